"""Model files the float64 reference reads: the SmolLM2 GGUF, and the tiny model written as GGUF.

The reference (:mod:`.llama64`) reads every model from a GGUF file, so it sees the tiny model
the way a foreign runtime would: :func:`write_tiny_gguf` writes the seeded tiny Llama
(``decodespec.impl.tiny.load_tiny``; its weights are data, not code the reference runs) in
float32 with llama.cpp's tensor names and its Q/K row permutation, and with the ``llama.*``
metadata keys.  ``decodespec export-tiny`` writes the same file for runtimes outside Python.

Source: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, tensor names, metadata
keys); gguf-py ``GGUFWriter``.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["gguf_path", "write_tiny_gguf"]

_TMP: list[Path] = []


def _interleave_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved pairs, per head.  ``[H * D, d] -> [H * D, d]``."""
    per = weights.shape[0] // n_head
    return weights.reshape(n_head, 2, per // 2, weights.shape[1]).swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model of ``seed`` to ``path`` as a float32 llama GGUF file.

    Returns:
        ``path``.
    """
    import gguf

    from decodespec.impl.tiny import load_tiny

    model = load_tiny(seed=seed)
    cfg = model.config
    state = {k: v.detach().to("cpu").numpy().astype(np.float32) for k, v in model.state_dict().items()}
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"decodespec-tiny-seed{seed}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        for short, hf in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                w = _interleave_rows(w, cfg.num_attention_heads)
            elif short == "attn_k":
                w = _interleave_rows(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{short}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cleanup() -> None:
    for tmp in _TMP:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_path(model: str) -> Path:
    """The GGUF file of ``model`` (``smollm2``: the installed wheel's; ``tiny``: written once per process).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
        ValueError: for another model name.
    """
    if model == "smollm2":
        from decodespec.impl.gguf import smollm2_path

        return smollm2_path()
    if model == "tiny":
        if not _TMP:
            _TMP.append(Path(tempfile.mkdtemp(prefix="decodespec-ref-")))
            atexit.register(_cleanup)
        path = _TMP[0] / "tiny-seed0.gguf"
        if not path.is_file():
            write_tiny_gguf(path.with_suffix(".part"), seed=0).replace(path)
        return path
    raise ValueError(f"no reference model file for {model!r}")
