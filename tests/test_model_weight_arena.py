"""The CPU weight arena (impl/fastpath.py ``weight_arena``, ``LlamaForCausalLM.rebuild_fused_projections``).

On the CPU every weight a decode step reads lives in one buffer, in the order the step reads it,
each slice on a 64-byte boundary (and the buffer on 2 MiB transparent huge pages where Linux
allows).  The arena is a layout only: the state dict, the fused ``qkv``/``gate_up`` views and
every logit are unchanged.  Mixed dtypes fall back to per-matrix storage.
"""

from __future__ import annotations

import torch
from torch import nn

from decodespec.impl.fastpath import FusedWeight, weight_arena
from decodespec.impl.tiny import load_tiny

PROMPT = [5, 60, 70, 80, 90]


def _tensors(model) -> list[torch.Tensor]:
    return [item.weight if isinstance(item, FusedWeight) else item for item in model.decode_weight_order()]


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        cache = model.new_cache()
        rows = [model(torch.tensor([PROMPT]), past_key_values=cache).logits[0]]
        for token in (3, 17):
            rows.append(model(torch.tensor([[token]]), past_key_values=cache).logits[0])
    return torch.cat(rows)


def test_decode_weights_share_one_storage_in_access_order():
    model = load_tiny(seed=0, device="cpu")
    tensors = _tensors(model)
    assert len(tensors) == 6 * model.config.num_hidden_layers + 2
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    ptrs = [t.data_ptr() for t in tensors]
    assert ptrs == sorted(ptrs) and len(set(ptrs)) == len(ptrs)
    assert all(p % 64 == 0 for p in ptrs)
    assert all(t.is_contiguous() for t in tensors)
    for end, start in zip((p + t.numel() * t.element_size() for p, t in zip(ptrs, tensors)), ptrs[1:]):
        assert 0 <= start - end < 64  # back to back, only alignment padding between slices
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives


def test_rebuilding_the_arena_changes_no_value():
    model = load_tiny(seed=0, device="cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = _logits(model)
    old = model.model.layers[0].input_layernorm.weight.untyped_storage().data_ptr()
    model.rebuild_fused_projections()
    assert model.model.layers[0].input_layernorm.weight.untyped_storage().data_ptr() != old
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(_logits(model), before)


def test_mixed_dtypes_fall_back_to_separate_storage():
    model = load_tiny(seed=0, device="cpu")
    before = _logits(model)
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight = nn.Parameter(layer.self_attn.o_proj.weight.detach().clone().to(torch.float64))
    model.rebuild_fused_projections()
    assert layer.self_attn.qkv.get() is not None and layer.mlp.gate_up.get() is not None  # still fused
    assert len({t.untyped_storage().data_ptr() for t in _tensors(model)}) > 1  # no common arena
    layer.self_attn.o_proj.weight = nn.Parameter(layer.self_attn.o_proj.weight.detach().to(torch.float32))
    model.rebuild_fused_projections()
    assert torch.equal(_logits(model), before)


def test_weight_arena_views_are_aligned_and_disjoint():
    views = weight_arena([(3, 5), (7,), (2, 2, 2)], torch.bfloat16)
    assert [tuple(v.shape) for v in views] == [(3, 5), (7,), (2, 2, 2)]
    assert all(v.dtype == torch.bfloat16 and v.data_ptr() % 64 == 0 for v in views)
    for i, v in enumerate(views):
        v.fill_(i)
    assert [v.unique().tolist() for v in views] == [[0.0], [1.0], [2.0]]
