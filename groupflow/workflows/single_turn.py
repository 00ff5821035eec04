"""The single-turn LLM workflow: one completion per sample, G samples per prompt, then rewards.

Design decision: the workflow the trainer ran inline before workflows existed, moved here
unchanged in its numbers: a prompt's G samples share one prefill, every sample is seeded from
(run seed, step, slot), completions are decoded once for the reward functions, and the batch
is contract-checked after rollout and after rewards.
"""

from __future__ import annotations

from typing import Any

from groupflow.assembly.data import encode_prompts, prompt_stats
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.contracts import validate
from groupflow.data import PromptRow
from groupflow.evaluation import records_from_scores, report_progress
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.utils.seeds import step_seeds
from groupflow.workflows.llm import (
    LLM_FIELDS,
    PromptTable,
    add_rewards,
    build_rewards,
    llm_step_metrics,
    llm_warm_start,
    row_fields,
    validate_llm,
    with_prompt_info,
)

__all__ = ["SingleTurnWorkflow"]


class SingleTurnWorkflow:
    """Prompt → G completions → rewards (``rollout.max_turns: 1``, no tools or environment)."""

    provided_fields = LLM_FIELDS  # handed to the reward functions with each sample

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow], val_rows: list[PromptRow],
                 rewards=None):  # fmt: skip
        self.cfg, self.policy = cfg, policy
        tok = policy.tokenizer
        self.train = PromptTable(encode_prompts(train_rows, tok, cfg, "train"))
        self.val = encode_prompts(val_rows, tok, cfg, "validation") if val_rows else None
        self.reward_fn = build_rewards(
            cfg, policy, rewards, [self.train.encoded] + ([self.val] if self.val else [])
        )
        self.data_stats = prompt_stats(self.train.encoded, self.val)
        self.contracts = policy.contracts

    @property
    def train_rows(self) -> list[PromptRow]:
        return self.train.rows

    # ----- the trainer's calls ------------------------------------------------------------------
    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
        params = self.policy.sampling
        n = params.n
        seeds, group_ids = step_seeds(self.cfg.run.seed, step, round_, len(rows), n)
        texts, ids = self.train.lookup(rows)
        prompts = prompts_batch(ids, seeds, group_ids, self.train.vision(rows))
        out = self.policy.rollout.generate(prompts, params, max(len(i) for i in ids))
        batch = with_prompt_info(out, rows, texts, n, f"{step}-{round_}", version)
        batch["completion"] = self.decode(batch)
        validate(batch, self.contracts["rollout"])
        batch, metrics = add_rewards(self.reward_fn, batch, list(batch["completion"]))
        return validate(batch, self.contracts["rewarded"]), metrics

    def step_metrics(self, batch: Batch, seconds: float) -> dict[str, float]:
        return llm_step_metrics(batch, seconds)

    def validate(self, step: int, return_records: bool = False, progress_label="validation"):
        return validate_llm(self.cfg, self.score, self.val, self.policy.sampling, return_records,
                            progress_label)  # fmt: skip

    def warm_start(self) -> dict[str, float]:
        return llm_warm_start(
            self.cfg, self.policy, self.sft_examples, self.score, self.train.encoded
        )

    def sample(self, prompts: list[str], params: SamplingParams,
               seeds: list[list[int]]) -> list[dict[str, Any]]:  # fmt: skip
        """``groupflow generate``: ``params.n`` completions of each raw prompt text (the
        tokenizer's usual special tokens added), one line per sample."""
        tok = self.policy.tokenizer
        ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
        out = self.policy.rollout.generate(
            prompts_batch(ids, seeds, range(len(ids))), params, max(len(i) for i in ids)
        )
        masks = out["response_mask"].bool()
        return [
            {"prompt": prompts[j // params.n],
             "completion": tok.decode(r[m].tolist(), skip_special_tokens=True),
             "finish_reason": out["finish_reason"][j], "tokens": int(m.sum())}
            for j, (r, m) in enumerate(zip(out["responses"], masks))
        ]  # fmt: skip

    # ----- helpers ------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> list[str]:
        ids = [r[m.bool()].tolist() for r, m in zip(batch["responses"], batch["response_mask"])]
        return self.policy.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def sft_examples(self, encoded) -> list[tuple[list[int], list[int], None]]:
        """(prompt ids, target ids, None: every target token trained, the prompt's images or None)
        from ``sft.target_field``."""
        tok, field = self.policy.tokenizer, self.cfg.sft.target_field
        out = []
        vision = getattr(encoded, "vision", None) or [None] * len(encoded.rows)
        for row, ids, images in zip(encoded.rows, encoded.ids, vision):
            if field not in row.fields:
                raise ValueError(
                    f"sft: row {row.index} of {row.source} has no '{field}' field to use as the "
                    "SFT target (sft.target_field)"
                )
            target = tok(str(row.fields[field]), add_special_tokens=False)["input_ids"]
            out.append((ids, target + [tok.eos_token_id], None, images))
        return out

    def score(self, encoded, params: SamplingParams, seed: int, progress=None,
              chunk_prompts: int = 64) -> list[dict[str, Any]]:  # fmt: skip
        """Generate ``params.n`` samples per prompt of ``encoded`` and score them: one record per
        sample (what validation, the warm start's probe and ``groupflow eval`` read)."""
        records: list[dict[str, Any]] = []
        n = params.n
        for start in range(0, len(encoded.rows), chunk_prompts):
            rows = encoded.rows[start : start + chunk_prompts]
            ids = encoded.ids[start : start + chunk_prompts]
            texts = encoded.texts[start : start + chunk_prompts]
            images = getattr(encoded, "vision", None)  # None: text prompts (or a bare table)
            vision = images[start : start + chunk_prompts] if images else None
            seeds = [seed * 7919 + (start * n + i) for i in range(len(rows) * n)]
            per_prompt = [seeds[i * n : (i + 1) * n] for i in range(len(ids))]
            out = self.policy.rollout.generate(
                prompts_batch(ids, per_prompt, range(len(ids)), vision), params,
                max(len(i) for i in ids),
            )  # fmt: skip
            masks = out["response_mask"].bool()
            resp = [r[m].tolist() for r, m in zip(out["responses"], masks)]
            completions = self.policy.tokenizer.batch_decode(resp, skip_special_tokens=True)
            sample_rows = [rows[i // n] for i in range(len(completions))]
            result = self.reward_fn(
                [texts[i // n] for i in range(len(completions))], completions,
                completion_lengths=[len(r) for r in resp], **row_fields(sample_rows),
            )  # fmt: skip
            records += records_from_scores(
                start, n, texts, sample_rows, completions, result, out["finish_reason"]
            )
            report_progress(progress, len(rows), int(masks.sum()), result.total)
        return records
