"""Stop strings, streaming and JSON completion end to end on SmolLM2 (greedy), through the controller.

Every case runs ``RequestRunner`` on the real model with the real tokenizer, streams the output
to a consumer, and replays the written trace with the tokenizer's bytes (trace validation checks
each chunk against the spec's stop oracle).  Stop strings are picked from the bytes of a greedy
continuation computed once, and each test asserts the property it relies on (a stop split over
three tokens; one that ends inside a token; emoji / CJK characters split over byte tokens), so a
different continuation cannot silently weaken a case.  The JSON case asks the model to repeat a
JSON object whose string values contain ``}`` and ``"``; the model does, so no constraint or
scripted score source is needed.

Rules: ``invariant.stop_match_rule``, ``invariant.stream_no_stop_bytes``,
``invariant.stream_final``, ``invariant.output_alignment``, ``invariant.decoder_frontier``,
``invariant.json_completion``, ``transition.commit``.  Source: M3.10 0x06.
"""

from __future__ import annotations

import json

import pytest
from runtime_helpers import renumber, request  # tests/ is on sys.path

from decodespec.checks.modelcheck.trace_validation import token_bytes_of, validate_trace
from decodespec.checks.testing import requires_smollm2
from decodespec.impl.events import ListSink
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import FinishReason as FR

pytestmark = [requires_smollm2, pytest.mark.smollm2]

EOS = 2
FRANCE = "What is the capital of France? Answer in one sentence."


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def run(model, tok, prompt, g, **changes):
    """One streamed greedy request; returns (runner, result, consumer chunks, trace lines); the trace is validated."""
    chunks, sink = [], ListSink()
    changes.setdefault("eos_ids", frozenset({EOS}))
    runner = RequestRunner(model, request(prompt, g, stream=True, **changes), tokenizer=tok, sink=sink, on_chunk=chunks.append).run()
    result = runner.result()
    verdict = validate_trace(sink.lines(), token_bytes=token_bytes_of(tok))
    assert verdict.accepted, verdict
    assert result.chunks == tuple(chunks) and len(result.logprobs) == len(result.output_ids)
    return runner, result, chunks, sink.lines()


def streamed(chunks) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def france(smollm2_model, smollm2_tokenizer):
    """The greedy continuation of FRANCE, streamed, with a stop string that never matches (all flushed at EOS)."""
    prompt = chat_ids(smollm2_tokenizer, FRANCE)
    _runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=("zzz",))
    assert result.finish_reason is FR.EOS and result.output_ids[-1] == EOS
    assert streamed(chunks) == result.text == smollm2_tokenizer.decode(result.output_ids[:-1])
    token_bytes = [smollm2_tokenizer.token_bytes(i) for i in result.output_ids[:-1]]
    assert len(token_bytes) >= 6 and all(len(b) >= 2 and b.isascii() for b in token_bytes[1:5])
    return prompt, result, token_bytes


def spans(token_bytes) -> list[tuple[int, int]]:
    out, at = [], 0
    for b in token_bytes:
        out.append((at, at + len(b)))
        at += len(b)
    return out


def covering(token_bytes, start: int, end: int) -> list[int]:
    """Indices of the tokens holding bytes ``[start, end)``."""
    return [i for i, (s, e) in enumerate(spans(token_bytes)) if s < end and e > start]


def test_stop_over_three_tokens(smollm2_model, smollm2_tokenizer, france):
    """A stop string split over three tokens (starting inside the first): cut exactly, nothing of it streamed."""
    prompt, free, tb = france
    data = b"".join(tb)
    start = spans(tb)[1][0] + 1  # inside token 1 (after its leading byte)
    end = spans(tb)[3][1]
    stop = data[start:end].decode()
    assert covering(tb, start, end) == [1, 2, 3]
    for alignment, kept in (("text", 2), ("token", 1)):
        runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(stop,), alignment=alignment)
        assert result.finish_reason is FR.STOP_STRING and runner.output_count == 4 and result.stop_match == (stop, start, end)
        assert result.output_ids == free.output_ids[:kept] and result.logprobs == free.logprobs[:kept]
        visible = start if alignment != "token" else spans(tb)[0][1]
        assert result.text == data[:visible].decode() and streamed(chunks) == result.text
        assert all(c.byte_end <= start for c in chunks)  # no byte of the stop string was ever published
    runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(stop,), include_stop_str=True)
    assert result.text == data[:end].decode() == streamed(chunks) and result.output_ids == free.output_ids[:4]


def test_stop_ending_inside_a_token_under_each_alignment(smollm2_model, smollm2_tokenizer, france):
    """A stop string ending in the middle of a token's bytes; len(logprobs) == len(output_ids) in every contract."""
    prompt, free, tb = france
    data = b"".join(tb)
    start = spans(tb)[4][0] + 1
    end = spans(tb)[5][0] + 3
    stop = data[start:end].decode()
    assert covering(tb, start, end) == [4, 5] and end < spans(tb)[5][1]  # ends inside token 5
    results = {}
    for alignment in ("token", "text", "span"):
        runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(stop,), alignment=alignment)
        assert result.finish_reason is FR.STOP_STRING and runner.output_count == 6 and result.num_committed == 6
        assert len(result.logprobs) == len(result.output_ids) and streamed(chunks) == result.text
        assert all(c.byte_end <= start for c in chunks)
        results[alignment] = result
    token, text, span = results["token"], results["text"], results["span"]
    # token: whole tokens before the match; the ids decode exactly to the text.
    assert token.output_ids == free.output_ids[:4] and token.text == smollm2_tokenizer.decode(token.output_ids) and token.overhang == b""
    # text: exact byte cut; the ids decode to text + overhang (the documented mismatch).
    assert text.text == data[:start].decode() and text.output_ids == free.output_ids[:5]
    assert text.overhang == data[start:spans(tb)[4][1]] and smollm2_tokenizer.decode(text.output_ids) == text.text + text.overhang.decode()
    # span: every committed token, spans mark the visible bytes and the trimmed ones.
    assert span.output_ids == free.output_ids[:6] and span.text == text.text and span.visible_end == start
    assert span.token_spans == tuple(spans(tb)[:6]) and span.overhang == data[start:spans(tb)[5][1]]


def test_prefix_stops_first_token_and_min_new_tokens(smollm2_model, smollm2_tokenizer, france):
    """Two stops where one is a prefix of the other; a stop matched by the first token; min_new_tokens past stop and EOS."""
    prompt, free, tb = france
    data = b"".join(tb)
    word = data[spans(tb)[3][0] + 1:spans(tb)[3][1]].decode()  # token 3 without its leading space
    longer = word + data[spans(tb)[4][0]:spans(tb)[4][1]].decode()
    _, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(longer, word), alignment="text")
    assert result.stop_match == (word, spans(tb)[3][0] + 1, spans(tb)[3][1])  # the earliest-ending one fires
    assert result.text == data[:spans(tb)[3][0] + 1].decode() == streamed(chunks)
    first = tb[0].decode()
    runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(first,))
    assert runner.output_count == 1 and result.finish_reason is FR.STOP_STRING and result.text == "" and chunks == []
    # min_new_tokens beyond the EOS position and the first token's stop: both suppressed until length.
    g = len(free.output_ids) + 2
    runner, result, chunks, lines = run(smollm2_model, smollm2_tokenizer, prompt, g, stop_strings=(first,), min_new_tokens=g)
    assert result.finish_reason is FR.LENGTH and runner.output_count == g and EOS not in result.output_ids
    assert result.output_ids[:len(free.output_ids) - 1] == free.output_ids[:-1] and streamed(chunks) == result.text
    assert result.text.startswith(free.text) and json.loads(lines[0])["min_new_tokens"] == g


@pytest.mark.parametrize("text, g", [("Repeat exactly: \U0001F355\U0001F355", 8), ("Translate to Chinese: Hello world", 14)],
                         ids=["emoji", "cjk"])
def test_multibyte_characters_split_across_tokens(smollm2_model, smollm2_tokenizer, text, g):
    """invariant.decoder_frontier: no U+FFFD in any chunk; stream == final text == decode(output ids)."""
    prompt = chat_ids(smollm2_tokenizer, text)
    runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, g)
    token_bytes = [smollm2_tokenizer.token_bytes(i) for i in runner.output_ids]
    split = [b for b in token_bytes if b and not _valid_utf8(b)]
    assert split, f"no character was split across tokens in {token_bytes}"
    assert not any("\ufffd" in c.text for c in chunks)
    assert streamed(chunks) == result.text == smollm2_tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert any(ord(ch) > 0x2E7F for ch in result.text)  # the emoji / CJK characters are really there
    # Every chunk ends on a character boundary although tokens end inside characters.
    assert all(_valid_utf8(result.text.encode()[:c.byte_end]) for c in chunks)


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


JSON_PROMPT = 'Output this JSON exactly: {"code": "if (x) { return; }", "q": "\\"ok\\""}'


def test_json_completion_only_at_the_real_end(smollm2_model, smollm2_tokenizer):
    """invariant.json_completion: '}' and '"' inside string values do not complete; the outer '}' does."""
    prompt = chat_ids(smollm2_tokenizer, JSON_PROMPT)
    runner, result, chunks, _ = run(smollm2_model, smollm2_tokenizer, prompt, 40, structured="json")
    value = json.loads(result.text)
    assert any("}" in v for v in value.values()) and any('"' in v for v in value.values())
    assert result.finish_reason is FR.STRUCTURED and result.triggers == (FR.STRUCTURED,)
    assert EOS not in runner.output_ids  # completion closed the output before the model's EOS
    token_bytes = [smollm2_tokenizer.token_bytes(i) for i in runner.output_ids]
    assert token_bytes[-1].endswith(b"}") and any(b"}" in b for b in token_bytes[:-1])  # an earlier brace did not complete
    assert result.structured_end == len(b"".join(token_bytes)) == len(result.text.encode())
    assert streamed(chunks) == result.text


def test_a_broken_smollm2_stream_trace_is_rejected_at_the_right_line(smollm2_model, smollm2_tokenizer, france):
    """A chunk that publishes held-back stop bytes, and a chunk overlapping the previous one."""
    prompt, _, tb = france
    data = b"".join(tb)
    start = spans(tb)[1][0] + 1
    stop = data[start:spans(tb)[3][1]].decode()
    _, _, _chunks, lines = run(smollm2_model, smollm2_tokenizer, prompt, 12, stop_strings=(stop,), alignment="text")
    records = [json.loads(line) for line in lines]
    i = next(n for n, r in enumerate(records) if r["event"] == "commit" and r["output_count"] == 2) + 1
    assert records[i]["event"] == "stream" and records[i]["byte_end"] == start  # " capital" held back after " "
    leaked = [dict(r) for r in records]
    leaked[i].update(byte_end=start + 3, text=data[records[i]["byte_start"]:start + 3].decode())
    verdict = validate_trace(renumber(leaked), token_bytes=token_bytes_of(smollm2_tokenizer))
    assert (verdict.line, verdict.event) == (i + 1, "stream") and "beyond the stream horizon" in verdict.reason
    overlap = [dict(r) for r in records]
    overlap[i].update(byte_start=records[i]["byte_start"] - 1, text=data[records[i]["byte_start"] - 1:start].decode())
    verdict = validate_trace(renumber(overlap), token_bytes=token_bytes_of(smollm2_tokenizer))
    assert (verdict.line, verdict.event) == (i + 1, "stream") and "never retracted" in verdict.reason
