"""Parity with HF transformers' ``LlamaForCausalLM`` on SmolLM2, loaded from the same GGUF file.

Float32 on the CPU, for five prompts (English, code, CJK, emoji, a chat-templated prompt) and
both attention implementations (ours and HF's switched together):

* logits: max |Δ logit| <= 1e-4 at every position (in practice they agree bitwise: both mirror
  the same operation order);
* greedy generation: identical ids for up to 64 new tokens (ours: ``greedy_generate``; HF:
  ``generate(do_sample=False)``; both stop at EOS id 2), and our logprobs equal HF's
  ``output_logits`` through log-softmax within 1e-4.

Source: M3.10 "A logit tolerance is not a token-equality proof" (the TENSOR layer is checked
before the DECISION layer); M3.10 0x0A "Pinned official runtime reconciliation".
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import attention  # tests/ is on sys.path via tests/conftest.py

from decodespec.checks.testing import requires_hf, requires_smollm2
from decodespec.impl.generate import greedy_generate

pytestmark = [requires_smollm2, requires_hf, pytest.mark.smollm2, pytest.mark.hf, pytest.mark.slow]

PROMPTS = {
    "english": "The history of the printing press begins in",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "cjk": "我喜欢学习中文，因为",
    "emoji": "My favourite things: 🍕🎉 and 🐍, because",
    "chat": None,  # the chat template around a question, built from the tokenizer
}
LOGIT_TOL = 1e-4
NEW_TOKENS = 64


def _prompt_ids(tokenizer, name: str) -> list[int]:
    if name == "chat":
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colours."}]))
    return tokenizer.encode(PROMPTS[name])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_match_hf_at_every_position(smollm2_model, hf_smollm2, smollm2_tokenizer, name, attn):
    ids = torch.tensor([_prompt_ids(smollm2_tokenizer, name)])
    with attention(smollm2_model, attn), attention(hf_smollm2, attn), torch.inference_mode():
        ours = smollm2_model(ids).logits
        theirs = hf_smollm2(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert float((ours - theirs).abs().max()) <= LOGIT_TOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_generation_matches_hf_generate(smollm2_model, hf_smollm2, smollm2_tokenizer, name, attn):
    prompt = _prompt_ids(smollm2_tokenizer, name)
    input_ids = torch.tensor([prompt])
    with attention(smollm2_model, attn), attention(hf_smollm2, attn), torch.inference_mode():
        ours = greedy_generate(smollm2_model, prompt, max_new_tokens=NEW_TOKENS, tokenizer=smollm2_tokenizer)
        theirs = hf_smollm2.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_ids = theirs.sequences[0, len(prompt) :].tolist()
    assert list(ours.output_ids) == hf_ids
    hf_logprobs = [float(torch.log_softmax(row[0].float(), -1)[tok]) for row, tok in zip(theirs.logits, hf_ids)]
    assert max(abs(a - b) for a, b in zip(ours.logprobs, hf_logprobs)) <= LOGIT_TOL
    expected_text = smollm2_tokenizer.decode(hf_ids[:-1] if hf_ids[-1] == 2 else hf_ids)
    assert ours.text == expected_text
