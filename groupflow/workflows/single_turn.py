"""The single-turn LLM workflow: one completion per sample, G samples per prompt, then rewards.

Design decision: the workflow the trainer ran inline before workflows existed, moved here
unchanged in its numbers: a prompt's G samples share one prefill, every sample is seeded from
(run seed, step, slot), completions are decoded once for the reward functions, and the batch
is contract-checked after rollout and after rewards.
"""

from __future__ import annotations

from typing import Any

from groupflow.assembly.data import encode_prompts
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.contracts import validate
from groupflow.data import PromptRow
from groupflow.evaluation import records_from_scores, report_progress
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.workflows.llm import (
    LLM_FIELDS,
    EncodedPromptsWorkflow,
    PromptTable,
    add_rewards,
    row_fields,
    scoring_chunks,
    with_prompt_info,
)

__all__ = ["SingleTurnWorkflow"]


class SingleTurnWorkflow(EncodedPromptsWorkflow):
    """Prompt → G completions → rewards (``rollout.max_turns: 1``, no tools or environment)."""

    provided_fields = LLM_FIELDS  # handed to the reward functions with each sample
    travels_as_built = True  # to the asynchronous rollout side (workflows.detach)

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow], val_rows: list[PromptRow],
                 rewards=None):  # fmt: skip
        self.cfg, self.policy = cfg, policy
        tok = policy.tokenizer
        self.train = PromptTable(encode_prompts(train_rows, tok, cfg, "train"))
        self.val = encode_prompts(val_rows, tok, cfg, "validation") if val_rows else None
        self._set_rewards(rewards)

    # ----- the trainer's calls ------------------------------------------------------------------
    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
        params, n = self.policy.sampling, self.policy.sampling.n
        seeds, group_ids, texts, ids = self._step_prompts(rows, step, round_)
        prompts = prompts_batch(ids, seeds, group_ids, self.train.vision(rows))
        out = self.policy.rollout.generate(prompts, params, max(len(i) for i in ids))
        batch = with_prompt_info(out, rows, texts, n, f"{step}-{round_}", version)
        batch["completion"] = self.decode(batch)
        validate(batch, self.contracts["rollout"])
        batch, metrics = add_rewards(self.reward_fn, batch, list(batch["completion"]))
        return validate(batch, self.contracts["rewarded"]), metrics

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
        for start, rows, ids, texts, seeds, vision in scoring_chunks(
            encoded, n, seed, chunk_prompts
        ):
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
