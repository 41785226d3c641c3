"""A small codec for the Informal Trace Format (ITF, Apalache ADR-015; Quint's trace format).

Counterexamples from the explorer, and traces of the conformance gate, are written as ITF so
that Apalache / Quint tooling can read them.  A trace is
``{"#meta"?, "params"?, "vars", "states", "loop"?}``; every state is a record of the ``vars``
(plus an optional ``"#meta"``).  Values:

============================  =========================================================
Python (encode)               ITF JSON
============================  =========================================================
``bool``, ``str``             the JSON value
``int``                       JSON integer within +-(2**53 - 1), else ``{"#bigint": "<digits>"}``
``list`` / ``tuple``          JSON array (a TLA+ sequence); :class:`Tup` -> ``{"#tup": [...]}``
``set`` / ``frozenset``       ``{"#set": [...]}`` (sorted by canonical JSON for determinism)
``dict`` with str keys        a record (keys must not start with ``#``)
:class:`ItfMap` / other dict  ``{"#map": [[key, value], ...]}``
``enum.Enum`` member          ``{"tag": member.name, "value": {"#tup": []}}``
:class:`Variant`              ``{"tag": ..., "value": ...}`` (Quint sum types)
``None``                      ``{"tag": "None", "value": {"#tup": []}}`` (Quint's Option)
attrs instance                a record of its fields
============================  =========================================================

:func:`decode` is the inverse up to representation: sequences come back as ``list``, tuples
as :class:`Tup`, sets as ``frozenset``, maps as :class:`ItfMap`, records as ``dict``, sum
types as :class:`Variant`.  ``encode(decode(x)) == x`` for every valid ITF value ``x`` (modulo
the order of ``#set`` / ``#map`` entries, which ITF leaves unordered).

Traces are validated against :data:`ITF_SCHEMA`, the ADR-015 format restated as a JSON Schema
(draft 2020-12), with ``jsonschema``.

Source: Apalache ADR-015 (Informal Trace Format); research/formal-anchors-survey.md 5.1
(itf-py fails on sum types, so the project owns its codec).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import jsonschema

from decodespec.checks.modelcheck.fastschema import FastAccept
from decodespec.impl.events import write_atomically  # a kill leaves no partial trace (M3.10 0x06)
from decodespec.spec.limits import MAX_SAFE_INT  # the largest integer ITF may write as a plain JSON number (I-JSON)

__all__ = [
    "ITF_SCHEMA",
    "MAX_SAFE_INT",
    "ItfError",
    "ItfMap",
    "Tup",
    "Variant",
    "decode",
    "encode",
    "make_trace",
    "read_trace",
    "validate_trace",
    "write_trace",
]


_EXPR = {"$ref": "#/$defs/expr"}

#: ITF (ADR-015) as a JSON Schema, draft 2020-12 (identical to research/itf.schema.json).
ITF_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "urn:example:itf-trace",
    "description": "Informal Trace Format (Apalache ADR-015), restated as a JSON Schema; Quint --mbt additions allowed as ordinary state keys.",
    "type": "object",
    "required": ["vars", "states"],
    "properties": {
        "#meta": {"type": "object"},
        "params": {"type": "array", "items": {"type": "string"}},
        "vars": {"type": "array", "items": {"type": "string"}},
        "states": {"type": "array", "items": {"$ref": "#/$defs/state"}},
        "loop": {"type": "integer", "minimum": 0},
    },
    "additionalProperties": False,
    "$defs": {
        "state": {
            "type": "object",
            "properties": {"#meta": {"type": "object"}},
            "additionalProperties": _EXPR,
        },
        "expr": {
            "anyOf": [
                {"type": ["string", "boolean"]},
                {"type": "integer"},
                {"type": "array", "items": _EXPR},
                {"type": "object", "required": ["#bigint"], "properties": {"#bigint": {"type": "string", "pattern": "^-?[0-9]+$"}}, "additionalProperties": False},
                {"type": "object", "required": ["#tup"], "properties": {"#tup": {"type": "array", "items": _EXPR}}, "additionalProperties": False},
                {"type": "object", "required": ["#set"], "properties": {"#set": {"type": "array", "items": _EXPR}}, "additionalProperties": False},
                {"type": "object", "required": ["#map"], "properties": {"#map": {"type": "array", "items": {"type": "array", "prefixItems": [_EXPR, _EXPR], "minItems": 2, "maxItems": 2}}}, "additionalProperties": False},
                {"type": "object", "required": ["#unserializable"], "properties": {"#unserializable": {"type": "string"}}, "additionalProperties": False},
                {"type": "object", "required": ["tag", "value"], "properties": {"tag": {"type": "string"}, "value": _EXPR}, "additionalProperties": False},
                {"type": "object", "propertyNames": {"not": {"pattern": "^#"}}, "additionalProperties": _EXPR},
            ]
        },
    },
}


class ItfError(ValueError):
    """A value cannot be encoded as ITF, or a JSON value is not valid ITF."""


class Tup(tuple):
    """An ITF tuple (``{"#tup": [...]}``); plain Python tuples encode as sequences."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Tup{tuple.__repr__(self)}"


@attrs.frozen
class Variant:
    """A sum-type value ``{"tag": tag, "value": value}`` (Quint); unit payload is ``Tup()``."""

    tag: str
    value: Any = attrs.field(factory=Tup)


class ItfMap(dict):
    """An ITF map (``{"#map": [[k, v], ...]}``): keys may be any hashable decoded value."""

    def __hash__(self) -> int:  # pragma: no cover - maps are rarely hashed
        return hash(frozenset(self.items()))


def _canonical_key(encoded: Any) -> str:
    return json.dumps(encoded, sort_keys=True, separators=(",", ":"))


def encode(value: Any) -> Any:
    """Encode a Python value as an ITF JSON value (see the module table).

    Raises:
        ItfError: for floats, record keys starting with ``#``, and unsupported types.
    """
    if value is None:
        return {"tag": "None", "value": {"#tup": []}}
    if isinstance(value, enum.Enum):  # before str/int: str- and int-valued enums are variants
        return {"tag": value.name, "value": {"#tup": []}}
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value if -MAX_SAFE_INT <= value <= MAX_SAFE_INT else {"#bigint": str(value)}
    if isinstance(value, Variant):
        return {"tag": value.tag, "value": encode(value.value)}
    if isinstance(value, Tup):
        return {"#tup": [encode(v) for v in value]}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"#set": sorted((encode(v) for v in value), key=_canonical_key)}
    if isinstance(value, ItfMap) or (isinstance(value, Mapping) and not all(isinstance(k, str) for k in value)):
        pairs = [[encode(k), encode(v)] for k, v in value.items()]
        return {"#map": sorted(pairs, key=lambda kv: _canonical_key(kv[0]))}
    if isinstance(value, Mapping):
        return _record(value.items())
    if attrs.has(type(value)):
        return _record((f.name, getattr(value, f.name)) for f in attrs.fields(type(value)))
    raise ItfError(f"cannot encode {type(value).__name__} value {value!r} as ITF")


def _record(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, val in items:
        if key.startswith("#"):
            raise ItfError(f"record key {key!r} starts with '#'")
        out[key] = encode(val)
    return out


class _FrozenRecord(dict):
    """A decoded record used where a hashable value is needed (a set element or a map key)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _hashable(value: Any) -> Any:
    """Make a decoded value hashable without changing its encoding (lists -> tuples, records frozen)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict) and not isinstance(value, ItfMap):
        return _FrozenRecord({k: _hashable(v) for k, v in value.items()})
    return value


def decode(value: Any) -> Any:
    """Decode an ITF JSON value into Python (inverse of :func:`encode` up to representation).

    Raises:
        ItfError: for JSON values outside ITF (``null``, floats, ``#unserializable``, bad ``#bigint``).
    """
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "#bigint" in value:
            text = value["#bigint"]
            if len(value) != 1 or not isinstance(text, str) or not text.lstrip("-").isdigit() or text.count("-") > 1:
                raise ItfError(f"bad #bigint {value!r}")
            return int(text)
        if "#tup" in value and len(value) == 1:
            return Tup(decode(v) for v in value["#tup"])
        if "#set" in value and len(value) == 1:
            return frozenset(_hashable(decode(v)) for v in value["#set"])
        if "#map" in value and len(value) == 1:
            return ItfMap((_hashable(decode(k)), decode(v)) for k, v in value["#map"])
        if "#unserializable" in value:
            raise ItfError(f"unserializable ITF value {value['#unserializable']!r}")
        if set(value) == {"tag", "value"} and isinstance(value["tag"], str):
            return Variant(value["tag"], decode(value["value"]))
        if any(k.startswith("#") for k in value):
            raise ItfError(f"unknown ITF object {sorted(value)}")
        return {k: decode(v) for k, v in value.items()}
    raise ItfError(f"{type(value).__name__} value {value!r} is not an ITF value")


def make_trace(
    vars: Sequence[str],
    states: Sequence[Mapping[str, Any]],
    *,
    meta: Mapping[str, Any] | None = None,
    params: Sequence[str] | None = None,
    loop: int | None = None,
) -> dict[str, Any]:
    """Build an ITF trace from Python state records (each a mapping from every var to a value).

    Each state gets ``"#meta": {"index": i}``; ``meta`` goes into the trace's ``"#meta"`` as plain
    JSON (it is not ITF-encoded).

    Raises:
        ItfError: when a state lacks a var or a value cannot be encoded.
    """
    encoded_states = []
    for index, state in enumerate(states):
        missing = [v for v in vars if v not in state]
        if missing:
            raise ItfError(f"state {index} lacks vars {missing}")
        record = {"#meta": {"index": index}}
        record.update({v: encode(state[v]) for v in vars})
        encoded_states.append(record)
    trace: dict[str, Any] = {}
    if meta is not None:
        trace["#meta"] = dict(meta)
    if params is not None:
        trace["params"] = list(params)
    trace["vars"] = list(vars)
    trace["states"] = encoded_states
    if loop is not None:
        trace["loop"] = loop
    return trace


_FAST_ACCEPT = FastAccept(ITF_SCHEMA)


def validate_trace(trace: Any) -> None:
    """Check ``trace`` against :data:`ITF_SCHEMA` and that every state carries every var.

    Raises:
        ItfError: naming the first problem.
    """
    if not _FAST_ACCEPT(trace):  # checks/modelcheck/fastschema.py: the Rust validator first, the Python one where it cannot tell
        fast = _FAST_ACCEPT.first_error(trace)
        if fast is not None:
            raise ItfError(f"not an ITF trace at {fast[0]}: {fast[1]}")
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(ITF_SCHEMA).iter_errors(trace))
        if error is not None:
            raise ItfError(f"not an ITF trace at {list(error.absolute_path)}: {error.message}")
    for index, state in enumerate(trace["states"]):
        missing = [v for v in trace["vars"] if v not in state]
        if missing:
            raise ItfError(f"state {index} lacks vars {missing}")
    if "loop" in trace and trace["loop"] >= len(trace["states"]):
        raise ItfError(f"loop index {trace['loop']} is past the last state")


def write_trace(path: str | Path, trace: Mapping[str, Any]) -> Path:
    """Validate and write ``trace`` as JSON (conventionally ``*.itf.json``); return the path."""
    validate_trace(trace)
    return write_atomically(path, json.dumps(trace, indent=1, sort_keys=False) + "\n")


def read_trace(path: str | Path) -> dict[str, Any]:
    """Read and validate an ITF trace file (UTF-8 JSON, RFC 8259).

    Raises:
        ItfError: when the file is not UTF-8, not JSON (or nested past the recursion limit), or
            not a valid ITF trace.
        OSError: when the file cannot be read.
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ItfError(f"{path}: not UTF-8 text (RFC 8259 section 8.1): {exc.reason} at byte {exc.start}") from None
    try:
        trace = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ItfError(f"{path}: not JSON: {exc}") from None
    except RecursionError:
        raise ItfError(f"{path}: JSON nested deeper than this reader's recursion limit") from None
    try:
        validate_trace(trace)
    except RecursionError:
        raise ItfError(f"{path}: a value is nested deeper than the ITF validator's recursion limit") from None
    return trace
