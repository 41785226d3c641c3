"""Checks of the cache ABI and the cache families (impl/cache.py) that kill Cosmic Ray's survivors.

The screen of a sampled Cosmic Ray session over ``impl/cache.py`` (the caches' own tests and their
users on the tiny model; docs/results/mutation-sampled-cache-beam-batch.md) left some mutants
alive: refusals whose path or bound is never compared, batches past CPython's small-int cache,
branches the runtime never takes.  Each check here drives a cache directly on small tensors (or
the tiny model) and asserts a value derived by hand; its docstring names the mutants it kills
(line, operator, occurrence, of ``impl/cache.py`` at commit 61ec8ad).

Rules: M3.10 0x09 (cache ABI, dynamic and static families, capacity vs commitment), 0x08 (the
call ledger).
"""

from __future__ import annotations

import pytest
import torch

from decodespec.impl.cache import CacheABI, DynamicCache, StaticCache, check_static_reservation
from decodespec.spec.errors import Rejection, ResourceLimit

ABI = CacheABI(num_layers=2, num_key_value_heads=2, head_dim=4, dtype="float32")


def _rows(batch: int, length: int, fill: float = 1.0) -> torch.Tensor:
    """``[batch, H_kv, length, D]`` float32 rows whose value names the slot: ``fill + slot / 100``."""
    ramp = fill + torch.arange(length, dtype=torch.float32) / 100  # [T]
    return ramp[None, None, :, None].expand(batch, ABI.num_key_value_heads, length, ABI.head_dim).clone()


def _refusal(fn, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as err:
        fn(*args, **kwargs)
    return err.value


@pytest.mark.parametrize("family", ["dynamic", "static"])
def test_a_batch_past_256_rows_continues_its_own_rows(family):
    """A batch of 300 rows (past CPython's small-int cache): the second update of the same batch is taken.

    Kills line 335 ``batch != shape[0]`` -> ``is not`` (NotEq_IsNot 8).
    """
    cache = DynamicCache(ABI) if family == "dynamic" else StaticCache(ABI, 4, batch_size=300)
    for layer in range(ABI.num_layers):
        cache.update(_rows(300, 2), _rows(300, 2), layer)
    for layer in range(ABI.num_layers):
        keys, _ = cache.update(_rows(300, 1, 2.0), _rows(300, 1, 2.0), layer)
        assert keys.shape[0] == 300
    assert cache.layer_lengths() == (3, 3) and cache.committed_length == 3
    err = _refusal(cache.update, _rows(299, 1), _rows(299, 1), 0)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.update")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_rows_of_another_dtype_are_refused(dtype):
    """Keys in a dtype other than the ABI's float32 (below it as a string too: ``"bfloat16"``, ``"float16"``)
    are ``cache.invalid_operation`` at ``$.cache.update``; nothing is stored.

    Kills line 332 ``str(dtype) != self.abi.dtype`` -> ``>`` (NotEq_Gt 7).
    """
    cache = DynamicCache(ABI)
    rows = _rows(1, 2).to(dtype)
    err = _refusal(cache.update, rows, rows, 0)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.update")
    assert cache.layer_lengths() == (0, 0) and cache.key_cache[0] is None


def test_a_batch_mismatch_names_both_batch_sizes():
    """The refusal of a 3-row update on a 2-row cache says ``batch 3 differs from the cached batch 2``.

    Kills line 336 ``shape[0]`` -> ``shape[1]`` in the message (NumberReplacer 34: it would say ``batch 2``).
    """
    cache = DynamicCache(ABI)
    cache.update(_rows(2, 1), _rows(2, 1), 0)
    err = _refusal(cache.update, _rows(3, 1), _rows(3, 1), 0)
    assert "batch 3 differs from the cached batch 2" in err.message


@pytest.mark.parametrize("family", ["dynamic", "static"])
def test_an_update_of_no_rows_stores_nothing_and_returns_the_rows_so_far(family):
    """An update of T = 0 rows with an empty CPU ``cache_position``: accepted, the lengths stay, the returned keys
    are the rows already held (dynamic: the 2 slots; static: the buffer).

    Kills line 341 ``shape[2] and (...)`` -> ``shape[3]`` (NumberReplacer 36: reads ``cache_position[0]`` of an empty
    tensor).
    """
    cache = DynamicCache(ABI) if family == "dynamic" else StaticCache(ABI, 4)
    cache.update(_rows(1, 2), _rows(1, 2), 0)
    keys, _ = cache.update(_rows(1, 0), _rows(1, 0), 0, torch.arange(2, 2))
    assert cache.layer_lengths() == (2, 0)
    assert keys.shape[2] == (2 if family == "dynamic" else 4)
    assert torch.equal(keys[:, :, :2], _rows(1, 2))


def test_reorder_skips_a_layer_that_holds_no_rows_and_reorders_the_next():
    """A dynamic cache whose middle layer never wrote (a dropped lane): reorder_cache leaves it empty and still
    reorders every later layer.

    Kills line 449 ``continue`` -> ``break`` (ReplaceContinueWithBreak 0).
    """
    abi = CacheABI(num_layers=3, num_key_value_heads=2, head_dim=4, dtype="float32")
    cache = DynamicCache(abi)
    rows = torch.cat([_rows(1, 2, 1.0), _rows(1, 2, 5.0)])  # row 0 holds 1.xx, row 1 holds 5.xx
    cache.begin_call(0, 2, 0, drop_layers=(1,))
    for layer in range(3):
        cache.update(rows, rows, layer)
    cache.abandon_call()
    assert cache.key_cache[1] is None
    cache.reorder_cache([1, 1, 0])
    for layer in (0, 2):
        assert torch.equal(cache.key_cache[layer], rows[[1, 1, 0]]) and torch.equal(cache.value_cache[layer], rows[[1, 1, 0]])
    assert cache.key_cache[1] is None and cache.batch_size == 3


@pytest.mark.parametrize("index", [[-1], [0, -1], [2], [0, 2], [3], [1, 5]])
def test_reorder_refuses_a_parent_row_outside_the_batch(index):
    """``beam_idx`` values must lie in ``[0, B)``: -1 (which ``index_select`` would not read as the last row) and B
    are ``cache.invalid_operation`` at ``$.cache.beam_idx``; the rows stay.

    Kills line 718 ``index.min() < 0`` -> ``< -1`` (NumberReplacer 103) and ``index.max() >= batch`` -> ``== batch``
    (GtE_Eq 0: B + 1 and beyond).
    """
    cache = DynamicCache(ABI)
    rows = torch.cat([_rows(1, 2, 1.0), _rows(1, 2, 5.0)])
    for layer in range(2):
        cache.update(rows, rows, layer)
    err = _refusal(cache.reorder_cache, index)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.beam_idx")
    assert torch.equal(cache.key_cache[0], rows) and cache.batch_size == 2


def test_loading_layers_of_mixed_rank_is_refused_before_anything_changes():
    """``load_committed`` with one 4-D layer of 0 slots and one 3-D layer: ``cache.invalid_operation`` at
    ``$.cache.layers`` (the slot counts cannot agree), and the cache keeps its rows.

    Kills line 486 ``else -1`` -> ``else -0`` (NumberReplacer 63: the 3-D layer then counts as 0 slots, the check
    passes, and the cache is reset before the shape check refuses it).
    """
    cache = DynamicCache(ABI)
    for layer in range(2):
        cache.update(_rows(1, 2), _rows(1, 2), layer)
    empty = _rows(1, 0)
    flat = _rows(1, 2)[0]  # [H_kv, 2, D]
    err = _refusal(cache.load_committed, [(empty, empty), (flat, flat)], generation=3)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.layers")
    assert cache.layer_lengths() == (2, 2) and cache.committed_length == 2 and cache.generation == 0


@pytest.mark.parametrize(("family", "bad", "code"), [
    ("dynamic", "heads", "cache.invalid_operation"), ("dynamic", "dtype", "cache.invalid_operation"),
    ("static", "heads", "cache.invalid_operation"), ("static", "dtype", "cache.invalid_operation"),
    ("static", "capacity", "cache.capacity_exceeded"),
])
def test_a_refused_load_keeps_the_rows(family, bad, code):
    """``load_committed`` of rows the cache refuses (3 heads for the ABI's 2, float64, or, static, more slots than
    its capacity): the typed refusal, and the cache keeps its rows, lengths and generation.

    A bug the session's survivors showed (line 486's ``-1`` -> ``-0``, above): the cache was reset before the
    per-layer checks, so a refused load emptied it.  Fixed in ``load_committed`` (the checks run on an empty cache
    of the same family first).
    """
    cache = DynamicCache(ABI) if family == "dynamic" else StaticCache(ABI, 4)
    for layer in range(2):
        cache.update(_rows(1, 2), _rows(1, 2), layer)
    rows = {"heads": torch.ones(1, 3, 2, 4), "dtype": _rows(1, 2).double(), "capacity": _rows(1, 5)}[bad]
    with pytest.raises((Rejection, ResourceLimit)) as err:
        cache.load_committed([(rows, rows)] * 2, generation=5)
    assert err.value.code == code
    assert cache.layer_lengths() == (2, 2) and cache.committed_length == 2 and cache.generation == 0
    assert torch.equal(cache.committed_tensors()[1][0], _rows(1, 2))


def test_an_unmanaged_forward_commits_at_the_last_layer_only():
    """Without a call ledger (unmanaged use), the committed length follows the last layer's write: layer 0 alone
    commits nothing (the handle is dirty), the last layer commits its length.

    Kills line 397 ``num_layers - 1`` -> ``num_layers % 1`` (Sub_Mod 1: it would commit at layer 0) and
    ``num_layers / 1`` (Sub_Div 1: a float index that no layer equals, so nothing would commit).
    """
    cache = DynamicCache(ABI)
    cache.update(_rows(1, 3), _rows(1, 3), 0)
    assert cache.committed_length == 0 and cache.dirty
    cache.update(_rows(1, 3), _rows(1, 3), 1)
    assert cache.committed_length == 3 and not cache.dirty


@pytest.mark.parametrize("second", ["slots", "rank3", "rank2"])
def test_layers_that_disagree_on_their_slot_count_are_refused_as_layers(second):
    """``load_committed``: every layer must be a 4-D tensor of the same slot count.  A 4-D layer of 4 slots with a
    layer of 3 slots, a 3-D layer whose third axis is 4, or a 2-D layer: ``cache.invalid_operation`` at
    ``$.cache.layers``, nothing changes.

    Kills line 486 ``k.dim() == 4`` -> ``<= 4`` (Eq_LtE 4: a 3-D layer's third axis counts as slots, a 2-D layer
    raises IndexError) and line 487 ``len(lengths) != 1`` -> ``< 1`` (NotEq_Lt 15).
    """
    cache = DynamicCache(ABI)
    first = _rows(1, 4)
    other = {"slots": _rows(1, 3), "rank3": torch.ones(2, 3, 4), "rank2": torch.ones(2, 4)}[second]
    err = _refusal(cache.load_committed, [(first, first), (other, other)], generation=1)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.layers")
    assert cache.layer_lengths() == (0, 0) and cache.generation == 0


@pytest.mark.parametrize("positions", [[0, 0], [0, 2, 1], [0, 1, 1]])
def test_a_cache_position_that_does_not_end_at_the_last_new_slot_is_refused(positions):
    """CPU ``cache_position`` of an update of T rows must run ``start .. start + T - 1``: one that starts right but
    ends short is ``cache.slot_mismatch`` at ``$.cache_position``; nothing is stored.

    Kills line 342 ``cache_position[-1] != start + T - 1`` -> ``>`` (NotEq_Gt 12).
    """
    cache = DynamicCache(ABI)
    rows = _rows(1, len(positions))
    err = _refusal(cache.update, rows, rows, 0, torch.tensor(positions))
    assert (err.code, err.path) == ("cache.slot_mismatch", "$.cache_position")
    assert cache.layer_lengths() == (0, 0) and cache.key_cache[0] is None


def test_recover_never_pads_a_layer_shorter_than_the_committed_length():
    """A static cache written unmanaged at its last layer only (committed 2, layer 0 empty): ``recover`` only crops, so
    it refuses (``cache.invalid_operation``, nothing changes) instead of marking 2 unwritten slots of layer 0 as
    holding rows.

    Kills line 306 ``self._lengths[layer_idx] > self._committed`` -> ``!=`` (Gt_NotEq 1) (written against the
    assertion that preceded the typed refusal; the refusal now comes first).
    """
    from decodespec.spec.errors import Rejection

    cache = StaticCache(ABI, 4)
    cache.update(_rows(1, 2), _rows(1, 2), 1)
    assert cache.layer_lengths() == (0, 2) and cache.committed_length == 2
    with pytest.raises(Rejection) as refused:
        cache.recover(1)
    assert refused.value.code == "cache.invalid_operation" and refused.value.path == "$.cache.layer_idx"
    assert cache.layer_lengths() == (0, 2) and cache.generation != 1


def test_reserve_row_hands_out_the_buffers_unless_the_open_call_drops_the_layer():
    """``StaticCache.reserve_row`` (the native kernel's write path): outside a call and in a call that drops another
    layer it returns ``(start, keys, values)`` with the layer's buffers; for the dropped layer it returns ``None``.

    Kills line 660 ``call is not None and layer_idx in call.drop_layers`` -> ``or`` (ReplaceAndWithOr 8).
    """
    cache = StaticCache(ABI, 4)
    like = _rows(1, 1)
    start, keys, _values = cache.reserve_row(0, 0, like)
    assert start == 0 and keys is cache.key_cache[0] and keys.shape == (1, 2, 4, 4)
    cache.update(_rows(1, 1), _rows(1, 1), 1)  # layer 1 catches up (unmanaged), committing slot 0
    cache.update(_rows(1, 1), _rows(1, 1), 0)
    cache.begin_call(1, 1, 0, drop_layers=(1,))
    assert cache.reserve_row(0, 1, like)[0] == 1
    assert cache.reserve_row(1, 1, like) is None


def test_nbytes_counts_the_allocated_k_and_v_payload():
    """``nbytes``: elements x bytes per element of every allocated K and V tensor.  Static: one layer allocated,
    2 x [1, 2, 4, 4] float32 = 256 bytes, both layers 512; dynamic: 2 layers x K and V of [1, 2, 3, 4] = 384.

    Kills line 709 ``t.numel() * t.element_size()`` -> ``^`` (Mul_BitXor 16).
    """
    static = StaticCache(ABI, 4)
    assert static.nbytes() == 0
    static.update(_rows(1, 1), _rows(1, 1), 0)
    assert static.nbytes() == 2 * 2 * 4 * 4 * 4
    static.update(_rows(1, 1), _rows(1, 1), 1)
    assert static.nbytes() == 2 * 2 * (2 * 4 * 4 * 4)
    dynamic = DynamicCache(ABI)
    for layer in range(2):
        dynamic.update(_rows(1, 3), _rows(1, 3), layer)
    assert dynamic.nbytes() == 2 * 2 * (2 * 3 * 4 * 4)


def test_a_static_cache_of_one_slot_holds_one_row():
    """Capacity 1 is the smallest static cache: one row fits, a second is ``cache.capacity_exceeded``; capacity 0 is
    ``cache.invalid_operation`` at ``$.cache.capacity``.

    Kills line 605 ``capacity < 1`` -> ``<= 1`` (Lt_LtE 3) and line 618 ``start + length`` -> ``start ^ length`` in
    the refusal's message (Add_BitXor 7: ``3 ^ 2 = 1``).
    """
    cache = StaticCache(ABI, 1)
    for layer in range(2):
        cache.update(_rows(1, 1), _rows(1, 1), layer)
    assert cache.committed_length == 1 and cache.key_validity(0).tolist() == [[True]]
    with pytest.raises(ResourceLimit) as err:
        cache.update(_rows(1, 1), _rows(1, 1), 0)
    assert err.value.code == "cache.capacity_exceeded"
    assert err.value.details == {"start": 1, "length": 1, "reserved": 1}
    wide = StaticCache(ABI, 4)
    wide.update(_rows(1, 3), _rows(1, 3), 0)
    with pytest.raises(ResourceLimit) as err:
        wide.update(_rows(1, 2), _rows(1, 2), 0)
    assert "write [3, 5) exceeds the 4 reserved slots" in err.value.message
    refused = _refusal(StaticCache, ABI, 0)
    assert (refused.code, refused.path) == ("cache.invalid_operation", "$.cache.capacity")


def test_an_abi_with_rope_scaling_round_trips_through_json():
    """``CacheABI.from_json(abi.to_json()) == abi`` with ``rope_scaling = ("linear", 2.0)`` (type first, factor second).

    Kills line 171 ``scaling[0]`` -> ``scaling[-1]`` (NumberReplacer 5).
    """
    abi = CacheABI(num_layers=2, num_key_value_heads=2, head_dim=4, dtype="float32", rope_scaling=("linear", 2.0))
    assert abi.to_json()["rope_scaling"] == ["linear", 2.0]
    assert CacheABI.from_json(abi.to_json()) == abi


def test_load_committed_takes_the_generation_by_keyword_only():
    """``load_committed(tensors, *, generation)``: the generation cannot be passed by position.

    Kills line 475 ``*`` -> ``/`` (Mul_Div 5).
    """
    cache = DynamicCache(ABI)
    rows = _rows(1, 2)
    with pytest.raises(TypeError):
        cache.load_committed([(rows, rows)] * 2, 3)  # type: ignore[misc]
    cache.load_committed([(rows, rows)] * 2, generation=3)
    assert cache.committed_length == 2 and cache.generation == 3


@pytest.mark.parametrize("shape", [(1, 2, 1, 4, 1), (1, 2, 1, 4, 4)])
def test_rows_of_rank_five_are_refused(shape):
    """Keys and values must be ``[B, H_kv, T, D]``: a 5-D tensor whose second and fourth axes fit the ABI is still
    ``cache.invalid_operation`` at ``$.cache.update``; nothing is stored.

    Kills line 319 ``len(shape) != 4`` -> ``< 4`` (NotEq_Lt 2).
    """
    cache = DynamicCache(ABI)
    rows = torch.ones(shape)
    err = _refusal(cache.update, rows, rows, 0)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.update")
    assert cache.layer_lengths() == (0, 0)


@pytest.mark.parametrize("capacity", [True, 2.5, "4", 0, -3])
def test_a_static_capacity_must_be_a_positive_int(capacity):
    """``StaticCache(abi, capacity)``: a bool, a float, a str or a non-positive int is ``cache.invalid_operation`` at
    ``$.cache.capacity``.

    Kills line 605 ``isinstance(capacity, bool) or not isinstance(...)`` -> ``and`` (ReplaceOrWithAnd 13).
    """
    err = _refusal(StaticCache, ABI, capacity)
    assert (err.code, err.path) == ("cache.invalid_operation", "$.cache.capacity")


def test_a_static_reservation_defaults_to_one_row():
    """``check_static_reservation(abi, 4)``: K and V x 2 layers x 1 row x 2 heads x 4 slots x 4 dims x 4 bytes = 512,
    the bytes a one-row static cache allocates once every layer is written.

    Kills line 89 ``batch_size: int = 1`` -> ``0`` (NumberReplacer 1).
    """
    assert check_static_reservation(ABI, 4) == 2 * 2 * 1 * 2 * 4 * 4 * 4 == 512
    assert check_static_reservation(ABI, 4, batch_size=3) == 3 * 512
    cache = StaticCache(ABI, 4)
    for layer in range(2):
        cache.update(_rows(1, 1), _rows(1, 1), layer)
    assert cache.nbytes() == check_static_reservation(ABI, 4)


def test_the_dynamic_key_length_is_the_first_layers_length_plus_t():
    """``DynamicCache.key_length(T)``: the key slots the next update returns, read from layer 0 (the first layer a
    forward updates), also when a dropped lane left the last layer shorter.

    Kills line 565 ``self._lengths[0]`` -> ``self._lengths[-1]`` (NumberReplacer 87).
    """
    cache = DynamicCache(ABI)
    cache.begin_call(0, 3, 0, drop_layers=(1,))
    for layer in range(2):
        cache.update(_rows(1, 3), _rows(1, 3), layer)
    cache.abandon_call()
    assert cache.layer_lengths() == (3, 0)
    assert cache.key_length(1) == 4
    keys, _ = cache.update(_rows(1, 1), _rows(1, 1), 0)
    assert keys.shape[2] == 4


def test_a_layer_written_twice_in_one_call_is_refused():
    """Within an open call over ``[0, 2)`` a layer writes once: a second update of layer 0 (now holding 2 slots) is
    ``cache.slot_mismatch`` at ``$.cache_position``, and the layer keeps its 2 slots.

    Kills line 339 ``start != call.start`` -> ``<`` (NotEq_Lt 10).
    """
    cache = DynamicCache(ABI)
    cache.begin_call(0, 2, 0)
    cache.update(_rows(1, 2), _rows(1, 2), 0)
    err = _refusal(cache.update, _rows(1, 1), _rows(1, 1), 0)
    assert (err.code, err.path) == ("cache.slot_mismatch", "$.cache_position")
    assert cache.layer_lengths() == (2, 0) and cache.complete_layers() == 1


def test_the_default_abi_is_the_tiny_llamas(tiny_model):
    """``CacheABI`` defaults (layout, compact heads, rotated keys, RoPE base 10000, no scaling, contiguous slots, full
    window) are those of a Llama model with the default RoPE base: the tiny model's ABI is the default one of its shape.

    Kills line 138 ``rope_theta: float = 10000.0`` -> ``10001.0`` (NumberReplacer 2).
    """
    config = tiny_model.config
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    default = CacheABI(num_layers=config.num_hidden_layers, num_key_value_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, dtype="float32")
    assert default == tiny_model.cache_abi and default.rope_theta == 10000.0
