"""The Hypothesis lock-step machines (checks/gate/machines.py) on the tiny model, and that they catch broken runtimes.

Rules exercised: every ``transition.*`` action of the request machine through the contract's
ops, ``invariant.*`` after every step, and the ladder (``ladder.STATE``, ``ladder.TENSOR``,
``ladder.DECISION`` ...).  Source: M3.10 "Boundary cases" (adversarial transitions).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase

from decodespec.checks.gate.machines import BUDGETS, machine_settings, run_beam_machine, run_machine
from decodespec.checks.gate.prompts import prompts_for
from decodespec.checks.modelcheck.traces import load_trace, replay


@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_tiny_lockstep_machine_passes_on_our_runtime(cache: str) -> None:
    """Spec and runtime agree under every adversarial interleaving the machine draws (cache family ``cache``)."""
    run_machine("impl", "tiny", cache)


def test_beam_machine_duplicated_parents_and_early_eos() -> None:
    """``transition.beam_step`` / ``selector.beam_topk``: the runtime's joint top-K equals the spec's, invariants hold."""
    from decodespec.checks.gate.machines import BeamMachine

    before = BeamMachine.duplicated_with_eos
    run_beam_machine()
    assert BeamMachine.duplicated_with_eos > before, "no step duplicated a parent while another parent completed"


def test_a_machine_on_a_refused_config_reports_the_documented_deviation() -> None:
    """llama.cpp has no tiny GGUF: every reset is refused (adapter.unsupported).  The machine observes the refused
    request (phase 'rejected', peer.py) instead of crashing and returns the documented deviation it hit."""
    from decodespec.checks.adapters.llamacpp import LLAMACPP_SKIP_REASON

    pytest.importorskip("llama_cpp", reason=LLAMACPP_SKIP_REASON)
    deviations = run_machine("llamacpp", "tiny", "none", max_examples=5, database=None)
    assert deviations and {d for d, _ in deviations} == {"llamacpp.machine_unsupported_config"}
    assert all(v.check == "accept_reject" and v.step == 0 for _, v in deviations)


def test_a_machine_crash_becomes_an_error_line_and_a_verdict_a_fail_line() -> None:
    """The gate's report: an exception of the adapter or the harness is result 'error' (check harness, its code);
    a failed ladder verdict is 'fail' at its layer (checks/test_machines.py writes both to --report)."""
    from decodespec.checks.gate.machines import machine_failure
    from decodespec.spec.errors import Rejection

    result, verdict = machine_failure(Rejection("adapter.protocol", "reset(config) must come before observe()", "$"))
    assert (result, verdict.layer, verdict.check, verdict.actual) == ("error", "STATE", "harness", "adapter.protocol")
    assert "reset(config) must come before observe()" in verdict.message
    result, verdict = machine_failure(ValueError("could not broadcast"))
    assert (result, verdict.actual) == ("error", "ValueError")
    result, verdict = machine_failure(AssertionError("ladder.DECISION decision.selected_id at step 3 ({'op': 'step'}): ..."))
    assert (result, verdict.layer, verdict.rule, verdict.check) == ("fail", "DECISION", "ladder.DECISION", "decision.selected_id")
    result, verdict = machine_failure(ExceptionGroup("two bugs", [AssertionError("spec invariants violated: [...]"), ValueError("x")]))
    assert (result, verdict.layer, verdict.check) == ("fail", "STATE", "invariant")

def test_machine_budgets_follow_the_profile() -> None:
    s = machine_settings("tiny")
    assert (s.max_examples, s.stateful_step_count) in {BUDGETS[k]["tiny"] for k in BUDGETS}
    assert s.deadline is None
    assert prompts_for("tiny")[0] == (1,)  # the one-token prompt


@pytest.mark.parametrize("runtime, cache, layer", [
    ("impl.broken.frozen_rng", "dynamic", "STATE"),
    ("impl.broken.next_step_logprob", "dynamic", "DECISION"),
])
def test_machine_catches_a_broken_runtime_with_a_replayable_trace(runtime, cache, layer, tmp_path, monkeypatch) -> None:
    """A broken runtime fails the machine at the right ladder layer; the written trace replays to the same verdict."""
    monkeypatch.setenv("DECODESPEC_TRACE_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match=f"ladder.{layer}"):
        run_machine(runtime, "tiny", cache, phases=[Phase.generate, Phase.shrink], max_examples=40, database=None)
    files = sorted(tmp_path.glob("*.itf.json"))
    assert files, "the failing run wrote no trace"
    trace = load_trace(files[-1])
    assert trace["#meta"]["verdict"]["layer"] == layer and trace["#meta"]["runtime"] == runtime
    result = replay(trace)
    assert result.reproduced, (result.expected, result.actual)
    assert not replay(trace, runtime="impl").reproduced  # the real runtime passes the same actions
