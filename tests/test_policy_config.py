"""M3.8 0x0B policy configuration: JSON parsing, typed rejections with paths, presets, schema."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from decodespec.spec.errors import ERROR_CODES, Rejection
from decodespec.spec.policy import (
    CATALOG,
    POLICY_JSON_SCHEMA,
    PRESET_ORDERS,
    EmptySupport,
    Family,
    Order,
    PolicyConfig,
    policy_config_from_json,
)

AUTOMATON = {"initial": "start", "transitions": {"start": {"7": "mid", "2": "start"}, "mid": {"2": "start"}}}

#: One example of every transform, with non-default parameters.
ALL_TRANSFORMS = [
    {"name": "constraint", "automaton": AUTOMATON},
    {"name": "min_new_tokens"},
    {"name": "bad_words", "sequences": [[4, 5], [9]], "history": "output"},
    {"name": "no_repeat_ngram", "n": 3},
    {"name": "repetition_penalty", "penalty": 1.3},
    {"name": "frequency_penalty", "penalty": 0.5},
    {"name": "presence_penalty", "penalty": -0.25},
    {"name": "logit_bias", "bias": {"3": -2.5, "11": 4}},
    {"name": "temperature", "temperature": 0.7},
    {"name": "top_n_sigma", "n": 1.5},
    {"name": "top_k", "k": 40},
    {"name": "top_p", "p": 0.9},
    {"name": "min_p", "p": 0.05},
    {"name": "typical", "p": 0.8},
    {"name": "epsilon", "epsilon": 3e-4},
    {"name": "eta", "epsilon": 2e-3},
    {"name": "mirostat_v2", "tau": 5.0, "eta": 0.1},
]

VALID = [
    {"family": "greedy"},
    {"family": "greedy", "transforms": [{"name": "repetition_penalty", "penalty": 1.2}]},
    {"family": "multinomial", "order": "explicit", "transforms": ALL_TRANSFORMS},
    {"family": "multinomial", "order": "default", "transforms": ALL_TRANSFORMS},
    {"family": "multinomial", "order": "hf", "transforms": [{"name": "top_p", "p": 0.9}, {"name": "temperature", "temperature": 0.7}, {"name": "eta", "epsilon": 0.01}]},
    {"family": "multinomial", "order": "vllm", "transforms": [{"name": "top_k", "k": 5}, {"name": "min_p", "p": 0.1}, {"name": "frequency_penalty", "penalty": 1.0}]},
    {"family": "multinomial", "order": "llama.cpp", "transforms": [{"name": "temperature", "temperature": 0.8}, {"name": "top_k", "k": 40}, {"name": "top_n_sigma", "n": 1.0}]},
    {"family": "multinomial", "order": "llama.cpp", "transforms": [{"name": "mirostat_v2", "tau": 5.0, "eta": 0.1}, {"name": "temperature", "temperature": 0.8}]},
    {"family": "beam", "num_beams": 4, "length_penalty": 0.6, "early_stopping": "never", "empty_support": "fallback_eos", "tie_rule": "lowest_id"},
]

#: (object, code, path) for rejections that the JSON Schema also rejects.
INVALID_BOTH = [
    ({}, "policy.missing_field", "$.policy.family"),
    ([], "policy.invalid_type", "$.policy"),
    ({"family": "sample"}, "policy.invalid_parameter", "$.policy.family"),
    ({"family": "greedy", "extra": 1}, "policy.unknown_field", "$.policy.extra"),
    ({"family": "greedy", "order": "sglang"}, "policy.invalid_parameter", "$.policy.order"),
    ({"family": "greedy", "tie_rule": "highest_id"}, "policy.invalid_parameter", "$.policy.tie_rule"),
    ({"family": "beam", "num_beams": 0}, "policy.invalid_parameter", "$.policy.num_beams"),
    ({"family": "beam", "num_beams": True}, "policy.invalid_type", "$.policy.num_beams"),
    ({"family": "multinomial", "transforms": {}}, "policy.invalid_type", "$.policy.transforms"),
    ({"family": "multinomial", "transforms": [{"name": "top_q"}]}, "policy.unknown_transform", "$.policy.transforms[0].name"),
    ({"family": "multinomial", "transforms": [{"k": 3}]}, "policy.missing_field", "$.policy.transforms[0].name"),
    ({"family": "multinomial", "transforms": [{"name": "top_k"}]}, "policy.missing_field", "$.policy.transforms[0].k"),
    ({"family": "multinomial", "transforms": [{"name": "top_k", "k": 3, "p": 0.5}]}, "policy.unknown_field", "$.policy.transforms[0].p"),
    ({"family": "multinomial", "transforms": [{"name": "top_k", "k": 0}]}, "policy.invalid_parameter", "$.policy.transforms[0].k"),
    ({"family": "multinomial", "transforms": [{"name": "top_k", "k": 2.5}]}, "policy.invalid_type", "$.policy.transforms[0].k"),
    ({"family": "multinomial", "transforms": [{"name": "top_p", "p": 0}]}, "policy.invalid_parameter", "$.policy.transforms[0].p"),
    ({"family": "multinomial", "transforms": [{"name": "top_p", "p": 1.01}]}, "policy.invalid_parameter", "$.policy.transforms[0].p"),
    ({"family": "multinomial", "transforms": [{"name": "top_p", "p": "0.9"}]}, "policy.invalid_type", "$.policy.transforms[0].p"),
    ({"family": "multinomial", "transforms": [{"name": "temperature", "temperature": -0.1}]}, "policy.invalid_parameter", "$.policy.transforms[0].temperature"),
    ({"family": "multinomial", "transforms": [{"name": "typical", "p": 1.0}]}, "policy.invalid_parameter", "$.policy.transforms[0].p"),
    ({"family": "multinomial", "transforms": [{"name": "repetition_penalty", "penalty": 0}]}, "policy.invalid_parameter", "$.policy.transforms[0].penalty"),
    ({"family": "multinomial", "transforms": [{"name": "repetition_penalty", "penalty": 1.2, "history": "prompt"}]}, "policy.invalid_parameter", "$.policy.transforms[0].history"),
    ({"family": "multinomial", "transforms": [{"name": "frequency_penalty", "penalty": 2.5}]}, "policy.invalid_parameter", "$.policy.transforms[0].penalty"),
    ({"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {}}]}, "policy.invalid_parameter", "$.policy.transforms[0].bias"),
    ({"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {"-3": 1.0}}]}, "policy.invalid_parameter", "$.policy.transforms[0].bias.-3"),
    ({"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {"03": 1.0}}]}, "policy.invalid_parameter", "$.policy.transforms[0].bias.03"),
    ({"family": "multinomial", "transforms": [{"name": "logit_bias", "bias": {"3": "x"}}]}, "policy.invalid_type", "$.policy.transforms[0].bias.3"),
    ({"family": "multinomial", "transforms": [{"name": "bad_words", "sequences": []}]}, "policy.invalid_parameter", "$.policy.transforms[0].sequences"),
    ({"family": "multinomial", "transforms": [{"name": "bad_words", "sequences": [[1, -2]]}]}, "policy.invalid_parameter", "$.policy.transforms[0].sequences[0][1]"),
    ({"family": "multinomial", "transforms": [{"name": "bad_words", "sequences": [[]]}]}, "policy.invalid_parameter", "$.policy.transforms[0].sequences[0]"),
    ({"family": "multinomial", "transforms": [{"name": "constraint", "automaton": {"initial": "a"}}]}, "policy.missing_field", "$.policy.transforms[0].automaton.transitions"),
    ({"family": "multinomial", "transforms": [{"name": "constraint", "automaton": {"initial": "a", "transitions": {"a": {"x": "a"}}}}]}, "policy.invalid_parameter", "$.policy.transforms[0].automaton.transitions.a.x"),
]

#: Rejections only the function can see (cross-field rules).
INVALID_FUNCTION_ONLY = [
    ({"family": "greedy", "transforms": [{"name": "temperature", "temperature": 0.7}]}, "policy.warper_requires_sampling", "$.policy.transforms[0].name"),
    ({"family": "beam", "num_beams": 2, "transforms": [{"name": "top_k", "k": 5}]}, "policy.warper_requires_sampling", "$.policy.transforms[0].name"),
    ({"family": "greedy", "num_beams": 4}, "policy.invalid_parameter", "$.policy.num_beams"),
    ({"family": "multinomial", "early_stopping": "true"}, "policy.invalid_parameter", "$.policy.early_stopping"),
    ({"family": "multinomial", "order": "vllm", "transforms": [{"name": "typical", "p": 0.5}]}, "policy.transform_not_in_preset", "$.policy.transforms[0].name"),
    ({"family": "multinomial", "order": "hf", "transforms": [{"name": "top_k", "k": 1}, {"name": "mirostat_v2", "tau": 3.0, "eta": 0.1}]}, "policy.transform_not_in_preset", "$.policy.transforms[1].name"),
    ({"family": "multinomial", "order": "llama.cpp", "transforms": [{"name": "mirostat_v2", "tau": 3.0, "eta": 0.1}, {"name": "top_k", "k": 3}]}, "policy.transform_not_in_preset", "$.policy.transforms[1].name"),
    ({"family": "multinomial", "order": "llama.cpp", "transforms": [{"name": "min_new_tokens"}]}, "policy.transform_not_in_preset", "$.policy.transforms[0].name"),
    ({"family": "multinomial", "order": "default", "transforms": [{"name": "top_k", "k": 3}, {"name": "top_k", "k": 5}]}, "policy.duplicate_transform", "$.policy.transforms[1]"),
    ({"family": "multinomial", "order": "explicit", "transforms": [{"name": "mirostat_v2", "tau": 3.0, "eta": 0.1}, {"name": "mirostat_v2", "tau": 3.0, "eta": 0.1}]}, "policy.duplicate_transform", "$.policy.transforms[1]"),
    ({"family": "multinomial", "transforms": [{"name": "constraint", "automaton": {"initial": "z", "transitions": {"a": {}}}}]}, "policy.invalid_automaton", "$.policy.transforms[0].automaton.initial"),
    ({"family": "multinomial", "transforms": [{"name": "constraint", "automaton": {"initial": "a", "transitions": {"a": {"4": "b"}}}}]}, "policy.invalid_automaton", "$.policy.transforms[0].automaton.transitions.a.4"),
]


@pytest.mark.parametrize("obj", VALID, ids=lambda o: str(o)[:60])
def test_valid_configs_round_trip_and_satisfy_the_schema(obj):
    config = policy_config_from_json(copy.deepcopy(obj))
    assert isinstance(config, PolicyConfig)
    assert policy_config_from_json(config.to_json()) == config
    jsonschema.validate(obj, POLICY_JSON_SCHEMA)
    jsonschema.validate(config.to_json(), POLICY_JSON_SCHEMA)


@pytest.mark.parametrize("obj,code,path", INVALID_BOTH, ids=lambda o: str(o)[:50])
def test_structural_rejections_are_typed_and_the_schema_agrees(obj, code, path):
    with pytest.raises(Rejection) as info:
        policy_config_from_json(obj)
    assert (info.value.code, info.value.path) == (code, path)
    assert code in ERROR_CODES
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, POLICY_JSON_SCHEMA)


@pytest.mark.parametrize("obj,code,path", INVALID_FUNCTION_ONLY, ids=lambda o: str(o)[:50])
def test_cross_field_rejections_are_typed(obj, code, path):
    with pytest.raises(Rejection) as info:
        policy_config_from_json(obj)
    assert (info.value.code, info.value.path) == (code, path)


def test_schema_is_valid_draft_2020_12_and_names_every_transform():
    jsonschema.Draft202012Validator.check_schema(POLICY_JSON_SCHEMA)
    names = {s["properties"]["name"]["const"] for s in POLICY_JSON_SCHEMA["properties"]["transforms"]["items"]["oneOf"]}
    assert names == set(CATALOG)


def test_error_path_uses_the_enclosing_document_prefix():
    with pytest.raises(Rejection) as info:
        policy_config_from_json({"family": "multinomial", "transforms": [{"name": "top_k", "k": -1}]}, path="$.request.policy")
    assert info.value.path == "$.request.policy.transforms[0].k"


def test_defaults_are_filled_and_recorded():
    config = policy_config_from_json({"family": "multinomial", "transforms": [{"name": "repetition_penalty", "penalty": 1.1}]})
    assert config.order is Order.DEFAULT and config.empty_support is EmptySupport.RAISE
    assert config.transforms[0].get("history") == "prompt_and_output"
    assert config.preset == "default" and config.family is Family.MULTINOMIAL


@pytest.mark.parametrize("order", [Order.DEFAULT, Order.HF, Order.VLLM, Order.LLAMA_CPP])
def test_presets_put_transforms_in_the_documented_order_whatever_the_list_order(order):
    names = [n for n in PRESET_ORDERS[order]]
    objs = {t["name"]: t for t in ALL_TRANSFORMS}
    shuffled = [objs[n] for n in reversed(names)]
    config = policy_config_from_json({"family": "multinomial", "order": order.value, "transforms": shuffled})
    assert [t.name for t in config.transforms] == names


def test_peer_orders_differ_where_the_survey_says():
    """Temperature is first among warpers in HF and vLLM, last in llama.cpp; min-p before top-k in vLLM only."""
    objs = [{"name": "temperature", "temperature": 0.5}, {"name": "top_k", "k": 3}, {"name": "min_p", "p": 0.1}, {"name": "top_p", "p": 0.8}]
    order_of = {o: [t.name for t in policy_config_from_json({"family": "multinomial", "order": o, "transforms": objs}).transforms] for o in ("hf", "vllm", "llama.cpp", "default")}
    assert order_of["hf"] == ["temperature", "top_k", "top_p", "min_p"]
    assert order_of["vllm"] == ["temperature", "min_p", "top_k", "top_p"]
    assert order_of["llama.cpp"] == ["top_k", "top_p", "min_p", "temperature"]
    assert order_of["default"] == ["temperature", "top_k", "top_p", "min_p"]


def test_explicit_order_keeps_the_list_and_allows_repeating_stateless_transforms():
    objs = [{"name": "top_p", "p": 0.5}, {"name": "temperature", "temperature": 2.0}, {"name": "top_p", "p": 0.9}]
    config = policy_config_from_json({"family": "multinomial", "order": "explicit", "transforms": objs})
    assert [t.to_json() for t in config.transforms] == [{"name": "top_p", "p": 0.5}, {"name": "temperature", "temperature": 2.0}, {"name": "top_p", "p": 0.9}]


def test_llama_cpp_with_mirostat_uses_the_mirostat_chain():
    config = policy_config_from_json({"family": "multinomial", "order": "llama.cpp", "transforms": [{"name": "mirostat_v2", "tau": 5.0, "eta": 0.1}, {"name": "temperature", "temperature": 0.8}, {"name": "logit_bias", "bias": {"1": -1}}]})
    assert [t.name for t in config.transforms] == ["logit_bias", "temperature", "mirostat_v2"]


def test_catalog_parameters_have_descriptions():
    for info in CATALOG.values():
        for p in info.params:
            assert p.description, (info.name, p.name)
