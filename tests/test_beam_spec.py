"""Beam search spec (spec/beam.py): hand-built searches, failure-lab mutants, errors, trace shape.

Each scenario is a table ``generated suffix -> probability row`` so that the expected answer can
be worked out by hand; each failure-lab bug (M3.10 0x0B "Beam bookkeeping bugs", M3.8 0x12 items
43-47) is reproduced as a mutant state or step and must be caught by the named rule.
"""

from __future__ import annotations

import json
import math

import attrs
import numpy as np
import pytest

from decodespec.spec import beam as B
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import ERROR_CODES, Rejection
from decodespec.spec.rules import RULES

EOS = 2
PROMPT = (1, 7, 7)


def table_fn(vocab: int, rows: dict[tuple[int, ...], list[float]], prompt_len: int = len(PROMPT)):
    """``score_fn`` from probability rows keyed by the generated suffix (uniform when absent)."""

    def score_fn(prefix):
        p = np.asarray(rows.get(tuple(prefix[prompt_len:]), [1.0 / vocab] * vocab), dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.log(p)

    return score_fn


def run(score_fn, params, prompt=PROMPT, lanes=None):
    result = B.beam_search(score_fn, prompt, params, lanes=lanes)
    for before, record, after in result.transitions():
        assert B.check_step(params, before, record, after) == ()
    return result


# A search where the parents cross: step 1 keeps slot 0 <- parent 1 and slot 1 <- parent 0.
CROSS_ROWS = {
    (): [0.1, 0.5, 0.3, 0.1],
    (1,): [0.25, 0.25, 0.25, 0.25],
    (2,): [0.9, 0.05, 0.03, 0.02],
}
COUNTING_LANES = B.BranchLanes(constraint_init=0, constraint_step=lambda q, t: (q * 5 + t + 1) % 97,
                               decoder_init=[], decoder_step=lambda d, t: (d + [t])[-2:])


def crossed_step():
    params = B.BeamParams(num_beams=2, max_new_tokens=3, early_stop="at_cap")
    result = run(table_fn(4, CROSS_ROWS), params, lanes=COUNTING_LANES)
    before, record, after = result.transitions()[1]
    assert [c.parent for c in record.live_candidates] == [1, 0]
    assert [c.token for c in record.live_candidates] == [0, 0]
    return params, before, record, after


# ---------------------------------------------------------------------------------------------
# Coupled branch state (invariant.beam_parent_coupling, M3.10 0x0B / M3.8 0x12 item 45)
# ---------------------------------------------------------------------------------------------


def test_children_take_every_lane_from_the_parent_named_by_parent_ids():
    """invariant.beam_parent_coupling holds on a step whose parent map crosses slots."""
    params, before, record, after = crossed_step()
    for cand, child in zip(record.live_candidates, record.children):
        parent = before.live[cand.parent]
        assert child.prefix == parent.prefix + (cand.token,)
        assert child.cache == parent.cache and child.constraint == (parent.constraint * 5 + cand.token + 1) % 97
        assert child.decoder == (parent.decoder + [cand.token])[-2:]
        assert child.ancestry == parent.ancestry + (cand.parent,)
        assert child.parent_hash == B.branch_hash(parent)
    assert B.beam_parent_coupling(params, before, record, after)


def _remap_children(before, record, after, **lanes_from_slot):
    """A mutant step: children keep the named lanes of the branch in their *own slot*."""
    children = tuple(
        attrs.evolve(child, **{name: fn(before.live[child.slot], child) for name, fn in lanes_from_slot.items()})
        for child in record.children)
    return attrs.evolve(record, children=children), attrs.evolve(after, live=children)


@pytest.mark.parametrize("bug, lanes", [
    ("parent beam IDs not gathered (tokens attach to the wrong prefix)",
     {"prefix": lambda own, c: own.prefix + (c.prefix[-1],)}),
    ("KV cache not reordered with beams",
     {"cache": lambda own, c: own.cache}),
    ("beam parent reorder omits constraint state",
     {"constraint": lambda own, c: own.constraint}),
    ("beam parent reorder omits decoder / stop state",
     {"decoder": lambda own, c: own.decoder}),
    ("ancestry records the child's slot instead of its parent id",
     {"ancestry": lambda own, c: c.ancestry[:-1] + (c.slot,)}),
])
def test_parent_coupling_catches_each_lane_left_ungathered(bug, lanes):
    """invariant.beam_parent_coupling fails when any one lane is not gathered by the parent map."""
    params, before, record, after = crossed_step()
    bad_record, bad_after = _remap_children(before, record, after, **lanes)
    assert not B.beam_parent_coupling(params, before, bad_record, bad_after), bug
    assert "invariant.beam_parent_coupling" in B.check_step(params, before, bad_record, bad_after)


def test_branch_hash_covers_every_lane():
    """Changing any one component of (X, S, L, C, P, Q, R, D, F, Pi, W), or b, k, t, changes I_branch."""
    _, _, record, _ = crossed_step()
    child = record.children[0]
    h = B.branch_hash(child)
    changes = {
        "request_id": "other", "row": 1, "slot": 5, "step": 9, "prefix": child.prefix + (0,), "prompt_len": 2,
        "score": child.score - 1e-12, "normalized": 0.5, "length": 7, "cache": B.CacheRef.of(child.prefix),
        "position": child.position + 1, "constraint": "q", "rng": B.RngState(child.rng.key, 1), "decoder": [9],
        "status": B.BeamStatus.COMPLETED, "finish_reason": FinishReason.EOS, "triggers": (FinishReason.EOS,),
        "ancestry": (1, 1), "parent_hash": "0" * 64, "policy_revision": "x", "consumed_step": None,
    }
    assert set(changes) == {f.name for f in attrs.fields(B.BranchState)}
    for name, value in changes.items():
        assert B.branch_hash(attrs.evolve(child, **{name: value})) != h, name


# ---------------------------------------------------------------------------------------------
# Fork before append (invariant.beam_fork_before_append)
# ---------------------------------------------------------------------------------------------


def test_siblings_never_see_each_others_token():
    """invariant.beam_fork_before_append: both children of parent 0 hold only their own token."""
    params = B.BeamParams(num_beams=2, max_new_tokens=2, early_stop="at_cap")
    result = run(table_fn(4, CROSS_ROWS), params)
    before, record, after = result.transitions()[0]
    parent = before.live[0]
    assert [c.parent for c in record.live_candidates] == [0, 0]
    tokens = [c.token for c in record.live_candidates]
    for child, own, other in zip(record.children, tokens, reversed(tokens)):
        assert child.prefix == parent.prefix + (own,) and other not in child.prefix[len(parent.prefix):]
        assert child.cache == parent.cache and child.pending == (own,) and child.position == len(parent.prefix)

    # Mutant: one shared, in-place mutated prefix and cache (no fork): child 1 sees child 0's token.
    shared = list(parent.prefix)
    bad = []
    for child in record.children:
        shared.append(child.prefix[-1])
        bad.append(attrs.evolve(child, prefix=tuple(shared), cache=B.CacheRef.of(shared[:-1])))
    bad_record = attrs.evolve(record, children=tuple(bad))
    assert not B.beam_fork_before_append(params, before, bad_record, attrs.evolve(after, live=tuple(bad)))


# ---------------------------------------------------------------------------------------------
# First step (invariant.beam_first_step_single_parent, M3.8 0x12 item 46)
# ---------------------------------------------------------------------------------------------


def test_first_step_expands_only_beam_zero():
    """invariant.beam_first_step_single_parent: dense scores [0, -inf, -inf]; distinct children."""
    params = B.BeamParams(num_beams=3, max_new_tokens=2, early_stop="at_cap")
    state = B.initial_state(params, PROMPT)
    assert state.beam_scores(3).tolist() == [0.0, -math.inf, -math.inf]
    result = run(table_fn(4, {}), params)
    first = result.steps[0]
    assert [c.parent for c in first.live_candidates] == [0, 0, 0]
    assert [c.token for c in first.live_candidates] == [0, 1, 2]  # uniform row: lowest flat index wins ties


def test_duplicate_first_step_beams_are_caught():
    """Mutant (M3.8 0x12 item 46): every first-step beam initialized at 0 fills the frontier with duplicates."""
    params = B.BeamParams(num_beams=3, max_new_tokens=2, early_stop="at_cap")
    good = B.beam_call(params, B.initial_state(params, PROMPT))
    root = good.live[0]
    bad_before = attrs.evolve(good, live=tuple(attrs.evolve(root, slot=k) for k in range(3)))
    rows = np.log(np.array([[0.7, 0.1, 0.1, 0.1]] * 3))
    after, record = B.beam_step(params, bad_before, rows)
    assert [b.output_ids for b in after.live] == [(0,), (0,), (0,)]
    assert not B.beam_first_step_single_parent(params, bad_before, record, after)
    assert not B.beam_live_frontier(params, after)
    after_ok, record_ok = B.beam_step(params, good, rows[:1])
    assert [b.output_ids for b in after_ok.live] == [(0,), (1,), (2,)]
    assert B.check_step(params, good, record_ok, after_ok) == ()


# ---------------------------------------------------------------------------------------------
# Completed set (invariant.beam_completed_never_expanded)
# ---------------------------------------------------------------------------------------------

EARLY_EOS_ROWS = {
    (): [0.05, 0.05, 0.4, 0.35, 0.15],     # EOS ranks 0 -> completes; live refills with 3, 4
    (3,): [0.0, 0.0, 0.99, 0.01, 0.0],     # 3 then EOS: -1.0498 - 0.01005 = -1.0599 over 2 tokens
    (4,): [0.0, 0.0, 0.5, 0.5, 0.0],
}


def test_eos_moves_to_completed_and_the_frontier_refills():
    """invariant.beam_completed_never_expanded: EOS leaves the live table; live slots refill from non-EOS."""
    params = B.BeamParams(num_beams=2, max_new_tokens=4, eos_ids=(EOS,), early_stop="at_cap")
    result = run(table_fn(5, EARLY_EOS_ROWS), params)
    first = result.steps[0]
    assert [(c.token, c.rank) for c in first.completed_candidates] == [(EOS, 0)]
    assert [b.output_ids for b in first.children] == [(3,), (4,)]
    assert first.completed[0].finish_reason is FinishReason.EOS and first.completed[0].cache.num_rows == len(PROMPT)
    for h in result.hypotheses:
        assert EOS not in h.output_ids[:-1]


def test_expanding_a_completed_hypothesis_again_is_caught():
    """Mutant (M3.10 0x0B "completed beams expanded again"): the EOS hypothesis stays in the active table."""
    params = B.BeamParams(num_beams=2, max_new_tokens=4, eos_ids=(EOS,), early_stop="at_cap")
    result = run(table_fn(5, EARLY_EOS_ROWS), params)
    state = result.states[1]
    done = state.completed[0]
    resurrected = attrs.evolve(done, status=B.BeamStatus.LIVE, finish_reason=None, triggers=(), slot=1)
    bad = attrs.evolve(state, live=(state.live[0], resurrected))
    before = B.beam_call(params, bad)
    after, record = B.beam_step(params, before, np.log(np.full((2, 5), 0.2)))
    assert not B.beam_completed_never_expanded(params, before, record, after)


# ---------------------------------------------------------------------------------------------
# Length penalty (transform.beam_length_penalty)
# ---------------------------------------------------------------------------------------------


def test_length_penalty_formulas():
    """transform.beam_length_penalty: |y|**alpha and ((5+|y|)/6)**alpha."""
    power = B.LengthPenalty(alpha=0.6)
    gnmt = B.LengthPenalty(alpha=0.6, form="gnmt")
    assert power.denominator(4) == pytest.approx(4 ** 0.6)
    assert gnmt.denominator(4) == pytest.approx(1.5 ** 0.6)
    assert gnmt.denominator(1) == 1.0
    assert power.normalize(-3.0, 3) == pytest.approx(-3.0 / 3 ** 0.6)
    assert B.LengthPenalty().normalize(-3.0, 7) == -3.0


LENGTH_ROWS = {  # sub-normalized rows are still log-probability rows (entries <= 0)
    (): [0.0, 0.0, math.exp(-1.0), 0.0, 1 - math.exp(-1.0)],   # [EOS] scores -1 (|y| = 1)
    (4,): [0.0, 0.0, 0.0, 0.0, 1.0],
    (4, 4): [0.0, 0.0, math.exp(-2.0) / (1 - math.exp(-1.0)), 0.0, 0.0],  # [4, 4, EOS] scores -2
}


def test_length_penalty_counts_generated_tokens_not_the_prompt():
    """transform.beam_length_penalty: |y| excludes the prompt (M3.10 0x0B "a length penalty counting the prompt").

    Hypotheses: [EOS] score -1 (|y|=1) and [4, 4, EOS] score -2 (|y|=3).  With alpha = 1 the
    longer one wins (-0.667 > -1); counting a 10-token prompt would flip it (-1/11 > -2/13).
    """
    for prompt in (PROMPT, tuple(range(3, 13))):
        params = B.BeamParams(num_beams=2, max_new_tokens=4, eos_ids=(EOS,),
                              length_penalty=B.LengthPenalty(alpha=1.0), early_stop="at_cap")
        result = run(table_fn(5, LENGTH_ROWS, prompt_len=len(prompt)), params, prompt=prompt)
        by_ids = {h.output_ids: h for h in result.hypotheses}
        assert by_ids[(EOS,)].score == pytest.approx(-1.0) and by_ids[(EOS,)].length == 1
        assert by_ids[(4, 4, EOS)].score == pytest.approx(-2.0) and by_ids[(4, 4, EOS)].length == 3
        assert by_ids[(4, 4, EOS)].normalized == pytest.approx(-2.0 / 3)
        assert result.best.output_ids == (4, 4, EOS)
        counting_prompt = max(result.hypotheses, key=lambda h: h.score / (h.length + len(prompt)))
        if len(prompt) == 10:
            assert counting_prompt.output_ids == (EOS,)  # the bug would return the other hypothesis


# ---------------------------------------------------------------------------------------------
# Termination contracts (transition.beam_stop, M3.8 0x12 item 47)
# ---------------------------------------------------------------------------------------------


def _contract(kind, alpha=1.0, **kw):
    return B.BeamParams(num_beams=2, max_new_tokens=4, eos_ids=(EOS,), length_penalty=B.LengthPenalty(alpha=alpha),
                        early_stop=kind, **kw)


def test_stopping_at_the_first_eos_misses_a_better_longer_hypothesis():
    """transition.beam_stop: with alpha = 1, [EOS] (-0.916) completes first but [3, EOS] scores -0.530.

    fixed_count(n=1) stops at the first EOS (M3.8 0x12 item 47) and HF's heuristic (early_stopping=False)
    stops too, since -1.05 / 1 <= -0.916 ignores that lp grows; never, exact and at_cap find [3, EOS].
    """
    fn = table_fn(5, EARLY_EOS_ROWS)
    outcomes = {}
    for kind in ("fixed_count", "heuristic", "never", "exact", "at_cap"):
        result = run(fn, _contract(kind, num_completed=1, completed_capacity=None))
        outcomes[kind] = (result.best.output_ids, len(result.steps), result.stop)
    assert outcomes["fixed_count"] == ((EOS,), 1, B.BeamStop.EARLY_STOP)
    assert outcomes["heuristic"] == ((EOS,), 1, B.BeamStop.EARLY_STOP)
    assert outcomes["never"][0] == outcomes["exact"][0] == outcomes["at_cap"][0] == (3, EOS)
    assert outcomes["exact"][1] == 2 and outcomes["exact"][2] is B.BeamStop.EARLY_STOP
    assert outcomes["at_cap"][1] == 4


def test_exact_bound_stops_as_soon_as_no_live_hypothesis_can_win():
    """transition.beam_stop (exact): alpha = 0, an EOS of probability 0.9 at step 0 ends the search."""
    fn = table_fn(5, {(): [0.02, 0.03, 0.9, 0.05, 0.0]})
    result = run(fn, _contract("exact", alpha=0.0))
    assert result.stop is B.BeamStop.EARLY_STOP and len(result.steps) == 1 and result.best.output_ids == (EOS,)
    # The admissible bound of the best live hypothesis ([3], log 0.05) is its own score at alpha = 0.
    assert B.admissible_bound(B.LengthPenalty(), math.log(0.05), 1, 4) == math.log(0.05)


def test_admissible_bound_uses_the_cap_for_positive_alpha_and_the_next_length_otherwise():
    """transition.beam_stop: the exact bound is s / lp(G) for alpha > 0 and s / lp(g + 1) for alpha < 0."""
    for form in B.PenaltyForm:
        for alpha, n in ((0.8, 9), (-0.8, 4)):
            pen = B.LengthPenalty(alpha=alpha, form=form)
            bound = B.admissible_bound(pen, -2.0, 3, 9)
            assert bound == -2.0 / pen.denominator(n)
            # Every completion with score <= -2 and length 4..9 stays at or below the bound.
            assert all(s / pen.denominator(m) <= bound for s in (-2.0, -2.5) for m in range(4, 10))


def test_fixed_count_waits_for_n_completions():
    """transition.beam_stop (fixed_count, HF early_stopping=True): stop once n = K hypotheses completed."""
    rows = {(): [0.0, 0.0, 0.6, 0.3, 0.1], (3,): [0.0, 0.0, 0.5, 0.25, 0.25], (4,): [0.0, 0.0, 0.1, 0.9, 0.0]}
    result = run(table_fn(5, rows), _contract("fixed_count"))
    assert [len(s.completed) for s in result.states] == [0, 1, 2]
    assert result.stop is B.BeamStop.EARLY_STOP and len(result.steps) == 2


def test_length_cap_closes_remaining_hypotheses_with_finish_reason_length():
    """transition.beam_step: at G every live child completes with `length`; EOS at the cap finishes `eos`."""
    rows = {(): [0.1, 0.0, 0.1, 0.5, 0.3], (3,): [0.2, 0.0, 0.4, 0.3, 0.1], (4,): [0.5, 0.0, 0.1, 0.2, 0.2]}
    params = B.BeamParams(num_beams=2, max_new_tokens=2, eos_ids=(EOS,), early_stop="at_cap")
    result = run(table_fn(5, rows), params)
    last = result.steps[-1]
    assert result.stop is B.BeamStop.LENGTH_CAP and not result.states[-1].live
    by_ids = {b.output_ids: b for b in last.completed}
    assert by_ids[(3, EOS)].triggers == (FinishReason.EOS, FinishReason.LENGTH)
    assert by_ids[(3, EOS)].finish_reason is FinishReason.EOS
    closed = [b for b in last.completed if b.finish_reason is FinishReason.LENGTH]
    assert sorted(b.output_ids for b in closed) == [(3, 3), (4, 0)]  # the refilled live frontier, both closed
    assert all(b.length == 2 for b in last.completed)

    hf_rule = attrs.evolve(params, length_cap_rule="close_top_ranks")
    top = run(table_fn(5, rows), hf_rule).steps[-1]
    # Ranks: (3,EOS) -1.609; (3,3) and (4,0) tie at log .5 + log .3, the lower flat index 3 < 5 first.
    # HF keeps only ranks < K = 2 and discards (4, 0).
    assert sorted(b.output_ids for b in top.completed) == [(3, EOS), (3, 3)]
    assert [(c.parent, c.token, c.rank) for c in top.discarded] == [(1, 0, 2)]


# ---------------------------------------------------------------------------------------------
# Width one, HF parameters, exactly-once, trace shape
# ---------------------------------------------------------------------------------------------


def test_width_one_equals_greedy_on_a_table():
    """selector.beam_topk with K = 1 is argmax with the lowest-id tie rule; scores are the same sums."""
    rows = {(): [0.2, 0.4, 0.0, 0.4, 0.0], (1,): [0.5, 0.0, 0.5, 0.0, 0.0]}
    result = run(table_fn(5, rows), B.BeamParams(num_beams=1, max_new_tokens=3, eos_ids=(EOS,)))
    assert result.best.output_ids == (1, 0, 0)
    assert result.best.score == ((0.0 + math.log(0.4)) + math.log(0.5)) + math.log(0.2)


def test_hf_compatible_parameters():
    """BeamParams.hf_compatible maps early_stopping True/False/'never' and HF's fixed choices."""
    p = B.BeamParams.hf_compatible(3, 10, [2, 5], length_penalty=0.5, early_stopping="never")
    assert (p.early_stop, p.required_completed, p.completed_capacity) == (B.EarlyStop.NEVER, 3, 3)
    assert p.length_cap_rule is B.LengthCapRule.CLOSE_TOP_RANKS and p.hf_envelope
    assert p.hf_candidate_window == 9 and B.BeamParams.hf_compatible(3, 10, []).hf_candidate_window == 6
    assert B.BeamParams.hf_compatible(2, 5, [2], early_stopping=True).early_stop is B.EarlyStop.FIXED_COUNT
    assert B.BeamParams.hf_compatible(2, 5, [2]).early_stop is B.EarlyStop.HEURISTIC
    assert B.BeamParams(num_beams=2, max_new_tokens=5).required_completed == 1
    assert p.revision() != attrs.evolve(p, hf_envelope=False).revision()


def test_each_score_row_is_consumed_once_and_nothing_runs_after_done():
    """transition.beam_step / transition.beam_call guards: beam.not_enabled."""
    params = B.BeamParams(num_beams=2, max_new_tokens=1)
    state = B.initial_state(params, PROMPT)
    with pytest.raises(Rejection) as e:
        B.beam_step(params, state, np.zeros((1, 4)))
    assert e.value.code == "beam.not_enabled"
    called = B.beam_call(params, state)
    with pytest.raises(Rejection):
        B.beam_call(params, called)
    done, _ = B.beam_step(params, called, np.log(np.full((1, 4), 0.25)))
    assert done.phase is B.BeamPhase.DONE and done.stop is B.BeamStop.LENGTH_CAP
    for action in (lambda: B.beam_call(params, done), lambda: B.beam_step(params, done, np.zeros((0, 4)))):
        with pytest.raises(Rejection) as e:
            action()
        assert e.value.code == "beam.not_enabled"


def test_beam_step_record_is_the_beam_step_trace_event():
    """The record's event has exactly docs/design.md section 6 `beam_step` fields and is strict JSON."""
    params = B.BeamParams(num_beams=2, max_new_tokens=4, eos_ids=(EOS,), early_stop="at_cap")
    result = run(table_fn(5, EARLY_EOS_ROWS), params)
    events = result.events()
    assert all(set(e) == {"step", "parents", "tokens", "scores", "completed"} for e in events)
    json.dumps(events, allow_nan=False)
    assert events[0]["parents"] == [0, 0] and events[0]["tokens"] == [3, 4]
    assert events[0]["completed"][0]["token"] == EOS and events[0]["completed"][0]["finish_reason"] == "eos"
    assert [e["step"] for e in events] == list(range(len(events)))


def test_vacant_slots_when_fewer_candidates_than_beams():
    """selector.beam_topk: -inf candidates are never kept, so K > V leaves vacant slots (normative)."""
    params = B.BeamParams(num_beams=4, max_new_tokens=2, early_stop="at_cap")
    result = run(table_fn(3, {(): [0.5, 0.0, 0.5]}), params)
    assert [b.output_ids for b in result.states[1].live] == [(0,), (2,)]
    assert result.states[1].beam_scores(4)[2:].tolist() == [-math.inf, -math.inf]
    assert len(result.states[2].completed) == 4


# ---------------------------------------------------------------------------------------------
# Typed errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, code", [
    ({"num_beams": 0, "max_new_tokens": 3}, "beam.invalid_width"),
    ({"num_beams": True, "max_new_tokens": 3}, "beam.invalid_width"),
    ({"num_beams": 1.5, "max_new_tokens": 3}, "beam.invalid_width"),
    ({"num_beams": 2, "max_new_tokens": 0}, "beam.invalid_max_new_tokens"),
    ({"num_beams": 2, "max_new_tokens": 3, "eos_ids": (2, 2)}, "beam.invalid_eos"),
    ({"num_beams": 2, "max_new_tokens": 3, "eos_ids": (-1,)}, "beam.invalid_eos"),
    ({"num_beams": 2, "max_new_tokens": 3, "early_stop": "sometimes"}, "beam.invalid_early_stopping"),
    ({"num_beams": 2, "max_new_tokens": 3, "completed_capacity": 0}, "beam.invalid_capacity"),
    ({"num_beams": 2, "max_new_tokens": 3, "num_completed": 0}, "beam.invalid_num_completed"),
    ({"num_beams": 3, "max_new_tokens": 3, "early_stop": "heuristic", "completed_capacity": 2}, "beam.invalid_num_completed"),
])
def test_invalid_parameters_are_rejected(kwargs, code):
    """BeamParams validation raises the registered beam.* code."""
    with pytest.raises(Rejection) as e:
        B.BeamParams(**kwargs)
    assert e.value.code == code and code in ERROR_CODES


@pytest.mark.parametrize("alpha, form", [(math.nan, "power"), (math.inf, "power"), (1.0, "cubic"), ("1", "power")])
def test_invalid_length_penalty_is_rejected(alpha, form):
    with pytest.raises(Rejection) as e:
        B.LengthPenalty(alpha=alpha, form=form)
    assert e.value.code == "beam.invalid_length_penalty"


@pytest.mark.parametrize("early_stopping", ["yes", None, 1])
def test_hf_compatible_rejects_unknown_early_stopping(early_stopping):
    with pytest.raises(Rejection) as e:
        B.BeamParams.hf_compatible(2, 4, [2], early_stopping=early_stopping)
    assert e.value.code == "beam.invalid_early_stopping"


@pytest.mark.parametrize("rows, code", [
    (np.array([[0.0, np.nan, -1.0, -1.0]]), "beam.nan_score"),
    (np.array([[0.5, -1.0, -1.0, -1.0]]), "beam.score_not_logprob"),
    (np.array([[np.inf, -1.0, -1.0, -1.0]]), "beam.score_not_logprob"),
    (np.zeros((2, 4)), "beam.shape"),
    (np.zeros(4), "beam.shape"),
    (np.zeros((1, 2)), "beam.invalid_eos"),
])
def test_bad_score_rows_are_rejected_and_change_nothing(rows, code):
    """beam_step validates before acting: a typed error and the input state unchanged."""
    params = B.BeamParams(num_beams=2, max_new_tokens=3, eos_ids=(EOS,))
    state = B.beam_call(params, B.initial_state(params, PROMPT))
    snapshot = attrs.evolve(state)
    with pytest.raises(Rejection) as e:
        B.beam_step(params, state, rows)
    assert e.value.code == code and state == snapshot


def test_vocabulary_size_is_fixed_for_the_search():
    params = B.BeamParams(num_beams=2, max_new_tokens=3)
    with pytest.raises(Rejection) as e:
        B.beam_search(lambda p: np.full(4 if len(p) == len(PROMPT) else 5, -2.0), PROMPT, params)
    assert e.value.code == "beam.shape"


def test_hf_envelope_rejects_windows_with_sentinel_candidates():
    """beam.outside_hf_envelope: V < 2K at the first step means HF would keep -1e9 sentinel beams."""
    params = B.BeamParams.hf_compatible(3, 4, [EOS])
    with pytest.raises(Rejection) as e:
        B.beam_search(table_fn(5, {}), PROMPT, params)
    assert e.value.code == "beam.outside_hf_envelope"
    B.beam_search(table_fn(9, {}), PROMPT, params)  # 9 finite candidates >= window 9: inside


@pytest.mark.parametrize("prompt", [(), (1, -3), ("a",)])
def test_bad_prompts_are_rejected(prompt):
    with pytest.raises(Rejection) as e:
        B.initial_state(B.BeamParams(num_beams=1, max_new_tokens=1), prompt)
    assert e.value.code == "beam.empty_prompt"


def test_lane_states_must_be_json_values():
    lanes = B.BranchLanes(constraint_init={1, 2})
    with pytest.raises(Rejection) as e:
        B.initial_state(B.BeamParams(num_beams=1, max_new_tokens=1), PROMPT, lanes=lanes)
    assert e.value.code == "beam.invalid_lane_state"


def test_rules_are_registered():
    for rid in ("transition.beam_init", "transition.beam_call", "transition.beam_step", "transition.beam_fork",
                "transition.beam_stop", "selector.beam_topk", "transform.beam_length_penalty",
                "invariant.beam_parent_coupling", "invariant.beam_fork_before_append",
                "invariant.beam_completed_never_expanded", "invariant.beam_first_step_single_parent",
                "invariant.beam_live_frontier", "invariant.beam_completed_metadata"):
        assert RULES[rid].obj is not None, rid


def test_score_rows_are_typed_log_probabilities():
    """The declared score kind is the policy's LOGPROBS: a typed logits row is refused, a logprobs row used."""
    from decodespec.spec.policy.scores import ScoreKind, ScoreRow

    assert B.SCORE_KIND is ScoreKind.LOGPROBS
    params = B.BeamParams(num_beams=2, max_new_tokens=2, early_stop="at_cap")
    uniform = np.log(np.full(4, 0.25))
    typed = B.beam_search(lambda p: ScoreRow.create(uniform, kind="logprobs"), PROMPT, params)
    assert [h.output_ids for h in typed.hypotheses] == [h.output_ids for h in run(table_fn(4, {}), params).hypotheses]
    with pytest.raises(Rejection) as e:
        B.beam_search(lambda p: ScoreRow.create(np.zeros(4), kind="logits"), PROMPT, params)
    assert e.value.code == "policy.score_kind_mismatch"


def test_beam_params_from_a_beam_family_policy():
    """BeamParams.from_policy maps the policy's HF-named beam fields onto BeamParams.hf_compatible."""
    from decodespec.spec.policy.config import EarlyStopping, Family, PolicyConfig

    config = PolicyConfig(family=Family.BEAM, num_beams=3, length_penalty=0.5, early_stopping=EarlyStopping.NEVER)
    assert B.BeamParams.from_policy(config, 8, [EOS]) == B.BeamParams.hf_compatible(
        3, 8, [EOS], length_penalty=0.5, early_stopping="never")
    with pytest.raises(Rejection) as e:
        B.BeamParams.from_policy(PolicyConfig.greedy(), 8, [EOS])
    assert e.value.code == "policy.family_mismatch"
