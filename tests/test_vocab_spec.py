"""spec/vocab.py: M3.8 0x08 ordered vocabulary identity, the audit, migration as a row-address transaction (pure float64).

Each rule is exercised where it can fail: a permutation, a resize or a moved special id changes
the hash; every audit violation is produced by the audit that has it; the migration moves rows and
moments by the map and refuses an undeclared initialization; the mapped raw-logit oracle is zero for
a right migration and large for a wrong one; the appended rows' drift has the closed form
``log(1 - m_new) - log(1 - m_drop)``.

Source: M3.8 0x08; 0x12 items 25-27, 53-56.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from decodespec.spec.errors import Rejection
from decodespec.spec.rules import RULES
from decodespec.spec.vocab import AUDIT_VIOLATIONS, VocabAudit, audit_violations, vocab_table_hash
from decodespec.spec.vocab_migration import (
    MIGRATION_VIOLATIONS,
    MigrationObservation,
    NewRowInit,
    VocabMap,
    append_drift,
    mapped_logit_gap,
    migrate_rows,
    migrate_state,
    migration_violations,
)

EPS = float(np.finfo(np.float64).eps)
TABLE = [b"<pad>", b"<s>", b"</s>", b"a", b"b", b"ab", b" the", "\u00e9".encode()]
SPECIALS = {"bos": 1, "eos": 2, "pad": 0, "unk": None}


def test_rules_are_registered_with_their_seed_section():
    for rid in ("invariant.vocab_ordered_identity", "invariant.vocab_audit", "invariant.vocab_migration_rows",
                "invariant.vocab_mapped_logits", "invariant.vocab_append_drift", "invariant.vocab_migration_owner"):
        assert RULES[rid].section.startswith("M3.8 0x08"), rid


def test_the_hash_binds_order_content_size_and_special_ids():
    base = vocab_table_hash(TABLE, SPECIALS, [0, 1, 2])
    assert base == vocab_table_hash(list(TABLE), dict(SPECIALS), (2, 1, 0)) and base.startswith("sha256:")
    swapped = TABLE[:3] + [TABLE[4], TABLE[3]] + TABLE[5:]
    assert sorted(swapped) == sorted(TABLE)  # same multiset, same size: only the order differs
    variants = [
        vocab_table_hash(swapped, SPECIALS, [0, 1, 2]),  # item 25: two ids swapped
        vocab_table_hash(TABLE + [b""], SPECIALS, [0, 1, 2]),  # resized by one unused row
        vocab_table_hash(TABLE, {**SPECIALS, "eos": 1}, [0, 1, 2]),  # a special id moved
        vocab_table_hash(TABLE, SPECIALS, [0, 1]),  # a control token demoted
        vocab_table_hash(TABLE[:-1] + [b"x"], SPECIALS, [0, 1, 2]),  # same size, other content (item 53)
    ]
    assert len({base, *variants}) == 1 + len(variants)


@pytest.mark.parametrize("tokens, specials, control, path", [
    ([b"a", 3], None, (), "$.tokens[1]"),
    ([b"a"], {"bos": 1}, (), "$.specials.bos"),
    ([b"a"], {"sep": 0}, (), "$.specials"),
    ([b"a"], None, (1,), "$.control_ids"),
])
def test_a_bad_table_is_refused(tokens, specials, control, path):
    with pytest.raises(Rejection) as err:
        vocab_table_hash(tokens, specials, control)
    assert err.value.code == "vocab.invalid_table" and err.value.path == path


GOOD = VocabAudit(tokenizer_size=8, tokenizer_len=10, embedding_rows=16, output_rows=16, config_vocab_size=16,
                  vocab_hash="sha256:x", added_ids=(8, 9), special_ids={"bos": 1, "eos": 2, "pad": 0, "unk": None},
                  config_special_ids={"bos": 1, "eos": 2, "pad": 0}, tied=True)


@pytest.mark.parametrize("change, violation", [
    ({"output_rows": 9, "embedding_rows": 9, "config_vocab_size": 9}, "tokenizer_exceeds_output_rows"),  # item 26
    ({"embedding_rows": 17}, "embedding_output_rows_differ"),  # item 27
    ({"config_vocab_size": 15}, "config_rows_differ"),
    ({"added_ids": (8, 16)}, "added_id_without_row"),
    ({"added_ids": (7, 9)}, "added_id_in_base_table"),
    ({"special_ids": {"bos": 1, "eos": 10, "pad": 0}}, "special_id_out_of_range"),
    ({"config_special_ids": {"bos": 1, "eos": 3}}, "special_id_mismatch"),
    ({"vocab_hash": ""}, "no_vocab_hash"),  # item 53: sizes alone
])
def test_each_audit_violation_is_found(change, violation):
    assert audit_violations(GOOD) == ()
    assert violation in audit_violations(attrs.evolve(GOOD, **change))
    assert set(audit_violations(attrs.evolve(GOOD, **change))) <= set(AUDIT_VIOLATIONS)


def test_reserved_rows_above_the_tokenizer_are_allowed():
    assert audit_violations(attrs.evolve(GOOD, tokenizer_len=10, output_rows=64, embedding_rows=64, config_vocab_size=64)) == ()


@pytest.mark.parametrize("make", [
    lambda: VocabMap.create(4, 4, {0: 1, 1: 1}),  # not injective
    lambda: VocabMap.create(4, 4, {4: 0}),
    lambda: VocabMap.create(4, 4, {0: 4}),
    lambda: VocabMap.append_only(5, 4),
    lambda: VocabMap.permutation([0, 0, 1]),
])
def test_a_map_that_is_not_a_partial_bijection_is_refused(make):
    with pytest.raises(Rejection) as err:
        make()
    assert err.value.code == "vocab.invalid_map"


def _rows(v: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(v, d))


def test_migration_moves_rows_by_the_map_and_initializes_new_rows_as_declared():
    old = _rows(6, 3)
    vmap = VocabMap.create(6, 8, {0: 0, 1: 2, 2: 1, 3: 3, 4: 4})  # 1 <-> 2 swapped, 5 dropped; new ids 5, 6, 7
    assert vmap.new_rows().tolist() == [5, 6, 7]
    for init, expect in (
        (NewRowInit("zeros"), np.zeros((3, 3))),
        (NewRowInit("mean", {5: (1, 2)}), np.stack([old[[1, 2]].mean(0), old.mean(0), old.mean(0)])),
        (NewRowInit("copy", {5: 0, 6: 1, 7: 5}), old[[0, 1, 5]]),
        (NewRowInit("values", values=np.arange(9.0).reshape(3, 3)), np.arange(9.0).reshape(3, 3)),
    ):
        new, copied = migrate_rows(old, vmap, init)
        assert np.array_equal(new[[0, 2, 1, 3, 4]], old[:5]) and np.array_equal(new[5:], expect), init.kind
        assert copied.tolist() == [True] * 5 + [False] * 3
    with pytest.raises(Rejection) as err:
        migrate_rows(old, vmap, None)  # no declared initialization: refused, never silently zero
    assert err.value.code == "vocab.invalid_map"
    for bad in (NewRowInit("copy", {5: 0}), NewRowInit("values", values=np.zeros((2, 3))), NewRowInit("mean", {5: (9,)})):
        with pytest.raises(Rejection):
            migrate_rows(old, vmap, bad)
    with pytest.raises(Rejection):
        migrate_rows(_rows(5, 3), vmap, NewRowInit("zeros"))  # wrong row count


def test_moments_follow_the_same_map_and_new_moments_are_zero():
    vmap = VocabMap.create(4, 5, {0: 1, 1: 0, 2: 2, 3: 3})
    w, m, u = _rows(4, 2, 1), _rows(4, 2, 2), _rows(4, 2, 3) ** 2
    rows, moments = migrate_state({"embed": w, "bias": w[:, 0]}, vmap, NewRowInit("mean"), {"embed": {"exp_avg": m, "exp_avg_sq": u}})
    assert np.array_equal(rows["embed"][[1, 0, 2, 3]], w) and np.array_equal(rows["bias"][[1, 0, 2, 3]], w[:, 0])
    assert np.array_equal(moments["embed"]["exp_avg"][[1, 0, 2, 3]], m) and not moments["embed"]["exp_avg"][4].any()
    assert np.array_equal(moments["embed"]["exp_avg_sq"][[1, 0, 2, 3]], u) and not moments["embed"]["exp_avg_sq"][4].any()
    with pytest.raises(Rejection):
        migrate_state({"embed": w}, vmap, NewRowInit("zeros"), {"head": {"exp_avg": m}})


def _dot_bound(h: np.ndarray, e: np.ndarray) -> float:
    """Twice the float64 dot-product rounding bound d * eps * sum |h_j e_j| (two products of the same rows)."""
    return float(2 * h.shape[1] * EPS * (np.abs(h) @ np.abs(e).T).max())


def test_mapped_raw_logit_oracle():
    e, b = _rows(7, 5, 4), _rows(7, 1, 5)[:, 0]
    vmap = VocabMap.create(7, 9, {v: (v + 3) % 7 for v in range(7)})  # rotated, two appended
    rows, _ = migrate_state({"w": e, "b": b}, vmap, NewRowInit("zeros"))
    h = _rows(3, 5, 6)
    z_old, z_new = h @ e.T + b, h @ rows["w"].T + rows["b"]
    gap, _ = mapped_logit_gap(z_old, z_new, vmap)
    assert gap <= _dot_bound(h, e) + EPS * np.abs(b).max()
    by_size = h @ np.vstack([e, np.zeros((2, 5))]).T + np.concatenate([b, [0, 0]])  # rows kept at their old index (item 53)
    bad, worst = mapped_logit_gap(z_old, by_size, vmap)
    assert bad > 0.1 and 0 <= worst < 7
    with pytest.raises(Rejection):
        mapped_logit_gap(z_old, z_new[:, :8], vmap)


def _lse_bound(*logits: np.ndarray) -> float:
    """Rounding bound of a difference of two float64 log-softmax values: (V + 2) eps (max |z| + 1) for each side."""
    return float(sum((z.shape[1] + 2) * EPS * (np.abs(z).max() + 1) for z in logits))


def test_append_drift_keeps_raw_logits_and_rescales_old_probabilities():
    """Item 54: the old raw logits are identical, the old probabilities are not -- all scaled by 1 - m_new."""
    e, h = _rows(6, 4, 7), _rows(2, 4, 8)
    vmap = VocabMap.append_only(6, 8)
    rows, _ = migrate_state({"w": e}, vmap, NewRowInit("mean"))
    z_old, z_new = h @ e.T, h @ rows["w"].T
    drift = append_drift(z_old, z_new, vmap)
    assert drift.logit_gap <= _dot_bound(h, e)
    assert (drift.new_mass > 0.01).all() and (drift.max_abs_prob_change > 1e-4).all()  # not unchanged
    bound = _lse_bound(z_old, z_new)
    assert np.abs(drift.log_shift - np.log1p(-drift.new_mass)).max() <= bound
    assert (drift.shift_spread <= bound).all() and not drift.dropped_mass.any()
    # A map that drops an id too: the shift is log(1 - m_new) - log(1 - m_drop).
    vmap2 = VocabMap.create(6, 7, {v: v for v in range(5)})
    rows2, _ = migrate_state({"w": e}, vmap2, NewRowInit("copy", {5: 0, 6: 1}))
    d2 = append_drift(z_old, h @ rows2["w"].T, vmap2)
    assert (d2.dropped_mass > 0).all() and np.abs(d2.log_shift - d2.expected_shift).max() <= _lse_bound(z_old, h @ rows2["w"].T)


def _obs(rows, moments, **kw):
    base = {"declared_tied": True, "tied_after": True, "rows": rows, "moments": moments, "optimizer_entries": 1, "stale_entries": 0, "state_slots": 1}
    return MigrationObservation(**{**base, **kw})


def test_migration_violations_name_each_broken_ownership():
    vmap = VocabMap.create(4, 6, {0: 0, 1: 2, 2: 1, 3: 3})
    w, m = _rows(4, 3, 9), _rows(4, 3, 10)
    rows, moments = migrate_state({"embed": w}, vmap, NewRowInit("mean"), {"embed": {"exp_avg": m}})
    assert migration_violations(_obs(rows, moments), rows, moments, vmap) == ()
    by_size = {"embed": np.vstack([w, np.zeros((2, 3))])}
    stale_m = {"embed": {"exp_avg": np.vstack([m, np.zeros((2, 3))])}}
    zero_init = {"embed": rows["embed"].copy()}
    zero_init["embed"][4:] = 0
    bad_new_moment = {"embed": {"exp_avg": moments["embed"]["exp_avg"] + np.eye(6, 3) * 0}}
    bad_new_moment["embed"]["exp_avg"][5, 0] = 1.0
    cases = {
        "rows_not_mapped": _obs(by_size, moments),
        "new_rows_not_declared": _obs(zero_init, moments),
        "alias_not_restored": _obs(rows, moments, tied_after=False),
        "stale_optimizer_parameter": _obs(rows, moments, stale_entries=1),
        "optimizer_duplicate_state": _obs(rows, moments, optimizer_entries=2, state_slots=2),
        "moments_not_mapped": _obs(rows, stale_m),
        "new_moments_not_zero": _obs(rows, bad_new_moment),
    }
    for name, obs in cases.items():
        assert name in migration_violations(obs, rows, moments, vmap), name
    rows_b, moments_b = migrate_state({"embed": w, "bias": w[:, 0]}, vmap, NewRowInit("mean"))
    unmapped_bias = {**rows_b, "bias": np.concatenate([w[:, 0], [0, 0]])}
    assert "bias_not_mapped" in migration_violations(_obs(unmapped_bias, {}, optimizer_entries=2, state_slots=2), rows_b, moments_b, vmap)
    assert set(MIGRATION_VIOLATIONS) == set(cases) | {"bias_not_mapped"}
