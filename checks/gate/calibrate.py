"""Tolerances derived from a shipped measurement: the runtime's error against the float64 reference.

M3.10 "A logit tolerance is not a token-equality proof" lets a gate claim token equality from
a logit tolerance only when the tolerance is *declared*; DESIGN.md asks that it be an error
against the float64 truth, stated in a form, and measured across the kernels a user can meet.
This module is that measurement and the derivation:

1. :func:`measure` runs the lock-step gate (the same adapters, the same TENSOR comparisons)
   over a fixed calibration set of greedy requests (:func:`calibration_configs`: prompts of
   several lengths, every cache family, one-shot and chunked prefill, eager and SDPA
   attention, the native decode kernel where it builds) with the comparisons' bounds opened
   (:func:`decodespec.checks.gate.ladder.measuring` collects every score-row and K/V error with
   its reference scale);
2. ``decodespec calibrate --sweep`` repeats it in child processes under every
   ``ATEN_CPU_CAPABILITY`` the CPU has (``default``, ``avx2``, ``avx512``) and 1 and 2 threads
   (torch reads the capability once, at import, so each variant is its own process), and
   writes the maxima to ``checks/gate/calibration.json``;
3. :func:`~decodespec.checks.gate.tolerance.derive` turns the maxima into the declared
   :class:`~decodespec.checks.gate.tolerance.Tolerance` of each (runtime, model, dtype):
   ``logit_rel = HEADROOM * max(error / scale)`` over score rows, ``kv_rel = HEADROOM *
   max(error / scale)`` over layers' K and V, and the absolute parts ``HEADROOM * max(error)``
   over rows (resp. layers) whose scale is below
   :data:`~decodespec.checks.gate.tolerance.SMALL_SCALE` (a floor for near-zero rows; at least
   :data:`~decodespec.checks.gate.tolerance.ABS_FLOOR`).

The ladder's :data:`~decodespec.checks.gate.tolerance.TOLERANCES` are built from the shipped file with
:func:`~decodespec.checks.gate.tolerance.derive`; tests/test_calibration.py re-measures in its own process and asserts the
measured errors stay inside the declared tolerance.

Source: M3.10 "A logit tolerance is not a token-equality proof", 0x0BA ("Sensitivity is a
controlled experiment": one variable at a time, the rest of the manifest fixed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ..adapters import CaseConfig
from ..modelcheck.traces import open_runtime
from .ladder import measuring
from .lockstep import LockStep
from .tolerance import SMALL_SCALE, Tolerance

__all__ = [
    "LONGEST_PROMPT",
    "calibration_configs",
    "measure",
    "summarize",
    "sweep",
]

_TEXTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    '{"name": "decodespec", "tags": ["spec", "gate"], "nested": {"depth": [1, [2, [3]]]}, "ok": true}',
)


#: The longest calibration prompt per model: the tiny window less one (the gate's
#: ``boundary.prompt_at_max_length``), and for SmolLM2 more than any gate case or machine draws.
#: Float32 error grows with the number of positions attention sums over, so the declared
#: tolerance is stated for prompts up to this length (docs/design.md "Tolerances").
LONGEST_PROMPT = {"tiny": 1023, "smollm2": 320}


def _prompts(model: str) -> list[tuple[int, ...]]:
    from ..adapters.impl import load_tokenizer

    tok = load_tokenizer(model)
    prompts = [tuple(tok.encode(text)) for text in _TEXTS]
    text = " ".join(_TEXTS)
    long = tuple(tok.encode(text))
    while len(long) < LONGEST_PROMPT[model]:
        long = long + tuple(tok.encode(" " + text))
    return [(prompts[0][0],)] + prompts + [long[: LONGEST_PROMPT[model]]]  # one token ... the longest


#: The runtimes whose kernels torch picks (``ATEN_CPU_CAPABILITY`` and the thread count reach them).
TORCH_RUNTIMES = ("impl", "impl-tp", "hf")


def calibration_configs(model: str, dtype: str = "float32", *, decode_kernels: Sequence[str] = ("torch",),
                        max_new_tokens: int = 12, eos_ids: Sequence[int] = ()) -> list[CaseConfig]:
    """The fixed calibration set of ``model`` in ``dtype``: greedy requests over every cache path.

    Args:
        eos_ids: The requests' EOS set; empty (the default) so that every request runs its
            ``max_new_tokens`` rows.  ``decodespec calibrate --stop-at-eos`` passes the tokenizer's EOS
            for a runtime that refuses a request without it (llama-cpp-python always stops on the
            vocabulary's end-of-generation tokens).

    Returns:
        One :class:`CaseConfig` per (prompt, cache family, prefill chunk, attention, decode
        kernel) combination; the native kernel only with a static float32 cache.
    """
    out = []
    for prompt in _prompts(model):
        for cache, chunk in (("none", None), ("dynamic", None), ("dynamic", 3), ("static", None)):
            for attention in ("sdpa", "eager"):
                for kernel in decode_kernels:
                    if kernel != "torch" and (cache != "static" or dtype != "float32" or attention != "sdpa"):
                        continue
                    out.append(CaseConfig(model=model, prompt_ids=prompt, max_new_tokens=max_new_tokens, cache=cache,
                                          prefill_chunk=chunk, attention=attention, dtype=dtype, decode_kernel=kernel,
                                          eos_ids=tuple(eos_ids)))
    return out


def measure(runtime: str, configs: Iterable[CaseConfig]) -> list[dict[str, Any]]:
    """Run ``configs`` on ``runtime`` in lock step and collect every TENSOR error (see the module docstring).

    A config the runtime does not declare a capability for is not run; one it refuses at reset
    as ``adapter.unsupported`` (llama.cpp: a static cache) is not measured and leaves a record
    ``{"kind": "unsupported", "message"}`` (:func:`summarize` counts them).

    Returns:
        The :func:`~decodespec.checks.gate.ladder.measuring` records, each with the config's
        ``cache``, ``attention`` and ``decode_kernel`` added.
    """
    opened = Tolerance.from_logit(1e9, 1e9)  # measure, never stop at a bound
    records: list[dict[str, Any]] = []
    for config in configs:
        adapter = open_runtime(runtime, config.model)
        need = {f"cache:{config.cache}"} | ({"prefill_chunk"} if config.prefill_chunk else set()) | \
            ({f"decode_kernel:{config.decode_kernel}"} if config.decode_kernel != "torch" else set())
        if need - adapter.capabilities():
            adapter.close()
            continue  # a path this runtime does not declare is not measured
        try:
            with measuring() as sink:
                ls = LockStep(adapter, config, runtime=runtime, tolerance=opened)
                ls.reset()
                if ls.unsupported:  # a path this runtime refuses is not measured
                    sink.append({"kind": "unsupported", "message": ls.unsupported})
                else:
                    ls.apply({"op": "prefill"})
                    for _ in range(config.max_new_tokens + 1):
                        if ls.failed or (ls.observation is not None and ls.observation.phase == "finished"):
                            break
                        ls.apply({"op": "step"})
        finally:
            adapter.close()
        for rec in sink:
            rec.update(cache=config.cache, attention=config.attention, decode_kernel=config.decode_kernel)
        records.extend(sink)
    return records


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Maxima of a measurement: ``row_max_error``, ``row_max_rel``, ``row_small_max_error``,
    ``row_max_scale``, ``kv_max_error``, ``kv_max_rel``, ``kv_small_max_error``, and counts (``rows``,
    ``kv_layers``, ``unsupported``: configs the runtime refused)."""
    rows = [r for r in records if r["kind"] == "score_row"]
    kvs = [(e, s) for r in records if r["kind"] == "cache_probe"
           for le, ls in zip(r["error"], r["scale"]) for e, s in zip(le, ls)]
    return {
        "rows": len(rows),
        "kv_layers": len(kvs),
        "unsupported": sum(r["kind"] == "unsupported" for r in records),
        "row_max_error": max((r["error"] for r in rows), default=0.0),
        "row_max_rel": max((r["error"] / r["scale"] for r in rows if r["scale"] > 0), default=0.0),
        "row_small_max_error": max((r["error"] for r in rows if r["scale"] < SMALL_SCALE), default=0.0),
        "row_max_scale": max((r["scale"] for r in rows), default=0.0),
        "kv_max_error": max((e for e, _ in kvs), default=0.0),
        "kv_max_rel": max((e / s for e, s in kvs if s > 0), default=0.0),
        "kv_small_max_error": max((e for e, s in kvs if s < SMALL_SCALE), default=0.0),
    }


def _capabilities() -> list[str]:
    import torch

    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    return order[: order.index(best) + 1] if best in order else ["default"]


def sweep(runtime: str, model: str, dtypes: Sequence[str], *, threads: Sequence[int] = (1, 2),
          capabilities: Sequence[str] | None = None, decode_kernels: Sequence[str] = ("torch",),
          max_new_tokens: int = 12, stop_at_eos: bool = False, log=print) -> list[dict[str, Any]]:
    """Measure ``runtime`` on ``model`` for every dtype, capability and thread count, one child process each.

    ``stop_at_eos`` gives the requests the tokenizer's EOS (see :func:`calibration_configs`).

    Returns:
        One entry per dtype: ``{"runtime", "model", "dtype", "variants": [summary + "capability",
        "threads", "decode_kernels", "torch", "stop_at_eos"]}``.

    Raises:
        RuntimeError: a child process failed (its stderr's tail in the message).
    """
    caps = list(capabilities or _capabilities())
    entries = []
    for dtype in dtypes:
        variants = []
        for cap in caps:
            for n in threads:
                env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": str(n)}
                cmd = [sys.executable, "-m", "decodespec.checks.gate.calibrate", runtime, model, dtype, str(n), str(max_new_tokens),
                       ",".join(decode_kernels if dtype == "float32" else ("torch",)), "eos" if stop_at_eos else "no-eos"]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    raise RuntimeError(f"calibration child {cap}/{n} threads failed:\n{out.stderr[-4000:]}")
                summary = json.loads(out.stdout.strip().splitlines()[-1])
                variants.append(summary)
                log(f"{runtime} {model} {dtype} capability={summary['capability']} threads={n}: "
                    f"rows {summary['rows']} max err {summary['row_max_error']:.3g} rel {summary['row_max_rel']:.3g}; "
                    f"K/V max err {summary['kv_max_error']:.3g} rel {summary['kv_max_rel']:.3g}")
        entries.append({"runtime": runtime, "model": model, "dtype": dtype, "variants": variants})
    return entries


def _child(argv: Sequence[str]) -> int:
    runtime, model, dtype, threads, steps, kernels, eos = argv
    import torch

    from ..adapters.impl import load_tokenizer

    torch.set_num_threads(int(threads))
    kernel_list = [k for k in kernels.split(",") if k]
    if "native" in kernel_list:
        from decodespec.impl.native import unavailable_reason

        if unavailable_reason() is not None:
            kernel_list.remove("native")
    eos_ids = (int(load_tokenizer(model).eos_token_id),) if eos == "eos" else ()
    records = measure(runtime, calibration_configs(model, dtype, decode_kernels=kernel_list, max_new_tokens=int(steps),
                                                   eos_ids=eos_ids))
    summary = summarize(records)
    # A runtime outside torch (llama.cpp's ggml) runs kernels of its own: ATEN_CPU_CAPABILITY and the
    # thread count then reach only the float64 reference, and no torch decode kernel is named.
    summary.update(capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                   decode_kernels=kernel_list if runtime in TORCH_RUNTIMES else [], torch=torch.__version__,
                   stop_at_eos=bool(eos_ids))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover - the sweep's child process
    sys.exit(_child(sys.argv[1:]))
