"""Recording a training run's agent episodes: one API key per episode, every call kept as sampled.

Design decision: the server's ``Access`` seam (``serve.access``) is where training hooks in. An
``EpisodeRecorder`` opens a key per episode; a request with an unknown key is refused (401), so
every call is attributed to its episode. It imposes the run's sampling (temperature, top-p/k,
min-p — what the training forward's log-probs assume; a request asking otherwise is counted in
``overrides`` and decoded with the run's settings), caps ``max_tokens`` at the run's
``rollout.max_new_tokens``, and draws each sample's seed from the episode's seed and a call
counter — so an episode's tokens depend on its seed and the agent's requests, not on which
episodes ran beside it. ``merge_calls`` turns an episode's calls into training samples (below).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field, replace

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.access import CallRecord

__all__ = ["EpisodeRecorder", "Chain", "merge_calls", "call_seed"]


def call_seed(episode_seed: int, k: int) -> int:
    """The seed of an episode's k-th sampled completion (k = 0: the episode's own seed)."""
    return episode_seed if k == 0 else (episode_seed * 1_000_033 + k * 7_919) % (2**63 - 1)


@dataclass
class _Open:
    seed: int
    sampling: SamplingParams
    calls: list[CallRecord] = field(default_factory=list)
    sampled: int = 0  # completions drawn so far (the seed counter)
    script: list[list[int]] | None = None  # a demonstration's turns, answered in order
    max_calls: int | None = None  # calls allowed; beyond, each is refused (and counted)
    started: int = 0  # calls that reached sampling
    refused: int = 0  # calls refused for max_calls


class EpisodeRecorder:
    """``serve.access.Access`` for a training run (see the module docstring). Thread-safe: the server
    thread records while the driver opens and closes episodes."""

    def __init__(self):
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self.overrides = 0  # requests whose sampling settings the run's replaced
        self.late_calls = 0  # calls that finished after their episode closed (dropped)

    def open(self, seed: int, sampling: SamplingParams,
             script: list[list[int]] | None = None, max_calls: int | None = None) -> str:  # fmt: skip
        """A new episode's API key. ``script``: the ids of a demonstration's model turns — each
        call is answered with the next one instead of a sample (the warm start plays
        demonstrations through the agent itself, so its tools write the observations).
        ``max_calls``: the episode's calls beyond this many are refused (``refused``)."""
        key = f"gf-episode-{secrets.token_hex(12)}"
        script = None if script is None else list(script)
        with self._lock:
            self._open[key] = _Open(seed, sampling, script=script, max_calls=max_calls)
        return key

    def refused(self, key: str) -> int:
        """Calls of the open episode ``key`` refused for its ``max_calls``."""
        with self._lock:
            episode = self._find(key)
            return episode.refused if episode is not None else 0

    def close(self, key: str) -> list[CallRecord]:
        with self._lock:
            episode = self._open.pop(key, None)
        return episode.calls if episode is not None else []

    def open_count(self) -> int:
        """Episodes open now: how many requests the batcher can expect at once."""
        return len(self._open)

    # ----- Access -----------------------------------------------------------------------------
    def _find(self, key: str | None) -> _Open | None:
        """The open episode of ``key`` (None: a call without one); under the lock."""
        return None if key is None else self._open.get(key)

    def authorize(self, key: str | None) -> bool:
        with self._lock:
            return key in self._open

    def params(self, key: str | None, requested: SamplingParams) -> SamplingParams:
        with self._lock:
            episode = self._find(key)
        if episode is None:
            return requested
        s = episode.sampling
        run = (s.temperature, s.top_p, s.top_k, s.min_p)
        if (requested.temperature, requested.top_p, requested.top_k, requested.min_p) != run:
            self.overrides += 1
        return replace(
            requested, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            max_new_tokens=min(requested.max_new_tokens, s.max_new_tokens),
            stop=tuple(dict.fromkeys((*requested.stop, *s.stop))),
            static_kv_cache=s.static_kv_cache,
        )  # fmt: skip

    def seeds(self, key: str | None, count: int, seed: int | None) -> list[int]:
        with self._lock:
            episode = self._find(key)
            if episode is None:
                return [0] * count
            start = episode.sampled
            episode.sampled += count
        return [call_seed(episode.seed, start + j) for j in range(count)]

    def scripted(self, key: str | None, count: int) -> list[list[int]] | None:
        # every call passes here before it is sampled: the episode's call budget is spent here
        with self._lock:
            episode = self._find(key)
            if episode is None:
                return None
            if episode.max_calls is not None and episode.started >= episode.max_calls:
                episode.refused += 1
                raise ValueError(
                    f"this episode has made its {episode.max_calls} calls "
                    "(rollout.agent_max_calls); further calls are refused"
                )
            episode.started += 1
            if episode.script is None:
                return None
            if count != 1 or not episode.script:
                raise ValueError(
                    "the demonstration has no model turn left for this call"
                    if count == 1
                    else "a demonstration answers one choice per call (n = 1)"
                )
            return [episode.script.pop(0)]

    def remaining_script(self, key: str) -> int:
        with self._lock:
            episode = self._find(key)
            return len(episode.script or []) if episode is not None else 0

    def record(self, key: str | None, call: CallRecord) -> None:
        with self._lock:
            episode = self._find(key)
            if episode is None:
                self.late_calls += 1
                return
            episode.calls.append(call)


@dataclass
class Chain:
    """One training sample: a prompt, then sampled completions (mask 1) and what came between
    them (mask 0)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    calls: int = 0
    # in-flight weight updates: the version that sampled each id (-1 where the mask is 0);
    # None when its completions carry none
    versions: list[int] | None = None

    @property
    def full(self) -> list[int]:
        return self.prompt_ids + self.ids


def merge_calls(calls: list[CallRecord]) -> list[Chain]:
    """An episode's calls as training samples, in call order: a completion whose prompt extends
    an earlier sample's prompt + completions (the agent sent back the conversation so far — the
    usual case, and what the server's continuation guarantees when the client did not edit the
    history) is appended to that sample, the tokens in between masked out; any other completion
    starts a sample of its own (step-wise: they share the episode's advantage). Choices of one
    request (``n`` > 1) branch, so each starts its own sample. Token versions (in-flight
    updates) follow their ids; what lies between completions gets -1."""
    chains: list[Chain] = []
    for call in calls:
        extended: set[int] = set()
        for c in call.completions:
            target = None
            for k in range(len(chains) - 1, -1, -1):
                full = chains[k].full
                if (
                    k not in extended
                    and len(call.prompt_ids) >= len(full)
                    and (call.prompt_ids[: len(full)] == full)
                ):
                    target = k
                    break
            if target is None:
                chains.append(Chain(list(call.prompt_ids)))
                target = len(chains) - 1
            chain = chains[target]
            between = call.prompt_ids[len(chain.full) :]
            chain.ids += between + c.ids
            chain.mask += [0] * len(between) + [1] * len(c.ids)
            chain.logprobs += [0.0] * len(between) + list(c.logprobs)
            if c.versions is not None:
                had = chain.versions if chain.versions is not None else []
                chain.versions = had + [-1] * (len(chain.ids) - len(had) - len(c.ids)) + c.versions
            chain.finish, chain.calls = c.finish, chain.calls + 1
            extended.add(target)
    return chains
