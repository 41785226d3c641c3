"""A tiny, seeded, randomly initialised Llama (same architecture as SmolLM2) for file-free tests.

``vocab_size = 512`` pairs with :class:`decodespec.impl.tokenizer.ByteTokenizer` (PAD 0, BOS 1,
EOS 2, bytes at 3..258); 4 layers, d_model 64, 4 query heads over 2 K/V heads (GQA), head
width 16, RoPE base 1e4, tied head: about 2.3e5 parameters, so a test runs hundreds of model
calls per second on one CPU core.

The initialisation is chosen so that the logits are *not* degenerate.  HF's default
``normal(0, 0.02)`` gives near-uniform rows with tiny top-2 margins, and unit-variance tied
embeddings make every token predict itself (the residual stream is dominated by the input
embedding, and the tied head scores it highest).  Here the embeddings are small,
``N(0, 0.05^2)``, so the attention and MLP branches (every projection ``N(0, 1/fan_in)``)
dominate the residual stream; the final ``norm`` weight is 10 so that the tied head turns the
unit-RMS hidden state into logits with a spread of a few nats (mean greedy logprob about
-0.7); and the embedding rows of printable-ASCII bytes and EOS are twice as long as the other
rows, so greedy text is mostly printable (useful for stop-string and stream tests).  Greedy
outputs depend on the prompt and top-2 ties do not occur in practice (tests/test_model_tiny.py
checks both).

Randomness is owned: weights come from a ``torch.Generator`` seeded with ``seed`` on the CPU in
float32, then cast and moved, so the same seed gives the same model on every device.

Source: M3.10 0x0B "Shape-correct failure lab" (small exhaustive configurations beside the
real model); STYLE.md (TLA+-style small bounded configurations).
"""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig
from .device import resolve_device
from .model import LlamaForCausalLM

__all__ = ["TINY_VOCAB_SIZE", "load_tiny", "tiny_config"]

TINY_VOCAB_SIZE = 512
#: Standard deviation of the embedding rows (before the per-row scale).
EMBED_STD = 0.05
#: Weight of the final norm (sets the logit spread of the tied head).
FINAL_NORM_WEIGHT = 10.0
# ByteTokenizer ids of the printable-ASCII bytes 0x20..0x7E (id = byte + 3).
_PRINTABLE_IDS = slice(3 + 0x20, 3 + 0x7F)


def tiny_config(attn_implementation: str = "sdpa", max_position_embeddings: int = 1024) -> LlamaConfig:
    """The tiny model's architecture (pairs with ``ByteTokenizer(512)``: BOS 1, EOS 2, PAD 0)."""
    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def load_tiny(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str = "sdpa",
    config: LlamaConfig | None = None,
) -> LlamaForCausalLM:
    """The tiny model with weights drawn from ``torch.Generator().manual_seed(seed)``.

    Args:
        seed: Weight seed (same seed, same weights, on any device).
        dtype: Parameter dtype.
        device: ``None``/``"auto"``, ``"cpu"``, ``"cuda[:N]"``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        config: Another architecture to initialise the same way (default :func:`tiny_config`).

    Raises:
        Rejection: ``runtime.invalid_device`` for an unknown or absent device.
    """
    target = resolve_device(device if not isinstance(device, torch.device) else str(device))
    config = config or tiny_config(attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config, device="cpu")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, d_model]
        embed.normal_(0.0, EMBED_STD, generator=gen)
        row_scale = torch.full((config.vocab_size, 1), 0.5)  # [V, 1]
        row_scale[_PRINTABLE_IDS] = 1.0
        if config.eos_token_id is not None:
            row_scale[config.eos_token_id] = 1.0
        embed.mul_(row_scale)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("proj.weight"):
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=gen)
            elif name == "lm_head.weight":  # only listed when untied (drawn last)
                param.normal_(0.0, EMBED_STD, generator=gen)
        model.model.norm.weight.fill_(FINAL_NORM_WEIGHT)
    return model.to(device=target, dtype=dtype).eval()
