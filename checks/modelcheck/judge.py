"""The rows-in oracle: judge a recorded run of any runtime -- request, score rows, decisions, frontiers -- without the gate's driver.

A runtime records one single-path request as ``decodespec.rows.v1`` JSON lines (published
schema :data:`ROWS_SCHEMA_PATH`, ``spec/schemas/rows.v1.json``; no M3.8 receipts):

=============== ===========================================================================
line            fields (``frontier`` and ``phase`` optional on every line after the header)
=============== ===========================================================================
``request``     ``format`` = ``decodespec.rows.v1``, ``request`` (the ``numinens.request.v1``
                envelope), optional ``runtime`` ``{name, model, dtype, vocab_hash}``
``call``        ``kind`` (prefill / decode / repair), ``start``, ``length``: one model call,
                launched and completed
``token``       ``row`` (the raw score row ``[V]`` the decision read), ``token_id``, ``logprob``,
                optional ``draws`` and ``triggers``: one decision and its commit
``empty_support`` ``row``: the policy found no legal token (finish ``constraint_error``)
``finish``      ``finish_reason``, optional ``triggers`` and ``output_ids``: the last line
=============== ===========================================================================

:func:`judge_rows` admits the envelope (:func:`decodespec.spec.envelope.validate_request_envelope`,
:func:`decodespec.spec.state.params_from_request`), then drives the spec request machine
(:data:`decodespec.spec.transitions.MACHINE`) with the observed actions -- a ``call`` is
``Launch`` + the all-new ``Complete`` (:func:`~decodespec.spec.transitions.expected_report`),
a ``token`` is ``Decide`` + ``Commit``, ``empty_support`` is ``SupportEmpty`` -- and judges each
line in ladder order (:mod:`decodespec.checks.gate.ladder`), stopping at the first broken rule:

* **STATE**: the runtime's ordered vocabulary hash, when the header states one
  (``runtime.vocab_hash``), is the model's (``vocab_hash=``; M3.8 0x08,
  ``invariant.vocab_ordered_identity``; check ``vocab.hash``, judged before any line); the action is enabled (a guard that fails names itself: a call at the wrong start, a
  decode after the output closed, a token without a scored call), and every stated ``frontier``
  field, ``phase`` and the finish's ``output_ids`` equal the spec state's after the line; a
  recording that ends before the request is terminal.
* **TENSOR**: the row has ``V`` entries; with a reference (``--reference``: the float64 no-cache
  forward :class:`~decodespec.checks.gate.reference.Reference64` of the tiny model or SmolLM2) the row is
  within the declared epsilon of the reference row of the same committed prefix.
* **POLICY**: the stated ``draws`` equal the spec policy's.
* **DECISION**: the selected id is the spec policy's (:func:`decodespec.spec.policy.decide`) on
  the observed row, by the seed's margin rule under the declared
  :class:`~decodespec.checks.gate.tolerance.Tolerance` (:func:`decodespec.checks.gate.lockstep.judge_decision`:
  greedy, a differing id fails unless the processed gap is at most 2 epsilon, then ``undecided``;
  sampled, the replayed draw of the request's RNG key, an id outside the processed support
  fails); the logprob is ``log_softmax(row)[token_id]`` within the tolerance's logprob bound; an
  ``empty_support`` line where the policy finds a legal token.
* **SEQUENCE**: the stated ``triggers`` of a commit and of the finish, and the ``finish_reason``,
  equal the spec's; a terminal request without its ``finish`` line.

Text triggers (stop strings, structured completion) need the token bytes: the tokenizer of the
header's model (tiny, SmolLM2) or ``token_bytes``; a request that declares them without one is
refused (``judge.unsupported``), as are beam requests and non-decoder-only architectures.
Interrupts, faults, snapshots and streams are the event trace's (``decodespec validate-trace``).

A bad file is a typed error before any judgement (:class:`~decodespec.spec.errors.Rejection` /
:class:`~decodespec.spec.errors.ResourceLimit`, codes ``judge.*`` registered below, or the
envelope's own ``envelope.*`` / ``policy.*`` code), with the JSON path of the offending value
in the file (``$[3].row[5]``: line 4, the row's sixth entry); reading is bounded
(:data:`MAX_LINE_BYTES`, :data:`MAX_LINES`).

Source: M3.10 "A logit tolerance is not a token-equality proof", "Correctness matrix", "One
request as a transition system"; M3.8 0x0B; issue 22 item 5 (the rows-in oracle).

Size: one file format and its judgement: the rows.v1 parser with its bounded, typed refusals, the
line-by-line judge over the composed request, and the recorder of our runtime.
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
import numpy as np

from decodespec.checks.modelcheck.fastschema import FastAccept
from decodespec.spec import request_machine as rm
from decodespec.spec.actions import Action, Admit, Commit, Decide, Launch, SupportEmpty, action_label
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason
from decodespec.spec.envelope import AdmittedRequest, validate_request_envelope
from decodespec.spec.errors import DecodeSpecError, Rejection, ResourceLimit, quote, register_code
from decodespec.spec.policy.scores import log_softmax
from decodespec.spec.request_machine import request_from_envelope
from decodespec.spec.state import Phase, RequestState, is_terminal
from decodespec.spec.transitions import MACHINE, Machine, expected_report

from ..gate.ladder import FAILED, PASSED, UNDECIDED, Verdict, score_row_failure
from ..gate.lockstep import judge_decision
from ..gate.tolerance import Tolerance
from .trace_validation import _frontier

__all__ = [
    "FORMAT",
    "JUDGE_SCHEMA",
    "JUDGE_TOO_LARGE",
    "JUDGE_UNREADABLE",
    "JUDGE_UNSUPPORTED",
    "MAX_LINES",
    "MAX_LINE_BYTES",
    "ROWS_SCHEMA_PATH",
    "Judgement",
    "judge_rows",
    "parse_line",
    "read_rows",
    "record_rows",
    "write_rows",
]

_S = "issue 22 item 5 (the rows-in oracle); spec/schemas/rows.v1.json; docs/adapters.md"

JUDGE_UNREADABLE = register_code(
    "judge.unreadable", "rejection", _S,
    "The rows file cannot be read (missing, a directory, not UTF-8) or is empty; nothing was judged.")
JUDGE_SCHEMA = register_code(
    "judge.schema", "rejection", _S,
    "A line of the rows file is not one JSON object of spec/schemas/rows.v1.json (bad JSON, a NaN or Infinity literal, "
    "a duplicate key, an unknown event or field, a missing or mistyped one), the first line is not the request header, "
    "a second header, or a line after the finish line; the path names the line and the value ($[3].row[5]).")
JUDGE_TOO_LARGE = register_code(
    "judge.too_large", "resource_limit", _S,
    "A line of the rows file is longer than MAX_LINE_BYTES, or the file has more than MAX_LINES lines.")
JUDGE_UNSUPPORTED = register_code(
    "judge.unsupported", "rejection", _S,
    "The recorded request is of a kind the rows-in oracle does not judge: a beam policy, an architecture other than "
    "decoder_only, or stop strings / structured completion without the token bytes of the model (no known tokenizer).")
JUDGE_NO_TOLERANCE = register_code(
    "judge.no_tolerance", "rejection", _S,
    "No declared tolerance for the recording's (runtime, model, dtype) and none given (--epsilon): the margin rule "
    "cannot be applied without one.")

#: The header's ``format``.
FORMAT = "decodespec.rows.v1"
#: The published JSON Schema of one line (Draft 2020-12).
ROWS_SCHEMA_PATH = Path(__file__).resolve().parents[2] / "spec" / "schemas" / "rows.v1.json"
#: Longest line read (a row of 4M vocabulary entries at ~16 characters each).
MAX_LINE_BYTES = 64 * 1024 * 1024
#: Most lines read: a header, a finish and, per output token, a call and a token line (G <= 65536).
MAX_LINES = 3 * 65_536 + 8


@attrs.frozen
class Judgement:
    """The outcome of :func:`judge_rows`.

    Attributes:
        verdict: The first failed rule (:class:`~decodespec.checks.gate.ladder.Verdict`: ``layer``,
            ``rule`` ``ladder.<LAYER>``, ``check``, expected / actual, ``message``; ``step`` the
            0-based line index), else the first undecided one, else ``passed``.
        line: 1-based line of that verdict (``num_lines + 1``: found at the end), ``None`` when passed.
        event: That line's event.
        output_index: O when the line was judged (the decision's output index for a token line).
        num_lines: Lines read.
        num_tokens: Token lines judged before the verdict (all of them when passed).
        identity: The envelope's identity.
    """

    verdict: Verdict
    line: int | None
    event: str | None
    output_index: int | None
    num_lines: int
    num_tokens: int
    identity: str | None = None

    @property
    def conforming(self) -> bool:
        """No rule is broken (passed or undecided)."""
        return self.verdict.result != FAILED

    def to_json(self) -> dict[str, Any]:
        """The judgement as one JSON object (the CLI's output)."""
        return {"result": self.verdict.result, "layer": self.verdict.layer, "rule": self.verdict.rule, "check": self.verdict.check,
                "line": self.line, "event": self.event, "output_index": self.output_index, "message": self.verdict.message,
                "expected": self.verdict.to_json()["expected"], "actual": self.verdict.to_json()["actual"],
                **({"probe": self.verdict.to_json()["probe"]} if self.verdict.probe is not None else {}),
                "num_lines": self.num_lines, "num_tokens": self.num_tokens, "identity": self.identity}


# --------------------------------------------------------------------------------------------
# Reading and the schema.
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _validators() -> dict[str | None, tuple[Any, FastAccept]]:
    """One validator per event (its ``$defs/event_<name>`` alone) and the whole schema's (key ``None``)."""
    schema = json.loads(ROWS_SCHEMA_PATH.read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    out: dict[str | None, tuple[Any, FastAccept]] = {}
    for name in schema["properties"]["event"]["enum"]:
        one = {"$defs": schema["$defs"], "$ref": f"#/$defs/event_{name}"}
        out[name] = (cls(one), FastAccept(one))
    out[None] = (cls(schema), FastAccept(schema))
    return out


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {quote(key)}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {quote(text)} overflows to infinity")
    return value


def parse_line(index: int, raw: str | dict[str, Any]) -> dict[str, Any]:
    """One line as a schema-valid object.

    Raises:
        Rejection: ``judge.schema`` with the path ``$[index]...`` of the offending value.
    """
    where = f"$[{index}]"
    if isinstance(raw, dict):
        rec: Any = raw
    else:
        try:
            rec = json.loads(raw, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant,
                             parse_float=_finite_float)
        except (ValueError, RecursionError) as exc:
            raise Rejection(JUDGE_SCHEMA, f"line {index + 1} is not one JSON object: {exc}", where) from None
    if not isinstance(rec, dict):
        raise Rejection(JUDGE_SCHEMA, f"line {index + 1} is not a JSON object", where)
    validators = _validators()
    event = rec.get("event")
    validator, accepts = validators.get(event if isinstance(event, str) else None, validators[None])
    if accepts(rec):
        return rec
    errors = list(validator.iter_errors(rec))
    if errors:
        leaves = [e for e in errors if not e.context] or errors
        err = min(leaves, key=lambda e: (-len(e.absolute_path), [str(p) for p in e.absolute_path], e.message))
        path = where + err.json_path[1:]
        raise Rejection(JUDGE_SCHEMA, f"line {index + 1} does not match spec/schemas/rows.v1.json at {path}: {quote(err.message, 200)}", path)
    return rec


def read_rows(path: str | Path) -> list[str]:
    """The lines of a rows file (bounded: :data:`MAX_LINE_BYTES` per line, :data:`MAX_LINES` lines; blank lines dropped).

    Raises:
        Rejection: ``judge.unreadable`` (missing, a directory, not UTF-8, empty).
        ResourceLimit: ``judge.too_large``.
    """
    lines: list[str] = []
    try:
        with open(path, "rb") as handle:
            while True:
                raw = handle.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                if len(raw) > MAX_LINE_BYTES:
                    raise ResourceLimit(JUDGE_TOO_LARGE, f"line {len(lines) + 1} is longer than {MAX_LINE_BYTES} bytes", f"$[{len(lines)}]",
                                        {"limit": MAX_LINE_BYTES})
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise Rejection(JUDGE_UNREADABLE, f"line {len(lines) + 1} is not UTF-8 (byte {exc.start}: {exc.reason})",
                                    f"$[{len(lines)}]") from None
                if text.strip():
                    if len(lines) >= MAX_LINES:
                        raise ResourceLimit(JUDGE_TOO_LARGE, f"more than {MAX_LINES} lines", f"$[{MAX_LINES}]", {"limit": MAX_LINES})
                    lines.append(text)
    except OSError as exc:
        raise Rejection(JUDGE_UNREADABLE, f"cannot read {quote(str(path), 200)}: {exc.strerror or exc}", "$") from None
    if not lines:
        raise Rejection(JUDGE_UNREADABLE, "the rows file is empty: no request header", "$")
    return lines


def _admit(header: dict[str, Any]) -> AdmittedRequest:
    """The header's envelope, admitted; the envelope's own typed error with its path under ``$[0].request``."""
    raw = json.dumps(header["request"], ensure_ascii=False, allow_nan=False).encode("utf-8")
    try:
        admitted, _ = validate_request_envelope(raw)
    except DecodeSpecError as exc:
        raise type(exc)(exc.code, exc.message, "$[0].request" + exc.path[1:], exc.details) from None
    if admitted.policy.family.value == "beam":
        raise Rejection(JUDGE_UNSUPPORTED, "a beam request: the rows-in oracle judges single-path requests (greedy, multinomial)",
                        "$[0].request.policy.family")
    if admitted.artifact.architecture != "decoder_only":
        raise Rejection(JUDGE_UNSUPPORTED, f"architecture {admitted.artifact.architecture!r}: the rows-in oracle judges decoder_only requests",
                        "$[0].request.artifact.architecture")
    return admitted


# --------------------------------------------------------------------------------------------
# The judge.
# --------------------------------------------------------------------------------------------


class _Broken(Exception):
    """A broken rule: ``args[0]`` its verdict."""


def _fail(layer: str, check: str, expected: Any, actual: Any, message: str, probe: dict[str, Any] | None = None) -> _Broken:
    return _Broken(Verdict(FAILED, layer, f"ladder.{layer}", check, expected, actual, message, probe=probe))


class _Judge:
    """The spec side of one recording: the composed request (:mod:`decodespec.spec.request_machine`), advanced line by line."""

    def __init__(self, admitted: AdmittedRequest, tolerance: Tolerance, reference: Any, token_bytes: Callable[[int], bytes] | None,
                 machine: Machine):
        self.admitted = admitted
        # With a reference, its window caps the context as in the gate (lockstep.request_for).
        self.request = request_from_envelope(admitted, window=None if reference is None else reference.window)
        self.params = self.request.params
        self.policy = self.request.policy
        self.tolerance = tolerance
        self.reference = reference
        self.machine = machine
        self.prompt_ids = self.request.prompt_ids
        self.token_bytes = token_bytes
        if (self.params.stop_strings or self.params.structured) and token_bytes is None:
            raise Rejection(JUDGE_UNSUPPORTED, "the request declares stop strings or structured completion, whose triggers need the "
                            "model's token bytes: name a known model (runtime.model tiny / smollm2) or pass a tokenizer", "$[0].runtime.model")
        self.undecided: tuple[Verdict, int] | None = None
        self.composed = rm.initial(self.request)
        self._do(lambda c: rm.apply(self.request, c, Admit(), machine=machine), Admit(), "admit")

    @property
    def state(self) -> RequestState:
        """The M3.10 machine state."""
        return self.composed.machine

    # -- helpers -------------------------------------------------------------------------
    def _do(self, fn: Callable[[rm.ComposedState], rm.ComposedState], action: Action, what: str) -> None:
        """``self.composed = fn(self.composed)``; a refusal is a broken STATE rule naming the guard."""
        try:
            self.composed = fn(self.composed)
        except DecodeSpecError as exc:
            guard = exc.details.get("guard") or exc.details.get("check")
            rule = exc.details.get("rule", "the transition")
            where = f"guard '{guard}' of {rule} fails" if guard else exc.message
            raise _fail("STATE", f"transition.{what}", "enabled", f"{exc.code}",
                        f"{action_label(action)} is not enabled in phase {self.state.phase.value}: {where}") from None

    def _state_check(self, rec: dict[str, Any]) -> None:
        """STATE: the stated frontier fields and phase equal the spec state's after the line."""
        spec = _frontier(self.params, self.state)
        for key, stated in (rec.get("frontier") or {}).items():
            if stated != spec[key]:
                raise _fail("STATE", f"frontier.{key}", spec[key], stated,
                            f"frontier {key}: the spec says {spec[key]!r}, the runtime reported {stated!r} (spec frontier {spec})")
        if "phase" in rec and rec["phase"] != self.state.phase.value:
            raise _fail("STATE", "phase", self.state.phase.value, rec["phase"],
                        f"phase: the spec says {self.state.phase.value!r}, the runtime reported {rec['phase']!r}")

    def _triggers_check(self, stated: Any, triggers: frozenset[FinishReason], what: str) -> None:
        if stated is None:
            return
        spec = [t.value for t in FINISH_PRECEDENCE if t in triggers]
        if list(stated) != spec:
            raise _fail("SEQUENCE", "triggers", spec, list(stated), f"{what} triggers: the spec fires {spec}, the runtime reported {list(stated)}")

    def _row(self, rec: dict[str, Any]) -> tuple[np.ndarray, float]:
        """STATE (a scored call precedes the row) and TENSOR (shape; the reference row) of a row line; ``(row, epsilon)``."""
        if self.state.phase is not Phase.SCORED or self.state.score is None:
            raise _fail("STATE", "phase", Phase.SCORED.value, self.state.phase.value,
                        f"a {rec['event']} line needs a completed call that exposed a score row, but the spec's phase is "
                        f"{self.state.phase.value!r}")
        row = np.asarray(rec["row"], dtype=np.float64)
        size = self.params.vocab_size
        if row.shape != (size,):
            raise _fail("TENSOR", "score_row.shape", [size], list(row.shape),
                        f"output {self.state.output_count}: the score row has {row.shape[0]} entries, the vocabulary {size}")
        if self.reference is not None:
            ref = np.asarray(self.reference.row(self.prompt_ids + self.state.output_ids), dtype=np.float64)
            eps = self.tolerance.epsilon(ref)
            bad = score_row_failure(ref, row, eps, where=f"output {self.state.output_count}: the score row is away from the float64 "
                                    "reference row of the same committed prefix: ")
            if bad is not None:
                raise _Broken(bad)
            return row, eps
        return row, self.tolerance.epsilon(row)

    # -- lines ---------------------------------------------------------------------------
    def on_call(self, rec: dict[str, Any]) -> None:
        launch = Launch(CallKind(rec["kind"]), rec["start"], rec["length"])
        self._do(lambda c: rm.apply(self.request, c, launch, machine=self.machine), launch, "launch")
        self._do(lambda c: rm.complete(self.request, c, machine=self.machine), expected_report(self.params, self.state), "complete")
        self._state_check(rec)

    def on_empty_support(self, rec: dict[str, Any]) -> None:
        row, _ = self._row(rec)
        score = self.state.score
        assert score is not None
        try:
            choice = rm.choose(self.request, self.composed, row, machine=self.machine)
        except DecodeSpecError as exc:
            raise _fail("DECISION", "decision.policy", "a decision", exc.code, f"the spec policy refuses the row: {exc.message}") from None
        if choice is not None:
            raise _fail("DECISION", "decision.empty_support", choice.token, "empty_support",
                        f"output {self.state.output_count}: the runtime found the legal support empty, the spec policy selects "
                        f"{choice.token} on the same row")
        self._do(lambda c: rm.support_empty(self.request, c, machine=self.machine), SupportEmpty(score.score_id), "support_empty")
        self._state_check(rec)

    def on_token(self, rec: dict[str, Any], index: int) -> None:
        row, eps = self._row(rec)
        score = self.state.score
        assert score is not None
        index_o = self.state.output_count
        token = int(rec["token_id"])
        try:
            choice = rm.choose(self.request, self.composed, row, machine=self.machine)
        except DecodeSpecError as exc:
            raise _fail("DECISION", "decision.policy", "a decision", exc.code, f"output {index_o}: the spec policy refuses the row: "
                        f"{exc.message}") from None
        if choice is None:
            raise _fail("DECISION", "decision.empty_support", "empty_support", token,
                        f"output {index_o}: the spec policy finds no legal token on this row (finish constraint_error), the "
                        f"runtime selected {token}")
        processed = choice.processed
        draws = choice.draws
        if "draws" in rec and rec["draws"] != draws:
            raise _fail("POLICY", "draws", draws, rec["draws"], f"output {index_o}: the decision consumed {rec['draws']} RNG draws, "
                        f"the spec policy's selector ({processed.selector}) draws {draws}")
        if not 0 <= token < self.params.vocab_size or not processed.support_mask[token]:
            raise _fail("DECISION", "decision.support", choice.token, token,
                        f"output {index_o}: the runtime selected {token}, outside the processed support of its own row "
                        f"({processed.support_size} ids; the spec policy selects {choice.token})")
        if token != choice.token:
            greedy = processed.selector == "greedy"
            verdict = judge_decision(policy=self.policy, ref_values=processed.values, ref_token=choice.token, runtime_token=token,
                                     tolerance=self.tolerance, greedy=greedy, ref_probs=processed.probs,
                                     u=None if greedy else choice.u, output_index=index_o, epsilon=eps)
            # The margin rule on the runtime's own row: the "reference" row of the message is the spec policy's processing of it.
            verdict = attrs.evolve(verdict, message=verdict.message + " [judged on the recorded row: 'reference' is the spec policy's "
                                   "processed row of it]")
            if verdict.result == FAILED:
                raise _Broken(verdict)
            if verdict.result == UNDECIDED and self.undecided is None:
                self.undecided = (verdict, index)
        want = float(log_softmax(row)[token])
        bound = self.tolerance.at_row(row).logprob
        got = float(rec["logprob"])
        if not abs(got - want) <= bound:
            raise _fail("DECISION", "decision.logprob", want, got,
                        f"output {index_o}: the logprob at vocabulary id {token} is not log-softmax of its own score row there: "
                        f"expected {want:.6g}, observed {got:.6g}, |error| {abs(got - want):.3g} > bound {bound:.3g}",
                        {"kind": "logprob", "id": token, "expected": want, "observed": got, "bound": bound})
        # Any id the tolerance allows is legal: the spec adopts it (the policy state advances as for that id).
        self._do(lambda c: rm.decide(self.request, c, choice, token=token, machine=self.machine),
                 Decide(score.score_id, token, draws), "decide")
        before = self.state.triggers
        assert self.state.receipt is not None
        receipt_id = self.state.receipt.receipt_id
        self._do(lambda c: rm.commit(self.request, c, token_bytes=self.token_bytes, machine=self.machine),
                 Commit(receipt_id, frozenset()), "commit")
        self._triggers_check(rec.get("triggers"), self.state.triggers - before, f"output {index_o}: the commit's")
        self._state_check(rec)

    def on_finish(self, rec: dict[str, Any]) -> None:
        if self.state.phase is not Phase.FINISHED:
            raise _fail("STATE", "phase", self.state.phase.value, Phase.FINISHED.value,
                        f"a finish line but the spec's request is {self.state.phase.value!r} with O = {self.state.output_count}: "
                        "no trigger fired (EOS, length, context_length, stop string)")
        self._state_check(rec)
        if "output_ids" in rec and list(rec["output_ids"]) != list(self.state.output_ids):
            raise _fail("STATE", "output_ids", list(self.state.output_ids), list(rec["output_ids"]), "the finish's committed output ids")
        spec = None if self.state.finish_reason is None else self.state.finish_reason.value
        if rec["finish_reason"] != spec:
            raise _fail("SEQUENCE", "finish_reason", spec, rec["finish_reason"],
                        f"finish reason: the spec says {spec!r} (triggers {[t.value for t in FINISH_PRECEDENCE if t in self.state.triggers]}), "
                        f"the runtime reported {rec['finish_reason']!r}")
        self._triggers_check(rec.get("triggers"), frozenset(self.state.triggers), "the finish's")

    def at_end(self, finished: bool) -> None:
        if not is_terminal(self.params, self.state) and not finished:
            raise _fail("STATE", "phase", "terminal", self.state.phase.value,
                        f"the recording ends with the request {self.state.phase.value!r} (O = {self.state.output_count}): a run ends "
                        "when a trigger closes the output (and its finish line reports it)")
        if not finished:
            spec = None if self.state.finish_reason is None else self.state.finish_reason.value
            raise _fail("SEQUENCE", "finish_reason", spec, None, f"the request is finished ({spec}) but the recording has no finish line")


def judge_rows(lines: Iterable[str | dict[str, Any]], *, tolerance: Tolerance, reference: Any = None,
               token_bytes: Callable[[int], bytes] | None = None, machine: Machine = MACHINE,
               vocab_hash: str | None = None) -> Judgement:
    """Judge a ``decodespec.rows.v1`` recording (see the module docstring): the first broken rule and its ladder layer.

    Args:
        lines: The recording's lines (JSON text or parsed objects), the ``request`` header first.
        tolerance: The declared tolerance (:func:`decodespec.checks.gate.tolerance.tolerance_for`): epsilon
            of the margin rule and the logprob bound; with ``reference``, the TENSOR bound.
        reference: A float64 reference with ``row(ids) -> [V]`` and ``window``
            (:class:`~decodespec.checks.gate.reference.Reference64`) of the recorded model, or ``None``
            (then TENSOR checks only the row's shape).  Its window also caps the context
            (``context_length`` fires at the least of the envelope's caps and the window, as in the gate).
        token_bytes: The bytes of each id (:func:`decodespec.checks.modelcheck.trace_validation.token_bytes_of`),
            needed when the request declares stop strings or structured completion.
        machine: The spec transition machine (tests plug in broken ones).
        vocab_hash: The recorded model's ordered vocabulary hash as the gate reads it
            (:func:`decodespec.checks.gate.vocab_check.reference_vocab`), or ``None``.  When both it and
            the header's ``runtime.vocab_hash`` are given, a difference fails STATE ``vocab.hash``
            at the header (line 1): the runtime scored another ordered vocabulary.

    Returns:
        The :class:`Judgement` (never raises for a broken rule).

    Raises:
        Rejection: ``judge.schema`` (a line outside spec/schemas/rows.v1.json, a misplaced header
            or finish), ``judge.unsupported``, or the envelope's ``envelope.*`` / ``policy.*`` /
            ``stop.*`` code at ``$[0].request...``; nothing is judged.
        ResourceLimit: the envelope's resource limits.
    """
    items = list(lines)
    if not items:
        raise Rejection(JUDGE_UNREADABLE, "no lines: no request header", "$")
    if len(items) > MAX_LINES:
        raise ResourceLimit(JUDGE_TOO_LARGE, f"more than {MAX_LINES} lines", f"$[{MAX_LINES}]", {"limit": MAX_LINES})
    records = [parse_line(i, raw) for i, raw in enumerate(items)]  # every line is well-formed before any judgement
    for i, rec in enumerate(records):
        if (rec["event"] == "request") != (i == 0):
            raise Rejection(JUDGE_SCHEMA, "the request header is the first line and only there" if i else
                            f"the first line is a {rec['event']!r} line, not the request header", f"$[{i}].event")
        if rec["event"] == "finish" and i != len(records) - 1:
            raise Rejection(JUDGE_SCHEMA, f"line {i + 1} is the finish line but {len(records) - 1 - i} lines follow it", f"$[{i + 1}]")
    admitted = _admit(records[0])
    judge = _Judge(admitted, tolerance, reference, token_bytes, machine)
    stated = records[0].get("runtime", {}).get("vocab_hash")
    if stated is not None and vocab_hash is not None and stated != vocab_hash:
        verdict = Verdict(FAILED, "STATE", "ladder.STATE", "vocab.hash", expected=vocab_hash, actual=stated, step=0,
                          message=f"ordered vocabulary hash (M3.8 0x08: equal sizes prove no identity): the model's is {vocab_hash}, "
                          f"the runtime states {stated}")
        return Judgement(verdict, 1, "request", 0, len(records), 0, admitted.identity)
    num_tokens = 0
    index, rec = 0, records[0]
    try:
        for index in range(1, len(records)):
            rec = records[index]
            event = rec["event"]
            if event == "call":
                judge.on_call(rec)
            elif event == "token":
                judge.on_token(rec, index)
                num_tokens += 1
            elif event == "empty_support":
                judge.on_empty_support(rec)
            else:
                judge.on_finish(rec)
        index, rec = len(records), {}
        judge.at_end(records[-1]["event"] == "finish")
    except _Broken as broken:
        verdict = attrs.evolve(broken.args[0], step=index)
        return Judgement(verdict, index + 1, rec.get("event"), judge.state.output_count, len(records), num_tokens, admitted.identity)
    if judge.undecided is not None:
        verdict, at = judge.undecided
        return Judgement(attrs.evolve(verdict, step=at), at + 1, "token", None, len(records), num_tokens, admitted.identity)
    return Judgement(Verdict(PASSED), None, None, judge.state.output_count, len(records), num_tokens, admitted.identity)


# --------------------------------------------------------------------------------------------
# Recording our runtime.
# --------------------------------------------------------------------------------------------


def record_rows(runner: Any, *, runtime: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run ``runner`` (a fresh :class:`decodespec.impl.runtime.RequestRunner` built from an envelope) to the end and record it.

    Drives :meth:`~decodespec.impl.runtime.RequestRunner.step` and writes what a foreign runtime
    would: each completed call (kind, start, length, frontier, phase), each decision's raw float32
    score row as float64 values with its id, logprob, draws, commit triggers, frontier and phase,
    and the finish.  The runtime's own answers are recorded; nothing is computed here.

    Args:
        runner: The runner, not yet admitted; its ``request.envelope`` (canonical bytes) is the header's request.
        runtime: The header's ``runtime`` object (``{"name", "model", "dtype"[, "vocab_hash"]}``), or ``None``;
            ``vocab_hash`` is the runner's tokenizer's ordered vocabulary hash when it has one and
            the object does not state it.

    Returns:
        The recording's lines as objects (:func:`write_rows` writes them).
    """
    envelope = runner.request.envelope
    assert envelope is not None, "record_rows needs a runner built from an envelope (RuntimeRequest.from_admitted)"
    header: dict[str, Any] = {"event": "request", "format": FORMAT, "request": json.loads(envelope)}
    if runtime:
        header["runtime"] = dict(runtime)
        own = getattr(getattr(runner, "tokenizer", None), "vocab_hash", None)
        if own is not None:
            header["runtime"].setdefault("vocab_hash", str(own))
    out = [header]
    call = None
    row = None
    while True:
        if runner.phase is Phase.SCORED and runner.score is not None:
            row = runner.score.logits.detach().double().cpu().numpy().tolist()
        before = len(runner.output_ids)
        action = runner.step()
        if action is None:
            break
        state = {"frontier": dict(runner.frontier()), "phase": runner.phase.value}
        if action == "launch":
            call = runner.in_flight
        elif action == "complete" and call is not None:
            out.append({"event": "call", "kind": call.kind.value, "start": call.start, "length": call.length, **state})
        elif action == "decide" and runner.decision is None and runner.phase is Phase.FINISHED:
            out.append({"event": "empty_support", "row": row, **state})
        elif action == "commit" and len(runner.output_ids) > before:
            decision = runner.consumed[-1]
            fired = [t.value for t in FINISH_PRECEDENCE if t in runner.triggers] if runner.phase is Phase.FINISHED else []
            out.append({"event": "token", "row": row, "token_id": decision.token_id, "logprob": decision.logprob, "draws": decision.draws,
                        "triggers": fired, **state})
    finish: dict[str, Any] = {"event": "finish", "finish_reason": None if runner.finish_reason is None else runner.finish_reason.value,
                              "triggers": [t.value for t in runner.ordered_triggers()], "output_ids": list(runner.output_ids),
                              "frontier": dict(runner.frontier()), "phase": runner.phase.value}
    out.append(finish)
    return out


def write_rows(path: str | Path, lines: Sequence[dict[str, Any]]) -> None:
    """Write a recording as JSON lines (to a temporary file renamed onto ``path``: never a partial file)."""
    target = Path(path)
    temp = target.with_name(f".{target.name}.partial")
    try:
        with open(temp, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n" for line in lines)
        temp.replace(target)
    finally:
        if temp.exists():
            temp.unlink()

