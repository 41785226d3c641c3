"""M3.10 "One request as a transition system": guards and effects of every request transition.

``step(params, state, action) -> state`` and ``enabled(params, state, action) -> bool`` are pure.
Each transition is a named rule ``transition.<name>`` with a *guard* (a list of named clauses,
the first failing one is reported) and an *effect* (a function building the next state with
``attrs.evolve``).  A disabled action raises ``Rejection("transition.not_enabled")`` naming the
failing clause, or ``ResourceLimit("cache.capacity_exceeded")`` when the only failing clause is
the static-cache capacity; either way the state is unchanged (states are immutable values).

The transitions, grouped by the four events of the commit spine:

* admission: ``admit`` (G >= 1, or G = 0 with ``prefill_only``), ``admit_no_call`` and
  ``admit_reject`` (the other two G = 0 branches);
* model calls: ``launch_prefill`` (whole prompt or one chunk), ``launch_decode`` (the pending
  token), ``launch_repair`` (the closed final token, logits discarded), ``fault``,
  ``complete_all_new`` / ``complete_all_old`` (SELECT LOGICAL STATE from the closed rosters),
  ``recover`` (a quarantined handle proven reusable);
* decision: ``decide`` (bind an M3.8 receipt to the current score), ``decide_empty_support``
  (the policy found no legal token: the typed terminal finish ``constraint_error``);
* logical commit: ``commit`` (consume the receipt exactly once);
* interrupts (cancel, timeout, streamer failure): ``interrupt_before_launch``,
  ``interrupt_in_flight``, ``interrupt_after_completion``, ``interrupt_after_decision``;
* snapshots (:mod:`decodespec.spec.snapshot`): ``snapshot`` (an observation in either form)
  and ``restore`` (a fresh request of the same identity takes the snapshot's state).

Declared choices (where the seeds leave one): the RNG counter advances at commit by the
receipt's draws (a discarded receipt consumes nothing); an ALL_OLD completion of a cached call
quarantines the handle (in-place writers may have mutated it) and a retry needs ``recover``;
after ``max_retries`` failed calls the request finishes with ``device_error``; a streamer failure
closes the request like a cancellation with reason ``stream_error``; stop strings and structured
completion are reported at commit by the (uninterpreted) matcher.

:class:`Machine` holds the transition table so tests and the explorer can plug in a deliberately
broken effect (:meth:`Machine.with_effect`) and watch an invariant catch it.

Source: M3.10 "Authoritative phase and commit spine", "The first-output off-by-one", 0x02
branch table, 0x06 "One selection is an output-state transaction" and "Finish reason and RNG
precedence", 0x08, 0x0A "Logical recovery sockets" and "Asynchronous completion and error
boundaries".

Size: the transition table: every M3.10 transition with its guard clauses beside its effect (issue
17 item 6), one table read top to bottom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs

from .actions import (
    FAULT_KINDS,
    TEXT_TRIGGERS,
    Action,
    Admit,
    Cancel,
    Commit,
    Complete,
    Decide,
    Fault,
    Launch,
    Recover,
    Restore,
    Snapshot,
    StreamFailure,
    SupportEmpty,
)
from .enums import CallKind, FinishReason, PendingTag, Selection, canonical_finish_reason, published_finish_reason
from .errors import ERROR_CODES, NOT_ENABLED, Rejection, ResourceLimit
from .participation import (
    RANK_TIMEOUT,
    EnterCollective,
    RankFault,
    RankTimeout,
    ReportRank,
    active,
    anyone_left,
    blocked,
    expected_lanes,
    initial_progress,
    participation_failure,
    rank_enter,
    rank_fault,
    rank_report,
    rank_timeout,
    roster_closed,
)
from .positions import CACHE_CAPACITY_EXCEEDED
from .rules import rule
from .snapshot import RESTORE_CHECKS, SNAPSHOT_FORM_UNAVAILABLE, RestoreCheck, form_available, restore_state
from .state import (
    Completion,
    InFlightCall,
    Phase,
    Receipt,
    RequestParams,
    RequestState,
    Score,
    repair_outstanding,
)

__all__ = [
    "MACHINE",
    "NOT_ENABLED",
    "Clause",
    "Machine",
    "Transition",
    "completion_reason",
    "enabled",
    "expected_lanes",
    "expected_report",
    "expected_start",
    "guard_failure",
    "select_logical_state",
    "step",
]

# NOT_ENABLED (``transition.not_enabled``) is registered in .errors, the shared taxonomy, so that a
# runtime can raise the contract's refusal code without importing the transitions it is judged by.

S = "M3.10 "
Effect = Callable[[RequestParams, RequestState, Action], RequestState]
#: The action type a guard clause reads (contravariant: a clause over every action serves any rule).
A_contra = TypeVar("A_contra", bound=Action, contravariant=True)
#: The action type a transition handles.
A = TypeVar("A", bound=Action)


@attrs.frozen
class Clause(Generic[A_contra]):
    """One named guard clause: ``holds(params, state, action) -> bool``; ``code`` raised when it fails."""

    name: str
    holds: Callable[[RequestParams, RequestState, A_contra], bool]
    code: str = NOT_ENABLED


@attrs.frozen
class Transition(Generic[A]):
    """One rule of the table: which action/variant it handles, its guard clauses and its effect."""

    rule_id: str
    action_type: type[A]
    applies: Callable[[RequestParams, RequestState, A], bool]
    guard: tuple[Clause[A], ...]
    effect: Callable[[RequestParams, RequestState, A], RequestState]


def _in_flight(state: RequestState) -> InFlightCall:
    """The call in flight, which an earlier guard clause checked (``AttributeError`` without one, as before)."""
    if state.in_flight is None:
        raise AttributeError("'NoneType' object has no attribute of an in-flight call")
    return state.in_flight


def _score(state: RequestState) -> Score:
    """The current score, which an earlier guard clause checked (``AttributeError`` without one)."""
    if state.score is None:
        raise AttributeError("'NoneType' object has no attribute of a score")
    return state.score


def _receipt(state: RequestState) -> Receipt:
    """The pending receipt, which an earlier guard clause checked (``AttributeError`` without one)."""
    if state.receipt is None:
        raise AttributeError("'NoneType' object has no attribute of a receipt")
    return state.receipt


# --------------------------------------------------------------------------------------------
# Derived quantities shared by guards, effects and the explorer.
# --------------------------------------------------------------------------------------------


def expected_start(params: RequestParams, state: RequestState) -> int:
    """Input position of the next call's first row: P when cached, 0 (full recomputation) without a cache."""
    return state.processed if params.cached else 0


def expected_report(params: RequestParams, state: RequestState) -> Complete:
    """The completion report of the in-flight call under which both rosters agree (ALL_NEW).

    Raises:
        Rejection: ``transition.not_enabled`` when no call is in flight.
    """
    call = state.in_flight
    if call is None:
        raise Rejection(NOT_ENABLED, "no call is in flight", "$.in_flight")
    return Complete(
        call_id=call.call_id,
        generation=call.generation,
        lanes=expected_lanes(params, call),
        stages_ok=True,
        output_row=call.decision_row,
    )


def _failure_reason(params: RequestParams, call: InFlightCall, report: Complete) -> str | None:
    """Why the report forbids ALL_NEW, ignoring interrupts: a fault, a stage, a lane or a rank disagreement."""
    if call.fault is not None:
        return call.fault
    if not report.stages_ok or report.output_row != call.decision_row:
        return "device_fault"
    if report.generation != call.generation or sorted(report.lanes) != sorted(expected_lanes(params, call)):
        return "missing_lane"
    return participation_failure(params, call)


def completion_reason(params: RequestParams, state: RequestState, report: Complete) -> str | None:
    """The ``reason`` of a completion (trace field): ``None`` for ALL_NEW, else why ALL_OLD.

    Interrupts come first (``cancelled`` / ``timeout`` / ``stream_error`` by finish
    precedence), then a reported fault, then a compute-stage failure (``device_fault``), then a
    lane / generation / frontier disagreement (``missing_lane``), then the rank roster of an
    R > 1 request (``missing_rank`` / ``rank_timeout``, :func:`decodespec.spec.participation.participation_failure`).
    """
    call = state.in_flight
    if call is None:
        return None
    if call.interrupts:
        reason = canonical_finish_reason(call.interrupts)
        assert reason is not None
        return reason.value
    return _failure_reason(params, call, report)


def select_logical_state(params: RequestParams, state: RequestState, report: Complete) -> Selection:
    """SELECT LOGICAL STATE: ALL_NEW only when both closed rosters agree, else ALL_OLD.

    ALL_NEW requires: no interrupt or fault recorded for the call; every compute stage through
    the vocabulary projection completed and exported the declared decision row; every roster
    lane reports the call's generation at its expected frontier (advancing lanes at the call's
    end, fixed lanes at S), and no other lane; with R > 1 declared ranks, every rank reported
    its expected report and none left (M3.10 0x0A "One request can still be model-parallel").

    Source: M3.10 0x08 "One model call prepares a complete logical state candidate".
    """
    if state.in_flight is None:
        return Selection.ALL_OLD
    return Selection.ALL_NEW if completion_reason(params, state, report) is None else Selection.ALL_OLD


def _decision_row(params: RequestParams, kind: CallKind, start: int, length: int) -> int | None:
    end = start + length
    if kind is CallKind.PREFILL:
        return end - 1 if end == params.prompt_len and params.max_new_tokens > 0 else None
    if kind is CallKind.DECODE:
        return end - 1
    return None


def _splits_prefix(params: RequestParams, state: RequestState, action: Launch) -> bool:
    prefix = params.prefix_length
    if prefix is None or state.processed >= prefix:
        return False
    return action.start != 0 or action.start + action.length < prefix


def _fits_capacity(params: RequestParams, action: Launch) -> bool:
    return params.static_capacity is None or action.start + action.length <= params.static_capacity


def _close_pending(state: RequestState) -> PendingTag:
    return PendingTag.CLOSED_UNPROCESSED if state.pending_ids else PendingTag.EMPTY


def _finish(state: RequestState, triggers: frozenset[FinishReason], **changes: Any) -> RequestState:
    fired = state.triggers | triggers
    return attrs.evolve(
        state,
        phase=Phase.FINISHED,
        triggers=fired,
        finish_reason=published_finish_reason(fired),
        pending_tag=_close_pending(state),
        **changes,
    )


# --------------------------------------------------------------------------------------------
# Admission and the G=0 union.
# --------------------------------------------------------------------------------------------

_PHASE_NEW: Clause[Action] = Clause("phase == NEW", lambda p, s, a: s.phase is Phase.NEW)


@rule(
    "transition.admit",
    title="Admit a request that will run model calls",
    section=S + "Immutable identity versus mutable request state",
    statement="Guard: phase NEW and (G >= 1 or the G=0 branch is prefill_only). Effect: phase READY; "
    "O = 0, U = [] (EMPTY), P = 0, every lane frontier None, RNG counter at the envelope's start.",
)
def admit(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    return attrs.evolve(state, phase=Phase.READY)


@rule(
    "transition.admit_no_call",
    title="G = 0, no-call branch",
    section=S + "The first-output off-by-one (G=0 is a typed union)",
    statement="Guard: phase NEW, G = 0 and zero_new_tokens = no_call. Effect: phase FINISHED with finish "
    "reason length; O = 0, P = 0; no model call ever runs.",
)
def admit_no_call(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    return _finish(state, frozenset({FinishReason.LENGTH}))


@rule(
    "transition.admit_reject",
    title="G = 0, reject branch",
    section=S + "The first-output off-by-one (G=0 is a typed union)",
    statement="Guard: phase NEW, G = 0 and zero_new_tokens = reject. Effect: phase REJECTED (terminal); no model, "
    "policy, RNG, cache or stream mutation. The envelope validator refuses such a request with "
    "envelope.zero_new_tokens_rejected before state construction.",
)
def admit_reject(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    return attrs.evolve(state, phase=Phase.REJECTED)


# --------------------------------------------------------------------------------------------
# Model calls.
# --------------------------------------------------------------------------------------------

_NO_CALL: Clause[Action] = Clause("no call in flight", lambda p, s, a: s.in_flight is None)
_NOT_QUARANTINED: Clause[Action] = Clause("handle not quarantined", lambda p, s, a: not s.quarantined)
_START: Clause[Launch] = Clause("start == expected start (P cached, 0 uncached)", lambda p, s, a: a.start == expected_start(p, s))
_CAPACITY: Clause[Launch] = Clause(
    "start + length <= static capacity", lambda p, s, a: _fits_capacity(p, a), code=CACHE_CAPACITY_EXCEEDED
)
_ONE_PENDING_ROW: Clause[Launch] = Clause(
    "length == 1 (cached) or L + O (uncached full prefix)",
    lambda p, s, a: a.length == (1 if p.cached else p.prompt_len + s.output_count),
)


def _launch(params: RequestParams, state: RequestState, action: Launch, phase: Phase) -> RequestState:
    call = InFlightCall(
        call_id=state.num_calls,
        kind=action.kind,
        start=action.start,
        length=action.length,
        generation=state.generation,
        roster=params.roster,
        decision_row=_decision_row(params, action.kind, action.start, action.length),
        ranks=initial_progress(params),
    )
    return attrs.evolve(state, phase=phase, in_flight=call, num_calls=state.num_calls + 1)


@rule(
    "transition.launch_prefill",
    title="Launch a prefill call (whole prompt or one chunk)",
    section=S + "0x08 Prefill and decode; 0x0A Chunked input equivalence",
    statement="Guard: phase READY, no call in flight, not quarantined, P < L, start = P (0 uncached); "
    "1 <= length <= L - P, length <= prefill_chunk when chunked, length = L - P for one-shot prefill, "
    "length = L uncached; a prefix-LM chunk holds the whole prefix; static: start + length <= capacity. "
    "Effect: phase IN_FLIGHT with the call (positions start..start+length-1, roster, generation, decision row "
    "L - 1 only when the chunk reaches the prompt end and G >= 1).",
)
def launch_prefill(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Launch)
    return _launch(params, state, action, Phase.IN_FLIGHT)


def _prefill_length_ok(params: RequestParams, state: RequestState, action: Launch) -> bool:
    remaining = params.prompt_len - state.processed
    if not params.cached:
        return action.length == params.prompt_len
    if params.prefill_chunk is None:
        return action.length == remaining
    return 1 <= action.length <= min(remaining, params.prefill_chunk)


@rule(
    "transition.launch_decode",
    title="Launch a decode call for the pending token",
    section=S + "0x08 Output, input, and cache frontiers",
    statement="Guard: phase READY, no call in flight, not quarantined, U tagged PENDING_NEXT_CALL, start = P, "
    "length = 1 (uncached: start 0, length L + O); static: start + length <= capacity. Effect: phase IN_FLIGHT; "
    "the call processes the pending token at position L + O - 1 and its row owns the next decision.",
)
def launch_decode(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Launch)
    return _launch(params, state, action, Phase.IN_FLIGHT)


@rule(
    "transition.launch_repair",
    title="Launch the append/repair call for the closed final token",
    section=S + "The first-output off-by-one; 0x08 (optional append/repair)",
    statement="Guard: phase FINISHED with repair owed (final_cache = all_outputs, content finish reason, U "
    "CLOSED_UNPROCESSED), no call in flight, not quarantined, start = P, length = 1 (uncached L + O). Effect: "
    "the call is in flight while the phase stays FINISHED; its logits will be discarded.",
)
def launch_repair(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Launch)
    return _launch(params, state, action, Phase.FINISHED)


@rule(
    "transition.fault",
    title="The runtime reports a fault of the in-flight call",
    section=S + "0x0A Asynchronous completion and error boundaries",
    statement="Guard: a call is in flight with no fault recorded; kind device_fault, or missing_lane when the "
    "roster is non-empty. Effect: the fault is recorded; the completion must select ALL_OLD.",
)
def fault(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Fault) and state.in_flight is not None
    return attrs.evolve(state, in_flight=attrs.evolve(state.in_flight, fault=action.kind))


_COMPLETE_GUARD: tuple[Clause[Complete], ...] = (
    Clause("a call is in flight", lambda p, s, a: s.in_flight is not None),
    Clause("call_id is the in-flight call", lambda p, s, a: a.call_id == _in_flight(s).call_id),
    Clause("every declared rank reported or left (closed rank roster)", lambda p, s, a: roster_closed(_in_flight(s))),
)


@rule(
    "transition.complete_all_new",
    title="Completion with both rosters in agreement: select ALL_NEW",
    section=S + "0x08 One model call prepares a complete logical state candidate",
    statement="Guard: the in-flight call completes, no interrupt or fault is recorded, every compute stage and "
    "the declared decision row completed, and every roster lane reports the call's generation at its "
    "expected frontier. Effect: P := start + length, every advancing lane frontier := P, fixed lanes := S, "
    "generation + 1; decode/repair move U into P (U = [], EMPTY); the final prefill chunk and decode expose "
    "one consumable score bound to (generation, P, O) (phase SCORED); a non-final chunk returns to READY; "
    "repair and G = 0 prefill expose no score (repair stays FINISHED; G = 0 prefill finishes with length).",
)
def complete_all_new(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    call = state.in_flight
    assert call is not None
    generation = state.generation + 1
    changes: dict[str, Any] = {
        "in_flight": None,
        "processed": call.end,
        "lanes": expected_lanes(params, call) if params.cached else state.lanes,
        "generation": generation,
    }
    score = None
    if call.kind is CallKind.PREFILL and call.end < params.prompt_len:
        changes["phase"] = Phase.READY
    elif call.kind is CallKind.PREFILL and params.max_new_tokens == 0:
        done = attrs.evolve(state, **changes)
        return _finish(done, frozenset({FinishReason.LENGTH}), last_completion=_completed(state, call, Selection.ALL_NEW, None))
    elif call.kind is CallKind.REPAIR:
        changes.update(phase=Phase.FINISHED, pending_ids=(), pending_tag=PendingTag.EMPTY)
    else:
        score = Score(
            score_id=f"score-{generation}", generation=generation, processed=call.end, output_count=state.output_count
        )
        changes.update(
            phase=Phase.SCORED, pending_ids=(), pending_tag=PendingTag.EMPTY, score=score, scores=state.scores + (score,)
        )
    changes["last_completion"] = _completed(state, call, Selection.ALL_NEW, score.score_id if score else None)
    return attrs.evolve(state, **changes)


def _completed(state: RequestState, call: InFlightCall, selection: Selection, score_id: str | None) -> Completion:
    after = call.end if selection is Selection.ALL_NEW else state.processed
    return Completion(call.call_id, call.kind, selection, state.processed, after, score_id, call.ranks)


@rule(
    "transition.complete_all_old",
    title="Completion without roster agreement: retain ALL_OLD",
    section=S + "0x08 SELECT LOGICAL STATE; 0x0A Logical recovery sockets",
    statement="Guard: the in-flight call completes and the rosters disagree, or a fault or interrupt was "
    "recorded. Effect: P, U, O, lanes and generation unchanged; no consumable score; a cached handle is "
    "quarantined. With interrupts: finish with every trigger (plus device_error when the call itself failed). "
    "Otherwise retry (READY, or FINISHED with repair still owed) while retries remain, else add device_error "
    "and finish (with timeout instead when a rank's bounded wait expired, rank_timeout). After the close (the repair call) the triggers are recorded but the published finish reason "
    "stays the closing one (published_finish_reason), and the repair is no longer owed.",
)
def complete_all_old(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    call = state.in_flight
    assert call is not None and isinstance(action, Complete)
    reason = _failure_reason(params, call, action)
    failed = reason is not None
    base = attrs.evolve(
        state,
        in_flight=None,
        quarantined=params.cached,
        last_completion=_completed(state, call, Selection.ALL_OLD, None),
    )
    if call.interrupts:
        extra = frozenset({FinishReason.DEVICE_ERROR}) if failed else frozenset()
        return _finish(base, call.interrupts | extra)
    if state.num_retries < params.max_retries:
        phase = Phase.FINISHED if call.kind is CallKind.REPAIR else Phase.READY
        return attrs.evolve(base, phase=phase, num_retries=state.num_retries + 1)
    return _finish(base, frozenset({FinishReason.TIMEOUT if reason == RANK_TIMEOUT else FinishReason.DEVICE_ERROR}))


@rule(
    "transition.recover",
    title="Recover a quarantined handle",
    section=S + "0x0A Logical recovery sockets and branch state",
    statement="Guard: quarantined, no call in flight, phase READY or repair still owed. Effect: not quarantined; "
    "generation + 1 (reuse starts from a new proven generation, never from the possibly mutated one).",
)
def recover(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    return attrs.evolve(state, quarantined=False, generation=state.generation + 1)


# --------------------------------------------------------------------------------------------
# Decision and commit.
# --------------------------------------------------------------------------------------------


@rule(
    "transition.decide",
    title="Bind an M3.8 decision receipt to the current score",
    section=S + "Authoritative phase and commit spine (M3.8 DECISION)",
    statement="Guard: phase SCORED; the action names the current score, bound to the current generation; "
    "0 <= token < V; an EOS token only once O >= min_new_tokens; 0 <= draws <= max_draws. Effect: phase "
    "DECIDED with receipt receipt-<n> (score id, token, draws, RNG counter before); the receipt id is issued.",
)
def decide(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Decide)
    receipt = Receipt(
        receipt_id=f"receipt-{len(state.issued)}",
        score_id=action.score_id,
        token_id=action.token_id,
        draws=action.draws,
        rng_counter_before=state.rng_counter,
    )
    return attrs.evolve(state, phase=Phase.DECIDED, receipt=receipt, issued=state.issued + (receipt.receipt_id,))


@rule(
    "transition.decide_empty_support",
    title="The policy finds no legal token: finish with constraint_error",
    section=S + "0x02 branch table (constraint/parser error: typed terminal error with no unsupported next call); "
    "M3.8 Hard constraints define a conditional support",
    statement="Guard: phase SCORED; the action names the current score, bound to the current generation. Effect: "
    "the score is discarded, no receipt is issued and no draw consumed (RNG counter unchanged); phase FINISHED with "
    "finish reason constraint_error; every committed token, logprob and P stay (U = [] at SCORED, so no repair "
    "is owed and no further call runs).",
)
def decide_empty_support(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, SupportEmpty)
    return _finish(state, frozenset({FinishReason.CONSTRAINT_ERROR}), score=None)


def commit_triggers(params: RequestParams, output_count: int, token_id: int, text: frozenset[FinishReason]) -> frozenset[FinishReason]:
    """Finish triggers fired by committing ``token_id`` as output number ``output_count`` (1-based after commit).

    EOS when the token is in the EOS set; ``length`` when O reaches G; ``context_length`` when
    L + O reaches the context cap; plus the matcher's text triggers.
    """
    fired = set(text)
    if token_id in params.eos_ids:
        fired.add(FinishReason.EOS)
    if output_count >= params.max_new_tokens:
        fired.add(FinishReason.LENGTH)
    if params.prompt_len + output_count >= params.context_cap:
        fired.add(FinishReason.CONTEXT_LENGTH)
    return frozenset(fired)


@rule(
    "transition.commit",
    title="Consume the decision receipt exactly once",
    section=S + "0x06 One selection is an output-state transaction",
    statement="Guard: phase DECIDED; the receipt is the pending one, never consumed, bound to the current score "
    "and generation and to the current RNG counter; text triggers only when declared (a stop string only once the committed "
    "token's index is >= min_new_tokens, as decodespec.spec.stop.step_triggers suppresses it). Effect: append the token "
    "and its logprob (owned by the score row); O + 1; RNG counter + draws; the receipt is consumed and the score "
    "is spent. Triggers (EOS, length at O = G, context_length at L + O = C, stop_string/structured, and stream_error "
    "when the commit's publish step failed, which needs a stream): finish with the canonical reason and U = [token] "
    "CLOSED_UNPROCESSED; otherwise READY with U = [token] PENDING_NEXT_CALL.",
)
def commit(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Commit) and state.receipt is not None
    receipt = state.receipt
    output_ids = state.output_ids + (receipt.token_id,)
    next_state = attrs.evolve(
        state,
        output_ids=output_ids,
        output_logprobs=state.output_logprobs + (receipt.score_id,),
        consumed=state.consumed + (receipt,),
        rng_counter=state.rng_counter + receipt.draws,
        score=None,
        receipt=None,
        pending_ids=(receipt.token_id,),
    )
    fired = commit_triggers(params, len(output_ids), receipt.token_id, action.text_triggers)
    if action.stream_failed:
        fired |= {FinishReason.STREAM_ERROR}
    if fired:
        return _finish(next_state, fired)
    return attrs.evolve(next_state, phase=Phase.READY, pending_tag=PendingTag.PENDING_NEXT_CALL)


# --------------------------------------------------------------------------------------------
# Interrupts: cancel, timeout, streamer failure.
# --------------------------------------------------------------------------------------------


def _reason(action: Cancel | StreamFailure) -> FinishReason:
    return FinishReason.STREAM_ERROR if isinstance(action, StreamFailure) else action.reason


_INTERRUPT_KIND: Clause[Cancel | StreamFailure] = Clause(
    "cancel reason is cancelled or timeout; stream failure needs a stream",
    lambda p, s, a: (
        p.stream if isinstance(a, StreamFailure) else a.reason in (FinishReason.CANCELLED, FinishReason.TIMEOUT)
    ),
)


@rule(
    "transition.interrupt_before_launch",
    title="Cancel / timeout / stream failure before launch",
    section=S + "0x02 branch table (cancellation/timeout before launch); 0x06",
    statement="Guard: phase READY. Effect: no launch and no logical mutation: phase FINISHED with the reason; "
    "a pending token becomes CLOSED_UNPROCESSED.",
)
def interrupt_before_launch(params: RequestParams, state: RequestState, action: Cancel | StreamFailure) -> RequestState:
    return _finish(state, frozenset({_reason(action)}))


@rule(
    "transition.interrupt_in_flight",
    title="Cancel / timeout / stream failure while a call is in flight",
    section=S + "0x02 branch table (in flight: await, select ALL_OLD, expose nothing partial)",
    statement="Guard: phase IN_FLIGHT, or a cancel / timeout while the repair call runs after the close (phase "
    "FINISHED); the reason is not yet recorded for the call. Effect: the reason is recorded on the call; its "
    "completion must select ALL_OLD and then finishes the request -- or, for the repair call, records the reason "
    "as a trigger and abandons the repair without rewriting the published finish reason.",
)
def interrupt_in_flight(params: RequestParams, state: RequestState, action: Cancel | StreamFailure) -> RequestState:
    call = state.in_flight
    assert call is not None
    return attrs.evolve(state, in_flight=attrs.evolve(call, interrupts=call.interrupts | {_reason(action)}))


@rule(
    "transition.interrupt_after_completion",
    title="Cancel / timeout / stream failure after completion, before the decision",
    section=S + "0x06 Finish reason and RNG precedence (cancellation has a commit boundary)",
    statement="Guard: phase SCORED. Effect: the score is discarded unconsumed; phase FINISHED with the reason; "
    "P keeps the completed call (ALL_NEW was already selected).",
)
def interrupt_after_completion(params: RequestParams, state: RequestState, action: Cancel | StreamFailure) -> RequestState:
    return _finish(state, frozenset({_reason(action)}), score=None)


@rule(
    "transition.interrupt_after_decision",
    title="Cancel / timeout / stream failure after the decision, before commit",
    section=S + "0x06 Finish reason and RNG precedence (cancellation has a commit boundary)",
    statement="Guard: phase DECIDED. Effect: the receipt is discarded unconsumed (it stays issued, so a later "
    "commit of it is stale), the score is discarded, the RNG counter is unchanged; phase FINISHED.",
)
def interrupt_after_decision(params: RequestParams, state: RequestState, action: Cancel | StreamFailure) -> RequestState:
    return _finish(state, frozenset({_reason(action)}), score=None, receipt=None)


# --------------------------------------------------------------------------------------------
# Snapshots and restore.
# --------------------------------------------------------------------------------------------


@rule(
    "transition.snapshot",
    title="Take a resumable snapshot (pending-suffix or repaired form)",
    section=S + "0x0BA A completed output is not automatically a resumable snapshot",
    statement="Guard: no call in flight, no pending decision, not quarantined; pending_suffix: phase READY or "
    "FINISHED; repaired: U = [] and phase READY, SCORED or FINISHED (a pending token must first pass through a valid "
    "append call). Effect: none (the snapshot records the state; the request may continue).",
)
def snapshot(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    return state


@rule(
    "transition.restore",
    title="Restore a snapshot into a fresh request of the same identity",
    section=S + "0x0BA A completed output is not automatically a resumable snapshot; Immutable identity versus mutable "
    "request state",
    statement="Guard: phase NEW and every restore check of decodespec.spec.snapshot holds (identity, lane roster, form, "
    "pending suffix, P + |U| = L + O, capacity, lane frontiers, receipt ledger, finish state). Effect: the snapshot's "
    "state (same generation, no call in flight, not quarantined); the pending token stays unprocessed.",
)
def restore(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    assert isinstance(action, Restore)
    return restore_state(params, action.record)


_SNAPSHOT_GUARD: tuple[Clause[Snapshot], ...] = (
    Clause("the state admits the snapshot form", lambda p, s, a: form_available(p, s, a.form) is None,
           code=SNAPSHOT_FORM_UNAVAILABLE),
)


def _restore_clause(check: RestoreCheck) -> Clause[Restore]:
    """The guard clause of one restore check (binds ``check`` per clause)."""
    return Clause(check.name, lambda p, s, a: check.holds(p, a.record), code=check.code)


_RESTORE_GUARD: tuple[Clause[Restore], ...] = (_PHASE_NEW,) + tuple(_restore_clause(check) for check in RESTORE_CHECKS)


# --------------------------------------------------------------------------------------------
# The transition table and the machine.
# --------------------------------------------------------------------------------------------


def _g0(branch: str) -> Callable[[RequestParams, RequestState, Action], bool]:
    return lambda p, s, a: p.max_new_tokens == 0 and p.zero_new_tokens == branch


def _kind(kind: CallKind) -> Callable[[RequestParams, RequestState, Launch], bool]:
    return lambda p, s, a: a.kind is kind


def _selection(selection: Selection) -> Callable[[RequestParams, RequestState, Complete], bool]:
    return lambda p, s, a: select_logical_state(p, s, a) is selection


def _in_flight_interrupt(p: RequestParams, s: RequestState, a: Action) -> bool:
    """A call is in flight: phase IN_FLIGHT, or the repair call after the close (a cancel or timeout only)."""
    return s.phase is Phase.IN_FLIGHT or (s.in_flight is not None and isinstance(a, Cancel))


def _interrupt_phase(phase: Phase) -> Callable[[RequestParams, RequestState, Action], bool]:
    return lambda p, s, a: s.phase is phase


def _rank_guard(rank_of: Callable[[Any], int]) -> tuple[Clause[Any], ...]:
    """A call with a rank roster is in flight and the action's rank is declared and active."""
    return (
        Clause("a call with a rank roster is in flight", lambda p, s, a: s.in_flight is not None and bool(s.in_flight.ranks)),
        Clause("rank is declared (0 <= rank < R)", lambda p, s, a: 0 <= rank_of(a) < len(_in_flight(s).ranks)),
        Clause("rank is active (not reported, not left)", lambda p, s, a: active(_in_flight(s).ranks[rank_of(a)])),
    )


_RANK_GUARD = _rank_guard(lambda a: a.rank)

_CURRENT_SCORE: Clause[Action] = Clause(
    "score is bound to the current generation", lambda p, s, a: _score(s).generation == s.generation
)

TRANSITIONS: tuple[Transition[Any], ...] = (
    Transition("transition.admit_reject", Admit, _g0("reject"), (_PHASE_NEW,), admit_reject),
    Transition("transition.admit_no_call", Admit, _g0("no_call"), (_PHASE_NEW,), admit_no_call),
    Transition("transition.admit", Admit, lambda p, s, a: True, (_PHASE_NEW,), admit),
    Transition(
        "transition.launch_prefill",
        Launch,
        _kind(CallKind.PREFILL),
        (
            Clause("phase == READY", lambda p, s, a: s.phase is Phase.READY),
            _NO_CALL,
            _NOT_QUARANTINED,
            Clause("P < L (prompt not yet processed)", lambda p, s, a: s.processed < p.prompt_len),
            _START,
            Clause("prefill length fits the remaining prompt and the chunk size", lambda p, s, a: _prefill_length_ok(p, s, a)),
            Clause("a chunk may not split the prefix-LM prefix", lambda p, s, a: not _splits_prefix(p, s, a)),
            _CAPACITY,
        ),
        launch_prefill,
    ),
    Transition(
        "transition.launch_decode",
        Launch,
        _kind(CallKind.DECODE),
        (
            Clause("phase == READY", lambda p, s, a: s.phase is Phase.READY),
            _NO_CALL,
            _NOT_QUARANTINED,
            Clause("U is PENDING_NEXT_CALL", lambda p, s, a: s.pending_tag is PendingTag.PENDING_NEXT_CALL),
            _START,
            _ONE_PENDING_ROW,
            _CAPACITY,
        ),
        launch_decode,
    ),
    Transition(
        "transition.launch_repair",
        Launch,
        _kind(CallKind.REPAIR),
        (
            Clause("repair owed (FINISHED, all_outputs, content finish, CLOSED_UNPROCESSED)", lambda p, s, a: repair_outstanding(p, s)),
            _NO_CALL,
            _NOT_QUARANTINED,
            _START,
            _ONE_PENDING_ROW,
            _CAPACITY,
        ),
        launch_repair,
    ),
    Transition(
        "transition.fault",
        Fault,
        lambda p, s, a: True,
        (
            Clause("a call is in flight", lambda p, s, a: s.in_flight is not None),
            Clause("no fault recorded yet", lambda p, s, a: _in_flight(s).fault is None),
            Clause("kind is device_fault or missing_lane", lambda p, s, a: a.kind in FAULT_KINDS),
            Clause("missing_lane needs a non-empty roster", lambda p, s, a: a.kind != "missing_lane" or bool(_in_flight(s).roster)),
        ),
        fault,
    ),
    Transition("transition.complete_all_new", Complete, _selection(Selection.ALL_NEW), _COMPLETE_GUARD, complete_all_new),
    Transition("transition.complete_all_old", Complete, _selection(Selection.ALL_OLD), _COMPLETE_GUARD, complete_all_old),
    Transition(
        "transition.recover",
        Recover,
        lambda p, s, a: True,
        (
            Clause("quarantined", lambda p, s, a: s.quarantined),
            _NO_CALL,
            Clause("phase READY or repair owed", lambda p, s, a: s.phase is Phase.READY or repair_outstanding(p, s)),
        ),
        recover,
    ),
    Transition(
        "transition.decide",
        Decide,
        lambda p, s, a: True,
        (
            Clause("phase == SCORED", lambda p, s, a: s.phase is Phase.SCORED and s.score is not None),
            Clause("score_id is the current score", lambda p, s, a: a.score_id == _score(s).score_id),
            _CURRENT_SCORE,
            Clause("0 <= token_id < V", lambda p, s, a: 0 <= a.token_id < p.vocab_size),
            Clause(
                "EOS only once O >= min_new_tokens",
                lambda p, s, a: a.token_id not in p.eos_ids or s.output_count >= p.min_new_tokens,
            ),
            Clause("0 <= draws <= max_draws", lambda p, s, a: 0 <= a.draws <= p.max_draws),
        ),
        decide,
    ),
    Transition(
        "transition.decide_empty_support",
        SupportEmpty,
        lambda p, s, a: True,
        (
            Clause("phase == SCORED", lambda p, s, a: s.phase is Phase.SCORED and s.score is not None),
            Clause("score_id is the current score", lambda p, s, a: a.score_id == _score(s).score_id),
            _CURRENT_SCORE,
        ),
        decide_empty_support,
    ),
    Transition(
        "transition.commit",
        Commit,
        lambda p, s, a: True,
        (
            Clause("phase == DECIDED", lambda p, s, a: s.phase is Phase.DECIDED and s.receipt is not None),
            Clause("receipt was never consumed", lambda p, s, a: all(r.receipt_id != a.receipt_id for r in s.consumed)),
            Clause("receipt is the pending one (not stale)", lambda p, s, a: a.receipt_id == _receipt(s).receipt_id),
            Clause("receipt is bound to the current score", lambda p, s, a: s.score is not None and _receipt(s).score_id == s.score.score_id),
            _CURRENT_SCORE,
            Clause("receipt read the current RNG counter", lambda p, s, a: _receipt(s).rng_counter_before == s.rng_counter),
            Clause(
                "text triggers are declared (stop strings / structured); stop strings only from output index min_new_tokens",
                lambda p, s, a: a.text_triggers <= TEXT_TRIGGERS
                and (FinishReason.STOP_STRING not in a.text_triggers or (p.stop_strings and s.output_count >= p.min_new_tokens))
                and (p.structured or not (a.text_triggers & {FinishReason.STRUCTURED, FinishReason.STRUCTURED_ERROR})),
            ),
            Clause("a stream failure at commit needs a stream", lambda p, s, a: p.stream or not a.stream_failed),
        ),
        commit,
    ),
    Transition(
        "transition.rank_enter",
        EnterCollective,
        lambda p, s, a: True,
        _RANK_GUARD + (
            Clause("rank not blocked in an incomplete collective", lambda p, s, a: not blocked(_in_flight(s), a.rank)),
            Clause("entered < C", lambda p, s, a: _in_flight(s).ranks[a.rank].entered < p.collectives),
            Clause("no rank has left the call", lambda p, s, a: not anyone_left(_in_flight(s))),
        ),
        rank_enter,
    ),
    Transition(
        "transition.rank_report",
        ReportRank,
        lambda p, s, a: True,
        _rank_guard(lambda a: a.report.rank) + (
            Clause("rank not blocked in an incomplete collective", lambda p, s, a: not blocked(_in_flight(s), a.report.rank)),
            Clause("entered == C", lambda p, s, a: _in_flight(s).ranks[a.report.rank].entered == p.collectives),
        ),
        rank_report,
    ),
    Transition("transition.rank_fault", RankFault, lambda p, s, a: True, _RANK_GUARD, rank_fault),
    Transition("transition.rank_timeout", RankTimeout, lambda p, s, a: True, _RANK_GUARD, rank_timeout),
    Transition("transition.snapshot", Snapshot, lambda p, s, a: True, _SNAPSHOT_GUARD, snapshot),
    Transition("transition.restore", Restore, lambda p, s, a: True, _RESTORE_GUARD, restore),
)

_Interrupt = Cancel | StreamFailure
for _action_type in (Cancel, StreamFailure):
    TRANSITIONS += (
        Transition[_Interrupt]("transition.interrupt_in_flight", _action_type, _in_flight_interrupt,
                   (_INTERRUPT_KIND, Clause("reason not yet recorded for the call", lambda p, s, a: _reason(a) not in _in_flight(s).interrupts)),
                   interrupt_in_flight),
        Transition[_Interrupt]("transition.interrupt_after_completion", _action_type, _interrupt_phase(Phase.SCORED), (_INTERRUPT_KIND,), interrupt_after_completion),
        Transition[_Interrupt]("transition.interrupt_after_decision", _action_type, _interrupt_phase(Phase.DECIDED), (_INTERRUPT_KIND,), interrupt_after_decision),
        Transition[_Interrupt]("transition.interrupt_before_launch", _action_type, lambda p, s, a: True,
                   (_INTERRUPT_KIND, Clause("phase == READY (before launch)", lambda p, s, a: s.phase is Phase.READY)),
                   interrupt_before_launch),
    )


@attrs.frozen
class Machine:
    """A transition table with routing, guards and effects (the spec's ``Next`` relation).

    Routing picks, among the transitions for the action's type, the first whose ``applies``
    predicate holds (the variant: G=0 branch, call kind, roster selection, interrupt point);
    its guard clauses are then checked in order.
    """

    transitions: tuple[Transition[Any], ...] = TRANSITIONS

    def route(self, params: RequestParams, state: RequestState, action: Action) -> Transition[Any] | None:
        """The transition that handles ``action`` in ``state``, or ``None`` for a foreign action type."""
        for transition in self.transitions:
            if isinstance(action, transition.action_type) and transition.applies(params, state, action):
                return transition
        return None

    def guard_failure(self, params: RequestParams, state: RequestState, action: Action) -> tuple[str, Clause[Any] | None] | None:
        """``None`` when enabled, else ``(rule id or "", the first failing clause or None)``."""
        transition = self.route(params, state, action)
        if transition is None:
            return ("", None)
        for clause in transition.guard:
            if not clause.holds(params, state, action):
                return (transition.rule_id, clause)
        return None

    def enabled(self, params: RequestParams, state: RequestState, action: Action) -> bool:
        """Whether ``action`` may be taken in ``state``."""
        return self.guard_failure(params, state, action) is None

    def step(self, params: RequestParams, state: RequestState, action: Action) -> RequestState:
        """The state after ``action``.

        Raises:
            Rejection: ``transition.not_enabled`` naming the rule and failing guard clause.
            ResourceLimit: ``cache.capacity_exceeded`` when the failing clause is the static
                capacity bound (the write is refused before any slot is touched).
        """
        return self.step_with_rule(params, state, action)[1]

    def step_with_rule(self, params: RequestParams, state: RequestState, action: Action) -> tuple[str, RequestState]:
        """Like :meth:`step`, also returning the id of the rule that fired."""
        transition = self.route(params, state, action)
        if transition is None:
            raise Rejection(NOT_ENABLED, f"no transition handles {type(action).__name__}", "$.action")
        for clause in transition.guard:
            if not clause.holds(params, state, action):
                error = ResourceLimit if ERROR_CODES[clause.code].kind == "resource_limit" else Rejection
                raise error(
                    clause.code,
                    f"{transition.rule_id}: guard '{clause.name}' is false in phase {state.phase.value}",
                    "$.action",
                    details={"rule": transition.rule_id, "guard": clause.name},
                )
        return transition.rule_id, transition.effect(params, state, action)

    def with_effect(self, rule_id: str, effect: Effect) -> Machine:
        """A copy whose rule ``rule_id`` has ``effect`` (to plug in a deliberately broken transition)."""
        if rule_id not in self.rule_ids():
            raise KeyError(rule_id)
        return Machine(tuple(attrs.evolve(t, effect=effect) if t.rule_id == rule_id else t for t in self.transitions))

    def with_guard(self, rule_id: str, guard: Sequence[Clause[Any]]) -> Machine:
        """A copy whose rule ``rule_id`` has the guard ``guard`` (e.g. a weakened guard)."""
        if rule_id not in self.rule_ids():
            raise KeyError(rule_id)
        return Machine(tuple(attrs.evolve(t, guard=tuple(guard)) if t.rule_id == rule_id else t for t in self.transitions))

    def rule_ids(self) -> tuple[str, ...]:
        """Distinct rule ids in table order."""
        return tuple(dict.fromkeys(t.rule_id for t in self.transitions))


#: The specification's machine.
MACHINE = Machine()


def guard_failure(params: RequestParams, state: RequestState, action: Action) -> str | None:
    """The name of the first failing guard clause of ``action`` in ``state``, or ``None`` when enabled."""
    failure = MACHINE.guard_failure(params, state, action)
    if failure is None:
        return None
    rule_id, clause = failure
    return f"{rule_id}: {clause.name}" if clause else f"no transition handles {type(action).__name__}"


def enabled(params: RequestParams, state: RequestState, action: Action) -> bool:
    """Whether ``action`` is enabled in ``state`` under the specification's machine."""
    return MACHINE.enabled(params, state, action)


def step(params: RequestParams, state: RequestState, action: Action) -> RequestState:
    """The next state under the specification's machine (see :meth:`Machine.step`)."""
    return MACHINE.step(params, state, action)
