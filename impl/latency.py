"""The runtime's latency record: when each model call launched and completed, and each emission.

:class:`LatencyRecorder` reads one host monotonic clock (:func:`time.perf_counter_ns`), always
after the completion boundary of the work it stamps: :meth:`RequestRunner.complete
<decodespec.impl.runtime.RequestRunner.complete>` stamps a call after the forward returned,
and on CUDA after the runner synchronised the device's stream (``_forward``), so host enqueue
time never stands for device completion.  Times are kept relative to admission.  It holds at most
``MAX_TIMED_EVENTS`` calls and as many emissions (``spec.latency``); later ones are only counted.

What the times mean -- TTFT, ITL, E2E, the per-phase sums -- is defined once, in
:mod:`decodespec.spec.latency`; :meth:`LatencyRecorder.timeline` hands the record over in its
terms.  The runner writes the same times into the event trace (``t_ns`` on ``call_launched``,
``call_completed``, ``stream`` and ``finish``), so a trace answers "where did the time go".

Source: M3.10 0x0BA "Latency semantics" and "Requirements for observability" (device completion
event, per-phase timings).
"""

from __future__ import annotations

import time
from typing import Callable

from decodespec.spec.latency import MAX_TIMED_EVENTS, CallTiming, Emission, Timeline

__all__ = ["LatencyRecorder"]


class LatencyRecorder:
    """Bounded record of one request's call and emission times (ns since admission).

    Args:
        prompt_len: L (carried into :meth:`timeline`).
        clock_ns: The clock (default :func:`time.perf_counter_ns`).
    """

    def __init__(self, prompt_len: int, clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self.prompt_len = prompt_len
        self._clock = clock_ns
        self._admit: int | None = None
        self._launch: tuple[str, int, int] | None = None
        self.calls: list[CallTiming] = []
        self.emissions: list[Emission] = []
        self.final_ns: int | None = None
        self.dropped = 0

    def now(self) -> int:
        """Nanoseconds since admission (0 before it)."""
        return 0 if self._admit is None else self._clock() - self._admit

    def admit(self) -> None:
        """Admission: the zero of every later time."""
        self._admit = self._clock()

    def launch(self, kind: str, rows: int) -> int | None:
        """A call was launched; returns its time, or ``None`` past the cap."""
        t = self.now()
        self._launch = (kind, rows, t)
        return t if len(self.calls) < MAX_TIMED_EVENTS else None

    def complete(self) -> int | None:
        """The launched call reached its completion boundary; returns the time, or ``None`` past the cap."""
        t = self.now()
        if self._launch is None:
            return None
        kind, rows, start = self._launch
        self._launch = None
        if len(self.calls) >= MAX_TIMED_EVENTS:
            self.dropped += 1
            return None
        self.calls.append(CallTiming(kind, rows, start, t))
        return t

    def emit(self, token_end: int) -> int | None:
        """Output through ``token_end`` tokens was published now; returns the time, or ``None`` past the cap."""
        t = self.now()
        if len(self.emissions) >= MAX_TIMED_EVENTS:
            return None
        self.emissions.append(Emission(t, token_end))
        return t

    def finish(self) -> int:
        """The final flush (a later call, e.g. the repair call's close, moves it)."""
        self.final_ns = self.now()
        return self.final_ns

    def timeline(self) -> Timeline:
        """The record as a :class:`decodespec.spec.latency.Timeline` (times relative to admission)."""
        return Timeline(prompt_len=self.prompt_len, admit_ns=0, calls=tuple(self.calls), emissions=tuple(self.emissions),
                        final_ns=self.final_ns, dropped=self.dropped)
