"""M3.8 0x0B-0x0F spec policy: worked examples, every transform and selector, errors, receipts.

Each test names the rule or error code it targets.  Peer-parity tests run HF transformers'
own logits processors on the same rows (they skip only when transformers is absent).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.errors import Rejection
from decodespec.spec.policy import (
    CATALOG,
    PolicyConfig,
    PolicyState,
    RequestView,
    ScoreKind,
    ScoreRow,
    beam_candidates,
    child_state,
    decide,
    initial_policy_state,
    policy_config_from_json,
    processed_row,
)
from decodespec.spec.policy.receipt import content_id, policy_digest
from decodespec.spec.policy.scores import softmax
from decodespec.spec.policy.selectors import ACCEPTS, DRAWS, beam_select, greedy, multinomial
from decodespec.spec.policy.transforms import TRANSFORMS
from decodespec.spec.rules import RULES

EMPTY_VIEW = RequestView(prompt_ids=())
EMPTY_STATE = PolicyState()


def spec_of(obj: dict):
    return policy_config_from_json({"family": "multinomial", "order": "explicit", "transforms": [obj]}).transforms[0]


def apply(obj: dict, z, view: RequestView = EMPTY_VIEW, state: PolicyState = EMPTY_STATE) -> np.ndarray:
    spec = spec_of(obj)
    return TRANSFORMS[spec.name](np.asarray(z, dtype=np.float64), spec, view, state).values


def sampling(*transforms, order="explicit", **extra) -> PolicyConfig:
    return policy_config_from_json({"family": "multinomial", "order": order, "transforms": list(transforms), **extra})


def row(values, kind=ScoreKind.LOGITS) -> ScoreRow:
    return ScoreRow.create(values, kind=kind, row_id="row", vocab_hash="vocab")


def kept(z) -> list[int]:
    return [int(i) for i in np.flatnonzero(np.isfinite(z))]


# ----------------------------------------------------------------------------------------
# M3.8 worked examples
# ----------------------------------------------------------------------------------------


def test_m38_full_pipeline_worked_example():
    """M3.8 0x0D 'One row through the full sampling pipeline': C forbidden, T=2, k=3, p=0.8 -> A 0.623, B 0.377.

    Rules: transform.constraint, transform.temperature, transform.top_k, transform.top_p.
    """
    legal = {"0": "s", "1": "s", "3": "s", "4": "s"}  # C (id 2) is forbidden
    config = sampling({"name": "constraint", "automaton": {"initial": "s", "transitions": {"s": legal}}},
                      {"name": "temperature", "temperature": 2.0}, {"name": "top_k", "k": 3}, {"name": "top_p", "p": 0.8})
    pr = processed_row(row([3.0, 2.0, 1.0, 0.0, -1.0]), config, initial_policy_state(config), EMPTY_VIEW)
    np.testing.assert_allclose(pr.probs[[0, 1]], [0.623, 0.377], atol=1e-3)
    # Exactly: sigmoid(0.5); the seed's 0.623 comes from renormalizing its rounded 0.547/0.878.
    assert pr.probs[0] == pytest.approx(1 / (1 + math.exp(-0.5)), rel=1e-12)
    assert pr.probs[2:].tolist() == [0.0, 0.0, 0.0]
    assert [s.name for s in pr.trace] == ["constraint", "temperature", "top_k", "top_p", "softmax"]
    assert [s.support_size for s in pr.trace] == [4, 4, 3, 2, 2]
    # Step 4 of the example: softmax over the top-k support is about A .547, B .331, D .122.
    after_k = apply({"name": "top_k", "k": 3}, [1.5, 1.0, -math.inf, 0.0, -0.5])
    np.testing.assert_allclose(softmax(after_k)[[0, 1, 3]], [0.547, 0.331, 0.122], atol=1e-3)


def test_m38_top_p_sorted_probabilities_example_keeps_three():
    """M3.8 0x0D: sorted probabilities [0.52, 0.25, 0.13, 0.06, 0.04] with p=0.8 keep three (transform.top_p)."""
    z = np.log([0.52, 0.25, 0.13, 0.06, 0.04])
    assert kept(apply({"name": "top_p", "p": 0.8}, z)) == [0, 1, 2]


# ----------------------------------------------------------------------------------------
# Legality transforms
# ----------------------------------------------------------------------------------------


def test_constraint_masks_to_the_legal_set_and_the_state_follows_the_emitted_token():
    """transform.constraint: A(s) = ids listed for s; s_{t+1} = delta(s_t, y_t) lives in the policy state."""
    automaton = {"initial": "a", "transitions": {"a": {"3": "b", "1": "a"}, "b": {"2": "a"}}}
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "constraint", "automaton": automaton}]})
    state = initial_policy_state(config)
    assert state.constraint_state == "a"
    z = [0.0, 1.0, 9.0, 2.0, 5.0]
    assert kept(apply({"name": "constraint", "automaton": automaton}, z, state=state)) == [1, 3]
    receipt, state = decide(row(z), config, state, EMPTY_VIEW)
    assert (receipt.selected_id, state.constraint_state) == (3, "b")
    receipt, state = decide(row(z), config, state, RequestView(prompt_ids=(), output_ids=(3,)))
    assert (receipt.selected_id, state.constraint_state) == (2, "a")
    assert receipt.state_before.constraint_state == "b" and receipt.state_after.constraint_state == "a"


def test_min_new_tokens_suppresses_every_eos_id_until_the_minimum():
    """transform.min_new_tokens: all EOS ids are -inf while |output| < min_new_tokens, none after."""
    z = [1.0, 2.0, 3.0, 4.0]
    before = RequestView(prompt_ids=(0,), output_ids=(1,), eos_ids=(2, 3), min_new_tokens=2)
    after = RequestView(prompt_ids=(0,), output_ids=(1, 1), eos_ids=(2, 3), min_new_tokens=2)
    assert kept(apply({"name": "min_new_tokens"}, z, before)) == [0, 1]
    assert kept(apply({"name": "min_new_tokens"}, z, after)) == [0, 1, 2, 3]


def test_bad_words_ban_the_last_token_when_the_history_ends_with_the_prefix():
    """transform.bad_words: sequence (w1..wm) bans wm iff the history ends with w1..w(m-1); single ids always."""
    obj = {"name": "bad_words", "sequences": [[5, 6, 7], [9], [1, 2]]}
    z = np.zeros(10)
    assert kept(apply(obj, z, RequestView(prompt_ids=(5,), output_ids=(6,)))) == [0, 1, 2, 3, 4, 5, 6, 8]
    assert kept(apply(obj, z, RequestView(prompt_ids=(6,), output_ids=(5,)))) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    # history "output" ignores the prompt (vLLM's bad words read output tokens only)
    obj_out = {**obj, "history": "output"}
    assert 7 in kept(apply(obj_out, z, RequestView(prompt_ids=(5,), output_ids=(6,))))
    assert 2 not in kept(apply(obj_out, z, RequestView(prompt_ids=(), output_ids=(1,))))


def test_no_repeat_ngram_bans_completions_of_a_seen_ngram():
    """transform.no_repeat_ngram: windows whose first n-1 tokens equal the history suffix ban their last token."""
    z = np.zeros(8)
    view = RequestView(prompt_ids=(1, 2, 3), output_ids=(1, 2))
    assert kept(apply({"name": "no_repeat_ngram", "n": 3}, z, view)) == [0, 1, 2, 4, 5, 6, 7]
    assert kept(apply({"name": "no_repeat_ngram", "n": 1}, z, view)) == [0, 4, 5, 6, 7]
    assert kept(apply({"name": "no_repeat_ngram", "n": 6}, z, view)) == list(range(8))


# ----------------------------------------------------------------------------------------
# Penalties and biases
# ----------------------------------------------------------------------------------------


def test_repetition_penalty_is_sign_aware():
    """transform.repetition_penalty: z/r for z > 0, z*r otherwise; unseen ids untouched (failure lab 0x12 item 41)."""
    z = [2.0, -2.0, 0.0, 3.0]
    out = apply({"name": "repetition_penalty", "penalty": 2.0}, z, RequestView(prompt_ids=(0, 1), output_ids=(2, 0)))
    assert out.tolist() == [1.0, -4.0, 0.0, 3.0]
    # The naive 'divide every logit' would move -2 toward zero and raise its probability.
    naive = np.array([1.0, -1.0, 0.0, 3.0])
    assert softmax(naive)[1] > softmax(np.array(z))[1] > softmax(out)[1]


@given(
    st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=2, max_size=12),
    st.floats(1.0, 3.0),
    st.data(),
)
def test_repetition_penalty_never_raises_a_penalized_logit_or_its_odds(values, penalty, data):
    """transform.repetition_penalty (failure lab 0x12 item 41): for r >= 1, z'_v <= z_v on penalized ids and
    p'_v / p'_u <= p_v / p_u against every unpenalized u; a lone penalized id never gains probability."""
    z = np.array(values)
    history = data.draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=5))
    out = apply({"name": "repetition_penalty", "penalty": penalty}, z, RequestView(prompt_ids=(), output_ids=history))
    seen = sorted(set(history))
    assert (out[seen] <= z[seen]).all()
    unseen = [i for i in range(len(z)) if i not in seen]
    assert (out[unseen] == z[unseen]).all()
    for v in seen:
        for u in unseen:
            assert out[v] - out[u] <= z[v] - z[u] + 1e-12
    if len(seen) == 1:
        assert softmax(out)[seen[0]] <= softmax(z)[seen[0]] + 1e-12


def test_frequency_and_presence_penalties_follow_the_openai_formulas():
    """transform.frequency_penalty, transform.presence_penalty: z - f*count and z - a*[count > 0] over output ids."""
    z = np.array([1.0, 1.0, 1.0, 1.0])
    view = RequestView(prompt_ids=(3, 3, 3), output_ids=(0, 0, 2))
    assert apply({"name": "frequency_penalty", "penalty": 0.5}, z, view).tolist() == [0.0, 1.0, 0.5, 1.0]
    assert apply({"name": "presence_penalty", "penalty": 0.5}, z, view).tolist() == [0.5, 1.0, 0.5, 1.0]


def test_logit_bias_multiplies_unnormalized_mass():
    """transform.logit_bias: z + b, so p'(v) is proportional to p(v) e^{b_v} (M3.8 0x0E)."""
    z = np.array([0.5, -1.0, 2.0])
    out = apply({"name": "logit_bias", "bias": {"1": 1.5, "2": -0.25}}, z)
    assert out.tolist() == [0.5, 0.5, 1.75]
    expected = softmax(z) * np.exp([0.0, 1.5, -0.25])
    np.testing.assert_allclose(softmax(out), expected / expected.sum(), rtol=1e-12)


# ----------------------------------------------------------------------------------------
# Warpers
# ----------------------------------------------------------------------------------------


def test_temperature_divides_and_zero_is_the_greedy_branch():
    """transform.temperature: z/T; T=0 branches to greedy with no division and no draw (failure lab 0x12 item 36)."""
    assert apply({"name": "temperature", "temperature": 0.5}, [1.0, -2.0]).tolist() == [2.0, -4.0]
    config = sampling({"name": "temperature", "temperature": 0.0}, {"name": "top_k", "k": 2}, {"name": "repetition_penalty", "penalty": 4.0})
    view = RequestView(prompt_ids=(2,), identity="req", seed=3)
    receipt, state = decide(row([0.0, 3.0, 4.0, 1.0]), config, initial_policy_state(config), view)
    # the repetition penalty (a processor) still runs after the branch: 4 -> 1, so id 1 wins
    assert (receipt.selected_id, receipt.selector, receipt.greedy_reason) == (1, "greedy", "temperature_zero")
    assert receipt.draws == 0 and state.rng_counter == 0 and receipt.rng.addresses == ()
    assert receipt.transforms == ("repetition_penalty",)


@given(st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=2, max_size=16, unique=True), st.integers(1, 16), st.floats(0.05, 20))
def test_positive_temperature_never_changes_top_k_membership(values, k, t):
    """transform.top_k with transform.temperature: positive T preserves rank, so the top-k support is the same (failure lab 0x12 item 37)."""
    z = np.array(values)
    top = kept(apply({"name": "top_k", "k": k}, z))
    assert kept(apply({"name": "top_k", "k": k}, apply({"name": "temperature", "temperature": t}, z))) == top


def test_top_k_keeps_exactly_k_with_ties_going_to_lower_ids():
    """transform.top_k tie rule lowest_id: under ties at the k-th value exactly k ids survive (failure lab 0x12 item 40)."""
    z = [1.0, 3.0, 2.0, 3.0, 2.0, 2.0]
    assert kept(apply({"name": "top_k", "k": 3}, z)) == [1, 2, 3]
    assert kept(apply({"name": "top_k", "k": 4}, z)) == [1, 2, 3, 4]
    assert kept(apply({"name": "top_k", "k": 1}, [5.0, 5.0, 5.0])) == [0]
    assert kept(apply({"name": "top_k", "k": 9}, z)) == list(range(6))


def test_top_p_keeps_the_crossing_token_and_returns_vocabulary_ids():
    """transform.top_p: the token that crosses p stays (item 38); removal is scattered back to ids, not sorted positions (item 39)."""
    probs = np.array([0.05, 0.30, 0.10, 0.40, 0.15])  # sorted order: 3, 1, 4, 2, 0
    out = apply({"name": "top_p", "p": 0.75}, np.log(probs))
    assert kept(out) == [1, 3, 4]  # 0.40 + 0.30 = 0.70 < 0.75, so 4 (0.15) crosses and stays
    kept_mass = probs[kept(out)].sum()
    assert kept_mass >= 0.75
    assert kept(apply({"name": "top_p", "p": 0.70}, np.log(probs))) == [1, 3]  # mass before id 4 is 0.70 >= p
    assert kept(apply({"name": "top_p", "p": 1.0}, np.log(probs))) == [0, 1, 2, 3, 4]
    # ties in probability go to lower ids
    assert kept(apply({"name": "top_p", "p": 0.3}, np.log([0.25, 0.25, 0.25, 0.25]))) == [0, 1]


def test_min_p_epsilon_eta_thresholds():
    """transform.min_p, transform.epsilon, transform.eta: probability floors; the most probable token always stays."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(probs)
    assert kept(apply({"name": "min_p", "p": 0.3}, z)) == [0, 1, 2]  # floor 0.15, inclusive
    assert kept(apply({"name": "min_p", "p": 0.0}, z)) == [0, 1, 2, 3]
    assert kept(apply({"name": "epsilon", "epsilon": 0.2}, z)) == [0, 1]
    assert kept(apply({"name": "epsilon", "epsilon": 0.9}, z)) == [0]
    entropy = -(probs * np.log(probs)).sum()
    eta = min(0.2, math.sqrt(0.2) * math.exp(-entropy))
    assert kept(apply({"name": "eta", "epsilon": 0.2}, z)) == [i for i, p in enumerate(probs) if p >= eta]


def test_typical_ranks_by_distance_from_the_entropy():
    """transform.typical: rank by |-log p - H|; the argmax need not rank first (M3.8 0x0D Locally typical support)."""
    probs = np.array([0.3] + [0.1] * 7)  # H = 1.97 nats; I(0) = 1.20, I(small) = 2.30
    z = np.log(probs)
    entropy = -(probs * np.log(probs)).sum()
    distance = np.abs(-np.log(probs) - entropy)
    assert np.argmin(distance) != 0
    # ranked 1..7 (ties to lower ids) then 0; mass before id 3 is 0.2 >= 0.15, so two stay
    assert kept(apply({"name": "typical", "p": 0.15}, z)) == [1, 2]
    assert kept(apply({"name": "typical", "p": 0.65}, z)) == [1, 2, 3, 4, 5, 6, 7]
    assert kept(apply({"name": "typical", "p": 0.75}, z)) == list(range(8))


@given(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=16), st.floats(0.1, 3.0), st.floats(0.1, 10.0))
def test_top_n_sigma_support_is_invariant_to_positive_temperature(values, n, t):
    """transform.top_n_sigma: keep z >= max - n*sigma; affine invariant under positive temperature (M3.8 0x0D)."""
    z = np.array(values)
    threshold = z.max() - n * z.std()
    assert kept(apply({"name": "top_n_sigma", "n": n}, z)) == [i for i in range(len(z)) if z[i] >= threshold]
    margin = np.min(np.abs(z - threshold))
    if margin > 1e-9 * max(1.0, np.abs(z).max()):
        assert kept(apply({"name": "top_n_sigma", "n": n}, z / t)) == kept(apply({"name": "top_n_sigma", "n": n}, z))


def test_mirostat_v2_truncates_by_mu_and_updates_the_controller_in_bits():
    """transform.mirostat_v2: keep -log2 p <= mu (at least one); mu starts at 2 tau and moves by -eta (surprise - tau)."""
    config = sampling({"name": "mirostat_v2", "tau": 1.0, "eta": 0.5})
    state = initial_policy_state(config)
    assert state.mirostat_mu == 2.0
    probs = np.array([0.5, 0.3, 0.15, 0.05])  # surprises 1.0, 1.74, 2.74, 4.32 bits
    assert kept(apply({"name": "mirostat_v2", "tau": 1.0, "eta": 0.5}, np.log(probs), state=state)) == [0, 1]
    assert kept(apply({"name": "mirostat_v2", "tau": 1.0, "eta": 0.5}, np.log(probs), state=PolicyState(mirostat_mu=0.1))) == [0]
    view = RequestView(prompt_ids=(), identity="a", seed=0)
    receipt, after = decide(row(np.log(probs)), config, state, view)
    q = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[receipt.selected_id]
    assert after.mirostat_mu == pytest.approx(2.0 - 0.5 * (-math.log2(q) - 1.0), rel=1e-12)
    assert receipt.processed_logprob == pytest.approx(math.log(q), rel=1e-12)


def test_mirostat_state_is_request_owned():
    """transform.mirostat_v2 (failure lab 0x12 item 61): mu lives in each request's PolicyState, never shared."""
    config = sampling({"name": "mirostat_v2", "tau": 2.0, "eta": 0.3})
    z = row(np.log([0.4, 0.3, 0.2, 0.1]))
    a = b = initial_policy_state(config)
    for step in range(5):
        _, a = decide(z, config, a, RequestView(prompt_ids=(), output_ids=(0,) * step, identity="A"))
    _, b1 = decide(z, config, b, RequestView(prompt_ids=(), identity="B"))
    _, b_again = decide(z, config, initial_policy_state(config), RequestView(prompt_ids=(), identity="B"))
    assert b1 == b_again and a.mirostat_mu != b.mirostat_mu


def test_every_catalog_transform_and_selector_is_a_registered_rule():
    """Rule registry: transform.<name> for every catalog entry; selector.greedy, selector.multinomial, selector.beam."""
    for name in CATALOG:
        assert RULES[f"transform.{name}"].obj is TRANSFORMS[name]
        assert RULES[f"transform.{name}"].statement
    for name in ("greedy", "multinomial", "beam"):
        assert RULES[f"selector.{name}"].kind == "selector"
    assert DRAWS == {"greedy": 0, "multinomial": 1, "beam": 0}


# ----------------------------------------------------------------------------------------
# Selectors
# ----------------------------------------------------------------------------------------


def test_greedy_lowest_id_on_ties_and_argmax_invariance_across_kinds():
    """selector.greedy: lowest id among maxima; same token from logits, logprobs and probs (M3.8 0x04)."""
    assert greedy(np.array([1.0, 4.0, 4.0, -math.inf]))[0] == 1
    z = np.array([0.3, 2.0, -1.0, 1.9])
    logprobs = z - np.log(np.exp(z).sum())
    config = PolicyConfig.greedy()
    ids = {decide(row(v, kind), config, PolicyState(), EMPTY_VIEW)[0].selected_id
           for v, kind in ((z, ScoreKind.LOGITS), (logprobs, ScoreKind.LOGPROBS), (np.exp(logprobs), ScoreKind.PROBS))}
    assert ids == {1}


def test_multinomial_is_inverse_cdf_in_id_order_and_never_sees_logits():
    """selector.multinomial: first id whose CDF exceeds u*total; accepts probabilities only (failure lab 0x12 items 13, 35)."""
    probs = np.array([0.2, 0.0, 0.5, 0.3])
    assert [multinomial(probs, u)[0] for u in (0.0, 0.19, 0.2, 0.69, 0.7, 0.9999)] == [0, 0, 2, 2, 3, 3]
    assert ACCEPTS["multinomial"] == frozenset({ScoreKind.PROBS})
    config = sampling({"name": "top_k", "k": 2})
    pr = processed_row(row([-1.0, 5.0, 4.0]), config, PolicyState(), EMPTY_VIEW)
    assert pr.kind is ScoreKind.PROBS and pr.normalization == "softmax" and (pr.values >= 0).all()


def test_multinomial_decision_consumes_exactly_one_addressed_draw():
    """selector.multinomial draw contract: one uniform at (step, 0); counter before/after in the receipt."""
    config = sampling({"name": "temperature", "temperature": 1.0})
    view = RequestView(prompt_ids=(1,), output_ids=(4, 4, 4), identity="req", seed=9)
    receipt, state = decide(row([0.0, 1.0, 2.0, 0.5, 0.1]), config, PolicyState(rng_counter=7), view)
    assert receipt.draws == 1 and receipt.rng.addresses == ((3, 0),)
    assert (receipt.rng.counter_before, receipt.rng.counter_after, state.rng_counter) == (7, 8, 8)


def test_beam_select_decodes_parent_and_token_from_the_flat_index():
    """selector.beam: parent = flat // V, token = flat % V (failure lab 0x12 item 44), beam scores added (item 43), ties to the lowest flat index."""
    logprobs = np.log(np.array([[0.1, 0.2, 0.3, 0.4, 0.0001], [0.5, 0.3, 0.1, 0.05, 0.05]]))
    scores, parents, tokens = beam_select(logprobs, np.array([-0.1, -2.0]), 3)
    flat = (np.array([-0.1, -2.0])[:, None] + logprobs).ravel()
    order = np.argsort(-flat, kind="stable")[:3]
    assert parents.tolist() == (order // 5).tolist() and tokens.tolist() == (order % 5).tolist()
    assert (parents.tolist(), tokens.tolist()) == ([0, 0, 0], [3, 2, 1])
    assert scores.tolist() == flat[order].tolist()
    # ties: identical parents, so every candidate pair ties; lowest flat index wins
    _, p, t = beam_select(np.zeros((2, 3)), np.zeros(2), 4)
    assert (p.tolist(), t.tolist()) == ([0, 0, 0, 1], [0, 1, 2, 0])


def test_beam_candidates_first_step_activates_one_parent():
    """selector.beam (failure lab 0x12 item 46): with duplicate initial parents at -inf, candidates come from parent 0 only."""
    config = policy_config_from_json({"family": "beam", "num_beams": 2})
    rows = [row([1.0, 2.0, 3.0, 0.0])] * 2
    out = beam_candidates(rows, [0.0, -math.inf], config, [PolicyState()] * 2, [EMPTY_VIEW] * 2)
    assert out.parents.tolist() == [0, 0, 0, 0] and out.tokens.tolist() == [2, 1, 0, 3]
    np.testing.assert_allclose(np.exp(out.logprobs).sum(axis=1), [1.0, 1.0])
    assert child_state(config, PolicyState(), 2) == PolicyState()


# ----------------------------------------------------------------------------------------
# Errors and the empty-support policy
# ----------------------------------------------------------------------------------------


def test_nan_and_infinite_rows_are_typed_errors():
    """policy.nan_scores, policy.infinite_scores: never sampled; a transform overflow is caught too."""
    with pytest.raises(Rejection) as info:
        ScoreRow.create([0.0, math.nan])
    assert info.value.code == "policy.nan_scores"
    with pytest.raises(Rejection) as info:
        ScoreRow.create([0.0, math.inf])
    assert info.value.code == "policy.infinite_scores"
    config = sampling({"name": "temperature", "temperature": 1e-300})
    with pytest.raises(Rejection) as info:
        decide(row([1e10, 0.0]), config, PolicyState(), EMPTY_VIEW)
    assert (info.value.code, info.value.path) == ("policy.infinite_scores", "$.policy.transforms[0]")


def test_malformed_rows_are_rejected():
    """policy.invalid_row: shape and kind consistency."""
    for values, kind in (([], "logits"), ([[1.0]], "logits"), ([0.5, 0.6], "probs"), ([0.0, 0.0], "logprobs"), ([1.0], "scores")):
        with pytest.raises(Rejection) as info:
            ScoreRow.create(values, kind=kind)
        assert info.value.code == "policy.invalid_row"


def test_directly_built_rows_are_checked_like_create():
    """policy.invalid_row: a ScoreRow built without ``create`` (2-D values, positive log-probabilities)
    is refused typed at construction, so ``decide`` never sees it (no raw IndexError)."""
    for values, kind in (([[0.0, 1.0]], ScoreKind.LOGITS), ([0.5, -0.2], ScoreKind.LOGPROBS), ([1.0], "scores")):
        with pytest.raises(Rejection) as info:
            ScoreRow(kind=kind, values=values, vocab_hash="", row_id="")
        assert info.value.code == "policy.invalid_row"
    with pytest.raises(Rejection) as info:
        ScoreRow.create([0.5, -0.2], kind="logprobs")
    assert info.value.message.startswith("a log-probability row has values <= 0; index 0")


def test_score_kind_mismatch_is_never_a_silent_conversion():
    """policy.score_kind_mismatch: a logit warper over probabilities, a beam over probabilities (failure lab 0x12 item 10)."""
    probs = row([0.25, 0.75], ScoreKind.PROBS)
    with pytest.raises(Rejection) as info:
        decide(probs, sampling({"name": "temperature", "temperature": 0.5}), PolicyState(), EMPTY_VIEW)
    assert (info.value.code, info.value.path) == ("policy.score_kind_mismatch", "$.policy.transforms[0]")
    with pytest.raises(Rejection) as info:
        beam_candidates([probs], [0.0], policy_config_from_json({"family": "beam"}), [PolicyState()], [EMPTY_VIEW])
    assert info.value.code == "policy.score_kind_mismatch"
    # a probability row with no transforms goes to the multinomial selector as is
    receipt, _ = decide(probs, sampling(), PolicyState(), RequestView(prompt_ids=(), identity="x"))
    assert receipt.normalization is None and receipt.raw_logprob == pytest.approx(math.log(probs.values[receipt.selected_id]))


def test_empty_support_raises_and_never_restores_the_raw_row():
    """policy.empty_support (failure lab 0x12 item 42): all legal tokens removed by an earlier truncation."""
    automaton = {"initial": "s", "transitions": {"s": {"0": "s", "3": "s"}}}
    # explicit order: top-k before the grammar mask empties the support
    config = sampling({"name": "top_k", "k": 2}, {"name": "constraint", "automaton": automaton})
    with pytest.raises(Rejection) as info:
        decide(row([0.0, 5.0, 4.0, 1.0]), config, initial_policy_state(config), EMPTY_VIEW)
    assert info.value.code == "policy.empty_support"
    assert info.value.details["trace"] == ["top_k", "constraint"]
    # the default order puts legality first, so the same policy is fine
    default = sampling({"name": "top_k", "k": 2}, {"name": "constraint", "automaton": automaton}, order="default")
    receipt, _ = decide(row([0.0, 5.0, 4.0, 1.0]), default, initial_policy_state(default), RequestView(prompt_ids=(), identity="r"))
    assert receipt.selected_id in (0, 3)


def test_fallback_eos_only_when_eos_is_legal():
    """policy.empty_support with empty_support=fallback_eos: force the lowest legal EOS id, no draw; raise if EOS is illegal."""
    automaton = {"initial": "s", "transitions": {"s": {"0": "s", "2": "s", "3": "s"}}}
    config = sampling({"name": "top_k", "k": 1}, {"name": "constraint", "automaton": automaton}, empty_support="fallback_eos")
    view = RequestView(prompt_ids=(), eos_ids=(3, 2), identity="r")
    receipt, state = decide(row([0.0, 5.0, 1.0, 1.0]), config, initial_policy_state(config), view)
    assert (receipt.selected_id, receipt.fallback_used, receipt.greedy_reason, receipt.draws) == (2, True, "fallback_eos", 0)
    assert state.rng_counter == 0 and receipt.processed_logprob == 0.0 and receipt.support_size == 1
    illegal = RequestView(prompt_ids=(), eos_ids=(1,), identity="r")
    with pytest.raises(Rejection) as info:
        decide(row([0.0, 5.0, 1.0, 1.0]), config, initial_policy_state(config), illegal)
    assert info.value.code == "policy.empty_support"
    suppressed = RequestView(prompt_ids=(), eos_ids=(2,), min_new_tokens=1, identity="r")
    config_min = sampling({"name": "min_new_tokens"}, {"name": "top_k", "k": 1}, {"name": "constraint", "automaton": automaton}, empty_support="fallback_eos")
    with pytest.raises(Rejection):
        decide(row([0.0, 5.0, 1.0, 1.0]), config_min, initial_policy_state(config_min), suppressed)


def test_out_of_range_ids_bad_views_states_and_families():
    """policy.token_out_of_range, policy.invalid_view, policy.invalid_state, policy.family_mismatch."""
    with pytest.raises(Rejection) as info:
        decide(row([0.0, 1.0]), sampling({"name": "logit_bias", "bias": {"5": 1.0}}), PolicyState(), EMPTY_VIEW)
    assert (info.value.code, info.value.path) == ("policy.token_out_of_range", "$.policy.transforms[0]")
    with pytest.raises(Rejection) as info:
        decide(row([0.0, 1.0]), PolicyConfig.greedy(), PolicyState(), RequestView(prompt_ids=(7,)))
    assert info.value.code == "policy.token_out_of_range"
    for kwargs in ({"prompt_ids": (-1,)}, {"prompt_ids": (1.5,)}, {"prompt_ids": (), "step": -1}, {"prompt_ids": (), "min_new_tokens": -2}, {"prompt_ids": (), "seed": -3}, {"prompt_ids": (), "seed": 2**53}):
        with pytest.raises(Rejection) as info:
            RequestView(**kwargs)
        assert info.value.code == "policy.invalid_view"
    config = sampling({"name": "mirostat_v2", "tau": 3.0, "eta": 0.1})
    for state in (PolicyState(), PolicyState(rng_counter=-1, mirostat_mu=6.0), PolicyState(constraint_state="x", mirostat_mu=6.0)):
        with pytest.raises(Rejection) as info:
            decide(row([0.0, 1.0]), config, state, EMPTY_VIEW)
        assert info.value.code == "policy.invalid_state"
    with pytest.raises(Rejection) as info:
        decide(row([0.0, 1.0]), policy_config_from_json({"family": "beam"}), PolicyState(), EMPTY_VIEW)
    assert info.value.code == "policy.family_mismatch"
    with pytest.raises(Rejection) as info:
        beam_candidates([row([0.0, 1.0])], [0.0], PolicyConfig.greedy(), [PolicyState()], [EMPTY_VIEW])
    assert info.value.code == "policy.family_mismatch"


# ----------------------------------------------------------------------------------------
# Receipts and orders
# ----------------------------------------------------------------------------------------


def test_receipt_is_json_with_a_content_hash_id():
    """DecisionReceipt: JSON-serialisable, id = sha256 of the canonical body, any change changes the id."""
    config = sampling({"name": "top_p", "p": 0.9}, {"name": "temperature", "temperature": 0.7}, order="hf")
    view = RequestView(prompt_ids=(1, 2), identity="req-1", seed=5)
    receipt, _ = decide(row([0.1, 0.5, 2.0, -1.0]), config, PolicyState(), view)
    body = json.loads(json.dumps(receipt.to_json()))
    assert body["receipt_id"] == receipt.receipt_id and body["receipt_id"].startswith("sha256:")
    assert body["preset"] == "hf" and body["transforms"] == ["temperature", "top_p"]
    # The receipt names its policy by digest (bounded size) instead of embedding the parameters.
    assert body["policy_digest"] == policy_digest(config) == content_id(config.to_json())
    assert policy_digest(sampling({"name": "top_p", "p": 0.8}, order="hf")) != body["policy_digest"]
    assert body["tie_rule"] == "lowest_id" and body["vocab_hash"] == "vocab" and body["score_id"] == "row"
    assert body["raw_logprob"] == pytest.approx(float(np.log(softmax(np.array([0.1, 0.5, 2.0, -1.0])))[receipt.selected_id]))
    again, _ = decide(row([0.1, 0.5, 2.0, -1.0]), config, PolicyState(), view)
    assert again == receipt
    other, _ = decide(row([0.1, 0.5, 2.0, -1.0]), config, PolicyState(), RequestView(prompt_ids=(1, 2), identity="req-1", seed=6))
    assert other.receipt_id != receipt.receipt_id


def test_the_same_row_under_different_peer_orders_gives_different_distributions():
    """M3.8 0x0B 'Most policy transforms do not commute': HF (temperature first) vs llama.cpp (temperature last) with top-p."""
    transforms = ({"name": "temperature", "temperature": 3.0}, {"name": "top_p", "p": 0.7})
    z = row([2.0, 1.0, 0.0, -1.0])
    hf = processed_row(z, sampling(*transforms, order="hf"), PolicyState(), EMPTY_VIEW)
    llama = processed_row(z, sampling(*transforms, order="llama.cpp"), PolicyState(), EMPTY_VIEW)
    assert hf.support_size == 3 and llama.support_size == 2
