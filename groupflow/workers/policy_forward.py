"""The actor's FSDP root: a module whose forward is the response log-probs of a batch.

Design decision: FSDP2 gathers a root's own parameters (embeddings, final norm, LM head) around
the root's ``forward``; making that forward the whole chunked log-prob computation — padded,
packed (``actor.packing``) or split over a Ulysses group (``parallel.sequence_parallel``) — gathers
them once per call, and keeps every rank making the same decoder calls, which FSDP2's collectives
need: whether the prompt pass is shared, or image rows take one pass, is agreed over ranks here.
The worker (``workers.actor``) only chooses which root to call (policy or reference).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from groupflow.distributed.parallel import all_reduce
from groupflow.distributed.ulysses import SequenceGroup
from groupflow.models.causal_lm import observation_images, prompt_sharing_applies
from groupflow.models.logprobs import response_logprobs
from groupflow.models.packing import packed_logprobs
from groupflow.models.sequence_parallel import sequence_parallel_logprobs
from groupflow.workers.update import check_no_images, check_text_only

__all__ = ["PolicyForward", "meta_template"]


def meta_template(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory); buffers (rotary
    frequencies, not in the state dict) are real copies. Tied parameters stay tied."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


class PolicyForward(nn.Module):
    """The FSDP root: its forward computes response log-probs, so root-level parameters (embeddings,
    final norm, LM head) are gathered by FSDP2's hooks around the whole chunked computation."""

    def __init__(
        self,
        lm: nn.Module,
        share_prompt_prefix: bool = True,
        sharded: bool = False,
        sp: SequenceGroup | None = None,
        packing: bool = False,
    ):
        super().__init__()
        self.lm = lm
        self.share_prompt_prefix = share_prompt_prefix
        self.sharded = sharded
        self.sp = sp  # Ulysses: this rank's sequence-parallel group (None: off)
        self.packing = packing  # actor.packing: one padding-free row per call (models.packing)

    def forward(
        self,
        prompt_ids,
        prompt_mask,
        responses,
        response_mask,
        temperature,
        chunk_tokens,
        with_entropy,
        entropy_grad=True,
        vision=None,
    ):
        if self.packing:  # one decoder call whatever the rows: FSDP ranks stay in step
            check_no_images(vision)
            return packed_logprobs(
                self.lm, prompt_ids, prompt_mask, responses, response_mask,
                temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )  # fmt: skip
        if self.sp is not None:  # one pass over whole rows, 1/N of each on this rank
            check_text_only(vision)
            return sequence_parallel_logprobs(
                self.lm, prompt_ids, prompt_mask, responses, response_mask, self.sp,
                temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                entropy_grad=entropy_grad,
            )  # fmt: skip
        share: bool | str = self.share_prompt_prefix
        whole = None
        if vision is not None:  # image rows take one pass on every rank (models/vision.py)
            share = False
            if self.sharded:  # the same calls on every rank: one pass over whole rows if any
                # rank's rows show observation images (multi-turn), else prompt then response
                shows = observation_images(self.lm, responses, response_mask)
                whole = bool(all_reduce(int(shows), op="max"))
        if share and self.sharded:
            # FSDP2 gathers each layer once per call: every rank must make the same decoder calls,
            # so the ranks share the prompt pass only if it applies on all of them.
            applies = prompt_sharing_applies(self.lm, prompt_ids, prompt_mask, responses)
            share = "always" if all_reduce(int(applies), op="min") else False
        return response_logprobs(
            self.lm, prompt_ids, prompt_mask, responses, response_mask,
            temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
            share_prompt=share, entropy_grad=entropy_grad, vision=vision, whole_sequence=whole,
        )  # fmt: skip
