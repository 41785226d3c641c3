"""Gate tooling (new-user trial findings 1, 4, 5): mutant traces replay, explore bound checks, check's runtime check.

Source: traces/README.md (``#meta.mutant``); checks/conftest.py (``--mutant``, ``--runtime``);
checks/commands/{replay,explore,check}.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decodespec.checks.cli import main
from decodespec.checks.traces import load_trace, replay

REPO = Path(__file__).resolve().parent.parent


def _gate(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    """``pytest checks/...`` in a subprocess (the gate's own conftest and options)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", "-o", "addopts="],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---- finding 1: a trace written under a mutant records it, and replay installs it ---------------------------------


@pytest.fixture(scope="module")
def mutant_trace(tmp_path_factory) -> Path:
    """The gate's failure trace of ``matrix.seeded_replay`` under ``mutant.logprob_next_step`` (tiny model)."""
    out = tmp_path_factory.mktemp("mutant-traces")
    run = _gate("checks/test_gate.py", "--model", "tiny", "--mutant", "logprob_next_step", "-k", "seeded_replay",
                "--trace-dir", str(out))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]  # the gate kills the mutant
    files = sorted(out.glob("*.itf.json"))
    assert len(files) == 1, files
    return files[0]


def test_a_mutant_failure_trace_records_the_mutant_and_replays(mutant_trace, capsys) -> None:
    meta = load_trace(mutant_trace)["#meta"]
    assert meta["mutant"] == "mutant.logprob_next_step" and meta["runtime"] == "impl"
    assert meta["verdict"]["result"] == "failed" and meta["verdict"]["layer"] == "DECISION"
    assert "mutant.logprob_next_step" in mutant_trace.name
    assert main(["replay", str(mutant_trace)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.splitlines()[-1])
    assert result["reproduced"] is True and result["mutant"] == "mutant.logprob_next_step"
    assert "installing failure-lab mutant mutant.logprob_next_step" in captured.err
    # The mutant is removed again after the replay: the same actions now pass.
    from decodespec.checks.traces import installed_mutant

    assert installed_mutant() is None


def test_without_the_mutant_field_the_failure_does_not_reproduce(mutant_trace, tmp_path, capsys) -> None:
    trace = load_trace(mutant_trace)
    del trace["#meta"]["mutant"]
    result = replay(trace)
    assert not result.reproduced and result.actual.result == "passed" and result.mutant is None
    path = tmp_path / "no-mutant.itf.json"
    path.write_text(json.dumps(trace))
    assert main(["replay", str(path)]) == 1
    assert "installing" not in capsys.readouterr().err


def test_an_unknown_or_malformed_mutant_is_a_typed_refusal(mutant_trace, tmp_path, capsys) -> None:
    for value in ("mutant.nosuch", 7):
        trace = load_trace(mutant_trace)
        trace["#meta"]["mutant"] = value
        path = tmp_path / "bad.itf.json"
        path.write_text(json.dumps(trace))
        assert main(["replay", str(path)]) == 2
        error = json.loads(capsys.readouterr().err.splitlines()[-1])["error"]
        assert error["code"] == "trace.invalid_conformance_trace" and "mutant" in error["message"]
