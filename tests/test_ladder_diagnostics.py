"""Failure diagnostics of the ladder (checks/gate/ladder.py) and of failure traces (checks/modelcheck/traces.py).

A TENSOR or DECISION failure names its worst coordinate -- the vocabulary id, or the layer, K or
V, head and position of a committed K/V row -- with both values and the bound, and keeps a
bounded probe of the rows that failed (:attr:`Verdict.probe`), which failure traces carry in
``#meta.verdict.probe``.  Failure-trace file names are safe slugs plus a digest.

Rules: ``ladder.TENSOR``, ``ladder.DECISION``.  Source: M3.10 "Correctness matrix" (2. tensor,
4. decision); issue 22 item 4.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from decodespec.checks.adapters import CaseConfig, Observation
from decodespec.checks.gate.ladder import FAILED, PROBE_ENTRIES, PROBE_POSITIONS, UNDECIDED, Expected, Verdict, compare, greedy_comparator, score_row_probe
from decodespec.checks.gate.lockstep import judge_decision
from decodespec.checks.gate.tolerance import Tolerance
from decodespec.checks.modelcheck.traces import MAX_TRACE_NAME, load_trace, make_trace, trace_file_name, write_trace
from decodespec.spec.policy import policy_config_from_json

TOL = Tolerance.from_logit(1e-3, 1e-3)
RNG = np.random.default_rng(7)
#: [layers, K/V, H_kv, P, D]
SHAPE = (3, 2, 4, 7, 8)


def _kv(changes: dict[tuple[int, ...], float]) -> tuple[np.ndarray, np.ndarray]:
    ref = RNG.standard_normal(SHAPE).astype(np.float32)
    cand = ref.copy()
    for where, delta in changes.items():
        cand[where] += np.float32(delta)
    return ref, cand


def _tensor(exp_kw: dict, obs_kw: dict) -> Verdict:
    return compare(Expected(tolerance=TOL, **exp_kw), Observation(**obs_kw), layers=("TENSOR",))


def test_a_planted_kv_difference_is_named_by_layer_kind_head_and_position() -> None:
    """One entry of layer 1's V, head 2, position 5, dim 3 moved by 0.5: the message names exactly it (ladder.TENSOR)."""
    ref, cand = _kv({(1, 1, 2, 5, 3): 0.5})
    verdict = _tensor({"cache_probe": ref}, {"cache_probe": cand})
    assert (verdict.result, verdict.layer, verdict.check) == (FAILED, "TENSOR", "cache_probe.linf")
    bound = TOL.kv_bounds(ref.astype(np.float64))[1, 1]
    want, got = float(ref[1, 1, 2, 5, 3]), float(cand[1, 1, 2, 5, 3])
    assert "worst at layer 1 V, head 2, position 5 (dim 3)" in verdict.message
    assert f"reference {want:.6g}, observed {got:.6g}" in verdict.message
    assert f"> {bound:.3g}" in verdict.message and "positions over the bound: 5;" in verdict.message
    worst = verdict.probe["worst"]
    assert (worst["layer"], worst["kv"], worst["head"], worst["position"], worst["dim"]) == (1, "V", 2, 5, 3)
    assert worst["reference"] == pytest.approx(want) and worst["observed"] == pytest.approx(got) and worst["bound"] == pytest.approx(bound)
    assert verdict.probe["positions_over_bound"] == [5] and verdict.probe["heads_over_bound"] == [2]
    assert verdict.probe["exceeded"] == [{"layer": 1, "kv": "V", "error": pytest.approx(0.5, rel=1e-6), "bound": pytest.approx(bound)}]


def test_the_first_layer_over_its_bound_is_reported_and_every_exceeded_bound_is_probed() -> None:
    """Layer 0 K a little over its bound, layer 2 K far over: layer 0 is named (where the error enters), both are listed."""
    ref, cand = _kv({(0, 0, 1, 3, 0): 0.01, (2, 0, 3, 6, 7): 3.0, (2, 0, 0, 1, 2): 2.0})
    verdict = _tensor({"cache_probe": ref}, {"cache_probe": cand})
    assert "worst at layer 0 K, head 1, position 3 (dim 0)" in verdict.message
    assert [(e["layer"], e["kv"]) for e in verdict.probe["exceeded"]] == [(0, "K"), (2, "K")]
    assert verdict.probe["exceeded_count"] == 2 and "2 of 6 layer/K-V bounds exceeded" in verdict.message


def test_kv_probe_lists_the_largest_entries_both_sides_and_is_bounded() -> None:
    """Every entry of layer 2 V differs: the probe keeps PROBE_ENTRIES of them, largest first, and caps the positions."""
    ref = RNG.standard_normal((1, 2, 2, 40, 4)).astype(np.float32)
    cand = ref.copy()
    cand[0, 1] += np.linspace(0.1, 1.0, cand[0, 1].size, dtype=np.float32).reshape(cand[0, 1].shape)
    verdict = _tensor({"cache_probe": ref}, {"cache_probe": cand})
    top = verdict.probe["top"]
    assert len(top) == PROBE_ENTRIES and [e["error"] for e in top] == sorted((e["error"] for e in top), reverse=True)
    assert (top[0]["head"], top[0]["position"], top[0]["dim"]) == (1, 39, 3)  # the last entry got the largest shift
    for e in top:
        assert e["reference"] == pytest.approx(float(ref[0, 1, e["head"], e["position"], e["dim"]]))
        assert e["observed"] == pytest.approx(float(cand[0, 1, e["head"], e["position"], e["dim"]]))
    assert len(verdict.probe["positions_over_bound"]) == PROBE_POSITIONS and verdict.message.count("...") == 1
    assert len(json.dumps(verdict.to_json())) < 4000


def test_a_nan_in_the_cache_is_the_worst_coordinate() -> None:
    ref, cand = _kv({})
    cand[2, 0, 0, 4, 1] = np.nan
    verdict = _tensor({"cache_probe": ref}, {"cache_probe": cand})
    assert "worst at layer 2 K, head 0, position 4 (dim 1)" in verdict.message and "observed nan" in verdict.message


def test_a_planted_score_difference_is_named_by_vocabulary_id_with_both_values_and_the_bound() -> None:
    """Id 17 of 64 off by 0.25, id 40 by 0.1: the message names id 17, its two values and epsilon (ladder.TENSOR)."""
    ref = RNG.standard_normal(64).astype(np.float32)
    cand = ref.copy()
    cand[17] += np.float32(0.25)
    cand[40] -= np.float32(0.1)
    verdict = _tensor({"score_row": ref}, {"score_row": cand})
    eps = TOL.epsilon(ref)
    assert verdict.check == "score_row.linf" and verdict.actual == pytest.approx(0.25, rel=1e-6)
    assert f"worst at vocabulary id 17: reference {float(ref[17]):.6g}, observed {float(cand[17]):.6g}" in verdict.message
    assert f"> bound {eps:.3g}" in verdict.message and "2 of 64 ids over the bound" in verdict.message
    assert [e["id"] for e in verdict.probe["top"][:2]] == [17, 40] and verdict.probe["over_bound"] == 2
    assert verdict.probe["top"][1]["observed"] == pytest.approx(float(cand[40]))


def test_a_score_masked_on_one_side_only_is_named_first() -> None:
    """Id 5 is -inf in the runtime's row only: an infinite error, named before any finite difference."""
    ref = np.arange(10, dtype=np.float32)
    cand = ref + np.float32(0.5)
    cand[5] = -np.inf
    probe = score_row_probe(ref, cand, 1e-3)
    assert probe["worst"]["id"] == 5 and probe["worst"]["error"] == float("inf")
    verdict = greedy_comparator(ref, cand, 1e-3)
    assert verdict.layer == "TENSOR" and "vocabulary id 5 is finite on one side only (reference 5, observed -inf)" in verdict.message


def test_score_probe_is_bounded_and_breaks_ties_by_lowest_id() -> None:
    ref = np.zeros(1000, dtype=np.float32)
    cand = np.full(1000, 0.5, dtype=np.float32)
    probe = score_row_probe(ref, cand, 0.1)
    assert [e["id"] for e in probe["top"]] == list(range(PROBE_ENTRIES)) and probe["over_bound"] == 1000


def test_decision_failures_name_both_ids_and_their_scores() -> None:
    """Greedy: the reference's id and the runtime's, with their processed scores on both rows (ladder.DECISION)."""
    greedy = policy_config_from_json({"family": "greedy"})
    ref = np.array([2.0, 1.0, 0.0])
    own = np.array([1.9, 2.2, 0.1])
    verdict = judge_decision(policy=greedy, ref_values=ref, ref_token=0, runtime_token=2, tolerance=TOL, greedy=True,
                             output_index=3, cand_values=own)
    assert (verdict.result, verdict.check) == (FAILED, "decision.selected_id")
    assert "output 3:" in verdict.message and "id 0: reference 2, observed 1.9; id 2: reference 0, observed 0.1" in verdict.message
    assert verdict.probe == {"kind": "decision", "rows": "processed",
                             "ids": [{"id": 0, "reference": 2.0, "observed": 1.9}, {"id": 2, "reference": 0.0, "observed": 0.1}]}
    near = judge_decision(policy=greedy, ref_values=np.array([2.0, 1.9995]), ref_token=0, runtime_token=1, tolerance=TOL, greedy=True)
    assert near.result == UNDECIDED and "id 0: reference 2; id 1: reference 1.9995" in near.message
    wide = greedy_comparator([10.0, 6.0], [9.5, 6.5], 1.0, candidate_id=1)
    assert "id 0: reference 10, observed 9.5; id 1: reference 6, observed 6.5" in wide.message


def test_the_ladder_decision_check_names_the_raw_scores_of_its_own_row() -> None:
    row = np.array([3.0, 1.0, -2.0, 0.5], dtype=np.float32)
    obs = Observation(score_row=row, score_id="score-1", decision={"score_id": "score-1", "token_id": 1, "logprob": None, "draws": 0})
    verdict = compare(Expected(tolerance=TOL, score_row=row, decision_token=0), obs, layers=("DECISION",))
    assert verdict.check == "decision.selected_id"
    assert "expected 0, observed 1 (raw scores id 0: reference 3, observed 3; id 1: reference 1, observed 1)" in verdict.message
    logprob = compare(Expected(tolerance=TOL, logprobs=(-0.2,)), Observation(output_ids=[7], logprobs=[-0.3]), layers=("DECISION",))
    assert "output 0 (vocabulary id 7)" in logprob.message and "expected -0.2, observed -0.3" in logprob.message
    assert logprob.probe["bound"] == TOL.logprob


def test_failure_traces_keep_the_probe_and_it_round_trips(tmp_path) -> None:
    """``#meta.verdict.probe`` is written, read back by load_trace and Verdict.from_json (issue 22 item 4)."""
    ref, cand = _kv({(1, 1, 2, 5, 3): 0.5})
    verdict = _tensor({"cache_probe": ref}, {"cache_probe": cand})
    config = CaseConfig(model="tiny", prompt_ids=(1, 2))

    class _Record:
        index, action, runtime, spec, observation, spec_state = 0, {"op": "reset"}, {"status": "ok"}, {"status": "ok"}, {}, {}

    _Record.verdict = verdict
    trace = make_trace(runtime="stdio:python /tmp/my runtime.py --flag 'a b'", config=config, records=[_Record()], verdict=verdict)
    path = write_trace(trace, tmp_path)
    meta = load_trace(path)["#meta"]
    assert meta["verdict"]["probe"]["worst"]["position"] == 5
    again = Verdict.from_json(meta["verdict"])
    assert again.probe["worst"]["kv"] == "V" and again.same_outcome(verdict)
    assert Verdict("passed").to_json().get("probe", "absent") == "absent"


@pytest.mark.parametrize("runtime", [
    "stdio:python /tmp/my runtime.py --flag 'a b'",
    "stdio:../../etc/passwd;rm -rf ~ $(x) `y` |z",
    "stdio:" + "very-long-command " * 40,
    "impl",
])
def test_failure_trace_names_are_safe_slugs_with_a_digest(runtime: str) -> None:
    meta = {"runtime": runtime, "config": {"a": 1}, "actions": [], "model": "tiny",
            "verdict": {"result": "failed", "layer": "TENSOR"}, "mutant": "mutant.chunked_prefill_position_reset"}
    name = trace_file_name({"#meta": meta})
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*-[0-9a-f]{12}\.itf\.json", name), name
    assert len(name) <= MAX_TRACE_NAME and ".." not in name.removesuffix(".itf.json").replace(".itf", "")
    other = trace_file_name({"#meta": {**meta, "runtime": runtime + "!"}})
    assert other != name  # two commands with the same slug get two names


def test_two_cases_or_two_failures_of_one_input_get_two_trace_names() -> None:
    """A new-user trial lost a trace: matrix.no_cache_vs_dynamic and matrix.dynamic_vs_static share
    their actions, and a second planted bug failed the same input differently; each overwrote the other."""
    verdict = {"result": "failed", "layer": "TENSOR", "check": "score_row.linf", "step": 3, "expected": 1.0, "actual": 2.0}
    meta = {"runtime": "impl", "config": {"a": 1}, "actions": [{"op": "run"}], "model": "tiny", "source": "x matrix.a", "verdict": verdict}
    name = trace_file_name({"#meta": meta})
    assert trace_file_name({"#meta": {**meta, "source": "x matrix.b"}}) != name
    assert trace_file_name({"#meta": {**meta, "verdict": {**verdict, "check": "cache_probe.linf"}}}) != name
    assert trace_file_name({"#meta": {**meta, "verdict": {**verdict, "actual": 3.0}}}) != name
    assert trace_file_name({"#meta": dict(meta)}) == name  # the same failure of the same case: the same name


def test_impl_trace_names_keep_their_form() -> None:
    meta = {"runtime": "impl", "config": {"a": 1}, "actions": [], "model": "tiny", "verdict": {"result": "passed"}}
    assert re.fullmatch(r"impl-tiny-passed-[0-9a-f]{12}\.itf\.json", trace_file_name({"#meta": meta}))


def test_a_failure_lab_mutant_is_localized_to_its_chunk(tiny_model) -> None:
    """mutant.chunked_prefill_position_reset: the second prefill chunk's K rows (positions 2, 3) are named (ladder.TENSOR)."""
    from decodespec.checks.modelcheck.traces import mutant_installed, record

    config = CaseConfig(model="tiny", prompt_ids=(72, 105, 33, 40, 50, 60), max_new_tokens=2, prefill_chunk=2)
    with mutant_installed("mutant.chunked_prefill_position_reset"):
        trace = record("impl", config, [{"op": "prefill", "chunk": 2}] * 3)
    verdict = trace["#meta"]["verdict"]
    assert (verdict["step"], verdict["check"]) == (2, "cache_probe.linf")
    assert verdict["probe"]["positions_over_bound"] == [2, 3] and verdict["probe"]["kv"] == "K"
    assert "positions over the bound: 2, 3;" in verdict["message"]


def test_an_undecided_pair_names_the_ids_and_their_reference_scores() -> None:
    from decodespec.checks.gate.divergence import pair_divergence_verdict
    from decodespec.checks.gate.lockstep import ReferenceDecision

    greedy = policy_config_from_json({"family": "greedy"})
    ref = ReferenceDecision(2, 0, np.array([2.0, 1.9995, 0.0]), np.array([0.5, 0.5, 0.0]), None, True, greedy, 1e-3)
    verdict = pair_divergence_verdict(ref, 0, 1, TOL)
    assert verdict.result == UNDECIDED and verdict.check == "pair.margin"
    assert "processed scores id 0: reference 2; id 1: reference 1.9995" in verdict.message
    assert [e["id"] for e in verdict.probe["ids"]] == [0, 1]
