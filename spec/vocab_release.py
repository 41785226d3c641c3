"""M3.8 0x08 The release and rollback ledger: a versioned bundle of tokenizer, ordered hash, rows, config, tie, map and manifests.

Split from :mod:`decodespec.spec.vocab` (identity, audit) and :mod:`decodespec.spec.vocab_migration`
(the row-address map): :class:`ReleaseBundle` (``decodespec.release.v2``) with its optimizer, shard
and local-policy manifests (:class:`OptimizerManifest`, :class:`ShardManifest`,
:class:`PolicyManifest`), checked part by part (:func:`bundle_violations`, :func:`manifest_violations`).

Source: M3.8 0x08 "Release and rollback ledger"; 0x09 (tied alias, sharded owners).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.rules import rule
from decodespec.spec.vocab import SPECIAL_NAMES, _count, _id_tuple
from decodespec.spec.vocab_migration import VocabMap
from decodespec.spec.vocab_parallel import shard_ranges

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_MANIFESTS",
    "BUNDLE_PARTS",
    "INVALID_BUNDLE",
    "MANIFEST_VIOLATIONS",
    "PARAM_USES",
    "TIE_MODES",
    "OptimizerManifest",
    "OptimizerParam",
    "PolicyManifest",
    "ReleaseBundle",
    "ShardManifest",
    "bundle_violations",
    "manifest_violations",
    "map_digest",
]

S08 = "M3.8 0x08 The vocabulary-axis identity contract"


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
