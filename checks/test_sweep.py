"""Gate: the envelope sweep -- one deterministic lock-step case per declared coverage item the machines reach by chance.

Each transform under each order that has a place for it, each parameter edge and ``history``
choice, each schema enum value and scalar field, each EOS shape, each stop-match shape the
model's tokens allow (:func:`decodespec.checks.gate.drawing.sweep_cases`) runs in lock step with the
spec on the runtime under test, judged like the table's cases (``sweep.*`` report lines).  The
machines draw the same items and their combinations at random; the sweep makes a full gate
run's coverage report (``--coverage-report``) independent of the draw.

Source: issue 15 item 4; M3.10 "Boundary cases", 0x06; M3.8 0x0B-0x0F.
"""

from __future__ import annotations

import pytest

from decodespec.checks.test_gate import judge_case


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sweep_case" in metafunc.fixturenames:
        from decodespec.checks.conftest import _model
        from decodespec.checks.gate.drawing import sweep_cases

        cases = sweep_cases(_model(metafunc.config))
        metafunc.parametrize("sweep_case", cases, ids=[c.id for c in cases])


def test_sweep_case(sweep_case, gate_runtime, gate_expectations, gate_report) -> None:
    """One sweep case: lock step with the spec, the ladder in order, expectations applied."""
    judge_case(sweep_case, gate_runtime, gate_expectations, gate_report)
