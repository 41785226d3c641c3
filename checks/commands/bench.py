"""``decodespec bench``: greedy decode tokens/s of our runtime vs HF transformers, and the bound.

Prints each runtime's median tokens/s (ours: the RequestRunner with a static cache; ours with
the event trace, and its overhead; the native CPU decode kernel, with and without the trace; on
CUDA the captured-graph decode), the ratios to HF, peak
memory, the memory-bandwidth bound (weight bytes per decode token / measured read bandwidth)
and our fraction of it; ``--json`` prints the same as one JSON object.  See
:mod:`decodespec.impl.bench`.

Exit codes: 0 success, 2 invalid input, 3 SmolLM2 or HF transformers not installed.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


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
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tp", type=int, default=None, metavar="R",
                        help="instead: tensor-parallel decode over R gloo rank processes vs single process (impl/tp_bench.py)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report; returns the exit code."""
    if args.tp is not None:
        from decodespec.impl.tp_bench import run_tp

        return run_tp(args)
    from decodespec.checks.testing import HF_SKIP_REASON, hf_available
    from decodespec.impl.device import resolve_dtype
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.spec.errors import DecodeSpecError

    if not hf_available():
        print(json.dumps({"error": {"code": "missing_peer", "message": HF_SKIP_REASON}}), file=sys.stderr)
        return 3
    if min(args.prompt_len, args.new_tokens, args.repetitions, 1 if args.threads is None else args.threads) < 1:
        print(json.dumps({"error": {"code": "bad_argument", "message": "--prompt-len, --new-tokens, --repetitions and --threads must be >= 1"}}),
              file=sys.stderr)
        return 2
    from decodespec.impl.bench import format_result, run_benchmark

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
        )
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    print(json.dumps(result.to_json()) if args.json else format_result(result))
    return 0
