"""Failure lab, output-head group: broken loss implementations, loaders and vocabulary migrations, each killed by its checker.

These bugs live at interfaces the gate's case table does not drive -- a user's training loss
(M3.8 0x05), a checkpoint loader's tying (0x09), a vocabulary migration of model and optimizer
(0x08) -- so each :class:`~decodespec.checks.lab.mutants.Mutant` here carries a
:attr:`~decodespec.checks.lab.mutants.Mutant.checker` instead of seam patches:

* ``head_*`` loss mutants (:data:`decodespec.checks.gate.head_check.LOSS_MUTANTS`):
  :func:`~decodespec.checks.gate.head_check.check_loss` on the broken callable (calibrated on
  :func:`~decodespec.checks.gate.head_check.torch_reference`), killed at its layer INTERFACE, ROWS,
  REDUCTION or GRADIENT;
* ``head_copy_not_tie`` (:data:`~decodespec.checks.gate.head_check.TYING_MUTANTS`): the tiny model
  loaded with a copied head, judged by ``invariant.head_tied_one_parameter`` (layer TYING);
* ``head_shard_*`` (:data:`~decodespec.checks.gate.sharded_tie.SHARD_MUTANTS`): a ZeroRedundancyOptimizer over
  2 gloo ranks whose sharder registers the tied table twice or splits a copied alias across ranks,
  judged by :func:`~decodespec.checks.gate.sharded_tie.run_sharded_tie` (``invariant.head_tied_sharded_owner``,
  layer TYING);
* ``vocab_*`` migration mutants (:data:`decodespec.checks.gate.vocab_check.MIGRATION_MUTANTS`):
  :func:`~decodespec.checks.gate.vocab_check.check_migration` of the tiny model with a ``[V]`` head
  bias, after one Adam step, through a map that swaps ids 40 and 41, drops id 511 and appends 8
  rows (mean-initialized), calibrated on :func:`decodespec.impl.vocab.migrate_vocabulary`
  (layer MIGRATION);
* ``vocab_added_rows_reinitialized`` (:data:`~decodespec.checks.gate.vocab_check.ADDED_TOKEN_MUTANTS`): the tiny
  model with its special tokens' rows re-initialized on load, judged by
  :func:`~decodespec.checks.gate.vocab_check.audit_added_tokens` (``invariant.vocab_added_token_identity``);
* ``vocab_migration_not_rolled_back`` (:data:`~decodespec.checks.gate.vocab_check.ROLLBACK_MUTANTS`):
  :func:`~decodespec.checks.gate.vocab_check.check_migration_rollback` of the same model and map with
  a fault injected after the rows are installed, judged by ``invariant.vocab_migration_transaction``;
* ``vocab_release_stale_optimizer_manifest`` (:data:`~decodespec.checks.gate.vocab_check.RELEASE_MUTANTS`):
  :func:`~decodespec.checks.gate.vocab_check.check_release_after_migration` of the same model and map,
  releasing the optimizer manifest read before the migration, judged by ``invariant.vocab_release_manifests``.

Their rules (``mutant.<name>``) are registered where the broken implementations live.

Source: M3.8 0x12 items 20, 28, 31, 51-56; 0x05, 0x08, 0x09.
"""

from __future__ import annotations

from typing import Any, Callable

from decodespec.spec.rules import RULES, Rule, register

from . import MUTANTS, Mutant

_G = "output head"


def _loss_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from ...gate.head_check import LOSS_MUTANTS, check_loss, torch_reference

        v = check_loss(LOSS_MUTANTS[name] if mutated else torch_reference)
        if v.passed:
            return None
        return {"check": f"head-check.{v.case}", "layer": v.layer, "rule": v.rule, "ladder_check": v.check, "message": v.message}

    return check


def _tiny(bias: bool = False) -> Any:
    import torch

    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=0)
    if bias:
        g = torch.Generator().manual_seed(41)
        model.lm_head.bias = torch.nn.Parameter(0.1 * torch.randn(model.config.vocab_size, generator=g))
    return model


def _tying_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        import torch

        from decodespec.spec.head_tying import tying_violations

        from ...gate.head_check import TYING_MUTANTS, observe_tying

        model = _tiny()
        if mutated:
            model = TYING_MUTANTS[name](model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        bad = tying_violations(observe_tying(model, optimizer))
        if not bad:
            return None
        return {"check": "tying.tiny", "layer": "TYING", "rule": "invariant.head_tied_one_parameter", "ladder_check": bad[0],
                "message": f"tying violations {list(bad)}"}

    return check


def _migration_plan():
    from decodespec.spec.vocab_migration import NewRowInit, VocabMap

    pairs = {v: v for v in range(511)}  # id 511 dropped
    pairs[40], pairs[41] = 41, 40  # two ids swapped
    return VocabMap.create(512, 520, pairs), NewRowInit("mean", {512: (40, 41)})


def _migration_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from ...gate.vocab_check import MIGRATION_MUTANTS, check_migration

        vmap, init = _migration_plan()
        report = check_migration(_tiny(bias=True), vmap, init, migrate=MIGRATION_MUTANTS[name][0] if mutated else None)
        if report.passed:
            return None
        if report.violations:
            return {"check": "migration.tiny", "layer": "MIGRATION", "rule": "invariant.vocab_migration_owner",
                    "ladder_check": report.violations[0], "message": f"migration violations {list(report.violations)}"}
        gap, worst = report.logit_gap
        return {"check": "migration.tiny", "layer": "MIGRATION", "rule": "invariant.vocab_mapped_logits", "ladder_check": "mapped_logits",
                "message": f"old id {worst}: mapped raw logit differs by {gap:.3g} > {report.logit_bound:.3g}"}

    return check


def _rollback_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from ...gate.vocab_check import ROLLBACK_MUTANTS, check_migration_rollback

        vmap, init = _migration_plan()
        report = check_migration_rollback(_tiny(bias=True), vmap, init, migrate=ROLLBACK_MUTANTS[name][0] if mutated else None)
        if report.passed:
            return None
        first = report.violations[0] if report.violations else "fault_not_raised"
        return {"check": "migration_rollback.tiny", "layer": "MIGRATION", "rule": "invariant.vocab_migration_transaction",
                "ladder_check": first, "message": f"after an injected fault: {list(report.violations) or 'the fault did not surface'}"}

    return check


def _shard_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from ...gate.sharded_tie import run_sharded_tie

        report = run_sharded_tie(2, mutant=name if mutated else None)
        if report.passed:
            return None
        return {"check": "sharded_tie.tiny.R2", "layer": "TYING", "rule": "invariant.head_tied_sharded_owner",
                "ladder_check": report.violations[0], "message": f"sharded-optimizer violations {list(report.violations)}"}

    return check


def _added_token_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from decodespec.impl.tokenizer import ByteTokenizer

        from ...gate.vocab_check import ADDED_TOKEN_MUTANTS, audit_added_tokens

        model = _tiny()
        if mutated:
            model = ADDED_TOKEN_MUTANTS[name][0](model)
        report = audit_added_tokens(model, ByteTokenizer(model.config.vocab_size), "tiny")
        if report.passed:
            return None
        token, first = report.violations[0]
        return {"check": "added_tokens.tiny", "layer": "VOCABULARY", "rule": "invariant.vocab_added_token_identity",
                "ladder_check": first, "message": f"added-token violations {list(report.violations)} (first at id {token})"}

    return check


def _release_checker(name: str) -> Callable[[bool], dict | None]:
    def check(mutated: bool) -> dict | None:
        from ...gate.vocab_check import RELEASE_MUTANTS, check_release_after_migration

        vmap, init = _migration_plan()
        bad = check_release_after_migration(_tiny(bias=True), vmap, init, release=RELEASE_MUTANTS[name][0] if mutated else None)
        if not bad:
            return None
        part, why = bad[0]
        return {"check": "release_bundle.tiny", "layer": "MIGRATION", "rule": "invariant.vocab_release_manifests",
                "ladder_check": why.split(":", 1)[0], "message": f"bundle part {part}: {[w.split(':', 1)[0] for _, w in bad]}"}

    return check


def _add(name: str, checker: Callable[[bool], dict | None], representative: bool = False) -> None:
    r = RULES[f"mutant.{name}"]
    MUTANTS[name] = Mutant(name, _G, r.title, r.section, r.statement, (), representative=representative, checker=checker)


def _register_all() -> None:
    from ...gate.head_check import LOSS_MUTANTS, TYING_MUTANTS
    from ...gate.sharded_tie import SHARD_MUTANTS
    from ...gate.vocab_check import ADDED_TOKEN_MUTANTS, MIGRATION_MUTANTS, RELEASE_MUTANTS, ROLLBACK_MUTANTS

    for name in LOSS_MUTANTS:
        _add(name, _loss_checker(name), representative=name == "head_chunk_mean")
    for name in TYING_MUTANTS:
        _add(name, _tying_checker(name))
    for name in SHARD_MUTANTS:  # rules registered in checks/gate/sharded_tie.py
        _add(name, _shard_checker(name))
    for name, (fn, section, title, statement) in MIGRATION_MUTANTS.items():
        register(Rule(id=f"mutant.{name}", kind="mutant", title=title, section=section, statement=statement, obj=fn))
        _add(name, _migration_checker(name))
    for name, (fn, section, title, statement) in ADDED_TOKEN_MUTANTS.items():
        register(Rule(id=f"mutant.{name}", kind="mutant", title=title, section=section, statement=statement, obj=fn))
        _add(name, _added_token_checker(name))
    for name, (fn, section, title, statement) in ROLLBACK_MUTANTS.items():
        register(Rule(id=f"mutant.{name}", kind="mutant", title=title, section=section, statement=statement, obj=fn))
        _add(name, _rollback_checker(name))

    for name, (fn, section, title, statement) in RELEASE_MUTANTS.items():
        register(Rule(id=f"mutant.{name}", kind="mutant", title=title, section=section, statement=statement, obj=fn))
        _add(name, _release_checker(name))


_register_all()
