"""Tensor-parallel decode of one request over R gloo rank processes (torch.distributed), coordinated by the controller.

M3.10 0x0A "One request can still be model-parallel": a single request does not imply one
device.  Here one request's model call is spread over ``R`` rank processes joined by a
``torch.distributed`` gloo process group (no own communication layer: every reduction and the
logits gather are ``torch.distributed`` collectives); the process that owns the request
controller (:class:`~decodespec.impl.runtime.RequestRunner`, unchanged) talks to the ranks
through one control pipe each and never computes a layer.

Sharding (:func:`shard_plan`, Megatron-style; parameter names are :mod:`decodespec.impl.model`'s):

* attention: each rank owns *whole* K/V heads and the ``n_rep`` query heads of each of them
  (grouped-query attention needs a query head and its K/V head on one rank): ``q_proj`` /
  ``k_proj`` / ``v_proj`` rows of those heads, ``o_proj`` columns of those query heads; the
  partial ``o_proj`` outputs are summed (``all_reduce``).  ``R`` must not exceed ``H_kv``.
  SmolLM2 has 3 K/V heads: ``R = 3`` owns one each; ``R = 2`` uses the declared *uneven* split
  -- rank 0 owns K/V heads {0, 1} (query heads 0..5), rank 1 owns K/V head {2} (query heads
  6..8); the first ``H_kv mod R`` ranks own one head more.
* MLP: ``gate_proj`` / ``up_proj`` rows (column parallel) and ``down_proj`` columns (row
  parallel) of a contiguous range of the intermediate axis; partial outputs summed.
* vocabulary (M3.8 0x0A): the tied ``embed_tokens`` / ``lm_head`` matrix in contiguous row
  ranges; the embedding is looked up where owned (zero elsewhere) and summed, the head's local
  logits are gathered to rank 0 (``dist.gather``) and handed to the controller, which owns the
  policy (exact: the full row).  ``V`` must divide by ``R``.
* norms, RoPE tables and the residual stream are replicated.

Each rank keeps its own K/V shard: a :class:`~decodespec.impl.cache.DynamicCache` or
:class:`~decodespec.impl.cache.StaticCache` of the rank's ABI (its ``H_kv`` share), with the
same explicit ledger (committed frontier, open call, generation) as the single-process cache.
The controller sees a :class:`TPCache` whose every operation is sent to all ranks.

Participation (M3.10 0x0A: "the closed roster must agree on request, generation, position,
visibility, output owner, and completion event.  A missing participant or lane selects ALL_OLD
and supplies no consumable score"): every rank answers each call with its report -- rank,
request generation, ``[start, end)``, committed frontier before the call, completed stages, and
completed lanes (layers whose write matched the call).  :class:`TPModel` passes a stage to the
runner's stage roster only when *every* rank reports it, and :meth:`TPCache.complete_layers`
counts a lane only when every rank completed it at the same interval, generation and frontier;
anything less is ALL_OLD (``missing_lane`` / ``device_fault``).

No hang ("One rank exiting while peers enter another collective can hang the request"): every
wait is bounded.  Collectives have the gloo timeout ``timeout_s``; the controller polls the
pipes and the processes' liveness and gives a call at most :data:`CALL_TIMEOUT_S`.  A rank that dies (``device_error``), reports a failed or timed-out collective, or does not
answer in time (``timeout``) fails the call with :class:`~decodespec.impl.faults.ParticipantFailure`
(the runner's ``fault{device_fault}``, ALL_OLD); the whole group is then torn down (SIGTERM,
then SIGKILL, each join bounded) and respawned, and the committed K/V of every rank is rebuilt
by re-running the committed prefix once on the new group (a dead rank's shard is gone; the
staged rows of the failed call are never published).  Rank processes are daemonic, ask the
kernel to end them when the controller dies (``PR_SET_PDEATHSIG``) and are joined by
:meth:`TPGroup.close`; :func:`live_groups` lists what is still running.

Declared limits: batch 1, no prompt logprobs (the head's hidden rows stay on the ranks), no
native decode kernel, CPU (gloo) only.

Source: M3.10 0x0A "One request can still be model-parallel" and "Asynchronous completion and
error boundaries"; M3.8 0x0A "Vocabulary-parallel projection"; Megatron-LM
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` (the split);
PyTorch ``torch.distributed`` (gloo, ``all_reduce``, ``gather``, ``timeout``).

Size: one protocol: the coordinator and the rank processes exchange the same messages
(torch.distributed over gloo); both sides of each exchange are kept together.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import itertools
import os
import signal
import socket
import time
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from decodespec.spec.errors import DecodeSpecError, Rejection, register_code

from .cache import CacheABI, make_cache
from .faults import ParticipantFailure
from .model import CausalLMOutput, LlamaForCausalLM, build_attention_mask, signed_sine

__all__ = [
    "CALL_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "TP_UNSHARDABLE",
    "RankFault",
    "ShardPlan",
    "TPCache",
    "TPGroup",
    "TPModel",
    "live_groups",
    "shard_model",
    "shard_plan",
]

TP_UNSHARDABLE = register_code(
    "runtime.tp_unshardable",
    "rejection",
    "M3.10 0x0A One request can still be model-parallel",
    "A tensor-parallel world size the model's shapes do not admit: more ranks than K/V heads (a query head and its K/V "
    "head must share a rank), a vocabulary not divisible by the ranks, fewer than 2 ranks, or a dtype/device other than "
    "float32/bfloat16 on the CPU.",
)

#: Seconds a collective waits for its peers (gloo ``timeout``), unless ``DECODESPEC_TP_TIMEOUT_S`` says otherwise: a
#: peer computes at most one layer between two collectives, so a live rank is never this late; a stalled one is.
DEFAULT_TIMEOUT_S = 5.0
#: A call (or a cache operation) waits at most this many seconds for every rank's answer (a whole prefill on a busy
#: machine); a stalled rank is found sooner, by its peers' collective timeout.
CALL_TIMEOUT_S = 300.0
#: Seconds :meth:`TPGroup.close` gives a rank to exit after SIGTERM (then SIGKILL, again bounded).
JOIN_TIMEOUT_S = 5.0


def _timeout_s() -> float:
    return float(os.environ.get("DECODESPEC_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


# --------------------------------------------------------------------------------------------
# The shard plan and the shards.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ShardPlan:
    """Which rank owns what (see the module docstring).

    Attributes:
        world_size: R.
        kv_heads: Per rank, the K/V heads it owns (whole heads, contiguous, in order).
        q_heads: Per rank, the query heads it owns (the ``n_rep`` query heads of each of its K/V heads).
        ffn: Per rank, ``(start, end)`` of its intermediate range.
        vocab: Per rank, ``(start, end)`` of its vocabulary rows.
    """

    world_size: int
    kv_heads: tuple[tuple[int, ...], ...]
    q_heads: tuple[tuple[int, ...], ...]
    ffn: tuple[tuple[int, int], ...]
    vocab: tuple[tuple[int, int], ...]


def _ranges(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` contiguous ranges covering ``[0, total)``; the first ``total mod parts`` one longer."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for rank in range(parts):
        end = start + base + (1 if rank < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


def query_heads_of(kv_head: int, n_rep: int) -> tuple[int, ...]:
    """The query heads that read K/V head ``kv_head`` (HF ``repeat_kv``: query head ``h`` reads K/V head ``h // n_rep``)."""
    return tuple(kv_head * n_rep + i for i in range(n_rep))


def shard_plan(config, world_size: int) -> ShardPlan:
    """The tensor-parallel split of ``config`` over ``world_size`` ranks.

    Raises:
        Rejection: ``runtime.tp_unshardable`` when ``world_size < 2``, ``world_size > H_kv`` or
            ``V mod world_size != 0``.
    """
    kv, vocab = config.num_key_value_heads, config.vocab_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise Rejection(TP_UNSHARDABLE, f"tensor parallelism needs at least 2 ranks, got {world_size!r}", "$.runtime.world_size")
    if world_size > kv:
        raise Rejection(TP_UNSHARDABLE, f"{world_size} ranks cannot each own a whole K/V head of {kv}", "$.runtime.world_size")
    if vocab % world_size:
        raise Rejection(TP_UNSHARDABLE, f"vocabulary {vocab} does not split into {world_size} equal row ranges", "$.runtime.world_size")
    n_rep = config.num_key_value_groups
    kv_heads = tuple(tuple(range(a, b)) for a, b in _ranges(kv, world_size))
    q_heads = tuple(tuple(h for g in heads for h in query_heads_of(g, n_rep)) for heads in kv_heads)
    return ShardPlan(world_size, kv_heads, q_heads, _ranges(config.intermediate_size, world_size), _ranges(vocab, world_size))


def _rows(heads: Sequence[int], dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * dim, (h + 1) * dim) for h in heads])


def _local_config(config, plan: ShardPlan, rank: int):
    f0, f1 = plan.ffn[rank]
    v0, v1 = plan.vocab[rank]
    return attrs.evolve(config, num_attention_heads=len(plan.q_heads[rank]), num_key_value_heads=len(plan.kv_heads[rank]),
                        intermediate_size=f1 - f0, vocab_size=v1 - v0, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def shard_model(model: LlamaForCausalLM, plan: ShardPlan, rank: int) -> LlamaForCausalLM:
    """Rank ``rank``'s :class:`LlamaForCausalLM` of local sizes, holding exactly its shard of ``model``'s weights.

    Its ``q_proj`` / ``k_proj`` / ``v_proj`` hold the rows of the rank's heads, ``o_proj`` the
    columns of its query heads, ``gate_proj`` / ``up_proj`` the rows and ``down_proj`` the columns
    of its intermediate range, ``embed_tokens`` (= ``lm_head``, tied) its vocabulary rows; norms
    are copies.  Built in the controller before the ranks fork, so a rank inherits it without a copy.
    """
    config = model.config
    dim = config.head_dim
    local = LlamaForCausalLM(_local_config(config, plan, rank), device="meta")
    q_rows, kv_rows = _rows(plan.q_heads[rank], dim), _rows(plan.kv_heads[rank], dim)
    f0, f1 = plan.ffn[rank]
    v0, v1 = plan.vocab[rank]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if name.endswith(("self_attn.q_proj.weight",)):
            t = t[q_rows]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            t = t[kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            t = t[:, q_rows]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            t = t[f0:f1]
        elif name.endswith("mlp.down_proj.weight"):
            t = t[:, f0:f1]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[v0:v1]
        out[name] = t.contiguous().clone()
    local.to_empty(device="cpu")
    local.load_state_dict(out, strict=False)
    local.tie_weights()
    local.rebuild_fused_projections()
    return local.to(model.dtype).eval()


@functools.lru_cache(maxsize=4)
def _shards(model_ref: weakref.ref[LlamaForCausalLM], plan: ShardPlan) -> tuple[LlamaForCausalLM, ...]:
    model = model_ref()
    assert model is not None
    with torch.no_grad():
        return tuple(shard_model(model, plan, rank) for rank in range(plan.world_size))


# --------------------------------------------------------------------------------------------
# The rank process.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class RankFault:
    """An adversarial action on one rank in the next model call: ``kill`` (the process exits before ``layer``)
    or ``stall`` (it sleeps before ``layer`` until it is killed)."""

    rank: int
    how: str
    layer: int = 0


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (the controller) dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


#: Seconds this rank process spent inside collectives (``all_reduce``, ``gather``) since it started (the bench's
#: communication time; a list so the module global is mutated, never rebound).
_COMM_S = [0.0]


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (gloo ``all_reduce``)."""
    import torch.distributed as dist

    began = time.perf_counter()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    _COMM_S[0] += time.perf_counter() - began
    return tensor


def _rank_layer(layer, hidden: torch.Tensor, cos, signed_sin, mask, cache, cache_position) -> torch.Tensor:
    """One decoder layer on a rank: local heads' attention and local MLP slice, each partial output summed over ranks."""
    attn = layer.self_attn(layer.input_layernorm(hidden), cos, signed_sin, mask, cache, cache_position)  # [B, T, d] partial
    hidden = hidden + _all_reduce(attn)
    mlp = layer.mlp(layer.post_attention_layernorm(hidden))  # [B, T, d] partial
    return hidden + _all_reduce(mlp)


def _rank_forward(rank: int, plan: ShardPlan, model: LlamaForCausalLM, cache, input_ids: Sequence[int], start: int,
                  fault_layer: int | None, rank_fault: RankFault | None) -> tuple[list[str], torch.Tensor | None]:
    """One model call on one rank: ``(stages completed, full logits [V] of the last row on rank 0 else None)``."""
    import torch.distributed as dist

    inner = model.model
    stages: list[str] = []
    ids = torch.tensor([list(input_ids)], dtype=torch.long)  # [1, T]
    length = ids.shape[1]
    cache_position = torch.arange(start, start + length)  # [T]
    v0, v1 = plan.vocab[rank]
    local = ids - v0
    owned = (local >= 0) & (local < v1 - v0)  # [1, T]
    hidden = inner.embed_tokens(local.clamp(0, v1 - v0 - 1)) * owned[..., None].to(model.dtype)  # [1, T, d]: rows owned here
    _all_reduce(hidden)  # every row owned by exactly one rank
    stages.append("embed_tokens")
    if cache is not None:
        key_positions = torch.arange(cache.key_length(length))  # [S_k]
        validity = cache.key_validity(length) if cache.family == "static" else None
    else:
        key_positions, validity = cache_position, None
    mask = build_attention_mask(cache_position, key_positions, validity, model.dtype)
    cos, sin = inner.rotary_emb(cache_position.expand(1, length))
    cos, sin = cos.to(hidden.dtype).transpose(1, 2), sin.to(hidden.dtype).transpose(1, 2)  # [1, T, 1, D]
    signed_sin = signed_sine(sin)
    for idx, layer in enumerate(inner.layers):
        if fault_layer == idx:  # the declared device fault: every rank stops before the same layer (no collective left open)
            return stages, None
        if rank_fault is not None and rank_fault.rank == rank and rank_fault.layer == idx:
            if rank_fault.how == "kill":
                os._exit(17)
            time.sleep(3600.0)  # stall: the peers' collective times out; the controller kills this process
        hidden = _rank_layer(layer, hidden, cos, signed_sin, mask, cache, cache_position)
        stages.append(f"layers.{idx}")
    hidden = inner.norm(hidden[:, -1:, :])  # [1, 1, d]
    stages.append("norm")
    local_logits = model.lm_head(hidden).reshape(-1).contiguous()  # [V / R]
    gathered = [torch.empty_like(local_logits) for _ in range(plan.world_size)] if rank == 0 else None
    began = time.perf_counter()
    dist.gather(local_logits, gathered, dst=0)
    _COMM_S[0] += time.perf_counter() - began
    stages.append("lm_head")
    return stages, (torch.cat(gathered) if rank == 0 else None)


class _Rank:
    """The state of one rank process: its model shard and its K/V shards (one per controller cache handle)."""

    def __init__(self, rank: int, plan: ShardPlan, model: LlamaForCausalLM):
        self.rank, self.plan, self.model = rank, plan, model
        self.caches: dict[int, Any] = {}

    def report(self, handle: int | None) -> dict[str, Any]:
        cache = self.caches.get(handle) if handle is not None else None
        if cache is None:
            return {"rank": self.rank, "frontier": 0, "lanes": 0, "call": None, "generation": 0}
        call = cache._call
        return {"rank": self.rank, "frontier": cache.committed_length, "lanes": cache.complete_layers(), "generation": cache.generation,
                "call": None if call is None else (call.start, call.length, call.generation)}

    def handle(self, message: tuple) -> Any:
        op = message[0]
        if op == "forward":
            _, handle, input_ids, start, fault_layer, rank_fault = message
            cache = self.caches.get(handle) if handle is not None else None
            before = self.report(handle)
            began, comm = time.perf_counter(), _COMM_S[0]
            with torch.inference_mode():
                stages, logits = _rank_forward(self.rank, self.plan, self.model, cache, input_ids, start, fault_layer, rank_fault)
            return {"before": before, "after": self.report(handle), "stages": stages, "logits": logits,
                    "busy_s": time.perf_counter() - began, "comm_s": _COMM_S[0] - comm}
        if op == "new_cache":
            _, handle, family, capacity = message
            self.caches[handle] = make_cache(family, self.model.cache_abi, capacity=capacity)
            while len(self.caches) > 8:  # the controller holds a few handles at once (a runner, a restored copy)
                self.caches.pop(next(iter(self.caches)))
            return None
        if op == "drop_cache":
            self.caches.pop(message[1], None)
            return None
        if op == "cache":
            _, handle, method, args, kwargs = message
            cache = self.caches[handle]
            if method == "set_generation":
                cache.generation = args[0]
                return None
            if method == "commit_call":
                return _rank_commit(self.rank, cache, *args)
            attr = getattr(cache, method)
            return attr(*args, **kwargs) if callable(attr) else attr
        raise ValueError(f"unknown rank message {op!r}")


def _rank_commit(rank: int, cache, generation: int) -> None:
    """Publish the open call's rows on this rank's shard (the controller sends it only after ALL_NEW)."""
    cache.commit_call(generation)


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, plan: ShardPlan, model: LlamaForCausalLM, conn) -> None:
    """Entry of a rank process: join the gloo group, then answer the controller's messages until ``close``."""
    import torch.distributed as dist

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the controller, which closes the group
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - reported to the controller, typed there
        conn.send(("error", "device_error", f"rank {rank} could not join the group: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", "ready"))
    state = _Rank(rank, plan, model)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "close":
            break
        try:
            conn.send(("ok", state.handle(message)))
        except Exception as exc:  # noqa: BLE001 - a typed error or a failed collective, reported to the controller
            text = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, DecodeSpecError):  # sent as its fields: the exception's own pickling needs its message
                conn.send(("rejection", (type(exc), exc.code, exc.message, exc.path, exc.details)))
            else:
                conn.send(("error", "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "device_error", text))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The controller side.
# --------------------------------------------------------------------------------------------

_GROUPS: weakref.WeakSet[TPGroup] = weakref.WeakSet()


def live_groups() -> list[TPGroup]:
    """The groups whose rank processes are running now (tests check that none is left)."""
    return [g for g in list(_GROUPS) if g.alive()]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """R rank processes (forked from the controller) joined by a gloo group, and their control pipes.

    Args:
        model: The full model (its shards are cut once per plan and inherited by the forked ranks).
        world_size: R.
        timeout_s: The collectives' timeout (default ``$DECODESPEC_TP_TIMEOUT_S`` or :data:`DEFAULT_TIMEOUT_S`).

    Raises:
        Rejection: ``runtime.tp_unshardable`` (see :func:`shard_plan`).
    """

    def __init__(self, model: LlamaForCausalLM, world_size: int, timeout_s: float | None = None):
        if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
            raise Rejection(TP_UNSHARDABLE, f"the gloo tensor-parallel runtime runs float32/bfloat16 on the CPU, not {model.dtype} "
                            f"on {model.device}", "$.runtime.device")
        self.model = model
        self.plan = shard_plan(model.config, world_size)
        self.timeout_s = _timeout_s() if timeout_s is None else float(timeout_s)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.epoch = 0  # incremented at every (re)spawn: cache handles of an older epoch are rebuilt
        _GROUPS.add(self)

    # -- lifetime -------------------------------------------------------------------------
    def alive(self) -> bool:
        """Whether every rank process is running."""
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def start(self) -> None:
        """Fork the ranks and wait (bounded) until each has joined the group.

        Raises:
            ParticipantFailure: ``device_error`` / ``timeout`` when a rank cannot join.
        """
        import multiprocessing as mp

        self.close()
        shards = _shards(weakref.ref(self.model), self.plan)
        ctx = mp.get_context("fork")
        port = _free_port()
        procs, conns = [], []
        for rank in range(self.plan.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, self.plan.world_size, port, self.timeout_s, self.plan, shards[rank], child),
                               daemon=True, name=f"decodespec-tp-rank{rank}")
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        self.procs, self.conns = procs, conns
        self.epoch += 1
        self._gather(None, "join the group")

    def close(self) -> None:
        """End every rank process: ``close`` message, then SIGTERM, then SIGKILL, each join bounded."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError, BrokenPipeError):
                conn.send(("close",))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        self.procs, self.conns = [], []

    def __del__(self):  # pragma: no cover - garbage collection
        with contextlib.suppress(Exception):
            self.close()

    # -- messages -------------------------------------------------------------------------
    def ensure(self) -> bool:
        """Start the group unless it runs; returns whether it was (re)started."""
        if self.alive():
            return False
        self.start()
        return True

    def send_all(self, message: tuple, what: str) -> list[Any]:
        """Send ``message`` to every rank and return their answers in rank order (see :meth:`_gather`)."""
        self.ensure()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except (OSError, BrokenPipeError) as exc:
                self._fail("device_error", rank, f"{what}: rank {rank} cannot be reached ({exc})")
        return self._gather(message, what)

    def _gather(self, message: tuple | None, what: str) -> list[Any]:
        """Wait (bounded) for one answer from every rank.

        Raises:
            ParticipantFailure: ``device_error`` when a rank died or reported an error, ``timeout`` when a rank
                reported a timed-out collective or did not answer within :data:`CALL_TIMEOUT_S`;
                the group is closed first.
            Rejection: a typed error a rank raised (every rank raised it alike, e.g. ``cache.slot_mismatch``).
        """
        answers: list[Any] = [None] * len(self.conns)
        pending = set(range(len(self.conns)))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        rejection = None
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll(0):
                    try:
                        answer = conn.recv()
                    except (EOFError, OSError):
                        self._fail("device_error", rank, f"{what}: rank {rank} closed its pipe (exit code {self.procs[rank].exitcode})")
                    pending.discard(rank)
                    if answer[0] == "error":
                        self._fail(answer[1], rank, f"{what}: rank {rank}: {answer[2]}")
                    if answer[0] == "rejection":
                        cls, code, text, path, details = answer[1]
                        rejection = rejection or cls(code, text, path, details)
                    answers[rank] = answer[1] if answer[0] != "rejection" else None
                elif not self.procs[rank].is_alive():
                    self._fail("device_error", rank, f"{what}: rank {rank} exited with code {self.procs[rank].exitcode}")
            if not pending:
                break
            if time.monotonic() > deadline:
                late = sorted(pending)
                self._fail("timeout", late[0], f"{what}: ranks {late} did not answer within {CALL_TIMEOUT_S:g} s")
            for conn_ready in _wait([self.conns[r] for r in pending], 0.05):
                del conn_ready
        if rejection is not None:
            raise rejection
        return answers

    def _fail(self, reason: str, rank: int, message: str) -> None:
        self.close()
        raise ParticipantFailure(reason, rank, message)


def _wait(conns, timeout: float):
    from multiprocessing.connection import wait

    return wait(conns, timeout)


class _Observer:
    """``TPModel.model``: where the runner's stage roster attaches its observer (:class:`~decodespec.impl.model.StageObserver`)."""

    observer = None


class TPModel:
    """The model as the controller sees it: the forward runs on the ranks; same call signature as :class:`LlamaForCausalLM`.

    Only what :class:`~decodespec.impl.runtime.RequestRunner` uses is offered (``config``,
    ``device``, ``dtype``, ``cache_abi`` of the whole model, ``make_request_cache``, the call).

    Args:
        model: The full model (loaded by :mod:`decodespec.impl.weights` / :mod:`decodespec.impl.tiny`).
        world_size: R.
        timeout_s: The collectives' timeout.
    """

    def __init__(self, model: LlamaForCausalLM, world_size: int = 2, timeout_s: float | None = None):
        self.group = TPGroup(model, world_size, timeout_s)
        self.config = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.cache_abi = CacheABI.for_config(model.config, model.dtype)
        self.model = _Observer()
        #: The head's shape only (``[V, d]`` on the meta device): its rows live on the ranks.
        self.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False, device="meta")
        self.reports: list[list[dict[str, Any]]] = []  # per call, every rank's participation report (the latest few)
        self.rank_faults: list[RankFault] = []  # adversarial actions for the next call (consumed by it)
        #: Per call: (wall seconds in the controller, the busiest rank's seconds, mean seconds a rank spent in collectives).
        self.timing: list[tuple[float, float, float]] = []
        self._handles = itertools.count(1)

    @property
    def world_size(self) -> int:
        return self.group.plan.world_size

    def named_modules(self):
        """No module of the model lives in this process (the runner's training-mode check finds none)."""
        return iter(())

    def make_request_cache(self, family: str, *, capacity: int | None = None) -> TPCache | None:
        """The request's cache: one shard per rank (``None`` for the no-cache family)."""
        if family == "none":
            return None
        make_cache(family, self.cache_abi, capacity=capacity)  # the same refusals as the single-process cache, nothing allocated here
        return TPCache(self, family, capacity, next(self._handles))

    def close(self) -> None:
        """End the rank processes."""
        self.group.close()

    def __call__(self, input_ids: torch.Tensor, attention_mask=None, past_key_values: TPCache | None = None, cache_position=None,
                 logits_to_keep: int = 1, return_hidden_states: bool = False, **_: Any) -> CausalLMOutput:
        """One model call on every rank (batch 1, the last row's logits); the stage roster sees what every rank completed.

        Raises:
            ParticipantFailure: a rank died, stalled or failed (the runner's ``device_fault``).
            InjectedDeviceFault: through the stage observer at its ``fault_layer`` (every rank stopped before it).
        """
        if return_hidden_states or input_ids.shape[0] != 1:
            raise Rejection(TP_UNSHARDABLE, "the tensor-parallel runtime runs batch 1 without hidden-state rows", "$.input_ids")
        ids = [int(t) for t in input_ids[0]]
        start = int(cache_position[0]) if cache_position is not None else 0
        observer = self.model.observer
        fault_layer = None if observer is None else observer.fault_layer
        rank_fault = self.rank_faults.pop(0) if self.rank_faults else None
        cache = past_key_values
        handle = None
        if cache is not None:
            cache.sync()
            handle = cache.handle
        began = time.perf_counter()
        answers = self.group.send_all(("forward", handle, ids, start, fault_layer, rank_fault), "forward")
        self.timing.append((time.perf_counter() - began, max(a["busy_s"] for a in answers),
                            sum(a["comm_s"] for a in answers) / len(answers)))
        self.reports = (self.reports + [[{k: a[k] for k in ("before", "after", "stages")} for a in answers]])[-8:]
        if cache is not None:
            cache.staged(ids, answers)
        stage_lists = [a["stages"] for a in answers]
        common = [s for s, *rest in zip(*stage_lists) if all(r == s for r in rest)]
        if observer is not None:
            for stage in common:
                observer.completed(stage)
            if fault_layer is not None and len(common) == 1 + fault_layer:
                observer.fault(fault_layer)
        logits = answers[0]["logits"]
        if logits is None or "lm_head" not in common:
            raise ParticipantFailure("device_error", 0, f"the ranks' stage rosters disagree: {stage_lists}")
        return CausalLMOutput(logits=logits.view(1, 1, -1), past_key_values=cache)


class TPCache:
    """The controller's handle of one request's K/V, stored as one shard per rank (see the module docstring).

    Every ledger operation of :class:`~decodespec.impl.cache.DynamicCache` /
    :class:`~decodespec.impl.cache.StaticCache` that the runner, the snapshots and the adapter
    use is sent to all ranks; an integer they disagree on is reported as the least (the frontier
    every rank holds).  :meth:`committed_tensors` concatenates the ranks' K/V heads in the
    plan's order, :meth:`load_committed` splits them back.  After the group was respawned
    (:class:`TPGroup` ``epoch``) the committed prefix is recomputed on the new ranks
    (:meth:`sync`); the ids of committed rows are kept for it.
    """

    def __init__(self, model: TPModel, family: str, capacity: int | None, handle: int):
        self.tp, self.family, self.capacity, self.handle = model, family, capacity, handle
        self.abi = model.cache_abi
        self._epoch = -1
        self._base: list[tuple[torch.Tensor, torch.Tensor]] = []  # loaded committed rows (a restored snapshot)
        self._committed_ids: list[int] = []  # ids of the committed rows after the base
        self._generation = 0
        self._call: tuple[int, int, int] | None = None  # (start, length, generation) of the open call
        self._staged: list[int] | None = None
        self._lanes: int = 0
        self.sync()

    # -- ranks ----------------------------------------------------------------------------
    def _send(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        self.sync()
        return self.tp.group.send_all(("cache", self.handle, method, args, kwargs), f"cache.{method}")

    def sync(self) -> None:
        """Make sure the current group holds this handle's shards: after a respawn, rebuild the committed prefix.

        Raises:
            ParticipantFailure: the rebuild failed too.
        """
        group = self.tp.group
        group.ensure()
        if self._epoch == group.epoch:
            return
        self._epoch = group.epoch
        group.send_all(("new_cache", self.handle, self.family, self.capacity), "new_cache")
        if self._base:
            self._load(self._base, self._generation)
        if self._committed_ids:
            ids, start = list(self._committed_ids), self._base_length()
            group.send_all(("cache", self.handle, "begin_call", (start, len(ids), self._generation), {}), "rebuild.begin_call")
            group.send_all(("forward", self.handle, ids, start, None, None), "rebuild.forward")
            group.send_all(("cache", self.handle, "commit_call", (self._generation,), {}), "rebuild.commit_call")
        elif not self._base:
            group.send_all(("cache", self.handle, "set_generation", (self._generation,), {}), "rebuild.generation")

    def staged(self, ids: list[int], answers: list[dict[str, Any]]) -> None:
        """Record a forward's reports: the lanes every rank completed at the same call and frontier (else none)."""
        self._staged = ids
        calls = {a["after"]["call"] for a in answers}
        frontiers = {a["before"]["frontier"] for a in answers}
        lanes = [a["after"]["lanes"] for a in answers]
        agree = len(calls) == 1 and len(frontiers) == 1 and self._call is not None and calls == {self._call}
        self._lanes = min(lanes) if agree else 0

    # -- the ledger -----------------------------------------------------------------------
    def begin_call(self, start: int, length: int, generation: int, *, drop_layers: Sequence[int] = ()) -> None:
        self._send("begin_call", start, length, generation, drop_layers=tuple(drop_layers))
        self._call, self._staged, self._lanes = (start, length, generation), None, 0

    def complete_layers(self) -> int:
        """Layers every rank wrote at the open call's interval, generation and frontier (0 on any disagreement)."""
        return self._lanes if self._call is not None and self._staged is not None else 0

    def commit_call(self, generation: int) -> None:
        assert self._call is not None and self._staged is not None, "no completed call to commit"
        self._send("commit_call", generation)
        self._committed_ids = self._committed_ids[: self._call[0] - self._base_length()] + list(self._staged)
        self._generation, self._call, self._staged = generation, None, None

    def abandon_call(self) -> None:
        self._call, self._staged = None, None
        with contextlib.suppress(ParticipantFailure):  # a dead group holds no open call; sync rebuilds it
            self._send("abandon_call")

    def recover(self, generation: int) -> None:
        self._send("recover", generation)
        self._generation = generation

    def reset(self) -> None:
        self._send("reset")
        self._base, self._committed_ids, self._call, self._staged, self._generation = [], [], None, None, 0

    def load_committed(self, tensors, *, generation: int) -> None:
        """Split each layer's ``[1, H_kv, P, D]`` K and V over the ranks by the plan's K/V heads and load them.

        The tensors are kept as the base of a rebuild (a snapshot's rows: their ids are not the cache's to know).
        """
        self.sync()
        self._load(tensors, generation)
        self._base, self._committed_ids, self._generation = list(tensors), [], generation

    def _load(self, tensors, generation: int) -> None:
        group = self.tp.group
        for rank, conn in enumerate(group.conns):
            heads = list(group.plan.kv_heads[rank])
            shard = [(k[:, heads].contiguous(), v[:, heads].contiguous()) for k, v in tensors]
            conn.send(("cache", self.handle, "load_committed", (shard,), {"generation": generation}))
        group._gather(None, "cache.load_committed")

    def _base_length(self) -> int:
        return self._base[0][0].shape[2] if self._base else 0

    def committed_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(K, V)`` ``[1, H_kv, P, D]``: the ranks' shards concatenated in K/V-head order."""
        shards = self._send("committed_tensors")
        order = [h for heads in self.tp.group.plan.kv_heads for h in heads]
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out = []
        for layer in range(self.abi.num_layers):
            k = torch.cat([s[layer][0] for s in shards], dim=1)[:, inverse]
            v = torch.cat([s[layer][1] for s in shards], dim=1)[:, inverse]
            out.append((k, v))
        return out

    @property
    def generation(self) -> int:
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        self._send("set_generation", value)
        self._generation = value

    @property
    def committed_length(self) -> int:
        return min(self._send("committed_length"))

    @property
    def dirty(self) -> bool:
        return any(self._send("dirty"))

    @property
    def reserved_length(self) -> int:
        """Reserved slots (static family only: elsewhere the attribute does not exist, as on a dynamic cache)."""
        if self.family != "static":
            raise AttributeError("reserved_length")
        return min(self._send("reserved_length"))

    def layer_lengths(self) -> tuple[int, ...]:
        return tuple(min(ls) for ls in zip(*self._send("layer_lengths")))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self._send("get_seq_length", layer_idx))

    def key_validity(self, num_new_tokens: int, device=None) -> torch.Tensor:
        return self._send("key_validity", num_new_tokens)[0]

    def key_length(self, num_new_tokens: int) -> int:
        return min(self._send("key_length", num_new_tokens))

    @property
    def batch_size(self) -> int | None:
        return self._send("batch_size")[0]

    def nbytes(self) -> int:
        return sum(self._send("nbytes"))
