"""The engine route (``--runtime engine:CMD``): the gate's controller over a process that answers model calls only.

The worked example ``docs/examples/engine_tiny.py`` (an independent numpy Llama that imports
nothing from decodespec) reaches a clean gate run on the tiny model -- every case passes or is
skipped for a capability it honestly does not declare -- and a cache bug planted in it
(``ENGINE_TINY_BUG=cache_position``) fails at TENSOR, with a trace that ``decodespec replay``
reproduces only when the user names the command.  Every message both ways matches
``spec/schemas/engine.v1.json``.  A broken engine (a bad hello, a malformed or foreign answer,
an unregistered code, a hang, a dead process, an oversized line) is a typed
``adapter.protocol`` in bounded time, never a hang.

Source: issue 22 item 2 (a reusable controller: the runtime author writes the model calls).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from decodespec.checks.adapters import ADAPTER_PROTOCOL, CaseConfig, parse_runtime
from decodespec.checks.adapters import engine as engine_module
from decodespec.checks.adapters.engine import StdioEngine, _check
from decodespec.checks.gate.cases import cases_for, run_case
from decodespec.checks.modelcheck.traces import check_replay_runtime, open_runtime
from decodespec.spec.errors import DecodeSpecError, Rejection

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "engine_tiny.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine") / "tiny"
    proc = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", "export-tiny", "--out-dir", str(out)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return out


def _runtime(model_dir: Path) -> str:
    return f"engine:python {EXAMPLE} --model-dir {model_dir}"


def test_the_example_imports_nothing_from_decodespec() -> None:
    tree = ast.parse(EXAMPLE.read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "argparse", "json", "math", "os", "struct", "sys", "pathlib", "numpy"}, imported
    assert "decodespec" not in imported


def test_engine_is_a_command_runtime() -> None:
    assert parse_runtime("engine:python x.py --a b") == ("engine", "python x.py --a b")
    with pytest.raises(Rejection) as err:
        open_runtime("engine:", "tiny")
    assert err.value.code == ADAPTER_PROTOCOL


def test_every_message_matches_the_schema_both_ways(model_dir: Path) -> None:
    """A short greedy request with a chunked prefill, a cancel in flight and the K/V probe: every request the gate
    sends and every answer the example gives is valid engine.v1."""
    adapter = open_runtime(_runtime(model_dir), "tiny")
    sent, received = [], []
    engine = adapter.engine
    stdin, get = engine.process.stdin, engine.lines.get

    class Tee:
        def write(self, data: bytes) -> int:
            sent.append(json.loads(data))
            return stdin.write(data)

        def flush(self) -> None:
            stdin.flush()

        def close(self) -> None:
            stdin.close()

    def tee_get(*args, **kwargs):
        line = get(*args, **kwargs)
        if line is not None:
            received.append(json.loads(line))
        return line

    engine.process.stdin, engine.lines.get = Tee(), tee_get
    try:
        adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 72, 105, 33), max_new_tokens=3, eos_ids=(2,), prefill_chunk=2,
                                 cache="static", final_cache="all_outputs"))
        for action in ({"op": "prefill", "chunk": 2}, {"op": "step"}, {"op": "run"}):
            assert adapter.apply(action).ok, action
        obs = adapter.observe()
        assert obs.phase == "finished" and obs.cache_probe is not None and obs.cache_probe.shape[3] == obs.frontier["processed"]
        assert obs.text is not None and len(obs.output_ids) == 3
        adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 72), max_new_tokens=2))
        assert adapter.apply({"op": "launch"}).ok
        assert adapter.apply({"op": "cancel", "kind": "cancelled"}).ok
        assert adapter.apply({"op": "complete"}).data["selection"] == "ALL_OLD"
        assert adapter.observe().frontier["processed"] == 0  # rolled back by the engine
    finally:
        adapter.close()
    methods = [m["method"] for m in sent]
    _check("hello_result", engine.implementation, "$.result")  # the hello ran before the tee
    assert {"window", "start", "forward", "decide", "triggers", "text", "cache_probe", "rollback", "stop"} <= set(methods)
    for message in sent:
        _check("request", message, "$")
    by_id = {m["id"]: m["method"] for m in sent}
    for answer in received:
        _check("response", answer, "$")
        _check(f"{by_id[answer['id']]}_result", answer["result"], "$.result")
    assert len(received) == len(sent) - 1  # every request but the closing stop was awaited


def _fake(tmp_path: Path, body: str, name: str = "fake.py") -> str:
    """An engine script: ``hello`` answered with ``HELLO`` (overridable), the other methods by ``body``."""
    script = tmp_path / name
    script.write_text(textwrap.dedent("""\
        import json, sys, time
        HELLO = {"protocol": "decodespec.engine.v1", "name": "fake", "version": "0", "capabilities": ["cache:dynamic"], "methods": []}
        def answer(obj):
            sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
        for line in sys.stdin:
            req = json.loads(line)
            m, p, i = req["method"], req["params"], req["id"]
            if m == "stop":
                break
        """) + textwrap.indent(textwrap.dedent(body), "    "), encoding="utf-8")
    return f"python {script}"


_HELLO_OK = 'if m == "hello": answer({"id": i, "result": HELLO}); continue\n'


@pytest.mark.parametrize("body, needle", [
    ('answer({"id": i, "result": dict(HELLO, capabilities=["cache:dynamic", "warp_drive"])})', "unknown capabilities"),
    ('answer({"id": i, "result": dict(HELLO, capabilities=["snapshot"])})', "cannot declare ['snapshot']"),
    ('answer({"id": i, "result": dict(HELLO, capabilities=["cache_probe"])})', "needs the 'cache_probe' method"),
    ('answer({"id": i, "result": dict(HELLO, protocol="decodespec.engine.v0")})', "engine.v1.json#/$defs/hello_result"),
    ('answer({"id": i + 1, "result": HELLO})', "does not echo the request id"),
    ('sys.stdout.write("not json\\n"); sys.stdout.flush()', "not a JSON line"),
    ('answer([1, 2])', "$defs/response"),
    ('answer({"id": i, "error": {"code": "made.up", "message": "no"}})', "unregistered code 'made.up'"),
    ('sys.stderr.write("the model file is missing\\n"); sys.exit(3)', "the model file is missing"),
    ('time.sleep(30)', "no answer to 'hello' within 1 s"),
    ('sys.stdout.write("x" * 5000 + "\\n"); sys.stdout.flush()', "longer than 1000 bytes"),
])
def test_a_broken_hello_is_a_typed_protocol_error_in_bounded_time(tmp_path, monkeypatch, body: str, needle: str) -> None:
    monkeypatch.setattr(engine_module, "MAX_LINE_BYTES", 1000)
    begin = time.monotonic()
    with pytest.raises(Rejection) as err:
        StdioEngine(_fake(tmp_path, body), timeout=1.0)
    assert err.value.code == ADAPTER_PROTOCOL
    assert needle in err.value.message, err.value.message
    assert time.monotonic() - begin < 20


def test_engine_failures_during_a_request_are_typed(tmp_path) -> None:
    """A refusal at start is the engine's typed error (adapter.unsupported: the gate's skip); a process that dies in a
    forward is adapter.protocol with its stderr, and every later call too, at once."""
    body = _HELLO_OK + textwrap.dedent("""\
        if m == "window": answer({"id": i, "result": {"window": 64}}); continue
        if m == "start" and p["config"]["max_new_tokens"] == 7:
            answer({"id": i, "error": {"code": "adapter.unsupported", "message": "seven is unlucky"}}); continue
        if m == "start": answer({"id": i, "result": {"processed": 0, "physical": 0}}); continue
        if m == "forward": sys.stderr.write("segfault in attention\\n"); sys.exit(11)
        """)
    adapter = open_runtime("engine:" + _fake(tmp_path, body), "tiny")
    try:
        with pytest.raises(Rejection) as err:
            adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 2), max_new_tokens=7))
        assert err.value.code == "adapter.unsupported" and "seven is unlucky" in err.value.message
        adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 2), max_new_tokens=2))
        result = adapter.apply({"op": "step"})
        assert not result.ok and result.code == ADAPTER_PROTOCOL and "segfault in attention" in result.message
        begin = time.monotonic()
        again = adapter.apply({"op": "step"})
        assert not again.ok and again.code == ADAPTER_PROTOCOL and time.monotonic() - begin < 5
    finally:
        adapter.close()


def test_a_refused_config_is_a_skip_with_the_engines_reason(model_dir: Path) -> None:
    case = next(c for c in cases_for("tiny") if c.id == "matrix.sampled_lockstep")
    result = run_case(case, _runtime(model_dir))
    assert result.result == "skip" and "does not declare" in result.reason and "sampling" in result.reason


def _gate(model_dir: Path, tmp_path: Path, select: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(  # noqa: PLW1510 - the caller reads the exit code
        [sys.executable, "-m", "pytest", "checks/test_gate.py", "--model", "tiny", "--runtime",
         f"engine:python docs/examples/engine_tiny.py --model-dir {model_dir}", "-k", select, "-q", "-rs", "-p", "no:cacheprovider",
         "--trace-dir", str(tmp_path / "traces")],
        cwd=ROOT, capture_output=True, text=True, timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


#: A subset of the gate's table that exercises every part of the controller the example reaches (the full table on the
#: example: docs/adapters.md gives its time), plus cases it honestly skips.
CLEAN = ("no_cache_vs_dynamic or dynamic_vs_static or static_chunked_prefill or min_new_tokens_blocks_eos or zero_new_tokens "
         "or duplicate_stale_receipt or timeout_during_repair or static_reuse_shorter or prompt_at_max_length "
         "or sampled_lockstep or cancel_in_flight")


def test_the_example_reaches_a_clean_gate_run(model_dir: Path, tmp_path: Path) -> None:
    proc = _gate(model_dir, tmp_path, CLEAN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    skipped = int(re.search(r"(\d+) skipped", out).group(1))
    assert passed >= 11 and skipped >= 2 and " failed" not in out, out[-2000:]
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(reasons) == skipped and all("does not declare" in line for line in reasons), reasons


def test_a_planted_cache_bug_fails_at_tensor_and_replays(model_dir: Path, tmp_path: Path) -> None:
    proc = _gate(model_dir, tmp_path, "static_chunked_prefill or no_cache_vs_dynamic", {"ENGINE_TINY_BUG": "cache_position"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "2 failed" in out, out[-3000:]
    assert out.count("ladder.TENSOR") >= 2, out[-3000:]
    assert "committed K rows of layer 0 differ" in out  # the K/V probe names the first wrong layer
    traces = sorted((tmp_path / "traces").glob("engine_python*.itf.json"))
    assert len(traces) == 2 and all(" " not in t.name for t in traces)
    command = f"python docs/examples/engine_tiny.py --model-dir {model_dir}"
    replay = [sys.executable, "-m", "decodespec.checks.commands.cli", "replay", str(traces[0])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ENGINE_TINY_BUG": "cache_position"}
    refused = subprocess.run(replay, cwd=ROOT, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "trace.runtime_not_allowed" in refused.stdout + refused.stderr
    allowed = subprocess.run(replay + ["--allow-runtime", command], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert json.loads(allowed.stdout.splitlines()[0])["actual"]["layer"] == "TENSOR"


def test_replay_never_starts_an_engine_a_file_names() -> None:
    meta = {"runtime": "engine:touch /tmp/never"}
    with pytest.raises(DecodeSpecError) as err:
        check_replay_runtime(meta, None)
    assert err.value.code == "trace.runtime_not_allowed" and "engine:" in err.value.message
    assert check_replay_runtime(meta, None, ["touch /tmp/never"]) == "engine:touch /tmp/never"


# ----------------------------------------------------------------------------------------------
# The guide (docs/adapters.md "Write a runtime adapter") says what the code does
# ----------------------------------------------------------------------------------------------

GUIDE = (ROOT / "docs" / "adapters.md").read_text(encoding="utf-8")


def _table(heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after ``heading`` in the guide."""
    text = GUIDE[GUIDE.index(heading):]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([a-z_:.]+)`", cell))


def test_the_capability_table_is_generated() -> None:
    from decodespec.checks.adapters import OP_AND_PROBE_CAPABILITIES
    from decodespec.checks.adapters.engine import OP_AND_PROBE_MEANINGS, capabilities_markdown

    assert set(OP_AND_PROBE_MEANINGS) == OP_AND_PROBE_CAPABILITIES
    begin, end = "<!-- capabilities:begin -->\n", "<!-- capabilities:end -->"
    block = GUIDE[GUIDE.index(begin) + len(begin):GUIDE.index(end)]
    assert block == capabilities_markdown(), ("regenerate the table in docs/adapters.md: python -c \"from decodespec.checks."
                                              "adapters.engine import capabilities_markdown; print(capabilities_markdown())\"")


def test_the_guide_lists_every_engine_method_op_observation_and_config_field() -> None:
    import attrs

    from decodespec.checks.adapters import OPS, Observation

    methods = engine_module.engine_schema()["$defs"]["request"]["properties"]["method"]["enum"]
    assert [min(_names(r[0])) for r in _table("| method | params | result | meaning |")] == methods
    assert [min(_names(r[0])) for r in _table("| op | fields | meaning |")] == list(OPS)
    observed = set().union(*(_names(r[0]) for r in _table("| field | type | meaning |")))
    assert observed >= {f.name for f in attrs.fields(Observation)}  # every field (the guide may name one landing on main)
    configured = set().union(*(_names(r[0]) for r in _table("| field | meaning |\n| --- | --- |\n| `model`")))
    assert configured == {f.name for f in attrs.fields(CaseConfig)}
    optional = {min(_names(r[0])) for r in _table("| left out | default | consequence |")}
    assert optional == set(engine_module.OPTIONAL_METHODS)


def test_an_engine_without_optional_methods_gets_the_contracts_defaults(tmp_path) -> None:
    """No triggers / text / cache_probe: the envelope's EOS / length / context rules fire, the text and K/V rows are not
    exposed."""
    body = _HELLO_OK + textwrap.dedent("""\
        if m == "window": answer({"id": i, "result": {"window": 6}}); continue
        if m == "start": n = 0; answer({"id": i, "result": {"processed": 0, "physical": 0}}); continue
        if m == "forward":
            n = p["start"] + p["length"]
            answer({"id": i, "result": {"logits": [0.0] * 8, "processed": n, "physical": n}}); continue
        if m == "decide":
            answer({"id": i, "result": {"token_id": 2 if p["output_count"] == 1 else 5}}); continue
        """)
    adapter = open_runtime("engine:" + _fake(tmp_path, body), "tiny")
    try:
        assert adapter.capabilities() >= {"cache:dynamic", "decide_commit", "inflight", "logits"}
        for eos, cap, want, count in (((2,), None, ["eos"], 2), ((), None, ["length"], 3), ((), 4, ["context_length"], 2)):
            adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 7), max_new_tokens=3, eos_ids=eos, context_cap=cap))
            assert adapter.apply({"op": "run"}).ok
            obs = adapter.observe()
            assert (obs.phase, list(obs.triggers), len(obs.output_ids)) == ("finished", want, count)
            assert obs.text is None and obs.cache_probe is None and obs.support_ids is None
    finally:
        adapter.close()


def test_the_timeout_comes_from_the_environment(tmp_path, monkeypatch) -> None:
    body = _HELLO_OK + 'if m == "window": time.sleep(30)\n'
    command = "engine:" + _fake(tmp_path, body)
    monkeypatch.setenv(engine_module.TIMEOUT_ENV, "1.5")
    adapter = open_runtime(command, "tiny")
    try:
        begin = time.monotonic()
        with pytest.raises(Rejection) as err:
            adapter.reset(CaseConfig(model="tiny", prompt_ids=(1, 2)))
        assert err.value.code == ADAPTER_PROTOCOL and "no answer to 'window' within 1.5 s" in err.value.message
        assert time.monotonic() - begin < 15
    finally:
        adapter.close()
    for bad in ("soon", "0", "nan", "-1"):
        monkeypatch.setenv(engine_module.TIMEOUT_ENV, bad)
        with pytest.raises(Rejection) as err:
            open_runtime(command, "tiny")
        assert err.value.code == ADAPTER_PROTOCOL and "$.timeout" == err.value.path
