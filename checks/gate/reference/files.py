"""Model files the float64 reference reads: the SmolLM2 GGUF, and the tiny model written as GGUF.

The reference (:mod:`.llama64`) reads every model from a GGUF file, so it sees the tiny model
the way a foreign runtime would: :func:`write_tiny_gguf` writes the seeded tiny Llama
(``decodespec.impl.tiny.load_tiny``; its weights are data, not code the reference runs) in
float32 with llama.cpp's tensor names and its Q/K row permutation, and with the ``llama.*``
metadata keys.  ``decodespec export-tiny`` writes the same file for runtimes outside Python, and
with ``--out-dir`` a whole model folder (:func:`write_tiny_files`): the GGUF, the same weights in
safetensors with HF transformers' names, HF's ``config.json``, the byte tokenizer's id table and a
README.

Source: llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, tensor names, metadata
keys); gguf-py ``GGUFWriter``; HF transformers ``LlamaConfig`` and ``save_pretrained`` (the
folder layout); issue 22 item 1.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["TINY_FILES", "byte_tokenizer_table", "gguf_path", "hf_config_dict", "hf_tensors", "llama_gguf_tensors",
           "write_llama_gguf", "write_tiny_files", "write_tiny_gguf"]

#: The files of a tiny-model folder (:func:`write_tiny_files`), in the order they are written.
TINY_FILES = ("tiny.gguf", "model.safetensors", "config.json", "tokenizer_table.json", "README.txt")

_TMP: list[Path] = []


def _interleave_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved pairs, per head.  ``[H * D, d] -> [H * D, d]``."""
    per = weights.shape[0] // n_head
    return weights.reshape(n_head, 2, per // 2, weights.shape[1]).swapaxes(1, 2).reshape(weights.shape)


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The float32 tensors of a Llama under HF transformers' parameter names (HF's rotate-half Q/K row order).

    Shapes: every matrix ``[out, in]`` (``model.embed_tokens.weight [V, d_model]``); ``lm_head.weight``
    only when the head is not tied (HF's ``save_pretrained`` also leaves a tied head out).
    """
    state = {k: v.detach().to("cpu").float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def llama_gguf_tensors(model) -> dict[str, np.ndarray]:
    """The float32 GGUF tensors of a Llama with HF parameter names (ours or HF's), Q/K rows interleaved.

    Shapes: every matrix ``[out, in]``; ``output.weight`` only when the head is not tied.
    """
    cfg = model.config
    state = hf_tensors(model)
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


def hf_config_dict(config) -> dict:
    """``config`` (:class:`decodespec.impl.config.LlamaConfig`) as HF transformers' ``config.json`` of a Llama.

    Plain RoPE only (``rope_scaling`` null); ``rope_theta`` is top level, which HF 4.x reads and 5.x
    converts to ``rope_parameters``.  No ``transformers_version`` key, so the file does not depend on
    what is installed.
    """
    if config.rope_scaling is not None:
        raise ValueError("hf_config_dict writes plain RoPE only")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
        "torch_dtype": "float32", "use_cache": True,
    }


def byte_tokenizer_table(tokenizer) -> dict:
    """The id table of a :class:`decodespec.impl.tokenizer.ByteTokenizer`, as JSON-ready data.

    ``tokens[i]`` is id ``i``: ``{"id", "kind", "hex"}`` with ``kind`` one of ``special`` (also
    ``name``: ``<pad>``, ``<bos>``, ``<eos>``), ``byte`` (``hex``: its one byte, two lowercase hex
    digits) or ``unused`` (decodes to no bytes; ``hex`` empty).  A text's ids are its UTF-8 bytes
    looked up here; a prompt starts with ``bos_token_id`` (``add_bos_token``).
    """
    tokens = []
    for token_id in range(tokenizer.vocab_size):
        entry = {"id": token_id, "kind": "byte", "hex": tokenizer.token_bytes(token_id).hex()}
        if token_id in tokenizer.special_ids:
            entry.update(kind="special", name=tokenizer.id_to_token(token_id))
        elif not entry["hex"]:
            entry["kind"] = "unused"
        tokens.append(entry)
    return {"format": "decodespec.byte-tokenizer.v1", "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "add_bos_token": tokenizer.add_bos_token, "tokens": tokens}


_README = """decodespec tiny model, seed {seed}: a randomly initialised Llama (SmolLM2's architecture), float32.
Regenerate: decodespec export-tiny --out-dir DIR --seed {seed}  (byte-identical for the same seed).
Its weights are decodespec.impl.tiny.load_tiny(seed={seed}) (impl/tiny.py); the gate's tiny model is seed 0.

Architecture: vocab {vocab_size}, d_model {hidden_size}, {num_hidden_layers} layers,
  {num_attention_heads} query heads over {num_key_value_heads} K/V heads (GQA), head_dim {head_dim},
  SwiGLU MLP width {intermediate_size}, RMSNorm eps {rms_norm_eps}, RoPE base {rope_theta} (no scaling),
  tied head (logits = final hidden state @ embed_tokens^T), context {max_position_embeddings}.

Files:
  tiny.gguf             llama.cpp GGUF (general.architecture "llama", llama.* keys), float32, llama.cpp
                        tensor names (token_embd, blk.N.attn_q, ...); the attn_q / attn_k rows are
                        permuted per head to llama.cpp's interleaved RoPE pairs (convert_hf_to_gguf.py
                        LlamaModel.permute), no output.weight (tied).  No tokenizer.ggml.* table: use
                        tokenizer_table.json.
  model.safetensors     the same weights under HF transformers' names (model.embed_tokens.weight,
                        model.layers.N.self_attn.q_proj.weight, ...) in HF's rotate-half Q/K order;
                        no lm_head.weight (tied to model.embed_tokens.weight).
  config.json           HF LlamaConfig: transformers.LlamaForCausalLM.from_pretrained(DIR) loads the folder.
  tokenizer_table.json  the byte tokenizer: PAD {pad}, BOS {bos}, EOS {eos}; byte b is id b + 3;
                        ids 259..{last} are unused (no bytes). Every id with its bytes in hex.

sha256:
{digests}
"""


def write_tiny_files(folder: str | Path, seed: int = 0) -> dict[str, dict]:
    """Write the tiny model of ``seed`` into the existing, empty ``folder`` as the files :data:`TINY_FILES`.

    Not atomic by itself (``decodespec export-tiny --out-dir`` writes into a temporary folder and
    renames it).  Every file is a function of ``seed`` alone: the same seed gives the same bytes.

    Returns:
        File name -> ``{"bytes": int, "sha256": hex str}``, for every file written.
    """
    from safetensors.numpy import save

    from decodespec.impl.tiny import load_tiny
    from decodespec.impl.tokenizer import ByteTokenizer

    folder = Path(folder)
    model = load_tiny(seed=seed)
    cfg = model.config
    tokenizer = ByteTokenizer(cfg.vocab_size)
    write_llama_gguf(folder / "tiny.gguf", model, name=f"decodespec-tiny-seed{seed}", eos_token_id=cfg.eos_token_id)
    # save() + write_bytes, not save_file: safetensors' writer creates its file 0600, the others follow the umask.
    (folder / "model.safetensors").write_bytes(
        save({k: np.ascontiguousarray(v) for k, v in hf_tensors(model).items()}, metadata={"format": "pt"}))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    table = byte_tokenizer_table(tokenizer)
    rows = ",\n".join("  " + json.dumps(entry) for entry in table.pop("tokens"))
    head = json.dumps(table, indent=1)[:-2]
    (folder / "tokenizer_table.json").write_text(f'{head},\n "tokens": [\n{rows}\n ]\n}}\n')

    def digest(name: str) -> dict:
        data = (folder / name).read_bytes()
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    files = {name: digest(name) for name in TINY_FILES[:-1]}
    fields = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                                             "rope_theta", "max_position_embeddings")}
    (folder / "README.txt").write_text(_README.format(
        seed=seed, pad=cfg.pad_token_id, bos=cfg.bos_token_id, eos=cfg.eos_token_id, last=cfg.vocab_size - 1,
        digests="\n".join(f"  {v['sha256']}  {k}" for k, v in files.items()), **fields))
    files["README.txt"] = digest("README.txt")
    return files


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
