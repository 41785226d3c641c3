"""M3.10 0x06 Structured completion: a pure incremental JSON completion state machine over bytes.

"A parser can report: incomplete but valid prefix, complete object, invalid prefix.  The
controller should not equate a closing brace token with semantic completion if it occurs inside
a string or nested object" (M3.10 0x06 "Token stops, text stops, and structured stops"), and
"A closing brace alone is not proof of JSON completion" ("Constraints before selection,
completion after selection").  This module is the reference for the *post-selection completion
detector*: it reads the UTF-8 bytes of the output one at a time and says, after every byte,
whether the bytes so far are

* ``INCOMPLETE``: a prefix of at least one JSON text (RFC 8259), not yet complete;
* ``COMPLETE``: one JSON value has ended and its end is unambiguous;
* ``INVALID``: no extension can be a JSON text.

Declared choices (each tested in ``tests/test_structured_*.py``):

* The grammar is RFC 8259 ``JSON-text = ws value ws`` with any value at top level; whitespace is
  exactly space, tab, LF and CR.  ``\\uXXXX`` takes any four hex digits (lone surrogates are
  grammatical, as in RFC 8259 section 8.2 and Python's ``json``).  String bodies must be
  well-formed UTF-8 (RFC 8259 section 8.1, RFC 3629 Table 3-7); control bytes below 0x20 are
  invalid inside strings.  An invalid byte is reported at that byte (eagerly), never at the end
  of the lexeme.
* Completion happens at the byte that ends the value: the closing ``}``/``]``/``"`` or the last
  letter of ``true``/``false``/``null``.  A top-level **number** is complete only at the
  whitespace byte that follows it (``123`` could still become ``1234``); at end of output it is
  complete (:func:`json_status_at_end`).  A number followed by any other byte at top level is
  invalid (``123}``).
* ``COMPLETE`` and ``INVALID`` are absorbing: the detector consumes nothing after them, so
  bytes after the value in the same token are not parsed (the output contract trims them, see
  :mod:`decodespec.spec.stop`).
* Nesting deeper than ``max_depth`` (a bound frozen at admission, M3.10 0x06 "Bound parsers,
  matchers, traces") makes the prefix ``INVALID`` at the opening byte that exceeds it.

The machine is a value (:class:`JsonState`) and a pure step function (:func:`json_step`); the
runtime twin is :class:`decodespec.impl.structured.JsonCompletionDetector` (written
independently; a property test compares them byte by byte).

Source: M3.10 0x06 "Token stops, text stops, and structured stops", "Constraints before
selection, completion after selection"; RFC 8259; RFC 3629.
"""

from __future__ import annotations

import enum

import attrs

from .rules import rule

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH",
    "JsonState",
    "JsonStatus",
    "json_initial",
    "json_prefix_status",
    "json_scan",
    "json_status_at_end",
    "json_step",
    "utf8_lead_info",
]

#: Default bound on JSON nesting depth (objects plus arrays open at once).
DEFAULT_MAX_JSON_DEPTH = 64

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
#: Number sub-states in which the number may end here.
_NUMBER_ACCEPTING = frozenset({"zero", "int", "frac", "exp"})


class JsonStatus(str, enum.Enum):
    """Status of a byte prefix under the JSON completion machine (M3.10 0x06)."""

    INCOMPLETE = "incomplete"
    COMPLETE = "complete"
    INVALID = "invalid"


def utf8_lead_info(byte: int) -> tuple[int, int, int] | None:
    """Well-formed UTF-8 lead byte: ``(num_continuations, first_lo, first_hi)`` or ``None``.

    ``first_lo..first_hi`` (inclusive) is the allowed range of the *first* continuation byte;
    later continuation bytes are always ``0x80..0xBF``.  ASCII bytes, continuation bytes and the
    never-valid bytes C0, C1, F5..FF return ``None``.

    Source: RFC 3629 section 4 / Unicode Table 3-7 (well-formed UTF-8 byte sequences).
    """
    if 0xC2 <= byte <= 0xDF:
        return (1, 0x80, 0xBF)
    if byte == 0xE0:
        return (2, 0xA0, 0xBF)
    if 0xE1 <= byte <= 0xEC or byte in (0xEE, 0xEF):
        return (2, 0x80, 0xBF)
    if byte == 0xED:
        return (2, 0x80, 0x9F)
    if byte == 0xF0:
        return (3, 0x90, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return (3, 0x80, 0xBF)
    if byte == 0xF4:
        return (3, 0x80, 0x8F)
    return None


@attrs.frozen
class JsonState:
    """State of the JSON completion machine after ``num_bytes`` bytes.

    Attributes:
        status: :class:`JsonStatus` of the bytes consumed so far.
        mode: What the next byte may be: ``"value"`` (a value; also the initial mode),
            ``"array_first"`` (a value or ``]``), ``"object_first"`` (a key or ``}``),
            ``"key"`` (a key after ``,``), ``"colon"``, ``"after_value"`` (``,`` or a closer),
            ``"string"``, ``"number"``, ``"literal"``.
        stack: Open containers, outermost first: ``"{"`` or ``"["``.
        is_key: In ``"string"`` mode, whether the string is an object key.
        escape: In a string: 0 none, 1 after ``\\``, 2..5 after ``\\u`` and ``escape - 2`` hex digits.
        utf8_need: In a string: continuation bytes still needed by the current character.
        utf8_lo, utf8_hi: Allowed range of the next continuation byte.
        number: In ``"number"`` mode: ``"minus"``, ``"zero"``, ``"int"``, ``"dot"``, ``"frac"``,
            ``"e"``, ``"esign"`` or ``"exp"``.
        literal: In ``"literal"`` mode: the bytes of ``true``/``false``/``null`` still expected.
        max_depth: Bound on ``len(stack)``.
        num_bytes: Bytes consumed (the machine stops consuming once not ``INCOMPLETE``).
        complete_offset: ``num_bytes`` when the state became ``COMPLETE``, else ``None``.

    Units: byte offsets into the output's UTF-8 bytes.
    """

    status: JsonStatus = JsonStatus.INCOMPLETE
    mode: str = "value"
    stack: tuple[str, ...] = ()
    is_key: bool = False
    escape: int = 0
    utf8_need: int = 0
    utf8_lo: int = 0x80
    utf8_hi: int = 0xBF
    number: str = ""
    literal: bytes = b""
    max_depth: int = DEFAULT_MAX_JSON_DEPTH
    num_bytes: int = 0
    complete_offset: int | None = None


def json_initial(max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> JsonState:
    """The state before any output byte (``INCOMPLETE``, expecting a value)."""
    return JsonState(max_depth=max_depth)


def _invalid(state: JsonState) -> JsonState:
    return attrs.evolve(state, status=JsonStatus.INVALID, num_bytes=state.num_bytes + 1)


def _value_end(state: JsonState, stack: tuple[str, ...]) -> JsonState:
    """A value ended at the byte being consumed: complete at top level, else expect , or closer."""
    n = state.num_bytes + 1
    if not stack:
        return attrs.evolve(state, status=JsonStatus.COMPLETE, mode="after_value", stack=(),
                            number="", literal=b"", num_bytes=n, complete_offset=n)
    return attrs.evolve(state, mode="after_value", stack=stack, number="", literal=b"", num_bytes=n)


def _open(state: JsonState, container: str) -> JsonState:
    if len(state.stack) + 1 > state.max_depth:
        return _invalid(state)
    mode = "object_first" if container == "{" else "array_first"
    return attrs.evolve(state, mode=mode, stack=state.stack + (container,), num_bytes=state.num_bytes + 1)


def _start_value(state: JsonState, byte: int) -> JsonState:
    """``byte`` (not whitespace) begins a value."""
    n = state.num_bytes + 1
    if byte == ord("{"):
        return _open(state, "{")
    if byte == ord("["):
        return _open(state, "[")
    if byte == ord('"'):
        return attrs.evolve(state, mode="string", is_key=False, escape=0, utf8_need=0, num_bytes=n)
    if byte == ord("-"):
        return attrs.evolve(state, mode="number", number="minus", num_bytes=n)
    if byte == ord("0"):
        return attrs.evolve(state, mode="number", number="zero", num_bytes=n)
    if byte in _DIGITS:
        return attrs.evolve(state, mode="number", number="int", num_bytes=n)
    if byte in _LITERALS:
        return attrs.evolve(state, mode="literal", literal=_LITERALS[byte], num_bytes=n)
    return _invalid(state)


def _close(state: JsonState, byte: int) -> JsonState:
    """``byte`` is ``}`` or ``]`` closing the innermost container, or invalid."""
    want = "{" if byte == ord("}") else "["
    if not state.stack or state.stack[-1] != want:
        return _invalid(state)
    return _value_end(state, state.stack[:-1])


def _string_byte(state: JsonState, byte: int) -> JsonState:
    n = state.num_bytes + 1
    if state.utf8_need:
        if not state.utf8_lo <= byte <= state.utf8_hi:
            return _invalid(state)
        return attrs.evolve(state, utf8_need=state.utf8_need - 1, utf8_lo=0x80, utf8_hi=0xBF, num_bytes=n)
    if state.escape == 1:
        if byte == ord("u"):
            return attrs.evolve(state, escape=2, num_bytes=n)
        if byte in _SIMPLE_ESCAPES:
            return attrs.evolve(state, escape=0, num_bytes=n)
        return _invalid(state)
    if state.escape >= 2:
        if byte not in _HEX:
            return _invalid(state)
        return attrs.evolve(state, escape=0 if state.escape == 5 else state.escape + 1, num_bytes=n)
    if byte == ord('"'):
        if state.is_key:
            return attrs.evolve(state, mode="colon", is_key=False, num_bytes=n)
        return _value_end(state, state.stack)
    if byte == ord("\\"):
        return attrs.evolve(state, escape=1, num_bytes=n)
    if byte < 0x20:
        return _invalid(state)
    if byte < 0x80:
        return attrs.evolve(state, num_bytes=n)
    lead = utf8_lead_info(byte)
    if lead is None:
        return _invalid(state)
    need, lo, hi = lead
    return attrs.evolve(state, utf8_need=need, utf8_lo=lo, utf8_hi=hi, num_bytes=n)


_NUMBER_NEXT: dict[str, dict[str, str]] = {
    # sub-state -> {byte class -> next sub-state}; a missing entry ends (or invalidates) the number.
    "minus": {"0": "zero", "1-9": "int"},
    "zero": {".": "dot", "e": "e"},
    "int": {"0": "int", "1-9": "int", ".": "dot", "e": "e"},
    "dot": {"0": "frac", "1-9": "frac"},
    "frac": {"0": "frac", "1-9": "frac", "e": "e"},
    "e": {"sign": "esign", "0": "exp", "1-9": "exp"},
    "esign": {"0": "exp", "1-9": "exp"},
    "exp": {"0": "exp", "1-9": "exp"},
}


def _number_class(byte: int) -> str | None:
    if byte == ord("0"):
        return "0"
    if byte in _DIGITS:
        return "1-9"
    if byte == ord("."):
        return "."
    if byte in (ord("e"), ord("E")):
        return "e"
    if byte in (ord("+"), ord("-")):
        return "sign"
    return None


def _number_byte(state: JsonState, byte: int) -> JsonState:
    nxt = _NUMBER_NEXT[state.number].get(_number_class(byte) or "")
    if nxt is not None:
        return attrs.evolve(state, number=nxt, num_bytes=state.num_bytes + 1)
    if state.number not in _NUMBER_ACCEPTING:
        return _invalid(state)
    if not state.stack:
        # Top level: only whitespace delimits a number (anything else is trailing garbage).
        return _value_end(state, ()) if byte in _WS else _invalid(state)
    # Inside a container the byte that ends the number is read again as "after value".
    return json_step(attrs.evolve(state, mode="after_value", number=""), byte)


@rule(
    "invariant.json_completion",
    title="JSON completion only at the real end of a value",
    section="M3.10 0x06 Token stops, text stops, and structured stops",
    statement=(
        "The structured completion detector reports COMPLETE exactly at the byte that ends one "
        "top-level JSON value (RFC 8259): a closing brace inside a string or a nested object is "
        "not completion; a top-level number completes only at a following whitespace byte or at "
        "end of output; INVALID is reported at the first byte no extension can accept."
    ),
)
def json_step(state: JsonState, byte: int) -> JsonState:
    """Consume one output byte.

    Args:
        state: The machine state; a non-``INCOMPLETE`` state is returned unchanged (absorbing).
        byte: One byte, ``0 <= byte < 256``.

    Returns:
        The next state (``num_bytes`` advanced by one unless ``state`` was absorbing).

    Raises:
        AssertionError: for a byte outside ``[0, 256)`` (a caller bug, not model output).

    Source: RFC 8259 sections 2-7 (grammar), 8.1 (UTF-8); M3.10 0x06.
    """
    assert 0 <= byte < 256, byte
    if state.status is not JsonStatus.INCOMPLETE:
        return state
    mode = state.mode
    if mode == "string":
        return _string_byte(state, byte)
    if mode == "number":
        return _number_byte(state, byte)
    if mode == "literal":
        if byte != state.literal[0]:
            return _invalid(state)
        if len(state.literal) == 1:
            return _value_end(state, state.stack)
        return attrs.evolve(state, literal=state.literal[1:], num_bytes=state.num_bytes + 1)
    if byte in _WS:
        return attrs.evolve(state, num_bytes=state.num_bytes + 1)
    n = state.num_bytes + 1
    if mode == "value":
        return _start_value(state, byte)
    if mode == "array_first":
        return _close(state, byte) if byte == ord("]") else _start_value(state, byte)
    if mode in ("object_first", "key"):
        if byte == ord('"'):
            return attrs.evolve(state, mode="string", is_key=True, escape=0, utf8_need=0, num_bytes=n)
        if mode == "object_first" and byte == ord("}"):
            return _close(state, byte)
        return _invalid(state)
    if mode == "colon":
        return attrs.evolve(state, mode="value", num_bytes=n) if byte == ord(":") else _invalid(state)
    assert mode == "after_value", mode
    if byte == ord(","):
        return attrs.evolve(state, mode="key" if state.stack[-1] == "{" else "value", num_bytes=n)
    if byte in (ord("}"), ord("]")):
        return _close(state, byte)
    return _invalid(state)


def json_scan(data: bytes, state: JsonState | None = None, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> JsonState:
    """Feed ``data`` byte by byte from ``state`` (or the initial state), stopping once absorbing.

    Returns:
        The final state; ``num_bytes`` tells how many bytes of ``data`` plus earlier input were
        consumed.
    """
    st = state if state is not None else json_initial(max_depth)
    for byte in data:
        if st.status is not JsonStatus.INCOMPLETE:
            break
        st = json_step(st, byte)
    return st


def json_prefix_status(data: bytes, *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> tuple[JsonStatus, int | None]:
    """Status of the byte prefix ``data`` and, when complete, the byte offset of completion.

    Returns:
        ``(status, complete_offset)``: ``complete_offset`` is the number of bytes consumed when
        the status became ``COMPLETE`` (bytes after it are not parsed), else ``None``.
    """
    st = json_scan(data, max_depth=max_depth)
    return st.status, st.complete_offset


def json_status_at_end(state: JsonState) -> JsonStatus:
    """Status if the output ends after ``state``: a pending top-level number then completes.

    Returns:
        ``COMPLETE`` when ``state`` is complete or is an accepting top-level number, ``INVALID``
        when invalid, else ``INCOMPLETE``.
    """
    if state.status is not JsonStatus.INCOMPLETE:
        return state.status
    if state.mode == "number" and not state.stack and state.number in _NUMBER_ACCEPTING:
        return JsonStatus.COMPLETE
    return JsonStatus.INCOMPLETE
