"""M3.10 0x09 KV cache implementation path: the cache ABI, the dynamic and the static cache.

A cache is an ABI, not an untyped tuple: :class:`CacheABI` declares what the stored rows mean
(compact ``H_kv`` heads, keys stored **after** RoPE with the model's base and scaling, dtype,
``[B, H_kv, S, D]`` layout, contiguous logical slots, full visibility window).  The model
refuses a cache whose ABI differs from its own (:data:`CACHE_ABI_MISMATCH`).

Every cache implements the same small interface, used by :class:`decodespec.impl.model.LlamaForCausalLM`:

* ``update(key_states, value_states, layer_idx, cache_position) -> (keys, values)``: store this
  call's rows for one layer and return every key/value slot attention reads, ``[B, H_kv, S_k, D]``;
* ``get_seq_length(layer_idx=0) -> int``: the layer's written logical length, an explicit
  integer (never inferred from tensor contents);
* ``key_length(num_new_tokens) -> int``: ``S_k``, the number of key slots the next ``update``
  of ``num_new_tokens`` rows returns (the model builds the attention mask over these slots
  from coordinates, M3.10 0x0A);
* ``abi``: the declared :class:`CacheABI`.

Families (M3.10 0x09 "Cache families preserve different contracts"):

* no cache: the runtime recomputes the committed prefix each call (``cache=None``; the
  reference answer) -- :func:`make_cache` returns ``None`` for ``"none"``;
* :class:`DynamicCache`: per-layer tensors grown by concatenation;
* :class:`StaticCache`: ``[B, H_kv, S, D]`` buffers reserved up front, written at explicit slots;
  explicit integers for committed and reserved length (``0 <= committed <= reserved``), a write
  past capacity refused before any slot is touched (``ResourceLimit("cache.capacity_exceeded")``),
  and :meth:`StaticCache.key_validity` (slots ``< committed + T``) so attention never reads an
  unwritten or stale slot (a finite score to a stale key would still change the softmax
  denominator).  :meth:`StaticCache.reset` makes a reused buffer forget every previous row.

The call ledger (both cached families, used by :mod:`decodespec.impl.runtime`): M3.10 0x08
"One model call prepares a complete logical state candidate".  :meth:`begin_call` opens one
call over ``[start, start + length)`` under generation ``g`` after checking the slot start
(``cache.slot_mismatch``) and the capacity (``cache.capacity_exceeded``); every layer's
``update`` records the interval and generation it actually wrote (the advancing-state-lane
roster, :meth:`lane_writes`); :meth:`commit_call` publishes the staged rows (the committed
length advances, the generation is the new one) only when every layer wrote exactly
``[start, start + length)`` under ``g``; :meth:`abandon_call` leaves the staged rows in place
(the handle is *dirty*: quarantined until :meth:`recover` crops every layer back to the proven
committed length under a new generation).  A dirty cache refuses a new call.

Source: M3.10 0x09 "KV cache implementation path", "Cache format is part of the model/runtime
boundary", "A cache is an ABI, not an untyped tuple", "Cache families preserve different
contracts" (``0 <= K_committed <= K_reserved <= K_max``); 0x0A "Logical recovery sockets"
(quarantine until recovery); HF ``transformers/cache_utils.py`` ``DynamicCache`` / ``StaticCache``
(``update``, ``get_seq_length``, ``crop``, ``reorder_cache``, ``reset``, ``index_copy_`` writes).

Size: the cache ABI and both cache families (dynamic, static) implement one stage / commit / crop
protocol (M3.10 0x09) and are read side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from decodespec.spec.errors import Rejection, ResourceLimit, register_code
from decodespec.spec.limits import CACHE_MEMORY_EXCEEDED, MAX_STATIC_CACHE_BYTES, static_cache_bytes
from decodespec.spec.positions import CACHE_CAPACITY_EXCEEDED, CACHE_SLOT_MISMATCH
from decodespec.spec.state import CACHE_FAMILIES  # the runtime offers every family of the envelope

__all__ = [
    "CACHE_ABI_MISMATCH",
    "CACHE_FAMILIES",
    "INVALID_CACHE_OPERATION",
    "CacheABI",
    "DynamicCache",
    "LaneWrite",
    "StaticCache",
    "check_static_reservation",
    "make_cache",
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

def check_static_reservation(abi: CacheABI, capacity: int, *, batch_size: int = 1, path: str = "$.cache.capacity") -> int:
    """The bytes a static cache of ``capacity`` slots reserves under ``abi``, refused past the declared bound.

    Returns:
        :func:`decodespec.spec.limits.static_cache_bytes` of the ABI's shape and dtype.

    Raises:
        ResourceLimit: ``cache.memory_exceeded`` when it exceeds
            :data:`decodespec.spec.limits.MAX_STATIC_CACHE_BYTES` (nothing is allocated).
    """
    dtype_bytes = torch.empty((), dtype=getattr(torch, abi.dtype)).element_size()
    need = static_cache_bytes(abi.num_layers, abi.num_key_value_heads, abi.head_dim, dtype_bytes, capacity, batch_size)
    if need > MAX_STATIC_CACHE_BYTES:
        raise ResourceLimit(CACHE_MEMORY_EXCEEDED, f"{capacity} static slots x {batch_size} rows reserve {need} bytes of K/V "
                            f"({abi.num_layers} layers x {abi.num_key_value_heads} heads x {abi.head_dim} x {abi.dtype}); the bound "
                            f"is {MAX_STATIC_CACHE_BYTES}", path, {"limit": MAX_STATIC_CACHE_BYTES, "actual": need})
    return need




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
    def for_config(cls, config, dtype: torch.dtype) -> CacheABI:
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

    def to_json(self) -> dict:
        """The ABI as a JSON object (snapshots and traces record it)."""
        out = attrs.asdict(self)
        out["rope_scaling"] = None if self.rope_scaling is None else list(self.rope_scaling)
        return out

    @classmethod
    def from_json(cls, obj: dict) -> CacheABI:
        """Inverse of :meth:`to_json`.

        Raises:
            Rejection: ``cache.abi_mismatch`` when ``obj`` is not an ABI object.
        """
        try:
            scaling = obj.get("rope_scaling")
            return cls(**{**obj, "rope_scaling": None if scaling is None else (str(scaling[0]), float(scaling[1]))})
        except (TypeError, KeyError, IndexError, ValueError, AttributeError) as exc:
            raise Rejection(CACHE_ABI_MISMATCH, f"not a cache ABI object: {exc}", "$.cache.abi") from None


@attrs.frozen
class LaneWrite:
    """What one layer's ``update`` wrote during the open call: slots ``[start, end)`` under ``generation``."""

    start: int
    end: int
    generation: int


@attrs.frozen
class _OpenCall:
    start: int
    length: int
    generation: int
    drop_layers: frozenset[int]


class _CacheLedger:
    """Shared explicit-integer bookkeeping of the cached families (see the module docstring).

    Subclasses keep per-layer written lengths in ``self._lengths`` and implement ``_store``
    (write rows of one layer) and ``_truncate`` (forget slots of one layer beyond a length).
    """

    family = "abstract"

    def __init__(self, abi: CacheABI):
        self.abi = abi
        self._lengths: list[int] = [0] * abi.num_layers
        self._committed = 0
        #: Generation of the committed rows (mutation ownership); advanced by the runtime.
        self.generation = 0
        self._call: _OpenCall | None = None
        self._writes: list[LaneWrite | None] = [None] * abi.num_layers

    # -- explicit integers ------------------------------------------------------------------
    @property
    def committed_length(self) -> int:
        """``K_committed``: slots holding committed rows of processed tokens (the K frontier)."""
        return self._committed

    @property
    def dirty(self) -> bool:
        """Whether some layer holds rows beyond the committed length (a failed or open call)."""
        return any(length != self._committed for length in self._lengths)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Written logical length of ``layer_idx`` (an explicit integer, never read from tensors)."""
        return self._lengths[layer_idx]

    def layer_lengths(self) -> tuple[int, ...]:
        """Written length of every layer, in layer order (all equal after a complete model call)."""
        return tuple(self._lengths)

    # -- the call ledger --------------------------------------------------------------------
    def check_call(self, start: int, length: int) -> None:
        """Refuse a call over ``[start, start + length)`` before anything is touched.

        Raises:
            Rejection: ``cache.invalid_operation`` while a call is open or the handle is dirty
                (quarantined: :meth:`recover` first), or for ``length < 1``;
                ``cache.slot_mismatch`` when ``start`` is not the committed length.
            ResourceLimit: ``cache.capacity_exceeded`` (static) when ``start + length`` exceeds
                the reserved slots.
        """
        if self._call is not None:
            raise Rejection(INVALID_CACHE_OPERATION, "a call is already open on this cache", "$.cache")
        if self.dirty:
            raise Rejection(INVALID_CACHE_OPERATION, f"the handle holds unselected rows (layer lengths {self.layer_lengths()}, "
                            f"committed {self._committed}); recover it first", "$.cache")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise Rejection(INVALID_CACHE_OPERATION, f"a call writes at least one row, got {length!r}", "$.cache.length")
        if start != self._committed:
            raise Rejection(CACHE_SLOT_MISMATCH, f"write starts at slot {start} but the committed frontier is {self._committed}",
                            "$.cache_position")
        self._check_capacity(start, length)

    def _check_capacity(self, start: int, length: int) -> None:
        return None

    def begin_call(self, start: int, length: int, generation: int, *, drop_layers: Sequence[int] = ()) -> None:
        """Open a call writing ``[start, start + length)`` under ``generation`` (checked by :meth:`check_call`).

        Args:
            drop_layers: Layers whose write is silently skipped (fault injection: a missing
                state lane; the layer still attends over its current rows).
        """
        self.check_call(start, length)
        self._call = _OpenCall(start, length, generation, frozenset(drop_layers))
        self._writes = [None] * self.abi.num_layers

    def lane_writes(self) -> tuple[LaneWrite | None, ...]:
        """Per layer, what the open (or just finished) call wrote, ``None`` for a layer that wrote nothing."""
        return tuple(self._writes)

    def complete_layers(self) -> int:
        """Layers that wrote exactly the open call's interval under its generation."""
        call = self._call
        if call is None:
            return 0
        want = LaneWrite(call.start, call.start + call.length, call.generation)
        return sum(1 for w in self._writes if w == want)

    def commit_call(self, generation: int) -> None:
        """Publish the open call's rows: committed length := call end, generation := ``generation``.

        Raises:
            AssertionError: when some layer did not write the call's interval (the runtime must
                select ALL_OLD then; publishing would be a bug).
        """
        call = self._call
        assert call is not None, "no open call to commit"
        assert self.complete_layers() == self.abi.num_layers, f"incomplete lane roster {self._writes}"
        self._committed = call.start + call.length
        self.generation = generation
        self._call = None

    def abandon_call(self) -> None:
        """Close the open call without publishing (ALL_OLD); staged rows stay until :meth:`recover`."""
        self._call = None

    def recover(self, generation: int) -> None:
        """Crop every layer back to the committed length and adopt ``generation`` (a recovery receipt).

        Raises:
            Rejection: ``cache.invalid_operation`` while a call is open, or when a layer holds fewer
                rows than the committed length (recovery only crops; such a handle lost committed
                rows and cannot be recovered); nothing changes.
        """
        if self._call is not None:
            raise Rejection(INVALID_CACHE_OPERATION, "cannot recover while a call is open", "$.cache")
        short = [i for i, length in enumerate(self._lengths) if length < self._committed]
        if short:
            raise Rejection(INVALID_CACHE_OPERATION, f"layer {short[0]} holds {self._lengths[short[0]]} rows, fewer than the committed "
                            f"{self._committed}: recovery only crops", "$.cache.layer_idx")
        for layer_idx in range(self.abi.num_layers):
            if self._lengths[layer_idx] > self._committed:
                self._truncate(layer_idx, self._committed)
        self.generation = generation

    # -- the model-facing update ------------------------------------------------------------
    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_position: torch.Tensor | None,
                      slot: int | None = None) -> int:
        """The refusals of :meth:`update` in their order; ``slot``: ``cache_position[0]`` given as an integer instead."""
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
        if str(key_states.dtype).removeprefix("torch.") != self.abi.dtype or value_states.dtype != key_states.dtype:
            raise Rejection(INVALID_CACHE_OPERATION, f"dtype {key_states.dtype} differs from the ABI's {self.abi.dtype}", "$.cache.update")
        batch = self.batch_size
        if batch is not None and batch != shape[0]:
            raise Rejection(INVALID_CACHE_OPERATION, f"batch {shape[0]} differs from the cached batch {batch}", "$.cache.update")
        start = self._lengths[layer_idx]
        call = self._call
        if call is not None and start != call.start:
            raise Rejection(CACHE_SLOT_MISMATCH, f"layer {layer_idx} holds {start} slots but the call writes from {call.start}", "$.cache_position")
        if cache_position is not None and cache_position.device.type == "cpu" and shape[2] and (
            int(cache_position[0]) != start or int(cache_position[-1]) != start + shape[2] - 1
        ):
            raise Rejection(CACHE_SLOT_MISMATCH, f"cache_position {cache_position.tolist()} does not continue layer {layer_idx} at slot {start}",
                            "$.cache_position")
        if slot is not None and slot != start:
            raise Rejection(CACHE_SLOT_MISMATCH, f"cache_position {slot} does not continue layer {layer_idx} at slot {start}", "$.cache_position")
        self._check_capacity(start, shape[2])
        return start

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_position: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's rotated keys and values for ``layer_idx``; return every slot attention reads.

        Args:
            key_states: ``[B, H_kv, T, D]`` keys after RoPE, in ``abi.dtype``.
            value_states: ``[B, H_kv, T, D]`` values.
            layer_idx: Layer index in ``[0, abi.num_layers)``.
            cache_position: ``int64[T]`` slots being written: ``get_seq_length(layer_idx) +
                arange(T)`` (values checked only on the CPU, where reading them costs no device
                synchronisation).

        Returns:
            ``(keys, values)``, each ``[B, H_kv, S_k, D]``: ``S_k = previous length + T`` for the
            dynamic cache, the capacity ``S`` for the static cache.

        Raises:
            Rejection: ``cache.invalid_operation`` for a bad layer index, shape, dtype or batch
                size; ``cache.slot_mismatch`` for a write that does not continue the layer.
            ResourceLimit: ``cache.capacity_exceeded`` (static) for a write past the reserved
                slots.  Nothing is stored when any of these is raised.
        """
        start = self._check_update(key_states, value_states, layer_idx, cache_position)
        num = key_states.shape[2]
        call = self._call
        if call is not None and layer_idx in call.drop_layers:
            return self._peek(key_states, value_states, layer_idx, start)
        keys, values = self._store(key_states, value_states, layer_idx, start)
        self.record_rows(layer_idx, start, num)
        return keys, values

    def record_rows(self, layer_idx: int, start: int, num: int) -> None:
        """Record that slots ``[start, start + num)`` of ``layer_idx`` now hold this call's rows.

        :meth:`update` calls it after storing; a kernel that writes the rows itself calls it
        after :meth:`StaticCache.reserve_row` and the write.
        """
        self._lengths[layer_idx] = start + num
        call = self._call
        if call is not None:
            self._writes[layer_idx] = LaneWrite(start, start + num, call.generation)
        elif layer_idx == self.abi.num_layers - 1:
            self._committed = self._lengths[layer_idx]  # unmanaged use: a complete forward commits

    def _store(self, key_states, value_states, layer_idx, start):  # pragma: no cover - abstract
        raise NotImplementedError

    def _peek(self, key_states, value_states, layer_idx, start):  # pragma: no cover - abstract
        raise NotImplementedError

    def _truncate(self, layer_idx: int, length: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def batch_size(self) -> int | None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- edits used by beams and by the runtime ---------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` slots of every layer (no-op for layers already that short).

        The committed length becomes ``min(committed, max_length)``.

        Raises:
            Rejection: ``cache.invalid_operation`` if ``max_length`` is negative or a call is open.

        Source: HF ``DynamicCache.crop`` (the non-negative branch).
        """
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise Rejection(INVALID_CACHE_OPERATION, f"crop length must be a non-negative int, got {max_length!r}", "$.cache.crop")
        if self._call is not None:
            raise Rejection(INVALID_CACHE_OPERATION, "cannot crop while a call is open", "$.cache.crop")
        for layer_idx, length in enumerate(self._lengths):
            if length > max_length:
                self._truncate(layer_idx, max_length)
        self._committed = min(self._committed, max_length)

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
        index = _check_beam_index(beam_idx, self.batch_size)
        for layer_idx, keys in enumerate(self.key_cache):  # type: ignore[attr-defined]
            if keys is None:
                continue
            rows = index.to(device=keys.device, dtype=torch.long)
            self.key_cache[layer_idx] = keys.index_select(0, rows)  # [B', H_kv, S, D]
            self.value_cache[layer_idx] = self.value_cache[layer_idx].index_select(0, rows)  # [B', H_kv, S, D]
        self._batch_changed(int(index.numel()))

    def _batch_changed(self, batch: int) -> None:
        return None

    # -- snapshots ---------------------------------------------------------------------------
    def committed_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``(keys, values)`` of the committed slots, ``[B, H_kv, K_committed, D]`` each (views).

        Raises:
            Rejection: ``cache.invalid_operation`` when the handle is dirty or empty.
        """
        if self.dirty or self._call is not None:
            raise Rejection(INVALID_CACHE_OPERATION, "the handle holds unselected rows; recover it before reading", "$.cache")
        out = []
        for layer_idx in range(self.abi.num_layers):
            keys, values = self._layer_tensors(layer_idx)
            if keys is None:
                raise Rejection(INVALID_CACHE_OPERATION, "the cache holds no rows", "$.cache")
            out.append((keys[..., : self._committed, :], values[..., : self._committed, :]))
        return out

    def load_committed(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]], *, generation: int) -> None:
        """Replace the contents by committed rows ``tensors`` (one ``(keys, values)`` per layer).

        Every layer must hold the same number of slots ``n``; the committed length becomes ``n``.

        Raises:
            Rejection: ``cache.invalid_operation`` for a wrong layer count, shape or dtype.
            ResourceLimit: ``cache.capacity_exceeded`` (static) when ``n`` exceeds the capacity.
            Nothing changes when one of these is raised.
        """
        if len(tensors) != self.abi.num_layers:
            raise Rejection(INVALID_CACHE_OPERATION, f"{len(tensors)} layers given, the ABI has {self.abi.num_layers}", "$.cache.layers")
        lengths = {k.shape[2] if k.dim() == 4 else -1 for k, _ in tensors}
        if len(lengths) != 1:
            raise Rejection(INVALID_CACHE_OPERATION, f"layers hold different slot counts {sorted(lengths)}", "$.cache.layers")
        if self._call is not None:
            raise Rejection(INVALID_CACHE_OPERATION, "cannot load while a call is open", "$.cache")
        probe = self._empty_like()  # the refusals of an update into an emptied cache, before this one is emptied
        for layer_idx, (keys, values) in enumerate(tensors):
            probe._check_update(keys, values, layer_idx, None)
        self.reset()
        for layer_idx, (keys, values) in enumerate(tensors):
            self._store(keys, values, layer_idx, 0)
            self._lengths[layer_idx] = keys.shape[2]
        self._committed = lengths.pop()
        self.generation = generation

    def _empty_like(self) -> _CacheLedger:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every row (lengths and committed length 0, no open call); storage may be kept."""
        self._lengths = [0] * self.abi.num_layers
        self._committed = 0
        self._call = None
        self._writes = [None] * self.abi.num_layers


class DynamicCache(_CacheLedger):
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
        super().__init__(abi)
        self.key_cache: list[torch.Tensor | None] = [None] * abi.num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * abi.num_layers

    def _store(self, key_states, value_states, layer_idx, start):
        old_keys = self.key_cache[layer_idx]
        if old_keys is None or start == 0:
            keys, values = key_states, value_states
        else:
            keys = torch.cat([old_keys, key_states], dim=-2)  # [B, H_kv, S + T, D]
            values = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)  # [B, H_kv, S + T, D]
        self.key_cache[layer_idx] = keys
        self.value_cache[layer_idx] = values
        return keys, values

    def _peek(self, key_states, value_states, layer_idx, start):
        old_keys = self.key_cache[layer_idx]
        if old_keys is None or start == 0:
            return key_states, value_states
        return torch.cat([old_keys, key_states], dim=-2), torch.cat([self.value_cache[layer_idx], value_states], dim=-2)

    def _truncate(self, layer_idx: int, length: int) -> None:
        self.key_cache[layer_idx] = self.key_cache[layer_idx][..., :length, :]  # [B, H_kv, length, D]
        self.value_cache[layer_idx] = self.value_cache[layer_idx][..., :length, :]  # [B, H_kv, length, D]
        self._lengths[layer_idx] = length

    def _layer_tensors(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def _empty_like(self) -> DynamicCache:
        return DynamicCache(self.abi)

    def reset(self) -> None:
        super().reset()
        self.key_cache = [None] * self.abi.num_layers
        self.value_cache = [None] * self.abi.num_layers

    def key_length(self, num_new_tokens: int) -> int:
        """``S_k``: key slots the next update of ``num_new_tokens`` rows returns (length + T)."""
        return self._lengths[0] + num_new_tokens

    @property
    def batch_size(self) -> int | None:
        """Rows B of the stored tensors, or ``None`` before the first update."""
        keys = self.key_cache[0]
        return None if keys is None else keys.shape[0]

    def nbytes(self) -> int:
        """Bytes of K and V payload held, ``2 * L_c * B * H_kv * S * D * itemsize``."""
        return sum(t.numel() * t.element_size() for t in (*self.key_cache, *self.value_cache) if t is not None)


class StaticCache(_CacheLedger):
    """Static full K/V cache: ``[B, H_kv, S, D]`` buffers reserved up front, rows written at explicit slots.

    ``committed_length <= capacity`` are explicit integers; :meth:`key_validity` marks the slots a
    call may read (``< committed + T``), everything else (unwritten or stale from an earlier
    request) is masked.  A write that would end past ``capacity`` is refused before any slot is
    touched.  :meth:`reset` (or reuse by a new request) forgets every row without clearing the
    buffers: their stale contents are never readable because validity comes from the integers.

    Args:
        abi: The ABI the model writes.
        capacity: ``S``, reserved slots (``>= 1``).
        batch_size: ``B`` (buffers are allocated at the first update, on its device).

    Shapes:
        ``key_cache[l]``, ``value_cache[l]``: ``[B, H_kv, S, D]`` in ``abi.dtype``.

    Raises:
        Rejection: ``cache.invalid_operation`` for a capacity below 1.

    Source: M3.10 0x09 "Static storage demonstrates why capacity and commitment differ"; HF
    ``StaticLayer.update`` (``index_copy_`` at ``cache_position``).
    """

    family = "static"

    def __init__(self, abi: CacheABI, capacity: int, *, batch_size: int = 1):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise Rejection(INVALID_CACHE_OPERATION, f"static capacity must be a positive int, got {capacity!r}", "$.cache.capacity")
        check_static_reservation(abi, capacity, batch_size=batch_size)
        super().__init__(abi)
        self.capacity = capacity
        self._batch = batch_size
        self.key_cache: list[torch.Tensor | None] = [None] * abi.num_layers
        self.value_cache: list[torch.Tensor | None] = [None] * abi.num_layers

    def _check_capacity(self, start: int, length: int) -> None:
        if start + length > self.capacity:
            raise ResourceLimit(
                CACHE_CAPACITY_EXCEEDED,
                f"write [{start}, {start + length}) exceeds the {self.capacity} reserved slots",
                "$.cache_position",
                details={"start": start, "length": length, "reserved": self.capacity},
            )

    def _buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.key_cache[layer_idx]
        if keys is None or keys.device != like.device:
            shape = (self._batch, self.abi.num_key_value_heads, self.capacity, self.abi.head_dim)
            self.key_cache[layer_idx] = keys = torch.zeros(shape, dtype=like.dtype, device=like.device)  # [B, H_kv, S, D]
            self.value_cache[layer_idx] = torch.zeros(shape, dtype=like.dtype, device=like.device)  # [B, H_kv, S, D]
        return keys, self.value_cache[layer_idx]

    def _store(self, key_states, value_states, layer_idx, start):
        keys, values = self._buffers(layer_idx, key_states)
        end = start + key_states.shape[2]
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys, values

    def reserve_row(self, layer_idx: int, slot: int, like: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """Check a write of ``like``'s rows to ``layer_idx`` as :meth:`update` would, without writing.

        For a kernel that writes the rotated key and value into the buffers itself (the native
        decode kernel): it writes slots ``[start, start + T)`` of the returned buffers and then
        calls :meth:`record_rows`.

        Args:
            layer_idx: As for :meth:`update`.
            slot: The first slot written (``cache_position[0]`` as an integer).
            like: ``[B, H_kv, T, D]`` in ``abi.dtype`` (shape and dtype only; values unused).

        Returns:
            ``(start, keys, values)`` with the layer's buffers ``[B, H_kv, S, D]``, or ``None``
            when the open call drops this layer's write (the caller then goes through
            :meth:`update`, which computes without storing).

        Raises:
            The refusals of :meth:`update`, before anything is touched.
        """
        start = self._check_update(like, like, layer_idx, None, slot)
        call = self._call
        if call is not None and layer_idx in call.drop_layers:
            return None
        keys, values = self._buffers(layer_idx, like)
        return start, keys, values

    def _peek(self, key_states, value_states, layer_idx, start):
        keys, values = self._buffers(layer_idx, key_states)
        end = start + key_states.shape[2]
        keys, values = keys.clone(), values.clone()
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys, values

    def _truncate(self, layer_idx: int, length: int) -> None:
        self._lengths[layer_idx] = length  # rows beyond stay in the buffer but are never valid

    def _layer_tensors(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def key_length(self, num_new_tokens: int) -> int:
        """``S_k = S``: attention reads every reserved slot, under :meth:`key_validity`."""
        return self.capacity

    def key_validity(self, num_new_tokens: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``bool[B, S]``: slot ``j`` is readable by the next call of ``num_new_tokens`` rows iff ``j < committed + T``.

        Derived from the explicit committed length (M3.10 0x09: unwritten or stale slots stay
        invisible even though the buffer holds values there); pass it as the model's
        ``attention_mask``.
        """
        end = self._committed + num_new_tokens
        valid = torch.arange(self.capacity, device=device) < end  # [S]
        return valid.expand(self._batch, self.capacity)  # [B, S]

    def _batch_changed(self, batch: int) -> None:
        self._batch = batch

    def _empty_like(self) -> StaticCache:
        return StaticCache(self.abi, self.capacity, batch_size=self._batch)

    @property
    def reserved_length(self) -> int:
        """``K_reserved = S``."""
        return self.capacity

    @property
    def batch_size(self) -> int | None:
        """Rows B of the buffers."""
        return self._batch

    def nbytes(self) -> int:
        """Reserved bytes of K and V buffers (allocated layers only)."""
        return sum(t.numel() * t.element_size() for t in (*self.key_cache, *self.value_cache) if t is not None)


def _check_beam_index(beam_idx: torch.Tensor | Sequence[int], batch: int | None) -> torch.Tensor:
    index = torch.as_tensor(beam_idx)
    if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise Rejection(INVALID_CACHE_OPERATION, f"beam_idx must be a 1-D integer tensor, got {tuple(index.shape)} {index.dtype}", "$.cache.beam_idx")
    if batch is None:
        raise Rejection(INVALID_CACHE_OPERATION, "cannot reorder an empty cache", "$.cache.beam_idx")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
        raise Rejection(INVALID_CACHE_OPERATION, f"beam_idx values must lie in [0, {batch})", "$.cache.beam_idx")
    return index


def make_cache(family: str, abi: CacheABI, *, capacity: int | None = None) -> DynamicCache | StaticCache | None:
    """A fresh cache of ``family``: ``None`` (no cache), :class:`DynamicCache` or :class:`StaticCache`.

    Raises:
        Rejection: ``cache.invalid_operation`` for an unknown family or a static cache without a
            positive ``capacity``.
    """
    if family == "none":
        return None
    if family == "dynamic":
        return DynamicCache(abi)
    if family == "static":
        if capacity is None:
            raise Rejection(INVALID_CACHE_OPERATION, "a static cache needs a capacity", "$.cache.capacity")
        return StaticCache(abi, capacity)
    raise Rejection(INVALID_CACHE_OPERATION, f"unknown cache family {family!r}; expected one of {CACHE_FAMILIES}", "$.cache.family")
