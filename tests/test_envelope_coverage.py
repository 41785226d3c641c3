"""The gate's envelope coverage (checks/gate/coverage.py) and strategies (checks/gate/drawing.py): derived declared items, per-run
items, capability-respecting draws, and the full-run rule that decides enforcement.

Rules: the coverage report of issue 15 item 4 (declared items from the request schema, the M3.8
catalog and presets, the finish-reason enum and the contract ops); M3.10 0x06 (stop matches,
holdback), M3.8 0x0B (presets).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from decodespec.checks.adapters import OPS, CaseConfig
from decodespec.checks.adapters.impl import IMPL_CAPABILITIES
from decodespec.checks.conftest import full_gate_run
from decodespec.checks.gate.coverage import Coverage, config_items, declared_items, edge_items, enforced_items, run_items, transform_orders, unsupported_values
from decodespec.checks.gate.drawing import case_configs, sweep_cases
from decodespec.spec.enums import FinishReason
from decodespec.spec.policy.config import CATALOG, PRESET_ORDERS, Order

CHECKS = Path(__file__).resolve().parent.parent / "checks"


def test_declared_items_come_from_the_registries() -> None:
    items = declared_items()
    schema = json.loads((CHECKS.parent / "spec" / "schemas" / "request.v1.json").read_text())
    for value in schema["properties"]["output"]["properties"]["alignment"]["enum"]:
        assert f"enum.alignment.{value}" in items
    assert {f"transform.{n}" for n in CATALOG} <= set(items)
    assert {f"finish.{r.value}" for r in FinishReason} <= set(items)
    assert {f"action.{op}" for op in OPS} <= set(items)
    # Every preset with a place for a transform, and explicit, which has a place for every one.
    for order, names in PRESET_ORDERS.items():
        for name in names:
            assert f"transform.{name}@{order.value}" in items
    assert all(Order.EXPLICIT.value in transform_orders(n) for n in CATALOG)
    # Values CaseConfig refuses are reported as unsupported, not declared.
    assert unsupported_values() == {"dtype": ("float64",), "attention": ("flash",)}
    assert "enum.attention.flash" not in items and "enum.attention.eager" in items
    assert "edge.top_p.p.max" in edge_items() and "edge.temperature.temperature.max" not in edge_items()


def test_enforced_items_respect_capabilities_and_the_model() -> None:
    full = enforced_items(IMPL_CAPABILITIES, "impl", model="smollm2", cuda=False)
    assert "stop.match_starts_inside_token" in full and "field.device" not in full
    tiny = enforced_items(IMPL_CAPABILITIES, "impl", model="tiny", cuda=False)
    assert "stop.match_starts_inside_token" not in tiny  # one byte per token
    greedy_only = enforced_items(IMPL_CAPABILITIES - {"sampling", "stream"}, "hf", model="tiny", cuda=False)
    assert "transform.top_p" not in greedy_only and "transform.logit_bias" in greedy_only
    assert not any(k.startswith("held.") for k in greedy_only) and "beam.width.2" not in greedy_only


def test_one_run_counts_its_config_its_actions_and_its_finish() -> None:
    config = CaseConfig(model="tiny", prompt_ids=(1, 72), eos_ids=(0, 2, 40), min_new_tokens=1, stop_strings=("ab", "abc"),
                        policy={"family": "multinomial", "order": "hf", "transforms": [{"name": "min_p", "p": 1.0},
                                                                                      {"name": "top_p", "p": 0.99}, {"name": "typical", "p": 0.99}]})
    items = config_items(config)
    assert {"eos.several", "eos.equals_pad", "eos.several_with_min_new_tokens", "stop.several", "stop.shared_prefix",
            "stop.nested", "transform.min_p@hf", "edge.min_p.p.max", "edge.typical.p.max", "field.stop_strings"} <= items
    assert "edge.top_p.p.max" not in items  # an inclusive bound counts only when drawn exactly
    assert "edge.min_p.p.min" not in items and "field.cache" not in items

    def tb(ids):
        return [bytes([i - 3]) if 3 <= i < 259 else b"" for i in ids]

    obs = [types.SimpleNamespace(finish_reason=None, triggers=(), output_ids=(100,), chunks=({"byte_end": 0},)),
           types.SimpleNamespace(finish_reason="cancelled", triggers=("cancelled",), output_ids=(100,), chunks=())]
    held = run_items(config.evolve(stream=True, stop_strings=("ax",)), [{"op": "step"}, {"op": "cancel", "kind": "cancelled"}], obs, tb)
    assert {"action.step", "action.cancel", "action.cancel.cancelled", "finish.cancelled", "trigger.cancelled",
            "held.cancelled.stop_prefix"} <= held  # 'a' (100 - 3 = 97) was held back as a prefix of 'ax'
    assert "held.cancelled.utf8_tail" not in held
    coverage = Coverage()
    coverage.add_run(held)
    coverage.add_run(held)
    assert coverage.counts["finish.cancelled"] == 2 and coverage.runs == 2
    assert "finish.eos" in coverage.missing({"finish.eos": "finish", "finish.cancelled": "finish"})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case_configs("tiny", "none", frozenset(IMPL_CAPABILITIES - {"sampling", "stop_strings", "stream", "structured"})))
def test_draws_stay_within_the_declared_capabilities(config: CaseConfig) -> None:
    assert config.policy["family"] == "greedy" and not config.stop_strings and not config.stream
    assert config.structured == "none" and config.cache == "none" and config.prefill_chunk is None
    assert config.final_cache != "all_outputs"


def test_the_sweep_has_a_case_per_transform_order_and_edge() -> None:
    ids = {c.id for c in sweep_cases("tiny")}
    for key, group in declared_items().items():
        if group in ("transform@order", "edge", "held"):
            assert f"sweep.{key}" in ids, key


def _session(args, keyword="", items=("checks/test_gate.py",)):
    option = types.SimpleNamespace(keyword=keyword, markexpr="", deselect=None, lf=False, failedfirst=False)
    config = types.SimpleNamespace(option=option, args=list(args), getoption=lambda name: None)
    return types.SimpleNamespace(config=config, items=[types.SimpleNamespace(fspath=str(CHECKS.parent / i)) for i in items])


def test_only_a_whole_gate_session_is_a_full_run() -> None:
    assert full_gate_run(_session([str(CHECKS)]))
    assert full_gate_run(_session([str(CHECKS.parent)]))  # a directory above checks/
    assert not full_gate_run(_session([str(CHECKS / "test_gate.py")]))  # one file
    assert not full_gate_run(_session([f"{CHECKS / 'test_gate.py'}::test_case"]))
    assert not full_gate_run(_session([str(CHECKS)], keyword="sweep"))  # -k
    assert not full_gate_run(_session([str(CHECKS.parent / "tests")], items=("tests/test_x.py",)))
