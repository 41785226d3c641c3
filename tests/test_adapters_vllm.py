"""The vLLM runtime's parts that run without vLLM: the policy -> ``SamplingParams`` mapping, the declared
capabilities, the skip reason, the runtime's registration, and the server's protocol channel.

The judgement of vLLM itself is the gate's (``pytest checks/ --runtime vllm --model smollm2``,
docs/results/vllm.jsonl); these tests keep what the adapter sends honest on a machine without vLLM.

Source: issue 18; :mod:`decodespec.checks.adapters.vllm`, :mod:`decodespec.checks.adapters.vllm_engine`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decodespec.checks.adapters import CAPABILITIES, AdapterUnavailable, CaseConfig, Observation, vllm
from decodespec.checks.adapters.vllm_engine import capabilities, sampling_fields
from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.spec.errors import DecodeSpecError, Rejection


def _config(**policy) -> CaseConfig:
    return CaseConfig(model="smollm2", prompt_ids=(504, 3575, 282), max_new_tokens=4, eos_ids=(2,), seed=7, policy=policy)


def test_declared_capabilities_are_protocol_names() -> None:
    caps = capabilities()
    assert caps <= CAPABILITIES
    assert {"cache:dynamic", "logits", "sampling", "stop_strings", "transform:top_k", "transform:logit_bias"} <= caps
    # what vLLM cannot do through its engine is never declared
    assert not caps & {"cache:none", "cache:static", "prefill_chunk", "snapshot", "reuse", "policy_rows", "beam", "stream",
                       "transform:typical", "transform:bad_words", "transform:constraint", "termination.max_total_tokens"}


def test_greedy_is_temperature_zero_and_takes_no_seed() -> None:
    fields = sampling_fields(_config(family="greedy", transforms=[{"name": "presence_penalty", "penalty": 0.5}]))
    assert fields == {"temperature": 0.0, "presence_penalty": 0.5}


def test_sampling_maps_each_transform_to_its_field() -> None:
    fields = sampling_fields(_config(family="multinomial", transforms=[
        {"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}, {"name": "top_p", "p": 0.9},
        {"name": "min_p", "p": 0.05}, {"name": "presence_penalty", "penalty": 0.5}, {"name": "logit_bias", "bias": {"13": 2.5}},
        {"name": "repetition_penalty", "penalty": 1.3}]))
    assert fields == {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
                      "logit_bias": {13: 2.5}, "repetition_penalty": 1.3, "seed": 7}


@pytest.mark.parametrize("transform", [
    {"name": "typical", "p": 0.9},
    {"name": "bad_words", "sequences": [[13]]},
    {"name": "repetition_penalty", "penalty": 1.3, "history": "output"},
])
def test_what_vllm_has_no_field_for_is_refused(transform: dict) -> None:
    with pytest.raises(Rejection) as exc:
        sampling_fields(_config(family="multinomial", transforms=[transform]))
    assert exc.value.code == "adapter.unsupported"


def test_a_policy_the_schema_refuses_keeps_its_code() -> None:
    with pytest.raises(DecodeSpecError) as exc:
        sampling_fields(_config(family="multinomial", transforms=[{"name": "top_k", "k": 0}]))
    assert exc.value.code.startswith("policy.")


def test_without_the_vllm_environment_the_runtime_is_a_skip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from decodespec.checks.modelcheck.traces import check_runtime, open_runtime

    monkeypatch.setenv("DECODESPEC_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    reason = vllm.available()
    assert reason is not None and "DECODESPEC_VLLM=1 .ci/setup" in reason
    check_runtime("vllm")  # the name is known: the gate starts, its cases skip
    with pytest.raises(AdapterUnavailable, match="vLLM is not installed"):
        open_runtime("vllm", "smollm2")


def test_server_keeps_stdout_for_the_protocol(tmp_path: Path) -> None:
    """The server moves fd 1 to stderr: a library print never reaches the protocol channel (vLLM logs to stdout)."""
    script = ("import os, sys\n"
              "from decodespec.checks.adapters import vllm_engine\n"
              "def fake_serve(runtime, stdin, stdout, factory=None, extra=None):\n"
              "    print('library log line')\n"
              "    os.write(1, b'native log line\\n')\n"
              "    stdout.write('PROTOCOL\\n')\n"
              "    return 0\n"
              "import decodespec.checks.adapters.stdio_server as s\n"
              "s.serve = fake_serve\n"
              f"sys.exit(vllm_engine.main(['--model-dir', {str(tmp_path)!r}, '--cache-dir', {str(tmp_path / 'c')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "PROTOCOL\n"
    assert "library log line" in proc.stderr and "native log line" in proc.stderr


# --------------------------------------------------------------------------------------------
# Prompt logprobs (M3.10 0x02) and the bench hook (M3.10 0x0BA), issue 19: what the adapter makes of
# vLLM's answers, and the two servers' protocol, with stand-ins for vLLM (it is not installed here).
# --------------------------------------------------------------------------------------------


def _lp(logprob: float, rank: int):
    from types import SimpleNamespace

    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=None)


def _vllm_prompt_logprobs():
    """vLLM's shape for prompt [5, 7, 9] with prompt_logprobs=2: None, then {x_i, top-1, top-2}; x_2 = 9 is top-1."""
    return [None,
            {7: _lp(-4.0, 6), 3: _lp(-0.5, 1), 4: _lp(-1.5, 2)},   # x_1 = 7 not in the top 2: k + 1 keys, its true rank 6
            {9: _lp(-0.25, 1), 2: _lp(-2.0, 2)}]                  # x_2 = 9 is top-1: k keys, the top-k entry overwrote it


@pytest.mark.parametrize("first", ["none", "omitted"])
def test_prompt_entries_keep_vllm_values_and_order_the_top_k_by_rank(first: str) -> None:
    from decodespec.checks.adapters.vllm_engine import prompt_entries
    from decodespec.spec.prompt_logprobs import PromptLogprob, PromptLogprobsSpec, prompt_logprobs_aligned

    spec = PromptLogprobsSpec(first_token=first, top_k=2)
    entries = prompt_entries([5, 7, 9], _vllm_prompt_logprobs(), spec)
    want = [PromptLogprob(1, 7, -4.0, 6, ((3, -0.5), (4, -1.5))), PromptLogprob(2, 9, -0.25, 1, ((9, -0.25), (2, -2.0)))]
    assert entries == ([PromptLogprob(0, 5)] if first == "none" else []) + want
    assert prompt_logprobs_aligned([5, 7, 9], spec, entries)


def test_prompt_entries_with_top_k_zero_hold_the_token_only() -> None:
    from decodespec.checks.adapters.vllm_engine import prompt_entries
    from decodespec.spec.prompt_logprobs import PromptLogprob, PromptLogprobsSpec

    entries = prompt_entries([5, 7], [None, {7: _lp(-3.0, 4)}], PromptLogprobsSpec(top_k=0))
    assert entries == [PromptLogprob(0, 5), PromptLogprob(1, 7, -3.0, 4, ())]


@pytest.mark.parametrize("vllm_entries", [
    [None, {7: _lp(-3.0, 4)}, {9: _lp(-1.0, 1)}],        # one entry more than the prompt
    [{5: _lp(-1.0, 1)}, {7: _lp(-3.0, 4)}],              # no leading None
    [None, {8: _lp(-3.0, 4)}],                           # the prompt id is missing
    [None, {7: _lp(-3.0, 4), 3: _lp(-0.5, 1), 4: _lp(-1.5, 1)}],  # top-k ranks 1, 1
])
def test_prompt_entries_refuse_what_is_not_vllm_shape(vllm_entries) -> None:
    from decodespec.checks.adapters.vllm_engine import prompt_entries
    from decodespec.spec.prompt_logprobs import PromptLogprobsSpec

    with pytest.raises(AssertionError):
        prompt_entries([5, 7], vllm_entries, PromptLogprobsSpec(top_k=2 if len(vllm_entries[-1] or {}) == 3 else 0))


def test_the_logprobs_mode_decides_logits_or_prompt_logprobs() -> None:
    raw, default = capabilities("raw_logits"), capabilities("raw_logprobs")
    assert "logits" in raw and "output.prompt_logprobs" not in raw
    assert "output.prompt_logprobs" in default and "logits" not in default
    assert raw - {"logits"} == default - {"output.prompt_logprobs"} and default <= CAPABILITIES
    with pytest.raises(ValueError):
        capabilities("processed_logprobs")


def test_server_command_names_mode_and_threads_only_when_not_the_defaults() -> None:
    assert "--logprobs-mode" not in vllm.server_command() and "--threads" not in vllm.server_command()
    assert vllm.server_command("raw_logprobs", threads=3)[-4:] == ["--logprobs-mode", "raw_logprobs", "--threads", "3"]


_FAKE_SERVER = '''
import json, sys
from decodespec.checks.adapters.stdio_server import serve
from decodespec.checks.adapters.vllm_engine import bench_command
from decodespec.spec.errors import Rejection
from decodespec.spec.latency import CallTiming, Emission, Timeline
from decodespec.spec.prompt_logprobs import PromptLogprob

with open(sys.argv[-1] if False else {log!r}, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")

class Engine:
    def bench(self, prompt_ids, new_tokens):
        calls = [CallTiming("prefill", len(prompt_ids), 0, 4000)]
        calls += [CallTiming("decode", 1, 5000 + 2000 * i, 6000 + 2000 * i) for i in range(new_tokens - 1)]
        emissions = [Emission(4500 + 2000 * i, i + 1) for i in range(new_tokens)]
        return [11] * new_tokens, Timeline(prompt_len=len(prompt_ids), calls=tuple(calls), emissions=tuple(emissions),
                                           final_ns=emissions[-1].t_ns + 100)

class Adapter:
    name = "vllm"
    engine = Engine()
    def capabilities(self):
        return frozenset({{"cache:dynamic"}} | ({{"output.prompt_logprobs"}} if "raw_logprobs" in sys.argv else set()))
    def prompt_logprobs(self, config, spec):
        if config.prompt_ids[0] == 0:
            raise Rejection("adapter.unsupported", "no prompt logprobs for id 0", "$")
        return [PromptLogprob(0, config.prompt_ids[0])] + [PromptLogprob(i, t, -0.5 * i, i, tuple((t, -0.5 * i) for _ in range(0)))
                                                            for i, t in enumerate(config.prompt_ids) if i]
    def close(self):
        pass

sys.exit(serve("vllm", sys.stdin, sys.stdout, factory=Adapter, extra={{"bench": bench_command}}))
'''


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stand-in for .venv-vllm: a 'python' that runs a protocol server with a fake engine, whatever module it is asked for."""
    import decodespec.impl.gguf

    log = tmp_path / "argv.log"
    (tmp_path / "server.py").write_text(_FAKE_SERVER.format(log=str(log)))
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'server.py'} \"$@\"\n")
    python.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # a converted model: convert_smollm2 keeps it
        (model / name).write_text("")
    monkeypatch.setenv("DECODESPEC_VLLM_PYTHON", str(python))
    monkeypatch.setenv("DECODESPEC_VLLM_MODEL_DIR", str(model))
    monkeypatch.setattr(decodespec.impl.gguf, "smollm2_available", lambda: True)
    yield log
    vllm._stop_all()
    vllm._PROMPT_SERVER.clear()


def test_bench_runner_returns_ids_and_the_timeline_timed_in_the_server(fake_vllm: Path) -> None:
    from decodespec.checks.commands.bench import PEER_HOOKS, find_peers
    from decodespec.spec.latency import request_latency

    found, absent = find_peers({"vllm": PEER_HOOKS["vllm"]})
    assert absent == {} and found["vllm"] is vllm.bench_runner
    run = vllm.bench_runner([1, 2, 3, 4], 5, 3)
    assert run.out_of_process  # the bench takes no CPU-time figure of it
    ids, timeline = run()
    assert ids == (11,) * 5
    lat = request_latency(timeline)
    assert (lat.prefill_calls, lat.decode_calls, lat.prefill_rows, lat.tokens_delivered) == (1, 4, 4, 5)
    assert lat.ttft_ns == 4500 and lat.itl_ns == (2000,) * 4 and lat.prefill_tokens_per_s == pytest.approx(4 / 4e-6)
    argv = [line for line in fake_vllm.read_text().splitlines()]
    assert len(argv) == 1 and '"--logprobs-mode", "raw_logprobs", "--threads", "3"' in argv[0]


def test_bench_runner_reports_a_refused_run_as_a_protocol_error(fake_vllm: Path) -> None:
    run = vllm.bench_runner([], 5, 1)  # the server validates the request: no prompt
    with pytest.raises(Rejection) as exc:
        run()
    assert exc.value.code == "adapter.protocol" and "prompt_ids" in exc.value.message


def test_without_vllm_the_bench_names_it_absent_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from decodespec.checks.commands.bench import PEER_HOOKS, find_peers

    monkeypatch.setenv("DECODESPEC_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    found, absent = find_peers({"vllm": PEER_HOOKS["vllm"]})
    assert found == {} and "DECODESPEC_VLLM=1 .ci/setup" in absent["vllm"]
    with pytest.raises(ImportError, match="vLLM is not installed"):
        vllm.bench_runner([1, 2], 2, 1)


def test_vllm_adapter_asks_the_raw_logprobs_server_for_prompt_logprobs(fake_vllm: Path) -> None:
    from decodespec.spec.prompt_logprobs import PromptLogprob, PromptLogprobsSpec

    adapter = vllm.create()
    assert "output.prompt_logprobs" not in adapter.server.capabilities() and "output.prompt_logprobs" in adapter.capabilities()
    config = CaseConfig(model="smollm2", prompt_ids=(4, 8, 15), max_new_tokens=2, eos_ids=(2,))
    entries = adapter.prompt_logprobs(config, PromptLogprobsSpec())
    assert entries == (PromptLogprob(0, 4), PromptLogprob(1, 8, -0.5, 1, ()), PromptLogprob(2, 15, -1.0, 2, ()))
    with pytest.raises(Rejection) as exc:  # the server's typed refusal comes back typed
        adapter.prompt_logprobs(config.evolve(prompt_ids=(0, 1)), PromptLogprobsSpec())
    assert exc.value.code == "adapter.unsupported"
    adapter.close()
    argv = fake_vllm.read_text().splitlines()
    assert len(argv) == 2 and "raw_logprobs" not in argv[0] and "raw_logprobs" in argv[1]  # lock-step server, then the prompt one


@pytest.mark.parametrize("answer, where", [
    ({"x": 1}, "$.prompt_logprobs"),
    ([{"position": 1, "token_id": 3, "logprob": -1.0, "rank": 2, "top": [{"token_id": 3, "logprob": -1.0, "rank": 2}]}],
     "$.prompt_logprobs[0].top"),
    ([{"position": 1, "token_id": 3, "logprob": "low", "rank": 2, "top": None}], "$.prompt_logprobs[0].logprob"),
])
def test_wire_refuses_a_malformed_prompt_logprobs_answer(answer, where: str) -> None:
    from decodespec.checks.adapters.wire import prompt_logprobs_from_json

    with pytest.raises(Rejection) as exc:
        prompt_logprobs_from_json(answer)
    assert exc.value.code == "adapter.protocol" and exc.value.path.startswith(where)


def test_expectations_declare_vllm_first_token_policy_as_the_adapter_returns_it() -> None:
    """``[prompt_logprobs]`` of checks/gate/expectations/vllm.toml names vLLM's own policy: its list starts with ``None``."""
    import tomllib

    from decodespec.checks.adapters.vllm_engine import prompt_entries
    from decodespec.checks.gate.cases import EXPECTATIONS_DIR
    from decodespec.spec.prompt_logprobs import FirstTokenPolicy, PromptLogprobsSpec

    declared = tomllib.loads((EXPECTATIONS_DIR / "vllm.toml").read_text(encoding="utf-8"))["prompt_logprobs"]
    policy = FirstTokenPolicy(declared["first_token"])
    entries = prompt_entries([5, 7, 9], _vllm_prompt_logprobs(), PromptLogprobsSpec(first_token=policy, top_k=2))
    assert len(entries) == 3 and entries[0].logprob is None  # vLLM's L entries, x_0 unscored: policy none


@pytest.mark.skipif(vllm.available() is not None, reason=f"needs the real vLLM: {vllm.available()}")
def test_bench_runner_on_real_vllm_times_one_prefill_and_g_minus_1_decodes_of_our_greedy_ids() -> None:
    """With .venv-vllm built: vLLM's timed run makes the calls a conforming cached run makes (1 prefill of L rows,
    G - 1 decodes), delivers G tokens one emission each, and its greedy ids are our runtime's (SmolLM2, float32)."""
    from decodespec.impl.generate import generate
    from decodespec.impl.weights import load_smollm2
    from decodespec.spec.latency import expected_calls, request_latency

    prompt = [1, 4093, 198, 19556, 665, 2, 198, 1, 520, 9531, 198]  # the gate's SmolLM2 prompt-logprobs prompt
    run = vllm.bench_runner(prompt, 4, 1)
    try:
        ids, timeline = run()
    finally:
        vllm._stop_all()
    lat = request_latency(timeline)
    calls = expected_calls(len(prompt), 4)
    assert (lat.prefill_calls, lat.decode_calls, lat.prefill_rows) == (calls["prefill"], calls["decode"], len(prompt))
    assert lat.tokens_delivered == 4 and len(lat.itl_ns) == 3 and lat.ttft_ns > 0
    ours = generate(load_smollm2(), prompt, max_new_tokens=4, eos_token_ids=())
    assert ids == tuple(ours.output_ids)


class _StandInLLM:
    """vLLM's ``LLM`` as far as the vocabulary reader asks it: ``get_tokenizer()`` (vLLM serves an HF tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def get_tokenizer(self):
        self.calls += 1
        return self.tokenizer


@requires_hf
@requires_smollm2
def test_vllm_reports_the_ordered_vocabulary_hash_of_its_tokenizer_and_a_permuted_one_fails_state(monkeypatch) -> None:
    """M3.8 0x08: the vLLM engine reads its own tokenizer's ordered table; STATE compares its hash with the checkpoint's."""
    from decodespec.checks.adapters.hf import hf_tokenizer
    from decodespec.checks.adapters.peer import peer_vocab_hash
    from decodespec.checks.adapters.vllm_engine import VllmEngine
    from decodespec.checks.adapters.wire import observation_from_json, observation_to_json
    from decodespec.checks.gate.ladder import Expected, check_state
    from decodespec.checks.gate.tolerance import Tolerance
    from decodespec.checks.gate.vocab_check import reference_vocab

    ref = reference_vocab("smollm2")
    config = CaseConfig(model="smollm2", prompt_ids=(1, 504, 3), max_new_tokens=1, eos_ids=(2,))
    engine = VllmEngine(Path("unused"))
    engine.llm = _StandInLLM(hf_tokenizer("smollm2"))  # the engine is built; only its tokenizer is read
    assert peer_vocab_hash(engine, config) == ref.vocab_hash
    assert peer_vocab_hash(engine, config) == ref.vocab_hash and engine.llm.calls == 1  # read once per engine
    assert engine.vocab_table(config.evolve(model="tiny")) is None
    # the hash travels the stdio protocol in the observation and STATE judges it
    expected = Expected(tolerance=Tolerance.from_logit(0.0, 0.0), phase="ready", output_ids=(), vocab_hash=ref.vocab_hash,
                        vocab_rows=ref.output_rows)
    obs = observation_from_json(observation_to_json(Observation(phase="ready", output_ids=(), vocab_hash=peer_vocab_hash(engine, config),
                                                                vocab_rows=ref.output_rows)))
    assert check_state(expected, obs) is None
    # a vLLM whose tokenizer swaps ids 500 and 501: same size, another identity -- STATE vocab.hash
    tok = hf_tokenizer("smollm2")
    real = type(tok).convert_ids_to_tokens
    monkeypatch.setattr(type(tok), "convert_ids_to_tokens",
                        lambda self, ids, *a, **k: real(self, [{500: 501, 501: 500}.get(i, i) for i in ids], *a, **k))
    swapped = VllmEngine(Path("unused"))
    swapped.llm = _StandInLLM(tok)
    bad = peer_vocab_hash(swapped, config)
    monkeypatch.undo()
    assert bad != ref.vocab_hash
    verdict = check_state(expected, Observation(phase="ready", output_ids=(), vocab_hash=bad, vocab_rows=ref.output_rows))
    assert verdict is not None and (verdict.layer, verdict.check) == ("STATE", "vocab.hash")
