"""Stop, stream and structured completion on SmolLM2's real byte-level BPE (M3.10 0x06).

Token sequences are built by tokenizing text with the real tokenizer (no model weights needed),
so stop strings really are split over tokens, start or end inside a token's bytes, and emoji /
CJK characters really are split across byte tokens.  Every case is also checked against the
spec's reference run (``decodespec.spec.stop.reference_stream``).
"""

from __future__ import annotations

import pytest

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.stream import Streamer
from decodespec.spec.enums import FinishReason as FR
from decodespec.spec.stop import OutputAlignment, StopConfig, StopMatch, reference_stream

pytestmark = requires_smollm2

EOS = 2


@pytest.fixture(scope="module")
def tok():
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def stream(tok, ids, **cfg_kwargs):
    """Push ``ids`` until finished (else cancel); check against the spec; return (streamer, chunks)."""
    cfg = StopConfig(**{"max_new_tokens": 64, "eos_ids": {EOS}, **cfg_kwargs})
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    s = Streamer(tok, cfg)
    chunks = []
    for token_id, lp in zip(ids, logprobs):
        chunks += s.push(token_id, lp)
        if s.finished:
            break
    if not s.finished:
        chunks += s.finish(FR.CANCELLED)
    tb = [b"" if i in tok.special_ids else tok.token_bytes(i) for i in ids]
    ref = reference_stream(cfg, ids, tb, logprobs, external=FR.CANCELLED)
    assert s.output == ref.output and tuple(chunks) == ref.chunks
    assert "".join(c.text for c in chunks) == s.output.text
    return s, chunks


def test_stop_split_over_three_tokens_under_each_alignment(tok) -> None:
    """invariant.stream_no_stop_bytes / invariant.output_alignment: "<STOP>" over b' <', b'STOP', b'>'."""
    ids = tok.encode("Hello <STOP> world")
    assert [tok.token_bytes(i) for i in ids[:4]] == [b"Hello", b" <", b"STOP", b">"]
    s, chunks = stream(tok, ids, stop_strings=["<STOP>"], alignment="text")
    out = s.output
    assert out.finish_reason is FR.STOP_STRING and out.stop_match == StopMatch(0, 6, 12)
    assert out.text == "Hello " and out.num_committed == 4
    assert all(c.byte_end <= 6 for c in chunks) and "<" not in "".join(c.text for c in chunks)
    # Text-aligned: the fewest tokens covering "Hello "; they decode to text + overhang b"<".
    assert out.output_ids == tuple(ids[:2]) and out.overhang == b"<"
    assert tok.decode(out.output_ids) == out.text + out.overhang.decode()
    assert len(out.logprobs) == len(out.output_ids) == 2

    s, chunks = stream(tok, ids, stop_strings=["<STOP>"], alignment="token")
    out = s.output
    # Token-aligned: every token holding a stop byte is dropped; " " shares b' <' and goes too.
    assert out.output_ids == tuple(ids[:1]) and out.text == "Hello" and out.overhang == b""
    assert tok.decode(out.output_ids) == out.text and len(out.logprobs) == 1
    assert all(c.byte_end <= 5 for c in chunks)

    s, _ = stream(tok, ids, stop_strings=["<STOP>"], alignment="span")
    out = s.output
    assert out.output_ids == tuple(ids[:4]) and len(out.logprobs) == 4
    assert out.text == "Hello " and out.visible == (0, 6) and out.trimmed == (6, 12)
    assert out.token_spans == ((0, 5), (5, 7), (7, 11), (11, 12))

    s, chunks = stream(tok, ids, stop_strings=["<STOP>"], include_stop_str=True)
    assert s.output.text == "Hello <STOP>" and s.output.output_ids == tuple(ids[:4])


def test_stop_ending_inside_a_token(tok) -> None:
    """invariant.stop_match_rule: "<STOP> w" ends inside b' world'; "STO" ends inside b'STOP'."""
    ids = tok.encode("Hello <STOP> world")
    s, chunks = stream(tok, ids, stop_strings=["<STOP> w"], include_stop_str=True)
    out = s.output
    assert out.stop_match == StopMatch(0, 6, 14) and out.text == "Hello <STOP> w"
    assert out.output_ids == tuple(ids[:5]) and out.overhang == b"orld"
    s, chunks = stream(tok, ids, stop_strings=["<STOP> w"], include_stop_str=True, alignment="token")
    assert s.output.text == "Hello <STOP> world"          # whole tokens keep the overhang
    s, chunks = stream(tok, ids, stop_strings=["STO"])
    assert s.output.text == "Hello <" and s.output.stop_match == StopMatch(0, 7, 10)
    assert all(c.byte_end <= 7 for c in chunks)


def test_prefix_sharing_stop_strings(tok) -> None:
    """invariant.stop_match_rule: "<ST" ends before "<STOP>"; "OP>" and "<STOP>" end together -> longest."""
    ids = tok.encode("Hello <STOP> world")
    s, _ = stream(tok, ids, stop_strings=["<STOP>", "<ST"])
    assert s.output.stop_match == StopMatch(1, 6, 9) and s.output.num_committed == 3
    s, _ = stream(tok, ids, stop_strings=["OP>", "<STOP>"])
    assert s.output.stop_match == StopMatch(1, 6, 12) and s.output.text == "Hello "


def test_stop_matched_by_the_first_token(tok) -> None:
    """invariant.stream_no_stop_bytes: a stop inside the very first token publishes only what precedes it."""
    ids = tok.encode("Hello world")
    s, chunks = stream(tok, ids, stop_strings=["ell"])
    out = s.output
    assert [c.text for c in chunks] == ["H"] and out.text == "H" and out.num_committed == 1
    assert out.output_ids == tuple(ids[:1]) and out.overhang == b"ello"
    s, chunks = stream(tok, ids, stop_strings=["Hel"], alignment="token")
    assert chunks == [] and s.output.text == "" and s.output.output_ids == () and s.output.logprobs == ()


def test_stop_that_never_matches_flushes_everything(tok) -> None:
    """invariant.stream_final: held-back stop prefixes are flushed when no stop matched."""
    ids = tok.encode("Hello <") + [EOS]
    s, chunks = stream(tok, ids, stop_strings=["<END>"])
    out = s.output
    assert out.finish_reason is FR.EOS and out.text == "Hello <" and out.output_ids == tuple(ids)
    assert [c.byte_end for c in chunks] == [5, 6, 7]   # "Hello", " ", then "<" only at finish
    assert chunks[-1].token_start == 1 and chunks[-1].token_end == 2


def test_emoji_and_cjk_split_across_tokens(tok) -> None:
    """invariant.decoder_frontier: no U+FFFD in any chunk; stream == final text == decode(ids)."""
    text = "😀🎉 日本語のテキスト"
    ids = tok.encode(text)
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)
    s, chunks = stream(tok, ids + [EOS])
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == s.output.text == text == tok.decode(s.output.output_ids, skip_special_tokens=True)
    # Each chunk ends on a character boundary, and its token range covers its bytes.
    for c in chunks:
        assert c.text.encode() == b"".join(tok.token_bytes(i) for i in ids)[c.byte_start:c.byte_end]
    s, chunks = stream(tok, ids, stop_strings=["テキ"])
    assert s.output.text == "😀🎉 日本語の" and all("\ufffd" not in c.text for c in chunks)


def test_json_braces_and_quotes_inside_strings(tok) -> None:
    """invariant.json_completion: '}' and '"' inside string values do not complete the object."""
    text = '{"a": "}\\"", "b": [1, {"c": null}]}'
    ids = tok.encode(text)
    assert b"}\\" in [tok.token_bytes(i) for i in ids]              # a token with } inside a string
    more = tok.encode("\n\nDone.")
    s, _chunks = stream(tok, ids + more, json_completion=True)
    out = s.output
    assert out.finish_reason is FR.STRUCTURED and out.num_committed == len(ids)
    assert out.text == text and out.structured_end == len(text.encode())
    # Every earlier prefix was incomplete: no trigger before the last token.
    s2 = Streamer(tok, StopConfig(max_new_tokens=64, json_completion=True))
    for i in ids[:-1]:
        s2.push(i)
        assert not s2.finished


def test_json_completion_inside_a_token_is_trimmed(tok) -> None:
    """invariant.output_alignment: b'}.' completes the value at '}'; text trims '.', token keeps it."""
    ids = tok.encode('{"a": 1}.')
    s, _ = stream(tok, ids, json_completion=True, alignment="text")
    assert s.output.text == '{"a": 1}' and s.output.overhang == b"." and s.output.structured_end == 8
    s, _ = stream(tok, ids, json_completion=True, alignment="token")
    assert s.output.text == '{"a": 1}.' and s.output.output_ids == tuple(ids)


def test_min_new_tokens_past_the_first_stop_and_eos(tok) -> None:
    """invariant.stop_triggers: min_new_tokens suppresses the first <STOP> and an early EOS."""
    ids = tok.encode("Hello <STOP> world <STOP> more")
    s, _chunks = stream(tok, ids, stop_strings=["<STOP>"], min_new_tokens=5)
    out = s.output
    assert out.stop_match == StopMatch(0, 19, 25) and out.text == "Hello <STOP> world "
    assert out.num_committed == 8
    ids = tok.encode("Hi") + [EOS] + tok.encode(" there") + [EOS]
    s, _ = stream(tok, ids, min_new_tokens=3)
    assert s.output.finish_reason is FR.EOS and s.output.num_committed == len(ids)
    assert s.output.text == "Hi there" and s.output.output_ids == tuple(ids)


def test_simultaneous_triggers_record_all_publish_one(tok) -> None:
    """invariant.finish_precedence: stop_string, eos-free length and context_length at one commit."""
    ids = tok.encode("Hello <STOP>")
    s, _ = stream(tok, ids, stop_strings=["<STOP>"], max_new_tokens=len(ids), prompt_len=10,
                  max_context_len=10 + len(ids), alignment=OutputAlignment.SPAN)
    assert s.output.triggers == (FR.STOP_STRING, FR.CONTEXT_LENGTH, FR.LENGTH)
    assert s.output.finish_reason is FR.STOP_STRING and s.last_triggers == s.output.triggers
