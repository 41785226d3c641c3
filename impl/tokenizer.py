"""Tokenizers: SmolLM2's byte-level BPE from the GGUF metadata, and a byte tokenizer for the tiny model.

The SmolLM2 tokenizer is built with the well-kept ``tokenizers`` library from the file's own
metadata (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``, special ids and the chat
template), exactly as HF transformers' GGUF conversion builds it
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer`` plus
``add_gguf_special_tokens``), so its ids equal HF's for the same text.  The chat template is
rendered with Jinja2 in a sandbox, like HF's ``apply_chat_template``.

Both tokenizers expose :meth:`token_bytes`, the exact bytes a token contributes to the decoded
stream, which the incremental detokenizer and the stop matcher work on (M3.10 0x06
"Deriving the stream holdback").

Source: M3.10 "Source-to-tensor trace before the first decision" (M2.1 owns the tokenizer;
M3.10 consumes its ids); M3.8 0x08 "The vocabulary-axis identity contract".
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from decodespec.spec.errors import Rejection
from decodespec.spec.vocab import vocab_table_hash

from .gguf import UNSUPPORTED_ARCHITECTURE, read_metadata

__all__ = ["ByteTokenizer", "GGUFTokenizer", "bytes_to_unicode", "load_smollm2_tokenizer"]

# GGUF token types (llama.cpp gguf-py constants).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE vocabularies.

    Source: openai/gpt-2 ``encoder.py`` (the same table ``tokenizers``' ByteLevel uses).
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class _OrderedTable:
    """The ordered vocabulary table and its identity, shared by the two tokenizers.

    ``vocab_hash`` is :func:`decodespec.spec.vocab.vocab_table_hash` -- the one definition of
    the vocabulary identity (M3.8 0x08) -- of :meth:`vocab_table`; ``sha256`` is its older name
    (what the request envelope's ``text_interface.tokenizer_sha256`` states).
    """

    vocab_size: int
    special_ids: frozenset[int]
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None

    def token_bytes(self, token_id: int) -> bytes:  # pragma: no cover - each tokenizer defines it
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:  # pragma: no cover - each tokenizer defines it
        raise NotImplementedError

    def vocab_table(self) -> tuple[list[bytes], dict[str, int | None], list[int]]:
        """``(tokens [V], specials, control ids)``: ``tokens[i]`` is ``token_bytes(i)``, a control token's own text.

        Specials are ``bos/eos/pad/unk`` -> id or ``None``.
        """
        control = sorted(int(i) for i in self.special_ids)
        ctrl = set(control)
        tokens = [self.id_to_token(i).encode("utf-8") if i in ctrl else self.token_bytes(i) for i in range(self.vocab_size)]
        specials = {"bos": self.bos_token_id, "eos": self.eos_token_id, "pad": self.pad_token_id, "unk": self.unk_token_id}
        return tokens, specials, control

    @property
    def vocab_hash(self) -> str:
        """The ordered vocabulary hash (``"sha256:<hex>"``) of :meth:`vocab_table`, computed once per table code."""
        key = (type(self).token_bytes, type(self).id_to_token, self.vocab_size)
        cached = self.__dict__.get("_vocab_hash")
        if cached is None or cached[0] != key:
            cached = (key, vocab_table_hash(*self.vocab_table()))
            self.__dict__["_vocab_hash"] = cached
        return str(cached[1])

    @property
    def sha256(self) -> str:
        """Older name of :attr:`vocab_hash` (the envelope's ``text_interface.tokenizer_sha256``), read for compatibility."""
        return self.vocab_hash


class GGUFTokenizer(_OrderedTable):
    """Byte-level BPE tokenizer built from GGUF metadata.

    Attributes:
        vocab_size: Number of token ids V (49152 for SmolLM2).
        bos_token_id, eos_token_id, pad_token_id, unk_token_id: Special ids from the file.
        special_ids: Ids of control tokens (never byte content; decoded to their text only when
            ``skip_special_tokens=False``).
        chat_template: The Jinja2 chat template string from the file.
        vocab_hash / sha256: The ordered vocabulary hash (:func:`decodespec.spec.vocab.vocab_table_hash`
            of :meth:`vocab_table`; the identity bound into the request envelope, M3.8 0x08).
        program_sha256: Hash of the tokenizer as a program (spellings, merges, token types and
            special ids): two tokenizers with one table and different merges split text apart.
            Before the two hashes were unified it was ``sha256``; an envelope stating it is still
            admitted (``decodespec generate``).
    """

    def __init__(self, metadata: dict[str, Any]):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise Rejection(UNSUPPORTED_ARCHITECTURE, f"tokenizer model {model!r} is not byte-level BPE ('gpt2')", "$.text_interface")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        merges: list[str] = list(metadata.get("tokenizer.ggml.merges", []))
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): idx
            for idx, tok in enumerate(tokens)
        }
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False)
        backend = Tokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        control = [
            AddedToken(tok, normalized=False, special=True)
            for tok, typ in zip(tokens, token_types)
            if typ == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet
        ]
        if control:
            backend.add_special_tokens(control)
        user_defined = [
            AddedToken(tok, normalized=False, special=False)
            for tok, typ in zip(tokens, token_types)
            if typ == _TOKEN_TYPE_USER_DEFINED and tok in vocab
        ]
        if user_defined:
            backend.add_tokens(user_defined)
        self._backend = backend
        self._tokens = tokens
        self.vocab_size = len(tokens)
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.pad_token_id: int | None = metadata.get("tokenizer.ggml.padding_token_id")
        self.unk_token_id: int | None = metadata.get("tokenizer.ggml.unknown_token_id")
        self.add_bos_token: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.special_ids = frozenset(
            idx for idx, typ in enumerate(token_types) if typ == _TOKEN_TYPE_CONTROL
        )
        unicode_to_byte = {c: b for b, c in spelling.items()}
        self._token_bytes: list[bytes] = []
        for idx, tok in enumerate(tokens):
            if idx in self.special_ids or not set(tok) <= alphabet:
                self._token_bytes.append(tok.encode("utf-8"))
            else:
                self._token_bytes.append(bytes(unicode_to_byte[c] for c in tok))
        h = hashlib.sha256()
        h.update(json.dumps({"tokens": tokens, "merges": merges, "types": token_types,
                             "special": [self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id]},
                            ensure_ascii=False).encode("utf-8"))
        self.program_sha256 = "sha256:" + h.hexdigest()

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its id.

        Shapes: returns ``int[T]``.
        """
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 decodes to U+FFFD, as HF does)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` contributes to the decoded byte stream.

        Byte-level BPE decodes by concatenating these and decoding UTF-8 once, so
        ``b"".join(token_bytes(i) for i in ids).decode("utf-8", "replace") == decode(ids)``.

        Raises:
            IndexError: for an id outside ``[0, vocab_size)``.
        """
        if token_id < 0:
            raise IndexError(token_id)
        return self._token_bytes[token_id]

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary spelling of ``token_id``."""
        return self._tokens[token_id]

    # -- chat template ----------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the file's chat template (Jinja2 sandbox, HF conventions).

        Raises:
            Rejection: ``model.unsupported_architecture`` if the file carries no chat template.
        """
        if not self.chat_template:
            raise Rejection(UNSUPPORTED_ARCHITECTURE, "the model file carries no chat template", "$.text_interface")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._tokens[self.bos_token_id] if self.bos_token_id is not None else "",
            eos_token=self._tokens[self.eos_token_id] if self.eos_token_id is not None else "",
        )


class ByteTokenizer(_OrderedTable):
    """A byte tokenizer for the tiny model: id = byte + ``NUM_SPECIAL``; ids 0..2 are PAD, BOS, EOS.

    ``vocab_size`` may exceed ``256 + NUM_SPECIAL``; the extra ids decode to no bytes.  It has
    the same interface as :class:`GGUFTokenizer`, so stop strings, UTF-8 holdback and streaming
    can be exercised on the tiny model without any file.
    """

    NUM_SPECIAL = 3

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + self.NUM_SPECIAL:
            raise ValueError(f"vocab_size must be >= {256 + self.NUM_SPECIAL}")
        self.vocab_size = vocab_size
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2
        self.unk_token_id = None
        self.add_bos_token = True
        self.chat_template = None
        self.special_ids = frozenset({0, 1, 2})
        self.program_sha256 = "sha256:" + hashlib.sha256(f"decodespec.byte-tokenizer.v1:{vocab_size}".encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``'s UTF-8 bytes (no BOS added)."""
        return [b + self.NUM_SPECIAL for b in text.encode("utf-8")]

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of ``token_id``: one byte for byte tokens, nothing for special or extra ids."""
        if token_id < 0 or token_id >= self.vocab_size:
            raise IndexError(token_id)
        if self.NUM_SPECIAL <= token_id < 256 + self.NUM_SPECIAL:
            return bytes([token_id - self.NUM_SPECIAL])
        return b""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """UTF-8 text of ``ids`` (invalid sequences become U+FFFD)."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return repr(self.token_bytes(token_id)) if token_id not in self.special_ids else ["<pad>", "<bos>", "<eos>"][token_id]

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """A fixed plain-text template (the tiny model has no trained template)."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


@functools.lru_cache(maxsize=2)
def _load(path: str) -> GGUFTokenizer:
    return GGUFTokenizer(read_metadata(path))


def load_smollm2_tokenizer(path: str | Path | None = None) -> GGUFTokenizer:
    """The SmolLM2 tokenizer from the GGUF file (cached per path).

    Raises:
        Rejection: ``model.file_missing`` when the file is not installed.
    """
    from .gguf import smollm2_path

    return _load(str(path or smollm2_path()))
