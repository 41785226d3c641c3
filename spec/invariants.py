"""M3.10 0x08 "Output, input, and cache frontiers": named invariants of the request state.

Each invariant is a predicate ``(params, state) -> bool`` registered as ``invariant.<name>``
and checked after every step by the explorer and the stateful machines.  One property per
predicate (TLA+ style), plus :func:`type_ok`.

Source: M3.10 "Authoritative phase and commit spine" (``P + |U| = L + O``), 0x08 (``K = P``,
``|U| <= 1``, ALL_NEW / ALL_OLD), 0x06 (exactly-once selection transaction, RNG precedence,
aligned token metadata), 0x02 branch table (no call after a terminal state except the declared
repair), 0x01 (fixed source-indexed lanes, hybrid lanes at one frontier), 0x09 (static capacity).
"""

from __future__ import annotations

from typing import Callable

import attrs

from .enums import CallKind, FinishReason, PendingTag, Selection, published_finish_reason
from . import participation
from .rules import RULES, rule
from .snapshot import restore_failure, restore_state, snapshot_forms, take_snapshot
from .state import Phase, RequestParams, RequestState, repair_outstanding

__all__ = [
    "INVARIANTS",
    "Invariant",
    "check_invariants",
    "violated",
]

Invariant = Callable[[RequestParams, RequestState], bool]
S = "M3.10 "


@rule(
    "invariant.type_ok",
    title="Every state variable is in its domain and consistent with the phase",
    section=S + "One request as a transition system",
    statement="Counts are non-negative integers; U holds at most the committed outputs; a score exists only in "
    "SCORED/DECIDED, a pending receipt only in DECIDED, a call in flight only in IN_FLIGHT (or FINISHED for "
    "repair); a finish reason exactly in FINISHED; lanes follow the roster.",
)
def type_ok(params: RequestParams, state: RequestState) -> bool:
    if not isinstance(state.phase, Phase) or not isinstance(state.pending_tag, PendingTag):
        return False
    if state.processed < 0 or state.generation < 0 or state.num_calls < 0 or state.num_retries < 0:
        return False
    if any(not (0 <= t < params.vocab_size) for t in state.output_ids):
        return False
    if tuple(name for name, _ in state.lanes) != params.roster:
        return False
    if (state.score is not None) != (state.phase in (Phase.SCORED, Phase.DECIDED)):
        return False
    if (state.receipt is not None) != (state.phase is Phase.DECIDED):
        return False
    if state.in_flight is not None and state.phase not in (Phase.IN_FLIGHT, Phase.FINISHED):
        return False
    if state.phase is Phase.IN_FLIGHT and state.in_flight is None:
        return False
    if (state.finish_reason is not None) != (state.phase is Phase.FINISHED):
        return False
    return state.identity == params.identity and state.num_retries <= params.max_retries


@rule(
    "invariant.frontiers_balance",
    title="P + |U| = L + O",
    section=S + "Authoritative phase and commit spine; 0x08 Output, input, and cache frontiers",
    statement="Once the prompt is processed, P + |U| = L + O; before that (prefill, possibly chunked) O = 0, "
    "U = [] and 0 <= P < L.",
)
def frontiers_balance(params: RequestParams, state: RequestState) -> bool:
    balanced = state.processed + len(state.pending_ids) == params.prompt_len + state.output_count
    in_prefill = state.output_count == 0 and not state.pending_ids and 0 <= state.processed < params.prompt_len
    return balanced or in_prefill


@rule(
    "invariant.cache_frontier_equals_processed",
    title="Every advancing lane frontier F_lane = P_dyn (K = P in the decoder-only profile)",
    section=S + "0x08 Output, input, and cache frontiers; 0x01 Recurrent and hybrid state generalize the cache frontier",
    statement="In a cached profile every advancing state lane's frontier F_lane equals the processed frontier P_dyn "
    "(None before the first call completes); only the decoder-only profile has a single K, and there K_frontier = P. "
    "A hybrid or recurrent profile reports P_dyn and its F_lane values (RequestState.frontiers), never a K/V length.",
)
def cache_frontier_equals_processed(params: RequestParams, state: RequestState) -> bool:
    return _lanes_at(state, params.profile.advancing_lanes(), state.processed)


def _lanes_at(state: RequestState, names: tuple[str, ...], frontier: int | None) -> bool:
    """Every lane in ``names`` is at ``frontier`` once a call has completed (P > 0), absent before."""
    expected = frontier if state.processed > 0 else None
    return all(value == expected for name, value in state.lanes if name in names)


@rule(
    "invariant.fixed_lanes_frozen",
    title="Fixed source-indexed lanes never change",
    section=S + "0x01 Encoder-decoder cached state has two lifetimes",
    statement="Encoder memory and cross K/V are absent before the first completed call and equal the source "
    "length S afterwards; target decode never mutates them.",
)
def fixed_lanes_frozen(params: RequestParams, state: RequestState) -> bool:
    return _lanes_at(state, params.profile.fixed_lanes(), params.source_len)


@rule(
    "invariant.pending_at_most_one",
    title="|U| <= 1 in ordinary decode",
    section=S + "0x08 Output, input, and cache frontiers",
    statement="The pending suffix holds at most one token, and U is a suffix of the output.",
)
def pending_at_most_one(params: RequestParams, state: RequestState) -> bool:
    pending = state.pending_ids
    return len(pending) <= 1 and (not pending or state.output_ids[-len(pending):] == pending)


@rule(
    "invariant.pending_tag_consistent",
    title="The tag of U agrees with U and the phase",
    section=S + "Authoritative phase and commit spine (U tags)",
    statement="EMPTY iff U = []; PENDING_NEXT_CALL only before finish; CLOSED_UNPROCESSED only after finish.",
)
def pending_tag_consistent(params: RequestParams, state: RequestState) -> bool:
    tag = state.pending_tag
    if (tag is PendingTag.EMPTY) != (not state.pending_ids):
        return False
    finished = state.phase is Phase.FINISHED
    if tag is PendingTag.PENDING_NEXT_CALL and finished:
        return False
    return not (tag is PendingTag.CLOSED_UNPROCESSED and not finished)


@rule(
    "invariant.receipt_consumed_once",
    title="A receipt is consumed at most once",
    section=S + "0x06 One selection is an output-state transaction",
    statement="Consumed receipt ids are distinct and were issued; the pending receipt is issued and not consumed; "
    "issued ids are distinct.",
)
def receipt_consumed_once(params: RequestParams, state: RequestState) -> bool:
    consumed = [r.receipt_id for r in state.consumed]
    issued = set(state.issued)
    if len(set(consumed)) != len(consumed) or not set(consumed) <= issued or len(issued) != len(state.issued):
        return False
    return state.receipt is None or (state.receipt.receipt_id in issued and state.receipt.receipt_id not in consumed)


@rule(
    "invariant.receipt_bound_to_score",
    title="A receipt is consumed only against the score it was issued for",
    section=S + "The first-output off-by-one; 0x02 Why logits at row i predict token i+1",
    statement="The i-th consumed receipt decides a score exposed when O = i and P = L + i (the row after the "
    "prompt and every earlier output); the pending receipt decides the current score.",
)
def receipt_bound_to_score(params: RequestParams, state: RequestState) -> bool:
    by_id = {s.score_id: s for s in state.scores}
    for index, receipt in enumerate(state.consumed):
        score = by_id.get(receipt.score_id)
        if score is None or score.output_count != index or score.processed != params.prompt_len + index:
            return False
    if state.receipt is not None:
        return state.score is not None and state.receipt.score_id == state.score.score_id
    return True


@rule(
    "invariant.commit_requires_all_new",
    title="No commit without an ALL_NEW score",
    section=S + "0x08 SELECT LOGICAL STATE (expose a consumable score only with ALL_NEW)",
    statement="Every consumed receipt and the current score refer to a score exposed by an ALL_NEW completion.",
)
def commit_requires_all_new(params: RequestParams, state: RequestState) -> bool:
    exposed = {s.score_id for s in state.scores}
    if any(r.score_id not in exposed for r in state.consumed):
        return False
    return state.score is None or state.score in state.scores


@rule(
    "invariant.all_old_exposes_nothing",
    title="ALL_OLD never exposes a score or a partial token",
    section=S + "0x08 SELECT LOGICAL STATE; 0x02 branch table (in flight: expose no partial token/state)",
    statement="After an ALL_OLD completion P is unchanged, no score was exposed, and (until the next call) no "
    "score or receipt exists.",
)
def all_old_exposes_nothing(params: RequestParams, state: RequestState) -> bool:
    last = state.last_completion
    if last is None or last.selection is not Selection.ALL_OLD:
        return True
    return (
        last.processed_after == last.processed_before
        and last.score_id is None
        and state.score is None
        and state.receipt is None
        and state.processed == last.processed_before
    )


@rule(
    "invariant.rng_counter_matches_draws",
    title="The RNG counter equals the draws actually consumed",
    section=S + "0x06 Finish reason and RNG precedence",
    statement="rng_counter = start counter + sum of the draws of consumed receipts; each consumed receipt read "
    "the counter left by the previous one.",
)
def rng_counter_matches_draws(params: RequestParams, state: RequestState) -> bool:
    counter = params.rng_counter_start
    for receipt in state.consumed:
        if receipt.rng_counter_before != counter:
            return False
        counter += receipt.draws
    return state.rng_counter == counter


@rule(
    "invariant.logprobs_aligned",
    title="One logprob per output token, owned by its score row",
    section=S + "0x06 One selection is an output-state transaction (the policy records the score/logprob row that owns "
    "the token); 0x06 Stop criteria and active rows (trimming keeps the token list and the logprob list aligned); 0x02 "
    "Prompt logprobs versus generated-token logprobs (a generated token's logprob is read from its own score row z_t, "
    "before the model advances; prompt logprobs are not part of this ledger)",
    statement="|output_logprobs| = O = |consumed|; output i is the token of consumed receipt i and its logprob "
    "belongs to that receipt's score row.",
)
def logprobs_aligned(params: RequestParams, state: RequestState) -> bool:
    if not (len(state.output_logprobs) == state.output_count == len(state.consumed)):
        return False
    return all(
        r.token_id == t and r.score_id == s for r, t, s in zip(state.consumed, state.output_ids, state.output_logprobs)
    )


@rule(
    "invariant.no_call_after_terminal",
    title="No model call after a terminal state, except the declared repair",
    section=S + "0x02 branch table; The first-output off-by-one (optional append/repair)",
    statement="A FINISHED or REJECTED request has no call in flight unless it is the repair call owed by an "
    "all_outputs promise.",
)
def no_call_after_terminal(params: RequestParams, state: RequestState) -> bool:
    if state.phase is Phase.REJECTED:
        return state.in_flight is None and state.num_calls == 0 and state.output_count == 0
    if state.phase is not Phase.FINISHED or state.in_flight is None:
        return True
    return state.in_flight.kind is CallKind.REPAIR and repair_outstanding(params, state)


@rule(
    "invariant.output_bounded",
    title="O <= G and L + O <= C",
    section=S + "0x06 Bound parsers, matchers, traces (declared limits); 0x02 branch table",
    statement="The output never exceeds max_new_tokens, the total sequence never exceeds the context cap, and "
    "a G = 0 request has no output.",
)
def output_bounded(params: RequestParams, state: RequestState) -> bool:
    return state.output_count <= params.max_new_tokens and params.prompt_len + state.output_count <= params.context_cap


@rule(
    "invariant.eos_closes_output",
    title="Nothing follows EOS; EOS respects min_new_tokens",
    section=S + "0x06 Stop criteria and active rows (finished rows keep expanding after EOS)",
    statement="An EOS token can only be the last output, never earlier than min_new_tokens, and it finishes "
    "the request.",
)
def eos_closes_output(params: RequestParams, state: RequestState) -> bool:
    for index, token in enumerate(state.output_ids):
        if token in params.eos_ids:
            if index != state.output_count - 1 or index < params.min_new_tokens:
                return False
            if state.phase is not Phase.FINISHED or FinishReason.EOS not in state.triggers:
                return False
    return True


@rule(
    "invariant.finish_reason_canonical",
    title="The finish reason is the canonical one of the triggers that closed the output",
    section=S + "0x06 Finish reason and RNG precedence",
    statement="In FINISHED the finish reason is published_finish_reason(triggers) over a non-empty trigger set (the "
    "canonical reason of the closing triggers; a cancel, timeout or device error of the repair call after the close "
    "is recorded but never rewrites it); "
    "before finish no trigger is recorded.",
)
def finish_reason_canonical(params: RequestParams, state: RequestState) -> bool:
    if state.phase is not Phase.FINISHED:
        return not state.triggers and state.finish_reason is None
    return bool(state.triggers) and state.finish_reason is published_finish_reason(state.triggers)


@rule(
    "invariant.static_capacity",
    title="0 <= committed <= reserved slots",
    section=S + "0x09 Cache families preserve different contracts",
    statement="With a static cache, the processed frontier and every in-flight write stay within the reserved "
    "capacity.",
)
def static_capacity(params: RequestParams, state: RequestState) -> bool:
    capacity = params.static_capacity
    if capacity is None:
        return True
    if state.processed > capacity:
        return False
    return state.in_flight is None or state.in_flight.end <= capacity


@rule(
    "invariant.quarantine_blocks_calls",
    title="A quarantined handle is never reused",
    section=S + "0x0A Logical recovery sockets (quarantine until recovery)",
    statement="While quarantined no call is in flight, and a generation recorded before the quarantine binds "
    "no live score.",
)
def quarantine_blocks_calls(params: RequestParams, state: RequestState) -> bool:
    return not state.quarantined or (state.in_flight is None and state.score is None)


@rule(
    "invariant.snapshot_round_trip",
    title="Restoring a snapshot gives back the state it was taken in",
    section=S + "0x0BA A completed output is not automatically a resumable snapshot",
    statement="For every snapshot form the state admits, a repaired record has U = [] and restoring the record "
    "(when the restore checks accept it) gives back the state without its diagnostic last completion: the pending "
    "token stays unprocessed, the ledger, RNG counter, generation and finish state are the same.",
)
def snapshot_round_trip(params: RequestParams, state: RequestState) -> bool:
    for form in snapshot_forms(params, state):
        record = take_snapshot(params, state, form)
        if form == "repaired" and record.pending_ids:
            return False
        if restore_failure(params, record) is not None:
            # A state the restore checks refuse breaks another invariant too; the explorer reports a
            # reachable snapshot that does not restore as explore.restore_mismatch.
            continue
        if restore_state(params, record) != attrs.evolve(state, last_completion=None):
            return False
    return True


#: Every invariant, by rule id, in the order they are checked (this module's and the rank layer's,
#: :mod:`decodespec.spec.participation`).
INVARIANTS: dict[str, Invariant] = {
    r.id: r.obj
    for r in sorted(RULES.values(), key=lambda r: r.id)
    if r.kind == "invariant" and r.obj.__module__ in (__name__, participation.__name__)
}


def violated(params: RequestParams, state: RequestState, invariants: dict[str, Invariant] | None = None) -> list[str]:
    """Ids of the invariants that ``state`` violates (empty when all hold)."""
    return [rule_id for rule_id, predicate in (invariants or INVARIANTS).items() if not predicate(params, state)]


def check_invariants(params: RequestParams, state: RequestState) -> None:
    """Raise ``AssertionError`` naming every violated invariant (a spec bug: cannot happen)."""
    broken = violated(params, state)
    assert not broken, f"invariants violated: {broken}"
