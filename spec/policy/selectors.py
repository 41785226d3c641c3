"""M3.8 0x0C, 0x0D, 0x0F Selectors: greedy argmax, one-draw inverse-CDF multinomial, beam candidates.

Each selector declares the score kinds it accepts and the number of RNG draws it consumes per
decision (:data:`DRAWS`): greedy and beam draw nothing; multinomial draws exactly one uniform.

Source: M3.8 0x0C "Greedy is a local argmax", 0x0D "Multinomial needs nonnegative mass",
0x0F "Beam search: joint parent/token candidates"; failure lab 0x12 items 13, 35, 39, 43, 44.
"""

from __future__ import annotations

import math

import numpy as np

from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.rules import rule

__all__ = ["ACCEPTS", "DRAWS", "beam_select", "greedy", "multinomial"]

#: Draws consumed per decision, by selector.
DRAWS: dict[str, int] = {"greedy": 0, "multinomial": 1, "beam": 0}

#: Score kinds each selector accepts (anything else is ``policy.score_kind_mismatch``).
ACCEPTS: dict[str, frozenset[ScoreKind]] = {
    "greedy": frozenset(ScoreKind),
    "multinomial": frozenset({ScoreKind.PROBS}),
    "beam": frozenset({ScoreKind.LOGPROBS}),
}


@rule(
    "selector.greedy",
    title="Greedy argmax, lowest id on ties",
    section="M3.8 0x0C Greedy decoding and temperature",
    statement="y = min { v : s_v = max_u s_u } over the processed scores s (any kind: softmax is monotone). Consumes no draw.",
)
def greedy(scores: np.ndarray) -> tuple[int, float]:
    """Argmax with the lowest-id tie rule.

    Args:
        scores: ``[V]`` float64 with at least one entry > -inf.

    Returns:
        ``(token_id, margin)``: margin is the gap to the best score strictly below the maximum
        (``inf`` if every finite score ties), in the units of ``scores``.
    """
    top = scores.max()
    token = int(np.flatnonzero(scores == top)[0])
    below = scores[(scores < top) & np.isfinite(scores)]
    return token, (float(top - below.max()) if below.size else math.inf)


@rule(
    "selector.multinomial",
    title="Multinomial by inverse CDF with one uniform",
    section="M3.8 0x0D Multinomial needs nonnegative mass",
    statement="Given processed probabilities q (kind probs, never logits) and one uniform u in [0, 1) at the request's RNG address, y = min { v : sum_{w <= v} q_w > u * sum_w q_w } in vocabulary-id order, so the index is the vocabulary id. Consumes exactly one draw.",
)
def multinomial(probs: np.ndarray, u: float) -> tuple[int, float]:
    """Inverse-CDF categorical draw in vocabulary-id order.

    Args:
        probs: ``[V]`` float64 probabilities (non-negative, positive sum).
        u: Uniform variate in ``[0, 1)``.

    Returns:
        ``(token_id, margin)``: margin is ``min_v |cdf_v - u * total|`` over ids with positive
        probability: how far the draw lies from a CDF boundary (probability units).
    """
    cdf = np.cumsum(probs)
    target = u * cdf[-1]
    idx = int(np.searchsorted(cdf, target, side="right"))
    positive = np.flatnonzero(probs > 0)
    token = min(idx, int(positive[-1]))
    return token, float(np.min(np.abs(cdf[positive] - target)))


@rule(
    "selector.beam",
    title="Beam candidates over the flattened parent-by-token axis",
    section="M3.8 0x0F Beam search: joint parent/token candidates",
    statement="c_{k,v} = s_k + log p(v | parent k); flatten i = k V + v; keep the num_candidates largest c (ties: lowest flat index); parent = i // V, token = i % V. Consumes no draw.",
)
def beam_select(logprobs: np.ndarray, beam_scores: np.ndarray, num_candidates: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top candidates of the joint beam grid.

    Args:
        logprobs: ``[K, V]`` float64 processed log-probabilities, one row per live parent.
        beam_scores: ``[K]`` float64 running sequence scores (``-inf`` for inactive parents).
        num_candidates: How many candidates to return (<= K * V).

    Returns:
        ``(scores, parents, tokens)``, each ``[num_candidates]``: candidate score (float64),
        parent beam index and vocabulary id (int64), best first.

    Shapes:
        logprobs: ``[K, V]``; beam_scores: ``[K]``; outputs: ``[num_candidates]``.
    """
    k, v = logprobs.shape
    flat = (beam_scores[:, None] + logprobs).reshape(k * v)
    order = np.argsort(-flat, kind="stable")[:num_candidates]
    return flat[order], order // v, order % v
