"""Vocabulary-parallel output head on torch.distributed: loss, gradients and exact global selection.

Each rank owns the contiguous head rows ``[start, stop)`` (:func:`shard_range`, the
``torch.tensor_split`` layout) and calls these functions with its local tensors inside an
initialized process group (gloo for CPU tensors, NCCL for CUDA tensors: :func:`backend`).  Every function is a
collective: every rank of ``group`` must call it, in the same order, with the same row count
(the common distributed schedule; no rank skips a row).  Communication is torch.distributed's
``all_reduce`` / ``all_gather`` / ``gather`` / ``broadcast`` only.

* :func:`logsumexp`: local MAX -> all-reduce MAX -> local ``sum exp(z - m)`` -> all-reduce SUM;
* :func:`cross_entropy`: the owner contributes ``z_target``, non-owners 0 (the SUM's neutral);
* :func:`logit_grad` (owner-only target subtraction), :func:`weight_grad` (local),
  :func:`hidden_grad` (all-reduce SUM of ``G_Z_r @ E_r``);
* :func:`greedy`: all-reduce MAX of the local maxima, then all-reduce MIN of the ids at it
  (lowest global id wins); :func:`top_k`: all-gather of the local top-k, merge by (-z, id);
* :func:`top_p_keep`: the owner gathers the probability row, computes the nucleus and
  broadcasts the cut ``(p_cut, id_cut)``; :func:`multinomial`: the owner broadcasts ``u``, the
  CDF is chained across ranks in rank order, all-reduce MIN picks the id;
* :func:`telemetry`: target-owner counts, non-finite local maxima, denominator validity.

Shapes: ``local`` ``[N, V_r]`` (float64 for the exact checks; any float dtype works);
``targets`` ``[N]`` int64; row results ``[N]``.

Source: M3.8 0x0A "Vocabulary-parallel projection and loss", "Exact forward trace over
vocabulary shards", "Exact backward and ownership", "Collective and failure ledger",
"Distributed inference selection".  The gate compares every function with the float64
reference ``decodespec.spec.vocab_parallel`` (never imported here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "backend",
    "cross_entropy",
    "greedy",
    "hidden_grad",
    "local_logits",
    "logit_grad",
    "logsumexp",
    "multinomial",
    "shard_range",
    "telemetry",
    "top_k",
    "top_p_keep",
    "weight_grad",
]


def backend(device: torch.device | str = "cpu") -> str:
    """The torch.distributed backend for tensors on ``device``: ``nccl`` for CUDA tensors (when built with NCCL), else ``gloo``.

    NCCL needs one GPU per rank; CPU tensors (the tests on this machine) always use gloo.
    """
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    return "nccl" if cuda and dist.is_nccl_available() else "gloo"


def shard_range(vocab_size: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s contiguous head rows (``torch.tensor_split`` sizes: the first ``V mod R`` get one more).

    Raises:
        ValueError: when ``ranks`` is outside ``[1, vocab_size]`` or ``rank`` outside ``[0, ranks)``.
    """
    if not 1 <= ranks <= vocab_size or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks} cannot own a non-empty shard of {vocab_size} rows")
    part = torch.arange(vocab_size).tensor_split(ranks)[rank]
    return int(part[0]), int(part[-1]) + 1


def _world(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def local_logits(hidden: torch.Tensor, weight_shard: torch.Tensor) -> torch.Tensor:
    """``Z_r = H @ E_r.T`` (``[N, V_r]``)."""
    return hidden @ weight_shard.T


def logsumexp(local: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, m + log s)`` over the whole vocabulary: all-reduce MAX of local maxima, then all-reduce SUM."""
    m = local.max(dim=-1).values.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(local - m[:, None]).sum(dim=-1)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    return m, s, m + torch.log(s)


def _owned(local: torch.Tensor, start: int, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    owns = (targets >= start) & (targets < start + local.shape[-1])
    return owns, torch.where(owns, targets - start, torch.zeros_like(targets))


def cross_entropy(local: torch.Tensor, start: int, targets: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Per-row ``m + log s - z_target`` (``[N]``); the target logit reaches every rank by an all-reduce SUM (non-owners 0)."""
    _, _, lse = logsumexp(local, group)
    owns, index = _owned(local, start, targets)
    contribution = torch.where(owns, local.gather(-1, index[:, None])[:, 0], torch.zeros_like(lse))
    dist.all_reduce(contribution, op=dist.ReduceOp.SUM, group=group)
    return lse - contribution


def logit_grad(local: torch.Tensor, start: int, targets: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``G_{Z_r} = exp(Z_r - m) / s`` minus 1 at the target, on its owner only (``[N, V_r]``)."""
    m, s, _ = logsumexp(local, group)
    grad = torch.exp(local - m[:, None]) / s[:, None]
    owns, index = _owned(local, start, targets)
    rows = torch.nonzero(owns).flatten()
    grad[rows, index[rows]] -= 1.0
    return grad


def weight_grad(grad: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``G_{E_r} = G_{Z_r}.T @ H`` (``[V_r, d]``), local to the rank."""
    return grad.T @ hidden


def hidden_grad(grad: torch.Tensor, weight_shard: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``G_H = sum_r G_{Z_r} @ E_r`` (``[N, d]``) by an all-reduce SUM (the trunk sees every shard)."""
    part = grad @ weight_shard
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return part


def greedy(local: torch.Tensor, start: int, vocab_size: int, group: Any = None) -> torch.Tensor:
    """Global argmax ids (``[N]`` int64), ties to the lowest global id."""
    values = local.max(dim=-1).values
    first = torch.argmax((local == values[:, None]).to(torch.int8), dim=-1)  # the lowest local id at the maximum
    top = values.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    ids = torch.where(values == top, first + start, torch.full_like(first, vocab_size))
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids


def _ranked(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``k`` per row in (-value, id) order: stable sort by id, then stable sort by -value."""
    by_id = torch.argsort(ids, dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = torch.argsort(-values, dim=-1, stable=True)[..., :k]
    return values.gather(-1, order), ids.gather(-1, order)


def top_k(local: torch.Tensor, start: int, vocab_size: int, k: int, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k ``(values [N, k], ids [N, k])`` in (-z, id) order by merging every rank's local top-k.

    A rank with fewer than ``k`` rows pads with ``(-inf, V)``, which ranks after every real id.
    """
    _, world = _world(group)
    ids = torch.arange(start, start + local.shape[-1]).expand_as(local)
    values, ids = _ranked(local, ids, min(k, local.shape[-1]))
    pad = k - values.shape[-1]
    if pad:
        values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), vocab_size)], dim=-1)
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    return _ranked(torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1), k)


def top_p_keep(local_probs: torch.Tensor, start: int, vocab_size: int, p: float, owner: int = 0, group: Any = None) -> torch.Tensor:
    """This rank's keep mask (``[N, V_r]`` bool) of the *global* nucleus of mass ``p``.

    The owner gathers the probability row (shards padded with -1, never a probability), ranks
    ids by (-p, id), keeps the prefix whose mass before each id is < ``p``, and broadcasts the cut
    key ``(p_cut, id_cut)``; every rank keeps its ids at or before the cut.
    """
    if p >= 1.0:
        return torch.ones_like(local_probs, dtype=torch.bool)
    rank, world = _world(group)
    width = -(-vocab_size // world)
    padded = torch.cat([local_probs, local_probs.new_full((local_probs.shape[0], width - local_probs.shape[-1]), -1.0)], dim=-1)
    gathered = [torch.empty_like(padded) for _ in range(world)] if rank == owner else None
    dist.gather(padded.contiguous(), gathered, dst=owner, group=group)
    cut = local_probs.new_zeros((local_probs.shape[0], 2))
    if rank == owner:
        assert gathered is not None
        row = torch.cat(gathered, dim=-1)
        ids = torch.cat([torch.arange(width) + shard_range(vocab_size, world, r)[0] for r in range(world)])
        valid = row >= 0
        for n in range(row.shape[0]):
            probs, pid = row[n][valid[n]], ids[valid[n]]
            order = torch.argsort(-probs, stable=True)
            sorted_p = probs[order]
            before = torch.cumsum(sorted_p, dim=0) - sorted_p
            kept = (before < p) & (sorted_p > 0)
            kept[0] = sorted_p[0] > 0
            last = int(torch.nonzero(kept).flatten()[-1])
            cut[n, 0], cut[n, 1] = sorted_p[last], float(pid[order[last]])
    dist.broadcast(cut, src=owner, group=group)
    ids = torch.arange(start, start + local_probs.shape[-1], dtype=cut.dtype)
    p_cut, id_cut = cut[:, :1], cut[:, 1:]
    return (local_probs > 0) & ((local_probs > p_cut) | ((local_probs == p_cut) & (ids <= id_cut)))


def multinomial(local_probs: torch.Tensor, start: int, vocab_size: int, u: torch.Tensor, owner: int = 0, group: Any = None) -> torch.Tensor:
    """Global inverse-CDF draw (``[N]`` int64) from the owner's uniforms ``u`` (``[N]``; other ranks' values are ignored).

    The CDF runs in vocabulary-id order across ranks: rank ``r`` continues the running sum that
    rank ``r - 1`` broadcast (every rank joins every broadcast, in rank order), so each CDF entry
    is the same float64 sum a single process computes.
    """
    rank, world = _world(group)
    u = u.to(local_probs.dtype).clone()
    dist.broadcast(u, src=owner, group=group)
    carry = local_probs.new_zeros(local_probs.shape[0])
    cdf = None
    for r in range(world):
        if r == rank:
            cdf = torch.cumsum(torch.cat([carry[:, None], local_probs], dim=-1), dim=-1)[:, 1:]
            carry = cdf[:, -1].clone()
        dist.broadcast(carry, src=r, group=group)
    assert cdf is not None
    target = u * carry
    above = cdf > target[:, None]
    first = torch.where(above.any(dim=-1), above.to(torch.int8).argmax(dim=-1) + start, torch.full_like(target, vocab_size, dtype=torch.int64))
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    positive = local_probs > 0
    width = local_probs.shape[-1]
    last = torch.where(positive.any(dim=-1), start + width - 1 - positive.flip(-1).to(torch.int8).argmax(dim=-1),
                       torch.full_like(first, -1))
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
    return torch.minimum(first, last)


def telemetry(local: torch.Tensor, start: int, targets: torch.Tensor, group: Any = None) -> dict[str, Any]:
    """The loss call's ledger telemetry, the same on every rank.

    Returns ``{"target_owner_counts": [N] ints, "targets_outside": int, "nonfinite_local_max":
    [R] ints, "denominator_valid": bool}``.
    """
    _, world = _world(group)
    owns, _ = _owned(local, start, targets)
    owners = owns.to(torch.int64)
    dist.all_reduce(owners, op=dist.ReduceOp.SUM, group=group)
    local_max = local.max(dim=-1).values
    bad = torch.tensor([int((~torch.isfinite(local_max)).sum())], dtype=torch.int64)
    all_bad = [torch.empty_like(bad) for _ in range(world)]
    dist.all_gather(all_bad, bad, group=group)
    m = local_max.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = torch.exp(local - m[:, None]).sum(dim=-1)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    return {
        "target_owner_counts": [int(c) for c in owners],
        "targets_outside": int((owners == 0).sum()),
        "nonfinite_local_max": [int(b) for b in all_bad],
        "denominator_valid": bool(torch.all(torch.isfinite(s) & (s > 0))),
    }
