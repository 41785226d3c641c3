"""The rows-in oracle (issue 22 item 5): a recording of the tiny model is accepted; each planted bug is caught at its ladder layer.

:func:`decodespec.checks.modelcheck.judge.judge_rows` judges a ``decodespec.rows.v1`` recording (request
envelope, score rows, decisions, frontiers) against the spec machine (STATE), the float64
reference (TENSOR, with a reference), the spec policy's draws (POLICY), the spec policy on the
observed row under the margin rule and the logprob bound (DECISION) and the finish
(SEQUENCE).  Every recording here is our runtime's real rows on the tiny model
(:func:`~decodespec.checks.modelcheck.judge.record_rows`); the bugs are edits of single lines.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.gate.lockstep import reference_for
from decodespec.checks.gate.tolerance import tolerance_for
from decodespec.checks.modelcheck.judge import (
    JUDGE_SCHEMA,
    JUDGE_UNREADABLE,
    JUDGE_UNSUPPORTED,
    ROWS_SCHEMA_PATH,
    judge_rows,
    read_rows,
    record_rows,
    write_rows,
)
from decodespec.checks.modelcheck.trace_validation import token_bytes_of
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.spec.enums import CallKind, FinishReason, PendingTag
from decodespec.spec.envelope import validate_request_envelope
from decodespec.spec.errors import DecodeSpecError
from decodespec.spec.policy.scores import log_softmax
from decodespec.spec.state import Phase

REPO = Path(__file__).resolve().parents[1]
TINY_ENVELOPE = json.loads((REPO / "docs" / "examples" / "tiny.request.json").read_text())
TOL = tolerance_for("impl", "tiny", "float32")


def envelope(*, policy: dict[str, Any] | None = None, eos: list[int] | None = None, max_new_tokens: int = 8) -> dict[str, Any]:
    """The tiny example, greedy (or ``policy``), without stop strings or stream, dynamic cache."""
    env = copy.deepcopy(TINY_ENVELOPE)
    env["policy"] = policy or {"family": "greedy"}
    env["termination"].update(max_new_tokens=max_new_tokens, stop_strings=[], eos_ids=sorted({2, *(eos or [])}))
    env["runtime"].update(cache_family="dynamic", prefill_chunk=8)
    env["runtime"].pop("static_capacity")
    env["output"].update(stream=False, final_cache="none", alignment="token")
    return env


def record(tiny_model, byte_tokenizer, env: dict[str, Any]) -> list[dict[str, Any]]:
    admitted, _ = validate_request_envelope(json.dumps(env).encode())
    runner = RequestRunner(tiny_model, RuntimeRequest.from_admitted(admitted), tokenizer=byte_tokenizer)
    return record_rows(runner, runtime={"name": "impl", "model": "tiny", "dtype": "float32"})


def judge(rows, byte_tokenizer=None, **kwargs):
    return judge_rows(rows, tolerance=TOL, token_bytes=None if byte_tokenizer is None else token_bytes_of(byte_tokenizer), **kwargs)


def tokens(rows) -> list[int]:
    """Line indices of the token lines."""
    return [i for i, r in enumerate(rows) if r["event"] == "token"]


@pytest.fixture(scope="module")
def greedy_rows(tiny_model, byte_tokenizer):
    return record(tiny_model, byte_tokenizer, envelope())


@pytest.fixture(scope="module")
def eos_rows(tiny_model, byte_tokenizer, greedy_rows):
    """A greedy run that ends at EOS: the first output id not seen before output 2 is declared an EOS id."""
    out = greedy_rows[-1]["output_ids"]
    index = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    rows = record(tiny_model, byte_tokenizer, envelope(eos=[out[index]]))
    assert rows[-1]["finish_reason"] == "eos" and len(rows[-1]["output_ids"]) == index + 1
    return rows


@pytest.fixture(scope="module")
def sampled_rows(tiny_model, byte_tokenizer):
    policy = {"family": "multinomial", "order": "hf", "transforms": [{"name": "temperature", "temperature": 0.7}, {"name": "top_k", "k": 5}]}
    return record(tiny_model, byte_tokenizer, envelope(policy=policy))


def test_conforming_recordings_are_accepted(tiny_model, byte_tokenizer, greedy_rows, eos_rows, sampled_rows):
    for rows in (greedy_rows, eos_rows, sampled_rows):
        verdict = judge(rows)
        assert verdict.verdict.result == "passed", verdict.to_json()
        assert verdict.num_tokens == len(tokens(rows)) == len(rows[-1]["output_ids"])
    # The shipped example (sampled, stop string, stream, static chunked cache, repair call) with the reference rows too.
    rows = record(tiny_model, byte_tokenizer, TINY_ENVELOPE)
    assert any(r["event"] == "call" and r["kind"] == CallKind.REPAIR.value for r in rows)
    verdict = judge(rows, byte_tokenizer, reference=reference_for("tiny"))
    assert verdict.verdict.result == "passed" and verdict.conforming, verdict.to_json()


def test_greedy_token_changed_is_a_decision_failure(greedy_rows):
    rows = copy.deepcopy(greedy_rows)
    line = tokens(rows)[2]
    row = np.asarray(rows[line]["row"])
    wrong = int(np.argmin(row))
    rows[line]["token_id"] = wrong
    rows[line]["logprob"] = float(log_softmax(row)[wrong])  # consistent with its own row: only the id is wrong
    verdict = judge(rows)
    assert (verdict.verdict.result, verdict.verdict.layer, verdict.verdict.check) == ("failed", "DECISION", "decision.selected_id")
    assert (verdict.line, verdict.event, verdict.output_index) == (line + 1, "token", 2)
    assert verdict.verdict.expected == greedy_rows[line]["token_id"] and verdict.verdict.actual == wrong
    assert "output 2" in verdict.verdict.message


def test_wrong_logprob_is_a_decision_failure(greedy_rows):
    rows = copy.deepcopy(greedy_rows)
    line = tokens(rows)[1]
    rows[line]["logprob"] -= 0.01
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line, verdict.output_index) == ("DECISION", "decision.logprob", line + 1, 1)
    assert verdict.verdict.actual == pytest.approx(greedy_rows[line]["logprob"] - 0.01)
    # A logprob within the declared bound (float rounding of another runtime) is accepted.
    rows[line]["logprob"] = greedy_rows[line]["logprob"] + TOL.at_row(rows[line]["row"]).logprob / 2
    assert judge(rows).verdict.result == "passed"


def test_sampled_id_outside_the_support_is_a_decision_failure(sampled_rows):
    rows = copy.deepcopy(sampled_rows)
    line = tokens(rows)[3]
    row = np.asarray(rows[line]["row"])
    outside = int(np.argsort(row)[-6])  # the sixth-highest score: outside top_k = 5
    rows[line]["token_id"] = outside
    rows[line]["logprob"] = float(log_softmax(row)[outside])
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line, verdict.output_index) == ("DECISION", "decision.support", line + 1, 3)
    assert verdict.verdict.expected == sampled_rows[line]["token_id"]
    # An id inside the support but not the replayed draw is caught by the draw rule.
    inside = next(int(i) for i in np.argsort(row)[::-1][:5] if int(i) != sampled_rows[line]["token_id"])
    rows[line]["token_id"], rows[line]["logprob"] = inside, float(log_softmax(row)[inside])
    verdict = judge(rows)
    assert verdict.verdict.layer == "DECISION" and verdict.verdict.check in ("decision.draw", "decision.draw_margin")
    # A stated draw count other than the selector's is a POLICY failure (before the decision is judged).
    rows = copy.deepcopy(sampled_rows)
    rows[line]["draws"] = 0
    assert (judge(rows).verdict.layer, judge(rows).verdict.check) == ("POLICY", "draws")


def test_frontier_off_by_one_is_a_state_failure(greedy_rows):
    calls = [i for i, r in enumerate(greedy_rows) if r["event"] == "call" and r["kind"] == "decode"]
    rows = copy.deepcopy(greedy_rows)
    rows[calls[1]]["start"] += 1  # the decode call launched one position past P
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("STATE", "transition.launch", calls[1] + 1)
    assert "start = P" in verdict.verdict.message or "guard" in verdict.verdict.message
    rows = copy.deepcopy(greedy_rows)
    line = tokens(rows)[0]
    rows[line]["frontier"]["output_count"] += 1  # the runtime's reported O after the first commit is one too many
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("STATE", "frontier.output_count", line + 1)
    assert (verdict.verdict.expected, verdict.verdict.actual) == (1, 2)


def test_missing_eos_finish_is_caught(eos_rows):
    last = tokens(eos_rows)[-1]
    # The runtime reports another finish reason for the EOS it committed.
    rows = copy.deepcopy(eos_rows)
    rows[-1]["finish_reason"] = FinishReason.LENGTH.value
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.verdict.expected) == ("SEQUENCE", "finish_reason", "eos")
    # The runtime does not close the output at EOS: it says READY and goes on with a decode call.
    rows = copy.deepcopy(eos_rows)
    rows[last]["phase"] = Phase.READY.value
    rows[last]["frontier"]["pending_tag"] = PendingTag.PENDING_NEXT_CALL.value
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("STATE", "frontier.pending_tag", last + 1)
    rows = copy.deepcopy(eos_rows[:-1])
    frontier = rows[last]["frontier"]
    rows.append({"event": "call", "kind": "decode", "start": frontier["processed"], "length": 1})
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("STATE", "transition.launch", last + 2)
    # A finished request whose recording lacks the finish line.
    verdict = judge(eos_rows[:-1])
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("SEQUENCE", "finish_reason", len(eos_rows))
    # A recording that stops early (the request still open) is a STATE failure at the end.
    verdict = judge(eos_rows[:tokens(eos_rows)[0] + 1])
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.verdict.actual) == ("STATE", "phase", "ready")


def test_reference_catches_a_row_away_from_the_model(greedy_rows):
    rows = copy.deepcopy(greedy_rows)
    line = tokens(rows)[1]
    row = np.asarray(rows[line]["row"])
    low = int(np.argmin(row))
    row[low] += 0.5  # a wrong low logit: the decision stays the same
    rows[line]["row"] = row.tolist()
    rows[line]["logprob"] = float(log_softmax(row)[rows[line]["token_id"]])
    assert judge(rows).verdict.result == "passed"  # the policy was applied right to the row it saw
    verdict = judge(rows, reference=reference_for("tiny"))
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("TENSOR", "score_row.linf", line + 1)
    assert verdict.verdict.probe["worst"]["id"] == low and f"vocabulary id {low}" in verdict.verdict.message
    rows[line]["row"] = rows[line]["row"][:-1]
    verdict = judge(rows)
    assert (verdict.verdict.layer, verdict.verdict.check) == ("TENSOR", "score_row.shape")


def test_bad_files_are_typed_errors(greedy_rows, tmp_path):
    lines = [json.dumps(r) for r in greedy_rows]

    def error(bad) -> DecodeSpecError:
        with pytest.raises(DecodeSpecError) as info:
            judge(bad)
        return info.value

    exc = error(lines[:2] + ["{not json"] + lines[3:])
    assert (exc.code, exc.path) == (JUDGE_SCHEMA, "$[2]")
    bad = copy.deepcopy(greedy_rows)
    bad[3]["surprise"] = 1
    assert (error(bad).code, error(bad).path) == (JUDGE_SCHEMA, "$[3]")
    line = tokens(greedy_rows)[0]
    text = lines[line].replace('"row": [', '"row": [NaN, ', 1)
    assert error(lines[:line] + [text] + lines[line + 1:]).code == JUDGE_SCHEMA
    text = lines[line].replace('"row": [', '"row": [1e400, ', 1)  # overflows to infinity
    assert (error(lines[:line] + [text] + lines[line + 1:]).code, error(lines[:line] + [text] + lines[line + 1:]).path) == (JUDGE_SCHEMA, f"$[{line}]")
    text = lines[1].replace('"start": 0', '"start": 0, "start": 1', 1)  # a duplicate key
    assert error(lines[:1] + [text] + lines[2:]).code == JUDGE_SCHEMA
    bad = copy.deepcopy(greedy_rows)
    bad[line]["row"][5] = "x"
    assert (error(bad).code, error(bad).path) == (JUDGE_SCHEMA, f"$[{line}].row[5]")
    bad = copy.deepcopy(greedy_rows)
    bad[0]["request"]["policy"]["family"] = "beam"
    bad[0]["request"]["policy"]["num_beams"] = 2
    assert error(bad).code == JUDGE_UNSUPPORTED
    bad = copy.deepcopy(greedy_rows)
    bad[0]["request"]["termination"]["max_new_tokens"] = -1
    exc = error(bad)
    assert exc.code.startswith("envelope.") and exc.path == "$[0].request.termination.max_new_tokens"
    assert error(greedy_rows[1:]).code == JUDGE_SCHEMA  # no header first
    assert error(greedy_rows[:-1] + [greedy_rows[-1], greedy_rows[1]]).code == JUDGE_SCHEMA  # a line after the finish
    with pytest.raises(DecodeSpecError) as info:
        read_rows(tmp_path / "missing.jsonl")
    assert info.value.code == JUDGE_UNREADABLE
    (tmp_path / "latin1.jsonl").write_bytes(b'{"event": "request"\xff}\n')
    with pytest.raises(DecodeSpecError) as info:
        read_rows(tmp_path / "latin1.jsonl")
    assert (info.value.code, info.value.path) == (JUDGE_UNREADABLE, "$[0]")


def test_schema_enums_are_the_codes(greedy_rows):
    schema = json.loads(ROWS_SCHEMA_PATH.read_text())
    defs = schema["$defs"]
    assert defs["event_call"]["properties"]["kind"]["enum"] == [k.value for k in CallKind]
    assert defs["event_finish"]["properties"]["finish_reason"]["enum"] == [r.value for r in FinishReason]
    assert defs["frontier"]["properties"]["pending_tag"]["enum"] == [t.value for t in PendingTag]
    assert defs["phase"]["enum"] == [p.value for p in Phase]
    assert set(defs["frontier"]["properties"]) == set(greedy_rows[-1]["frontier"])


def test_cli_exit_codes(greedy_rows, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    write_rows(good, greedy_rows)
    assert main(["judge", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["result"] == "passed"
    rows = copy.deepcopy(greedy_rows)
    rows[tokens(rows)[0]]["logprob"] += 1.0
    bad = tmp_path / "bad.jsonl"
    write_rows(bad, rows)
    assert main(["judge", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["result"], out["layer"], out["rule"], out["check"], out["line"]) == ("failed", "DECISION", "ladder.DECISION",
                                                                                    "decision.logprob", tokens(rows)[0] + 1)
    assert main(["judge", str(tmp_path / "missing.jsonl")]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == JUDGE_UNREADABLE
    # The recorder command writes what the library records.
    envelope_file = tmp_path / "request.json"
    envelope_file.write_text(json.dumps(envelope()))
    recorded = tmp_path / "recorded.jsonl"
    assert main(["judge", "--record", str(envelope_file), str(recorded)]) == 0
    capsys.readouterr()
    assert [json.loads(line) for line in read_rows(recorded)] == json.loads(json.dumps(greedy_rows))
    assert main(["judge", str(recorded), "--reference"]) == 0
    capsys.readouterr()
    assert main(["judge", "--record", str(envelope_file), str(tmp_path / "no" / "such" / "folder.jsonl")]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "cli.io_error"
    assert main(["judge", str(recorded), "--epsilon", "nan"]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "judge.no_tolerance"


def test_a_tie_within_the_tolerance_is_undecided_not_failed(greedy_rows):
    rows = copy.deepcopy(greedy_rows)
    line = tokens(rows)[1]
    row = np.asarray(rows[line]["row"])
    top = int(np.argmax(row))
    other = int(np.argsort(row)[-2])
    row[other] = row[top] - 1e-6  # the runner-up within 2 epsilon of the top: the margin rule cannot decide
    rows[line]["row"] = row.tolist()
    rows[line]["token_id"], rows[line]["logprob"] = other, float(log_softmax(row)[other])
    rows = rows[:line + 1]
    verdict = judge(rows)
    assert verdict.verdict.result == "failed" and verdict.verdict.check == "phase"  # ends open: the undecided one is not reported over a failure
    full = copy.deepcopy(greedy_rows)
    full[line] = rows[line]
    full[-1].pop("output_ids")
    verdict = judge(full)
    assert (verdict.verdict.result, verdict.verdict.check, verdict.line) == ("undecided", "decision.margin", line + 1)
    assert verdict.conforming


def test_zero_new_tokens_and_bounds(tiny_model, byte_tokenizer, tmp_path, monkeypatch):
    env = envelope(max_new_tokens=0)
    env["termination"]["min_new_tokens"] = 0
    rows = record(tiny_model, byte_tokenizer, env)
    assert [r["event"] for r in rows] == ["request", "finish"] and rows[-1]["finish_reason"] == "length"
    assert judge(rows).verdict.result == "passed"
    rows[-1]["finish_reason"] = "eos"
    assert (judge(rows).verdict.layer, judge(rows).verdict.check) == ("SEQUENCE", "finish_reason")
    import decodespec.checks.modelcheck.judge as J

    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    monkeypatch.setattr(J, "MAX_LINE_BYTES", 100)
    with pytest.raises(DecodeSpecError) as info:
        read_rows(path)
    assert (info.value.code, info.value.kind, info.value.path) == ("judge.too_large", "resource_limit", "$[0]")


def test_the_reference_window_caps_the_context(greedy_rows):
    """With a reference, context_length fires at the model window (the gate's cap), not only at the envelope's."""
    real = reference_for("tiny")

    class Narrow:
        window = greedy_rows[-1]["frontier"]["prompt_len"] + 3

        def row(self, ids):
            return real.row(ids)

    verdict = judge(greedy_rows, reference=Narrow())
    line = tokens(greedy_rows)[2]  # L + 3 reached at the third commit: the spec closes the output there
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("SEQUENCE", "triggers", line + 1)
    assert verdict.verdict.expected == ["context_length"] and verdict.verdict.actual == []


def test_an_empty_support_finishes_constraint_error(tiny_model, byte_tokenizer, greedy_rows):
    """A constraint that allows only "ab" empties the legal set at the third decision: the empty_support line is judged."""
    forced = [ord("a") + 3, ord("b") + 3]  # the byte tokenizer's ids (3 special ids first)
    states = {"s0": {str(forced[0]): "s1"}, "s1": {str(forced[1]): "s2"}, "s2": {}}
    env = envelope(policy={"family": "greedy", "transforms": [{"name": "constraint", "automaton": {"initial": "s0", "transitions": states}}]})
    env["termination"]["min_new_tokens"] = 0
    rows = record(tiny_model, byte_tokenizer, env)
    assert [r["event"] for r in rows][-2:] == ["empty_support", "finish"] and rows[-1]["finish_reason"] == "constraint_error"
    assert rows[-1]["output_ids"] == forced
    assert judge(rows).verdict.result == "passed"
    # A token where the policy finds no legal id is a DECISION failure.
    bad = copy.deepcopy(rows)
    row = bad[-2]["row"]
    bad[-2] = {"event": "token", "row": row, "token_id": 70, "logprob": float(log_softmax(np.asarray(row))[70])}
    verdict = judge(bad)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line) == ("DECISION", "decision.empty_support", len(rows) - 1)
    # An empty_support line where the policy selects a token is a DECISION failure too.
    bad = copy.deepcopy(greedy_rows)
    line = tokens(bad)[0]
    bad[line] = {"event": "empty_support", "row": bad[line]["row"]}
    verdict = judge(bad)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.verdict.expected) == ("DECISION", "decision.empty_support",
                                                                                        greedy_rows[line]["token_id"])


def test_the_worked_example_of_docs_adapters_runs_as_written(tmp_path, capsys):
    """docs/adapters.md "Worked example (tiny model)": the shipped docs/examples/greedy.request.json is recorded
    (21 lines, 8 tokens, length) and judged against the spec and the float64 reference (passed, exit 0); a token
    changed in the recording then fails at DECISION (exit 1)."""
    envelope = Path(__file__).resolve().parent.parent / "docs" / "examples" / "greedy.request.json"
    run = tmp_path / "run.jsonl"
    assert main(["judge", "--record", str(envelope), str(run)]) == 0
    assert json.loads(capsys.readouterr().out) == {"recorded": str(run), "lines": 21, "tokens": 8, "finish_reason": "length"}
    assert main(["judge", str(run), "--reference"]) == 0
    assert json.loads(capsys.readouterr().out)["result"] == "passed"
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    token = next(rec for rec in lines if rec["event"] == "token")
    token["token_id"] = (token["token_id"] + 1) % 512
    run.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    assert main(["judge", str(run), "--reference"]) == 1
    assert json.loads(capsys.readouterr().out)["layer"] == "DECISION"


def test_the_stated_ordered_vocabulary_hash_is_judged_at_state(greedy_rows, byte_tokenizer, tmp_path, capsys):
    """M3.8 0x08: a recording may state its runtime's ordered vocabulary hash; a wrong one fails STATE vocab.hash at line 1."""
    from decodespec.checks.gate.vocab_check import reference_vocab
    from decodespec.spec.vocab import vocab_table_hash

    model_hash = reference_vocab("tiny").vocab_hash
    assert greedy_rows[0]["runtime"]["vocab_hash"] == byte_tokenizer.vocab_hash == model_hash  # record_rows wrote it
    assert judge(greedy_rows, vocab_hash=model_hash).conforming
    # a runtime whose table swaps two ids: same size, another identity
    tokens_, specials, control = byte_tokenizer.vocab_table()
    swapped = list(tokens_)
    swapped[100], swapped[101] = swapped[101], swapped[100]
    other = vocab_table_hash(swapped, specials, control)
    rows = copy.deepcopy(greedy_rows)
    rows[0]["runtime"]["vocab_hash"] = other
    verdict = judge(rows, vocab_hash=model_hash)
    assert (verdict.verdict.layer, verdict.verdict.check, verdict.line, verdict.event) == ("STATE", "vocab.hash", 1, "request")
    assert (verdict.verdict.expected, verdict.verdict.actual) == (model_hash, other)
    assert judge(rows).conforming  # no model hash given: nothing to compare with
    unstated = copy.deepcopy(greedy_rows)
    del unstated[0]["runtime"]["vocab_hash"]
    assert judge(unstated, vocab_hash=model_hash).conforming  # not stated: not compared
    # the command reads the model's hash from the checkpoint as the gate does
    bad = tmp_path / "swapped.jsonl"
    write_rows(bad, rows)
    assert main(["judge", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["layer"], out["check"], out["line"]) == ("STATE", "vocab.hash", 1)
    rows[0]["runtime"]["vocab_hash"] = "sha256:xyz"
    write_rows(bad, rows)
    assert main(["judge", str(bad)]) == 2
    err = json.loads(capsys.readouterr().err)["error"]
    assert err["code"] == JUDGE_SCHEMA and err["path"] == "$[0].runtime.vocab_hash"
