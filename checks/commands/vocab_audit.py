"""``decodespec vocab-audit``: print and check every vocabulary count of a model and its tokenizer (M3.8 0x08).

Loads the model (``--model tiny|smollm2``) and its tokenizer as the runtime does, and prints the
audit side by side (:func:`decodespec.checks.gate.vocab_check.audit_model`): the tokenizer's base
size and its length with added tokens, the added and special ids (tokenizer and model
configuration), embedding rows, output rows, the configuration's ``vocab_size``, whether the
head is tied (Parameter identity) and the ordered vocabulary hash
(:func:`decodespec.spec.vocab.vocab_table_hash`).  It checks them with
:func:`decodespec.spec.vocab.audit_violations` (``invariant.vocab_audit``) and compares the
runtime's hash and rows with the checkpoint's as the gate reads it, independently
(:func:`decodespec.checks.gate.vocab_check.reference_vocab`; ``invariant.vocab_ordered_identity``).
``--json`` prints one JSON object.

``--write-bundle`` writes the release bundle (:class:`decodespec.spec.vocab_release.ReleaseBundle`) of
the loaded artifacts with the ledger's manifests: the optimizer manifest declared absent (an
inference-only release), the shard manifest (``--shards N`` contiguous ranges and owners) and
the local-policy manifest (the ordered hash, special and EOS ids the policy addresses, and the
``--policy-masks`` bad-word ids and logit-bias keys, each inside the table);
``--check-bundle`` checks one (``invariant.vocab_release_bundle``,
``invariant.vocab_release_manifests``), naming every part that disagrees.

Exit codes: 0 the audit holds and the hashes agree; 1 a violation or a hash / row mismatch;
3 SmolLM2 not installed.

Source: M3.8 0x08 "The robust audit prints all of them", "The minimum contract is".
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``vocab-audit`` subcommand."""
    parser = subparsers.add_parser(
        "vocab-audit",
        help="print and check tokenizer, embedding, head and config vocabularies and the ordered vocabulary hash (M3.8 0x08)",
        description="Audit a model's vocabulary identity: every size, the special and added ids, tying, and the ordered "
        "vocabulary hash against the checkpoint's.",
    )
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="the model (default tiny)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--write-bundle", metavar="FILE", help="write the release bundle of the loaded artifacts (after the "
                        "audit holds) to FILE")
    parser.add_argument("--release-version", default=None, help="the bundle's version (default <model>@1)")
    parser.add_argument("--policy-masks", default=None, metavar="JSON", help="the written bundle's policy masks, "
                        "'{\"bad_words_ids\": [[id, ...], ...], \"logit_bias_ids\": [id, ...]}' (default none); each id must "
                        "lie inside the table")
    parser.add_argument("--shards", type=int, default=1, metavar="N", help="the written bundle's shard manifest splits the "
                        "vocabulary rows over N ranks, contiguous and even (default 1)")
    parser.add_argument("--check-bundle", metavar="FILE", help="check the release bundle in FILE (with its optimizer, shard "
                        "and policy manifests) against itself and the loaded artifacts; names every part that disagrees")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the audit; returns the exit code."""
    if args.model == "smollm2":
        from decodespec.impl.gguf import smollm2_available

        if not smollm2_available():
            from decodespec.checks.testing import SMOLLM2_SKIP_REASON

            print(f"decodespec vocab-audit: {SMOLLM2_SKIP_REASON}", file=sys.stderr)
            return 3
    from decodespec.checks.adapters.impl import load_model, load_tokenizer
    from decodespec.checks.gate.vocab_check import audit_added_tokens, audit_model, reference_vocab
    from decodespec.spec.vocab import ADDED_TOKEN_VIOLATIONS, AUDIT_VIOLATIONS, audit_violations

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    audit = audit_model(model, tokenizer)
    ref = reference_vocab(args.model)
    added = audit_added_tokens(model, tokenizer, args.model)
    violations = list(audit_violations(audit))
    if audit.vocab_hash != ref.vocab_hash:
        violations.append("hash_differs_from_checkpoint")
    if audit.output_rows != ref.output_rows:
        violations.append("rows_differ_from_checkpoint")
    violations += [f"added_token:{i}:{v}" for i, v in added.violations]
    bundle_report = _bundle(args, model, tokenizer, ok=not violations)
    violations += [f"bundle:{part}" for part, _ in bundle_report.get("violations", [])]
    ok = not violations
    if args.json:
        print(json.dumps({"model": args.model, "audit": audit.to_json(), "checkpoint": {"vocab_hash": ref.vocab_hash,
                          "table_size": ref.table_size, "output_rows": ref.output_rows}, "added_tokens": added.to_json(),
                          "bundle": bundle_report or None, "violations": violations, "ok": ok}))
        return 0 if ok else 1
    rows = [
        ("tokenizer base size (tokenizer.vocab_size)", audit.tokenizer_size),
        ("tokenizer length with added (len(tokenizer))", audit.tokenizer_len),
        ("added token ids", list(audit.added_ids) or "none"),
        ("special ids (tokenizer)", dict(audit.special_ids)),
        ("special ids (model config)", dict(audit.config_special_ids)),
        ("input embedding rows", audit.embedding_rows),
        ("output head rows (V_out)", audit.output_rows),
        ("config vocab_size", audit.config_vocab_size),
        ("head tied to embedding (one Parameter)", audit.tied),
        ("ordered vocabulary hash (runtime)", audit.vocab_hash),
        ("ordered vocabulary hash (checkpoint)", ref.vocab_hash),
        ("checkpoint table entries / head rows", f"{ref.table_size} / {ref.output_rows}"),
        ("added / special tokens (string, flag, rows)",
         f"{len(added.declared)} declared, " + ("all keep their identity" if added.passed else f"{len(added.violations)} violations")),
    ]
    if bundle_report:
        rows.append(("release bundle " + bundle_report["action"], f"{bundle_report['path']} ({bundle_report['version']}, "
                     f"{bundle_report['digest']})" if bundle_report.get("digest") else bundle_report["path"]))
    print(f"vocabulary audit of {args.model} (M3.8 0x08)")
    for label, value in rows:
        print(f"  {label:48s} {value}")
    if ok:
        print("ok: every emitted id has an output row, embedding and head agree with the config, special ids agree, "
              "and the runtime's ordered table is the checkpoint's")
    for name in violations:
        if not name.startswith("bundle:"):
            why = AUDIT_VIOLATIONS.get(name) or ADDED_TOKEN_VIOLATIONS.get(name.rsplit(":", 1)[-1]) or "the runtime and the checkpoint disagree"
            print(f"VIOLATION {name}: {why}")
    for part, why in bundle_report.get("violations", []):
        print(f"VIOLATION bundle part {part}: {why}")
    return 0 if ok else 1


def _bundle(args: argparse.Namespace, model, tokenizer, *, ok: bool) -> dict:
    """Write or check the release bundle (``--write-bundle`` / ``--check-bundle``); the report, ``{}`` when neither was asked.

    Writing refuses (``violations``: ``audit``) when the audit failed: a bundle binds a consistent release only.
    """
    from pathlib import Path

    import attrs

    from decodespec.checks.gate.vocab_check import INFERENCE_ONLY, loaded_bundle, loaded_policy
    from decodespec.spec.errors import Rejection
    from decodespec.spec.vocab_release import ReleaseBundle, ShardManifest, bundle_violations

    if args.write_bundle:
        version = args.release_version or f"{args.model}@1"
        rows = int(model.lm_head.weight.shape[0])
        # an inference release: the optimizer manifest is declared absent, never left out
        try:
            masks = json.loads(args.policy_masks) if args.policy_masks else {}
            policy = loaded_policy(tokenizer, bad_words_ids=masks.get("bad_words_ids", ()), logit_bias_ids=masks.get("logit_bias_ids", ()))
        except (ValueError, TypeError, AttributeError) as exc:
            return {"action": "written", "path": args.write_bundle, "version": version, "digest": None,
                    "violations": [("policy", f"--policy-masks is not the masks object: {exc}")]}
        bundle = attrs.evolve(loaded_bundle(args.model, model, tokenizer, version), optimizer=INFERENCE_ONLY,
                              shards=ShardManifest.even(rows, max(1, min(args.shards, rows))), policy=policy)
        bad = [("audit", "the audit failed: no bundle written")] if not ok else list(bundle_violations(bundle))
        if not bad:
            Path(args.write_bundle).write_text(json.dumps(bundle.to_json(), indent=1, ensure_ascii=False) + "\n")
        return {"action": "written", "path": args.write_bundle, "version": version,
                "digest": None if bad else bundle.digest(), "violations": bad}
    if args.check_bundle:
        try:
            bundle = ReleaseBundle.from_json(json.loads(Path(args.check_bundle).read_text()))
        except (OSError, ValueError) as exc:
            return {"action": "checked", "path": args.check_bundle, "violations": [("format", f"unreadable: {exc}")]}
        except Rejection as exc:
            return {"action": "checked", "path": args.check_bundle, "violations": [("format", exc.message)]}
        loaded = loaded_bundle(args.model, model, tokenizer, bundle.version)
        return {"action": "checked", "path": args.check_bundle, "version": bundle.version, "digest": bundle.digest(),
                "violations": list(bundle_violations(bundle, loaded))}
    return {}
