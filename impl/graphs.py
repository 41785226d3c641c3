"""M3.10 0x0A "Compilation makes shape and mutation assumptions executable": a captured greedy decode step.

On CUDA a batch-1 decode step of a 135M model is bound by kernel-launch and Python overhead, not
by the GPU.  :class:`GraphDecoder` captures one decode step of the ordinary
:meth:`LlamaForCausalLM.forward <decodespec.impl.model.LlamaForCausalLM.forward>` in a CUDA
graph and replays it at every position.  What the graph may assume is made explicit, as the
section requires:

* shapes: one decode graph for ``[1, 1]`` input (prefill is never captured; it runs eagerly);
* the write interval: the slot comes from a **device tensor** (``cache_position``), written with
  ``index_copy_`` (:class:`SlotStaticCache`), never from a Python integer baked in at capture;
* attention validity over the reserved slots: derived inside the graph from the same tensor
  (``slot <= cache_position``), so unwritten and stale slots stay invisible at every replay;
* the cache generation and committed length: explicit integers kept by the cache's call
  ledger outside the graph (``begin_call`` before a replay, :meth:`SlotStaticCache.record_replay`
  and ``commit_call`` after it); a capture in which some layer did not write exactly once is
  refused (``runtime.graph_capture_incomplete``).

Off CUDA the same step function runs eagerly (no capture), so the slot-indexed write, the
in-graph mask and the ledger are exercised by the CPU tests.  Selection is the runtime's greedy
rule (:func:`decodespec.impl.generate.select_greedy`: lowest id among the maxima, logprob from
the raw row), one host transfer per token (the completion boundary before commit).

This is a speed path for greedy decode only; the reference controller remains
:class:`~decodespec.impl.runtime.RequestRunner` (tests check that both commit the same ids).

Source: M3.10 0x0A "Compilation makes shape and mutation assumptions executable", "Asynchronous
completion and error boundaries"; HF ``cache_utils.StaticLayer.update`` (``index_copy_`` at
``cache_position``); pytorch-labs/gpt-fast ``generate.py`` (a static cache and a captured
decode step, ``mode="reduce-overhead"``); PyTorch ``torch.cuda.graphs`` (side-stream warm-up
before capture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence

import torch

from decodespec.spec.errors import Rejection, register_code

from .batch import closed_result, commit_triggers
from .cache import CacheABI, LaneWrite, StaticCache
from .generate import GenerationResult, select_greedy
from .model import LlamaForCausalLM
from .runtime import INVALID_REQUEST

__all__ = ["GRAPH_CAPTURE_INCOMPLETE", "GraphDecoder", "SlotStaticCache", "graph_greedy_generate"]

GRAPH_CAPTURE_INCOMPLETE = register_code(
    "runtime.graph_capture_incomplete",
    "rejection",
    "M3.10 0x0A Compilation makes shape and mutation assumptions executable",
    "A captured decode step did not write every cache-producing layer exactly once, so its replay cannot complete the lane roster.",
)


class SlotStaticCache(StaticCache):
    """A :class:`~decodespec.impl.cache.StaticCache` that can write rows at a device slot tensor.

    Outside :meth:`slot_writes` it is the ordinary static cache (prefill uses that path and
    allocates the buffers).  Inside, ``update`` writes ``key_states``/``value_states``
    ``[B, H_kv, T, D]`` at ``cache_position`` ``int64[T]`` with ``index_copy_`` (no host read of
    the slot, so a CUDA graph can replay the write at any position) and records which layers
    wrote; the call ledger is then advanced by :meth:`record_replay` after the step completed.
    """

    def __init__(self, abi: CacheABI, capacity: int, *, batch_size: int = 1):
        super().__init__(abi, capacity, batch_size=batch_size)
        self._slot_mode = False
        #: Layers that wrote during the last :meth:`slot_writes` block, in call order.
        self.slot_layers: list[int] = []

    @contextlib.contextmanager
    def slot_writes(self) -> Iterator[None]:
        """Within the block, ``update`` writes at the device ``cache_position`` (see the class docstring)."""
        self._slot_mode, self.slot_layers = True, []
        try:
            yield
        finally:
            self._slot_mode = False

    def update(self, key_states, value_states, layer_idx, cache_position=None):
        if not self._slot_mode:
            return super().update(key_states, value_states, layer_idx, cache_position)
        keys, values = self._buffers(layer_idx, key_states)  # [B, H_kv, S, D], allocated by the prefill
        keys.index_copy_(2, cache_position, key_states)
        values.index_copy_(2, cache_position, value_states)
        self.slot_layers.append(layer_idx)
        return keys, values

    def record_replay(self, start: int, length: int) -> None:
        """Record that the step just run wrote ``[start, start + length)`` in every layer under the open call's generation.

        Raises:
            AssertionError: when no call is open at ``start`` (the decoder's bug, not the caller's).
        """
        call = self._call
        assert call is not None and call.start == start and call.length == length, (call, start, length)
        for layer_idx in range(self.abi.num_layers):
            self._lengths[layer_idx] = start + length
            self._writes[layer_idx] = LaneWrite(start, start + length, call.generation)


class GraphDecoder:
    """Prefill eagerly, then decode one token per captured-graph replay (eager step off CUDA).

    Args:
        model: The decoder (any device and dtype; its attention implementation is used).
        capacity: Static cache slots ``S`` (prompt plus every decoded token).

    Attributes:
        cache: The :class:`SlotStaticCache` (its ledger holds the committed length and generation).
        use_graph: Whether decode steps replay a CUDA graph (``True`` on CUDA).
    """

    def __init__(self, model: LlamaForCausalLM, capacity: int):
        self.model = model
        device = model.device
        self.cache = SlotStaticCache(model.cache_abi, capacity)
        self.use_graph = device.type == "cuda"
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=device)  # [1, 1] static input
        self._position = torch.zeros((1,), dtype=torch.long, device=device)  # [1] the slot and position written
        self._slots = torch.arange(capacity, device=device)  # [S]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._row: torch.Tensor | None = None  # [V] the graph's static output

    def _step(self) -> torch.Tensor:
        mask = (self._slots <= self._position)[None]  # [1, S]: slot < P + 1, derived from the device slot
        out = self.model(self._ids, attention_mask=mask, past_key_values=self.cache, cache_position=self._position, logits_to_keep=1)
        return out.logits[0, -1]  # [V]

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Reset the cache and process the prompt in one eager call; returns the decision row ``[V]`` (model dtype)."""
        cache, length = self.cache, len(prompt_ids)
        cache.reset()
        cache.begin_call(0, length, 0)
        device = self.model.device
        with torch.inference_mode():
            out = self.model(torch.tensor([list(prompt_ids)], device=device), attention_mask=cache.key_validity(length, device),
                             past_key_values=cache, cache_position=torch.arange(length, device=device), logits_to_keep=1)
        assert cache.complete_layers() == cache.abi.num_layers
        cache.commit_call(1)
        return out.logits[0, -1]

    def decode(self, token_id: int) -> torch.Tensor:
        """Process ``token_id`` at the committed frontier P (slot and position P); returns the next decision row ``[V]``.

        The returned row is the graph's static output on CUDA: read it before the next call.

        Raises:
            ResourceLimit: ``cache.capacity_exceeded`` when P reaches the capacity (nothing written).
            Rejection: ``runtime.graph_capture_incomplete`` when the capture missed a layer.
        """
        cache = self.cache
        start, generation = cache.committed_length, cache.generation
        cache.begin_call(start, 1, generation)
        self._ids.fill_(token_id)
        self._position.fill_(start)
        with torch.inference_mode():
            if self.use_graph:
                if self._graph is None:
                    self._capture()
                assert self._graph is not None and self._row is not None
                self._graph.replay()
                row = self._row
            else:
                with cache.slot_writes():
                    row = self._step()
                self._check_layers()
        cache.record_replay(start, 1)
        cache.commit_call(generation + 1)
        return row

    def _check_layers(self) -> None:
        if sorted(self.cache.slot_layers) != list(range(self.cache.abi.num_layers)):
            self._graph = None
            raise Rejection(GRAPH_CAPTURE_INCOMPLETE, f"the step wrote layers {self.cache.slot_layers}", "$.graph")

    def _capture(self) -> None:
        """Warm up on a side stream, then capture one step (the open call's slot is the one written)."""
        cache = self.cache
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side), cache.slot_writes():
            for _ in range(2):
                self._step()
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with cache.slot_writes(), torch.cuda.graph(graph):
            self._row = self._step()
        self._graph = graph
        self._check_layers()


def graph_greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int] | None = None,
    decoder: GraphDecoder | None = None,
) -> GenerationResult:
    """Greedy generation through :class:`GraphDecoder`: same ids and frontier as the runtime's greedy run.

    Args:
        model: The decoder.
        prompt_ids: ``L >= 1`` ids.
        max_new_tokens: ``G >= 1``.
        eos_token_ids: Finish ids; default ``{model.config.eos_token_id}``; ``()`` disables.
        decoder: A decoder to reuse (its captured graph is kept across requests; capacity
            must hold ``L + G - 1`` slots); default a fresh one of exactly that capacity.

    Returns:
        A :class:`~decodespec.impl.generate.GenerationResult` (no receipts; ``rng_counter`` 0).

    Raises:
        Rejection: ``runtime.invalid_request`` for an empty prompt, an id outside ``[0, V)`` or
            ``G < 1``; ``runtime.graph_capture_incomplete``.
        ResourceLimit: ``cache.capacity_exceeded`` when a reused decoder is too small;
            ``model.context_window_exceeded`` past the model window.
    """
    vocab = model.config.vocab_size
    if not prompt_ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise Rejection(INVALID_REQUEST, f"prompt_ids must be 1 or more ids in [0, {vocab})", "$.prompt_ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise Rejection(INVALID_REQUEST, f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}", "$.max_new_tokens")
    if eos_token_ids is None:
        eos_token_ids = () if model.config.eos_token_id is None else (model.config.eos_token_id,)
    eos = frozenset(eos_token_ids)
    window = model.config.max_position_embeddings
    decoder = decoder or GraphDecoder(model, len(prompt_ids) + max_new_tokens - 1)
    row = decoder.prefill(prompt_ids)
    output_ids: list[int] = []
    logprobs: list[float] = []
    while True:
        token, logprob = select_greedy(row)  # one host transfer: the completion boundary
        output_ids.append(token)
        logprobs.append(logprob)
        triggers = commit_triggers(token, len(prompt_ids), len(output_ids), max_new_tokens, eos, window)
        if triggers:
            return closed_result(prompt_ids, output_ids, logprobs, triggers)
        row = decoder.decode(token)
