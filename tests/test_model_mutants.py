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

import pytest
import torch

from decodespec.impl import native
from decodespec.impl.model import LlamaForCausalLM, apply_rotary_pos_emb, rotate_half
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
