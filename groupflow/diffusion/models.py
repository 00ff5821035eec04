"""Flow-matching models behind one small interface: a tiny CPU model and diffusers transformers.

Design decision: the policy needs four things from a generator, so that is the whole interface
(:class:`FlowModel`): ``forward(x, σ[B], cond) -> v`` (the velocity ε − x0), ``encode(prompts)``
(a dict of per-sample condition tensors, so conditions split and concatenate like any Batch
entry), ``null_cond(n)`` (the unconditional input for classifier-free guidance) and ``decode(x0)``
(latent -> image/video in [0, 1]). ``latent_shape`` is one sample's latent: ``(C, H, W)`` for
images, ``(C, F, H, W)`` for video.

- :class:`TinyFlowModel` — a ~26k-parameter conditional conv net in pixel space (3×16×16) whose
  condition is one of a few text labels; it pre-trains on synthetic shapes on a CPU
  (``groupflow pretrain-diffusion``) and is what the demo fine-tunes.
- :class:`DiffusersFlowModel` — wraps a diffusers flow transformer loaded from a local
  directory: ``SD3Transformer2DModel`` (``sd3``), ``WanTransformer3DModel`` (``wan``, video
  latents [B, C, F, H, W]), ``FluxTransformer2DModel`` (``flux``, FLUX.1),
  ``QwenImageTransformer2DModel`` (``qwen_image``), ``ZImageTransformer2DModel`` (``z_image``) or
  ``Flux2Transformer2DModel`` (``flux2``, FLUX.2 dev / klein). Each is called exactly as its
  diffusers pipeline calls it — latent packing, position ids, timestep scale, text masks,
  guidance embedding — by ``groupflow.diffusion.kinds``, so the policy keeps seeing
  [B, C, H, W] and a velocity ε − x0. A :class:`PromptEncoder` turns prompts into the
  transformer's conditioning tensors: the pipeline's own text encoder
  (``groupflow.diffusion.encoders`` / ``text_encoders``), or without one
  :class:`HashPromptEncoder`'s fixed random embeddings per prompt (tests, label-like prompts) and
  :class:`MaskedHashPromptEncoder`'s, the same with a text mask of a per-prompt length (the kinds
  whose transformer takes a mask or variable-length captions); the pipeline's VAE comes through
  ``decoder`` (``groupflow.diffusion.vaes``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from groupflow.diffusion.kinds import (
    KIND_CALLS,
    KIND_CLASSES,
    check_kind_latent,
    flux_image_ids,
    freeze_unused,
    pack_flux_latents,
    unpack_flux_latents,
)
from groupflow.diffusion.sharding import empty_parameters

__all__ = [
    "FlowModel",
    "PromptEncoder",
    "HashPromptEncoder",
    "MaskedHashPromptEncoder",
    "TinyFlowModel",
    "DiffusersFlowModel",
    "check_latents",
    "check_latent_fits",
    "check_text_widths",
    "check_teacher_model",
    "load_tiny_model",
    "save_tiny_model",
    "load_diffusers_model",
    "transformer_config",
    "transformer_dir",
    "ModelPathError",
    "UnknownPromptError",
    # re-exported from groupflow.diffusion.kinds (where the per-kind code lives)
    "flux_image_ids",
    "pack_flux_latents",
    "unpack_flux_latents",
]


class ModelPathError(FileNotFoundError):
    """A model directory is missing or holds no loadable model."""


class UnknownPromptError(ValueError):
    """A prompt the model cannot condition on (the tiny model knows a fixed set of labels)."""


class FlowModel(Protocol):
    latent_shape: tuple[int, ...]

    def __call__(self, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor: ...
    def encode(self, prompts: Sequence[str]) -> dict[str, Tensor]: ...
    def null_cond(self, n: int) -> dict[str, Tensor]: ...
    def decode(self, x0: Tensor) -> Tensor: ...


def check_latents(x: Tensor, latent_shape: Sequence[int], where: str) -> None:
    """A latent batch must be [B, *latent_shape]; say which one was expected otherwise."""
    if tuple(x.shape[1:]) != tuple(latent_shape):
        raise ValueError(
            f"{where}: latent shape mismatch: expected [B, {', '.join(map(str, latent_shape))}], "
            f"got {list(x.shape)}"
        )


def _timestep_embedding(sigma: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of 1000·σ (the timestep diffusers models see)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
    args = (1000.0 * sigma.float())[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], 1)


class _FiLMBlock(nn.Module):
    """conv -> norm -> scale/shift by the condition -> SiLU -> conv, with a residual."""

    def __init__(self, width: int, emb: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.GroupNorm(4, width)
        self.film = nn.Linear(emb, 2 * width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        scale, shift = self.film(c)[:, :, None, None].chunk(2, 1)
        y = torch.nn.functional.silu(self.norm(self.conv1(h)) * (1 + scale) + shift)
        return h + self.conv2(y)


class TinyFlowModel(nn.Module):
    """A small conditional velocity model in pixel space (images in [-1, 1]).

    ``labels`` are the prompts it knows; index ``len(labels)`` is the null (unconditional) label
    that pre-training drops to with some probability, so CFG works.
    """

    def __init__(
        self,
        labels: Sequence[str],
        *,
        channels: int = 3,
        image_size: int = 16,
        width: int = 16,
        blocks: int = 2,
        emb_dim: int = 64,
    ):
        super().__init__()
        if not labels:
            raise ValueError("TinyFlowModel needs at least one label")
        self.labels = list(labels)
        self.arch = dict(
            channels=channels, image_size=image_size, width=width, blocks=blocks, emb_dim=emb_dim
        )
        self.latent_shape = (channels, image_size, image_size)
        self.emb_dim = emb_dim
        self.label_emb = nn.Embedding(len(self.labels) + 1, emb_dim)
        self.time_mlp = nn.Sequential(
            nn.Linear(emb_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        # Full resolution only at the edges (narrow, cheap); the conditioned blocks work at half
        # resolution, where most of the compute goes.
        skip = max(8, width // 2)
        self.conv_in = nn.Conv2d(channels, skip, 3, padding=1)
        self.down = nn.Conv2d(skip, width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(_FiLMBlock(width, emb_dim) for _ in range(blocks))
        self.up = nn.ConvTranspose2d(width, skip, 4, stride=2, padding=1)
        self.conv_out = nn.Conv2d(2 * skip, channels, 3, padding=1)

    def forward(self, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor:
        check_latents(x, self.latent_shape, "TinyFlowModel")
        c = self.time_mlp(_timestep_embedding(sigma, self.emb_dim)) + self.label_emb(cond["labels"])
        c = torch.nn.functional.silu(c)
        h0 = torch.nn.functional.silu(self.conv_in(x))
        h = self.down(h0)
        for block in self.blocks:
            h = block(h, c)
        h = torch.cat([self.up(h), h0], 1)
        return self.conv_out(torch.nn.functional.silu(h))

    def encode(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        index = {label: i for i, label in enumerate(self.labels)}
        unknown = sorted({p for p in prompts if p not in index})
        if unknown:
            raise UnknownPromptError(
                f"the tiny diffusion model has no label {unknown[0]!r}; its labels are {self.labels}"
            )
        return {"labels": torch.tensor([index[p] for p in prompts], dtype=torch.long)}

    def null_cond(self, n: int) -> dict[str, Tensor]:
        return {"labels": torch.full((n,), len(self.labels), dtype=torch.long)}

    def decode(self, x0: Tensor) -> Tensor:
        return ((x0 + 1) / 2).clamp(0, 1)


def save_tiny_model(model: TinyFlowModel, path: str | Path) -> Path:
    """``config.json`` (labels, architecture) + ``model.safetensors``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({"type": "tiny_flow", "labels": model.labels, **model.arch}, indent=2)
    )
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"))
    return path


def load_tiny_model(path: str | Path) -> TinyFlowModel:
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config, weights = path / "config.json", path / "model.safetensors"
    if not (config.is_file() and weights.is_file()):
        raise ModelPathError(
            f"tiny diffusion model directory '{path}' is missing config.json or model.safetensors "
            "(create it with: groupflow pretrain-diffusion --out DIR)"
        )
    cfg = json.loads(config.read_text())
    if cfg.pop("type", None) != "tiny_flow":
        raise ModelPathError(f"'{config}' is not a tiny flow model config (type != tiny_flow)")
    model = TinyFlowModel(cfg.pop("labels"), **cfg)
    model.load_state_dict(load_file(str(weights)))
    return model


# ----- diffusers transformers ---------------------------------------------------------------------


class PromptEncoder(Protocol):
    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]: ...
    def null(self, n: int) -> dict[str, Tensor]: ...


class HashPromptEncoder:
    """Fixed random embeddings per prompt text (seeded by its SHA-256): deterministic across
    processes, so rollout and training workers agree. ``null`` is all zeros.

    Keys: ``encoder_hidden_states`` [B, seq_len, dim] and, with ``pooled_dim``,
    ``pooled_projections`` [B, pooled_dim].
    """

    def __init__(self, dim: int, seq_len: int = 4, pooled_dim: int | None = None):
        self.dim, self.seq_len, self.pooled_dim = dim, seq_len, pooled_dim

    def _one(self, prompt: str) -> dict[str, Tensor]:
        seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little") % (2**63)
        g = torch.Generator().manual_seed(seed)
        out = {"encoder_hidden_states": torch.randn(self.seq_len, self.dim, generator=g)}
        if self.pooled_dim:
            out["pooled_projections"] = torch.randn(self.pooled_dim, generator=g)
        return out

    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        rows = [self._one(p) for p in prompts]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def null(self, n: int) -> dict[str, Tensor]:
        out = {"encoder_hidden_states": torch.zeros(n, self.seq_len, self.dim)}
        if self.pooled_dim:
            out["pooled_projections"] = torch.zeros(n, self.pooled_dim)
        return out


class MaskedHashPromptEncoder:
    """:class:`HashPromptEncoder`'s embeddings with a text mask, for transformers that take one
    (Qwen-Image) or unpadded captions (Z-Image): a prompt of n words has min(n, seq_len) real
    tokens (at least 1), the rest zeros and masked out. ``null``: one zero token.

    Keys: ``encoder_hidden_states`` [B, seq_len, dim], ``encoder_hidden_states_mask`` [B, seq_len]
    (int64, 1: a real token).
    """

    def __init__(self, dim: int, seq_len: int = 4):
        self.dim, self.seq_len = dim, seq_len
        self._hash = HashPromptEncoder(dim, seq_len)

    def _mask(self, lengths: Sequence[int]) -> Tensor:
        return (torch.arange(self.seq_len)[None] < torch.tensor(lengths)[:, None]).long()

    def __call__(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        mask = self._mask([min(max(len(p.split()), 1), self.seq_len) for p in prompts])
        hidden = self._hash(prompts)["encoder_hidden_states"] * mask[..., None]
        return {"encoder_hidden_states": hidden, "encoder_hidden_states_mask": mask}

    def null(self, n: int) -> dict[str, Tensor]:
        return {
            "encoder_hidden_states": torch.zeros(n, self.seq_len, self.dim),
            "encoder_hidden_states_mask": self._mask([1] * n),
        }


DIFFUSERS_KINDS = KIND_CLASSES  # kind -> its diffusers transformer class name


def _check_kind(kind: str) -> None:
    if kind not in DIFFUSERS_KINDS:
        raise ValueError(
            f"unknown diffusers model kind '{kind}'; valid kinds: {sorted(DIFFUSERS_KINDS)}"
        )


def check_latent_fits(config, kind: str, latent_shape: Sequence[int]) -> None:
    """Refuse a ``diffusion.model.latent_shape`` the transformer cannot take: other channels than
    its ``in_channels``, frames/height/width not divisible by its patch, or (SD3) more patches per
    side than its position embedding holds. ``config``: the transformer's diffusers config."""
    shape = [int(d) for d in latent_shape]
    key = f"diffusion.model.latent_shape={shape}"
    if check_kind_latent(config, kind, shape, key):  # the kinds groupflow.diffusion.kinds packs
        return
    channels = getattr(config, "in_channels", None)
    if channels is not None and shape[0] != channels:
        raise ValueError(
            f"{key}: the {DIFFUSERS_KINDS[kind]} takes {channels} latent channels, not {shape[0]}"
        )
    patch = getattr(config, "patch_size", None)
    if patch is None:
        return
    patch = [1, patch, patch] if isinstance(patch, int) else [int(q) for q in patch]
    names, dims = ("frames", "height", "width"), shape[1:] if kind == "wan" else [1, *shape[1:]]
    for name, d, q in zip(names, dims, patch, strict=True):
        if d % q:
            raise ValueError(f"{key}: {name} {d} is not divisible by the patch size {q}")
    most = getattr(config, "pos_embed_max_size", None)
    if kind == "sd3" and most is not None and max(dims[1] // patch[1], dims[2] // patch[2]) > most:
        raise ValueError(
            f"{key}: {dims[1] // patch[1]}x{dims[2] // patch[2]} patches exceed the position "
            f"embedding's {most} per side (pos_embed_max_size)"
        )


class DiffusersFlowModel(nn.Module):
    """A diffusers flow transformer as a :class:`FlowModel`; ``kind`` is a key of
    :data:`DIFFUSERS_KINDS` (``guidance``: the guidance scale a guidance-distilled FLUX.1 or
    FLUX.2 takes as input)."""

    def __init__(
        self,
        transformer: nn.Module,
        kind: str,
        latent_shape: Sequence[int],
        prompt_encoder: PromptEncoder,
        decoder: Callable[[Tensor], Tensor] | None = None,
        guidance: float = 3.5,
    ):
        super().__init__()
        _check_kind(kind)
        want = 4 if kind == "wan" else 3
        if len(latent_shape) != want:
            layout = "(C, F, H, W)" if want == 4 else "(C, H, W)"
            raise ValueError(
                f"a '{kind}' latent is {layout}; got latent_shape={list(latent_shape)}"
            )
        if hasattr(transformer, "config"):
            check_latent_fits(transformer.config, kind, latent_shape)
        freeze_unused(transformer, kind)
        self.transformer, self.kind = transformer, kind
        self.latent_shape = tuple(int(d) for d in latent_shape)
        self.prompt_encoder, self.decoder = prompt_encoder, decoder
        self.guidance = float(guidance)

    def forward(self, x: Tensor, sigma: Tensor, cond: dict[str, Tensor]) -> Tensor:
        check_latents(x, self.latent_shape, f"{DIFFUSERS_KINDS[self.kind]} adapter")
        return KIND_CALLS[self.kind](self.transformer, x, sigma, cond, self.guidance)

    def encode(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        return self.prompt_encoder(prompts)

    def null_cond(self, n: int) -> dict[str, Tensor]:
        return self.prompt_encoder.null(n)

    def decode(self, x0: Tensor) -> Tensor:
        """The decoder (e.g. a VAE) if given; else a preview: the first 3 latent channels in [0, 1]."""
        if self.decoder is not None:
            return self.decoder(x0)
        c = min(3, x0.shape[1])
        return ((x0[:, :c] + 1) / 2).clamp(0, 1)


def transformer_dir(path: str | Path) -> Path:
    """``path``, or its ``transformer/`` where ``path`` is a whole diffusers pipeline (a Hub
    snapshot of e.g. Qwen/Qwen-Image holds ``model_index.json`` and one folder per part)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file() and (path / "transformer" / "config.json").is_file():
        return path / "transformer"
    return path


def _default_encoder(kind: str, c) -> PromptEncoder:
    """Fixed random embeddings of the widths ``kind``'s transformer config asks for."""
    if kind in ("sd3", "flux"):
        return HashPromptEncoder(c.joint_attention_dim, pooled_dim=c.pooled_projection_dim)
    if kind == "qwen_image":
        return MaskedHashPromptEncoder(c.joint_attention_dim)
    if kind == "z_image":
        return MaskedHashPromptEncoder(c.cap_feat_dim)
    if kind == "flux2":
        return HashPromptEncoder(c.joint_attention_dim)
    return HashPromptEncoder(c.text_dim)


# kind -> (the prompt encoder's attribute, the transformer config's field, the key naming it)
_TEXT_WIDTHS = {
    "sd3": [("dim", "joint_attention_dim", "text_encoder_3_path"),
            ("pooled_dim", "pooled_projection_dim", "text_encoder_path + text_encoder_2_path")],
    "wan": [("dim", "text_dim", "text_encoder_path")],
    "flux": [("dim", "joint_attention_dim", "text_encoder_2_path"),
             ("pooled_dim", "pooled_projection_dim", "text_encoder_path")],
    "qwen_image": [("dim", "joint_attention_dim", "text_encoder_path")],
    "z_image": [("dim", "cap_feat_dim", "text_encoder_path")],
    "flux2": [("dim", "joint_attention_dim", "text_encoder_path")],
}  # fmt: skip


def check_text_widths(config, kind: str, encoder, path) -> None:
    """Refuse a text encoder whose embeddings are not as wide as the transformer's text input."""
    for attr, field, key in _TEXT_WIDTHS.get(kind, []):
        want, got = getattr(config, field, None), getattr(encoder, attr, None)
        if want is not None and got is not None and got != want:
            raise ValueError(
                f"diffusion.model.{key}: its embeddings have {got} features; the transformer at "
                f"'{path}' takes {field}={want}"
            )


def load_diffusers_model(
    path: str | Path,
    kind: str,
    latent_shape: Sequence[int],
    prompt_encoder: PromptEncoder | None = None,
    decoder: Callable[[Tensor], Tensor] | None = None,
    empty: bool = False,
    guidance: float = 3.5,
) -> DiffusersFlowModel:
    """Load ``kind``'s transformer (:data:`DIFFUSERS_KINDS`) from a local directory — the
    transformer's own, or a diffusers pipeline's whose ``transformer/`` holds it (a Hub id is
    resolved to its snapshot before: ``assembly.models``); a config of another class than
    ``kind``'s is an error naming both.

    ``empty``: build it from its config with parameters on the meta device and read no weights
    (the FSDP2 worker shards it, then reads each rank's shard: ``sharding.materialise_shards``).
    """
    _check_kind(kind)
    path = transformer_dir(path)
    if not (path / "config.json").is_file():
        raise ModelPathError(
            f"diffusers transformer directory '{path}' has no config.json (nor transformer/)"
        )
    import diffusers

    cls = getattr(diffusers, DIFFUSERS_KINDS[kind])
    found = json.loads((path / "config.json").read_text()).get("_class_name")
    if found is not None and found != cls.__name__:
        raise ValueError(
            f"diffusion.model.path: '{path}' holds a {found}, but diffusion.model.kind "
            f"'{kind}' takes a {cls.__name__}"
        )
    if empty:
        with empty_parameters():
            transformer = cls.from_config(cls.load_config(str(path), local_files_only=True))
    else:
        transformer = cls.from_pretrained(str(path), local_files_only=True)
    if prompt_encoder is None:
        c = transformer.config
        prompt_encoder = _default_encoder(kind, c)
    check_text_widths(transformer.config, kind, prompt_encoder, path)
    z_dim = getattr(decoder, "z_dim", None)
    if z_dim is not None and z_dim != int(latent_shape[0]):
        raise ValueError(
            f"diffusion.model.vae_path: the VAE decodes {z_dim}-channel latents; "
            f"diffusion.model.latent_shape has {int(latent_shape[0])}"
        )
    return DiffusersFlowModel(transformer, kind, latent_shape, prompt_encoder, decoder, guidance)


# ----- a distillation teacher (groupflow.diffusion.distillation) ---------------------------------

# What must agree for the teacher's velocity at the student's state to mean the same thing: the
# latent (shape, channels, patching) and the conditioning (the tiny model's label indices; a
# transformer's text-embedding widths, whose inputs the student's prompt encoder makes).
_TEACHER_KEYS = {
    "tiny": ("type", "channels", "image_size", "labels"),
    "sd3": ("_class_name", "in_channels", "out_channels", "patch_size", "joint_attention_dim",
            "pooled_projection_dim"),
    "wan": ("_class_name", "in_channels", "out_channels", "patch_size", "text_dim"),
    "flux": ("_class_name", "in_channels", "out_channels", "joint_attention_dim",
             "pooled_projection_dim", "guidance_embeds"),
    "qwen_image": ("_class_name", "in_channels", "out_channels", "patch_size",
                   "joint_attention_dim"),
    "z_image": ("_class_name", "in_channels", "all_patch_size", "all_f_patch_size",
                "cap_feat_dim"),
    "flux2": ("_class_name", "in_channels", "out_channels", "joint_attention_dim",
              "guidance_embeds"),
}  # fmt: skip


def transformer_config(path: str | Path, key: str = "diffusion.model.path") -> dict:
    """The flow model's ``config.json`` at ``path`` (or its ``transformer/``), read only."""
    file = transformer_dir(path) / "config.json"
    if not file.is_file():
        raise ModelPathError(f"{key}: '{file.parent}' holds no flow model (no config.json)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: '{file}' is not valid JSON ({e})") from None


def check_teacher_model(teacher_path: str | Path, student_path: str | Path, kind: str) -> None:
    """Refuse a teacher whose latent or conditioning differs from the student's, reading only
    the two ``config.json`` files (before any worker starts): errors name ``teacher.path`` and
    each differing field with both values."""
    if kind != "tiny":
        _check_kind(kind)
    teacher = transformer_config(teacher_path, "teacher.path")
    student = transformer_config(student_path, "diffusion.model.path")
    differ = [
        f"{k}: student {student.get(k)!r}, teacher {teacher.get(k)!r}"
        for k in _TEACHER_KEYS[kind]
        if teacher.get(k) != student.get(k)
    ]
    if differ:
        raise ValueError(
            f"teacher.path: the teacher at '{teacher_path}' does not match the student's latent "
            f"or conditioning ({'; '.join(differ)}); distillation scores the student's own states, "
            "so both must take the same latents and conditions"
        )
