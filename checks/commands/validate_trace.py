"""``decodespec validate-trace FILE``: replay a runtime event trace against the spec and print the verdict.

Reads a ``decodespec.events.v1`` trace (``decodespec generate --trace FILE``), runs
:func:`decodespec.checks.trace_validation.validate_trace` and prints the
:class:`~decodespec.checks.trace_validation.TraceVerdict` as one JSON object: ``accepted``,
``num_lines``, ``consumed``, and for a rejected trace the first unmatched ``line`` (1-based),
its ``seq`` and ``event``, and the ``reason`` (the failing guard or the disagreeing field).

Exit codes: 0 accepted, 1 rejected, 2 the file cannot be read.

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
        "keeping every candidate spec state per line; print the verdict as JSON (exit 0 accepted, 1 rejected).",
    )
    parser.add_argument("file", help="the NDJSON trace file")
    return parser


def run(args: argparse.Namespace) -> int:
    """Validate the trace and print the verdict; returns the exit code."""
    from decodespec.checks.trace_validation import validate_trace
    from decodespec.impl.events import read_events

    try:
        lines = read_events(args.file)
    except (OSError, UnicodeDecodeError) as exc:
        print(json.dumps({"error": {"code": "trace.unreadable", "path": "$", "message": str(exc)}}), file=sys.stderr)
        return 2
    verdict = validate_trace(lines)
    print(json.dumps(verdict.to_json(), ensure_ascii=False))
    return 0 if verdict.accepted else 1
