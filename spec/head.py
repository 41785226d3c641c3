"""M3.8 0x02 Linear projection and storage orientation: the head equation, its score kind and its ledger as pure float64 rules.

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
* the training interface (0x04 / 0x05: the loss, its schedules, smoothing, the backward, the
  accumulation bound, the row map): :mod:`decodespec.spec.head_loss`; weight tying (0x09):
  :mod:`decodespec.spec.head_tying` (split out so each module holds one concern).

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

from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.rules import rule

__all__ = [
    "CRITERIA",
    "DEGENERATE_ROW",
    "HEAD_OUTPUT_KINDS",
    "IGNORE_INDEX",
    "INVALID_INPUT",
    "NAN_LOGITS",
    "HeadLedger",
    "HeadShape",
    "criterion_accepts",
    "head_ledger",
    "head_logits",
    "log_ratio_gap",
    "translation_gap",
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
