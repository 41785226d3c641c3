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

__all__ = ["gguf_path", "llama_gguf_tensors", "write_llama_gguf", "write_tiny_gguf"]

_TMP: list[Path] = []


def _interleave_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved pairs, per head.  ``[H * D, d] -> [H * D, d]``."""
    per = weights.shape[0] // n_head
    return weights.reshape(n_head, 2, per // 2, weights.shape[1]).swapaxes(1, 2).reshape(weights.shape)


def llama_gguf_tensors(model) -> dict[str, np.ndarray]:
    """The float32 GGUF tensors of a Llama with HF parameter names (ours or HF's), Q/K rows interleaved.

    Shapes: every matrix ``[out, in]``; ``output.weight`` only when the head is not tied.
    """
    cfg = model.config
    state = {k: v.detach().to("cpu").float().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
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
            tensors[f"blk.{i}.{short}.weight"] = w
    return tensors


def write_llama_gguf(path: str | Path, model, tensors: dict[str, np.ndarray] | None = None, *, arch: str = "llama",
                     name: str | None = None, eos_token_id: int | None = None,
                     rope_scaling: tuple[str, float] | None = None) -> Path:
    """Write ``model``'s architecture metadata and ``tensors`` (default :func:`llama_gguf_tensors`) as a GGUF file.

    Args:
        path: The file to write.
        model: A Llama with an HF-style ``config``.
        tensors: GGUF name -> array (written as float32).
        arch: ``general.architecture``.
        name: ``general.name``.
        eos_token_id: ``tokenizer.ggml.eos_token_id``, when given.
        rope_scaling: ``(type, factor)``, when given.

    Returns:
        ``path``.
    """
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    if eos_token_id is not None:
        writer.add_eos_token_id(eos_token_id)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    for tensor_name, array in (llama_gguf_tensors(model) if tensors is None else tensors).items():
        writer.add_tensor(tensor_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_tiny_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the tiny model of ``seed`` to ``path`` as a float32 llama GGUF file.

    Returns:
        ``path``.
    """
    from decodespec.impl.tiny import load_tiny

    return write_llama_gguf(path, load_tiny(seed=seed), name=f"decodespec-tiny-seed{seed}", eos_token_id=2)


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
