"""M3.8 0x11 'Statistical policies need more than one golden string': each sampler matches its
declared distribution under a chi-square goodness-of-fit test.

For a fixed row and each warper, the spec's processed distribution q is the declared target;
N draws come from the request's counter-based stream (steps 0..N-1 of one seeded identity) and
go through the torch twin's inverse-CDF selector and, for a subset, the spec's.  The test is
deterministic (fixed identity and seed) and uses significance alpha = 1e-3, so a correct
sampler fails it with probability 1e-3 per (sampler, seed) pair *once*, not at random in CI.
A deliberately wrong sampler (sampling the raw row instead of the processed one) is rejected.

Rules: selector.multinomial, transform.temperature, transform.top_k, transform.top_p,
transform.min_p, transform.typical, transform.epsilon, transform.eta, transform.top_n_sigma,
transform.mirostat_v2, transform.repetition_penalty.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decodespec.impl import policy as twin
from decodespec.impl.rng import RequestRng
from decodespec.spec.policy import PolicyState, RequestView, ScoreRow, initial_policy_state, policy_config_from_json, processed_row
from decodespec.spec.policy.selectors import multinomial

ALPHA = 1e-3
N = 20_000
Z = np.array([2.0, 1.5, 1.2, 0.7, 0.3, -0.2, -0.9, -1.5, -2.5, -4.0], dtype=np.float32)
VIEW = RequestView(prompt_ids=(0, 3), output_ids=(3,), identity="chi-square", seed=11)

SAMPLERS = {
    "plain": [],
    "temperature": [{"name": "temperature", "temperature": 0.6}],
    "top_k": [{"name": "temperature", "temperature": 1.4}, {"name": "top_k", "k": 4}],
    "top_p": [{"name": "top_p", "p": 0.7}],
    "min_p": [{"name": "min_p", "p": 0.2}],
    "typical": [{"name": "typical", "p": 0.5}],
    "epsilon": [{"name": "epsilon", "epsilon": 0.03}],
    "eta": [{"name": "eta", "epsilon": 0.1}],
    "top_n_sigma": [{"name": "top_n_sigma", "n": 1.0}],
    "mirostat_v2": [{"name": "mirostat_v2", "tau": 1.5, "eta": 0.1}],
    "repetition_penalty": [{"name": "repetition_penalty", "penalty": 2.0}],
}


def _uniforms(n: int) -> np.ndarray:
    rng = RequestRng(VIEW.identity, VIEW.seed)
    return np.array([rng.uniform(step, 0) for step in range(n)])


UNIFORMS = _uniforms(N)


def _chi_square_pvalue(counts: np.ndarray, q: np.ndarray) -> float:
    support = q > 0
    assert counts[~support].sum() == 0, "a token outside the processed support was sampled"
    return float(chisquare(counts[support], q[support] * counts.sum()).pvalue)


@pytest.mark.parametrize("name", SAMPLERS)
def test_sampler_matches_its_processed_distribution(name):
    """Chi-square goodness of fit of N twin draws against the spec's processed distribution."""
    config = policy_config_from_json({"family": "multinomial", "transforms": SAMPLERS[name]})
    state = initial_policy_state(config)
    q = processed_row(ScoreRow.create(Z.astype(np.float64)), config, state, VIEW).probs
    processed = twin.process_scores(torch.from_numpy(Z), config, state, VIEW)
    probs = processed.probs.expand(N, -1)
    tokens = twin.multinomial_select(probs, torch.from_numpy(UNIFORMS)).numpy()
    counts = np.bincount(tokens, minlength=len(Z))
    assert _chi_square_pvalue(counts, q) > ALPHA, (name, counts, q)
    # Sampling the raw row instead (temperature / truncation ignored) is detected, when they differ.
    raw = twin.multinomial_select(torch.softmax(torch.from_numpy(Z), -1).expand(N, -1), torch.from_numpy(UNIFORMS)).numpy()
    raw_counts = np.bincount(raw, minlength=len(Z))
    if np.abs(q - torch.softmax(torch.from_numpy(Z).double(), -1).numpy()).max() > 0.02:
        support = q > 0
        assert raw_counts[~support].sum() > 0 or _chi_square_pvalue(raw_counts, q) < ALPHA


def test_spec_and_twin_selectors_draw_the_same_ids_from_the_same_uniforms():
    """selector.multinomial: spec (float64) and twin (float32) inverse CDFs agree draw by draw away from CDF boundaries."""
    config = policy_config_from_json({"family": "multinomial", "transforms": SAMPLERS["top_k"]})
    q = processed_row(ScoreRow.create(Z.astype(np.float64)), config, PolicyState(), VIEW).probs
    probs = twin.process_scores(torch.from_numpy(Z), config, PolicyState(), VIEW).probs
    u = UNIFORMS[:2000]
    twin_ids = twin.multinomial_select(probs.expand(len(u), -1), torch.from_numpy(u)).tolist()
    compared = 0
    for ui, tid in zip(u, twin_ids):
        sid, margin = multinomial(q, float(ui))
        if margin > 1e-5:
            compared += 1
            assert sid == tid
    assert compared > 1900


def test_uniforms_of_the_request_stream_are_uniform():
    """The request stream's uniforms pass a 20-bin chi-square test at alpha = 1e-3."""
    counts = np.histogram(UNIFORMS, bins=20, range=(0.0, 1.0))[0]
    assert chisquare(counts).pvalue > ALPHA
