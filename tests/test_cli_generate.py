"""``decodespec generate`` (and ``decodespec bench --help``) through ``decodespec.checks.commands.cli.main``.

Source: docs/design.md section 8 (runtime outputs: ``--json`` prints at least prompt_ids,
output_ids, text, logprobs, finish_reason, triggers, frontier).
"""

from __future__ import annotations

import json

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.testing import requires_smollm2
from decodespec.impl.generate import greedy_generate

JSON_KEYS = {"prompt_ids", "output_ids", "text", "logprobs", "finish_reason", "triggers", "frontier"}


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_works(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: decodespec {command}" in out
    assert "--dtype" in out and "--device" in out


def test_generate_is_registered_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out


def test_tiny_plain_prints_the_greedy_text(capsys, tiny_model, byte_tokenizer):
    assert main(["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    expected = greedy_generate(tiny_model, [1, *byte_tokenizer.encode("hello")], max_new_tokens=12, tokenizer=byte_tokenizer)
    assert capsys.readouterr().out == expected.text + "\n"


def test_tiny_json_has_the_contract_keys(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "5", "--seed", "7", "--device", "cpu", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(payload)
    assert payload["prompt_ids"] == [1, ord("h") + 3, ord("i") + 3]  # BOS + bytes
    assert len(payload["output_ids"]) == len(payload["logprobs"]) <= 5
    assert payload["seed"] == 7 and payload["model"] == "tiny" and payload["device"] == "cpu"
    assert payload["frontier"]["prompt_len"] == 3


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--max-new-tokens", "-1"], "envelope.out_of_range"),  # the flags become an envelope, admitted first
        (["--dtype", "float64"], "runtime.invalid_dtype"),
        (["--device", "tpu"], "runtime.invalid_device"),
    ],
)
def test_invalid_input_exits_2_with_a_typed_error(capsys, argv, code):
    assert main(["generate", "--model", "tiny", "--prompt", "x", *argv]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == code


def test_missing_model_file_exits_3(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DECODESPEC_SMOLLM2_GGUF", str(tmp_path / "absent.gguf"))
    assert main(["generate", "--model", "smollm2", "--prompt", "x", "--device", "cpu"]) == 3
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "model.file_missing"


@requires_smollm2
@pytest.mark.smollm2
def test_smollm2_chat_answers_paris(capsys, smollm2_model):
    # smollm2_model is requested so the weights are already dequantized in this process.
    argv = ["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--device", "cpu"]
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(payload)
    assert "Paris" in payload["text"]
    assert payload["prompt_ids"][0] == 1  # <|im_start|> opens the chat template (id 1)
    assert payload["finish_reason"] in ("eos", "length")
    if payload["finish_reason"] == "eos":
        assert payload["output_ids"][-1] == 2 and "<|im_end|>" not in payload["text"]


def test_an_empty_support_finishes_with_constraint_error_and_writes_the_trace(tmp_path, capsys):
    """M3.10 0x02 branch table (constraint/parser error is a typed terminal finish): a constraint that allows only
    "ab" empties the legal set at the third decision; generate exits 0 with finish_reason constraint_error, keeps
    both tokens, and writes a trace that validate-trace accepts."""
    from pathlib import Path

    envelope = json.loads((Path(__file__).resolve().parent.parent / "docs" / "examples" / "tiny.request.json").read_text())
    forced = [ord("a") + 3, ord("b") + 3]  # the byte tokenizer's ids (3 special ids first)
    states = {"s0": {str(forced[0]): "s1"}, "s1": {str(forced[1]): "s2"}, "s2": {}}
    envelope["policy"] = {"family": "greedy", "transforms": [{"name": "constraint", "automaton": {"initial": "s0", "transitions": states}}]}
    envelope["termination"].update(stop_strings=[], min_new_tokens=0)
    request, trace = tmp_path / "r.json", tmp_path / "t.ndjson"
    request.write_text(json.dumps(envelope))
    assert main(["generate", "--model", "tiny", "--request", str(request), "--trace", str(trace), "--device", "cpu", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    payload = json.loads(lines[-1])
    assert payload["finish_reason"] == "constraint_error" and payload["output_ids"] == forced and len(payload["logprobs"]) == 2
    events = [json.loads(line)["event"] for line in trace.read_text().splitlines()]
    assert events[-2:] == ["empty_support", "finish"]
    assert main(["validate-trace", str(trace)]) == 0
