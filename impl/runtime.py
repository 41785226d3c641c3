"""M3.10 single-request runtime: a step-wise request controller over a real model and cache.

:class:`RequestRunner` runs one request with explicit integer state (never inferred from
tensor contents) and one method per action the spec names (M3.10; the spec's transitions are
never imported or called here -- tests/test_layout.py checks it -- so the runtime computes its own
answers and the checker, which maps the two, stays an independent oracle), so a test can drive the
spec and the runtime in lock step:

==========================  ===========================================================
runner method               spec action / rule
==========================  ===========================================================
:meth:`admit`               ``Admit`` (``admit`` / ``admit_no_call``)
:meth:`launch`              ``Launch(kind, start, length)`` (prefill chunk / decode / repair)
:meth:`complete`            ``Fault`` (if the call raised) then ``Complete`` (ALL_NEW / ALL_OLD)
:meth:`decide`              ``Decide(score_id, token_id, draws)``, or ``SupportEmpty(score_id)``
:meth:`commit`              ``Commit(receipt_id, text_triggers)``
:meth:`cancel`              ``Cancel(cancelled | timeout)`` at the current interrupt point
:meth:`stream_failure`      ``StreamFailure()``
:meth:`recover`             ``Recover()``
:meth:`snapshot`            ``Snapshot(form)`` (``repaired`` first runs the append call)
:meth:`restore`             ``Restore(record)`` into a fresh runner
==========================  ===========================================================

State (the spec's ``RequestState`` names): ``output_ids``, aligned ``logprobs`` and decision
receipts; the pending suffix ``pending_ids`` with its :class:`PendingTag`; the processed
frontier ``processed`` (P); the cache ``generation``; the in-flight call (its slice, generation
and decision row); the consumable score (``score_id = "score-<generation>"``, bound to P, O and
the generation); issued / consumed receipt ids (``"receipt-<n>"``); the policy state (RNG
counter, automaton, Mirostat); finish reason and every trigger; the quarantine flag.

A model call is a transaction (M3.10 0x08): :meth:`launch` validates ids, positions, the
cache's slot start and capacity before any slot is touched and opens the call on the cache;
:meth:`complete` awaits the forward (declared contract for an interrupt that arrives in flight:
**await**, then select ALL_OLD), checks the two closed rosters -- every compute stage
(embedding, each decoder layer, final norm, LM head) ran, and every layer's cache lane wrote
exactly ``[P, P + Delta)`` under the call's generation -- and selects ALL_NEW (publish the
staged rows, advance P and the generation, expose the score when the call's last row is the
decision row) or ALL_OLD (expose nothing; a cached handle is quarantined until
:meth:`recover` crops it back to P under a new generation; retried up to ``max_retries``, then
``device_error``).  Logprobs are the natural log-softmax of the raw float32 logits of the
selecting row at the selected id, recorded at decision time, before any later call.

Stop/stream integration (M3.10 0x06 "One selection is an output-state transaction"):
:meth:`commit` hands each committed token to a :class:`CommitObserver` (``observe(token_id,
logprob, output_index) -> CommitObservation``), which feeds the detokenizer, the stop matcher and
the structured parser, publishes the chunks behind the stream commit horizon, and reports the
text triggers (``stop_string`` / ``structured`` / ``structured_error``), whether this commit's
delivery failed, and the chunks it published; EOS, ``length`` and ``context_length`` stay in
the controller, which resolves every trigger under ``FINISH_PRECEDENCE``.  A delivery failure
is one of the commit's triggers (``stream_error``, spec ``Commit.stream_failed``), also when the
commit fires another trigger.  With a tokenizer that exposes ``token_bytes`` and no observer of
its own, the runner builds :class:`~decodespec.impl.output.OutputObserver` (stop strings,
``include_stop_str``, the alignment contract, JSON completion, ``on_chunk`` streaming); it is
closed when the request finishes outside a commit (its held-back bytes flushed), its state rides
in snapshots, and :meth:`result` returns its aligned output.  The trace gets one ``stream`` event
per published chunk, right after the ``commit`` that published it (or before the ``finish`` of
an external close).

Declared choices (docs/design.md): finish precedence; EOS included in ``output_ids``; G = 0
follows the request's ``zero_new_tokens`` branch; the context cap is the least of the
envelope's ``max_context`` / ``max_total_tokens`` / static capacity and the model window;
``min_new_tokens`` is enforced by the policy's ``min_new_tokens`` legality transform (added to
the policy when the envelope's policy lacks it); the last committed token stays
CLOSED_UNPROCESSED at finish unless the request promises ``final_cache = all_outputs`` (then the
repair call processes it and its logits are discarded).

Source: M3.10 "Authoritative phase and commit spine", "The first-output off-by-one", 0x02
bounded cached profile and branch table, 0x03, 0x06 "Finish reason and RNG precedence", 0x08
"One model call prepares a complete logical state candidate" and "Output, input, and cache
frontiers", 0x09, 0x0A "Logical recovery sockets" and "Asynchronous completion and error
boundaries"; HF ``GenerationMixin._sample`` (last row in float32), gpt-fast (explicit
``input_pos``), Meta Llama ``generate`` (``prev_pos:cur_pos``).

Size: the controller: one method per spec action (the table above) over one request's state; its
records are in impl/values.py, the observer protocol in impl/observers.py, snapshots in
impl/snapshot.py.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from decodespec.spec.actions import TEXT_TRIGGERS
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason, PendingTag, Selection, canonical_finish_reason, published_finish_reason
from decodespec.spec.envelope import MAX_TIMEOUT_MS, ZERO_NEW_TOKENS_REJECTED
from decodespec.spec.errors import NOT_ENABLED, DecodeSpecError, Rejection, ResourceLimit, quote, register_code
from decodespec.spec.policy.codes import FAMILY_MISMATCH, TERMINAL_DECISION_CODES
from decodespec.spec.policy.config import Family
from decodespec.spec.policy.receipt import DecisionReceipt
from decodespec.spec.policy.state import RequestView, initial_policy_state
from decodespec.spec.positions import CACHE_CAPACITY_EXCEEDED
from decodespec.spec.prompt_logprobs import PromptLogprob
from decodespec.spec.request import INVALID_REQUEST as SPEC_INVALID_REQUEST
from decodespec.spec.request import context_cap, default_static_capacity, policy_with_min_new_tokens, prompt_room
from decodespec.spec.state import ControllerAction, InterruptPoint, Phase, call_interrupt_point, controller_action, next_call, repair_owed

from .cache import DynamicCache, StaticCache, check_static_reservation, make_cache
from .events import EVENTS_FORMAT, EventSink
from .faults import FaultPlan, InjectedDeviceFault, ParticipantFailure
from .latency import LatencyRecorder
from .model import CONTEXT_WINDOW_EXCEEDED, TRAINING_MODE, LlamaForCausalLM, StageObserver
from .observers import CommitObservation, CommitObserver, NullObserver
from .output import OutputObserver, output_header, stop_config
from .policy import decide as policy_decide
from .prompt_logprobs import first_entries, score_rows
from .rng import RequestRng
from .snapshot import restore_runner, take_runtime_snapshot
from .values import CallRecord, Decision, GenerationResult, RunnerState, RuntimeRequest, Score

__all__ = [
    "ARTIFACT_MISMATCH",
    "INVALID_REQUEST",
    "CallRecord",
    "CommitObservation",
    "CommitObserver",
    "Decision",
    "RequestRunner",
    "RuntimeRequest",
    "Score",
    "Selection",
]

#: ``runtime.invalid_request`` (registered in the spec: :data:`decodespec.spec.request.INVALID_REQUEST`).
INVALID_REQUEST = SPEC_INVALID_REQUEST

ARTIFACT_MISMATCH = register_code(
    "runtime.artifact_mismatch",
    "rejection",
    "M3.10 Immutable request envelope and canonical identity",
    "The admitted envelope names another checkpoint, tokenizer or vocabulary than the loaded model.",
)

_LANE = "self_kv"


@attrs.frozen
class _Report:
    """The closed-roster report of a completed call (the spec's ``Complete`` action)."""

    stages_ok: bool
    lanes: tuple[tuple[str, int], ...]
    layers_written: int
    generation: int
    output_row: int | None
    logits: torch.Tensor | None
    prompt_rows: tuple[PromptLogprob, ...] = ()


# --------------------------------------------------------------------------------------------
# The controller.
# --------------------------------------------------------------------------------------------


class RequestRunner:
    """The step-wise controller of one request (see the module docstring).

    Args:
        model: The decoder; its device, dtype and attention implementation are used as they are.
        request: The :class:`RuntimeRequest`.
        cache: A cache to use (e.g. a :class:`StaticCache` reused from an earlier request: it
            is reset first); default a fresh cache of ``request.cache``.
        sink: Event sink (``decodespec.events.v1``), or ``None`` for no trace.
        faults: A declared :class:`FaultPlan`.
        observer: A :class:`CommitObserver`; default (``None``) an
            :class:`~decodespec.impl.output.OutputObserver` when ``tokenizer`` has ``token_bytes``.
        tokenizer: ``token_bytes(id)`` / ``vocab_size`` / ``special_ids`` (the output observer) or
            only ``decode(ids) -> str`` (then :meth:`result`'s text is a plain decode).
        runtime_info: Extra ``runtime`` fields for the trace header (device, dtype, attention, decode_kernel).
        on_chunk: Consumer of published stream chunks (needs ``request.stream`` and the output
            observer); if it raises, the output closes with ``stream_error``.
        clock: Monotonic clock in seconds (default :func:`time.monotonic`) that measures the
            request's wall-clock budget ``request.timeout_ms``; read once at :meth:`admit` and
            once per :meth:`step` at a call boundary (inject a fake one for deterministic tests).

    Wall-clock budget (M3.10 0x06 "wall/device budget plus cancellation checkpoints", 0x02
    "cancellation/timeout before launch"): with ``request.timeout_ms`` set, :meth:`step` checks
    the clock whenever the request is READY (before launching the next call or recovering);
    once ``(clock() - admitted_at) * 1000 >= timeout_ms`` it takes ``Cancel(timeout)`` there
    (trace: ``cancel`` with ``source = "budget"`` and the elapsed milliseconds) instead of the
    next call.  A call already running is never interrupted by the budget (declared contract:
    the budget is observed at call boundaries only), so every committed token, its logprob and
    receipt are kept, and a pending token is closed CLOSED_UNPROCESSED.

    Raises:
        Rejection: ``model.training_mode`` when ``model`` or one of its modules is in
            training mode (M3.10 0x0A: ``model.eval()`` is a separate control);
            ``runtime.invalid_request`` (empty prompt, id outside ``[0, V)``, negative G,
            unknown cache family); ``policy.family_mismatch`` for a beam policy;
            ``envelope.zero_new_tokens_rejected`` for G = 0 under ``reject``;
            ``runtime.invalid_fault_plan``; ``cache.abi_mismatch`` for a cache of another ABI;
            ``stop.*`` for bad stop strings or alignment; ``runtime.invalid_request`` for an
            ``on_chunk`` without a streamed request or without the output observer.
        ResourceLimit: ``model.context_window_exceeded`` when ``L >= max_position_embeddings``;
            ``cache.capacity_exceeded`` when a static capacity cannot hold the prompt.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        request: RuntimeRequest,
        *,
        cache: DynamicCache | StaticCache | None = None,
        sink: EventSink | None = None,
        faults: FaultPlan | None = None,
        observer: CommitObserver | None = None,
        tokenizer: Any = None,
        runtime_info: dict[str, Any] | None = None,
        on_chunk: Callable[[Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model = model
        self.request = request = _validated(model, request)
        self.policy = policy_with_min_new_tokens(request.policy, request.min_new_tokens)
        self.sink = sink
        self.faults = faults or FaultPlan()
        self.faults.check(num_layers=model.config.num_hidden_layers, cached=request.cached, stream=request.stream)
        self.tokenizer = tokenizer
        self.runtime_info = dict(runtime_info or {})
        self.capacity = request.static_capacity if request.cache == "static" else None
        #: C: L + O reaching it fires ``context_length``.
        self.context_cap = context_cap(model.config.max_position_embeddings, request.context_cap, self.capacity)
        if self.capacity is not None and self.capacity < prompt_room(request.prompt_len, request.max_new_tokens):
            raise ResourceLimit(CACHE_CAPACITY_EXCEEDED, f"static capacity {self.capacity} cannot hold the {request.prompt_len}-token prompt",
                                "$.runtime.static_capacity")
        if self.capacity is not None:
            _check_static_capacity(model, self.capacity)
        #: The request's stop / structured / output parameters (validated before any state exists).
        self.stop_config = stop_config(request, self.context_cap)
        if on_chunk is not None and not request.stream:
            raise Rejection(INVALID_REQUEST, "a chunk consumer needs a streamed request (output.stream)", "$.output.stream")
        if observer is None and tokenizer is not None and hasattr(tokenizer, "token_bytes"):
            observer = OutputObserver(tokenizer, self.stop_config, on_chunk=on_chunk)
        elif on_chunk is not None:
            raise Rejection(INVALID_REQUEST, "a chunk consumer needs the runner's output observer (a tokenizer with token_bytes)", "$.on_chunk")
        #: The commit observer (every protocol method is called; :class:`NullObserver` when there is none).
        self.observer: CommitObserver = observer if observer is not None else NullObserver()
        self._stream_chunks: list[Any] = []  # published chunks whose trace events are not yet written
        if cache is None and hasattr(model, "make_request_cache"):  # a model whose ranks keep the K/V shards (impl/tp.py)
            cache = model.make_request_cache(request.cache, capacity=self.capacity)
        elif cache is None:
            cache = make_cache(request.cache, model.cache_abi, capacity=self.capacity)
        elif request.cache == "none" or cache.family != request.cache or cache.abi != model.cache_abi:
            raise Rejection(INVALID_REQUEST, f"the given {cache.family} cache does not fit the request's {request.cache} cache / model ABI",
                            "$.runtime.cache_family")
        elif cache.family == "static" and cache.capacity != self.capacity:
            raise Rejection(INVALID_REQUEST, f"the given static cache holds {cache.capacity} slots, the request declares {self.capacity}",
                            "$.runtime.static_capacity")
        else:
            cache.reset()  # a reused buffer forgets every row of the previous request
        self.cache = cache
        self.rng = RequestRng(request.identity, request.seed)
        # -- the explicit state (spec RequestState names) --
        self.phase = Phase.NEW
        self.processed = 0
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.receipts: list[DecisionReceipt] = []
        self.consumed: list[Decision] = []
        self.pending_ids: tuple[int, ...] = ()
        self.pending_tag = PendingTag.EMPTY
        self.generation = 0
        #: The :class:`~decodespec.impl.faults.ParticipantFailure` (rank, typed reason) of the latest call, if one failed so.
        self.participant_failure: ParticipantFailure | None = None
        self.in_flight: CallRecord | None = None
        self._interrupts: set[FinishReason] = set()
        self._budget_elapsed: int | None = None  # set while the budget's own Cancel(timeout) runs
        self._fault: str | None = None
        self.score: Score | None = None
        self.decision: Decision | None = None
        self.issued: list[str] = []
        self.scores: list[tuple[str, int, int, int]] = []  # (score_id, generation, processed, output_count)
        #: Prompt-logprob entries of the prefill rows published so far (ALL_NEW calls only), in position order.
        self.prompt_rows: list[PromptLogprob] = []
        self.policy_state = attrs.evolve(initial_policy_state(self.policy), rng_counter=request.rng_counter_start)
        self.finish_reason: FinishReason | None = None
        self.triggers: set[FinishReason] = set()
        self.quarantined = False
        self.num_calls = 0
        #: Call and emission times (M3.10 0x0BA "Latency semantics"; :mod:`decodespec.impl.latency`).
        self.latency = LatencyRecorder(request.prompt_len)
        self._emitted_at: int | None = None
        self.num_retries = 0
        self.suspended = False
        self.clock = clock
        #: Clock reading at admission (the budget's origin), ``None`` before :meth:`admit` or without a budget.
        self.admitted_at: float | None = None

    # ---------------------------------------------------------------------------------------
    # The state as one record.
    # ---------------------------------------------------------------------------------------
    #: The :class:`RunnerState` fields, each an attribute of the runner (lists for the growing ledgers, a set for the triggers).
    STATE_FIELDS = tuple(f.name for f in attrs.fields(RunnerState))

    def state(self) -> RunnerState:
        """The request state as one frozen :class:`~decodespec.impl.values.RunnerState` (the spec's field names)."""
        values = {name: getattr(self, name) for name in self.STATE_FIELDS}
        for name in ("output_ids", "logprobs", "receipts", "consumed", "issued", "scores"):
            values[name] = tuple(values[name])
        values["triggers"] = frozenset(values["triggers"])
        return RunnerState(**values)

    def adopt_state(self, state: RunnerState) -> None:
        """Make ``state`` the runner's request state (a restored runner; the caller validated it)."""
        for name in self.STATE_FIELDS:
            value = getattr(state, name)
            if name in ("output_ids", "logprobs", "receipts", "consumed", "issued", "scores"):
                value = list(value)
            elif name == "triggers":
                value = set(value)
            setattr(self, name, value)

    # ---------------------------------------------------------------------------------------
    # Views.
    # ---------------------------------------------------------------------------------------
    @property
    def output_count(self) -> int:
        """O."""
        return len(self.output_ids)

    @property
    def finished(self) -> bool:
        """Whether the output is closed (a repair call may still be owed)."""
        return self.phase is Phase.FINISHED

    def frontier(self) -> dict[str, Any]:
        """``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}`` (L, O, |U|, P, tag)."""
        return {"prompt_len": self.request.prompt_len, "output_count": self.output_count, "pending": len(self.pending_ids),
                "processed": self.processed, "pending_tag": self.pending_tag.value}

    def repair_owed(self) -> bool:
        """Whether the declared append/repair call still has to process the closed final token."""
        return repair_owed(phase=self.phase, repair_required=self.request.final_cache == "all_outputs" and self.request.cached,
                           pending_tag=self.pending_tag, finish_reason=self.finish_reason, triggers=self.triggers)

    def terminal(self) -> bool:
        """Whether no further controller action is required (FINISHED, no call in flight, no repair owed)."""
        return self.phase is Phase.FINISHED and self.in_flight is None and not self.repair_owed()

    def interrupt_point(self) -> InterruptPoint | None:
        """Where an interrupt arriving now lands, or ``None`` (NEW, or FINISHED with no repair call in flight).

        The repair call in flight after the close is ``IN_FLIGHT`` too (a cancel or timeout lands on it).
        """
        return call_interrupt_point(self.phase, self.in_flight is not None)

    def ordered_triggers(self) -> tuple[FinishReason, ...]:
        """Every trigger recorded, in precedence order."""
        return tuple(r for r in FINISH_PRECEDENCE if r in self.triggers)

    # ---------------------------------------------------------------------------------------
    # Admission.
    # ---------------------------------------------------------------------------------------
    def admit(self) -> None:
        """``Admit``: write the trace header; READY, or FINISHED ``length`` for the G = 0 ``no_call`` branch.

        Raises:
            Rejection: ``transition.not_enabled`` unless the phase is NEW.
        """
        self._require(self.phase is Phase.NEW, "transition.admit", "phase == NEW")
        self.latency.admit()
        if self.request.timeout_ms is not None:
            self.admitted_at = self.clock()
        self._emit_request()
        if self.request.max_new_tokens == 0 and self.request.zero_new_tokens == "no_call":
            self._finish({FinishReason.LENGTH})
        else:
            self.phase = Phase.READY

    def _emit_request(self) -> None:
        if self.sink is None:
            return
        r = self.request
        self.sink.emit(
            "request",
            format=EVENTS_FORMAT,
            identity=r.identity,
            prompt_ids=list(r.prompt_ids),
            max_new_tokens=r.max_new_tokens,
            min_new_tokens=r.min_new_tokens,
            eos_ids=sorted(r.eos_ids),
            zero_new_tokens=r.zero_new_tokens,
            cache=r.cache,
            capacity=self.capacity,
            prefill_chunk=r.prefill_chunk,
            profile="decoder_only",
            lanes=[_LANE] if r.cached else [],
            runtime={"name": "decodespec.impl", **self.runtime_info},
            **({} if r.timeout_ms is None else {"timeout_ms": r.timeout_ms}),
            policy=self.policy.to_json(),
            seed=r.seed,
            params=self.spec_params(),
            output=output_header(self.stop_config, r.stream),
        )

    def spec_params(self) -> dict[str, Any]:
        """This request's constants under the spec's ``RequestParams`` field names (the trace header's ``params``)."""
        r = self.request
        return {
            "identity": r.identity, "prompt_len": r.prompt_len, "max_new_tokens": r.max_new_tokens,
            "min_new_tokens": r.min_new_tokens, "vocab_size": self.model.config.vocab_size, "eos_ids": sorted(r.eos_ids),
            "profile": "decoder_only", "cache_family": r.cache, "context_cap": self.context_cap,
            "static_capacity": self.capacity, "zero_new_tokens": r.zero_new_tokens, "final_cache": r.final_cache,
            "prefill_chunk": r.prefill_chunk if r.cached else None, "max_retries": r.max_retries,
            "max_draws": r.max_draws(), "rng_counter_start": r.rng_counter_start, "stream": r.stream,
            "stop_strings": bool(r.stop_strings), "structured": r.structured != "none",
        }

    # ---------------------------------------------------------------------------------------
    # Model calls.
    # ---------------------------------------------------------------------------------------
    def next_call(self) -> tuple[CallKind, int, int] | None:
        """``(kind, start, length)`` of the call the state calls for, or ``None`` when none is due."""
        r = self.request
        return next_call(phase=self.phase, processed=self.processed, prompt_len=r.prompt_len, output_count=self.output_count,
                         cached=r.cached, prefill_chunk=r.prefill_chunk, pending_tag=self.pending_tag,
                         call_in_flight=self.in_flight is not None, quarantined=self.quarantined, repair_owed=self.repair_owed())

    def launch(self, kind: CallKind | str | None = None, *, start: int | None = None, length: int | None = None) -> CallRecord:
        """``Launch``: validate and record the next model call; nothing runs yet (see :meth:`complete`).

        Args:
            kind: ``prefill`` / ``decode`` / ``repair``; default the call the state calls for.
            start: ``cache_position`` of row 0; default the expected start (P, 0 uncached).
            length: Rows; default the expected length (a chunk, 1, or L + O uncached).

        Returns:
            The :class:`CallRecord`.

        Raises:
            Rejection: ``transition.not_enabled`` (wrong phase, call in flight, quarantined
                handle, a kind the state does not call for, a start other than the expected one,
                a length that does not fit); ``cache.slot_mismatch`` when the cache's committed
                length disagrees.  Nothing changes.
            ResourceLimit: ``cache.capacity_exceeded`` when ``start + length`` exceeds the static
                capacity; ``model.context_window_exceeded`` past the model window.  Nothing changes.
        """
        r = self.request
        kind = None if kind is None else CallKind(kind)
        due = self.next_call()
        rule = f"transition.launch_{(kind or (due[0] if due else CallKind.DECODE)).value}"
        self._require(self.in_flight is None, rule, "no call in flight")
        self._require(not self.quarantined, rule, "handle not quarantined")
        self._require(due is not None, rule, f"a call is due in phase {self.phase.value}")
        assert due is not None
        due_kind, due_start, due_length = due
        kind = kind or due_kind
        self._require(kind is due_kind, rule, f"the state calls for a {due_kind.value} call")
        start = due_start if start is None else start
        length = due_length if length is None else length
        self._require(start == due_start, rule, "start == expected start (P cached, 0 uncached)")
        if kind is CallKind.PREFILL and r.cached and r.prefill_chunk is not None:
            self._require(1 <= length <= min(r.prompt_len - self.processed, r.prefill_chunk), rule,
                          "prefill length fits the remaining prompt and the chunk size")
        else:
            self._require(length == due_length, rule, "length == the expected slice length")
        if self.capacity is not None and start + length > self.capacity:
            raise ResourceLimit(CACHE_CAPACITY_EXCEEDED, f"write [{start}, {start + length}) exceeds the {self.capacity} reserved slots",
                                "$.cache_position", details={"rule": rule, "guard": "start + length <= static capacity"})
        window = self.model.config.max_position_embeddings
        if start + length > window:
            raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"positions {start}..{start + length - 1} exceed the window {window}", "$.position_ids")
        sequence = self.request.prompt_ids + tuple(self.output_ids)
        input_ids = sequence[start:start + length]
        vocab = self.model.config.vocab_size
        assert len(input_ids) == length and all(0 <= t < vocab for t in input_ids), "ids were validated at admission and commit"
        if self.cache is not None:
            self.cache.begin_call(start, length, self.generation, drop_layers=self.faults.missing_lane_layers(self.num_calls))
        end = start + length
        if kind is CallKind.PREFILL:
            decision_row = end - 1 if end == r.prompt_len and r.max_new_tokens > 0 else None
        elif kind is CallKind.DECODE:
            decision_row = end - 1
        else:
            decision_row = None
        call = CallRecord(self.num_calls, kind, start, length, self.generation, decision_row, tuple(input_ids))
        frontier_before = self.frontier()
        self.in_flight = call
        self._interrupts = set()
        self._fault = None
        self.participant_failure = None
        self.num_calls += 1
        if kind is not CallKind.REPAIR:
            self.phase = Phase.IN_FLIGHT
        t_ns = self.latency.launch(kind.value, length)
        if self.sink is not None:
            self.sink.emit("call_launched", call_id=call.call_id, kind=kind.value, input_ids=list(input_ids),
                           position_ids=list(range(start, end)), cache_position=list(range(start, end)),
                           frontier_before=frontier_before, generation=call.generation, **_timed(t_ns))
        return call

    def complete(self) -> Selection:
        """``Complete``: run the launched call to its completion boundary and select ALL_NEW or ALL_OLD.

        ALL_NEW needs no interrupt or fault, every compute stage through the LM head, and every
        layer's lane at ``[start, end)`` under the call's generation.  A forward that raises
        (:class:`~decodespec.impl.faults.InjectedDeviceFault`, or any error on an accelerator)
        is reported as ``fault{kind: device_fault}`` first.

        Returns:
            The selection.

        Raises:
            Rejection: ``transition.not_enabled`` when no call is in flight.
        """
        call = self.in_flight
        self._require(call is not None, "transition.complete_all_new", "a call is in flight")
        assert call is not None
        triggers_before = set(self.triggers)
        report = self._forward(call)
        t_ns = self.latency.complete()  # after the completion boundary (_forward synchronises CUDA)
        reason = self._completion_reason(call, report)
        selection = Selection.ALL_NEW if reason is None else Selection.ALL_OLD
        score = None
        if selection is Selection.ALL_NEW:
            score = self._select_all_new(call, report)
        else:
            self._select_all_old(call, report)
        if self.sink is not None:
            self.sink.emit("call_completed", call_id=call.call_id, selection=selection.value,
                           lanes_completed=[list(lane) for lane in report.lanes], layers_written=report.layers_written,
                           stages_ok=report.stages_ok, output_row=report.output_row, frontier_after=self.frontier(),
                           score_id=None if score is None else score.score_id, generation=report.generation, reason=reason,
                           **_timed(t_ns))
            if self.quarantined and selection is Selection.ALL_OLD:
                self.sink.emit("quarantine", generation=self.generation, processed=self.processed)
        if self.phase is Phase.FINISHED and (self.triggers != triggers_before or call.kind is CallKind.REPAIR and selection is Selection.ALL_NEW):
            self._emit_finish()
        return selection

    def _forward(self, call: CallRecord) -> _Report:
        model, cache = self.model, self.cache
        device = model.device
        ids = torch.tensor([call.input_ids], dtype=torch.long, device=device)  # [1, T]
        cache_position = torch.arange(call.start, call.end, device=device)  # [T]
        mask = cache.key_validity(call.length, device) if cache is not None and cache.family == "static" else None  # [1, S] or None
        stages: list[str] = []
        logits = None
        prompt_rows: list[PromptLogprob] = []
        spec = self.request.prompt_logprobs
        score_prompt = spec is not None and call.kind is CallKind.PREFILL
        fault_layer = self.faults.device_fault_layer(call.call_id)
        try:
            with torch.inference_mode(), _stage_roster(model, stages, fault_layer):
                out = model(ids, attention_mask=mask, past_key_values=cache, cache_position=cache_position, logits_to_keep=1,
                            return_hidden_states=score_prompt)
                logits = out.logits[0, -1]  # [V] raw scores of the call's last row
                if score_prompt:  # M3.10 0x02: row p scores x_{p+1}; staged until ALL_NEW publishes them
                    assert spec is not None and out.hidden_states is not None
                    prompt_rows = score_rows(model.lm_head, out.hidden_states[0], call.start, self.request.prompt_ids, spec.top_k)
                if logits.is_cuda:
                    torch.cuda.current_stream(logits.device).synchronize()  # the declared completion boundary
        except (InjectedDeviceFault, ParticipantFailure) as exc:
            self.participant_failure = exc if isinstance(exc, ParticipantFailure) else None
            self._report_fault("device_fault", call)
        except RuntimeError:
            if device.type == "cpu":
                raise  # on the CPU a RuntimeError is a bug, not a device fault
            self._report_fault("device_fault", call)
        expected = ["embed_tokens", *(f"layers.{i}" for i in range(model.config.num_hidden_layers)), "norm", "lm_head"]
        stages_ok = logits is not None and stages == expected
        if cache is not None:
            complete = cache.complete_layers()
            lanes = ((_LANE, call.end),) if complete == model.config.num_hidden_layers else ()
        else:
            complete, lanes = 0, ()
        output_row = call.decision_row if stages_ok else None
        return _Report(stages_ok, lanes, complete, call.generation, output_row, logits if stages_ok else None,
                       tuple(prompt_rows) if stages_ok else ())

    def _report_fault(self, kind: str, call: CallRecord) -> None:
        self._fault = kind
        if self.sink is not None:
            self.sink.emit("fault", kind=kind, call_id=call.call_id)

    def _completion_reason(self, call: CallRecord, report: _Report) -> str | None:
        if self._interrupts:
            reason = canonical_finish_reason(self._interrupts)
            assert reason is not None
            return reason.value
        if self._fault is not None:
            return self._fault
        if not report.stages_ok or report.output_row != call.decision_row:
            return "device_fault"
        expected = ((_LANE, call.end),) if self.request.cached else ()
        if report.generation != call.generation or report.lanes != expected:
            return "missing_lane"
        return None

    def _select_all_new(self, call: CallRecord, report: _Report) -> Score | None:
        r = self.request
        generation = self.generation + 1
        if self.cache is not None:
            self.cache.commit_call(generation)
        self.in_flight = None
        self.processed = call.end
        self.generation = generation
        self.prompt_rows.extend(report.prompt_rows)
        if call.kind is CallKind.PREFILL and call.end < r.prompt_len:
            self.phase = Phase.READY
            return None
        if call.kind is CallKind.PREFILL and r.max_new_tokens == 0:
            self._finish({FinishReason.LENGTH}, emit=False)
            return None
        self.pending_ids, self.pending_tag = (), PendingTag.EMPTY
        if call.kind is CallKind.REPAIR:
            self.phase = Phase.FINISHED
            return None
        assert report.logits is not None
        score = Score(f"score-{generation}", generation, call.end, self.output_count, report.logits)
        self.score = score
        self.scores.append((score.score_id, generation, call.end, self.output_count))
        self.phase = Phase.SCORED
        return score

    def _select_all_old(self, call: CallRecord, report: _Report) -> None:
        failed = self._fault is not None or not report.stages_ok or report.lanes != (((_LANE, call.end),) if self.request.cached else ())
        if self.cache is not None:
            self.cache.abandon_call()
        self.in_flight = None
        self.quarantined = self.request.cached
        if self._interrupts:
            self._finish(set(self._interrupts) | ({FinishReason.DEVICE_ERROR} if failed else set()), emit=False)
        elif self.num_retries < self.request.max_retries:
            self.num_retries += 1
            self.phase = Phase.FINISHED if call.kind is CallKind.REPAIR else Phase.READY
        else:
            self._finish({FinishReason.DEVICE_ERROR}, emit=False)

    def recover(self) -> None:
        """``Recover``: crop the quarantined handle back to the proven frontier P under a new generation.

        Raises:
            Rejection: ``transition.not_enabled`` unless quarantined, no call in flight, and READY
                or a repair still owed.
        """
        self._require(self.quarantined, "transition.recover", "quarantined")
        self._require(self.in_flight is None, "transition.recover", "no call in flight")
        self._require(self.phase is Phase.READY or self.repair_owed(), "transition.recover", "phase READY or repair owed")
        self.generation += 1
        if self.cache is not None:
            self.cache.recover(self.generation)
            assert self.cache.committed_length == self.processed
        self.quarantined = False
        if self.sink is not None:
            self.sink.emit("recover", generation=self.generation, processed=self.processed)

    def repair(self) -> Selection:
        """The append/repair call for a CLOSED_UNPROCESSED final token (its logits are discarded): launch + complete."""
        self.launch(CallKind.REPAIR)
        return self.complete()

    # ---------------------------------------------------------------------------------------
    # Decision and commit.
    # ---------------------------------------------------------------------------------------
    def decide(self) -> Decision | None:
        """``Decide``: apply the M3.8 policy to the current score row and issue a receipt.

        When the policy finds the legal support empty (``policy.empty_support``: the constraint
        admits no token and no fallback is declared) the request finishes instead
        (``SupportEmpty``, M3.10 0x02 branch table "constraint/parser error"): finish reason
        ``constraint_error``, no receipt, no draw, every committed token and logprob kept, the
        output observer closed (its held-back bytes flushed), and the trace gets an
        ``empty_support`` event and the ``finish``.

        Returns:
            The decision, or ``None`` when the support was empty (the request is then finished).

        Raises:
            Rejection: ``transition.not_enabled`` unless SCORED with a score of the current
                generation; any other ``policy.*`` code when the policy refuses the row.  Nothing
                changes.
        """
        score = self.score
        self._require(self.phase is Phase.SCORED and score is not None, "transition.decide", "phase == SCORED")
        assert score is not None
        self._require(score.generation == self.generation, "transition.decide", "score is bound to the current generation")
        r = self.request
        view = RequestView(prompt_ids=r.prompt_ids, output_ids=self.output_ids, eos_ids=sorted(r.eos_ids),
                           min_new_tokens=r.min_new_tokens, identity=r.identity, seed=r.seed)
        try:
            with torch.inference_mode():
                receipt, after = policy_decide(score.logits, self.policy, self.policy_state, view, score_id=score.score_id,
                                               vocab_hash=r.vocab_hash, rng=self.rng)
        except DecodeSpecError as exc:
            reason = TERMINAL_DECISION_CODES.get(exc.code)
            if reason is None:
                raise
            self.score = None
            if self.sink is not None:
                self.sink.emit("empty_support", score_id=score.score_id, code=exc.code, message=exc.message,
                               rng_counter=self.policy_state.rng_counter)
            self._finish({reason})
            return None
        decision = Decision(f"receipt-{len(self.issued)}", score.score_id, receipt.selected_id, receipt.raw_logprob,
                            receipt.draws, self.policy_state.rng_counter, receipt, after)
        self.issued.append(decision.receipt_id)
        self.decision = decision
        self.phase = Phase.DECIDED
        if self.sink is not None:
            self.sink.emit("decision", receipt_id=decision.receipt_id, score_id=score.score_id, token_id=decision.token_id,
                           logprob=decision.logprob, draws=decision.draws, rng_counter_before=decision.rng_counter_before,
                           rng_counter_after=after.rng_counter, receipt=receipt.to_json())
        return decision

    def commit(self, receipt: Decision | str | None = None) -> tuple[FinishReason, ...]:
        """``Commit``: consume the pending receipt exactly once into the output.

        M3.10's output-state transaction: appends the token and its logprob, adopts the policy
        state (RNG counter + the receipt's draws only), lets the observer decode the token, match
        stop strings, run the structured parser and publish the chunks behind the stream horizon,
        then resolves every trigger -- the observer's text triggers, EOS, ``length``,
        ``context_length``, and ``stream_error`` when this commit's delivery failed -- under
        ``FINISH_PRECEDENCE``.  A trigger finishes the request (U = [token] CLOSED_UNPROCESSED);
        otherwise READY with U = [token] PENDING_NEXT_CALL.  The fault plan's
        :class:`~decodespec.impl.faults.StreamFailureAt` fails the delivery of the first chunk
        this commit publishes (the output observer); when the commit publishes none, it is a
        failure right after the commit: an interrupt before the next launch, or, when this commit
        closed the output, one of its triggers (never dropped).

        Args:
            receipt: The :class:`Decision` or its ``receipt_id``; default the pending one.

        Returns:
            The triggers this commit fired, in precedence order (empty when the request goes on).

        Raises:
            Rejection: ``transition.not_enabled`` for a duplicate (already consumed) or stale
                (discarded or superseded) receipt, or outside DECIDED.  Nothing changes.
        """
        receipt_id = receipt.receipt_id if isinstance(receipt, Decision) else receipt
        pending = self.decision
        self._require(self.phase is Phase.DECIDED and pending is not None, "transition.commit", "phase == DECIDED")
        assert pending is not None and self.score is not None
        receipt_id = pending.receipt_id if receipt_id is None else receipt_id
        self._require(all(d.receipt_id != receipt_id for d in self.consumed), "transition.commit", "receipt was never consumed")
        self._require(receipt_id == pending.receipt_id, "transition.commit", "receipt is the pending one (not stale)")
        self._require(pending.score_id == self.score.score_id and self.score.generation == self.generation, "transition.commit",
                      "receipt is bound to the current score")
        self._require(pending.rng_counter_before == self.policy_state.rng_counter, "transition.commit", "receipt read the current RNG counter")
        token = pending.token_id
        index = self.output_count
        injected = self.faults.stream_fails_after(index)
        if injected:
            self.observer.inject_delivery_failure()  # the first chunk this commit publishes fails
        observation: CommitObservation = self.observer.observe(token, pending.logprob, index)
        if not observation.text_triggers <= TEXT_TRIGGERS:
            raise Rejection(NOT_ENABLED, f"the observer reported {sorted(t.value for t in observation.text_triggers)}; only "
                            "stop_string / structured / structured_error are text triggers", "$.observer")
        self._require(self.request.stream or not observation.stream_failed, "transition.commit",
                      "a stream failure at commit needs a stream")
        self.output_ids.append(token)
        self.logprobs.append(pending.logprob)
        self.receipts.append(pending.receipt)
        self.consumed.append(pending)
        self.policy_state = pending.policy_state
        self.decision = None
        self.score = None
        self.pending_ids = (token,)
        r = self.request
        fired = set(observation.text_triggers)
        if token in r.eos_ids:
            fired.add(FinishReason.EOS)
        if self.output_count >= r.max_new_tokens:
            fired.add(FinishReason.LENGTH)
        if r.prompt_len + self.output_count >= self.context_cap:
            fired.add(FinishReason.CONTEXT_LENGTH)
        stream_failed = observation.stream_failed or (injected and bool(fired))
        if stream_failed:
            fired.add(FinishReason.STREAM_ERROR)
        self._stream_chunks.extend(observation.chunks)
        if r.stream and observation.chunks:
            self._emitted_at = self.latency.emit(observation.chunks[-1].token_end)
        if fired:
            self.phase = Phase.FINISHED
            self.triggers |= fired
            self.finish_reason = published_finish_reason(self.triggers)
            self.pending_tag = PendingTag.CLOSED_UNPROCESSED
        else:
            self.phase = Phase.READY
            self.pending_tag = PendingTag.PENDING_NEXT_CALL
        if self.sink is not None:
            self.sink.emit("commit", receipt_id=pending.receipt_id, token_id=token, logprob=pending.logprob,
                           output_count=self.output_count, pending_tag=self.pending_tag.value,
                           triggers=[t.value for t in FINISH_PRECEDENCE if t in fired], stream_failed=stream_failed)
        self._emit_stream()
        if fired:
            self._emit_finish()
        if injected and self.phase is Phase.READY:
            self.stream_failure()
        return tuple(t for t in FINISH_PRECEDENCE if t in fired)

    # ---------------------------------------------------------------------------------------
    # Interrupts.
    # ---------------------------------------------------------------------------------------
    def cancel(self, kind: FinishReason | str = FinishReason.CANCELLED) -> InterruptPoint:
        """``Cancel``: a cancellation or timeout at the current interrupt point.

        Before launch: finish at once (a pending token becomes CLOSED_UNPROCESSED).  In flight:
        recorded; :meth:`complete` then awaits the call and selects ALL_OLD.  After completion /
        after decision: the score (and receipt) are discarded unconsumed and the request finishes.
        During the repair call after the close: recorded the same way; the awaited call selects
        ALL_OLD, the repair is abandoned (the final-cache promise is not kept) and the reason joins
        the triggers without rewriting the published finish reason.

        Returns:
            Where the interrupt landed.

        Raises:
            Rejection: ``transition.not_enabled`` for a reason other than cancelled / timeout, in
                phase NEW or FINISHED without a repair call in flight, or when the reason is
                already recorded for the call.
        """
        reason = FinishReason(kind)
        self._require(reason in (FinishReason.CANCELLED, FinishReason.TIMEOUT), "transition.interrupt_before_launch",
                      "cancel reason is cancelled or timeout; stream failure needs a stream")
        return self._interrupt(reason)

    def stream_failure(self) -> InterruptPoint:
        """``StreamFailure``: the streamer failed; declared policy: close like an interrupt with ``stream_error``.

        Raises:
            Rejection: ``transition.not_enabled`` when the request does not stream, or as :meth:`cancel`.
        """
        self._require(self.request.stream, "transition.interrupt_before_launch", "cancel reason is cancelled or timeout; stream failure needs a stream")
        self._require(self.phase is not Phase.FINISHED, "transition.interrupt_before_launch", "phase == READY (before launch)")
        if self.sink is not None and self.interrupt_point() is not None:
            self.sink.emit("fault", kind="stream_error", call_id=None if self.in_flight is None else self.in_flight.call_id)
        return self._interrupt(FinishReason.STREAM_ERROR, emit_cancel=False)

    def _interrupt(self, reason: FinishReason, *, emit_cancel: bool = True) -> InterruptPoint:
        at = self.interrupt_point()
        self._require(at is not None, "transition.interrupt_before_launch", "phase == READY (before launch)")
        assert at is not None
        if at is InterruptPoint.IN_FLIGHT:
            self._require(reason not in self._interrupts, "transition.interrupt_in_flight", "reason not yet recorded for the call")
        if emit_cancel and self.sink is not None:
            budget = {} if self._budget_elapsed is None else {"source": "budget", "elapsed_ms": self._budget_elapsed}
            self.sink.emit("cancel", kind=reason.value, at=at.value, **budget)
        if at is InterruptPoint.IN_FLIGHT:
            self._interrupts.add(reason)
            return at
        self.score = None
        self.decision = None
        self._finish({reason})
        return at

    def _finish(self, triggers: set[FinishReason], *, emit: bool = True) -> None:
        # After a content close (the repair call) a cancel / timeout / device_error is recorded but the
        # published finish reason stays the closing one (spec.enums.published_finish_reason).
        self.triggers |= triggers
        self.finish_reason = published_finish_reason(self.triggers)
        self.phase = Phase.FINISHED
        self.pending_tag = PendingTag.CLOSED_UNPROCESSED if self.pending_ids else PendingTag.EMPTY
        # The output closes outside a commit: the observer flushes its held-back bytes.
        flushed = self.observer.close(self.finish_reason)
        self._stream_chunks.extend(flushed)
        if self.request.stream and flushed:
            self._emitted_at = self.latency.emit(flushed[-1].token_end)
        if emit:
            self._emit_finish()

    def _emit_stream(self) -> None:
        """Write a ``stream`` event for every published chunk not yet in the trace (streamed requests only)."""
        if self.sink is not None and self.request.stream:
            for chunk in self._stream_chunks:
                self.sink.emit("stream", **chunk.to_json(), **_timed(self._emitted_at))
        self._stream_chunks.clear()

    def _emit_finish(self) -> None:
        self._emit_stream()
        first = self.latency.final_ns is None
        t_ns = self.latency.finish()
        if first and not self.request.stream and self.output_count:
            self.latency.emit(self.output_count)  # an unstreamed output is delivered whole, at the final flush
        if self.sink is not None:
            report = self.stream_report() if self.request.stream else None
            self.sink.emit("finish", finish_reason=self.finish_reason.value, triggers=[t.value for t in self.ordered_triggers()],
                           frontier=self.frontier(), **({} if report is None else {"stream": report}), t_ns=t_ns)

    def stream_report(self) -> dict[str, Any] | None:
        """What the stream delivered: ``{"chunks", "delivered_bytes", "delivered_tokens", "failed", "error"}``.

        ``failed`` is true when ``stream_error`` is among the triggers or a delivery failed (also
        the flush of an external close, which outranks ``stream_error``).  ``None`` when the
        observer keeps no stream (a custom observer).
        """
        report = self.observer.stream_report()
        if report is None:
            return None
        out = dict(report)
        out["failed"] = bool(out["failed"]) or FinishReason.STREAM_ERROR in self.triggers
        return out

    # ---------------------------------------------------------------------------------------
    # The ordinary loop.
    # ---------------------------------------------------------------------------------------
    def step(self) -> str | None:
        """Take the one controller action the state calls for (applying the fault plan's interrupts first).

        Returns:
            The action's name (``admit``, ``launch``, ``complete``, ``recover``, ``decide``,
            ``commit``, ``cancel``), or ``None`` when the request is terminal.
        """
        if self.phase is Phase.NEW:
            self.admit()
            return "admit"
        if self._plan_interrupt() or self._budget_interrupt():
            return "cancel"
        action = controller_action(phase=self.phase, call_in_flight=self.in_flight is not None, quarantined=self.quarantined,
                                   repair_owed=self.repair_owed(), call_due=self.next_call() is not None)
        if action is None:
            return None
        {ControllerAction.COMPLETE: self.complete, ControllerAction.RECOVER: self.recover, ControllerAction.DECIDE: self.decide,
         ControllerAction.COMMIT: self.commit, ControllerAction.LAUNCH: self.launch}[action]()
        return action.value

    def _plan_interrupt(self) -> bool:
        at = self.interrupt_point()
        if at is None or not self.faults.faults:
            return False
        if at is InterruptPoint.BEFORE_LAUNCH:
            call_id = self.num_calls
        else:
            call_id = self.num_calls - 1
        reason = self.faults.interrupt(call_id, at)
        if reason is None or (at is InterruptPoint.IN_FLIGHT and reason in self._interrupts):
            return False
        self.cancel(reason)
        return True

    def budget_elapsed_ms(self) -> int | None:
        """Whole milliseconds of the wall-clock budget spent so far (one clock reading), or ``None`` without a budget."""
        if self.admitted_at is None:
            return None
        return int((self.clock() - self.admitted_at) * 1000)

    def _budget_interrupt(self) -> bool:
        """At a call boundary (READY), finish ``timeout`` once the budget is spent (see the class docstring)."""
        if self.phase is not Phase.READY or self.in_flight is not None or self.admitted_at is None:
            return False
        elapsed = self.budget_elapsed_ms()
        assert elapsed is not None and self.request.timeout_ms is not None
        if elapsed < self.request.timeout_ms:
            return False
        self._budget_elapsed = elapsed
        try:
            self.cancel(FinishReason.TIMEOUT)
        finally:
            self._budget_elapsed = None
        return True

    def run(self, *, max_outputs: int | None = None) -> RequestRunner:
        """Drive the request until it is terminal (or suspend after ``max_outputs`` committed tokens).

        Args:
            max_outputs: Stop at the first READY boundary with O >= this (the request stays open:
                take a snapshot to resume it later); ``None``: run to the end.

        Returns:
            ``self``.
        """
        while True:
            if max_outputs is not None and self.phase is Phase.READY and self.output_count >= max_outputs and not self.quarantined:
                self.suspended = True
                return self
            if self.step() is None:
                return self

    def result(self):
        """The :class:`~decodespec.impl.generate.GenerationResult` of a finished (or suspended) request.

        With the output observer and a finished request, ids, logprobs and text follow the
        request's alignment contract (``len(logprobs) == len(output_ids)``; ``overhang`` is the
        text-aligned mismatch; the text equals the concatenated stream unless the stream failed);
        ``receipts`` stay one per committed token (the commit ledger).  A suspended request
        returns every committed id and the decode of every committed byte.  Without an observer
        the text is ``tokenizer.decode`` of the ids without a final EOS.
        """
        common = {"prompt_ids": self.request.prompt_ids, "finish_reason": self.finish_reason, "triggers": self.ordered_triggers(),
                      "frontier": self.frontier(), "receipts": tuple(self.receipts), "rng_counter": self.policy_state.rng_counter,
                      "num_committed": self.output_count, "stream": self.stream_report() if self.request.stream else None,
                      "prompt_logprobs": self.prompt_logprobs(), "timeline": self.latency.timeline()}
        out = self.observer.output if self.phase is Phase.FINISHED else None
        if out is not None:
            match = out.stop_match
            return GenerationResult(
                output_ids=out.output_ids, text=out.text, logprobs=tuple(out.logprobs or ()), alignment=out.alignment.value,
                overhang=out.overhang, token_spans=out.token_spans, visible_end=out.visible_end, structured_end=out.structured_end,
                stop_match=None if match is None else (self.request.stop_strings[match.pattern_idx], match.start, match.end),
                chunks=tuple(self.observer.chunks), **common)
        ids = self.output_ids
        text = self.observer.text_so_far()
        if text is None:
            eos = self.request.eos_ids
            text_ids = ids[:-1] if ids and ids[-1] in eos else ids
            text = self.tokenizer.decode(text_ids) if self.tokenizer is not None else ""
        chunks = tuple(self.observer.chunks)
        return GenerationResult(output_ids=tuple(ids), text=text, logprobs=tuple(self.logprobs), chunks=chunks, **common)

    def prompt_logprobs(self) -> tuple[PromptLogprob, ...] | None:
        """The requested prompt logprobs (``invariant.prompt_logprobs_aligned``), or ``None`` when not requested.

        Complete once every prefill call selected ALL_NEW (``L`` entries under ``first_token =
        none``, ``L - 1`` under ``omitted``); before that, the entries of the rows published so
        far.  Each is the natural log-softmax of the raw float32 logits of prefill row ``i - 1``
        at ``x_i``, with its rank and the requested top-k.

        Source: M3.10 0x02 "Prompt logprobs versus generated-token logprobs".
        """
        spec = self.request.prompt_logprobs
        if spec is None:
            return None
        return tuple(first_entries(self.request.prompt_ids, spec)) + tuple(self.prompt_rows)

    # ---------------------------------------------------------------------------------------
    # Snapshots.
    # ---------------------------------------------------------------------------------------
    def snapshot(self, form: str = "pending_suffix"):
        """``Snapshot``: a resumable :class:`~decodespec.impl.snapshot.RuntimeSnapshot` of this request.

        ``repaired`` with a pending token first runs the valid append call (the ordinary decode
        call between calls, the repair call after finish), so that U = [] and P = L + O; never by
        relabelling.

        Raises:
            Rejection: ``snapshot.form_unavailable`` (call in flight, pending decision,
                quarantined handle, a repaired form whose append call is not allowed).
        """
        return take_runtime_snapshot(self, form)

    @classmethod
    def restore(cls, model: LlamaForCausalLM, snapshot, request: RuntimeRequest | None = None, **kwargs: Any) -> RequestRunner:
        """``Restore``: a runner continuing ``snapshot`` (validated before any state is built).

        Args:
            model: The decoder (its cache ABI must equal the snapshot's).
            snapshot: A :class:`~decodespec.impl.snapshot.RuntimeSnapshot` (or see
                :func:`decodespec.impl.snapshot.load_snapshot`).
            request: The request; default the one the snapshot carries.
            **kwargs: As :class:`RequestRunner` (sink, faults, observer, tokenizer, runtime_info).

        Raises:
            Rejection: ``snapshot.*`` (see :mod:`decodespec.impl.snapshot`).
        """
        runner = restore_runner(cls, model, snapshot, request, **kwargs)
        if runner.request.timeout_ms is not None:
            runner.admitted_at = runner.clock()  # declared: a resumed run starts a fresh budget at restore
        observer = runner.observer
        if isinstance(observer, OutputObserver):
            if snapshot.observer_state is None and (runner.output_ids or runner.phase is Phase.FINISHED):
                # A snapshot taken without the output observer: its chunks count as delivered.
                observer.replay(runner.output_ids, runner.logprobs, finish_reason=runner.finish_reason)
            if observer.output_ids != tuple(runner.output_ids):
                from decodespec.spec.snapshot import SNAPSHOT_LEDGER_INVALID

                raise Rejection(SNAPSHOT_LEDGER_INVALID, "the output state's committed ids differ from the snapshot's output ids",
                                "$.observer.output_ids")
        return runner

    # ---------------------------------------------------------------------------------------
    # Helpers.
    # ---------------------------------------------------------------------------------------
    def _require(self, condition: bool, rule: str, guard: str) -> None:
        if not condition:
            raise Rejection(NOT_ENABLED, f"{rule}: guard '{guard}' is false in phase {self.phase.value}", "$.action",
                            details={"rule": rule, "guard": guard})


def _check_static_capacity(model: LlamaForCausalLM, capacity: int, batch_size: int = 1) -> None:
    """Admission of a static reservation: at most the model window, and within the declared memory bound.

    Raises:
        ResourceLimit: ``model.context_window_exceeded`` when ``capacity`` exceeds
            ``max_position_embeddings`` (slots past the window can never be written);
            ``cache.memory_exceeded`` past :data:`decodespec.spec.limits.MAX_STATIC_CACHE_BYTES`.
            Both at ``$.runtime.static_capacity``, before anything is allocated.
    """
    window = model.config.max_position_embeddings
    if capacity > window:
        raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"static capacity {capacity} exceeds the model window {window}: slots past the "
                            "window can never be written", "$.runtime.static_capacity", {"limit": window, "actual": capacity})
    check_static_reservation(model.cache_abi, capacity, batch_size=batch_size, path="$.runtime.static_capacity")


def _validated(model: LlamaForCausalLM, request: RuntimeRequest) -> RuntimeRequest:
    training = [name or "<model>" for name, module in model.named_modules() if module.training]
    if training:
        raise Rejection(TRAINING_MODE, f"the model is in training mode ({len(training)} modules, first {training[0]!r}); "
                        "call model.eval() before running a request", "$.model.training")
    g = request.max_new_tokens
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise Rejection(INVALID_REQUEST, f"max_new_tokens must be a non-negative int, got {g!r}", "$.max_new_tokens")
    prompt = tuple(int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in request.prompt_ids)
    if not prompt:
        raise Rejection(INVALID_REQUEST, "the prompt is empty (L >= 1 is required)", "$.prompt_ids")
    vocab = model.config.vocab_size
    for idx, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise Rejection(INVALID_REQUEST, f"prompt_ids[{idx}] = {tok!r} is not an id in [0, {vocab})", f"$.prompt_ids[{idx}]")
    window = model.config.max_position_embeddings
    if len(prompt) >= window:
        raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"prompt length {len(prompt)} leaves no room in the context window {window}", "$.prompt_ids")
    if request.cache not in ("none", "dynamic", "static"):
        raise Rejection(INVALID_REQUEST, f"unknown cache family {request.cache!r}", "$.runtime.cache_family")
    if request.structured not in ("none", "json"):
        raise Rejection(INVALID_REQUEST, f"unknown structured output {request.structured!r} (none or json)", "$.termination.structured")
    if request.policy.family is Family.BEAM:
        raise Rejection(FAMILY_MISMATCH, "the request runner runs one sequence; the beam family needs a beam loop", "$.policy.family")
    budget = request.timeout_ms
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_TIMEOUT_MS):
        raise Rejection(INVALID_REQUEST, f"timeout_ms must be None or an int in [1, {MAX_TIMEOUT_MS}], got {quote(budget)}",
                        "$.termination.timeout_ms")
    if g == 0 and request.zero_new_tokens == "reject":
        raise Rejection(ZERO_NEW_TOKENS_REJECTED, "max_new_tokens is 0 and the declared G=0 branch is 'reject'", "$.termination.max_new_tokens")
    changes: dict[str, Any] = {"prompt_ids": prompt, "eos_ids": frozenset(int(i) for i in request.eos_ids)}
    if request.cache == "static" and request.static_capacity is None:
        changes["static_capacity"] = default_static_capacity(len(prompt), g, window)
    if request.cache == "none":
        changes["prefill_chunk"] = None
    return attrs.evolve(request, **changes)


class _Roster(StageObserver):
    """The stage observer of one call: appends each completed stage; raises at ``fault_layer``."""

    def __init__(self, stages: list[str], fault_layer: int | None):
        self.stages = stages
        self.fault_layer = fault_layer

    def completed(self, stage: str) -> None:
        self.stages.append(stage)

    def fault(self, layer_idx: int) -> None:
        raise InjectedDeviceFault(f"injected device fault at layer {layer_idx}")


@contextlib.contextmanager
def _stage_roster(model: LlamaForCausalLM, stages: list[str], fault_layer: int | None) -> Iterator[None]:
    """Record each compute stage as it completes (the model's :class:`StageObserver`); raise at ``fault_layer`` if given.

    The model reports ``embed_tokens``, ``layers.i``, ``norm`` and ``lm_head`` on the torch path
    and on the native kernel alike (no forward hooks: a hook on a layer would keep the native
    kernel from running the layers in one call).
    """
    inner = model.model
    before = inner.__dict__.get("observer")
    inner.observer = _Roster(stages, fault_layer)
    try:
        yield
    finally:
        if before is None:
            inner.__dict__.pop("observer", None)
        else:
            inner.observer = before


def _timed(t_ns: int | None) -> dict[str, int]:
    """The optional ``t_ns`` trace field (ns since admission; absent past ``spec.latency.MAX_TIMED_EVENTS``)."""
    return {} if t_ns is None else {"t_ns": t_ns}
