"""The rollout-engine interface: token ids in, sampled token ids and their log-probs out.

Design decision: a worker that generates holds one ``RolloutEngine`` and never asks which one it
is. An engine is built from plain, picklable options (``HFOptions`` here, ``VLLMOptions`` in
``groupflow.rollout.engines.vllm_engine``; ``rollout.engine`` picks them in ``groupflow.assembly.engines``), each options
class knowing how to build its engine inside the worker's process — so a third engine is one
options class and one engine class, and nothing checks ``engine is None``.

``separate_weights`` says whether the engine keeps weights of its own (vLLM: its own copy,
refreshed through ``load_weights`` after every update) or decodes with a model the worker already
holds and keeps current itself (the HF engine: the training model, or the worker's unsharded
copy). ``pause``/``resume`` release and take back what the engine holds between rollouts where it
can (vLLM's sleep mode on a GPU); elsewhere they do nothing. ``local_model`` is the one
question a caller may ask: the torch model the engine decodes with in this process, if any (the
server's continuous batcher and its scoring decode over it; an engine that decodes elsewhere, as
vLLM does, answers None) — so no caller tests which class an engine is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from groupflow.rollout.engines.hf import GenerationOutput, SamplingParams, generate

__all__ = ["RolloutEngine", "LocalModel", "HFOptions", "HFEngine", "HF"]


@dataclass(frozen=True)
class LocalModel:
    """The torch model an engine decodes with in this process, with what decoding over it needs."""

    model: nn.Module
    tokenizer: object
    eos_ids: list[int]
    pad_id: int


class RolloutEngine(Protocol):
    name: str
    separate_weights: bool  # True: load_weights after every update; False: shares a model
    version: int  # the policy version of the weights it generates with (-1: the initial ones)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Sequence[int], vision: Sequence | None = None) -> GenerationOutput:  # fmt: skip
        """``params.n`` samples per prompt (sample j of prompt i at i*n + j), one seed each;
        ``vision``: each prompt's ``models.vision.VisionInputs`` or None (images, if any)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     version: int = -1) -> float:  # fmt: skip
        """Replace the weights (HF names, full tensors) with ``version``'s; returns seconds."""
        ...

    def local_model(self) -> LocalModel | None:
        """The model it decodes with in this process, or None (it decodes with its own copy)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


class HFEngine:
    """groupflow's own decode loop (``groupflow.rollout.engines.hf``) over a model the worker holds."""

    name = "hf"
    separate_weights = False

    def __init__(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int], pad_id: int):
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids, self.pad_id = list(eos_ids), pad_id
        self.version = -1
        # set by a worker whose model is sharded across ranks: they decode in lockstep
        # (``rollout.hf.generate``'s ``lockstep``; ``distributed.parallel.agree``)
        self.lockstep: Callable[[bool, str], bool] | None = None
        # set by the asynchronous rollout side for rollout.async_mode=in_flight: called between
        # decode steps, it answers (the version to decode with, its weights when they are newer
        # than what the model holds, else None) — ``groupflow.rollout.side.serve``
        self.updates: Callable[[], tuple[int, dict | None]] | None = None

    def generate(self, prompts, params: SamplingParams, *, seeds, vision=None) -> GenerationOutput:
        return generate(
            self.model, prompts, params, seeds=seeds, pad_id=self.pad_id, eos_ids=self.eos_ids,
            tokenizer=self.tokenizer, vision=vision, lockstep=self.lockstep,
            between=self.take_update if self.updates is not None else None,
        )  # fmt: skip

    def take_update(self) -> int:
        """In-flight weight updates: load a newer version in place (the KV cache is kept); the
        version the next forward computes with. Also the server's continuous decoder's hook
        (``serve.batcher.group_batcher``)."""
        assert self.updates is not None
        version, weights = self.updates()
        if weights is not None:
            self.model.load_state_dict(weights)
        self.version = version
        return version

    def load_weights(self, weights, version: int = -1) -> float:
        """The shared model: load into it (a worker whose model is not the engine's own, e.g. a
        snapshot worker given a published version, calls this)."""
        start = time.perf_counter()
        self.model.load_state_dict(dict(weights))
        self.version = version
        return time.perf_counter() - start

    def local_model(self) -> LocalModel:
        return LocalModel(self.model, self.tokenizer, self.eos_ids, self.pad_id)

    def pause(self) -> None:
        """Nothing to release: the model is the worker's."""

    def resume(self) -> None:
        """Nothing to take back."""

    def close(self) -> None:
        """Nothing of its own to free."""


@dataclass(frozen=True)
class HFOptions:
    """``rollout.engine: hf`` (no options of its own)."""

    def build(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int],
              pad_id: int) -> HFEngine:  # fmt: skip
        return HFEngine(model, tokenizer, eos_ids=eos_ids, pad_id=pad_id)


HF = HFOptions()  # the default engine of every generating worker
