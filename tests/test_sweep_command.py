"""``decodespec sweep`` / ``compare`` on the tiny model (M3.10 0x0BA "Sensitivity is a controlled experiment").

The contracts can fail: a planted chunking bug (later prefill chunks see their ids reversed) breaks
the chunk-size contract at the chunked points while the one-shot point still passes; a planted
stop-matcher bug that keeps the stop string breaks the exact-span contract.  A request that moves
two variables is refused with a typed error before anything runs; the plots are written.
"""

from __future__ import annotations

import json

import attrs
import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.gate.sweep import SWEEP_TWO_VARIABLES, Manifest, check_one_variable, parse_values, sweep
from decodespec.spec.errors import Rejection

FAST = Manifest(model="tiny", prompt_len=12, new_tokens=4, repetitions=1)


def _failed(line):
    return {c["check"] for c in line["contract"]["checks"] if not c["passed"]}


def test_chunk_size_sweep_keeps_its_contract_and_writes_jsonl_and_png(tmp_path):
    lines = sweep("prefill_chunk", [None, 5, 12], FAST, out_dir=tmp_path, progress=False)
    assert [line["value"] for line in lines] == [None, 5, 12]
    for line in lines:
        assert line["contract"]["passed"], _failed(line)
        assert line["cost"]["calls"] == [line["cost"]["expected_calls"]]
        assert line["cost"]["ttft_ms"]["n"] == 1 and line["cost"]["itl_ms"]["n"] == 3  # G = 4: three gaps
    assert lines[1]["cost"]["expected_calls"] == 3 + 3  # ceil(12 / 5) prefill calls + G - 1 decode calls
    checks = {c["check"] for c in lines[1]["contract"]["checks"]}
    assert {"prefill_kv_vs_own_one_shot", "last_row_vs_own_base_run", "prefill_kv_vs_float64_reference"} <= checks
    written = [json.loads(x) for x in (tmp_path / "sweep-prefill_chunk.jsonl").read_text().splitlines()]
    assert [w["value"] for w in written] == [None, 5, 12] and written[0]["manifest"]["prompt_len"] == 12
    png = tmp_path / "sweep-prefill_chunk.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as image:
        assert image.size[0] >= 1000 and image.size[1] >= 700


def test_a_planted_chunking_bug_breaks_the_chunk_size_contract(monkeypatch):
    from decodespec.impl.model import LlamaForCausalLM

    forward = LlamaForCausalLM.forward

    def buggy(self, input_ids, *args, cache_position=None, **kwargs):
        if cache_position is not None and int(cache_position[0]) > 0 and input_ids.shape[-1] > 1:
            input_ids = input_ids.flip(-1)  # a later prefill chunk processes its ids in the wrong order
        return forward(self, input_ids, *args, cache_position=cache_position, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", buggy)
    one_shot, chunked = sweep("prefill_chunk", [None, 5], FAST, progress=False)
    assert one_shot["contract"]["passed"]
    assert not chunked["contract"]["passed"]
    assert {"prefill_kv_vs_own_one_shot", "prefill_kv_vs_float64_reference", "last_row_vs_own_base_run"} <= _failed(chunked)


def test_stop_sweep_checks_exact_spans_and_catches_a_leaking_matcher(monkeypatch):
    manifest = attrs.evolve(FAST, new_tokens=8)  # the tiny model writes "G}2MH}2M" after this prompt
    base, fired, absent = sweep("stop", ["", "MH", "zz"], manifest, progress=False)
    for line in (base, fired, absent):
        assert line["contract"]["passed"], _failed(line)
    spans = {c["check"]: c for c in fired["contract"]["checks"]}
    assert spans["finish_reason"]["actual"] == "stop_string" and spans["exact_span_text"]["stop_at_char"] == 3
    assert {c["check"]: c for c in absent["contract"]["checks"]}["finish_reason"]["actual"] == "length"
    assert fired["cost"]["output_count"] < 8 and fired["cost"]["calls"] == [fired["cost"]["expected_calls"]]

    from decodespec.impl.runtime import RequestRunner

    real_result = RequestRunner.result

    def leaking(self):
        res = real_result(self)
        if self.request.stop_strings and res.stop_match is not None:
            return attrs.evolve(res, text=res.text + self.request.stop_strings[0])  # the stop string leaks into the text
        return res

    monkeypatch.setattr(RequestRunner, "result", leaking)
    _, leaked = sweep("stop", ["", "MH"], manifest, progress=False)
    assert "exact_span_text" in _failed(leaked)


def test_dtype_sweep_reports_divergence_and_margin_crossings():
    f32, bf16 = sweep("dtype", ["float32", "bfloat16"], FAST, progress=False)
    assert f32["contract"]["passed"] and bf16["contract"]["passed"], (_failed(f32), _failed(bf16))
    measures = bf16["contract"]["measures"]
    assert "token_divergence_from_base" in measures and measures["margin_crossings"] >= 0
    assert bf16["contract"]["measures"]["epsilon"] > f32["contract"]["measures"]["epsilon"]  # bf16's calibrated tolerance is wider
    assert bf16["cost"]["kv_bytes"] * 2 == f32["cost"]["kv_bytes"]


def test_two_moving_variables_are_refused_and_nothing_is_written(tmp_path, capsys):
    code = main(["sweep", "prefill_chunk", "--values", "none,4", "--prompt-len", "8,16", "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 2
    err = json.loads(capsys.readouterr().err)
    assert err["error"]["code"] == SWEEP_TWO_VARIABLES and "decodespec compare" in err["error"]["message"]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Rejection) as info:
        check_one_variable("dtype", {"dtype": ["float32", "bfloat16"], "cache": ["static", "dynamic"]})
    assert info.value.code == SWEEP_TWO_VARIABLES
    check_one_variable("dtype", {"dtype": ["float32", "bfloat16"], "cache": ["static"]})  # one value: fixed, not moving


@pytest.mark.parametrize("variable, values, code", [
    ("num_beams", "2,x", "sweep.value_invalid"),
    ("temperature", "1", "sweep.variable_unsupported"),
    ("prompt_len", "8,x", "sweep.value_invalid"),
    ("prompt_len", "8,8", "sweep.value_invalid"),
])
def test_bad_sweeps_are_typed_refusals(variable, values, code, tmp_path, capsys):
    assert main(["sweep", variable, "--values", values, "--out-dir", str(tmp_path), "--no-progress"]) == 2
    assert json.loads(capsys.readouterr().err)["error"]["code"] == code
    with pytest.raises(Rejection):
        parse_values(variable, values)


def test_compare_runs_configurations_under_that_name(tmp_path, capsys):
    code = main(["compare", "--config", "prompt_len=8,prefill_chunk=4", "--config", "prompt_len=12,prefill_chunk=none",
                 "--new-tokens", "3", "--repetitions", "1", "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 0, capsys.readouterr()
    lines = [json.loads(x) for x in (tmp_path / "compare.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["configuration_comparison"] * 2
    assert lines[0]["moved"] == {"prompt_len": 8, "prefill_chunk": 4} and lines[0]["cost"]["calls"] == [2 + 2]
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", "--config", "prompt_len=8", "--out-dir", str(tmp_path)]) == 2  # one configuration is no comparison


def test_beam_width_sweep_checks_branch_correctness_and_catches_a_wrong_parent_gather(monkeypatch):
    """Width 1 equals greedy; each kept branch's logprobs are its own path's (float64 reference) and its score their
    sum.  A cache reorder that gathers the wrong parent rows (reversed) breaks that at width > 1."""
    manifest = attrs.evolve(FAST, new_tokens=6, cache="dynamic")
    lines = sweep("num_beams", [1, 2, 3], manifest, progress=False)
    for line in lines:
        assert line["contract"]["passed"], _failed(line)
    assert "beam_width_one_equals_greedy" in {c["check"] for c in lines[0]["contract"]["checks"]}
    assert lines[2]["contract"]["measures"]["branches"] == 3 and lines[2]["cost"]["kv_bytes"] == 3 * lines[0]["cost"]["kv_bytes"]
    assert lines[2]["cost"]["calls"] == [lines[2]["cost"]["expected_calls"]]  # 1 prefill + G - 1 batched decode calls

    from decodespec.impl.cache import DynamicCache

    reorder = DynamicCache.reorder_cache

    def wrong_parents(self, beam_idx):
        idx = list(beam_idx.tolist() if hasattr(beam_idx, "tolist") else beam_idx)
        return reorder(self, idx[::-1])

    monkeypatch.setattr(DynamicCache, "reorder_cache", wrong_parents)
    broken = sweep("num_beams", [1, 3], manifest, progress=False)
    assert not broken[1]["contract"]["passed"]
    assert "branch_logprobs_vs_float64_reference" in _failed(broken[1])


def test_cache_family_and_output_length_sweeps_keep_their_contracts():
    """Cache families: last row and tokens against the no-cache run; output length: every run a prefix of the longest."""
    caches = sweep("cache", ["none", "dynamic", "static"], FAST, progress=False)
    for line in caches:
        assert line["contract"]["passed"], _failed(line)
    assert caches[0]["cost"]["kv_bytes"] == 0 and caches[1]["cost"]["kv_bytes"] == caches[2]["cost"]["kv_bytes"] > 0
    assert caches[2]["cost"]["kv_reserved_bytes"] > caches[2]["cost"]["kv_bytes"]  # the static buffer reserves L + G + 1 slots
    assert {"last_row_vs_own_base_run", "same_tokens_as_base"} <= {c["check"] for c in caches[1]["contract"]["checks"]}
    lengths = sweep("new_tokens", [1, 3, 5], FAST, progress=False)
    for line in lengths:
        assert line["contract"]["passed"], _failed(line)
    assert [line["cost"]["calls"] for line in lengths] == [[1], [3], [5]]  # 1 prefill + G - 1 decode calls
    assert lengths[0]["cost"]["itl_ms"]["n"] == 0 and lengths[0]["base"] == "new_tokens=5"
