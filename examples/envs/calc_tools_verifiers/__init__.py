"""The calculator task with a tool, as a verifiers (0.4.0, ``verifiers.v1``) taskset: the task
serves a ``calc`` tool (its ``Toolset``, an MCP server verifiers launches per rollout; the
``@vf.tool`` method's docstring is the tool's description), the harness hands the model's tool
calls to it and the results back, and ``@vf.reward correct`` scores the final reply. A
multi-turn tool environment built with verifiers' own classes. The toolset lives in a module of
its own (``toolset.py``): verifiers serves it with ``python -m calc_tools_verifiers.toolset``."""

from __future__ import annotations

import random

import verifiers.v1 as vf

from calc_tools_verifiers.toolset import CalcToolset

__all__ = ["CalcToolsTaskset"]


class CalcData(vf.TaskData):
    answer: str


class CalcToolsTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 64
    digits: int = 2
    seed: int = 0


class CalcToolsTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages or [] if getattr(m, "role", None) == "assistant"]
        last = replies[-1].content if replies else ""
        return float(isinstance(last, str) and last.strip() == task.answer)

    @vf.reward(weight=0.0)
    async def used_tool(self, task: CalcData, trace: vf.Trace) -> float:
        return float(any(getattr(m, "role", None) == "tool" for m in trace.messages or []))


class CalcToolsTaskset(vf.Taskset[CalcToolsTask, CalcToolsTasksetConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        lo, hi = 10 ** (self.config.digits - 1), 10**self.config.digits - 1
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            yield CalcToolsTask(CalcData(prompt=f"{a}*{b}=", answer=str(a * b)), self.config.task)
