"""Bookkeeping of packed updates (``actor.packing`` / ``critic.packing``): micro-batches formed by
a budget of real tokens, and a split of a batch across data-parallel ranks balanced by tokens.

Design decision: with packing a micro-batch costs the sum of its samples' lengths, not its count
times its longest sample, so the budget (``micro_batch_tokens``) is charged that sum and a
sample longer than the budget is an error naming it and the key (the padded path gives such a
sample a micro-batch of its own; a packed row over budget would break the memory promise the key
makes). Micro-batches are filled first-fit-decreasing (TRL's and verl's choice: few, full
micro-batches), then listed in order of their first sample, each in row order, so the result
depends on the lengths only. The rank split reorders the batch so that the dispatcher's equal
contiguous parts (``Batch.chunk_padded``) carry near-equal token sums: longest sample first to the
part with the fewest tokens that still has room (the LPT rule). Both are pure functions of the
lengths, tested by hand (tests/workers/test_packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "packed_micro_batches",
    "consecutive_groups",
    "check_token_budget",
    "balanced_rank_order",
    "OverBudgetError",
]


class OverBudgetError(ValueError):
    """A sample has more tokens than the packed micro-batch budget."""


def packed_micro_batches(
    lengths: Sequence[int],
    max_tokens: int | None,
    max_samples: int | None = None,
    *,
    key: str = "actor.micro_batch_tokens",
    names: Sequence[str] | None = None,
) -> list[list[int]]:
    """Index groups of a packed update: at most ``max_tokens`` tokens (the sum of ``lengths``)
    and at most ``max_samples`` samples each (None: no limit of that kind).

    With a token budget, first-fit-decreasing bins, listed by their first index; without one,
    consecutive groups of ``max_samples`` (all samples in one group if both are None).
    ``names`` (e.g. uids) name an offending sample in the error; its index otherwise.
    """
    n = len(lengths)
    if max_tokens is None:
        return consecutive_groups(n, max_samples)
    check_token_budget(lengths, max_tokens, key=key, names=names)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b in range(len(bins)):
            if lengths[i] <= room[b] and (max_samples is None or len(bins[b]) < max_samples):
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def consecutive_groups(n: int, max_samples: int | None) -> list[list[int]]:
    """Indices 0..n-1 in consecutive groups of ``max_samples`` (all in one group if None; no
    group when n is 0): the micro-batches of an update without a token budget, packed or not."""
    if n == 0:
        return []
    size = max_samples or n
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def check_token_budget(
    lengths: Sequence[int],
    max_tokens: int | None,
    *,
    key: str = "actor.micro_batch_tokens",
    names: Sequence[str] | None = None,
) -> None:
    """Raise ``OverBudgetError`` naming the first sample longer than ``max_tokens`` and ``key``
    (by ``names[i]``, e.g. its uid, else its index); nothing without a budget."""
    if max_tokens is None:
        return
    for i, length in enumerate(lengths):
        if length > max_tokens:
            who = f"sample {names[i]!r}" if names is not None else f"sample {i}"
            raise OverBudgetError(
                f"{who} has {length} tokens (prompt + response), more than {key}={max_tokens}: "
                f"a packed micro-batch cannot hold it; raise {key} to at least {length} or "
                "filter longer samples"
            )


def balanced_rank_order(lengths: Sequence[int], parts: int) -> list[int]:
    """A permutation of the samples after which ``parts`` equal contiguous parts (the
    dispatcher's split: ``ceil(n / parts)`` rows each, the last ones short) hold near-equal
    token sums. Each part's samples keep their original order."""
    n = len(lengths)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if parts == 1 or n == 0:
        return list(range(n))
    size = -(-n // parts)
    capacity = [max(0, min(size, n - r * size)) for r in range(parts)]
    members: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(parts) if len(members[r]) < capacity[r]),
                key=lambda r: (tokens[r], r))  # fmt: skip
        members[r].append(i)
        tokens[r] += lengths[i]
    return [i for m in members for i in sorted(m)]
