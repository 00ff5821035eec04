"""The multi-turn LLM workflow: conversations with tools or an environment, token-in/token-out.

Design decision: the episodes themselves are ``episodes.run_episodes`` (the token bookkeeping);
this class wires them to the run — prompt encoding with the tools described, one environment per
sample (a :class:`~groupflow.agents.environments.ToolEnvironment` over ``rollout.tools``, or the
``rollout.environment`` class), rewards that receive the whole trajectory, failure accounting, and
per-step tool metrics. Reward functions get, besides the dataset fields:

- ``completions``: the text of the model's *last* turn (what answer-checking rewards read);
- ``trajectory``: the whole response text after the prompt (model turns and observations);
- ``messages``: the conversation after the prompt as chat messages (assistant / tool / user);
- ``turns``, ``tool_calls``: counts; ``env_rewards``: the environment's reward per step.

A vision-language policy (the model has a processor) renders prompts and observations with
``agents.formats.VisionChatFormat``: prompts and observations may show images, which each later
turn and the training forward see with the sample (``workflows.episodes``).

A sample whose environment failed (raised, timed out, returned garbage) gets
``reward.failure_value`` whatever its reward functions say, and is counted in
``rollout/env_failures``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import torch

from groupflow.agents.calls import run_async
from groupflow.agents.environments import environment_factory, reset_env, step_env
from groupflow.agents.formats import ChatFormat, PlainFormat, TemplateError, VisionChatFormat
from groupflow.agents.parsers import build_parser
from groupflow.agents.tools import build_tools
from groupflow.assembly.data import EncodedPrompts, encode_prompts
from groupflow.assembly.tokenizers import build_processor
from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.contracts import validate
from groupflow.data import DataError, PromptRow
from groupflow.data.images import ImageLimits
from groupflow.data.tokenizer import DEFAULT_ALPHABET
from groupflow.evaluation import records_from_scores, report_progress
from groupflow.models.vision import join_vision
from groupflow.rollout.engines.hf import SamplingParams
from groupflow.utils.imports import resolve_import_path
from groupflow.workflows.episodes import Episode, EpisodeLimits, episodes_batch, run_episodes
from groupflow.workflows.llm import (
    LLM_FIELDS,
    EncodedPromptsWorkflow,
    PromptTable,
    finite_metrics,
    row_fields,
    scoring_chunks,
    sft_turns,
    with_prompt_info,
)

log = logging.getLogger("groupflow")

__all__ = ["MultiTurnWorkflow", "TRAJECTORY_FIELDS"]

# Per-sample fields a multi-turn reward function may ask for by name.
TRAJECTORY_FIELDS = ("trajectory", "messages", "turns", "tool_calls", "env_rewards")


class MultiTurnWorkflow(EncodedPromptsWorkflow):
    """Prompt → G conversations of up to ``rollout.max_turns`` model turns → rewards."""

    # handed to the reward functions with each sample
    provided_fields = (*LLM_FIELDS, *TRAJECTORY_FIELDS)
    # built over the policy (its tokenizer, live tools): the rollout side builds its own
    over_policy = (*EncodedPromptsWorkflow.over_policy, "tools", "make_env", "format")
    travels_as_built = True  # to the asynchronous rollout side (workflows.detach)

    def __init__(self, cfg: Config, policy, train_rows: list[PromptRow], val_rows: list[PromptRow],
                 rewards=None):  # fmt: skip
        self.cfg, self.policy = cfg, policy
        r = cfg.rollout
        tok = policy.tokenizer
        templated = self._episode_parts(policy)

        def render(row: PromptRow, _tok, _flag) -> str:
            try:
                return self.format.prompt_text(row.prompt)
            except TemplateError as exc:
                raise DataError(
                    str(exc), source=row.source, index=row.index, field="prompt"
                ) from None

        def encode_images(row: PromptRow):
            if not isinstance(self.format, VisionChatFormat):
                raise DataError(
                    "this prompt shows images but the model is text-only, or its turns are "
                    "plain text (rollout.observation_template); use a vision-language model "
                    "with its chat template", source=row.source, index=row.index, field="prompt",
                )  # fmt: skip
            try:
                return self.format.prompt_inputs(row.prompt)
            except (TemplateError, ValueError) as exc:
                raise DataError(
                    str(exc), source=row.source, index=row.index, field="prompt"
                ) from None

        def encode(rows: list[PromptRow], split: str) -> EncodedPrompts:
            return encode_prompts(rows, tok, cfg, split, render=render, templated=templated,
                                  encode_images=encode_images)  # fmt: skip

        self.train = PromptTable(encode(train_rows, "train"))
        self.val = encode(val_rows, "validation") if val_rows else None
        self.limits = EpisodeLimits(
            max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
            max_response_tokens=r.max_response_tokens or r.max_new_tokens * r.max_turns,
            max_observation_tokens=r.max_observation_tokens, env_timeout_s=r.env_timeout_s,
            max_observation_chars=r.max_observation_chars,
        )  # fmt: skip
        self._set_rewards(rewards)

    def _episode_parts(self, policy) -> bool:
        """The tools, the environment factory and the turn format over ``policy``'s tokenizer
        (from ``rollout``); whether prompts are rendered by a chat template."""
        cfg, tok = self.cfg, policy.tokenizer
        r = cfg.rollout
        self.tools = build_tools(r.tools, default_timeout_s=r.tool_timeout_s)
        parser = build_parser(r.tool_parser) if self.tools else None
        env_spec = None
        if r.environment is not None:
            cls = resolve_import_path(r.environment.cls, "rollout.environment.class")
            env_spec = (cls, dict(r.environment.kwargs))
        self.make_env = environment_factory(
            env_spec, self.tools, parser, max_calls_per_turn=r.max_tool_calls_per_turn,
            max_result_chars=r.max_tool_result_chars,
        )  # fmt: skip
        schemas = [t.schema for t in self.tools]
        processor = build_processor(cfg, tok)
        if r.observation_template is not None:
            self.format = PlainFormat(tok, r.observation_template)
            return False
        if processor is not None:  # a vision-language model: prompts and observations may
            # show images, rendered by the processor's template (agents.formats)
            limits = ImageLimits(max_pixels=cfg.data.max_pixels, min_pixels=cfg.data.min_pixels,
                                 max_file_bytes=cfg.data.max_image_bytes)  # fmt: skip
            self.format = VisionChatFormat(processor, schemas, limits)
            return True
        self.format = ChatFormat(tok, schemas)
        return True

    def attach(self, policy, rewards) -> None:
        self._episode_parts(policy)
        self._set_rewards(rewards)

    @staticmethod
    def tokenizer_texts(cfg: Config) -> list[str]:
        return _tokenizer_texts(cfg)

    # ----- the trainer's calls ------------------------------------------------------------------
    def collect(self, rows: list[PromptRow], step: int, round_: int,
                version: int) -> tuple[Batch, dict[str, float]]:  # fmt: skip
        params, n = self.policy.sampling, self.policy.sampling.n
        seeds, group_ids, texts, ids = self._step_prompts(rows, step, round_)
        episodes = self.run(rows, ids, [s for per in seeds for s in per], group_ids, params,
                            self.train.vision(rows))  # fmt: skip
        batch = episodes_batch(
            episodes, self.policy.tokenizer.pad_token_id, self.limits.max_response_tokens
        )
        batch = with_prompt_info(batch, rows, texts, n, f"{step}-{round_}", version)
        batch["completion"] = [e.turn_texts[-1] if e.turn_texts else "" for e in episodes]
        validate(batch, self.contracts["rollout"])
        batch, reward_metrics = self.add_rewards(batch, episodes)
        metrics = {**episode_metrics(episodes), **reward_metrics}
        return validate(batch, self.contracts["rewarded"]), metrics

    # ----- episodes -----------------------------------------------------------------------------
    def run(self, rows, prompt_ids, seeds, group_ids, params: SamplingParams,
            vision=None) -> list[Episode]:  # fmt: skip
        """``vision``: each row's prompt images (``models.vision.VisionInputs`` or None)."""
        return run_episodes(
            rows, prompt_ids, seeds, group_ids, n=params.n, generate=self.policy.rollout.generate,
            params=params, make_env=self.make_env, fmt=self.format,
            tokenizer=self.policy.tokenizer, limits=self.limits,
            max_prompt_tokens=self.cfg.data.max_prompt_tokens, vision=vision,
        )  # fmt: skip

    def add_rewards(self, batch: Batch, episodes: list[Episode]) -> tuple[Batch, dict]:
        fields = trajectory_fields(episodes, self.policy.tokenizer)
        lengths = batch["response_mask"].sum(1).tolist()
        result = self.reward_fn(
            list(batch["prompt"]), list(batch["completion"]), completion_lengths=lengths,
            group_ids=batch["group_ids"], **row_fields(batch["row"]), **fields,
        )  # fmt: skip
        batch["rewards"] = self.failed_to_failure_value(result.total.float(), episodes)
        batch["trajectory"] = fields["trajectory"]
        batch["messages"] = fields["messages"]
        _log_first_failure(episodes)
        return batch, finite_metrics(result.metrics)

    def failed_to_failure_value(
        self, rewards: torch.Tensor, episodes: list[Episode]
    ) -> torch.Tensor:
        """A sample whose environment failed gets ``reward.failure_value``, whatever was scored."""
        failed = torch.tensor([e.failure is not None for e in episodes])
        return torch.where(failed, torch.tensor(self.cfg.reward.failure_value), rewards)

    def score(self, encoded, params: SamplingParams, seed: int, progress=None,
              chunk_prompts: int = 64) -> list[dict[str, Any]]:  # fmt: skip
        """Run ``params.n`` episodes per prompt of ``encoded`` and score them (one record per
        sample, with its turn and tool-call counts)."""
        records: list[dict[str, Any]] = []
        n = params.n
        for start, rows, ids, texts, seeds, vision in scoring_chunks(
            encoded, n, seed, chunk_prompts
        ):
            episodes = self.run(rows, ids, seeds, list(range(len(rows))), params, vision)
            sample_rows = [rows[i // n] for i in range(len(episodes))]
            fields = trajectory_fields(episodes, self.policy.tokenizer)
            completions = [e.turn_texts[-1] if e.turn_texts else "" for e in episodes]
            result = self.reward_fn(
                [texts[i // n] for i in range(len(episodes))], completions,
                completion_lengths=[sum(e.mask) for e in episodes], **row_fields(sample_rows),
                **fields,
            )  # fmt: skip
            result = dataclasses.replace(
                result, total=self.failed_to_failure_value(result.total, episodes)
            )
            records += records_from_scores(
                start, n, texts, sample_rows, completions, result, [e.finish for e in episodes],
                extras={"turns": fields["turns"], "tool_calls": fields["tool_calls"],
                        "trajectory": fields["trajectory"]},
            )  # fmt: skip
            report_progress(progress, len(rows), sum(sum(e.mask) for e in episodes), result.total)
        return records

    def sample(self, prompts: list[str], params: SamplingParams,
               seeds: list[list[int]]) -> list[dict[str, Any]]:  # fmt: skip
        """``groupflow generate``: ``params.n`` episodes from each prompt text (as a user turn, tools
        described), one line per sample with the whole trajectory."""
        rows = [PromptRow(p, {}, "<generate>", i) for i, p in enumerate(prompts)]
        tok = self.policy.tokenizer
        special = isinstance(self.format, PlainFormat)  # as encode_prompts: plain text gets BOS
        ids = [
            tok(self.format.prompt_text(p), add_special_tokens=special)["input_ids"]
            for p in prompts
        ]
        flat = [s for per_prompt in seeds for s in per_prompt]
        episodes = self.run(rows, ids, flat, list(range(len(rows))), params)
        return [
            {"prompt": prompts[j // params.n], "completion": e.turn_texts[-1] if e.turn_texts else "",
             "trajectory": tok.decode(e.ids, skip_special_tokens=True), "turns": len(e.turn_texts),
             "finish_reason": e.finish, "tokens": sum(e.mask)}
            for j, e in enumerate(episodes)
        ]  # fmt: skip

    def sft_examples(self, encoded) -> list[tuple]:
        """Demonstrations from the rows' ``sft.target_field``: a list of model turns (or one
        string), played through a fresh environment so the observation tokens between them are
        the environment's own — masked out of the loss, as in RL. Each example: (prompt ids,
        target ids, loss mask[, the images of prompt and observations where there are some])."""
        field = self.cfg.sft.target_field
        tok = self.policy.tokenizer
        out = []
        prompt_vision = getattr(encoded, "vision", None) or [None] * len(encoded.rows)
        for row, ids, images in zip(encoded.rows, encoded.ids, prompt_vision):
            turns = sft_turns(row, field)
            target, mask, shown = teacher_trajectory(self, row, turns, tok)
            vision = join_vision([images, *shown])
            out.append((ids, target, mask) if vision is None else (ids, target, mask, vision))
        return out


def teacher_trajectory(workflow: MultiTurnWorkflow, row: PromptRow, turns: list[str], tok):
    """Target ids, loss mask and observation images (``VisionInputs`` list) of a demonstrated
    conversation: each model turn tokenized (the last one ends with EOS), each observation
    produced by a real environment step (mask 0)."""
    env = workflow.make_env()
    timeout = workflow.limits.env_timeout_s
    first = run_async(reset_env(env, {"prompt": row.prompt, **row.fields}, timeout))
    if first.failure or first.observation:
        raise ValueError(
            f"sft: row {row.index} of {row.source}: demonstrations need an environment whose "
            f"reset adds nothing to the prompt ({first.failure or 'it returned an observation'})"
        )
    ids: list[int] = []
    mask: list[int] = []
    shown = []
    for k, text in enumerate(turns):
        turn = tok(text, add_special_tokens=False)["input_ids"]
        if k == len(turns) - 1:
            turn = turn + [tok.eos_token_id]
        ids += turn
        mask += [1] * len(turn)
        if k == len(turns) - 1:
            break
        step = run_async(step_env(env, text, timeout))
        if step.failure or step.done or not step.observation:
            raise ValueError(
                f"sft: row {row.index} of {row.source}: the environment ended the demonstration "
                f"after turn {k + 1} of {len(turns)} ({step.failure or 'done'})"
            )
        inputs = getattr(workflow.format, "observation_inputs", None)
        last = turn[-1] if turn else None
        if inputs is not None:
            obs, images = inputs(step.observation, last)
            shown += [images] if images is not None else []
        else:
            obs = workflow.format.observation_ids(step.observation, last)
        ids += obs
        mask += [0] * len(obs)
    return ids, mask, shown


def _tokenizer_texts(cfg: Config) -> list[str]:
    """Text a tiny model's character tokenizer must cover beyond the data: the observation
    template, tool names and tool-call syntax, and the characters of error observations."""
    r = cfg.rollout
    names = [t.label or t.name or "" for t in r.tools]
    return [DEFAULT_ALPHABET, r.observation_template or "", *names, '<>/{}[]":,']


def trajectory_fields(episodes: list[Episode], tok) -> dict[str, list]:
    return {
        "trajectory": [tok.decode(e.ids, skip_special_tokens=True) for e in episodes],
        "messages": [list(e.messages) for e in episodes],
        "turns": [len(e.turn_texts) for e in episodes],
        "tool_calls": [getattr(e.env, "stats", {}).get("tool_calls", 0) for e in episodes],
        "env_rewards": [list(e.env_rewards) for e in episodes],
    }


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Turns, tool use, observation tokens, how episodes ended, and user-code failures."""
    n = len(episodes)
    stats = Counter()
    for e in episodes:
        stats.update(getattr(e.env, "stats", {}))
    finishes = Counter(e.finish for e in episodes)
    failures = Counter(e.failure_kind for e in episodes if e.failure is not None)
    calls = [getattr(e.env, "stats", {}).get("tool_calls", 0) for e in episodes]
    m = {
        "rollout/turns/mean": sum(len(e.turn_texts) for e in episodes) / n,
        "rollout/observation_tokens/mean": sum(e.observation_tokens for e in episodes) / n,
        "rollout/env_failures": float(sum(failures.values())),
        "rollout/env_timeouts": float(failures.get("timeout", 0)),
    }
    if any(hasattr(e.env, "stats") for e in episodes):
        m["rollout/tool_calls/mean"] = sum(calls) / n
        m["rollout/tool_call_rate"] = sum(c > 0 for c in calls) / n
        for key in ("tool_errors", "tool_timeouts", "bad_calls", "sandbox_failures"):
            m[f"rollout/{key}"] = float(stats.get(key, 0))
    for reason in ("stop", "length", "max_turns", "env_failure"):
        m[f"rollout/finish/{reason}"] = finishes.get(reason, 0) / n
    return m


_logged_failures: set[str | None] = set()


def _log_first_failure(episodes: list[Episode]) -> None:
    """Each kind of environment failure is logged once (then only counted)."""
    for e in episodes:
        if e.failure is not None and e.failure_kind not in _logged_failures:
            _logged_failures.add(e.failure_kind)
            log.warning(
                "environment failure (%s) on row %d of %s: %s — the sample gets "
                "reward.failure_value; further failures are counted in rollout/env_failures",
                e.failure_kind, e.row.index, e.row.source, e.failure,
            )  # fmt: skip
