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
from decodespec.spec.prompt_logprobs import (FirstTokenPolicy, PromptLogprob, PromptLogprobsSpec, prompt_logprobs_aligned,
                                             scored_positions)
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
    explicit, same = E.validate_request_envelope(_envelope(prompt_logprobs={"first_token": "none", "top_k": 0}))
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
