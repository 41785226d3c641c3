"""M3.8 0x0A "Vocabulary-parallel projection and loss" and "Distributed inference selection".

The output head ``E: [V, d]`` sharded over ``R`` ranks in contiguous row ranges: rank ``r`` owns
global ids ``[a_r, b_r)`` (:func:`shard_ranges`) and computes ``Z_r = H @ E_r.T: [N, V_r]``.
Every function here is the float64 numpy *reference* of one distributed computation, written
as the seed writes it: per-rank local work, then the named collective (MAX, SUM, MIN, gather),
with the neutral value that fits that collective.  The reference takes the list of the ranks'
local arrays and performs the collectives itself, so a test can compare it with the
single-rank computation (``spec.head`` / ``spec.policy``) and with the torch.distributed
runtime (:mod:`decodespec.impl.vocab_parallel`, which never imports this module).

Collective ledger (M3.8 0x0A "Collective and failure ledger"):

=========================  ======================  ================================
object                     collective              neutral value of a non-owner
=========================  ======================  ================================
local row maximum          MAX                     ``-inf``
exponential sum            SUM                     ``0``
target contribution        SUM                     ``0`` (never ``-inf``)
hidden-gradient part       SUM                     ``0``
greedy candidate id        MAX value, then MIN id  value ``-inf`` / id ``V``
top-k candidates           gather, merge           (none: exactly k per rank)
top-p cut                  gather to the owner     (none: the owner sees the row)
multinomial CDF            chained carry, MIN id   id ``V``
=========================  ======================  ================================

Declared choices:

* shard layout: contiguous, the first ``V mod R`` ranks own one row more
  (``numpy.array_split`` / ``torch.tensor_split`` sizes);
* tie rule: the policy's (``spec/policy/config.py`` ``TIE_RULE_LOWEST_ID``): among equal scores
  the lowest *global* token id wins, in greedy and at the top-k cut;
* top-p: exact, not shard-local: the declared owner (rank 0) gathers the probability row,
  computes the global nucleus in (-p, id) order exactly as ``transform.top_p`` does, and
  broadcasts the cut key ``(p_cut, id_cut)``; each rank keeps its ids at or before the cut;
* multinomial: one declared owner of the draw (rank 0) holds the uniform ``u`` and broadcasts
  it; the inverse CDF in vocabulary-id order is accumulated across shards by a chained carry
  (rank ``r`` continues the running sum left by rank ``r - 1``), so every CDF entry is the same
  float64 value the single-rank ``numpy.cumsum`` computes; the sampled id is the minimum over
  ranks of the first local id whose CDF exceeds ``u * total`` (neutral ``V``), clipped to the
  last positive id (as ``selector.multinomial`` does).

Shapes: ``hidden`` ``[N, d]``; ``weight`` ``[V, d]``; ``shards[r]`` ``[N, V_r]``; ``targets``
``[N]`` int; every row result ``[N]``.  Units: logits and log-probabilities in nats.

Source: M3.8 0x0A "Vocabulary-parallel projection and loss", "Exact forward trace over
vocabulary shards", "Exact backward and ownership", "Collective and failure ledger",
"Distributed inference selection"; M3.8 0x0C (greedy tie rule), 0x0D (top-k, top-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from decodespec.spec.head_loss import Smoothing

from .errors import Rejection, register_code
from .policy.transforms import _prefix_keep, stable_order
from .rules import rule

__all__ = [
    "VOCAB_PARALLEL_INVALID",
    "VocabTelemetry",
    "cross_entropy",
    "global_denominator",
    "global_max",
    "greedy",
    "hidden_grad",
    "logit_grads",
    "logsumexp",
    "multinomial",
    "shard",
    "shard_logits",
    "shard_ranges",
    "smoothed_cross_entropy",
    "smoothed_logit_grads",
    "smoothing_contributions",
    "smoothing_targets",
    "target_contributions",
    "telemetry",
    "top_k",
    "top_p_keep",
    "weight_grads",
]

S = "M3.8 0x0A "

VOCAB_PARALLEL_INVALID = register_code(
    "vocab_parallel.invalid_layout", "rejection", S + "Exact forward trace over vocabulary shards",
    "A vocabulary-parallel layout or call that describes no exact computation: R < 1 or R > V, shards that are not "
    "the declared contiguous ranges, k outside [1, V], p outside (0, 1], u outside [0, 1).")

Shards = Sequence[np.ndarray]


def _refuse(message: str, path: str = "$") -> Rejection:
    return Rejection(VOCAB_PARALLEL_INVALID, message, path)


def shard_ranges(vocab_size: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """The contiguous ranges ``((a_0, b_0), ..., (a_{R-1}, b_{R-1}))``; the first ``V mod R`` own one row more.

    Raises:
        Rejection: ``vocab_parallel.invalid_layout`` when ``ranks < 1`` or ``ranks > vocab_size``.
    """
    if ranks < 1 or ranks > vocab_size:
        raise _refuse(f"{ranks} ranks cannot own contiguous non-empty shards of a {vocab_size}-row head", "$.ranks")
    base, extra = divmod(vocab_size, ranks)
    out, start = [], 0
    for r in range(ranks):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


def shard(row: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Split ``[..., V]`` along the last axis into the ranks' local ``[..., V_r]`` views."""
    return [row[..., a:b] for a, b in ranges]


def _check(shards: Shards, ranges: Sequence[tuple[int, int]]) -> None:
    if len(shards) != len(ranges) or any(s.shape[-1] != b - a for s, (a, b) in zip(shards, ranges)):
        raise _refuse("the local shards do not match the declared contiguous ranges", "$.shards")


def shard_logits(hidden: np.ndarray, weight: np.ndarray, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """Local logits ``Z_r = H @ E_r.T`` (``[N, V_r]`` float64) of every rank."""
    h = np.asarray(hidden, dtype=np.float64)
    return [h @ np.asarray(weight[a:b], dtype=np.float64).T for a, b in ranges]


def global_max(shards: Shards) -> np.ndarray:
    """``m = max_r max_{v in V_r} z_v``: each rank's local row maximum, then an all-reduce MAX (``[N]``)."""
    m: np.ndarray = np.max(np.stack([s.max(axis=-1) for s in shards]), axis=0)
    return m


def global_denominator(shards: Shards, m: np.ndarray) -> np.ndarray:
    """``s = sum_r sum_{v in V_r} exp(z_v - m)``: local sums with the *global* maximum, then an all-reduce SUM.

    Ranks are summed in rank order (the order an all-reduce SUM of R values is declared to use here).
    """
    total = np.zeros_like(m)
    for local in (np.exp(s - m[:, None]).sum(axis=-1) for s in shards):
        total = total + local
    return total


@rule(
    "invariant.vocab_parallel_logsumexp",
    title='The sharded log-sum-exp uses a global MAX, then a global SUM',
    section='M3.8 0x0A Exact forward trace over vocabulary shards',
    statement='Each rank takes its local row maximum; an all-reduce MAX gives m; each rank sums exp(z - m) over its shard with that global m; an all-reduce SUM gives s; LSE = m + log s equals the single-rank log-sum-exp (a local maximum breaks it).',
)
def logsumexp(shards: Shards) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distributed log-sum-exp: ``(m, s, m + log s)`` (MAX then SUM), each ``[N]``."""
    m = global_max(shards)
    s = global_denominator(shards, m)
    return m, s, m + np.log(s)


def target_contributions(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray) -> list[np.ndarray]:
    """Each rank's contribution to the SUM that yields ``z_target``: the owner its local logit, a non-owner 0.

    A non-owner gathers a safe in-range index (0) and ``where`` discards it; ``-inf`` would be the
    neutral value of a MAX, not of this SUM.
    """
    _check(shards, ranges)
    out = []
    for s, (a, b) in zip(shards, ranges):
        owns = (a <= targets) & (targets < b)
        local = np.where(owns, targets - a, 0)
        out.append(np.where(owns, np.take_along_axis(s, local[:, None], axis=-1)[:, 0], 0.0))
    return out


@rule(
    "invariant.vocab_parallel_target_owner",
    title="Exactly one rank contributes the target logit; non-owners contribute the SUM's neutral 0",
    section='M3.8 0x0A Exact forward trace over vocabulary shards',
    statement='The owner a_r <= y < b_r contributes z_y at local index y - a_r; every non-owner gathers a safe in-range index and contributes 0 (never -inf, the neutral value of MAX); an all-reduce SUM gives z_y and the row loss m + log s - z_y without gathering [N, V] logits.',
)
def cross_entropy(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray) -> np.ndarray:
    """Per-row ``L = m + log s - z_target`` (``[N]``), without gathering the ``[N, V]`` logits."""
    _, _, lse = logsumexp(shards)
    z_target = np.zeros_like(lse)
    for c in target_contributions(shards, ranges, targets):
        z_target = z_target + c
    loss: np.ndarray = lse - z_target
    return loss


@rule(
    "invariant.vocab_parallel_backward",
    title='Owner-only target subtraction; G_E local, G_H summed over shards',
    section='M3.8 0x0A Exact backward and ownership',
    statement='Each rank normalizes its shard with the global m and s, P_r = exp(Z_r - m) / s; only the owner subtracts the target; G_{E_r} = G_{Z_r}^T H needs no all-gather; G_H = sum_r G_{Z_r} E_r is an all-reduce SUM; together they equal the single-rank gradients.',
)
def logit_grads(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray) -> list[np.ndarray]:
    """``G_{Z_r} = P_r - onehot`` with ``P_r = exp(Z_r - m) / s``; only the owner subtracts the target (``[N, V_r]`` each)."""
    _check(shards, ranges)
    m, s, _ = logsumexp(shards)
    out = []
    for z, (a, b) in zip(shards, ranges):
        g = np.exp(z - m[:, None]) / s[:, None]
        rows = np.flatnonzero((a <= targets) & (targets < b))
        g[rows, targets[rows] - a] -= 1.0
        out.append(g)
    return out


def smoothing_targets(ranges: Sequence[tuple[int, int]], targets: np.ndarray, eps: float,
                      smoothing: Smoothing | str = Smoothing.ALL_CLASSES) -> list[np.ndarray]:
    """Each rank's local target distribution ``Q_r`` (``[N, V_r]``), built from global ids only.

    ``ALL_CLASSES``: ``(Q_r)_v = (1 - eps) 1[r owns y] 1[v = y - a_r] + eps / V``;
    ``NON_TARGET``: ``eps / (V - 1)`` off the target, ``1 - eps`` at the owner's target.  ``V`` is
    the *global* vocabulary size ``b_{R-1}``, never the shard's ``V_r``.

    Raises:
        Rejection: ``vocab_parallel.invalid_layout`` (eps outside [0, 1]; ``NON_TARGET`` with V < 2).
    """
    conv = Smoothing(smoothing)
    vocab = int(ranges[-1][1])
    if not 0.0 <= float(eps) <= 1.0 or (conv is Smoothing.NON_TARGET and eps > 0 and vocab < 2):
        raise _refuse(f"label smoothing eps = {eps!r} with {conv.value} over V = {vocab} describes no target distribution", "$.eps")
    off = eps / vocab if conv is Smoothing.ALL_CLASSES else (eps / (vocab - 1) if eps > 0 else 0.0)
    on = (1.0 - eps) + (eps / vocab if conv is Smoothing.ALL_CLASSES else 0.0)
    out = []
    for a, b in ranges:
        q = np.full((targets.shape[0], b - a), off)
        rows = np.flatnonzero((a <= targets) & (targets < b))
        q[rows, targets[rows] - a] = on
        out.append(q)
    return out


@rule(
    "invariant.vocab_parallel_label_smoothing",
    title="Label smoothing over vocabulary shards: one convention, global V, a SUM of local terms",
    section=S + "Exact backward and ownership",
    statement="With label smoothing eps the per-row loss over shards is m + log s - sum_r sum_{v in V_r} (Q_r)_v z_v (a SUM "
    "with neutral 0 after the MAX and SUM of the log-sum-exp) and the local logit gradient is P_r - Q_r, where every rank "
    "builds Q_r from global ids with the one declared convention and the global V: ALL_CLASSES gives eps / V to every class "
    "and 1 - eps more to the owner's target; NON_TARGET gives eps / (V - 1) off the target. The result equals the "
    "single-rank smoothed loss and gradient; ranks mixing conventions (or using V_r) break both.",
)
def smoothing_contributions(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray, eps: float,
                            smoothing: Smoothing | str = Smoothing.ALL_CLASSES) -> list[np.ndarray]:
    """Each rank's contribution ``sum_{v in V_r} (Q_r)_v z_v`` (``[N]``) to the SUM that yields ``sum_v q_v z_v``.

    A masked class (``z = -inf``) with ``q = 0`` contributes 0 (the single-rank ``0 * -inf = 0``
    convention); one with ``q > 0`` contributes ``-inf`` (the loss is ``+inf``, as on one rank).

    Source: M3.8 0x0A "Exact backward and ownership" ("Label smoothing adds a distributed target
    value for every local class"); 0x04 "Label smoothing is a target-distribution contract".
    """
    _check(shards, ranges)
    out = []
    for z, q in zip(shards, smoothing_targets(ranges, targets, eps, smoothing)):
        with np.errstate(invalid="ignore"):
            out.append(np.where(q > 0, q * z, 0.0).sum(axis=-1))
    return out


def smoothed_cross_entropy(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray, eps: float,
                           smoothing: Smoothing | str = Smoothing.ALL_CLASSES) -> np.ndarray:
    """Per-row ``-sum_v q_v log p_v = LSE - sum_v q_v z_v`` (``[N]``; ``sum_v q_v = 1``): MAX, SUM, SUM."""
    _, _, lse = logsumexp(shards)
    qz = np.zeros_like(lse)
    for c in smoothing_contributions(shards, ranges, targets, eps, smoothing):
        qz = qz + c
    return np.asarray(lse - qz, dtype=np.float64)


def smoothed_logit_grads(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray, eps: float,
                         smoothing: Smoothing | str = Smoothing.ALL_CLASSES) -> list[np.ndarray]:
    """``G_{Z_r} = P_r - Q_r`` (``[N, V_r]`` each), ``P_r`` normalized with the global ``m`` and ``s``."""
    _check(shards, ranges)
    m, s, _ = logsumexp(shards)
    return [np.exp(z - m[:, None]) / s[:, None] - q for z, q in zip(shards, smoothing_targets(ranges, targets, eps, smoothing))]


def weight_grads(grads: Shards, hidden: np.ndarray) -> list[np.ndarray]:
    """``G_{E_r} = G_{Z_r}.T @ H`` (``[V_r, d]``): local, no vocabulary all-gather."""
    return [g.T @ np.asarray(hidden, dtype=np.float64) for g in grads]


def hidden_grad(grads: Shards, weight: np.ndarray, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """``G_H = sum_r G_{Z_r} @ E_r`` (``[N, d]``): every shard's part, then an all-reduce SUM in rank order."""
    total = None
    for g, (a, b) in zip(grads, ranges):
        part = g @ np.asarray(weight[a:b], dtype=np.float64)
        total = part if total is None else total + part
    assert total is not None
    return total


@rule(
    "invariant.vocab_parallel_greedy",
    title='Distributed greedy: global maximum, global id, lowest id on ties',
    section='M3.8 0x0A Distributed inference selection',
    statement='Each rank proposes (local max, global id); a MAX of values then a MIN of ids at the maximum gives the single-rank greedy token under the lowest-id tie rule.',
)
def greedy(shards: Shards, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Exact global argmax with the lowest-global-id tie rule (``[N]`` int64).

    Each rank proposes ``(local max, lowest global id at it)``; an all-reduce MAX gives the
    global maximum; ranks whose proposal is not at it propose the neutral id ``V``; an
    all-reduce MIN over ids picks the winner.
    """
    _check(shards, ranges)
    vocab = ranges[-1][1]
    values = np.stack([s.max(axis=-1) for s in shards])
    ids = np.stack([s.argmax(axis=-1) + a for s, (a, _) in zip(shards, ranges)])
    top = values.max(axis=0)
    first_max: np.ndarray = np.where(values == top[None, :], ids, vocab).min(axis=0)
    return first_max


def _ranked(values: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` of each row in (-value, id) order."""
    order = np.lexsort((ids, -values), axis=-1)[..., :k]
    return np.take_along_axis(values, order, axis=-1), np.take_along_axis(ids, order, axis=-1)


@rule(
    "invariant.vocab_parallel_top_k",
    title='Distributed top-k: local top-k per shard suffices, merged by global id',
    section='M3.8 0x0A Distributed inference selection',
    statement="Each rank's local top-k (global ids) is sufficient; merging at most R k candidates with the (-score, id) key gives the single-rank top-k set and order.",
)
def top_k(shards: Shards, ranges: Sequence[tuple[int, int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact global top-k by merging local top-k lists: ``(values [N, k], ids [N, k])`` in (-z, id) order.

    A candidate ranked below ``k`` inside its own shard cannot enter the global top-k (k
    same-shard candidates outrank it), so each rank sends ``min(k, V_r)`` candidates with global
    ids, and the merge ranks at most ``R * k`` of them, ties to the lower global id.

    Raises:
        Rejection: ``vocab_parallel.invalid_layout`` when ``k`` is outside ``[1, V]``.
    """
    _check(shards, ranges)
    vocab = ranges[-1][1]
    if not 1 <= k <= vocab:
        raise _refuse(f"k={k} is outside [1, {vocab}]", "$.k")
    values, ids = [], []
    for s, (a, b) in zip(shards, ranges):
        local_ids = np.broadcast_to(np.arange(a, b), s.shape)
        v, i = _ranked(s, local_ids, min(k, b - a))
        values.append(v)
        ids.append(i)
    return _ranked(np.concatenate(values, axis=-1), np.concatenate(ids, axis=-1), k)


@rule(
    "invariant.vocab_parallel_top_p",
    title='Top-p is global, never shard-local',
    section='M3.8 0x0A Distributed inference selection',
    statement='The declared owner gathers the probability row, computes the global nucleus in (-p, id) order and broadcasts the cut; a top-p computed on each renormalized shard is a different set and is refused.',
)
def top_p_keep(prob_shards: Shards, ranges: Sequence[tuple[int, int]], p: float) -> list[np.ndarray]:
    """Exact global top-p: each rank's keep mask ``[N, V_r]`` of the global nucleus.

    The owner (rank 0) gathers the probability row, ranks ids by (-p_v, v), keeps the prefix
    whose mass *before* each id is < ``p`` (the crossing id stays; ``transform.top_p``), and
    broadcasts the cut key ``(p_cut, id_cut)`` of the last kept id; each rank keeps its ids at or
    before the cut in (-p, id) order.  ``p = 1`` keeps every id.

    Raises:
        Rejection: ``vocab_parallel.invalid_layout`` when ``p`` is outside ``(0, 1]``.
    """
    _check(prob_shards, ranges)
    if not 0.0 < p <= 1.0:
        raise _refuse(f"p={p} is outside (0, 1]", "$.p")
    if p >= 1.0:
        return [np.ones(s.shape, dtype=bool) for s in prob_shards]
    row = np.concatenate(prob_shards, axis=-1)  # gathered on the owner
    keeps = [np.zeros(s.shape, dtype=bool) for s in prob_shards]
    for n in range(row.shape[0]):
        probs = row[n]
        kept, _ = _prefix_keep(stable_order(-probs), probs, p, probs)  # transform.top_p's nucleus on the owner
        p_cut = probs[kept].min()
        id_cut = int(np.flatnonzero(kept & (probs == p_cut))[-1])  # (p_cut, id_cut) broadcast by the owner
        for keep, s, (a, b) in zip(keeps, prob_shards, ranges):
            ids = np.arange(a, b)
            keep[n] = (s[n] > 0) & ((s[n] > p_cut) | ((s[n] == p_cut) & (ids <= id_cut)))
    return keeps


@rule(
    "invariant.vocab_parallel_multinomial",
    title='Distributed multinomial: one owner of the draw, CDF carried across shards',
    section='M3.8 0x0A Distributed inference selection',
    statement='One declared owner holds u and broadcasts it; the inverse CDF in vocabulary-id order is carried from rank to rank, so every CDF entry and the drawn id equal the single-rank draw bit for bit.',
)
def multinomial(prob_shards: Shards, ranges: Sequence[tuple[int, int]], u: np.ndarray) -> np.ndarray:
    """Exact global inverse-CDF draw with one owner of the uniform (``[N]`` int64), equal to ``selector.multinomial``.

    The owner broadcasts ``u``; rank ``r`` continues the running CDF from the carry left by rank
    ``r - 1`` (a chained broadcast in rank order), the last rank's carry is the total, each rank
    proposes the first local id with ``cdf > u * total`` (else ``V``), an all-reduce MIN picks
    the id, and it is clipped to the last positive id (all-reduce MAX, neutral ``-1``).

    Raises:
        Rejection: ``vocab_parallel.invalid_layout`` when some ``u`` is outside ``[0, 1)``.
    """
    _check(prob_shards, ranges)
    u = np.asarray(u, dtype=np.float64)
    if np.any((u < 0.0) | (u >= 1.0)):
        raise _refuse("every uniform must lie in [0, 1)", "$.u")
    vocab = ranges[-1][1]
    cdfs, carry = [], np.zeros(u.shape[0])
    for s in prob_shards:
        cdf = np.cumsum(np.concatenate([carry[:, None], s], axis=-1), axis=-1)[:, 1:]
        cdfs.append(cdf)
        carry = cdf[:, -1] if cdf.shape[-1] else carry
    target = u * carry
    first = np.full(u.shape[0], vocab)
    last_positive = np.full(u.shape[0], -1)
    for cdf, s, (a, b) in zip(cdfs, prob_shards, ranges):
        above = cdf > target[:, None]
        local = np.where(above.any(axis=-1), above.argmax(axis=-1) + a, vocab)
        first = np.minimum(first, local)
        pos = s > 0
        last_positive = np.maximum(last_positive, np.where(pos.any(axis=-1), b - 1 - pos[:, ::-1].argmax(axis=-1), -1))
    cut: np.ndarray = np.minimum(first, last_positive)
    return cut


@attrs.frozen
class VocabTelemetry:
    """The ledger's telemetry of one vocabulary-parallel loss call.

    Attributes:
        target_owner_counts: ``[N]`` how many ranks own each row's target (must be 1).
        targets_outside: Rows whose target lies outside every shard range.
        nonfinite_local_max: ``[R]`` rows per rank whose local maximum is not finite.
        denominator_valid: Whether every global denominator is finite and positive.
    """

    target_owner_counts: tuple[int, ...]
    targets_outside: int
    nonfinite_local_max: tuple[int, ...]
    denominator_valid: bool


@rule(
    "invariant.vocab_parallel_telemetry",
    title='Distributed loss telemetry: owner count, outside targets, local maxima, denominator',
    section='M3.8 0x0A Collective and failure ledger',
    statement='A vocabulary-parallel loss reports per row how many ranks own its target (exactly 1), targets outside every shard, non-finite local maxima per rank and whether every global denominator is finite and positive.',
)
def telemetry(shards: Shards, ranges: Sequence[tuple[int, int]], targets: np.ndarray) -> VocabTelemetry:
    """Target-owner counts (a SUM of 0/1 per rank), targets outside all shards, non-finite local maxima, denominator validity."""
    _check(shards, ranges)
    owners = np.sum([((a <= targets) & (targets < b)).astype(np.int64) for a, b in ranges], axis=0)
    local_max = [s.max(axis=-1) for s in shards]
    m = np.max(np.stack(local_max), axis=0)
    with np.errstate(invalid="ignore", over="ignore"):
        s = global_denominator(shards, m)
    return VocabTelemetry(
        target_owner_counts=tuple(int(c) for c in owners),
        targets_outside=int(np.sum(owners == 0)),
        nonfinite_local_max=tuple(int(np.sum(~np.isfinite(x))) for x in local_max),
        denominator_valid=bool(np.all(np.isfinite(s) & (s > 0))),
    )
