"""The step-wise controller: frontiers at every boundary, typed refusals in lock step with the spec, branches.

* The M3.10 0x08 frontier table (O, U, P and K = P) after every boundary, including the repair call.
* Every controller action refused where the spec refuses it, with the same error code and
  nothing changed (``transition.commit`` duplicate / stale receipts, ``transition.launch_decode``
  with a reset ``cache_position``, ``transition.decide`` outside SCORED, ``transition.recover``
  without quarantine, interrupts after finish).
* The G = 0 union (``no_call``, ``prefill_only``, ``reject``), ``context_length`` from the static
  capacity, ``min_new_tokens`` (EOS outside the support), the commit observer hook (text
  triggers, stream failure, a non-text trigger refused).
"""

from __future__ import annotations

import attrs
import pytest
from runtime_helpers import drive, request  # tests/ is on sys.path

from decodespec.impl.observers import CommitObservation, NullObserver
from decodespec.impl.runtime import RequestRunner
from decodespec.spec import transitions as T
from decodespec.spec.actions import Admit, Commit, Decide, Launch, Recover
from decodespec.spec.enums import CallKind, FinishReason, PendingTag
from decodespec.spec.errors import DecodeSpecError, Rejection, ResourceLimit
from decodespec.spec.policy import PolicyConfig
from decodespec.spec.state import RequestParams, initial_state


def _prompt(tok) -> list[int]:
    return [tok.bos_token_id, *tok.encode("frontiers")]


def _snapshot_of(runner: RequestRunner) -> tuple:
    return (runner.phase, runner.output_count, tuple(runner.pending_ids), runner.pending_tag, runner.processed, runner.generation,
            runner.num_calls, tuple(runner.issued), runner.policy_state, frozenset(runner.triggers), runner.quarantined)


def test_frontier_table_at_every_boundary(tiny_model, byte_tokenizer):
    """M3.10 0x08 "Output, input, and cache frontiers": P + |U| = L + O and K = P at each row of the table."""
    prompt = _prompt(byte_tokenizer)
    L = len(prompt)
    runner = RequestRunner(tiny_model, request(prompt, 2, final_cache="all_outputs"))

    def row():
        return runner.output_count, runner.pending_ids, runner.processed, runner.pending_tag, runner.cache.committed_length

    runner.admit()
    runner.launch()
    runner.complete()
    assert row() == (0, (), L, PendingTag.EMPTY, L)  # after prompt prefill, before first selection
    y0 = runner.decide().token_id
    runner.commit()
    assert row() == (1, (y0,), L, PendingTag.PENDING_NEXT_CALL, L)  # after selecting y0
    assert runner.launch().input_ids == (y0,)
    runner.complete()
    assert row() == (1, (), L + 1, PendingTag.EMPTY, L + 1)  # after processing y0, before selecting y1
    y1 = runner.decide().token_id
    assert runner.commit() == (FinishReason.LENGTH,)
    assert row() == (2, (y1,), L + 1, PendingTag.CLOSED_UNPROCESSED, L + 1)  # stop immediately
    assert runner.repair_owed() and not runner.terminal()
    call = runner.launch()
    assert call.kind is CallKind.REPAIR and call.decision_row is None and call.input_ids == (y1,)
    runner.complete()
    assert row() == (2, (), L + 2, PendingTag.EMPTY, L + 2)  # optional append/repair of y1
    assert runner.score is None and runner.terminal() and runner.finish_reason is FinishReason.LENGTH


def _params(runner: RequestRunner) -> RequestParams:
    p = runner.spec_params()
    from decodespec.checks.modelcheck.trace_validation import params_from_header

    return params_from_header({"params": p, "identity": p["identity"], "prompt_ids": list(runner.request.prompt_ids)})


def test_refusals_agree_with_the_spec_and_change_nothing(tiny_model, byte_tokenizer):
    """Lock step: the runner and the spec take the same actions; adversarial ones are refused by both with one code."""
    runner = RequestRunner(tiny_model, request(_prompt(byte_tokenizer), 3))
    params = _params(runner)
    spec = T.step(params, initial_state(params), Admit())
    runner.admit()

    def both_refuse(runner_attempt, spec_action):
        before = _snapshot_of(runner)
        with pytest.raises(DecodeSpecError) as ours:
            runner_attempt()
        with pytest.raises(DecodeSpecError) as theirs:
            T.step(params, spec, spec_action)
        assert ours.value.code == theirs.value.code
        assert _snapshot_of(runner) == before

    both_refuse(lambda: runner.decide(), Decide("score-1", 0))
    both_refuse(lambda: runner.launch(CallKind.DECODE), Launch(CallKind.DECODE, 0, 1))
    both_refuse(lambda: runner.recover(), Recover())
    call = runner.launch()
    spec = T.step(params, spec, Launch(call.kind, call.start, call.length))
    both_refuse(lambda: runner.launch(), Launch(CallKind.PREFILL, 0, call.length))
    runner.complete()
    spec = T.step(params, spec, T.expected_report(params, spec))
    both_refuse(lambda: runner.commit("receipt-0"), Commit("receipt-0"))
    decision = runner.decide()
    spec = T.step(params, spec, Decide(decision.score_id, decision.token_id, decision.draws))
    assert spec.receipt.receipt_id == decision.receipt_id and spec.score.score_id == decision.score_id
    both_refuse(lambda: runner.commit("receipt-7"), Commit("receipt-7"))
    runner.commit(decision)
    spec = T.step(params, spec, Commit(decision.receipt_id))
    both_refuse(lambda: runner.commit(decision), Commit(decision.receipt_id))  # duplicate
    # a decode launched at a reset cache_position (M3.10 0x0B) is refused
    both_refuse(lambda: runner.launch(CallKind.DECODE, start=0), Launch(CallKind.DECODE, 0, 1))
    runner.launch()
    runner.complete()
    second = runner.decide()
    assert runner.cancel(FinishReason.TIMEOUT).value == "after_decision"
    with pytest.raises(Rejection) as stale:
        runner.commit(second)  # discarded by the interrupt: stale
    assert stale.value.code == "transition.not_enabled" and runner.output_count == 1
    with pytest.raises(Rejection):
        runner.cancel()  # nothing to interrupt after finish
    # the second decode call had processed y0: nothing is pending, the discarded decision left no trace
    assert runner.finish_reason is FinishReason.TIMEOUT and runner.pending_tag is PendingTag.EMPTY
    assert runner.processed == len(runner.request.prompt_ids) + 1 and runner.policy_state.rng_counter == 0


def test_launch_guards_name_the_failing_clause(tiny_model, byte_tokenizer):
    runner = RequestRunner(tiny_model, request(_prompt(byte_tokenizer), 3, prefill_chunk=4))
    runner.admit()
    with pytest.raises(Rejection) as info:
        runner.launch(length=5)
    assert info.value.details["guard"] == "prefill length fits the remaining prompt and the chunk size"
    with pytest.raises(Rejection) as info:
        runner.launch(start=1)
    assert info.value.details["guard"] == "start == expected start (P cached, 0 uncached)"
    assert runner.launch(length=3).length == 3 and runner.cache.layer_lengths() == (0,) * 4  # nothing written before complete


def test_zero_new_tokens_branches(tiny_model, byte_tokenizer):
    """The G = 0 union: no_call makes no call; prefill_only prefills and selects nothing; reject is refused."""
    prompt = _prompt(byte_tokenizer)
    no_call = RequestRunner(tiny_model, request(prompt, 0)).run()
    assert (no_call.num_calls, no_call.processed, no_call.finish_reason) == (0, 0, FinishReason.LENGTH)
    prefill = RequestRunner(tiny_model, request(prompt, 0, zero_new_tokens="prefill_only")).run()
    assert (prefill.num_calls, prefill.processed, prefill.output_count) == (1, len(prompt), 0)
    assert prefill.finish_reason is FinishReason.LENGTH and prefill.score is None
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request(prompt, 0, zero_new_tokens="reject"))
    assert info.value.code == "envelope.zero_new_tokens_rejected"


def test_static_capacity_caps_the_context(tiny_model, byte_tokenizer):
    """The static capacity is part of the context cap C: L + O = C fires context_length; a prompt that cannot fit is refused."""
    prompt = _prompt(byte_tokenizer)
    runner = RequestRunner(tiny_model, request(prompt, 8, cache="static", static_capacity=len(prompt) + 2)).run()
    assert runner.output_count == 2 and runner.finish_reason is FinishReason.CONTEXT_LENGTH
    assert runner.processed == len(prompt) + 1 <= runner.capacity
    with pytest.raises(ResourceLimit) as info:
        RequestRunner(tiny_model, request(prompt, 8, cache="static", static_capacity=len(prompt)))
    assert info.value.code == "cache.capacity_exceeded"


def test_min_new_tokens_keeps_eos_out_of_the_support(tiny_model, byte_tokenizer):
    prompt = _prompt(byte_tokenizer)
    free = drive(RequestRunner(tiny_model, request(prompt, 6)))[1]
    eos = free.output_ids[0]
    stopped = drive(RequestRunner(tiny_model, request(prompt, 6, eos_ids=frozenset({eos}))))[1]
    assert stopped.output_ids == (eos,) and stopped.finish_reason is FinishReason.EOS
    held = RequestRunner(tiny_model, request(prompt, 6, eos_ids=frozenset({eos}), min_new_tokens=2))
    result = drive(held)[1]
    assert eos not in result.output_ids[:2] and held.policy.find("min_new_tokens") is not None


@attrs.define
class Observer(NullObserver):
    """A stand-in for the stop/stream components: reports a fixed observation at one output index (the rest of the
    observer protocol is :class:`~decodespec.impl.observers.NullObserver`'s)."""

    at: int
    observation: CommitObservation
    seen: list = attrs.field(factory=list)

    def observe(self, token_id, logprob, output_index):
        self.seen.append((token_id, output_index))
        return self.observation if output_index == self.at else CommitObservation()


def test_commit_observer_reports_text_triggers_and_stream_failures(tiny_model, byte_tokenizer):
    prompt = _prompt(byte_tokenizer)
    stop = Observer(2, CommitObservation(frozenset({FinishReason.STOP_STRING})))
    runner = RequestRunner(tiny_model, request(prompt, 8, stop_strings=("x",)), observer=stop).run()
    assert runner.output_count == 3 and runner.finish_reason is FinishReason.STOP_STRING
    assert runner.pending_tag is PendingTag.CLOSED_UNPROCESSED and [i for _, i in stop.seen] == [0, 1, 2]
    failing = RequestRunner(tiny_model, request(prompt, 8, stream=True), observer=Observer(1, CommitObservation(stream_failed=True))).run()
    assert failing.output_count == 2 and failing.finish_reason is FinishReason.STREAM_ERROR
    wrong = RequestRunner(tiny_model, request(prompt, 8), observer=Observer(0, CommitObservation(frozenset({FinishReason.EOS}))))
    while wrong.phase.value != "decided":
        wrong.step()
    with pytest.raises(Rejection):
        wrong.commit()
    assert wrong.output_count == 0 and wrong.phase.value == "decided"


def test_every_other_action_is_refused_outside_its_phase(tiny_model, byte_tokenizer):
    """transition.admit, transition.complete_*, transition.interrupt_*, transition.recover: typed refusals, nothing changed."""
    from decodespec.impl.faults import DeviceFault, FaultPlan

    runner = RequestRunner(tiny_model, request(_prompt(byte_tokenizer), 3, max_retries=1), faults=FaultPlan.of(DeviceFault(1)))
    for attempt in (runner.complete, runner.launch, runner.stream_failure, lambda: runner.cancel(FinishReason.EOS)):
        with pytest.raises(Rejection) as info:
            attempt()
        assert info.value.code == "transition.not_enabled" and runner.phase.value == "new"
    runner.admit()
    with pytest.raises(Rejection):
        runner.admit()
    while runner.num_calls < 2 or runner.in_flight is not None:
        runner.step()
    assert runner.quarantined and runner.num_retries == 1 and runner.phase.value == "ready"
    before = _snapshot_of(runner)
    with pytest.raises(Rejection) as info:
        runner.launch()  # a quarantined handle is never reused before recovery
    assert info.value.details["guard"] == "handle not quarantined" and _snapshot_of(runner) == before
    runner.recover()
    assert not runner.quarantined and runner.cache.committed_length == runner.processed
    assert drive(runner)[1].output_ids == drive(RequestRunner(tiny_model, request(_prompt(byte_tokenizer), 3)))[1].output_ids


def test_a_model_in_training_mode_is_refused(tiny_model, byte_tokenizer):
    """M3.10 0x0A "Numerical and runtime execution contract": model.eval() is its own control; a model (or one module)
    left in training mode is refused with model.training_mode before any state exists, and runs once in eval mode."""
    prompt = _prompt(byte_tokenizer)
    layer = tiny_model.model.layers[0]
    try:
        layer.train()
        assert tiny_model.training is False and layer.training is True
        with pytest.raises(Rejection) as info:
            RequestRunner(tiny_model, request(prompt, 1))
        assert info.value.code == "model.training_mode" and info.value.path == "$.model.training"
        assert "model.layers.0" in info.value.message
        tiny_model.train()
        with pytest.raises(Rejection) as info:
            RequestRunner(tiny_model, request(prompt, 1))
        assert info.value.code == "model.training_mode"
    finally:
        tiny_model.eval()
    assert RequestRunner(tiny_model, request(prompt, 1)).run().output_count == 1


def _forced(ids) -> PolicyConfig:
    """Greedy under a constraint automaton that allows exactly ``ids`` in order, then nothing (an empty legal set)."""
    from decodespec.spec.policy import policy_config_from_json

    states = {f"s{i}": {str(t): f"s{i + 1}"} for i, t in enumerate(ids)}
    states[f"s{len(ids)}"] = {}
    return policy_config_from_json({"family": "greedy", "transforms": [
        {"name": "constraint", "automaton": {"initial": "s0", "transitions": states}}]})


@pytest.mark.parametrize("final_cache", ["processed_inputs_only", "all_outputs"])
def test_empty_support_finishes_with_constraint_error_and_keeps_the_output(tiny_model, byte_tokenizer, final_cache):
    """M3.10 0x02 branch table ("constraint/parser error: typed terminal error with no unsupported next call"),
    M3.8 hard constraints: the third decision's legal set is empty, so the request finishes with constraint_error
    keeping both committed tokens and their logprobs; no receipt, no draw, no further call (not even a repair);
    the trace (empty_support, then finish) replays against the spec."""
    from decodespec.checks.modelcheck.trace_validation import validate_trace
    from decodespec.impl.events import ListSink

    sink = ListSink()
    forced = tuple(byte_tokenizer.encode("ab"))
    runner = RequestRunner(tiny_model, request(_prompt(byte_tokenizer), 5, policy=_forced(forced), final_cache=final_cache),
                           sink=sink, tokenizer=byte_tokenizer).run()
    assert runner.finish_reason is FinishReason.CONSTRAINT_ERROR and runner.terminal()
    assert tuple(runner.output_ids) == forced and len(runner.logprobs) == 2 and len(runner.issued) == 2
    assert runner.score is None and runner.decision is None and runner.num_calls == 3  # prefill, decode a, decode b
    result = runner.result()
    assert result.output_ids == forced and result.text == "ab" and result.finish_reason is FinishReason.CONSTRAINT_ERROR
    events = [r["event"] for r in sink.records]
    assert events[-2:] == ["empty_support", "finish"] and events.count("decision") == 2
    empty = sink.records[-2]
    assert (empty["code"], empty["rng_counter"]) == ("policy.empty_support", 0)
    assert sink.records[-1]["finish_reason"] == "constraint_error"
    verdict = validate_trace(sink.lines())
    assert verdict.accepted, verdict
    with pytest.raises(Rejection):
        runner.decide()  # FINISHED: nothing left to decide
