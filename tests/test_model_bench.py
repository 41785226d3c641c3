"""The benchmark's arithmetic (no timing is asserted: ``decodespec bench`` prints the figures).

The memory-bandwidth bound counts what one batch-1 decode step reads: every layer weight
once, one embedding row, the final norm and the full ``lm_head`` (M3.10 0x08 "Quantifying
projection reuse and retained state").
"""

from __future__ import annotations

import attrs
import pytest
import torch

from decodespec.checks.testing import requires_smollm2
from decodespec.impl.bench import BenchResult, decode_weight_bytes, measure_read_bandwidth
from decodespec.impl.tiny import load_tiny


def test_decode_weight_bytes_of_the_tiny_model(tiny_model):
    c = tiny_model.config
    per_layer = (
        c.hidden_size * c.num_attention_heads * c.head_dim * 2  # q_proj, o_proj
        + c.hidden_size * c.num_key_value_heads * c.head_dim * 2  # k_proj, v_proj
        + c.hidden_size * c.intermediate_size * 3  # gate, up, down
        + c.hidden_size * 2  # two norms
    )
    expected = (c.num_hidden_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size + c.hidden_size) * 4
    assert decode_weight_bytes(tiny_model) == expected
    assert decode_weight_bytes(load_tiny(dtype=torch.bfloat16, device="cpu")) == expected // 2


@requires_smollm2
def test_decode_weight_bytes_of_smollm2(smollm2_model):
    # 134,515,008 parameters; the tied head is read once more as lm_head, the embedding only one row.
    embed = 49152 * 576
    assert decode_weight_bytes(smollm2_model) == (134_515_008 - embed + 576 + embed) * 4


def test_bench_result_derived_figures():
    result = BenchResult(
        device="cpu", dtype="float32", prompt_len=32, new_tokens=128, repetitions=3,
        ours_tokens_per_s=(10.0, 12.0, 11.0), hf_tokens_per_s=(8.0, 9.0, 10.0), same_tokens=True,
        decode_weight_bytes=1_000_000, bandwidth_bytes_per_s={"sum": 2e7, "gemv": 3e7},
        peak_memory={"ours_resident": 1, "hf_resident": 2, "process_peak_rss": 3},
    )
    assert result.ours_median == 11.0 and result.hf_median == 9.0
    assert result.ratio == pytest.approx(11.0 / 9.0)
    assert result.ratio_best == pytest.approx(12.0 / 10.0)
    assert result.bound_tokens_per_s == pytest.approx(30.0)  # best bandwidth / bytes per token
    assert result.fraction_of_bound == pytest.approx(11.0 / 30.0)
    payload = result.to_json()
    assert payload["ratio_ours_over_hf"] == pytest.approx(11.0 / 9.0)
    assert payload["ours_tokens_per_s"] == [10.0, 12.0, 11.0]


def test_measure_read_bandwidth_reports_both_methods():
    figures = measure_read_bandwidth(1 << 20, torch.device("cpu"), torch.float32, hidden_size=64, repetitions=2)
    assert set(figures) == {"sum", "gemv"}
    assert all(value > 0 for value in figures.values())


def test_trace_overhead_is_the_paired_median_and_graph_ratio_uses_the_hf_median():
    """Each repetition's traced run is compared with the untraced run of the same repetition."""
    result = BenchResult(
        device="cpu", dtype="float32", prompt_len=32, new_tokens=128, repetitions=3,
        ours_tokens_per_s=(10.0, 20.0, 12.0), hf_tokens_per_s=(8.0, 9.0, 10.0), same_tokens=True,
        decode_weight_bytes=1_000_000, bandwidth_bytes_per_s={"sum": 2e7},
        peak_memory={"ours_resident": 1, "hf_resident": 2, "process_peak_rss": 3, "ours_cache": 4},
        trace_tokens_per_s=(9.0, 20.0, 12.0), graph_tokens_per_s=(90.0, 80.0, 100.0), same_tokens_graph=True, threads=1,
    )
    # Per-repetition time ratios 10/9, 20/20, 12/12 -> overheads 11.1%, 0, 0: the median is 0 (a burst does not count).
    assert result.trace_overhead == pytest.approx(0.0)
    assert result.graph_ratio == pytest.approx(90.0 / 9.0)
    payload = result.to_json()
    assert payload["trace_overhead"] == pytest.approx(0.0) and payload["threads"] == 1 and payload["ratio_graph_over_hf"] == pytest.approx(10.0)
    assert BenchResult(**{**attrs.asdict(result), "trace_tokens_per_s": ()}).trace_overhead is None
    assert result.cpu_ratio is None and result.trace_overhead_cpu is None
    cpu = BenchResult(**{**attrs.asdict(result), "cpu_tokens_per_s": {"ours": (10.0, 10.0, 10.0), "trace": (9.9, 9.8, 10.0), "hf": (8.0, 8.0, 8.0)}})
    assert cpu.cpu_ratio == pytest.approx(1.25) and cpu.trace_overhead_cpu == pytest.approx(10.0 / 9.9 - 1.0)
    assert result.fraction_of_bound_paired is None
    paired = BenchResult(**{**attrs.asdict(result), "bound_runs": (20.0, 20.0, 30.0)})
    assert paired.fraction_of_bound_paired == pytest.approx(0.5)  # 10/20, 20/20, 12/30 -> median 0.5


def _run(ttft_ms: float, itls_ms: list[float], prefill_rate: float | None = 100.0) -> dict:
    from decodespec.spec.latency import CallTiming, Emission, Timeline, request_latency

    ms = 1_000_000
    t = int(ttft_ms * ms)
    emissions = [Emission(t, 1)]
    for i, gap in enumerate(itls_ms):
        t += int(gap * ms)
        emissions.append(Emission(t, i + 2))
    calls = (CallTiming("prefill", 4, 0, int(ttft_ms * ms) - 1),) if prefill_rate is not None else ()
    return request_latency(Timeline(prompt_len=4, calls=calls, emissions=tuple(emissions), final_ns=t)).to_json()


def test_latency_summary_quantiles_and_paired_decode_ratio():
    """TTFT quantiles run over repetitions, ITL quantiles over every token of every repetition; the decode ratio is paired."""
    base = BenchResult(
        device="cpu", dtype="float32", prompt_len=4, new_tokens=3, repetitions=2,
        ours_tokens_per_s=(10.0, 12.0), hf_tokens_per_s=(8.0, 9.0), same_tokens=True,
        decode_weight_bytes=1_000_000, bandwidth_bytes_per_s={"sum": 2e8},
        peak_memory={"ours_resident": 1, "hf_resident": 2, "process_peak_rss": 3, "ours_cache": 4},
    )
    result = BenchResult(**{**attrs.asdict(base), "latency": {
        "ours": (_run(10, [2, 2]), _run(30, [4, 4])),
        "hf": (_run(20, [4, 4]), _run(20, [4, 4])),
    }, "absent": {"vllm": "not installed"}, "expected_calls": {"total": 3}})
    s = result.latency_summary("ours")
    assert s["ttft_ms"]["median"] == pytest.approx(20.0) and s["ttft_ms"]["n"] == 2
    assert s["itl_ms"]["n"] == 4 and s["itl_ms"]["median"] == pytest.approx(3.0)
    assert s["decode_tokens_per_s"] == pytest.approx((500.0 + 250.0) / 2)  # 2 tokens over 4 ms / over 8 ms
    assert result.paired_decode_ratio("ours") == pytest.approx((2.0 + 1.0) / 2)  # 500/250 and 250/250 per repetition
    assert result.latency_summary("native") is None
    assert result.decode_fraction_of_bound == pytest.approx(375.0 / 200.0)
    payload = result.to_json()
    assert payload["latency_summary"]["hf"]["ttft_ms"]["p99"] == pytest.approx(20.0) and "GEMV" in payload["bound_method"]
    from decodespec.impl.bench import format_result

    text = format_result(result)
    assert "vllm: not in this run -- not installed" in text and "TTFT ms" in text


def test_find_peers_reports_a_missing_hook_and_takes_a_present_one(tmp_path, monkeypatch):
    from decodespec.checks.commands.bench import find_peers

    (tmp_path / "fake_vllm_hook.py").write_text("def bench_runner(prompt_ids, new_tokens, threads):\n    return lambda: ((), None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found, absent = find_peers({"vllm": ("decodespec.checks.adapters.no_such_vllm", "bench_runner", "absent here"),
                                "fake": ("fake_vllm_hook", "bench_runner", "x"), "noattr": ("fake_vllm_hook", "missing", "no factory")})
    assert absent == {"vllm": "absent here", "noattr": "no factory"} and set(found) == {"fake"}


def test_hf_timer_stamps_calls_and_emissions():
    """The HF instrumentation: the first hooked call is the prefill, each streamer put after the prompt is one emission."""
    from decodespec.impl.bench import _HFTimer
    from decodespec.spec.latency import request_latency

    class Toy(torch.nn.Module):
        def forward(self, input_ids=None):
            return input_ids * 2

    toy = Toy()
    timer = _HFTimer(toy, torch.device("cpu"))
    toy(input_ids=torch.zeros(1, 5))  # not timing: not recorded
    with timer.timing(5):
        timer.put(torch.zeros(1, 5))  # the prompt
        toy(input_ids=torch.zeros(1, 5))
        timer.put(torch.tensor([1]))
        toy(input_ids=torch.zeros(1, 1))
        timer.put(torch.tensor([2]))
        timer.end()
    lat = request_latency(timer.timeline())
    assert (lat.prefill_calls, lat.decode_calls, lat.prefill_rows, lat.tokens_delivered, len(lat.itl_ns)) == (1, 1, 5, 2, 1)


def test_llamacpp_peer_times_each_generated_token(monkeypatch, tmp_path):
    """The llama.cpp peer's wrapper (llama-cpp-python is not installed here: a stand-in module with its API):
    greedy settings, ``new_tokens`` tokens then stop, one emission per token, every ``eval`` a timed call (the first
    the prefill of the whole prompt), and a fresh request every repetition: the stand-in, like ``Llama.generate``,
    reuses a cached prompt prefix unless the context was reset."""
    import sys
    import types

    from decodespec.impl.bench import llamacpp_peer
    from decodespec.spec.latency import request_latency

    seen = {"evals": []}

    class Ctx:
        def kv_cache_clear(self):
            seen["cleared"] = seen.get("cleared", 0) + 1

    class Llama:
        def __init__(self, **kwargs):
            seen["init"] = kwargs
            self._ctx, self.n_tokens = Ctx(), 0

        def reset(self):
            self.n_tokens = 0

        def eval(self, tokens):
            seen["evals"].append(len(tokens))
            self.n_tokens += len(tokens)

        def generate(self, tokens, **kwargs):
            seen["generate"] = (list(tokens), kwargs)
            prompt = list(tokens)[self.n_tokens:] or list(tokens)[-1:]  # the prefix match of llama.py L:917-950
            self.eval(prompt)
            token = 100
            while True:  # like llama-cpp-python, it never stops by itself
                token += 1
                yield token
                self.eval([token])

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setattr("decodespec.impl.gguf.smollm2_path", lambda: tmp_path / "model.gguf")
    run = llamacpp_peer([1, 2, 3], 4, 1)
    for _ in range(2):  # the second repetition must prefill the whole prompt again
        seen["evals"].clear()
        ids, timeline = run()
        assert ids == (101, 102, 103, 104) and seen["evals"][0] == 3
    assert seen["generate"][0] == [1, 2, 3] and seen["generate"][1]["temp"] == 0.0 and seen["generate"][1]["top_k"] == 1
    assert seen["init"]["logits_all"] is False and seen["init"]["n_threads"] == 1 and seen["cleared"] == 2
    lat = request_latency(timeline)
    assert lat.tokens_delivered == 4 and len(lat.itl_ns) == 3
    assert (lat.prefill_calls, lat.decode_calls, lat.prefill_rows) == (1, 3, 3) and lat.prefill_tokens_per_s is not None
