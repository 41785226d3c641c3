"""The GGUF loader: name map, Q/K un-permutation, typed errors, config from metadata, SmolLM2 facts.

File-free tests write the tiny model into a GGUF file with ``gguf.GGUFWriter`` (Q/K rows
permuted the way llama.cpp's converter does) and load it back; the SmolLM2 tests read the real
file.  Errors: ``model.file_missing``, ``model.unsupported_architecture`` (M3.10 envelope,
artifact identity).
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from decodespec.checks.gate.reference.files import llama_gguf_tensors
from decodespec.checks.gate.reference.files import write_llama_gguf as write_gguf
from decodespec.checks.testing import requires_smollm2
from decodespec.impl.config import LlamaConfig, RopeScaling
from decodespec.impl.tiny import load_tiny, tiny_config
from decodespec.impl.weights import load_llama_gguf, permute, read_gguf_state_dict, reverse_permute
from decodespec.spec.errors import Rejection


def write_llama_gguf(path, model, *, arch="llama", drop=(), extra=None, untie=False, rope_scaling=None, bad_shape=None):
    """Write ``model`` (ours) as a llama.cpp-style GGUF: F32 tensors, Q/K rows permuted (with the loader's failure knobs)."""
    tensors = llama_gguf_tensors(model)
    if untie:
        tensors["output.weight"] = tensors["token_embd.weight"] * 0.5
    for name in drop:
        tensors.pop(name)
    tensors.update(extra or {})
    if bad_shape:
        tensors[bad_shape] = tensors[bad_shape][:-1]
    return write_gguf(path, model, tensors, arch=arch, eos_token_id=2, rope_scaling=rope_scaling)


# -- the permutation -------------------------------------------------------------------------
def test_permute_is_llama_cpp_interleaving_and_reverse_undoes_it():
    """One head, D=4: rotate-half pairs (r0, r2), (r1, r3) become adjacent rows [r0, r2, r1, r3]."""
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # row i = [2i, 2i+1]
    assert permute(rows, 1)[:, 0].tolist() == [0, 4, 2, 6]
    weights = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(reverse_permute(permute(weights, 3), 3), weights)
    assert not np.array_equal(permute(weights, 3), weights)


# -- round trip through a GGUF file ----------------------------------------------------------
@pytest.mark.parametrize("untie", [False, True])
def test_tiny_model_round_trips_through_gguf(tmp_path, tiny_model, untie):
    path = write_llama_gguf(tmp_path / f"tiny-{untie}.gguf", tiny_model, untie=untie)
    loaded = load_llama_gguf(path, device="cpu")
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is (not untie)
    assert loaded.config == attrs.evolve(  # GGUF stores the epsilon as float32
        tiny_model.config, tie_word_embeddings=not untie, bos_token_id=None, pad_token_id=None,
        rms_norm_eps=float(np.float32(tiny_model.config.rms_norm_eps)),
    )
    ids = torch.tensor([[1, 70, 71, 72, 73]])
    with torch.inference_mode():
        got = loaded(ids).logits
        want = tiny_model(ids).logits
        if untie:
            reference = load_tiny(seed=0, device="cpu", config=attrs.evolve(tiny_config(), tie_word_embeddings=False))
            reference.lm_head.weight.copy_(reference.model.embed_tokens.weight * 0.5)
            want = reference(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_loaded_models_own_their_weights(tmp_path, tiny_model):
    path = write_llama_gguf(tmp_path / "own.gguf", tiny_model)
    first = load_llama_gguf(path, device="cpu")
    second = load_llama_gguf(path, device="cpu", attn_implementation="eager")
    with torch.no_grad():
        first.model.layers[0].mlp.up_proj.weight.zero_()
    assert second.model.layers[0].mlp.up_proj.weight.abs().sum() > 0
    assert second.config.attn_implementation == "eager"
    third = load_llama_gguf(path, device="cpu", dtype=torch.bfloat16)
    assert third.dtype == torch.bfloat16 and third.lm_head.weight is third.model.embed_tokens.weight


def test_linear_rope_scaling_is_read_from_metadata(tmp_path, tiny_model):
    path = write_llama_gguf(tmp_path / "linear.gguf", tiny_model, rope_scaling=("linear", 4.0))
    config, _ = read_gguf_state_dict(path)
    assert config.rope_scaling == RopeScaling("linear", 4.0)


# -- typed loader errors ---------------------------------------------------------------------
def test_missing_file_is_model_file_missing(tmp_path):
    with pytest.raises(Rejection) as info:
        load_llama_gguf(tmp_path / "absent.gguf", device="cpu")
    assert info.value.code == "model.file_missing"


def test_garbage_file_is_unsupported(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(Rejection) as info:
        load_llama_gguf(path, device="cpu")
    assert info.value.code == "model.unsupported_architecture"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"arch": "gpt2"}, "general.architecture"),
        ({"drop": ("blk.1.ffn_up.weight",)}, "missing"),
        ({"extra": {"rope_freqs.weight": np.ones(8, dtype=np.float32)}}, "unknown"),
        ({"extra": {"blk.0.attn_q.bias": np.ones(64, dtype=np.float32)}}, "unknown"),
        ({"bad_shape": "blk.2.attn_v.weight"}, "shape"),
        ({"rope_scaling": ("yarn", 4.0)}, "RoPE scaling"),
    ],
)
def test_wrong_architecture_or_tensor_set_is_unsupported(tmp_path, tiny_model, kwargs, fragment):
    path = write_llama_gguf(tmp_path / f"bad-{abs(hash(str(kwargs)))}.gguf", tiny_model, **kwargs)
    with pytest.raises(Rejection) as info:
        load_llama_gguf(path, device="cpu")
    assert info.value.code == "model.unsupported_architecture"
    assert fragment in info.value.message


def test_config_from_metadata_needs_the_llama_keys():
    with pytest.raises(Rejection) as info:
        LlamaConfig.from_gguf_metadata({"general.architecture": "llama", "llama.embedding_length": 64})
    assert info.value.code == "model.unsupported_architecture"
    with pytest.raises(Rejection) as info:
        LlamaConfig.from_gguf_metadata({"general.architecture": "qwen2"})
    assert "qwen2" in info.value.message


def test_dtype_by_name_and_unsupported_dtypes(tmp_path, tiny_model):
    """``dtype`` takes a torch dtype or its name; anything else is ``runtime.invalid_dtype`` before loading."""
    path = write_llama_gguf(tmp_path / "dt.gguf", tiny_model)
    assert load_llama_gguf(path, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    for bad in (torch.int8, "int8", "cpu"):
        with pytest.raises(Rejection) as info:
            load_llama_gguf(path, dtype=bad, device="cpu")
        assert info.value.code == "runtime.invalid_dtype" and info.value.path == "$.runtime.compute_dtype"


def test_unknown_device_is_rejected(tmp_path, tiny_model):
    path = write_llama_gguf(tmp_path / "dev.gguf", tiny_model)
    with pytest.raises(Rejection) as info:
        load_llama_gguf(path, device="tpu")
    assert info.value.code == "runtime.invalid_device"


# -- the real file ---------------------------------------------------------------------------
@requires_smollm2
def test_smollm2_config_from_its_metadata(smollm2_model):
    config = smollm2_model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert config.tie_word_embeddings
    assert smollm2_model.lm_head.weight is smollm2_model.model.embed_tokens.weight
    assert smollm2_model.num_parameters() == 134_515_008
    assert smollm2_model.cache_abi.num_key_value_heads == 3
