"""Hypothesis stateful machines: the spec and a runtime adapter in lock step under adversarial interleavings.

:func:`machine_for` builds a :class:`~hypothesis.stateful.RuleBasedStateMachine` for one
(runtime, model, cache family); :func:`run_machine` runs it with the active settings profile
(:func:`machine_settings`).  Every rule applies one contract action
(:mod:`decodespec.checks.adapters`) to both sides through :class:`~decodespec.checks.gate.lockstep.LockStep`,
which requires them to agree on accept / reject and judges the observation with the ladder
(STATE, TENSOR on the latest score row and the committed K/V rows, POLICY, DECISION,
SEQUENCE, RESUME after a restore).  A failed verdict fails the rule at once (Hypothesis then
shrinks and prints the failing program); the spec's own invariants
(:func:`decodespec.spec.invariants.violated`) are checked after every step.

Rules (preconditions read the spec state through the spec's ``enabled`` / the controller's due
call, so a rule is drawn only where its action is meaningful; ``wild`` draws any simple op in
any state, so refusals are exercised too):

* the controller: ``prefill`` (a chunk or the rest), ``decode``, ``launch`` / ``complete`` (an
  in-flight window), ``decide``, ``commit``, ``step``, ``run``, ``repair``, ``recover``;
* the environment: ``cancel`` / timeout before launch, in flight, after completion and after
  the decision; ``fault`` (device fault or missing state lane) in flight; ``rank_fault`` (one rank
  process of a tensor-parallel call killed or stalled mid-call, runtimes declaring ``rank_faults``); a duplicated or stale
  receipt (``commit_receipt``); a streamer failure; static-cache reuse by a shorter request
  (``reuse``); snapshots of both forms at any step and ``restore`` (a pending-suffix snapshot
  restores a pending token ahead of the cache frontier), also of deliberately corrupted
  records that must be refused;
* ``stutter``: re-observe and compare (always enabled, so a terminal state never raises
  ``InvalidDefinition``).

A failure that the runtime's expectations file documents (``checks/gate/expectations/<runtime>.toml``,
matched as case ``machine.<cache>``) is printed as an expected deviation and ends the lock step
of that example (the two sides no longer describe the same request); it is never skipped
silently.

A failing run writes its shrunk counterexample as a ``decodespec.trace`` ITF file
(:mod:`decodespec.checks.modelcheck.traces`) into ``$DECODESPEC_TRACE_DIR`` (default ``traces/failures/``)
when Hypothesis replays the final, minimal example.

:class:`BeamMachine` is the beam case: scripted log-probability rows drive the spec's beam search
(:mod:`decodespec.spec.beam`) and the runtime's joint top-K (``impl/beam.py``
``top_flat_candidates``) in lock step; a ``force`` draw shapes the rows so that one parent
owns two of the kept candidates (a duplicated parent) while another parent's EOS candidate
completes in the same step.  The spec's beam invariants (``check_step``) hold after every step
and the runtime's kept ids and parents equal the spec's (ladder DECISION).

Source: M3.10 "Boundary cases" (adversarial state transitions); /work/shared/DESIGN.md
("Adversarial environment actions the machines must generate"); research/formal-anchors-survey.md
2 (API, profiles, stutter rule, ``is_final`` export).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import hypothesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from decodespec.spec.actions import Fault, Recover, StreamFailure
from decodespec.spec.enums import CallKind
from decodespec.spec.invariants import violated
from decodespec.spec.policy.config import EarlyStopping
from decodespec.spec.state import Phase, due_call, interrupt_point, repair_outstanding

from ..adapters import CORRUPTIONS, Adapter
from ..modelcheck.traces import make_trace, open_runtime, write_trace
from .cases import load_expectations
from .ladder import FAILED, PASSED, Expected, Verdict, compare
from .lockstep import LockStep
from .prompts import PROMPT_TEXTS, prompts_for
from .tolerance import Tolerance

__all__ = ["SAMPLED_POLICY", "BeamMachine", "GateMachine", "machine_failure", "machine_for", "machine_settings", "run_beam_machine", "run_machine"]

#: The multinomial policy the machines draw (temperature 0.8, top-k 40: one draw per decision).
SAMPLED_POLICY = {"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}]}
#: Budgets per profile and model: (max_examples, stateful_step_count).
BUDGETS = {
    "fast": {"tiny": (60, 15), "smollm2": (4, 8)},
    "ci": {"tiny": (60, 15), "smollm2": (4, 8)},
    "full": {"tiny": (400, 30), "smollm2": (40, 20)},
}
#: Ops ``wild`` draws in any state (each needs no argument).
_SIMPLE_OPS = ("decode", "launch", "complete", "decide", "commit", "step", "recover", "repair", "stream_fail")





def machine_settings(model: str, **overrides: Any) -> settings:
    """Settings for a machine on ``model`` under the active profile (``fast``, ``full`` or CI's ``ci``).

    The budget comes from :data:`BUDGETS`; everything else (derandomization, database) from the
    active profile, so ``CI=true`` stays derandomized with no example database.
    """
    name = settings.get_current_profile_name()
    key = "full" if name == "full" else ("ci" if name.startswith("ci") else "fast")
    examples, steps = BUDGETS[key][model]
    values = {"max_examples": examples, "stateful_step_count": steps, "deadline": None,
                  "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]}
    values.update(overrides)
    return settings(**values)


class GateMachine(RuleBasedStateMachine):
    """Lock-step machine (configure it through :func:`machine_for`)."""

    runtime = "impl"
    model = "tiny"
    cache = "dynamic"
    adapter_factory: Callable[[], Adapter] | None = None
    #: Largest G the machine draws.
    max_new_tokens = 6
    #: ``(deviation id, verdict)`` of every documented deviation any example of this class hit
    #: (:func:`machine_for` gives each class its own list; :func:`run_machine` returns it).
    seen_deviations: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self) -> None:
        super().__init__()
        self.ls: LockStep | None = None
        self.adapter: Adapter | None = None
        self.caps: frozenset[str] = frozenset()
        self.handles: list[str] = []
        self.diverged = False
        self.refused = False
        self.deviations: list[tuple[str, Any]] = []
        self.expectations = load_expectations(self.runtime)

    # -- the case ----------------------------------------------------------------------------
    @initialize(data=st.data())
    def start(self, data: Any) -> None:
        """Open the runtime and draw the whole request envelope it declares capabilities for (:func:`~decodespec.checks.gate.drawing.case_configs`)."""
        from .drawing import case_configs

        self.adapter = self.adapter_factory() if self.adapter_factory is not None else open_runtime(self.runtime, self.model)
        self.caps = self.adapter.capabilities()
        config = data.draw(case_configs(self.model, self.cache, self.caps, max_new=self.max_new_tokens), label="config")
        self.ls = LockStep(self.adapter, config, runtime=self.runtime)
        record = self.ls.reset()
        if self.ls.unsupported is not None and not self._documented(record):
            # The runtime refuses a config it declared it could run with adapter.unsupported: an honest refusal is
            # this example's skip (as a table case's), never a failure; nothing is left to drive.
            self.refused = True
            _event(f"skip: {self.ls.unsupported}")
            return
        self._judge(record)
        # Both sides refused the request (they agree, with the same code): nothing is left to drive.
        self.refused = record.spec["status"] != "ok" and record.runtime["status"] != "ok"

    # -- helpers -------------------------------------------------------------------------------
    @property
    def state(self):
        return self.ls.spec.state

    @property
    def params(self):
        return self.ls.spec.params

    def _enabled(self, action) -> bool:
        return self.ls.spec.machine.enabled(self.params, self.state, action)

    def _due(self) -> CallKind | None:
        due = due_call(self.params, self.state)
        return None if due is None else due[0]

    def _documented(self, record) -> bool:
        """Whether a documented deviation of this runtime matches the record's failed verdict."""
        v = record.verdict
        return v.result == FAILED and any(e.matches(f"machine.{self.cache}", v, record.action, model=self.model,
                                                    spec_state=record.spec_state)
                                          for e in self.expectations)

    def _judge(self, record) -> None:
        if record.verdict.result == FAILED:
            v = record.verdict
            for expectation in self.expectations:
                if expectation.matches(f"machine.{self.cache}", v, record.action, model=self.model, spec_state=record.spec_state):
                    # A documented deviation: reported, and the lock step ends here (the two sides
                    # no longer describe the same request).
                    self.deviations.append((expectation.id, v))
                    type(self).seen_deviations.append((expectation.id, v))
                    print(f"decodespec: expected deviation {expectation.id} at step {v.step}: {v.message}")
                    self.diverged = True
                    return
            raise AssertionError(f"{v.rule} {v.check} at step {v.step} ({record.action}): {v.message} "
                                 f"[expected {v.expected!r}, observed {v.actual!r}]")

    def _do(self, action: dict[str, Any]) -> None:
        self._judge(self.ls.apply(action))

    def _live(self) -> bool:
        return self.ls is not None and not self.diverged and not self.refused

    def _has(self, *caps: str) -> bool:
        return self._live() and set(caps) <= self.caps

    def _open(self) -> bool:
        return self._live() and self.state.phase is not Phase.REJECTED

    # -- controller rules ------------------------------------------------------------------------
    @precondition(lambda self: self._open() and self._due() is CallKind.PREFILL)
    @rule(chunk=st.one_of(st.none(), st.integers(1, 3)))
    def prefill(self, chunk: int | None) -> None:
        if chunk is not None and not self._has("prefill_chunk"):
            chunk = None
        self._do({"op": "prefill", "chunk": chunk})

    @precondition(lambda self: self._open() and self._due() is CallKind.DECODE)
    @rule()
    def decode(self) -> None:
        self._do({"op": "decode"})

    @precondition(lambda self: self._has("inflight") and self._due() is not None)
    @rule(kind=st.one_of(st.none(), st.sampled_from([k.value for k in CallKind])))
    def launch(self, kind: str | None) -> None:
        """The due call, or a call of a named kind (refused by both sides unless it is the due one)."""
        self._do({"op": "launch", "kind": kind, "length": None})

    @precondition(lambda self: self._has("inflight") and self.state.in_flight is not None)
    @rule()
    def complete(self) -> None:
        self._do({"op": "complete"})

    @precondition(lambda self: self._has("decide_commit") and self.state.phase is Phase.SCORED)
    @rule()
    def decide(self) -> None:
        self._do({"op": "decide"})

    @precondition(lambda self: self._has("decide_commit") and self.state.phase is Phase.DECIDED)
    @rule()
    def commit(self) -> None:
        self._do({"op": "commit", "receipt": None})

    @precondition(lambda self: self._has("decide_commit") and bool(self.state.issued))
    @rule(n=st.integers(0, 8))
    def commit_receipt(self, n: int) -> None:
        """A duplicated (already consumed), stale (discarded) or the pending receipt, by id."""
        self._do({"op": "commit", "receipt": f"receipt-{n % (len(self.state.issued) + 1)}"})

    @precondition(lambda self: self._open() and self.state.phase is not Phase.FINISHED)
    @rule()
    def step(self) -> None:
        self._do({"op": "step"})

    @precondition(lambda self: self._open() and self.state.phase is not Phase.FINISHED)
    @rule()
    def run(self) -> None:
        self._do({"op": "run"})

    @precondition(lambda self: self._open() and repair_outstanding(self.params, self.state) and not self.state.quarantined
                  and self.state.in_flight is None)
    @rule()
    def repair(self) -> None:
        self._do({"op": "repair"})

    @precondition(lambda self: self._has("faults") and self._enabled(Recover()))
    @rule()
    def recover(self) -> None:
        self._do({"op": "recover"})

    # -- environment rules -----------------------------------------------------------------------
    @precondition(lambda self: self._open() and interrupt_point(self.state) is not None)
    @rule(kind=st.sampled_from(["cancelled", "timeout"]))
    def cancel(self, kind: str) -> None:
        self._do({"op": "cancel", "kind": kind})

    @precondition(lambda self: self._has("stream") and self._open() and self._enabled(StreamFailure()))
    @rule()
    def stream_fail(self) -> None:
        self._do({"op": "stream_fail"})

    @precondition(lambda self: self._has("faults", "inflight") and self._enabled(Fault("device_fault")))
    @rule(kind=st.sampled_from(["device_fault", "missing_lane"]), layer=st.integers(0, 3))
    def fault(self, kind: str, layer: int) -> None:
        if kind == "missing_lane" and not self._enabled(Fault("missing_lane")):
            kind = "device_fault"
        self._do({"op": "fault", "kind": kind, "layer": layer})

    @precondition(lambda self: self._has("rank_faults", "inflight") and self._enabled(Fault("device_fault")))
    @rule(kind=st.sampled_from(["rank_kill", "rank_stall"]), rank=st.integers(0, 1), layer=st.integers(0, 3))
    def rank_fault(self, kind: str, rank: int, layer: int) -> None:
        """One rank process of a tensor-parallel call dies or stalls mid-call (M3.10 0x0A: a missing participant selects
        ALL_OLD; no rank may hang the request).  The spec sees ``Fault("device_fault")``."""
        self._do({"op": "fault", "kind": kind, "layer": layer, "rank": rank})

    @precondition(lambda self: self._has("snapshot") and self._open())
    @rule(form=st.sampled_from(["pending_suffix", "repaired"]))
    def snapshot(self, form: str) -> None:
        handle = f"s{len(self.handles)}"
        record = self.ls.apply({"op": "snapshot", "form": form, "id": handle})
        self._judge(record)
        if record.runtime["status"] == "ok":
            self.handles.append(handle)

    @precondition(lambda self: self._has("snapshot") and bool(self.handles))
    @rule(index=st.integers(0, 7), corrupt=st.one_of(st.none(), st.sampled_from(CORRUPTIONS)))
    def restore(self, index: int, corrupt: str | None) -> None:
        self._do({"op": "restore", "snapshot": self.handles[index % len(self.handles)], "corrupt": corrupt})

    @precondition(lambda self: self._has("reuse") and self.params.cached and self.state.phase is Phase.FINISHED)
    @rule(prompt=st.integers(0, len(PROMPT_TEXTS) - 1))
    def reuse(self, prompt: int) -> None:
        """After finish, the same cache object serves a new request whose prompt is no longer than the current one."""
        # No longer than the current prompt, as the rule says: a longer fallback could exceed a small context cap the
        # config declares (found by the widened draws: L = 1, context_cap = 2, a reuse with a 5-token prompt).
        prompts = [p for p in prompts_for(self.model) if len(p) <= self.params.prompt_len] or [tuple(self.ls.spec.config.prompt_ids)]
        self._do({"op": "reuse", "prompt_ids": list(prompts[prompt % len(prompts)])})

    @precondition(lambda self: self._live())
    @rule(op=st.sampled_from(_SIMPLE_OPS))
    def wild(self, op: str) -> None:
        """Any simple op in any state: both sides must agree on accept / reject."""
        from ..adapters import OP_CAPABILITIES

        if OP_CAPABILITIES[op] <= self.caps:
            self._do({"op": op})

    @rule()
    def stutter(self) -> None:
        """Observe again: nothing changes (keeps terminal states productive)."""
        if self.ls is None or self.refused:
            return
        obs = self.adapter.observe()
        # After a refused reset the harness holds no observation: observing twice must agree.
        before = self.ls.observation if self.ls.observation is not None else self.adapter.observe()
        assert obs.summary() == before.summary(), "observing changed the observation"

    # -- invariants and teardown ---------------------------------------------------------------
    @invariant()
    def spec_invariants(self) -> None:
        if self._live():
            broken = violated(self.params, self.state)
            assert not broken, f"spec invariants violated: {broken}"

    def teardown(self) -> None:
        from .coverage import record_lockstep

        skipped = self.ls is not None and self.ls.unsupported is not None and self.refused
        if not skipped:
            record_lockstep(self.ls)
        if self.ls is not None and self.ls.failed and not self.diverged and not skipped:  # a documented deviation is no counterexample
            try:
                final = current_build_context().is_final
            except Exception:  # noqa: BLE001 - outside a Hypothesis test (a pasted program)
                final = True
            if final:
                trace = make_trace(runtime=self.runtime, config=self.ls.config, records=self.ls.records, verdict=self.ls.verdict,
                                   tolerance=self.ls.tolerance, description=f"shrunk counterexample of {type(self).__name__}",
                                   generator={"tool": "hypothesis", "version": hypothesis.__version__, "shrunk": True})
                path = write_trace(trace)
                print(f"decodespec: counterexample trace written to {path}")
        if self.adapter is not None:
            self.adapter.close()


def _event(text: str) -> None:
    """A Hypothesis ``event`` (the statistics of ``--hypothesis-show-statistics``); nothing outside a test."""
    with contextlib.suppress(Exception):  # outside a Hypothesis test (a pasted program) it raises
        hypothesis.event(text[:200])


def machine_for(runtime: str = "impl", model: str = "tiny", cache: str = "dynamic", *,
                adapter_factory: Callable[[], Adapter] | None = None) -> type[GateMachine]:
    """A :class:`GateMachine` subclass for one runtime, model and cache family.

    Args:
        runtime: Runtime name (``impl``, ``hf``, ``llamacpp``, ``stdio:CMD``, a broken one).
        model: ``tiny`` or ``smollm2``.
        cache: ``none``, ``dynamic`` or ``static``.
        adapter_factory: Build the adapter this way instead of opening ``runtime``.
    """
    name = f"Gate_{runtime}_{model}_{cache}".replace(":", "_").replace(".", "_").replace("/", "_").replace(" ", "_")
    return type(name, (GateMachine,), {"runtime": runtime, "model": model, "cache": cache, "adapter_factory": adapter_factory,
                                       "seen_deviations": []})


def run_machine(runtime: str = "impl", model: str = "tiny", cache: str = "dynamic", *,
                adapter_factory: Callable[[], Adapter] | None = None, **overrides: Any) -> list[tuple[str, Any]]:
    """Run the machine of (runtime, model, cache) under :func:`machine_settings` (``overrides`` win).

    Returns:
        ``(deviation id, verdict)`` of each documented deviation an example hit (in order; empty
        when none did), so the gate reports the machine as ``deviation`` rather than ``pass``.

    Raises:
        AssertionError: a failed verdict or a broken invariant (Hypothesis' shrunk example);
            any other exception of the adapter or the harness propagates unchanged.
    """
    factory = machine_for(runtime, model, cache, adapter_factory=adapter_factory)
    run_state_machine_as_test(factory, settings=machine_settings(model, **overrides))
    return list(factory.seen_deviations)


def machine_failure(exc: BaseException) -> tuple[str, Verdict]:
    """``(result, verdict)`` of a machine that raised: ``fail`` for a ladder verdict or a broken invariant
    (an AssertionError, layer from its ``ladder.<LAYER>`` prefix, else STATE), ``error`` for any other
    exception of the adapter or the harness (layer STATE, check ``harness``, actual the error code or type)."""
    if isinstance(exc, BaseExceptionGroup):  # Hypothesis reports several distinct failures as a group
        exc = exc.exceptions[0]
    message = (str(exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, AssertionError):
        head = message.split(" ", 2)
        layer = head[0].split(".", 1)[1] if head[0].startswith("ladder.") else "STATE"
        check = head[1] if head[0].startswith("ladder.") and len(head) > 1 else "invariant"
        return "fail", Verdict(FAILED, layer, f"ladder.{layer}", check, None, None, message)
    code = getattr(exc, "code", None) or type(exc).__name__
    return "error", Verdict(FAILED, "STATE", "ladder.STATE", "harness", None, code, f"the machine crashed: {message}")


class BeamMachine(RuleBasedStateMachine):
    """Beam bookkeeping in lock step: spec ``beam_step`` versus the runtime's joint top-K on scripted rows."""

    #: V >= 2K for the widest beam (4): HF's first step needs 2K finite candidates from the one initial beam.
    vocab = 10
    eos = 9
    #: Steps (over every run) in which a parent was duplicated while another completed with EOS.
    duplicated_with_eos = 0

    def __init__(self) -> None:
        super().__init__()
        self.params = None
        self.state = None
        self.steps = 0

    @initialize(num_beams=st.integers(1, 4), max_new_tokens=st.integers(2, 4),
                early_stopping=st.sampled_from([e.value for e in EarlyStopping]), length_penalty=st.sampled_from([0.0, 1.0, 2.0]))
    def start(self, num_beams: int, max_new_tokens: int, early_stopping: str, length_penalty: float) -> None:
        """A beam-family policy of every width 1-4 and every ``early_stopping`` value (M3.8 0x0F; ``BeamParams.from_policy``)."""
        from decodespec.spec.beam import BeamParams, initial_state
        from decodespec.spec.policy import policy_config_from_json

        from .coverage import policy_items, record_items

        policy = {"family": "beam", "num_beams": num_beams, "early_stopping": early_stopping, "length_penalty": length_penalty}
        self.params = BeamParams.from_policy(policy_config_from_json(policy), max_new_tokens, (self.eos,))
        record_items(policy_items(policy) | {f"beam.width.{num_beams}"} | ({"field.num_beams"} if num_beams != 1 else set()))
        self.state = initial_state(self.params, (1, 2), request_id="beam-machine")

    def _running(self) -> bool:
        from decodespec.spec.beam import BeamPhase

        return self.state is not None and self.state.phase is not BeamPhase.DONE

    @precondition(lambda self: self._running())
    @rule(data=st.data(), force=st.booleans())
    def step(self, data: Any, force: bool) -> None:
        """One call + decision; with ``force``, parent 0 takes the two best tokens and parent 1's best is EOS."""
        import numpy as np
        import torch

        from decodespec.impl.beam import top_flat_candidates
        from decodespec.spec.beam import beam_call, beam_step, check_step

        before = beam_call(self.params, self.state)
        n, k, v = len(before.live), self.params.num_beams, self.vocab
        raw = np.array(data.draw(st.lists(st.lists(st.integers(-40, 0), min_size=v, max_size=v), min_size=n, max_size=n)), dtype=np.float64)
        logits = raw / 4.0
        order = sorted(range(n), key=lambda j: (-before.live[j].score, j))
        a, b = (order[0], order[1]) if n >= 2 else (0, 0)
        if force and n >= 2:
            logits[:, :] = 0.0  # other parents: uniform rows, below the best parent's two children
            logits[a, :] = -30.0
            logits[a, 1], logits[a, 2] = 0.0, -0.01  # the best parent: two children share its mass
            logits[b, :] = -30.0
            logits[b, self.eos] = 0.0  # the second parent: its EOS takes all its mass
        rows = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)  # log-softmax per parent row
        after, record = beam_step(self.params, before, rows)
        broken = check_step(self.params, before, record, after)
        assert not broken, f"beam invariants violated: {broken}"
        scores = np.array([b.score for b in before.live], dtype=np.float64)
        flat = top_flat_candidates(torch.tensor(scores), torch.tensor(rows), min(n * v, 2 * k)).tolist()
        finite = [i for i in flat if np.isfinite(scores[i // v] + rows[i // v, i % v])]
        live = [i for i in finite if i % v != self.eos][:k]
        done = [i for i in finite[:k] if i % v == self.eos]
        observed_live = [(i // v, i % v) for i in live]
        spec_live = [(c.parent, c.token) for c in record.live_candidates]
        spec_done = [(c.parent, c.token) for c in record.completed_candidates if c.token == self.eos]
        exp = Expected(tolerance=Tolerance.from_logit(0.0, 0.0), beam_tokens=tuple(t for _, t in spec_live), beam_parents=tuple(p for p, _ in spec_live))
        from ..adapters import Observation

        obs = Observation(beam_tokens=[t for _, t in observed_live][:len(spec_live)], beam_parents=[p for p, _ in observed_live][:len(spec_live)])
        verdict = compare(exp, obs, layers=("DECISION",))
        assert verdict.result == PASSED, f"{verdict.rule} {verdict.check}: {verdict.message}"
        assert [(i // v, i % v) for i in done] == spec_done[:len(done)], f"completed EOS candidates differ: {done} vs {spec_done}"
        if force and n >= 2 and len(spec_live) >= 2:
            # The best parent's two children outrank every other live candidate: it is duplicated.
            assert [p for p, _ in spec_live][:2] == [a, a], f"parent {a} must be duplicated"
            if (b, self.eos) in spec_done:  # ... while the second parent completes with EOS in the same step
                BeamMachine.duplicated_with_eos += 1
        self.state = after
        self.steps += 1

    @rule()
    def stutter(self) -> None:
        """Nothing changes (a finished search keeps a rule enabled)."""

    @invariant()
    def beam_state_ok(self) -> None:
        if self.state is not None:
            from decodespec.spec.beam import check_state

            assert not check_state(self.params, self.state)


def run_beam_machine(**overrides: Any) -> None:
    """Run :class:`BeamMachine` under the tiny model's budget of the active profile."""
    run_state_machine_as_test(BeamMachine, settings=machine_settings("tiny", **overrides))
