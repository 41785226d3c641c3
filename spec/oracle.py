"""The oracle a foreign runtime calls: "given this request and the score rows I decided on, where did I break the contract?"

:func:`replay_decisions` takes a :class:`~decodespec.spec.request_machine.Request` (from an admitted
envelope: :func:`~decodespec.spec.request_machine.request_from_envelope`) and the runtime's decisions in
order -- each the raw score row ``[V]`` it read and the id it selected (or ``None`` when it found no
legal token) -- and drives the composed request machine with them: every model call the schedule
makes due (:func:`~decodespec.spec.request_machine.next_action`: prefill chunks, decode calls, the
repair call of ``final_cache = all_outputs``) completes with all new rows, every decision is the spec
policy's on the runtime's own row (M3.8 0x0B: the same pipeline, RNG key and counter), every
commit fires the stop table's triggers (EOS, ``length``, ``context_length``, stop strings,
structured completion).  The first difference is returned as a :class:`Breach`:

================================ =======================================================================
check                            the runtime ...
================================ =======================================================================
``decision.selected_id``         selected another id than the policy on the same row
``decision.empty_support``       selected an id where the policy finds no legal token, or the reverse
``decision.logprob``             reported a logprob other than ``log_softmax(row)[id]`` (``logprob_atol``)
``decision.row_shape``           handed a row without ``V`` entries
``sequence.extra_decision``      decided after the request finished (a missed EOS / stop / length)
``sequence.missing_decision``    stopped while the request still needs a decision
``sequence.finish_reason``       reported another finish reason than the spec's
``sequence.text``                returned another text than the spec's (needs the token bytes)
================================ =======================================================================

The comparison is exact: it says what the contract requires of these rows.  Rows computed in float32
can put two ids within rounding of each other; the gate's tolerance-aware judge
(``decodespec judge``, ``checks/modelcheck/judge.py``) adds M3.10's margin rule on top of this replay.  Beam
requests are a different machine (:mod:`decodespec.spec.beam`).

Pure: no torch, no I/O; the request and the rows are not modified.

Source: M3.10 0x00 "One request as a transition system", 0x05 (exactly-once commit), 0x0A "A logit
tolerance is not a token-equality proof"; M3.8 0x0B; issue 17 item 1 (the oracle API).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from . import request_machine as rm
from .enums import FinishReason
from .policy.scores import log_softmax
from .request_machine import ComposedState, Request
from .transitions import MACHINE, Machine

__all__ = ["Breach", "ObservedDecision", "OracleResult", "replay_decisions"]


@attrs.frozen(eq=False)
class ObservedDecision:
    """One decision as the runtime made it.

    Attributes:
        row: ``[V]`` the raw score row (logits) the runtime decided on.
        token_id: The id it selected, or ``None`` when it found no legal token (``constraint_error``).
        logprob: The logprob it reports for the id (nats), or ``None`` when it reports none.
    """

    row: Sequence[float] | np.ndarray
    token_id: int | None
    logprob: float | None = None


@attrs.frozen
class Breach:
    """The first broken rule.

    Attributes:
        step: 0-based index of the observed decision it concerns (``len(decisions)`` for the end of the run).
        check: The check's name (module docstring's table).
        expected: What the spec requires.
        actual: What the runtime did.
        message: One sentence naming both.
    """

    step: int
    check: str
    expected: Any
    actual: Any
    message: str


@attrs.frozen(eq=False)
class OracleResult:
    """What the replay found.

    Attributes:
        breach: The first broken rule, or ``None``.
        output_ids: The spec's committed output ids when the replay stopped.
        logprobs: Their logprobs (nats, the spec's: ``log_softmax(row)[id]``).
        finish_reason: The spec's finish reason, or ``None`` while unfinished.
        state: The composed state when the replay stopped.
    """

    breach: Breach | None
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    state: ComposedState

    @property
    def ok(self) -> bool:
        """Whether no rule was broken."""
        return self.breach is None


def _advance(request: Request, state: ComposedState, machine: Machine) -> ComposedState:
    """Run the controller's calls until a decision is due or nothing is (no faults: every call completes ALL_NEW)."""
    while True:
        action = rm.next_action(request, state)
        if action == "launch":
            state = rm.launch(request, state, machine=machine)
        elif action == "complete":
            state = rm.complete(request, state, machine=machine)
        else:
            return state


def replay_decisions(request: Request, decisions: Sequence[ObservedDecision], *, finish_reason: str | None = None,
                     text: str | None = None, token_bytes: Callable[[int], bytes] | None = None, logprob_atol: float = 1e-6,
                     machine: Machine = MACHINE) -> OracleResult:
    """Replay a runtime's decisions through the composed request and return the first broken rule (see the module docstring).

    Args:
        request: The admitted request.
        decisions: The runtime's decisions in output order.
        finish_reason: The finish reason the runtime reported (a :class:`~decodespec.spec.enums.FinishReason`
            value), or ``None`` to leave it unchecked.
        text: The text the runtime returned, or ``None`` to leave it unchecked (needs ``token_bytes``).
        token_bytes: The model's bytes of one id; required when the request has stop strings or
            structured completion (the text triggers) or ``text`` is given.
        logprob_atol: Largest accepted ``|reported - log_softmax(row)[id]|`` (nats).
        machine: The spec's transition machine.

    Returns:
        The :class:`OracleResult`; never raises for a broken rule.

    Raises:
        Rejection / ResourceLimit: the request's admission refusal (the runtime should have refused it).
        ValueError: text triggers or ``text`` need ``token_bytes`` and it is ``None``.
    """
    if (text is not None or request.params.stop_strings or request.params.structured) and token_bytes is None:
        raise ValueError("the request's text (stop strings, structured completion, or the returned text) needs token_bytes")
    state = _advance(request, rm.admit(request, machine=machine), machine)
    breach: Breach | None = None
    size = request.params.vocab_size
    for i, observed in enumerate(decisions):
        if rm.next_action(request, state) != "decide":
            breach = Breach(i, "sequence.extra_decision", None, observed.token_id,
                            f"decision {i}: the runtime decided after the request finished "
                            f"({_finish(state)} with O = {len(state.output_ids)})")
            break
        row = np.asarray(observed.row, dtype=np.float64)
        if row.shape != (size,):
            breach = Breach(i, "decision.row_shape", [size], list(row.shape), f"decision {i}: the row has shape {list(row.shape)}, V = {size}")
            break
        choice = rm.choose(request, state, row, machine=machine)
        if choice is None or observed.token_id is None:
            if choice is None and observed.token_id is None:
                state = _advance(request, rm.support_empty(request, state, machine=machine), machine)
                continue
            expected = "no legal token" if choice is None else choice.token
            breach = Breach(i, "decision.empty_support", expected, "no legal token" if observed.token_id is None else observed.token_id,
                            f"decision {i}: the policy finds {expected!r} on the row, the runtime "
                            f"{'found no legal token' if observed.token_id is None else f'selected {observed.token_id}'}")
            break
        if observed.token_id != choice.token:
            values = choice.processed.values
            got = int(observed.token_id)
            theirs = float(values[got]) if 0 <= got < size else float("nan")
            breach = Breach(i, "decision.selected_id", choice.token, got,
                            f"decision {i}: the policy selects {choice.token} (processed score {float(values[choice.token]):.6g}) on the "
                            f"runtime's row, the runtime selected {got} (processed score {theirs:.6g})")
            break
        if observed.logprob is not None:
            want = float(log_softmax(row)[choice.token])
            if not abs(float(observed.logprob) - want) <= logprob_atol:
                breach = Breach(i, "decision.logprob", want, float(observed.logprob),
                                f"decision {i}: the logprob of {choice.token} is log_softmax(row)[id] = {want:.9g}, the runtime "
                                f"reported {float(observed.logprob):.9g}")
                break
        state = rm.decide(request, state, choice, machine=machine)
        state = _advance(request, rm.commit(request, state, token_bytes=token_bytes, machine=machine), machine)
    if breach is None and rm.next_action(request, state) == "decide":
        breach = Breach(len(decisions), "sequence.missing_decision", "a decision", None,
                        f"the runtime stopped after {len(decisions)} decisions, but the request is unfinished (O = "
                        f"{len(state.output_ids)}, G = {request.params.max_new_tokens}; no trigger fired)")
    if breach is None and finish_reason is not None and finish_reason != _finish(state):
        breach = Breach(len(decisions), "sequence.finish_reason", _finish(state), finish_reason,
                        f"finish reason: the spec says {_finish(state)!r}, the runtime reported {finish_reason!r}")
    if breach is None and text is not None and token_bytes is not None:
        want_text = rm.output_view(request, state, token_bytes).text
        if text != want_text:
            breach = Breach(len(decisions), "sequence.text", want_text, text, "the returned text differs from the spec's")
    return OracleResult(breach, state.output_ids, state.logprobs, _finish(state), state)


def _finish(state: ComposedState) -> str | None:
    reason: FinishReason | None = state.machine.finish_reason
    return None if reason is None else reason.value
