"""Ulysses sequence parallelism: the process groups and the differentiable collectives.

Design decision: a role's W workers form W/N sequence-parallel groups of N consecutive ranks
(ranks ``g·N … g·N+N-1``); a group is one data-parallel replica. Its members first pool their
dispatched rows (``gather_rows``: every member then holds the group's samples, as verl's
Ulysses sharding manager does), each takes 1/N of every sequence, and around attention an
all-to-all trades the sequence dimension for the head dimension (``all_to_all``), so attention
sees the whole sequence for 1/N of the heads. FSDP2 still shards over all W ranks: the groups
only add the all-to-alls, so the worker's data-parallel bookkeeping changes in one place — each
sample is held by N ranks (its sums over ranks are divided by N).

Per-token results (log-probs) are gathered back to the whole sequence on every member
(``gather_sequence``) and the loss is computed there, identically on every member: so a member's
gradient with respect to its own slice is its slice of that common gradient (the backward is a
slice, no communication), and the members' parameter gradients add up to the full one — which
FSDP2's reduction over all ranks performs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from groupflow.batch import Batch

__all__ = [
    "SequenceGroup",
    "sequence_groups",
    "all_to_all",
    "gather_sequence",
    "split_sequence",
    "gather_heads",
    "gather_rows",
    "padded_length",
]


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: ``size`` ranks, this one at ``rank`` in it."""

    group: object  # a torch.distributed ProcessGroup
    size: int
    rank: int

    def __deepcopy__(self, memo):  # a process group is shared, not copied (model copies hold it)
        return self


def sequence_groups(rank: int, world_size: int, size: int) -> SequenceGroup | None:
    """Split the ranks into groups of ``size`` consecutive ranks; this rank's group (None when
    ``size`` is 1). A collective: every rank creates every group, in the same order."""
    if size == 1:
        return None
    if world_size % size:
        raise ValueError(
            f"parallel.sequence_parallel={size} must divide the role's {world_size} workers"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sequence parallelism needs an initialised torch.distributed group")
    mine = None
    for start in range(0, world_size, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = SequenceGroup(group, size, rank - start)
    return mine


def padded_length(length: int, size: int) -> int:
    """The sequence length padded up to a multiple of the group size (every member an equal slice)."""
    return -(-length // size) * size


def _exchange(x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int):
    chunks = torch.stack([c.contiguous() for c in x.chunk(size, dim=scatter_dim)])
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)  # out[i]: what rank i sent to this rank
    return torch.cat(list(out.unbind(0)), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.args = (group, size, scatter_dim, gather_dim)
        return _exchange(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, scatter_dim, gather_dim = ctx.args
        # the inverse exchange routes each gradient slice back to the rank it came from
        return _exchange(grad, group, size, gather_dim, scatter_dim), None, None, None, None


def all_to_all(x: torch.Tensor, sp: SequenceGroup, scatter_dim: int, gather_dim: int):
    """Split ``x`` into ``sp.size`` chunks along ``scatter_dim``, send chunk j to member j, and
    concatenate what the members sent along ``gather_dim`` (in member order); differentiable.
    E.g. [B, H, S/N, D] → [B, H/N, S, D] with scatter_dim 1, gather_dim 2 (and back)."""
    if x.shape[scatter_dim] % sp.size:
        raise ValueError(
            f"all_to_all: dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split "
            f"over {sp.size} ranks"
        )
    return _AllToAll.apply(x, sp.group, sp.size, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = (size, rank, dim)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        size, rank, dim = ctx.args
        # every member computes the same function of the gathered tensor (module docstring):
        # the gradient of this member's slice is its slice of that common gradient
        return grad.chunk(size, dim=dim)[rank].contiguous(), None, None, None, None


def gather_sequence(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """Concatenate the members' slices along ``dim`` (member order) on every member. Backward:
    this member's slice of the gradient — valid because every member uses the gathered tensor
    in the same way (the same loss)."""
    return _GatherSequence.apply(x, sp.group, sp.size, sp.rank, dim)


def split_sequence(x: torch.Tensor, sp: SequenceGroup, what: str, dim: int = 1) -> torch.Tensor:
    """This member's 1/N of ``x`` along ``dim`` (what :func:`gather_sequence` puts back together);
    ``what`` names the tokens in the refusal when the group does not divide them (there is no
    padding mask to even them out)."""
    if x.shape[dim] % sp.size:
        raise ValueError(
            f"parallel.sequence_parallel={sp.size}: {what} has {x.shape[dim]} tokens that do "
            f"not split evenly over {sp.size} ranks; choose a latent_shape whose token count "
            "it divides"
        )
    return x.chunk(sp.size, dim=dim)[sp.rank]


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank, dim):
        ctx.args = (group, size, rank, dim)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, size, rank, dim = ctx.args
        # every member uses the gathered tensor in its own way: this slice's gradient is the sum
        # of the members' gradients for it
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad.chunk(size, dim=dim)[rank].contiguous(), None, None, None, None


def gather_heads(x: torch.Tensor, sp: SequenceGroup, dim: int) -> torch.Tensor:
    """Concatenate the members' parts along ``dim`` (member order) on every member, for a
    tensor each member then uses differently (e.g. SD3's text tokens, whose heads were attended
    on different members); backward sums the members' gradients of each part."""
    return _GatherHeads.apply(x, sp.group, sp.size, sp.rank, dim)


def gather_rows(batch: Batch, sp: SequenceGroup) -> tuple[Batch, slice]:
    """The group's rows (its members' dispatched shares, in member order) on every member, and
    where this member's own rows sit in them (to return per-row results for those only)."""
    parts: list = [None] * sp.size
    dist.all_gather_object(parts, batch, group=sp.group)
    start = sum(len(p) for p in parts[: sp.rank])
    return Batch.concat(parts), slice(start, start + len(batch))
