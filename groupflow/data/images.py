"""Images in prompts: image parts of chat messages and image columns, decoded and resized at load.

Design decision: a prompt that shows images is stored in one shape whatever the dataset wrote —
chat messages whose ``content`` is a list of ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": <PIL.Image, RGB>}`` parts, the shape HF processors' chat templates
read. Accepted on input: HF parts (``{"type": "image", "image"|"path"|"url": ...}``), OpenAI parts
(``{"type": "image_url", "image_url": {"url": ...}}``), bare ``{"type": "image"}`` parts filled
in order from the row's image column (TRL's shape), and verl's geo3k rows (an ``images`` column
plus ``<image>`` markers in the text; without markers the images go before the first user
message's text). An image is a file path (relative to the dataset file), a ``file://`` or
``data:`` URL, bytes, a ``{"bytes", "path"}`` struct (how a ``datasets.Image`` column is stored
in parquet) or a PIL image (a ``datasets.Image`` feature read through ``datasets``).

Every image is decoded and resized once, at load, so a missing, unreadable or absurd image is a
``DataError`` naming the file, row and field before any training starts (or a counted skip with
``data.bad_rows=skip``), never a crash in step 800. Resizing keeps the aspect ratio and puts the
pixel count within ``[min_pixels, max_pixels]`` (the budget that decides how many image tokens a
processor makes); an image above ``max_source_pixels`` (a decompression bomb) or with an aspect
ratio above ``max_aspect`` (Qwen2-VL's processor rejects > 200) is an error, not resized — told
from its header, before any pixel is decoded. A file is read only up to ``max_file_bytes``
(``data.max_image_bytes``): a larger one (or ``bytes`` / a ``data:`` URL holding more) is an
error before it is read whole. The paths of a data file's rows are confined to that file's
directory (symbolic links resolved) and the folders listed in ``data.image_dirs``; a Hub
dataset's path-only images to those folders; rows built in Python are the caller's own and not
confined. Nothing is ever fetched from a URL.
The images live in memory as PIL images: geo3k's 2.1k images are ~0.3 GB at the default budget.
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_MARKER",
    "ImageLimits",
    "ImageProblem",
    "has_images",
    "is_pil_image",
    "load_image",
    "normalize_image_prompt",
    "prompt_images",
    "resize_within",
]

IMAGE_MARKER = "<image>"  # verl's placeholder for "the next image of the row" in prompt text
IMAGE_COLUMNS = ("images", "image")  # the row columns that hold a prompt's images, in order


class ImageProblem(Exception):
    """An image that cannot be used; ``field`` locates it in the row (``prompt[0].content[1]``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ImageLimits:
    """Pixel budget (``data.min_pixels`` / ``data.max_pixels``) and sanity bounds of images."""

    max_pixels: int = 1280 * 28 * 28  # Qwen2.5-VL's usual budget: ≤ 1280 visual tokens
    min_pixels: int = 4 * 28 * 28
    max_source_pixels: int = 89_478_485  # PIL's decompression-bomb threshold
    max_aspect: float = 200.0
    max_file_bytes: int = 64 << 20  # data.max_image_bytes: an image's encoded bytes
    image_dirs: tuple[str, ...] = ()  # data.image_dirs: folders image paths may point into

    def __post_init__(self):
        if self.min_pixels < 1 or self.max_pixels < self.min_pixels:
            raise ValueError(
                f"image pixel budget needs 1 <= min_pixels <= max_pixels, got min_pixels="
                f"{self.min_pixels}, max_pixels={self.max_pixels}"
            )
        object.__setattr__(self, "image_dirs", tuple(self.image_dirs))


def _pil():
    from PIL import Image

    return Image


def is_pil_image(value: Any) -> bool:
    """Whether ``value`` is a PIL image (False where Pillow is missing)."""
    return _is_pil(value)


def _is_pil(value: Any) -> bool:
    try:
        return isinstance(value, _pil().Image)
    except ImportError:  # pragma: no cover - Pillow ships with transformers' vision extra
        return False


def _open_bytes(data: bytes, field: str, what: str, limits: ImageLimits):
    Image = _pil()
    if len(data) > limits.max_file_bytes:
        raise ImageProblem(field, _too_many_bytes(what, len(data), limits))
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        _check_size(img.size, limits, field)  # so a bomb is refused before it is decoded
        img.load()
    except ImageProblem:
        raise
    except Image.DecompressionBombError as err:
        raise ImageProblem(field, f"{what}: image too large to decode safely ({err})") from None
    except Exception as err:  # PIL raises many types for corrupt data; all mean "unreadable"
        raise ImageProblem(
            field, f"{what}: unreadable image ({type(err).__name__}: {err})"
        ) from None
    return img


def _too_many_bytes(what: str, size: int | str, limits: ImageLimits) -> str:
    return (
        f"{what}: {size} bytes, above the {limits.max_file_bytes} an image may have "
        "(data.max_image_bytes)"
    )


def _check_size(size: tuple[int, int], limits: ImageLimits, field: str) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageProblem(field, f"image has no pixels ({w}x{h})")
    if w * h > limits.max_source_pixels:
        raise ImageProblem(
            field,
            f"image is {w}x{h} = {w * h} pixels, above the {limits.max_source_pixels} a decoded "
            "image may have; shrink it before training",
        )
    if max(w, h) / min(w, h) > limits.max_aspect:
        raise ImageProblem(
            field, f"image is {w}x{h}: aspect ratio above {limits.max_aspect:g} is not supported"
        )


def _allowed_dirs(root: Path | None, limits: ImageLimits) -> list[Path]:
    dirs = [Path(d).expanduser() for d in limits.image_dirs]
    return [Path(os.path.realpath(d)) for d in ([root] if root is not None else []) + dirs]


def _read_path(text: str, field: str, root: Path | None, limits: ImageLimits, confine: bool):
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.is_absolute() and root is not None:
        path = root / path
    if confine:
        real = Path(os.path.realpath(path))
        allowed = _allowed_dirs(root, limits)
        if not any(real == d or d in real.parents for d in allowed):
            where = " or ".join(str(d) for d in allowed) or "no folder (data.image_dirs is empty)"
            raise ImageProblem(
                field,
                f"image path {text[:200]!r} is outside {where}; list its folder in "
                "data.image_dirs to allow it",
            )
    if not path.is_file():
        raise ImageProblem(field, f"image file not found: {path}")
    with open(path, "rb") as f:
        data = f.read(limits.max_file_bytes + 1)  # never more than the cap, whatever stat says
    if len(data) > limits.max_file_bytes:
        raise ImageProblem(field, _too_many_bytes(str(path), "more than that, at least", limits))
    return _open_bytes(data, field, str(path), limits)


def _from_string(text: str, field: str, root: Path | None, limits: ImageLimits, confine: bool):
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header:
            raise ImageProblem(field, "a data: URL image must be base64 encoded")
        size = len(payload.rstrip("=")) * 3 // 4  # decoded bytes, told before decoding them
        if size > limits.max_file_bytes:
            raise ImageProblem(field, _too_many_bytes("data: URL", size, limits))
        try:
            data = base64.b64decode(payload, validate=True)
        except ValueError:
            raise ImageProblem(field, "data: URL image holds invalid base64") from None
        return _open_bytes(data, field, "data: URL", limits)
    if re.match(r"^[a-z][a-z0-9+.-]*://", text) and not text.startswith("file://"):
        raise ImageProblem(
            field,
            f"image URL {text[:80]!r}: only local files, file:// and data: URLs are read "
            "(no network at run time); download the images and give their paths",
        )
    return _read_path(text, field, root, limits, confine)


def load_image(
    value: Any,
    field: str,
    root: Path | None = None,
    limits: ImageLimits = ImageLimits(),
    confine: bool = False,
):
    """Decode one image value (see the module docstring) to an RGB PIL image within ``limits``.

    ``root``: the folder relative paths start from; ``confine``: a path must lie in ``root`` or
    ``limits.image_dirs`` (a data file's rows; code's own values are not confined)."""
    if _is_pil(value):
        img = value
    elif isinstance(value, (bytes, bytearray)):
        img = _open_bytes(bytes(value), field, "image bytes", limits)
    elif isinstance(value, str):
        if not value.strip():
            raise ImageProblem(field, "empty image path")
        img = _from_string(value, field, root, limits, confine)
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:  # datasets.Image storage: bytes win over the path
            what = str(value.get("path") or "image bytes")
            img = _open_bytes(bytes(value["bytes"]), field, what, limits)
        elif value.get("path"):
            img = _from_string(str(value["path"]), field, root, limits, confine)
        else:
            raise ImageProblem(field, "image struct has neither bytes nor path")
    elif value is None:
        raise ImageProblem(field, "image is missing (null)")
    else:
        raise ImageProblem(
            field,
            f"image must be a path, URL, bytes, {{bytes, path}} struct or PIL image, got "
            f"{type(value).__name__}",
        )
    return resize_within(img, limits, field)


def resize_within(img, limits: ImageLimits, field: str = "image"):
    """``img`` as RGB with its pixel count in ``[min_pixels, max_pixels]``, aspect ratio kept
    (to the pixel); errors for a decompression bomb or an extreme aspect ratio."""
    _check_size(img.size, limits, field)
    w, h = img.size
    img = img.convert("RGB") if img.mode != "RGB" else img
    pixels = w * h
    if limits.min_pixels <= pixels <= limits.max_pixels:
        return img
    scale = math.sqrt(
        (limits.max_pixels if pixels > limits.max_pixels else limits.min_pixels) / pixels
    )
    if pixels > limits.max_pixels:  # floor: never above the budget
        nw, nh = max(1, math.floor(w * scale)), max(1, math.floor(h * scale))
    else:  # ceil: never below it
        nw, nh = math.ceil(w * scale), math.ceil(h * scale)
    return img.resize((nw, nh), _pil().Resampling.BICUBIC)


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _part_image_value(part: dict) -> tuple[bool, Any]:
    """(whether the part carries its own image, the value) for an image part."""
    if part.get("type") == "image_url":
        ref = part.get("image_url")
        return True, ref.get("url") if isinstance(ref, dict) else ref
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return True, part[key]
    return False, None


class _ColumnImages:
    """The row's image column, handed out in order to bare image parts and ``<image>`` markers."""

    def __init__(self, values: Sequence[Any], column: str, root, limits, confine: bool):
        self.values, self.column, self.root, self.limits = list(values), column, root, limits
        self.confine = confine
        self.used = 0

    def next(self, field: str):
        if self.used >= len(self.values):
            raise ImageProblem(
                field,
                f"the prompt asks for image {self.used + 1} but column '{self.column}' holds "
                f"{len(self.values)}",
            )
        i = self.used
        self.used += 1
        where = f"{self.column}[{i}]"
        return load_image(self.values[i], where, self.root, self.limits, self.confine)


def _text_parts(text: str, images: _ColumnImages | None, field: str) -> list[dict]:
    if images is None or IMAGE_MARKER not in text:
        return [{"type": "text", "text": text}] if text else []
    parts: list[dict] = []
    for i, chunk in enumerate(text.split(IMAGE_MARKER)):
        if i:
            parts.append({"type": "image", "image": images.next(field)})
        if chunk:
            parts.append({"type": "text", "text": chunk})
    return parts


def _content_parts(content: Any, field: str, images, root, limits, confine) -> list[dict]:
    if isinstance(content, str):
        return _text_parts(content, images, field)
    if not isinstance(content, (list, tuple)):
        raise ImageProblem(
            field, f"content must be a string or a list of parts, got {type(content).__name__}"
        )
    parts: list[dict] = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise ImageProblem(where, f"content part must be a dict, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ImageProblem(f"{where}.text", "text part needs a string 'text'")
            parts += _text_parts(text, images, where)
        elif kind in ("image", "image_url"):
            own, value = _part_image_value(part)
            if own:
                image = load_image(value, where, root, limits, confine)
                parts.append({"type": "image", "image": image})
            elif images is not None:
                parts.append({"type": "image", "image": images.next(where)})
            else:
                raise ImageProblem(where, "image part has no image and the row no image column")
        else:
            raise ImageProblem(
                f"{where}.type",
                f"unknown content part type {kind!r} (valid: text, image, image_url)",
            )
    return parts


def _column(raw: dict) -> tuple[str, list] | None:
    for name in IMAGE_COLUMNS:
        value = raw.get(name)
        if value is None or (isinstance(value, (list, tuple)) and not value):
            continue  # null or [] : a row without images
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        return name, values
    return None


def has_image_input(raw: dict) -> bool:
    """Whether a raw row shows images (an image column, or a message with content parts)."""
    if _column(raw) is not None:
        return True
    prompt = raw.get("prompt")
    return isinstance(prompt, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get("content"), (list, tuple)) for m in prompt
    )


def normalize_image_prompt(raw: dict, root: Path | None = None,
                           limits: ImageLimits = ImageLimits(),
                           confine: bool = False) -> tuple[list[dict], str | None]:  # fmt: skip
    """The row's prompt as chat messages with decoded image parts, and the image column it read
    (None: images only inside the messages). Every image of the column must be used.
    ``root``, ``confine``: see :func:`load_image`."""
    col = _column(raw)
    images = _ColumnImages(col[1], col[0], root, limits, confine) if col else None
    prompt = raw["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]  # images need a chat template's markers
    if not isinstance(prompt, (list, tuple)):
        raise ImageProblem(
            "prompt", f"prompt must be a string or chat messages, got {type(prompt).__name__}"
        )
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, dict) or "content" not in msg:
            raise ImageProblem(f"prompt[{i}]", "chat message must be a dict with 'content'")
        where = f"prompt[{i}].content"
        parts = _content_parts(msg["content"], where, images, root, limits, confine)
        messages.append({**msg, "content": parts})
    if images is not None and images.used < len(images.values):
        if images.used:
            raise ImageProblem(
                images.column,
                f"column '{images.column}' holds {len(images.values)} images but the prompt "
                f"places {images.used}",
            )
        # No markers: the images open the first user message (TRL's and the processors' habit).
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), 0)
        loaded = [images.next(f"{images.column}") for _ in range(len(images.values))]
        messages[first]["content"] = [{"type": "image", "image": im} for im in loaded] + (
            messages[first]["content"]
        )
    if not any(p["type"] == "image" or p["text"].strip() for m in messages for p in m["content"]):
        raise ImageProblem("prompt", "empty prompt: no text and no image")
    return messages, col[0] if col else None


def prompt_images(prompt: Any) -> list:
    """The PIL images of a normalised prompt, in order (empty for text prompts)."""
    if not isinstance(prompt, list):
        return []
    return [
        p["image"]
        for m in prompt
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image"
    ]


def has_images(prompt: Any) -> bool:
    return bool(prompt_images(prompt))
