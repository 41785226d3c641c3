"""M3.8 0x04 / 0x05 The head's training interface: the loss, its three schedules, smoothing, the backward, the accumulation bound, the row map.

Split from :mod:`decodespec.spec.head` (the head equation, score kind and ledger), which this builds on:

* the per-row loss ``m + log s - z_y`` over supervised rows only (:func:`row_losses`), its reduction
  (:class:`LossResult`), three schedules that must agree -- materialized, row-chunked and tiled over
  the vocabulary with an online log-sum-exp (:func:`materialized_loss`, :func:`chunked_loss`,
  :func:`tiled_loss`) --, label smoothing with its convention named (:class:`Smoothing`);
* the affine-head backward ``dH = G E``, ``dE = G^T H``, ``db = sum_r G`` (:func:`head_gradients`);
* the declared accumulation dtype and the error bound it implies (:class:`PrecisionPolicy`,
  :func:`loss_error_bound`, :func:`accumulation_violations`);
* the immutable row map and the loss's random streams (:class:`RowMap`, :func:`row_map_violations`,
  :func:`rng_violations`).

Source: M3.8 0x04 ("One denominator derives softmax, log-softmax, and cross-entropy", "Label smoothing
is a target-distribution contract", "Dtype and degenerate-row policy"), 0x05 ("Source-to-tensor
training trace", "Materialized, chunked, and fused execution", "Exact conformance checks"), 0x02
("Cross-entropy gradient at the head", "Deriving the complete affine-head backward").

Size: one training interface: the three loss schedules must agree with each other and share the row
checks, the smoothing target and the online log-sum-exp; the accumulation bound and the row map
bound the same loss.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.head import DEGENERATE_ROW, IGNORE_INDEX, INVALID_INPUT, NAN_LOGITS, _check_head, _check_rows, _lse, _matrix, head_logits
from decodespec.spec.rules import rule

__all__ = [
    "ACCUMULATION_VIOLATIONS",
    "HALF_DTYPES",
    "ROW_MAP_VIOLATIONS",
    "UNIT_ROUNDOFF",
    "HeadGradients",
    "LossErrorBound",
    "LossResult",
    "LossSpec",
    "PrecisionPolicy",
    "RowMap",
    "Smoothing",
    "accumulation_violations",
    "chunk_bounds",
    "chunked_loss",
    "gamma",
    "head_gradients",
    "loss_error_bound",
    "materialized_loss",
    "rng_violations",
    "row_losses",
    "row_map_from_labels",
    "row_map_violations",
    "target_distribution",
    "tiled_loss",
]

S01 = "M3.8 0x01 The local object: final normalized hidden rows"
S02 = "M3.8 0x02 Linear projection and storage orientation"
S04 = "M3.8 0x04 Logits, probabilities, and log-probabilities"
S05 = "M3.8 0x05 The training interface: all supervised rows"
S09 = "M3.8 0x09 Weight tying: shared storage, not similar shape"
S0A = "M3.8 0x0A Output-row scope is an interface and cost boundary"


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
