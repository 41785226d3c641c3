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

from decodespec.checks.adapters import CAPABILITIES, AdapterUnavailable, CaseConfig, vllm
from decodespec.checks.adapters.vllm_engine import capabilities, sampling_fields
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
    from decodespec.checks.traces import check_runtime, open_runtime

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
              "def fake_serve(runtime, stdin, stdout, factory=None):\n"
              "    print('library log line')\n"
              "    os.write(1, b'native log line\\n')\n"
              "    stdout.write('PROTOCOL\\n')\n"
              "    return 0\n"
              "import decodespec.checks.stdio_server as s\n"
              "s.serve = fake_serve\n"
              f"sys.exit(vllm_engine.main(['--model-dir', {str(tmp_path)!r}, '--cache-dir', {str(tmp_path / 'c')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "PROTOCOL\n"
    assert "library log line" in proc.stderr and "native log line" in proc.stderr
