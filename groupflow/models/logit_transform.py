"""The transform some causal LMs apply to the LM head's output, for every path that computes logits.

Design decision: training log-probs are computed from decoder hidden states and the LM head in
chunks (``models/logprobs.py``), and the static-cache decode calls the LM head itself, so neither
goes through ``model(...).logits``. A transform that an architecture's ``ForCausalLM.forward``
applies after ``lm_head`` must therefore be applied there as well — otherwise the training
log-probs are not those of the distribution the rollout sampled from (HF forward or vLLM), and
with μ = 1 the first ratio is not 1 (Granite with logits_scaling 8: 0.22 nats; Gemma2 with its
cap 30: 3.5 nats). The transforms are mirrored op for op, in the dtype HF computes them in, so the
numbers are the model's own. From a scan of every ``transformers/models/*/modeling_*.py`` of
transformers 5.24:

* soft-capping ``cap·tanh(z / cap)``, ``cap = final_logit_softcapping`` of the text config:
  Gemma2, Gemma3 (text), Gemma3n, Gemma4, Gemma4-unified, VaultGemma, NanoChat; in float32: Beam;
  ``cap = logits_soft_cap``: RecurrentGemma (Gemma3's multimodal model does not cap);
* ``z / logits_scaling``: Granite, GraniteMoe, GraniteMoeShared, GraniteMoeHybrid (and the _swa
  variants); ``z · logits_scaling``: HyperCLOVAX;
* ``z · logit_scale``: Cohere, Cohere2, Cohere2Moe, CohereCompass; ``z · lm_head_multiplier``:
  FalconH1.

Anything else (a vocabulary slice, a module after the head, custom code) is not reproduced:
``check_logit_transform`` compares the model's own logits with the transformed head output of the
decoder states once, at load, and refuses a model where they differ, naming the architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from groupflow.models.causal_lm import ModelLoadError, decoder_hidden_states

__all__ = ["logit_transform", "lm_logits", "check_logit_transform", "TRANSFORMED_MODEL_TYPES"]

Transform = Callable[[torch.Tensor], torch.Tensor]


def _softcap(cap: Any, float32: bool = False) -> Transform | None:
    if cap is None:
        return None

    def transform(z: torch.Tensor) -> torch.Tensor:
        z = z.float() if float32 else z
        return torch.tanh(z / cap) * cap  # HF: logits / cap; tanh; * cap

    return transform


def _scale(factor: Any, divide: bool = False) -> Transform:
    return (lambda z: z / factor) if divide else (lambda z: z * factor)


def _text_attr(name: str) -> Callable[[Any], Any]:
    return lambda model: getattr(model.config.get_text_config(), name, None)


_SOFTCAP_TYPES = (
    "gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
    "gemma4_unified_text", "vaultgemma", "nanochat",
)  # fmt: skip
_GRANITE_TYPES = (
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared",
)  # fmt: skip
_COHERE_TYPES = ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text")

# each entry reads a transformers model's config or attributes (typed Any: nn.Module has none)
_CATALOG: dict[str, Callable[[Any], Transform | None]] = {
    **{t: (lambda m: _softcap(_text_attr("final_logit_softcapping")(m))) for t in _SOFTCAP_TYPES},
    "beam": lambda m: _softcap(_text_attr("final_logit_softcapping")(m), float32=True),
    "recurrent_gemma": lambda m: _softcap(_text_attr("logits_soft_cap")(m)),
    **{t: (lambda m: _scale(m.config.logits_scaling, divide=True)) for t in _GRANITE_TYPES},
    "hyperclovax": lambda m: _scale(m.config.logits_scaling),
    **{t: (lambda m: _scale(m.logit_scale)) for t in _COHERE_TYPES},
    "falcon_h1": lambda m: _scale(m.model.lm_head_multiplier),
}
TRANSFORMED_MODEL_TYPES = tuple(sorted(_CATALOG))


def logit_transform(model: nn.Module) -> Transform | None:
    """The function ``model``'s forward applies to the LM head's output; None for none (the
    usual case). Unknown architectures get None here and are vetted by ``check_logit_transform``."""
    config = getattr(model, "config", None)
    factory = _CATALOG.get(str(getattr(config, "model_type", None)))
    return factory(model) if factory is not None else None


def lm_logits(
    model: nn.Module,
    hidden: torch.Tensor,
    head: nn.Module | Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The model's logits from final hidden states: its LM head (or ``head``, the same module
    reached through a wrapper such as FSDP, or a kernel computing it: ``rollout/kernels.py``),
    then its final transform."""
    hf: Any = model  # a transformers model: get_output_embeddings
    logits = (head if head is not None else hf.get_output_embeddings())(hidden)
    transform = logit_transform(model)
    return logits if transform is None else transform(logits)


_PROBE_TOKENS = 6


@torch.no_grad()
def check_logit_transform(model: nn.Module) -> None:
    """Refuse a model whose logits are not ``lm_logits`` of its decoder states.

    One forward over a few tokens compares ``model(...).logits`` with the path training uses
    (decoder states, LM head, catalogued transform). They agree to float rounding for every
    supported architecture; a difference means a transform (or a step between decoder and
    head) groupflow does not know, whose training log-probs would silently be wrong.
    """
    hf: Any = model
    head = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ModelLoadError(f"{type(model).__name__} has no output embeddings (LM head)")
    vocab = head.weight.shape[0]
    device = head.weight.device
    ids = (torch.arange(_PROBE_TOKENS, device=device)[None] * 7 + 3) % vocab
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours = lm_logits(model, decoder_hidden_states(model, ids, mask))
    except (AttributeError, TypeError, ValueError) as e:  # not an HF decoder + head layout
        raise ModelLoadError(
            f"cannot compute {type(model).__name__}'s logits from its decoder states: {e}"
        ) from e
    finally:
        model.train(was_training)
    expected, ours = expected.float(), ours.float()
    scale = max(1.0, float(expected.abs().max()))
    tol = (1e-4 if head.weight.dtype == torch.float32 else 2e-2) * scale
    diff = float((expected - ours).abs().max()) if expected.shape == ours.shape else float("inf")
    if not diff <= tol:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ModelLoadError(
            f"{type(model).__name__} (model_type {model_type!r}) transforms its logits in a way "
            f"groupflow does not reproduce (max difference {diff:.3g} between model(...).logits "
            f"and its LM head applied to the decoder's states): its training log-probs would not "
            f"match what it samples. Architectures with a known final-logit transform: "
            f"{', '.join(TRANSFORMED_MODEL_TYPES)}; add this one to "
            f"groupflow/models/logit_transform.py"
        )
