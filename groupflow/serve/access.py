"""``Access``: who may call the server, with which sampling settings, and what is recorded.

Design decision: ``Access`` is the seam between serving and training: ``OpenAccess`` (``groupflow
serve``: one optional API key, the request's sampling settings) or a training run's episode
recorder (``serve.recording``: one key per episode, the run's sampling settings, every call kept
as a ``CallRecord``) — ``ServerCore`` and the HTTP code are the same for both. A server bound to
an address outside ``LOCAL_HOSTS`` needs an API key (``serve.thread``).
"""

from __future__ import annotations

import hmac
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from groupflow.rollout.engines.hf import SamplingParams
from groupflow.serve.batcher import Completion

__all__ = ["LOCAL_HOSTS", "CallRecord", "Access", "OpenAccess"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class CallRecord:
    """One engine call of a request, as sampled: what a training run records."""

    prompt_ids: list[int]
    completions: list[Completion]
    messages: list[dict[str, Any]] | None  # the request's messages (chat), None for /completions
    # the assistant messages (chat), the texts (/completions)
    responses: list[dict[str, Any]] | list[str] = field(default_factory=list)
    tool_calls: int = 0  # over all choices


class Access(Protocol):
    def authorize(self, key: str | None) -> bool: ...

    def params(self, key: str | None, requested: SamplingParams) -> SamplingParams: ...

    def seeds(self, key: str | None, count: int, seed: int | None) -> list[int]: ...

    def record(self, key: str | None, call: CallRecord) -> None: ...

    def scripted(self, key: str | None, count: int) -> list[list[int]] | None:
        """Ids to answer with instead of sampling (a demonstration played through the agent),
        or None: sample."""
        ...


class OpenAccess:
    """``groupflow serve``: an optional API key, the request's own sampling, nothing recorded."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key

    def authorize(self, key: str | None) -> bool:
        if not self.api_key:
            return True
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())

    def params(self, key, requested: SamplingParams) -> SamplingParams:
        return requested

    def seeds(self, key, count: int, seed: int | None) -> list[int]:
        if seed is None:
            return [random.getrandbits(62) for _ in range(count)]
        # choice j of a request seeded s: s + j, wrapped into [0, 2^63) — what every engine's
        # generator takes, for any 64-bit request seed (the request model checks the range)
        return [(seed + j) % 2**63 for j in range(count)]

    def record(self, key, call: CallRecord) -> None:
        return None

    def scripted(self, key, count: int) -> None:
        return None
