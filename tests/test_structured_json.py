"""Structured completion (M3.10 0x06): the spec's JSON machine, the runtime detector, stdlib json.

Rule under test: ``invariant.json_completion``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from decodespec.impl.structured import JsonCompletionDetector
from decodespec.spec.structured import (
    JsonStatus,
    json_initial,
    json_prefix_status,
    json_status_at_end,
    json_step,
)

C, I, X = JsonStatus.COMPLETE, JsonStatus.INCOMPLETE, JsonStatus.INVALID


def _strict_loads(data: bytes):
    """stdlib json as a third witness, without its NaN/Infinity extension."""
    def no_constants(name: str):
        raise ValueError(name)
    return json.loads(data.decode("utf-8"), parse_constant=no_constants)


def _spec_trace(data: bytes, max_depth: int = 64) -> list[tuple[JsonStatus, int, int | None]]:
    st_ = json_initial(max_depth)
    out = []
    for b in data:
        st_ = json_step(st_, b)
        out.append((st_.status, st_.num_bytes, st_.complete_offset))
    return out


def _impl_trace(data: bytes, max_depth: int = 64) -> list[tuple[JsonStatus, int, int | None]]:
    det = JsonCompletionDetector(max_depth)
    out = []
    for i in range(len(data)):
        det.feed(data[i:i + 1])
        out.append((det.status, det.num_bytes, det.completion_offset))
    return out


@pytest.mark.parametrize(
    "text, status, offset",
    [
        (b'{"a": "}", "b": "\\"}"}', C, 22),          # } and " inside strings are not completion
        (b'{"a": "}", "b": "\\"}"', I, None),
        (b'{"a": {"b": [1, {}]}} trailing', C, 21),   # nested closers are not completion
        (b'{"a": {"b": [1, {}]}', I, None),
        (b"123", I, None),                             # a top-level number needs a delimiter
        (b"123 ", C, 4),
        (b"123}", X, None),
        (b"-0.5e+3\n", C, 8),
        (b"[01", X, None),
        (b"[1.]", X, None),
        (b"  true", C, 6),
        (b"tru", I, None),
        (b"trux", X, None),
        (b'"\\u12', I, None),                          # unicode escape in progress
        (b'"\\u12g', X, None),
        (b'"\\ud800"', C, 8),                          # lone surrogate escapes are grammatical
        (b'"\\q"', X, None),
        (b'"a\nb"', X, None),                          # raw control byte in a string
        (b'"\xe2\x82', I, None),                       # UTF-8 character in progress
        (b'"\xe2\x82\xac"', C, 5),
        (b'"\xe2A', X, None),                          # eagerly invalid, not at the closing quote
        (b'"\xed\xa0', X, None),                       # UTF-16 surrogate in UTF-8
        (b"\x0b1", X, None),                           # vertical tab is not JSON whitespace
        (b"{,}", X, None),
        (b'{"a" 1}', X, None),
        (b"[1,]", X, None),
        (b"", I, None),
        (b"   ", I, None),
        (b'[1, 2] ["second"]', C, 6),                  # nothing after completion is parsed
    ],
)
def test_json_prefix_status_examples(text: bytes, status: JsonStatus, offset: int | None) -> None:
    """invariant.json_completion: hand-checked statuses, identical in spec and runtime."""
    assert json_prefix_status(text) == (status, offset)
    det = JsonCompletionDetector()
    assert det.feed(text) is status
    assert det.completion_offset == offset


def test_top_level_number_completes_at_end_of_output() -> None:
    """invariant.json_completion: "123" is incomplete, but complete if the output ends there."""
    spec_state = json_initial()
    for b in b"123":
        spec_state = json_step(spec_state, b)
    det = JsonCompletionDetector()
    det.feed(b"123")
    assert spec_state.status is I and det.status is I
    assert json_status_at_end(spec_state) is C and det.status_at_end() is C
    det2 = JsonCompletionDetector()
    det2.feed(b"1.")
    assert det2.status_at_end() is I
    assert json_status_at_end(json_initial()) is I


def test_max_depth_bound() -> None:
    """invariant.json_completion: opening past max_depth makes the prefix invalid at that byte."""
    assert json_prefix_status(b"[[[]]]", max_depth=3) == (C, 6)
    assert json_prefix_status(b"[[[[", max_depth=3) == (X, None)
    assert _spec_trace(b"[[[[", 3)[-1] == (X, 4, None)
    det = JsonCompletionDetector(max_depth=3)
    assert det.feed(b"[[[[") is X and det.num_bytes == 4


_ALPHABET = list(b'{}[]",:0123456789-+.eE tfnrulsa\\u/\n\t') + [0x01, 0x0B, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xED, 0xA0, 0x80, 0xF0, 0x9F, 0x98, 0xFF]

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _json_like_bytes(draw) -> bytes:
    """Valid JSON (random spacing, escapes), then optionally cut and mutated; or noise."""
    if draw(st.booleans()):
        return bytes(draw(st.lists(st.sampled_from(_ALPHABET), max_size=24)))
    text = json.dumps(draw(_json_values), ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    data = text.encode("utf-8") + draw(st.sampled_from([b"", b" ", b"\n", b"}", b" x", b"1"]))
    if draw(st.booleans()) and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.sampled_from(_ALPHABET))]) + data[i + draw(st.integers(0, 1)):]
    return data


@given(_json_like_bytes())
@example(b'{"a":01}')
@example(b'"\xed\xa0\x80"')
@example(b"[true false]")
def test_detector_agrees_with_spec_byte_by_byte(data: bytes) -> None:
    """invariant.json_completion: runtime detector == spec machine after every byte."""
    assert _impl_trace(data) == _spec_trace(data)


@given(_json_like_bytes())
def test_spec_agrees_with_stdlib_json(data: bytes) -> None:
    """invariant.json_completion: COMPLETE prefixes parse with stdlib json; INVALID ones never do."""
    status, offset = json_prefix_status(data)
    if status is C:
        assert offset is not None
        _strict_loads(data[:offset])
    elif status is X:
        with pytest.raises((ValueError, UnicodeDecodeError)):
            _strict_loads(data)
    else:
        state = json_initial()
        for b in data:
            state = json_step(state, b)
        try:
            _strict_loads(data)
        except (ValueError, UnicodeDecodeError):
            assert json_status_at_end(state) is not C
        else:
            assert json_status_at_end(state) is C     # a bare top-level number at end of output


@given(_json_values)
def test_every_serialised_value_completes_exactly_at_its_end(value) -> None:
    """invariant.json_completion: json.dumps(v) + " " completes at the last byte of the value (numbers: the space)."""
    data = json.dumps(value).encode("utf-8")
    status, offset = json_prefix_status(data + b" ")
    assert status is C
    expected = len(data) + 1 if isinstance(value, (int, float)) and not isinstance(value, bool) else len(data)
    assert offset == expected
    for cut in range(len(data) - (0 if offset == len(data) + 1 else 1)):
        assert json_prefix_status(data[:cut])[0] is I
