"""Runtime structured-completion detector: incremental JSON status of the output bytes.

Implements rule ``invariant.json_completion`` (:mod:`decodespec.spec.structured`, M3.10 0x06
"Token stops, text stops, and structured stops"): after every output byte the detector says
``INCOMPLETE``, ``COMPLETE`` (one JSON value ended, unambiguously) or ``INVALID``; it consumes
nothing after ``COMPLETE`` or ``INVALID``.  Work is O(1) per byte; nothing is re-parsed.

Why not a library.  We evaluated the candidates on prefixes before writing this:

* ``ijson`` (yajl2_c push parser) is truly incremental, but reports grammar errors only when the
  *next lexeme* is complete (``[true f`` stays "incomplete" until ``false`` is read; ``[01`` until
  the closer), validates UTF-8 inside strings only at the closing quote, and accepts ``\\v`` /
  ``\\f`` as whitespace.
* ``jiter`` (re-parse of the whole prefix) is exact on grammar errors but scans string bodies
  lazily (``"\\u1x`` and ``"\\u1x"`` read as "EOF while parsing a string"), rejects lone
  surrogates, and costs O(prefix) per byte.
* ``partial-json-parser`` completes partial JSON leniently; it is not a validator.

None gives the exact prefix status the completion trigger needs, so the detector is written here
from the standard library: the stdlib strict incremental UTF-8 decoder validates string bodies,
``json.scanner.NUMBER_RE`` decides whether a number lexeme is complete, and a small container
stack tracks what may come next.  The spec's pure machine is an independent implementation; a
Hypothesis property test (``tests/test_structured_json.py``) compares them byte by byte.
"""

from __future__ import annotations

import codecs
import re
from json.scanner import NUMBER_RE

from decodespec.spec.structured import DEFAULT_MAX_JSON_DEPTH, JsonStatus

__all__ = ["JsonCompletionDetector", "utf8_pending"]

# A prefix of a JSON number (RFC 8259 section 6) that may still grow.
_NUMBER_PREFIX_RE = re.compile(rb"-|-?(?:0|[1-9][0-9]*)(?:\.|\.[0-9]+(?:[eE][-+]?[0-9]*)?|[eE][-+]?[0-9]*)?")
_NUMBER_RE = re.compile(NUMBER_RE.pattern.encode("ascii"))
_WHITESPACE = b" \t\n\r"
_LITERALS = (b"true", b"false", b"null")
_ESCAPES = b'"\\/bfnrtu'
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def utf8_pending(decoder: codecs.IncrementalDecoder) -> bytes:
    """Bytes an incremental UTF-8 decoder holds that may still become one character.

    CPython defers judging ``ED A0..BF`` (UTF-16 surrogates) until the third byte so that the
    ``surrogatepass`` handler can see the whole sequence; under RFC 3629 such a prefix is already
    invalid, so it is reported as not pending.
    """
    pending = decoder.getstate()[0]
    if len(pending) >= 2 and pending[0] == 0xED and pending[1] >= 0xA0:
        return b""
    return pending


class JsonCompletionDetector:
    """Incremental JSON completion detector over output bytes (impl of ``invariant.json_completion``).

    Args:
        max_depth: Bound on open objects plus arrays; opening one more makes the prefix INVALID.

    Attributes:
        status: :class:`~decodespec.spec.structured.JsonStatus` after the bytes consumed so far.
        num_bytes: Bytes consumed (nothing after COMPLETE or INVALID).
        completion_offset: ``num_bytes`` when the status became COMPLETE, else ``None``.

    Units: byte offsets into the output's UTF-8 bytes.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_JSON_DEPTH):
        self.max_depth = max_depth
        self.status = JsonStatus.INCOMPLETE
        self.num_bytes = 0
        self.completion_offset: int | None = None
        self._containers: list[int] = []     # b"{" / b"[" bytes, outermost first
        self._expect = "value"               # what the next non-whitespace byte must start
        self._lexeme: bytearray | None = None  # bytes of the current number or literal
        self._in_string = False
        self._key = False
        self._strict = codecs.getincrementaldecoder("utf-8")("strict")
        self._escape: int | None = None      # None; 0 after "\"; n >= 1 while reading \u hex digits

    # -- public ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> JsonStatus:
        """Consume output bytes until the status is no longer INCOMPLETE; return the status."""
        for byte in data:
            if self.status is not JsonStatus.INCOMPLETE:
                break
            self._consume(byte)
            self.num_bytes += 1
        return self.status

    def status_at_end(self) -> JsonStatus:
        """Status if the output ends now: a pending top-level number then completes (RFC 8259)."""
        if (self.status is JsonStatus.INCOMPLETE and self._lexeme is not None and not self._containers
                and self._lexeme[:1] not in (b"t", b"f", b"n") and _NUMBER_RE.fullmatch(bytes(self._lexeme))):
            return JsonStatus.COMPLETE
        return self.status

    # -- one byte ----------------------------------------------------------------------------
    def _consume(self, byte: int) -> None:
        if self._in_string:
            self._string(byte)
        elif self._lexeme is not None:
            self._scalar(byte)
        else:
            self._structural(byte)

    def _fail(self) -> None:
        self.status = JsonStatus.INVALID

    def _ended_value(self) -> None:
        if self._containers:
            self._expect = "comma_or_close"
        else:
            self.status = JsonStatus.COMPLETE
            self.completion_offset = self.num_bytes + 1

    def _string(self, byte: int) -> None:
        if self._escape is not None:
            if self._escape == 0:
                if byte not in _ESCAPES:
                    return self._fail()
                self._escape = 1 if byte == ord("u") else None
            elif byte not in _HEX_DIGITS:
                return self._fail()
            else:
                self._escape = None if self._escape == 4 else self._escape + 1
            return None
        try:
            char = self._strict.decode(bytes([byte]))
        except UnicodeDecodeError:
            return self._fail()
        if not char:
            if utf8_pending(self._strict) != self._strict.getstate()[0]:
                self._fail()
            return None
        if char == '"':
            self._in_string = False
            if self._key:
                self._key = False
                self._expect = "colon"
            else:
                self._ended_value()
        elif char == "\\":
            self._escape = 0
        elif ord(char) < 0x20:
            self._fail()
        return None

    def _scalar(self, byte: int) -> None:
        assert self._lexeme is not None
        grown = bytes(self._lexeme) + bytes([byte])
        if self._lexeme[:1] in (b"t", b"f", b"n"):
            literal = next(lit for lit in _LITERALS if lit[0] == self._lexeme[0])
            if not literal.startswith(grown):
                return self._fail()
            self._lexeme.append(byte)
            if grown == literal:
                self._lexeme = None
                self._ended_value()
            return None
        if _NUMBER_PREFIX_RE.fullmatch(grown):
            self._lexeme.append(byte)
            return None
        # ``byte`` does not extend the number: the number must be complete here.
        if not _NUMBER_RE.fullmatch(bytes(self._lexeme)):
            return self._fail()
        self._lexeme = None
        if not self._containers:
            if byte in _WHITESPACE:
                self._ended_value()
            else:
                self._fail()
            return None
        self._expect = "comma_or_close"
        return self._structural(byte)

    def _structural(self, byte: int) -> None:
        if byte in _WHITESPACE:
            return None
        expect = self._expect
        if expect == "colon":
            if byte != ord(":"):
                return self._fail()
            self._expect = "value"
            return None
        if expect == "comma_or_close":
            if byte == ord(","):
                self._expect = "key" if self._containers[-1] == ord("{") else "value"
            elif byte in b"]}":
                self._close(byte)
            else:
                self._fail()
            return None
        if expect in ("key", "key_or_close"):
            if byte == ord('"'):
                self._begin_string(key=True)
            elif expect == "key_or_close" and byte == ord("}"):
                self._close(byte)
            else:
                self._fail()
            return None
        # expect is "value" or "value_or_close"
        if expect == "value_or_close" and byte == ord("]"):
            return self._close(byte)
        if byte in b"{[":
            if len(self._containers) >= self.max_depth:
                return self._fail()
            self._containers.append(byte)
            self._expect = "key_or_close" if byte == ord("{") else "value_or_close"
        elif byte == ord('"'):
            self._begin_string(key=False)
        elif byte in b"-0123456789tfn":
            self._lexeme = bytearray([byte])
        else:
            self._fail()
        return None

    def _begin_string(self, *, key: bool) -> None:
        self._in_string = True
        self._key = key
        self._escape = None
        self._strict.reset()

    def _close(self, byte: int) -> None:
        opener = ord("{") if byte == ord("}") else ord("[")
        if not self._containers or self._containers[-1] != opener:
            return self._fail()
        self._containers.pop()
        self._ended_value()
        return None
