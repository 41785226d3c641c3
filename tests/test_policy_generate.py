"""The M3.8 policy inside generation: receipts per step, request-owned draws, spec replay, CLI flags.

The runtime loop hands each raw logits row to ``impl.policy.decide``; these tests capture those
exact rows and let the spec (``decodespec.spec.policy.decide``) decide on them independently:
the spec must pick the same token with the same draw, RNG address and next policy state
(outside float32 margins), which is the POLICY/DECISION rung of the conformance ladder.

Rules: selector.multinomial, selector.greedy, transform.temperature, transform.top_k,
transform.top_p, transform.repetition_penalty.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.testing import requires_smollm2
from decodespec.impl import generate as gen
from decodespec.impl import runtime as rt  # the controller calls the policy twin
from decodespec.spec.policy import PolicyState, ScoreRow, decide, policy_config_from_json, processed_row
from decodespec.spec.policy.selectors import greedy, multinomial

SAMPLING = {"family": "multinomial", "order": "hf", "transforms": [
    {"name": "repetition_penalty", "penalty": 1.3}, {"name": "temperature", "temperature": 0.9},
    {"name": "top_k", "k": 40}, {"name": "top_p", "p": 0.92}]}


def _captured_generate(monkeypatch, model, prompt, **kwargs):
    """Run ``generate`` and return (result, [(row float32 numpy, state_before, view), ...])."""
    calls = []
    real = rt.policy_decide

    def spy(row, config, state, view, **kw):
        calls.append((row.detach().float().cpu().numpy().copy(), state, view))
        return real(row, config, state, view, **kw)

    monkeypatch.setattr(rt, "policy_decide", spy)
    result = gen.generate(model, prompt, **kwargs)
    monkeypatch.setattr(rt, "policy_decide", real)
    return result, calls


def _spec_agrees(config, calls, result):
    """The spec re-decides every captured row; returns how many decisions were compared."""
    compared = 0
    for (row, state, view), receipt in zip(calls, result.receipts):
        spec_row = ScoreRow.create(row.astype(np.float64))
        spec_receipt, spec_state = decide(spec_row, config, state, view)
        assert (spec_receipt.draws, spec_receipt.rng, spec_receipt.step) == (receipt.draws, receipt.rng, receipt.step)
        pr = processed_row(spec_row, config, state, view)
        margin = multinomial(pr.probs, spec_receipt.rng.uniforms[0])[1] if spec_receipt.draws else greedy(pr.values)[1]
        if min(margin, pr.margin) > 1e-4:
            compared += 1
            assert spec_receipt.selected_id == receipt.selected_id
            assert spec_state == receipt.state_after
            assert spec_receipt.raw_logprob == pytest.approx(receipt.raw_logprob, abs=1e-4)
    return compared


def test_sampled_generation_has_one_receipt_per_token_and_counts_its_draws(tiny_model, byte_tokenizer):
    """selector.multinomial in the loop: receipts chain states, one draw per token at (step, 0), replayable."""
    config = policy_config_from_json(SAMPLING)
    kwargs = {"max_new_tokens": 12, "policy": config, "eos_token_ids": (), "identity": "req-A", "seed": 7, "tokenizer": byte_tokenizer}
    result = gen.generate(tiny_model, [1, 2, 3], **kwargs)
    assert len(result.receipts) == len(result.output_ids) == 12 and result.rng_counter == 12
    before = PolicyState()
    for step, (receipt, token, logprob) in enumerate(zip(result.receipts, result.output_ids, result.logprobs)):
        assert (receipt.selected_id, receipt.raw_logprob, receipt.step) == (token, logprob, step)
        assert receipt.draws == 1 and receipt.rng.addresses == ((step, 0),)
        assert receipt.state_before == before and receipt.preset == "hf"
        before = receipt.state_after
    again = gen.generate(tiny_model, [1, 2, 3], **kwargs)
    assert again.output_ids == result.output_ids and again.receipts == result.receipts
    other = gen.generate(tiny_model, [1, 2, 3], **{**kwargs, "seed": 8})
    assert other.receipts[0].rng.key_id != result.receipts[0].rng.key_id
    payload = json.loads(json.dumps(result.to_json()))
    assert payload["rng_counter"] == 12 and payload["receipts"][0]["receipt_id"] == result.receipts[0].receipt_id


def test_spec_reproduces_every_runtime_decision_on_the_runtime_rows(tiny_model, monkeypatch):
    """The spec decides the same tokens as the runtime on the exact rows the runtime saw."""
    config = policy_config_from_json(SAMPLING)
    result, calls = _captured_generate(monkeypatch, tiny_model, [5, 6, 7, 8], max_new_tokens=16, policy=config, eos_token_ids=(), identity="spec-replay", seed=3)
    assert len(calls) == 16
    assert _spec_agrees(config, calls, result) >= 14


def test_greedy_and_temperature_zero_draw_nothing(tiny_model):
    """selector.greedy and the temperature-0 branch: same tokens as the plain greedy loop, rng_counter 0."""
    greedy_result = gen.greedy_generate(tiny_model, [1, 2, 3], max_new_tokens=10, eos_token_ids=())
    assert greedy_result.rng_counter == 0 and all(r.draws == 0 and r.selector == "greedy" for r in greedy_result.receipts)
    t0 = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.0}, {"name": "top_p", "p": 0.5}]})
    branch = gen.generate(tiny_model, [1, 2, 3], max_new_tokens=10, eos_token_ids=(), policy=t0, identity="x", seed=1)
    assert branch.output_ids == greedy_result.output_ids and branch.rng_counter == 0
    assert {r.greedy_reason for r in branch.receipts} == {"temperature_zero"}


def test_beam_policy_is_refused_before_any_model_call(tiny_model, monkeypatch):
    """policy.family_mismatch: generate runs one sequence."""
    from decodespec.spec.errors import Rejection

    monkeypatch.setattr(tiny_model, "forward", lambda *a, **k: pytest.fail("model called"))
    with pytest.raises(Rejection) as info:
        gen.generate(tiny_model, [1, 2], max_new_tokens=3, policy=policy_config_from_json({"family": "beam", "num_beams": 2}))
    assert info.value.code == "policy.family_mismatch"


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_sampling_flags_build_the_policy_and_print_receipts():
    """decodespec generate --do-sample --temperature --top-k --top-p --min-p --repetition-penalty --order --json."""
    argv = ["generate", "--model", "tiny", "--prompt", "abc", "--max-new-tokens", "6", "--device", "cpu", "--json",
            "--do-sample", "--seed", "5", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05",
            "--repetition-penalty", "1.1", "--order", "vllm"]
    code, out, _ = _cli(*argv)
    assert code == 0
    payload = json.loads(out)
    assert [t["name"] for t in payload["policy"]["transforms"]] == ["repetition_penalty", "temperature", "min_p", "top_k", "top_p"]
    assert payload["policy"]["order"] == "vllm" and payload["seed"] == 5
    assert payload["rng_counter"] == len(payload["output_ids"]) == len(payload["receipts"])
    assert [r["selected_id"] for r in payload["receipts"]] == payload["output_ids"]
    assert _cli(*argv)[1] == out  # replay in the same process: same identity, seed, tokens, receipts
    code, out, _ = _cli(*argv[:-8], "--seed", "6", "--temperature", "0.8", "--top-k", "20", "--order", "vllm")
    assert code == 0 and json.loads(out)["receipts"][0]["rng"]["key_id"] != payload["receipts"][0]["rng"]["key_id"]


def test_cli_rejects_warpers_without_do_sample():
    """policy.warper_requires_sampling: a warper flag without --do-sample is refused, not ignored (exit 2)."""
    code, out, err = _cli("generate", "--model", "tiny", "--prompt", "abc", "--max-new-tokens", "2", "--top-p", "0.9")
    assert code == 2 and out == ""
    assert json.loads(err)["error"]["code"] == "policy.warper_requires_sampling"
    code, out, _ = _cli("generate", "--model", "tiny", "--prompt", "abc", "--max-new-tokens", "3", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["rng_counter"] == 0 and json.loads(out)["policy"]["family"] == "greedy"


@requires_smollm2
def test_smollm2_sampling_replays_and_the_spec_agrees(smollm2_model, smollm2_tokenizer, monkeypatch):
    """SmolLM2: a seeded sampled run replays exactly, and the spec reproduces its decisions on its rows."""
    config = policy_config_from_json(SAMPLING)
    prompt = [1, *smollm2_tokenizer.encode("The capital of France is")]
    kwargs = {"max_new_tokens": 8, "policy": config, "identity": "smollm2-sample", "seed": 11, "vocab_hash": smollm2_tokenizer.sha256}
    result, calls = _captured_generate(monkeypatch, smollm2_model, prompt, **kwargs)
    again = gen.generate(smollm2_model, prompt, **kwargs)
    assert again.output_ids == result.output_ids and again.receipts == result.receipts
    assert result.rng_counter == len(result.output_ids)
    assert result.receipts[0].vocab_hash == smollm2_tokenizer.sha256 and result.receipts[0].vocab_size == 49152
    assert _spec_agrees(config, calls, result) >= len(calls) - 1
