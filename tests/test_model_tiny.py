"""The decoder on the tiny model: config validation, seeded init, non-degenerate logits, masks, padding.

These run without any model file.  The coordinate mask follows M3.10 0x0A "Deriving cached
causal visibility from coordinates"; padding follows M3.10 0x0A "Position fields have related
but distinct meanings" (left-padded row: valid-token position ids, rectangular cache slots,
key validity mask).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

import decodespec.impl.tiny as tiny_module
from decodespec.impl.config import LlamaConfig, RopeScaling
from decodespec.impl.generate import greedy_generate
from decodespec.impl.model import build_attention_mask
from decodespec.impl.tiny import load_tiny, normal_draws, tiny_config
from decodespec.spec.errors import Rejection, ResourceLimit

PROMPTS = ["hello", "world", "abc", "The quick brown fox", "12345", "zzz", "Hi!", "def f(x):"]


def _ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text)]


REPO = Path(__file__).resolve().parent.parent
#: The seed-0 tiny model's artifact identity (``tiny_checkpoint_sha256``: its float32 state dict), the same on every CPU.
TINY_CHECKPOINT_SHA256 = "sha256:667f9eed05e73bc76782e32de3736a1f03277f9baf23897842a0ba7041b1d3fa"
_DIGEST = "from decodespec.checks.commands.generate import tiny_checkpoint_sha256 as d; print(d(0))"


def _capabilities() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return ["default"] + [c for c, flag in (("avx2", " avx2"), ("avx512", " avx512bw")) if flag in flags]


# -- machine-independent weights (issue 15 item 3) ----------------------------------------------
def test_the_tiny_weights_are_the_same_bits_under_every_cpu_kernel_set():
    """torch's own ``normal_`` drew other float32 weights under ``ATEN_CPU_CAPABILITY=default``; ours do not."""
    digests = {}
    for capability in _capabilities():
        for threads in ("1", "2"):
            env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS=threads)
            out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=120, check=True)
            digests[(capability, threads)] = out.stdout.strip()
    assert set(digests.values()) == {TINY_CHECKPOINT_SHA256}, digests


def test_the_shipped_tiny_examples_name_the_tiny_checkpoint():
    for name in ("tiny.request.json", "greedy.request.json"):
        envelope = json.loads((REPO / "docs" / "examples" / name).read_text())
        assert envelope["artifact"]["checkpoint_sha256"] == TINY_CHECKPOINT_SHA256, name


@pytest.mark.parametrize("n, std", [(16, 1.0), (17, 0.5), (100, 0.3), (64 * 192, 1 / 8), (512 * 64, 0.05)])
def test_normal_draws_follow_torchs_recipe_and_consume_the_generator_as_it_does(n, std):
    """Within a few float32 ulps of ``normal_`` (which rounds in float32), and the generator ends in the same state."""
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    drawn = normal_draws(ours, n, std)
    expected = torch.empty(n).normal_(0.0, std, generator=theirs).numpy()
    assert drawn.dtype == np.float32 and drawn.shape == (n,)
    assert np.abs(drawn - expected).max() <= 8 * np.finfo(np.float32).eps * std * 6
    assert 0.8 * std < float(drawn.std()) < 1.2 * std
    assert torch.equal(torch.rand(4, generator=ours), torch.rand(4, generator=theirs))


def test_normal_draws_round_the_exact_value_when_float64_is_near_a_midpoint(monkeypatch):
    """The mpmath path (taken here for every value) rounds as the float64 path does away from midpoints."""
    plain = normal_draws(torch.Generator().manual_seed(9), 256, 0.05)
    monkeypatch.setattr(tiny_module, "_MIDPOINT_GUARD", 1.0)
    exact = normal_draws(torch.Generator().manual_seed(9), 256, 0.05)
    assert np.array_equal(plain, exact)


def test_normal_draws_refuse_fewer_than_sixteen_values():
    with pytest.raises(ValueError, match="at least 16"):
        normal_draws(torch.Generator().manual_seed(0), 15, 1.0)


# -- configuration ---------------------------------------------------------------------------
def test_tiny_config_is_a_small_gqa_llama(tiny_model):
    config = tiny_model.config
    assert config.vocab_size == 512
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.num_hidden_layers >= 3
    assert 100_000 <= tiny_model.num_parameters() <= 900_000
    assert tiny_model.lm_head.weight is tiny_model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "change, path",
    [
        ({"num_key_value_heads": 3}, "$.config.num_key_value_heads"),  # 4 % 3 != 0
        ({"head_dim": 15}, "$.config.head_dim"),
        ({"hidden_size": 0}, "$.config.hidden_size"),
        ({"rms_norm_eps": -1.0}, "$.config.rms_norm_eps"),
        ({"attn_implementation": "flash"}, "$.config.attn_implementation"),
        ({"eos_token_id": 512}, "$.config.eos_token_id"),
    ],
)
def test_config_validators_reject_inconsistent_values(change, path):
    with pytest.raises(Rejection) as info:
        attrs.evolve(tiny_config(), **change)
    assert info.value.code == "model.invalid_config"
    assert info.value.path == path


def test_rope_scaling_rejects_non_positive_factor():
    with pytest.raises(Rejection):
        RopeScaling(rope_type="linear", factor=0.0)
    with pytest.raises(Rejection):
        RopeScaling(rope_type="yarn", factor=2.0)


def test_linear_rope_scaling_divides_frequencies():
    """Linear scaling by 2 makes position 2p rotate exactly like position p unscaled."""
    base = load_tiny(seed=0, device="cpu")
    scaled = load_tiny(seed=0, device="cpu", config=attrs.evolve(tiny_config(), rope_scaling=RopeScaling("linear", 2.0)))
    cos_base, sin_base = base.model.rotary_emb(torch.tensor([[3, 5]]))
    cos_scaled, sin_scaled = scaled.model.rotary_emb(torch.tensor([[6, 10]]))
    torch.testing.assert_close(cos_scaled, cos_base, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin_scaled, sin_base, rtol=0, atol=1e-6)


# -- seeded initialisation -------------------------------------------------------------------
def test_same_seed_same_weights_other_seed_other_weights(tiny_model):
    again = load_tiny(seed=0, device="cpu")
    other = load_tiny(seed=1, device="cpu")
    for (name, a), b, c in zip(tiny_model.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(a, c), name


def test_logits_are_not_degenerate(tiny_model, byte_tokenizer):
    """Greedy outputs vary with the prompt, top-2 margins are clear, and rows are not near-uniform."""
    outputs = set()
    min_margin = float("inf")
    mean_logprobs = []
    for text in PROMPTS:
        result = greedy_generate(tiny_model, _ids(byte_tokenizer, text), max_new_tokens=16, eos_token_ids=(), use_cache=False)
        outputs.add(result.output_ids)
        mean_logprobs.append(sum(result.logprobs) / len(result.logprobs))
        ids = torch.tensor([list(result.prompt_ids) + list(result.output_ids)])
        with torch.inference_mode():
            logits = tiny_model(ids).logits[0, len(result.prompt_ids) - 1 : -1]  # the 16 selecting rows
        top2 = logits.topk(2, dim=-1).values
        min_margin = min(min_margin, float((top2[:, 0] - top2[:, 1]).min()))
    assert len(outputs) == len(PROMPTS)
    assert min_margin > 1e-3
    # Neither uniform (logprob ~ -log 512 = -6.2) nor one-hot (logprob ~ 0).
    assert -3.0 < sum(mean_logprobs) / len(mean_logprobs) < -0.1


def test_tiny_greedy_text_is_mostly_printable(tiny_model, byte_tokenizer):
    result = greedy_generate(tiny_model, _ids(byte_tokenizer, "The quick brown fox"), max_new_tokens=32, eos_token_ids=(), tokenizer=byte_tokenizer)
    printable = sum(0x20 + 3 <= t < 0x7F + 3 for t in result.output_ids)
    assert printable >= 0.8 * len(result.output_ids)


def test_eager_and_sdpa_compute_the_same_function(tiny_model, byte_tokenizer):
    ids = torch.tensor([_ids(byte_tokenizer, "attention implementations agree")])
    with torch.inference_mode():
        sdpa = tiny_model(ids).logits
        tiny_model.set_attn_implementation("eager")
        try:
            eager = tiny_model(ids).logits
        finally:
            tiny_model.set_attn_implementation("sdpa")
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=5e-5)


def test_bfloat16_tiny_model_tracks_float32(tiny_model, byte_tokenizer):
    bf16 = load_tiny(seed=0, dtype=torch.bfloat16, device="cpu")
    ids = torch.tensor([_ids(byte_tokenizer, "bfloat16")])
    with torch.inference_mode():
        ref = tiny_model(ids).logits
        low = bf16(ids).logits
    assert low.dtype == torch.bfloat16
    assert bf16.model.rotary_emb.cos_cached.dtype == torch.bfloat16
    assert float((low.float() - ref).abs().max()) < 0.5  # logits spread over ~20 units


# -- the coordinate mask (M3.10 0x0A) --------------------------------------------------------
def test_mask_matches_the_seed_example_p3_c2():
    """M3.10 0x0A: a chunk at p=3 with c=2 rows sees keys 0..3 and 0..4."""
    mask = build_attention_mask(torch.tensor([3, 4]), torch.arange(5), None, torch.float32)
    neg = torch.finfo(torch.float32).min
    expected = torch.tensor([[0, 0, 0, 0, neg], [0, 0, 0, 0, 0]], dtype=torch.float32)
    assert mask.shape == (1, 1, 2, 5)
    assert torch.equal(mask[0, 0], expected)


def test_mask_intersects_key_validity():
    validity = torch.tensor([[False, True, True, True], [True, True, False, True]])
    mask = build_attention_mask(torch.tensor([2, 3]), torch.arange(4), validity, torch.float32)
    visible = mask == 0
    assert mask.shape == (2, 1, 2, 4)
    assert visible[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert visible[1, 0].tolist() == [[True, True, False, False], [True, True, False, True]]


# -- padded batches --------------------------------------------------------------------------
def test_left_padded_row_equals_the_unpadded_row(tiny_model, byte_tokenizer):
    """Left padding: rectangular slots, valid-token position ids, a key-validity mask (M3.10 0x0A)."""
    short = _ids(byte_tokenizer, "abc")  # 4 ids
    full = _ids(byte_tokenizer, "wxyz!!")  # 7 ids
    pad = 3
    input_ids = torch.tensor([[0] * pad + short, full])
    validity = torch.tensor([[False] * pad + [True] * 4, [True] * 7])
    position_ids = torch.tensor([[0] * pad + [0, 1, 2, 3], list(range(7))])
    with torch.inference_mode():
        cache = tiny_model.new_cache()
        batch = tiny_model(input_ids, attention_mask=validity, position_ids=position_ids, past_key_values=cache, logits_to_keep=1)
        alone_short = tiny_model(torch.tensor([short]), past_key_values=(c0 := tiny_model.new_cache()), logits_to_keep=1)
        alone_full = tiny_model(torch.tensor([full]), past_key_values=(c1 := tiny_model.new_cache()), logits_to_keep=1)
        torch.testing.assert_close(batch.logits[0], alone_short.logits[0], rtol=0, atol=5e-5)
        torch.testing.assert_close(batch.logits[1], alone_full.logits[0], rtol=0, atol=5e-5)
        # One decode step for both rows: slot 7, positions 4 and 7, the padding stays invisible.
        step = torch.tensor([[65], [66]])
        validity = torch.cat([validity, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        batch = tiny_model(step, attention_mask=validity, position_ids=torch.tensor([[4], [7]]), past_key_values=cache)
        alone_short = tiny_model(step[:1], past_key_values=c0)
        alone_full = tiny_model(step[1:], past_key_values=c1)
    torch.testing.assert_close(batch.logits[0], alone_short.logits[0], rtol=0, atol=5e-5)
    torch.testing.assert_close(batch.logits[1], alone_full.logits[0], rtol=0, atol=5e-5)


def test_right_padded_row_equals_the_unpadded_row(tiny_model, byte_tokenizer):
    short = _ids(byte_tokenizer, "abc")
    input_ids = torch.tensor([short + [0, 0]])
    validity = torch.tensor([[True] * 4 + [False, False]])
    with torch.inference_mode():
        padded = tiny_model(input_ids, attention_mask=validity).logits[0, 3]
        alone = tiny_model(torch.tensor([short])).logits[0, -1]
    torch.testing.assert_close(padded, alone, rtol=0, atol=5e-5)


# -- typed input errors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"input_ids": torch.tensor([1, 2, 3])}, "model.invalid_input"),  # rank 1
        ({"input_ids": torch.tensor([[1.0, 2.0]])}, "model.invalid_input"),  # float ids
        ({"input_ids": torch.tensor([[1, 512]])}, "model.invalid_input"),  # id == V
        ({"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 3, dtype=torch.bool)}, "model.invalid_input"),
        ({"input_ids": torch.tensor([[1, 2]]), "position_ids": torch.tensor([[0, 1, 2]])}, "model.invalid_input"),
        ({"input_ids": torch.tensor([[1, 2]]), "cache_position": torch.tensor([0])}, "model.invalid_input"),
        ({"input_ids": torch.tensor([[1, 2]]), "logits_to_keep": -1}, "model.invalid_input"),
        ({"input_ids": torch.tensor([[1, 2]]), "position_ids": torch.tensor([[0, 1024]])}, "model.context_window_exceeded"),
        ({"input_ids": torch.tensor([[1, 2]]), "position_ids": torch.tensor([[-1, 0]])}, "model.invalid_input"),
    ],
)
def test_bad_model_inputs_are_typed_and_change_nothing(tiny_model, kwargs, code):
    cache = tiny_model.new_cache()
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 70, 71]]), past_key_values=cache)
        keys_before = cache.key_cache[0].clone()
        with pytest.raises((Rejection, ResourceLimit)) as info:
            tiny_model(past_key_values=cache, **kwargs)
    assert info.value.code == code
    assert cache.layer_lengths() == (3,) * 4
    assert torch.equal(cache.key_cache[0], keys_before)


def test_derived_positions_past_the_window_are_a_resource_limit():
    small = load_tiny(seed=0, device="cpu", config=tiny_config(max_position_embeddings=8))
    cache = small.new_cache()
    with torch.inference_mode():
        small(torch.tensor([[1] * 6]), past_key_values=cache)
        with pytest.raises(ResourceLimit) as info:
            small(torch.tensor([[1] * 3]), past_key_values=cache)
    assert info.value.code == "model.context_window_exceeded"
    assert cache.get_seq_length() == 6


def test_config_is_constructible_from_plain_values():
    config = LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=1e4,
    )
    assert config.num_key_value_groups == 2
    assert config.attn_implementation == "sdpa"


def test_untied_tiny_head_is_initialised():
    untied = load_tiny(seed=0, device="cpu", config=attrs.evolve(tiny_config(), tie_word_embeddings=False))
    weight = untied.lm_head.weight.detach()
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert torch.isfinite(weight).all() and 0.03 < float(weight.std()) < 0.07


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_row_projection_equals_f_linear(dtype):
    """``model.Linear`` routes a single row through ``torch.mv``; values equal ``F.linear``'s (dtype tolerance)."""
    from decodespec.impl.model import Linear

    gen = torch.Generator().manual_seed(0)
    layer = Linear(96, 200, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
    layer = layer.to(dtype)
    row = torch.randn(1, 1, 96, generator=gen).to(dtype)
    rows = torch.randn(2, 3, 96, generator=gen).to(dtype)
    with torch.inference_mode():
        assert layer(row).shape == (1, 1, 200)
        # Equal values (bitwise on the machines measured; a kernel may round differently elsewhere).
        torch.testing.assert_close(layer(row), torch.nn.functional.linear(row, layer.weight))
        assert torch.equal(layer(rows), torch.nn.functional.linear(rows, layer.weight))  # the F.linear path itself
