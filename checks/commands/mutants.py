"""``decodespec mutants``: run the conformance gate against every failure-lab mutant and print who killed it.

For each mutant (:mod:`decodespec.checks.lab.mutants`) the gate -- the case table, then the
lock-step machines of every cache family, under the active Hypothesis profile (``fast`` by
default) -- runs with the mutant installed until its first failed check
(:func:`decodespec.checks.lab.mutants.harness.run_gate`).  The table lists the mutant, its seed
section, the outcome (``killed`` / ``SURVIVED`` / ``CRASHED`` / ``SEAM MOVED``), the first check
that killed it with its ladder layer and check, and the time to kill; the summary gives the kill
rate and the median time to kill.  A check that fails under a mutant is re-run once without it
(remembered): if it fails there too it is no evidence, is skipped and listed as excluded.

Options: ``--model tiny|smollm2`` (on SmolLM2 the default set is the mutants that need real
text: stop strings, UTF-8, padding; ``--all`` runs every one), ``--only NAME ...``, ``--group
GROUP``, ``--json`` (one JSON object per mutant, then a summary object), ``--report FILE``
(``docs/results/failure-lab.jsonl`` lines; ``--append`` adds to the file), ``--traces DIR``
(counterexample traces of the machines), ``--max-examples N`` (machine budget), ``--list``.

Exit codes: 0 every mutant run was killed, 1 a mutant survived, crashed or its seam moved,
2 an unknown mutant or group.

Source: M3.10 0x0B, M3.8 0x12 (failure labs); docs/design.md section 9.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``mutants`` subcommand."""
    parser = subparsers.add_parser(
        "mutants",
        help="run the gate against the failure-lab mutants (shape-correct bugs it must kill)",
        description="Install each failure-lab mutant of the runtime, run the conformance gate (case table, then the "
        "lock-step machines) until its first failure, and print which check killed it and how fast.",
    )
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="the model the gate runs (default tiny)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=(), help="run only these mutants (names or mutant.* ids)")
    parser.add_argument("--group", help="run only one group of the failure lab")
    parser.add_argument("--all", action="store_true", help="with --model smollm2: every mutant, not only those needing real text")
    parser.add_argument("--json", action="store_true", help="one JSON object per mutant, then a summary object")
    parser.add_argument("--report", metavar="FILE", help="write docs/results-style JSON lines ({mutant, killed, killed_by, ...})")
    parser.add_argument("--append", action="store_true", help="append to --report instead of replacing it")
    parser.add_argument("--traces", metavar="DIR", help="keep the machines' counterexample traces here")
    parser.add_argument("--max-examples", type=int, metavar="N", help="machine budget per cache family (default: the profile's)")
    parser.add_argument("--no-calibrate", action="store_true", help="count a failing check without re-running it unmutated")
    parser.add_argument("--list", action="store_true", help="list the mutants (name, group, section) and exit")
    return parser


def _selected(args: argparse.Namespace):
    from decodespec.checks.lab.mutants import GROUPS, MUTANTS, get

    if args.group is not None and args.group not in GROUPS:
        raise KeyError(f"unknown group {args.group!r}; groups: {', '.join(GROUPS)}")
    chosen = [get(name) for name in args.only] if args.only else list(MUTANTS.values())
    if args.group is not None:
        chosen = [m for m in chosen if m.group == args.group]
    if args.model == "smollm2" and not args.all and not args.only:
        chosen = [m for m in chosen if m.text]
    return chosen


def run(args: argparse.Namespace) -> int:
    """Run the gate against the selected mutants; print the table (or JSON); returns the exit code."""
    try:
        chosen = _selected(args)
    except KeyError as exc:
        if args.json:
            print(json.dumps({"error": {"code": "runtime.invalid_request", "path": "$.only" if args.only else "$.group",
                                        "message": str(exc.args[0])}}, ensure_ascii=False))
        else:
            print(f"decodespec mutants: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.rule_id:45s} {m.group:22s} {m.section}")
        return 0
    if args.model == "smollm2":
        from decodespec.impl.gguf import smollm2_available

        if not smollm2_available():
            from decodespec.checks.testing import SMOLLM2_SKIP_REASON

            print(f"decodespec mutants: {SMOLLM2_SKIP_REASON}", file=sys.stderr)
            return 3
    from decodespec.checks.lab.mutants.harness import Calibration, gate_checks, run_gate

    overrides = {} if args.max_examples is None else {"max_examples": args.max_examples}
    checks = {runtime: gate_checks(args.model, runtime=runtime) for runtime in sorted({m.runtime for m in chosen})}  # impl-tp: its own gate
    calibration = None if args.no_calibrate else Calibration(overrides)
    results = []
    if not args.json:
        print(f"{'mutant':38s} {'section':44s} {'outcome':10s} {'killed by':36s} {'layer / check':32s} {'time':>7s}")
    for m in chosen:
        result = run_gate(m, args.model, checks=checks[m.runtime], calibration=calibration, trace_dir=args.traces, settings_overrides=overrides)
        results.append(result)
        line = result.report_line()
        if args.json:
            print(json.dumps({**line, "killed_by_detail": result.killed_by}, ensure_ascii=False), flush=True)
        else:
            by = result.killed_by or {}
            outcome = result.outcome if result.killed else result.outcome.upper().replace("_", " ")
            layer = f"{by.get('layer')} {by.get('ladder_check')}" if result.killed else (result.crash or "")[:32]
            head = m.section.split(";")[0]  # the primary seed section, without its gloss unless it is a bare id
            section = head.split(" (")[0] if len(head.split(" (")[0].split()) > 2 else head
            print(f"{m.name:38s} {section[:44]:44s} {outcome:10s} {str(by.get('check', ''))[:36]:36s} {layer[:32]:32s} "
                  f"{result.seconds:6.2f}s", flush=True)
    if calibration is not None:
        for check, why in calibration.failing.items():
            print(f"decodespec mutants: excluded {check} (fails without a mutant: {why})", file=sys.stderr)
    summary = _summary(results, args.model, calibration)
    if args.report:
        path = Path(args.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if args.append else "w", encoding="utf-8") as fh:
            for result in results:
                fh.write(json.dumps(result.report_line(), ensure_ascii=False, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps({"summary": summary}, ensure_ascii=False))
    else:
        print(f"\n{summary['killed']}/{summary['mutants']} killed ({summary['kill_rate']:.0%}) on {args.model}; median time to kill "
              f"{summary['median_seconds_to_kill']}s; survived {summary['survived'] or 'none'}; crashed {summary['crashed'] or 'none'}; "
              f"seam moved {summary['seam_moved'] or 'none'}")
    return 0 if summary["killed"] == summary["mutants"] else 1


def _summary(results, model: str, calibration) -> dict:
    killed = [r for r in results if r.killed]
    times = [r.seconds for r in killed]
    return {
        "model": model,
        "mutants": len(results),
        "killed": len(killed),
        "kill_rate": len(killed) / len(results) if results else 0.0,
        "median_seconds_to_kill": round(statistics.median(times), 3) if times else None,
        "survived": [r.mutant for r in results if r.outcome == "survived"],
        "crashed": [r.mutant for r in results if r.outcome == "crashed"],
        "seam_moved": [r.mutant for r in results if r.outcome == "seam_moved"],
        "weak_crashes": [r.mutant for r in results if r.crash],
        "excluded_checks": sorted(calibration.failing) if calibration is not None else [],
    }
