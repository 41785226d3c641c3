"""Judging prompt logprobs (M3.10 0x02) against the float64 reference: the ``prompt_logprobs`` gate case.

A runtime that declares the capability ``output.prompt_logprobs`` answers
``adapter.prompt_logprobs(config, spec)`` with one
:class:`~decodespec.spec.prompt_logprobs.PromptLogprob` per entry (in-process adapters only; the
JSON-lines wire has no such message yet).  :func:`judge` compares an answer with the reference:

* STATE ``prompt_logprobs.aligned``: the shape ``invariant.prompt_logprobs_aligned`` requires
  (count ``L`` or ``L - 1``, positions, ids, ``x_0`` unscored under ``none``, ranks and top-k
  consistent);
* TENSOR ``prompt_logprobs.value``: each logprob within the declared logprob tolerance of the
  reference log-softmax of the float64 row of the same prefix (:class:`~decodespec.checks.gate.reference.Reference64`
  ``row(x_0..x_{i-1})``), at that row's scale (:meth:`~decodespec.checks.gate.tolerance.Tolerance.at_row`);
* DECISION ``prompt_logprobs.rank`` / ``prompt_logprobs.top_k``: the rank lies in the interval
  the tolerance cannot decide (ids whose reference logprob is more than 2 epsilon above the
  token's are surely ahead, those within it may go either way), each top-k id's reference
  logprob is within 2 epsilon of the reference's own ``j``-th value, and its value within the
  logprob tolerance of the reference at that id.

The case (:func:`run_prompt_logprobs_case`) asks for the answer under one-shot prefill, chunked
prefill (``prefill_chunk = 3``), the static cache and the no-cache path where the runtime
declares them, judges each, and compares every variant with the one-shot answer within twice
the tolerance (both are within it of the reference).

Source: M3.10 0x02 "Prompt logprobs versus generated-token logprobs"; "A logit tolerance is not a
token-equality proof" (2 epsilon margins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.prompt_logprobs import PromptLogprob, PromptLogprobsSpec, prompt_logprobs_aligned, scored_positions

from .ladder import FAILED, PASSED, Verdict
from .tolerance import Tolerance, tolerance_for

__all__ = ["CAPABILITY", "judge", "reference_rows", "run_prompt_logprobs_case", "variants"]

#: The capability name (derived from the request schema's ``output.prompt_logprobs``).
CAPABILITY = "output.prompt_logprobs"


def reference_rows(model: str, prompt_ids: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{i: (raw float64[V], log-softmax float64[V])}``: the reference row scoring ``x_i`` (prefix ``x_0 .. x_{i-1}``), ``i = 1 .. L-1``."""
    from .lockstep import reference_for

    ref = reference_for(model)
    out = {}
    for i in range(1, len(prompt_ids)):
        row = np.asarray(ref.row(tuple(prompt_ids[:i])), dtype=np.float64)  # [V]
        shifted = row - row.max()
        out[i] = (row, shifted - np.log(np.exp(shifted).sum()))
    return out


def _fail(layer: str, check: str, expected: Any, actual: Any, message: str) -> Verdict:
    return Verdict(FAILED, layer, f"ladder.{layer}", check, expected, actual, message)


def judge(model: str, prompt_ids: Sequence[int], spec: PromptLogprobsSpec, entries: Sequence[PromptLogprob], tol: Tolerance,
          *, what: str = "prompt logprobs") -> Verdict:
    """The verdict on one answer (see the module docstring); ``passed`` when every layer passes."""
    if not prompt_logprobs_aligned(prompt_ids, spec, entries):
        got = [(e.position, e.token_id, e.logprob is None) for e in entries][:8]
        want = [(p, int(prompt_ids[p]), r is None) for p, r in scored_positions(len(prompt_ids), spec)][:8]
        return _fail("STATE", "prompt_logprobs.aligned", want, got, f"{what}: the entries do not have the shape "
                     "invariant.prompt_logprobs_aligned requires (positions, ids, first-token policy, ranks, top-k)")
    rows = reference_rows(model, prompt_ids)
    for entry in entries:
        if entry.logprob is None:
            continue
        raw, ref = rows[entry.position]
        at = tol.at_row(raw)  # epsilon at the raw row's scale; logprob bound 2 epsilon plus rounding
        eps = at.logit
        want = float(ref[entry.token_id])
        if not abs(entry.logprob - want) <= at.logprob:
            return _fail("TENSOR", "prompt_logprobs.value", {"position": entry.position, "logprob": want},
                         {"position": entry.position, "logprob": entry.logprob},
                         f"{what}: x_{entry.position} (id {entry.token_id}) has logprob {entry.logprob:.6g}, the reference "
                         f"{want:.6g}; |error| {abs(entry.logprob - want):.3g} > bound {at.logprob:.3g}")
        ahead = int(np.sum(ref > want + 2 * eps))
        maybe = int(np.sum(ref >= want - 2 * eps))  # the token itself included
        if not 1 + ahead <= entry.rank <= maybe:
            return _fail("DECISION", "prompt_logprobs.rank", [1 + ahead, maybe], entry.rank,
                         f"{what}: x_{entry.position} has rank {entry.rank}; the reference puts it in [{1 + ahead}, {maybe}] "
                         f"within 2 epsilon = {2 * eps:.3g}")
        order = np.lexsort((np.arange(ref.size), -ref))[: len(entry.top or ())]
        for j, (token, value) in enumerate(entry.top or ()):
            expected_value = float(ref[order[j]])
            if not (abs(float(ref[token]) - expected_value) <= 2 * eps + at.logprob and abs(value - float(ref[token])) <= at.logprob):
                return _fail("DECISION", "prompt_logprobs.top_k", {"rank": j + 1, "id": int(order[j]), "logprob": expected_value},
                             {"rank": j + 1, "id": int(token), "logprob": value},
                             f"{what}: rank {j + 1} of row {entry.position - 1} is id {token} ({value:.6g}); the reference's is "
                             f"id {int(order[j])} ({expected_value:.6g}), its value at id {token} {float(ref[token]):.6g}")
    return Verdict(PASSED)


def _pair(a: Sequence[PromptLogprob], b: Sequence[PromptLogprob], tol: Tolerance, what: str) -> Verdict:
    """Two answers for the same prompt: equal shape and ids, logprobs within twice the tolerance."""
    bound = tol.scaled(2).logprob
    for x, y in zip(a, b):
        if (x.position, x.token_id) != (y.position, y.token_id) or (x.logprob is None) != (y.logprob is None):
            return _fail("STATE", "prompt_logprobs.pair", [x.position, x.token_id], [y.position, y.token_id], f"{what}: entries differ")
        if x.logprob is not None and not abs(x.logprob - y.logprob) <= bound:
            return _fail("TENSOR", "prompt_logprobs.pair", x.logprob, y.logprob,
                         f"{what}: x_{x.position} logprobs {x.logprob:.6g} vs {y.logprob:.6g} differ by more than {bound:.3g}")
    if len(a) != len(b):
        return _fail("STATE", "prompt_logprobs.pair", len(a), len(b), f"{what}: entry counts differ")
    return Verdict(PASSED)


def variants(config: Any) -> list[tuple[str, Any]]:
    """``(name, config)``: one-shot (the case's), chunked by 3, the static cache and the no-cache path."""
    return [("one-shot", config), ("chunked prefill (3)", config.evolve(prefill_chunk=3)), ("static cache", config.evolve(cache="static")),
            ("no cache", config.evolve(cache="none"))]


def run_prompt_logprobs_case(adapter: Any, case: Any, runtime: str) -> Verdict:
    """The ``prompt_logprobs`` gate case on one adapter (it declares :data:`CAPABILITY`; see the module docstring).

    Each first-token policy is asked once per variant the adapter declares the capabilities for, with ``top_k = 3``.
    """
    from ..adapters import config_capabilities

    config = case.config
    tol = tolerance_for(runtime, config.model, config.dtype)
    declared = adapter.capabilities()
    for first in ("none", "omitted"):
        spec = PromptLogprobsSpec(first_token=first, top_k=3)
        base = None
        for name, variant in variants(config):
            if not config_capabilities(variant) <= declared:
                continue
            what = f"{runtime} prompt logprobs ({name}, first_token {first})"
            entries = tuple(adapter.prompt_logprobs(variant, spec))
            verdict = judge(config.model, config.prompt_ids, spec, entries, tol, what=what)
            if verdict.passed and base is not None:
                verdict = _pair(base, entries, tol, f"{what} versus one-shot")
            if not verdict.passed:
                return attrs.evolve(verdict, message=verdict.message)
            base = entries if base is None else base
    return Verdict(PASSED)
