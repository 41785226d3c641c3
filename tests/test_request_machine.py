"""The composed request in spec/ (issue 17 item 1): one frozen state, pure steps, and the oracle a foreign runtime calls.

:mod:`decodespec.spec.request_machine` composes M3.10's machine, M3.8's policy state and the stop/stream
reference; :mod:`decodespec.spec.oracle` replays a runtime's score rows and decisions through it.  The
rows here are our runtime's real rows on the tiny model (``impl`` never calls the spec: the oracle
judges it from outside), recorded by :func:`decodespec.checks.modelcheck.judge.record_rows`; each bug is one edit
of a recorded decision, and the oracle must name the first broken step and the check.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from decodespec.checks.modelcheck.judge import record_rows
from decodespec.checks.modelcheck.trace_validation import token_bytes_of
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.spec import request_machine as rm
from decodespec.spec.actions import Cancel
from decodespec.spec.enums import FinishReason
from decodespec.spec.envelope import validate_request_envelope
from decodespec.spec.errors import DecodeSpecError
from decodespec.spec.oracle import ObservedDecision, replay_decisions
from decodespec.spec.policy import policy_config_from_json
from decodespec.spec.state import Phase

REPO = Path(__file__).resolve().parents[1]
TINY_ENVELOPE = json.loads((REPO / "docs" / "examples" / "tiny.request.json").read_text())


def envelope(*, policy: dict[str, Any] | None = None, eos: list[int] | None = None, max_new_tokens: int = 8,
             stop_strings: list[str] | None = None) -> dict[str, Any]:
    env = copy.deepcopy(TINY_ENVELOPE)
    env["policy"] = policy or {"family": "greedy"}
    env["termination"].update(max_new_tokens=max_new_tokens, stop_strings=stop_strings or [], eos_ids=sorted({2, *(eos or [])}))
    env["runtime"].update(cache_family="dynamic", prefill_chunk=8)
    env["runtime"].pop("static_capacity")
    env["output"].update(stream=False, final_cache="none", alignment="token")
    return env


def run(tiny_model, byte_tokenizer, env: dict[str, Any]) -> tuple[rm.Request, list[ObservedDecision], dict[str, Any]]:
    """Our runtime's run of ``env``: the spec request, its decisions (rows, ids, logprobs) and the finish line."""
    admitted, _ = validate_request_envelope(json.dumps(env).encode())
    runner = RequestRunner(tiny_model, RuntimeRequest.from_admitted(admitted), tokenizer=byte_tokenizer)
    lines = record_rows(runner, runtime={"name": "impl", "model": "tiny", "dtype": "float32"})
    decisions = [ObservedDecision(np.asarray(r["row"]), r["token_id"], r["logprob"]) for r in lines if r["event"] == "token"]
    return rm.request_from_envelope(admitted), decisions, lines[-1]


@pytest.fixture(scope="module")
def greedy(tiny_model, byte_tokenizer):
    return run(tiny_model, byte_tokenizer, envelope())


@pytest.fixture(scope="module")
def sampled(tiny_model, byte_tokenizer):
    return run(tiny_model, byte_tokenizer, envelope(policy={"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 1.5}]}))


def test_the_runtimes_own_runs_replay_without_a_breach(greedy, sampled, byte_tokenizer):
    for request, decisions, finish in (greedy, sampled):
        result = replay_decisions(request, decisions, finish_reason=finish["finish_reason"], token_bytes=token_bytes_of(byte_tokenizer),
                                  logprob_atol=1e-4)
        assert result.ok, result.breach
        assert list(result.output_ids) == finish["output_ids"] and result.finish_reason == finish["finish_reason"] == "length"
        assert len(result.logprobs) == len(decisions) == 8
        assert result.logprobs == pytest.approx([d.logprob for d in decisions], abs=1e-4)


def test_another_id_is_the_first_breach(greedy, sampled):
    for request, decisions, _ in (greedy, sampled):
        bad = list(decisions)
        wrong = (bad[3].token_id + 1) % request.params.vocab_size
        bad[3] = attrs.evolve(bad[3], token_id=wrong)
        breach = replay_decisions(request, bad, logprob_atol=1e-4).breach
        assert breach is not None and (breach.step, breach.check, breach.actual) == (3, "decision.selected_id", wrong)
        assert breach.expected == decisions[3].token_id


def test_the_row_decides_not_the_recorded_id(greedy):
    """Swapping the argmax of one row (the runtime decided on a row whose argmax is another id) is a breach at that row."""
    request, decisions, _ = greedy
    bad = list(decisions)
    row = np.array(bad[2].row, dtype=np.float64)
    other = int(np.argsort(row)[-2])
    row[other] = row.max() + 1.0
    bad[2] = attrs.evolve(bad[2], row=row)
    breach = replay_decisions(request, bad).breach
    assert breach is not None and (breach.step, breach.check, breach.expected, breach.actual) == (2, "decision.selected_id", other,
                                                                                                  decisions[2].token_id)


def test_sequence_breaches(greedy):
    request, decisions, _ = greedy
    missing = replay_decisions(request, decisions[:-1], logprob_atol=1e-4).breach
    assert missing is not None and (missing.step, missing.check) == (7, "sequence.missing_decision")
    extra = replay_decisions(request, decisions + [decisions[-1]], logprob_atol=1e-4).breach
    assert extra is not None and (extra.step, extra.check) == (8, "sequence.extra_decision")
    reason = replay_decisions(request, decisions, finish_reason="eos", logprob_atol=1e-4).breach
    assert reason is not None and (reason.check, reason.expected, reason.actual) == ("sequence.finish_reason", "length", "eos")
    logprob = replay_decisions(request, [attrs.evolve(decisions[0], logprob=decisions[0].logprob + 0.01)] + decisions[1:],
                               logprob_atol=1e-4).breach
    assert logprob is not None and (logprob.step, logprob.check) == (0, "decision.logprob")
    shape = replay_decisions(request, [attrs.evolve(decisions[0], row=decisions[0].row[:-1])]).breach
    assert shape is not None and (shape.step, shape.check) == (0, "decision.row_shape")


def test_a_missed_eos_is_an_extra_decision(tiny_model, byte_tokenizer, greedy):
    """Declare an output id (its first occurrence at index >= 2) an EOS id: the spec finishes there, so the run that ignored it breaks
    at its next decision."""
    _, decisions, finish = greedy
    out = finish["output_ids"]
    first = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    eos = out[first]
    request, eos_decisions, eos_finish = run(tiny_model, byte_tokenizer, envelope(eos=[eos]))
    assert eos_finish["finish_reason"] == "eos" and len(eos_decisions) == first + 1
    assert replay_decisions(request, eos_decisions, finish_reason="eos", logprob_atol=1e-4).ok
    breach = replay_decisions(request, decisions, logprob_atol=1e-4).breach  # the run that ignored the EOS id
    assert breach is not None and (breach.step, breach.check) == (first + 1, "sequence.extra_decision")


def test_stop_strings_and_text(tiny_model, byte_tokenizer, greedy):
    """A stop string cut from the greedy text: the spec finishes at the commit that completes it and returns the text before it."""
    _, _, finish = greedy
    tb = token_bytes_of(byte_tokenizer)
    text = b"".join(tb(t) for t in finish["output_ids"]).decode("utf-8", errors="replace")
    stop = text[3:5]
    request, decisions, stop_finish = run(tiny_model, byte_tokenizer, envelope(stop_strings=[stop]))
    assert stop_finish["finish_reason"] == "stop_string"
    want = text[:text.index(stop)]
    assert replay_decisions(request, decisions, finish_reason="stop_string", text=want, token_bytes=tb, logprob_atol=1e-4).ok
    breach = replay_decisions(request, decisions, text=want + "x", token_bytes=tb, logprob_atol=1e-4).breach
    assert breach is not None and breach.check == "sequence.text" and breach.expected == want
    with pytest.raises(ValueError):
        replay_decisions(request, decisions)  # stop strings need the token bytes


def test_steps_are_pure_and_refusals_change_nothing(greedy):
    request, decisions, _ = greedy
    state = rm.admit(request)
    assert rm.next_action(request, state) == "launch"
    launched = rm.launch(request, state)
    assert state.machine.phase is Phase.READY and state.call is None and launched.call is not None and launched.call.kind.value == "prefill"
    with pytest.raises(DecodeSpecError):
        rm.commit(request, launched)  # nothing decided
    with pytest.raises(DecodeSpecError):
        rm.choose(request, launched, decisions[0].row)  # no score row yet
    while rm.next_action(request, launched) != "decide":
        launched = (rm.launch if rm.next_action(request, launched) == "launch" else rm.complete)(request, launched)
    choice = rm.choose(request, launched, decisions[0].row)
    assert choice is not None and choice.token == decisions[0].token_id
    decided = rm.decide(request, launched, choice)
    assert decided.pending_logprob is not None and launched.pending_logprob is None and decided.decision is not None
    cancelled = rm.apply(request, decided, Cancel(FinishReason.CANCELLED))
    # A cancel after the decision drops the pending decision with the receipt (exactly once: never output).
    assert cancelled.machine.finish_reason is FinishReason.CANCELLED and cancelled.pending_logprob is None
    assert cancelled.decision is None and cancelled.logprobs == () and decided.machine.receipt is not None
    committed = rm.commit(request, decided)
    assert committed.output_ids == (choice.token,) and committed.committed_decision is decided.decision
    assert committed.policy_state is decided.pending_policy_state and committed.logprobs == (decided.pending_logprob,)


def test_admission_refusals(greedy):
    request, _, _ = greedy
    p = request.params
    assert rm.admission_refusal(p, request.prompt_ids, None) is None
    assert rm.admission_refusal(p, request.prompt_ids + (p.vocab_size,), None).code == "runtime.invalid_request"
    assert rm.admission_refusal(p, request.prompt_ids, p.prompt_len).code == "model.context_window_exceeded"
    assert rm.admission_refusal(p, request.prompt_ids, p.prompt_len + 1) is None
    zero = attrs.evolve(p, max_new_tokens=0, zero_new_tokens="reject")
    assert rm.admission_refusal(zero, request.prompt_ids, None).code == "envelope.zero_new_tokens_rejected"
    small = attrs.evolve(p, cache_family="static", static_capacity=p.prompt_len)
    assert rm.admission_refusal(small, request.prompt_ids, None).code == "cache.capacity_exceeded"
    assert rm.admission_refusal(attrs.evolve(small, static_capacity=p.prompt_len + 1), request.prompt_ids, None) is None


def test_min_new_tokens_is_the_policys_legality_transform(greedy):
    request, _, _ = greedy
    plain = policy_config_from_json({"family": "greedy"})
    with_min = rm.compose(attrs.evolve(request.params, min_new_tokens=2), plain, prompt_ids=request.prompt_ids)
    without = rm.compose(attrs.evolve(request.params, min_new_tokens=0), plain, prompt_ids=request.prompt_ids)
    assert [t.name for t in with_min.policy.transforms] == ["min_new_tokens"] and without.policy is plain
    assert with_min.stop.min_new_tokens == 2


def test_the_adapters_guide_oracle_example_runs_as_written():
    """docs/adapters.md "The oracle from Python": the code block runs from the repository root and prints what the guide shows."""
    guide = (REPO / "docs" / "adapters.md").read_text(encoding="utf-8")
    section = guide[guide.index("## The oracle from Python"):guide.index("## Reading a failure")]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("```")]
    shown = section[section.index("```text\n") + 8:]
    shown = shown[:shown.index("```")]
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown


@pytest.mark.parametrize("runtime_plane, output_plane, max_new_tokens", [
    ({"cache_family": "none", "cache_abi": "none"}, {"final_cache": "none"}, 5),
    ({"cache_family": "static", "static_capacity": 64, "prefill_chunk": 3}, {"final_cache": "processed_inputs_only"}, 5),
    ({"cache_family": "dynamic", "prefill_chunk": 8}, {"final_cache": "all_outputs"}, 5),  # the repair call at finish
    ({"cache_family": "dynamic", "prefill_chunk": 8}, {"final_cache": "processed_inputs_only"}, 0),  # G = 0: no decision
])
def test_every_cache_family_and_schedule_replays(tiny_model, byte_tokenizer, runtime_plane, output_plane, max_new_tokens):
    """The oracle makes the same calls due as our runtime (chunked prefill, no cache, the repair call, G = 0) and accepts its run."""
    env = envelope(max_new_tokens=max_new_tokens)
    env["runtime"].pop("prefill_chunk", None)
    env["runtime"].update(runtime_plane)
    env["output"].update(output_plane)
    env["termination"]["min_new_tokens"] = min(env["termination"].get("min_new_tokens", 0), max_new_tokens)
    admitted, _ = validate_request_envelope(json.dumps(env).encode())
    runner = RequestRunner(tiny_model, RuntimeRequest.from_admitted(admitted), tokenizer=byte_tokenizer)
    lines = record_rows(runner, runtime={"name": "impl", "model": "tiny", "dtype": "float32"})
    decisions = [ObservedDecision(np.asarray(r["row"]), r["token_id"], r["logprob"]) for r in lines if r["event"] == "token"]
    request = rm.request_from_envelope(admitted)
    result = replay_decisions(request, decisions, finish_reason=lines[-1]["finish_reason"], logprob_atol=1e-4)
    assert result.ok, result.breach
    assert len(decisions) == max_new_tokens and list(result.output_ids) == lines[-1]["output_ids"]
    calls = [(r["kind"], r["start"], r["length"]) for r in lines if r["event"] == "call"]
    state = result.state
    last = None if state.call is None else (state.call.kind.value, state.call.start, state.call.length)
    assert last == (calls[-1] if calls else None)  # the same last call (G = 0 under no_call: none)
    assert state.machine.num_calls == len(calls)
