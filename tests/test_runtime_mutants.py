"""Checks written against the survivors of the sampled Cosmic Ray session on ``impl/runtime.py``.

Each test's docstring names the mutants it kills (``line operator occurrence``, line numbers of
``impl/runtime.py`` at commit 61ec8ad).  The screen (``checks/lab/mutation/runtime.toml``) runs the
runner's own tests and the gate case table on tiny; what it did not reach: budgets spent exactly
at a call boundary.

Source: docs/results/mutation-sampled-runtime-snapshot-model.md (issue 15 item 5); M3.10 0x06.
"""

from __future__ import annotations

import itertools

import pytest
from runtime_helpers import request  # tests/ is on sys.path

from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import FinishReason

PROMPT = (1, 70, 71, 72)


@pytest.mark.parametrize("spent_ms, finished", [(99, False), (100, True), (101, True)])
def test_a_budget_is_spent_when_the_elapsed_time_reaches_it(tiny_model, spent_ms, finished):
    """``timeout_ms = 100``: at the first call boundary 100 ms after admission the budget is spent (``elapsed >= budget``).

    Kills 950 ``ReplaceComparisonOperator_Lt_LtE`` 4 (spent only past the budget).
    """
    readings = itertools.chain([0.0], itertools.repeat(spent_ms / 1000))  # admission, then every later reading
    runner = RequestRunner(tiny_model, request(PROMPT, 3, timeout_ms=100), clock=lambda: next(readings)).run()
    assert runner.budget_elapsed_ms() == spent_ms
    if finished:
        assert runner.finish_reason is FinishReason.TIMEOUT and runner.num_calls == 0 and runner.output_ids == []
    else:
        assert runner.finish_reason is FinishReason.LENGTH and runner.output_count == 3
