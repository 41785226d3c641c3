"""Receipts reference the policy by digest (issue 16 item 4, bounded output): sizes and every reader.

A receipt carries ``policy_digest`` (the content hash of the whole policy) and the names of the
transforms that ran; the policy is written once per output (``generate --json``'s ``policy``, the
trace header, the snapshot's request).  Output bytes are then O(tokens) + |policy| instead of
O(tokens x |policy|): for the tiny model, a 4,096-state automaton and 16 tokens, ``--json`` fell
from 18,057,615 bytes to 1,080,463 (1,061,369 of them the policy, written once) and the trace
from 15,776,904 to 962,504 (docs/results/receipt-digest.md).

Source: M3.8 0x0B (the receipt binds the ordered transforms and parameters), M3.10 0x08 (the
receipt binds ... ordered transforms, parameters), 0x06 "Bound parsers, matchers, traces, and
sensitive data" (total returned bytes).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import attrs
import pytest
from runtime_helpers import renumber, request  # tests/ is on sys.path

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.trace_validation import TRACE_RECEIPT, validate_trace
from decodespec.impl.events import ListSink
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import policy_config_from_json
from decodespec.spec.policy.receipt import content_id, policy_digest, receipt_policy_mismatch
from decodespec.spec.snapshot import SNAPSHOT_LEDGER_INVALID

TOKENS = 12


def _automaton(states: int, edges: int) -> dict:
    """A constraint automaton over tiny-model ids 3..502: ``states`` states with ``edges`` edges each, a ring."""
    return {"initial": "s0", "transitions": {f"s{i}": {str(3 + (i * edges + j) % 500): f"s{(i + 1) % states}" for j in range(edges)}
                                             for i in range(states)}}


@pytest.fixture(scope="module")
def big_request(tmp_path_factory):
    env = json.loads(Path("docs/examples/tiny.request.json").read_text())
    env["policy"] = {"family": "greedy", "transforms": [{"name": "constraint", "automaton": _automaton(4096, 4)}]}
    env["termination"]["max_new_tokens"] = TOKENS
    env["output"]["stream"] = False
    path = tmp_path_factory.mktemp("big") / "big.request.json"
    path.write_text(json.dumps(env))
    return path


def test_generate_json_is_bounded_by_the_policy_once_plus_o_tokens(capsys, big_request, tmp_path):
    trace = tmp_path / "t.trace"
    assert main(["generate", "--model", "tiny", "--request", str(big_request), "--device", "cpu", "--json", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out)
    policy_bytes = len(json.dumps(payload["policy"]))
    assert policy_bytes > 100_000  # the automaton is big ...
    assert len(payload["receipts"]) == payload["num_committed"] == TOKENS
    # ... but it is written once: the receipts take O(tokens), not O(tokens x policy).
    assert len(json.dumps(payload["receipts"])) < TOKENS * 2048
    assert len(out) < policy_bytes + TOKENS * 4096
    assert trace.stat().st_size < policy_bytes + TOKENS * 8192
    digest = policy_digest(policy_config_from_json(payload["policy"]))
    assert {r["policy_digest"] for r in payload["receipts"]} == {digest}
    assert all(r["transforms"] == ["constraint", "min_new_tokens"] for r in payload["receipts"])  # the envelope's min_new_tokens = 1
    assert validate_trace(trace.read_text().splitlines()).accepted


def test_receipt_policy_mismatch_reads_both_forms():
    policy = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.7},
                                                                             {"name": "top_k", "k": 5}]})
    digest = policy_digest(policy)
    assert digest == content_id(policy.to_json())
    assert receipt_policy_mismatch({"policy_digest": digest, "transforms": ["temperature", "top_k"]}, policy) is None
    assert receipt_policy_mismatch({"policy_digest": digest, "transforms": ["top_k"]}, policy) is None  # a skipped transform
    assert receipt_policy_mismatch({"policy_digest": digest, "transforms": ["top_k", "temperature"]}, policy)[0] == "transforms"
    assert receipt_policy_mismatch({"policy_digest": digest, "transforms": [{"name": "top_k", "k": 5}]}, policy)[0] == "transforms"
    other = policy_digest(policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.7},
                                                                                          {"name": "top_k", "k": 6}]}))
    assert receipt_policy_mismatch({"policy_digest": other, "transforms": ["top_k"]}, policy)[0] == "policy_digest"
    # The older embedded form: each applied transform's JSON, checked against the written policy's.
    assert receipt_policy_mismatch({"transforms": [{"name": "top_k", "k": 5}]}, policy) is None
    assert receipt_policy_mismatch({"transforms": [{"name": "top_k", "k": 6}]}, policy)[0] == "transforms"


# -- validate-trace ---------------------------------------------------------------------------


def _sampled_policy():
    return policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.8},
                                                                           {"name": "top_k", "k": 40}]})


@pytest.fixture(scope="module")
def trace_records(tiny_model):
    sink = ListSink()
    RequestRunner(tiny_model, request((1, 40, 41, 42), 4, policy=_sampled_policy()), sink=sink).run()
    return [json.loads(line) for line in sink.lines()]


def _edit_receipt(records, fn):
    """Apply ``fn`` to the first decision's receipt and re-seal its content hash (a careful forger)."""
    records = copy.deepcopy(records)
    decision = next(r for r in records if r["event"] == "decision")
    receipt = decision["receipt"]
    fn(receipt)
    receipt["receipt_id"] = content_id({k: v for k, v in receipt.items() if k != "receipt_id"})
    return records


def test_a_trace_receipt_names_the_header_policy(trace_records):
    decision = next(r for r in trace_records if r["event"] == "decision")
    header_policy = policy_config_from_json(trace_records[0]["policy"])
    assert decision["receipt"]["policy_digest"] == policy_digest(header_policy)
    assert decision["receipt"]["transforms"] == ["temperature", "top_k"]
    assert validate_trace(renumber(trace_records)).accepted


@pytest.mark.parametrize("name, fn, field", [
    ("another policy", lambda r: r.update(policy_digest="sha256:" + "0" * 64), "receipt.policy_digest"),
    ("a transform the policy lacks", lambda r: r.update(transforms=["temperature", "top_p"]), "receipt.transforms"),
    ("reordered", lambda r: r.update(transforms=["top_k", "temperature"]), "receipt.transforms"),
    ("old form with another parameter", lambda r: (r.pop("policy_digest"), r.update(transforms=[{"name": "temperature", "temperature": 0.9}])),
     "receipt.transforms"),
])
def test_a_receipt_naming_another_policy_is_refused(trace_records, name, fn, field):
    verdict = validate_trace(renumber(_edit_receipt(trace_records, fn)))
    assert not verdict.accepted and verdict.code == TRACE_RECEIPT and field in verdict.reason, (name, verdict.reason)


def test_the_header_policy_changed_under_its_receipts_is_refused(trace_records):
    records = copy.deepcopy(trace_records)
    records[0]["policy"]["transforms"][1]["k"] = 41
    verdict = validate_trace(renumber(records))
    assert not verdict.accepted and verdict.code == TRACE_RECEIPT and "receipt.policy_digest" in verdict.reason


def test_an_old_form_trace_receipt_is_still_read(trace_records):
    def embed(receipt):
        del receipt["policy_digest"]
        receipt["transforms"] = [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}]

    assert validate_trace(renumber(_edit_receipt(trace_records, embed))).accepted


# -- snapshots ----------------------------------------------------------------------------------


@pytest.fixture
def suspended(tiny_model):
    runner = RequestRunner(tiny_model, request((1, 40, 41, 42), 4, policy=_sampled_policy())).run(max_outputs=2)
    return runner.snapshot("pending_suffix")


def _with_receipt(snapshot, fn):
    receipts = [dict(r) for r in snapshot.receipts]
    fn(receipts[-1])
    receipts[-1]["receipt_id"] = content_id({k: v for k, v in receipts[-1].items() if k != "receipt_id"})
    return attrs.evolve(snapshot, receipts=tuple(receipts))


def test_a_snapshot_receipt_naming_another_policy_is_refused(tiny_model, suspended):
    assert {r["policy_digest"] for r in suspended.receipts} == {policy_digest(_sampled_policy())}
    bad = _with_receipt(suspended, lambda r: r.update(policy_digest="sha256:" + "1" * 64))
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, bad)
    assert info.value.code == SNAPSHOT_LEDGER_INVALID and info.value.path == "$.receipts[1].policy_digest"
    reordered = _with_receipt(suspended, lambda r: r.update(transforms=["top_k", "temperature"]))
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, reordered)
    assert info.value.code == SNAPSHOT_LEDGER_INVALID and info.value.path == "$.receipts[1].transforms"


def test_an_old_form_snapshot_receipt_is_still_read(tiny_model, suspended):
    def embed(receipt):
        del receipt["policy_digest"]
        receipt["transforms"] = [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}]

    restored = RequestRunner.restore(tiny_model, _with_receipt(suspended, embed)).run()
    assert len(restored.output_ids) == 4
