"""Environments written for other libraries, trained unchanged through the agent workflow.

Design decision: each adapter is an agent of ``groupflow.workflows.agent`` — an
``async (client, row)`` callable with ``check()`` (raise when its environment is gone) and
``close()`` — so episodes, the server that records the sampled ids, rewards, failures and
validation are the agent workflow's, unchanged. ``rollout.openenv``: an OpenEnv server
(``groupflow.envs.openenv``); ``rollout.verifiers``: a verifiers
environment (``groupflow.envs.verifiers``). An adapter with ``rows()`` brings its own prompt rows
(train, validation), which replace the data section's, and ``built_tasks()``: those tasks,
pickled, which an adapter built again on the asynchronous rollout side is given (``tasks``)
instead of reading its row source again (the rows travel as built: ``workflows.agent``).
"""

from groupflow.envs.openenv import OpenEnvAgent, OpenEnvServerError
from groupflow.envs.packages import MissingEnvPackageError
from groupflow.envs.verifiers import VerifiersAgent

__all__ = [
    "MissingEnvPackageError",
    "OpenEnvAgent",
    "OpenEnvServerError",
    "VerifiersAgent",
    "build_env_agent",
]


def build_env_agent(rollout_cfg, tasks: bytes | None = None):
    """The adapter agent the rollout section asks for, or None (``rollout.agent`` then).
    ``tasks``: an adapter's ``built_tasks()`` (the trainer's), to run instead of loading its own."""
    if rollout_cfg.openenv is not None:
        return OpenEnvAgent(rollout_cfg.openenv)
    if rollout_cfg.verifiers is not None:
        return VerifiersAgent(rollout_cfg.verifiers, tasks)
    return None
