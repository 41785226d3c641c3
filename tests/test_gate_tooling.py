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

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.traces import load_trace, replay

REPO = Path(__file__).resolve().parent.parent


def _gate(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    """``pytest checks/...`` in a subprocess (the gate's own conftest and options)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", "-o", "addopts="],
                          check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


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
    from decodespec.checks.modelcheck.traces import installed_mutant

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


# ---- finding 4: explore refuses bounds that describe no admissible request, before exploring -----------------------


@pytest.mark.parametrize(("argv", "path"), [
    (["--prefill-chunk", "0"], "$.prefill_chunk"),
    (["--draws", "-1"], "$.max_draws"),
    (["--max-retries", "-1"], "$.max_retries"),
    (["--context-cap", "0"], "$.context_cap"),
    (["--context-cap", "3"], "$.context_cap"),  # L = 3 fills it: no room for the first output
    (["--vocab", "1"], "$.vocab"),
    (["--min-new-tokens", "5"], "$.min_new_tokens"),  # G = 3 (generate: envelope.min_exceeds_max)
    (["--min-new-tokens", "-1"], "$.min_new_tokens"),
    (["--cache", "static", "--capacity", "0"], "$.capacity"),
    (["--profile", "encoder_decoder", "--source-len", "0"], "$.source_len"),
    (["--profile", "prefix_lm", "--prefill-chunk", "2"], "$.prefill_chunk"),  # cannot hold the 3-token prefix
    (["--profile", "prefix_lm", "--prefix-length", "4"], "$.prefix_length"),
])
def test_explore_refuses_invalid_bounds_with_exit_2_and_writes_nothing(argv, path, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["explore", *argv]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["error"]["code"] == "explore.invalid_bounds"
    assert report["error"]["path"] == path and "states" not in report
    assert list(tmp_path.iterdir()) == []


def test_explore_bounds_at_the_edge_are_explored(tmp_path, monkeypatch, capsys) -> None:
    """The least admissible values pass: C = L + 1, min_new_tokens = G, G = 0 with C = L, prefix_lm by default."""
    monkeypatch.chdir(tmp_path)
    quiet = ["--no-adversarial", "--no-faults", "--no-interrupts"]
    for argv in (["--context-cap", "4"], ["--min-new-tokens", "3"], ["--max-new-tokens", "0", "--context-cap", "3"],
                 ["--profile", "prefix_lm"], ["--profile", "prefix_lm", "--prefill-chunk", "none"]):
        assert main(["explore", *argv, *quiet]) == 0, argv
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] is True and report["states"] > 1, argv
    assert list(tmp_path.iterdir()) == []


def test_explore_prefix_lm_default_chunk_holds_the_prefix() -> None:
    """Without --prefill-chunk a prefix_lm profile gets a chunk that holds its prefix (rule: explore bounds)."""
    from decodespec.checks.commands.cli import build_parser
    from decodespec.checks.commands.explore import _prefill_chunk

    parser = build_parser()
    assert _prefill_chunk(parser.parse_args(["explore", "--profile", "prefix_lm"]), 2) == 3
    assert _prefill_chunk(parser.parse_args(["explore", "--profile", "prefix_lm", "--prefix-length", "1"]), 2) == 2
    assert _prefill_chunk(parser.parse_args(["explore", "--profile", "prefix_lm", "--prefill-chunk", "none"]), 2) is None
    assert _prefill_chunk(parser.parse_args(["explore"]), 2) == 2
    assert _prefill_chunk(parser.parse_args(["explore", "--prefill-chunk", "5"]), 2) == 5


def test_explore_help_gives_the_itf_out_default(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["explore", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--itf-out" in text and "default ./counterexample.itf.json" in text


# ---- finding 5: check / the gate refuse a runtime they cannot run, before any case -------------------------------


@pytest.mark.parametrize(("runtime", "code"), [
    ("bogus", "adapter.unsupported"),
    ("impl:x", "adapter.unsupported"),
    ("stdio:", "adapter.protocol"),  # empty command
    ("stdio:cat", "adapter.protocol"),  # echoes the start request: a bad handshake
    ("stdio:/bin/false", "adapter.protocol"),  # exits before answering
    ("stdio:decodespec-no-such-command", "adapter.protocol"),  # cannot start
])
def test_check_refuses_a_runtime_it_cannot_run_with_exit_2(runtime, code, tmp_path, capsys) -> None:
    report = tmp_path / "report.jsonl"
    assert main(["check", "--runtime", runtime, "--model", "tiny", "--report", str(report)]) == 2
    out, err = capsys.readouterr()
    error = json.loads(err.splitlines()[-1])
    assert error["runtime"] == runtime and error["error"]["code"] == code and error["error"]["message"]
    assert out == "" and not report.exists()  # pytest never ran


def test_check_runtime_accepts_what_the_gate_can_run() -> None:
    from decodespec.checks.modelcheck.traces import check_runtime

    for runtime in ("impl", "hf", "llamacpp", "impl.broken.frozen_rng"):  # a missing peer is the gate's skip, not an error
        check_runtime(runtime, "tiny")
    check_runtime("stdio:python -m decodespec.checks.adapters.stdio_server", "tiny", timeout=120)


def test_check_runtime_gives_up_on_a_silent_server() -> None:
    import time

    from decodespec.checks.modelcheck.traces import check_runtime
    from decodespec.spec.errors import Rejection

    started = time.monotonic()
    with pytest.raises(Rejection) as err:
        check_runtime("stdio:sleep 30", "tiny", timeout=1)
    assert err.value.code == "adapter.protocol" and "within 1" in err.value.message
    assert time.monotonic() - started < 8  # the silent process is killed, not waited for


def test_pytest_checks_with_a_bogus_runtime_is_one_usage_error() -> None:
    run = _gate("checks/", "--runtime", "bogus", "--model", "tiny", timeout=120)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]  # pytest.ExitCode.USAGE_ERROR
    assert "--runtime bogus: [adapter.unsupported] unknown runtime 'bogus'" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr and "passed" not in run.stdout and "failed" not in run.stdout


# ---- a recorded intra-op thread count is replayed (CPU float32 rounding depends on it) ---------------------------


def test_a_trace_records_torch_threads_and_replay_sets_them_for_the_replay(mutant_trace) -> None:
    """``#meta.threads``: written by the trace writer, set by replay for the replay only, restored after."""
    import torch

    from decodespec.checks.modelcheck import traces

    trace = load_trace(mutant_trace)
    assert trace["#meta"]["threads"] == 1  # the gate subprocess ran with OMP_NUM_THREADS=1
    seen: list[int] = []
    before = torch.get_num_threads()
    with traces.intra_op_threads(before + 1):
        seen.append(torch.get_num_threads())
    assert seen == [before + 1] and torch.get_num_threads() == before
    with traces.intra_op_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", [0, -2, True, "2", 1.5])
def test_a_malformed_thread_count_is_a_typed_refusal(mutant_trace, value) -> None:
    from decodespec.spec.errors import Rejection

    trace = load_trace(mutant_trace)
    trace["#meta"]["threads"] = value
    with pytest.raises(Rejection) as info:
        replay(trace)
    assert info.value.code == "trace.invalid_conformance_trace" and info.value.path == "$.#meta.threads"
