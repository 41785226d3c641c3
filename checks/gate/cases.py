"""The gate's case table: the SmolLM2 correctness matrix, the boundary cases and adversarial interleavings.

One table (:func:`cases_for`) serves every runtime: ``pytest checks/`` and ``decodespec check``
run it for ``--runtime`` / ``--model``, and the peer engineer's matrix files import it for HF
and llama.cpp.  A :class:`Case` is one of:

* ``lockstep``: one config and a list of contract actions driven in lock step with the spec
  (:class:`~decodespec.checks.gate.lockstep.LockStep`);
* ``pair``: two configs driven with the same actions, each in lock step, and then compared
  with each other step by step (the correctness matrix's "A versus B": ids, frontiers, cache
  lengths, score rows and K/V rows within twice the declared tolerance -- both sides are within
  epsilon of the same reference);
* ``resume``: an uninterrupted run versus the same request snapshotted after ``resume_at``
  actions, restored and continued (RESUME: ``Continue(Restore(S), n) == Continue(S, n)``);
* ``custom``: a runtime-specific procedure (padded batches, beam width 1), registered per
  runtime in :data:`decodespec.checks.gate.procedures.CUSTOM` (a runtime without one skips the case with that reason);
* ``prompt_logprobs``: the runtime's prompt logprobs (M3.10 0x02) under one-shot and chunked
  prefill, the static cache and the no-cache path, judged against the float64 reference at
  STATE / TENSOR / DECISION (:func:`~decodespec.checks.gate.prompt_logprobs.run_prompt_logprobs_case`;
  needs the ``output.prompt_logprobs`` capability).

:func:`run_case` returns a :class:`CaseResult` (``pass`` / ``fail`` / ``deviation`` /
``undecided`` / ``skip``, the ladder layer, rule and check, expected, actual, a message and, for
a lock-step failure, the replayable trace).  A case is a ``skip`` with the missing names when its
configs need a capability the runtime does not declare (its ``requires`` and every feature the
configs set, :func:`~decodespec.checks.adapters.config_capabilities`), and a ``skip`` with the
runtime's reason when the runtime refuses a config with ``adapter.unsupported`` (never a fail).  A failure that a runtime's expectations file
(``checks/gate/expectations/<runtime>.toml``, :func:`load_expectations`) documents is reported as
``deviation``; :func:`unused_expectations` lists documented deviations of the cases that ran and
did not occur (a fixed deviation must be removed from the file).

Source: M3.10 "Correctness matrix", "Boundary cases" (prompt shapes and adversarial state
transitions), 0x0B failure lab; research/formal-anchors-survey.md 4 (conformance suites and
expectation files: test262 / JSON-Schema-Test-Suite / Bowtie).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from decodespec.spec.errors import DecodeSpecError

from ..adapters import CORRUPTIONS, AdapterUnavailable, CaseConfig, config_capabilities
from ..modelcheck.traces import make_trace, open_runtime
from .coverage import record_lockstep
from .divergence import pair_verdict
from .ladder import FAILED, PASSED, UNDECIDED, Verdict
from .lockstep import LockStep
from .procedures import CUSTOM
from .prompts import greedy_continuation, prompt_ids

__all__ = [
    "EXPECTATIONS_DIR",
    "Case",
    "CaseResult",
    "Expectation",
    "cases_for",
    "load_expectations",
    "report_line",
    "run_case",
    "unused_expectations",
]

EXPECTATIONS_DIR = Path(__file__).resolve().parent / "expectations"
_M = "M3.10 Correctness matrix"
_B = "M3.10 Boundary cases"


def _steps(n: int) -> tuple[dict[str, Any], ...]:
    return tuple({"op": "step"} for _ in range(n))


@attrs.frozen
class Case:
    """One gate case (see the module docstring).

    Attributes:
        id: Stable id, ``matrix.*``, ``boundary.*`` or ``adversarial.*``.
        kind: ``lockstep``, ``pair``, ``resume``, ``custom`` or ``prompt_logprobs``.
        description: One sentence.
        section: The seed section it checks.
        config: The case config (the first side of a pair).
        actions: Contract actions after the reset.
        other: The second config of a pair.
        compare: What a pair compares: ``ids``, ``frontier``, ``cache``, ``logits``, ``kv``,
            ``rng``, ``text``.
        resume_at: For ``resume``: how many actions run before the snapshot.
        form: For ``resume``: the snapshot form.
        requires: Capabilities the runtime must declare.
    """

    id: str
    kind: str
    description: str
    section: str
    config: CaseConfig
    actions: tuple[dict[str, Any], ...] = ()
    other: CaseConfig | None = None
    compare: tuple[str, ...] = ("ids", "frontier", "logits")
    resume_at: int = 0
    form: str = "pending_suffix"
    requires: frozenset[str] = frozenset()


# --------------------------------------------------------------------------------------------
# Prompts.
# --------------------------------------------------------------------------------------------


def _spanning_stop(model: str, prompt: Sequence[int], n: int) -> tuple[str, str, int]:
    """``(stop, longer, i)``: a 2-character stop string spanning output tokens ``i`` and ``i + 1`` (ASCII), and a
    3-character one sharing its prefix."""
    from ..adapters.impl import load_tokenizer

    tok = load_tokenizer(model)
    ids = list(greedy_continuation(model, tuple(prompt), n))
    pieces = [tok.token_bytes(t) if t not in getattr(tok, "special_ids", ()) and t != 2 else b"" for t in ids]
    for i in range(len(pieces) - 2):
        a, b, c = pieces[i], pieces[i + 1], pieces[i + 2]
        if a and b and a.isascii() and b.isascii() and a[-1:].strip() and b[:1].strip():
            stop = (a[-1:] + b[:1]).decode()
            longer = stop + ((b[1:2] or c[:1]) or b"?").decode("ascii", errors="replace")
            return stop, longer, i
    return "e", "ea", 0


# --------------------------------------------------------------------------------------------
# The table.
# --------------------------------------------------------------------------------------------

SAMPLED = {"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}]}
#: Nucleus sampling (the crossing token kept), full-vocabulary repetition penalty, temperature 0 in
#: a sampling policy (the greedy branch), and three ids tied far above the rest under top-k 2.
NUCLEUS = {"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.7}, {"name": "top_p", "p": 0.9}]}
PENALTY = {"family": "multinomial", "transforms": [{"name": "repetition_penalty", "penalty": 1.5}, {"name": "temperature", "temperature": 0.9}]}
TEMPERATURE_ZERO = {"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.0}, {"name": "top_k", "k": 5}]}
TIES = {"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {"40": 1e30, "41": 1e30, "42": 1e30}}, {"name": "top_k", "k": 2}]}


def forced(ids: Sequence[int]) -> dict[str, Any]:
    """A greedy policy whose constraint automaton allows exactly ``ids`` in order, then nothing (an empty legal set)."""
    states = {f"s{i}": {str(t): f"s{i + 1}"} for i, t in enumerate(ids)}
    states[f"s{len(ids)}"] = {}
    return {"family": "greedy", "transforms": [{"name": "constraint", "automaton": {"initial": "s0", "transitions": states}}]}


def output_ids(model: str, text: str) -> tuple[int, ...]:
    """The ids of ``text`` as output tokens (no BOS): one byte per token on tiny, the tokenizer's pieces on SmolLM2."""
    ids = prompt_ids(model, text, chat=False)
    return ids[1:] if model == "tiny" else ids


@functools.lru_cache(maxsize=4)
def cases_for(model: str) -> tuple[Case, ...]:
    """Every gate case on ``model`` (``tiny`` or ``smollm2``), in a stable order."""
    tiny = model == "tiny"
    g = 6 if tiny else 5
    hello = prompt_ids(model, "Hello there")
    short = prompt_ids(model, "Hi")
    base = CaseConfig(model=model, prompt_ids=hello, max_new_tokens=g, eos_ids=[2], seed=11)
    static = base.evolve(cache="static")
    cases: list[Case] = []

    def add(*args: Any, **kwargs: Any) -> None:
        cases.append(Case(*args, **kwargs))

    # -- correctness matrix -------------------------------------------------------------------
    add("matrix.no_cache_vs_dynamic", "pair", "No cache versus dynamic cache: logits at every step.", _M,
        base.evolve(cache="none"), _steps(g), other=base, compare=("ids", "logits"), requires=frozenset({"cache:none", "cache:dynamic"}))
    add("matrix.dynamic_vs_static", "pair", "Dynamic versus static cache: logits, token ids, cache lengths.", _M,
        base, _steps(g), other=static, compare=("ids", "frontier", "cache", "logits"), requires=frozenset({"cache:dynamic", "cache:static"}))
    add("matrix.oneshot_vs_chunked", "pair", "One-shot versus chunked prefill: last-row logits and cache tensors.", _M + "; 0x0A",
        base, _steps(2), other=base.evolve(prefill_chunk=3), compare=("ids", "frontier", "cache", "logits", "kv"), requires=frozenset({"prefill_chunk"}))
    add("matrix.static_chunked_prefill", "lockstep", "Chunked prefill into a static cache, chunk by chunk.", _M + "; 0x0A",
        static.evolve(prefill_chunk=2), tuple({"op": "prefill", "chunk": 2} for _ in range((len(hello) + 1) // 2)) + _steps(2),
        requires=frozenset({"prefill_chunk", "cache:static"}))
    add("matrix.eager_vs_sdpa", "pair", "Eager versus optimized (SDPA) attention: logits under tolerance.", _M,
        base, _steps(g), other=base.evolve(attention="eager"), compare=("ids", "logits"))
    native = static.evolve(decode_kernel="native")
    native_needs = frozenset({"cache:static", "decode_kernel:native"})
    add("matrix.torch_vs_native_kernel", "pair", "Torch versus the native CPU decode kernel (static cache): logits, ids, frontier, "
        "cache lengths, K/V rows.", _M + "; 0x09", static, _steps(g), other=native, compare=("ids", "frontier", "cache", "logits", "kv"),
        requires=native_needs)
    add("matrix.native_kernel_lockstep", "lockstep", "The native decode kernel judged by the spec at every step (static cache).",
        _M + "; 0x09", native, tuple(_steps(g)), requires=native_needs)
    add("matrix.seeded_replay", "pair", "Fixed-seed sampled replay: token path and RNG counter.", _M + "; M3.8 RNG",
        base.evolve(policy=SAMPLED), _steps(g), other=base.evolve(policy=SAMPLED), compare=("ids", "rng", "logits"),
        requires=frozenset({"sampling"}))
    add("matrix.sampled_lockstep", "lockstep", "Sampled decoding: the spec replays every draw (policy rows, draw count, RNG counter).",
        _M + "; M3.8 0x0E", base.evolve(policy=SAMPLED, seed=3), tuple(_steps(g)), requires=frozenset({"sampling"}))
    for form in ("pending_suffix", "repaired"):
        add(f"matrix.resume_{form}", "resume", f"Resume from a {form} snapshot equals the uninterrupted run.", _M + "; 0x0B resumable snapshot",
            base.evolve(final_cache="all_outputs" if form == "repaired" else "processed_inputs_only"), ({"op": "run"},),
            resume_at=2, form=form, requires=frozenset({"snapshot"}))
    add("matrix.greedy_vs_beam1", "custom", "Greedy reference versus beam width one: tokens and scores.", _M + "; 0x05", base)
    for side in ("left", "right"):
        add(f"matrix.padded_batch_{side}", "custom", f"Batch size one versus a {side}-padded batch: per-row logits and token path.",
            _M + "; 0x07", base)

    add("matrix.prompt_logprobs", "prompt_logprobs", "Prompt logprobs (row i scores x_{i+1}; first token none / omitted; "
        "top-3 with ranks) against the float64 reference, one-shot versus chunked prefill, static cache and no cache.",
        _M + '; M3.10 0x02 "Prompt logprobs versus generated-token logprobs"', base, requires=frozenset({"output.prompt_logprobs"}))

    # -- boundary cases -------------------------------------------------------------------------
    one = prompt_ids(model, "")[:1]
    add("boundary.one_token_prompt", "lockstep", "A one-token prompt (BOS only).", _B, base.evolve(prompt_ids=one), ({"op": "run"},))
    if tiny:
        window = 1024
        longest = tuple((hello * (window // len(hello) + 1))[: window - 1])
        add("boundary.prompt_at_max_length", "lockstep", "A prompt of window - 1 tokens: one output, then context_length.", _B,
            base.evolve(prompt_ids=longest, cache="static"), ({"op": "run"},), requires=frozenset({"cache:static"}))
    else:
        add("boundary.prompt_at_max_length", "lockstep",
            "A prompt at the maximum declared length (context cap L + 1): one output, then context_length.", _B,
            base.evolve(context_cap=len(hello) + 1), ({"op": "run"},))
    add("boundary.immediate_eos", "lockstep", "EOS forced at the first decision by a logit bias: finish eos, empty text.", _B,
        base.evolve(policy={"family": "greedy", "transforms": [{"name": "logit_bias", "bias": {"2": 100.0}}]}, stream=True),
        ({"op": "run"},))
    add("boundary.min_new_tokens_blocks_eos", "lockstep", "EOS biased up but illegal until min_new_tokens outputs.", _B,
        base.evolve(policy={"family": "greedy", "transforms": [{"name": "logit_bias", "bias": {"2": 100.0}}]}, min_new_tokens=2),
        ({"op": "run"},))
    for branch in ("no_call", "prefill_only", "reject"):
        add(f"boundary.zero_new_tokens_{branch}", "lockstep", f"Zero allowed new tokens, G=0 branch {branch}.", _B + "; The first-output off-by-one",
            base.evolve(max_new_tokens=0, zero_new_tokens=branch), () if branch == "reject" else ({"op": "run"},))
    add("boundary.non_ascii_text", "lockstep", "Non-ASCII prompt and streamed output (UTF-8 holdback in the chunks).", _B,
        base.evolve(prompt_ids=prompt_ids(model, "héllo ✓ 日本"), stream=True), ({"op": "run"},), requires=frozenset({"stream"}))
    stop, longer, stop_at = _spanning_stop(model, hello, g)
    add("boundary.stop_string_spanning_tokens", "lockstep", f"A stop string ({stop!r}) spanning two output tokens, streamed.", _B,
        base.evolve(stop_strings=[stop], stream=True, max_new_tokens=g + 4), ({"op": "run"},), requires=frozenset({"stop_strings", "stream"}))
    add("boundary.stop_patterns_shared_prefix", "lockstep", f"Stop patterns sharing a prefix ({longer!r}, {stop!r}), text alignment.", _B,
        base.evolve(stop_strings=[longer, stop], alignment="text", max_new_tokens=g + 4), ({"op": "run"},),
        requires=frozenset({"stop_strings"}))
    add("boundary.structured_invalid_prefix", "lockstep", "Structured JSON output whose first bytes are not JSON: structured_error.", _B,
        base.evolve(structured="json"), ({"op": "run"},), requires=frozenset({"structured"}))

    # -- adversarial interleavings ---------------------------------------------------------------
    add("adversarial.cancel_in_flight", "lockstep", "Cancellation while a decode call is in flight: awaited, ALL_OLD, finish cancelled.",
        _B + " (stream cancellation while a device call is in flight)", base.evolve(stream=True),
        ({"op": "step"}, {"op": "launch", "kind": None, "length": None}, {"op": "cancel", "kind": "cancelled"}, {"op": "complete"}),
        requires=frozenset({"inflight"}))
    add("adversarial.timeout_after_completion", "lockstep", "Timeout after completion, before the decision: the score is discarded.",
        _B, base, ({"op": "prefill", "chunk": None}, {"op": "cancel", "kind": "timeout"}))
    add("adversarial.device_fault_retry", "lockstep", "A device fault in flight: ALL_OLD, quarantine, recover, retry, finish.",
        _B + " (model call fails before ALL_NEW)", base.evolve(max_retries=1),
        ({"op": "step"}, {"op": "launch", "kind": None, "length": None}, {"op": "fault", "kind": "device_fault", "layer": 1},
         {"op": "complete"}, {"op": "recover"}, {"op": "run"}), requires=frozenset({"faults", "inflight"}))
    add("adversarial.native_kernel_device_fault", "lockstep", "A device fault inside a native-kernel decode call (after layer 0): "
        "ALL_OLD, quarantine, recover, retry, finish.", _B + " (model call fails before ALL_NEW)", native.evolve(max_retries=1),
        ({"op": "step"}, {"op": "step"}, {"op": "launch", "kind": None, "length": None}, {"op": "fault", "kind": "device_fault", "layer": 1},
         {"op": "complete"}, {"op": "recover"}, {"op": "run"}), requires=frozenset({"faults", "inflight"}) | native_needs)
    add("adversarial.missing_lane", "lockstep", "A missing state lane in flight: ALL_OLD and device_error without retries.", _B, base,
        ({"op": "launch", "kind": None, "length": None}, {"op": "fault", "kind": "missing_lane", "layer": 2}, {"op": "complete"}),
        requires=frozenset({"faults", "inflight"}))
    add("adversarial.duplicate_stale_receipt", "lockstep", "Duplicated and stale decision receipts are refused; the pending one commits once.",
        "M3.10 0x06 One selection is an output-state transaction", base,
        ({"op": "step"}, {"op": "commit", "receipt": "receipt-0"}, {"op": "decode"}, {"op": "decide"},
         {"op": "commit", "receipt": "receipt-0"}, {"op": "commit", "receipt": "receipt-1"}, {"op": "commit", "receipt": "receipt-1"}),
        requires=frozenset({"decide_commit"}))
    capacity = len(hello) + g + 2
    add("adversarial.static_reuse_shorter", "lockstep", "A static cache reused by a shorter request forgets every row.", _B,
        static.evolve(static_capacity=capacity),
        ({"op": "run"}, {"op": "reuse", "prompt_ids": list(short), "max_new_tokens": None}, {"op": "run"}),
        requires=frozenset({"cache:static", "reuse"}))
    add("adversarial.restore_pending_ahead", "lockstep", "Restore a snapshot whose pending token is ahead of the cache frontier.", _B,
        base, (*_steps(2), {"op": "snapshot", "form": "pending_suffix", "id": "s0"}, {"op": "run"},
               {"op": "restore", "snapshot": "s0", "corrupt": None}, {"op": "run"}), requires=frozenset({"snapshot"}))
    add("adversarial.corrupt_restore", "lockstep", "Corrupted snapshot records are refused and change nothing.",
        "M3.10 0x0BA A completed output is not automatically a resumable snapshot", base,
        (*_steps(2), {"op": "snapshot", "form": "pending_suffix", "id": "s0"},
         *({"op": "restore", "snapshot": "s0", "corrupt": c} for c in CORRUPTIONS), {"op": "run"}), requires=frozenset({"snapshot"}))
    add("adversarial.stream_failure", "lockstep", "A streamer failure between calls closes with stream_error; committed tokens stay.", _B,
        base.evolve(stream=True), (*_steps(2), {"op": "stream_fail"}), requires=frozenset({"stream"}))
    add("adversarial.repair_fault_after_finish", "lockstep", "The repair call fails after length closed the output (no retries): "
        "device_error is recorded, length stays the published finish reason, the repair is abandoned.",
        "M3.10 The first-output off-by-one; 0x06 Finish reason and RNG precedence", base.evolve(final_cache="all_outputs"),
        (*_steps(g), {"op": "launch", "kind": None, "length": None}, {"op": "fault", "kind": "device_fault", "layer": 1},
         {"op": "complete"}), requires=frozenset({"faults", "inflight"}))
    add("adversarial.timeout_during_repair", "lockstep", "A timeout arrives while the repair call runs after the close: it lands "
        "in flight, the call is awaited and selects ALL_OLD, the repair is abandoned, length stays published.",
        _B + " (cancellation/timeout in flight); M3.10 The first-output off-by-one", base.evolve(final_cache="all_outputs"),
        (*_steps(g), {"op": "launch", "kind": None, "length": None}, {"op": "cancel", "kind": "timeout"}, {"op": "complete"}),
        requires=frozenset({"inflight"}))
    add("adversarial.repair_after_finish", "lockstep", "The append/repair call processes the final token after finish.",
        "M3.10 The first-output off-by-one", base.evolve(final_cache="all_outputs"),
        (*_steps(g), {"op": "snapshot", "form": "repaired", "id": "r"}), requires=frozenset({"snapshot"}))

    # -- decoding-policy rows, forced outputs, resume inside a stop string (M3.8; the failure lab) --
    sampling = frozenset({"sampling"})
    add("matrix.policy_top_p", "lockstep", "Sampled nucleus (temperature 0.7, top-p 0.9): processed support with the crossing token, draws.",
        _M + "; M3.8 0x0D top-p", base.evolve(policy=NUCLEUS, seed=5), _steps(g), requires=sampling)
    add("matrix.policy_repetition_penalty", "lockstep", "Repetition penalty 1.5 over the whole vocabulary: seen ids with negative "
        "logits are multiplied, positive ones divided.", _M + "; M3.8 0x0C penalties", base.evolve(policy=PENALTY, seed=6), _steps(g),
        requires=sampling)
    add("boundary.temperature_zero", "lockstep", "Temperature 0 in a sampling policy: the greedy branch, no RNG draw.",
        _B + "; M3.8 0x12 item 36", base.evolve(policy=TEMPERATURE_ZERO), _steps(g), requires=sampling)
    add("boundary.top_k_ties", "lockstep", "Three ids tied far above the rest and top-k 2: exactly k kept, ties to the lower ids.",
        _B + "; M3.8 0x12 item 40", base.evolve(policy=TIES, seed=7), _steps(2), requires=sampling)
    empty = forced([40, 2])  # the second decision may only take EOS, which bad_words bans: an empty legal set
    empty["transforms"].append({"name": "bad_words", "sequences": [[2]]})
    add("boundary.empty_support", "lockstep", "The legal set empties at the second decision (the constraint allows only EOS, "
        "bad_words bans it, no fallback declared): both sides finish with constraint_error, keeping the committed token "
        "(M3.10 0x02 branch table: a constraint error is a typed terminal finish).", _B + "; M3.8 0x12 item 42; M3.10 0x02 branch table",
        base.evolve(policy=empty), ({"op": "step"}, {"op": "decode"}, {"op": "decide"}), requires=frozenset({"decide_commit"}))
    partial = output_ids(model, "✓")[:-1]  # the check mark's first bytes: an incomplete UTF-8 tail
    add("boundary.empty_support_streamed", "lockstep", "The legal set empties after the first bytes of a multi-byte character that "
        "also start the stop string '✓!': constraint_error closes the output from outside a commit, so the held-back bytes "
        "(UTF-8 tail and stop prefix) are flushed to the stream and returned.", _B + "; M3.10 0x02 branch table; 0x06 Deriving the "
        "stream holdback", base.evolve(policy=forced(partial), stop_strings=["✓!"], stream=True, max_new_tokens=len(partial) + 2),
        (*_steps(len(partial)), {"op": "step"}), requires=frozenset({"stream", "stop_strings"}))
    doc = output_ids(model, '{"a": {"b": [1, 2]}, "c": "}"}')
    add("boundary.structured_nested_json", "lockstep", "A forced nested JSON document with a '}' inside a string: structured "
        "completion only at its last byte.", _B + "; docs/design.md structured completion",
        base.evolve(policy=forced(doc), structured="json", max_new_tokens=len(doc) + 1), ({"op": "run"},), requires=frozenset({"structured"}))
    split = output_ids(model, "✓ 日本 🦙")
    add("boundary.utf8_split_streamed", "lockstep", "Forced multi-byte characters split over output tokens, streamed: chunks end "
        "only at character boundaries.", _B + "; 0x06 Streaming has a commit horizon",
        base.evolve(policy=forced(split), stream=True, max_new_tokens=len(split)), ({"op": "run"},), requires=frozenset({"stream"}))
    add("matrix.resume_inside_stop_string", "resume", f"Resume from a snapshot between the two tokens the stop string {stop!r} spans: "
        "it still fires and the held-back bytes stay held.", _M + "; 0x0B resumable snapshot; 0x06 Deriving the stream holdback",
        base.evolve(stop_strings=[stop], stream=True, max_new_tokens=g + 4), ({"op": "run"},), resume_at=stop_at + 1,
        requires=frozenset({"snapshot", "stop_strings", "stream"}))
    add("matrix.resume_sampled", "resume", "Resume a sampled request from a pending-suffix snapshot: the RNG counter and the draws "
        "continue where they stopped.", _M + "; 0x0B resumable snapshot; M3.8 0x0B request-owned randomness",
        base.evolve(policy=SAMPLED, seed=4), ({"op": "run"},), resume_at=2, requires=frozenset({"snapshot", "sampling"}))

    # -- runtime families outside the request adapter (procedures: checks/gate/procedures.py) --
    finisher = greedy_continuation(model, tuple(short), 2)[1]  # the short row's second greedy token: it finishes early
    add("matrix.padded_batch_eos_left", "custom", "A left-padded batch in which one row selects its EOS mid-run: that row stops "
        "there (no token after logical completion), the others go on, each equal to its unbatched run.",
        _M + "; 0x06 Stop criteria and active rows; 0x07", base.evolve(eos_ids=[finisher]))
    add("matrix.beam_lockstep", "custom", "Beam search (K=3, exact termination, a parity constraint automaton): each live beam's row "
        "is the reference row of its own prefix; the spec's beam_step over the runtime's rows takes the same decisions and "
        "exports the same branch lanes.", _M + "; 0x05; M3.8 0x0F", base)
    add("matrix.encdec_cached_vs_uncached", "custom", "Encoder-decoder with a padded source: cached decoding equals the uncached "
        "reference under the source mask; the fixed lanes never change.", _M + "; 0x01 Architecture-qualified conformance tests", base)
    return tuple(cases)


# --------------------------------------------------------------------------------------------
# Expectations (accepted deviations).
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Expectation:
    """One documented, accepted deviation of a runtime (a ``[[deviation]]`` table).

    Matching fields (each optional; an absent field matches anything): ``case`` (a glob over
    case ids, e.g. ``"matrix.*"``, or several joined by ``|``, :func:`case_matches`), ``layer``, ``check``, ``rule`` (the verdict's ladder rule or the
    spec rule the refusal names), ``op`` (the action at the failing step), ``model`` (the model the
    deviation is tied to, e.g. ``"tiny"``: it explains nothing on another model and is not reported
    unused there), ``spec_finish`` (the spec side's finish reason at the failing step: the
    deviation explains only a step whose recorded spec state, when the caller passes it, finished
    so; a caller that passes none gets no match).  Every other field (``reason``, ``source``,
    ``test``, ...) is documentation.
    """

    id: str
    reason: str
    case: str | None = None
    layer: str | None = None
    check: str | None = None
    rule: str | None = None
    op: str | None = None
    fields: dict[str, Any] = attrs.field(factory=dict, eq=False)
    model: str | None = None
    spec_finish: str | None = None

    def matches(self, case_id: str, verdict: Verdict, action: Mapping[str, Any] | None = None, *, model: str | None = None,
                spec_state: Mapping[str, Any] | None = None) -> bool:
        """Whether this deviation explains ``verdict`` of case ``case_id`` (run on ``model``, when given; ``spec_state``:
        the spec side's state JSON at the failing step, :attr:`StepRecord.spec_state <decodespec.checks.gate.lockstep.StepRecord>`)."""
        if self.model is not None and model is not None and model != self.model:
            return False
        if self.spec_finish is not None and (spec_state or {}).get("finish_reason") != self.spec_finish:
            return False
        if self.case is not None and not case_matches(self.case, case_id):
            return False
        if self.layer is not None and verdict.layer != self.layer:
            return False
        if self.check is not None and verdict.check != self.check:
            return False
        if self.rule is not None and self.rule != verdict.rule and self.rule not in json.dumps(verdict.to_json()):
            return False
        return not (self.op is not None and (action or {}).get("op") != self.op)


def case_matches(pattern: str, case_id: str) -> bool:
    """Whether ``case_id`` matches the ``case`` field ``pattern`` of a deviation: one :func:`fnmatch.fnmatchcase` glob, or
    several joined by ``|`` (``"boundary.stop_*|sweep.field.stop_strings"``); case ids hold no ``|``."""
    return any(fnmatch.fnmatchcase(case_id, glob) for glob in pattern.split("|"))


def load_expectations(runtime: str, directory: Path | None = None) -> tuple[Expectation, ...]:
    """The documented deviations of ``runtime`` (``<directory>/<runtime>.toml``; none when absent).

    Raises:
        ValueError: a file that is not TOML or a ``[[deviation]]`` without ``id`` / ``reason``.
    """
    path = (directory or EXPECTATIONS_DIR) / f"{runtime.split(':', 1)[0]}.toml"
    if not path.is_file():
        return ()
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    out = []
    for index, entry in enumerate(data.get("deviation", [])):
        if "id" not in entry or "reason" not in entry:
            raise ValueError(f"{path}: deviation {index} needs 'id' and 'reason'")
        out.append(Expectation(id=entry["id"], reason=entry["reason"], case=entry.get("case"), layer=entry.get("layer"),
                               check=entry.get("check"), rule=entry.get("ladder_rule", entry.get("rule")) if entry.get("case") or
                               entry.get("layer") or entry.get("check") or entry.get("op") else entry.get("ladder_rule"),
                               op=entry.get("op"), fields=dict(entry), model=entry.get("model"), spec_finish=entry.get("spec_finish")))
    return tuple(out)


def unused_expectations(expectations: Sequence[Expectation], results: Sequence[CaseResult]) -> list[Expectation]:
    """Deviations bound to a deterministic case (``case`` field, not a ``machine.*`` glob) that ran without producing them.

    Hypothesis machines draw their interleavings, so a machine deviation that did not occur in
    one run proves nothing; its corpus trace (``trace`` field) is what keeps it checked.
    """
    used = {r.deviation for r in results if r.deviation}
    ran = [(r.case, r.model) for r in results if r.result != "skip"]
    return [e for e in expectations if e.case is not None and not e.case.startswith("machine.") and e.id not in used
            and any(case_matches(e.case, c) and (e.model is None or m == e.model) for c, m in ran)]


# --------------------------------------------------------------------------------------------
# Running a case.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class CaseResult:
    """The outcome of one case on one runtime (one line of a report).

    Attributes:
        case: Case id.
        runtime: Runtime name.
        model: Model name.
        result: ``pass``, ``fail``, ``deviation``, ``undecided`` or ``skip``.
        verdict: The ladder verdict behind it.
        deviation: The id of the expectation that explains a failure, or ``None``.
        reason: Skip reason, or the deviation's documented reason.
        trace: The replayable trace of a failing lock-step run, or ``None``.
    """

    case: str
    runtime: str
    model: str
    result: str
    verdict: Verdict
    deviation: str | None = None
    reason: str = ""
    trace: dict[str, Any] | None = attrs.field(default=None, repr=False)


def report_line(result: CaseResult) -> dict[str, Any]:
    """One report line: ``case``, ``runtime``, ``model``, ``result``, ``layer``, ``rule``, ``check``, ``expected``, ``actual``,
    ``message``, and ``data``, the passport (``{"classification": "synthetic"}``: the gate generated every input)."""
    from decodespec.spec.passport import SYNTHETIC_PASSPORT

    v = result.verdict.to_json()
    out = {"case": result.case, "runtime": result.runtime, "model": result.model, "result": result.result, "layer": v["layer"],
           "rule": v["rule"], "check": v["check"], "expected": v["expected"], "actual": v["actual"], "message": v["message"]}
    if result.deviation:
        out["deviation"] = result.deviation
    if result.reason:
        out["reason"] = result.reason
    out["data"] = SYNTHETIC_PASSPORT.to_json()
    return out


def run_case(case: Case, runtime: str, *, adapter_factory: Callable[[], Any] | None = None,
             expectations: Sequence[Expectation] = ()) -> CaseResult:
    """Run one case on ``runtime`` and classify the outcome (see the module docstring)."""
    model = case.config.model

    def done(verdict: Verdict, *, trace: dict | None = None, action: Mapping[str, Any] | None = None,
             unsupported: str | None = None) -> CaseResult:
        if verdict.result == FAILED:
            for e in expectations:
                if e.matches(case.id, verdict, action, model=model):
                    return CaseResult(case.id, runtime, model, "deviation", verdict, e.id, e.reason, trace)
            if unsupported is not None:  # an honest refusal of the config: not what the runtime declared it can run
                return skip(unsupported)
            return CaseResult(case.id, runtime, model, "fail", verdict, trace=trace)
        return CaseResult(case.id, runtime, model, "undecided" if verdict.result == UNDECIDED else "pass", verdict)

    def skip(reason: str) -> CaseResult:
        return CaseResult(case.id, runtime, model, "skip", Verdict(PASSED, message=reason), reason=reason)

    if case.kind == "custom":
        fn = CUSTOM.get((case.id, runtime.split(":", 1)[0]))
        if fn is None:
            return skip(f"no {case.id} procedure for runtime {runtime}")
        try:
            verdict = fn(case, runtime)
        except AdapterUnavailable as exc:  # the procedure's runtime is not installed here
            return skip(str(exc))
        return done(verdict)
    open_one = adapter_factory or (lambda: open_runtime(runtime, model))
    try:
        adapter = open_one()
    except AdapterUnavailable as exc:
        return skip(str(exc))
    try:
        configs = [case.config] + ([case.other] if case.other is not None else [])
        # The case's own needs (ops, probes) and every feature its configs set (features.config_capabilities).
        missing = sorted(case.requires.union(*(config_capabilities(c) for c in configs)) - adapter.capabilities())
        if missing:
            return skip(f"{runtime} does not declare {missing}")
        if case.kind == "prompt_logprobs":
            from .prompt_logprobs import run_prompt_logprobs_case

            return done(run_prompt_logprobs_case(adapter, case, runtime))
        runs: list[LockStep] = []
        for config in configs:
            ls = LockStep(adapter, config, runtime=runtime)
            if case.kind == "resume":
                ls = _resume_run(ls, case)
            else:
                ls.reset()
                for action in case.actions:
                    if ls.failed:
                        break
                    ls.apply(action)
            runs.append(ls)
            if ls.unsupported is None:
                record_lockstep(ls)
            if ls.verdict.result == FAILED:
                bad = ls.verdict
                action = ls.records[bad.step].action if bad.step is not None and bad.step < len(ls.records) else None
                trace = make_trace(runtime=runtime, config=config, records=ls.records, verdict=bad, tolerance=ls.tolerance,
                                   description=f"{case.id}: {case.description}", spec_refs=[case.id])
                return done(bad, trace=trace, action=action, unsupported=ls.unsupported)
        verdict = Verdict(PASSED)
        if case.kind == "pair":
            verdict = pair_verdict(runs[0], runs[1], case.compare, runs[0].tolerance)
        undecided = [ls.verdict for ls in runs if ls.verdict.result == UNDECIDED]
        if verdict.passed and undecided:
            verdict = undecided[0]
        return done(verdict)
    except DecodeSpecError as exc:
        return done(Verdict(FAILED, "STATE", "ladder.STATE", "harness", None, exc.code, f"the case could not run: {exc.message}"))
    finally:
        adapter.close()


def _resume_run(ls: LockStep, case: Case) -> LockStep:
    """Uninterrupted run, then the same request with a snapshot after ``resume_at`` steps, restored and run; RESUME at the end."""
    ls.reset()
    ls.apply({"op": "run"})
    uninterrupted = ls.observation
    if ls.failed:
        return ls
    ls.reset()
    for action in _steps(case.resume_at):
        ls.apply(action)
    ls.apply({"op": "snapshot", "form": case.form, "id": "resume"})
    ls.apply({"op": "run"})
    ls.apply({"op": "restore", "snapshot": "resume", "corrupt": None})
    ls.apply({"op": "run"})
    if not ls.failed:
        ls.finish_against(uninterrupted)
    return ls
