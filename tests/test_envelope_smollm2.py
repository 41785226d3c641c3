"""docs/examples/smollm2.request.json binds the real SmolLM2 artifact, tokenizer, template and prompt ids.

M3.10 "Immutable request envelope and canonical identity": the checkpoint hash, tokenizer and
template hashes and the chat-templated prompt ids of the shipped example are the real ones.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from decodespec.checks.testing import requires_smollm2
from decodespec.spec.envelope import validate_request_envelope
from decodespec.spec.state import params_from_request

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "smollm2.request.json"

pytestmark = [requires_smollm2, pytest.mark.smollm2]


def test_smollm2_example_binds_the_real_files() -> None:
    from decodespec.impl.gguf import file_sha256, smollm2_path
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    request, identity = validate_request_envelope(EXAMPLE.read_bytes())
    tok = load_smollm2_tokenizer()
    assert request.artifact.checkpoint_sha256 == file_sha256(smollm2_path())
    assert request.text_interface.tokenizer_sha256 == tok.sha256
    assert request.text_interface.template_sha256 == "sha256:" + hashlib.sha256(tok.chat_template.encode()).hexdigest()
    assert (request.text_interface.vocab_size, request.text_interface.bos_id, request.text_interface.pad_id) == (
        tok.vocab_size, tok.bos_token_id, tok.pad_token_id)
    assert request.text_interface.eos_ids == (tok.eos_token_id,) == (2,)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert request.prompt.text == text
    assert request.valid_input_ids == tuple(tok.encode(text))
    params = params_from_request(request)
    assert params.prompt_len == len(tok.encode(text)) and params.max_new_tokens == 32 and params.max_draws == 0
    assert json.loads(EXAMPLE.read_text())["schema"] == "numinens.request.v1" and identity == request.identity
