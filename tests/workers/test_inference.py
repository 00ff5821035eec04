"""The inference worker's in-flight updates from weight-transport tickets: the route of a Ray rollout
pool's workers (``groupflow.rollout.ray_host``), here without Ray — the board's answers
(``BoardUpdates``) are given by a pinned callable, the ticket is a real filesystem transport's."""

import copy

import torch

from groupflow.distributed.transport import FileTransport
from groupflow.models.causal_lm import build_tiny_llama
from groupflow.rollout.engines.hf import SamplingParams, generate
from groupflow.workers.inference import InferenceWorker
from tests.rollout.engines.test_hf import check_logprobs_switch_at_token_3, check_switch_at_token_3

PAD, EOS = 0, 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


class Tok:
    pad_token_id = PAD


def _models():
    old = build_tiny_llama(24, hidden_size=32, num_layers=2, num_heads=4, seed=3,
                           pad_token_id=PAD, eos_token_id=EOS).eval()  # fmt: skip
    new = copy.deepcopy(old)
    with torch.no_grad():  # the final norm only: the KV cache kept is the new version's too
        new.model.norm.weight.mul_(torch.linspace(0.2, 3.0, new.model.norm.weight.numel()))
    return old, new


class Refusing:
    """A transport whose fetches must not happen."""

    name = "refusing"

    def receive(self, ticket, *, role="rollout", rank=0):
        raise AssertionError(f"fetched version {ticket['version']} a second time")


def test_a_ticket_answered_between_decode_steps_is_fetched_into_the_model_mid_batch(tmp_path):
    """A worker holds version 6; the board answers version 7's ticket before the forward of
    token 3 (and keeps answering it: no longer newer, it is not fetched again). Tokens 0-2 are
    the old model's own, the rest have the new model's teacher-forced log-probs, token_versions
    says which; the worker's model now holds version 7, and the batch that next receives version
    7 the usual way (``receive_weights``) does not fetch it again."""
    old, new = _models()
    transport = FileTransport(root=str(tmp_path))
    ticket = transport.send(7, new.state_dict())
    worker = InferenceWorker(copy.deepcopy(old), Tok(), None, pad_id=PAD, eos_ids=[EOS],
                             role="rollout")  # fmt: skip
    worker.engine.version = 6  # as a batch's receive_weights of version 6 leaves it
    asked = []

    def board(held: int):
        asked.append(held)
        return (7, ticket) if len(asked) >= 4 else (held, None)

    worker.take_updates_in_flight(board, transport)
    params = SamplingParams(max_new_tokens=10, n=2)
    seeds = list(range(40, 46))
    out = worker.engine.generate(PROMPTS, params, seeds=seeds)
    alone = generate(old, PROMPTS, params, seeds=seeds, pad_id=PAD, eos_ids=[EOS])
    check_switch_at_token_3(out, alone, asked)
    assert asked[:4] == [6, 6, 6, 6] and set(asked[4:]) == {7}  # asked with what it held
    check_logprobs_switch_at_token_3(out, old, new)
    for name, t in new.state_dict().items():
        assert torch.equal(worker.model.state_dict()[name], t), name
    assert worker.engine.version == 7
    assert worker.receive_weights(ticket, Refusing()) == 0  # held already: nothing moves
    assert worker.engine.version == 7
    nbytes = sum(t.numel() * t.element_size() for t in new.state_dict().values())
    assert worker.receive_weights(transport.send(8, old.state_dict()), transport) == nbytes
    assert worker.engine.version == 8


def test_a_version_not_newer_than_the_held_one_is_not_fetched(tmp_path):
    """An answer can be overtaken: a batch's own receive_weights loaded version 8 while the
    question (asked holding 6) waited. The worker drops its answer, version 7, unfetched."""
    old, new = _models()
    worker = InferenceWorker(copy.deepcopy(old), Tok(), None, pad_id=PAD, eos_ids=[EOS],
                             role="rollout")  # fmt: skip
    worker.engine.version = 8
    worker.take_updates_in_flight(lambda held: (7, {"version": 7}), Refusing())
    out = worker.engine.generate(PROMPTS, SamplingParams(max_new_tokens=4), seeds=[1, 2, 3])
    assert set(out.token_versions[out.response_mask.bool()].tolist()) == {8}
    ref = generate(old, PROMPTS, SamplingParams(max_new_tokens=4), seeds=[1, 2, 3], pad_id=PAD,
                   eos_ids=[EOS])  # fmt: skip
    assert torch.equal(out.responses, ref.responses)  # the old weights all along
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-6, rtol=0)
