"""The ladder comparator (checks/gate/ladder.py): layer order, each layer's checks, the greedy comparator, undecided margins.

Rules: ``ladder.STATE``, ``ladder.TENSOR``, ``ladder.POLICY``, ``ladder.DECISION``,
``ladder.SEQUENCE``, ``ladder.RESUME``.  Source: M3.10 "A logit tolerance is not a
token-equality proof" and "Correctness matrix".
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from decodespec.checks.adapters import Observation
from decodespec.checks.gate.ladder import FAILED, LAYERS, PASSED, UNDECIDED, DecisionCheck, Expected, Verdict, combine, compare, compare_rows, greedy_comparator
from decodespec.checks.gate.lockstep import judge_decision
from decodespec.checks.gate.tolerance import TOLERANCES, Tolerance, tolerance_for
from decodespec.spec.policy import policy_config_from_json
from decodespec.spec.rules import RULES

TOL = Tolerance.from_logit(1e-3, 1e-3)
ROW = np.array([3.0, 1.0, -2.0, 0.5], dtype=np.float32)
FRONTIER = {"prompt_len": 3, "output_count": 1, "pending": 1, "processed": 3, "pending_tag": "PENDING_NEXT_CALL"}


def _obs(**changes) -> Observation:
    values = {"phase": "ready", "output_ids": [0], "logprobs": [-0.2], "frontier": dict(FRONTIER), "finish_reason": None, "triggers": [],
                  "rng_counter": 0, "generation": 1, "quarantined": False, "cache_committed": 3, "score_row": ROW, "score_output_count": 0,
                  "decision": {"receipt_id": "receipt-0", "score_id": "score-1", "token_id": 0, "logprob": -0.2, "draws": 0},
                  "support_ids": [0, 1, 2, 3], "support_probs": [0.8, 0.1, 0.05, 0.05], "text": "a", "chunks": []}
    values.update(changes)
    return Observation(**values)


def _exp(**changes) -> Expected:
    values = {"tolerance": TOL, "phase": "ready", "output_ids": (0,), "frontier": dict(FRONTIER), "rng_counter": 0, "generation": 1, "quarantined": False,
                  "cache_committed": 3, "score_row": ROW.copy(), "support_ids": np.array([0, 1, 2, 3]), "support_probs": np.array([0.8, 0.1, 0.05, 0.05]),
                  "draws": 0, "decision_token": 0, "decision_logprob": -0.2, "logprobs": (-0.2,), "finish_reason": None, "triggers": (), "text": "a", "chunks": ()}
    values.update(changes)
    return Expected(**values)


def test_the_layers_are_registered_rules_in_the_seeds_order() -> None:
    """``ladder.STATE`` .. ``ladder.RESUME`` are registered, in M3.10's order."""
    assert LAYERS == ("STATE", "TENSOR", "POLICY", "DECISION", "SEQUENCE", "RESUME")
    for layer in LAYERS:
        assert RULES[f"ladder.{layer}"].kind == "ladder"


def test_matching_observation_passes() -> None:
    assert compare(_exp(), _obs()).result == PASSED


@pytest.mark.parametrize("change, layer, check", [
    ({"phase": "finished"}, "STATE", "phase"),
    ({"output_ids": [1]}, "STATE", "output_ids"),
    ({"rng_counter": 1}, "STATE", "rng_counter"),
    ({"cache_committed": 4}, "STATE", "cache_committed"),
    ({"frontier": {**FRONTIER, "processed": 4}}, "STATE", "frontier.processed"),
    ({"score_row": ROW + np.float32(0.01)}, "TENSOR", "score_row.linf"),
    ({"support_ids": [0, 1, 2]}, "POLICY", "support.ids"),
    ({"support_probs": [0.7, 0.2, 0.05, 0.05]}, "POLICY", "support.probs"),
    ({"decision": {"receipt_id": "receipt-0", "score_id": "score-1", "token_id": 0, "logprob": -0.2, "draws": 1}}, "POLICY", "draws"),
    ({"decision": {"receipt_id": "receipt-0", "score_id": "score-1", "token_id": 1, "logprob": -0.2, "draws": 0}}, "DECISION", "decision.selected_id"),
    ({"logprobs": [-0.3]}, "DECISION", "logprobs.value"),
    ({"text": "b"}, "SEQUENCE", "text"),
    ({"chunks": [{"chunk_idx": 0}]}, "SEQUENCE", "stream.chunks"),
])
def test_each_layer_fails_on_its_own_field(change, layer, check) -> None:
    """A difference in one field fails its layer (``ladder.<LAYER>``) with the named check."""
    verdict = compare(_exp(), _obs(**change))
    assert (verdict.result, verdict.layer, verdict.rule, verdict.check) == (FAILED, layer, f"ladder.{layer}", check)


def test_the_first_failed_layer_wins_and_a_later_pass_does_not_cure_it() -> None:
    """STATE and TENSOR both broken: STATE is reported; SEQUENCE passing changes nothing (ladder.STATE)."""
    verdict = compare(_exp(), _obs(rng_counter=5, score_row=ROW * 2))
    assert verdict.layer == "STATE"
    assert compare(_exp(), _obs(rng_counter=5), layers=("TENSOR", "SEQUENCE")).passed


def test_unexposed_fields_are_skipped() -> None:
    """``None`` in the observation means not exposed (a peer without phases or caches)."""
    assert compare(_exp(), _obs(phase=None, rng_counter=None, score_row=None, support_ids=None, cache_committed=None)).passed


def test_undecided_does_not_stop_a_later_failure() -> None:
    """An undecided DECISION judgement is reported unless a later layer (SEQUENCE) fails."""
    undecided = Verdict(UNDECIDED, "DECISION", "ladder.DECISION", "decision.margin")
    exp = _exp(decision_checks=(DecisionCheck(0, undecided),))
    assert compare(exp, _obs()).result == UNDECIDED
    assert compare(exp, _obs(text="zzz")).layer == "SEQUENCE"


def test_seed_example_l_infinity_premise_fails_first() -> None:
    """M3.10: reference [10, 0], candidate [100, 0], epsilon 1: same winner, but L-inf = 90 fails TENSOR (ladder.TENSOR)."""
    verdict = greedy_comparator([10.0, 0.0], [100.0, 0.0], 1.0)
    assert (verdict.result, verdict.layer, verdict.check, verdict.actual) == (FAILED, "TENSOR", "score_row.linf", 90.0)


def test_greedy_comparator_margin_rule() -> None:
    """Margin > 2 eps: ids must agree; margin <= 2 eps: another id is undecided, not a fail (ladder.DECISION)."""
    assert greedy_comparator([10.0, 0.0], [10.5, 0.0], 1.0).passed
    near = greedy_comparator([10.0, 9.5], [9.6, 9.9], 1.0)
    assert (near.result, near.layer, near.check) == (UNDECIDED, "DECISION", "decision.margin")
    wide = greedy_comparator([10.0, 6.0], [9.5, 6.5], 1.0, candidate_id=1)
    assert (wide.result, wide.check) == (FAILED, "decision.tie_rule")
    # ties go to the lowest id: a candidate that takes the higher id of a tie breaks the tie rule
    assert greedy_comparator([1.0, 1.0], [1.0, 1.0], 0.1, candidate_id=1).check == "decision.tie_rule"


def test_compare_rows_shapes_and_finite_sets() -> None:
    with pytest.raises(ValueError):
        compare_rows([1.0, 2.0], [1.0], 0.1)
    with pytest.raises(ValueError):
        compare_rows([1.0], [1.0], -1.0)
    assert compare_rows([0.0, -np.inf], [0.0, 0.0], 1.0).linf == np.inf  # another finite support never passes


def test_judge_decision_greedy_and_sampled() -> None:
    """The harness's per-decision judgement: margin for greedy, CDF distance for a replayed draw (ladder.DECISION)."""
    greedy = policy_config_from_json({"family": "greedy"})
    values = np.array([2.0, 1.99995, 0.0])
    assert judge_decision(policy=greedy, ref_values=values, ref_token=0, runtime_token=1, tolerance=TOL, greedy=True).result == UNDECIDED
    assert judge_decision(policy=greedy, ref_values=values, ref_token=0, runtime_token=2, tolerance=TOL, greedy=True).result == FAILED
    assert judge_decision(policy=greedy, ref_values=values, ref_token=0, runtime_token=1, tolerance=TOL, greedy=True,
                          cand_token=0).check == "decision.policy"
    sampled = policy_config_from_json({"family": "multinomial"})
    probs = np.array([0.5, 0.3, 0.2])
    kw = {"policy": sampled, "ref_values": np.log(probs), "ref_token": 0, "tolerance": TOL, "greedy": False, "ref_probs": probs}
    assert judge_decision(runtime_token=1, u=0.4999, **kw).result == UNDECIDED  # u at the boundary of [0.5, 0.8)
    assert judge_decision(runtime_token=1, u=0.2, **kw).result == FAILED
    assert judge_decision(runtime_token=0, u=0.2, **kw).result == PASSED


def test_a_decision_the_policy_makes_on_the_runtimes_own_admitted_row_is_undecided_not_failed() -> None:
    """A truncation is not continuous in the logits: the runtime's own row, within epsilon of the reference, may keep
    another id than the reference row does.  When the policy (with the same uniform) selects the runtime's id on that
    row, no tolerance-admitted row rules it out (``decision.own_row``); without that row, or when the policy selects
    another id there, the verdict stands.  Found by the machines: traces/undecided-typical-truncation-own-row.itf.json (first recorded as a failure)."""
    sampled = policy_config_from_json({"family": "multinomial"})
    probs = np.array([1.0, 0.0, 0.0])  # the reference keeps id 0 only
    kw = {"policy": sampled, "ref_values": np.array([0.0, -np.inf, -np.inf]), "ref_token": 0, "tolerance": TOL, "greedy": False,
          "ref_probs": probs, "u": 0.37, "runtime_token": 1}
    assert judge_decision(**kw).check == "decision.support"
    assert judge_decision(cand_token=1, **kw).check == "decision.support"  # own row not shown to be within epsilon
    own = judge_decision(cand_token=1, cand_within_tolerance=True, **kw)
    assert (own.result, own.check) == (UNDECIDED, "decision.own_row")
    assert judge_decision(cand_token=2, cand_within_tolerance=True, **kw).check == "decision.policy"
    finite = {**kw, "ref_values": np.log(np.array([0.9, 0.1, 1e-9])), "ref_probs": np.array([0.9, 0.1, 1e-9]), "u": 0.2}
    assert judge_decision(cand_token=1, **finite).check == "decision.draw"
    assert judge_decision(cand_token=1, cand_within_tolerance=True, **finite).check == "decision.own_row"
    greedy = policy_config_from_json({"family": "greedy"})
    values = np.array([2.0, 0.0, -1.0])
    assert judge_decision(policy=greedy, ref_values=values, ref_token=0, runtime_token=1, tolerance=TOL, greedy=True,
                          cand_token=1).check == "decision.selected_id"
    assert judge_decision(policy=greedy, ref_values=values, ref_token=0, runtime_token=1, tolerance=TOL, greedy=True,
                          cand_token=1, cand_within_tolerance=True).check == "decision.own_row"


def test_the_machines_truncation_counterexample_is_now_undecided() -> None:
    from pathlib import Path

    from decodespec.checks.modelcheck.traces import load_trace, replay

    path = Path(__file__).resolve().parent.parent / "traces" / "undecided-typical-truncation-own-row.itf.json"
    result = replay(load_trace(path), runtime="impl")
    assert (result.actual.result, result.actual.check) == (UNDECIDED, "decision.own_row")


def test_resume_layer_compares_with_the_uninterrupted_run() -> None:
    """``ladder.RESUME``: a restored request whose RNG counter or logprobs differ from the uninterrupted one fails."""
    same = _obs()
    assert compare(_exp(resume=same), _obs()).passed
    verdict = compare(_exp(resume=_obs(rng_counter=1)), _obs(), layers=("RESUME",))
    assert (verdict.layer, verdict.check, verdict.expected, verdict.actual) == ("RESUME", "resume.rng_counter", 1, 0)
    verdict = compare(_exp(resume=same), _obs(logprobs=[-0.5]), layers=("RESUME",))
    assert (verdict.layer, verdict.check) == ("RESUME", "resume.logprobs")


def test_combine_and_verdict_json() -> None:
    fail = Verdict(FAILED, "TENSOR", "ladder.TENSOR", "x", step=3)
    und = Verdict(UNDECIDED, "DECISION", "ladder.DECISION", "y")
    assert combine([Verdict(PASSED), und, fail]) is fail
    assert combine([Verdict(PASSED), und]) is und
    assert Verdict.from_json(fail.to_json()) == fail
    assert fail.same_outcome(attrs.evolve(fail, message="other", actual=1.0))
    assert not fail.same_outcome(attrs.evolve(fail, layer="STATE", rule="ladder.STATE"))


def test_tolerances_are_declared_per_model_and_dtype() -> None:
    # Runtime entry first, then the default: a stdio runtime falls back to our runtime's bound.
    assert tolerance_for("impl", "tiny", "float32") == TOLERANCES[("impl", "tiny", "float32")]
    assert tolerance_for("stdio:./server", "tiny", "float32") == TOLERANCES[("*", "tiny", "float32")]
    assert tolerance_for("impl", "tiny", "bfloat16").epsilon([10.0]) > tolerance_for("impl", "tiny", "float32").epsilon([10.0])
    with pytest.raises(KeyError):
        tolerance_for("impl", "tiny", "float64")
