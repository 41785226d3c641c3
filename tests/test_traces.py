"""Conformance traces (checks/modelcheck/traces.py): the ``decodespec.trace`` ITF format, replay and the CLI.

Source: traces/README.md; research/formal-anchors-survey.md 5.1 (ITF).
"""

from __future__ import annotations

import json

import pytest

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck import itf
from decodespec.checks.modelcheck.traces import TRACE_FORMAT, TRACE_FORMAT_VERSION, load_trace, record, replay, write_trace
from decodespec.spec.errors import Rejection

CONFIG = CaseConfig(model="tiny", prompt_ids=[1, 75, 105], max_new_tokens=4, eos_ids=[2], stream=True)
ACTIONS = [{"op": "step"}, {"op": "snapshot", "form": "pending_suffix", "id": "s"}, {"op": "run"},
           {"op": "restore", "snapshot": "s"}, {"op": "commit", "receipt": "receipt-0"}, {"op": "run"}]


@pytest.fixture(scope="module")
def trace():
    return record("impl", CONFIG, ACTIONS, description="test")


def test_a_trace_is_valid_itf_with_the_replay_meta(trace) -> None:
    itf.validate_trace(trace)
    meta = trace["#meta"]
    assert (meta["format"], meta["format_version"]) == (TRACE_FORMAT, TRACE_FORMAT_VERSION)
    assert meta["config"] == CONFIG.to_json() and [a["op"] for a in meta["actions"]] == [a["op"] for a in ACTIONS]
    assert meta["verdict"]["result"] == "passed"
    assert len(trace["states"]) == len(ACTIONS) + 1
    assert trace["states"][5]["runtime"]["status"] == "rejected"  # the duplicate receipt, refused on both sides
    assert trace["states"][5]["spec"]["code"] == "transition.not_enabled"


def test_write_load_replay(trace, tmp_path) -> None:
    path = write_trace(trace, tmp_path)
    assert path.name.startswith("impl-tiny-passed-") and path.name.endswith(".itf.json")
    loaded = load_trace(path)
    result = replay(loaded)
    assert result.reproduced and result.steps == len(ACTIONS) + 1


def test_load_refuses_other_formats_and_versions(trace, tmp_path) -> None:
    for meta_change in ({"format_version": TRACE_FORMAT_VERSION + 1}, {"format": "decodespec.counterexample"}, {"actions": None}):
        bad = json.loads(json.dumps(trace))
        bad["#meta"].update(meta_change)
        if meta_change.get("actions", 0) is None:
            del bad["#meta"]["actions"]
        path = tmp_path / "bad.itf.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(Rejection) as err:
            load_trace(path)
        assert err.value.code == "trace.invalid_conformance_trace"


def test_replay_reports_a_changed_verdict(trace) -> None:
    """A trace whose recorded verdict differs from what the run gives is not reproduced (exit 1 in the CLI)."""
    changed = json.loads(json.dumps(trace))
    changed["#meta"]["verdict"] = {"result": "failed", "layer": "TENSOR", "rule": "ladder.TENSOR"}
    assert not replay(changed).reproduced


def test_cli_replay_exit_codes(trace, tmp_path, capsys) -> None:
    good = write_trace(trace, tmp_path)
    assert main(["replay", str(good)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["reproduced"] is True
    changed = json.loads(json.dumps(trace))
    changed["#meta"]["verdict"]["result"] = "undecided"
    bad = write_trace(changed, tmp_path, "changed.itf.json")
    assert main(["replay", str(bad)]) == 1
    junk = tmp_path / "junk.itf.json"
    junk.write_text("{}")
    assert main(["replay", str(junk)]) == 2


def test_cli_check_runs_the_gate_and_writes_the_report(tmp_path, capsys) -> None:
    """``decodespec check`` runs the same case table as ``pytest checks/`` and prints the summary table."""
    report = tmp_path / "impl.jsonl"
    code = main(["check", "--runtime", "impl", "--model", "tiny", "--cases-only", "-k", "immediate_eos or duplicate_stale",
                 "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert {line["case"] for line in lines} == {"boundary.immediate_eos", "adversarial.duplicate_stale_receipt"}
    assert all(line["result"] == "pass" and line["runtime"] == "impl" for line in lines)
    assert "boundary.immediate_eos" in out and "pass: 2" in out


def test_a_trace_records_the_cpu_capability_next_to_the_thread_count(trace) -> None:
    import torch

    meta = trace["#meta"]
    assert meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and meta["threads"] == torch.get_num_threads()
    assert "exact_floats" not in meta


def test_a_bit_exact_verdict_of_other_cpu_kernels_says_this_machine_cannot_reproduce_it(trace, tmp_path, capsys) -> None:
    """#meta.exact_floats under another cpu_capability: a non-reproduced replay says why (exit 3), a reproduced one is a pass;
    the same mismatch without exact_floats, or under this process's capability, is an ordinary non-reproduction (exit 1)."""
    changed = json.loads(json.dumps(trace))
    changed["#meta"]["verdict"] = {"result": "failed", "layer": "TENSOR", "rule": "ladder.TENSOR"}
    changed["#meta"].update(exact_floats=True, cpu_capability="VSX")
    result = replay(changed)
    assert not result.reproduced and "VSX" in result.cannot_reproduce_here and "ATEN_CPU_CAPABILITY=vsx" in result.cannot_reproduce_here
    path = write_trace(changed, tmp_path, "exact.itf.json")
    assert main(["replay", str(path)]) == 3
    out = capsys.readouterr()
    assert json.loads(out.out.splitlines()[-1])["cannot_reproduce_here"] and "this machine cannot reproduce" in out.err
    same = json.loads(json.dumps(trace))
    same["#meta"].update(exact_floats=True, cpu_capability="VSX")
    assert replay(same).reproduced and replay(same).cannot_reproduce_here is None
    for meta_change in ({"exact_floats": False}, {"cpu_capability": trace["#meta"]["cpu_capability"]}):
        other = json.loads(json.dumps(changed))
        other["#meta"].update(meta_change)
        assert replay(other).cannot_reproduce_here is None
        assert main(["replay", str(write_trace(other, tmp_path, "other.itf.json"))]) == 1
