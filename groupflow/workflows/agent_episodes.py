"""Agent episodes and what a finished one becomes: a reward, training samples, metrics.

Design decision: an episode is plain data (``AgentEpisode``: its row, seed, group, the calls the
server recorded under its key, the agent's return value or why it failed), and turning finished
episodes into a training batch is a pure function of them, the tokenizer and the sample width —
no server, no event loop — so it is read, tested and reused apart from the loop that runs them
(``workflows.agent``). Samples (``episode_samples``): ``merge_calls`` joins an episode's calls
into one sample when each call's prompt extends the previous call's prompt + completion, else
one per call; every sample carries its episode's reward and id (``episode_ids``: the credit
stage counts a split episode once in its group). An episode without a call still counts in its
group through a one-token, masked-out placeholder. Rewards (``episode_rewards``): the agent's
return value, the configured reward functions on the final conversation, or their sum; a failed
episode gets ``reward.failure_value``.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from groupflow.batch import Batch
from groupflow.config import Config
from groupflow.data import PromptRow
from groupflow.serve.access import CallRecord
from groupflow.serve.recording import Chain, merge_calls
from groupflow.workflows.episodes import Episode, episodes_batch
from groupflow.workflows.llm import finite_metrics, row_fields, sample_versions

__all__ = [
    "AgentEpisode",
    "FAILURE_KINDS",
    "agent_metrics",
    "episode_rewards",
    "episode_samples",
    "prompt_key",
]

# Why an episode failed (rollout/agent/failures/<kind>); "blocked": its sync code held the event
# loop past its rollout.agent_timeout_s.
FAILURE_KINDS = ("raised", "timeout", "blocked", "no_call", "invalid", "max_calls")


@dataclass
class AgentEpisode:
    row: PromptRow
    seed: int
    group: int
    calls: list[CallRecord] = field(default_factory=list)
    reward: float | None = None  # from the agent's return value
    extras: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    failure_kind: str | None = None
    # the run of it on an event loop: its server key, when its agent started, whether it is done
    key: str | None = None
    started: float | None = None
    finished: bool = False

    def fail(self, kind: str, message: str) -> None:
        self.failure_kind, self.failure = kind, message

    def fresh(self) -> AgentEpisode:
        """The same episode, not run yet."""
        return AgentEpisode(self.row, self.seed, self.group)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The final conversation: the last chat call's messages and the answer it got."""
        for call in reversed(self.calls):
            if call.messages is not None:
                # a chat call's responses are its assistant messages (CallRecord)
                return [*call.messages, *cast(list[dict[str, Any]], call.responses[:1])]
        return []

    @property
    def completion(self) -> str:
        for call in reversed(self.calls):
            if call.responses:
                r = call.responses[0]
                return r if isinstance(r, str) else (r.get("content") or "")
        return ""

    @property
    def tool_calls(self) -> int:
        return sum(c.tool_calls for c in self.calls)


def prompt_key(row: PromptRow) -> str:
    return row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt, sort_keys=True)


def episode_rewards(
    cfg: Config, reward_fn, episodes: list[AgentEpisode], train: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """One reward per episode (``rollout.agent_reward``: the agent's ``return``, the reward
    ``functions`` — ``reward_fn`` — on the final conversation, or ``both`` summed); ``train``: a
    training batch, whose groups ``reward.normalize: group`` uses (validation reports the plain
    weighted sum)."""
    how = cfg.rollout.agent_reward
    total = torch.tensor([e.reward or 0.0 for e in episodes], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if how != "return":
        fields = {"messages": [e.messages for e in episodes],
                  "agent_calls": [len(e.calls) for e in episodes]}  # fmt: skip
        result = reward_fn(
            [prompt_key(e.row) for e in episodes], [e.completion for e in episodes],
            completion_lengths=[sum(len(c.ids) for call in e.calls for c in call.completions)
                                for e in episodes],
            group_ids=[e.group for e in episodes] if train else None,
            **row_fields([e.row for e in episodes]), **fields,
        )  # fmt: skip
        total = total + result.total.float() if how == "both" else result.total.float()
        metrics = finite_metrics(result.metrics)
    failed = torch.tensor([e.failure is not None for e in episodes])
    total = torch.where(failed, torch.tensor(cfg.reward.failure_value), total)
    return total, metrics


def episode_samples(tok, width: int, episodes: list[AgentEpisode], rewards: torch.Tensor,
                    uid: str, version: int) -> tuple[Batch, Counter]:  # fmt: skip
    """The episodes' samples (``merge_calls``), each with its episode's reward and id; a sample
    longer than ``width`` (``rollout.max_response_tokens``) is cut there and counted. With
    in-flight weight updates every sampled token keeps its version (``token_versions``; -1 in
    a sample that sampled nothing, e.g. a placeholder) and a sample is as old as its oldest."""
    samples, owner, counts = [], [], Counter()
    per_episode = [merge_calls(e.calls) or [placeholder_chain(tok, e)] for e in episodes]
    in_flight = any(c.versions is not None for chains in per_episode for c in chains)
    for k, (e, chains) in enumerate(zip(episodes, per_episode)):
        counts["samples"] += len(chains)
        counts["split_episodes"] += len(chains) > 1
        for chain in chains:
            versions = chain.versions if chain.versions is not None else [-1] * len(chain.ids)
            if len(chain.ids) > width:  # the sample's width: rollout.max_response_tokens
                counts["truncated"] += 1
                chain = Chain(chain.prompt_ids, chain.ids[:width],
                              chain.mask[:width], chain.logprobs[:width], "length")  # fmt: skip
            samples.append(Episode(e.row, None, e.seed, e.group, chain.prompt_ids, chain.ids,
                                   chain.mask, chain.logprobs,
                                   versions[:width] if in_flight else [],
                                   finish=chain.finish))  # fmt: skip
            owner.append(k)
    batch = episodes_batch(samples, tok.pad_token_id, width)
    batch["uid"] = [f"{uid}-{i}" for i in range(len(samples))]
    batch["prompt"] = [prompt_key(episodes[k].row) for k in owner]
    batch["row"] = [episodes[k].row for k in owner]
    batch["version"] = sample_versions(batch, version)
    batch["episode_ids"] = torch.tensor(owner, dtype=torch.long)
    batch["completion"] = [episodes[k].completion for k in owner]
    batch["messages"] = [episodes[k].messages for k in owner]
    batch["rewards"] = rewards[torch.tensor(owner, dtype=torch.long)]
    return batch, counts


def placeholder_chain(tok, e: AgentEpisode) -> Chain:
    """An episode without a call still counts in its group (reward.failure_value): its row's
    prompt with one masked-out token, so it trains nothing itself."""
    text = prompt_key(e.row)
    if getattr(tok, "chat_template", None) and isinstance(e.row.prompt, (str, list)):
        msgs = [{"role": "user", "content": e.row.prompt}] if isinstance(e.row.prompt, str) \
            else e.row.prompt  # fmt: skip
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = list(tok(text, add_special_tokens=False)["input_ids"]) or [tok.pad_token_id]
    return Chain(ids, [tok.pad_token_id], [0], [0.0], "stop")


def agent_metrics(episodes: list[AgentEpisode], counts: Counter) -> dict[str, float]:
    """Calls, samples per episode, tool use and failures of one collect round."""
    n = len(episodes)
    failures = Counter(e.failure_kind for e in episodes if e.failure is not None)
    m = {
        "rollout/agent/episodes": float(n),
        "rollout/agent/calls/mean": sum(len(e.calls) for e in episodes) / n,
        "rollout/agent/samples_per_episode": counts["samples"] / n,
        "rollout/agent/split_episodes": float(counts["split_episodes"]),
        "rollout/agent/truncated_samples": float(counts["truncated"]),
        "rollout/agent/tool_calls/mean": sum(e.tool_calls for e in episodes) / n,
        "rollout/agent/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "rollout/agent/failures": float(sum(failures.values())),
    }
    for kind in FAILURE_KINDS:
        m[f"rollout/agent/failures/{kind}"] = float(failures.get(kind, 0))
    extras = {k for e in episodes for k in e.extras}
    for k in sorted(extras):
        values = [e.extras[k] for e in episodes if k in e.extras]
        m[f"rollout/agent/{k}"] = statistics.fmean(values)
    return m
