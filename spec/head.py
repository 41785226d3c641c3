"""M3.8 0x02 Linear projection and storage orientation, 0x04 and 0x05: the output head as pure float64 rules.

The output head maps final hidden rows to raw logits, ``Z = H E^T + b`` (PyTorch storage
orientation: ``E`` is ``[V, d]``, the shape of the embedding table).  This module states what a
head and its training loss owe, as pure numpy float64 functions over frozen attrs values:

* the head equation and the score kind of its output (:func:`head_logits`,
  :data:`HEAD_OUTPUT_KINDS`, :func:`criterion_accepts`): a raw head returns ``LOGITS``, the A15
  ``Generator`` returns ``LOGPROBS``; cross entropy takes logits, NLL/KL takes log-probabilities;
* softmax translation invariance and the log-ratio identity (:func:`translation_gap`,
  :func:`log_ratio_gap`);
* the parameter and multiply-accumulate ledger (:class:`HeadShape`, :func:`head_ledger`):
  ``V d (+ V)`` parameters, ``R V d`` MACs and ``R V`` logical logits for ``R`` projected rows;
* the training interface (0x05): per-row loss ``m + log s - z_y`` over supervised rows only
  (:func:`row_losses`), its reduction from the loss sum and the valid count
  (:class:`LossResult`), three schedules that must agree -- materialized, row-chunked and tiled
  over the vocabulary with an online log-sum-exp (:func:`materialized_loss`,
  :func:`chunked_loss`, :func:`tiled_loss`) --, label smoothing with its convention named
  (:class:`Smoothing`), and the affine-head backward ``dH = G E``, ``dE = G^T H``,
  ``db = sum_r G`` (:func:`head_gradients`);
* weight tying (0x09): tied means one Parameter, not equal values, with one optimizer state
  (:class:`TyingObservation`, :func:`tying_violations`), and its gradient is the sum of the
  sparse input-lookup scatter and the dense classifier contribution (:func:`tied_gradient`).

Every rule is registered as ``invariant.head_*`` (:mod:`decodespec.spec.rules`).  Bad input is
a typed :class:`~decodespec.spec.errors.Rejection` (``head.*`` codes) raised before any work.

Source: M3.8 0x01 (``z_i = h_i W_U + b_U``), 0x02 ("Softmax is translation invariant",
"Cross-entropy gradient at the head", "Deriving the complete affine-head backward", "Parameter
and logical-work ledger"), 0x04 ("One denominator derives softmax, log-softmax, and
cross-entropy", "Label smoothing is a target-distribution contract", "Dtype and degenerate-row
policy"), 0x05 ("Source-to-tensor training trace", "Materialized, chunked, and fused
execution", "Exact conformance checks"), 0x0A (the ledger, vocabulary tiles), 0x11 (shape and
type ledger).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.rules import rule

__all__ = [
    "ACCUMULATION_VIOLATIONS",
    "CRITERIA",
    "DEGENERATE_ROW",
    "HALF_DTYPES",
    "HEAD_OUTPUT_KINDS",
    "IGNORE_INDEX",
    "INVALID_INPUT",
    "NAN_LOGITS",
    "ROW_MAP_VIOLATIONS",
    "SHARDED_TIE_VIOLATIONS",
    "TIED_VIOLATIONS",
    "TYING_VARIANT_VIOLATIONS",
    "UNIT_ROUNDOFF",
    "HeadGradients",
    "HeadLedger",
    "HeadShape",
    "LossErrorBound",
    "LossResult",
    "LossSpec",
    "PrecisionPolicy",
    "RowMap",
    "ShardedTieObservation",
    "Smoothing",
    "TyingLayout",
    "TyingObservation",
    "TyingVariant",
    "accumulation_violations",
    "adam_first_update",
    "chunk_bounds",
    "chunked_loss",
    "criterion_accepts",
    "gamma",
    "head_gradients",
    "head_ledger",
    "head_logits",
    "log_ratio_gap",
    "loss_error_bound",
    "materialized_loss",
    "rng_violations",
    "row_losses",
    "row_map_from_labels",
    "row_map_violations",
    "sharded_tie_violations",
    "target_distribution",
    "tied_gradient",
    "tiled_loss",
    "translation_gap",
    "tying_variant_violations",
    "tying_violations",
]

S01 = "M3.8 0x01 The local object: final normalized hidden rows"
S02 = "M3.8 0x02 Linear projection and storage orientation"
S04 = "M3.8 0x04 Logits, probabilities, and log-probabilities"
S05 = "M3.8 0x05 The training interface: all supervised rows"
S09 = "M3.8 0x09 Weight tying: shared storage, not similar shape"
S0A = "M3.8 0x0A Output-row scope is an interface and cost boundary"

INVALID_INPUT = register_code(
    "head.invalid_input", "rejection", S05,
    "A head or loss input has the wrong rank, shape or type (hidden [R, d], weight [V, d], bias [V], labels [R] integers), "
    "a label outside [0, V) that is not the ignore index, a chunk or tile size below one, or a smoothing epsilon outside [0, 1].",
)
NAN_LOGITS = register_code(
    "head.nan_logits", "rejection", "M3.8 0x04 Dtype and degenerate-row policy",
    "A head input or logit row holds NaN (or +inf); NaN contaminates every comparison and reduction, so the loss is refused.",
)
DEGENERATE_ROW = register_code(
    "head.degenerate_row", "rejection", "M3.8 0x04 Dtype and degenerate-row policy",
    "A supervised row has every logit -inf: zero-over-zero normalization is undefined and no fallback is declared, so the loss is refused.",
)

#: The ignore index of PyTorch's ``cross_entropy`` (and HF's label convention): a row with this
#: label is not supervised (M3.8 0x05 "M3.9 excludes it through the declared ignore/mask contract").
IGNORE_INDEX = -100


# -- 0x02 / 0x11: score kind of the head's output and the criterion pairing --------------------

#: Score kind returned by each head form (M3.8 0x03, 0x11 "Score-type contract"): the modern raw
#: head (``lm_head``, ``nn.Linear``) returns logits; the A15 ``Generator`` (``log_softmax`` of the
#: projection) returns log-probabilities.  The shape does not identify the kind; the head declares it.
HEAD_OUTPUT_KINDS: dict[str, ScoreKind] = {"linear": ScoreKind.LOGITS, "generator": ScoreKind.LOGPROBS}

#: Score kind each training criterion accepts (M3.8 0x05 "The implementation rule is"):
#: ``cross_entropy`` expects unnormalized logits; ``nll`` and ``kl_div`` expect log-probabilities.
CRITERIA: dict[str, ScoreKind] = {"cross_entropy": ScoreKind.LOGITS, "nll": ScoreKind.LOGPROBS, "kl_div": ScoreKind.LOGPROBS}


@rule(
    "invariant.head_criterion_pairing",
    title="The head's output kind must be the kind its criterion accepts",
    section=S05,
    statement="A linear head returns raw logits and pairs with cross entropy; a Generator returns log-probabilities and "
    "pairs with an NLL/KL criterion. Passing probabilities or log-probabilities to cross entropy, or logits to NLL/KL, is "
    "refused as policy.score_kind_mismatch (failure lab 0x12 items 15, 16).",
)
def criterion_accepts(head: str, criterion: str) -> ScoreKind:
    """Check that ``criterion`` accepts the kind ``head`` returns; return that kind.

    Args:
        head: ``"linear"`` or ``"generator"`` (:data:`HEAD_OUTPUT_KINDS`).
        criterion: ``"cross_entropy"``, ``"nll"`` or ``"kl_div"`` (:data:`CRITERIA`).

    Raises:
        Rejection: ``head.invalid_input`` for an unknown head or criterion;
            ``policy.score_kind_mismatch`` when the kinds differ.

    Source: M3.8 0x03, 0x05, 0x11; failure lab 0x12 items 15-16.
    """
    from decodespec.spec.policy.codes import SCORE_KIND_MISMATCH

    if head not in HEAD_OUTPUT_KINDS:
        raise Rejection(INVALID_INPUT, f"unknown head form {head!r}; known: {sorted(HEAD_OUTPUT_KINDS)}", "$.head")
    if criterion not in CRITERIA:
        raise Rejection(INVALID_INPUT, f"unknown criterion {criterion!r}; known: {sorted(CRITERIA)}", "$.criterion")
    kind = HEAD_OUTPUT_KINDS[head]
    if CRITERIA[criterion] is not kind:
        raise Rejection(SCORE_KIND_MISMATCH, f"{criterion} expects {CRITERIA[criterion].value}, the {head} head returns {kind.value}",
                        "$.criterion")
    return kind


# -- input checks ----------------------------------------------------------------------------

def _matrix(x: Any, name: str, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise Rejection(INVALID_INPUT, f"{name} must hold real numbers: {exc}", f"$.{name}") from None
    if arr.ndim != ndim:
        raise Rejection(INVALID_INPUT, f"{name} must have rank {ndim}, got shape {arr.shape}", f"$.{name}")
    if np.isnan(arr).any():
        raise Rejection(NAN_LOGITS, f"{name} holds NaN", f"$.{name}", {"first_index": int(np.flatnonzero(np.isnan(arr).ravel())[0])})
    return arr


def _check_head(hidden: Any, weight: Any, bias: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    h = _matrix(hidden, "hidden", 2)
    e = _matrix(weight, "weight", 2)
    if h.shape[1] != e.shape[1] or e.shape[0] == 0:
        raise Rejection(INVALID_INPUT, f"hidden [R, d] {h.shape} and weight [V, d] {e.shape} must share d, V >= 1", "$.weight")
    if not (np.isfinite(h).all() and np.isfinite(e).all()):
        raise Rejection(NAN_LOGITS, "hidden rows and output weights must be finite", "$.hidden")
    b = None
    if bias is not None:
        b = _matrix(bias, "bias", 1)
        if b.shape != (e.shape[0],):
            raise Rejection(INVALID_INPUT, f"bias must be [V] = [{e.shape[0]}], got {b.shape}", "$.bias")
        if np.isposinf(b).any():
            raise Rejection(NAN_LOGITS, "bias holds +inf", "$.bias")
    return h, e, b


# -- 0x01 / 0x02: the head equation -------------------------------------------------------------

@rule(
    "invariant.head_equation",
    title="Logits are Z = H E^T + b over the last axis",
    section=S02,
    statement="For hidden rows H [R, d], stored output weight E [V, d] (the embedding-table orientation, not transposed by "
    "hand) and optional bias b [V], the head returns raw logits Z [R, V] with Z[r, v] = sum_j H[r, j] E[v, j] + b[v]; "
    "-inf in b masks a vocabulary column.",
)
def head_logits(hidden: Any, weight: Any, bias: Any = None) -> np.ndarray:
    """Raw logits of the affine head in float64.

    Args:
        hidden: ``[R, d]`` final normalized hidden rows.
        weight: ``[V, d]`` output weight in PyTorch storage orientation.
        bias: ``[V]`` or ``None``; ``-inf`` entries mask a column.

    Returns:
        ``[R, V]`` float64 logits (kind ``LOGITS``).

    Raises:
        Rejection: ``head.invalid_input`` (ranks, shapes), ``head.nan_logits`` (NaN or
            non-finite hidden/weight, +inf bias).

    Source: M3.8 0x01 (``z_i = h_i W_U + b_U``), 0x02 ("Algebra versus PyTorch weight shape").
    """
    h, e, b = _check_head(hidden, weight, bias)
    z: np.ndarray = h @ e.T  # [R, V]
    return z if b is None else z + b[None, :]


def _lse(z: np.ndarray) -> np.ndarray:
    """Row-wise stable log-sum-exp of ``[R, V]``; a row of all ``-inf`` gives ``-inf``."""
    m = z.max(axis=1)  # [R]
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse: np.ndarray = safe + np.log(np.exp(z - safe[:, None]).sum(axis=1))
    return lse


@rule(
    "invariant.head_translation_invariance",
    title="Softmax is translation invariant",
    section=S02,
    statement="softmax(z + c 1) = softmax(z) for every real c: adding one constant to every logit of a row changes neither "
    "its probabilities nor its cross entropy (the zero mode of the Hessian diag(p) - p p^T along the all-ones vector).",
)
def translation_gap(logits: Any, shift: float) -> float:
    """``max |softmax(z + c) - softmax(z)|`` over the rows of ``logits`` (0 up to rounding).

    Args:
        logits: ``[R, V]`` (or ``[V]``) float logits, each row with a finite entry.
        shift: The constant ``c`` (finite).

    Returns:
        The L-infinity gap in probability units.

    Raises:
        Rejection: ``head.nan_logits`` (NaN), ``head.degenerate_row`` (a row of all ``-inf``).

    Source: M3.8 0x02 "Logits are learned compatibility energies"; 0x04 (Hessian zero mode).
    """
    z = np.atleast_2d(_matrix(logits, "logits", np.ndim(logits)))
    _check_rows(z)
    p = np.exp(z - _lse(z)[:, None])
    zc = z + float(shift)
    q = np.exp(zc - _lse(zc)[:, None])
    return float(np.abs(p - q).max())


@rule(
    "invariant.head_log_ratio",
    title="A logit difference is a multiclass log-probability ratio",
    section=S02,
    statement="log(p_i / p_j) = z_i - z_j for every pair of finite logits of one row: only relative logits matter, and no "
    "single logit is a binary log-odds (failure lab 0x12 items 7-8).",
)
def log_ratio_gap(logits: Any) -> float:
    """``max |(log p_i - log p_j) - (z_i - z_j)|`` over rows and finite pairs (0 up to rounding).

    Args:
        logits: ``[R, V]`` (or ``[V]``) logits.

    Returns:
        The largest deviation in nats.

    Raises:
        Rejection: ``head.nan_logits``, ``head.degenerate_row`` (as :func:`translation_gap`).

    Source: M3.8 0x02 "Logits are learned compatibility energies".
    """
    z = np.atleast_2d(_matrix(logits, "logits", np.ndim(logits)))
    _check_rows(z)
    logp = z - _lse(z)[:, None]
    gap = 0.0
    for row_z, row_lp in zip(z, logp):
        fin = np.isfinite(row_z)
        dz = row_z[fin][:, None] - row_z[fin][None, :]
        dlp = row_lp[fin][:, None] - row_lp[fin][None, :]
        gap = max(gap, float(np.abs(dz - dlp).max()))
    return gap


def _check_rows(z: np.ndarray, row_ids: np.ndarray | None = None) -> None:
    """Refuse +inf, and a row of all ``-inf`` (named by its id in ``row_ids``, default its position)."""
    if np.isposinf(z).any():
        raise Rejection(NAN_LOGITS, "+inf logit", "$.logits")
    dead = ~np.isfinite(z).any(axis=1)
    if dead.any():
        r = int(np.flatnonzero(dead)[0])
        r = int(row_ids[r]) if row_ids is not None else r
        raise Rejection(DEGENERATE_ROW, f"row {r} has every logit -inf", f"$.logits[{r}]", {"row": r})


# -- 0x02 / 0x0A: the parameter and work ledger --------------------------------------------------

@attrs.frozen
class HeadShape:
    """The output head's architecture.

    Attributes:
        vocab_size: V, output rows.
        hidden_size: d, the model width.
        bias: Whether the head has a ``[V]`` bias (tying never ties or removes it).
        tied: Whether the weight is the input embedding's Parameter (M3.8 0x09).
    """

    vocab_size: int = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(1)))
    hidden_size: int = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(1)))
    bias: bool = False
    tied: bool = False


@attrs.frozen
class HeadLedger:
    """The head's local ledger for one projection of ``num_rows`` rows.

    Attributes:
        num_rows: R, rows actually projected.
        head_parameters: ``V d + [bias] V``, the head's parameters (elements).
        new_parameters: Parameters the head allocates beyond the embedding: ``head_parameters``
            untied, only the bias when tied.
        macs: ``R V d`` multiply-accumulates of the projection (tying does not remove them).
        logit_elements: ``R V`` elements of the logical logit tensor.

    Units: counts of elements / multiply-accumulates (not bytes).
    """

    num_rows: int
    head_parameters: int
    new_parameters: int
    macs: int
    logit_elements: int

    def logit_bytes(self, bytes_per_logit: int) -> int:
        """Logical logit bytes ``R V b_z`` (M3.8 0x05: a logical size, not a hardware peak)."""
        return self.logit_elements * bytes_per_logit


@rule(
    "invariant.head_ledger",
    title="Head parameters V d (+ V), work R V d MACs, R V logical logits",
    section=S0A,
    statement="An affine head has V d weight parameters plus V with a bias; projecting R rows costs R V d multiply-accumulates "
    "and produces R V logical logit elements. A tied head allocates no extra V d parameters but does the same R V d work; "
    "selecting rows before the projection reduces work and logits in proportion to the omitted rows.",
)
def head_ledger(shape: HeadShape, num_rows: int) -> HeadLedger:
    """The ledger of projecting ``num_rows`` rows through ``shape``.

    Args:
        shape: The head.
        num_rows: R >= 0, rows projected (``B * T_kept``).

    Returns:
        :class:`HeadLedger`.

    Raises:
        Rejection: ``head.invalid_input`` for a negative or non-integer ``num_rows``.

    Source: M3.8 0x02 "Parameter and logical-work ledger"; 0x0A (worked example: the all-row
    versus last-row ratio is exactly S).
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0:
        raise Rejection(INVALID_INPUT, f"num_rows must be an integer >= 0, got {num_rows!r}", "$.num_rows")
    v, d, r = shape.vocab_size, shape.hidden_size, int(num_rows)
    params = v * d + (v if shape.bias else 0)
    new = (v if shape.bias else 0) if shape.tied else params
    return HeadLedger(num_rows=r, head_parameters=params, new_parameters=new, macs=r * v * d, logit_elements=r * v)


# -- 0x04 / 0x05: the training loss ----------------------------------------------------------------

class Smoothing(str, enum.Enum):
    """Label-smoothing conventions (M3.8 0x04 "Label smoothing is a target-distribution contract").

    * ``ALL_CLASSES``: ``q = (1 - eps) onehot(y) + eps / V`` -- uniform mass over all V classes,
      the target included.  This is PyTorch's ``cross_entropy(label_smoothing=eps)`` and HF's
      ``label_smoothing_factor``.
    * ``NON_TARGET``: ``q = (1 - eps) onehot(y) + eps / (V - 1)`` on the ``V - 1`` other classes
      only.  The same eps gives another target distribution, loss and gradient.
    """

    ALL_CLASSES = "all_classes"
    NON_TARGET = "non_target"


def _epsilon(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not 0.0 <= float(value) <= 1.0:
        raise Rejection(INVALID_INPUT, f"label_smoothing must be a number in [0, 1], got {value!r}", "$.label_smoothing")
    return float(value)


@attrs.frozen
class LossSpec:
    """The declared loss contract of one training step.

    Attributes:
        ignore_index: Label of an unsupervised row (default :data:`IGNORE_INDEX`, -100).
        label_smoothing: eps in ``[0, 1]``.
        smoothing: The convention eps means (default ``ALL_CLASSES``, PyTorch/HF).
    """

    ignore_index: int = IGNORE_INDEX
    label_smoothing: float = attrs.field(default=0.0, converter=_epsilon)
    smoothing: Smoothing = attrs.field(default=Smoothing.ALL_CLASSES, converter=Smoothing)


def _labels(labels: Any, num_rows: int, vocab_size: int, spec: LossSpec) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.shape != (num_rows,) or not (arr.dtype.kind in "iu" or (arr.size == 0)):
        raise Rejection(INVALID_INPUT, f"labels must be integers [R] = [{num_rows}], got {arr.dtype} {arr.shape}", "$.labels")
    arr = arr.astype(np.int64)
    bad = (arr != spec.ignore_index) & ((arr < 0) | (arr >= vocab_size))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise Rejection(INVALID_INPUT, f"label {int(arr[r])} of row {r} is outside [0, {vocab_size}) and is not the ignore index "
                        f"{spec.ignore_index}", f"$.labels[{r}]", {"row": r})
    return arr


@rule(
    "invariant.head_label_smoothing",
    title="Label smoothing is a target distribution with a named convention",
    section=S04,
    statement="With eps and the ALL_CLASSES convention (PyTorch/HF label_smoothing) q = (1 - eps) onehot(y) + eps / V; with "
    "NON_TARGET, q = (1 - eps) onehot(y) + eps / (V - 1) off the target. The loss is -sum_v q_v log p_v and its logit gradient "
    "p - q; the same eps under the two conventions gives different losses and gradients.",
)
def target_distribution(labels: Any, vocab_size: int, spec: LossSpec = LossSpec()) -> np.ndarray:
    """Target distributions ``Q [R, V]`` of the supervised rows (ignored rows are all zero).

    Args:
        labels: ``[R]`` integer labels (``spec.ignore_index`` marks an unsupervised row).
        vocab_size: V.
        spec: The loss contract.

    Returns:
        ``[R, V]`` float64; each supervised row sums to one.

    Raises:
        Rejection: ``head.invalid_input`` (labels shape or range; V = 1 with ``NON_TARGET``
            smoothing, which has no other class).

    Source: M3.8 0x04 "Label smoothing is a target-distribution contract"; 0x0A (all-class
    convention across vocabulary shards).
    """
    y = np.asarray(labels)
    num_rows = int(y.shape[0]) if y.ndim == 1 else -1
    y = _labels(labels, num_rows, vocab_size, spec)
    valid = y != spec.ignore_index
    eps = spec.label_smoothing
    q = np.zeros((y.shape[0], vocab_size))
    if spec.smoothing is Smoothing.ALL_CLASSES:
        q[valid] = eps / vocab_size
    elif eps > 0:
        if vocab_size < 2:
            raise Rejection(INVALID_INPUT, "NON_TARGET smoothing needs V >= 2", "$.smoothing")
        q[valid] = eps / (vocab_size - 1)
    rows = np.flatnonzero(valid)
    q[rows, y[rows]] = (1.0 - eps) + (eps / vocab_size if spec.smoothing is Smoothing.ALL_CLASSES else 0.0)
    return q


@attrs.frozen(eq=False)
class LossResult:
    """Per-row losses and their reduction.

    Attributes:
        row_losses: ``[R]`` float64; 0 on ignored rows (PyTorch ``reduction="none"``).
        valid: ``[R]`` bool, the supervised rows.
        loss_sum: Sum of the supervised rows' losses.
        valid_count: Number of supervised rows.

    Units: nats.
    """

    row_losses: np.ndarray
    valid: np.ndarray
    loss_sum: float
    valid_count: int

    @property
    def mean(self) -> float:
        """``loss_sum / valid_count`` (NaN when no row is supervised, as PyTorch's mean)."""
        return self.loss_sum / self.valid_count if self.valid_count else float("nan")


@rule(
    "invariant.head_loss_row",
    title="Per-row loss m + log s - z_y over supervised rows only",
    section=S05,
    statement="For each supervised row, m = max_v z_v, s = sum_v exp(z_v - m) and the loss is m + log s - z_y (with label "
    "smoothing, -sum_v q_v log p_v); a row labelled with the ignore index contributes no loss, no count and no gradient. "
    "A supervised row of all -inf logits is refused (head.degenerate_row); a -inf target logit gives +inf.",
)
def row_losses(logits: Any, labels: Any, spec: LossSpec = LossSpec()) -> LossResult:
    """Reference per-row losses of materialized logits.

    Args:
        logits: ``[R, V]`` raw logits (``-inf`` masks allowed).
        labels: ``[R]`` integer labels.
        spec: The loss contract.

    Returns:
        :class:`LossResult`.

    Raises:
        Rejection: ``head.invalid_input``, ``head.nan_logits`` (NaN or +inf),
            ``head.degenerate_row`` (a supervised row of all ``-inf``).

    Source: M3.8 0x05 "Source-to-tensor training trace"; 0x04 ``L = LSE(z) - z_y``.
    """
    z = _matrix(logits, "logits", 2)
    y = _labels(labels, z.shape[0], z.shape[1], spec)
    valid = y != spec.ignore_index
    if np.isposinf(z).any():
        raise Rejection(NAN_LOGITS, "+inf logit", "$.logits")
    if valid.any():
        _check_rows(z[valid], np.flatnonzero(valid))
    losses = np.zeros(z.shape[0])
    if valid.any():
        zv = z[valid]
        lse = _lse(zv)
        q = target_distribution(y, z.shape[1], spec)[valid]
        with np.errstate(invalid="ignore"):
            logp = zv - lse[:, None]
            # q_v log p_v with the convention 0 * (-inf) = 0 (a masked class with no target mass).
            losses[valid] = -np.where(q > 0, q * logp, 0.0).sum(axis=1)
    return LossResult(losses, valid, float(losses[valid].sum()), int(valid.sum()))


def materialized_loss(hidden: Any, weight: Any, bias: Any, labels: Any, spec: LossSpec = LossSpec()) -> LossResult:
    """The materialized schedule: all ``[R, V]`` logits at once, then :func:`row_losses`.

    Shapes: hidden ``[R, d]``, weight ``[V, d]``, bias ``[V]`` or ``None``, labels ``[R]``.

    Raises: as :func:`head_logits` and :func:`row_losses`.

    Source: M3.8 0x05 "Materialized, chunked, and fused execution".
    """
    return row_losses(head_logits(hidden, weight, bias), labels, spec)


def chunk_bounds(num_rows: int, chunks: int | Sequence[int]) -> list[tuple[int, int]]:
    """Half-open row ranges of a chunk schedule.

    Args:
        num_rows: R.
        chunks: A chunk size C >= 1 (the last chunk holds the remainder), or explicit sizes
            (each >= 1) summing to R.

    Raises:
        Rejection: ``head.invalid_input`` for a size below one or sizes not summing to R.
    """
    if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool):
        if chunks < 1:
            raise Rejection(INVALID_INPUT, f"chunk size must be >= 1, got {chunks}", "$.chunks")
        sizes = [min(int(chunks), num_rows - a) for a in range(0, num_rows, int(chunks))]
    else:
        if isinstance(chunks, bool):  # a bool is neither a chunk size nor a list of sizes
            raise Rejection(INVALID_INPUT, f"chunks must be a size or a list of sizes, got {chunks!r}", "$.chunks")
        sizes = [int(c) for c in chunks]
        if any(c < 1 for c in sizes) or sum(sizes) != num_rows:
            raise Rejection(INVALID_INPUT, f"chunk sizes {sizes} must be >= 1 and sum to R = {num_rows}", "$.chunks")
    bounds, start = [], 0
    for c in sizes:
        bounds.append((start, start + c))
        start += c
    return bounds


@rule(
    "invariant.head_mean_from_sum_and_count",
    title="The mean loss is the loss sum over the valid count, never a mean of chunk means",
    section=S05,
    statement="A chunked or sharded loss accumulates loss_sum += sum of its supervised rows' losses and valid_count += its "
    "supervised rows, and returns loss_sum / valid_count; averaging per-chunk means weights uneven chunks and chunks with "
    "ignored rows wrongly (failure lab 0x12 item 51).",
)
def chunked_loss(hidden: Any, weight: Any, bias: Any, labels: Any, spec: LossSpec = LossSpec(),
                 chunks: int | Sequence[int] = 1) -> LossResult:
    """The row-chunked schedule: ``[C, V]`` logits per chunk, loss sum and valid count accumulated.

    Args:
        hidden, weight, bias, labels, spec: As :func:`materialized_loss`.
        chunks: A chunk size or explicit sizes (:func:`chunk_bounds`); uneven chunks allowed.

    Returns:
        :class:`LossResult` equal to the materialized one.

    Raises: as :func:`materialized_loss` and :func:`chunk_bounds`.

    Source: M3.8 0x05 "An exact row-chunked loss must accumulate a sum and count".
    """
    h, e, b = _check_head(hidden, weight, bias)
    y = _labels(labels, h.shape[0], e.shape[0], spec)
    parts: list[np.ndarray] = []
    loss_sum, valid_count = 0.0, 0
    for a, z in chunk_bounds(h.shape[0], chunks):
        res = row_losses(head_logits(h[a:z], e, b), y[a:z], spec)  # [C, V] live
        parts.append(res.row_losses)
        loss_sum += res.loss_sum
        valid_count += res.valid_count
    losses = np.concatenate(parts) if parts else np.zeros(0)
    return LossResult(losses, y != spec.ignore_index, loss_sum, valid_count)


@rule(
    "invariant.head_schedules_agree",
    title="Materialized, row-chunked and vocabulary-tiled schedules give the same losses",
    section=S05,
    statement="The materialized [R, V] schedule, any row-chunked schedule and a fused-style schedule that tiles the vocabulary "
    "with an online log-sum-exp (running max m, rescaled denominator s, the target logit taken from its owning tile) give the "
    "same per-row losses, the same loss sum and valid count, and the same mean; matching only the scalar mean is not enough.",
)
def tiled_loss(hidden: Any, weight: Any, bias: Any, labels: Any, spec: LossSpec = LossSpec(),
               chunks: int | Sequence[int] = 1, vocab_tile: int = 1) -> LossResult:
    """The fused-style schedule: row chunks times vocabulary tiles, never an ``[R, V]`` or ``[C, V]`` tensor.

    Per row it keeps the running maximum ``m``, the denominator ``s`` (rescaled by
    ``exp(m_old - m_new)`` when the maximum grows), the target logit (from the tile that owns the
    label, a neutral 0 elsewhere) and, for smoothing, the weighted sum of logits; the loss is
    ``m + log s - sum_v q_v z_v``.

    Args:
        hidden, weight, bias, labels, spec: As :func:`materialized_loss`.
        chunks: Row chunk size or sizes (:func:`chunk_bounds`).
        vocab_tile: Vocabulary tile width (>= 1; the last tile holds the remainder).

    Returns:
        :class:`LossResult` equal to the materialized one up to float64 rounding.

    Raises: as :func:`materialized_loss`; ``head.invalid_input`` for ``vocab_tile < 1``.

    Source: M3.8 0x05 (fused linear plus cross-entropy), 0x0A "Exact forward trace over
    vocabulary shards" (global MAX then SUM; the target from its owner, neutral elsewhere).
    """
    h, e, b = _check_head(hidden, weight, bias)
    v = e.shape[0]
    y = _labels(labels, h.shape[0], v, spec)
    if isinstance(vocab_tile, bool) or not isinstance(vocab_tile, (int, np.integer)) or vocab_tile < 1:
        raise Rejection(INVALID_INPUT, f"vocab_tile must be an integer >= 1, got {vocab_tile!r}", "$.vocab_tile")
    eps = spec.label_smoothing
    on_target = 1.0 - eps + (eps / v if spec.smoothing is Smoothing.ALL_CLASSES else 0.0)
    off_target = eps / v if spec.smoothing is Smoothing.ALL_CLASSES else (eps / (v - 1) if eps > 0 else 0.0)
    if spec.smoothing is Smoothing.NON_TARGET and eps > 0 and v < 2:
        raise Rejection(INVALID_INPUT, "NON_TARGET smoothing needs V >= 2", "$.smoothing")
    losses = np.zeros(h.shape[0])
    valid = y != spec.ignore_index
    loss_sum, valid_count = 0.0, 0
    for a, z_end in chunk_bounds(h.shape[0], chunks):
        rows = np.flatnonzero(valid[a:z_end]) + a  # the chunk's supervised rows (ignored rows are compacted away)
        if rows.size == 0:
            continue
        hc, yc = h[rows], y[rows]
        m = np.full(rows.size, -np.inf)
        s = np.zeros(rows.size)
        target = np.zeros(rows.size)
        weighted = np.zeros(rows.size)  # sum_v q_v z_v over the non-target classes, finite logits only
        masked_mass = np.zeros(rows.size, dtype=bool)  # a class with q_v > 0 has z_v = -inf
        for t0 in range(0, v, int(vocab_tile)):
            t1 = min(v, t0 + int(vocab_tile))
            zt = hc @ e[t0:t1].T  # [C, tile]
            if b is not None:
                zt = zt + b[None, t0:t1]
            if np.isposinf(zt).any():
                raise Rejection(NAN_LOGITS, "+inf logit", "$.logits")
            m_new = np.maximum(m, zt.max(axis=1))
            live = np.isfinite(m_new)
            both = live & np.isfinite(m)
            scale = np.where(both, np.exp(np.where(both, m, 0.0) - np.where(both, m_new, 0.0)), 0.0)  # exp(m_old - m_new)
            shift = np.where(live, m_new, 0.0)
            s = s * scale + np.where(live, np.exp(zt - shift[:, None]).sum(axis=1), 0.0)
            m = m_new
            owns = (t0 <= yc) & (yc < t1)
            local = np.where(owns, yc - t0, 0)
            picked = zt[np.arange(rows.size), local]
            target = target + np.where(owns, np.where(np.isfinite(picked), picked, 0.0), 0.0)
            target_dead = owns & ~np.isfinite(picked)
            if off_target > 0:
                off = np.ones_like(zt, dtype=bool)
                off[np.flatnonzero(owns), local[owns]] = False
                fin = np.isfinite(zt)
                weighted = weighted + np.where(off & fin, zt, 0.0).sum(axis=1) * off_target
                masked_mass |= (off & ~fin).any(axis=1)
            masked_mass |= target_dead & (on_target > 0)
            if target_dead.any():
                target = np.where(target_dead, -np.inf, target)
        dead = ~np.isfinite(m)
        if dead.any():
            r = int(rows[np.flatnonzero(dead)[0]])
            raise Rejection(DEGENERATE_ROW, f"row {r} has every logit -inf", f"$.logits[{r}]", {"row": r})
        lse = m + np.log(s)
        with np.errstate(invalid="ignore"):
            row = lse - (on_target * target if on_target > 0 else 0.0) - weighted
        row = np.where(masked_mass, np.inf, row)
        losses[rows] = row
        loss_sum += float(row.sum())
        valid_count += int(rows.size)
    return LossResult(losses, valid, loss_sum, valid_count)


# -- 0x02 / 0x05: the affine-head backward ----------------------------------------------------------

@attrs.frozen(eq=False)
class HeadGradients:
    """Gradients of the mean (or sum) loss at the head.

    Attributes:
        logits: ``G [R, V]`` = ``(P - Q) / N`` on supervised rows, 0 on ignored rows
            (``N`` = valid count for the mean, 1 for the sum).
        hidden: ``dH = G E`` ``[R, d]``.
        weight: ``dE = G^T H`` ``[V, d]``.
        bias: ``db = sum_r G`` ``[V]``, or ``None`` without a bias.
    """

    logits: np.ndarray
    hidden: np.ndarray
    weight: np.ndarray
    bias: np.ndarray | None


@rule(
    "invariant.head_gradients",
    title="Head backward: G = (P - Q) / N, dH = G E, dE = G^T H, db = sum_r G",
    section=S02,
    statement="For Z = H E^T + b and the mean loss over N supervised rows, the logit gradient is G = (P - Q) / N on supervised "
    "rows and 0 on ignored rows (Q the one-hot or smoothed target); then dH = G E [R, d], dE = G^T H [V, d], db = sum over "
    "rows of G [V]. Every vocabulary row gets probability-weighted pressure; the target row the extra -1 term.",
)
def head_gradients(hidden: Any, weight: Any, bias: Any, labels: Any, spec: LossSpec = LossSpec(),
                   reduction: str = "mean") -> HeadGradients:
    """Analytic float64 gradients of the head loss.

    Args:
        hidden, weight, bias, labels, spec: As :func:`materialized_loss`.
        reduction: ``"mean"`` (over the valid count) or ``"sum"``.

    Returns:
        :class:`HeadGradients`; all zero when no row is supervised.

    Raises: as :func:`materialized_loss`; ``head.invalid_input`` for another reduction.

    Source: M3.8 0x02 "Deriving the complete affine-head backward"; 0x04 "Why the gradient is
    probability minus target"; 0x05 "Backward state and recomputation".
    """
    if reduction not in ("mean", "sum"):
        raise Rejection(INVALID_INPUT, f"reduction must be 'mean' or 'sum', got {reduction!r}", "$.reduction")
    h, e, b = _check_head(hidden, weight, bias)
    z = head_logits(h, e, b)
    res = row_losses(z, labels, spec)
    g = np.zeros_like(z)
    if res.valid_count:
        zv = z[res.valid]
        p = np.exp(zv - _lse(zv)[:, None])
        q = target_distribution(labels, z.shape[1], spec)[res.valid]
        g[res.valid] = (p - q) / (res.valid_count if reduction == "mean" else 1.0)
    return HeadGradients(logits=g, hidden=g @ e, weight=g.T @ h, bias=None if b is None else g.sum(axis=0))



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


# -- 0x04: the declared accumulation dtype and the error bound it implies ---------------------

#: Unit roundoff ``u = 2^-p`` of each floating dtype a head or loss may run in (``p`` = significand
#: bits including the implicit one: float64 53, float32 24, float16 11, bfloat16 8).  Rounding to
#: nearest gives ``fl(x) = x (1 + delta)`` with ``|delta| <= u`` (Higham, *Accuracy and Stability of
#: Numerical Algorithms*, 2.1); the loss checker's tolerances for 16-bit inputs are derived from it.
UNIT_ROUNDOFF: dict[str, float] = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}

#: Dtypes whose range or precision cannot carry a row maximum and an exponential sum over V
#: classes: M3.8 0x04 "A runtime may project in bf16/fp16, promote row maximum and exponential
#: reductions to fp32".
HALF_DTYPES = ("float16", "bfloat16")

#: Violation names of :func:`accumulation_violations`.
ACCUMULATION_VIOLATIONS: dict[str, str] = {
    "unknown_dtype": "a dtype of the declaration is not one of UNIT_ROUNDOFF's floating dtypes",
    "half_accumulation": "16-bit logits reduced (row maximum, exponential sum, loss sum) in a 16-bit dtype",
    "narrower_accumulation": "the accumulation dtype has a larger unit roundoff than the input dtype",
}


@attrs.frozen
class PrecisionPolicy:
    """The declared mixed-precision contract of a head and its loss.

    Attributes:
        input_dtype: Dtype of hidden rows, weights and the projected logits (``"bfloat16"``, ...).
        accumulation_dtype: Dtype the row maximum, the exponential sum, the target gather and the
            loss sum are accumulated in (PyTorch CPU and CUDA GEMMs accumulate 16-bit products in
            float32; ``cross_entropy`` on 16-bit logits reduces in float32).
    """

    input_dtype: str
    accumulation_dtype: str


@rule(
    "invariant.head_accumulation_dtype",
    title="The loss declares its accumulation dtype; 16-bit logits are reduced in float32 or wider",
    section="M3.8 0x04 Dtype and degenerate-row policy",
    statement="Stable algebra does not choose an accumulation dtype: a head/loss declares (input dtype, accumulation dtype). "
    "With bfloat16 or float16 logits, the row maximum, exponential sum and loss reduction are accumulated in float32 or "
    "float64; no accumulation dtype is coarser than its input dtype. A candidate in a 16-bit dtype is judged against the "
    "float64 reference on the same rounded inputs, within a bound derived from the two unit roundoffs.",
)
def accumulation_violations(policy: PrecisionPolicy) -> tuple[str, ...]:
    """The names (:data:`ACCUMULATION_VIOLATIONS`) of every way ``policy`` breaks the dtype contract; empty when it keeps it.

    Source: M3.8 0x04 "Dtype and degenerate-row policy" ("Accumulate the reduction in the
    declared stable dtype"); 0x05 "Exact conformance checks" item 6.
    """
    u_in, u_acc = UNIT_ROUNDOFF.get(policy.input_dtype), UNIT_ROUNDOFF.get(policy.accumulation_dtype)
    if u_in is None or u_acc is None:
        return ("unknown_dtype",)
    out = []
    if policy.input_dtype in HALF_DTYPES and policy.accumulation_dtype in HALF_DTYPES:
        out.append("half_accumulation")
    if u_acc > u_in:
        out.append("narrower_accumulation")
    return tuple(out)


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` rounded operations (Higham 3.1).

    Raises:
        Rejection: ``head.invalid_input`` when ``n u >= 1`` (no bound exists).
    """
    if n * u >= 1.0:
        raise Rejection(INVALID_INPUT, f"{n} operations at unit roundoff {u:g} admit no error bound (n u >= 1)", "$.dtype")
    return n * u / (1.0 - n * u)


@attrs.frozen
class LossErrorBound:
    """First-order error bounds of a candidate loss under a :class:`PrecisionPolicy`, for one case.

    Attributes:
        logit: Bound on ``|z_hat - z|`` per logit: the dot product of length ``d`` (plus the bias)
            accumulated at ``u_acc`` and the logit stored at ``u_in``:
            ``(u_in + gamma_{d+1}(u_acc)) * S``, ``S = max_{r,v} sum_k |h_rk e_vk| + |b_v|``.
        row: Bound on one row loss: ``LSE`` and ``z_y`` each move by at most ``logit``; the
            reduction over ``V`` terms adds ``gamma_{V+2}(u_acc) (|LSE| + |z_y|)``, the stored
            result ``u_in |L|`` (``2 logit + (gamma_{V+2}(u_acc) + u_in) (2 S + log V)``).
        grad: Bound on a logit-gradient entry of the mean, ``|dG| <= grad / N``: each probability
            moves by a factor ``exp(+-2 logit)`` (at most 1 in absolute value), plus the rounding
            of ``P - Q`` (``min(1, expm1(2 logit)) + 2 gamma_{V+2}(u_acc) + u_in``).
    """

    logit: float
    row: float
    grad: float


def loss_error_bound(policy: PrecisionPolicy, hidden: Any, weight: Any, bias: Any = None) -> LossErrorBound:
    """The :class:`LossErrorBound` of ``policy`` on one case's (already rounded) inputs.

    Args:
        policy: The declared policy (it must keep :func:`accumulation_violations`).
        hidden, weight, bias: ``[R, d]``, ``[V, d]``, ``[V]`` or ``None``.

    Raises:
        Rejection: ``head.invalid_input`` (a policy that breaks the contract, bad shapes).

    Source: M3.8 0x04 "Dtype and degenerate-row policy"; 0x05 "Exact conformance checks" item 6
    ("forward and backward dtypes within declared tolerances").
    """
    bad = accumulation_violations(policy)
    if bad:
        raise Rejection(INVALID_INPUT, f"precision policy {policy} breaks the dtype contract: {list(bad)}", "$.dtype")
    h, e, b = _check_head(hidden, weight, bias)
    u_in, u_acc = UNIT_ROUNDOFF[policy.input_dtype], UNIT_ROUNDOFF[policy.accumulation_dtype]
    v, d = e.shape
    scale = float((np.abs(h) @ np.abs(e).T + (0.0 if b is None else np.abs(np.where(np.isfinite(b), b, 0.0)))).max(initial=0.0))
    logit = (u_in + gamma(d + 1, u_acc)) * scale
    g = gamma(v + 2, u_acc)
    row = 2.0 * logit + (g + u_in) * (2.0 * scale + float(np.log(v)))
    grad = min(1.0, float(np.expm1(2.0 * logit))) + 2.0 * g + u_in
    return LossErrorBound(logit, row, grad)


# -- 0x05: the immutable row map and the loss's random streams ---------------------------------

@attrs.frozen(eq=False)
class RowMap:
    """M3.9's immutable row map, as M3.8 0x05 consumes it: row ``r -> (batch index, position, target or ignore)``.

    Attributes:
        batch: ``[R]`` int64 batch index of each row.
        position: ``[R]`` int64 sequence position of each row.
        target: ``[R]`` int64 target token id, or the ignore index.
        ignore_index: The ignore label (default :data:`IGNORE_INDEX`).

    Build it once with :func:`row_map_from_labels`; the arrays are read-only.
    """

    batch: np.ndarray
    position: np.ndarray
    target: np.ndarray
    ignore_index: int = IGNORE_INDEX

    def __attrs_post_init__(self) -> None:
        for a in (self.batch, self.position, self.target):
            a.setflags(write=False)

    @property
    def supervised(self) -> np.ndarray:
        """``[R]`` bool: rows whose target is not the ignore index."""
        return np.asarray(self.target != self.ignore_index, dtype=bool)


def row_map_from_labels(labels: Any, ignore_index: int = IGNORE_INDEX) -> RowMap:
    """Build the row map of already shifted ``labels [B, T]`` (M3.9 owns the shift): row ``r = b T + t``.

    Raises:
        Rejection: ``head.invalid_input`` (labels not an integer ``[B, T]`` array).
    """
    y = np.asarray(labels)
    if y.ndim != 2 or not (y.dtype.kind in "iu" or y.size == 0):
        raise Rejection(INVALID_INPUT, f"labels must be integers [B, T], got {y.dtype} {y.shape}", "$.labels")
    b, t = np.indices(y.shape)
    return RowMap(b.reshape(-1).astype(np.int64), t.reshape(-1).astype(np.int64), y.reshape(-1).astype(np.int64).copy(), int(ignore_index))


#: Violation names of :func:`row_map_violations`.
ROW_MAP_VIOLATIONS: dict[str, str] = {
    "rows_not_tiled": "the chunks do not cover rows [0, R) exactly once, in order",
    "row_rederived": "a chunk's (batch, position, target) differs from the row map's rows it claims (re-derived per chunk)",
}


@rule(
    "invariant.head_row_map",
    title="One immutable row map, built before the loss, read by every chunk",
    section=S05,
    statement="M3.9 supplies one row map r -> (batch index, position, target or ignore), built once before the loss. Every "
    "schedule (materialized, row-chunked, tiled) consumes slices of that map: the chunks tile rows [0, R) exactly once and "
    "each chunk's (batch, position, target) triples are the map's, never re-derived per chunk (a second shift, a chunk-local "
    "position, a re-padded target).",
)
def row_map_violations(row_map: RowMap, chunks: Sequence[tuple[int, Any, Any, Any]]) -> tuple[str, ...]:
    """Judge the rows each chunk of a schedule consumed against the one row map.

    Args:
        row_map: The map built before the loss.
        chunks: ``(start, batch [C], position [C], target [C])`` per chunk, in execution order,
            as the schedule observed them.

    Returns:
        Violation names (:data:`ROW_MAP_VIOLATIONS`), empty when every chunk read the map.

    Source: M3.8 0x05 "Source-to-tensor training trace" ("M3.9 supplies an immutable row map"),
    "Backward state and recomputation" ("replay must preserve dtype and row map").
    """
    out: list[str] = []
    nxt = 0
    n = row_map.target.shape[0]
    for start, batch, position, target in chunks:
        got = [np.asarray(x).reshape(-1).astype(np.int64) for x in (batch, position, target)]
        c = got[0].shape[0]
        if int(start) != nxt or any(g.shape[0] != c for g in got) or nxt + c > n:
            out.append("rows_not_tiled")
            break
        want = (row_map.batch[nxt:nxt + c], row_map.position[nxt:nxt + c], row_map.target[nxt:nxt + c])
        if any(not np.array_equal(g, w) for g, w in zip(got, want)):
            out.append("row_rederived")
        nxt += c
    if "rows_not_tiled" not in out and nxt != n:
        out.append("rows_not_tiled")
    return tuple(dict.fromkeys(out))


@rule(
    "invariant.head_loss_rng_free",
    title="The training loss consumes no sampling randomness",
    section=S05,
    statement="The head and its loss are deterministic: computing (or recomputing) the loss draws from no random stream. A "
    "replayed upstream dropout draws from M3.9's training stream; inference sampling RNG is a different state and is never "
    "consumed by the training loss. Checked: the process-wide torch RNG (and a sampling generator the loss can reach) is unchanged by a loss call.",
)
def rng_violations(global_before: bytes, global_after: bytes, sampling_before: bytes | None = None,
                   sampling_after: bytes | None = None) -> tuple[str, ...]:
    """``global_rng_consumed`` / ``sampling_rng_consumed`` for each RNG state a loss call changed.

    Args:
        global_before, global_after: The process-wide generator's state around the loss call
            (the stream a default-seeded dropout or sampler draws from).
        sampling_before, sampling_after: A sampling generator's state around the call, when the
            loss could reach one (``None``: not observed).

    Source: M3.8 0x05 "Backward state and recomputation" ("Inference sampling RNG is a
    different state and must never be consumed by the training loss").
    """
    out = []
    if global_before != global_after:
        out.append("global_rng_consumed")
    if sampling_before is not None and sampling_before != sampling_after:
        out.append("sampling_rng_consumed")
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
