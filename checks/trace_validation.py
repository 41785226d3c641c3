"""Trace validation: replay a runtime event trace (``decodespec.events.v1``) against the spec state machine.

:func:`validate_trace` reads the trace line by line and keeps the **set of candidate spec
states** that could have produced the lines so far, starting from the state built by the
spec's own :func:`~decodespec.spec.state.initial_state` from the ``request`` header's ``params``
(the :class:`~decodespec.spec.state.RequestParams` fields).  Each event maps to its candidate
spec action(s) (see the table in :mod:`decodespec.impl.events`); a candidate survives a line
when the spec's :meth:`~decodespec.spec.transitions.Machine.step` enables the action and every
field the line states (frontiers, generation, selection, score id, receipt id, RNG counter,
triggers, finish reason ...) agrees with the spec's successor.  Observation events (``finish``,
``quarantine``, ``stream``) check the state without moving it.

A trace is accepted when every line is consumed and the request ends terminal, or suspended
right after a ``snapshot`` event; otherwise :class:`TraceVerdict` names the first unmatched line
(1-based ``line`` and its ``seq``), its event, and the reason (the failing guard clause, or the
field that disagreed and both values).

Source: docs/design.md section 6 (the trace format); M3.10 0x0BA "Requirements for
observability"; research/formal-anchors-survey.md (trace validation as membership of a
runtime trace in the spec's behaviours, as in TLA+ trace validation).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Iterable

import attrs

from decodespec.spec.actions import TEXT_TRIGGERS, Action, Admit, Cancel, Commit, Complete, Decide, Fault, Launch, Recover, Restore, Snapshot, StreamFailure, action_label
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason, PendingTag, Selection
from decodespec.spec.errors import DecodeSpecError, Rejection, register_code
from decodespec.spec.profiles import profile_named
from decodespec.spec.snapshot import SnapshotRecord
from decodespec.spec.state import Phase, RequestParams, RequestState, initial_state, interrupt_point, is_terminal
from decodespec.spec.transitions import MACHINE, Machine, completion_reason

__all__ = ["TRACE_INVALID", "TraceVerdict", "params_from_header", "validate_trace"]

TRACE_INVALID = register_code(
    "trace.invalid_header",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1)",
    "The trace's first line is not a request header whose params build the spec's RequestParams.",
)

#: Events that check the current state without a spec action.
_OBSERVATIONS = ("finish", "quarantine", "stream")


@attrs.frozen
class TraceVerdict:
    """The outcome of :func:`validate_trace`.

    Attributes:
        accepted: Every line matched and the request ended terminal (or suspended after a snapshot).
        num_lines: Lines read.
        consumed: Lines matched by some candidate state.
        line: 1-based number of the first unmatched line (``num_lines + 1`` when the trace ended
            too early), or ``None`` when accepted.
        seq: That line's ``seq`` (when it has one).
        event: That line's event name.
        reason: Why no candidate state matched it.
        num_candidates: Candidate spec states after the last consumed line.
        final_phase: The phase of the candidates after the last consumed line (``"mixed"`` when
            they differ).
    """

    accepted: bool
    num_lines: int
    consumed: int
    line: int | None = None
    seq: int | None = None
    event: str | None = None
    reason: str | None = None
    num_candidates: int = 0
    final_phase: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The verdict as a JSON object."""
        return attrs.asdict(self)


def params_from_header(header: dict[str, Any]) -> RequestParams:
    """The spec's :class:`RequestParams` from a ``request`` event.

    Raises:
        Rejection: ``trace.invalid_header`` when ``params`` is missing or a field is mistyped,
            or when it disagrees with the header (identity, prompt length).
    """
    try:
        p = dict(header["params"])
        params = RequestParams(
            identity=str(p["identity"]),
            prompt_len=int(p["prompt_len"]),
            max_new_tokens=int(p["max_new_tokens"]),
            vocab_size=int(p["vocab_size"]),
            eos_ids=frozenset(int(i) for i in p["eos_ids"]),
            profile=profile_named(p.get("profile", "decoder_only")),
            min_new_tokens=int(p.get("min_new_tokens", 0)),
            cache_family=str(p["cache_family"]),
            context_cap=int(p["context_cap"]),
            static_capacity=None if p.get("static_capacity") is None else int(p["static_capacity"]),
            zero_new_tokens=str(p.get("zero_new_tokens", "no_call")),
            final_cache=str(p.get("final_cache", "processed_inputs_only")),
            prefill_chunk=None if p.get("prefill_chunk") is None else int(p["prefill_chunk"]),
            max_retries=int(p.get("max_retries", 0)),
            max_draws=int(p.get("max_draws", 0)),
            rng_counter_start=int(p.get("rng_counter_start", 0)),
            stream=bool(p.get("stream", False)),
            stop_strings=bool(p.get("stop_strings", False)),
            structured=bool(p.get("structured", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise Rejection(TRACE_INVALID, f"the request header's params are not RequestParams: {type(exc).__name__}: {exc}", "$.params") from None
    if params.identity != header.get("identity") or params.prompt_len != len(header.get("prompt_ids", ())):
        raise Rejection(TRACE_INVALID, "params.identity / prompt_len disagree with the header's identity / prompt_ids", "$.params")
    return params


def _frontier(params: RequestParams, state: RequestState) -> dict[str, Any]:
    return {"prompt_len": params.prompt_len, "output_count": state.output_count, "pending": len(state.pending_ids),
            "processed": state.processed, "pending_tag": state.pending_tag.value}


def _differs(field: str, stated: Any, spec: Any) -> str | None:
    return None if stated == spec else f"field {field!r} is {stated!r} but the spec says {spec!r}"


def _first(*checks: str | None) -> str | None:
    return next((c for c in checks if c is not None), None)


Check = Callable[[RequestState, RequestState], "str | None"]


class _Replay:
    def __init__(self, header: dict[str, Any], machine: Machine):
        self.params = params_from_header(header)
        self.prompt_ids = tuple(int(t) for t in header["prompt_ids"])
        self.machine = machine

    # -- event -> [(action or None, check)] ------------------------------------------------------
    def candidates(self, rec: dict[str, Any], state: RequestState) -> list[tuple[Action | None, Check]]:
        event = rec.get("event")
        handler = getattr(self, f"_on_{event}", None)
        if handler is None:
            raise _Mismatch(f"unknown event {event!r}")
        return handler(rec, state)

    def _on_call_launched(self, rec, state):
        ids = list(rec["input_ids"])
        positions = list(rec["cache_position"])
        start = positions[0] if positions else -1
        action = Launch(CallKind(rec["kind"]), start, len(ids))
        sequence = list(self.prompt_ids + state.output_ids)

        def check(before, after):
            return _first(
                _differs("call_id", rec["call_id"], before.num_calls),
                _differs("frontier_before", rec["frontier_before"], _frontier(self.params, before)),
                _differs("generation", rec["generation"], before.generation),
                _differs("cache_position", positions, list(range(start, start + len(ids)))),
                _differs("position_ids", list(rec["position_ids"]), positions),
                _differs("input_ids", ids, sequence[start:start + len(ids)]),
            )

        return [(action, check)]

    def _on_fault(self, rec, state):
        kind = rec["kind"]
        action: Action = StreamFailure() if kind == "stream_error" else Fault(kind)
        return [(action, lambda b, a: None)]

    def _on_call_completed(self, rec, state):
        lanes = tuple((str(name), int(frontier)) for name, frontier in rec["lanes_completed"])
        action = Complete(int(rec["call_id"]), int(rec["generation"]), lanes, bool(rec["stages_ok"]), rec["output_row"])

        def check(before, after):
            last = after.last_completion
            score_id = after.score.score_id if after.score is not None and last.score_id is not None else None
            return _first(
                _differs("selection", rec["selection"], last.selection.value),
                _differs("reason", rec["reason"], completion_reason(self.params, before, action)),
                _differs("frontier_after", rec["frontier_after"], _frontier(self.params, after)),
                _differs("score_id", rec["score_id"], score_id),
            )

        return [(action, check)]

    def _on_decision(self, rec, state):
        action = Decide(rec["score_id"], int(rec["token_id"]), int(rec["draws"]))

        def check(before, after):
            logprob = rec.get("logprob")
            if not isinstance(logprob, (int, float)) or isinstance(logprob, bool) or not math.isfinite(logprob) or logprob > 1e-6:
                return f"field 'logprob' is {logprob!r}: a decision records a finite natural-log probability <= 0"
            return _first(
                _differs("receipt_id", rec["receipt_id"], after.receipt.receipt_id),
                _differs("rng_counter_before", rec["rng_counter_before"], before.rng_counter),
                _differs("rng_counter_after", rec.get("rng_counter_after"), before.rng_counter + int(rec["draws"])),
            )

        return [(action, check)]

    def _on_commit(self, rec, state):
        triggers = [FinishReason(t) for t in rec["triggers"]]
        action = Commit(rec["receipt_id"], frozenset(triggers) & TEXT_TRIGGERS)

        def check(before, after):
            logprob = rec.get("logprob")
            if not isinstance(logprob, (int, float)) or isinstance(logprob, bool) or not math.isfinite(logprob) or logprob > 1e-6:
                return f"field 'logprob' is {logprob!r}: a committed token carries its finite logprob <= 0"
            fired = after.triggers - before.triggers
            return _first(
                _differs("token_id", rec["token_id"], before.receipt.token_id),
                _differs("output_count", rec["output_count"], after.output_count),
                _differs("pending_tag", rec["pending_tag"], after.pending_tag.value),
                _differs("triggers", [t.value for t in triggers], [t.value for t in FINISH_PRECEDENCE if t in fired]),
            )

        return [(action, check)]

    def _on_cancel(self, rec, state):
        action = Cancel(FinishReason(rec["kind"]))
        return [(action, lambda before, after: _differs("at", rec["at"], getattr(interrupt_point(before), "value", None)))]

    def _on_recover(self, rec, state):
        return [(Recover(), lambda b, a: _first(_differs("generation", rec["generation"], a.generation),
                                                 _differs("processed", rec["processed"], a.processed)))]

    def _on_snapshot(self, rec, state):
        return [(Snapshot(rec["form"]), lambda b, a: _differs("frontier", rec["frontier"], _frontier(self.params, a)))]

    def _on_restore(self, rec, state):
        record = SnapshotRecord.from_json(rec["state"])
        return [(Restore(record), lambda b, a: _differs("frontier", rec["frontier"], _frontier(self.params, a)))]

    def _on_quarantine(self, rec, state):
        def check(before, after):
            if not before.quarantined:
                return "a quarantine event but the spec's handle is not quarantined"
            return _first(_differs("generation", rec["generation"], before.generation), _differs("processed", rec["processed"], before.processed))

        return [(None, check)]

    def _on_finish(self, rec, state):
        def check(before, after):
            if before.phase is not Phase.FINISHED:
                return f"a finish event but the spec's phase is {before.phase.value}"
            return _first(
                _differs("finish_reason", rec["finish_reason"], before.finish_reason.value),
                _differs("triggers", rec["triggers"], [t.value for t in FINISH_PRECEDENCE if t in before.triggers]),
                _differs("frontier", rec["frontier"], _frontier(self.params, before)),
            )

        return [(None, check)]

    def _on_stream(self, rec, state):
        return [(None, lambda b, a: None)]

    def _on_beam_step(self, rec, state):
        raise _Mismatch("beam_step events belong to the beam machine, not the single-path request machine")


class _Mismatch(Exception):
    pass


def _parse(index: int, raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        rec = raw
    else:
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _Mismatch(f"not a JSON object: {exc}") from None
    if not isinstance(rec, dict):
        raise _Mismatch("not a JSON object")
    if rec.get("v") != 1:
        raise _Mismatch(f"field 'v' is {rec.get('v')!r}, expected 1")
    if rec.get("seq") != index:
        raise _Mismatch(f"field 'seq' is {rec.get('seq')!r}, expected {index} (consecutive from 0)")
    return rec


def validate_trace(lines: Iterable[str | dict[str, Any]], *, machine: Machine = MACHINE) -> TraceVerdict:
    """Accept or reject an event trace against the spec (see the module docstring).

    Args:
        lines: The trace's lines (JSON text, or already-parsed dicts), in order.
        machine: The transition table to replay against (tests plug in broken ones).

    Returns:
        The :class:`TraceVerdict`; never raises for a bad trace.
    """
    items = list(lines)
    replay: _Replay | None = None
    candidates: set[RequestState] = set()
    last_event = None
    for index, raw in enumerate(items):
        rec: dict[str, Any] = {}
        try:
            rec = _parse(index, raw)
            event = rec.get("event")
            if index == 0:
                if event != "request":
                    raise _Mismatch(f"the first event must be 'request', got {event!r}")
                replay = _Replay(rec, machine)
                init = initial_state(replay.params)
                candidates = {init}
                try:
                    candidates.add(machine.step(replay.params, init, Admit()))
                except DecodeSpecError:
                    pass
                last_event = event
                continue
            if event == "request":
                raise _Mismatch("a second request header")
            assert replay is not None
            survivors: set[RequestState] = set()
            reasons: list[str] = []
            for state in candidates:
                for action, check in replay.candidates(rec, state):
                    if action is None:
                        after = state
                    else:
                        try:
                            after = machine.step(replay.params, state, action)
                        except DecodeSpecError as exc:
                            guard = exc.details.get("guard") or exc.details.get("check")
                            where = f"guard '{guard}' of {exc.details.get('rule', 'the transition')}" if guard else exc.code
                            reasons.append(f"{action_label(action)} is not enabled in phase {state.phase.value}: {where} fails ({exc.code})")
                            continue
                    why = check(state, after)
                    if why is None:
                        survivors.add(after)
                    else:
                        reasons.append(why)
            if not survivors:
                raise _Mismatch(reasons[0] if reasons else "no candidate state")
            candidates = survivors
            last_event = event
        except (_Mismatch, DecodeSpecError, KeyError, TypeError, ValueError, AttributeError) as exc:
            reason = exc.args[0] if isinstance(exc, _Mismatch) else (
                exc.message if isinstance(exc, DecodeSpecError) else f"malformed event: {type(exc).__name__}: {exc}")
            return TraceVerdict(False, len(items), index, index + 1, rec.get("seq"), rec.get("event"), reason,
                                len(candidates), _phase(candidates))
    if replay is None:
        return TraceVerdict(False, 0, 0, 1, None, None, "empty trace: no request header", 0, None)
    ended = any(is_terminal(replay.params, s) for s in candidates) or last_event == "snapshot"
    if not ended:
        return TraceVerdict(False, len(items), len(items), len(items) + 1, None, None,
                            f"the trace ends before the request is terminal (phase {_phase(candidates)}) and not after a snapshot",
                            len(candidates), _phase(candidates))
    return TraceVerdict(True, len(items), len(items), num_candidates=len(candidates), final_phase=_phase(candidates))


def _phase(states: set[RequestState]) -> str | None:
    phases = {s.phase.value for s in states}
    if not phases:
        return None
    return phases.pop() if len(phases) == 1 else "mixed"
