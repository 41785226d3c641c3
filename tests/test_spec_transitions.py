"""Guards and effects of every request transition (M3.10 "One request as a transition system").

Each test names the rule it targets.  The frontier table of M3.10 0x08 ("Output, input, and
cache frontiers") and the first-output off-by-one are checked on concrete runs.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.checks.modelcheck.explore import ExploreBounds, candidate_actions, frontier_label, params_for_bounds
from decodespec.spec import invariants as inv
from decodespec.spec.actions import Admit, Cancel, Commit, Decide, Fault, Launch, Recover, StreamFailure, SupportEmpty
from decodespec.spec.enums import CallKind, FinishReason, PendingTag, Selection
from decodespec.spec.errors import ERROR_CODES, Rejection, ResourceLimit
from decodespec.spec.rules import RULES, rules_of_kind
from decodespec.spec.state import InterruptPoint, Phase, RequestParams, RequestState, initial_state, interrupt_point, is_terminal
from decodespec.spec.transitions import (
    MACHINE,
    completion_reason,
    enabled,
    expected_report,
    guard_failure,
    select_logical_state,
    step,
)

FR = FinishReason
PREFILL, DECODE, REPAIR = CallKind.PREFILL, CallKind.DECODE, CallKind.REPAIR


def P(**kw) -> RequestParams:
    """Small-scope params: V=3 (EOS 2), L=3, G=3, one-shot prefill unless overridden."""
    kw.setdefault("prefill_chunk", None)
    return params_for_bounds(ExploreBounds(**kw))


def run(params: RequestParams, *actions) -> RequestState:
    state = initial_state(params)
    for action in actions:
        state = step(params, state, action)
        assert not inv.violated(params, state), inv.violated(params, state)
    return state


def done(params: RequestParams, state: RequestState) -> RequestState:
    """Complete the in-flight call with the report under which both rosters agree."""
    return step(params, state, expected_report(params, state))


def prefilled(params: RequestParams) -> RequestState:
    return done(params, run(params, Admit(), Launch(PREFILL, 0, params.prompt_len)))


def select(params: RequestParams, state: RequestState, token: int, draws: int = 0, **commit) -> RequestState:
    state = step(params, state, Decide(state.score.score_id, token, draws))
    return step(params, state, Commit(state.receipt.receipt_id, **commit))


def rejected(params: RequestParams, state: RequestState, action) -> Rejection:
    with pytest.raises(Rejection) as info:
        step(params, state, action)
    assert info.value.code == "transition.not_enabled"
    assert not enabled(params, state, action)
    return info.value


def test_only_transition_code_is_not_enabled_and_every_rule_is_registered() -> None:
    assert {c for c in ERROR_CODES if c.startswith("transition.")} == {"transition.not_enabled"}
    modules = ("decodespec.spec.transitions", "decodespec.spec.participation")  # the request machine and its rank layer
    mine = {r.id for r in rules_of_kind("transition") if r.obj.__module__ in modules}
    assert set(MACHINE.rule_ids()) == mine and len(mine) == 19 + 4
    for rule in (RULES[rid] for rid in mine):
        assert rule.section.startswith("M3.10") and "Guard" in rule.statement and "Effect" in rule.statement


def test_admit() -> None:
    """transition.admit: NEW -> READY, nothing processed, lanes absent, RNG at the envelope counter."""
    params = attrs.evolve(P(), rng_counter_start=7)
    state = run(params, Admit())
    assert (state.phase, state.processed, state.output_ids, state.pending_tag) == (Phase.READY, 0, (), PendingTag.EMPTY)
    assert state.lanes == (("self_kv", None),) and state.rng_counter == 7
    rejected(params, state, Admit())


def test_admit_no_call() -> None:
    """transition.admit_no_call: G=0 no_call finishes with length, O=0, P=0, and no call is ever enabled."""
    params = P(max_new_tokens=0, zero_new_tokens="no_call")
    state = run(params, Admit())
    assert (state.phase, state.finish_reason, state.processed, state.num_calls) == (Phase.FINISHED, FR.LENGTH, 0, 0)
    assert is_terminal(params, state)
    rejected(params, state, Launch(PREFILL, 0, 3))


def test_admit_reject() -> None:
    """transition.admit_reject: G=0 reject is terminal with nothing built."""
    params = P(max_new_tokens=0, zero_new_tokens="reject")
    state = run(params, Admit())
    assert state.phase is Phase.REJECTED and is_terminal(params, state) and state.finish_reason is None
    for action in (Launch(PREFILL, 0, 3), Cancel(FR.CANCELLED), Recover()):
        rejected(params, state, action)


def test_g0_prefill_only() -> None:
    """transition.complete_all_new, G=0 prefill_only: the prefill runs, no score, finish length, P = L."""
    params = P(max_new_tokens=0, zero_new_tokens="prefill_only")
    state = run(params, Admit(), Launch(PREFILL, 0, 3))
    assert state.in_flight.decision_row is None
    state = done(params, state)
    assert (state.phase, state.finish_reason, state.processed, state.score) == (Phase.FINISHED, FR.LENGTH, 3, None)
    assert state.scores == () and is_terminal(params, state)


def test_launch_prefill_guards_and_effect() -> None:
    """transition.launch_prefill: start = P, one-shot covers the prompt, chunks bounded, not quarantined."""
    params = P()
    ready = run(params, Admit())
    assert "start == expected start" in rejected(params, ready, Launch(PREFILL, 1, 2)).message
    assert "prefill length" in rejected(params, ready, Launch(PREFILL, 0, 2)).message  # one-shot must cover L
    state = step(params, ready, Launch(PREFILL, 0, 3))
    call = state.in_flight
    assert (state.phase, call.kind, call.position_ids, call.roster, call.decision_row) == (
        Phase.IN_FLIGHT, PREFILL, (0, 1, 2), ("self_kv",), 2)
    rejected(params, state, Launch(PREFILL, 0, 3))  # one call at a time
    chunked = P(prefill_chunk=2)
    ready = run(chunked, Admit())
    rejected(chunked, ready, Launch(PREFILL, 0, 3))  # longer than the chunk
    state = step(chunked, ready, Launch(PREFILL, 0, 2))
    assert state.in_flight.decision_row is None  # a non-final chunk owns no decision
    state = done(chunked, state)
    assert (state.phase, state.processed, state.score, state.lane_frontier("self_kv")) == (Phase.READY, 2, None, 2)
    state = step(chunked, state, Launch(PREFILL, 2, 1))
    assert state.in_flight.decision_row == 2


def test_frontier_table_and_first_output_off_by_one() -> None:
    """transition.complete_all_new, transition.commit, transition.launch_decode, transition.launch_repair:
    the M3.10 0x08 boundary table, P = L + G - 1 at stop and P = L + G only after repair."""
    params = P(max_new_tokens=2, final_cache="all_outputs")
    L = params.prompt_len
    state = prefilled(params)
    assert (state.output_count, len(state.pending_ids), state.processed, state.k_frontier(params)) == (0, 0, L, L)
    assert state.score == state.scores[-1] and (state.score.processed, state.score.output_count) == (L, 0)
    state = select(params, state, 0)
    assert (state.output_count, state.pending_ids, state.pending_tag, state.processed) == (1, (0,), PendingTag.PENDING_NEXT_CALL, L)
    state = step(params, state, Launch(DECODE, L, 1))
    assert state.in_flight.position_ids == (L,) and state.in_flight.decision_row == L
    state = done(params, state)
    assert (state.output_count, state.pending_ids, state.processed, state.k_frontier(params)) == (1, (), L + 1, L + 1)
    state = select(params, state, 1)  # O = G: length
    assert (state.phase, state.finish_reason, state.pending_tag, state.processed) == (
        Phase.FINISHED, FR.LENGTH, PendingTag.CLOSED_UNPROCESSED, L + 2 - 1)
    assert not is_terminal(params, state)  # all_outputs owes the repair
    state = step(params, state, Launch(REPAIR, L + 1, 1))
    assert state.phase is Phase.FINISHED and state.in_flight.decision_row is None
    state = done(params, state)
    assert (state.processed, state.pending_tag, state.score, state.k_frontier(params)) == (L + 2, PendingTag.EMPTY, None, L + 2)
    assert is_terminal(params, state) and state.output_ids == (0, 1)
    assert state.output_logprobs == tuple(r.score_id for r in state.consumed)


def test_launch_decode_guards() -> None:
    """transition.launch_decode: needs a PENDING_NEXT_CALL token and start = P (a reset cache_position is refused)."""
    params = P()
    state = prefilled(params)
    rejected(params, state, Launch(DECODE, 3, 1))  # phase SCORED, nothing pending
    state = select(params, state, 0)
    assert "start == expected start" in rejected(params, state, Launch(DECODE, 0, 1)).message
    rejected(params, state, Launch(DECODE, 3, 2))
    rejected(params, state, Launch(PREFILL, 3, 1))  # the prompt is processed


def test_uncached_calls_recompute_the_full_prefix() -> None:
    """transition.launch_decode without a cache: start 0, length L + O, no lanes, no quarantine after ALL_OLD."""
    params = P(cache="none", final_cache="processed_inputs_only", max_retries=1)
    state = select(params, prefilled(params), 0)
    rejected(params, state, Launch(DECODE, 3, 1))
    state = step(params, state, Launch(DECODE, 0, 4))
    assert state.in_flight.roster == () and state.in_flight.decision_row == 3
    failed = step(params, state, attrs.evolve(expected_report(params, state), stages_ok=False))
    assert failed.phase is Phase.READY and not failed.quarantined
    state = done(params, state)
    assert (state.processed, state.lanes, state.k_frontier(params)) == (4, (), None)


def test_launch_repair_guard() -> None:
    """transition.launch_repair: only when all_outputs is promised and the finish is a content reason."""
    params = P(max_new_tokens=1, final_cache="processed_inputs_only")
    state = select(params, prefilled(params), 0)
    assert state.phase is Phase.FINISHED and is_terminal(params, state)
    rejected(params, state, Launch(REPAIR, 3, 1))
    params = P(max_new_tokens=2, final_cache="all_outputs")
    cancelled = step(params, select(params, prefilled(params), 0), Cancel(FR.CANCELLED))
    assert cancelled.pending_tag is PendingTag.CLOSED_UNPROCESSED and is_terminal(params, cancelled)
    rejected(params, cancelled, Launch(REPAIR, 3, 1))


def test_decide_guards_and_receipt() -> None:
    """transition.decide: current score, token in vocabulary, EOS only after min_new_tokens, bounded draws."""
    params = P(min_new_tokens=1, max_draws=1)
    state = prefilled(params)
    sid = state.score.score_id
    assert "current score" in rejected(params, state, Decide("score-0", 0)).message
    assert "0 <= token_id < V" in rejected(params, state, Decide(sid, 3)).message
    assert "EOS only once" in rejected(params, state, Decide(sid, 2)).message
    assert "draws" in rejected(params, state, Decide(sid, 0, 2)).message
    decided = step(params, state, Decide(sid, 1, 1))
    assert decided.phase is Phase.DECIDED and decided.receipt.receipt_id == "receipt-0"
    assert (decided.receipt.score_id, decided.receipt.token_id, decided.receipt.draws, decided.receipt.rng_counter_before) == (sid, 1, 1, 0)
    assert decided.rng_counter == 0  # advanced only at commit
    rejected(params, decided, Decide(sid, 0))  # one decision per score row
    committed = step(params, decided, Commit("receipt-0"))
    assert committed.rng_counter == 1 and committed.consumed == (decided.receipt,)


def test_commit_consumes_once_and_refuses_stale_receipts() -> None:
    """transition.commit: a receipt is consumed once; a duplicate, a stale and an unknown receipt are refused."""
    params = P()
    state = step(params, prefilled(params), Decide("score-1", 0))
    assert "pending one" in rejected(params, state, Commit("receipt-9")).message
    state = step(params, state, Commit("receipt-0"))
    assert rejected(params, state, Commit("receipt-0"))  # duplicate: consumed already
    state = done(params, step(params, state, Launch(DECODE, 3, 1)))
    state = step(params, state, Decide(state.score.score_id, 1))
    assert "never consumed" in rejected(params, state, Commit("receipt-0")).message
    discarded = step(params, state, Cancel(FR.TIMEOUT))
    assert discarded.receipt is None and "receipt-1" in discarded.issued
    rejected(params, discarded, Commit("receipt-1"))  # stale: discarded by the timeout


def test_commit_triggers_and_precedence() -> None:
    """transition.commit: EOS, length, context_length and text triggers; one canonical reason, every trigger kept."""
    params = P(stop_strings=True, structured=True)
    state = select(params, prefilled(params), 2)
    assert (state.finish_reason, state.triggers, state.pending_tag) == (FR.EOS, {FR.EOS}, PendingTag.CLOSED_UNPROCESSED)
    state = select(params, prefilled(params), 2, text_triggers=frozenset({FR.STOP_STRING}))
    assert state.finish_reason is FR.STOP_STRING and state.triggers == {FR.EOS, FR.STOP_STRING}
    state = select(params, prefilled(params), 0, text_triggers=frozenset({FR.STRUCTURED_ERROR}))
    assert state.finish_reason is FR.STRUCTURED_ERROR
    capped = attrs.evolve(P(), context_cap=4)
    state = select(capped, prefilled(capped), 0)
    assert state.finish_reason is FR.CONTEXT_LENGTH  # L + O = C before O = G
    plain = P()
    decided = step(plain, prefilled(plain), Decide("score-1", 0))
    assert "text triggers" in rejected(plain, decided, Commit("receipt-0", frozenset({FR.STOP_STRING}))).message
    late = P(stop_strings=True, min_new_tokens=1)
    decided = step(late, prefilled(late), Decide("score-1", 0))
    rejected(late, decided, Commit("receipt-0", frozenset({FR.STOP_STRING})))  # suppressed below min_new_tokens


def test_complete_all_old_keeps_everything_and_quarantines() -> None:
    """transition.complete_all_old, transition.recover: missing lane -> ALL_OLD, no score, quarantine, retry
    only after recovery (new generation), then device_error once retries are spent."""
    params = P(max_retries=1)
    state = run(params, Admit(), Launch(PREFILL, 0, 3))
    missing = attrs.evolve(expected_report(params, state), lanes=())
    assert select_logical_state(params, state, missing) is Selection.ALL_OLD
    assert completion_reason(params, state, missing) == "missing_lane"
    state = step(params, state, missing)
    assert (state.phase, state.processed, state.score, state.quarantined, state.generation) == (Phase.READY, 0, None, True, 0)
    assert state.last_completion.selection is Selection.ALL_OLD
    assert "quarantined" in rejected(params, state, Launch(PREFILL, 0, 3)).message
    state = step(params, state, Recover())
    assert (state.quarantined, state.generation) == (False, 1)
    rejected(params, state, Recover())
    state = step(params, state, Launch(PREFILL, 0, 3))
    assert state.in_flight.generation == 1
    stale = attrs.evolve(expected_report(params, state), generation=0)
    assert completion_reason(params, state, stale) == "missing_lane"
    state = step(params, state, stale)
    assert (state.phase, state.finish_reason, state.triggers) == (Phase.FINISHED, FR.DEVICE_ERROR, {FR.DEVICE_ERROR})


@pytest.mark.parametrize("change, reason", [
    ({"stages_ok": False}, "device_fault"),
    ({"output_row": 0}, "device_fault"),
    ({"lanes": (("self_kv", 2),)}, "missing_lane"),
    ({"lanes": (("self_kv", 3), ("recurrent", 3))}, "missing_lane"),
])
def test_select_logical_state_needs_both_rosters(change: dict, reason: str) -> None:
    """transition.complete_all_new vs transition.complete_all_old: any disagreement selects ALL_OLD."""
    params = P()
    state = run(params, Admit(), Launch(PREFILL, 0, 3))
    good = expected_report(params, state)
    assert select_logical_state(params, state, good) is Selection.ALL_NEW and completion_reason(params, state, good) is None
    bad = attrs.evolve(good, **change)
    assert select_logical_state(params, state, bad) is Selection.ALL_OLD
    assert completion_reason(params, state, bad) == reason
    assert "call_id" in rejected(params, state, attrs.evolve(good, call_id=5)).message


def test_fault() -> None:
    """transition.fault: a reported fault forces ALL_OLD even with an agreeing roster report."""
    params = P(max_retries=0)
    state = run(params, Admit(), Launch(PREFILL, 0, 3))
    faulted = step(params, state, Fault("device_fault"))
    assert faulted.in_flight.fault == "device_fault"
    rejected(params, faulted, Fault("missing_lane"))
    rejected(params, state, Fault("oom"))
    finished = step(params, faulted, expected_report(params, faulted))
    assert finished.finish_reason is FR.DEVICE_ERROR and finished.processed == 0
    uncached = P(cache="none", final_cache="processed_inputs_only")
    rejected(uncached, run(uncached, Admit(), Launch(PREFILL, 0, 3)), Fault("missing_lane"))


def test_interrupt_before_launch() -> None:
    """transition.interrupt_before_launch: no launch, no logical change; the pending token is closed."""
    params = P()
    state = select(params, prefilled(params), 0)
    assert interrupt_point(state).value == "before_launch"
    after = step(params, state, Cancel(FR.CANCELLED))
    assert (after.phase, after.finish_reason, after.pending_tag, after.output_ids, after.processed) == (
        Phase.FINISHED, FR.CANCELLED, PendingTag.CLOSED_UNPROCESSED, (0,), 3)
    rejected(params, after, Cancel(FR.TIMEOUT))
    rejected(params, state, Cancel(FR.EOS))


def test_interrupt_in_flight() -> None:
    """transition.interrupt_in_flight: recorded on the call; completion selects ALL_OLD and finishes with all triggers."""
    params = P()
    state = select(params, prefilled(params), 0)
    state = step(params, state, Launch(DECODE, 3, 1))
    state = step(params, state, Cancel(FR.TIMEOUT))
    rejected(params, state, Cancel(FR.TIMEOUT))
    state = step(params, state, Cancel(FR.CANCELLED))
    report = expected_report(params, state)
    assert completion_reason(params, state, report) == "cancelled"
    state = step(params, state, report)
    assert (state.finish_reason, state.triggers, state.processed, state.score) == (
        FR.CANCELLED, {FR.CANCELLED, FR.TIMEOUT}, 3, None)
    assert state.quarantined and state.pending_tag is PendingTag.CLOSED_UNPROCESSED


def test_interrupt_after_completion_and_decision() -> None:
    """transition.interrupt_after_completion, transition.interrupt_after_decision: the score / receipt is
    discarded unconsumed; the RNG counter is unchanged; P keeps the ALL_NEW call."""
    params = P(max_draws=1)
    scored = prefilled(params)
    after = step(params, scored, Cancel(FR.TIMEOUT))
    assert (after.score, after.processed, after.finish_reason, after.pending_tag) == (None, 3, FR.TIMEOUT, PendingTag.EMPTY)
    decided = step(params, scored, Decide(scored.score.score_id, 0, 1))
    after = step(params, decided, Cancel(FR.CANCELLED))
    assert (after.receipt, after.score, after.rng_counter, after.consumed, after.output_ids) == (None, None, 0, (), ())


def test_stream_failure_needs_a_stream() -> None:
    """transition.interrupt_before_launch via StreamFailure: closes with stream_error; refused without a stream."""
    params = P(stream=True)
    state = step(params, select(params, prefilled(params), 0), StreamFailure())
    assert state.finish_reason is FR.STREAM_ERROR
    quiet = P(stream=False)
    rejected(quiet, select(quiet, prefilled(quiet), 0), StreamFailure())


def test_static_capacity_is_a_resource_limit_and_changes_nothing() -> None:
    """transition.launch_decode with a static cache: an overflowing write raises cache.capacity_exceeded."""
    params = attrs.evolve(P(cache="static", capacity=4, final_cache="processed_inputs_only"), context_cap=10)
    state = select(params, prefilled(params), 0)
    state = select(params, done(params, step(params, state, Launch(DECODE, 3, 1))), 1)
    assert state.processed == 4 and state.phase is Phase.READY
    with pytest.raises(ResourceLimit) as info:
        step(params, state, Launch(DECODE, 4, 1))
    assert info.value.code == "cache.capacity_exceeded" and state.in_flight is None


def test_encoder_decoder_fixed_lanes() -> None:
    """profile.encoder_decoder: encoder memory and cross K/V are set to S by the first call and never change."""
    params = P(profile="encoder_decoder", prompt_len=1, source_len=4)
    state = prefilled(params)
    assert dict(state.lanes) == {"encoder_memory": 4, "cross_kv": 4, "self_kv": 1}
    state = done(params, step(params, select(params, state, 0), Launch(DECODE, 1, 1)))
    assert dict(state.lanes) == {"encoder_memory": 4, "cross_kv": 4, "self_kv": 2}
    assert state.k_frontier(params) is None and state.frontiers(params) == {
        "P_dyn": 2, "F_lane": {"encoder_memory": 4, "cross_kv": 4, "self_kv": 2}}


def test_prefix_lm_prefix_is_one_call() -> None:
    """profile.prefix_lm: a chunk may not split the bidirectional prefix."""
    params = P(profile="prefix_lm", prefix_length=2, prefill_chunk=3)
    ready = run(params, Admit())
    assert "prefix" in rejected(params, ready, Launch(PREFILL, 0, 1)).message
    state = done(params, step(params, ready, Launch(PREFILL, 0, 2)))
    assert state.processed == 2 and state.phase is Phase.READY
    assert step(params, state, Launch(PREFILL, 2, 1)).in_flight.decision_row == 2


def test_hybrid_lanes_advance_together() -> None:
    """profile.hybrid: attention K/V and recurrent state report the same frontier P_dyn; one missing -> ALL_OLD."""
    params = P(profile="hybrid")
    state = run(params, Admit(), Launch(PREFILL, 0, 3))
    report = expected_report(params, state)
    assert report.lanes == (("self_kv", 3), ("recurrent", 3))
    assert completion_reason(params, state, attrs.evolve(report, lanes=(("self_kv", 3),))) == "missing_lane"
    state = done(params, state)
    assert dict(state.lanes) == {"self_kv": 3, "recurrent": 3}
    # M3.10 0x01: a hybrid has no single K; it reports P_dyn and one F_lane per lane.
    assert state.frontiers(params) == {"P_dyn": 3, "F_lane": {"self_kv": 3, "recurrent": 3}} and state.k_frontier(params) is None
    decoder = P()
    assert done(decoder, run(decoder, Admit(), Launch(PREFILL, 0, 3))).frontiers(decoder) == {"P": 3, "K": 3}
    assert frontier_label(params, state) == "P_dyn=3, F_lane={self_kv: 3, recurrent: 3}"


def test_disabled_action_names_the_guard_and_changes_nothing() -> None:
    params = P()
    state = run(params, Admit())
    before = state
    err = rejected(params, state, Decide("score-1", 0))
    assert err.details == {"rule": "transition.decide", "guard": "phase == SCORED"}
    assert guard_failure(params, state, Decide("score-1", 0)) == "transition.decide: phase == SCORED"
    assert guard_failure(params, state, Launch(PREFILL, 0, 3)) is None
    assert state == before


_BOUNDS = st.builds(
    ExploreBounds,
    vocab=st.integers(2, 4),
    prompt_len=st.integers(1, 3),
    max_new_tokens=st.integers(0, 4),
    min_new_tokens=st.integers(0, 1),
    profile=st.sampled_from(["decoder_only", "hybrid", "prefix_lm"]),
    cache=st.sampled_from(["none", "dynamic", "static"]),
    prefill_chunk=st.sampled_from([None, 1, 2, 3]),
    zero_new_tokens=st.sampled_from(["reject", "no_call", "prefill_only"]),
    final_cache=st.sampled_from(["processed_inputs_only", "all_outputs"]),
    max_retries=st.integers(0, 2),
    max_draws=st.integers(0, 1),
    stream=st.booleans(),
    stop_strings=st.booleans(),
    structured=st.booleans(),
    context_cap=st.sampled_from([None, 3, 5]),
)


@settings(deadline=None)
@given(bounds=_BOUNDS, data=st.data())
def test_random_walks_keep_every_invariant(bounds: ExploreBounds, data: st.DataObject) -> None:
    """Random runs (including adversarial actions) keep every invariant; refusals are typed and change nothing."""
    if bounds.profile == "prefix_lm":
        bounds = attrs.evolve(bounds, prefix_length=1)
    if bounds.cache == "none":
        bounds = attrs.evolve(bounds, final_cache="processed_inputs_only")
    try:
        params = params_for_bounds(bounds)
    except ValueError:
        return
    state = initial_state(params)
    for _ in range(40):
        actions = list(candidate_actions(params, state, bounds))
        if not actions:
            break
        action = data.draw(st.sampled_from(actions))
        try:
            nxt = step(params, state, action)
        except (Rejection, ResourceLimit):
            assert not enabled(params, state, action)
            continue
        assert enabled(params, state, action)
        assert not inv.violated(params, nxt), (action, inv.violated(params, nxt))
        state = nxt


def test_empty_support_is_a_typed_terminal_finish_that_keeps_the_output() -> None:
    """transition.decide_empty_support (M3.10 0x02 branch table "constraint/parser error"; M3.8 hard constraints):
    an empty legal support finishes with constraint_error; committed tokens, logprobs, P and the RNG counter stay,
    no receipt is issued, no call is due (not even the repair of an all_outputs promise)."""
    params = P(final_cache="all_outputs", max_draws=1)
    state = select(params, prefilled(params), 1, draws=1)
    state = done(params, step(params, state, Launch(DECODE, 3, 1)))
    assert state.phase is Phase.SCORED
    rejected(params, state, SupportEmpty("score-0"))  # a stale score
    before = state
    state = run_from(params, state, SupportEmpty(state.score.score_id))
    assert (state.phase, state.finish_reason, state.triggers) == (Phase.FINISHED, FR.CONSTRAINT_ERROR, frozenset({FR.CONSTRAINT_ERROR}))
    assert (state.output_ids, state.output_logprobs, state.processed, state.rng_counter, state.issued) == (
        before.output_ids, before.output_logprobs, before.processed, before.rng_counter, before.issued)
    assert state.score is None and state.receipt is None and state.pending_tag is PendingTag.EMPTY
    assert is_terminal(params, state) and interrupt_point(state) is None
    rejected(params, state, SupportEmpty(before.score.score_id))  # once only
    rejected(params, state, Launch(REPAIR, 4, 1))
    rejected(params, prefilled(params), SupportEmpty("score-x"))
    rejected(params, select(params, prefilled(params), 0), SupportEmpty("score-1"))  # READY: nothing to decide


def run_from(params: RequestParams, state: RequestState, *actions) -> RequestState:
    for action in actions:
        state = step(params, state, action)
        assert not inv.violated(params, state), inv.violated(params, state)
    return state


def _closed_with_repair_owed(**kw) -> tuple[RequestParams, RequestState]:
    params = P(max_new_tokens=1, final_cache="all_outputs", **kw)
    state = select(params, prefilled(params), 0)  # O = G: length closes the output, the repair is owed
    assert state.finish_reason is FR.LENGTH and not is_terminal(params, state)
    return params, run_from(params, state, Launch(REPAIR, 3, 1))


def test_a_failed_repair_does_not_rewrite_the_published_finish_reason() -> None:
    """transition.complete_all_old after the close (M3.10 "The first-output off-by-one": the repair call is not another
    output decision; 0x06: record every trigger, publish one reason): device_error is recorded, length stays published,
    the repair is abandoned and the request is terminal."""
    params, state = _closed_with_repair_owed(max_retries=0)
    state = run_from(params, state, attrs.evolve(expected_report(params, state), stages_ok=False))
    assert (state.finish_reason, state.triggers) == (FR.LENGTH, frozenset({FR.LENGTH, FR.DEVICE_ERROR}))
    assert state.pending_tag is PendingTag.CLOSED_UNPROCESSED and state.processed == 3 and is_terminal(params, state)
    rejected(params, state, Launch(REPAIR, 3, 1))  # abandoned, not owed again
    rejected(params, state, Recover())


@pytest.mark.parametrize("reason", [FR.CANCELLED, FR.TIMEOUT])
def test_a_cancel_or_timeout_during_the_repair_call_lands(reason) -> None:
    """transition.interrupt_in_flight on the repair call (phase FINISHED): the interrupt is recorded, the awaited call
    selects ALL_OLD, the repair is abandoned; the published finish reason stays length.  A stream failure cannot land
    on a closed stream."""
    params, state = _closed_with_repair_owed(stream=True)
    assert interrupt_point(state) is InterruptPoint.IN_FLIGHT
    rejected(params, state, StreamFailure())
    state = run_from(params, state, Cancel(reason))
    assert state.in_flight.interrupts == frozenset({reason}) and state.finish_reason is FR.LENGTH
    rejected(params, state, Cancel(reason))  # once per call
    state = run_from(params, state, expected_report(params, state))
    assert state.last_completion.selection is Selection.ALL_OLD and state.processed == 3
    assert (state.finish_reason, state.triggers) == (FR.LENGTH, frozenset({FR.LENGTH, reason}))
    assert is_terminal(params, state) and interrupt_point(state) is None
