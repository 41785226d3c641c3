"""M3.8 0x08 Vocabulary migration as a row-address transaction: the map, new rows, moments, the mapped-logit oracle.

Split from :mod:`decodespec.spec.vocab` (the ordered identity and the audit), which this builds on:

* **migration** (:class:`VocabMap`, :class:`NewRowInit`, :func:`migrate_rows`, :func:`migrate_state`):
  an explicit partial bijection from retained old ids to new ids, applied by the *same* map to every
  row-addressed object -- embedding, head, bias, master weights and optimizer moments --, new rows
  initialized as declared (moments of new rows zero), a tied table migrated once (0x12 items 54-56);
* the **mapped raw-logit oracle** (:func:`mapped_logit_gap`) and the **probability drift** of
  appended rows (:func:`append_drift`: ``log p_new[pi(v)] - log p_old[v] = log(1 - m_new)``);
* the **ownership observation** (:class:`MigrationObservation`, :func:`migration_violations`), the
  encoder-decoder vocabulary (:class:`EncDecVocab`) and the migration transaction
  (:class:`MigrationSnapshot`, :func:`transaction_violations`).

Source: M3.8 0x08 ("Vocabulary migration is a row-address transaction", "Append-only growth is safer,
not free", "Tied alias and optimizer restoration order"); 0x09 (tied alias); 0x12 items 31, 53-56.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.rules import rule
from decodespec.spec.vocab import INVALID_MAP, INVALID_TABLE, _count

__all__ = [
    "MIGRATION_VIOLATIONS",
    "NEW_ROW_INITS",
    "AppendDrift",
    "MigrationObservation",
    "NewRowInit",
    "VocabMap",
    "append_drift",
    "mapped_logit_gap",
    "migrate_rows",
    "migrate_state",
    "migration_violations",
]

S08 = "M3.8 0x08 The vocabulary-axis identity contract"


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
