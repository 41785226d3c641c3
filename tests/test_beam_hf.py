"""Beam runtime (impl/beam.py) against HF transformers 5.24 on SmolLM2, and the declared deviations.

Under ``BeamParams.hf_compatible(K, G, [EOS], length_penalty=a, early_stopping=e)`` our runtime must
return HF ``generate(num_beams=K, do_sample=False, length_penalty=a, early_stopping=e,
num_return_sequences=K, output_scores=True, return_dict_in_generate=True)``'s sequences
(identical, after HF's fill value), ``sequences_scores`` (within 1e-4 in float32) and
``beam_indices`` (our ancestry), for three prompts and K in {2, 4}, across HF's three
``early_stopping`` settings and several length penalties; every run is also replayed by the spec
with the branch hash of every child.  Where HF differs from the spec, the difference is an entry
of ``checks/gate/expectations/hf.toml`` (its ``test`` names the test below that shows it), and the
spec's answer is what our runtime returns under the normative parameters.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch
from test_beam_runtime_smollm2 import EOS, QUESTIONS, chat_ids, search

from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.spec import beam as B
from decodespec.spec.rules import RULES

ROOT = Path(__file__).resolve().parents[1]
EXPECTATIONS = ROOT / "checks" / "gate" / "expectations" / "hf.toml"
#: Declared float32 tolerance on HF's sequences_scores (HF sums in float32, we in float64).
SCORE_TOL = 1e-4
G = 12


def hf_beams(hf_model, prompt, num_beams, **kw):
    """HF ``generate`` with beams on one prompt; returns the output dict."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return hf_model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=num_beams, num_return_sequences=num_beams,
                                 do_sample=False, max_new_tokens=G, output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=EOS, pad_token_id=EOS, **kw)


def strip_fill(ids, fill=EOS):
    """Generated ids without trailing fill values (HF fills with ``pad_token_id or eos_token_id[0]`` = EOS here)."""
    out = list(ids)
    while out and out[-1] == fill:
        out.pop()
    return out


def assert_equal_to_hf(out, prompt, result, num_beams):
    hyps = result.hypotheses[:num_beams]
    assert len(hyps) == out.sequences.shape[0] == num_beams
    for row, score, parents, h in zip(out.sequences.tolist(), out.sequences_scores.tolist(), out.beam_indices.tolist(), hyps):
        assert row[: len(prompt)] == list(prompt)
        assert strip_fill(row[len(prompt):]) == strip_fill(h.output_ids)
        assert row[len(prompt): len(prompt) + h.length] == list(h.output_ids)
        assert abs(score - h.normalized) <= SCORE_TOL
        assert parents[: h.length] == list(h.ancestry) and all(p == -1 for p in parents[h.length:])


# (question, K, early_stopping, length_penalty): each K meets each early_stopping setting.
CASES = [
    (0, 2, False, 1.0), (1, 2, True, 0.0), (2, 2, "never", -0.5),
    (0, 4, True, 1.0), (1, 4, "never", 2.0), (2, 4, False, 0.5),
]


@requires_smollm2
@requires_hf
@pytest.mark.smollm2
@pytest.mark.hf
@pytest.mark.parametrize("question, num_beams, early_stopping, alpha", CASES,
                         ids=[f"q{q}-K{k}-es={e}-lp={a}" for q, k, e, a in CASES])
def test_runtime_equals_hf_beam_search_under_the_hf_parameters(smollm2_model, smollm2_tokenizer, hf_smollm2,
                                                              question, num_beams, early_stopping, alpha):
    """transition.beam_step, transition.beam_stop, transform.beam_length_penalty under
    BeamParams.hf_compatible: HF's sequences (after its fill value, hf.beam_fill_value),
    sequences_scores (within 1e-4: hf.beam_float32_sums) and beam_indices; and the spec replayed
    over our rows with every child's branch hash."""
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[question])
    params = B.BeamParams.hf_compatible(num_beams, G, [EOS], length_penalty=alpha, early_stopping=early_stopping)
    runner = search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[question])  # replayed by the spec
    out = hf_beams(hf_smollm2, prompt, num_beams, length_penalty=alpha, early_stopping=early_stopping)
    assert_equal_to_hf(out, prompt, runner.result(), num_beams)


@requires_smollm2
@requires_hf
@pytest.mark.smollm2
@pytest.mark.hf
def test_normative_exact_search_keeps_searching_where_hfs_default_stops(smollm2_model, smollm2_tokenizer, hf_smollm2):
    """Expectation hf.beam_heuristic_early_stopping: HF's default (early_stopping=False,
    length_penalty=1) stops on s / lp(g) once K are finished; the normative exact bound
    (s / lp(G) for alpha > 0) keeps searching the same finite-beam trace past HF's stop, so its best
    is at least HF's."""
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[0])
    out = hf_beams(hf_smollm2, prompt, 2, length_penalty=1.0, early_stopping=False)
    hf_steps = int((out.beam_indices[0] >= 0).sum())
    params = B.BeamParams(2, G, [EOS], length_penalty=B.LengthPenalty(1.0), early_stop="exact")
    runner = search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[0])  # replayed by the spec
    result = runner.result()
    assert len(result.steps) > hf_steps  # HF stopped; the exact bound could not yet
    assert result.best.normalized >= out.sequences_scores[0].item() - SCORE_TOL


@requires_smollm2
@requires_hf
@pytest.mark.smollm2
@pytest.mark.hf
def test_processor_rows_are_renormalised_unlike_hfs(smollm2_model, smollm2_tokenizer, hf_smollm2):
    """Expectation hf.beam_processor_renormalisation: with a processor (repetition_penalty), HF adds
    the processed log-probabilities un-renormalised; the M3.8 policy renormalises them
    (log_softmax), so the scores differ by more than the float32 tolerance (the deviation occurs)."""
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[1])
    params = B.BeamParams.hf_compatible(2, 8, [EOS], length_penalty=1.0, early_stopping=True)
    runner = search(smollm2_model, smollm2_tokenizer, params, QUESTIONS[1],
                    transforms=[{"name": "repetition_penalty", "penalty": 1.3}])  # replayed by the spec
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, num_return_sequences=2,
                                  do_sample=False, max_new_tokens=8, output_scores=True, return_dict_in_generate=True,
                                  eos_token_id=EOS, pad_token_id=EOS, length_penalty=1.0, early_stopping=True,
                                  repetition_penalty=1.3)
    ours = runner.result().hypotheses[0]
    theirs = out.sequences_scores[0].item()
    assert abs(ours.normalized - theirs) > 100 * SCORE_TOL
    for log in runner.log:  # ours: each row is a log-probability row (float32 log_softmax over V = 49152)
        assert torch.logsumexp(log.rows.double(), dim=-1).abs().max() < 1e-4


@requires_smollm2
@requires_hf
@pytest.mark.smollm2
@pytest.mark.hf
def test_cli_beams_are_hfs_sequences_and_sequence_scores(smollm2_model, smollm2_tokenizer, hf_smollm2, capsys, monkeypatch):
    """decodespec generate --chat --num-beams 4 --length-penalty 1 --early-stopping true --json: the
    best hypothesis and every beam (ids and HF's sequence score) are HF's num_return_sequences=4
    output (the loaded models are the session's, so only the command path runs here)."""
    import json

    from decodespec.checks.commands import generate as command
    from decodespec.checks.commands.cli import main

    monkeypatch.setattr(command, "_load", lambda *a, **k: (smollm2_model, smollm2_tokenizer))
    assert main(["generate", "--chat", "--prompt", QUESTIONS[2], "--device", "cpu", "--num-beams", "4", "--max-new-tokens",
                 str(G), "--length-penalty", "1.0", "--early-stopping", "true", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    prompt = chat_ids(smollm2_tokenizer, QUESTIONS[2])
    assert payload["prompt_ids"] == list(prompt)
    out = hf_beams(hf_smollm2, prompt, 4, length_penalty=1.0, early_stopping=True)
    assert len(payload["beams"]) == 4 and payload["output_ids"] == payload["beams"][0]["output_ids"]
    for row, score, beam in zip(out.sequences.tolist(), out.sequences_scores.tolist(), payload["beams"]):
        assert strip_fill(row[len(prompt):]) == strip_fill(beam["output_ids"])
        assert abs(score - beam["score"]) <= SCORE_TOL
    assert payload["text"] == smollm2_tokenizer.decode(strip_fill(payload["output_ids"]))


# --------------------------------------------------------------------------------------------
# The expectations file is well formed and every entry points at real evidence.
# --------------------------------------------------------------------------------------------


def test_every_beam_expectation_names_a_rule_a_doc_row_and_an_existing_test():
    """checks/gate/expectations/hf.toml: each beam deviation has an id, a registered rule id, the HF
    source, the spec's answer, the reason, the docs/beam-expectations.md row it refines, and a test
    in this repository that shows it."""
    from decodespec.checks.gate.cases import load_expectations
    from decodespec.checks.gate.ladder import Verdict

    data = tomllib.loads(EXPECTATIONS.read_text(encoding="utf-8"))
    entries = [e for e in data["deviation"] if e["id"].startswith("hf.beam_")]
    loaded = {e.id: e for e in load_expectations("hf")}
    other = Verdict("failed", "DECISION", "ladder.DECISION", "tokens", [1], [2], "a greedy token differs")
    for e in entries:  # bound to beam cases and their rule: never an explanation for another failure
        assert e["case"] == "beam.*" and loaded[e["id"]].rule == e["rule"]
        assert not loaded[e["id"]].matches("matrix.greedy_vs_beam1", other)
        assert not loaded[e["id"]].matches("beam.search", other)
    assert len(entries) >= 6 and len({e["id"] for e in entries}) == len(entries)
    doc = (ROOT / "docs" / "beam-expectations.md").read_text(encoding="utf-8")
    rows = {int(m) for m in re.findall(r"^\| (\d+) \|", doc, flags=re.MULTILINE)}
    for e in entries:
        assert {"id", "rule", "hf", "spec", "reason", "source", "doc_row", "test"} <= set(e), e["id"]
        assert e["rule"] in RULES, e["rule"]
        assert e["doc_row"] in rows, e["id"]
        path, _, name = e["test"].partition("::")
        text = (ROOT / path).read_text(encoding="utf-8")
        assert f"def {name}(" in text, e["test"]
        body = text[text.index(f"def {name}("):]
        assert e["id"] in body[: body.find("\ndef ", 1)], f"{e['test']} does not name {e['id']}"
