"""``decodespec compare``: a configuration comparison -- several manifest variables move at once.

``decodespec compare --config prompt_len=16,prefill_chunk=4 --config prompt_len=32,prefill_chunk=8``
runs each configuration on the fixed manifest given by the other options and records its cost and
the generic contract (model calls, first-row score against the float64 reference, greedy
comparator at every decision); writes ``DIR/compare.jsonl`` and ``DIR/compare.png``.  The result
is named a configuration comparison, never a sensitivity curve (M3.10 0x0BA: "If two variables
move together, call the result a configuration comparison").

Exit codes: 0 every contract held, 1 one failed, 2 invalid input, 3 SmolLM2 not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .sweep import add_manifest_options, manifest_from_args

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand."""
    parser = subparsers.add_parser(
        "compare",
        help="configuration comparison: several variables move at once (not a sensitivity curve); JSONL + PNG",
        description="Run whole configurations side by side (M3.10 0x0BA configuration comparison).",
    )
    parser.add_argument("--config", action="append", required=True,
                        help="FIELD=VALUE[,FIELD=VALUE...] of the manifest (prompt_len, new_tokens, cache, prefill_chunk, dtype, stop, num_beams); "
                        "once per configuration")
    add_manifest_options(parser)
    parser.add_argument("--out-dir", default=".", help="folder for compare.jsonl and compare.png (default .)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the comparison; returns the exit code."""
    from decodespec.checks.gate.sweep import SWEEP_VALUE_INVALID, VARIABLES, compare, parse_values
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.spec.errors import DecodeSpecError, Rejection

    try:
        manifest = manifest_from_args(args)
        configs = []
        for text in args.config:
            config = {}
            for item in text.split(","):
                field, sep, value = item.partition("=")
                if not sep or field not in VARIABLES:
                    raise Rejection(SWEEP_VALUE_INVALID, f"--config item {item[:40]!r}: expected FIELD=VALUE with FIELD in {sorted(VARIABLES)}",
                                    "$.config")
                config[field] = value if field in ("cache", "dtype") else parse_values(field, value)[0]
            configs.append(config)
        if len(configs) < 2:
            raise Rejection(SWEEP_VALUE_INVALID, "a comparison needs at least two --config", "$.config")
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    try:
        lines = compare(configs, manifest, out_dir=out_dir, progress=not args.no_progress)
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    for line in lines:
        print(json.dumps({"kind": line["kind"], "moved": line["moved"], "contract_passed": line["contract"]["passed"],
                          "ttft_ms_p50": line["cost"]["ttft_ms"]["median"], "itl_ms_p50": line["cost"]["itl_ms"]["median"]}))
    return 0 if all(line["contract"]["passed"] for line in lines) else 1
