"""Gate: every case of the table (:mod:`decodespec.checks.gate.cases`) on the runtime under test.

The correctness matrix (``matrix.*``), the seed's boundary cases (``boundary.*``) and the
adversarial interleavings (``adversarial.*``) run in lock step with the spec and are judged by
the ladder (``ladder.STATE`` .. ``ladder.RESUME``).  A failure writes its replayable trace
(``decodespec replay FILE``) and names the layer, rule and check; a documented deviation
(``checks/gate/expectations/<runtime>.toml``) passes and is reported as ``deviation``; an undecided
margin passes with a warning and is reported as ``undecided``.

Source: M3.10 "Correctness matrix", "Boundary cases".
"""

from __future__ import annotations

import warnings

import pytest

from decodespec.checks.gate.cases import cases_for, run_case
from decodespec.checks.modelcheck.traces import write_trace


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        from decodespec.checks.conftest import _model

        cases = cases_for(_model(metafunc.config))
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_case(case, gate_runtime, gate_expectations, gate_report) -> None:
    """One case: lock step with the spec, the ladder in order, expectations applied."""
    judge_case(case, gate_runtime, gate_expectations, gate_report)


def judge_case(case, gate_runtime, gate_expectations, gate_report) -> None:
    """Run ``case`` (:func:`~decodespec.checks.gate.cases.run_case`), report it, and skip / fail / warn as its result says."""
    result = run_case(case, gate_runtime, expectations=gate_expectations)
    gate_report.add(result)
    if result.result == "skip":
        pytest.skip(result.reason)
    if result.result == "fail":
        where = ""
        if result.trace is not None:
            where = f"; trace: {write_trace(result.trace)} (decodespec replay FILE)"
        v = result.verdict
        pytest.fail(f"{case.id}: {v.rule} {v.check} at step {v.step}: {v.message} [expected {v.expected!r}, observed {v.actual!r}]{where}",
                    pytrace=False)
    if result.result == "undecided":
        warnings.warn(f"{case.id}: undecided: {result.verdict.message}", stacklevel=1)
