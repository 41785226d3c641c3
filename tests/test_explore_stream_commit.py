"""The explorer tries a streamer failure at commit: ``Commit(stream_failed=True)`` (transition.commit).

M3.10 0x06 "One selection is an output-state transaction" (the stream commit horizon): a
commit's own publish step may fail; the commit then fires ``stream_error`` among its triggers,
which outranks whatever else the same commit fires (EOS, ``length``, a text trigger), and the
request finishes.  The explorer offers that commit in every DECIDED state of a streamed request
(next to the plain commit, for every declared text-trigger set) and, in the adversarial alphabet,
in a request without a stream, where the guard "a stream failure at commit needs a stream" must
refuse it.  Every invariant holds over the larger state space (``checks/test_explore.py`` runs
every configuration); a commit that lets a lower-precedence trigger win when the stream fails is
caught by ``invariant.finish_reason_canonical`` with a 5-step counterexample, which the explorer
could not reach before it tried this action.

Source: docs/design.md section 2 (stop and stream: a failure at a commit is one of that
commit's triggers) and section 5 (explorer).
"""

from __future__ import annotations

import attrs
import pytest

from decodespec.checks.modelcheck.explore import ExploreBounds, candidate_actions, explore, params_for_bounds
from decodespec.spec import transitions as T
from decodespec.spec.actions import Admit, Commit, Complete, Decide, Launch
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason
from decodespec.spec.errors import Rejection
from decodespec.spec.state import Phase, initial_state

ONE_SHOT = ExploreBounds(prefill_chunk=None)


def _stream_failed_commits(result):
    """``(state before, action, state after)`` for every explored ``Commit(stream_failed=True)`` edge."""
    return [(a, d["action"], b) for a, b, d in result.graph.edges(data=True)
            if isinstance(d["action"], Commit) and d["action"].stream_failed]


def test_streamed_request_explores_the_commit_whose_delivery_fails():
    """transition.commit with stream_failed: every such commit finishes with stream_error, outranking EOS and length."""
    bounds = attrs.evolve(ONE_SHOT, stop_strings=True)
    result = explore(params_for_bounds(bounds), bounds)
    assert result.ok, result.summary()["violations"]
    edges = _stream_failed_commits(result)
    assert edges
    for _, action, after in edges:
        assert after.phase is Phase.FINISHED and after.finish_reason is FinishReason.STREAM_ERROR
        assert FinishReason.STREAM_ERROR in after.triggers
    together = {frozenset(after.triggers) - {FinishReason.STREAM_ERROR} for _, _, after in edges}
    # fired alone, with EOS, with length (O = G) and with a stop string: the other triggers are still recorded
    assert {frozenset(), frozenset({FinishReason.EOS}), frozenset({FinishReason.LENGTH}),
            frozenset({FinishReason.STOP_STRING})} <= together
    assert any(action.text_triggers for _, action, _ in edges)


def test_without_a_stream_the_commit_stream_failure_is_tried_and_refused():
    """transition.commit guard 'a stream failure at commit needs a stream': offered adversarially, refused, nothing changes."""
    bounds = attrs.evolve(ONE_SHOT, stream=False)
    params = params_for_bounds(bounds)
    state = initial_state(params)
    for action in (Admit(), Launch(CallKind.PREFILL, 0, params.prompt_len)):
        state = T.MACHINE.step(params, state, action)
    state = T.MACHINE.step(params, state, T.expected_report(params, state))
    state = T.MACHINE.step(params, state, Decide(state.score.score_id, 0, 0))
    offered = [a for a in candidate_actions(params, state, bounds) if isinstance(a, Commit) and a.stream_failed]
    assert offered == [Commit(state.receipt.receipt_id, frozenset(), stream_failed=True)]
    with pytest.raises(Rejection) as info:
        T.MACHINE.step(params, state, offered[0])
    assert info.value.code == "transition.not_enabled" and "stream" in info.value.details["guard"]
    assert not [a for a in candidate_actions(params, state, attrs.evolve(bounds, adversarial=False))
                if isinstance(a, Commit) and a.stream_failed]
    result = explore(params, bounds)
    assert result.ok and not _stream_failed_commits(result)


def commit_stream_error_loses_precedence(params, state, action):
    """Broken transition.commit: when the delivery fails together with another trigger, the lowest-precedence one wins."""
    nxt = T.commit(params, state, action)
    if action.stream_failed and len(nxt.triggers) > 1:
        return attrs.evolve(nxt, finish_reason=[t for t in FINISH_PRECEDENCE if t in nxt.triggers][-1])
    return nxt


def test_a_commit_that_mis_ranks_stream_error_is_caught():
    """invariant.finish_reason_canonical catches the broken commit only through Commit(stream_failed=True)."""
    params = params_for_bounds(ONE_SHOT)
    result = explore(params, ONE_SHOT, machine=T.MACHINE.with_effect("transition.commit", commit_stream_error_loses_precedence))
    assert not result.ok
    violation = result.violations[0]
    assert violation.rule_id == "invariant.finish_reason_canonical"
    assert [type(a) for a in violation.actions] == [Admit, Launch, Complete, Decide, Commit]
    assert violation.actions[-1].stream_failed and violation.states[-1].finish_reason is not FinishReason.STREAM_ERROR
