"""Bad command-line input is refused typed and changes nothing (new-user trial findings 2, 3, 8).

Every refusal is exit 2 with a JSON error (registered code, path, message), comes before any
generation, and leaves no output file, partial or orphan.  Generation runs on the tiny model.

Source: docs/design.md section 8 (runtime outputs), ``decodespec.checks.commands.cli`` (exit codes).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.testing import requires_smollm2
from decodespec.spec.errors import ERROR_CODES, Rejection

REPO = Path(__file__).resolve().parents[1]
TINY_REQUEST = REPO / "docs" / "examples" / "tiny.request.json"
GEN = ["generate", "--model", "tiny", "--device", "cpu"]


def _error(capsys, argv: list[str]) -> dict:
    assert main(argv) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] in ERROR_CODES, error
    return error


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# -- finding 2: flags that conflict with --resume / --request ---------------------------------------


def test_request_flags_conflict_with_resume(capsys, tmp_path):
    error = _error(capsys, [*GEN, "--resume", str(tmp_path / "y.json"), "--max-new-tokens", "3", "--seed", "9",
                            "--do-sample", "--stop", "X", "--prompt", "other"])
    assert (error["code"], error["path"]) == ("runtime.invalid_request", "$.resume")
    for flag in ("--prompt", "--max-new-tokens", "--seed", "--do-sample", "--stop"):
        assert flag in error["message"]


def test_request_flags_conflict_with_request(capsys):
    error = _error(capsys, [*GEN, "--request", str(TINY_REQUEST), "--prompt", "x", "--max-new-tokens", "2", "--do-sample", "--seed", "1"])
    assert (error["code"], error["path"]) == ("runtime.invalid_request", "$.request")
    assert all(f in error["message"] for f in ("--prompt", "--max-new-tokens", "--do-sample", "--seed"))
    assert "--trace" not in error["message"]


def test_request_and_resume_conflict(capsys, tmp_path):
    error = _error(capsys, [*GEN, "--request", str(TINY_REQUEST), "--resume", str(tmp_path / "s.json")])
    assert "--request and --resume conflict" in error["message"]


@pytest.mark.parametrize("argv, path, text", [
    (["--snapshot-at", "-1", "--snapshot", "s.json"], "$.snapshot_at", "N >= 0"),
    (["--capacity", "5"], "$.runtime.static_capacity", "needs --cache static"),
    (["--capacity", "5", "--cache", "none"], "$.runtime.static_capacity", "not --cache none"),
])
def test_inconsistent_flags_are_refused(capsys, tmp_path, monkeypatch, argv, path, text):
    monkeypatch.chdir(tmp_path)
    error = _error(capsys, [*GEN, "--prompt", "hi", *argv])
    assert error["path"] == path and text in error["message"]
    assert _files(tmp_path) == []


# -- finding 3: output paths, atomic outputs, malformed tensors ----------------------------------------


@pytest.mark.parametrize("argv, path, text", [
    (["--trace", "/nonexistent/dir/t.ndjson"], "$.trace", "does not exist"),
    (["--trace", "adir"], "$.trace", "is a directory"),
    (["--snapshot", "/nonexistent/dir/s.json"], "$.snapshot", "does not exist"),
    (["--snapshot", "adir", "--trace", "pt.ndjson"], "$.snapshot", "is a directory"),
    (["--snapshot", "s.json", "--trace", "pt.ndjson"], "$.snapshot", "is a directory"),  # s.json.safetensors is a folder
])
def test_bad_output_paths_are_refused_before_any_work(capsys, tmp_path, monkeypatch, argv, path, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "s.json.safetensors").mkdir()
    error = _error(capsys, [*GEN, "--prompt", "hi", "--max-new-tokens", "2", *argv])
    assert (error["code"], error["path"]) == ("cli.io_error", path) and text in error["message"]
    assert _files(tmp_path) == ["adir", "s.json.safetensors"]


def test_a_failure_after_generation_leaves_no_file(capsys, tmp_path, monkeypatch):
    """The snapshot write fails after the run: no trace, no snapshot, no temporary is left."""
    import decodespec.impl.snapshot as snap

    real = snap.save_snapshot

    def failing(snapshot, path, **options):
        real(snapshot, path, **options)  # the partial files exist ...
        raise Rejection("snapshot.malformed", "disk full (simulated)", "$")  # ... and then the write fails

    monkeypatch.setattr(snap, "save_snapshot", failing)
    monkeypatch.chdir(tmp_path)
    _error(capsys, [*GEN, "--prompt", "hi", "--max-new-tokens", "3", "--trace", "t.ndjson", "--snapshot", "s.json"])
    assert _files(tmp_path) == []


def test_outputs_land_whole_with_the_same_mode(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*GEN, "--prompt", "hi", "--max-new-tokens", "3", "--trace", "t.ndjson", "--snapshot", "s.json", "--snapshot-at", "1"]) == 0
    capsys.readouterr()
    assert _files(tmp_path) == ["s.json", "s.json.safetensors", "t.ndjson"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert main(["validate-trace", "t.ndjson"]) == 0
    capsys.readouterr()
    # a truncated tensor file whose SHA-256 is re-recorded is snapshot.malformed, exit 2, no traceback
    blob = (tmp_path / "s.json.safetensors").read_bytes()[:-64]
    (tmp_path / "s.json.safetensors").write_bytes(blob)
    doc = json.loads((tmp_path / "s.json").read_text())
    doc["cache"]["sha256"] = "sha256:" + hashlib.sha256(blob).hexdigest()
    (tmp_path / "s.json").write_text(json.dumps(doc))
    error = _error(capsys, [*GEN, "--resume", "s.json"])
    assert (error["code"], error["path"]) == ("snapshot.malformed", "$.cache.tensors")


# -- validate, mutants: JSON errors, bounded reads ---------------------------------------------------------


def test_validate_errors_are_json_with_namespaced_codes(capsys, tmp_path):
    assert main(["validate"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "runtime.invalid_request"
    for target in (tmp_path / "absent.json", tmp_path):
        assert main(["validate", str(target)]) == 2
        assert json.loads(capsys.readouterr().out)["error"]["code"] == "cli.io_error"


def test_validate_reads_at_most_one_byte_past_the_limit():
    """``validate /dev/zero`` returns envelope.too_large instead of reading forever."""
    done = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "validate", "/dev/zero"], check=False, capture_output=True, timeout=120)
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["code"] == "envelope.too_large"


def test_mutants_unknown_name_with_json_prints_json(capsys):
    assert main(["mutants", "--only", "nosuch", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "runtime.invalid_request" and "nosuch" in error["message"]


def test_a_closed_pipe_exits_without_a_traceback():
    """stdout closed by its reader (``| head``): exit 1, nothing on stderr (the BrokenPipeError recipe)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "validate", str(TINY_REQUEST)],
                              check=False, stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stderr == b"", done.stderr.decode()


@requires_smollm2
@pytest.mark.smollm2
def test_empty_prompt_on_smollm2_says_so_plainly(capsys, smollm2_model):
    error = _error(capsys, ["generate", "--model", "smollm2", "--device", "cpu", "--prompt", ""])
    assert error["code"] == "envelope.empty_prompt"
    assert error["message"].startswith("an empty prompt needs a declared start state; SmolLM2 declares none")
