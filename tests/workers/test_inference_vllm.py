"""A rollout worker with the vLLM engine fed through a weight transport (runs in .venv-vllm).

What a Ray rollout pool's worker does with every version, in this process: the filesystem
transport's buckets land in the worker's torch model, and vLLM loads them from there — the engine
then generates exactly what the HF engine generates with the sent weights. A corrupted bucket is a
clear error and the engine keeps the version it had. A version whose ticket the pool's board
answers between two engine steps (rollout.async_mode=in_flight) reaches vLLM the same way, while
the requests run.
"""

import copy
import os

import pytest
import torch

from groupflow.rollout.engines.vllm_engine import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(),
    reason="vLLM is not installed here; runs in .venv-vllm (bash scripts/setup_vllm.sh)",
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is first imported


def _sharpen(model, seed):
    """Weights large enough that greedy decoding has no near-ties (as tests/rollout/engines/test_vllm.py)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in name else 0.08))


def test_a_transported_version_reaches_the_vllm_engine(tmp_path):
    from groupflow.config import ActorConfig
    from groupflow.data import train_char_tokenizer
    from groupflow.distributed.transport import FileTransport, TransferError
    from groupflow.models.causal_lm import build_tiny_llama
    from groupflow.rollout.engines.hf import SamplingParams, generate
    from groupflow.rollout.engines.vllm_engine import VLLMOptions
    from groupflow.workers.inference import InferenceWorker

    torch.set_num_threads(1)
    tok = train_char_tokenizer("0123456789=+")
    model = build_tiny_llama(
        len(tok), hidden_size=128, num_layers=2, num_heads=2, max_positions=64, seed=5,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    ).eval()  # fmt: skip
    _sharpen(model, seed=0)
    trained = copy.deepcopy(model)
    _sharpen(trained, seed=1)  # the actor's newer weights
    worker = InferenceWorker(
        model, tok, ActorConfig(), pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
        role="rollout",
        engine=VLLMOptions(dtype="float32", seed=0, cpu_kv_cache_gib=1, in_flight=True),
    )  # fmt: skip
    prompts = [tok(t)["input_ids"] for t in ("12345=", "907=", "4411235=")]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    seeds = [0] * len(prompts)

    def hf(m):
        return generate(m, prompts, greedy, seeds=seeds, pad_id=tok.pad_token_id,
                        eos_ids=[tok.eos_token_id], tokenizer=tok)  # fmt: skip

    before = worker.engine.generate(prompts, greedy, seeds=seeds)
    assert worker.engine_state() == ("vllm", -1)
    transport = FileTransport(str(tmp_path), bucket_bytes=16 << 10)  # many buckets
    ticket = transport.send(3, trained.state_dict())
    worker.receive_weights(ticket, transport)
    assert worker.engine_state() == ("vllm", 3)
    after, expected = worker.engine.generate(prompts, greedy, seeds=seeds), hf(trained)
    n = after.responses.shape[1]
    assert torch.equal(after.response_mask, expected.response_mask[:, :n])
    assert torch.equal(after.responses * after.response_mask,
                       expected.responses[:, :n] * expected.response_mask[:, :n])  # fmt: skip
    assert not torch.equal(before.responses, after.responses)  # the new weights decode differently
    # a corrupted bucket of version 4: an error naming role, rank, version; vLLM keeps version 3
    ticket = transport.send(4, model.state_dict())
    bucket = tmp_path / "v4" / "bucket_1.safetensors"
    from safetensors.torch import load_file, save_file

    data = load_file(str(bucket))
    data["bucket"][0] ^= 0xFF
    save_file(data, str(bucket), metadata={"version": "4", "crc32": "0"})
    with pytest.raises(TransferError, match="rollout role, rank 0, policy version 4: bucket 1"):
        worker.receive_weights(ticket, transport)
    assert worker.engine_state() == ("vllm", 3)
    again = worker.engine.generate(prompts, greedy, seeds=seeds)
    assert torch.equal(again.responses, after.responses)
    # in flight (a Ray pool's route, the board pinned): version 7's ticket is answered before the
    # engine step that samples token 3; it lands in the torch model and vLLM reloads from there
    from tests.rollout.engines.test_hf import (
        check_logprobs_switch_at_token_3,
        check_switch_at_token_3,
    )

    worker.receive_weights(transport.send(6, trained.state_dict()), transport)
    new = copy.deepcopy(trained)
    with torch.no_grad():  # the final norm only: the KV blocks kept are the new version's too
        new.model.norm.weight.mul_(torch.linspace(0.2, 3.0, new.model.norm.weight.numel()))
    ticket = transport.send(7, new.state_dict())
    params, seeds = SamplingParams(max_new_tokens=10, n=2), list(range(40, 46))
    alone = worker.engine.generate(prompts, params, seeds=seeds)
    asked = []

    def board(held):
        asked.append(held)
        return (7, ticket) if len(asked) == 4 else (held, None)

    worker.take_updates_in_flight(board, transport)
    out = worker.engine.generate(prompts, params, seeds=seeds)
    check_switch_at_token_3(out, alone, asked)
    assert worker.engine_state() == ("vllm", 7) and asked[:4] == [6] * 4
    check_logprobs_switch_at_token_3(out, trained, new, atol=1e-3)  # vLLM's fp32 kernels
