"""Latency semantics of one isolated request: what TTFT, ITL and E2E mean, over recorded timestamps.

Pure functions over a :class:`Timeline` of recorded times (no torch, no clock is read here): the
runtime (:mod:`decodespec.impl.latency`), a peer's instrumented run or a trace
(``decodespec.checks.gate.latency.timeline_from_trace``) records the times, and this module alone says
what they mean.

Definitions (M3.10 0x0BA "Latency semantics", for an isolated single request):

* **clock**: one monotonic clock, in integer nanoseconds, read on the host *after* the completion
  boundary of the work it stamps (on CUDA after the stream is synchronised, so host enqueue time
  is never mixed with device completion); times are kept relative to admission (``admit_ns``).
* **admission** ``t_admit``: the request was admitted (``Admit``; the trace's ``request`` event).
* **model call** ``i``: ``launch_ns`` (the call was launched) and ``complete_ns`` (its completion
  boundary: every stage done, the device synchronised); ``kind`` ``prefill`` / ``decode`` /
  ``repair``; ``rows`` the input rows it processed.
* **emission** ``j``: the moment output became visible to the caller -- a stream chunk was
  published (behind the stop-string holdback: a token the matcher still holds back is *not*
  emitted), or, for a request that does not stream, the one delivery of the whole output at the
  final flush.  ``token_end`` is the count of output tokens delivered through that emission.
* **final flush** ``t_final``: the request finished and its last held-back bytes were flushed
  (the trace's ``finish`` event).

Then::

    TTFT   = t_emit(first emission that delivers a token) - t_admit       (None when none: G = 0)
    ITL_j  = t_emit(j) - t_emit(j - 1)      for consecutive token-delivering emissions
    E2E    = t_final - t_admit
    prefill time = sum of the prefill calls' (complete - launch); decode time likewise
    decode tokens/s  = (tokens delivered after the first emission) / (t_emit(last) - t_emit(first))
    prefill tokens/s = prefill rows / prefill time

The decode rate excludes the prefill: the first output token is decided from the prefill's last
row, so G tokens need G - 1 decode calls (M3.10 "The first-output off-by-one"); dividing
``G / E2E`` (what a whole-call tokens/s reports) hides that boundary and the call count.
:func:`expected_calls` states the call count a conforming cached run makes.

Source: M3.10 0x0BA "Latency semantics" (TTFT_isolated, ITL_j, E2E; warm-up, synchronisation,
repetition count, median and tail quantiles; never mix host enqueue with device completion) and
"Requirements for observability" (per-phase timings in the trace); M3.10 "The first-output
off-by-one".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from .errors import Rejection, register_code

__all__ = [
    "CALL_KINDS",
    "CLOCK",
    "LATENCY_TIMELINE_INVALID",
    "MAX_TIMED_EVENTS",
    "QUANTILE_METHOD",
    "CallTiming",
    "Emission",
    "RequestLatency",
    "Timeline",
    "expected_calls",
    "quantile",
    "request_latency",
    "summarize",
    "timeline_from_json",
]

#: The clock every timestamp is read from (what the trace's ``t_ns`` fields hold).
CLOCK = "host monotonic clock (time.perf_counter_ns), integer ns since admission, read after the completion boundary"

#: At most this many model calls and this many emissions carry a time in one request (the runtime's
#: record and the trace's ``t_ns`` fields stop there; later ones are counted in ``Timeline.dropped``).
#: Bounds the memory of the record whatever ``max_new_tokens`` is.
MAX_TIMED_EVENTS = 65_536

#: How :func:`quantile` interpolates (NumPy's default ``method="linear"``).
QUANTILE_METHOD = "linear interpolation between order statistics (Hyndman-Fan type 7, numpy's default)"

#: The model-call kinds a timeline names (spec.enums.CallKind values).
CALL_KINDS = ("prefill", "decode", "repair")

LATENCY_TIMELINE_INVALID = register_code(
    "latency.timeline_invalid",
    "rejection",
    "M3.10 0x0BA Latency semantics",
    "A recorded request timeline is not a timeline: a time before admission or going backwards, a call completing "
    "before its launch, an unknown call kind, emissions whose delivered-token count does not grow, or more timed "
    "entries than MAX_TIMED_EVENTS.",
)


@attrs.frozen
class CallTiming:
    """One model call's recorded times.

    Attributes:
        kind: ``prefill`` / ``decode`` / ``repair``.
        rows: Input rows the call processed (``len(input_ids)``).
        launch_ns, complete_ns: Launch and completion boundary (ns on :data:`CLOCK`).
    """

    kind: str
    rows: int
    launch_ns: int
    complete_ns: int

    @property
    def duration_ns(self) -> int:
        return self.complete_ns - self.launch_ns


@attrs.frozen
class Emission:
    """One publication of output to the caller.

    Attributes:
        t_ns: When it was published (ns on :data:`CLOCK`).
        token_end: Output tokens delivered through it (cumulative).
    """

    t_ns: int
    token_end: int


@attrs.frozen
class Timeline:
    """The recorded times of one isolated request (see the module docstring for each boundary).

    Attributes:
        prompt_len: L.
        admit_ns: Admission time (0 when times are relative to admission).
        calls: Model calls in launch order.
        emissions: Publications in order.
        final_ns: The final flush, or ``None`` for a request that did not finish.
        dropped: Calls and emissions beyond :data:`MAX_TIMED_EVENTS` that carry no time.
    """

    prompt_len: int
    admit_ns: int = 0
    calls: tuple[CallTiming, ...] = ()
    emissions: tuple[Emission, ...] = ()
    final_ns: int | None = None
    dropped: int = 0

    def check(self) -> Timeline:
        """``self`` if it is a timeline; else ``Rejection(latency.timeline_invalid)`` naming the first fault."""

        def bad(message: str, path: str) -> Rejection:
            return Rejection(LATENCY_TIMELINE_INVALID, message, path)

        if len(self.calls) > MAX_TIMED_EVENTS or len(self.emissions) > MAX_TIMED_EVENTS:
            raise bad(f"{len(self.calls)} calls / {len(self.emissions)} emissions exceed {MAX_TIMED_EVENTS}", "$.calls")
        last = self.admit_ns
        for i, call in enumerate(self.calls):
            if call.kind not in CALL_KINDS:
                raise bad(f"call {i} has kind {call.kind!r}; expected one of {CALL_KINDS}", f"$.calls[{i}].kind")
            if call.rows < 1:
                raise bad(f"call {i} processed {call.rows} rows", f"$.calls[{i}].rows")
            if call.launch_ns < last:
                raise bad(f"call {i} launched at {call.launch_ns} ns, before {last} ns", f"$.calls[{i}].launch_ns")
            if call.complete_ns < call.launch_ns:
                raise bad(f"call {i} completed at {call.complete_ns} ns, before its launch at {call.launch_ns} ns", f"$.calls[{i}].complete_ns")
            last = call.complete_ns
        last_t, last_tokens = self.admit_ns, 0
        for j, emission in enumerate(self.emissions):
            if emission.t_ns < last_t:
                raise bad(f"emission {j} at {emission.t_ns} ns is before {last_t} ns", f"$.emissions[{j}].t_ns")
            if emission.token_end < last_tokens:
                raise bad(f"emission {j} delivers through token {emission.token_end}, fewer than {last_tokens}", f"$.emissions[{j}].token_end")
            last_t, last_tokens = emission.t_ns, emission.token_end
        if self.final_ns is not None and self.final_ns < max(last, last_t):
            raise bad(f"final flush at {self.final_ns} ns precedes the last recorded time {max(last, last_t)} ns", "$.final_ns")
        return self


@attrs.frozen
class RequestLatency:
    """What one request's timeline means (:func:`request_latency`); all times in ns.

    Attributes:
        ttft_ns: Admission to the first emission that delivers a token (``None``: none did).
        itl_ns: Each gap between consecutive token-delivering emissions (``len = emissions - 1``).
        e2e_ns: Admission to the final flush (``None``: not finished).
        prefill_ns, decode_ns, repair_ns: Sum of the calls' launch-to-completion times per kind.
        host_ns: ``e2e_ns`` less every call's time: policy, commit, stop matching and streaming
            between calls (``None`` without ``e2e_ns``).
        calls, prefill_calls, decode_calls, repair_calls: Model calls made (timed or dropped).
        prefill_rows: Rows the prefill calls processed.
        tokens_delivered: Output tokens the last emission delivered through.
        decode_tokens_per_s: Tokens delivered after the first emission / time from the first to
            the last emission (``None`` with fewer than two token-delivering emissions).
        prefill_tokens_per_s: ``prefill_rows / prefill time`` (``None`` without a timed prefill).
    """

    ttft_ns: int | None
    itl_ns: tuple[int, ...]
    e2e_ns: int | None
    prefill_ns: int
    decode_ns: int
    repair_ns: int
    host_ns: int | None
    calls: int
    prefill_calls: int
    decode_calls: int
    repair_calls: int
    prefill_rows: int
    tokens_delivered: int
    decode_tokens_per_s: float | None
    prefill_tokens_per_s: float | None

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["itl_ns"] = list(self.itl_ns)
        return out


def request_latency(timeline: Timeline) -> RequestLatency:
    """TTFT, every ITL, E2E, per-phase times and call counts of one request (module docstring).

    Raises:
        Rejection: ``latency.timeline_invalid`` (:meth:`Timeline.check`).
    """
    t = timeline.check()
    delivering = [e for e in t.emissions if e.token_end > 0]
    # Emissions that deliver no new token (an empty flush) are not token emissions.
    token_emissions: list[Emission] = []
    for e in delivering:
        if not token_emissions or e.token_end > token_emissions[-1].token_end:
            token_emissions.append(e)
    ttft = token_emissions[0].t_ns - t.admit_ns if token_emissions else None
    itl = tuple(b.t_ns - a.t_ns for a, b in itertools.pairwise(token_emissions))
    per_kind = {kind: [c for c in t.calls if c.kind == kind] for kind in CALL_KINDS}
    spent = {kind: sum(c.duration_ns for c in calls) for kind, calls in per_kind.items()}
    e2e = None if t.final_ns is None else t.final_ns - t.admit_ns
    prefill_rows = sum(c.rows for c in per_kind["prefill"])
    decode_rate = None
    if len(token_emissions) >= 2:
        span = token_emissions[-1].t_ns - token_emissions[0].t_ns
        tokens = token_emissions[-1].token_end - token_emissions[0].token_end
        decode_rate = tokens / (span * 1e-9) if span > 0 else math.inf
    prefill_rate = None
    if per_kind["prefill"]:
        prefill_rate = prefill_rows / (spent["prefill"] * 1e-9) if spent["prefill"] > 0 else math.inf
    return RequestLatency(
        ttft_ns=ttft,
        itl_ns=itl,
        e2e_ns=e2e,
        prefill_ns=spent["prefill"],
        decode_ns=spent["decode"],
        repair_ns=spent["repair"],
        host_ns=None if e2e is None else e2e - sum(spent.values()),
        calls=len(t.calls) + t.dropped,
        prefill_calls=len(per_kind["prefill"]),
        decode_calls=len(per_kind["decode"]) + t.dropped,
        repair_calls=len(per_kind["repair"]),
        prefill_rows=prefill_rows,
        tokens_delivered=token_emissions[-1].token_end if token_emissions else 0,
        decode_tokens_per_s=decode_rate,
        prefill_tokens_per_s=prefill_rate,
    )


def expected_calls(prompt_len: int, output_count: int, *, cached: bool = True, prefill_chunk: int | None = None,
                   repair: bool = False) -> dict[str, int]:
    """The model calls a conforming request makes: ``{"prefill", "decode", "repair", "total"}``.

    Cached: ``ceil(L / chunk)`` prefill calls (one without chunking), ``max(O - 1, 0)`` decode
    calls (the first token comes from the prefill's last row; the last committed token is never
    processed unless the request owes the repair call), plus one repair call when ``repair``.
    Uncached: the same counts, each call recomputing the whole prefix (one prefill call).
    ``O = 0`` with a call (``zero_new_tokens = prefill_only``) still makes the prefill calls;
    the ``no_call`` branch makes none -- pass ``prompt_len = 0`` for it.

    Source: M3.10 "The first-output off-by-one"; 0x08 "Output, input, and cache frontiers".
    """
    if prompt_len < 0 or output_count < 0 or (prefill_chunk is not None and prefill_chunk < 1):
        raise ValueError("prompt_len and output_count must be >= 0 and prefill_chunk >= 1")
    if prompt_len == 0:
        prefill = 0
    elif not cached or prefill_chunk is None:
        prefill = 1
    else:
        prefill = -(-prompt_len // prefill_chunk)
    decode = max(output_count - 1, 0)
    rep = 1 if repair and output_count > 0 else 0
    return {"prefill": prefill, "decode": decode, "repair": rep, "total": prefill + decode + rep}


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (``0 <= q <= 1``) of ``values`` by :data:`QUANTILE_METHOD`.

    Raises:
        ValueError: ``values`` is empty or ``q`` outside ``[0, 1]``.
    """
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q} outside [0, 1]")
    xs = sorted(values)
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """``{"n", "median", "p90", "p99", "min", "max"}`` of ``values`` (``None`` quantiles when empty)."""
    xs = list(values)
    if not xs:
        return {"n": 0, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    return {"n": len(xs), "median": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "p99": quantile(xs, 0.99),
            "min": min(xs), "max": max(xs)}


def timeline_from_json(data: Mapping[str, Any]) -> Timeline:
    """A :class:`Timeline` from its JSON form (``attrs.asdict``), checked.

    Raises:
        Rejection: ``latency.timeline_invalid`` for a malformed object or a non-timeline.
    """
    try:
        calls = tuple(CallTiming(str(c["kind"]), _int(c["rows"]), _int(c["launch_ns"]), _int(c["complete_ns"])) for c in data.get("calls", ()))
        emissions = tuple(Emission(_int(e["t_ns"]), _int(e["token_end"])) for e in data.get("emissions", ()))
        final = data.get("final_ns")
        timeline = Timeline(prompt_len=_int(data["prompt_len"]), admit_ns=_int(data.get("admit_ns", 0)), calls=calls,
                            emissions=emissions, final_ns=None if final is None else _int(final), dropped=_int(data.get("dropped", 0)))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Rejection(LATENCY_TIMELINE_INVALID, f"not a timeline object: {type(exc).__name__}", "$") from None
    return timeline.check()


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return value
