"""``decodespec explore``: exhaustive small-scope check of the request state machine.

Enumerates every reachable state for the given bounds (:mod:`decodespec.checks.modelcheck.explore`),
checks every invariant on every state and that the controller never deadlocks, and prints a
JSON report: state and transition counts, states per second, rule and phase-edge coverage,
rejected attempts, unexercised transitions and violations.  A violation is written as an ITF
trace (``--itf-out``, default ``counterexample.itf.json`` in the current directory) and the
command exits 1.

Bounds are checked before anything is explored
(:func:`~decodespec.checks.modelcheck.explore.params_for_bounds`): bounds that describe no admissible
request (a non-positive prefill chunk, vocabulary, capacity or context cap, negative draws or
retries, ``min_new_tokens > max_new_tokens``, a prefix-LM prefix the prefill chunk cannot hold)
print ``{"ok": false, "error": {"code": "explore.invalid_bounds", "path", "message"}}`` and exit
2, writing nothing.  Without ``--prefill-chunk``, a ``prefix_lm`` profile prefills its prefix in
one chunk (default chunk: the prefix length, at least the decoder-only default 2).

Exit codes: 0 every invariant holds, 1 a violation (counterexample written), 2 invalid bounds.

Source: research/formal-anchors-survey.md 3.1 (TLC), 5.1 (ITF).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: ``--prefill-chunk`` not given: the profile's default (see :func:`_prefill_chunk`); not a string,
#: so argparse does not convert it.
_PROFILE_DEFAULT = object()


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _prefill_chunk(args: argparse.Namespace, default: int | None) -> int | None:
    """``--prefill-chunk``, else the default chunk; a ``prefix_lm`` prefix is never split by the default."""
    if args.prefill_chunk is not _PROFILE_DEFAULT:
        return args.prefill_chunk
    if args.profile == "prefix_lm" and default is not None:
        prefix = args.prefix_length if args.prefix_length is not None else args.prompt_len
        return max(default, prefix)
    return default


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``explore`` subcommand (defaults are :class:`~decodespec.checks.modelcheck.explore.ExploreBounds`')."""
    from decodespec.checks.modelcheck.explore import ExploreBounds

    d = ExploreBounds()
    p = subparsers.add_parser(
        "explore",
        help="exhaustively check the request state machine for small bounds",
        description="Breadth-first search of every reachable request state under controller and adversarial "
        "environment actions; every invariant on every state, no deadlock; shortest counterexample as ITF.",
    )
    p.add_argument("--vocab", type=int, default=d.vocab, help=f"vocabulary size V (the last id is EOS); default {d.vocab}")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help=f"prompt length L (decoder side); default {d.prompt_len}")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"G; default {d.max_new_tokens}")
    p.add_argument("--min-new-tokens", type=int, default=d.min_new_tokens, help=f"EOS excluded while O < this (<= G); default {d.min_new_tokens}")
    p.add_argument("--profile", choices=["decoder_only", "encoder_decoder", "prefix_lm", "hybrid"], default=d.profile,
                   help=f"default {d.profile}")
    p.add_argument("--cache", choices=["none", "dynamic", "static"], default=d.cache, help=f"default {d.cache}")
    p.add_argument("--capacity", type=int, default=None, help="static-cache slots (default the spec's: L + G + 1)")
    p.add_argument("--context-cap", type=int, default=None, help="total-length cap C (>= L + 1 when G >= 1; default L + G + 1)")
    p.add_argument("--prefill-chunk", type=_optional_int, default=_PROFILE_DEFAULT,
                   help=f"largest prefill chunk (>= 1), or 'none' for one-shot; default {d.prefill_chunk} "
                   "(prefix_lm: the prefix length when larger)")
    p.add_argument("--prefix-length", type=int, default=None, help="prefix-LM prefix (default L)")
    p.add_argument("--source-len", type=int, default=d.source_len, help=f"encoder-decoder source length S; default {d.source_len}")
    p.add_argument("--zero-new-tokens", choices=["reject", "no_call", "prefill_only"], default=d.zero_new_tokens,
                   help=f"the G = 0 branch; default {d.zero_new_tokens}")
    p.add_argument("--final-cache", choices=["processed_inputs_only", "all_outputs"], default=d.final_cache,
                   help=f"default {d.final_cache}")
    p.add_argument("--max-retries", type=int, default=d.max_retries, help=f"retries after recovery (>= 0); default {d.max_retries}")
    p.add_argument("--draws", type=int, default=d.max_draws,
                   help=f"max RNG draws per decision (>= 0; 0 greedy, 1 multinomial); default {d.max_draws}")
    p.add_argument("--ranks", type=int, default=d.ranks,
                   help=f"R declared participants of every call (>= 1; 1 = one process; M3.10 0x0A); default {d.ranks}")
    p.add_argument("--collectives", type=int, default=d.collectives,
                   help=f"collectives per call in the ranks' common schedule (>= 0, with --ranks > 1); default {d.collectives}")
    p.add_argument("--no-stream", action="store_true", help="no streamer (no streamer failures)")
    p.add_argument("--stop-strings", action="store_true", help="declare stop strings (stop_string trigger)")
    p.add_argument("--structured", action="store_true", help="declare structured completion")
    p.add_argument("--no-interrupts", action="store_true", help="no cancel / timeout actions")
    p.add_argument("--no-faults", action="store_true", help="no faults or failing completion reports")
    p.add_argument("--no-adversarial", action="store_true", help="no must-be-rejected actions")
    p.add_argument("--all-violations", action="store_true", help="keep searching after the first violation")
    p.add_argument("--itf-out", type=Path, default=Path("counterexample.itf.json"),
                   help="where to write the first violation's counterexample (ITF), written only on a violation; "
                   "default ./counterexample.itf.json (the current directory)")
    return p


def run(args: argparse.Namespace) -> int:
    """Explore; print the JSON report; write an ITF counterexample on violation."""
    from decodespec.checks.modelcheck import itf
    from decodespec.checks.modelcheck.explore import ExploreBounds, explore, params_for_bounds
    from decodespec.spec.errors import DecodeSpecError

    bounds = ExploreBounds(
        vocab=args.vocab, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens, profile=args.profile, cache=args.cache, capacity=args.capacity,
        context_cap=args.context_cap, prefill_chunk=_prefill_chunk(args, ExploreBounds().prefill_chunk), prefix_length=args.prefix_length,
        source_len=args.source_len, zero_new_tokens=args.zero_new_tokens, final_cache=args.final_cache,
        max_retries=args.max_retries, max_draws=args.draws, stream=not args.no_stream,
        stop_strings=args.stop_strings, structured=args.structured, interrupts=not args.no_interrupts,
        faults=not args.no_faults, adversarial=not args.no_adversarial, ranks=args.ranks, collectives=args.collectives,
    )
    try:
        params = params_for_bounds(bounds)
    except DecodeSpecError as exc:
        print(json.dumps({"ok": False, "error": exc.to_json()}))
        return 2
    result = explore(params, bounds, stop_on_violation=not args.all_violations)
    report = result.summary()
    if result.violations:
        itf.write_trace(args.itf_out, result.violations[0].to_itf(params, bounds))
        report["counterexample"] = str(args.itf_out)
    print(json.dumps(report, indent=1))
    return 0 if result.ok else 1
