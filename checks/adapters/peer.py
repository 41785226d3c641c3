"""The step-wise request controller shared by the peer adapters (HF transformers, llama.cpp).

A peer runtime has no phases, receipts or frontiers of its own; it has a loop.  This module is
the thin translation layer that walks a peer's loop one contract action at a time
(:mod:`decodespec.checks.adapters`) while every *answer* comes from the peer: the raw score row
(the peer's forward), the processed support and the selected id (the peer's own logits
processors / sampler chain), the processed-row count P (the peer's own cache length:
``Cache.get_seq_length()`` in HF, ``Llama.n_tokens`` in llama.cpp), the rollback of an aborted
call (the peer's own crop), the finish triggers (the peer's own stopping criteria where it has
them) and the returned text (the peer's own detokenizer).  The controller only keeps what the
contract needs and a peer does not name: the phase, the receipt ledger (``"receipt-<n>"``, so
duplicate and stale receipts replay the same way on every runtime), the interrupt point of a
cancel, the quarantine of a handle whose call was aborted (the peer's rows are cropped at once;
the flag only withholds snapshots, as the contract does), and the committed logprobs
(``log_softmax`` of the peer's raw row at the committed id).

Phases and calls follow the reference controller's declared contract (docs/design.md sections
5, 6 and 11): READY -> launch -> IN_FLIGHT -> complete -> SCORED (a decision row) or READY (a
prefill chunk) -> decide -> DECIDED -> commit -> READY or FINISHED; the due call is a prefill
chunk ``[P, P + chunk)``, then one decode row per committed token (the whole prefix without a
cache), then the repair call when ``final_cache = "all_outputs"``.  A peer call runs at
``complete`` (an interrupt that arrives in flight is awaited; the call's rows are then cropped
away with the peer's own rollback and the request finishes).  Fields a peer has no notion of
(generation, RNG counter unless the peer counts draws) are reported as ``None``
(not exposed) rather than invented.

Source: docs/design.md section 11 (adapter contract); M3.10 "Framework names are observations,
invariants are the contract" (map fields semantically), "Pinned official runtime
reconciliation" (prepare / execute / select / decide), 0x08 "Output, input, and cache
frontiers"; HF ``GenerationMixin._sample`` (loop order), llama-cpp-python ``Llama.generate``.

Size: one controller: the step-wise request controller every peer shares (admission, calls,
decisions, commits, interrupts, snapshots), one method per contract action.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import numpy as np

from decodespec.spec.enums import FINISH_PRECEDENCE, FinishReason, PendingTag, canonical_finish_reason, published_finish_reason
from decodespec.spec.envelope import ZERO_NEW_TOKENS_REJECTED
from decodespec.spec.errors import DecodeSpecError, Rejection, ResourceLimit
from decodespec.spec.policy.codes import TERMINAL_DECISION_CODES
from decodespec.spec.request import context_cap, default_static_capacity, static_capacity
from decodespec.spec.snapshot import SNAPSHOT_FORM_UNAVAILABLE
from decodespec.spec.state import ControllerAction, InterruptPoint, Phase, call_interrupt_point, controller_action, next_call, repair_owed
from decodespec.spec.transitions import NOT_ENABLED
from decodespec.spec.vocab import vocab_table_hash

from . import (
    ADAPTER_INVALID_ACTION,
    ADAPTER_PROTOCOL,
    ADAPTER_UNSUPPORTED,
    ApplyResult,
    CaseConfig,
    Observation,
    check_action,
    required_capabilities,
)
from .features import undeclared

__all__ = ["PeerAdapter", "PeerDecision", "PeerEngine", "bound_triggers", "log_softmax_at", "main_value", "peer_vocab_hash", "register_tolerances",
           "unsupported"]


def unsupported(message: str, path: str = "$") -> Rejection:
    """``adapter.unsupported``: the peer cannot honour this part of the case."""
    return Rejection(ADAPTER_UNSUPPORTED, message, path)


def register_tolerances(runtime: str) -> dict[tuple[str, str, str], Any]:
    """Declare ``runtime``'s tolerances to the ladder from its expectations file.

    Reads the ``[tolerance.<model>.<dtype>]`` tables (``logit``, ``kv``: epsilon on raw logits and
    on committed K/V rows) of ``checks/gate/expectations/<runtime>.toml`` into
    :data:`decodespec.checks.gate.tolerance.TOLERANCES` under ``(runtime, model, dtype)``; the derived
    probability and logprob tolerances follow :meth:`~decodespec.checks.gate.tolerance.Tolerance.from_logit`.
    A key ``checks/gate/calibration.json`` already declares is left to the calibration.

    Returns:
        The entries registered.
    """
    import tomllib
    from pathlib import Path

    from decodespec.checks.gate.tolerance import TOLERANCES, Tolerance

    path = Path(__file__).resolve().parent.parent / "gate" / "expectations" / f"{runtime}.toml"
    if not path.is_file():
        return {}
    tables = tomllib.loads(path.read_text(encoding="utf-8")).get("tolerance", {})
    added = {(runtime, model, dtype): Tolerance.from_logit(float(t["logit"]), float(t["kv"]))
             for model, by_dtype in tables.items() for dtype, t in by_dtype.items()
             if (runtime, model, dtype) not in TOLERANCES}  # a calibrated entry wins (derived, not declared by hand)
    TOLERANCES.update(added)
    return added


def main_value(transform: Any) -> Any:
    """The value of a transform's first catalog parameter (the one a peer's processor or sampler takes)."""
    return transform.params[0][1]


def bound_triggers(sequence: list[int], output_count: int, max_new_tokens: int, context_cap: int) -> set[FinishReason]:
    """The envelope's two bounds after a commit: ``length`` when O >= G, ``context_length`` when L + O = ``len(sequence)`` >= C."""
    fired: set[FinishReason] = set()
    if output_count >= max_new_tokens:
        fired.add(FinishReason.LENGTH)
    if len(sequence) >= context_cap:
        fired.add(FinishReason.CONTEXT_LENGTH)
    return fired


def log_softmax_at(row: np.ndarray, token_id: int) -> float:
    """Natural ``log_softmax(row)[token_id]`` of a raw float32 row (float64 accumulation).

    Shapes: ``row`` ``float32[V]``.  Units: nats.
    """
    z = np.asarray(row, dtype=np.float64)
    top = float(np.max(z))
    return float(z[token_id] - top - math.log(float(np.sum(np.exp(z - top)))))


@attrs.frozen(eq=False)
class PeerDecision:
    """What a peer's own policy code returned for one score row.

    Attributes:
        token_id: The selected id.
        support_ids: ``int64[k]`` ascending ids the peer's processors / sampler chain kept.
        support_probs: ``float32[k]`` the probabilities the peer selects from (softmax of its
            processed scores over the support).
        draws: RNG draws the decision consumed when the peer accounts for them, else ``None``.
    """

    token_id: int
    support_ids: np.ndarray | None = None
    support_probs: np.ndarray | None = None
    draws: int | None = None


#: Hashes of peers' tables already computed: ``id(tokens) -> (tokens, hash)`` (the table object is kept alive with its key).
_TABLE_HASHES: dict[int, tuple[Any, str]] = {}


def peer_vocab_hash(engine: Any, config: CaseConfig) -> str | None:
    """The peer's ordered vocabulary hash (M3.8 0x08), or ``None`` when it exposes no table for ``config.model``.

    The engine's optional ``vocab_table(config)`` returns ``(tokens [V], specials, control ids)``
    read from the peer's own tokenizer or vocabulary API (HF: its tokenizer; llama.cpp: its
    ``llama_vocab``); it is hashed with :func:`decodespec.spec.vocab.vocab_table_hash`, the one
    definition our runtime's receipts and the gate's reference use, so ``ladder.STATE`` compares
    it (check ``vocab.hash``) on the peer's first observation.
    """
    reader = getattr(engine, "vocab_table", None)
    table = None if reader is None else reader(config)
    if table is None:
        return None
    tokens, specials, control = table
    hit = _TABLE_HASHES.get(id(tokens))
    if hit is None or hit[0] is not tokens:
        hit = (tokens, vocab_table_hash(tokens, specials, control))
        _TABLE_HASHES[id(tokens)] = hit
    return hit[1]


class PeerEngine(Protocol):
    """What a peer runtime supplies to :class:`PeerAdapter` (one request at a time)."""

    name: str
    capabilities: frozenset[str]

    def window_for(self, config: CaseConfig) -> int:
        """The context window (positions) of the case's model (loads the model)."""
        ...  # pragma: no cover - protocol

    def start(self, config: CaseConfig, *, context_cap: int, reuse: bool = False) -> None:
        """Build the request's peer state (cache, processors, sampler chain, finish criteria bounded by ``context_cap``).

        ``reuse`` gives the request the previous request's cache object.

        Raises:
            Rejection: ``adapter.unsupported`` for what the peer cannot honour.
        """
        ...  # pragma: no cover - protocol

    def processed(self) -> int:
        """Rows the peer's retained state holds, by the peer's own count."""
        ...  # pragma: no cover - protocol

    def physical(self) -> int:
        """Rows physically allocated (static capacity) or written."""
        ...  # pragma: no cover - protocol

    def forward(self, sequence: list[int], start: int, length: int) -> np.ndarray:
        """Run one model call over ``sequence[start:start + length]`` (the whole prefix without a cache).

        Returns:
            ``float32[V]`` raw logits of the call's last row.
        """
        ...  # pragma: no cover - protocol

    def rollback(self, processed: int) -> None:
        """Drop every retained row at or after ``processed`` with the peer's own API."""
        ...  # pragma: no cover - protocol

    def decide(self, row: np.ndarray, sequence: list[int], output_count: int) -> PeerDecision:
        """Apply the peer's own policy code to ``row`` after ``sequence`` (prompt + committed outputs)."""
        ...  # pragma: no cover - protocol

    def accept(self, token_id: int) -> None:
        """The committed token (a stateful sampler chain records it)."""
        ...  # pragma: no cover - protocol

    def triggers(self, sequence: list[int], output_count: int) -> set[FinishReason]:
        """Finish triggers the peer's own criteria fire after a commit (EOS, length, context length, stop strings)."""
        ...  # pragma: no cover - protocol

    def text(self, output_ids: list[int]) -> str | None:
        """The peer's returned text for ``output_ids`` (``None``: not exposed)."""
        ...  # pragma: no cover - protocol

    def cache_probe(self, processed: int) -> np.ndarray | None:
        """Committed K/V rows ``float32[layers, 2, H_kv, P, D]`` or ``None``."""
        ...  # pragma: no cover - protocol

    def save(self) -> Any:
        """A snapshot of the peer's own state (its snapshot API)."""
        ...  # pragma: no cover - protocol

    def load(self, blob: Any) -> None:
        """Restore :meth:`save`'s blob with the peer's own API."""
        ...  # pragma: no cover - protocol


@attrs.frozen
class _Call:
    call_id: int
    kind: str
    start: int
    length: int
    decision_row: bool


@attrs.frozen(eq=False)
class _Pending:
    receipt_id: str
    score_id: str
    token_id: int
    logprob: float
    draws: int | None
    probe: tuple[np.ndarray, np.ndarray] | None = None  # (support ids, probabilities) of the peer's processed row


class PeerAdapter:
    """The contract's ops over a :class:`PeerEngine` (see the module docstring).

    Args:
        engine: The peer.
        name: Adapter name reported to the harness (``hf``, ``llamacpp``).
    """

    def __init__(self, engine: PeerEngine, name: str):
        self.engine = engine
        self.name = name
        self.config: CaseConfig | None = None
        #: The config of a refused ``reset`` (nothing admitted); ``None`` once a reset admits a request.
        self.refused: CaseConfig | None = None
        self.snapshots: dict[str, tuple[Any, dict[str, Any], CaseConfig]] = {}
        #: The peer's ordered vocabulary hash for the admitted request's model (:func:`peer_vocab_hash`).
        self.vocab_hash: str | None = None

    # -- contract ------------------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        """The peer's declared capabilities."""
        return self.engine.capabilities

    def reset(self, config: CaseConfig) -> None:
        """Build and admit the request of ``config``.

        Raises:
            Rejection: ``adapter.unsupported`` for what the peer cannot honour (beams, a
                capability it lacks, a policy transform it has no processor for);
                ``envelope.zero_new_tokens_rejected`` for G = 0 under ``reject``;
                ``runtime.invalid_request``-like refusals of the peer.
            ResourceLimit: the prompt does not fit the model window.

        A refused reset admits nothing and drops the previous request: :meth:`observe` then reports
        phase ``rejected`` (no output, no frontier) and every action is refused with
        ``transition.not_enabled`` (the spec's answer in a state with no admitted request) until a
        reset admits one.
        """
        try:
            self._admit(config, reuse=False)
        except DecodeSpecError:
            self.config, self.refused = None, config
            raise
        self.refused = None
        self.vocab_hash = peer_vocab_hash(self.engine, config)

    def prompt_logprobs(self, config: CaseConfig, spec: Any) -> tuple[Any, ...]:
        """The peer's prompt logprobs (M3.10 0x02) of ``config``'s prompt under ``spec``: a fresh :meth:`reset`, then the
        engine's ``prompt_logprobs(config, spec)`` (the request's prefill, every row's logits).

        Raises:
            Rejection: ``adapter.unsupported`` when the engine offers none; what :meth:`reset` refuses.
        """
        if not hasattr(self.engine, "prompt_logprobs") or "output.prompt_logprobs" not in self.capabilities():
            raise unsupported(f"{self.name} returns no prompt logprobs through this adapter", "$.output.prompt_logprobs")
        self.reset(config)
        return tuple(self.engine.prompt_logprobs(config, spec))

    def _admit(self, config: CaseConfig, *, reuse: bool) -> None:
        if config.num_beams != 1 or config.policy.get("family") == "beam":
            raise unsupported("the step-wise peer adapter decodes one sequence; beams run through generate(num_beams=...)", "$.num_beams")
        refusal = undeclared(config, self.capabilities(), self.name)
        if refusal is not None:
            raise refusal
        if config.cache not in ("none", "dynamic", "static") or f"cache:{config.cache}" not in self.capabilities():
            raise unsupported(f"{self.name} has no {config.cache!r} cache family", "$.cache")
        if config.prefill_chunk is not None and "prefill_chunk" not in self.capabilities():
            raise unsupported(f"{self.name} does not prefill in chunks through this adapter", "$.prefill_chunk")
        if config.stop_strings and "stop_strings" not in self.capabilities():
            raise unsupported(f"{self.name} matches no stop strings through this adapter", "$.stop_strings")
        if config.structured != "none" and "structured" not in self.capabilities():
            raise unsupported(f"{self.name} has no structured-completion stop", "$.structured")
        if config.max_new_tokens == 0 and config.zero_new_tokens == "reject":
            raise Rejection(ZERO_NEW_TOKENS_REJECTED, "max_new_tokens = 0 under zero_new_tokens = 'reject'", "$.max_new_tokens")
        window = self.engine.window_for(config)
        if config.prompt_len >= window:
            from decodespec.impl.model import CONTEXT_WINDOW_EXCEEDED

            raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"a {config.prompt_len}-token prompt needs L < {window}", "$.prompt_ids")
        capacity = static_capacity(config.cache, config.static_capacity, config.prompt_len, config.max_new_tokens, window)
        cap = context_cap(window, config.context_cap, capacity)
        self.engine.start(config, context_cap=cap, reuse=reuse)
        self.config = config
        self.window = window
        #: C: L + O reaching it fires ``context_length``.
        self.context_cap = cap
        self.phase = Phase.READY
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.pending_ids: tuple[int, ...] = ()
        self.pending_tag = PendingTag.EMPTY
        self.uncached_processed = 0
        self.in_flight: _Call | None = None
        self.interrupts: set[FinishReason] = set()
        self.quarantined = False
        self.score: tuple[str, np.ndarray, int] | None = None  # (score_id, row, output_count)
        self.latest_score: tuple[str, np.ndarray, int] | None = None
        self.decision: _Pending | None = None
        self.latest_decision: _Pending | None = None  # the pending one, else the last committed one
        self.last_committed: _Pending | None = None
        self.consumed: list[str] = []
        self.num_issued = 0
        self.num_scores = 0
        self.num_calls = 0
        self.last_call: dict[str, Any] | None = None
        self.finish_reason: FinishReason | None = None
        self.triggers: set[FinishReason] = set()
        if config.max_new_tokens == 0 and config.zero_new_tokens == "no_call":
            self._finish({FinishReason.LENGTH})

    @property
    def capacity(self) -> int:
        """S of a static cache: the config's, else the spec's default (:func:`decodespec.spec.request.default_static_capacity`)."""
        c = self.config
        return c.static_capacity if c.static_capacity is not None else default_static_capacity(c.prompt_len, c.max_new_tokens, self.window)

    def apply(self, action: Mapping[str, Any]) -> ApplyResult:
        """Apply one action; typed refusals become ``rejected`` (validated before anything changes)."""
        try:
            act = check_action(action)
            missing = required_capabilities(act) - self.capabilities()
            if missing:
                raise unsupported(f"op {act['op']!r} needs {sorted(missing)}", "$.op")
            if self.config is None and self.refused is not None:
                raise Rejection(NOT_ENABLED, "the request was refused at admission: no action is enabled", "$.op",
                                details={"rule": "transition.admit", "guard": "a request was admitted"})
            if self.config is None:
                raise Rejection(ADAPTER_PROTOCOL, "reset(config) must come before any action", "$")
            data = getattr(self, "_op_" + act["op"])(act)
        except DecodeSpecError as exc:
            return ApplyResult.rejected(exc.code, exc.message)
        return ApplyResult.accepted(data)

    def observe(self) -> Observation:
        """The observable projection (peer-owned values where the peer has them; ``None`` where it has no notion).

        After a refused :meth:`reset`: phase ``rejected``, no outputs, no triggers, every other
        field not exposed (nothing was built).

        Raises:
            Rejection: ``adapter.protocol`` before any ``reset``.
        """
        if self.config is None and self.refused is not None:
            return Observation(phase=Phase.REJECTED.value)
        if self.config is None:
            raise Rejection(ADAPTER_PROTOCOL, "reset(config) must come before observe()", "$")
        latest = self.latest_decision
        score = self.latest_score
        cached = self.config.cache != "none"
        processed = self.engine.processed() if cached else self.uncached_processed
        call = None
        if self.last_call is not None:
            call = {**self.last_call, "in_flight": self.in_flight is not None and self.in_flight.call_id == self.last_call["call_id"]}
        return Observation(
            phase=self.phase.value,
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            frontier={"prompt_len": self.config.prompt_len, "output_count": len(self.output_ids), "pending": len(self.pending_ids),
                      "processed": processed, "pending_tag": self.pending_tag.value},
            finish_reason=None if self.finish_reason is None else self.finish_reason.value,
            triggers=[t.value for t in FINISH_PRECEDENCE if t in self.triggers],
            rng_counter=None,
            generation=None,
            quarantined=self.quarantined,
            decision=None if latest is None else {"receipt_id": latest.receipt_id, "score_id": latest.score_id,
                                                  "token_id": latest.token_id, "logprob": latest.logprob, "draws": latest.draws},
            score_row=None if score is None else score[1],
            score_id=None if score is None else score[0],
            score_output_count=None if score is None else score[2],
            support_ids=None if latest is None or latest.probe is None else latest.probe[0],
            support_probs=None if latest is None or latest.probe is None else latest.probe[1],
            text=self.engine.text(self._text_ids()),
            chunks=None,
            cache_committed=processed if cached else 0,
            cache_physical=self.engine.physical() if cached else 0,
            call=call,
            cache_probe=self.engine.cache_probe(processed) if cached and self.in_flight is None and processed > 0 else None,
            vocab_rows=None if score is None else len(score[1]),  # the peer's V_out
            vocab_hash=self.vocab_hash,  # its own tokenizer's / vocabulary API's ordered table, hashed by the one definition
        )

    def close(self) -> None:
        """Drop the request and the stored snapshots."""
        self.config = self.refused = None
        self.snapshots.clear()

    # -- state helpers -------------------------------------------------------------------
    def _text_ids(self) -> list[int]:
        ids = list(self.output_ids)
        if ids and ids[-1] in self.config.eos_ids and FinishReason.EOS in self.triggers:
            ids.pop()
        return ids

    def _require(self, condition: bool, rule: str, guard: str) -> None:
        if not condition:
            raise Rejection(NOT_ENABLED, f"{rule}: guard '{guard}' is false in phase {self.phase.value}", "$.action",
                            details={"rule": rule, "guard": guard})

    def _sequence(self) -> list[int]:
        return list(self.config.prompt_ids) + self.output_ids

    def _repair_owed(self) -> bool:
        return repair_owed(phase=self.phase, repair_required=self.config.final_cache == "all_outputs" and self.config.cache != "none",
                           pending_tag=self.pending_tag, finish_reason=self.finish_reason, triggers=self.triggers)

    def _next_call(self) -> tuple[str, int, int] | None:
        """The due call ``(kind, start, length)``, or ``None``."""
        c = self.config
        cached = c.cache != "none"
        processed = self.engine.processed() if cached else self.uncached_processed
        due = next_call(phase=self.phase, processed=processed, prompt_len=c.prompt_len, output_count=len(self.output_ids), cached=cached,
                        prefill_chunk=c.prefill_chunk, pending_tag=self.pending_tag, call_in_flight=self.in_flight is not None,
                        quarantined=self.quarantined, repair_owed=self._repair_owed())
        return None if due is None else (due[0].value, due[1], due[2])

    def _interrupt_point(self) -> InterruptPoint | None:
        return call_interrupt_point(self.phase, self.in_flight is not None)  # IN_FLIGHT also for the repair call after the close

    def _finish(self, triggers: set[FinishReason]) -> None:
        self.triggers |= triggers
        self.finish_reason = published_finish_reason(self.triggers)
        self.phase = Phase.FINISHED
        self.pending_tag = PendingTag.CLOSED_UNPROCESSED if self.pending_ids else PendingTag.EMPTY

    # -- calls ---------------------------------------------------------------------------
    def _launch(self, kind: str | None, length: int | None) -> _Call:
        due = self._next_call()
        rule = f"transition.launch_{kind or (due[0] if due else 'decode')}"
        self._require(self.in_flight is None, rule, "no call in flight")
        self._require(due is not None, rule, f"a call is due in phase {self.phase.value}")
        due_kind, start, due_length = due
        kind = kind or due_kind
        self._require(kind == due_kind, rule, f"the state calls for a {due_kind} call")
        length = due_length if length is None else length
        c = self.config
        if kind == "prefill" and c.cache != "none" and c.prefill_chunk is not None:
            self._require(1 <= length <= min(c.prompt_len - start, c.prefill_chunk), rule,
                          "prefill length fits the remaining prompt and the chunk size")
        else:
            self._require(length == due_length, rule, "length == the expected slice length")
        if c.cache == "static" and start + length > self.capacity:
            from decodespec.spec.positions import CACHE_CAPACITY_EXCEEDED

            raise ResourceLimit(CACHE_CAPACITY_EXCEEDED, f"write [{start}, {start + length}) exceeds the {self.capacity} reserved slots",
                                "$.cache_position")
        end = start + length
        if kind == "prefill":
            decision_row = end == c.prompt_len and c.max_new_tokens > 0
        else:
            decision_row = kind == "decode"
        call = _Call(self.num_calls, kind, start, length, decision_row)
        self.num_calls += 1
        self.in_flight = call
        self.interrupts = set()
        if kind != "repair":
            self.phase = Phase.IN_FLIGHT
        positions = list(range(start, end))
        self.last_call = {"call_id": call.call_id, "kind": kind, "start": start, "length": length,
                          "position_ids": positions, "cache_position": positions}
        return call

    def _complete(self) -> dict[str, Any]:
        call = self.in_flight
        self._require(call is not None, "transition.complete_all_new", "a call is in flight")
        c = self.config
        cached = c.cache != "none"
        before = self.engine.processed() if cached else self.uncached_processed
        row = self.engine.forward(self._sequence(), call.start, call.length)
        self.in_flight = None
        if self.interrupts:
            # ALL_OLD: the awaited call's rows are dropped with the peer's own rollback; the
            # controller keeps the handle quarantined (no snapshot of it) as the contract says.
            if cached:
                self.engine.rollback(before)
                self.quarantined = True
            self._finish(set(self.interrupts))
            return {"selection": "ALL_OLD", "reason": canonical_finish_reason(self.interrupts).value}
        end = call.start + call.length
        if not cached:
            self.uncached_processed = end
        if call.kind == "repair":
            self.pending_ids, self.pending_tag = (), PendingTag.EMPTY
            return {"selection": "ALL_NEW", "reason": None}
        if call.kind == "prefill" and end < c.prompt_len:
            self.phase = Phase.READY
            return {"selection": "ALL_NEW", "reason": None}
        if call.kind == "prefill" and c.max_new_tokens == 0:
            self._finish({FinishReason.LENGTH})
            return {"selection": "ALL_NEW", "reason": None}
        self.pending_ids, self.pending_tag = (), PendingTag.EMPTY
        self.num_scores += 1
        row = np.asarray(row, dtype=np.float32).copy()
        row.setflags(write=False)
        self.score = (f"score-{self.num_scores}", row, len(self.output_ids))
        self.latest_score = self.score
        self.phase = Phase.SCORED
        return {"selection": "ALL_NEW", "reason": None}

    # -- ops -----------------------------------------------------------------------------
    def _op_prefill(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch("prefill", act["chunk"])
        return self._complete()

    def _op_decode(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch("decode", None)
        return self._complete()

    def _op_repair(self, act: dict[str, Any]) -> dict[str, Any]:
        self._launch("repair", None)
        return self._complete()

    def _op_launch(self, act: dict[str, Any]) -> dict[str, Any]:
        call = self._launch(act["kind"], act["length"])
        return {"call_id": call.call_id, "kind": call.kind, "start": call.start, "length": call.length}

    def _op_complete(self, act: dict[str, Any]) -> dict[str, Any]:
        return self._complete()

    def _op_decide(self, act: dict[str, Any]) -> dict[str, Any]:
        self._require(self.phase is Phase.SCORED and self.score is not None, "transition.decide", "phase == SCORED")
        score_id, row, _ = self.score
        try:
            made = self.engine.decide(row, self._sequence(), len(self.output_ids))
        except DecodeSpecError as exc:
            reason = TERMINAL_DECISION_CODES.get(exc.code)
            if reason is None:
                raise
            # The peer's own "unsatisfiable constraint" is the typed terminal finish (M3.10 0x02 branch table).
            self.score = None
            self._finish({reason})
            return {"finish_reason": reason.value}
        probe = None
        if made.support_ids is not None:
            probe = (np.asarray(made.support_ids, dtype=np.int64), np.asarray(made.support_probs, dtype=np.float32))
        pending = _Pending(f"receipt-{self.num_issued}", score_id, int(made.token_id), log_softmax_at(row, int(made.token_id)),
                           made.draws, probe)
        self.num_issued += 1
        self.decision = self.latest_decision = pending
        self.phase = Phase.DECIDED
        return {"receipt_id": pending.receipt_id, "token_id": pending.token_id, "logprob": pending.logprob, "draws": pending.draws}

    def _op_commit(self, act: dict[str, Any]) -> dict[str, Any]:
        pending = self.decision
        self._require(self.phase is Phase.DECIDED and pending is not None, "transition.commit", "phase == DECIDED")
        receipt_id = pending.receipt_id if act["receipt"] is None else act["receipt"]
        self._require(receipt_id not in self.consumed, "transition.commit", "receipt was never consumed")
        self._require(receipt_id == pending.receipt_id, "transition.commit", "receipt is the pending one (not stale)")
        token = pending.token_id
        self.engine.accept(token)
        self.output_ids.append(token)
        self.logprobs.append(pending.logprob)
        self.consumed.append(pending.receipt_id)
        self.last_committed = pending
        self.decision = None
        self.score = None
        self.pending_ids = (token,)
        fired = set(self.engine.triggers(self._sequence(), len(self.output_ids)))
        if fired:
            self._finish(fired)
        else:
            self.phase = Phase.READY
            self.pending_tag = PendingTag.PENDING_NEXT_CALL
        ordered = [t.value for t in FINISH_PRECEDENCE if t in fired]
        return {"receipt_id": pending.receipt_id, "token_id": token, "triggers": ordered}

    def _step_once(self) -> str | None:
        """The one controller action the spec's schedule calls for (:func:`decodespec.spec.state.controller_action`)."""
        action = controller_action(phase=self.phase, call_in_flight=self.in_flight is not None, quarantined=self.quarantined,
                                   repair_owed=self._repair_owed(), call_due=self._next_call() is not None)
        if action is ControllerAction.COMPLETE:
            self._complete()
        elif action is ControllerAction.RECOVER:  # a peer quarantines only when an interrupt finished the request
            self._op_recover({})
        elif action is ControllerAction.DECIDE:
            self._op_decide({})
        elif action is ControllerAction.COMMIT:
            self._op_commit({"receipt": None})
        elif action is ControllerAction.LAUNCH:
            self._launch(None, None)
        return None if action is None else action.value

    def _steps(self, until_commit: bool) -> list[str]:
        names = []
        while True:
            name = self._step_once()
            if name is None:
                break
            names.append(name)
            if name == "commit" and until_commit:
                break
        if not names:
            raise Rejection(NOT_ENABLED, f"no controller action is enabled in phase {self.phase.value} (terminal)", "$.op",
                            details={"rule": "controller", "guard": "the request is not terminal"})
        return names

    def _op_step(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"actions": self._steps(until_commit=True)}

    def _op_run(self, act: dict[str, Any]) -> dict[str, Any]:
        return {"actions": self._steps(until_commit=False)}

    def _op_cancel(self, act: dict[str, Any]) -> dict[str, Any]:
        reason = FinishReason(act["kind"])
        at = self._interrupt_point()
        self._require(at is not None, "transition.interrupt_before_launch", "phase == READY (before launch)")
        if at is InterruptPoint.IN_FLIGHT:
            self._require(reason not in self.interrupts, "transition.interrupt_in_flight", "reason not yet recorded for the call")
            self.interrupts.add(reason)
            return {"at": at.value}
        self.score = None
        self.decision = None
        self.latest_decision = self.last_committed  # a discarded receipt is no decision
        self._finish({reason})
        return {"at": at.value}

    def _op_snapshot(self, act: dict[str, Any]) -> dict[str, Any]:
        form = act["form"]
        if form == "repaired" and self.pending_ids and self.in_flight is None:
            # The valid append call of the pending token: the ordinary decode between calls, the
            # promised repair call after finish (its row is discarded); the peer's state then holds U.
            if self.phase is Phase.READY:
                self._launch("decode", None)
                self._complete()
            elif self._repair_owed():
                self._launch("repair", None)
                self._complete()
        phases = (Phase.READY, Phase.FINISHED) if form == "pending_suffix" else (Phase.READY, Phase.SCORED, Phase.FINISHED)
        why = ("a call is in flight" if self.in_flight is not None else
               "the handle is quarantined (an aborted call)" if self.quarantined else
               f"no {form} snapshot in phase {self.phase.value}" if self.phase not in phases else
               "a token is still pending (no append call ran)" if form == "repaired" and self.pending_ids else None)
        if why is not None:
            raise Rejection(SNAPSHOT_FORM_UNAVAILABLE, why, "$.form")
        handle = act["id"] or f"snapshot-{len(self.snapshots)}"
        state = {k: getattr(self, k) for k in _SNAPSHOT_FIELDS}
        state = {k: (list(v) if isinstance(v, list) else set(v) if isinstance(v, set) else v) for k, v in state.items()}
        self.snapshots[handle] = (self.engine.save(), state, self.config)
        return {"snapshot": handle}

    def _op_restore(self, act: dict[str, Any]) -> dict[str, Any]:
        entry = self.snapshots.get(act["snapshot"])
        if entry is None:
            raise Rejection(ADAPTER_INVALID_ACTION, f"no snapshot named {act['snapshot']!r}", "$.snapshot")
        blob, state, config = entry
        if act["corrupt"] is not None:
            blob, state = self.corrupt(blob, dict(state), act["corrupt"])
        self.engine.start(config, context_cap=state["context_cap"], reuse=False)
        self.engine.load(blob)
        self.config = config
        for key, value in state.items():
            setattr(self, key, list(value) if isinstance(value, list) else set(value) if isinstance(value, set) else value)
        self.in_flight = None
        self.interrupts = set()
        return {}

    def corrupt(self, blob: Any, state: dict[str, Any], corruption: str) -> tuple[Any, dict[str, Any]]:
        """Apply one of the contract's corruptions to what the peer's snapshot holds (the engine may override).

        The peer's snapshot has no identity, RNG counter or frontier record to corrupt beyond what
        :meth:`PeerEngine.save` returns; the default corrupts the controller's copy the same way
        :func:`~decodespec.checks.adapters.corrupt_record` corrupts a spec record.
        """
        corrupt = getattr(self.engine, "corrupt", None)
        if corrupt is not None:
            return corrupt(blob, state, corruption)
        raise unsupported(f"{self.name} snapshots carry no record to corrupt", "$.corrupt")

    def _op_reuse(self, act: dict[str, Any]) -> dict[str, Any]:
        changes: dict[str, Any] = {"prompt_ids": tuple(act["prompt_ids"])}
        if act["max_new_tokens"] is not None:
            changes["max_new_tokens"] = act["max_new_tokens"]
        self._admit(self.config.evolve(**changes), reuse=True)
        return {}

    def _op_fault(self, act: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - the capability is never declared
        raise unsupported(f"{self.name} has no fault injection", "$.op")

    def _op_recover(self, act: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - the capability is never declared
        raise unsupported(f"{self.name} has no recovery", "$.op")

    def _op_stream_fail(self, act: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - the capability is never declared
        raise unsupported(f"{self.name} exposes no stream", "$.op")


#: Controller fields a snapshot keeps beside the peer's own state.
_SNAPSHOT_FIELDS = (
    "phase", "output_ids", "logprobs", "pending_ids", "pending_tag", "uncached_processed", "score", "latest_score", "decision",
    "latest_decision", "last_committed", "consumed", "quarantined", "num_issued", "num_scores", "num_calls", "last_call",
    "finish_reason", "triggers",
    "context_cap",
)
