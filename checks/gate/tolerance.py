"""Declared numerical tolerances against the float64 reference, derived from the shipped calibration.

M3.10 "A logit tolerance is not a token-equality proof" lets a gate claim token equality from a
logit tolerance only when the tolerance is *declared*.  :class:`Tolerance` is its stated form
(absolute plus relative to the row's largest magnitude for score rows, per layer and per K / V
for the cache); :data:`TOLERANCES` holds one per (runtime, model, dtype), derived at import by
:func:`derive` from the shipped measurement ``checks/gate/calibration.json`` (:func:`load_calibration`),
never typed in by hand.  :mod:`decodespec.checks.gate.calibrate` measures and rewrites that file; the
ladder (:mod:`decodespec.checks.gate.ladder`) compares within these bounds.  docs/design.md
section 11b, "The reference and its tolerances", gives the method and headroom.

Source: M3.10 "A logit tolerance is not a token-equality proof", 0x0BA ("Sensitivity is a
controlled experiment").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = [
    "ABS_FLOOR",
    "CALIBRATION_FILE",
    "HEADROOM",
    "SMALL_SCALE",
    "TOLERANCES",
    "Tolerance",
    "derive",
    "load_calibration",
    "tolerance_for",
]

#: Factor between the largest measured error and the declared bound.
HEADROOM = 4.0
#: Rows / layers with a reference magnitude below this set the absolute part.
SMALL_SCALE = 1.0
#: The least absolute part of a bound (float32 rounding of a value near 1).
ABS_FLOOR = 1e-6
#: The shipped measurement (package data).
CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@attrs.frozen
class Tolerance:
    """Declared numerical tolerances of one (runtime, model, dtype) against the float64 reference.

    The stated form (docs/design.md section 11b): an error is within tolerance when

    * score rows: ``max_v |row - ref| <= logit + logit_rel * max_v |ref|`` (:meth:`epsilon`);
    * committed K/V: per layer and per K / V, ``max |kv - ref| <= kv + kv_rel * max |ref|`` of
      that layer's K (resp. V) rows (:meth:`kv_bounds`);
    * processed probabilities and logprobs: ``2 * epsilon`` plus rounding (a logit error
      epsilon moves log-softmax by at most 2 epsilon).

    Attributes:
        logit: Absolute part of epsilon on raw logits (L-infinity).
        kv: Absolute part of the K (after RoPE) / V bound.
        prob: Absolute tolerance on processed probabilities at the declared ``row_scale``.
        logprob: Absolute tolerance on recorded logprobs at the declared ``row_scale``.
        logit_rel: Part of epsilon relative to the reference row's largest magnitude.
        kv_rel: Part of the K/V bound relative to the layer's largest reference magnitude.
        row_scale: The largest reference row magnitude the calibration met (the scale
            :attr:`prob` and :attr:`logprob` are stated at, where no row is at hand).

    Units: logits and nats.
    """

    logit: float
    kv: float
    prob: float
    logprob: float
    logit_rel: float = 0.0
    kv_rel: float = 0.0
    row_scale: float = 0.0

    @classmethod
    def from_logit(cls, logit: float, kv: float, *, logit_rel: float = 0.0, kv_rel: float = 0.0, row_scale: float = 0.0) -> Tolerance:
        """Derived tolerances: a logit error epsilon moves log-softmax by at most 2 epsilon."""
        eps = logit + logit_rel * row_scale
        return cls(logit=logit, kv=kv, prob=2 * eps + 1e-6, logprob=2 * eps + 1e-5, logit_rel=logit_rel, kv_rel=kv_rel,
                   row_scale=row_scale)

    def epsilon(self, reference_row: Any) -> float:
        """Epsilon of one score row: ``logit + logit_rel * max |reference_row|`` over its finite entries.

        Shapes: ``reference_row [V]``.
        """
        if not self.logit_rel:
            return self.logit
        ref = np.asarray(reference_row, dtype=np.float64)
        finite = ref[np.isfinite(ref)]
        return self.logit + self.logit_rel * (float(np.max(np.abs(finite))) if finite.size else 0.0)

    def at_row(self, reference_row: Any) -> Tolerance:
        """This tolerance with epsilon fixed at ``reference_row``'s (probabilities and logprobs derived from it)."""
        eps = self.epsilon(reference_row)
        return Tolerance(logit=eps, kv=self.kv, prob=2 * eps + 1e-6, logprob=2 * eps + 1e-5, kv_rel=self.kv_rel)

    def scaled(self, factor: float) -> Tolerance:
        """Every bound multiplied by ``factor`` (two runs each within the tolerance differ by at most twice it)."""
        return Tolerance(logit=factor * self.logit, kv=factor * self.kv, prob=factor * self.prob, logprob=factor * self.logprob,
                         logit_rel=factor * self.logit_rel, kv_rel=factor * self.kv_rel, row_scale=self.row_scale)

    def kv_bounds(self, reference: Any) -> np.ndarray:
        """Per layer and per K / V: ``kv + kv_rel * max |reference[layer, kind]|``.

        Shapes: ``reference [layers, 2, H_kv, P, D]`` -> ``[layers, 2]``.
        """
        ref = np.abs(np.asarray(reference, dtype=np.float64))
        scale = ref.reshape(ref.shape[0], 2, -1).max(axis=-1) if ref.size else np.zeros(ref.shape[:2])
        return self.kv + self.kv_rel * scale


def derive(variants: Sequence[dict[str, Any]]) -> Tolerance:
    """The declared tolerance of one (runtime, model, dtype) from its measured variants.

    Args:
        variants: :func:`~decodespec.checks.gate.calibrate.summarize` dicts (one per capability / thread count / path).

    Returns:
        :class:`Tolerance` with ``logit_rel`` and ``kv_rel`` =
        :data:`HEADROOM` times the largest relative error, absolute parts :data:`HEADROOM`
        times the largest error at small scale (at least :data:`ABS_FLOOR`), and
        ``row_scale`` the largest reference row magnitude met.
    """
    def top(key: str) -> float:
        return max(float(v[key]) for v in variants)

    return Tolerance.from_logit(
        max(ABS_FLOOR, HEADROOM * top("row_small_max_error")),
        max(ABS_FLOOR, HEADROOM * top("kv_small_max_error")),
        logit_rel=HEADROOM * top("row_max_rel"),
        kv_rel=HEADROOM * top("kv_max_rel"),
        row_scale=top("row_max_scale"),
    )


def load_calibration(path: Path = CALIBRATION_FILE) -> dict[str, Any]:
    """The shipped measurement: ``{"entries": [{"runtime", "model", "dtype", "variants": [...]}, ...], ...}``."""
    return json.loads(Path(path).read_text())


def _declared() -> dict[tuple[str, str, str], Tolerance]:
    """The declared tolerances, derived from the shipped calibration (:func:`derive` of :func:`load_calibration`).

    Our runtime's entries (``impl``) are also the default (``*``) of a runtime that declares
    none (a ``stdio:`` runtime): its error is judged by the bound our own float32 runtime meets.
    """
    out: dict[tuple[str, str, str], Tolerance] = {}
    if not CALIBRATION_FILE.is_file():
        return out
    for entry in load_calibration()["entries"]:
        tol = derive(entry["variants"])
        out[(entry["runtime"], entry["model"], entry["dtype"])] = tol
        if entry["runtime"] == "impl":
            out[("*", entry["model"], entry["dtype"])] = tol
    return out


#: ``(runtime or "*", model, dtype) -> Tolerance`` against the float64 reference, derived from
#: ``checks/gate/calibration.json`` (``decodespec calibrate --update``; method, maxima and headroom in
#: docs/design.md section 11b).  A peer adapter may register its own entry (llama.cpp: its
#: expectations file).
TOLERANCES: dict[tuple[str, str, str], Tolerance] = _declared()


def tolerance_for(runtime: str, model: str, dtype: str) -> Tolerance:
    """The declared tolerance of ``runtime`` on ``model`` in ``dtype`` (runtime entry first, then ``*``).

    Raises:
        KeyError: when no tolerance is declared (a gate must not guess one).
    """
    for key in ((runtime.split(":", 1)[0], model, dtype), ("*", model, dtype)):
        if key in TOLERANCES:
            return TOLERANCES[key]
    raise KeyError(f"no tolerance declared for runtime {runtime!r}, model {model!r}, dtype {dtype!r}")
