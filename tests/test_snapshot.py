"""Snapshots: resume equivalence for both forms at every step, and typed refusals of bad snapshots.

* M3.10 0x0BA "A completed output is not automatically a resumable snapshot" / RESUME level:
  ``Continue(Restore(S), n) == Continue(S, n)`` -- restoring a snapshot written to disk (JSON +
  safetensors) and continuing gives the same tokens and logprobs as never stopping, for greedy
  and seeded sampling, at every step, in both forms, for every cache family (tiny model), and
  on SmolLM2 (one economical case per form).
* The repaired form is made by a valid append call, never by relabelling; a finished request
  without a repair promise has no repaired form.
* Restore refuses, before building anything: another identity, another cache ABI or family, a
  frontier with ``P + |U| != L + O``, a cache holding other than P rows, a pending token in a
  "repaired" snapshot, a ledger whose RNG counter or logprobs do not line up, a malformed or
  altered file.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from runtime_helpers import request, sampled_policy  # tests/ is on sys.path

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.runtime import RequestRunner
from decodespec.impl.snapshot import load_snapshot, save_snapshot
from decodespec.spec.enums import PendingTag
from decodespec.spec.errors import Rejection

G = 5


def _resume_equals_uninterrupted(model, req, tmp_path, steps, forms=("pending_suffix", "repaired")):
    full = RequestRunner(model, req).run()
    checked = 0
    for k in steps:
        for form in forms:
            first = RequestRunner(model, req).run(max_outputs=k)
            snapshot = first.snapshot(form)
            path = tmp_path / f"{form}-{k}.json"
            save_snapshot(snapshot, path)
            loaded = load_snapshot(path)
            record = loaded.record
            if form == "repaired":  # the append call ran: nothing pending, P = L + O (or the prompt is not yet prefilled)
                assert record.pending_ids == () and record.processed == (len(req.prompt_ids) + record.output_count if k else 0)
            else:
                assert record.processed + len(record.pending_ids) == (len(req.prompt_ids) + record.output_count if k else 0)
            resumed = RequestRunner.restore(model, loaded).run()
            assert resumed.output_ids == full.output_ids, (form, k)
            assert resumed.logprobs == full.logprobs, (form, k)
            assert resumed.finish_reason is full.finish_reason and resumed.policy_state == full.policy_state
            assert resumed.frontier() == full.frontier()
            checked += 1
    return checked


@pytest.mark.parametrize("family", ["none", "dynamic", "static"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_resume_equals_never_stopping_at_every_step(tiny_model, byte_tokenizer, tmp_path, family, sampled):
    prompt = [1, *byte_tokenizer.encode("resume me")]
    extra = {"policy": sampled_policy()} if sampled else {}
    req = request(prompt, G, cache=family, prefill_chunk=4 if family != "none" else None, **extra)
    assert _resume_equals_uninterrupted(tiny_model, req, tmp_path, range(G)) == 2 * G


def test_snapshot_at_finish_and_the_repaired_form_after_finish(tiny_model, byte_tokenizer, tmp_path):
    """At finish: pending_suffix keeps [u_O] CLOSED_UNPROCESSED; repaired needs the declared repair call."""
    prompt = [1, *byte_tokenizer.encode("finish")]
    done = RequestRunner(tiny_model, request(prompt, 3)).run()
    pending = done.snapshot("pending_suffix")
    assert pending.record.pending_tag is PendingTag.CLOSED_UNPROCESSED and pending.record.processed == len(prompt) + 2
    with pytest.raises(Rejection) as info:
        done.snapshot("repaired")
    assert info.value.code == "snapshot.form_unavailable" and done.processed == len(prompt) + 2  # nothing relabelled
    promised = RequestRunner(tiny_model, request(prompt, 3, final_cache="all_outputs"))
    promised.run()  # run() performs the owed repair call
    repaired = promised.snapshot("repaired")
    assert repaired.record.pending_ids == () and repaired.record.processed == len(prompt) + 3
    save_snapshot(repaired, tmp_path / "r.json")
    restored = RequestRunner.restore(tiny_model, load_snapshot(tmp_path / "r.json"))
    assert restored.terminal() and restored.output_ids == promised.output_ids and restored.cache.committed_length == len(prompt) + 3


def test_snapshot_refused_in_flight_and_after_a_decision(tiny_model, byte_tokenizer):
    runner = RequestRunner(tiny_model, request([1, *byte_tokenizer.encode("busy")], 3))
    runner.admit()
    runner.launch()
    for form in ("pending_suffix", "repaired", "other"):
        with pytest.raises(Rejection) as info:
            runner.snapshot(form)
        assert info.value.code == "snapshot.form_unavailable"
    runner.complete()
    with pytest.raises(Rejection):
        runner.snapshot("pending_suffix")  # a consumable score: only the repaired form carries it
    assert runner.snapshot("repaired").score_logits is not None
    runner.decide()
    with pytest.raises(Rejection):
        runner.snapshot("repaired")


@pytest.fixture
def saved(tiny_model, byte_tokenizer, tmp_path):
    """A pending-suffix snapshot of a static-cache run after 2 outputs, on disk; returns (path, document)."""
    runner = RequestRunner(tiny_model, request([1, *byte_tokenizer.encode("tamper")], G, cache="static")).run(max_outputs=2)
    path = tmp_path / "s.json"
    save_snapshot(runner.snapshot("pending_suffix"), path)
    return path, json.loads(path.read_text())


def _edit(path, doc, fn):
    edited = json.loads(json.dumps(doc))
    fn(edited)
    path.write_text(json.dumps(edited))
    return path


@pytest.mark.parametrize("code, fn", [
    ("snapshot.identity_mismatch", lambda d: d["state"].update(identity="sha256:" + "f" * 64)),
    ("snapshot.frontier_invalid", lambda d: d["state"].update(processed=d["state"]["processed"] + 1)),
    ("snapshot.frontier_invalid", lambda d: d["state"].update(pending_ids=[], pending_tag="EMPTY")),
    ("snapshot.pending_invalid", lambda d: d["state"].update(form="repaired")),
    ("snapshot.pending_invalid", lambda d: d["state"].update(pending_ids=[d["state"]["output_ids"][0]])),
    ("snapshot.ledger_invalid", lambda d: d["state"].update(rng_counter=1)),
    ("snapshot.ledger_invalid", lambda d: d.update(logprobs=d["logprobs"][:-1])),
    ("snapshot.abi_mismatch", lambda d: d["cache"]["abi"].update(keys_rotated=False)),
    ("snapshot.abi_mismatch", lambda d: d["cache"].update(capacity=d["cache"]["capacity"] + 1)),
    ("snapshot.malformed", lambda d: d["state"].pop("generation")),
    ("snapshot.malformed", lambda d: d["cache"].update(sha256="sha256:" + "0" * 64)),
], ids=["identity", "processed+1", "pending-dropped", "repaired-with-pending", "pending-not-suffix", "rng-counter",
        "logprob-missing", "abi", "capacity", "missing-field", "tensor-hash"])
def test_restore_refuses_a_bad_snapshot_before_building_state(tiny_model, saved, code, fn):
    path, doc = saved
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, load_snapshot(_edit(path, doc, fn)))
    assert info.value.code == code


def test_restore_refuses_another_request_and_a_model_of_another_abi(tiny_model, byte_tokenizer, saved):
    path, _ = saved
    snapshot = load_snapshot(path)
    other = attrs.evolve(snapshot.request, identity="other")
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, snapshot, other)
    assert info.value.code == "snapshot.identity_mismatch"
    from decodespec.impl.tiny import load_tiny

    bf16 = load_tiny(seed=0, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(bf16, snapshot)
    assert info.value.code == "snapshot.abi_mismatch"
    with pytest.raises(Rejection) as info:
        load_snapshot(path.with_name("absent.json"))
    assert info.value.code == "snapshot.malformed"


@requires_smollm2
@pytest.mark.smollm2
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_smollm2_resume_equivalence(smollm2_model, smollm2_tokenizer, tmp_path, sampled):
    """SmolLM2: resuming after 2 of 4 tokens, both forms, equals the uninterrupted run."""
    prompt = [1, *smollm2_tokenizer.encode("The capital of France is")]
    extra = {"policy": sampled_policy()} if sampled else {}
    req = request(prompt, 4, cache="static", **extra)
    assert _resume_equals_uninterrupted(smollm2_model, req, tmp_path, [2]) == 2
