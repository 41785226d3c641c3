"""``decodespec generate`` stop / stream / structured flags and ``decodespec validate-trace`` on stream traces.

Flags: ``--stop STR`` (repeatable), ``--include-stop``, ``--align {token,text,span}``,
``--min-new-tokens N``, ``--json-mode``, ``--stream`` (plain: chunks as published; with
``--json``: one JSON line per chunk, then the result object).  Every flag reaches the admitted
envelope (its identity changes) and the controller; traces written with ``--trace`` are accepted
by ``validate-trace`` (which loads the header's tokenizer for the stream-content checks).

Source: docs/design.md section 8 (runtime outputs: "streams add per-chunk lines"); M3.10 0x06.
"""

from __future__ import annotations

import itertools
import json

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.testing import requires_smollm2

CHUNK_KEYS = ["chunk_idx", "text", "byte_start", "byte_end", "token_start", "token_end"]
BASE = ["generate", "--model", "tiny", "--prompt", "trace", "--max-new-tokens", "12", "--device", "cpu"]


def _generate(capsys, *flags: str) -> tuple[list[dict], dict]:
    """Run ``generate --json`` with ``flags``; return (chunk lines, result object)."""
    assert main([*BASE, "--json", *flags]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return lines[:-1], lines[-1]


@pytest.fixture(scope="module")
def free_text(tiny_model, byte_tokenizer):
    from decodespec.impl.generate import generate

    return generate(tiny_model, [1, *byte_tokenizer.encode("trace")], max_new_tokens=12, tokenizer=byte_tokenizer).text


def test_stream_json_prints_one_line_per_chunk_then_the_result(capsys, free_text):
    chunks, result = _generate(capsys, "--stream")
    assert chunks and all(list(c) == CHUNK_KEYS for c in chunks)
    assert [c["chunk_idx"] for c in chunks] == list(range(len(chunks)))
    assert all(a["byte_end"] == b["byte_start"] for a, b in itertools.pairwise(chunks)) and chunks[0]["byte_start"] == 0
    assert all(c["token_end"] <= len(result["output_ids"]) for c in chunks)
    assert "".join(c["text"] for c in chunks) == result["text"] == free_text
    assert result["finish_reason"] == "length" and result["stream"] == {
        "chunks": len(chunks), "delivered_bytes": len(free_text.encode()), "delivered_tokens": 12, "failed": False, "error": None}
    assert len(result["logprobs"]) == len(result["output_ids"]) == result["num_committed"] == 12


def test_stream_plain_prints_the_chunks(capsys, free_text):
    assert main([*BASE, "--stream", "--stop", "zzz"]) == 0
    assert capsys.readouterr().out == free_text + "\n"


def test_stop_flags_reach_the_envelope_and_the_result(capsys, free_text):
    stop = free_text[3:6]
    _, plain = _generate(capsys)
    chunks, text = _generate(capsys, "--stream", "--stop", "zzz", "--stop", stop, "--align", "text")
    assert text["identity"] != plain["identity"]  # the flags are identity-bearing envelope fields
    assert text["finish_reason"] == "stop_string" and text["stop_match"] == {"stop": stop, "start": 3, "end": 6}
    assert text["text"] == free_text[:3] == "".join(c["text"] for c in chunks) and text["alignment"] == "text"
    assert text["num_committed"] == 6 and len(text["output_ids"]) == len(text["logprobs"]) == 3 and text["overhang"] == ""
    _, span = _generate(capsys, "--stop", stop, "--align", "span")
    assert span["text"] == free_text[:3] and len(span["output_ids"]) == 6 and span["visible_end"] == 3
    assert bytes.fromhex(span["overhang"]) == stop.encode() and span["token_spans"] == [[i, i + 1] for i in range(6)]
    _, included = _generate(capsys, "--stop", stop, "--include-stop")
    assert included["text"] == free_text[:6] and included["alignment"] == "token"  # the envelope's default contract


def test_min_new_tokens_and_json_mode(capsys, free_text):
    first = free_text[0]
    _, late = _generate(capsys, "--stop", first, "--min-new-tokens", "2", "--align", "text")
    later = free_text.index(first, 2)
    assert late["stop_match"] == {"stop": first, "start": later, "end": later + 1} and late["text"] == free_text[:later]
    _, structured = _generate(capsys, "--json-mode")
    assert structured["finish_reason"] == "structured_error" and structured["num_committed"] == 1  # "B" cannot start JSON
    assert main([*BASE, "--min-new-tokens", "13"]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "envelope.min_exceeds_max"


def test_bad_alignment_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([*BASE, "--align", "bytes"])
    assert info.value.code == 2


def test_stream_trace_is_accepted_and_a_broken_one_rejected(capsys, tmp_path, free_text):
    path = tmp_path / "t.ndjson"
    stop = free_text[3:6]
    assert main([*BASE, "--stream", "--stop", stop, "--align", "text", "--trace", str(path), "--trace-content"]) == 0  # checks the text
    capsys.readouterr()
    assert main(["validate-trace", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["output"] == {"stop_strings": [stop], "include_stop_str": False, "alignment": "text", "structured": "none",
                                    "max_json_depth": records[0]["output"]["max_json_depth"], "stream": True}
    i = max(n for n, r in enumerate(records) if r["event"] == "stream")
    records[i]["text"] = records[i]["text"].upper() + "!"  # text that is not the decode of its bytes
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["validate-trace", str(path)]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["line"] == i + 1 and verdict["event"] == "stream" and "text" in verdict["reason"]
    assert main(["validate-trace", "--tokenizer", "none", str(path)]) == 0  # without the bytes: structure only, intact
    assert json.loads(capsys.readouterr().out)["accepted"] is True


def test_resumed_stream_continues_the_chunk_numbering(capsys, tmp_path, free_text):
    snap = tmp_path / "s.json"
    chunks, first = _generate(capsys, "--stream", "--snapshot", str(snap), "--snapshot-at", "5")
    assert first["suspended"] and "".join(c["text"] for c in chunks) == free_text[:5]
    assert main(["generate", "--model", "tiny", "--device", "cpu", "--resume", str(snap), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rest, result = lines[:-1], lines[-1]
    assert rest[0]["chunk_idx"] == len(chunks) and rest[0]["byte_start"] == 5
    assert "".join(c["text"] for c in chunks + rest) == result["text"] == free_text


@requires_smollm2
@pytest.mark.smollm2
def test_smollm2_stream_with_a_stop_string(capsys, tmp_path, smollm2_model):
    path = tmp_path / "t.ndjson"
    argv = ["generate", "--chat", "--prompt", "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "10",
            "--device", "cpu", "--stop", " Paris", "--stream", "--json", "--trace", str(path),
            "--trace-content"]  # content: validate-trace then runs the stop oracle and the stream-text checks
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    chunks, result = lines[:-1], lines[-1]
    assert result["finish_reason"] == "stop_string" and result["text"] == "The capital of France is"
    assert "".join(c["text"] for c in chunks) == result["text"] and all(" Paris" not in c["text"] for c in chunks)
    assert main(["validate-trace", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True


def test_ignore_eos_runs_past_the_tokenizers_eos(capsys, tmp_path):
    """``--ignore-eos`` (termination.ignore_eos with an empty stop set): the tokenizer's EOS no longer stops.

    A logit bias of +1000 on the tiny tokenizer's EOS (id 2) makes it the greedy choice at every step on every CPU:
    without the flag the request finishes ``eos`` at its first token; with it, the same request (through
    ``--request``, the flags' envelope plus the bias) runs to G, committing EOS every time.
    """
    import argparse

    from decodespec.checks.commands.generate import envelope_from_flags, register
    from decodespec.impl.tiny import TINY_VOCAB_SIZE, load_tiny
    from decodespec.impl.tokenizer import ByteTokenizer

    def run(*flags: str) -> dict:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["generate", "--model", "tiny", "--prompt", "trace", "--max-new-tokens", "5", *flags])
        envelope = envelope_from_flags(args, load_tiny(device="cpu"), ByteTokenizer(TINY_VOCAB_SIZE))
        envelope["policy"]["transforms"] = [{"name": "logit_bias", "bias": {"2": 1000.0}}]
        path = tmp_path / "request.json"
        path.write_text(json.dumps(envelope))
        assert main(["generate", "--model", "tiny", "--request", str(path), "--device", "cpu", "--json"]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    stopped = run()
    assert stopped["finish_reason"] == "eos" and stopped["output_ids"] == [2]
    ignored = run("--ignore-eos")
    assert ignored["finish_reason"] == "length" and ignored["output_ids"] == [2] * 5
    assert ignored["identity"] != stopped["identity"]  # an identity-bearing envelope field
