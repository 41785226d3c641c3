"""M3.8 0x0A: label smoothing over vocabulary shards against the single-rank spec/head.py smoothing, both conventions.

Rule checked: invariant.vocab_parallel_label_smoothing (with a planted mixed-convention rank and a
rank that smooths over its shard size).
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.spec import head_loss as HL
from decodespec.spec import vocab_parallel as VP
from decodespec.spec.errors import Rejection
from decodespec.spec.rules import RULES


def _case(v, n=6, d=5, seed=0):
    rng = np.random.default_rng(seed)
    h, e = rng.normal(size=(n, d)), rng.normal(size=(v, d))
    y = rng.integers(0, v, size=n)
    return h, e, y


def _single(z, y, eps, conv):
    spec = HL.LossSpec(label_smoothing=eps, smoothing=conv)
    loss = HL.row_losses(z, y, spec).row_losses
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return loss, p - HL.target_distribution(y, z.shape[1], spec)


def test_rules_registered_on_their_reference_functions():
    assert RULES["invariant.vocab_parallel_label_smoothing"].section.startswith("M3.8 0x0A")
    # The distributed references tests/test_vocab_parallel.py compares with the single-rank spec carry named rules.
    for rid, fn in (("logsumexp", VP.logsumexp), ("target_owner", VP.cross_entropy), ("backward", VP.logit_grads),
                    ("greedy", VP.greedy), ("top_k", VP.top_k), ("top_p", VP.top_p_keep), ("multinomial", VP.multinomial),
                    ("telemetry", VP.telemetry)):
        r = RULES[f"invariant.vocab_parallel_{rid}"]
        assert r.obj is fn and r.section.startswith("M3.8 0x0A"), rid


@pytest.mark.parametrize("conv", list(HL.Smoothing))
@pytest.mark.parametrize("v, ranks", [(13, 1), (13, 2), (13, 3), (10, 4), (7, 7)])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.37])
def test_sharded_smoothing_equals_single_rank(conv, v, ranks, eps):
    h, e, y = _case(v, seed=v * 10 + ranks)
    ranges = VP.shard_ranges(v, ranks)
    shards = VP.shard_logits(h, e, ranges)
    z = h @ e.T
    want_loss, want_grad = _single(z, y, eps, conv)
    got = VP.smoothed_cross_entropy(shards, ranges, y, eps, conv)
    np.testing.assert_allclose(got, want_loss, rtol=4 * np.finfo(float).eps * v, atol=4 * np.finfo(float).eps * v)
    grads = VP.smoothed_logit_grads(shards, ranges, y, eps, conv)
    np.testing.assert_allclose(np.concatenate(grads, axis=1), want_grad, atol=4 * np.finfo(float).eps * v)
    # The local weight gradients G_{Z_r}^T H stack to the single-rank (P - Q)^T H.
    np.testing.assert_allclose(np.concatenate(VP.weight_grads(grads, h)), want_grad.T @ h, atol=16 * np.finfo(float).eps * v)
    if eps == 0.0:  # no smoothing: the unsmoothed distributed loss
        np.testing.assert_allclose(got, VP.cross_entropy(shards, ranges, y), rtol=4 * np.finfo(float).eps * v)


def test_conventions_differ_and_mixed_ranks_are_caught():
    v, ranks, eps = 13, 3, 0.2
    h, e, y = _case(v)
    ranges = VP.shard_ranges(v, ranks)
    shards = VP.shard_logits(h, e, ranges)
    z = h @ e.T
    all_cls, _ = _single(z, y, eps, HL.Smoothing.ALL_CLASSES)
    non_tgt, _ = _single(z, y, eps, HL.Smoothing.NON_TARGET)
    assert np.abs(all_cls - non_tgt).max() > 1e-3
    # Planted: rank 0 uses ALL_CLASSES, the others NON_TARGET.
    a = VP.smoothing_contributions(shards, ranges, y, eps, "all_classes")
    b = VP.smoothing_contributions(shards, ranges, y, eps, "non_target")
    lse = VP.logsumexp(shards)[2]
    mixed = lse - (a[0] + b[1] + b[2])
    assert np.abs(mixed - all_cls).max() > 1e-3 and np.abs(mixed - non_tgt).max() > 1e-3
    # Planted: every rank smooths with its own shard size V_r instead of the global V.
    # (each rank sees itself as a one-shard vocabulary of V_r rows; a non-owner's target is -1).
    wrong = lse - sum(VP.smoothing_contributions([s], [(0, hi - lo)], np.where((lo <= y) & (y < hi), y - lo, -1), eps)[0]
                      for s, (lo, hi) in zip(shards, ranges))
    assert np.abs(wrong - all_cls).max() > 1e-3


def test_masked_columns_and_refusals():
    h, e, y = _case(9)
    ranges = VP.shard_ranges(9, 3)
    z = h @ e.T
    z[:, 4] = -np.inf
    y = np.where(y == 4, 0, y)
    shards = VP.shard(z, ranges)
    # With eps > 0 a masked class holds target mass: +inf on one rank and on three.
    want, _ = _single(z, y, 0.1, HL.Smoothing.ALL_CLASSES)
    got = VP.smoothed_cross_entropy(shards, ranges, y, 0.1)
    assert np.array_equal(np.isposinf(got), np.isposinf(want)) and np.isposinf(got).all()
    np.testing.assert_allclose(VP.smoothed_cross_entropy(shards, ranges, y, 0.0), _single(z, y, 0.0, "all_classes")[0], rtol=1e-13)
    with pytest.raises(Rejection):
        VP.smoothing_targets(ranges, y, 1.5)
    with pytest.raises(ValueError):
        VP.smoothing_targets(ranges, y, 0.1, "half")
