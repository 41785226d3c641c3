"""Checks written against the survivors of the sampled Cosmic Ray session on ``impl/runtime.py``.

Each test's docstring names the mutants it kills (``line operator occurrence``, line numbers of
``impl/runtime.py`` at commit 61ec8ad).  The screen (``checks/lab/mutation/runtime.toml``) runs the
runner's own tests and the gate case table on tiny; what it did not reach: budgets spent exactly
at a call boundary.

Source: docs/results/mutation-sampled-runtime-snapshot-model.md (issue 15 item 5); M3.10 0x06.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from runtime_helpers import request, sampled_policy  # tests/ is on sys.path

from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import CallKind, FinishReason
from decodespec.spec.errors import Rejection

PROMPT = (1, 70, 71, 72)


@pytest.mark.parametrize("spent_ms, finished", [(99, False), (100, True), (101, True)])
def test_a_budget_is_spent_when_the_elapsed_time_reaches_it(tiny_model, spent_ms, finished):
    """``timeout_ms = 100``: at the first call boundary 100 ms after admission the budget is spent (``elapsed >= budget``).

    Kills 950 ``ReplaceComparisonOperator_Lt_LtE`` 4 (spent only past the budget).
    """
    readings = itertools.chain([0.0], itertools.repeat(spent_ms / 1000))  # admission, then every later reading
    runner = RequestRunner(tiny_model, request(PROMPT, 3, timeout_ms=100), clock=lambda: next(readings)).run()
    assert runner.budget_elapsed_ms() == spent_ms
    if finished:
        assert runner.finish_reason is FinishReason.TIMEOUT and runner.num_calls == 0 and runner.output_ids == []
    else:
        assert runner.finish_reason is FinishReason.LENGTH and runner.output_count == 3


@pytest.mark.parametrize("length", [3, 4])
def test_a_prefill_chunk_past_the_remaining_prompt_is_not_enabled(tiny_model, length):
    """Chunked prefill (chunk 6, ``L = 8``): after 6 rows only 2 remain, so a launch of 3 or 4 rows is ``transition.not_enabled``.

    Nothing changes: the runner then prefills the last 2 rows and decodes as a run never refused.
    Kills 459 ``ReplaceBinaryOperator_Sub_BitXor`` 0 (``8 ^ 6 = 14`` rows allowed).
    """
    prompt = (1, 70, 71, 72, 73, 74, 75, 76)
    full = RequestRunner(tiny_model, request(prompt, 3, cache="dynamic", prefill_chunk=6)).run()  # chunks of 6 and 2
    runner = RequestRunner(tiny_model, request(prompt, 3, cache="dynamic", prefill_chunk=6))
    runner.admit()
    runner.launch(CallKind.PREFILL, length=6)
    runner.complete()
    assert runner.processed == 6
    with pytest.raises(Rejection) as info:
        runner.launch(CallKind.PREFILL, length=length)
    assert info.value.code == "transition.not_enabled" and info.value.details["rule"] == "transition.launch_prefill"
    assert runner.processed == 6 and runner.in_flight is None and runner.num_calls == 1
    runner.run()
    assert runner.output_ids == full.output_ids and runner.logprobs == full.logprobs


@pytest.mark.parametrize("shift", [1, -1])
def test_a_decision_that_read_another_rng_counter_is_not_committed(tiny_model, shift):
    """An adopted state whose RNG counter moved after the decision (either way) refuses the commit; nothing changes.

    Kills 746 ``ReplaceComparisonOperator_Eq_LtE`` 21 (a counter that moved forward accepted).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 3, policy=sampled_policy(), rng_counter_start=5))
    while runner.phase.value != "decided":
        runner.step()
    state = runner.state()
    assert state.decision.rng_counter_before == state.policy_state.rng_counter == 5
    moved = attrs.evolve(state, policy_state=attrs.evolve(state.policy_state, rng_counter=5 + shift))
    runner.adopt_state(moved)
    with pytest.raises(Rejection) as info:
        runner.commit()
    assert info.value.code == "transition.not_enabled" and info.value.details["guard"] == "receipt read the current RNG counter"
    after = runner.state()
    assert (after.phase, after.output_ids, after.policy_state, after.decision) == (moved.phase, moved.output_ids, moved.policy_state, moved.decision)


def _ready_with_one_pending(runner: RequestRunner) -> None:
    while not (runner.phase.value == "ready" and runner.output_count == 1):
        runner.step()


def test_a_launch_past_the_static_capacity_or_the_window_is_refused_and_named(tiny_model):
    """``launch``'s own guards, reached by adopting a state whose frontier sits at the capacity or the window edge.

    Admission and the context cap keep every honest run inside both bounds, so only an adopted
    state (``adopt_state`` trusts its caller) reaches them: the write ``[5, 6)`` past 5 reserved slots
    is ``cache.capacity_exceeded``, positions ``8..8`` past a window of 8 ``model.context_window_exceeded``,
    each quoting its range; nothing is launched.  Kills 463 ``ReplaceBinaryOperator_Add_BitOr`` 0,
    464 ``ReplaceBinaryOperator_Add_BitAnd`` 1 and ``ReplaceBinaryOperator_Add_BitXor`` 1, 468
    ``ReplaceBinaryOperator_Add_Mul`` 3.
    """
    from decodespec.impl.tiny import load_tiny, tiny_config
    from decodespec.spec.errors import ResourceLimit

    static = RequestRunner(tiny_model, request((1, 70, 71), 3, cache="static", static_capacity=5))
    _ready_with_one_pending(static)
    static.adopt_state(attrs.evolve(static.state(), processed=5))
    with pytest.raises(ResourceLimit) as info:
        static.launch()
    assert (info.value.code, info.value.path) == ("cache.capacity_exceeded", "$.cache_position")
    assert "write [5, 6) exceeds the 5 reserved slots" in str(info.value)
    assert static.in_flight is None and static.num_calls == 1
    small = load_tiny(seed=0, config=tiny_config(max_position_embeddings=8))
    window = RequestRunner(small, request((1, 70, 71), 3, cache="dynamic"))
    _ready_with_one_pending(window)
    window.adopt_state(attrs.evolve(window.state(), processed=8))
    with pytest.raises(ResourceLimit) as info:
        window.launch()
    assert (info.value.code, info.value.path) == ("model.context_window_exceeded", "$.position_ids")
    assert "positions 8..8 exceed the window 8" in str(info.value)
    assert window.in_flight is None and window.num_calls == 1


def test_a_runtime_error_on_the_cpu_is_a_bug_not_a_device_fault(tiny_model):
    """On the CPU a ``RuntimeError`` inside a model call propagates; it is not turned into a ``device_error`` finish.

    Kills 563 ``ReplaceComparisonOperator_Eq_NotEq`` 12.
    """

    def boom(module, args):
        raise RuntimeError("a shape bug")

    runner = RequestRunner(tiny_model, request(PROMPT, 3))
    handle = tiny_model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="a shape bug"):
            runner.run()
    finally:
        handle.remove()
    assert runner.finish_reason is None and runner.output_ids == []


def test_a_decision_on_a_score_of_an_older_generation_is_not_committed(tiny_model):
    """An adopted state whose generation moved past the decided score's refuses the commit (``receipt is bound to the current score``).

    Kills 744 ``ReplaceComparisonOperator_Eq_LtE`` 20 (an older score accepted).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 3))
    while runner.phase.value != "decided":
        runner.step()
    state = runner.state()
    runner.adopt_state(attrs.evolve(state, generation=state.generation + 1))
    with pytest.raises(Rejection) as info:
        runner.commit()
    assert info.value.code == "transition.not_enabled" and info.value.details["guard"] == "receipt is bound to the current score"
    assert runner.output_ids == []


def test_a_given_cache_of_another_family_is_refused(tiny_model):
    """A ``dynamic`` cache handed to a ``static`` request (``"dynamic" < "static"``) is ``runtime.invalid_request`` at ``$.runtime.cache_family``.

    Kills 249 ``ReplaceComparisonOperator_NotEq_Gt`` 0.
    """
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request(PROMPT, 3, cache="static", static_capacity=8), cache=tiny_model.new_cache())
    assert (info.value.code, info.value.path) == ("runtime.invalid_request", "$.runtime.cache_family")


def test_a_prompt_as_long_as_the_window_is_refused():
    """``L = window`` leaves no position for an output: ``model.context_window_exceeded`` at ``$.prompt_ids`` (``L = window - 1`` runs).

    Kills 1108 ``ReplaceComparisonOperator_GtE_Gt`` 3.
    """
    from decodespec.impl.tiny import load_tiny, tiny_config
    from decodespec.spec.errors import ResourceLimit

    small = load_tiny(seed=0, config=tiny_config(max_position_embeddings=8))
    with pytest.raises(ResourceLimit) as info:
        RequestRunner(small, request((1, *range(70, 77)), 2))
    assert (info.value.code, info.value.path) == ("model.context_window_exceeded", "$.prompt_ids")
    fits = RequestRunner(small, request((1, *range(70, 76)), 2)).run()
    assert fits.output_count == 1 and fits.finish_reason is FinishReason.CONTEXT_LENGTH


@pytest.mark.parametrize("bad", [True, False, "7", 7.0])
def test_a_prompt_id_that_is_not_an_int_is_refused(tiny_model, bad):
    """A bool, str or float prompt id is ``runtime.invalid_request`` at ``$.prompt_ids[1]`` (``True`` is not id 1).

    Kills 1105 ``ReplaceOrWithAnd`` 25.
    """
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request((1, bad, 70), 3))
    assert (info.value.code, info.value.path) == ("runtime.invalid_request", "$.prompt_ids[1]")


def test_the_result_text_of_a_decode_only_tokenizer_leaves_out_the_final_eos(tiny_model, byte_tokenizer):
    """Without an output observer (a tokenizer with ``decode`` only) the result's text decodes the outputs before the EOS.

    Kills 1002 ``ReplaceUnaryOperator_USub_Not`` 3 (the text cut to nothing).
    """

    class DecodeOnly:
        def decode(self, ids):
            return byte_tokenizer.decode(ids)

    eos = RequestRunner(tiny_model, request(PROMPT, 1)).run().output_ids[0]
    runner = RequestRunner(tiny_model, request(PROMPT, 6, eos_ids=frozenset({eos}), min_new_tokens=2), tokenizer=DecodeOnly()).run()
    ids = list(runner.output_ids)
    assert runner.finish_reason is FinishReason.EOS and ids[-1] == eos and len(ids) >= 3
    assert runner.result().text == byte_tokenizer.decode(ids[:-1]) != ""


def test_a_retried_repair_call_publishes_finish_once_more_only_when_it_completes(tiny_model):
    """``finish`` is emitted when the output closes and again when the owed repair call completes; a failed attempt in between emits none.

    Kills 533 ``ReplaceComparisonOperator_NotEq_GtE`` 4 (``triggers >= before`` always holds, so the
    failed attempt emitted a finish too).
    """
    from decodespec.impl.events import ListSink
    from decodespec.impl.faults import DeviceFault, FaultPlan

    sink = ListSink()
    runner = RequestRunner(tiny_model, request(PROMPT, 3, cache="static", final_cache="all_outputs", max_retries=1), sink=sink,
                           faults=FaultPlan.of(DeviceFault(3))).run()
    assert runner.finish_reason is FinishReason.LENGTH and runner.num_retries == 1 and not runner.repair_owed()
    assert [r["finish_reason"] for r in sink.records if r["event"] == "finish"] == ["length", "length"]


def test_a_length_bound_past_256_closes_the_output_there(tiny_model):
    """``max_new_tokens = 300``: the 300th commit fires ``length`` (counts compared by value, not identity).

    Kills 770 ``ReplaceComparisonOperator_GtE_Is`` 0 (``300 is 300`` is false for computed ints,
    so the run went on to the context bound).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 300, cache="dynamic")).run()
    assert runner.output_count == 300 and runner.finish_reason is FinishReason.LENGTH


def test_finished_is_true_exactly_in_the_finished_phase(tiny_model):
    """``RequestRunner.finished`` is False from admission through every call and decision, True once the output closed.

    Kills 330 ``ReplaceComparisonOperator_Is_GtE`` 0 and ``ReplaceComparisonOperator_Is_IsNot`` 3.
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 2))
    seen = []
    while True:
        seen.append((runner.phase.value, runner.finished))
        if runner.step() is None:
            break
    assert all(finished is (phase == "finished") for phase, finished in seen)
    assert {phase for phase, _ in seen} >= {"new", "ready", "in_flight", "scored", "decided", "finished"}
    assert seen[-1] == ("finished", True)
