"""groupflow: GRPO-family RL post-training for LLMs and flow-matching generators.

Design decision: the package is layered bottom-up — `batch`/`contracts` (the data passed between
stages), `algorithms` (pure tensor math), `rewards` (plain callables), then policies, workers and
the driver. Lower layers never import higher ones, so the math can be used and tested alone.
"""

__version__ = "0.1.0"
