"""``decodespec generate``: one request through the reference runtime (SmolLM2 or the tiny model).

The request is an admitted ``numinens.request.v1`` envelope: ``--request FILE`` reads one (its
planes decide prompt, policy, termination, cache family and chunking; the loaded model must be
the envelope's checkpoint and tokenizer), otherwise the flags are turned into an envelope and
admitted by the same validator (:func:`decodespec.spec.envelope.validate_request_envelope`),
so there is one identity rule: the envelope identity keys the request RNG and heads the trace.

Runtime flags: ``--cache {none,dynamic,static}`` (no cache = full recomputation, the reference),
``--capacity N`` (static slots), ``--prefill-chunk N``, ``--repair`` (declare
``final_cache = all_outputs``: the closed final token is processed by the append/repair call),
``--dtype``, ``--device``, ``--attention {eager,sdpa}``, ``--decode-kernel {torch,native}``
(``native``: one-row float32 CPU decode calls on a static cache run in the C kernel of
:mod:`decodespec.impl.native`; refused with ``runtime.kernel_unavailable`` where it cannot
run), ``--trace FILE`` (the
``decodespec.events.v1`` event trace; check it with ``decodespec validate-trace FILE``; redacted by
default -- prompt and output ids, streamed text, stop strings and identities become keyed digests
and byte counts, :mod:`decodespec.spec.passport` -- and raw only with ``--trace-content``, which the
header's ``data`` records), ``--snapshot-content`` (keep the prompt text in the snapshot; by
default it is dropped),
``--snapshot FILE`` (write a resumable snapshot: ``FILE`` JSON + ``FILE.safetensors``) with
``--snapshot-form {pending_suffix,repaired}`` and ``--snapshot-at N`` (suspend after N committed
tokens; without it the snapshot is taken at finish), ``--resume FILE`` (continue a snapshot:
same tokens and logprobs as never stopping).  With ``DECODESPEC_SNAPSHOT_KEY`` set, ``--snapshot``
writes an HMAC-SHA256 of the snapshot and ``--resume`` refuses a file without a matching one
(``snapshot.unauthenticated``); without it the recorded SHA-256 of the tensor file detects
accidental damage only.  ``--capacity`` is checked at admission against the model window
(``model.context_window_exceeded``) and the declared K/V memory bound (``cache.memory_exceeded``,
:data:`decodespec.spec.limits.MAX_STATIC_CACHE_BYTES`) before anything is allocated.

Wall-clock budget (M3.10 0x06): ``--timeout-ms N`` sets the envelope's ``termination.timeout_ms``;
the runner finishes ``timeout`` at the first call boundary after N ms (monotonic clock, from
admission), keeping every committed token; an out-of-range N is the envelope's
``envelope.out_of_range`` at ``$.termination.timeout_ms``.

Stop, structured completion and streaming (M3.10 0x06): ``--stop STR`` (repeatable; matched on
the output's UTF-8 bytes, the earliest-ending match fires), ``--include-stop`` (keep the matched
stop string in the text), ``--align {token,text,span}`` (the output contract after a cut;
default the envelope's ``token``), ``--min-new-tokens N`` (EOS and stop strings are suppressed
until N tokens are committed), ``--ignore-eos`` (the tokenizer's EOS does not stop the request:
``termination.ignore_eos`` with an empty stop set), ``--json-mode`` (structured completion: finish ``structured``
where one JSON value completes, ``structured_error`` on an invalid prefix), ``--stream`` (publish
the text behind the stream commit horizon as it is committed: plain mode prints each chunk as it
is published; with ``--json`` one JSON line per chunk -- ``chunk_idx``, ``text``,
``byte_start``, ``byte_end``, ``token_start``, ``token_end`` -- then the result object as the last
line).  A chunk that cannot be written (a closed pipe) closes the request with ``stream_error``.

Plain mode prints the generated text; ``--json`` prints one JSON object with ``prompt_ids``,
``output_ids``, ``text``, ``logprobs``, ``finish_reason``, ``triggers``, ``frontier``
(``prompt_len``, ``output_count``, ``pending``, ``processed``, ``pending_tag``), one M3.8
decision ``receipts`` entry per output token decided in this run, ``rng_counter``, the
``policy``, ``identity``, ``cache``, ``suspended`` and the run's ``model``, ``device``,
``dtype``, ``attention``, ``decode_kernel``, ``seed``; and the output contract: ``num_committed``, ``alignment``,
``overhang`` (hex), ``token_spans``, ``visible_end``, ``stop_match``, ``structured_end`` and
the ``stream`` report (chunks, delivered bytes and tokens, failure).  The decoding policy (M3.8) comes from the flags: greedy by
default; ``--do-sample`` selects the multinomial family with ``--temperature`` (0 = the greedy
branch), ``--top-k``, ``--top-p`` and ``--min-p``; ``--repetition-penalty`` applies in both
families; ``--order`` picks the transform order preset.

Beam search (M3.10 0x05, M3.8 0x0F; :class:`decodespec.impl.beam.BeamRunner`): ``--num-beams K``
selects the beam family with ``--length-penalty A`` (default 1.0, HF's) and ``--early-stopping
{true,false,never,exact}`` (HF's three settings under ``BeamParams.hf_compatible``, or the spec's
normative exact bound; default ``false``, HF's).  A beam-family ``--request`` envelope runs the
same way.  ``--json`` then prints the best hypothesis as ``output_ids``, ``text``, ``logprobs``,
``score`` (HF's sequence score: sum of logprobs / length**alpha), ``sum_logprobs``,
``finish_reason`` and ``triggers``, and under ``beams`` every kept completed hypothesis with its
``output_ids``, ``text``, ``score``, ``sum_logprobs``, ``length``, ``finish_reason``, ``triggers``,
``ancestry``, ``logprobs`` and ``branch_hash``; plus ``stop``, ``num_beams`` and ``beam_params``.
Refused with ``runtime.beam_unsupported`` (exit 2): ``--do-sample`` (beam sampling is not
modelled), ``--stream``, ``--stop``, ``--json-mode``, ``--repair``, snapshots and ``--resume``.

Bad input is refused before any work and leaves no file (exit 2, ``runtime.invalid_request``
unless noted): request flags (prompt, policy, termination, cache, stream and beam flags) set away
from their defaults next to ``--request`` or ``--resume`` (the file fixes the request; the error
names the flags), ``--request`` with ``--resume``, ``--snapshot-at`` below 0 or without
``--snapshot``, ``--capacity`` without ``--cache static``; an output path whose folder is
missing, which is a directory or is not writable (``cli.io_error``).  The trace and the snapshot
are written to temporaries next to their paths and renamed into place only when the command
succeeds.

Exit codes: 0 success, 2 invalid input (typed ``Rejection``/``ResourceLimit``, printed as JSON
on stderr), 3 the model file is not installed.

Source: docs/design.md section 8 (runtime outputs); M3.10 0x03 "Decoder-only serving loop",
"Immutable request envelope and canonical identity", 0x0B snapshots.

Size: one command: the flags, the envelope they describe, the run, its trace and stream and every
typed exit of ``decodespec generate``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from typing import Any

from decodespec.spec.request import static_capacity

__all__ = ["envelope_from_flags", "policy_json", "register", "run", "tiny_checkpoint_sha256"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="one request through the reference runtime (SmolLM2 or the tiny model), greedy or sampled",
        description="Generation with the step-wise reference runtime: prefill (one shot or chunked), decode one token per "
        "call over no cache / a dynamic / a static cache, decide each token with the M3.8 policy (greedy, or --do-sample), "
        "stop on EOS, --max-new-tokens or the context cap; optional event trace and resumable snapshots.",
    )
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="model to run (default smollm2)")
    parser.add_argument("--prompt", help="prompt text (required unless --request or --resume)")
    parser.add_argument("--request", metavar="FILE", help="a numinens.request.v1 envelope (JSON); its planes replace the prompt, "
                        "policy, termination and cache flags")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="G, the most tokens to generate (default 64)")
    parser.add_argument("--timeout-ms", type=int, default=None, metavar="N",
                        help="wall-clock budget (termination.timeout_ms, 1 <= N <= 86400000): finish 'timeout' at the first "
                        "call boundary after N ms, keeping every committed token (default: no budget)")
    parser.add_argument("--seed", type=int, default=0, help="request seed; keys the RNG stream with the request identity (greedy draws nothing)")
    parser.add_argument("--do-sample", action="store_true", help="multinomial family (default: greedy)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature T >= 0 (0 = greedy branch)")
    parser.add_argument("--top-k", type=int, default=None, help="keep exactly the k highest scores (sampling)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass p in (0, 1] (sampling)")
    parser.add_argument("--min-p", type=float, default=None, help="keep p >= min_p * p_max (sampling)")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="sign-aware repetition penalty r > 0 over prompt and output")
    parser.add_argument("--order", choices=("default", "hf", "vllm", "llama.cpp"), default="default", help="transform order preset (default: the normative order)")
    parser.add_argument("--cache", choices=("none", "dynamic", "static"), default="dynamic",
                        help="cache family: none (recompute the committed prefix each call), dynamic (default), static")
    parser.add_argument("--capacity", type=int, default=None, help="static cache slots (default L + G + 1)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill in chunks of at most N tokens (cached families)")
    parser.add_argument("--repair", action="store_true", help="final_cache = all_outputs: process the closed final token with the append/repair call")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="attention implementation (default sdpa)")
    parser.add_argument("--decode-kernel", choices=("torch", "native"), default="torch",
                        help="native: one-row float32 CPU decode calls on a static cache run in the C kernel (default torch)")
    parser.add_argument("--trace", metavar="FILE", help="write the decodespec.events.v1 event trace (NDJSON) to FILE")
    parser.add_argument("--trace-content", action="store_true",
                        help="keep the raw content in the --trace file (prompt and output ids, streamed text, stop strings); "
                        "recorded in its header as data.classification 'content', opt_in true. Default: redacted (digests and counts)")
    parser.add_argument("--snapshot", metavar="FILE", help="write a resumable snapshot to FILE (JSON) and FILE.safetensors")
    parser.add_argument("--snapshot-content", action="store_true",
                        help="keep the prompt text in the --snapshot file (default: dropped; token ids and K/V are always kept)")
    parser.add_argument("--snapshot-form", choices=("pending_suffix", "repaired"), default="pending_suffix",
                        help="snapshot form (default pending_suffix; repaired runs the append call first)")
    parser.add_argument("--snapshot-at", type=int, default=None, metavar="N",
                        help="suspend after N committed tokens and snapshot there (needs --snapshot)")
    parser.add_argument("--resume", metavar="FILE", help="continue the request of a snapshot written by --snapshot")
    parser.add_argument("--stop", action="append", default=None, metavar="STR",
                        help="stop string, matched on the output's UTF-8 bytes (repeatable)")
    parser.add_argument("--include-stop", action="store_true", help="keep the matched stop string in the returned text")
    parser.add_argument("--align", choices=("token", "text", "span"), default=None,
                        help="output contract after a stop / structured cut (default: the envelope's token)")
    parser.add_argument("--min-new-tokens", type=int, default=None, metavar="N",
                        help="suppress EOS and stop strings until N tokens are committed")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="the tokenizer's EOS does not stop the request (termination.ignore_eos; vLLM's and llama.cpp's ignore_eos)")
    parser.add_argument("--json-mode", action="store_true",
                        help="structured completion: finish where one JSON value completes (structured_error on invalid JSON)")
    parser.add_argument("--stream", action="store_true",
                        help="print text chunks as they pass the stream commit horizon (with --json: one JSON line per chunk, "
                        "then the result object)")
    parser.add_argument("--num-beams", type=int, default=None, metavar="K",
                        help="beam search with K live beams (the beam family; refused with --do-sample, --stream, snapshots)")
    parser.add_argument("--length-penalty", type=float, default=None, metavar="A",
                        help="beam length penalty alpha: score / |y|**alpha (default 1.0, HF's)")
    parser.add_argument("--early-stopping", choices=("true", "false", "never", "exact"), default=None,
                        help="beam termination: HF's true / false (default) / never, or the spec's exact bound")
    parser.add_argument("--prompt-logprobs", nargs="?", const="none", choices=("none", "omitted"), default=None, metavar="FIRST",
                        help="return prompt logprobs (output.prompt_logprobs, M3.10 0x02): row i of the prefill scores prompt token "
                        "i + 1; FIRST is the answer for token 0, which no row scores: none (default: an entry with a null "
                        "logprob) or omitted (no entry)")
    parser.add_argument("--prompt-logprobs-top-k", type=int, default=None, metavar="K",
                        help="with --prompt-logprobs: also the K (0..20) most likely ids of each prompt row, with ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run one request and print the result; returns the exit code."""
    from decodespec.impl.device import resolve_device, resolve_dtype
    from decodespec.impl.events import FileSink
    from decodespec.impl.gguf import MODEL_FILE_MISSING
    from decodespec.impl.runtime import RequestRunner
    from decodespec.impl.snapshot import load_snapshot
    from decodespec.spec.errors import DecodeSpecError

    refused = _beam_refusal(args) or _flag_refusal(args)
    if refused is not None:
        print(json.dumps({"error": refused}), file=sys.stderr)
        return 2
    sink = None
    outputs = _Outputs(args.trace, args.snapshot)
    try:
        outputs.check()
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype)
        snapshot = load_snapshot(args.resume) if args.resume else None
        model, tokenizer = _load(args.model, dtype, device, args.attention)
        model.set_decode_kernel(args.decode_kernel)
        info = {"device": str(device), "dtype": args.dtype, "attention": args.attention, "decode_kernel": args.decode_kernel,
                "model": args.model}
        request = None
        if args.request or snapshot is None:
            request = _admitted_request(args, model, tokenizer)
        sink = FileSink(outputs.trace_temp(), content=args.trace_content) if args.trace else None
        if request is not None and request.policy.family.value == "beam":
            code = _run_beams(args, model, tokenizer, request, sink, info)
            sink = _close(sink)
            outputs.commit(None)
            return code
        streamed = (request if request is not None else snapshot.request).stream
        on_chunk = _chunk_printer(args.json) if streamed else None
        if snapshot is not None:
            runner = RequestRunner.restore(model, snapshot, request, sink=sink, tokenizer=tokenizer, runtime_info=info, on_chunk=on_chunk)
        else:
            runner = RequestRunner(model, request, sink=sink, tokenizer=tokenizer, runtime_info=info, on_chunk=on_chunk)
        runner.run(max_outputs=args.snapshot_at)
        snap = runner.snapshot(args.snapshot_form) if args.snapshot else None  # emits the trace's snapshot event
        sink = _close(sink)
        outputs.commit(snap, content=args.snapshot_content)
        result = runner.result()
    except DecodeSpecError as exc:
        print(json.dumps({"error": exc.to_json()}), file=sys.stderr)
        return 3 if exc.code == MODEL_FILE_MISSING else 2
    finally:
        _close(sink)
        outputs.discard()
    if args.json:
        payload = result.to_json()
        request = runner.request
        payload.update(model=args.model, device=str(device), dtype=args.dtype, attention=args.attention,
                       decode_kernel=args.decode_kernel, seed=request.seed,
                       identity=request.identity, policy=runner.policy.to_json(), cache=request.cache,
                       suspended=runner.suspended, snapshot=args.snapshot)
        print(json.dumps(payload, ensure_ascii=False))
    elif streamed:
        if not (result.stream or {}).get("failed"):
            print()  # the chunks were printed as they were published
    else:
        print(result.text)
    return 0


#: Flags that describe the request itself: ``--request FILE`` and ``--resume FILE`` carry their own
#: request, so any of these set to a non-default value conflicts with them (dest -> flag).
_REQUEST_FLAGS = {
    "prompt": "--prompt", "chat": "--chat", "max_new_tokens": "--max-new-tokens", "seed": "--seed",
    "do_sample": "--do-sample", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
    "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "order": "--order", "cache": "--cache",
    "capacity": "--capacity", "prefill_chunk": "--prefill-chunk", "repair": "--repair", "stop": "--stop",
    "include_stop": "--include-stop", "align": "--align", "min_new_tokens": "--min-new-tokens", "ignore_eos": "--ignore-eos",
    "json_mode": "--json-mode", "stream": "--stream", "num_beams": "--num-beams",
    "length_penalty": "--length-penalty", "early_stopping": "--early-stopping", "timeout_ms": "--timeout-ms",
    "prompt_logprobs": "--prompt-logprobs", "prompt_logprobs_top_k": "--prompt-logprobs-top-k",
}
_DEFAULTS: dict[str, Any] = {"max_new_tokens": 64, "seed": 0, "order": "default", "cache": "dynamic"}


def _flag_refusal(args: argparse.Namespace) -> dict[str, Any] | None:
    """The typed error (``runtime.invalid_request``) for flags that contradict each other, or ``None``.

    Checked before anything is loaded: a request source is missing; ``--request`` with
    ``--resume``; request flags (:data:`_REQUEST_FLAGS`) set away from their defaults next to
    ``--request`` / ``--resume`` (they would be ignored); ``--snapshot-at`` without ``--snapshot``
    or negative; ``--capacity`` without ``--cache static``.
    """

    def error(path: str, message: str) -> dict[str, Any]:
        return {"code": "runtime.invalid_request", "path": path, "message": message}

    if not (args.prompt is not None or args.request or args.resume):
        return error("$.prompt", "give --prompt, --request FILE or --resume FILE")
    if args.request and args.resume:
        return error("$.resume", "--request and --resume conflict: a snapshot carries its own request")
    source = "--resume" if args.resume else "--request" if args.request else None
    if source is not None:
        given = [flag for dest, flag in _REQUEST_FLAGS.items()
                 if getattr(args, dest, None) not in (None, False) and getattr(args, dest) != _DEFAULTS.get(dest)]
        if given:
            what = "the snapshot's request" if source == "--resume" else "the envelope FILE"
            return error("$." + source[2:], f"{', '.join(given)} conflict{'s' if len(given) == 1 else ''} with {source}: "
                         f"{what} fixes the prompt, policy, termination and cache; drop {'it' if len(given) == 1 else 'them'}")
    if args.snapshot_at is not None and not args.snapshot:
        return error("$.snapshot_at", "--snapshot-at needs --snapshot FILE")
    if args.snapshot_at is not None and args.snapshot_at < 0:
        return error("$.snapshot_at", f"--snapshot-at {args.snapshot_at}: N counts committed tokens, N >= 0")
    if getattr(args, "prompt_logprobs_top_k", None) is not None and getattr(args, "prompt_logprobs", None) is None:
        return error("$.output.prompt_logprobs.top_k", "--prompt-logprobs-top-k needs --prompt-logprobs")
    if args.capacity is not None and args.cache != "static":
        return error("$.runtime.static_capacity", f"--capacity sizes a static cache; it needs --cache static, not --cache {args.cache}")
    if getattr(args, "trace_content", False) and not args.trace:
        return error("$.trace_content", "--trace-content keeps the content of the --trace file; it needs --trace FILE")
    if getattr(args, "snapshot_content", False) and not args.snapshot:
        return error("$.snapshot_content", "--snapshot-content keeps the prompt text of the --snapshot file; it needs --snapshot FILE")
    return None


def _close(sink):
    if sink is not None:
        sink.close()


class _Outputs:
    """The command's output files: checked before any work, written to temporaries, renamed on success.

    ``--trace FILE`` is written to a temporary file next to ``FILE`` and renamed onto it; the
    snapshot (``FILE`` and ``FILE.safetensors``) is written into a temporary folder next to
    ``FILE`` and both files are renamed into place (tensors first).  :meth:`discard` removes
    whatever temporaries remain, so a failed command leaves no partial or orphan file.
    """

    def __init__(self, trace: str | None, snapshot: str | None):
        from pathlib import Path

        self.trace = Path(trace) if trace else None
        self.snapshot = Path(snapshot) if snapshot else None
        self._temps: list[Path] = []
        self._trace_temp: Path | None = None

    def check(self) -> None:
        """Raises ``Rejection`` (``cli.io_error``) for an output path that cannot be written."""
        import os

        from decodespec.checks.commands.cli import IO_ERROR
        from decodespec.spec.errors import Rejection

        paths = [("--trace", self.trace)]
        if self.snapshot is not None:
            paths += [("--snapshot", self.snapshot), ("--snapshot", self.snapshot.with_name(self.snapshot.name + ".safetensors"))]
        for flag, path in paths:
            if path is None:
                continue
            parent = path.parent
            if path.is_dir():
                raise Rejection(IO_ERROR, f"{flag} {path}: is a directory", "$." + flag[2:])
            if not parent.is_dir():
                raise Rejection(IO_ERROR, f"{flag} {path}: the folder {parent} does not exist", "$." + flag[2:])
            if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise Rejection(IO_ERROR, f"{flag} {path}: not writable", "$." + flag[2:])

    def trace_temp(self):
        """A fresh temporary path next to the trace file (removed by :meth:`discard` unless committed)."""
        import os
        import tempfile
        from pathlib import Path

        fd, name = tempfile.mkstemp(prefix=f".{self.trace.name}.", suffix=".tmp", dir=self.trace.parent)
        os.close(fd)
        self._trace_temp = Path(name)
        self._temps.append(self._trace_temp)
        return name

    def commit(self, snapshot, *, content: bool = False) -> None:
        """Write ``snapshot`` (when given; its prompt text only with ``content``) and move every output into place."""
        import os
        import shutil

        from decodespec.impl.events import staging_folder
        from decodespec.impl.snapshot import save_snapshot

        if snapshot is not None:
            folder = staging_folder(self.snapshot)  # locked; a killed run's stale folder is removed here
            self._temps.append(folder)
            doc, tensors = save_snapshot(snapshot, folder / self.snapshot.name, content=content)
            os.chmod(tensors, 0o666 & ~_umask())
            os.replace(tensors, self.snapshot.with_name(tensors.name))
            os.replace(doc, self.snapshot)
            shutil.rmtree(folder, ignore_errors=True)
        if self._trace_temp is not None:
            os.chmod(self._trace_temp, 0o666 & ~_umask())
            os.replace(self._trace_temp, self.trace)
        self._temps.clear()

    def discard(self) -> None:
        import shutil

        for temp in self._temps:
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)
        self._temps.clear()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def _chunk_printer(as_json: bool):
    """The stream consumer: write each published chunk to stdout at once (a failing write is a stream_error)."""

    def deliver(chunk) -> None:
        sys.stdout.write(json.dumps(chunk.to_json(), ensure_ascii=False) + "\n" if as_json else chunk.text)
        sys.stdout.flush()

    return deliver


def _beam_refusal(args: argparse.Namespace) -> dict[str, Any] | None:
    """The typed error for beam flags combined with what the beam runtime cannot honour, or ``None``."""
    if getattr(args, "num_beams", None) is None:
        return None
    for flag, given in (("--do-sample", args.do_sample), ("--stream", getattr(args, "stream", False)),
                        ("--snapshot", args.snapshot), ("--snapshot-at", args.snapshot_at is not None), ("--resume", args.resume)):
        if given:
            return {"code": "runtime.beam_unsupported", "path": "$.policy.num_beams",
                    "message": f"--num-beams cannot be combined with {flag}: beam search here is deterministic, "
                               "returns whole hypotheses at the end and keeps no resumable state"}
    return None


def _run_beams(args: argparse.Namespace, model, tokenizer, request, sink, info: dict[str, Any]) -> int:
    """Run a beam-family request with :class:`decodespec.impl.beam.BeamRunner` and print the result.

    Raises:
        DecodeSpecError: ``runtime.beam_unsupported`` (snapshots; and what the runner refuses).
    """
    from decodespec.impl.beam import BEAM_UNSUPPORTED, BeamRunner
    from decodespec.spec.errors import Rejection

    if args.snapshot or args.snapshot_at is not None:
        raise Rejection(BEAM_UNSUPPORTED, "a beam search keeps no resumable snapshot", "$.snapshot")
    if request.prompt_logprobs is not None:  # a RuntimeRequest (_admitted_request)
        raise Rejection(BEAM_UNSUPPORTED, "the beam runner returns no prompt logprobs (output.prompt_logprobs)", "$.output.prompt_logprobs")
    runner = BeamRunner(model, request, sink=sink, tokenizer=tokenizer, runtime_info=info).run()
    result = runner.result()
    if args.json:
        payload = result.to_json()
        payload.update(model=args.model, device=info["device"], dtype=args.dtype, attention=args.attention,
                       decode_kernel=args.decode_kernel, seed=request.seed,
                       identity=request.identity, policy=runner.policy.to_json(), cache=request.cache, suspended=False)
        print(json.dumps(payload, ensure_ascii=False))
    else:
        print("" if result.best is None else result.best.text)
    return 0


def _admitted_request(args: argparse.Namespace, model, tokenizer):
    """The runtime request: ``--request FILE`` admitted, or the flags' envelope admitted."""
    from pathlib import Path

    import attrs

    from decodespec.impl.runtime import RuntimeRequest
    from decodespec.spec.envelope import EMPTY_PROMPT, validate_request_envelope
    from decodespec.spec.errors import Rejection

    if args.request:
        try:
            raw = Path(args.request).read_bytes()
        except OSError as exc:
            raise Rejection("runtime.invalid_request", f"cannot read {args.request}: {exc}", "$.request") from None
    else:
        raw = json.dumps(envelope_from_flags(args, model, tokenizer), ensure_ascii=False).encode("utf-8")
    try:
        admitted, _identity = validate_request_envelope(raw)
    except Rejection as exc:
        if exc.code != EMPTY_PROMPT or args.request:
            raise
        raise Rejection(EMPTY_PROMPT, f"an empty prompt needs a declared start state; {_DISPLAY[args.model]} declares none "
                        "(give a non-empty --prompt, or --chat to wrap it in the chat template)", "$.prompt") from None
    _check_artifact(admitted, args.model, model, tokenizer)
    # Receipts carry the ordered vocabulary hash, also when the envelope states the older program hash.
    return attrs.evolve(RuntimeRequest.from_admitted(admitted), vocab_hash=tokenizer.vocab_hash)


def _check_artifact(admitted, name: str, model, tokenizer) -> None:
    from decodespec.impl.runtime import ARTIFACT_MISMATCH
    from decodespec.spec.errors import Rejection

    checkpoint = _checkpoint_sha256(name, model)
    ti = admitted.text_interface
    # text_interface.tokenizer_sha256 is the ordered vocabulary hash (spec.vocab.vocab_table_hash, tokenizer.vocab_hash);
    # an envelope written before the two hashes were unified states the tokenizer's program hash, still admitted.
    stated_vocab = tokenizer.vocab_hash if ti.tokenizer_sha256 == getattr(tokenizer, "program_sha256", None) else ti.tokenizer_sha256
    for what, stated, loaded in (
        ("artifact.checkpoint_sha256", admitted.artifact.checkpoint_sha256, checkpoint),
        ("text_interface.tokenizer_sha256", stated_vocab, tokenizer.vocab_hash),
        ("text_interface.vocab_size", ti.vocab_size, model.config.vocab_size),
    ):
        if stated != loaded:
            raise Rejection(ARTIFACT_MISMATCH, f"the envelope's {what} is {stated!r} but the loaded {name} model has {loaded!r}", f"$.{what}")


def envelope_from_flags(args: argparse.Namespace, model, tokenizer) -> dict[str, Any]:
    """The ``numinens.request.v1`` envelope the flags describe (validated by the caller)."""
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = list(tokenizer.encode(text))
    if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    eos = sorted({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    text_interface: dict[str, Any] = {"tokenizer_sha256": tokenizer.vocab_hash, "vocab_size": model.config.vocab_size, "eos_ids": eos}
    if tokenizer.bos_token_id is not None and tokenizer.bos_token_id not in eos:
        text_interface["bos_id"] = tokenizer.bos_token_id
    if getattr(tokenizer, "pad_token_id", None) is not None:
        text_interface["pad_id"] = tokenizer.pad_token_id
    runtime: dict[str, Any] = {
        "framework_revision": f"decodespec-0.1.0+torch-{torch.__version__.split('+')[0]}",
        "compute_dtype": args.dtype,
        "logit_dtype": "float32",
        "cache_family": args.cache,
        "cache_abi": "none" if args.cache == "none" else "per_layer_compact_kv_rotated",
        "attention": args.attention,
        "append_repair": bool(args.repair),
    }
    if args.cache == "static":
        g = max(args.max_new_tokens, 0)
        runtime["static_capacity"] = static_capacity("static", args.capacity, len(prompt_ids), g, model.config.max_position_embeddings)
    if args.prefill_chunk is not None:
        runtime["prefill_chunk"] = args.prefill_chunk
    final_cache = "none" if args.cache == "none" else ("all_outputs" if args.repair else "processed_inputs_only")
    return {
        "schema": "numinens.request.v1",
        "artifact": {"release_id": _RELEASE[args.model], "checkpoint_sha256": _checkpoint_sha256(args.model, model), "architecture": "decoder_only"},
        "text_interface": text_interface,
        "prompt": {"input_ids": prompt_ids, "attention_mask": [1] * len(prompt_ids), "text": text},
        "position_visibility": {"mode": "causal", "position_rule": "valid_token_cumsum", "cache_position_start": 0,
                                "max_context": model.config.max_position_embeddings},
        "policy": policy_json(args),
        "rng": {"algorithm": "philox", "seed": args.seed, "counter": 0},
        "runtime": runtime,
        "termination": _termination(args, eos),
        "output": _output(args, final_cache),
    }


def _termination(args: argparse.Namespace, eos: list[int]) -> dict[str, Any]:
    """The envelope's termination plane from the flags (only the fields a flag sets; defaults otherwise)."""
    term: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "eos_ids": eos}
    if getattr(args, "ignore_eos", False):
        term.update(eos_ids=[], ignore_eos=True)
    if getattr(args, "min_new_tokens", None) is not None:
        term["min_new_tokens"] = args.min_new_tokens
    if getattr(args, "stop", None):
        term["stop_strings"] = list(args.stop)
    if getattr(args, "json_mode", False):
        term["structured"] = "json"
    if getattr(args, "timeout_ms", None) is not None:
        term["timeout_ms"] = args.timeout_ms
    return term


def _output(args: argparse.Namespace, final_cache: str) -> dict[str, Any]:
    """The envelope's output plane from the flags."""
    out: dict[str, Any] = {"return_token_ids": True, "return_logprobs": True, "final_cache": final_cache}
    if getattr(args, "include_stop", False):
        out["include_stop_str"] = True
    if getattr(args, "align", None) is not None:
        out["alignment"] = args.align
    if getattr(args, "stream", False):
        out["stream"] = True
    if getattr(args, "prompt_logprobs", None) is not None:
        out["prompt_logprobs"] = {"first_token": args.prompt_logprobs}
        if args.prompt_logprobs_top_k is not None:
            out["prompt_logprobs"]["top_k"] = args.prompt_logprobs_top_k
    return out


_DISPLAY = {"smollm2": "SmolLM2", "tiny": "the tiny model"}
_RELEASE = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct.Q4_1.gguf", "tiny": "decodespec-tiny-llama-seed0"}


def _checkpoint_sha256(name: str, model) -> str:
    if name == "tiny":
        return tiny_checkpoint_sha256(0)
    from decodespec.impl.gguf import file_sha256, smollm2_path

    return file_sha256(smollm2_path())


@functools.lru_cache(maxsize=4)
def tiny_checkpoint_sha256(seed: int = 0) -> str:
    """The tiny model's artifact identity: SHA-256 over its float32 state dict (names in sorted order, NUL, bytes)."""
    import torch

    from decodespec.impl.tiny import load_tiny

    digest = hashlib.sha256()
    for key, value in sorted(load_tiny(seed=seed, device="cpu").state_dict().items()):
        digest.update(key.encode() + b"\x00")
        digest.update(value.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return "sha256:" + digest.hexdigest()


def policy_json(args: argparse.Namespace) -> dict:
    """The M3.8 policy JSON object the sampling flags describe (validated by ``policy_config_from_json``).

    Warpers given without ``--do-sample`` are kept, so that the policy rejects them
    (``policy.warper_requires_sampling``) instead of silently ignoring them.
    """
    transforms = []
    if args.repetition_penalty is not None:
        transforms.append({"name": "repetition_penalty", "penalty": args.repetition_penalty})
    if args.temperature is not None:
        transforms.append({"name": "temperature", "temperature": args.temperature})
    if args.top_k is not None:
        transforms.append({"name": "top_k", "k": args.top_k})
    if args.top_p is not None:
        transforms.append({"name": "top_p", "p": args.top_p})
    if args.min_p is not None:
        transforms.append({"name": "min_p", "p": args.min_p})
    policy: dict[str, Any] = {"family": "multinomial" if args.do_sample else "greedy", "order": args.order, "transforms": transforms}
    # Beam flags (kept outside the beam family too, so that the policy rejects them there).
    if getattr(args, "num_beams", None) is not None:
        policy["family"] = "beam"
        policy["num_beams"] = args.num_beams
    if getattr(args, "length_penalty", None) is not None:
        policy["length_penalty"] = args.length_penalty
    if getattr(args, "early_stopping", None) is not None:
        policy["early_stopping"] = args.early_stopping
    return policy


def _load(name: str, dtype, device, attention: str):
    if name == "tiny":
        from decodespec.impl.tiny import TINY_VOCAB_SIZE, load_tiny
        from decodespec.impl.tokenizer import ByteTokenizer

        return load_tiny(dtype=dtype, device=device, attn_implementation=attention), ByteTokenizer(TINY_VOCAB_SIZE)
    from decodespec.impl.tokenizer import load_smollm2_tokenizer
    from decodespec.impl.weights import load_smollm2

    return load_smollm2(dtype=dtype, device=device, attn_implementation=attention), load_smollm2_tokenizer()
