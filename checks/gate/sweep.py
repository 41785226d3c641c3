"""Sensitivity sweeps: vary one variable of a fixed manifest, record cost and the contract at each point.

M3.10 0x0BA "Sensitivity is a controlled experiment": one aggregate number cannot explain an
inference implementation; sweep *one* variable while the rest of the manifest stays fixed, and at
each point record both what it costs and the equivalence that must still hold.  Two variables that
move together make a *configuration comparison*, not a sensitivity curve: :func:`check_one_variable`
refuses that with ``sweep.two_variables`` and :func:`compare` runs it under its own name.

Per point (:func:`measure_point`) on our runtime (:class:`~decodespec.impl.runtime.RequestRunner`,
greedy, EOS disabled so every run makes ``new_tokens`` tokens, the output streamed to a no-op
consumer so emissions are what a stream user sees):

* **cost**: ``repetitions`` timed runs after one warm-up; TTFT and ITL quantiles, E2E, prefill and
  decode tokens/s, model calls (against :func:`decodespec.spec.latency.expected_calls`) -- all as
  :mod:`decodespec.spec.latency` defines them -- and the K/V bytes the request retains at finish
  (``kv_bytes``: 2 x layers x KV heads x head dim x P x element size) and reserves (static cache);
* **contract**: a probe run driven step by step that keeps every decision row and the K/V rows the
  prefill committed, judged against the float64 no-cache reference (:mod:`decodespec.checks.gate.reference`)
  and, where the seed names it, against the runtime's own run at the sweep's base point, with the
  calibrated tolerance of ``checks/gate/ladder.py`` (:func:`~decodespec.checks.gate.tolerance.tolerance_for`;
  two runs each within it differ by at most twice it: ``Tolerance.scaled(2)``) -- never a typed one.

Contracts by variable (the seed's table, "main observation" column):

============== =================================================================================
variable       contract checked at each point
============== =================================================================================
prompt_len     calls = ceil(L/chunk) + G - 1; the first-row score (prefill last row) within epsilon
               of the reference; every decision passes the greedy comparator against the reference
new_tokens     calls; the tokens are a prefix of the longest point's tokens (no per-step drift);
               every decision passes the greedy comparator
cache          calls; last prefill row and tokens equal the no-cache family's within 2 epsilon
prefill_chunk  calls; last prefill row and the committed K/V rows within 2x tolerance of the runtime's
               own one-shot prefill (and within tolerance of the reference); same tokens
dtype          the first-row score within that dtype's calibrated epsilon of the reference; every
               decision passes the greedy comparator (a flip is allowed only at a margin crossing:
               reference top-2 margin <= 2 epsilon); reports token divergence from float32 and
               the margin crossings
stop           exact spans: the returned text is the stop-free run's text cut before the first
               occurrence of the stop string (found by ``str.find``, not by the matcher), the
               finish reason is ``stop_string`` exactly when it occurs, the stream delivered the
               returned text
num_beams      calls (one batched decode call per step); branch correctness: every kept
               hypothesis' per-token logprobs are its own path's under the float64 reference
               (``Tolerance.at_row(row).logprob`` per step), its score is their sum, the kept
               branches are distinct; width 1 equals the greedy path.  Beam search publishes
               once at the end: its TTFT is its E2E and it has no ITL
============== =================================================================================

Source: M3.10 0x0BA "Sensitivity is a controlled experiment" (the variable table; "if two
variables move together, call the result a configuration comparison") and "Latency semantics";
"Correctness matrix" (one-shot versus chunked prefill: last-row logits and cache tensors;
no-cache versus cached); "A logit tolerance is not a token-equality proof" (greedy comparator,
margin > 2 epsilon).

Size: one sweep runner: the manifest, its variables, the per-point runs and the report, sharing the
point record.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.latency import Emission, Timeline, expected_calls, request_latency, summarize
from decodespec.spec.request import default_static_capacity

from .ladder import FAILED, UNDECIDED, cache_probe_failure, compare_rows, greedy_comparator
from .tolerance import tolerance_for

__all__ = [
    "SWEEP_TWO_VARIABLES",
    "SWEEP_VALUE_INVALID",
    "SWEEP_VARIABLE_UNSUPPORTED",
    "VARIABLES",
    "Manifest",
    "check_one_variable",
    "compare",
    "measure_point",
    "parse_values",
    "plot_comparison",
    "plot_sweep",
    "sweep",
]

SWEEP_TWO_VARIABLES = register_code(
    "sweep.two_variables",
    "rejection",
    "M3.10 0x0BA Sensitivity is a controlled experiment",
    "A sweep was asked to move more than one variable of the manifest at once; that is a configuration comparison "
    "(decodespec compare), not a sensitivity curve. Nothing was run.",
)
SWEEP_VARIABLE_UNSUPPORTED = register_code(
    "sweep.variable_unsupported",
    "rejection",
    "M3.10 0x0BA Sensitivity is a controlled experiment",
    "The variable is not one the sweep can vary (prompt_len, new_tokens, cache, prefill_chunk, dtype, stop, num_beams). "
    "Nothing was run.",
)
SWEEP_VALUE_INVALID = register_code(
    "sweep.value_invalid",
    "rejection",
    "M3.10 0x0BA Sensitivity is a controlled experiment",
    "A sweep value or manifest value is not valid for its variable (a non-positive length, an unknown cache family or "
    "dtype, a prompt longer than the source text, fewer than one or more than 64 values). Nothing was run.",
)

#: Variables a sweep can move, with their unit (axis labels).
VARIABLES: dict[str, str] = {
    "prompt_len": "prompt tokens",
    "new_tokens": "output tokens",
    "cache": "cache family",
    "prefill_chunk": "prefill chunk (tokens; none = one shot)",
    "dtype": "compute / cache dtype",
    "stop": "stop string",
    "num_beams": "beam width",
}
#: Named in the seed's table but not swept (a typed refusal says so).
UNSUPPORTED: dict[str, str] = {}
_CACHES = ("none", "dynamic", "static")
_DTYPES = ("float32", "bfloat16", "float16")
MAX_POINTS = 64

#: Source text of the prompts (the first ``prompt_len`` tokens are used).
PROMPT_TEXT = (
    "The history of computing is a story of abstractions: vacuum tubes gave way to transistors, transistors to integrated "
    "circuits, and assembly language to compilers that let engineers describe what a program should do rather than how "
    "each register should move. Today a single chip holds billions of transistors, and the software that runs on it is "
    "built from layers of libraries, runtimes and operating systems, each hiding the details of the one below. "
) * 8


@attrs.frozen
class Manifest:
    """The fixed manifest of a sweep point (every field but the swept one stays as given).

    Attributes:
        model: ``tiny`` or ``smollm2``.
        prompt_len: L (tokens of :data:`PROMPT_TEXT`).
        new_tokens: G (EOS disabled: every run makes G tokens unless a stop string fires).
        cache: ``none`` / ``dynamic`` / ``static``.
        prefill_chunk: Chunk size, or ``None`` (one shot).
        dtype: ``float32`` / ``bfloat16`` / ``float16`` (compute and cache).
        stop: Stop string, or ``""`` (none).
        num_beams: Beam width (1: the greedy runner; > 1: beam search, HF-compatible parameters).
        repetitions: Timed runs per point (after one warm-up).
        threads: torch intra-op threads.
    """

    model: str = "tiny"
    prompt_len: int = 16
    new_tokens: int = 8
    cache: str = "static"
    prefill_chunk: int | None = None
    dtype: str = "float32"
    stop: str = ""
    num_beams: int = 1
    repetitions: int = 3
    threads: int = 1

    def caption(self, variable: str | None = None) -> str:
        """The fixed manifest in one line (the swept variable left out)."""
        fields = {k: v for k, v in attrs.asdict(self).items() if k != variable}
        if "stop" in fields and not fields["stop"]:
            fields["stop"] = "(none)"
        if "prefill_chunk" in fields and fields["prefill_chunk"] is None:
            fields["prefill_chunk"] = "one shot"
        decoding = "greedy" if self.num_beams == 1 and variable != "num_beams" else "beam search (HF-compatible) / greedy at width 1"
        return ", ".join(f"{k}={v}" for k, v in fields.items()) + f", {decoding}, EOS off, batch 1"

    def check(self) -> Manifest:
        """``self`` if valid, else ``Rejection(sweep.value_invalid)``."""
        def bad(msg: str) -> Rejection:
            return Rejection(SWEEP_VALUE_INVALID, msg, "$.manifest")

        if self.model not in ("tiny", "smollm2"):
            raise bad(f"model {self.model!r}: expected tiny or smollm2")
        if not 1 <= self.prompt_len <= 512 or not 1 <= self.new_tokens <= 512:
            raise bad("prompt_len and new_tokens must be in [1, 512]")
        if self.cache not in _CACHES:
            raise bad(f"cache {self.cache!r}: expected one of {_CACHES}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise bad("prefill_chunk must be >= 1 (or none)")
        if self.dtype not in _DTYPES:
            raise bad(f"dtype {self.dtype!r}: expected one of {_DTYPES}")
        if not 1 <= self.num_beams <= 16:
            raise bad("num_beams must be in [1, 16]")
        if self.num_beams > 1 and (self.stop or self.cache == "none"):
            raise bad("a beam sweep point takes no stop string and a cached family")
        if not 1 <= self.repetitions <= 100 or not 1 <= self.threads <= 64:
            raise bad("repetitions must be in [1, 100] and threads in [1, 64]")
        return self


def parse_values(variable: str, text: str) -> list[Any]:
    """The values of ``variable`` from a comma-separated list (``stop``: separated by ``|``; ``none`` for no chunk / no stop).

    Raises:
        Rejection: ``sweep.variable_unsupported`` for an unknown variable, ``sweep.value_invalid`` for a bad value.
    """
    if variable in UNSUPPORTED or variable not in VARIABLES:
        why = UNSUPPORTED.get(variable, f"unknown variable; expected one of {sorted(VARIABLES)}")
        raise Rejection(SWEEP_VARIABLE_UNSUPPORTED, f"{variable!r}: {why}", "$.variable")
    raw = text.split("|") if variable == "stop" else [v.strip() for v in text.split(",")]
    if not 1 <= len(raw) <= MAX_POINTS:
        raise Rejection(SWEEP_VALUE_INVALID, f"{len(raw)} values; expected 1 to {MAX_POINTS}", "$.values")
    out: list[Any] = []
    for value in raw:
        try:
            if variable in ("prompt_len", "new_tokens", "num_beams"):
                out.append(int(value))
            elif variable == "prefill_chunk":
                out.append(None if value.lower() == "none" else int(value))
            elif variable == "stop":
                out.append("" if value == "none" else value)
            else:
                out.append(value)
        except ValueError:
            raise Rejection(SWEEP_VALUE_INVALID, f"{variable} value {value[:40]!r} is not an integer", "$.values") from None
    if len(set(out)) != len(out):
        raise Rejection(SWEEP_VALUE_INVALID, f"{variable} values repeat", "$.values")
    return out


def check_one_variable(variable: str, moving: dict[str, Sequence[Any]]) -> None:
    """Refuse a sweep that moves any manifest field other than ``variable`` (``sweep.two_variables``).

    Args:
        variable: The swept variable.
        moving: Every manifest field that was given more than one value.
    """
    others = sorted(k for k, values in moving.items() if k != variable and len(values) > 1)
    if others:
        raise Rejection(SWEEP_TWO_VARIABLES, f"the sweep of {variable} also moves {', '.join(others)}: two variables moving together "
                        "make a configuration comparison, not a sensitivity curve; run `decodespec compare` with one --config per "
                        "configuration instead", "$.manifest", details={"moving": [variable, *others]})


# ----------------------------------------------------------------------------------------------
# Running a point.
# ----------------------------------------------------------------------------------------------
class _Models:
    """Loaded models and tokenizers, one per (model, dtype), shared by the points of a sweep."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], Any] = {}
        self._tokenizers: dict[str, Any] = {}

    def model(self, name: str, dtype: str):
        import torch

        key = (name, dtype)
        if key not in self._models:
            if name == "tiny":
                from decodespec.impl.tiny import load_tiny

                self._models[key] = load_tiny(seed=0, dtype=getattr(torch, dtype), device="cpu")
            else:
                from decodespec.impl.weights import load_smollm2

                self._models[key] = load_smollm2(dtype=getattr(torch, dtype), device="cpu")
        return self._models[key]

    def tokenizer(self, name: str):
        if name not in self._tokenizers:
            if name == "tiny":
                from decodespec.impl.tiny import TINY_VOCAB_SIZE
                from decodespec.impl.tokenizer import ByteTokenizer

                self._tokenizers[name] = ByteTokenizer(TINY_VOCAB_SIZE)
            else:
                from decodespec.impl.tokenizer import load_smollm2_tokenizer

                self._tokenizers[name] = load_smollm2_tokenizer()
        return self._tokenizers[name]

    def prompt(self, m: Manifest) -> tuple[int, ...]:
        ids = self.tokenizer(m.model).encode(PROMPT_TEXT)[: m.prompt_len]
        if len(ids) < m.prompt_len:
            raise Rejection(SWEEP_VALUE_INVALID, f"the prompt text has only {len(ids)} tokens", "$.prompt_len")
        return tuple(ids)


def _request(m: Manifest, prompt: tuple[int, ...]):
    from decodespec.impl.runtime import RuntimeRequest
    from decodespec.spec.policy.config import PolicyConfig

    return RuntimeRequest(identity="sweep", prompt_ids=prompt, max_new_tokens=m.new_tokens, policy=PolicyConfig.greedy(),
                          eos_ids=frozenset(), cache=m.cache, prefill_chunk=m.prefill_chunk if m.cache != "none" else None,
                          stream=True, stop_strings=(m.stop,) if m.stop else ())


def _discard(chunk: Any) -> None:
    """The sweep's stream consumer."""


@attrs.frozen
class _Probe:
    """What the step-by-step probe run kept."""

    prompt: tuple[int, ...]
    output_ids: tuple[int, ...]
    rows: tuple[np.ndarray, ...]  # float64[V] per decision, in order
    prefill_kv: np.ndarray | None  # [layers, 2, H_kv, L, D] after the prefill
    text: str
    finish_reason: str | None
    streamed_text: str
    calls: int
    beams: tuple[tuple[tuple[int, ...], tuple[float, ...], float], ...] = ()  # (ids, logprobs, score) per kept hypothesis


def _beam_search(models: _Models, m: Manifest, prompt: tuple[int, ...]):
    from decodespec.impl.beam import beam_generate
    from decodespec.spec.beam import BeamParams

    return beam_generate(models.model(m.model, m.dtype), prompt, BeamParams.hf_compatible(m.num_beams, m.new_tokens, ()),
                         cache=m.cache, prefill_chunk=m.prefill_chunk, tokenizer=models.tokenizer(m.model))


def _probe(models: _Models, m: Manifest, prompt: tuple[int, ...], *, beams: bool = False) -> _Probe:
    """The probe run; with ``beams`` (or a width above 1) also a beam search of width ``m.num_beams``."""
    import torch

    if m.num_beams > 1 or beams:
        search = _beam_search(models, m, prompt)
        kept = tuple((tuple(h.output_ids), tuple(h.logprobs), float(h.score)) for h in search.hypotheses)
        if m.num_beams > 1:
            best = search.best
            ids = () if best is None else tuple(best.output_ids)
            return _Probe(prompt, ids, (), None, "" if best is None else best.text,
                          None if best is None else best.finish_reason.value, "", search.num_calls, kept)
        return attrs.evolve(_probe(models, m, prompt), beams=kept)

    from decodespec.impl.runtime import RequestRunner
    from decodespec.spec.state import Phase

    chunks: list[Any] = []
    model = models.model(m.model, m.dtype)
    runner = RequestRunner(model, _request(m, prompt), tokenizer=models.tokenizer(m.model), on_chunk=chunks.append)
    rows: list[np.ndarray] = []
    prefill_kv = None
    while True:
        if runner.phase is Phase.SCORED and runner.score is not None:
            rows.append(runner.score.logits.detach().to("cpu", torch.float64).numpy().copy())
            if prefill_kv is None and runner.cache is not None:
                tensors = runner.cache.committed_tensors()
                prefill_kv = torch.stack([torch.stack((k[0], v[0])) for k, v in tensors]).to("cpu", torch.float64).numpy()
        if runner.step() is None:
            break
    result = runner.result()
    return _Probe(prompt, tuple(runner.output_ids), tuple(rows), prefill_kv, result.text,
                  None if result.finish_reason is None else result.finish_reason.value,
                  "".join(getattr(c, "text", "") for c in chunks), runner.num_calls)


def _kv_bytes(model: Any, m: Manifest, processed: int) -> dict[str, int]:
    c = model.config
    per_slot = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
    reserved = per_slot * default_static_capacity(m.prompt_len, m.new_tokens, c.max_position_embeddings) if m.cache == "static" else per_slot * processed
    return {"kv_bytes": per_slot * processed if m.cache != "none" else 0, "kv_reserved_bytes": reserved if m.cache != "none" else 0}


def _timed(models: _Models, m: Manifest, prompt: tuple[int, ...]) -> dict[str, Any]:
    import torch

    from decodespec.impl.generate import generate

    model = models.model(m.model, m.dtype)
    tokenizer = models.tokenizer(m.model)
    before = torch.get_num_threads()
    torch.set_num_threads(m.threads)
    try:
        runs = []
        frontier = None
        for i in range(m.repetitions + 1):  # the first is the warm-up
            if m.num_beams > 1:
                start = time.perf_counter_ns()
                search = _beam_search(models, m, prompt)
                e2e = time.perf_counter_ns() - start
                out = 0 if search.best is None else search.best.length
                frontier = {**search.frontier(), "processed": m.num_beams * search.frontier()["processed"]}  # k branches retained
                # Beam search publishes its output once, at the end: TTFT = E2E, no ITL; its calls are counted, not timed.
                timeline = Timeline(prompt_len=len(prompt), emissions=(Emission(e2e, out),) if out else (), final_ns=e2e)
                if i:
                    runs.append(attrs.evolve(request_latency(timeline), calls=search.num_calls))
                continue
            result = generate(model, prompt, max_new_tokens=m.new_tokens, eos_token_ids=(), cache=m.cache,
                              prefill_chunk=m.prefill_chunk if m.cache != "none" else None, tokenizer=tokenizer, stream=True,
                              on_chunk=_discard, stop_strings=(m.stop,) if m.stop else ())
            frontier = result.frontier
            if i:
                runs.append(request_latency(result.timeline))
    finally:
        torch.set_num_threads(before)
    assert frontier is not None

    def median(values: Iterable[float | None]) -> float | None:
        xs = [v for v in values if v is not None]
        return statistics.median(xs) if xs else None

    return {
        "ttft_ms": summarize([r.ttft_ns / 1e6 for r in runs if r.ttft_ns is not None]),
        "itl_ms": summarize([x / 1e6 for r in runs for x in r.itl_ns]),
        "e2e_ms": median(r.e2e_ns / 1e6 for r in runs if r.e2e_ns is not None),
        "prefill_ms": median(r.prefill_ns / 1e6 for r in runs if r.prefill_calls),  # None: calls not timed (beam search)
        "prefill_tokens_per_s": median(r.prefill_tokens_per_s for r in runs),
        "decode_tokens_per_s": median(r.decode_tokens_per_s for r in runs),
        "calls": sorted({r.calls for r in runs}),
        "output_count": frontier["output_count"],
        **_kv_bytes(model, m, frontier["processed"]),
        "repetitions": m.repetitions,
    }


def _reference(model: str):
    from .lockstep import reference_for

    return reference_for(model)


def _check(name: str, passed: bool, **detail: Any) -> dict[str, Any]:
    return {"check": name, "passed": bool(passed), **detail}


def _decisions(reference, probe: _Probe, tol) -> tuple[list[dict[str, Any]], int, int]:
    """Greedy comparator at every decision: (failed checks, margin crossings, undecided)."""
    failed, crossings, undecided = [], 0, 0
    for i, row in enumerate(probe.rows):
        ref = reference.row(probe.prompt + probe.output_ids[:i])
        eps = tol.epsilon(ref)
        cmp = compare_rows(ref, row, eps)
        if cmp.margin <= 2 * eps:
            crossings += 1
        verdict = greedy_comparator(ref, row, eps, candidate_id=probe.output_ids[i] if i < len(probe.output_ids) else None)
        if verdict.result == FAILED:
            failed.append({"step": i, "message": verdict.message})
        elif verdict.result == UNDECIDED:
            undecided += 1
    return failed, crossings, undecided


def _contract(variable: str, m: Manifest, probe: _Probe, base: _Probe | None, base_manifest: Manifest | None) -> dict[str, Any]:
    """The contract of one point (see the module docstring's table)."""
    tol = tolerance_for("impl", m.model, m.dtype)
    reference = _reference(m.model)
    checks: list[dict[str, Any]] = []
    cached = m.cache != "none"
    want = expected_calls(m.prompt_len, len(probe.output_ids), cached=cached, prefill_chunk=m.prefill_chunk if cached else None)["total"]
    checks.append(_check("model_calls", probe.calls == want, expected=want, actual=probe.calls))
    ref_row = reference.row(probe.prompt)
    eps = tol.epsilon(ref_row)
    measures: dict[str, Any] = {"first_row_linf": None, "epsilon": eps, "margin_crossings": 0, "undecided": 0}
    failed: list[dict[str, Any]] = []
    if probe.rows:  # a beam search of width > 1 keeps no single decision row
        first = compare_rows(ref_row, probe.rows[0], eps)
        checks.append(_check("first_row_vs_float64_reference", first.linf <= eps, linf=first.linf, epsilon=eps))
        failed, crossings, undecided = _decisions(reference, probe, tol)
        measures.update(first_row_linf=first.linf, margin_crossings=crossings, undecided=undecided)
    if variable == "num_beams":
        checks.extend(_beam_checks(reference, tol, m, probe, measures))
    if variable in ("prompt_len", "new_tokens", "dtype", "cache", "prefill_chunk"):
        checks.append(_check("greedy_comparator_every_decision", not failed, failures=failed[:3]))
    if base is not None and variable in ("cache", "prefill_chunk", "dtype", "new_tokens"):
        n = min(len(base.output_ids), len(probe.output_ids))
        diverge = next((i for i in range(n) if base.output_ids[i] != probe.output_ids[i]), None)
        measures["token_divergence_from_base"] = diverge
        if variable in ("cache", "prefill_chunk"):
            two = tol.scaled(2.0)
            own = compare_rows(base.rows[0], probe.rows[0], two.epsilon(ref_row))
            measures["first_row_linf_vs_base"] = own.linf
            checks.append(_check("last_row_vs_own_base_run", own.linf <= two.epsilon(ref_row), linf=own.linf, bound=two.epsilon(ref_row),
                                 base=_base_label(variable, base_manifest)))
            tokens_ok = _near_tie(reference, probe, diverge, tol)  # equal, or first differing at a reference near-tie
            checks.append(_check("same_tokens_as_base", tokens_ok, first_divergence=diverge))
        if variable == "prefill_chunk" and base.prefill_kv is not None and probe.prefill_kv is not None:
            own_kv = cache_probe_failure(base.prefill_kv, probe.prefill_kv, tol.scaled(2.0))
            ref_kv = cache_probe_failure(reference.kv(probe.prompt), probe.prefill_kv, tol)
            measures["kv_linf_vs_base"] = float(np.max(np.abs(base.prefill_kv - probe.prefill_kv)))
            checks.append(_check("prefill_kv_vs_own_one_shot", own_kv is None, message=None if own_kv is None else own_kv.message))
            checks.append(_check("prefill_kv_vs_float64_reference", ref_kv is None, message=None if ref_kv is None else ref_kv.message))
        if variable == "new_tokens":
            checks.append(_check("tokens_prefix_of_longest_run", diverge is None, first_divergence=diverge))
    if variable == "stop":
        checks.extend(_stop_checks(m, probe, base))
    return {"passed": all(c["passed"] for c in checks), "checks": checks, "measures": measures,
            "tolerance": {"source": "checks/gate/ladder.py tolerance_for('impl', model, dtype) from checks/gate/calibration.json",
                          "logit": tol.logit, "logit_rel": tol.logit_rel, "kv": tol.kv, "kv_rel": tol.kv_rel}}


def _beam_checks(reference, tol, m: Manifest, probe: _Probe, measures: dict[str, Any]) -> list[dict[str, Any]]:
    """Branch correctness: each kept hypothesis' logprobs are its own path's (float64 reference), its score their sum."""
    checks = []
    if m.num_beams == 1:
        checks.append(_check("beam_width_one_equals_greedy", bool(probe.beams) and probe.beams[0][0] == probe.output_ids,
                             beam=list(probe.beams[0][0]) if probe.beams else None, greedy=list(probe.output_ids)))
    worst_step, worst_score, bad = 0.0, 0.0, []
    for rank, (ids, logprobs, score) in enumerate(probe.beams):
        bound_sum, ref_sum = 0.0, 0.0
        for i, token in enumerate(ids):
            row = reference.row(probe.prompt + ids[:i])
            top = float(np.max(row))
            ref_lp = float(row[token] - top - np.log(np.sum(np.exp(row - top))))
            bound = tol.at_row(row).logprob
            err = abs(logprobs[i] - ref_lp)
            worst_step = max(worst_step, err / bound)
            if err > bound and len(bad) < 3:
                bad.append({"rank": rank, "step": i, "logprob": logprobs[i], "reference": ref_lp, "bound": bound})
            bound_sum += bound
            ref_sum += ref_lp
        worst_score = max(worst_score, abs(score - ref_sum) / bound_sum if bound_sum else 0.0)
    measures.update(branch_logprob_error_over_bound=worst_step, branch_score_error_over_bound=worst_score, branches=len(probe.beams))
    checks.append(_check("branch_logprobs_vs_float64_reference", not bad and bool(probe.beams), failures=bad))
    checks.append(_check("branch_score_is_its_path_sum", worst_score <= 1.0, worst_error_over_bound=worst_score))
    checks.append(_check("branches_distinct", len({b[0] for b in probe.beams}) == len(probe.beams)))
    return checks


def _near_tie(reference, probe: _Probe, step: int | None, tol) -> bool:
    """Whether a token divergence at ``step`` is allowed: the reference's top-2 margin there is <= 2 epsilon."""
    if step is None:
        return True
    ref = reference.row(probe.prompt + probe.output_ids[:step])
    eps = tol.epsilon(ref)
    return compare_rows(ref, ref, eps).margin <= 2 * eps


def _stop_checks(m: Manifest, probe: _Probe, base: _Probe | None) -> list[dict[str, Any]]:
    if base is None:
        return [_check("stop_free_base_run", False, message="no stop-free base run")]
    if not m.stop:
        return [_check("stop_free_run_is_the_base", probe.text == base.text and probe.finish_reason == "length")]
    at = base.text.find(m.stop)
    want_text = base.text if at < 0 else base.text[:at]
    want_reason = "length" if at < 0 else "stop_string"
    return [
        _check("exact_span_text", probe.text == want_text, expected=want_text[-60:], actual=probe.text[-60:], stop_at_char=at),
        _check("finish_reason", probe.finish_reason == want_reason, expected=want_reason, actual=probe.finish_reason),
        _check("stream_delivered_the_returned_text", probe.streamed_text == probe.text),
    ]


def _base_label(variable: str, base: Manifest | None) -> str | None:
    return None if base is None else f"{variable}={getattr(base, variable)}"


def measure_point(models: _Models, variable: str, m: Manifest, base: _Probe | None, base_manifest: Manifest | None) -> tuple[dict[str, Any], _Probe]:
    """Cost and contract of one point; returns the JSON line and the probe (the base of later points)."""
    m.check()
    prompt = models.prompt(m)
    probe = _probe(models, m, prompt, beams=variable == "num_beams")
    base = probe if base is None else base  # the base point is judged against itself
    cost = _timed(models, m, prompt)
    cost["expected_calls"] = expected_calls(m.prompt_len, cost["output_count"], cached=m.cache != "none",
                                            prefill_chunk=m.prefill_chunk if m.cache != "none" else None)["total"]
    contract = _contract(variable, m, probe, base, base_manifest)
    return {"variable": variable, "value": getattr(m, variable), "manifest": attrs.asdict(m), "cost": cost, "contract": contract}, probe


def machine() -> dict[str, Any]:
    """The machine the figures came from (named in every line)."""
    import torch

    from decodespec.impl.bench import cpu_model_name

    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "python": platform.python_version()}


def _base_value(variable: str, values: Sequence[Any]) -> Any:
    """The point the others are compared with: one-shot prefill, float32, no cache, the longest output, no stop."""
    preferred = {"prefill_chunk": None, "dtype": "float32", "cache": "none", "stop": ""}
    if variable == "new_tokens":
        return max(values)
    return preferred.get(variable, values[0])


def sweep(variable: str, values: Sequence[Any], manifest: Manifest, *, out_dir: str | Path | None = None,
          progress: bool = True, before_point: Callable[[Any], None] | None = None) -> list[dict[str, Any]]:
    """Run a sensitivity sweep of ``variable`` over ``values`` holding ``manifest`` fixed.

    The base point (:func:`_base_value`: one-shot, float32, no cache, the longest output, no
    stop) is run first (and measured even when not in ``values``, then not reported), so each
    point can be judged against it.  With ``out_dir``: writes ``sweep-<variable>.jsonl`` and
    ``sweep-<variable>.png`` there.

    Returns:
        One JSON-ready dict per value, in the order given.

    Raises:
        Rejection: ``sweep.variable_unsupported`` / ``sweep.value_invalid`` before anything runs;
            ``model.file_missing`` when SmolLM2 is asked for and absent.
    """
    from tqdm import tqdm

    if variable not in VARIABLES:
        parse_values(variable, "x")  # raises the typed refusal
    manifest.check()
    points = [attrs.evolve(manifest, **{variable: v}) for v in values]
    for p in points:
        p.check()
    models = _Models()
    base_value = _base_value(variable, values)
    base_manifest = attrs.evolve(manifest, **{variable: base_value})
    order = sorted(range(len(points)), key=lambda i: values[i] != base_value)
    lines: dict[int, dict[str, Any]] = {}
    info = machine()
    base_probe = None
    bar = tqdm(total=len(points) + (base_value not in values), desc=f"sweep {variable}", unit="point", disable=not progress)
    with bar:
        if base_value not in values:
            base_probe = _probe(models, base_manifest, models.prompt(base_manifest))
            bar.update(1)
        for i in order:
            if before_point is not None:
                before_point(values[i])
            line, probe = measure_point(models, variable, points[i], base_probe, base_manifest)
            if values[i] == base_value:
                base_probe = probe
            line["base"] = f"{variable}={base_value}"
            line["machine"] = info
            lines[i] = line
            bar.update(1)
    out = [lines[i] for i in range(len(points))]
    if out_dir is not None:
        _write_jsonl(out, Path(out_dir) / f"sweep-{variable}.jsonl")
        plot_sweep(out, Path(out_dir) / f"sweep-{variable}.png")
    return out


def compare(configs: Sequence[dict[str, Any]], manifest: Manifest, *, out_dir: str | Path | None = None,
            progress: bool = True) -> list[dict[str, Any]]:
    """A configuration comparison: each config (manifest fields -> values) run as it is, judged by the generic contract.

    What differs between configurations is named in each line's ``moved``; nothing here is a
    sensitivity curve (several variables move at once).  With ``out_dir``: ``compare.jsonl`` and
    ``compare.png``.
    """
    from tqdm import tqdm

    models = _Models()
    info = machine()
    fields = attrs.fields_dict(Manifest)
    out = []
    for config in configs:
        unknown = sorted(set(config) - set(fields))
        if unknown or not config:
            raise Rejection(SWEEP_VALUE_INVALID, f"a configuration names no or unknown manifest fields {unknown}", "$.config")
    points = [attrs.evolve(manifest, **config).check() for config in configs]
    for config, m in tqdm(list(zip(configs, points)), desc="compare", unit="config", disable=not progress):
        prompt = models.prompt(m)
        probe = _probe(models, m, prompt)
        cost = _timed(models, m, prompt)
        contract = _contract("prompt_len", m, probe, None, None)
        out.append({"kind": "configuration_comparison", "moved": dict(config), "manifest": attrs.asdict(m), "cost": cost,
                    "contract": contract, "machine": info})
    if out_dir is not None:
        _write_jsonl(out, Path(out_dir) / "compare.jsonl")
        plot_comparison(out, Path(out_dir) / "compare.png")
    return out


def _write_jsonl(lines: Sequence[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))


# ----------------------------------------------------------------------------------------------
# Plots.
# ----------------------------------------------------------------------------------------------
def _caption(lines: Sequence[dict[str, Any]], variable: str | None) -> str:
    m = Manifest(**lines[0]["manifest"])
    mach = lines[0]["machine"]
    return (f"Fixed manifest: {m.caption(variable)}.\nMachine: {mach['cpu']}, {mach['cores']} cores, ATen {mach['aten_cpu_capability']}, "
            f"torch {mach['torch']}; TTFT/ITL from {m.repetitions} runs after a warm-up (spec/latency.py definitions).")


def plot_sweep(lines: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Four panels against the swept variable: TTFT and E2E, ITL p50/p90/p99, model calls and K/V bytes, the contract.

    The contract panel plots the first-row L-infinity error against the float64 reference over the
    calibrated epsilon (below 1 = within tolerance) and marks a failed point with a red cross.
    """
    plt = _pyplot()
    variable = lines[0]["variable"]
    labels = [str(line["value"]) if line["value"] not in (None, "") else ("one shot" if variable == "prefill_chunk" else "none")
              for line in lines]
    numeric = variable in ("prompt_len", "new_tokens") or (variable == "prefill_chunk" and all(line["value"] is not None for line in lines))
    xs = [line["value"] for line in lines] if numeric else list(range(len(lines)))

    def series(get: Callable[[dict[str, Any]], Any]) -> list[float]:
        return [np.nan if get(line) is None else float(get(line)) for line in lines]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.6))
    ax = axes[0][0]
    ax.plot(xs, series(lambda l: l["cost"]["ttft_ms"]["median"]), "o-", label="TTFT p50")
    ax.plot(xs, series(lambda l: l["cost"]["e2e_ms"]), "s--", label="E2E p50")
    ax.plot(xs, series(lambda l: l["cost"]["prefill_ms"]), "^:", label="prefill calls p50")
    ax.set_ylabel("time (ms)")
    ax.set_title("time to first token, end to end, prefill")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for q, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
        ax.plot(xs, series(lambda l, q=q: l["cost"]["itl_ms"][q]), style, label=f"ITL {q if q != 'median' else 'p50'}")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title("inter-token latency (every token of every run)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(xs, series(lambda l: max(l["cost"]["calls"]) if l["cost"]["calls"] else None), "o-", color="tab:purple", label="model calls")
    ax.plot(xs, series(lambda l: l["cost"]["expected_calls"]), "x", color="black", label="expected (spec)")
    ax.set_ylabel("model calls (count)")
    ax.set_title("model calls and retained K/V")
    twin = ax.twinx()
    twin.plot(xs, series(lambda l: l["cost"]["kv_bytes"] / 2**20), "d--", color="tab:green", label="K/V at finish")
    twin.set_ylabel("K/V bytes at finish (MiB)", color="tab:green")
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1][1]
    ratio = series(lambda l: None if l["contract"]["measures"]["first_row_linf"] is None
                   else l["contract"]["measures"]["first_row_linf"] / l["contract"]["measures"]["epsilon"])
    if variable == "num_beams":
        ax.plot(xs, series(lambda l: l["contract"]["measures"].get("branch_logprob_error_over_bound")), "s--",
                label="branch logprob error / bound (float64 ref)")
    ax.plot(xs, ratio, "o-", label="first-row L-inf / epsilon (float64 ref)")
    if any("first_row_linf_vs_base" in l["contract"]["measures"] for l in lines):
        ax.plot(xs, series(lambda l: (l["contract"]["measures"].get("first_row_linf_vs_base") or 0.0) / l["contract"]["measures"]["epsilon"]),
                "s--", label="last-row L-inf vs own base run / epsilon (bound 2)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    if variable in ("dtype", "cache", "prefill_chunk", "new_tokens"):
        for x, y, line in zip(xs, ratio, lines):
            m = line["contract"]["measures"]
            diverge = m.get("token_divergence_from_base")
            ax.annotate(f"margin crossings {m['margin_crossings']}/{line['cost']['output_count']}\n"
                        f"tokens diverge: {'no' if diverge is None else f'at {diverge}'}",
                        (x, y), textcoords="offset points", xytext=(0, 10), ha="center", fontsize=7)
    bad = [i for i, l in enumerate(lines) if not l["contract"]["passed"]]
    if bad:
        ax.plot([xs[i] for i in bad], [ratio[i] for i in bad], "x", color="red", ms=12, mew=3, label="contract FAILED")
    ax.set_ylim(bottom=0.0, top=max([1.3, *[r * 1.3 for r in ratio if np.isfinite(r)]]))
    ax.set_ylabel("error / calibrated epsilon (1)")
    ax.set_title("contract: " + ("passed at every point" if not bad else f"FAILED at {len(bad)} point(s)"))
    ax.legend(fontsize=8)
    for row in axes:
        for a in row:
            a.set_xlabel(VARIABLES[variable])
            if not numeric:
                a.set_xticks(xs)
                a.set_xticklabels(labels)
            a.grid(alpha=0.3)
            a.margins(x=0.12)
    fig.suptitle(f"decodespec sweep {variable} (M3.10 0x0BA: one variable moves, the manifest stays fixed)")
    return _save(fig, _caption(lines, variable), path, rect=(0, 0.06, 1, 0.96))


def plot_comparison(lines: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Bars per configuration: TTFT p50, ITL p50 and E2E (ms); titled a configuration comparison."""
    plt = _pyplot()
    labels = [", ".join(f"{k}={v}" for k, v in line["moved"].items()) for line in lines]
    idx = np.arange(len(lines))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(lines)), 4.6))
    for j, (name, get) in enumerate((("TTFT p50", lambda l: l["cost"]["ttft_ms"]["median"]), ("ITL p50", lambda l: l["cost"]["itl_ms"]["median"]),
                                     ("E2E p50", lambda l: l["cost"]["e2e_ms"]))):
        ax.bar(idx + (j - 1) * 0.27, [get(l) or 0.0 for l in lines], 0.27, label=name)
    ax.set_xticks(idx)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("time (ms)")
    ax.set_title("configuration comparison (several variables move: not a sensitivity curve)")
    ax.legend(fontsize=8)
    return _save(fig, _caption(lines, None), path, rect=(0, 0.08, 1, 1))


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, caption: str, path: str | Path, *, rect: tuple[float, float, float, float]) -> Path:
    """Put the caption (the fixed manifest and the machine) under the figure, write the PNG, close the figure."""
    fig.text(0.01, 0.005, caption, fontsize=7.5, va="bottom", wrap=True)
    fig.tight_layout(rect=rect)
    path = Path(path)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
