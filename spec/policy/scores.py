"""M3.8 0x04 Logits, probabilities, and log-probabilities: the typed score row.

A score row is one vocabulary-width vector together with the *kind* of its values.  Kinds are
never inferred from the numbers: a transform declares the kinds it accepts and the kind it
returns, and a mismatch raises ``policy.score_kind_mismatch`` (failure lab 0x12 items 7-13:
"Calling logits probabilities", "Applying softmax to probabilities again", "Sampling raw
logits with torch.multinomial").

Source: M3.8 0x04; M3.8 0x08 (the vocabulary map hash binds the row to an ordered id table).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.policy import codes

__all__ = [
    "ScoreKind",
    "ScoreRow",
    "log_softmax",
    "softmax",
]

#: Tolerance for declared probability and log-probability rows (sum to one, logsumexp zero).
NORMALIZATION_TOLERANCE = 1e-6


class ScoreKind(str, enum.Enum):
    """The kind of the values in a score row.

    * ``LOGITS``: unnormalized real scores; ``-inf`` means forbidden.
    * ``LOGPROBS``: natural-log probabilities, ``logsumexp = 0``; ``-inf`` means probability 0.
    * ``PROBS``: probabilities in ``[0, 1]`` summing to one.
    """

    LOGITS = "logits"
    LOGPROBS = "logprobs"
    PROBS = "probs"


def _frozen_array(values: Any) -> np.ndarray:
    try:
        arr = np.array(values, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise Rejection(codes.INVALID_ROW, f"a score row holds real numbers: {exc}", "$.row.values") from None
    arr.setflags(write=False)
    return arr


def _score_kind(kind: Any) -> ScoreKind:
    try:
        return ScoreKind(kind)
    except ValueError:
        raise Rejection(codes.INVALID_ROW, f"unknown score kind {kind!r}", "$.row.kind") from None


def _check_row(kind: ScoreKind, arr: np.ndarray) -> None:
    """The row checks of :meth:`ScoreRow.create`, run on every construction (direct ones too)."""
    if arr.ndim != 1 or arr.shape[0] == 0:
        raise Rejection(codes.INVALID_ROW, f"a score row is one non-empty vocabulary axis, got shape {arr.shape}", "$.row.values")
    check_scores(arr, "$.row.values")
    if kind is ScoreKind.PROBS:
        if np.isinf(arr).any() or (arr < 0).any() or (arr > 1).any() or abs(float(arr.sum()) - 1.0) > NORMALIZATION_TOLERANCE:
            raise Rejection(codes.INVALID_ROW, "a probability row needs values in [0, 1] summing to one", "$.row.values")
    elif kind is ScoreKind.LOGPROBS:
        if (arr > NORMALIZATION_TOLERANCE).any():
            first = int(np.flatnonzero(arr > NORMALIZATION_TOLERANCE)[0])
            raise Rejection(codes.INVALID_ROW, f"a log-probability row has values <= 0; index {first} holds {float(arr[first])!r}",
                            "$.row.values", {"first_index": first})
        if not np.isfinite(arr).any() or abs(_logsumexp(arr)) > NORMALIZATION_TOLERANCE:
            raise Rejection(codes.INVALID_ROW, "a log-probability row needs logsumexp = 0", "$.row.values")


@attrs.frozen(eq=False)
class ScoreRow:
    """One typed vocabulary score row.

    Attributes:
        kind: The :class:`ScoreKind` of ``values``.
        values: ``[V]`` float64, read-only copy of the row.
        vocab_hash: Hash of the ordered id-to-token table the row is indexed by (M3.8 0x08).
        row_id: The score identity assigned by the runtime (the ``score_id`` of the
            ``call_completed`` event that exposed this row).

    Every construction validates the row (the checks of :meth:`create`), so a row that reaches
    :func:`decodespec.spec.policy.decide` is one non-empty ``[V]`` axis consistent with its kind.

    Shapes:
        values: ``[V]``.
    """

    kind: ScoreKind = attrs.field(converter=_score_kind)
    values: np.ndarray = attrs.field(converter=_frozen_array)
    vocab_hash: str
    row_id: str

    def __attrs_post_init__(self) -> None:
        _check_row(self.kind, self.values)

    @property
    def vocab_size(self) -> int:
        """V, the row width."""
        return int(self.values.shape[0])

    @classmethod
    def create(cls, values: Any, *, kind: ScoreKind | str = ScoreKind.LOGITS, vocab_hash: str = "", row_id: str = "") -> ScoreRow:
        """Validate and build a row.

        Args:
            values: ``[V]`` real numbers (any float dtype; kept as float64).
            kind: Declared kind of the values.
            vocab_hash: Ordered vocabulary map hash.
            row_id: Score identity.

        Raises:
            Rejection: ``policy.invalid_row`` (not 1-D, empty, inconsistent with ``kind``),
                ``policy.nan_scores`` (NaN), ``policy.infinite_scores`` (+inf, or -inf in a
                probability row).
        """
        return cls(kind=kind, values=values, vocab_hash=vocab_hash, row_id=row_id)


def check_scores(values: np.ndarray, path: str) -> None:
    """Raise ``policy.nan_scores`` on NaN and ``policy.infinite_scores`` on +inf in ``values``."""
    if np.isnan(values).any():
        raise Rejection(codes.NAN_SCORES, "NaN in scores; the row is never sampled", path, {"first_index": int(np.flatnonzero(np.isnan(values))[0])})
    if np.isposinf(values).any():
        raise Rejection(codes.INFINITE_SCORES, "+inf in scores", path, {"first_index": int(np.flatnonzero(np.isposinf(values))[0])})


def _logsumexp(z: np.ndarray) -> float:
    finite = z[np.isfinite(z)]
    m = float(finite.max())
    return m + float(np.log(np.exp(finite - m).sum()))


def softmax(z: np.ndarray) -> np.ndarray:
    """Stable softmax over the finite entries of ``z``; ``-inf`` entries get probability 0.

    Shapes:
        z: ``[V]`` float64 with at least one finite entry; returns ``[V]`` float64.

    Source: M3.8 0x04 "One denominator derives softmax, log-softmax, and cross-entropy".
    """
    finite = np.isfinite(z)
    m = z[finite].max()
    e = np.where(finite, np.exp(np.where(finite, z - m, 0.0)), 0.0)
    probs: np.ndarray = e / e.sum()
    return probs


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Stable log-softmax ``z - LSE(z)``; ``-inf`` stays ``-inf``.

    Shapes:
        z: ``[V]`` float64 with at least one finite entry; returns ``[V]`` float64.

    Source: M3.8 0x04 (``log p_v = z_v - LSE(z)``).
    """
    return z - _logsumexp(z)
