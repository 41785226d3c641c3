"""M3.8 0x08: read a runtime's vocabulary identity and check it, its audit and a vocabulary migration against spec/vocab.py.

* :func:`runtime_table` / :func:`runtime_vocab_hash` -- the ordered table a runtime's tokenizer
  emits (id -> bytes, control ids, special ids) and its
  :func:`~decodespec.spec.vocab.vocab_table_hash`.  The impl adapter binds it into the request
  (every receipt's ``vocab_hash``) and reports it, with the head's row count, in each
  :class:`~decodespec.checks.adapters.Observation`; ``ladder.STATE`` compares both with
  :func:`reference_vocab` (so a runtime with a permuted or resized vocabulary fails at STATE on
  its first observation, before any score row is compared);
* :func:`reference_vocab` -- the gate's own reading of the checkpoint's vocabulary, sharing no
  code with the runtime: SmolLM2's table from the GGUF ``tokenizer.ggml.*`` metadata (read with
  the ``gguf`` library, byte-level spellings decoded with GPT-2's byte map), the tiny model's
  from its declared layout (``PAD 0, BOS 1, EOS 2; byte b is id b + 3; the rest unused``,
  export-tiny's README) and the reference checkpoint's row count;
* :func:`audit_model` -- :class:`~decodespec.spec.vocab.VocabAudit` of a loaded model and its
  tokenizer (``decodespec vocab-audit``), judged by
  :func:`~decodespec.spec.vocab.audit_violations`;
* :func:`check_migration` -- run a torch migration (default :func:`decodespec.impl.vocab.migrate_vocabulary`)
  on a model that has taken one Adam step and judge it: rows and moments against
  :func:`~decodespec.spec.vocab_migration.migrate_state`, alias and optimizer ownership
  (:func:`~decodespec.spec.vocab_migration.migration_violations`), the mapped raw-logit oracle and the
  appended rows' probability drift; :data:`MIGRATION_MUTANTS` are migrations from the failure
  lab it must catch.

Source: M3.8 0x08 (the audit, the ordered identity, migration, append drift, the restoration
order), 0x09 (tied alias), 0x12 items 25-27, 31, 53-56.

Size: one check of a runtime's vocabulary: reading its identity from each runtime, the audit,
migration and the release bundle against spec/vocab*.py.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.vocab import AddedToken, AddedTokenObservation, VocabAudit, added_token_violations, vocab_table_hash
from decodespec.spec.vocab_migration import (
    EncDecVocab,
    MigrationObservation,
    MigrationSnapshot,
    NewRowInit,
    VocabMap,
    append_drift,
    mapped_logit_gap,
    migrate_state,
    migration_violations,
    transaction_violations,
)
from decodespec.spec.vocab_release import OptimizerManifest, OptimizerParam, PolicyManifest, ReleaseBundle, ShardManifest, bundle_violations, map_digest

__all__ = [
    "ADDED_TOKEN_MUTANTS",
    "INFERENCE_ONLY",
    "MIGRATION_MUTANTS",
    "RELEASE_MUTANTS",
    "ROLLBACK_MUTANTS",
    "AddedTokenReport",
    "MigrationReport",
    "ReferenceVocab",
    "RollbackReport",
    "audit_added_tokens",
    "audit_hf_added_tokens",
    "audit_model",
    "check_migration",
    "check_migration_rollback",
    "check_release_after_migration",
    "checkpoint_rows",
    "declared_added_tokens",
    "loaded_bundle",
    "loaded_policy",
    "observe_encdec",
    "optimizer_manifest",
    "reference_vocab",
    "runtime_table",
    "runtime_vocab_hash",
    "snapshot_migration",
]

#: GGUF ``tokenizer.ggml.token_type`` of a control token (llama.cpp ``LLAMA_TOKEN_TYPE_CONTROL``).
_CONTROL = 3


# -- the runtime's table --------------------------------------------------------------------------

def runtime_table(tokenizer: Any) -> tuple[list[bytes], dict[str, int | None], list[int]]:
    """``(tokens, specials, control_ids)`` of one of our tokenizers (``GGUFTokenizer``, ``ByteTokenizer``): its ``vocab_table()``.

    ``tokens[i]`` is ``token_bytes(i)``, a control token's own text; specials are the
    tokenizer's ``bos/eos/pad/unk_token_id``.
    """
    tokens, specials, control = tokenizer.vocab_table()
    return list(tokens), dict(specials), list(control)


def runtime_vocab_hash(tokenizer: Any) -> str:
    """The runtime's ordered vocabulary hash: its tokenizer's ``vocab_hash``.

    That is :func:`~decodespec.spec.vocab.vocab_table_hash` of :func:`runtime_table`, the one
    definition the request envelope's ``tokenizer_sha256`` also states; the tokenizer recomputes
    it when its table code changes (a failure-lab mutant that patches ``token_bytes``).
    """
    return str(tokenizer.vocab_hash)


def audit_model(model: Any, tokenizer: Any) -> VocabAudit:
    """The :class:`~decodespec.spec.vocab.VocabAudit` of a loaded ``LlamaForCausalLM`` and its tokenizer.

    ``tokenizer_len`` is the base table plus added tokens (our tokenizers add none on top of the
    checkpoint's table: GGUF user-defined tokens are in it); the head's rows are its weight's
    first dimension; ``tied`` is Parameter identity.
    """
    added = tuple(getattr(tokenizer, "added_ids", ()))
    config = model.config
    return VocabAudit(
        tokenizer_size=int(tokenizer.vocab_size),
        tokenizer_len=int(tokenizer.vocab_size) + len(added),
        embedding_rows=int(model.model.embed_tokens.weight.shape[0]),
        output_rows=int(model.lm_head.weight.shape[0]),
        config_vocab_size=int(config.vocab_size),
        vocab_hash=runtime_vocab_hash(tokenizer),
        added_ids=added,
        special_ids={"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                     "unk": tokenizer.unk_token_id},
        config_special_ids={"bos": config.bos_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id},
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
    )


# -- the gate's own reading of the checkpoint ------------------------------------------------------

@attrs.frozen
class ReferenceVocab:
    """The checkpoint's vocabulary as the gate reads it.

    Attributes:
        model: ``tiny`` or ``smollm2``.
        vocab_hash: :func:`~decodespec.spec.vocab.vocab_table_hash` of the checkpoint's table.
        table_size: Entries in the table.
        output_rows: Rows of the checkpoint's output head (``output.weight``, or the embedding when tied).
    """

    model: str
    vocab_hash: str
    table_size: int
    output_rows: int


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted (the byte-level BPE convention of the GGUF table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _gguf_rows(reader: Any) -> int:
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return int(head.shape[1])  # GGUF shapes are [ne0 = d, ne1 = V]


@functools.lru_cache(maxsize=4)
def reference_vocab(model: str) -> ReferenceVocab:
    """The gate's reading of ``model``'s vocabulary (independent of ``impl/``).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
        ValueError: for another model name.
    """
    import gguf

    from .reference.files import gguf_path

    reader = gguf.GGUFReader(str(gguf_path(model)))
    rows = _gguf_rows(reader)
    if model == "tiny":
        # The declared byte table (export-tiny README): PAD 0, BOS 1, EOS 2; byte b is id b + 3; the rest unused.
        names = [b"<pad>", b"<bos>", b"<eos>"]
        tokens = names + [bytes([b]) for b in range(256)] + [b""] * (rows - 259)
        specials = {"bos": 1, "eos": 2, "pad": 0, "unk": None}
        digest = vocab_table_hash(tokens, specials, [0, 1, 2])
        return ReferenceVocab(model, digest, len(tokens), rows)
    if model != "smollm2":
        raise ValueError(f"no reference vocabulary for {model!r}")
    wanted = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id"}  # not the merges: the table is what is hashed
    field = {key: f.contents() for key, f in reader.fields.items() if key in wanted}
    spellings: list[str] = list(field["tokenizer.ggml.tokens"])
    types = list(field.get("tokenizer.ggml.token_type", [1] * len(spellings)))
    decoder = _gpt2_byte_decoder()
    control = [i for i, t in enumerate(types) if t == _CONTROL]
    ctrl = set(control)
    tokens = [s.encode("utf-8") if i in ctrl or not set(s) <= decoder.keys() else bytes(decoder[c] for c in s)
              for i, s in enumerate(spellings)]
    specials = {name: field.get(f"tokenizer.ggml.{key}_token_id") for name, key in
                (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    specials = {k: None if v is None else int(v) for k, v in specials.items()}
    return ReferenceVocab(model, vocab_table_hash(tokens, specials, control), len(tokens), rows)


# -- added tokens on identity (M3.8 0x08) ----------------------------------------------------------

#: GGUF ``tokenizer.ggml.token_type`` of a user-defined (added, not special) token.
_USER_DEFINED = 4


def declared_added_tokens(model: str) -> tuple[AddedToken, ...]:
    """The checkpoint's added and special tokens as the gate reads them (independent of ``impl/``).

    SmolLM2: every GGUF token of type control (special) or user-defined, its spelling from
    ``tokenizer.ggml.tokens``; tiny: its declared specials ``<pad>, <bos>, <eos>`` (ids 0-2),
    which have no text form (the byte tokenizer encodes text as bytes).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
        ValueError: for another model name.
    """
    if model == "tiny":
        return tuple(AddedToken(i, name, True, text_form=False) for i, name in enumerate(("<pad>", "<bos>", "<eos>")))
    if model != "smollm2":
        raise ValueError(f"no declared added tokens for {model!r}")
    import gguf

    from .reference.files import gguf_path

    reader = gguf.GGUFReader(str(gguf_path(model)))
    spellings = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    return tuple(AddedToken(i, spellings[i], t == _CONTROL) for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED))


def checkpoint_rows(model: str, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(embedding rows [n, d], head rows [n, d])`` of ``ids`` as the checkpoint stores them (GGUF, dequantized by ``gguf``).

    The head's rows are ``output.weight``'s, or the embedding's when the file ties them.
    """
    import gguf
    from gguf.quants import dequantize

    from .reference.files import gguf_path

    reader = gguf.GGUFReader(str(gguf_path(model)))
    tensors = {t.name: t for t in reader.tensors}
    idx = np.asarray(list(ids), dtype=np.int64)

    def rows(t: Any) -> np.ndarray:
        return np.asarray(dequantize(np.asarray(t.data)[idx], t.tensor_type), dtype=np.float64).reshape(len(idx), -1)

    embed = rows(tensors["token_embd.weight"])
    head = rows(tensors["output.weight"]) if "output.weight" in tensors else embed
    return embed, head


@attrs.frozen(eq=False)
class AddedTokenReport:
    """Added tokens of a loaded runtime judged by ``invariant.vocab_added_token_identity``."""

    declared: tuple[AddedToken, ...]
    observed: dict[int, AddedTokenObservation]
    violations: tuple[tuple[int, str], ...]

    @property
    def passed(self) -> bool:
        """No violation."""
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``decodespec vocab-audit --json``, ``added_tokens``)."""
        return {"declared": [{"id": t.id, "content": t.content, "special": t.special} for t in self.declared],
                "violations": [{"id": i, "violation": v} for i, v in self.violations], "ok": self.passed}


def audit_added_tokens(model: Any, tokenizer: Any, name: str) -> AddedTokenReport:
    """Read every declared added token from the runtime (string, flag, encode/decode, rows) and judge it.

    Rows are compared with the checkpoint's (:func:`checkpoint_rows`) within ``2 u32 |row|`` per
    value (Q4_1 dequantization is one float32 multiply and one add; float32 checkpoints are exact).

    Source: M3.8 0x08 ("added token rows exist and were initialized/adapted as intended").
    """
    declared = declared_added_tokens(name)
    ids = [t.id for t in declared]
    want_embed, want_head = checkpoint_rows(name, ids)
    embed = model.model.embed_tokens.weight.detach().double().cpu().numpy()
    head = model.lm_head.weight.detach().double().cpu().numpy()
    u = float(np.finfo(np.float32).eps) / 2
    special = {int(i) for i in tokenizer.special_ids}
    observed: dict[int, AddedTokenObservation] = {}
    for k, tok in enumerate(declared):
        if tok.id >= int(tokenizer.vocab_size):
            continue
        content = tokenizer.id_to_token(tok.id)

        def error(rows: np.ndarray, want: np.ndarray, i: int = tok.id) -> float | None:
            if i >= rows.shape[0] or rows.shape[1] != want.shape[0]:
                return None
            err, bound = np.abs(rows[i] - want), 2 * u * np.abs(want)
            with np.errstate(divide="ignore", invalid="ignore"):
                return float(np.max(np.where(err == 0, 0.0, err / bound)))

        observed[tok.id] = AddedTokenObservation(
            content=content, special=tok.id in special,
            encodes_to=tuple(int(x) for x in tokenizer.encode(tok.content)) if tok.text_form else None,
            decodes_to=tokenizer.decode([tok.id], skip_special_tokens=False) if tok.text_form else None,
            embedding_row_error=error(embed, want_embed[k]), output_row_error=error(head, want_head[k]),
            row_zero=tok.id < embed.shape[0] and not np.any(embed[tok.id]))
    return AddedTokenReport(declared, observed, added_token_violations(declared, observed, special))


def audit_hf_added_tokens(name: str = "smollm2", *, model: Any = None, tokenizer: Any = None) -> AddedTokenReport:
    """HF's added tokens judged on identity against the GGUF (``invariant.vocab_added_token_identity``).

    HF's ``added_tokens_decoder`` (id -> content, special flag), its encode/decode of each
    token's text (:class:`~decodespec.checks.adapters.hf.HFTokenizerView`) and HF's model's
    embedding and head rows are read for every token the checkpoint declares added or special
    (:func:`declared_added_tokens`, from the GGUF token types), as :func:`audit_added_tokens`
    reads our runtime.

    Args:
        name: ``smollm2`` (the tiny model has no HF tokenizer).
        model, tokenizer: HF's model and tokenizer (default :func:`~decodespec.checks.adapters.hf.hf_model`,
            :func:`~decodespec.checks.adapters.hf.hf_tokenizer` of ``name``).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
        ValueError: ``name`` has no HF tokenizer.

    Source: M3.8 0x08 ("added token rows exist and were initialized/adapted as intended", "special
    token IDs agree with model configuration").
    """
    from ..adapters.hf import HFTokenizerView, hf_model, hf_tokenizer

    tok = tokenizer if tokenizer is not None else hf_tokenizer(name)
    if tok is None:
        raise ValueError(f"{name!r} has no HF tokenizer")
    return audit_added_tokens(model if model is not None else hf_model(name), HFTokenizerView(tok), name)


def _added_rows_reinitialized(model: Any) -> Any:
    """Failure lab: a loader that resizes the vocabulary re-initializes the special tokens' rows with the mean row."""
    import torch

    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        embed[:3] = embed.mean(dim=0, keepdim=True)  # the tiny model's specials, ids 0-2 (tied: the head's rows too)
    return model


#: name -> (loader bug applied to a loaded model, section, title, statement); each is the rule ``mutant.<name>``.
ADDED_TOKEN_MUTANTS: dict[str, tuple[Callable[[Any], Any], str, str, str]] = {
    "vocab_added_rows_reinitialized": (
        _added_rows_reinitialized, "M3.8 0x12 Vocabulary and tying bugs (item 26); 0x08 The vocabulary-axis identity contract",
        "The added / special tokens' rows are re-initialized on load",
        ("A resize-on-load writes the mean embedding row into the rows of <pad>, <bos> and <eos>: every count, size, id and "
         "string is right and the ordered hash is unchanged, but the rows are not the checkpoint's. audit_added_tokens reports "
         "row_differs for ids 0-2 (invariant.vocab_added_token_identity).")),
}


# -- the release bundle (M3.8 0x08 "Release and rollback ledger") ----------------------------------

def loaded_bundle(name: str, model: Any, tokenizer: Any, version: str, *, migration: Any = None,
                  parent: str | None = None) -> ReleaseBundle:
    """The :class:`~decodespec.spec.vocab_release.ReleaseBundle` of the artifacts loaded now.

    Parts: the checkpoint file's SHA-256 (the GGUF the model was loaded from), the tokenizer's
    program hash (``program_sha256``) and ordered vocabulary hash (``vocab_hash``), its table size
    and special ids, its special tokens as ``(id, string, True)``, the model's embedding and output
    rows, ``config.vocab_size`` and the tie (Parameter identity).
    """
    from decodespec.impl.gguf import file_sha256

    from .reference.files import gguf_path

    special = sorted(int(i) for i in tokenizer.special_ids)
    return ReleaseBundle(
        version=version, checkpoint_sha256=file_sha256(gguf_path(name)), tokenizer_sha256=tokenizer.program_sha256,
        vocab_hash=tokenizer.vocab_hash, table_size=int(tokenizer.vocab_size),
        special_ids={"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                     "unk": tokenizer.unk_token_id},
        added_tokens=[(i, tokenizer.id_to_token(i), True) for i in special],
        embedding_rows=int(model.model.embed_tokens.weight.shape[0]), output_rows=int(model.lm_head.weight.shape[0]),
        config_vocab_size=int(model.config.vocab_size),
        tie="tied" if model.lm_head.weight is model.model.embed_tokens.weight else "untied",
        policy=loaded_policy(tokenizer), migration=migration, parent=parent)


def loaded_policy(tokenizer: Any, *, bad_words_ids: Sequence[Sequence[int]] = (),
                  logit_bias_ids: Sequence[int] = ()) -> PolicyManifest:
    """The local-policy manifest of the loaded tokenizer: its ordered hash, special ids and EOS id, with the given masks."""
    specials = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                "unk": tokenizer.unk_token_id}
    eos = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    return PolicyManifest(tokenizer.vocab_hash, specials, eos, bad_words_ids, logit_bias_ids)


#: The optimizer manifest of an inference-only release (the runtime holds no optimizer state).
INFERENCE_ONLY = OptimizerManifest(absent=True, reason="inference-only release: the runtime holds no optimizer state")


def optimizer_manifest(model: Any, optimizer: Any, migration: VocabMap | None = None) -> OptimizerManifest:
    """The optimizer manifest of a torch model and optimizer: per vocabulary-shaped Parameter, its uses and state digests.

    Entries: every Parameter in the optimizer's groups whose first dimension is a vocabulary row
    count (the model's embedding rows, or ``migration.old_size``), named by the model's
    ``named_parameters`` (``"<stale>"`` when the model no longer holds it); ``uses`` are
    Parameter identity with ``embed_tokens.weight``, ``lm_head.weight`` and ``lm_head.bias``;
    ``states`` the SHA-256 of each row-addressed state tensor's bytes; ``new_rows`` the map's
    new rows and whether every state tensor is zero there; ``map_digest`` the map's
    (:func:`~decodespec.spec.vocab_release.map_digest`).

    Source: M3.8 0x08 "Release and rollback ledger" (optimizer/master state).
    """
    embed, head, bias = model.model.embed_tokens.weight, model.lm_head.weight, model.lm_head.bias
    rows_now = int(embed.shape[0])
    vocab_rows = {rows_now} | ({migration.old_size} if migration is not None else set())
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    fresh = () if migration is None else tuple(int(i) for i in migration.new_rows())
    entries, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen or p.dim() < 1 or int(p.shape[0]) not in vocab_rows:
                continue
            seen.add(id(p))
            uses = tuple(u for u, q in (("embed", embed), ("head", head), ("bias", bias)) if q is p)
            state = {k: v for k, v in optimizer.state.get(p, {}).items() if hasattr(v, "dim") and v.dim() >= 1}
            digests = tuple(sorted((k, int(v.shape[0]), "sha256:" + hashlib.sha256(v.detach().cpu().contiguous().numpy().tobytes()).hexdigest())
                                   for k, v in state.items()))
            zero = all(not bool(v.detach()[list(fresh)].any()) for v in state.values()) if fresh else True
            entries.append(OptimizerParam(names.get(id(p), "<stale>"), uses, int(p.shape[0]), digests, fresh, zero))
    return OptimizerManifest(params=tuple(entries), map_digest=None if migration is None else map_digest(migration))


def check_release_after_migration(model: Any, vmap: VocabMap, init: NewRowInit, *, release: Callable[..., Any] | None = None,
                                  tokenizer: Any = None) -> tuple[tuple[str, str], ...]:
    """Train ``model`` one Adam step, migrate it, release it as a bundle and judge the bundle's manifests.

    ``release(model, optimizer, vmap, before)`` returns the release's optimizer manifest
    (``before``: the manifest read at step 1, before the migration); default: read it again
    after the migration (:func:`optimizer_manifest` with the map).  The bundle's other parts are
    the migrated model's; its shards one process, its policy the tokenizer's (the tiny model's
    byte table grown to the new rows).  Judged by ``invariant.vocab_release_manifests``.

    Returns:
        The ``(part, reason)`` pairs of :func:`~decodespec.spec.vocab_release.bundle_violations`.

    Source: M3.8 0x08 "Tied alias and optimizer restoration order" (steps 1 and 9), "Release and rollback ledger".
    """
    import torch

    from decodespec.impl.tokenizer import ByteTokenizer
    from decodespec.impl.vocab import migrate_vocabulary

    optimizer = _trained(model)
    before = optimizer_manifest(model, optimizer)
    pairs = {int(a): int(b) for a, b in zip(vmap.old_ids, vmap.new_ids)}
    values = None if init.values is None else torch.as_tensor(init.values, dtype=model.lm_head.weight.dtype)
    migrate_vocabulary(model, pairs, vmap.new_size, init=init.kind, sources=dict(init.sources), values=values, optimizer=optimizer)
    manifest = (release or (lambda m, o, v, b: optimizer_manifest(m, o, v)))(model, optimizer, vmap, before)
    tok = tokenizer or ByteTokenizer(vmap.new_size)
    rows = int(model.lm_head.weight.shape[0])
    bundle = ReleaseBundle(
        version="tiny@2", checkpoint_sha256="sha256:" + "0" * 64, tokenizer_sha256=tok.program_sha256, vocab_hash=tok.vocab_hash,
        table_size=int(tok.vocab_size), special_ids={"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id,
                                                     "unk": tok.unk_token_id},
        added_tokens=[(i, tok.id_to_token(i), True) for i in sorted(int(i) for i in tok.special_ids)],
        embedding_rows=int(model.model.embed_tokens.weight.shape[0]), output_rows=rows, config_vocab_size=int(model.config.vocab_size),
        tie="tied" if model.lm_head.weight is model.model.embed_tokens.weight else "untied", optimizer=manifest,
        shards=ShardManifest.even(rows), policy=loaded_policy(tok), migration=vmap, parent="sha256:" + "1" * 64)
    return bundle_violations(bundle)


def _stale_optimizer_manifest(model: Any, optimizer: Any, vmap: VocabMap, before: OptimizerManifest) -> OptimizerManifest:
    """Failure lab: the release ships the optimizer manifest loaded at step 1, before the migration moved the state (item 55)."""
    return before


#: name -> (release step, section, title, statement), judged by :func:`check_release_after_migration`.
RELEASE_MUTANTS: dict[str, tuple[Callable[..., Any], str, str, str]] = {
    "vocab_release_stale_optimizer_manifest": (
        _stale_optimizer_manifest, "M3.8 0x12 Extended contract failures (item 55); 0x08 Release and rollback ledger",
        "The release bundle ships the optimizer manifest from before the migration",
        ("The migration moves rows and moments correctly, but step 9 releases the optimizer manifest read at step 1: its "
         "state digests, row counts and map are the parent release's, so a restore from this bundle applies old moments to "
         "the wrong token addresses. bundle_violations names the optimizer part (optimizer_rows, optimizer_not_mapped, "
         "optimizer_new_rows; invariant.vocab_release_manifests).")),
}


# -- migration ------------------------------------------------------------------------------------

@attrs.frozen(eq=False)
class MigrationReport:
    """A torch migration judged against the float64 spec.

    Attributes:
        violations: :func:`~decodespec.spec.vocab_migration.migration_violations` names (empty: conforms).
        logit_gap: Mapped raw-logit oracle gap (logits) and the worst old id.
        logit_bound: The bound it is held to (rounding of one float32 dot product, derived).
        new_mass: Probability mass the new rows take, per hidden row.
        drift_error: ``max |log_shift - expected_shift|`` (0 up to rounding; :class:`~decodespec.spec.vocab_migration.AppendDrift`).
        shift_spread: Largest spread of ``log p_new - log p_old`` over kept ids (0: rescaled, not reshaped).
        max_abs_prob_change: Largest change of an old token's probability.
    """

    violations: tuple[str, ...]
    logit_gap: tuple[float, int]
    logit_bound: float
    new_mass: np.ndarray
    drift_error: float
    shift_spread: float
    max_abs_prob_change: float

    @property
    def passed(self) -> bool:
        """No violation and the mapped logits within their bound."""
        return not self.violations and self.logit_gap[0] <= self.logit_bound


def _vocab_params(model: Any) -> dict[str, Any]:
    embed = model.model.embed_tokens.weight
    out = {"embed": embed}
    if model.lm_head.weight is not embed:
        out["head"] = model.lm_head.weight
    if model.lm_head.bias is not None:
        out["bias"] = model.lm_head.bias
    return out


def _rows64(t: Any) -> np.ndarray:
    return t.detach().double().cpu().numpy().copy()


def _observe(model: Any, optimizer: Any, declared_tied: bool, old_vocab: set[int]) -> MigrationObservation:
    params = _vocab_params(model)
    ids = {id(p) for p in params.values()}
    rows_now = int(model.model.embed_tokens.weight.shape[0])
    entries = [p for g in optimizer.param_groups for p in g["params"]]
    mine = sum(1 for p in entries if id(p) in ids)
    stale = sum(1 for p in entries if id(p) not in ids and p.dim() >= 1 and p.shape[0] in old_vocab | {rows_now}
                and id(p) not in {id(q) for q in model.parameters()})
    slots = sum(1 for p, st in optimizer.state.items() if p.dim() >= 1 and p.shape[0] in old_vocab | {rows_now} and st)
    moments = {name: {k: _rows64(v) for k, v in optimizer.state.get(p, {}).items() if getattr(v, "dim", lambda: 0)() >= 1}
               for name, p in params.items()}
    return MigrationObservation(declared_tied=declared_tied, tied_after=model.lm_head.weight is model.model.embed_tokens.weight,
                                rows={name: _rows64(p) for name, p in params.items()}, moments=moments,
                                optimizer_entries=mine, stale_entries=stale, state_slots=slots)


def _trained(model: Any, input_ids: Sequence[int] = (1, 40, 41, 42, 43)) -> Any:
    """One Adam step of next-token loss on ``input_ids``: returns the optimizer (moments populated)."""
    import torch

    for p in model.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([list(input_ids)])
    with torch.enable_grad():
        out = model(ids)
        torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def check_migration(model: Any, vmap: VocabMap, init: NewRowInit, *, migrate: Callable[..., Any] | None = None,
                    input_ids: Sequence[int] = (1, 40, 41, 42, 43), seed: int = 8) -> MigrationReport:
    """Train ``model`` one Adam step, migrate it with ``migrate`` and judge the result against the spec.

    Args:
        model: A loaded ``LlamaForCausalLM`` (float32); it is changed in place.
        vmap: The map (:class:`~decodespec.spec.vocab_migration.VocabMap`).
        init: The declared initialization of new rows (``zeros``, ``mean``, ``copy``, ``values``).
        migrate: ``migrate(model, old_to_new, new_size, init=, sources=, values=, optimizer=)``;
            default :func:`decodespec.impl.vocab.migrate_vocabulary`.
        input_ids: The training step's ids (ids below ``V_old``).
        seed: Seed of the fixed hidden rows of the logit oracle.

    Returns:
        :class:`MigrationReport`.
    """
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    migrate = migrate or migrate_vocabulary
    optimizer = _trained(model, input_ids)
    declared_tied = bool(model.config.tie_word_embeddings)
    params = _vocab_params(model)
    old_rows = {name: _rows64(p) for name, p in params.items()}
    old_moments = {name: {k: _rows64(v) for k, v in optimizer.state[p].items() if v.dim() >= 1} for name, p in params.items()}
    inits = {name: NewRowInit("zeros") if name == "bias" and init.kind == "values" else init for name in old_rows}
    expected_rows, expected_moments = migrate_state(old_rows, vmap, inits, old_moments)
    d = int(model.config.hidden_size)
    hidden = torch.randn(4, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    with torch.no_grad():
        z_old = model.lm_head(hidden).double().numpy()
    pairs = {int(a): int(b) for a, b in zip(vmap.old_ids, vmap.new_ids)}
    values = None if init.values is None else torch.as_tensor(init.values, dtype=model.lm_head.weight.dtype)
    migrate(model, pairs, vmap.new_size, init=init.kind, sources=dict(init.sources), values=values, optimizer=optimizer)
    with torch.no_grad():
        z_new = model.lm_head(hidden).double().numpy()
    obs = _observe(model, optimizer, declared_tied, {vmap.old_size})
    eps = float(np.finfo(np.float32).eps)
    scale = max(float(np.abs(r).max()) for r in expected_rows.values())
    violations = migration_violations(obs, expected_rows, expected_moments, vmap, atol=eps * scale)
    # Each float32 logit is within d * eps * sum_j |h_j| |e_j| of its exact value (the standard dot-product rounding bound);
    # the old and new heads hold the same float32 rows at mapped addresses, so two computations differ by at most twice it.
    head_rows = expected_rows.get("head", expected_rows["embed"])
    bound = float(2 * d * eps * (np.abs(hidden.double().numpy()) @ np.abs(head_rows).T).max())
    gap = mapped_logit_gap(z_old, z_new, vmap)
    drift = append_drift(z_old, z_new, vmap)
    drift_error = float(np.abs(drift.log_shift - drift.expected_shift).max())
    return MigrationReport(violations, gap, bound, drift.new_mass, drift_error, float(drift.shift_spread.max()),
                           float(drift.max_abs_prob_change.max()))


# -- migration mutants (failure lab 0x12 items 31, 55, 56) -----------------------------------------

def _moments_not_moved(model: Any, old_to_new: Mapping[int, int], new_size: int, *, optimizer: Any = None, **kw: Any) -> Any:
    """Rows migrated, optimizer moments left at their old row addresses (item 55)."""
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    migrate_vocabulary(model, old_to_new, new_size, optimizer=optimizer, **kw)
    kept = [(a, b) for a, b in old_to_new.items() if a < new_size]
    at_old, at_new = torch.tensor([a for a, _ in kept]), torch.tensor([b for _, b in kept])
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == new_size:
                stale = torch.zeros_like(value)
                stale[at_old] = value[at_new]  # moment of old id v back at index v
                state[key] = stale
    return model


def _optimizer_before_retie(model: Any, old_to_new: Mapping[int, int], new_size: int, *, optimizer: Any = None, **kw: Any) -> Any:
    """Migrate, then re-create the head as a second Parameter before re-tying: the optimizer keeps a stale/duplicate slot (items 31, 56)."""
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    migrate_vocabulary(model, old_to_new, new_size, optimizer=optimizer, **kw)
    copy = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    optimizer.param_groups[0]["params"].append(copy)  # the optimizer was handed the head before the alias was restored
    optimizer.state[copy] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                             for k, v in optimizer.state[model.model.embed_tokens.weight].items()}
    return model


def _alias_not_restored(model: Any, old_to_new: Mapping[int, int], new_size: int, *, optimizer: Any = None, **kw: Any) -> Any:
    """Migrate, then load the head as its own Parameter with equal values (copy, not tie): item 56."""
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    migrate_vocabulary(model, old_to_new, new_size, optimizer=optimizer, **kw)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    return model


def _rows_by_size_only(model: Any, old_to_new: Mapping[int, int], new_size: int, **kw: Any) -> Any:
    """Resize by position, ignoring the map (rows keep their old index): items 25, 53."""
    from decodespec.impl.vocab import migrate_vocabulary

    kept = sorted(old_to_new)
    return migrate_vocabulary(model, {a: a for a in kept if a < new_size}, new_size, **kw)


def _bias_not_migrated(model: Any, old_to_new: Mapping[int, int], new_size: int, *, optimizer: Any = None, **kw: Any) -> Any:
    """Migrate the (tied) weight, then resize the head's [V] bias by position outside the map and the optimizer (0x09)."""
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    bias = model.lm_head.bias
    model.lm_head.bias = None  # tying ties the weight; this loader forgets the bias is row-addressed too
    migrate_vocabulary(model, old_to_new, new_size, optimizer=optimizer, **kw)
    fresh = torch.zeros(new_size, dtype=bias.dtype)
    k = min(new_size, int(bias.shape[0]))
    fresh[:k] = bias.detach()[:k]
    model.lm_head.bias = torch.nn.Parameter(fresh)
    return model


# -- encoder-decoder vocabularies (M3.8 0x08) ---------------------------------------------------------

def observe_encdec(model: Any, source_tokens: Sequence[Any], target_tokens: Sequence[Any]) -> EncDecVocab:
    """The :class:`~decodespec.spec.vocab_migration.EncDecVocab` of an Annotated-Transformer encoder-decoder and its two token tables.

    Args:
        model: :class:`~decodespec.impl.encdec.EncoderDecoder` (``src_embed[0].lut``,
            ``tgt_embed[0].lut``, ``generator.proj``).
        source_tokens, target_tokens: The ordered ``V_src`` and ``V_tgt`` tables (token strings
            or bytes), hashed with :func:`~decodespec.spec.vocab.vocab_table_hash`.

    Source: M3.8 0x08 "For encoder-decoder models".
    """
    src, tgt, out = model.src_embed[0].lut.weight, model.tgt_embed[0].lut.weight, model.generator.proj.weight

    def key(p: Any) -> str:
        return f"{id(p)}:{p.data_ptr()}"

    return EncDecVocab(vocab_table_hash(source_tokens), vocab_table_hash(target_tokens), len(source_tokens), len(target_tokens),
                       int(src.shape[0]), int(tgt.shape[0]), int(out.shape[0]), key(src), key(tgt), key(out))


# -- the migration transaction (M3.8 0x08 "Release and rollback ledger") ----------------------------

def snapshot_migration(model: Any, optimizer: Any) -> MigrationSnapshot:
    """Fingerprint the vocabulary Parameters (objects and values), the tie, ``vocab_size`` and the optimizer.

    A Parameter's key is its object identity, not its ``data_ptr``: the decode-weight arena may
    relocate a Parameter's storage (``rebuild_fused_projections``) without changing the model.
    """
    def key(p: Any) -> str:
        return str(id(p))

    def digest(t: Any) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    named = [("embed", embed), ("head", head)] + ([("bias", model.lm_head.bias)] if model.lm_head.bias is not None else [])
    params = tuple((name, key(p), digest(p)) for name, p in named)
    entries = tuple(key(p) for g in optimizer.param_groups for p in g["params"])
    h = hashlib.sha256()
    for p, st in sorted(optimizer.state.items(), key=lambda kv: key(kv[0])):
        h.update(key(p).encode())
        for name in sorted(st):
            v = st[name]
            h.update(name.encode() + (digest(v).encode() if hasattr(v, "detach") else repr(v).encode()))
    return MigrationSnapshot(params, head is embed, int(model.config.vocab_size), entries, h.hexdigest())


class _FaultyGroup(dict):
    """A parameter group that refuses the first new ``params`` list: a fault after the model's rows were installed."""

    armed = True

    def __setitem__(self, k: Any, v: Any) -> None:
        if k == "params" and self.armed:
            self.armed = False
            raise RuntimeError("injected fault: the optimizer refused its new parameter groups")
        super().__setitem__(k, v)


@attrs.frozen
class RollbackReport:
    """Outcome of :func:`check_migration_rollback`.

    Attributes:
        fault_raised: The injected fault reached the caller (a migration that swallows it, or
            never touches the optimizer, cannot be judged and does not pass).
        violations: :func:`~decodespec.spec.vocab_migration.transaction_violations` names.
    """

    fault_raised: bool
    violations: tuple[str, ...]

    @property
    def passed(self) -> bool:
        """The fault surfaced and nothing was left changed."""
        return self.fault_raised and not self.violations


def check_migration_rollback(model: Any, vmap: VocabMap, init: NewRowInit, *, migrate: Callable[..., Any] | None = None) -> RollbackReport:
    """Train ``model`` one Adam step, migrate it with a fault injected after the rows are installed, judge the rollback.

    The fault: the optimizer's first parameter group refuses its new ``params`` list (step 6 of
    the construction order, after steps 2-5 changed the model).  Judged by
    ``invariant.vocab_migration_transaction`` on :func:`snapshot_migration` before and after.

    Source: M3.8 0x08 "Release and rollback ledger", "Tied alias and optimizer restoration order".
    """
    import torch

    from decodespec.impl.vocab import migrate_vocabulary

    migrate = migrate or migrate_vocabulary
    optimizer = _trained(model)
    before = snapshot_migration(model, optimizer)
    optimizer.param_groups[0] = _FaultyGroup(optimizer.param_groups[0])
    pairs = {int(a): int(b) for a, b in zip(vmap.old_ids, vmap.new_ids)}
    values = None if init.values is None else torch.as_tensor(init.values, dtype=model.lm_head.weight.dtype)
    raised = False
    try:
        migrate(model, pairs, vmap.new_size, init=init.kind, sources=dict(init.sources), values=values, optimizer=optimizer)
    except RuntimeError as exc:
        raised = "injected fault" in str(exc)
    return RollbackReport(raised, transaction_violations(before, snapshot_migration(model, optimizer)))


def _not_rolled_back(model: Any, old_to_new: Mapping[int, int], new_size: int, **kw: Any) -> Any:
    """The migration without its undo log: a fault after step 4 leaves the new rows installed (failure lab, 0x08)."""
    from decodespec.impl import vocab as iv

    real = iv._undo_log
    iv._undo_log = lambda model, optimizer: (lambda: None)
    try:
        return iv.migrate_vocabulary(model, old_to_new, new_size, **kw)
    finally:
        iv._undo_log = real


#: name -> (migration, section, title, statement), judged by :func:`check_migration_rollback`.
ROLLBACK_MUTANTS: dict[str, tuple[Callable[..., Any], str, str, str]] = {
    "vocab_migration_not_rolled_back": (
        _not_rolled_back, "M3.8 0x08 Release and rollback ledger; 0x12 Extended contract failures",
        "A failed vocabulary migration is not rolled back",
        ("The migration installs the resized rows and then fails (the optimizer refuses its new groups): without the undo log "
         "the model keeps the new Parameters and vocab_size while the optimizer holds the old ones. check_migration_rollback "
         "reports model_changed and config_changed (invariant.vocab_migration_transaction).")),
}


#: name -> (migration, section, title, statement).  Each is the rule ``mutant.<name>``.
MIGRATION_MUTANTS: dict[str, tuple[Callable[..., Any], str, str, str]] = {
    "vocab_moments_not_moved": (
        _moments_not_moved, "M3.8 0x12 Extended contract failures (item 55); 0x08 Vocabulary migration is a row-address transaction",
        "Vocabulary migration moves the rows but not the optimizer moments",
        ("The embedding/head rows follow the old->new map, Adam's exp_avg / exp_avg_sq stay at their old row addresses: the next "
        "update applies old state to the wrong token. check_migration reports moments_not_mapped.")),
    "vocab_optimizer_before_retie": (
        _optimizer_before_retie, "M3.8 0x12 Vocabulary and tying bugs (item 31); 0x08 Tied alias and optimizer restoration order",
        "The optimizer is handed a second head Parameter before the tie is restored",
        ("After the migration the optimizer also holds a copy of the shared table with its own moment slot (the object created "
        "before re-tying): two optimizer states for one shared Parameter. check_migration reports stale_optimizer_parameter "
        "and optimizer_duplicate_state.")),
    "vocab_alias_not_restored": (
        _alias_not_restored, "M3.8 0x12 Extended contract failures (item 56); 0x08 Tied alias and optimizer restoration order",
        "Tied values restored into two Parameters after migration",
        ("The migrated head is loaded as its own Parameter holding the embedding's values: the logits are right, the tie is "
        "gone. check_migration reports alias_not_restored.")),
    "vocab_rows_by_size": (
        _rows_by_size_only, "M3.8 0x12 Extended contract failures (item 53); 0x08 The vocabulary-axis identity contract",
        "Migration by vocabulary size instead of the ordered identity map",
        ("The migration keeps each row at its old index (only the size changes), ignoring a permutation in the map: every "
        "shape is right and every moved token scores with another token's row. check_migration reports rows_not_mapped and "
        "the mapped raw-logit oracle fails at the moved ids.")),
    "vocab_bias_not_migrated": (
        _bias_not_migrated, ("M3.8 0x09 What tying does and does not imply (a bias is not tied); 0x08 Vocabulary migration is a "
        "row-address transaction"),
        "The head's bias is resized by position, outside the map, when the weight is tied",
        ("The tied table is migrated by the map, but the separate [V] head bias is padded in place (old index kept) and "
        "handed to no optimizer: tying the weight does not tie the bias. check_migration reports bias_not_mapped and "
        "moments_not_mapped, and the mapped raw-logit oracle fails at the moved ids.")),
}
