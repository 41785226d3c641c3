"""checks/gate/vocab_check.py, impl/vocab.py, the STATE vocabulary check and the row scope: M3.8 0x06, 0x08, 0x0A in torch.

* the audit of tiny and SmolLM2 (V = 49152) and the runtime's ordered table hash against the
  gate's independent reading of the checkpoint;
* ``ladder.STATE`` catches a runtime whose vocabulary is permuted or resized on its first
  observation (the ``vocabulary`` mutants, through the gate harness);
* the torch migration (:func:`decodespec.impl.vocab.migrate_vocabulary`) judged against the
  float64 spec for every declared initialization, tied and untied, and the migration mutants
  killed;
* rows selected before ``lm_head`` per sequence (``logits_to_keep`` ``[B, 1]``), and the row-scope
  bench's byte ledger (no timing is asserted).

Source: M3.8 0x06, 0x08, 0x0A; 0x12 items 25-27, 31, 53-56.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

from decodespec.checks.adapters import Observation
from decodespec.checks.gate import vocab_check as vc
from decodespec.checks.gate.ladder import Expected, check_state
from decodespec.checks.gate.tolerance import Tolerance
from decodespec.checks.lab.mutants.harness import KILLED, Calibration, GateCheck, run_gate
from decodespec.spec.errors import Rejection
from decodespec.spec.vocab import audit_violations
from decodespec.spec.vocab_migration import NewRowInit, VocabMap


def test_tiny_audit_agrees_with_the_checkpoint(tiny_model, byte_tokenizer):
    audit = vc.audit_model(tiny_model, byte_tokenizer)
    ref = vc.reference_vocab("tiny")
    assert audit_violations(audit) == () and audit.tied
    assert (audit.tokenizer_size, audit.embedding_rows, audit.output_rows, audit.config_vocab_size) == (512, 512, 512, 512)
    assert audit.vocab_hash == ref.vocab_hash and ref.output_rows == 512


@pytest.mark.smollm2
def test_smollm2_audit_agrees_with_the_gguf_table(smollm2_model, smollm2_tokenizer):
    """The real model: V = 49152 everywhere, tied, specials agree, and the runtime's table is the GGUF's as the gate reads it."""
    audit = vc.audit_model(smollm2_model, smollm2_tokenizer)
    ref = vc.reference_vocab("smollm2")
    assert audit_violations(audit) == () and audit.tied
    assert {audit.tokenizer_len, audit.embedding_rows, audit.output_rows, audit.config_vocab_size, ref.table_size} == {49152}
    assert audit.special_ids == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    assert audit.vocab_hash == ref.vocab_hash


def test_state_compares_the_vocabulary_first():
    exp = Expected(tolerance=Tolerance.from_logit(0.0, 0.0), vocab_hash="sha256:a", vocab_rows=512, phase="ready")
    assert check_state(exp, Observation(phase="ready", vocab_hash="sha256:a", vocab_rows=512)) is None
    v = check_state(exp, Observation(phase="scored", vocab_hash="sha256:b", vocab_rows=512))
    assert (v.layer, v.check) == ("STATE", "vocab.hash")
    assert check_state(exp, Observation(phase="ready", vocab_hash="sha256:a", vocab_rows=576)).check == "vocab.rows"
    assert check_state(exp, Observation(phase="ready")) is None  # a runtime that does not expose it is not judged on it


def test_the_impl_adapter_reports_the_hash_its_receipts_carry():
    from decodespec.checks.adapters import CaseConfig
    from decodespec.checks.adapters.impl import ImplAdapter

    adapter = ImplAdapter()
    adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 70, 71), max_new_tokens=2, policy={"family": "greedy"}))
    before = adapter.observe()
    assert before.vocab_hash == vc.reference_vocab("tiny").vocab_hash and before.vocab_rows == 512
    adapter.apply({"op": "run"})
    assert all(r.vocab_hash == before.vocab_hash for r in adapter.runner.receipts) and adapter.runner.receipts


@pytest.mark.parametrize("name, check", [("vocab_table_permuted", "vocab.hash"), ("vocab_head_resized", "vocab.rows")])
def test_a_permuted_or_resized_vocabulary_is_caught_at_state(name, check):
    """Caught on the first case by STATE, not by a later layer that happens to see it."""
    result = run_gate(name, "tiny", checks=[GateCheck("boundary.one_token_prompt", "case", "tiny")], calibration=Calibration())
    assert result.outcome == KILLED, (result.outcome, result.crash)
    assert (result.killed_by["layer"], result.killed_by["ladder_check"]) == ("STATE", check)


# -- migration -----------------------------------------------------------------------------------------

PLAN = VocabMap.create(512, 520, {**{v: v for v in range(511)}, 40: 41, 41: 40})


def _untied(model):
    from decodespec.checks.gate.head_check import untie_by_copy

    model = untie_by_copy(model)
    model.config = attrs.evolve(model.config, tie_word_embeddings=False)
    return model


@pytest.mark.parametrize("init", [NewRowInit("mean", {512: (40, 41)}), NewRowInit("copy", {v: v - 500 for v in (511, *range(512, 520))}),
                                  NewRowInit("values", values=np.random.default_rng(3).normal(size=(9, 64)) * 0.02),
                                  NewRowInit("zeros")], ids=lambda i: i.kind)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_torch_migration_matches_the_spec(init, tied):
    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=0) if tied else _untied(load_tiny(seed=0))
    report = vc.check_migration(model, PLAN, init)
    assert report.passed, (report.violations, report.logit_gap, report.logit_bound)
    assert report.logit_gap[0] <= report.logit_bound and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert (report.new_mass > 0).all() and report.drift_error < 1e-9 * max(1.0, abs(np.log(report.new_mass).max()))
    with torch.inference_mode():
        assert model(torch.tensor([[1, 519, 40]])).logits.shape == (1, 3, 520)


def test_a_bad_migration_request_changes_nothing():
    from decodespec.impl.tiny import load_tiny
    from decodespec.impl.vocab import migrate_vocabulary

    model = load_tiny(seed=0)
    before = model.model.embed_tokens.weight.detach().clone()
    for kwargs in ({"old_to_new": {0: 1, 1: 1}, "new_size": 512}, {"old_to_new": {v: v for v in range(512)}, "new_size": 520},
                   {"old_to_new": {v: v for v in range(512)}, "new_size": 520, "init": "copy", "sources": {512: 9999}}):
        with pytest.raises(Rejection) as err:
            migrate_vocabulary(model, **kwargs)
        assert err.value.code == "vocab.invalid_map"
    assert torch.equal(model.model.embed_tokens.weight, before) and model.config.vocab_size == 512


@pytest.mark.parametrize("name", sorted(vc.MIGRATION_MUTANTS))
def test_migration_mutants_are_killed(name):
    result = run_gate(name, "tiny", calibration=Calibration())
    assert result.outcome == KILLED and result.killed_by["layer"] == "MIGRATION", result


# -- row scope (0x06, 0x0A) -----------------------------------------------------------------------------

def test_per_sequence_rows_are_selected_before_the_head(tiny_model):
    """``logits_to_keep`` ``[B, 1]``: one projected row per sequence, equal to that row of the all-row projection."""
    ids = torch.tensor([[1, 50, 60, 70, 80], [1, 90, 91, 0, 0]])
    last = torch.tensor([[4], [2]])
    calls = []
    hook = tiny_model.lm_head.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    try:
        with torch.inference_mode():
            every = tiny_model(ids).logits  # [2, 5, V]
            picked = tiny_model(ids, logits_to_keep=last).logits  # [2, 1, V]
    finally:
        hook.remove()
    assert calls == [(2, 5, 64), (2, 1, 64)] and picked.shape == (2, 1, 512)
    ref = every[torch.arange(2), last[:, 0]]
    bound = 64 * float(torch.finfo(torch.float32).eps) * float(every.abs().max()) * 2
    assert float((picked[:, 0] - ref).abs().max()) <= bound
    with pytest.raises(Rejection):
        tiny_model(ids, logits_to_keep=torch.tensor([[1], [2], [3]]))


def test_row_scope_bench_reports_the_tensor_not_produced(tiny_model):
    from decodespec.impl.bench import format_row_scope, row_scope_bench

    result = row_scope_bench(tiny_model, batch=2, prompt_len=16, repetitions=1, threads=1)
    assert result["logits_bytes"] == {"all_rows": 2 * 16 * 512 * 4, "last_row": 2 * 512 * 4, "saved": 2 * 15 * 512 * 4}
    assert result["head_macs"] == {"all_rows": 2 * 16 * 512 * 64, "last_row": 2 * 512 * 64}
    assert "cores" in result["machine"] and "saved" in format_row_scope(result)
    json.dumps(result)


def test_vocab_audit_command(capsys):
    from decodespec.checks.commands.cli import main

    assert main(["vocab-audit", "--model", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["audit"]["vocab_hash"] == out["checkpoint"]["vocab_hash"] and out["audit"]["output_rows"] == 512


def test_the_new_mutants_are_in_the_failure_lab():
    from decodespec.checks.lab.mutants import MUTANTS
    from decodespec.spec.rules import RULES

    groups = {"mutant.vocab_table_permuted": "vocabulary", "mutant.vocab_head_resized": "vocabulary",
              "mutant.vocab_moments_not_moved": "output head", "mutant.vocab_optimizer_before_retie": "output head",
              "mutant.vocab_alias_not_restored": "output head", "mutant.vocab_rows_by_size": "output head",
              "mutant.vocab_bias_not_migrated": "output head", "mutant.head_chunk_mean": "output head",
              "mutant.head_valid_count_all_rows": "output head", "mutant.head_smoothing_non_target": "output head",
              "mutant.head_ignored_rows_trained": "output head", "mutant.head_bias_gradient_dropped": "output head",
              "mutant.head_copy_not_tie": "output head", "mutant.head_shard_duplicate_tie": "output head",
              "mutant.head_shard_alias_split": "output head", "mutant.vocab_added_rows_reinitialized": "output head"}
    for rid, group in groups.items():
        m = MUTANTS[rid.removeprefix("mutant.")]
        assert rid in RULES and m.group == group and (m.checker is not None) == (group == "output head"), rid
