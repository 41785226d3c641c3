"""M3.10 0x08 Prefill and decode: a Llama-architecture decoder in plain PyTorch (HF names).

One ``forward`` serves prefill, single-token decode and chunked prefill: the calls differ only
in how many rows they carry and at which coordinates (gpt-fast).  The pieces and their HF
names: ``embed_tokens``, ``LlamaRMSNorm``, rotary position embedding (precomputed cos/sin
tables, theta and scaling from the config), grouped-query attention (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``; ``eager`` or ``sdpa``), SwiGLU MLP (``gate_proj``, ``up_proj``,
``down_proj``), final ``norm``, and ``lm_head`` (tied to ``embed_tokens`` when the file says so).

Coordinates (M3.10 0x0A "Position and cache consistency") are explicit and distinct:

* ``position_ids`` ``[B, T]``: the coordinates RoPE rotates with (per row, so left-padded rows
  can start at 0);
* ``cache_position`` ``[T]``: the logical cache slots this call writes, which are also the
  query coordinates of the causal mask;
* the key coordinates are the slots ``0..S_k-1`` the cache returns (``S_k`` is the cache's
  explicit ``key_length(T)``), or this call's own ``cache_position`` without a cache;
* ``attention_mask`` ``[B, S_k]``: optional boolean key validity (padding, unwritten slots).

The additive mask is derived from these coordinates once per call
(:func:`build_attention_mask`): ``M[i, j] = 0 if key_j <= query_i else -inf``, intersected with
key validity.  Keys are stored in the cache after rotation with compact ``H_kv`` heads; the
cache's declared ABI must equal :attr:`LlamaForCausalLM.cache_abi`.

Source: M3.10 0x08 "Prefill and decode" (shape table), 0x09 "KV cache implementation path"
(Llama-style attention with ``start_pos``, cache ABI), 0x0A "Deriving cached causal visibility
from coordinates" and "Chunked input equivalence"; HF
``transformers/models/llama/modeling_llama.py`` and ``integrations/sdpa_attention.py`` (the
numerics mirrored here); pytorch-labs/gpt-fast ``model.py`` (layout).

Size: the plain Llama decoder with HF's module names (RMSNorm, RoPE, attention, MLP, layers, the
causal LM with its position and cache checks); the fused weights, the arena and the native decode
kernel's dispatch are in impl/fastpath.py.
"""

from __future__ import annotations

import contextlib

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from decodespec.spec.errors import Rejection, ResourceLimit, register_code
from decodespec.spec.request import CONTEXT_WINDOW_EXCEEDED as SPEC_CONTEXT_WINDOW_EXCEEDED

from .cache import CACHE_ABI_MISMATCH, CacheABI, DynamicCache, StaticCache
from .config import ATTN_IMPLEMENTATIONS, INVALID_CONFIG, LlamaConfig
from .fastpath import FusedWeight, clear_native_result, has_hooks, native_layers, native_result, weight_arena

__all__ = [
    "CONTEXT_WINDOW_EXCEEDED",
    "INVALID_MODEL_INPUT",
    "CausalLMOutput",
    "Linear",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "StageObserver",
    "apply_rotary_pos_emb",
    "build_attention_mask",
    "project",
    "rotate_half",
    "rotate_heads",
]

INVALID_MODEL_INPUT = register_code(
    "model.invalid_input",
    "rejection",
    "M3.10 0x02 One step as a shape ledger",
    "A model call's input_ids, position_ids, cache_position, attention_mask or logits_to_keep has the wrong rank, "
    "shape, dtype or value range.",
)
TRAINING_MODE = register_code(
    "model.training_mode",
    "rejection",
    "M3.10 0x0B Shape-correct failure lab (running inference with model.train())",
    "Inference was asked of a model in training mode (dropout and training behaviour would be active).",
)

#: ``model.context_window_exceeded`` (registered in the spec: :data:`decodespec.spec.request.CONTEXT_WINDOW_EXCEEDED`).
CONTEXT_WINDOW_EXCEEDED = SPEC_CONTEXT_WINDOW_EXCEEDED


class LlamaRMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32: ``weight * x / sqrt(mean(x^2) + eps)``.

    Shapes: ``[..., d_model] -> [..., d_model]`` (input dtype kept).

    Source: HF ``LlamaRMSNorm`` (same operation order, so float32 results are bitwise equal).
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        if input_dtype != torch.float32:  # a float32 input skips two no-op casts (two dispatches per norm)
            hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)  # [..., 1]
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if input_dtype != torch.float32:
            hidden_states = hidden_states.to(input_dtype)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Module):
    """Precomputed RoPE tables ``cos``, ``sin`` of shape ``[C, D]`` for every position in the window.

    ``inv_freq[k] = 1 / theta^(2k/D)`` (divided by ``factor`` under linear scaling); the tables
    are computed in float32 and cast once to the model dtype, exactly as HF casts its per-call
    values, so table lookup and HF's per-call computation agree bitwise.  After ``.to(...)``
    the tables are rebuilt from the config (never re-cast from a lower precision).

    Source: HF ``LlamaRotaryEmbedding`` / ``compute_default_rope_parameters`` and
    ``_compute_linear_scaling_rope_parameters``; gpt-fast ``precompute_freqs_cis``.
    """

    def __init__(self, config: LlamaConfig, device: torch.device | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        cos, sin = self._tables(device, dtype)
        self.register_buffer("cos_cached", cos, persistent=False)  # [C, D]
        self.register_buffer("sin_cached", sin, persistent=False)  # [C, D]

    def _tables(self, device: torch.device | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        dim = config.head_dim
        if device is not None and torch.device(device).type == "meta":
            shape = (config.max_position_embeddings, dim)
            return torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))  # [D/2]
        if config.rope_scaling is not None:
            inv_freq = inv_freq / config.rope_scaling.factor
        positions = torch.arange(config.max_position_embeddings, device=device, dtype=torch.int64).float()  # [C]
        freqs = positions[:, None] * inv_freq[None, :]  # [C, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [C, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _apply(self, fn, recurse: bool = True):  # nn.Module hook
        """Rebuild the tables in float32 after a device/dtype move, then cast (no precision loss)."""
        result = super()._apply(fn, recurse)
        cos, sin = self._tables(self.cos_cached.device, self.cos_cached.dtype)
        self.cos_cached, self.sin_cached = cos, sin
        return result

    def signed_rows(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``signed_sin = cat(-sin[:D/2], sin[D/2:])`` at one position, ``[D]`` each (views of cached tables).

        The sign is moved exactly, so these are bitwise the rows :class:`LlamaModel` builds per
        call for :func:`rotate_heads`.
        """
        table = self.__dict__.get("_signed_sin")
        if table is None or table[0] is not self.sin_cached:
            table = self.__dict__["_signed_sin"] = (self.sin_cached, signed_sine(self.sin_cached))  # [C, D]
        return self.cos_cached[position], table[1][position]

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` at ``position_ids`` ``int64[B, T]``, each ``[B, 1, T, D]`` (broadcast over heads)."""
        cos = self.cos_cached[position_ids].unsqueeze(1)  # [B, 1, T, D]
        sin = self.sin_cached[position_ids].unsqueeze(1)  # [B, 1, T, D]
        return cos, sin


def signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """``cat(-sin[..., :D/2], sin[..., D/2:])``: the sine factor of :func:`rotate_heads` (the sign moved exactly).

    Shapes: ``[..., D] -> [..., D]``.
    """
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (HF's half-split RoPE convention).

    Shapes: ``[..., D] -> [..., D]``.
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., D]


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``[B, H, T, D]`` and keys ``[B, H_kv, T, D]`` by ``cos``/``sin`` ``[B, 1, T, D]``.

    Source: HF ``apply_rotary_pos_emb`` (rotate-half form; GGUF Q/K rows are un-permuted by the
    loader so this form applies).
    """
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary_pos_emb` for query and key heads in one pass: ``x * cos + swap_halves(x) * signed_sin``.

    ``signed_sin = cat(-sin[:D/2], sin[D/2:])``, so ``swap_halves(x) * signed_sin`` equals
    ``rotate_half(x) * sin`` element for element (a sign moved between two factors changes no
    bit), with one rotation for all ``H + H_kv`` heads instead of one per tensor.

    Shapes: ``x [B, T, N, D]`` (N heads), ``cos``/``signed_sin`` ``[B, T, 1, D]`` -> ``[B, T, N, D]``.
    """
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [B, T, N, D]: halves swapped in one copy (= cat of the two slices)
    return x * cos + swapped * signed_sin


def build_attention_mask(
    cache_position: torch.Tensor,
    key_positions: torch.Tensor,
    key_validity: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The additive attention mask from coordinates: ``M[i, j] = 0 if key_j <= query_i else -inf``.

    Query row ``i`` has coordinate ``cache_position[i]`` (``p + i`` for a chunk starting at
    ``p``); key column ``j`` has coordinate ``key_positions[j]``.  Causal visibility is
    intersected with ``key_validity`` (padding, unwritten static slots).  ``-inf`` is realised
    as ``torch.finfo(dtype).min`` (as HF does): a visible row gives masked keys exactly zero
    weight (``exp`` underflows), and a row with no visible key (a padding query) stays finite
    instead of producing NaN that would reach other rows through the cache.

    Args:
        cache_position: ``int64[T]`` query coordinates.
        key_positions: ``int64[S_k]`` key coordinates.
        key_validity: ``bool[B, S_k]`` (or 0/1 integers) or ``None`` (every key valid).
        dtype: Floating dtype of the mask (the attention compute dtype).

    Returns:
        ``[B or 1, 1, T, S_k]`` additive mask in ``dtype``.

    Source: M3.10 0x0A "Deriving cached causal visibility from coordinates" (with ``p=3, c=2``:
    row for position 3 sees keys 0..3, row for position 4 sees keys 0..4).
    """
    visible = key_positions[None, :] <= cache_position[:, None]  # [T, S_k]
    visible = visible[None, None]  # [1, 1, T, S_k]
    if key_validity is not None:
        visible = visible & key_validity.bool()[:, None, None, :]  # [B, 1, T, S_k]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand compact K/V heads for attention: ``[B, H_kv, S, D] -> [B, H_kv * n_rep, S, D]``.

    Source: HF ``repeat_kv`` (equivalent to ``repeat_interleave(n_rep, dim=1)``).
    """
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_kv_heads, n_rep, slen, head_dim)  # [B, H_kv, n_rep, S, D]
    return hidden_states.reshape(batch, num_kv_heads * n_rep, slen, head_dim)  # [B, H, S, D]


def eager_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float, n_rep: int) -> torch.Tensor:
    """Reference attention: ``softmax(q k^T * scaling + mask) v`` with the softmax in float32.

    Shapes: ``query [B, H, T, D]``, ``key``/``value [B, H_kv, S_k, D]``, ``mask [B|1, 1, T, S_k]``
    -> ``[B, T, H, D]``.

    Source: HF ``eager_attention_forward``.
    """
    key = repeat_kv(key, n_rep)  # [B, H, S_k, D]
    value = repeat_kv(value, n_rep)  # [B, H, S_k, D]
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, T, S_k]
    if mask is not None:
        scores = scores + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # [B, H, T, S_k]
    return torch.matmul(weights, value).transpose(1, 2)  # [B, T, H, D]


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float, n_rep: int) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with grouped-query heads, no K/V copies.

    A single query row (decode) folds the ``n_rep`` query heads of each K/V head into the query
    axis, ``[B, H, 1, D] -> [B, H_kv, n_rep, D]``, so the compact cache is read as is (HF's
    ``pack_gqa``); several rows use SDPA's ``enable_gqa``.

    Shapes: as :func:`eager_attention`, returns ``[B, T, H, D]``.

    Source: HF ``integrations/sdpa_attention.py`` ``sdpa_attention_forward``.
    """
    batch, num_heads, q_len, head_dim = query.shape
    if q_len == 1 and n_rep > 1:
        packed = query.reshape(batch, num_heads // n_rep, n_rep, head_dim)  # [B, H_kv, n_rep, D]
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)  # [B, H_kv, n_rep, D]
        return out.reshape(batch, 1, num_heads, head_dim)  # [B, 1, H, D]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=n_rep > 1)  # [B, H, T, D]
    return out.transpose(1, 2)  # [B, T, H, D]


_ATTENTION = {"eager": eager_attention, "sdpa": sdpa_attention}


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` without bias; a single row goes through ``torch.mv``.

    A batch-1 decode step multiplies one row by every weight matrix.  On the CPU the GEMV
    kernel behind ``torch.mv`` streams bfloat16 weights about 1.4x faster than the GEMM path of
    ``F.linear`` (measured: 15 vs 10 GB/s) and returns the same values (float32 and bfloat16
    logits of SmolLM2 are bitwise equal either way); every other call is ``F.linear``.

    Shapes: ``x [..., in]``, ``weight [out, in]`` -> ``[..., out]``.
    """
    if x.numel() == weight.shape[1]:
        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])  # [..., out]
    return F.linear(x, weight)


class Linear(nn.Linear):
    """``nn.Linear`` whose bias-free call is :func:`project` (single rows through ``torch.mv``).

    State dict names and module hooks are those of ``nn.Linear``.

    Shapes: ``[..., in_features] -> [..., out_features]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return project(x, self.weight)
        return F.linear(x, self.weight, self.bias)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention (H query heads over H_kv K/V heads) with RoPE and a cache.

    Source: HF ``LlamaAttention``; M3.10 0x09 (keys are rotated before they are stored, and
    stored with compact heads).
    """

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_key_value_groups
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attn_implementation = config.attn_implementation
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv = FusedWeight([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        mask: torch.Tensor | None,
        past_key_values,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        """Shapes: ``hidden_states [B, T, d_model]``, ``cos``/``signed_sin [B, T, 1, D]`` (:func:`rotate_heads`),
        ``mask [B|1, 1, T, S_k]`` -> ``[B, T, d_model]``.

        With the fused ``qkv`` matrix one projection yields query, key and value rows, and one
        rotation covers the ``H + H_kv`` query and key heads; otherwise each projection runs alone.
        """
        batch, q_len, _ = hidden_states.shape
        heads, kv_heads, dim = self.num_heads, self.num_key_value_heads, self.head_dim
        fused = self.qkv.get()
        if fused is not None:
            qkv = project(hidden_states, fused)  # [B, T, (H + 2 H_kv) * D]
            rotated = rotate_heads(qkv[..., : (heads + kv_heads) * dim].view(batch, q_len, heads + kv_heads, dim), cos, signed_sin)  # [B, T, H + H_kv, D]
            query = rotated[:, :, :heads].transpose(1, 2)  # [B, H, T, D]
            key = rotated[:, :, heads:].transpose(1, 2)  # [B, H_kv, T, D]
            value = qkv[..., (heads + kv_heads) * dim:].view(batch, q_len, kv_heads, dim).transpose(1, 2)  # [B, H_kv, T, D]
        else:
            query = rotate_heads(self.q_proj(hidden_states).view(batch, q_len, heads, dim), cos, signed_sin).transpose(1, 2)  # [B, H, T, D]
            key = rotate_heads(self.k_proj(hidden_states).view(batch, q_len, kv_heads, dim), cos, signed_sin).transpose(1, 2)  # [B, H_kv, T, D]
            value = self.v_proj(hidden_states).view(batch, q_len, kv_heads, dim).transpose(1, 2)  # [B, H_kv, T, D]
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx, cache_position)  # [B, H_kv, S_k, D]
        out = _ATTENTION[self.attn_implementation](query, key, value, mask, self.scaling, self.num_key_value_groups)  # [B, T, H, D]
        return self.o_proj(out.reshape(batch, q_len, self.num_heads * self.head_dim))  # [B, T, d_model]


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Shapes: ``[B, T, d_model] -> [B, T, d_model]``.  Source: HF ``LlamaMLP``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up = FusedWeight([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up.get()
        if fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = project(x, fused)  # [..., 2F], one GEMV
        width = gate_up.shape[-1] // 2
        return self.down_proj(F.silu(gate_up[..., :width]) * gate_up[..., width:])


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))``.  Source: HF ``LlamaDecoderLayer``."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin, mask, past_key_values, cache_position) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, mask, past_key_values, cache_position)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states

class StageObserver:
    """Told each compute stage of a model call as it completes; may inject a fault before a layer.

    The runtime's stage roster (:func:`decodespec.impl.runtime._stage_roster`) sets one on
    :attr:`LlamaModel.observer` for a call.  Stages, in order: ``embed_tokens``, ``layers.0`` ..
    ``layers.{n-1}``, ``norm``, ``lm_head``.  Both the torch path and the native kernel report
    them; with the native kernel the layers before ``fault_layer`` run in one kernel call and
    are reported when it returns (a kernel call cannot fail part-way).

    Attributes:
        fault_layer: Call :meth:`fault` instead of running this layer (``None``: never).
    """

    fault_layer: int | None = None

    def completed(self, stage: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def fault(self, layer_idx: int) -> None:  # pragma: no cover - interface
        """Raise the injected fault (must not return)."""
        raise NotImplementedError


@attrs.frozen(eq=False)
class CausalLMOutput:
    """Result of one model call.

    Attributes:
        logits: ``[B, T_kept, V]`` raw scores in the model dtype (``T_kept`` rows chosen by
            ``logits_to_keep``).
        past_key_values: The cache the call wrote into (``None`` without a cache).
        hidden_states: ``[B, T, d_model]`` final-normed hidden states of every row (the head's
            input) when the call asked for them (``return_hidden_states``), else ``None``.
    """

    logits: torch.Tensor
    past_key_values: DynamicCache | None
    hidden_states: torch.Tensor | None = None


class LlamaModel(nn.Module):
    """The decoder stack: ``embed_tokens`` -> layers -> ``norm`` (hidden states, no head)."""

    def __init__(self, config: LlamaConfig, device: torch.device | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, idx) for idx in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config, device=device)

    #: Set for one call by the runtime's stage roster (:class:`StageObserver`); ``None``: no one listens.
    observer: StageObserver | None = None
    @property
    def native_logits(self) -> torch.Tensor | None:
        """The logits ``float32[V]`` the native kernel computed in this thread's last call (with ``native_head``), else ``None``."""
        return native_result(self)

    def forward(self, input_ids, position_ids, cache_position, mask, past_key_values, native_kernel=None, native_head=None) -> torch.Tensor:
        """Shapes: ``input_ids int64[B, T]``, ``position_ids int64[B, T]`` -> ``[B, T, d_model]``.

        ``native_kernel``: a :class:`decodespec.impl.native.NativeKernel` when this call is one
        float32 CPU row on a :class:`StaticCache` (the caller decides); the layers then run in it
        (:func:`decodespec.impl.fastpath.native_layers`) unless a hook watches a layer, a layer's weights cannot go
        native, or the open call drops a layer's write.  When all of them did and nothing hooks
        ``norm``, the final norm runs there too, and with ``native_head`` (the ``lm_head`` weight
        ``[V, d]``) the head: its logits are left in :attr:`native_logits`.
        """
        observer = self.observer
        hidden_states = self.embed_tokens(input_ids)  # [B, T, d_model]
        if observer is not None:
            observer.completed("embed_tokens")
        done = 0
        clear_native_result()
        if native_kernel is not None:
            hidden_states, done, normed = native_layers(self, native_kernel, native_head, hidden_states, position_ids, mask,
                                                        past_key_values, cache_position)
            if normed:
                return hidden_states  # the final norm ran in the kernel
        cos, sin = self.rotary_emb(position_ids)  # [B, 1, T, D] each, tables in the model dtype
        cos, sin = cos.to(hidden_states.dtype).transpose(1, 2), sin.to(hidden_states.dtype).transpose(1, 2)  # [B, T, 1, D]
        signed_sin = signed_sine(sin)  # [B, T, 1, D] (rotate_heads)
        for idx in range(done, len(self.layers)):
            if observer is not None and observer.fault_layer == idx:
                observer.fault(idx)
            hidden_states = self.layers[idx](hidden_states, cos, signed_sin, mask, past_key_values, cache_position)
            if observer is not None:
                observer.completed(f"layers.{idx}")
        return self.norm(hidden_states)

class LlamaForCausalLM(nn.Module):
    """Llama decoder with the vocabulary head: ``input_ids -> logits``.

    Build with :func:`decodespec.impl.weights.load_smollm2` (the real model) or
    :func:`decodespec.impl.tiny.load_tiny`; the constructor creates uninitialised weights.

    Args:
        config: The architecture.
        device: Where to create parameters (``"meta"`` to allocate nothing before loading).

    Source: HF ``LlamaForCausalLM`` (``lm_head`` tied to ``model.embed_tokens`` when
    ``tie_word_embeddings``).
    """

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.model = LlamaModel(config, device=device)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.decode_kernel = "torch"
        self._kernel = None
        self.eval()

    def _apply(self, fn, recurse: bool = True):  # nn.Module hook
        """After a device/dtype move (``.to``, ``to_empty``), point the projections at fused matrices again."""
        result = super()._apply(fn, recurse)
        self.rebuild_fused_projections()
        for layer in self.model.layers:  # cached native weight pointers would pin the old storage
            layer.__dict__.pop("_native_weights", None)
        return result

    def __setstate__(self, state) -> None:
        """After ``copy.deepcopy`` or unpickling: the copied weights are new storage, so fuse them again."""
        super().__setstate__(state)
        self.rebuild_fused_projections()

    def rebuild_fused_projections(self) -> None:
        """(Re)build every layer's fused ``qkv`` and ``gate_up`` matrices (:class:`FusedWeight`).

        On the CPU every weight a decode step reads is moved into one arena in the order a step
        reads it (:meth:`decode_weight_order`; :func:`weight_arena`, backed by transparent huge
        pages where the OS allows): parameters become views into it, values and state dict are
        unchanged.  Elsewhere (or with mixed dtypes) each fused matrix gets its own storage.
        """
        order = self.decode_weight_order()
        items = [item for item in order if not isinstance(item, FusedWeight) or item.fusable()]
        tensors = [item.linears[0].weight if isinstance(item, FusedWeight) else item for item in items]
        if not tensors or len({(t.dtype, t.device) for t in tensors}) != 1 or tensors[0].device.type != "cpu":
            for item in order:
                if isinstance(item, FusedWeight):
                    item.refuse()
            return
        shapes = [item.shape if isinstance(item, FusedWeight) else tuple(item.shape) for item in items]
        views = weight_arena(shapes, tensors[0].dtype)
        with torch.no_grad():
            for item, view in zip(items, views):
                if isinstance(item, FusedWeight):
                    item.refuse(out=view)
                else:
                    view.copy_(item.detach())
                    item.data = view
        for item in order:  # fused matrices that could not be fused fall back to the separate path
            if isinstance(item, FusedWeight) and item not in items:
                item.refuse()

    def decode_weight_order(self) -> list:
        """The weights of a decode step in the order it reads them (each once; a tied head once).

        Per layer ``input_layernorm``, fused ``qkv`` (a :class:`FusedWeight`), ``o_proj``,
        ``post_attention_layernorm``, fused ``gate_up``, ``down_proj``; then the final ``norm``
        and ``lm_head`` (the embedding matrix when tied).  Parameters are ``nn.Parameter``.
        """
        order: list = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            order += [layer.input_layernorm.weight, attn.qkv, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                      mlp.gate_up, mlp.down_proj.weight]
        order += [self.model.norm.weight, self.lm_head.weight]
        seen: set[int] = set()
        unique = []
        for item in order:
            if id(item) not in seen:
                seen.add(id(item))
                unique.append(item)
        return unique

    # -- properties -------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` and ``embed_tokens.weight`` one Parameter, holding the embedding's values, when tied.

        The Parameter kept is the head's when the two differ in storage but agree in shape,
        dtype and device (its values overwritten by the embedding's): after a device move the
        two are separate tensors again, and :meth:`rebuild_fused_projections` placed the head in the
        decode-weight arena, where a decode step streams it last.  Otherwise the embedding's
        Parameter is used for both.
        """
        if not self.config.tie_word_embeddings:
            return
        head, embed = self.lm_head.weight, self.model.embed_tokens.weight
        if head is embed:
            return
        if head.shape == embed.shape and head.dtype == embed.dtype and head.device == embed.device and head.device.type != "meta":
            with torch.no_grad():
                head.copy_(embed)
            self.model.embed_tokens.weight = head
        else:
            self.lm_head.weight = embed

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def cache_abi(self) -> CacheABI:
        """The :class:`CacheABI` this model writes and reads (compact heads, rotated keys, dtype)."""
        return CacheABI.for_config(self.config, self.dtype)

    def new_cache(self) -> DynamicCache:
        """An empty :class:`DynamicCache` with this model's ABI."""
        return DynamicCache(self.cache_abi)

    def set_attn_implementation(self, attn_implementation: str) -> LlamaForCausalLM:
        """Switch every layer to ``"eager"`` or ``"sdpa"`` attention; returns ``self``.

        Raises:
            Rejection: ``model.invalid_config`` for another name.
        """
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise Rejection(INVALID_CONFIG, f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}", "$.config.attn_implementation")
        self.config = attrs.evolve(self.config, attn_implementation=attn_implementation)
        for layer in self.model.layers:
            layer.self_attn.attn_implementation = attn_implementation
        return self

    def set_decode_kernel(self, name: str) -> LlamaForCausalLM:
        """Run single-row decode calls through ``"native"`` (:mod:`decodespec.impl.native`) or ``"torch"``; returns ``self``.

        With ``"native"``, a call of one row, batch 1, float32 on the CPU with a
        :class:`StaticCache` runs every layer and the ``lm_head`` product in the C kernel; every
        other call runs the torch path (module docstring of :mod:`decodespec.impl.native`).

        Raises:
            Rejection: ``runtime.kernel_unavailable`` when ``"native"`` cannot run here (no C
                compiler, no AVX2/FMA) or the model is not float32 on the CPU;
                ``model.invalid_config`` for another name.  Nothing changes then.
        """
        from .native import DECODE_KERNELS, KERNEL_UNAVAILABLE, kernel

        if name not in DECODE_KERNELS:
            raise Rejection(INVALID_CONFIG, f"decode kernel must be one of {DECODE_KERNELS}, got {name!r}", "$.runtime.decode_kernel")
        native = None
        if name == "native":
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise Rejection(KERNEL_UNAVAILABLE, f"the native decode kernel runs float32 on the CPU, not {self.dtype} on {self.device}",
                                "$.runtime.decode_kernel")
            native = kernel()
        self.decode_kernel, self._kernel = name, native
        return self

    def num_parameters(self) -> int:
        """Distinct parameter elements (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    # -- the model call ---------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        cache_position: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_hidden_states: bool = False,
    ) -> CausalLMOutput:
        """One model call: process ``T`` rows at explicit coordinates and return their logits.

        Prefill is a call with the whole prompt (``cache_position = 0..L-1``); decode is a call
        with one row at ``cache_position = [P]``; a prefill chunk is ``p..p+c-1``.  Every call
        writes its rotated K/V rows into ``past_key_values`` (when given) and reads every slot
        the cache returns, under the coordinate mask of :func:`build_attention_mask`.

        Args:
            input_ids: ``int64[B, T]`` token ids.
            attention_mask: ``bool[B, S_k]`` (or 0/1 integers) key validity over every key slot
                this call reads (``S_k = past_key_values.key_length(T)``, or ``T`` without a
                cache); ``None``: every slot valid.
            position_ids: ``int64[B, T]`` (or ``[T]``/``[1, T]``, broadcast) RoPE coordinates;
                default ``cache_position`` for every row.
            past_key_values: A cache whose ``abi`` equals :attr:`cache_abi`, or ``None``.
            use_cache: With ``past_key_values=None``, create a fresh :class:`DynamicCache`.
            cache_position: ``int64[T]`` slots written (query coordinates); default
                ``past_len + arange(T)`` with ``past_len = past_key_values.get_seq_length()``
                (an explicit integer; 0 without a cache).
            logits_to_keep: ``0`` keeps every row; ``n > 0`` keeps the last ``n`` rows; an
                ``int64[k]`` tensor keeps those rows of every sequence; an ``int64[B, k]`` tensor
                keeps rows per sequence (``[B, 1]``: each sequence's last valid row under right
                padding, M3.8 0x06).  Rows are selected before ``lm_head``: only ``B * T_kept``
                rows are projected and no ``[B, T, V]`` tensor is produced (M3.8 0x0A).
            return_hidden_states: Also return every row's final-normed hidden state (prompt
                logprobs score each prefill row with the head in bounded blocks,
                :mod:`decodespec.impl.prompt_logprobs`, instead of keeping ``[T, V]`` logits).

        Returns:
            :class:`CausalLMOutput` with ``logits [B, T_kept, V]`` (model dtype).

        Raises:
            Rejection: ``model.invalid_input`` for a wrong rank, shape, dtype, ``input_ids`` on
                another device than the model's weights, or (for CPU
                tensors, where checking is free of device synchronisation) an id outside
                ``[0, V)``; ``cache.abi_mismatch`` when the cache's ABI differs.  Raised before
                anything is written.
            ResourceLimit: ``model.context_window_exceeded`` when a derived position, or a given
                CPU position, is outside ``[0, max_position_embeddings)``.

        Units: logits are natural-log-scale unnormalised scores.
        """
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        batch, q_len = self._check_input_ids(input_ids)
        past_len = 0
        if past_key_values is not None:
            if past_key_values.abi != self.cache_abi:
                raise Rejection(CACHE_ABI_MISMATCH, f"cache ABI {past_key_values.abi} differs from the model's {self.cache_abi}", "$.past_key_values.abi")
            cached_batch = past_key_values.batch_size
            if cached_batch is not None and cached_batch != batch:
                raise Rejection(INVALID_MODEL_INPUT, f"batch {batch} differs from the cache's {cached_batch}", "$.input_ids")
            past_len = past_key_values.get_seq_length()
        device = input_ids.device
        window = self.config.max_position_embeddings
        if cache_position is None:
            if past_len + q_len > window:
                raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"positions {past_len}..{past_len + q_len - 1} exceed the window {window}", "$.cache_position")
            cache_position = torch.arange(past_len, past_len + q_len, device=device)  # [T]
        else:
            _check_index_tensor(cache_position, (q_len,), "cache_position", None)
        if position_ids is None:
            position_ids = cache_position.expand(batch, q_len)  # [B, T]
        else:
            if position_ids.dim() == 1:
                position_ids = position_ids[None]  # [1, T]
            if position_ids.dim() != 2 or position_ids.shape[1] != q_len or position_ids.shape[0] not in (1, batch):
                raise Rejection(INVALID_MODEL_INPUT, f"position_ids {tuple(position_ids.shape)} must be [B, T] = [{batch}, {q_len}]", "$.position_ids")
            _check_index_tensor(position_ids, tuple(position_ids.shape), "position_ids", window)
            position_ids = position_ids.expand(batch, q_len)  # [B, T]
        if past_key_values is not None:
            key_len = past_key_values.key_length(q_len)
            key_positions = torch.arange(key_len, device=device)  # [S_k]
        else:
            key_len = q_len
            key_positions = cache_position  # [S_k = T]: the keys are this call's own rows
        if attention_mask is not None and (
            attention_mask.shape != (batch, key_len) or attention_mask.dtype.is_floating_point
        ):
            raise Rejection(
                INVALID_MODEL_INPUT,
                f"attention_mask {tuple(attention_mask.shape)} {attention_mask.dtype} must be bool/int [B, S_k] = [{batch}, {key_len}]",
                "$.attention_mask",
            )
        keep = _check_logits_to_keep(logits_to_keep, q_len, batch)
        mask = build_attention_mask(cache_position, key_positions, attention_mask, self.dtype)  # [B|1, 1, T, S_k]

        native = native_head = None
        if (self._kernel is not None and batch == 1 and q_len == 1 and isinstance(past_key_values, StaticCache)
                and device.type == "cpu" and self.dtype == torch.float32 and not torch.is_grad_enabled()
                and not has_hooks((self.model,))):
            native = self._kernel
            head = self.lm_head.weight
            if (isinstance(keep, int) and head.dtype == torch.float32 and head.device.type == "cpu" and head.is_contiguous()
                    and not has_hooks((self.lm_head,))):
                native_head = head
        hidden_states = self.model(input_ids, position_ids, cache_position, mask, past_key_values, native, native_head)  # [B, T, d_model]
        observer = self.model.observer
        if observer is not None:
            observer.completed("norm")
        every_row = hidden_states if return_hidden_states else None  # [B, T, d_model]
        if isinstance(keep, torch.Tensor) and keep.dim() == 2:  # per-sequence rows (M3.8 0x06)
            rows = torch.arange(batch, device=hidden_states.device)[:, None]  # [B, 1]
            hidden_states = hidden_states[rows, keep.to(hidden_states.device)]  # [B, T_kept, d_model]
        else:
            hidden_states = hidden_states[:, keep, :] if isinstance(keep, torch.Tensor) else hidden_states[:, -keep:, :]  # [B, T_kept, d_model]
        native_logits = self.model.native_logits
        if native_logits is not None:
            logits = native_logits.view(1, 1, -1)  # [1, 1, V]: the head ran in the kernel
        else:
            logits = self.lm_head(hidden_states)  # [B, T_kept, V]
        if observer is not None:
            observer.completed("lm_head")
        return CausalLMOutput(logits=logits, past_key_values=past_key_values, hidden_states=every_row)

    def _check_input_ids(self, input_ids: torch.Tensor) -> tuple[int, int]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise Rejection(INVALID_MODEL_INPUT, "input_ids must be a non-empty int64[B, T] tensor", "$.input_ids")
        if input_ids.device != self.device:  # torch would fail inside the embedding, or (meta) return rows of no value
            raise Rejection(INVALID_MODEL_INPUT, f"input_ids are on {input_ids.device}, the model's weights on {self.device}",
                            "$.input_ids")
        _check_index_tensor(input_ids, tuple(input_ids.shape), "input_ids", self.config.vocab_size)
        return input_ids.shape[0], input_ids.shape[1]


def _check_index_tensor(tensor: torch.Tensor, shape: tuple[int, ...], name: str, upper: int | None) -> None:
    """Shape and integer dtype always; value range ``[0, upper)`` only for CPU tensors (no device sync).

    Raises:
        Rejection: ``model.invalid_input`` for a wrong shape/dtype, a negative value or an id
            ``>= upper``.
        ResourceLimit: ``model.context_window_exceeded`` for a position ``>= upper``.
    """
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise Rejection(INVALID_MODEL_INPUT, f"{name} must be an integer tensor of shape {shape}, got {got}", f"$.{name}")
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    low, high = int(tensor.min()), int(tensor.max())
    if name == "input_ids" and (low < 0 or high >= upper):
        # token ids are user content: count them, never quote them (spec/errors.py)
        outside = int(((tensor < 0) | (tensor >= upper)).sum())
        raise Rejection(INVALID_MODEL_INPUT, f"input_ids must lie in [0, {upper}): {outside} id(s) outside it", "$.input_ids",
                        {"outside": outside})
    if low < 0:
        raise Rejection(INVALID_MODEL_INPUT, f"{name} must lie in [0, {upper}), got [{low}, {high}]", f"$.{name}")
    if upper is not None and high >= upper:
        raise ResourceLimit(CONTEXT_WINDOW_EXCEEDED, f"{name} must lie in [0, {upper}), got [{low}, {high}]", f"$.{name}")


def _check_logits_to_keep(logits_to_keep: int | torch.Tensor, q_len: int, batch: int) -> int | torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        if (logits_to_keep.dim() not in (1, 2) or (logits_to_keep.dim() == 2 and logits_to_keep.shape[0] != batch)
                or logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype == torch.bool):
            raise Rejection(INVALID_MODEL_INPUT, f"logits_to_keep tensor must be int64[k] or int64[B = {batch}, k] row indices",
                            "$.logits_to_keep")
        return logits_to_keep
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise Rejection(INVALID_MODEL_INPUT, f"logits_to_keep must be a non-negative int or an index tensor, got {logits_to_keep!r}", "$.logits_to_keep")
    return q_len if logits_to_keep == 0 or logits_to_keep > q_len else logits_to_keep

