"""``algorithm.preset``: one key that sets the keys an algorithm spreads over config sections.

Design decision: a preset is plain data -- dotted keys and values, with the paper or reference
implementation they come from -- merged UNDER the user's own keys before validation, so every
way into a config (file, ``key=value`` overrides, the Python API) resolves it the same way, a key
given explicitly always wins, and the validated config (and the saved ``config.yaml``) holds the
resolved values. Nothing downstream knows presets exist. Typed PPO options and
``actor.loss_options`` of a preset that the finally chosen ``actor.loss_fn`` does not take are
left out (``preset: grpo`` with ``actor.loss_fn: sapo`` keeps the GRPO estimator and aggregation,
not PPO's clip range), so that the strict loss-option check at load stays meaningful.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from groupflow.config.loss_keys import LOSS_TYPED_OPTIONS
from groupflow.config.registries import is_policy_loss, option_names, policy_loss

__all__ = [
    "PRESETS",
    "Preset",
    "expand_preset",
    "preset_note",
    "preset_report",
    "shadowed_by_file",
]


@dataclass(frozen=True)
class Preset:
    keys: dict[str, Any]  # dotted key -> value
    reference: str  # where the values come from
    note: str = ""  # what the preset does not set, and why


_PPO_CLIP = {"actor.loss_fn": "ppo_clip", "actor.ratio_level": "token"}

PRESETS: dict[str, Preset] = {
    "grpo": Preset(
        {
            "algorithm.estimator": "grpo",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "seq_mean_token_mean",
            "actor.kl_coef": 0.04,
            "actor.kl_kind": "k3",
        },
        "DeepSeekMath, arXiv 2402.03300, eq. 3 (eps 0.2, beta 0.04, k3 KL in the loss, "
        "1/|o_i| per-sequence mean); TRL loss_type='grpo'",
        "the KL term loads a reference model; actor.kl_coef: 0 drops it (TRL's default beta)",
    ),
    "dapo": Preset(
        {
            "algorithm.estimator": "grpo",
            "algorithm.dynamic_sampling": True,
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.28,
            "actor.loss_agg": "token_mean",
            "actor.kl_coef": 0.0,
        },
        "DAPO, arXiv 2503.14476 (clip-higher 0.2/0.28, dynamic sampling, token-level loss, no "
        "KL); verl recipe/dapo, TRL loss_type='dapo'",
        "overlong reward shaping is a reward: add {name: overlong_penalty} to reward.functions",
    ),
    "dr_grpo": Preset(
        {
            "algorithm.estimator": "dr_grpo",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "seq_mean_token_sum_norm",
            "actor.kl_coef": 0.0,
        },
        "Dr. GRPO, arXiv 2503.20783 (no std scaling, token sum over a constant length, no KL); "
        "TRL loss_type='dr_grpo', verl norm_adv_by_std_in_grpo=False",
    ),
    "gspo": Preset(
        {
            "algorithm.estimator": "grpo",
            "actor.loss_fn": "ppo_clip",
            "actor.ratio_level": "sequence",
            "actor.clip_eps_low": 3e-4,
            "actor.clip_eps_high": 4e-4,
            "actor.loss_agg": "seq_mean_token_mean",
            "actor.kl_coef": 0.0,
        },
        "GSPO, arXiv 2507.18071 (sequence-level ratio, clip range 3e-4 / 4e-4, sequence mean); "
        "TRL importance_sampling_level='sequence' with loss_type='grpo'",
    ),
    "bnpo": Preset(
        {
            "algorithm.estimator": "grpo",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "local_token_mean",
            "actor.kl_coef": 0.0,
        },
        "TRL loss_type='bnpo' (token mean within each micro-batch, divided by the accumulation "
        "steps)",
    ),
    "cispo": Preset(
        {
            "algorithm.estimator": "grpo",
            "actor.loss_fn": "cispo",
            "actor.ratio_level": "token",
            "actor.loss_options": {"clip_ratio_max": 5.0},
            "actor.loss_agg": "token_mean",
            "actor.kl_coef": 0.0,
        },
        "MiniMax-M1, arXiv 2506.13585; cap eps_max 5.0 from ScaleRL, arXiv 2510.13786; TRL "
        "loss_type='cispo' with epsilon_high=5.0",
    ),
    "rloo": Preset(
        {
            "algorithm.estimator": "rloo",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "token_mean",
            "actor.kl_coef": 0.0,
        },
        "RLOO, arXiv 2402.14740 (leave-one-out baseline); verl adv_estimator=rloo. With one "
        "optimizer step per batch the ratio is 1 and the clipped loss is plain REINFORCE",
        "the paper's KL penalty in the reward is not set: add algorithm.kl_in_reward",
    ),
    "reinforce_pp": Preset(
        {
            "algorithm.estimator": "reinforce_pp_baseline",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "token_mean",
            "actor.kl_coef": 0.0,
        },
        "REINFORCE++-baseline, arXiv 2501.03262 (group mean subtracted, then batch "
        "whitening); verl adv_estimator=reinforce_plus_plus_baseline",
        "the paper's KL penalty in the reward is not set: add algorithm.kl_in_reward",
    ),
    "opd": Preset(
        {
            "teacher.coef": 1.0,
            "teacher.reward_weight": 0.0,
            "algorithm.estimator": "grpo",
            **_PPO_CLIP,
            "actor.clip_eps_low": 0.2,
            "actor.clip_eps_high": 0.2,
            "actor.loss_agg": "token_mean",
            "actor.kl_coef": 0.0,
        },
        "on-policy distillation: per-token reverse KL to the teacher as the advantage, no "
        "discount (Thinking Machines' tinker-cookbook on-policy distillation; verl "
        "docs/algo/opd.md; Agarwal et al., GKD, arXiv 2306.13649)",
        "teacher.path is yours to give; teacher.reward_weight > 0 mixes in the rewards",
    ),
}


def _get(data: dict, dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set_default(data: dict, dotted: str, value: Any) -> None:
    """Set ``dotted`` unless the user gave it; merge dict values key by key (user keys win)."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            return  # the user's value is not a section: validation reports it
        node = child
    last = parts[-1]
    if last not in node:
        node[last] = copy.deepcopy(value)
    elif isinstance(node[last], dict) and isinstance(value, dict):
        node[last] = {**copy.deepcopy(value), **node[last]}


def _accepted_options(loss_fn: Any) -> tuple[str, ...] | None:
    if not isinstance(loss_fn, str) or not is_policy_loss(loss_fn):
        return None  # an unknown loss is reported by actor.loss_fn's own validator
    return option_names(policy_loss(loss_fn))


def expand_preset(data: Any) -> Any:
    """The raw config mapping with ``algorithm.preset``'s keys merged under the user's keys.

    Returns ``data`` itself when there is no preset (or a name that is not one: the field's
    validator reports it, naming the closest)."""
    if not isinstance(data, dict):
        return data
    found, name = _get(data, "algorithm.preset")
    if not found or not isinstance(name, str) or name not in PRESETS:
        return data
    out = copy.deepcopy(data)
    preset = PRESETS[name]
    given, loss_fn = _get(out, "actor.loss_fn")
    loss_fn = loss_fn if given else preset.keys.get("actor.loss_fn", "ppo_clip")
    accepted = _accepted_options(loss_fn)
    for dotted, value in preset.keys.items():
        section, _, key = dotted.partition(".")
        if section == "actor" and accepted is not None:
            if key in LOSS_TYPED_OPTIONS and key not in accepted:
                continue
            if key == "loss_options":
                value = {k: v for k, v in value.items() if k in accepted}
        _set_default(out, dotted, value)
    return out


def preset_note(name: str | None) -> str:
    """What the preset leaves to the user (empty when nothing)."""
    return PRESETS[name].note if name in PRESETS else ""


def preset_report(cfg: Any) -> list[str]:
    """``key=value (preset|overridden)`` for each key the run's preset names, from the validated
    config (a key given with the preset's own value reads as preset)."""
    name = cfg.algorithm.preset
    if name is None:
        return []
    plain = cfg.to_dict()
    accepted = _accepted_options(cfg.actor.loss_fn)
    lines = []
    for dotted, value in PRESETS[name].keys.items():
        section, _, key = dotted.partition(".")
        if section == "actor" and key in LOSS_TYPED_OPTIONS and accepted is not None:
            if key not in accepted:
                lines.append(f"{dotted} (not an option of actor.loss_fn={cfg.actor.loss_fn!r})")
                continue
        found, actual = _get(plain, dotted)
        if isinstance(value, dict) and isinstance(actual, dict):
            same = all(actual.get(k) == v for k, v in value.items())
        else:
            same = found and actual == value
        lines.append(f"{dotted}={actual!r} ({'preset' if same else 'overridden'})")
    return lines


def shadowed_by_file(file_data: Any, overrides: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, preset's value, file's value)`` for each key of a preset chosen by ``overrides``
    that the config file sets to another value and no override resets: the file's value wins, as
    any explicit key does, but whoever adds ``algorithm.preset=...`` to a file that happens to set
    ``actor.loss_agg`` (as the examples do) did not ask for that, so the loader warns.

    A preset written in the file itself is taken to be chosen together with the file's keys."""
    if not isinstance(file_data, dict):
        return []
    chosen = overrides.get("algorithm.preset")
    if chosen is None and isinstance(overrides.get("algorithm"), dict):
        chosen = overrides["algorithm"].get("preset")
    in_file, file_preset = _get(file_data, "algorithm.preset")
    if not isinstance(chosen, str) or chosen not in PRESETS or (in_file and file_preset == chosen):
        return []
    merged = copy.deepcopy(file_data)
    for dotted, value in overrides.items():
        _set_path(merged, dotted, value)
    resolved = expand_preset(merged)  # what the preset keeps, given the final actor.loss_fn
    shadowed = []
    for dotted, value in PRESETS[chosen].keys.items():
        found, mine = _get(file_data, dotted)
        if not found or _overridden(overrides, dotted):
            continue
        kept, final = _get(resolved, dotted)
        if kept and final != value and final == mine:
            shadowed.append((dotted, value, mine))
    return shadowed


def _overridden(overrides: dict[str, Any], dotted: str) -> bool:
    if dotted in overrides:
        return True
    return _get({k: v for k, v in overrides.items() if "." not in k}, dotted)[0]


def _set_path(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
