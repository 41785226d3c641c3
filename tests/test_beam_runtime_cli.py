"""``decodespec generate --num-beams K`` on the tiny model: output contract, parameters, refusals, trace.

The SmolLM2 command is compared with HF transformers in ``test_beam_hf.py``.
"""

from __future__ import annotations

import json

import pytest

from decodespec.checks.commands.cli import main
from decodespec.impl.beam import beam_generate
from decodespec.impl.events import read_events
from decodespec.spec import beam as B

BEAM_KEYS = {"prompt_ids", "output_ids", "text", "logprobs", "score", "sum_logprobs", "finish_reason", "triggers",
             "frontier", "beams", "stop", "num_beams", "beam_params", "identity", "policy", "cache", "suspended"}
HYP_KEYS = {"output_ids", "text", "score", "sum_logprobs", "length", "finish_reason", "triggers", "ancestry", "logprobs",
            "branch_hash"}


def generate_json(capsys, *flags: str) -> dict:
    assert main(["generate", "--model", "tiny", "--prompt", "Hello", "--device", "cpu", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("early", ["true", "false", "never", "exact"])
def test_json_has_the_best_hypothesis_and_every_completed_beam(capsys, tiny_model, early):
    """The best hypothesis is `output_ids` with its `score` (HF's sequence score sum / |y|**alpha);
    `beams` lists every kept completed hypothesis best first; the runtime's answer is the runner's
    for the same prompt and parameters (HF's set, or the normative one for `exact`)."""
    payload = generate_json(capsys, "--num-beams", "3", "--max-new-tokens", "6", "--length-penalty", "0.5",
                            "--early-stopping", early)
    assert BEAM_KEYS <= set(payload) and payload["num_beams"] == 3 and payload["policy"]["family"] == "beam"
    beams = payload["beams"]
    assert beams and all(HYP_KEYS <= set(h) for h in beams)
    assert payload["output_ids"] == beams[0]["output_ids"] and payload["score"] == beams[0]["score"]
    assert [h["score"] for h in beams] == sorted((h["score"] for h in beams), reverse=True)
    for h in beams:
        assert h["score"] == pytest.approx(h["sum_logprobs"] / h["length"] ** 0.5, rel=1e-12)
        assert len(h["output_ids"]) == len(h["logprobs"]) == len(h["ancestry"]) == h["length"]
        assert h["finish_reason"] in ("eos", "length")
    if early == "exact":
        params = B.BeamParams(3, 6, [2], length_penalty=B.LengthPenalty(0.5), early_stop="exact")
    else:
        params = B.BeamParams.hf_compatible(3, 6, [2], length_penalty=0.5, early_stopping={"true": True, "false": False}.get(early, early))
    assert payload["beam_params"] == params.to_json()
    direct = beam_generate(tiny_model, payload["prompt_ids"], params, identity=payload["identity"])
    assert [h.output_ids for h in direct.hypotheses] == [tuple(h["output_ids"]) for h in beams]
    assert [h.branch_hash for h in direct.hypotheses] == [h["branch_hash"] for h in beams]


def test_plain_mode_prints_the_best_text(capsys):
    payload = generate_json(capsys, "--num-beams", "2", "--max-new-tokens", "5")
    assert main(["generate", "--model", "tiny", "--prompt", "Hello", "--device", "cpu", "--num-beams", "2",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == payload["text"] + "\n"


def test_trace_and_cache_flags(capsys, tmp_path):
    """--trace writes request (with the beam parameters), one beam_step per step and finish;
    --cache static and --prefill-chunk give the same beams as the default dynamic cache."""
    trace = tmp_path / "beam.ndjson"
    payload = generate_json(capsys, "--num-beams", "2", "--max-new-tokens", "5", "--trace", str(trace))
    records = [json.loads(line) for line in read_events(trace)]
    assert [r["event"] for r in records] == ["request"] + ["beam_step"] * (len(records) - 2) + ["finish"]
    assert records[0]["beam"] == payload["beam_params"] and records[-1]["finish_reason"] == payload["finish_reason"]
    static = generate_json(capsys, "--num-beams", "2", "--max-new-tokens", "5", "--cache", "static", "--prefill-chunk", "2")
    assert [h["output_ids"] for h in static["beams"]] == [h["output_ids"] for h in payload["beams"]]
    assert static["cache"] == "static"


def test_a_beam_request_envelope_runs_the_beam_runtime(capsys, tmp_path):
    """--request FILE with a beam-family policy (the envelope's identity heads the branch hashes)."""
    import argparse

    from decodespec.checks.commands.generate import envelope_from_flags, register
    from decodespec.impl.tiny import TINY_VOCAB_SIZE, load_tiny
    from decodespec.impl.tokenizer import ByteTokenizer

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "tiny", "--prompt", "Hello", "--num-beams", "2", "--max-new-tokens", "4",
                              "--early-stopping", "exact"])
    envelope = envelope_from_flags(args, load_tiny(device="cpu"), ByteTokenizer(TINY_VOCAB_SIZE))
    assert envelope["policy"]["family"] == "beam" and envelope["policy"]["early_stopping"] == "exact"
    path = tmp_path / "req.json"
    path.write_text(json.dumps(envelope))
    assert main(["generate", "--model", "tiny", "--request", str(path), "--device", "cpu", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    from_flags = generate_json(capsys, "--num-beams", "2", "--max-new-tokens", "4", "--early-stopping", "exact")
    assert from_file["identity"] == from_flags["identity"] and from_file["beams"] == from_flags["beams"]


@pytest.mark.parametrize("flags, code", [
    (["--num-beams", "2", "--do-sample"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--stream"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--snapshot", "x.json"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--resume", "x.json"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--stop", "a"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--json-mode"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--repair"], "runtime.beam_unsupported"),
    (["--num-beams", "2", "--temperature", "0.7"], "policy.warper_requires_sampling"),
    (["--num-beams", "0"], "envelope.out_of_range"),
    (["--num-beams", "17"], "envelope.too_many_beams"),
    (["--length-penalty", "2"], "policy.invalid_parameter"),
    (["--early-stopping", "exact"], "policy.invalid_parameter"),
    (["--num-beams", "2", "--max-new-tokens", "0"], "runtime.invalid_request"),
])
def test_combinations_that_cannot_be_honoured_are_typed_errors(capsys, flags, code):
    assert main(["generate", "--model", "tiny", "--prompt", "Hello", "--device", "cpu", *flags]) == 2
    err = json.loads(capsys.readouterr().err)["error"]
    assert err["code"] == code, err
