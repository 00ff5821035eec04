"""Environments written for other libraries, trained unchanged through the agent workflow.

Design decision: each adapter is an agent of ``groupflow.workflows.agent`` — an
``async (client, row)`` callable with ``check()`` (raise when its environment is gone) and
``close()`` — so episodes, the server that records the sampled ids, rewards, failures and
validation are the agent workflow's, unchanged. ``rollout.openenv``: an OpenEnv server
(``groupflow.envs.openenv``).
"""

from groupflow.envs.openenv import OpenEnvAgent, OpenEnvServerError
from groupflow.envs.packages import MissingEnvPackageError

__all__ = ["MissingEnvPackageError", "OpenEnvAgent", "OpenEnvServerError", "build_env_agent"]


def build_env_agent(rollout_cfg):
    """The adapter agent the rollout section asks for, or None (``rollout.agent`` then)."""
    if rollout_cfg.openenv is not None:
        return OpenEnvAgent(rollout_cfg.openenv)
    return None
