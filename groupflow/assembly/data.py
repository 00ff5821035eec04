"""The run's prompt rows from ``data`` (a built-in task, files, Hub datasets or Python rows), each
checked for the fields its reward needs, then rendered and tokenized once.

Design decision: rows are loaded, checked and encoded here once, at start-up, so a bad row or an
over-long prompt is an error (or a counted skip) naming its source before any worker starts;
what leaves this module is plain rows, texts and ids (``EncodedPrompts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from groupflow.assembly.tokenizers import build_processor
from groupflow.config import Config
from groupflow.data import (
    DataError,
    NamedRows,
    PromptRow,
    check_row_fields,
    load_prompt_rows,
    make_task_rows,
    render_prompt,
)
from groupflow.data.columns import row_mapper
from groupflow.data.ifeval_style import make_ifeval_style_rows
from groupflow.data.images import ImageLimits, prompt_images
from groupflow.data.instructions import make_instruction_rows
from groupflow.data.shapes import make_shape_rows
from groupflow.models.vision import encode_image_prompt
from groupflow.utils.hub import load_hub_rows, parse_hub_dataset

log = logging.getLogger("groupflow")

__all__ = [
    "PythonInputs",
    "EncodedPrompts",
    "build_data",
    "rows_with_reward_fields",
    "encode_prompts",
    "prompt_stats",
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
        train, val = make_instruction_rows(d.task.num_train, d.task.num_val, d.task.seed)
    elif d.task is not None and d.task.name == "ifeval_style":
        train, val = make_ifeval_style_rows(
            d.task.num_train, d.task.num_val, d.task.seed, d.task.max_answer_words
        )
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
        per_row = [
            (r.is_chat or bool(d.use_chat_template)) if templated is None else templated
            for r in rows
        ]
        ids = [
            tokenizer(t, add_special_tokens=not chat)["input_ids"]
            for t, chat in zip(texts, per_row)
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


def prompt_stats(train: EncodedPrompts, val: EncodedPrompts | None) -> dict[str, float]:
    """Rows that reach training and validation (after the over-long filter), and how many the
    filter dropped."""
    return {
        "data/train_rows": float(len(train.rows)),
        "data/train_filtered_overlong": float(train.num_filtered),
        "data/val_rows": float(len(val.rows) if val is not None else 0),
        "data/val_filtered_overlong": float(val.num_filtered if val is not None else 0),
    }
