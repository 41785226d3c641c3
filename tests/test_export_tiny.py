"""``decodespec export-tiny --out-dir``: the tiny model as files a foreign runtime reads (issue 22 item 1).

HF transformers loads the exported folder (local files only) and its float32 logits equal our
runtime's; the GGUF holds the same weights (Q/K rows in llama.cpp's order); the tokenizer table
is the byte tokenizer; the export is deterministic and atomic.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from decodespec.checks.commands import cli
from decodespec.checks.gate.reference import files as ref_files
from decodespec.impl.tiny import load_tiny
from decodespec.impl.tokenizer import ByteTokenizer

SEED = 0


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "export-tiny", *args], check=False, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny"
    proc = _export("--out-dir", str(out), "--seed", str(SEED))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and sorted(report["files"]) == sorted(ref_files.TINY_FILES)
    for name, info in report["files"].items():
        data = (out / name).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert sorted(p.name for p in out.iterdir()) == sorted(ref_files.TINY_FILES)
    assert not list(out.parent.glob(".*"))  # no temporary folder left beside it
    return out


def test_hf_transformers_loads_the_folder_and_its_logits_match(exported: Path) -> None:
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    with safe_open(exported / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "model.layers.3.self_attn.q_proj.weight" in names
    assert "lm_head.weight" not in names  # tied head
    hf = LlamaForCausalLM.from_pretrained(exported, local_files_only=True, dtype=torch.float32,
                                          attn_implementation="eager").eval()
    ours = load_tiny(seed=SEED, attn_implementation="eager")
    assert hf.config.tie_word_embeddings and hf.config.vocab_size == 512 and hf.config.head_dim == 16
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (1, 2, 0)
    assert torch.equal(hf.lm_head.weight, ours.model.embed_tokens.weight)
    tok = ByteTokenizer(512)
    ids = torch.tensor([[tok.bos_token_id, *tok.encode("The café, 12 ¼ past noon:")]])
    with torch.no_grad():
        want = ours(ids).logits
        got = hf(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 512)
    assert want.abs().max() > 1.0  # not a degenerate row
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _gguf_to_hf_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved RoPE pairs -> HF rotate-half rows, per head (the inverse of convert_hf_to_gguf's permute)."""
    per = weights.shape[0] // n_head
    return weights.reshape(n_head, per // 2, 2, weights.shape[1]).swapaxes(1, 2).reshape(weights.shape)


def test_gguf_holds_the_safetensors_weights(exported: Path) -> None:
    import gguf
    from safetensors.numpy import load_file

    hf = load_file(exported / "model.safetensors")
    ours = {k: v.numpy() for k, v in load_tiny(seed=SEED).state_dict().items()}
    assert np.array_equal(ours.pop("lm_head.weight"), ours["model.embed_tokens.weight"])  # tied: one tensor on file
    assert set(hf) == set(ours) and all(np.array_equal(hf[k], ours[k]) for k in hf)
    reader = gguf.GGUFReader(exported / "tiny.gguf")
    meta = {k: reader.fields[k].contents() for k in ("general.architecture", "llama.block_count", "llama.embedding_length",
                                                    "llama.attention.head_count", "llama.attention.head_count_kv",
                                                    "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
                                                    "llama.vocab_size", "tokenizer.ggml.eos_token_id")}
    assert meta == {"general.architecture": "llama", "llama.block_count": 4, "llama.embedding_length": 64,
                    "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.rope.freq_base": 1e4,
                    "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-5), "llama.vocab_size": 512,
                    "tokenizer.ggml.eos_token_id": 2}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    expected = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    for i in range(4):
        for short, long in names.items():
            expected[f"blk.{i}.{short}.weight"] = hf[f"model.layers.{i}.{long}.weight"]
    assert set(tensors) == set(expected)  # no output.weight: the head is tied
    for name, want in expected.items():
        got = tensors[name]
        if ".attn_q." in name:
            assert not np.array_equal(got, want)  # the rows are permuted ...
            got = _gguf_to_hf_rows(got, 4)  # ... and undoing llama.cpp's permutation gives HF's
        elif ".attn_k." in name:
            got = _gguf_to_hf_rows(got, 2)
        assert got.shape == want.shape and np.array_equal(got, want), name


def test_tokenizer_table_round_trips_the_byte_tokenizer(exported: Path) -> None:
    table = json.loads((exported / "tokenizer_table.json").read_text())
    tok = ByteTokenizer(512)
    assert table["format"] == "decodespec.byte-tokenizer.v1" and table["sha256"] == tok.sha256
    assert (table["pad_token_id"], table["bos_token_id"], table["eos_token_id"]) == (0, 1, 2)
    assert table["vocab_size"] == len(table["tokens"]) == 512 and table["add_bos_token"] is True
    assert [e["id"] for e in table["tokens"]] == list(range(512))
    for entry in table["tokens"]:
        assert bytes.fromhex(entry["hex"]) == tok.token_bytes(entry["id"]), entry
    kinds = {e["id"]: (e["kind"], e.get("name")) for e in table["tokens"]}
    assert [kinds[i] for i in (0, 1, 2)] == [("special", "<pad>"), ("special", "<bos>"), ("special", "<eos>")]
    assert {kinds[i][0] for i in range(3, 259)} == {"byte"} and {kinds[i][0] for i in range(259, 512)} == {"unused"}
    # A foreign runtime's encode and decode from the table alone equal ByteTokenizer's.
    by_byte = {bytes.fromhex(e["hex"]): e["id"] for e in table["tokens"] if e["kind"] == "byte"}
    text = "naïve ✓ tab\there\x00"
    ids = [by_byte[bytes([b])] for b in text.encode("utf-8")]
    assert ids == tok.encode(text)
    hexes = {e["id"]: e["hex"] for e in table["tokens"]}
    stream = [1, *ids, 300, 2]
    assert b"".join(bytes.fromhex(hexes[i]) for i in stream).decode("utf-8") == tok.decode(stream) == text


def test_reexport_is_byte_identical_and_replaces_an_earlier_export(exported: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert _export("--out-dir", str(again), "--seed", str(SEED)).returncode == 0
    for name in ref_files.TINY_FILES:
        assert (again / name).read_bytes() == (exported / name).read_bytes(), name
    # Into the same folder (an earlier export): replaced, same bytes, nothing left beside it.
    proc = _export("--out-dir", str(again), "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (again / "model.safetensors").read_bytes() != (exported / "model.safetensors").read_bytes()
    assert "seed 1" in (again / "README.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_unwritable_or_foreign_output_is_refused_and_nothing_changes(tmp_path: Path, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit) as bad_seed:
        cli.main(["export-tiny", "--out-dir", str(tmp_path / "x"), "--seed", str(2**64)])
    assert bad_seed.value.code == 2 and "outside [0, 2**63)" in capsys.readouterr().err
    missing = tmp_path / "no" / "tiny"
    proc = _export("--out-dir", str(missing))
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["code"] == "cli.io_error"
    assert not (tmp_path / "no").exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    assert cli.main(["export-tiny", "--out-dir", str(a_file)]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == {
        "code": "cli.io_error", "path": "$.out_dir", "message": f"{a_file} exists and is not a folder"}
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert cli.main(["export-tiny", "--out-dir", str(foreign)]) == 2
    assert "notes.txt" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and a_file.read_text() == "keep"

    # A write that fails half-way (disk full) leaves no folder and no temporary files.
    def half(folder, seed=0):
        (Path(folder) / "tiny.gguf").write_bytes(b"GGUF")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ref_files, "write_tiny_files", half)
    target = tmp_path / "full"
    assert cli.main(["export-tiny", "--out-dir", str(target)]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "cli.io_error" and "No space left on device" in error["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "mine"]


def test_every_exported_file_follows_the_umask(tmp_path: Path) -> None:
    """A new-user trial found model.safetensors written 0600 beside 0644 files (safetensors' own writer)."""
    out = tmp_path / "umask"
    old = os.umask(0o022)
    try:
        proc = _export("--out-dir", str(out))
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == dict.fromkeys(modes, 0o644) and "model.safetensors" in modes, modes
