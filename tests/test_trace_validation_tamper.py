"""``decodespec validate-trace`` refuses tampered traces and keeps accepting untampered ones.

A new-user trial (finding 6) found four tampered traces accepted with exit 0.  Each test here
builds a real trace with ``decodespec generate --model tiny --trace FILE``, tampers one line, and
asserts the refusal: exit 1, the verdict's registered ``code`` and the first unmatched ``line``.

* a header whose ``format`` is not ``decodespec.events.v1`` -> ``trace.schema`` (the published
  schema ``spec/schemas/events.v1.json`` fixes it as a constant);
* a ``decision`` whose embedded M3.8 receipt says ``selected_id`` 9 while its ``token_id`` is
  another id -> ``trace.receipt`` (M3.8 0x0B: the receipt binds the selected id; its content hash
  binds every other field);
* an unknown extra field, at the top level or inside a nested object -> ``trace.schema`` (closed
  field sets);
* the final ``finish`` event removed -> ``trace.incomplete`` at line ``num_lines + 1`` (a terminal
  request must be reported by its ``finish`` event).

Source: docs/design.md section 6 (``decodespec.events.v1``); /work/prompts/NU_findings.md item 6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import EVENTS_SCHEMA_PATH, TRACE_INCOMPLETE, TRACE_RECEIPT, TRACE_SCHEMA, validate_trace
from decodespec.spec.enums import CallKind, FinishReason, PendingTag, Selection
from decodespec.spec.errors import quote_content
from decodespec.spec.state import InterruptPoint

BASE = ["generate", "--model", "tiny", "--prompt", "hi", "--device", "cpu"]


def _generate(tmp_path: Path, name: str, *flags: str) -> Path:
    """A content trace (``--trace-content``): these tamperings change raw ids and text (redacted ones: tests/test_passport.py)."""
    path = tmp_path / f"{name}.ndjson"
    assert main([*BASE, "--trace", str(path), "--trace-content", *flags]) == 0
    return path


def _verdict(capsys, path: Path, expected_exit: int) -> dict:
    capsys.readouterr()
    assert main(["validate-trace", str(path)]) == expected_exit
    return json.loads(capsys.readouterr().out)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def greedy_trace(tmp_path_factory) -> Path:
    return _generate(tmp_path_factory.mktemp("traces"), "greedy", "--max-new-tokens", "4")


# -- untampered traces stay accepted ----------------------------------------------------------


@pytest.mark.parametrize("name,flags", [
    ("greedy", ["--max-new-tokens", "4"]),
    ("sampled", ["--max-new-tokens", "4", "--do-sample", "--seed", "7", "--top-k", "20"]),
    ("stop-stream", ["--max-new-tokens", "12", "--stop", "BB", "--stream"]),
    ("chunked-static", ["--max-new-tokens", "3", "--cache", "static", "--prefill-chunk", "2"]),
    ("repair", ["--max-new-tokens", "3", "--repair"]),
])
def test_untampered_traces_are_accepted(tmp_path, capsys, name, flags):
    path = _generate(tmp_path, name, *flags)
    verdict = _verdict(capsys, path, 0)
    assert verdict["accepted"] is True and verdict["code"] is None and verdict["consumed"] == len(_records(path))
    if name == "stop-stream":
        events = [r["event"] for r in _records(path)]
        assert "stream" in events and _records(path)[-1]["finish_reason"] == "stop_string"


def test_snapshot_and_resume_traces_are_accepted(tmp_path, capsys, tiny_model):
    """Suspend after 2 sampled outputs (``snapshot`` last), resume from the snapshot (``request``, ``restore``, ...).

    Built with the Python API (``RequestRunner`` + ``FileSink``), the traces ``generate --snapshot`` /
    ``--resume`` write.
    """
    from runtime_helpers import request, sampled_policy  # tests/ is on sys.path

    from decodespec.impl.events import FileSink
    from decodespec.impl.runtime import RequestRunner

    first, second = tmp_path / "first.ndjson", tmp_path / "second.ndjson"
    with FileSink(first) as sink:
        snap = RequestRunner(tiny_model, request([1, 104, 105], 5, policy=sampled_policy()), sink=sink).run(max_outputs=2).snapshot("pending_suffix")
    assert _records(first)[-1]["event"] == "snapshot"
    assert _verdict(capsys, first, 0)["final_phase"] != "finished"
    with FileSink(second) as sink:
        RequestRunner.restore(tiny_model, snap, sink=sink).run()
    assert [r["event"] for r in _records(second)[:2]] == ["request", "restore"]
    assert _verdict(capsys, second, 0)["final_phase"] == "finished"
    # Removing the resumed trace's finish is refused like any other.
    _write(second, _records(second)[:-1])
    assert _verdict(capsys, second, 1)["code"] == TRACE_INCOMPLETE


# -- the four tamperings of finding 6 ---------------------------------------------------------


def test_a_header_with_another_format_is_refused(greedy_trace, tmp_path, capsys):
    records = _records(greedy_trace)
    records[0]["format"] = "x"
    path = tmp_path / "format.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, 1, "request")
    assert "$.format" in verdict["reason"] and "decodespec.events.v1" in verdict["reason"]


def test_a_receipt_whose_selected_id_is_not_the_token_is_refused(greedy_trace, tmp_path, capsys):
    records = _records(greedy_trace)
    i = [k for k, r in enumerate(records) if r["event"] == "decision"][1]
    assert records[i]["token_id"] != 9
    records[i]["receipt"]["selected_id"] = 9
    path = tmp_path / "receipt.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_RECEIPT, i + 1, "decision")
    # Token ids are user content: the reason shows them as length and fingerprint (spec/errors.py quote_content), never raw.
    assert f"'receipt.selected_id' is {quote_content(9)} but the spec says {quote_content(records[i]['token_id'])}" in verdict["reason"]


def test_a_receipt_altered_behind_its_content_hash_is_refused(greedy_trace, tmp_path, capsys):
    records = _records(greedy_trace)
    i = next(k for k, r in enumerate(records) if r["event"] == "decision")
    records[i]["receipt"]["support_size"] -= 1  # bound by no event field: only the content hash catches it
    path = tmp_path / "hash.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == (TRACE_RECEIPT, i + 1) and "content hash" in verdict["reason"]


@pytest.mark.parametrize("where", ["top", "frontier", "receipt.rng", "params"])
def test_an_unknown_field_is_refused(greedy_trace, tmp_path, capsys, where):
    records = _records(greedy_trace)
    if where == "top":
        i = next(k for k, r in enumerate(records) if r["event"] == "commit")
        records[i]["note"], path_part = "hi", "$"
    elif where == "frontier":
        i = next(k for k, r in enumerate(records) if r["event"] == "call_completed")
        records[i]["frontier_after"]["note"], path_part = 1, "$.frontier_after"
    elif where == "receipt.rng":
        i = next(k for k, r in enumerate(records) if r["event"] == "decision")
        records[i]["receipt"]["rng"]["note"], path_part = 1, "$.receipt.rng"
    else:
        i = 0
        records[0]["params"]["note"], path_part = 1, "$.params"
    path = tmp_path / "extra.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, i + 1, records[i]["event"])
    assert f"at {path_part}:" in verdict["reason"] and "'note' was unexpected" in verdict["reason"]


def test_a_trace_without_its_final_finish_is_incomplete(greedy_trace, tmp_path, capsys):
    records = _records(greedy_trace)
    assert records[-1]["event"] == "finish"
    path = tmp_path / "nofinish.ndjson"
    _write(path, records[:-1])
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["consumed"]) == (TRACE_INCOMPLETE, len(records), len(records) - 1)
    assert verdict["final_phase"] == "finished" and "without the finish event" in verdict["reason"]


def test_a_repaired_trace_needs_the_finish_after_its_repair(tmp_path, capsys):
    """With ``--repair`` the runtime reports ``finish`` again after the repair call; dropping that last one is refused."""
    path = _generate(tmp_path, "repair", "--max-new-tokens", "3", "--repair")
    records = _records(path)
    assert [r["event"] for r in records[-4:]] == ["finish", "call_launched", "call_completed", "finish"]
    _write(path, records[:-1])
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == (TRACE_INCOMPLETE, len(records))


def test_the_python_api_reports_the_same_codes(greedy_trace):
    lines = greedy_trace.read_text().splitlines()
    assert validate_trace(lines).accepted
    assert validate_trace(lines[:-1]).code == TRACE_INCOMPLETE
    assert validate_trace([]).code == TRACE_INCOMPLETE
    bad = json.loads(lines[1])
    bad["kind"] = "warmup"
    verdict = validate_trace([lines[0], json.dumps(bad), *lines[2:]])
    assert (verdict.code, verdict.line) == (TRACE_SCHEMA, 2) and "$.kind" in verdict.reason


def test_the_schema_enums_are_the_specs():
    """spec/schemas/events.v1.json spells the spec's enums (spec/enums.py, spec/state.py) exactly."""
    defs = json.loads(EVENTS_SCHEMA_PATH.read_text())["$defs"]
    assert set(defs["finish_reason"]["enum"]) == {r.value for r in FinishReason}
    assert defs["frontier"]["properties"]["pending_tag"]["enum"] == [t.value for t in PendingTag]
    assert defs["event_call_launched"]["properties"]["kind"]["enum"] == [k.value for k in CallKind]
    assert defs["event_call_completed"]["properties"]["selection"]["enum"] == [s.value for s in Selection]
    assert defs["event_cancel"]["properties"]["at"]["enum"] == [p.value for p in InterruptPoint]


# -- wrong acceptances of the hostile-input report (issue 16) ---------------------------------


def test_a_commit_whose_logprob_is_not_its_decisions_is_refused(greedy_trace, tmp_path, capsys):
    records = _records(greedy_trace)
    i = [k for k, r in enumerate(records) if r["event"] == "commit"][1]
    records[i]["logprob"] = records[i]["logprob"] - 0.5  # still a finite logprob <= 0
    path = tmp_path / "logprob.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == ("trace.mismatch", i + 1, "commit")
    assert "field 'logprob'" in verdict["reason"] and "decision" in verdict["reason"]


@pytest.mark.parametrize("event", ["decision", "commit"])
def test_a_logprob_too_large_for_a_float_is_a_mismatch_not_a_crash(greedy_trace, tmp_path, capsys, event):
    """Found by the long trace fuzz (seed 41): an integer logprob of 400 digits raised OverflowError in math.isfinite."""
    records = _records(greedy_trace)
    i = next(k for k, r in enumerate(records) if r["event"] == event)
    records[i]["logprob"] = -(10**400)
    path = tmp_path / "huge.ndjson"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    verdict = _verdict(capsys, path, 1)
    assert verdict["line"] == i + 1 and verdict["code"] in ("trace.mismatch", "trace.schema", "trace.receipt") and "logprob" in verdict["reason"]


@pytest.mark.parametrize("written", [0, 3, 5])
def test_layers_written_that_contradict_all_new_are_refused(greedy_trace, tmp_path, capsys, written):
    """The tiny model has 4 layers: ALL_NEW on a cached call wrote all 4; 0, or another count than the first ALL_NEW's, is a lie."""
    records = _records(greedy_trace)
    completed = [k for k, r in enumerate(records) if r["event"] == "call_completed"]
    assert {records[k]["selection"] for k in completed} == {"ALL_NEW"} and {records[k]["layers_written"] for k in completed} == {4}
    i = completed[0] if written == 0 else completed[1]
    records[i]["layers_written"] = written
    path = tmp_path / "layers.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == ("trace.mismatch", i + 1, "call_completed")
    assert "field 'layers_written'" in verdict["reason"] and "ALL_NEW" in verdict["reason"]


def test_a_no_cache_trace_writes_no_layer(tmp_path, capsys):
    path = _generate(tmp_path, "nocache", "--max-new-tokens", "2", "--cache", "none")
    assert _verdict(capsys, path, 0)["accepted"]
    records = _records(path)
    i = next(k for k, r in enumerate(records) if r["event"] == "call_completed")
    records[i]["layers_written"] = 4
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert verdict["line"] == i + 1 and "writes no layer" in verdict["reason"]


@pytest.fixture(scope="module")
def snapshot_trace(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("snap")
    return _generate(folder, "snap", "--max-new-tokens", "4", "--snapshot", str(folder / "s.json"), "--snapshot-at", "2")


@pytest.mark.parametrize("field,value", [("output_ids", [9, 9]), ("rng_counter", 7), ("num_calls", 9), ("issued", ["receipt-0"]),
                                         ("pending_ids", []), ("generation", 0)])
def test_a_snapshot_event_whose_state_is_not_the_specs_is_refused(snapshot_trace, tmp_path, capsys, field, value):
    records = _records(snapshot_trace)
    assert records[-1]["event"] == "snapshot" and _verdict(capsys, snapshot_trace, 0)["accepted"]
    assert records[-1]["state"][field] != value
    records[-1]["state"][field] = value
    path = tmp_path / "state.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == ("trace.mismatch", len(records), "snapshot")
    assert f"field 'state.{field}'" in verdict["reason"]


def test_a_snapshot_event_with_a_malformed_state_is_refused(snapshot_trace, tmp_path, capsys):
    records = _records(snapshot_trace)
    records[-1]["state"] = {"identity": 5}
    path = tmp_path / "malformed.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, len(records), "snapshot")
    assert "$.state" in verdict["reason"]


@pytest.mark.parametrize("field,value", [("name", "evil.runtime"), ("model", "gpt-5"), ("device", "tpu:0"), ("dtype", "float64"),
                                         ("attention", "flash"), ("decode_kernel", "cuda")])
def test_a_header_runtime_field_outside_its_domain_is_refused(greedy_trace, tmp_path, capsys, field, value):
    records = _records(greedy_trace)
    records[0]["runtime"][field] = value
    path = tmp_path / "runtime.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, 1, "request")
    assert f"$.runtime.{field}" in verdict["reason"]


def test_the_header_runtime_enums_are_the_runtimes():
    """spec/schemas/events.v1.json's runtime.* domains are the runtime's own (models, dtypes, attention implementations)."""
    from decodespec.checks.adapters import MODELS
    from decodespec.impl.config import ATTN_IMPLEMENTATIONS
    from decodespec.impl.device import DTYPES

    runtime = json.loads(EVENTS_SCHEMA_PATH.read_text())["$defs"]["runtime"]["properties"]
    assert set(runtime["model"]["enum"]) == set(MODELS)
    assert set(runtime["dtype"]["enum"]) == set(DTYPES)
    assert set(runtime["attention"]["enum"]) == set(ATTN_IMPLEMENTATIONS)


@pytest.mark.parametrize("field,value", [("eos_ids", [2063]), ("eos_ids", [7]), ("max_new_tokens", 9), ("cache_family", "none"),
                                         ("min_new_tokens", 1)])
def test_header_params_that_disagree_with_the_header_are_refused(greedy_trace, tmp_path, capsys, field, value):
    """Found by tests/test_fuzz_traces.py: params.eos_ids = [2063] (outside the 512-id vocabulary, and not the header's
    eos_ids [2]) was accepted, since the run ended by length. The header states these constants twice; both must agree."""
    records = _records(greedy_trace)
    records[0]["params"][field] = value
    path = tmp_path / "params.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == ("trace.invalid_header", 1), verdict


# -- found by the wrong-acceptance oracle of tests/test_fuzz_traces.py (tests/trace_oracle.py) ----------------------------

@pytest.fixture(scope="module")
def stream_trace(tmp_path_factory) -> Path:
    return _generate(tmp_path_factory.mktemp("traces"), "stream", "--max-new-tokens", "8", "--do-sample", "--seed", "3",
                     "--top-k", "20", "--stop", "BB", "--stream")


def _set_path(record: dict, path: tuple, value, delete: bool = False) -> None:
    for key in path[:-1]:
        record = record[key]
    if delete:
        del record[path[-1]]
    else:
        record[path[-1]] = value


@pytest.mark.parametrize("path,value,json_path", [
    (("params", "max_draws"), 2**64, "$.params.max_draws"),
    (("params", "context_cap"), 1e308, "$.params.context_cap"),
    (("seed",), 10**39, "$.seed"),
    (("seed",), -(2**63) - 1, "$.seed"),
    (("params", "final_cache"), "x", "$.params.final_cache"),
    (("params", "zero_new_tokens"), "x", "$.params.zero_new_tokens"),
    (("data", "note"), "x", "$.data"),
    (("data", "runtime"), 5, "$.data"),
])
def test_a_header_value_outside_its_domain_is_a_schema_refusal_naming_it(greedy_trace, tmp_path, capsys, path, value, json_path):
    """Every integer of spec/schemas/events.v1.json is bounded by spec/limits.py MAX_SAFE_INT (2**64, 10**39 and the
    float 1e308, which JSON Schema's "integer" admits, were accepted); params' enums and the passport are closed."""
    records = _records(greedy_trace)
    _set_path(records[0], path, value)
    out = tmp_path / "header.ndjson"
    _write(out, records)
    verdict = _verdict(capsys, out, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, 1, "request"), verdict
    assert json_path in verdict["reason"], verdict


def test_every_integer_of_the_events_schema_is_in_0_to_max_safe_int():
    from decodespec.spec.limits import MAX_SAFE_INT

    def walk(node, where="$"):
        if isinstance(node, dict):
            types = node.get("type")
            if types == "integer" or (isinstance(types, list) and "integer" in types):
                assert node.get("maximum", MAX_SAFE_INT + 1) <= MAX_SAFE_INT and node.get("minimum", -1) >= 0, where
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(json.loads(EVENTS_SCHEMA_PATH.read_text()))


@pytest.mark.parametrize("field", ["model", "dtype", "device", "attention", "decode_kernel"])
def test_a_runtime_field_deleted_from_a_described_runtime_is_refused(greedy_trace, tmp_path, capsys, field):
    records = _records(greedy_trace)
    del records[0]["runtime"][field]
    path = tmp_path / "runtime.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == (TRACE_SCHEMA, 1) and "$.runtime" in verdict["reason"], verdict


def test_a_content_trace_without_the_recorded_opt_in_is_refused(tmp_path, capsys):
    """The trace fuzz (seed 46) found ``data.opt_in`` flipped to false in a content trace accepted."""
    path = _generate(tmp_path, "content", "--max-new-tokens", "3", "--trace-content")
    records = _records(path)
    assert records[0]["data"]["classification"] == "content" and records[0]["data"]["opt_in"] is True
    assert _verdict(capsys, path, 0)["accepted"] is True
    records[0]["data"]["opt_in"] = False
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == ("data.unknown_classification", 1), verdict


def test_a_python_api_trace_without_a_seed_is_accepted_and_its_null_seed_is_checked(tmp_path, capsys):
    """``generate()`` without a seed writes ``"seed": null`` (RequestView admits None); validate-trace accepts it.

    The null seed still keys the receipts' RNG (``rng_key(identity, None)``): writing an integer
    seed into the header of a content trace breaks the key and is refused.
    """
    from decodespec.impl.events import FileSink
    from decodespec.impl.generate import generate
    from decodespec.impl.tiny import load_tiny

    path = tmp_path / "unseeded.ndjson"
    with FileSink(path, content=True) as sink:
        generate(load_tiny(seed=0), [5, 6, 7], max_new_tokens=3, sink=sink)
    records = _records(path)
    assert records[0]["seed"] is None
    assert _verdict(capsys, path, 0)["accepted"] is True
    records[0]["seed"] = 0
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert verdict["accepted"] is False and verdict["code"] == TRACE_RECEIPT, verdict


def test_a_seed_that_does_not_derive_the_receipts_key_is_refused(greedy_trace, tmp_path, capsys):
    """A content trace's receipts record rng.key_id = rng_key(identity, seed): another seed is another key."""
    records = _records(greedy_trace)
    records[0]["seed"] += 1
    path = tmp_path / "seed.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert verdict["code"] == TRACE_RECEIPT and "receipt.rng.key_id" in verdict["reason"], verdict


@pytest.mark.parametrize("field,value", [("profile", "encoder_decoder"), ("lanes", []), ("lanes", ["self_kv", "self_kv"])])
def test_a_header_profile_or_lane_roster_that_disagrees_with_params_is_refused(greedy_trace, tmp_path, capsys, field, value):
    records = _records(greedy_trace)
    records[0][field] = value
    path = tmp_path / "profile.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == ("trace.invalid_header", 1) and field in verdict["reason"], verdict


@pytest.mark.parametrize("change", ["delivered_tokens_big", "delivered_tokens_off", "error_without_failure", "report_deleted"])
def test_a_finish_stream_report_that_disagrees_with_the_stream_is_refused(stream_trace, tmp_path, capsys, change):
    records = _records(stream_trace)
    finish = records[-1]
    assert finish["event"] == "finish" and finish["stream"]["failed"] is False
    if change == "delivered_tokens_big":
        finish["stream"]["delivered_tokens"] = 2**53 + 1
    elif change == "delivered_tokens_off":
        finish["stream"]["delivered_tokens"] += 1
    elif change == "error_without_failure":
        finish["stream"]["error"] = "cuda:0"
    else:
        del finish["stream"]
    path = tmp_path / "report.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert verdict["line"] == len(records) and verdict["event"] == "finish", verdict
    assert verdict["code"] == (TRACE_SCHEMA if change == "delivered_tokens_big" else "trace.mismatch"), verdict


@pytest.mark.parametrize("where", [("state",), ("state", "consumed", 0), ("state", "scores", 0)])
def test_an_extra_key_inside_a_snapshot_events_state_is_refused(snapshot_trace, tmp_path, capsys, where):
    records = _records(snapshot_trace)
    target = records[-1]
    for key in where:
        target = target[key]
    target["#meta"] = 1
    path = tmp_path / "state.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"], verdict["event"]) == (TRACE_SCHEMA, len(records), "snapshot"), verdict
    assert "$.state" in verdict["reason"]


# -- the trace fuzz's seed-47 acceptances, triaged (docs/results/fuzz-traces.md) ---------------------------------------

def _inert(text: str) -> str:
    """Two characters that do not occur in ``text``."""
    return "".join([c for c in "zqxjkvwyZQXJKVWY#%~" if c not in text][:2])


@pytest.mark.parametrize("kind", ["inert", "first_char", "last_char", "first_char_prefix", "middle_char_prefix"])
def test_a_stop_string_appended_to_a_content_trace_is_judged_on_the_output(stream_trace, tmp_path, capsys, kind):
    """Seed 47 appended a stop string to ``output.stop_strings``; validate-trace re-derives stop matches and the
    stream's holdback from the token bytes, so it accepts exactly the strings that could neither match nor hold
    back, and the oracle (tests/trace_oracle.py) agrees by its own brute-force rule.  The strings are built from
    the sampled output (which depends on the request identity and the CPU's kernels): one sharing no character
    with it (inert), a character of it (the request must have stopped there), a character of it followed by
    characters it lacks (the chunk ending there must have been held back)."""
    from trace_oracle import classify_acceptance  # tests/ is on sys.path

    records = _records(stream_trace)
    output = "".join(r.get("text", "") for r in records if r["event"] == "stream")
    assert len(output) >= 3 and records[-1]["finish_reason"] == "length", output
    added = {"inert": _inert(output), "first_char": output[0], "last_char": output[-1],
             "first_char_prefix": output[0] + _inert(output), "middle_char_prefix": output[len(output) // 2] + _inert(output)}[kind]
    records[0]["output"]["stop_strings"].append(added)
    path = tmp_path / "stop.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 0 if kind == "inert" else 1)
    cls, detail = classify_acceptance(stream_trace.read_bytes(), path.read_bytes())
    if kind == "inert":
        assert verdict["accepted"] is True and (cls, detail) == ("free", "request.output.stop_strings")
    else:
        assert verdict["code"] == "trace.mismatch", verdict
        assert ("stop_triggers" in verdict["reason"]) if kind.endswith("char") else ("stream horizon" in verdict["reason"]), verdict
        assert cls == "wrong", "the oracle must not call a string that matches or holds back free"


def test_a_trace_without_a_passport_is_refused(stream_trace, tmp_path, capsys):
    """Seed 47 deleted ``data`` from a content trace's header and it was read as an older, passport-less content
    trace.  Every trace written since the passport declares it, and content needs the recorded opt-in, so a
    header without ``data`` is refused (M3.10 0x06)."""
    records = _records(stream_trace)
    del records[0]["data"]
    path = tmp_path / "nopassport.ndjson"
    _write(path, records)
    verdict = _verdict(capsys, path, 1)
    assert (verdict["code"], verdict["line"]) == ("data.unknown_classification", 1), verdict


def test_a_redacted_chunk_text_digest_is_free_and_the_verdict_says_it_was_not_checked(tmp_path, capsys):
    """Seed 47 flipped a byte of a redacted chunk's ``text_redacted.digest``: a keyed digest under a key the file
    does not keep, related to the tokens only through their bytes, which a redacted file does not hold.  The
    validator accepts and lists the chunk-text check in ``needs_content``; the oracle declares it free there."""
    from trace_oracle import classify_acceptance

    path = tmp_path / "redacted.ndjson"
    assert main([*BASE, "--trace", str(path), "--max-new-tokens", "6", "--do-sample", "--seed", "3", "--top-k", "20",
                 "--stream"]) == 0
    records = _records(path)
    chunk = next(r for r in records if r["event"] == "stream")
    digest = chunk["text_redacted"]["digest"]
    chunk["text_redacted"]["digest"] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    mutated = tmp_path / "flipped.ndjson"
    _write(mutated, records)
    verdict = _verdict(capsys, mutated, 0)
    assert verdict["accepted"] is True and any("chunk text" in c for c in verdict["needs_content"]["checks"]), verdict
    assert classify_acceptance(path.read_bytes(), mutated.read_bytes()) == ("free", "stream.text_redacted.digest")
    # The same flip in a content trace's chunk text is no digest: it is refused.
    content = _generate(tmp_path, "content-stream", "--max-new-tokens", "6", "--do-sample", "--seed", "3", "--top-k", "20",
                        "--stream")
    records = _records(content)
    chunk = next(r for r in records if r["event"] == "stream")
    chunk["text"] = chunk["text"] + "\u00e9"
    _write(content, records)
    assert _verdict(capsys, content, 1)["accepted"] is False


@pytest.mark.parametrize("stops", [False, True])
def test_include_stop_str_is_free_only_until_a_stop_string_matched(tmp_path, capsys, stops):
    """The trace fuzz (seed 49) flipped ``output.include_stop_str`` in a trace without stop strings: accepted, and the
    oracle now declares it free there.  After a stop-string finish the flag decides the returned text, so the flip
    is refused (and the oracle would call its acceptance wrong)."""
    from trace_oracle import classify_acceptance

    flags = ("--max-new-tokens", "8", "--stop", "BB", "--stream") if stops else ("--max-new-tokens", "4")
    path = _generate(tmp_path, "include", *flags)
    records = _records(path)
    assert (records[-1]["finish_reason"] == "stop_string") is stops
    records[0]["output"]["include_stop_str"] = not records[0]["output"]["include_stop_str"]
    flipped = tmp_path / "flipped.ndjson"
    _write(flipped, records)
    verdict = _verdict(capsys, flipped, 1 if stops else 0)
    kind, _ = classify_acceptance(path.read_bytes(), flipped.read_bytes())
    assert kind == ("wrong" if stops else "free"), verdict
