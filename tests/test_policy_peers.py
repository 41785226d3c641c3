"""M3.8 0x0B-0x0E transform parity with the peers' own code: HF transformers' logits processors.

The spec mirrors HF ``generation/logits_process.py`` where their semantics agree; rows are drawn
away from decision boundaries (spec margin > 1e-4) and without ties, where HF's threshold rules
(``scores < kth value``) and the spec's exact-k lowest-id tie rule coincide.  Each test runs the
HF processor on the same float32 row and history.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decodespec.checks.testing import requires_hf
from decodespec.spec.policy import PolicyState, RequestView, policy_config_from_json
from decodespec.spec.policy.transforms import TRANSFORMS

pytestmark = requires_hf

V = 40
ROWS = 40


def _spec(obj):
    return policy_config_from_json({"family": "multinomial", "order": "explicit", "transforms": [obj]}).transforms[0]


def _hf(name, **kwargs):
    import transformers.generation.logits_process as lp

    return getattr(lp, name)(**kwargs)


CASES = [
    # (our transform JSON, HF class, HF kwargs, uses a token history)
    ({"name": "temperature", "temperature": 0.7}, "TemperatureLogitsWarper", {"temperature": 0.7}, False),
    ({"name": "repetition_penalty", "penalty": 1.7}, "RepetitionPenaltyLogitsProcessor", {"penalty": 1.7}, True),
    ({"name": "top_k", "k": 7}, "TopKLogitsWarper", {"top_k": 7}, False),
    ({"name": "top_p", "p": 0.8}, "TopPLogitsWarper", {"top_p": 0.8}, False),
    ({"name": "min_p", "p": 0.1}, "MinPLogitsWarper", {"min_p": 0.1}, False),
    ({"name": "typical", "p": 0.6}, "TypicalLogitsWarper", {"mass": 0.6}, False),
    ({"name": "epsilon", "epsilon": 0.02}, "EpsilonLogitsWarper", {"epsilon": 0.02}, False),
    ({"name": "eta", "epsilon": 0.05}, "EtaLogitsWarper", {"epsilon": 0.05}, False),
    ({"name": "no_repeat_ngram", "n": 2}, "NoRepeatNGramLogitsProcessor", {"ngram_size": 2}, True),
    ({"name": "bad_words", "sequences": [[3, 4], [5], [1, 2, 6]]}, "NoBadWordsLogitsProcessor", {"bad_words_ids": [[3, 4], [5], [1, 2, 6]], "eos_token_id": None}, True),
    ({"name": "logit_bias", "bias": {"3": 2.5, "17": -1.25}}, "SequenceBiasLogitsProcessor", {"sequence_bias": [[[3], 2.5], [[17], -1.25]]}, False),
]


@pytest.mark.parametrize("obj,hf_name,hf_kwargs,uses_history", CASES, ids=[c[0]["name"] for c in CASES])
def test_transform_matches_hf_logits_processor(obj, hf_name, hf_kwargs, uses_history):
    """transform.temperature, transform.repetition_penalty, transform.top_k, transform.top_p, transform.min_p,
    transform.typical, transform.epsilon, transform.eta, transform.no_repeat_ngram, transform.bad_words,
    transform.logit_bias agree with HF's processor on the same row (same support, values within float32)."""
    spec = _spec(obj)
    rng = np.random.default_rng(1234)
    compared = 0
    for _ in range(ROWS):
        z = (rng.standard_normal(V) * 3).astype(np.float32)
        history = rng.integers(0, 8, size=12).tolist() if uses_history else [0]
        view = RequestView(prompt_ids=history[:4], output_ids=history[4:])
        step = TRANSFORMS[spec.name](z.astype(np.float64), spec, view, PolicyState())
        if step.margin < 1e-4:
            continue
        compared += 1
        hf_out = _hf(hf_name, **hf_kwargs)(torch.tensor([history]), torch.tensor(z)[None])[0].double().numpy()
        assert np.array_equal(np.isfinite(step.values), np.isfinite(hf_out)), (spec.name, z)
        finite = np.isfinite(hf_out)
        np.testing.assert_allclose(step.values[finite], hf_out[finite], rtol=1e-6, atol=1e-6)
    assert compared >= ROWS // 2


def test_min_new_tokens_matches_hf_for_every_eos_id():
    """transform.min_new_tokens agrees with HF MinNewTokensLengthLogitsProcessor with several EOS ids."""
    spec = _spec({"name": "min_new_tokens"})
    z = np.linspace(-1, 1, V).astype(np.float32)
    prompt = [1, 2, 3]
    for produced in range(4):
        output = [7] * produced
        view = RequestView(prompt_ids=prompt, output_ids=output, eos_ids=(2, 9), min_new_tokens=2)
        ours = TRANSFORMS["min_new_tokens"](z.astype(np.float64), spec, view, PolicyState()).values
        hf = _hf("MinNewTokensLengthLogitsProcessor", prompt_length_to_skip=3, min_new_tokens=2, eos_token_id=[2, 9])
        theirs = hf(torch.tensor([prompt + output]), torch.tensor(z)[None])[0].double().numpy()
        assert np.array_equal(np.isfinite(ours), np.isfinite(theirs))


def test_top_k_differs_from_hf_only_by_the_declared_tie_rule():
    """transform.top_k: HF keeps every id tied with the k-th value; the spec keeps exactly k (lowest ids)."""
    z = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0], dtype=np.float32)
    spec = _spec({"name": "top_k", "k": 3})
    ours = TRANSFORMS["top_k"](z.astype(np.float64), spec, RequestView(prompt_ids=()), PolicyState()).values
    theirs = _hf("TopKLogitsWarper", top_k=3)(torch.tensor([[0]]), torch.tensor(z)[None])[0].numpy()
    assert np.flatnonzero(np.isfinite(ours)).tolist() == [1, 2, 3]
    assert np.flatnonzero(np.isfinite(theirs)).tolist() == [1, 2, 3, 4, 5]
