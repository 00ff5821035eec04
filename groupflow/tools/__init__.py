"""Callables that a model can call as tools during a rollout, and what they run on.

Design decision: a tool is a plain Python function with type hints and a Google-style docstring
(``Args:``), so ``transformers.utils.get_json_schema`` describes it to a chat template's
``tools=`` without any groupflow wrapper. Tools that run model-written code do so through
:func:`run_python`, a sandbox behind one interface (bubblewrap OS isolation by default, a remote
SandboxFusion service, or an opt-in audit-hook guard that is not a security boundary). Nothing here
imports the trainer, workers or rewards: rewards (``groupflow.rewards.code``) build on this layer.
"""

from groupflow.tools.python_tool import format_result, python, python_tool
from groupflow.tools.sandbox import LIMIT_REASONS, SandboxLimits, SandboxResult, run_python

__all__ = [
    "LIMIT_REASONS",
    "SandboxLimits",
    "SandboxResult",
    "format_result",
    "python",
    "python_tool",
    "run_python",
]
