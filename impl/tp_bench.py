"""``decodespec bench --tp R``: greedy decode tokens/s of the tensor-parallel runtime against the single-process one.

Both runtimes decode the same prompt with the same :class:`~decodespec.impl.runtime.RequestRunner`
(greedy, static or dynamic cache) in one process run: the single-process model
(:class:`~decodespec.impl.model.LlamaForCausalLM`, ``threads`` intra-op threads) and
:class:`~decodespec.impl.tp.TPModel` over ``R`` forked gloo rank processes (one thread each).
Each is timed ``repetitions`` times after one warm-up; the median decode rate is reported
(prefill excluded: tokens after the first over the time after the first score row), with the
ratio TP / single.  Communication is shown apart, per decode call: the mean time a rank spends
inside ``torch.distributed`` collectives (``all_reduce`` of the attention and MLP partial sums,
the embedding sum, the logits ``gather``) and the controller's control-pipe overhead (wall time
of the call less the busiest rank's time in it).

On a CPU with fewer free cores than ``R`` ranks (this project's machine: 2 shared cores) the
ranks compete for the same cores, so the figure measures the overhead of tensor parallelism
(collectives, pipes, smaller GEMVs), not a speed-up; the report says so.

Source: issue 21 item 4; M3.10 0x0A "One request can still be model-parallel".
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import attrs
import torch

from .bench import machine_name
from .runtime import RequestRunner, RuntimeRequest

__all__ = ["TPBenchResult", "format_tp_result", "run_tp", "run_tp_benchmark"]


@attrs.frozen
class TPBenchResult:
    """What :func:`run_tp_benchmark` measured (rates in tokens/s, times in milliseconds per decode call)."""

    model: str
    world_size: int
    prompt_len: int
    new_tokens: int
    repetitions: int
    threads: int
    cores: int
    single_tokens_per_s: float
    tp_tokens_per_s: float
    tp_call_ms: float
    tp_rank_busy_ms: float
    tp_collective_ms: float
    tp_pipe_ms: float
    same_tokens: bool
    machine: str

    @property
    def ratio(self) -> float:
        """TP tokens/s over single-process tokens/s."""
        return self.tp_tokens_per_s / self.single_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "ratio": self.ratio,
                "note": "ranks share the CPU's cores: this measures overhead, not speed-up" if self.cores < self.world_size + 1 else ""}


def _decode_rate(model, prompt_ids: tuple[int, ...], new_tokens: int, cache: str) -> tuple[float, tuple[int, ...]]:
    """Tokens/s of the decode phase of one greedy request (the first score row's time excluded) and the ids."""
    request = RuntimeRequest(identity="sha256:" + "be" * 32, prompt_ids=prompt_ids, max_new_tokens=new_tokens, cache=cache)
    runner = RequestRunner(model, request)
    first = None
    with torch.inference_mode():
        while runner.step() is not None:
            if first is None and runner.output_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return (len(runner.output_ids) - 1) / (end - first), tuple(runner.output_ids)


def run_tp_benchmark(*, model_name: str = "smollm2", world_size: int = 2, prompt_len: int = 32, new_tokens: int = 64,
                     repetitions: int = 3, threads: int = 1, cache: str = "static") -> TPBenchResult:
    """Time greedy decode single-process and tensor-parallel over ``world_size`` ranks (see the module docstring).

    Raises:
        Rejection: ``model.file_missing`` without SmolLM2; ``runtime.tp_unshardable`` for a world size the model
            does not admit.
    """
    from .tp import TPModel

    torch.set_num_threads(threads)
    if model_name == "tiny":
        from .tiny import load_tiny
        from .tokenizer import ByteTokenizer

        model, tokenizer = load_tiny(), ByteTokenizer(512)
    else:
        from .tokenizer import load_smollm2_tokenizer
        from .weights import load_smollm2

        model, tokenizer = load_smollm2(device="cpu"), load_smollm2_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 16
    prompt_ids = tuple(tokenizer.encode(text))[:prompt_len]
    tp = TPModel(model, world_size)
    try:
        single, parallel, timings = [], [], []
        ids_single = ids_tp = ()
        for rep in range(repetitions + 1):
            rate, ids_single = _decode_rate(model, prompt_ids, new_tokens, cache)
            tp.timing.clear()
            rate_tp, ids_tp = _decode_rate(tp, prompt_ids, new_tokens, cache)
            if rep:  # the first round warms both up
                single.append(rate)
                parallel.append(rate_tp)
                timings.extend(tp.timing[1:])  # decode calls only (the first call is the prefill)
    finally:
        tp.close()
    wall, busy, comm = (statistics.median(t[i] for t in timings) * 1e3 for i in range(3))
    return TPBenchResult(model_name, world_size, len(prompt_ids), new_tokens, repetitions, threads, os.cpu_count() or 1,
                         statistics.median(single), statistics.median(parallel), wall, busy, comm, wall - busy,
                         ids_single == ids_tp, machine_name(torch.device("cpu")))


def format_tp_result(r: TPBenchResult) -> str:
    """The report as text lines."""
    lines = [
        f"machine: {r.machine}",
        f"model {r.model}, prompt {r.prompt_len} tokens, {r.new_tokens} new tokens, greedy, median of {r.repetitions} runs",
        f"single process ({r.threads} thread):        {r.single_tokens_per_s:8.2f} tokens/s",
        (f"tensor parallel (R = {r.world_size}, 1 thread each): {r.tp_tokens_per_s:8.2f} tokens/s  "
         f"(ratio {r.ratio:.2f}x; same tokens: {r.same_tokens})"),
        (f"per decode call (median): {r.tp_call_ms:.2f} ms in the controller; busiest rank {r.tp_rank_busy_ms:.2f} ms, of which "
         f"{r.tp_collective_ms:.2f} ms inside collectives (mean over ranks); control pipes {r.tp_pipe_ms:.2f} ms"),
    ]
    if r.cores < r.world_size + 1:
        lines.append(f"note: {r.cores} cores for {r.world_size} ranks and the controller: this measures the overhead of tensor "
                     "parallelism (collectives, pipes, smaller GEMVs), not a speed-up")
    return "\n".join(lines)


def run_tp(args) -> int:
    """``decodespec bench --tp R`` (the ``bench`` command's arguments; exit 0, 2 invalid input, 3 SmolLM2 missing)."""
    import json
    import sys

    from decodespec.spec.errors import DecodeSpecError

    from .gguf import MODEL_FILE_MISSING

    if min(args.prompt_len, args.new_tokens, args.repetitions, args.tp, 1 if args.threads is None else args.threads) < 1:
        print(json.dumps({"error": {"code": "bad_argument", "message": "--tp, --prompt-len, --new-tokens, --repetitions and "
                                    "--threads must be >= 1"}}), file=sys.stderr)
        return 2
    try:
        result = run_tp_benchmark(world_size=args.tp, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  repetitions=args.repetitions, threads=args.threads or 1, cache=args.cache)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    print(json.dumps(result.to_json()) if args.json else format_tp_result(result))
    return 0
