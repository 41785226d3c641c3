"""``decodespec replay FILE``: re-run a conformance trace against the spec and a runtime; exit 0 iff its verdict reproduces.

Reads a ``decodespec.trace`` ITF file (:mod:`decodespec.checks.modelcheck.traces`: a shrunk Hypothesis
counterexample from ``traces/failures/``, a failing gate case, or a corpus file under
``traces/``), replays its actions in lock step against the spec and the recorded runtime (or
``--runtime``), and prints ``{"reproduced", "runtime", "steps", "expected", "actual"}`` as JSON.
A trace may record a pass, a failure at a ladder layer, or an undecided margin; replay
reproduces it when the result, the layer and the rule are the same.  A trace recorded under a
failure-lab mutant (``#meta.mutant``, written by ``pytest checks/ --mutant NAME``) is replayed
with that mutant installed again; the command says so on stderr and the JSON carries ``mutant``.

Replay never starts a process that a file names: a trace recorded on ``stdio:CMD`` or
``engine:CMD`` is refused (``trace.runtime_not_allowed``, exit 2, before anything runs) unless the
user names that runtime with ``--runtime 'stdio:CMD'`` / ``--runtime 'engine:CMD'`` or allows the
command with ``--allow-runtime CMD``.

A trace whose verdict rests on bit-exact float32 values (``#meta.exact_floats``) recorded under
another torch CPU capability (``#meta.cpu_capability``) that does not reproduce is reported as
such: the JSON carries ``cannot_reproduce_here`` and stderr says so plainly (exit 3).

Exit codes: 0 reproduced, 1 not reproduced, 2 not a readable trace of this format version (or a
``stdio`` / ``engine`` runtime the user did not name), 3 the runtime is not installed here, or this process's
CPU kernels cannot reproduce the trace's bit-exact verdict.

Source: research/formal-anchors-survey.md 2.7 (no upstream "replay this trace file" entry point:
this fills it), 5.1 (ITF).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a conformance trace (decodespec.trace ITF) and check that its verdict reproduces",
        description="Re-run a trace's actions in lock step against the spec and the recorded runtime; exit 0 exactly when "
        "the recorded verdict (result, ladder layer, rule) reproduces. A trace recorded under a failure-lab mutant "
        "(#meta.mutant) is replayed with that mutant installed.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="trace file(s) (*.itf.json)")
    parser.add_argument("--runtime", default=None, help="replay against this runtime instead of the recorded one")
    parser.add_argument("--allow-runtime", action="append", default=[], metavar="CMD",
                        help="let a trace whose #meta.runtime is stdio:CMD or engine:CMD start CMD (exactly this command line; "
                        "repeatable). Without it (or --runtime 'stdio:CMD' / 'engine:CMD') replay refuses such a trace with trace.runtime_not_allowed: "
                        "it never starts a process a file names")
    return parser


def run(args: argparse.Namespace) -> int:
    """Replay every file; print one JSON object per file; return the worst exit code."""
    from decodespec.checks.adapters import AdapterUnavailable
    from decodespec.checks.commands.validate_trace import printable_json
    from decodespec.checks.modelcheck.traces import load_trace, replay
    from decodespec.spec.errors import DecodeSpecError

    worst = 0
    for path in args.files:
        try:
            trace = load_trace(path)
            mutant = trace["#meta"].get("mutant")
            if mutant:
                print(f"decodespec replay: {path}: installing failure-lab mutant {mutant} (recorded in #meta.mutant)",
                      file=sys.stderr)
            result = replay(trace, runtime=args.runtime, allow_commands=tuple(args.allow_runtime))
        except AdapterUnavailable as exc:
            print(json.dumps({"file": path, "error": {"code": "adapter.unavailable", "message": str(exc)}}), file=sys.stderr)
            worst = max(worst, 3)
            continue
        except DecodeSpecError as exc:
            print(json.dumps({"file": path, "error": exc.to_json()}), file=sys.stderr)
            worst = max(worst, 2)
            continue
        print(printable_json({"file": path, **result.to_json()}))
        if result.cannot_reproduce_here:
            print(f"decodespec replay: {path}: this machine cannot reproduce the recorded verdict: {result.cannot_reproduce_here}",
                  file=sys.stderr)
        worst = max(worst, 0 if result.reproduced else 3 if result.cannot_reproduce_here else 1)
    return worst
