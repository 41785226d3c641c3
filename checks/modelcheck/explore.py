"""Exhaustive small-scope checking of the request state machine (TLC-style breadth-first search).

:func:`explore` enumerates every state reachable from the initial state of one
:class:`~decodespec.spec.state.RequestParams` under the environment's full action alphabet:
controller actions (admit, launch every legal prefill chunk / decode / repair, decide every
token with every allowed draw count or find the support empty (``SupportEmpty``), commit with every declared text trigger, with and without
a failure of the commit's own delivery, recover) and
adversarial environment actions (cancel and timeout at every point, streamer failure, device
fault and missing-lane faults, completion reports with a missing lane, a stale generation, a
failed compute stage or a wrong decision row, duplicate and stale receipts, stale scores, a
decode launched at a reset ``cache_position``), and both snapshot forms wherever a state admits
them: each snapshot is restored into a fresh request (``transition.restore``, an edge from the
initial state) and must give back the state (``explore.restore_mismatch`` otherwise), while
corrupted copies of the record (:func:`corrupted_records`) must be refused with a
``snapshot.*`` code (``explore.corrupt_snapshot_restored`` otherwise).  The reachable graph is a ``networkx.DiGraph``
whose nodes are states and whose edges carry the rule id and the action.

On every state it checks every invariant of :mod:`decodespec.spec.invariants`; every
non-terminal state must have a successor other than an interrupt or a fault (no deadlock: the
controller can always make progress); every rejected action must raise a typed error.  A violation comes back as the shortest counterexample (BFS parent
pointers), convertible to an ITF trace (:meth:`Violation.to_itf`).  The result reports state
and transition counts, states per second, rule and phase-edge coverage, and the registered
transitions never exercised.

Deliberately broken transitions are plugged in with
``explore(params, machine=MACHINE.with_effect("transition.commit", broken))``.

Source: research/formal-anchors-survey.md 3.1 (TLC: exhaustive BFS gives shortest
counterexamples; coverage reveals never-enabled actions; deadlock check), 5.1 (ITF).

Size: one checker: the bounded state space, the breadth-first search, its invariants and the
counterexample output read together (TLC-style).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

import attrs
import networkx as nx

from decodespec.spec import invariants as inv
from decodespec.spec.actions import (
    Action,
    Admit,
    Cancel,
    Commit,
    Decide,
    Fault,
    Launch,
    Recover,
    Restore,
    Snapshot,
    StreamFailure,
    SupportEmpty,
    action_json,
    action_label,
)
from decodespec.spec.enums import CallKind, FinishReason, PendingTag
from decodespec.spec.errors import ERROR_CODES, DecodeSpecError, Rejection, register_code
from decodespec.spec.participation import (
    EnterCollective,
    RankFault,
    RankTimeout,
    ReportRank,
    active,
    expected_rank_report,
)
from decodespec.spec.profiles import PROFILES, profile_named
from decodespec.spec.request import context_cap, prompt_room, static_capacity, unbounded_context_cap
from decodespec.spec.snapshot import SNAPSHOT_FORMS, SnapshotRecord, take_snapshot
from decodespec.spec.state import Phase, RequestParams, RequestState, initial_state, is_terminal
from decodespec.spec.transitions import MACHINE, Machine, expected_report, expected_start

from . import itf

__all__ = [
    "CORRUPT_RESTORED",
    "DEADLOCK",
    "EXPLORE_INVALID_BOUNDS",
    "RESTORE_MISMATCH",
    "ExploreBounds",
    "ExploreResult",
    "InvalidBounds",
    "Violation",
    "candidate_actions",
    "corrupted_records",
    "explore",
    "frontier_label",
    "params_for_bounds",
]

#: Pseudo rule id reported for a non-terminal state whose only successors are interrupts or faults.
DEADLOCK = "explore.deadlock"
#: Pseudo rule id reported when a rejected action raised something other than a registered typed error.
UNTYPED_REJECTION = "explore.untyped_rejection"
#: Pseudo rule id reported when restoring a snapshot does not give back the snapshotted state.
RESTORE_MISMATCH = "explore.restore_mismatch"
#: Pseudo rule id reported when a corrupted snapshot record is restored instead of refused.
CORRUPT_RESTORED = "explore.corrupt_snapshot_restored"
EXPLORE_INVALID_BOUNDS = register_code(
    "explore.invalid_bounds", "rejection", "checks/modelcheck/explore.py ExploreBounds; M3.10 immutable request envelope",
    "Explorer bounds outside the small scope or describing no admissible request (unknown profile or cache "
    "family, V < 2, L < 1, G < 0, min_new_tokens outside [0, G], a non-positive prefill chunk or source length, "
    "negative retries or draws, a capacity or context cap without room for the prompt and one output, a "
    "prefix-LM prefix outside [1, L] or larger than the prefill chunk).")


class InvalidBounds(Rejection, ValueError):
    """``explore.invalid_bounds``: a :class:`~decodespec.spec.errors.Rejection` that is also a
    ``ValueError`` (what :func:`params_for_bounds` raised before the code existed)."""


#: Actions that are observations: they never count as the controller's progress.
_OBSERVATIONS = (Snapshot,)
#: Actions that only the environment takes to end or break a request; a state whose only
#: successors come from these is stuck (a deadlock of the controller).
_ENVIRONMENT_ONLY = (Cancel, StreamFailure, Fault, RankFault)
ITF_FORMAT = "decodespec.counterexample"
ITF_FORMAT_VERSION = 1


@attrs.frozen
class ExploreBounds:
    """Small-scope bounds and environment switches of one exploration.

    Attributes:
        vocab: V; token ``vocab - 1`` is the EOS id.
        prompt_len: L (decoder side; 1 for encoder-decoder).
        max_new_tokens: G.
        min_new_tokens: EOS is excluded from the support while O < this.
        profile: ``decoder_only``, ``encoder_decoder``, ``prefix_lm`` or ``hybrid``.
        cache: ``none``, ``dynamic`` or ``static``.
        capacity: Static-cache slots (default: the spec's, ``prompt_len + max_new_tokens + 1``,
            :func:`decodespec.spec.request.static_capacity`).
        context_cap: Total-length cap C (default: none beyond the capacity).
        prefill_chunk: Largest prefill chunk, or ``None`` for one-shot prefill.
        prefix_length: Prefix-LM prefix (default ``prompt_len``).
        source_len: Encoder-decoder source length S.
        zero_new_tokens: The G=0 branch.
        final_cache: ``processed_inputs_only`` or ``all_outputs`` (enables repair).
        max_retries: Failed calls that may be retried after recovery.
        max_draws: Draws per decision (0 greedy, 1 multinomial).
        stream: Streamed output (enables streamer failure, between calls and at a commit:
            ``Commit(stream_failed=True)``, M3.10 0x06 stream commit horizon).
        stop_strings / structured: Enable the matcher's text triggers at commit.
        interrupts: Generate cancel and timeout actions.
        faults: Generate faults and failing completion reports.
        adversarial: Generate actions that must be rejected (duplicate / stale receipts,
            stale scores, reset cache positions, corrupted snapshot records, a commit's stream
            failure in a request without a stream).
        snapshots: Take both snapshot forms wherever a state admits them and restore each
            record into a fresh request (it must give back the state).
        ranks: R declared participants of every call (1: one process, no rank layer).  With
            R > 1 every interleaving of the ranks' collective entries, reports, bounded-wait
            timeouts and (with ``faults``) rank faults is explored; with ``adversarial`` a rank
            may also report a stale generation or a different frontier (M3.10 0x0A "One request
            can still be model-parallel").
        collectives: C, collectives per call in the ranks' common schedule.
    """

    vocab: int = 3
    prompt_len: int = 3
    max_new_tokens: int = 3
    min_new_tokens: int = 0
    profile: str = "decoder_only"
    cache: str = "dynamic"
    capacity: int | None = None
    context_cap: int | None = None
    prefill_chunk: int | None = 2
    prefix_length: int | None = None
    source_len: int = 2
    zero_new_tokens: str = "no_call"
    final_cache: str = "all_outputs"
    max_retries: int = 1
    max_draws: int = 0
    stream: bool = True
    stop_strings: bool = False
    structured: bool = False
    interrupts: bool = True
    faults: bool = True
    adversarial: bool = True
    snapshots: bool = True
    ranks: int = 1
    collectives: int = 1


def params_for_bounds(bounds: ExploreBounds) -> RequestParams:
    """The request parameters of a small-scope configuration.

    Every bound is checked before anything is explored: bounds that describe no admissible
    request would otherwise show up as spec violations (a deadlock, a type or bound invariant)
    of a request the envelope refuses at admission.  The checks mirror the envelope's
    (``envelope.min_exceeds_max``, ``envelope.context_exceeded``, ``envelope.visibility_incompatible``,
    ``envelope.empty_prompt``; M3.10 "Immutable request envelope and canonical identity").

    Raises:
        InvalidBounds: ``explore.invalid_bounds`` (path ``$.<field>``; a ``Rejection`` and a ``ValueError``) for bounds outside the small
            scope: an unknown profile or cache family; V < 2, L < 1, G < 0; ``min_new_tokens``
            outside [0, G]; a prefill chunk, capacity, context cap or (encoder-decoder) source
            length below 1; negative ``max_retries`` or ``max_draws``; a capacity or context cap
            without room for the prompt plus one output (when G >= 1); a prefix-LM prefix
            outside [1, L] or larger than a (cached) prefill chunk.
    """

    def refuse(field: str, message: str) -> InvalidBounds:
        return InvalidBounds(EXPLORE_INVALID_BOUNDS, message, f"$.{field}")

    if bounds.profile not in PROFILES:
        raise refuse("profile", f"unknown profile {bounds.profile!r}; choose one of {sorted(PROFILES)}")
    if bounds.cache not in ("none", "dynamic", "static"):
        raise refuse("cache", f"unknown cache family {bounds.cache!r}; choose none, dynamic or static")
    for field, least in (("vocab", 2), ("prompt_len", 1), ("max_new_tokens", 0), ("min_new_tokens", 0),
                         ("max_retries", 0), ("max_draws", 0), ("ranks", 1), ("collectives", 0)):
        if getattr(bounds, field) < least:
            raise refuse(field, f"{field} {getattr(bounds, field)} must be >= {least}")
    for field in ("prefill_chunk", "capacity", "context_cap"):
        value = getattr(bounds, field)
        if value is not None and value < 1:
            raise refuse(field, f"{field} {value} must be >= 1 (or unset)")
    if bounds.min_new_tokens > bounds.max_new_tokens:
        raise refuse("min_new_tokens", f"min_new_tokens {bounds.min_new_tokens} exceeds max_new_tokens "
                     f"{bounds.max_new_tokens} (the envelope refuses it: envelope.min_exceeds_max)")
    profile = profile_named(bounds.profile)
    if profile.source_indexed and bounds.source_len < 1:
        raise refuse("source_len", f"source_len {bounds.source_len} must be >= 1 for {bounds.profile} "
                     "(the envelope refuses an empty source: envelope.empty_prompt)")
    needed = prompt_room(bounds.prompt_len, bounds.max_new_tokens)
    capacity = None
    if bounds.cache == "static":
        # The spec's default S (min(L + G + 1, window)); the small scope has no model window beyond L + G + 1.
        window = unbounded_context_cap(bounds.prompt_len, bounds.max_new_tokens)
        capacity = static_capacity("static", bounds.capacity, bounds.prompt_len, bounds.max_new_tokens, window)
        assert capacity is not None
        if capacity < needed:
            raise refuse("capacity", f"capacity {capacity} leaves no room after the {bounds.prompt_len}-token prompt "
                         f"(need >= {needed}: envelope.context_exceeded)")
    if bounds.context_cap is not None and bounds.context_cap < needed:
        raise refuse("context_cap", f"context_cap {bounds.context_cap} leaves no room after the {bounds.prompt_len}-token "
                     f"prompt (need >= {needed}: envelope.context_exceeded)")
    prefix = None
    if bounds.profile == "prefix_lm":
        prefix = bounds.prefix_length if bounds.prefix_length is not None else bounds.prompt_len
        if not 1 <= prefix <= bounds.prompt_len:
            raise refuse("prefix_length", f"prefix_length {prefix} must lie in [1, {bounds.prompt_len}]")
        if bounds.cache != "none" and bounds.prefill_chunk is not None and bounds.prefill_chunk < prefix:
            raise refuse("prefill_chunk", f"prefill_chunk {bounds.prefill_chunk} cannot hold the {prefix}-token prefix "
                         f"(the prefix is prefilled in one chunk): use a chunk >= {prefix}, 'none', or a shorter prefix_length")
    return RequestParams(
        identity="sha256:" + "0" * 64,
        prompt_len=bounds.prompt_len,
        max_new_tokens=bounds.max_new_tokens,
        min_new_tokens=bounds.min_new_tokens,
        vocab_size=bounds.vocab,
        eos_ids=frozenset({bounds.vocab - 1}),
        profile=profile,
        cache_family=bounds.cache,
        context_cap=(unbounded_context_cap(bounds.prompt_len, bounds.max_new_tokens) if capacity is None and bounds.context_cap is None
                     else context_cap(capacity, bounds.context_cap)),
        static_capacity=capacity,
        zero_new_tokens=bounds.zero_new_tokens,
        final_cache=bounds.final_cache,
        prefill_chunk=bounds.prefill_chunk if bounds.cache != "none" else None,
        prefix_length=prefix,
        source_len=bounds.source_len if profile.source_indexed else None,
        max_retries=bounds.max_retries,
        max_draws=bounds.max_draws,
        stream=bounds.stream,
        stop_strings=bounds.stop_strings,
        structured=bounds.structured,
        ranks=bounds.ranks,
        collectives=bounds.collectives,
    )


def candidate_actions(params: RequestParams, state: RequestState, bounds: ExploreBounds) -> Iterator[Action]:
    """Every action the environment and controller may attempt in ``state`` (guards filter them).

    The alphabet is phase-directed (an admit is only offered to a NEW request, and so on) but
    deliberately includes actions that must be rejected when ``bounds.adversarial`` is set.
    """
    phase = state.phase
    if phase is Phase.NEW:
        yield Admit()
        return
    if phase is Phase.REJECTED:
        return
    if bounds.interrupts and (phase is not Phase.FINISHED or state.in_flight is not None):  # incl. the repair call
        yield Cancel(FinishReason.CANCELLED)
        yield Cancel(FinishReason.TIMEOUT)
    if params.stream and phase is not Phase.FINISHED:
        yield StreamFailure()
    call = state.in_flight
    if call is not None:
        yield from _rank_actions(params, state, bounds)
        yield from _completions(params, state, bounds)
        return
    if state.quarantined:
        yield Recover()
    start = expected_start(params, state)
    if phase is Phase.READY:
        if state.processed < params.prompt_len:
            for length in range(1, params.prompt_len - state.processed + 1 if params.cached else params.prompt_len + 1):
                yield Launch(CallKind.PREFILL, start, length)
        else:
            length = 1 if params.cached else params.prompt_len + state.output_count
            yield Launch(CallKind.DECODE, start, length)
            if bounds.adversarial and params.cached and start > 0:
                yield Launch(CallKind.DECODE, 0, 1)  # cache_position reset after prefill
    elif phase is Phase.FINISHED:
        length = 1 if params.cached else params.prompt_len + state.output_count
        yield Launch(CallKind.REPAIR, start, length)
    elif phase is Phase.SCORED:
        assert state.score is not None
        for token in range(params.vocab_size):
            for draws in range(params.max_draws + 1):
                yield Decide(state.score.score_id, token, draws)
        yield SupportEmpty(state.score.score_id)  # the policy finds no legal token (constraint_error)
        if bounds.adversarial:
            for stale in state.scores[:-1][-1:]:
                yield Decide(stale.score_id, 0, 0)
                yield SupportEmpty(stale.score_id)
    elif phase is Phase.DECIDED:
        assert state.receipt is not None
        for triggers in _text_trigger_sets(params):
            yield Commit(state.receipt.receipt_id, triggers)
            if params.stream or bounds.adversarial:  # the commit's own delivery fails (refused without a stream)
                yield Commit(state.receipt.receipt_id, triggers, stream_failed=True)
    if bounds.snapshots and phase in (Phase.READY, Phase.SCORED, Phase.FINISHED):
        for form in SNAPSHOT_FORMS:
            yield Snapshot(form)
    if bounds.adversarial and phase in (Phase.DECIDED, Phase.READY, Phase.FINISHED):
        pending = state.receipt.receipt_id if state.receipt is not None else None
        for receipt_id in state.issued:
            if receipt_id != pending:
                yield Commit(receipt_id)  # duplicate (consumed) or stale (discarded) receipt


def _text_trigger_sets(params: RequestParams) -> list[frozenset[FinishReason]]:
    sets = [frozenset()]
    if params.stop_strings:
        sets.append(frozenset({FinishReason.STOP_STRING}))
    if params.structured:
        sets.append(frozenset({FinishReason.STRUCTURED}))
        sets.append(frozenset({FinishReason.STRUCTURED_ERROR}))
    return sets


def _rank_actions(params: RequestParams, state: RequestState, bounds: ExploreBounds) -> Iterator[Action]:
    """Every active rank's next step: enter, report (and, adversarially, a stale or shifted report), fault, time out."""
    call = state.in_flight
    assert call is not None
    for progress in call.ranks:
        if not active(progress):
            continue
        rank = progress.rank
        yield EnterCollective(rank)
        report = expected_rank_report(params, call, rank)
        yield ReportRank(report)
        if bounds.adversarial:  # a rank at another frontier (its K/V shard one row behind), else a stale generation
            yield ReportRank(attrs.evolve(report, lanes=tuple((n, f - 1) for n, f in report.lanes)) if report.lanes
                             else attrs.evolve(report, generation=report.generation - 1))
        if bounds.faults:
            yield RankFault(rank)
        yield RankTimeout(rank)


def _completions(params: RequestParams, state: RequestState, bounds: ExploreBounds) -> Iterator[Action]:
    ok = expected_report(params, state)
    yield ok
    if not bounds.faults:
        return
    call = state.in_flight
    assert call is not None
    if call.fault is None:
        yield Fault("device_fault")
        if call.roster:
            yield Fault("missing_lane")
    for index in range(len(ok.lanes)):
        yield attrs.evolve(ok, lanes=ok.lanes[:index] + ok.lanes[index + 1 :])
    if ok.lanes:
        yield attrs.evolve(ok, generation=ok.generation - 1)
    yield attrs.evolve(ok, stages_ok=False)
    if call.decision_row is not None and call.length > 1:
        yield attrs.evolve(ok, output_row=call.start)


def corrupted_records(params: RequestParams, record: SnapshotRecord) -> Iterator[tuple[str, SnapshotRecord]]:
    """Deliberately broken copies of ``record`` that restore must refuse: ``(what was broken, record)``.

    Another identity; the pending token counted as processed (P + 1 with U kept); the pending
    token dropped while P stays (U = []); a pending token labelled ``repaired``; a renamed lane
    (another cache ABI); an RNG counter that skips a draw.
    """
    yield "identity", attrs.evolve(record, identity="sha256:" + "f" * 64)
    yield "processed + 1", attrs.evolve(record, processed=record.processed + 1)
    if record.pending_ids:
        yield "pending dropped", attrs.evolve(record, pending_ids=(), pending_tag=PendingTag.EMPTY)
        yield "repaired with a pending token", attrs.evolve(record, form="repaired")
    if record.lanes:
        yield "lane renamed", attrs.evolve(record, lanes=(("other_lane", record.lanes[0][1]),) + record.lanes[1:])
    yield "rng counter", attrs.evolve(record, rng_counter=record.rng_counter + 1)


@attrs.frozen
class Violation:
    """A violated invariant (or a deadlock) with its shortest counterexample.

    Attributes:
        rule_id: The violated invariant's id, :data:`DEADLOCK` or ``explore.untyped_rejection``.
        states: The path of states from the initial state to the violating one.
        actions: ``actions[i]`` leads from ``states[i]`` to ``states[i + 1]``.
        rules: The transition rule that fired for each action.
        message: Human explanation.
    """

    rule_id: str
    states: tuple[RequestState, ...]
    actions: tuple[Action, ...]
    rules: tuple[str, ...]
    message: str

    def to_itf(self, params: RequestParams, bounds: ExploreBounds | None = None) -> dict[str, Any]:
        """The counterexample as an ITF trace: one record per state, plus ``action`` and ``rule``.

        ``#meta`` holds the format name and version, the violated rule id, the bounds and the
        parameters; state 0 has ``action == "init"``.
        """
        fields = [f.name for f in attrs.fields(RequestState)]
        records = []
        for index, state in enumerate(self.states):
            record = {name: getattr(state, name) for name in fields}
            record["action"] = "init" if index == 0 else action_label(self.actions[index - 1])
            record["rule"] = "init" if index == 0 else self.rules[index - 1]
            records.append(record)
        meta = {
            "format": ITF_FORMAT,
            "format-version": ITF_FORMAT_VERSION,
            "format-description": "https://apalache-mc.org/docs/adr/015adr-trace.html",
            "source": "spec/transitions.py",
            "violated": self.rule_id,
            "description": self.message,
            "bounds": attrs.asdict(bounds) if bounds is not None else None,
            "params": itf.encode(params),
            "actions": [action_json(a) for a in self.actions],
        }
        return itf.make_trace(["action", "rule", *fields], records, meta=meta)


@attrs.frozen
class ExploreResult:
    """Outcome of one exploration.

    Attributes:
        graph: Reachable states (nodes) and transitions (edges with ``rule`` and ``action``).
        num_states: Reachable states (graph nodes).
        num_transitions: Transitions taken (one per enabled action per state; several actions
            may join the same two states).
        num_edges: Distinct ``(state, next state)`` pairs (graph edges).
        elapsed_s: Wall time of the search, in seconds.
        rule_counts: Transitions taken per rule id.
        action_counts: Transitions taken per action type (``Launch``, ``Commit`` ...).
        phase_edges: Transitions taken per ``(phase before, phase after)``.
        rejected: Rejected attempts per ``(action type, error code)``.
        unexercised: Rules of the explored machine's table never taken.
        violations: Every violation found (each with its shortest counterexample).
        num_terminal: Terminal states reached.
        max_depth: Length of the longest shortest path.
    """

    graph: nx.DiGraph = attrs.field(repr=False)
    num_states: int
    num_transitions: int
    num_edges: int
    elapsed_s: float
    rule_counts: dict[str, int]
    action_counts: dict[str, int]
    phase_edges: dict[tuple[str, str], int]
    rejected: dict[tuple[str, str], int]
    unexercised: tuple[str, ...]
    violations: tuple[Violation, ...]
    num_terminal: int
    max_depth: int

    @property
    def states_per_second(self) -> float:
        """Throughput of the search (states / s)."""
        return self.num_states / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def ok(self) -> bool:
        """Whether no invariant was violated and no deadlock was found."""
        return not self.violations

    def summary(self) -> dict[str, Any]:
        """A JSON-ready report."""
        return {
            "ok": self.ok,
            "states": self.num_states,
            "transitions": self.num_transitions,
            "edges": self.num_edges,
            "terminal_states": self.num_terminal,
            "max_depth": self.max_depth,
            "elapsed_s": round(self.elapsed_s, 3),
            "states_per_second": round(self.states_per_second, 1),
            "rules": dict(sorted(self.rule_counts.items())),
            "actions": dict(sorted(self.action_counts.items())),
            "phase_edges": {f"{a}->{b}": n for (a, b), n in sorted(self.phase_edges.items())},
            "rejected": {f"{a}:{c}": n for (a, c), n in sorted(self.rejected.items())},
            "unexercised": list(self.unexercised),
            "violations": [
                {"rule": v.rule_id, "depth": len(v.actions), "message": v.message} for v in self.violations
            ],
        }


def frontier_label(params: RequestParams, state: RequestState) -> str:
    """The state's frontiers under its profile's names, e.g. ``P=3, K=3`` or ``P_dyn=3, F_lane={self_kv: 3, recurrent: 3}``.

    See :meth:`decodespec.spec.state.RequestState.frontiers` (M3.10 0x01: a hybrid or recurrent
    profile reports P_dyn and explicit F_lane values, never a K/V length).
    """
    parts = []
    for name, value in state.frontiers(params).items():
        if isinstance(value, dict):
            value = "{" + ", ".join(f"{lane}: {frontier}" for lane, frontier in value.items()) + "}"
        parts.append(f"{name}={value}")
    return ", ".join(parts)


def explore(
    params: RequestParams,
    bounds: ExploreBounds | None = None,
    *,
    machine: Machine = MACHINE,
    invariants: dict[str, inv.Invariant] | None = None,
    stop_on_violation: bool = True,
    max_states: int = 2_000_000,
) -> ExploreResult:
    """Breadth-first search of every state reachable from ``initial_state(params)``.

    Args:
        params: The request constants.
        bounds: Environment switches (interrupts, faults, adversarial actions); defaults apply.
        machine: The transition table (swap in a broken effect to test the checker).
        invariants: The invariants to check (default: all registered ones).
        stop_on_violation: Stop at the first violating state (its counterexample is shortest).
        max_states: Safety bound on the search.

    Returns:
        The :class:`ExploreResult`.

    Raises:
        RuntimeError: when more than ``max_states`` states are reachable.
    """
    bounds = bounds or ExploreBounds()
    checks = invariants if invariants is not None else inv.INVARIANTS
    started = time.perf_counter()
    init = initial_state(params)
    graph = nx.DiGraph()
    graph.add_node(init, depth=0)
    parent: dict[RequestState, tuple[RequestState, Action, str] | None] = {init: None}
    queue = collections.deque([init])
    rule_counts: collections.Counter[str] = collections.Counter()
    action_counts: collections.Counter[str] = collections.Counter()
    phase_edges: collections.Counter[tuple[str, str]] = collections.Counter()
    rejected: collections.Counter[tuple[str, str]] = collections.Counter()
    violations: list[Violation] = []
    num_terminal = 0
    max_depth = 0

    def path_to(state: RequestState) -> tuple[tuple[RequestState, ...], tuple[Action, ...], tuple[str, ...]]:
        states, actions, rules = [state], [], []
        link = parent[state]
        while link is not None:
            prev, action, rule_id = link
            states.append(prev)
            actions.append(action)
            rules.append(rule_id)
            link = parent[prev]
        return tuple(reversed(states)), tuple(reversed(actions)), tuple(reversed(rules))

    def report(rule_id: str, state: RequestState, message: str) -> None:
        states, actions, rules = path_to(state)
        violations.append(Violation(rule_id, states, actions, rules, message))

    def check(state: RequestState) -> bool:
        broken = [rid for rid, predicate in checks.items() if not predicate(params, state)]
        for rid in broken:
            report(rid, state, f"{rid} is false after {len(path_to(state)[1])} steps ({frontier_label(params, state)})")
        return not broken

    def restore_round_trip(state: RequestState, form: str) -> bool:
        """Restore ``state``'s snapshot into a fresh request; refuse every corrupted copy."""
        record = take_snapshot(params, state, form)
        restore = Restore(record)
        try:
            rule_id, restored = machine.step_with_rule(params, init, restore)
        except DecodeSpecError as exc:
            report(RESTORE_MISMATCH, state, f"restoring the {form} snapshot raised {exc.code}: {exc.message}")
            return False
        rule_counts[rule_id] += 1
        action_counts["Restore"] += 1
        phase_edges[(init.phase.value, restored.phase.value)] += 1
        graph.add_edge(init, state, rule=rule_id, action=restore)
        if restored != attrs.evolve(state, last_completion=None):
            report(RESTORE_MISMATCH, state, f"the restored {form} snapshot differs from the state it was taken in")
            return False
        broken = [rid for rid, predicate in checks.items() if not predicate(params, restored)]
        for rid in broken:
            report(rid, state, f"{rid} is false in the restored {form} snapshot")
        if broken:
            return False
        if not bounds.adversarial:
            return True
        for what, bad in corrupted_records(params, record):
            try:
                machine.step_with_rule(params, init, Restore(bad))
            except DecodeSpecError as exc:
                rejected[("Restore", exc.code)] += 1
                continue
            report(CORRUPT_RESTORED, state, f"a {form} snapshot with a corrupted field ({what}) was restored")
            return False
        return True

    if not check(init) and stop_on_violation:
        queue.clear()
    while queue:
        state = queue.popleft()
        depth = graph.nodes[state]["depth"]
        max_depth = max(max_depth, depth)
        successors = 0  # successors the request reaches without an interrupt or a fault
        for action in candidate_actions(params, state, bounds):
            try:
                rule_id, nxt = machine.step_with_rule(params, state, action)
            except DecodeSpecError as exc:
                rejected[(type(action).__name__, exc.code)] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - a typed error is the only acceptable refusal
                report(UNTYPED_REJECTION, state, f"{action_label(action)} raised {type(exc).__name__}: {exc}")
                if stop_on_violation:
                    queue.clear()
                    break
                continue
            if not isinstance(action, _ENVIRONMENT_ONLY + _OBSERVATIONS):
                successors += 1
            rule_counts[rule_id] += 1
            action_counts[type(action).__name__] += 1
            phase_edges[(state.phase.value, nxt.phase.value)] += 1
            if isinstance(action, Snapshot):
                if not restore_round_trip(state, action.form) and stop_on_violation:
                    queue.clear()
                    break
                continue  # an observation: no edge, the state is unchanged
            if nxt not in parent:
                parent[nxt] = (state, action, rule_id)
                graph.add_node(nxt, depth=depth + 1)
                if len(parent) > max_states:
                    raise RuntimeError(f"more than {max_states} reachable states; tighten the bounds")
                if not check(nxt) and stop_on_violation:
                    queue.clear()
                    break
                queue.append(nxt)
            graph.add_edge(state, nxt, rule=rule_id, action=action)
        else:
            if is_terminal(params, state):
                num_terminal += 1
            elif successors == 0:
                report(DEADLOCK, state, f"non-terminal state in phase {state.phase.value} can only be ended by the environment")
                if stop_on_violation:
                    break
    elapsed = time.perf_counter() - started
    unexercised = tuple(rid for rid in machine.rule_ids() if rid not in rule_counts)
    return ExploreResult(
        graph=graph,
        num_states=graph.number_of_nodes(),
        num_transitions=sum(rule_counts.values()),
        num_edges=graph.number_of_edges(),
        elapsed_s=elapsed,
        rule_counts=dict(rule_counts),
        action_counts=dict(action_counts),
        phase_edges=dict(phase_edges),
        rejected=dict(rejected),
        unexercised=unexercised,
        violations=tuple(violations),
        num_terminal=num_terminal,
        max_depth=max_depth,
    )


def registered_codes_of(result: ExploreResult) -> set[str]:
    """Error codes seen among rejected attempts (each must be registered)."""
    return {code for _, code in result.rejected if code in ERROR_CODES}
