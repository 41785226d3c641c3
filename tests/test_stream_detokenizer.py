"""Incremental detokenization (rule ``invariant.decoder_frontier``, M3.10 0x06 "Deriving the stream holdback").

The claim the streamer rests on: for byte-level BPE the tokenizer's decode is the UTF-8 decode
(U+FFFD for invalid sequences) of the concatenated token bytes, so a decoded prefix is stable
exactly when it ends before any trailing valid-but-incomplete UTF-8 sequence.
"""

from __future__ import annotations

import codecs

from hypothesis import example, given
from hypothesis import strategies as st

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.stream import IncrementalDetokenizer
from decodespec.impl.structured import utf8_pending
from decodespec.impl.tokenizer import ByteTokenizer
from decodespec.spec.stop import decoder_frontier, utf8_pending_len

_BYTES = st.binary(max_size=12) | st.lists(
    st.sampled_from([b"\xf0", b"\x9f", b"\x98", b"\x80", b"\xe2", b"\x82", b"\xac", b"\xed", b"\xa0", b"\xc3", b"a", b"\xff"]),
    max_size=8).map(b"".join)


@given(_BYTES)
@example(b"\xed\xa0")
@example(b"\xe0\x80")
def test_stdlib_decoder_pending_equals_spec_table(data: bytes) -> None:
    """invariant.decoder_frontier: the runtime's decoder holdback == the spec's RFC 3629 table."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i in range(len(data)):
        dec.decode(data[i:i + 1])
        assert len(utf8_pending(dec)) == utf8_pending_len(data[:i + 1])


@given(_BYTES, st.integers(0, 12))
def test_stable_prefix_never_changes(data: bytes, cut: int) -> None:
    """invariant.decoder_frontier: the decode of bytes before the frontier is a prefix of every later decode."""
    prefix = data[:cut]
    f = decoder_frontier(prefix)
    stable = prefix[:f].decode("utf-8", errors="replace")
    assert data.decode("utf-8", errors="replace").startswith(stable)


def test_detokenizer_on_byte_tokenizer() -> None:
    """invariant.decoder_frontier: bytes of a split euro sign are held until complete; EOS adds nothing."""
    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok)
    stables = []
    for i in tok.encode("a€") + [tok.eos_token_id]:
        det.push(i)
        stables.append(det.stable_len)
    assert stables == [1, 1, 1, 4, 4]
    assert det.token_ends == [1, 2, 3, 4, 4] and det.stable_after == stables
    assert det.text() == "a€"


@requires_smollm2
@given(st.data())
def test_smollm2_decode_is_utf8_of_concatenated_token_bytes(data) -> None:
    """invariant.decoder_frontier: tokenizer.decode(ids) == UTF-8 decode of the detokenizer's bytes."""
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1) | st.sampled_from(tok.encode("😀 日本語 é")), max_size=12))
    det = IncrementalDetokenizer(tok)
    for i in ids:
        det.push(i)
        stable = det.text(0, det.stable_len)
        assert tok.decode(ids, skip_special_tokens=True).startswith(stable)
    assert det.text() == tok.decode(ids, skip_special_tokens=True)
    assert det.stable_len == decoder_frontier(det.data)
