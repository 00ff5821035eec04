"""The sections of what a run starts from: the policy model (``model``, a tiny one included) and
its prompts (``data``: files, Hub datasets or a built-in ``task``).

Design decision: each section names exactly one source (``model.path`` or ``model.tiny``;
``data.train_files``, ``data.task`` or a dataset given to ``groupflow.Run``), checked on the
section itself, so a config never leaves the assembly to guess which of two sources wins.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from groupflow.config.base import _Section


class TinyVisionConfig(_Section):
    """A tiny image encoder in front of the tiny LM: an Idefics3 (SmolVLM's architecture) whose
    ViT reads ``patch_size`` patches of an ``image_size`` square image, pixel-shuffled by
    ``scale_factor`` into (image_size / patch_size / scale_factor)² image tokens."""

    image_size: int = Field(default=32, ge=8)  # side of the (square) input image in pixels
    patch_size: int = Field(default=8, ge=2)  # ViT patch side in pixels
    # pixel-shuffle factor: image tokens per side shrink by it
    scale_factor: int = Field(default=2, ge=1)
    hidden_size: int = Field(default=32, ge=8)  # width of the vision encoder
    num_layers: int = Field(default=1, ge=1)  # vision encoder layers

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

    hidden_size: int = Field(default=64, ge=8)  # width of the residual stream
    num_layers: int = Field(default=4, ge=1)  # decoder layers
    num_heads: int = Field(default=4, ge=1)  # attention heads (must divide hidden_size)
    # MLP width; None: ≈ 8/3 × hidden_size
    intermediate_size: int | None = Field(default=None, ge=8)
    max_positions: int = Field(default=128, ge=8)  # longest sequence (prompt + response) in tokens
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
    # ifeval_style: our writing requests with IFEval's instruction kinds, drawn by the official
    # checkers, in IFEval's row format (groupflow.data.ifeval_style; reward ifeval)
    name: Literal["reverse", "add", "calc", "instructions", "ifeval_style", "shapes"] = "reverse"
    digits: int = Field(default=6, ge=1, le=32)  # reverse / add / calc: digits per operand
    grid: int = Field(default=4, ge=2, le=8)  # shapes: the board's side in 8-pixel cells
    # ifeval_style: the longest answer an instruction may demand, in words (length and count
    # arguments are drawn from ranges that fit it)
    max_answer_words: int = Field(default=80, ge=16, le=2000)
    num_train: int = Field(default=20000, ge=1)  # training prompts generated
    num_val: int = Field(default=256, ge=1)  # held-out prompts generated
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
    prompts_per_step: int = Field(default=32, ge=1)
    # longest prompt in tokens; longer ones are handled by overlong_prompts
    max_prompt_tokens: int = Field(default=512, ge=1)
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
    max_val_prompts: int | None = Field(default=None, ge=1)
    # prompt images are resized (aspect kept) to a pixel count within [min_pixels, max_pixels]
    # at load (groupflow.data.images); the defaults are Qwen2.5-VL's usual 4..1280 28x28 patches
    max_pixels: int = Field(default=1280 * 28 * 28, ge=1)
    # lower bound of the resize range (see max_pixels)
    min_pixels: int = Field(default=4 * 28 * 28, ge=1)
    # an image file (or bytes, a data: URL) is refused beyond this many bytes, before it is read
    max_image_bytes: int = Field(default=64 << 20, ge=1)
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
            # lazy: keeps `import groupflow.config` light (groupflow.data's __init__ imports
            # transformers); data.columns itself is plain Python
            from groupflow.data.columns import template_fields

            template_fields(self.prompt_template)
        return self
