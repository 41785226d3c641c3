"""The failure lab (checks/lab/mutants): catalogue, seams, the untouched normal path, and a CI-sized kill subset.

A mutant is a named, documented, shape-correct bug of the runtime (``mutant.*`` rules) installed
only inside its context manager.  These tests prove that every seam still resolves and every
source edit still applies, that the normal path holds exactly the same objects and computes the
same bits after every mutant, that the gate's reference stays on the oracle side while a mutant
is installed, that the harness tells a crash from a kill, and that one representative mutant per
group is killed by the gate's own checks on the tiny model (each in seconds; ``decodespec
mutants`` runs all of them, README "The failure lab").

Representatives: mutant.right_padding_last_column, mutant.argmax_over_time,
mutant.batch_rows_expand_after_eos, mutant.beam_parents_not_gathered,
mutant.cache_position_reset_after_prefill, mutant.final_norm_bypassed,
mutant.final_token_claimed_processed, mutant.global_rng, mutant.logprob_next_step,
mutant.encdec_memory_mutated, mutant.resume_resets_stop_matcher, mutant.vocab_local_max (killed by the gate's
distributed check, distributed.vocab_parallel.R2, which that group runs first), mutant.tp_wrong_kv_head_owner (on
``--runtime impl-tp``).
"""

from __future__ import annotations

import ast
import json
import pathlib

import pytest
import torch

from decodespec.checks.commands.cli import main
from decodespec.checks.lab import mutants as M
from decodespec.checks.lab.mutants import GROUPS, MUTANTS, Mutant, Patch
from decodespec.checks.lab.mutants.harness import CRASHED, KILLED, Calibration, GateCheck, run_gate
from decodespec.checks.lab.mutants.seams import SeamMoved, is_oracle_side, leaked, oracle_side
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.spec.policy import policy_config_from_json
from decodespec.spec.rules import RULES

REPRESENTATIVES = sorted(name for name, m in MUTANTS.items() if m.representative)
SAMPLED = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}]})


def _normal_path(model) -> list[tuple]:
    """What the unmutated runtime computes on a few requests (every cache family, greedy and sampled): ids, logprobs, logit bytes."""
    out = []
    for cache in ("none", "dynamic", "static"):
        for policy in (None, SAMPLED):
            request = RuntimeRequest(identity="sha256:" + "cd" * 32, prompt_ids=(1, 75, 104, 111, 111), max_new_tokens=4,
                                     cache=cache, prefill_chunk=2 if cache != "none" else None, seed=3,
                                     **({} if policy is None else {"policy": policy}))
            runner = RequestRunner(model, request)
            rows = []
            while runner.step() is not None:
                if runner.score is not None and (not rows or rows[-1][0] != runner.score.score_id):
                    rows.append((runner.score.score_id, runner.score.logits.float().numpy().tobytes()))
            out.append((cache, tuple(runner.output_ids), tuple(runner.logprobs), tuple(rows), runner.policy_state.rng_counter))
    return out


def test_the_catalogue_covers_both_failure_labs():
    """At least 40 mutants, each a registered ``mutant.*`` rule with a seed section and a statement; every group covered and represented."""
    assert len(MUTANTS) >= 40
    for name, m in MUTANTS.items():
        rule = RULES[m.rule_id]
        assert rule.kind == "mutant" and rule.section.startswith(("M3.10", "M3.8")) and len(rule.statement) > 80, name
        if m.checker is not None:  # the output-head group: killed by its own checker, patches no seam
            assert not m.patches and m.group == "output head", name
            continue
        assert m.patches and all(p.target.startswith("decodespec.impl.") for p in m.patches), name
    assert {m.group for m in MUTANTS.values()} == set(GROUPS)
    assert {MUTANTS[n].group for n in REPRESENTATIVES} == set(GROUPS) and len(REPRESENTATIVES) == len(GROUPS)
    assert any("M3.8 0x12" in m.section for m in MUTANTS.values()) and any("M3.10 0x0B" in m.section for m in MUTANTS.values())


def test_nothing_in_the_runtime_imports_the_failure_lab():
    """The runtime never reaches a mutant: no module of impl/ imports decodespec.checks."""
    impl = pathlib.Path(M.__file__).resolve().parents[2] / "impl"
    offenders = []
    for path in impl.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(("decodespec.checks", "..checks"))]
    assert offenders == []


def test_normal_path_is_untouched_after_every_mutant(tiny_model):
    """After each mutant's context exits, every seam (and every alias of it) holds the very same object, no dispatcher is
    left anywhere in decodespec, and the runtime computes bit-identical ids, logprobs and logits."""
    before = _normal_path(tiny_model)
    seams = M.seam_fingerprint()
    assert leaked() == []
    for name, m in MUTANTS.items():
        with m.applied():
            inside = M.seam_fingerprint()
            assert all(inside[s] is not seams[s] for s in m.seams), f"{name} did not patch its seams"
            assert leaked() or m.checker is not None, name  # a checker mutant installs nothing
        after = M.seam_fingerprint()
        assert after.keys() == seams.keys() and all(after[k] is seams[k] for k in seams), f"{name} left a seam changed"
        assert leaked() == [], name
    assert _normal_path(tiny_model) == before


def test_a_mutant_changes_the_runtime_side_only(tiny_model):
    """mutant.rope_q_not_k: inside the context the runtime's logits change; on the oracle side (the gate's reference) they do not."""
    ids = torch.tensor([[1, 75, 104, 111, 111, 35]])
    with torch.inference_mode():
        clean = tiny_model(ids).logits
        with M.get("mutant.rope_q_not_k").applied():
            assert not is_oracle_side()
            mutated = tiny_model(ids).logits
            with oracle_side():
                reference = tiny_model(ids).logits
        assert torch.equal(tiny_model(ids).logits, clean)
    assert torch.equal(reference, clean) and mutated.shape == clean.shape and not torch.allclose(mutated, clean, atol=1e-3)


def test_a_seam_that_moved_is_refused_and_installs_nothing():
    """An edit that no longer matches exactly once, or a seam that is gone, raises SeamMoved before anything is set."""
    seams = M.seam_fingerprint()
    moved = Patch("decodespec.impl.policy:greedy_select", edits=[("this text is not in the function", "x")])
    good = Patch("decodespec.impl.policy:decide", edits=[("raw = row.to(torch.float32)", "raw = row.to(torch.float64)")])
    for patches in ([good, moved], [Patch("decodespec.impl.policy:no_such_function", wrap=lambda f: f)]):
        with pytest.raises(SeamMoved), Mutant("moved", "logprob", "t", "M3.10 0x0B", "s", patches).applied():
            pass  # pragma: no cover - never entered
        assert all(M.seam_fingerprint()[k] is v for k, v in seams.items()) and leaked() == []


def _crash(original):
    def forward(self, call):
        raise RuntimeError("a shape error the mutant author did not mean")

    return forward


def test_a_crashing_mutant_is_reported_as_a_crash_not_a_kill():
    """The harness separates the gate's verdicts from exceptions out of the runtime (a weak mutant)."""
    crashing = Mutant("crashes", "commit", "t", "M3.10 0x0B", "s", [Patch("decodespec.impl.runtime:RequestRunner._forward", wrap=_crash)])
    result = run_gate(crashing, "tiny", checks=[GateCheck("boundary.one_token_prompt", "case", "tiny")])
    assert result.outcome == CRASHED and result.killed_by is None and "RuntimeError" in result.crash
    assert leaked() == []


@pytest.mark.parametrize("name", REPRESENTATIVES)
def test_representative_mutant_is_killed_by_the_gate(name):
    """One mutant per group (see the module docstring): the gate's case table, then its machines, on the tiny model,
    stop at a failing gate check that passes without the mutant."""
    calibration = Calibration()
    result = run_gate(name, "tiny", calibration=calibration)
    assert result.outcome == KILLED, (result.outcome, result.crash)
    check = result.killed_by["check"]
    if MUTANTS[name].checker is not None:  # the output-head group: its own checker, calibrated on the correct implementation
        assert calibration.findings[f"checker.{name}"].status == "passed" and result.excluded == ()
        assert result.killed_by["rule"].startswith("invariant.head_") or result.killed_by["rule"].startswith("invariant.vocab_")
        return
    assert calibration.findings[check].status == "passed" and result.excluded == ()
    assert result.killed_by["rule"].startswith("ladder.") and result.killed_by["layer"] in ("STATE", "TENSOR", "POLICY", "DECISION", "SEQUENCE", "RESUME")
    assert leaked() == []


def test_decodespec_mutants_command(capsys, tmp_path):
    """``decodespec mutants``: --list, a JSON run with a report that the docs read, exit 2 for an unknown mutant."""
    assert main(["mutants", "--list", "--group", "logprob"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in listed} == {m.rule_id for m in MUTANTS.values() if m.group == "logprob"}
    report = tmp_path / "failure-lab.jsonl"
    assert main(["mutants", "--only", "mutant.logprob_wrong_axis", "--json", "--report", str(report)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["summary"]["kill_rate"] == 1.0 and lines[0]["killed_by"].startswith("tiny: ") and "ladder.DECISION" in lines[0]["killed_by"]
    from decodespec.checks.docs.pages import load_results

    _, lab = load_results(tmp_path)
    assert [x["mutant"] for x in lab] == ["mutant.logprob_wrong_axis"] and lab[0]["killed"] is True
    assert main(["mutants", "--only", "no_such_mutant"]) == 2
