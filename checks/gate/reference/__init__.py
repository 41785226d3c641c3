"""The gate's reference arithmetic, independent of the runtime it judges.

:mod:`.llama64` is a plain float64 numpy Llama (no torch, no import from ``decodespec.impl``);
:mod:`.files` finds the GGUF file it reads (and writes the tiny model as one).

Source: M3.10 "A logit tolerance is not a token-equality proof"; DESIGN.md "The reference must
not share code with what it judges".
"""

from .llama64 import Llama64, LlamaShape, Reference64, dequantize64, load_gguf64

__all__ = ["Llama64", "LlamaShape", "Reference64", "dequantize64", "load_gguf64"]
