"""The static cache and the call ledger of both cached families (M3.10 0x09, 0x08).

* Capacity: a write past the reserved slots is refused with ``cache.capacity_exceeded`` before
  any slot or integer changes; ``0 <= committed <= reserved`` are explicit integers.
* Validity: :meth:`StaticCache.key_validity` is exactly ``slot < committed + T``.
* Reuse: a buffer filled by a long request and reused by a shorter one gives the fresh cache's
  logits (stale rows never readable), through the runner's reset.
* The call ledger: slot mismatch, a dirty handle refused until recovery, per-layer lane writes
  under the call's generation, ALL_NEW publication, recovery crops back to the committed length.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import LOGIT_TOL, drive, request  # tests/ is on sys.path

from decodespec.impl.cache import DynamicCache, LaneWrite, StaticCache, make_cache
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.errors import Rejection, ResourceLimit


def _rows(model, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    abi = model.cache_abi
    shape = (1, abi.num_key_value_heads, n, abi.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_static_capacity_is_refused_before_any_slot_is_touched(tiny_model):
    """cache.capacity_exceeded (M3.10 0x09: overflow fails before overwrite)."""
    cache = StaticCache(tiny_model.cache_abi, capacity=4)
    keys, values = _rows(tiny_model, 3)
    cache.begin_call(0, 3, generation=0)
    for layer in range(tiny_model.config.num_hidden_layers):
        cache.update(keys, values, layer, torch.arange(3))
    cache.commit_call(1)
    before = [k.clone() for k in cache.key_cache]
    with pytest.raises(ResourceLimit) as info:
        cache.begin_call(3, 2, generation=1)
    assert info.value.code == "cache.capacity_exceeded" and info.value.details["reserved"] == 4
    with pytest.raises(ResourceLimit):
        cache.update(*_rows(tiny_model, 2, seed=1), 0, torch.arange(3, 5))  # unmanaged write: refused too
    assert cache.committed_length == 3 and cache.layer_lengths() == (3,) * 4 and cache.reserved_length == 4
    assert all(torch.equal(a, b) for a, b in zip(before, cache.key_cache))


def test_key_validity_is_committed_plus_current_rows(tiny_model):
    cache = StaticCache(tiny_model.cache_abi, capacity=6)
    assert cache.key_validity(2).tolist() == [[True, True, False, False, False, False]]
    cache.load_committed([_rows(tiny_model, 3)] * 4, generation=7)
    assert cache.committed_length == 3 and cache.generation == 7
    assert cache.key_validity(1).tolist() == [[True, True, True, True, False, False]]


@pytest.mark.parametrize("family", ["dynamic", "static"])
def test_call_ledger_checks_slots_rosters_and_recovery(tiny_model, family):
    """M3.10 0x08: every layer's lane records [P, P + Delta) under the call's generation; ALL_OLD leaves the handle dirty."""
    cache = make_cache(family, tiny_model.cache_abi, capacity=8)
    layers = tiny_model.config.num_hidden_layers
    with pytest.raises(Rejection) as info:
        cache.begin_call(1, 2, generation=0)
    assert info.value.code == "cache.slot_mismatch"
    cache.begin_call(0, 2, generation=0, drop_layers=[2])
    keys, values = _rows(tiny_model, 2)
    for layer in range(layers):
        cache.update(keys, values, layer, torch.arange(2))
    writes = cache.lane_writes()
    assert writes[2] is None and all(w == LaneWrite(0, 2, 0) for i, w in enumerate(writes) if i != 2)
    assert cache.complete_layers() == layers - 1
    with pytest.raises(AssertionError):
        cache.commit_call(1)  # an incomplete roster is never published
    cache.abandon_call()
    assert cache.dirty and cache.committed_length == 0
    with pytest.raises(Rejection) as info:
        cache.begin_call(0, 2, generation=0)
    assert info.value.code == "cache.invalid_operation"  # quarantined until recovery
    cache.recover(generation=1)
    assert not cache.dirty and cache.layer_lengths() == (0,) * layers and cache.generation == 1
    cache.begin_call(0, 2, generation=1)
    for layer in range(layers):
        cache.update(keys, values, layer, torch.arange(2))
    cache.commit_call(2)
    assert cache.committed_length == 2 and cache.generation == 2
    stored = cache.committed_tensors()
    assert torch.equal(stored[0][0], keys) and torch.equal(stored[3][1], values)


def test_cache_position_that_does_not_continue_the_layer_is_refused(tiny_model):
    """cache.slot_mismatch: a reset cache_position after prefill (M3.10 0x0B failure lab)."""
    for cache in (DynamicCache(tiny_model.cache_abi), StaticCache(tiny_model.cache_abi, 8)):
        cache.update(*_rows(tiny_model, 3), 0, torch.arange(3))
        with pytest.raises(Rejection) as info:
            cache.update(*_rows(tiny_model, 1), 0, torch.tensor([0]))
        assert info.value.code == "cache.slot_mismatch" and cache.get_seq_length(0) == 3


def test_static_cache_reused_by_a_shorter_request_equals_a_fresh_cache(tiny_model, byte_tokenizer):
    """M3.10 0x09: a reused buffer cannot expose a previous request's rows (validity comes from integers)."""
    long_prompt = [1, *byte_tokenizer.encode("a long request fills many static slots with its rows")]
    short_prompt = [1, *byte_tokenizer.encode("short")]
    capacity = len(long_prompt) + 12
    shared = StaticCache(tiny_model.cache_abi, capacity)
    drive(RequestRunner(tiny_model, request(long_prompt, 10, cache="static", static_capacity=capacity), cache=shared))
    assert shared.committed_length == len(long_prompt) + 9
    beyond = len(short_prompt) + 8  # a slot the short request never writes
    stale = shared.key_cache[0][0, :, beyond].clone()
    assert not torch.equal(stale, torch.zeros_like(stale))
    reused_rows, reused = drive(RequestRunner(tiny_model, request(short_prompt, 6, cache="static", static_capacity=capacity), cache=shared))
    fresh_rows, fresh = drive(RequestRunner(tiny_model, request(short_prompt, 6, cache="static", static_capacity=capacity)))
    assert reused.output_ids == fresh.output_ids
    for a, b in zip(reused_rows, fresh_rows):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGIT_TOL["tiny"])
    # the reused buffer still holds the long request's row beyond the short frontier: masked, not cleared
    assert shared.committed_length == len(short_prompt) + 5
    assert torch.equal(shared.key_cache[0][0, :, beyond], stale)


def test_make_cache_refuses_unknown_families(tiny_model):
    assert make_cache("none", tiny_model.cache_abi) is None
    for family, capacity in (("paged", 4), ("static", None)):
        with pytest.raises(Rejection) as info:
            make_cache(family, tiny_model.cache_abi, capacity=capacity)
        assert info.value.code == "cache.invalid_operation"
    with pytest.raises(Rejection):
        StaticCache(tiny_model.cache_abi, capacity=0)
