"""Two token paths of the same request that may diverge: the pair and path verdicts of the gate's cases.

Two runs of one request (a ``pair`` case, :func:`pair_verdict`), a batch row or a width-one beam
against the lock-step run (:func:`path_divergence_verdict`), or a path and its rows against the
float64 reference (:func:`row_path_verdict`) may select different ids after a shared prefix; the
divergence is judged by the margin rule on the spec's reference decision of that prefix
(:func:`pair_divergence_verdict`): ``undecided`` when the tolerance cannot decide between the two
ids, ``failed`` when it rules one out.  :func:`drive` runs one lock-step request for them.

Source: M3.10 "A logit tolerance is not a token-equality proof" (the margin rule, issue 8),
"Correctness matrix" (A versus B).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..adapters import Adapter, CaseConfig
from .ladder import FAILED, PASSED, UNDECIDED, Expected, Verdict, compare, decision_probe, describe_probe, greedy_comparator
from .lockstep import LockStep, ReferenceDecision, judge_decision, reference_for
from .tolerance import Tolerance

__all__ = ["common_prefix", "drive", "final_ids", "pair_divergence_verdict", "pair_verdict", "path_divergence_verdict", "row_path_verdict"]


def drive(adapter: Adapter, config: CaseConfig, actions: Sequence[Mapping[str, Any]], runtime: str) -> LockStep:
    """Reset a lock-step run of ``config`` on ``adapter`` and apply ``actions`` until the first failure."""
    ls = LockStep(adapter, config, runtime=runtime)
    ls.reset()
    for action in actions:
        if ls.failed:
            break
        ls.apply(action)
    return ls


def pair_verdict(a: LockStep, b: LockStep, fields: Sequence[str], tol: Tolerance) -> Verdict:
    """Compare the two runs' observations step by step (within twice the tolerance: both are within it of the reference).

    Where the two token paths diverge (first differing output ``k``), the steps up to the shared
    prefix are compared as usual and the divergence itself is judged by the margin rule
    (:func:`pair_divergence_verdict`): ``undecided`` when the reference margin of the shared prefix
    cannot decide between the two ids, ``failed`` only when it rules one of them out.  Later steps
    condition on different prefixes and are not compared.

    Source: M3.10 "A logit tolerance is not a token-equality proof" (issue 8: "Greedy token
    equality is only claimed from a logit tolerance when the reference margin exceeds 2 epsilon;
    otherwise the report says the margin was too small to decide"), "Correctness matrix".
    """
    pair_tol = tol.scaled(2)
    final_a, final_b = final_ids(a), final_ids(b)
    shared = common_prefix(final_a, final_b)
    diverged = shared < min(len(final_a), len(final_b))
    for index, (oa, ob) in enumerate(zip(a.observations, b.observations)):
        if oa is None or ob is None:
            continue
        if diverged and max(len(oa.output_ids), len(ob.output_ids)) > shared:
            break
        exp = Expected(
            tolerance=pair_tol,
            output_ids=oa.output_ids if "ids" in fields else None,
            frontier=oa.frontier if "frontier" in fields else None,
            cache_committed=oa.cache_committed if "cache" in fields else None,
            rng_counter=oa.rng_counter if "rng" in fields else None,
            score_row=oa.score_row if "logits" in fields and oa.score_output_count == ob.score_output_count else None,
            cache_probe=oa.cache_probe if "kv" in fields else None,
            text=oa.text if "text" in fields else None,
        )
        verdict = compare(exp, ob, layers=("STATE", "TENSOR", "SEQUENCE"))
        if not verdict.passed:
            return attrs.evolve(verdict, step=index, message=f"pair comparison at step {index}: {verdict.message}")
    if not diverged:
        return Verdict(PASSED)
    prefix = tuple(a.config.prompt_ids) + final_a[:shared]
    ref = a.reference_decisions.get(prefix) or b.reference_decisions.get(prefix)
    if ref is None:
        return Verdict(FAILED, "STATE", "ladder.STATE", "output_ids", list(final_a), list(final_b),
                       f"the two paths diverge at output {shared} ({final_a[shared]} vs {final_b[shared]}) and the spec made no "
                       "reference decision on the shared prefix to judge it by")
    return pair_divergence_verdict(ref, final_a[shared], final_b[shared], tol)


def final_ids(ls: LockStep) -> tuple[int, ...]:
    """The output ids of ``ls``'s last observation (``()`` when it observed nothing)."""
    obs = next((o for o in reversed(ls.observations) if o is not None), None)
    return () if obs is None else tuple(obs.output_ids)


def common_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    """The length of the longest common prefix of ``x`` and ``y``."""
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def pair_divergence_verdict(ref: ReferenceDecision, token_a: int, token_b: int, tol: Tolerance) -> Verdict:
    """Judge two runtime paths that select ``token_a`` and ``token_b`` after the same committed prefix.

    Each path's id is judged against the spec's decision on the reference row of that prefix
    (:func:`~decodespec.checks.gate.lockstep.judge_decision`, the row's epsilon ``ref.epsilon``: each path is
    within epsilon of the reference).  A path the reference margin rules out fails the pair (its
    verdict, DECISION layer); otherwise the tolerance cannot decide between the two ids and the
    pair is ``undecided`` (check ``pair.margin``; greedy: both ids within 2 epsilon of the
    reference maximum, so the reference margin is at most 2 epsilon).

    Args:
        ref: The spec's decision on the shared prefix (:attr:`LockStep.reference_decisions`).
        token_a / token_b: The two paths' ids at output ``ref.output_index`` (different).
        tol: The runtime's declared tolerance.

    Returns:
        ``failed`` (``decision.selected_id`` / ``decision.draw`` / ``decision.support``) or
        ``undecided`` (``pair.margin``), never ``passed`` for two different ids.

    Source: M3.10 "A logit tolerance is not a token-equality proof"; issue 8.
    """
    k = ref.output_index
    eps = tol.logit if ref.epsilon is None else ref.epsilon
    for side, token in (("A", token_a), ("B", token_b)):
        verdict = judge_decision(policy=ref.policy, ref_values=ref.values, ref_token=ref.token, runtime_token=int(token), tolerance=tol,
                                 greedy=ref.greedy, ref_probs=ref.probs, u=ref.u, output_index=k, epsilon=eps)
        if verdict.result == FAILED:
            return attrs.evolve(verdict, message=f"pair: the paths diverge at output {k} ({token_a} vs {token_b}); path {side}: "
                                                 f"{verdict.message}")
    finite = np.sort(ref.values[np.isfinite(ref.values)])
    margin = float(finite[-1] - finite[-2]) if finite.size > 1 else math.inf
    what = (f"the reference margin {margin:.3g} <= 2 epsilon = {2 * eps:.3g}" if ref.greedy else
            f"the uniform {ref.u:.6g} lies within the tolerance of both ids' CDF intervals")
    probe = decision_probe([ref.token, int(token_a), int(token_b)], ref.values, what="processed")
    return Verdict(UNDECIDED, "DECISION", "ladder.DECISION", "pair.margin", int(token_a), int(token_b),
                   f"pair: the paths diverge at output {k} ({token_a} vs {token_b}) where {what}: the tolerance cannot decide "
                   f"between them (the reference selects {ref.token}; processed scores {describe_probe(probe)})", probe=probe)


def path_divergence_verdict(ls: LockStep, ids: Sequence[int], other: Sequence[int], tol: Tolerance, *, layer: str, check: str,
                            what: str) -> Verdict:
    """Judge a token path ``other`` (a batch row, a width-one beam) against the lock-step run ``ls`` whose ids are ``ids``.

    Equal paths pass.  Where they diverge at output ``k`` after a shared prefix, the divergence
    is judged by the margin rule on the spec's reference decision of that prefix
    (:func:`pair_divergence_verdict`, from ``ls.reference_decisions``): ``undecided`` when the
    reference margin cannot decide between the two ids, ``failed`` when it rules ``other``'s id
    out (at the DECISION layer, the failing id's check).  A path that is a strict prefix of the
    other (one stopped, the other went on) and a divergence without a reference decision fail at
    ``layer`` / ``check``.

    Args:
        ls: The lock-step run (greedy, batch size one) the other path is compared with.
        ids / other: The two paths' output ids.
        tol: The runtime's declared tolerance.
        layer / check: The ladder layer and check named by a failure (``STATE`` / ``batch.output_ids``,
            ``DECISION`` / ``beam.tokens``).
        what: The comparison, for messages ("batch row 1 (left padding) and the batch-size-one run").

    Source: M3.10 "A logit tolerance is not a token-equality proof"; issue 8.
    """
    ids, other = tuple(int(t) for t in ids), tuple(int(t) for t in other)
    if ids == other:
        return Verdict(PASSED)
    k = common_prefix(ids, other)
    ref = ls.reference_decisions.get(tuple(ls.config.prompt_ids) + ids[:k]) if k < min(len(ids), len(other)) else None
    if ref is None:
        return Verdict(FAILED, layer, f"ladder.{layer}", check, list(ids), list(other), f"{what} select different token paths")
    verdict = pair_divergence_verdict(ref, ids[k], other[k], tol)
    return attrs.evolve(verdict, message=f"{what}: {verdict.message}")


def row_path_verdict(model: str, prompt: Sequence[int], ids: Sequence[int], rows: Sequence[Any], tol: Tolerance) -> Verdict:
    """Each decision of a greedy path: its row against the reference row of the same prefix, then the seed's comparator."""
    ref = reference_for(model)
    undecided = None
    for index, (token, row) in enumerate(zip(ids, rows)):
        ref_row = ref.row(tuple(prompt) + tuple(ids[:index]))
        verdict = greedy_comparator(ref_row, np.asarray(row, dtype=np.float32), tol.epsilon(ref_row), candidate_id=int(token))
        if verdict.result == FAILED:
            return attrs.evolve(verdict, message=f"output {index}: {verdict.message}")
        undecided = undecided or (verdict if verdict.result == UNDECIDED else None)
    return undecided or Verdict(PASSED)
