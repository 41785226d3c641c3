"""One ordered vocabulary hash (M3.8 0x08): the envelope's ``tokenizer_sha256`` and the gate's ``vocab_hash`` are one definition.

Rules checked: invariant.vocab_ordered_identity (its one home, spec.vocab.vocab_table_hash, used by the
request envelope's path -- ``decodespec generate`` -- and the gate's path -- the impl adapter, STATE).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from decodespec.checks.testing import requires_smollm2
from decodespec.spec.rules import RULES
from decodespec.spec.vocab import vocab_table_hash

REPO = Path(__file__).resolve().parents[1]
#: Names that only a function reading a vocabulary table uses.
_TABLE_NAMES = {"token_bytes", "id_to_token", "vocab_table", "tokenizer.ggml.tokens", "special_ids", "merges"}
#: Hashing functions of a tokenizer that are *not* a vocabulary identity, each with its reason.
_ALLOWED = {
    ("impl/tokenizer.py", "__init__"): "GGUFTokenizer.program_sha256 / ByteTokenizer.program_sha256: the tokenizer as a "
                                       "program (merges included), the older envelope value read for compatibility",
}


def _hashing_functions(path: Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names, hashes = set(), False
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
                hashes |= isinstance(node.value, ast.Name) and node.value.id == "hashlib"
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
        if hashes:
            yield fn.name, names


def test_no_second_definition_of_the_vocabulary_hash():
    home = RULES["invariant.vocab_ordered_identity"].obj
    assert home is vocab_table_hash and home.__module__ == "decodespec.spec.vocab"
    found = []
    for root in ("spec", "impl", "checks"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for name, names in _hashing_functions(path):
                table = names & _TABLE_NAMES
                named = re.search(r"vocab.*hash|table_hash|tokenizer_sha", name)
                if (table or named) and (rel, name) not in _ALLOWED and not (rel == "spec/vocab.py" and name == "vocab_table_hash"):
                    found.append(f"{rel}:{name} hashes {sorted(table) or name}")
    assert not found, "a second vocabulary hash: use decodespec.spec.vocab.vocab_table_hash\n" + "\n".join(found)


def test_the_scan_sees_a_second_definition(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import hashlib\ndef my_hash(tok):\n    return hashlib.sha256(b''.join(tok.token_bytes(i) for i in range(3)))\n")
    assert [name for name, names in _hashing_functions(bad) if names & _TABLE_NAMES] == ["my_hash"]


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_envelope_path_and_gate_path_state_one_hash(model):
    from decodespec.checks.adapters.impl import load_model, load_tokenizer, runtime_request
    from decodespec.checks.commands.generate import envelope_from_flags
    from decodespec.checks.gate.vocab_check import reference_vocab, runtime_vocab_hash

    tok = load_tokenizer(model)
    digest = vocab_table_hash(*tok.vocab_table())
    assert tok.vocab_hash == tok.sha256 == runtime_vocab_hash(tok) == reference_vocab(model).vocab_hash == digest
    assert tok.program_sha256 != digest  # the older value hashes merges / a format tag, not the table
    from decodespec.checks.commands.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", model, "--prompt", "hi"])
    env = envelope_from_flags(args, load_model(model), tok)
    assert env["text_interface"]["tokenizer_sha256"] == digest
    assert runtime_request  # the gate's request binds runtime_vocab_hash (checks/adapters/impl.py)


def _example_with(value: str, tmp_path: Path) -> Path:
    env = json.loads((REPO / "docs/examples/tiny.request.json").read_text())
    env["text_interface"]["tokenizer_sha256"] = value
    env["output"]["stream"] = False
    path = tmp_path / "req.json"
    path.write_text(json.dumps(env))
    return path


@pytest.mark.parametrize("older", [False, True])
def test_generate_receipts_carry_the_ordered_hash_also_for_the_older_value(older, tmp_path, capsys):
    from decodespec.checks.commands.cli import main
    from decodespec.impl.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    path = _example_with(tok.program_sha256 if older else tok.vocab_hash, tmp_path)
    assert main(["generate", "--model", "tiny", "--request", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["receipts"] and {r["vocab_hash"] for r in out["receipts"]} == {tok.vocab_hash}


def test_generate_refuses_another_vocabulary_hash(tmp_path, capsys):
    from decodespec.checks.commands.cli import main

    path = _example_with("sha256:" + "3" * 64, tmp_path)
    assert main(["generate", "--model", "tiny", "--request", str(path), "--json"]) != 0
    captured = capsys.readouterr()
    assert "runtime.artifact_mismatch" in captured.err and "tokenizer_sha256" in captured.err
