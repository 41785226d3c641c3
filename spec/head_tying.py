"""M3.8 0x09 Weight tying: shared storage, not similar shape -- one Parameter, one optimizer state, the summed gradient, sharded owners, the declared variant.

Split from :mod:`decodespec.spec.head` (the head equation) and :mod:`decodespec.spec.head_loss` (the
backward it sums): tied means one Parameter, not equal values, with one optimizer state
(:class:`TyingObservation`, :func:`tying_violations`); its gradient is the sum of the sparse
input-lookup scatter and the dense classifier contribution (:func:`tied_gradient`); a sharded
optimizer keeps the tie (:class:`ShardedTieObservation`, :func:`sharded_tie_violations`); the
declared tying variant is checked against the parameters (:class:`TyingVariant`,
:func:`tying_variant_violations`).

Source: M3.8 0x09 ("Weight tying: shared storage, not similar shape", "Tied alias and optimizer
restoration order").
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.head import INVALID_INPUT, _matrix
from decodespec.spec.rules import rule

__all__ = [
    "SHARDED_TIE_VIOLATIONS",
    "TIED_VIOLATIONS",
    "TYING_VARIANT_VIOLATIONS",
    "ShardedTieObservation",
    "TyingLayout",
    "TyingObservation",
    "TyingVariant",
    "adam_first_update",
    "sharded_tie_violations",
    "tied_gradient",
    "tying_variant_violations",
    "tying_violations",
]

S01 = "M3.8 0x01 The local object: final normalized hidden rows"
S02 = "M3.8 0x02 Linear projection and storage orientation"
S04 = "M3.8 0x04 Logits, probabilities, and log-probabilities"
S05 = "M3.8 0x05 The training interface: all supervised rows"
S09 = "M3.8 0x09 Weight tying: shared storage, not similar shape"
S0A = "M3.8 0x0A Output-row scope is an interface and cost boundary"


# -- 0x09: weight tying ------------------------------------------------------------------------------

#: The named ways a head can break its tying declaration (:func:`tying_violations`).
TIED_VIOLATIONS: dict[str, str] = {
    "copied_not_tied": "declared tied, but the head and the embedding are two Parameters holding equal values (a copy diverges "
                       "after the next optimizer update)",
    "not_tied": "declared tied, but the head and the embedding are two Parameters with different values",
    "storage_split": "declared tied and one Parameter object, yet two storages (data pointers differ)",
    "tied_but_declared_untied": "declared untied, but the head is the embedding's Parameter",
    "optimizer_duplicate": "the optimizer holds the shared Parameter (or its copies) more than once, or keeps two moment slots "
                           "for it",
    "optimizer_missing": "the optimizer does not hold the head/embedding Parameter at all (a stale object after re-tying)",
}


@attrs.frozen
class TyingObservation:
    """What a runtime's head and embedding are, as plain facts (read from torch by the checker).

    Attributes:
        declared_tied: The checkpoint configuration's ``tie_word_embeddings``.
        same_parameter: ``lm_head.weight is embed_tokens.weight`` (object identity).
        same_storage: Their ``data_ptr()`` are equal.
        equal_values: Their values are equal (never evidence of tying by itself).
        optimizer_entries: How many parameter-group entries of the optimizer are the head or
            embedding Parameter (``None``: no optimizer observed).
        optimizer_states: How many of those entries have their own optimizer state
            (moments) after a step (``None``: not observed).
    """

    declared_tied: bool
    same_parameter: bool
    same_storage: bool
    equal_values: bool
    optimizer_entries: int | None = None
    optimizer_states: int | None = None


@rule(
    "invariant.head_tied_one_parameter",
    title="Tied means one Parameter and one optimizer state, not equal values",
    section=S09,
    statement="When the checkpoint declares tie_word_embeddings, lm_head.weight is embed_tokens.weight (one object, one storage); "
    "two Parameters with equal values are a copy, not a tie, and are refused; the optimizer holds the shared Parameter once, "
    "with one moment slot (two when untied). When untied is declared, the two are distinct Parameters (failure lab 0x12 items "
    "28, 30, 31, 56).",
)
def tying_violations(obs: TyingObservation) -> tuple[str, ...]:
    """The names (:data:`TIED_VIOLATIONS`) of every way ``obs`` breaks its tying declaration; empty when it keeps it.

    Args:
        obs: The observation.

    Returns:
        A tuple of violation names, in the order of :data:`TIED_VIOLATIONS`.

    Source: M3.8 0x09 ("Copying values is not tying", "Tied parameters receive two semantic
    gradient contributions", a loader that materializes two Parameters), 0x08 (restore or create
    exactly one optimizer state for each shared Parameter).
    """
    out: list[str] = []
    if obs.declared_tied:
        if not obs.same_parameter:
            out.append("copied_not_tied" if obs.equal_values else "not_tied")
        elif not obs.same_storage:
            out.append("storage_split")
        want = 1
    else:
        if obs.same_parameter:
            out.append("tied_but_declared_untied")
        want = 2
    if obs.optimizer_entries is not None:
        if obs.optimizer_entries == 0:
            out.append("optimizer_missing")
        elif obs.optimizer_entries > want or (obs.optimizer_states is not None and obs.optimizer_states > want):
            out.append("optimizer_duplicate")
    order = list(TIED_VIOLATIONS)
    return tuple(sorted(dict.fromkeys(out), key=order.index))


@rule(
    "invariant.head_tied_gradient_accumulates",
    title="A tied table's gradient is the input scatter plus the output classifier term",
    section=S09,
    statement="For one Parameter E used for input lookup and output projection, dL/dE[v] = sum over input occurrences of token v "
    "of the upstream gradient at the embedding output (sparse in token rows) + sum_r G[r, v] H[r] (dense over the vocabulary), "
    "accumulated into one gradient buffer before one optimizer update.",
)
def tied_gradient(token_ids: Any, grad_in: Any, grad_logits: Any, hidden: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The two contributions to a tied table's gradient, in float64.

    Args:
        token_ids: ``[N]`` input token ids looked up in ``E`` (flattened ``[B, T]``).
        grad_in: ``[N, d]`` upstream gradient at the embedding output.
        grad_logits: ``G [R, V]``, gradient at the logits (flattened rows).
        hidden: ``H [R, d]``, the rows the head projected.
        vocab_size: V.

    Returns:
        ``(input_part [V, d], output_part [V, d])``; their sum is ``dL/dE``.

    Raises:
        Rejection: ``head.invalid_input`` (shapes, ids outside ``[0, V)``), ``head.nan_logits``.

    Source: M3.8 0x09 "Tied parameters receive two semantic gradient contributions".
    """
    ids = np.asarray(token_ids).reshape(-1)
    gin = _matrix(grad_in, "grad_in", 2)
    g = _matrix(grad_logits, "grad_logits", 2)
    h = _matrix(hidden, "hidden", 2)
    if ids.dtype.kind not in "iu" or gin.shape[0] != ids.shape[0] or g.shape != (h.shape[0], vocab_size) or gin.shape[1] != h.shape[1]:
        raise Rejection(INVALID_INPUT, f"token_ids [N] {ids.shape}, grad_in [N, d] {gin.shape}, grad_logits [R, V] {g.shape} and "
                        f"hidden [R, d] {h.shape} do not agree (V = {vocab_size})", "$.grad_in")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise Rejection(INVALID_INPUT, f"token ids must lie in [0, {vocab_size})", "$.token_ids")
    input_part = np.zeros((vocab_size, gin.shape[1]))
    np.add.at(input_part, ids, gin)  # scatter-add: repeated ids accumulate
    return input_part, g.T @ h


# -- 0x09: a sharded optimizer keeps the tie ------------------------------------------------------

#: The named ways a sharded optimizer breaks a tied table (:func:`sharded_tie_violations`).
SHARDED_TIE_VIOLATIONS: dict[str, str] = {
    "alias_lost": "declared tied, but on some rank the head is no longer the embedding's Parameter (a loader materialized two)",
    "no_owner": "no rank's optimizer shard holds the shared table: it is never updated",
    "duplicate_entry": "one rank's shard holds the shared table (or its copy) more than once",
    "split_owners": "the shared table (or its two halves, embedding and head) is owned by more than one rank",
    "duplicate_state": "the shared table has more than one optimizer state over all ranks",
    "gradient_not_once": "the table's gradient is not the input scatter plus the classifier term, accumulated once",
    "update_not_one_step": "after one step the table is not one Adam step of that gradient from its old value",
    "replicas_diverge": "after the step the ranks hold different tables",
}


@attrs.frozen
class ShardedTieObservation:
    """What each rank of a sharded optimizer holds for a tied table, as plain facts (read from torch by the checker).

    Attributes:
        declared_tied: The checkpoint configuration's ``tie_word_embeddings``.
        alias: ``[R]``: per rank, ``lm_head.weight is embed_tokens.weight``.
        entries: ``[R]``: per rank, parameter-group entries of its *local* optimizer shard that
            are the embedding or the head Parameter (a duplicate counts twice).
        states: ``[R]``: per rank, local optimizer states over those Parameters after the step.
        grad_error: ``max |dE_observed - (input part + output part)| / bound`` over ranks and
            rows (``<= 1`` keeps :func:`tied_gradient`; the checker derives the bound).
        update_error: ``max |E_after - adam_first_update(E_before, dE)| / bound`` (``<= 1``: one step).
        replicas_agree: Every rank holds the same table after the step.

    Source: M3.8 0x09 ("Distributed and sharded optimizers must preserve that identity").
    """

    declared_tied: bool
    alias: tuple[bool, ...]
    entries: tuple[int, ...]
    states: tuple[int, ...]
    grad_error: float
    update_error: float
    replicas_agree: bool


def adam_first_update(weight: Any, grad: Any, lr: float, eps: float = 1e-8) -> np.ndarray:
    """``W - lr * g / (|g| + eps)``: one Adam step from zero moments, bias-corrected (float64).

    With ``m_1 = (1 - b1) g`` and ``v_1 = (1 - b2) g^2`` the bias corrections give ``m_hat = g``,
    ``v_hat = g^2`` for any ``b1, b2``; a table stepped twice (two optimizer entries on one rank)
    moves by about ``2 lr``.

    Args:
        weight: ``[V, d]`` the table before the step.  grad: ``[V, d]`` its gradient.
        lr: Learning rate (> 0).  eps: Adam's ``eps``.

    Raises:
        Rejection: ``head.invalid_input`` when the shapes differ or ``lr <= 0``.

    Source: Kingma and Ba, Adam (Algorithm 1, first iteration); M3.8 0x09 (one optimizer state).
    """
    w = _matrix(weight, "weight", 2)
    g = _matrix(grad, "grad", 2)
    if w.shape != g.shape or not lr > 0:
        raise Rejection(INVALID_INPUT, f"weight {w.shape} and grad {g.shape} must agree and lr > 0 (got {lr})", "$.grad")
    out: np.ndarray = w - lr * g / (np.abs(g) + eps)
    return out


@rule(
    "invariant.head_tied_sharded_owner",
    title="A sharded optimizer keeps a tied table one Parameter, one owner, one state, one accumulated gradient",
    section=S09 + " (Distributed and sharded optimizers must preserve that identity)",
    statement="When optimizer state is sharded over R ranks (ZeroRedundancyOptimizer, or a plain partition of the parameters), "
    "a declared tie stays one Parameter on every rank, which is one entry of exactly one rank's shard with exactly one "
    "optimizer state; its gradient is the input scatter plus the classifier term accumulated once (invariant."
    "head_tied_gradient_accumulates), one step moves it by one Adam update of that gradient, and every rank holds the same "
    "table afterwards. A sharder that registers the table twice (two states, or the embedding and head halves split across "
    "ranks) is refused (failure lab 0x12 items 31, 56).",
)
def sharded_tie_violations(obs: ShardedTieObservation) -> tuple[str, ...]:
    """The names (:data:`SHARDED_TIE_VIOLATIONS`) of every way ``obs`` breaks the tie under sharding; empty when it keeps it.

    Returns:
        Violation names, in the order of :data:`SHARDED_TIE_VIOLATIONS`.

    Source: M3.8 0x09 "Distributed and sharded optimizers must preserve that identity. Registering two
    independently sharded parameters that happen to begin with equal values does not reproduce one shared
    parameter with one accumulated gradient and one optimizer state"; 0x08 step 6.
    """
    out: list[str] = []
    if obs.declared_tied and not all(obs.alias):
        out.append("alias_lost")
    owners = [r for r, n in enumerate(obs.entries) if n > 0]
    tables = 1 if obs.declared_tied else 2  # untied: embedding and head are two Parameters, each owned once
    if not owners:
        out.append("no_owner")
    if any(n > tables for n in obs.entries) or sum(obs.entries) > tables and len(owners) == 1:
        out.append("duplicate_entry")
    if obs.declared_tied and len(owners) > 1:
        out.append("split_owners")
    if sum(obs.states) > tables:
        out.append("duplicate_state")
    if not obs.grad_error <= 1.0:
        out.append("gradient_not_once")
    if not obs.update_error <= 1.0:
        out.append("update_not_one_step")
    if not obs.replicas_agree:
        out.append("replicas_diverge")
    return tuple(out)




# -- 0x09: the declared tying variant against the parameters ------------------------------------

class TyingVariant(str, enum.Enum):
    """M3.8 0x09 "Tying variants are different architectures"."""

    UNTIED = "untied"
    DIRECT = "direct"
    PROJECTED = "projected"
    SOURCE_TARGET_OUTPUT = "source_target_output"
    COPIED_INIT = "copied_init"


@attrs.frozen
class TyingLayout:
    """The storage facts of an embedding/head layout (identities as opaque keys, read by the checker).

    Attributes:
        input_table: Identity key of the (target) input embedding Parameter.
        output_weight: Identity key of the output head's weight Parameter.
        source_table: Identity key of an encoder's source embedding (``None``: decoder-only).
        source_vocab_hash, target_vocab_hash: Ordered vocabulary hashes
            (:func:`decodespec.spec.vocab.vocab_table_hash`) of ``V_src`` and ``V_tgt``
            (``None`` for decoder-only).
        input_width: Columns of the input table (``d_embed``).
        model_width: ``d_model``, the width of the final hidden rows.
        projection_shape: Shape of the learned projection between hidden rows and the shared
            table (``[d_embed, d_model]``) or ``None``.
        projection_key: Its pinned checkpoint key (``None``: not pinned).
    """

    input_table: str
    output_weight: str
    input_width: int
    model_width: int
    source_table: str | None = None
    source_vocab_hash: str | None = None
    target_vocab_hash: str | None = None
    projection_shape: tuple[int, ...] | None = None
    projection_key: str | None = None


#: Violation names of :func:`tying_variant_violations`.
TYING_VARIANT_VIOLATIONS: dict[str, str] = {
    "shared_but_untied_declared": "untied (or copied initialization) declared, but the head's weight is the input table",
    "not_shared": "a tying variant declared, but the head's weight is not the input table's Parameter",
    "width_mismatch": "direct tying declared with d_embed != d_model",
    "projection_missing": "projected tying declared without a [d_embed, d_model] projection",
    "projection_not_pinned": "the projection's checkpoint key is not pinned",
    "unexpected_projection": "a projection exists but the declaration is not projected tying",
    "source_not_shared": "three-way tying declared, but the source embedding is another Parameter",
    "source_target_vocab_differ": "three-way tying over two different ordered vocabularies (V_src != V_tgt)",
    "no_source": "three-way tying declared on a model without a source embedding",
}


@rule(
    "invariant.head_tying_variant",
    title="The declared tying variant is checked against the parameters",
    section=S09,
    statement="A model declares one of untied, direct, projected, source-target-output or copied initialization, and its "
    "parameters must be that architecture: untied and copied initialization keep two Parameters; direct tying shares one "
    "table with d_embed = d_model; projected tying shares the table and has a [d_embed, d_model] projection with a pinned "
    "key; three-way tying shares one table among source embedding, target embedding and output, and only when V_src and "
    "V_tgt are one ordered vocabulary.",
)
def tying_variant_violations(declared: TyingVariant | str, layout: TyingLayout) -> tuple[str, ...]:
    """The names (:data:`TYING_VARIANT_VIOLATIONS`) of every way ``layout`` differs from ``declared``.

    Raises:
        ValueError: ``declared`` is not a :class:`TyingVariant` value.

    Source: M3.8 0x09 "Tying variants are different architectures", "What tying does and does
    not imply" ("different source and target vocabularies: blind three-way tying is invalid").
    """
    v = TyingVariant(declared)
    shared = layout.input_table == layout.output_weight
    out: list[str] = []
    if v in (TyingVariant.UNTIED, TyingVariant.COPIED_INIT):
        if shared:
            out.append("shared_but_untied_declared")
    elif not shared:
        out.append("not_shared")
    if v is TyingVariant.DIRECT and layout.input_width != layout.model_width:
        out.append("width_mismatch")
    if v is TyingVariant.PROJECTED:
        if layout.projection_shape != (layout.input_width, layout.model_width):
            out.append("projection_missing")
        elif layout.projection_key is None:
            out.append("projection_not_pinned")
    elif layout.projection_shape is not None and v is not TyingVariant.UNTIED:
        out.append("unexpected_projection")
    if v is TyingVariant.SOURCE_TARGET_OUTPUT:
        if layout.source_table is None:
            out.append("no_source")
        else:
            if layout.source_table != layout.input_table:
                out.append("source_not_shared")
            if layout.source_vocab_hash is None or layout.source_vocab_hash != layout.target_vocab_hash:
                out.append("source_target_vocab_differ")
    return tuple(out)
