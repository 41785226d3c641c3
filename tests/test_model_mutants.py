"""Checks written against the survivors of the sampled Cosmic Ray session on ``impl/model.py``.

Each test's docstring names the mutants it kills (``line operator occurrence``, line numbers of
``impl/model.py`` at commit 61ec8ad).  The screen (``checks/lab/mutation/model.toml``) runs the
decoder through the gate and the tiny-model tests, which never call the public helpers the decoder
itself does not use (``apply_rotary_pos_emb``, ``rotate_half``) and never hand the model inputs
that only a refusal reads.

Source: docs/results/mutation-sampled-runtime-snapshot-model.md (issue 15 item 5); M3.10 0x08
"Prefill and decode", 0x0A "Deriving cached causal visibility from coordinates".
"""

from __future__ import annotations

import attrs
import pytest
import torch

from decodespec.impl import native
from decodespec.impl.model import Linear, LlamaForCausalLM, LlamaRMSNorm, apply_rotary_pos_emb, repeat_kv, rotate_half
from decodespec.impl.tiny import tiny_config
from decodespec.spec.errors import Rejection


def _rotate_half_by_hand(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis, element by element (no slicing helper shared with impl/)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for j in range(d // 2):
        out[..., j] = -x[..., j + d // 2]
        out[..., j + d // 2] = x[..., j]
    return out


def test_rotate_half_and_apply_rotary_pos_emb_follow_hf_on_every_axis_layout():
    """HF's rotate-half RoPE on queries ``[B, H, T, D]`` and keys ``[B, H_kv, T, D]`` with ``H != D / 2``.

    Kills 186 ``ReplaceUnaryOperator_Delete_USub`` 5 (``x.shape[1]`` halves the head axis) and
    197 ``ReplaceBinaryOperator_Add_FloorDiv`` 2 (the key rotation's sum).
    """
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k = torch.randn(2, 1, 5, 8, generator=gen)
    half_angle = torch.randn(2, 1, 5, 4, generator=gen)
    angle = torch.cat((half_angle, half_angle), dim=-1)  # RoPE: one angle per (j, j + D/2) pair
    cos, sin = angle.cos(), angle.sin()
    assert torch.equal(rotate_half(q), _rotate_half_by_hand(q))
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_embed, q * cos + _rotate_half_by_hand(q) * sin, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_embed, k * cos + _rotate_half_by_hand(k) * sin, rtol=0, atol=1e-6)
    # A rotation keeps each (j, j + D/2) pair's norm.
    torch.testing.assert_close(k_embed.square().sum(-1), k.square().sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="native kernel unavailable here")
def test_the_native_kernel_is_refused_for_a_model_off_the_cpu():
    """A model on the ``meta`` device cannot take the native kernel (``runtime.kernel_unavailable``), and nothing changes.

    Kills 673 ``ReplaceComparisonOperator_NotEq_Lt`` 5 (``"meta" < "cpu"`` is false, so the mutant
    installs the kernel).
    """
    model = LlamaForCausalLM(tiny_config(), device="meta")
    with pytest.raises(Rejection) as info:
        model.set_decode_kernel("native")
    assert info.value.code == "runtime.kernel_unavailable" and info.value.path == "$.runtime.decode_kernel"
    assert model.decode_kernel == "torch" and model._kernel is None


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_call_whose_batch_differs_from_the_cache_is_refused(tiny_model, batch):
    """A cache written with batch 2 refuses batch 1 and batch 3 alike (``model.invalid_input`` at ``$.input_ids``), and accepts 2.

    Kills 745 ``ReplaceComparisonOperator_NotEq_Gt`` 8 (only a smaller batch refused).
    """
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 70, 71], [1, 72, 73]]), past_key_values=cache)
        keys_before = cache.key_cache[0].clone()
        if batch == 2:
            out = tiny_model(torch.tensor([[74], [75]]), past_key_values=cache)
            assert tuple(out.logits.shape) == (2, 1, tiny_model.config.vocab_size)
            return
        with pytest.raises(Rejection) as info:
            tiny_model(torch.tensor([[74]] * batch), past_key_values=cache)
    assert info.value.code == "model.invalid_input" and info.value.path == "$.input_ids"
    assert cache.layer_lengths() == (3,) * tiny_model.config.num_hidden_layers
    assert torch.equal(cache.key_cache[0], keys_before)


def test_a_call_returns_hidden_states_only_when_asked(tiny_model):
    """``return_hidden_states`` defaults to False: no ``[B, T, d_model]`` tensor is kept; asked, it is the head's input.

    Kills 694 ``ReplaceFalseWithTrue`` 12 (the default flipped).
    """
    ids = torch.tensor([[1, 70, 71, 72]])
    with torch.inference_mode():
        plain = tiny_model(ids)
        asked = tiny_model(ids, return_hidden_states=True)
        relogits = asked.hidden_states @ tiny_model.lm_head.weight.T  # [1, 4, V]
    assert plain.hidden_states is None
    assert tuple(asked.hidden_states.shape) == (1, 4, tiny_model.config.hidden_size)
    torch.testing.assert_close(relogits, plain.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [True, False, 1.0, "2", None])
def test_logits_to_keep_that_is_not_an_int_is_refused(tiny_model, keep):
    """``logits_to_keep`` of type bool, float, str or None is ``model.invalid_input`` at ``$.logits_to_keep`` (``True`` is not 1).

    Kills 844 ``ReplaceOrWithAnd`` 19 (only a negative int refused: ``True`` kept the last row, a
    float or a string failed untyped).
    """
    with torch.inference_mode(), pytest.raises(Rejection) as info:
        tiny_model(torch.tensor([[1, 70, 71]]), logits_to_keep=keep)
    assert info.value.code == "model.invalid_input" and info.value.path == "$.logits_to_keep"


def test_the_fused_qkv_path_equals_the_separate_projections_when_heads_and_kv_heads_share_bits():
    """With ``H = 3``, ``H_kv = 1`` (``3 | 1 != 3 + 1``) the fused ``qkv`` call gives the separate projections' logits.

    The tiny model's ``H = 4``, ``H_kv = 2`` has ``4 | 2 == 4 + 2``, so only another head layout
    tells the value rows' offset apart.  The separate MLP (``silu(gate) * up``) is checked the same
    way.  Kills 375 ``ReplaceBinaryOperator_Add_BitOr`` 7 and 402 ``ReplaceBinaryOperator_Mul_Div`` 18.
    """
    from torch import nn

    from decodespec.impl.tiny import load_tiny

    config = attrs.evolve(tiny_config(), num_attention_heads=3, num_key_value_heads=1)
    fused, separate = load_tiny(seed=0, config=config), load_tiny(seed=0, config=config)
    for layer in separate.model.layers:  # a weight that is no longer a view of the fused matrix turns the fused path off
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj.weight = nn.Parameter(attn.q_proj.weight.detach().clone())
        mlp.gate_proj.weight = nn.Parameter(mlp.gate_proj.weight.detach().clone())
        assert attn.qkv.get() is None and mlp.gate_up.get() is None
    assert all(layer.self_attn.qkv.get() is not None and layer.mlp.gate_up.get() is not None for layer in fused.model.layers)
    ids = torch.tensor([[1, 70, 71, 72, 73]])
    with torch.inference_mode():
        a, b = fused(ids).logits, separate(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_window_overflow_names_the_positions_it_would_write():
    """``model.context_window_exceeded`` quotes the positions ``past..past + T - 1`` and the window.

    Kills 752 ``ReplaceBinaryOperator_Sub_Mul`` 0 and ``ReplaceBinaryOperator_Sub_LShift`` 0 (the
    message's last position).
    """
    from decodespec.impl.tiny import load_tiny
    from decodespec.spec.errors import ResourceLimit

    small = load_tiny(seed=0, config=tiny_config(max_position_embeddings=8))
    cache = small.new_cache()
    with torch.inference_mode():
        small(torch.tensor([[1, 70, 71]]), past_key_values=cache)
        with pytest.raises(ResourceLimit) as info:
            small(torch.tensor([[72, 73, 74, 75, 76, 77]]), past_key_values=cache)
    assert info.value.code == "model.context_window_exceeded" and info.value.path == "$.cache_position"
    assert "positions 3..8 exceed the window 8" in str(info.value)


def test_a_meta_model_moves_and_runs_without_reading_values():
    """On the ``meta`` device nothing is fused or range-checked: ``.to(dtype)`` keeps every weight on meta, a call gives ``[B, T, V]``.

    ``impl/weights.py`` builds SmolLM2 exactly so (meta, then ``.to(dtype)``).  Kills 564
    ``ReplaceComparisonOperator_NotEq_Is`` 2 (the arena copied meta weights) and 828
    ``ReplaceComparisonOperator_NotEq_Lt`` 14 (the id range read off a meta tensor).
    """
    model = LlamaForCausalLM(tiny_config(), device="meta").to(torch.float32)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(layer.self_attn.qkv.get() is None for layer in model.model.layers)
    with torch.inference_mode():
        out = model(torch.tensor([[1, 70, 71]], device="meta"))
    assert out.logits.device.type == "meta" and tuple(out.logits.shape) == (1, 3, model.config.vocab_size)


def test_tying_keeps_the_heads_parameter_with_the_embeddings_values():
    """``tie_weights`` on two same-shape tensors keeps the head's Parameter (placed in the decode arena) and the embedding's values.

    Kills 618 ``ReplaceComparisonOperator_Eq_Lt`` 5 (the embedding's Parameter kept instead).
    """
    from torch import nn

    model = LlamaForCausalLM(tiny_config(), device="cpu")
    embed = torch.randn(model.config.vocab_size, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    model.model.embed_tokens.weight = nn.Parameter(embed.clone())
    head = model.lm_head.weight
    assert head is not model.model.embed_tokens.weight
    model.tie_weights()
    assert model.lm_head.weight is head and model.model.embed_tokens.weight is head
    assert torch.equal(head.detach(), embed)


def test_a_single_row_sdpa_call_packs_the_query_heads_of_each_kv_head(tiny_model, monkeypatch):
    """A decode row under SDPA reads the compact cache as is: query ``[B, H_kv, n_rep, D]``, no ``enable_gqa`` (HF ``pack_gqa``).

    A prefill call of several rows uses ``enable_gqa``.  Kills 290
    ``ReplaceComparisonOperator_Gt_Lt`` 0 (every call through ``enable_gqa``).
    """
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape), kwargs.get("enable_gqa", False)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = tiny_model.config
    cache = tiny_model.new_cache()
    assert cfg.attn_implementation == "sdpa" and cfg.num_attention_heads > cfg.num_key_value_heads
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 70, 71]]), past_key_values=cache)
        prefill = list(calls)
        calls.clear()
        tiny_model(torch.tensor([[72]]), past_key_values=cache)
    h, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    assert prefill == [((1, h, 3, d), (1, h_kv, 3, d), True)] * cfg.num_hidden_layers
    assert calls == [((1, h_kv, h // h_kv, d), (1, h_kv, 4, d), False)] * cfg.num_hidden_layers


def test_repeat_kv_repeats_each_kv_head_n_rep_times_in_place():
    """``[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D]`` equals ``repeat_interleave(n_rep, dim=1)`` for ``H_kv = 3, n_rep = 2``.

    On the tiny model ``H_kv = n_rep = 2`` and ``2 ** 2 == 2 * 2``.  Kills 258
    ``ReplaceBinaryOperator_Mul_Pow`` 9.
    """
    x = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(4))
    assert torch.equal(repeat_kv(x, 2), x.repeat_interleave(2, dim=1))
    assert repeat_kv(x, 1) is x


def test_tying_a_head_of_another_shape_takes_the_embedding():
    """A head whose shape differs from the embedding's is replaced by the embedding's Parameter (no copy into it).

    Kills 618 ``ReplaceComparisonOperator_Eq_IsNot`` 3 (two ``torch.Size`` objects are never
    identical, so the copy branch ran and failed).
    """
    from torch import nn

    model = LlamaForCausalLM(tiny_config(), device="cpu")
    embed = model.model.embed_tokens.weight
    model.lm_head.weight = nn.Parameter(torch.zeros(7, model.config.hidden_size))
    model.tie_weights()
    assert model.lm_head.weight is embed and model.model.embed_tokens.weight is embed


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="native kernel unavailable here")
def test_a_native_model_moved_off_the_cpu_decodes_through_torch():
    """Only a call on the CPU runs the native kernel: the same model moved to ``meta`` decodes a row through torch.

    784 ``ReplaceComparisonOperator_Eq_IsNot`` 7 (``device.type is not "cpu"``, always true) passes
    this test: the kernel refuses weights off the CPU and falls back.  Since the model refuses
    ``input_ids`` on another device than its weights
    (:func:`test_input_ids_on_another_device_than_the_model_are_refused`), the call's device is the
    model's, so the mutant is equivalent (docs/results/mutation-sampled-runtime-snapshot-model.md).
    """
    from decodespec.impl.cache import StaticCache
    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=0).set_decode_kernel("native").to("meta")
    assert model.decode_kernel == "native" and model.device.type == "meta"
    cache = StaticCache(model.cache_abi, 8)
    with torch.inference_mode():
        model(torch.tensor([[1, 70, 71]], device="meta"), past_key_values=cache, attention_mask=cache.key_validity(3).to("meta"))
        out = model(torch.tensor([[72]], device="meta"), past_key_values=cache, cache_position=torch.tensor([3], device="meta"),
                    attention_mask=cache.key_validity(4).to("meta"))
    assert out.logits.device.type == "meta" and tuple(out.logits.shape) == (1, 1, model.config.vocab_size)


def test_rms_norm_of_a_bfloat16_input_is_computed_in_float32():
    """A bfloat16 input is normed in float32 and cast back before the weight (HF's order): bitwise that computation.

    Kills 105 ``AddNot`` 0 (the norm computed in bfloat16).
    """
    norm = LlamaRMSNorm(64, eps=1e-5)
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 7).to(torch.bfloat16)
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    with torch.no_grad():
        got = norm(x)
        assert torch.equal(got, expected)
        x64 = x.double()
        exact = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert (got.double() - exact).abs().max().item() <= 2 ** -8 * exact.abs().max().item()


def test_linear_with_a_bias_adds_it():
    """``Linear(..., bias=True)`` is ``x @ W.T + b``; a bias-free one goes through :func:`project` with the same values.

    Kills 325 ``AddNot`` 10 (the bias dropped, and the bias-free call sent to ``F.linear``).
    """
    lin = Linear(4, 3, bias=True)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 4, generator=gen))
        lin.bias.copy_(torch.tensor([1.0, -2.0, 3.0]))
        x = torch.randn(2, 4, generator=gen)
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
def test_an_empty_call_is_refused(tiny_model, shape):
    """``input_ids`` with no row or no token is ``model.invalid_input`` at ``$.input_ids``; the cache is untouched.

    Kills 811 ``NumberReplacer`` 161 (``T = 0`` admitted).
    """
    cache = tiny_model.new_cache()
    with torch.inference_mode(), pytest.raises(Rejection) as info:
        tiny_model(torch.zeros(shape, dtype=torch.int64), past_key_values=cache)
    assert (info.value.code, info.value.path) == ("model.invalid_input", "$.input_ids")
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(("model_device", "ids_device"), [("cpu", "meta"), ("meta", "cpu")])
def test_input_ids_on_another_device_than_the_model_are_refused(model_device, ids_device):
    """``input_ids`` on another device than the weights is ``model.invalid_input`` at ``$.input_ids``, and the cache is untouched.

    Before, a CPU model given ``meta`` ids returned CPU logits of no value (the torch path ran a meta
    embedding lookup) and with the native kernel raised an untyped ``RuntimeError``; found through the
    live mutant at line 784 of the sampled Cosmic Ray session.
    """
    from decodespec.impl.cache import StaticCache
    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=0)
    if native.unavailable_reason() is None:
        model.set_decode_kernel("native")
    model = model.to(model_device)
    cache = StaticCache(model.cache_abi, 8)
    with torch.inference_mode():
        for ids in (torch.tensor([[1, 70, 71]], device=ids_device), torch.tensor([[72]], device=ids_device)):
            with pytest.raises(Rejection) as info:
                model(ids, past_key_values=cache)
            assert info.value.code == "model.invalid_input" and info.value.path == "$.input_ids"
            assert ids_device in str(info.value) and model_device in str(info.value)
            assert cache.get_seq_length() == 0
