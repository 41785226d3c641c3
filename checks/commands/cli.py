"""The ``decodespec`` command line.

Each subcommand lives in its own module under :mod:`decodespec.checks.commands` and exposes
``register(subparsers) -> argparse.ArgumentParser`` and ``run(args) -> int``.  Modules are
listed in :data:`COMMANDS`; heavy imports (torch, transformers) happen inside ``run`` so that
``decodespec --help`` and ``decodespec <cmd> --help`` stay fast.

Exit codes: 0 success, 1 a check failed / verdict not reproduced, 2 invalid input (a typed
``Rejection``), 3 a required optional component is missing (model file, peer runtime).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Sequence

from decodespec.spec.errors import register_code

__all__ = ["COMMANDS", "IO_ERROR", "build_parser", "main"]

#: A file the command line was given cannot be read, or an output path cannot be written
#: (missing parent folder, a directory, not writable); checked before any work is done.
IO_ERROR = register_code(
    "cli.io_error",
    "rejection",
    "docs/design.md section 8 (runtime outputs)",
    "A file named on the command line cannot be read, or an output path cannot be written (its folder is missing, "
    "it is a directory, or it is not writable); checked before any work, so nothing is written.",
)

#: Subcommand name -> module (relative to decodespec.checks.commands), in ``--help`` order.
COMMANDS: dict[str, str] = {
    "docs": "docs",
    "generate": "generate",
    "bench": "bench",
    "validate": "validate",
    "explore": "explore",
    "validate-trace": "validate_trace",
    "judge": "judge",
    "mutants": "mutants",
    "check": "check",
    "calibrate": "calibrate",
    "export-tiny": "export_tiny",
    "replay": "replay",
    "head-check": "head_check",
    "vocab-audit": "vocab_audit",
    "sweep": "sweep",
    "compare": "compare",
    "matrix": "matrix",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="decodespec",
        description="Executable spec of single-request LLM inference (M3.10) and decoding policy (M3.8): "
        "reference runtime, model checker and conformance gate.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        mod = importlib.import_module(f"decodespec.checks.commands.{module}")
        sp = mod.register(sub)
        sp.set_defaults(_run=mod.run)
    return parser


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """:func:`build_parser`, built once per process (it costs more than a ``validate-trace`` of a short trace)."""
    return build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``decodespec`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``decodespec generate ... | head``): the Python recipe
        # (docs.python.org, signal "Note on SIGPIPE") -- point stdout at devnull so that the
        # interpreter's final flush does not raise again, and exit 1 without a traceback.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a replaced sys.stdout without a file descriptor
            pass
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
