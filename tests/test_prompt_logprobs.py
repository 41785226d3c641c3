"""Prompt logprobs (M3.10 0x02 "Prompt logprobs versus generated-token logprobs"): spec, envelope, runtime, references.

``invariant.prompt_logprobs_aligned``: row i of the prefill scores x_{i+1}; x_0 has no score (first-token policy
``none``: an entry without a logprob; ``omitted``: no entry); the values are the raw log-softmax of the prefill rows
and do not depend on chunking, the cache family or the no-cache path.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from decodespec.spec import envelope as E
from decodespec.spec.errors import Rejection
from decodespec.spec.prompt_logprobs import FirstTokenPolicy, PromptLogprob, PromptLogprobsSpec, prompt_logprobs_aligned, scored_positions
from decodespec.spec.rules import RULES

REPO = Path(__file__).resolve().parents[1]
TINY = json.loads((REPO / "docs" / "examples" / "tiny.request.json").read_text())


def _envelope(**output) -> bytes:
    env = copy.deepcopy(TINY)
    env["output"].update(output)
    return json.dumps(env).encode()


# -- spec ---------------------------------------------------------------------------------------


def test_rule_is_registered_with_its_section():
    rule = RULES["invariant.prompt_logprobs_aligned"]
    assert "0x02" in rule.section and "Prompt logprobs versus generated-token logprobs" in rule.section
    assert rule.obj is prompt_logprobs_aligned


def test_scored_positions_row_i_scores_token_i_plus_one():
    none = PromptLogprobsSpec()
    assert none.first_token is FirstTokenPolicy.NONE and none.top_k == 0
    assert scored_positions(4, none) == ((0, None), (1, 0), (2, 1), (3, 2))
    omitted = PromptLogprobsSpec(first_token="omitted")
    assert scored_positions(4, omitted) == ((1, 0), (2, 1), (3, 2))
    assert scored_positions(1, omitted) == () and scored_positions(1, none) == ((0, None),)
    assert none.num_entries(4) == 4 and omitted.num_entries(4) == 3 and omitted.num_entries(1) == 0


@pytest.mark.parametrize("top_k", [-1, 21, True, 1.0])
def test_spec_refuses_top_k_outside_its_range(top_k):
    with pytest.raises(ValueError):
        PromptLogprobsSpec(top_k=top_k)


def _entries(prompt, spec):
    out = []
    for position, row in scored_positions(len(prompt), spec):
        if row is None:
            out.append(PromptLogprob(position, prompt[position]))
        else:
            top = tuple((t, -0.5 - j) for j, t in enumerate(sorted({prompt[position], 7, 8, 9} - {prompt[position]})))[: spec.top_k]
            top = ((prompt[position], -0.1),) + top[: max(spec.top_k - 1, 0)] if spec.top_k else ()
            out.append(PromptLogprob(position, prompt[position], -0.1, 1, top))
    return out


@pytest.mark.parametrize("first", ["none", "omitted"])
def test_invariant_accepts_the_shape_and_refuses_each_break(first):
    prompt = (1, 5, 6, 5)
    spec = PromptLogprobsSpec(first_token=first, top_k=2)
    good = _entries(prompt, spec)
    assert prompt_logprobs_aligned(prompt, spec, good)
    import attrs

    k = 1 if first == "none" else 0
    broken = [
        good[:-1],  # one entry short
        good + [good[-1]],  # one too many
        [attrs.evolve(good[k], token_id=9)] + good[k + 1:] if k == 0 else good[:1] + [attrs.evolve(good[1], token_id=9)] + good[2:],
        good[:k] + [attrs.evolve(good[k], logprob=0.5)] + good[k + 1:],  # a positive logprob
        good[:k] + [attrs.evolve(good[k], logprob=float("nan"))] + good[k + 1:],
        good[:k] + [attrs.evolve(good[k], rank=2)] + good[k + 1:],  # rank disagrees with the top-k place
        good[:k] + [attrs.evolve(good[k], top=good[k].top[::-1])] + good[k + 1:],  # increasing top-k
        good[:k] + [attrs.evolve(good[k], top=good[k].top[:1])] + good[k + 1:],  # top_k entries short
    ]
    if first == "none":
        broken.append([attrs.evolve(good[0], logprob=-1.0)] + good[1:])  # x_0 scored without a row
    for entries in broken:
        assert not prompt_logprobs_aligned(prompt, spec, entries)


# -- envelope ---------------------------------------------------------------------------------


def test_envelope_field_defaults_and_identity():
    plain, identity = E.validate_request_envelope(_envelope())
    assert plain.output.prompt_logprobs is None
    req, requested = E.validate_request_envelope(_envelope(prompt_logprobs={}))
    assert req.output.prompt_logprobs == PromptLogprobsSpec()
    _explicit, same = E.validate_request_envelope(_envelope(prompt_logprobs={"first_token": "none", "top_k": 0}))
    assert same == requested != identity  # defaults filled in before hashing; absent is another request
    other, omitted = E.validate_request_envelope(_envelope(prompt_logprobs={"first_token": "omitted", "top_k": 5}))
    assert other.output.prompt_logprobs == PromptLogprobsSpec(first_token=FirstTokenPolicy.OMITTED, top_k=5)
    assert omitted not in (identity, requested)


@pytest.mark.parametrize("value, code, path", [
    ({"first_token": "bos"}, "envelope.invalid_value", "$.output.prompt_logprobs.first_token"),
    ({"top_k": 21}, "envelope.out_of_range", "$.output.prompt_logprobs.top_k"),
    ({"top_k": 1.0}, "envelope.type_mismatch", "$.output.prompt_logprobs.top_k"),
    ({"enabled": True}, "envelope.unknown_field", "$.output.prompt_logprobs.enabled"),
    (True, "envelope.type_mismatch", "$.output.prompt_logprobs"),
])
def test_envelope_refuses_bad_prompt_logprobs(value, code, path):
    with pytest.raises(Rejection) as info:
        E.validate_request_envelope(_envelope(prompt_logprobs=value))
    assert (info.value.code, info.value.path) == (code, path)


def test_envelope_refuses_prompt_logprobs_without_a_prefill_call():
    env = copy.deepcopy(TINY)
    env["output"]["prompt_logprobs"] = {}
    env["termination"]["max_new_tokens"] = 0
    env["termination"]["min_new_tokens"] = 0
    env["termination"]["zero_new_tokens"] = "no_call"
    with pytest.raises(Rejection) as info:
        E.validate_request_envelope(json.dumps(env).encode())
    assert (info.value.code, info.value.path) == ("envelope.output_unimplementable", "$.output.prompt_logprobs")
    env["termination"]["zero_new_tokens"] = "prefill_only"
    request, _ = E.validate_request_envelope(json.dumps(env).encode())
    assert request.output.prompt_logprobs == PromptLogprobsSpec()


# -- runtime --------------------------------------------------------------------------------

import attrs

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.adapters.impl import ImplAdapter, load_model
from decodespec.checks.gate.prompt_logprobs import judge, reference_rows, variants
from decodespec.checks.gate.prompts import prompt_ids
from decodespec.checks.gate.tolerance import tolerance_for
from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.impl.faults import DeviceFault, FaultPlan
from decodespec.impl.runtime import RequestRunner, RuntimeRequest

SPEC3 = PromptLogprobsSpec(top_k=3)


def _config(model: str, **changes) -> CaseConfig:
    return CaseConfig(model=model, prompt_ids=prompt_ids(model, "Hello there, how are you?"), max_new_tokens=2, eos_ids=[2], **changes)


def _answers(model: str, spec=SPEC3) -> dict[str, tuple[PromptLogprob, ...]]:
    adapter = ImplAdapter()
    return {name: adapter.prompt_logprobs(config, spec) for name, config in variants(_config(model))}


def test_one_shot_prefill_is_bitwise_the_same_on_every_cache_family_and_chunking_within_tolerance():
    answers = _answers("tiny")
    one_shot = answers["one-shot"]
    config = _config("tiny")
    assert prompt_logprobs_aligned(config.prompt_ids, SPEC3, one_shot) and len(one_shot) == config.prompt_len
    # The same kernels over the same L rows: dynamic, static and the no-cache path agree to the bit.
    assert answers["static cache"] == one_shot and answers["no cache"] == one_shot
    chunked = answers["chunked prefill (3)"]
    assert chunked != one_shot  # other matmul shapes: float rounding moves (a real comparison, not an identity)
    bound = tolerance_for("impl", "tiny", "float32").scaled(2).logprob
    assert max(abs(a.logprob - b.logprob) for a, b in zip(one_shot[1:], chunked[1:])) <= bound
    assert [e.top and [t for t, _ in e.top] for e in chunked] == [e.top and [t for t, _ in e.top] for e in one_shot]


def test_row_i_scores_the_next_prompt_token_not_its_own_input():
    """A shifted answer (row i scored at x_i, the off-by-one of M3.10 0x02) fails at TENSOR; the right one passes."""
    config = _config("tiny")
    tol = tolerance_for("impl", "tiny", "float32")
    entries = _answers("tiny")["one-shot"]
    assert judge("tiny", config.prompt_ids, SPEC3, entries, tol).passed
    rows = reference_rows("tiny", config.prompt_ids)
    shifted = [entries[0]] + [attrs.evolve(e, logprob=float(rows[e.position + 1][1][e.token_id])) for e in entries[1:-1]] + [entries[-1]]
    verdict = judge("tiny", config.prompt_ids, SPEC3, shifted, tol)
    assert (verdict.result, verdict.layer, verdict.check) == ("failed", "TENSOR", "prompt_logprobs.value")
    # A wrong rank and a swapped top-k pair are DECISION failures.
    k = next(i for i, e in enumerate(entries) if e.rank and e.rank > 3)
    bad_rank = list(entries)
    bad_rank[k] = attrs.evolve(entries[k], rank=entries[k].rank + 50)
    verdict = judge("tiny", config.prompt_ids, SPEC3, bad_rank, tol)
    assert (verdict.layer, verdict.check) == ("DECISION", "prompt_logprobs.rank")
    bad_top = list(entries)
    top = entries[k].top
    bad_top[k] = attrs.evolve(entries[k], top=(top[0], (top[1][0], top[0][1]), top[2]))  # id 2 claims the rank-1 value
    verdict = judge("tiny", config.prompt_ids, SPEC3, bad_top, tol)
    assert verdict.result == "failed" and verdict.check in ("prompt_logprobs.top_k", "prompt_logprobs.aligned")


@pytest.mark.parametrize("first", ["none", "omitted"])
def test_tiny_agrees_with_the_float64_reference(first):
    spec = PromptLogprobsSpec(first_token=first, top_k=5)
    config = _config("tiny")
    tol = tolerance_for("impl", "tiny", "float32")
    for name, variant in variants(config):
        entries = ImplAdapter().prompt_logprobs(variant, spec)
        assert len(entries) == spec.num_entries(config.prompt_len)
        verdict = judge("tiny", config.prompt_ids, spec, entries, tol, what=name)
        assert verdict.passed, verdict.message


@requires_smollm2
def test_smollm2_agrees_with_the_float64_reference():
    config = _config("smollm2")
    tol = tolerance_for("impl", "smollm2", "float32")
    for name, variant in variants(config)[:2]:  # one-shot and chunked (the cache families share one-shot's kernels)
        entries = ImplAdapter().prompt_logprobs(variant, SPEC3)
        verdict = judge("smollm2", config.prompt_ids, SPEC3, entries, tol, what=name)
        assert verdict.passed, verdict.message
        # Real text: the chat template's fixed tokens are predictable, so some prompt token ranks first.
        assert any(e.rank == 1 for e in entries[1:])


def test_a_failed_prefill_chunk_publishes_no_rows_and_the_retry_scores_each_once():
    config = _config("tiny", prefill_chunk=4)
    request = attrs.evolve(_runtime_request(config), max_retries=1, prompt_logprobs=SPEC3)
    model = load_model("tiny")
    clean = RequestRunner(model, request)
    clean.admit()
    clean.run()
    faulty = RequestRunner(model, request, faults=FaultPlan.of(DeviceFault(call_id=1, layer=1)))
    faulty.admit()
    faulty.run()
    assert faulty.num_retries == 1 and faulty.output_ids == clean.output_ids
    assert faulty.prompt_logprobs() == clean.prompt_logprobs()
    assert len(clean.prompt_logprobs()) == config.prompt_len


def _runtime_request(config: CaseConfig) -> RuntimeRequest:
    from decodespec.checks.adapters.impl import runtime_request

    return runtime_request(config)


def test_not_requested_means_none_and_no_extra_rows():
    model = load_model("tiny")
    request = _runtime_request(_config("tiny"))
    runner = RequestRunner(model, request)
    runner.admit()
    runner.run()
    assert runner.prompt_logprobs() is None and runner.result().prompt_logprobs is None
    assert "prompt_logprobs" not in runner.result().to_json()
    with_plp = RequestRunner(model, attrs.evolve(request, prompt_logprobs=PromptLogprobsSpec()))
    with_plp.admit()
    with_plp.run()
    # The decision rows are computed as without the field: the same tokens and bitwise the same logprobs.
    assert with_plp.output_ids == runner.output_ids and with_plp.logprobs == runner.logprobs


def test_snapshot_of_a_request_with_prompt_logprobs_is_refused():
    model = load_model("tiny")
    runner = RequestRunner(model, attrs.evolve(_runtime_request(_config("tiny")), prompt_logprobs=SPEC3))
    runner.admit()
    runner.step()
    with pytest.raises(Rejection) as info:
        runner.snapshot()
    assert info.value.code == "snapshot.form_unavailable"


def test_generate_json_prints_prompt_logprobs(capsys):
    from decodespec.checks.commands.cli import main

    args = ["generate", "--model", "tiny", "--prompt", "Hi you", "--max-new-tokens", "1", "--device", "cpu", "--json"]
    assert main(args + ["--prompt-logprobs", "omitted", "--prompt-logprobs-top-k", "2", "--prefill-chunk", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    entries = result["prompt_logprobs"]
    assert [e["position"] for e in entries] == list(range(1, len(result["prompt_ids"])))
    assert [e["token_id"] for e in entries] == result["prompt_ids"][1:]
    assert all(e["logprob"] <= 0 and len(e["top"]) == 2 and e["top"][0]["rank"] == 1 for e in entries)
    assert main(args + ["--prompt-logprobs-top-k", "2"]) == 2
    assert "prompt_logprobs" in capsys.readouterr().err


# -- HF transformers through its logits -------------------------------------------------------


@requires_hf
@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=requires_smollm2)])
def test_hf_through_its_logits_agrees_with_the_reference_and_with_ours(model):
    from decodespec.checks.adapters import hf

    adapter = hf.create()
    config = _config(model)
    tol = tolerance_for("hf", model, "float32")
    ours = ImplAdapter().prompt_logprobs(config, SPEC3)
    for name, variant in [("one-shot", config), ("chunked prefill (3)", config.evolve(prefill_chunk=3))]:
        theirs = adapter.prompt_logprobs(variant, SPEC3)
        verdict = judge(model, config.prompt_ids, SPEC3, theirs, tol, what=f"HF {name}")
        assert verdict.passed, verdict.message
        assert theirs[0] == PromptLogprob(0, config.prompt_ids[0])  # HF's omitted first entry, mapped to the spec's 'none'
        bound = tol.scaled(2).logprob + tolerance_for("impl", model, "float32").logprob
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours[1:], theirs[1:])) <= bound


def test_admitted_envelope_prefill_only_and_the_native_kernel():
    """The envelope's field reaches the runner; G = 0 under prefill_only still scores every row; one-row prefill
    chunks on a static cache (the native decode kernel's shape) score the same rows within tolerance."""
    env = copy.deepcopy(TINY)
    env["output"]["prompt_logprobs"] = {"first_token": "omitted", "top_k": 1}
    env["termination"].update(max_new_tokens=0, min_new_tokens=0, zero_new_tokens="prefill_only")
    admitted, _ = E.validate_request_envelope(json.dumps(env).encode())
    request = RuntimeRequest.from_admitted(admitted)
    assert request.prompt_logprobs == PromptLogprobsSpec(first_token="omitted", top_k=1)
    runner = RequestRunner(load_model("tiny"), request)
    runner.admit()
    runner.run()
    entries = runner.result().prompt_logprobs
    assert runner.output_ids == [] and prompt_logprobs_aligned(request.prompt_ids, request.prompt_logprobs, entries)
    assert len(entries) == request.prompt_len - 1
    config = _config("tiny", cache="static", prefill_chunk=1)
    tol = tolerance_for("impl", "tiny", "float32")
    for kernel in ("torch", "native"):
        try:
            answer = ImplAdapter().prompt_logprobs(config.evolve(decode_kernel=kernel), SPEC3)
        except Rejection as exc:  # the native kernel is not built here
            assert kernel == "native", exc
            continue
        assert judge("tiny", config.prompt_ids, SPEC3, answer, tol, what=kernel).passed
