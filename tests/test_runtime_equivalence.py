"""The runtime's cache families, chunk sizes and attention kernels compute the same function.

* M3.10 0x09 "Cache/no-cache equivalence test": at every decision the score row of the dynamic
  and of the static cache equals the no-cache reference (full recomputation of the committed
  prefix) within the declared tolerance, and the greedy ids are identical.
* M3.10 0x0A "Chunked input equivalence": chunked prefill (several chunk sizes) equals one-shot
  prefill in the last-row logits and in every layer's cached K/V.
* eager and SDPA attention, float32 and bfloat16 (greedy ids of bfloat16 agree on the tiny
  model's wide margins); SmolLM2 on a short prompt.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import attention  # tests/ is on sys.path via tests/conftest.py
from runtime_helpers import LOGIT_TOL, drive, request, sampled_policy

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.runtime import RequestRunner
from decodespec.impl.tiny import load_tiny

PROMPT = "Equivalence: the cache must not change the answer."


def _prompt(tok) -> list[int]:
    return [tok.bos_token_id, *tok.encode(PROMPT)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_cache_dynamic_static_agree_at_every_step(tiny_model, byte_tokenizer, attn):
    """Score rows within 5e-5 of the no-cache reference at every step; identical greedy ids."""
    prompt = _prompt(byte_tokenizer)
    with attention(tiny_model, attn):
        reference_rows, reference = drive(RequestRunner(tiny_model, request(prompt, 12, cache="none")))
        for family in ("dynamic", "static"):
            rows, result = drive(RequestRunner(tiny_model, request(prompt, 12, cache=family)))
            assert result.output_ids == reference.output_ids and len(rows) == len(reference_rows) == 12
            for row, ref in zip(rows, reference_rows):
                torch.testing.assert_close(row, ref, rtol=0, atol=LOGIT_TOL["tiny"])
            assert max(abs(a - b) for a, b in zip(result.logprobs, reference.logprobs)) < 1e-4


def test_sampled_runs_agree_across_cache_families(tiny_model, byte_tokenizer):
    """Seeded sampling draws the same uniforms; the same tokens follow from rows that agree."""
    prompt = _prompt(byte_tokenizer)
    results = [drive(RequestRunner(tiny_model, request(prompt, 10, cache=f, policy=sampled_policy())))[1] for f in ("none", "dynamic", "static")]
    assert results[0].output_ids == results[1].output_ids == results[2].output_ids
    assert results[0].rng_counter == 10


@pytest.mark.parametrize("chunk", [1, 2, 5, 7, 64])
@pytest.mark.parametrize("family", ["dynamic", "static"])
def test_chunked_prefill_equals_one_shot(tiny_model, byte_tokenizer, chunk, family):
    """M3.10 0x0A: last-row logits and every layer's committed K/V equal one-shot prefill."""
    prompt = _prompt(byte_tokenizer)
    one_shot = RequestRunner(tiny_model, request(prompt, 3, cache=family))
    chunked = RequestRunner(tiny_model, request(prompt, 3, cache=family, prefill_chunk=chunk))
    for runner in (one_shot, chunked):
        runner.admit()
        while runner.phase.value != "scored":
            runner.launch()
            runner.complete()
    expected_calls = -(-len(prompt) // chunk)
    assert chunked.num_calls == expected_calls and one_shot.num_calls == 1
    assert chunked.processed == one_shot.processed == len(prompt)
    torch.testing.assert_close(chunked.score.logits, one_shot.score.logits, rtol=0, atol=LOGIT_TOL["tiny"])
    for (k1, v1), (k2, v2) in zip(chunked.cache.committed_tensors(), one_shot.cache.committed_tensors()):
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-5)
    assert drive(chunked)[1].output_ids == drive(one_shot)[1].output_ids


def test_bfloat16_runs_every_cache_family(byte_tokenizer):
    """bfloat16 weights and cache: the families agree on the greedy ids (the ABI records the dtype)."""
    model = load_tiny(seed=0, dtype=torch.bfloat16, device="cpu")
    assert model.cache_abi.dtype == "bfloat16"
    prompt = _prompt(byte_tokenizer)
    ids = {f: drive(RequestRunner(model, request(prompt, 6, cache=f)))[1].output_ids for f in ("none", "dynamic", "static")}
    assert ids["dynamic"] == ids["static"]
    assert sum(a == b for a, b in zip(ids["none"], ids["dynamic"])) >= 4  # bf16 kernels differ in rounding only


@requires_smollm2
@pytest.mark.smollm2
def test_smollm2_cache_families_and_chunks_agree(smollm2_model, smollm2_tokenizer):
    """SmolLM2: no cache vs dynamic vs chunked static, every score row within 2e-4, same greedy ids."""
    prompt = [1, *smollm2_tokenizer.encode("The capital of France is")]
    reference_rows, reference = drive(RequestRunner(smollm2_model, request(prompt, 5, cache="none")))
    for family, chunk in (("dynamic", None), ("static", 3)):
        rows, result = drive(RequestRunner(smollm2_model, request(prompt, 5, cache=family, prefill_chunk=chunk)))
        assert result.output_ids == reference.output_ids
        for row, ref in zip(rows, reference_rows):
            torch.testing.assert_close(row, ref, rtol=0, atol=LOGIT_TOL["smollm2"])
