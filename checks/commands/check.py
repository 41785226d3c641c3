"""``decodespec check``: run the conformance gate (``pytest checks/``) and print a summary table.

One source of truth: the command runs pytest on the gate's own test modules (``checks/``) with
the same options (``--runtime``, ``--model``, ``--profile``, ``--report``, ``--trace-dir``), so
the CLI and ``pytest checks/`` run the same cases, machines and corpus.  Afterwards it prints
one row per case from the report (result, ladder layer, rule, check, message) and the counts.
``--report docs/results/<runtime>.jsonl`` is how the docs' conformance page gets its table.

Before pytest starts, the runtime name is checked and a ``stdio:CMD`` server's ``start``
handshake (an ``engine:CMD`` engine's ``hello``) is tried (:func:`~decodespec.checks.modelcheck.traces.check_runtime`): an unknown name, an empty
command, a command that cannot start or exits, or a bad handshake prints
``{"error": {"code", "path", "message"}}`` on stderr and exits 2 without running anything.

Exit codes: 2 an invalid runtime (above); otherwise pytest's (0 every case passed or is a
documented deviation, 1 a case failed, others: pytest usage or internal errors).

Source: docs/design.md section 9; research/formal-anchors-survey.md 4.4 (Bowtie ``summary``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

__all__ = ["register", "run", "summary_table"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand."""
    parser = subparsers.add_parser(
        "check",
        help="run the conformance gate against a runtime and print a summary table",
        description="Run `pytest checks/` (the case table, the lock-step machines, the trace corpus) for one runtime and "
        "model, and print one row per case.",
    )
    parser.add_argument("--runtime", default="impl", help="impl, hf, llamacpp, stdio:CMD or engine:CMD (default impl)")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default=None, help="default smollm2 when installed, else tiny")
    parser.add_argument("--profile", choices=["fast", "full", "ci"], default=None, help="Hypothesis profile (default fast)")
    parser.add_argument("--report", default=None, help="write the JSONL report here (e.g. docs/results/impl.jsonl)")
    parser.add_argument("--trace-dir", default=None, help="where failing runs write their traces (default traces/failures/)")
    parser.add_argument("-k", dest="keyword", default=None, help="only run tests matching this pytest -k expression")
    parser.add_argument("--cases-only", action="store_true", help="run only the case table (skip machines, corpus, explorer)")
    return parser


def summary_table(lines: list[dict]) -> str:
    """A fixed-width table of report lines, then the counts per result."""
    rows = [("result", "case", "layer", "rule", "check", "message")]
    for line in lines:
        rows.append((line["result"], line["case"] or "", line.get("layer") or "", line.get("rule") or "", line.get("check") or "",
                     (line.get("message") or line.get("reason") or "")[:70]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    out = ["  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows]
    counts: dict[str, int] = {}
    for line in lines:
        counts[line["result"]] = counts.get(line["result"], 0) + 1
    out.append("")
    out.append(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Check the runtime, run pytest on the gate, then print the summary table."""
    import sys

    import pytest

    from decodespec.checks.modelcheck.traces import RUNTIME_CHECKED_ENV, check_runtime
    from decodespec.spec.errors import DecodeSpecError

    try:
        check_runtime(args.runtime, args.model)
    except DecodeSpecError as exc:
        print(json.dumps({"runtime": args.runtime, "error": exc.to_json()}), file=sys.stderr)
        return 2

    checks_dir = Path(__file__).resolve().parent.parent
    report = args.report or os.path.join(tempfile.mkdtemp(prefix="decodespec-check-"), "report.jsonl")
    argv = [str(checks_dir / "test_gate.py") if args.cases_only else str(checks_dir), "--runtime", args.runtime, "--report", report,
            "-q", "-p", "no:cacheprovider", "--rootdir", str(checks_dir.parent), "-o", "addopts="]
    argv += ["--import-mode=importlib"]
    for option, value in (("--model", args.model), ("--profile", args.profile), ("--trace-dir", args.trace_dir), ("-k", args.keyword)):
        if value:
            argv += [option, value]
    previous = os.environ.get(RUNTIME_CHECKED_ENV)
    os.environ[RUNTIME_CHECKED_ENV] = args.runtime
    try:
        code = int(pytest.main(argv))
    finally:
        if previous is None:
            os.environ.pop(RUNTIME_CHECKED_ENV, None)
        else:
            os.environ[RUNTIME_CHECKED_ENV] = previous
    path = Path(report)
    if path.is_file():
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        print()
        print(summary_table(lines))
        if args.report:
            print(f"\nreport: {report}")
    return code
