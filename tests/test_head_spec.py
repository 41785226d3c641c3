"""spec/head.py: the head equation, score kinds, translation invariance, the ledger (M3.8 0x02, 0x04, 0x0A).

Rules checked: invariant.head_equation, invariant.head_criterion_pairing,
invariant.head_translation_invariance, invariant.head_log_ratio, invariant.head_ledger.
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.spec import head as H
from decodespec.spec import head_loss as HL
from decodespec.spec import head_tying as HT
from decodespec.spec.errors import Rejection
from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.rules import RULES

RNG = np.random.default_rng(20)


def _head(r=5, v=9, d=4, bias=True):
    return RNG.normal(size=(r, d)), RNG.normal(size=(v, d)), (RNG.normal(size=v) if bias else None)


def test_rules_are_registered_with_their_sections():
    for rid in ("invariant.head_equation", "invariant.head_criterion_pairing", "invariant.head_translation_invariance",
                "invariant.head_log_ratio", "invariant.head_ledger"):
        assert RULES[rid].section.startswith("M3.8 0x"), rid
        assert RULES[rid].obj.__module__ == "decodespec.spec.head"


def test_head_equation_is_stored_orientation_dot_products_plus_bias():
    h, e, b = _head()
    z = H.head_logits(h, e, b)
    assert z.shape == (5, 9)
    assert z[2, 7] == pytest.approx(float(np.dot(h[2], e[7]) + b[7]), abs=1e-12)
    # A hand transpose of the stored weight is a different (here: shape-refused) head (0x12 item 4).
    with pytest.raises(Rejection) as err:
        H.head_logits(h, e.T, b)
    assert err.value.code == "head.invalid_input"
    # -inf in the bias masks a column; NaN is refused.
    b2 = b.copy()
    b2[3] = -np.inf
    assert np.isneginf(H.head_logits(h, e, b2)[:, 3]).all()
    with pytest.raises(Rejection) as err:
        H.head_logits(h, e, np.full(9, np.nan))
    assert err.value.code == "head.nan_logits"


def test_head_output_kind_and_criterion_pairing():
    assert H.criterion_accepts("linear", "cross_entropy") is ScoreKind.LOGITS
    assert H.criterion_accepts("generator", "kl_div") is ScoreKind.LOGPROBS
    assert H.criterion_accepts("generator", "nll") is ScoreKind.LOGPROBS
    for head, crit in (("linear", "nll"), ("linear", "kl_div"), ("generator", "cross_entropy")):
        with pytest.raises(Rejection) as err:
            H.criterion_accepts(head, crit)
        assert err.value.code == "policy.score_kind_mismatch" and err.value.path == "$.criterion"
    with pytest.raises(Rejection) as err:
        H.criterion_accepts("softmax", "cross_entropy")
    assert err.value.code == "head.invalid_input"


@pytest.mark.parametrize("shift", [-1e4, -3.5, 0.0, 7.25, 1e4])
def test_translation_invariance(shift):
    z = RNG.normal(size=(4, 11)) * 5
    z[1, 2] = -np.inf
    assert H.translation_gap(z, shift) < 1e-12
    # and the cross entropy does not move either
    y = np.array([0, 3, 10, 5])
    base = HL.row_losses(z, y).row_losses
    moved = HL.row_losses(z + shift, y).row_losses
    assert np.allclose(base, moved, atol=1e-9, rtol=0)


def test_translation_gap_is_not_trivially_zero_for_a_non_uniform_shift():
    z = RNG.normal(size=(1, 6))
    p = np.exp(z - np.log(np.exp(z).sum()))
    zs = z + np.arange(6)  # not a translation
    ps = np.exp(zs - np.log(np.exp(zs).sum()))
    assert np.abs(p - ps).max() > 1e-2  # the probe measures something real


def test_log_ratio_equals_logit_difference():
    z = RNG.normal(size=(3, 8)) * 30
    z[0, 0] = -np.inf
    assert H.log_ratio_gap(z) < 1e-10
    with pytest.raises(Rejection) as err:
        H.log_ratio_gap(np.full((2, 3), -np.inf))
    assert err.value.code == "head.degenerate_row" and err.value.path == "$.logits[0]"


def test_ledger_formulas_and_the_worked_example():
    # M3.8 0x0A worked example: B=8, S=2048, d=4096, V=32000.
    shape = H.HeadShape(vocab_size=32000, hidden_size=4096)
    all_rows, last = H.head_ledger(shape, 8 * 2048), H.head_ledger(shape, 8)
    assert all_rows.head_parameters == 131_072_000
    assert all_rows.logit_elements == 524_288_000 and all_rows.logit_bytes(2) == 1000 * 2**20
    assert all_rows.macs == 2_147_483_648_000 and last.macs == 1_048_576_000
    assert all_rows.macs // last.macs == 2048 and last.logit_elements == 256_000
    biased = H.HeadShape(vocab_size=10, hidden_size=3, bias=True)
    assert H.head_ledger(biased, 2).head_parameters == 40
    tied = H.HeadShape(vocab_size=10, hidden_size=3, bias=True, tied=True)
    led = H.head_ledger(tied, 2)
    assert led.new_parameters == 10 and led.macs == 60  # tying removes parameters, not work
    assert H.head_ledger(H.HeadShape(10, 3, tied=True), 0).new_parameters == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(Rejection):
            H.head_ledger(shape, bad)


def test_our_models_head_ledger_for_each_row_scope(tiny_model):
    import torch

    from decodespec.checks.gate.head_check import measure_head

    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(0))
    expected_rows = {0: 14, 1: 2, 3: 6}
    for keep, rows in expected_rows.items():
        m = measure_head(tiny_model, ids, keep, expected_rows=rows)
        assert m.shape == H.HeadShape(vocab_size=512, hidden_size=64, bias=False, tied=True)
        assert m.agrees, (keep, m)
        assert m.measured.macs == rows * 512 * 64 and m.measured.new_parameters == 0
    m = measure_head(tiny_model, ids, torch.tensor([0, 6]), expected_rows=4)
    assert m.agrees and m.measured.macs == 4 * 512 * 64
    one = measure_head(tiny_model, ids[:1], 1, expected_rows=1)  # a single row: the torch.mv path
    assert one.agrees and one.measured.macs == 512 * 64
    # A scope that claims one row per sequence but projects all of them is caught.
    assert not measure_head(tiny_model, ids, 0, expected_rows=2).agrees


def test_smollm2_head_ledger(smollm2_model):
    import torch

    from decodespec.checks.gate.head_check import measure_head

    ids = torch.tensor([[1, 4093, 314, 253, 1789]])
    last = measure_head(smollm2_model, ids, 1, expected_rows=1)
    assert last.shape == H.HeadShape(vocab_size=49152, hidden_size=576, bias=False, tied=True)
    assert last.agrees and last.measured.macs == 49152 * 576 and last.measured.head_parameters == 28_311_552
    full = measure_head(smollm2_model, ids, 0, expected_rows=5)
    assert full.agrees and full.measured.macs == 5 * last.measured.macs


# -- 0x05: the training interface -------------------------------------------------------------------
# Rules checked: invariant.head_loss_row, invariant.head_label_smoothing, invariant.head_mean_from_sum_and_count,
# invariant.head_schedules_agree, invariant.head_gradients.

def _training_case(r=13, v=17, d=6, scale=1.0, seed=5):
    rng = np.random.default_rng(seed)
    h, e, b = rng.normal(size=(r, d)) * scale, rng.normal(size=(v, d)) * scale, rng.normal(size=v)
    y = rng.integers(0, v, size=r)
    y[[i for i in (0, 1, 2, 9) if i < r]] = H.IGNORE_INDEX  # clustered at the front: uneven valid counts per chunk
    return h, e, b, y


def _torch_rows(z, y, eps=0.0):
    import torch
    import torch.nn.functional as F

    return F.cross_entropy(torch.tensor(z), torch.tensor(y), ignore_index=H.IGNORE_INDEX, label_smoothing=eps,
                           reduction="none").numpy()


def test_row_loss_is_m_plus_log_s_minus_target_on_supervised_rows_only():
    h, e, b, y = _training_case()
    z = H.head_logits(h, e, b)
    res = HL.row_losses(z, y)
    r = 5
    m = z[r].max()
    s = np.exp(z[r] - m).sum()
    assert res.row_losses[r] == pytest.approx(m + np.log(s) - z[r, y[r]], abs=1e-12)
    assert res.valid_count == 9 and (res.row_losses[[0, 1, 2, 9]] == 0).all()
    assert res.loss_sum == pytest.approx(res.row_losses.sum()) and res.mean == pytest.approx(res.loss_sum / 9)
    assert np.allclose(res.row_losses, _torch_rows(z, y), atol=1e-12, rtol=0)  # PyTorch's reduction="none"
    # An ignored row may be degenerate; a supervised one may not.
    z2 = z.copy()
    z2[0] = -np.inf
    assert HL.row_losses(z2, y).valid_count == 9
    z2[3] = -np.inf
    with pytest.raises(Rejection) as err:
        HL.row_losses(z2, y)
    assert err.value.code == "head.degenerate_row" and err.value.path == "$.logits[3]"
    bad = y.copy()
    bad[4] = 17
    with pytest.raises(Rejection) as err:
        HL.row_losses(z, bad)
    assert err.value.code == "head.invalid_input" and err.value.path == "$.labels[4]"


def test_label_smoothing_conventions_are_named_and_differ():
    h, e, b, y = _training_case()
    z = H.head_logits(h, e, b)
    eps = 0.1
    all_cls = HL.LossSpec(label_smoothing=eps)
    non_tgt = HL.LossSpec(label_smoothing=eps, smoothing="non_target")
    q = HL.target_distribution(y, 17, all_cls)
    assert np.allclose(q[~(y == H.IGNORE_INDEX)].sum(axis=1), 1.0) and (q[0] == 0).all()
    assert q[4, y[4]] == pytest.approx(1 - eps + eps / 17) and q[4, (y[4] + 1) % 17] == pytest.approx(eps / 17)
    qn = HL.target_distribution(y, 17, non_tgt)
    assert qn[4, y[4]] == pytest.approx(1 - eps) and qn[4, (y[4] + 1) % 17] == pytest.approx(eps / 16)
    # ALL_CLASSES is PyTorch's label_smoothing; NON_TARGET is another loss for the same eps.
    ours = HL.row_losses(z, y, all_cls).row_losses
    assert np.allclose(ours, _torch_rows(z, y, eps), atol=1e-12, rtol=0)
    other = HL.row_losses(z, y, non_tgt).row_losses
    assert np.abs(other - ours).max() > 1e-3
    # the closed form (1 - eps)(-log p_y) + eps * (-(1/V) sum_v log p_v)
    logp = z[4] - np.log(np.exp(z[4] - z[4].max()).sum()) - z[4].max()
    assert ours[4] == pytest.approx((1 - eps) * -logp[y[4]] + eps * -logp.mean(), abs=1e-12)
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(Rejection):
            HL.LossSpec(label_smoothing=bad)


@pytest.mark.parametrize("spec", [HL.LossSpec(), HL.LossSpec(label_smoothing=0.2), HL.LossSpec(label_smoothing=0.2, smoothing="non_target")])
@pytest.mark.parametrize("chunks", [1, 4, [1, 5, 2, 5], 13])
@pytest.mark.parametrize("vocab_tile", [1, 5, 17])
def test_schedules_agree_row_by_row(spec, chunks, vocab_tile):
    h, e, b, y = _training_case()
    full = HL.materialized_loss(h, e, b, y, spec)
    chunked = HL.chunked_loss(h, e, b, y, spec, chunks)
    tiled = HL.tiled_loss(h, e, b, y, spec, chunks, vocab_tile)
    for other in (chunked, tiled):
        assert np.allclose(other.row_losses, full.row_losses, atol=1e-12, rtol=1e-12)
        assert other.valid_count == full.valid_count == 9
        assert other.loss_sum == pytest.approx(full.loss_sum, abs=1e-11)
        assert other.mean == pytest.approx(full.mean, abs=1e-12)
        assert (other.valid == full.valid).all()


def test_a_mean_of_chunk_means_is_another_number():
    h, e, b, y = _training_case()
    full = HL.materialized_loss(h, e, b, y)
    means = [r.mean for r in (HL.materialized_loss(h[a:z], e, b, y[a:z]) for a, z in HL.chunk_bounds(13, [1, 5, 2, 5]))
             if r.valid_count]
    assert abs(float(np.mean(means)) - full.mean) > 1e-3
    assert HL.chunked_loss(h, e, b, y, chunks=[1, 5, 2, 5]).mean == pytest.approx(full.mean, abs=1e-12)
    for bad in (0, [3, 3], [13, 0]):
        with pytest.raises(Rejection) as err:
            HL.chunk_bounds(13, bad)
        assert err.value.code == "head.invalid_input"


def test_extreme_logits_and_inf_masks():
    h, e, b, y = _training_case(scale=70.0)  # |z| up to about 1e4
    b = b.copy()
    b[[3, 8]] = -np.inf
    y = np.where(np.isin(y, [3, 8]), 4, y)
    z = H.head_logits(h, e, b)
    assert np.abs(z[np.isfinite(z)]).max() > 5e3
    full = HL.materialized_loss(h, e, b, y)
    assert np.isfinite(full.row_losses).all()
    assert np.allclose(full.row_losses, _torch_rows(z, y), atol=1e-9, rtol=1e-12)
    for spec in (HL.LossSpec(), HL.LossSpec(label_smoothing=0.0)):
        tiled = HL.tiled_loss(h, e, b, y, spec, chunks=[3, 10], vocab_tile=4)
        assert np.allclose(tiled.row_losses, full.row_losses, atol=1e-9, rtol=1e-12)
    # Explicit +-1e4 rows: stable, no overflow.
    zz = np.array([[1e4, -1e4, 0.0], [1e4, 1e4, -np.inf]])
    res = HL.row_losses(zz, np.array([0, 1]))
    assert res.row_losses[0] == pytest.approx(0.0, abs=1e-12) and res.row_losses[1] == pytest.approx(np.log(2), abs=1e-12)
    # A masked target has probability 0: loss +inf (as PyTorch), in every schedule; smoothing over a masked class too.
    inf_case = HL.row_losses(zz, np.array([0, 2]))
    assert np.isposinf(inf_case.row_losses[1])
    assert np.isposinf(HL.row_losses(zz, np.array([0, 0]), HL.LossSpec(label_smoothing=0.1)).row_losses[1])
    hh, ee, bb = np.eye(3), np.eye(3), np.array([0.0, 0.0, -np.inf])
    assert np.isposinf(HL.tiled_loss(hh, ee, bb, np.array([0, 1, 2]), vocab_tile=2).row_losses[2])
    with pytest.raises(Rejection) as err:
        HL.row_losses(np.array([[np.nan, 0.0]]), np.array([0]))
    assert err.value.code == "head.nan_logits"


def _loss_of(hidden, weight, bias, y, spec):
    return HL.materialized_loss(hidden, weight, bias, y, spec).mean


@pytest.mark.parametrize("spec", [HL.LossSpec(), HL.LossSpec(label_smoothing=0.1), HL.LossSpec(label_smoothing=0.1, smoothing="non_target")])
def test_gradients_against_finite_differences(spec):
    h, e, b, y = _training_case(r=6, v=7, d=3)
    y[[0, 1, 2]] = [1, H.IGNORE_INDEX, 5]
    g = HL.head_gradients(h, e, b, y, spec)
    assert np.allclose(g.hidden, g.logits @ e) and np.allclose(g.weight, g.logits.T @ h) and np.allclose(g.bias, g.logits.sum(axis=0))
    assert (g.logits[~(y != H.IGNORE_INDEX)] == 0).all() and (g.hidden[1] == 0).all()
    step = 1e-6
    for name, arr in (("hidden", h), ("weight", e), ("bias", b)):
        num = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += step
            minus[idx] -= step
            args = {"hidden": h, "weight": e, "bias": b}
            lp = _loss_of(**{**args, name: plus}, y=y, spec=spec)
            lm = _loss_of(**{**args, name: minus}, y=y, spec=spec)
            num[idx] = (lp - lm) / (2 * step)
        assert np.allclose(getattr(g, name), num, atol=1e-8, rtol=1e-6), name


def test_gradients_against_torch_autograd_float64():
    import torch
    import torch.nn.functional as F

    for eps in (0.0, 0.15):
        h, e, b, y = _training_case()
        th, te, tb = (torch.tensor(x, requires_grad=True) for x in (h, e, b))
        loss = F.cross_entropy(F.linear(th, te, tb), torch.tensor(y), ignore_index=H.IGNORE_INDEX, label_smoothing=eps)
        loss.backward()
        g = HL.head_gradients(h, e, b, y, HL.LossSpec(label_smoothing=eps))
        assert loss.item() == pytest.approx(HL.materialized_loss(h, e, b, y, HL.LossSpec(label_smoothing=eps)).mean, abs=1e-12)
        for ours, theirs in ((g.hidden, th.grad), (g.weight, te.grad), (g.bias, tb.grad)):
            assert np.allclose(ours, theirs.numpy(), atol=1e-13, rtol=1e-10)
    g_sum = HL.head_gradients(h, e, b, y, reduction="sum")
    assert np.allclose(g_sum.logits, HL.head_gradients(h, e, b, y).logits * 9)
    assert HL.head_gradients(h, e, None, y).bias is None
    with pytest.raises(Rejection):
        HL.head_gradients(h, e, b, y, reduction="max")


# -- 0x09: weight tying (pure) ------------------------------------------------------------------------
# Rules checked: invariant.head_tied_one_parameter, invariant.head_tied_gradient_accumulates.

def test_tying_violations_name_each_way_to_break_the_declaration():
    T = HT.TyingObservation
    assert HT.tying_violations(T(True, True, True, True, 1, 1)) == ()
    assert HT.tying_violations(T(False, False, False, False, 2, 2)) == ()
    assert HT.tying_violations(T(True, False, False, True)) == ("copied_not_tied",)
    assert HT.tying_violations(T(True, False, False, False)) == ("not_tied",)
    assert HT.tying_violations(T(True, True, False, True)) == ("storage_split",)
    assert HT.tying_violations(T(False, True, True, True)) == ("tied_but_declared_untied",)
    assert HT.tying_violations(T(True, False, False, True, 2, 2)) == ("copied_not_tied", "optimizer_duplicate")
    assert HT.tying_violations(T(True, True, True, True, 0)) == ("optimizer_missing",)
    assert HT.tying_violations(T(True, True, True, True, 1, 2)) == ("optimizer_duplicate",)
    assert set(HT.TIED_VIOLATIONS) >= {"copied_not_tied", "optimizer_duplicate"}


def test_tied_gradient_is_a_sparse_scatter_plus_a_dense_classifier_term():
    rng = np.random.default_rng(9)
    v, d = 6, 3
    ids = np.array([4, 1, 4, 4])  # a repeated id accumulates
    gin = rng.normal(size=(4, d))
    g, h = rng.normal(size=(2, v)), rng.normal(size=(2, d))
    inp, out = HT.tied_gradient(ids, gin, g, h, v)
    assert np.allclose(inp[4], gin[[0, 2, 3]].sum(axis=0)) and np.allclose(inp[1], gin[1])
    assert (inp[[0, 2, 3, 5]] == 0).all()  # sparse in token rows
    assert np.allclose(out, g.T @ h) and (np.abs(out).sum(axis=1) > 0).all()  # dense over the vocabulary
    with pytest.raises(Rejection) as err:
        HT.tied_gradient(np.array([6, 0, 0, 0]), gin, g, h, v)
    assert err.value.code == "head.invalid_input"


def test_tiled_schedule_matches_on_drawn_cases_with_masks_and_both_conventions():
    """invariant.head_schedules_agree on 200 drawn cases: -inf masks, logits to ~1e4, ignored rows, eps in {0, 0.1, 1}."""
    rng = np.random.default_rng(3)
    compared = 0
    for _ in range(200):
        r, v, d = int(rng.integers(1, 9)), int(rng.integers(2, 12)), int(rng.integers(1, 5))
        h, e, b = rng.normal(size=(r, d)) * rng.choice([1, 100]), rng.normal(size=(v, d)) * rng.choice([1, 100]), rng.normal(size=v)
        if rng.random() < 0.5:
            b[rng.integers(0, v, size=2)] = -np.inf
        y = rng.integers(0, v, size=r)
        y[rng.random(r) < 0.3] = H.IGNORE_INDEX
        spec = HL.LossSpec(label_smoothing=float(rng.choice([0.0, 0.1, 1.0])), smoothing=str(rng.choice(["all_classes", "non_target"])))
        chunks, tile = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        try:
            full = HL.materialized_loss(h, e, b, y, spec)
        except Rejection as err:  # every column of a supervised row masked: both schedules refuse it the same way
            with pytest.raises(Rejection) as other:
                HL.tiled_loss(h, e, b, y, spec, chunks=chunks, vocab_tile=tile)
            assert (other.value.code, other.value.path) == (err.code, err.path) == ("head.degenerate_row", err.path)
            continue
        tiled = HL.tiled_loss(h, e, b, y, spec, chunks=chunks, vocab_tile=tile)
        assert np.allclose(tiled.row_losses, full.row_losses, rtol=1e-10, atol=1e-8), (spec, y, b)
        assert tiled.valid_count == full.valid_count
        compared += int(np.isposinf(full.row_losses).any())
    assert compared > 0  # some cases put mass on a masked class (+inf in both schedules)
