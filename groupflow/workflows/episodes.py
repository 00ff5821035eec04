"""Multi-turn episodes, token-in/token-out: model turn → environment → observation → model turn …

Design decision: the episode loop lives on the driver and calls the rollout worker group once per
turn with the contexts of the samples still running, so tools and environments (user code, often
I/O) stay in the single controller, the workers stay stateless, and the same loop runs locally,
on Ray and with either engine (with vLLM, its prefix cache reuses each conversation's earlier
turns). Every sample is a :class:`Episode` holding the token ids it will be trained on, built by
appending — never by re-encoding text:

    prompt ids | turn 1 (sampled ids, mask 1) | observation ids (mask 0) | turn 2 (mask 1) | …

So the ids trained are the ids sampled, and the sampling log-probs of turn k are those of the
context the model really saw. Turn 1 samples a group's G episodes from one prefill; later turns
decode each live episode from its own context, with a seed derived from (sample seed, turn), so a
sample's trajectory depends on nothing but its prompt, seed and environment.

Limits: ``max_turns`` model turns, ``max_new_tokens`` per turn, ``max_response_tokens`` for
everything after the prompt (model and observation tokens), ``max_observation_tokens`` per
observation (the observation's text is cut, marked, and rendered again), and
``max_observation_chars`` per step observation, applied to its text *before* it is tokenized: a
1 MB observation would otherwise be tokenized whole (seconds per step) only to be cut by the
token limits. Its default, :data:`CHARS_PER_TOKEN_BOUND` characters per token of the
observation's budget (BPE tokens average about 4), drops in practice only text the token limits
would drop anyway.

Images (a vision-language policy, ``agents.formats.VisionChatFormat``): an episode keeps the
``VisionInputs`` of its prompt and of each observation that showed images, in order; every turn
decodes its context with all of them (``Episode.vision``), and the batch carries them per sample
for the training forward. A model turn that samples an image placeholder token is cut before it
and ends the episode as an ``env_failure`` (``invalid``): otherwise the next turn's context would
hold a placeholder with no image behind it.

An episode ends when its environment says done (a tool environment: a turn without a tool call),
when a model turn is cut by a limit (``length``), at the turn limit (``max_turns``), or when its
environment fails (``env_failure``: raised, timed out or returned garbage — counted, and the
sample later gets ``reward.failure_value``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from groupflow.agents.calls import run_async
from groupflow.agents.environments import StepResult, reset_env, step_env
from groupflow.agents.formats import TurnFormat
from groupflow.batch import Batch
from groupflow.data import PromptRow
from groupflow.models.vision import VisionInputs, join_vision
from groupflow.rollout.engines.batching import prompts_batch
from groupflow.rollout.engines.hf import SamplingParams

log = logging.getLogger("groupflow")

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "EpisodeLimits",
    "Episode",
    "cap_chars",
    "run_episodes",
    "episodes_batch",
    "turn_seed",
]

_TRUNCATED = " …[cut]"
# The default character cap of an observation, per token of its budget.
CHARS_PER_TOKEN_BOUND = 16


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_new_tokens: int  # per model turn
    max_response_tokens: int  # model + observation tokens after the prompt
    max_observation_tokens: int | None = None
    env_timeout_s: float | None = 30.0
    max_observation_chars: int | None = None  # None: CHARS_PER_TOKEN_BOUND × its token budget

    @property
    def observation_chars(self) -> int:
        """Characters of one observation's text kept before it is tokenized."""
        if self.max_observation_chars is not None:
            return self.max_observation_chars
        budget = self.max_observation_tokens or self.max_response_tokens
        return CHARS_PER_TOKEN_BOUND * budget


@dataclass
class Episode:
    """One sample's conversation as token ids (see the module docstring)."""

    row: PromptRow
    env: Any
    seed: int
    group: int
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # in-flight weight updates: the version that sampled each token (-1: an observation's)
    versions: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    env_rewards: list[float] = field(default_factory=list)
    observation_tokens: int = 0
    images: list[VisionInputs] = field(default_factory=list)  # the prompt's, then observations'
    finish: str = ""
    failure: str | None = None
    failure_kind: str | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def vision(self) -> VisionInputs | None:
        """The images of the whole sequence (prompt and observations), in placeholder order."""
        return join_vision(self.images)

    def add_model_turn(self, ids: list[int], logprobs: list[float], text: str,
                       versions: list[int] | None = None) -> None:  # fmt: skip
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        if versions is not None:
            self.versions += versions
        self.turn_texts.append(text)
        self.messages.append({"role": "assistant", "content": text})

    def add_observation(self, ids: list[int], messages: list[dict[str, Any]],
                        vision: VisionInputs | None = None) -> None:  # fmt: skip
        if vision is not None:
            self.images.append(vision)
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        if self.versions:
            self.versions += [-1] * len(ids)
        self.observation_tokens += len(ids)
        self.messages += messages

    def fail(self, result: StepResult) -> None:
        self.finish, self.failure, self.failure_kind = (
            "env_failure",
            result.failure,
            result.failure_kind,
        )


def turn_seed(sample_seed: int, turn: int) -> int:
    """The generator seed of one sample's model turn (turn 0: the sample's own seed)."""
    return sample_seed if turn == 0 else (sample_seed * 1_000_033 + turn * 7_919) % (2**63 - 1)


def run_episodes(
    rows: Sequence[PromptRow],
    prompt_ids: Sequence[Sequence[int]],
    seeds: Sequence[int],
    group_ids: Sequence[int],
    *,
    n: int,
    generate: Callable[[Batch, SamplingParams, int], Batch],
    params: SamplingParams,
    make_env: Callable[[], Any],
    fmt: TurnFormat,
    tokenizer,
    limits: EpisodeLimits,
    max_prompt_tokens: int | None = None,
    vision: Sequence[VisionInputs | None] | None = None,
) -> list[Episode]:
    """Run ``n`` episodes per row (sample j of row i at i*n + j, seed ``seeds[i*n + j]``).

    ``prompt_ids`` are the rows' encoded prompts, ``vision`` their images (None: text prompts);
    an environment whose ``reset`` returns a first observation extends its sample's prompt
    (rendered again with it)."""
    episodes = [
        Episode(row, make_env(), seeds[i * n + j], group_ids[i], list(prompt_ids[i]),
                images=[v] if vision is not None and (v := vision[i]) is not None else [])
        for i, row in enumerate(rows)
        for j in range(n)
    ]  # fmt: skip
    placeholders = getattr(fmt, "placeholder_ids", ())
    try:
        _reset(episodes, fmt, tokenizer, limits, max_prompt_tokens)
        for turn in range(limits.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            budget = [limits.max_response_tokens - len(e.ids) for e in live]
            width = min(limits.max_new_tokens, max(budget))
            batch, per_prompt = _turn_inputs(live, turn, n, prompts_batch)
            out = generate(batch, replace(params, max_new_tokens=max(1, width), n=per_prompt), 0)
            _take_turn(live, out, budget, limits, tokenizer, turn, placeholders)
            stepping = [e for e in live if not e.done]
            if not stepping:
                continue
            results = run_async(_step_all(stepping, limits.env_timeout_s))
            for e, r in zip(stepping, results):
                _apply(e, r, turn, fmt, tokenizer, limits)
    finally:
        for e in episodes:
            close = getattr(e.env, "close", None)
            if callable(close):
                try:
                    close()
                except (Exception, SystemExit) as exc:  # user cleanup must not lose the batch
                    log.warning("closing environment %s failed: %s: %s", type(e.env).__name__,
                                type(exc).__name__, exc)  # fmt: skip
    for e in episodes:
        e.finish = e.finish or "max_turns"
    return episodes


def _reset(episodes: list[Episode], fmt: TurnFormat, tokenizer, limits: EpisodeLimits,
           max_prompt_tokens: int | None) -> None:  # fmt: skip
    results = run_async(_reset_all(episodes, limits.env_timeout_s))
    first: dict[int, tuple[int, ...]] = {}
    for e, r in zip(episodes, results):
        if r.failure is not None:
            e.fail(r)
            continue
        if r.observation:
            try:
                e.prompt_ids, images = _first_prompt(fmt, e.row.prompt, r.observation, tokenizer)
            except ValueError as exc:  # e.g. an image that cannot be used
                e.fail(StepResult(None, failure=f"{type(e.env).__qualname__}.reset: {exc}",
                                  failure_kind="invalid"))  # fmt: skip
                continue
            if images is not None:
                e.images = [images]
            e.messages += r.observation
            if max_prompt_tokens is not None and len(e.prompt_ids) > max_prompt_tokens:
                e.fail(StepResult(None, failure=f"the first observation makes the prompt "
                                  f"{len(e.prompt_ids)} tokens, more than data.max_prompt_tokens="
                                  f"{max_prompt_tokens}", failure_kind="invalid"))  # fmt: skip
        key = tuple(e.prompt_ids)
        if first.setdefault(e.group, key) != key:
            raise ValueError(
                f"environment {type(e.env).__qualname__}: reset returned different first "
                f"observations for samples of one group (row {e.row.index} of {e.row.source}); "
                "GRPO compares answers to the same prompt, so reset must depend only on the row "
                "(draw any randomness from a row field, e.g. a seed column)"
            )


def _first_prompt(fmt: TurnFormat, prompt, observation: list[dict],
                  tokenizer) -> tuple[list[int], VisionInputs | None]:  # fmt: skip
    """The ids (and images) of a prompt followed by the environment's first observation."""
    inputs = getattr(fmt, "prompt_inputs", None)
    if inputs is not None:
        _, ids, images = inputs(prompt, observation)
        return ids, images
    return tokenizer(fmt.prompt_text(prompt, observation), add_special_tokens=False)[
        "input_ids"
    ], None


async def _reset_all(episodes: list[Episode], timeout_s: float | None) -> list[StepResult]:
    return await asyncio.gather(*(reset_env(e.env, _row_dict(e.row), timeout_s) for e in episodes))


def _row_dict(row: PromptRow) -> dict[str, Any]:
    return {"prompt": row.prompt, **row.fields}


def _turn_inputs(live: list[Episode], turn: int, n: int, prompts_batch) -> tuple[Batch, int]:
    """Turn 0 of whole groups shares one prefill per prompt (n samples); later turns (and groups
    thinned by failed resets) decode each episode from its own context."""
    if turn == 0 and len(live) % n == 0:
        firsts = live[::n]
        whole = all(
            live[k * n + j].group == firsts[k].group
            and live[k * n + j].context == firsts[k].context
            for k in range(len(firsts))
            for j in range(n)
        )
        if whole:
            return prompts_batch(
                [e.context for e in firsts],
                [[e.seed for e in live[k * n : (k + 1) * n]] for k in range(len(firsts))],
                [e.group for e in firsts],
                [e.vision for e in firsts],
            ), n
    return prompts_batch(
        [e.context for e in live],
        [[turn_seed(e.seed, turn)] for e in live],
        [e.group for e in live],
        [e.vision for e in live],
    ), 1


def _take_turn(live: list[Episode], out: Batch, budget: list[int], limits: EpisodeLimits,
               tokenizer, turn: int = 0, placeholders: Sequence[int] = ()) -> None:  # fmt: skip
    responses, mask, logps = out["responses"], out["response_mask"], out["rollout_logprobs"]
    versions = out["token_versions"] if "token_versions" in out else None  # in-flight updates
    for k, e in enumerate(live):
        m = mask[k].bool()
        ids, lps = responses[k][m].tolist(), logps[k][m].tolist()
        vs = versions[k][m].tolist() if versions is not None else None
        reason = out["finish_reason"][k]
        keep = len(ids)
        if len(ids) > budget[k]:  # the batch decoded to the longest budget; this one has less
            keep, reason = budget[k], "length"
        cut = next((j for j, t in enumerate(ids[:keep]) if t in placeholders), None)
        if cut is not None:  # see the module docstring: no placeholder without its image
            keep = cut
        ids, lps, vs = ids[:keep], lps[:keep], (vs[:keep] if vs is not None else None)
        e.add_model_turn(ids, lps, tokenizer.decode(ids, skip_special_tokens=True), vs)
        if cut is not None:
            e.fail(StepResult(None, failure=f"turn {turn + 1}: the model sampled an image "
                              f"placeholder token (id {responses[k][m][cut].item()}); the turn is "
                              "cut before it", failure_kind="invalid"))  # fmt: skip
        elif reason == "length":
            e.finish = "length"


async def _step_all(episodes: list[Episode], timeout_s: float | None) -> list[StepResult]:
    return await asyncio.gather(*(step_env(e.env, e.turn_texts[-1], timeout_s) for e in episodes))


def _apply(e: Episode, r: StepResult, turn: int, fmt: TurnFormat, tokenizer,
           limits: EpisodeLimits) -> None:  # fmt: skip
    if r.failure is not None:
        e.fail(r)
        return
    e.env_rewards.append(r.reward)
    if r.done or not r.observation:
        e.finish = "stop"
        return
    if turn == limits.max_turns - 1:
        e.finish = "max_turns"
        return
    last = e.ids[-1] if e.ids else None
    observation = cap_chars(r.observation, limits.observation_chars)
    try:
        messages, ids, vision = _observation(fmt, observation, last, limits.max_observation_tokens)
    except ValueError as exc:  # the environment's observation cannot be rendered (or an image)
        e.fail(StepResult(None, failure=f"{type(e.env).__qualname__}: turn {turn + 1}: {exc}",
                          failure_kind="invalid"))  # fmt: skip
        return
    if len(e.ids) + len(ids) >= limits.max_response_tokens:  # no room left for a model token
        e.finish = "length"
        return
    e.add_observation(ids, messages, vision)


def cap_chars(messages: list[dict], max_chars: int) -> list[dict]:
    """``messages`` with at most ``max_chars`` characters of content in all, in order; a cut
    message is marked (a message past the cap keeps only the mark)."""
    left = max_chars
    out = []
    for m in messages:
        if isinstance(m["content"], list):  # content parts: the text parts count, images stay
            parts = []
            for p in m["content"]:
                if p.get("type") == "text":
                    text = p["text"]
                    if len(text) > left:
                        p = {**p, "text": text[:left] + _TRUNCATED}
                    left = max(0, left - len(text))
                parts.append(p)
            out.append({**m, "content": parts})
            continue
        text = m["content"]
        if len(text) > left:
            m = {**m, "content": text[:left] + _TRUNCATED}
        left = max(0, left - len(text))
        out.append(m)
    return out


def _cut_text(content, keep: float):
    """``content`` (text or parts) with each text cut to ``keep`` of its length, marked."""
    if isinstance(content, list):
        return [
            {**p, "text": p["text"][: int(len(p["text"]) * keep)] + _TRUNCATED}
            if p.get("type") == "text" else p
            for p in content
        ]  # fmt: skip
    return content[: int(len(content) * keep)] + _TRUNCATED


def _observation_inputs(fmt: TurnFormat, messages: list[dict], last: int | None
                        ) -> tuple[list[int], VisionInputs | None]:  # fmt: skip
    inputs = getattr(fmt, "observation_inputs", None)
    if inputs is not None:
        return inputs(messages, last)
    return fmt.observation_ids(messages, last), None


def _observation(fmt: TurnFormat, messages: list[dict], last: int | None, max_tokens: int | None
                 ) -> tuple[list[dict], list[int], VisionInputs | None]:  # fmt: skip
    """The observation's ids and images; over ``max_tokens``, its texts are cut (marked) until
    they fit (image placeholder tokens are never cut: an image is shown whole or not at all)."""
    ids, vision = _observation_inputs(fmt, messages, last)
    if max_tokens is None or len(ids) <= max_tokens:
        return messages, ids, vision
    original = [m["content"] for m in messages]
    keep = 1.0  # the share of each message's text that is kept
    for _ in range(12):
        keep *= 0.9 * max_tokens / len(ids)
        cut = [{**m, "content": _cut_text(content, keep)}
               for m, content in zip(messages, original)]  # fmt: skip
        ids, vision = _observation_inputs(fmt, cut, last)
        if len(ids) <= max_tokens:
            return cut, ids, vision
    raise ValueError(
        f"the observation's template (and images) alone are longer than max_observation_tokens="
        f"{max_tokens}"
    )


def episodes_batch(episodes: list[Episode], pad_id: int, width: int) -> Batch:
    """Fixed-width tensors of the episodes: prompts left-padded, responses right-padded to ``width``
    (so batches of different steps or ranks concatenate), observation tokens with mask 0."""
    p_width = max(len(e.prompt_ids) for e in episodes)
    b = len(episodes)
    prompt_ids = torch.full((b, p_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p_width), dtype=torch.long)
    responses = torch.full((b, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, width), dtype=torch.long)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        p = len(e.prompt_ids)
        if p:
            prompt_ids[i, p_width - p :] = torch.tensor(e.prompt_ids)
            prompt_mask[i, p_width - p :] = 1
        t = len(e.ids)
        if t:
            responses[i, :t] = torch.tensor(e.ids)
            response_mask[i, :t] = torch.tensor(e.mask)
            logprobs[i, :t] = torch.tensor(e.logprobs)
    versions = None
    if any(e.versions for e in episodes):  # in-flight updates: every model token has its version
        versions = torch.full((b, width), -1, dtype=torch.long)
        for i, e in enumerate(episodes):
            if len(e.versions) != len(e.ids):
                raise RuntimeError(f"episode {i}: {len(e.versions)} token versions for "
                                   f"{len(e.ids)} tokens")  # fmt: skip
            if e.versions:
                versions[i, : len(e.versions)] = torch.tensor(e.versions)
    objects: dict[str, Any] = {"finish_reason": [e.finish for e in episodes]}
    vision = [e.vision for e in episodes]
    if any(v is not None for v in vision):  # each sample's images, for log-probs and updates
        objects["vision"] = vision
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "rollout_logprobs": logprobs,
            "group_ids": torch.tensor([e.group for e in episodes], dtype=torch.long),
            **({"token_versions": versions} if versions is not None else {}),
        },
        objects,
    )
