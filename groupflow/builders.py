"""Builders: turn the typed config into plain objects (tokenizer, model, data, rewards, worker).

Design decision: this is the only module that reads config sections to construct things; the
objects it returns take plain arguments and never see the config again (style.md principle 6).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from groupflow.config import Config, ModelConfig
from groupflow.data import (
    DataError,
    NamedRows,
    PromptRow,
    check_row_fields,
    load_prompt_rows,
    make_task_rows,
    render_prompt,
    train_char_tokenizer,
)
from groupflow.data.images import ImageLimits, prompt_images
from groupflow.data.shapes import make_shape_rows
from groupflow.data.tokenizer import DEFAULT_ALPHABET
from groupflow.distributed import PoolSpec, RayOptions, WorkerGroup
from groupflow.models.causal_lm import ModelLoadError, build_tiny_llama, load_causal_lm
from groupflow.models.logit_transform import check_logit_transform
from groupflow.models.tiny_vlm import (
    IDEFICS3_TOKENS,
    idefics3_processor,
    load_processor,
    tiny_idefics3,
)
from groupflow.models.vision import encode_image_prompt, freeze_vision_tower, is_vision_model
from groupflow.rewards import build_reward_runner

log = logging.getLogger("groupflow")

__all__ = [
    "EncodedPrompts",
    "PythonInputs",
    "resolve_hub_models",
    "build_tokenizer",
    "build_model",
    "build_data",
    "build_reward",
    "rows_with_reward_fields",
    "prompt_stats",
    "build_rollout_engine",
    "encode_prompts",
    "role_group",
    "pool_spec",
    "total_cpus",
]


@dataclass(frozen=True)
class PythonInputs:
    """What the Python API (``groupflow.Run``) hands the run besides its config: reward functions
    (``RewardFunction`` objects, after the config's ``reward.functions``) and datasets as lists of
    row dicts (None: the config names them)."""

    rewards: tuple = ()
    train_rows: list | None = None
    val_rows: list | None = None


@dataclass
class EncodedPrompts:
    """Prompt rows with their rendered text and token ids (computed once at load)."""

    rows: list[PromptRow]
    texts: list[str]
    ids: list[list[int]]
    num_filtered: int = 0
    # per row: its images as ``models.vision.VisionInputs`` (None: a text row); None: no images
    vision: list | None = None

    def subset(self, idx) -> EncodedPrompts:
        """The rows at ``idx`` (a slice or indices), with their texts, ids and images."""
        pick = (lambda xs: xs[idx]) if isinstance(idx, slice) else (lambda xs: [xs[i] for i in idx])
        vision = pick(self.vision) if self.vision is not None else None
        return EncodedPrompts(pick(self.rows), pick(self.texts), pick(self.ids), self.num_filtered,
                              vision)  # fmt: skip


def resolve_hub_models(cfg: Config) -> Config:
    """A copy of ``cfg`` whose model paths that are Hub ids (policy, tokenizer, critic, reward
    model and its tokenizer, diffusion model) name their local snapshot directories
    (``groupflow.utils.hub``); ``cfg`` itself, which is logged and checkpointed, keeps the ids.
    A missing tiny flow model that ``pretrain_if_missing`` will create stays a local path."""
    from groupflow.utils.hub import resolve_model_path

    out = cfg.model_copy(deep=True)
    sections = [
        ("model", ("path", "tokenizer_path")),
        ("critic", ("path",)),
        ("reward_model", ("path", "tokenizer_path")),
        ("teacher", ("path",)),
    ]
    for name, keys in sections:
        section = getattr(out, name)
        for key in keys:
            value = getattr(section, key, None) if section is not None else None
            if value is not None:
                setattr(section, key, resolve_model_path(value, section.revision, f"{name}.{key}"))
    dm = out.diffusion.model if out.diffusion is not None else None
    if dm is not None and not (dm.kind == "tiny" and dm.pretrain_if_missing):
        dm.path = resolve_model_path(dm.path, dm.revision, "diffusion.model.path")
    return out


def tokenizer_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the tokenizer lives: the run's own (tiny models) or the model's local directory."""
    m = cfg.model
    if m.tiny is not None and m.tokenizer_path is None:
        return run_dir / "tokenizer"
    return Path(m.tokenizer_path or m.path).expanduser()


def build_tokenizer(cfg: Config, run_dir: Path, corpus: list[PromptRow] = (),
                    extra_texts: list[str] = ()):  # fmt: skip
    """Load the tokenizer from a local directory, or train a character tokenizer on ``corpus``.

    The tiny model's vocabulary is exactly the characters of the data (prompts and answers, plus
    ``extra_texts``: what a workflow's observations can contain): a small output space is what
    lets a 0.2M-parameter model learn quickly on a CPU.
    """
    from transformers import AutoTokenizer

    m = cfg.model
    if m.tiny is not None and m.tokenizer_path is None:
        saved = run_dir / "tokenizer"
        if saved.is_dir():  # resume: reuse the exact tokenizer the run started with
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
        texts = [_prompt_text(r.prompt) for r in corpus] + [
            str(v) for r in corpus for k, v in r.fields.items() if k != "images"
        ] + list(extra_texts)  # fmt: skip
        tok = train_char_tokenizer(texts, base_alphabet="" if corpus else DEFAULT_ALPHABET)
        if m.tiny.vision is not None:  # the image processor's special tokens, saved with it
            tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_TOKENS)})
        tok.save_pretrained(str(saved))
        return tok
    key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
    path = Path(m.tokenizer_path or m.path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{key}: tokenizer path '{path}' does not exist or is not a directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{key}: '{path}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); point "
            "it at a Hugging Face model directory, or set model.tokenizer_path"
        )
    try:
        tok = AutoTokenizer.from_pretrained(
            str(path), trust_remote_code=m.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError) as err:  # transformers' messages do not name the directory
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"{key}: cannot load the tokenizer in '{path}': {reason}") from err
    if tok.pad_token_id is None:
        # Padding is masked everywhere, so any id works; EOS is the usual choice (as TRL does).
        tok.pad_token = tok.eos_token
    return tok


def _prompt_text(prompt) -> str:
    """The characters of a prompt (image parts have none; their PIL repr must not enter a
    character vocabulary)."""
    if isinstance(prompt, str):
        return prompt
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p.get("text", "") for p in content if p.get("type") == "text"]
    return "\n".join(out)


def _is_vlm_config(cfg: Config) -> bool:
    m = cfg.model
    if m.tiny is not None:
        return m.tiny.vision is not None
    cfg_file = Path(m.path).expanduser() / "config.json"
    return cfg_file.is_file() and "vision_config" in json.loads(cfg_file.read_text())


def save_processor(cfg: Config, tokenizer, out: Path) -> None:
    """Write a vision-language model's processor next to its exported weights, so the export
    loads with ``AutoProcessor`` (nothing for a text model). Qwen-VL's image-only processor
    (no torchvision here) is written as its image processor and chat template, which
    ``models.tiny_vlm.load_processor`` reads back."""
    processor = build_processor(resolve_hub_models(cfg), tokenizer)
    if processor is None:
        return
    if type(processor).__name__.startswith("ImageOnly"):
        processor.image_processor.save_pretrained(str(out))
        (Path(out) / "chat_template.jinja").write_text(processor.chat_template)
    else:
        processor.save_pretrained(str(out))


def build_processor(cfg: Config, tokenizer):
    """The processor that turns prompts with images into ids and image tensors: the tiny VLM's
    (``model.tiny.vision``) or the model directory's; None for a text-only model."""
    m = cfg.model
    if m.tiny is not None:
        v = m.tiny.vision
        if v is None:
            return None
        return idefics3_processor(tokenizer, image_size=v.image_size, patch_size=v.patch_size,
                                  scale_factor=v.scale_factor)  # fmt: skip
    if not _is_vlm_config(cfg):
        return None
    return load_processor(str(Path(m.path).expanduser()), tokenizer, m.trust_remote_code)


# Files a Hugging Face tokenizer directory has at least one of.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def check_model_dir(path: str, key: str) -> None:
    """Fail at start-up, naming ``key`` and the directory, unless ``path`` is an HF model dir."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"{key}: '{p}' does not exist or is not a directory")
    if not (p / "config.json").is_file():
        what = "it is empty" if not any(p.iterdir()) else "no config.json"
        raise ModelLoadError(
            f"{key}: '{p}' is not a Hugging Face model directory ({what}); for a GGUF file, "
            "convert it first with `groupflow convert-gguf`"
        )


def check_teacher(path: str, student_tokenizer) -> None:
    """On-policy distillation compares log-probs of the same token ids: the teacher's tokenizer
    (in ``path``) must map every token to the id the student's does, with the same special
    tokens, and the teacher's output layer must cover every id. Raises ModelLoadError naming the
    first difference."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        teacher_tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"teacher.path: cannot load a tokenizer from '{path}' ({e})") from None
    mine, theirs = student_tokenizer.get_vocab(), teacher_tok.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
        shown = ", ".join(f"{t!r}: student {mine.get(t)}, teacher {theirs.get(t)}"
                          for t in differ[:3])  # fmt: skip
        raise ModelLoadError(
            f"teacher.path: the teacher's tokenizer does not match the student's ({len(mine)} vs "
            f"{len(theirs)} tokens, {len(differ)} differ: {shown}); on-policy distillation needs "
            "the same token ids (use a teacher of the student's model family, or give the "
            "student the teacher's tokenizer with model.tokenizer_path)"
        )
    for name in ("eos_token_id", "bos_token_id"):  # pad is never scored
        a, b = getattr(student_tokenizer, name), getattr(teacher_tok, name)
        if a != b:
            raise ModelLoadError(
                f"teacher.path: {name} is {b} for the teacher, {a} for the student"
            )
    vocab = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    if vocab is not None and vocab < len(student_tokenizer):
        raise ModelLoadError(
            f"teacher.path: the teacher's vocab_size {vocab} is smaller than the student's "
            f"tokenizer ({len(student_tokenizer)} tokens)"
        )


def eos_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(extra)
    ids.discard(None)
    if not ids:
        raise ModelLoadError(
            "the tokenizer has no EOS token; generation could never stop on its own"
        )
    return sorted(ids)


def build_model(m: ModelConfig, tokenizer, seed: int):
    """The policy model: a tiny Llama built from ``m.tiny`` (initialised from ``seed`` unless it sets
    its own) or an HF model loaded from the local directory ``m.path``."""
    if m.tiny is not None and m.tiny.vision is not None:
        t, v = m.tiny, m.tiny.vision
        model, _ = tiny_idefics3(
            tokenizer, image_size=v.image_size, patch_size=v.patch_size,
            scale_factor=v.scale_factor, hidden_size=t.hidden_size, num_layers=t.num_layers,
            num_heads=t.num_heads, vision_hidden=v.hidden_size, vision_layers=v.num_layers,
            max_positions=t.max_positions, seed=seed if t.seed is None else t.seed,
        )  # fmt: skip
    elif m.tiny is not None:
        t = m.tiny
        model = build_tiny_llama(
            len(tokenizer),
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            intermediate_size=t.intermediate_size,
            max_positions=t.max_positions,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            seed=seed if t.seed is None else t.seed,
        )
    else:
        model = load_causal_lm(m.path, dtype=m.dtype, trust_remote_code=m.trust_remote_code)
    if m.freeze_vision and is_vision_model(model):
        freeze_vision_tower(model)
    check_logit_transform(model)  # training log-probs must be those the model samples from
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def build_data(
    cfg: Config, reward_fn=None, provided: tuple[str, ...] = (), inputs: PythonInputs | None = None
) -> tuple[list[PromptRow], list[PromptRow], dict[str, float]]:
    """Training and validation rows plus load statistics (rows kept, malformed rows skipped).

    The built-in task's held-out split never overlaps its training split. With ``reward_fn``,
    every row must carry the fields its reward needs (:func:`rows_with_reward_fields`) except
    ``provided`` ones (a workflow supplies them per sample, e.g. a trajectory's messages); rows
    skipped for lacking one count as malformed. ``inputs``: datasets given as Python objects.
    """
    d = cfg.data
    inputs = inputs or PythonInputs()
    if d.task is not None and d.task.name == "instructions":
        from groupflow.data.instructions import make_instruction_rows

        train, val = make_instruction_rows(d.task.num_train, d.task.num_val, d.task.seed)
    elif d.task is not None and d.task.name == "shapes":
        train, val = make_shape_rows(
            d.task.num_train, d.task.num_val, d.task.seed, grid=d.task.grid
        )
    elif d.task is not None:
        train, val = make_task_rows(
            d.task.name, d.task.num_train, d.task.num_val, d.task.seed, digits=d.task.digits
        )
    if d.task is not None:
        images = _image_limits(d)
        train_set = load_prompt_rows(train, images=images)
        val_set = load_prompt_rows(val, images=images) if inputs.val_rows is None else None
    else:
        train_set = _load_split(d, d.train_files, inputs.train_rows, "train")
        val_set = None
    if inputs.val_rows is not None or d.val_files:
        val_set = _load_split(d, d.val_files, inputs.val_rows, "val")
    val_rows = list(val_set) if val_set is not None else []
    if d.max_val_prompts is not None:
        val_rows = val_rows[: d.max_val_prompts]
    train_rows, val_rows, (train_skipped, val_skipped) = rows_with_reward_fields(
        reward_fn, list(train_set), val_rows, d.bad_rows, provided
    )
    stats = {
        "data/train_rows": float(len(train_rows)),
        "data/train_skipped_bad_rows": float(train_set.num_skipped + train_skipped),
        "data/val_rows": float(len(val_rows)),
        "data/val_skipped_bad_rows": float(
            (val_set.num_skipped if val_set is not None else 0) + val_skipped
        ),
    }
    return train_rows, val_rows, stats


def _image_limits(d) -> ImageLimits:
    return ImageLimits(max_pixels=d.max_pixels, min_pixels=d.min_pixels,
                       max_file_bytes=d.max_image_bytes, image_dirs=tuple(d.image_dirs))  # fmt: skip


def _load_split(d, files: list, python_rows: list | None, split: str):
    """One split's rows: from Python (the API), else its files and Hub datasets, each row mapped
    by ``data.columns`` / ``prompt_template`` / ``data_source`` (a Hub dataset's default
    ``data_source`` is its id, as verl writes it)."""
    from groupflow.data.columns import row_mapper
    from groupflow.utils.hub import load_hub_rows, parse_hub_dataset

    mapper = row_mapper(d.columns, d.prompt_template, d.data_source)
    images = _image_limits(d)
    if python_rows is not None:  # rows, never file paths (a list of strings is bad rows)
        rows = NamedRows(f"{split}_dataset", python_rows)
        return load_prompt_rows(rows, on_bad_row=d.bad_rows, prepare=mapper, images=images)
    key = f"data.{split}_files"
    sources: list = []
    for i, entry in enumerate(files):
        spec = entry.model_dump() if hasattr(entry, "model_dump") else entry
        hub = parse_hub_dataset(spec, "train" if split == "train" else "test", f"{key}[{i}]")
        if hub is None:
            sources.append(spec)
            continue
        rows = load_hub_rows(hub, f"{key}[{i}]")
        if d.data_source is None:
            rows = [_default_source(r, hub.name) for r in rows]
        sources.append(NamedRows(hub.label(), rows))
    return load_prompt_rows(sources, on_bad_row=d.bad_rows, prepare=mapper, images=images)


def _default_source(raw, source: str):
    if isinstance(raw, dict) and raw.get("data_source") is None:
        return {**raw, "data_source": source}
    return raw


def rows_with_reward_fields(
    reward_fn,
    train_rows: list[PromptRow],
    val_rows: list[PromptRow],
    on_bad_row: str,
    provided: tuple[str, ...] = (),
) -> tuple[list[PromptRow], list[PromptRow], tuple[int, int]]:
    """Train and validation rows that carry every field their reward needs, and how many rows of
    each were skipped for lacking one (``data.bad_rows=skip``; ``error`` raises a DataError
    naming the file, row and field). A reward never sees a missing field as ``None``."""
    if reward_fn is None:  # no rule-based reward (the reward model alone scores text)
        return train_rows, val_rows, (0, 0)
    # A field no row has is a configuration error (a wrong column name), reported as such.
    reward_fn.check_fields({k for r in train_rows for k in r.fields} | set(provided))

    def missing(row):
        return [m for m in reward_fn.missing_fields(row) if m[0] not in provided]

    train_rows, train_skipped = check_row_fields(
        train_rows, missing, on_bad_row=on_bad_row, split="train"
    )
    val_skipped = 0
    if val_rows:
        val_rows, val_skipped = check_row_fields(
            val_rows, missing, on_bad_row=on_bad_row, split="validation"
        )
    return train_rows, val_rows, (train_skipped, val_skipped)


def encode_prompts(rows: list[PromptRow], tokenizer, cfg: Config, split: str, *, render=render_prompt,
                   templated: bool | None = None, encode_images=None) -> EncodedPrompts:  # fmt: skip
    """Render (chat template where asked) and tokenize each prompt once; filter or reject over-long
    ones. ``render(row, tokenizer, use_chat_template)`` may be a workflow's own (tools described);
    ``templated`` says whether its text carries the template's special tokens (None: per row).
    ``encode_images(row) -> (text, ids, VisionInputs | None)``: a workflow's own encoding of
    prompts with images (None: the model's processor, ``models.vision.encode_image_prompt``)."""
    d = cfg.data
    if any(prompt_images(r.prompt) for r in rows):
        if encode_images is not None:
            texts, ids, vision = (list(x) for x in zip(*(encode_images(r) for r in rows)))
        else:
            texts, ids, vision = _encode_image_prompts(rows, tokenizer, cfg, split)
    else:
        vision = None
        texts = [render(r, tokenizer, d.use_chat_template) for r in rows]
        # A chat template writes its own special tokens into the text; a plain prompt gets the
        # tokenizer's usual BOS (if it has one).
        templated = [
            (r.is_chat or bool(d.use_chat_template)) if templated is None else templated
            for r in rows
        ]
        ids = [
            tokenizer(t, add_special_tokens=not chat)["input_ids"]
            for t, chat in zip(texts, templated)
        ]
    keep = []
    for j, (r, t, i) in enumerate(zip(rows, texts, ids)):
        if len(i) <= d.max_prompt_tokens:  # image placeholder tokens count
            keep.append((r, t, i, vision[j] if vision is not None else None))
        elif d.overlong_prompts == "error":
            raise DataError(
                f"the {split} prompt has {len(i)} tokens, more than data.max_prompt_tokens="
                f"{d.max_prompt_tokens} (raise it, or set data.overlong_prompts=filter to skip "
                "such rows)",
                source=r.source,
                index=r.index,
                field="prompt",
            )
    filtered = len(rows) - len(keep)
    if filtered:
        log.warning(
            "%s data: filtered %d prompt(s) longer than %d tokens",
            split,
            filtered,
            d.max_prompt_tokens,
        )
    if not keep:
        raise DataError(
            f"every {split} prompt is longer than data.max_prompt_tokens={d.max_prompt_tokens} "
            "(raise it)",
            source=", ".join(dict.fromkeys(r.source for r in rows)),
        )
    rows_, texts_, ids_, vision_ = (list(x) for x in zip(*keep))
    return EncodedPrompts(rows_, texts_, ids_, filtered, vision_ if vision is not None else None)


def _encode_image_prompts(rows: list[PromptRow], tokenizer, cfg: Config, split: str):
    """Texts, ids (image placeholders expanded) and VisionInputs (None for text rows) through the
    model's processor; a text-only model is an error naming the first row with images."""
    processor = build_processor(cfg, tokenizer)
    if processor is None:
        first = next(r for r in rows if prompt_images(r.prompt))
        raise DataError(
            "this prompt shows images but the model is text-only (model.path has no "
            "vision_config; use a vision-language model such as Qwen2.5-VL or SmolVLM, or "
            "model.tiny.vision)",
            source=first.source, index=first.index, field="prompt",
        )  # fmt: skip
    texts, ids, vision = [], [], []
    for r in rows:
        messages = (
            r.prompt if isinstance(r.prompt, list) else [{"role": "user", "content": r.prompt}]
        )
        text, i, v = encode_image_prompt(processor, messages)
        texts.append(text)
        ids.append(i)
        vision.append(v if v.tensors else None)
    return texts, ids, vision


def build_reward(cfg: Config, functions: tuple = ()):
    """The reward runner: the config's ``reward.functions``, then ``functions`` (Python objects
    from the API); neither: each sample's ``data_source`` picks its reward."""
    specs = [s.model_dump() for s in cfg.reward.functions] or None
    return build_reward_runner(
        specs,
        failure_value=cfg.reward.failure_value,
        timeout_s=cfg.reward.timeout_s,
        functions=functions,
        normalize=cfg.reward.normalize,
        normalize_eps=cfg.reward.normalize_eps,
    )


def prompt_stats(train: EncodedPrompts, val: EncodedPrompts | None) -> dict[str, float]:
    """Rows that reach training and validation (after the over-long filter), and how many the
    filter dropped."""
    return {
        "data/train_rows": float(len(train.rows)),
        "data/train_filtered_overlong": float(train.num_filtered),
        "data/val_rows": float(len(val.rows) if val is not None else 0),
        "data/val_filtered_overlong": float(val.num_filtered if val is not None else 0),
    }


def build_rollout_engine(cfg: Config):
    """Plain, picklable options of the rollout engine (``groupflow.rollout.engines.base``) the workers
    that generate build in their own processes: ``HFOptions`` or ``VLLMOptions``.

    Called at start-up: ``rollout.engine=vllm`` without vLLM installed fails here, naming the
    install command, before any data or model is loaded.
    """
    from groupflow.rollout.engines.base import HF
    from groupflow.rollout.engines.vllm_engine import VLLMOptions, require_vllm

    if cfg.rollout.engine == "hf":
        return HF
    require_vllm()
    v = cfg.rollout.vllm
    # a vision-language model: vLLM's multimodal processor reads the directory's processor files
    processor_path = str(Path(cfg.model.path).expanduser()) if _is_vlm_config(cfg) else None
    return VLLMOptions(
        gpu_memory_utilization=v.gpu_memory_utilization,
        sleep_mode=v.sleep_mode,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
        max_model_len=v.max_model_len,
        dtype=v.dtype,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        seed=cfg.run.seed,
        processor_path=processor_path,
    )


def build_weight_transport(cfg: Config, run_dir: Path, kind: str | None = None):
    """The configured weight transport (``groupflow.distributed.transport``); ``auto``: on
    run.backend=ray the collective one where it applies (a rollout pool fed synchronously: each
    actor rank broadcasts its shard), else Ray's object store (nothing passes the driver either
    way); in-process tensors otherwise. ``kind``: instead of ``rollout.weight_transport``."""
    from groupflow.config.root import collective_refusal
    from groupflow.distributed.collective import CollectiveTransport
    from groupflow.distributed.transport import DriverTransport, FileTransport, RayObjectTransport

    r = cfg.rollout
    kind = kind or r.weight_transport
    if kind == "auto" and cfg.run.backend == "ray":
        kind = "ray" if collective_refusal(cfg) else "collective"
    bucket = max(1, int(r.weight_bucket_mb * (1 << 20)))
    timeout = cfg.run.worker_timeout_s
    if kind == "collective":
        return CollectiveTransport(bucket_bytes=bucket, timeout_s=timeout)
    if kind == "ray":
        return RayObjectTransport(bucket_bytes=bucket, timeout_s=timeout)
    if kind == "filesystem":
        root = Path(r.weight_dir).expanduser() if r.weight_dir else Path(run_dir) / "weights"
        return FileTransport(str(root), bucket_bytes=bucket, timeout_s=timeout)
    return DriverTransport()


# ----- worker groups: where each role runs ---------------------------------------------------------


def role_group(config: Config, role: str, worker_cls, /, **kwargs) -> WorkerGroup:
    """The worker group of one role, placed in the pool ``config.placement`` gives it; ``kwargs``
    go to the worker's constructor."""
    spec, run = pool_spec(config, role), config.run
    if run.backend == "ray" and not run.ray_address:
        # Declare logical CPUs for every role's pool at once: Ray starts with the first group, and
        # a later pool asking for more than was declared would wait for the placement timeout.
        import os

        from groupflow.distributed.group import ensure_ray

        ensure_ray(None, num_cpus=max(os.cpu_count() or 1, int(total_cpus(config)) + 2))
    return WorkerGroup(
        worker_cls, spec.world_size, backend=run.backend, timeout_s=run.worker_timeout_s,
        ray_options=RayOptions(address=run.ray_address), pool=spec,
        placement_timeout_s=config.placement.timeout_s, **kwargs,
    )  # fmt: skip


def snapshot_group(
    config: Config, worker_cls, /, role_name: str = "rollout", **kwargs
) -> WorkerGroup:
    """One worker of the asynchronous rollout side, in that side's own process (a child process,
    or this one for ``rollout.async_worker: thread``): a frozen copy the side loads weights into."""
    return WorkerGroup(
        worker_cls, 1, backend="local", timeout_s=config.run.worker_timeout_s, role_name=role_name,
        **kwargs,
    )  # fmt: skip


def pool_spec(cfg: Config, role: str) -> PoolSpec:
    """A role's pool; the critic and reward model take the actor's shape unless placed otherwise."""
    pool = getattr(cfg.placement, role)
    if pool is None:
        return replace(pool_spec(cfg, "actor"), name=role)
    default = cfg.run.num_workers // pool.nodes if role == "actor" else 1
    return PoolSpec(pool.nodes, pool.workers_per_node or default, pool.cpus_per_worker,
                    pool.gpus_per_worker, name=role, resources=dict(pool.resources))  # fmt: skip


def total_cpus(cfg: Config) -> float:
    """Logical CPUs every pool of this run reserves together (a local Ray instance declares them)."""
    roles = ["actor"] + [
        r for r in ("rollout", "reference") if getattr(cfg.placement, r) != "colocated"
    ]
    roles += [r for r in ("critic", "reward_model", "teacher") if getattr(cfg, r) is not None]
    if cfg.diffusion is not None and "teacher" in roles:  # held inside the diffusion actor
        roles.remove("teacher")
    return sum(pool_spec(cfg, r).world_size * pool_spec(cfg, r).cpus_per_worker for r in roles)
