"""``decodespec judge FILE``: the rows-in oracle -- judge a recorded run of any runtime without the gate's driver.

Reads a ``decodespec.rows.v1`` recording (schema ``spec/schemas/rows.v1.json``; written by any
runtime, or by ours with ``decodespec judge --record ENVELOPE --model tiny FILE``), runs
:func:`decodespec.checks.modelcheck.judge.judge_rows` and prints one JSON object: ``result`` (``passed``,
``failed`` or ``undecided``), and for a non-passing run its ladder ``layer``, ``rule``
(``ladder.<LAYER>``), ``check``, the 1-based ``line`` and its ``event``, the ``output_index``,
``expected`` / ``actual`` and the ``message`` (and the bounded ``probe`` of the rows).

``--reference`` also compares every row with the float64 reference of the same committed prefix
(the header's ``runtime.model``: ``tiny`` or ``smollm2``).  A header that states the runtime's
ordered vocabulary hash (``runtime.vocab_hash``) of a known model is compared with the model's
as the gate reads it (:func:`~decodespec.checks.gate.vocab_check.reference_vocab`): a different one
fails STATE ``vocab.hash`` at line 1; ``--record`` writes our tokenizer's.  The tolerance is the declared one of
the header's ``(runtime.name, runtime.model, runtime.dtype)`` (:func:`~decodespec.checks.gate.tolerance.tolerance_for`,
our runtime's bound for an unknown runtime name); ``--epsilon E`` states it instead (logit epsilon
E, logprob bound ``2 E + 1e-5``).  ``--tokenizer`` gives the token bytes of stop strings /
structured completion (``auto``: the header's model).

Exit codes: 0 conforming (passed, or undecided: the tolerance cannot decide a decision), 1 a
rule is broken, 2 the file cannot be read or is not a valid recording (a typed error on stderr:
``{"error": {"code", "path", "message"}}``, codes ``judge.*``, ``envelope.*``, ``policy.*``),
3 the reference or tokenizer named is not installed.

Source: issue 22 item 5; docs/adapters.md "Judge a recorded run".
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``judge`` subcommand."""
    parser = subparsers.add_parser(
        "judge",
        help="the rows-in oracle: judge a recorded run (decodespec.rows.v1: request, score rows, decisions, frontiers)",
        description="Judge a decodespec.rows.v1 recording of any runtime against the spec request machine, the spec policy "
        "(margin rule under the declared tolerance) and optionally the float64 reference; print the first broken rule with "
        "its ladder layer as JSON (exit 0 conforming, 1 broken rule, 2 unreadable). With --record ENVELOPE, run our runtime "
        "on the envelope and write its recording to FILE instead.",
    )
    parser.add_argument("file", help="the rows file (JSON lines); with --record, the file to write")
    parser.add_argument("--reference", action="store_true", help="also compare each row with the float64 reference (tiny, smollm2)")
    parser.add_argument("--epsilon", type=float, default=None, help="logit tolerance epsilon (default: the declared one)")
    parser.add_argument("--tokenizer", choices=("auto", "smollm2", "tiny", "none"), default="auto",
                        help="token bytes for stop strings / structured completion (default: the header's model)")
    parser.add_argument("--record", metavar="ENVELOPE", default=None,
                        help="run our runtime on this numinens.request.v1 envelope and write its recording to FILE")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="with --record: the model (default tiny)")
    return parser


def _error(exc) -> int:
    print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
    return 3 if exc.code == "model.file_missing" else 2


def run(args: argparse.Namespace) -> int:
    """Judge (or record) and print; returns the exit code."""
    from decodespec.checks.gate.tolerance import Tolerance, tolerance_for
    from decodespec.checks.modelcheck.judge import JUDGE_NO_TOLERANCE, JUDGE_SCHEMA, judge_rows, parse_line, read_rows
    from decodespec.spec.errors import DecodeSpecError, Rejection

    if args.record is not None:
        return _record(args)
    try:
        lines = read_rows(args.file)
        header = parse_line(0, lines[0])  # judge.schema before anything is read from it
        if header["event"] != "request":
            raise Rejection(JUDGE_SCHEMA, f"the first line is a {header['event']!r} line, not the request header", "$[0].event")
        info = header.get("runtime", {})
        model, dtype, name = info.get("model"), info.get("dtype", "float32"), info.get("name", "*")
        if args.epsilon is not None:
            if not (args.epsilon >= 0 and args.epsilon < float("inf")):
                raise Rejection(JUDGE_NO_TOLERANCE, f"--epsilon must be finite and >= 0, got {args.epsilon}", "$.epsilon")
            tolerance = Tolerance.from_logit(args.epsilon, 0.0)
        else:
            try:
                tolerance = tolerance_for(str(name), str(model), str(dtype))
            except KeyError:
                raise Rejection(JUDGE_NO_TOLERANCE, f"no declared tolerance for runtime {name!r}, model {model!r}, dtype {dtype!r}; "
                                "give --epsilon", "$[0].runtime") from None
        reference = None
        if args.reference:
            if model not in ("tiny", "smollm2"):
                raise Rejection(JUDGE_NO_TOLERANCE, f"--reference needs runtime.model tiny or smollm2 in the header, not {model!r}",
                                "$[0].runtime.model")
            from decodespec.checks.gate.lockstep import reference_for

            reference = reference_for(model)
        model_hash = None
        if info.get("vocab_hash") is not None and model in ("tiny", "smollm2"):  # stated: compared at STATE with the model's
            from decodespec.checks.gate.vocab_check import reference_vocab

            model_hash = reference_vocab(str(model)).vocab_hash
        judgement = judge_rows(lines, tolerance=tolerance, reference=reference, token_bytes=_token_bytes(args.tokenizer, model),
                               vocab_hash=model_hash)
    except DecodeSpecError as exc:
        return _error(exc)
    from .validate_trace import printable_json

    print(printable_json(judgement.to_json()))
    return 0 if judgement.conforming else 1


def _token_bytes(choice: str, model):
    """The token bytes of ``choice`` (``auto``: the header's model), loaded on first use (only stop strings need them), or ``None``."""
    if choice == "auto":
        choice = model if model in ("tiny", "smollm2") else "none"
    if choice == "none":
        return None
    loaded: list = []

    def token_bytes(token_id: int) -> bytes:
        if not loaded:
            from decodespec.checks.adapters.impl import load_tokenizer
            from decodespec.checks.modelcheck.trace_validation import token_bytes_of

            loaded.append(token_bytes_of(load_tokenizer(choice)))
        return loaded[0](token_id)

    return token_bytes


def _record(args: argparse.Namespace) -> int:
    """``--record ENVELOPE FILE``: run our runtime (CPU, float32) on the envelope and write its recording."""
    from pathlib import Path

    from decodespec.checks.commands.cli import IO_ERROR
    from decodespec.checks.modelcheck.judge import record_rows, write_rows
    from decodespec.impl.runtime import RequestRunner, RuntimeRequest
    from decodespec.spec.envelope import validate_request_envelope
    from decodespec.spec.errors import DecodeSpecError, Rejection

    try:
        try:
            raw = Path(args.record).read_bytes()
        except OSError as exc:
            raise Rejection(IO_ERROR, f"cannot read {args.record}: {exc.strerror or exc}", "$.record") from None
        target = Path(args.file)
        if target.is_dir() or not target.parent.is_dir():
            raise Rejection(IO_ERROR, f"cannot write {args.file}: a directory, or its folder is missing", "$.file")
        import torch

        from .generate import _check_artifact, _load

        admitted, _ = validate_request_envelope(raw)
        model, tokenizer = _load(args.model, torch.float32, torch.device("cpu"), "sdpa")
        _check_artifact(admitted, args.model, model, tokenizer)  # runtime.artifact_mismatch: an envelope of another model
        runner = RequestRunner(model, RuntimeRequest.from_admitted(admitted), tokenizer=tokenizer)
        lines = record_rows(runner, runtime={"name": "impl", "model": args.model, "dtype": "float32"})
        write_rows(target, lines)
    except DecodeSpecError as exc:
        return _error(exc)
    print(json.dumps({"recorded": str(args.file), "lines": len(lines), "tokens": sum(1 for line in lines if line["event"] == "token"),
                      "finish_reason": lines[-1]["finish_reason"]}))
    return 0
