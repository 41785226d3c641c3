"""M3.10 "A logit tolerance is not a token-equality proof": the STATE..RESUME comparison ladder.

:func:`compare` judges one runtime :class:`~decodespec.checks.adapters.Observation` against
:class:`Expected` -- the spec state's projection (driven by the same actions) plus the
references the spec cannot compute itself (the no-cache float64 score row and K/V rows of the
same committed prefix from :mod:`decodespec.checks.gate.reference`, the spec policy's processed row) -- layer by layer, in the seed's order,
and stops at the first layer that does not pass (a later pass never cures an earlier failure):

========== ===================================================================================
layer      what is compared (``ladder.<LAYER>``)
========== ===================================================================================
STATE      vocabulary identity (ordered table hash, output rows), phase, committed tokens,
           frontiers (L, O, |U|, P, tag), RNG counter, generation,
           quarantine, committed cache rows (K = P) and the launched call's slice/positions
TENSOR     the latest score row against the reference row of the same prefix (L-infinity
           <= epsilon), committed K/V rows against the reference K/V (declared tolerance)
POLICY     processed support (exact ids) and probabilities (tolerance), draw count
DECISION   the latest decision's selected id (M3.10 greedy comparator: L-infinity premise, tie
           rule, margin > 2 epsilon, then ids), its logprob (aligned token metadata), beams
SEQUENCE   output ids, text, finish reason, triggers, stream chunks (offsets and final flush)
RESUME     after a restore: the continuation equals the uninterrupted state at the same point
========== ===================================================================================

A :class:`Verdict` is ``passed``, ``failed`` or ``undecided``: undecided is the seed's third
outcome -- the candidate row is within tolerance of the reference, the reference margin is at
most 2 epsilon, and the candidate picked another id that the tolerance cannot rule out; it is
neither a pass nor a fail.  Every non-passing verdict names its layer, the rule id
(``ladder.<LAYER>``), the check that failed, the expected and actual values and a message.
TENSOR and DECISION messages name the worst coordinate -- the vocabulary id of a score row; the
layer, K or V, head, position and dimension of a committed K/V row -- with both values and the
bound, and the verdict keeps a bounded :attr:`Verdict.probe` of the rows that failed (the worst
entry and the :data:`PROBE_ENTRIES` largest differences, both sides), which failure traces carry.

Tolerances are declared per (runtime, model, dtype) against the float64 reference in a stated
form -- absolute plus relative to the row's largest magnitude for score rows, per layer and per
K / V for the cache (:class:`~decodespec.checks.gate.tolerance.Tolerance`) -- and derived from the shipped calibration
(``checks/gate/calibration.json``, :mod:`decodespec.checks.gate.tolerance`), never typed in by hand;
docs/design.md section 11b gives the method and headroom.

Source: M3.10 "A logit tolerance is not a token-equality proof" (the comparator order and the
[10,0] vs [100,0] example), "Correctness matrix" (the ladder stops at the first failed layer;
final-text equality cannot waive a state or tensor failure), 0x0BA (observable fields).

Size: the ladder: the STATE..RESUME layers and their checks, compared in order over one Expected
record.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.rules import rule

from ..adapters import Observation
from .tolerance import Tolerance

__all__ = [
    "FAILED",
    "LAYERS",
    "PASSED",
    "PROBE_ENTRIES",
    "PROBE_POSITIONS",
    "UNDECIDED",
    "DecisionCheck",
    "Expected",
    "Layer",
    "Result",
    "Verdict",
    "cache_probe_failure",
    "combine",
    "compare",
    "compare_rows",
    "decision_probe",
    "describe_probe",
    "greedy_comparator",
    "score_row_failure",
    "score_row_probe",
]



class Layer(enum.StrEnum):
    """A layer of the ladder (a ``str``: ``Layer.STATE == "STATE"``, rule id ``ladder.<LAYER>``)."""

    STATE = "STATE"
    TENSOR = "TENSOR"
    POLICY = "POLICY"
    DECISION = "DECISION"
    SEQUENCE = "SEQUENCE"
    RESUME = "RESUME"


class Result(enum.StrEnum):
    """The result of a verdict (a ``str``: ``Result.PASSED == "passed"``, as the reports write it)."""

    PASSED = "passed"
    FAILED = "failed"
    UNDECIDED = "undecided"


#: The ladder's layers, in checking order.
LAYERS: tuple[Layer, ...] = tuple(Layer)
PASSED, FAILED, UNDECIDED = Result.PASSED, Result.FAILED, Result.UNDECIDED
_S = "M3.10 A logit tolerance is not a token-equality proof; Correctness matrix"


#: Where :func:`measuring` collects the TENSOR layer's errors (``None``: not collecting).
_MEASUREMENTS: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("decodespec_ladder_measurements", default=None)


def _measure(kind: str, error: Any, reference: np.ndarray) -> None:
    sink = _MEASUREMENTS.get()
    if sink is None:
        return
    if kind == "score_row":
        finite = reference[np.isfinite(reference)]
        sink.append({"kind": kind, "error": float(error), "scale": float(np.max(np.abs(finite))) if finite.size else 0.0})
    else:
        ref = np.abs(reference).reshape(reference.shape[0], 2, -1)
        scale = ref.max(axis=-1) if ref.size else np.zeros(reference.shape[:2])
        sink.append({"kind": kind, "error": np.asarray(error, dtype=np.float64).tolist(), "scale": scale.tolist()})


@contextlib.contextmanager
def measuring() -> Iterator[list[dict[str, Any]]]:
    """Collect every TENSOR comparison made inside the block (``decodespec calibrate``).

    Yields a list that receives one dict per comparison: ``{"kind": "score_row", "error",
    "scale"}`` (floats: L-infinity error, largest reference magnitude) or ``{"kind":
    "cache_probe", "error", "scale"}`` (``[layers][2]`` lists, K then V).
    """
    sink: list[dict[str, Any]] = []
    token = _MEASUREMENTS.set(sink)
    try:
        yield sink
    finally:
        _MEASUREMENTS.reset(token)


@attrs.frozen
class Verdict:
    """The outcome of a comparison.

    Attributes:
        result: ``passed``, ``failed`` or ``undecided``.
        layer: The layer that did not pass (``None`` when passed).
        rule: Its rule id ``ladder.<LAYER>`` (``None`` when passed).
        check: The named check inside the layer, e.g. ``frontier.processed``.
        expected: The expected value (JSON-able summary).
        actual: The observed value (JSON-able summary).
        message: One sentence.
        step: Index of the action after which it was found (set by the harness), or ``None``.
        probe: A bounded probe of the rows that failed (JSON-able; :func:`score_row_probe`,
            :func:`cache_probe_probe`, :func:`decision_probe`): the worst coordinate and the
            largest differences, both sides, at most :data:`PROBE_ENTRIES` entries each; ``None``
            for checks that compare no rows.  Failure traces keep it (``#meta.verdict.probe``).
    """

    result: Result = attrs.field(converter=Result)
    layer: Layer | None = attrs.field(default=None, converter=attrs.converters.optional(Layer))
    rule: str | None = None
    check: str | None = None
    expected: Any = None
    actual: Any = None
    message: str = ""
    step: int | None = None
    probe: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """Whether the result is ``passed``."""
        return self.result == PASSED

    def to_json(self) -> dict[str, Any]:
        """The verdict as JSON (``probe`` only when there is one, so verdicts without rows read as before)."""
        out = {"result": self.result, "layer": self.layer, "rule": self.rule, "check": self.check,
               "expected": _jsonable(self.expected), "actual": _jsonable(self.actual), "message": self.message, "step": self.step}
        if self.probe is not None:
            out["probe"] = _jsonable(self.probe)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Verdict:
        """Inverse of :meth:`to_json`."""
        return cls(result=obj["result"], layer=obj.get("layer"), rule=obj.get("rule"), check=obj.get("check"),
                   expected=obj.get("expected"), actual=obj.get("actual"), message=obj.get("message", ""), step=obj.get("step"),
                   probe=obj.get("probe"))

    def same_outcome(self, other: Verdict) -> bool:
        """Whether ``other`` reproduces this (recorded) verdict: the same result, layer and rule, and the same
        named check when this one names it (a trace recorded before checks were named names none)."""
        same = (self.result, self.layer, self.rule) == (other.result, other.layer, other.rule)
        return same and (self.check is None or self.check == other.check)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size <= 16:
            return value.tolist()
        return {"shape": list(value.shape), "head": value.ravel()[:8].tolist()}
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


PASS = Verdict(PASSED)


def _fail(layer: str, check: str, expected: Any, actual: Any, message: str, probe: dict[str, Any] | None = None) -> Verdict:
    return Verdict(FAILED, layer, f"ladder.{layer}", check, expected, actual, message, probe=probe)


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """The verdict of a run: its first failure, else its first undecided verdict, else passed."""
    for result in (FAILED, UNDECIDED):
        for verdict in verdicts:
            if verdict.result == result:
                return verdict
    return PASS


# --------------------------------------------------------------------------------------------
# The greedy comparator (M3.10 "A logit tolerance is not a token-equality proof").
# --------------------------------------------------------------------------------------------


def _greedy_top(row: np.ndarray) -> tuple[int, float]:
    """``(argmax under the lowest-id tie rule, margin to the runner-up)``; margin ``inf`` for one finite entry."""
    finite = np.where(np.isfinite(row), row, -np.inf)
    top = int(np.argmax(finite))  # first maximal index = lowest id
    rest = np.delete(finite, top)
    second = float(rest.max()) if rest.size else -math.inf
    return top, float(finite[top]) - second


@attrs.frozen
class RowComparison:
    """One reference/candidate score-row comparison.

    Attributes:
        linf: ``max |z - z~|`` over ids finite in both (``inf`` if the finite sets differ).
        ref_top / cand_top: Greedy ids of both rows (lowest id on ties).
        margin: Reference top-1 minus top-2.
        epsilon: The declared tolerance.
    """

    linf: float
    ref_top: int
    cand_top: int
    margin: float
    epsilon: float

    @property
    def within(self) -> bool:
        """The L-infinity premise holds."""
        return self.linf <= self.epsilon

    @property
    def stable(self) -> bool:
        """Greedy selection is guaranteed unchanged (margin > 2 epsilon)."""
        return self.margin > 2 * self.epsilon


def compare_rows(reference: Any, candidate: Any, epsilon: float) -> RowComparison:
    """Compare two raw score rows under tolerance ``epsilon`` (shape, finite-value policy, L-infinity, tie rule, margin).

    Raises:
        ValueError: for different shapes or a negative / non-finite epsilon (the comparator's
            first check: same vocabulary map and shape).

    Shapes: both ``[V]``.
    """
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape or ref.ndim != 1:
        raise ValueError(f"rows of different shapes {ref.shape} and {cand.shape}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    same_support = np.array_equal(np.isfinite(ref), np.isfinite(cand))
    both = np.isfinite(ref) & np.isfinite(cand)
    linf = float(np.max(np.abs(ref[both] - cand[both]))) if both.any() and same_support else math.inf
    ref_top, margin = _greedy_top(ref)
    cand_top, _ = _greedy_top(cand)
    return RowComparison(linf, ref_top, cand_top, margin, epsilon)


#: Most entries a probe lists (the largest differences, both sides): bounds a failure trace's size.
PROBE_ENTRIES = 8
#: Most positions and heads a K/V probe lists as over the bound.
PROBE_POSITIONS = 16


def _row_errors(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """``|ref - cand|`` where both are finite, ``inf`` where only one is (as :func:`compare_rows` counts), ``0`` where neither is."""
    fr, fc = np.isfinite(ref), np.isfinite(cand)
    with np.errstate(invalid="ignore"):
        return np.where(fr & fc, np.abs(np.where(fr, ref, 0.0) - np.where(fc, cand, 0.0)), np.where(fr == fc, 0.0, np.inf))


def _largest(errors: np.ndarray, count: int) -> np.ndarray:
    """Flat indices of the ``count`` largest ``errors``, largest first, lowest index among equals (O(n) selection)."""
    flat = errors.ravel()
    if flat.size > count:
        cut = np.argpartition(-flat, count - 1)[:count]
        keep = np.flatnonzero(flat >= flat[cut].min())  # every entry tied with the smallest kept one
    else:
        keep = np.arange(flat.size)
    order = np.lexsort((keep, -flat[keep]))
    return keep[order][:count]


def score_row_probe(reference: Any, candidate: Any, epsilon: float) -> dict[str, Any]:
    """A bounded probe of one score-row comparison: the worst vocabulary id and the largest differences, both sides.

    An id finite on one side only counts as an infinite error (as :func:`compare_rows` does), so
    it is named first.  Ties go to the lowest id.

    Shapes: both ``[V]``.

    Returns:
        ``{"kind": "score_row", "size": V, "bound": epsilon, "over_bound": n, "worst": {"id",
        "reference", "observed", "error"}, "top": [the same, at most PROBE_ENTRIES, largest first]}``.
    """
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    errors = _row_errors(ref, cand)
    top = [{"id": int(i), "reference": float(ref[i]), "observed": float(cand[i]), "error": float(errors[i])}
           for i in _largest(errors, PROBE_ENTRIES)]
    return {"kind": "score_row", "size": int(ref.size), "bound": float(epsilon), "over_bound": int(np.count_nonzero(errors > epsilon)),
            "worst": top[0] if top else None, "top": top}


def score_row_failure(reference: Any, candidate: Any, epsilon: float, *, layer: str = "TENSOR", check: str = "score_row.linf",
                      where: str = "", suffix: str = "") -> Verdict | None:
    """The failed verdict of a score row outside L-infinity ``epsilon`` of the reference row, else ``None``.

    The message names the worst vocabulary id, both values there and the bound; the verdict's
    :attr:`Verdict.probe` is :func:`score_row_probe`.  ``expected`` is ``"<= epsilon"`` and
    ``actual`` the L-infinity error.

    Args:
        reference / candidate: The rows ``[V]`` (same shape).
        epsilon: The declared tolerance of this row.
        layer / check: Where the failure is reported (TENSOR ``score_row.linf``; RESUME, a beam row).
        where: A prefix naming the row (``"output 3: "``).
        suffix: Text appended to the message.

    A candidate row of another length than the reference fails at STATE (``vocab.rows``): the
    runtime scores another vocabulary (M3.8 0x08), which no tolerance can judge.
    """
    bad = vocab_rows_failure(reference, candidate)
    if bad is not None:
        return bad
    cmp = compare_rows(reference, candidate, epsilon)
    if cmp.within:
        return None
    probe = score_row_probe(reference, candidate, epsilon)
    w = probe["worst"]
    if w is None:
        at = "the rows are empty"
    elif math.isinf(w["error"]):
        at = (f"vocabulary id {w['id']} is finite on one side only (reference {w['reference']:.6g}, observed {w['observed']:.6g})")
    else:
        at = (f"worst at vocabulary id {w['id']}: reference {w['reference']:.6g}, observed {w['observed']:.6g}, "
              f"|error| {w['error']:.3g} > bound {epsilon:.3g}")
    message = (f"{where}score row L-infinity error {cmp.linf:.3g} > epsilon {epsilon:.3g}; {at}; "
               f"{probe['over_bound']} of {probe['size']} ids over the bound{suffix}")
    return _fail(layer, check, f"<= {epsilon:.6g}", cmp.linf, message, probe)


def cache_probe_failure(reference: Any, candidate: Any, tolerance: Tolerance) -> Verdict | None:
    """The failed TENSOR verdict of committed K/V rows outside the declared per-layer K / V bounds, else ``None``.

    The layer reported is the first (in forward order, K before V) whose bound is exceeded: where
    the error enters, since every later layer reads it.  Inside it the message names the worst
    coordinate -- K or V, head, position (the absolute cache position), head dimension -- both
    values and the bound, and the positions over the bound; the :attr:`Verdict.probe` keeps the
    largest differences of that layer (both sides) and every exceeded layer / K-V bound, capped.

    Shapes: both ``[layers, 2, H_kv, P, D]`` (K after RoPE, then V).
    """
    ref = np.asarray(reference, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(ref - np.asarray(candidate, dtype=np.float64))
    diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN is never within a bound
    err = diff.reshape(ref.shape[0], 2, -1).max(axis=-1)  # [layers, 2]
    bounds = tolerance.kv_bounds(ref)
    _measure("cache_probe", err, ref)
    bad = np.argwhere(~(err <= bounds))
    if not bad.size:
        return None
    layer, kind = (int(i) for i in bad[0])
    name = "KV"[kind]
    bound = float(bounds[layer, kind])
    block = diff[layer, kind]  # [H_kv, P, D]
    cand = np.asarray(candidate, dtype=np.float64)[layer, kind]
    over = block > bound
    positions = np.flatnonzero(over.any(axis=(0, 2)))
    heads = np.flatnonzero(over.any(axis=(1, 2)))
    top = []
    for flat in _largest(block, PROBE_ENTRIES):
        h, p, d = (int(i) for i in np.unravel_index(flat, block.shape))
        top.append({"head": h, "position": p, "dim": d, "reference": float(ref[layer, kind, h, p, d]),
                    "observed": float(cand[h, p, d]), "error": float(block[h, p, d])})
    w = top[0]
    probe = {"kind": "cache_probe", "shape": list(ref.shape), "layer": layer, "kv": name, "bound": bound,
             "worst": {"layer": layer, "kv": name, **w, "bound": bound}, "top": top,
             "positions_over_bound": positions[:PROBE_POSITIONS].tolist(), "heads_over_bound": heads[:PROBE_POSITIONS].tolist(),
             "exceeded": [{"layer": int(a), "kv": "KV"[int(b)], "error": float(err[a, b]), "bound": float(bounds[a, b])}
                          for a, b in bad[:PROBE_ENTRIES]], "exceeded_count": len(bad)}
    shown = ", ".join(str(q) for q in positions[:PROBE_POSITIONS]) + (" ..." if positions.size > PROBE_POSITIONS else "")
    message = (f"committed {name} rows of layer {layer} differ by {err[layer, kind]:.3g} > {bound:.3g}: worst at layer {layer} {name}, "
               f"head {w['head']}, position {w['position']} (dim {w['dim']}): reference {w['reference']:.6g}, observed "
               f"{w['observed']:.6g}; positions over the bound: {shown}; {len(bad)} of {err.size} layer/K-V bounds exceeded")
    return _fail("TENSOR", "cache_probe.linf", f"<= {bound:.6g}", float(err[layer, kind]), message, probe)


def decision_probe(ids: Sequence[int], reference: Any = None, candidate: Any = None, *, what: str = "raw") -> dict[str, Any]:
    """A bounded probe of a decision: each named id's value on the reference row and on the runtime's row.

    Args:
        ids: The ids that matter (the reference's id, the runtime's), at most :data:`PROBE_ENTRIES`.
        reference / candidate: Rows ``[V]`` (``None``: not at hand); an id outside a row gives ``None``.
        what: Which rows (``raw`` logits or ``processed`` scores).
    """
    def at(row: Any, i: int) -> float | None:
        if row is None:
            return None
        arr = np.asarray(row)
        return float(arr[i]) if 0 <= i < arr.shape[0] else None

    unique = list(dict.fromkeys(int(i) for i in ids))[:PROBE_ENTRIES]
    return {"kind": "decision", "rows": what, "ids": [{"id": i, "reference": at(reference, i), "observed": at(candidate, i)} for i in unique]}


def describe_probe(probe: dict[str, Any]) -> str:
    """``"id 3: reference 1.2, observed 1.1; id 7: ..."`` of a :func:`decision_probe` (sides not at hand left out)."""
    parts = []
    for entry in probe["ids"]:
        sides = [f"{side} {entry[side]:.6g}" for side in ("reference", "observed") if entry[side] is not None]
        if sides:
            parts.append(f"id {entry['id']}: " + ", ".join(sides))
    return "; ".join(parts)


def vocab_rows_failure(reference: Any, candidate: Any) -> Verdict | None:
    """A STATE ``vocab.rows`` failure when a runtime's score row is not as long as the reference's, else ``None``.

    Source: M3.8 0x08 (the last axis is the checkpoint's ordered vocabulary; V_out is part of its identity).
    """
    n_ref, n_cand = int(np.shape(reference)[-1]), int(np.shape(candidate)[-1])
    if n_ref == n_cand:
        return None
    return _fail("STATE", "vocab.rows", n_ref, n_cand,
                 f"the runtime's score row has {n_cand} entries, the checkpoint's head {n_ref} rows: another vocabulary")


def greedy_comparator(reference: Any, candidate: Any, epsilon: float, *, candidate_id: int | None = None) -> Verdict:
    """The seed's valid greedy comparator, in its order: L-infinity <= epsilon, tie rule, margin > 2 epsilon, ids.

    Args:
        reference: Reference raw row ``[V]``.
        candidate: Candidate raw row ``[V]``.
        epsilon: Declared tolerance.
        candidate_id: The id the candidate runtime selected (default: its row's greedy id).

    Returns:
        ``failed`` at TENSOR when the L-infinity premise fails (whatever the ids); ``failed`` at
        DECISION when the candidate's id is not its own row's greedy id, or the ids differ although
        the margin exceeds 2 epsilon; ``undecided`` at DECISION when the ids differ and the margin
        is at most 2 epsilon; ``passed`` otherwise.
    """
    bad = vocab_rows_failure(reference, candidate)
    if bad is not None:
        return bad
    cmp = compare_rows(reference, candidate, epsilon)
    if not cmp.within:
        return score_row_failure(reference, candidate, epsilon, suffix=f" (ids {cmp.ref_top} / {cmp.cand_top} prove nothing)")
    chosen = cmp.cand_top if candidate_id is None else int(candidate_id)
    probe = decision_probe([cmp.ref_top, cmp.cand_top, chosen], reference, candidate)
    if chosen != cmp.cand_top:
        return _fail("DECISION", "decision.tie_rule", cmp.cand_top, chosen,
                     f"the runtime selected {chosen}, not its own row's greedy id {cmp.cand_top} (lowest-id tie rule; {describe_probe(probe)})",
                     probe)
    if chosen == cmp.ref_top:
        return PASS
    if cmp.stable:
        return _fail("DECISION", "decision.selected_id", cmp.ref_top, chosen,
                     f"reference margin {cmp.margin:.3g} > 2 epsilon = {2 * epsilon:.3g} guarantees id {cmp.ref_top}, the runtime "
                     f"selected {chosen} ({describe_probe(probe)})", probe)
    return Verdict(UNDECIDED, "DECISION", "ladder.DECISION", "decision.margin", cmp.ref_top, chosen,
                   f"reference margin {cmp.margin:.3g} <= 2 epsilon = {2 * epsilon:.3g}: the tolerance cannot decide between "
                   f"{cmp.ref_top} and {chosen} ({describe_probe(probe)})", probe=probe)


# --------------------------------------------------------------------------------------------
# What the spec side expects.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class DecisionCheck:
    """The harness's judgement of one decision (made when the spec decided; see :mod:`decodespec.checks.gate.lockstep`).

    Attributes:
        output_index: The decision's output index O.
        verdict: ``passed``, ``failed`` (DECISION) or ``undecided``.
    """

    output_index: int
    verdict: Verdict


@attrs.frozen(eq=False)
class Expected:
    """The spec side of one comparison (``None``: nothing expected, the check is skipped).

    Attributes mirror :class:`~decodespec.checks.adapters.Observation`; besides:

    Attributes:
        score_row: Reference raw row ``float32[V]`` of the observation's score prefix.
        cache_probe: Reference committed K/V ``float32[layers, 2, H_kv, P, D]``.
        support_ids / support_probs: The spec policy's processed row of the latest decision
            (on the runtime's own row when it exposes one).
        support_prob_tolerance / support_log_tolerance: The bounds on the processed probabilities
            (absolute) and log-probabilities (nats) when they were computed on the runtime's own row:
            the declared ones plus the rounding of the runtime's dtype at the largest processed
            magnitude (:meth:`~decodespec.checks.gate.lockstep.LockStep._decide`); ``None``: the
            declared probability bound, and no log-space check.
        draws: Draws of the latest decision.
        decision_checks: The harness's per-decision judgements (DECISION layer).
        decision_token / decision_logprob: The latest decision's id and its reference logprob.
        text / chunks / finish_reason / triggers: The spec's output (SEQUENCE).
        resume: The observation of the uninterrupted run at the same point (RESUME), or ``None``.
        tolerance: The declared :class:`Tolerance`.
        vocab_hash / vocab_rows: The checkpoint's ordered vocabulary hash and output rows, as the
            gate reads them (:func:`decodespec.checks.gate.vocab_check.reference_vocab`).
    """

    tolerance: Tolerance
    phase: str | None = None
    output_ids: tuple[int, ...] | None = None
    frontier: dict[str, Any] | None = None
    rng_counter: int | None = None
    generation: int | None = None
    quarantined: bool | None = None
    cache_committed: int | None = None
    call: dict[str, Any] | None = None
    score_row: np.ndarray | None = None
    cache_probe: np.ndarray | None = None
    support_ids: np.ndarray | None = None
    support_probs: np.ndarray | None = None
    support_prob_tolerance: float | None = None
    support_log_tolerance: float | None = None
    draws: int | None = None
    decision_checks: tuple[DecisionCheck, ...] = ()
    decision_token: int | None = None
    decision_logprob: float | None = None
    logprobs: tuple[float, ...] | None = None
    finish_reason: str | None = None
    triggers: tuple[str, ...] | None = None
    text: str | None = None
    chunks: tuple[dict[str, Any], ...] | None = None
    returned_ids: tuple[int, ...] | None = None
    returned_logprobs: tuple[float, ...] | None = None
    beam_tokens: tuple[int, ...] | None = None
    beam_parents: tuple[int, ...] | None = None
    resume: Observation | None = None
    vocab_hash: str | None = None
    vocab_rows: int | None = None


def _eq(layer: str, check: str, expected: Any, actual: Any, what: str) -> Verdict | None:
    if expected is None or actual is None or expected == actual:
        return None
    return _fail(layer, check, expected, actual, f"{what}: expected {expected!r}, observed {actual!r}")


def _first_difference(layer: str, checks: Sequence[tuple[str, Any, Any, str]]) -> Verdict | None:
    """The first ``(check, expected, actual, what)`` whose values differ (``None`` on either side: skipped)."""
    for name, want, got, what in checks:
        bad = _eq(layer, name, want, got, what)
        if bad is not None:
            return bad
    return None


@rule(
    "ladder.STATE",
    title="State equivalence: tokens, frontiers, positions, RNG counter",
    section="M3.10 Correctness matrix (1. state); A logit tolerance is not a token-equality proof",
    statement="The runtime's vocabulary identity (the ordered id -> token table hash its receipts carry, and its output "
    "rows V_out: M3.8 0x08, invariant.vocab_ordered_identity), phase, committed output ids, frontiers (L, O, |U|, P, "
    "pending tag), RNG counter, generation, quarantine flag, committed cache rows (K = P; 0 without a cache) and the launched call's slice and positions "
    "(position_ids = cache_position = start..start+length-1) equal the spec state's, exactly.",
)
def check_state(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.STATE``; ``None`` when it passes."""
    bad = _first_difference("STATE", (
        ("vocab.hash", exp.vocab_hash, obs.vocab_hash, "ordered vocabulary hash (M3.8 0x08: equal sizes prove no identity)"),
        ("vocab.rows", exp.vocab_rows, obs.vocab_rows, "output rows V_out"),
        ("phase", exp.phase, obs.phase, "phase"),
        ("output_ids", exp.output_ids, obs.output_ids, "committed output ids"),
        ("rng_counter", exp.rng_counter, obs.rng_counter, "RNG counter"),
        ("quarantined", exp.quarantined, obs.quarantined, "quarantine flag"),
        ("generation", exp.generation, obs.generation, "generation"),
        ("cache_committed", exp.cache_committed, obs.cache_committed, "committed cache rows (K frontier)"),
    ))
    if bad is not None:
        return bad
    if exp.frontier is not None and obs.frontier is not None:
        for key, want in exp.frontier.items():
            bad = _eq("STATE", f"frontier.{key}", want, obs.frontier.get(key), f"frontier {key}")
            if bad is not None:
                return bad
    if exp.call is not None and obs.call is not None:
        for key, want in exp.call.items():
            got = obs.call.get(key)
            if isinstance(got, tuple):
                got = list(got)
            bad = _eq("STATE", f"call.{key}", want, got, f"launched call {key}")
            if bad is not None:
                return bad
    return None


@rule(
    "ladder.TENSOR",
    title="Tensor equivalence: score row and cache probes within the declared tolerance",
    section="M3.10 Correctness matrix (2. tensor); A logit tolerance is not a token-equality proof",
    statement="The latest raw score row is within L-infinity epsilon (absolute plus relative to the row's scale) of the "
    "independent float64 reference row of the same committed prefix (same shape and finite entries), and each layer's "
    "committed K and V rows are within the declared K/V tolerance of the reference forward over the first P tokens.",
)
def check_tensor(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.TENSOR``; ``None`` when it passes."""
    tol = exp.tolerance
    if exp.score_row is not None and obs.score_row is not None:
        if exp.score_row.shape != obs.score_row.shape:
            return _fail("TENSOR", "score_row.shape", list(exp.score_row.shape), list(obs.score_row.shape), "score row shape differs")
        eps = tol.epsilon(exp.score_row)
        _measure("score_row", compare_rows(exp.score_row, obs.score_row, eps).linf, exp.score_row)
        bad = score_row_failure(exp.score_row, obs.score_row, eps)
        if bad is not None:
            return bad
    if exp.cache_probe is not None and obs.cache_probe is not None:
        if exp.cache_probe.shape != obs.cache_probe.shape:
            return _fail("TENSOR", "cache_probe.shape", list(exp.cache_probe.shape), list(obs.cache_probe.shape),
                         "committed K/V rows have another shape (layers, K/V, H_kv, P, D)")
        if exp.cache_probe.size:
            return cache_probe_failure(exp.cache_probe, obs.cache_probe, tol)
    return None


@rule(
    "ladder.POLICY",
    title="Policy equivalence: processed support, probabilities, draw count",
    section="M3.10 Correctness matrix (3. policy); M3.8 0x0B (local policy trace)",
    statement="The latest decision's processed support (ids) equals the spec policy's processed row computed on the "
    "runtime's own raw row, its probabilities agree within the declared probability tolerance (and, on the runtime's "
    "own row, in log space within the logprob tolerance wherever they exceed 1e-30), and the decision consumed the "
    "same number of RNG draws.",
)
def check_policy(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.POLICY``; ``None`` when it passes."""
    if exp.support_ids is not None and obs.support_ids is not None:
        if not np.array_equal(exp.support_ids, obs.support_ids):
            missing = np.setdiff1d(exp.support_ids, obs.support_ids)[:8].tolist()
            extra = np.setdiff1d(obs.support_ids, exp.support_ids)[:8].tolist()
            return _fail("POLICY", "support.ids", {"size": int(exp.support_ids.size), "missing": missing},
                         {"size": int(obs.support_ids.size), "extra": extra},
                         f"processed support differs ({exp.support_ids.size} vs {obs.support_ids.size} ids)")
        if exp.support_probs is not None and obs.support_probs is not None:
            diff = np.abs(exp.support_probs.astype(np.float64) - obs.support_probs)
            err = float(np.max(diff)) if diff.size else 0.0
            bound = exp.tolerance.prob if exp.support_prob_tolerance is None else exp.support_prob_tolerance
            if not err <= bound:
                worst = int(np.argmax(np.where(np.isnan(diff), np.inf, diff)))
                token = int(exp.support_ids[worst])
                return _fail("POLICY", "support.probs", f"<= {bound}", err,
                             f"processed probabilities differ by {err:.3g} > {bound:.3g}: worst at vocabulary id {token} "
                             f"(expected {float(exp.support_probs[worst]):.6g}, observed {float(obs.support_probs[worst]):.6g})",
                             {"kind": "support_probs", "bound": bound,
                              "worst": {"id": token, "expected": float(exp.support_probs[worst]), "observed": float(obs.support_probs[worst])}})
            bad = _support_logprobs(exp, obs)
            if bad is not None:
                return bad
    if exp.draws is not None and obs.decision is not None and obs.decision.get("draws") is not None:
        bad = _eq("POLICY", "draws", exp.draws, obs.decision.get("draws"), "RNG draws of the latest decision")
        if bad is not None:
            return bad
    return None


#: Processed probabilities below this are not compared in log space (float32 keeps ~7 digits down to 1e-38).
LOG_COMPARE_FLOOR = 1e-30


def _support_logprobs(exp: Expected, obs: Observation) -> Verdict | None:
    """Processed probabilities in log space on the runtime's own row: an absolute tolerance cannot see the tail.

    A transform that reshapes the tail (a penalty on a seen id far below the maximum) moves
    probabilities of 1e-7 by 1e-7: far inside the absolute tolerance, yet a factor of e^2 in the
    log.  Both sides processed the same raw row, so the log-probabilities agree to float32
    rounding; the declared logprob tolerance bounds that.  Compared where either side's
    probability is at least :data:`LOG_COMPARE_FLOOR`.
    """
    if exp.support_log_tolerance is None or exp.support_probs is None or obs.support_probs is None or not exp.support_probs.size:
        return None
    want, got = exp.support_probs.astype(np.float64), obs.support_probs.astype(np.float64)
    keep = (want >= LOG_COMPARE_FLOOR) | (got >= LOG_COMPARE_FLOOR)
    if not keep.any():
        return None
    diff = np.abs(np.log(np.maximum(want[keep], 1e-300)) - np.log(np.maximum(got[keep], 1e-300)))
    worst = int(np.argmax(diff))
    if diff[worst] <= exp.support_log_tolerance:
        return None
    token = int(exp.support_ids[keep][worst]) if exp.support_ids is not None else None
    return _fail("POLICY", "support.logprobs", {"id": token, "log_prob": float(np.log(max(want[keep][worst], 1e-300)))},
                 {"id": token, "log_prob": float(np.log(max(got[keep][worst], 1e-300)))},
                 f"processed log-probability of id {token} differs by {diff[worst]:.3g} nats on the runtime's own row")


@rule(
    "ladder.DECISION",
    title="Decision equivalence: selected ids, aligned logprobs, beam parents",
    section="M3.10 Correctness matrix (4. decision); A logit tolerance is not a token-equality proof",
    statement="Every decision selects the spec policy's id (greedy: by the seed's comparator -- L-infinity premise, "
    "lowest-id tie rule, then ids, undecided when the reference margin is at most 2 epsilon; sampled: the same "
    "replayed draw); each committed logprob is the reference log-softmax at the committed id within tolerance; "
    "beam steps select the same ids and parents.",
)
def check_decision(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.DECISION``; ``None`` when it passes (an undecided judgement is returned as is)."""
    for check in exp.decision_checks:
        if check.verdict.result == FAILED:
            return check.verdict
    if exp.decision_token is not None and obs.decision is not None:
        got = obs.decision.get("token_id")
        if got is not None and got != exp.decision_token:
            # The rows are the decision's own when the latest exposed row is the one it decided on.
            own = obs.score_row is not None and obs.decision.get("score_id") == obs.score_id
            probe = decision_probe([exp.decision_token, int(got)], exp.score_row if own else None, obs.score_row if own else None)
            values = describe_probe(probe)
            return _fail("DECISION", "decision.selected_id", exp.decision_token, got,
                         f"selected id: expected {exp.decision_token!r}, observed {got!r}" + (f" (raw scores {values})" if values else ""),
                         probe)
    if exp.decision_logprob is not None and obs.decision is not None and obs.decision.get("logprob") is not None:
        got = float(obs.decision["logprob"])
        if not abs(got - exp.decision_logprob) <= exp.tolerance.logprob:
            token = obs.decision.get("token_id")
            return _fail("DECISION", "decision.logprob", exp.decision_logprob, got,
                         f"the decision's logprob at vocabulary id {token} is not log-softmax of its own score row there: expected "
                         f"{exp.decision_logprob:.6g}, observed {got:.6g}, |error| {abs(got - exp.decision_logprob):.3g} > bound "
                         f"{exp.tolerance.logprob:.3g}",
                         {"kind": "logprob", "id": token, "expected": exp.decision_logprob, "observed": got, "bound": exp.tolerance.logprob})
    if exp.logprobs is not None and obs.logprobs:
        if len(exp.logprobs) != len(obs.logprobs):
            return _fail("DECISION", "logprobs.aligned", len(exp.logprobs), len(obs.logprobs), "one logprob per committed token")
        for index, (want, got) in enumerate(zip(exp.logprobs, obs.logprobs)):
            if not abs(want - got) <= exp.tolerance.logprob:
                token = obs.output_ids[index] if index < len(obs.output_ids) else None
                return _fail("DECISION", "logprobs.value", {"index": index, "logprob": want}, {"index": index, "logprob": got},
                             f"logprob of output {index} (vocabulary id {token}) is not the reference log-softmax at that token: "
                             f"expected {want:.6g}, observed {got:.6g}, |error| {abs(want - got):.3g} > bound {exp.tolerance.logprob:.3g}",
                             {"kind": "logprob", "index": index, "id": token, "expected": want, "observed": got,
                              "bound": exp.tolerance.logprob})
    for name, want, got in (("beam.tokens", exp.beam_tokens, obs.beam_tokens), ("beam.parents", exp.beam_parents, obs.beam_parents)):
        bad = _eq("DECISION", name, None if want is None else list(want), None if got is None else list(got), name)
        if bad is not None:
            return bad
    for check in exp.decision_checks:
        if check.verdict.result == UNDECIDED:
            return check.verdict
    return None


@rule(
    "ladder.SEQUENCE",
    title="Sequence equivalence: output ids, text, finish reason, stream",
    section="M3.10 Correctness matrix (5. sequence); 0x06 Streaming has a commit horizon",
    statement="The returned text, the canonical finish reason, every trigger (precedence order), the delivered "
    "stream chunks (text, byte and token offsets, final flush) and the returned ids and logprobs under the alignment "
    "contract (one logprob per returned id) equal the spec's stop/stream reference over the same committed tokens.",
)
def check_sequence(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.SEQUENCE``; ``None`` when it passes."""
    bad = _first_difference("SEQUENCE", (
        ("finish_reason", exp.finish_reason, obs.finish_reason, "finish reason"),
        ("triggers", None if exp.triggers is None else list(exp.triggers), None if obs.triggers is None else list(obs.triggers), "triggers"),
        ("text", exp.text, obs.text, "text"),
    ))
    if bad is not None:
        return bad
    if exp.chunks is not None and obs.chunks is not None:
        want, got = [dict(c) for c in exp.chunks], [dict(c) for c in obs.chunks]
        if want != got:
            index = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            return _fail("SEQUENCE", "stream.chunks", want[index] if index < len(want) else None,
                         got[index] if index < len(got) else None, f"stream chunk {index} differs ({len(want)} vs {len(got)} chunks)")
    return _check_returned(exp, obs)


def _check_returned(exp: Expected, obs: Observation) -> Verdict | None:
    """The returned output's ids and logprobs under the alignment contract (``invariant.output_alignment``)."""
    if exp.returned_ids is not None and obs.returned_ids is not None and list(exp.returned_ids) != list(obs.returned_ids):
        return _fail("SEQUENCE", "returned.output_ids", list(exp.returned_ids), list(obs.returned_ids),
                     "the returned ids are not the committed ids cut by the alignment contract")
    if exp.returned_logprobs is not None and obs.returned_logprobs is not None:
        want, got = list(exp.returned_logprobs), list(obs.returned_logprobs)
        if len(want) != len(got) or any(not abs(a - b) <= exp.tolerance.logprob for a, b in zip(want, got)):
            return _fail("SEQUENCE", "returned.logprobs", {"count": len(want)}, {"count": len(got), "ids": len(obs.returned_ids or ())},
                         "the returned logprobs do not line up with the returned ids (one raw logprob per returned token)")
    return None


_RESUME_FIELDS = ("phase", "output_ids", "logprobs", "frontier", "finish_reason", "triggers", "rng_counter", "cache_committed", "text")


@rule(
    "ladder.RESUME",
    title="Resume equivalence: a restored request continues like the uninterrupted one",
    section="M3.10 0x0BA A completed output is not automatically a resumable snapshot; Correctness matrix (6. resume)",
    statement="After restoring a snapshot, the runtime's observable state (phase, outputs, logprobs, frontiers, finish "
    "state, RNG counter, committed cache rows, text) equals the uninterrupted run's at the same point, and its score "
    "row (when both expose one) agrees within the logit tolerance: Continue(Restore(S), n) == Continue(S, n).",
)
def check_resume(exp: Expected, obs: Observation) -> Verdict | None:
    """``ladder.RESUME``; ``None`` when it passes."""
    ref = exp.resume
    if ref is None:
        return None
    for name in _RESUME_FIELDS:
        want, got = getattr(ref, name), getattr(obs, name)
        if name == "logprobs":
            if len(want) != len(got) or any(not abs(a - b) <= exp.tolerance.logprob for a, b in zip(want, got)):
                return _fail("RESUME", "resume.logprobs", list(want), list(got), "logprobs after resume differ from the uninterrupted run")
            continue
        bad = _eq("RESUME", f"resume.{name}", want, got, f"{name} after resume")
        if bad is not None:
            return bad
    if ref.score_row is not None and obs.score_row is not None and ref.score_output_count == obs.score_output_count:
        bad = score_row_failure(ref.score_row, obs.score_row, exp.tolerance.epsilon(ref.score_row), layer="RESUME",
                                check="resume.score_row", where="after resume: ")
        if bad is not None:
            return bad
    return None


#: The layer checks in ladder order.
LAYER_CHECKS: tuple[tuple[str, Callable[[Expected, Observation], Verdict | None]], ...] = (
    ("STATE", check_state),
    ("TENSOR", check_tensor),
    ("POLICY", check_policy),
    ("DECISION", check_decision),
    ("SEQUENCE", check_sequence),
    ("RESUME", check_resume),
)


def compare(exp: Expected, obs: Observation, *, layers: Sequence[str] = LAYERS) -> Verdict:
    """Run the ladder in order and stop at the first layer that does not pass.

    Args:
        exp: The spec side.
        obs: The runtime's observation.
        layers: The layers to run (a subset keeps the order; the rest are skipped).

    Returns:
        The first failed layer's verdict; else the first undecided one (an undecided layer
        does not stop the ladder: a later layer may still fail); else ``passed``.
    """
    if exp.score_row is not None:
        exp = attrs.evolve(exp, tolerance=exp.tolerance.at_row(exp.score_row))
    undecided = None
    for layer, check in LAYER_CHECKS:
        if layer not in layers:
            continue
        verdict = check(exp, obs)
        if verdict is None:
            continue
        if verdict.result == FAILED:
            return verdict
        undecided = undecided or verdict
    return undecided or PASS
