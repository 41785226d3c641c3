"""Failure lab, encoder-decoder group: the fixed lanes (memory, cross K/V) and the source mask.

Source: M3.10 0x0B "Encoder-decoder memory bugs" (mutating memory inside the decoder loop,
dropping src_mask in inference) and "Runtime-mode bugs" (running inference with model.train()),
0x01 "Encoder-decoder cached state has two lifetimes".
"""

from __future__ import annotations

from typing import Any, Callable

from . import Patch, mutant

_G = "encoder-decoder"
_STEP = "decodespec.impl.encdec:DecoderLayer.step"


@mutant(
    "encdec_memory_mutated", group=_G, representative=True,
    title="Encoder memory mutated inside the decoder loop",
    section="M3.10 0x0B Encoder-decoder memory bugs (mutating memory inside the decoder loop)",
    statement="impl/encdec.py DecoderLayer.step re-projects the cross K/V from the memory each step and then adds "
    "the step's mean decoder state into the memory in place: the memory keeps its [B, S, d_model] shape, but "
    "cross-attention no longer reads stable source states and the fixed lanes' fingerprint changes. TENSOR fails "
    "(cached scores against the uncached reference) and STATE (fixed lanes changed).",
)
def _encdec_memory_mutated():
    return [Patch(_STEP, edits=[(
        "cross_keys, cross_values = cache.cross_kv[layer_idx]",
        "cross_keys, cross_values = self.src_attn.project_kv(cache.memory, cache.memory); "
        "cache.memory.add_(x.mean(dim=1, keepdim=True))")])]


@mutant(
    "encdec_src_mask_dropped", group=_G,
    title="Source mask dropped in cross-attention",
    section="M3.10 0x0B Encoder-decoder memory bugs (dropping src_mask in inference)",
    statement="impl/encdec.py DecoderLayer.step cross-attends without the source mask: memory is still "
    "[B, S, d_model], but the PAD source positions of a padded batch become visible. TENSOR fails (the padded row's "
    "scores against the reference decode under the mask).",
)
def _encdec_src_mask_dropped():
    return [Patch(_STEP, edits=[(
        "self.src_attn.attend(y, cross_keys, cross_values, cache.src_mask)", "self.src_attn.attend(y, cross_keys, cross_values, None)")])]


def _in_train_mode(original: Callable[..., Any]) -> Callable[..., Any]:
    def decode_step(self: Any, tgt: Any, cache: Any) -> Any:
        self.train()  # dropout active during the step
        try:
            return original(self, tgt, cache)
        finally:
            self.eval()

    return decode_step


@mutant(
    "encdec_train_mode", group=_G,
    title="Target decoding runs in training mode",
    section="M3.10 0x0B Runtime-mode bugs (running inference with model.train())",
    statement="impl/encdec.py EncoderDecoder.decode_step runs with the model in training mode (after the entry "
    "check, restored afterwards): dropout stays active, so the same tensors carry randomly dropped activations. "
    "TENSOR fails (cached scores against the evaluation-mode reference).",
)
def _encdec_train_mode():
    return [Patch("decodespec.impl.encdec:EncoderDecoder.decode_step", wrap=_in_train_mode)]
