"""The versioned release bundle (M3.8 0x08 "Release and rollback ledger") and added tokens audited on identity.

Rules checked: invariant.vocab_release_bundle, invariant.vocab_added_token_identity; mutant.vocab_added_rows_reinitialized.
"""

from __future__ import annotations

import json

import attrs
import pytest

from decodespec.checks.testing import requires_smollm2
from decodespec.spec.errors import Rejection
from decodespec.spec.vocab import (
    BUNDLE_PARTS,
    AddedToken,
    AddedTokenObservation,
    ReleaseBundle,
    VocabMap,
    added_token_violations,
    bundle_violations,
)


def _bundle(**kw):
    base = {"version": "tiny@1", "checkpoint_sha256": "sha256:" + "a" * 64, "tokenizer_sha256": "sha256:" + "b" * 64,
            "vocab_hash": "sha256:" + "c" * 64, "table_size": 512, "special_ids": {"bos": 1, "eos": 2, "pad": 0},
            "added_tokens": [(0, "<pad>", True), (1, "<bos>", True), (2, "<eos>", True)], "embedding_rows": 512,
            "output_rows": 512, "config_vocab_size": 512, "tie": "tied"}
    base.update(kw)
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
    assert [p for p, _ in got] == ["vocab_hash", "added_tokens", "tie"]
    assert "entry 1" in got[1][1] and "<BOS>" in got[1][1]
    # version, migration and parent are the release's own: never compared with the artifacts
    child = _bundle(version="tiny@2", parent=loaded.digest(), migration=VocabMap.create(512, 512, {i: i for i in range(512)}))
    assert bundle_violations(child, loaded) == () and child.parent == loaded.digest()


@pytest.mark.parametrize("obj, path", [
    ({"format": "other"}, "$.format"),
    ({"format": "decodespec.release.v1"}, "$.version"),
])
def test_a_malformed_bundle_is_a_typed_rejection(obj, path):
    with pytest.raises(Rejection) as err:
        ReleaseBundle.from_json(obj)
    assert err.value.code == "vocab.invalid_bundle" and err.value.path == path
    with pytest.raises(Rejection):
        _bundle(tie="shared")


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
    from decodespec.checks.mutants import MUTANTS
    from decodespec.checks.vocab_check import audit_added_tokens
    from decodespec.impl.tiny import load_tiny

    report = audit_added_tokens(load_tiny(seed=0), load_tokenizer("tiny"), "tiny")
    assert report.passed and [t.id for t in report.declared] == [0, 1, 2]
    m = MUTANTS["vocab_added_rows_reinitialized"]
    assert m.group == "output head" and m.checker(False) is None
    verdict = m.checker(True)
    assert verdict["rule"] == "invariant.vocab_added_token_identity" and verdict["ladder_check"] == "row_differs"


def _audit(capsys, *argv):
    from decodespec.checks.cli import main

    rc = main(["vocab-audit", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_vocab_audit_writes_and_checks_the_bundle(model, tmp_path, capsys):
    path = tmp_path / "bundle.json"
    rc, out = _audit(capsys, "--model", model, "--write-bundle", str(path), "--release-version", f"{model}@7")
    assert rc == 0 and out["ok"] and out["added_tokens"]["ok"] and out["bundle"]["violations"] == []
    written = json.loads(path.read_text())
    assert written["version"] == f"{model}@7" and written["vocab_hash"] == out["audit"]["vocab_hash"]
    assert written["tie"] == "tied" and written["output_rows"] == out["audit"]["output_rows"]
    if model == "smollm2":
        assert len(written["added_tokens"]) == len(out["added_tokens"]["declared"]) == 17
        assert written["added_tokens"][1] == [1, "<|im_start|>", True]
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    assert rc == 0 and out["bundle"]["digest"] == ReleaseBundle.from_json(written).digest()
    written["vocab_hash"] = "sha256:" + "1" * 64
    written["added_tokens"][1][2] = False
    path.write_text(json.dumps(written))
    rc, out = _audit(capsys, "--model", model, "--check-bundle", str(path))
    assert rc == 1 and [p for p, _ in out["bundle"]["violations"]] == ["vocab_hash", "added_tokens"]
    assert "bundle:vocab_hash" in out["violations"]
