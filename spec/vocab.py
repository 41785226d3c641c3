"""M3.8 0x08 The vocabulary-axis identity contract: ordered identity, the audit, and migration as a row-address transaction.

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
* **migration** as a row-address transaction (:class:`VocabMap`, :class:`NewRowInit`,
  :func:`migrate_rows`, :func:`migrate_state`): an explicit partial bijection from retained old
  ids to new ids, applied by the *same* map to every row-addressed object -- embedding, head,
  bias, master weights and optimizer moments --, new rows initialized as declared (moments of new
  rows zero), a tied table migrated once (items 54-56);
* the **mapped raw-logit oracle** (:func:`mapped_logit_gap`): for a fixed hidden row, the new
  head's raw logit at ``pi(v)`` equals the old head's at ``v`` for every retained ``v``; and the
  **probability drift** of appended rows (:func:`append_drift`): old raw logits unchanged, old
  probabilities all scaled by ``1 - m_new`` where ``m_new`` is the probability mass the new rows
  take (``log p_new[pi(v)] - log p_old[v] = log(1 - m_new)`` for every kept ``v``);
* the migration **ownership observation** (:class:`MigrationObservation`,
  :func:`migration_violations`): alias restored once, one optimizer state per shared Parameter,
  moments moved by the map, new rows as declared.

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
from decodespec.spec.vocab_parallel import shard_ranges

__all__ = [
    "ADDED_TOKEN_VIOLATIONS",
    "AUDIT_VIOLATIONS",
    "BUNDLE_FORMAT",
    "BUNDLE_MANIFESTS",
    "BUNDLE_PARTS",
    "INVALID_BUNDLE",
    "INVALID_MAP",
    "INVALID_TABLE",
    "MANIFEST_VIOLATIONS",
    "MIGRATION_VIOLATIONS",
    "NEW_ROW_INITS",
    "PARAM_USES",
    "SPECIAL_NAMES",
    "TIE_MODES",
    "VOCAB_FORMAT",
    "AddedToken",
    "AddedTokenObservation",
    "AppendDrift",
    "MigrationObservation",
    "NewRowInit",
    "OptimizerManifest",
    "OptimizerParam",
    "PolicyManifest",
    "ReleaseBundle",
    "ShardManifest",
    "VocabAudit",
    "VocabMap",
    "added_token_violations",
    "append_drift",
    "audit_violations",
    "bundle_violations",
    "manifest_violations",
    "map_digest",
    "mapped_logit_gap",
    "migrate_rows",
    "migrate_state",
    "migration_violations",
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


# -- migration ---------------------------------------------------------------------------------------

@attrs.frozen(eq=False)
class VocabMap:
    """An explicit partial bijection ``pi`` from retained old ids to new ids (M3.8 0x08).

    Attributes:
        old_size: ``V_old``.
        new_size: ``V_new``.
        old_ids: ``int64[K]`` retained old ids (the set ``K``).
        new_ids: ``int64[K]``: ``pi(old_ids[k]) = new_ids[k]``.

    Every new id not in ``new_ids`` is a **new row** and needs a declared initialization.  The
    map is immutable; :meth:`new_rows` lists the new ids, :meth:`inverse` maps new -> old.
    """

    old_size: int
    new_size: int
    old_ids: np.ndarray
    new_ids: np.ndarray

    @classmethod
    def create(cls, old_size: int, new_size: int, old_to_new: Mapping[int, int] | Sequence[tuple[int, int]]) -> VocabMap:
        """Validate and build a map.

        Raises:
            Rejection: ``vocab.invalid_map`` when an id is outside its table or mapped twice
                (``pi`` must be injective on ``K``).
        """
        old_size, new_size = _count(old_size, "old_size"), _count(new_size, "new_size")
        pairs = sorted(dict(old_to_new).items())  # a mapping or (old, new) pairs
        old = np.array([int(a) for a, _ in pairs], dtype=np.int64)
        new = np.array([int(b) for _, b in pairs], dtype=np.int64)
        if old.size and (old.min() < 0 or old.max() >= old_size):
            raise Rejection(INVALID_MAP, f"retained old ids must lie in [0, {old_size})", "$.old_to_new")
        if new.size and (new.min() < 0 or new.max() >= new_size):
            raise Rejection(INVALID_MAP, f"new ids must lie in [0, {new_size})", "$.old_to_new")
        if np.unique(new).size != new.size:
            dup = int(new[np.flatnonzero(np.diff(np.sort(new)) == 0)[0]]) if new.size > 1 else -1
            raise Rejection(INVALID_MAP, f"new id {dup} is the image of two old ids: the map is not a bijection on K", "$.old_to_new")
        old.setflags(write=False)
        new.setflags(write=False)
        return cls(old_size, new_size, old, new)

    @classmethod
    def append_only(cls, old_size: int, new_size: int) -> VocabMap:
        """Keep every old id where it is (``pi(v) = v``) and append ``new_size - old_size`` rows.

        Raises:
            Rejection: ``vocab.invalid_map`` when ``new_size < old_size``.
        """
        if new_size < old_size:
            raise Rejection(INVALID_MAP, f"append-only growth needs new_size >= old_size, got {new_size} < {old_size}", "$.new_size")
        return cls.create(old_size, new_size, {v: v for v in range(old_size)})

    @classmethod
    def permutation(cls, perm: Sequence[int]) -> VocabMap:
        """The full permutation ``pi(v) = perm[v]`` (``V_new = V_old``).

        Raises:
            Rejection: ``vocab.invalid_map`` when ``perm`` is not a permutation of ``range(V)``.
        """
        p = [int(x) for x in perm]
        if sorted(p) != list(range(len(p))):
            raise Rejection(INVALID_MAP, "perm must be a permutation of range(V)", "$.perm")
        return cls.create(len(p), len(p), dict(enumerate(p)))

    def new_rows(self) -> np.ndarray:
        """``int64[V_new - K]``: new ids with no old row (ascending)."""
        mask = np.ones(self.new_size, dtype=bool)
        mask[self.new_ids] = False
        return np.flatnonzero(mask)

    def to_json(self) -> dict[str, Any]:
        """The map as a manifest entry: sizes and the ``[old, new]`` pairs."""
        return {"old_size": self.old_size, "new_size": self.new_size,
                "pairs": [[int(a), int(b)] for a, b in zip(self.old_ids, self.new_ids)]}


#: Declared initializations of new rows (M3.8 0x08 "New rows need declared initialization").
NEW_ROW_INITS = ("zeros", "mean", "copy", "values")


@attrs.frozen(eq=False)
class NewRowInit:
    """The declared initialization of new rows: a design choice, never a default.

    Attributes:
        kind: ``zeros``; ``mean`` (each new row the mean of the listed old rows, e.g. the
            source subtokens); ``copy`` (a semantically related old row); ``values`` (given rows,
            e.g. checkpoint-style random draws or a separately trained initialization).
        sources: For ``mean``: ``{new id: (old ids...)}``; for ``copy``: ``{new id: old id}``.
            New ids not listed take the mean of all old rows (``mean``) -- never silently zero.
        values: For ``values``: ``[n_new, ...]`` rows in the order of :meth:`VocabMap.new_rows`.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(NEW_ROW_INITS))
    sources: Mapping[int, Any] = attrs.field(factory=dict, converter=dict)
    values: np.ndarray | None = None


def _rows_array(rows: Any, name: str, old_size: int) -> np.ndarray:
    try:
        arr = np.asarray(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise Rejection(INVALID_MAP, f"{name} must hold real numbers: {exc}", f"$.{name}") from None
    if arr.ndim < 1 or arr.shape[0] != old_size:
        raise Rejection(INVALID_MAP, f"{name} must have V_old = {old_size} rows, got shape {arr.shape}", f"$.{name}")
    return arr


@rule(
    "invariant.vocab_migration_rows",
    title="Migration moves every row-addressed object by one map; new rows are initialized as declared",
    section="M3.8 0x08 Vocabulary migration is a row-address transaction",
    statement="Given a partial bijection pi from retained old ids to new ids, E_new[pi(v)] = E_old[v] and b_new[pi(v)] = "
    "b_old[v] for every retained v, and the same map moves master weights and optimizer moments (m_new[pi(v)] = m_old[v], "
    "u_new[pi(v)] = u_old[v]). A new row gets the declared initialization (zeros, the mean of source rows, a copied "
    "related row, or given values), its optimizer moments zero; an undeclared initialization is refused. Untied models "
    "move embedding and head rows by the same map; a tied model migrates its one table once (failure lab 0x12 item 55).",
)
def migrate_rows(rows: Any, vmap: VocabMap, init: NewRowInit | None) -> tuple[np.ndarray, np.ndarray]:
    """One row-addressed array through the map.

    Args:
        rows: ``[V_old, ...]`` (an embedding ``[V, d]``, a bias ``[V]``, a moment of either).
        vmap: The map.
        init: The declared initialization of new rows; may be ``None`` only when there are none.

    Returns:
        ``(new_rows [V_new, ...] float64, copied bool[V_new])``: ``copied[n]`` when row ``n``
        came from an old row.

    Raises:
        Rejection: ``vocab.invalid_map`` (row count, new rows without a declared init, a source id
            outside the old table, ``values`` of the wrong shape).

    Source: M3.8 0x08 ``migrate_vocab_rows(old_rows, old_to_new, new_size, init_new)``.
    """
    old = _rows_array(rows, "rows", vmap.old_size)
    fresh = vmap.new_rows()
    new = np.zeros((vmap.new_size, *old.shape[1:]))
    copied = np.zeros(vmap.new_size, dtype=bool)
    new[vmap.new_ids] = old[vmap.old_ids]
    copied[vmap.new_ids] = True
    if fresh.size:
        if init is None:
            raise Rejection(INVALID_MAP, f"{fresh.size} new rows need a declared initialization", "$.init")
        if init.kind == "mean":
            for n in fresh:
                src = np.asarray(init.sources.get(int(n), range(vmap.old_size)), dtype=np.int64).reshape(-1)
                if src.size == 0 or src.min() < 0 or src.max() >= vmap.old_size:
                    raise Rejection(INVALID_MAP, f"mean sources of new row {int(n)} must be old ids in [0, {vmap.old_size})",
                                    f"$.init.sources.{int(n)}")
                new[n] = old[src].mean(axis=0)
        elif init.kind == "copy":
            for n in fresh:
                source_id = init.sources.get(int(n))
                if source_id is None or not 0 <= int(source_id) < vmap.old_size:
                    raise Rejection(INVALID_MAP, f"new row {int(n)} has no old row to copy", f"$.init.sources.{int(n)}")
                new[n] = old[int(source_id)]
        elif init.kind == "values":
            vals = np.asarray(init.values, dtype=np.float64) if init.values is not None else None
            if vals is None or vals.shape != (fresh.size, *old.shape[1:]):
                raise Rejection(INVALID_MAP, f"values must be [{fresh.size}, ...] rows for the new ids", "$.init.values")
            new[fresh] = vals
        # "zeros": already zero
    return new, copied


#: The conventional names of row-addressed optimizer state (torch Adam/AdamW): new rows start at zero.
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def migrate_state(tensors: Mapping[str, Any], vmap: VocabMap, init: NewRowInit | Mapping[str, NewRowInit] | None,
                  moments: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """Every row-addressed tensor and its optimizer moments through one map (the transaction).

    Args:
        tensors: ``{name: [V_old, ...]}``: embedding, head (absent when tied: one table), bias,
            master copies.
        vmap: The map.
        init: Declared initialization of new *parameter* rows (see :func:`migrate_rows`), one for
            every tensor or ``{name: init}`` (e.g. a bias whose weight gets ``values`` rows).
        moments: ``{name: {moment key: [V_old, ...]}}`` (e.g. ``exp_avg``, ``exp_avg_sq``);
            retained rows move by the map, new rows are zero (the usual Adam-like contract).

    Returns:
        ``(tensors_new, moments_new)`` with the same keys.

    Raises:
        Rejection: as :func:`migrate_rows`; a moment for a tensor not in ``tensors``.

    Source: M3.8 0x08 ("Optimizer moments and any row-shaped master weights must follow the same
    address transform"; "Adam-like moments for genuinely new rows are usually initialized to zero").
    """
    inits = dict(init) if isinstance(init, Mapping) else {name: init for name in tensors}
    out = {name: migrate_rows(rows, vmap, inits.get(name))[0] for name, rows in tensors.items()}
    out_m: dict[str, dict[str, np.ndarray]] = {}
    for name, state in (moments or {}).items():
        if name not in tensors:
            raise Rejection(INVALID_MAP, f"optimizer moments of {name!r}, which is not migrated", f"$.moments.{name}")
        out_m[name] = {key: migrate_rows(value, vmap, NewRowInit("zeros"))[0] for key, value in state.items()}
    return out, out_m


@rule(
    "invariant.vocab_mapped_logits",
    title="Mapped raw-logit oracle: old logits equal new logits under the map",
    section="M3.8 0x08 Append-only growth is safer, not free",
    statement="For a fixed hidden row h, the migrated head's raw logit at pi(v) equals the old head's raw logit at v for "
    "every retained id v (weights and bias moved by the map); a migration that moves rows to the wrong address, or not "
    "at all, breaks it at the moved ids even when every shape is right.",
)
def mapped_logit_gap(old_logits: Any, new_logits: Any, vmap: VocabMap) -> tuple[float, int]:
    """``max |z_new[:, pi(v)] - z_old[:, v]|`` over retained ids, and the worst old id.

    Args:
        old_logits: ``[R, V_old]`` raw logits of the old head for hidden rows ``H``.
        new_logits: ``[R, V_new]`` raw logits of the migrated head for the same rows.
        vmap: The map.

    Returns:
        ``(gap, worst_old_id)`` (``-1`` when no id is retained).  Units: logits.

    Raises:
        Rejection: ``vocab.invalid_map`` when the shapes do not match the map.
    """
    zo = np.atleast_2d(np.asarray(old_logits, dtype=np.float64))
    zn = np.atleast_2d(np.asarray(new_logits, dtype=np.float64))
    if zo.shape[1] != vmap.old_size or zn.shape[1] != vmap.new_size or zo.shape[0] != zn.shape[0]:
        raise Rejection(INVALID_MAP, f"logits {zo.shape} / {zn.shape} do not match V_old = {vmap.old_size}, V_new = {vmap.new_size}",
                        "$.logits")
    if vmap.old_ids.size == 0:
        return 0.0, -1
    diff = np.abs(zn[:, vmap.new_ids] - zo[:, vmap.old_ids]).max(axis=0)  # [K]
    k = int(np.argmax(diff))
    return float(diff[k]), int(vmap.old_ids[k])


@attrs.frozen(eq=False)
class AppendDrift:
    """How appended rows move old probabilities (M3.8 0x08 "Append-only growth is safer, not free").

    Attributes:
        new_mass: ``[R]``: probability mass the new rows take, ``m_new = sum_{n new} p_new[n]``.
        dropped_mass: ``[R]``: old mass of the ids the map drops, ``m_drop = sum_{v not in K} p_old[v]``
            (0 for append-only growth).
        log_shift: ``[R]``: ``log p_new[pi(v)] - log p_old[v]``, the same for every kept ``v``
            and equal to ``log(1 - m_new) - log(1 - m_drop)`` (``log(1 - m_new)`` append-only).
        expected_shift: ``[R]``: that closed form, from the two masses.
        shift_spread: ``[R]``: ``max - min`` of that shift over kept ids (0 up to rounding: the
            old distribution is rescaled, never reshaped).
        max_abs_prob_change: ``[R]``: ``max_v |p_new[pi(v)] - p_old[v]|``.
        logit_gap: The mapped raw-logit gap (:func:`mapped_logit_gap`).

    Units: probability, nats, logits.
    """

    new_mass: np.ndarray
    dropped_mass: np.ndarray
    log_shift: np.ndarray
    expected_shift: np.ndarray
    shift_spread: np.ndarray
    max_abs_prob_change: np.ndarray
    logit_gap: float


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1, keepdims=True)
    out: np.ndarray = z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))
    return out


@rule(
    "invariant.vocab_append_drift",
    title="Appended rows keep old raw logits and rescale old probabilities by 1 - m_new",
    section="M3.8 0x08 Append-only growth is safer, not free",
    statement="After an append-only growth with old weights and bias unchanged, the old ids' raw logits are identical, but "
    "their probabilities are not: the new rows enter the softmax denominator, so log p_new[v] - log p_old[v] = "
    "log(1 - m_new) for every old v, m_new the mass the new rows take (log(1 - m_new) - log(1 - m_drop) when the map also "
    "drops ids of old mass m_drop). Claiming old probabilities unchanged is refused "
    "whenever m_new > 0 (failure lab 0x12 item 54); the drift is measured, not assumed.",
)
def append_drift(old_logits: Any, new_logits: Any, vmap: VocabMap) -> AppendDrift:
    """Measure the probability drift of a migration on fixed hidden rows.

    Args:
        old_logits: ``[R, V_old]`` old raw logits (finite).
        new_logits: ``[R, V_new]`` migrated raw logits of the same hidden rows (finite).
        vmap: The map (any partial bijection; ``new_mass`` counts every unmapped new row).

    Returns:
        :class:`AppendDrift`.

    Raises:
        Rejection: ``vocab.invalid_map`` (shapes), ``vocab.invalid_table`` (non-finite logits).
    """
    gap, _ = mapped_logit_gap(old_logits, new_logits, vmap)
    zo = np.atleast_2d(np.asarray(old_logits, dtype=np.float64))
    zn = np.atleast_2d(np.asarray(new_logits, dtype=np.float64))
    if not (np.isfinite(zo).all() and np.isfinite(zn).all()):
        raise Rejection(INVALID_TABLE, "drift is measured on finite logits", "$.logits")
    lpo, lpn = _log_softmax(zo), _log_softmax(zn)
    fresh = vmap.new_rows()
    new_mass = np.exp(lpn[:, fresh]).sum(axis=1) if fresh.size else np.zeros(zo.shape[0])
    dropped = np.ones(vmap.old_size, dtype=bool)
    dropped[vmap.old_ids] = False
    dropped_mass = np.exp(lpo[:, dropped]).sum(axis=1) if dropped.any() else np.zeros(zo.shape[0])
    shift = lpn[:, vmap.new_ids] - lpo[:, vmap.old_ids]  # [R, K]
    return AppendDrift(
        new_mass=new_mass,
        dropped_mass=dropped_mass,
        expected_shift=np.log1p(-new_mass) - np.log1p(-dropped_mass),
        log_shift=shift.mean(axis=1) if shift.size else np.zeros(zo.shape[0]),
        shift_spread=(shift.max(axis=1) - shift.min(axis=1)) if shift.size else np.zeros(zo.shape[0]),
        max_abs_prob_change=np.abs(np.exp(lpn[:, vmap.new_ids]) - np.exp(lpo[:, vmap.old_ids])).max(axis=1) if shift.size
        else np.zeros(zo.shape[0]),
        logit_gap=gap,
    )


# -- the migration's ownership -----------------------------------------------------------------------

#: The named ways a migrated model + optimizer breaks the transaction (:func:`migration_violations`).
MIGRATION_VIOLATIONS: dict[str, str] = {
    "rows_not_mapped": "a retained token's row is not the old row under the map (wrong address, or not moved)",
    "new_rows_not_declared": "a new row differs from its declared initialization",
    "alias_not_restored": "the model declares tied embeddings, but after migration the head is not the embedding's Parameter",
    "stale_optimizer_parameter": "the optimizer still holds a Parameter the model no longer uses (created before the swap)",
    "optimizer_duplicate_state": "the shared table has more than one optimizer entry or moment slot (re-tied after restore)",
    "moments_not_mapped": "an optimizer moment of a retained row is not the old row's moment under the map (item 55)",
    "new_moments_not_zero": "an optimizer moment of a new row is not zero",
    "bias_not_mapped": "the head's bias was not moved by the map (tying ties the weight, never the [V] bias)",
}


@attrs.frozen(eq=False)
class MigrationObservation:
    """What a migrated runtime holds, read from torch by the checker (M3.8 0x08 "Tied alias and optimizer restoration order").

    Attributes:
        declared_tied: The configuration's ``tie_word_embeddings``.
        tied_after: ``lm_head.weight is embed_tokens.weight`` after the migration.
        rows: ``{name: [V_new, ...]}`` the migrated Parameters (``embed``, ``head`` when untied, ``bias``).
        moments: ``{name: {key: [V_new, ...]}}`` the optimizer moments of those Parameters.
        optimizer_entries: Parameter-group entries that are a vocabulary Parameter of the model.
        stale_entries: Parameter-group entries that are vocabulary-shaped but not the model's.
        state_slots: Optimizer state slots over vocabulary-shaped Parameters.
    """

    declared_tied: bool
    tied_after: bool
    rows: Mapping[str, np.ndarray]
    moments: Mapping[str, Mapping[str, np.ndarray]] = attrs.field(factory=dict)
    optimizer_entries: int | None = None
    stale_entries: int = 0
    state_slots: int | None = None


@rule(
    "invariant.vocab_migration_owner",
    title="After migration: rows and moments under the map, one alias and one optimizer owner",
    section="M3.8 0x08 Tied alias and optimizer restoration order",
    statement="A migrated model holds every retained row (embedding, head, bias) and every optimizer moment at its mapped "
    "address, new rows as declared and their moments zero; when tying is declared the head is the embedding's Parameter "
    "again (alias restored once), and the optimizer holds exactly the model's vocabulary Parameters -- no stale object "
    "from before the swap, one entry and one moment slot per shared Parameter (failure lab 0x12 items 31, 55, 56).",
)
def migration_violations(obs: MigrationObservation, expected_rows: Mapping[str, np.ndarray],
                         expected_moments: Mapping[str, Mapping[str, np.ndarray]], vmap: VocabMap,
                         *, atol: float = 0.0) -> tuple[str, ...]:
    """The names (:data:`MIGRATION_VIOLATIONS`) of every way ``obs`` differs from the spec's migration.

    Args:
        obs: The migrated runtime.
        expected_rows / expected_moments: :func:`migrate_state` of the old runtime's rows/moments.
        vmap: The map.
        atol: Absolute tolerance of a row comparison (0 for float64 runtimes; the checker passes
            the storage dtype's rounding of the largest old value, never a typed-in number).

    Returns:
        Violation names, in the order of :data:`MIGRATION_VIOLATIONS`.
    """
    out: list[str] = []
    kept, fresh = vmap.new_ids, vmap.new_rows()

    def close(a: np.ndarray, b: np.ndarray) -> bool:
        return a.shape == b.shape and bool(np.all(np.abs(a - b) <= atol))

    for name, want in expected_rows.items():
        got = np.asarray(obs.rows.get(name, np.zeros(0)), dtype=np.float64)
        if got.shape != want.shape or not close(got[kept], want[kept]):
            out.append("bias_not_mapped" if name == "bias" else "rows_not_mapped")
        elif fresh.size and not close(got[fresh], want[fresh]):
            out.append("new_rows_not_declared")
    if obs.declared_tied and not obs.tied_after:
        out.append("alias_not_restored")
    if obs.stale_entries:
        out.append("stale_optimizer_parameter")
    want_slots = 1 if obs.declared_tied else len([n for n in expected_rows if n != "bias"])
    if (obs.optimizer_entries is not None and obs.optimizer_entries > want_slots + ("bias" in expected_rows)) or \
            (obs.state_slots is not None and obs.state_slots > want_slots + ("bias" in expected_rows)):
        out.append("optimizer_duplicate_state")
    for name, state in expected_moments.items():
        got_state = obs.moments.get(name, {})
        for key, want in state.items():
            got = np.asarray(got_state.get(key, np.zeros(0)), dtype=np.float64)
            if got.shape != want.shape or not close(got[kept], want[kept]):
                out.append("moments_not_mapped")
            elif fresh.size and np.any(got[fresh] != 0):
                out.append("new_moments_not_zero")
    order = list(MIGRATION_VIOLATIONS)
    return tuple(sorted(dict.fromkeys(out), key=order.index))


# -- 0x08: encoder-decoder vocabularies and the migration transaction ---------------------------

@attrs.frozen
class EncDecVocab:
    """The vocabulary facts of an encoder-decoder, read by the checker.

    Attributes:
        source_hash, target_hash: Ordered vocabulary hashes (:func:`vocab_table_hash`) of
            ``V_src`` (source ids) and ``V_tgt`` (target decoder ids).
        source_size, target_size: ``|V_src|``, ``|V_tgt|``.
        source_rows, target_rows, output_rows: Rows of the source embedding, the target
            embedding and the output head (the Generator's projection).
        source_table, target_table, output_weight: Identity keys of those three Parameters.
    """

    source_hash: str
    target_hash: str
    source_size: int
    target_size: int
    source_rows: int
    target_rows: int
    output_rows: int
    source_table: str
    target_table: str
    output_weight: str


#: Violation names of :func:`encdec_violations`.
ENCDEC_VIOLATIONS: dict[str, str] = {
    "source_rows": "the source embedding's rows are not |V_src|",
    "target_rows": "the target embedding's rows are not |V_tgt|",
    "output_rows": "the output head's rows are not |V_tgt|",
    "output_over_source": "the output head is the source table while V_src and V_tgt are different ordered vocabularies",
    "target_over_source": "the target embedding is the source table while V_src and V_tgt are different ordered vocabularies",
}


@rule(
    "invariant.vocab_encdec_identity",
    title="Source ids address V_src, target ids and output logits address V_tgt",
    section="M3.8 0x08 The vocabulary-axis identity contract",
    statement="In an encoder-decoder, source ids address V_src (source embedding rows = |V_src|), target decoder ids and the "
    "output logits address V_tgt (target embedding and head rows = |V_tgt|). V_src and V_tgt are two identities, compared by "
    "their ordered hashes, never by size: a target embedding or output head bound to the source table is refused unless the "
    "two ordered vocabularies are one.",
)
def encdec_violations(obs: EncDecVocab) -> tuple[str, ...]:
    """The names (:data:`ENCDEC_VIOLATIONS`) of every way ``obs`` mixes the two vocabularies; empty when it keeps them apart.

    Source: M3.8 0x08 ("For encoder-decoder models: source IDs address V_src, target decoder
    IDs address V_tgt, output logits usually use V_tgt"; "Equal row counts do not prove equal
    vocabulary semantics"), 0x09 ("different source and target vocabularies: blind three-way
    tying is invalid").
    """
    out = []
    if obs.source_rows != obs.source_size:
        out.append("source_rows")
    if obs.target_rows != obs.target_size:
        out.append("target_rows")
    if obs.output_rows != obs.target_size:
        out.append("output_rows")
    one = obs.source_hash == obs.target_hash
    if obs.output_weight == obs.source_table and not one:
        out.append("output_over_source")
    if obs.target_table == obs.source_table and not one:
        out.append("target_over_source")
    return tuple(out)


@attrs.frozen
class MigrationSnapshot:
    """A fingerprint of everything a vocabulary migration may touch (read by the checker before and after).

    Attributes:
        params: ``((name, identity key, sha256 of the values), ...)`` for the embedding, head and
            bias Parameters.
        tied: ``lm_head.weight is embed_tokens.weight``.
        vocab_size: The configuration's ``vocab_size``.
        optimizer_params: Identity keys of every parameter-group entry, in order.
        optimizer_state: sha256 over every optimizer state entry (the Parameter's key, each
            tensor's name and bytes).
    """

    params: tuple[tuple[str, str, str], ...]
    tied: bool
    vocab_size: int
    optimizer_params: tuple[str, ...] = ()
    optimizer_state: str = ""


#: Violation names of :func:`transaction_violations`.
TRANSACTION_VIOLATIONS: dict[str, str] = {
    "model_changed": "a vocabulary Parameter's object or values differ from before the failed migration",
    "tie_changed": "the tied alias differs from before",
    "config_changed": "the configuration's vocab_size differs from before",
    "optimizer_changed": "the optimizer's parameter groups or state differ from before",
}


@rule(
    "invariant.vocab_migration_transaction",
    title="A failed vocabulary migration leaves model, tie and optimizer exactly as before",
    section="M3.8 0x08 Release and rollback ledger",
    statement="A migration is a transaction over every row-addressed object: if any step fails after validation, the "
    "embedding, head and bias Parameters (objects and values), the tied alias, the configuration's vocab_size, the "
    "optimizer's parameter groups and its state are exactly those of before -- the previous release bundle, not an inverse "
    "permutation of a half-applied one.",
)
def transaction_violations(before: MigrationSnapshot, after: MigrationSnapshot) -> tuple[str, ...]:
    """The names (:data:`TRANSACTION_VIOLATIONS`) of what a failed migration left changed; empty when rolled back.

    Source: M3.8 0x08 "Release and rollback ledger" ("Reliable rollback restores the complete
    previous release bundle"), "Tied alias and optimizer restoration order".
    """
    out = []
    if before.params != after.params:
        out.append("model_changed")
    if before.tied != after.tied:
        out.append("tie_changed")
    if before.vocab_size != after.vocab_size:
        out.append("config_changed")
    if (before.optimizer_params, before.optimizer_state) != (after.optimizer_params, after.optimizer_state):
        out.append("optimizer_changed")
    return tuple(out)


# -- 0x08: the versioned release bundle ------------------------------------------------------------

INVALID_BUNDLE = register_code(
    "vocab.invalid_bundle", "rejection", "M3.8 0x08 Release and rollback ledger",
    "A release bundle is not a JSON object of the declared format, or one of its parts has the wrong type.",
)
#: The format tag of a release bundle manifest.
BUNDLE_FORMAT = "decodespec.release.v2"
#: The tie modes a bundle may state.
TIE_MODES = ("tied", "untied")
#: The parts of a bundle, in the order they are compared and named.
BUNDLE_PARTS = ("version", "checkpoint_sha256", "tokenizer_sha256", "vocab_hash", "table_size", "special_ids", "added_tokens",
                "embedding_rows", "output_rows", "config_vocab_size", "tie", "optimizer", "shards", "policy", "migration", "parent")
#: The manifests a bundle must state (``optimizer`` may be declared absent, never left out).
BUNDLE_MANIFESTS = ("optimizer", "shards", "policy")


def _bundle_str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Rejection(INVALID_BUNDLE, f"expected a non-empty string, got {v!r}", "$")
    return v


def _bundle_opt_str(v: Any) -> str | None:
    return None if v is None else _bundle_str(v)


def _bundle_added(v: Any) -> tuple[tuple[int, str, bool], ...]:
    try:
        return tuple((int(i), str(c), bool(s)) for i, c, s in v)
    except (TypeError, ValueError):
        raise Rejection(INVALID_BUNDLE, "added_tokens must be [id, content, special] triples", "$.added_tokens") from None


def _bundle_migration(v: Any) -> VocabMap | None:
    if v is None or isinstance(v, VocabMap):
        return v
    try:
        return VocabMap.create(int(v["old_size"]), int(v["new_size"]), [(int(a), int(b)) for a, b in v["pairs"]])
    except (TypeError, KeyError, ValueError):
        raise Rejection(INVALID_BUNDLE, "migration must be a map manifest {old_size, new_size, pairs}", "$.migration") from None


def _bundle_tie(v: Any) -> str:
    if v not in TIE_MODES:
        raise Rejection(INVALID_BUNDLE, f"tie must be one of {TIE_MODES}, got {v!r}", "$.tie")
    return str(v)


def _bundle_specials(v: Any) -> dict[str, int | None]:
    if not isinstance(v, Mapping) or set(v) - set(SPECIAL_NAMES):
        raise Rejection(INVALID_BUNDLE, f"special_ids must map {list(SPECIAL_NAMES)} to ids", "$.special_ids")
    return {k: None if v.get(k) is None else int(v[k]) for k in SPECIAL_NAMES}


def _bundle_count(v: Any) -> int:
    return _count(v, "bundle row count")


def _canonical_digest(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return "sha256:" + hashlib.sha256(data).hexdigest()


def map_digest(vmap: VocabMap) -> str:
    """``"sha256:<hex>"`` of a migration map's manifest entry (:meth:`VocabMap.to_json`): what an optimizer manifest names.

    Source: M3.8 0x08 "Tied alias and optimizer restoration order" (step 2: "immutable old-to-new mapping").
    """
    return _canonical_digest(vmap.to_json())


def _bad_manifest(part: str, what: str) -> Rejection:
    return Rejection(INVALID_BUNDLE, f"{part} manifest: {what}", f"$.{part}")


#: The row-addressed uses a vocabulary Parameter can have (its optimizer entry names them).
PARAM_USES = ("embed", "head", "bias")


@attrs.frozen
class OptimizerParam:
    """One optimizer-owned vocabulary Parameter in the optimizer manifest: digests and counts, never raw tensors.

    Attributes:
        name: The Parameter's state-dict name (e.g. ``"model.embed_tokens.weight"``).
        uses: Which row-addressed uses the one Parameter serves (:data:`PARAM_USES`): a tied table
            is ``("embed", "head")``; empty: a Parameter the model no longer uses (stale).
        rows: The Parameter's row count.
        states: ``((key, rows, sha256), ...)`` of its row-addressed optimizer state tensors
            (``exp_avg``, ``exp_avg_sq``, master copies), sorted by key.
        new_rows: Ids of rows the release's migration created (their state starts declared).
        new_rows_zero: Every state tensor is zero at ``new_rows``.
    """

    name: str
    uses: tuple[str, ...]
    rows: int
    states: tuple[tuple[str, int, str], ...]
    new_rows: tuple[int, ...] = ()
    new_rows_zero: bool = True

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON."""
        return {"name": self.name, "uses": list(self.uses), "rows": self.rows,
                "states": [{"key": k, "rows": r, "sha256": d} for k, r, d in self.states],
                "new_rows": list(self.new_rows), "new_rows_zero": self.new_rows_zero}

    @classmethod
    def from_json(cls, obj: Any) -> OptimizerParam:
        """Parse an entry.

        Raises:
            Rejection: ``vocab.invalid_bundle`` for a missing or mistyped field.
        """
        try:
            uses = tuple(str(u) for u in obj["uses"])
            if set(uses) - set(PARAM_USES):
                raise ValueError(f"uses must be among {PARAM_USES}")
            return cls(str(obj["name"]), uses, _count(obj["rows"], "rows"),
                       tuple(sorted((str(e["key"]), _count(e["rows"], "rows"), str(e["sha256"])) for e in obj["states"])),
                       tuple(int(i) for i in obj.get("new_rows", ())), bool(obj.get("new_rows_zero", True)))
        except (TypeError, KeyError, ValueError) as exc:
            raise _bad_manifest("optimizer", f"a parameter entry is {{name, uses, rows, states[, new_rows, new_rows_zero]}}: {exc}") from None


@attrs.frozen
class OptimizerManifest:
    """The optimizer / master-state row of the ledger (M3.8 0x08): one state per shared Parameter, moved by the release's map.

    Attributes:
        absent: ``True`` for an inference-only release, which ships no optimizer state -- a
            declaration, never a silent omission.
        reason: Why it is absent (required when ``absent``).
        params: One :class:`OptimizerParam` per optimizer-owned vocabulary Parameter.
        map_digest: :func:`map_digest` of the migration the state was moved by (``None``: not
            migrated; must be the release's own map when the release has one).
    """

    absent: bool = False
    reason: str = ""
    params: tuple[OptimizerParam, ...] = ()
    map_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON (``{"absent": true, "reason": ...}`` when absent)."""
        if self.absent:
            return {"absent": True, "reason": self.reason}
        return {"absent": False, "map_digest": self.map_digest, "params": [p.to_json() for p in self.params]}

    @classmethod
    def from_json(cls, obj: Any) -> OptimizerManifest:
        """Parse the manifest.

        Raises:
            Rejection: ``vocab.invalid_bundle`` for a non-object or mistyped entry.
        """
        if not isinstance(obj, Mapping):
            raise _bad_manifest("optimizer", "expected an object (an inference-only release states {\"absent\": true, \"reason\": ...})")
        if obj.get("absent") is True:
            return cls(True, str(obj.get("reason", "")))
        digest = obj.get("map_digest")
        return cls(False, "", tuple(OptimizerParam.from_json(p) for p in obj.get("params", ())), None if digest is None else str(digest))


@attrs.frozen
class ShardManifest:
    """The shards row of the ledger: contiguous global row ranges and their owners.

    Attributes:
        world_size: Ranks the vocabulary axis is split over (1: one process holds every row).
        ranges: ``((start, stop, owner rank), ...)``: rank ``owner`` holds global rows ``[start, stop)``.
    """

    world_size: int
    ranges: tuple[tuple[int, int, int], ...]

    @classmethod
    def even(cls, rows: int, ranks: int = 1) -> ShardManifest:
        """The even contiguous split of ``rows`` over ``ranks`` (:func:`decodespec.spec.vocab_parallel.shard_ranges`: the
        first ``rows mod ranks`` own one row more), rank ``r`` owning range ``r``.

        Raises:
            Rejection: ``vocab_parallel.invalid_layout`` when ``ranks < 1`` or ``ranks > rows``.
        """
        return cls(ranks, tuple((a, b, r) for r, (a, b) in enumerate(shard_ranges(rows, ranks))))

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON."""
        return {"world_size": self.world_size, "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, obj: Any) -> ShardManifest:
        """Parse the manifest.

        Raises:
            Rejection: ``vocab.invalid_bundle`` for a missing or mistyped field.
        """
        try:
            return cls(_count(obj["world_size"], "world_size"), tuple((int(a), int(b), int(o)) for a, b, o in obj["ranges"]))
        except (TypeError, KeyError, ValueError):
            raise _bad_manifest("shards", "expected {world_size, ranges: [[start, stop, owner], ...]}") from None


def _id_seqs(v: Iterable[Iterable[Any]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_id_tuple(seq) for seq in v)


@attrs.frozen
class PolicyManifest:
    """The local-policy row of the ledger: the special ids and legal-token masks the decoding policy was written for.

    Attributes:
        vocab_hash: The ordered vocabulary hash the policy's ids address (:func:`vocab_table_hash`).
        special_ids: ``bos/eos/pad/unk`` -> id or ``None``, as the policy uses them.
        eos_ids: The ids the policy stops on.
        bad_words_ids: Banned id sequences (HF ``bad_words_ids``).
        logit_bias_ids: The ids a logit bias is keyed by.
    """

    vocab_hash: str
    special_ids: dict[str, int | None] = attrs.field(converter=_bundle_specials)
    eos_ids: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)
    bad_words_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_id_seqs)
    logit_bias_ids: tuple[int, ...] = attrs.field(default=(), converter=_id_tuple)

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON."""
        return {"vocab_hash": self.vocab_hash, "special_ids": dict(self.special_ids), "eos_ids": list(self.eos_ids),
                "bad_words_ids": [list(s) for s in self.bad_words_ids], "logit_bias_ids": list(self.logit_bias_ids)}

    @classmethod
    def from_json(cls, obj: Any) -> PolicyManifest:
        """Parse the manifest.

        Raises:
            Rejection: ``vocab.invalid_bundle`` for a missing or mistyped field.
        """
        try:
            return cls(str(obj["vocab_hash"]), obj["special_ids"], obj.get("eos_ids", ()), obj.get("bad_words_ids", ()),
                       obj.get("logit_bias_ids", ()))
        except (TypeError, KeyError, ValueError):
            raise _bad_manifest("policy", "expected {vocab_hash, special_ids, eos_ids, bad_words_ids, logit_bias_ids}") from None


def _opt_manifest(v: Any) -> OptimizerManifest | None:
    return v if v is None or isinstance(v, OptimizerManifest) else OptimizerManifest.from_json(v)


def _shard_manifest(v: Any) -> ShardManifest | None:
    return v if v is None or isinstance(v, ShardManifest) else ShardManifest.from_json(v)


def _policy_manifest(v: Any) -> PolicyManifest | None:
    return v if v is None or isinstance(v, PolicyManifest) else PolicyManifest.from_json(v)


@attrs.frozen(eq=False)
class ReleaseBundle:
    """One versioned release of the vocabulary axis: every part that must move together (M3.8 0x08 "Release and rollback ledger").

    Attributes:
        version: The release's name and version (e.g. ``"smollm2-135m-instruct-q4_1@1"``).
        checkpoint_sha256: The checkpoint file's SHA-256 (model rows and bias).
        tokenizer_sha256: The tokenizer as a program (spellings, merges, types, specials:
            ``tokenizer.program_sha256``): one ordered table can be split by two merge lists.
        vocab_hash: The ordered vocabulary hash (:func:`vocab_table_hash`).
        table_size: Entries of the ordered table (``V_tok``).
        special_ids: ``bos/eos/pad/unk`` -> id or ``None``.
        added_tokens: ``(id, content, special)`` of every added / special token.
        embedding_rows, output_rows: Rows of the input embedding and of the output head.
        config_vocab_size: The configuration's ``vocab_size``.
        tie: ``"tied"`` (one Parameter) or ``"untied"``.
        optimizer: The optimizer / master-state manifest (:class:`OptimizerManifest`; declared
            absent for an inference-only release); ``None``: not stated (refused in a bundle; in
            a loaded reading, not observed).
        shards: The shard manifest (:class:`ShardManifest`); ``None`` as for ``optimizer``.
        policy: The local-policy manifest (:class:`PolicyManifest`); ``None`` as for ``optimizer``.
        migration: The map (:class:`VocabMap`) that made this release's rows from its parent's,
            or ``None`` (a first release).
        parent: The :meth:`digest` of the previous release bundle -- the rollback target, restored
            whole, never an inverse permutation -- or ``None``.
    """

    version: str = attrs.field(converter=_bundle_str)
    checkpoint_sha256: str = attrs.field(converter=_bundle_str)
    tokenizer_sha256: str = attrs.field(converter=_bundle_str)
    vocab_hash: str = attrs.field(converter=_bundle_str)
    table_size: int = attrs.field(converter=_bundle_count)
    special_ids: dict[str, int | None] = attrs.field(converter=_bundle_specials)
    added_tokens: tuple[tuple[int, str, bool], ...] = attrs.field(converter=_bundle_added)
    embedding_rows: int = attrs.field(converter=_bundle_count)
    output_rows: int = attrs.field(converter=_bundle_count)
    config_vocab_size: int = attrs.field(converter=_bundle_count)
    tie: str = attrs.field(converter=_bundle_tie)
    optimizer: OptimizerManifest | None = attrs.field(default=None, converter=_opt_manifest)
    shards: ShardManifest | None = attrs.field(default=None, converter=_shard_manifest)
    policy: PolicyManifest | None = attrs.field(default=None, converter=_policy_manifest)
    migration: VocabMap | None = attrs.field(default=None, converter=_bundle_migration)
    parent: str | None = attrs.field(default=None, converter=_bundle_opt_str)

    def part(self, name: str) -> Any:
        """The JSON value of part ``name`` (one of :data:`BUNDLE_PARTS`)."""
        value = getattr(self, name)
        if name in ("migration", *BUNDLE_MANIFESTS):
            return None if value is None else value.to_json()
        if name == "added_tokens":
            return [list(t) for t in value]
        return dict(value) if name == "special_ids" else value

    def to_json(self) -> dict[str, Any]:
        """The manifest: ``{"format": BUNDLE_FORMAT, <part>: value, ...}``."""
        return {"format": BUNDLE_FORMAT, **{name: self.part(name) for name in BUNDLE_PARTS}}

    def digest(self) -> str:
        """``"sha256:<hex>"`` of the canonical manifest (sorted keys, no spaces, UTF-8): what a child's ``parent`` names."""
        data = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        return "sha256:" + hashlib.sha256(data).hexdigest()

    @classmethod
    def from_json(cls, obj: Any) -> ReleaseBundle:
        """Parse a manifest.

        Raises:
            Rejection: ``vocab.invalid_bundle`` for another format, a missing or mistyped part (the
                optimizer, shard and policy manifests must be stated; an inference-only release
                states ``"optimizer": {"absent": true, "reason": ...}``).
        """
        if not isinstance(obj, Mapping) or obj.get("format") != BUNDLE_FORMAT:
            raise Rejection(INVALID_BUNDLE, f"a release bundle is a JSON object with format {BUNDLE_FORMAT!r}", "$.format")
        required = [p for p in BUNDLE_PARTS if p not in ("migration", "parent")]
        missing = [p for p in required if p not in obj]
        if missing:
            raise Rejection(INVALID_BUNDLE, f"the bundle lacks {missing}", f"$.{missing[0]}")
        return cls(**{p: obj[p] for p in BUNDLE_PARTS if p in obj})


@rule(
    "invariant.vocab_release_bundle",
    title="A release bundle binds tokenizer, ordered table, rows, config, tie and map under one version; parts that disagree are refused",
    section="M3.8 0x08 Release and rollback ledger",
    statement="A release is one versioned bundle of the tokenizer (its program hash), the ordered vocabulary hash, the table "
    "size, the special and added tokens, the embedding and output rows, the config vocab_size, the tie mode, the migration "
    "map from its parent and the parent's digest (the rollback target). Its parts must agree with each other (output rows = "
    "embedding rows = config vocab_size >= table size; added and special ids inside the table; a tied release has one row "
    "count; the map's new size is the output rows) and with the loaded artifacts, part by part; a bundle whose parts "
    "disagree is refused naming the part. It also carries the ledger's remaining manifests "
    "(invariant.vocab_release_manifests): optimizer, shards and local policy.",
)
def bundle_violations(bundle: ReleaseBundle, loaded: ReleaseBundle | None = None) -> tuple[tuple[str, str], ...]:
    """Every ``(part, reason)`` where ``bundle`` disagrees with itself or with ``loaded`` (what the artifacts are now).

    Args:
        bundle: The release manifest.
        loaded: The same parts read from the loaded tokenizer, model and checkpoint (its
            ``version``, ``migration`` and ``parent`` are not compared: the loaded artifacts
            carry none), or ``None`` to check the bundle's own consistency only.

    Returns:
        ``(part, reason)`` pairs; internal disagreements first, then the parts in
        :data:`BUNDLE_PARTS` order.

    Source: M3.8 0x08 "Release and rollback ledger" (tokenizer and ordered table: deterministic ID
    table hash; model rows; tied aliases; "Release tokenizer, model, optimizer, policy, and
    mapping manifests as one versioned bundle"; "Reliable rollback restores the complete previous
    release bundle").
    """
    out: list[tuple[str, str]] = []
    b = bundle
    if b.embedding_rows != b.output_rows:
        out.append(("embedding_rows", f"{b.embedding_rows} embedding rows but {b.output_rows} output rows"
                    + (" in a tied release (one table)" if b.tie == "tied" else "")))
    if b.config_vocab_size != b.output_rows:
        out.append(("config_vocab_size", f"config vocab_size {b.config_vocab_size} but {b.output_rows} output rows"))
    if b.table_size > b.output_rows:
        out.append(("table_size", f"{b.table_size} table entries but only {b.output_rows} output rows"))
    for tid, content, _special in b.added_tokens:
        if not 0 <= tid < b.table_size:
            out.append(("added_tokens", f"added token {content!r} has id {tid} outside the table [0, {b.table_size})"))
            break
    if any(v is not None and not 0 <= v < b.table_size for v in b.special_ids.values()):
        out.append(("special_ids", f"a special id lies outside the table [0, {b.table_size})"))
    if b.migration is not None and b.migration.new_size != b.output_rows:
        out.append(("migration", f"the map makes {b.migration.new_size} rows but the release has {b.output_rows}"))
    out.extend((part, f"{name}: {MANIFEST_VIOLATIONS[name]}") for part, name in manifest_violations(b))
    if loaded is not None:
        for name in BUNDLE_PARTS:
            if name in ("version", "migration", "parent"):
                continue
            if name in BUNDLE_MANIFESTS and getattr(loaded, name) is None:
                continue  # not observed in the loaded artifacts (an inference runtime holds no optimizer)
            want, got = b.part(name), loaded.part(name)
            if name == "policy" and want is not None:
                # the masks are the release's own choice (judged against the table); the artifacts fix the rest
                want = {k: want[k] for k in ("vocab_hash", "special_ids", "eos_ids")}
                got = {k: got[k] for k in ("vocab_hash", "special_ids", "eos_ids")}
            if want == got:
                continue
            if isinstance(want, list) and isinstance(got, list):
                k = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
                x = want[k] if k < len(want) else "nothing"
                y = got[k] if k < len(got) else "nothing"
                out.append((name, f"entry {k}: the bundle states {x!r}, the loaded artifacts have {y!r}"))
            else:
                out.append((name, f"the bundle states {want!r}, the loaded artifacts have {got!r}"))
    return tuple(out)


#: The named ways a bundle's manifests fail (:func:`manifest_violations`); each is reported under its part.
MANIFEST_VIOLATIONS: dict[str, str] = {
    "optimizer_undeclared": "the bundle states no optimizer manifest: an inference-only release declares it absent",
    "optimizer_absent_without_reason": "the optimizer manifest is declared absent without a reason",
    "optimizer_use_missing": "a row-addressed use (embedding, head) has no optimizer owner",
    "optimizer_duplicate_state": "one use is owned by two optimizer entries (two states for one shared Parameter)",
    "optimizer_tie_split": "a tied release's embedding and head have two optimizer owners, or an untied release's one",
    "optimizer_stale_parameter": "an optimizer entry owns a Parameter the release does not use (created before the swap)",
    "optimizer_rows": "an optimizer entry or state tensor does not have the release's row count",
    "optimizer_not_mapped": "the optimizer state was not moved by the release's migration map (stale manifest)",
    "optimizer_new_rows": "the declared new rows are not the map's new rows, or their state is not zero",
    "shards_undeclared": "the bundle states no shard manifest",
    "shards_not_contiguous": "the shard ranges leave a gap, overlap, or do not cover [0, V) exactly once",
    "shards_owner_map": "an owner rank lies outside the world or owns two ranges, or a range is empty",
    "policy_undeclared": "the bundle states no local-policy manifest",
    "policy_vocabulary": "the policy was written for another ordered vocabulary (its hash is not the release's)",
    "policy_special_ids": "the policy's special ids are not the release's",
    "policy_ids_outside_table": "an EOS id, bad-word id or logit-bias key lies outside the release's table",
}


def _optimizer_violations(b: ReleaseBundle) -> list[tuple[str, str]]:
    o = b.optimizer
    if o is None:
        return [("optimizer", "optimizer_undeclared")]
    if o.absent:
        return [] if o.reason.strip() else [("optimizer", "optimizer_absent_without_reason")]
    out: list[str] = []
    owners: dict[str, list[int]] = {}
    for k, p in enumerate(o.params):
        for use in p.uses:
            owners.setdefault(use, []).append(k)
        if not p.uses:
            out.append("optimizer_stale_parameter")
        if p.rows != b.output_rows or any(r != p.rows for _, r, _ in p.states):
            out.append("optimizer_rows")
    if not {"embed", "head"} <= set(owners):
        out.append("optimizer_use_missing")
    if any(len(ks) > 1 for ks in owners.values()):
        out.append("optimizer_duplicate_state")
    if "embed" in owners and "head" in owners and (owners["embed"] == owners["head"]) != (b.tie == "tied"):
        out.append("optimizer_tie_split")
    want_map = None if b.migration is None else map_digest(b.migration)
    if o.map_digest != want_map:
        out.append("optimizer_not_mapped")
    fresh = () if b.migration is None else tuple(int(i) for i in b.migration.new_rows())
    if any(p.uses and (p.new_rows != fresh or not p.new_rows_zero) for p in o.params):
        out.append("optimizer_new_rows")
    return [("optimizer", v) for v in dict.fromkeys(out)]


def _shard_violations(b: ReleaseBundle) -> list[tuple[str, str]]:
    sh = b.shards
    if sh is None:
        return [("shards", "shards_undeclared")]
    out: list[str] = []
    ranges = sorted(sh.ranges)
    stop = 0
    for a, z, _ in ranges:
        if a != stop:
            out.append("shards_not_contiguous")
        stop = max(stop, z)
    if stop != b.output_rows or not ranges:
        out.append("shards_not_contiguous")
    owners = [o for _, _, o in sh.ranges]
    if any(not 0 <= o < sh.world_size for o in owners) or len(set(owners)) != len(owners) or len(owners) != sh.world_size \
            or any(z <= a for a, z, _ in sh.ranges):
        out.append("shards_owner_map")
    return [("shards", v) for v in dict.fromkeys(out)]


def _policy_violations(b: ReleaseBundle) -> list[tuple[str, str]]:
    pol = b.policy
    if pol is None:
        return [("policy", "policy_undeclared")]
    out: list[str] = []
    if pol.vocab_hash != b.vocab_hash:
        out.append("policy_vocabulary")
    if dict(pol.special_ids) != dict(b.special_ids):
        out.append("policy_special_ids")
    ids = [*pol.eos_ids, *(i for seq in pol.bad_words_ids for i in seq), *pol.logit_bias_ids]
    if any(not 0 <= i < b.table_size for i in ids):
        out.append("policy_ids_outside_table")
    return [("policy", v) for v in out]


@rule(
    "invariant.vocab_release_manifests",
    title="The release bundle carries the optimizer, shard and local-policy manifests of the ledger, each consistent with the release",
    section="M3.8 0x08 Release and rollback ledger",
    statement="A release bundle states an optimizer manifest (or declares it absent, with a reason, for an inference-only "
    "release: never silently skipped), a shard manifest and a local-policy manifest. The optimizer manifest gives, per "
    "optimizer-owned vocabulary Parameter, its uses, rows and the digests and row counts of its state tensors: exactly one "
    "owner per use and one for a tied table (two for an untied one), no stale Parameter, the release's row count, the "
    "release's migration map (its digest) and the map's new rows with zero state. The shard manifest's contiguous ranges "
    "cover [0, V) exactly once and each rank owns one. The policy manifest addresses the release's ordered vocabulary (its "
    "hash), uses its special ids, and its EOS ids, bad-word ids and logit-bias keys lie inside the new table.",
)
def manifest_violations(bundle: ReleaseBundle) -> tuple[tuple[str, str], ...]:
    """Every ``(part, violation name)`` (:data:`MANIFEST_VIOLATIONS`) of the bundle's optimizer, shard and policy manifests.

    Args:
        bundle: The release bundle.

    Returns:
        ``(part, name)`` pairs, parts in :data:`BUNDLE_MANIFESTS` order; empty when all three hold.

    Source: M3.8 0x08 "Release and rollback ledger" (optimizer/master state: "mapped old rows, zero/declared new
    rows, one state per shared parameter"; shards: "contiguous global row ranges and owner map"; local policy:
    "special IDs and legal-token masks match new vocabulary"), "Tied alias and optimizer restoration order" (step
    9); 0x12 items 31, 55, 56.
    """
    return tuple(_optimizer_violations(bundle) + _shard_violations(bundle) + _policy_violations(bundle))
