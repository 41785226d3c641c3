"""Fused q/k/v and gate/up projections (impl/fastpath.py ``FusedWeight``): same state dict, same bits.

The decode speed work fuses ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` into
one matrix each whose row blocks *are* the modules' weights (views), and rotates query and key
heads in one pass.  These tests pin the contract: the state dict is unchanged, the fused path is
the one in use after loading, it is bitwise equal to the separate projections (logits of a
prefill and of cached decode steps), writes through the modules' weights reach the fused
matrix, a replaced Parameter is never silently ignored (the separate path takes over), and a
dtype move re-fuses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.fastpath import FusedWeight
from decodespec.impl.tiny import load_tiny

PROMPT = [5, 60, 70, 80, 90, 100, 110]


def _fused_in_use(model) -> bool:
    return all(layer.self_attn.qkv.get() is not None and layer.mlp.gate_up.get() is not None for layer in model.model.layers)


def _logits(model) -> torch.Tensor:
    """Prefill rows then three cached decode rows, ``[T + 3, V]``."""
    with torch.inference_mode():
        cache = model.new_cache()
        rows = [model(torch.tensor([PROMPT]), past_key_values=cache).logits[0]]
        for token in (3, 200, 17):
            rows.append(model(torch.tensor([[token]]), past_key_values=cache).logits[0])
    return torch.cat(rows)


def _separate_logits(model, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(FusedWeight, "get", lambda self: None)
        return _logits(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_is_used_and_bitwise_equal_to_separate_projections(dtype, monkeypatch):
    model = load_tiny(seed=0, dtype=dtype, device="cpu")
    assert _fused_in_use(model)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.get().untyped_storage().data_ptr()  # views, no copy
    assert torch.equal(_logits(model), _separate_logits(model, monkeypatch))


def test_state_dict_is_unchanged_by_fusion():
    model = load_tiny(seed=0, device="cpu")
    c = model.config
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (c.num_attention_heads * c.head_dim, c.hidden_size)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (c.num_key_value_heads * c.head_dim, c.hidden_size)
    assert sd["model.layers.0.mlp.up_proj.weight"].shape == (c.intermediate_size, c.hidden_size)
    assert not any("qkv" in k or "gate_up" in k for k in sd)
    fresh = load_tiny(seed=1, device="cpu")
    fresh.load_state_dict(sd)  # in-place copies reach the fused matrices
    assert _fused_in_use(fresh) and torch.equal(_logits(fresh), _logits(model))


def test_writes_and_replacements_are_never_lost(monkeypatch):
    model = load_tiny(seed=0, device="cpu")
    before = _logits(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(2.0)  # an in-place write through the module
    assert _fused_in_use(model)
    doubled = _logits(model)
    assert not torch.equal(doubled, before)
    assert torch.equal(doubled, _separate_logits(model, monkeypatch))
    layer = model.model.layers[2].self_attn
    layer.v_proj.weight = nn.Parameter(layer.v_proj.weight.detach().clone() * 0.5)  # a replaced Parameter
    assert layer.qkv.get() is None  # the stale fused matrix is not used ...
    replaced = _logits(model)
    assert not torch.equal(replaced, doubled)
    assert torch.equal(replaced, _separate_logits(model, monkeypatch))  # ... the separate path is
    model.rebuild_fused_projections()
    assert _fused_in_use(model) and torch.equal(_logits(model), replaced)


def test_a_dtype_move_refuses():
    model = load_tiny(seed=0, device="cpu").to(torch.bfloat16)
    assert _fused_in_use(model) and model.model.layers[0].self_attn.qkv.get().dtype == torch.bfloat16
    assert torch.equal(_logits(model), _logits(load_tiny(seed=0, dtype=torch.bfloat16, device="cpu")))


@requires_smollm2
@pytest.mark.smollm2
def test_fused_smollm2_is_bitwise_equal_to_separate_projections(smollm2_model, monkeypatch):
    assert _fused_in_use(smollm2_model)
    assert torch.equal(_logits(smollm2_model), _separate_logits(smollm2_model, monkeypatch))
