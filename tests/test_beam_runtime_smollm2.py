"""Beam runtime (impl/beam.py) on SmolLM2: the spec replayed over the real model's rows.

Short chat prompts whose beams complete on EOS (``<|im_end|>``, id 2) within a few tokens, small
``max_new_tokens``: the normative parameters (exact bound) replayed in lock step by the spec with
the branch hash of every child at every step, width 1 against the greedy controller, cache
families, and a deliberately un-reordered cache.  HF transformers comparisons are in
``test_beam_hf.py``.  Budget: a few seconds per search on one CPU core.
"""

from __future__ import annotations

import attrs
import pytest
from test_beam_runtime import assert_same_beams, beam_request, replay_against_spec

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.beam import BeamRunner
from decodespec.impl.cache import DynamicCache
from decodespec.impl.generate import generate
from decodespec.spec import beam as B
from decodespec.spec.enums import FinishReason

pytestmark = [requires_smollm2, pytest.mark.smollm2]

EOS = 2
#: Questions whose beams finish on EOS inside 14 tokens (checked by the tests that use them).
QUESTIONS = ("What is 2+2?", "What is the capital of France?", "Say hi.")


def chat_ids(tokenizer, question: str) -> tuple[int, ...]:
    """The prompt ids of one user turn in SmolLM2's chat template (with its default system turn)."""
    return tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}])))


def search(model, tokenizer, params: B.BeamParams, question: str = QUESTIONS[0], **kw) -> BeamRunner:
    """A finished recorded search on one chat question, replayed by the spec (every step, every branch hash)."""
    request = beam_request(params, prompt=chat_ids(tokenizer, question), **kw)
    runner = BeamRunner(model, request, params, tokenizer=tokenizer, record=True).run()
    replay_against_spec(runner)
    return runner


def test_normative_exact_search_is_the_spec_replayed_with_every_branch_hash(smollm2_model, smollm2_tokenizer):
    """transition.beam_step, transition.beam_stop (exact), invariant.beam_parent_coupling: under the
    normative parameters (exact bound, every completed hypothesis kept, the cap closing every live
    child) the runtime's decisions and lanes are the spec's over its own rows, and every child's
    branch hash is the hash of its parent's fork at every step."""
    params = B.BeamParams(4, 12, [EOS], length_penalty=B.LengthPenalty(1.0), early_stop="exact")
    result = search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[2]).result()
    assert result.best.finish_reason is FinishReason.EOS and result.best.text
    assert result.stop is B.BeamStop.EARLY_STOP and len(result.steps) < params.max_new_tokens
    # "Exact relative to the finite-beam trace": the same search run to the cap finds nothing better.
    at_cap = search(smollm2_model, smollm2_tokenizer, attrs.evolve(params, early_stop=B.EarlyStop.AT_CAP), QUESTIONS[2])
    assert at_cap.result().steps[: len(result.steps)] == result.steps
    assert (at_cap.result().best.output_ids, at_cap.result().best.score) == (result.best.output_ids, result.best.score)


def test_width_one_is_greedy_token_for_token_with_identical_logprobs(smollm2_model, smollm2_tokenizer):
    """A width-1 beam (normative parameters) equals the greedy controller on SmolLM2: same ids,
    bit-identical logprobs, and the beam score is their left-to-right sum."""
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[1])
    best = search(smollm2_model, smollm2_tokenizer, B.BeamParams(1, 12, [EOS]), QUESTIONS[1]).result().best
    greedy = generate(smollm2_model, prompt, max_new_tokens=12, eos_token_ids=(EOS,))
    assert best.output_ids == greedy.output_ids and best.logprobs == greedy.logprobs
    assert greedy.output_ids[-1] == EOS and best.finish_reason is FinishReason.EOS
    total = 0.0
    for lp in greedy.logprobs:
        total += lp
    assert best.score == total


def test_dynamic_and_static_caches_give_identical_beams_and_an_unreordered_cache_does_not(smollm2_model, smollm2_tokenizer, monkeypatch):
    """Dynamic and static caches give the same beams (ids, parents, ancestry; scores within the
    declared SmolLM2 logit tolerance; no cache is compared on the tiny model); a dynamic cache that
    keeps its rows in place changes the answer."""
    params = B.BeamParams.hf_compatible(4, 10, [EOS], length_penalty=1.0, early_stopping="never")
    results = [search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[0], cache=c).result()
               for c in ("dynamic", "static")]
    assert_same_beams(results, tol=2e-4)  # tests/runtime_helpers.py LOGIT_TOL["smollm2"]
    good = results[0]
    assert any(e["parents"] != list(range(len(e["parents"]))) for e in good.steps[1:])
    original = DynamicCache.reorder_cache
    monkeypatch.setattr(DynamicCache, "reorder_cache",
                        lambda self, idx: original(self, [min(r, self.batch_size - 1) for r in range(len(idx))]))
    bad = search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[0]).result()
    assert [(h.output_ids, h.score) for h in bad.hypotheses] != [(h.output_ids, h.score) for h in good.hypotheses]
