"""Shared names of the contract: phases, pending tags, call kinds, selections, finish reasons.

These enums are the only spec objects that ``impl/`` imports (types and enums, never
transitions), so that spec, runtime, traces and docs use one name per concept.  Enum values
are the lowercase strings written in JSON traces and envelopes.

Source: M3.10 "Authoritative phase and commit spine" (O, U, P, K and the U tags), M3.10 0x08
"One model call prepares a complete logical state candidate" (ALL_NEW / ALL_OLD), M3.10 0x06
"Finish reason and RNG precedence".
"""

from __future__ import annotations

import enum

__all__ = [
    "AFTER_CLOSE_FAILURES",
    "EXTERNAL_FINISH_REASONS",
    "FINISH_PRECEDENCE",
    "CallKind",
    "FinishReason",
    "PendingTag",
    "Selection",
    "canonical_finish_reason",
    "published_finish_reason",
]


class PendingTag(str, enum.Enum):
    """Tag of U, the committed output suffix not yet processed by the model (M3.10 spine).

    * ``EMPTY``: every committed token is processed (P = L + O).
    * ``PENDING_NEXT_CALL``: the last committed token waits for the next model call.
    * ``CLOSED_UNPROCESSED``: the request finished; the last token stays unprocessed unless an
      explicit append / repair call processes it (M3.10 "The first-output off-by-one").
    """

    EMPTY = "EMPTY"
    PENDING_NEXT_CALL = "PENDING_NEXT_CALL"
    CLOSED_UNPROCESSED = "CLOSED_UNPROCESSED"


class CallKind(str, enum.Enum):
    """Kind of one model call (M3.10 0x08).

    * ``PREFILL``: processes a slice of the prompt (the whole prompt, or one chunk of it); only
      the call that reaches the prompt end exposes a decision row.
    * ``DECODE``: processes the one pending output token and exposes the next decision row.
    * ``REPAIR``: processes a CLOSED_UNPROCESSED final token after finish; its logits are
      discarded (M3.10 "optional append/repair").
    """

    PREFILL = "prefill"
    DECODE = "decode"
    REPAIR = "repair"


class Selection(str, enum.Enum):
    """Logical result of a completed call (M3.10 0x08 SELECT LOGICAL STATE).

    ``ALL_NEW`` only when the closed compute-stage roster and the advancing-state-lane roster
    both agree on request, generation, frontier and output row; otherwise ``ALL_OLD`` (no
    consumable score, no logical change).
    """

    ALL_NEW = "ALL_NEW"
    ALL_OLD = "ALL_OLD"


class FinishReason(str, enum.Enum):
    """Why a request is terminal.  The declared precedence is :data:`FINISH_PRECEDENCE`.

    ``CONSTRAINT_ERROR``: the M3.8 policy found the legal support of the current score row empty
    (``policy.empty_support``: the constraint / parser state admits no token, and no declared
    fallback applies).  M3.10 0x02 branch table: "constraint/parser error -- typed terminal error
    with no unsupported next call"; M3.8 "Hard constraints define a conditional support" (raise,
    never silently restore the raw row or force EOS).  The request finishes at the decision with
    every committed token kept, no receipt issued and no RNG draw consumed.  ``STRUCTURED_ERROR``
    is the other parser role (M3.10 0x06 "Constraints before selection, completion after
    selection"): a committed token's bytes make the structured prefix invalid.
    """

    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    DEVICE_ERROR = "device_error"
    STREAM_ERROR = "stream_error"
    CONSTRAINT_ERROR = "constraint_error"
    STRUCTURED_ERROR = "structured_error"
    STOP_STRING = "stop_string"
    STRUCTURED = "structured"
    EOS = "eos"
    CONTEXT_LENGTH = "context_length"
    LENGTH = "length"


#: Finish precedence, highest first (M3.10 0x06 "Finish reason and RNG precedence": "Freeze a
#: precedence rule ... Record every trigger for diagnostics and publish one canonical finish
#: reason").  This project's declared choice:
#: cancelled > timeout > device_error > stream_error > constraint_error > structured_error >
#: stop_string > structured > eos > context_length > length.
#: Environment failures outrank content triggers; an explicit user stop string outranks a
#: structured completion and EOS; the total-context cap outranks ``max_new_tokens``.
FINISH_PRECEDENCE: tuple[FinishReason, ...] = (
    FinishReason.CANCELLED,
    FinishReason.TIMEOUT,
    FinishReason.DEVICE_ERROR,
    FinishReason.STREAM_ERROR,
    FinishReason.CONSTRAINT_ERROR,
    FinishReason.STRUCTURED_ERROR,
    FinishReason.STOP_STRING,
    FinishReason.STRUCTURED,
    FinishReason.EOS,
    FinishReason.CONTEXT_LENGTH,
    FinishReason.LENGTH,
)


def canonical_finish_reason(triggers: frozenset[FinishReason] | set[FinishReason] | tuple[FinishReason, ...]) -> FinishReason | None:
    """The one finish reason published for a set of simultaneous triggers, or ``None`` if empty.

    Args:
        triggers: Every finish condition that fired at one selection.

    Returns:
        The highest-precedence trigger under :data:`FINISH_PRECEDENCE`.
    """
    fired = set(triggers)
    for reason in FINISH_PRECEDENCE:
        if reason in fired:
            return reason
    return None


#: The external finish reasons: those that close the output from outside a token commit (no
#: committed token fired them).  The environment's (cancelled, timeout, device_error, stream_error)
#: and ``constraint_error``, which closes the output at a decision whose legal support is empty
#: (M3.10 0x02 branch table; U is empty then).  A request that finished for one of these never
#: runs the repair call; a stream closes on one only through ``Streamer.finish``; an output
#: observer replays a close for one (``external``, a member of this set, or ``length``).
#: This is the one name of the concept (it was also ``ENVIRONMENT_FAILURES``, issue 17).
EXTERNAL_FINISH_REASONS = frozenset({
    FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.DEVICE_ERROR, FinishReason.STREAM_ERROR,
    FinishReason.CONSTRAINT_ERROR,
})
#: What can still happen after a content trigger closed the output: the declared repair call is
#: cancelled, times out, or fails past its retries.  Recorded as triggers (diagnostics; the repair is
#: then abandoned and the final-cache promise not kept), never published as the finish reason.
AFTER_CLOSE_FAILURES = frozenset({FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.DEVICE_ERROR})


def published_finish_reason(triggers: frozenset[FinishReason] | set[FinishReason] | tuple[FinishReason, ...]) -> FinishReason | None:
    """The finish reason a request publishes for every trigger it recorded, or ``None`` if none.

    The canonical reason (:func:`canonical_finish_reason`) of the triggers that closed the output.
    When a content trigger closed it (no external finish reason among the closing triggers), an
    :data:`AFTER_CLOSE_FAILURES` trigger can only have been recorded afterwards, by the repair call
    (M3.10 "The first-output off-by-one": the repair call "is not another output decision"), and
    does not rewrite the published reason: ``{length, device_error}`` publishes ``length``.  At a
    close the result is always the canonical reason (no closing trigger set mixes a content
    trigger with cancelled / timeout / device_error).

    Source: M3.10 0x06 "Finish reason and RNG precedence" (one canonical reason; record every
    trigger for diagnostics), "The first-output off-by-one" (optional append/repair).
    """
    fired = frozenset(triggers)
    closing = fired - AFTER_CLOSE_FAILURES
    if closing - EXTERNAL_FINISH_REASONS:
        return canonical_finish_reason(closing)
    return canonical_finish_reason(fired)
