"""The JSON-lines wire format of a foreign-runtime adapter (both sides use this codec).

One JSON object per line on the adapter process's stdin (requests, from the harness) and
stdout (responses, line-buffered).  Requests carry ``cmd`` and, except ``start`` / ``stop``,
a ``seq`` the response echoes; responses carry ``ok``.

=============================================  ================================================
request                                        response
=============================================  ================================================
``{"cmd": "start", "version": 1}``             ``{"ok": true, "ready": true, "version": 1,
                                               "implementation": {"name", "version",
                                               "language"?, "homepage"?, "capabilities": [...]}}``
``{"cmd": "reset", "seq", "config": {...}}``   ``{"ok": true, "seq"}``, or the refusal
                                               ``{"ok": false, "seq", "error": {"code",
                                               "message"}}`` (a typed error: the config is
                                               refused, nothing was built)
``{"cmd": "apply", "seq", "action": {...}}``   ``{"ok": true, "seq", "result": {"status": "ok",
                                               "data": {...}}}`` or ``{"ok": true, "seq",
                                               "result": {"status": "rejected", "code",
                                               "message"}}``
``{"cmd": "observe", "seq"}``                  ``{"ok": true, "seq", "observation": {...}}``
``{"cmd": "prompt_logprobs", "seq", ...}``     fields ``config`` (as ``reset``) and ``spec``
                                               ``{"first_token", "top_k"}``; answer ``{"ok":
                                               true, "seq", "prompt_logprobs": [...]}``, one
                                               :meth:`PromptLogprob.to_json` per entry (M3.10
                                               0x02), or the typed refusal as for ``reset``
``{"cmd": "bench", "seq", ...}``               fields ``prompt_ids``, ``new_tokens``,
                                               ``threads``; answer ``{"ok": true, "seq",
                                               "output_ids": [...], "timeline": {...}}``: one
                                               greedy run timed inside the server (optional;
                                               :func:`decodespec.spec.latency.timeline_from_json`)
``{"cmd": "stop"}``                            ``{"ok": true}`` then the process exits
=============================================  ================================================

``prompt_logprobs`` and ``bench`` were added to version 1 without changing any other message: a
server that predates them answers ``ok: false`` ("unknown command"), which the client reports as a
protocol error.  ``ok: false`` on ``apply`` / ``observe`` is a protocol error (the adapter itself failed), not a
refused action.  Config objects are :meth:`CaseConfig.to_json`; actions are the contract's
action objects; observations are :func:`observation_to_json` (arrays as ``{"dtype", "shape",
"base64"}`` of the little-endian bytes: ``float32`` rows, ``int64`` ids).  The protocol
version is :data:`PROTOCOL_VERSION`; a server answering another version is refused.

Source: research/formal-anchors-survey.md 4.4 and 5.4 (Bowtie IHOP: ``start`` handshake
declaring the implementation, per-case commands, ``stop``; line-buffered stdout).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import attrs
import jsonschema
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.prompt_logprobs import PromptLogprob

from . import ADAPTER_PROTOCOL, CAPABILITIES, ApplyResult, CaseConfig, Observation

__all__ = [
    "PROTOCOL_VERSION",
    "IntegerOutOfRange",
    "array_from_json",
    "array_to_json",
    "bounded_int",
    "decode_line",
    "encode_line",
    "observation_from_json",
    "observation_to_json",
    "prompt_logprobs_from_json",
    "request",
    "response_error",
    "response_ok",
    "start_response",
]

#: Version of this wire format (bump when a message changes meaning).
PROTOCOL_VERSION = 1
_ARRAY_DTYPES = ("float32", "int64")
_ARRAY_FIELDS = {"score_row": "float32", "support_ids": "int64", "support_probs": "float32", "cache_probe": "float32"}
_CMDS = ("start", "reset", "apply", "observe", "prompt_logprobs", "bench", "stop")


def _protocol(message: str, path: str = "$") -> Rejection:
    return Rejection(ADAPTER_PROTOCOL, message, path)


def array_to_json(array: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "base64"}`` of ``array`` (little-endian ``float32`` or ``int64``)."""
    arr = np.asarray(array)
    dtype = "float32" if arr.dtype.kind == "f" else "int64"
    data = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "shape": list(arr.shape), "base64": base64.b64encode(data.tobytes()).decode("ascii")}


def array_from_json(obj: Any, path: str = "$") -> np.ndarray:
    """Inverse of :func:`array_to_json`.

    Raises:
        Rejection: ``adapter.protocol`` for a wrong dtype, shape or byte count.
    """
    if not isinstance(obj, Mapping) or obj.get("dtype") not in _ARRAY_DTYPES or not isinstance(obj.get("shape"), list):
        raise _protocol(f"not an array object: {obj!r}", path)
    try:
        raw = base64.b64decode(obj["base64"], validate=True)
        arr = np.frombuffer(raw, dtype=np.dtype(obj["dtype"]).newbyteorder("<")).astype(obj["dtype"])
        return arr.reshape([int(n) for n in obj["shape"]])
    except (KeyError, TypeError, ValueError) as exc:
        raise _protocol(f"bad array: {exc}", path) from None


def observation_to_json(obs: Observation) -> dict[str, Any]:
    """The observation as a JSON object (arrays base64-encoded, ``None`` fields kept as ``null``)."""
    out: dict[str, Any] = {}
    for field in attrs.fields(Observation):
        value = getattr(obs, field.name)
        if field.name in _ARRAY_FIELDS and value is not None:
            out[field.name] = array_to_json(value)
        elif isinstance(value, tuple):
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _null_or(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "null"}, schema]}


_INTS = {"type": "array", "items": {"type": "integer"}}
_NUMBERS = {"type": "array", "items": {"type": "number"}}
_ARRAY = {"type": "object"}  # decoded and checked by array_from_json
#: The JSON types of an observation's fields (what :func:`observation_to_json` writes); a value of
#: another type is ``adapter.protocol`` here, before any comparison reads it.
OBSERVATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "phase": _null_or({"type": "string"}),
        "output_ids": _null_or(_INTS),
        "logprobs": _null_or(_NUMBERS),
        "frontier": _null_or({"type": "object", "properties": {
            **{k: {"type": "integer", "minimum": 0} for k in ("prompt_len", "output_count", "pending", "processed")},
            "pending_tag": _null_or({"type": "string"})}}),
        "finish_reason": _null_or({"type": "string"}),
        "triggers": _null_or({"type": "array", "items": {"type": "string"}}),
        **{k: _null_or({"type": "integer"}) for k in ("rng_counter", "generation", "score_output_count", "cache_committed", "cache_physical")},
        "quarantined": _null_or({"type": "boolean"}),
        "decision": _null_or({"type": "object", "properties": {
            "receipt_id": _null_or({"type": "string"}), "score_id": _null_or({"type": "string"}),
            "token_id": _null_or({"type": "integer"}), "logprob": _null_or({"type": "number"}), "draws": _null_or({"type": "integer"})}}),
        **{k: _null_or(_ARRAY) for k in _ARRAY_FIELDS},
        "score_id": _null_or({"type": "string"}),
        "text": _null_or({"type": "string"}),
        "chunks": _null_or({"type": "array", "items": {"type": "object", "properties": {
            "chunk_idx": {"type": "integer"}, "text": {"type": "string"},
            **{k: {"type": "integer"} for k in ("byte_start", "byte_end", "token_start", "token_end")}}}}),
        "call": _null_or({"type": "object", "properties": {
            "call_id": {"type": ["integer", "string"]}, "kind": {"type": "string"}, "start": {"type": "integer"},
            "length": {"type": "integer"}, "position_ids": _null_or(_INTS), "cache_position": _null_or(_INTS),
            "in_flight": {"type": "boolean"}}}),
        **{k: _null_or(_INTS) for k in ("beam_tokens", "beam_parents", "returned_ids")},
        "returned_logprobs": _null_or(_NUMBERS),
    },
}
_OBSERVATION_VALIDATOR = jsonschema.Draft202012Validator(OBSERVATION_SCHEMA)


def observation_from_json(obj: Any) -> Observation:
    """Inverse of :func:`observation_to_json` (absent fields are not exposed: ``None`` / empty).

    Raises:
        Rejection: ``adapter.protocol`` for a non-object, an unknown field or a bad array.
    """
    if not isinstance(obj, Mapping):
        raise _protocol(f"an observation is a JSON object, got {type(obj).__name__}", "$.observation")
    names = {f.name for f in attrs.fields(Observation)}
    unknown = sorted(set(obj) - names)
    if unknown:
        raise _protocol(f"unknown observation field(s) {unknown}", f"$.observation.{unknown[0]}")
    error = next(iter(_OBSERVATION_VALIDATOR.iter_errors(obj)), None)
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise _protocol(f"bad observation field: {error.message[:200]}", f"$.observation{where}")
    values = {}
    for name, value in obj.items():
        if name in _ARRAY_FIELDS and value is not None:
            value = array_from_json(value, f"$.observation.{name}")
        values[name] = value
    for name in ("output_ids", "logprobs", "triggers"):
        if values.get(name) is None:
            values.pop(name, None)
    try:
        return Observation(**values)
    except (TypeError, ValueError) as exc:
        raise _protocol(f"bad observation: {exc}", "$.observation") from None


_PROMPT_LOGPROB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["position", "token_id", "logprob", "rank", "top"],
    "additionalProperties": False,
    "properties": {
        "position": {"type": "integer", "minimum": 0}, "token_id": {"type": "integer", "minimum": 0},
        "logprob": _null_or({"type": "number"}), "rank": _null_or({"type": "integer"}),
        "top": _null_or({"type": "array", "items": {"type": "object", "required": ["token_id", "logprob", "rank"],
                                                      "additionalProperties": False, "properties": {
                                                          "token_id": {"type": "integer", "minimum": 0}, "logprob": {"type": "number"},
                                                          "rank": {"type": "integer"}}}}),
    },
}
_PROMPT_LOGPROBS_VALIDATOR = jsonschema.Draft202012Validator({"type": "array", "items": _PROMPT_LOGPROB_SCHEMA})


def prompt_logprobs_from_json(obj: Any) -> tuple[PromptLogprob, ...]:
    """The entries of a ``prompt_logprobs`` answer (inverse of :meth:`PromptLogprob.to_json` per entry).

    Only the JSON types are checked here; whether the entries have the shape
    ``invariant.prompt_logprobs_aligned`` requires is the judge's question
    (:func:`decodespec.checks.gate.prompt_logprobs.judge`).

    Raises:
        Rejection: ``adapter.protocol`` for a non-list, a malformed entry, or a ``top`` list whose
            ``rank`` fields are not ``1, 2, ...`` in order.
    """
    error = next(iter(_PROMPT_LOGPROBS_VALIDATOR.iter_errors(obj)), None)
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise _protocol(f"bad prompt_logprobs: {error.message[:200]}", f"$.prompt_logprobs{where}")
    out = []
    for index, entry in enumerate(obj):
        top = entry["top"]
        if top is not None and [t["rank"] for t in top] != list(range(1, len(top) + 1)):
            raise _protocol(f"entry {index}: top-k ranks {[t['rank'] for t in top]} are not 1..{len(top)} in order",
                            f"$.prompt_logprobs[{index}].top")
        out.append(PromptLogprob(entry["position"], entry["token_id"], None if entry["logprob"] is None else float(entry["logprob"]),
                                 entry["rank"], None if top is None else tuple((t["token_id"], float(t["logprob"])) for t in top)))
    return tuple(out)


def encode_line(message: Mapping[str, Any]) -> str:
    """One message as one line of JSON (UTF-8 text, no embedded newline, ``\\n`` appended)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"


class IntegerOutOfRange(ValueError):
    """A JSON integer outside what the protocols carry (:func:`bounded_int`)."""


def bounded_int(text: str) -> int:
    """A JSON integer of the protocol: ids, counters and seeds, all within ``[-2^63, 2^64)``.

    The digits are counted before they are converted, so a line of a million digits costs no
    quadratic conversion, and no integer reaches a ``float()`` that would overflow.
    """
    if len(text.lstrip("-")) > 20:
        raise IntegerOutOfRange(f"an integer of {len(text.lstrip('-'))} digits")
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise IntegerOutOfRange(f"the integer {value} is outside [-2^63, 2^64)")
    return value


def decode_line(line: str | bytes) -> dict[str, Any]:
    """Parse one line into a message object.

    Raises:
        Rejection: ``adapter.protocol`` for invalid JSON, a non-object, or an integer outside
            ``[-2^63, 2^64)`` (a runtime answering ``"logprob": 1e400`` written as an integer;
            found by ``tests/test_fuzz_wire.py``).
    """
    try:
        obj = json.loads(line, parse_int=bounded_int)
    except IntegerOutOfRange as exc:
        raise _protocol(f"not a protocol line: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _protocol(f"not a JSON line: {exc}") from None
    if not isinstance(obj, dict):
        raise _protocol(f"a message is a JSON object, got {type(obj).__name__}")
    return obj


def request(cmd: str, seq: int | None = None, **fields: Any) -> dict[str, Any]:
    """A request message; ``config`` may be a :class:`CaseConfig`."""
    if cmd not in _CMDS:
        raise _protocol(f"unknown command {cmd!r}", "$.cmd")
    message: dict[str, Any] = {"cmd": cmd}
    if seq is not None:
        message["seq"] = seq
    for key, value in fields.items():
        message[key] = value.to_json() if isinstance(value, CaseConfig) else value
    return message


def start_response(name: str, version: str, capabilities: frozenset[str] | set[str], **implementation: Any) -> dict[str, Any]:
    """The server's answer to ``start``.

    Raises:
        Rejection: ``adapter.protocol`` for a capability outside :data:`CAPABILITIES`.
    """
    unknown = sorted(set(capabilities) - CAPABILITIES)
    if unknown:
        raise _protocol(f"unknown capabilities {unknown}", "$.implementation.capabilities")
    return {"ok": True, "ready": True, "version": PROTOCOL_VERSION,
            "implementation": {"name": name, "version": version, **implementation, "capabilities": sorted(capabilities)}}


def response_ok(seq: int | None = None, *, result: ApplyResult | None = None, observation: Observation | None = None) -> dict[str, Any]:
    """A successful response (with an apply result or an observation when given)."""
    message: dict[str, Any] = {"ok": True}
    if seq is not None:
        message["seq"] = seq
    if result is not None:
        message["result"] = result.to_json()
    if observation is not None:
        message["observation"] = observation_to_json(observation)
    return message


def response_error(seq: int | None, code: str, message: str) -> dict[str, Any]:
    """A refusal (``reset``) or protocol error (other commands)."""
    out: dict[str, Any] = {"ok": False, "error": {"code": code, "message": message}}
    if seq is not None:
        out["seq"] = seq
    return out
