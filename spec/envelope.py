"""M3.10 "Immutable request envelope and canonical identity": the ``numinens.request.v1`` envelope.

:func:`validate_request_envelope` turns raw bytes into an :class:`AdmittedRequest` and its
identity, or raises a typed error, in the order M3.10 prescribes:

1. **Raw bytes, before any Python object is built**: byte size (``envelope.too_large``),
   strict UTF-8 (``envelope.invalid_utf8``), nesting depth (``envelope.too_deep``), then a
   parse that rejects duplicate keys at any depth (``envelope.duplicate_key``), the
   ``NaN``/``Infinity`` literals and overflowing floats (``envelope.non_finite_number``),
   integer literals outside the I-JSON domain ``[-(2**53 - 1), 2**53 - 1]`` in any field
   (``envelope.out_of_range`` at the field: RFC 8785 hashes no other integer exactly, and a
   number field must convert to a finite float), escaped lone surrogates and malformed JSON.
   Every step is linear in the byte size: the depth pre-scan (:func:`_nesting_depth`) cuts
   strings out with a regex that never restarts inside one, also when a string is unclosed, so
   the full 4 MB is refused in well under a second (tests/test_hostile_input.py measures it).
2. **Closed schema** (the published JSON Schema :data:`SCHEMA_PATH`, Draft 2020-12, checked
   with ``jsonschema``): closed field sets, required fields, types (no bool-as-int and, unlike
   plain JSON Schema, no float-as-int: ``1.0`` is not an integer here), enums, integer ranges,
   list and string bounds, unique set elements.  Each ``jsonschema`` error is mapped to a
   stable ``envelope.*`` code and JSON path.
3. **Semantics** (M3.10's ``validate_request_envelope`` order): ids and mask of equal length;
   declared token / pattern / beam / context bounds; a non-empty prompt or a declared start
   state; ids inside the vocabulary; special ids agreeing with termination; the M3.8 policy
   (:func:`decodespec.spec.policy.policy_config_from_json`, ``policy.*`` codes); stop strings
   (:func:`decodespec.spec.stop.encode_stop_strings`, ``stop.*`` codes); the cache ABI
   compatible with the architecture and position plane; the output promise implementable;
   the G=0 branch.
4. **Canonical bytes and identity**: defaults filled in, set-valued lists sorted, then RFC 8785
   (JCS) bytes with the ``rfc8785`` library and
   ``identity = "sha256:" + hex(sha256(b"numinens.request.v1" + b"\\x00" + canonical_bytes))``.

Declared choices:

* **Identity-bearing fields**: every field except ``annotations``, a bounded free-form
  string map for runtime observations (trace ids, labels, timestamps) that M3.10 says do not
  belong in the semantic hash.  Reordering keys or changing whitespace never changes the
  identity; changing any other field does.
* **Absent versus default**: a field with a schema ``default`` means the same whether absent or
  given explicitly (defaults are filled in before hashing).  ``null`` is never allowed; an
  optional field without a default is simply absent.
* **Special-id agreement** (M3.10's ``require_special_id_agreement``, whose rule the seed leaves
  open): ``text_interface.eos_ids`` lists the tokenizer's EOS ids (empty for a tokenizer that
  declares none, such as a byte-level test tokenizer); every one of them must also be in
  ``termination.eos_ids`` unless ``termination.ignore_eos`` is true.  ``ignore_eos`` (default
  false; the name and meaning of vLLM's ``SamplingParams.ignore_eos`` and llama.cpp's
  ``ignore_eos``) declares that the tokenizer's EOS ids stop this request only where
  ``termination.eos_ids`` lists them, which may be none: the request runs to its length bound,
  a stop string or structured completion.  Without the flag, leaving a tokenizer EOS out of the
  stop set is refused as a likely mistake (``envelope.special_ids_disagree``).  BOS and the
  decoder start id are never EOS ids.
* **Sets**: ``text_interface.eos_ids`` and ``termination.eos_ids`` are sets (elements unique,
  canonically sorted, marked ``"x-set": true`` in the schema); every other list is ordered.
* **Strings**: exact code points, no Unicode normalization; lone surrogates are rejected.
* **G = 0**: ``termination.zero_new_tokens = "reject"`` refuses the request here
  (``envelope.zero_new_tokens_rejected``); ``"no_call"`` (default) and ``"prefill_only"``
  are admitted (M3.10 "The first-output off-by-one").
* **Empty prompt**: allowed only with ``text_interface.decoder_start_id`` (the start state
  becomes the single decoder input); encoder-decoder requests always start from it.
* **Wall-clock budget**: ``termination.timeout_ms`` (an integer, ``1 ..`` :data:`MAX_TIMEOUT_MS`
  milliseconds) is the request's timeout policy, so it is identity-bearing like every other
  termination field (M3.10 lists "timeout/cancellation policy" in the termination plane; the
  wall time a run actually took is a runtime observation and is not hashed).  Absent means no
  budget (:data:`DEFAULT_TIMEOUT_MS` is ``None``); like every optional field, ``null`` is refused.
* **Positions**: ``position_rule`` is ``valid_token_cumsum`` and ``cache_position_start`` is 0
  in v1 (resuming from a non-zero frontier is a snapshot contract, not an envelope field).

Every rejection is a :class:`~decodespec.spec.errors.Rejection` or
:class:`~decodespec.spec.errors.ResourceLimit` with a registered code, a JSON path and a
message that quotes at most a short prefix of the offending value
(:func:`~decodespec.spec.errors.quote`); nothing else happens.  The policy tables' size bounds
(``policy.too_large``) are :mod:`decodespec.spec.limits`'.

Source: M3.10 "Immutable request envelope and canonical identity" (planes, closed byte-level
contract, ``validate_request_envelope``), "Immutable identity versus mutable request state",
0x06 "Bound parsers, matchers, traces, and sensitive data".

Size: the numinens.request.v1 envelope: every plane's validation with its typed refusal and the
canonical identity over all of them.
"""

from __future__ import annotations

import array
import copy
import functools
import hashlib
import itertools
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import rfc8785

from .errors import DecodeSpecError, Rejection, ResourceLimit, quote, register_code
from .limits import MAX_SAFE_INT
from .passport import is_content_path, quote_content
from .policy import POLICY_JSON_SCHEMA, PolicyConfig, policy_config_from_json
from .profiles import PROFILES
from .prompt_logprobs import PROMPT_LOGPROBS_JSON_SCHEMA, PromptLogprobsSpec
from .request import prompt_room
from .stop import MAX_STOP_PATTERN_BYTES, MAX_STOP_STRINGS, OutputAlignment, encode_stop_strings

__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "DOMAIN_TAG",
    "MAX_ANNOTATIONS",
    "MAX_CONTEXT_TOKENS",
    "MAX_ENVELOPE_BYTES",
    "MAX_EOS_IDS",
    "MAX_NESTING_DEPTH",
    "MAX_NEW_TOKENS",
    "MAX_NUM_BEAMS",
    "MAX_PROMPT_TEXT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_RETRIES",
    "MAX_SAFE_INT",
    "MAX_STRING_CHARS",
    "MAX_TIMEOUT_MS",
    "MAX_VOCAB_SIZE",
    "SCHEMA_NAME",
    "SCHEMA_PATH",
    "AdmittedRequest",
    "canonical_bytes",
    "identity_of",
    "lone_surrogate_path",
    "parse_raw",
    "published_schema",
    "request_schema",
    "schema_text",
    "validate_request_envelope",
]

SCHEMA_NAME = "numinens.request.v1"
#: Domain tag hashed before the canonical bytes (then one NUL byte).
DOMAIN_TAG = SCHEMA_NAME.encode("ascii")
#: The published JSON Schema file (generated by :func:`schema_text`; a test keeps it in sync).
SCHEMA_PATH = Path(__file__).parent / "schemas" / "request.v1.json"

# Declared bounds (M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data").
#: Largest envelope, in bytes (a resource bound: ``envelope.too_large``).
MAX_ENVELOPE_BYTES = 4 * 1024 * 1024
#: Deepest nesting of JSON arrays/objects (a resource bound: ``envelope.too_deep``).
MAX_NESTING_DEPTH = 12
#: Most prompt tokens (``prompt.input_ids`` and ``attention_mask`` length).
MAX_PROMPT_TOKENS = 131_072
#: Largest ``max_context``, ``max_total_tokens`` and static capacity, in tokens.
MAX_CONTEXT_TOKENS = 1 << 20
#: Largest ``max_new_tokens``.
MAX_NEW_TOKENS = 65_536
#: Largest vocabulary.
MAX_VOCAB_SIZE = 1 << 22
#: Most EOS ids in one set.
MAX_EOS_IDS = 16
#: Largest beam width (a resource bound: ``envelope.too_many_beams``).
MAX_NUM_BEAMS = 16
#: Longest ``prompt.text``, in code points.
MAX_PROMPT_TEXT_CHARS = 1 << 20
#: Longest identifier-like string (release id, framework revision), in code points.
MAX_STRING_CHARS = 256
#: Most ``annotations`` entries.
MAX_ANNOTATIONS = 16
#: Most retries of a failed call (``runtime.max_retries``).
MAX_RETRIES = 8
#: Largest wall-clock budget ``termination.timeout_ms``, in milliseconds (24 hours).
MAX_TIMEOUT_MS = 24 * 60 * 60 * 1000
#: The default wall-clock budget: ``None``, no budget (the field is absent).
DEFAULT_TIMEOUT_MS: int | None = None
# MAX_SAFE_INT (the I-JSON integer domain every integer literal lies in) is decodespec.spec.limits'.
# MAX_STOP_STRINGS and MAX_STOP_PATTERN_BYTES are the stop matcher's (decodespec.spec.stop).

_S = "M3.10 Immutable request envelope and canonical identity"


def _code(name: str, description: str, kind: str = "rejection", section: str = _S) -> str:
    return register_code(f"envelope.{name}", kind, section, description)


TOO_LARGE = _code("too_large", f"The envelope exceeds {MAX_ENVELOPE_BYTES} bytes.", "resource_limit")
INVALID_UTF8 = _code("invalid_utf8", "The envelope bytes are not valid UTF-8, or a string escapes a lone surrogate.")
TOO_DEEP = _code("too_deep", f"JSON nesting deeper than {MAX_NESTING_DEPTH} levels.", "resource_limit")
INVALID_JSON = _code("invalid_json", "The bytes are not one JSON value (syntax error, byte-order mark, trailing data, an integer literal of more digits than Python converts).")
DUPLICATE_KEY = _code("duplicate_key", "An object repeats a key (at any depth); rejected before any object is built.")
NON_FINITE = _code("non_finite_number", "A NaN or Infinity literal, or a float that overflows to infinity.")
UNKNOWN_FIELD = _code("unknown_field", "A field outside the closed field set of its object.")
MISSING_FIELD = _code("missing_field", "A required field is absent.")
TYPE_MISMATCH = _code("type_mismatch", "A value has the wrong JSON type (booleans are not integers, 1.0 is not an integer, null is never allowed).")
INVALID_VALUE = _code("invalid_value", "A value outside its enumeration or constant.")
OUT_OF_RANGE = _code("out_of_range", "A number outside its declared range, or an integer literal outside the I-JSON domain [-(2**53 - 1), 2**53 - 1] in any field (RFC 8785 cannot hash it exactly).")
LENGTH_BOUND = _code("length_bound", "A list, string or map outside its declared length bounds.")
INVALID_STRING = _code("invalid_string", "A string that does not match its declared pattern (hashes are sha256:<64 hex>).")
DUPLICATE_ITEM = _code("duplicate_item", "A set-valued list repeats an element.")
SCHEMA_VIOLATION = _code("schema_violation", "The value matches none of the allowed shapes (e.g. an unknown policy transform object).")
PROMPT_MASK_MISMATCH = _code("prompt_mask_mismatch", "prompt.input_ids and prompt.attention_mask have different lengths.")
ATTENTION_MASK_INVALID = _code("attention_mask_invalid", "The valid columns of the attention mask are not one contiguous run.")
PADDING_INVALID = _code("padding_invalid", "A padding column does not hold text_interface.pad_id (or no pad_id is declared).")
CONTEXT_EXCEEDED = _code("context_exceeded", "The prompt (plus one output when max_new_tokens >= 1) does not fit max_context, max_total_tokens or the static capacity.")
TOO_MANY_BEAMS = _code("too_many_beams", f"policy.num_beams exceeds {MAX_NUM_BEAMS}.", "resource_limit")
EMPTY_PROMPT = _code("empty_prompt", "No valid prompt token and no declared start state (text_interface.decoder_start_id); an encoder-decoder request needs a non-empty source and a start state.")
TOKEN_OUT_OF_VOCAB = _code("token_out_of_vocab", "A prompt or special token id is not below text_interface.vocab_size.")
SPECIAL_IDS_DISAGREE = _code("special_ids_disagree", "Special ids disagree with termination: a tokenizer EOS id missing from termination.eos_ids (unless termination.ignore_eos), BOS or the start id listed as EOS, or no non-EOS token while min_new_tokens > 0.")
MIN_EXCEEDS_MAX = _code("min_exceeds_max", "termination.min_new_tokens exceeds max_new_tokens.")
VISIBILITY_INCOMPATIBLE = _code("visibility_incompatible", "The visibility mode or prefix length does not match the architecture (decoder_only/hybrid: causal; prefix_lm: prefix_lm with 1 <= prefix_length <= L; encoder_decoder: encoder_decoder).")
CACHE_ABI_INCOMPATIBLE = _code("cache_abi_incompatible", "The cache family / ABI / capacity / chunking does not fit the architecture and position plane.")
OUTPUT_UNIMPLEMENTABLE = _code("output_unimplementable", "The output promise cannot be kept (a final cache without a cache, all_outputs without append repair, streamed beams, prompt logprobs without a prefill call or of an encoder-decoder source, or more prompt-logprob alternatives than the vocabulary).")
ZERO_NEW_TOKENS_REJECTED = _code("zero_new_tokens_rejected", "max_new_tokens = 0 under the declared 'reject' branch of the G=0 union.", section="M3.10 The first-output off-by-one (G=0 union)")

# --------------------------------------------------------------------------------------------
# The published schema
# --------------------------------------------------------------------------------------------

_SHA256 = {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}
_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_STRING_CHARS}
_TOKEN = {"type": "integer", "minimum": 0, "maximum": MAX_VOCAB_SIZE - 1}
_DTYPES = ["float32", "bfloat16", "float16", "float64"]

#: Cache ABI required by each architecture (``"none"`` exactly when ``cache_family == "none"``).
CACHE_ABI_FOR_ARCHITECTURE = {
    "decoder_only": "per_layer_compact_kv_rotated",
    "prefix_lm": "per_layer_compact_kv_rotated",
    "encoder_decoder": "per_layer_compact_kv_rotated+cross_kv",
    "hybrid": "per_layer_compact_kv_rotated+recurrent_state",
}
#: Visibility mode required by each architecture.
MODE_FOR_ARCHITECTURE = {
    "decoder_only": "causal",
    "hybrid": "causal",
    "prefix_lm": "prefix_lm",
    "encoder_decoder": "encoder_decoder",
}


def _int(lo: int, hi: int, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi, **extra}


def _obj(properties: dict[str, Any], required: list[str], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties, **extra}


def _id_set(max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": _TOKEN, "minItems": min_items, "maxItems": max_items, "uniqueItems": True, "x-set": True}


@functools.lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:decodespec:schema:numinens.request.v1",
        "title": "numinens.request.v1: one single-request inference envelope (M3.10)",
        "description": "Closed, bounded request envelope. Identity: sha256(b'numinens.request.v1' + b'\\x00' + "
        "RFC 8785 canonical bytes of the envelope without 'annotations', defaults filled in, 'x-set' lists sorted). "
        "Beyond this schema a validator must reject duplicate keys, NaN/Infinity, float literals where an integer is "
        "required, invalid UTF-8, documents over the byte and depth bounds, and the semantic rules of "
        "decodespec.spec.envelope.",
        "type": "object",
        "additionalProperties": False,
        "required": [
            "schema", "artifact", "text_interface", "prompt", "position_visibility",
            "policy", "rng", "runtime", "termination", "output",
        ],
        "properties": {
            "schema": {"const": SCHEMA_NAME},
            "artifact": _obj(
                {"release_id": _NAME, "checkpoint_sha256": _SHA256, "architecture": {"enum": sorted(PROFILES)}},
                ["release_id", "checkpoint_sha256", "architecture"],
            ),
            "text_interface": _obj(
                {
                    "tokenizer_sha256": _SHA256,
                    "template_sha256": _SHA256,
                    "vocab_size": _int(1, MAX_VOCAB_SIZE),
                    "bos_id": _TOKEN,
                    "eos_ids": _id_set(MAX_EOS_IDS),
                    "pad_id": _TOKEN,
                    "decoder_start_id": _TOKEN,
                },
                ["tokenizer_sha256", "vocab_size", "eos_ids"],
            ),
            "prompt": _obj(
                {
                    "input_ids": {"type": "array", "items": _TOKEN, "maxItems": MAX_PROMPT_TOKENS},
                    "attention_mask": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": MAX_PROMPT_TOKENS},
                    "text": {"type": "string", "maxLength": MAX_PROMPT_TEXT_CHARS},
                },
                ["input_ids", "attention_mask"],
            ),
            "position_visibility": _obj(
                {
                    "mode": {"enum": ["causal", "prefix_lm", "encoder_decoder"]},
                    "position_rule": {"const": "valid_token_cumsum"},
                    "cache_position_start": {"const": 0},
                    "max_context": _int(1, MAX_CONTEXT_TOKENS),
                    "prefix_length": _int(1, MAX_PROMPT_TOKENS),
                },
                ["mode", "position_rule", "cache_position_start", "max_context"],
            ),
            "policy": {"$ref": "#/$defs/policy"},
            "rng": _obj(
                {"algorithm": {"const": "philox"}, "seed": _int(0, MAX_SAFE_INT), "counter": _int(0, MAX_SAFE_INT)},
                ["algorithm", "seed", "counter"],
            ),
            "runtime": _obj(
                {
                    "framework_revision": _NAME,
                    "compute_dtype": {"enum": _DTYPES},
                    "logit_dtype": {"enum": _DTYPES},
                    "cache_family": {"enum": ["none", "dynamic", "static"]},
                    "cache_abi": {"enum": ["none", *sorted(set(CACHE_ABI_FOR_ARCHITECTURE.values()))]},
                    "static_capacity": _int(1, MAX_CONTEXT_TOKENS),
                    "prefill_chunk": _int(1, MAX_PROMPT_TOKENS),
                    "attention": {"enum": ["eager", "sdpa", "flash"]},
                    "append_repair": {"type": "boolean", "default": False},
                    "max_retries": _int(0, MAX_RETRIES, default=0),
                },
                ["framework_revision", "compute_dtype", "logit_dtype", "cache_family", "cache_abi"],
            ),
            "termination": _obj(
                {
                    "max_new_tokens": _int(0, MAX_NEW_TOKENS),
                    "min_new_tokens": _int(0, MAX_NEW_TOKENS, default=0),
                    "eos_ids": _id_set(MAX_EOS_IDS),
                    "ignore_eos": {"type": "boolean", "default": False},
                    "stop_strings": {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_PATTERN_BYTES},
                        "maxItems": MAX_STOP_STRINGS,
                        "uniqueItems": True,
                        "default": [],
                    },
                    "structured": {"enum": ["none", "json"], "default": "none"},
                    "zero_new_tokens": {"enum": ["reject", "no_call", "prefill_only"], "default": "no_call"},
                    "max_total_tokens": _int(1, MAX_CONTEXT_TOKENS),
                    "timeout_ms": _int(1, MAX_TIMEOUT_MS),
                },
                ["max_new_tokens", "eos_ids"],
            ),
            "output": _obj(
                {
                    "return_token_ids": {"type": "boolean"},
                    "return_logprobs": {"type": "boolean"},
                    "final_cache": {"enum": ["none", "processed_inputs_only", "all_outputs"]},
                    "include_stop_str": {"type": "boolean", "default": False},
                    "alignment": {"enum": [a.value for a in OutputAlignment], "default": OutputAlignment.TOKEN.value},
                    "stream": {"type": "boolean", "default": False},
                    "prompt_logprobs": PROMPT_LOGPROBS_JSON_SCHEMA,
                },
                ["return_token_ids", "return_logprobs", "final_cache"],
            ),
            "annotations": {
                "type": "object",
                "description": "Free-form runtime observations (labels, trace ids); NOT part of the identity.",
                "maxProperties": MAX_ANNOTATIONS,
                "propertyNames": {"pattern": "^[a-z0-9_.-]{1,64}$"},
                "additionalProperties": {"type": "string", "maxLength": MAX_STRING_CHARS},
            },
        },
        "$defs": {"policy": POLICY_JSON_SCHEMA},
    }


def request_schema() -> dict[str, Any]:
    """The ``numinens.request.v1`` JSON Schema (Draft 2020-12) as a fresh dict (the M3.8 policy schema embedded)."""
    return copy.deepcopy(_schema())


def schema_text() -> str:
    """The published schema file's exact text (``json.dumps(indent=2)`` plus a newline)."""
    return json.dumps(_schema(), indent=2, ensure_ascii=False) + "\n"


def published_schema() -> dict[str, Any]:
    """The committed schema file :data:`SCHEMA_PATH`, parsed."""
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return schema


def _strict_validator_class() -> type:
    # JSON Schema counts 1.0 as an integer; this envelope does not (no float-as-int).
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
    )
    validator: type = jsonschema.validators.extend(  # type: ignore[no-untyped-call]  # types-jsonschema leaves extend untyped
        jsonschema.Draft202012Validator, type_checker=checker)
    return validator


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    return _strict_validator_class()(_schema())


# --------------------------------------------------------------------------------------------
# Raw bytes
# --------------------------------------------------------------------------------------------

#: One JSON string, closed or not: the possessive repeats never backtrack and the closing quote
#: is optional, so a match that starts at a quote always succeeds and the scan never restarts
#: inside a string (linear time, also on an unclosed string full of escaped quotes).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = str.maketrans({"[": "\x01", "{": "\x01", "]": "\xff", "}": "\xff"})
_SURROGATE = re.compile("[\ud800-\udfff]")


def _nesting_depth(text: str) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings, in time linear in ``len(text)``.

    Strings (closed or not) are cut out with :data:`_STRING`, every character but the brackets is
    dropped, and the running depth is the prefix sum of +1 per opening and -1 per closing bracket
    (computed by :func:`itertools.accumulate` in C).  For text that is not JSON the number may be
    meaningless; the parse that follows refuses such text anyway.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    steps = array.array("b", brackets.translate(_DEPTH_STEP).encode("latin-1"))  # +1 / -1 as signed bytes
    return max(0, max(itertools.accumulate(steps)))


class _Duplicate:
    """Marker left by the object hook where an object repeated a key (the path is found later)."""

    def __init__(self, key: str):
        self.key = key


def _pairs_hook(pairs: list[tuple[str, Any]]) -> Any:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Duplicate(key)
        out[key] = value
    return out


class _Invalid:
    """Marker left by a parse hook where a number literal cannot be admitted (the path is found later)."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message


def _reject_constant(name: str) -> Any:
    return _Invalid(NON_FINITE, f"the literal {name} is not a finite JSON number")


def _parse_float(text: str) -> Any:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        return _Invalid(NON_FINITE, f"the number {text} overflows to infinity")
    return value


def _parse_int(text: str) -> Any:
    digits = len(text.lstrip("-"))
    limit = sys.get_int_max_str_digits() or digits
    if digits > limit:  # Python refuses to convert it (and the conversion is quadratic); no envelope integer is near
        return _Invalid(INVALID_JSON, f"integer literal too large: {digits} digits (every envelope integer is at most "
                                      f"{MAX_SAFE_INT}, 16 digits)")
    value = int(text)
    if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
        # In any field, bounded by the schema or not: RFC 8785 hashes no other integer exactly, and a
        # number field must convert to a finite float.
        return _Invalid(OUT_OF_RANGE, f"integer literal {quote(text, 24)} ({digits} digits) is outside the I-JSON domain "
                                      f"[-{MAX_SAFE_INT}, {MAX_SAFE_INT}] (write a larger number as a float literal)")
    return value


def _json_path(parts: Any) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _scan(value: Any, path: str) -> None:
    """Find duplicate-key markers and lone surrogates, depth first, in document order."""
    if isinstance(value, _Duplicate):
        raise Rejection(DUPLICATE_KEY, f"key {quote(value.key)} appears twice in one object", f"{path}.{value.key}")
    if isinstance(value, _Invalid):
        raise Rejection(value.code, value.message, path)
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise Rejection(INVALID_UTF8, "a string escapes a lone UTF-16 surrogate", path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                raise Rejection(INVALID_UTF8, "a key escapes a lone UTF-16 surrogate", path)
            _scan(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _scan(item, f"{path}[{index}]")


def lone_surrogate_path(value: Any, path: str = "$") -> str | None:
    """The JSON path of the first string or key (depth first, document order) that holds a lone UTF-16 surrogate, else ``None``.

    ``json.loads`` admits an escaped lone surrogate (``"\\ud800"``); such a string cannot be
    encoded as UTF-8, hashed by RFC 8785 or written back, so every JSON reader of this project
    refuses it (the envelope here, snapshots in ``decodespec.impl.snapshot``).
    """
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return path
            found = lone_surrogate_path(item, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def parse_raw(raw: bytes) -> Any:
    """Check the raw bytes and parse them into plain JSON values (step 1).

    Raises:
        ResourceLimit: ``envelope.too_large``, ``envelope.too_deep``.
        Rejection: ``envelope.invalid_utf8``, ``envelope.invalid_json``,
            ``envelope.duplicate_key``, ``envelope.non_finite_number``.
        TypeError: when ``raw`` is not bytes-like (a programming error).
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"validate_request_envelope takes bytes, not {type(raw).__name__}")
    raw = bytes(raw)
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise ResourceLimit(TOO_LARGE, f"{len(raw)} bytes > {MAX_ENVELOPE_BYTES}", "$",
                            {"limit": MAX_ENVELOPE_BYTES, "actual": len(raw)})
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejection(INVALID_UTF8, f"invalid UTF-8 at byte {exc.start}: {exc.reason}", "$") from None
    if text.startswith("\ufeff"):
        raise Rejection(INVALID_JSON, "the envelope starts with a byte-order mark", "$")
    deepest = _nesting_depth(text)
    if deepest > MAX_NESTING_DEPTH:
        raise ResourceLimit(TOO_DEEP, f"nesting depth {deepest} > {MAX_NESTING_DEPTH}", "$",
                            {"limit": MAX_NESTING_DEPTH, "actual": deepest})
    try:
        value = json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_reject_constant, parse_float=_parse_float,
                           parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise Rejection(INVALID_JSON, f"{exc.msg} at line {exc.lineno} column {exc.colno}", "$") from None
    _scan(value, "$")
    return value


# --------------------------------------------------------------------------------------------
# Structural validation
# --------------------------------------------------------------------------------------------

_KEYWORD_CODES = {
    "additionalProperties": UNKNOWN_FIELD,
    "unevaluatedProperties": UNKNOWN_FIELD,
    "required": MISSING_FIELD,
    "type": TYPE_MISMATCH,
    "enum": INVALID_VALUE,
    "const": INVALID_VALUE,
    "minimum": OUT_OF_RANGE,
    "maximum": OUT_OF_RANGE,
    "exclusiveMinimum": OUT_OF_RANGE,
    "exclusiveMaximum": OUT_OF_RANGE,
    "multipleOf": OUT_OF_RANGE,
    "minItems": LENGTH_BOUND,
    "maxItems": LENGTH_BOUND,
    "minLength": LENGTH_BOUND,
    "maxLength": LENGTH_BOUND,
    "minProperties": LENGTH_BOUND,
    "maxProperties": LENGTH_BOUND,
    "pattern": INVALID_STRING,
    "propertyNames": INVALID_STRING,
    "uniqueItems": DUPLICATE_ITEM,
}


def _discriminated(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """The error inside the ``oneOf`` branch whose ``name`` const the instance matches (a policy transform).

    ``best_match`` cannot choose between branches that fail equally deep (``top_p`` and ``min_p``
    both have a ``p``), so it reports the whole object; the transform's ``name`` selects the
    branch, and that branch's own error (``p`` out of range) is the one to report.
    """
    if error.validator not in ("oneOf", "anyOf") or not error.context:
        return error
    wrong_name = {e.schema_path[0] for e in error.context if list(e.relative_path) == ["name"] and e.validator == "const"}
    kept = [e for e in error.context if e.schema_path[0] not in wrong_name]
    if not kept or not wrong_name:
        return error
    return _discriminated(jsonschema.exceptions.best_match(kept))


def _range_error(error: jsonschema.ValidationError, path: str) -> Rejection:
    """``envelope.out_of_range`` naming the field (``top_p.p``) and its declared range."""
    schema: Any = error.schema  # a schema object here (the stubs also allow bool and Unset)
    lo = (f"[{schema['minimum']}" if "minimum" in schema
          else f"({schema['exclusiveMinimum']}" if "exclusiveMinimum" in schema else "(-inf")
    hi = (f"{schema['maximum']}]" if "maximum" in schema
          else f"{schema['exclusiveMaximum']})" if "exclusiveMaximum" in schema else "inf)")
    owner = _owner_name(error)
    field = error.absolute_path[-1] if error.absolute_path else None
    name = (owner if owner == field else f"{owner}.{field}") if owner and field is not None else path.removeprefix("$.")
    return Rejection(OUT_OF_RANGE, f"{name} = {quote(error.instance)} is outside its range {lo}, {hi}", path)


def schema_of(error: jsonschema.ValidationError) -> Any:
    """The schema object of the failing keyword (the stubs also allow bool and Unset)."""
    return error.schema


def _owner_name(error: jsonschema.ValidationError) -> str | None:
    """The ``name`` of the transform object holding the offending field, if any."""
    node: Any = error
    while node is not None:
        if isinstance(node.instance, dict) and isinstance(node.instance.get("name"), str) and node.instance is not error.instance:
            name: str = node.instance["name"]
            return name
        node = node.parent
    return None


def _schema_error(error: jsonschema.ValidationError) -> Rejection:
    error = _discriminated(error)
    path = _json_path(error.absolute_path)
    keyword = str(error.validator)
    instance = error.instance
    expected: Any = error.validator_value  # the keyword's value in the schema (typed loosely by the stubs)
    if is_content_path(path) and isinstance(instance, (str, list, dict)):  # user content: length and fingerprint, never a prefix
        bound = error.validator_value if isinstance(error.validator_value, (int, str)) and keyword != "type" else None
        code = OUT_OF_RANGE if keyword in ("minimum", "maximum") else _KEYWORD_CODES.get(keyword, SCHEMA_VIOLATION)
        return Rejection(code, f"{quote_content(instance)} fails the schema's {keyword}" + (f" {bound!r}" if bound is not None else "")
                         + (f" (expected {error.validator_value})" if keyword == "type" else ""), path)
    if keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return _range_error(error, path)
    if keyword == "oneOf" and isinstance(instance, dict) and isinstance(instance.get("name"), str):
        known = sorted(b["properties"]["name"]["const"] for b in expected if "name" in b.get("properties", {}))
        if instance["name"] not in known:
            return Rejection(INVALID_VALUE, f"unknown transform name {quote(instance['name'])}; known: {', '.join(known)}", f"{path}.name")
    if keyword in ("additionalProperties", "unevaluatedProperties") and isinstance(instance, dict):
        allowed = set(schema_of(error).get("properties", {}))
        extra = sorted(k for k in instance if k not in allowed)
        if extra:
            return Rejection(UNKNOWN_FIELD, f"unknown field {quote(extra[0])} (the field set is closed)", f"{path}.{extra[0]}")
    if keyword == "required" and isinstance(instance, dict):
        missing = [k for k in expected if k not in instance]
        if missing:
            return Rejection(MISSING_FIELD, f"required field {missing[0]!r} is absent", f"{path}.{missing[0]}")
    if keyword == "type" and instance is None:
        return Rejection(TYPE_MISMATCH, "null is not allowed (leave an optional field out instead)", path)
    if keyword == "type" and isinstance(instance, float) and error.validator_value == "integer":
        return Rejection(TYPE_MISMATCH, f"{instance!r} is a float literal where an integer is required", path)
    return Rejection(_KEYWORD_CODES.get(keyword, SCHEMA_VIOLATION), _quoted_message(error), path)


def _quoted_message(error: jsonschema.ValidationError) -> str:
    """``jsonschema``'s message with the offending value's ``repr`` cut by :func:`~decodespec.spec.errors.quote`."""
    if isinstance(error.instance, (str, list, dict)) and len(error.instance) > 8:
        return error.message.replace(repr(error.instance), quote(error.instance), 1)
    return error.message


def _structural(value: Any) -> None:
    error = jsonschema.exceptions.best_match(_validator().iter_errors(value))
    if error is not None:
        raise _schema_error(error)


def _fill_defaults(value: Any, schema: Mapping[str, Any]) -> Any:
    """``value`` with every absent field that has a schema ``default`` filled in (a new object)."""
    if "$ref" in schema:
        schema = _schema()["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    if isinstance(value, dict) and "properties" in schema:
        out = {}
        for key, sub in schema["properties"].items():
            if key in value:
                out[key] = _fill_defaults(value[key], sub)
            elif "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
        out.update({k: v for k, v in value.items() if k not in out})
        return out
    return value


def _sort_sets(value: Any, schema: Mapping[str, Any]) -> Any:
    if "$ref" in schema:
        return value
    if isinstance(value, dict) and "properties" in schema:
        return {k: _sort_sets(v, schema["properties"].get(k, {})) for k, v in value.items()}
    if isinstance(value, list) and schema.get("x-set"):
        return sorted(value)
    return value


def canonical_bytes(value: Mapping[str, Any]) -> bytes:
    """RFC 8785 (JCS) bytes of an admitted envelope value, without ``annotations``.

    ``value`` must already be structurally valid; defaults are filled and sets sorted here.
    """
    schema = _schema()
    normal = _sort_sets(_fill_defaults(dict(value), schema), schema)
    normal.pop("annotations", None)
    return rfc8785.dumps(normal)


def identity_of(canonical: bytes) -> str:
    """``"sha256:" + hex(sha256(DOMAIN_TAG + b"\\x00" + canonical))``."""
    return "sha256:" + hashlib.sha256(DOMAIN_TAG + b"\x00" + canonical).hexdigest()


# --------------------------------------------------------------------------------------------
# The admitted request
# --------------------------------------------------------------------------------------------


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _section(cls: type, data: Mapping[str, Any]) -> Any:
    return cls(**{f.name: _tuple(data[f.name]) for f in attrs.fields(cls) if f.name in data})


@attrs.frozen
class Artifact:
    """Candidate identity plane: ``release_id``, ``checkpoint_sha256``, ``architecture`` (a profile name)."""

    release_id: str
    checkpoint_sha256: str
    architecture: str


@attrs.frozen
class TextInterface:
    """Text-interface plane (M2.1 exports): tokenizer/template hashes, V and special ids (``None`` = absent)."""

    tokenizer_sha256: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    template_sha256: str | None = None
    bos_id: int | None = None
    pad_id: int | None = None
    decoder_start_id: int | None = None


@attrs.frozen
class Prompt:
    """Prompt plane: ``input_ids`` ``[T]`` and ``attention_mask`` ``[T]`` (0/1), optional serialized text."""

    input_ids: tuple[int, ...]
    attention_mask: tuple[int, ...]
    text: str | None = None


@attrs.frozen
class PositionVisibility:
    """Position/visibility plane: mode, position rule, first cache position, context cap, prefix length."""

    mode: str
    position_rule: str
    cache_position_start: int
    max_context: int
    prefix_length: int | None = None


@attrs.frozen
class RngSpec:
    """Randomness plane: algorithm (``philox``), seed, initial counter."""

    algorithm: str
    seed: int
    counter: int


@attrs.frozen
class RuntimeSpec:
    """Cache/runtime plane: revision, dtypes, cache family/ABI/capacity, chunking, attention, repair, retries."""

    framework_revision: str
    compute_dtype: str
    logit_dtype: str
    cache_family: str
    cache_abi: str
    append_repair: bool = False
    max_retries: int = 0
    static_capacity: int | None = None
    prefill_chunk: int | None = None
    attention: str | None = None


@attrs.frozen
class Termination:
    """Termination plane: G, min new tokens, EOS set, stop strings, structured stop, G=0 branch, total cap, wall-clock budget.

    ``timeout_ms`` is the request's wall-clock budget in milliseconds (``1 <= timeout_ms <=
    MAX_TIMEOUT_MS``) or ``None`` (:data:`DEFAULT_TIMEOUT_MS`: no budget, the field absent).  The
    runtime measures it on a monotonic clock from admission and, once it is spent, finishes
    ``timeout`` at the next call boundary (before the next launch), keeping every committed token
    (M3.10 0x02 "cancellation/timeout before launch"; 0x06 "wall/device budget plus cancellation
    checkpoints").
    """

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    structured: str = "none"
    zero_new_tokens: str = "no_call"
    max_total_tokens: int | None = None
    timeout_ms: int | None = DEFAULT_TIMEOUT_MS


def _prompt_logprobs_spec(value: Any) -> PromptLogprobsSpec | None:
    """The converter of ``output.prompt_logprobs``: a JSON object becomes the spec, a spec or ``None`` stays."""
    return PromptLogprobsSpec.from_json(value) if isinstance(value, Mapping) else value


@attrs.frozen
class OutputSpec:
    """Output plane: returned fields, final-cache promise, stop-string inclusion, alignment, stream, prompt logprobs.

    ``prompt_logprobs`` is ``None`` when not requested (the field is absent), else the
    :class:`~decodespec.spec.prompt_logprobs.PromptLogprobsSpec` (M3.10 0x02).
    """

    return_token_ids: bool
    return_logprobs: bool
    final_cache: str
    include_stop_str: bool = False
    alignment: str = "token"
    stream: bool = False
    prompt_logprobs: PromptLogprobsSpec | None = attrs.field(default=None, converter=_prompt_logprobs_spec)


@attrs.frozen
class AdmittedRequest:
    """A validated ``numinens.request.v1`` envelope (immutable; one attrs value per plane).

    Attributes:
        artifact, text_interface, prompt, position_visibility, rng, runtime, termination,
        output: The planes, defaults filled in.
        policy: The M3.8 :class:`~decodespec.spec.policy.PolicyConfig`.
        annotations: ``(key, value)`` pairs, sorted; not identity-bearing.
        identity: ``"sha256:<hex>"``.
        canonical: The RFC 8785 bytes that were hashed.
    """

    artifact: Artifact
    text_interface: TextInterface
    prompt: Prompt
    position_visibility: PositionVisibility
    policy: PolicyConfig
    rng: RngSpec
    runtime: RuntimeSpec
    termination: Termination
    output: OutputSpec
    annotations: tuple[tuple[str, str], ...]
    identity: str
    canonical: bytes = attrs.field(repr=False)

    @property
    def valid_input_ids(self) -> tuple[int, ...]:
        """Prompt ids at valid mask columns, in order (``[L_valid]``)."""
        return tuple(t for t, m in zip(self.prompt.input_ids, self.prompt.attention_mask) if m)

    @property
    def decoder_input_ids(self) -> tuple[int, ...]:
        """The decoder-side model input before the first decision.

        Encoder-decoder: ``(decoder_start_id,)``; otherwise the valid prompt ids, or
        ``(decoder_start_id,)`` for an empty prompt with a declared start state.
        """
        start = self.text_interface.decoder_start_id
        if self.artifact.architecture == "encoder_decoder" or not self.valid_input_ids:
            assert start is not None
            return (start,)
        return self.valid_input_ids

    @property
    def decoder_prompt_len(self) -> int:
        """L: decoder-side valid input count (>= 1)."""
        return len(self.decoder_input_ids)

    @property
    def source_len(self) -> int | None:
        """S for encoder-decoder requests (valid source tokens), else ``None``."""
        return len(self.valid_input_ids) if self.artifact.architecture == "encoder_decoder" else None

    def to_json(self) -> dict[str, Any]:
        """The admitted value as JSON (defaults filled in, sets sorted, annotations included)."""
        value: dict[str, Any] = json.loads(self.canonical)
        if self.annotations:
            value["annotations"] = dict(self.annotations)
        return value


# --------------------------------------------------------------------------------------------
# Semantic checks (M3.10 validate_request_envelope order)
# --------------------------------------------------------------------------------------------


def _check_prompt_geometry(v: Mapping[str, Any]) -> list[int]:
    ids, mask = v["prompt"]["input_ids"], v["prompt"]["attention_mask"]
    if len(ids) != len(mask):
        raise Rejection(PROMPT_MASK_MISMATCH, f"{len(ids)} input ids but {len(mask)} mask values", "$.prompt.attention_mask")
    valid = [i for i, m in enumerate(mask) if m]
    if valid and valid[-1] - valid[0] + 1 != len(valid):
        hole = next(i for i in range(valid[0], valid[-1]) if not mask[i])
        raise Rejection(ATTENTION_MASK_INVALID, "valid columns must form one contiguous run (left or right padding only)",
                        f"$.prompt.attention_mask[{hole}]")
    pad = v["text_interface"].get("pad_id")
    for i, m in enumerate(mask):
        if not m and ids[i] != pad:
            what = "no text_interface.pad_id is declared" if pad is None else f"it holds {ids[i]}, not pad_id {pad}"
            raise Rejection(PADDING_INVALID, f"padding column {i}: {what}", f"$.prompt.input_ids[{i}]")
    return valid


def _check_bounds(v: Mapping[str, Any], num_valid: int) -> None:
    term, runtime, pv = v["termination"], v["runtime"], v["position_visibility"]
    decoder_len = 1 if v["artifact"]["architecture"] == "encoder_decoder" or num_valid == 0 else num_valid
    need = prompt_room(decoder_len, term["max_new_tokens"])
    caps = [("position_visibility.max_context", pv["max_context"])]
    if "max_total_tokens" in term:
        caps.append(("termination.max_total_tokens", term["max_total_tokens"]))
    if "static_capacity" in runtime:
        caps.append(("runtime.static_capacity", runtime["static_capacity"]))
    if v["artifact"]["architecture"] == "encoder_decoder" and num_valid > pv["max_context"]:
        raise Rejection(CONTEXT_EXCEEDED, f"the {num_valid}-token source exceeds max_context {pv['max_context']}",
                        "$.position_visibility.max_context")
    for name, cap in caps:
        if need > cap:
            raise Rejection(CONTEXT_EXCEEDED, f"{decoder_len} decoder input tokens plus {need - decoder_len} output need {need} "
                            f"positions but {name} is {cap}", f"$.{name}")
    beams = v["policy"].get("num_beams", 1)
    if isinstance(beams, int) and beams > MAX_NUM_BEAMS:
        raise ResourceLimit(TOO_MANY_BEAMS, f"num_beams {beams} > {MAX_NUM_BEAMS}", "$.policy.num_beams",
                            {"limit": MAX_NUM_BEAMS, "actual": beams})
    try:
        encode_stop_strings(term["stop_strings"])
    except DecodeSpecError as exc:
        raise type(exc)(exc.code, exc.message, exc.path.replace("$.stop", "$.termination.stop_strings", 1), exc.details) from None


def _check_start_state(v: Mapping[str, Any], num_valid: int) -> None:
    start = v["text_interface"].get("decoder_start_id")
    if v["artifact"]["architecture"] == "encoder_decoder":
        if num_valid == 0:
            raise Rejection(EMPTY_PROMPT, "an encoder-decoder request needs a non-empty source prompt", "$.prompt.input_ids")
        if start is None:
            raise Rejection(EMPTY_PROMPT, "an encoder-decoder request needs text_interface.decoder_start_id", "$.text_interface.decoder_start_id")
    elif num_valid == 0 and start is None:
        raise Rejection(EMPTY_PROMPT, "the prompt has no valid token and no start state (text_interface.decoder_start_id)", "$.prompt.input_ids")


def _check_vocabulary(v: Mapping[str, Any]) -> None:
    ti = v["text_interface"]
    vocab = ti["vocab_size"]
    for i, t in enumerate(v["prompt"]["input_ids"]):
        if t >= vocab:
            raise Rejection(TOKEN_OUT_OF_VOCAB, f"token {t} is not below vocab_size {vocab}", f"$.prompt.input_ids[{i}]")
    singles = [("text_interface", k) for k in ("bos_id", "pad_id", "decoder_start_id")]
    for section, key in singles:
        t = v[section].get(key)
        if t is not None and t >= vocab:
            raise Rejection(TOKEN_OUT_OF_VOCAB, f"{key} {t} is not below vocab_size {vocab}", f"$.{section}.{key}")
    for section in ("text_interface", "termination"):
        for i, t in enumerate(v[section]["eos_ids"]):
            if t >= vocab:
                raise Rejection(TOKEN_OUT_OF_VOCAB, f"EOS id {t} is not below vocab_size {vocab}", f"$.{section}.eos_ids[{i}]")


def _check_special_ids(v: Mapping[str, Any]) -> None:
    ti, term = v["text_interface"], v["termination"]
    stops = set(term["eos_ids"])
    missing = sorted(set(ti["eos_ids"]) - stops)
    if missing and not term["ignore_eos"]:
        raise Rejection(SPECIAL_IDS_DISAGREE, f"tokenizer EOS id {missing[0]} is not in termination.eos_ids", "$.termination.eos_ids")
    for key in ("bos_id", "decoder_start_id"):
        if ti.get(key) is not None and ti[key] in stops:
            raise Rejection(SPECIAL_IDS_DISAGREE, f"{key} {ti[key]} is also an EOS id", f"$.text_interface.{key}")
    if term["min_new_tokens"] > term["max_new_tokens"]:
        raise Rejection(MIN_EXCEEDS_MAX, f"min_new_tokens {term['min_new_tokens']} > max_new_tokens {term['max_new_tokens']}",
                        "$.termination.min_new_tokens")
    if term["min_new_tokens"] > 0 and len(stops) >= ti["vocab_size"]:
        raise Rejection(SPECIAL_IDS_DISAGREE, "every token is EOS, so min_new_tokens leaves an empty support", "$.termination.eos_ids")


def _check_cache_abi(v: Mapping[str, Any], num_valid: int) -> None:
    arch, pv, rt = v["artifact"]["architecture"], v["position_visibility"], v["runtime"]
    if pv["mode"] != MODE_FOR_ARCHITECTURE[arch]:
        raise Rejection(VISIBILITY_INCOMPATIBLE, f"architecture {arch} needs mode {MODE_FOR_ARCHITECTURE[arch]!r}, not {quote(pv['mode'])}",
                        "$.position_visibility.mode")
    prefix = pv.get("prefix_length")
    if (arch == "prefix_lm") != (prefix is not None):
        raise Rejection(VISIBILITY_INCOMPATIBLE, "prefix_length is required exactly for the prefix_lm mode", "$.position_visibility.prefix_length")
    if prefix is not None and prefix > num_valid:
        raise Rejection(VISIBILITY_INCOMPATIBLE, f"prefix_length {prefix} exceeds the {num_valid} valid prompt tokens",
                        "$.position_visibility.prefix_length")
    family, abi = rt["cache_family"], rt["cache_abi"]
    expected = "none" if family == "none" else CACHE_ABI_FOR_ARCHITECTURE[arch]
    if abi != expected:
        raise Rejection(CACHE_ABI_INCOMPATIBLE, f"{arch} with cache_family {family!r} needs cache_abi {expected!r}, not {abi!r}",
                        "$.runtime.cache_abi")
    if arch == "hybrid" and family == "none":
        raise Rejection(CACHE_ABI_INCOMPATIBLE, "a hybrid model carries recurrent state: cache_family cannot be 'none'", "$.runtime.cache_family")
    if (family == "static") != ("static_capacity" in rt):
        raise Rejection(CACHE_ABI_INCOMPATIBLE, "runtime.static_capacity is required exactly for the static cache family",
                        "$.runtime.static_capacity")
    chunk = rt.get("prefill_chunk")
    if chunk is not None:
        if family == "none":
            raise Rejection(CACHE_ABI_INCOMPATIBLE, "chunked prefill needs retained state (cache_family != 'none')", "$.runtime.prefill_chunk")
        if arch == "encoder_decoder":
            raise Rejection(CACHE_ABI_INCOMPATIBLE, "an encoder-decoder decoder prompt is one start token; it has nothing to chunk",
                            "$.runtime.prefill_chunk")
        if prefix is not None and chunk < prefix:
            raise Rejection(CACHE_ABI_INCOMPATIBLE, f"prefill_chunk {chunk} would split the {prefix}-token bidirectional prefix",
                            "$.runtime.prefill_chunk")


def _check_output(v: Mapping[str, Any]) -> None:
    out, rt = v["output"], v["runtime"]
    if out["final_cache"] != "none" and rt["cache_family"] == "none":
        raise Rejection(OUTPUT_UNIMPLEMENTABLE, "a final cache cannot be returned without a cache", "$.output.final_cache")
    if out["final_cache"] == "all_outputs" and not rt["append_repair"]:
        raise Rejection(OUTPUT_UNIMPLEMENTABLE, "final_cache 'all_outputs' needs the append/repair call (runtime.append_repair)",
                        "$.output.final_cache")
    if out["stream"] and v["policy"].get("num_beams", 1) > 1:
        raise Rejection(OUTPUT_UNIMPLEMENTABLE, "beam search cannot stream: no hypothesis is final before the search ends", "$.output.stream")
    plp = out.get("prompt_logprobs")
    if plp is not None:
        if v["artifact"]["architecture"] == "encoder_decoder":
            raise Rejection(OUTPUT_UNIMPLEMENTABLE, "prompt logprobs score decoder prompt rows; an encoder-decoder source has no score rows",
                            "$.output.prompt_logprobs")
        if v["termination"]["max_new_tokens"] == 0 and v["termination"]["zero_new_tokens"] == "no_call":
            raise Rejection(OUTPUT_UNIMPLEMENTABLE, "prompt logprobs come from the prefill, and max_new_tokens 0 under 'no_call' "
                            "makes no call (declare zero_new_tokens 'prefill_only')", "$.output.prompt_logprobs")
        if plp["top_k"] > v["text_interface"]["vocab_size"]:
            raise Rejection(OUTPUT_UNIMPLEMENTABLE, f"prompt_logprobs.top_k {plp['top_k']} exceeds vocab_size "
                            f"{v['text_interface']['vocab_size']}", "$.output.prompt_logprobs.top_k")


def validate_request_envelope(raw: bytes) -> tuple[AdmittedRequest, str]:
    """Validate raw envelope bytes and return the admitted request and its identity.

    Args:
        raw: The envelope as UTF-8 JSON bytes.

    Returns:
        ``(request, identity)`` with ``identity == request.identity == "sha256:<64 hex>"``.

    Raises:
        Rejection: an ``envelope.*``, ``policy.*`` or ``stop.*`` code with the JSON path of the
            offending field (see the module docstring for the order of checks).
        ResourceLimit: ``envelope.too_large``, ``envelope.too_deep``,
            ``envelope.too_many_beams``, ``stop.too_many_patterns``, ``stop.pattern_too_long``.

    Source: M3.10 "Immutable identity versus mutable request state" (``validate_request_envelope``).
    """
    value = parse_raw(raw)
    _structural(value)
    v = _fill_defaults(value, _schema())
    valid = _check_prompt_geometry(v)
    _check_bounds(v, len(valid))
    _check_start_state(v, len(valid))
    _check_vocabulary(v)
    _check_special_ids(v)
    policy = policy_config_from_json(v["policy"], "$.policy")
    _check_cache_abi(v, len(valid))
    _check_output(v)
    if v["termination"]["max_new_tokens"] == 0 and v["termination"]["zero_new_tokens"] == "reject":
        raise Rejection(ZERO_NEW_TOKENS_REJECTED, "max_new_tokens is 0 and the declared G=0 branch is 'reject'",
                        "$.termination.max_new_tokens")
    canonical = canonical_bytes(v)
    identity = identity_of(canonical)
    ordered = _sort_sets(v, _schema())
    request = AdmittedRequest(
        artifact=_section(Artifact, ordered["artifact"]),
        text_interface=_section(TextInterface, ordered["text_interface"]),
        prompt=_section(Prompt, ordered["prompt"]),
        position_visibility=_section(PositionVisibility, ordered["position_visibility"]),
        policy=policy,
        rng=_section(RngSpec, ordered["rng"]),
        runtime=_section(RuntimeSpec, ordered["runtime"]),
        termination=_section(Termination, ordered["termination"]),
        output=_section(OutputSpec, ordered["output"]),
        annotations=tuple(sorted(v.get("annotations", {}).items())),
        identity=identity,
        canonical=canonical,
    )
    return request, identity
