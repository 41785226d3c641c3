"""The composed request: M3.10's state machine, M3.8's policy state, the stop/stream reference and the ledgers as one value.

:mod:`decodespec.spec.transitions` is the M3.10 machine over :class:`~decodespec.spec.state.RequestState`;
:mod:`decodespec.spec.policy` decides one row under a :class:`~decodespec.spec.policy.PolicyState`;
:mod:`decodespec.spec.stop` turns committed ids into text, triggers and stream chunks.  This module
composes them into the single request a runtime serves, so that "given this request and these score
rows, what must happen?" is answered by the spec alone (the oracle :mod:`decodespec.spec.oracle`, the
gate's lock step, the rows-in judge and the trace checker all step this one value):

* :class:`Request` -- the request's constants: the machine's :class:`~decodespec.spec.state.RequestParams`,
  the policy it decides with (``min_new_tokens`` added by
  :func:`~decodespec.spec.request.policy_with_min_new_tokens`), the :class:`~decodespec.spec.stop.StopConfig`,
  prompt, seed and the model's window.  Built from an admitted envelope by :func:`request_from_envelope`
  (or by :func:`compose` from parameters a caller already holds); admission is :func:`admission_refusal`.
* :class:`ComposedState` -- one frozen value: the M3.10 state, the committed and pending M3.8 policy
  state (RNG counter, constraint state, Mirostat ``mu``), the committed logprobs and the pending one,
  the latest call and the latest and latest committed decision.  The stop matcher, the incremental
  decoder and the stream are functions of the committed ids and the finish (:func:`output_view`): the
  spec derives them rather than keeping a second copy that could disagree (declared choice).
* pure steps over it: :func:`admit`, :func:`launch`, :func:`complete`, :func:`choose` (the policy on a
  row) + :func:`decide`, :func:`commit`, :func:`support_empty`, :func:`apply` (interrupts, faults,
  recovery), :func:`snapshot` / :func:`restore`; :func:`next_action` is the controller's schedule
  (which of them is due; the call due is :func:`~decodespec.spec.state.due_call`).

Every function returns a new value and raises the machine's own typed refusal
(``transition.not_enabled`` naming rule and guard, ``cache.capacity_exceeded``) with nothing changed.

Source: M3.10 0x00 "One request as a transition system", "Immutable request envelope and canonical
identity"; 0x05 exactly-once commit of a decision; M3.8 0x0B (the policy pipeline and its state).

Size: one request's constants, its composed frozen state and every pure step on it (admission, calls,
decisions, commits, interrupts, snapshots, the output view) in one place, so the oracle and the gate read one
module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from .actions import TEXT_TRIGGERS, Action, Admit, Commit, Decide, Launch, Restore, Snapshot, SupportEmpty
from .enums import EXTERNAL_FINISH_REASONS, CallKind, FinishReason
from .envelope import ZERO_NEW_TOKENS_REJECTED, AdmittedRequest
from .errors import NOT_ENABLED, DecodeSpecError, Rejection, ResourceLimit
from .policy import PolicyConfig, PolicyState, RequestView, ScoreRow, child_state, initial_policy_state, processed_row
from .policy import decide as policy_decide
from .policy.codes import TERMINAL_DECISION_CODES
from .policy.config import Family
from .policy.decide import ProcessedRow
from .policy.rng import rng_key, uniform
from .policy.scores import log_softmax
from .positions import CACHE_CAPACITY_EXCEEDED
from .request import CONTEXT_WINDOW_EXCEEDED, INVALID_REQUEST, context_cap, policy_with_min_new_tokens, prompt_room
from .snapshot import REPAIRED, SnapshotRecord, take_snapshot
from .state import Phase, RequestParams, RequestState, controller_action, due_call, initial_state, params_from_request, repair_outstanding
from .stop import Chunk, StopConfig, align_output, reference_stream, step_triggers
from .transitions import MACHINE, Machine, expected_report, expected_start

__all__ = [
    "CallRecord",
    "Choice",
    "ComposedState",
    "DecisionRecord",
    "OutputView",
    "Request",
    "SnapshotEntry",
    "admission_refusal",
    "admit",
    "apply",
    "choose",
    "commit",
    "complete",
    "compose",
    "decide",
    "initial",
    "launch",
    "next_action",
    "output_view",
    "refusal_of",
    "rekeyed",
    "request_from_envelope",
    "restore",
    "snapshot",
    "support_empty",
]

#: The bytes of one token id (a tokenizer's ``token_bytes``).
TokenBytes = Callable[[int], bytes]


# --------------------------------------------------------------------------------------------
# The request's constants.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Request:
    """The constants of one admitted single-path request.

    Attributes:
        params: The M3.10 machine's parameters (L, G, V, EOS set, cache family, S, C, ...).
        policy: The M3.8 policy the request decides with (``min_new_tokens`` included).
        stop: The stop/stream reference's configuration (G, EOS, stop strings, alignment, C).
        prompt_ids: The L decoder prompt ids.
        seed: The request seed (keys the RNG with ``params.identity``), or ``None``.
        window: The model's context window in positions, or ``None`` when not bound here.
        special_ids: Ids whose bytes never reach the text (a tokenizer's special tokens); EOS ids
            never do either (docs/design.md section 2).

    Source: M3.10 0x00 "Immutable request envelope and canonical identity" (which planes bind which constants).
    """

    params: RequestParams
    policy: PolicyConfig
    stop: StopConfig
    prompt_ids: tuple[int, ...]
    seed: int | None = None
    window: int | None = None
    special_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        """Whether the selector is greedy (family greedy, or temperature 0)."""
        t = self.policy.find("temperature")
        return self.policy.family is Family.GREEDY or (t is not None and t.get("temperature") == 0.0)

    def view(self, output_ids: Sequence[int]) -> RequestView:
        """The policy's request view after ``output_ids`` (M3.8 0x0B: the decision conditions on prompt + committed outputs)."""
        p = self.params
        return RequestView(prompt_ids=self.prompt_ids, output_ids=tuple(output_ids), eos_ids=sorted(p.eos_ids),
                           min_new_tokens=p.min_new_tokens, identity=p.identity, seed=self.seed)

    def output_bytes(self, ids: Sequence[int], token_bytes: TokenBytes) -> list[bytes]:
        """The output bytes of each id: ``b""`` for an EOS or special id, else ``token_bytes(id)``."""
        silent = self.special_ids | self.params.eos_ids
        return [b"" if t in silent else bytes(token_bytes(int(t))) for t in ids]


def compose(params: RequestParams, policy: PolicyConfig, *, prompt_ids: Sequence[int], seed: int | None = None,
            stop_strings: Sequence[str] = (), include_stop_str: bool = False, alignment: str = "token",
            window: int | None = None, special_ids: frozenset[int] = frozenset()) -> Request:
    """The :class:`Request` of parameters a caller already holds.

    The stop configuration takes its counts from ``params`` (G, the EOS set, ``min_new_tokens``,
    L, C), so the stop reference closes the output at exactly the commit where the machine
    finishes; ``json_completion`` is ``params.structured``.

    Raises:
        Rejection / ResourceLimit: ``policy.*`` (the augmented policy), ``stop.*`` (stop strings, alignment).
    """
    stop = StopConfig(max_new_tokens=params.max_new_tokens, eos_ids=params.eos_ids, min_new_tokens=params.min_new_tokens,
                      prompt_len=params.prompt_len, max_context_len=params.context_cap, stop_strings=tuple(stop_strings),
                      include_stop_str=include_stop_str, alignment=alignment, json_completion=params.structured)
    return Request(params=params, policy=policy_with_min_new_tokens(policy, params.min_new_tokens), stop=stop,
                   prompt_ids=tuple(int(t) for t in prompt_ids), seed=seed, window=window, special_ids=frozenset(special_ids))


def request_from_envelope(admitted: AdmittedRequest, *, window: int | None = None, special_ids: frozenset[int] = frozenset()) -> Request:
    """The :class:`Request` of an admitted ``numinens.request.v1`` envelope.

    Args:
        admitted: The envelope after :func:`~decodespec.spec.envelope.validate_request_envelope`.
        window: The model's context window; when given it also caps C (``context_length`` fires at
            the least of the envelope's bounds and the window, :func:`~decodespec.spec.request.context_cap`).
        special_ids: The tokenizer's special ids (no bytes in the text).

    The policy's RNG counter starts at the envelope's ``rng.counter`` (:func:`initial`).

    Source: M3.10 0x00 "Immutable request envelope and canonical identity".
    """
    params = params_from_request(admitted)
    if window is not None:
        params = attrs.evolve(params, context_cap=context_cap(window, params.context_cap))
    term, out = admitted.termination, admitted.output
    return compose(params, admitted.policy, prompt_ids=admitted.decoder_input_ids, seed=admitted.rng.seed,
                   stop_strings=term.stop_strings, include_stop_str=out.include_stop_str, alignment=out.alignment,
                   window=window, special_ids=special_ids)


def admission_refusal(params: RequestParams, prompt_ids: Sequence[int], window: int | None) -> DecodeSpecError | None:
    """The typed refusal of admitting a request with ``params`` and ``prompt_ids`` on a model of ``window`` positions, or ``None``.

    :func:`refusal_of` over the parameters' G, G = 0 branch, V and S.

    Source: as :func:`refusal_of`.
    """
    p = params
    return refusal_of(prompt_ids=prompt_ids, max_new_tokens=p.max_new_tokens, zero_new_tokens=p.zero_new_tokens,
                      vocab_size=p.vocab_size, static_capacity=p.static_capacity, window=window)


def refusal_of(*, prompt_ids: Sequence[int], max_new_tokens: int, zero_new_tokens: str, vocab_size: int,
               static_capacity: int | None, window: int | None) -> DecodeSpecError | None:
    """The runtime's admission refusal of a request, over its plain values, or ``None``.

    Over plain values, so a caller (the gate, whose cases may carry what an envelope would refuse
    with another code) can refuse before it builds an envelope or a :class:`Request` (a policy
    the schema refuses is refused first, by :func:`compose`).

    In order: G = 0 under the declared ``reject`` branch (``envelope.zero_new_tokens_rejected``);
    a prompt id outside ``[0, V)`` (``runtime.invalid_request``); ``L >= window``
    (``model.context_window_exceeded``); a static capacity that cannot hold the prompt and one
    output (``cache.capacity_exceeded``, :func:`~decodespec.spec.request.prompt_room`).

    Args:
        prompt_ids: The L prompt ids.
        max_new_tokens: G (tokens).
        zero_new_tokens: The G = 0 branch (``reject`` / ``no_call`` / ``prefill_only``).
        vocab_size: V.
        static_capacity: S (slots) of a static cache, else ``None``.
        window: The model's context window (positions), or ``None`` when not bound here.

    Source: M3.10 "The first-output off-by-one" (G = 0 reject), 0x00 "Immutable request envelope"
    (ids inside the vocabulary), 0x09 (static capacity), 0x0A (the window).
    """
    if max_new_tokens == 0 and zero_new_tokens == "reject":
        return Rejection(ZERO_NEW_TOKENS_REJECTED, "max_new_tokens is 0 and the declared G=0 branch is 'reject'", "$.max_new_tokens")
    if any(t >= vocab_size for t in prompt_ids):
        return Rejection(INVALID_REQUEST, f"a prompt id is outside [0, {vocab_size})", "$.prompt_ids")
    prompt_len = len(prompt_ids)
    if window is not None and prompt_len >= window:
        return ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"prompt length {prompt_len} leaves no room in the window {window}",
                             "$.prompt_ids")
    if static_capacity is not None and static_capacity < prompt_room(prompt_len, max_new_tokens):
        return ResourceLimit(CACHE_CAPACITY_EXCEEDED, f"static capacity {static_capacity} cannot hold the prompt", "$.static_capacity")
    return None


def rekeyed(request: Request, *, identity: str, seed: int | None) -> Request:
    """``request`` with its RNG keyed by ``identity`` and ``seed`` instead of the envelope's.

    For a harness whose request identity binds more than the envelope does (the gate's case
    identity also binds the device and the dtype it runs): the policy's draws are keyed by
    ``(identity, seed)`` (M3.8 0x06), so both sides of a lock step must key them alike.
    Nothing else changes.
    """
    return attrs.evolve(request, params=attrs.evolve(request.params, identity=identity), seed=seed)


# --------------------------------------------------------------------------------------------
# The composed state.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class CallRecord:
    """The latest launched model call: id, kind, first input position and rows (``cache_position`` = ``position_ids`` = ``start..end``)."""

    call_id: int
    kind: CallKind
    start: int
    length: int

    @property
    def positions(self) -> list[int]:
        """``[start, start + length)``: the call's ``position_ids`` and ``cache_position``."""
        return list(range(self.start, self.start + self.length))


@attrs.frozen(eq=False)
class DecisionRecord:
    """One decision as the request recorded it.

    Attributes:
        token: The selected id.
        logprob: ``log_softmax(raw row)[token]`` in float64 (nats) of the row the spec decided on.
        draws: Uniforms the selector consumed.
        support_ids: ``int64[k]`` the processed support (ids with positive probability).
        support_probs: ``float64[k]`` their processed probabilities.
        annotation: A caller's data carried with the record, opaque to the spec (the gate keeps
            how it compares the support there).
    """

    token: int
    logprob: float
    draws: int
    support_ids: Any
    support_probs: Any
    annotation: Any = None


@attrs.frozen(eq=False)
class ComposedState:
    """The whole request state as one value (see the module docstring).

    Attributes:
        machine: The M3.10 :class:`~decodespec.spec.state.RequestState`.
        policy_state: The M3.8 policy state after the last committed decision.
        pending_policy_state: The policy state after the pending (decided, uncommitted) decision.
        logprobs: The committed outputs' logprobs (nats), one per output id.
        pending_logprob: The pending decision's logprob.
        call: The latest launched call.
        decision: The latest decision (the pending one, else the latest committed one).
        committed_decision: The latest committed decision.
    """

    machine: RequestState
    policy_state: PolicyState
    pending_policy_state: PolicyState | None = None
    logprobs: tuple[float, ...] = ()
    pending_logprob: float | None = None
    call: CallRecord | None = None
    decision: DecisionRecord | None = None
    committed_decision: DecisionRecord | None = None

    @property
    def output_ids(self) -> tuple[int, ...]:
        """The committed output ids (O of them)."""
        return self.machine.output_ids


def initial(request: Request) -> ComposedState:
    """The state before admission: the machine's initial state and the policy's (RNG counter at the request's start)."""
    policy_state = attrs.evolve(initial_policy_state(request.policy), rng_counter=request.params.rng_counter_start)
    return ComposedState(machine=initial_state(request.params), policy_state=policy_state)


def _step(request: Request, state: ComposedState, action: Action, machine: Machine) -> ComposedState:
    return attrs.evolve(state, machine=machine.step(request.params, state.machine, action))


def admit(request: Request, state: ComposedState | None = None, *, machine: Machine = MACHINE) -> ComposedState:
    """``Admit`` from :func:`initial` (or ``state``).

    Raises:
        DecodeSpecError: :func:`admission_refusal`'s refusal, or the machine's.
    """
    refusal = admission_refusal(request.params, request.prompt_ids, request.window)
    if refusal is not None:
        raise refusal
    return _step(request, initial(request) if state is None else state, Admit(), machine)


def launch(request: Request, state: ComposedState, kind: CallKind | None = None, length: int | None = None, *,
           machine: Machine = MACHINE) -> ComposedState:
    """``Launch`` a call at the expected start (P cached, 0 without a cache).

    Args:
        kind: The call kind; ``None``: the due call's (:func:`~decodespec.spec.state.due_call`).
        length: Rows; ``None``: the due call's, else one row cached or the whole sequence without a cache.

    Raises:
        Rejection: ``transition.not_enabled`` (rule ``controller``, guard "a call is due") when
            ``kind`` is ``None`` and no call is due; the machine's refusal otherwise.
    """
    due = due_call(request.params, state.machine)
    if kind is None:
        if due is None:
            raise Rejection(NOT_ENABLED, f"no call is due in phase {state.machine.phase.value}", "$.action",
                            details={"rule": "controller", "guard": "a call is due"})
        kind = due[0]
    start = expected_start(request.params, state.machine)
    if length is None:
        cached = request.params.cached
        length = due[2] if due is not None and due[0] is kind else (1 if cached else request.params.prompt_len + state.machine.output_count)
    after = _step(request, state, Launch(kind, start, length), machine)
    call = after.machine.in_flight
    assert call is not None
    return attrs.evolve(after, call=CallRecord(call.call_id, call.kind, call.start, call.length))


def complete(request: Request, state: ComposedState, *, machine: Machine = MACHINE) -> ComposedState:
    """``Complete`` the in-flight call under the report both rosters agree on (ALL_NEW; :func:`~decodespec.spec.transitions.expected_report`)."""
    return _step(request, state, expected_report(request.params, state.machine), machine)


@attrs.frozen(eq=False)
class Choice:
    """The spec policy's decision on one raw score row at a scored state (nothing stepped yet).

    Attributes:
        score_id: The scored call's row id.
        output_index: O, the output this decision fills.
        row: ``float64[V]`` the raw score row decided on.
        token: The selected id.
        draws: Uniforms consumed.
        processed: The processed row (selector input, support, probabilities).
        policy_state: The policy state after selecting ``token``.
        u: The decision's first uniform (sampled selectors), else ``None``.
    """

    score_id: str
    output_index: int
    row: np.ndarray
    token: int
    draws: int
    processed: ProcessedRow
    policy_state: PolicyState
    u: float | None


def choose(request: Request, state: ComposedState, row: Sequence[float] | np.ndarray, *, machine: Machine = MACHINE) -> Choice | None:
    """The policy's decision on ``row`` (the raw scores the current scored call exposed), or ``None`` for an empty legal support.

    Args:
        row: ``[V]`` raw scores (logits) of ``prompt_ids + output_ids``.

    Returns:
        The :class:`Choice`; ``None`` when the policy finds no legal token (``policy.empty_support``:
        the typed terminal finish ``constraint_error``, :func:`support_empty`).

    Raises:
        Rejection: the machine's ``transition.decide`` refusal when no score row is pending;
            ``policy.*`` for a row the policy refuses otherwise.

    Source: M3.8 0x0B (the pipeline over one row); M3.10 0x02 branch table (empty support).
    """
    m = state.machine
    if m.phase is not Phase.SCORED or m.score is None:
        machine.step(request.params, m, Decide(score_id="", token_id=0, draws=0))  # raises the spec's own refusal
        raise AssertionError("Decide is enabled outside SCORED")  # pragma: no cover
    raw = np.asarray(row, dtype=np.float64)
    view = request.view(m.output_ids)
    srow = ScoreRow.create(raw, row_id=m.score.score_id)
    try:
        receipt, after = policy_decide(srow, request.policy, state.policy_state, view)
    except DecodeSpecError as exc:
        if exc.code in TERMINAL_DECISION_CODES:
            return None
        raise
    processed = processed_row(srow, request.policy, state.policy_state, view)
    u = None if request.greedy else uniform(rng_key(request.params.identity, request.seed), view.step, 0)
    return Choice(m.score.score_id, m.output_count, raw, receipt.selected_id, receipt.draws, processed, after, u)


def decide(request: Request, state: ComposedState, choice: Choice, *, token: int | None = None, support: ProcessedRow | None = None,
           annotation: Any = None, machine: Machine = MACHINE) -> ComposedState:
    """``Decide``: record ``choice`` (or ``token`` in its place) as the pending decision.

    Args:
        choice: :func:`choose`'s result at this state.
        token: An id other than the choice's that the caller adopts (the gate adopts a runtime's
            id when the tolerance cannot rule it out); the policy state advances as for any
            selected id (:func:`~decodespec.spec.policy.child_state`).
        support: The processed row whose support the record keeps (default ``choice.processed``).
        annotation: Stored in the :class:`DecisionRecord`.

    Raises:
        Rejection: the machine's ``transition.decide`` refusal.
    """
    selected = choice.token if token is None else int(token)
    after = choice.policy_state if selected == choice.token else child_state(request.policy, state.policy_state, selected,
                                                                              draws=choice.draws)
    stepped = _step(request, state, Decide(choice.score_id, selected, choice.draws), machine)
    logprob = float(log_softmax(choice.row)[selected])
    probe = choice.processed if support is None else support
    record = DecisionRecord(selected, logprob, choice.draws, probe.support, probe.probs[probe.support], annotation)
    return attrs.evolve(stepped, pending_policy_state=after, pending_logprob=logprob, decision=record)


def support_empty(request: Request, state: ComposedState, *, machine: Machine = MACHINE) -> ComposedState:
    """``SupportEmpty``: the policy found no legal token; the request finishes ``constraint_error`` keeping its outputs."""
    score = state.machine.score
    return _step(request, state, SupportEmpty("" if score is None else score.score_id), machine)


def commit(request: Request, state: ComposedState, receipt_id: str | None = None, *, token_bytes: TokenBytes | None = None,
           machine: Machine = MACHINE) -> ComposedState:
    """``Commit`` the pending receipt (exactly once), with the text triggers its token fires.

    Args:
        receipt_id: The receipt to commit (default the pending one; another id is refused by the machine).
        token_bytes: The model's token bytes; needed when the request has stop strings or
            structured completion (the text triggers, :func:`~decodespec.spec.stop.step_triggers`).

    Raises:
        Rejection: the machine's ``transition.commit`` refusal (no receipt, a stale id).
        ValueError: text triggers are needed and ``token_bytes`` is ``None``.
    """
    m = state.machine
    pending = m.receipt
    rid = receipt_id if receipt_id is not None else (pending.receipt_id if pending is not None else "")
    text: frozenset[FinishReason] = frozenset()
    if pending is not None and rid == pending.receipt_id and (request.params.stop_strings or request.params.structured):
        if token_bytes is None:
            raise ValueError("the request's text triggers need the model's token bytes")
        ids = m.output_ids + (pending.token_id,)
        fired, _, _ = step_triggers(request.stop, ids, request.output_bytes(ids, token_bytes))
        text = frozenset(fired) & TEXT_TRIGGERS
    stepped = _step(request, state, Commit(rid, text), machine)
    assert state.pending_policy_state is not None and state.pending_logprob is not None
    return attrs.evolve(stepped, policy_state=state.pending_policy_state, logprobs=state.logprobs + (state.pending_logprob,),
                        pending_policy_state=None, pending_logprob=None, committed_decision=state.decision)


def apply(request: Request, state: ComposedState, action: Action, *, machine: Machine = MACHINE) -> ComposedState:
    """Any other M3.10 action (``Cancel``, ``StreamFailure``, ``Fault``, ``Recover``, ...).

    An interrupt that drops the pending receipt (a cancel or stream failure after ``Decide``)
    drops the pending decision with it: the latest decision is the latest committed one again
    (exactly-once: an uncommitted decision never becomes output).

    Raises:
        Rejection: the machine's refusal.
    """
    stepped = _step(request, state, action, machine)
    if stepped.machine.receipt is None and stepped.pending_logprob is not None:
        stepped = attrs.evolve(stepped, pending_policy_state=None, pending_logprob=None, decision=stepped.committed_decision)
    return stepped


def next_action(request: Request, state: ComposedState) -> str | None:
    """The controller's next action (:func:`decodespec.spec.state.controller_action`'s value: ``complete``, ``recover``,
    ``decide``, ``commit``, ``launch``), or ``None`` when nothing is due.

    Source: M3.10 0x00 "One request as a transition system" (the controller's schedule).
    """
    m = state.machine
    action = controller_action(phase=m.phase, call_in_flight=m.in_flight is not None, quarantined=m.quarantined,
                               repair_owed=repair_outstanding(request.params, m), call_due=due_call(request.params, m) is not None)
    return None if action is None else action.value


@attrs.frozen(eq=False)
class SnapshotEntry:
    """A snapshot of the composed state: the machine's record plus the policy state, logprobs, latest call and decision."""

    record: SnapshotRecord
    policy_state: PolicyState
    logprobs: tuple[float, ...]
    call: CallRecord | None
    decision: DecisionRecord | None


def snapshot(request: Request, state: ComposedState, form: str, *, machine: Machine = MACHINE) -> tuple[ComposedState, SnapshotEntry]:
    """``Snapshot`` in ``form``; a ``repaired`` snapshot with a pending token first runs the valid append call.

    The append call (decode between calls, repair after finish) runs only where a runtime would
    run it -- no call in flight, no quarantine; every refusal is then the machine's own
    ``transition.snapshot`` guard (``snapshot.form_unavailable``).

    Source: M3.10 0x09 snapshot forms; "The first-output off-by-one" (the append call).
    """
    m = state.machine
    if form == REPAIRED and m.pending_ids and m.in_flight is None and not m.quarantined:
        if m.phase is Phase.READY:
            state = complete(request, launch(request, state, CallKind.DECODE, machine=machine), machine=machine)
        elif repair_outstanding(request.params, m):
            state = complete(request, launch(request, state, CallKind.REPAIR, machine=machine), machine=machine)
    state = _step(request, state, Snapshot(form), machine)
    record = take_snapshot(request.params, state.machine, form)
    return state, SnapshotEntry(record, state.policy_state, state.logprobs, state.call, state.decision)


def restore(request: Request, entry: SnapshotEntry, record: SnapshotRecord | None = None, *, machine: Machine = MACHINE) -> ComposedState:
    """``Restore`` ``entry`` (or a tampered ``record`` in its place) into a fresh request.

    Raises:
        Rejection: ``snapshot.*`` from the machine's restore checks.
    """
    fresh = machine.step(request.params, initial_state(request.params), Restore(entry.record if record is None else record))
    return ComposedState(machine=fresh, policy_state=entry.policy_state, logprobs=entry.logprobs, call=entry.call,
                         decision=entry.decision, committed_decision=entry.decision)


# --------------------------------------------------------------------------------------------
# The output the request must show.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class OutputView:
    """What the request's output must be at a state.

    Attributes:
        text: The returned text (while running: every committed byte, decoded with replacement).
        chunks: The stream's delivered chunks when the request streams, else ``None``.
        returned_ids: The returned output ids once finished (after alignment), else ``None``.
        returned_logprobs: Their logprobs, else ``None``.
    """

    text: str
    chunks: tuple[Chunk, ...] | None
    returned_ids: tuple[int, ...] | None
    returned_logprobs: tuple[float, ...] | None


def output_view(request: Request, state: ComposedState, token_bytes: TokenBytes) -> OutputView:
    """The text, stream chunks and returned ids the request must show at ``state`` (:mod:`decodespec.spec.stop`).

    A commit that closed the output aligns it at its triggers (stop string cut, structured end);
    a close from outside (cancel, timeout, device or stream error) returns every committed id
    and flushes the stream, except after ``stream_error``.

    Source: M3.10 0x05 stop table and streaming; the output alignment contract (docs/design.md section 2).
    """
    m = state.machine
    ids = list(m.output_ids)
    stream = request.params.stream
    if not ids:
        finished = m.phase is Phase.FINISHED
        return OutputView("", () if stream else None, () if finished else None, () if finished else None)
    tb = request.output_bytes(ids, token_bytes)
    flush = None
    returned = None
    if m.phase is not Phase.FINISHED:
        text = b"".join(tb).decode("utf-8", errors="replace")
    elif m.triggers - EXTERNAL_FINISH_REASONS:  # a commit closed the output
        fired, match, structured_end = step_triggers(request.stop, ids, tb)
        aligned = align_output(request.stop, ids, tb, None, fired, match, structured_end)
        text, returned = aligned.text, aligned.output_ids
    else:  # closed from outside: everything committed is text; the stream flushes except after stream_error
        aligned = align_output(request.stop, ids, tb, None, frozenset(m.triggers))
        text, returned = aligned.text, aligned.output_ids
        flush = None if m.finish_reason is FinishReason.STREAM_ERROR else m.finish_reason
    chunks = tuple(reference_stream(request.stop, ids, tb, external=flush).chunks) if stream else None
    returned_ids = None if returned is None else tuple(returned)
    return OutputView(text, chunks, returned_ids, None if returned_ids is None else state.logprobs[:len(returned_ids)])
