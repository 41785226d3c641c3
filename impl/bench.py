"""Greedy decode throughput of our runtime against HF transformers, and the memory-bandwidth bound.

One process loads SmolLM2 twice, into :class:`~decodespec.impl.model.LlamaForCausalLM` and into
HF's ``LlamaForCausalLM`` (from the same GGUF file), then times greedy generation of
``new_tokens`` tokens after the same ``prompt_len``-token prompt, batch 1.  What is timed:

* ``ours``: the runtime's own path, :func:`decodespec.impl.generate.generate` -- a
  :class:`~decodespec.impl.runtime.RequestRunner` with a static cache (``cache="static"``, the
  preallocated buffer) or a dynamic one, every token decided by the M3.8 policy twin with its
  receipt, the closed stage and lane rosters checked at every call -- no trace;
* ``ours_trace``: the same with the ``decodespec.events.v1`` trace written to a file
  (:class:`~decodespec.impl.events.FileSink`); its cost is reported as the paired median of
  ``time(trace) / time(no trace) - 1`` over the repetitions (the event-trace overhead);
* ``native`` / ``native_trace`` (float32 on the CPU where :mod:`decodespec.impl.native` runs):
  the same runtime with ``model.set_decode_kernel("native")``, every decode call's layers
  and ``lm_head`` in the C kernel (prefill stays on the torch path), without and
  with the event trace;
* ``ours_graph`` (CUDA only, or when asked): :func:`decodespec.impl.graphs.graph_greedy_generate`,
  the same forward with one decode step captured in a CUDA graph;
* ``hf``: ``generate(do_sample=False, max_new_tokens=...)``.

EOS is disabled everywhere, so each run produces exactly ``new_tokens`` tokens (the ids are
compared with ours and reported).  After a warm-up run of each, the runtimes alternate for
``repetitions`` rounds (background load hits all alike); tokens/s is ``new_tokens / wall time``
of the whole call (prefill included, device synchronised); medians are reported with the ratio
ours / HF, and the ratio of the best runs (the least disturbed on a shared machine).  Every
runtime runs with the same intra-op thread count (``threads``, reported): on a shared CPU a
second thread that is descheduled stalls every parallel region, so ``--threads 1`` is the
honest setting there.

The memory-bandwidth bound: a batch-1 decode step reads every weight matrix once, one
embedding row and the ``lm_head`` (:func:`decode_weight_bytes`).  Divided by a measured read
bandwidth (:func:`measure_read_bandwidth`: ``sum()`` over a buffer of the same byte count, and
a GEMV over a weight-shaped matrix of that size; the faster is taken, so the bound is an upper
bound), it gives the most tokens/s the hardware allows; ours is reported as a fraction of it.

Latency (issue 19, M3.10 0x0BA "Latency semantics"): every timed run also yields a
:class:`~decodespec.spec.latency.Timeline` -- ours from the runner's own record
(:mod:`decodespec.impl.latency`: each call stamped after its completion boundary, each published
stream chunk; our runs stream, with a no-op consumer), HF from forward hooks on its model (launch and
completion of each model call, the device synchronised) and a streamer that stamps each new token as
``generate`` hands it out, llama.cpp (when ``import llama_cpp`` works) from its token generator
(emissions only: its prefill and decode calls are not separable from outside, so its prefill rate
is not reported).  :func:`decodespec.spec.latency.request_latency` turns each into TTFT, every ITL,
E2E, prefill and decode time and the model-call count; reported per runtime: TTFT p50/p90/p99 over
the repetitions, ITL p50/p90/p99 over every token of every repetition, decode tokens/s without
the prefill (median over repetitions), prefill tokens/s, and the calls against
:func:`~decodespec.spec.latency.expected_calls`.  Ratios stay paired (same repetition).  Other
peers (vLLM) come in through ``extra_peers`` (``decodespec bench`` looks for an adapter hook); a
peer that is not installed is named with the reason in :attr:`BenchResult.absent`.

Timing is never asserted by tests: this is a script (``decodespec bench``) whose output is read.

Source: M3.10 0x08 "Quantifying projection reuse and retained state" (what a cached decode step
reads); M3.10 0x0A "Asynchronous completion and error boundaries" (timers synchronise the
device); M4 owns physical cost; HF ``GenerationMixin.generate`` (the peer).

Size: one benchmark run: the same ids and calls timed on every installed runtime (ours, HF,
llama.cpp, vLLM) so their ratios come from one run; each peer's timing needs its own loop.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from decodespec.spec.latency import QUANTILE_METHOD, CallTiming, Emission, Timeline, expected_calls, request_latency, summarize
from decodespec.spec.request import default_static_capacity

from .device import resolve_device
from .events import FileSink
from .generate import generate
from .model import LlamaForCausalLM

__all__ = [
    "BENCH_TEXT",
    "BOUND_METHOD",
    "LLAMACPP_ABSENT",
    "BenchResult",
    "PeerFactory",
    "decode_weight_bytes",
    "format_result",
    "measure_read_bandwidth",
    "run_benchmark",
]

#: Source text of the benchmark prompt (its first ``prompt_len`` SmolLM2 tokens are used).
BENCH_TEXT = (
    "The history of computing is a story of abstractions: vacuum tubes gave way to transistors, "
    "transistors to integrated circuits, and assembly language to compilers that let engineers "
    "describe what a program should do rather than how each register should move. Today a single "
    "chip holds billions of transistors, and the software that runs on it is built from layers of "
    "libraries, runtimes and operating systems, each hiding the details of the one below."
)


#: How the memory-bandwidth bound is obtained (printed with it).
BOUND_METHOD = ("bytes one batch-1 decode step reads (every layer weight, one embedding row, final norm, full lm_head) "
                "divided into the best measured read bandwidth of two methods: a streaming sum() over a buffer of that size "
                "and a GEMV over a weight-shaped matrix of that size")

#: Why llama.cpp is not in the run when ``llama_cpp`` cannot be imported.
LLAMACPP_ABSENT = "llama-cpp-python is not installed (DECODESPEC_LLAMACPP=1 .ci/setup builds it)"

#: ``factory(prompt_ids, new_tokens, threads) -> run``: a peer the bench can time; ``run()`` returns the
#: generated ids and the request's :class:`~decodespec.spec.latency.Timeline` (``None``: no latency record).  A ``run``
#: with the attribute ``out_of_process = True`` (vLLM's server) gets no CPU-time figure: this process's CPU time is not its work.
PeerFactory = Callable[[list[int], int, "int | None"], Callable[[], "tuple[tuple[int, ...], Timeline | None]"]]


@attrs.frozen
class BenchResult:
    """One benchmark run.

    Attributes:
        device, dtype: Where and in which dtype every runtime ran.
        prompt_len, new_tokens, repetitions: The workload (batch 1, greedy).
        ours_tokens_per_s, hf_tokens_per_s: Tokens/s of each timed repetition (ours: the
            runtime without a trace).
        same_tokens: Whether ours and HF generated the same ids.
        decode_weight_bytes: Bytes of weights one decode step reads.
        bandwidth_bytes_per_s: Measured read bandwidth per method (``sum``, ``gemv``).
        peak_memory: Bytes: ``ours_resident``/``hf_resident`` (parameters + buffers of each
            model), ``ours_cache`` (K/V buffers of our cache), on CUDA
            ``<runtime>_peak_allocated`` (peak allocated device memory during that runtime's
            timed runs), and ``process_peak_rss`` (the whole process, both models loaded).
        trace_tokens_per_s: Tokens/s of the runtime writing the event trace (empty: not timed).
        graph_tokens_per_s: Tokens/s of the captured-graph path (empty: not timed).
        same_tokens_graph: Whether the graph path generated our ids (``None``: not run).
        threads: Intra-op threads of every runtime (``torch.get_num_threads()`` during the runs).
        cache: Our cache family (``"static"`` or ``"dynamic"``).
        native_tokens_per_s, native_trace_tokens_per_s: Tokens/s of the runtime with the native
            decode kernel, without and with the event trace (empty: not timed).
        same_tokens_native: Whether the native kernel generated the torch path's ids (``None``: not run).
        bound_runs: The bandwidth bound re-measured right after each repetition's runs (tokens/s),
            so that each run has a bound measured under the same background load.
        cpu_tokens_per_s: With one thread on the CPU: per runtime (``ours``, ``trace``,
            ``native``, ``native_trace``, ``graph``, ``hf``), ``new_tokens / process CPU seconds`` of each timed run.  CPU time
            does not count the time the process waited for a core, so on a shared machine these
            ratios compare the work each runtime does (memory-bandwidth contention still shows).
        latency: Per runtime, one :meth:`decodespec.spec.latency.RequestLatency.to_json` per timed
            repetition (in repetition order; runtimes without a record are absent).
        peer_tokens_per_s: Whole-call tokens/s of each extra peer (llama.cpp, vLLM) per repetition.
        same_tokens_peers: Per extra peer, whether it generated our ids.
        absent: Peer name -> why it is not in the run (not installed).
        expected_calls: The model calls a conforming cached run of this workload makes
            (:func:`decodespec.spec.latency.expected_calls`).
    """

    device: str
    dtype: str
    prompt_len: int
    new_tokens: int
    repetitions: int
    ours_tokens_per_s: tuple[float, ...]
    hf_tokens_per_s: tuple[float, ...]
    same_tokens: bool
    decode_weight_bytes: int
    bandwidth_bytes_per_s: dict[str, float]
    peak_memory: dict[str, int]
    trace_tokens_per_s: tuple[float, ...] = ()
    graph_tokens_per_s: tuple[float, ...] = ()
    same_tokens_graph: bool | None = None
    threads: int | None = None
    cache: str = "static"
    cpu_tokens_per_s: dict[str, tuple[float, ...]] = attrs.field(factory=dict)
    bound_runs: tuple[float, ...] = ()
    native_tokens_per_s: tuple[float, ...] = ()
    native_trace_tokens_per_s: tuple[float, ...] = ()
    same_tokens_native: bool | None = None
    latency: dict[str, tuple[dict[str, Any], ...]] = attrs.field(factory=dict)
    peer_tokens_per_s: dict[str, tuple[float, ...]] = attrs.field(factory=dict)
    same_tokens_peers: dict[str, bool] = attrs.field(factory=dict)
    absent: dict[str, str] = attrs.field(factory=dict)
    expected_calls: dict[str, int] = attrs.field(factory=dict)

    def latency_summary(self, runtime: str) -> dict[str, Any] | None:
        """TTFT and ITL quantiles (ms), decode tokens/s without the prefill, prefill tokens/s and call counts of one runtime.

        ``ttft_ms``: :func:`~decodespec.spec.latency.summarize` over the repetitions' TTFT;
        ``itl_ms``: over every ITL of every repetition; ``decode_tokens_per_s`` /
        ``prefill_tokens_per_s`` / ``e2e_ms``: medians over repetitions (``None`` when not
        measured); ``calls``: the set of call counts seen (``[]``: not observable).  ``None``
        when the runtime has no latency record.
        """
        runs = self.latency.get(runtime)
        if not runs:
            return None

        def median_of(key: str, scale: float = 1.0) -> float | None:
            values = [r[key] * scale for r in runs if r.get(key) is not None]
            return statistics.median(values) if values else None

        return {
            "ttft_ms": summarize([r["ttft_ns"] / 1e6 for r in runs if r["ttft_ns"] is not None]),
            "itl_ms": summarize([x / 1e6 for r in runs for x in r["itl_ns"]]),
            "e2e_ms": median_of("e2e_ns", 1e-6),
            "decode_tokens_per_s": median_of("decode_tokens_per_s"),
            "prefill_tokens_per_s": median_of("prefill_tokens_per_s"),
            "calls": sorted({r["calls"] for r in runs if r["calls"]}),
        }

    def paired_decode_ratio(self, runtime: str, peer: str = "hf") -> float | None:
        """Median over repetitions of ``runtime``'s decode tokens/s (no prefill) / ``peer``'s in the same repetition."""
        a, b = self.latency.get(runtime, ()), self.latency.get(peer, ())
        pairs = [x["decode_tokens_per_s"] / y["decode_tokens_per_s"] for x, y in zip(a, b)
                 if x.get("decode_tokens_per_s") and y.get("decode_tokens_per_s")]
        return statistics.median(pairs) if pairs else None

    @property
    def decode_fraction_of_bound(self) -> float | None:
        """Our median decode tokens/s without the prefill as a fraction of the bound (``None``: not measured)."""
        summary = self.latency_summary("ours")
        if summary is None or summary["decode_tokens_per_s"] is None:
            return None
        return summary["decode_tokens_per_s"] / self.bound_tokens_per_s

    @property
    def ours_median(self) -> float:
        return statistics.median(self.ours_tokens_per_s)

    @property
    def hf_median(self) -> float:
        return statistics.median(self.hf_tokens_per_s)

    @property
    def ratio(self) -> float:
        """Ours / HF median tokens per second."""
        return self.ours_median / self.hf_median

    @property
    def ratio_best(self) -> float:
        """Ours / HF best (highest) tokens per second: the least disturbed runs on a shared machine."""
        return max(self.ours_tokens_per_s) / max(self.hf_tokens_per_s)

    @property
    def bound_tokens_per_s(self) -> float:
        """Memory-bandwidth bound: best measured read bandwidth / decode weight bytes."""
        return max(self.bandwidth_bytes_per_s.values()) / self.decode_weight_bytes

    @property
    def fraction_of_bound(self) -> float:
        return self.ours_median / self.bound_tokens_per_s

    @property
    def fraction_of_bound_best(self) -> float:
        """Our best run as a fraction of the bound."""
        return max(self.ours_tokens_per_s) / self.bound_tokens_per_s

    @property
    def fraction_of_bound_paired(self) -> float | None:
        """Median over repetitions of our tokens/s / the bound measured right after (``None`` without :attr:`bound_runs`)."""
        if not self.bound_runs:
            return None
        return statistics.median(ours / bound for ours, bound in zip(self.ours_tokens_per_s, self.bound_runs))

    @property
    def trace_overhead(self) -> float | None:
        """Event-trace cost as a fraction of generation time: the median over repetitions of
        ``time(trace) / time(no trace) - 1`` for the adjacent runs of one repetition (paired, so
        a burst of background load cancels); ``None`` when not timed."""
        if not self.trace_tokens_per_s:
            return None
        return statistics.median(plain / traced - 1.0 for plain, traced in zip(self.ours_tokens_per_s, self.trace_tokens_per_s))

    @property
    def trace_overhead_cpu(self) -> float | None:
        """:attr:`trace_overhead` from CPU times (``None`` without CPU-time figures)."""
        cpu = self.cpu_tokens_per_s
        if "trace" not in cpu:
            return None
        return statistics.median(plain / traced - 1.0 for plain, traced in zip(cpu["ours"], cpu["trace"]))

    @property
    def cpu_ratio(self) -> float | None:
        """Ours / HF median CPU-time tokens per second (``None`` without CPU-time figures)."""
        if not self.cpu_tokens_per_s:
            return None
        return statistics.median(self.cpu_tokens_per_s["ours"]) / statistics.median(self.cpu_tokens_per_s["hf"])

    @property
    def native_ratio(self) -> float | None:
        """Native-kernel / HF median tokens per second (``None``: not timed)."""
        return statistics.median(self.native_tokens_per_s) / self.hf_median if self.native_tokens_per_s else None

    @property
    def native_ratio_best(self) -> float | None:
        """Native-kernel / HF best tokens per second (``None``: not timed)."""
        return max(self.native_tokens_per_s) / max(self.hf_tokens_per_s) if self.native_tokens_per_s else None

    @property
    def native_fraction_of_bound(self) -> float | None:
        """Native-kernel median tokens/s as a fraction of the bound (``None``: not timed)."""
        return statistics.median(self.native_tokens_per_s) / self.bound_tokens_per_s if self.native_tokens_per_s else None

    @property
    def native_fraction_of_bound_paired(self) -> float | None:
        """Median over repetitions of native tokens/s / the bound measured right after (``None``: not timed)."""
        if not self.native_tokens_per_s or not self.bound_runs:
            return None
        return statistics.median(n / bound for n, bound in zip(self.native_tokens_per_s, self.bound_runs))

    @property
    def native_trace_overhead(self) -> float | None:
        """:attr:`trace_overhead` of the native-kernel runs (``None``: not timed)."""
        if not self.native_trace_tokens_per_s:
            return None
        return statistics.median(plain / traced - 1.0 for plain, traced in zip(self.native_tokens_per_s, self.native_trace_tokens_per_s))

    @property
    def graph_ratio(self) -> float | None:
        """Captured-graph path / HF median tokens per second (``None``: not timed)."""
        return statistics.median(self.graph_tokens_per_s) / self.hf_median if self.graph_tokens_per_s else None

    def to_json(self) -> dict[str, Any]:
        """Every field plus the derived medians, ratios, bound, fractions and trace overhead."""
        out = attrs.asdict(self)
        for name in ("ours_tokens_per_s", "hf_tokens_per_s", "trace_tokens_per_s", "graph_tokens_per_s", "native_tokens_per_s",
                     "native_trace_tokens_per_s"):
            out[name] = list(getattr(self, name))
        out["cpu_tokens_per_s"] = {k: list(v) for k, v in self.cpu_tokens_per_s.items()}
        out["bound_runs"] = list(self.bound_runs)
        out["latency"] = {k: list(v) for k, v in self.latency.items()}
        out["peer_tokens_per_s"] = {k: list(v) for k, v in self.peer_tokens_per_s.items()}
        out.update(
            latency_summary={k: self.latency_summary(k) for k in self.latency},
            paired_decode_ratio_over_hf={k: self.paired_decode_ratio(k) for k in self.latency if k != "hf"},
            decode_fraction_of_bound=self.decode_fraction_of_bound,
            bound_method=BOUND_METHOD,
            quantile_method=QUANTILE_METHOD,
            ours_median_tokens_per_s=self.ours_median,
            hf_median_tokens_per_s=self.hf_median,
            ratio_ours_over_hf=self.ratio,
            ratio_best_ours_over_hf=self.ratio_best,
            bound_tokens_per_s=self.bound_tokens_per_s,
            ours_fraction_of_bound=self.fraction_of_bound,
            ours_best_fraction_of_bound=self.fraction_of_bound_best,
            ours_fraction_of_bound_paired=self.fraction_of_bound_paired,
            trace_overhead=self.trace_overhead,
            ratio_graph_over_hf=self.graph_ratio,
            cpu_ratio_ours_over_hf=self.cpu_ratio,
            trace_overhead_cpu=self.trace_overhead_cpu,
            ratio_native_over_hf=self.native_ratio,
            ratio_best_native_over_hf=self.native_ratio_best,
            native_fraction_of_bound=self.native_fraction_of_bound,
            native_fraction_of_bound_paired=self.native_fraction_of_bound_paired,
            native_trace_overhead=self.native_trace_overhead,
        )
        return out


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one batch-1 decode step reads, in the model's dtype.

    Every 2-D weight matrix of the decoder layers once, every norm vector, one embedding row,
    and the ``lm_head`` matrix (read in full even when tied to the embedding).

    Units: bytes.
    """
    itemsize = model.dtype.itemsize
    layer_elems = sum(p.numel() for p in model.model.layers.parameters())
    embed_row = model.config.hidden_size
    head = model.lm_head.weight.numel()
    final_norm = model.model.norm.weight.numel()
    return (layer_elems + embed_row + head + final_norm) * itemsize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repetitions: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repetitions):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_read_bandwidth(nbytes: int, device: torch.device, dtype: torch.dtype, hidden_size: int, repetitions: int = 5) -> dict[str, float]:
    """Read bandwidth (bytes/s) of this machine for a working set of ``nbytes``.

    * ``sum``: ``buf.sum()`` over a float32 buffer of ``nbytes`` (a pure streaming read);
    * ``gemv``: ``W @ x`` with ``W`` ``[nbytes / (hidden_size * itemsize), hidden_size]`` in
      ``dtype`` (the access pattern of a decode step).

    Units: bytes per second (median of ``repetitions`` after one warm-up).
    """
    with torch.inference_mode():
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        read_sum = nbytes / _median_seconds(buf.sum, device, repetitions)
        del buf
        rows = max(nbytes // (hidden_size * dtype.itemsize), 1)
        weight = torch.ones(rows, hidden_size, dtype=dtype, device=device)
        vec = torch.ones(hidden_size, dtype=dtype, device=device)
        read_gemv = weight.numel() * dtype.itemsize / _median_seconds(functools.partial(torch.mv, weight, vec), device, repetitions)
        del weight
    return {"sum": read_sum, "gemv": read_gemv}


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's distinct parameters and buffers (tied tensors counted once)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[int]:
    """Run a block with ``count`` intra-op threads (``None``: as configured); yields the count in force."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class _HFTimer:
    """Times HF ``generate``: forward hooks stamp each model call, a streamer each new token (M3.10 0x0BA).

    The forward pre-hook stamps the launch, the forward hook the completion (after synchronising
    CUDA); the first call of a run is its prefill, the rest decode calls.  The streamer's first
    ``put`` is the prompt (skipped); each later ``put`` is one emission.  ``end`` is the final flush.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.active = False
        self._reset(0)
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.t0 = time.perf_counter_ns()
        self.calls: list[CallTiming] = []
        self.emissions: list[Emission] = []
        self.final: int | None = None
        self.prompt_seen = False
        self._launch: tuple[int, int] | None = None

    def _now(self) -> int:
        _sync(self.device)
        return time.perf_counter_ns() - self.t0

    def _pre(self, module, args, kwargs) -> None:
        if self.active:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._launch = (int(ids.shape[-1]) if ids is not None else 1, self._now())

    def _post(self, module, args, kwargs, output) -> None:
        if self.active and self._launch is not None:
            rows, start = self._launch
            self.calls.append(CallTiming("decode" if self.calls else "prefill", rows, start, self._now()))
            self._launch = None

    # The streamer protocol of transformers.generation.streamers.BaseStreamer.
    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        count = (self.emissions[-1].token_end if self.emissions else 0) + int(value.numel())
        self.emissions.append(Emission(self._now(), count))

    def end(self) -> None:
        self.final = self._now()

    @contextlib.contextmanager
    def timing(self, prompt_len: int) -> Iterator[_HFTimer]:
        self._reset(prompt_len)
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def timeline(self) -> Timeline:
        return Timeline(prompt_len=self.prompt_len, calls=tuple(self.calls), emissions=tuple(self.emissions), final_ns=self.final)


def llamacpp_peer(prompt_ids: list[int], new_tokens: int, threads: int | None) -> Callable[[], tuple[tuple[int, ...], Timeline | None]]:
    """The llama.cpp peer (``llama_cpp.Llama`` on the SmolLM2 GGUF file as stored, Q4_1, its own kernels).

    Greedy (``top_k=1``, ``temp=0``) through ``Llama.generate``, ``new_tokens`` tokens (it does not stop at
    EOS); each yielded token is one emission.  Its model calls are timed at ``Llama.eval`` (the instance's
    method wrapped: ``generate`` calls ``self.eval(tokens)``, one ``llama_decode`` per call, synchronous on the
    CPU, so its return is the completion boundary): the first call of a run is the prefill (its rows are the
    prompt), every later one a decode -- which gives llama.cpp's prefill rate and call count.

    Raises:
        ImportError: when llama-cpp-python is not installed.
    """
    import llama_cpp

    from .gguf import smollm2_path

    n = threads or 1
    llm = llama_cpp.Llama(model_path=str(smollm2_path()), n_ctx=len(prompt_ids) + new_tokens + 8, n_threads=n, n_threads_batch=n,
                          logits_all=False, seed=0, verbose=False)

    calls: list[CallTiming] = []
    t0 = 0
    untimed_eval = llm.eval

    def timed_eval(tokens: Any) -> None:
        start = time.perf_counter_ns() - t0
        untimed_eval(tokens)
        calls.append(CallTiming("decode" if calls else "prefill", len(tokens), start, time.perf_counter_ns() - t0))

    llm.eval = timed_eval

    def run() -> tuple[tuple[int, ...], Timeline | None]:
        nonlocal t0
        calls.clear()
        # A fresh request every repetition: without this, Llama.generate finds the prompt in its KV cache
        # (its prefix match, llama.py L:917-950) and skips the prefill, as an earlier bench did (TTFT 15 ms).
        llm.reset()
        llm._ctx.kv_cache_clear()
        t0 = time.perf_counter_ns()
        ids: list[int] = []
        emissions: list[Emission] = []
        for token in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ids.append(int(token))
            emissions.append(Emission(time.perf_counter_ns() - t0, len(ids)))
            if len(ids) >= new_tokens:
                break
        final = time.perf_counter_ns() - t0
        return tuple(ids), Timeline(prompt_len=len(prompt_ids), calls=tuple(calls), emissions=tuple(emissions), final_ns=final)

    return run


def run_benchmark(
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    prompt_len: int = 32,
    new_tokens: int = 128,
    repetitions: int = 5,
    threads: int | None = None,
    cache: str = "static",
    trace: bool = True,
    graph: bool | None = None,
    native: bool | None = None,
    llamacpp: bool | None = None,
    extra_peers: dict[str, PeerFactory] | None = None,
    absent: dict[str, str] | None = None,
) -> BenchResult:
    """Load both runtimes on SmolLM2 and time greedy decode (see the module docstring).

    Args:
        dtype, device: Of both models.
        prompt_len, new_tokens, repetitions: The workload.
        threads: Intra-op threads for every runtime (``None``: torch's setting).
        cache: Our cache family, ``"static"`` (default) or ``"dynamic"``.
        trace: Also time the runtime writing its event trace.
        graph: Also time the captured-graph path (default: on CUDA).
        native: Also time the native CPU decode kernel (default: float32 on the CPU where it
            runs; ``True`` elsewhere raises ``runtime.kernel_unavailable``).
        llamacpp: Also time llama.cpp (default: when ``llama_cpp`` imports; else it is named in
            :attr:`BenchResult.absent`).
        extra_peers: More peers by name (:data:`PeerFactory`), e.g. vLLM through an adapter hook.
        absent: Peers the caller looked for and did not find (name -> reason), reported as they are.

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed; ``runtime.invalid_device``.
        ImportError: when HF transformers is not installed.
    """
    import importlib.util

    from transformers import AutoModelForCausalLM, GenerationConfig

    from .gguf import smollm2_path
    from .graphs import GraphDecoder, graph_greedy_generate
    from .tokenizer import load_smollm2_tokenizer
    from .weights import load_smollm2

    target = resolve_device(device if not isinstance(device, torch.device) else str(device))
    graph = target.type == "cuda" if graph is None else graph
    path = smollm2_path()
    tokenizer = load_smollm2_tokenizer()
    prompt_ids = tokenizer.encode(BENCH_TEXT)[:prompt_len]
    if len(prompt_ids) < prompt_len:
        raise ValueError(f"BENCH_TEXT has only {len(prompt_ids)} tokens")
    ours = load_smollm2(dtype=dtype, device=target)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(target).eval()
    hf_config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    hf_input = torch.tensor([prompt_ids], device=target)
    hf_mask = torch.ones_like(hf_input)
    hf_timer = _HFTimer(hf, target)
    trace_dir = tempfile.TemporaryDirectory(prefix="decodespec-bench-")
    decoder = GraphDecoder(ours, prompt_len + new_tokens - 1) if graph else None
    if native is None:
        from .native import unavailable_reason

        native = target.type == "cpu" and dtype == torch.float32 and cache == "static" and unavailable_reason() is None
    if native:
        ours.set_decode_kernel("native")  # refuses (runtime.kernel_unavailable) before anything is timed
        ours.set_decode_kernel("torch")
    absent = dict(absent or {})
    peers: dict[str, Callable[[], tuple[tuple[int, ...], Timeline | None]]] = {}
    if llamacpp is None:
        llamacpp = importlib.util.find_spec("llama_cpp") is not None
        if not llamacpp:
            absent["llamacpp"] = LLAMACPP_ABSENT
    if llamacpp:
        peers["llamacpp"] = llamacpp_peer(list(prompt_ids), new_tokens, threads)
    for name, factory in (extra_peers or {}).items():
        peers[name] = factory(list(prompt_ids), new_tokens, threads)

    @contextlib.contextmanager
    def native_kernel() -> Iterator[None]:
        ours.set_decode_kernel("native")
        try:
            yield
        finally:
            ours.set_decode_kernel("torch")

    def ours_generate(sink: FileSink | None = None) -> tuple[tuple[int, ...], Timeline | None]:
        # Streamed (a no-op consumer): emissions are the published chunks, as a user of the stream sees them.
        result = generate(ours, prompt_ids, max_new_tokens=new_tokens, eos_token_ids=(), cache=cache, sink=sink, tokenizer=tokenizer,
                          stream=True, on_chunk=_discard)
        return result.output_ids, result.timeline

    def run_native() -> tuple[tuple[int, ...], Timeline | None]:
        with native_kernel():
            return run_ours()

    def run_native_trace() -> tuple[tuple[int, ...], Timeline | None]:
        with native_kernel():
            return run_trace()

    def run_ours() -> tuple[tuple[int, ...], Timeline | None]:
        return ours_generate()

    def run_trace() -> tuple[tuple[int, ...], Timeline | None]:
        with FileSink(Path(trace_dir.name) / "trace.ndjson") as sink:
            return ours_generate(sink)

    def run_graph() -> tuple[tuple[int, ...], Timeline | None]:
        return graph_greedy_generate(ours, prompt_ids, max_new_tokens=new_tokens, eos_token_ids=(), decoder=decoder).output_ids, None

    def run_hf() -> tuple[tuple[int, ...], Timeline | None]:
        with torch.inference_mode(), hf_timer.timing(prompt_len) as timer:
            out = hf.generate(hf_input, attention_mask=hf_mask, generation_config=hf_config, streamer=timer)
        return tuple(out[0, prompt_len:].tolist()), hf_timer.timeline()

    runtimes: dict[str, Callable[[], tuple[tuple[int, ...], Timeline | None]]] = {"ours": run_ours}
    if trace:
        runtimes["trace"] = run_trace
    if native:
        runtimes["native"] = run_native
        if trace:
            runtimes["native_trace"] = run_native_trace
    if graph:
        runtimes["graph"] = run_graph
    runtimes["hf"] = run_hf
    runtimes.update(peers)
    timings: dict[str, list[float]] = {name: [] for name in runtimes}
    cpu_timings: dict[str, list[float]] = {name: [] for name, fn in runtimes.items() if not getattr(fn, "out_of_process", False)}
    latency: dict[str, list[dict[str, Any]]] = {}
    weight_bytes = decode_weight_bytes(ours)
    bound_runs: list[float] = []
    peaks: dict[str, int] = {"ours_resident": _resident_bytes(ours), "hf_resident": _resident_bytes(hf)}
    with _threads(threads) as num_threads, trace_dir:
        ids = {name: fn()[0] for name, fn in runtimes.items()}  # warm-up (and the token comparison)
        assert all(len(v) == new_tokens for v in ids.values()), {k: len(v) for k, v in ids.items()}
        for _ in range(repetitions):
            for name, fn in runtimes.items():
                if target.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(target)
                _sync(target)
                start, cpu_start = time.perf_counter(), time.process_time()
                _, timeline = fn()
                _sync(target)
                timings[name].append(new_tokens / (time.perf_counter() - start))
                if name in cpu_timings:
                    cpu_timings[name].append(new_tokens / max(time.process_time() - cpu_start, 1e-9))
                if timeline is not None:
                    latency.setdefault(name, []).append(request_latency(timeline).to_json())
                if target.type == "cuda":
                    key = f"{name}_peak_allocated"
                    peaks[key] = max(peaks.get(key, 0), torch.cuda.max_memory_allocated(target))
            now = measure_read_bandwidth(weight_bytes, target, dtype, ours.config.hidden_size, repetitions=1)
            bound_runs.append(max(now.values()) / weight_bytes)
        bandwidth = measure_read_bandwidth(weight_bytes, target, dtype, ours.config.hidden_size)
    c = ours.config
    slots = default_static_capacity(prompt_len, new_tokens, c.max_position_embeddings) if cache == "static" else prompt_len + new_tokens - 1
    peaks["ours_cache"] = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * slots * dtype.itemsize
    peaks["process_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return BenchResult(
        device=str(target),
        dtype=str(dtype).removeprefix("torch."),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        repetitions=repetitions,
        ours_tokens_per_s=tuple(timings["ours"]),
        hf_tokens_per_s=tuple(timings["hf"]),
        same_tokens=ids["ours"] == ids["hf"],
        decode_weight_bytes=weight_bytes,
        bandwidth_bytes_per_s=bandwidth,
        peak_memory=peaks,
        trace_tokens_per_s=tuple(timings.get("trace", ())),
        graph_tokens_per_s=tuple(timings.get("graph", ())),
        same_tokens_graph=(ids["graph"] == ids["ours"]) if graph else None,
        threads=num_threads,
        cache=cache,
        cpu_tokens_per_s={k: tuple(v) for k, v in cpu_timings.items()} if target.type == "cpu" and num_threads == 1 else {},
        bound_runs=tuple(bound_runs),
        native_tokens_per_s=tuple(timings.get("native", ())),
        native_trace_tokens_per_s=tuple(timings.get("native_trace", ())),
        same_tokens_native=(ids["native"] == ids["ours"]) if native else None,
        latency={k: tuple(v) for k, v in latency.items()},
        peer_tokens_per_s={k: tuple(timings[k]) for k in peers},
        same_tokens_peers={k: ids[k] == ids["ours"] for k in peers},
        absent=absent,
        expected_calls=expected_calls(prompt_len, new_tokens),
    )


def _discard(chunk: Any) -> None:
    """The bench's stream consumer: takes each chunk, does nothing."""


def format_result(result: BenchResult) -> str:
    """Human-readable report of :func:`run_benchmark`."""
    mib = 1024 * 1024
    bw = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in result.bandwidth_bytes_per_s.items())
    peak = result.peak_memory

    def runs(label: str, values: tuple[float, ...]) -> str:
        return f"{label:<48}{statistics.median(values):8.2f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in values)})"

    device_peak = "; ".join(f"{k.removesuffix('_peak_allocated')} {v / mib:.1f} MiB" for k, v in peak.items() if k.endswith("_peak_allocated"))
    lines = [
        (f"greedy decode, batch 1, {result.prompt_len}-token prompt, {result.new_tokens} new tokens, {result.dtype} on {result.device}, "
        f"{result.threads} thread(s), median of {result.repetitions} alternating runs"),
        runs(f"ours (RequestRunner, {result.cache} cache, no trace):", result.ours_tokens_per_s),
    ]
    if result.trace_tokens_per_s:
        lines.append(f"{runs('ours + event trace (file):', result.trace_tokens_per_s)}   "
                     f"trace overhead {100 * result.trace_overhead:+.1f}% of generation time (paired median"
                     + (f"; {100 * result.trace_overhead_cpu:+.1f}% in CPU time)" if result.trace_overhead_cpu is not None else ")"))
    if result.native_tokens_per_s:
        lines.append(f"{runs('ours, native CPU decode kernel:', result.native_tokens_per_s)}   same tokens: {result.same_tokens_native}")
        if result.native_trace_tokens_per_s:
            lines.append(f"{runs('ours, native kernel + event trace (file):', result.native_trace_tokens_per_s)}   "
                         f"trace overhead {100 * result.native_trace_overhead:+.1f}% (paired median)")
    if result.graph_tokens_per_s:
        lines.append(f"{runs('ours, captured-graph decode:', result.graph_tokens_per_s)}   same tokens: {result.same_tokens_graph}; "
                     f"graph / HF {result.graph_ratio:.2f}x")
    lines += [
        runs("HF transformers generate:", result.hf_tokens_per_s),
        f"ratio ours / HF: {result.ratio:.3f} (medians), {result.ratio_best:.3f} (best runs)   same tokens: {result.same_tokens}",
    ]
    if result.native_tokens_per_s:
        lines.append(f"ratio ours with the native kernel / HF: {result.native_ratio:.3f} (medians), {result.native_ratio_best:.3f} (best runs)")
    if result.cpu_tokens_per_s:
        cpu = result.cpu_tokens_per_s
        lines.append("CPU-time tok/s (1 thread; not counting waits for a core): "
                     + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in cpu.items())
                     + f"; ratio ours / HF {result.cpu_ratio:.3f}")
    lines += _latency_lines(result)
    lines += [
        f"weights read per decode token: {result.decode_weight_bytes / mib:.1f} MiB; read bandwidth: {bw}",
        f"memory-bandwidth bound ({BOUND_METHOD}): {result.bound_tokens_per_s:.2f} tok/s; ours (whole call) at {100 * result.fraction_of_bound:.1f}% of it "
        f"(best run {100 * result.fraction_of_bound_best:.1f}%"
        + (f"; paired with a bound re-measured after each repetition: {100 * result.fraction_of_bound_paired:.1f}%)"
           if result.bound_runs else ")"),
        *([(f"native kernel at {100 * result.native_fraction_of_bound:.1f}% of the bound (paired: "
           f"{100 * result.native_fraction_of_bound_paired:.1f}%)")] if result.native_tokens_per_s and result.bound_runs else []),
        f"memory: weights+buffers ours {peak['ours_resident'] / mib:.1f} MiB (+ K/V cache {peak['ours_cache'] / mib:.1f} MiB), "
        f"HF {peak['hf_resident'] / mib:.1f} MiB; process peak RSS {peak['process_peak_rss'] / mib:.0f} MiB (both models)"
        + (f"; peak allocated during runs: {device_peak}" if device_peak else ""),
    ]
    return "\n".join(lines)


def cpu_model_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where that file is absent)."""
    import platform

    cpu = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine_name(device: torch.device) -> str:
    """The machine in words: CPU model, cores, the ATen CPU capability (and the GPU when ``device`` is CUDA)."""
    import os

    words = f"{cpu_model_name()}, {os.cpu_count()} cores, ATen {torch.backends.cpu.get_cpu_capability()}"
    if device.type == "cuda":
        words += f", {torch.cuda.get_device_name(device)}"
    return words


def row_scope_bench(model: LlamaForCausalLM, *, batch: int = 1, prompt_len: int = 256, repetitions: int = 7,
                    threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    """What selecting the decision row before ``lm_head`` saves in one prefill: bytes and time, paired in one run.

    Two prefills of the same ``[batch, prompt_len]`` ids, no cache: ``logits_to_keep=0`` (every
    row projected: a ``[B, S, V]`` logits tensor) and ``logits_to_keep=1`` (the last row selected
    before the projection: ``[B, 1, V]``); and the head alone on the same final hidden rows
    (``lm_head(hidden [B, S, d])`` vs ``lm_head(hidden[:, -1:])``).  The two variants alternate
    within each repetition (which one runs first alternates too), so background load hits both;
    the report gives each median and the median of the per-repetition ratios all / last.

    Returns:
        A JSON-ready dict: ``machine``, ``threads``, shapes, ``logits_bytes`` (all rows, last row,
        saved), ``head_macs`` (``R V d`` for R = B S and R = B), ``prefill_seconds`` and
        ``head_seconds`` (``all``, ``last``, ``ratio``: median paired ratio),
        ``last_row_max_abs_diff`` (the last row's logits in the two prefills: the same row through
        GEMMs of different shapes, so equal up to float rounding, not bitwise).

    Units: bytes, multiply-accumulates, seconds.

    Source: M3.8 0x0A "Output-row scope is an interface and cost boundary" (the ``[B, S, V]``
    tensor not produced; MACs ``R V d``), 0x06.
    """
    device = model.device
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    with _threads(threads) as used, torch.inference_mode():
        out_all = model(ids, logits_to_keep=0)
        out_last = model(ids, logits_to_keep=1)
        hidden = model(ids, logits_to_keep=1, return_hidden_states=True).hidden_states  # [B, S, d]
        diff = float((out_all.logits[:, -1].double() - out_last.logits[:, -1].double()).abs().max())
        all_bytes, last_bytes = out_all.logits.nbytes, out_last.logits.nbytes
        del out_all, out_last

        def timed(fn) -> float:
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            return time.perf_counter() - start

        runs: dict[str, list[float]] = {"prefill_all": [], "prefill_last": [], "head_all": [], "head_last": []}
        pairs = (("prefill_all", lambda: model(ids, logits_to_keep=0)), ("prefill_last", lambda: model(ids, logits_to_keep=1)),
                 ("head_all", lambda: model.lm_head(hidden)), ("head_last", lambda: model.lm_head(hidden[:, -1:])))
        for _, fn in pairs:
            fn()  # warm-up
        for r in range(repetitions):
            for a, b in ((0, 1), (2, 3)):
                order = (a, b) if r % 2 == 0 else (b, a)
                for k in order:
                    runs[pairs[k][0]].append(timed(pairs[k][1]))

    def summary(kind: str) -> dict[str, float]:
        all_t, last_t = runs[f"{kind}_all"], runs[f"{kind}_last"]
        return {"all": statistics.median(all_t), "last": statistics.median(last_t),
                "ratio": statistics.median(x / y for x, y in zip(all_t, last_t))}

    v, d = cfg.vocab_size, cfg.hidden_size
    return {
        "machine": machine_name(device), "threads": used, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
        "batch": batch, "prompt_len": prompt_len, "vocab_size": v, "hidden_size": d, "repetitions": repetitions,
        "logits_bytes": {"all_rows": all_bytes, "last_row": last_bytes, "saved": all_bytes - last_bytes},
        "head_macs": {"all_rows": batch * prompt_len * v * d, "last_row": batch * v * d},
        "prefill_seconds": summary("prefill"), "head_seconds": summary("head"), "last_row_max_abs_diff": diff,
    }


def format_row_scope(result: dict[str, Any]) -> str:
    """The row-scope report as text."""
    b, s, v = result["batch"], result["prompt_len"], result["vocab_size"]
    lb, p, h = result["logits_bytes"], result["prefill_seconds"], result["head_seconds"]
    return "\n".join([
        (f"row scope of one prefill, B={b} S={s} V={v} d={result['hidden_size']} {result['dtype']} on {result['device']} "
        f"({result['machine']}; {result['threads']} threads; {result['repetitions']} paired repetitions)"),
        (f"  logits produced: all rows [B,S,V] {lb['all_rows'] / 2**20:.2f} MiB, last row [B,1,V] {lb['last_row'] / 2**20:.4f} MiB "
        f"(saved {lb['saved'] / 2**20:.2f} MiB, {lb['all_rows'] // max(lb['last_row'], 1)}x)"),
        f"  head MACs: all rows {result['head_macs']['all_rows']:,}, last row {result['head_macs']['last_row']:,}",
        f"  prefill: all rows {p['all'] * 1e3:.1f} ms, last row {p['last'] * 1e3:.1f} ms, paired ratio {p['ratio']:.2f}x",
        f"  lm_head alone: all rows {h['all'] * 1e3:.2f} ms, last row {h['last'] * 1e3:.3f} ms, paired ratio {h['ratio']:.1f}x",
        f"  last row's logits, all-rows vs last-row prefill: max |diff| {result['last_row_max_abs_diff']:.3g}",
    ])


def _latency_lines(result: BenchResult) -> list[str]:
    """The latency table of :func:`format_result` (M3.10 0x0BA): per runtime TTFT / ITL quantiles, rates, calls."""

    def q(summary: dict[str, Any]) -> str:
        if not summary["n"]:
            return "-"
        return f"{summary['median']:.2f}/{summary['p90']:.2f}/{summary['p99']:.2f}"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    if not result.latency:
        return []
    lines = [(f"latency per request (TTFT over the {result.repetitions} runs, ITL over every token of every run; ms, p50/p90/p99; "
             f"rates: median over runs; decode tok/s excludes the prefill):"),
             f"  {'runtime':<14}{'TTFT ms':>26}{'ITL ms':>26}{'prefill tok/s':>15}{'decode tok/s':>14}{'calls':>8}  decode / HF (paired)"]
    expected = result.expected_calls.get("total")
    for name in result.latency:
        s = result.latency_summary(name)
        assert s is not None
        ratio = result.paired_decode_ratio(name) if name != "hf" else None
        calls = ",".join(str(c) for c in s["calls"]) or "n/a"
        lines.append(f"  {name:<14}{q(s['ttft_ms']):>26}{q(s['itl_ms']):>26}{rate(s['prefill_tokens_per_s']):>15}"
                     f"{rate(s['decode_tokens_per_s']):>14}{calls:>8}  {'' if ratio is None else f'{ratio:.3f}'}")
    lines.append(f"  model calls a conforming cached run makes: {expected} (1 prefill + {result.new_tokens} - 1 decode; "
                 "the last token is never processed)")
    if result.decode_fraction_of_bound is not None:
        lines.append(f"  ours, decode only (no prefill): {100 * result.decode_fraction_of_bound:.1f}% of the memory-bandwidth bound")
    for name, same in result.same_tokens_peers.items():
        lines.append(f"  {name}: whole-call {statistics.median(result.peer_tokens_per_s[name]):.2f} tok/s; same tokens as ours: {same}")
    for name, why in result.absent.items():
        lines.append(f"  {name}: not in this run -- {why}")
    return lines
