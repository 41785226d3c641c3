"""The gate's independent reference arithmetic: a plain float64 Llama forward in numpy.

M3.10 "A logit tolerance is not a token-equality proof" needs a reference row for every
committed prefix; DESIGN.md: "the no-cache recompute is the reference *schedule*; the
reference *arithmetic* is a separate, slow float64 model".  This module is that model, written
in the spirit of llama2.c / nanoGPT: one function per block, shape comments, no torch, and no
import from ``decodespec.impl`` (tests/test_reference64.py checks both), so a bug in the
runtime's model math cannot hide in the reference.

Independence is deliberate where two readings of the architecture exist:

* weights are read from the GGUF file with ``gguf.GGUFReader`` and dequantized here, exactly in
  float64 (Q4_1: ``d * q + m``; Q8_0: ``d * q``; F32/F16/BF16 widened), not with
  ``gguf.quants.dequantize`` (float32) as the runtime's loader does;
* Q and K stay in the GGUF row order, and RoPE rotates *adjacent pairs* ``(2i, 2i+1)`` as
  llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` does, where the runtime un-permutes the rows and
  applies HF's rotate-half; :meth:`KVRows.hf_layout` maps K to the HF head-dim order only
  for the comparison (``K_hf[h * D/2 + i] = K_gguf[2 i + h]``);
* the K/V cache is this module's own: one row per committed position, so extending a prefix
  by one token costs one row of work (a trie of prefixes in :class:`Reference64`).

Dimension letters (docs/glossary.md): T new positions, S cached positions, V vocabulary,
d model width, F MLP width, H query heads, H_kv K/V heads, D head width, layers N.

Source: M3.10 0x02 (the model as a function of the committed prefix), "A logit tolerance is
not a token-equality proof"; llama.cpp ``src/llama-graph.cpp`` / ``ggml rope`` (normal mode),
``convert_hf_to_gguf.py`` ``LlamaModel.permute``; HF ``modeling_llama.py`` (RMSNorm, SwiGLU,
GQA ``repeat_kv``); gguf-py ``gguf/quants.py`` (block layouts of Q4_1 and Q8_0).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

__all__ = [
    "Llama64",
    "LlamaShape",
    "Reference64",
    "dequantize64",
    "load_gguf64",
]

_QK = 32  # weights per Q4_1 / Q8_0 block


@attrs.frozen
class LlamaShape:
    """Hyperparameters read from GGUF metadata (``llama.*`` keys).

    Attributes:
        vocab_size: V.  hidden_size: d.  intermediate_size: F.  num_layers: N.
        num_heads: H.  num_kv_heads: H_kv.  head_dim: D.  rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.  context_length: the window.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int


@attrs.frozen(eq=False)
class Layer64:
    """One decoder block's float64 weights (GGUF row order; ``[out, in]`` matrices)."""

    attn_norm: np.ndarray  # [d]
    wq: np.ndarray  # [H * D, d]   rows in llama.cpp's interleaved-pair order
    wk: np.ndarray  # [H_kv * D, d] idem
    wv: np.ndarray  # [H_kv * D, d]
    wo: np.ndarray  # [d, H * D]
    ffn_norm: np.ndarray  # [d]
    w_gate: np.ndarray  # [F, d]
    w_up: np.ndarray  # [F, d]
    w_down: np.ndarray  # [d, F]


@attrs.frozen(eq=False)
class Llama64:
    """A whole float64 model: shape, embeddings, blocks, final norm and head.

    ``head is embed`` when the file has no ``output.weight`` (tied embeddings, as SmolLM2).
    """

    shape: LlamaShape
    embed: np.ndarray  # [V, d]
    layers: tuple[Layer64, ...]
    norm: np.ndarray  # [d]
    head: np.ndarray  # [V, d]


# --------------------------------------------------------------------------------------------
# Loading: GGUF -> float64, dequantized here.
# --------------------------------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian IEEE half floats stored as two bytes each -> float64.  ``uint8[..., 2] -> [...]``."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float64)


def dequantize64(data: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    """Dequantize one GGUF tensor exactly in float64.

    Args:
        data: The tensor's bytes or values as ``GGUFReader`` exposes them.
        type_name: The GGML type name (``F32``, ``F16``, ``BF16``, ``Q4_1``, ``Q8_0``).
        rows, cols: The logical shape ``[rows, cols]`` (``cols`` = the GGUF ``ne0``).

    Returns:
        ``float64[rows, cols]``.

    Raises:
        ValueError: for another type or a byte count that does not fit the shape.

    Source: gguf-py ``quants.py`` (``Q4_1``: per 32 weights ``d: f16, m: f16, qs: 16 bytes``,
    weight ``j`` is ``qs[j] & 15`` and weight ``j + 16`` is ``qs[j] >> 4``; ``Q8_0``: ``d: f16,
    qs: int8[32]``).
    """
    if type_name == "F32":
        return np.asarray(data, dtype=np.float32).reshape(rows, cols).astype(np.float64)
    if type_name == "F16":
        return np.asarray(data, dtype=np.float16).reshape(rows, cols).astype(np.float64)
    if type_name == "BF16":
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(rows, cols).astype(np.float64)
    raw = np.asarray(data, dtype=np.uint8).reshape(-1)
    if cols % _QK:
        raise ValueError(f"{type_name} needs a row width divisible by {_QK}, got {cols}")
    blocks_per_row = cols // _QK
    if type_name == "Q4_1":
        block = raw.reshape(rows, blocks_per_row, 20)  # 2 + 2 + 16 bytes
        d, m = _f16(block[..., 0:2]), _f16(block[..., 2:4])  # [rows, blocks]
        qs = block[..., 4:20]  # [rows, blocks, 16]
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).astype(np.float64)  # [rows, blocks, 32]
        return (d[..., None] * q + m[..., None]).reshape(rows, cols)
    if type_name == "Q8_0":
        block = raw.reshape(rows, blocks_per_row, 34)  # 2 + 32 bytes
        d = _f16(block[..., 0:2])
        q = block[..., 2:34].view(np.int8).astype(np.float64)  # [rows, blocks, 32]
        return (d[..., None] * q).reshape(rows, cols)
    raise ValueError(f"unsupported GGML type {type_name}")


def load_gguf64(path: str | Path) -> Llama64:
    """Read a llama-architecture GGUF file into float64 weights.

    Raises:
        ValueError: when the file is not a llama GGUF, declares a RoPE scaling, or lacks a tensor.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{path}: architecture {meta.get('general.architecture')!r} is not llama")
    if meta.get("llama.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{path}: RoPE scaling {meta['llama.rope.scaling.type']!r} is outside this reference")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    d, v = (int(n) for n in embd.shape[:2])  # GGUF shapes are [ne0 = in, ne1 = out]
    heads = int(meta["llama.attention.head_count"])
    shape = LlamaShape(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.rope.dimension_count", d // heads)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        context_length=int(meta["llama.context_length"]),
    )

    def weight(name: str) -> np.ndarray:
        t = tensors[name]
        cols = int(t.shape[0])
        rows = int(np.prod([int(n) for n in t.shape[1:]])) if len(t.shape) > 1 else 1
        out = dequantize64(t.data, t.tensor_type.name, rows, cols)
        return out[0] if len(t.shape) == 1 else out

    layers = tuple(
        Layer64(
            attn_norm=weight(f"blk.{i}.attn_norm.weight"),
            wq=weight(f"blk.{i}.attn_q.weight"),
            wk=weight(f"blk.{i}.attn_k.weight"),
            wv=weight(f"blk.{i}.attn_v.weight"),
            wo=weight(f"blk.{i}.attn_output.weight"),
            ffn_norm=weight(f"blk.{i}.ffn_norm.weight"),
            w_gate=weight(f"blk.{i}.ffn_gate.weight"),
            w_up=weight(f"blk.{i}.ffn_up.weight"),
            w_down=weight(f"blk.{i}.ffn_down.weight"),
        )
        for i in range(shape.num_layers)
    )
    embed = weight("token_embd.weight")
    head = weight("output.weight") if "output.weight" in tensors else embed
    return Llama64(shape=shape, embed=embed, layers=layers, norm=weight("output_norm.weight"), head=head)


# --------------------------------------------------------------------------------------------
# The blocks.
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis.  ``[T, d] -> [T, d]``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` by ``position * theta^(-2i/D)``.  ``[T, H, D] -> [T, H, D]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / x.shape[-1])  # [D/2]
    angle = positions.astype(np.float64)[:, None] * freq[None, :]  # [T, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [T, 1, D/2]
    even, odd = x[..., 0::2], x[..., 1::2]  # [T, H, D/2] each
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention of T queries over S keys (key ``s`` sits at position ``s``).

    Shapes: ``q [T, H, D]``, ``k, v [S, H_kv, D]`` -> ``[T, H * D]``.  Query head ``h`` reads
    K/V head ``h // (H / H_kv)`` (HF ``repeat_kv``).
    """
    t, h, dim = q.shape
    group = h // k.shape[1]
    kh = np.repeat(k, group, axis=1)  # [S, H, D]
    vh = np.repeat(v, group, axis=1)  # [S, H, D]
    scores = np.einsum("thd,shd->hts", q, kh) / np.sqrt(dim)  # [H, T, S]
    future = np.arange(k.shape[0])[None, :] > q_positions[:, None]  # [T, S]
    scores = np.where(future[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)  # [H, T, S]
    return np.einsum("hts,shd->thd", weights, vh).reshape(t, h * dim)  # [T, H * D]


def swiglu(x: np.ndarray, layer: Layer64) -> np.ndarray:
    """``w_down (silu(w_gate x) * w_up x)``.  ``[T, d] -> [T, d]``."""
    gate = x @ layer.w_gate.T  # [T, F]
    up = x @ layer.w_up.T  # [T, F]
    return (gate / (1.0 + np.exp(-gate)) * up) @ layer.w_down.T


def forward(model: Llama64, ids: Sequence[int], past_k: Sequence[np.ndarray], past_v: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run T new tokens after S cached positions.

    Args:
        model: The weights.
        ids: The T new token ids (positions ``S .. S + T - 1``).
        past_k, past_v: Per layer the cached K (after RoPE, GGUF head-dim order) and V rows,
            ``float64[S, H_kv, D]`` each.

    Returns:
        ``(hidden, k_new, v_new)``: the final-normed hidden states ``float64[T, d]`` and the new
        rows ``float64[N, T, H_kv, D]`` each (K after RoPE).
    """
    shp = model.shape
    start = past_k[0].shape[0] if past_k else 0
    positions = np.arange(start, start + len(ids))  # [T]
    x = model.embed[np.asarray(ids, dtype=np.int64)]  # [T, d]
    k_new, v_new = [], []
    for i, layer in enumerate(model.layers):
        h = rms_norm(x, layer.attn_norm, shp.rms_norm_eps)  # [T, d]
        q = rope_pairs((h @ layer.wq.T).reshape(len(ids), shp.num_heads, shp.head_dim), positions, shp.rope_theta)  # [T, H, D]
        k = rope_pairs((h @ layer.wk.T).reshape(len(ids), shp.num_kv_heads, shp.head_dim), positions, shp.rope_theta)  # [T, H_kv, D]
        v = (h @ layer.wv.T).reshape(len(ids), shp.num_kv_heads, shp.head_dim)  # [T, H_kv, D]
        k_all = np.concatenate((past_k[i], k)) if past_k else k  # [S + T, H_kv, D]
        v_all = np.concatenate((past_v[i], v)) if past_v else v
        x = x + attention(q, k_all, v_all, positions) @ layer.wo.T  # [T, d]
        x = x + swiglu(rms_norm(x, layer.ffn_norm, shp.rms_norm_eps), layer)
        k_new.append(k)
        v_new.append(v)
    return rms_norm(x, model.norm, shp.rms_norm_eps), np.stack(k_new), np.stack(v_new)


def hf_head_order(k: np.ndarray) -> np.ndarray:
    """K rows from llama.cpp's interleaved-pair head-dim order to HF's rotate-half order (last axis)."""
    return np.concatenate((k[..., 0::2], k[..., 1::2]), axis=-1)


# --------------------------------------------------------------------------------------------
# The reference: a trie of committed prefixes, one K/V row per node.
# --------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Node:
    k: np.ndarray  # [N, H_kv, D] this position's K (after RoPE, GGUF order)
    v: np.ndarray  # [N, H_kv, D]
    hidden: np.ndarray  # [d] final-normed hidden state of this position


class Reference64:
    """Reference score rows and K/V rows of committed prefixes, in float64.

    Prefixes are kept in a trie (a dict keyed by the prefix tuple, every cached prefix's own
    prefixes cached too); a new prefix runs only the tokens after its longest cached prefix.
    The node budget is bounded by ``max_bytes`` (least recently used prefixes, and the prefixes
    that extend them, are dropped first); score rows are computed from a node's hidden state
    on demand and kept in a small LRU.

    Args:
        model: The float64 weights (:func:`load_gguf64`).
        max_bytes: Budget of cached K/V rows and hidden states.
        max_rows: Score rows kept.

    Shapes: :meth:`row` ``float64[V]``; :meth:`kv` ``float64[N, 2, H_kv, P, D]`` (K in HF's
    head-dim order, the layout the adapters observe).
    """

    def __init__(self, model: Llama64, *, max_bytes: int = 1 << 30, max_rows: int = 64) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self._nodes: collections.OrderedDict[tuple[int, ...], _Node] = collections.OrderedDict()
        self._rows: collections.OrderedDict[tuple[int, ...], np.ndarray] = collections.OrderedDict()
        shp = model.shape
        self._node_bytes = 8 * (2 * shp.num_layers * shp.num_kv_heads * shp.head_dim + shp.hidden_size)
        self.num_forwards = 0
        self.num_positions = 0

    @property
    def vocab_size(self) -> int:
        """V."""
        return self.model.shape.vocab_size

    @property
    def window(self) -> int:
        """The model's context window (``llama.context_length``)."""
        return self.model.shape.context_length

    def _extend(self, prefix: tuple[int, ...]) -> None:
        known = len(prefix)
        while known and prefix[:known] not in self._nodes:
            known -= 1
        chain = [self._nodes[prefix[:j]] for j in range(1, known + 1)]
        for j in range(1, known + 1):
            self._nodes.move_to_end(prefix[:j])
        past_k = [np.stack([n.k[i] for n in chain]) for i in range(self.model.shape.num_layers)] if chain else []
        past_v = [np.stack([n.v[i] for n in chain]) for i in range(self.model.shape.num_layers)] if chain else []
        hidden, k_new, v_new = forward(self.model, prefix[known:], past_k, past_v)
        self.num_forwards += 1
        self.num_positions += len(prefix) - known
        for t in range(len(prefix) - known):
            self._nodes[prefix[: known + t + 1]] = _Node(k=k_new[:, t].copy(), v=v_new[:, t].copy(), hidden=hidden[t].copy())
        self._evict(protect=prefix)

    def _evict(self, protect: tuple[int, ...]) -> None:
        while len(self._nodes) * self._node_bytes > self.max_bytes and len(self._nodes) > len(protect):
            oldest = next(iter(self._nodes))
            if protect[: len(oldest)] == oldest:
                self._nodes.move_to_end(oldest)
                continue
            doomed = [p for p in self._nodes if p[: len(oldest)] == oldest]  # the prefix and what extends it
            for p in doomed:
                del self._nodes[p]

    def _node(self, prefix: tuple[int, ...]) -> _Node:
        if not prefix:
            raise ValueError("the empty prefix has no score row (M3.10: no row without a context)")
        if any(not 0 <= t < self.vocab_size for t in prefix):
            raise ValueError(f"a prefix id is outside [0, {self.vocab_size})")
        if len(prefix) > self.window:
            raise ValueError(f"prefix of {len(prefix)} positions exceeds the window {self.window}")
        if prefix not in self._nodes:
            self._extend(prefix)
        return self._nodes[prefix]

    def row(self, prefix: Sequence[int]) -> np.ndarray:
        """Raw logits ``float64[V]`` predicting the token after ``prefix`` (read-only).

        Raises:
            ValueError: for an empty prefix, an id outside the vocabulary or a prefix longer
                than the window.
        """
        key = tuple(int(t) for t in prefix)
        hit = self._rows.get(key)
        if hit is None:
            hit = self.model.head @ self._node(key).hidden  # [V]
            hit.setflags(write=False)
            self._rows[key] = hit
            while len(self._rows) > self.max_rows:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(key)
        return hit

    def kv(self, prefix: Sequence[int]) -> np.ndarray | None:
        """Committed K (after RoPE) and V rows of ``prefix``, ``float64[N, 2, H_kv, P, D]`` (``None`` when empty)."""
        key = tuple(int(t) for t in prefix)
        if not key:
            return None
        self._node(key)
        nodes = [self._nodes[key[:j]] for j in range(1, len(key) + 1)]
        k = hf_head_order(np.stack([n.k for n in nodes], axis=2))  # [N, H_kv, P, D]
        v = np.stack([n.v for n in nodes], axis=2)  # [N, H_kv, P, D]
        return np.stack((k, v), axis=1)  # [N, 2, H_kv, P, D]
