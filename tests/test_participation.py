"""The participation contract of R ranks (M3.10 0x0A "One request can still be model-parallel").

The explorer covers the rank layer at R = 2 and 3 (every reachable state checks
``invariant.ranks_declared``, ``invariant.no_collective_after_leave`` and
``invariant.all_new_needs_every_rank``, and no state deadlocks); planted bad rules (ALL_NEW with a
rank missing, a rank entering a collective a peer has left, a wait without a bound) are found with
short counterexamples; single paths pin the selections and typed finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from decodespec.checks.modelcheck.explore import DEADLOCK, ExploreBounds, explore, params_for_bounds
from decodespec.spec import invariants as inv
from decodespec.spec import transitions as T
from decodespec.spec.actions import Admit, Complete, Launch
from decodespec.spec.enums import CallKind, FinishReason, Selection
from decodespec.spec.errors import Rejection
from decodespec.spec.participation import (
    MISSING_RANK,
    RANK_TIMEOUT,
    EnterCollective,
    RankFault,
    RankTimeout,
    ReportRank,
    blocked,
    expected_rank_report,
    participation_failure,
)
from decodespec.spec.state import Phase, initial_state

RANK_RULES = ("transition.rank_enter", "transition.rank_report", "transition.rank_fault", "transition.rank_timeout")
RANK_INVARIANTS = ("invariant.ranks_declared", "invariant.no_collective_after_leave", "invariant.all_new_needs_every_rank")


def bounds(ranks: int, **changes: object) -> ExploreBounds:
    """A one-call request (L = 1, G = 1) whose calls run on ``ranks`` ranks."""
    base = {"vocab": 2, "prompt_len": 1, "max_new_tokens": 1, "prefill_chunk": None, "ranks": ranks, "collectives": 2 if ranks == 2 else 1,
                "max_retries": 0, "interrupts": False, "stream": False, "final_cache": "processed_inputs_only"}
    base.update(changes)
    return ExploreBounds(**base)  # type: ignore[arg-type]


def test_the_rank_invariants_are_checked_by_the_explorer() -> None:
    assert set(RANK_INVARIANTS) <= set(inv.INVARIANTS)


@pytest.mark.parametrize("b", [bounds(2), bounds(2, max_retries=1, collectives=1, max_new_tokens=2), bounds(3)],
                         ids=["R2-C2", "R2-C1-retry-decode", "R3-C1"])
def test_explorer_covers_every_rank_interleaving_without_violation(b: ExploreBounds) -> None:
    params = params_for_bounds(b)
    result = explore(params, b)
    assert result.ok, result.violations[0].message
    assert all(result.rule_counts.get(rid, 0) > 0 for rid in RANK_RULES), result.rule_counts
    assert result.rule_counts["transition.complete_all_new"] > 0 and result.rule_counts["transition.complete_all_old"] > 0
    # the rank layer multiplies the single-process state space: R ranks really interleave
    assert result.num_states > explore(params_for_bounds(attrs.evolve(b, ranks=1)), attrs.evolve(b, ranks=1)).num_states


def _machine_with(rule_id: str, **changes: object) -> T.Machine:
    return T.Machine(tuple(attrs.evolve(t, **changes) if t.rule_id == rule_id else t for t in T.MACHINE.transitions))


def _selection_ignoring_last_rank(p, s, a) -> bool:
    """Planted bad routing: ALL_NEW judged on every rank but the last (one rank may be missing)."""
    call = s.in_flight
    return T.select_logical_state(p, attrs.evolve(s, in_flight=attrs.evolve(call, ranks=call.ranks[:-1])), a) is Selection.ALL_NEW


@pytest.mark.parametrize("ranks", [2, 3])
def test_all_new_with_a_rank_missing_is_a_counterexample(ranks: int) -> None:
    b = bounds(ranks)
    machine = _machine_with("transition.complete_all_new", applies=_selection_ignoring_last_rank)
    result = explore(params_for_bounds(b), b, machine=machine)
    assert not result.ok
    violation = result.violations[0]
    assert violation.rule_id == "invariant.all_new_needs_every_rank"
    assert violation.rules[-1] == "transition.complete_all_new"
    assert any(isinstance(a, (RankFault, RankTimeout)) and a.rank == ranks - 1 for a in violation.actions) or any(
        isinstance(a, ReportRank) and a.report.rank == ranks - 1 for a in violation.actions)


def test_all_old_completion_that_advances_is_caught_by_the_rank_invariant() -> None:
    b = bounds(2)
    result = explore(params_for_bounds(b), b, machine=T.MACHINE.with_effect("transition.complete_all_old", T.complete_all_new))
    assert [v.rule_id for v in result.violations] == ["invariant.all_new_needs_every_rank"]


def test_entering_a_collective_a_peer_left_is_a_counterexample() -> None:
    enter = next(t for t in T.MACHINE.transitions if t.rule_id == "transition.rank_enter")
    assert enter.guard[-1].name == "no rank has left the call"
    b = bounds(2)
    result = explore(params_for_bounds(b), b, machine=T.MACHINE.with_guard("transition.rank_enter", enter.guard[:-1]))
    violation = result.violations[0]
    assert violation.rule_id == "invariant.no_collective_after_leave"
    assert isinstance(violation.actions[-1], EnterCollective) and len(violation.actions) == 4


def test_a_wait_without_a_bound_deadlocks() -> None:
    """A rank that may time out only while running (never while blocked in a collective) can hang."""
    timeout = next(t for t in T.MACHINE.transitions if t.rule_id == "transition.rank_timeout")
    unbounded = timeout.guard + (T.Clause("planted: no timeout while blocked", lambda p, s, a: not blocked(s.in_flight, a.rank)),)
    b = bounds(2)
    result = explore(params_for_bounds(b), b, machine=T.MACHINE.with_guard("transition.rank_timeout", unbounded))
    assert result.violations[0].rule_id == DEADLOCK


# ----------------------------------------------------------------------------------------------
# Single paths: selections and typed finishes.
# ----------------------------------------------------------------------------------------------


def _in_flight(ranks: int = 2, collectives: int = 1, max_retries: int = 0):
    params = params_for_bounds(bounds(ranks, collectives=collectives, max_retries=max_retries))
    state = T.step(params, initial_state(params), Admit())
    return params, T.step(params, state, Launch(CallKind.PREFILL, 0, 1))


def _run_ranks(params, state, reports):
    """Every rank enters every collective, then sends ``reports[rank]`` (None: the rank times out)."""
    for _ in range(params.collectives):
        for rank in range(params.ranks):
            state = T.step(params, state, EnterCollective(rank))
    for rank, report in enumerate(reports):
        state = T.step(params, state, ReportRank(report) if report is not None else RankTimeout(rank))
    return state


def test_every_rank_agreeing_selects_all_new_with_a_score() -> None:
    params, state = _in_flight(3, 2)
    reports = [expected_rank_report(params, state.in_flight, r) for r in range(3)]
    state = _run_ranks(params, state, reports)
    assert participation_failure(params, state.in_flight) is None
    state = T.step(params, state, T.expected_report(params, state))
    assert state.phase is Phase.SCORED and state.score is not None
    assert state.last_completion.selection is Selection.ALL_NEW and len(state.last_completion.ranks) == 3


@pytest.mark.parametrize("what", ["frontier", "generation", "positions", "identity"])
def test_a_disagreeing_rank_selects_all_old_and_device_error(what: str) -> None:
    params, state = _in_flight(2)
    good = expected_rank_report(params, state.in_flight, 1)
    bad = {"frontier": attrs.evolve(good, lanes=(("self_kv", 0),)), "generation": attrs.evolve(good, generation=5),
           "positions": attrs.evolve(good, start=1), "identity": attrs.evolve(good, identity="sha256:" + "1" * 64)}[what]
    state = _run_ranks(params, state, [expected_rank_report(params, state.in_flight, 0), bad])
    assert participation_failure(params, state.in_flight) == MISSING_RANK
    state = T.step(params, state, T.expected_report(params, state))
    assert state.last_completion.selection is Selection.ALL_OLD and state.score is None
    assert state.finish_reason is FinishReason.DEVICE_ERROR


def test_a_late_rank_selects_all_old_and_finishes_timeout() -> None:
    params, state = _in_flight(2)
    state = _run_ranks(params, state, [expected_rank_report(params, state.in_flight, 0), None])
    assert participation_failure(params, state.in_flight) == RANK_TIMEOUT
    assert T.completion_reason(params, state, T.expected_report(params, state)) == RANK_TIMEOUT
    state = T.step(params, state, T.expected_report(params, state))
    assert state.score is None and state.finish_reason is FinishReason.TIMEOUT and state.processed == 0


def test_a_rank_fault_leaves_its_peer_only_the_bounded_wait() -> None:
    params, state = _in_flight(2, collectives=2, max_retries=1)
    state = T.step(params, state, EnterCollective(0))
    state = T.step(params, state, RankFault(1))
    assert blocked(state.in_flight, 0)
    for action in (EnterCollective(0), ReportRank(expected_rank_report(params, state.in_flight, 0))):
        assert not T.enabled(params, state, action)
    with pytest.raises(Rejection, match="closed rank roster"):
        T.step(params, state, T.expected_report(params, state))
    state = T.step(params, state, RankTimeout(0))
    state = T.step(params, state, T.expected_report(params, state))
    assert state.phase is Phase.READY and state.quarantined and state.num_retries == 1  # retried like any ALL_OLD call


@pytest.mark.parametrize("breaker", [
    lambda c: attrs.evolve(c, ranks=c.ranks[:-1]),  # a declared rank absent from the call
    lambda c: attrs.evolve(c, ranks=c.ranks[::-1]),  # ranks out of order
    lambda c: attrs.evolve(c, ranks=(attrs.evolve(c.ranks[0], entered=9),) + c.ranks[1:]),  # past C collectives
    lambda c: attrs.evolve(c, ranks=(attrs.evolve(c.ranks[0], left="bored"),) + c.ranks[1:]),  # an undeclared reason
], ids=["missing", "order", "entered>C", "reason"])
def test_ranks_declared_catches_a_broken_call(breaker) -> None:
    params, state = _in_flight(3)
    assert inv.violated(params, state) == []
    broken = attrs.evolve(state, in_flight=breaker(state.in_flight))
    assert "invariant.ranks_declared" in inv.violated(params, broken)


def test_single_process_requests_have_no_rank_layer() -> None:
    params = params_for_bounds(bounds(1))
    state = T.step(params, T.step(params, initial_state(params), Admit()), Launch(CallKind.PREFILL, 0, 1))
    assert state.in_flight.ranks == () and not T.enabled(params, state, EnterCollective(0))
    assert isinstance(T.expected_report(params, state), Complete)


def test_cli_explores_ranks() -> None:
    out = subprocess.run([sys.executable, "-m", "decodespec.checks", "explore", "--vocab", "2", "--prompt-len", "1",
                          "--max-new-tokens", "1", "--prefill-chunk", "none", "--ranks", "2", "--max-retries", "0",
                          "--no-interrupts", "--no-stream", "--final-cache", "processed_inputs_only"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["rules"]["transition.rank_timeout"] > 0
