"""M3.10 0x09 KV cache implementation path: the cache ABI and the dynamic (concat-growth) cache.

A cache is an ABI, not an untyped tuple: :class:`CacheABI` declares what the stored rows mean
(compact ``H_kv`` heads, keys stored **after** RoPE with the model's base and scaling, dtype,
``[B, H_kv, S, D]`` layout, contiguous logical slots, full visibility window).  The model
refuses a cache whose ABI differs from its own (:data:`CACHE_ABI_MISMATCH`).

Every cache implements the same small interface, used by :class:`decodespec.impl.model.LlamaForCausalLM`:

* ``update(key_states, value_states, layer_idx, cache_position) -> (keys, values)``: store this
  call's rows for one layer and return every key/value slot attention reads, ``[B, H_kv, S_k, D]``;
* ``get_seq_length(layer_idx=0) -> int``: the committed logical length, an explicit integer
  (never inferred from tensor contents);
* ``key_length(num_new_tokens) -> int``: ``S_k``, the number of key slots the next ``update``
  of ``num_new_tokens`` rows returns (the model builds the attention mask over these slots
  from coordinates, M3.10 0x0A);
* ``abi``: the declared :class:`CacheABI`.

A static cache (fixed ``[B, H_kv, S, D]`` buffers written with ``index_copy_`` at
``cache_position``) plugs into the same interface: its ``key_length`` is the capacity ``S`` and
the coordinate mask hides every slot beyond the query's position.

Source: M3.10 0x09 "KV cache implementation path", "Cache format is part of the model/runtime
boundary", "A cache is an ABI, not an untyped tuple", "Cache families preserve different
contracts" (dynamic full cache: append order and every-layer length remain aligned); HF
``transformers/cache_utils.py`` ``DynamicCache`` (``update``, ``get_seq_length``, ``crop``,
``reorder_cache``).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from decodespec.spec.errors import Rejection, register_code

__all__ = [
    "CACHE_ABI_MISMATCH",
    "CacheABI",
    "DynamicCache",
    "INVALID_CACHE_OPERATION",
]

CACHE_ABI_MISMATCH = register_code(
    "cache.abi_mismatch",
    "rejection",
    "M3.10 0x09 A cache is an ABI, not an untyped tuple",
    "The cache's declared ABI (layers, K/V heads, head width, dtype, key rotation, positional transform) differs from the model's.",
)
INVALID_CACHE_OPERATION = register_code(
    "cache.invalid_operation",
    "rejection",
    "M3.10 0x09 KV cache implementation path",
    "A cache update, crop or reorder has the wrong layer index, shape, dtype, batch size or argument range.",
)


@attrs.frozen
class CacheABI:
    """The one-request cache ABI ``A_C = (L_c, H_kv, d_h, L_K, L_V, D_K, D_V, rho, P, W)`` of M3.10 0x09.

    Attributes:
        num_layers: L_c, number of cache-producing layers (in model order).
        num_key_value_heads: H_kv, heads stored per layer.
        head_dim: d_h.
        dtype: Storage dtype of keys and values (D_K = D_V), e.g. ``"float32"``.
        layout: Physical axis layout of K and V (L_K = L_V): ``"[B, H_kv, S, D]"``.
        compact_heads: True: compact GQA heads are stored (never query-head-expanded copies).
        keys_rotated: True: keys are stored after RoPE (rho); never rotate a cached key again.
        rope_theta: RoPE base that rotated the stored keys.
        rope_scaling: ``None`` or ``(rope_type, factor)`` of the RoPE scaling used.
        slot_map: P, logical-position to slot mapping: ``"contiguous"`` (slot i holds processed
            input token i).
        window: W, retained visibility regime: ``"full"``.

    The cache generation G (mutation ownership) is request state, not part of this value.
    """

    num_layers: int
    num_key_value_heads: int
    head_dim: int
    dtype: str
    layout: str = "[B, H_kv, S, D]"
    compact_heads: bool = True
    keys_rotated: bool = True
    rope_theta: float = 10000.0
    rope_scaling: tuple[str, float] | None = None
    slot_map: str = "contiguous"
    window: str = "full"

    @classmethod
    def for_config(cls, config, dtype: torch.dtype) -> "CacheABI":
        """The ABI a model with :class:`~decodespec.impl.config.LlamaConfig` ``config`` writes in ``dtype``."""
        scaling = config.rope_scaling
        return cls(
            num_layers=config.num_hidden_layers,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=str(dtype).removeprefix("torch."),
            rope_theta=config.rope_theta,
            rope_scaling=None if scaling is None else (scaling.rope_type, scaling.factor),
        )


class DynamicCache:
    """Dynamic full K/V cache: per-layer tensors that grow by concatenation along the slot axis.

    Slot ``i`` of every layer holds the rotated key and the value of processed input token ``i``
    (contiguous logical slots).  Lengths are explicit integers kept per layer, so the M3.10 0x08
    length-agreement check ``len(C_l) == K + Delta`` for every layer is :meth:`layer_lengths`.

    Args:
        abi: The ABI the model writes (``model.cache_abi``).

    Shapes:
        ``key_cache[l]``, ``value_cache[l]``: ``[B, H_kv, S, D]`` in ``abi.dtype`` (``None`` before
        the first update of layer ``l``).

    Source: M3.10 0x09 (dynamic full cache: "concatenate/grow per-layer K/V; append order and
    every-layer length remain aligned"); HF ``cache_utils.DynamicLayer.update``.
    """

    family = "dynamic"

    def __init__(self, abi: CacheABI):
        self.abi = abi
        self.key_cache: list[torch.Tensor | None] = [None] * abi.num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * abi.num_layers
        self._lengths: list[int] = [0] * abi.num_layers

    # -- the model-facing interface ----------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's rotated keys and values for ``layer_idx``; return all slots.

        Args:
            key_states: ``[B, H_kv, T, D]`` keys after RoPE, in ``abi.dtype``.
            value_states: ``[B, H_kv, T, D]`` values.
            layer_idx: Layer index in ``[0, abi.num_layers)``.
            cache_position: ``int64[T]`` slots being written.  A dynamic cache appends, so these
                must be ``get_seq_length(layer_idx) + arange(T)``; only the length is checked
                here (checking values would synchronise the device).

        Returns:
            ``(keys, values)``, each ``[B, H_kv, S_k, D]`` with ``S_k = previous length + T``.

        Raises:
            Rejection: ``cache.invalid_operation`` for a bad layer index, shape, dtype or batch
                size; nothing is stored then.
        """
        if not 0 <= layer_idx < self.abi.num_layers:
            raise Rejection(INVALID_CACHE_OPERATION, f"layer_idx {layer_idx} outside [0, {self.abi.num_layers})", "$.cache.layer_idx")
        shape = key_states.shape
        if (
            len(shape) != 4
            or value_states.shape != shape
            or shape[1] != self.abi.num_key_value_heads
            or shape[3] != self.abi.head_dim
            or (cache_position is not None and cache_position.shape != (shape[2],))
        ):
            raise Rejection(
                INVALID_CACHE_OPERATION,
                f"keys {tuple(shape)} / values {tuple(value_states.shape)} do not match "
                f"[B, {self.abi.num_key_value_heads}, T, {self.abi.head_dim}] (cache_position "
                f"{None if cache_position is None else tuple(cache_position.shape)})",
                "$.cache.update",
            )
        old_keys = self.key_cache[layer_idx]
        if old_keys is None:
            if str(key_states.dtype).removeprefix("torch.") != self.abi.dtype or value_states.dtype != key_states.dtype:
                raise Rejection(INVALID_CACHE_OPERATION, f"dtype {key_states.dtype} differs from the ABI's {self.abi.dtype}", "$.cache.update")
            keys, values = key_states, value_states
        else:
            if old_keys.shape[0] != shape[0] or old_keys.dtype != key_states.dtype or value_states.dtype != key_states.dtype:
                raise Rejection(
                    INVALID_CACHE_OPERATION,
                    f"batch {shape[0]} / dtype {key_states.dtype} differ from the cached batch {old_keys.shape[0]} / {old_keys.dtype}",
                    "$.cache.update",
                )
            keys = torch.cat([old_keys, key_states], dim=-2)  # [B, H_kv, S + T, D]
            values = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)  # [B, H_kv, S + T, D]
        self.key_cache[layer_idx] = keys
        self.value_cache[layer_idx] = values
        self._lengths[layer_idx] += shape[2]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Committed logical length (slots written) of ``layer_idx``: an explicit integer."""
        return self._lengths[layer_idx]

    def key_length(self, num_new_tokens: int) -> int:
        """``S_k``: key slots the next update of ``num_new_tokens`` rows returns (length + T)."""
        return self._lengths[0] + num_new_tokens

    # -- inspection -------------------------------------------------------------------------
    def layer_lengths(self) -> tuple[int, ...]:
        """Length of every layer, in layer order (all equal after a complete model call)."""
        return tuple(self._lengths)

    @property
    def batch_size(self) -> int | None:
        """Rows B of the stored tensors, or ``None`` before the first update."""
        keys = self.key_cache[0]
        return None if keys is None else keys.shape[0]

    def nbytes(self) -> int:
        """Bytes of K and V payload held, ``2 * L_c * B * H_kv * S * D * itemsize``."""
        return sum(t.numel() * t.element_size() for t in (*self.key_cache, *self.value_cache) if t is not None)

    # -- edits used by beams and by the runtime ---------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` slots of every layer (no-op when already that short).

        Raises:
            Rejection: ``cache.invalid_operation`` if ``max_length`` is negative.

        Source: HF ``DynamicCache.crop`` (the non-negative branch).
        """
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise Rejection(INVALID_CACHE_OPERATION, f"crop length must be a non-negative int, got {max_length!r}", "$.cache.crop")
        for layer_idx, length in enumerate(self._lengths):
            if length <= max_length:
                continue
            self.key_cache[layer_idx] = self.key_cache[layer_idx][..., :max_length, :]  # [B, H_kv, max_length, D]
            self.value_cache[layer_idx] = self.value_cache[layer_idx][..., :max_length, :]  # [B, H_kv, max_length, D]
            self._lengths[layer_idx] = max_length

    def reorder_cache(self, beam_idx: torch.Tensor | Sequence[int]) -> None:
        """Select batch rows ``beam_idx`` in every layer (row ``r`` becomes old row ``beam_idx[r]``).

        Args:
            beam_idx: ``int64[B']`` parent row of each new row; repeats are allowed (a parent
                with several children), ``B'`` may differ from ``B``.

        Raises:
            Rejection: ``cache.invalid_operation`` for a non-1-D or non-integer index or an index
                outside ``[0, B)``; nothing changes then.

        Source: HF ``Cache.reorder_cache`` (``index_select`` on the batch axis).
        """
        index = torch.as_tensor(beam_idx)
        if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise Rejection(INVALID_CACHE_OPERATION, f"beam_idx must be a 1-D integer tensor, got {tuple(index.shape)} {index.dtype}", "$.cache.beam_idx")
        batch = self.batch_size
        if batch is None:
            raise Rejection(INVALID_CACHE_OPERATION, "cannot reorder an empty cache", "$.cache.beam_idx")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
            raise Rejection(INVALID_CACHE_OPERATION, f"beam_idx values must lie in [0, {batch})", "$.cache.beam_idx")
        for layer_idx, keys in enumerate(self.key_cache):
            if keys is None:
                continue
            rows = index.to(device=keys.device, dtype=torch.long)
            self.key_cache[layer_idx] = keys.index_select(0, rows)  # [B', H_kv, S, D]
            self.value_cache[layer_idx] = self.value_cache[layer_idx].index_select(0, rows)  # [B', H_kv, S, D]
