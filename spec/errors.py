"""Error taxonomy shared by spec, impl and checks (WebAssembly-interpreter style).

Three kinds, never mixed:

* ``Rejection``: a defined refusal; the caller's input or request is at fault (an invalid
  envelope, a disabled action, an out-of-range policy parameter).  Nothing changes.
* ``ResourceLimit``: a declared finite bound was reached (static-cache capacity, stream
  buffer, envelope byte size when it is a resource bound).  Nothing changes.
* ``AssertionError``: "cannot happen"; a bug in this project.  Never raised on purpose for
  caller input.

Every raised error carries a stable ``code`` (registered once in :data:`ERROR_CODES`, with the
seed section that motivates it), a JSON-path-like ``path`` naming the offending field (``"$"``
when the error is not about one field), and a human ``message``.  The codes are the API:
messages may be reworded, codes may not.

Every error also declares its **data classification** (M3.10 0x06, the trace passport; issue 16
item 5): :data:`MESSAGE_CLASSIFICATION` = ``"redacted"``, carried as ``data`` in :meth:`DecodeSpecError.to_json`.
A message quotes no user content -- prompt text, token ids, stop strings, decoded text, annotations:
such a value is shown by :func:`quote_content` as its length and a SHA-256 fingerprint, never a
prefix.  There is no opt-in to raw content in messages: the content stays in the file the error is
about (a content trace, a snapshot), which the error locates by its JSON path.

Source: M3.10 "Immutable request envelope and canonical identity" (typed rejection before
execution), M3.10 0x02 branch table ("typed rejection; no model, policy, RNG, cache, or stream
mutation").
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = [
    "ERROR_CODES",
    "MAX_MESSAGE_CHARS",
    "MAX_QUOTED_CHARS",
    "MESSAGE_CLASSIFICATION",
    "NOT_ENABLED",
    "DecodeSpecError",
    "ErrorCode",
    "Rejection",
    "ResourceLimit",
    "quote",
    "quote_content",
    "register_code",
]

#: Longest prefix of an offending value that an error message quotes, in characters of its
#: ``repr`` (M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data": a 1 MB stop string
#: must not come back as 1 MB of stderr).
MAX_QUOTED_CHARS = 64
#: Longest error message, in characters; a longer one is cut (with its length said) at
#: construction, so no message is unbounded even where a value was not quoted through :func:`quote`.
MAX_MESSAGE_CHARS = 1024


def _clip(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters, else its prefix, an ellipsis and the full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def quote(value: Any, limit: int = MAX_QUOTED_CHARS) -> str:
    """The ``repr`` of ``value`` for an error message, cut to ``limit`` characters.

    A long value is shown as its first ``limit`` characters, ``...`` and its length: a ``str``,
    ``bytes``, list, tuple or dict by its own length (characters, bytes or items), anything else by
    the length of its ``repr``.  The ``repr`` of a huge container is never built whole (its
    elements are quoted until ``limit`` characters are reached).

    Example: ``quote("x" * 10**6)`` is ``"'xxxx...xx'... (1000000 chars)"`` with 64 characters
    quoted.

    Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data".
    """
    if isinstance(value, (str, bytes, bytearray)):
        unit = "chars" if isinstance(value, str) else "bytes"
        if len(value) <= limit:
            return repr(value)
        return f"{repr(value[:limit])[:limit + 3]}... ({len(value)} {unit})"
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else value
        opening, closing = ("{", "}") if isinstance(value, dict) else ("(", ")") if isinstance(value, tuple) else ("[", "]")
        parts: list[str] = []
        size = 1
        for item in items:
            part = f"{quote(item[0], limit)}: {quote(item[1], limit)}" if isinstance(value, dict) else quote(item, limit)
            parts.append(part)
            size += len(part) + 2
            if size > limit:
                break
        text = opening + ", ".join(parts) + closing
        if size <= limit and len(parts) == len(value):
            return text
        return f"{text[:limit]}... ({len(value)} items)"
    return _clip(repr(value), limit)


#: The declared data classification of every error message (module docstring): no user content, fingerprints only.
MESSAGE_CLASSIFICATION = "redacted"


def quote_content(value: Any) -> str:
    """How an error message shows a value that is user content: its length and a 32-bit fingerprint.

    ``quote_content("my card is 4111 1111 1111 1111")`` is ``"<content: 30 chars, sha256 3f1c...>"``
    (the first 8 hex digits of SHA-256 of the UTF-8 bytes); a list (token ids) shows its length and the
    fingerprint of its JSON, an integer (one token id) the fingerprint of its decimal digits.  Never a
    prefix of the value (module docstring).
    """
    import hashlib
    import json

    if isinstance(value, str):
        data, size = value.encode("utf-8", "surrogatepass"), f"{len(value)} chars"
    elif isinstance(value, (bytes, bytearray)):
        data, size = bytes(value), f"{len(value)} bytes"
    else:
        try:
            data = json.dumps(value, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError, RecursionError):
            data = repr(type(value)).encode()
        size = f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else type(value).__name__
    return f"<content: {size}, sha256 {hashlib.sha256(data).hexdigest()[:8]}>"


@attrs.frozen
class ErrorCode:
    """One registered error code.

    Attributes:
        code: Stable dotted identifier, e.g. ``"envelope.duplicate_key"``.
        kind: ``"rejection"`` or ``"resource_limit"``.
        section: Seed section that motivates the rule, e.g. ``"M3.10 envelope"``.
        description: One sentence, rendered in the docs.
    """

    code: str
    kind: str = attrs.field(validator=attrs.validators.in_(("rejection", "resource_limit")))
    section: str
    description: str


#: Every error code that any module may raise, by code.  Filled by :func:`register_code` at
#: import time of the module that owns the code; the docs render this table and a test checks
#: that each code is documented exactly once.
ERROR_CODES: dict[str, ErrorCode] = {}


def register_code(code: str, kind: str, section: str, description: str) -> str:
    """Register an error code once and return it (so modules can write ``X = register_code(...)``).

    Raises:
        AssertionError: if ``code`` is registered twice with a different definition
            (a project bug, not caller input).
    """
    entry = ErrorCode(code=code, kind=kind, section=section, description=description)
    existing = ERROR_CODES.get(code)
    assert existing is None or existing == entry, f"error code {code!r} registered twice"
    ERROR_CODES[code] = entry
    return code


#: The guard of a transition is false (spec/transitions.py raises it; a runtime refuses with it).
NOT_ENABLED = register_code(
    "transition.not_enabled",
    "rejection",
    "M3.10 One request as a transition system",
    "The action's guard is false in this state (the failing guard clause is named); nothing changed.",
)


class DecodeSpecError(Exception):
    """Base of every typed error raised by decodespec.

    Args:
        code: A code registered in :data:`ERROR_CODES`.
        message: Human-readable explanation.
        path: JSON-path-like location of the offending field (``"$"`` for the whole input).
        details: Optional machine-readable context (must be JSON-serialisable).
    """

    kind = "rejection"

    def __init__(self, code: str, message: str, path: str = "$", details: dict[str, Any] | None = None):
        assert code in ERROR_CODES, f"unregistered error code {code!r}"
        message = _clip(str(message), MAX_MESSAGE_CHARS)
        path = _clip(str(path), MAX_MESSAGE_CHARS)
        super().__init__(f"[{code}] {path}: {message}")
        self.code = code
        self.message = message
        self.path = path
        self.details = dict(details or {})

    def to_json(self) -> dict[str, Any]:
        """The error as the CLI prints it: ``{"code", "path", "message", "data"}`` (``data``: :data:`MESSAGE_CLASSIFICATION`)."""
        return {"code": self.code, "path": self.path, "message": self.message, "data": MESSAGE_CLASSIFICATION}


class Rejection(DecodeSpecError):
    """The caller's input or request is invalid or the action is not enabled; nothing changed."""

    kind = "rejection"


class ResourceLimit(DecodeSpecError):
    """A declared finite bound would be exceeded; nothing changed."""

    kind = "resource_limit"
