"""Streamer edges the spec-vs-runtime properties never drew (mutation testing of ``impl/stream.py``).

Each test here was added because Cosmic Ray (docs/results/mutation.md, section ``impl/stream.py``)
left a mutant of :mod:`decodespec.impl.stream` alive under the streamer's own tests on the byte
tokenizer.  The byte tokenizer makes every token one byte, so whole-token and byte frontiers
coincide; :class:`PieceTokenizer` below has multi-byte tokens, which tell them apart.  Each test
names the mutants it kills.

Source: M3.10 0x06 "Streaming has a commit horizon", "Token-aligned and text-aligned outputs can
diverge", "Finish reason and RNG precedence"; ``invariant.stop_triggers``,
``invariant.stream_frontier``, ``invariant.output_alignment`` in :mod:`decodespec.spec.stop`.
"""

from __future__ import annotations

import pytest

from decodespec.impl.stream import StopMatcher, Streamer
from decodespec.impl.tokenizer import ByteTokenizer
from decodespec.spec.enums import FinishReason as FR
from decodespec.spec.errors import Rejection
from decodespec.spec.stop import OutputAlignment, StopConfig

TOK = ByteTokenizer()


class PieceTokenizer:
    """A tokenizer whose tokens are the given byte strings (id = index); no special ids."""

    special_ids = frozenset()

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]


#: ``ab`` | ``cS`` | ``d``: the stop byte ``S`` ends the second token, after the cut byte ``c``.
PIECES = PieceTokenizer([b"ab", b"cS", b"d"])


def _texts(chunks) -> list[str]:
    return [c.text for c in chunks]


def test_token_ids_at_both_ends_of_the_vocabulary() -> None:
    """Id 0 and id V - 1 are committed; V and V + 1 are refused (``stop.token_out_of_range``).

    Kills: ``0 <= token_id`` -> ``0 < token_id`` (id 0 refused) and ``token_id < V`` ->
    ``token_id != V`` (id V + 1 accepted).
    """
    s = Streamer(TOK, StopConfig(max_new_tokens=5))
    s.push(0)
    s.push(TOK.vocab_size - 1)
    assert s.num_committed == 2 and not s.finished
    for bad in (TOK.vocab_size, TOK.vocab_size + 1):
        with pytest.raises(Rejection) as info:
            s.push(bad)
        assert info.value.code == "stop.token_out_of_range"
    assert s.num_committed == 2


def test_context_length_from_outside_only_at_the_bound() -> None:
    """``finish(context_length)`` needs ``L + O >= max_context_len``; below it, ``stop.finish_not_allowed``.

    Kills, in ``finish``: ``prompt_len + o`` -> ``*`` or ``//`` (at the bound with O = 0: refused,
    or ZeroDivisionError), ``+`` -> ``<<`` (5 << 1 reaches 10 below the bound), ``>=`` -> ``<=``,
    ``!=`` or ``is not`` (accepted below the bound), ``>=`` -> ``==``, ``is`` or ``>`` (refused
    past or at the bound); ``why is CONTEXT_LENGTH`` -> ``>=`` (``"eos" >= "context_length"``:
    eos accepted at the bound).
    """
    belows = []
    for prompt_len, pushed in ((2, 1), (2, 0), (5, 1)):
        s = Streamer(TOK, StopConfig(max_new_tokens=5, prompt_len=prompt_len, max_context_len=10))
        for i in TOK.encode("a" * pushed):
            s.push(i)
        belows.append(s)
    for s in belows:
        with pytest.raises(Rejection) as info:
            s.finish(FR.CONTEXT_LENGTH)
        assert info.value.code == "stop.finish_not_allowed" and not s.finished
    for prompt_len in (4, 6):
        at = Streamer(TOK, StopConfig(max_new_tokens=5, prompt_len=prompt_len, max_context_len=4))
        with pytest.raises(Rejection) as info:
            at.finish(FR.EOS)
        assert info.value.code == "stop.finish_not_allowed"
        assert at.finish("context_length") == [] and at.finish_reason is FR.CONTEXT_LENGTH and at.output.output_ids == ()


@pytest.mark.parametrize(("prompt_len", "max_context_len"), [(5, 9), (2, 4), (300, 302)])
def test_context_length_fires_at_the_commit_that_reaches_the_bound(prompt_len: int, max_context_len: int) -> None:
    """A commit fires ``context_length`` exactly when ``L + O`` reaches ``max_context_len``.

    Kills, in ``push``: ``prompt_len + t + 1`` -> ``prompt_len ** t + 1`` (5: fires at O = 3) or
    ``prompt_len << t + 1`` (fires at O = 1); ``>=`` -> ``is`` (past 256 the sum and the bound
    are distinct int objects, so it never fires).
    """
    s = Streamer(TOK, StopConfig(max_new_tokens=20, prompt_len=prompt_len, max_context_len=max_context_len))
    for i in TOK.encode("abcdefgh"):
        s.push(i)
        if s.finished:
            break
    assert s.finish_reason is FR.CONTEXT_LENGTH and s.num_committed == max_context_len - prompt_len


def test_eos_counts_from_min_new_tokens_on() -> None:
    """EOS below ``min_new_tokens`` is ignored; at index ``min_new_tokens`` and after it fires.

    Kills: ``eligible = t >= min_new_tokens`` -> ``t != min_new_tokens`` (EOS at index 0 fires
    with ``min_new_tokens = 1``; EOS after the minimum is ignored).
    """
    eos = 2
    s = Streamer(TOK, StopConfig(max_new_tokens=10, eos_ids={eos}, min_new_tokens=1))
    s.push(eos)
    assert not s.finished
    s.push(TOK.encode("a")[0])
    s.push(eos)
    assert s.finish_reason is FR.EOS and s.num_committed == 3


def test_the_chunk_consumer_is_keyword_only() -> None:
    """``Streamer(tokenizer, config, *, on_chunk=...)``: the consumer cannot be passed by position.

    Kills: the ``*`` of the signature -> ``/`` (tokenizer and config then positional-only, the
    consumer positional).
    """
    got: list = []
    s = Streamer(tokenizer=TOK, config=StopConfig(max_new_tokens=2), on_chunk=got.append)
    s.push(TOK.encode("a")[0])
    assert _texts(got) == ["a"]
    with pytest.raises(TypeError):
        Streamer(TOK, StopConfig(max_new_tokens=2), got.append)


@pytest.mark.parametrize(("alignment", "chunks"), [
    (OutputAlignment.TOKEN, ["ab", "cSd"]),
    (OutputAlignment.TEXT, ["ab", "c", "Sd"]),
    (OutputAlignment.SPAN, ["ab", "c", "Sd"]),
])
def test_token_alignment_holds_back_to_a_whole_token(alignment, chunks) -> None:
    """``invariant.stream_frontier``: under token alignment the frontier falls back to a token end.

    Stop ``Sx`` (never matched) over ``ab|cS|d``: after ``cS`` the held-back ``S`` leaves the byte
    frontier at 3, inside the second token, so token alignment publishes nothing more (2) while
    text and span alignment publish ``c``.

    Kills: ``alignment is TOKEN`` -> ``>`` in ``_frontier`` (no whole-token fallback).
    """
    s = Streamer(PIECES, StopConfig(max_new_tokens=5, stop_strings=["Sx"], alignment=alignment))
    for i in (0, 1, 2):
        s.push(i)
    s.finish(FR.CANCELLED)
    assert _texts(s.chunks) == chunks and s.output.text == "abcSd"


@pytest.mark.parametrize(("pieces", "alignment", "ids", "text"), [
    ([b"ab", b"cS", b"d"], OutputAlignment.TOKEN, (0,), "ab"),
    ([b"ab", b"cS", b"d"], OutputAlignment.TEXT, (0, 1), "abc"),
    ([b"ab", b"cS", b"d"], OutputAlignment.SPAN, (0, 1), "abc"),
    ([b"ab", b"c", b"Sd"], OutputAlignment.TOKEN, (0, 1), "abc"),
    ([b"ab", b"c", b"Sd"], OutputAlignment.TEXT, (0, 1), "abc"),
    ([b"ab", b"c", b"Sd"], OutputAlignment.SPAN, (0, 1, 2), "abc"),
])
def test_a_stop_inside_or_after_a_token_cuts_by_alignment(pieces, alignment, ids, text) -> None:
    """``invariant.output_alignment`` with multi-byte tokens and the stop ``S`` (excluded).

    Token alignment keeps the tokens that end at or before the match start, text alignment the
    fewest tokens that reach it, span alignment every committed token; text and span cut the text
    at the match, token alignment at the last kept token.

    Kills: ``alignment is TOKEN`` -> ``>`` in ``_build_output`` (token text cut at the byte) and
    ``alignment is TOKEN`` -> ``!=`` in the token keep rule (span keeps only the whole tokens
    before the match; token keeps every token).
    """
    s = Streamer(PieceTokenizer(pieces), StopConfig(max_new_tokens=5, stop_strings=["S"], alignment=alignment))
    for i in range(3):
        s.push(i)
        if s.finished:
            break
    assert s.finish_reason is FR.STOP_STRING
    assert s.output.output_ids == ids and s.output.text == text


def test_a_commit_past_a_zero_bound_still_closes_with_length() -> None:
    """``invariant.stop_triggers``: ``length`` fires once ``O >= max_new_tokens``, not only at equality.

    With ``max_new_tokens = 0`` the loop should finish from outside (``finish(length)``); a commit
    made anyway closes the output at once, so it can never stay open past its bound.

    Only ``length`` may close it from outside there, not a content reason such as ``eos``.

    Kills: ``t + 1 >= max_new_tokens`` -> ``==`` or ``is`` in ``push`` (the output stays open);
    ``why is LENGTH`` -> ``why <= LENGTH`` or ``>=`` in ``finish`` (``"eos" <= "length" <=
    "stop_string"``: a content reason accepted).
    """
    s = Streamer(TOK, StopConfig(max_new_tokens=0, eos_ids={2}))
    for reason in (FR.EOS, FR.STOP_STRING):
        with pytest.raises(Rejection) as info:
            s.finish(reason)
        assert info.value.code == "stop.finish_not_allowed"
    s.push(TOK.encode("a")[0])
    assert s.finished and s.finish_reason is FR.LENGTH and s.num_committed == 1


def test_token_alignment_holds_back_the_whole_first_token() -> None:
    """A held-back stop prefix inside the first token holds back all of it under token alignment.

    Stop ``bx`` over the one token ``ab``: the byte frontier is 1, no whole token ends there, so
    the stream frontier is 0 and nothing is published until the next token clears the prefix.

    Kills: the fallback ``else 0`` -> ``else -1`` in ``_frontier`` (the frontier moves backwards).
    """
    s = Streamer(PieceTokenizer([b"ab", b"c"]), StopConfig(max_new_tokens=5, stop_strings=["bx"], alignment="token"))
    assert s.push(0) == [] and s.delivered_bytes == 0
    assert _texts(s.push(1)) == ["abc"]


def test_a_commit_that_moves_no_frontier_past_256_bytes_publishes_nothing() -> None:
    """A commit that adds no publishable byte yields no chunk, at any offset (compared by value).

    Kills: ``upto == start`` -> ``upto is start`` in ``_publish`` (past 256 bytes the two ints are
    distinct objects, so an empty chunk would be published).
    """
    s = Streamer(TOK, StopConfig(max_new_tokens=400))
    for i in TOK.encode("a" * 300):
        s.push(i)
    assert s.push(0) == [] and len(s.chunks) == 300 and s.delivered_bytes == 300


def test_the_matcher_reports_by_default_and_takes_eligible_by_keyword() -> None:
    """``StopMatcher.feed(data, *, eligible=True)``: a match is reported unless told otherwise.

    Kills: the default ``eligible=True`` -> ``False`` (no match reported), and the ``*`` of
    ``feed``'s signature -> ``/`` (``eligible`` then positional).
    """
    m = StopMatcher([b"S"])
    match = m.feed(b"aS")
    assert match is not None and (match.pattern_idx, match.start, match.end) == (0, 1, 2)
    assert StopMatcher([b"S"]).feed(b"aS", eligible=False) is None
    with pytest.raises(TypeError):
        StopMatcher([b"S"]).feed(b"aS", False)


def test_a_commit_past_the_context_bound_still_closes_with_context_length() -> None:
    """``context_length`` fires once ``L + O >= max_context_len``, also when the prompt alone reached it.

    Kills: ``prompt_len + t + 1 >= max_context_len`` -> ``==`` in ``push`` (the output stays open).
    """
    s = Streamer(TOK, StopConfig(max_new_tokens=5, prompt_len=4, max_context_len=4))
    s.push(TOK.encode("a")[0])
    assert s.finished and s.finish_reason is FR.CONTEXT_LENGTH and s.num_committed == 1


def test_the_matcher_holds_back_nothing_outside_a_pattern_prefix() -> None:
    """``StopMatcher.holdback`` (``h_t``) is 0 before any byte and after bytes that start no pattern.

    Kills: the initial ``hold = [0] * n`` -> ``[-1] * n`` (the root's holdback would be -1; the
    streamer's frontier clamps it, the matcher's public ``holdback`` does not).
    """
    m = StopMatcher([b"ab"])
    assert m.holdback == 0
    m.feed(b"x")
    assert m.holdback == 0
    m.feed(b"a")
    assert m.holdback == 1
