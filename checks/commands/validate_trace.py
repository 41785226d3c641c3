"""``decodespec validate-trace FILE``: replay a runtime event trace against the spec and print the verdict.

Reads a ``decodespec.events.v1`` trace (``decodespec generate --trace FILE``), runs
:func:`decodespec.checks.modelcheck.trace_validation.validate_trace` and prints the
:class:`~decodespec.checks.modelcheck.trace_validation.TraceVerdict` as one JSON object: ``accepted``,
``num_lines``, ``consumed``, and for a rejected trace the first unmatched ``line`` (1-based),
its ``seq`` and ``event``, the refusal ``code`` and the ``reason`` (the failing guard, the
schema error with its JSON path, or the disagreeing field).  Refusal codes: ``trace.schema`` (a
line outside the published schema ``spec/schemas/events.v1.json``: closed field sets, the header's
``format``), ``trace.receipt`` (a decision's embedded receipt is not that decision's, or names another
policy than the header's by its ``policy_digest``),
``trace.incomplete`` (the trace ends before the request is terminal, or without the ``finish``
event that reports it: ``line`` is then ``num_lines + 1``), ``trace.invalid_header`` and
``trace.mismatch`` (no spec state matches the line).

The verdict also carries the trace's ``classification`` (its passport, the header's ``data``:
``redacted``, the default of ``generate --trace``, or ``content`` with ``--trace-content``) and,
for a redacted trace, ``needs_content``: ``{"code": "trace.redacted", "checks", "message"}``, the
checks that need the token bytes and text the trace replaced by digests (stop oracle, chunk text,
stream frontier and final text), which were not run; everything else is checked on the digests.
An unknown classification is refused with ``data.unknown_classification`` at ``$.data.classification``.

``--tokenizer {auto,smollm2,tiny,none}`` supplies the token bytes for the stream-content and
stop-oracle checks (``auto``: the model named in the header's ``runtime``; ``none``: structure
only).

Exit codes: 0 accepted, 1 rejected, 2 the file (or the named tokenizer) cannot be read, or the
trace is of a procedure trace validation does not replay (``trace.unsupported``: a beam-search
trace, whose ``beam_step`` events do not record the score rows the spec's beam step needs); the
error is printed to stderr as ``{"error": {"code", "path", "message", ...}}``.

Source: docs/design.md section 6.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``validate-trace`` subcommand."""
    parser = subparsers.add_parser(
        "validate-trace",
        help="check a runtime event trace (decodespec.events.v1) against the spec state machine",
        description="Replay an event trace written by `decodespec generate --trace FILE` against the spec's transitions, "
        "keeping every candidate spec state per line; print the verdict as JSON (exit 0 accepted, 1 rejected, 2 unreadable "
        "or unsupported: beam-search traces).",
    )
    parser.add_argument("file", help="the NDJSON trace file")
    parser.add_argument("--tokenizer", choices=("auto", "smollm2", "tiny", "none"), default="auto",
                        help="token bytes for the stream / stop-string checks (default: the header's runtime model)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the trace and print the verdict; returns the exit code."""
    from decodespec.checks.modelcheck.trace_validation import TRACE_UNREADABLE, validate_trace
    from decodespec.impl.events import read_events

    try:
        lines = read_events(args.file)
    except (OSError, UnicodeDecodeError) as exc:
        print(json.dumps({"error": {"code": TRACE_UNREADABLE, "path": "$", "message": str(exc)}}), file=sys.stderr)
        return 2
    from decodespec.spec.errors import DecodeSpecError

    try:
        token_bytes = _token_bytes(args.tokenizer, lines)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 2
    try:
        verdict = validate_trace(lines, token_bytes=token_bytes)
    except DecodeSpecError as exc:  # trace.unsupported
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 2
    print(printable_json(verdict.to_json()))
    return 0 if verdict.accepted else 1


def printable_json(obj) -> str:
    """``json.dumps(obj, ensure_ascii=False)``, or its ASCII form when a string holds a lone surrogate (from a hostile
    file or file name), which no UTF-8 stream can write."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj)
    return text


def _token_bytes(choice: str, lines: list[str]):
    """The token-bytes function for ``choice`` (``auto``: the header's ``runtime.model``), or ``None``."""
    from decodespec.checks.modelcheck.trace_validation import token_bytes_of

    auto = choice == "auto"
    try:
        header = json.loads(lines[0])
        redacted = header.get("data", {}).get("classification") == "redacted"
    except (IndexError, ValueError, AttributeError, RecursionError):
        header, redacted = {}, False
    if redacted:  # digests, not ids: no token has bytes to look up (the verdict's needs_content says what is skipped)
        return None
    if auto:
        try:
            choice = str(header.get("runtime", {}).get("model", "none"))
        except AttributeError:
            choice = "none"
    if choice == "tiny":
        from decodespec.impl.tiny import TINY_VOCAB_SIZE
        from decodespec.impl.tokenizer import ByteTokenizer

        return token_bytes_of(ByteTokenizer(TINY_VOCAB_SIZE))
    if choice == "smollm2":
        from decodespec.impl.gguf import smollm2_available
        from decodespec.impl.tokenizer import load_smollm2_tokenizer

        return None if auto and not smollm2_available() else token_bytes_of(load_smollm2_tokenizer())
    return None
