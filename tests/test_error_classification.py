"""Error messages declare their data classification and quote no user content (issue 16 item 5, the trace passport).

Every typed error a CLI surface prints carries ``data: "redacted"`` (``spec/errors.py``
MESSAGE_CLASSIFICATION) and shows a value that is user content -- prompt text, token ids, stop
strings, decoded text -- as its length and a SHA-256 fingerprint (``quote_content``), never raw.
Each test feeds a card number through one surface's error path (validate, generate --request,
generate --resume = snapshot restore, validate-trace, replay, judge) and asserts that no spelling of
it (the digits, the text, a run of its token ids) reaches stdout or stderr.

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data"; issue 16 deliverable 5.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.impl.tiny import TINY_VOCAB_SIZE
from decodespec.impl.tokenizer import ByteTokenizer

CARD = "4111 1111 1111 1111"
PROMPT = f"my card is {CARD}"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = json.loads((ROOT / "docs" / "examples" / "tiny.request.json").read_text())
BASE = ["generate", "--model", "tiny", "--device", "cpu", "--prompt", PROMPT]
CARD_IDS = ByteTokenizer(TINY_VOCAB_SIZE).encode(CARD)


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


def _assert_no_card(text: str) -> None:
    for needle in (CARD, CARD.replace(" ", ""), "4111", "1111 1111", "my card"):
        assert needle not in text, (needle, text[:2000])
    for sep in (",", ", ", " "):
        assert sep.join(map(str, CARD_IDS[:4])) not in text, text[:2000]


def _errors(text: str) -> list[dict]:
    """Every error object printed (``{"error": {...}}`` lines, or a rejected verdict)."""
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            out.append(doc["error"])
    return out


def _envelopes() -> list[dict]:
    card_ids = [1, *CARD_IDS]
    base = json.loads(json.dumps(EXAMPLE))
    base["prompt"] = {"input_ids": card_ids, "attention_mask": [1] * len(card_ids), "text": PROMPT}
    variants = []
    v = json.loads(json.dumps(base)); v["prompt"]["input_ids"] = [*card_ids[:-1], 10**6]; variants.append(v)      # an id out of the vocabulary
    v = json.loads(json.dumps(base)); v["termination"]["stop_strings"] = [PROMPT, PROMPT]; variants.append(v)    # a repeated stop string
    v = json.loads(json.dumps(base)); v["termination"]["stop_strings"] = [PROMPT * 400]; variants.append(v)      # a stop string too long
    v = json.loads(json.dumps(base)); v["annotations"] = {"note": 5, "card": [PROMPT]}; variants.append(v)       # mistyped annotations
    v = json.loads(json.dumps(base)); v["prompt"]["text"] = 5; variants.append(v)                               # mistyped text
    v = json.loads(json.dumps(base)); v["prompt"]["input_ids"] = [*card_ids, "4111"]; variants.append(v)         # a string among ids
    v = json.loads(json.dumps(base)); v["prompt"]["attention_mask"] = [1]; variants.append(v)                    # mask of another length
    return variants


@pytest.mark.parametrize("index", range(len(_envelopes())))
@pytest.mark.parametrize("surface", ["validate", "generate --request"])
def test_an_envelope_error_quotes_no_card_number(tmp_path, surface, index):
    path = tmp_path / "card.request.json"
    path.write_text(json.dumps(_envelopes()[index]))
    argv = ["validate", str(path)] if surface == "validate" else ["generate", "--model", "tiny", "--device", "cpu", "--request", str(path)]
    code, text = _run(argv)
    assert code == 2, text[:2000]
    errors = _errors(text)
    assert errors and all(e["data"] == "redacted" and e["code"] for e in errors), text[:2000]
    _assert_no_card(text)


@pytest.fixture(scope="module")
def card_snapshot(tmp_path_factory):
    folder = tmp_path_factory.mktemp("card-snap")
    path = folder / "card.json"
    code, _ = _run([*BASE, "--max-new-tokens", "6", "--snapshot", str(path), "--snapshot-at", "3"])
    assert code == 0
    return path


@pytest.mark.parametrize("tamper", ["observer_output", "receipt_selected", "prompt_id_string", "prompt_id_negative", "request_edit"])
def test_a_snapshot_restore_error_quotes_no_card_number(card_snapshot, tmp_path, tamper):
    doc = json.loads(card_snapshot.read_text())
    doc["request"]["prompt_ids"] = [1, *CARD_IDS]  # the card's ids are in the ledger the messages talk about
    if tamper == "observer_output":
        doc["observer"]["output_ids"][0] = CARD_IDS[0]
    elif tamper == "receipt_selected":
        doc["receipts"][0]["selected_id"] = CARD_IDS[0]
    elif tamper == "prompt_id_string":
        doc["request"]["prompt_ids"][2] = CARD
    elif tamper == "prompt_id_negative":
        doc["request"]["prompt_ids"][2] = -int(CARD.replace(" ", ""))
    path = tmp_path / "card.json"
    (tmp_path / card_snapshot.name).with_suffix(".json.safetensors")
    for sibling in card_snapshot.parent.iterdir():
        if sibling.name.endswith(".safetensors"):
            (tmp_path / sibling.name).write_bytes(sibling.read_bytes())
    path.write_text(json.dumps(doc))
    code, text = _run(["generate", "--model", "tiny", "--device", "cpu", "--resume", str(path)])
    assert code == 2, text[:2000]
    errors = _errors(text)
    assert errors and all(e["data"] == "redacted" for e in errors), text[:2000]
    _assert_no_card(text)


@pytest.fixture(scope="module")
def card_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("card-trace") / "card.ndjson"
    code, _ = _run([*BASE, "--max-new-tokens", "8", "--stream", "--stop", CARD, "--trace-content", "--trace", str(path)])
    assert code == 0
    return path


@pytest.mark.parametrize("tamper", ["launch_ids", "prompt_id_string", "stream_text", "stream_text_type", "commit_token", "stop_string"])
def test_a_validate_trace_reason_quotes_no_card_number(card_trace, tmp_path, tamper):
    records = [json.loads(line) for line in card_trace.read_text().splitlines()]
    launch = next(r for r in records if r["event"] == "call_launched" and r["kind"] == "prefill")
    if tamper == "launch_ids":
        launch["input_ids"] = list(reversed(launch["input_ids"]))
    elif tamper == "prompt_id_string":
        records[0]["prompt_ids"][3] = CARD
    elif tamper in ("stream_text", "stream_text_type"):
        chunk = next(r for r in records if r["event"] == "stream")
        chunk["text"] = PROMPT if tamper == "stream_text" else [PROMPT]
    elif tamper == "commit_token":
        commit = next(r for r in records if r["event"] == "commit")
        commit["token_id"] = CARD_IDS[0]
    else:
        records[0]["output"]["stop_strings"] = [5, CARD]
    path = tmp_path / "card.ndjson"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, text = _run(["validate-trace", str(path), "--tokenizer", "tiny"])
    assert code == 1, text[:2000]
    verdict = json.loads(text.splitlines()[0])
    assert verdict["accepted"] is False and verdict["data"] == "redacted", verdict
    _assert_no_card(text)


def test_a_replay_load_error_quotes_no_card_number(tmp_path):
    doc = json.loads(next((ROOT / "traces").glob("*.itf.json")).read_text())
    doc["#meta"]["config"]["prompt_ids"] = [PROMPT]
    path = tmp_path / "card.itf.json"
    path.write_text(json.dumps(doc))
    code, text = _run(["replay", str(path)])
    assert code != 0
    errors = _errors(text)
    assert errors and all(e["data"] == "redacted" for e in errors), text[:2000]
    _assert_no_card(text)


def test_a_judge_error_quotes_no_card_number(tmp_path):
    envelope = _envelopes()[0]
    envelope["prompt"]["input_ids"][-1] = CARD_IDS[-1]
    request = tmp_path / "card.request.json"
    request.write_text(json.dumps(envelope))
    rows = tmp_path / "card.rows.ndjson"
    code, text = _run(["judge", str(rows), "--record", str(request), "--model", "tiny"])
    assert code == 0, text[:2000]
    lines = rows.read_text().splitlines()
    header = json.loads(lines[0])
    header["request"]["prompt"]["text"] = [PROMPT]  # a mistyped envelope field holding the card
    rows.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    code, text = _run(["judge", str(rows)])
    assert code == 2, text[:2000]
    errors = _errors(text)
    assert errors and all(e["data"] == "redacted" for e in errors), text[:2000]
    _assert_no_card(text)
