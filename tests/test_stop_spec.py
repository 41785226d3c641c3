"""Stop criteria in the spec and the runtime matcher (M3.10 0x06): holdback, match rule, triggers, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.impl.stream import StopMatcher
from decodespec.spec.enums import FinishReason as FR
from decodespec.spec.errors import ERROR_CODES, Rejection, ResourceLimit
from decodespec.spec.rules import RULES
from decodespec.spec.stop import (
    MAX_STOP_PATTERN_BYTES,
    MAX_STOP_STRINGS,
    OutputAlignment,
    StopConfig,
    StopMatch,
    find_stop_match,
    resolve_finish,
    step_triggers,
    stop_holdback,
    utf8_pending_len,
)


@pytest.mark.parametrize(
    "data, h",
    [(b"hello", 0), (b"hello<", 1), (b"hello<ST", 3), (b"hello<STOP", 5), (b"hello<STOP>", 0), (b"<S<", 1), (b"", 0)],
)
def test_holdback_seed_table(data: bytes, h: int) -> None:
    """invariant.stream_holdback: the seed's <STOP> table ("hello<" holds "<", "hello<ST" holds "<ST")."""
    assert stop_holdback(data, [b"<STOP>"]) == h


def test_holdback_takes_the_longest_proper_prefix_over_all_patterns() -> None:
    """invariant.stream_holdback: overlapping and prefix-sharing patterns."""
    pats = [b"abc", b"bcd", b"ab"]
    assert stop_holdback(b"xab", pats) == 2      # "ab" is a proper prefix of "abc"
    assert stop_holdback(b"xbc", pats) == 2      # "bc" of "bcd"
    assert stop_holdback(b"xa", pats) == 1
    assert stop_holdback(b"abcd", pats) == 0     # full matches are not proper prefixes


def test_match_rule_earliest_end_then_longest_then_first_listed() -> None:
    """invariant.stop_match_rule: earliest-ending match; same end -> longest; same bytes -> first listed."""
    assert find_stop_match(b"xxabcd", [b"abcd", b"bc"]) == StopMatch(1, 3, 5)       # "bc" ends first
    assert find_stop_match(b"xxabcd", [b"cd", b"abcd"]) == StopMatch(1, 2, 6)       # same end: longest
    assert find_stop_match(b"xxabcd", [b"cd", b"cd"]) == StopMatch(0, 4, 6)         # duplicates: first
    assert find_stop_match(b"abab", [b"bab"], eligible_from=3) == StopMatch(0, 1, 4)  # may start before
    assert find_stop_match(b"abab", [b"ab"], eligible_from=3) == StopMatch(0, 2, 4)
    assert find_stop_match(b"abab", [b"zz"]) is None


def test_runtime_matcher_on_the_same_examples() -> None:
    """invariant.stop_match_rule: the Aho-Corasick matcher picks the same matches, fed token by token."""
    m = StopMatcher([b"abcd", b"bc"])
    assert m.feed(b"xxa") is None and m.holdback == 1
    assert m.feed(b"bcd") == StopMatch(1, 3, 5)
    m = StopMatcher([b"cd", b"abcd"])
    assert m.feed(b"xxab") is None and m.holdback == 2
    assert m.feed(b"cd") == StopMatch(1, 2, 6)
    m = StopMatcher([b"ab"])
    assert m.feed(b"ab", eligible=False) is None and m.feed(b"ab") == StopMatch(0, 2, 4)


_PATTERN_BYTES = st.binary(min_size=1, max_size=4).map(lambda b: bytes(x % 3 + 97 for x in b))


@given(st.lists(_PATTERN_BYTES, min_size=1, max_size=4),
       st.lists(st.binary(max_size=4).map(lambda b: bytes(x % 4 + 97 for x in b)), max_size=12))
def test_runtime_matcher_equals_spec_definitions(patterns: list[bytes], pieces: list[bytes]) -> None:
    """invariant.stop_match_rule / invariant.stream_holdback: AC matcher == naive spec scan, per token."""
    m = StopMatcher(patterns)
    data = b""
    for piece in pieces:
        found = m.feed(piece)
        expected = find_stop_match(data + piece, patterns, eligible_from=len(data))
        assert found == expected
        if found is not None:
            return
        data += piece
        assert m.holdback == stop_holdback(data, patterns)


def test_triggers_and_min_new_tokens_suppression() -> None:
    """invariant.stop_triggers: EOS and stop strings wait for min_new_tokens; length does not."""
    cfg = StopConfig(max_new_tokens=5, eos_ids={2}, min_new_tokens=2, stop_strings=["ab"])
    assert step_triggers(cfg, [7, 2], [b"ab", b""]) == (frozenset(), None, None)             # t=1 < 2
    assert step_triggers(cfg, [7, 2, 2], [b"ab", b"", b""])[0] == {FR.EOS}                  # t=2: EOS ok, old match not
    assert step_triggers(cfg, [7, 8, 9], [b"ab", b"x", b"ab"])[1] == StopMatch(0, 3, 5)      # match in token 2
    assert step_triggers(cfg, [7, 8, 9], [b"xa", b"x", b"b"])[0] == frozenset()              # "ab" not contiguous
    assert step_triggers(cfg, [7, 8, 9], [b"x", b"a", b"b"])[1] == StopMatch(0, 1, 3)        # starts in a suppressed token
    five = [1, 1, 1, 1, 2]
    assert step_triggers(cfg, five, [b""] * 5)[0] == {FR.EOS, FR.LENGTH}
    ctx = StopConfig(max_new_tokens=9, prompt_len=6, max_context_len=8)
    assert step_triggers(ctx, [1, 1], [b"", b""])[0] == {FR.CONTEXT_LENGTH}


def test_finish_precedence_resolution() -> None:
    """invariant.finish_precedence: one canonical reason, every trigger recorded in order."""
    assert resolve_finish({FR.LENGTH, FR.EOS, FR.STOP_STRING}) == (FR.STOP_STRING, (FR.STOP_STRING, FR.EOS, FR.LENGTH))
    assert resolve_finish({FR.STRUCTURED, FR.STREAM_ERROR}) == (FR.STREAM_ERROR, (FR.STREAM_ERROR, FR.STRUCTURED))
    assert resolve_finish({FR.CONTEXT_LENGTH, FR.LENGTH})[0] is FR.CONTEXT_LENGTH


@pytest.mark.parametrize(
    "kwargs, kind, code",
    [
        ({"stop_strings": [""]}, Rejection, "stop.empty_pattern"),
        ({"stop_strings": "abc"}, Rejection, "stop.pattern_type"),
        ({"stop_strings": [b"abc"]}, Rejection, "stop.pattern_type"),
        ({"stop_strings": ["\ud800"]}, Rejection, "stop.pattern_type"),
        ({"stop_strings": ["x"] * (MAX_STOP_STRINGS + 1)}, ResourceLimit, "stop.too_many_patterns"),
        ({"stop_strings": ["é" * (MAX_STOP_PATTERN_BYTES // 2 + 1)]}, ResourceLimit, "stop.pattern_too_long"),
        ({"min_new_tokens": 11}, Rejection, "stop.invalid_count"),
        ({"min_new_tokens": -1}, Rejection, "stop.invalid_count"),
        ({"max_context_len": 0}, Rejection, "stop.invalid_count"),
        ({"eos_ids": {-1}}, Rejection, "stop.invalid_count"),
        ({"max_json_depth": 0}, Rejection, "stop.invalid_count"),
        ({"alignment": "words"}, Rejection, "stop.invalid_alignment"),
    ],
)
def test_bad_stop_config_is_a_typed_error(kwargs: dict, kind: type, code: str) -> None:
    """Typed errors for bad stop input, with registered codes and a JSON path."""
    with pytest.raises(kind) as info:
        StopConfig(max_new_tokens=10, **kwargs)
    assert info.value.code == code and code in ERROR_CODES
    assert info.value.path.startswith("$.")


def test_config_encodes_patterns_and_declares_holdback() -> None:
    """A config keeps the UTF-8 encodings; only excluded stops need holdback."""
    cfg = StopConfig(max_new_tokens=3, stop_strings=["é<", "x"], alignment="span")
    assert cfg.stop_patterns == (b"\xc3\xa9<", b"x") and cfg.alignment is OutputAlignment.SPAN
    assert cfg.holds_back_stop
    assert not StopConfig(max_new_tokens=3, stop_strings=["x"], include_stop_str=True).holds_back_stop
    assert not StopConfig(max_new_tokens=3).holds_back_stop


def test_utf8_pending_len_table() -> None:
    """invariant.decoder_frontier: trailing incomplete-but-valid UTF-8 only (RFC 3629 Table 3-7)."""
    cases = {b"a": 0, b"\xe2": 1, b"\xe2\x82": 2, b"\xe2\x82\xac": 0, b"\xf0\x9f\x98": 3, b"\xe2A": 0,
             b"\xed\xa0": 0, b"\xed\x9f": 2, b"\xe0\x80": 0, b"\xf4\x90": 0, b"\x80": 0, b"\xc3\xc3": 1, b"": 0}
    for data, n in cases.items():
        assert utf8_pending_len(data) == n, data


def test_every_stop_rule_is_registered() -> None:
    """The rules this module states are in the registry (docs render them)."""
    for rid in ("invariant.stream_holdback", "invariant.stop_match_rule", "invariant.stop_triggers",
                "invariant.finish_precedence", "invariant.stream_frontier", "invariant.stream_prefix",
                "invariant.stream_final", "invariant.stream_no_stop_bytes", "invariant.chunk_metadata",
                "invariant.output_alignment", "invariant.decoder_frontier", "invariant.json_completion"):
        assert rid in RULES, rid
