"""The wall-clock budget ``termination.timeout_ms`` (issue 16 item 4): admission, the runner, the trace, the CLI.

The runner reads an injected clock, so no test here depends on real time except the CLI ones,
which only assert what holds for any timing (the request ends ``timeout`` with every committed
token kept).

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data" (wall/device budget plus
cancellation checkpoints), 0x02 branch table (cancellation/timeout before launch: no launch, no
logical mutation), "Finish reason and RNG precedence".
"""

from __future__ import annotations

import json

import attrs
import pytest
from runtime_helpers import renumber, request  # tests/ is on sys.path
from test_envelope import dumps, edit, tiny

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import validate_trace
from decodespec.impl.beam import BeamRunner
from decodespec.impl.events import ListSink
from decodespec.impl.runtime import INVALID_REQUEST, RequestRunner, RuntimeRequest
from decodespec.impl.snapshot import request_from_json, request_to_json
from decodespec.spec import envelope as E
from decodespec.spec.enums import FinishReason, PendingTag
from decodespec.spec.errors import DecodeSpecError
from decodespec.spec.policy import policy_config_from_json

#: Fake time per model call, in seconds (10 ms).
CALL_S = 0.010


def _per_call_clock(holder: dict):
    """A clock that advances 10 ms per model call the runner has launched (deterministic)."""
    return lambda: holder["runner"].num_calls * CALL_S


def _budget_run(model, prompt, budget_ms, *, sink=None, **changes):
    holder: dict = {}
    runner = RequestRunner(model, request(prompt, max_new_tokens=12, timeout_ms=budget_ms, **changes), sink=sink,
                           clock=_per_call_clock(holder))
    holder["runner"] = runner
    return runner.run()


@pytest.fixture(scope="module")
def prompt(byte_tokenizer):
    return [1, *byte_tokenizer.encode("budget")]


@pytest.fixture(scope="module")
def unbudgeted(tiny_model, prompt):
    return RequestRunner(tiny_model, request(prompt, max_new_tokens=12)).run()


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_budget_spent_after_k_calls_finishes_timeout_with_k_committed_tokens(tiny_model, prompt, unbudgeted, k):
    # The clock reads k * 10 ms once k calls ran; a budget of 10k - 5 ms is spent exactly then.
    runner = _budget_run(tiny_model, prompt, 10 * k - 5)
    result = runner.result()
    assert result.finish_reason is FinishReason.TIMEOUT and result.triggers == (FinishReason.TIMEOUT,)
    assert runner.num_calls == k and result.num_committed == k
    # Every committed token, logprob and receipt is kept: the prefix of the unbudgeted run.
    assert result.output_ids == unbudgeted.result().output_ids[:k]
    assert result.logprobs == unbudgeted.result().logprobs[:k]
    assert [r.receipt_id for r in result.receipts] == [r.receipt_id for r in unbudgeted.receipts[:k]]
    assert result.frontier == {"prompt_len": len(prompt), "output_count": k, "pending": 1, "processed": len(prompt) + k - 1,
                               "pending_tag": PendingTag.CLOSED_UNPROCESSED.value}


def test_a_budget_never_spent_changes_nothing(tiny_model, prompt, unbudgeted):
    runner = _budget_run(tiny_model, prompt, 10 * 13)  # 12 calls take 120 ms of fake time
    assert runner.finish_reason is FinishReason.LENGTH
    assert runner.result().output_ids == unbudgeted.result().output_ids


def test_a_budget_spent_before_the_first_launch_makes_no_call(tiny_model, prompt):
    readings = iter([0.0, 0.5])  # admission, then the first call boundary 500 ms later
    runner = RequestRunner(tiny_model, request(prompt, timeout_ms=100), clock=lambda: next(readings)).run()
    assert runner.finish_reason is FinishReason.TIMEOUT
    assert runner.num_calls == 0 and runner.output_ids == [] and runner.processed == 0


def test_without_a_budget_the_clock_is_never_read(tiny_model, prompt):
    def clock():
        raise AssertionError("read without a budget")

    assert RequestRunner(tiny_model, request(prompt), clock=clock).run().finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("value", [0, -1, E.MAX_TIMEOUT_MS + 1, 1.5, True, "10"])
def test_the_runtime_request_refuses_a_bad_budget(tiny_model, prompt, value):
    with pytest.raises(DecodeSpecError) as info:
        RequestRunner(tiny_model, request(prompt, timeout_ms=value))
    assert info.value.code == INVALID_REQUEST and info.value.path == "$.termination.timeout_ms"


def test_beam_search_refuses_a_budget(tiny_model, prompt):
    beam = policy_config_from_json({"family": "beam", "num_beams": 2})
    with pytest.raises(DecodeSpecError) as info:
        BeamRunner(tiny_model, request(prompt, policy=beam, timeout_ms=50))
    assert info.value.code == "runtime.beam_unsupported" and info.value.path == "$.termination.timeout_ms"


def test_a_snapshot_request_carries_the_budget(prompt):
    req = request(prompt, timeout_ms=250)
    assert request_from_json(request_to_json(req)).timeout_ms == 250
    old = request_to_json(request(prompt))
    del old["timeout_ms"]  # a snapshot written before the field existed: no budget
    assert request_from_json(old).timeout_ms is None


# -- the trace and its checker ----------------------------------------------------------------


def _budget_trace(tiny_model, prompt, k=3):
    sink = ListSink()
    _budget_run(tiny_model, prompt, 10 * k - 5, sink=sink)
    return [json.loads(line) for line in sink.lines()]


def test_the_budget_timeout_trace_is_accepted(tiny_model, prompt):
    records = _budget_trace(tiny_model, prompt)
    assert records[0]["timeout_ms"] == 25
    cancel = next(r for r in records if r["event"] == "cancel")
    assert cancel == {**cancel, "kind": "timeout", "at": "before_launch", "source": "budget", "elapsed_ms": 30}
    verdict = validate_trace(renumber(records))
    assert verdict.accepted, verdict.reason


def _tampered(records, fn):
    records = [dict(r) for r in records]
    fn(records)
    return validate_trace(renumber(records))


def _cancel(records):
    return next(r for r in records if r["event"] == "cancel")


@pytest.mark.parametrize("name, fn, why", [
    ("no budget declared", lambda rs: rs[0].pop("timeout_ms"), "declares no wall-clock budget"),
    ("budget not yet spent", lambda rs: _cancel(rs).update(elapsed_ms=24), "before its 25 ms were spent"),
    ("budget as a cancel", lambda rs: _cancel(rs).update(kind="cancelled"), "finishes 'timeout'"),
])
def test_a_budget_timeout_the_contract_does_not_allow_is_refused(tiny_model, prompt, name, fn, why):
    verdict = _tampered(_budget_trace(tiny_model, prompt), fn)
    assert not verdict.accepted and verdict.event == "cancel" and why in verdict.reason, (name, verdict.reason)


def test_a_budget_timeout_in_flight_is_refused(tiny_model, prompt):
    # Move the budget's cancel before the last completion: the runtime declares call boundaries only.
    records = _budget_trace(tiny_model, prompt)
    i = next(i for i, r in enumerate(records) if r["event"] == "cancel")
    j = max(n for n, r in enumerate(records[:i]) if r["event"] == "call_completed")
    records.insert(j, {**records.pop(i), "at": "in_flight"})
    verdict = validate_trace(renumber(records))
    assert not verdict.accepted and verdict.event == "cancel" and "call boundary" in verdict.reason


def test_a_timeout_that_drops_a_committed_token_is_refused(tiny_model, prompt):
    def drop(rs):
        finish = rs[-1]
        assert finish["event"] == "finish"
        finish["frontier"] = {**finish["frontier"], "output_count": finish["frontier"]["output_count"] - 1}

    verdict = _tampered(_budget_trace(tiny_model, prompt), drop)
    assert not verdict.accepted and verdict.event == "finish" and "output_count" in verdict.reason


def test_an_external_timeout_needs_no_budget(tiny_model, prompt):
    # A host's timeout interrupt (no 'source') is the spec's Cancel(timeout), enabled at every interrupt point.
    sink = ListSink()
    runner = RequestRunner(tiny_model, request(prompt, max_new_tokens=4), sink=sink)
    runner.run(max_outputs=2)
    runner.cancel(FinishReason.TIMEOUT)
    assert runner.finish_reason is FinishReason.TIMEOUT and len(runner.output_ids) == 2
    assert validate_trace(sink.lines()).accepted


# -- the envelope -------------------------------------------------------------------------------


def test_the_envelope_admits_a_budget_and_it_is_identity_bearing():
    plain, plain_id = E.validate_request_envelope(dumps(tiny()))
    budgeted, budget_id = E.validate_request_envelope(dumps(edit("termination.timeout_ms", 1500)(tiny())))
    assert plain.termination.timeout_ms is E.DEFAULT_TIMEOUT_MS is None
    assert budgeted.termination.timeout_ms == 1500 and RuntimeRequest.from_admitted(budgeted).timeout_ms == 1500
    assert budget_id != plain_id
    top, _ = E.validate_request_envelope(dumps(edit("termination.timeout_ms", E.MAX_TIMEOUT_MS)(tiny())))
    assert top.termination.timeout_ms == E.MAX_TIMEOUT_MS


@pytest.mark.parametrize("value, code", [
    (0, "envelope.out_of_range"),
    (-5, "envelope.out_of_range"),
    (E.MAX_TIMEOUT_MS + 1, "envelope.out_of_range"),
    (2**53, "envelope.out_of_range"),
    (1.5, "envelope.type_mismatch"),
    (10.0, "envelope.type_mismatch"),
    ("100", "envelope.type_mismatch"),
    (True, "envelope.type_mismatch"),
    (None, "envelope.type_mismatch"),
])
def test_the_envelope_refuses_a_budget_out_of_bounds_with_a_typed_error(value, code):
    with pytest.raises(DecodeSpecError) as info:
        E.validate_request_envelope(dumps(edit("termination.timeout_ms", value)(tiny())))
    assert info.value.code == code and info.value.path == "$.termination.timeout_ms"


# -- the CLI ------------------------------------------------------------------------------------


def test_cli_tiny_budget_ends_with_timeout_and_keeps_committed_tokens(capsys, tmp_path):
    trace = tmp_path / "t.trace"
    argv = ["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "4000", "--device", "cpu", "--json",
            "--timeout-ms", "1", "--trace", str(trace)]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["finish_reason"] == "timeout" and payload["triggers"] == ["timeout"]
    assert payload["num_committed"] == payload["frontier"]["output_count"] == len(payload["output_ids"]) < 4000
    assert len(payload["receipts"]) == payload["num_committed"]
    assert validate_trace(trace.read_text().splitlines()).accepted


@pytest.mark.parametrize("value", ["0", str(E.MAX_TIMEOUT_MS + 1)])
def test_cli_refuses_a_budget_out_of_range(capsys, value):
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--device", "cpu", "--timeout-ms", value]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "envelope.out_of_range" and error["path"] == "$.termination.timeout_ms"


def test_cli_budget_flag_conflicts_with_a_request_file(capsys):
    assert main(["generate", "--model", "tiny", "--request", "docs/examples/tiny.request.json", "--timeout-ms", "5"]) == 2
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "runtime.invalid_request" and "--timeout-ms" in error["message"]


def test_a_resumed_request_starts_a_fresh_budget_at_restore(tiny_model, prompt, unbudgeted):
    # Declared choice: the budget bounds one run; a restore is a new run with the same budget.
    holder: dict = {}
    runner = RequestRunner(tiny_model, request(prompt, max_new_tokens=12, timeout_ms=25), clock=_per_call_clock(holder))
    holder["runner"] = runner
    runner.run(max_outputs=2)
    assert runner.finish_reason is None and runner.output_count == 2
    snapshot = runner.snapshot("pending_suffix")
    assert snapshot.request.timeout_ms == 25
    readings = iter([100.0, 100.01, 100.02, 100.03])  # restore, then 10 ms per boundary: spent at the third boundary
    resumed = RequestRunner.restore(tiny_model, snapshot, clock=lambda: next(readings)).run()
    assert resumed.finish_reason is FinishReason.TIMEOUT
    assert resumed.output_count == 2 + 2 and resumed.output_ids == list(unbudgeted.output_ids[:4])


# -- the lock-step gate --------------------------------------------------------------------------
# The gate's case configs carry no budget: its timeouts are its own cancel{kind: timeout} actions,
# which both sides take.  A runtime that times out on its own there, or drops a committed token
# when it times out, must fail the lock step.


def _lockstep(runner_cls, actions):
    from decodespec.checks.adapters import CaseConfig
    from decodespec.checks.adapters.impl import ImplAdapter
    from decodespec.checks.gate.divergence import drive  # the gate's own driver (reset, then each action until a failure)

    config = CaseConfig(model="tiny", prompt_ids=(1, 40, 41, 42), max_new_tokens=6, seed=0)
    return drive(ImplAdapter(runner_cls=runner_cls), config, actions, "impl")


class _OwnBudget(RequestRunner):
    """A runtime that applies a budget the case never declared (spent after 2 calls of fake time)."""

    def __init__(self, model, req, **kwargs):
        super().__init__(model, attrs.evolve(req, timeout_ms=15), clock=lambda: self.num_calls * CALL_S, **kwargs)


class _DropsOnTimeout(RequestRunner):
    """A runtime whose timeout forgets the last committed token."""

    def cancel(self, kind=FinishReason.CANCELLED):
        at = super().cancel(kind)
        if FinishReason(kind) is FinishReason.TIMEOUT and self.output_ids:
            self.output_ids.pop()
            self.logprobs.pop()
        return at


def test_the_gate_accepts_its_own_timeout_with_every_committed_token(tiny_model):
    ls = _lockstep(RequestRunner, [{"op": "step"}, {"op": "step"}, {"op": "cancel", "kind": "timeout"}])
    assert not ls.failed and ls.spec.state.finish_reason is FinishReason.TIMEOUT and len(ls.spec.state.output_ids) == 2


def test_the_gate_refuses_a_timeout_without_a_budget(tiny_model):
    ls = _lockstep(_OwnBudget, [{"op": "run"}])
    # The runtime finished timeout after 2 calls; the spec (no budget declared) ran on: STATE fails.
    assert ls.failed and ls.verdict.layer == "STATE" and ls.observation.finish_reason == "timeout"
    assert ls.spec.state.finish_reason is FinishReason.LENGTH


def test_the_gate_refuses_a_timeout_that_drops_a_committed_token(tiny_model):
    ls = _lockstep(_DropsOnTimeout, [{"op": "step"}, {"op": "step"}, {"op": "cancel", "kind": "timeout"}])
    assert ls.failed and ls.verdict.layer == "STATE" and ls.verdict.check == "output_ids"
