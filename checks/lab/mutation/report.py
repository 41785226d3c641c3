"""Summarise Cosmic Ray sessions and re-test their survivors against added gate checks.

``python -m decodespec.checks.lab.mutation.report summary SESSION.sqlite ... --out FILE.json``
    One record per module: mutants generated, left out of a sample (``sample_filter``), skipped as
    equivalent (annotations), killed,
    timed out, survived, incompetent, pending; and one record per mutant (job id, operator,
    occurrence, position, outcome, the first failing test of a killed mutant, the diff of a
    survivor).  Prints a Markdown table.

``python -m decodespec.checks.lab.mutation.report recheck SESSION.sqlite --command CMD --out FILE.json``
    Re-runs every survivor of the session under ``CMD`` (for example the gate file added to
    kill them) with Cosmic Ray's own ``mutate_and_test`` (apply, run, restore the file) and
    records which are killed now.  The session is not modified.

Both read the session through Cosmic Ray's ``WorkDB`` (no schema of our own).

Source: docs/results/mutation.md; Cosmic Ray 8.7 (``cosmic_ray.work_db``, ``cosmic_ray.mutating``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome

_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def _outcome(result) -> str:
    if result is None:
        return "pending"
    if result.worker_outcome is WorkerOutcome.SKIPPED:
        # sample_filter marks the mutants it leaves out "not sampled: ..."; annotation_filter's are equivalent.
        return "not_sampled" if (result.output or "").startswith("not sampled") else "equivalent"
    if result.worker_outcome is not WorkerOutcome.NORMAL:
        return result.worker_outcome.value
    if result.test_outcome is TestOutcome.KILLED:
        return "timeout" if result.output == "timeout" else "killed"
    return result.test_outcome.value


def _killer(output: str | None) -> str | None:
    """The first failing test of a killed run, or why it failed before any test ran."""
    text = output or ""
    found = _FAILED.search(text)
    if found:
        return found.group(1)
    if "SyntaxError" in text:
        return "SyntaxError (the mutant does not compile)"
    lines = [line for line in text.splitlines() if line.strip()]
    # Cosmic Ray keeps stdout only: pytest's import error (e.g. a SyntaxError from ``*`` in a
    # signature turned into ``//``) goes to stderr and leaves stdout empty.
    return lines[-1][:200] if lines else "no test ran: importing the mutated module failed (pytest wrote nothing to stdout)"


def _records(session: str) -> list[dict]:
    with use_db(session, WorkDB.Mode.open) as db:
        results = dict(db.results)
        out = []
        for item in db.work_items:
            (m,) = item.mutations
            result = results.get(item.job_id)
            outcome = _outcome(result)
            rec = {"job_id": item.job_id, "module": str(m.module_path), "operator": m.operator_name,
                   "occurrence": m.occurrence, "line": m.start_pos[0], "col": m.start_pos[1], "outcome": outcome}
            if outcome == "killed":
                rec["killed_by"] = _killer(result.output)
            if outcome == "survived":
                rec["diff"] = result.diff
            out.append(rec)
    return out


def summary(sessions: list[str], out: str | None) -> dict:
    """Per-module counts and per-mutant records of ``sessions`` (written to ``out`` when given)."""
    modules: dict[str, dict] = {}
    mutants = []
    for session in sessions:
        for rec in _records(session):
            counts = modules.setdefault(rec["module"], {"generated": 0})
            counts["generated"] += 1
            counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
            mutants.append(rec)
    doc = {"tool": "cosmic-ray 8.7.0", "modules": modules, "mutants": mutants}
    if out:
        Path(out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    cols = ["generated", "not_sampled", "equivalent", "killed", "timeout", "survived", "incompetent", "pending"]
    print("| module | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, counts in modules.items():
        print(f"| {name} | " + " | ".join(str(counts.get(c, 0)) for c in cols) + " |")
    return doc


def recheck(session: str, command: str, timeout: float, out: str, outcomes: tuple[str, ...] = ("survived", "timeout"),
            start: int = 0) -> list[dict]:
    """Run each mutant of ``session`` whose outcome is in ``outcomes`` under ``command``.

    Writes ``{"command", "rechecked": [{job_id, module, operator, occurrence, line, was, outcome, killed_by}]}``
    (``was``: the session's outcome; a timed-out mutant is re-run to see a check fail on it).
    ``start`` skips the first mutants of that list (to continue an interrupted re-check).
    """
    with use_db(session, WorkDB.Mode.open) as db:
        results = dict(db.results)
        survivors = [(item, _outcome(results.get(item.job_id))) for item in db.work_items
                     if _outcome(results.get(item.job_id)) in outcomes][start:]
    done = []
    for item, was in survivors:
        (m,) = item.mutations
        result = mutate_and_test(item.mutations, command, timeout)
        outcome = _outcome(result)
        done.append({"job_id": item.job_id, "module": str(m.module_path), "operator": m.operator_name, "occurrence": m.occurrence,
                     "line": m.start_pos[0], "was": was, "outcome": outcome, "killed_by": _killer(result.output) if outcome == "killed" else None})
        print(f"{m.module_path}:{m.start_pos[0]} {m.operator_name} {m.occurrence}: {was} -> {outcome}", flush=True)
    Path(out).write_text(json.dumps({"command": command, "rechecked": done}, indent=1) + "\n", encoding="utf-8")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("sessions", nargs="+")
    s.add_argument("--out")
    r = sub.add_parser("recheck")
    r.add_argument("session")
    r.add_argument("--command", required=True)
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--out", required=True)
    r.add_argument("--start", type=int, default=0, help="skip this many mutants (continue an interrupted re-check)")
    args = parser.parse_args(argv)
    if args.cmd == "summary":
        summary(args.sessions, args.out)
    else:
        recheck(args.session, args.command, args.timeout, args.out, start=args.start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
