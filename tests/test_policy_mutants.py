"""Fixed-row checks of the torch policy twin (impl/policy.py) that kill Cosmic Ray's survivors.

The property tests of ``tests/test_policy_twin.py`` compare the twin with the spec policy on
drawn rows; a mutant of ``impl/policy.py`` that survived them (docs/results/mutation.md, the
``impl/policy.py`` section) lives in a branch those draws rarely reach or leaves a value they do
not compare.  Each check here runs the twin and the spec (``decodespec.spec.policy``, the
independent float64 reference) on fixed rows with wide decision margins, or asserts a value
derived by hand, and its docstring names the mutants it kills (line, operator, occurrence).

Rules: every ``transform.*``, ``selector.greedy``, ``selector.multinomial``, ``selector.beam``,
``policy.empty_support``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decodespec.impl import policy as twin
from decodespec.spec.policy import (
    PolicyState,
    RequestView,
    ScoreRow,
    beam_candidates,
    decide,
    initial_policy_state,
    policy_config_from_json,
    processed_row,
)
from decodespec.spec.policy.selectors import multinomial

# Distinct logits in no particular id order, and a row with ties, a -inf and negative values.
Z = np.array([0.3, 2.0, -0.9, 1.2, -4.0, 1.5, -0.2, 0.7, -2.5, -1.5], dtype=np.float32)
Z_TIES = np.array([1.0, 2.0, 2.0, -0.5, 2.0, -1.0, 0.5, -np.inf, 0.0, 1.0], dtype=np.float32)
ROWS = {"distinct": Z, "ties": Z_TIES}
VIEW = RequestView(prompt_ids=(0, 3), output_ids=(3, 5, 3, 1, 3), eos_ids=(9,), min_new_tokens=7, identity="mutants", seed=5)
AUTOMATON = {"initial": "s0", "transitions": {"s0": {"1": "s1", "3": "s0", "5": "s1", "6": "s0"}, "s1": {"0": "s0", "2": "s1"}}}

TRANSFORMS = {
    "constraint": [{"name": "constraint", "automaton": AUTOMATON}],
    "min_new_tokens": [{"name": "min_new_tokens"}],
    "bad_words": [{"name": "bad_words", "sequences": [[3, 1, 2], [5, 7], [4], [1, 3, 8]], "history": "prompt_and_output"}],
    "bad_words_output": [{"name": "bad_words", "sequences": [[0, 3, 6], [3, 9]], "history": "output"}],
    "no_repeat_ngram_2": [{"name": "no_repeat_ngram", "n": 2, "history": "prompt_and_output"}],
    "no_repeat_ngram_3": [{"name": "no_repeat_ngram", "n": 3, "history": "output"}],
    "repetition_penalty": [{"name": "repetition_penalty", "penalty": 1.7, "history": "prompt_and_output"}],
    "repetition_penalty_below_one": [{"name": "repetition_penalty", "penalty": 0.6, "history": "output"}],
    "frequency_penalty": [{"name": "frequency_penalty", "penalty": 0.4}],
    "presence_penalty": [{"name": "presence_penalty", "penalty": -0.6}],
    "logit_bias": [{"name": "logit_bias", "bias": {"2": 1.5, "7": -3.0, "0": 0.25}}],
    "temperature": [{"name": "temperature", "temperature": 0.7}],
    "top_k": [{"name": "top_k", "k": 3}],
    "top_k_all": [{"name": "top_k", "k": 10}],
    "top_k_past_v": [{"name": "top_k", "k": 12}],
    "top_k_ties": [{"name": "top_k", "k": 4}],
    "top_k_2": [{"name": "top_k", "k": 2}],
    "top_p": [{"name": "top_p", "p": 0.6}],
    "min_p": [{"name": "min_p", "p": 0.15}],
    "min_p_zero": [{"name": "min_p", "p": 0.0}],
    "typical": [{"name": "typical", "p": 0.5}],
    "epsilon": [{"name": "epsilon", "epsilon": 0.05}],
    "eta": [{"name": "eta", "epsilon": 0.08}],
    "top_n_sigma": [{"name": "top_n_sigma", "n": 1.0}],
    "mirostat_v2": [{"name": "mirostat_v2", "tau": 2.0, "eta": 0.3}],
    "chain": [{"name": "repetition_penalty", "penalty": 1.3, "history": "output"}, {"name": "temperature", "temperature": 1.4},
              {"name": "top_k", "k": 6}, {"name": "top_p", "p": 0.9}, {"name": "min_p", "p": 0.05}],
}


def _config(name: str, family: str = "multinomial", **extra):
    return policy_config_from_json({"family": family, "order": "explicit", "transforms": TRANSFORMS[name], **extra})


def _spec_row(z: np.ndarray) -> ScoreRow:
    return ScoreRow.create(z.astype(np.float64))


def _same_processed(spec_pr, twin_pr, b: int = 0) -> None:
    assert spec_pr.margin > 1e-3, "the fixture must stay clear of float32 decision boundaries"
    assert np.array_equal(spec_pr.support_mask, twin_pr.support_mask[b].numpy())
    np.testing.assert_allclose(twin_pr.probs[b].double().numpy(), spec_pr.probs, atol=1e-6, rtol=0)
    finite = np.isfinite(spec_pr.values)
    assert np.array_equal(finite, torch.isfinite(twin_pr.values[b]).numpy())
    np.testing.assert_allclose(twin_pr.values[b].double().numpy()[finite], spec_pr.values[finite], atol=1e-5, rtol=1e-5)
    assert (twin_pr.kind, twin_pr.applied, twin_pr.normalization, twin_pr.selector, twin_pr.greedy_reason) == (
        spec_pr.kind, spec_pr.applied, spec_pr.normalization, spec_pr.selector, spec_pr.greedy_reason)
    assert twin_pr.fallback_rows[b] is spec_pr.fallback_used is False


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_each_transform_on_fixed_rows_equals_the_spec(name, row):
    """Every transform on two fixed rows: support, probabilities and values equal the spec's.

    Kills mutants of the transforms whose effect the drawn rows rarely show (the 25-example
    screen), listed in docs/results/mutation.md.
    """
    config = _config(name)
    state = initial_policy_state(config)
    spec_pr = processed_row(_spec_row(ROWS[row]), config, state, VIEW)
    twin_pr = twin.process_scores(torch.tensor(ROWS[row]), config, state, VIEW)
    _same_processed(spec_pr, twin_pr)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_each_transform_on_a_batch_equals_the_spec_row_by_row(name):
    """The ``[B, V]`` path (whole-vocabulary sorts, per-row masks) equals the spec on each row."""
    config = _config(name)
    state = initial_policy_state(config)
    views = [VIEW, RequestView(prompt_ids=(2,), output_ids=(6, 6, 0), eos_ids=(4,), identity="other", seed=1), VIEW]
    batch = np.stack([Z, Z_TIES, Z[::-1].copy()])
    twin_pr = twin.process_scores(torch.tensor(batch), config, [state] * 3, views)
    for b in range(3):
        _same_processed(processed_row(_spec_row(batch[b]), config, state, views[b]), twin_pr, b)


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("name", TRANSFORMS)
def test_each_transform_decides_as_the_spec(name, row):
    """decide: the selected id, raw and processed log-probabilities, draws and next state equal the spec's."""
    config = _config(name)
    state = initial_policy_state(config)
    r_spec, s_spec = decide(_spec_row(ROWS[row]), config, state, VIEW)
    r_twin, s_twin = twin.decide(torch.tensor(ROWS[row]), config, state, VIEW)
    assert (r_twin.selected_id, r_twin.draws, r_twin.rng, r_twin.support_size) == (r_spec.selected_id, r_spec.draws, r_spec.rng, r_spec.support_size)
    assert (r_twin.selector, r_twin.greedy_reason, r_twin.normalization, r_twin.fallback_used) == (
        r_spec.selector, r_spec.greedy_reason, r_spec.normalization, r_spec.fallback_used)
    assert r_twin.raw_logprob == pytest.approx(r_spec.raw_logprob, abs=1e-5)
    assert r_twin.processed_logprob == pytest.approx(r_spec.processed_logprob, abs=1e-5)
    assert (s_twin.rng_counter, s_twin.constraint_state) == (s_spec.rng_counter, s_spec.constraint_state)
    if s_spec.mirostat_mu is None:
        assert s_twin.mirostat_mu is None
    else:
        assert s_twin.mirostat_mu == pytest.approx(s_spec.mirostat_mu, abs=1e-5)


@pytest.mark.parametrize("output", [(5,), (2, 5), (5, 7, 5)])
def test_bad_words_bans_after_a_history_as_short_as_the_prefix(output):
    """A sequence of even length n bans its last id once the history holds its n - 1 prefix ids.

    Kills line 137 ``len(seq) - 1 <= len(h)`` -> ``len(seq) ^ 1 <= len(h)`` (for even n,
    ``n ^ 1 = n + 1``: the ban would wait for n + 1 history ids).
    """
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "bad_words", "sequences": [[5, 7], [0, 2, 5, 1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), output_ids=output)
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), view)
    assert pr.support_mask[0].tolist() == [i != 7 for i in range(10)]
    assert processed_row(_spec_row(Z), config, PolicyState(), view).support_mask.tolist() == pr.support_mask[0].tolist()


def test_top_k_keeps_the_lowest_ids_among_ties_at_the_kth_value():
    """k = 4 on [1, 2, 2, -0.5, 2, -1, 0.5, -inf, 0, 1]: the three 2s are above, one of the two 1s is kept (id 0, not id 9).

    Kills line 213 ``room = k - above`` -> ``k | above`` (room 7 keeps both 1s) and the other
    replacements of that ``-`` that enlarge the room.
    """
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_k", "k": 4}]})
    pr = twin.process_scores(torch.tensor(Z_TIES), config, PolicyState(), VIEW)
    assert pr.support_mask[0].nonzero().squeeze(-1).tolist() == [0, 1, 2, 4]


def test_temperature_zero_skips_warpers_but_runs_the_transforms_after_them():
    """Explicit order [temperature 0, top_k 1, logit_bias, min_p]: the greedy branch skips the warpers and still applies the bias.

    Kills line 406 ``continue`` -> ``break`` (the bias after a skipped warper would be dropped).
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "transforms": [
        {"name": "temperature", "temperature": 0.0}, {"name": "top_k", "k": 1}, {"name": "logit_bias", "bias": {"4": 9.0}}, {"name": "min_p", "p": 0.5}]})
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW)
    assert [t.name for t in pr.applied] == ["logit_bias"] and pr.greedy_reason == "temperature_zero"
    receipt, _ = twin.decide(torch.tensor(Z), config, PolicyState(), VIEW)
    assert receipt.selected_id == 4 and receipt.draws == 0 and receipt.support_size == 10


def test_decide_takes_one_row_as_v_or_1_by_v_and_refuses_a_batch():
    """decide on ``[1, V]`` equals decide on ``[V]``; ``[2, V]`` is ``policy.invalid_row``.

    Kills line 535 ``scores.shape[0] == 1`` -> ``!= 1`` (refuses ``[1, V]``, flattens ``[2, V]``
    into one row of 2V).
    """
    from decodespec.spec.errors import Rejection

    config = policy_config_from_json({"family": "multinomial"})
    flat, _ = twin.decide(torch.tensor(Z), config, PolicyState(), VIEW)
    one, _ = twin.decide(torch.tensor(Z).unsqueeze(0), config, PolicyState(), VIEW)
    assert (one.selected_id, one.vocab_size, one.rng) == (flat.selected_id, 10, flat.rng)
    with pytest.raises(Rejection) as info:
        twin.decide(torch.tensor(np.stack([Z, Z])), config, PolicyState(), VIEW)
    assert info.value.code == "policy.invalid_row"


def test_a_probability_row_must_sum_to_one():
    """kind probs: a row of probabilities in [0, 1] summing to 2 is ``policy.invalid_row``; one summing to 1 - 5e-5 is accepted.

    Kills line 332 ``(sum - 1).abs() > 1e-4`` -> ``(sum % 1)`` (a sum of 2 passes, a sum just
    under 1 fails) and the other replacements of that ``-``.
    """
    from decodespec.spec.errors import Rejection

    config = policy_config_from_json({"family": "greedy"})
    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.tensor([0.5, 0.5, 0.5, 0.5]), config, PolicyState(), RequestView(prompt_ids=()), kind="probs")
    assert info.value.code == "policy.invalid_row"
    under = twin.process_scores(torch.tensor([0.25, 0.25, 0.25, 0.25 - 5e-5]), config, PolicyState(), RequestView(prompt_ids=()), kind="probs")
    assert under.support_mask[0].tolist() == [True] * 4


def test_decide_refuses_a_scalar():
    """A 0-d score tensor is not a row: ``policy.invalid_row``.

    Kills line 535 ``scores.ndim == 1`` -> ``scores.ndim <= 1`` (the scalar would be decided as a
    one-token vocabulary).
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.decide(torch.tensor(1.5), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()))
    assert info.value.code == "policy.invalid_row"


def test_a_token_exactly_at_the_epsilon_floor_is_kept():
    """epsilon keeps ``p >= epsilon``: a token whose log-probability equals ``log epsilon`` stays.

    The row is [log 2, 0, 0, -3]: p ~ [0.49, 0.25, 0.25, 0.012].  The twin takes log-probabilities
    in float64 (stop 30), so epsilon is the double next to ``exp(logp[1])`` whose ``log`` is exactly
    the twin's float64 ``logp[1]`` (asserted).  Kills line 246 ``logp >= log_floor`` -> ``logp >
    log_floor`` (ids 1 and 2 would be dropped).
    """
    z = torch.tensor([[math.log(2.0), 0.0, 0.0, -3.0]])
    logp = torch.log_softmax(z.double(), dim=-1)[0]
    target = float(logp[1])
    eps = next(e for e in (math.exp(target), *(math.exp(target) + k * math.ulp(math.exp(target)) for k in (-1, 1, -2, 2, -3, 3)))
               if math.log(e) == target)
    assert math.log(eps) == float(logp[1]) == float(logp[2])
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "epsilon", "epsilon": eps}]})
    pr = twin.process_scores(z, config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, True, True, False]


def test_processed_rows_compare_by_identity():
    """TorchProcessed holds tensors, which have no single truth value: results compare by identity, never elementwise.

    Kills line 289 ``attrs.frozen(eq=False)`` -> ``eq=True`` (comparing two results would raise
    ``RuntimeError: Boolean value of Tensor ... is ambiguous``).
    """
    config = policy_config_from_json({"family": "multinomial"})
    a = twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW)
    b = twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW)
    assert a != b and (a == b) is False and len({a, b}) == 2


def test_the_support_of_a_probability_row_leaves_out_zero_probabilities():
    """kind probs, greedy: the receipt's support size counts the positive probabilities only (3 of 5).

    Kills line 422 ``z > 0`` -> ``z > -1`` (every id of a probability row would be in the support).
    """
    receipt, _ = twin.decide(torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25]), policy_config_from_json({"family": "greedy"}), PolicyState(),
                             RequestView(prompt_ids=()), kind="probs")
    assert (receipt.support_size, receipt.selected_id) == (3, 1)


def test_fallback_eos_forces_the_lowest_legal_eos_id():
    """Explicit [top_k 1, bad_words [[1]]] empties the row (top_k keeps only id 1, bad_words bans it); EOS ids {9, 4} are legal, 4 is forced.

    Kills line 445 ``out[b, eos[0]]`` -> ``eos[1]`` (id 9) and ``eos[-1]``.
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "empty_support": "fallback_eos",
                                      "transforms": [{"name": "top_k", "k": 1}, {"name": "bad_words", "sequences": [[1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), eos_ids=(9, 4))
    receipt, _ = twin.decide(torch.tensor(Z), config, PolicyState(), view)
    spec_receipt, _ = decide(_spec_row(Z), config, PolicyState(), view)
    assert (receipt.selected_id, receipt.fallback_used, receipt.draws) == (spec_receipt.selected_id, True, 0) == (4, True, 0)


def test_multinomial_select_scales_the_uniform_by_the_total_mass():
    """Unnormalized probabilities [1, 1, 2] (total 4): u = 0.3 targets 1.2 (id 1), u = 0.6 targets 2.4 (id 2), u = 0.1 id 0.

    Kills line 476 ``u * cdf[:, -1]`` -> ``u / cdf[:, -1]`` (targets 0.075, 0.15, 0.025: id 0 for all)
    and the other replacements of that ``*``.
    """
    probs = torch.tensor([[1.0, 1.0, 2.0]]).expand(3, -1)
    assert twin.multinomial_select(probs, torch.tensor([0.3, 0.6, 0.1], dtype=torch.float64)).tolist() == [1, 2, 0]


def test_top_p_one_keeps_a_tail_that_float32_mass_rounds_away():
    """top_p p = 1 is the identity: [0, -30, -40, -inf] keeps ids 0, 1, 2 although float32 ``softmax`` puts 1.0 on id 0.

    Kills line 221 ``if p >= 1.0`` -> ``p > 1.0`` (the prefix rule ``mass before < 1`` would drop ids
    1 and 2, whose mass before is 1.0 in float32).
    """
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_p", "p": 1.0}]})
    pr = twin.process_scores(torch.tensor([0.0, -30.0, -40.0, -math.inf]), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, True, True, False]


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name", ["top_p", "typical"])
def test_ranked_truncation_breaks_ties_by_lowest_id_past_16_ties(name, rows):
    """24 equal logits: top_p / typical with p = 0.3 keep the 8 lowest ids (8 * 1/24 = 0.33 is the crossing mass).

    torch's CPU sort is stable only up to 16 elements unless asked to be.  Kills line 102 (one
    row, support-only sort) and line 103 (several rows) ``stable=True`` -> ``stable=False``.
    """
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": name, "p": 0.3}]})
    z = torch.zeros(rows, 24)
    pr = twin.process_scores(z, config, [PolicyState()] * rows, [RequestView(prompt_ids=())] * rows)
    for b in range(rows):
        assert pr.support_mask[b].nonzero().squeeze(-1).tolist() == list(range(8))


def test_beam_candidates_break_ties_by_lowest_flat_index_past_16_ties():
    """A [1, 2, 12] grid of equal log-probabilities: the 6 best candidates are flat indices 0..5 (parent 0, tokens 0..5).

    Kills line 85 ``stable=True`` -> ``stable=False`` in ``_stable_desc`` (torch's CPU sort is
    stable only up to 16 elements unless asked to be).
    """
    scores, parents, tokens = twin.select_beam_candidates(torch.zeros(1, 2, 12), torch.zeros(1, 2), 6)
    assert (parents[0].tolist(), tokens[0].tolist(), scores[0].tolist()) == ([0] * 6, list(range(6)), [0.0] * 6)


def test_beam_candidates_default_to_twice_the_beam_count():
    """num_beams = 3, K = 2 parents, V = 10: 2 * 3 = 6 candidates by default (HF), capped at K * V = 20.

    Kills line 631 ``2 * config.num_beams`` -> ``2 + config.num_beams`` (5) and the other
    replacements of that ``*``.
    """
    config = policy_config_from_json({"family": "beam", "num_beams": 3})
    cand, parents, tokens, logprobs = twin.beam_candidates(torch.tensor(np.stack([Z, Z[::-1].copy()])), torch.tensor([0.0, -1.0]), config,
                                                            [PolicyState()] * 2, [VIEW] * 2)
    assert len(cand) == len(parents) == len(tokens) == 6 and logprobs.shape == (2, 10)


def test_min_p_keeps_a_token_exactly_at_alpha_times_the_top_probability():
    """min_p bans ``p < alpha p_max`` only: with alpha = 1/4 the logit ``float32(log 1/4)`` against a top logit 0 stays.

    Kills line 232 ``z < z_max + log(alpha)`` -> ``<=`` (the token at the bound would be banned).
    """
    at = float(np.float32(math.log(0.25)))
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "min_p", "p": 0.25}]})
    pr = twin.process_scores(torch.tensor([0.0, at, at - 1e-3, -5.0]), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, True, False, False]


def test_fallback_in_a_batch_leaves_the_other_rows_as_the_spec_processes_them():
    """Two rows under explicit [top_k 1, bad_words [[1]]] with fallback_eos: row 0's top id is 1 (emptied, forced to EOS 4), row 1's is not.

    Row 1 must equal the spec's processed row.  Kills line 437 ``kind is not ScoreKind.PROBS`` ->
    ``is`` (row 1 would be the log of its logits: NaN).
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "empty_support": "fallback_eos",
                                      "transforms": [{"name": "top_k", "k": 1}, {"name": "bad_words", "sequences": [[1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), eos_ids=(9, 4))
    rows = np.stack([Z, Z[::-1].copy()])
    pr = twin.process_scores(torch.tensor(rows), config, [PolicyState()] * 2, [view] * 2)
    assert pr.fallback_rows == (True, False)
    assert twin.greedy_select(pr.values).tolist() == [4, 8]
    spec_pr = processed_row(_spec_row(rows[1]), config, PolicyState(), view)
    np.testing.assert_allclose(pr.probs[1].double().numpy(), spec_pr.probs, atol=1e-6)


@pytest.mark.parametrize("counter", [0, 1, 6])
def test_a_draw_advances_the_counter_by_one_from_any_counter(counter):
    """A multinomial decision at counter c draws once at (step, 0) and leaves counter c + 1 (the spec's child state).

    Kills line 499 ``state.rng_counter + draws`` -> ``^ draws`` (odd counters would go back by one)
    and the other replacements of that ``+``.
    """
    config = policy_config_from_json({"family": "multinomial"})
    receipt, after = twin.decide(torch.tensor(Z), config, PolicyState(rng_counter=counter), VIEW)
    assert (receipt.draws, after.rng_counter, receipt.rng.counter_before, receipt.rng.counter_after) == (1, counter + 1, counter, counter + 1)
    assert decide(_spec_row(Z), config, PolicyState(rng_counter=counter), VIEW)[1].rng_counter == counter + 1


def test_next_state_takes_draws_and_selected_prob_by_keyword_only():
    """``next_state(config, state, token_id, *, draws, selected_prob)``: the counts cannot be passed by position.

    Kills line 483 ``*`` -> ``/`` (``draws`` and ``selected_prob`` would bind by position).
    """
    config = policy_config_from_json({"family": "multinomial"})
    with pytest.raises(TypeError):
        twin.next_state(config, PolicyState(), 3, 1, None)  # type: ignore[misc]
    assert twin.next_state(config, PolicyState(), 3, draws=1, selected_prob=None) == PolicyState(rng_counter=1)


@pytest.mark.parametrize("shape", [(0,), (1, 0), (1, 2, 5), (1, 1, 5)])
def test_an_empty_or_three_dimensional_score_tensor_is_not_a_row(shape):
    """``[0]`` and ``[1, 0]`` (no vocabulary), ``[1, 2, 5]`` and ``[1, 1, 5]`` (not a row) are ``policy.invalid_row`` for decide.

    Kills line 328 ``scores.shape[-1] == 0`` -> ``< 0`` (an empty vocabulary would reach the
    pipeline) and line 535 ``scores.ndim == 2`` -> ``>= 2`` (a ``[1, ...]`` tensor of any rank
    would be flattened into one row).
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.decide(torch.zeros(shape), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()))
    assert info.value.code == "policy.invalid_row"


@pytest.mark.parametrize("state", [PolicyState(constraint_state="s0"), PolicyState(mirostat_mu=3.0), PolicyState(rng_counter=-1)])
def test_process_scores_checks_every_state_against_the_config(state):
    """A state that does not fit a plain multinomial config (a constraint state, a Mirostat mu, a negative counter) is ``policy.invalid_state``, in any row.

    Kills line 389 ``for s in states: s.check(config)`` -> ``for s in []`` (states unchecked).
    """
    from decodespec.spec.errors import Rejection

    config = policy_config_from_json({"family": "multinomial"})
    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.tensor(np.stack([Z, Z])), config, [PolicyState(), state], [VIEW, VIEW])
    assert info.value.code == "policy.invalid_state"


def test_epsilon_above_the_top_probability_keeps_the_top_token():
    """epsilon = 0.45 on Z (p_max ~ 0.33): every probability is under the floor, and the top token (id 1) is kept anyway.

    Kills line 246 ``z == z.amax(...)`` -> ``z is z.amax(...)`` (always False: the row would be
    emptied, ``policy.empty_support``).
    """
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "epsilon", "epsilon": 0.45}]})
    assert float(torch.softmax(torch.tensor(Z), -1).max()) < 0.45
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW)
    assert pr.support_mask[0].nonzero().squeeze(-1).tolist() == [1]


def test_beam_refuses_a_probability_row():
    """selector.beam takes log-probabilities: a row of kind probs is ``policy.score_kind_mismatch``, as in the spec.

    Kills line 428 ``kind is not ScoreKind.LOGPROBS`` -> ``kind < ScoreKind.LOGPROBS``
    (``"probs" < "logprobs"`` is False, so the row would be ranked as if it were log-probabilities).
    """
    from decodespec.spec.errors import Rejection

    probs = np.exp(Z) / np.exp(Z).sum()
    config = policy_config_from_json({"family": "beam", "num_beams": 2})
    with pytest.raises(Rejection) as info:
        twin.beam_candidates(torch.tensor(probs[None, :]), torch.zeros(1), config, [PolicyState()], [VIEW], kind="probs")
    with pytest.raises(Rejection) as spec_info:
        beam_candidates([ScoreRow.create(probs.astype(np.float64), kind="probs")], [0.0], config, [PolicyState()], [VIEW])
    assert info.value.code == spec_info.value.code == "policy.score_kind_mismatch"


def test_a_probability_above_one_is_refused_even_when_the_row_sums_to_one_within_tolerance():
    """kind probs: [1.00005, 0] sums to 1 within 1e-4 but holds a probability above 1: ``policy.invalid_row``, as in the spec.

    Kills line 332 ``(scores > 1).any()`` -> ``(scores > 2).any()``.
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.tensor([1.00005, 0.0]), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()), kind="probs")
    with pytest.raises(Rejection) as spec_info:
        ScoreRow.create(np.array([1.00005, 0.0]), kind="probs")
    assert info.value.code == spec_info.value.code == "policy.invalid_row"


def test_token_ids_past_the_vocabulary_are_refused_in_the_view_and_in_the_transforms():
    """V = 10: a view naming id 10 (a plain policy) or a logit_bias on id 12 is ``policy.token_out_of_range``, never an IndexError or a silent pass.

    Kills line 391 ``for view in views`` and line 394 ``for i, t in enumerate(config.transforms)``
    -> zero iterations, line 392 ``max_token_id() >= v`` -> ``is v`` (id 12 would pass) and line
    395 ``max(t.token_ids()) >= v`` -> ``> v`` (id 10 would pass).
    """
    from decodespec.spec.errors import Rejection

    for ids in ((10,), (3, 12)):
        with pytest.raises(Rejection) as info:
            twin.process_scores(torch.tensor(Z), policy_config_from_json({"family": "multinomial"}), PolicyState(), RequestView(prompt_ids=ids))
        assert info.value.code == "policy.token_out_of_range" and info.value.path == "$.view"
    for bad in ("10", "12"):
        config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {bad: 1.0}}]})
        with pytest.raises(Rejection) as info:
            twin.process_scores(torch.tensor(Z), config, PolicyState(), RequestView(prompt_ids=()))
        assert info.value.code == "policy.token_out_of_range" and info.value.path == "$.policy.transforms[0]"


def test_mirostat_keeps_a_token_whose_surprise_equals_mu():
    """mirostat_v2 keeps surprise <= mu (bits): with mu set to the float32 surprise of the third-best token, the three best stay.

    Kills line 278 ``surprise <= mu`` -> ``surprise < mu`` (the token at mu would be dropped).
    """
    z = torch.tensor(Z).unsqueeze(0)
    surprise = -torch.log_softmax(z, dim=-1)[0] / math.log(2.0)
    third = int(torch.argsort(surprise)[2])
    mu = float(surprise[third])
    assert torch.tensor([mu], dtype=torch.float32)[0] == surprise[third]
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "mirostat_v2", "tau": 2.0, "eta": 0.3}]})
    pr = twin.process_scores(z, config, PolicyState(mirostat_mu=mu), VIEW)
    assert pr.support_mask[0].nonzero().squeeze(-1).tolist() == sorted(torch.argsort(surprise)[:3].tolist()) == [1, 3, 5]


@pytest.mark.parametrize("family", ["greedy", "multinomial"])
def test_beam_candidates_refuse_a_non_beam_family(family):
    """beam_candidates needs the beam family: greedy and multinomial configs are ``policy.family_mismatch``.

    Kills line 627 ``config.family is not Family.BEAM`` -> ``config.family < Family.BEAM``
    (``"greedy" < "beam"`` and ``"multinomial" < "beam"`` are False: nothing would be refused).
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.beam_candidates(torch.tensor(Z).unsqueeze(0), torch.zeros(1), policy_config_from_json({"family": family}), [PolicyState()], [VIEW])
    assert info.value.code == "policy.family_mismatch"


def test_the_multinomial_selector_takes_the_first_id_whose_mass_exceeds_the_target():
    """Inverse CDF with ``right=True``: a target on a CDF step goes past it, never to a zero-probability id.

    [0, 0.5, 0.5] with u = 0 (target 0): id 1, not the zero-mass id 0; [0.5, 0.5] with u = 0.5
    (target 0.5 = cdf[0]): id 1, as the spec's selector.  Kills line 477 ``right=True`` ->
    ``right=False``.
    """
    assert twin.multinomial_select(torch.tensor([[0.0, 0.5, 0.5]]), torch.tensor([0.0], dtype=torch.float64)).tolist() == [1]
    assert twin.multinomial_select(torch.tensor([[0.5, 0.5]]), torch.tensor([0.5], dtype=torch.float64)).tolist() == [1]
    assert multinomial(np.array([0.0, 0.5, 0.5]), 0.0)[0] == multinomial(np.array([0.5, 0.5]), 0.5)[0] == 1


def test_a_log_probability_row_must_be_normalized():
    """kind logprobs: a row whose logsumexp is 0.5 is ``policy.invalid_row`` (tolerance 1e-4), as in the spec.

    Kills line 334 ``logsumexp.abs() > 1e-4`` -> ``== 1e-4``.
    """
    from decodespec.spec.errors import Rejection

    row = np.log(np.array([0.5, 0.3, 0.2])) + 0.5
    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.tensor(row, dtype=torch.float32), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()), kind="logprobs")
    with pytest.raises(Rejection) as spec_info:
        ScoreRow.create(row, kind="logprobs")
    assert info.value.code == spec_info.value.code == "policy.invalid_row"


def test_the_beam_family_has_no_greedy_reason():
    """A beam config's processed rows carry selector ``beam``, normalization ``log_softmax`` and no greedy reason, as the spec's.

    Kills line 399 ``config.family is Family.GREEDY`` -> ``<=`` (``"beam" <= "greedy"``: the beam
    family would report greedy reason ``family``).
    """
    config = policy_config_from_json({"family": "beam", "num_beams": 2})
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW)
    spec_pr = processed_row(_spec_row(Z), config, PolicyState(), VIEW)
    assert (pr.selector, pr.normalization, pr.greedy_reason) == (spec_pr.selector, spec_pr.normalization, spec_pr.greedy_reason) == ("beam", "log_softmax", None)


def test_a_forced_row_is_logit_zero_at_eos_and_minus_infinity_elsewhere():
    """Explicit [top_k 1, temperature 0, bad_words [[1]]]: top_k keeps id 1, T = 0 turns the selector greedy, bad_words empties the row; EOS 4 is forced.

    The greedy branch does not normalize, so the forced logits reach the selector as they are:
    [-inf, ..., 0 at id 4, ..., -inf], as the spec's.  Kills line 445
    ``out[b, eos[0]] = 0.0`` -> ``-1.0``.
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "empty_support": "fallback_eos", "transforms": [
        {"name": "top_k", "k": 1}, {"name": "temperature", "temperature": 0.0}, {"name": "bad_words", "sequences": [[1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), eos_ids=(9, 4))
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), view)
    forced = processed_row(_spec_row(Z), config, PolicyState(), view)
    assert pr.fallback_rows == (True,) and forced.fallback_used and pr.normalization is None
    assert pr.values[0].tolist() == forced.values.tolist() == [-math.inf] * 4 + [0.0] + [-math.inf] * 5


def test_one_state_or_view_per_row():
    """Two rows with one state (or one view) in a list: ``policy.invalid_row`` at ``$.rows``, fewer or more alike.

    Kills line 343 ``len(rows) != b`` -> ``len(rows) > b`` (a short list would be accepted).
    """
    from decodespec.spec.errors import Rejection

    config = policy_config_from_json({"family": "multinomial"})
    for states, views in (([PolicyState()], [VIEW, VIEW]), ([PolicyState()] * 2, [VIEW]), ([PolicyState()] * 3, [VIEW, VIEW])):
        with pytest.raises(Rejection) as info:
            twin.process_scores(torch.tensor(np.stack([Z, Z])), config, states, views)
        assert (info.value.code, info.value.path) == ("policy.invalid_row", "$.rows")


def test_a_one_hot_probability_row_is_valid():
    """kind probs: [0, 1, 0] is a valid row (a probability may be exactly 1); greedy picks id 1 with support 1.

    Kills line 332 ``(scores > 1).any()`` -> ``(scores >= 1).any()``.
    """
    receipt, _ = twin.decide(torch.tensor([0.0, 1.0, 0.0]), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()), kind="probs")
    assert (receipt.selected_id, receipt.support_size) == (1, 1)


def test_no_repeat_trigram_matches_both_prefix_ids():
    """n = 3 over output (2, 2, 5, 2, 2): the prefix (2, 2) occurred before 5 only, so only id 5 is banned (the spec agrees).

    Kills line 152 ``windows[:, :-1]`` -> ``windows[:, :1]`` (the first id alone, broadcast against
    both prefix ids, would also match (2, 5, 2) and ban id 2).
    """
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "no_repeat_ngram", "n": 3, "history": "output"}]})
    view = RequestView(prompt_ids=(), output_ids=(2, 2, 5, 2, 2))
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), view)
    assert pr.support_mask[0].tolist() == [i != 5 for i in range(10)]
    assert processed_row(_spec_row(Z), config, PolicyState(), view).support_mask.tolist() == pr.support_mask[0].tolist()


def test_top_p_never_keeps_a_token_of_zero_float32_probability():
    """top_p p = 0.99999999 (1.0 in float32) on [0.5, 0.1, -0.4, 1.3, -200]: the float32 mass before id 4 is 0.99999994 < 1, yet its probability is 0, so it goes (the spec drops it too).

    Kills line 110 ``sorted_p > 0`` -> ``sorted_p > -1`` (id 4 would stay in the support).
    """
    z = np.array([0.5, 0.1, -0.4, 1.3, -200.0], dtype=np.float32)
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_p", "p": 0.99999999}]})
    pr = twin.process_scores(torch.tensor(z), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, True, True, True, False]
    assert processed_row(_spec_row(z), config, PolicyState(), RequestView(prompt_ids=())).support_mask.tolist() == pr.support_mask[0].tolist()


@pytest.mark.parametrize("family", ["greedy", "multinomial"])
def test_a_row_with_a_single_finite_score_is_decided(family):
    """[-inf, 2, -inf] with a penalty: the one finite id is the support (size 1) and is selected, not an empty support.

    Kills line 401 ``_support(z, kind) == 0`` -> ``== 1`` (a row of support 1 would be taken for an
    emptied one: ``policy.empty_support``).
    """
    config = policy_config_from_json({"family": family, "transforms": [{"name": "presence_penalty", "penalty": 0.5}]})
    receipt, _ = twin.decide(torch.tensor([-math.inf, 2.0, -math.inf]), config, PolicyState(), RequestView(prompt_ids=(), output_ids=(1,)))
    assert (receipt.selected_id, receipt.support_size, receipt.fallback_used) == (1, 1, False)
    assert list(receipt.transforms) == ["presence_penalty"]  # the applied transforms, by name


def test_beam_candidates_take_the_score_kind_by_keyword_only():
    """``beam_candidates(scores, beam_scores, config, states, views, num_candidates=None, *, kind=...)``: kind cannot be passed by position.

    Kills line 607 ``*`` -> ``/`` (``kind`` would bind by position; the parameters before it would
    become positional-only).
    """
    config = policy_config_from_json({"family": "beam", "num_beams": 2})
    args = (torch.tensor(Z).unsqueeze(0), torch.zeros(1), config, [PolicyState()], [VIEW])
    with pytest.raises(TypeError):
        twin.beam_candidates(*args, None, "logits")  # type: ignore[misc]
    by_name = twin.beam_candidates(scores=args[0], beam_scores=args[1], config=config, states=args[3], views=args[4], num_candidates=3, kind="logits")
    assert by_name[2].tolist() == twin.beam_candidates(*args, 3)[2].tolist() == [1, 5, 3]


def test_top_n_sigma_uses_the_exact_mean():
    """top_n_sigma n = 1 on [0, 0.5, 0.9, 1]: mean 0.6, sigma 0.394, threshold 0.606 keeps ids 2 and 3 (the spec agrees).

    Kills line 268 ``sum / count`` -> ``sum // count`` (mean 0, sigma 0.718, threshold 0.282 would
    keep id 1 as well).
    """
    z = np.array([0.0, 0.5, 0.9, 1.0], dtype=np.float32)
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_n_sigma", "n": 1.0}]})
    pr = twin.process_scores(torch.tensor(z), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [False, False, True, True]
    assert processed_row(_spec_row(z), config, PolicyState(), RequestView(prompt_ids=())).support_mask.tolist() == [False, False, True, True]


def test_temperature_zero_from_json_text_is_the_greedy_branch():
    """A policy parsed from JSON text (its strings are not the interned literals) with temperature 0 decides greedily with no draw.

    Kills line 407 ``t.name == "temperature"`` -> ``t.name is "temperature"`` (the branch would be
    missed and the zero temperature divided by).
    """
    import json

    config = policy_config_from_json(json.loads('{"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.0}]}'))
    receipt, after = twin.decide(torch.tensor(Z), config, PolicyState(), VIEW)
    assert (receipt.selected_id, receipt.draws, receipt.greedy_reason, after.rng_counter) == (1, 0, "temperature_zero", 0)


def test_decide_refuses_the_beam_family():
    """decide is for greedy and multinomial policies: a beam config is ``policy.family_mismatch``.

    Kills line 533 ``config.family is Family.BEAM`` -> ``config.family < Family.BEAM`` (``"beam"``
    is the least family value: nothing would be refused).
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.decide(torch.tensor(Z), policy_config_from_json({"family": "beam", "num_beams": 2}), PolicyState(), VIEW)
    assert info.value.code == "policy.family_mismatch"


def test_a_forced_row_does_not_feed_mirostat():
    """Explicit [mirostat_v2, bad_words [[1]]] with mu = 0.5 bits: Mirostat keeps only id 1, bad_words bans it, EOS 4 is forced, and mu stays 0.5 (the spec agrees).

    Kills line 549 ``... and not fallback`` -> ``... or not fallback`` (the forced token would update mu).
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "empty_support": "fallback_eos", "transforms": [
        {"name": "mirostat_v2", "tau": 2.0, "eta": 0.3}, {"name": "bad_words", "sequences": [[1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), eos_ids=(4,), identity="m", seed=2)
    state = PolicyState(mirostat_mu=0.5)
    receipt, after = twin.decide(torch.tensor(Z), config, state, view)
    spec_receipt, spec_after = decide(_spec_row(Z), config, state, view)
    assert (receipt.selected_id, receipt.fallback_used, after.mirostat_mu) == (spec_receipt.selected_id, spec_receipt.fallback_used, spec_after.mirostat_mu) == (4, True, 0.5)


def test_fallback_forces_every_empty_row_after_a_live_one():
    """The batch of the fallback test in the other order: row 0 live (top id 8), row 1 emptied and forced to EOS 4.

    Kills line 440 ``continue`` -> ``break`` (the loop would stop at the live row and leave row 1
    empty).
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "empty_support": "fallback_eos",
                                      "transforms": [{"name": "top_k", "k": 1}, {"name": "bad_words", "sequences": [[1]], "history": "output"}]})
    view = RequestView(prompt_ids=(), eos_ids=(9, 4))
    pr = twin.process_scores(torch.tensor(np.stack([Z[::-1].copy(), Z])), config, [PolicyState()] * 2, [view] * 2)
    assert pr.fallback_rows == (False, True)
    assert twin.greedy_select(pr.values).tolist() == [8, 4] and pr.support_mask.sum(dim=-1).tolist() == [1, 1]


def test_decide_takes_its_options_by_keyword_only():
    """``decide(scores, config, state, view, *, kind, score_id, vocab_hash, rng)``: the options cannot be passed by position.

    Kills line 507 ``*`` -> ``/`` (``kind`` and the rest would bind by position, the four leading
    parameters would become positional-only).
    """
    config = policy_config_from_json({"family": "greedy"})
    with pytest.raises(TypeError):
        twin.decide(torch.tensor(Z), config, PolicyState(), VIEW, "logits")  # type: ignore[misc]
    receipt, _ = twin.decide(scores=torch.tensor(Z), config=config, state=PolicyState(), view=VIEW, kind="logits", score_id="s")
    assert (receipt.selected_id, receipt.score_id) == (1, "s")


def test_top_n_sigma_keeps_a_logit_exactly_at_the_threshold():
    """n = 2 on [0, 1]: mean 0.5, sigma 0.5 (exact in float32), threshold 1 - 2 * 0.5 = 0, so the logit 0 stays (keep ``z >= max - n sigma``, as the spec).

    Kills line 271 ``z < threshold`` -> ``z <= threshold``.
    """
    z = np.array([0.0, 1.0], dtype=np.float32)
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_n_sigma", "n": 2.0}]})
    pr = twin.process_scores(torch.tensor(z), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, True]
    assert processed_row(_spec_row(z), config, PolicyState(), RequestView(prompt_ids=())).support_mask.tolist() == [True, True]


def test_no_repeat_ngram_after_a_row_with_a_short_history():
    """Two rows, n = 2 over output: row 0's history is shorter than n (nothing banned), row 1's (3, 5, 3) bans 5 (the spec agrees row by row).

    Kills line 149 ``continue`` -> ``break`` (the rows after a short history would go unbanned).
    """
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "no_repeat_ngram", "n": 2, "history": "output"}]})
    views = [RequestView(prompt_ids=(), output_ids=(1,)), RequestView(prompt_ids=(), output_ids=(3, 5, 3))]
    pr = twin.process_scores(torch.tensor(np.stack([Z, Z])), config, [PolicyState()] * 2, views)
    assert pr.support_mask.tolist() == [[True] * 10, [i != 5 for i in range(10)]]
    assert [processed_row(_spec_row(Z), config, PolicyState(), v).support_mask.tolist() for v in views] == pr.support_mask.tolist()


@pytest.mark.parametrize("name", ["top_p", "typical"])
def test_a_prefix_that_reaches_p_exactly_stops_there(name):
    """p = 0.5 on two equal logits: the first id's mass is exactly 0.5 in float32, which reaches p, so the second id goes (the spec agrees).

    Kills line 110 ``before < mass`` -> ``before <= mass`` (the second id, whose mass before is
    exactly p, would stay).
    """
    z = np.array([0.0, 0.0, -math.inf], dtype=np.float32)
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": name, "p": 0.5}]})
    pr = twin.process_scores(torch.tensor(z), config, PolicyState(), RequestView(prompt_ids=()))
    assert pr.support_mask[0].tolist() == [True, False, False]
    assert processed_row(_spec_row(z), config, PolicyState(), RequestView(prompt_ids=())).support_mask.tolist() == [True, False, False]


def test_beam_candidates_cap_at_k_times_v():
    """K = 2 parents, V = 10, 20 candidates asked: all K * V = 20 come back, in the spec's order.

    Kills line 631 ``min(k * v, ...)`` -> ``min(k + v, ...)`` (12 candidates).
    """
    config = policy_config_from_json({"family": "beam", "num_beams": 2})
    rows = np.stack([Z, Z[::-1].copy()])
    cand, parents, tokens, _ = twin.beam_candidates(torch.tensor(rows), torch.tensor([0.0, -1.0]), config, [PolicyState()] * 2, [VIEW] * 2, 20)
    spec = beam_candidates([_spec_row(r) for r in rows], [0.0, -1.0], config, [PolicyState()] * 2, [VIEW] * 2, 20)
    assert len(cand) == 20 and (parents.tolist(), tokens.tolist()) == (spec.parents.tolist(), spec.tokens.tolist())


@pytest.mark.parametrize("empty_support", ["raise", "fallback_eos"])
def test_a_row_with_no_finite_score_is_an_empty_support(empty_support):
    """A row of -inf only, no transforms: ``policy.empty_support`` (no EOS id is legal for the fallback either), as in the spec.

    Kills line 401 ``_support(z, kind) == 0`` -> ``== -1`` (the row would never be taken for empty
    and would be normalized into NaN).
    """
    from decodespec.spec.errors import Rejection

    config = policy_config_from_json({"family": "multinomial", "empty_support": empty_support})
    view = RequestView(prompt_ids=(), eos_ids=(1,), identity="e", seed=1)
    row = np.full(4, -np.inf, dtype=np.float32)
    with pytest.raises(Rejection) as info:
        twin.decide(torch.tensor(row), config, PolicyState(), view)
    with pytest.raises(Rejection) as spec_info:
        decide(_spec_row(row), config, PolicyState(), view)
    assert info.value.code == spec_info.value.code == "policy.empty_support"


@pytest.mark.parametrize("penalty", [{"name": "repetition_penalty", "penalty": 1.5, "history": "output"}, {"name": "frequency_penalty", "penalty": 0.5}])
def test_a_skipped_mirostat_does_not_observe_the_greedy_token(penalty):
    """[a penalty, temperature 0, mirostat_v2]: the greedy branch skips Mirostat, so mu stays as it was (the spec agrees).

    Kills line 549 ``t.name == "mirostat_v2"`` -> ``t.name >= "mirostat_v2"`` (the applied
    ``repetition_penalty`` sorts after it) and -> ``<=`` (``frequency_penalty`` sorts before it):
    mu would be updated from the greedy token.
    """
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "transforms": [
        penalty, {"name": "temperature", "temperature": 0.0},
        {"name": "mirostat_v2", "tau": 2.0, "eta": 0.3}]})
    state = PolicyState(mirostat_mu=4.0)
    receipt, after = twin.decide(torch.tensor(Z), config, state, VIEW)
    spec_receipt, spec_after = decide(_spec_row(Z), config, state, VIEW)
    assert (receipt.selected_id, after.mirostat_mu) == (spec_receipt.selected_id, spec_after.mirostat_mu) == (spec_receipt.selected_id, 4.0)


@pytest.mark.parametrize("shape", [(), (1, 2, 5)])
def test_process_scores_refuses_a_scalar(shape):
    """A 0-d or 3-d tensor is not a row: ``policy.invalid_row`` from process_scores itself, not an IndexError or ValueError.

    Kills line 328 ``scores.ndim != 2`` -> ``scores.ndim > 2`` (the 0-d tensor would reach
    ``shape[-1]``) and -> ``scores.ndim < 2`` (the 3-d one would reach ``b, v = z.shape``).
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.ones(shape), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()))
    assert info.value.code == "policy.invalid_row"


def test_mirostat_from_json_text_updates_mu():
    """A Mirostat policy parsed from JSON text (names that are not the interned literals): the decision observes the sampled token and updates mu as the spec does.

    Kills line 549 ``t.name == "mirostat_v2"`` -> ``t.name is "mirostat_v2"`` (mu would stay put).
    """
    import json

    config = policy_config_from_json(json.loads('{"family": "multinomial", "transforms": [{"name": "mirostat_v2", "tau": 2.0, "eta": 0.3}]}'))
    state = PolicyState(mirostat_mu=4.0)
    _, after = twin.decide(torch.tensor(Z), config, state, VIEW)
    _, spec_after = decide(_spec_row(Z), config, state, VIEW)
    assert after.mirostat_mu != 4.0 and after.mirostat_mu == pytest.approx(spec_after.mirostat_mu, abs=1e-5)


@pytest.mark.parametrize("name", ["top_p", "typical"])
def test_two_different_rows_are_truncated_each_by_its_own_ranking(name):
    """A 2-row batch (Z and Z reversed) under top_p / typical p = 0.6: each row's support equals the spec's for that row.

    Kills line 100 ``key.shape[0] == 1`` -> ``== 2`` (the single-row branch would rank row 0 only
    and apply its kept set to row 1).
    """
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": name, "p": 0.6}]})
    rows = np.stack([Z, Z[::-1].copy()])
    pr = twin.process_scores(torch.tensor(rows), config, [PolicyState()] * 2, [VIEW] * 2)
    assert pr.support_mask.tolist() == [processed_row(_spec_row(r), config, PolicyState(), VIEW).support_mask.tolist() for r in rows]
    assert pr.support_mask[0].tolist() != pr.support_mask[1].tolist()


def test_process_scores_takes_the_score_kind_by_keyword_only():
    """``process_scores(scores, config, states, views, *, kind)``: kind cannot be passed by position.

    Kills line 361 ``*`` -> ``/`` (``kind`` would bind by position, the four leading parameters
    would become positional-only).
    """
    config = policy_config_from_json({"family": "greedy"})
    with pytest.raises(TypeError):
        twin.process_scores(torch.tensor(Z), config, PolicyState(), VIEW, "logits")  # type: ignore[misc]
    pr = twin.process_scores(scores=torch.tensor(Z), config=config, states=PolicyState(), views=VIEW, kind="logits")
    assert pr.support_mask[0].all() and pr.selector == "greedy"


def test_eos_is_legal_once_min_new_tokens_outputs_exist():
    """min_new_tokens = 5: EOS 9 is banned after 4 outputs and legal after exactly 5 (the spec agrees).

    Kills line 129 ``len(v.output_ids) < v.min_new_tokens`` -> ``<=``.
    """
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "min_new_tokens"}]})
    for outputs, legal in (((3, 5, 3, 1), False), ((3, 5, 3, 1, 3), True)):
        view = RequestView(prompt_ids=(), output_ids=outputs, eos_ids=(9,), min_new_tokens=5)
        pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), view)
        assert bool(pr.support_mask[0, 9]) is legal is bool(processed_row(_spec_row(Z), config, PolicyState(), view).support_mask[9])


def test_no_repeat_ngram_on_a_history_of_exactly_n_ids():
    """n = 2 over output (4, 4): the one bigram (4, 4) ends in the prefix 4, so 4 is banned (the spec agrees).

    Kills line 147 ``h.numel() < n`` -> ``<=`` (a history of exactly n ids would be skipped).
    """
    config = policy_config_from_json({"family": "greedy", "transforms": [{"name": "no_repeat_ngram", "n": 2, "history": "output"}]})
    view = RequestView(prompt_ids=(), output_ids=(4, 4))
    pr = twin.process_scores(torch.tensor(Z), config, PolicyState(), view)
    assert pr.support_mask[0].tolist() == [i != 4 for i in range(10)] == processed_row(_spec_row(Z), config, PolicyState(), view).support_mask.tolist()


def test_a_negative_probability_is_refused():
    """kind probs: [1, -0.5, 0.5] sums to 1 but holds a negative probability: ``policy.invalid_row``, as in the spec.

    Kills line 332 ``(scores < 0).any()`` -> ``(scores < -1).any()``.
    """
    from decodespec.spec.errors import Rejection

    with pytest.raises(Rejection) as info:
        twin.process_scores(torch.tensor([1.0, -0.5, 0.5]), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()), kind="probs")
    with pytest.raises(Rejection) as spec_info:
        ScoreRow.create(np.array([1.0, -0.5, 0.5]), kind="probs")
    assert info.value.code == spec_info.value.code == "policy.invalid_row"


def test_a_batch_of_more_than_256_rows():
    """300 rows, one state and view each: accepted, each row decided alone (ints past 256 are compared by value).

    Kills line 343 ``len(rows) != b`` -> ``len(rows) is not b`` (distinct int objects past 256).
    """
    config = policy_config_from_json({"family": "greedy"})
    rows = torch.tensor(Z[:3]).repeat(300, 1)
    pr = twin.process_scores(rows, config, [PolicyState()] * 300, [RequestView(prompt_ids=())] * 300)
    assert twin.greedy_select(pr.values).tolist() == [1] * 300


def test_a_log_probability_row_is_exponentiated_not_renormalized():
    """Greedy on a log-probability row whose logsumexp is 5e-5 (inside the twin's 1e-4 tolerance): the processed log-probability of the pick is the row's own value (``probs = exp(values)``).

    Kills line 430 ``kind is ScoreKind.LOGPROBS`` -> ``kind > ScoreKind.LOGPROBS`` (never true: the
    row would be renormalized by softmax, shifting it by 5e-5).  The spec refuses this row (its
    tolerance is tighter): see docs/results/mutation.md.
    """
    row = (np.log(np.array([0.5, 0.3, 0.2])) + 5e-5).astype(np.float32)
    receipt, _ = twin.decide(torch.tensor(row), policy_config_from_json({"family": "greedy"}), PolicyState(), RequestView(prompt_ids=()), kind="logprobs")
    assert receipt.selected_id == 0 and receipt.processed_logprob == pytest.approx(float(row[0]), abs=2e-6)


LOGPROB_TOLERANCE = 1e-4  # the twin's bound on |logsumexp| of a kind-logprobs row (impl/policy.py _check_row)


def _row_whose_logsumexp_is(target: float) -> torch.Tensor:
    """A float32 row ``[a, b, c]`` whose float64 ``torch.logsumexp`` is exactly the double ``target`` on this machine.

    ``lse = a + log(s)`` with ``s = 1 + exp(b - a) + exp(c - a)``, ``a`` float32 and ``s`` a double.
    One rounding step of ``log(s)`` (2^-52) is 16,000 steps of a double near 1e-4, so ``a`` cannot
    sit next to ``target``: for each float32 ``a`` between ``|target| / 1.6`` and ``|target|`` (the
    sign of ``target``; about 5 million) the doubles ``s = 1 + k 2^-52`` nearest ``exp(target - a)``
    are tried with torch's ``log``, and 241 ``a`` (200 for -1e-4) have one for which ``a + log(s)``
    rounds to ``target``.  For those, ``b`` is the largest float32 with ``exp(b - a) < s - 1`` and ``c`` is
    stepped through the float32 values around ``a + log(s - 1 - exp(b - a))``: the remainder is below
    one step of ``b``, so one step of ``c`` moves ``s`` by less than 2^-53 and the sum can land on
    ``s``.  Every row is checked with torch's own ``logsumexp`` here, so the search holds on any CPU:
    under ``ATEN_CPU_CAPABILITY`` default, avx2 and avx512 with 1 and 2 threads every one of those
    ``a`` gave a row (the first is returned).  No row found is an ``AssertionError``, not a skip.
    """
    sign, size = math.copysign(1.0, target), abs(target)
    f32 = np.float32
    if sign > 0:  # a + log(s) = target with log(s) >= 0: a in [size / 1.6, size)
        low = f32(size / 1.6)
        high = f32(size) if float(f32(size)) < size else np.nextafter(f32(size), f32(0))
    else:  # a = target - log(s) <= target: |a| in (size, 1.4 size]
        low = f32(size) if float(f32(size)) > size else np.nextafter(f32(size), f32(np.inf))
        high = f32(size * 1.4)
    bits = np.arange(low.view(np.int32), high.view(np.int32) + 1, dtype=np.int32)
    a = torch.from_numpy(sign * bits.view(np.float32).astype(np.float64))  # [n] float32 values as doubles
    eps = 2.0 ** -52
    k = torch.round(torch.expm1(target - a) / eps)
    for d in (-1, 0, 1):
        s = 1 + (k + d) * eps  # [n] doubles near exp(target - a)
        ok = (a + torch.log(s)) == target
        for av, sv in zip(a[ok].tolist(), s[ok].tolist()):
            b = f32(av + math.log(sv - 1))
            while math.exp(float(b) - av) >= sv - 1:
                b = np.nextafter(b, f32(-np.inf))
            rest = sv - 1 - math.exp(float(b) - av)
            c = f32(av + math.log(rest))
            cs = [c]
            for step in (np.inf, -np.inf):
                x = c
                for _ in range(60):
                    x = np.nextafter(x, f32(step))
                    cs.append(x)
            rows = torch.tensor(np.array([[f32(av), b, ci] for ci in cs], dtype=np.float32))  # [m, 3]
            hit = (torch.logsumexp(rows.double(), dim=-1) == target).nonzero()
            if len(hit):
                return rows[int(hit[0])]
    raise AssertionError(f"no float32 row with logsumexp exactly {target!r} found on this machine")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_log_probability_row_at_the_tolerance_is_accepted_and_one_past_it_refused(sign):
    """kind logprobs: a row whose float64 logsumexp is exactly +-1e-4 (the twin's bound, inclusive) is decided; one float32
    step of its largest entry further out is ``policy.invalid_row``.

    The bound is inclusive, ``|logsumexp| <= 1e-4`` (the spec's own is 1e-6 for the float64 rows it
    is given, ``NORMALIZATION_TOLERANCE``).  Kills ``_check_row``'s ``> 1e-4`` -> ``>= 1e-4`` (kind
    logprobs; line 334 in the Cosmic Ray session's numbering, live until stop 30; docs/results/mutation.md).
    """
    from decodespec.spec.errors import Rejection

    target = sign * LOGPROB_TOLERANCE
    row = _row_whose_logsumexp_is(target)
    assert torch.logsumexp(row.double(), dim=-1).item() == target and row.dtype == torch.float32
    assert torch.logsumexp(row.double()[None], dim=-1).item() == target  # as _check_row computes it, on [1, V]
    config = policy_config_from_json({"family": "greedy"})
    receipt, _ = twin.decide(row, config, PolicyState(), RequestView(prompt_ids=()), kind="logprobs")
    assert receipt.selected_id == 0
    past = row.clone()
    past[0] = torch.tensor(np.nextafter(row[0].numpy(), np.float32(sign * np.inf)))
    assert abs(torch.logsumexp(past.double(), dim=-1).item()) > LOGPROB_TOLERANCE
    with pytest.raises(Rejection) as info:
        twin.decide(past, config, PolicyState(), RequestView(prompt_ids=()), kind="logprobs")
    assert info.value.code == "policy.invalid_row" and info.value.path == "$.row.values"
