"""The values the request runner takes and hands out: the request, the launched call, the exposed score, the decision and the result.

Leaf module (no runner, no model): :mod:`decodespec.impl.runtime`, :mod:`decodespec.impl.snapshot`,
:mod:`decodespec.impl.generate` and the batch and beam loops share these records without importing
each other.  Each is frozen; field names are the spec's (:mod:`decodespec.spec.state`).

Source: M3.10 0x00 "Immutable request envelope and canonical identity" (:class:`RuntimeRequest`),
0x08 "One model call prepares a complete logical state candidate" (:class:`CallRecord`,
:class:`Score`), 0x05 exactly-once commit (:class:`Decision`), 0x06 output contract
(:class:`GenerationResult`).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from decodespec.spec.enums import CallKind, FinishReason, PendingTag
from decodespec.spec.envelope import AdmittedRequest
from decodespec.spec.errors import Rejection
from decodespec.spec.policy.config import Family, PolicyConfig
from decodespec.spec.policy.receipt import DecisionReceipt
from decodespec.spec.policy.state import PolicyState
from decodespec.spec.prompt_logprobs import PromptLogprobsSpec
from decodespec.spec.request import INVALID_REQUEST, context_cap
from decodespec.spec.state import Phase

__all__ = ["CallRecord", "Decision", "GenerationResult", "RunnerState", "RuntimeRequest", "Score"]


@attrs.frozen
class RuntimeRequest:
    """Everything the runner needs from an admitted request (immutable).

    Build it with :meth:`from_admitted` (an admitted ``numinens.request.v1`` envelope: its identity
    keys the RNG and heads the trace) or directly (tests; ``identity`` is then whatever the
    caller declares).

    Attributes:
        identity: Request identity (``"sha256:<hex>"`` for an admitted envelope).
        prompt_ids: The L decoder input ids.
        max_new_tokens: G.
        policy: The M3.8 policy (greedy or multinomial family).
        eos_ids: The termination EOS set.
        min_new_tokens: EOS (and stop strings) are suppressed while O < this.
        seed: Request seed (keys the RNG with the identity) or ``None``.
        rng_counter_start: The envelope's initial RNG counter.
        cache: ``"none"``, ``"dynamic"`` or ``"static"``.
        static_capacity: S for the static cache (default: L + G + 1, at most the model window).
        prefill_chunk: Largest prefill chunk, or ``None`` for one-shot prefill.
        zero_new_tokens: The G = 0 branch (``reject`` / ``no_call`` / ``prefill_only``).
        final_cache: ``none`` / ``processed_inputs_only`` / ``all_outputs`` (repair call at finish).
        max_retries: Failed calls retried after recovery before ``device_error``.
        context_cap: Envelope bound on L + O (``None``: only the model window and capacity).
        stream: Whether the output streams (a streamer failure is possible).
        stop_strings: Declared stop strings (the observer matches them).
        structured: ``"none"`` or ``"json"``.
        include_stop_str: Whether a matched stop string is part of the returned text.
        alignment: The output contract after a cut: ``"token"`` (the envelope's default),
            ``"text"`` or ``"span"`` (M3.10 "Token-aligned and text-aligned outputs can diverge").
        vocab_hash: Ordered vocabulary hash recorded in receipts.
        timeout_ms: The wall-clock budget in milliseconds (the envelope's
            ``termination.timeout_ms``), or ``None`` for no budget: once the runner's monotonic
            clock has advanced this much since :meth:`RequestRunner.admit`, the request finishes
            ``timeout`` at the next call boundary.
        envelope: Canonical bytes of the admitted envelope (snapshots carry them), or ``None``.
        prompt_logprobs: The requested prompt logprobs (the envelope's ``output.prompt_logprobs``),
            or ``None`` (not requested): every prefill call then scores its rows
            (M3.10 0x02, :mod:`decodespec.impl.prompt_logprobs`).
    """

    identity: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    policy: PolicyConfig = attrs.field(factory=PolicyConfig.greedy)
    eos_ids: frozenset[int] = frozenset()
    min_new_tokens: int = 0
    seed: int | None = None
    rng_counter_start: int = 0
    cache: str = "dynamic"
    static_capacity: int | None = None
    prefill_chunk: int | None = None
    zero_new_tokens: str = "no_call"
    final_cache: str = "processed_inputs_only"
    max_retries: int = 0
    context_cap: int | None = None
    stream: bool = False
    stop_strings: tuple[str, ...] = ()
    structured: str = "none"
    include_stop_str: bool = False
    alignment: str = "token"
    vocab_hash: str = ""
    timeout_ms: int | None = None
    envelope: bytes | None = attrs.field(default=None, repr=False)
    prompt_logprobs: PromptLogprobsSpec | None = None

    @classmethod
    def from_admitted(cls, request: AdmittedRequest) -> RuntimeRequest:
        """The runtime request of an admitted envelope (``decodespec.spec.envelope.validate_request_envelope``).

        Raises:
            Rejection: ``policy.family_mismatch`` for a beam policy (beams have their own loop);
                ``runtime.invalid_request`` for an architecture other than ``decoder_only``.
        """
        if request.artifact.architecture != "decoder_only":
            raise Rejection(INVALID_REQUEST, f"the reference runtime runs decoder_only requests, not {request.artifact.architecture}",
                            "$.artifact.architecture")
        term, rt, pv = request.termination, request.runtime, request.position_visibility
        return cls(
            identity=request.identity,
            prompt_ids=request.decoder_input_ids,
            max_new_tokens=term.max_new_tokens,
            policy=request.policy,
            eos_ids=frozenset(term.eos_ids),
            min_new_tokens=term.min_new_tokens,
            seed=request.rng.seed,
            rng_counter_start=request.rng.counter,
            cache=rt.cache_family,
            static_capacity=rt.static_capacity,
            prefill_chunk=rt.prefill_chunk,
            zero_new_tokens=term.zero_new_tokens,
            final_cache=request.output.final_cache,
            max_retries=rt.max_retries,
            context_cap=context_cap(pv.max_context, term.max_total_tokens),
            stream=request.output.stream,
            stop_strings=term.stop_strings,
            structured=term.structured,
            include_stop_str=request.output.include_stop_str,
            alignment=request.output.alignment,
            vocab_hash=request.text_interface.tokenizer_sha256,
            timeout_ms=term.timeout_ms,
            envelope=request.canonical,
            prompt_logprobs=request.output.prompt_logprobs,
        )

    @property
    def prompt_len(self) -> int:
        """L."""
        return len(self.prompt_ids)

    @property
    def cached(self) -> bool:
        """Whether calls reuse retained state."""
        return self.cache != "none"

    def max_draws(self) -> int:
        """Most RNG draws one decision consumes (1 for the multinomial family, else 0)."""
        return 1 if self.policy.family is Family.MULTINOMIAL else 0


@attrs.frozen(eq=False)
class CallRecord:
    """The launched model call (M3.10 0x08 PREPARE).

    Attributes:
        call_id: 0-based call number of the request.
        kind: prefill / decode / repair.
        start: ``cache_position`` of row 0 (P cached, 0 without a cache).
        length: Rows (T).
        generation: Generation the call reads and its lanes must report.
        decision_row: Input position whose output row owns the next decision, or ``None``.
        input_ids: The T input ids.
    """

    call_id: int
    kind: CallKind
    start: int
    length: int
    generation: int
    decision_row: int | None
    input_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        """P after an ALL_NEW selection."""
        return self.start + self.length


@attrs.frozen(eq=False)
class Score:
    """A consumable score row exposed by an ALL_NEW completion.

    Attributes:
        score_id: ``"score-<generation>"``.
        generation: The generation the completion selected.
        processed: P when exposed (the row belongs to input position ``processed - 1``).
        output_count: O when exposed (the row predicts output number O).
        logits: ``[V]`` raw logits of the decision row (model dtype, model device).
    """

    score_id: str
    generation: int
    processed: int
    output_count: int
    logits: torch.Tensor = attrs.field(repr=False)


@attrs.frozen(eq=False)
class Decision:
    """An issued decision receipt, not yet consumed.

    Attributes:
        receipt_id: ``"receipt-<n>"`` (the request's ledger id).
        score_id: The score row decided on.
        token_id: The selected id.
        logprob: ``log_softmax(raw row)[token_id]`` (natural log, float32 row).
        draws: RNG draws consumed by the decision.
        rng_counter_before: The request RNG counter the decision read.
        receipt: The full M3.8 :class:`DecisionReceipt`.
        policy_state: The policy state the commit adopts.
    """

    receipt_id: str
    score_id: str
    token_id: int
    logprob: float
    draws: int
    rng_counter_before: int
    receipt: DecisionReceipt = attrs.field(repr=False)
    policy_state: PolicyState = attrs.field(repr=False)


@attrs.frozen
class GenerationResult:
    """What one request returned (M3.10 0x06 output contract; docs/design.md section 8).

    Attributes:
        prompt_ids: The L prompt token ids.
        output_ids: The returned output ids under the alignment contract (``int[k]``; a final EOS
            included); every committed id when no cut applies or without the output observer.
        text: The returned text (UTF-8 of the output bytes ``[0, visible_end)``; EOS and other
            special tokens contribute no bytes; "" without a tokenizer).
        logprobs: ``float[k]``: per returned token, natural log-softmax of the raw float32 logits of
            its selecting row at that token (``<= 0``); ``len(logprobs) == len(output_ids)``.
        finish_reason: The canonical finish reason (``None`` for a suspended request).
        triggers: Every finish condition recorded, in precedence order.
        frontier: ``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}``
            (L, O, |U|, P, tag) at finish; O counts every committed token.
        receipts: One M3.8 decision receipt per committed token (``impl.policy.decide``).
        rng_counter: Draws the request consumed (0 for greedy).
        num_committed: O, tokens committed (returned or not); ``None`` when unknown.
        alignment: ``token`` / ``text`` / ``span`` when the output observer aligned the result,
            else ``None``.
        overhang: Output bytes ``[visible_end, ids_byte_end)``: what the returned ids decode to
            beyond ``text`` (empty under ``token``; the documented mismatch under ``text``; the
            trimmed bytes under ``span``).
        token_spans: ``(start, end)`` byte span of each returned token in the output bytes.
        visible_end: End of the visible bytes (``len(text.encode())`` unless the text ends in an
            incomplete UTF-8 sequence), or ``None``.
        stop_match: ``(stop string, start byte, end byte)`` of the stop match that fired, or ``None``.
        structured_end: Byte offset where the JSON value completed, or ``None``.
        chunks: The stream chunks delivered (:class:`~decodespec.spec.stop.Chunk`).
        stream: The stream report (``chunks``, ``delivered_bytes``, ``delivered_tokens``,
            ``failed``, ``error``) of a streamed request, else ``None``.
        prompt_logprobs: The requested prompt logprobs
            (:class:`~decodespec.spec.prompt_logprobs.PromptLogprob` each, M3.10 0x02), or ``None``
            when not requested.
        timeline: When each model call launched and completed and each emission was published
            (:class:`decodespec.spec.latency.Timeline`, ns since admission; M3.10 0x0BA "Latency
            semantics"); ``None`` from a path that keeps no record.  Not part of equality.
    """

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    triggers: tuple[FinishReason, ...] = ()
    frontier: dict[str, Any] = attrs.field(factory=dict)
    receipts: tuple[DecisionReceipt, ...] = ()
    rng_counter: int = 0
    num_committed: int | None = None
    alignment: str | None = None
    overhang: bytes = b""
    token_spans: tuple[tuple[int, int], ...] = ()
    visible_end: int | None = None
    stop_match: tuple[str, int, int] | None = None
    structured_end: int | None = None
    chunks: tuple[Any, ...] = ()
    stream: dict[str, Any] | None = None
    prompt_logprobs: tuple[Any, ...] | None = None
    #: The request's recorded call and emission times (:class:`decodespec.spec.latency.Timeline`); not compared.
    timeline: Any = attrs.field(default=None, eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (``finish_reason`` and ``triggers`` as their string values, ``overhang`` as hex).

        ``stop_match`` is ``{"stop", "start", "end"}``; ``token_spans`` a list of ``[start, end]``;
        the chunks themselves are not included (``decodespec generate --stream --json`` prints
        them as lines), only the ``stream`` report; ``prompt_logprobs`` (a list of
        :meth:`~decodespec.spec.prompt_logprobs.PromptLogprob.to_json`) only when requested.
        """
        match = self.stop_match
        extra = {} if self.prompt_logprobs is None else {"prompt_logprobs": [e.to_json() for e in self.prompt_logprobs]}
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "text": self.text,
            "logprobs": list(self.logprobs),
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "triggers": [t.value for t in self.triggers],
            "frontier": dict(self.frontier),
            "receipts": [r.to_json() for r in self.receipts],
            "rng_counter": self.rng_counter,
            "num_committed": self.num_committed,
            "alignment": self.alignment,
            "overhang": self.overhang.hex(),
            "token_spans": [list(span) for span in self.token_spans],
            "visible_end": self.visible_end,
            "stop_match": None if match is None else {"stop": match[0], "start": match[1], "end": match[2]},
            "structured_end": self.structured_end,
            "stream": None if self.stream is None else dict(self.stream),
            **extra,
        }


@attrs.frozen(eq=False)
class RunnerState:
    """The runner's request state as one frozen record, field for field the spec's ``RequestState`` names.

    :meth:`decodespec.impl.runtime.RequestRunner.state` reads it; snapshots are taken from it and a
    restored runner adopts one (:func:`decodespec.impl.snapshot.restore_runner`).  Tensors stay out:
    the K/V rows live in the cache, the score's logits in :class:`Score`.

    Attributes:
        phase: The request phase.
        processed: P, input positions whose K/V rows are committed.
        output_ids: The O committed output ids.
        logprobs: Their logprobs (nats).
        receipts: The M3.8 receipt of each committed token.
        consumed: The consumed decisions (the commit ledger).
        pending_ids: U, committed ids not yet processed, with ``pending_tag``.
        pending_tag: U's tag.
        generation: The cache generation.
        in_flight: The launched, not yet completed call.
        score: The consumable score row.
        decision: The issued, not yet committed decision.
        issued: Every receipt id issued.
        scores: ``(score_id, generation, processed, output_count)`` of every exposed score.
        policy_state: The M3.8 policy state (RNG counter, automaton state, Mirostat mu).
        finish_reason: The published finish reason, or ``None``.
        triggers: Every finish trigger recorded.
        quarantined: Whether the handle waits for ``recover``.
        num_calls: Calls launched.
        num_retries: Failed calls retried.

    Source: M3.10 0x00 "Authoritative phase and commit spine" (the state's fields).
    """

    phase: Phase
    processed: int
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    receipts: tuple[DecisionReceipt, ...]
    consumed: tuple[Decision, ...]
    pending_ids: tuple[int, ...]
    pending_tag: PendingTag
    generation: int
    in_flight: CallRecord | None
    score: Score | None
    decision: Decision | None
    issued: tuple[str, ...]
    scores: tuple[tuple[str, int, int, int], ...]
    policy_state: PolicyState
    finish_reason: FinishReason | None
    triggers: frozenset[FinishReason]
    quarantined: bool
    num_calls: int
    num_retries: int
