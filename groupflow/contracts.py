"""Stage contracts: what a Batch must hold when it crosses each stage boundary.

Design decision: contracts are data (a tuple of field specs per stage), not code scattered through
the trainer. The driver calls ``validate(batch, stage)`` after every stage, so a broken rollout
engine, reward function or custom estimator is caught at the boundary where it happened, with an
error naming the stage, the key, what was expected, what was found and which samples are wrong —
instead of a shape error three stages later. A policy family (LLM, diffusion) whose actions are
not token ids extends a contract with ``Contract.extend`` / ``Contract.without`` rather than
branching in the validator.

Shapes are written with symbolic dimensions: ``B`` (samples) and ``T`` (actions per sample) must
agree across all keys of one batch; other names (``P``: prompt length) only within a key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from groupflow.batch import Batch

__all__ = [
    "ContractError",
    "FieldSpec",
    "Contract",
    "CONTRACTS",
    "STAGES",
    "validate",
    "get_contract",
    "DIFFUSION_CONTRACTS",
    "check_staleness",
]

_KINDS = ("float", "int", "mask", "object")
# How many offending sample ids an error message lists before it says "and N more".
_MAX_IDS = 8


class ContractError(ValueError):
    """A Batch does not meet the contract of a stage."""

    def __init__(self, stage: str, key: str, expected: str, found: str, sample_ids: Sequence = ()):
        self.stage, self.key, self.expected, self.found = stage, key, expected, found
        self.sample_ids = list(sample_ids)
        ids = ""
        if self.sample_ids:
            shown = ", ".join(repr(s) for s in self.sample_ids[:_MAX_IDS])
            more = len(self.sample_ids) - _MAX_IDS
            ids = f"; offending samples: {shown}" + (f" and {more} more" if more > 0 else "")
        super().__init__(f"[stage '{stage}'] key '{key}': expected {expected}, found {found}{ids}")


@dataclass(frozen=True)
class FieldSpec:
    """One required (or optional) entry of a stage's Batch.

    kind: ``float`` (floating tensor, must be finite), ``int`` (integer tensor), ``mask`` (bool or
    0/1 numeric tensor), ``object`` (per-sample Python values). ``shapes`` lists the accepted
    symbolic shapes, e.g. ``(("B",), ("B", "T"))`` for advantages.
    """

    key: str
    kind: str
    shapes: tuple[tuple[str, ...], ...] = (("B",),)
    optional: bool = False
    unique: bool = False  # object/int keys whose values must be distinct (uids)
    max_value: float | None = None  # e.g. log-probabilities must be <= 0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(
                f"FieldSpec '{self.key}': kind must be one of {_KINDS}, got '{self.kind}'"
            )


@dataclass(frozen=True)
class Contract:
    stage: str
    fields: tuple[FieldSpec, ...]
    check_groups: bool = True  # every group shares one prompt; group_ids integer
    group_key: str | None = "prompt"  # the per-sample key that must be constant within a group

    def extend(self, *fields: FieldSpec, stage: str | None = None) -> Contract:
        keys = {f.key for f in fields}
        kept = tuple(f for f in self.fields if f.key not in keys)
        return replace(self, stage=stage or self.stage, fields=kept + tuple(fields))

    def without(self, *keys: str) -> Contract:
        return replace(self, fields=tuple(f for f in self.fields if f.key not in keys))

    @property
    def keys(self) -> list[str]:
        return [f.key for f in self.fields]


_LOGP_MAX = 1e-4  # log-probs are <= 0; a little slack for float rounding

_ROLLOUT = (
    FieldSpec("uid", "object", unique=True),
    FieldSpec("group_ids", "int"),
    # the policy version (updates applied) whose weights generated the sample (check_staleness)
    FieldSpec("version", "int"),
    FieldSpec("prompt", "object", optional=True),
    FieldSpec("prompt_ids", "int", (("B", "P"),), optional=True),
    FieldSpec("prompt_mask", "mask", (("B", "P"),), optional=True),
    FieldSpec("responses", "int", (("B", "T"),)),
    FieldSpec("response_mask", "mask", (("B", "T"),)),
    FieldSpec("rollout_logprobs", "float", (("B", "T"),), optional=True, max_value=_LOGP_MAX),
    # rollout.async_mode=in_flight: the version that sampled each token (-1 where masked); then
    # ``version`` is the sample's oldest (its first token's)
    FieldSpec("token_versions", "int", (("B", "T"),), optional=True),
)
_REWARDED = _ROLLOUT + (FieldSpec("rewards", "float"),)
_ADVANTAGED = _REWARDED + (FieldSpec("advantages", "float", (("B",), ("B", "T"))),)
_TRAIN_READY = _ADVANTAGED + (
    # absent: the update's own forward (detached) anchors the ratio — one optimizer step on the
    # current weights with an off-policy correction (policies.llm.old_logprobs_source)
    FieldSpec("old_logprobs", "float", (("B", "T"),), optional=True, max_value=_LOGP_MAX),
    FieldSpec("ref_logprobs", "float", (("B", "T"),), optional=True, max_value=_LOGP_MAX),
)

STAGES = ("rollout", "rewarded", "advantaged", "train_ready")
CONTRACTS: dict[str, Contract] = {
    "rollout": Contract("rollout", _ROLLOUT),
    "rewarded": Contract("rewarded", _REWARDED),
    "advantaged": Contract("advantaged", _ADVANTAGED),
    "train_ready": Contract("train_ready", _TRAIN_READY),
}


# A flow-matching policy's actions are its denoising steps (T = N steps): token ids and prompt
# tensors give way to the stored transitions, and step log-probs are Gaussian *densities* (they
# may be positive), so their upper bound is dropped. Built from the LLM contracts, not beside them.
_LATENTS = (("B", "T", "C", "H", "W"), ("B", "T", "C", "F", "H", "W"))
_DIFFUSION_ROLLOUT = (
    FieldSpec("latents", "float", _LATENTS),
    FieldSpec("next_latents", "float", _LATENTS),
    FieldSpec("sigmas", "float", (("B", "T"),)),
    FieldSpec("sigmas_next", "float", (("B", "T"),)),
    FieldSpec("images", "float", (("B", "C", "H", "W"), ("B", "C", "F", "H", "W"))),
    FieldSpec("rollout_logprobs", "float", (("B", "T"),)),
    # each sample's rollout seed: DiffusionNFT / AWM draw its training noise from it
    FieldSpec("sample_seeds", "int", optional=True),
)
_LLM_ONLY = ("responses", "prompt_ids", "prompt_mask")


def _diffusion(stage: str) -> Contract:
    c = (
        CONTRACTS[stage]
        .without(*_LLM_ONLY)
        .extend(*_DIFFUSION_ROLLOUT, stage=f"{stage} (diffusion)")
    )
    if stage == "train_ready":
        c = c.extend(
            FieldSpec("old_logprobs", "float", (("B", "T"),)),
            FieldSpec("ref_logprobs", "float", (("B", "T"),), optional=True),
        )
    return c


DIFFUSION_CONTRACTS: dict[str, Contract] = {s: _diffusion(s) for s in STAGES}


def get_contract(stage: str | Contract) -> Contract:
    if isinstance(stage, Contract):
        return stage
    if stage not in CONTRACTS:
        raise ValueError(f"unknown stage '{stage}'; valid stages: {', '.join(CONTRACTS)}")
    return CONTRACTS[stage]


def validate(batch: Batch, stage: str | Contract) -> Batch:
    """Check ``batch`` against the contract of ``stage``; return it unchanged or raise ContractError."""
    contract = get_contract(stage)
    name = contract.stage
    if not isinstance(batch, Batch):
        raise ContractError(name, "<batch>", "a groupflow Batch", type(batch).__name__)
    n = len(batch)
    if n == 0:
        raise ContractError(name, "<batch>", "at least one sample", "an empty batch")
    ids = _sample_ids(batch)
    dims: dict[str, tuple[int, str]] = {"B": (n, "batch size")}
    for spec in contract.fields:
        if spec.key not in batch:
            if spec.optional:
                continue
            raise ContractError(
                name,
                spec.key,
                f"a {spec.kind} entry",
                f"no such key (keys: {sorted(batch.keys())})",
            )
        value = batch[spec.key]
        if spec.kind == "object":
            _check_object(name, spec, value, ids)
        else:
            _check_tensor(name, spec, value, dims, ids)
    if contract.check_groups and "group_ids" in batch:
        _check_groups(name, batch, contract.group_key, ids)
    return batch


def _sample_ids(batch: Batch) -> list:
    if "uid" in batch.non_tensors:
        return list(batch.non_tensors["uid"])
    return list(range(len(batch)))


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def _check_object(stage: str, spec: FieldSpec, value, ids: list) -> None:
    if isinstance(value, torch.Tensor):
        raise ContractError(
            stage, spec.key, "per-sample Python values (non-tensor)", f"a tensor {_describe(value)}"
        )
    if spec.unique:
        seen: dict = {}
        dupes = []
        for v in value:
            try:
                if v in seen:
                    dupes.append(v)
                seen[v] = True
            except TypeError:
                raise ContractError(
                    stage, spec.key, "hashable values", f"{type(v).__name__}"
                ) from None
        if dupes:
            raise ContractError(
                stage, spec.key, "unique values", f"{len(dupes)} duplicate(s)", dupes
            )


def _check_tensor(stage: str, spec: FieldSpec, t, dims: dict, ids: list) -> None:
    key = spec.key
    if not isinstance(t, torch.Tensor):
        raise ContractError(stage, key, f"a {spec.kind} tensor", f"{type(t).__name__} values")
    expected_shapes = " or ".join("[" + ",".join(s) + "]" for s in spec.shapes)
    shape = next((s for s in spec.shapes if len(s) == t.dim()), None)
    if shape is None:
        raise ContractError(stage, key, f"{spec.kind} {expected_shapes}", _describe(t))
    for axis, (sym, size) in enumerate(zip(shape, t.shape)):
        if sym in ("B", "T"):
            if sym in dims and dims[sym][0] != size:
                known, where = dims[sym]
                raise ContractError(
                    stage,
                    key,
                    f"dim {axis} ({sym}) = {known} as in {where}",
                    f"{size} in {_describe(t)}",
                )
            dims.setdefault(sym, (size, f"'{key}'"))
    if spec.kind == "float":
        if not t.is_floating_point():
            raise ContractError(stage, key, f"a floating tensor {expected_shapes}", _describe(t))
        bad = ~torch.isfinite(t)
        _raise_rows(stage, key, bad, "finite values", "NaN/inf", ids)
        if spec.max_value is not None:
            _raise_rows(
                stage,
                key,
                t > spec.max_value,
                f"values <= {spec.max_value:g}",
                "larger values",
                ids,
            )
    elif spec.kind == "int":
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ContractError(stage, key, f"an integer tensor {expected_shapes}", _describe(t))
    elif spec.kind == "mask":
        if t.is_complex():
            raise ContractError(stage, key, "a bool or 0/1 tensor", _describe(t))
        if t.dtype != torch.bool:
            _raise_rows(stage, key, (t != 0) & (t != 1), "only 0/1 values", "other values", ids)


def _raise_rows(
    stage: str, key: str, bad: torch.Tensor, expected: str, found: str, ids: list
) -> None:
    if not bool(bad.any()):
        return
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    raise ContractError(
        stage, key, expected, f"{found} in {len(rows)} sample(s)", [ids[r] for r in rows]
    )


def _check_groups(stage: str, batch: Batch, group_key: str | None, ids: list) -> None:
    """Samples of one group must share their prompt: advantages compare answers to the same question."""
    gids = batch["group_ids"]
    if not isinstance(gids, torch.Tensor) or gids.dim() != 1:
        return  # its own FieldSpec reports the problem
    prompts = _prompt_keys(batch, group_key)
    if prompts is None:
        return
    first: dict[int, object] = {}
    bad = []
    for i, (g, p) in enumerate(zip(gids.tolist(), prompts)):
        if g in first and first[g] != p:
            bad.append(ids[i])
        first.setdefault(g, p)
    if bad:
        raise ContractError(
            stage,
            "group_ids",
            f"one prompt per group (by '{group_key}')",
            "groups mixing different prompts",
            bad,
        )


def _prompt_keys(batch: Batch, group_key: str | None) -> list | None:
    if group_key and group_key in batch.non_tensors:
        return [_hashable(v) for v in batch.non_tensors[group_key]]
    if "prompt_ids" in batch.tensors:
        ids, mask = batch["prompt_ids"], batch.get("prompt_mask")
        rows = ids.tolist()
        if mask is not None:
            keep = mask.bool().tolist()
            rows = [[t for t, k in zip(r, m) if k] for r, m in zip(rows, keep)]
        return [tuple(r) for r in rows]
    return None


def _hashable(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(_hashable(x) for x in v)
    return v


def check_staleness(batch: Batch, current: int, max_staleness: int, stage: str = "update") -> Batch:
    """A sample generated by policy version v may be trained at version ≤ v + ``max_staleness``
    (and never by an older policy than generated it)."""
    versions = batch["version"]
    if "token_versions" in batch:  # in-flight updates: a sample's newest token counts as well
        newest = batch["token_versions"].max(dim=1).values
        _raise_rows(stage, "token_versions", newest > current, f"<= {current} (the policy's "
                    "version)", "tokens from the future", _sample_ids(batch))  # fmt: skip
    ids = _sample_ids(batch)
    too_old = versions < current - max_staleness
    _raise_rows(stage, "version", too_old, f">= {current - max_staleness} (policy version "
                f"{current}, max staleness {max_staleness})", "older versions", ids)  # fmt: skip
    _raise_rows(stage, "version", versions > current, f"<= {current} (the policy's version)",
                "versions from the future", ids)  # fmt: skip
    return batch


def required_keys(stage: str) -> list[str]:
    return [f.key for f in get_contract(stage).fields if not f.optional]


def describe(stages: Iterable[str] = STAGES) -> str:
    """Human-readable listing of the contracts (used in docs and error hints)."""
    lines = []
    for s in stages:
        lines.append(f"{s}:")
        for f in get_contract(s).fields:
            shapes = " or ".join("[" + ",".join(x) + "]" for x in f.shapes)
            lines.append(f"  {f.key:<18} {f.kind:<6} {shapes}{' (optional)' if f.optional else ''}")
    return "\n".join(lines)
