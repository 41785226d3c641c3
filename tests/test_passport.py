"""The trace passport (issue 16 item 5; M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data").

A default ``decodespec generate --trace`` holds no byte of the prompt (a card number: neither its
digits nor any run of its token ids), no output id and no streamed text; it declares
``data.classification = "redacted"``, still validates (frontiers, phases, receipts, commit against
decision by digest) and says which checks needed the content (``trace.redacted``); ``replay``
refuses it with ``trace.redacted``.  ``--trace-content`` keeps the content and records the opt-in.
Snapshots drop the prompt text by default and still resume exactly; conformance traces, the
corpus and the gate's result lines are ``synthetic``; an unknown classification is a typed error
with its path; envelope errors quote user content as length + fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import TRACE_MISMATCH, TRACE_RECEIPT, TRACE_SCHEMA, validate_trace
from decodespec.impl.tiny import TINY_VOCAB_SIZE
from decodespec.impl.tokenizer import ByteTokenizer
from decodespec.spec.errors import DecodeSpecError, Rejection
from decodespec.spec.passport import (
    DATA_UNKNOWN_CLASSIFICATION,
    TRACE_REDACTED,
    Redactor,
    is_content_path,
    passport_from_json,
    quote_content,
    snapshot_passport,
)

CARD = "4111 1111 1111 1111"
PROMPT = f"my card is {CARD}"
BASE = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", PROMPT]
TRACES = Path(__file__).resolve().parent.parent / "traces"


def _tokenizer() -> ByteTokenizer:
    return ByteTokenizer(TINY_VOCAB_SIZE)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _run(capsys, argv: list[str], code: int = 0) -> tuple[str, str]:
    capsys.readouterr()
    assert main(argv) == code
    out = capsys.readouterr()
    return out.out, out.err


def _ints(value) -> list[int]:
    """Every JSON integer of ``value``, in document order (a token-id run shows up as a contiguous slice)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [i for v in value for i in _ints(v)]
    if isinstance(value, dict):
        return [i for v in value.values() for i in _ints(v)]
    return []


def _has_run(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def _main_json(argv: list[str]) -> dict:
    """Run the CLI in this process; the last stdout line parsed (the ``--json`` result)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return json.loads(buffer.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def card_run(tmp_path_factory):
    """A streamed run over the card-number prompt with a stop string holding digits: ``(trace, its --json result)``."""
    trace = tmp_path_factory.mktemp("passport") / "card.ndjson"
    result = _main_json([*BASE, "--max-new-tokens", "8", "--stream", "--stop", "1111 9", "--json", "--trace", str(trace)])
    return trace, result


@pytest.fixture(scope="module")
def card_result():
    """The ``--json`` result of the plain request (greedy: deterministic), never stopped."""
    return _main_json([*BASE, "--max-new-tokens", "8", "--json"])


# -- the acceptance test: a default trace holds no byte of the card number ---------------------


def test_a_default_trace_holds_no_byte_of_the_card_number(card_run):
    card_run, card_result = card_run
    data = card_run.read_bytes()
    tok = _tokenizer()
    prompt_ids = card_result["prompt_ids"]
    card_ids = tok.encode(CARD)
    assert _has_run(prompt_ids, card_ids) and len(card_ids) == len(CARD)  # the card's ids are in the request
    for needle in (CARD, CARD.replace(" ", ""), "4111", "my card", "1111 9"):
        assert needle.encode() not in data, needle
    # No run of the card's ids (nor of the prompt's, nor of the output's) as JSON integers, in any spelling.
    for ids in (card_ids, prompt_ids, card_result["output_ids"][:4]):
        assert ",".join(map(str, ids)).encode() not in data
        assert ", ".join(map(str, ids)).encode() not in data
    for rec in _records(card_run):
        assert not _has_run(_ints(rec), card_ids), rec["event"]
        assert not _has_run(_ints(rec), prompt_ids[:6]), rec["event"]
    # Nor an unkeyed digest of an id (the key is random per trace and not stored).
    for t in set(prompt_ids):
        assert hashlib.sha256(b"token\x00" + str(t).encode()).hexdigest()[:24].encode() not in data
    # Nor the identity of the request, an unkeyed hash of the prompt.
    assert card_result["identity"].encode() not in data
    assert card_result["identity"].split(":")[1].encode() not in data


def test_a_default_trace_declares_its_passport_and_keeps_digests_and_counters(card_run):
    card_run, card_result = card_run
    records = _records(card_run)
    header = records[0]
    data = header["data"]
    assert data["classification"] == "redacted" and data["opt_in"] is False
    assert data["clear_ids"] == header["eos_ids"] == [2]
    assert "request.prompt_ids" in data["redacted"] and "stream.text" in data["redacted"]
    assert "hmac-sha256" in data["digest"] and "not stored" in data["digest"]
    # Counters survive: the prompt length, the number of outputs, stream byte counts.
    assert len(header["prompt_ids"]) == header["params"]["prompt_len"] == len(card_result["prompt_ids"])
    assert all(isinstance(t, str) and t.startswith("tok:") for t in header["prompt_ids"])
    # Equal ids are equal digests within the trace; different ids, different digests.
    by_id = {}
    for t, d in zip(card_result["prompt_ids"], header["prompt_ids"]):
        assert by_id.setdefault(t, d) == d
    assert len(set(by_id.values())) == len(by_id)
    decisions = [r for r in records if r["event"] == "decision"]
    commits = [r for r in records if r["event"] == "commit"]
    assert [d["token_id"] for d in decisions] == [c["token_id"] for c in commits] == [d["receipt"]["selected_id"] for d in decisions]
    streams = [r for r in records if r["event"] == "stream"]
    assert streams and all("text" not in s and s["text_redacted"]["bytes"] == s["byte_end"] - s["byte_start"] for s in streams)
    assert header["output"]["stop_strings"] == [{"digest": header["output"]["stop_strings"][0]["digest"], "bytes": 6}]


def test_two_traces_of_one_request_share_no_digest(card_run, tmp_path):
    card_run = card_run[0]
    again = tmp_path / "again.ndjson"
    assert main([*BASE, "--max-new-tokens", "8", "--stream", "--stop", "1111 9", "--trace", str(again)]) == 0
    first, second = _records(card_run)[0], _records(again)[0]
    assert len(first["prompt_ids"]) == len(second["prompt_ids"])
    assert not set(first["prompt_ids"]) & set(second["prompt_ids"])
    assert first["identity"] != second["identity"]


def test_a_redacted_trace_validates_and_names_the_checks_that_need_content(card_run, capsys):
    card_run = card_run[0]
    out, _ = _run(capsys, ["validate-trace", str(card_run)])
    verdict = json.loads(out)
    assert verdict["accepted"] is True and verdict["consumed"] == len(_records(card_run))
    assert verdict["classification"] == "redacted"
    assert verdict["needs_content"]["code"] == TRACE_REDACTED
    assert "invariant.stop_triggers" in verdict["needs_content"]["checks"]
    assert "--trace-content" in verdict["needs_content"]["message"]


def test_trace_content_keeps_the_content_and_records_the_opt_in(card_result, tmp_path, capsys):
    path = tmp_path / "content.ndjson"
    own = _main_json([*BASE, "--max-new-tokens", "8", "--stream", "--json", "--trace", str(path), "--trace-content"])
    records = _records(path)
    assert own["output_ids"] == card_result["output_ids"]  # streaming changes the identity, not the tokens
    assert records[0]["data"] == {"classification": "content", "opt_in": True}
    assert records[0]["prompt_ids"] == card_result["prompt_ids"]
    assert records[0]["identity"] == own["identity"]
    assert "".join(r["text"] for r in records if r["event"] == "stream") == own["text"]
    verdict = json.loads(_run(capsys, ["validate-trace", str(path)])[0])
    assert verdict["accepted"] is True and verdict["classification"] == "content" and verdict["needs_content"] is None


def test_trace_content_without_trace_is_refused(capsys):
    _, err = _run(capsys, [*BASE, "--trace-content"], 2)
    assert json.loads(err)["error"]["path"] == "$.trace_content"


# -- tampering a redacted trace is still caught -------------------------------------------------


def _tampered(records, tmp_path, name):
    path = tmp_path / f"{name}.ndjson"
    _write(path, records)
    return validate_trace(path.read_text().splitlines())


def test_a_commit_whose_digest_is_not_its_decisions_is_refused(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    prompt_digests = set(records[0]["prompt_ids"])
    i = [k for k, r in enumerate(records) if r["event"] == "commit"][1]
    other = next(d for d in prompt_digests if d != records[i]["token_id"])
    records[i]["token_id"] = other
    verdict = _tampered(records, tmp_path, "commit")
    assert (verdict.accepted, verdict.code, verdict.line, verdict.event) == (False, TRACE_MISMATCH, i + 1, "commit")
    assert "token_id" in verdict.reason


def test_a_decode_launch_of_another_digest_is_refused(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    i = next(k for k, r in enumerate(records) if r["event"] == "call_launched" and r["kind"] == "decode")
    records[i]["input_ids"] = [next(d for d in records[0]["prompt_ids"] if d != records[i]["input_ids"][0])]
    verdict = _tampered(records, tmp_path, "launch")
    assert (verdict.code, verdict.line, verdict.event) == (TRACE_MISMATCH, i + 1, "call_launched")


def test_a_redacted_receipt_is_bound_by_its_content_hash(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    i = next(k for k, r in enumerate(records) if r["event"] == "decision")
    records[i]["receipt"]["support_size"] += 1
    verdict = _tampered(records, tmp_path, "receipt")
    assert (verdict.code, verdict.line) == (TRACE_RECEIPT, i + 1) and "content hash" in verdict.reason


def test_a_stream_byte_count_that_disagrees_is_refused(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    i = next(k for k, r in enumerate(records) if r["event"] == "stream")
    records[i]["text_redacted"]["bytes"] += 1
    verdict = _tampered(records, tmp_path, "stream")
    assert (verdict.code, verdict.line) == (TRACE_MISMATCH, i + 1) and "text_redacted.bytes" in verdict.reason


def test_a_token_id_in_clear_in_a_redacted_trace_is_refused(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    i = next(k for k, r in enumerate(records) if r["event"] == "commit")
    records[i]["token_id"] = 100
    verdict = _tampered(records, tmp_path, "clear")
    assert (verdict.code, verdict.line) == (TRACE_SCHEMA, i + 1) and "in clear" in verdict.reason


@pytest.mark.parametrize("data,path", [
    ({"classification": "secret", "opt_in": False}, "$.data.classification"),
    ({"classification": "redacted", "opt_in": "yes"}, "$.data.opt_in"),
    ({"classification": "synthetic", "opt_in": True}, "$.data.opt_in"),
])
def test_an_unknown_or_inconsistent_classification_is_a_typed_error(card_run, tmp_path, data, path):
    card_run = card_run[0]
    with pytest.raises(Rejection) as info:
        passport_from_json(data)
    assert (info.value.code, info.value.path) == (DATA_UNKNOWN_CLASSIFICATION, path)
    records = _records(card_run)
    records[0]["data"] = {**records[0]["data"], **data}
    verdict = _tampered(records, tmp_path, "data")
    assert (verdict.accepted, verdict.code, verdict.line) == (False, DATA_UNKNOWN_CLASSIFICATION, 1)


def test_a_redacted_trace_cannot_claim_content(card_run, tmp_path):
    card_run = card_run[0]
    records = _records(card_run)
    records[0]["data"] = {"classification": "content", "opt_in": True}
    verdict = _tampered(records, tmp_path, "claim")
    assert verdict.accepted is False and verdict.line == 1  # digests where a content trace has ids and text


# -- replay ------------------------------------------------------------------------------------


def test_replay_refuses_a_redacted_event_trace_with_trace_redacted(card_run, capsys):
    card_run = card_run[0]
    _, err = _run(capsys, ["replay", str(card_run)], 2)
    error = json.loads(err)["error"]
    assert error["code"] == TRACE_REDACTED and error["path"] == "$[0].data.classification"
    assert "--trace-content" in error["message"] and "validate-trace" in error["message"]


def test_every_corpus_trace_is_synthetic_and_a_redacted_or_unknown_one_is_refused(tmp_path, capsys):
    files = sorted(TRACES.glob("*.itf.json"))
    assert files
    for f in files:
        assert json.loads(f.read_text())["#meta"]["data"] == {"classification": "synthetic", "opt_in": False}, f.name
    trace = json.loads((TRACES / "boundary-one-token-prompt.itf.json").read_text())
    from decodespec.spec.passport import DIGEST_SCHEME, EVENT_FIELDS

    for cls, code in (("redacted", TRACE_REDACTED), ("secret", "trace.invalid_conformance_trace")):
        trace["#meta"]["data"] = {"classification": cls, "opt_in": False}
        if cls == "redacted":  # a well-formed redacted passport: refused for what it is, not for its form
            trace["#meta"]["data"].update(redacted=list(EVENT_FIELDS), digest=DIGEST_SCHEME)
        path = tmp_path / f"{cls}.itf.json"
        path.write_text(json.dumps(trace))
        _, err = _run(capsys, ["replay", str(path)], 2)
        error = json.loads(err)["error"]
        assert (error["code"], error["path"]) == (code, "$.#meta.data.classification")


def test_gate_report_lines_are_synthetic_and_checked_when_read(tmp_path):
    from decodespec.checks.docs.pages import DocsError, load_results
    from decodespec.checks.gate.cases import CaseResult, report_line
    from decodespec.checks.gate.ladder import Verdict

    verdict = Verdict.from_json({"result": "passed"})
    line = report_line(CaseResult(case="c", runtime="impl", model="tiny", result="pass", verdict=verdict))
    assert line["data"] == {"classification": "synthetic", "opt_in": False} and line["case"] == "c"
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "x.jsonl").write_text(json.dumps(line) + "\n")
    assert [r.case for r in load_results(folder)[0]] == ["c"]
    (folder / "x.jsonl").write_text(json.dumps({**line, "data": {"classification": "public"}}) + "\n")
    with pytest.raises(DocsError, match=r"x\.jsonl:1: \[data\.unknown_classification\] \$\.data\.classification"):
        load_results(folder)


# -- snapshots ---------------------------------------------------------------------------------


def test_a_default_snapshot_drops_the_prompt_text_and_still_resumes_exactly(card_result, tmp_path, capsys):
    snap = tmp_path / "s.json"
    _run(capsys, [*BASE, "--max-new-tokens", "8", "--snapshot", str(snap), "--snapshot-at", "3"])
    doc = json.loads(snap.read_text())
    assert PROMPT.encode() not in snap.read_bytes() and CARD.encode() not in snap.read_bytes()
    assert doc["data"] == snapshot_passport(False).to_json()
    assert doc["data"]["classification"] == "content" and doc["data"]["redacted"] == ["request.envelope.prompt.text"]
    assert "K/V" in doc["data"]["note"]
    assert "text" not in doc["request"]["envelope"]["prompt"] and doc["request"]["envelope_identity"] != doc["identity"]
    assert doc["identity"] == card_result["identity"]
    trace = tmp_path / "resumed.ndjson"
    out, _ = _run(capsys, ["generate", "--model", "tiny", "--device", "cpu", "--resume", str(snap), "--json", "--trace", str(trace)])
    resumed = json.loads(out)
    assert resumed["output_ids"] == card_result["output_ids"] and resumed["logprobs"] == card_result["logprobs"]
    assert resumed["identity"] == card_result["identity"]
    verdict = json.loads(_run(capsys, ["validate-trace", str(trace)])[0])
    assert verdict["accepted"] is True and verdict["classification"] == "redacted"  # a restore of digested state


def test_snapshot_content_keeps_the_prompt_text(tmp_path, capsys):
    snap = tmp_path / "s.json"
    _run(capsys, [*BASE, "--max-new-tokens", "2", "--snapshot", str(snap), "--snapshot-content"])
    doc = json.loads(snap.read_text())
    assert doc["request"]["envelope"]["prompt"]["text"] == PROMPT and "envelope_identity" not in doc["request"]
    assert doc["data"]["opt_in"] is True and "redacted" not in doc["data"]


def test_a_snapshot_with_an_unknown_classification_is_refused(tmp_path, capsys):
    from decodespec.impl.snapshot import load_snapshot

    snap = tmp_path / "s.json"
    _run(capsys, [*BASE, "--max-new-tokens", "2", "--snapshot", str(snap)])
    doc = json.loads(snap.read_text())
    doc["data"]["classification"] = "public"
    snap.write_text(json.dumps(doc))
    with pytest.raises(DecodeSpecError) as info:
        load_snapshot(snap)
    assert (info.value.code, info.value.path) == (DATA_UNKNOWN_CLASSIFICATION, "$.data.classification")


def test_a_snapshot_whose_dropped_text_is_put_back_is_refused(tmp_path, capsys):
    from decodespec.impl.snapshot import load_snapshot

    snap = tmp_path / "s.json"
    _run(capsys, [*BASE, "--max-new-tokens", "2", "--snapshot", str(snap)])
    doc = json.loads(snap.read_text())
    doc["request"]["envelope"]["prompt"]["text"] = "another prompt"
    snap.write_text(json.dumps(doc))
    with pytest.raises(DecodeSpecError) as info:
        load_snapshot(snap)
    assert info.value.path == "$.request.envelope_identity"


# -- error messages and the pure pieces ---------------------------------------------------------


def test_an_envelope_error_quotes_user_content_as_length_and_fingerprint(capsys):
    stop = f"my card is {CARD} " * 40
    _, err = _run(capsys, [*BASE, "--stop", stop], 2)
    error = json.loads(err)["error"]
    assert "4111" not in err and "my card" not in err
    assert error["path"] == "$.termination.stop_strings[0]"
    assert f"{len(stop)} chars, sha256 {hashlib.sha256(stop.encode()).hexdigest()[:8]}" in error["message"]


def test_quote_content_and_content_paths():
    assert quote_content(PROMPT) == f"<content: {len(PROMPT)} chars, sha256 {hashlib.sha256(PROMPT.encode()).hexdigest()[:8]}>"
    assert "4111" not in quote_content([4111, 1111])
    assert is_content_path("$.prompt.text") and is_content_path("$.termination.stop_strings[2]") and is_content_path("$.prompt")
    assert not is_content_path("$.termination.max_new_tokens") and not is_content_path("$.prompts")


def test_the_redactor_is_keyed_and_keeps_eos_in_clear():
    header = {"event": "request", "eos_ids": [2], "identity": "sha256:" + "0" * 64, "prompt_ids": [5, 2]}
    a, b = Redactor(b"a" * 32).for_request(header), Redactor(b"b" * 32).for_request(header)
    assert a.event(header)["prompt_ids"] == [a.token(5), 2] and a.event(header)["data"]["clear_ids"] == [2]
    assert header["prompt_ids"] == [5, 2]  # pure: the record is not changed
    assert a.token(2) == 2 and a.token(5) == a.token(5) != b.token(5)
    assert a.token(5) != a.token(6) and a.token(5).startswith("tok:") and len(a.token(5)) == 28
    assert a.text("hi") == {"digest": a.text("hi")["digest"], "bytes": 2} and a.text("hi") != b.text("hi")
    # 49,152 candidate ids, none of which recomputes a digest under another key.
    target = a.token(12345)
    assert all(b.token(t) != target for t in range(0, 49152, 7))


def test_a_redacted_passport_that_misstates_its_fields_or_clear_ids_is_refused(card_run, tmp_path):
    """Found by the long trace fuzz (seed 41): a passport with an entry of ``redacted`` dropped or renamed, or an extra
    id in ``clear_ids`` (which would let that id stand in clear), was accepted."""
    card_run = card_run[0]
    records = _records(card_run)
    for change in ({"redacted": records[0]["data"]["redacted"][1:]}, {"redacted": records[0]["data"]["redacted"] + ["x"]},
                   {"clear_ids": records[0]["data"]["clear_ids"] + [100]}, {"digest": "sha1"}):
        tampered = json.loads(json.dumps(records))
        tampered[0]["data"].update(change)
        verdict = _tampered(tampered, tmp_path, "passport")
        assert verdict.line == 1 and verdict.code in ("data.unknown_classification", TRACE_SCHEMA), (change, verdict)
