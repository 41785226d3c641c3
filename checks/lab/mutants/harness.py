"""Run the conformance gate against a mutant until its first failure: killed, survived or crashed.

The gate is the gate's own checks, not per-mutant asserts: the case table
(:func:`decodespec.checks.gate.cases.cases_for`, every case run by
:func:`~decodespec.checks.gate.cases.run_case` on the ``impl`` runtime), then the Hypothesis lock-step
machines (:func:`decodespec.checks.gate.machines.machine_for`, one per cache family, the active
settings profile's budget -- ``fast`` by default -- derandomized, without shrinking), then the
distributed checks (``distributed.vocab_parallel.R2``: the vocabulary-parallel head on gloo
ranks against its float64 reference, :mod:`decodespec.checks.gate.vocab_parallel`), in that order;
a mutant may name checks to run first (``Mutant.first``, the checks that exercise its code).  :func:`run_gate` installs the mutant (:meth:`~decodespec.checks.lab.mutants.Mutant.applied`)
around the whole run, with the gate's reference computations on the oracle side
(:func:`~decodespec.checks.lab.mutants.seams.spec_side`, :func:`~decodespec.checks.lab.mutants.seams.oracle_side`): the
reference is the specification, so it runs the original code.

Outcomes (:class:`MutantResult`):

* ``killed``: a gate check failed -- a case result ``fail`` (a documented deviation of the
  runtime does not count) or a machine verdict ``failed``; ``killed_by`` names the case (or
  ``machine.<cache>``), the ladder layer, rule and check, the step and the message;
* ``crashed``: the runtime raised out of the gate (an exception that is not a typed refusal
  the adapter reports, or a typed error outside the adapter that stops a case): a verdict of the
  harness, not of the gate; reported separately (a mutant that only crashes is a weak mutant);
* ``survived``: every check passed -- a gap in the gate;
* ``seam_moved``: the runtime changed under the mutant (its seam or source edit no longer
  matches; :class:`~decodespec.checks.lab.mutants.seams.SeamMoved`).

A gate check is only evidence when the unmutated runtime passes it: when a check fails under the
mutant, :class:`Calibration` runs it once without a mutant (remembered for the next mutants) and a
check that fails there too is skipped (``excluded``), never counted as a kill.  Each check runs
with the mutant freshly installed and removed around it.

Source: M3.10 0x0B, M3.8 0x12 (the failure labs); research/formal-anchors-survey.md 7 (mutants
killed by the gate); docs/design.md section 9.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

import attrs

from . import MUTANTS, Mutant
from .seams import SeamMoved, spec_side

__all__ = [
    "CACHES",
    "KILLED",
    "CRASHED",
    "SEAM_MOVED",
    "SURVIVED",
    "Calibration",
    "GateCheck",
    "MutantResult",
    "gate_checks",
    "run_gate",
]

KILLED = "killed"
SURVIVED = "survived"
CRASHED = "crashed"
SEAM_MOVED = "seam_moved"
#: Cache families the machines run, in order.
CACHES = ("dynamic", "static", "none")

# --------------------------------------------------------------------------------------------
# The gate as a list of checks.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class GateCheck:
    """One unit of the gate: a case of the table, a machine or a distributed check.

    Attributes:
        id: The case id, ``machine.<cache>`` or ``distributed.vocab_parallel.R<ranks>``.
        kind: ``case``, ``machine`` or ``distributed`` (ranks of torch.distributed, :mod:`decodespec.checks.gate.vocab_parallel`).
        model: ``tiny`` or ``smollm2``.
        runtime: The runtime the check drives (``impl``; ``impl-tp`` for the tensor-parallel mutants).
    """

    id: str
    kind: str
    model: str
    runtime: str = "impl"


#: The distributed checks of the gate: the vocabulary-parallel head on this many gloo ranks
#: (:func:`decodespec.checks.gate.vocab_parallel.run_check`).
DISTRIBUTED_RANKS = (2,)


def gate_checks(model: str, *, cases: bool = True, machines: bool = True, distributed: bool = True,
                only: Sequence[str] = (), runtime: str = "impl") -> tuple[GateCheck, ...]:
    """The gate's checks on ``model`` and ``runtime`` in running order (cases, machines, distributed checks); ``only`` keeps
    the ids listed (globs).

    The distributed checks (``distributed.vocab_parallel.R<n>``) do not depend on the model or the runtime.
    """
    import fnmatch

    from ...gate.cases import cases_for

    out: list[GateCheck] = []
    if cases:
        out += [GateCheck(c.id, "case", model, runtime) for c in cases_for(model)]
    if machines:
        out += [GateCheck(f"machine.{cache}", "machine", model, runtime) for cache in CACHES]
    if distributed:
        out += [GateCheck(f"distributed.vocab_parallel.R{r}", "distributed", model) for r in DISTRIBUTED_RANKS]
    if only:
        out = [c for c in out if any(fnmatch.fnmatchcase(c.id, pattern) for pattern in only)]
    return tuple(out)


@attrs.frozen
class Finding:
    """What one gate check said: ``passed``, ``failed`` (a gate verdict), ``deviation`` or ``crashed``."""

    status: str
    layer: str | None = None
    rule: str | None = None
    check: str | None = None
    step: int | None = None
    message: str = ""
    trace: str | None = None


def _case_finding(check: GateCheck) -> Finding:
    from ...gate.cases import cases_for, load_expectations, run_case

    case = next(c for c in cases_for(check.model) if c.id == check.id)
    result = run_case(case, check.runtime, expectations=load_expectations(check.runtime))
    v = result.verdict
    if result.result == "fail" and v.check == "harness":
        return Finding(CRASHED, v.layer, v.rule, v.check, v.step, v.message)
    status = {"fail": "failed", "deviation": "deviation"}.get(result.result, "passed")
    return Finding(status, v.layer, v.rule, v.check, v.step, v.message)


def _machine_finding(check: GateCheck, settings_overrides: dict[str, Any]) -> Finding:
    from hypothesis import Phase
    from hypothesis.errors import HypothesisException

    from ...gate.machines import machine_for, machine_settings, run_state_machine_as_test

    cache = check.id.split(".", 1)[1]
    verdicts: list[Any] = []
    base = machine_for(check.runtime, check.model, cache)

    class Recorded(base):  # type: ignore[misc, valid-type]
        def _judge(self, record):  # noqa: ANN001 - the machine's own signature
            try:
                return super()._judge(record)
            except AssertionError:  # a failed verdict the expectations do not document
                verdicts.append(record.verdict)
                raise


    Recorded.__name__ = base.__name__
    options = dict(derandomize=True, database=None, phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False, print_blob=False)
    options.update(settings_overrides)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            run_state_machine_as_test(Recorded, settings=machine_settings(check.model, **options))
    except HypothesisException as exc:
        return Finding(CRASHED, message=f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # noqa: BLE001 - classify every way the run can end
        if isinstance(exc, KeyboardInterrupt):
            raise
        trace = next((line.split("written to", 1)[1].strip() for line in out.getvalue().splitlines() if "trace written to" in line), None)
        if verdicts:
            v = verdicts[0]
            return Finding("failed", v.layer, v.rule, v.check, v.step, v.message, trace)
        return Finding(CRASHED, message=_crash_text(exc))
    return Finding("passed")


def _crash_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames)), "?")
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({where})"[:400]


_SELECTION_ITEMS = ("greedy", "top_k", "top_p", "multinomial")


def _distributed_finding(check: GateCheck) -> Finding:
    """``distributed.vocab_parallel.R<n>``: the vocabulary-parallel head on n ranks against the float64 reference."""
    from ...gate.vocab_parallel import run_check as vocab_parallel_check

    problems = vocab_parallel_check(int(check.id.rsplit(".R", 1)[1]))
    if not problems:
        return Finding("passed")
    first = problems[0]
    if first.startswith(("timeout:", "crash:")):
        return Finding(CRASHED, message=first[:400])
    layer = "DECISION" if any(item in first.split(":", 1)[0] for item in _SELECTION_ITEMS) else "TENSOR"
    return Finding("failed", layer, f"ladder.{layer}", "vocab_parallel", None, "; ".join(problems[:3])[:600])


def run_check(check: GateCheck, *, settings_overrides: dict[str, Any] | None = None) -> Finding:
    """Run one gate check under the current runtime (mutated or not); never raises for the runtime's failures."""
    try:
        if check.kind == "case":
            return _case_finding(check)
        if check.kind == "distributed":
            return _distributed_finding(check)
        return _machine_finding(check, dict(settings_overrides or {}))
    except KeyboardInterrupt:
        raise
    except SeamMoved:
        raise
    except BaseException as exc:  # noqa: BLE001 - the runtime (or the harness) raised out of the gate
        return Finding(CRASHED, message=_crash_text(exc))


# --------------------------------------------------------------------------------------------
# Calibration and runs.
# --------------------------------------------------------------------------------------------


class Calibration:
    """The gate on the unmutated runtime, check by check, computed when first needed and kept.

    A check that fails under a mutant is only evidence when it passes without one; :meth:`passes`
    runs it once without a mutant (reference on the oracle side) and remembers the finding.

    Args:
        settings_overrides: Hypothesis settings for the machines (as for the mutant runs).

    Attributes:
        findings: ``{check id: Finding}`` of the checks run so far.
    """

    def __init__(self, settings_overrides: dict[str, Any] | None = None):
        self.settings_overrides = dict(settings_overrides or {})
        self.findings: dict[str, Finding] = {}

    def passes(self, check: GateCheck) -> bool:
        """Whether ``check`` passes without a mutant (run once, then remembered)."""
        if check.id not in self.findings:
            with spec_side():
                self.findings[check.id] = run_check(check, settings_overrides=self.settings_overrides)
        return self.findings[check.id].status == "passed"

    @property
    def failing(self) -> dict[str, str]:
        """``{check id: why}`` of the checks found failing without a mutant."""
        return {k: f"{f.status}: {f.layer} {f.check} {f.message}"[:300] for k, f in self.findings.items() if f.status != "passed"}


@contextlib.contextmanager
def _trace_dir(directory: str | None) -> Iterator[str]:
    old = os.environ.get("DECODESPEC_TRACE_DIR")
    with contextlib.ExitStack() as stack:
        path = directory or stack.enter_context(tempfile.TemporaryDirectory(prefix="decodespec-mutants-"))
        os.environ["DECODESPEC_TRACE_DIR"] = path
        try:
            yield path
        finally:
            if old is None:
                os.environ.pop("DECODESPEC_TRACE_DIR", None)
            else:
                os.environ["DECODESPEC_TRACE_DIR"] = old


@attrs.frozen
class MutantResult:
    """The gate's verdict on one mutant.

    Attributes:
        mutant: The mutant's name.
        model: The model the gate ran on.
        outcome: ``killed``, ``survived``, ``crashed`` or ``seam_moved``.
        killed_by: The check that failed first: ``{"check", "layer", "rule", "ladder_check", "step",
            "message", "trace"}`` (``None`` unless killed).
        seconds: Wall time from the start of the run to the verdict (time to kill when killed).
        checks_run: Gate checks run.
        crash: The first crash message, when a check crashed (also when another check killed it).
        excluded: Checks skipped because they fail without the mutant.
    """

    mutant: str
    model: str
    outcome: str
    killed_by: dict[str, Any] | None
    seconds: float
    checks_run: int
    crash: str | None = None
    excluded: tuple[str, ...] = ()

    @property
    def killed(self) -> bool:
        """Whether a gate check killed the mutant."""
        return self.outcome == KILLED

    def report_line(self) -> dict[str, Any]:
        """One ``docs/results/failure-lab.jsonl`` line (see :func:`decodespec.checks.docs.pages.load_results`)."""
        m = MUTANTS[self.mutant]
        by = self.killed_by or {}
        line = {"mutant": m.rule_id, "killed": self.killed, "outcome": self.outcome, "model": self.model, "group": m.group,
                "section": m.section, "seconds": round(self.seconds, 3), "checks_run": self.checks_run}
        if self.killed:
            line["killed_by"] = f"{self.model}: {by.get('check')} ({by.get('rule') or by.get('layer')} {by.get('ladder_check')})"
            line.update({"case": by.get("check"), "layer": by.get("layer"), "ladder_check": by.get("ladder_check"),
                         "message": by.get("message")})
        if self.crash:
            line["crash"] = self.crash
        from decodespec.spec.passport import SYNTHETIC_PASSPORT

        line["data"] = SYNTHETIC_PASSPORT.to_json()  # the passport (spec/passport.py): gate-generated inputs
        return line


def run_gate(mutant: Mutant | str, model: str = "tiny", *, checks: Sequence[GateCheck] | None = None,
             calibration: Calibration | None = None, trace_dir: str | None = None, stop_at_first: bool = True,
             settings_overrides: dict[str, Any] | None = None) -> MutantResult:
    """Run the gate against ``mutant`` until the first failed check (see the module docstring).

    Args:
        mutant: The :class:`Mutant` or its name.
        model: ``tiny`` or ``smollm2``.
        checks: The gate checks to run, in order (default :func:`gate_checks`).
        calibration: Confirms each failing check without the mutant (``None``: every failure counts).
        trace_dir: Where machines write counterexample traces (default a temporary folder).
        stop_at_first: Stop at the first kill (else run every check; the first kill is reported).
        settings_overrides: Hypothesis settings for the machines (e.g. ``max_examples``).
    """
    import fnmatch

    m = MUTANTS[mutant] if isinstance(mutant, str) else mutant
    if m.checker is not None:
        return _run_checker(m, model, calibration)
    plan = list(checks if checks is not None else gate_checks(model, runtime=m.runtime))
    plan.sort(key=lambda c: not any(fnmatch.fnmatchcase(c.id, pattern) for pattern in m.first))  # stable: the mutant's own checks first
    excluded: list[str] = []
    start = time.perf_counter()
    crash = None
    killed_by = None
    run = 0
    calibrating = 0.0  # time spent running checks without the mutant (not part of the time to kill)
    try:
        with _trace_dir(trace_dir):
            for check in plan:
                run += 1
                with spec_side(), m.applied():
                    finding = run_check(check, settings_overrides=settings_overrides)
                if finding.status == CRASHED and crash is None:
                    crash = f"{check.id}: {finding.message}"
                if finding.status != "failed" or killed_by is not None:
                    continue
                found_at = time.perf_counter() - start - calibrating
                before = time.perf_counter()
                passes = calibration is None or calibration.passes(check)
                calibrating += time.perf_counter() - before
                if not passes:
                    excluded.append(check.id)  # fails without the mutant too: no evidence
                    continue
                killed_by = {"check": check.id, "layer": finding.layer, "rule": finding.rule, "ladder_check": finding.check,
                             "step": finding.step, "message": finding.message, "trace": finding.trace, "seconds": round(found_at, 3)}
                if stop_at_first:
                    break
    except SeamMoved as exc:
        return MutantResult(m.name, model, SEAM_MOVED, None, time.perf_counter() - start, run, str(exc), tuple(excluded))
    seconds = killed_by["seconds"] if killed_by else time.perf_counter() - start - calibrating
    outcome = KILLED if killed_by else (CRASHED if crash else SURVIVED)
    return MutantResult(m.name, model, outcome, killed_by, seconds, run, crash, tuple(excluded))


def _run_checker(m: Mutant, model: str, calibration: Calibration | None) -> MutantResult:
    """A mutant of the ``output head`` group: its own checker on the broken implementation, calibrated on the correct one."""
    start = time.perf_counter()
    try:
        finding = m.checker(True)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the broken implementation raised out of the checker
        return MutantResult(m.name, model, CRASHED, None, time.perf_counter() - start, 1, _crash_text(exc))
    seconds = time.perf_counter() - start
    if finding is None:
        return MutantResult(m.name, model, SURVIVED, None, seconds, 1)
    if calibration is not None:
        key = f"checker.{m.name}"
        if key not in calibration.findings:
            baseline = m.checker(False)
            calibration.findings[key] = Finding("passed") if baseline is None else Finding(
                "failed", baseline.get("layer"), baseline.get("rule"), baseline.get("ladder_check"), None, baseline.get("message", ""))
        if calibration.findings[key].status != "passed":
            return MutantResult(m.name, model, SURVIVED, None, seconds, 1, excluded=(key,))
    killed_by = {"step": None, "trace": None, **finding, "seconds": round(seconds, 3)}
    return MutantResult(m.name, model, KILLED, killed_by, seconds, 1)
