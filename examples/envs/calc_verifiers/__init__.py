"""The calculator task as a verifiers (0.4.0, ``verifiers.v1``) taskset: its own ``Taskset``,
``Task`` and ``TaskData`` classes, scored by ``@vf.reward`` methods (``correct``, weight 1, and
``short``, weight 0: logged, not rewarded). ``--env.taskset.id calc_verifiers`` in verifiers'
own CLI; ``rollout.verifiers.taskset: calc_verifiers`` in groupflow.

``CALC_VERIFIERS_LOG``, when set, names a file each scored reply is appended to (one JSON line:
the reply, its score): the tests compare it with what groupflow trained. A task whose prompt is
``fail`` raises in scoring (tests: a failing environment)."""

from __future__ import annotations

import json
import os
import random

import verifiers.v1 as vf

__all__ = ["CalcTaskset"]


class CalcData(vf.TaskData):
    answer: str


class CalcTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 64
    digits: int = 2
    seed: int = 0  # another seed: other problems (e.g. a held-out split)
    fail_every: int = 0  # tests: every n-th task fails in scoring (0: none)


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        if task.answer == "fail":
            raise RuntimeError("calc_verifiers: failing on purpose")
        reply = _last_reply(trace)
        score = float(reply.strip() == task.answer)
        if os.environ.get("CALC_VERIFIERS_LOG"):
            with open(os.environ["CALC_VERIFIERS_LOG"], "a") as f:
                f.write(json.dumps({"reply": reply, "correct": score}) + "\n")
        return score

    @vf.reward(weight=0.0)
    async def short(self, task: CalcData, trace: vf.Trace) -> float:
        return float(len(_last_reply(trace)) <= 2 * len(task.answer))


def _last_reply(trace) -> str:
    for message in reversed(trace.messages or []):
        if getattr(message, "role", None) == "assistant":
            content = message.content
            return content if isinstance(content, str) else ""
    return ""


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        lo, hi = 10 ** (self.config.digits - 1), 10**self.config.digits - 1
        for i in range(self.config.num_tasks):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            fail = self.config.fail_every and i % self.config.fail_every == 0
            answer = "fail" if fail else str(a * b)
            yield CalcTask(CalcData(prompt=f"{a}*{b}=", answer=answer), self.config.task)
