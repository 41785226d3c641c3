"""Hostile conformance-trace files (checks/modelcheck/traces.py ``load_trace`` / ``replay``, ``decodespec replay``).

Replay never starts a process a file names (a ``stdio:CMD`` runtime needs the user's
``--runtime`` or ``--allow-runtime``), and every malformed file is a typed refusal with its code
and JSON path (exit 2), never a Python traceback.

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data"; traces/README.md.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.traces import load_trace, replay
from decodespec.spec.errors import DecodeSpecError, Rejection

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "traces" / "boundary-one-token-prompt.itf.json"


@pytest.fixture(scope="module")
def good() -> dict:
    return json.loads(SOURCE.read_text())


def _write(tmp_path: Path, trace: dict, name: str = "t.itf.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(trace))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", *args], check=False, capture_output=True, text=True, timeout=300)


def test_a_stdio_runtime_named_by_the_file_is_never_started(good, tmp_path) -> None:
    """``#meta.runtime = "stdio:touch X"``: the replay exits 2 with trace.runtime_not_allowed and X is never created."""
    marker = tmp_path / "X"
    trace = copy.deepcopy(good)
    trace["#meta"]["runtime"] = f"stdio:touch {marker}"
    path = _write(tmp_path, trace)
    done = _cli("replay", str(path))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = json.loads(done.stderr.strip().splitlines()[-1])["error"]
    assert (error["code"], error["path"]) == ("trace.runtime_not_allowed", "$.#meta.runtime")
    assert not marker.exists()
    with pytest.raises(Rejection) as err:  # the library refuses it the same way
        replay(load_trace(path))
    assert err.value.code == "trace.runtime_not_allowed" and not marker.exists()


def test_another_allowed_command_does_not_allow_the_files_command(good, tmp_path) -> None:
    marker = tmp_path / "X"
    trace = copy.deepcopy(good)
    trace["#meta"]["runtime"] = f"stdio:touch {marker}"
    with pytest.raises(Rejection) as err:
        replay(load_trace(_write(tmp_path, trace)), allow_commands=(f"touch {marker}x", "touch"))
    assert err.value.code == "trace.runtime_not_allowed" and not marker.exists()


def test_the_user_may_allow_the_same_command(good, tmp_path, capsys) -> None:
    """--allow-runtime CMD (exactly the trace's command) is the user's consent: the command runs (and, not being an
    adapter server, fails the handshake: adapter.protocol, exit 2)."""
    marker = tmp_path / "X"
    command = f"touch {marker}"
    trace = copy.deepcopy(good)
    trace["#meta"]["runtime"] = f"stdio:{command}"
    path = _write(tmp_path, trace)
    assert main(["replay", str(path), "--allow-runtime", command]) == 2
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["error"]["code"] == "adapter.protocol"
    assert marker.exists()


def _meta(change):
    def apply(trace):
        change(trace["#meta"])
    return apply


HOSTILE = {
    "verdict_a_string": (_meta(lambda m: m.__setitem__("verdict", "passed")), "$.#meta.verdict"),
    "verdict_without_result": (_meta(lambda m: m["verdict"].pop("result")), "$.#meta.verdict"),
    "verdict_unknown_layer": (_meta(lambda m: m["verdict"].__setitem__("layer", "KERNEL")), "$.#meta.verdict.layer"),
    "runtime_a_number": (_meta(lambda m: m.__setitem__("runtime", 5)), "$.#meta.runtime"),
    "actions_a_number": (_meta(lambda m: m.__setitem__("actions", 5)), "$.#meta.actions"),
    "action_unknown_op": (_meta(lambda m: m.__setitem__("actions", [{"op": "explode"}])), "$.#meta.actions[0].op"),
    "action_huge_ids": (_meta(lambda m: m.__setitem__("actions", [{"op": "reuse", "prompt_ids": [2**60]}])),
                        "$.#meta.actions[0].prompt_ids"),
    "device_a_list": (_meta(lambda m: m["config"].__setitem__("device", [1])), "$.#meta.config.device"),
    "device_unknown": (_meta(lambda m: m["config"].__setitem__("device", "tpu")), "$.#meta.config.device"),
    "id_above_2_53": (_meta(lambda m: m["config"].__setitem__("prompt_ids", [2**53 + 1])), "$.#meta.config.prompt_ids"),
    "eos_above_2_53": (_meta(lambda m: m["config"].__setitem__("eos_ids", [2**60])), "$.#meta.config.eos_ids"),
    "ids_a_float_overflow": (_meta(lambda m: m["config"].__setitem__("prompt_ids", [1e308 * 10])), "$.#meta.config"),
    "stream_a_string": (_meta(lambda m: m["config"].__setitem__("stream", "yes")), "$.#meta.config.stream"),
    "threads_zero": (_meta(lambda m: m.__setitem__("threads", 0)), "$.#meta.threads"),
    "threads_huge": (_meta(lambda m: m.__setitem__("threads", 10**9)), "$.#meta.threads"),
    "capability_a_number": (_meta(lambda m: m.__setitem__("cpu_capability", 3)), "$.#meta.cpu_capability"),
    "policy_unknown_field": (_meta(lambda m: m["config"]["policy"].__setitem__("x", 1)), "$.#meta.config.policy.x"),
    "mutant_a_list": (_meta(lambda m: m.__setitem__("mutant", ["x"])), "$.#meta.mutant"),
    "version_true": (_meta(lambda m: m.__setitem__("format_version", True)), "$.#meta.format_version"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_malformed_meta_is_a_typed_refusal_with_its_path(good, tmp_path, name) -> None:
    change, where = HOSTILE[name]
    trace = copy.deepcopy(good)
    change(trace)
    with pytest.raises(Rejection) as err:
        load_trace(_write(tmp_path, trace))
    assert (err.value.code, err.value.path) == ("trace.invalid_conformance_trace", where), err.value


@pytest.mark.parametrize("where", ["stop_strings", "policy_key", "description"])
def test_a_lone_surrogate_is_refused(good, tmp_path, where) -> None:
    """A JSON ``\\ud800`` escape decodes to a lone surrogate: no canonical (RFC 8785) identity, no printable output."""
    trace = copy.deepcopy(good)
    meta = trace["#meta"]
    text = json.dumps(trace)
    marker = {"stop_strings": '"stop_strings": []', "policy_key": '"family": "greedy"', "description": '"description": "'}[where]
    assert marker in text
    text = text.replace(marker, {"stop_strings": '"stop_strings": ["\\ud800"]', "policy_key": '"family": "greedy", "\\udc00": 1',
                                 "description": '"description": "\\ud800'}[where], 1)
    path = tmp_path / "s.itf.json"
    path.write_text(text)
    with pytest.raises(Rejection) as err:
        load_trace(path)
    assert err.value.code == "trace.invalid_conformance_trace"
    assert err.value.path == {"stop_strings": "$.#meta.config.stop_strings[0]", "policy_key": "$.#meta.config.policy",
                              "description": "$.#meta.description"}[where]
    assert meta  # the source is untouched


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"{\"#meta\": {\"format\": \"\xc3\x28\"}}", b"[" * 100_000, b""])
def test_bytes_that_are_not_utf8_json_are_refused(tmp_path, content) -> None:
    path = tmp_path / "b.itf.json"
    path.write_bytes(content)
    with pytest.raises(Rejection) as err:
        load_trace(path)
    assert (err.value.code, err.value.path) == ("trace.invalid_conformance_trace", "$")


def test_the_cli_prints_each_refusal_as_json_with_exit_2(good, tmp_path) -> None:
    """The eight kinds of the report, in one process: no traceback, exit 2, the code and path on stderr."""
    paths = []
    for name in ("verdict_a_string", "verdict_without_result", "runtime_a_number", "actions_a_number", "device_a_list",
                 "id_above_2_53"):
        trace = copy.deepcopy(good)
        HOSTILE[name][0](trace)
        paths.append(str(_write(tmp_path, trace, f"{name}.itf.json")))
    raw = tmp_path / "raw.itf.json"
    raw.write_bytes(b"\xff" + SOURCE.read_bytes())
    surrogate = tmp_path / "surrogate.itf.json"
    surrogate.write_text(SOURCE.read_text().replace('"stop_strings": []', '"stop_strings": ["\\ud800"]', 1))
    paths += [str(raw), str(surrogate)]
    done = _cli("replay", *paths)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    errors = [json.loads(line)["error"] for line in done.stderr.strip().splitlines()]
    assert len(errors) == len(paths)
    assert all(e["code"] == "trace.invalid_conformance_trace" and e["path"].startswith("$") for e in errors)


def test_every_corpus_trace_still_loads() -> None:
    for path in sorted((ROOT / "traces").glob("*.itf.json")):
        try:
            load_trace(path)
        except DecodeSpecError as exc:  # pragma: no cover - the failure message names the file
            pytest.fail(f"{path.name}: {exc}")
