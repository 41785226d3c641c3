"""``decodespec sweep VARIABLE``: a sensitivity sweep -- one variable moves, the manifest stays fixed.

``decodespec sweep prefill_chunk --values none,4,8,16 --model smollm2 --prompt-len 32 --out-dir DIR``
runs our runtime at each value (cost: TTFT / ITL quantiles, E2E, prefill and decode rates, model
calls, K/V bytes; contract: the equivalence the seed names for that variable, against the float64
reference and the runtime's own base run with the calibrated tolerance) and writes
``DIR/sweep-<VARIABLE>.jsonl`` (one JSON line per value) and ``DIR/sweep-<VARIABLE>.png``; a
progress bar (tqdm) runs on stderr.  See :mod:`decodespec.checks.gate.sweep`.

Every manifest option takes one value; a comma list on any option but VARIABLE's moves a second
variable and is refused (``sweep.two_variables``, exit 2): that is a configuration comparison,
``decodespec compare``.

Exit codes: 0 every point kept its contract, 1 a contract failed at some point, 2 invalid input
(a typed refusal; nothing was run), 3 SmolLM2 not installed.

Source: M3.10 0x0BA "Sensitivity is a controlled experiment".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_manifest_options", "manifest_from_args", "register", "run"]

#: Manifest options: (flag, manifest field, help).
MANIFEST_OPTIONS = (
    ("--model", "model", "tiny or smollm2 (default tiny)"),
    ("--prompt-len", "prompt_len", "prompt tokens (default 16)"),
    ("--new-tokens", "new_tokens", "output tokens (default 8; EOS is disabled)"),
    ("--cache", "cache", "none, dynamic or static (default static)"),
    ("--prefill-chunk", "prefill_chunk", "prefill chunk size, or none (default none: one shot)"),
    ("--dtype", "dtype", "float32 (default), bfloat16 or float16"),
    ("--stop", "stop", "a stop string (default none)"),
    ("--num-beams", "num_beams", "beam width (default 1: greedy)"),
    ("--repetitions", "repetitions", "timed runs per point after one warm-up (default 3)"),
    ("--threads", "threads", "torch intra-op threads (default 1)"),
)


def add_manifest_options(parser: argparse.ArgumentParser) -> None:
    """The fixed-manifest options (each one value; a comma list moves that variable)."""
    for flag, field, text in MANIFEST_OPTIONS:
        parser.add_argument(flag, dest=f"m_{field}", metavar=field.upper(), default=None, help=text)


def moving_fields(args: argparse.Namespace) -> dict[str, list[str]]:
    """Manifest fields given on the command line -> their raw values (``stop``: split at ``|``, others at commas)."""
    out = {}
    for _, field, _ in MANIFEST_OPTIONS:
        raw = getattr(args, f"m_{field}")
        if raw is not None:
            out[field] = raw.split("|") if field == "stop" else raw.split(",")
    return out


def manifest_from_args(args: argparse.Namespace, skip: str | None = None):
    """The :class:`~decodespec.checks.gate.sweep.Manifest` of the options (one value each; ``skip`` left at its default)."""
    from decodespec.checks.gate.sweep import Manifest, parse_values

    fields: dict[str, Any] = {}
    for field, values in moving_fields(args).items():
        if field == skip:
            continue
        if field in ("model", "cache", "dtype"):
            fields[field] = values[0]
        elif field in ("repetitions", "threads", "num_beams"):
            fields[field] = parse_values("prompt_len", values[0])[0]
        else:
            fields[field] = parse_values(field, values[0] if field != "stop" else "|".join(values))[0]
    return Manifest(**fields).check()


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``sweep`` subcommand."""
    parser = subparsers.add_parser(
        "sweep",
        help="sensitivity sweep: vary one variable, hold the manifest fixed; cost + contract per point, JSONL + PNG",
        description="Vary one variable of a fixed manifest (M3.10 0x0BA) and record at each point the cost (TTFT, ITL, E2E, "
        "calls, K/V bytes) and the contract that must hold; two moving variables are refused (use `decodespec compare`).",
    )
    parser.add_argument("variable", help="prompt_len, new_tokens, cache, prefill_chunk, dtype, stop or num_beams")
    parser.add_argument("--values", required=True, help="comma-separated values (stop: separated by |; none = no chunk / no stop)")
    add_manifest_options(parser)
    parser.add_argument("--out-dir", default=".", help="folder for sweep-VARIABLE.jsonl and sweep-VARIABLE.png (default .)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _refuse(exc) -> int:
    print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the sweep; print one JSON summary line per point; returns the exit code."""
    from decodespec.checks.commands.cli import IO_ERROR
    from decodespec.checks.gate.sweep import check_one_variable, parse_values, sweep
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.spec.errors import DecodeSpecError

    try:
        values = parse_values(args.variable, args.values)
        moving = moving_fields(args)
        moving[args.variable] = list(values) + moving.get(args.variable, [])
        check_one_variable(args.variable, moving)
        manifest = manifest_from_args(args, skip=args.variable)
    except DecodeSpecError as exc:
        return _refuse(exc)
    out_dir = Path(args.out_dir)
    if not out_dir.is_dir():
        print(json.dumps({"error": {"code": IO_ERROR, "message": f"--out-dir {str(out_dir)[:200]!r} is not a folder"}}), file=sys.stderr)
        return 2
    try:
        lines = sweep(args.variable, values, manifest, out_dir=out_dir, progress=not args.no_progress)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    for line in lines:
        cost = line["cost"]
        print(json.dumps({"variable": line["variable"], "value": line["value"], "contract_passed": line["contract"]["passed"],
                          "failed_checks": [c["check"] for c in line["contract"]["checks"] if not c["passed"]],
                          "ttft_ms_p50": cost["ttft_ms"]["median"], "itl_ms_p50": cost["itl_ms"]["median"], "calls": cost["calls"]}))
    print(json.dumps({"jsonl": str(out_dir / f"sweep-{args.variable}.jsonl"), "plot": str(out_dir / f"sweep-{args.variable}.png")}))
    return 0 if all(line["contract"]["passed"] for line in lines) else 1
