"""What the LLM workflows share: encoded prompts, the reward call, per-step metrics, and evaluation
through the workflow's own episodes.

Design decision: single- and multi-turn workflows differ only in how one prompt becomes a
sample (one completion, or a conversation with tools); loading and encoding prompts, calling the
reward functions with the dataset's fields, building a ``samples.jsonl``-ready Batch, computing
step metrics and turning scored records into validation accuracy are the same code, here, used by
composition. Validation and the warm start's probe run the *workflow's* episodes, so a tool-using
policy is evaluated with its tools.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from groupflow.assembly.data import EncodedPrompts, prompt_stats
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.data import PromptRow
from groupflow.evaluation import evaluate
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.sft import warm_start
from groupflow.utils.seeds import step_seeds
from groupflow.workers.reward_model import ModelRewardRunner
from groupflow.workflows.detach import PolicyParts

__all__ = [
    "LLM_FIELDS",
    "row_fields",
    "with_prompt_info",
    "sample_versions",
    "llm_step_metrics",
    "finite_metrics",
    "build_rewards",
    "add_rewards",
    "PromptTable",
    "EncodedPromptsWorkflow",
    "scoring_chunks",
]


# Per-sample fields every LLM workflow hands the reward functions besides the dataset's (the
# response's token count, for the length rewards); declared as the workflows' ``provided_fields``
# so a reward asking for one is not refused at load for the data lacking it.
LLM_FIELDS = ("completion_lengths",)


def row_fields(rows: Sequence[PromptRow]) -> dict[str, list]:
    """Per-sample dataset fields by name, for the reward functions (missing → None)."""
    keys = dict.fromkeys(k for r in rows for k in r.fields)
    return {k: [r.fields.get(k) for r in rows] for k in keys}


def sft_turns(row: PromptRow, field: str) -> list[str]:
    """A warm-start demonstration's model turns from ``row``'s ``field`` (``sft.target_field``):
    one string or a non-empty list of strings, else a ValueError naming row, file and field."""
    turns = row.fields.get(field)
    turns = [turns] if isinstance(turns, str) else turns
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(
            f"sft: row {row.index} of {row.source}: field '{field}' (sft.target_field) must be "
            "a model turn or a non-empty list of model turns (strings)"
        )
    return turns


def with_prompt_info(out: Batch, rows: list[PromptRow], texts: list[str], n: int,
                     uid_prefix: str, version: int) -> Batch:  # fmt: skip
    """Attach uids, prompt text, dataset rows and the policy version to generated samples
    (sample j of prompt i at i*n + j)."""
    b = len(rows) * n
    out["uid"] = [f"{uid_prefix}-{i}" for i in range(b)]
    out["prompt"] = [texts[i // n] for i in range(b)]
    out["row"] = [rows[i // n] for i in range(b)]
    out["version"] = sample_versions(out, version)
    return out


def sample_versions(batch: Batch, version: int) -> torch.Tensor:
    """Each sample's policy version: ``version``, or with in-flight updates (``token_versions``)
    its oldest token's — a sample is as old as its oldest token (``version`` where it has none)."""
    if "token_versions" not in batch:
        return torch.full((len(batch),), version, dtype=torch.long)
    tv = batch["token_versions"]
    oldest = torch.where(tv >= 0, tv, torch.iinfo(tv.dtype).max).min(dim=1).values
    return torch.where(oldest == torch.iinfo(tv.dtype).max, version, oldest)


def build_rewards(cfg: Config, policy, rules, prompt_tables: Sequence):
    """The reward runner: the rule-based functions (``rules``, None when the reward model alone
    scores), plus the reward model role when configured."""
    reward_fn = rules
    if cfg.reward_model is not None:
        rm = cfg.reward_model
        raw = {t: r.prompt for table in prompt_tables for t, r in zip(table.texts, table.rows)}
        reward_fn = ModelRewardRunner(
            reward_fn, policy.reward_model, weight=rm.weight, label=rm.label, raw_prompts=raw,
            normalize=cfg.reward.normalize, normalize_eps=cfg.reward.normalize_eps,
        )  # fmt: skip
    return reward_fn


def finite_metrics(metrics: dict) -> dict[str, float]:
    """The numeric, finite entries of a reward runner's metrics (what a step logs)."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, (int, float)) and math.isfinite(v)
    }  # fmt: skip


def add_rewards(reward_fn, batch: Batch, completions: list[str],
                **extra: list) -> tuple[Batch, dict[str, float]]:  # fmt: skip
    """``rewards`` [B] from the reward runner, called with the dataset fields and ``extra``
    per-sample fields (e.g. a trajectory's messages); (batch, the reward metrics)."""
    lengths = batch["response_mask"].sum(1).tolist()
    result = reward_fn(
        list(batch["prompt"]), completions, completion_lengths=lengths,
        group_ids=batch["group_ids"], **row_fields(batch["row"]), **extra,
    )  # fmt: skip
    batch["rewards"] = result.total.float()
    return batch, finite_metrics(result.metrics)


def llm_step_metrics(batch: Batch, seconds: float) -> dict[str, float]:
    """Rewards, advantages and response lengths (model tokens only: observation tokens of a
    multi-turn sample are not the policy's) of one training batch. The metrics of the stages
    that produced it (rollout, rewards) are their own return values, not read from the batch."""
    rewards, adv = batch["rewards"], batch["advantages"]
    lengths = batch["response_mask"].sum(1).float()
    finished_by_length = sum(r == "length" for r in batch["finish_reason"]) / len(batch)
    m = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "acc/train": float((rewards >= 1.0).float().mean()),
        "advantages/mean": float(adv.mean()),
        "advantages/std": float(adv.std(unbiased=False)),
        "advantages/max": float(adv.max()),
        "advantages/min": float(adv.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(finished_by_length),
        "batch/samples": float(len(batch)),
    }
    # prompt tokens count once per sample, observation tokens not at all (they are not decoded)
    prompt = float(batch["prompt_mask"].sum()) if "prompt_mask" in batch else 0.0
    m["perf/tokens_per_s"] = (float(lengths.sum()) + prompt) / max(seconds, 1e-9)
    return m


class PromptTable:
    """Prompt rows with their rendered text and token ids (``EncodedPrompts``), looked up
    by row identity: rollout never renders or tokenizes a prompt again."""

    def __init__(self, encoded: EncodedPrompts):
        self.encoded = encoded
        self._by_row = {id(r): (t, i) for r, t, i in zip(encoded.rows, encoded.texts, encoded.ids)}

    # the lookup is by the rows' identities, which are the process's own: an unpickled table
    # (the rollout side's) builds it again over its own row objects
    def __getstate__(self) -> dict[str, Any]:
        return {"encoded": self.encoded}

    def __setstate__(self, state: dict[str, Any]) -> None:
        PromptTable.__init__(self, state["encoded"])

    @property
    def rows(self) -> list[PromptRow]:
        return self.encoded.rows

    @property
    def texts(self) -> list[str]:
        return self.encoded.texts

    def lookup(self, rows: Sequence[PromptRow]) -> tuple[list[str], list[list[int]]]:
        texts, ids = zip(*(self._by_row[id(r)] for r in rows))
        return list(texts), list(ids)

    def vision(self, rows: Sequence[PromptRow]) -> list | None:
        """Each row's images (``models.vision.VisionInputs`` or None); None when no row has any."""
        vision = getattr(self.encoded, "vision", None)
        if vision is None:
            return None
        by_row = {id(r): v for r, v in zip(self.encoded.rows, vision)}
        return [by_row[id(r)] for r in rows]


Scorer = Callable[[Any, SamplingParams, int], list[dict[str, Any]]]


def validate_llm(cfg: Config, score: Scorer, val: EncodedPrompts | None,
                 sampling: SamplingParams, return_records: bool = False,
                 progress_label: str = "validation"):  # fmt: skip
    """Greedy and sampled accuracy on the held-out prompts through ``score`` (the workflow's
    episodes); progress shows as ``progress_label`` (a bar of its own command stays)."""
    if val is None:
        return ({}, {}) if return_records else {}
    v = cfg.validation
    return evaluate(
        score, val, base_params=sampling, samples=v.samples_per_prompt,
        temperature=v.temperature, greedy=v.greedy, seed=cfg.run.seed,
        return_records=return_records, progress_label=progress_label,
        progress_leave=progress_label != "validation",
    )  # fmt: skip


def llm_warm_start(cfg: Config, policy, examples, score: Scorer, train) -> dict[str, float]:
    """The supervised warm start (``sft.steps``), probed through the workflow's episodes."""
    if not cfg.sft.steps:
        return {}
    greedy = replace(policy.sampling, temperature=0.0, n=1)
    return warm_start(
        policy, examples, lambda probe: score(probe, greedy, cfg.run.seed), train,
        cfg.sft, cfg.run.seed, sync=lambda: policy.sync(0),  # RL starts from version 0
    )  # fmt: skip


def scoring_chunks(encoded, n: int, seed: int, chunk_prompts: int):
    """``encoded``'s prompts in chunks of ``chunk_prompts`` for scoring ``n`` samples each:
    (start, rows, ids, texts, seeds [one per sample], vision or None). Each sample's seed depends
    on its place in the table only, so a score does not depend on the chunk size."""
    images = getattr(encoded, "vision", None)  # None: text prompts (or a bare table)
    for start in range(0, len(encoded.rows), chunk_prompts):
        stop = start + chunk_prompts
        rows = encoded.rows[start:stop]
        seeds = [seed * 7919 + (start * n + i) for i in range(len(rows) * n)]
        vision = images[start:stop] if images else None
        yield start, rows, encoded.ids[start:stop], encoded.texts[start:stop], seeds, vision


class EncodedPromptsWorkflow(PolicyParts):
    """What the single- and multi-turn workflows share beside how a sample is made: they hold
    encoded prompts (``train``, a :class:`PromptTable`, and ``val``), and validate and warm-start
    through their own ``score`` and ``sft_examples``; they travel to the asynchronous rollout
    side as built (``PolicyParts``: the prompts stay encoded, the reward runner is rebuilt)."""

    cfg: Config
    policy: Any
    train: PromptTable
    val: EncodedPrompts | None

    # each workflow's own: its episodes, and its demonstrations for the warm start
    score: Callable[..., list[dict[str, Any]]]
    sft_examples: Callable[[Any], list[tuple]]

    def _set_rewards(self, rewards) -> None:
        """The reward functions (checked against both prompt tables), data stats and contracts,
        once ``train`` and ``val`` are encoded."""
        tables = [self.train.encoded] + ([self.val] if self.val else [])
        self.reward_fn = build_rewards(self.cfg, self.policy, rewards, tables)
        self.data_stats = prompt_stats(self.train.encoded, self.val)
        self.contracts = self.policy.contracts

    def attach(self, policy, rewards) -> None:
        self._set_rewards(rewards)

    @property
    def train_rows(self) -> list[PromptRow]:
        return self.train.rows

    def _step_prompts(self, rows: list[PromptRow], step: int, round_: int):
        """A step's (seeds [per row, n each], group ids, prompt texts, prompt ids) for ``rows``:
        the seeds from (run seed, step, round, slot), so a resumed run samples the same."""
        n = self.policy.sampling.n
        seeds, group_ids = step_seeds(self.cfg.run.seed, step, round_, len(rows), n)
        texts, ids = self.train.lookup(rows)
        return seeds, group_ids, texts, ids

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        return llm_step_metrics(batch, seconds)

    def validate(self, step: int, return_records: bool = False, progress_label="validation"):
        return validate_llm(self.cfg, self.score, self.val, self.policy.sampling, return_records,
                            progress_label)  # fmt: skip

    def warm_start(self) -> dict[str, float]:
        return llm_warm_start(
            self.cfg, self.policy, self.sft_examples, self.score, self.train.encoded
        )
