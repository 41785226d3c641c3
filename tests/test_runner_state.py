"""The runner's state as one frozen record (issue 17 item 5): :class:`decodespec.impl.values.RunnerState`.

:meth:`RequestRunner.state` reads it, snapshots are taken from it and a restored runner adopts one;
its field names are the spec's ``RequestState`` names except the four the composed request keeps
(:class:`decodespec.spec.request_machine.ComposedState`: ``policy_state``, ``logprobs``,
``decision``) and one the runtime alone has (``receipts``: the M3.8 receipt documents).
"""

from __future__ import annotations

import attrs
import pytest

from decodespec.impl.runtime import RequestRunner
from decodespec.impl.values import RunnerState
from decodespec.spec.request_machine import ComposedState
from decodespec.spec.state import Phase, RequestState

from .runtime_helpers import request, sampled_policy


def started(model, tokenizer, outputs: int) -> RequestRunner:
    """A sampled 6-token request on ``model``, admitted and advanced to ``outputs`` commits."""
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("frontiers")]
    runner = RequestRunner(model, request(prompt, 6, policy=sampled_policy()))
    runner.admit()
    advance(runner, outputs)
    return runner


def advance(runner: RequestRunner, outputs: int) -> None:
    """Step ``runner`` until it has committed ``outputs`` tokens and launched nothing since."""
    while len(runner.output_ids) < outputs or runner.phase is not Phase.READY:
        runner.step()


def test_field_names_are_the_specs():
    spec = {f.name for f in attrs.fields(RequestState)} | {f.name for f in attrs.fields(ComposedState)}
    runner_only = {f.name for f in attrs.fields(RunnerState)} - spec
    assert runner_only == {"receipts"}


def test_state_is_frozen_and_round_trips(tiny_model, byte_tokenizer):
    runner = started(tiny_model, byte_tokenizer, 3)
    state = runner.state()
    assert state.phase is Phase.READY and len(state.output_ids) == 3 and state.output_ids == tuple(runner.output_ids)
    assert state.policy_state.rng_counter == 3 and len(state.consumed) == len(state.receipts) == 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.processed = 0  # type: ignore[misc]
    advance(runner, 4)
    assert runner.state().output_ids != state.output_ids and state.output_ids == tuple(runner.output_ids[:3])  # a copy, not a view
    other = RequestRunner(tiny_model, runner.request)
    other.adopt_state(state)
    again = other.state()
    for field in attrs.fields(RunnerState):
        assert getattr(again, field.name) == getattr(state, field.name), field.name
    assert isinstance(other.output_ids, list) and isinstance(other.triggers, set)


def test_a_snapshot_restores_the_same_state(tiny_model, byte_tokenizer):
    runner = started(tiny_model, byte_tokenizer, 2)
    before = runner.state()
    restored = RequestRunner.restore(tiny_model, runner.snapshot("pending_suffix"))
    after = restored.state()
    for name in ("phase", "processed", "output_ids", "logprobs", "pending_ids", "pending_tag", "generation", "issued", "scores",
                 "policy_state", "finish_reason", "triggers", "num_calls", "num_retries"):
        assert getattr(after, name) == getattr(before, name), name
    assert [d.receipt_id for d in after.consumed] == [d.receipt_id for d in before.consumed]
