"""The calculator environment: ``reset(prompt=..., answer=...)`` poses a problem, a step whose
message is ``<calc>expression</calc>`` answers with the calculator's result (reward 0, not
done), any other message is the answer (done; reward 1 when it equals ``answer``). A third
tool call ends the episode unanswered (reward 0).

``CALC_OPENENV_LOG``, when set, names a file each finished or stepped episode appends one JSON
line to (the action received, the reward returned): the tests compare it with what groupflow
trained. ``reset(fail=...)`` makes the environment misbehave on purpose (tests): ``"raise"``
raises inside ``step``, ``"nan"`` answers with a reward of NaN."""

from __future__ import annotations

import json
import os
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from groupflow.tools.calculator import calculator

try:
    from ..models import CalcAction, CalcObservation
except ImportError:  # served from inside the package directory
    from models import CalcAction, CalcObservation

MAX_CALLS = 2
LOG_ENV = "CALC_OPENENV_LOG"


class CalcEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True  # each session has its own instance

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = ""
        self._calls = 0
        self._fail: str | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              prompt: str = "", answer: str = "", fail: str | None = None,
              **kwargs: Any) -> CalcObservation:  # fmt: skip
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._answer, self._calls, self._fail = str(answer), 0, fail
        return CalcObservation(text=prompt, done=False, reward=0.0)

    def step(self, action: CalcAction, **kwargs: Any) -> CalcObservation:  # type: ignore[override]
        self._state.step_count += 1
        if self._fail == "raise":
            raise RuntimeError("calc environment: failing on purpose")
        if self._fail == "nan":  # a malformed reward
            return CalcObservation(text="?", done=True, reward=float("nan"))
        text = action.message.strip()
        if text.startswith("<calc>"):
            self._calls += 1
            expression = text.removeprefix("<calc>").removesuffix("</calc>")
            try:
                result = calculator(expression)
            except Exception as exc:  # a bad call is an observation the model learns from
                result = f"error: {exc}"
            done = self._calls > MAX_CALLS
            obs = CalcObservation(text=result, done=done, reward=0.0)
        else:
            obs = CalcObservation(text="", done=True, reward=float(text == self._answer))
        self._log(action.message, obs)
        return obs

    def _log(self, message: str, obs: CalcObservation) -> None:
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"episode": self._state.episode_id, "action": message,
                                    "reward": obs.reward, "done": obs.done}) + "\n")  # fmt: skip

    @property
    def state(self) -> State:
        return self._state
