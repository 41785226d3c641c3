"""Latency semantics (M3.10 0x0BA "Latency semantics"): the spec's definitions on constructed timelines,
the runtime's record, and the trace's ``t_ns`` fields read back (old traces without them still validate).
"""

from __future__ import annotations

import json

import pytest

from decodespec.checks.gate.latency import LATENCY_UNTIMED_TRACE, timeline_from_trace
from decodespec.spec.errors import Rejection
from decodespec.spec.latency import (
    LATENCY_TIMELINE_INVALID,
    MAX_TIMED_EVENTS,
    CallTiming,
    Emission,
    Timeline,
    expected_calls,
    quantile,
    request_latency,
    summarize,
    timeline_from_json,
)

MS = 1_000_000


def _greedy_timeline(g: int, *, chunk_calls: int = 1, stream: bool = True) -> Timeline:
    """A cached run: prefill in ``chunk_calls`` calls of 10 ms, then G - 1 decode calls of 4 ms, each followed by 1 ms host work."""
    calls, emissions, t = [], [], 0
    for _ in range(chunk_calls):
        calls.append(CallTiming("prefill", 4, t, t + 10 * MS))
        t += 10 * MS
    for i in range(g):
        t += 1 * MS  # policy + commit + stream
        if stream:
            emissions.append(Emission(t, i + 1))
        if i < g - 1:
            calls.append(CallTiming("decode", 1, t, t + 4 * MS))
            t += 4 * MS
    if not stream and g:
        emissions.append(Emission(t, g))
    return Timeline(prompt_len=4 * chunk_calls, calls=tuple(calls), emissions=tuple(emissions), final_ns=t)


def test_ttft_itl_e2e_of_a_streamed_greedy_run():
    lat = request_latency(_greedy_timeline(5))
    assert lat.ttft_ns == 11 * MS  # the prefill and one host step: no decode call before the first token
    assert lat.itl_ns == (5 * MS,) * 4  # one decode call + host work between emissions
    assert lat.e2e_ns == 11 * MS + 4 * 5 * MS
    assert (lat.prefill_calls, lat.decode_calls, lat.calls) == (1, 4, 5)  # G tokens, G - 1 decode calls
    assert lat.prefill_ns == 10 * MS and lat.decode_ns == 16 * MS and lat.host_ns == 5 * MS
    assert lat.decode_tokens_per_s == pytest.approx(4 / 0.020)  # 4 tokens after the first, over 20 ms: the prefill excluded
    assert lat.prefill_tokens_per_s == pytest.approx(4 / 0.010)
    assert lat.calls == expected_calls(4, 5)["total"]


def test_g_zero_and_g_one():
    none = request_latency(Timeline(prompt_len=0, final_ns=5))  # no_call branch: nothing emitted, nothing called
    assert none.ttft_ns is None and none.itl_ns == () and none.calls == 0 and none.e2e_ns == 5 and none.decode_tokens_per_s is None
    assert expected_calls(0, 0) == {"prefill": 0, "decode": 0, "repair": 0, "total": 0}
    assert expected_calls(7, 0) == {"prefill": 1, "decode": 0, "repair": 0, "total": 1}  # prefill_only
    one = request_latency(_greedy_timeline(1))
    assert one.ttft_ns == 11 * MS and one.itl_ns == () and one.decode_calls == 0 and one.decode_tokens_per_s is None
    assert one.calls == expected_calls(4, 1)["total"] == 1


def test_call_count_off_by_one_and_chunking():
    assert expected_calls(10, 4, prefill_chunk=3) == {"prefill": 4, "decode": 3, "repair": 0, "total": 7}
    assert expected_calls(10, 4, prefill_chunk=3, repair=True)["total"] == 8
    assert expected_calls(10, 4, cached=False, prefill_chunk=3)["prefill"] == 1
    lat = request_latency(_greedy_timeline(3, chunk_calls=4))
    assert lat.prefill_calls == 4 and lat.prefill_rows == 16 and lat.ttft_ns == 41 * MS
    assert lat.calls == expected_calls(16, 3, prefill_chunk=4)["total"]
    # A runtime that made one decode call too many (processing the final token) is visible in the count.
    t = _greedy_timeline(3)
    extra = Timeline(prompt_len=4, calls=t.calls + (CallTiming("decode", 1, t.final_ns, t.final_ns + MS),), emissions=t.emissions,
                     final_ns=t.final_ns + MS)
    assert request_latency(extra).calls == expected_calls(4, 3)["total"] + 1


def test_stop_string_holdback_delays_the_first_emission():
    """Tokens 1 and 2 are held back (they could start a stop string) and published with token 3: TTFT is at
    that emission, not at the first commit, and the first ITL spans the two held-back steps."""
    calls = (CallTiming("prefill", 4, 0, 10 * MS), CallTiming("decode", 1, 11 * MS, 15 * MS), CallTiming("decode", 1, 16 * MS, 20 * MS),
             CallTiming("decode", 1, 21 * MS, 25 * MS))
    held = Timeline(prompt_len=4, calls=calls, emissions=(Emission(21 * MS, 3), Emission(26 * MS, 4)), final_ns=26 * MS)
    lat = request_latency(held)
    assert lat.ttft_ns == 21 * MS and lat.itl_ns == (5 * MS,) and lat.tokens_delivered == 4
    assert lat.decode_tokens_per_s == pytest.approx(1 / 0.005)
    # An empty flush (no new token) is not a token emission.
    flushed = Timeline(prompt_len=4, calls=calls, emissions=held.emissions + (Emission(27 * MS, 4),), final_ns=27 * MS)
    assert request_latency(flushed).itl_ns == (5 * MS,)


def test_unstreamed_output_is_emitted_at_the_final_flush():
    lat = request_latency(_greedy_timeline(4, stream=False))
    assert lat.ttft_ns == lat.e2e_ns and lat.itl_ns == ()


@pytest.mark.parametrize("bad", [
    Timeline(prompt_len=1, calls=(CallTiming("prefill", 1, 5, 3),)),
    Timeline(prompt_len=1, calls=(CallTiming("prefill", 1, 0, 5), CallTiming("decode", 1, 4, 6))),
    Timeline(prompt_len=1, calls=(CallTiming("chunk", 1, 0, 5),)),
    Timeline(prompt_len=1, calls=(CallTiming("prefill", 0, 0, 5),)),
    Timeline(prompt_len=1, emissions=(Emission(5, 2), Emission(4, 3))),
    Timeline(prompt_len=1, emissions=(Emission(5, 2), Emission(6, 1))),
    Timeline(prompt_len=1, emissions=(Emission(5, 2),), final_ns=4),
    Timeline(prompt_len=1, admit_ns=10, emissions=(Emission(5, 2),)),
])
def test_a_non_timeline_is_refused(bad):
    with pytest.raises(Rejection) as info:
        request_latency(bad)
    assert info.value.code == LATENCY_TIMELINE_INVALID


def test_cap_and_json_round_trip():
    big = Timeline(prompt_len=1, emissions=tuple(Emission(i, i + 1) for i in range(MAX_TIMED_EVENTS + 1)))
    with pytest.raises(Rejection):
        big.check()
    import attrs

    t = _greedy_timeline(3)
    assert timeline_from_json(json.loads(json.dumps(attrs.asdict(t)))) == t
    with pytest.raises(Rejection) as info:
        timeline_from_json({"prompt_len": "4"})
    assert info.value.code == LATENCY_TIMELINE_INVALID


def test_quantiles_are_numpys_linear_method():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)))
    s = summarize(xs)
    assert s["median"] == 5.0 and s["n"] == 7 and s["p99"] == pytest.approx(float(np.quantile(xs, 0.99)))
    assert summarize([])["p90"] is None
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_runtime_record_matches_its_trace_and_the_call_count(tiny_model, byte_tokenizer):
    """The runner's own record and the trace's t_ns say the same thing; calls obey the off-by-one."""
    from decodespec.impl.events import ListSink
    from decodespec.impl.runtime import RequestRunner, RuntimeRequest
    from decodespec.spec.policy.config import PolicyConfig

    prompt = tuple(byte_tokenizer.encode("hello world"))
    request = RuntimeRequest(identity="lat", prompt_ids=prompt, max_new_tokens=5, policy=PolicyConfig.greedy(), eos_ids=frozenset(),
                             cache="dynamic", prefill_chunk=2, stream=True)
    sink = ListSink()
    runner = RequestRunner(tiny_model, request, sink=sink, tokenizer=byte_tokenizer, on_chunk=lambda c: None).run()
    recorded = runner.latency.timeline()
    assert timeline_from_trace(sink.records) == recorded
    lat = request_latency(recorded)
    assert lat.calls == runner.num_calls == expected_calls(len(prompt), 5, prefill_chunk=2)["total"]
    assert lat.prefill_calls == -(-len(prompt) // 2) and lat.decode_calls == 4
    assert lat.ttft_ns is not None and 0 < lat.ttft_ns <= lat.e2e_ns
    assert lat.prefill_ns + lat.decode_ns + lat.host_ns == lat.e2e_ns
    assert lat.tokens_delivered <= 5


def test_untimed_trace_still_validates_but_has_no_latency(tmp_path, tiny_model, byte_tokenizer):
    """A trace written before the t_ns fields (simulated by stripping them) is still accepted by validate-trace."""
    from decodespec.checks.commands.cli import main
    from decodespec.impl.events import FileSink
    from decodespec.impl.generate import generate

    path = tmp_path / "t.ndjson"
    with FileSink(path) as sink:
        generate(tiny_model, list(byte_tokenizer.encode("hi there")), max_new_tokens=3, seed=0, sink=sink)
    lines = path.read_text().splitlines()
    assert any('"t_ns"' in line for line in lines)
    old = tmp_path / "old.ndjson"
    stripped = []
    for line in lines:
        rec = json.loads(line)
        rec.pop("t_ns", None)
        stripped.append(json.dumps(rec))
    old.write_text("\n".join(stripped) + "\n")
    assert main(["validate-trace", str(path)]) == 0
    assert main(["validate-trace", str(old)]) == 0
    with pytest.raises(Rejection) as info:
        timeline_from_trace(stripped)
    assert info.value.code == LATENCY_UNTIMED_TRACE
    # A negative or non-integer t_ns is outside the published schema.
    bad = tmp_path / "bad.ndjson"
    bad.write_text("\n".join(line.replace('"t_ns":', '"t_ns":-', 1) if '"call_launched"' in line else line for line in lines) + "\n")
    assert main(["validate-trace", str(bad)]) == 1  # refused: trace.schema
