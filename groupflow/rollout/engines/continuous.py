"""Continuous batching for the HF engine: sequences join a running decode at the next step.

Design decision: ``rollout.hf.generate`` decodes a fixed batch from prefill to its last token, so
a server built on it makes a request that arrives mid-call wait for the whole call. This decoder
keeps a *dynamic* set of rows instead: ``add`` prefills new prompts (one batched forward, each
row's first token sampled from its logits) and splices their keys/values into the running cache;
``step`` feeds every live row its last token (one forward for all rows, ``StaticDecoder.step``'s
math) and samples the next; a row that ends (EOS, a stop string, its own ``max_new_tokens``)
leaves at once. The K/V buffer is preallocated in row slots: the live rows hold slots
``[0, B)`` (so a step reads a view of the buffer, never a copy), each at its own column (its
prefill's width plus the tokens it has fed; the prefill's left padding and every column not
yet written are masked). Joining writes only the new rows, into the next free slots; a leaving
row frees its slot, and the live rows above the new count move down into the freed ones (only
theirs are copied). Nothing else moves: the running cache is never copied into a wider buffer
on a join, as it was — a copy of every live row per join. The buffer grows only when a join
needs more slots (doubled, up to ``max_rows``, the batcher's ``max_batch_samples``; beyond it
as needed) or columns; allocating every slot up front for a 135M model's 1k-token context
would hold gigabytes on a laptop for a server that sees a few conversations.

What a row samples is what ``generate`` samples: its tokens depend only on its prompt, its seed
(its own ``torch.Generator``, one uniform per token) and its sampling settings — rows with other
settings sample in their own ``_sample`` call over their rows of the same logits — and the
recorded log-prob is the same ``log_softmax(logits / T)`` of the sampled token as
``generate``'s. Padding changes only float summation order (as batched ``generate`` does).

Prefix cache: an agent's next call re-sends its whole conversation — the previous call's prompt and
completion, then the new turn — so by default a finished row's keys/values are kept (copied out of
its slot, up to ``prefix_tokens`` tokens in all, least recently used dropped first) under the ids
they encode, and a prompt that extends kept ids prefills only the rest (one forward over the kept
keys/values, as vLLM's and SGLang's prefix caches do). Kept keys/values are only valid for the
weights that computed them: each row notes the parameters' identity, storage and version
counters when it joins (an optimizer step, ``load_state_dict`` or a cast changes them), a row is
kept only if they did not change while it decoded, and a change drops everything kept. A
continued prompt's numbers differ from a full prefill's only in float summation order.

Only models the static-cache path drives (``static_cache.unsupported_reason``: Llama-family, full
attention) decode this way; the server falls back to request-level batching for the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from groupflow.models.causal_lm import cache_kwarg, output_cache, token_positions
from groupflow.rollout.engines.hf import SamplingParams, _sample, _stop_window, left_pad
from groupflow.rollout.engines.static_cache import StaticDecoder, _kv, _layers, unsupported_reason

__all__ = ["ContinuousDecoder", "Finished", "continuous_reason", "weights_key"]


@dataclass(frozen=True)
class Finished:
    tag: Hashable  # the caller's name for the row (``add``'s ``tags``)
    ids: list[int]  # sampled ids, the EOS or stop string included
    logprobs: list[float]
    finish: str  # "stop" or "length"
    versions: list[int] | None = None  # in-flight updates: the version that sampled each id


@dataclass
class _Row:
    tag: Hashable
    params: SamplingParams
    generator: torch.Generator
    position: int  # the position of the token fed next
    col: int  # the buffer column its key/value go to next
    prompt: Sequence[int] = ()
    weights: tuple = ()  # the model's weights_key when it joined
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Kept:
    """A finished row's keys/values, per layer [H_kv, n, D], for the ``n`` tokens ``ids``."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def weights_key(model: nn.Module) -> tuple:
    """Changes whenever a parameter is written in place (its version counter), replaced, moved
    or cast (its storage; ``module.to`` swaps ``.data`` without a version bump): what kept
    keys/values were computed with."""
    return tuple((id(p), p.data_ptr(), p._version) for p in model.parameters())


def continuous_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot be decoded continuously (None: it can)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 4096
    return unsupported_reason(model, int(positions))


class ContinuousDecoder:
    """A dynamic batch of decoding rows (see the module docstring). Not thread-safe: one thread
    calls ``add`` and ``step``; both run in inference mode with the model in eval mode.

    ``max_rows``: the row slots the buffer grows to before it needs more (the batcher's
    ``max_batch_samples``); ``release`` frees the buffer (an idle server). ``prefix_tokens``:
    the tokens of finished rows' keys/values kept for prompts that extend them (0: none)."""

    def __init__(self, model: nn.Module, tokenizer, *, eos_ids: Sequence[int], pad_id: int,
                 max_rows: int = 64, prefix_tokens: int = 16384):  # fmt: skip
        reason = continuous_reason(model)
        if reason is not None:
            raise ValueError(f"continuous batching: {reason}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        if prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be at least 0, got {prefix_tokens}")
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        self.eos = set(int(e) for e in eos_ids)
        self.max_rows = max_rows
        self.rows: list[_Row] = []  # row i lives in slot i
        # per layer [slots, H_kv, width, D], and [slots, width] True where a key is not attended
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_pad: torch.Tensor | None = None
        # columns [0, written) of the buffer may hold keys; a live row's columns from its own
        # col on are zeros (a masked column still meets its value as 0 * value: NaN * 0 = NaN,
        # so a key a finished row left behind must not linger where the next one attends)
        self.written = 0
        self.decoder: StaticDecoder | None = None  # over the live rows' views of the buffer
        self.pending: torch.Tensor | None = None  # [B] each row's last sampled token (fed next)
        self.prefix_tokens = prefix_tokens
        self.kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self.kept_tokens = 0
        self.kept_weights: tuple = ()  # the weights_key the kept keys/values belong to
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to the prefix cache
        # in-flight updates: the policy version of the model's weights, recorded per token
        self.version: int | None = None

    @property
    def active(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        """Rows the buffer holds (live or free)."""
        return 0 if self.key_pad is None else self.key_pad.shape[0]

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
        weights = self._check_weights()
        hits = [self._longest_kept(p) for p in prompts]
        with torch.inference_mode():
            if any(hits):
                out, mask = self._prefill_after(prompts, hits, device)
            else:
                ids, mask = left_pad(prompts, self.pad_id)
                ids, mask = ids.to(device), mask.to(device)
                out = self.model(input_ids=ids, attention_mask=mask,
                                 position_ids=token_positions(mask), use_cache=True,
                                 logits_to_keep=1)  # fmt: skip
            width = mask.shape[1]
            rows = [
                _Row(tag, p, torch.Generator().manual_seed(int(s)), len(prompt), width, prompt,
                     weights)  # fmt: skip
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

    # ----- the prefix cache -----------------------------------------------------------------------
    def _check_weights(self) -> tuple:
        """The model's ``weights_key``; kept keys/values of other weights are dropped."""
        key = weights_key(self.model) if self.prefix_tokens else ()
        if key != self.kept_weights:
            self.kept.clear()
            self.kept_tokens, self.kept_weights = 0, key
        return key

    def _longest_kept(self, prompt: Sequence[int]) -> _Kept | None:
        """The kept entry whose ids are the longest proper prefix of ``prompt`` (at least one
        token must be left to prefill: its logits give the first new token)."""
        best = None
        for name, kept in self.kept.items():
            n = len(kept.ids)
            if n < len(prompt) and (best is None or n > len(best[1].ids)):
                if prompt[n - 1] == kept.ids[-1] and list(prompt[:n]) == kept.ids:
                    best = (name, kept)
        if best is None:
            return None
        self.kept.move_to_end(best[0])
        return best[1]

    def _prefill_after(self, prompts, hits: list[_Kept | None], device):
        """Prefill each prompt's ids after its kept prefix (a row without one: all of them),
        over the kept keys/values; the forward's output and the mask of its cache's columns
        (the prefixes left-padded to the longest, then the rest left-padded likewise)."""
        done = [0 if h is None else len(h.ids) for h in hits]
        width = max(done)
        cache = DynamicCache()
        for i in range(len(_layers(self.model))):
            k, v = next((h.keys[i], h.values[i]) for h in hits if h is not None)
            shape = (len(prompts), k.shape[0], width, k.shape[2])
            keys, values = k.new_zeros(shape), v.new_zeros(shape)
            for r, h in enumerate(hits):
                if h is not None:
                    keys[r, :, width - done[r] :] = h.keys[i]
                    values[r, :, width - done[r] :] = h.values[i]
            cache.update(keys, values, i)
        rest, rest_mask = left_pad([p[n:] for p, n in zip(prompts, done)], self.pad_id)
        before = torch.arange(width)[None, :] >= width - torch.tensor(done)[:, None]
        mask = torch.cat([before.long(), rest_mask], dim=1).to(device)
        rest_mask = rest_mask.to(device)
        positions = torch.tensor(done, device=device)[:, None] + token_positions(rest_mask)
        self.reused_tokens += sum(done)
        out = self.model(input_ids=rest.to(device), attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1,
                         **{cache_kwarg(self.model): cache})  # fmt: skip
        return out, mask

    def _keep(self, slot: int, row: _Row) -> None:
        """Copy finished row ``slot``'s keys/values out of the buffer, dropping the least
        recently used entries beyond ``prefix_tokens``."""
        fed = [*row.prompt, *row.ids[:-1]]  # the last sampled token was never fed
        if len(fed) > self.prefix_tokens:
            return
        assert self.key_pad is not None, "a finished row's slot is in the buffer"
        cols = (~self.key_pad[slot, : row.col]).nonzero().squeeze(-1)
        if len(cols) != len(fed):  # the columns a row attends are exactly its fed tokens
            raise RuntimeError(f"prefix cache: {len(cols)} columns for {len(fed)} fed tokens")
        kept = _Kept(fed, [k[slot].index_select(1, cols) for k in self.keys],
                     [v[slot].index_select(1, cols) for v in self.values])  # fmt: skip
        self.kept[id(kept)] = kept
        self.kept_tokens += len(fed)
        while self.kept_tokens > self.prefix_tokens:
            _, old = self.kept.popitem(last=False)
            self.kept_tokens -= len(old.ids)

    def reset(self) -> list[Hashable]:
        """Drop every row (after an error left the batch in an unknown state); their tags. The
        buffer stays (``release`` frees it)."""
        tags = [r.tag for r in self.rows]
        self.rows, self.decoder, self.pending = [], None, None
        return tags

    def release(self) -> None:
        """Free the buffer and the kept prefixes (no rows may be live); the next ``add``
        allocates a new one."""
        if self.rows:
            raise RuntimeError(f"release: {len(self.rows)} rows are decoding")
        self.keys, self.values, self.key_pad, self.written = [], [], None, 0
        self.kept.clear()
        self.kept_tokens = 0

    def _join(self, rows: list[_Row], cache, mask: torch.Tensor, index: torch.Tensor,
              tokens: torch.Tensor) -> None:  # fmt: skip
        """Write the prefilled rows ``index`` of ``cache`` into the free slots after the live
        rows, columns ``[0, width)`` (each row's left padding masked): nothing else moves."""
        width = mask.shape[1]
        n_old, n_new = len(self.rows), len(rows)
        need = width + max(r.params.max_new_tokens for r in rows)
        self._reserve(n_old + n_new, need, cache)
        assert self.key_pad is not None, "_reserve allocated the buffer"
        new = slice(n_old, n_old + n_new)
        for i in range(len(self.keys)):
            k, v = _kv(cache, i)
            self.keys[i][new, :, :width] = k.index_select(0, index)
            self.values[i][new, :, :width] = v.index_select(0, index)
            if self.written > width:  # what the slots' earlier rows left there
                self.keys[i][new, :, width : self.written] = 0
                self.values[i][new, :, width : self.written] = 0
        self.written = max(self.written, width)
        self.key_pad[new, :width] = mask.index_select(0, index) == 0
        self.key_pad[new, width:] = True  # until the row writes there
        self.rows += rows
        self.pending = tokens if self.pending is None or not n_old else torch.cat(
            [self.pending, tokens])  # fmt: skip
        # a new decoder per join: its LM-head kernel is chosen for the weights as they are now
        self.decoder = StaticDecoder(self.model, [], [], None, 0)
        self._views()

    def _reserve(self, rows: int, width: int, cache) -> None:
        """A buffer of at least ``rows`` slots and ``width`` columns: the same one while it fits,
        else a larger one (slots doubled up to ``max_rows``, columns by half) holding the live
        rows. Fresh memory is zeros, not empty: a column no row attends is multiplied by a 0
        probability (NaN * 0 = NaN)."""
        k, _ = _kv(cache, 0)
        if self.keys and not self.rows and (self.keys[0].dtype, self.keys[0].device) != (
            k.dtype, k.device):  # fmt: skip
            self.release()  # the model was moved or cast while the buffer was idle
        slots, cols = self.slots, 0 if self.key_pad is None else self.key_pad.shape[1]
        if rows <= slots and width <= cols:
            return
        if rows > slots:  # the first buffer: 8 slots (or max_rows), then doubled
            slots = max(rows, min(self.max_rows, max(2 * slots, 8)))
        cols = max(width, cols + cols // 2) if width > cols else cols
        n, used = len(self.rows), max((r.col for r in self.rows), default=0)
        keys, values = [], []
        for i in range(len(_layers(self.model))):
            k, _ = _kv(cache, i)
            shape = (slots, k.shape[1], cols, k.shape[3])
            k_buf, v_buf = k.new_zeros(shape), k.new_zeros(shape)
            if n:
                k_buf[:n, :, :used] = self.keys[i][:n, :, :used]
                v_buf[:n, :, :used] = self.values[i][:n, :, :used]
            keys.append(k_buf)
            values.append(v_buf)
        pad = torch.ones(slots, cols, dtype=torch.bool, device=k.device)
        if n:
            assert self.key_pad is not None, "live rows are in the buffer"
            pad[:n, :used] = self.key_pad[:n, :used]
        self.keys, self.values, self.key_pad, self.written = keys, values, pad, used
        if self.decoder is not None:
            self._views()

    def _views(self) -> None:
        """Point the decoder at the live rows' slots (a view of the buffer: no copy)."""
        n, d = len(self.rows), self.decoder
        assert d is not None and self.key_pad is not None, "a join made the decoder and buffer"
        d.keys = [k[:n] for k in self.keys]
        d.values = [v[:n] for v in self.values]
        d.key_pad = self.key_pad[:n, None, None, :]

    # ----- decoding -----------------------------------------------------------------------------
    def step(self) -> tuple[list[tuple[Hashable, int]], list[Finished]]:
        """One token for every row: returns ``(tag, token)`` per row and the rows that ended."""
        if not self.rows:
            return [], []
        assert self.decoder is not None and self.pending is not None and self.key_pad is not None, (
            "live rows have joined: a decoder, their last tokens and the buffer"
        )
        device = self.pending.device
        positions = torch.tensor([r.position for r in self.rows], device=device)
        cols = [r.col for r in self.rows]
        last = max(cols)
        with torch.inference_mode():
            if min(cols) == last:  # rows that joined together share a column: a plain slice
                self.key_pad[: len(cols), last] = False
                logits = self.decoder.step(self.pending, positions, last)
            else:
                columns = torch.tensor(cols, device=device)
                self.key_pad[torch.arange(len(cols), device=device), columns] = False
                logits = self.decoder.step(self.pending, positions, last, columns)
            for r in self.rows:
                r.position += 1
                r.col += 1
            self.written = max(self.written, last + 1)
            tokens = self._sample(logits, self.rows)
        rows = self.rows
        progress = [(r.tag, t) for r, t in zip(rows, tokens.tolist())]
        finished, keep = self._advance(rows, tokens)
        if len(keep) < len(rows):
            if self.prefix_tokens:
                weights = self._check_weights()
                with torch.inference_mode():
                    for i in sorted(set(range(len(rows))) - set(keep)):
                        if rows[i].weights == weights:  # else the model changed while it decoded
                            self._keep(i, rows[i])
            self._leave(keep, tokens)
        else:
            self.pending = tokens
        return progress, finished

    def drop(self, gone: Callable[[Hashable], bool]) -> int:
        """Remove the rows whose tag ``gone`` says nobody waits for; how many left."""
        keep = [i for i, r in enumerate(self.rows) if not gone(r.tag)]
        dropped = len(self.rows) - len(keep)
        if dropped:
            assert self.pending is not None, "live rows have their last tokens"
            self._leave(keep, self.pending)
        return dropped

    def _leave(self, keep: list[int], tokens: torch.Tensor) -> None:
        """Keep the rows ``keep``: the live ones past the new count move into the freed slots
        below it (only their keys are copied), so the live rows stay slots ``[0, len(keep))``."""
        if not keep:
            self.reset()
            return
        n, kept = len(keep), set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))  # slot -> the row it holds now
        for h, m in zip(holes, movers):
            order[h] = m
        if movers:
            used = self.written  # their zeros past their columns too (see __init__)
            assert self.key_pad is not None, "live rows are in the buffer"
            dst = torch.tensor(holes, device=tokens.device)
            src = torch.tensor(movers, device=tokens.device)
            with torch.inference_mode():
                for buf in (*self.keys, *self.values):
                    buf[:, :, :used].index_copy_(0, dst, buf[:, :, :used].index_select(0, src))
                self.key_pad.index_copy_(0, dst, self.key_pad.index_select(0, src))
        self.rows = [self.rows[i] for i in order]
        self.pending = tokens.index_select(0, torch.tensor(order, device=tokens.device))
        self._views()

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
            if self.version is not None:
                r.versions.append(self.version)
            stop = t in self.eos or (bool(r.params.stop) and self._hits_stop(r))
            if stop or len(r.ids) >= r.params.max_new_tokens:
                versions = r.versions if len(r.versions) == len(r.ids) else None
                finished.append(Finished(r.tag, r.ids, r.logprobs, "stop" if stop else "length",
                                         versions))  # fmt: skip
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
