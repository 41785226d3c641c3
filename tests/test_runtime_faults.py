"""Cancellation, timeout, device faults, missing lanes and stream failures at every boundary of a run.

M3.10 0x02 branch table and 0x0A "Asynchronous completion and error boundaries": whatever
happens, the runner returns the last committed state (the clean run's first outputs and their
logprobs), the right finish reason, and nothing partial (no score, no pending decision, no token
of the failed call; P at the last selected ALL_NEW state, a cached handle quarantined after an
ALL_OLD completion).  With retries declared, a failed call is recovered (cropped back to P under
a new generation) and retried, and the run equals the clean run.  Every trace is accepted by
the spec (``decodespec.checks.modelcheck.trace_validation``).
"""

from __future__ import annotations

import pytest
from runtime_helpers import request  # tests/ is on sys.path

from decodespec.checks.modelcheck.trace_validation import validate_trace
from decodespec.impl.events import ListSink
from decodespec.impl.faults import DeviceFault, FaultPlan, Interrupt, MissingLane, StreamFailureAt
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import FinishReason, PendingTag
from decodespec.spec.errors import Rejection
from decodespec.spec.state import InterruptPoint

G = 4
FAMILIES = ["none", "dynamic", "static"]


@pytest.fixture(scope="module")
def clean(tiny_model, byte_tokenizer):
    prompt = [1, *byte_tokenizer.encode("faults")]
    runs = {}
    for family in FAMILIES:
        runner = RequestRunner(tiny_model, request(prompt, G, cache=family)).run()
        assert runner.num_calls == G and runner.finish_reason is FinishReason.LENGTH
        runs[family] = runner
    return prompt, runs


def _run(model, prompt, family, plan, **changes):
    sink = ListSink()
    runner = RequestRunner(model, request(prompt, G, cache=family, **changes), sink=sink, faults=plan).run()
    verdict = validate_trace(sink.lines())
    assert verdict.accepted, verdict
    return runner


def _assert_last_committed(runner, clean_runner, count, prompt_len):
    assert runner.output_ids == clean_runner.output_ids[:count]
    assert runner.logprobs == clean_runner.logprobs[:count]
    assert runner.score is None and runner.decision is None and runner.in_flight is None
    if count:
        assert runner.pending_tag in (PendingTag.CLOSED_UNPROCESSED, PendingTag.EMPTY)
    assert runner.processed + len(runner.pending_ids) == prompt_len + count or (count == 0 and runner.processed == 0)
    if runner.cache is not None and not runner.quarantined:
        assert runner.cache.committed_length == runner.processed


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("at", list(InterruptPoint), ids=[p.value for p in InterruptPoint])
def test_interrupt_at_every_call_boundary(tiny_model, clean, family, at):
    prompt, runs = clean
    for call_id in range(G):
        reason = FinishReason.CANCELLED if call_id % 2 else FinishReason.TIMEOUT
        runner = _run(tiny_model, prompt, family, FaultPlan.of(Interrupt(reason, call_id, at)))
        assert runner.finish_reason is reason and runner.triggers == {reason}
        _assert_last_committed(runner, runs[family], call_id, len(prompt))
        in_flight = at is InterruptPoint.IN_FLIGHT
        assert runner.quarantined == (in_flight and family != "none")  # ALL_OLD was selected for the awaited call
        if at in (InterruptPoint.AFTER_COMPLETION, InterruptPoint.AFTER_DECISION):
            assert runner.processed == len(prompt) + call_id and runner.pending_tag is PendingTag.EMPTY
        assert runner.num_calls == call_id + (0 if at is InterruptPoint.BEFORE_LAUNCH else 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_device_fault_and_missing_lane_at_every_call(tiny_model, clean, family):
    """No retries: device_error with the last committed state; one retry: the clean run exactly."""
    prompt, runs = clean
    kinds = [DeviceFault] + ([MissingLane] if family != "none" else [])
    for kind in kinds:
        for call_id in range(G):
            plan = FaultPlan.of(kind(call_id, layer=call_id % 4))
            failed = _run(tiny_model, prompt, family, plan)
            assert failed.finish_reason is FinishReason.DEVICE_ERROR
            _assert_last_committed(failed, runs[family], call_id, len(prompt))
            assert failed.quarantined == (family != "none")
            retried = _run(tiny_model, prompt, family, plan, max_retries=1)
            assert retried.output_ids == runs[family].output_ids and retried.logprobs == runs[family].logprobs
            assert retried.num_retries == 1 and retried.num_calls == G + 1 and retried.finish_reason is FinishReason.LENGTH
            assert retried.generation == runs[family].generation + (family != "none")  # a recovery starts a new generation


def test_missing_lane_needs_a_cache_and_faults_name_real_layers(tiny_model, clean):
    prompt, _ = clean
    for family, plan in (("none", FaultPlan.of(MissingLane(0))), ("dynamic", FaultPlan.of(DeviceFault(0, layer=9))),
                         ("dynamic", FaultPlan.of(StreamFailureAt(0)))):
        with pytest.raises(Rejection) as info:
            RequestRunner(tiny_model, request(prompt, G, cache=family), faults=plan)
        assert info.value.code == "runtime.invalid_fault_plan"


@pytest.mark.parametrize("index", range(G - 1))
def test_stream_failure_after_each_commit(tiny_model, clean, index):
    """Declared policy: a streamer failure closes like an interrupt with stream_error, keeping the committed tokens."""
    prompt, runs = clean
    runner = _run(tiny_model, prompt, "dynamic", FaultPlan.of(StreamFailureAt(index)), stream=True)
    assert runner.finish_reason is FinishReason.STREAM_ERROR
    _assert_last_committed(runner, runs["dynamic"], index + 1, len(prompt))
    assert runner.pending_tag is PendingTag.CLOSED_UNPROCESSED


def test_faulted_repair_call_is_retried(tiny_model, clean):
    """The repair call after finish can fail and be recovered like any call (it stays FINISHED)."""
    prompt, runs = clean
    runner = _run(tiny_model, prompt, "static", FaultPlan.of(DeviceFault(G, layer=2)), final_cache="all_outputs", max_retries=1)
    assert runner.output_ids == runs["static"].output_ids and runner.pending_tag is PendingTag.EMPTY
    assert runner.processed == len(prompt) + G and runner.num_retries == 1 and runner.finish_reason is FinishReason.LENGTH


def test_a_failed_repair_call_keeps_the_published_finish_reason(tiny_model, clean):
    """M3.10 "The first-output off-by-one" (the repair call is not another output decision), 0x06 (record every trigger,
    publish one reason): the repair call fails past its retries after length closed the output; device_error joins the
    triggers, length stays the finish reason (in the result and in both finish events), the repair is abandoned."""
    prompt, runs = clean
    sink = ListSink()
    runner = RequestRunner(tiny_model, request(prompt, G, cache="static", final_cache="all_outputs", max_retries=0), sink=sink,
                           faults=FaultPlan.of(DeviceFault(G))).run()
    assert runner.finish_reason is FinishReason.LENGTH and runner.ordered_triggers() == (FinishReason.DEVICE_ERROR, FinishReason.LENGTH)
    assert runner.output_ids == runs["static"].output_ids and runner.pending_tag is PendingTag.CLOSED_UNPROCESSED
    assert runner.processed == len(prompt) + G - 1 and runner.terminal() and not runner.repair_owed()
    assert runner.result().finish_reason is FinishReason.LENGTH
    finishes = [r for r in sink.records if r["event"] == "finish"]
    assert [f["finish_reason"] for f in finishes] == ["length", "length"] and finishes[-1]["triggers"] == ["device_error", "length"]
    assert validate_trace(sink.lines()).accepted


@pytest.mark.parametrize("reason", [FinishReason.CANCELLED, FinishReason.TIMEOUT])
def test_a_cancel_or_timeout_during_the_repair_call_lands(tiny_model, clean, reason):
    """M3.10 0x02 branch table (cancellation/timeout in flight: await, ALL_OLD): an interrupt during the repair call after
    the close lands on it (interrupt point in_flight); the call selects ALL_OLD, the repair is abandoned, and the reason
    joins the triggers without rewriting the published finish reason."""
    prompt, runs = clean
    runner = _run(tiny_model, prompt, "static", FaultPlan.of(Interrupt(reason, G, InterruptPoint.IN_FLIGHT)), final_cache="all_outputs")
    assert runner.finish_reason is FinishReason.LENGTH and set(runner.triggers) == {FinishReason.LENGTH, reason}
    assert runner.output_ids == runs["static"].output_ids and runner.processed == len(prompt) + G - 1
    assert runner.terminal() and runner.quarantined and runner.num_calls == G + 1
    direct = RequestRunner(tiny_model, request(prompt, G, cache="static", final_cache="all_outputs"))
    while not direct.repair_owed():
        direct.step()
    direct.launch()
    assert direct.cancel(reason) is InterruptPoint.IN_FLIGHT
    with pytest.raises(Rejection):
        direct.cancel(reason)  # once per call
    direct.complete()
    assert direct.finish_reason is FinishReason.LENGTH and direct.terminal()
