"""Gate: the Hypothesis lock-step machines (spec || runtime) for every cache family, and the beam machine.

Each machine drives the spec and the runtime adapter with the same actions under adversarial
interleavings (cancel / timeout at every interrupt point, device faults and missing lanes in
flight, duplicated and stale receipts, streamer failures, static-cache reuse by a shorter
request, snapshots of both forms and restores of pending-ahead and corrupted records), checks
accept / reject agreement, the ladder after every step (``ladder.STATE`` first) and the spec's
invariants (``invariant.*``).  The machines run on the tiny model and on the gate's model.
Budgets come from the active profile (``--profile``; ``CI=true`` is derandomized).

Source: M3.10 "Boundary cases" (adversarial state transitions); /work/shared/DESIGN.md.
"""

from __future__ import annotations

import pytest

from decodespec.checks.adapters import AdapterUnavailable
from decodespec.checks.gate.cases import CaseResult
from decodespec.checks.gate.ladder import Verdict
from decodespec.checks.gate.machines import machine_failure, run_beam_machine, run_machine
from decodespec.checks.modelcheck.traces import open_runtime


@pytest.mark.parametrize("model", ["tiny", "gate"])
@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_lockstep_machine(cache: str, model: str, gate_runtime: str, gate_model: str, gate_report, gate_expectations) -> None:
    """The lock-step machine of (runtime, model, cache) finds no failed ladder verdict and no broken invariant."""
    if model == "gate" and gate_model == "tiny":
        pytest.skip("the gate's model is tiny (covered by the tiny machine)")
    model = gate_model if model == "gate" else model
    try:
        adapter = open_runtime(gate_runtime, model)
    except AdapterUnavailable as exc:
        pytest.skip(str(exc))
    caps = adapter.capabilities()
    adapter.close()
    if f"cache:{cache}" not in caps:
        pytest.skip(f"{gate_runtime} does not declare cache:{cache}")
    case = f"machine.{cache}"
    try:
        deviations = run_machine(gate_runtime, model, cache)
    except Exception as exc:  # every crash becomes a report line, then fails the test
        gate_report.add(CaseResult(case, gate_runtime, model, *machine_failure(exc)))
        raise
    if deviations:
        ids = sorted({d for d, _ in deviations})
        reasons = {e.id: e.reason for e in gate_expectations}
        gate_report.add(CaseResult(case, gate_runtime, model, "deviation", deviations[0][1], ", ".join(ids),
                                   " | ".join(reasons.get(d, "") for d in ids)))
        return
    gate_report.add(CaseResult(case, gate_runtime, model, "pass", Verdict("passed")))


def test_beam_machine(gate_runtime: str, gate_report) -> None:
    """Duplicated beam parents while another parent completes: spec ``transition.beam_step`` versus the runtime's ``selector.beam_topk``."""
    if gate_runtime != "impl":
        pytest.skip("the beam machine drives our runtime's joint top-K (impl/beam.py)")
    run_beam_machine()
    gate_report.add(CaseResult("machine.beam", gate_runtime, "scripted", "pass", Verdict("passed")))
