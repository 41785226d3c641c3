"""The gate's case configs build ``numinens.request.v1`` envelopes (issue 17 item 2).

:meth:`CaseConfig.envelope` maps a case onto the envelope's planes; the lock step's spec side is
composed from that envelope after :func:`~decodespec.spec.envelope.validate_request_envelope`
admits it (:func:`decodespec.checks.gate.lockstep.request_for`), so every default it decides with
is the spec's.  Shown here on the configs the gate's own machines draw: every config the gate's
admission lets through is admitted by the envelope, and the envelope carries the case's values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.adapters.impl import load_tokenizer
from decodespec.checks.gate import lockstep
from decodespec.checks.gate.drawing import case_configs
from decodespec.spec.envelope import validate_request_envelope
from decodespec.spec.errors import Rejection
from decodespec.spec.request import context_cap, default_static_capacity

ROOT = Path(__file__).resolve().parents[1]
CAPS = frozenset({"stream", "stop_strings", "structured", "sampling", "prefill_chunk", "cache:none", "cache:dynamic",
                  "cache:static", "snapshot", "repair", "final_cache:all_outputs"})


@pytest.fixture(scope="module")
def facts():
    reference = lockstep.reference_for("tiny")
    return lockstep.model_facts("tiny", reference, load_tokenizer("tiny"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), cache=st.sampled_from(["none", "dynamic", "static"]))
def test_every_config_the_gate_admits_is_an_admitted_envelope(facts, data, cache):
    config = data.draw(case_configs("tiny", cache, CAPS))
    if lockstep.admission_refusal(config, facts.vocab_size, facts.window) is not None:
        return
    admitted = lockstep.admitted_envelope(config, facts)
    term, out, rt = admitted.termination, admitted.output, admitted.runtime
    assert admitted.valid_input_ids == config.prompt_ids
    assert (term.max_new_tokens, term.min_new_tokens, term.eos_ids) == (config.max_new_tokens, config.min_new_tokens, config.eos_ids)
    assert term.ignore_eos == (not set(facts.eos_ids) <= set(config.eos_ids))
    assert (term.stop_strings, out.include_stop_str, out.alignment, out.stream) == (
        config.stop_strings, config.include_stop_str, config.alignment, config.stream)
    assert rt.cache_family == config.cache and rt.max_retries == config.max_retries
    request = lockstep.request_for(config, facts)
    p = request.params
    # the spec's defaults, computed by the spec from the envelope
    capacity = None if cache != "static" else (config.static_capacity or default_static_capacity(config.prompt_len, config.max_new_tokens, facts.window))
    assert p.static_capacity == capacity
    assert p.context_cap == context_cap(facts.window, config.context_cap, capacity)
    # keyed by the case's identity and seed, as the runtime keys its RNG
    assert (p.identity, request.seed) == (config.identity(), config.seed)


def test_a_case_without_eos_runs_under_ignore_eos(facts):
    config = CaseConfig(model="tiny", prompt_ids=(5, 6, 7), max_new_tokens=4)
    env = config.envelope(facts)
    assert env["termination"]["eos_ids"] == [] and env["termination"]["ignore_eos"] is True
    assert facts.eos_ids and env["text_interface"]["eos_ids"] == list(facts.eos_ids)
    # without the flag the envelope refuses it (the tokenizer's EOS left out of the stop set)
    env["termination"]["ignore_eos"] = False
    import json

    with pytest.raises(Rejection) as refused:
        validate_request_envelope(json.dumps(env).encode())
    assert refused.value.code == "envelope.special_ids_disagree"
    stopping = config.evolve(eos_ids=facts.eos_ids)
    assert stopping.envelope(facts)["termination"]["ignore_eos"] is False


def test_the_lock_step_builds_no_request_parameters_itself():
    """The gate's spec side never constructs ``RequestParams``: they come from the envelope (``params_from_request``)."""
    tree = ast.parse((ROOT / "checks" / "gate" / "lockstep.py").read_text())
    built = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) in
             ("RequestParams", "compose")]
    assert built == []
