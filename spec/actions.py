"""M3.10 "One request as a transition system": the actions of the request state machine.

One frozen attrs class per action.  Controller actions (admit, launch, decide, commit,
recover) and environment actions (complete with a roster report, fault, cancel / timeout,
streamer failure) share one alphabet so the explorer can enumerate both.  The model is
uninterpreted: a :class:`Decide` carries the selected token and its draw count as the M3.8
receipt reports them; a :class:`Commit` carries the triggers the (uninterpreted) stop-string
matcher and structured parser report for the committed token.

Guards and effects live in :mod:`decodespec.spec.transitions`.

Source: M3.10 "Authoritative phase and commit spine" (four separate events), 0x02 branch table
(terminal and failure branches), 0x08 "One model call prepares a complete logical state
candidate" (SELECT LOGICAL STATE), 0x0A "Asynchronous completion and error boundaries".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import attrs

from .enums import CallKind, FinishReason
from .participation import EnterCollective, RankFault, RankTimeout, ReportRank

if TYPE_CHECKING:  # pragma: no cover
    from .snapshot import SnapshotRecord

__all__ = [
    "Action",
    "Admit",
    "Cancel",
    "Commit",
    "Complete",
    "Decide",
    "EnterCollective",
    "FAULT_KINDS",
    "Fault",
    "Launch",
    "RankFault",
    "RankTimeout",
    "Recover",
    "ReportRank",
    "Restore",
    "Snapshot",
    "StreamFailure",
    "SupportEmpty",
    "TEXT_TRIGGERS",
    "action_json",
    "action_label",
]

#: Fault kinds a runtime may report while a call is in flight.
FAULT_KINDS = ("device_fault", "missing_lane")
#: Triggers that only the text stop matcher / structured parser can report at commit.
TEXT_TRIGGERS = frozenset({FinishReason.STOP_STRING, FinishReason.STRUCTURED, FinishReason.STRUCTURED_ERROR})


@attrs.frozen
class Admit:
    """Admit the validated envelope: build the initial state, or take the declared G=0 branch."""


@attrs.frozen
class Launch:
    """Launch one model call over input positions ``[start, start + length)``.

    Attributes:
        kind: prefill (a prompt slice or chunk), decode (the pending token), repair (the
            CLOSED_UNPROCESSED final token after finish).
        start: First input position (``cache_position`` of row 0); the processed frontier P
            in a cached profile, 0 without a cache (full-prefix recomputation).
        length: Rows in the call.
    """

    kind: CallKind
    start: int
    length: int


@attrs.frozen
class Fault:
    """The runtime reports a fault of the in-flight call (``device_fault`` or ``missing_lane``).

    The call then completes ALL_OLD whatever its roster report says (M3.10 0x0A: an
    asynchronous device fault invalidates staged cache/output state).
    """

    kind: str


@attrs.frozen
class Complete:
    """The in-flight call reached its completion boundary; its closed-roster report.

    Attributes:
        call_id: The call that completed (must be the in-flight call).
        generation: The generation every participant reports.
        lanes: ``(lane, frontier)`` for every state lane that completed, in any order.
        stages_ok: Whether every declared compute stage through final export and vocabulary
            projection completed.
        output_row: Input position whose row the call exported as the decision row, or
            ``None`` when it exported none.
    """

    call_id: int
    generation: int
    lanes: tuple[tuple[str, int], ...]
    stages_ok: bool
    output_row: int | None


@attrs.frozen
class Decide:
    """Bind an M3.8 decision receipt to the current score row.

    Attributes:
        score_id: The score row the policy read.
        token_id: The selected token.
        draws: RNG draws the decision consumed (0 for greedy).
    """

    score_id: str
    token_id: int
    draws: int = 0


@attrs.frozen
class SupportEmpty:
    """The M3.8 policy found no legal token for the current score row: no receipt (``policy.empty_support``).

    M3.8 "Hard constraints define a conditional support" raises rather than restoring the raw
    row; M3.10 0x02 makes it a typed terminal finish (``constraint_error``) with no further call.

    Attributes:
        score_id: The score row the policy read.
    """

    score_id: str


@attrs.frozen
class Commit:
    """Consume the pending receipt exactly once into the output ledger.

    Attributes:
        receipt_id: The receipt to consume.
        text_triggers: Triggers the stop-string matcher / structured parser report after
            decoding the committed token (subset of :data:`TEXT_TRIGGERS`).
        stream_failed: The commit's own publish step (M3.10 0x06 "One selection is an
            output-state transaction", step 7) failed to deliver: ``stream_error`` is one of the
            commit's triggers (declared output-transaction policy), whether or not another
            trigger also closes the output.  Needs a streamed request.
    """

    receipt_id: str
    text_triggers: frozenset[FinishReason] = frozenset()
    stream_failed: bool = False


@attrs.frozen
class Cancel:
    """The caller cancels, or the request's deadline passes (``reason`` CANCELLED or TIMEOUT)."""

    reason: FinishReason


@attrs.frozen
class StreamFailure:
    """The streamer failed to deliver; declared policy: close like an interrupt with ``stream_error``."""


@attrs.frozen
class Recover:
    """A recovery receipt proves the quarantined handle is safe; reuse starts a new generation."""


@attrs.frozen
class Snapshot:
    """Take a resumable snapshot of form ``form`` (``pending_suffix`` or ``repaired``, :mod:`decodespec.spec.snapshot`).

    An observation: the request state is unchanged.
    """

    form: str


@attrs.frozen
class Restore:
    """Restore a snapshot into a fresh request (phase NEW) of the same identity.

    Attributes:
        record: The snapshot's logical record (:class:`decodespec.spec.snapshot.SnapshotRecord`).
    """

    record: "SnapshotRecord"


Action = Union[Admit, Launch, Fault, Complete, Decide, SupportEmpty, Commit, Cancel, StreamFailure, Recover, Snapshot, Restore,
               EnterCollective, ReportRank, RankFault, RankTimeout]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json") and not isinstance(value, (CallKind, FinishReason)):
        return value.to_json()
    if attrs.has(type(value)):  # a nested value (a rank's report)
        return {f.name: _jsonable(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if hasattr(value, "value") and isinstance(value, (CallKind, FinishReason)):
        return value.value
    if isinstance(value, frozenset):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def action_json(action: Action) -> dict[str, Any]:
    """The action as a JSON object ``{"action": <class name>, <field>: <value>, ...}``."""
    out: dict[str, Any] = {"action": type(action).__name__}
    for field in attrs.fields(type(action)):
        out[field.name] = _jsonable(getattr(action, field.name))
    return out


def action_label(action: Action) -> str:
    """A short readable label, e.g. ``Launch(kind=prefill, start=0, length=2)``."""
    if isinstance(action, Restore):
        r = action.record
        return f"Restore(form={r.form}, phase={r.phase.value}, P={r.processed}, O={r.output_count}, U={list(r.pending_ids)})"
    parts = []
    for field in attrs.fields(type(action)):
        parts.append(f"{field.name}={_jsonable(getattr(action, field.name))}")
    return f"{type(action).__name__}({', '.join(parts)})"
