"""A sharded optimizer keeps the tie (M3.8 0x09): ZeroRedundancyOptimizer over gloo ranks, judged against the spec.

Rules checked: invariant.head_tied_sharded_owner; mutant.head_shard_duplicate_tie, mutant.head_shard_alias_split.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decodespec.checks.testing import requires_smollm2
from decodespec.spec.errors import Rejection
from decodespec.spec.head_tying import ShardedTieObservation, adam_first_update, sharded_tie_violations


def _obs(**kw):
    base = {"declared_tied": True, "alias": (True, True), "entries": (1, 0), "states": (1, 0), "grad_error": 0.3,
            "update_error": 0.5, "replicas_agree": True}
    base.update(kw)
    return ShardedTieObservation(**base)


def test_the_rule_names_each_way_a_sharder_breaks_the_tie():
    assert sharded_tie_violations(_obs()) == ()
    assert sharded_tie_violations(_obs(entries=(0, 1), states=(0, 1))) == ()  # the owner may be any one rank
    assert sharded_tie_violations(_obs(entries=(1, 1), states=(1, 1))) == ("split_owners", "duplicate_state")
    assert sharded_tie_violations(_obs(entries=(2, 0))) == ("duplicate_entry",)
    assert sharded_tie_violations(_obs(entries=(0, 0), states=(0, 0))) == ("no_owner",)
    assert sharded_tie_violations(_obs(alias=(True, False))) == ("alias_lost",)
    assert sharded_tie_violations(_obs(grad_error=1.5, update_error=float("nan"))) == ("gradient_not_once", "update_not_one_step")
    assert sharded_tie_violations(_obs(replicas_agree=False)) == ("replicas_diverge",)
    # untied: two Parameters, each one entry and one state, on one rank or two
    untied = {"declared_tied": False, "alias": (False, False)}
    assert sharded_tie_violations(_obs(**untied, entries=(2, 0), states=(2, 0))) == ()
    assert sharded_tie_violations(_obs(**untied, entries=(1, 1), states=(1, 1))) == ()
    assert sharded_tie_violations(_obs(**untied, entries=(3, 0), states=(2, 0))) == ("duplicate_entry",)
    assert sharded_tie_violations(_obs(**untied, entries=(2, 1), states=(2, 1))) == ("duplicate_state",)


def test_adam_first_update_is_torch_adams_first_step_and_a_second_entry_doubles_it():
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(7, 5, generator=g, dtype=torch.float64)
    grad = torch.randn(7, 5, generator=g, dtype=torch.float64)
    grad[2] = 0.0  # an untouched row does not move
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([p], lr=0.05)
    p.grad = grad.clone()
    opt.step()
    want = adam_first_update(w0.numpy(), grad.numpy(), 0.05)
    assert np.allclose(p.detach().numpy(), want, rtol=0, atol=1e-15)
    assert np.array_equal(want[2], w0.numpy()[2])
    # the same Parameter twice in one group: torch steps it twice, about 2 lr
    q = torch.nn.Parameter(w0.clone())
    with pytest.warns(UserWarning):
        opt2 = torch.optim.Adam([q, q], lr=0.05)
    q.grad = grad.clone()
    opt2.step()
    moved = np.abs(q.detach().numpy() - w0.numpy())
    assert moved[np.abs(grad.numpy()) > 1e-3].min() > 1.9 * 0.05
    with pytest.raises(Rejection):
        adam_first_update(w0.numpy(), grad.numpy()[:3], 0.05)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # forked ranks from a multi-thread process hang (libgomp); start_ranks spawns then, which is slow
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_zero_over_two_gloo_ranks_keeps_one_owner_one_state_one_gradient():
    from decodespec.checks.gate.sharded_tie import run_sharded_tie

    report = run_sharded_tie(2)
    obs = report.observation
    assert report.passed, report.violations
    assert obs.declared_tied and obs.alias == (True, True)
    assert sorted(obs.entries) == [0, 1] and sum(obs.states) == 1
    assert 0 <= obs.grad_error <= 1 and 0 < obs.update_error <= 1 and obs.replicas_agree


@pytest.mark.parametrize("name, expected", [
    ("head_shard_duplicate_tie", ("split_owners", "duplicate_state")),
    ("head_shard_alias_split", ("alias_lost", "split_owners", "duplicate_state", "gradient_not_once")),
])
def test_a_sharder_that_duplicates_the_tie_is_caught(name, expected):
    from decodespec.checks.gate.sharded_tie import run_sharded_tie

    assert run_sharded_tie(2, mutant=name).violations == expected


def test_one_rank_holding_the_table_twice_steps_it_twice():
    from decodespec.checks.gate.sharded_tie import run_sharded_tie

    report = run_sharded_tie(1, mutant="head_shard_duplicate_tie")
    assert report.observation.entries == (2,)
    assert report.violations == ("duplicate_entry", "update_not_one_step")
    assert report.observation.update_error > 1e3


def test_the_mutants_are_in_the_failure_lab_and_killed():
    from decodespec.checks.lab.mutants import MUTANTS

    for name in ("head_shard_duplicate_tie", "head_shard_alias_split"):
        m = MUTANTS[name]
        assert m.group == "output head" and m.checker(False) is None
        verdict = m.checker(True)
        assert verdict["rule"] == "invariant.head_tied_sharded_owner" and verdict["layer"] == "TYING"


@requires_smollm2
@pytest.mark.smollm2
def test_smollm2_sharded_over_two_ranks_keeps_its_tie():
    from decodespec.checks.gate.sharded_tie import run_sharded_tie

    report = run_sharded_tie(2, model="smollm2", deadline_s=300)
    assert report.passed, report.violations
    assert report.observation.alias == (True, True) and sorted(report.observation.entries) == [0, 1]
    assert sum(report.observation.states) == 1 and report.observation.grad_error <= 1
