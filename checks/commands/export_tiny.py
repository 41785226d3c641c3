"""``decodespec export-tiny``: write the seeded tiny model as files a runtime outside Python can read.

``--out FILE`` writes one GGUF file: the seed's float32 weights with llama.cpp's tensor names and
Q/K row permutation and the ``llama.*`` metadata keys
(:func:`decodespec.checks.gate.reference.files.write_tiny_gguf`); the gate's float64 reference reads
the same file.  ``--out-dir DIR`` writes a model folder
(:func:`decodespec.checks.gate.reference.files.write_tiny_files`): ``tiny.gguf``; ``model.safetensors``
with HF transformers' tensor names (tied head: no ``lm_head.weight``); HF's ``config.json``
(``transformers.LlamaForCausalLM.from_pretrained(DIR)`` loads the folder); ``tokenizer_table.json``
(every id with its bytes in hex and the special ids) and ``README.txt``.  The tokenizer is the
byte tokenizer: PAD 0, BOS 1, EOS 2, byte ``b`` is id ``b + 3``, ids 259..511 are unused
(``decodespec.impl.tokenizer.ByteTokenizer``).  The same seed gives byte-identical files.

Both are atomic: the output is written under a temporary name beside it and renamed into place,
so an error leaves nothing partial.  An existing ``DIR`` is replaced only when it holds nothing
but the files of an earlier export.

Exit codes: 0 written; 2 the output path cannot be written (``cli.io_error``, nothing written).

Source: llama.cpp ``convert_hf_to_gguf.py``; HF transformers ``save_pretrained`` layout; issue 22 item 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("export-tiny", help="write the tiny model as GGUF / safetensors files (for runtimes outside Python)",
                       description=__doc__.split("\n\n")[0])
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", type=Path, help="the .gguf file to write")
    out.add_argument("--out-dir", type=Path, help="the model folder to write (GGUF, safetensors, config, tokenizer table)")
    p.add_argument("--seed", type=_seed, default=0, help="the tiny model's weight seed, 0 <= SEED < 2**63 (the gate uses 0)")
    return p


def _seed(text: str) -> int:
    """A ``torch.Generator`` seed: an integer in ``[0, 2**63)`` (argparse refuses another with exit code 2)."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"seed {value} is outside [0, 2**63)")
    return value


def _refuse(json_path: str, message: str) -> int:
    from decodespec.checks.commands.cli import IO_ERROR

    print(json.dumps({"ok": False, "error": {"code": IO_ERROR, "path": json_path, "message": message[:300]}}))
    return 2


def _writable_parent(path: Path) -> bool:
    parent = path.resolve().parent
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def _run_file(out: Path, seed: int) -> int:
    from decodespec.checks.gate.reference.files import write_tiny_gguf

    if out.is_dir() or not _writable_parent(out):
        return _refuse("$.out", f"cannot write {str(out)[:200]}")
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        write_tiny_gguf(part, seed=seed)
        part.replace(out)
    except OSError as exc:
        return _refuse("$.out", f"cannot write {str(out)[:200]}: {exc.strerror or exc}")
    finally:
        part.unlink(missing_ok=True)
    print(json.dumps({"ok": True, "path": str(out), "seed": seed, "bytes": out.stat().st_size}))
    return 0


def _run_dir(out: Path, seed: int) -> int:
    from decodespec.checks.gate.reference.files import TINY_FILES, write_tiny_files

    if out.exists() and not out.is_dir():
        return _refuse("$.out_dir", f"{str(out)[:200]} exists and is not a folder")
    if not _writable_parent(out):
        return _refuse("$.out_dir", f"cannot write {str(out)[:200]}: its parent folder is missing or not writable")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in TINY_FILES)
        if foreign:
            return _refuse("$.out_dir", f"{str(out)[:200]} holds files an export did not write ({', '.join(foreign[:5])});"
                                        " give an empty or new folder")
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    try:
        part.mkdir()
        files = write_tiny_files(part, seed=seed)
        if out.is_dir():
            out.rename(old)
        part.rename(out)
    except OSError as exc:
        if old.is_dir() and not out.exists():
            old.rename(out)
        return _refuse("$.out_dir", f"cannot write {str(out)[:200]}: {exc.strerror or exc}")
    finally:
        shutil.rmtree(part, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    print(json.dumps({"ok": True, "path": str(out), "seed": seed, "files": files}))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.out_dir is not None:
        return _run_dir(args.out_dir, args.seed)
    return _run_file(args.out, args.seed)
