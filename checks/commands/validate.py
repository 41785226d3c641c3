"""``decodespec validate FILE``: validate a ``numinens.request.v1`` envelope and print its identity.

Prints ``{"ok": true, "identity": "sha256:<hex>"}`` and exits 0, or prints
``{"ok": false, "error": {"code", "path", "message"}}`` and exits 2 (a typed rejection or
resource limit; ``cli.io_error`` for a file that cannot be read; see :mod:`decodespec.checks.commands.cli`).
At most ``MAX_ENVELOPE_BYTES + 1`` bytes are read from the file or stdin.  ``--print-schema`` prints the published
JSON Schema; ``--write-schema`` regenerates ``spec/schemas/request.v1.json`` from the Python
definition (which embeds the M3.8 policy schema).

Source: M3.10 "Immutable request envelope and canonical identity"; :mod:`decodespec.spec.envelope`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``validate`` subcommand."""
    p = subparsers.add_parser(
        "validate",
        help="validate a request envelope (numinens.request.v1) and print its identity",
        description="Check the raw bytes (UTF-8, size, depth, duplicate keys, finite numbers), the closed JSON Schema "
        "and the semantic rules, then print the domain-separated SHA-256 identity of the RFC 8785 canonical bytes.",
    )
    p.add_argument("file", nargs="?", type=Path, help="envelope JSON file ('-' for stdin)")
    p.add_argument("--print-schema", action="store_true", help="print the published JSON Schema and exit")
    p.add_argument("--write-schema", action="store_true", help="regenerate spec/schemas/request.v1.json and exit")
    return p


def run(args: argparse.Namespace) -> int:
    """Validate ``args.file``; print the JSON verdict."""
    from decodespec.spec.envelope import SCHEMA_PATH, schema_text, validate_request_envelope
    from decodespec.spec.errors import DecodeSpecError

    if args.print_schema:
        sys.stdout.write(schema_text())
        return 0
    if args.write_schema:
        SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
        print(json.dumps({"ok": True, "written": str(SCHEMA_PATH)}))
        return 0
    from decodespec.checks.commands.cli import IO_ERROR
    from decodespec.spec.envelope import MAX_ENVELOPE_BYTES

    if args.file is None:
        print(json.dumps({"ok": False, "error": {"code": "runtime.invalid_request", "path": "$",
                                                  "message": "give FILE ('-' for stdin), --print-schema or --write-schema"}}))
        return 2
    try:
        # At most one byte past the limit: enough for envelope.too_large, never the whole of /dev/zero.
        if str(args.file) == "-":
            raw = sys.stdin.buffer.read(MAX_ENVELOPE_BYTES + 1)
        else:
            with args.file.open("rb") as fh:
                raw = fh.read(MAX_ENVELOPE_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(json.dumps({"ok": False, "error": {"code": IO_ERROR, "path": "$", "message": f"cannot read {args.file}: {reason}"}}))
        return 2
    try:
        _, identity = validate_request_envelope(raw)
    except DecodeSpecError as exc:
        print(json.dumps({"ok": False, "error": exc.to_json()}))
        return 2
    print(json.dumps({"ok": True, "identity": identity}))
    return 0
