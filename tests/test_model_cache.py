"""The dynamic cache: ABI, edits, cache/no-cache equivalence and chunked prefill (tiny and SmolLM2).

* M3.10 0x09 "Cache/no-cache equivalence test": the cached single-token logits equal full
  recomputation at every step (and after a one-shot prefill).
* M3.10 0x0A "Chunked input equivalence": chunked prefill matches one-shot prefill in last-row
  logits and cache contents, for several chunk sizes.
* M3.10 0x09 "A cache is an ABI": a cache with another ABI is refused.

Declared tolerances (float32, CPU): tiny model 5e-5 on logits (final norm weight 10 amplifies
rounding; measured max ~1e-5) and 1e-5 on K/V; SmolLM2 2e-4 on logits
(|logit| up to ~30; measured max 6e-5) and 1e-4 on cached K/V.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from model_fixtures import attention  # tests/ is on sys.path via tests/conftest.py

from decodespec.impl.cache import CacheABI, DynamicCache
from decodespec.spec.errors import Rejection

TOL = {"tiny": {"logits": 5e-5, "kv": 1e-5}, "smollm2": {"logits": 2e-4, "kv": 1e-4}}
TEXT = "The cache must not change the answer: 1, 2, 3, 4, 5"


@pytest.fixture(params=["tiny", "smollm2"])
def case(request):
    """``(name, model, input_ids [1, T])`` for the tiny model and for SmolLM2."""
    if request.param == "tiny":
        model, tok = request.getfixturevalue("tiny_model"), request.getfixturevalue("byte_tokenizer")
        ids = [tok.bos_token_id, *tok.encode(TEXT)][:24]
    else:
        model, tok = request.getfixturevalue("smollm2_model"), request.getfixturevalue("smollm2_tokenizer")
        ids = tok.encode(TEXT)
    return request.param, model, torch.tensor([ids])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_logits_equal_full_recomputation_at_every_step(case, attn):
    """M3.10 0x09 Cache/no-cache equivalence test, as written in the seed (one row per cached call)."""
    name, model, input_ids = case
    cache = model.new_cache()
    with attention(model, attn), torch.inference_mode():
        for t in range(input_ids.shape[1]):
            full = model(input_ids[:, : t + 1]).logits[:, -1]
            cached = model(input_ids[:, t : t + 1], past_key_values=cache, cache_position=torch.tensor([t])).logits[:, -1]
            torch.testing.assert_close(cached, full, rtol=0, atol=TOL[name]["logits"])
    assert cache.layer_lengths() == (input_ids.shape[1],) * model.config.num_hidden_layers


def test_prefill_then_decode_equals_full_recomputation(case):
    """M3.10 0x09: the first cached call is the whole prompt; decode starts at the prompt length."""
    name, model, input_ids = case
    prompt_len = input_ids.shape[1] // 2
    cache = model.new_cache()
    with torch.inference_mode():
        out = model(input_ids[:, :prompt_len], past_key_values=cache, logits_to_keep=1)
        torch.testing.assert_close(out.logits[:, -1], model(input_ids[:, :prompt_len]).logits[:, -1], rtol=0, atol=TOL[name]["logits"])
        for t in range(prompt_len, input_ids.shape[1]):
            cached = model(input_ids[:, t : t + 1], past_key_values=cache).logits[:, -1]
            full = model(input_ids[:, : t + 1], logits_to_keep=1).logits[:, -1]
            torch.testing.assert_close(cached, full, rtol=0, atol=TOL[name]["logits"])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
def test_chunked_prefill_equals_one_shot_prefill(case, chunk):
    """M3.10 0x0A Chunked input equivalence: last-row logits and every layer's K/V rows."""
    name, model, input_ids = case
    length = input_ids.shape[1]
    one_shot_cache = model.new_cache()
    chunked_cache = model.new_cache()
    with torch.inference_mode():
        one_shot = model(input_ids, past_key_values=one_shot_cache, logits_to_keep=1).logits
        for start in range(0, length, chunk):
            out = model(input_ids[:, start : start + chunk], past_key_values=chunked_cache, logits_to_keep=1)
    torch.testing.assert_close(out.logits, one_shot, rtol=0, atol=TOL[name]["logits"])
    assert chunked_cache.layer_lengths() == one_shot_cache.layer_lengths() == (length,) * model.config.num_hidden_layers
    for a, b in zip(chunked_cache.key_cache + chunked_cache.value_cache, one_shot_cache.key_cache + one_shot_cache.value_cache):
        assert a.shape == b.shape == (1, model.config.num_key_value_heads, length, model.config.head_dim)
        torch.testing.assert_close(a, b, rtol=0, atol=TOL[name]["kv"])


@given(
    ids=st.lists(st.integers(0, 511), min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 39), max_size=6),
)
def test_any_chunking_equals_one_shot_prefill_tiny(tiny_model, ids, cuts):
    """M3.10 0x0A Chunked input equivalence for arbitrary chunk boundaries (tiny model)."""
    bounds = sorted({c for c in cuts if c < len(ids)} | {0, len(ids)})
    input_ids = torch.tensor([ids])
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        one_shot = tiny_model(input_ids, logits_to_keep=1).logits
        for start, stop in itertools.pairwise(bounds):
            out = tiny_model(input_ids[:, start:stop], past_key_values=cache, logits_to_keep=1)
    torch.testing.assert_close(out.logits, one_shot, rtol=0, atol=TOL["tiny"]["logits"])
    assert cache.get_seq_length() == len(ids)


def test_keys_are_stored_rotated_with_compact_heads(tiny_model):
    """The cache ABI (M3.10 0x09): stored keys are k_proj rows after RoPE, H_kv heads, not expanded."""
    config = tiny_model.config
    ids = torch.tensor([[1, 70, 71, 72]])
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        tiny_model(ids, past_key_values=cache)
        layer0 = tiny_model.model.layers[0]
        hidden = layer0.input_layernorm(tiny_model.model.embed_tokens(ids))
        raw = layer0.self_attn.k_proj(hidden).view(1, 4, config.num_key_value_heads, config.head_dim).transpose(1, 2)
        cos, sin = tiny_model.model.rotary_emb(torch.arange(4)[None])
        half = config.head_dim // 2
        rotated = raw * cos + torch.cat((-raw[..., half:], raw[..., :half]), dim=-1) * sin
    abi = tiny_model.cache_abi
    assert abi.keys_rotated and abi.compact_heads and abi.dtype == "float32"
    assert cache.key_cache[0].shape == (1, config.num_key_value_heads, 4, config.head_dim)
    torch.testing.assert_close(cache.key_cache[0], rotated, rtol=0, atol=1e-6)
    assert not torch.allclose(cache.key_cache[0][..., 1:, :], raw[..., 1:, :], atol=1e-3)  # position > 0 is rotated


def test_cache_with_another_abi_is_refused(tiny_model):
    other = DynamicCache(attrs.evolve(tiny_model.cache_abi, keys_rotated=False))
    with torch.inference_mode(), pytest.raises(Rejection) as info:
        tiny_model(torch.tensor([[1, 2]]), past_key_values=other)
    assert info.value.code == "cache.abi_mismatch"
    assert other.layer_lengths() == (0,) * tiny_model.config.num_hidden_layers
    bf16 = DynamicCache(CacheABI.for_config(tiny_model.config, torch.bfloat16))
    with torch.inference_mode(), pytest.raises(Rejection):
        tiny_model(torch.tensor([[1, 2]]), past_key_values=bf16)


def test_crop_keeps_a_prefix_and_recomputes_like_a_shorter_prompt(tiny_model):
    ids = torch.tensor([[1, 80, 81, 82, 83, 84, 85]])
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        tiny_model(ids, past_key_values=cache)
        cache.crop(4)
        assert cache.layer_lengths() == (4,) * 4
        assert cache.key_cache[2].shape[2] == 4
        resumed = tiny_model(torch.tensor([[90]]), past_key_values=cache).logits[:, -1]
        fresh = tiny_model(torch.tensor([[1, 80, 81, 82, 90]])).logits[:, -1]
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=5e-5)
    assert cache.get_seq_length() == 5  # 4 kept + the decoded row
    cache.crop(10)  # longer than held: no-op (HF behaviour)
    assert cache.get_seq_length() == 5
    with pytest.raises(Rejection) as info:
        cache.crop(-1)
    assert info.value.code == "cache.invalid_operation"


def test_reorder_cache_selects_parent_rows(tiny_model):
    ids = torch.tensor([[1, 80, 81], [1, 90, 91], [1, 100, 101]])
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        tiny_model(ids, past_key_values=cache)
        before = [k.clone() for k in cache.key_cache]
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        for old, new in zip(before, cache.key_cache):
            assert torch.equal(new[0], old[2]) and torch.equal(new[1], old[2]) and torch.equal(new[2], old[0])
        # Continuing row 1 (a copy of old row 2) equals continuing prompt 2 alone.
        step = tiny_model(torch.tensor([[5], [5], [5]]), past_key_values=cache).logits[1, -1]
        alone = tiny_model(torch.tensor([[1, 100, 101, 5]])).logits[0, -1]
    torch.testing.assert_close(step, alone, rtol=0, atol=5e-5)
    for bad in ([3], [[0, 1]], torch.tensor([0.5])):
        with pytest.raises(Rejection):
            cache.reorder_cache(bad)
    assert cache.batch_size == 3


def test_invalid_update_is_refused_and_stores_nothing(tiny_model):
    abi = tiny_model.cache_abi
    cache = DynamicCache(abi)
    good = torch.zeros(1, abi.num_key_value_heads, 2, abi.head_dim)
    cache.update(good, good, 0, torch.tensor([0, 1]))
    for keys, layer_idx, position in [
        (torch.zeros(1, abi.num_key_value_heads + 1, 1, abi.head_dim), 0, None),  # expanded heads
        (torch.zeros(2, abi.num_key_value_heads, 1, abi.head_dim), 0, None),  # batch changed
        (torch.zeros(1, abi.num_key_value_heads, 1, abi.head_dim, dtype=torch.float64), 0, None),
        (torch.zeros(1, abi.num_key_value_heads, 1, abi.head_dim), abi.num_layers, None),
        (torch.zeros(1, abi.num_key_value_heads, 1, abi.head_dim), 0, torch.tensor([2, 3])),
    ]:
        with pytest.raises(Rejection) as info:
            cache.update(keys, keys, layer_idx, position)
        assert info.value.code == "cache.invalid_operation"
    assert cache.layer_lengths()[0] == 2 and cache.key_cache[0].shape[2] == 2
    assert cache.nbytes() == 2 * good.numel() * 4
