"""``decodespec export-tiny``: write the seeded tiny model as a GGUF file for runtimes outside Python.

The file holds the seed's float32 weights with llama.cpp's tensor names and Q/K row permutation
and the ``llama.*`` metadata keys (:func:`decodespec.checks.reference.files.write_tiny_gguf`); the
gate's float64 reference reads the same file.  Its tokenizer is the byte tokenizer: PAD 0, BOS 1,
EOS 2, byte ``b`` is id ``b + 3``, ids 259..511 are unused (``decodespec.impl.tokenizer.ByteTokenizer``).

Exit codes: 0 written; 2 the output path cannot be written (``cli.io_error``, nothing written).

Source: llama.cpp ``convert_hf_to_gguf.py``; issue 22 item 1.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export-tiny", help="write the tiny model as a GGUF file (for runtimes outside Python)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's weight seed (the gate uses 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from decodespec.checks.cli import IO_ERROR
    from decodespec.checks.reference.files import write_tiny_gguf

    parent = args.out.resolve().parent
    if args.out.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        print(json.dumps({"ok": False, "error": {"code": IO_ERROR, "path": "$.out",
                                                 "message": f"cannot write {str(args.out)[:200]}"}}))
        return 2
    part = args.out.with_name(f".{args.out.name}.{os.getpid()}.part")
    try:
        write_tiny_gguf(part, seed=args.seed)
        part.replace(args.out)
    finally:
        part.unlink(missing_ok=True)
    print(json.dumps({"ok": True, "path": str(args.out), "seed": args.seed, "bytes": args.out.stat().st_size}))
    return 0
