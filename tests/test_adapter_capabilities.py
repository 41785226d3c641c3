"""Capability names derived from the schemas, and what the gate does with them (checks/adapters/features.py).

Every policy transform and every envelope feature has a capability name; a case, a corpus replay
and a machine never send a config that needs an undeclared one (a skip naming the missing
capabilities); a config the runtime refuses with ``adapter.unsupported`` is a skip with the
runtime's reason, never a failure.  Exercised in process and through a stdio server that
declares less than our runtime.

Source: issue 22 item 3; M3.10 "Immutable request envelope and canonical identity"; M3.8 0x0B.
"""

from __future__ import annotations

import functools
import sys
import textwrap

import attrs
import pytest

from decodespec.checks.adapters import ADAPTER_UNSUPPORTED, CAPABILITIES, CaseConfig, config_capabilities, features
from decodespec.checks.adapters.impl import IMPL_CAPABILITIES, ImplAdapter
from decodespec.checks.adapters.wire import start_response
from decodespec.checks.gate.cases import Case, cases_for, run_case
from decodespec.checks.gate.coverage import SCHEMA_ENUMS, schema_enum
from decodespec.checks.modelcheck.traces import open_runtime, record, replay
from decodespec.spec.envelope import request_schema
from decodespec.spec.errors import Rejection
from decodespec.spec.policy.config import CATALOG, Order

#: The names protocol version 1 had; every one stays valid.
FIRST_NAMES = {"cache:none", "cache:dynamic", "cache:static", "prefill_chunk", "decide_commit", "inflight", "faults", "snapshot",
               "sampling", "beam", "stream", "logits", "policy_rows", "cache_probe", "reuse", "stop_strings", "structured",
               "decode_kernel:native"}


def test_every_transform_and_envelope_feature_has_a_name() -> None:
    """``transform:<name>`` per catalog transform; ``<section>.<field>[:<value>]`` per envelope choice; the first names kept."""
    assert FIRST_NAMES <= CAPABILITIES
    assert {f"transform:{name}" for name in CATALOG} <= CAPABILITIES
    for field, path in SCHEMA_ENUMS.items():
        default = attrs.fields_dict(CaseConfig)[field].default
        for value in schema_enum(path):
            name = features.feature_of(*path, value)
            assert (name is None) == (value == default and field != "cache"), (field, value)
            assert name is None or name in CAPABILITIES
    for order in Order:
        assert (features.policy_feature("order", order.value) is None) == (order is Order.DEFAULT)
    for name in ("output.include_stop_str", "termination.min_new_tokens", "termination.max_total_tokens", "runtime.max_retries",
                 "runtime.static_capacity", "policy.empty_support:fallback_eos", "position_visibility.mode:prefix_lm"):
        assert name in CAPABILITIES, name


def test_the_names_follow_the_schema(monkeypatch) -> None:
    """A property added to the envelope schema gets its name with no list to edit (``termination.timeout_ms``, say)."""
    schema = request_schema()
    schema["properties"]["termination"]["properties"]["timeout_ms"] = {"type": "integer", "minimum": 1}
    schema["properties"]["output"]["properties"]["format"] = {"enum": ["plain", "chat"], "default": "plain"}
    monkeypatch.setattr(features, "request_schema", lambda: schema)
    for cached in (features._envelope_features, features.feature_capabilities):
        cached.cache_clear()
    try:
        names = features.feature_capabilities()
        assert names["termination.timeout_ms"] == "termination.timeout_ms" and "output.format:chat" in names
        assert "output.format:plain" not in names  # the schema default is the baseline
    finally:
        monkeypatch.undo()
        for cached in (features._envelope_features, features.feature_capabilities):
            cached.cache_clear()


def test_a_config_needs_one_name_per_feature_it_sets() -> None:
    base = CaseConfig(model="tiny", prompt_ids=(1, 2))
    assert config_capabilities(base) == {"cache:dynamic"}
    bias = base.evolve(policy={"family": "greedy", "transforms": [{"name": "logit_bias", "bias": {"2": 100.0}}]}, stream=True)
    assert config_capabilities(bias) == {"cache:dynamic", "transform:logit_bias", "stream"}
    wide = base.evolve(cache="static", static_capacity=8, alignment="span", stop_strings=["a"], include_stop_str=True,
                       min_new_tokens=1, context_cap=6, max_retries=1, dtype="float16", attention="eager",
                       zero_new_tokens="prefill_only", final_cache="none",
                       policy={"family": "multinomial", "order": "vllm", "empty_support": "fallback_eos",
                               "transforms": [{"name": "top_p", "p": 0.9}]})
    assert config_capabilities(wide) == {
        "cache:static", "runtime.static_capacity", "output.alignment:span", "stop_strings", "output.include_stop_str",
        "termination.min_new_tokens", "termination.max_total_tokens", "runtime.max_retries", "runtime.compute_dtype:float16",
        "runtime.attention:eager", "termination.zero_new_tokens:prefill_only", "output.final_cache:none", "sampling",
        "policy.order:vllm", "policy.empty_support:fallback_eos", "transform:top_p"}


def test_declarations_are_within_the_names_and_impl_declares_what_the_gate_sends() -> None:
    assert IMPL_CAPABILITIES <= CAPABILITIES
    assert features.sendable_features() - IMPL_CAPABILITIES == features.names_at(
        "policy.family", "policy.num_beams", "policy.length_penalty", "policy.early_stopping") - {"sampling"}
    start_response("x", "1", {"transform:logit_bias", "output.alignment:text"})  # the handshake takes the new names
    with pytest.raises(Rejection) as exc:
        start_response("x", "1", {"transform:no_such_transform"})
    assert exc.value.code == "adapter.protocol"


class _Limited:
    """Our runtime declaring less (``without``), optionally refusing configs it declares (``refuse``), recording every reset."""

    def __init__(self, without: set[str], refuse: set[str] = frozenset()):
        self.inner = ImplAdapter()
        self.without, self.refuse = set(without), set(refuse)
        self.name = "impl"
        self.configs: list[CaseConfig] = []
        self.refusals = 0

    def capabilities(self) -> frozenset[str]:
        return self.inner.capabilities() - self.without

    def reset(self, config: CaseConfig) -> None:
        self.configs.append(config)
        need = config_capabilities(config)
        if need - self.capabilities() or need & self.refuse:
            self.inner.runner = None
            self.refusals += 1
            raise Rejection(ADAPTER_UNSUPPORTED, f"this runtime cannot run {sorted(need & (self.refuse | self.without))}", "$")
        self.inner.reset(config)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _case(case_id: str) -> Case:
    return next(c for c in cases_for("tiny") if c.id == case_id)


@pytest.mark.parametrize("case_id", ["boundary.immediate_eos", "boundary.min_new_tokens_blocks_eos"])
def test_a_case_needing_an_undeclared_feature_is_a_skip_naming_it(case_id: str) -> None:
    """Greedy with a logit bias (and a stream) on a runtime without ``transform:logit_bias``: skipped, nothing sent."""
    limited = _Limited({"transform:logit_bias", "stream"})
    result = run_case(_case(case_id), "impl", adapter_factory=lambda: limited)
    assert result.result == "skip" and "transform:logit_bias" in result.reason
    assert limited.configs == []


def test_an_honest_refusal_is_a_skip_with_the_runtimes_reason() -> None:
    """The runtime declares logit_bias but refuses this config with adapter.unsupported: a skip, never a STATE failure."""
    limited = _Limited(set(), refuse={"transform:logit_bias"})
    result = run_case(_case("boundary.min_new_tokens_blocks_eos"), "impl", adapter_factory=lambda: limited)
    assert result.result == "skip", result
    assert "adapter.unsupported" in result.reason and "transform:logit_bias" in result.reason
    # the same runtime without the refusal passes the case: the skip came from the refusal alone
    assert run_case(_case("boundary.min_new_tokens_blocks_eos"), "impl").result == "pass"


def test_a_replay_of_a_refused_config_reports_the_refusal(tiny_model) -> None:
    config = CaseConfig(model="tiny", prompt_ids=(72, 105), max_new_tokens=2, eos_ids=[2],
                        policy={"family": "greedy", "transforms": [{"name": "logit_bias", "bias": {"2": -5.0}}]})
    trace = record("impl", config, [{"op": "run"}])
    assert trace["#meta"]["verdict"]["result"] == "passed"
    result = replay(trace, adapter=_Limited(set(), refuse={"transform:logit_bias"}))
    assert not result.reproduced and "transform:logit_bias" in result.unsupported and result.to_json()["unsupported"]
    assert replay(trace, adapter=ImplAdapter()).unsupported is None


def test_machines_never_send_an_undeclared_config() -> None:
    """A runtime without stream, logit bias, text alignment, min_new_tokens or the vllm order gets none of them."""
    from decodespec.checks.gate.machines import run_machine

    without = {"stream", "transform:logit_bias", "transform:constraint", "output.alignment:text", "termination.min_new_tokens",
               "policy.order:vllm", "runtime.max_retries", "termination.max_total_tokens"}
    made: list[_Limited] = []

    def factory() -> _Limited:
        made.append(_Limited(without))
        return made[-1]

    run_machine("impl", "tiny", "dynamic", adapter_factory=functools.partial(factory), max_examples=12, stateful_step_count=4)
    configs = [c for a in made for c in a.configs]
    assert configs
    for config in configs:
        assert not config_capabilities(config) & without, config
        assert not config.stream and config.alignment != "text" and config.min_new_tokens == 0 and config.context_cap is None


def test_a_machine_example_refused_as_unsupported_is_a_skip() -> None:
    """The runtime declares everything but refuses every sampled config: the machine passes (each such example a skip)."""
    from decodespec.checks.gate.machines import run_machine

    limited: list[_Limited] = []

    def factory() -> _Limited:
        limited.append(_Limited(set(), refuse={"sampling", "transform:top_k", "transform:temperature"}))
        return limited[-1]

    run_machine("impl", "tiny", "dynamic", adapter_factory=functools.partial(factory), max_examples=12, stateful_step_count=3)
    assert sum(a.refusals for a in limited) >= 1


SERVER = """
    import sys
    from decodespec.checks.adapters import stdio_server
    from decodespec.checks.adapters import impl

    without = set(sys.argv[1].split(","))
    full = impl.ImplAdapter.capabilities
    impl.ImplAdapter.capabilities = lambda self: full(self) - without
    sys.exit(stdio_server.main([]))
"""


def test_a_stdio_runtime_that_declares_less_skips_what_it_lacks(tmp_path) -> None:
    """Through the wire: the handshake's names decide; the logit-bias cases skip, a plain one passes."""
    script = tmp_path / "limited_server.py"
    script.write_text(textwrap.dedent(SERVER), encoding="utf-8")
    runtime = f"stdio:{sys.executable} {script} transform:logit_bias,stream"
    adapter = open_runtime(runtime, "tiny")
    try:
        assert "transform:logit_bias" not in adapter.capabilities() and "transform:top_k" in adapter.capabilities()
    finally:
        adapter.close()
    for case_id in ("boundary.immediate_eos", "boundary.min_new_tokens_blocks_eos"):
        result = run_case(_case(case_id), runtime)
        assert result.result == "skip" and "transform:logit_bias" in result.reason, result
    assert run_case(_case("boundary.one_token_prompt"), runtime).result == "pass"


def test_an_adapter_refuses_an_undeclared_feature_at_its_field() -> None:
    """The shared reset check (features.undeclared): adapter.unsupported naming every missing capability, at the first field."""
    config = CaseConfig(model="tiny", prompt_ids=(1,), alignment="text",
                        policy={"family": "greedy", "transforms": [{"name": "top_k", "k": 2}, {"name": "logit_bias", "bias": {"1": 1.0}}]})
    refusal = features.undeclared(config, {"cache:dynamic", "transform:top_k"}, "mine")
    assert refusal.code == ADAPTER_UNSUPPORTED and refusal.path == "$.alignment"
    assert "['output.alignment:text', 'transform:logit_bias']" in refusal.message
    assert features.undeclared(config, IMPL_CAPABILITIES, "impl") is None
    only_bias = features.undeclared(config.evolve(alignment="token"), {"cache:dynamic", "transform:top_k"}, "mine")
    assert only_bias.path == "$.policy.transforms[1]"


def test_coverage_enforces_only_declared_features() -> None:
    """A runtime without ``transform:logit_bias`` or ``output.alignment:text`` is not asked to exercise them."""
    from decodespec.checks.gate.coverage import enforced_items

    full = enforced_items(IMPL_CAPABILITIES, cuda=False)
    less = enforced_items(IMPL_CAPABILITIES - {"transform:logit_bias", "output.alignment:text", "policy.order:vllm"}, cuda=False)
    assert {"transform.logit_bias", "transform.logit_bias@hf", "enum.alignment.text", "transform.top_k@vllm"} <= set(full)
    assert set(full) - set(less) == {k for k in full if k.startswith("transform.logit_bias") or k.endswith("@vllm")
                                     or k in ("enum.alignment.text", "enum.policy.order.vllm")}


def test_every_case_only_feature_is_required_by_a_case() -> None:
    """features.CASE_ONLY_FEATURES (sent through a dedicated case, not a CaseConfig field) each have such a case."""
    required = {name for model in ("tiny", "smollm2") for case in cases_for(model) for name in case.requires}
    assert features.CASE_ONLY_FEATURES and features.CASE_ONLY_FEATURES <= required
    assert not features.CASE_ONLY_FEATURES & features.sendable_features()
