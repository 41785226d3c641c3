"""Reading a request's latency out of its event trace: "where did the time go".

:func:`timeline_from_trace` maps the ``t_ns`` fields of a ``decodespec.events.v1`` trace
(``call_launched`` / ``call_completed``: each model call; ``stream``: each published chunk;
``finish``: the final flush) onto :class:`decodespec.spec.latency.Timeline`, whose meaning --
TTFT, ITL, E2E, per-phase times, call counts -- :func:`decodespec.spec.latency.request_latency`
defines.  Traces written before the times existed carry no ``t_ns``; they still validate
(``decodespec validate-trace``), and this reader refuses them with ``latency.untimed_trace``.

A request that does not stream delivers its output once, at the final flush (one emission with
every committed token).

Source: M3.10 0x0BA "Latency semantics" and "Requirements for observability" (per-phase timings
in the trace).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.latency import CallTiming, Emission, Timeline

__all__ = ["LATENCY_UNTIMED_TRACE", "timeline_from_trace"]

LATENCY_UNTIMED_TRACE = register_code(
    "latency.untimed_trace",
    "rejection",
    "M3.10 0x0BA Latency semantics",
    "The trace carries no call times (t_ns): it was written before issue 19, or is a beam trace; re-record it with "
    "decodespec generate --trace to read its latency.",
)


def timeline_from_trace(lines: Iterable[str | Mapping[str, Any]]) -> Timeline:
    """The :class:`~decodespec.spec.latency.Timeline` of one single-path trace (lines or parsed records).

    Raises:
        Rejection: ``latency.untimed_trace`` when no model call carries times;
            ``latency.timeline_invalid`` when the times are not a timeline (times going back).
        ValueError / KeyError: a line that is not a trace event (run ``validate-trace`` first).
    """
    records = [json.loads(x) if isinstance(x, str) else dict(x) for x in lines]
    header = next((r for r in records if r.get("event") == "request"), None)
    if header is None or "params" not in header:
        raise Rejection(LATENCY_UNTIMED_TRACE, "no single-path request header", "$")
    prompt_len = int(header["params"]["prompt_len"])
    streamed = bool(header["params"].get("stream", False))
    calls: list[CallTiming] = []
    emissions: list[Emission] = []
    launched: dict[int, tuple[str, int, int]] = {}
    final: int | None = None
    untimed_calls = 0
    for rec in records:
        event = rec.get("event")
        if event == "call_launched":
            if "t_ns" in rec:
                launched[int(rec["call_id"])] = (str(rec["kind"]), len(rec["cache_position"]), int(rec["t_ns"]))
            else:
                untimed_calls += 1
        elif event == "call_completed" and "t_ns" in rec and int(rec["call_id"]) in launched:
            kind, rows, start = launched.pop(int(rec["call_id"]))
            calls.append(CallTiming(kind, rows, start, int(rec["t_ns"])))
        elif event == "stream" and streamed and "t_ns" in rec:
            if not emissions or emissions[-1].t_ns != rec["t_ns"]:
                emissions.append(Emission(int(rec["t_ns"]), int(rec["token_end"])))
            else:  # chunks of one commit share its emission
                emissions[-1] = Emission(emissions[-1].t_ns, int(rec["token_end"]))
        elif event == "finish" and "t_ns" in rec:
            if final is None and not streamed and int(rec["frontier"]["output_count"]):
                emissions.append(Emission(int(rec["t_ns"]), int(rec["frontier"]["output_count"])))
            final = int(rec["t_ns"])
    if not calls and untimed_calls:
        raise Rejection(LATENCY_UNTIMED_TRACE, f"none of the trace's {untimed_calls} model calls carries t_ns", "$")
    return Timeline(prompt_len=prompt_len, calls=tuple(calls), emissions=tuple(emissions), final_ns=final,
                    dropped=untimed_calls).check()
