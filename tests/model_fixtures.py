"""Session-scoped model fixtures shared by every test file (a pytest plugin, see tests/conftest.py).

Each model is loaded once per test session and shared; a test that switches the attention
implementation uses :func:`attention` so the shared model is restored afterwards.  Every
fixture runs on the CPU in float32 (the parity contract is stated there).

* ``tiny_model``: :func:`decodespec.impl.tiny.load_tiny` with seed 0; ``byte_tokenizer``.
* ``smollm2_model``: our decoder on SmolLM2 (skips with the install hint when the file is absent).
* ``smollm2_tokenizer``: the SmolLM2 tokenizer from the same file.
* ``hf_smollm2``: HF transformers' ``LlamaForCausalLM`` loaded from the same GGUF file (skips
  when transformers is absent).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from decodespec.checks.testing import HF_SKIP_REASON, SMOLLM2_SKIP_REASON, hf_available
from decodespec.impl.gguf import smollm2_available


@contextlib.contextmanager
def attention(model, attn_implementation: str) -> Iterator[None]:
    """Run a block with ``model`` switched to ``attn_implementation`` (ours or HF), then restore."""
    ours = hasattr(model, "cache_abi")
    before = model.config.attn_implementation if ours else model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@pytest.fixture(scope="session")
def tiny_model():
    from decodespec.impl.tiny import load_tiny

    return load_tiny(seed=0, device="cpu")


@pytest.fixture(scope="session")
def byte_tokenizer():
    from decodespec.impl.tiny import TINY_VOCAB_SIZE
    from decodespec.impl.tokenizer import ByteTokenizer

    return ByteTokenizer(TINY_VOCAB_SIZE)


@pytest.fixture(scope="session")
def smollm2_model():
    if not smollm2_available():
        pytest.skip(SMOLLM2_SKIP_REASON)
    from decodespec.impl.weights import load_smollm2

    return load_smollm2(dtype=torch.float32, device="cpu", attn_implementation="sdpa")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if not smollm2_available():
        pytest.skip(SMOLLM2_SKIP_REASON)
    from decodespec.impl.tokenizer import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def hf_smollm2():
    if not smollm2_available():
        pytest.skip(SMOLLM2_SKIP_REASON)
    if not hf_available():
        pytest.skip(HF_SKIP_REASON)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from decodespec.impl.gguf import smollm2_path

    hf_logging.disable_progress_bar()
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa")
    return model.to("cpu").eval()
