"""``decodespec matrix``: the conformance matrix (cases and machines x runtimes) from the gate's report files.

Prints the text table and the summaries per runtime and per ladder layer
(:mod:`decodespec.checks.gate.matrix`); ``--format json`` prints the data; ``--write FILE`` writes the
docs page (``docs/matrix.md``); ``--check FILE`` compares FILE with the page the report files
give now.

Exit codes: 0 printed / written / up to date; 1 ``--check``: the page is stale (regenerate it
with ``--write``); 2 a report line that is not a JSON object.

Source: issue 18 item 3; research/formal-anchors-survey.md 4.4 (Bowtie, test262.fyi).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``matrix`` subcommand."""
    p = subparsers.add_parser(
        "matrix",
        help="the conformance matrix: every gate case against every runtime with a report in docs/results",
        description="Read the gate reports (docs/results/*.jsonl, written by pytest checks/ --report) and show each case's "
        "result per runtime (pass / dev / undec / FAIL / skip, with the ladder layer), the counts per runtime and per "
        "ladder layer, and whether a report was recorded on an older gate.",
    )
    p.add_argument("--results", type=Path, metavar="DIR", default=None, help="folder of gate reports (default docs/results)")
    p.add_argument("--format", choices=["text", "json", "markdown"], default="text", help="output format (default text)")
    p.add_argument("--write", type=Path, metavar="FILE", default=None, help="write the docs page (MyST Markdown) to FILE")
    p.add_argument("--check", type=Path, metavar="FILE", default=None,
                   help="exit 1 when FILE differs from the page the reports give now (a stale docs/matrix.md)")
    return p


def run(args: argparse.Namespace) -> int:
    """Build the matrix; print, write or check it."""
    from decodespec.checks.gate.matrix import build_matrix, render_markdown, render_text

    try:
        matrix = build_matrix(args.results)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"decodespec matrix: {exc}", file=sys.stderr)
        return 2
    page = render_markdown(matrix)
    if args.check is not None:
        current = args.check.read_text(encoding="utf-8") if args.check.is_file() else ""
        if current != page:
            print(f"decodespec matrix: {args.check} is stale: regenerate it with decodespec matrix --write {args.check}",
                  file=sys.stderr)
            return 1
        print(f"{args.check} is up to date")
        return 0
    if args.write is not None:
        args.write.write_text(page, encoding="utf-8")
        print(f"wrote {args.write}")
        return 0
    if args.format == "json":
        print(json.dumps(matrix.to_json(), indent=1, ensure_ascii=False))
    elif args.format == "markdown":
        sys.stdout.write(page)
    else:
        sys.stdout.write(render_text(matrix))
    return 0
