"""The gate's prompts: token ids of a text, the machines' prompt pool, the reference's greedy continuation.

On the tiny model a text is BOS + its UTF-8 bytes (byte ``b`` is id ``b + 3``, export-tiny's
README); on SmolLM2 it is a bare chat turn encoded by the runtime's tokenizer
(:func:`decodespec.checks.adapters.impl.load_tokenizer`, imported only then: it brings torch).  :func:`greedy_continuation` is the
float64 reference's greedy path (:func:`decodespec.checks.gate.lockstep.reference_for`), which the
case table and the drawings use to aim stop strings, constraints and EOS ids at real output.

Source: M3.10 "Correctness matrix", "Boundary cases" (the prompts the cases need).
"""

from __future__ import annotations

import functools

import numpy as np

from .lockstep import reference_for

__all__ = ["PROMPT_TEXTS", "greedy_continuation", "prompt_ids", "prompts_for"]

#: Prompt texts (tiny: BOS + UTF-8 bytes; SmolLM2: a bare chat turn).  The first is one token on tiny.
PROMPT_TEXTS = ("", "Hi", "The cat sat", "héllo ✓")


@functools.lru_cache(maxsize=32)
def prompt_ids(model: str, text: str, *, chat: bool = True) -> tuple[int, ...]:
    """Token ids of ``text``: BOS + UTF-8 bytes on tiny; a bare chat turn (or plain text) on SmolLM2."""
    if model == "tiny":
        return (1,) + tuple(b + 3 for b in text.encode("utf-8"))
    from ..adapters.impl import load_tokenizer  # torch: imported when a real tokenizer is needed

    tok = load_tokenizer(model)
    return tuple(tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" if chat else text))


@functools.lru_cache(maxsize=4)
def prompts_for(model: str) -> tuple[tuple[int, ...], ...]:
    """The machines' prompt pool of ``model`` (shortest first is a one-token prompt on tiny)."""
    if model == "tiny":
        return tuple((1,) + tuple(b + 3 for b in text.encode("utf-8")) for text in PROMPT_TEXTS)
    from ..adapters.impl import load_tokenizer  # torch: imported when a real tokenizer is needed

    tok = load_tokenizer(model)
    return tuple(tuple(tok.encode(f"<|im_start|>user\n{text or 'Yes?'}<|im_end|>\n<|im_start|>assistant\n")) for text in PROMPT_TEXTS)


@functools.lru_cache(maxsize=256)
def greedy_continuation(model: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The reference's greedy continuation of ``prompt`` (``n`` ids; lowest id on ties): the ids a greedy output will contain."""
    ref = reference_for(model)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(ref.row(prompt + tuple(out)))))
    return tuple(out)
