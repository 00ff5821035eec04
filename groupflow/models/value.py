"""Value models (PPO's critic): an LM backbone with a scalar head, as an HF token classifier.

Design decision: a critic is ``AutoModelForTokenClassification`` with ``num_labels=1`` (verl's
choice): any HF causal-LM directory loads as one (backbone weights reused, head freshly
initialised), it has no vocabulary-sized LM head to waste memory on, and a trained critic saves
as a plain HF directory. Three sources: a local HF directory, a copy of the policy's backbone
(the usual PPO initialisation), or a tiny random one for tests. Classifier dropout is 0: the
values of a sample must not change between the forward that records them and the update.

The value of response token t is read at the position that predicts it (the state before the
action), the same alignment as the policy's log-probs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from groupflow.algorithms.masks import response_span
from groupflow.models.causal_lm import ModelLoadError, hf_model, resolve_dtype, token_positions

__all__ = [
    "value_model_from_config",
    "load_value_model",
    "value_model_from_policy",
    "response_values",
]


def _backbone(model: nn.Module) -> nn.Module:
    return getattr(model, hf_model(model).base_model_prefix)


def value_model_from_config(config) -> nn.Module:
    """A randomly initialised value model for ``config`` (an HF causal-LM config)."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(config)
    config.num_labels = 1  # the setter also resets the label maps
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_config(config)


def value_model_from_policy(policy: nn.Module, seed: int) -> nn.Module:
    """Backbone weights copied from the policy; the head initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = value_model_from_config(hf_model(policy).config)
    missing = _backbone(critic).load_state_dict(
        hf_model(policy).get_decoder().state_dict(), strict=True
    )
    del missing
    return critic.to(next(policy.parameters()).dtype)


def load_value_model(path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False):
    """Load a value model from a local HF directory (a causal LM's backbone, or a saved critic)."""
    from transformers import AutoModelForTokenClassification

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"critic.path '{path}' is not a Hugging Face model directory (no config.json there)"
        )
    return AutoModelForTokenClassification.from_pretrained(
        str(path), num_labels=1, classifier_dropout=0.0, dtype=resolve_dtype(dtype),
        trust_remote_code=trust_remote_code, local_files_only=True,
    )  # fmt: skip


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a value model (FSDP2 shards each as a unit)."""
    base = _backbone(model)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the transformer layers of {type(model).__name__} to shard")
    return list(layers)


def response_values(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Values [B, T] (float32) of the states before each response token; garbage where masked."""
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    # gaps in the mask (tool/observation tokens) are attended: see groupflow.algorithms.masks
    attention = torch.cat([prompt_mask, response_span(response_mask).to(prompt_mask.dtype)], dim=1)
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=token_positions(attention),
        use_cache=False,
    )
    p, t = prompt_ids.shape[1], responses.shape[1]
    return out.logits[:, p - 1 : p + t - 1, 0].float()
