"""spec/head.py: the head equation, score kinds, translation invariance, the ledger (M3.8 0x02, 0x04, 0x0A).

Rules checked: invariant.head_equation, invariant.head_criterion_pairing,
invariant.head_translation_invariance, invariant.head_log_ratio, invariant.head_ledger.
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.spec import head as H
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
    base = H.row_losses(z, y).row_losses
    moved = H.row_losses(z + shift, y).row_losses
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

    from decodespec.checks.head_check import measure_head

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

    from decodespec.checks.head_check import measure_head

    ids = torch.tensor([[1, 4093, 314, 253, 1789]])
    last = measure_head(smollm2_model, ids, 1, expected_rows=1)
    assert last.shape == H.HeadShape(vocab_size=49152, hidden_size=576, bias=False, tied=True)
    assert last.agrees and last.measured.macs == 49152 * 576 and last.measured.head_parameters == 28_311_552
    full = measure_head(smollm2_model, ids, 0, expected_rows=5)
    assert full.agrees and full.measured.macs == 5 * last.measured.macs
