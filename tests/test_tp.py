"""Tensor-parallel decode (impl/tp.py): the shard plan, agreement with the single-process runtime, rank failures, no orphans.

Source: M3.10 0x0A "One request can still be model-parallel"; issue 21 items 3-5.
"""

from __future__ import annotations

import os
import time

import attrs
import pytest

from decodespec.checks.gate.tolerance import tolerance_for
from decodespec.impl.config import LlamaConfig
from decodespec.impl.faults import ParticipantFailure
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.impl.tiny import tiny_config
from decodespec.impl.tp import TP_UNSHARDABLE, RankFault, TPModel, live_groups, shard_plan
from decodespec.spec.enums import FinishReason, Selection
from decodespec.spec.errors import Rejection

#: SmolLM2-135M's shapes (impl/weights.py reads them from the GGUF file; written out so the plan test needs no file).
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True)
PROMPT = (1, 75, 104, 111, 111)


def _request(cache: str, **changes) -> RuntimeRequest:
    return RuntimeRequest(identity="sha256:" + "ab" * 32, prompt_ids=PROMPT, max_new_tokens=5, cache=cache,
                          prefill_chunk=2 if cache != "none" else None, **changes)


def _run(model, request: RuntimeRequest):
    runner = RequestRunner(model, request)
    rows = []
    while runner.step() is not None:
        if runner.score is not None and (not rows or rows[-1][0] != runner.score.score_id):
            rows.append((runner.score.score_id, runner.score.logits.double().clone()))
    return runner, rows


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_shard_plan_respects_the_kv_head_groups():
    """Each rank owns whole K/V heads and exactly their query heads; SmolLM2 R = 2 is the declared uneven split {0, 1} | {2}."""
    two = shard_plan(SMOLLM2, 2)
    assert two.kv_heads == ((0, 1), (2,)) and two.q_heads == ((0, 1, 2, 3, 4, 5), (6, 7, 8))
    assert two.ffn == ((0, 768), (768, 1536)) and two.vocab == ((0, 24576), (24576, 49152))
    three = shard_plan(SMOLLM2, 3)
    assert three.kv_heads == ((0,), (1,), (2,)) and three.q_heads == ((0, 1, 2), (3, 4, 5), (6, 7, 8))
    assert three.ffn == ((0, 512), (512, 1024), (1024, 1536))
    tiny = shard_plan(tiny_config(), 2)
    assert tiny.kv_heads == ((0,), (1,)) and tiny.q_heads == ((0, 1), (2, 3)) and tiny.vocab == ((0, 256), (256, 512))
    for config, ranks in ((SMOLLM2, 4), (tiny_config(), 3), (SMOLLM2, 1), (attrs.evolve(SMOLLM2, vocab_size=49153), 2)):
        with pytest.raises(Rejection) as err:
            shard_plan(config, ranks)
        assert err.value.code == TP_UNSHARDABLE


@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_tp_decode_equals_single_process_within_the_declared_tolerance(tiny_model, cache):
    """R = 2 on tiny: same greedy ids; every score row and the committed K/V (heads concatenated in plan order) within the
    calibrated impl-tp tolerance of the single-process rows."""
    tol = tolerance_for("impl-tp", "tiny", "float32")
    tp = TPModel(tiny_model, 2)
    try:
        single, rows_single = _run(tiny_model, _request(cache))
        parallel, rows_tp = _run(tp, _request(cache))
        assert parallel.output_ids == single.output_ids and [r[0] for r in rows_tp] == [r[0] for r in rows_single]
        for (_, a), (_, b) in zip(rows_single, rows_tp):
            assert float((a - b).abs().max()) <= 2 * (tol.logit + tol.logit_rel * float(a.abs().max()))
        if cache != "none":
            for (k1, v1), (k2, v2) in zip(single.cache.committed_tensors(), parallel.cache.committed_tensors()):
                for x, y in ((k1, k2), (v1, v2)):
                    assert x.shape == y.shape
                    assert float((x - y).abs().max()) <= 2 * (tol.kv + tol.kv_rel * float(x.abs().max()))
        pids = [p.pid for p in tp.group.procs]
    finally:
        tp.close()
    assert all(_gone(pid) for pid in pids) and tp.group not in live_groups()


@pytest.mark.parametrize("how,reason", [("kill", "device_error"), ("stall", "timeout")])
def test_a_rank_failing_mid_call_gives_all_old_and_a_typed_reason_without_a_hang(tiny_model, how, reason):
    """Rank 1 dies / stalls before layer 2 of the first decode call: that call is ALL_OLD (no score) with the typed reason,
    bounded in time; the group is respawned, the committed prefix rebuilt, and after recovery the request ends with the
    tokens of an unfaulted run.  With no retry left the request finishes device_error."""
    clean, _ = _run(tiny_model, _request("dynamic"))
    tp = TPModel(tiny_model, 2, timeout_s=1.0)
    try:
        runner = RequestRunner(tp, _request("dynamic", max_retries=1))
        runner.admit()
        while runner.output_ids == [] or runner.phase.value != "ready":
            runner.step()
        old_pids = [p.pid for p in tp.group.procs]
        runner.launch()
        tp.rank_faults = [RankFault(1, how, 2)]
        began = time.monotonic()
        assert runner.complete() is Selection.ALL_OLD
        assert time.monotonic() - began < 30
        failure = runner.participant_failure
        assert isinstance(failure, ParticipantFailure) and failure.reason == reason and failure.rank in (0, 1)
        assert runner.score is None or runner.score.generation < runner.generation + 1
        assert all(_gone(pid) for pid in old_pids)  # the failed group is gone, not orphaned
        assert runner.quarantined
        runner.recover()
        while runner.step() is not None:
            pass
        assert runner.output_ids == clean.output_ids and runner.finish_reason is FinishReason.LENGTH
        # No retry left: the same failure finishes the request with device_error.
        last = RequestRunner(tp, _request("static"))
        last.admit()
        last.launch()
        tp.rank_faults = [RankFault(0, how, 0)]
        assert last.complete() is Selection.ALL_OLD and last.finish_reason is FinishReason.DEVICE_ERROR
        pids = [p.pid for p in tp.group.procs]
    finally:
        tp.close()
    assert all(_gone(pid) for pid in pids) and live_groups() == []


def test_the_gate_adapter_declares_what_the_ranks_cannot_do(monkeypatch):
    """impl-tp declares no prompt logprobs, no native kernel, no dtype it was not calibrated in; it declares rank faults."""
    from decodespec.checks.adapters.impl_tp import TP_CAPABILITIES, TP_CORE_CAPABILITIES
    from decodespec.checks.modelcheck.traces import open_runtime

    adapter = open_runtime("impl-tp", "tiny")
    try:
        caps = adapter.capabilities()
        monkeypatch.setenv("DECODESPEC_TP_PROFILE", "full")
        full = adapter.capabilities()
    finally:
        adapter.close()
    assert full == TP_CAPABILITIES and "rank_faults" in full and "cache:static" in full and "transform:top_p" in full
    assert not {"output.prompt_logprobs", "decode_kernel:native", "runtime.compute_dtype:bfloat16"} & full
    assert caps == TP_CORE_CAPABILITIES < full and not any(c.startswith(("transform:", "policy.order")) for c in caps)


@pytest.mark.parametrize("name", ["tp_rank_skips_collective", "tp_rank_frontier_lags", "tp_wrong_kv_head_owner"])
def test_tensor_parallel_mutant_is_killed_by_the_impl_tp_gate(name):
    """Each tensor-parallel mutant (checks/lab/mutants/tp.py) is killed by a gate check of --runtime impl-tp on tiny that passes
    without it; the skipped collective ends by the bounded gloo wait (no hang), and no rank process is left."""
    from decodespec.checks.lab.mutants.harness import KILLED, Calibration, run_gate

    calibration = Calibration()
    began = time.monotonic()
    result = run_gate(name, "tiny", calibration=calibration)
    assert result.outcome == KILLED, (result.outcome, result.crash)
    assert calibration.findings[result.killed_by["check"]].status == "passed" and result.excluded == ()
    assert result.killed_by["layer"] in ("STATE", "TENSOR") and time.monotonic() - began < 300
    assert live_groups() == []


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_smollm2_tp_decode_equals_single_process(smollm2_model, world_size):
    """SmolLM2 over R = 2 (uneven K/V heads {0, 1} | {2}) and R = 3 ranks: the same greedy ids as one process, score rows
    and committed K/V within the calibrated impl-tp tolerance of the single-process rows."""
    tol = tolerance_for("impl-tp", "smollm2", "float32")
    request = attrs.evolve(_request("static"), prompt_ids=(1, 504, 3458, 282, 4649, 314), max_new_tokens=4)
    tp = TPModel(smollm2_model, world_size)
    try:
        single, rows_single = _run(smollm2_model, request)
        parallel, rows_tp = _run(tp, request)
        assert parallel.output_ids == single.output_ids
        for (_, a), (_, b) in zip(rows_single, rows_tp):
            assert float((a - b).abs().max()) <= 2 * (tol.logit + tol.logit_rel * float(a.abs().max()))
        for (k1, v1), (k2, v2) in zip(single.cache.committed_tensors(), parallel.cache.committed_tensors()):
            assert k2.shape == k1.shape and k1.shape[1] == 3 and k1.shape[3] == 64
            for x, y in ((k1, k2), (v1, v2)):
                assert float((x - y).abs().max()) <= 2 * (tol.kv + tol.kv_rel * float(x.abs().max()))
    finally:
        tp.close()
    assert live_groups() == []


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_impl_tp_tolerance_is_calibrated_not_typed(model):
    """The impl-tp tolerance is derived from its own measurement (R = 2, one thread per rank) under default and AVX2 at
    least (tiny also AVX-512), never borrowed from impl's."""
    from decodespec.checks.gate.tolerance import derive, load_calibration

    entry = next(e for e in load_calibration()["entries"] if (e["runtime"], e["model"], e["dtype"]) == ("impl-tp", model, "float32"))
    seen = {(v["capability"], v["threads"]) for v in entry["variants"]}
    assert {("DEFAULT", 1), ("AVX2", 1)} <= seen and all(threads == 1 for _, threads in seen)
    assert model == "smollm2" or ("AVX512", 1) in seen
    assert tolerance_for("impl-tp", model, "float32") == derive(entry["variants"]) != tolerance_for("impl", model, "float32")
