"""The policy model from ``model`` (a tiny Llama or VLM, or a local Hugging Face directory), the
start-up checks on model directories, and the Hub ids a config names resolved to local paths.

Design decision: ``build_model`` takes the ``ModelConfig`` section alone (plus the tokenizer and
a seed), so a worker process rebuilds the exact model from the picklable section it was handed;
this module imports only the model code (and the stdlib-only Hub resolver), which is all such
a worker needs.
"""

from __future__ import annotations

from pathlib import Path

from groupflow.config import Config, ModelConfig, present
from groupflow.models.causal_lm import ModelLoadError, build_tiny_llama, hf_model, load_causal_lm
from groupflow.models.logit_transform import check_logit_transform
from groupflow.models.tiny_vlm import tiny_idefics3
from groupflow.models.vision import freeze_vision_tower, is_vision_model
from groupflow.utils.hub import is_hub_id, resolve_model_path

__all__ = ["resolve_hub_models", "check_model_dir", "build_model", "eos_ids"]


def resolve_hub_models(cfg: Config) -> Config:
    """A copy of ``cfg`` whose model paths that are Hub ids (policy, tokenizer, critic, reward
    model and its tokenizer, diffusion model) name their local snapshot directories
    (``groupflow.utils.hub``); ``cfg`` itself, which is logged and checkpointed, keeps the ids.
    A missing tiny flow model that ``pretrain_if_missing`` will create stays a local path."""
    out = cfg.model_copy(deep=True)
    sections = [
        ("model", ("path", "tokenizer_path")),
        ("critic", ("path",)),
        ("reward_model", ("path", "tokenizer_path")),
        ("teacher", ("path",)),
    ]
    for name, keys in sections:
        section = getattr(out, name)
        if section is None:
            continue
        for key in keys:
            value = getattr(section, key, None)
            if value is not None:
                setattr(section, key, resolve_model_path(value, section.revision, f"{name}.{key}"))
    dm = out.diffusion.model if out.diffusion is not None else None
    if dm is not None and not (dm.kind == "tiny" and dm.pretrain_if_missing):
        dm.path = resolve_model_path(dm.path, dm.revision, "diffusion.model.path")
        for key in DIFFUSION_PARTS:
            value = getattr(dm, key)
            if value is not None:
                setattr(dm, key, _pipeline_part(value, dm.path, key))
    return out


# a diffusers pipeline's other parts, each a local folder, a folder of the pipeline at
# diffusion.model.path (`text_encoder`, `vae`: a Hub snapshot holds one per part) or a Hub id
DIFFUSION_PARTS = (
    "text_encoder_path", "tokenizer_path", "text_encoder_2_path", "tokenizer_2_path",
    "text_encoder_3_path", "vae_path",
)  # fmt: skip


def _pipeline_part(value: str, pipeline: str, key: str) -> str:
    """A local path wins; then ``value`` as a folder of the pipeline (``model_index.json`` beside
    it: the same snapshot, so the same revision, as its transformer); then ``value`` as a Hub id
    of its own (at its default branch: diffusion.model.revision is the pipeline's). Neither: a
    ModelLoadError naming the key, the value and the places looked in."""
    if Path(value).expanduser().exists():
        return value
    root = Path(pipeline).expanduser()
    is_pipeline = (root / "model_index.json").is_file()
    if is_pipeline and (root / value).is_dir():
        return str(root / value)
    if is_hub_id(value):
        return resolve_model_path(value, None, f"diffusion.model.{key}")
    where = f" nor a folder of the pipeline at '{root}'" if is_pipeline else ""
    raise ModelLoadError(
        f"diffusion.model.{key}: '{value}' is neither a local directory{where} nor a Hub id "
        "(owner/name)"
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
        model = load_causal_lm(present(m.path, "model.path"), dtype=m.dtype,
                               trust_remote_code=m.trust_remote_code)  # fmt: skip
    if m.freeze_vision and is_vision_model(model):
        freeze_vision_tower(model)
    check_logit_transform(model)  # training log-probs must be those the model samples from
    if m.gradient_checkpointing:
        hf = hf_model(model)
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.config.use_cache = False
    return model
