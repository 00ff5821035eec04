"""Continuous batching for the HF engine: sequences join a running decode at the next step.

Design decision: ``rollout.hf.generate`` decodes a fixed batch from prefill to its last token, so
a server built on it makes a request that arrives mid-call wait for the whole call. This decoder
keeps a *dynamic* set of rows instead: ``add`` prefills new prompts (one batched forward, each
row's first token sampled from its logits) and splices their keys/values into the running cache;
``step`` feeds every live row its last token (one forward for all rows, ``StaticDecoder.step``'s
math) and samples the next; a row that ends (EOS, a stop string, its own ``max_new_tokens``)
leaves at once. Rows are right-aligned in one preallocated K/V buffer — all of them write the
same column each step, and a row's columns before its prompt are masked padding — so joining
means copying the cache into a new buffer wide enough for everyone (a few times per request,
negligible next to the forwards), and leaving means dropping the row.

What a row samples is what ``generate`` samples: its tokens depend only on its prompt, its seed
(its own ``torch.Generator``, one uniform per token) and its sampling settings — rows with other
settings sample in their own ``_sample`` call over their rows of the same logits — and the
recorded log-prob is the same ``log_softmax(logits / T)`` of the sampled token as
``generate``'s. Padding changes only float summation order (as batched ``generate`` does).

Only models the static-cache path drives (``static_cache.unsupported_reason``: Llama-family, full
attention) decode this way; the server falls back to request-level batching for the others.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from groupflow.models.causal_lm import output_cache, token_positions
from groupflow.rollout.hf import SamplingParams, _sample, _stop_window, left_pad
from groupflow.rollout.static_cache import StaticDecoder, _kv, unsupported_reason

__all__ = ["ContinuousDecoder", "Finished", "continuous_reason"]


@dataclass(frozen=True)
class Finished:
    tag: Hashable  # the caller's name for the row (``add``'s ``tags``)
    ids: list[int]  # sampled ids, the EOS or stop string included
    logprobs: list[float]
    finish: str  # "stop" or "length"


@dataclass
class _Row:
    tag: Hashable
    params: SamplingParams
    generator: torch.Generator
    position: int  # the position of the token fed next
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def continuous_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot be decoded continuously (None: it can)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 4096
    return unsupported_reason(model, int(positions))


class ContinuousDecoder:
    """A dynamic batch of decoding rows (see the module docstring). Not thread-safe: one thread
    calls ``add`` and ``step``; both run in inference mode with the model in eval mode."""

    def __init__(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int], pad_id: int):
        reason = continuous_reason(model)
        if reason is not None:
            raise ValueError(f"continuous batching: {reason}")
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        self.eos = set(int(e) for e in eos_ids)
        self.rows: list[_Row] = []
        self.decoder: StaticDecoder | None = None  # its keys/values/key_pad are the live buffer
        self.col = 0  # the column every row writes next
        self.pending: torch.Tensor | None = None  # [B] each row's last sampled token (fed next)

    @property
    def active(self) -> int:
        return len(self.rows)

    # ----- joining ------------------------------------------------------------------------------
    def add(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
            seeds: Sequence[int],
            tags: Sequence[Hashable]) -> tuple[list[tuple[Hashable, int]], list[Finished]]:  # fmt: skip
        """Prefill ``prompts`` (one row each: repeat a prompt for several samples) and sample their
        first tokens; rows that are not finished by then join the batch. Returns ``(tag, token)``
        per row and the rows that ended, as ``step``."""
        if not (len(prompts) == len(params) == len(seeds) == len(tags)) or not prompts:
            raise ValueError("add: need one params, seed and tag per prompt (and a prompt)")
        if any(p.stop for p in params) and self.tokenizer is None:
            raise ValueError("add: stop strings need a tokenizer")
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=token_positions(mask),
                             use_cache=True, logits_to_keep=1)  # fmt: skip
            rows = [
                _Row(tag, p, torch.Generator().manual_seed(int(s)), len(prompt))
                for prompt, p, s, tag in zip(prompts, params, seeds, tags)
            ]  # fmt: skip
            tokens = self._sample(out.logits[:, -1], rows)
            progress = [(r.tag, t) for r, t in zip(rows, tokens.tolist())]
            finished, keep = self._advance(rows, tokens)
            if keep:
                index = torch.tensor(keep, device=device)
                self._join([rows[i] for i in keep], output_cache(out), mask, index,
                           tokens[index])  # fmt: skip
        return progress, finished

    def reset(self) -> list[Hashable]:
        """Drop every row (after an error left the batch in an unknown state); their tags."""
        tags = [r.tag for r in self.rows]
        self.rows, self.decoder, self.pending, self.col = [], None, None, 0
        return tags

    def _join(self, rows: list[_Row], cache, mask: torch.Tensor, index: torch.Tensor,
              tokens: torch.Tensor) -> None:  # fmt: skip
        """Splice the prefilled rows ``index`` of ``cache`` into a new right-aligned buffer."""
        width = mask.shape[1]
        old = self.decoder
        # the old rows' live columns: from the earliest real column of any of them to self.col
        start = self.col
        if old is not None and self.rows:
            real = ~old.key_pad[:, 0, 0, : self.col]  # [B, col]
            start = int(real.any(0).float().argmax()) if bool(real.any()) else self.col
        kept = self.col - start
        col = max(kept, width)
        left = [r.params.max_new_tokens - len(r.ids) for r in (*self.rows, *rows)]
        cap = col + max(left)
        n_old, n_new = len(self.rows), len(rows)
        layers = len(self.model.model.layers)
        keys, values = [], []
        for i in range(layers):
            k, v = _kv(cache, i)
            k, v = k.index_select(0, index), v.index_select(0, index)
            shape = (n_old + n_new, k.shape[1], cap, k.shape[3])
            # zeros, not empty: masked columns are multiplied by a 0 probability (NaN * 0 = NaN)
            k_buf, v_buf = k.new_zeros(shape), v.new_zeros(shape)
            if n_old:
                k_buf[:n_old, :, col - kept : col] = old.keys[i][:, :, start : self.col]
                v_buf[:n_old, :, col - kept : col] = old.values[i][:, :, start : self.col]
            k_buf[n_old:, :, col - width : col] = k
            v_buf[n_old:, :, col - width : col] = v
            keys.append(k_buf)
            values.append(v_buf)
        pad = torch.ones(n_old + n_new, cap, dtype=torch.bool, device=mask.device)
        if n_old:
            pad[:n_old, col - kept : col] = old.key_pad[:, 0, 0, start : self.col]
        pad[n_old:, col - width : col] = mask.index_select(0, index) == 0
        pad[:, col:] = False  # the columns the rows will write
        self.decoder = StaticDecoder(self.model, keys, values, pad[:, None, None, :], 0)
        self.col = col
        self.rows += rows
        self.pending = tokens if self.pending is None or not n_old else torch.cat(
            [self.pending, tokens])  # fmt: skip

    # ----- decoding -----------------------------------------------------------------------------
    def step(self) -> tuple[list[tuple[Hashable, int]], list[Finished]]:
        """One token for every row: returns ``(tag, token)`` per row and the rows that ended."""
        if not self.rows:
            return [], []
        positions = torch.tensor([r.position for r in self.rows], device=self.pending.device)
        with torch.inference_mode():
            logits = self.decoder.step(self.pending, positions, self.col)
            self.col += 1
            for r in self.rows:
                r.position += 1
            tokens = self._sample(logits, self.rows)
        rows = self.rows
        progress = [(r.tag, t) for r, t in zip(rows, tokens.tolist())]
        finished, keep = self._advance(rows, tokens)
        if len(keep) < len(rows):
            self._leave(keep, tokens)
        else:
            self.pending = tokens
        return progress, finished

    def drop(self, gone: Callable[[Hashable], bool]) -> int:
        """Remove the rows whose tag ``gone`` says nobody waits for; how many left."""
        keep = [i for i, r in enumerate(self.rows) if not gone(r.tag)]
        dropped = len(self.rows) - len(keep)
        if dropped:
            self._leave(keep, self.pending)
        return dropped

    def _leave(self, keep: list[int], tokens: torch.Tensor) -> None:
        if not keep:
            self.reset()
            return
        d = self.decoder
        index = torch.tensor(keep, device=tokens.device)
        d.keys = [k.index_select(0, index) for k in d.keys]
        d.values = [v.index_select(0, index) for v in d.values]
        d.key_pad = d.key_pad.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]
        self.pending = tokens.index_select(0, index)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Each row's token from its logits and settings; rows sampling alike share a call."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(_sampling(r.params), []).append(i)
        if len(groups) == 1:
            tokens, logp = _sample(logits, rows[0].params, [r.generator for r in rows])
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            logp = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
            for params, idx in groups.items():
                at = torch.tensor(idx, device=logits.device)
                t, lp = _sample(
                    logits.index_select(0, at), params, [rows[i].generator for i in idx]
                )
                tokens[at], logp[at] = t, lp.float()
        for r, lp in zip(rows, logp.tolist()):
            r.logprobs.append(lp)
        return tokens

    def _advance(self, rows: list[_Row], tokens: torch.Tensor) -> tuple[list[Finished], list[int]]:
        """Append each row's token; the rows that ended, and the indices of the others."""
        finished, keep = [], []
        for i, (r, t) in enumerate(zip(rows, tokens.tolist())):
            r.ids.append(t)
            stop = t in self.eos or (bool(r.params.stop) and self._hits_stop(r))
            if stop or len(r.ids) >= r.params.max_new_tokens:
                finished.append(Finished(r.tag, r.ids, r.logprobs, "stop" if stop else "length"))
            else:
                keep.append(i)
        return finished, keep

    def _hits_stop(self, r: _Row) -> bool:
        """``generate``'s rule: a stop string in the decoded last few tokens."""
        window = r.ids[-_stop_window(r.params.stop) :]
        text = self.tokenizer.decode(window, skip_special_tokens=True)
        return any(s in text for s in r.params.stop)


def _sampling(p: SamplingParams) -> SamplingParams:
    """The settings ``_sample`` reads (rows differing elsewhere share a sampling call)."""
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
