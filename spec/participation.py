"""M3.10 0x0A "One request can still be model-parallel": the participation contract of R ranks.

One model call of one request may run on ``R`` declared participants (tensor-parallel ranks that
own shards of the projections, vocabulary scores and K/V heads).  The seed's contract:

* the roster is closed and declared: ``R`` ranks, ids ``0 .. R-1`` (:func:`declared_ranks`);
* a call selects ALL_NEW only when every rank reports every compute stage and state lane for the
  same request, generation, positions and frontier (:class:`RankReport`,
  :func:`expected_rank_report`, :func:`participation_failure`): "the closed roster must agree on
  request, generation, position, visibility, output owner, and completion event";
* a missing participant (a rank that faulted, died, or reported a disagreeing report) or a late
  one (its bounded wait expired) selects ALL_OLD and supplies no consumable score;
* "One rank exiting while peers enter another collective can hang the request": every rank
  follows one common schedule of ``C`` collectives per call (``RequestParams.collectives``); a
  rank enters collective ``k`` only when no rank has left the call (:func:`anyone_left`); a rank
  waiting inside a collective that cannot complete leaves through its bounded wait
  (``transition.rank_timeout``), so no state waits forever (the explorer's deadlock check).

This module is the rank layer of :mod:`decodespec.spec.transitions`: the rank progress lives in
the in-flight call (``InFlightCall.ranks``), the four rank transitions below join the request
machine's table, and the request-level completion (``transition.complete_all_new`` /
``complete_all_old``) consults :func:`participation_failure` after the single-process lane
roster.  With ``R = 1`` (the default) there is no rank layer and nothing changes.

Declared choices (where the seed leaves one):

* completion reasons: a rank that left with a fault, or reported anything other than its
  expected report, is ``missing_rank``; a rank whose bounded wait expired is ``rank_timeout``.
  Precedence: a recorded fault, then ``missing_rank`` from a faulted rank, then
  ``rank_timeout``, then ``missing_rank`` from a disagreeing report.
* a failed call is retried like any ALL_OLD call (quarantine, recover) while retries remain; at
  exhaustion ``rank_timeout`` finishes the request with ``timeout`` and ``missing_rank`` with
  ``device_error`` (typed finishes, never a hang).
* the coordinator may close the call (``Complete``) only when the roster is closed: every rank
  reported or left (:func:`roster_closed`).  A rank that is late with its report is marked by
  its own bounded wait (``rank_timeout``), which is always enabled for an active rank.

The runtime mechanism (which collective, which backend, timeouts in ms) is not prescribed:
M3.10 exports the consistency requirement, not M6.6 communication or topology.

Public API (pure functions over frozen attrs values; no torch):

* values: :class:`RankReport` (what one rank reports at the end of a call),
  :class:`RankProgress` (one rank's progress through the call's schedule);
* actions: :class:`EnterCollective`, :class:`ReportRank`, :class:`RankFault`,
  :class:`RankTimeout`;
* derived: :func:`declared_ranks`, :func:`initial_progress`, :func:`collective_complete`,
  :func:`blocked`, :func:`active`, :func:`anyone_left`, :func:`roster_closed`,
  :func:`expected_rank_report`, :func:`rank_disagreement`, :func:`participation_failure`;
* constants: :data:`MISSING_RANK`, :data:`RANK_TIMEOUT`, :data:`RANK_LEFT_REASONS`;
* rules: ``transition.rank_enter``, ``transition.rank_report``, ``transition.rank_fault``,
  ``transition.rank_timeout`` (effects here, routing in transitions.py) and the invariants
  ``invariant.ranks_declared``, ``invariant.no_collective_after_leave``,
  ``invariant.all_new_needs_every_rank``.

Source: M3.10 0x0A "One request can still be model-parallel"; M3.10 0x08 "One model call
prepares a complete logical state candidate" (SELECT LOGICAL STATE); M3.10 0x0A "Asynchronous
completion and error boundaries".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .enums import Selection
from .rules import rule

if TYPE_CHECKING:  # pragma: no cover
    from .state import InFlightCall, RequestParams, RequestState

__all__ = [
    "MISSING_RANK",
    "RANK_LEFT_REASONS",
    "RANK_TIMEOUT",
    "EnterCollective",
    "RankFault",
    "RankProgress",
    "RankReport",
    "RankTimeout",
    "ReportRank",
    "active",
    "all_new_needs_every_rank",
    "anyone_left",
    "blocked",
    "collective_complete",
    "declared_ranks",
    "expected_lanes",
    "expected_rank_report",
    "initial_progress",
    "no_collective_after_leave",
    "participation_failure",
    "rank_disagreement",
    "ranks_declared",
    "roster_closed",
]

S = "M3.10 0x0A One request can still be model-parallel"

#: Completion reason: a declared rank faulted, died, or reported a disagreeing report.
MISSING_RANK = "missing_rank"
#: Completion reason: a rank's bounded wait expired (a peer is late or gone).
RANK_TIMEOUT = "rank_timeout"
#: Why a rank left the call: its device faulted (or the process died), or its wait bound expired.
RANK_LEFT_REASONS = ("device_fault", "timeout")


# --------------------------------------------------------------------------------------------
# Values.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class RankReport:
    """What one rank reports when it finished its part of a call (its completion event).

    Attributes:
        rank: The reporting rank (``0 <= rank < R``).
        identity: Request identity ``"sha256:<hex>"`` the rank executed.
        generation: The request generation the rank read and must report.
        start: First input position the rank processed (``cache_position`` of row 0).
        length: Rows the rank processed (positions ``start .. start + length - 1``).
        lanes: ``(lane, frontier)`` of every state lane the rank holds a shard of (every roster
            lane: a tensor-parallel rank holds its heads of every K/V lane).
        stages_ok: Whether every compute stage of the rank (through its vocabulary shard)
            completed.
        output_row: The decision row the rank exported, or ``None``.

    Units: positions and rows are tokens.
    """

    rank: int
    identity: str
    generation: int
    start: int
    length: int
    lanes: tuple[tuple[str, int], ...]
    stages_ok: bool
    output_row: int | None


@attrs.frozen
class RankProgress:
    """One rank's progress through the in-flight call's common collective schedule.

    Attributes:
        rank: The rank id.
        entered: Collectives the rank entered so far (``0 .. C``); collective ``k`` is the
            ``k``-th (0-based) of the call's schedule.
        report: The rank's :class:`RankReport`, once sent (after all ``C`` collectives).
        left: Why the rank left the call early (one of :data:`RANK_LEFT_REASONS`), else ``None``.
        ceiling: ``entered`` at the moment the first rank of the call left, else ``None``: from
            then on the rank may enter no further collective (``invariant.no_collective_after_leave``).
    """

    rank: int
    entered: int = 0
    report: RankReport | None = None
    left: str | None = None
    ceiling: int | None = None


# --------------------------------------------------------------------------------------------
# Actions (rank-level events inside one in-flight call).
# --------------------------------------------------------------------------------------------


@attrs.frozen
class EnterCollective:
    """Rank ``rank`` enters its next collective of the call's schedule (``entered`` -> ``entered + 1``)."""

    rank: int


@attrs.frozen
class ReportRank:
    """A rank sends its completion report (after completing every collective of the schedule)."""

    report: RankReport


@attrs.frozen
class RankFault:
    """Environment: rank ``rank``'s device faults or its process dies; it leaves the call."""

    rank: int


@attrs.frozen
class RankTimeout:
    """The bounded wait of rank ``rank`` expires (inside a collective, or its report is late); it leaves the call."""

    rank: int


# --------------------------------------------------------------------------------------------
# Derived quantities (guards, effects, the explorer and the gate use them).
# --------------------------------------------------------------------------------------------


def declared_ranks(params: RequestParams) -> tuple[int, ...]:
    """The declared rank roster ``(0, ..., R - 1)``, or ``()`` for a single-process request (R = 1)."""
    return tuple(range(params.ranks)) if params.ranks > 1 else ()


def initial_progress(params: RequestParams) -> tuple[RankProgress, ...]:
    """Each declared rank at the start of a call: nothing entered, nothing reported, not left."""
    return tuple(RankProgress(rank) for rank in declared_ranks(params))


def collective_complete(call: InFlightCall, k: int) -> bool:
    """Whether collective ``k`` of ``call`` completed: every declared rank entered it (a left rank never will)."""
    return all(p.entered > k for p in call.ranks)


def active(progress: RankProgress) -> bool:
    """Whether the rank is still working on the call (neither reported nor left)."""
    return progress.report is None and progress.left is None


def blocked(call: InFlightCall, rank: int) -> bool:
    """Whether ``rank`` waits inside a collective that has not completed (its last entered one)."""
    entered = call.ranks[rank].entered
    return entered >= 1 and not collective_complete(call, entered - 1)


def anyone_left(call: InFlightCall) -> bool:
    """Whether some rank left the call (after that no rank may enter another collective)."""
    return any(p.left is not None for p in call.ranks)


def roster_closed(call: InFlightCall) -> bool:
    """Whether every declared rank reported or left (the coordinator may then close the call)."""
    return all(not active(p) for p in call.ranks)


def expected_lanes(params: RequestParams, call: InFlightCall) -> tuple[tuple[str, int], ...]:
    """The roster report that selects ALL_NEW: advancing lanes at the call's end, fixed lanes at S.

    The lane roster rule of the single-process machine (:func:`decodespec.spec.transitions.expected_report`)
    and of every rank's report (:func:`expected_rank_report`).

    Source: M3.10 0x08 "advancing-state-lane roster" (select ALL_NEW only when every item agrees).
    """
    out = []
    for lane in params.profile.lanes:
        if lane.name not in call.roster:
            continue
        frontier = call.end if lane.advancing else params.source_len
        out.append((lane.name, frontier if frontier is not None else 0))
    return tuple(out)


def expected_rank_report(params: RequestParams, call: InFlightCall, rank: int) -> RankReport:
    """The report under which rank ``rank`` agrees with the call (what ALL_NEW needs from it).

    Same request identity and generation as the call, the call's positions, every roster lane at
    its expected frontier (advancing lanes at the call's end, fixed lanes at S), every stage
    completed, the call's decision row.
    """
    return RankReport(
        rank=rank,
        identity=params.identity,
        generation=call.generation,
        start=call.start,
        length=call.length,
        lanes=expected_lanes(params, call),
        stages_ok=True,
        output_row=call.decision_row,
    )


def rank_disagreement(params: RequestParams, call: InFlightCall, report: RankReport) -> str | None:
    """Which field of ``report`` disagrees with the call (``"generation"``, ``"positions"`` ...), or ``None``."""
    want = expected_rank_report(params, call, report.rank)
    if report.identity != want.identity:
        return "identity"
    if report.generation != want.generation:
        return "generation"
    if (report.start, report.length) != (want.start, want.length):
        return "positions"
    if sorted(report.lanes) != sorted(want.lanes):
        return "frontier"
    if not report.stages_ok:
        return "stages"
    if report.output_row != want.output_row:
        return "output_row"
    return None


def participation_failure(params: RequestParams, call: InFlightCall) -> str | None:
    """Why the rank roster forbids ALL_NEW (:data:`MISSING_RANK` / :data:`RANK_TIMEOUT`), or ``None``.

    ``None`` for a single-process call (no rank layer).  A faulted rank first, then a rank whose
    wait expired, then a rank whose report disagrees with the call (:func:`rank_disagreement`).
    """
    if not call.ranks:
        return None
    if any(p.left == "device_fault" for p in call.ranks):
        return MISSING_RANK
    if any(p.left == "timeout" for p in call.ranks):
        return RANK_TIMEOUT
    if any(p.report is None or rank_disagreement(params, call, p.report) is not None for p in call.ranks):
        return MISSING_RANK
    return None


# --------------------------------------------------------------------------------------------
# Effects (the guards and the routing are rows of spec/transitions.py TRANSITIONS).
# --------------------------------------------------------------------------------------------


def _with_rank(state: RequestState, rank: int, **changes: Any) -> RequestState:
    call = state.in_flight
    assert call is not None
    ranks = tuple(attrs.evolve(p, **changes) if p.rank == rank else p for p in call.ranks)
    return attrs.evolve(state, in_flight=attrs.evolve(call, ranks=ranks))


def _leave(state: RequestState, rank: int, reason: str) -> RequestState:
    call = state.in_flight
    assert call is not None
    first = not anyone_left(call)
    ranks = tuple(
        attrs.evolve(
            p,
            left=reason if p.rank == rank else p.left,
            ceiling=p.entered if first else p.ceiling,
        )
        for p in call.ranks
    )
    return attrs.evolve(state, in_flight=attrs.evolve(call, ranks=ranks))


@rule(
    "transition.rank_enter",
    title="A rank enters its next collective",
    section=S,
    statement="Guard: a call is in flight with a rank roster; the rank is declared and active (not reported, not "
    "left); it is not blocked in an incomplete collective; it entered fewer than C collectives; no rank has left "
    "the call (no rank enters a collective another rank has left). Effect: the rank's entered count + 1.",
)
def rank_enter(params: RequestParams, state: RequestState, action: EnterCollective) -> RequestState:
    assert state.in_flight is not None
    return _with_rank(state, action.rank, entered=state.in_flight.ranks[action.rank].entered + 1)


@rule(
    "transition.rank_report",
    title="A rank reports the end of its part of the call",
    section=S,
    statement="Guard: the rank is declared and active, not blocked, entered all C collectives, and the report names "
    "it. Effect: the report is recorded as sent (whatever it says: agreement is judged at completion).",
)
def rank_report(params: RequestParams, state: RequestState, action: ReportRank) -> RequestState:
    return _with_rank(state, action.report.rank, report=action.report)


@rule(
    "transition.rank_fault",
    title="A rank's device faults or its process dies",
    section=S + "; M3.10 0x0A Asynchronous completion and error boundaries",
    statement="Guard (environment): the rank is declared and active. Effect: the rank leaves the call with reason "
    "device_fault; on the first leave every rank's ceiling is set to its entered count; the call can only select "
    "ALL_OLD (missing_rank).",
)
def rank_fault(params: RequestParams, state: RequestState, action: RankFault) -> RequestState:
    return _leave(state, action.rank, "device_fault")


@rule(
    "transition.rank_timeout",
    title="A rank's bounded wait expires",
    section=S,
    statement="Guard: the rank is declared and active (waiting in a collective that cannot complete, or late "
    "with its report); always enabled for an active rank, so no rank waits forever. Effect: the rank leaves the call "
    "with reason timeout; on the first leave every rank's ceiling is set; the call can only select ALL_OLD "
    "(rank_timeout, finishing timeout when no retry remains).",
)
def rank_timeout(params: RequestParams, state: RequestState, action: RankTimeout) -> RequestState:
    return _leave(state, action.rank, "timeout")


# --------------------------------------------------------------------------------------------
# Invariants (joined to decodespec.spec.invariants.INVARIANTS).
# --------------------------------------------------------------------------------------------


@rule(
    "invariant.ranks_declared",
    title="The in-flight call carries exactly the declared rank roster",
    section=S,
    statement="With R = 1 no call carries rank progress; with R > 1 an in-flight call has one progress entry per "
    "rank 0..R-1 in order, 0 <= entered <= C, a report only after all C collectives and naming its rank, and a "
    "rank either reported or left, never both.",
)
def ranks_declared(params: RequestParams, state: RequestState) -> bool:
    call = state.in_flight
    if call is None:
        return True
    if tuple(p.rank for p in call.ranks) != declared_ranks(params):
        return False
    for p in call.ranks:
        if not 0 <= p.entered <= params.collectives:
            return False
        if p.report is not None and (p.left is not None or p.entered != params.collectives or p.report.rank != p.rank):
            return False
        if p.left is not None and p.left not in RANK_LEFT_REASONS:
            return False
    return True


@rule(
    "invariant.no_collective_after_leave",
    title="No rank enters a collective another rank has left",
    section=S + " (one rank exiting while peers enter another collective can hang the request)",
    statement="Once a rank of the in-flight call has left, every rank has a ceiling (its entered count when the "
    "first rank left) and entered <= ceiling; before any rank left no ceiling is set.",
)
def no_collective_after_leave(params: RequestParams, state: RequestState) -> bool:
    call = state.in_flight
    if call is None or not call.ranks:
        return True
    if not anyone_left(call):
        return all(p.ceiling is None for p in call.ranks)
    return all(p.ceiling is not None and p.entered <= p.ceiling for p in call.ranks)


@rule(
    "invariant.all_new_needs_every_rank",
    title="ALL_NEW only with every declared rank reporting the same call",
    section=S + "; M3.10 0x08 One model call prepares a complete logical state candidate",
    statement="When the last completion selected ALL_NEW in an R > 1 request, it recorded R rank entries, none "
    "left, each reported after all C collectives, and the reports agree: same identity and generation, positions "
    "[P_before, P_after) ([0, P_after) uncached), every advancing lane at P_after, every stage completed, one decision row. An ALL_OLD "
    "completion exposes no score (invariant.all_old_exposes_nothing).",
)
def all_new_needs_every_rank(params: RequestParams, state: RequestState) -> bool:
    last = state.last_completion
    if last is None or last.selection is not Selection.ALL_NEW or params.ranks == 1:
        return True
    if tuple(p.rank for p in last.ranks) != declared_ranks(params):
        return False
    reports = [p.report for p in last.ranks]
    if any(p.left is not None or p.entered != params.collectives for p in last.ranks) or None in reports:
        return False
    first = reports[0]
    assert first is not None
    advancing = set(params.profile.advancing_lanes())
    for report in reports:
        assert report is not None
        if attrs.evolve(report, rank=first.rank) != first or report.identity != params.identity:
            return False
        start = last.processed_before if params.cached else 0
        if (report.start, report.start + report.length) != (start, last.processed_after):
            return False
        if not report.stages_ok or any(f != last.processed_after for name, f in report.lanes if name in advancing):
            return False
    return True
