"""Positions, visibility and static capacity as pure functions (M3.10 0x07, 0x09, 0x0A)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.errors import Rejection, ResourceLimit
from decodespec.spec.positions import (
    PAD_POSITION_FILL,
    StaticCacheLedger,
    cached_causal_mask,
    call_positions,
    decision_column,
    intersect_key_validity,
    prefix_lm_chunk_mask,
    translation_receipt,
)


def test_left_padded_receipt_seed_table() -> None:
    """M3.10 0x0A: [PAD, PAD, A, B, C] -> positions [-, -, 0, 1, 2]; compact slots [-, -, 0, 1, 2]."""
    r = translation_receipt([0, 0, 1, 1, 1])
    assert [e.position_id for e in r.entries] == [None, None, 0, 1, 2]
    assert [e.cache_slot for e in r.entries] == [None, None, 0, 1, 2]
    assert [e.row_idx for e in r.entries] == [None, None, 0, 1, 2]
    assert r.position_ids() == (PAD_POSITION_FILL, PAD_POSITION_FILL, 0, 1, 2) == (0, 0, 0, 1, 2)
    assert r.cache_positions() == (0, 1, 2)
    assert (r.decision_column, r.num_valid) == (4, 3)


def test_rectangular_layout_keeps_padding_slots_invalid() -> None:
    """A static API storing rectangular columns: slots 0..4, only 2..4 valid (M3.10 0x0A)."""
    r = translation_receipt([0, 0, 1, 1, 1], cache_layout="rectangular")
    assert r.cache_positions() == (0, 1, 2, 3, 4)
    assert r.slot_validity() == (False, False, True, True, True)
    assert r.position_ids() == (0, 0, 0, 1, 2)


def test_right_padding_and_cache_position_start() -> None:
    r = translation_receipt([1, 1, 0, 0], cache_position_start=5)
    assert r.position_ids() == (0, 1, 0, 0)
    assert r.cache_positions() == (5, 6)
    assert r.decision_column == 1


@pytest.mark.parametrize(
    "mask, column", [([1, 1, 1, 1], 3), ([1, 1, 0, 0], 1), ([0, 0, 1, 1, 1], 4), ([0, 1], 1), ([1], 0)]
)
def test_decision_column_is_the_greatest_valid_column(mask: list[int], column: int) -> None:
    """M3.10 0x07: right padding [A,B,PAD,PAD] -> 1; left padding [0,0,1,1,1] -> 4, not sum-1 = 2."""
    assert decision_column(mask) == column


def test_empty_row_and_bad_masks_are_typed_errors() -> None:
    with pytest.raises(Rejection) as info:
        decision_column([0, 0, 0])
    assert info.value.code == "runtime.empty_input_row"
    with pytest.raises(Rejection) as info:
        translation_receipt([1, 2, 1])
    assert (info.value.code, info.value.path) == ("runtime.invalid_mask", "$.attention_mask[1]")
    with pytest.raises(Rejection) as info:
        translation_receipt([1, 0, 1])
    assert (info.value.code, info.value.path) == ("runtime.invalid_mask", "$.attention_mask[1]")
    with pytest.raises(Rejection):
        translation_receipt([1, 1], cache_layout="paged")


@given(st.integers(0, 5), st.integers(1, 6), st.integers(0, 5))
def test_receipt_is_consistent_for_every_padding(left: int, valid: int, right: int) -> None:
    mask = [0] * left + [1] * valid + [0] * right
    r = translation_receipt(mask)
    assert r.num_valid == valid and r.decision_column == left + valid - 1
    assert [e.position_id for e in r.entries if e.valid] == list(range(valid))
    assert r.cache_positions() == tuple(range(valid))
    rect = translation_receipt(mask, cache_layout="rectangular")
    assert rect.cache_positions() == tuple(range(len(mask)))


def test_cached_causal_mask_seed_example() -> None:
    """M3.10 0x0A p=3, c=2: row 3 sees keys 0..3, row 4 sees 0..4; shape [c, p+c]."""
    assert cached_causal_mask(3, 2) == (
        (True, True, True, True, False),
        (True, True, True, True, True),
    )


@given(st.integers(0, 6), st.integers(1, 6))
def test_cached_causal_mask_blocks(p: int, c: int) -> None:
    m = cached_causal_mask(p, c)
    assert len(m) == c and all(len(row) == p + c for row in m)
    assert all(all(row[:p]) for row in m)  # zero (visible) history block
    for i in range(c):
        assert m[i][p:] == tuple(j <= i for j in range(c))  # lower-triangular current block
    # a chunked prefill and a one-shot prefill agree on every row's visibility
    one_shot = cached_causal_mask(0, p + c)
    assert m == tuple(row for row in one_shot[p:])


def test_prefix_lm_mask_is_bidirectional_inside_the_prefix() -> None:
    m = prefix_lm_chunk_mask(0, 4, 2)
    assert m == (
        (True, True, False, False),
        (True, True, False, False),
        (True, True, True, False),
        (True, True, True, True),
    )
    assert prefix_lm_chunk_mask(4, 1, 2) == ((True,) * 5,)


@pytest.mark.parametrize("start, length", [(0, 1), (1, 2)])
def test_prefix_lm_chunk_may_not_split_the_prefix(start: int, length: int) -> None:
    with pytest.raises(Rejection) as info:
        prefix_lm_chunk_mask(start, length, 2)
    assert info.value.code == "runtime.prefix_split"


def test_key_validity_intersects_never_replaces() -> None:
    m = intersect_key_validity(cached_causal_mask(2, 1), [False, True, True])
    assert m == ((False, True, True),)
    with pytest.raises(ValueError):
        intersect_key_validity(cached_causal_mask(2, 1), [True])


def test_call_positions_continue_after_prefill() -> None:
    assert call_positions(3, 1) == (3,)
    assert call_positions(0, 3) == (0, 1, 2)


def test_static_ledger_capacity_and_slot_checks() -> None:
    """M3.10 0x09: 0 <= committed <= reserved <= max; overflow refused before any slot is touched."""
    ledger = StaticCacheLedger(committed=3, reserved=4, maximum=8)
    assert ledger.check_write(3, 1) == (3,)
    assert ledger.write(3, 1) == StaticCacheLedger(4, 4, 8)
    assert ledger.readable_slots(3, 1) == (True, True, True, True)
    assert StaticCacheLedger(2, 4, 8).readable_slots(2, 1) == (True, True, True, False)
    with pytest.raises(ResourceLimit) as info:
        ledger.write(3, 2)
    assert info.value.code == "cache.capacity_exceeded" and info.value.details["reserved"] == 4
    assert ledger == StaticCacheLedger(3, 4, 8)  # unchanged
    with pytest.raises(Rejection) as info:
        ledger.check_write(0, 1)  # cache_position reset after prefill
    assert info.value.code == "cache.slot_mismatch"
    with pytest.raises(Rejection) as info:
        ledger.check_write(3, 0)
    assert info.value.code == "cache.slot_mismatch"
    with pytest.raises(Rejection) as info:
        StaticCacheLedger(5, 4, 8)
    assert info.value.code == "cache.ledger_invalid"
