"""Streamer failure policy and typed errors (M3.10 0x06 "One selection is an output-state transaction").

Declared output-transaction policy: a delivery callback that raises => finish reason
``stream_error``; the committed output is kept; nothing beyond the last delivered chunk is
claimed delivered; no further token may be committed.
"""

from __future__ import annotations

import pytest

from decodespec.impl.stream import StopMatcher, Streamer
from decodespec.impl.tokenizer import ByteTokenizer
from decodespec.spec.enums import FinishReason as FR
from decodespec.spec.errors import Rejection
from decodespec.spec.stop import StopConfig

TOK = ByteTokenizer()


class FlakyClient:
    """Accepts ``ok`` chunks, then raises."""

    def __init__(self, ok: int):
        self.ok = ok
        self.received: list[str] = []

    def __call__(self, chunk) -> None:
        if len(self.received) >= self.ok:
            raise ConnectionError("client went away")
        self.received.append(chunk.text)


def test_callback_failure_closes_with_stream_error() -> None:
    """invariant.finish_precedence: a raising callback => stream_error; delivered prefix is exact."""
    client = FlakyClient(ok=3)
    s = Streamer(TOK, StopConfig(max_new_tokens=20), on_chunk=client)
    for i in TOK.encode("abcde"):
        s.push(i, -1.0)
        if s.finished:
            break
    assert s.finished and s.finish_reason is FR.STREAM_ERROR
    assert isinstance(s.stream_error, ConnectionError)
    assert client.received == ["a", "b", "c"] and [c.text for c in s.chunks] == ["a", "b", "c"]
    assert s.delivered_bytes == 3
    # The committed output is kept (4 tokens were committed when the 4th chunk failed).
    assert s.output.num_committed == 4 and s.output.text == "abcd" and len(s.output.logprobs) == 4
    with pytest.raises(Rejection) as info:
        s.push(TOK.encode("f")[0])
    assert info.value.code == "stop.after_finish" and s.output.num_committed == 4


def test_callback_failure_on_the_final_chunk_keeps_every_trigger() -> None:
    """invariant.finish_precedence: the stop trigger is recorded; stream_error is canonical."""
    client = FlakyClient(ok=3)
    s = Streamer(TOK, StopConfig(max_new_tokens=20, stop_strings=["<S>"], include_stop_str=True), on_chunk=client)
    for i in TOK.encode("a<S>b"):
        s.push(i)
        if s.finished:
            break
    assert s.output.triggers == (FR.STREAM_ERROR, FR.STOP_STRING) and s.finish_reason is FR.STREAM_ERROR
    assert s.output.text == "a<S>" and s.output.num_committed == 4
    assert s.delivered_bytes == 3 and client.received == ["a", "<", "S"]


def test_external_finish_flushes_held_bytes_and_rejects_content_reasons() -> None:
    """invariant.stream_final: cancel flushes the held-back stop prefix; eos cannot be external."""
    s = Streamer(TOK, StopConfig(max_new_tokens=20, stop_strings=["<S>"]))
    for i in TOK.encode("ab<"):
        s.push(i)
    assert s.delivered_bytes == 2
    for bad in (FR.EOS, FR.STOP_STRING, FR.LENGTH, "nonsense"):
        with pytest.raises(Rejection) as info:
            s.finish(bad)
        assert info.value.code == "stop.finish_not_allowed"
    assert not s.finished
    chunks = s.finish(FR.CANCELLED)
    assert [c.text for c in chunks] == ["<"] and s.output.text == "ab<" and s.finish_reason is FR.CANCELLED


def test_zero_new_tokens_finishes_with_length_from_outside() -> None:
    """invariant.stop_triggers: with max_new_tokens = 0 the loop closes the output as length, O = 0."""
    s = Streamer(TOK, StopConfig(max_new_tokens=0))
    assert s.finish(FR.LENGTH) == [] and s.output.output_ids == () and s.output.logprobs is None


@pytest.mark.parametrize("bad", [-1, 512, 3.0, True, None])
def test_out_of_range_token_is_rejected_and_changes_nothing(bad) -> None:
    """Typed error for a bad token id; the streamer is unchanged."""
    s = Streamer(TOK, StopConfig(max_new_tokens=5))
    s.push(TOK.encode("a")[0])
    with pytest.raises(Rejection) as info:
        s.push(bad)
    assert info.value.code == "stop.token_out_of_range"
    assert s.num_committed == 1 and s.detokenizer.num_bytes == 1 and not s.finished


def test_matcher_rejects_empty_pattern() -> None:
    """Typed error: stop.empty_pattern from the runtime matcher as well."""
    with pytest.raises(Rejection) as info:
        StopMatcher([b"ok", b""])
    assert info.value.code == "stop.empty_pattern" and info.value.path == "$.stop[1]"


def test_chunk_to_json_has_the_trace_fields() -> None:
    """A chunk never travels without its token metadata (docs/design.md section 6, stream event)."""
    s = Streamer(TOK, StopConfig(max_new_tokens=5))
    (chunk,) = s.push(TOK.encode("a")[0])
    assert chunk.to_json() == {"chunk_idx": 0, "text": "a", "byte_start": 0, "byte_end": 1, "token_start": 0, "token_end": 1}
