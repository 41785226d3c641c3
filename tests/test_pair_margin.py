"""Pair comparisons of the case table apply the margin rule where two runtime paths diverge (issue 8).

``matrix.*`` pair cases (no cache versus dynamic cache, eager versus SDPA ...) run the same
request down two runtime paths, each in lock step with the spec, then compare the two runs.
Where their token ids diverge, the divergence is judged against the spec's decision on the
reference row of the shared prefix: ``undecided`` when the reference margin is at most
2 epsilon (``ladder.DECISION``, check ``pair.margin``), ``failed`` only when the margin rules one
of the ids out.  Synthetic rows, no model.

Source: M3.10 "A logit tolerance is not a token-equality proof"; checks/gate/cases.py
``pair_verdict`` / ``pair_divergence_verdict``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from decodespec.checks.adapters import CaseConfig, Observation
from decodespec.checks.gate.divergence import pair_divergence_verdict, pair_verdict
from decodespec.checks.gate.ladder import FAILED, PASSED, UNDECIDED
from decodespec.checks.gate.lockstep import ReferenceDecision
from decodespec.checks.gate.tolerance import Tolerance
from decodespec.spec.policy import policy_config_from_json

V = 16
PROMPT = (1, 4, 9)
EPS = 0.1
TOL = Tolerance.from_logit(EPS, 0.1)
GREEDY = policy_config_from_json({"family": "greedy"})


def _row(top: int, second: int, gap: float) -> np.ndarray:
    row = np.linspace(-5.0, -3.0, V)
    row[top], row[second] = 2.0, 2.0 - gap
    return row


def _greedy_ref(index: int, row: np.ndarray) -> ReferenceDecision:
    probs = np.exp(row - row.max())
    return ReferenceDecision(index, int(np.argmax(row)), row, probs / probs.sum(), None, True, GREEDY)


def _run(ids: tuple[int, ...], rows: list[np.ndarray], refs: dict) -> SimpleNamespace:
    """A lock-step run's record: reset, then one observation per committed token (the row it decided on)."""
    observations = [Observation(phase="ready", output_ids=())]
    for n in range(1, len(ids) + 1):
        observations.append(Observation(phase="ready", output_ids=ids[:n], score_row=rows[n - 1].astype(np.float32),
                                        score_output_count=n - 1))
    return SimpleNamespace(config=CaseConfig(model="tiny", prompt_ids=PROMPT, max_new_tokens=len(ids)), observations=observations,
                           reference_decisions=refs)


def _pair(gap: float, *, row_b_shift: float = 0.0):
    """Two paths sharing output 0 (id 3), then diverging at output 1: A takes 5, B takes 7; reference margin ``gap``."""
    row0 = _row(3, 8, 1.0)
    row1 = _row(5, 7, gap)
    refs = {PROMPT: _greedy_ref(0, row0), PROMPT + (3,): _greedy_ref(1, row1)}
    a = _run((3, 5, 11), [row0, row1, _row(11, 2, 1.0)], refs)
    b = _run((3, 7, 12), [row0 + row_b_shift, row1 + row_b_shift, _row(12, 2, 1.0)], refs)
    return a, b


def test_divergence_at_a_near_tie_is_undecided() -> None:
    """ladder.DECISION: ids diverge where the reference margin 0.05 <= 2 epsilon = 0.2: undecided, not failed."""
    a, b = _pair(0.05)
    verdict = pair_verdict(a, b, ("ids", "logits"), TOL)
    assert verdict.result == UNDECIDED, verdict
    assert (verdict.layer, verdict.check, verdict.expected, verdict.actual) == ("DECISION", "pair.margin", 5, 7)
    assert "output 1" in verdict.message and "2 epsilon" in verdict.message


def test_divergence_at_a_wide_margin_fails() -> None:
    """ladder.DECISION: the reference margin 1.0 > 2 epsilon guarantees id 5; path B's 7 fails the pair."""
    a, b = _pair(1.0)
    verdict = pair_verdict(a, b, ("ids", "logits"), TOL)
    assert verdict.result == FAILED
    assert (verdict.layer, verdict.check, verdict.expected, verdict.actual) == ("DECISION", "decision.selected_id", 5, 7)
    assert "path B" in verdict.message


def test_rows_of_the_shared_prefix_are_still_compared() -> None:
    """ladder.TENSOR: a near tie does not excuse rows of the shared prefix more than 2 epsilon apart."""
    a, b = _pair(0.05, row_b_shift=0.5)
    verdict = pair_verdict(a, b, ("ids", "logits"), TOL)
    assert verdict.result == FAILED and verdict.layer == "TENSOR", verdict
    assert verdict.step == 1  # the first row (output 0), before the divergence


def test_identical_paths_pass_and_rows_after_a_divergence_are_not_compared() -> None:
    """Same ids: passed.  After a divergence the rows condition on different prefixes (here 11 vs 12 rows): ignored."""
    a, _ = _pair(0.05)
    assert pair_verdict(a, a, ("ids", "logits"), TOL).result == PASSED
    a, b = _pair(0.05)
    b.observations[-1] = Observation(phase="ready", output_ids=(3, 7, 12), score_row=np.full(V, 50.0, np.float32), score_output_count=2)
    assert pair_verdict(a, b, ("ids", "logits"), TOL).result == UNDECIDED


def test_a_path_outside_two_epsilon_fails_even_when_the_top_two_are_tied() -> None:
    """Greedy: B's id 9 is 1.0 below the maximum although ids 5 and 7 tie: the reference rules it out."""
    row = _row(5, 7, 0.0)
    row[9] = 1.0
    ref = _greedy_ref(0, row)
    assert pair_divergence_verdict(ref, 7, 5, TOL).result == UNDECIDED
    verdict = pair_divergence_verdict(ref, 5, 9, TOL)
    assert verdict.result == FAILED and verdict.check == "decision.selected_id"


def test_sampled_divergence_uses_the_draw_margin() -> None:
    """selector.multinomial: a divergence is undecided only when the uniform lies within the tolerance of both ids' intervals."""
    policy = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 1.0}]})
    probs = np.zeros(V)
    probs[[4, 5, 6]] = [0.3, 0.4, 0.3]
    values = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), -np.inf)
    near = ReferenceDecision(0, 4, values, probs, 0.299, False, policy)  # inside 4's interval [0, 0.3), 0.001 from 5's
    assert pair_divergence_verdict(near, 4, 5, TOL).result == UNDECIDED
    far = ReferenceDecision(0, 5, values, probs, 0.45, False, policy)
    verdict = pair_divergence_verdict(far, 5, 6, TOL)  # 0.45 is 0.25 from 6's interval [0.7, 1.0) > 2 epsilon / T = 0.2
    assert verdict.result == FAILED and verdict.check == "decision.draw"


# ---- custom procedures (a padded batch row, a width-one beam) against the lock-step run -------------------------


def test_a_batch_row_diverging_at_a_near_tie_is_undecided_not_failed() -> None:
    """``path_divergence_verdict``: the batch row's id at the divergence lies within 2 eps of the reference maximum."""
    from decodespec.checks.gate.divergence import path_divergence_verdict

    run = _pair(0.05)[0]  # reference margin 0.05 <= 2 eps = 0.2 at output 1
    verdict = path_divergence_verdict(run, (3, 5, 11), (3, 7, 12), TOL, layer="STATE", check="batch.output_ids",
                                      what="batch row 0 and the batch-size-one run")
    assert verdict.result == UNDECIDED and verdict.check == "pair.margin"
    assert verdict.message.startswith("batch row 0 and the batch-size-one run: ")


def test_a_batch_row_diverging_at_a_wide_margin_fails_on_its_id() -> None:
    from decodespec.checks.gate.divergence import path_divergence_verdict

    run = _pair(1.0)[0]  # margin 1.0 > 2 eps: id 7 is ruled out
    verdict = path_divergence_verdict(run, (3, 5, 11), (3, 7, 12), TOL, layer="DECISION", check="beam.tokens",
                                      what="greedy decoding and beam width one")
    assert verdict.result == FAILED and verdict.layer == "DECISION" and "path B" in verdict.message


def test_equal_paths_pass_and_a_path_running_past_the_other_fails_at_the_named_check() -> None:
    """A row that goes on after the other stopped (rows expanding after EOS) is no near tie: it fails."""
    from decodespec.checks.gate.divergence import path_divergence_verdict

    run = _pair(0.05)[0]
    assert path_divergence_verdict(run, (3, 5), (3, 5), TOL, layer="STATE", check="batch.output_ids", what="x").result == PASSED
    verdict = path_divergence_verdict(run, (3, 5), (3, 5, 11), TOL, layer="STATE", check="batch.output_ids", what="rows")
    assert (verdict.result, verdict.layer, verdict.check) == (FAILED, "STATE", "batch.output_ids")


# ---- an expectation tied to one model (checks/gate/expectations/*.toml ``model``) -----------------------------------


def test_an_expectation_with_a_model_explains_and_is_missed_only_on_that_model(tmp_path) -> None:
    """``hf.stop_strings_need_a_tokenizer`` is tiny-only: on SmolLM2 it neither explains a failure nor is reported unused."""
    from decodespec.checks.gate.cases import CaseResult, load_expectations, unused_expectations
    from decodespec.checks.gate.ladder import Verdict

    (tmp_path / "peer.toml").write_text('[[deviation]]\nid = "peer.x"\ncase = "boundary.stop_*"\nmodel = "tiny"\nreason = "r"\n')
    (e,) = load_expectations("peer", tmp_path)
    failed = Verdict(FAILED, "STATE", "ladder.STATE", "accept_reject", None, None, "refused")
    assert e.model == "tiny" and e.matches("boundary.stop_one", failed, model="tiny")
    assert not e.matches("boundary.stop_one", failed, model="smollm2")
    ran_smollm2 = [CaseResult("boundary.stop_one", "peer", "smollm2", "pass", Verdict(PASSED))]
    ran_tiny = [CaseResult("boundary.stop_one", "peer", "tiny", "pass", Verdict(PASSED))]
    assert unused_expectations([e], ran_smollm2) == [] and unused_expectations([e], ran_tiny) == [e]
    assert load_expectations("hf")  # the shipped file still loads
    assert {x.id: x.model for x in load_expectations("hf")}["hf.stop_strings_need_a_tokenizer"] == "tiny"


def test_an_expectation_case_field_may_join_several_globs_with_a_bar(tmp_path) -> None:
    """``case = "boundary.stop_*|sweep.field.stop_strings"`` matches either glob and nothing else, for explaining and for
    ``unused``; the shipped ``hf.stop_string_not_trimmed`` covers the sweep case its SmolLM2 run met (stop 30)."""
    from decodespec.checks.gate.cases import CaseResult, case_matches, load_expectations, unused_expectations
    from decodespec.checks.gate.ladder import Verdict

    assert case_matches("boundary.stop_*|sweep.field.stop_strings", "sweep.field.stop_strings")
    assert case_matches("boundary.stop_*|sweep.field.stop_strings", "boundary.stop_one")
    assert not case_matches("boundary.stop_*|sweep.field.stop_strings", "sweep.field.stop_strings_x")
    assert not case_matches("boundary.stop_*|sweep.field.stop_strings", "sweep.stop.include")
    (tmp_path / "peer.toml").write_text('[[deviation]]\nid = "peer.x"\ncase = "boundary.stop_*|sweep.field.stop_strings"\n'
                                        'layer = "SEQUENCE"\ncheck = "text"\nreason = "r"\n')
    (e,) = load_expectations("peer", tmp_path)
    text = Verdict(FAILED, "SEQUENCE", "ladder.SEQUENCE", "text", "", "The", "text")
    assert e.matches("sweep.field.stop_strings", text) and e.matches("boundary.stop_one", text)
    assert not e.matches("sweep.field.include_stop_str", text)
    assert unused_expectations([e], [CaseResult("sweep.field.stop_strings", "peer", "smollm2", "pass", Verdict(PASSED))]) == [e]
    assert unused_expectations([e], [CaseResult("sweep.field.eos_ids", "peer", "smollm2", "pass", Verdict(PASSED))]) == []
    hf = {x.id: x for x in load_expectations("hf")}["hf.stop_string_not_trimmed"]
    assert hf.matches("sweep.field.stop_strings", text, model="smollm2") and not hf.matches("sweep.field.stop_strings", text, model="tiny")
