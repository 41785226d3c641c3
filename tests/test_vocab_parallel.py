"""The vocabulary-parallel head (M3.8 0x0A): reference against single-rank, torch.distributed runtime against reference.

* spec side: the float64 reference over R shards (``spec/vocab_parallel.py``) equals the
  single-rank computation of the same quantity (log-softmax, cross-entropy and its gradient,
  ``selector.greedy`` with the lowest-id tie rule, ``transform.top_k``, ``transform.top_p``,
  ``selector.multinomial``) for R = 1 .. 5, bit for bit where the seed's algorithm permits
  (maxima, ids, masks, the chained CDF) and within the float64 summation bound elsewhere;
* impl side: ``impl/vocab_parallel.py`` on R = 2 and 4 gloo processes (and the SmolLM2-sized
  head V = 49152, d = 576 on 2) equals the reference (``checks/gate/vocab_parallel.py``), every run
  bounded by a deadline; a rank that skips a collective ends in a bounded failure, not a hang;
* the failure lab's vocabulary-parallel mutants are killed by the gate's distributed check.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest

from decodespec.checks.gate import vocab_parallel as check
from decodespec.checks.lab.mutants import MUTANTS, Mutant, Patch
from decodespec.checks.lab.mutants.harness import KILLED, Calibration, gate_checks, run_gate
from decodespec.checks.lab.mutants.seams import leaked
from decodespec.spec import vocab_parallel as vp
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import selectors
from decodespec.spec.policy.scores import log_softmax, softmax
from decodespec.spec.policy.transforms import stable_order

EPS = float(np.finfo(np.float64).eps)
VOCAB_MUTANTS = sorted(name for name, m in MUTANTS.items() if m.group == "vocabulary parallel")


def _inputs(seed: int, vocab: int, rows: int = 6, d: int = 5):
    rng = np.random.default_rng(seed)
    hidden, weight = rng.standard_normal((rows, d)), rng.standard_normal((vocab, d))
    return hidden, weight, hidden @ weight.T, rng.integers(0, vocab, rows), rng


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_distributed_loss_and_gradients_equal_the_single_rank_ones(ranks: int, seed: int) -> None:
    hidden, weight, z, y, _ = _inputs(seed, vocab=11)
    ranges = vp.shard_ranges(11, ranks)
    shards = vp.shard_logits(hidden, weight, ranges)
    m, _s, lse = vp.logsumexp(shards)
    assert np.array_equal(m, np.concatenate(shards, axis=-1).max(axis=-1))  # MAX is exact
    single = np.stack([-log_softmax(row)[t] for row, t in zip(z, y)])
    bound = 4 * 11 * EPS * (1 + np.abs(lse) + np.abs(z[np.arange(6), y]))
    assert np.all(np.abs(vp.cross_entropy(shards, ranges, y) - single) <= bound)
    probs = np.stack([softmax(row) for row in z])
    onehot = np.eye(11)[y]
    grads = vp.logit_grads(shards, ranges, y)
    assert np.all(np.abs(np.concatenate(grads, axis=-1) - (probs - onehot)) <= 4 * 11 * EPS * (probs + 1))
    g_h = vp.hidden_grad(grads, weight, ranges)
    assert np.all(np.abs(g_h - (probs - onehot) @ weight) <= 4 * (11 + 5) * EPS * ((probs + 1) @ np.abs(weight)))
    g_e = np.concatenate(vp.weight_grads(grads, hidden), axis=0)
    assert np.all(np.abs(g_e - (probs - onehot).T @ hidden) <= 4 * (11 + 6) * EPS * ((probs + 1).T @ np.abs(hidden)))


def test_non_owners_contribute_the_sum_neutral_and_exactly_one_rank_owns_each_target() -> None:
    hidden, weight, _z, y, _ = _inputs(3, vocab=10)
    ranges = vp.shard_ranges(10, 3)
    assert ranges == ((0, 4), (4, 7), (7, 10))  # the first V mod R shards own one row more
    parts = vp.target_contributions(vp.shard_logits(hidden, weight, ranges), ranges, y)
    for part, (a, b) in zip(parts, ranges):
        owned = (a <= y) & (y < b)
        assert np.all(part[~owned] == 0.0) and np.all(np.isfinite(part))
    assert vp.telemetry(vp.shard_logits(hidden, weight, ranges), ranges, y).target_owner_counts == (1,) * 6


def test_telemetry_reports_targets_outside_every_shard_and_non_finite_local_maxima() -> None:
    hidden, weight, _z, _y, _ = _inputs(4, vocab=8, rows=3)
    ranges = vp.shard_ranges(8, 2)
    shards = vp.shard_logits(hidden, weight, ranges)
    shards[1][0, :] = -np.inf  # row 0: rank 1's whole shard masked
    t = vp.telemetry(shards, ranges, np.array([1, 8, 5]))
    assert t.target_owner_counts == (1, 0, 1) and t.targets_outside == 1
    assert t.nonfinite_local_max == (0, 1) and t.denominator_valid
    shards[0][0, :] = -np.inf  # row 0 fully masked: no valid denominator
    assert not vp.telemetry(shards, ranges, np.array([1, 2, 5])).denominator_valid


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_distributed_selection_equals_the_single_rank_policy(ranks: int, seed: int) -> None:
    """Ties across shards (integer logits): greedy and top-k keep the lowest global id, as spec/policy does."""
    rng = np.random.default_rng(seed)
    vocab = 9
    ties = rng.integers(0, 3, (8, vocab)).astype(np.float64)
    ranges = vp.shard_ranges(vocab, ranks)
    assert np.array_equal(vp.greedy(vp.shard(ties, ranges), ranges), [selectors.greedy(row)[0] for row in ties])
    for k in (1, 3, vocab):
        _, ids = vp.top_k(vp.shard(ties, ranges), ranges, k)
        assert np.array_equal(ids, np.stack([stable_order(-row)[:k] for row in ties]))  # transform.top_k's order
    probs = np.stack([softmax(row) for row in rng.standard_normal((8, vocab)) * 2])
    u = rng.random(8)
    drawn = vp.multinomial(vp.shard(probs, ranges), ranges, u)
    assert np.array_equal(drawn, [selectors.multinomial(p, x)[0] for p, x in zip(probs, u)])  # bit-exact chained CDF
    for p in (0.3, 0.9, 1.0):
        keep = np.concatenate(vp.top_p_keep(vp.shard(probs, ranges), ranges, p), axis=-1)
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p
        want = np.zeros_like(keep)
        np.put_along_axis(want, order, (before < p) | (np.arange(vocab) == 0), axis=-1)
        assert np.array_equal(keep, want)


def test_local_top_p_is_not_global_top_p() -> None:
    """The seed's warning, as a value: per-shard nuclei differ from the global nucleus on this row."""
    probs = np.array([[0.30, 0.25, 0.05, 0.2, 0.1, 0.1]])
    ranges = vp.shard_ranges(6, 2)
    glob = np.concatenate(vp.top_p_keep(vp.shard(probs, ranges), ranges, 0.5), axis=-1)
    local = np.concatenate([vp.top_p_keep([s / s.sum()], [(0, 3)], 0.5)[0] for s in vp.shard(probs, ranges)], axis=-1)
    assert glob.tolist() == [[True, True, False, False, False, False]]
    assert not np.array_equal(glob, local)


@pytest.mark.parametrize("bad", [
    lambda: vp.shard_ranges(3, 4), lambda: vp.shard_ranges(3, 0),
    lambda: vp.top_k([np.zeros((1, 2))], ((0, 2),), 3), lambda: vp.top_p_keep([np.ones((1, 2)) / 2], ((0, 2),), 0.0),
    lambda: vp.multinomial([np.ones((1, 2)) / 2], ((0, 2),), np.array([1.0])),
    lambda: vp.greedy([np.zeros((1, 2))], ((0, 3),)),
])
def test_bad_layouts_are_typed_rejections(bad) -> None:
    with pytest.raises(Rejection) as info:
        bad()
    assert info.value.code == "vocab_parallel.invalid_layout"


# ----------------------------------------------------------------------------------------------
# The torch.distributed runtime on gloo processes.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
def test_impl_on_gloo_ranks_equals_the_reference(ranks: int) -> None:
    results = check.run_ranks(ranks, check.SMALL, deadline_s=180)
    assert len(results) == ranks
    assert check.compare(check.SMALL, results) == []
    want = check.reference(ranks, check.SMALL)
    assert all(np.array_equal(r["greedy"], want["greedy"]) and np.array_equal(r["drawn"], want["drawn"]) for r in results)


def test_impl_smollm2_sized_head_on_two_ranks_equals_the_reference() -> None:
    """V = 49152, d = 576 (SmolLM2-135M's head shape), random float64 weights, two rows."""
    case = check.SMOLLM2_HEAD
    assert (case.vocab, case.hidden) == (49152, 576)
    assert check.compare(case, check.run_ranks(2, case, deadline_s=300)) == []


def test_compare_finds_a_wrong_result() -> None:
    """The comparison can fail: one changed id, mask entry or a loss off by a few ulps more than the bound."""
    results = check.run_ranks(2, check.SMALL, deadline_s=180)
    bad = [dict(r) for r in results]
    bad[1]["greedy"] = bad[1]["greedy"] + 1
    bad[0]["ce"] = bad[0]["ce"] * (1 + 1e3 * check.SMALL.vocab * EPS)
    problems = check.compare(check.SMALL, bad)
    assert any(p.startswith("rank 1 greedy") for p in problems) and any(p.startswith("rank 0 cross_entropy") for p in problems)


def _rank_one_skips(original):
    """Rank 1 leaves greedy before its collectives: rank 0 waits in an all-reduce nobody else enters."""
    import torch.distributed as dist

    def greedy(local, start, vocab_size, group=None):
        if dist.get_rank(group) == 1:
            return local.argmax(dim=-1) + start
        return original(local, start, vocab_size, group)

    return greedy


def test_a_rank_skipping_a_collective_ends_bounded_not_hung() -> None:
    skipping = Mutant("skips", "vocabulary parallel", "t", "M3.8 0x0A", "s",
                      [Patch("decodespec.impl.vocab_parallel:greedy", wrap=_rank_one_skips)])
    started = time.monotonic()
    with skipping.applied():
        problems = check.run_check(2, deadline_s=30)
    assert problems and problems[0].split(":", 1)[0] in ("timeout", "crash")
    assert time.monotonic() - started < 60 and leaked() == []


@pytest.mark.parametrize("name", VOCAB_MUTANTS)
def test_vocabulary_parallel_mutant_is_killed_by_the_distributed_check(name: str) -> None:
    assert {"vocab_local_max", "vocab_non_owner_subtracts_target", "vocab_top_p_per_shard"} <= set(VOCAB_MUTANTS)
    calibration = Calibration()
    distributed = [c for c in gate_checks("tiny") if c.kind == "distributed"]
    result = run_gate(name, "tiny", checks=distributed, calibration=calibration)
    assert result.outcome == KILLED, (result.outcome, result.crash)
    assert result.killed_by["check"] == "distributed.vocab_parallel.R2"
    assert calibration.findings["distributed.vocab_parallel.R2"].status == "passed"
    assert result.killed_by["layer"] == ("DECISION" if "top_p" in name else "TENSOR")
    assert leaked() == []


def test_vocab_mutants_run_their_distributed_check_first() -> None:
    assert all(MUTANTS[n].first == ("distributed.*",) for n in VOCAB_MUTANTS)
    assert attrs.fields_dict(Mutant)["first"].default == ()
