"""groupflow: GRPO-family RL post-training for LLMs and flow-matching generators.

Design decision: the package is layered bottom-up — `batch`/`contracts` (the data passed between
stages), `algorithms` (pure tensor math), `rewards` (plain callables), then policies, workers and
the driver. Lower layers never import higher ones, so the math can be used and tested alone.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what `groupflow.Run` is, for type checkers (at run time: __getattr__ below)
    from groupflow.api import Run

__version__ = "0.1.0"

__all__ = ["Run"]


def __getattr__(name: str):
    if name == "Run":
        # lazy: `import groupflow` stays light (no torch); `groupflow.Run` imports the driver
        from groupflow.api import Run

        return Run
    raise AttributeError(f"module 'groupflow' has no attribute {name!r}")
