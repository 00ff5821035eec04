"""Typed run configuration: YAML + dotted ``key=value`` overrides, validated once at load.

Design decision: one strict pydantic schema (unknown keys are errors), split by job — the LLM-side
sections by domain (``model_data.py``, ``rollout.py``, ``training.py``, ``rewards.py``,
``run.py``, over their strict base in ``base.py``), the diffusion section (``diffusion.py``), the
whole ``Config`` with the checks across sections (``root.py``) and loading with its error messages
(``loading.py``) — and re-exported here, so callers import everything from ``groupflow.config``.
Nothing below the assembly (``groupflow.assembly``) reads this object: it passes plain arguments
into workers (style.md principle 6).
"""

from groupflow.config.base import ConfigError, present
from groupflow.config.diffusion import (
    DiffusionConfig,
    DiffusionLoraConfig,
    DiffusionModelConfig,
    NftConfig,
    SdeWindowConfig,
)
from groupflow.config.loading import apply_overrides, config_from_dict, load_config, parse_overrides
from groupflow.config.model_data import (
    DataConfig,
    HubDatasetConfig,
    ModelConfig,
    TaskConfig,
    TinyModelConfig,
)
from groupflow.config.rewards import (
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    TeacherConfig,
)
from groupflow.config.rollout import (
    VLLM_HEAD_DIMS,
    EnvironmentConfig,
    OpenEnvConfig,
    RolloutConfig,
    ServeConfig,
    ToolConfig,
    VerifiersConfig,
    VLLMConfig,
)
from groupflow.config.root import Config
from groupflow.config.run import (
    ParallelConfig,
    PlacementConfig,
    PoolConfig,
    RunConfig,
    ValidationConfig,
)
from groupflow.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLInRewardConfig,
    LoraConfig,
    SFTConfig,
)

__all__ = [
    "VLLM_HEAD_DIMS",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "present",
    "CriticConfig",
    "DataConfig",
    "DiffusionConfig",
    "DiffusionLoraConfig",
    "DiffusionModelConfig",
    "EnvironmentConfig",
    "OpenEnvConfig",
    "VerifiersConfig",
    "HubDatasetConfig",
    "KLInRewardConfig",
    "LoraConfig",
    "ModelConfig",
    "NftConfig",
    "ParallelConfig",
    "PlacementConfig",
    "PoolConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "ServeConfig",
    "SFTConfig",
    "SdeWindowConfig",
    "TaskConfig",
    "TeacherConfig",
    "TinyModelConfig",
    "ToolConfig",
    "VLLMConfig",
    "ValidationConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "parse_overrides",
]
