"""The versioned release bundle (M3.8 0x08 "Release and rollback ledger") and added tokens audited on identity.

Rules checked: invariant.vocab_release_bundle, invariant.vocab_release_manifests, invariant.vocab_added_token_identity;
mutant.vocab_added_rows_reinitialized, mutant.vocab_release_stale_optimizer_manifest.
"""

from __future__ import annotations

import json

import attrs
import pytest

from decodespec.checks.testing import requires_smollm2
from decodespec.spec.errors import Rejection
from decodespec.spec.vocab import AddedToken, AddedTokenObservation, added_token_violations
from decodespec.spec.vocab_migration import VocabMap
from decodespec.spec.vocab_release import (
    BUNDLE_PARTS,
    MANIFEST_VIOLATIONS,
    OptimizerManifest,
    OptimizerParam,
    PolicyManifest,
    ReleaseBundle,
    ShardManifest,
    bundle_violations,
    manifest_violations,
    map_digest,
)

_SPECIALS = {"bos": 1, "eos": 2, "pad": 0}
_HASH = "sha256:" + "c" * 64


def _bundle(**kw):
    base = {"version": "tiny@1", "checkpoint_sha256": "sha256:" + "a" * 64, "tokenizer_sha256": "sha256:" + "b" * 64,
            "vocab_hash": "sha256:" + "c" * 64, "table_size": 512, "special_ids": {"bos": 1, "eos": 2, "pad": 0},
            "added_tokens": [(0, "<pad>", True), (1, "<bos>", True), (2, "<eos>", True)], "embedding_rows": 512,
            "output_rows": 512, "config_vocab_size": 512, "tie": "tied",
            "optimizer": OptimizerManifest(absent=True, reason="inference-only"), "shards": ShardManifest.even(512),
            "policy": None}
    base.update(kw)
    if base["policy"] is None and "policy" not in kw:  # the policy follows the bundle's own special ids
        base["policy"] = PolicyManifest(base["vocab_hash"], base["special_ids"], ())
    return ReleaseBundle(**base)


def test_a_consistent_bundle_round_trips_and_its_digest_binds_every_part():
    b = _bundle()
    assert bundle_violations(b) == () and bundle_violations(b, b) == ()
    again = ReleaseBundle.from_json(json.loads(json.dumps(b.to_json())))
    assert again.digest() == b.digest() and again.to_json() == b.to_json()
    assert set(b.to_json()) == {"format", *BUNDLE_PARTS}
    digests = {b.digest()}
    for part, value in [("vocab_hash", "sha256:" + "d" * 64), ("tie", "untied"), ("table_size", 511),
                        ("added_tokens", [(0, "<pad>", False), (1, "<bos>", True), (2, "<eos>", True)])]:
        digests.add(attrs.evolve(b, **{part: value}).digest())
    assert len(digests) == 5


@pytest.mark.parametrize("change, part", [
    ({"config_vocab_size": 513}, "config_vocab_size"),
    ({"embedding_rows": 520}, "embedding_rows"),
    ({"table_size": 600, "special_ids": {"bos": 1}}, "table_size"),
    ({"added_tokens": [(700, "<x>", True)], "special_ids": {"bos": 1}}, "added_tokens"),
    ({"special_ids": {"eos": 512}}, "special_ids"),
    ({"migration": VocabMap.create(512, 520, {i: i for i in range(512)})}, "migration"),
])
def test_a_bundle_whose_parts_disagree_is_refused_naming_the_part(change, part):
    assert [p for p, _ in bundle_violations(_bundle(**change))] == [part]


def test_a_bundle_that_disagrees_with_the_loaded_artifacts_names_each_part():
    loaded = _bundle()
    stated = _bundle(vocab_hash="sha256:" + "e" * 64, tie="untied", added_tokens=[(0, "<pad>", True), (1, "<BOS>", True)])
    got = bundle_violations(stated, loaded)
    assert [p for p, _ in got] == ["vocab_hash", "added_tokens", "tie", "policy"]  # its policy follows its own hash
    assert "entry 1" in got[1][1] and "<BOS>" in got[1][1]
    # version, migration and parent are the release's own: never compared with the artifacts
    child = _bundle(version="tiny@2", parent=loaded.digest(), migration=VocabMap.create(512, 512, {i: i for i in range(512)}))
    assert bundle_violations(child, loaded) == () and child.parent == loaded.digest()


@pytest.mark.parametrize("obj, path", [
    ({"format": "other"}, "$.format"),
    ({"format": "decodespec.release.v2"}, "$.version"),
])
def test_a_malformed_bundle_is_a_typed_rejection(obj, path):
    with pytest.raises(Rejection) as err:
        ReleaseBundle.from_json(obj)
    assert err.value.code == "vocab.invalid_bundle" and err.value.path == path
    with pytest.raises(Rejection):
        _bundle(tie="shared")


def _states(rows, tag="0"):
    return (("exp_avg", rows, "sha256:" + tag * 64), ("exp_avg_sq", rows, "sha256:" + tag * 64))


def _opt(*params, mapped=None):
    return OptimizerManifest(params=params, map_digest=mapped)


def test_the_manifests_must_be_stated_and_an_absent_optimizer_declared():
    obj = _bundle().to_json()
    assert obj["optimizer"] == {"absent": True, "reason": "inference-only"}
    assert obj["shards"] == {"world_size": 1, "ranges": [[0, 512, 0]]}
    for part in ("optimizer", "shards", "policy"):
        missing = {k: v for k, v in obj.items() if k != part}
        with pytest.raises(Rejection) as err:
            ReleaseBundle.from_json(missing)  # left out: refused, never skipped
        assert err.value.code == "vocab.invalid_bundle" and part in err.value.message
        assert manifest_violations(ReleaseBundle.from_json({**obj, part: None})) == ((part, f"{part}_undeclared"),)
    assert manifest_violations(_bundle(optimizer=OptimizerManifest(absent=True))) == (
        ("optimizer", "optimizer_absent_without_reason"),)
    with pytest.raises(Rejection):
        ReleaseBundle.from_json({**obj, "optimizer": [1]})


def test_the_optimizer_manifest_owns_one_state_per_shared_parameter_moved_by_the_map():
    tied = _opt(OptimizerParam("model.embed_tokens.weight", ("embed", "head"), 512, _states(512)))
    assert manifest_violations(_bundle(optimizer=tied)) == ()
    # a tied table with a second owner (re-tied after the optimizer restore), or split into two owners
    dup = _opt(*tied.params, OptimizerParam("lm_head.weight", ("head",), 512, _states(512, "1")))
    assert [v for _, v in manifest_violations(_bundle(optimizer=dup))] == ["optimizer_duplicate_state", "optimizer_tie_split"]
    split = _opt(OptimizerParam("e", ("embed",), 512, _states(512)), OptimizerParam("h", ("head",), 512, _states(512)))
    assert [v for _, v in manifest_violations(_bundle(optimizer=split))] == ["optimizer_tie_split"]
    assert manifest_violations(_bundle(optimizer=split, tie="untied")) == ()
    stale = _opt(*tied.params, OptimizerParam("<stale>", (), 512, _states(512)))
    assert [v for _, v in manifest_violations(_bundle(optimizer=stale))] == ["optimizer_stale_parameter"]
    only_embed = _opt(OptimizerParam("e", ("embed",), 512, _states(512)))
    assert [v for _, v in manifest_violations(_bundle(optimizer=only_embed))] == ["optimizer_use_missing"]
    # after a migration: the state's rows, its map and the map's new rows with zero state
    vmap = VocabMap.create(512, 520, {**{i: i for i in range(511)}, 40: 41, 41: 40})
    grown = {"embedding_rows": 520, "output_rows": 520, "config_vocab_size": 520, "shards": ShardManifest.even(520, 2),
             "migration": vmap}
    fresh = tuple(int(i) for i in vmap.new_rows())
    assert fresh == (511, *range(512, 520))
    moved = _opt(OptimizerParam("e", ("embed", "head"), 520, _states(520), fresh), mapped=map_digest(vmap))
    assert manifest_violations(_bundle(optimizer=moved, **grown)) == ()
    assert [v for _, v in manifest_violations(_bundle(optimizer=tied, **grown))] == [
        "optimizer_rows", "optimizer_not_mapped", "optimizer_new_rows"]
    other = VocabMap.create(512, 520, {i: i for i in range(512)})
    assert [v for _, v in manifest_violations(_bundle(optimizer=attrs.evolve(moved, map_digest=map_digest(other)), **grown))] == [
        "optimizer_not_mapped"]
    nonzero = _opt(attrs.evolve(moved.params[0], new_rows_zero=False), mapped=map_digest(vmap))
    assert [v for _, v in manifest_violations(_bundle(optimizer=nonzero, **grown))] == ["optimizer_new_rows"]
    assert set(MANIFEST_VIOLATIONS) >= {v for _, v in manifest_violations(_bundle(optimizer=dup))}
    # bundle_violations names the part, with the reason
    assert [p for p, _ in bundle_violations(_bundle(optimizer=tied, **grown))] == ["optimizer"] * 3
    # the manifest round-trips through JSON and enters the digest
    again = ReleaseBundle.from_json(json.loads(json.dumps(_bundle(optimizer=moved, **grown).to_json())))
    assert again.optimizer == moved and again.digest() == _bundle(optimizer=moved, **grown).digest()
    assert again.digest() != _bundle(optimizer=attrs.evolve(moved, map_digest=None), **grown).digest()


@pytest.mark.parametrize("ranges, world, names", [
    (((0, 256, 0), (256, 512, 1)), 2, []),
    (((0, 300, 0), (256, 512, 1)), 2, ["shards_not_contiguous"]),  # overlap
    (((0, 200, 0), (256, 512, 1)), 2, ["shards_not_contiguous"]),  # gap
    (((0, 256, 0), (256, 500, 1)), 2, ["shards_not_contiguous"]),  # short of V
    (((0, 256, 0), (256, 512, 0)), 2, ["shards_owner_map"]),  # one rank owns two ranges, rank 1 none
    (((0, 256, 0), (256, 512, 2)), 2, ["shards_owner_map"]),  # owner outside the world
    (((256, 512, 1), (0, 256, 0)), 2, []),  # order of listing is free
])
def test_the_shard_manifest_covers_the_rows_once_with_an_owner_map(ranges, world, names):
    assert [v for _, v in manifest_violations(_bundle(shards=ShardManifest(world, ranges)))] == names
    assert ShardManifest.even(10, 3).ranges == ((0, 4, 0), (4, 7, 1), (7, 10, 2))


@pytest.mark.parametrize("policy, names", [
    (PolicyManifest(_HASH, _SPECIALS, (2,), ((100, 101), (7,)), (3, 511)), []),
    (PolicyManifest("sha256:" + "9" * 64, _SPECIALS, (2,)), ["policy_vocabulary"]),  # written for another vocabulary
    (PolicyManifest(_HASH, {"bos": 1, "eos": 3, "pad": 0}, (2,)), ["policy_special_ids"]),
    (PolicyManifest(_HASH, _SPECIALS, (2,), ((100, 512),)), ["policy_ids_outside_table"]),  # bad word past the table
    (PolicyManifest(_HASH, _SPECIALS, (2,), (), (600,)), ["policy_ids_outside_table"]),  # logit-bias key past it
])
def test_the_policy_manifest_addresses_the_releases_vocabulary(policy, names):
    assert [v for _, v in manifest_violations(_bundle(policy=policy))] == names


def test_the_loaded_policy_is_compared_but_not_its_masks_and_unobserved_manifests_are_not():
    stated = _bundle(policy=PolicyManifest(_HASH, _SPECIALS, (2,), ((100,),)))
    loaded = _bundle(optimizer=None, shards=None, policy=PolicyManifest(_HASH, _SPECIALS, (2,)))
    assert bundle_violations(stated, loaded) == ()
    assert [p for p, _ in bundle_violations(stated, _bundle(policy=PolicyManifest(_HASH, _SPECIALS, (2, 5))))] == ["policy"]
    trained = _opt(OptimizerParam("e", ("embed", "head"), 512, _states(512)))
    assert [p for p, _ in bundle_violations(stated, attrs.evolve(loaded, optimizer=trained))] == ["optimizer"]


def test_the_stale_optimizer_manifest_mutant_is_killed():
    from decodespec.checks.lab.mutants import MUTANTS

    m = MUTANTS["vocab_release_stale_optimizer_manifest"]
    assert m.checker(False) is None
    verdict = m.checker(True)
    assert verdict["rule"] == "invariant.vocab_release_manifests" and verdict["ladder_check"] == "optimizer_rows"
    assert "optimizer_not_mapped" in verdict["message"] and "optimizer_new_rows" in verdict["message"]


def _ok(content, special=True, tid=1):
    return AddedTokenObservation(content=content, special=special, encodes_to=(tid,), decodes_to=content,
                                 embedding_row_error=0.0, output_row_error=0.5)


def test_added_tokens_are_judged_on_identity_not_counts():
    declared = [AddedToken(1, "<|im_start|>", True), AddedToken(2, "<|im_end|>", True)]
    good = {1: _ok("<|im_start|>"), 2: _ok("<|im_end|>", tid=2)}
    assert added_token_violations(declared, good, {1, 2}) == ()
    bad = {1: attrs.evolve(good[1], content="<|im_end|>", encodes_to=(2,)),
           2: attrs.evolve(good[2], special=False, embedding_row_error=3.0, row_zero=True)}
    assert added_token_violations(declared, bad, {1, 5}) == (
        (1, "string_differs"), (1, "encode_not_id"), (2, "special_flag_differs"), (2, "row_differs"), (2, "row_zero"),
        (5, "undeclared"))
    assert added_token_violations(declared, {1: attrs.evolve(good[1], output_row_error=None)}, {1}) == (
        (1, "no_row"), (2, "missing"))
    # a tokenizer without a text form for specials is not asked to encode them
    tiny = [AddedToken(0, "<pad>", True, text_form=False)]
    assert added_token_violations(tiny, {0: attrs.evolve(_ok("<pad>", tid=0), encodes_to=(3, 63), decodes_to="")}, {0}) == ()


def test_the_tiny_runtimes_added_tokens_and_the_reinitialized_rows_mutant():
    from decodespec.checks.adapters.impl import load_tokenizer
    from decodespec.checks.gate.vocab_check import audit_added_tokens
    from decodespec.checks.lab.mutants import MUTANTS
    from decodespec.impl.tiny import load_tiny

    report = audit_added_tokens(load_tiny(seed=0), load_tokenizer("tiny"), "tiny")
    assert report.passed and [t.id for t in report.declared] == [0, 1, 2]
    m = MUTANTS["vocab_added_rows_reinitialized"]
    assert m.group == "output head" and m.checker(False) is None
    verdict = m.checker(True)
    assert verdict["rule"] == "invariant.vocab_added_token_identity" and verdict["ladder_check"] == "row_differs"


def _audit(capsys, *argv):
    from decodespec.checks.commands.cli import main

    rc = main(["vocab-audit", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_vocab_audit_writes_and_checks_the_bundle(model, tmp_path, capsys):
    path = tmp_path / "bundle.json"
    rc, out = _audit(capsys, "--model", model, "--write-bundle", str(path), "--release-version", f"{model}@7",
                     "--shards", "2")
    assert rc == 0 and out["ok"] and out["added_tokens"]["ok"] and out["bundle"]["violations"] == []
    written = json.loads(path.read_text())
    assert written["version"] == f"{model}@7" and written["vocab_hash"] == out["audit"]["vocab_hash"]
    assert written["tie"] == "tied" and written["output_rows"] == out["audit"]["output_rows"]
    if model == "smollm2":
        assert len(written["added_tokens"]) == len(out["added_tokens"]["declared"]) == 17
        assert written["added_tokens"][1] == [1, "<|im_start|>", True]
    assert written["optimizer"]["absent"] is True and written["optimizer"]["reason"]
    assert written["shards"] == {"world_size": 2, "ranges": [[0, written["output_rows"] // 2, 0],
                                                             [written["output_rows"] // 2, written["output_rows"], 1]]}
    assert written["policy"]["vocab_hash"] == written["vocab_hash"] and written["policy"]["eos_ids"] == [
        written["special_ids"]["eos"]]
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    assert rc == 0 and out["bundle"]["digest"] == ReleaseBundle.from_json(written).digest()
    # a manifest disagreeing with the release: overlapping shards, a policy for another vocabulary
    bad = json.loads(path.read_text())
    bad["shards"]["ranges"][1][0] -= 1
    bad["policy"]["vocab_hash"] = "sha256:" + "2" * 64
    path.write_text(json.dumps(bad))
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    assert rc == 1 and [p for p, _ in out["bundle"]["violations"]] == ["shards", "policy", "policy"]
    del bad["optimizer"]
    path.write_text(json.dumps(bad))
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    assert rc == 1 and out["bundle"]["violations"][0][0] == "format" and "optimizer" in out["bundle"]["violations"][0][1]
    path.write_text(json.dumps(written))
    written["vocab_hash"] = "sha256:" + "1" * 64
    written["added_tokens"][1][2] = False
    path.write_text(json.dumps(written))
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    # the policy still addresses the loaded vocabulary, no longer the one the bundle states
    assert rc == 1 and [p for p, _ in out["bundle"]["violations"]] == ["policy", "vocab_hash", "added_tokens"]
    assert "bundle:vocab_hash" in out["violations"]
    # policy masks: written when inside the table, refused (nothing written) when one is not
    masked = tmp_path / "masked.json"
    rc, out = _audit(capsys, "--model", model, "--write-bundle", str(masked), "--policy-masks",
                     json.dumps({"bad_words_ids": [[100, 101], [7]], "logit_bias_ids": [3]}))
    assert rc == 0 and json.loads(masked.read_text())["policy"]["bad_words_ids"] == [[100, 101], [7]]
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(masked))
    assert rc == 0  # the masks are the release's own: not compared with the artifacts
    outside = tmp_path / "outside.json"
    rc, out = _audit(capsys, "--model", model, "--write-bundle", str(outside), "--policy-masks",
                     json.dumps({"logit_bias_ids": [written["table_size"]]}))
    assert rc == 1 and not outside.exists() and out["bundle"]["violations"][0][0] == "policy"
    assert out["bundle"]["violations"][0][1].startswith("policy_ids_outside_table")
    rc, out = _audit(capsys, "--model", model, "--write-bundle", str(outside), "--policy-masks", "[1]")
    assert rc == 1 and not outside.exists() and out["bundle"]["violations"][0][0] == "policy"


def test_the_optimizer_manifest_read_from_torch_names_one_owner_and_catches_a_duplicate_slot():
    """checks.vocab_check.optimizer_manifest on the tiny model (tied, [V] bias) after one Adam step and a migration."""
    from decodespec.checks.gate.vocab_check import MIGRATION_MUTANTS, _trained, optimizer_manifest
    from decodespec.checks.lab.mutants.head import _migration_plan, _tiny
    from decodespec.impl.vocab import migrate_vocabulary

    vmap, init = _migration_plan()
    pairs = {int(a): int(b) for a, b in zip(vmap.old_ids, vmap.new_ids)}
    for migrate, want in [(migrate_vocabulary, []),
                          (MIGRATION_MUTANTS["vocab_optimizer_before_retie"][0], ["optimizer_stale_parameter"])]:
        model = _tiny(bias=True)
        optimizer = _trained(model)
        before = optimizer_manifest(model, optimizer)
        assert [(p.uses, p.rows) for p in before.params] == [(("embed", "head"), 512), (("bias",), 512)]
        assert {k for k, _, _ in before.params[0].states} >= {"exp_avg", "exp_avg_sq"}
        migrate(model, pairs, vmap.new_size, init=init.kind, sources=dict(init.sources), optimizer=optimizer)
        after = optimizer_manifest(model, optimizer, vmap)
        assert after.map_digest == map_digest(vmap) and all(p.rows == 520 and p.new_rows_zero for p in after.params)
        assert after.params[0].states != before.params[0].states  # the state moved: new digests
        bundle = _bundle(embedding_rows=520, output_rows=520, config_vocab_size=520, shards=ShardManifest.even(520),
                         migration=vmap, optimizer=after)
        assert [v for _, v in manifest_violations(bundle)] == want
