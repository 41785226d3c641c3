"""Trace validation: every trace the runtime writes is accepted; hand-broken traces are rejected at the right line.

docs/design.md section 6 (``decodespec.events.v1``): :func:`decodespec.checks.modelcheck.trace_validation.validate_trace`
replays each event as a spec action (rules ``transition.launch_*``, ``transition.complete_all_new`` /
``transition.complete_all_old``, ``transition.decide``, ``transition.commit``,
``transition.interrupt_*``, ``transition.recover``, ``transition.snapshot``, ``transition.restore``)
and checks every stated field against the spec's successor state.
"""

from __future__ import annotations

import json

import pytest
from runtime_helpers import renumber, request, sampled_policy  # tests/ is on sys.path

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import validate_trace
from decodespec.impl.events import ListSink
from decodespec.impl.faults import DeviceFault, FaultPlan, Interrupt, MissingLane
from decodespec.impl.observers import CommitObservation, NullObserver
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import FinishReason
from decodespec.spec.state import InterruptPoint

CASES = {
    "greedy": {},
    "sampled": {"policy": sampled_policy()},
    "chunked": {"prefill_chunk": 3},
    "static": {"cache": "static", "prefill_chunk": 4},
    "no-cache": {"cache": "none"},
    "repaired": {"final_cache": "all_outputs"},
    "g0-no-call": {"max_new_tokens": 0},
    "g0-prefill-only": {"max_new_tokens": 0, "zero_new_tokens": "prefill_only"},
    "cancelled": {"faults": FaultPlan.of(Interrupt(FinishReason.CANCELLED, 2, InterruptPoint.IN_FLIGHT))},
    "timeout": {"faults": FaultPlan.of(Interrupt(FinishReason.TIMEOUT, 1, InterruptPoint.AFTER_DECISION))},
    "device-fault": {"faults": FaultPlan.of(DeviceFault(2, layer=1))},
    "missing-lane-retried": {"cache": "static", "max_retries": 1, "faults": FaultPlan.of(MissingLane(1, layer=3))},
    "repair-faulted-retried": {"final_cache": "all_outputs", "max_retries": 2, "faults": FaultPlan.of(DeviceFault(5), DeviceFault(6))},
}


def _trace(model, prompt, **kwargs) -> tuple[RequestRunner, list[str]]:
    sink = ListSink()
    faults = kwargs.pop("faults", None)
    observer = kwargs.pop("observer", None)
    kwargs.setdefault("max_new_tokens", 5)
    runner = RequestRunner(model, request(prompt, **kwargs), sink=sink, faults=faults, observer=observer).run()
    return runner, sink.lines()


@pytest.fixture(scope="module")
def prompt(byte_tokenizer):
    return [1, *byte_tokenizer.encode("trace")]


@pytest.mark.parametrize("name", list(CASES))
def test_every_runtime_trace_is_accepted(tiny_model, prompt, name):
    _runner, lines = _trace(tiny_model, prompt, **dict(CASES[name]))
    verdict = validate_trace(lines)
    assert verdict.accepted, verdict
    assert verdict.consumed == len(lines) and verdict.final_phase == "finished"
    assert json.loads(lines[-1])["event"] == "finish"


def test_a_stop_string_trace_is_accepted(tiny_model, prompt):
    class Stop(NullObserver):
        def observe(self, token_id, logprob, output_index):
            return CommitObservation(frozenset({FinishReason.STOP_STRING}) if output_index == 1 else frozenset())

    runner, lines = _trace(tiny_model, prompt, stop_strings=("x",), observer=Stop())
    assert runner.finish_reason is FinishReason.STOP_STRING and validate_trace(lines).accepted


def test_suspended_and_resumed_traces_are_accepted(tiny_model, prompt):
    first_sink, second_sink = ListSink(), ListSink()
    req = request(prompt, 5, cache="static", policy=sampled_policy())
    snapshot = RequestRunner(tiny_model, req, sink=first_sink).run(max_outputs=2).snapshot("repaired")
    RequestRunner.restore(tiny_model, snapshot, sink=second_sink).run()
    first, second = validate_trace(first_sink.lines()), validate_trace(second_sink.lines())
    assert first.accepted and first.final_phase == "scored"
    assert second.accepted and second.final_phase == "finished"
    assert [json.loads(line)["event"] for line in second_sink.lines()[:3]] == ["request", "restore", "decision"]
    assert not validate_trace(first_sink.lines()[:-1]).accepted  # without the snapshot line it just stops


def _records(lines):
    return [json.loads(line) for line in lines]


def _index(records, event, nth=0, **match):
    hits = [i for i, r in enumerate(records) if r["event"] == event and all(r.get(k) == v for k, v in match.items())]
    return hits[nth]


def _broken(tiny_model, prompt, edit, **kwargs):
    _, lines = _trace(tiny_model, prompt, **kwargs)
    records = _records(lines)
    line = edit(records)
    verdict = validate_trace(renumber(records))
    assert not verdict.accepted
    return verdict, line


def test_commit_without_a_score_is_rejected(tiny_model, prompt):
    def edit(records):
        i = _index(records, "decision", 1)
        del records[i]
        return i + 1  # the commit now sits at line i + 1
    verdict, line = _broken(tiny_model, prompt, edit)
    assert (verdict.line, verdict.event) == (line, "commit") and "phase == DECIDED" in verdict.reason


def test_a_duplicated_commit_is_rejected(tiny_model, prompt):
    def edit(records):
        i = _index(records, "commit", 0)
        records.insert(i + 1, dict(records[i]))
        return i + 2
    verdict, line = _broken(tiny_model, prompt, edit)
    assert (verdict.line, verdict.event) == (line, "commit") and "transition.commit" in verdict.reason


def test_a_frontier_that_jumps_is_rejected(tiny_model, prompt):
    def edit(records):
        i = _index(records, "call_launched", 0, kind="decode")
        start = records[i]["cache_position"][0] + 1
        records[i].update(cache_position=[start], position_ids=[start])
        return i + 1
    verdict, line = _broken(tiny_model, prompt, edit)
    assert (verdict.line, verdict.event) == (line, "call_launched") and "start == expected start" in verdict.reason


def test_p_advanced_on_all_old_is_rejected(tiny_model, prompt):
    def edit(records):
        i = _index(records, "call_completed", 0, selection="ALL_OLD")
        records[i]["frontier_after"]["processed"] += 1
        return i + 1
    verdict, line = _broken(tiny_model, prompt, edit, faults=FaultPlan.of(DeviceFault(2)))
    assert (verdict.line, verdict.event) == (line, "call_completed") and "frontier_after" in verdict.reason


def test_a_decode_launched_after_finish_is_rejected(tiny_model, prompt):
    def edit(records):
        launch = dict(records[_index(records, "call_launched", 0, kind="decode")])
        records.append(launch)
        return len(records)
    verdict, line = _broken(tiny_model, prompt, edit)
    assert (verdict.line, verdict.event) == (line, "call_launched") and "phase finished" in verdict.reason


def test_a_missing_logprob_is_rejected(tiny_model, prompt):
    def edit(records):
        i = _index(records, "decision", 2)
        del records[i]["logprob"]
        return i + 1
    verdict, line = _broken(tiny_model, prompt, edit)
    assert (verdict.line, verdict.event) == (line, "decision") and "logprob" in verdict.reason


def test_wrong_input_ids_and_early_end_and_seq_gaps_are_rejected(tiny_model, prompt):
    _, lines = _trace(tiny_model, prompt)
    records = _records(lines)
    i = _index(records, "call_launched", 1, kind="decode")
    records[i]["input_ids"] = [records[i]["input_ids"][0] + 1]
    verdict = validate_trace(renumber(records))
    assert (verdict.line, verdict.event) == (i + 1, "call_launched") and "input_ids" in verdict.reason
    early = validate_trace(lines[:-3])
    assert not early.accepted and early.line == len(lines) - 2 and "ends before the request is terminal" in early.reason
    gap = validate_trace(lines[:4] + lines[5:])
    assert not gap.accepted and gap.line == 5 and "seq" in gap.reason
    assert validate_trace([]).reason == "empty trace: no request header"


def test_cli_validate_trace(tiny_model, prompt, tmp_path, capsys):
    path = tmp_path / "t.ndjson"
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu", "--cache", "static",
                 "--prefill-chunk", "2", "--trace", str(path)]) == 0
    capsys.readouterr()
    assert main(["validate-trace", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] is True
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    assert main(["validate-trace", str(path)]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["accepted"] is False and verdict["line"] == 3
    assert main(["validate-trace", str(tmp_path / "absent.ndjson")]) == 2
