"""M3.10 "Immutable identity versus mutable request state": request parameters and request state.

TLA+ vocabulary: :class:`RequestParams` are the *constants* of one request (fixed by the
admitted envelope: prompt length L, ``max_new_tokens`` G, vocabulary size V, EOS ids, profile
and lane roster, cache family and capacity, the G=0 branch, the repair promise, chunking ...);
:class:`RequestState` holds the *variables* ``S_t = (I_request, X, A, P, C, R, F, U)``:

* ``output_ids`` / ``output_logprobs``: the committed output ledger (O = its length) and, per
  output token, the id of the score row that owns its logprob (the logprob value itself is
  uninterpreted in the spec);
* ``pending_ids`` / ``pending_tag``: U, the committed suffix not yet processed by the model,
  tagged EMPTY / PENDING_NEXT_CALL / CLOSED_UNPROCESSED;
* ``processed``: P (``P_dyn`` for hybrids); ``lanes``: one frontier ``F_lane`` per roster lane
  (``K_frontier`` is the ``self_kv`` lane in the decoder-only cached profile);
* ``generation``: the state/cache generation, advanced by every ALL_NEW selection and every
  recovery, to which scores and receipts are bound;
* ``in_flight``: the launched call (kind, slice, positions, expected roster);
* ``score``: the current consumable score (bound to frontier and generation) or ``None``;
* ``receipt`` / ``issued`` / ``consumed``: the pending M3.8 decision receipt and the receipt
  ledgers (exactly-once consumption);
* ``rng_counter``: the request RNG counter (advanced only by consumed draws);
* ``finish_reason`` / ``triggers``: the canonical finish reason and every trigger that fired;
* ``quarantined``: a possibly mutated cache handle awaits a recovery receipt.

Every value is a frozen attrs class; transitions build new states with ``attrs.evolve``.

Source: M3.10 "Immutable identity versus mutable request state", "Authoritative phase and commit
spine", "One request as a transition system", 0x08 "Output, input, and cache frontiers".
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs

from .enums import EXTERNAL_FINISH_REASONS, CallKind, FinishReason, PendingTag, Selection
from .participation import RankProgress
from .profiles import Profile, profile_named
from .request import context_cap

if TYPE_CHECKING:  # pragma: no cover
    from .envelope import AdmittedRequest

__all__ = [
    "CACHE_FAMILIES",
    "FINAL_CACHE_PROMISES",
    "ZERO_NEW_TOKENS_BRANCHES",
    "CacheFamily",
    "Completion",
    "ControllerAction",
    "InFlightCall",
    "InterruptPoint",
    "Phase",
    "Receipt",
    "RequestParams",
    "RequestState",
    "Score",
    "call_interrupt_point",
    "controller_action",
    "due_call",
    "initial_state",
    "interrupt_point",
    "is_terminal",
    "next_call",
    "params_from_request",
    "repair_outstanding",
    "repair_owed",
]



class CacheFamily(enum.StrEnum):
    """The envelope's ``runtime.cache_family`` (M3.10 0x09 family table); a ``str`` (``CacheFamily.STATIC == "static"``)."""

    NONE = "none"
    DYNAMIC = "dynamic"
    STATIC = "static"


#: The cache family names, in table order (the values of :class:`CacheFamily`).
CACHE_FAMILIES: tuple[str, ...] = tuple(f.value for f in CacheFamily)
#: The G=0 union (M3.10 "The first-output off-by-one"): reject before state construction,
#: prohibit every call, or perform a prefill-only call and select no output.
ZERO_NEW_TOKENS_BRANCHES = ("reject", "no_call", "prefill_only")
#: The envelope's ``output.final_cache`` promise.
FINAL_CACHE_PROMISES = ("none", "processed_inputs_only", "all_outputs")


class Phase(str, enum.Enum):
    """Authoritative phase of one request (M3.10 "Authoritative phase and commit spine").

    ``NEW`` before admission; ``REJECTED`` the G=0 ``reject`` branch (terminal, nothing built);
    ``READY`` between calls; ``IN_FLIGHT`` one call launched; ``SCORED`` an ALL_NEW call exposed a
    consumable score; ``DECIDED`` an M3.8 receipt was issued for it; ``FINISHED`` the output is
    closed (only a declared repair call may still run).
    """

    NEW = "new"
    REJECTED = "rejected"
    READY = "ready"
    IN_FLIGHT = "in_flight"
    SCORED = "scored"
    DECIDED = "decided"
    FINISHED = "finished"


class InterruptPoint(str, enum.Enum):
    """Where a cancellation, timeout or streamer failure arrives (trace field ``at``)."""

    BEFORE_LAUNCH = "before_launch"
    IN_FLIGHT = "in_flight"
    AFTER_COMPLETION = "after_completion"
    AFTER_DECISION = "after_decision"


@attrs.frozen
class RequestParams:
    """Immutable parameters of one request (the constants of the transition system).

    Attributes:
        identity: Request identity ``"sha256:<hex>"`` from the envelope.
        prompt_len: L, valid decoder-side input count (``>= 1``; for encoder-decoder the
            decoder start prefix, usually 1).
        max_new_tokens: G (``>= 0``).
        min_new_tokens: EOS is outside the decision support while ``O < min_new_tokens``.
        vocab_size: V.
        eos_ids: The termination EOS set.
        profile: Architecture profile and its lane roster.
        cache_family: ``"none"``, ``"dynamic"`` or ``"static"``.
        context_cap: C, the greatest total sequence length ``L + O`` (min of ``max_context``,
            ``max_total_tokens`` and the static capacity).  Reaching it fires
            ``context_length``.
        static_capacity: Reserved slots of a static cache, else ``None``.
        zero_new_tokens: The declared G=0 branch (one of :data:`ZERO_NEW_TOKENS_BRANCHES`).
        final_cache: The output's final-cache promise (:data:`FINAL_CACHE_PROMISES`).
        prefill_chunk: Largest prefill chunk, or ``None`` for one-shot prefill.
        prefix_length: Bidirectional prefix length of a prefix-LM request, else ``None``.
        source_len: S, source length of an encoder-decoder request, else ``None``.
        max_retries: How many failed (ALL_OLD) calls may be retried after recovery before the
            request finishes with ``device_error``.
        max_draws: Most RNG draws one decision may consume (0 for greedy, 1 for multinomial).
        rng_counter_start: The envelope's initial RNG counter.
        stream: Whether output is streamed (enables streamer failure).
        stop_strings: Whether stop strings are declared (enables the ``stop_string`` trigger).
        structured: Whether structured completion is declared (``structured`` /
            ``structured_error`` triggers).
        ranks: R, the declared participants of every model call (tensor-parallel ranks; 1 = one
            process, no rank layer; :mod:`decodespec.spec.participation`).
        collectives: C, collectives per call in the ranks' common schedule (R > 1 only).

    Units: tokens for every length and count.
    """

    identity: str
    prompt_len: int
    max_new_tokens: int
    vocab_size: int
    eos_ids: frozenset[int]
    profile: Profile = attrs.field(factory=lambda: profile_named("decoder_only"))
    min_new_tokens: int = 0
    cache_family: str = "dynamic"
    context_cap: int = 1 << 20
    static_capacity: int | None = None
    zero_new_tokens: str = "no_call"
    final_cache: str = "processed_inputs_only"
    prefill_chunk: int | None = None
    prefix_length: int | None = None
    source_len: int | None = None
    max_retries: int = 0
    max_draws: int = 0
    rng_counter_start: int = 0
    stream: bool = False
    stop_strings: bool = False
    structured: bool = False
    ranks: int = 1
    collectives: int = 1

    @property
    def cached(self) -> bool:
        """Whether calls reuse retained state (``cache_family != "none"``)."""
        return self.cache_family != "none"

    @property
    def roster(self) -> tuple[str, ...]:
        """The advancing-state-lane roster a call must complete: the profile's lanes when cached, else empty."""
        return self.profile.lane_names() if self.cached else ()

    @property
    def repair_required(self) -> bool:
        """Whether the output promises a final cache holding every output (the append/repair call)."""
        return self.final_cache == "all_outputs"


@attrs.frozen
class Score:
    """A consumable score row exposed by an ALL_NEW completion.

    Attributes:
        score_id: Stable id (``"score-<generation>"``).
        generation: The generation selected by the call that produced the row.
        processed: P when the row was exposed: the row belongs to input position
            ``processed - 1`` and predicts output index ``output_count``.
        output_count: O when the row was exposed.
    """

    score_id: str
    generation: int
    processed: int
    output_count: int


@attrs.frozen
class Receipt:
    """An M3.8 decision receipt as M3.10 consumes it (token, draws, bound score, RNG address).

    Attributes:
        receipt_id: Stable id (``"receipt-<n>"``).
        score_id: The score row it decides.
        token_id: The selected token.
        draws: RNG draws the decision consumed.
        rng_counter_before: Request RNG counter the decision read.
    """

    receipt_id: str
    score_id: str
    token_id: int
    draws: int
    rng_counter_before: int


@attrs.frozen
class InFlightCall:
    """The launched model call (M3.10 0x08 PREPARE).

    Attributes:
        call_id: 0-based call number within the request.
        kind: prefill / decode / repair.
        start: First input position processed (``cache_position`` of row 0).
        length: Rows processed.
        generation: Generation the call reads and must report.
        roster: Lanes expected to complete (the closed advancing-state-lane roster).
        decision_row: Input position whose output row owns the next decision, or ``None``
            (non-final prefill chunk, repair, G=0 prefill).
        interrupts: Cancel / timeout / stream failures that arrived while in flight.
        fault: ``"device_fault"`` / ``"missing_lane"`` reported while in flight, else ``None``.
        ranks: Each declared rank's progress through the call (``()`` when R = 1;
            M3.10 0x0A "One request can still be model-parallel").
    """

    call_id: int
    kind: CallKind
    start: int
    length: int
    generation: int
    roster: tuple[str, ...]
    decision_row: int | None
    interrupts: frozenset[FinishReason] = frozenset()
    fault: str | None = None
    ranks: tuple[RankProgress, ...] = ()

    @property
    def end(self) -> int:
        """The processed frontier the call reaches on ALL_NEW (half-open end of its slice)."""
        return self.start + self.length

    @property
    def position_ids(self) -> tuple[int, ...]:
        """Position ids (= cache positions) of the call's rows."""
        return tuple(range(self.start, self.end))


@attrs.frozen
class Completion:
    """What the last completed call selected (kept so invariants can check ALL_OLD and the rank roster).

    ``ranks`` is the call's rank progress at completion (``()`` when R = 1).
    """

    call_id: int
    kind: CallKind
    selection: Selection
    processed_before: int
    processed_after: int
    score_id: str | None
    ranks: tuple[RankProgress, ...] = ()


@attrs.frozen(cache_hash=True)
class RequestState:
    """Mutable request state ``S_t`` (a frozen value; each transition returns a new one).

    See the module docstring for the meaning of each field.  ``lanes`` is a tuple of
    ``(lane name, frontier or None)`` pairs in roster order.
    """

    identity: str
    phase: Phase
    processed: int = 0
    output_ids: tuple[int, ...] = ()
    output_logprobs: tuple[str, ...] = ()
    pending_ids: tuple[int, ...] = ()
    pending_tag: PendingTag = PendingTag.EMPTY
    lanes: tuple[tuple[str, int | None], ...] = ()
    generation: int = 0
    in_flight: InFlightCall | None = None
    score: Score | None = None
    receipt: Receipt | None = None
    issued: tuple[str, ...] = ()
    consumed: tuple[Receipt, ...] = ()
    scores: tuple[Score, ...] = ()
    rng_counter: int = 0
    finish_reason: FinishReason | None = None
    triggers: frozenset[FinishReason] = frozenset()
    quarantined: bool = False
    num_calls: int = 0
    num_retries: int = 0
    last_completion: Completion | None = None

    @property
    def output_count(self) -> int:
        """O, the committed output count."""
        return len(self.output_ids)

    def lane_frontier(self, name: str) -> int | None:
        """Frontier of lane ``name`` (``None`` before the lane holds state).

        Raises:
            KeyError: if the lane is not in the state's roster.
        """
        for lane, frontier in self.lanes:
            if lane == name:
                return frontier
        raise KeyError(name)

    def frontiers(self, params: RequestParams) -> dict[str, Any]:
        """The request's frontiers under the names its profile defines (what a report or trace prints).

        The contiguous full-K/V decoder-only cached profile reports ``{"P": P, "K": K_frontier}``;
        every other cached profile (hybrid, recurrent, prefix-LM, encoder-decoder) has no single
        K and reports ``{"P_dyn": P, "F_lane": {lane: frontier or None}}``; a request without a
        cache reports ``{"P": P}`` (no retained state).  Units: input positions.

        Source: M3.10 0x01 "Recurrent and hybrid state generalize the cache frontier" ("use P_dyn
        plus explicit F_lane values rather than inventing a physical K/V length").
        """
        if not params.cached:
            return {"P": self.processed}
        if params.profile.has_k_frontier:
            return {"P": self.processed, "K": self.lane_frontier("self_kv")}
        return {"P_dyn": self.processed, "F_lane": dict(self.lanes)}

    def k_frontier(self, params: RequestParams) -> int | None:
        """``K_frontier`` (the self K/V lane frontier) in the decoder-only cached profile, else ``None`` (no K defined)."""
        return self.frontiers(params).get("K")


def initial_state(params: RequestParams) -> RequestState:
    """The state before admission: identity bound, nothing processed, RNG at its start counter."""
    return RequestState(
        identity=params.identity,
        phase=Phase.NEW,
        lanes=tuple((name, None) for name in params.roster),
        rng_counter=params.rng_counter_start,
    )


def repair_owed(*, phase: Phase, repair_required: bool, pending_tag: PendingTag, finish_reason: FinishReason | None,
                triggers: frozenset[FinishReason] | set[FinishReason]) -> bool:
    """Whether the declared append/repair call still has to process the closed final token.

    True when the request finished for a content reason (EOS, length, stop string, structured,
    context length), the output promises a final cache holding every output (``repair_required``),
    the last output is still CLOSED_UNPROCESSED, and no external finish reason
    (:data:`~decodespec.spec.enums.EXTERNAL_FINISH_REASONS`) is recorded (not at the close, and
    not after it: a repair call that was cancelled, timed out or failed past its retries is
    abandoned).  Over plain fields, so that a runtime's controller asks the same rule.

    Source: M3.10 "The first-output off-by-one" (``P = L + G`` only after an explicit append).
    """
    return (
        phase is Phase.FINISHED
        and repair_required
        and pending_tag is PendingTag.CLOSED_UNPROCESSED
        and finish_reason is not None
        and not triggers & EXTERNAL_FINISH_REASONS
    )


def repair_outstanding(params: RequestParams, state: RequestState) -> bool:
    """:func:`repair_owed` of a spec state (``final_cache == "all_outputs"``)."""
    return repair_owed(phase=state.phase, repair_required=params.repair_required, pending_tag=state.pending_tag,
                       finish_reason=state.finish_reason, triggers=state.triggers)


def next_call(*, phase: Phase, processed: int, prompt_len: int, output_count: int, cached: bool, prefill_chunk: int | None,
              pending_tag: PendingTag, call_in_flight: bool, quarantined: bool, repair_owed: bool) -> tuple[CallKind, int, int] | None:
    """``(kind, start, length)`` of the call the controller launches next, or ``None`` when none is due.

    The schedule of model calls: no call while one is in flight or the handle is quarantined;
    the whole remaining prompt (the next chunk of ``prefill_chunk`` rows when chunked; the whole
    prompt from 0 without a cache) while the prompt is unprocessed; the pending token's decode
    call (one row at P cached, ``L + O`` rows from 0 without a cache); the repair call (same
    slice) when it is owed (:func:`repair_owed`).  Over plain fields, so that every controller
    (the spec side of the gate, the reference runtime, the peer adapters) asks this one rule.

    Source: M3.10 0x08 "Prefill and decode", "The first-output off-by-one", 0x03 "Decoder-only
    serving loop".
    """
    if call_in_flight or quarantined:
        return None
    if phase is Phase.READY and processed < prompt_len and output_count == 0:
        if not cached:
            return CallKind.PREFILL, 0, prompt_len
        remaining = prompt_len - processed
        return CallKind.PREFILL, processed, remaining if prefill_chunk is None else min(prefill_chunk, remaining)
    start, length = (processed, 1) if cached else (0, prompt_len + output_count)
    if phase is Phase.READY and pending_tag is PendingTag.PENDING_NEXT_CALL:
        return CallKind.DECODE, start, length
    if repair_owed:
        return CallKind.REPAIR, start, length
    return None


class ControllerAction(enum.StrEnum):
    """The controller's actions, in the order :func:`controller_action` considers them."""

    COMPLETE = "complete"
    RECOVER = "recover"
    DECIDE = "decide"
    COMMIT = "commit"
    LAUNCH = "launch"


def controller_action(*, phase: Phase, call_in_flight: bool, quarantined: bool, repair_owed: bool, call_due: bool) -> ControllerAction | None:
    """The one action the controller takes next, or ``None`` when the request needs none (terminal or waiting).

    Complete the call in flight; recover a quarantined handle that needs another call (READY, or
    a repair call owed); decide a scored row; commit a decision; launch the due call
    (:func:`next_call`).  Over plain fields, so that every controller -- the spec's composed
    request (:func:`decodespec.spec.request_machine.next_action`), the reference runtime's
    ``RequestRunner.step`` and the peer adapters' controller -- asks this one rule.

    Source: M3.10 0x00 "One request as a transition system" (the controller's schedule); 0x05
    (a decision is committed before the next call); 0x0A "Logical recovery sockets" (recover before
    the next call).
    """
    if call_in_flight:
        return ControllerAction.COMPLETE
    if quarantined and (phase is Phase.READY or repair_owed):
        return ControllerAction.RECOVER
    if phase is Phase.SCORED:
        return ControllerAction.DECIDE
    if phase is Phase.DECIDED:
        return ControllerAction.COMMIT
    if call_due:
        return ControllerAction.LAUNCH
    return None


def due_call(params: RequestParams, state: RequestState) -> tuple[CallKind, int, int] | None:
    """:func:`next_call` of a spec state."""
    return next_call(phase=state.phase, processed=state.processed, prompt_len=params.prompt_len, output_count=state.output_count,
                     cached=params.cached, prefill_chunk=params.prefill_chunk, pending_tag=state.pending_tag,
                     call_in_flight=state.in_flight is not None, quarantined=state.quarantined,
                     repair_owed=repair_outstanding(params, state))


def is_terminal(params: RequestParams, state: RequestState) -> bool:
    """Whether no further action is required: REJECTED, or FINISHED with no call in flight and no repair owed."""
    if state.phase is Phase.REJECTED:
        return True
    return state.phase is Phase.FINISHED and state.in_flight is None and not repair_outstanding(params, state)


def call_interrupt_point(phase: Phase, call_in_flight: bool) -> InterruptPoint | None:
    """Where an interrupt arriving now would land, or ``None`` when the phase admits none (NEW, REJECTED, FINISHED).

    A repair call in flight after the close (phase FINISHED) is ``IN_FLIGHT`` too: a cancel or
    timeout lands on it (the stream is closed, so a stream failure does not).  Over plain fields,
    so that every controller asks this one map.

    Source: M3.10 "Authoritative phase and commit spine" (cancellation and timeout at each phase).
    """
    if call_in_flight:
        return InterruptPoint.IN_FLIGHT
    return {
        Phase.READY: InterruptPoint.BEFORE_LAUNCH,
        Phase.IN_FLIGHT: InterruptPoint.IN_FLIGHT,
        Phase.SCORED: InterruptPoint.AFTER_COMPLETION,
        Phase.DECIDED: InterruptPoint.AFTER_DECISION,
    }.get(phase)


def interrupt_point(state: RequestState) -> InterruptPoint | None:
    """:func:`call_interrupt_point` of a spec state."""
    return call_interrupt_point(state.phase, state.in_flight is not None)


def params_from_request(request: AdmittedRequest) -> RequestParams:
    """The state-machine parameters of an admitted envelope.

    Beams are a different state machine (coupled branch state, M3.10 0x05); this single-path
    machine models the ``greedy`` and ``multinomial`` families and treats a beam request as
    its single-path skeleton with zero draws.

    Source: M3.10 "Immutable request envelope and canonical identity" (which planes bind which
    constants).
    """
    runtime = request.runtime
    termination = request.termination
    # M3.8 selectors (decodespec.spec.policy.selectors.DRAWS): multinomial draws one uniform per
    # decision; greedy and beam draw nothing.
    family = request.policy.family.value
    return RequestParams(
        identity=request.identity,
        prompt_len=request.decoder_prompt_len,
        max_new_tokens=termination.max_new_tokens,
        min_new_tokens=termination.min_new_tokens,
        vocab_size=request.text_interface.vocab_size,
        eos_ids=frozenset(termination.eos_ids),
        profile=profile_named(request.artifact.architecture),
        cache_family=runtime.cache_family,
        context_cap=context_cap(request.position_visibility.max_context, termination.max_total_tokens, runtime.static_capacity),
        static_capacity=runtime.static_capacity,
        zero_new_tokens=termination.zero_new_tokens,
        final_cache=request.output.final_cache,
        prefill_chunk=runtime.prefill_chunk,
        prefix_length=request.position_visibility.prefix_length,
        source_len=request.source_len,
        max_retries=runtime.max_retries,
        max_draws=1 if family == "multinomial" else 0,
        rng_counter_start=request.rng.counter,
        stream=request.output.stream,
        stop_strings=bool(termination.stop_strings),
        structured=termination.structured != "none",
    )
