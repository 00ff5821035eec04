import pytest
import torch

from groupflow.batch import Batch
from groupflow.contracts import (
    ContractError,
    FieldSpec,
    check_staleness,
    get_contract,
    validate,
)


def rollout(n=4, t=3):
    return Batch(
        {
            "group_ids": torch.tensor([0, 0, 1, 1])[:n],
            "responses": torch.ones(n, t, dtype=torch.long),
            "response_mask": torch.ones(n, t, dtype=torch.bool),
            "rollout_logprobs": -torch.ones(n, t),
            "version": torch.zeros(n, dtype=torch.long),
        },
        {"uid": [f"u{i}" for i in range(n)], "prompt": ["p", "p", "q", "q"][:n]},
    )


def staged(stage):
    b = rollout()
    if stage in ("rewarded", "advantaged", "train_ready"):
        b["rewards"] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    if stage in ("advantaged", "train_ready"):
        b["advantages"] = torch.tensor([0.7, -0.7, 0.0, 0.0])
    if stage == "train_ready":
        b["old_logprobs"] = -torch.ones(4, 3)
    return b


@pytest.mark.parametrize("stage", ["rollout", "rewarded", "advantaged", "train_ready"])
def test_valid_batches_pass(stage):
    assert validate(staged(stage), stage) is not None


def test_token_level_advantages_accepted():
    b = staged("advantaged")
    b["advantages"] = torch.zeros(4, 3)
    validate(b, "advantaged")


def test_missing_key_names_stage_and_key():
    b = staged("rollout")
    with pytest.raises(ContractError, match=r"\[stage 'rewarded'\] key 'rewards'.*no such key"):
        validate(b, "rewarded")


def test_wrong_dtype():
    b = staged("rewarded")
    b["rewards"] = torch.tensor([1, 0, 1, 0])
    with pytest.raises(
        ContractError, match=r"key 'rewards': expected a floating tensor \[B\], found int64 \[4\]"
    ):
        validate(b, "rewarded")
    b = staged("rollout")
    b["responses"] = torch.ones(4, 3)
    with pytest.raises(ContractError, match="'responses': expected an integer tensor"):
        validate(b, "rollout")


def test_wrong_rank_and_inconsistent_T():
    b = staged("train_ready")
    b["old_logprobs"] = -torch.ones(4, 5)
    with pytest.raises(
        ContractError, match=r"'old_logprobs': expected dim 1 \(T\) = 3 as in 'responses', found 5"
    ):
        validate(b, "train_ready")
    b = staged("rewarded")
    b["rewards"] = torch.ones(4, 2)
    with pytest.raises(
        ContractError, match=r"'rewards': expected float \[B\], found float32 \[4, 2\]"
    ):
        validate(b, "rewarded")


def test_nan_reward_names_samples():
    b = staged("rewarded")
    b["rewards"] = torch.tensor([1.0, float("nan"), 0.5, float("inf")])
    with pytest.raises(
        ContractError, match=r"NaN/inf in 2 sample\(s\); offending samples: 'u1', 'u3'"
    ) as e:
        validate(b, "rewarded")
    assert e.value.sample_ids == ["u1", "u3"] and e.value.stage == "rewarded"


def test_mask_values():
    b = staged("rollout")
    m = torch.ones(4, 3)
    m[2, 1] = 0.5
    b["response_mask"] = m
    with pytest.raises(ContractError, match="only 0/1 values.*'u2'"):
        validate(b, "rollout")


def test_positive_logprobs_rejected():
    b = staged("train_ready")
    b["old_logprobs"][0, 0] = 0.3
    with pytest.raises(ContractError, match=r"'old_logprobs': expected values <= 0.0001.*'u0'"):
        validate(b, "train_ready")


def test_duplicate_uid():
    b = staged("rollout")
    b["uid"] = ["a", "b", "a", "c"]
    with pytest.raises(ContractError, match="'uid': expected unique values, found 1 duplicate"):
        validate(b, "rollout")


def test_group_mixing_prompts():
    b = staged("rollout")
    b["prompt"] = ["p", "q", "q", "q"]
    with pytest.raises(ContractError, match="one prompt per group.*'u1'"):
        validate(b, "rollout")


def test_group_consistency_from_prompt_ids_ignores_padding():
    b = staged("rollout")
    del b["prompt"]
    b["prompt_ids"] = torch.tensor([[0, 5, 6], [5, 6, 0], [7, 7, 7], [7, 7, 7]])
    b["prompt_mask"] = torch.tensor([[0, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    validate(b, "rollout")
    b["prompt_ids"] = torch.tensor([[0, 5, 6], [5, 9, 0], [7, 7, 7], [7, 7, 7]])
    with pytest.raises(ContractError, match="group_ids"):
        validate(b, "rollout")


def test_float_group_ids_rejected():
    b = staged("rollout")
    b["group_ids"] = torch.tensor([0.0, 0.0, 1.0, 1.0])
    with pytest.raises(ContractError, match="'group_ids': expected an integer tensor"):
        validate(b, "rollout")


def test_empty_and_non_batch():
    with pytest.raises(ContractError, match="empty batch"):
        validate(Batch(), "rollout")
    with pytest.raises(ContractError, match="a groupflow Batch"):
        validate({"x": 1}, "rollout")
    with pytest.raises(ValueError, match="unknown stage 'rolout'; valid stages: rollout"):
        validate(staged("rollout"), "rolout")


def test_contract_extension_for_other_policy_types():
    c = (
        get_contract("rollout")
        .without("responses")
        .extend(FieldSpec("latents", "float", (("B", "T", "C"),)))
    )
    b = staged("rollout")
    del b["responses"]
    with pytest.raises(ContractError, match="'latents'"):
        validate(b, c)
    b["latents"] = torch.zeros(4, 3, 2)
    validate(b, c)


def test_object_key_given_as_tensor():
    b = staged("rollout")
    b["uid"] = torch.arange(4)
    with pytest.raises(ContractError, match="'uid': expected per-sample Python values"):
        validate(b, "rollout")


def test_version_is_required():
    b = staged("rollout")
    del b["version"]
    with pytest.raises(
        ContractError, match="key 'version': expected a int entry, found no such key"
    ):
        validate(b, "rollout")


def test_staleness_bound_names_the_stale_and_the_future_samples():
    b = staged("train_ready")
    b["version"] = torch.tensor([3, 4, 2, 4])
    assert check_staleness(b, current=4, max_staleness=2) is b  # 4 - 2 = 2 is still allowed
    with pytest.raises(ContractError, match=r"'version': expected >= 3 .*max staleness 1.*'u2'"):
        check_staleness(b, current=4, max_staleness=1)
    with pytest.raises(ContractError, match=r"'version': expected >= 4 .*'u0', 'u2'"):
        check_staleness(b, current=4, max_staleness=0)
    with pytest.raises(ContractError, match=r"versions from the future in 2 sample.*'u1', 'u3'"):
        check_staleness(b, current=3, max_staleness=1)


def test_in_flight_token_versions_are_bounded_by_the_policy_and_the_oldest_token():
    """rollout.async_mode=in_flight: a sample's version is its oldest token's (the lower bound);
    a token newer than the policy that trains it names its sample."""
    b = staged("train_ready")
    width = b["responses"].shape[1]
    b["version"] = torch.tensor([3, 3, 2, 4])
    b["token_versions"] = b["version"][:, None].repeat(1, width)
    b["token_versions"][0, -1] = 4  # switched to version 4 mid-sample
    assert check_staleness(b, current=4, max_staleness=2) is b
    b["token_versions"][2, -1] = 5
    with pytest.raises(ContractError, match=r"'token_versions': expected <= 4 .*tokens from the "
                       r"future in 1 sample.*'u2'"):  # fmt: skip
        check_staleness(b, current=4, max_staleness=2)
