"""M3.8 0x0B-0x0E Score transforms: processors (legality, penalties, biases) and warpers.

Every transform is a pure function ``(z, spec, view, state) -> Step`` over one float64
vocabulary row ``z`` (kind logits or logprobs; ``-inf`` = forbidden) that returns the new row
(kind logits) and a *decision margin*: how far the transform's keep/remove decision is from
flipping, in the units of the statistic it thresholds (``inf`` when nothing is near a
boundary).  Margins are observations for the conformance ladder (M3.8 0x0B "Useful trace
fields are top-score margin ..."): the float32 twin may legitimately disagree only where a
margin is within float32 error.

Declared choices (each tested in ``tests/test_policy_*.py``):

* tie rule ``lowest_id``: top-k keeps exactly k ids, ties at the k-th value going to lower ids;
  every probability sort (top-p, typical) breaks ties by lower id.
* truncation never empties a non-empty support: top-p, typical and Mirostat keep at least the
  first ranked token; min-p, epsilon, eta and top-n-sigma always keep every maximum.
* top-p keeps the token whose cumulative mass crosses p (remove iff the mass *before* it is
  >= p); ``p = 1`` is the identity (HF, vLLM and llama.cpp all skip it).
* temperature ``T = 0`` never reaches :func:`temperature`: the pipeline branches to greedy.

Source: M3.8 0x0B-0x0E; HF ``generation/logits_process.py`` (5.24); vLLM
``vllm/v1/sample/ops/{penalties,bad_words,topk_topp_sampler}.py``,
``vllm/model_executor/layers/utils.py`` (``apply_penalties``); llama.cpp
``src/llama-sampler.cpp`` (top-n-sigma, Mirostat v2, min-p, typical).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import numpy as np

from decodespec.spec.policy.config import TransformSpec
from decodespec.spec.policy.scores import log_softmax, softmax
from decodespec.spec.policy.state import PolicyState, RequestView
from decodespec.spec.rules import rule

__all__ = ["TRANSFORMS", "Step", "stable_order"]

NEG_INF = -math.inf


@attrs.frozen(eq=False)
class Step:
    """Result of one transform.

    Attributes:
        values: ``[V]`` float64, kind logits.
        margin: Distance of the closest token from the transform's decision boundary (>= 0;
            ``inf`` if no boundary applies).
    """

    values: np.ndarray
    margin: float = math.inf


Transform = Callable[[np.ndarray, TransformSpec, RequestView, PolicyState], Step]

#: Transform name -> implementation.  Filled by :func:`_transform`.
TRANSFORMS: dict[str, Transform] = {}


def _transform(name: str, *, title: str, section: str, statement: str) -> Callable[[Transform], Transform]:
    def deco(fn: Transform) -> Transform:
        rule(f"transform.{name}", title=title, section=section, statement=statement)(fn)
        TRANSFORMS[name] = fn
        return fn

    return deco


def stable_order(key: np.ndarray) -> np.ndarray:
    """Ids sorted by ascending ``key``, ties by ascending id (the ``lowest_id`` tie rule)."""
    return np.argsort(key, kind="stable")


def _mask(z: np.ndarray, banned: np.ndarray) -> np.ndarray:
    out = z.copy()
    out[banned] = NEG_INF
    return out


def _threshold_margin(stat: np.ndarray, threshold: float, where: np.ndarray) -> float:
    """min |stat - threshold| over the ``where`` entries (inf when none)."""
    if not where.any():
        return math.inf
    return float(np.min(np.abs(stat[where] - threshold)))


def _near_tie_margin(key: np.ndarray, cut: float) -> float:
    """Distance from ``cut`` to the closest finite key that differs from it (inf if none).

    An exact tie at a cut is resolved by the tie rule identically in any precision; a near tie
    is where a lower-precision twin may order the ids differently.
    """
    other = key[np.isfinite(key) & (key != cut)]
    return float(np.min(np.abs(other - cut))) if other.size and math.isfinite(cut) else math.inf


def _prefix_keep(order: np.ndarray, probs: np.ndarray, mass: float, rank_key: np.ndarray) -> tuple[np.ndarray, float]:
    """Keep the ranked prefix whose mass *before* each token is < ``mass`` (the crossing token stays).

    Returns the keep mask and the margin: the smaller of ``min |mass_before - mass|`` over
    positive-probability tokens and the rank-key distance from the last kept id to the closest
    differing key (a near tie at the cut).
    """
    sorted_p = probs[order]
    before = np.cumsum(sorted_p) - sorted_p
    keep_sorted = (before < mass) & (sorted_p > 0)
    keep_sorted[0] = sorted_p[0] > 0
    keep = np.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    margin = _threshold_margin(before, mass, sorted_p > 0)
    n_keep = int(keep_sorted.sum())
    if 0 < n_keep < len(order) and sorted_p[n_keep] > 0:
        margin = min(margin, _near_tie_margin(rank_key, float(rank_key[order[n_keep - 1]])))
    return keep, margin


# ----------------------------------------------------------------------------------------
# Legality (mandatory suppression)
# ----------------------------------------------------------------------------------------


@_transform(
    "constraint",
    title="Finite-state constraint mask",
    section="M3.8 0x0B Hard constraints define a conditional support; 0x0E",
    statement="z'_v = z_v if v in A(s_t) else -inf, where s_t is the automaton state in the policy state; after selection s_{t+1} = delta(s_t, y_t).",
)
def constraint(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    legal = np.zeros(z.shape[0], dtype=bool)
    legal[list(spec.get("automaton").legal(state.constraint_state))] = True
    return Step(_mask(z, ~legal))


@_transform(
    "min_new_tokens",
    title="Minimum new tokens (EOS suppression)",
    section="M3.8 0x0E Hard constraints and finite-state policy",
    statement="While |output_ids| < min_new_tokens, z'_e = -inf for every EOS id e; otherwise z' = z (HF MinNewTokensLengthLogitsProcessor).",
)
def min_new_tokens(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    banned = np.zeros(z.shape[0], dtype=bool)
    if len(view.output_ids) < view.min_new_tokens:
        banned[list(view.eos_ids)] = True
    return Step(_mask(z, banned))


@_transform(
    "bad_words",
    title="Multi-token bad words",
    section="M3.8 0x0E Hard constraints and finite-state policy",
    statement="For each banned sequence (w_1..w_m): if the history ends with w_1..w_{m-1} (always for m = 1), z'_{w_m} = -inf (HF NoBadWordsLogitsProcessor).",
)
def bad_words(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    history = view.history(spec.get("history"))
    banned = np.zeros(z.shape[0], dtype=bool)
    for seq in spec.get("sequences"):
        prefix = seq[:-1]
        if len(prefix) <= len(history) and tuple(history[len(history) - len(prefix):]) == prefix:
            banned[seq[-1]] = True
    return Step(_mask(z, banned))


@_transform(
    "no_repeat_ngram",
    title="No-repeat n-gram",
    section="M3.8 0x0F Length penalty (a no-repeat n-gram rule changes legal continuations)",
    statement="With h the history and q its last n-1 tokens, every window h[i:i+n] whose first n-1 tokens equal q bans its last token (HF NoRepeatNGramLogitsProcessor).",
)
def no_repeat_ngram(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    n = spec.get("n")
    h = view.history(spec.get("history"))
    banned = np.zeros(z.shape[0], dtype=bool)
    if len(h) >= n:
        q = h[len(h) - (n - 1):] if n > 1 else ()
        for i in range(len(h) - n + 1):
            if h[i:i + n - 1] == q:
                banned[h[i + n - 1]] = True
    return Step(_mask(z, banned))


# ----------------------------------------------------------------------------------------
# Penalties and biases
# ----------------------------------------------------------------------------------------


@_transform(
    "repetition_penalty",
    title="Sign-aware repetition penalty",
    section="M3.8 0x0E Sign-sensitive repetition penalty",
    statement="For every distinct id v in the history: z'_v = z_v / r if z_v > 0 else z_v * r (HF RepetitionPenaltyLogitsProcessor, vLLM apply_repetition_penalties).",
)
def repetition_penalty(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    r = spec.get("penalty")
    ids = np.unique(np.array(view.history(spec.get("history")), dtype=np.int64))
    out = z.copy()
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / r, seen * r)
    return Step(out)


def _output_counts(view: RequestView, size: int) -> np.ndarray:
    return np.bincount(np.array(view.output_ids, dtype=np.int64), minlength=size).astype(np.float64)[:size]


@_transform(
    "frequency_penalty",
    title="Frequency penalty",
    section="M3.8 0x0E Score processors (frequency penalties)",
    statement="z'_v = z_v - f * count_v, count_v the occurrences of v in the output ids (OpenAI / vLLM apply_penalties).",
)
def frequency_penalty(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    return Step(z - spec.get("penalty") * _output_counts(view, z.shape[0]))


@_transform(
    "presence_penalty",
    title="Presence penalty",
    section="M3.8 0x0E Score processors (presence penalties)",
    statement="z'_v = z_v - a * [count_v > 0] over the output ids (OpenAI / vLLM apply_penalties).",
)
def presence_penalty(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    return Step(z - spec.get("penalty") * (_output_counts(view, z.shape[0]) > 0))


@_transform(
    "logit_bias",
    title="Additive logit bias",
    section="M3.8 0x0E Additive token bias",
    statement="z'_v = z_v + b_v (p'(v) proportional to p(v) e^{b_v}); unlisted ids get b_v = 0.",
)
def logit_bias(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    out = z.copy()
    for tid, b in spec.get("bias"):
        out[tid] += b
    return Step(out)


# ----------------------------------------------------------------------------------------
# Temperature and truncation warpers
# ----------------------------------------------------------------------------------------


@_transform(
    "temperature",
    title="Temperature",
    section="M3.8 0x0C Greedy decoding and temperature",
    statement="z'_v = z_v / T for T > 0; T = 0 is the greedy branch (argmax of the row at this step, no division, no draw) and never reaches this function.",
)
def temperature(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    t = spec.get("temperature")
    assert t > 0, "temperature 0 is the greedy branch, never a division"
    with np.errstate(over="ignore"):  # an overflow to +inf is reported as policy.infinite_scores
        return Step(z / t)


@_transform(
    "top_k",
    title="Top-k (exactly k under ties)",
    section="M3.8 0x0D Top-k: fixed cardinality",
    statement="Sort ids by (-z_v, v); keep the first k, set the rest to -inf. Ties at the k-th value go to lower ids, so exactly min(k, V) ids keep their scores.",
)
def top_k(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    k = spec.get("k")
    if k >= z.shape[0]:
        return Step(z.copy())
    order = stable_order(-z)
    banned = np.zeros(z.shape[0], dtype=bool)
    banned[order[k:]] = True
    return Step(_mask(z, banned), _near_tie_margin(z, float(z[order[k - 1]])))


@_transform(
    "top_p",
    title="Top-p (nucleus) keeping the crossing token",
    section="M3.8 0x0D Top-p: dynamic probability mass",
    statement="p = softmax(z); sort ids by (-p_v, v); remove an id iff the mass before it in that order is >= p (the crossing token stays); removal is scattered back through the sort permutation to vocabulary ids. p = 1 is the identity.",
)
def top_p(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    p = spec.get("p")
    if p >= 1.0:
        return Step(z.copy())
    probs = softmax(z)
    keep, margin = _prefix_keep(stable_order(-probs), probs, p, probs)
    return Step(_mask(z, ~keep), margin)


@_transform(
    "min_p",
    title="Min-p",
    section="M3.8 0x0D Min-p and relative logit gaps",
    statement="Keep v iff p_v >= alpha * p_max, evaluated as z_v >= z_max + log alpha (no underflow; llama.cpp form); alpha = 0 is the identity (HF MinPLogitsWarper, vLLM MinPLogitsProcessor).",
)
def min_p(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    alpha = spec.get("p")
    if alpha <= 0.0:
        return Step(z.copy())
    threshold = float(z.max()) + math.log(alpha)
    return Step(_mask(z, z < threshold), _threshold_margin(z, threshold, np.isfinite(z)))


@_transform(
    "typical",
    title="Locally typical sampling",
    section="M3.8 0x0D Locally typical support",
    statement="With I(v) = -log p_v and H = sum_v p_v I(v) (nats), sort ids by (|I(v) - H|, v) and keep the prefix whose mass before each id is < p (the crossing id stays) (HF TypicalLogitsWarper, Meister et al.).",
)
def typical(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    logp = log_softmax(z)
    probs = np.exp(logp)
    finite = np.isfinite(logp)
    entropy = -float(np.sum(probs[finite] * logp[finite]))
    shifted = np.where(finite, np.abs(-np.where(finite, logp, 0.0) - entropy), math.inf)
    keep, margin = _prefix_keep(stable_order(shifted), probs, spec.get("p"), shifted)
    return Step(_mask(z, ~keep), margin)


def _log_floor_cut(z: np.ndarray, logp: np.ndarray, log_floor: float) -> Step:
    """Keep ``log p_v >= log_floor`` or the row maxima; margin in nats."""
    keep = (logp >= log_floor) | (z == z.max())
    return Step(_mask(z, ~keep), _threshold_margin(logp, log_floor, np.isfinite(logp)))


@_transform(
    "epsilon",
    title="Epsilon cutoff",
    section="M3.8 0x0D Sampling-family contracts (truncation sampling)",
    statement="Keep v iff p_v >= epsilon (evaluated as log p_v >= log epsilon) or z_v is the row maximum (HF EpsilonLogitsWarper with min_tokens_to_keep = 1).",
)
def epsilon(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    return _log_floor_cut(z, log_softmax(z), math.log(spec.get("epsilon")))


@_transform(
    "eta",
    title="Eta cutoff",
    section="M3.8 0x0D Eta sampling",
    statement="eta = min(epsilon, sqrt(epsilon) * exp(-H(p))) with H in nats; keep v iff p_v >= eta (evaluated as log p_v >= min(log epsilon, log(epsilon)/2 - H)) or z_v is the row maximum (HF EtaLogitsWarper, Hewitt et al.).",
)
def eta(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    logp = log_softmax(z)
    finite = np.isfinite(logp)
    entropy = -float(np.sum(np.exp(logp[finite]) * logp[finite]))
    log_eps = math.log(spec.get("epsilon"))
    return _log_floor_cut(z, logp, min(log_eps, 0.5 * log_eps - entropy))


@_transform(
    "top_n_sigma",
    title="Top-n-sigma",
    section="M3.8 0x0D Top-n-sigma and affine invariance",
    statement="With sigma the population standard deviation of the finite logits, keep v iff z_v >= z_max - n * sigma (llama.cpp llama_sampler_top_n_sigma_apply).",
)
def top_n_sigma(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    finite = np.isfinite(z)
    threshold = float(z.max()) - spec.get("n") * float(np.std(z[finite]))
    keep = z >= threshold
    return Step(_mask(z, ~keep), _threshold_margin(z, threshold, finite))


@_transform(
    "mirostat_v2",
    title="Mirostat v2 (stateful controller)",
    section="M3.8 0x0D Feedback-controlled surprise and temperature",
    statement="Keep the probability-ranked ids with surprise -log2 p_v <= mu (at least the first); mu is policy state in bits, initialised to 2 tau; after selection mu <- mu - eta * (-log2 q_y - tau), q the final processed distribution (llama.cpp llama_sampler_mirostat_v2_apply).",
)
def mirostat_v2(z: np.ndarray, spec: TransformSpec, view: RequestView, state: PolicyState) -> Step:
    surprise = -log_softmax(z) / math.log(2.0)  # bits; +inf for forbidden ids
    mu = state.mirostat_mu
    assert mu is not None, "initial_policy_state sets mu for a mirostat_v2 policy"
    keep = surprise <= mu
    if not keep.any():
        keep[stable_order(-z)[0]] = True
    return Step(_mask(z, ~keep), _threshold_margin(surprise, mu, np.isfinite(surprise)))


def mirostat_update(mu: float, spec: TransformSpec, selected_prob: float) -> float:
    """Mirostat v2 controller update after selection.

    Args:
        mu: Threshold before the decision, bits.
        spec: The ``mirostat_v2`` transform (``tau`` bits, ``eta`` gain).
        selected_prob: Final processed probability of the selected id (> 0).

    Returns:
        ``mu - eta * (-log2(selected_prob) - tau)``, bits.

    Units:
        bits (log base 2), as llama.cpp.
    """
    return mu - float(spec.get("eta")) * (-math.log2(selected_prob) - float(spec.get("tau")))
