"""M3.8 0x08: encoder-decoder vocabularies and the migration transaction, with planted violations.

Rules checked: invariant.vocab_encdec_identity, invariant.vocab_migration_transaction,
mutant.vocab_migration_not_rolled_back.
"""

from __future__ import annotations

import pytest

from decodespec.spec import vocab_migration as SVM
from decodespec.spec.rules import RULES

torch = pytest.importorskip("torch")

from decodespec.checks.gate import vocab_check as vc
from decodespec.checks.lab.mutants import MUTANTS
from decodespec.impl.encdec import make_model
from decodespec.impl.tiny import load_tiny

SRC = [f"s{i}" for i in range(11)]
TGT = [f"t{i}" for i in range(11)]  # the same size, another ordered vocabulary


def test_rules_registered():
    for rid in ("invariant.vocab_encdec_identity", "invariant.vocab_migration_transaction"):
        assert RULES[rid].section.startswith("M3.8 0x08"), rid


def _obs(**kw):
    base = {"source_hash": "a", "target_hash": "b", "source_size": 5, "target_size": 7, "source_rows": 5, "target_rows": 7, "output_rows": 7,
                "source_table": "S", "target_table": "T", "output_weight": "O"}
    return SVM.EncDecVocab(**{**base, **kw})


@pytest.mark.parametrize("kw, want", [
    ({}, ()),
    ({"output_rows": 5}, ("output_rows",)),
    ({"source_rows": 7}, ("source_rows",)),
    ({"target_rows": 5}, ("target_rows",)),
    ({"output_weight": "S"}, ("output_over_source",)),
    ({"target_table": "S", "output_weight": "S"}, ("output_over_source", "target_over_source")),
    ({"target_table": "S", "output_weight": "S", "target_hash": "a", "target_size": 5, "target_rows": 5, "output_rows": 5}, ()),
])
def test_encdec_identity_values(kw, want):
    assert SVM.encdec_violations(_obs(**kw)) == want


def test_encdec_identity_read_from_torch():
    ed = make_model(len(SRC), len(TGT), 1, d_model=16, d_ff=32, h=2)
    assert SVM.encdec_violations(vc.observe_encdec(ed, SRC, TGT)) == ()
    # Equal sizes prove nothing: a target head over the source table is refused by identity, not by shape.
    ed.generator.proj.weight = ed.src_embed[0].lut.weight
    assert SVM.encdec_violations(vc.observe_encdec(ed, SRC, TGT)) == ("output_over_source",)
    # One shared ordered vocabulary makes the same sharing legal.
    assert SVM.encdec_violations(vc.observe_encdec(ed, SRC, SRC)) == ()
    # A head of the source's size over a larger target vocabulary.
    ed2 = make_model(len(SRC), len(TGT) + 2, 1, d_model=16, d_ff=32, h=2)
    assert SVM.encdec_violations(vc.observe_encdec(ed2, SRC, TGT + ["t11", "t12"])) == ()
    ed2.generator.proj = torch.nn.Linear(16, len(SRC))
    assert SVM.encdec_violations(vc.observe_encdec(ed2, SRC, TGT + ["t11", "t12"])) == ("output_rows",)


def test_transaction_rule_on_values():
    before = SVM.MigrationSnapshot((("embed", "k", "h"),), True, 512, ("k",), "s")
    assert SVM.transaction_violations(before, before) == ()
    after = SVM.MigrationSnapshot((("embed", "k2", "h2"),), False, 520, ("k",), "s2")
    assert SVM.transaction_violations(before, after) == ("model_changed", "tie_changed", "config_changed", "optimizer_changed")


def _plan():
    pairs = {v: v for v in range(511)}
    pairs[40], pairs[41] = 41, 40
    return SVM.VocabMap.create(512, 520, pairs), SVM.NewRowInit("mean", {512: (40, 41)})


def _biased(tied=True):
    model = load_tiny(seed=0)
    if not tied:
        import attrs

        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.config = attrs.evolve(model.config, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(41)
    model.lm_head.bias = torch.nn.Parameter(0.1 * torch.randn(model.config.vocab_size, generator=g))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_failed_migration_is_rolled_back(tied):
    vmap, init = _plan()
    model = _biased(tied)
    report = vc.check_migration_rollback(model, vmap, init)
    assert report.fault_raised and report.violations == () and report.passed
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.vocab_size == 512 and model.lm_head.weight.shape[0] == 512
    # After the rollback the same migration succeeds (the optimizer groups are usable again).
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    from decodespec.impl.vocab import migrate_vocabulary

    migrate_vocabulary(model, {int(a): int(b) for a, b in zip(vmap.old_ids, vmap.new_ids)}, 520, init="mean",
                       sources={512: (40, 41)}, optimizer=opt)
    assert model.lm_head.weight.shape[0] == 520


def test_migration_not_rolled_back_is_killed():
    vmap, init = _plan()
    report = vc.check_migration_rollback(_biased(), vmap, init, migrate=vc.ROLLBACK_MUTANTS["vocab_migration_not_rolled_back"][0])
    assert report.fault_raised and "model_changed" in report.violations and "config_changed" in report.violations
    m = MUTANTS["vocab_migration_not_rolled_back"]
    assert m.group == "output head" and m.checker(False) is None
    killed = m.checker(True)
    assert killed["rule"] == "invariant.vocab_migration_transaction" and killed["ladder_check"] == "model_changed"


def test_a_migration_that_swallows_the_fault_does_not_pass():
    from decodespec.impl.vocab import migrate_vocabulary

    def swallow(*a, **kw):
        try:
            return migrate_vocabulary(*a, **kw)
        except RuntimeError:
            return None

    vmap, init = _plan()
    report = vc.check_migration_rollback(_biased(), vmap, init, migrate=swallow)
    assert not report.fault_raised and not report.passed
