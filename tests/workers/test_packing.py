"""Packed micro-batches by real-token budget and the token-balanced split across ranks, on
hand-computed cases; an over-budget sample is an error naming it and the key."""

from __future__ import annotations

import pytest

from groupflow.workers.packing import OverBudgetError, balanced_rank_order, packed_micro_batches


def test_first_fit_decreasing_under_a_token_budget():
    # lengths 5 3 8 2 6 4, budget 10: decreasing 8(2) 6(4) 5(0) 4(5) 3(1) 2(3)
    # 8 → bin A [8]; 6 → B [6]; 5 → C [5]; 4 → B (6+4=10); 3 → C (5+3); 2 → A (8+2)
    groups = packed_micro_batches([5, 3, 8, 2, 6, 4], 10)
    assert groups == [[0, 1], [2, 3], [4, 5]]


def test_a_sample_limit_as_well_as_a_token_budget():
    # budget 100 would take all; at most 2 samples each: 4(0) 3(1) 2(2) 1(3) decreasing → [0,1],[2,3]
    assert packed_micro_batches([4, 3, 2, 1], 100, 2) == [[0, 1], [2, 3]]


def test_without_a_budget_groups_are_consecutive():
    assert packed_micro_batches([5, 3, 8], None) == [[0, 1, 2]]
    assert packed_micro_batches([5, 3, 8, 1, 1], None, 2) == [[0, 1], [2, 3], [4]]
    assert packed_micro_batches([], 10) == []


def test_a_sample_over_the_budget_is_named_with_the_key():
    with pytest.raises(
        OverBudgetError, match=r"sample 'u7' has 12 tokens.*critic\.micro_batch_tokens=10"
    ):
        packed_micro_batches([3, 12], 10, key="critic.micro_batch_tokens", names=["u1", "u7"])
    with pytest.raises(OverBudgetError, match=r"sample 1 has 12 tokens.*actor\.micro_batch_tokens"):
        packed_micro_batches([3, 12], 10)


def test_balanced_rank_order_evens_the_token_sums_of_the_contiguous_parts():
    # 2 parts of 3: decreasing 9(0) 7(3) 5(1) 4(4) 2(2) 1(5):
    # 9→A; 7→B; 5→B(12); 4→A(13); 2→B(14, full); 1→A(14)  → A {0,4,5}, B {1,2,3}
    order = balanced_rank_order([9, 5, 2, 7, 4, 1], 2)
    assert order == [0, 4, 5, 1, 2, 3]
    lengths = [9, 5, 2, 7, 4, 1]
    assert sum(lengths[i] for i in order[:3]) == sum(lengths[i] for i in order[3:]) == 14


def test_balanced_rank_order_respects_the_dispatchers_part_sizes():
    # 5 samples on 2 ranks: parts of 3 and 2 (the dispatcher pads the second).
    # decreasing 10(0) 8(1) 3(2) 2(3) 1(4): 10→A; 8→B; 3→B (8 < 10; B now full); 2→A; 1→A
    assert balanced_rank_order([10, 8, 3, 2, 1], 2) == [0, 3, 4, 1, 2]  # sums 13 and 11
    assert balanced_rank_order([4, 3], 1) == [0, 1]
    with pytest.raises(ValueError, match="parts"):
        balanced_rank_order([1], 0)
