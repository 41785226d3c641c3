"""``decodespec validate-trace`` refuses a beam-search trace with ``trace.unsupported`` (exit 2).

A beam trace (``decodespec generate --num-beams K --trace FILE``, written by ``BeamRunner``) has
a ``request`` header carrying ``beam`` (the ``BeamParams``) instead of ``params`` and one
``beam_step`` event per ``transition.beam_step``; the events record parents, tokens and scores
but not the score rows the spec's beam step selects from, so trace validation cannot replay it.
It used to be reported as a malformed header (``KeyError: 'params'``, exit 1); it is now a typed
refusal naming what is unsupported, before any line is judged.  A single-path trace whose lines
include a ``beam_step`` event is still a rejected trace (exit 1), not an unsupported one.

Source: docs/design.md section 6 (``decodespec.events.v1``, ``beam_step``).
"""

from __future__ import annotations

import json

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import TRACE_UNSUPPORTED, unsupported_trace, validate_trace
from decodespec.impl.events import read_events
from decodespec.spec.errors import Rejection

GENERATE = ["generate", "--model", "tiny", "--prompt", "beams", "--max-new-tokens", "3", "--device", "cpu"]


def test_beam_trace_is_refused_as_unsupported_with_exit_code_2(capsys, tmp_path):
    """transition.beam_step: validate-trace on a beam trace exits 2 with trace.unsupported naming beam search."""
    path = tmp_path / "beam.ndjson"
    assert main([*GENERATE, "--num-beams", "2", "--trace", str(path)]) == 0
    lines = read_events(path)
    assert json.loads(lines[1])["event"] == "beam_step" and "params" not in json.loads(lines[0])
    capsys.readouterr()
    assert main(["validate-trace", str(path)]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.err)["error"]
    assert error["code"] == TRACE_UNSUPPORTED == "trace.unsupported" and "beam" in error["message"]
    assert captured.out == ""  # no verdict: nothing was judged
    with pytest.raises(Rejection) as info:
        validate_trace(lines)
    assert info.value.code == TRACE_UNSUPPORTED and info.value.details["feature"] == "beam"


def test_single_path_traces_are_not_unsupported(capsys, tmp_path):
    """A greedy trace still validates (exit 0); a beam_step line inside it is a rejected line (exit 1)."""
    path = tmp_path / "greedy.ndjson"
    assert main([*GENERATE, "--trace", str(path)]) == 0
    lines = read_events(path)
    assert unsupported_trace(lines[0]) is None and validate_trace(lines).accepted
    capsys.readouterr()
    assert main(["validate-trace", str(path)]) == 0
    records = [json.loads(line) for line in lines]
    records.insert(1, {"v": 1, "seq": 1, "event": "beam_step", "step": 0, "parents": [0], "tokens": [5], "scores": [-1.0],
                       "completed": []})
    for index, rec in enumerate(records):
        rec["seq"] = index
    verdict = validate_trace(records)
    assert not verdict.accepted and verdict.line == 2 and verdict.event == "beam_step"
    # a header that only names the beam policy family is a beam trace too; a non-request first line is left to validation
    assert unsupported_trace({**records[0], "policy": {"family": "beam"}}) is not None
    assert unsupported_trace({"event": "commit", "beam": {}}) is None and unsupported_trace("not json") is None
