"""``decodespec bench``: greedy decode tokens/s of our runtime vs HF transformers, and the bound.

Prints each runtime's median tokens/s (ours: the RequestRunner with a static cache; ours with
the event trace, and its overhead; the native CPU decode kernel, with and without the trace; on
CUDA the captured-graph decode), the ratios to HF, peak
memory, the memory-bandwidth bound (weight bytes per decode token / measured read bandwidth)
and our fraction of it; ``--json`` prints the same as one JSON object.  See
:mod:`decodespec.impl.bench`.

``--row-scope`` measures instead what selecting the decision row before ``lm_head`` saves in one
prefill (the ``[B, S, V]`` logits not produced: bytes and time, paired in one run, the machine
named; :func:`decodespec.impl.bench.row_scope_bench`); it needs no HF.

Latency (issue 19, M3.10 0x0BA): per runtime TTFT and ITL p50/p90/p99, prefill tokens/s, decode
tokens/s without the prefill, the model-call count; paired decode ratios to HF.  llama.cpp joins
the run when ``import llama_cpp`` works (``--no-llamacpp`` leaves it out).  vLLM joins through
the hook :data:`PEER_HOOKS`: a module ``decodespec.checks.adapters.vllm`` exposing
``bench_runner(prompt_ids, new_tokens, threads) -> run`` with ``run() -> (ids, Timeline | None)``
(:data:`decodespec.impl.bench.PeerFactory`; :func:`decodespec.checks.adapters.vllm.bench_runner`); without it, or
when the module's ``available()`` names a reason (``.venv-vllm`` not built), the report says vLLM is absent and why.

Exit codes: 0 success, 2 invalid input, 3 SmolLM2 or HF transformers not installed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

__all__ = ["PEER_HOOKS", "find_peers", "register", "run"]

#: Peers the bench runs when their hook exists: name -> (module, factory attribute, why it is absent otherwise).
PEER_HOOKS: dict[str, tuple[str, str, str]] = {
    "vllm": ("decodespec.checks.adapters.vllm", "bench_runner",
             "no adapter decodespec.checks.adapters.vllm with bench_runner(prompt_ids, new_tokens, threads)"),
}


def find_peers(hooks: dict[str, tuple[str, str, str]] = PEER_HOOKS) -> tuple[dict[str, Any], dict[str, str]]:
    """``(factories, absent)``: each hook's factory when its module imports and has it, else the reason it is absent.

    A hook module may also define ``available() -> str | None`` (the adapters' convention): a
    reason it returns (the peer's environment is not installed) makes the peer absent with it.
    """
    found: dict[str, Any] = {}
    absent: dict[str, str] = {}
    for name, (module, attribute, reason) in hooks.items():
        try:
            loaded = importlib.import_module(module)
        except ImportError as exc:
            absent[name] = f"{reason} ({type(exc).__name__}: {exc})" if getattr(exc, "name", None) != module else reason
            continue
        factory = getattr(loaded, attribute, None)
        why = getattr(loaded, "available", lambda: None)() if factory is not None else None
        if factory is None:
            absent[name] = reason
        elif why is not None:
            absent[name] = why
        else:
            found[name] = factory
    return found, absent


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="decode tokens/s of our decoder vs HF generate on SmolLM2, and the memory-bandwidth bound",
        description="Greedy decode benchmark, batch 1: ours vs HF transformers generate() on SmolLM2 in one process.",
    )
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens per run (default 128)")
    parser.add_argument("--repetitions", type=int, default=5, help="timed runs per runtime after warm-up (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for every runtime (default: torch's; use 1 on a shared CPU)")
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static", help="our cache family (default static)")
    parser.add_argument("--no-trace", action="store_true", help="do not time the runtime writing its event trace")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the captured-graph decode path (default: on CUDA)")
    parser.add_argument("--native", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the native CPU decode kernel (default: float32 on the CPU where it builds)")
    parser.add_argument("--row-scope", action="store_true",
                        help="instead: what selecting the decision row before lm_head saves in one prefill (bytes, time; "
                        "logits_to_keep=0 vs 1, paired), no HF needed")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2", help="with --row-scope: the model (default smollm2)")
    parser.add_argument("--batch", type=int, default=1, help="with --row-scope: batch size B (default 1)")
    parser.add_argument("--llamacpp", action=argparse.BooleanOptionalAction, default=None,
                        help="also time llama.cpp (default: when llama-cpp-python is installed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tp", type=int, default=None, metavar="R",
                        help="instead: tensor-parallel decode over R gloo rank processes vs single process (impl/tp_bench.py)")
    return parser


def _row_scope(args: argparse.Namespace) -> int:
    from decodespec.impl.bench import format_row_scope, row_scope_bench
    from decodespec.impl.device import resolve_dtype
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.spec.errors import DecodeSpecError

    if min(args.prompt_len, args.repetitions, args.batch, 1 if args.threads is None else args.threads) < 1:
        print(json.dumps({"error": {"code": "bad_argument", "message": "--prompt-len, --repetitions, --batch and --threads must be >= 1"}}),
              file=sys.stderr)
        return 2
    try:
        from decodespec.impl.device import resolve_device

        dtype, device = resolve_dtype(args.dtype), resolve_device(args.device)
        if args.model == "tiny":
            from decodespec.impl.tiny import load_tiny

            model = load_tiny(seed=0, dtype=dtype, device=device)
        else:
            from decodespec.impl.weights import load_smollm2

            model = load_smollm2(dtype=dtype, device=device)
        result = row_scope_bench(model, batch=args.batch, prompt_len=args.prompt_len, repetitions=args.repetitions,
                                 threads=args.threads)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    print(json.dumps(result) if args.json else format_row_scope(result))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report; returns the exit code."""
    if args.tp is not None:
        from decodespec.impl.tp_bench import run_tp

        return run_tp(args)
    from decodespec.checks.testing import HF_SKIP_REASON, hf_available
    from decodespec.impl.device import resolve_dtype
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.spec.errors import DecodeSpecError

    if args.row_scope:
        return _row_scope(args)
    if not hf_available():
        print(json.dumps({"error": {"code": "missing_peer", "message": HF_SKIP_REASON}}), file=sys.stderr)
        return 3
    if min(args.prompt_len, args.new_tokens, args.repetitions, 1 if args.threads is None else args.threads) < 1:
        print(json.dumps({"error": {"code": "bad_argument", "message": "--prompt-len, --new-tokens, --repetitions and --threads must be >= 1"}}),
              file=sys.stderr)
        return 2
    from decodespec.impl.bench import format_result, run_benchmark

    peers, absent = find_peers()

    try:
        result = run_benchmark(
            dtype=resolve_dtype(args.dtype),
            device=args.device,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repetitions=args.repetitions,
            threads=args.threads,
            cache=args.cache,
            trace=not args.no_trace,
            graph=args.graph,
            native=args.native,
            llamacpp=args.llamacpp,
            extra_peers=peers,
            absent=absent,
        )
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    print(json.dumps(result.to_json()) if args.json else format_result(result))
    return 0
