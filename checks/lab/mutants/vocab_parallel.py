"""Failure lab, vocabulary-parallel group: bugs of the head sharded over ranks that keep every shape.

Each mutant patches :mod:`decodespec.impl.vocab_parallel`; the gate check
``distributed.vocab_parallel.R2`` (run first for these mutants) runs the head on two gloo ranks
and compares every result with the float64 reference of :mod:`decodespec.spec.vocab_parallel`.

Source: M3.8 0x0A "Vocabulary-parallel projection and loss" (collective and failure ledger:
"normalization differs by shard", "wrong or missing target score"), "Exact backward and
ownership" ("No rank subtracts the target outside its own shard"), "Distributed inference
selection" ("A local top-p on each shard is not equal to global top-p").
"""

from __future__ import annotations

from . import Patch, mutant

_G = "vocabulary parallel"
_FIRST = ("distributed.*",)
_VP = "decodespec.impl.vocab_parallel"


@mutant(
    "vocab_local_max", group=_G, representative=True, first=_FIRST,
    title="A rank normalizes with its local maximum",
    section="M3.8 0x0A Vocabulary-parallel projection and loss (collective and failure ledger: local maximum, MAX)",
    statement="impl/vocab_parallel.py logsumexp skips the all-reduce MAX: each rank subtracts its own shard's maximum "
    "before the SUM of exponentials, so the shards' terms are on different scales and the global denominator, "
    "log-sum-exp, loss and gradients are wrong (normalization differs by shard), while every shape is kept. TENSOR "
    "fails (distributed.vocab_parallel: m, s, lse against the reference).",
)
def _vocab_local_max():
    return [Patch(f"{_VP}:logsumexp", edits=[("    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)\n", "")])]


@mutant(
    "vocab_non_owner_subtracts_target", group=_G, first=_FIRST,
    title="A non-owner rank subtracts the target in the backward",
    section="M3.8 0x0A Exact backward and ownership (no rank subtracts the target outside its own shard)",
    statement="impl/vocab_parallel.py logit_grad subtracts 1 on every rank, at the safe in-range index 0 of a rank "
    "that does not own the target: the local gradient of every non-owner shard is wrong at one entry per row, and "
    "the hidden-state gradient sums the error over ranks. TENSOR fails (logit_grad / hidden_grad).",
)
def _vocab_non_owner_subtracts_target():
    return [Patch(f"{_VP}:logit_grad", edits=[("rows = torch.nonzero(owns).flatten()", "rows = torch.arange(owns.shape[0])")])]


@mutant(
    "vocab_top_p_per_shard", group=_G, first=_FIRST,
    title="Top-p applied per shard",
    section="M3.8 0x0A Distributed inference selection (a local top-p on each shard is not equal to global top-p)",
    statement="impl/vocab_parallel.py top_p_keep renormalizes each rank's shard and keeps its local nucleus, with no "
    "gather and no global cut: the kept support is the union of shard-local nuclei (too large, and a shard's crossing "
    "token is kept regardless of the global order). DECISION fails (the top_p keep masks against the reference).",
)
def _vocab_top_p_per_shard():
    return [Patch(f"{_VP}:top_p_keep", edits=[(
        "    rank, world = _world(group)\n",
        "    probs = local_probs / local_probs.sum(dim=-1, keepdim=True)\n"
        "    order = torch.argsort(-probs, dim=-1, stable=True)\n"
        "    sorted_p = probs.gather(-1, order)\n"
        "    kept = ((torch.cumsum(sorted_p, dim=-1) - sorted_p) < p) & (sorted_p > 0)\n"
        "    kept[:, 0] = sorted_p[:, 0] > 0\n"
        "    return torch.zeros_like(kept).scatter(-1, order, kept)\n"
        "    rank, world = _world(group)\n")])]
