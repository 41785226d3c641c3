"""The request envelope numinens.request.v1 (M3.10 "Immutable request envelope and canonical identity").

Every registered ``envelope.*`` code is triggered by a case below; structural cases are also
rejected by plain ``jsonschema`` against the published schema file; examples validate; the
identity is invariant under key order, whitespace, set order, omitted defaults and annotations,
and changes with every identity-bearing field.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import rfc8785
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec import envelope as E
from decodespec.spec.errors import ERROR_CODES, DecodeSpecError, Rejection, ResourceLimit
from decodespec.spec.state import params_from_request

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
TINY = json.loads((EXAMPLES / "tiny.request.json").read_text())


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def tiny() -> dict[str, Any]:
    return copy.deepcopy(TINY)


def edit(path: str, value: Any = None, *, delete: bool = False) -> Callable[[dict], dict]:
    """A mutation that sets (or deletes) the dotted ``path`` of a copy of the tiny example."""

    def apply(env: dict) -> dict:
        keys = path.split(".")
        node = env
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        last: Any = int(keys[-1]) if isinstance(node, list) else keys[-1]
        if delete:
            del node[last]
        else:
            node[last] = value
        return env

    return apply


def chain(*fns: Callable[[dict], dict]) -> Callable[[dict], dict]:
    def apply(env: dict) -> dict:
        for fn in fns:
            env = fn(env)
        return env

    return apply


def reject(raw: bytes) -> DecodeSpecError:
    with pytest.raises(DecodeSpecError) as info:
        E.validate_request_envelope(raw)
    return info.value


# Structural cases: (code, path, mutation).  Plain jsonschema must reject each too.
STRUCTURAL = [
    ("envelope.unknown_field", "$.runtime.device", edit("runtime.device", "cpu")),
    ("envelope.unknown_field", "$.surprise", edit("surprise", 1)),
    ("envelope.missing_field", "$.rng.seed", edit("rng.seed", delete=True)),
    ("envelope.missing_field", "$.output", edit("output", delete=True)),
    ("envelope.type_mismatch", "$.termination.max_new_tokens", edit("termination.max_new_tokens", True)),
    ("envelope.type_mismatch", "$.rng.seed", edit("rng.seed", "42")),
    ("envelope.type_mismatch", "$.prompt.text", edit("prompt.text", None)),
    ("envelope.invalid_value", "$.runtime.cache_family", edit("runtime.cache_family", "paged")),
    ("envelope.invalid_value", "$.schema", edit("schema", "numinens.request.v2")),
    ("envelope.invalid_value", "$.prompt.attention_mask[0]", edit("prompt.attention_mask.0", 2)),
    ("envelope.out_of_range", "$.termination.max_new_tokens", edit("termination.max_new_tokens", -1)),
    ("envelope.out_of_range", "$.rng.seed", edit("rng.seed", 2**53)),
    ("envelope.out_of_range", "$.text_interface.vocab_size", edit("text_interface.vocab_size", E.MAX_VOCAB_SIZE + 1)),
    ("envelope.length_bound", "$.termination.eos_ids", edit("termination.eos_ids", list(range(3, 3 + E.MAX_EOS_IDS + 1)))),
    ("envelope.length_bound", "$.termination.stop_strings[0]", edit("termination.stop_strings", [""])),
    ("envelope.length_bound", "$.artifact.release_id", edit("artifact.release_id", "")),
    ("envelope.length_bound", "$.prompt.input_ids", edit("prompt.input_ids", [3] * (E.MAX_PROMPT_TOKENS + 1))),
    ("envelope.invalid_string", "$.artifact.checkpoint_sha256", edit("artifact.checkpoint_sha256", "sha256:XYZ")),
    ("envelope.invalid_string", "$.annotations", edit("annotations", {"Bad Key": "x"})),
    ("envelope.duplicate_item", "$.termination.eos_ids", edit("termination.eos_ids", [2, 2])),
    ("envelope.unknown_field", "$.policy.transforms[0].extra", edit("policy.transforms.0", {"name": "top_k", "k": 5, "extra": 1})),
    ("envelope.schema_violation", "$.policy.transforms[0]", edit("policy.transforms.0", {"k": 5})),
    ("envelope.invalid_value", "$.policy.transforms[0].name", edit("policy.transforms.0", {"name": "nosuch"})),
    ("envelope.out_of_range", "$.policy.transforms[0].p", edit("policy.transforms.0", {"name": "top_p", "p": 1.5})),
    ("envelope.out_of_range", "$.policy.transforms[0].p", edit("policy.transforms.0", {"name": "min_p", "p": 2})),
    ("envelope.out_of_range", "$.policy.transforms[0].temperature", edit("policy.transforms.0", {"name": "temperature", "temperature": -1})),
    ("envelope.out_of_range", "$.policy.transforms[0].penalty", edit("policy.transforms.0", {"name": "repetition_penalty", "penalty": 0})),
]

# Checks on the raw bytes, before any object is built (not expressible in JSON Schema).
_GOOD = dumps(TINY)


def _sub(old: bytes, new: bytes) -> bytes:
    assert old in _GOOD, old
    return _GOOD.replace(old, new, 1)


RAW = [
    ("envelope.too_large", b" " * (E.MAX_ENVELOPE_BYTES + 1)),
    ("envelope.invalid_utf8", _sub(b'"decodespec-tiny', b'"decodespec\xff-tiny')),
    ("envelope.invalid_utf8", _sub(b'"tiny-model example"', b'"\\ud800"')),
    ("envelope.too_deep", _sub(b'"annotations": {', b'"deep": ' + b"[" * 13 + b"]" * 13 + b', "annotations": {')),
    ("envelope.invalid_json", _GOOD + b" trailing"),
    ("envelope.invalid_json", b"\xef\xbb\xbf" + _GOOD),
    ("envelope.invalid_json", b'{"a": 1' + b"0" * 5000 + b"}"),
    ("envelope.duplicate_key", _sub(b'"seed": 42', b'"seed": 42, "seed": 43')),
    ("envelope.duplicate_key", _sub(b'"name": "temperature"', b'"name": "temperature", "name": "temperature"')),
    ("envelope.non_finite_number", _sub(b'"temperature": 0.7', b'"temperature": NaN')),
    ("envelope.non_finite_number", _sub(b'"temperature": 0.7', b'"temperature": Infinity')),
    ("envelope.non_finite_number", _sub(b'"temperature": 0.7', b'"temperature": 1e999')),
    ("envelope.type_mismatch", _sub(b'"seed": 42', b'"seed": 42.0')),
]

SEMANTIC = [
    ("envelope.prompt_mask_mismatch", "$.prompt.attention_mask", lambda e: edit("prompt.attention_mask", e["prompt"]["attention_mask"][:-1])(e)),
    ("envelope.attention_mask_invalid", "$.prompt.attention_mask[3]", chain(
        edit("prompt.input_ids", [1, 3, 4, 0, 5]), edit("prompt.attention_mask", [1, 1, 1, 0, 1]))),
    ("envelope.padding_invalid", "$.prompt.input_ids[0]", edit("prompt.input_ids.0", 7)),
    ("envelope.padding_invalid", "$.prompt.input_ids[0]", edit("text_interface.pad_id", delete=True)),
    ("envelope.context_exceeded", "$.runtime.static_capacity", edit("runtime.static_capacity", 24)),
    ("envelope.context_exceeded", "$.position_visibility.max_context", edit("position_visibility.max_context", 5)),
    ("envelope.context_exceeded", "$.termination.max_total_tokens", edit("termination.max_total_tokens", 24)),
    ("envelope.too_many_beams", "$.policy.num_beams", edit("policy", {"family": "beam", "num_beams": E.MAX_NUM_BEAMS + 1})),
    ("envelope.empty_prompt", "$.prompt.input_ids", chain(edit("prompt.input_ids", [0, 0]), edit("prompt.attention_mask", [0, 0]))),
    ("envelope.empty_prompt", "$.text_interface.decoder_start_id", chain(
        edit("artifact.architecture", "encoder_decoder"), edit("position_visibility.mode", "encoder_decoder"))),
    ("envelope.token_out_of_vocab", "$.prompt.input_ids[5]", edit("prompt.input_ids.5", 512)),
    ("envelope.token_out_of_vocab", "$.termination.eos_ids[1]", edit("termination.eos_ids", [2, 600])),
    ("envelope.token_out_of_vocab", "$.text_interface.bos_id", edit("text_interface.bos_id", 511 + 1)),
    ("envelope.special_ids_disagree", "$.termination.eos_ids", edit("termination.eos_ids", [5])),
    ("envelope.special_ids_disagree", "$.text_interface.bos_id", edit("termination.eos_ids", [1, 2])),
    ("envelope.min_exceeds_max", "$.termination.min_new_tokens", edit("termination.min_new_tokens", 17)),
    ("envelope.visibility_incompatible", "$.position_visibility.mode", edit("position_visibility.mode", "prefix_lm")),
    ("envelope.visibility_incompatible", "$.position_visibility.prefix_length", edit("position_visibility.prefix_length", 3)),
    ("envelope.cache_abi_incompatible", "$.runtime.cache_abi", edit("runtime.cache_abi", "none")),
    ("envelope.cache_abi_incompatible", "$.runtime.static_capacity", edit("runtime.static_capacity", delete=True)),
    ("envelope.cache_abi_incompatible", "$.runtime.prefill_chunk", chain(
        edit("artifact.architecture", "prefix_lm"), edit("position_visibility.mode", "prefix_lm"),
        edit("position_visibility.prefix_length", 10))),
    ("envelope.output_unimplementable", "$.output.final_cache", edit("runtime.append_repair", False)),
    ("envelope.output_unimplementable", "$.output.stream", edit("policy", {"family": "beam", "num_beams": 2})),
    ("envelope.zero_new_tokens_rejected", "$.termination.max_new_tokens", chain(
        edit("termination.max_new_tokens", 0), edit("termination.min_new_tokens", 0), edit("termination.zero_new_tokens", "reject"))),
]


@pytest.mark.parametrize("code, path, mutate", STRUCTURAL, ids=[f"{c}@{p}" for c, p, _ in STRUCTURAL])
def test_structural_rejections(code: str, path: str, mutate: Callable[[dict], dict]) -> None:
    """Each structural rejection has its stable code and JSON path."""
    err = reject(dumps(mutate(tiny())))
    assert (err.code, err.path) == (code, path), err
    assert isinstance(err, Rejection)


@pytest.mark.parametrize("code, path, mutate", STRUCTURAL, ids=[f"{c}@{p}" for c, p, _ in STRUCTURAL])
def test_structural_rejections_agree_with_plain_jsonschema(code: str, path: str, mutate: Callable[[dict], dict]) -> None:
    """The published schema file alone, with plain jsonschema, rejects every structural case."""
    validator = jsonschema.Draft202012Validator(E.published_schema())
    assert not validator.is_valid(mutate(tiny()))


@pytest.mark.parametrize("code, raw", RAW, ids=[c for c, _ in RAW])
def test_raw_byte_rejections(code: str, raw: bytes) -> None:
    """Size, UTF-8, depth, duplicates, NaN/Infinity and float-as-int are refused on the raw bytes."""
    err = reject(raw)
    assert err.code == code, err
    assert isinstance(err, ResourceLimit) == (ERROR_CODES[code].kind == "resource_limit")


@pytest.mark.parametrize("literal", [b"NaN", b"-Infinity", b"1e999"])
def test_non_finite_number_path_names_the_field(literal: bytes) -> None:
    err = reject(_sub(b'"temperature": 0.7', b'"temperature": ' + literal))
    assert (err.code, err.path) == ("envelope.non_finite_number", "$.policy.transforms[0].temperature")


def test_huge_integer_literal_is_a_clear_error_at_its_field() -> None:
    err = reject(_sub(b'"seed": 42', b'"seed": 4' + b"2" * 5000))
    assert (err.code, err.path) == ("envelope.invalid_json", "$.rng.seed")
    assert "integer literal too large: 5001 digits" in err.message and "set_int_max_str_digits" not in err.message


@pytest.mark.parametrize("transform, text", [
    ({"name": "top_p", "p": 1.5}, "top_p.p = 1.5 is outside its range (0.0, 1.0]"),
    ({"name": "min_p", "p": 2}, "min_p.p = 2 is outside its range [0.0, 1.0]"),
    ({"name": "temperature", "temperature": -1}, "temperature = -1 is outside its range [0.0, inf)"),
    ({"name": "repetition_penalty", "penalty": 0}, "repetition_penalty.penalty = 0 is outside its range (0.0, inf)"),
    ({"name": "top_k", "k": 0}, "top_k.k = 0 is outside its range [1, inf)"),
])
def test_policy_range_errors_name_the_field_and_its_range(transform: dict, text: str) -> None:
    """The transform's ``name`` selects its oneOf branch, so the range error wins over 'not valid under any'."""
    err = reject(dumps(edit("policy.transforms.0", transform)(tiny())))
    assert err.code == "envelope.out_of_range" and err.message == text, err


def test_duplicate_key_path_names_the_nested_key() -> None:
    err = reject(_sub(b'"seed": 42', b'"seed": 42, "seed": 43'))
    assert err.path == "$.rng.seed"


@pytest.mark.parametrize("code, path, mutate", SEMANTIC, ids=[f"{c}@{p}" for c, p, _ in SEMANTIC])
def test_semantic_rejections(code: str, path: str, mutate: Callable[[dict], dict]) -> None:
    """Each semantic rejection has its stable code and JSON path (structurally valid input)."""
    env = mutate(tiny())
    jsonschema.Draft202012Validator(E.published_schema()).validate(env)  # the schema alone accepts it
    err = reject(dumps(env))
    assert (err.code, err.path) == (code, path), err


def test_every_envelope_code_is_triggered_by_a_case() -> None:
    registered = {c for c in ERROR_CODES if c.startswith("envelope.")}
    covered = {c for c, *_ in STRUCTURAL} | {c for c, _ in RAW} | {c for c, *_ in SEMANTIC}
    assert registered == covered


def test_policy_and_stop_codes_propagate_with_envelope_paths() -> None:
    """The M3.8 policy check and the stop-string bounds keep their own codes; paths point into the envelope."""
    twice = edit("policy.transforms", [{"name": "temperature", "temperature": 0.7}, {"name": "temperature", "temperature": 0.9}])
    err = reject(dumps(twice(tiny())))
    assert err.code == "policy.duplicate_transform" and err.path.startswith("$.policy.transforms["), err
    err = reject(dumps(edit("policy.transforms.1.k", 0)(tiny())))  # a range the schema states: structural
    assert (err.code, err.path) == ("envelope.out_of_range", "$.policy.transforms[1].k")
    err = reject(dumps(edit("policy", {"family": "greedy", "transforms": [{"name": "temperature", "temperature": 0.5}]})(tiny())))
    assert err.code == "policy.warper_requires_sampling"
    err = reject(dumps(edit("termination.stop_strings", ["é" * 300])(tiny())))
    assert (err.code, err.path) == ("stop.pattern_too_long", "$.termination.stop_strings[0]")
    assert isinstance(err, ResourceLimit)


def test_examples_are_valid_and_accepted_by_the_schema_file() -> None:
    validator = jsonschema.Draft202012Validator(E.published_schema())
    for path in sorted(EXAMPLES.glob("*.request.json")):
        raw = path.read_bytes()
        validator.validate(json.loads(raw))
        request, identity = E.validate_request_envelope(raw)
        assert identity == request.identity and identity.startswith("sha256:") and len(identity) == 71


def test_tiny_example_matches_the_byte_tokenizer() -> None:
    from decodespec.impl.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    request, _ = E.validate_request_envelope(_GOOD)
    assert request.text_interface.tokenizer_sha256 == tok.sha256
    assert request.valid_input_ids == (tok.bos_token_id, *tok.encode(request.prompt.text))
    assert request.decoder_prompt_len == len(request.valid_input_ids) == 26
    params = params_from_request(request)
    assert (params.prompt_len, params.context_cap, params.max_draws, params.prefill_chunk) == (26, 64, 1, 8)
    assert params.repair_required and params.stream and params.stop_strings and params.eos_ids == {2}


def test_published_schema_file_is_generated_from_the_python_definition() -> None:
    """spec/schemas/request.v1.json == schema_text(); regenerate with `decodespec validate --write-schema`."""
    assert E.SCHEMA_PATH.read_text(encoding="utf-8") == E.schema_text()
    jsonschema.Draft202012Validator.check_schema(E.published_schema())
    from decodespec.spec.policy import POLICY_JSON_SCHEMA

    assert E.published_schema()["$defs"]["policy"] == json.loads(json.dumps(POLICY_JSON_SCHEMA))


def test_identity_is_domain_separated_sha256_of_jcs_bytes() -> None:
    request, identity = E.validate_request_envelope(_GOOD)
    value = json.loads(_GOOD)
    value.pop("annotations")
    value["termination"]["structured"] = "none"  # the defaults the example leaves out
    value["output"]["include_stop_str"] = False
    for key, default in (("order", "hf"),):
        assert value["policy"][key] == default
    canonical = rfc8785.dumps(E._fill_defaults(value, E._schema()))
    assert request.canonical == canonical
    assert identity == "sha256:" + hashlib.sha256(b"numinens.request.v1\x00" + canonical).hexdigest()


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@given(seed=st.integers(0, 2**32 - 1), indent=st.sampled_from([None, 0, 1, 4]), compact=st.booleans())
def test_identity_ignores_key_order_and_whitespace(seed: int, indent: int | None, compact: bool) -> None:
    """Reordering keys at every depth or changing whitespace keeps the identity."""
    _, base = E.validate_request_envelope(_GOOD)
    env = _shuffled(tiny(), random.Random(seed))
    seps = (",", ":") if compact else (", ", ": ")
    raw = json.dumps(env, indent=indent, separators=None if indent is not None else seps, ensure_ascii=bool(seed % 2)).encode()
    assert E.validate_request_envelope(raw)[1] == base


SAME_IDENTITY = [
    edit("termination.ignore_eos", False),
    edit("annotations", {"trace_id": "abc"}),
    edit("annotations", delete=True),
    edit("termination.eos_ids", [2]),
    edit("runtime.max_retries", 1),  # explicit value equal to the example's
    edit("termination.structured", "none"),  # an omitted default given explicitly
    edit("output.include_stop_str", False),
    edit("policy.tie_rule", "lowest_id"),
]

# Each changes one identity-bearing field to another valid value.
CHANGED_IDENTITY = [
    edit("termination.ignore_eos", True),
    edit("artifact.release_id", "other"),
    edit("artifact.checkpoint_sha256", "sha256:" + "1" * 64),
    edit("text_interface.tokenizer_sha256", "sha256:" + "2" * 64),
    edit("text_interface.template_sha256", "sha256:" + "3" * 64),
    edit("text_interface.bos_id", 3),
    edit("prompt.input_ids.5", 99),
    edit("prompt.text", "user: Say hi!\nassistant: "),
    edit("position_visibility.max_context", 2048),
    edit("policy.transforms.0.temperature", 0.8),
    edit("policy.order", "explicit"),
    edit("rng.seed", 43),
    edit("rng.counter", 1),
    edit("runtime.framework_revision", "other"),
    edit("runtime.compute_dtype", "bfloat16"),
    edit("runtime.static_capacity", 65),
    edit("runtime.prefill_chunk", 4),
    edit("runtime.max_retries", 0),
    edit("runtime.attention", "eager"),
    edit("termination.max_new_tokens", 15),
    edit("termination.min_new_tokens", 0),
    edit("termination.eos_ids", [2, 3]),
    edit("termination.stop_strings", ["\n", "."]),
    edit("termination.zero_new_tokens", "prefill_only"),
    edit("termination.max_total_tokens", 60),
    edit("output.return_logprobs", False),
    edit("output.alignment", "text"),
    edit("output.stream", False),
]


@given(st.sampled_from(SAME_IDENTITY))
def test_non_semantic_edits_keep_the_identity(mutate: Callable[[dict], dict]) -> None:
    """Annotations, set order and defaults given explicitly do not change the identity."""
    _, base = E.validate_request_envelope(_GOOD)
    assert E.validate_request_envelope(dumps(mutate(tiny())))[1] == base


@given(st.sampled_from(CHANGED_IDENTITY))
def test_identity_bearing_edits_change_the_identity(mutate: Callable[[dict], dict]) -> None:
    _, base = E.validate_request_envelope(_GOOD)
    assert E.validate_request_envelope(dumps(mutate(tiny())))[1] != base


def test_ignore_eos_lifts_the_tokenizer_eos_agreement() -> None:
    """The declared special-id agreement (spec/envelope.py): a tokenizer EOS left out of the stop set is
    refused unless ``termination.ignore_eos``; an empty tokenizer EOS set is admitted."""
    no_stop = edit("termination.eos_ids", [])(tiny())
    with pytest.raises(Rejection) as refused:
        E.validate_request_envelope(dumps(no_stop))
    assert refused.value.code == "envelope.special_ids_disagree" and refused.value.path == "$.termination.eos_ids"
    admitted, _ = E.validate_request_envelope(dumps(edit("termination.ignore_eos", True)(no_stop)))
    assert admitted.termination.ignore_eos and admitted.termination.eos_ids == ()
    assert params_from_request(admitted).eos_ids == frozenset()
    # another stop id while the tokenizer's EOS is ignored
    other = edit("termination.ignore_eos", True)(edit("termination.eos_ids", [7])(tiny()))
    assert E.validate_request_envelope(dumps(other))[0].termination.eos_ids == (7,)
    # a tokenizer that declares no EOS needs no flag
    bare = edit("text_interface.eos_ids", [])(edit("termination.eos_ids", [])(tiny()))
    assert not E.validate_request_envelope(dumps(bare))[0].termination.ignore_eos
    # the flag never lets BOS be an EOS id
    with pytest.raises(Rejection, match="bos_id"):
        E.validate_request_envelope(dumps(edit("termination.ignore_eos", True)(edit("termination.eos_ids", [1])(tiny()))))


def test_eos_set_order_is_canonical() -> None:
    a = E.validate_request_envelope(dumps(edit("termination.eos_ids", [2, 7])(tiny())))
    b = E.validate_request_envelope(dumps(edit("termination.eos_ids", [7, 2])(tiny())))
    assert a[1] == b[1] and a[0].termination.eos_ids == (2, 7)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_typed_errors(raw: bytes) -> None:
    """Garbage never escapes as an untyped exception."""
    with pytest.raises(DecodeSpecError):
        E.validate_request_envelope(raw)


def test_non_bytes_input_is_a_programming_error() -> None:
    with pytest.raises(TypeError):
        E.validate_request_envelope(_GOOD.decode())  # type: ignore[arg-type]


def test_encoder_decoder_and_empty_prompt_with_start_state() -> None:
    env = chain(edit("artifact.architecture", "encoder_decoder"), edit("position_visibility.mode", "encoder_decoder"),
                edit("text_interface.decoder_start_id", 1), edit("termination.eos_ids", [2]),
                edit("runtime.cache_abi", "per_layer_compact_kv_rotated+cross_kv"),
                edit("runtime.prefill_chunk", delete=True), edit("text_interface.bos_id", delete=True))(tiny())
    request, _ = E.validate_request_envelope(dumps(env))
    assert (request.decoder_input_ids, request.source_len) == ((1,), 26)
    params = params_from_request(request)
    assert params.profile.name == "encoder_decoder" and params.prompt_len == 1 and params.source_len == 26
    empty = chain(edit("prompt.input_ids", []), edit("prompt.attention_mask", []), edit("prompt.text", ""),
                  edit("text_interface.decoder_start_id", 1), edit("text_interface.bos_id", delete=True))(tiny())
    request, _ = E.validate_request_envelope(dumps(empty))
    assert request.decoder_input_ids == (1,) and request.decoder_prompt_len == 1


def _cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decodespec.checks", *args], check=False, input=stdin, capture_output=True, cwd=REPO)


def test_cli_validate_prints_identity_or_typed_error(tmp_path: Path) -> None:
    ok = _cli("validate", str(EXAMPLES / "tiny.request.json"))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"ok": True, "identity": E.validate_request_envelope(_GOOD)[1]}
    bad = tmp_path / "bad.json"
    bad.write_bytes(_sub(b'"seed": 42', b'"seed": 42, "seed": 1'))
    out = _cli("validate", str(bad))
    assert out.returncode == 2
    assert json.loads(out.stdout) == {"ok": False, "error": {"code": "envelope.duplicate_key", "path": "$.rng.seed",
                                                           "message": "key 'seed' appears twice in one object", "data": "redacted"}}
    piped = _cli("validate", "-", stdin=_GOOD)
    assert piped.returncode == 0 and json.loads(piped.stdout)["ok"] is True
