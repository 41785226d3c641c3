"""Capability names of every policy transform and every envelope feature, derived from the schemas.

A runtime declares what it can run (an in-process adapter's ``capabilities()``, a stdio
server's ``start`` handshake).  The gate sends it no case config that needs a capability it did
not declare (:func:`config_capabilities`): a table case, a sweep entry or a corpus trace is then
a skip with the missing names, and the machines draw only declared features
(:func:`decodespec.checks.gate.drawing.case_configs`).  A config the runtime still refuses with
``adapter.unsupported`` is a skip with the runtime's reason, never a failure.

The feature names are derived from the schemas, not listed by hand:

* ``transform:<name>``: every transform object of the M3.8 policy schema
  (:data:`~decodespec.spec.policy.POLICY_JSON_SCHEMA`: ``transforms.items.oneOf[*].name``);
* ``policy.<field>:<value>`` / ``policy.<field>``: the policy object's other fields, by the
  rules below;
* ``<section>.<field>:<value>`` / ``<section>.<field>``: every property of the request
  envelope's runtime-choice sections (``position_visibility``, ``runtime``, ``termination``,
  ``output`` of :func:`~decodespec.spec.envelope.request_schema`), by these rules: an enum names
  each value except its baseline (``<path>:<value>``); a boolean that defaults to ``false``, an
  integer or number with a default, an optional field without one and a list that defaults to
  empty name the field (``<path>``: needed when it is true, away from its default, present, or
  non-empty); a constant, a required field without a default and a string name nothing, nor does
  ``termination.ignore_eos`` (the request's data: which EOS ids stop is ``termination.eos_ids``).

The baseline of an enum is its schema ``default``, else the gate's default (the
:class:`~decodespec.checks.adapters.CaseConfig` field that sets it, :data:`CONFIG_FIELDS`), else
its first value; ``runtime.cache_family`` has none (each family is its own cache ABI, M3.10
0x09).  A feature that protocol version 1 already named keeps its short name
(:data:`SHORT_NAMES`: ``cache:static``, ``stream``, ``sampling``, ...), so every declaration
written before these names existed stays valid.  A field added to the schema (say
``termination.timeout_ms``) gets its name with no change here; a :class:`CaseConfig` field that
sets it is mapped in :data:`CONFIG_FIELDS`.

Source: M3.10 "Immutable request envelope and canonical identity" (the planes and their
fields), 0x09 (the cache ABI); M3.8 0x0B (the transform catalog); issue 22 item 3.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from decodespec.spec.envelope import request_schema
from decodespec.spec.policy import POLICY_JSON_SCHEMA

__all__ = [
    "CASE_ONLY_FEATURES",
    "CONFIG_FIELDS",
    "SECTIONS",
    "SHORT_NAMES",
    "config_capabilities",
    "config_features",
    "config_needs",
    "envelope_features",
    "feature_capabilities",
    "feature_of",
    "missing_capabilities",
    "names_at",
    "policy_feature",
    "sendable_features",
    "transform_capability",
    "undeclared",
]

#: The request envelope's sections whose properties are runtime choices (the rest -- artifact, text interface,
#: prompt, RNG -- is the request's data, which every runtime takes).
SECTIONS = ("position_visibility", "runtime", "termination", "output")
#: Derived name -> the name protocol version 1 gave the same feature (declared by the short name).
SHORT_NAMES: dict[str, str] = {
    "runtime.cache_family:none": "cache:none",
    "runtime.cache_family:dynamic": "cache:dynamic",
    "runtime.cache_family:static": "cache:static",
    "runtime.prefill_chunk": "prefill_chunk",
    "termination.stop_strings": "stop_strings",
    "termination.structured:json": "structured",
    "output.stream": "stream",
    "policy.family:multinomial": "sampling",
    "policy.family:beam": "beam",
}
#: :class:`~decodespec.checks.adapters.CaseConfig` field -> the request-schema property it sets (the gate's form
#: of the envelope; ``policy`` is the M3.8 policy object itself).
CONFIG_FIELDS: dict[str, tuple[str, str]] = {
    "alignment": ("output", "alignment"),
    "structured": ("termination", "structured"),
    "cache": ("runtime", "cache_family"),
    "zero_new_tokens": ("termination", "zero_new_tokens"),
    "final_cache": ("output", "final_cache"),
    "dtype": ("runtime", "compute_dtype"),
    "attention": ("runtime", "attention"),
    "stream": ("output", "stream"),
    "include_stop_str": ("output", "include_stop_str"),
    "stop_strings": ("termination", "stop_strings"),
    "min_new_tokens": ("termination", "min_new_tokens"),
    "max_retries": ("runtime", "max_retries"),
    "static_capacity": ("runtime", "static_capacity"),
    "prefill_chunk": ("runtime", "prefill_chunk"),
    "context_cap": ("termination", "max_total_tokens"),
}
#: Enum properties without a baseline: every value is a feature.
_NO_BASELINE = {("runtime", "cache_family")}
#: Properties of those sections that are the request's data, not a runtime choice: ``termination.ignore_eos`` only
#: says that ``termination.eos_ids`` (the stop set every runtime takes) may leave the tokenizer's EOS out.
_DATA = {("termination", "ignore_eos")}
_ABSENT = object()


def transform_capability(name: str) -> str:
    """``transform:<name>``: the capability of one M3.8 transform."""
    return f"transform:{name}"


def _short(name: str) -> str:
    return SHORT_NAMES.get(name, name)


def _gate_default(section: str, prop: str) -> Any:
    """The :class:`CaseConfig` default of the field that sets ``section.prop``, else ``_ABSENT``."""
    import attrs

    from . import CaseConfig

    for field, path in CONFIG_FIELDS.items():
        if path == (section, prop):
            default = attrs.fields_dict(CaseConfig)[field].default
            return default
    return _ABSENT


class _Feature:
    """How one schema property maps its value to a capability name (``None``: no capability needed)."""

    def __init__(self, path: str, node: Mapping[str, Any], required: bool, baseline: Any = _ABSENT):
        self.path = path
        self.names: dict[Any, str] = {}  # enum value -> name
        self.name: str | None = None  # the field's own name (boolean, number, optional, list)
        self.default = node.get("default", _ABSENT)
        self.kind = "none"
        if "const" in node:
            return
        if "enum" in node:
            values = list(node["enum"])
            base = self.default if self.default is not _ABSENT else baseline
            if base is _ABSENT:
                base = values[0]
            self.kind = "enum"
            self.names = {v: _short(f"{path}:{v}") for v in values if base is None or v != base}
            return
        kind = node.get("type")
        if kind == "boolean" and self.default is False:
            self.kind = "flag"
        elif kind in ("integer", "number") and self.default is not _ABSENT:
            self.kind = "value"
        elif kind == "array" and self.default == []:
            self.kind = "list"
        elif kind in ("integer", "number", "boolean", "array", "object") and not required and self.default is _ABSENT:
            self.kind = "optional"
        if self.kind != "none":
            self.name = _short(path)

    def all_names(self) -> list[str]:
        return list(self.names.values()) if self.kind == "enum" else [self.name] if self.name else []

    def needs(self, value: Any) -> str | None:
        """The capability ``value`` of this property needs, or ``None``."""
        if self.kind == "enum":
            return self.names.get(value)
        if self.kind == "flag":
            return self.name if value is True else None
        if self.kind == "value":
            return self.name if value is not None and value != self.default else None
        if self.kind == "list":
            return self.name if value else None
        if self.kind == "optional":
            return self.name if value is not None else None
        return None


@functools.lru_cache(maxsize=1)
def _envelope_features() -> dict[tuple[str, str], _Feature]:
    schema = request_schema()["properties"]
    out = {}
    for section in SECTIONS:
        node = schema[section]
        required = set(node.get("required", ()))
        for prop, sub in node["properties"].items():
            if (section, prop) in _DATA:
                continue
            baseline = None if (section, prop) in _NO_BASELINE else _gate_default(section, prop)
            out[(section, prop)] = _Feature(f"{section}.{prop}", sub, prop in required, baseline)
    return out


@functools.lru_cache(maxsize=1)
def _policy_features() -> dict[str, _Feature]:
    props = POLICY_JSON_SCHEMA["properties"]
    required = set(POLICY_JSON_SCHEMA.get("required", ()))
    return {prop: _Feature(f"policy.{prop}", node, prop in required) for prop, node in props.items() if prop != "transforms"}


@functools.lru_cache(maxsize=1)
def _transform_names() -> tuple[str, ...]:
    return tuple(item["properties"]["name"]["const"] for item in POLICY_JSON_SCHEMA["properties"]["transforms"]["items"]["oneOf"])


def policy_feature(prop: str, value: Any) -> str | None:
    """The capability that ``value`` of the M3.8 policy field ``prop`` (``order``, ``family``, ``empty_support``) needs, or ``None``.

    Raises:
        KeyError: for a field the policy schema does not have (``transforms``: :func:`transform_capability`).
    """
    return _policy_features()[prop].needs(value)


def feature_of(section: str, prop: str, value: Any) -> str | None:
    """The capability that ``value`` of the request-schema property ``section.prop`` needs, or ``None`` (its baseline).

    Raises:
        KeyError: for a property outside :data:`SECTIONS` or the schema.
    """
    return _envelope_features()[(section, prop)].needs(value)


@functools.lru_cache(maxsize=1)
def feature_capabilities() -> dict[str, str]:
    """Every derived capability name -> the schema path it stands for (envelope properties, policy fields, transforms)."""
    out: dict[str, str] = {}
    for (section, prop), feature in _envelope_features().items():
        for name in feature.all_names():
            out[name] = f"{section}.{prop}"
    for prop, feature in _policy_features().items():
        for name in feature.all_names():
            out[name] = f"policy.{prop}"
    for name in _transform_names():
        out[transform_capability(name)] = f"policy.transforms[name = {name}]"
    return out


@functools.lru_cache(maxsize=1)
def config_features() -> frozenset[str]:
    """The derived capabilities a :class:`~decodespec.checks.adapters.CaseConfig` can need (:func:`config_capabilities`'s range)."""
    names: set[str] = set()
    for section, prop in CONFIG_FIELDS.values():
        names |= set(_envelope_features()[(section, prop)].all_names())
    for feature in _policy_features().values():
        names |= set(feature.all_names())
    names |= {transform_capability(n) for n in _transform_names()}
    return frozenset(names)


#: Envelope features the gate sends through a dedicated case rather than a :class:`~decodespec.checks.adapters.CaseConfig`
#: field (the case ``requires`` the capability; ``tests/test_adapter_capabilities.py`` checks that one does).
CASE_ONLY_FEATURES = frozenset({"output.prompt_logprobs"})  # matrix.prompt_logprobs (M3.10 0x02)


@functools.lru_cache(maxsize=1)
def sendable_features() -> frozenset[str]:
    """:func:`config_features` less the enum values :class:`~decodespec.checks.adapters.CaseConfig` itself refuses
    (``runtime.attention:flash``, ``runtime.compute_dtype:float64``): what the gate can send at all."""
    from decodespec.spec.errors import DecodeSpecError

    from . import CaseConfig

    base = CaseConfig(model="tiny", prompt_ids=(1,))
    envelope = _envelope_features()
    refused = set()
    for field, path in CONFIG_FIELDS.items():
        for value, name in envelope[path].names.items():
            try:
                base.evolve(**{field: value})
            except DecodeSpecError:
                refused.add(name)
    return config_features() - refused


def names_at(*paths: str) -> frozenset[str]:
    """The derived capabilities of the schema paths ``paths`` (``"policy.order"``, ``"output.alignment"``; a transform's
    path is ``policy.transforms``)."""
    wanted = set(paths)
    return frozenset(n for n, path in feature_capabilities().items()
                     if path in wanted or ("policy.transforms" in wanted and path.startswith("policy.transforms[")))


def envelope_features() -> frozenset[str]:
    """The :func:`sendable_features` of the envelope's :data:`SECTIONS` that have no short name (what a peer declared
    implicitly before the names existed)."""
    return frozenset(n for n in sendable_features() if feature_capabilities()[n].split(".", 1)[0] in SECTIONS
                     and n not in SHORT_NAMES.values())


def config_needs(config: Any) -> dict[str, str]:
    """The capabilities a :class:`~decodespec.checks.adapters.CaseConfig` needs, each with the JSON path of the first
    config field that needs it (``$.policy.transforms[0]``, ``$.alignment``): see :func:`config_capabilities`."""
    need: dict[str, str] = {}

    def add(name: str | None, path: str) -> None:
        if name is not None:
            need.setdefault(name, path)

    envelope = _envelope_features()
    policy = config.policy if isinstance(config.policy, Mapping) else {}
    for index, transform in enumerate(policy.get("transforms", ()) or ()):
        if isinstance(transform, Mapping) and isinstance(transform.get("name"), str):
            add(transform_capability(transform["name"]), f"$.policy.transforms[{index}]")
    for prop, feature in _policy_features().items():
        add(feature.needs(policy.get(prop, feature.default if feature.default is not _ABSENT else None)), f"$.policy.{prop}")
    for field, path in CONFIG_FIELDS.items():
        add(envelope[path].needs(getattr(config, field)), f"$.{field}")
    if getattr(config, "num_beams", 1) != 1:
        add(SHORT_NAMES["policy.family:beam"], "$.num_beams")
    if getattr(config, "decode_kernel", "torch") == "native":
        add("decode_kernel:native", "$.decode_kernel")
    return need


def config_capabilities(config: Any) -> frozenset[str]:
    """The capabilities a :class:`~decodespec.checks.adapters.CaseConfig` needs: one per envelope feature it sets away from
    its baseline (:data:`CONFIG_FIELDS`), per policy field value and per transform, plus ``beam`` for ``num_beams > 1``
    and ``decode_kernel:native`` for the native decode kernel.

    Examples: greedy with a ``logit_bias`` transform needs ``{"cache:dynamic", "transform:logit_bias"}``; a streamed
    request with stop strings needs ``stream`` and ``stop_strings``.
    """
    return frozenset(config_needs(config))


def undeclared(config: Any, declared: Iterable[str], runtime: str) -> Any:
    """The ``adapter.unsupported`` refusal of ``config`` by a runtime declaring ``declared``, or ``None`` when it needs nothing
    more: the message names every missing capability, the path the field that needs the first of them."""
    from decodespec.spec.errors import Rejection

    from . import ADAPTER_UNSUPPORTED

    have = frozenset(declared)
    missing = {name: path for name, path in config_needs(config).items() if name not in have}
    if not missing:
        return None
    first = min(missing.values())
    return Rejection(ADAPTER_UNSUPPORTED, f"{runtime} does not declare {sorted(missing)}", first)


def missing_capabilities(configs: Iterable[Any], declared: Iterable[str]) -> list[str]:
    """Sorted capabilities ``configs`` need beyond ``declared``."""
    have = frozenset(declared)
    return sorted(set().union(*(config_capabilities(c) for c in configs)) - have)
