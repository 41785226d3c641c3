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

Randomness is owned and the same bits on every CPU and device (issue 15 item 3).  Each drawn matrix
is :func:`normal_draws`: torch's own ``normal_`` recipe (Box-Muller over the uniforms of a
``torch.Generator`` seeded with ``seed``, paired in blocks of 16 as
``aten/src/ATen/native/cpu/DistributionTemplates.h`` ``normal_fill`` pairs them), but evaluated in
float64 and correctly rounded to float32 once.  torch's ``normal_`` itself is not used: it does the
arithmetic in float32 with a kernel chosen at run time, so ``ATEN_CPU_CAPABILITY=default`` drew
other float32 values than ``avx2`` / ``avx512`` (checkpoint sha256 ``87f8...`` against ``2d0b...``),
and the tiny model, every output it gives and every trace recorded on it depended on the machine.
The uniforms come from torch's serial integer kernel, the same on every CPU; the weights are within
6e-8 of what ``normal_`` gave on either kernel set.  The model is then cast and moved.

Source: M3.10 0x0B "Shape-correct failure lab" (small exhaustive configurations beside the
real model); STYLE.md (TLA+-style small bounded configurations).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import torch

from .config import LlamaConfig
from .device import resolve_device
from .model import LlamaForCausalLM

__all__ = ["TINY_VOCAB_SIZE", "load_tiny", "normal_draws", "tiny_config"]

TINY_VOCAB_SIZE = 512
#: Standard deviation of the embedding rows (before the per-row scale).
EMBED_STD = 0.05
#: Weight of the final norm (sets the logit spread of the tied head).
FINAL_NORM_WEIGHT = 10.0
# ByteTokenizer ids of the printable-ASCII bytes 0x20..0x7E (id = byte + 3).
_PRINTABLE_IDS = slice(3 + 0x20, 3 + 0x7F)


#: A float64 evaluation this close (relative) to a float32 rounding midpoint is redone in mpmath; the
#: float64 chain (log1p, sqrt, cos or sin, three products) is accurate to well under 1e-14.
_MIDPOINT_GUARD = 1e-12


def normal_draws(gen: torch.Generator, n: int, std: float) -> np.ndarray:
    """``n`` normal draws ``N(0, std^2)`` from ``gen``, as float32, the same bits on every CPU.

    The recipe of torch's CPU ``normal_`` for a contiguous tensor of at least 16 values
    (``normal_fill`` in ``aten/src/ATen/native/cpu/DistributionTemplates.h``, torch 2.13): draw ``n``
    float32 uniforms ``u``; in each block of 16, value ``j < 8`` is ``std * sqrt(-2 ln(1 - u[j])) *
    cos(2 pi u[j + 8])`` and value ``j + 8`` the same with ``sin``; when 16 does not divide ``n``, 16
    fresh uniforms redo the last 16 values.  Here the exact value of that formula (``std`` taken as
    the float64 given) is rounded to float32 once: in float64, or in mpmath at 113 bits where the
    float64 value lies within ``_MIDPOINT_GUARD`` of a rounding midpoint, so no libm or CPU kernel
    difference can change a bit.

    Args:
        gen: Consumed exactly as ``normal_`` would consume it (``n`` uniforms, plus 16 when ``n % 16``).
        n: Number of values, at least 16.
        std: Standard deviation.

    Returns:
        float32 array of shape ``[n]``.

    Raises:
        ValueError: ``n < 16`` (torch draws those one at a time, another recipe not mirrored here).
    """
    if n < 16:
        raise ValueError(f"normal_draws needs at least 16 values, got {n}")
    draws = [torch.empty(n, dtype=torch.float32).uniform_(0.0, 1.0, generator=gen)]
    position = np.arange(n)
    block, offset = position // 16 * 16, position % 16  # where position p's block starts in `uniforms`
    if n % 16:  # 16 fresh uniforms (stored after the n) redo the last 16 values
        draws.append(torch.empty(16, dtype=torch.float32).uniform_(0.0, 1.0, generator=gen))
        block[n - 16 :], offset[n - 16 :] = n, np.arange(16)
    uniforms = torch.cat(draws).numpy().astype(np.float64)  # exact: float32 -> float64
    use_cos = offset < 8
    u1, u2 = uniforms[block + offset % 8], uniforms[block + 8 + offset % 8]
    theta = 2.0 * math.pi * u2
    values = std * np.sqrt(-2.0 * np.log1p(-u1)) * np.where(use_cos, np.cos(theta), np.sin(theta))  # float64 [n]
    rounded = values.astype(np.float32)
    toward = np.nextafter(rounded, np.where(values > rounded, np.float32(np.inf), np.float32(-np.inf)))
    midpoint = (rounded.astype(np.float64) + toward.astype(np.float64)) / 2.0  # exact in float64
    for i in np.flatnonzero(np.abs(values - midpoint) <= _MIDPOINT_GUARD * np.abs(values)):
        with mpmath.workprec(113):
            exact = mpmath.mpf(std) * mpmath.sqrt(-2 * mpmath.log(1 - mpmath.mpf(u1[i])))
            exact *= (mpmath.cos if use_cos[i] else mpmath.sin)(2 * mpmath.pi * mpmath.mpf(u2[i]))
            lower, upper = sorted((float(rounded[i]), float(toward[i])))
            rounded[i] = np.float32(lower if exact < (mpmath.mpf(lower) + mpmath.mpf(upper)) / 2 else upper)
    return rounded


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
    """The tiny model with weights drawn by :func:`normal_draws` from ``torch.Generator().manual_seed(seed)``.

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

    def draw(param: torch.Tensor, std: float) -> None:
        param.copy_(torch.from_numpy(normal_draws(gen, param.numel(), std)).view(param.shape))

    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [V, d_model]
        draw(embed, EMBED_STD)
        row_scale = torch.full((config.vocab_size, 1), 0.5)  # [V, 1]
        row_scale[_PRINTABLE_IDS] = 1.0
        if config.eos_token_id is not None:
            row_scale[config.eos_token_id] = 1.0
        embed.mul_(row_scale)  # exact: powers of two
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("proj.weight"):
                draw(param, 1.0 / math.sqrt(param.shape[1]))
            elif name == "lm_head.weight":  # only listed when untied (drawn last)
                draw(param, EMBED_STD)
        model.model.norm.weight.fill_(FINAL_NORM_WEIGHT)
    return model.to(device=target, dtype=dtype).eval()
