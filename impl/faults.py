"""Declared fault injection for the reference runtime: device faults, missing lanes, interrupts, stream failures.

A :class:`FaultPlan` is a frozen value naming *where* each fault happens, by call number
(0-based ``call_id`` of the request's model calls) or by commit number, so a test or the
conformance gate can put one fault at every boundary of a run and compare the outcome with
the spec:

* :class:`DeviceFault` ``(call_id, layer)``: decoder layer ``layer`` raises
  :class:`InjectedDeviceFault` when call ``call_id`` reaches it (earlier layers have already
  staged their K/V rows); the runtime reports ``fault{kind: device_fault}`` and selects ALL_OLD
  (M3.10 0x0A "an asynchronous device fault invalidates staged cache/output state").
* :class:`MissingLane` ``(call_id, layer)``: layer ``layer`` of call ``call_id`` skips its cache
  write (it still attends over its current rows), so the advancing-state-lane roster is
  incomplete and the runtime selects ALL_OLD with reason ``missing_lane`` (M3.10 0x08).
* :class:`Interrupt` ``(reason, call_id, at)``: a cancellation or timeout arriving at one of the
  four interrupt points of call ``call_id`` (``before_launch`` of that call, ``in_flight``,
  ``after_completion``, ``after_decision`` of the decision its score row owns).
* :class:`StreamFailureAt` ``(output_index)``: the streamer fails right after output
  ``output_index`` (0-based) is committed (declared policy: close like an interrupt with
  ``stream_error``; needs a streamed request).

Each fault fires at most once per runner.  Every fault leaves the runner in a state the spec
reaches by the same actions: the last committed output, the right finish reason and nothing
partial (no score, no token of a failed call).

Source: M3.10 0x02 branch table (cancellation/timeout before launch / in flight, device error,
streamer failure), 0x08 SELECT LOGICAL STATE, 0x0A "Asynchronous completion and error
boundaries".
"""

from __future__ import annotations

import attrs

from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.state import InterruptPoint

__all__ = [
    "INVALID_FAULT_PLAN",
    "DeviceFault",
    "FaultPlan",
    "InjectedDeviceFault",
    "Interrupt",
    "MissingLane",
    "ParticipantFailure",
    "StreamFailureAt",
]

INVALID_FAULT_PLAN = register_code(
    "runtime.invalid_fault_plan",
    "rejection",
    "M3.10 0x0A Asynchronous completion and error boundaries",
    "A fault plan names a layer outside the model, a missing lane without a cache, an interrupt reason other than "
    "cancelled/timeout, or a stream failure for a request that does not stream.",
)


class InjectedDeviceFault(RuntimeError):
    """Raised inside a model call by a :class:`DeviceFault` (stands for an asynchronous device error)."""


class ParticipantFailure(RuntimeError):
    """A declared participant of a model call did not complete it: a rank process died (``device_error``) or was late
    past its bounded wait (``timeout``).  The runtime reports ``fault{device_fault}`` and selects ALL_OLD (no score).

    Attributes:
        reason: ``device_error`` or ``timeout``.
        rank: The first rank found missing.

    Source: M3.10 0x0A "One request can still be model-parallel" ("A missing participant or lane selects ALL_OLD and
    supplies no consumable score"; "One rank exiting while peers enter another collective can hang the request").
    """

    def __init__(self, reason: str, rank: int, message: str):
        super().__init__(f"[{reason}] {message}")
        self.reason, self.rank = reason, rank


@attrs.frozen
class DeviceFault:
    """Layer ``layer`` of call ``call_id`` raises :class:`InjectedDeviceFault` before computing."""

    call_id: int
    layer: int = 0


@attrs.frozen
class MissingLane:
    """Layer ``layer`` of call ``call_id`` does not write its K/V rows (a missing state lane)."""

    call_id: int
    layer: int = 0


@attrs.frozen
class Interrupt:
    """A cancellation or timeout arriving at point ``at`` of call ``call_id``."""

    reason: FinishReason
    call_id: int
    at: InterruptPoint = InterruptPoint.BEFORE_LAUNCH


@attrs.frozen
class StreamFailureAt:
    """The streamer fails right after output number ``output_index`` (0-based) is committed."""

    output_index: int


Fault = DeviceFault | MissingLane | Interrupt | StreamFailureAt


@attrs.frozen
class FaultPlan:
    """The faults of one run (each fires at most once).

    Attributes:
        faults: Any number of :class:`DeviceFault`, :class:`MissingLane`, :class:`Interrupt`,
            :class:`StreamFailureAt`.
    """

    faults: tuple[Fault, ...] = ()

    @classmethod
    def of(cls, *faults: Fault) -> FaultPlan:
        """``FaultPlan.of(DeviceFault(2), Interrupt(FinishReason.TIMEOUT, 4, InterruptPoint.IN_FLIGHT))``."""
        return cls(tuple(faults))

    def check(self, *, num_layers: int, cached: bool, stream: bool) -> None:
        """Refuse a plan the runner cannot carry out.

        Raises:
            Rejection: ``runtime.invalid_fault_plan`` (see the code's description).
        """
        for index, fault in enumerate(self.faults):
            path = f"$.faults[{index}]"
            if isinstance(fault, (DeviceFault, MissingLane)):
                if not 0 <= fault.layer < num_layers or fault.call_id < 0:
                    raise Rejection(INVALID_FAULT_PLAN, f"layer {fault.layer} / call {fault.call_id} outside the model's {num_layers} layers", path)
                if isinstance(fault, MissingLane) and not cached:
                    raise Rejection(INVALID_FAULT_PLAN, "a missing lane needs a cache (the no-cache profile has no state lane)", path)
            elif isinstance(fault, Interrupt):
                if fault.reason not in (FinishReason.CANCELLED, FinishReason.TIMEOUT) or fault.call_id < 0:
                    raise Rejection(INVALID_FAULT_PLAN, f"an interrupt is cancelled or timeout at a call >= 0, got {fault}", path)
            elif isinstance(fault, StreamFailureAt):
                if not stream or fault.output_index < 0:
                    raise Rejection(INVALID_FAULT_PLAN, "a stream failure needs a streamed request and an output index >= 0", path)
            else:
                raise Rejection(INVALID_FAULT_PLAN, f"unknown fault {fault!r}", path)

    def device_fault_layer(self, call_id: int) -> int | None:
        """The layer that faults in call ``call_id``, or ``None``."""
        return next((f.layer for f in self.faults if isinstance(f, DeviceFault) and f.call_id == call_id), None)

    def missing_lane_layers(self, call_id: int) -> frozenset[int]:
        """Layers whose cache write call ``call_id`` skips."""
        return frozenset(f.layer for f in self.faults if isinstance(f, MissingLane) and f.call_id == call_id)

    def interrupt(self, call_id: int, at: InterruptPoint) -> FinishReason | None:
        """The interrupt arriving at point ``at`` of call ``call_id``, or ``None``."""
        return next((f.reason for f in self.faults if isinstance(f, Interrupt) and f.call_id == call_id and f.at is at), None)

    def stream_fails_after(self, output_index: int) -> bool:
        """Whether the streamer fails right after output ``output_index`` is committed."""
        return any(isinstance(f, StreamFailureAt) and f.output_index == output_index for f in self.faults)
