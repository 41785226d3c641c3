"""M3.8 0x04 accumulation dtype, 0x05 row map and RNG, 0x09 tying variants: rules planted with violations.

Rules checked: invariant.head_accumulation_dtype, invariant.head_row_map, invariant.head_loss_rng_free,
invariant.head_tying_variant.
"""

from __future__ import annotations

import numpy as np
import pytest

from decodespec.spec import head_loss as HL
from decodespec.spec import head_tying as HT
from decodespec.spec.errors import Rejection
from decodespec.spec.rules import RULES

torch = pytest.importorskip("torch")

from decodespec.checks.gate import head_check as hc


def test_rules_registered_with_sections():
    for rid in ("invariant.head_accumulation_dtype", "invariant.head_row_map", "invariant.head_loss_rng_free",
                "invariant.head_tying_variant"):
        assert RULES[rid].section.startswith("M3.8 0x0"), rid


# -- 0x04 accumulation dtype ---------------------------------------------------------------------

@pytest.mark.parametrize("inp, acc, want", [
    ("bfloat16", "float32", ()), ("float16", "float64", ()), ("float32", "float32", ()), ("float64", "float64", ()),
    ("bfloat16", "bfloat16", ("half_accumulation",)), ("bfloat16", "float16", ("half_accumulation",)),
    ("float16", "bfloat16", ("half_accumulation", "narrower_accumulation")),
    ("float64", "float32", ("narrower_accumulation",)), ("float32", "int8", ("unknown_dtype",)),
])
def test_accumulation_policy_is_judged(inp, acc, want):
    assert HL.accumulation_violations(HL.PrecisionPolicy(inp, acc)) == want


def test_unit_roundoff_matches_the_dtypes():
    for name, u in HL.UNIT_ROUNDOFF.items():
        assert u == float(torch.finfo(getattr(torch, name)).eps) / 2, name


def test_error_bound_grows_with_unit_roundoff_and_refuses_bad_policies():
    rng = np.random.default_rng(3)
    h, e, b = rng.normal(size=(4, 6)), rng.normal(size=(9, 6)), rng.normal(size=9)
    bf = HL.loss_error_bound(HL.PrecisionPolicy("bfloat16", "float32"), h, e, b)
    fp = HL.loss_error_bound(HL.PrecisionPolicy("float16", "float32"), h, e, b)
    f32 = HL.loss_error_bound(HL.PrecisionPolicy("float32", "float32"), h, e, b)
    assert bf.row > fp.row > f32.row > 0 and bf.logit / fp.logit == pytest.approx(8.0, rel=1e-3)
    with pytest.raises(Rejection) as err:
        HL.loss_error_bound(HL.PrecisionPolicy("bfloat16", "bfloat16"), h, e, b)
    assert err.value.code == "head.invalid_input"
    with pytest.raises(Rejection):
        HL.gamma(300, 2.0 ** -8)  # n u >= 1: no bound


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_reference_schedules_pass(dtype):
    for fn in (hc.torch_reference, hc.torch_chunked, hc.torch_tiled):
        v = hc.check_loss(fn, dtype=dtype)
        assert v.passed, (fn.__name__, v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_tolerance_is_derived_not_vacuous(dtype):
    # A loss whose rows are off by just over the derived row bound fails at ROWS: the bound is the gate.
    def shifted(hidden, weight, bias, labels, **kw):
        out = hc.torch_reference(hidden, weight, bias, labels, **kw)
        case = next(c for c in hc.loss_cases() if c.hidden.shape[0] == hidden.shape[0] and c.weight.shape == tuple(weight.shape))
        tol = hc.derived_tolerances(hc._rounded(case, dtype), HL.PrecisionPolicy(dtype, "float32"))["row_losses"].atol
        valid = labels != kw["ignore_index"]
        rows = out["row_losses"].double() + torch.where(valid, 1.5 * tol, 0.0)
        return {**out, "row_losses": rows}

    v = hc.check_loss(shifted, dtype=dtype)
    assert not v.passed and (v.layer, v.check) == ("ROWS", "row_losses"), v
    for name in ("head_chunk_mean", "head_valid_count_all_rows", "head_bias_gradient_dropped", "head_ignored_rows_trained"):
        assert not hc.check_loss(hc.LOSS_MUTANTS[name], dtype=dtype).passed, name


def test_declared_half_accumulation_is_refused_before_any_call():
    calls = []

    def fn(*a, **kw):
        calls.append(1)
        return hc.torch_reference(*a, **kw)

    v = hc.check_loss(fn, dtype="bfloat16", accumulation_dtype="bfloat16")
    assert (v.layer, v.rule, v.check) == ("INTERFACE", "invariant.head_accumulation_dtype", "accumulation_dtype") and not calls
    assert hc.check_loss(hc.torch_reference, dtype="bfloat16", accumulation_dtype="float64").passed


# -- 0x05 row map and RNG --------------------------------------------------------------------------

def _labels():
    y = np.array([[5, -100, 7, 2], [-100, -100, 1, 3], [4, 4, -100, 0]])
    return y


def test_row_map_is_built_once_and_read_only():
    m = HL.row_map_from_labels(_labels())
    assert m.batch.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and m.position.tolist() == [0, 1, 2, 3] * 3
    assert m.supervised.sum() == 8
    with pytest.raises(ValueError):
        m.target[0] = 9
    with pytest.raises(Rejection):
        HL.row_map_from_labels(np.zeros(5, dtype=np.int64))


def _chunks(m, bounds):
    return [(a, m.batch[a:b], m.position[a:b], m.target[a:b]) for a, b in bounds]


def test_chunks_that_read_the_map_pass_and_rederived_chunks_fail():
    m = HL.row_map_from_labels(_labels())
    assert HL.row_map_violations(m, _chunks(m, [(0, 5), (5, 7), (7, 12)])) == ()
    # A chunk that re-derives positions from its own offset (chunk-local positions).
    bad = _chunks(m, [(0, 5), (5, 12)])
    bad[1] = (5, bad[1][1], np.arange(7), bad[1][3])
    assert HL.row_map_violations(m, bad) == ("row_rederived",)
    # A chunk that shifts its targets a second time.
    bad = _chunks(m, [(0, 6), (6, 12)])
    bad[1] = (6, bad[1][1], bad[1][2], np.r_[bad[1][3][1:], -100])
    assert HL.row_map_violations(m, bad) == ("row_rederived",)
    # Overlapping or missing rows.
    assert HL.row_map_violations(m, _chunks(m, [(0, 5), (4, 12)])) == ("rows_not_tiled",)
    assert HL.row_map_violations(m, _chunks(m, [(0, 5), (5, 11)])) == ("rows_not_tiled",)


def test_row_map_drives_the_chunked_schedule():
    rng = np.random.default_rng(5)
    y = _labels()
    m = HL.row_map_from_labels(y)
    h, e = rng.normal(size=(12, 4)), rng.normal(size=(8, 4))
    whole = HL.materialized_loss(h, e, None, m.target)
    chunked = HL.chunked_loss(h, e, None, m.target, chunks=[5, 2, 5])
    assert np.array_equal(whole.valid, m.supervised) and chunked.valid_count == int(m.supervised.sum())
    assert chunked.mean == pytest.approx(whole.mean, rel=1e-14)


def test_loss_that_draws_random_state_is_caught():
    assert HL.rng_violations(b"a", b"a", b"s", b"s") == ()
    assert HL.rng_violations(b"a", b"b") == ("global_rng_consumed",)
    assert HL.rng_violations(b"a", b"a", b"s", b"t") == ("sampling_rng_consumed",)

    def dropout_loss(hidden, weight, bias, labels, **kw):
        hidden = torch.nn.functional.dropout(hidden, p=0.0 + 1e-9, training=True)  # draws even at p ~ 0
        return hc.torch_reference(hidden, weight, bias, labels, **kw)

    v = hc.check_loss(dropout_loss)
    assert (v.layer, v.rule, v.check) == ("INTERFACE", "invariant.head_loss_rng_free", "rng"), v


# -- 0x09 tying variants ---------------------------------------------------------------------------

def _layout(**kw):
    base = {"input_table": "E", "output_weight": "E", "input_width": 8, "model_width": 8}
    return HT.TyingLayout(**{**base, **kw})


@pytest.mark.parametrize("declared, layout, want", [
    ("direct", _layout(), ()),
    ("direct", _layout(output_weight="W"), ("not_shared",)),
    ("direct", _layout(input_width=6), ("width_mismatch",)),
    ("untied", _layout(output_weight="W", input_width=6), ()),
    ("untied", _layout(), ("shared_but_untied_declared",)),
    ("copied_init", _layout(output_weight="W"), ()),
    ("copied_init", _layout(), ("shared_but_untied_declared",)),
    ("projected", _layout(input_width=6, projection_shape=(6, 8), projection_key="head_projection"), ()),
    ("projected", _layout(input_width=6), ("projection_missing",)),
    ("projected", _layout(input_width=6, projection_shape=(6, 8)), ("projection_not_pinned",)),
    ("direct", _layout(projection_shape=(8, 8), projection_key="p"), ("unexpected_projection",)),
    ("source_target_output", _layout(source_table="E", source_vocab_hash="h", target_vocab_hash="h"), ()),
    ("source_target_output", _layout(source_table="S", source_vocab_hash="h", target_vocab_hash="h"), ("source_not_shared",)),
    ("source_target_output", _layout(source_table="E", source_vocab_hash="h", target_vocab_hash="g"),
     ("source_target_vocab_differ",)),
    ("source_target_output", _layout(), ("no_source",)),
])
def test_tying_variant_declaration_against_layout(declared, layout, want):
    assert HT.tying_variant_violations(declared, layout) == want


def test_tying_variant_read_from_torch_models():
    from decodespec.impl.encdec import make_model
    from decodespec.impl.tiny import load_tiny

    tiny = load_tiny(seed=0)
    assert HT.tying_variant_violations("direct", hc.observe_tying_layout(tiny)) == ()
    assert HT.tying_variant_violations("untied", hc.observe_tying_layout(tiny)) == ("shared_but_untied_declared",)
    copied = hc.untie_by_copy(load_tiny(seed=0))
    assert HT.tying_variant_violations("direct", hc.observe_tying_layout(copied)) == ("not_shared",)
    assert HT.tying_variant_violations("copied_init", hc.observe_tying_layout(copied)) == ()
    ed = make_model(11, 11, 1, d_model=16, d_ff=32, h=2)
    lay = hc.observe_tying_layout(ed, source_vocab_hash="sha256:a", target_vocab_hash="sha256:b")
    assert HT.tying_variant_violations("untied", lay) == ()
    # Three-way tying over two different vocabularies of equal size: refused twice over.
    ed.tgt_embed[0].lut.weight = ed.src_embed[0].lut.weight
    ed.generator.proj.weight = ed.src_embed[0].lut.weight
    lay = hc.observe_tying_layout(ed, source_vocab_hash="sha256:a", target_vocab_hash="sha256:b")
    assert HT.tying_variant_violations("source_target_output", lay) == ("source_target_vocab_differ",)
    lay = hc.observe_tying_layout(ed, source_vocab_hash="sha256:a", target_vocab_hash="sha256:a")
    assert HT.tying_variant_violations("source_target_output", lay) == ()
