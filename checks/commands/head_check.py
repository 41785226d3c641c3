"""``decodespec head-check``: check a loss/head implementation against the float64 reference of M3.8 0x05.

``decodespec head-check MODULE:FUNCTION`` imports the callable (the current folder is
importable) and runs :func:`decodespec.checks.gate.head_check.check_loss` on it: the cases of
:func:`~decodespec.checks.gate.head_check.loss_cases`, each through the layers INTERFACE, ROWS,
REDUCTION and GRADIENT in that order, stopping at the first failure, under the declared
tolerance of ``--dtype``.  ``--mutants`` runs the built-in failure-lab mutants instead and
reports which layer killed each; ``--reference`` runs the built-in correct schedules.
``--json`` prints the verdicts as JSON lines.

The callable's interface: ``fn(hidden [R, d], weight [V, d], bias [V] | None, labels int64 [R],
*, ignore_index, label_smoothing) -> {"row_losses": [R], "loss_sum": [], "valid_count": int,
"loss": []}``; ``label_smoothing`` means PyTorch/HF's convention (eps / V over all classes,
target included).

Exit codes: 0 passed (or, with ``--mutants``, every mutant killed); 1 a check failed (or a
mutant survived); 2 invalid input (``head.invalid_callable``, ``head.invalid_input``).

Source: M3.8 0x05 "Exact conformance checks"; 0x11 "Evaluation ladder"; 0x12 items 20, 51, 52.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("head-check", help="check a loss/head implementation (module:function) against the M3.8 0x05 reference",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("implementation", nargs="?", help="the callable, as module:function")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32", "bfloat16", "float16"),
                   help="dtype of the candidate's inputs (16-bit: tolerances derived from the unit roundoff)")
    p.add_argument("--accumulation-dtype", default=None, help="the candidate's declared accumulation dtype (default float32 for 16-bit inputs, else --dtype)")
    p.add_argument("--mutants", action="store_true", help="run the built-in failure-lab mutants instead")
    p.add_argument("--reference", action="store_true", help="run the built-in correct schedules instead")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    return p


def run(args: argparse.Namespace) -> int:
    from decodespec.checks.gate import head_check as hc
    from decodespec.spec.errors import DecodeSpecError, Rejection

    try:
        if args.mutants or args.reference:
            if args.implementation:
                raise Rejection(hc.INVALID_CALLABLE, "give an implementation or --mutants/--reference, not both", "$.implementation")
            targets = dict(hc.LOSS_MUTANTS) if args.mutants else {
                "torch_reference": hc.torch_reference, "torch_chunked": hc.torch_chunked, "torch_tiled": hc.torch_tiled}
        elif args.implementation:
            targets = {args.implementation: hc.load_callable(args.implementation)}
        else:
            raise Rejection(hc.INVALID_CALLABLE, "name an implementation (module:function), or --mutants or --reference", "$.implementation")
        verdicts = {name: hc.check_loss(fn, dtype=args.dtype, accumulation_dtype=args.accumulation_dtype) for name, fn in targets.items()}
    except DecodeSpecError as err:
        print(json.dumps({"error": err.to_json()}), file=sys.stderr)
        return 2
    bad = 0
    for name, v in verdicts.items():
        ok = (not v.passed) if args.mutants else v.passed
        bad += not ok
        if args.json:
            print(json.dumps({"implementation": name, "dtype": args.dtype, **v.to_json()}))
        elif v.passed:
            print(f"{name}: passed ({v.cases_run} cases, {args.dtype})" + ("  SURVIVED" if args.mutants else ""))
        else:
            print(f"{name}: failed at {v.layer} ({v.rule}), case {v.case}, check {v.check}: {v.message}"
                  + ("  killed" if args.mutants else ""))
    return 1 if bad else 0
