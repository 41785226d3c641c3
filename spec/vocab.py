"""M3.8 0x08 The vocabulary-axis identity contract: the ordered identity, the audit and added tokens.

The last axis of the head's output is not an anonymous class dimension: column ``c`` is the
checkpoint's token id ``c``.  This module states, as pure numpy float64 functions over frozen
attrs values:

* the **ordered vocabulary identity** (:func:`vocab_table_hash`): a content hash of the ordered
  id -> token-bytes table and the special ids, so that a permutation of two tokens, a resized
  table or a moved special id changes it, while equal sizes prove nothing (failure lab 0x12
  items 25, 53);
* the **audit** (:class:`VocabAudit`, :func:`audit_violations`): tokenizer base size, its length
  with added tokens, the added and special ids, embedding rows, output rows and the config's
  ``vocab_size``, printed side by side and checked (every emitted id has an output row, the
  embedding and the head score the same space, special ids agree with the configuration; items
  26, 27);
* migration as a row-address transaction, the mapped-logit oracle and the ownership observation:
  :mod:`decodespec.spec.vocab_migration`; the versioned release bundle and its manifests:
  :mod:`decodespec.spec.vocab_release` (split out so each module holds one concern).

Every rule is registered as ``invariant.vocab_*`` (:mod:`decodespec.spec.rules`).  Bad input is a
typed :class:`~decodespec.spec.errors.Rejection` (``vocab.*`` codes) raised before any work.

Source: M3.8 0x08 ("The last axis is not an anonymous class dimension", "The robust audit prints
all of them", "Vocabulary migration is a row-address transaction", "Append-only growth is safer,
not free", "Tied alias and optimizer restoration order", "Release and rollback ledger"); 0x09
(tied alias); 0x12 items 25-27, 31, 53-56.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.rules import rule

__all__ = [
    "ADDED_TOKEN_VIOLATIONS",
    "AUDIT_VIOLATIONS",
    "INVALID_MAP",
    "INVALID_TABLE",
    "SPECIAL_NAMES",
    "VOCAB_FORMAT",
    "AddedToken",
    "AddedTokenObservation",
    "VocabAudit",
    "added_token_violations",
    "audit_violations",
    "vocab_table_hash",
]

S08 = "M3.8 0x08 The vocabulary-axis identity contract"

INVALID_TABLE = register_code(
    "vocab.invalid_table", "rejection", S08,
    "A vocabulary table is not a sequence of token bytes, names a special id outside it, or an audit field is not a "
    "non-negative integer.",
)
INVALID_MAP = register_code(
    "vocab.invalid_map", "rejection", "M3.8 0x08 Vocabulary migration is a row-address transaction",
    "A vocabulary map is not a partial bijection (an old or new id outside its table, an id mapped twice), new rows have no "
    "declared initialization, or a row-addressed array does not have the old table's row count.",
)

#: The format tag hashed with every table (a change of the hashed layout changes every hash).
VOCAB_FORMAT = "decodespec.vocab.v1"
#: The special-id names the identity binds, in order.
SPECIAL_NAMES = ("bos", "eos", "pad", "unk")


# -- the ordered identity ------------------------------------------------------------------------

def _as_bytes(token: Any, i: int) -> bytes:
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    if isinstance(token, str):
        return token.encode("utf-8")
    raise Rejection(INVALID_TABLE, f"token {i} must be bytes or str, got {type(token).__name__}", f"$.tokens[{i}]")


@rule(
    "invariant.vocab_ordered_identity",
    title="Vocabulary identity is the ordered id -> token table, not its size",
    section=S08,
    statement="The vocabulary identity is a SHA-256 over the ordered table (id i -> the bytes token i stands for, control "
    "tokens marked) and the special ids (bos, eos, pad, unk): swapping two tokens, adding or dropping one, or moving a "
    "special id changes it, while two tables of equal size need not be equal (failure lab 0x12 items 25, 53). Two runtimes "
    "score the same vocabulary only when their hashes are equal.",
)
def vocab_table_hash(tokens: Sequence[Any], specials: Mapping[str, int | None] | None = None,
                     control_ids: Iterable[int] = ()) -> str:
    """``"sha256:<hex>"`` of the ordered vocabulary table.

    Args:
        tokens: ``[V_tok]`` token contents in id order: the bytes each id decodes to (``str`` is
            taken as UTF-8; a control token's own text, e.g. ``"<|im_end|>"``).
        specials: ``{"bos", "eos", "pad", "unk"}`` -> id or ``None`` (missing names are ``None``).
        control_ids: Ids of control (special) tokens; they are marked in the table.

    Returns:
        The content hash (RFC 8785-style canonical JSON: sorted keys, no spaces, UTF-8).

    Raises:
        Rejection: ``vocab.invalid_table`` for a non-bytes token, an unknown special name or a
            special / control id outside ``[0, V_tok)``.

    Source: M3.8 0x08 ("output row ordering matches checkpoint token-ID ordering", "special token IDs
    agree with model configuration"; release gate "deterministic ID table hash").
    """
    table = [_as_bytes(t, i) for i, t in enumerate(tokens)]
    size = len(table)
    specials = dict(specials or {})
    unknown = set(specials) - set(SPECIAL_NAMES)
    if unknown:
        raise Rejection(INVALID_TABLE, f"unknown special names {sorted(unknown)}; known: {list(SPECIAL_NAMES)}", "$.specials")
    special = {}
    for name in SPECIAL_NAMES:
        value = specials.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size):
            raise Rejection(INVALID_TABLE, f"special id {name} = {value!r} is not an id in [0, {size})", f"$.specials.{name}")
        special[name] = None if value is None else int(value)
    control = sorted({int(c) for c in control_ids})
    if control and (control[0] < 0 or control[-1] >= size):
        raise Rejection(INVALID_TABLE, f"control ids must lie in [0, {size})", "$.control_ids")
    body = {"format": VOCAB_FORMAT, "tokens": [t.hex() for t in table], "control": control, "special": special}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- the audit -------------------------------------------------------------------------------------

def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise Rejection(INVALID_TABLE, f"{name} must be an integer >= 0, got {value!r}", f"$.{name}")
    return int(value)


# Named converters of VocabAudit's counts (each names its field in the error).
def _tokenizer_size(v: Any) -> int:
    return _count(v, "tokenizer_size")


def _tokenizer_len(v: Any) -> int:
    return _count(v, "tokenizer_len")


def _embedding_rows(v: Any) -> int:
    return _count(v, "embedding_rows")


def _output_rows(v: Any) -> int:
    return _count(v, "output_rows")


def _config_vocab_size(v: Any) -> int:
    return _count(v, "config_vocab_size")


def _id_tuple(v: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


@attrs.frozen
class VocabAudit:
    """Every vocabulary count of one model + tokenizer, side by side (M3.8 0x08 "The robust audit prints all of them").

    Libraries report these differently (added and reserved tokens are handled apart), so the
    audit records all of them and :func:`audit_violations` judges them together.

    Attributes:
        tokenizer_size: The tokenizer's base table (HF ``tokenizer.vocab_size``).
        tokenizer_len: Base plus added tokens (HF ``len(tokenizer)``): every id it can emit is below it.
        added_ids: Ids of tokens added on top of the base table (``tokenizer_size <= id``).
        special_ids: ``{"bos", "eos", "pad", "unk"}`` -> id or ``None``, from the tokenizer.
        config_special_ids: The same names from the model configuration (``None``: not declared).
        embedding_rows: Rows of the input embedding ``[V_in, d]``.
        output_rows: Rows of the output head ``[V_out, d]`` (the score row's length).
        config_vocab_size: The configuration's ``vocab_size``.
        vocab_hash: :func:`vocab_table_hash` of the tokenizer's ordered table.
        tied: Whether the head is the embedding's Parameter (identity, M3.8 0x09).
    """

    tokenizer_size: int = attrs.field(converter=_tokenizer_size)
    tokenizer_len: int = attrs.field(converter=_tokenizer_len)
    embedding_rows: int = attrs.field(converter=_embedding_rows)
    output_rows: int = attrs.field(converter=_output_rows)
    config_vocab_size: int = attrs.field(converter=_config_vocab_size)
    vocab_hash: str = ""
    added_ids: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)
    special_ids: Mapping[str, int | None] = attrs.field(factory=dict, converter=dict)
    config_special_ids: Mapping[str, int | None] = attrs.field(factory=dict, converter=dict)
    tied: bool = False

    def to_json(self) -> dict[str, Any]:
        """The audit as a JSON object (what ``decodespec vocab-audit --json`` prints)."""
        return {"tokenizer_size": self.tokenizer_size, "tokenizer_len": self.tokenizer_len, "added_ids": list(self.added_ids),
                "special_ids": dict(self.special_ids), "config_special_ids": dict(self.config_special_ids),
                "embedding_rows": self.embedding_rows, "output_rows": self.output_rows,
                "config_vocab_size": self.config_vocab_size, "vocab_hash": self.vocab_hash, "tied": self.tied}


#: The named ways an audit fails (:func:`audit_violations`).
AUDIT_VIOLATIONS: dict[str, str] = {
    "tokenizer_exceeds_output_rows": "the tokenizer can emit an id with no output row (len(tokenizer) > V_out): tokens were "
                                     "added without resizing the head (failure lab 0x12 item 26)",
    "embedding_output_rows_differ": "the input embedding and the output head have different row counts: one was resized "
                                    "alone (item 27), so lookup and scoring address different spaces",
    "config_rows_differ": "the configuration's vocab_size is not the head's row count",
    "added_id_without_row": "an added token's id has no embedding or output row",
    "added_id_in_base_table": "an 'added' id lies inside the base table (added tokens take ids from tokenizer_size upward)",
    "special_id_out_of_range": "a special id is not an id the tokenizer can emit",
    "special_id_mismatch": "a special id differs between the tokenizer and the model configuration",
    "no_vocab_hash": "the audit records no ordered vocabulary hash: sizes alone prove no identity (item 53)",
}


@rule(
    "invariant.vocab_audit",
    title="Tokenizer, embedding, head and config vocabularies agree",
    section=S08,
    statement="The audit records the tokenizer's base size and length with added tokens, the added and special ids, the "
    "embedding rows, the output rows and the config vocab_size, and the ordered vocabulary hash. Every id the tokenizer "
    "can emit has an output row (len(tokenizer) <= V_out; reserved rows above it are allowed), embedding and head have "
    "the same rows, the config states the head's rows, added ids lie above the base table and have rows, and the special "
    "ids lie in the table and agree with the configuration (failure lab 0x12 items 26, 27).",
)
def audit_violations(audit: VocabAudit) -> tuple[str, ...]:
    """The names (:data:`AUDIT_VIOLATIONS`) of every way ``audit`` breaks the contract; empty when it keeps it.

    Args:
        audit: The audit.

    Returns:
        Violation names, in the order of :data:`AUDIT_VIOLATIONS`.

    Source: M3.8 0x08 "The minimum contract is", "The robust audit prints all of them".
    """
    out: list[str] = []
    if audit.tokenizer_len > audit.output_rows:
        out.append("tokenizer_exceeds_output_rows")
    if audit.embedding_rows != audit.output_rows:
        out.append("embedding_output_rows_differ")
    if audit.config_vocab_size != audit.output_rows:
        out.append("config_rows_differ")
    if any(i >= min(audit.embedding_rows, audit.output_rows) for i in audit.added_ids):
        out.append("added_id_without_row")
    if any(i < audit.tokenizer_size for i in audit.added_ids):
        out.append("added_id_in_base_table")
    if any(v is not None and not 0 <= v < audit.tokenizer_len for v in audit.special_ids.values()):
        out.append("special_id_out_of_range")
    for name, value in audit.config_special_ids.items():
        if value is not None and audit.special_ids.get(name) is not None and audit.special_ids[name] != value:
            out.append("special_id_mismatch")
            break
    if not audit.vocab_hash:
        out.append("no_vocab_hash")
    return tuple(out)


# -- added tokens on identity --------------------------------------------------------------------------

@attrs.frozen
class AddedToken:
    """One added or special token as the checkpoint declares it (M3.8 0x08 "added token rows exist").

    Attributes:
        id: Its token id.
        content: Its text (a control token's own spelling, e.g. ``"<|im_start|>"``).
        special: A control token (skipped by ``skip_special_tokens``, never split by BPE).
        text_form: Whether the tokenizer parses ``content`` back to ``id`` (``False`` for a
            tokenizer whose specials have no text form, e.g. the tiny byte tokenizer).
    """

    id: int
    content: str
    special: bool
    text_form: bool = True


@attrs.frozen
class AddedTokenObservation:
    """What a runtime holds for one added token, read by the checker.

    Attributes:
        content: The runtime tokenizer's string for the id (``id_to_token``), ``None`` if it has none.
        special: Whether the runtime marks the id special (control).
        encodes_to: ``encode(content)`` of the runtime (``None``: not asked, no text form).
        decodes_to: ``decode([id], skip_special_tokens=False)`` (``None``: not asked).
        embedding_row_error / output_row_error: ``max |runtime row - checkpoint row| / bound`` of
            the id's input-embedding and output-head rows (``None``: the runtime has no such row;
            ``<= 1``: the checkpoint's row).
        row_zero: The runtime's embedding row is all zeros (never initialized).
    """

    content: str | None
    special: bool
    encodes_to: tuple[int, ...] | None = None
    decodes_to: str | None = None
    embedding_row_error: float | None = None
    output_row_error: float | None = None
    row_zero: bool = False


#: The named ways an added token loses its identity (:func:`added_token_violations`).
ADDED_TOKEN_VIOLATIONS: dict[str, str] = {
    "missing": "a declared added / special token is not an added token of the runtime",
    "undeclared": "the runtime marks an id special that the checkpoint does not declare",
    "string_differs": "the runtime's string for the id is not the declared one (id -> string)",
    "special_flag_differs": "the runtime's special flag differs from the declaration",
    "encode_not_id": "the runtime does not encode the token's text to exactly its id (string -> id)",
    "decode_not_string": "the runtime does not decode the id to the token's text",
    "no_row": "the id has no input-embedding or output-head row (failure lab 0x12 item 26)",
    "row_differs": "the id's embedding or head row is not the checkpoint's (re-initialized or moved)",
    "row_zero": "the id's embedding row is all zeros (never initialized)",
}


@rule(
    "invariant.vocab_added_token_identity",
    title="Added and special tokens keep their identity: id <-> string, special flag and rows",
    section=S08 + " (added token rows exist and were initialized/adapted as intended)",
    statement="Every added or special token the checkpoint declares is an added token of the runtime with the same string "
    "for its id, the same special flag, its text encoding to exactly its id and its id decoding to its text (where the "
    "tokenizer gives specials a text form), and an input-embedding and output-head row that are the checkpoint's rows "
    "(not zero, not re-initialized); the runtime marks no other id special. Values alone (counts, sizes) prove none of "
    "this (failure lab 0x12 items 25, 26).",
)
def added_token_violations(declared: Sequence[AddedToken], observed: Mapping[int, AddedTokenObservation],
                           runtime_special: Iterable[int] = ()) -> tuple[tuple[int, str], ...]:
    """Every ``(id, violation name)`` (:data:`ADDED_TOKEN_VIOLATIONS`) of the runtime's added tokens; empty when all keep their identity.

    Args:
        declared: The checkpoint's added / special tokens.
        observed: ``{id: observation}`` for each declared id the runtime knows (absent: ``missing``).
        runtime_special: Every id the runtime marks special.

    Returns:
        ``(id, name)`` pairs in id order, names in the order of :data:`ADDED_TOKEN_VIOLATIONS`.

    Source: M3.8 0x08 ("special token IDs agree with model configuration", "added token rows exist
    and were initialized/adapted as intended", "Equal row counts do not prove equal vocabulary
    semantics").
    """
    order = list(ADDED_TOKEN_VIOLATIONS)
    out: list[tuple[int, str]] = []
    known = {t.id for t in declared}
    for tok in sorted(declared, key=lambda t: t.id):
        obs = observed.get(tok.id)
        if obs is None:
            out.append((tok.id, "missing"))
            continue
        bad = []
        if obs.content != tok.content:
            bad.append("string_differs")
        if obs.special != tok.special:
            bad.append("special_flag_differs")
        if tok.text_form and obs.encodes_to is not None and obs.encodes_to != (tok.id,):
            bad.append("encode_not_id")
        if tok.text_form and obs.decodes_to is not None and obs.decodes_to != tok.content:
            bad.append("decode_not_string")
        if obs.embedding_row_error is None or obs.output_row_error is None:
            bad.append("no_row")
        elif not (obs.embedding_row_error <= 1.0 and obs.output_row_error <= 1.0):
            bad.append("row_differs")
        if obs.row_zero:
            bad.append("row_zero")
        out.extend((tok.id, name) for name in sorted(bad, key=order.index))
    out.extend((int(i), "undeclared") for i in sorted({int(i) for i in runtime_special} - known))
    return tuple(sorted(out, key=lambda p: (p[0], order.index(p[1]))))
