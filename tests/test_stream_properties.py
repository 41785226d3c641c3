"""Spec vs runtime streamer on random token sequences and stop sets (M3.10 0x06).

For every example: the runtime :class:`Streamer` publishes, after every commit, exactly the
bytes the spec's stream frontier allows (``invariant.stream_frontier``); its chunks equal the
spec's chunks (``invariant.chunk_metadata``), are never retracted (``invariant.stream_prefix``),
concatenate to the returned text (``invariant.stream_final``) and never contain an excluded stop
byte (``invariant.stream_no_stop_bytes``); the returned output equals the spec's aligned output
(``invariant.output_alignment``, ``invariant.finish_precedence``, ``invariant.stop_triggers``).
Runs on the tiny model's ``ByteTokenizer`` and on SmolLM2's real byte-level BPE vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.stream import Streamer
from decodespec.impl.tokenizer import ByteTokenizer
from decodespec.spec.enums import FinishReason
from decodespec.spec.stop import (
    OutputAlignment,
    StopConfig,
    chunk_metadata_holds,
    output_alignment_holds,
    reference_stream,
    stream_excludes_stop,
    stream_matches_output,
    stream_prefix_holds,
    token_ends,
)


def committed_bytes(tok: Any, ids: Sequence[int]) -> list[bytes]:
    """Each id's bytes in the output text (special tokens have none)."""
    return [b"" if i in tok.special_ids else tok.token_bytes(i) for i in ids]


def check_streamer_against_spec(tok: Any, cfg: StopConfig, ids: Sequence[int], logprobs: Sequence[float] | None) -> Any:
    """Drive a Streamer over ``ids`` and compare every step with the spec's reference run."""
    tb = committed_bytes(tok, ids)
    ref = reference_stream(cfg, ids, tb, logprobs, external=FinishReason.CANCELLED)
    streamer = Streamer(tok, cfg)
    published: list = []
    for t, token_id in enumerate(ids):
        published += streamer.push(token_id, None if logprobs is None else logprobs[t])
        assert streamer.delivered_bytes == ref.steps[t].published, f"frontier differs after token {t}"
        assert tuple(published) == tuple(streamer.chunks)
        if streamer.finished:
            break
    if not streamer.finished:
        published += streamer.finish(FinishReason.CANCELLED)
    out = streamer.output
    assert out is not None and ref.output is not None
    assert tuple(published) == ref.chunks
    assert out == ref.output
    # The invariants, on what the runtime produced.
    committed = tb[:out.num_committed]
    data, ends = b"".join(committed), token_ends(committed)
    assert stream_prefix_holds(published)
    assert stream_matches_output(published, out)
    assert stream_excludes_stop(published, out, cfg.include_stop_str)
    assert all(chunk_metadata_holds(c, data, ends) for c in published)
    assert output_alignment_holds(out, committed)
    if logprobs:
        assert len(out.logprobs) == len(out.output_ids)
    if out.alignment is OutputAlignment.TOKEN:
        assert out.text == tok.decode(out.output_ids, skip_special_tokens=True)
    event(f"finish={out.finish_reason.value}")
    event(f"held back a stop prefix={any(s.stop_holdback for s in ref.steps)}")
    event(f"trimmed={out.visible_end < out.total_bytes}")
    return out


@st.composite
def stop_configs(draw, text: str, num_tokens: int, json_completion: bool = False) -> StopConfig:
    """Stop strings drawn from substrings of ``text`` (so they match, overlap, share prefixes) and noise."""
    stops = []
    for _ in range(draw(st.integers(0, 4))):
        if text and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i:i + draw(st.integers(1, 5))])
        else:
            stops.append(draw(st.text(alphabet="ab<>S é€😀日", min_size=1, max_size=3)))
    if stops and draw(st.booleans()):
        stops.append(stops[0][: max(1, len(stops[0]) - 1)])   # a prefix of another pattern
    max_new = draw(st.integers(1, num_tokens + 2) | st.just(num_tokens + 2))
    return StopConfig(
        max_new_tokens=max_new,
        eos_ids={2},
        min_new_tokens=draw(st.integers(0, min(max_new, 4))),
        prompt_len=5,
        max_context_len=draw(st.none() | st.none() | st.integers(6, 5 + num_tokens + 2)),
        stop_strings=stops,
        include_stop_str=draw(st.booleans()),
        alignment=draw(st.sampled_from(list(OutputAlignment))),
        json_completion=json_completion,
    )


_BYTE_TOK = ByteTokenizer(vocab_size=262)
_BYTE_POOL = sorted({b + 3 for b in "ab<>S é€😀日{}\":1".encode()} | {0xFF + 3, 0xED + 3, 0xA0 + 3, 0x80 + 3, 2, 260})


@given(st.data())
def test_byte_tokenizer_streamer_matches_spec(data) -> None:
    """invariant.stream_frontier etc. on the tiny model's byte tokenizer (every byte is a token)."""
    pieces = st.text(alphabet="ab<>S é€😀日", min_size=1, max_size=3).map(_BYTE_TOK.encode) | st.sampled_from(_BYTE_POOL).map(lambda i: [i])
    ids = [i for piece in data.draw(st.lists(pieces, max_size=10)) for i in piece][:24]
    text = _BYTE_TOK.decode(ids)
    cfg = data.draw(stop_configs(text, len(ids), data.draw(st.integers(0, 7)) == 0))
    logprobs = data.draw(st.none() | st.just([-0.25 * (i + 1) for i in range(len(ids))]))
    check_streamer_against_spec(_BYTE_TOK, cfg, ids, logprobs)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 99) | st.text(alphabet='a}{"\\é😀', max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="ab}", max_size=2), inner, max_size=2),
    max_leaves=6,
)


@given(st.data())
def test_byte_tokenizer_json_completion_matches_spec(data) -> None:
    """invariant.json_completion inside the streamer: structured fires where the spec says, with stops."""
    text = json.dumps(data.draw(_JSON), ensure_ascii=False) + data.draw(st.sampled_from(["", " ", "\n}", "x"]))
    ids = _BYTE_TOK.encode(text) + data.draw(st.lists(st.sampled_from(_BYTE_POOL), max_size=3))
    cfg = data.draw(stop_configs(text, len(ids), json_completion=True))
    check_streamer_against_spec(_BYTE_TOK, cfg, ids, None)


@pytest.fixture(scope="module")
def smollm2_pool():
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    texts = ["Hello <STOP> world", "😀🎉 日本語のテキスト", '{"a": "}\\"", "b": [1, {"c": null}]}', "ab<ab<STOP>>abab"]
    pool = sorted({i for t in texts for i in tok.encode(t)} | {2, 0, 1})
    return tok, pool


@requires_smollm2
@given(data=st.data())
def test_smollm2_streamer_matches_spec(smollm2_pool, data) -> None:
    """invariant.stream_frontier etc. on SmolLM2's real vocabulary (tokens split UTF-8 and stops)."""
    tok, pool = smollm2_pool
    token = st.sampled_from(pool) | st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(token, max_size=16))
    cfg = data.draw(stop_configs(tok.decode(ids, skip_special_tokens=True), len(ids), data.draw(st.integers(0, 7)) == 0))
    check_streamer_against_spec(tok, cfg, ids, [-0.5] * len(ids))
