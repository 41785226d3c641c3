"""M3.8 spec (numpy, float64) and torch twin (float32) agree on processed rows and decisions.

Hypothesis draws rows (ties, -inf, tiny and huge logits), presets and explicit orders, every
transform with random parameters, histories, EOS sets, constraint automata and Mirostat
states.  Both sides either raise the same ``policy.*`` code or agree:

* on the finite support and the processed distribution, whenever the spec's smallest decision
  margin over all steps (:attr:`ProcessedRow.margin`) is outside float32 error;
* on the selected id, the draws, the RNG counters and the next policy state for the same
  request identity and seed, whenever additionally the uniform lies outside float32 error of
  a CDF boundary (greedy: the top score is not within float32 error of the runner-up).

Rules exercised: every ``transform.*``, ``selector.greedy``, ``selector.multinomial``,
``selector.beam``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, event, given, note
from hypothesis import strategies as st

from decodespec.impl import policy as twin
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import (
    PRESET_ORDERS,
    Order,
    PolicyState,
    RequestView,
    ScoreRow,
    beam_candidates,
    decide,
    initial_policy_state,
    policy_config_from_json,
    processed_row,
)
from decodespec.spec.policy.selectors import greedy, multinomial

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

TIE_VALUES = [0.0, 1.0, 2.0, -1.0, 3.5]
TINY = float(np.float32(1e-30))
value = st.one_of(
    st.sampled_from(TIE_VALUES),
    st.just(-math.inf),
    st.floats(-30, 30, width=32),
    st.floats(-TINY, TINY, width=32),
    st.floats(-1e4, 1e4, width=32),
)


@st.composite
def rows(draw, vocab: int) -> np.ndarray:
    values = draw(st.lists(value, min_size=vocab, max_size=vocab))
    if not any(math.isfinite(v) for v in values):
        values[draw(st.integers(0, vocab - 1))] = draw(st.floats(-5, 5, width=32))
    return np.array(values, dtype=np.float32)


def ids(vocab: int, max_size: int = 6):
    return st.lists(st.integers(0, vocab - 1), max_size=max_size)


def transform(name: str, vocab: int):
    """Strategy for one transform JSON object with random parameters."""
    history = st.sampled_from(["prompt_and_output", "output"])
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False)
    return {
        "constraint": st.builds(lambda a, b: {"name": "constraint", "automaton": {"initial": "s0", "transitions": {
            "s0": {str(t): "s1" for t in a} | {str(vocab - 1): "s0"}, "s1": {str(t): "s0" for t in b} | {"0": "s1"}}}},
            ids(vocab), ids(vocab)),
        "min_new_tokens": st.just({"name": "min_new_tokens"}),
        "bad_words": st.builds(lambda seqs, h: {"name": "bad_words", "sequences": seqs, "history": h},
                               st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3), min_size=1, max_size=3), history),
        "no_repeat_ngram": st.builds(lambda n, h: {"name": "no_repeat_ngram", "n": n, "history": h}, st.integers(1, 3), history),
        "repetition_penalty": st.builds(lambda r, h: {"name": "repetition_penalty", "penalty": r, "history": h}, floats(0.5, 3.0), history),
        "frequency_penalty": st.builds(lambda f: {"name": "frequency_penalty", "penalty": f}, floats(-2, 2)),
        "presence_penalty": st.builds(lambda f: {"name": "presence_penalty", "penalty": f}, floats(-2, 2)),
        "logit_bias": st.builds(lambda b: {"name": "logit_bias", "bias": {str(k): v for k, v in b.items()}},
                                st.dictionaries(st.integers(0, vocab - 1), floats(-5, 5), min_size=1, max_size=3)),
        "temperature": st.builds(lambda t: {"name": "temperature", "temperature": t}, st.one_of(st.just(0.0), floats(0.05, 5.0))),
        "top_k": st.builds(lambda k: {"name": "top_k", "k": k}, st.integers(1, vocab + 1)),
        "top_p": st.builds(lambda p: {"name": "top_p", "p": p}, st.one_of(st.just(1.0), floats(0.01, 1.0))),
        "min_p": st.builds(lambda p: {"name": "min_p", "p": p}, floats(0.0, 1.0)),
        "typical": st.builds(lambda p: {"name": "typical", "p": p}, floats(0.01, 0.99)),
        "epsilon": st.builds(lambda e: {"name": "epsilon", "epsilon": e}, floats(1e-4, 0.5)),
        "eta": st.builds(lambda e: {"name": "eta", "epsilon": e}, floats(1e-4, 0.5)),
        "top_n_sigma": st.builds(lambda n: {"name": "top_n_sigma", "n": n}, floats(0.1, 3.0)),
        "mirostat_v2": st.builds(lambda tau, eta: {"name": "mirostat_v2", "tau": tau, "eta": eta}, floats(0.5, 8.0), floats(0.01, 1.0)),
    }[name]


@st.composite
def cases(draw, families=("multinomial", "greedy")):
    vocab = draw(st.integers(2, 24))
    family = draw(st.sampled_from(families))
    order = draw(st.sampled_from([o.value for o in Order]))
    allowed = list(PRESET_ORDERS[Order.DEFAULT if order == "explicit" else Order(order)])
    if family != "multinomial":
        allowed = [n for n in allowed if n not in ("temperature", "top_n_sigma", "top_k", "top_p", "min_p", "typical", "epsilon", "eta", "mirostat_v2")]
    names = draw(st.lists(st.sampled_from(allowed), max_size=5, unique=order != "explicit"))
    if order == "explicit":
        stateful = [n for n in names if n in ("constraint", "mirostat_v2")]
        assume(len(stateful) == len(set(stateful)))
    objs = [draw(transform(n, vocab)) for n in names]
    config = policy_config_from_json({"family": family, "order": order, "transforms": objs,
                                      "empty_support": draw(st.sampled_from(["raise", "fallback_eos"]))})
    prompt = draw(ids(vocab, 5))
    output = draw(ids(vocab, 6))
    view = RequestView(prompt_ids=prompt, output_ids=output, eos_ids=draw(ids(vocab, 2)), min_new_tokens=draw(st.integers(0, 8)),
                       identity=draw(st.text(max_size=8)), seed=draw(st.one_of(st.none(), st.integers(0, 2**32))))
    state = initial_policy_state(config)
    if state.mirostat_mu is not None:
        state = PolicyState(rng_counter=draw(st.integers(0, 5)), constraint_state=state.constraint_state, mirostat_mu=draw(st.floats(0.0, 12.0)))
    z = draw(rows(vocab))
    return z, config, state, view


def _scale(z: np.ndarray, config) -> float:
    """A bound on |processed logits|, for float32 error tolerances."""
    finite = np.abs(z[np.isfinite(z)])
    s = (float(finite.max()) if finite.size else 1.0) + 30.0
    for t in config.transforms:
        if t.name == "temperature" and t.get("temperature") > 0:
            s /= min(1.0, t.get("temperature"))
        if t.name == "repetition_penalty":
            s *= max(1.0, t.get("penalty"))
    return max(1.0, s)


def _both(fn_spec, fn_twin, tol: float, spec_margin):
    """Run both sides: they raise the same code or both return, except that an empty support
    reached through a near-boundary truncation (spec margin within ``tol``) may differ.

    Returns ``(spec_out, twin_out)``, or ``(None, None)`` when there is nothing more to compare.
    """
    try:
        spec_out = fn_spec()
    except Rejection as e:
        near = e.code == "policy.empty_support" and e.details.get("margin") is not None and e.details["margin"] <= tol
        try:
            fn_twin()
        except Rejection as t:
            assert t.code == e.code or near, (t, e)
            event(f"both rejected: {e.code}")
            return None, None
        assert near, f"spec raised {e}, twin did not"
        event("near-margin empty support")
        return None, None
    try:
        twin_out = fn_twin()
    except Rejection as t:
        assert t.code == "policy.empty_support" and spec_margin() <= tol, f"twin raised {t}, spec did not"
        event("near-margin empty support")
        return None, None
    return spec_out, twin_out


def _unpack(case):
    """``(z, config, state, view, tol, spec_row)``: the case, its float32 tolerance and the spec's processed row as a thunk."""
    z, config, state, view = case
    return z, config, state, view, 1e-5 * _scale(z, config), lambda: processed_row(ScoreRow.create(z.astype(np.float64)), config, state, view)


@pytest.mark.parametrize("device", DEVICES)
@given(case=cases())
def test_spec_and_torch_twin_agree_on_the_processed_row(device, case):
    """Processed support and probabilities agree within float32 error outside decision margins."""
    z, config, state, view, tol, spec_row = _unpack(case)
    spec_pr, twin_pr = _both(spec_row, lambda: twin.process_scores(torch.tensor(z, device=device), config, state, view), tol, lambda: spec_row().margin)
    if spec_pr is None:
        return
    note(f"margin={spec_pr.margin} tol={tol} trace={spec_pr.trace}")
    assert (spec_pr.selector, spec_pr.greedy_reason, spec_pr.normalization) == (twin_pr.selector, twin_pr.greedy_reason, twin_pr.normalization) or spec_pr.fallback_used
    assert spec_pr.kind is twin_pr.kind or spec_pr.fallback_used
    assert spec_pr.applied == twin_pr.applied
    assert spec_pr.fallback_used == twin_pr.fallback_rows[0]
    if spec_pr.margin <= tol:
        event("within float32 margin")
        return
    event("compared")
    assert np.array_equal(spec_pr.support_mask, twin_pr.support_mask[0].cpu().numpy())
    np.testing.assert_allclose(twin_pr.probs[0].double().cpu().numpy(), spec_pr.probs, atol=tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@given(case=cases())
def test_spec_and_torch_twin_select_the_same_token_for_the_same_draw(device, case):
    """decide: same id, draws, RNG address and counters, and next state outside float32 margins."""
    z, config, state, view, tol, spec_row = _unpack(case)
    spec_out, twin_out = _both(lambda: decide(ScoreRow.create(z.astype(np.float64)), config, state, view),
                               lambda: twin.decide(torch.tensor(z, device=device), config, state, view), tol, lambda: spec_row().margin)
    if spec_out is None:
        return
    (r_spec, s_spec), (r_twin, s_twin) = spec_out, twin_out
    assert (r_spec.draws, r_spec.rng, r_spec.selector, r_spec.greedy_reason) == (r_twin.draws, r_twin.rng, r_twin.selector, r_twin.greedy_reason)
    assert s_spec.rng_counter == s_twin.rng_counter == state.rng_counter + r_spec.draws
    pr = spec_row()
    if r_spec.draws:
        select_margin = multinomial(pr.probs, r_spec.rng.uniforms[0])[1]
    else:
        select_margin = greedy(pr.values)[1]
    note(f"margin={pr.margin} select_margin={select_margin} tol={tol}")
    if min(pr.margin, select_margin) <= tol:
        event("within float32 margin")
        return
    event(f"compared ({r_spec.selector})")
    assert r_spec.selected_id == r_twin.selected_id
    assert r_spec.support_size == r_twin.support_size
    assert s_spec.constraint_state == s_twin.constraint_state
    if s_spec.mirostat_mu is not None:
        assert s_twin.mirostat_mu == pytest.approx(s_spec.mirostat_mu, abs=1e-3)
    assert r_twin.raw_logprob == pytest.approx(r_spec.raw_logprob, abs=tol)
    assert r_twin.processed_logprob == pytest.approx(r_spec.processed_logprob, abs=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@given(case=cases(families=("beam",)), num_parents=st.integers(1, 3), data=st.data())
def test_spec_and_torch_twin_agree_on_beam_candidates(device, case, num_parents, data):
    """selector.beam: same parents and tokens for the joint grid outside float32 margins."""
    z, config, state, view = case
    beam_cfg = policy_config_from_json({**config.to_json(), "family": "beam", "num_beams": 2})
    zs = [z] + [data.draw(rows(len(z))) for _ in range(num_parents - 1)]
    # Running beam scores are sums of log-probabilities; they are drawn on a 1/16 grid so that a
    # score cannot be absorbed in float64 yet survive in float32 (e.g. -4e-8 + -6e-31), which
    # would turn a float64 exact tie into a float32 order.
    scores = data.draw(st.lists(st.integers(-320, 0).map(lambda i: i / 16), min_size=num_parents, max_size=num_parents))
    tol = 1e-5 * _scale(np.concatenate(zs), config)
    spec_rows = [ScoreRow.create(r.astype(np.float64)) for r in zs]
    spec_out, twin_out = _both(
        lambda: beam_candidates(spec_rows, scores, beam_cfg, [state] * num_parents, [view] * num_parents),
        lambda: twin.beam_candidates(torch.tensor(np.stack(zs), device=device), torch.tensor(scores, device=device), beam_cfg, [state] * num_parents, [view] * num_parents),
        tol, lambda: min(processed_row(r, beam_cfg, state, view).margin for r in spec_rows),
    )
    if spec_out is None:
        return
    _cand_scores, parents, tokens, _logprobs = twin_out
    grid = (np.asarray(scores)[:, None] + spec_out.logprobs).ravel()
    top = spec_out.scores[np.isfinite(spec_out.scores)]
    gaps = np.abs(np.diff(top))
    cut = np.abs(grid[np.isfinite(grid)] - top[-1]) if top.size else np.array([])
    assume(not ((gaps != 0) & (gaps <= tol)).any() and not ((cut != 0) & (cut <= tol)).any())
    event("compared")
    n = int(np.isfinite(spec_out.scores).sum())
    assert parents[:n].tolist() == spec_out.parents[:n].tolist() and tokens[:n].tolist() == spec_out.tokens[:n].tolist()


@given(case=cases(), data=st.data())
def test_twin_batch_rows_equal_the_rows_decided_alone(case, data):
    """The twin on ``[B, V]`` (whole-vocabulary sorts) equals B single-row calls (support-only sorts): no batch coupling."""
    z, config, state, view = case
    extra = [data.draw(rows(len(z))) for _ in range(2)]
    batch = np.stack([z, *extra])
    try:
        alone = [twin.process_scores(torch.tensor(r), config, state, view) for r in batch]
    except Rejection:
        return
    together = twin.process_scores(torch.tensor(batch), config, [state] * 3, [view] * 3)
    for b, single in enumerate(alone):
        assert torch.equal(together.support_mask[b], single.support_mask[0])
        torch.testing.assert_close(together.probs[b], single.probs[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["logits", "logprobs", "probs"])
def test_twin_and_spec_agree_on_every_declared_score_kind(kind):
    """policy.score_kind_mismatch and normalization: the twin treats each kind exactly as the spec does."""
    z = np.array([0.3, 2.0, -1.0, 1.9, -np.inf])
    values = {"logits": z, "logprobs": z - np.log(np.exp(z[np.isfinite(z)]).sum()), "probs": np.exp(z - np.log(np.exp(z[np.isfinite(z)]).sum()))}[kind]
    view = RequestView(prompt_ids=(1,), identity="kinds", seed=4)
    for config in (policy_config_from_json({"family": "multinomial"}), policy_config_from_json({"family": "greedy"}),
                   policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.5}]})):
        spec_row = ScoreRow.create(values, kind=kind)
        try:
            spec_receipt, _ = decide(spec_row, config, PolicyState(), view)
        except Rejection as e:
            with pytest.raises(Rejection) as info:
                twin.decide(torch.tensor(values, dtype=torch.float32), config, PolicyState(), view, kind=kind)
            assert info.value.code == e.code == "policy.score_kind_mismatch" and kind == "probs"
            continue
        twin_receipt, _ = twin.decide(torch.tensor(values, dtype=torch.float32), config, PolicyState(), view, kind=kind)
        assert (twin_receipt.selected_id, twin_receipt.normalization, twin_receipt.draws, twin_receipt.score_kind) == (
            spec_receipt.selected_id, spec_receipt.normalization, spec_receipt.draws, kind)
        assert twin_receipt.raw_logprob == pytest.approx(spec_receipt.raw_logprob, abs=1e-5)
