"""Gate procedures for runtime families the request adapter does not drive: beam search and encoder-decoder.

Two ``custom`` cases of the table (:mod:`decodespec.checks.cases`) for our runtime:

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

The reference computations (:meth:`decodespec.checks.lockstep.Reference.row`,
:func:`encdec_reference`) are the specification side of these comparisons.

Source: M3.10 0x05 "A beam is a coupled branch-state vector", "Fork parent state before
appending the child token", 0x01 "Architecture-qualified conformance tests", 0x0B "Beam
bookkeeping bugs", "Encoder-decoder memory bugs"; M3.8 0x0F.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cases import CUSTOM, Case, _greedy_continuation
from .ladder import FAILED, PASSED, Verdict, score_row_failure, tolerance_for
from .lockstep import reference_for

__all__ = ["ENCDEC_TOLERANCE", "beam_lockstep", "encdec_cached_vs_uncached", "encdec_reference"]

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
    path = _greedy_continuation(model, prompt, steps)
    eos = path[2]
    legal = {eos}
    for i in range(steps):
        legal |= {int(t) for t in np.argsort(-ref.row(tuple(prompt) + tuple(path[:i])), kind="stable")[:_LEGAL_PER_STEP]}
    flip = {"even": "odd", "odd": "even"}
    transitions = {s: {str(t): (flip[s] if t % 2 else s) for t in sorted(legal)} for s in ("even", "odd")}
    return eos, sorted(legal), {"initial": "even", "transitions": transitions}


def beam_lockstep(case: Case, runtime: str) -> Verdict:
    """The ``matrix.beam_lockstep`` procedure (see the module docstring)."""
    from decodespec.impl.beam import BeamRunner
    from decodespec.impl.runtime import RuntimeRequest
    from decodespec.spec import beam as B
    from decodespec.spec.errors import DecodeSpecError
    from decodespec.spec.policy import policy_config_from_json

    from .adapters.impl import load_model

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


def encdec_cached_vs_uncached(case: Case, runtime: str) -> Verdict:
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


CUSTOM[("matrix.beam_lockstep", "impl")] = beam_lockstep
CUSTOM[("matrix.encdec_cached_vs_uncached", "impl")] = encdec_cached_vs_uncached
