"""Token log-probs of given sequences, with the likeliest alternatives: ``echo`` and top log-probs.

Design decision: the decode loops record one number per sampled token (its sampling log-prob)
and nothing else, and they stay that way — the hot path of every request. What evaluation
harnesses ask beyond it (lm-evaluation-harness's multiple choice: the log-probs of the prompt's
own tokens, ``echo: true`` with ``logprobs``; any client's top-k alternatives) is one teacher-
forced forward over the sequence after the fact, here: the decoder's hidden states once, then
the LM head (and the model's own final transform, ``models.logit_transform``) over a bounded
number of positions at a time, so a 49k vocabulary never materialises ``[L, V]`` logits for a
long prompt. A prompt token's log-prob is the model's plain distribution (temperature 1, as
vLLM's and OpenAI's prompt log-probs); a sampled token's is at its request's temperature, the
number the sampler recorded for it (up to float rounding: another batch shape) — and a token's
alternatives come from the very tensor its own log-prob was read from, so "was it the argmax"
compares equal numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from groupflow.models.causal_lm import decoder_hidden_states
from groupflow.models.logit_transform import lm_logits
from groupflow.rollout.engines.hf import left_pad

__all__ = ["ScoreJob", "TokenScores", "ScoreFn", "score_sequences", "model_scorer"]

_CHUNK_POSITIONS = 1024  # positions per LM-head call: 1024 × 49k fp32 logits is 200 MB
_BATCH_TOKENS = 8192  # padded tokens per decoder pass


@dataclass(frozen=True)
class ScoreJob:
    ids: list[int]  # the whole sequence (prompt, then any sampled tokens)
    start: int  # ids[start:] were sampled at ``temperature``; ids[1:start] are prompt tokens
    temperature: float = 1.0  # of the sampled part (0, greedy, scores at 1 as the sampler does)
    first: int = 1  # score ids[first:] (1: every token something predicts; start: the sampled)

    def __post_init__(self):
        if not 1 <= self.first <= len(self.ids):
            raise ValueError(f"ScoreJob: first={self.first} for {len(self.ids)} ids")


@dataclass(frozen=True)
class TokenScores:
    logprobs: list[float]  # of ids[first:], each given the ids before it
    top: list[list[tuple[int, float]]]  # per scored token, the k likeliest (id, log-prob)


# (jobs, k) -> one TokenScores per job; runs on the engine's thread
ScoreFn = Callable[[Sequence[ScoreJob], int], list[TokenScores]]


def _temperatures(jobs: Sequence[ScoreJob]) -> torch.Tensor:
    """The temperature of every scored token, rows concatenated: 1 for a prompt token."""
    out = []
    for job in jobs:
        t = job.temperature if job.temperature > 0 else 1.0
        out += [1.0 if p < job.start else t for p in range(job.first, len(job.ids))]
    return torch.tensor(out, dtype=torch.float32)


@torch.inference_mode()
def _score_batch(model: nn.Module, jobs: Sequence[ScoreJob], k: int, pad_id: int):
    ids, mask = left_pad([j.ids for j in jobs], pad_id)
    device = next(model.parameters()).device
    hidden = decoder_hidden_states(model, ids.to(device), mask.to(device))  # [B, L, H]
    width = ids.shape[1]
    lengths = [len(j.ids) - j.first for j in jobs]
    # row r's state at column width - len(ids) + p - 1 predicts its ids[p]
    states = torch.cat([
        hidden[r, width - len(j.ids) + j.first - 1 : width - 1] for r, j in enumerate(jobs)
    ])  # fmt: skip
    targets = torch.tensor([t for j in jobs for t in j.ids[j.first :]], device=device)
    temps = _temperatures(jobs).to(device)
    lps, top_lps, top_ids = [], [], []
    for s in range(0, states.shape[0], _CHUNK_POSITIONS):
        logits = lm_logits(model, states[s : s + _CHUNK_POSITIONS]).float()
        logits = logits / temps[s : s + _CHUNK_POSITIONS, None]
        logp = torch.log_softmax(logits, dim=-1)
        lps.append(logp.gather(-1, targets[s : s + _CHUNK_POSITIONS, None]).squeeze(-1))
        if k:
            values, index = logp.topk(min(k, logp.shape[-1]), dim=-1)
            top_lps.append(values)
            top_ids.append(index)
    lp = torch.cat(lps).tolist()
    tv = torch.cat(top_lps).tolist() if k else [[] for _ in lp]
    ti = torch.cat(top_ids).tolist() if k else [[] for _ in lp]
    out, at = [], 0
    for n in lengths:
        top = [list(zip(ti[p], tv[p])) for p in range(at, at + n)]
        out.append(TokenScores(lp[at : at + n], top))
        at += n
    return out


def score_sequences(model: nn.Module, jobs: Sequence[ScoreJob], k: int,
                    pad_id: int) -> list[TokenScores]:  # fmt: skip
    """Each job's token log-probs and its ``k`` likeliest alternatives per position (module
    docstring); sequences are batched up to ``_BATCH_TOKENS`` padded tokens per forward."""
    out: list[TokenScores | None] = [None] * len(jobs)
    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i].ids))  # alike lengths together
    batch: list[int] = []
    for i in [*order, None]:
        if batch and (i is None or len(jobs[i].ids) * (len(batch) + 1) > _BATCH_TOKENS):
            scored = [j for j in batch if jobs[j].first < len(jobs[j].ids)]
            if scored:
                for j, s in zip(scored, _score_batch(model, [jobs[j] for j in scored], k, pad_id)):
                    out[j] = s
            for j in batch:
                if out[j] is None:  # nothing to score (e.g. no token sampled)
                    out[j] = TokenScores([], [])
            batch = []
        if i is not None:
            batch.append(i)
    scored = [s for s in out if s is not None]
    assert len(scored) == len(out), "every job is scored above"
    return scored


def model_scorer(model: nn.Module, pad_id: int) -> ScoreFn:
    """``score_sequences`` over ``model`` with the model in eval mode for the call (a training
    run's model goes back to the mode it was in)."""

    def score(jobs: Sequence[ScoreJob], k: int) -> list[TokenScores]:
        was_training = model.training
        model.eval()
        try:
            return score_sequences(model, jobs, k, pad_id)
        finally:
            model.train(was_training)

    return score
