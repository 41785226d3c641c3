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

Before any replay, every line must match the published JSON Schema
``spec/schemas/events.v1.json`` (:data:`EVENTS_SCHEMA_PATH`, Draft 2020-12, validated with
``jsonschema``): every event has a **closed field set** (an unknown field is refused), the header's
``format`` is ``decodespec.events.v1``, and nested objects (frontier, params, output, runtime,
the decision's receipt, the finish's stream report) are closed too.  A ``decision``'s embedded
M3.8 receipt must be the receipt of that decision: its content hash ``receipt_id`` must match its
body (:func:`decodespec.spec.policy.receipt.content_id`), its ``policy_digest`` must be the
digest of the header's ``policy`` (written once per trace; receipts reference it instead of
embedding it) and its applied ``transforms`` a subsequence of that policy's, and ``selected_id``, ``score_id``,
``draws``, ``raw_logprob``, the RNG counters, ``step`` (O at decision time) and ``vocab_size``
must equal the event's fields and the spec state's.  A ``commit`` carries the ``logprob`` its
decision recorded; a completion's ``layers_written`` agrees with its selection (no cache: 0; a
cached ALL_NEW call wrote every layer: at least one, and the count of the trace's first ALL_NEW
completion, the model's depth); a ``snapshot`` event's ``state`` is, field by field, the spec's
:func:`~decodespec.spec.snapshot.take_snapshot` of the matched state; the header's ``runtime``
fields are in the runtime's domains (schema enums: name, model, device, dtype, attention, kernel) and
all or nothing (model, device, dtype, attention and kernel together, or the name alone); every integer
is in ``[0, MAX_SAFE_INT]`` (spec/limits.py) and every object closed, the snapshot event's ``state``
included; the header's ``profile`` and ``lanes`` are its params' profile and lane roster; in a content
trace each receipt's ``rng.key_id`` is the Philox key of the header's identity and ``seed``
(spec/policy/rng.py); a streamed request's ``finish`` carries its stream report, whose
``delivered_tokens`` is the last chunk's ``token_end`` and whose ``error`` implies ``failed``.

A reason quotes no user content (token ids, text, stop strings): such values appear as length and
fingerprint (:func:`~decodespec.spec.errors.quote_content`); the verdict's ``data`` says so.

A ``cancel`` with ``source = "budget"`` (the request's own wall-clock budget fired) needs the
header's ``timeout_ms``, ``kind = timeout``, ``at = before_launch`` and ``elapsed_ms >=
timeout_ms``; a ``timeout`` without that source is an external interrupt (the spec enables it at
every interrupt point).

A trace is accepted when every line is consumed and the request ends terminal with a ``finish``
event after its last state change (a trace that reaches a terminal state but lacks that
``finish`` is incomplete: the finish is what reports the outcome), or suspended right after a
``snapshot`` event; a resumed trace of an already finished snapshot (``request``, ``restore``)
needs no second ``finish``: the original trace reported it and the restored ledger carries it.
Otherwise :class:`TraceVerdict` names the first unmatched line (1-based ``line`` and its
``seq``), its event, the refusal ``code`` (``trace.schema``, ``trace.receipt``,
``trace.incomplete``, ``trace.invalid_header`` or ``trace.mismatch``) and the reason (the
failing guard clause, the schema error with its JSON path, or the field that disagreed and both
values).

The stream contract (M3.10 0x06) is checked on every trace: ``stream`` events only in a
streamed request, numbered from 0, each publishing the bytes right after the previous one
(published bytes are never retracted or overlapped, ``invariant.stream_prefix``), never covering
a token that is not yet committed, none after the stream failed or after ``finish``; the
``finish`` event's stream report agrees with the chunks seen.  Given the tokenizer's bytes
(``token_bytes``, special tokens as ``b""``), the committed ids are also replayed through the
spec's stop oracle (:mod:`decodespec.spec.stop`, with the header's ``output`` object and
``params``): each ``commit``'s text triggers must be ``step_triggers``'; each chunk must be the
decode of its byte range with its token range (``invariant.chunk_metadata``) and end at or before
the stream horizon of the committed output (``stream_frontier``; the aligned output's visible end
once finished), so no held-back byte of a stop string is ever published
(``invariant.stream_no_stop_bytes``); between commits exactly the stream frontier is published
(``invariant.stream_frontier``); and at ``finish`` the concatenated chunks equal the returned text
``align_output`` gives (``invariant.stream_final``) unless the stream failed (then a prefix of it).
A resumed trace continues the stream at the reference frontier of the restored output.

A **redacted** trace (the header's ``data``, :mod:`decodespec.spec.passport`; the default of
``decodespec generate --trace``) carries keyed digests instead of token ids and texts: each
distinct digest is replayed as a distinct stand-in id (:class:`_Surrogates`), so every check above
that compares ids runs unchanged; the receipt's content hash is checked over the body as written;
a chunk's ``text_redacted.bytes`` must be its byte range; and the checks that need the bytes
(:data:`CONTENT_CHECKS`) are not run and are listed in the verdict's ``needs_content``
(``trace.redacted``).  Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data".

Source: docs/design.md section 6 (the trace format); M3.10 0x0BA "Requirements for
observability"; research/formal-anchors-survey.md (trace validation as membership of a
runtime trace in the spec's behaviours, as in TLA+ trace validation).

Size: one validator: every event of the runtime trace mapped to its spec action with its typed
refusal, the data passport and the stream and stop checks of the same replay.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import attrs
import jsonschema

from decodespec.checks.modelcheck.fastschema import FastAccept
from decodespec.spec.actions import (
    TEXT_TRIGGERS,
    Action,
    Admit,
    Cancel,
    Commit,
    Complete,
    Decide,
    Fault,
    Launch,
    Recover,
    Restore,
    Snapshot,
    StreamFailure,
    SupportEmpty,
    action_label,
)
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason, Selection
from decodespec.spec.errors import MESSAGE_CLASSIFICATION, DecodeSpecError, Rejection, quote, quote_content, register_code
from decodespec.spec.passport import CONTENT, DATA_UNKNOWN_CLASSIFICATION, REDACTED, TRACE_REDACTED, DataPassport, is_token_digest, passport_from_json
from decodespec.spec.policy.config import PolicyConfig, policy_config_from_json
from decodespec.spec.policy.receipt import content_id, receipt_policy_mismatch
from decodespec.spec.policy.rng import rng_key
from decodespec.spec.profiles import profile_named
from decodespec.spec.snapshot import SnapshotRecord, take_snapshot
from decodespec.spec.state import Phase, RequestParams, RequestState, initial_state, interrupt_point, is_terminal
from decodespec.spec.stop import (
    AlignedOutput,
    StopConfig,
    align_output,
    make_chunk,
    reference_stream,
    step_triggers,
    stream_frontier,
    token_ends,
)
from decodespec.spec.transitions import MACHINE, Machine, completion_reason

__all__ = ["EVENTS_SCHEMA_PATH", "TRACE_INCOMPLETE", "TRACE_INVALID", "TRACE_MISMATCH", "TRACE_RECEIPT", "TRACE_SCHEMA", "TRACE_UNSUPPORTED", "TraceVerdict", "params_from_header", "stop_config_from_header", "token_bytes_of", "validate_trace"]

TRACE_INVALID = register_code(
    "trace.invalid_header",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1)",
    "The trace's first line is not a request header whose params build the spec's RequestParams.",
)

TRACE_UNREADABLE = register_code(
    "trace.unreadable",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1)",
    "The trace file cannot be read (missing, unreadable, or not UTF-8); nothing was validated.",
)

TRACE_UNSUPPORTED = register_code(
    "trace.unsupported",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1)",
    "The trace is a runtime trace of a procedure trace validation does not replay: a beam search (its request "
    "header carries 'beam', the BeamParams, or a policy of family 'beam'; its steps are beam_step events). The spec's "
    "transition.beam_step needs every live beam's score row, which the trace does not record; the beam runtime is "
    "checked against the spec by replaying its rows (tests/test_beam_runtime.py) and in lock step by the gate.",
)

TRACE_SCHEMA = register_code(
    "trace.schema",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1); spec/schemas/events.v1.json",
    "A trace line does not match the published event schema spec/schemas/events.v1.json: not a JSON object, "
    "'v' is not 1, 'seq' is not consecutive from 0, an unknown event, a missing, mistyped or unknown field "
    "(every event and nested object has a closed field set), or a header whose 'format' is not decodespec.events.v1.",
)

TRACE_RECEIPT = register_code(
    "trace.receipt",
    "rejection",
    "M3.8 0x0B (the decision receipt); M3.10 0x08; docs/design.md section 6 (decision)",
    "A decision event's embedded receipt is not the receipt of that decision: its content-hash receipt_id does not "
    "match its body, or its selected_id, score_id, draws, raw_logprob, RNG counters, step or vocab_size disagree "
    "with the event's fields or the spec state.",
)

TRACE_INCOMPLETE = register_code(
    "trace.incomplete",
    "rejection",
    "docs/design.md section 6 (decodespec.events.v1)",
    "The trace ends before the request is terminal (and not right after a snapshot), or it reaches a terminal state "
    "without the finish event that reports it.",
)

TRACE_MISMATCH = register_code(
    "trace.mismatch",
    "rejection",
    "docs/design.md section 6; M3.10 (the request state machine)",
    "No candidate spec state matches a trace line: the action is not enabled (a guard fails) or a stated field "
    "disagrees with the spec's successor state or with the stream / stop-oracle contract.",
)

#: The published JSON Schema of one trace line (Draft 2020-12).
EVENTS_SCHEMA_PATH = Path(__file__).resolve().parents[2] / "spec" / "schemas" / "events.v1.json"

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
        code: The refusal's registered code (``trace.schema``, ``trace.receipt``,
            ``trace.incomplete``, ``trace.invalid_header``, ``trace.mismatch``,
            ``data.unknown_classification``), or ``None`` when accepted.
        classification: The trace's declared data classification (the header's ``data``, which
            every trace must declare: a header without one is ``data.unknown_classification``), or
            ``None`` when the header was not read.
        needs_content: For a redacted trace, the checks that need the raw content and were not
            run: ``{"code": "trace.redacted", "checks": [...], "message"}``; else ``None``.
        data: The declared classification of the verdict's own text (``reason``): ``redacted``
            (spec/errors.py MESSAGE_CLASSIFICATION: token ids, text and stop strings appear as
            length and fingerprint, never raw), whatever the trace's ``classification``.
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
    code: str | None = None
    classification: str | None = None
    needs_content: dict[str, Any] | None = None
    data: str = MESSAGE_CLASSIFICATION

    def to_json(self) -> dict[str, Any]:
        """The verdict as a JSON object."""
        return attrs.asdict(self)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


#: The ``request`` header's ``params`` fields a trace must state (the rest default as in RequestParams).
_HEADER_REQUIRED = ("identity", "prompt_len", "max_new_tokens", "vocab_size", "eos_ids", "cache_family", "context_cap")
#: Each ``params`` field a trace may state -> how its JSON value becomes the RequestParams field.
_HEADER_FIELDS: dict[str, Any] = {
    "identity": str, "prompt_len": int, "max_new_tokens": int, "vocab_size": int,
    "eos_ids": lambda v: frozenset(int(i) for i in v), "profile": lambda v: profile_named(str(v)), "min_new_tokens": int,
    "cache_family": str, "context_cap": int, "static_capacity": _optional_int, "zero_new_tokens": str, "final_cache": str,
    "prefill_chunk": _optional_int, "max_retries": int, "max_draws": int, "rng_counter_start": int, "stream": bool,
    "stop_strings": bool, "structured": bool,
}


def params_from_header(header: dict[str, Any]) -> RequestParams:
    """The spec's :class:`RequestParams` from a ``request`` event.

    Raises:
        Rejection: ``trace.invalid_header`` when ``params`` is missing or a field is mistyped,
            or when it disagrees with the header (identity, prompt length).
    """
    try:
        p = dict(header["params"])
        missing = sorted(set(_HEADER_REQUIRED) - set(p))
        if missing:
            raise KeyError(missing[0])
        # Only the fields the header states: every other field takes RequestParams' own (the spec's) default.
        params = RequestParams(**{name: convert(p[name]) for name, convert in _HEADER_FIELDS.items() if name in p})
    except (KeyError, TypeError, ValueError) as exc:
        raise Rejection(TRACE_INVALID, f"the request header's params are not RequestParams: {type(exc).__name__}: {quote(str(exc))}", "$.params") from None
    if params.identity != header.get("identity") or params.prompt_len != len(header.get("prompt_ids", ())):
        raise Rejection(TRACE_INVALID, "params.identity / prompt_len disagree with the header's identity / prompt_ids", "$.params")
    # The header states the request's constants twice (its own fields and params): both must say the same.
    stated = {"max_new_tokens": params.max_new_tokens, "min_new_tokens": params.min_new_tokens, "eos_ids": sorted(params.eos_ids),
              "zero_new_tokens": params.zero_new_tokens, "cache": params.cache_family, "capacity": params.static_capacity,
              "prefill_chunk": params.prefill_chunk}
    for field, value in stated.items():
        if field in header:
            own = sorted(header[field]) if field == "eos_ids" and isinstance(header[field], list) else header[field]
            if own != value:
                raise Rejection(TRACE_INVALID, f"the header's {field} {_shown(field, own)} disagrees with its params ({_shown(field, value)})", f"$.{field}")
    if header.get("profile", params.profile.name) != params.profile.name:
        raise Rejection(TRACE_INVALID, f"the header's profile {quote(header['profile'])} disagrees with its params "
                        f"({params.profile.name!r})", "$.profile")
    lanes = list(params.profile.lane_names()) if params.cache_family != "none" else []
    if "lanes" in header and header["lanes"] != lanes:
        raise Rejection(TRACE_INVALID, f"the header's lanes {quote(header['lanes'])} are not the profile's lane roster {lanes!r} "
                        f"(a request with cache {params.cache_family!r})", "$.lanes")
    outside = sorted(i for i in (*header.get("prompt_ids", ()), *params.eos_ids) if not 0 <= int(i) < params.vocab_size)
    if outside:
        raise Rejection(TRACE_INVALID, f"token id {quote_content(outside[0])} is outside the vocabulary [0, {params.vocab_size})", "$.params")
    return params


def stop_config_from_header(header: dict[str, Any], params: RequestParams, *, redacted: bool = False) -> StopConfig | None:
    """The request's :class:`~decodespec.spec.stop.StopConfig`: the header's ``output`` object plus ``params``' counts.

    Returns ``None`` for a header without ``output`` whose params declare neither stop strings nor
    structured completion (the default output contract applies then: no cut).

    In a ``redacted`` trace the stop strings are digests (``{"digest", "bytes"}``): the returned
    configuration has none (the stop oracle, which needs them and the token bytes, is not run).

    Raises:
        Rejection: ``trace.invalid_header`` when ``output`` is missing although stop strings or
            structured completion are declared, is mistyped, or disagrees with ``params``.
    """
    out = header.get("output")
    if out is None:
        if params.stop_strings or params.structured:
            raise Rejection(TRACE_INVALID, "params declare stop strings / structured completion but the header has no 'output'", "$.output")
        out = {}
    stated_stops = out.get("stop_strings", ())
    if redacted:
        if not all(isinstance(x, dict) for x in stated_stops):
            raise Rejection(TRACE_INVALID, "a redacted trace's stop strings are digests ({digest, bytes}), not text", "$.output.stop_strings")
        out = {**out, "stop_strings": ()}
    elif not all(isinstance(x, str) for x in stated_stops):
        raise Rejection(TRACE_INVALID, "a stop string is a digest but the trace is not redacted", "$.output.stop_strings")
    try:
        config = StopConfig(
            max_new_tokens=params.max_new_tokens, eos_ids=params.eos_ids, min_new_tokens=params.min_new_tokens,
            prompt_len=params.prompt_len, max_context_len=params.context_cap, stop_strings=tuple(out.get("stop_strings", ())),
            include_stop_str=bool(out.get("include_stop_str", False)), alignment=out.get("alignment", "token"),
            json_completion=out.get("structured", "none") == "json", **({"max_json_depth": int(out["max_json_depth"])} if "max_json_depth" in out else {}))
    except (DecodeSpecError, TypeError, ValueError, AttributeError) as exc:
        raise Rejection(TRACE_INVALID, f"the header's output object is not a stop configuration: {type(exc).__name__} "
                        f"{quote_content(str(exc))}", "$.output") from None
    declared = (bool(stated_stops), config.json_completion, bool(out.get("stream", params.stream)))
    if declared != (params.stop_strings, params.structured, params.stream):
        raise Rejection(TRACE_INVALID, f"output (stop strings, structured, stream) = {declared} disagrees with params "
                        f"{(params.stop_strings, params.structured, params.stream)}", "$.output")
    return config


def token_bytes_of(tokenizer: Any) -> Callable[[int], bytes]:
    """``token_bytes`` for :func:`validate_trace`: a tokenizer's bytes per id, ``b""`` for its special ids (EOS ...)."""
    special = frozenset(getattr(tokenizer, "special_ids", ()))
    return lambda token_id: b"" if token_id in special else tokenizer.token_bytes(token_id)


@attrs.define
class _Stream:
    """What the trace's ``stream`` events have published so far (trace-global, not per candidate)."""

    num_chunks: int | None = 0     # None: unknown (a resumed trace without the tokenizer's bytes)
    published: int | None = 0
    delivered_tokens: int | None = 0  # the last chunk's token_end
    text: str | None = ""
    failed: bool = False           # stream_error at a commit or as an interrupt
    closed: bool = False           # a finish event was seen
    restored_finished: bool = False


def _frontier(params: RequestParams, state: RequestState) -> dict[str, Any]:
    return {"prompt_len": params.prompt_len, "output_count": state.output_count, "pending": len(state.pending_ids),
            "processed": state.processed, "pending_tag": state.pending_tag.value}


#: Trace fields whose values are user content (token ids, text, stop strings): a reason shows them by
#: :func:`~decodespec.spec.errors.quote_content` (length and fingerprint), never raw (spec/errors.py, the message's
#: declared classification).
_CONTENT_FIELDS = frozenset({"token_id", "input_ids", "prompt_ids", "selected_id", "text", "output_ids", "pending_ids", "consumed",
                             "stop_strings", "identity", "text_redacted"})


def _is_content(field: str) -> bool:
    return any(part.split("[")[0] in _CONTENT_FIELDS for part in field.replace("$.", "").split("."))


def _shown(field: str, value: Any) -> str:
    """``value`` as a reason shows it: fingerprinted when ``field`` holds user content, else :func:`quote` (bounded)."""
    return quote_content(value) if _is_content(field) else quote(value)


def _differs(field: str, stated: Any, spec: Any) -> str | None:
    return None if stated == spec else f"field {field!r} is {_shown(field, stated)} but the spec says {_shown(field, spec)}"


def _first(*checks: str | None) -> str | None:
    return next((c for c in checks if c is not None), None)


Check = Callable[[RequestState, RequestState], "str | None"]


#: The checks of a trace that need the raw content (token bytes, text): not run on a redacted trace.
CONTENT_CHECKS = ("invariant.stop_triggers", "invariant.chunk_metadata (chunk text)", "invariant.stream_frontier",
                  "invariant.stream_no_stop_bytes", "invariant.stream_final (text)")


class _Surrogates:
    """Stand-in token ids for the digests of a redacted trace (M3.10 0x06, the trace passport).

    Every distinct digest gets a distinct id of the vocabulary, counted down from ``vocab_size - 1``
    and never one of the trace's clear ids (its EOS ids): the digests are keyed per trace, so equal
    ids are equal digests and every equality the spec checks (a commit's token is its decision's,
    a launch's inputs are the committed slice, a snapshot's ledger is the state's) holds exactly
    when it held for the real ids.  A plain id outside the clear ids is refused (``trace.schema``):
    the writer leaves only those in clear.
    """

    def __init__(self, passport: DataPassport, header: dict[str, Any]):
        params = header.get("params") if isinstance(header.get("params"), dict) else {}
        eos = params.get("eos_ids", ())
        eos_ids = frozenset(i for i in eos if isinstance(i, int)) if isinstance(eos, list) else frozenset()
        if frozenset(passport.clear_ids) != eos_ids:  # the writer leaves exactly the EOS ids in clear, no other id
            raise _Mismatch(f"the passport's clear_ids {sorted(passport.clear_ids)[:8]} are not the request's EOS ids "
                            f"{sorted(eos_ids)[:8]}", TRACE_SCHEMA)
        self.clear = eos_ids
        self.vocab_size = params.get("vocab_size") if isinstance(params.get("vocab_size"), int) else 0
        self.ids: dict[str, int] = {}
        self._next = self.vocab_size - 1

    def id(self, value: Any, where: str) -> Any:
        if is_token_digest(value):
            known = self.ids.get(value)
            if known is None:
                while self._next in self.clear:
                    self._next -= 1
                if self._next < 0:
                    raise _Mismatch(f"{where}: more distinct token digests than the vocabulary has ids", TRACE_MISMATCH)
                known = self.ids[value] = self._next
                self._next -= 1
            return known
        if isinstance(value, int) and not isinstance(value, bool) and value not in self.clear:
            raise _Mismatch(f"{where}: token id {quote_content(value)} is in clear in a redacted trace, which leaves only its clear ids "
                            f"{sorted(self.clear)} (the EOS ids) in clear", TRACE_SCHEMA)
        return value

    def ids_of(self, values: Any, where: str) -> Any:
        return [self.id(v, f"{where}[{i}]") for i, v in enumerate(values)] if isinstance(values, list) else values

    def apply(self, rec: dict[str, Any]) -> dict[str, Any]:
        """``rec`` with every token digest replaced by its stand-in id."""
        rec = dict(rec)
        event = rec.get("event")
        if event == "request":
            rec["prompt_ids"] = self.ids_of(rec.get("prompt_ids"), "$.prompt_ids")
        elif event == "call_launched":
            rec["input_ids"] = self.ids_of(rec.get("input_ids"), "$.input_ids")
        elif event in ("decision", "commit"):
            rec["token_id"] = self.id(rec.get("token_id"), "$.token_id")
            if isinstance(rec.get("receipt"), dict):
                rec["receipt"] = {**rec["receipt"], "selected_id": self.id(rec["receipt"].get("selected_id"), "$.receipt.selected_id")}
        elif event in ("snapshot", "restore") and isinstance(rec.get("state"), dict):
            state = dict(rec["state"])
            for key in ("output_ids", "pending_ids"):
                state[key] = self.ids_of(state.get(key), f"$.state.{key}")
            if isinstance(state.get("consumed"), list):
                state["consumed"] = [{**c, "token_id": self.id(c.get("token_id"), f"$.state.consumed[{i}].token_id")}
                                     if isinstance(c, dict) else c for i, c in enumerate(state["consumed"])]
            rec["state"] = state
        return rec


class _Replay:
    def __init__(self, header: dict[str, Any], machine: Machine, token_bytes: Callable[[int], bytes] | None = None,
                 passport: DataPassport | None = None):
        self.passport = passport or DataPassport(CONTENT)
        self.redacted = self.passport.classification == REDACTED
        self.params = params_from_header(header)
        self.prompt_ids = tuple(int(t) for t in header["prompt_ids"])
        self.machine = machine
        self.stop = stop_config_from_header(header, self.params, redacted=self.redacted)
        self.token_bytes = None if self.redacted else token_bytes
        #: The line as written (before stand-in ids), for the receipt's content hash.
        self.raw: dict[str, Any] | None = None
        if self.stop is None:
            self.stop = StopConfig(max_new_tokens=self.params.max_new_tokens, eos_ids=self.params.eos_ids,
                                   min_new_tokens=self.params.min_new_tokens, prompt_len=self.params.prompt_len,
                                   max_context_len=self.params.context_cap)
        self.stream = _Stream(text=None) if self.redacted else _Stream()
        self._bytes: dict[int, bytes] = {}
        self._memo: dict[tuple, Any] = {}
        #: receipt id -> the logprob its decision event recorded (a commit must carry the same value).
        self.decision_logprobs: dict[str, Any] = {}
        #: The model's layer count, as the trace's first ALL_NEW completion of a cached call states it.
        self.num_layers: int | None = None
        #: The header's policy, every receipt names it (:meth:`bind_policy`).
        self.policy: PolicyConfig | None = None
        #: The request's wall-clock budget (header ``timeout_ms``), ``None`` without one.
        self.timeout_ms: int | None = header.get("timeout_ms")
        #: The Philox key id the header's identity and seed derive (spec/policy/rng.py); a receipt's rng.key_id in clear
        #: must be it.  ``None`` in a redacted trace: its key ids are keyed digests, so the seed is not checked there.
        self.key_id: str | None = None if self.redacted else rng_key(self.params.identity, header["seed"]).key_id

    def bind_policy(self, policy: PolicyConfig) -> None:
        """Record the header policy every receipt must name (by :func:`~decodespec.spec.policy.receipt.policy_digest`)."""
        self.policy = policy

    def _policy_check(self, receipt: dict[str, Any]) -> str | None:
        mismatch = None if self.policy is None else receipt_policy_mismatch(receipt, self.policy)
        return None if mismatch is None else f"receipt.{mismatch[0]} {mismatch[1]}"

    # -- the stop oracle over committed ids --------------------------------------------------------
    def _token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        assert self.token_bytes is not None
        out = []
        for token in ids:
            b = self._bytes.get(token)
            if b is None:  # declared: the request's EOS ids never contribute text, like special tokens
                b = self._bytes[token] = b"" if token in self.params.eos_ids else bytes(self.token_bytes(int(token)))
            out.append(b)
        return out

    def _oracle(self, state: RequestState) -> int | AlignedOutput:
        """The stream frontier F of an open state, or the aligned output of a finished one (needs token bytes)."""
        finished = state.phase is Phase.FINISHED
        key = (state.output_ids, frozenset(state.triggers) if finished else None)
        if key not in self._memo:
            tb = self._token_bytes(state.output_ids)
            if not finished:
                self._memo[key] = stream_frontier(self.stop, tb)
            else:
                match = structured_end = None
                if state.output_ids:
                    _, match, structured_end = step_triggers(self.stop, state.output_ids, tb)
                triggers = frozenset(state.triggers)
                self._memo[key] = align_output(self.stop, state.output_ids, tb, None, triggers,
                                               match if FinishReason.STOP_STRING in triggers else None,
                                               structured_end if FinishReason.STRUCTURED in triggers else None)
        return self._memo[key]

    def stream_due(self, candidates: set[RequestState]) -> str | None:
        """``invariant.stream_frontier``: between commits exactly F bytes are published (checked before each non-stream line)."""
        st = self.stream
        if not self.params.stream or self.token_bytes is None or st.failed or st.published is None:
            return None
        for state in candidates:
            if state.phase is not Phase.FINISHED:
                front = self._oracle(state)
                if st.published != front:
                    return (f"with {state.output_count} committed outputs the stream has published {st.published} bytes, but the stream "
                            f"frontier (invariant.stream_frontier: min(decoder frontier, stop frontier)) is {front}")
        return None

    def accepted(self, rec: dict[str, Any], candidates: set[RequestState]) -> None:
        """Advance the trace-global stream bookkeeping after ``rec`` was matched."""
        st = self.stream
        event = rec.get("event")
        if event == "decision":
            self.decision_logprobs[str(rec["receipt_id"])] = rec["logprob"]
        elif event == "call_completed" and rec["selection"] == Selection.ALL_NEW.value and self.params.cache_family != "none":
            self.num_layers = self.num_layers or int(rec["layers_written"])
        if event == "stream":
            st.num_chunks = int(rec["chunk_idx"]) + 1
            st.published = int(rec["byte_end"])
            st.delivered_tokens = int(rec["token_end"])
            st.text = None if st.text is None or "text" not in rec else st.text + str(rec["text"])
        elif event == "commit" and rec.get("stream_failed") or event == "fault" and rec.get("kind") == "stream_error":
            st.failed = True
        elif event == "finish":
            st.closed = True
        elif event == "restore":
            state = next(iter(candidates))
            self.stream = st = _Stream(num_chunks=None, published=None, delivered_tokens=None, text=None)
            if state.phase is Phase.FINISHED:
                st.restored_finished = st.closed = True
            elif self.token_bytes is not None and self.params.stream:
                # What a conforming stream had published when the snapshot was taken.
                ref = reference_stream(self.stop, state.output_ids, self._token_bytes(state.output_ids))
                st.num_chunks, st.published = len(ref.chunks), ref.chunks[-1].byte_end if ref.chunks else 0
                st.delivered_tokens = ref.chunks[-1].token_end if ref.chunks else 0
                st.text = "".join(c.text for c in ref.chunks)

    # -- event -> [(action or None, check)] ------------------------------------------------------
    def candidates(self, rec: dict[str, Any], state: RequestState) -> list[tuple[Action | None, Check]]:
        event = rec.get("event")
        handler = getattr(self, f"_on_{event}", None)
        if handler is None:
            raise _Mismatch(f"unknown event {quote(event)}")
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
                self._layers_check(rec, last.selection),
            )

        return [(action, check)]

    def _layers_check(self, rec: dict[str, Any], selection: Selection) -> str | None:
        """``layers_written`` agrees with the selection (M3.10 0x04: ALL_NEW publishes every layer's rows of the call).

        No cache: nothing is written (0).  A cached call selected ALL_NEW wrote every layer: at least one, and the
        same count in every ALL_NEW completion of the trace (the model's depth, stated by the first one); an ALL_OLD
        completion (a failed call, rolled back) wrote at most that many.
        """
        written = rec["layers_written"]
        if self.params.cache_family == "none":
            return None if written == 0 else f"field 'layers_written' is {written} but a request without a cache writes no layer"
        if selection is Selection.ALL_NEW:
            if written < 1:
                return (f"field 'layers_written' is {written} beside an ALL_NEW selection: ALL_NEW means every layer's K/V rows "
                        "of the call were written (M3.10 0x04)")
            if self.num_layers is not None and written != self.num_layers:
                return (f"field 'layers_written' is {written} beside an ALL_NEW selection, but the trace's first ALL_NEW call "
                        f"wrote {self.num_layers} layers (the model's depth: ALL_NEW writes every layer)")
        elif self.num_layers is not None and written > self.num_layers:
            return f"field 'layers_written' is {written}, more than the model's {self.num_layers} layers"
        return None

    def _on_empty_support(self, rec, state):
        """``SupportEmpty(score_id)``: the policy found no legal token; the spec finishes with constraint_error."""
        action = SupportEmpty(str(rec["score_id"]))

        def check(before, after):
            return _differs("rng_counter", rec["rng_counter"], before.rng_counter)

        return [(action, check)]

    def _on_decision(self, rec, state):
        self._receipt_check(rec)
        action = Decide(rec["score_id"], int(rec["token_id"]), int(rec["draws"]))

        def check(before, after):
            logprob = rec.get("logprob")
            if not _finite_logprob(logprob):
                return f"field 'logprob' is {quote(logprob)}: a decision records a finite natural-log probability <= 0"
            return _first(
                _differs("receipt_id", rec["receipt_id"], after.receipt.receipt_id),
                _differs("rng_counter_before", rec["rng_counter_before"], before.rng_counter),
                _differs("rng_counter_after", rec.get("rng_counter_after"), before.rng_counter + int(rec["draws"])),
                _differs("receipt.step", rec["receipt"]["step"], before.output_count),
            )

        return [(action, check)]

    def _receipt_check(self, rec: dict[str, Any]) -> None:
        """The embedded M3.8 receipt is this decision's: bound to the event's fields and intact.

        (Its ``step`` is checked per candidate state, against O, with the other fields.)

        Raises:
            _Mismatch: with code ``trace.receipt`` on the first disagreement (independent of the
                candidate state: no candidate could make a tampered receipt right).
        """
        receipt = rec["receipt"]
        rng = receipt["rng"]
        why = _first(
            _differs("receipt.selected_id", receipt["selected_id"], rec["token_id"]),
            _differs("receipt.score_id", receipt["score_id"], rec["score_id"]),
            _differs("receipt.draws", receipt["draws"], rec["draws"]),
            _differs("receipt.raw_logprob", receipt["raw_logprob"], rec["logprob"]),
            _differs("receipt.rng.counter_before", rng["counter_before"], rec["rng_counter_before"]),
            _differs("receipt.rng.counter_after", rng["counter_after"], rec["rng_counter_after"]),
            _differs("receipt.state_before.rng_counter", receipt["state_before"]["rng_counter"], rec["rng_counter_before"]),
            _differs("receipt.state_after.rng_counter", receipt["state_after"]["rng_counter"], rec["rng_counter_after"]),
            _differs("len(receipt.rng.addresses)", len(rng["addresses"]), rec["draws"]),
            _differs("receipt.vocab_size", receipt["vocab_size"], self.params.vocab_size),
            None if self.key_id is None or rng.get("key_id") in (None, self.key_id) else (
                f"field 'receipt.rng.key_id' is {quote(rng['key_id'])} but the header's identity and seed derive the Philox key "
                f"{self.key_id} (spec/policy/rng.py rng_key)"),
            self._policy_check(receipt),
        )
        if why is None:
            written = (self.raw or rec)["receipt"]  # a redacted receipt's hash is over its digests, as written
            body = {k: v for k, v in written.items() if k != "receipt_id"}
            digest = content_id(body)
            if digest != receipt["receipt_id"]:
                why = (f"the receipt's content hash is {digest} but its receipt_id says {receipt['receipt_id']}: "
                       "the receipt body was altered after it was issued")
        if why is not None:
            raise _Mismatch(f"the decision's receipt is not this decision's: {why}", TRACE_RECEIPT)

    def _on_commit(self, rec, state):
        triggers = [FinishReason(t) for t in rec["triggers"]]
        stream_failed = rec.get("stream_failed", False)
        if not isinstance(stream_failed, bool):
            raise _Mismatch(f"field 'stream_failed' is {quote(stream_failed)}, expected a bool")
        action = Commit(rec["receipt_id"], frozenset(triggers) & TEXT_TRIGGERS, stream_failed)

        def check(before, after):
            logprob = rec.get("logprob")
            if not _finite_logprob(logprob):
                return f"field 'logprob' is {quote(logprob)}: a committed token carries its finite logprob <= 0"
            fired = after.triggers - before.triggers
            decided = self.decision_logprobs.get(str(rec["receipt_id"]), logprob)  # unknown: decided before a restore
            return _first(
                _differs("token_id", rec["token_id"], before.receipt.token_id),
                None if logprob == decided else (f"field 'logprob' is {quote(logprob)} but the decision of {quote(rec['receipt_id'])} recorded "
                                                 f"{quote(decided)}: a commit carries its decision's logprob (M3.8 0x0B receipt)"),
                _differs("output_count", rec["output_count"], after.output_count),
                _differs("pending_tag", rec["pending_tag"], after.pending_tag.value),
                _differs("triggers", [t.value for t in triggers], [t.value for t in FINISH_PRECEDENCE if t in fired]),
                self._text_triggers_check(after, frozenset(triggers) & TEXT_TRIGGERS),
            )

        return [(action, check)]

    def _text_triggers_check(self, after: RequestState, stated: frozenset[FinishReason]) -> str | None:
        """invariant.stop_triggers: the commit's text triggers are the stop oracle's for the committed bytes."""
        if self.token_bytes is None:
            return None
        fired, _, _ = step_triggers(self.stop, after.output_ids, self._token_bytes(after.output_ids))
        oracle = fired & TEXT_TRIGGERS
        if stated != oracle:
            return (f"the commit reports text triggers {[t.value for t in FINISH_PRECEDENCE if t in stated]} but the stop oracle "
                    f"(invariant.stop_triggers) gives {[t.value for t in FINISH_PRECEDENCE if t in oracle]} for the committed bytes")
        return None

    def _on_cancel(self, rec, state):
        action = Cancel(FinishReason(rec["kind"]))
        why = self._budget_check(rec) if rec.get("source") == "budget" else None
        return [(action, lambda before, after: why or _differs("at", rec["at"], getattr(interrupt_point(before), "value", None)))]

    def _budget_check(self, rec) -> str | None:
        """A timeout the request's own budget fired: a budget is declared, it is spent, and it fired at a call boundary.

        The spec cannot predict wall time, so it accepts the budget's ``timeout`` wherever its
        ``Cancel(timeout)`` is enabled; what the trace can be held to is the runtime's declared
        contract (:class:`decodespec.impl.runtime.RequestRunner`): only with a header
        ``timeout_ms``, only once ``elapsed_ms >= timeout_ms``, only before a launch (no call is
        interrupted, so no committed token is lost: the finish frontier is then the spec's).
        """
        if self.timeout_ms is None:
            return "a cancel with source 'budget' but the request header declares no wall-clock budget (timeout_ms)"
        if rec["kind"] != FinishReason.TIMEOUT.value:
            return f"the wall-clock budget finishes 'timeout', not {quote(rec['kind'])}"
        if rec["at"] != "before_launch":
            return f"the wall-clock budget fires at a call boundary (before_launch), not {quote(rec['at'])}"
        if rec["elapsed_ms"] < self.timeout_ms:
            return f"the budget fired after {rec['elapsed_ms']} ms, before its {self.timeout_ms} ms were spent"
        return None

    def _on_recover(self, rec, state):
        return [(Recover(), lambda b, a: _first(_differs("generation", rec["generation"], a.generation),
                                                 _differs("processed", rec["processed"], a.processed)))]

    def _on_snapshot(self, rec, state):
        stated = SnapshotRecord.from_json(rec["state"]).to_json()  # snapshot.malformed for a mistyped or missing field

        def check(before, after):
            why = _differs("frontier", rec["frontier"], _frontier(self.params, after))
            if why is not None:
                return why
            spec = take_snapshot(self.params, before, rec["form"]).to_json()
            return next((f"field 'state.{key}' is {_shown('state.' + key, stated[key])} but the spec's snapshot of this state says "
                         f"{_shown('state.' + key, spec[key])}"
                         for key in spec if stated[key] != spec[key]), None)

        return [(Snapshot(rec["form"]), check)]

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
                self._final_stream_check(rec, before),
            )

        return [(None, check)]

    def _final_stream_check(self, rec: dict[str, Any], state: RequestState) -> str | None:
        """invariant.stream_final / invariant.stream_no_stop_bytes at ``finish`` (and the stream report's agreement)."""
        st = self.stream
        report = rec.get("stream")
        if report is not None and not self.params.stream:
            return "the finish event carries a stream report but the request does not stream"
        if not self.params.stream or st.restored_finished:
            return None
        if report is None:
            if st.num_chunks == 0:
                # impl.runtime.RequestRunner.stream_report: an observer that keeps no stream (no
                # tokenizer, a custom observer) publishes no chunk and writes no report.
                return None
            return ("the finish event of a streamed request carries no stream report (chunks, delivered bytes and tokens, "
                    "failure): the report is how the finish states what the stream delivered")
        failed = st.failed or FinishReason.STREAM_ERROR in state.triggers
        claims_failure = isinstance(report, dict) and report.get("failed") is True
        if report is not None:
            if not isinstance(report, dict):
                return f"field 'stream' is {quote(report)}, expected the stream report object"
            why = _first(_differs("stream.chunks", report.get("chunks"), st.num_chunks) if st.num_chunks is not None else None,
                         _differs("stream.delivered_bytes", report.get("delivered_bytes"), st.published) if st.published is not None else None,
                         _differs("stream.delivered_tokens", report.get("delivered_tokens"), st.delivered_tokens)
                         if st.delivered_tokens is not None else None)
            if why is not None:
                return why
            if report.get("error") is not None and not claims_failure:
                return "the stream report names a consumer error but says the stream did not fail (an error fails the delivery)"
            if failed and not claims_failure:
                return "the stream failed (stream_error) but the finish event's stream report says it did not"
            if claims_failure and not failed and state.finish_reason not in (FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.DEVICE_ERROR):
                return (f"the stream report claims a failed delivery without stream_error; only the flush of an external close "
                        f"(cancelled / timeout / device_error) may fail that way, not a {state.finish_reason.value} finish")
        if self.token_bytes is None or st.published is None:
            return None
        out = self._oracle(state)
        assert isinstance(out, AlignedOutput)
        match = out.stop_match
        if match is not None and not self.stop.include_stop_str and st.published > match.start:
            return (f"the stream published bytes up to {st.published}, past the start {match.start} of the excluded stop string "
                    "(invariant.stream_no_stop_bytes)")
        if failed or claims_failure:
            if st.published > out.visible_end:
                return f"the stream published {st.published} bytes, more than the returned text's {out.visible_end}"
            return None
        if st.published != out.visible_end or (st.text is not None and st.text != out.text):
            return (f"the stream published {st.published} bytes {quote_content(st.text)}, but the returned text is {out.visible_end} "
                    f"bytes {quote_content(out.text)} (invariant.stream_final: the concatenated stream equals the final text)")
        return None

    def _on_stream(self, rec, state):
        def check(before, after):
            return self._chunk_check(rec, before)

        return [(None, check)]

    def _chunk_check(self, rec: dict[str, Any], state: RequestState) -> str | None:
        """invariant.stream_prefix, invariant.chunk_metadata and the stream horizon for one ``stream`` event."""
        st = self.stream
        if not self.params.stream:
            return "a stream event but the request does not stream (params.stream is false)"
        if st.failed:
            return "a stream event after the stream failed (stream_error): nothing more is published"
        if st.closed:
            return "a stream event after the finish event: the output is closed and fully published"
        fields = {}
        for name in ("chunk_idx", "byte_start", "byte_end", "token_start", "token_end"):
            value = rec[name]
            if isinstance(value, bool) or not isinstance(value, int):
                return f"field {name!r} is {quote(value)}, expected an int"
            fields[name] = value
        if self.redacted:
            if "text" in rec:
                return "a redacted trace's stream event carries its text (a redacted chunk has text_redacted only)"
            size = rec["text_redacted"]["bytes"]
            if size != fields["byte_end"] - fields["byte_start"]:
                return (f"field 'text_redacted.bytes' is {size} but the chunk [{fields['byte_start']}, {fields['byte_end']}) "
                        f"has {fields['byte_end'] - fields['byte_start']} bytes")
        elif "text" not in rec:
            return "a stream event without its text in a trace that is not redacted (its header's data says content)"
        elif not isinstance(rec["text"], str):
            return f"field 'text' is {quote_content(rec['text'])}, expected a str"
        idx, start, end = fields["chunk_idx"], fields["byte_start"], fields["byte_end"]
        if st.num_chunks is not None and idx != st.num_chunks:
            return f"field 'chunk_idx' is {idx}, expected {st.num_chunks} (chunks are numbered consecutively from 0)"
        if st.published is not None and start != st.published:
            return (f"field 'byte_start' is {start} but {st.published} bytes are published: chunks are contiguous and published "
                    "bytes are never retracted (invariant.stream_prefix)")
        if end <= start:
            return f"the chunk [{start}, {end}) is empty or reversed"
        if not fields["token_start"] < fields["token_end"]:
            return f"the chunk's token range [{fields['token_start']}, {fields['token_end']}) is empty or reversed"
        if st.delivered_tokens is not None and not (fields["token_start"] >= st.delivered_tokens - 1 and fields["token_end"] >= st.delivered_tokens):
            return (f"the chunk's token range [{fields['token_start']}, {fields['token_end']}) does not continue the previous chunk's, "
                    f"which ended at token {st.delivered_tokens} (a chunk starts in the token where the last one ended or after it)")
        if fields["token_end"] > state.output_count:
            return (f"the chunk covers tokens up to {fields['token_end']} but only {state.output_count} are committed: "
                    "text is never published before its tokens are committed")
        if self.token_bytes is None:
            return None
        tb = self._token_bytes(state.output_ids)
        data = b"".join(tb)
        horizon = self._oracle(state)
        limit = horizon.visible_end if isinstance(horizon, AlignedOutput) else horizon
        if end > limit:
            what = "the returned text's visible end" if isinstance(horizon, AlignedOutput) else "the stream horizon (held-back stop / UTF-8 bytes)"
            return f"the chunk ends at byte {end}, beyond {what} {limit}: {quote_content(data[limit:end])} may not be published"
        expected = make_chunk(idx, data, token_ends(tb), start, end)
        return _first(
            _differs("text", rec["text"], expected.text),
            _differs("token_start", fields["token_start"], expected.token_start),
            _differs("token_end", fields["token_end"], expected.token_end),
        )

    def _on_beam_step(self, rec, state):
        raise _Mismatch("beam_step events belong to the beam machine, not the single-path request machine")


class _Mismatch(Exception):
    """A line no candidate matches: ``args[0]`` the reason, :attr:`code` the registered refusal code."""

    def __init__(self, reason: str, code: str = TRACE_MISMATCH):
        super().__init__(reason)
        self.code = code


@lru_cache(maxsize=1)
def _events_validators() -> dict[str | None, Any]:
    """The whole schema's validator (key ``None``) and one per event (its ``$defs/event_<name>`` alone: faster, same verdict), each with its fast acceptance."""
    schema = json.loads(EVENTS_SCHEMA_PATH.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    defs = schema["$defs"]
    per_event: dict[str | None, Any] = {}
    for name in schema["properties"]["event"]["enum"]:
        one = {"$defs": defs, "$ref": f"#/$defs/event_{name}"}
        per_event[name] = (cls(one), FastAccept(one))
    per_event[None] = (cls(schema), FastAccept(schema))
    return per_event


def _finite_logprob(value: Any) -> bool:
    """Whether ``value`` is a finite JSON number <= 1e-6 (a logprob; an integer too large for a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value <= 1e-6
    except OverflowError:
        return False


def schema_error(rec: Any) -> str | None:
    """Why ``rec`` (one parsed trace line) does not match ``spec/schemas/events.v1.json``, or ``None``.

    The reason names the JSON path of the offending value (``$.receipt.rng``) and the schema's
    message (an unexpected field, a missing one, a wrong type or constant).  Among several errors
    the deepest, then first by path, is reported, so the message is stable.
    """
    validators = _events_validators()
    event = rec.get("event") if isinstance(rec, dict) else None
    validator, accepts = validators.get(event if isinstance(event, str) else None, validators[None])
    if accepts(rec):  # the Rust validator's acceptance (checks/modelcheck/fastschema.py); a refusal is the Python validator's
        return None
    errors = list(validator.iter_errors(rec))
    if not errors:
        return None
    leaves = [e for e in errors if not e.context] or errors
    err = min(leaves, key=lambda e: (-len(e.absolute_path), [str(p) for p in e.absolute_path], e.message))
    message = (f"{quote_content(err.instance)} fails the schema's {err.validator!r}" if _is_content(err.json_path) else err.message)
    return f"line does not match spec/schemas/events.v1.json at {err.json_path}: {message}"


def _parse(index: int, raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        rec = raw
    else:
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _Mismatch(f"not a JSON object: {exc}", TRACE_SCHEMA) from None
        except RecursionError:
            raise _Mismatch("not a JSON object this reader accepts: nested deeper than its recursion limit", TRACE_SCHEMA) from None
    if not isinstance(rec, dict):
        raise _Mismatch("not a JSON object", TRACE_SCHEMA)
    if rec.get("v") != 1:
        raise _Mismatch(f"field 'v' is {quote(rec.get('v'))}, expected 1", TRACE_SCHEMA)
    if rec.get("seq") != index:
        raise _Mismatch(f"field 'seq' is {quote(rec.get('seq'))}, expected {index} (consecutive from 0)", TRACE_SCHEMA)
    return rec


def unsupported_trace(header: str | dict[str, Any]) -> str | None:
    """Why the trace whose first line is ``header`` cannot be validated, or ``None``.

    A beam-search header (written by :class:`decodespec.impl.beam.BeamRunner`: a ``beam`` object,
    the ``BeamParams`` JSON, instead of ``params``, or a ``policy`` of family ``beam``) is
    unsupported: its ``beam_step`` events record each step's parents, tokens and scores but not the
    ``[n, V]`` score rows the spec's ``transition.beam_step`` selects from, so no spec state can be
    replayed from it.  Anything else (even a malformed header) is left to :func:`validate_trace`.
    """
    try:
        rec = json.loads(header) if isinstance(header, str) else header
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(rec, dict) or rec.get("event") != "request":
        return None
    policy = rec.get("policy")
    if "beam" in rec or (isinstance(policy, dict) and policy.get("family") == "beam"):
        return ("a beam-search trace (transition.beam_step) cannot be validated: its beam_step events do not record the "
                "score rows the spec's beam procedure selects from; trace validation replays single-path request traces "
                "(decodespec generate without --num-beams)")
    return None


def validate_trace(lines: Iterable[str | dict[str, Any]], *, machine: Machine = MACHINE,
                   token_bytes: Callable[[int], bytes] | None = None) -> TraceVerdict:
    """Accept or reject an event trace against the spec (see the module docstring).

    Args:
        lines: The trace's lines (JSON text, or already-parsed dicts), in order.
        machine: The transition table to replay against (tests plug in broken ones).
        token_bytes: The bytes each output id contributes to the text (``b""`` for special ids;
            :func:`token_bytes_of` builds it from a tokenizer).  Enables the stop-oracle and
            stream-content checks; without it only the stream's structure is checked.

    Returns:
        The :class:`TraceVerdict`; never raises for a bad trace.

    Raises:
        Rejection: ``trace.unsupported`` for a beam-search trace (see :func:`unsupported_trace`),
            before any line is judged.
    """
    items = list(lines)
    unsupported = unsupported_trace(items[0]) if items else None
    if unsupported is not None:
        raise Rejection(TRACE_UNSUPPORTED, unsupported, "$[0]", details={"feature": "beam"})
    replay: _Replay | None = None
    passport: DataPassport | None = None
    surrogates: _Surrogates | None = None
    candidates: set[RequestState] = set()
    last_event = None
    reported = False  # a finish event (or the restore of a finished snapshot) followed the last state change
    for index, raw in enumerate(items):
        rec: dict[str, Any] = {}
        try:
            rec = _parse(index, raw)
            event = rec.get("event")
            why = schema_error(rec)
            if why is not None:
                raise _Mismatch(why, TRACE_SCHEMA)
            raw_rec = rec
            if index == 0:
                if event != "request":
                    raise _Mismatch(f"the first event must be 'request', got {quote(event)}")
                # Every trace declares its classification (M3.10 0x06): a header without ``data`` is
                # refused, since a content trace keeps raw content only on the recorded opt-in.
                passport = passport_from_json(rec.get("data"), "$.data")
                if passport.classification == CONTENT and not passport.opt_in:
                    # A trace keeps raw content only on the user's opt-in, which the writer records
                    # (M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data"); only a
                    # snapshot is content without one (it must keep the ids to resume).
                    raise _Mismatch("a content trace must record the user's opt-in: data.opt_in is false", DATA_UNKNOWN_CLASSIFICATION)
                if passport.classification == REDACTED:
                    surrogates = _Surrogates(passport, rec)
                    rec = surrogates.apply(rec)
                replay = _Replay(rec, machine, token_bytes, passport)
                replay.bind_policy(policy_config_from_json(rec["policy"]))  # Rejection (policy.*) for a policy the runtime could not have run
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
            if surrogates is not None:
                rec = surrogates.apply(rec)
            replay.raw = raw_rec
            if event != "stream":
                due = replay.stream_due(candidates)
                if due is not None:
                    raise _Mismatch(due)
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
            replay.accepted(rec, candidates)
            last_event = event
            if event == "finish" or (event == "restore" and replay.stream.restored_finished):
                reported = True
            elif event not in _OBSERVATIONS:
                reported = False
        except (_Mismatch, DecodeSpecError, KeyError, TypeError, ValueError, AttributeError) as exc:
            reason = exc.args[0] if isinstance(exc, _Mismatch) else (
                exc.message if isinstance(exc, DecodeSpecError) else f"malformed event: {type(exc).__name__}: {quote(str(exc))}")
            code = exc.code if isinstance(exc, (_Mismatch, DecodeSpecError)) else TRACE_SCHEMA
            if isinstance(exc, DecodeSpecError) and not code.startswith("trace.") and code != DATA_UNKNOWN_CLASSIFICATION:
                reason, code = f"{code}: {reason}", TRACE_MISMATCH  # e.g. policy.* / snapshot.* from a field's parser
            if index == 0 and code == TRACE_MISMATCH:
                code = TRACE_INVALID
            return TraceVerdict(False, len(items), index, index + 1, rec.get("seq"), rec.get("event"), reason,
                                len(candidates), _phase(candidates), code, *_passport_fields(passport))
    if replay is None:
        return TraceVerdict(False, 0, 0, 1, None, None, "empty trace: no request header", 0, None, TRACE_INCOMPLETE)
    terminal = any(is_terminal(replay.params, s) for s in candidates)
    if last_event != "snapshot" and not (terminal and reported):
        why = (f"the request is terminal (phase {_phase(candidates)}) but the trace ends without the finish event that reports it"
               if terminal else f"the trace ends before the request is terminal (phase {_phase(candidates)}) and not after a snapshot")
        return TraceVerdict(False, len(items), len(items), len(items) + 1, None, None, why,
                            len(candidates), _phase(candidates), TRACE_INCOMPLETE, *_passport_fields(passport))
    cls, needs = _passport_fields(passport)
    return TraceVerdict(True, len(items), len(items), num_candidates=len(candidates), final_phase=_phase(candidates),
                        classification=cls, needs_content=needs)


def _passport_fields(passport: DataPassport | None) -> tuple[str | None, dict[str, Any] | None]:
    """``(classification, needs_content)`` of a verdict (``trace.redacted`` lists the checks a redacted trace skips)."""
    if passport is None:
        return None, None
    if passport.classification != REDACTED:
        return passport.classification, None
    return passport.classification, {
        "code": TRACE_REDACTED, "checks": list(CONTENT_CHECKS),
        "message": "the trace is redacted: these checks need the token bytes and text it replaced by digests and were not run; "
                   "every other check (frontiers, phases, receipts, commit against decision, stream byte counts) ran on "
                   "the digests. Re-record with decodespec generate --trace-content to run them."}


def _phase(states: set[RequestState]) -> str | None:
    phases = {s.phase.value for s in states}
    if not phases:
        return None
    return phases.pop() if len(phases) == 1 else "mixed"
