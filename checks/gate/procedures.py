"""Gate procedures for the table's ``custom`` cases: what the request adapter does not drive.

:data:`CUSTOM` maps ``(case id, runtime)`` to a procedure ``(case, runtime) -> Verdict`` (``case`` a
:class:`decodespec.checks.gate.cases.Case`); :func:`~decodespec.checks.gate.cases.run_case` skips a custom
case of a runtime without one.  Padded batches (``matrix.padded_batch_*``: every row against the
reference path and the batch-size-one run) and beam width one (``matrix.greedy_vs_beam1``) run on
our runtime and on HF; two runtime families run on our runtime only:

* ``matrix.beam_lockstep``: :class:`~decodespec.impl.beam.BeamRunner` (K = 3, the normative
  ``exact`` termination waiting for the two best results, an EOS the model reaches early, a parity
  constraint automaton over a legal set of likely tokens, so that the per-branch policy lane
  differs between beams) driven call by call.  TENSOR: each live beam's raw row is the reference row of **its own** prefix
  (the cache follows the parent map).  DECISION: the spec's ``beam_step``
  (:mod:`decodespec.spec.beam`) over the runtime's own processed rows takes the same decisions,
  exports the same branch lanes (tokens, scores, normalized scores, constraint state, ancestry)
  and stops at the same step; STATE: the spec's beam invariants hold on every step
  (``check_step``).
* ``matrix.encdec_cached_vs_uncached``: the encoder-decoder profile with a padded source batch.
  TENSOR: the cached target decoding's log-probabilities at every step equal the uncached
  full-prefix reference (:func:`encdec_reference`) under the source mask within ``1e-5``;
  DECISION: identical tokens; STATE: the fixed lanes (memory, cross K/V) are unchanged (version
  counters and SHA-256) and the lane frontiers are the profile's.

The reference computations (:meth:`decodespec.checks.gate.lockstep.Reference.row`,
:func:`encdec_reference`) are the specification side of these comparisons.

Source: M3.10 0x05 "A beam is a coupled branch-state vector", "Fork parent state before
appending the child token", 0x01 "Architecture-qualified conformance tests", 0x0B "Beam
bookkeeping bugs", "Encoder-decoder memory bugs"; M3.8 0x0F.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..modelcheck.traces import open_runtime
from .coverage import record_items
from .divergence import drive, path_divergence_verdict, row_path_verdict
from .ladder import FAILED, PASSED, Verdict, score_row_failure
from .lockstep import reference_for
from .prompts import greedy_continuation, prompt_ids
from .tolerance import tolerance_for

__all__ = ["CUSTOM", "ENCDEC_TOLERANCE", "beam_lockstep", "encdec_cached_vs_uncached", "encdec_reference"]

#: Declared tolerance on float32 encoder-decoder log-probabilities, cached versus uncached (tests/test_encdec.py).
ENCDEC_TOLERANCE = 1e-5
#: Beam width and the number of likely tokens per step that make the constraint's legal set.
_BEAMS, _LEGAL_PER_STEP = 3, 8


def _fail(layer: str, check: str, expected: Any, actual: Any, message: str) -> Verdict:
    return Verdict(FAILED, layer, f"ladder.{layer}", check, expected, actual, message)


# --------------------------------------------------------------------------------------------
# Beam search in lock step.
# --------------------------------------------------------------------------------------------


def _beam_setup(model: str, prompt: tuple[int, ...], steps: int) -> tuple[int, list[int], dict[str, Any]]:
    """``(eos, legal ids, automaton)``: EOS is the reference's third greedy token (hypotheses complete while others
    live on); the legal set is the top :data:`_LEGAL_PER_STEP` ids along the greedy path plus EOS; the automaton
    flips its state on odd ids, so the constraint lane of a branch depends on its whole path."""
    ref = reference_for(model)
    path = list(greedy_continuation(model, prompt, steps))
    eos = path[2]
    legal = {eos}
    for i in range(steps):
        legal |= {int(t) for t in np.argsort(-ref.row(tuple(prompt) + tuple(path[:i])), kind="stable")[:_LEGAL_PER_STEP]}
    flip = {"even": "odd", "odd": "even"}
    transitions = {s: {str(t): (flip[s] if t % 2 else s) for t in sorted(legal)} for s in ("even", "odd")}
    return eos, sorted(legal), {"initial": "even", "transitions": transitions}


def beam_lockstep(case: Any, runtime: str) -> Verdict:
    """The ``matrix.beam_lockstep`` procedure (see the module docstring)."""
    from decodespec.impl.beam import BeamRunner
    from decodespec.impl.runtime import RuntimeRequest
    from decodespec.spec import beam as B
    from decodespec.spec.errors import DecodeSpecError
    from decodespec.spec.policy import policy_config_from_json

    from ..adapters.impl import load_model

    config = case.config
    steps = config.max_new_tokens + 2
    eos, _, automaton = _beam_setup(config.model, config.prompt_ids, steps)
    params = B.BeamParams(_BEAMS, steps, [eos], length_penalty=B.LengthPenalty(1.0), early_stop="exact", num_completed=2)
    policy = policy_config_from_json({"family": "beam", "num_beams": _BEAMS, "transforms": [{"name": "constraint", "automaton": automaton}]})
    request = RuntimeRequest(identity=config.identity(), prompt_ids=config.prompt_ids, max_new_tokens=steps, policy=policy,
                             eos_ids=frozenset({eos}), cache=config.cache)
    runner = BeamRunner(load_model(config.model, config.dtype, config.device, config.attention), request, params, record=True)
    ref, tol = reference_for(config.model), tolerance_for(runtime, config.model, config.dtype)
    while not runner.done:
        if runner.phase == "scored":
            runner.decide()
            continue
        prefixes = [config.prompt_ids + b.tokens for b in runner.live]
        raw = runner.call().detach().to("cpu").float().numpy()  # [n, V]
        for k, prefix in enumerate(prefixes):
            ref_row = ref.row(prefix)
            eps = tol.epsilon(ref_row)
            bad = score_row_failure(ref_row, raw[k], eps, check="beam.score_row",
                                    where=f"step {runner.step_idx}: live beam {k}'s row against the reference row of its prefix: ",
                                    suffix=" (the cache does not hold that beam's prefix)")
            if bad is not None:
                return bad
    edges = {s: {int(t): n for t, n in e.items()} for s, e in automaton["transitions"].items()}
    lanes = B.BranchLanes(constraint_init="even", constraint_step=lambda q, t: edges[q][t])
    state = B.initial_state(params, config.prompt_ids, request_id=request.identity, lanes=lanes)
    try:
        for t, log in enumerate(runner.log):
            state = B.beam_call(params, state)
            if state.live != log.expanded:
                return _fail("DECISION", "beam.parents", [b.prefix for b in state.live], [b.prefix for b in log.expanded],
                             f"step {t}: the live parents' branch lanes differ from the spec's")
            before = state
            state, record = B.beam_step(params, state, log.rows.double().numpy())
            if record.to_event() != runner.events[t]:
                return _fail("DECISION", "beam.step", record.to_event(), runner.events[t], f"step {t}: the beam decisions differ")
            if state.live != log.children or record.completed != log.completed:
                return _fail("DECISION", "beam.lanes", [b.prefix for b in state.live], [b.prefix for b in log.children],
                             f"step {t}: the children's exported branch lanes differ from the spec's fork of their parents")
            broken = B.check_step(params, before, record, state)
            if broken:
                return _fail("STATE", "beam.invariants", [], list(broken), f"step {t}: beam invariants violated")
    except DecodeSpecError as exc:
        return _fail("DECISION", "beam.stop", "the spec's search", exc.code, f"the runtime searched on after the spec stopped: {exc.message}")
    if state.phase is not B.BeamPhase.DONE or state.stop is not runner.stop:
        return _fail("DECISION", "beam.stop", None if state.stop is None else state.stop.value, runner.stop.value,
                     f"the runtime stopped after {len(runner.log)} steps ({runner.stop.value}); the spec has not")
    return Verdict(PASSED)


# --------------------------------------------------------------------------------------------
# Encoder-decoder.
# --------------------------------------------------------------------------------------------

_ENCDEC = {"vocab": 64, "start": 1, "pad": 0, "max_len": 10}
_SRC = ((5, 9, 12, 40, 33, 7, 21, 8), (3, 4, 5, 6, 0, 0, 0, 0))


def encdec_reference(model: Any, src: Any, src_mask: Any, max_len: int, start_symbol: int) -> Any:
    """The uncached reference: every step decodes the whole target prefix from a fresh memory (the spec side)."""
    from decodespec.impl.encdec import greedy_decode

    return greedy_decode(model, src, src_mask, max_len, start_symbol, use_cache=False)


def encdec_cached_vs_uncached(case: Any, runtime: str) -> Verdict:
    """The ``matrix.encdec_cached_vs_uncached`` procedure (see the module docstring)."""
    import torch

    from decodespec.impl.encdec import greedy_decode, make_model

    e = _ENCDEC
    model = make_model(e["vocab"], e["vocab"], N=2, d_model=64, d_ff=128, h=4, seed=0)
    src = torch.tensor(_SRC)
    mask = (src != e["pad"])[:, None, :]  # [B, 1, S]
    ref = encdec_reference(model, src, mask, e["max_len"], e["start"])
    out = greedy_decode(model, src, mask, e["max_len"], e["start"])
    if out.fingerprint_before != out.fingerprint_after:
        return _fail("STATE", "encdec.fixed_lanes", "unchanged", "changed",
                     "target decoding wrote the encoder memory or the cross K/V (fixed lanes)")
    want = {"encoder_memory": src.shape[1], "cross_kv": src.shape[1], "self_kv": e["max_len"] - 1}
    if out.lanes != want:
        return _fail("STATE", "encdec.lane_frontiers", want, out.lanes, "the lane frontiers are not the profile's")
    for step in range(ref.scores.shape[0]):
        err = float((out.scores[step] - ref.scores[step]).abs().max())
        if not err <= ENCDEC_TOLERANCE:
            return _fail("TENSOR", "encdec.scores", f"<= {ENCDEC_TOLERANCE}", err,
                         f"step {step}: cached log-probabilities are {err:.3g} away from the uncached reference under the source mask")
    if not torch.equal(out.ys, ref.ys):
        return _fail("DECISION", "encdec.tokens", ref.ys.tolist(), out.ys.tolist(), "cached and uncached decoding select other tokens")
    return Verdict(PASSED)


# --------------------------------------------------------------------------------------------
# Padded batches and beam width one: our runtime and HF.
# --------------------------------------------------------------------------------------------


def _impl_padded_batch(case: Any, runtime: str) -> Verdict:
    """``matrix.padded_batch_*``: every row of our padded batch against the reference path and the batch-size-one run."""
    from decodespec.impl.batch import batch_generate

    from ..adapters.impl import load_model

    config = case.config
    side = case.id.rsplit("_", 1)[-1]
    record_items({f"padding_side.{side}"})
    model = load_model(config.model, config.dtype, config.device, config.attention, config.decode_kernel)
    tol = tolerance_for(runtime, config.model, config.dtype)
    prompts = [config.prompt_ids, prompt_ids(config.model, "Hi"), prompt_ids(config.model, "héllo ✓ 日本")]
    batch = batch_generate(model, prompts, max_new_tokens=config.max_new_tokens, eos_token_ids=config.eos_ids, padding_side=side,
                           return_scores=True)
    assert batch.scores is not None
    for b, (prompt, row) in enumerate(zip(prompts, batch.rows)):
        verdict = row_path_verdict(config.model, prompt, row.output_ids, batch.scores[b], tol)
        if not verdict.passed:
            return attrs.evolve(verdict, message=f"batch row {b} ({side} padding): {verdict.message}")
        single = drive(open_runtime(runtime, config.model), config.evolve(prompt_ids=prompt), [{"op": "run"}], runtime)
        if single.verdict.result == FAILED:
            return single.verdict
        verdict = path_divergence_verdict(single, single.observation.output_ids, row.output_ids, tol, layer="STATE",
                                          check="batch.output_ids", what=f"batch row {b} ({side} padding) and the batch-size-one run")
        if not verdict.passed:
            return verdict
    return Verdict(PASSED)


def _impl_beam_width_one(case: Any, runtime: str) -> Verdict:
    """``matrix.greedy_vs_beam1``: beam width one selects the greedy path, its score the sum of the greedy logprobs."""
    from decodespec.impl.beam import beam_generate
    from decodespec.spec.beam import BeamParams

    from ..adapters.impl import load_model

    config = case.config
    model = load_model(config.model, config.dtype, config.device, config.attention, config.decode_kernel)
    tol = tolerance_for(runtime, config.model, config.dtype)
    greedy = drive(open_runtime(runtime, config.model), config, [{"op": "run"}], runtime)
    if greedy.verdict.result == FAILED:
        return greedy.verdict
    obs = greedy.observation
    result = beam_generate(model, config.prompt_ids, BeamParams.hf_compatible(1, config.max_new_tokens, config.eos_ids))
    record_items({"beam.width.1"})
    best = result.best
    if best is None:
        return Verdict(FAILED, "DECISION", "ladder.DECISION", "beam.tokens", list(obs.output_ids), None,
                       "beam width one completes no hypothesis")
    verdict = path_divergence_verdict(greedy, obs.output_ids, best.output_ids, tol, layer="DECISION", check="beam.tokens",
                                      what="greedy decoding and beam width one")
    if not verdict.passed:
        return verdict
    total = float(sum(obs.logprobs))
    if not abs(best.score - total) <= tol.logprob * max(1, len(obs.logprobs)):
        return Verdict(FAILED, "DECISION", "ladder.DECISION", "beam.score", total, best.score,
                       "the width-one beam score is not the sum of the greedy logprobs")
    return Verdict(PASSED)




def _hf_padded_batch(case: Any, runtime: str) -> Verdict:
    """``matrix.padded_batch_*``: every row of HF's padded batch against the reference path and HF's batch-size-one run."""
    from ..adapters.hf import batch_generate  # HF transformers: imported when the hf runtime runs

    config = case.config
    side = "left" if "left" in case.id else "right"
    tol = tolerance_for(runtime, config.model, config.dtype)
    prompts = [config.prompt_ids, prompt_ids(config.model, "Hi"), prompt_ids(config.model, "héllo ✓ 日本")]
    for b, (prompt, (ids, rows)) in enumerate(zip(prompts, batch_generate(config, prompts, side))):
        verdict = row_path_verdict(config.model, prompt, ids, rows, tol)
        if not verdict.passed:
            return attrs.evolve(verdict, message=f"HF batch row {b} ({side} padding): {verdict.message}")
        single = drive(open_runtime(runtime, config.model), config.evolve(prompt_ids=prompt), [{"op": "run"}], runtime)
        if single.verdict.result == FAILED:
            return single.verdict
        verdict = path_divergence_verdict(single, single.observation.output_ids, ids, tol, layer="STATE", check="batch.output_ids",
                                          what=f"HF batch row {b} ({side} padding) and HF's batch-size-one run")
        if not verdict.passed:
            return verdict
    return Verdict(PASSED)


def _hf_beam_width_one(case: Any, runtime: str) -> Verdict:
    """``matrix.greedy_vs_beam1``: ``generate(num_beams=1)`` (HF dispatches it to greedy search) equals the lock-step greedy run."""
    from ..adapters.hf import generate_sequence  # HF transformers: imported when the hf runtime runs

    config = case.config
    greedy = drive(open_runtime(runtime, config.model), config, [{"op": "run"}], runtime)
    if greedy.verdict.result == FAILED:
        return greedy.verdict
    beam = generate_sequence(config, num_beams=1, text=False)
    ids = beam["output_ids"][0]
    verdict = path_divergence_verdict(greedy, greedy.observation.output_ids, ids, tolerance_for(runtime, config.model, config.dtype),
                                      layer="DECISION", check="beam.tokens", what="HF's step-wise greedy run and generate(num_beams=1)")
    if not verdict.passed:
        return verdict
    if not np.array_equal(beam["logits"][-1], greedy.observation.score_row):
        return Verdict(FAILED, "TENSOR", "ladder.TENSOR", "beam.score_row", "equal rows", "different rows",
                       "HF generate(num_beams=1) decided its last token on another row than the step-wise run")
    return Verdict(PASSED)


#: ``(case id, runtime) -> procedure(case, runtime) -> Verdict`` for the table's ``custom`` cases
#: (:func:`decodespec.checks.gate.cases.run_case` skips a custom case of a runtime without one).
CUSTOM: dict[tuple[str, str], Callable[[Any, str], Verdict]] = {
    ("matrix.padded_batch_left", "impl"): _impl_padded_batch,
    ("matrix.padded_batch_right", "impl"): _impl_padded_batch,
    ("matrix.greedy_vs_beam1", "impl"): _impl_beam_width_one,
    ("matrix.padded_batch_eos_left", "impl"): _impl_padded_batch,
    ("matrix.beam_lockstep", "impl"): beam_lockstep,
    ("matrix.encdec_cached_vs_uncached", "impl"): encdec_cached_vs_uncached,
    ("matrix.padded_batch_left", "hf"): _hf_padded_batch,
    ("matrix.padded_batch_right", "hf"): _hf_padded_batch,
    ("matrix.greedy_vs_beam1", "hf"): _hf_beam_width_one,
}
