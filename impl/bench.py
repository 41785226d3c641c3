"""Greedy decode throughput of our decoder against HF transformers, and the memory-bandwidth bound.

One process loads SmolLM2 twice, into :class:`~decodespec.impl.model.LlamaForCausalLM` and into
HF's ``LlamaForCausalLM`` (from the same GGUF file), then times greedy generation of
``new_tokens`` tokens after the same ``prompt_len``-token prompt, batch 1: ours with
:func:`~decodespec.impl.generate.greedy_generate`, HF with ``generate(do_sample=False,
max_new_tokens=...)``.  EOS is disabled in both, so both produce exactly ``new_tokens`` tokens
(their ids are compared and reported).  After a warm-up run of each, the runtimes alternate for
``repetitions`` rounds (so background load hits both alike); tokens/s is
``new_tokens / wall time`` of the whole call (prefill included, device synchronised), and the
median is reported with the ratio ours / HF (and the ratio of the best runs, the least
disturbed on a shared machine).

The memory-bandwidth bound: a batch-1 decode step reads every weight matrix once, one
embedding row and the ``lm_head`` (:func:`decode_weight_bytes`).  Divided by a measured read
bandwidth (:func:`measure_read_bandwidth`: ``sum()`` over a buffer of the same byte count, and
a GEMV over a weight-shaped matrix of that size; the faster is taken, so the bound is an upper
bound), it gives the most tokens/s the hardware allows; ours is reported as a fraction of it.

Timing is never asserted by tests: this is a script (``decodespec bench``) whose output is read.

Source: M3.10 0x08 "Quantifying projection reuse and retained state" (what a cached decode step
reads); M4 owns physical cost; HF ``GenerationMixin.generate`` (the peer).
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import attrs
import torch

from .device import resolve_device
from .generate import greedy_generate
from .model import LlamaForCausalLM

__all__ = [
    "BenchResult",
    "BENCH_TEXT",
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


@attrs.frozen
class BenchResult:
    """One benchmark run.

    Attributes:
        device, dtype: Where and in which dtype both runtimes ran.
        prompt_len, new_tokens, repetitions: The workload (batch 1, greedy).
        ours_tokens_per_s, hf_tokens_per_s: Tokens/s of each timed repetition.
        same_tokens: Whether both runtimes generated the same ids.
        decode_weight_bytes: Bytes of weights one decode step reads.
        bandwidth_bytes_per_s: Measured read bandwidth per method (``sum``, ``gemv``).
        peak_memory: Bytes: ``ours_resident``/``hf_resident`` (parameters + buffers of each
            model), on CUDA ``ours_peak_allocated``/``hf_peak_allocated`` (peak allocated device
            memory during each runtime's timed runs), and ``process_peak_rss`` (the whole
            process, both models loaded).
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

    def to_json(self) -> dict[str, Any]:
        """Every field plus the derived medians, ratio, bound and fraction."""
        out = attrs.asdict(self)
        out["ours_tokens_per_s"] = list(self.ours_tokens_per_s)
        out["hf_tokens_per_s"] = list(self.hf_tokens_per_s)
        out.update(
            ours_median_tokens_per_s=self.ours_median,
            hf_median_tokens_per_s=self.hf_median,
            ratio_ours_over_hf=self.ratio,
            ratio_best_ours_over_hf=self.ratio_best,
            bound_tokens_per_s=self.bound_tokens_per_s,
            ours_fraction_of_bound=self.fraction_of_bound,
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
        read_gemv = weight.numel() * dtype.itemsize / _median_seconds(lambda: torch.mv(weight, vec), device, repetitions)
        del weight
    return {"sum": read_sum, "gemv": read_gemv}


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's distinct parameters and buffers (tied tensors counted once)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_benchmark(
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    prompt_len: int = 32,
    new_tokens: int = 128,
    repetitions: int = 5,
) -> BenchResult:
    """Load both runtimes on SmolLM2 and time greedy decode (see the module docstring).

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed; ``runtime.invalid_device``.
        ImportError: when HF transformers is not installed.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .gguf import smollm2_path
    from .tokenizer import load_smollm2_tokenizer
    from .weights import load_smollm2

    target = resolve_device(device if not isinstance(device, torch.device) else str(device))
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

    def run_ours() -> tuple[int, ...]:
        return greedy_generate(ours, prompt_ids, max_new_tokens=new_tokens, eos_token_ids=()).output_ids

    def run_hf() -> tuple[int, ...]:
        with torch.inference_mode():
            out = hf.generate(hf_input, attention_mask=hf_mask, generation_config=hf_config)
        return tuple(out[0, prompt_len:].tolist())

    ours_ids, hf_ids = run_ours(), run_hf()  # warm-up (and the token comparison)
    assert len(ours_ids) == len(hf_ids) == new_tokens, (len(ours_ids), len(hf_ids))
    timings: dict[str, list[float]] = {"ours": [], "hf": []}
    peaks: dict[str, int] = {"ours_resident": _resident_bytes(ours), "hf_resident": _resident_bytes(hf)}
    for _ in range(repetitions):
        for name, fn in (("ours", run_ours), ("hf", run_hf)):
            if target.type == "cuda":
                torch.cuda.reset_peak_memory_stats(target)
            _sync(target)
            start = time.perf_counter()
            fn()
            _sync(target)
            timings[name].append(new_tokens / (time.perf_counter() - start))
            if target.type == "cuda":
                key = f"{name}_peak_allocated"
                peaks[key] = max(peaks.get(key, 0), torch.cuda.max_memory_allocated(target))
    weight_bytes = decode_weight_bytes(ours)
    bandwidth = measure_read_bandwidth(weight_bytes, target, dtype, ours.config.hidden_size)
    peaks["process_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return BenchResult(
        device=str(target),
        dtype=str(dtype).removeprefix("torch."),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        repetitions=repetitions,
        ours_tokens_per_s=tuple(timings["ours"]),
        hf_tokens_per_s=tuple(timings["hf"]),
        same_tokens=ours_ids == hf_ids,
        decode_weight_bytes=weight_bytes,
        bandwidth_bytes_per_s=bandwidth,
        peak_memory=peaks,
    )


def format_result(result: BenchResult) -> str:
    """Human-readable report of :func:`run_benchmark`."""
    mib = 1024 * 1024
    bw = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in result.bandwidth_bytes_per_s.items())
    peak = result.peak_memory
    device_peak = (
        f"; peak allocated during runs: ours {peak['ours_peak_allocated'] / mib:.1f} MiB, HF {peak['hf_peak_allocated'] / mib:.1f} MiB"
        if "ours_peak_allocated" in peak
        else ""
    )
    lines = [
        f"greedy decode, batch 1, {result.prompt_len}-token prompt, {result.new_tokens} new tokens, {result.dtype} on {result.device}, "
        f"median of {result.repetitions}",
        f"ours: {result.ours_median:8.2f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in result.ours_tokens_per_s)})",
        f"HF:   {result.hf_median:8.2f} tok/s   (runs: {', '.join(f'{x:.1f}' for x in result.hf_tokens_per_s)})",
        f"ratio ours / HF: {result.ratio:.3f} (medians), {result.ratio_best:.3f} (best runs)   same tokens: {result.same_tokens}",
        f"weights read per decode token: {result.decode_weight_bytes / mib:.1f} MiB; read bandwidth: {bw}",
        f"memory-bandwidth bound: {result.bound_tokens_per_s:.2f} tok/s; ours at {100 * result.fraction_of_bound:.1f}% of it",
        f"memory: weights+buffers ours {peak['ours_resident'] / mib:.1f} MiB, HF {peak['hf_resident'] / mib:.1f} MiB; "
        f"process peak RSS {peak['process_peak_rss'] / mib:.0f} MiB (both models){device_peak}",
    ]
    return "\n".join(lines)
