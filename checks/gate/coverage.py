"""Envelope coverage of a gate run: which request fields, enum values, transforms, finishes and actions its inputs exercised.

Every lock-step run of the gate (a machine example, a table case, a sweep entry) is fed to the
session's :class:`Coverage` (:func:`record_lockstep`): its case config (the fields it sets away
from their defaults, each enum value, each transform with its preset order and the parameter
edges it reaches, EOS-set and stop-string shapes), every contract action it applied, and what
the observations show (finish reasons, triggers, stop matches starting or ending inside a token,
spanning tokens or matching at the first output, external closes while a stop prefix or an
incomplete UTF-8 tail is held back).  A count is the number of runs that exercised the item.

The declared items (:func:`declared_items`) are derived from the registries, not typed here:

* ``field.<name>``: every :class:`~decodespec.checks.adapters.CaseConfig` field (the gate's
  form of the request envelope), exercised by a run that sets it away from its default;
* ``enum.<field>.<value>``: every value of the request schema's enum behind each config field
  (``spec/schemas/request.v1.json``; :data:`SCHEMA_ENUMS` maps the field to its schema path) and
  the policy enums (family, order, empty support, early stopping; the transforms' ``history``);
  a value :class:`CaseConfig` itself refuses (``attention = flash``, ``compute_dtype = float64``)
  is listed as unsupported by the harness, not declared;
* ``transform.<name>`` and ``transform.<name>@<order>``: every M3.8 transform
  (:data:`~decodespec.spec.policy.config.CATALOG`) and every preset that has a place for it
  (:data:`~decodespec.spec.policy.config.PRESET_ORDERS`, ``explicit`` takes any);
* ``edge.<transform>.<param>.min|max``: each finite bound of a numeric parameter
  (:class:`~decodespec.spec.policy.config.ParamSpec`), reached exactly (inclusive bound) or
  within :data:`EDGE_FRACTION` of the range (exclusive bound);
* ``finish.<reason>`` / ``trigger.<reason>``: :class:`~decodespec.spec.enums.FinishReason`;
  ``held.<reason>.stop_prefix`` / ``held.<reason>.utf8_tail``: each external close
  (:data:`~decodespec.spec.enums.EXTERNAL_FINISH_REASONS`) of a stream with bytes held back;
* ``action.<op>`` and ``action.<op>.<value>``: every contract op
  (:data:`~decodespec.checks.adapters.OPS`) and every value of its enum fields;
* ``stop.*`` / ``eos.*``: the request shapes issue 15 names (:data:`SHAPES`);
* ``padding_side.<side>``, ``beam.width.<k>``: the batch and beam procedures.

:func:`enforced_items` is the declared list restricted to what a runtime declares capabilities
for (a peer without ``stream`` is not asked for held-back closes).

Source: issue 15 item 4; M3.10 "Boundary cases"; M3.8 0x0B-0x0F; research/formal-anchors-survey.md
2 (Hypothesis ``event()``).
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from decodespec.spec.enums import EXTERNAL_FINISH_REASONS, FinishReason
from decodespec.spec.policy.config import CATALOG, LLAMA_CPP_MIROSTAT_ORDER, PRESET_ORDERS, EarlyStopping, EmptySupport, Family, Order
from decodespec.spec.stop import StopConfig, decoder_frontier, step_triggers, stop_holdback, token_ends

from ..adapters import _ENUMS, OPS, CaseConfig
from ..adapters.features import CONFIG_FIELDS, feature_of, policy_feature, transform_capability

__all__ = [
    "EDGE_FRACTION",
    "SCHEMA_ENUMS",
    "SHAPES",
    "Coverage",
    "declared_items",
    "edge_items",
    "enforced_items",
    "record_items",
    "record_lockstep",
    "schema_enum",
    "session_coverage",
    "transform_orders",
    "unsupported_values",
]

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "spec" / "schemas" / "request.v1.json"
#: CaseConfig field -> the request schema's property path of its enum (the enum fields of
#: :data:`~decodespec.checks.adapters.features.CONFIG_FIELDS`).
SCHEMA_ENUMS: dict[str, tuple[str, ...]] = {
    field: path for field, path in CONFIG_FIELDS.items()
    if "enum" in json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))["properties"][path[0]]["properties"][path[1]]
}
#: A value within this fraction of its range from an exclusive bound counts as that edge.
EDGE_FRACTION = 0.05
#: Request shapes without a registry (issue 15 item 4), with what exercises each.
SHAPES: dict[str, str] = {
    "stop.several": "two or more stop strings",
    "stop.shared_prefix": "two stop strings sharing a non-empty prefix",
    "stop.nested": "a stop string inside another",
    "stop.match_starts_inside_token": "a stop match starting inside a token's bytes",
    "stop.match_ends_inside_token": "a stop match ending inside a token's bytes",
    "stop.match_spans_tokens": "a stop match spanning two or more tokens",
    "stop.match_at_first_output": "a stop match ending in the first output token",
    "stop.include": "a matched stop string kept in the text",
    "stop.exclude": "a matched stop string cut from the text",
    "eos.several": "an EOS set of two or more ids",
    "eos.empty": "an empty EOS set",
    "eos.equals_pad": "an EOS set holding the PAD id",
    "eos.several_with_min_new_tokens": "an EOS set of two or more ids with min_new_tokens > 0",
    "eos.fired_not_first": "EOS fired by an id other than the smallest of the set",
}
PADDING_SIDES = ("left", "right")
BEAM_WIDTHS = (1, 2, 3, 4)
_DEFAULTS = {f.name: f.default for f in attrs.fields(CaseConfig)}


@functools.lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def schema_enum(path: Sequence[str]) -> tuple[Any, ...]:
    """The ``enum`` of the request schema's property at ``path`` (e.g. ``("output", "alignment")``)."""
    node = _schema()
    for key in path:
        node = node["properties"][key]
    return tuple(node["enum"])


def _admitted(field: str, value: Any) -> bool:
    base = CaseConfig(model="tiny", prompt_ids=(1,))
    try:
        base.evolve(**{field: value})
    except Exception:  # noqa: BLE001 - CaseConfig refuses it (adapter.invalid_config)
        return False
    return True


def unsupported_values() -> dict[str, tuple[Any, ...]]:
    """Schema enum values the gate's :class:`CaseConfig` refuses (the harness cannot send them), per field."""
    out = {}
    for field, path in SCHEMA_ENUMS.items():
        refused = tuple(v for v in schema_enum(path) if not _admitted(field, v))
        if refused:
            out[field] = refused
    return out


def transform_orders(name: str) -> tuple[str, ...]:
    """The orders with a place for transform ``name`` (``explicit`` has a place for every one)."""
    orders = [o.value for o in Order if o is not Order.EXPLICIT and name in PRESET_ORDERS[o]]
    if name in LLAMA_CPP_MIROSTAT_ORDER and Order.LLAMA_CPP.value not in orders:
        orders.append(Order.LLAMA_CPP.value)
    return tuple(orders) + (Order.EXPLICIT.value,)


def edge_items() -> dict[str, tuple[str, str, str, float, bool]]:
    """``edge.<t>.<p>.<min|max>`` -> (transform, param, side, bound, inclusive) for every finite numeric bound."""
    out = {}
    for t in CATALOG.values():
        for p in t.params:
            if p.kind not in ("number", "integer"):
                continue
            for side, inc, exc in (("min", p.minimum, p.exclusive_minimum), ("max", p.maximum, p.exclusive_maximum)):
                bound = inc if inc is not None else exc
                if bound is not None:
                    out[f"edge.{t.name}.{p.name}.{side}"] = (t.name, p.name, side, float(bound), inc is not None)
    return out


@functools.lru_cache(maxsize=1)
def declared_items() -> dict[str, str]:
    """Every declared item -> its group (see the module docstring)."""
    items: dict[str, str] = {}
    for name in _DEFAULTS:
        items[f"field.{name}"] = "field"
    refused = unsupported_values()
    for field, path in SCHEMA_ENUMS.items():
        for value in schema_enum(path):
            if value not in refused.get(field, ()):
                items[f"enum.{field}.{value}"] = "enum"
    for value in (False, True):
        items[f"enum.stream.{str(value).lower()}"] = "enum"
        items[f"enum.include_stop_str.{str(value).lower()}"] = "enum"
    for cls, key in ((Family, "policy.family"), (Order, "policy.order"), (EmptySupport, "policy.empty_support"),
                     (EarlyStopping, "policy.early_stopping")):
        for member in cls:
            items[f"enum.{key}.{member.value}"] = "enum"
    for t in CATALOG.values():
        items[f"transform.{t.name}"] = "transform"
        for order in transform_orders(t.name):
            items[f"transform.{t.name}@{order}"] = "transform@order"
        for p in t.params:
            if p.kind == "enum":
                for choice in p.choices:
                    items[f"enum.{t.name}.{p.name}.{choice}"] = "enum"
    for key in edge_items():
        items[key] = "edge"
    for reason in FinishReason:
        items[f"finish.{reason.value}"] = "finish"
        items[f"trigger.{reason.value}"] = "trigger"
    for reason in sorted(EXTERNAL_FINISH_REASONS, key=lambda r: r.value):
        for what in ("stop_prefix", "utf8_tail"):
            items[f"held.{reason.value}.{what}"] = "held"
    for op in OPS:
        items[f"action.{op}"] = "action"
    for (op, field), values in _ENUMS.items():
        for value in values:
            items[f"action.{op}.{value}"] = "action"
    for key in SHAPES:
        items[key] = "shape"
    for side in PADDING_SIDES:
        items[f"padding_side.{side}"] = "family"
    for width in BEAM_WIDTHS:
        items[f"beam.width.{width}"] = "family"
    return items


#: Capability -> item prefixes that need it (an item no prefix names needs nothing).
_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("stream", ("held.", "enum.stream.true", "action.stream_fail", "field.stream")),
    ("stop_strings", ("stop.", "field.stop_strings", "field.include_stop_str", "enum.include_stop_str", "trigger.stop_string",
                      "finish.stop_string", "held.")),
    ("structured", ("enum.structured.json", "finish.structured", "trigger.structured", "field.structured")),
    ("sampling", ("enum.policy.family.multinomial", "field.seed")),
    ("snapshot", ("action.snapshot", "action.restore")),
    ("inflight", ("action.launch", "action.complete", "action.fault")),
    ("faults", ("action.fault", "action.recover", "finish.device_error", "trigger.device_error", "held.device_error",
                "field.max_retries")),
    ("decide_commit", ("action.decide", "action.commit")),
    ("reuse", ("action.reuse",)),
    ("prefill_chunk", ("field.prefill_chunk",)),
    ("cache:none", ("enum.cache.none",)),
    ("cache:static", ("enum.cache.static", "field.static_capacity")),
    ("decode_kernel:native", ("field.decode_kernel",)),
)


#: Items a model's tokenizer cannot produce: one byte per token (tiny) has no match inside a token.
_MULTI_BYTE_ONLY = ("stop.match_starts_inside_token", "stop.match_ends_inside_token")


def enforced_items(capabilities: Iterable[str], runtime: str = "impl", *, model: str = "smollm2",
                   cuda: bool | None = None) -> dict[str, str]:
    """The declared items a runtime with ``capabilities`` must exercise in a full gate run on ``model``.

    An item whose transform, policy order or enum value needs a feature capability the runtime does not declare
    (:mod:`decodespec.checks.adapters.features`) is not enforced.
    Warpers (temperature and truncation transforms) need ``sampling``; the padded-batch, beam and
    beam-family items are our runtime's own procedures (``impl`` only); a stop match inside a
    token needs multi-byte tokens (not tiny); ``field.device`` needs CUDA here; an action's parameter
    values (``action.<op>.<value>``) are reported but not enforced (only the random machines reach them).
    """
    caps = frozenset(capabilities)
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    out = {}
    warpers = {t.name for t in CATALOG.values() if t.stage.value in ("temperature", "truncation")}
    for key, group in declared_items().items():
        if any(key.startswith(prefix) for cap, prefixes in _NEEDS if cap not in caps for prefix in prefixes):
            continue
        if group in ("transform", "transform@order", "edge") and "sampling" not in caps and \
                key.split(".")[1].split("@")[0] in warpers:
            continue
        if (group == "family" or key.startswith(("enum.policy.family.beam", "enum.policy.early_stopping"))) \
                and runtime != "impl":
            continue
        if (key in _MULTI_BYTE_ONLY and model == "tiny") or (key == "field.device" and not cuda):
            continue
        beam_family = key.startswith(("enum.policy.family.beam", "enum.policy.early_stopping"))  # our beam procedures, above
        if not beam_family and not _item_capabilities(key) <= caps:  # a transform, order or enum value it does not declare
            continue
        if group == "action" and key.count(".") >= 2:
            # An action's parameter values (``action.launch.decode``, ``action.restore.identity``) are reached
            # only by the random machines, not by the deterministic sweep: reported, not enforced (a full run
            # failed on ``action.launch.decode`` by chance); the op itself (``action.launch``) stays enforced.
            continue
        out[key] = group
    return out


def _item_capabilities(key: str) -> frozenset[str]:
    """The feature capabilities (:mod:`decodespec.checks.adapters.features`) an item needs: its transform, its order, its
    enum value (``transform.top_k@vllm``: ``transform:top_k`` and ``policy.order:vllm``)."""
    kind, _, rest = key.partition(".")
    need: set[str | None] = set()
    if kind in ("transform", "edge") or (kind == "enum" and rest.split(".", 1)[0] in CATALOG):
        name, _, order = rest.split(".", 1)[0].partition("@")
        need.add(transform_capability(name))
        if not order and "@" in rest:
            order = rest.split("@", 1)[1]
        if order:
            need.add(policy_feature("order", order))
    elif kind == "enum" and rest.startswith("policy."):
        field, _, value = rest.removeprefix("policy.").partition(".")
        need.add(policy_feature(field, value))
    elif kind == "enum" and rest.split(".", 1)[0] in SCHEMA_ENUMS:
        field, _, value = rest.partition(".")
        need.add(feature_of(*SCHEMA_ENUMS[field], value))
    need.discard(None)
    return frozenset(need)  # type: ignore[arg-type]


class Coverage:
    """Counts per item of one gate session (:func:`session_coverage`); :meth:`add_run` takes one run's item set."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.runs = 0
        #: Items seen that are not declared (shown in the table, never enforced).
        self.extra: collections.Counter[str] = collections.Counter()

    def add_run(self, items: Iterable[str]) -> None:
        """Record one run (each item counts once per run); items are also reported as Hypothesis events inside a test."""
        seen = set(items)
        self.runs += 1
        declared = declared_items()
        for item in seen:
            (self.counts if item in declared else self.extra)[item] += 1
        _events(seen)

    def missing(self, enforced: Mapping[str, str]) -> list[str]:
        """Enforced items no run exercised (sorted)."""
        return sorted(k for k in enforced if not self.counts.get(k))

    def to_json(self, enforced: Mapping[str, str] | None = None, *, full: bool = False) -> dict[str, Any]:
        """``{"runs", "full_run", "items": [{"item", "group", "count", "enforced"}], "missing", "extra", "unsupported"}``."""
        enforced = enforced if enforced is not None else {}
        return {
            "runs": self.runs,
            "full_run": full,
            "items": [{"item": k, "group": g, "count": self.counts.get(k, 0), "enforced": k in enforced}
                      for k, g in declared_items().items()],
            "missing": self.missing(enforced),
            "extra": dict(sorted(self.extra.items())),
            "unsupported": {k: list(v) for k, v in unsupported_values().items()},
        }

    def table(self, enforced: Mapping[str, str]) -> list[str]:
        """Summary lines: one per group (items exercised / declared, the least-exercised ones), then every missing item."""
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for key, group in declared_items().items():
            groups[group].append(key)
        lines = [f"{self.runs} runs"]
        for group, keys in groups.items():
            hit = [k for k in keys if self.counts.get(k)]
            low = sorted(keys, key=lambda k: (self.counts.get(k, 0), k))[:3]
            lines.append(f"{group:>16}: {len(hit):>3}/{len(keys):<3} exercised; least: "
                         + ", ".join(f"{k} {self.counts.get(k, 0)}" for k in low))
        return lines


def _events(items: set[str]) -> None:
    try:
        from hypothesis import event
        from hypothesis.control import _current_build_context

        if _current_build_context.value is None:
            return
        for item in sorted(items):
            event(item)
    except Exception:  # noqa: BLE001 - outside a Hypothesis test, or an older Hypothesis: counting is enough
        return


_SESSION: Coverage | None = None


def session_coverage() -> Coverage:
    """This process's :class:`Coverage` (created on first use; the gate's conftest reads it at the end)."""
    global _SESSION
    if _SESSION is None:
        _SESSION = Coverage()
    return _SESSION


# --------------------------------------------------------------------------------------------
# What one run exercised.
# --------------------------------------------------------------------------------------------


def config_items(config: CaseConfig) -> set[str]:
    """The items a case config exercises by itself (fields, enums, policy, transforms, edges, EOS / stop shapes)."""
    items: set[str] = set()
    for name, default in _DEFAULTS.items():
        value = getattr(config, name)
        if name in ("model", "prompt_ids"):
            items.add(f"field.{name}")
        elif isinstance(default, attrs.Factory):
            if value != default.factory():
                items.add(f"field.{name}")
        elif value != (tuple(default) if isinstance(default, (list, tuple)) else default):
            items.add(f"field.{name}")
    for field in SCHEMA_ENUMS:
        items.add(f"enum.{field}.{getattr(config, field)}")
    items.add(f"enum.stream.{str(config.stream).lower()}")
    if config.stop_strings:
        items.add(f"enum.include_stop_str.{str(config.include_stop_str).lower()}")
    items |= policy_items(config.policy)
    eos = config.eos_ids
    if len(eos) >= 2:
        items.add("eos.several")
        if config.min_new_tokens > 0:
            items.add("eos.several_with_min_new_tokens")
    if not eos:
        items.add("eos.empty")
    if _pad_id(config.model) in eos:
        items.add("eos.equals_pad")
    stops = [s.encode("utf-8") for s in config.stop_strings]
    if len(stops) >= 2:
        items.add("stop.several")
    for i, a in enumerate(stops):
        for b in stops[i + 1:]:
            if a[:1] == b[:1]:
                items.add("stop.shared_prefix")
            if a != b and (a in b or b in a):
                items.add("stop.nested")
    return items


def policy_items(policy: Mapping[str, Any]) -> set[str]:
    """Family, order, empty-support, early-stopping values, transforms with their order, parameter edges and enums."""
    order = policy.get("order", Order.DEFAULT.value)
    items = {f"enum.policy.family.{policy.get('family')}", f"enum.policy.order.{order}",
             f"enum.policy.empty_support.{policy.get('empty_support', EmptySupport.RAISE.value)}"}
    if policy.get("family") == Family.BEAM.value:
        items.add(f"enum.policy.early_stopping.{policy.get('early_stopping', EarlyStopping.FALSE.value)}")
    edges = edge_items()
    for t in policy.get("transforms", ()):
        name = t.get("name")
        if name not in CATALOG:
            continue
        items |= {f"transform.{name}", f"transform.{name}@{order}"}
        for p in CATALOG[name].params:
            value = t.get(p.name, p.default)
            if p.kind == "enum" and value is not None:
                items.add(f"enum.{name}.{p.name}.{value}")
            if p.kind not in ("number", "integer") or value is None:
                continue
            for side in ("min", "max"):
                key = f"edge.{name}.{p.name}.{side}"
                if key in edges and _at_edge(float(value), p, side):
                    items.add(key)
    return items


def _at_edge(value: float, p: Any, side: str) -> bool:
    lo = p.minimum if p.minimum is not None else p.exclusive_minimum
    hi = p.maximum if p.maximum is not None else p.exclusive_maximum
    inclusive, bound = (p.minimum is not None, lo) if side == "min" else (p.maximum is not None, hi)
    if inclusive:
        return value == bound
    span = (hi - lo) if lo is not None and hi is not None else max(1.0, abs(bound))
    return abs(value - bound) <= EDGE_FRACTION * span


@functools.lru_cache(maxsize=4)
def _pad_id(model: str) -> int | None:
    from ..adapters.impl import load_tokenizer

    return getattr(load_tokenizer(model), "pad_token_id", None)


def run_items(config: CaseConfig, actions: Sequence[Mapping[str, Any]], observations: Sequence[Any], token_bytes: Any) -> set[str]:
    """Everything one lock-step run exercised: its config, its actions and what its observations show.

    Args:
        config: The run's case config.
        actions: The contract actions applied after the reset (``{"op": ...}`` each).
        observations: The observation after each action (``None`` where none was made), same length.
        token_bytes: ``ids -> [bytes per id]`` of the run's model (special and EOS ids give ``b""``).
    """
    items = config_items(config)
    for act in actions:
        op = act.get("op")
        if op not in OPS:
            continue
        items.add(f"action.{op}")
        for (name, field), values in _ENUMS.items():
            if name == op and act.get(field) in values:
                items.add(f"action.{op}.{act[field]}")
    prev = None
    stop_cfg = None
    for obs in observations:
        if obs is None:
            continue
        if obs.finish_reason is not None and (prev is None or prev.finish_reason is None):
            items.add(f"finish.{obs.finish_reason}")
            items |= {f"trigger.{t}" for t in obs.triggers}
            if prev is not None and obs.finish_reason in {r.value for r in EXTERNAL_FINISH_REASONS} and config.stream:
                items |= _held(config, prev, obs.finish_reason, token_bytes)
            if "stop_string" in obs.triggers and obs.output_ids:
                stop_cfg = stop_cfg or _stop_config(config)
                items |= _match_items(stop_cfg, config, list(obs.output_ids), token_bytes)
            if "eos" in obs.triggers and obs.output_ids and len(config.eos_ids) >= 2 and obs.output_ids[-1] != min(config.eos_ids):
                items.add("eos.fired_not_first")
        prev = obs
    return items


def _stop_config(config: CaseConfig) -> StopConfig:
    return StopConfig(max_new_tokens=config.max_new_tokens, eos_ids=frozenset(config.eos_ids), min_new_tokens=config.min_new_tokens,
                      prompt_len=config.prompt_len, max_context_len=None, stop_strings=config.stop_strings,
                      include_stop_str=config.include_stop_str, alignment=config.alignment)


def _held(config: CaseConfig, before: Any, reason: str, token_bytes: Any) -> set[str]:
    """``held.<reason>.*`` when, just before the external close, committed bytes were held back from the stream."""
    data = b"".join(token_bytes(list(before.output_ids)))
    delivered = before.chunks[-1]["byte_end"] if before.chunks else 0
    if delivered >= len(data):
        return set()
    items = set()
    if decoder_frontier(data) < len(data):
        items.add(f"held.{reason}.utf8_tail")
    if config.stop_strings and not config.include_stop_str and stop_holdback(data, [s.encode("utf-8") for s in config.stop_strings]):
        items.add(f"held.{reason}.stop_prefix")
    return items


def _match_items(stop_cfg: StopConfig, config: CaseConfig, ids: list[int], token_bytes: Any) -> set[str]:
    pieces = token_bytes(ids)
    _fired, match, _ = step_triggers(stop_cfg, ids, pieces)
    if match is None:
        return set()
    ends = token_ends(pieces)
    starts = {0} | set(ends)
    items = {"stop.include" if config.include_stop_str else "stop.exclude"}
    if match.start not in starts:
        items.add("stop.match_starts_inside_token")
    if match.end not in ends:
        items.add("stop.match_ends_inside_token")
    first = next(i for i, e in enumerate(ends) if e > match.start)
    last = next(i for i, e in enumerate(ends) if e >= match.end)
    if last > first:
        items.add("stop.match_spans_tokens")
    if last == 0:
        items.add("stop.match_at_first_output")
    return items


def record_items(items: Iterable[str], *, coverage: Coverage | None = None) -> None:
    """Feed one run that is not a lock step (a padded batch, a beam search) by the items it exercised."""
    (coverage or session_coverage()).add_run(items)


def record_lockstep(ls: Any, *, coverage: Coverage | None = None) -> set[str]:
    """Feed one :class:`~decodespec.checks.gate.lockstep.LockStep` run (its config, records and observations) to the session's coverage.

    Returns:
        The items the run exercised.
    """
    if ls is None or not ls.records:
        return set()
    actions = [r.action for r in ls.records[1:]]
    observations = list(ls.observations[1:])
    items = run_items(ls.config, actions, observations, ls.spec.token_bytes)
    (coverage or session_coverage()).add_run(items)
    return items
