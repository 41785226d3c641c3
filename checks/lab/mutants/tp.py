"""Failure lab, tensor-parallel group: bugs of the rank processes of ``impl/tp.py`` that the gate of ``--runtime impl-tp`` must kill.

The ranks are forked from the controller after the mutant is installed (a new rank group per
adapter), so they run the mutated code.  The three bugs break the participation contract of
M3.10 0x0A in three places: the collective schedule (a rank skips one), the frontier the ranks
agree on (one rank does not publish a call), and the ownership of grouped-query heads (a rank's
query heads read another group's K/V head).  None changes a shape.

Source: M3.10 0x0A "One request can still be model-parallel" (the closed roster must agree on
generation and position; one rank leaving a collective can hang the request), 0x0B
"Shape-correct failure lab"; issue 21 item 5.
"""

from __future__ import annotations

from . import Patch, mutant

_G = "tensor parallel"
_RT = "impl-tp"


@mutant(
    "tp_rank_skips_collective", group=_G, runtime=_RT,
    title="Rank 1 skips the MLP all_reduce of every layer",
    section="M3.10 0x0A One request can still be model-parallel ('One rank exiting while peers enter another collective "
    "can hang the request'); M3.10 0x0B Shape-correct failure lab",
    statement="impl/tp.py _rank_layer: on rank 1 the MLP's partial output is added without the all_reduce over the ranks. "
    "Rank 1's residual stream misses the other ranks' MLP slices, and the ranks' collective schedules no longer match "
    "(rank 0 enters an all_reduce rank 1 never joins): the call must end by the bounded gloo wait, not hang, and the "
    "runtime selects ALL_OLD where the spec completes ALL_NEW (STATE).",
)
def _tp_rank_skips_collective():
    return [Patch("decodespec.impl.tp:_rank_layer", edits=[
        ("return hidden + _all_reduce(mlp)", "return hidden + (_all_reduce(mlp) if torch.distributed.get_rank() != 1 else mlp)")])]


@mutant(
    "tp_rank_frontier_lags", group=_G, runtime=_RT,
    title="Rank 1 does not publish single-row calls: the ranks' frontiers diverge",
    section="M3.10 0x0A One request can still be model-parallel (K_g^(0) = ... = K_g^(R-1) under the shared generation); "
    "M3.10 0x0B Shape-correct failure lab",
    statement="impl/tp.py _rank_commit: rank 1 abandons instead of committing every one-row call (decode, repair), so its "
    "committed K/V frontier stays behind rank 0's after the first decode. The ranks then disagree on the frontier of "
    "the next call; a runtime that trusted rank 0's report would read rank 1's missing K/V rows. The gate sees the "
    "request refuse or fail the call the spec accepts (STATE).",
)
def _tp_rank_frontier_lags():
    return [Patch("decodespec.impl.tp:_rank_commit", edits=[
        ("    cache.commit_call(generation)",
         "    cache.commit_call(generation) if rank != 1 or cache._call.length > 1 else cache.abandon_call()")])]


@mutant(
    "tp_wrong_kv_head_owner", group=_G, runtime=_RT, representative=True,
    title="Query heads sharded with the wrong K/V head (grouping not respected)",
    section="M3.10 0x0A One request can still be model-parallel (ranks own shards of projections); M3.10 0x0B "
    "Shape-correct failure lab (grouped-query heads)",
    statement="impl/tp.py shard_plan: each rank's query heads are those of the next K/V head ((g + 1) mod H_kv) instead "
    "of its own K/V head g, so every query head attends over another group's keys and values. Shapes, the collective "
    "schedule and the first layer's K/V rows are right; the score rows and later K/V rows are wrong (TENSOR).",
)
def _tp_wrong_kv_head_owner():
    return [Patch("decodespec.impl.tp:shard_plan", edits=[
        ("for h in query_heads_of(g, n_rep))", "for h in query_heads_of((g + 1) % kv, n_rep))")])]
