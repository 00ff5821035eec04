"""The text-encoder folders checked against the kind and the transformer before any worker starts.

Design decision: a worker loads the text encoders only once it has started (minutes into a run on
a cluster, and gigabytes for T5-XXL), so a folder of the wrong model or width must fail before
that, from what is cheap to read: each folder's ``config.json`` (transformers' ``AutoConfig``,
which fills in the defaults a saved config leaves out; no weights) and the transformer's. The
policy runs :func:`check_text_encoder_folders` before it starts its workers and
``FlowModelSpec.build`` before it loads anything; the loaded encoders' widths are checked again
by ``models.check_text_widths`` (the encoder may be any ``PromptEncoder`` there). Each error names
the key, the folder and both values: the model type or class found and the one the kind's
pipeline loads, or the embedding width and the transformer's field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from groupflow.diffusion.encoders import local_folder
from groupflow.diffusion.models import transformer_dir

__all__ = ["TEXT_ENCODER_PARTS", "EncoderPart", "check_text_encoder_folders"]


@dataclass(frozen=True)
class EncoderPart:
    """One text encoder of a kind's pipeline: its key, the folder it defaults to beside
    ``text_encoder_path``'s (None: only where the key is set), the model types and (where the
    type alone does not tell) the class its pipeline loads, and how its width is read."""

    key: str
    default: str | None
    model_types: tuple[str, ...]
    cls: str
    width: str  # the config field of its embeddings' width (of text_config where there is one)
    architecture: bool = False  # the class must be cls: a CLIP without projection is not SD3's


_CLIP_L = EncoderPart("text_encoder_path", None, ("clip_text_model",),
                      "CLIPTextModelWithProjection", "hidden_size", architecture=True)  # fmt: skip
TEXT_ENCODER_PARTS: dict[str, tuple[EncoderPart, ...]] = {
    "sd3": (
        _CLIP_L,
        EncoderPart("text_encoder_2_path", "text_encoder_2", ("clip_text_model",),
                    "CLIPTextModelWithProjection", "hidden_size", architecture=True),
        EncoderPart("text_encoder_3_path", None, ("t5",), "T5EncoderModel", "d_model"),
    ),
    "wan": (EncoderPart("text_encoder_path", None, ("umt5",), "UMT5EncoderModel", "d_model"),),
    "flux": (
        EncoderPart("text_encoder_path", None, ("clip_text_model",), "CLIPTextModel",
                    "hidden_size"),
        EncoderPart("text_encoder_2_path", "text_encoder_2", ("t5",), "T5EncoderModel",
                    "d_model"),
    ),
    "qwen_image": (EncoderPart("text_encoder_path", None, ("qwen2_5_vl",),
                               "Qwen2_5_VLForConditionalGeneration", "hidden_size"),),
    "z_image": (EncoderPart("text_encoder_path", None, ("qwen3",), "Qwen3 model",
                            "hidden_size"),),
    "flux2": (EncoderPart("text_encoder_path", None, ("mistral3", "qwen3"),
                          "Mistral3 (dev) or Qwen3 (klein) model", "hidden_size"),),
}  # fmt: skip

# the key an error about SD3's pooled (both CLIPs') width names
_SD3_POOLED = "text_encoder_path + diffusion.model.text_encoder_2_path"


def _config(folder: Path, key: str) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError) as e:  # no or an unknown model_type, bad JSON
        raise ValueError(f"diffusion.model.{key}: '{folder}' holds no text encoder's config "
                         f"({str(e).strip().splitlines()[0]})") from None  # fmt: skip


def _width(config: Any, field: str) -> int:
    return int(getattr(getattr(config, "text_config", None) or config, field))


def _check_class(kind: str, part: EncoderPart, folder: Path, config: Any) -> None:
    found = (getattr(config, "architectures", None) or [config.model_type])[0]
    wrong_type = config.model_type not in part.model_types
    if wrong_type or (part.architecture and found != part.cls):
        raise ValueError(
            f"diffusion.model.{part.key}: '{folder}' holds a {found} (model_type "
            f"{config.model_type}), but diffusion.model.kind '{kind}' takes a {part.cls}"
        )


def _folders(kind: str, parts: dict) -> list[tuple[EncoderPart, Path]]:
    first = local_folder(parts["text_encoder_path"], f"{TEXT_ENCODER_PARTS[kind][0].cls} text "
                         "encoder", "diffusion.model.text_encoder_path")  # fmt: skip
    out = []
    for part in TEXT_ENCODER_PARTS[kind]:
        path = parts.get(part.key) or (first.parent / part.default if part.default else None)
        if path is not None:
            what = f"{part.cls} text encoder"
            out.append((part, local_folder(path, what, f"diffusion.model.{part.key}")))
    return out


def _too_wide(key: str, got: int, folder: Path, field: str, want: int, model: Path) -> ValueError:
    return ValueError(
        f"diffusion.model.{key}: its embeddings have {got} features; the transformer at "
        f"'{model}' takes {field}={want} (text encoder: '{folder}')"
    )


def _check_sd3_widths(widths: dict, folders: dict, model: Path, t: dict) -> None:
    joint, pooled = t.get("joint_attention_dim"), t.get("pooled_projection_dim")
    t5 = widths.get("text_encoder_3_path")
    if t5 is not None and joint is not None and t5 != joint:
        raise _too_wide("text_encoder_3_path", t5, folders["text_encoder_3_path"],
                        "joint_attention_dim", joint, model)  # fmt: skip
    clip = widths["text_encoder_path"] + widths["text_encoder_2_path"]
    wide = t5 if t5 is not None else joint
    if wide is not None and clip > wide:
        raise ValueError(
            f"diffusion.model.{_SD3_POOLED}: CLIP-L's and CLIP-G's hidden states are {clip} wide "
            f"together, wider than the T5 part's {wide} ('{folders['text_encoder_path']}', "
            f"'{folders['text_encoder_2_path']}')"
        )
    got = widths["pooled"]
    if pooled is not None and got != pooled:
        raise _too_wide(_SD3_POOLED, got, folders["text_encoder_path"], "pooled_projection_dim",
                        pooled, model)  # fmt: skip


# kind -> [(the part's key, the transformer config's field its width must equal, a factor)]
_WIDTHS = {
    "wan": [("text_encoder_path", "text_dim", 1)],
    "flux": [("text_encoder_path", "pooled_projection_dim", 1),
             ("text_encoder_2_path", "joint_attention_dim", 1)],
    "qwen_image": [("text_encoder_path", "joint_attention_dim", 1)],
    "z_image": [("text_encoder_path", "cap_feat_dim", 1)],
    "flux2": [("text_encoder_path", "joint_attention_dim", 3)],  # three hidden states per token
}  # fmt: skip


def check_text_encoder_folders(kind: str, parts: dict, model_path: str | Path) -> None:
    """Refuse ``diffusion.model``'s text-encoder folders (``parts``: its keys) that hold another
    model than ``kind``'s pipeline loads, or whose embeddings the transformer at ``model_path``
    cannot take, reading only ``config.json`` files. Nothing to check without
    ``text_encoder_path`` or for a kind without wired encoders (the config refuses those)."""
    if not parts.get("text_encoder_path") or kind not in TEXT_ENCODER_PARTS:
        return
    widths, folders = {}, {}
    for part, folder in _folders(kind, parts):
        config = _config(folder, part.key)
        _check_class(kind, part, folder, config)
        widths[part.key], folders[part.key] = _width(config, part.width), folder
        if kind == "sd3" and part.architecture:
            widths["pooled"] = widths.get("pooled", 0) + int(config.projection_dim)
    model = transformer_dir(model_path)
    if not (model / "config.json").is_file():
        return  # the transformer's loader names the missing folder
    t = json.loads((model / "config.json").read_text())
    if kind == "sd3":
        _check_sd3_widths(widths, folders, model, t)
        return
    for key, field, factor in _WIDTHS[kind]:
        want, got = t.get(field), widths[key] * factor
        if want is not None and got != want:
            raise _too_wide(key, got, folders[key], field, want, model)
