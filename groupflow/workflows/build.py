"""A run's parts built from its config: the policy (the runtime half of its model kind) and the
workflow that produces the policy's experience.

Design decision: this is the one module of ``groupflow.workflows`` that imports the policies (the
training stack: the workers, transformers), and only the driver imports it (``groupflow.trainer``,
``groupflow serve``'s path check); the package itself stays what the asynchronous rollout side and
the benchmarks import, with no policy in it.
"""

from __future__ import annotations

from pathlib import Path

from groupflow.assembly.data import PythonInputs, build_data
from groupflow.config import Config
from groupflow.data import PromptRow
from groupflow.policies.diffusion import DiffusionPolicy
from groupflow.policies.llm import LLMPolicy, check_role_paths
from groupflow.workflows import build_workflow, rule_rewards, workflow_class

__all__ = ["build_run", "check_paths"]

# The runtime half of a model kind (its config half: ``groupflow.config.kinds``), looked up once by
# ``cfg.kind.name``: how its policy is built, and which model directories must exist before anything
# starts (a diffusion model's directory is read, and checked, as its policy loads).


def _llm_policy(cfg: Config, run_dir: Path, corpus: list[PromptRow], workflow_cls: type):
    # a tiny model's character tokenizer must also spell what the workflow appends (observations)
    texts = getattr(workflow_cls, "tokenizer_texts", None)
    return LLMPolicy(cfg, run_dir, corpus, list(texts(cfg)) if texts else [])


def _diffusion_policy(cfg: Config, run_dir: Path, corpus: list[PromptRow], workflow_cls: type):
    return DiffusionPolicy(cfg, run_dir, corpus)


_POLICIES = {"llm": _llm_policy, "diffusion": _diffusion_policy}
_PATH_CHECKS = {"llm": check_role_paths, "diffusion": lambda cfg: None}


def check_paths(cfg: Config) -> None:
    """Model directories the run needs must exist before anything else starts."""
    _PATH_CHECKS[cfg.kind.name](cfg)


def build_run(cfg: Config, run_dir: Path, inputs=None):
    """(policy, workflow, data statistics): the rule-based rewards, the data (each row checked
    for the fields its reward needs, except those the workflow supplies while scoring), the
    policy's worker groups and the workflow that produces their experience. ``inputs``: a
    ``PythonInputs`` (reward callables and datasets from the Python API) or None."""
    inputs = inputs or PythonInputs()
    cls = workflow_class(cfg)
    rewards = rule_rewards(cfg, inputs.rewards)
    provided = tuple(getattr(cls, "provided_fields", ()))
    train_rows, val_rows, stats = build_data(cfg, rewards, provided=provided, inputs=inputs)
    policy = _POLICIES[cfg.kind.name](cfg, run_dir, train_rows + val_rows, cls)
    try:
        workflow = build_workflow(cfg, policy, train_rows, val_rows, rewards, run_dir)
    except BaseException:
        policy.shutdown()  # its worker groups (Ray actors) must not outlive a failed start
        raise
    stats.update(getattr(workflow, "data_stats", {}))
    return policy, workflow, stats
