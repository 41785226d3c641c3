"""The first greedy loop (impl/generate.py) on the tiny model.

Checks the cached loop against the no-cache reference loop (M3.10 0x09), the logprob contract
(natural log-softmax of the raw float32 selecting row, M3.8), the declared tie rule (lowest
id), finish triggers and precedence (M3.10 0x06), the frontier at finish (M3.10 0x08: the last
token is CLOSED_UNPROCESSED, P = L + O - 1), G = 0 ("no_call") and typed request errors.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from model_fixtures import attention  # tests/ is on sys.path via tests/conftest.py

from decodespec.impl.generate import GenerationResult, greedy_generate, select_greedy
from decodespec.impl.tiny import load_tiny, tiny_config
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection, ResourceLimit

PROMPTS = ["hello", "The quick brown fox", "12345", "def f(x):"]


def _ids(tokenizer, text):
    return [tokenizer.bos_token_id, *tokenizer.encode(text)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_loop_equals_the_no_cache_reference_loop(tiny_model, byte_tokenizer, attn):
    """M3.10 0x09: the cached greedy loop selects what full recomputation selects, step by step."""
    with attention(tiny_model, attn):
        for text in PROMPTS:
            prompt = _ids(byte_tokenizer, text)
            cached = greedy_generate(tiny_model, prompt, max_new_tokens=24, eos_token_ids=())
            reference = greedy_generate(tiny_model, prompt, max_new_tokens=24, eos_token_ids=(), use_cache=False)
            assert cached.output_ids == reference.output_ids
            np.testing.assert_allclose(cached.logprobs, reference.logprobs, rtol=0, atol=5e-5)


def test_logprobs_are_log_softmax_of_the_raw_selecting_row(tiny_model, byte_tokenizer):
    prompt = _ids(byte_tokenizer, "logprobs")
    result = greedy_generate(tiny_model, prompt, max_new_tokens=8, eos_token_ids=())
    ids = torch.tensor([prompt + list(result.output_ids)])
    with torch.inference_mode():
        rows = tiny_model(ids).logits[0, len(prompt) - 1 : -1].float()  # [8, V], row k selects output k
    expected_tokens = rows.argmax(-1).tolist()
    expected = torch.log_softmax(rows, -1)[torch.arange(8), torch.tensor(expected_tokens)].tolist()
    assert list(result.output_ids) == expected_tokens
    np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=5e-5)
    assert all(lp <= 0 for lp in result.logprobs)


def test_select_greedy_breaks_ties_by_lowest_id():
    row = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0])
    token, logprob = select_greedy(row)
    assert token == 1
    assert logprob == pytest.approx(3.0 - math.log(math.exp(1) + 3 * math.exp(3) + 1), abs=1e-6)
    token, _ = select_greedy(row.to(torch.bfloat16))  # upcast first, same decision
    assert token == 1


def test_eos_is_in_output_ids_not_in_text(tiny_model, byte_tokenizer):
    prompt = _ids(byte_tokenizer, "The quick brown fox")
    free = greedy_generate(tiny_model, prompt, max_new_tokens=16, eos_token_ids=())
    eos_id = free.output_ids[5]  # declare the 6th generated token's id as EOS
    first = free.output_ids.index(eos_id)
    result = greedy_generate(tiny_model, prompt, max_new_tokens=16, eos_token_ids=(eos_id,), tokenizer=byte_tokenizer)
    assert result.output_ids == free.output_ids[: first + 1]
    assert result.logprobs == free.logprobs[: first + 1]
    assert result.finish_reason is FinishReason.EOS and result.triggers == (FinishReason.EOS,)
    assert result.text == byte_tokenizer.decode(free.output_ids[:first])
    assert result.frontier == {
        "prompt_len": len(prompt),
        "output_count": first + 1,
        "pending": 1,
        "processed": len(prompt) + first,
        "pending_tag": "CLOSED_UNPROCESSED",
    }


def test_eos_and_length_at_once_publish_eos_and_record_both(tiny_model, byte_tokenizer):
    """M3.10 0x06: every trigger is recorded, the canonical reason follows the precedence."""
    prompt = _ids(byte_tokenizer, "hello")
    free = greedy_generate(tiny_model, prompt, max_new_tokens=16, eos_token_ids=())
    step = next(k for k in range(1, 16) if free.output_ids[k] not in free.output_ids[:k])  # a token seen first at step k
    result = greedy_generate(tiny_model, prompt, max_new_tokens=step + 1, eos_token_ids=(free.output_ids[step],))
    assert result.output_ids == free.output_ids[: step + 1]
    assert result.triggers == (FinishReason.EOS, FinishReason.LENGTH)
    assert result.finish_reason is FinishReason.EOS


def test_length_finish_and_frontier(tiny_model, byte_tokenizer):
    prompt = _ids(byte_tokenizer, "12345")
    result = greedy_generate(tiny_model, prompt, max_new_tokens=7, eos_token_ids=())
    assert len(result.output_ids) == 7 and result.finish_reason is FinishReason.LENGTH
    frontier = result.frontier
    assert frontier["processed"] + frontier["pending"] == frontier["prompt_len"] + frontier["output_count"]  # P + |U| = L + O
    assert frontier["processed"] == len(prompt) + 6


def test_context_window_finishes_with_context_length():
    small = load_tiny(seed=0, device="cpu", config=tiny_config(max_position_embeddings=12))
    result = greedy_generate(small, [1, 70, 71, 72, 73, 74, 75, 76], max_new_tokens=50, eos_token_ids=())
    assert len(result.output_ids) == 4  # L + O == C
    assert result.finish_reason is FinishReason.CONTEXT_LENGTH
    with pytest.raises(ResourceLimit) as info:
        greedy_generate(small, [1] * 12, max_new_tokens=1)
    assert info.value.code == "model.context_window_exceeded"


def test_zero_new_tokens_makes_no_model_call(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr(tiny_model, "forward", lambda *a, **k: calls.append(1))
    result = greedy_generate(tiny_model, [1, 70], max_new_tokens=0)
    assert calls == []
    assert result.output_ids == () and result.finish_reason is FinishReason.LENGTH
    assert result.frontier == {"prompt_len": 2, "output_count": 0, "pending": 0, "processed": 0, "pending_tag": "EMPTY"}


@pytest.mark.parametrize(
    "prompt, max_new_tokens, path",
    [
        ([], 4, "$.prompt_ids"),
        ([1, 512], 4, "$.prompt_ids[1]"),
        ([1, -1], 4, "$.prompt_ids[1]"),
        ([1, "a"], 4, "$.prompt_ids[1]"),
        ([1, 2], -1, "$.max_new_tokens"),
        ([1, 2], True, "$.max_new_tokens"),
        ([1, 2], 2.0, "$.max_new_tokens"),
    ],
)
def test_malformed_requests_are_rejected(tiny_model, prompt, max_new_tokens, path):
    with pytest.raises(Rejection) as info:
        greedy_generate(tiny_model, prompt, max_new_tokens=max_new_tokens)
    assert info.value.code == "runtime.invalid_request"
    assert info.value.path == path


def test_numpy_prompt_ids_and_default_eos(tiny_model):
    result = greedy_generate(tiny_model, np.array([1, 70, 71]), max_new_tokens=3)
    assert result.prompt_ids == (1, 70, 71) and all(type(t) is int for t in result.prompt_ids)


def test_result_json_round_trips(tiny_model, byte_tokenizer):
    result = greedy_generate(tiny_model, _ids(byte_tokenizer, "json"), max_new_tokens=5, tokenizer=byte_tokenizer)
    payload = json.loads(json.dumps(result.to_json()))
    assert {"prompt_ids", "output_ids", "text", "logprobs", "finish_reason", "triggers", "frontier"} <= set(payload)
    assert payload["finish_reason"] == result.finish_reason.value
    assert payload["output_ids"] == list(result.output_ids)
    assert isinstance(result, GenerationResult)
