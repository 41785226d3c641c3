"""Peers report an ordered vocabulary hash and STATE compares it (M3.8 0x08): HF from its tokenizer, llama.cpp from its vocab API.

llama.cpp may not be installed: its reader is tested on a stand-in of the bindings (the llama.h calls it
makes, answered from a table), and on the real library when present.

Rules checked: invariant.vocab_ordered_identity; ladder.STATE (check vocab.hash); invariant.vocab_added_token_identity
(HF's added tokens against the GGUF).
"""

from __future__ import annotations

import ctypes
import importlib.util

import pytest

from decodespec.checks.adapters import CaseConfig, Observation
from decodespec.checks.adapters.llamacpp import LLAMACPP_SKIP_REASON, llamacpp_vocab_table
from decodespec.checks.adapters.peer import PeerAdapter, peer_vocab_hash
from decodespec.checks.gate.ladder import Expected, check_state
from decodespec.checks.gate.tolerance import Tolerance
from decodespec.checks.gate.vocab_check import reference_vocab
from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.spec.vocab import vocab_table_hash


class _StandInBindings:
    """The llama.h vocabulary calls ``llamacpp_vocab_table`` makes, answered from a table (ids, pieces, attrs, specials)."""

    def __init__(self, pieces, control, bos, eos, pad):
        self.pieces, self.control, self.ids = pieces, set(control), {"bos": bos, "eos": eos, "pad": pad}
        self.calls = 0

    def llama_vocab_n_tokens(self, vocab):
        return len(self.pieces)

    def llama_vocab_get_attr(self, vocab, i):
        return 1 << 3 if i in self.control else 1 << 2  # CONTROL / NORMAL

    def llama_token_to_piece(self, vocab, token, buf, length, lstrip, special):
        self.calls += 1
        piece = self.pieces[token] if special or token not in self.control else b""  # llama.cpp hides control text unless asked
        if len(piece) > length:
            return -len(piece)
        ctypes.memmove(buf, piece, len(piece))
        return len(piece)

    def llama_vocab_bos(self, vocab):
        return self.ids["bos"]

    def llama_vocab_eos(self, vocab):
        return self.ids["eos"]

    def llama_vocab_pad(self, vocab):
        return self.ids["pad"]


def _tiny_pieces(swap=None):
    pieces = [b"<pad>", b"<bos>", b"<eos>"] + [bytes([b]) for b in range(256)] + [b""] * (512 - 259)
    if swap:
        a, b = swap
        pieces[a], pieces[b] = pieces[b], pieces[a]
    return pieces


class _StandInEngine:
    """A peer engine whose vocabulary is read by the llama.cpp reader from a stand-in of the bindings."""

    def __init__(self, bindings, metadata=None):
        self.bindings, self.metadata = bindings, metadata or {}

    def vocab_table(self, config):
        return llamacpp_vocab_table(self.bindings, object(), self.metadata)


def _expected(model):
    ref = reference_vocab(model)
    return Expected(tolerance=Tolerance.from_logit(0.0, 0.0), vocab_hash=ref.vocab_hash, vocab_rows=ref.output_rows)


def test_the_llamacpp_reader_hashes_the_checkpoint_table_on_a_stand_in():
    bindings = _StandInBindings(_tiny_pieces(), [0, 1, 2], bos=1, eos=2, pad=0)
    tokens, specials, control = llamacpp_vocab_table(bindings, object(), {})
    assert control == (0, 1, 2) and specials == {"bos": 1, "eos": 2, "pad": 0, "unk": None}
    assert tokens[0] == b"<pad>" and tokens[3 + 65] == b"A" and tokens[400] == b""
    config = CaseConfig(model="tiny", prompt_ids=(1,))
    digest = peer_vocab_hash(_StandInEngine(bindings), config)
    assert digest == vocab_table_hash(tokens, specials, control) == reference_vocab("tiny").vocab_hash
    obs = Observation(phase="ready", vocab_hash=digest, vocab_rows=512)
    assert check_state(_expected("tiny"), obs) is None


def test_a_piece_longer_than_the_first_buffer_is_read_whole():
    pieces = _tiny_pieces()
    pieces[300] = "é".encode() * 50  # 100 bytes > the 64-byte first buffer
    tokens, _, _ = llamacpp_vocab_table(_StandInBindings(pieces, [0, 1, 2], 1, 2, 0), object(), {})
    assert tokens[300] == pieces[300]


@pytest.mark.parametrize("change, what", [
    ({"swap": (100, 101)}, "two ids swapped"),
    ({"pad": -1}, "pad id absent (LLAMA_TOKEN_NULL)"),
    ({"control": [0, 1]}, "id 2 not a control token"),
])
def test_a_peer_with_another_vocabulary_is_caught_at_state(change, what):
    bindings = _StandInBindings(_tiny_pieces(change.get("swap")), change.get("control", [0, 1, 2]), bos=1, eos=2,
                                pad=change.get("pad", 0))
    digest = peer_vocab_hash(_StandInEngine(bindings), CaseConfig(model="tiny", prompt_ids=(1,)))
    verdict = check_state(_expected("tiny"), Observation(phase="ready", vocab_hash=digest, vocab_rows=512))
    assert verdict is not None and verdict.layer == "STATE" and verdict.check == "vocab.hash", what


def test_a_peer_without_a_table_is_not_compared():
    class NoTable:
        pass

    assert peer_vocab_hash(NoTable(), CaseConfig(model="tiny", prompt_ids=(1,))) is None
    assert check_state(_expected("tiny"), Observation(phase="ready", vocab_hash=None, vocab_rows=512)) is None


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=LLAMACPP_SKIP_REASON)
@requires_smollm2
def test_llamacpp_reports_the_checkpoint_hash():
    from decodespec.checks.adapters.llamacpp import LlamaCppEngine

    digest = peer_vocab_hash(LlamaCppEngine(), CaseConfig(model="smollm2", prompt_ids=(1,)))
    assert digest == reference_vocab("smollm2").vocab_hash


@requires_hf
@requires_smollm2
def test_hf_reports_the_checkpoint_hash_and_a_permuted_hf_tokenizer_fails_state(monkeypatch):
    from decodespec.checks.adapters import hf

    table = hf.hf_vocab_table("smollm2")
    assert table is not None and len(table[0]) == 49152 and table[2] == tuple(range(17))
    config = CaseConfig(model="smollm2", prompt_ids=(1, 504, 3), max_new_tokens=1, eos_ids=(2,))
    assert peer_vocab_hash(hf.HFEngine(), config) == reference_vocab("smollm2").vocab_hash
    assert hf.hf_vocab_table("tiny") is None  # the tiny HF model has no tokenizer: nothing to compare
    # the HF tokenizer with two ids swapped: every shape is right, the identity is not
    tok = hf.hf_tokenizer("smollm2")
    real = type(tok).convert_ids_to_tokens

    def swapped(self, ids, *a, **k):
        return real(self, [{500: 501, 501: 500}.get(i, i) for i in ids], *a, **k)

    hf.hf_vocab_table.cache_clear()
    monkeypatch.setattr(type(tok), "convert_ids_to_tokens", swapped)
    try:
        adapter = PeerAdapter(hf.HFEngine(), "hf")
        adapter.reset(config)
        obs = adapter.observe()
        verdict = check_state(_expected("smollm2"), obs)
        assert verdict is not None and verdict.check == "vocab.hash"
    finally:
        monkeypatch.undo()
        hf.hf_vocab_table.cache_clear()


class _Renamed:
    """An HF tokenizer whose ``added_tokens_decoder`` is edited (content or special flag), everything else delegated."""

    def __init__(self, tok, edits):
        self._tok, self._edits = tok, edits

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    @property
    def added_tokens_decoder(self):
        import copy

        out = {}
        for i, t in self._tok.added_tokens_decoder.items():
            t = copy.copy(t)
            for key, value in self._edits.get(int(i), {}).items():
                setattr(t, key, value)
            out[i] = t
        return out


@requires_hf
@requires_smollm2
def test_hf_added_tokens_keep_their_identity_against_the_gguf():
    """HF's added_tokens_decoder (id <-> content, special flag), encode/decode and HF's rows, judged against the GGUF's declaration."""
    import types

    import torch

    from decodespec.checks.adapters import hf
    from decodespec.checks.gate.vocab_check import audit_hf_added_tokens, declared_added_tokens

    report = audit_hf_added_tokens("smollm2")
    declared = declared_added_tokens("smollm2")
    assert report.passed and len(declared) == 17 and [t.id for t in report.declared] == list(range(17))
    assert report.observed[1].content == "<|im_start|>" and report.observed[1].encodes_to == (1,)
    assert all(o.special and o.embedding_row_error <= 1 for o in report.observed.values())
    # planted: id 1 spelled as another token, id 2 no longer special
    tok = _Renamed(hf.hf_tokenizer("smollm2"), {1: {"content": "<|im_end|>"}, 2: {"special": False}})
    bad = audit_hf_added_tokens("smollm2", tokenizer=tok)
    assert bad.violations == ((1, "string_differs"), (2, "special_flag_differs"))
    # planted: HF's embedding row of id 3 zeroed (a resize that re-initialized it)
    model = hf.hf_model("smollm2")
    embed = model.model.embed_tokens.weight.detach().clone()
    embed[3] = 0
    fake = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=types.SimpleNamespace(weight=embed)),
                                 lm_head=types.SimpleNamespace(weight=model.lm_head.weight))
    assert audit_hf_added_tokens("smollm2", model=fake).violations == ((3, "row_differs"), (3, "row_zero"))
    assert torch.count_nonzero(model.model.embed_tokens.weight[3]) > 0  # the shared model is untouched

