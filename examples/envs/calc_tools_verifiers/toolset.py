"""The ``calc`` tool of the calc_tools_verifiers taskset: a verifiers ``Toolset`` (an MCP server
that verifiers starts per rollout as ``python -m calc_tools_verifiers.toolset``)."""

from __future__ import annotations

import verifiers.v1 as vf

from groupflow.tools.calculator import calculator


class CalcToolset(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is advertised as `calc`, not `calc_toolset_calc`

    @vf.tool
    async def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly, e.g. 347*582."""
        try:
            return calculator(expression)
        except Exception as exc:  # a bad call is an observation the model learns from
            return f"error: {exc}"


if __name__ == "__main__":
    CalcToolset.run()
