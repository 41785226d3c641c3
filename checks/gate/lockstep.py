"""Lock-step driver of the conformance gate: the spec and a runtime adapter take the same actions.

:class:`LockStep` holds one :class:`~decodespec.checks.adapters.Adapter` and the spec side of
the same request -- the spec's :class:`~decodespec.spec.state.RequestParams` and
:class:`~decodespec.spec.state.RequestState`, the M3.8 policy state, the stop/stream reference
-- and applies each contract action (:data:`~decodespec.checks.adapters.OPS`) to both:

1. the adapter applies the action and is observed;
2. the action is translated into spec actions (``prefill`` = ``Launch`` + ``Complete``,
   ``step`` = the controller's next actions up to one ``Commit``, ``snapshot{repaired}`` with a
   pending token = the append call + ``Snapshot`` ...) and stepped through
   :func:`decodespec.spec.transitions.step`; the model is uninterpreted in the spec, so every
   decision takes its score row from the :class:`Reference` (a no-cache float64 forward of the
   same committed prefix by a model that shares no code with ``impl/``, M3.10's "full
   recompute" semantics) and the spec policy
   (:func:`decodespec.spec.policy.decide`) picks the token;
3. both must agree on accept / reject (and the refusal code); a rejected action must leave
   the observation unchanged;
4. the ladder (:func:`decodespec.checks.gate.ladder.compare`) judges the observation against the
   spec state's projection and the references.

A decision where the runtime picked another id than the spec is judged when it is made
(:func:`judge_decision`): failed when the margin rules it out, ``undecided`` when the
tolerance cannot (then the spec adopts the runtime's id -- any id within the tolerance is a
legal spec behaviour -- so the lock step goes on).

The spec side's request is built from the case's envelope (:meth:`CaseConfig.envelope
<decodespec.checks.adapters.CaseConfig.envelope>`, admitted by
:func:`~decodespec.spec.envelope.validate_request_envelope` and composed by
:func:`~decodespec.spec.request_machine.request_from_envelope`), so every default it decides with
is the spec's: ``min_new_tokens`` is enforced by the policy's ``min_new_tokens`` legality
transform (added when the policy lacks it); S defaults to ``L + G + 1`` capped by the model
window; C is the least of the model window, ``context_cap`` and the capacity
(:mod:`decodespec.spec.request`); the schedule of calls is :func:`decodespec.spec.state.due_call`.
Admission first refuses, with the runtime's codes, G = 0 under ``reject``, a prompt id outside the
vocabulary, ``L >= window`` and a static capacity that cannot hold the prompt (``L + 1`` slots
when G >= 1) (:func:`decodespec.spec.request_machine.refusal_of`); the envelope admits the rest.
The RNG is keyed by the case's identity and seed (:func:`~decodespec.spec.request_machine.rekeyed`).

Source: M3.10 "A logit tolerance is not a token-equality proof", "Correctness matrix",
"Boundary cases" (adversarial transitions); research/formal-anchors-survey.md 0 and 7
(quint-connect style lock step; comparison in the harness); docs/design.md section 11.

Size: the lock step: the translation of each contract action into the composed request's steps, the
judging of each decision against the reference, and the expected projection the ladder compares.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import rfc8785

from decodespec.spec import request_machine as rm
from decodespec.spec.actions import Action, Cancel, Fault, Recover, StreamFailure
from decodespec.spec.enums import FINISH_PRECEDENCE, CallKind, FinishReason
from decodespec.spec.envelope import AdmittedRequest, validate_request_envelope
from decodespec.spec.errors import DecodeSpecError, Rejection
from decodespec.spec.policy import PolicyConfig, RequestView, ScoreRow, decide, policy_config_from_json, processed_row
from decodespec.spec.request import policy_with_min_new_tokens
from decodespec.spec.request import static_capacity as request_static_capacity
from decodespec.spec.request_machine import ComposedState, Request, SnapshotEntry, refusal_of, rekeyed, request_from_envelope
from decodespec.spec.state import Phase, RequestParams, RequestState
from decodespec.spec.transitions import MACHINE, Machine

from ..adapters import (
    ADAPTER_UNSUPPORTED,
    RANK_FAULTS,
    Adapter,
    ApplyResult,
    CaseConfig,
    ModelFacts,
    Observation,
    check_action,
    corrupt_record,
    no_controller_action,
)
from .ladder import FAILED, LAYERS, PASSED, UNDECIDED, DecisionCheck, Expected, Verdict, compare, decision_probe, describe_probe, score_row_failure
from .reference import Reference64, load_gguf64
from .reference.files import gguf_path
from .tolerance import Tolerance, tolerance_for
from .vocab_check import reference_vocab

__all__ = [
    "LockStep",
    "Reference",
    "ReferenceDecision",
    "SpecSide",
    "StepRecord",
    "admission_refusal",
    "admitted_envelope",
    "judge_decision",
    "model_facts",
    "policy_for",
    "reference_for",
]

_RUNTIME_INVALID_REQUEST = "runtime.invalid_request"
#: Unit roundoff of each runtime dtype (half an ulp at 1.0).
_UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_CONTEXT_WINDOW_EXCEEDED = "model.context_window_exceeded"


# --------------------------------------------------------------------------------------------
# The reference forward (no-cache semantics, float64 arithmetic independent of impl/).
# --------------------------------------------------------------------------------------------

#: The reference the lock step reads score rows and K/V rows from (see :mod:`decodespec.checks.gate.reference`).
Reference = Reference64

_REFERENCES: dict[str, Reference64] = {}


def reference_for(model: str) -> Reference64:
    """The shared float64 :class:`~decodespec.checks.gate.reference.Reference64` of ``model``, built once per process.

    It reads the model's GGUF file itself (:func:`decodespec.checks.gate.reference.files.gguf_path`;
    the tiny model is written as GGUF first) and shares no code with the runtime it judges.

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
    """
    if model not in _REFERENCES:
        _REFERENCES[model] = Reference64(load_gguf64(gguf_path(model)))
    return _REFERENCES[model]


# --------------------------------------------------------------------------------------------
# Spec-side request constants.
# --------------------------------------------------------------------------------------------


def static_capacity(config: CaseConfig, window: int) -> int | None:
    """S of a static cache: the config's, else the spec's default (:func:`decodespec.spec.request.static_capacity`)."""
    return request_static_capacity(config.cache, config.static_capacity, config.prompt_len, config.max_new_tokens, window)


@functools.cache
def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def model_facts(model: str, reference: Reference, tokenizer: Any) -> ModelFacts:
    """What a case's envelope states about ``model``: its GGUF file's digest, the tokenizer's vocabulary
    hash and EOS / BOS ids, and the reference's V and window.

    Raises:
        Rejection: ``model.file_missing`` when SmolLM2 is not installed.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    return ModelFacts(release_id=model, checkpoint_sha256=_file_sha256(str(gguf_path(model))),
                      tokenizer_sha256=str(tokenizer.vocab_hash), vocab_size=reference.vocab_size, window=reference.window,
                      eos_ids=() if eos is None else (int(eos),), bos_id=getattr(tokenizer, "bos_token_id", None))


def policy_for(config: CaseConfig) -> PolicyConfig:
    """The M3.8 policy the spec side decides with: the config's, plus ``min_new_tokens`` when needed
    (:func:`decodespec.spec.request.policy_with_min_new_tokens`).

    Raises:
        Rejection: ``policy.*`` for a policy object the schema refuses.
    """
    return policy_with_min_new_tokens(policy_config_from_json(config.policy), config.min_new_tokens)


def admission_refusal(config: CaseConfig, vocab_size: int, window: int) -> DecodeSpecError | None:
    """The typed refusal of admitting ``config``, or ``None``: a policy the schema refuses, then the runtime's
    refusals over the case's plain values (:func:`decodespec.spec.request_machine.refusal_of`), which a
    runtime raises with its own codes before any envelope exists.  What passes here is then admitted
    by the envelope (:func:`request_for`).
    """
    try:
        policy_for(config)
    except DecodeSpecError as exc:
        return exc
    return runtime_refusal(config, vocab_size, window)


def runtime_refusal(config: CaseConfig, vocab_size: int, window: int) -> DecodeSpecError | None:
    """:func:`decodespec.spec.request_machine.refusal_of` over ``config``'s values (S: :func:`static_capacity`)."""
    return refusal_of(prompt_ids=config.prompt_ids, max_new_tokens=config.max_new_tokens, zero_new_tokens=config.zero_new_tokens,
                      vocab_size=vocab_size, static_capacity=static_capacity(config, window), window=window)


def admitted_envelope(config: CaseConfig, model: ModelFacts) -> AdmittedRequest:
    """``config``'s envelope (:meth:`CaseConfig.envelope`) through the spec's validator.

    Raises:
        Rejection / ResourceLimit: the envelope's ``envelope.*`` / ``policy.*`` / ``stop.*`` refusal.
    """
    admitted, _ = validate_request_envelope(rfc8785.dumps(config.envelope(model)))
    return admitted


def request_for(config: CaseConfig, model: ModelFacts, special_ids: frozenset[int] = frozenset()) -> Request:
    """The spec's composed :class:`~decodespec.spec.request_machine.Request` of ``config``: its envelope,
    admitted by :func:`~decodespec.spec.envelope.validate_request_envelope`, composed by
    :func:`~decodespec.spec.request_machine.request_from_envelope` (every default the spec's) and keyed
    by the case's identity and seed (:func:`~decodespec.spec.request_machine.rekeyed`).

    Raises:
        Rejection / ResourceLimit: the envelope's refusal (``envelope.*``, ``policy.*``, ``stop.*``).
    """
    request = request_from_envelope(admitted_envelope(config, model), window=model.window, special_ids=special_ids)
    return rekeyed(request, identity=config.identity(), seed=config.seed)


# --------------------------------------------------------------------------------------------
# Judging one decision.
# --------------------------------------------------------------------------------------------


def _temperature(policy: PolicyConfig) -> float:
    t = policy.find("temperature")
    value = None if t is None else t.get("temperature")
    return float(value) if value else 1.0


def judge_decision(
    *,
    policy: PolicyConfig,
    ref_values: np.ndarray,
    ref_token: int,
    runtime_token: int,
    tolerance: Tolerance,
    greedy: bool,
    cand_token: int | None = None,
    ref_probs: np.ndarray | None = None,
    u: float | None = None,
    output_index: int = 0,
    epsilon: float | None = None,
    cand_values: np.ndarray | None = None,
    cand_within_tolerance: bool = False,
) -> Verdict:
    """Judge a decision where the runtime may have picked another id than the spec on the reference row.

    Args:
        policy: The policy.
        ref_values: The spec's processed reference row (selector input).
        ref_token: The spec's id on the reference row.
        runtime_token: The runtime's id.
        tolerance: Declared tolerances (epsilon on logits).
        greedy: Whether the selector is greedy (family greedy or temperature 0).
        cand_token: The spec policy's id on the runtime's own row, when the runtime exposed it.
        ref_probs: Processed reference probabilities (multinomial).
        u: The decision's uniform (multinomial).
        output_index: O of the decision (for the message).
        epsilon: The row's epsilon (:meth:`~decodespec.checks.gate.tolerance.Tolerance.epsilon` of the raw
            reference row; default ``tolerance.logit``).
        cand_values: The spec policy's processed row of the runtime's own raw row, when it exposed
            one (named in the message and the probe beside the reference's).
        cand_within_tolerance: The runtime's own raw row was checked to lie within ``epsilon`` of
            the reference row.  Then a ``cand_token`` equal to ``runtime_token`` is ``undecided``
            (``decision.own_row``) where the tests below would fail it: a row the tolerance admits makes the policy, with the same
            uniform, select the runtime's id, so the tolerance cannot rule it out.  The margin and
            CDF-distance tests below assume the processed row moves continuously with the logits,
            which a truncation does not (``typical``, ``epsilon``, ``top_k`` ... can swap the kept
            id when two candidates are within epsilon of its boundary; found by the machines on tiny
            float16, ``traces/undecided-typical-truncation-own-row.itf.json (first recorded as a failure)``).

    Returns:
        ``passed`` when the ids agree; ``failed`` (DECISION) when the runtime's id is not the
        policy's on its own row, or the reference margin rules it out; ``undecided`` when a row
        within epsilon of the reference could select it (greedy: the runtime's processed score
        is within 2 epsilon of the maximum; sampled: the uniform lies within ``2 epsilon / T``
        of the runtime id's CDF interval, T the temperature).  A non-passing verdict names both
        ids with their processed scores on the reference row (and on the runtime's row when
        given) in its message and its probe (:func:`~decodespec.checks.gate.ladder.decision_probe`).

    Source: M3.10 "A logit tolerance is not a token-equality proof" (margin > 2 epsilon;
    "equal seed is even weaker" for sampling).
    """
    if runtime_token == ref_token:
        return Verdict(PASSED)
    where = f"output {output_index}"
    ids = [ref_token, runtime_token] + ([cand_token] if cand_token is not None else [])
    probe = decision_probe(ids, ref_values, cand_values, what="processed")
    values = f" (processed scores {describe_probe(probe)})"

    def verdict(result: str, check: str, expected: int, message: str) -> Verdict:
        return Verdict(result, "DECISION", "ladder.DECISION", check, expected, runtime_token, message + values, probe=probe)

    if cand_token is not None and cand_token != runtime_token:
        return verdict(FAILED, "decision.policy", cand_token,
                       f"{where}: the runtime selected {runtime_token}, but the policy selects {cand_token} on the runtime's own row")
    eps = tolerance.logit if epsilon is None else epsilon
    own_row = verdict(UNDECIDED, "decision.own_row", ref_token,
                      f"{where}: the policy selects {runtime_token} on the runtime's own score row, which is within epsilon "
                      f"{eps:.3g} of the reference row; the tolerance cannot decide between {ref_token} and {runtime_token}")
    admitted = cand_within_tolerance and cand_token == runtime_token  # checked only where the tests below would fail
    if not 0 <= runtime_token < ref_values.shape[0] or not math.isfinite(float(ref_values[runtime_token])):
        if admitted and 0 <= runtime_token < ref_values.shape[0]:
            return own_row
        return verdict(FAILED, "decision.support", ref_token, f"{where}: the runtime selected {runtime_token}, outside the processed support")
    if greedy:
        gap = float(ref_values[ref_token] - ref_values[runtime_token])
        if gap <= 2 * eps:
            return verdict(UNDECIDED, "decision.margin", ref_token,
                           f"{where}: reference margin {gap:.3g} <= 2 epsilon = {2 * eps:.3g}; the tolerance cannot decide between "
                           f"{ref_token} and {runtime_token}")
        if admitted:
            return own_row
        return verdict(FAILED, "decision.selected_id", ref_token,
                       f"{where}: reference margin {gap:.3g} > 2 epsilon = {2 * eps:.3g} guarantees {ref_token}; the runtime selected "
                       f"{runtime_token}")
    assert ref_probs is not None and u is not None
    cdf = np.cumsum(ref_probs)
    low = float(cdf[runtime_token - 1]) if runtime_token else 0.0
    high = float(cdf[runtime_token])
    distance = max(low - u, u - high, 0.0)
    delta = 2 * eps / _temperature(policy)
    if distance <= delta:
        return verdict(UNDECIDED, "decision.draw_margin", ref_token,
                       f"{where}: the uniform {u:.6g} is {distance:.3g} <= {delta:.3g} from the CDF interval of {runtime_token}; "
                       "the tolerance cannot decide the draw")
    if admitted:
        return own_row
    return verdict(FAILED, "decision.draw", ref_token,
                   f"{where}: the replayed draw selects {ref_token} (uniform {u:.6g} is {distance:.3g} > {delta:.3g} from {runtime_token}'s "
                   f"interval [{low:.6g}, {high:.6g}))")


# --------------------------------------------------------------------------------------------
# The spec side.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class SpecSnapshot:
    """What the spec side keeps per snapshot handle: the composed state's snapshot and the runtime's observation then."""

    entry: SnapshotEntry
    observation: Observation | None


class SpecSide:
    """The spec side of one request: the composed :class:`~decodespec.spec.request_machine.Request` and its
    :class:`~decodespec.spec.request_machine.ComposedState` (one frozen value), stepped by the spec's pure functions.

    Args:
        config: The case config.
        reference: The reference forward of the config's model.
        tokenizer: ``token_bytes`` / ``special_ids`` for the stop/stream reference.
        machine: The spec's transition machine (a broken one in the gate's own tests).
    """

    def __init__(self, config: CaseConfig, reference: Reference, tokenizer: Any, machine: Machine = MACHINE):
        self.reference = reference
        self.tokenizer = tokenizer
        self.machine = machine
        self.snapshots: dict[str, SpecSnapshot] = {}
        self._special_ids = frozenset(getattr(tokenizer, "special_ids", ()))
        self._facts: dict[str, ModelFacts] = {}
        if runtime_refusal(config, reference.vocab_size, reference.window) is None:
            self._install(config)  # a policy or stop refusal raises here, as before the envelope existed
        else:  # refused at admission with the runtime's code (LockStep.reset): no request exists, the state is NEW
            self.config = config
            self.composed = None
            self._unadmitted = RequestState(identity=config.identity(), phase=Phase.NEW)

    def facts(self, model: str) -> ModelFacts:
        """What ``model``'s envelopes state (:func:`model_facts`, computed once per lock step)."""
        if model not in self._facts:
            self._facts[model] = model_facts(model, self.reference, self.tokenizer)
        return self._facts[model]

    def _install(self, config: CaseConfig) -> None:
        self.config = config
        self.request = request_for(config, self.facts(config.model), self._special_ids)
        self.composed = rm.initial(self.request)

    # -- views -----------------------------------------------------------------------------
    @property
    def params(self) -> RequestParams:
        """The M3.10 machine's parameters."""
        return self.request.params

    @property
    def policy(self) -> PolicyConfig:
        """The M3.8 policy the request decides with."""
        return self.request.policy

    @property
    def state(self) -> RequestState:
        """The M3.10 machine state (``NEW`` for a config refused before any request existed)."""
        return self._unadmitted if self.composed is None else self.composed.machine

    def admit(self, config: CaseConfig) -> None:
        """Admission of ``config`` (replaces the request; snapshots are kept).

        Raises:
            Rejection / ResourceLimit: :func:`admission_refusal`; nothing changes.
        """
        refusal = admission_refusal(config, self.reference.vocab_size, self.reference.window)
        if refusal is not None:
            raise refusal
        request = request_for(config, self.facts(config.model), self._special_ids)
        self.composed = rm.admit(request, machine=self.machine)
        self.config, self.request = config, request

    @property
    def sequence(self) -> tuple[int, ...]:
        """``prompt_ids + output_ids``."""
        return self.config.prompt_ids + self.state.output_ids

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The output bytes of each id (``b""`` for special tokens and EOS ids)."""
        return self.request.output_bytes(ids, self.tokenizer.token_bytes)

    def view(self, state: RequestState) -> RequestView:
        """The policy's request view at ``state``."""
        return self.request.view(state.output_ids)

    def greedy(self) -> bool:
        """Whether the selector is greedy (family greedy, or temperature 0)."""
        return self.request.greedy


@attrs.frozen
class StepRecord:
    """One lock-step step.

    Attributes:
        index: 0-based step number (``reset`` is step 0).
        action: The action (``{"op": "reset", "config": ...}`` for step 0).
        runtime: The adapter's result (``ApplyResult.to_json()``; for reset ``ok`` / the refusal).
        spec: The spec's result: ``{"status": "ok"}`` or ``{"status": "rejected", "code", "message", "rule", "guard"}``.
        observation: The observation summary after the step.
        verdict: The step's verdict.
    """

    index: int
    action: dict[str, Any]
    runtime: dict[str, Any]
    spec: dict[str, Any]
    observation: dict[str, Any] | None
    verdict: Verdict
    spec_state: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as JSON."""
        return {"index": self.index, "action": self.action, "runtime": self.runtime, "spec": self.spec,
                "observation": self.observation, "verdict": self.verdict.to_json(), "spec_state": self.spec_state}


def _refusal_json(exc: DecodeSpecError) -> dict[str, Any]:
    return {"status": "rejected", "code": exc.code, "message": exc.message, **{k: exc.details[k] for k in ("rule", "guard") if k in exc.details}}


def _spec_state_json(state: RequestState) -> dict[str, Any]:
    return {"phase": state.phase.value, "processed": state.processed, "output_ids": list(state.output_ids),
            "pending_ids": list(state.pending_ids), "pending_tag": state.pending_tag.value, "generation": state.generation,
            "rng_counter": state.rng_counter, "quarantined": state.quarantined,
            "finish_reason": None if state.finish_reason is None else state.finish_reason.value,
            "in_flight": None if state.in_flight is None else {"call_id": state.in_flight.call_id, "kind": state.in_flight.kind.value,
                                                                "start": state.in_flight.start, "length": state.in_flight.length}}


_STATE_FIELDS = ("phase", "output_ids", "logprobs", "frontier", "finish_reason", "triggers", "rng_counter", "generation",
                 "quarantined", "decision", "score_id", "text", "chunks", "cache_committed", "call")


@attrs.frozen(eq=False)
class ReferenceDecision:
    """The spec's decision on the reference row of one committed prefix (what a pair comparison judges a divergence by).

    Attributes:
        output_index: O of the decision.
        token: The spec policy's id on the reference row (before any adoption of the runtime's id).
        values: ``float64[V]`` the processed reference row (selector input; ``-inf`` outside the support).
        probs: ``float64[V]`` its processed probabilities.
        u: The decision's uniform (multinomial), else ``None``.
        greedy: Whether the selector is greedy (family greedy or temperature 0).
        policy: The request's policy.
        epsilon: The raw reference row's epsilon under the run's tolerance, or ``None``
            (then a judge uses the tolerance's absolute ``logit``).
    """

    output_index: int
    token: int
    values: np.ndarray
    probs: np.ndarray
    u: float | None
    greedy: bool
    policy: PolicyConfig
    epsilon: float | None = None


@attrs.frozen
class _SupportNote:
    """The gate's annotation of a decision record: whether its support is the runtime's own processed row, and the
    rounding slack (nats) of comparing its log-probabilities (see :meth:`LockStep._decide`)."""

    own_row: bool
    slack: float


class LockStep:
    """Drive ``adapter`` and the spec with the same actions and judge every step with the ladder.

    Args:
        adapter: The runtime's adapter.
        config: The case config (``reset`` admits it on both sides).
        runtime: Runtime name for the tolerance lookup (default ``adapter.name``).
        tolerance: Declared tolerance (default :func:`~decodespec.checks.gate.tolerance.tolerance_for`).
        layers: Ladder layers to check.
        machine: The spec machine (default the specification's).

    Attributes:
        config: The initial case config (a ``reuse`` action changes the spec side's, not this).
        records: One :class:`StepRecord` per step (``reset`` first).
        observations: The full observation after each record.
        observation: The latest observation.
        reference_decisions: ``prompt_ids + output_ids[:O] -> ReferenceDecision`` of every decision
            the spec made (keyed by the committed prefix it conditions on).
    """

    def __init__(self, adapter: Adapter, config: CaseConfig, *, runtime: str | None = None, tolerance: Tolerance | None = None,
                 layers: Sequence[str] = LAYERS, machine: Machine = MACHINE, reference: Reference | None = None):
        from ..adapters.impl import load_tokenizer

        self.adapter = adapter
        self.config = config
        self.runtime = runtime or adapter.name
        self.tolerance = tolerance or tolerance_for(self.runtime, config.model, config.dtype)
        self.layers = tuple(layers)
        self.reference = reference or reference_for(config.model)
        self.spec = SpecSide(config, self.reference, load_tokenizer(config.model), machine)
        self.records: list[StepRecord] = []
        #: The full observation after each record (arrays included), ``None`` where none was made.
        self.observations: list[Observation | None] = []
        self.observation: Observation | None = None
        self.resume_reference: Observation | None = None
        self.reference_decisions: dict[tuple[int, ...], ReferenceDecision] = {}
        #: Why the runtime refused the latest reset with ``adapter.unsupported`` (a config outside what it can run),
        #: else ``None``.  The reset's verdict stays the disagreement; callers make the run a skip with this reason
        #: (after a documented deviation that matches it), never a failure.
        self.unsupported: str | None = None
        self._snapshot_count = 0

    # -- public ----------------------------------------------------------------------------
    @property
    def verdict(self) -> Verdict:
        """The run's verdict: its first failed step, else its first undecided step, else passed."""
        for result in (FAILED, UNDECIDED):
            for record in self.records:
                if record.verdict.result == result:
                    return record.verdict
        return Verdict(PASSED)

    @property
    def failed(self) -> bool:
        """Whether some step failed."""
        return any(r.verdict.result == FAILED for r in self.records)

    def reset(self) -> StepRecord:
        """Admit the config on both sides (step 0)."""
        spec_error = runtime_error = None
        try:
            self.spec.admit(self.config)
        except DecodeSpecError as exc:
            spec_error = exc
        try:
            self.adapter.reset(self.config)
        except DecodeSpecError as exc:
            runtime_error = exc
        action = {"op": "reset", "config": self.config.to_json()}
        self.unsupported = None
        if runtime_error is not None and runtime_error.code == ADAPTER_UNSUPPORTED:
            self.unsupported = f"{self.runtime} refuses the config as unsupported (adapter.unsupported): {runtime_error.message}"
        runtime = {"status": "ok", "data": {}} if runtime_error is None else _refusal_json(runtime_error)
        spec = {"status": "ok"} if spec_error is None else _refusal_json(spec_error)
        verdict = self._agreement(spec, runtime)
        obs = None
        if runtime_error is None:
            obs = self.adapter.observe()
            self.observation = obs
            if verdict is None:
                verdict = compare(self._expected(obs, ()), obs, layers=self.layers)
        return self._record(action, runtime, spec, obs, verdict or Verdict(PASSED))

    def apply(self, action: Mapping[str, Any]) -> StepRecord:
        """Apply one contract action to both sides and judge it (see the module docstring)."""
        act = check_action(action)
        if act["op"] == "snapshot" and act["id"] is None:
            act["id"] = f"snapshot-{self._snapshot_count}"
        before = self.observation
        result = self.adapter.apply(act)
        obs = self.adapter.observe()
        self.observation = obs
        saved = self._save()
        checks: list[DecisionCheck] = []
        partial = False
        try:
            self._spec_apply(act, obs, result, checks)
            spec = {"status": "ok"}
        except DecodeSpecError as exc:
            # step / run are loops of controller actions: a refused one ends the loop and those before it stand.
            partial = act["op"] in ("step", "run") and self.spec.state is not saved[2].machine
            if not partial:
                self._restore(saved)
                checks = []
            spec = _refusal_json(exc)
        runtime = result.to_json()
        verdict = self._agreement(spec, runtime)
        if verdict is None and partial:
            verdict = compare(self._expected(obs, tuple(checks)), obs, layers=self.layers)
        elif verdict is None and not result.ok:
            verdict = self._unchanged(before, obs)
        if verdict is None and result.ok:
            if act["op"] == "snapshot":
                self._snapshot_count += 1
                handle = result.data.get("snapshot", act["id"])
                snap = self.spec.snapshots.pop(act["id"])
                self.spec.snapshots[handle] = attrs.evolve(snap, observation=obs)
            resume = None
            if act["op"] == "restore" and act["corrupt"] is None:
                resume = self.spec.snapshots[act["snapshot"]].observation
            # A decision inside the action that already failed happened before the final state:
            # report it first (it carries its own layer, TENSOR before DECISION).
            early = [c.verdict for c in checks if c.verdict.result == FAILED and c.verdict.layer in self.layers]
            verdict = early[0] if early else compare(self._expected(obs, tuple(checks), resume=resume), obs, layers=self.layers)
        return self._record(act, runtime, spec, obs, verdict or Verdict(PASSED))

    def finish_against(self, uninterrupted: Observation) -> Verdict:
        """RESUME: compare the current observation with an uninterrupted run's final observation."""
        assert self.observation is not None
        exp = Expected(tolerance=self.tolerance, resume=uninterrupted)
        verdict = compare(exp, self.observation, layers=("RESUME",))
        record = StepRecord(len(self.records), {"op": "compare_resume"}, {"status": "ok", "data": {}}, {"status": "ok"},
                            self.observation.summary(), verdict, _spec_state_json(self.spec.state))
        self.records.append(record)
        self.observations.append(self.observation)
        return verdict

    # -- internals -------------------------------------------------------------------------
    def _record(self, action: dict[str, Any], runtime: dict[str, Any], spec: dict[str, Any], obs: Observation | None,
                verdict: Verdict) -> StepRecord:
        index = len(self.records)
        record = StepRecord(index, action, runtime, spec, None if obs is None else obs.summary(),
                            attrs.evolve(verdict, step=index) if not verdict.passed else verdict, _spec_state_json(self.spec.state))
        self.records.append(record)
        self.observations.append(obs)
        return record

    def _agreement(self, spec: dict[str, Any], runtime: dict[str, Any]) -> Verdict | None:
        s_ok, r_ok = spec["status"] == "ok", runtime["status"] == "ok"
        if s_ok != r_ok:
            expected = "accepted" if s_ok else f"rejected ({spec.get('code')}: {spec.get('rule', '')} {spec.get('guard', '')})".rstrip()
            actual = "accepted" if r_ok else f"rejected ({runtime.get('code')}: {runtime.get('message', '')})"
            return Verdict(FAILED, "STATE", "ladder.STATE", "accept_reject", expected, actual,
                           f"the spec {'accepts' if s_ok else 'rejects'} the action, the runtime {'accepts' if r_ok else 'rejects'} it")
        if not s_ok and spec.get("code") != runtime.get("code"):
            return Verdict(FAILED, "STATE", "ladder.STATE", "refusal_code", spec.get("code"), runtime.get("code"),
                           f"both refuse the action, with different codes ({spec.get('message')} / {runtime.get('message')})")
        return None

    def _unchanged(self, before: Observation | None, after: Observation) -> Verdict | None:
        if before is None:
            return None
        for name in _STATE_FIELDS:
            a, b = getattr(before, name), getattr(after, name)
            if a != b:
                return Verdict(FAILED, "STATE", "ladder.STATE", "rejected_changed_nothing", {name: a}, {name: b},
                               f"a rejected action changed the observable {name}")
        return None

    def _save(self) -> tuple[CaseConfig, Request, ComposedState, dict[str, SpecSnapshot]]:
        s = self.spec
        return (s.config, s.request, s.composed, dict(s.snapshots))

    def _restore(self, saved: tuple[CaseConfig, Request, ComposedState, dict[str, SpecSnapshot]]) -> None:
        s = self.spec
        s.config, s.request, s.composed, s.snapshots = saved

    # -- the spec translation --------------------------------------------------------------
    def _step(self, action: Action) -> None:
        s = self.spec
        s.composed = rm.apply(s.request, s.composed, action, machine=s.machine)

    def _launch(self, kind: CallKind | None, length: int | None) -> None:
        s = self.spec
        s.composed = rm.launch(s.request, s.composed, kind, length, machine=s.machine)

    def _complete(self) -> None:
        s = self.spec
        s.composed = rm.complete(s.request, s.composed, machine=s.machine)

    def _decide(self, obs: Observation, checks: list[DecisionCheck], runtime_token: int | None) -> None:
        s = self.spec
        state = s.state
        index = state.output_count
        ref_raw = s.reference.row(s.sequence) if state.phase is Phase.SCORED and state.score is not None else ()
        choice = rm.choose(s.request, s.composed, ref_raw, machine=s.machine)  # refuses outside SCORED
        if choice is None:  # an empty legal support is the typed terminal finish constraint_error (M3.10 0x02 branch table)
            s.composed = rm.support_empty(s.request, s.composed, machine=s.machine)
            return
        view = s.view(state)
        ref_processed = choice.processed
        token = choice.token
        u = choice.u
        self.reference_decisions[tuple(s.sequence)] = ReferenceDecision(index, token, ref_processed.values, ref_processed.probs, u,
                                                                        s.greedy(), s.policy, self.tolerance.epsilon(ref_raw))
        cand_processed = None
        cand_token = None
        own_row = obs.score_row is not None and obs.score_output_count == index
        eps = self.tolerance.epsilon(ref_raw)
        if own_row:
            bad = score_row_failure(ref_raw, obs.score_row, eps,
                                    where=f"output {index}: the runtime decided on a score row away from the reference row of the same prefix: ")
            if bad is not None:
                checks.append(DecisionCheck(index, bad))
            cand_row = ScoreRow.create(obs.score_row, row_id=choice.score_id)
            try:
                cand_processed = processed_row(cand_row, s.policy, s.composed.policy_state, view)
                cand_token = decide(cand_row, s.policy, s.composed.policy_state, view)[0].selected_id
            except DecodeSpecError:
                cand_processed = cand_token = None
        adopted = None
        if runtime_token is not None and runtime_token != token:
            verdict = judge_decision(policy=s.policy, ref_values=ref_processed.values, ref_token=token, runtime_token=runtime_token,
                                     tolerance=self.tolerance, greedy=s.greedy(), cand_token=cand_token,
                                     ref_probs=ref_processed.probs, u=u, output_index=index, epsilon=eps,
                                     cand_values=None if cand_processed is None else cand_processed.values,
                                     cand_within_tolerance=own_row and bad is None)
            checks.append(DecisionCheck(index, verdict))
            if verdict.result == UNDECIDED:
                adopted = runtime_token
        # The runtime processed its own row in its dtype: a processed score of magnitude M carries
        # rounding of M * 2^-mantissa (a logit bias of 1e4 in float32: ~1e-3), which moves each
        # log-probability by at most twice that, beyond the raw-row tolerance, and each probability
        # p by at most p (e^slack - 1) (found by the machines: two ids biased by 1e4 on tiny, their
        # probabilities 1.7e-4 apart against a declared 1.5e-4; tests/test_calibration.py).  M is the largest
        # magnitude of any stage, not only the last: a bias of 1e4 rounds there even when a later
        # truncation (epsilon, eta) renormalises to log-probabilities near 0 (found by the machines:
        # logit_bias 1e4, then epsilon and eta, 4e-4 nats apart on tiny).
        slack = 0.0
        if cand_processed is not None:
            finite = cand_processed.values[np.isfinite(cand_processed.values)]
            raw = np.asarray(obs.score_row, dtype=np.float64)
            raw = raw[np.isfinite(raw)]
            biases = [abs(float(b)) for t in s.policy.transforms if t.name == "logit_bias" for _, b in t.get("bias")]
            magnitude = max(float(np.max(np.abs(finite))) if finite.size else 0.0,
                            (float(np.max(np.abs(raw))) if raw.size else 0.0) + sum(biases))
            slack = 4.0 * _UNIT_ROUNDOFF.get(s.config.dtype, 2.0 ** -8) * magnitude
        # The record keeps the support of the runtime's own processed row when it exposed one (else the reference's),
        # annotated with whether it did and the rounding slack of comparing its log-probabilities.
        s.composed = rm.decide(s.request, s.composed, choice, token=adopted, support=cand_processed,
                               annotation=_SupportNote(cand_processed is not None, slack), machine=s.machine)

    def _commit(self, receipt: str | None, obs: Observation) -> None:
        s = self.spec
        s.composed = rm.commit(s.request, s.composed, receipt, token_bytes=s.tokenizer.token_bytes, machine=s.machine)

    def _controller(self, obs: Observation, checks: list[DecisionCheck], *, until_commit: bool) -> None:
        s = self.spec
        moved = False
        while True:
            action = rm.next_action(s.request, s.composed)
            if action == "complete":
                self._complete()
            elif action == "recover":
                self._step(Recover())
            elif action == "decide":
                index = s.state.output_count
                self._decide(obs, checks, obs.output_ids[index] if index < len(obs.output_ids) else None)
            elif action == "commit":
                self._commit(None, obs)
                moved = True
                if until_commit:
                    return
                continue
            elif action == "launch":
                self._launch(None, None)
            else:
                break
            moved = True
        if not moved:
            raise no_controller_action(s.state.phase.value)

    def _spec_apply(self, act: dict[str, Any], obs: Observation, result: ApplyResult, checks: list[DecisionCheck]) -> None:
        s = self.spec
        op = act["op"]
        if op in ("prefill", "decode", "repair"):
            kind = CallKind(op)
            self._launch(kind, act["chunk"] if op == "prefill" else None)
            self._complete()
        elif op == "launch":
            self._launch(None if act["kind"] is None else CallKind(act["kind"]), act["length"])
        elif op == "complete":
            self._complete()
        elif op == "decide":
            token = result.data.get("token_id") if result.ok else None
            self._decide(obs, checks, token if token is None else int(token))
        elif op == "commit":
            self._commit(act["receipt"], obs)
        elif op == "step":
            self._controller(obs, checks, until_commit=True)
        elif op == "run":
            self._controller(obs, checks, until_commit=False)
        elif op == "cancel":
            self._step(Cancel(FinishReason(act["kind"])))
        elif op == "stream_fail":
            self._step(StreamFailure())
        elif op == "fault":  # a rank that dies or stalls is a participant missing from the roster: a device fault
            self._step(Fault("device_fault" if act["kind"] in RANK_FAULTS else act["kind"]))
        elif op == "recover":
            self._step(Recover())
        elif op == "snapshot":
            s.composed, entry = rm.snapshot(s.request, s.composed, act["form"], machine=s.machine)
            s.snapshots[act["id"]] = SpecSnapshot(entry, None)
        elif op == "restore":
            self._restore_snapshot(act["snapshot"], act["corrupt"])
        elif op == "reuse":
            changes: dict[str, Any] = {"prompt_ids": tuple(act["prompt_ids"])}
            if act["max_new_tokens"] is not None:
                changes["max_new_tokens"] = act["max_new_tokens"]
            s.admit(s.config.evolve(**changes))
        else:  # pragma: no cover - check_action knows every op
            raise AssertionError(op)

    def _restore_snapshot(self, handle: str, corrupt: str | None) -> None:
        s = self.spec
        snap = s.snapshots.get(handle)
        if snap is None:
            raise Rejection("adapter.invalid_action", f"no snapshot named {handle!r}", "$.snapshot")
        record = None if corrupt is None else corrupt_record(snap.entry.record, corrupt)
        s.composed = rm.restore(s.request, snap.entry, record, machine=s.machine)

    # -- the expected projection -----------------------------------------------------------
    def _expected(self, obs: Observation, checks: tuple[DecisionCheck, ...], *, resume: Observation | None = None) -> Expected:
        s = self.spec
        state = s.state
        params = s.params
        seq = s.sequence
        score_row = None
        if obs.score_row is not None and obs.score_output_count is not None and obs.score_output_count <= state.output_count:
            score_row = s.reference.row(s.config.prompt_ids + state.output_ids[:obs.score_output_count])
        cache_probe = None
        if obs.cache_probe is not None and params.cached and 0 < state.processed <= len(seq):
            cache_probe = s.reference.kv(seq[:state.processed])
        call = None
        last = s.composed.call
        if last is not None:
            call = {"call_id": last.call_id, "kind": last.kind.value, "start": last.start, "length": last.length,
                    "position_ids": last.positions, "cache_position": last.positions,
                    "in_flight": state.in_flight is not None and state.in_flight.call_id == last.call_id}
        decision = s.composed.decision
        note = None if decision is None else decision.annotation
        out = rm.output_view(s.request, s.composed, s.tokenizer.token_bytes)
        vocab = reference_vocab(s.config.model)
        return Expected(
            tolerance=self.tolerance,
            vocab_hash=vocab.vocab_hash,
            vocab_rows=vocab.output_rows,
            phase=state.phase.value,
            output_ids=state.output_ids,
            frontier={"prompt_len": params.prompt_len, "output_count": state.output_count, "pending": len(state.pending_ids),
                      "processed": state.processed, "pending_tag": state.pending_tag.value},
            rng_counter=state.rng_counter,
            generation=state.generation,
            quarantined=state.quarantined,
            cache_committed=state.processed if params.cached else 0,
            call=call,
            score_row=score_row,
            cache_probe=cache_probe,
            support_ids=None if decision is None else decision.support_ids,
            support_probs=None if decision is None else decision.support_probs,
            # A log-probability off by at most L moves a probability p by at most p (e^L - 1) <= e^L - 1
            # (capped where that passes 1, which bounds nothing: a slack of 1e30 nats would overflow).
            support_prob_tolerance=self.tolerance.prob + math.expm1(min(note.slack, 1.0)) if note is not None and note.own_row else None,
            support_log_tolerance=self.tolerance.logprob + note.slack if note is not None and note.own_row else None,
            draws=None if decision is None else decision.draws,
            decision_checks=checks,
            decision_token=None if decision is None else decision.token,
            decision_logprob=None if decision is None else decision.logprob,
            logprobs=s.composed.logprobs,
            finish_reason=None if state.finish_reason is None else state.finish_reason.value,
            triggers=tuple(r.value for r in FINISH_PRECEDENCE if r in state.triggers),
            text=out.text,
            chunks=None if out.chunks is None else tuple(c.to_json() for c in out.chunks),
            returned_ids=out.returned_ids,
            returned_logprobs=out.returned_logprobs,
            resume=resume,
        )
