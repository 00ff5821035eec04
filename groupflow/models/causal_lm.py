"""Causal LMs: build a tiny one from a config, load a real one from a local HF directory.

Design decision: groupflow uses plain HF ``PreTrainedModel`` objects and touches them only through
three narrow helpers — ``decoder_forward`` (hidden states), the output embedding (LM head) and a
KV-cache forward used by the rollout engine and by the shared-prompt training forward
(``response_hidden_states``). That keeps every HF causal LM (Llama, Qwen, SmolLM,
Mistral...) usable without per-architecture code, and lets log-probs be computed from hidden states
in chunks so memory never holds B·T·V logits at once.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from groupflow.algorithms.masks import response_span
from groupflow.models.vision import (
    collate_vision,
    multimodal_base,
    placeholder_ids,
    vision_positions,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ModelLoadError",
    "hf_model",
    "build_tiny_llama",
    "load_causal_lm",
    "cache_kwarg",
    "token_positions",
    "response_hidden_states",
]


class ModelLoadError(ValueError):
    """A model or tokenizer path is missing or not an HF directory."""


def hf_model(model: nn.Module) -> PreTrainedModel:
    """``model`` as the Hugging Face model it is, for the type checker only: workers and
    forwards hold their models as ``nn.Module`` (a wrapped, sharded or LoRA model is one too),
    whose ``__getattr__`` types every HF method (``get_decoder``, ``config``, ...) as a tensor."""
    return cast("PreTrainedModel", model)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def build_tiny_llama(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 128,
    tie_embeddings: bool = True,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> nn.Module:
    """A small Llama-architecture LM, randomly initialised from ``seed`` (for tests and the demo)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or int(hidden_size * 8 / 3 + 7) // 8 * 8,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    # Initialisation draws from the global RNG; fork it so building a model does not shift the
    # caller's random stream (resume must replay identical numbers).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
) -> nn.Module:
    """Load an HF causal LM from a local directory (never from a hub: no network at run time).
    A vision-language model (its config has a ``vision_config``: Qwen2.5-VL, SmolVLM, ...) loads
    with its image encoder (``AutoModelForImageTextToText``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model path '{path}' does not exist or is not a directory")
    if gguf_file is None and not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model path '{path}' has no config.json: it is not a Hugging Face model directory "
            "(for a GGUF file, convert it first with `groupflow convert-gguf`)"
        )
    if gguf_file is not None and not (path / gguf_file).is_file():
        raise ModelLoadError(f"GGUF file '{gguf_file}' not found in '{path}'")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    auto = AutoModelForImageTextToText if _has_vision_config(path) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(str(path), dtype=resolve_dtype(dtype), **kwargs)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ModelLoadError(
                f"model at '{path}' needs custom code; set model.trust_remote_code=true if you trust it"
            ) from e
        raise
    return model


def _has_vision_config(path: Path) -> bool:
    cfg = path / "config.json"
    return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())


def read_model_type(path: str | Path) -> str | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("model_type")


def cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument: transformers >= 5.x calls it ``cache``, older ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at the first real token, pads clamped to 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def decoder_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Last hidden states [B, L, H] of the decoder stack, without the LM head."""
    decoder = hf_model(model).get_decoder()
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=token_positions(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _accepts_cache(module: nn.Module) -> bool:
    params = inspect.signature(module.forward).parameters
    return "cache" in params or "past_key_values" in params


def output_cache(out):
    """The cache an HF forward returned (``cache`` in transformers 5.x, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def full_attention_only(model: nn.Module, length: int) -> bool:
    """True when every layer attends to the whole prefix: sliding-window and linear/recurrent layers
    keep a truncated or summarised cache, for which we do not claim exactness."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    types = getattr(config, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or not getattr(config, "use_sliding_window", True) or length < window


def _unique_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Distinct (ids, mask) prompt rows [U, P] and each row's index into them [B]."""
    p = prompt_ids.shape[1]
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    return unique[:, :p], unique[:, p:].to(prompt_mask.dtype), inverse


def _to_rows(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, inverse)`` (``inverse`` uses every row of ``x``): each row gets its
    prompt's entry. When every prompt's rows are one run of equal length (GRPO's groups, as the
    update orders them) it is an expand of the runs' prompts instead: its backward is a sum,
    where index_select's is a serial scatter on CPU (5-10 % of a small model's update)."""
    u, b = x.shape[0], inverse.shape[0]
    if b % u == 0:
        g = b // u
        runs = inverse.view(u, g)
        if bool((runs == runs[:, :1]).all()):  # u runs of g: each prompt once (u distinct)
            x = x.index_select(0, runs[:, 0])  # the runs' order: a permutation of the prompts
            return x.unsqueeze(1).expand(u, g, *x.shape[1:]).flatten(0, 1)
    return x.index_select(0, inverse)


def _cache_to_rows(cache, inverse: torch.Tensor) -> None:
    """Each row's K/V from its prompt's (differentiable: backward sums the rows' gradients into
    their prompt). transformers < 4.56 caches have no ``layers``: their own index_select."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(la, "keys") and hasattr(la, "values") for la in layers):
        cache.reorder_cache(inverse)
        return
    for layer in layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = (
                _to_rows(layer.keys, inverse),
                _to_rows(layer.values, inverse),
            )


def _can_share_prompt(model: nn.Module, decoder: nn.Module, length: int) -> bool:
    # HF drops the cache when a checkpointed layer will be replayed in backward (it would be
    # appended to twice), so there would be no K/V to share.
    # (transformers 5.24 renamed is_gradient_checkpointing; the old name warns there.)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    replayed = checkpointing and model.training and torch.is_grad_enabled()
    return not replayed and _accepts_cache(decoder) and full_attention_only(model, length)


def prompt_sharing_applies(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor
) -> bool:
    """Whether ``response_hidden_states`` would encode these rows' prompts once each: some prompt
    repeats and the model's cache can be shared at this length."""
    length = prompt_ids.shape[1] + responses.shape[1]
    if responses.shape[1] == 0 or not _can_share_prompt(
        model, hf_model(model).get_decoder(), length
    ):
        return False
    return _unique_prompts(prompt_ids, prompt_mask)[0].shape[0] < prompt_ids.shape[0]


def _shared_prompt_hidden(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    force: bool = False,
) -> torch.Tensor | None:
    """Hidden states [B, T, H] predicting each response token, with every distinct prompt encoded
    once and its K/V shared by the rows that repeat it; None when that is not possible or useful."""
    decoder = hf_model(model).get_decoder()
    p, t = prompt_ids.shape[1], responses.shape[1]
    if t == 0 or not _can_share_prompt(model, decoder, p + t):
        return None
    u_ids, u_mask, inverse = _unique_prompts(prompt_ids, prompt_mask)
    if u_ids.shape[0] == prompt_ids.shape[0] and not force:
        return None  # no prompt repeats: one pass is cheaper
    out = decoder(
        input_ids=u_ids, attention_mask=u_mask, position_ids=token_positions(u_mask), use_cache=True
    )
    cache = output_cache(out)
    if cache is None:
        return None
    prompt_hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    # Left padding: column p-1 is every prompt's last token, whose state predicts response token 0.
    first = _to_rows(prompt_hidden[:, -1], inverse).unsqueeze(1)
    if t == 1:
        return first
    _cache_to_rows(cache, inverse)
    # The last response token predicts nothing, so the response pass stops one short of it.
    span = response_span(response_mask)[:, : t - 1].to(prompt_mask.dtype)
    attention = torch.cat([prompt_mask, span], dim=1)
    out = decoder(
        input_ids=responses[:, : t - 1],
        attention_mask=attention,
        position_ids=token_positions(attention)[:, p:],
        use_cache=True,
        **{cache_kwarg(decoder): cache},
    )
    rest = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return torch.cat([first, rest], dim=1)


def check_no_lost_images(model: nn.Module, prompt_ids: torch.Tensor) -> None:
    """Image placeholder tokens without images mean the ``vision`` inputs were dropped on the way
    (a text-only forward would silently train on placeholder embeddings): an error."""
    token = getattr(getattr(model, "config", None), "image_token_id", None)
    if token is not None and bool((prompt_ids == token).any()):
        raise ValueError(
            "prompts hold image placeholder tokens but no images reached the forward: pass each "
            "row's models.vision.VisionInputs (Batch key 'vision') along with its ids"
        )


def _image_prompt_hidden(model, prompt_ids, prompt_mask, responses, response_mask, vision):
    """``response_hidden_states`` for rows that show images: the prompts through the multimodal
    base (images embedded at their placeholders, positions from ``vision_positions``), then the
    responses through the language model on that cache — as generation runs them, so a response
    that happens to contain a placeholder token id is text, never matched against image features.
    """
    tensors = collate_vision(vision, prompt_ids.device)
    positions, next_pos = vision_positions(model, prompt_ids, prompt_mask, tensors)
    base = multimodal_base(model)
    out = base(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
               use_cache=True, **tensors)  # fmt: skip
    prompt_hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    first = prompt_hidden[:, -1:]  # left padding: every prompt's last token predicts token 0
    t = responses.shape[1]
    cache = output_cache(out)
    if t == 1:
        return first
    if cache is None:
        raise RuntimeError(
            f"{type(model).__name__}: the multimodal prompt pass returned no cache (gradient "
            "checkpointing drops it in training); set model.gradient_checkpointing=false for VLMs"
        )
    decoder = model.get_decoder()
    span = response_span(response_mask)[:, : t - 1].to(prompt_mask.dtype)
    steps = torch.arange(t - 1, device=prompt_ids.device)
    out = decoder(
        input_ids=responses[:, : t - 1],
        attention_mask=torch.cat([prompt_mask, span], dim=1),
        position_ids=next_pos[:, None] + steps[None, :],
        use_cache=True,
        **{cache_kwarg(decoder): cache},
    )
    rest = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return torch.cat([first, rest], dim=1)


def observation_images(model: nn.Module, responses: torch.Tensor,
                       response_mask: torch.Tensor) -> bool:  # fmt: skip
    """Whether some response shows images: placeholder tokens in a gap (an observation, mask 0)."""
    ids = placeholder_ids(model.config)
    if not ids:
        return False
    hits = torch.isin(responses, torch.tensor(ids, device=responses.device))
    return bool((hits & (response_mask == 0) & response_span(response_mask).bool()).any())


def _image_sequence_hidden(model, prompt_ids, prompt_mask, responses, response_mask, vision):
    """``response_hidden_states`` for rows whose observations show images (multi-turn): the whole
    [prompt | response] through the multimodal base in one pass, every placeholder — the
    prompt's and the observations' — embedding its image, positions from ``vision_positions``
    over the whole row (as each later turn's prefill computed them for its context). A model
    turn never holds a placeholder (``workflows.episodes`` cuts the turn before one), so all
    placeholders stand for images; one in an action is an error rather than a wrong number."""
    ids = torch.tensor(placeholder_ids(model.config), device=responses.device)
    if bool((torch.isin(responses, ids) & (response_mask == 1)).any()):
        raise ValueError(
            "a response action is an image placeholder token in a row whose observations show "
            "images: multi-turn episodes end a turn before such a token (workflows.episodes)"
        )
    tensors = collate_vision(vision, prompt_ids.device)
    span = response_span(response_mask).to(prompt_mask.dtype)
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, span], dim=1)
    positions, _ = vision_positions(model, input_ids, attention, tensors)
    out = multimodal_base(model)(input_ids=input_ids, attention_mask=attention,
                                 position_ids=positions, use_cache=False, **tensors)  # fmt: skip
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    p, t = prompt_ids.shape[1], responses.shape[1]
    return hidden[:, p - 1 : p + t - 1]


def response_hidden_states(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    share_prompt: bool | str = True,
    vision=None,
    whole_sequence: bool | None = None,
) -> torch.Tensor:
    """Decoder states [B, T, H]: row b's state at t is the one that predicts ``responses[b, t]``.

    ``response_mask`` marks actions; the attention covers every response column up to the row's
    last action, so tokens in a gap (tool/observation tokens, mask 0) are attended and positioned
    like any other token (``groupflow.algorithms.masks``).

    ``share_prompt``: True shares when ``prompt_sharing_applies``; ``"always"`` shares whenever
    the model allows it, even without repeats — for FSDP ranks, which must all make the same
    number of decoder calls and so decide together (``prompt_sharing_applies`` on every rank).

    With ``share_prompt`` and repeated prompts (GRPO's G samples per prompt, in any row order),
    each distinct prompt is encoded once and its K/V expanded to its rows — the same numbers as
    one pass over [prompt | response], with (G-1)/G of the prompt compute saved in forward and
    backward. Otherwise (no repeats, gradient checkpointing in training, no cache argument,
    sliding-window or recurrent layers) it is that one pass.

    ``vision``: one ``models.vision.VisionInputs`` (or None) per row; with images, the prompts go
    through the multimodal base and the responses through the language model on its cache, one
    prompt pass per row (no sharing: reason in ``models/vision.py``). Rows whose observations show
    images (multi-turn) take one pass over prompt and response instead (``_image_sequence_hidden``);
    ``whole_sequence`` forces that choice (None: ``observation_images`` of these rows decides) —
    FSDP ranks pass the same value, so that they make the same calls.
    """
    if share_prompt not in (True, False, "always"):
        raise ValueError(f"share_prompt must be True, False or 'always', got {share_prompt!r}")
    if vision is not None and any(v is not None and v.tensors for v in vision):
        if whole_sequence is None:
            whole_sequence = observation_images(model, responses, response_mask)
        if whole_sequence:
            return _image_sequence_hidden(
                model, prompt_ids, prompt_mask, responses, response_mask, vision
            )
        return _image_prompt_hidden(
            model, prompt_ids, prompt_mask, responses, response_mask, vision
        )
    check_no_lost_images(model, prompt_ids)
    if share_prompt:
        hidden = _shared_prompt_hidden(
            model, prompt_ids, prompt_mask, responses, response_mask,
            force=share_prompt == "always",
        )  # fmt: skip
        if hidden is not None:
            return hidden
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention = torch.cat([prompt_mask, response_span(response_mask).to(prompt_mask.dtype)], dim=1)
    p, t = prompt_ids.shape[1], responses.shape[1]
    return decoder_hidden_states(model, input_ids, attention)[:, p - 1 : p + t - 1]
