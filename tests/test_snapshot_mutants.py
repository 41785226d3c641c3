"""Checks written against the survivors of the sampled Cosmic Ray session on ``impl/snapshot.py``.

Each test's docstring names the mutants it kills (``line operator occurrence``, line numbers of
``impl/snapshot.py`` at commit 61ec8ad).  The screen (``checks/lab/mutation/snapshot.toml``) resumes
every step and refuses a table of tampered files by code; what it did not reach: counters past 256
(where ``is`` and ``==`` differ for ints), a snapshot of a runner that was itself restored (fewer
receipts than outputs), and the path a refusal names.

Source: docs/results/mutation-sampled-runtime-snapshot-model.md (issue 15 item 5); M3.10 0x0BA
"A completed output is not automatically a resumable snapshot".
"""

from __future__ import annotations

import json

import pytest
from runtime_helpers import request  # tests/ is on sys.path

from decodespec.impl.runtime import RequestRunner
from decodespec.impl.snapshot import load_snapshot, save_snapshot
from decodespec.spec.errors import Rejection

PROMPT = (1, 70, 71, 72)


def _saved(model, tmp_path, *, form="pending_suffix", outputs=2, cache="dynamic", name="s.json", **changes):
    runner = RequestRunner(model, request(PROMPT, 5, cache=cache, **changes)).run(max_outputs=outputs)
    path = tmp_path / name
    save_snapshot(runner.snapshot(form), path)
    return path, json.loads(path.read_text())


def _write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def _refusal(model, path) -> Rejection:
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(model, load_snapshot(path))
    return info.value


def test_a_scored_snapshot_past_generation_256_restores(tiny_model, tmp_path):
    """A consumable score at generation 300 (JSON ints past 256 are distinct objects) is the record's own row.

    The same file with the score (and its row) one generation behind is refused at
    ``$.state.score``.  Kills 711 ``ReplaceComparisonOperator_NotEq_IsNot`` 34 (``is not`` on the
    generation) and 711 ``ReplaceComparisonOperator_NotEq_Gt`` 38 (an older score passed on to the
    generation check, ``$.state.generation``).
    """
    path, doc = _saved(tiny_model, tmp_path, form="repaired")
    state = doc["state"]
    assert state["phase"] == "scored" and state["num_retries"] == 0
    big = json.loads(json.dumps(doc).replace('"generation": 3', '"generation": 300').replace('"num_calls": 3', '"num_calls": 300'))
    assert big["state"]["generation"] == big["state"]["score"]["generation"] == big["state"]["num_calls"] == 300
    runner = RequestRunner.restore(tiny_model, load_snapshot(_write(path, big)))
    assert runner.phase.value == "scored" and runner.state().generation == 300 and runner.score.generation == 300
    behind = json.loads(json.dumps(big))  # the score row and the consumable score agree, one generation behind the record
    behind["state"]["score"]["generation"] = behind["state"]["scores"][-1]["generation"] = 299
    error = _refusal(tiny_model, _write(path, behind))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.state.score")


def test_a_snapshot_of_a_restored_runner_has_fewer_receipts_than_outputs_and_resumes(tiny_model, tmp_path):
    """A restored runner holds the receipts of the tokens it decided itself: its snapshot restores and resumes exactly.

    More receipts than outputs is ``snapshot.ledger_invalid`` at ``$.receipts``.  Kills 775
    ``ReplaceComparisonOperator_Gt_Lt`` 9.
    """
    req = request(PROMPT, 5, cache="dynamic")
    full = RequestRunner(tiny_model, req).run()
    path, _ = _saved(tiny_model, tmp_path, outputs=2)
    second = RequestRunner.restore(tiny_model, load_snapshot(path)).run(max_outputs=3)
    again = tmp_path / "again.json"
    save_snapshot(second.snapshot("pending_suffix"), again)
    doc = json.loads(again.read_text())
    assert len(doc["receipts"]) == 1 and len(doc["state"]["output_ids"]) == 3
    resumed = RequestRunner.restore(tiny_model, load_snapshot(again)).run()
    assert resumed.output_ids == full.output_ids and resumed.logprobs == full.logprobs
    doc["receipts"] = doc["receipts"] * 4
    error = _refusal(tiny_model, _write(again, doc))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.receipts")


@pytest.mark.parametrize("where, value, path, message", [
    (("cache", "capacity"), "4", "$.cache.capacity", "capacity must be int or null, got str"),
    (("cache", "num_layers"), None, "$.cache.num_layers", "num_layers must be int, got NoneType"),
    (("policy_state", "mirostat_mu"), "1", "$.policy_state.mirostat_mu", "mirostat_mu must be int or float or null, got str"),
])
def test_a_mistyped_field_is_malformed_at_that_field(tiny_model, tmp_path, where, value, path, message):
    """``snapshot.malformed`` names the field and the JSON types it takes (``null`` for None).

    Kills 558 ``ReplaceComparisonOperator_Is_LtE`` 2 (``type <= type`` raises, and the catch-all
    reports ``$``).
    """
    file, doc = _saved(tiny_model, tmp_path)
    doc[where[0]][where[1]] = value
    with pytest.raises(Rejection) as info:
        load_snapshot(_write(file, doc))
    assert (info.value.code, info.value.path) == ("snapshot.malformed", path)
    assert message in str(info.value)


def test_rng_counters_past_256_restore(tiny_model, tmp_path):
    """A sampled request whose RNG counter starts at 300: the record's and the policy state's counters agree by value.

    Kills 697 ``ReplaceComparisonOperator_NotEq_IsNot`` 27 (``is not`` between two JSON ints past 256).
    """
    from runtime_helpers import sampled_policy

    req = request(PROMPT, 5, cache="dynamic", policy=sampled_policy(), rng_counter_start=300)
    full = RequestRunner(tiny_model, req).run()
    first = RequestRunner(tiny_model, req).run(max_outputs=2)
    path = tmp_path / "rng.json"
    save_snapshot(first.snapshot("pending_suffix"), path)
    loaded = load_snapshot(path)
    assert loaded.record.rng_counter == loaded.policy_state.rng_counter == 302
    resumed = RequestRunner.restore(tiny_model, loaded).run()
    assert resumed.output_ids == full.output_ids and resumed.policy_state == full.policy_state


@pytest.mark.parametrize("ids", [[300, 301], [0, 511]], ids=["past-256", "vocabulary-ends"])
def test_token_ids_past_256_and_at_the_vocabulary_ends_restore(tiny_model, tmp_path, ids):
    """Outputs with ids past 256 (JSON ints that are distinct objects), or ids 0 and ``V - 1``, line up and are in range.

    A snapshot without decision receipts (as a restored runner's before it decides) whose outputs
    are renamed everywhere (outputs, consumed receipts, the observer) restores.  Kills 680
    ``ReplaceComparisonOperator_NotEq_IsNot`` 22 and 731 ``ReplaceComparisonOperator_LtE_NotEq`` 6
    (id 0 taken for out of range).
    """
    path, doc = _saved(tiny_model, tmp_path, outputs=2)
    state = doc["state"]
    assert len(state["output_ids"]) == 2 and state["pending_ids"] == state["output_ids"][-1:]
    state["output_ids"], state["pending_ids"] = ids, ids[-1:]
    for receipt, token in zip(state["consumed"], ids):
        receipt["token_id"] = token
    doc["receipts"] = []
    if doc["observer"] is not None:
        doc["observer"]["output_ids"] = ids
    runner = RequestRunner.restore(tiny_model, load_snapshot(_write(path, doc)))
    assert list(runner.output_ids) == ids and list(runner.pending_ids) == ids[-1:]


def test_a_prefilled_prompt_with_no_output_and_nothing_pending_is_refused_at_the_pending_ids(tiny_model, tmp_path):
    """Chunked prefill: READY with ``P = L``, ``O = 0`` and no pending token is not between chunks (``$.state.pending_ids``).

    Between chunks (``0 < P < L``) a snapshot restores; at ``P = L`` the decision row is owed, so
    the record is ``snapshot.frontier_invalid`` at ``$.state.pending_ids``, before the cache rows
    are compared.  Kills 642 ``ReplaceComparisonOperator_Lt_LtE`` 1.
    """
    prompt = (1, 70, 71, 72, 73, 74, 75, 76)
    runner = RequestRunner(tiny_model, request(prompt, 5, cache="dynamic", prefill_chunk=4))
    while runner.processed < 4:
        runner.step()
    path = tmp_path / "chunk.json"
    save_snapshot(runner.snapshot("pending_suffix"), path)
    doc = json.loads(path.read_text())
    assert doc["state"]["processed"] == 4 and doc["state"]["phase"] == "ready"
    assert RequestRunner.restore(tiny_model, load_snapshot(path)).processed == 4
    doc["state"]["processed"] = len(prompt)
    error = _refusal(tiny_model, _write(path, doc))
    assert (error.code, error.path) == ("snapshot.frontier_invalid", "$.state.pending_ids")


def test_a_snapshot_after_a_retried_device_fault_restores(tiny_model, tmp_path):
    """``num_retries = 1`` (a device fault on call 1, retried) is within ``max_retries``: restore and resume exactly.

    Kills 735 ``ReplaceComparisonOperator_LtE_Is`` 6 (``0 is num_retries`` holds for 0 only).
    """
    from decodespec.impl.faults import DeviceFault, FaultPlan

    req = request(PROMPT, 5, cache="dynamic", max_retries=1)
    full = RequestRunner(tiny_model, req).run()
    first = RequestRunner(tiny_model, req, faults=FaultPlan.of(DeviceFault(1))).run(max_outputs=3)
    assert first.num_retries == 1
    path = tmp_path / "retried.json"
    save_snapshot(first.snapshot("pending_suffix"), path)
    resumed = RequestRunner.restore(tiny_model, load_snapshot(path))
    assert resumed.num_retries == 1
    resumed.run()
    assert resumed.output_ids == full.output_ids and resumed.logprobs == full.logprobs


@pytest.mark.parametrize("reason", ["timeout", "cancelled", "eos"])
def test_a_finish_reason_that_is_not_the_published_trigger_is_refused(tiny_model, tmp_path, reason):
    """A finished (``length``) snapshot relabelled with another reason is ``snapshot.ledger_invalid`` at ``$.state.triggers``.

    ``timeout`` sorts after ``length``, ``cancelled`` and ``eos`` before it.  Kills 720
    ``ReplaceComparisonOperator_IsNot_Lt`` 2 (only a reason that sorts before the published one
    refused).
    """
    path, doc = _saved(tiny_model, tmp_path, outputs=5)
    assert doc["state"]["phase"] == "finished" and doc["state"]["finish_reason"] == "length"
    assert RequestRunner.restore(tiny_model, load_snapshot(path)).finish_reason.value == "length"
    doc["state"]["finish_reason"] = reason
    error = _refusal(tiny_model, _write(path, doc))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.state.triggers")


def test_cache_tensors_of_another_dtype_are_refused(tiny_model, tmp_path):
    """Stored K/V rows of the right shape in float64 do not fit a float32 ABI: ``snapshot.abi_mismatch`` at ``$.cache.layers[0]``.

    Kills 620 ``ReplaceOrWithAnd`` 18 (refused only when the shape is wrong too).
    """
    import attrs

    path, _ = _saved(tiny_model, tmp_path)
    snapshot = load_snapshot(path)
    wide = attrs.evolve(snapshot, tensors=[(k.double(), v.double()) for k, v in snapshot.tensors])
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, wide)
    assert (info.value.code, info.value.path) == ("snapshot.abi_mismatch", "$.cache.layers[0]")


def test_cache_rows_or_a_lane_frontier_off_p_are_refused(tiny_model, tmp_path):
    """Either the stored rows or the lane's recorded frontier differing from ``P`` is ``snapshot.frontier_invalid`` at ``$.cache``.

    Kills 651 ``ReplaceOrWithAnd`` 27 (refused only when both differ).
    """
    import attrs

    path, doc = _saved(tiny_model, tmp_path)
    p = doc["state"]["processed"]
    assert doc["state"]["lanes"] == [["self_kv", p]]
    snapshot = load_snapshot(path)
    short = attrs.evolve(snapshot, tensors=[(k[:, :, :-1], v[:, :, :-1]) for k, v in snapshot.tensors])
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, short)
    assert (info.value.code, info.value.path) == ("snapshot.frontier_invalid", "$.cache")
    doc["state"]["lanes"] = [["self_kv", p + 1]]
    error = _refusal(tiny_model, _write(path, doc))
    assert (error.code, error.path) == ("snapshot.frontier_invalid", "$.cache")


def test_a_snapshot_finished_by_eos_restores(tiny_model, tmp_path):
    """An EOS as the last output of a finished request is allowed: the ``eos`` snapshot restores finished, nothing pending to run.

    Kills 726 ``NumberReplacer`` 51 (EOS expected one past the last output).
    """
    from runtime_helpers import sampled_policy

    plain = RequestRunner(tiny_model, request(PROMPT, 5, cache="dynamic", policy=sampled_policy())).run()
    ids = list(plain.output_ids)
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # the first output that is not an earlier one
    path, doc = _saved(tiny_model, tmp_path, outputs=5, eos_ids=frozenset({ids[at]}), policy=sampled_policy())
    assert doc["state"]["finish_reason"] == "eos" and doc["state"]["output_ids"] == ids[:at + 1]
    restored = RequestRunner.restore(tiny_model, load_snapshot(path))
    assert restored.finish_reason.value == "eos" and list(restored.output_ids) == ids[:at + 1]


def test_a_lane_in_a_snapshot_without_a_cache_is_refused(tiny_model, tmp_path):
    """A ``none``-cache snapshot whose record names a ``self_kv`` lane is ``snapshot.abi_mismatch`` at ``$.state.lanes``.

    Kills 610 ``ReplaceComparisonOperator_NotEq_Lt`` 13 (only a missing lane refused).
    """
    path, doc = _saved(tiny_model, tmp_path, cache="none")
    assert doc["state"]["lanes"] == []
    doc["state"]["lanes"] = [["self_kv", doc["state"]["processed"]]]
    error = _refusal(tiny_model, _write(path, doc))
    assert (error.code, error.path) == ("snapshot.abi_mismatch", "$.state.lanes")


def test_snapshots_compare_by_identity_and_hash(tiny_model):
    """``RuntimeSnapshot`` is ``eq=False``: two snapshots of the same state are different objects, each hashable.

    Kills 118 ``ReplaceFalseWithTrue`` 0 (value equality over tensor lists: comparing raises, hashing
    a list fails).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 5, cache="dynamic")).run(max_outputs=2)
    a, b = runner.snapshot("pending_suffix"), runner.snapshot("pending_suffix")
    assert a != b and len({a, b}) == 2 and [s for s in (a, b) if s == a] == [a]
    assert a.record == b.record


def test_ledger_refusals_quote_the_expected_counter_and_frontier(tiny_model, tmp_path):
    """The messages of two ledger refusals: the RNG counter's start plus draws, and the score row's expected ``O`` and ``P``.

    Kills 699 ``ReplaceBinaryOperator_Sub_Mul`` 0 (the draws quoted as a product) and 708
    ``ReplaceBinaryOperator_Add_Mod`` 8 (``P`` quoted as ``L % O``).
    """
    from runtime_helpers import sampled_policy

    req = request(PROMPT, 5, cache="dynamic", policy=sampled_policy(), rng_counter_start=300)
    path = tmp_path / "ledger.json"
    save_snapshot(RequestRunner(tiny_model, req).run(max_outputs=2).snapshot("pending_suffix"), path)
    doc = json.loads(path.read_text())
    counter = json.loads(json.dumps(doc))
    counter["state"]["rng_counter"] = 303
    error = _refusal(tiny_model, _write(path, counter))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.state.rng_counter")
    assert "RNG counter 303 / policy 302 != start 300 + 2 draws" in str(error)
    row = json.loads(json.dumps(doc))
    row["receipts"] = []  # allowed (a restored runner's); the score-row check is then the first to see the change
    row["state"]["consumed"][1]["score_id"] = row["state"]["consumed"][0]["score_id"]
    error = _refusal(tiny_model, _write(path, row))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.state.consumed[1].score_id")
    assert f"taken at O = 1, P = {len(PROMPT) + 1}" in str(error)


def test_a_tampered_token_id_is_quoted_as_content_and_a_tampered_logprob_as_a_value(tiny_model, byte_tokenizer, tmp_path):
    """Refusal messages never show a token id (user content: length and fingerprint) but do show a logprob.

    A receipt's ``selected_id`` and the observer's ``output_ids`` are fingerprinted; the observer's
    ``logprobs`` are quoted as numbers.  Kills 787 ``ReplaceComparisonOperator_Eq_Lt`` 13 and 828
    ``ReplaceComparisonOperator_Eq_LtE`` 14 (the choice of quoting by key).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 5, cache="dynamic"), tokenizer=byte_tokenizer).run(max_outputs=2)
    path = tmp_path / "quoted.json"
    save_snapshot(runner.snapshot("pending_suffix"), path)
    doc = json.loads(path.read_text())
    assert doc["receipts"] and doc["observer"] is not None
    receipt = json.loads(json.dumps(doc))
    receipt["receipts"][0]["selected_id"] = 4321
    error = _refusal(tiny_model, _write(path, receipt))
    assert error.path == "$.receipts[0].selected_id" and "4321" not in str(error) and "<content: int" in str(error)
    observed = json.loads(json.dumps(doc))
    observed["observer"]["output_ids"][0] = 4321
    error = _refusal(tiny_model, _write(path, observed))
    assert error.path == "$.observer.output_ids[0]" and "4321" not in str(error) and "<content: int" in str(error)
    logprob = json.loads(json.dumps(doc))
    logprob["observer"]["logprobs"][0] = -0.125
    error = _refusal(tiny_model, _write(path, logprob))
    assert error.path == "$.observer.logprobs[0]" and "-0.125" in str(error) and "<content" not in str(error)


def test_a_frontier_past_256_rows_restores(tiny_model, tmp_path):
    """``P + |U| = L + O = 302`` (a 300-token prompt): the frontier equation holds by value and the snapshot resumes exactly.

    Kills 643 ``ReplaceComparisonOperator_Eq_Is`` 7 (``is`` between two computed ints past 256).
    """
    prompt = (1, *[70 + i % 20 for i in range(299)])
    req = request(prompt, 4, cache="dynamic")
    full = RequestRunner(tiny_model, req).run()
    path = tmp_path / "long.json"
    save_snapshot(RequestRunner(tiny_model, req).run(max_outputs=2).snapshot("pending_suffix"), path)
    loaded = load_snapshot(path)
    assert loaded.record.processed + len(loaded.record.pending_ids) == len(prompt) + 2 == 302
    resumed = RequestRunner.restore(tiny_model, loaded).run()
    assert resumed.output_ids == full.output_ids and resumed.logprobs == full.logprobs


def test_cache_tensors_with_more_kv_heads_than_the_abi_are_refused(tiny_model, tmp_path):
    """Stored rows with ``H_kv + 1`` heads are ``snapshot.abi_mismatch`` at ``$.cache.layers[0]`` (not only fewer heads).

    Kills 619 ``ReplaceComparisonOperator_NotEq_Lt`` 18.
    """
    import attrs
    import torch

    path, _ = _saved(tiny_model, tmp_path)
    snapshot = load_snapshot(path)
    wide = attrs.evolve(snapshot, tensors=[(torch.cat((k, k[:, :1]), dim=1), torch.cat((v, v[:, :1]), dim=1)) for k, v in snapshot.tensors])
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, wide)
    assert (info.value.code, info.value.path) == ("snapshot.abi_mismatch", "$.cache.layers[0]")


def test_an_observer_holding_more_or_fewer_outputs_than_the_ledger_is_refused(tiny_model, byte_tokenizer, tmp_path):
    """An observer state with one output id more, or one fewer, than the ledger is ``snapshot.ledger_invalid`` at ``$.observer.output_ids``.

    Kills 826 ``ReplaceComparisonOperator_NotEq_Lt`` 51 and ``ReplaceComparisonOperator_NotEq_Gt`` 51
    (only one direction refused).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 5, cache="dynamic"), tokenizer=byte_tokenizer).run(max_outputs=2)
    path = tmp_path / "observer.json"
    save_snapshot(runner.snapshot("pending_suffix"), path)
    doc = json.loads(path.read_text())
    for ids in (doc["observer"]["output_ids"] + doc["observer"]["output_ids"][-1:], doc["observer"]["output_ids"][:-1]):
        edited = json.loads(json.dumps(doc))
        edited["observer"]["output_ids"] = ids
        error = _refusal(tiny_model, _write(path, edited))
        assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.observer.output_ids")


def test_a_snapshot_whose_carried_request_has_another_identity_is_refused(tiny_model, tmp_path):
    """Restoring with the right request a snapshot whose carried request names another identity: ``snapshot.identity_mismatch``.

    The carried identity ``"a"`` sorts before the request's ``"test"``.  Kills 601
    ``ReplaceComparisonOperator_NotEq_Gt`` 10.
    """
    import attrs

    path, _ = _saved(tiny_model, tmp_path)
    snapshot = load_snapshot(path)
    assert snapshot.record.identity == snapshot.request.identity == "test"
    other = attrs.evolve(snapshot, request=attrs.evolve(snapshot.request, identity="a"))
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, other, snapshot.request)
    assert (info.value.code, info.value.path) == ("snapshot.identity_mismatch", "$.identity")


def test_a_keyed_snapshot_naming_another_mac_algorithm_is_refused(tiny_model, tmp_path):
    """A keyed file whose ``authentication.algorithm`` is not ``hmac-sha256`` is ``snapshot.unauthenticated`` at ``$.authentication``.

    The MAC itself still matches (it covers every field but ``authentication``).  Kills 349
    ``ReplaceComparisonOperator_NotEq_Is`` 2 and ``ReplaceComparisonOperator_NotEq_LtE`` 3.
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 5, cache="dynamic")).run(max_outputs=2)
    path = tmp_path / "keyed.json"
    save_snapshot(runner.snapshot("pending_suffix"), path, key="k1")
    load_snapshot(path, key="k1")
    doc = json.loads(path.read_text())
    for algorithm in ("hmac-sha1", "hmac-sha512"):
        doc["authentication"]["algorithm"] = algorithm
        with pytest.raises(Rejection) as info:
            load_snapshot(_write(path, doc), key="k1")
        assert (info.value.code, info.value.path) == ("snapshot.unauthenticated", "$.authentication")


def test_a_carried_envelope_that_no_longer_hashes_to_the_identity_is_refused_at_the_envelope(tiny_model, tmp_path):
    """A snapshot of an envelope request (saved with its content): a changed envelope field is ``snapshot.identity_mismatch`` at ``$.request.envelope``.

    Refused when the re-admitted envelope is hashed, before the request digest is compared.
    Kills 284 ``ReplaceComparisonOperator_NotEq_Is`` 0 (``identity is expected`` never holds).
    """
    from test_envelope import dumps, tiny  # tests/ is on sys.path

    from decodespec.impl.values import RuntimeRequest
    from decodespec.spec.envelope import validate_request_envelope

    admitted, identity = validate_request_envelope(dumps(tiny()))
    runner = RequestRunner(tiny_model, RuntimeRequest.from_admitted(admitted)).run(max_outputs=1)
    path = tmp_path / "envelope.json"
    save_snapshot(runner.snapshot("pending_suffix"), path, content=True)
    doc = json.loads(path.read_text())
    assert doc["identity"] == identity and "envelope_identity" not in doc["request"]
    assert load_snapshot(path).request.identity == identity
    doc["request"]["envelope"]["prompt"]["text"] += "!"
    with pytest.raises(Rejection) as info:
        load_snapshot(_write(path, doc))
    assert (info.value.code, info.value.path) == ("snapshot.identity_mismatch", "$.request.envelope")


def test_a_snapshot_after_258_outputs_restores(tiny_model, tmp_path):
    """Receipt 257's score row was taken at ``O = 257`` (JSON ints past 256 are distinct objects): the ledger lines up by value.

    Kills 706 ``ReplaceComparisonOperator_NotEq_IsNot`` 29.
    """
    req = request(PROMPT, 260, cache="dynamic")
    path = tmp_path / "long-output.json"
    save_snapshot(RequestRunner(tiny_model, req).run(max_outputs=258).snapshot("pending_suffix"), path)
    restored = RequestRunner.restore(tiny_model, load_snapshot(path))
    assert restored.output_count == 258 and restored.state().scores[-1][3] == 257


def test_rows_processed_after_no_model_call_are_refused_at_the_call_count(tiny_model, tmp_path):
    """``P > 0`` after 0 model calls is ``snapshot.ledger_invalid`` at ``$.state.num_calls`` (the generation left as it was).

    Kills 738 ``NumberReplacer`` 65 (only a negative call count refused; the generation check
    then refuses at ``$.state.generation``).
    """
    path, doc = _saved(tiny_model, tmp_path)
    assert doc["state"]["processed"] > 0 and doc["state"]["generation"] >= 1
    doc["state"]["num_calls"] = 0
    error = _refusal(tiny_model, _write(path, doc))
    assert (error.code, error.path) == ("snapshot.ledger_invalid", "$.state.num_calls")
    assert "after 0 model calls" in str(error)
