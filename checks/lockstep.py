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
4. the ladder (:func:`decodespec.checks.ladder.compare`) judges the observation against the
   spec state's projection and the references.

A decision where the runtime picked another id than the spec is judged when it is made
(:func:`judge_decision`): failed when the margin rules it out, ``undecided`` when the
tolerance cannot (then the spec adopts the runtime's id -- any id within the tolerance is a
legal spec behaviour -- so the lock step goes on).

Declared choices of the spec side (the contract's, mirrored by our runtime): ``min_new_tokens``
is enforced by the policy's ``min_new_tokens`` legality transform (added when the policy lacks
it); the static capacity and the context cap are the spec's (:mod:`decodespec.spec.request`: S
defaults to ``L + G + 1`` capped by the model window; C is the least of the model window,
``context_cap`` and the capacity); the schedule of calls is :func:`decodespec.spec.state.due_call`;
admission refuses G = 0
under ``reject``, a prompt id outside the vocabulary, ``L >= window`` and a static capacity
that cannot hold the prompt (``L + 1`` slots when G >= 1).

Source: M3.10 "A logit tolerance is not a token-equality proof", "Correctness matrix",
"Boundary cases" (adversarial transitions); research/formal-anchors-survey.md 0 and 7
(quint-connect style lock step; comparison in the harness); docs/design.md section 11.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from decodespec.spec.actions import TEXT_TRIGGERS, Action, Admit, Cancel, Commit, Decide, Fault, Launch, Recover, Restore, Snapshot, StreamFailure, SupportEmpty
from decodespec.spec.enums import EXTERNAL_FINISH_REASONS, FINISH_PRECEDENCE, CallKind, FinishReason
from decodespec.spec.envelope import ZERO_NEW_TOKENS_REJECTED
from decodespec.spec.errors import DecodeSpecError, Rejection, ResourceLimit
from decodespec.spec.policy import PolicyConfig, PolicyState, RequestView, ScoreRow, child_state, decide, policy_config_from_json, processed_row
from decodespec.spec.policy.codes import TERMINAL_DECISION_CODES
from decodespec.spec.policy.config import Family
from decodespec.spec.policy.rng import rng_key, uniform
from decodespec.spec.policy.scores import log_softmax
from decodespec.spec.positions import CACHE_CAPACITY_EXCEEDED
from decodespec.spec.request import context_cap, prompt_room
from decodespec.spec.request import static_capacity as request_static_capacity
from decodespec.spec.snapshot import REPAIRED, SnapshotRecord, take_snapshot
from decodespec.spec.state import Phase, RequestParams, RequestState, due_call, initial_state, repair_outstanding
from decodespec.spec.stop import StopConfig, align_output, reference_stream, step_triggers
from decodespec.spec.transitions import MACHINE, NOT_ENABLED, Machine, expected_report, expected_start

from .adapters import ADAPTER_UNSUPPORTED, RANK_FAULTS, Adapter, ApplyResult, CaseConfig, Observation, check_action, corrupt_record, no_controller_action
from .ladder import (
    FAILED,
    LAYERS,
    PASSED,
    UNDECIDED,
    DecisionCheck,
    Expected,
    Tolerance,
    Verdict,
    compare,
    decision_probe,
    describe_probe,
    score_row_failure,
    tolerance_for,
)
from .reference import Reference64, load_gguf64
from .reference.files import gguf_path
from .vocab_check import reference_vocab

__all__ = [
    "LockStep",
    "Reference",
    "ReferenceDecision",
    "SpecSide",
    "StepRecord",
    "admission_refusal",
    "judge_decision",
    "params_for",
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

#: The reference the lock step reads score rows and K/V rows from (see :mod:`decodespec.checks.reference`).
Reference = Reference64

_REFERENCES: dict[str, Reference64] = {}


def reference_for(model: str) -> Reference64:
    """The shared float64 :class:`~decodespec.checks.reference.Reference64` of ``model``, built once per process.

    It reads the model's GGUF file itself (:func:`decodespec.checks.reference.files.gguf_path`;
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


def params_for(config: CaseConfig, vocab_size: int, window: int) -> RequestParams:
    """The spec's :class:`RequestParams` of ``config`` (see the module docstring for the declared defaults)."""
    capacity = static_capacity(config, window)
    family = config.policy.get("family")
    return RequestParams(
        identity=config.identity(),
        prompt_len=config.prompt_len,
        max_new_tokens=config.max_new_tokens,
        vocab_size=vocab_size,
        eos_ids=frozenset(config.eos_ids),
        min_new_tokens=config.min_new_tokens,
        cache_family=config.cache,
        context_cap=context_cap(window, config.context_cap, capacity),
        static_capacity=capacity,
        zero_new_tokens=config.zero_new_tokens,
        final_cache=config.final_cache,
        prefill_chunk=None if config.cache == "none" else config.prefill_chunk,
        max_retries=config.max_retries,
        max_draws=1 if family == "multinomial" else 0,
        stream=config.stream,
        stop_strings=bool(config.stop_strings),
        structured=config.structured != "none",
    )


def policy_for(config: CaseConfig) -> PolicyConfig:
    """The M3.8 policy the spec side decides with: the config's, plus ``min_new_tokens`` when needed.

    Raises:
        Rejection: ``policy.*`` for a policy object the schema refuses.
    """
    policy = policy_config_from_json(config.policy)
    if config.min_new_tokens > 0 and policy.find("min_new_tokens") is None:
        obj = policy.to_json()
        policy = policy_config_from_json({**obj, "transforms": [{"name": "min_new_tokens"}] + obj["transforms"]})
    return policy


def admission_refusal(config: CaseConfig, vocab_size: int, window: int) -> DecodeSpecError | None:
    """The typed refusal of admitting ``config``, or ``None`` (see the module docstring).

    Source: M3.10 "The first-output off-by-one" (G = 0 reject), "Immutable request envelope"
    (ids inside the vocabulary), 0x09 (static capacity).
    """
    try:
        policy_for(config)
    except DecodeSpecError as exc:
        return exc
    if config.max_new_tokens == 0 and config.zero_new_tokens == "reject":
        return Rejection(ZERO_NEW_TOKENS_REJECTED, "max_new_tokens is 0 and the declared G=0 branch is 'reject'", "$.max_new_tokens")
    if any(t >= vocab_size for t in config.prompt_ids):
        return Rejection(_RUNTIME_INVALID_REQUEST, f"a prompt id is outside [0, {vocab_size})", "$.prompt_ids")
    if config.prompt_len >= window:
        return ResourceLimit(_CONTEXT_WINDOW_EXCEEDED, f"prompt length {config.prompt_len} leaves no room in the window {window}", "$.prompt_ids")
    capacity = static_capacity(config, window)
    if capacity is not None and capacity < prompt_room(config.prompt_len, config.max_new_tokens):
        return ResourceLimit(CACHE_CAPACITY_EXCEEDED, f"static capacity {capacity} cannot hold the prompt", "$.static_capacity")
    return None


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
        epsilon: The row's epsilon (:meth:`~decodespec.checks.ladder.Tolerance.epsilon` of the raw
            reference row; default ``tolerance.logit``).
        cand_values: The spec policy's processed row of the runtime's own raw row, when it exposed
            one (named in the message and the probe beside the reference's).

    Returns:
        ``passed`` when the ids agree; ``failed`` (DECISION) when the runtime's id is not the
        policy's on its own row, or the reference margin rules it out; ``undecided`` when a row
        within epsilon of the reference could select it (greedy: the runtime's processed score
        is within 2 epsilon of the maximum; sampled: the uniform lies within ``2 epsilon / T``
        of the runtime id's CDF interval, T the temperature).  A non-passing verdict names both
        ids with their processed scores on the reference row (and on the runtime's row when
        given) in its message and its probe (:func:`~decodespec.checks.ladder.decision_probe`).

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
    if not 0 <= runtime_token < ref_values.shape[0] or not math.isfinite(float(ref_values[runtime_token])):
        return verdict(FAILED, "decision.support", ref_token, f"{where}: the runtime selected {runtime_token}, outside the processed support")
    if greedy:
        gap = float(ref_values[ref_token] - ref_values[runtime_token])
        if gap <= 2 * eps:
            return verdict(UNDECIDED, "decision.margin", ref_token,
                           f"{where}: reference margin {gap:.3g} <= 2 epsilon = {2 * eps:.3g}; the tolerance cannot decide between "
                           f"{ref_token} and {runtime_token}")
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
    return verdict(FAILED, "decision.draw", ref_token,
                   f"{where}: the replayed draw selects {ref_token} (uniform {u:.6g} is {distance:.3g} > {delta:.3g} from {runtime_token}'s "
                   f"interval [{low:.6g}, {high:.6g}))")


# --------------------------------------------------------------------------------------------
# The spec side.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class SpecSnapshot:
    """What the spec side keeps per snapshot handle."""

    record: SnapshotRecord
    policy_state: PolicyState
    logprobs: tuple[float, ...]
    last_call: dict[str, Any] | None
    last_decision: tuple[int, float, int, Any] | None
    observation: Observation | None


class SpecSide:
    """The spec state of one request plus what the spec needs to act (policy, stop reference, ledgers).

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
        self._install(config)

    def _install(self, config: CaseConfig) -> None:
        self.config = config
        self.params = params_for(config, self.reference.vocab_size, self.reference.window)
        self.policy = policy_for(config)
        self.state = initial_state(self.params)
        self.policy_state = PolicyState(rng_counter=0, constraint_state=self._initial_constraint(), mirostat_mu=self._initial_mu())
        self.pending_policy_state: PolicyState | None = None
        self.logprobs: list[float] = []
        self.pending_logprob: float | None = None
        self.last_call: dict[str, Any] | None = None
        #: The latest decision: (token, reference logprob, draws, processed row (ids, probs) or None).
        self.last_decision: tuple[int, float, int, Any] | None = None
        #: The latest committed decision (what the latest decision falls back to when a pending one is discarded).
        self.committed_decision: tuple[int, float, int, Any] | None = None
        self.stop = StopConfig(max_new_tokens=config.max_new_tokens, eos_ids=frozenset(config.eos_ids),
                               min_new_tokens=config.min_new_tokens, prompt_len=config.prompt_len,
                               max_context_len=self.params.context_cap, stop_strings=config.stop_strings,
                               include_stop_str=config.include_stop_str, alignment=config.alignment,
                               json_completion=config.structured == "json")

    def _initial_constraint(self):
        from decodespec.spec.policy import initial_policy_state

        return initial_policy_state(self.policy).constraint_state

    def _initial_mu(self):
        from decodespec.spec.policy import initial_policy_state

        return initial_policy_state(self.policy).mirostat_mu

    # -- helpers ---------------------------------------------------------------------------
    def admit(self, config: CaseConfig) -> None:
        """Admission of ``config`` (replaces the request; snapshots are kept).

        Raises:
            Rejection / ResourceLimit: :func:`admission_refusal`; nothing changes.
        """
        refusal = admission_refusal(config, self.reference.vocab_size, self.reference.window)
        if refusal is not None:
            raise refusal
        old = (self.config, self.params, self.policy, self.state)
        try:
            self._install(config)
            self.state = self.machine.step(self.params, self.state, Admit())
        except DecodeSpecError:
            self.config, self.params, self.policy, self.state = old
            raise

    @property
    def sequence(self) -> tuple[int, ...]:
        """``prompt_ids + output_ids``."""
        return self.config.prompt_ids + self.state.output_ids

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The output bytes of each id (``b""`` for special tokens)."""
        # Declared choice (docs/design.md section 2): EOS ids never contribute text, like special tokens.
        special = frozenset(getattr(self.tokenizer, "special_ids", ())) | frozenset(self.config.eos_ids)
        return [b"" if t in special else self.tokenizer.token_bytes(t) for t in ids]

    def view(self, state: RequestState) -> RequestView:
        """The policy's request view at ``state``."""
        c = self.config
        return RequestView(prompt_ids=c.prompt_ids, output_ids=state.output_ids, eos_ids=sorted(c.eos_ids),
                           min_new_tokens=c.min_new_tokens, identity=self.params.identity, seed=c.seed)

    def greedy(self) -> bool:
        """Whether the selector is greedy (family greedy, or temperature 0)."""
        t = self.policy.find("temperature")
        return self.policy.family is Family.GREEDY or (t is not None and t.get("temperature") == 0.0)


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


class LockStep:
    """Drive ``adapter`` and the spec with the same actions and judge every step with the ladder.

    Args:
        adapter: The runtime's adapter.
        config: The case config (``reset`` admits it on both sides).
        runtime: Runtime name for the tolerance lookup (default ``adapter.name``).
        tolerance: Declared tolerance (default :func:`~decodespec.checks.ladder.tolerance_for`).
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
        from .adapters.impl import load_tokenizer

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
            partial = act["op"] in ("step", "run") and self.spec.state is not saved[3]
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

    def _save(self) -> tuple:
        s = self.spec
        return (s.config, s.params, s.policy, s.state, s.policy_state, s.pending_policy_state, list(s.logprobs), s.pending_logprob,
                s.last_call, s.last_decision, s.committed_decision, s.stop, dict(s.snapshots))

    def _restore(self, saved: tuple) -> None:
        s = self.spec
        (s.config, s.params, s.policy, s.state, s.policy_state, s.pending_policy_state, s.logprobs, s.pending_logprob,
         s.last_call, s.last_decision, s.committed_decision, s.stop, s.snapshots) = saved

    # -- the spec translation --------------------------------------------------------------
    def _step(self, action: Action) -> None:
        s = self.spec
        s.state = s.machine.step(s.params, s.state, action)

    def _launch(self, kind: CallKind | None, length: int | None) -> None:
        s = self.spec
        due = due_call(s.params, s.state)
        if kind is None:
            if due is None:
                raise Rejection(NOT_ENABLED, f"no call is due in phase {s.state.phase.value}", "$.action",
                                details={"rule": "controller", "guard": "a call is due"})
            kind = due[0]
        start = expected_start(s.params, s.state)
        if length is None:
            length = due[2] if due is not None and due[0] is kind else (1 if s.params.cached else s.params.prompt_len + s.state.output_count)
        self._step(Launch(kind, start, length))
        call = s.state.in_flight
        assert call is not None
        positions = list(range(call.start, call.end))
        s.last_call = {"call_id": call.call_id, "kind": call.kind.value, "start": call.start, "length": call.length,
                       "position_ids": positions, "cache_position": positions}

    def _complete(self) -> None:
        s = self.spec
        self._step(expected_report(s.params, s.state))

    def _decide(self, obs: Observation, checks: list[DecisionCheck], runtime_token: int | None) -> None:
        s = self.spec
        state = s.state
        if state.phase is not Phase.SCORED or state.score is None:
            self._step(Decide(score_id="", token_id=0, draws=0))  # raises the spec's own refusal
        score = state.score
        assert score is not None
        index = state.output_count
        view = s.view(state)
        ref_raw = s.reference.row(s.sequence)
        ref_row = ScoreRow.create(ref_raw, row_id=score.score_id)
        try:
            receipt, after = decide(ref_row, s.policy, s.policy_state, view)
        except DecodeSpecError as exc:
            if exc.code not in TERMINAL_DECISION_CODES:
                raise
            # An empty legal support is the typed terminal finish constraint_error (M3.10 0x02 branch table).
            self._step(SupportEmpty(score.score_id))
            return
        ref_processed = processed_row(ref_row, s.policy, s.policy_state, view)
        token, draws = receipt.selected_id, receipt.draws
        u = None if s.greedy() else uniform(rng_key(s.params.identity, s.config.seed), view.step, 0)
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
            cand_row = ScoreRow.create(obs.score_row, row_id=score.score_id)
            try:
                cand_processed = processed_row(cand_row, s.policy, s.policy_state, view)
                cand_token = decide(cand_row, s.policy, s.policy_state, view)[0].selected_id
            except DecodeSpecError:
                cand_processed = cand_token = None
        if runtime_token is not None and runtime_token != token:
            verdict = judge_decision(policy=s.policy, ref_values=ref_processed.values, ref_token=token, runtime_token=runtime_token,
                                     tolerance=self.tolerance, greedy=s.greedy(), cand_token=cand_token,
                                     ref_probs=ref_processed.probs, u=u, output_index=index, epsilon=eps,
                                     cand_values=None if cand_processed is None else cand_processed.values)
            checks.append(DecisionCheck(index, verdict))
            if verdict.result == UNDECIDED:
                token = runtime_token
                after = child_state(s.policy, s.policy_state, token, draws=draws)
        self._step(Decide(score.score_id, token, draws))
        probe = cand_processed if cand_processed is not None else ref_processed
        support = probe.support
        s.pending_policy_state = after
        s.pending_logprob = float(log_softmax(np.asarray(ref_raw, dtype=np.float64))[token])
        # The runtime processed its own row in its dtype: a processed score of magnitude M carries
        # rounding of M * 2^-mantissa (a logit bias of 1e4 in float32: ~1e-3), which moves each
        # log-probability by at most twice that, beyond the raw-row tolerance.  M is the largest
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
        s.last_decision = (token, s.pending_logprob, draws, (support, probe.probs[support], cand_processed is not None, slack))

    def _commit(self, receipt: str | None, obs: Observation) -> None:
        s = self.spec
        state = s.state
        pending = state.receipt
        receipt_id = receipt if receipt is not None else (pending.receipt_id if pending is not None else "")
        text: frozenset[FinishReason] = frozenset()
        if pending is not None and receipt_id == pending.receipt_id and (s.params.stop_strings or s.params.structured):
            ids = state.output_ids + (pending.token_id,)
            fired, _, _ = step_triggers(s.stop, ids, s.token_bytes(ids))
            text = frozenset(fired) & TEXT_TRIGGERS
        self._step(Commit(receipt_id, text))
        assert s.pending_policy_state is not None and s.pending_logprob is not None
        s.policy_state = s.pending_policy_state
        s.logprobs.append(s.pending_logprob)
        s.pending_policy_state = None
        s.pending_logprob = None
        s.committed_decision = s.last_decision

    def _controller(self, obs: Observation, checks: list[DecisionCheck], *, until_commit: bool) -> None:
        s = self.spec
        moved = False
        while True:
            state = s.state
            if state.in_flight is not None:
                self._complete()
            elif state.quarantined and (state.phase is Phase.READY or repair_outstanding(s.params, state)):
                self._step(Recover())
            elif state.phase is Phase.SCORED:
                index = state.output_count
                self._decide(obs, checks, obs.output_ids[index] if index < len(obs.output_ids) else None)
            elif state.phase is Phase.DECIDED:
                self._commit(None, obs)
                moved = True
                if until_commit:
                    return
                continue
            elif due_call(s.params, state) is not None:
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
            self._discard_decision()
        elif op == "stream_fail":
            self._step(StreamFailure())
            self._discard_decision()
        elif op == "fault":  # a rank that dies or stalls is a participant missing from the roster: a device fault
            self._step(Fault("device_fault" if act["kind"] in RANK_FAULTS else act["kind"]))
        elif op == "recover":
            self._step(Recover())
        elif op == "snapshot":
            self._snapshot(act["form"], act["id"])
        elif op == "restore":
            self._restore_snapshot(act["snapshot"], act["corrupt"])
        elif op == "reuse":
            changes: dict[str, Any] = {"prompt_ids": tuple(act["prompt_ids"])}
            if act["max_new_tokens"] is not None:
                changes["max_new_tokens"] = act["max_new_tokens"]
            s.admit(s.config.evolve(**changes))
        else:  # pragma: no cover - check_action knows every op
            raise AssertionError(op)

    def _discard_decision(self) -> None:
        """An interrupt after the decision discards the pending receipt: the latest decision is the last committed one again."""
        s = self.spec
        if s.state.receipt is None and s.pending_logprob is not None:
            s.pending_policy_state = None
            s.pending_logprob = None
            s.last_decision = s.committed_decision

    def _snapshot(self, form: str, handle: str) -> None:
        """``Snapshot``; a ``repaired`` snapshot with a pending token first runs the valid append call.

        The append call (decode between calls, repair after finish) runs only where the runtime
        would run it -- no call in flight, no quarantine; every refusal is then the spec's own
        ``transition.snapshot`` guard (``snapshot.form_unavailable``).
        """
        s = self.spec
        state = s.state
        if form == REPAIRED and state.pending_ids and state.in_flight is None and not state.quarantined:
            if state.phase is Phase.READY:
                self._launch(CallKind.DECODE, None)
                self._complete()
            elif repair_outstanding(s.params, state):
                self._launch(CallKind.REPAIR, None)
                self._complete()
        self._step(Snapshot(form))
        record = take_snapshot(s.params, s.state, form)
        s.snapshots[handle] = SpecSnapshot(record, s.policy_state, tuple(s.logprobs), s.last_call, s.last_decision, None)

    def _restore_snapshot(self, handle: str, corrupt: str | None) -> None:
        s = self.spec
        snap = s.snapshots.get(handle)
        if snap is None:
            raise Rejection("adapter.invalid_action", f"no snapshot named {handle!r}", "$.snapshot")
        record = snap.record if corrupt is None else corrupt_record(snap.record, corrupt)
        state = s.machine.step(s.params, initial_state(s.params), Restore(record))
        s.state = state
        s.policy_state = snap.policy_state
        s.pending_policy_state = None
        s.pending_logprob = None
        s.logprobs = list(snap.logprobs)
        s.last_call = snap.last_call
        s.last_decision = s.committed_decision = snap.last_decision

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
        if s.last_call is not None:
            call = {**s.last_call, "in_flight": state.in_flight is not None and state.in_flight.call_id == s.last_call["call_id"]}
        decision = s.last_decision
        text, chunks, returned = self._text(state)
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
            support_ids=None if decision is None else decision[3][0],
            support_probs=None if decision is None else decision[3][1],
            support_log_tolerance=self.tolerance.logprob + decision[3][3] if decision is not None and decision[3][2] else None,
            draws=None if decision is None else decision[2],
            decision_checks=checks,
            decision_token=None if decision is None else decision[0],
            decision_logprob=None if decision is None else decision[1],
            logprobs=tuple(s.logprobs),
            finish_reason=None if state.finish_reason is None else state.finish_reason.value,
            triggers=tuple(r.value for r in FINISH_PRECEDENCE if r in state.triggers),
            text=text,
            chunks=chunks,
            returned_ids=returned,
            returned_logprobs=None if returned is None else tuple(s.logprobs[:len(returned)]),
            resume=resume,
        )

    def _text(self, state: RequestState) -> tuple[str, tuple[dict[str, Any], ...] | None, tuple[int, ...] | None]:
        """The spec's returned text, delivered chunks and, once finished, returned ids (:mod:`decodespec.spec.stop` reference)."""
        s = self.spec
        ids = list(state.output_ids)
        stream = s.config.stream
        if not ids:
            return "", (() if stream else None), (() if state.phase is Phase.FINISHED else None)
        tb = s.token_bytes(ids)
        flush = None
        returned = None
        if state.phase is not Phase.FINISHED:
            text = b"".join(tb).decode("utf-8", errors="replace")
        elif state.triggers - EXTERNAL_FINISH_REASONS:  # a commit closed the output
            fired, match, structured_end = step_triggers(s.stop, ids, tb)
            aligned = align_output(s.stop, ids, tb, None, fired, match, structured_end)
            text, returned = aligned.text, aligned.output_ids
        else:  # closed from outside: everything committed is text; the stream flushes except after stream_error
            aligned = align_output(s.stop, ids, tb, None, frozenset(state.triggers))
            text, returned = aligned.text, aligned.output_ids
            flush = None if state.finish_reason is FinishReason.STREAM_ERROR else state.finish_reason
        chunks = reference_stream(s.stop, ids, tb, external=flush).chunks if stream else None
        return text, None if chunks is None else tuple(c.to_json() for c in chunks), returned
