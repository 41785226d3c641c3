"""decodespec.impl: the reference runtime in plain PyTorch (CPU and CUDA).

A Llama-architecture decoder that runs SmolLM2-135M-Instruct from its GGUF file, its caches,
prefill and decode, the decoding policy's torch twin, stop and stream handling, beams and
snapshots.  It records what it did as events; it never asks the spec what to do (the mapping
between the two lives in :mod:`decodespec.checks`).
"""
