"""Each named invariant holds on reachable states and catches a state broken on purpose (M3.10 0x08, 0x06)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from decodespec.checks.modelcheck.explore import ExploreBounds, explore, params_for_bounds
from decodespec.spec import invariants as inv
from decodespec.spec.actions import Admit, Commit, Decide, Launch
from decodespec.spec.enums import CallKind, FinishReason, PendingTag, Selection
from decodespec.spec.rules import rules_of_kind
from decodespec.spec.state import Phase, RequestParams, RequestState, initial_state
from decodespec.spec.transitions import expected_report, step

PARAMS = params_for_bounds(ExploreBounds(prefill_chunk=None, max_draws=1, cache="static", capacity=6))
PREFILL, DECODE = CallKind.PREFILL, CallKind.DECODE


def _reach(params: RequestParams, *tokens: int, decode: bool = False) -> RequestState:
    """Admit, prefill, then commit ``tokens`` (one decode call between them); optionally launch the next decode."""
    s = step(params, initial_state(params), Admit())
    s = step(params, s, Launch(PREFILL, 0, params.prompt_len))
    s = step(params, s, expected_report(params, s))
    for i, token in enumerate(tokens):
        if i:
            s = step(params, s, Launch(DECODE, s.processed, 1))
            s = step(params, s, expected_report(params, s))
        s = step(params, s, Decide(s.score.score_id, token, 1))
        s = step(params, s, Commit(s.receipt.receipt_id))
    if decode:
        s = step(params, s, Launch(DECODE, s.processed, 1))
    return s


PENDING = _reach(PARAMS, 0, 1)  # READY, O = 2, U = [1]
IN_FLIGHT = _reach(PARAMS, 0, 1, decode=True)
FINISHED = _reach(PARAMS, 0, 2)  # EOS
SCORED = step(PARAMS, IN_FLIGHT, expected_report(PARAMS, IN_FLIGHT))
DECIDED = step(PARAMS, SCORED, Decide(SCORED.score.score_id, 0, 0))

Breaker = Callable[[RequestState], RequestState]

CASES: list[tuple[str, RequestState, Breaker]] = [
    ("invariant.type_ok", PENDING, lambda s: attrs.evolve(s, score=SCORED.score)),
    ("invariant.type_ok", PENDING, lambda s: attrs.evolve(s, output_ids=(0, 7), output_logprobs=s.output_logprobs)),
    ("invariant.type_ok", IN_FLIGHT, lambda s: attrs.evolve(s, phase=Phase.READY)),
    ("invariant.frontiers_balance", PENDING, lambda s: attrs.evolve(s, processed=s.processed + 1, lanes=(("self_kv", s.processed + 1),))),
    ("invariant.cache_frontier_equals_processed", PENDING, lambda s: attrs.evolve(s, lanes=(("self_kv", s.processed + 1),))),
    ("invariant.pending_at_most_one", PENDING, lambda s: attrs.evolve(s, pending_ids=(0, 1), processed=s.processed - 1, lanes=(("self_kv", s.processed - 1),))),
    ("invariant.pending_tag_consistent", PENDING, lambda s: attrs.evolve(s, pending_tag=PendingTag.CLOSED_UNPROCESSED)),
    ("invariant.pending_tag_consistent", FINISHED, lambda s: attrs.evolve(s, pending_tag=PendingTag.PENDING_NEXT_CALL)),
    ("invariant.receipt_consumed_once", PENDING, lambda s: attrs.evolve(s, consumed=(s.consumed[0], s.consumed[0]))),
    ("invariant.receipt_consumed_once", DECIDED, lambda s: attrs.evolve(s, issued=s.issued[:-1])),
    ("invariant.receipt_bound_to_score", PENDING, lambda s: attrs.evolve(
        s, consumed=(s.consumed[0], attrs.evolve(s.consumed[1], score_id=s.consumed[0].score_id)))),
    ("invariant.receipt_bound_to_score", DECIDED, lambda s: attrs.evolve(s, receipt=attrs.evolve(s.receipt, score_id="score-1"))),
    ("invariant.commit_requires_all_new", PENDING, lambda s: attrs.evolve(s, scores=s.scores[1:])),
    ("invariant.all_old_exposes_nothing", SCORED, lambda s: attrs.evolve(
        s, last_completion=attrs.evolve(s.last_completion, selection=Selection.ALL_OLD))),
    ("invariant.rng_counter_matches_draws", PENDING, lambda s: attrs.evolve(s, rng_counter=s.rng_counter + 1)),
    ("invariant.logprobs_aligned", PENDING, lambda s: attrs.evolve(s, output_logprobs=s.output_logprobs[:1])),
    ("invariant.logprobs_aligned", PENDING, lambda s: attrs.evolve(s, output_logprobs=tuple(reversed(s.output_logprobs)))),
    ("invariant.no_call_after_terminal", FINISHED, lambda s: attrs.evolve(s, in_flight=IN_FLIGHT.in_flight)),
    ("invariant.output_bounded", FINISHED, lambda s: attrs.evolve(s, output_ids=(0, 2, 1, 0))),
    ("invariant.eos_closes_output", FINISHED, lambda s: attrs.evolve(s, finish_reason=FinishReason.LENGTH, triggers=frozenset({FinishReason.LENGTH}))),
    ("invariant.finish_reason_canonical", FINISHED, lambda s: attrs.evolve(
        s, triggers=s.triggers | {FinishReason.STREAM_ERROR})),  # cancelled after an EOS close is a repair's, and legal
    ("invariant.static_capacity", IN_FLIGHT, lambda s: attrs.evolve(s, in_flight=attrs.evolve(s.in_flight, length=3))),
    ("invariant.quarantine_blocks_calls", IN_FLIGHT, lambda s: attrs.evolve(s, quarantined=True)),
    # A logprob owner that is not its receipt's score row does not survive a snapshot round trip.
    ("invariant.snapshot_round_trip", PENDING, lambda s: attrs.evolve(s, output_logprobs=("score-9",) * len(s.output_ids))),
]


def test_every_invariant_has_a_breaking_case() -> None:
    registered = {r.id for r in rules_of_kind("invariant") if r.obj.__module__ == inv.__name__}
    # the rank layer's invariants (spec/participation.py) are broken in tests/test_participation.py
    rank_layer = {r.id for r in rules_of_kind("invariant") if r.obj.__module__ == "decodespec.spec.participation"}
    assert rank_layer == {"invariant.ranks_declared", "invariant.no_collective_after_leave", "invariant.all_new_needs_every_rank"}
    assert registered | rank_layer == set(inv.INVARIANTS)
    assert registered == {c for c, *_ in CASES} | {"invariant.fixed_lanes_frozen"}


@pytest.mark.parametrize("base", [PENDING, IN_FLIGHT, FINISHED, SCORED, DECIDED], ids=["pending", "in_flight", "finished", "scored", "decided"])
def test_invariants_hold_on_reachable_states(base: RequestState) -> None:
    assert inv.violated(PARAMS, base) == []
    inv.check_invariants(PARAMS, base)


@pytest.mark.parametrize("rule_id, base, breaker", CASES, ids=[c for c, *_ in CASES])
def test_a_broken_state_is_caught(rule_id: str, base: RequestState, breaker: Breaker) -> None:
    """The named invariant is violated by a state broken on purpose."""
    broken = breaker(base)
    assert rule_id in inv.violated(PARAMS, broken), inv.violated(PARAMS, broken)
    with pytest.raises(AssertionError):
        inv.check_invariants(PARAMS, broken)


def test_fixed_lanes_frozen_catches_a_mutated_cross_cache() -> None:
    """invariant.fixed_lanes_frozen: target decode may not change the source-indexed lanes."""
    params = params_for_bounds(ExploreBounds(profile="encoder_decoder", prompt_len=1, source_len=3, prefill_chunk=None, max_draws=1))
    state = _reach(params, 0)
    assert inv.violated(params, state) == []
    broken = attrs.evolve(state, lanes=tuple((n, 4 if n == "cross_kv" else f) for n, f in state.lanes))
    assert inv.violated(params, broken) == ["invariant.fixed_lanes_frozen"]


def test_eos_respects_min_new_tokens() -> None:
    """invariant.eos_closes_output: an EOS before min_new_tokens is a violation."""
    params = attrs.evolve(PARAMS, min_new_tokens=2)
    assert "invariant.eos_closes_output" in inv.violated(params, FINISHED)


def test_explorer_checks_every_invariant_on_every_state() -> None:
    """Exhaustive check: every reachable state of a small configuration satisfies every invariant."""
    bounds = ExploreBounds(vocab=3, prompt_len=2, max_new_tokens=2)
    params = params_for_bounds(bounds)
    result = explore(params, bounds)
    assert result.ok and result.num_states > 100
    assert all(not inv.violated(params, s) for s in result.graph.nodes)
