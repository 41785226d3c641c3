"""Hypothesis strategies that draw the whole request envelope the lock-step harness can send.

:func:`case_configs` draws one :class:`~decodespec.checks.adapters.CaseConfig` for a runtime with
given capabilities: every field over its whole range, alone and in combination, where the
runtime declares the capability (a runtime without ``sampling`` gets greedy policies only,
without ``stop_strings`` no stop strings, without ``structured`` no JSON completion,
without ``transform:logit_bias`` no logit bias, without ``output.alignment:text`` token
alignment only -- every feature by its derived name, :mod:`decodespec.checks.adapters.features`;
``decode_kernel = native`` only where ``decode_kernel:native`` is declared; the cache family
is the machine's).  A drawn config never needs an undeclared capability
(:func:`~decodespec.checks.adapters.config_capabilities`):

* **policy** (M3.8 0x0B): the family, every order of :class:`~decodespec.spec.policy.config.Order`
  (the presets and ``explicit``), a subset of the transforms that order has a place for
  (:data:`~decodespec.spec.policy.config.PRESET_ORDERS`; warpers only when sampling; Mirostat v2
  in llama.cpp's Mirostat chain), each parameter drawn over its declared range with its
  finite bounds drawn on purpose (:func:`param_values`), logit biases and bad words on the
  ids that matter (the model's likely outputs, the EOS set), constraint automata, and the
  empty-support policy;
* **output plan**: either the model decides (stop strings are then cut from the reference's
  greedy continuation of the prompt, so they match), or a constraint automaton forces a drawn
  text (ASCII, multi-byte characters, JSON documents), so stop strings can start or end inside
  a token, span tokens, match at the first output, and streams end while an incomplete UTF-8
  tail is held back;
* **stop strings**: up to three, cut from that text, sharing prefixes, nested, extended, or
  unrelated; ``include_stop_str`` and every alignment;
* **EOS**: sets of zero to three ids from the model's EOS, PAD, the ids the output will contain
  and random ids, with ``min_new_tokens`` from 0 to G;
* **the rest**: G from 0 (every ``zero_new_tokens`` branch) up, random prompts (ids anywhere in
  the vocabulary, also outside it: refused), prefill chunk, static capacity (also too small:
  refused), context cap, final cache, retries, stream, dtype, attention, decode kernel, seed.

Source: issue 15 item 4; M3.10 "Boundary cases", 0x06 (stop / stream / EOS), 0x09-0x0B; M3.8
0x0B-0x0F (the transform catalog and presets).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import strategies as st

from decodespec.spec.policy.config import CATALOG, LLAMA_CPP_MIROSTAT_ORDER, PRESET_ORDERS, EmptySupport, Order, ParamSpec, Stage
from decodespec.spec.request import prompt_room

from ..adapters import CaseConfig, config_capabilities
from ..adapters.features import CONFIG_FIELDS, feature_of, policy_feature, transform_capability
from .coverage import EDGE_FRACTION, SCHEMA_ENUMS, schema_enum, unsupported_values
from .prompts import greedy_continuation, prompts_for

__all__ = ["FORCED_TEXTS", "PRACTICAL_MAX", "case_configs", "param_values", "policies"]

#: Upper ends drawn for parameters the catalog leaves unbounded above (the catalog's bounds are used everywhere else).
PRACTICAL_MAX: dict[tuple[str, str], float] = {
    ("temperature", "temperature"): 3.0, ("repetition_penalty", "penalty"): 3.0, ("no_repeat_ngram", "n"): 4,
    ("top_k", "k"): 64, ("top_n_sigma", "n"): 4.0, ("mirostat_v2", "tau"): 8.0, ("mirostat_v2", "eta"): 1.0,
}
#: Texts a constraint automaton can force: ASCII, two-, three- and four-byte characters, JSON documents.
FORCED_TEXTS = ("abab", "The cat", "héllo", "✓ 日本", "a🦙b", '{"a": 1}', '[1, "✓"]', '{"k": {"x": []}}', '"s"', "ab{}")
_ALPHABET = "ab c{}\"é✓日"
_WARPER_STAGES = (Stage.TEMPERATURE, Stage.TRUNCATION)
#: A CaseConfig field's baseline: its default (what it is drawn as when the runtime does not declare the feature).
_BASELINES = {name: attrs.fields_dict(CaseConfig)[name].default for name in CONFIG_FIELDS}


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str):
    from ..adapters.impl import load_tokenizer

    return load_tokenizer(model)


@functools.lru_cache(maxsize=1)
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bytes_of(model: str, ids: Sequence[int]) -> bytes:
    tok = _tokenizer(model)
    special = frozenset(getattr(tok, "special_ids", ()))
    return b"".join(b"" if t in special else tok.token_bytes(t) for t in ids)


def _text_ids(model: str, text: str) -> tuple[int, ...]:
    tok = _tokenizer(model)
    return tuple(tok.encode(text))


def param_values(info_name: str, spec: ParamSpec, vocab: int) -> st.SearchStrategy:
    """Values of one numeric parameter over its declared range, its finite bounds drawn on purpose.

    An inclusive bound is drawn exactly; an exclusive bound as a value inside the
    ``EDGE_FRACTION`` band next to it (what the coverage report counts as that edge); an
    unbounded side ends at :data:`PRACTICAL_MAX` (``top_k`` may also be V, keeping everything).
    """
    lo = spec.minimum if spec.minimum is not None else spec.exclusive_minimum
    hi = spec.maximum if spec.maximum is not None else spec.exclusive_maximum
    top = PRACTICAL_MAX.get((info_name, spec.name), hi)
    span = (hi - lo) if lo is not None and hi is not None else max(1.0, abs(lo or 0.0))
    edges = []
    if lo is not None:
        edges.append(lo if spec.minimum is not None else lo + EDGE_FRACTION * span / 2)
    if hi is not None:
        edges.append(hi if spec.maximum is not None else hi - EDGE_FRACTION * span / 2)
    if spec.kind == "integer":
        inner = st.integers(int(lo if lo is not None else 0), int(top))
        extra = [vocab] if (info_name, spec.name) == ("top_k", "k") else []
        return st.one_of(st.sampled_from([int(e) for e in edges] + extra), inner)
    # Nearer to 0 than the band a penalty like r = 5e-324 overflows float32 (z / r = inf) in the runtime while the
    # float64 spec still accepts it (an open question at the range's ill-conditioned end)
    # (T = 2.7e-76 likewise: z / T = inf), so the inner draws start at the band next to any lower bound, which
    # itself is drawn exactly (inclusive) or inside the band (exclusive).
    low = lo + EDGE_FRACTION * span / 2 if lo is not None else -float(top)
    high = edges[-1] if hi is not None and spec.maximum is None else float(top)
    inner = st.floats(low, high, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from([float(e) for e in edges]), inner) if edges else inner


@st.composite
def _transform(draw, name: str, vocab: int, ids: Sequence[int], forced: Sequence[int] | None) -> dict[str, Any]:
    """One transform object of ``name`` with drawn parameters (``ids``: the ids that matter for biases and bans)."""
    out: dict[str, Any] = {"name": name}
    any_id = st.one_of(st.sampled_from(list(ids)), st.integers(0, vocab - 1)) if ids else st.integers(0, vocab - 1)
    for spec in CATALOG[name].params:
        if spec.kind in ("number", "integer"):
            out[spec.name] = draw(param_values(name, spec, vocab))
        elif spec.kind == "enum":
            choice = draw(st.one_of(st.none(), st.sampled_from(spec.choices)))
            if choice is not None:
                out[spec.name] = choice
        elif spec.kind == "token_bias":
            keys = draw(st.lists(any_id, min_size=1, max_size=3, unique=True))
            out["bias"] = {str(k): draw(st.sampled_from([-1e4, -10.0, -0.5, 0.5, 10.0, 1e4])) for k in keys}
        elif spec.kind == "token_sequences":
            out["sequences"] = draw(st.lists(st.lists(any_id, min_size=1, max_size=2), min_size=1, max_size=2))
        elif spec.kind == "automaton":
            out["automaton"] = _forced_automaton(forced) if forced else draw(_small_automaton(ids, vocab))
    return out


def _forced_automaton(forced: Sequence[int]) -> dict[str, Any]:
    """A cyclic automaton allowing exactly ``forced[i]`` in state ``s<i>`` (the text repeats)."""
    n = len(forced)
    return {"initial": "s0", "transitions": {f"s{i}": {str(t): f"s{(i + 1) % n}"} for i, t in enumerate(forced)}}


@st.composite
def _small_automaton(draw, ids: Sequence[int], vocab: int) -> dict[str, Any]:
    """Two states, each allowing one to three ids (the likely outputs, the EOS set, random ids)."""
    pick = st.one_of(st.sampled_from(list(ids)), st.integers(0, vocab - 1)) if ids else st.integers(0, vocab - 1)
    states = {}
    for s in ("s0", "s1"):
        allowed = draw(st.lists(pick, min_size=1, max_size=3, unique=True))
        states[s] = {str(t): draw(st.sampled_from(["s0", "s1"])) for t in allowed}
    return {"initial": "s0", "transitions": states}


def _declared(caps: frozenset[str] | None, name: str | None) -> bool:
    """Whether a feature is declared (``None``: a baseline value, needing nothing; ``caps`` ``None``: everything is)."""
    return name is None or caps is None or name in caps


@st.composite
def policies(draw, *, sampling: bool, vocab: int, ids: Sequence[int] = (), forced: Sequence[int] | None = None,
             caps: frozenset[str] | None = None) -> dict[str, Any]:
    """An M3.8 policy object: family (multinomial twice as likely as greedy when sampling), order, up to four transforms the
    order has a place for (with parameters), empty support.

    ``forced``: ids a constraint automaton forces in turn (the constraint is then always present).  ``caps``: the
    runtime's declared capabilities; only declared orders, transforms and empty-support values are drawn
    (:func:`~decodespec.checks.adapters.features.config_capabilities`; ``None``: all).
    """
    family = draw(st.sampled_from(["greedy", "multinomial", "multinomial"])) if sampling else "greedy"
    order = draw(st.sampled_from([o for o in Order if _declared(caps, policy_feature("order", o.value))]))
    names = list(CATALOG) if order is Order.EXPLICIT else list(PRESET_ORDERS[order])
    if family == "multinomial" and order is Order.LLAMA_CPP:
        names.append("mirostat_v2")  # llama.cpp's Mirostat chain (LLAMA_CPP_MIROSTAT_ORDER)
    names = [n for n in names if _declared(caps, transform_capability(n))]
    if family != "multinomial":
        names = [n for n in names if CATALOG[n].stage not in _WARPER_STAGES]
    # Each transform equally likely: a Random the draw controls picks them (lists of sampled_from, and permutations,
    # lean toward the first names, so a derandomized run would never draw the catalog's tail).
    rnd = draw(st.randoms(use_true_random=False))
    chosen = rnd.sample(sorted(set(names)), min(len(set(names)), draw(st.integers(0, 4))))
    if forced and "constraint" not in chosen:
        chosen.append("constraint")
    if order is Order.LLAMA_CPP and "mirostat_v2" in chosen:
        chosen = [n for n in chosen if n in LLAMA_CPP_MIROSTAT_ORDER]
    if order is Order.EXPLICIT:
        chosen = draw(st.permutations(chosen)) if chosen else chosen
    transforms = [draw(_transform(n, vocab, ids, forced)) for n in chosen]
    policy: dict[str, Any] = {"family": family, "order": order.value, "transforms": transforms}
    if draw(st.booleans()):
        policy["empty_support"] = draw(st.sampled_from([e.value for e in EmptySupport if _declared(caps, policy_feature("empty_support", e.value))]))
    return policy


@st.composite
def _stop_strings(draw, target: bytes) -> list[str]:
    """Up to three stop strings cut from ``target`` (the bytes the output will likely contain), sharing prefixes, nested or unrelated."""
    out: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["cut", "cut", "extend", "prefix", "inner", "infix", "other"] if out else ["cut", "cut", "other"]))
        s = None
        if kind == "cut" and target:
            start = draw(st.integers(0, len(target) - 1))
            length = draw(st.integers(1, 4))
            for shift in range(4):  # move to the next position that decodes as whole characters
                piece = target[start + shift:start + shift + length]
                try:
                    s = piece.decode("utf-8") if piece else None
                except UnicodeDecodeError:
                    continue
                break
        elif kind == "extend":
            s = draw(st.sampled_from(out)) + draw(st.sampled_from(_ALPHABET))
        elif kind == "prefix":
            base = draw(st.sampled_from(out))
            s = base[:draw(st.integers(1, len(base)))] + draw(st.sampled_from(_ALPHABET))
        elif kind == "infix" and any(len(o) >= 3 for o in out):  # ends where a longer pattern's path runs on
            base = draw(st.sampled_from([o for o in out if len(o) >= 3]))
            s = base[1:2]
        elif kind == "inner":
            base = draw(st.sampled_from(out))
            i = draw(st.integers(0, len(base) - 1))
            s = base[i:i + draw(st.integers(1, len(base)))]
        if not s:
            s = draw(st.text(_ALPHABET, min_size=1, max_size=3))
        if s not in out:
            out.append(s)
    return out


@st.composite
def case_configs(draw, model: str, cache: str, caps: frozenset[str], *, max_new: int = 6) -> CaseConfig:
    """One case config for ``model`` on cache family ``cache`` within ``caps`` (see the module docstring)."""
    from ..adapters.impl import load_model

    tok = _tokenizer(model)
    vocab = int(load_model(model).config.vocab_size)
    pool = prompts_for(model)
    if draw(st.integers(0, 7)) == 0:  # a random prompt anywhere in the vocabulary (rarely one id past it: refused)
        prompt = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6)))
        outside = draw(st.integers(0, 9)) == 0
        if outside:
            prompt = prompt + (vocab,)
    else:
        outside = False
        prompt = pool[draw(st.integers(0, len(pool) - 1))]
    g = draw(st.integers(0, max_new))
    sampling = "sampling" in caps
    forced = None
    forced_text = None
    declared = functools.partial(_declared, caps)
    if declared(transform_capability("constraint")) and draw(st.integers(0, 2)) == 0:
        # a third of the examples force a text (the rest let the model and the policy decide)
        forced_text = draw(st.sampled_from(FORCED_TEXTS))
        forced = _text_ids(model, forced_text)
        likely = tuple(forced[i % len(forced)] for i in range(g + 2))
    else:
        likely = greedy_continuation(model, prompt, g + 2) if max(prompt) < vocab else ()
    eos_model = getattr(tok, "eos_token_id", 2)
    pad = getattr(tok, "pad_token_id", None)
    candidates = sorted({eos_model, *(() if pad is None else (pad,)), *likely})
    eos = draw(st.lists(st.one_of(st.sampled_from(candidates), st.integers(0, vocab - 1)), max_size=3, unique=True))
    policy = draw(policies(sampling=sampling, vocab=vocab, ids=tuple(candidates), forced=forced, caps=caps))
    changes: dict[str, Any] = {}
    if "stop_strings" in caps:
        target = _bytes_of(model, likely)
        changes["stop_strings"] = draw(_stop_strings(target))
        changes["include_stop_str"] = declared(feature_of("output", "include_stop_str", True)) and draw(st.booleans())
    structured = SCHEMA_ENUMS["structured"]
    if "structured" in caps and (forced_text is not None and forced_text[:1] in "{[\"" or draw(st.integers(0, 3)) == 0):
        changes["structured"] = draw(st.sampled_from(schema_enum(structured)))
    refused = unsupported_values()

    def enum(field: str) -> Any:
        return draw(st.sampled_from([v for v in schema_enum(SCHEMA_ENUMS[field]) if v not in refused.get(field, ())
                                     and declared(feature_of(*SCHEMA_ENUMS[field], v))]))

    def field(name: str, value: Any) -> Any:
        """``value`` when the feature it sets is declared, else the field's baseline (the envelope default)."""
        return value if declared(feature_of(*CONFIG_FIELDS[name], value)) else _BASELINES[name]

    cached = cache != "none"
    final_cache = enum("final_cache")
    if final_cache == "all_outputs" and not cached:
        final_cache = "processed_inputs_only"
    need = prompt_room(len(prompt), g)
    capacity = None
    if cache == "static":
        # Always declared (where the runtime declares runtime.static_capacity): a machine's ``reuse`` keeps the cache
        # object, whose slots a default capacity (L + G + 1 of the shorter prompt) would not match -- the spec side
        # accepts that reuse, our runtime refuses it (an open question).
        capacity = field("static_capacity", max(1, need + draw(st.integers(-1, g + 2))))
    dtype = "float32" if draw(st.integers(0, 5)) else enum("dtype")
    kernel = "torch"
    if cache == "static" and "decode_kernel:native" in caps and dtype == "float32" and draw(st.integers(0, 3)) == 0:
        kernel = "native"
    config = CaseConfig(
        model=model,
        prompt_ids=prompt,
        policy=policy,
        max_new_tokens=g,
        # llama.cpp's preset has no place for the min_new_tokens transform both sides add for min_new_tokens > 0:
        # both refuse, but the harness's spec side raises building the LockStep (SpecSide._install), not at admission.
        min_new_tokens=0 if policy["order"] == Order.LLAMA_CPP.value else field("min_new_tokens", draw(st.integers(0, g))),
        eos_ids=eos,
        alignment=enum("alignment"),
        stream="stream" in caps and draw(st.booleans()),
        cache=cache,
        static_capacity=capacity,
        prefill_chunk=draw(st.one_of(st.none(), st.integers(1, len(prompt) + 1))) if cached and "prefill_chunk" in caps else None,
        # Not drawn together: G = 0 under 'reject' with a prompt id outside the vocabulary (the spec side names
        # envelope.zero_new_tokens_rejected, our runtime runtime.invalid_request: an open question of precedence).
        zero_new_tokens="no_call" if outside and g == 0 else enum("zero_new_tokens"),
        final_cache=final_cache,
        max_retries=field("max_retries", draw(st.integers(0, 2))),
        context_cap=field("context_cap", draw(st.one_of(st.none(), st.integers(len(prompt) + 1, len(prompt) + g + 2)))),
        dtype=dtype,
        attention=enum("attention"),
        decode_kernel=kernel,
        seed=draw(st.one_of(st.integers(0, 2**53 - 1), st.none())),
        device="cuda" if _cuda() and draw(st.integers(0, 7)) == 0 else "cpu",
        **changes,
    )
    undeclared = config_capabilities(config) - caps
    assert not undeclared, f"case_configs drew {sorted(undeclared)}, which the runtime does not declare"
    return config


# --------------------------------------------------------------------------------------------
# The sweep: one deterministic lock-step case per declared item the machines reach only by chance.
# --------------------------------------------------------------------------------------------

_SWEEP = "issue 15 item 4 (envelope coverage sweep)"
#: A non-default value per scalar case-config field (the enum fields take every schema value instead).
_FIELD_VALUES: dict[str, Any] = {
    "max_new_tokens": 1, "min_new_tokens": 1, "eos_ids": (2, 5), "stop_strings": ("e",), "include_stop_str": True,
    "stream": True, "prefill_chunk": 2, "max_retries": 1, "seed": 123,
}


def _mid(name: str, spec: ParamSpec) -> Any:
    """A value inside the range of a numeric parameter (the sweep's value for the parameters it does not put at an edge)."""
    if spec.kind == "integer":
        return {"top_k": 5, "no_repeat_ngram": 2}.get(name, 2)
    lo = spec.minimum if spec.minimum is not None else spec.exclusive_minimum
    hi = spec.maximum if spec.maximum is not None else spec.exclusive_maximum
    hi = PRACTICAL_MAX.get((name, spec.name), hi)
    return float((lo + hi) / 2) if lo is not None and hi is not None else float(hi if hi is not None else 1.0)


def _sweep_transform(name: str, likely: Sequence[int], forced: Sequence[int], **values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name}
    for spec in CATALOG[name].params:
        if spec.name in values:
            out[spec.name] = values[spec.name]
        elif spec.kind in ("number", "integer"):
            out[spec.name] = _mid(name, spec)
        elif spec.kind == "token_bias":
            out["bias"] = {str(likely[0]): -10.0, str(likely[1]): 5.0}
        elif spec.kind == "token_sequences":
            out["sequences"] = [[likely[0]]]
        elif spec.kind == "automaton":
            out["automaton"] = _forced_automaton(forced)
    return out


def _held_text(model: str, candidates: Sequence[str]) -> tuple[str, int] | None:
    """A text and k such that its first k tokens end in an incomplete UTF-8 character, or ``None``."""
    from decodespec.spec.stop import decoder_frontier

    for text in candidates:
        ids = _text_ids(model, text)
        for k in range(1, len(ids)):
            data = _bytes_of(model, ids[:k])
            if decoder_frontier(data) < len(data):
                return text, k
    return None


@functools.lru_cache(maxsize=4)
def sweep_cases(model: str) -> tuple[Any, ...]:
    """The sweep's cases on ``model`` (``sweep.*`` ids): each transform in each order with a place for it, each parameter
    edge and ``history`` choice, each schema enum value and scalar field, each EOS shape, each stop-match shape the
    model's tokens allow, and each external close while a stop prefix or an incomplete UTF-8 tail is held back.

    The machines draw all of these and their combinations at random; the sweep makes each one certain, so a full gate
    run's coverage report (:mod:`decodespec.checks.gate.coverage`) does not depend on the draw.
    """
    from .cases import Case
    from .coverage import edge_items, transform_orders

    tok = _tokenizer(model)
    pool = prompts_for(model)
    prompt = pool[2]
    likely = greedy_continuation(model, prompt, 4)
    forced_text = "The cat"
    forced = _text_ids(model, forced_text)
    eos = getattr(tok, "eos_token_id", 2)
    base = CaseConfig(model=model, prompt_ids=prompt, max_new_tokens=2, eos_ids=[eos], seed=5)
    run = ({"op": "run"},)
    sampling = frozenset({"sampling"})
    out: list[Any] = []

    def add(cid: str, what: str, config: CaseConfig, actions: tuple = run, requires: frozenset[str] = frozenset()) -> None:
        out.append(Case(f"sweep.{cid}", "lockstep", what, _SWEEP, config, actions, requires=requires))

    def policy(transform: dict[str, Any], order: str) -> tuple[dict[str, Any], frozenset[str]]:
        name = transform["name"]
        warper = CATALOG[name].stage in _WARPER_STAGES
        return {"family": "multinomial" if warper else "greedy", "order": order, "transforms": [transform]}, sampling if warper else frozenset()

    for name, info in CATALOG.items():
        for order in transform_orders(name):
            pol, req = policy(_sweep_transform(name, likely, forced), order)
            add(f"transform.{name}@{order}", f"{name} alone under the {order} order.", base.evolve(policy=pol), requires=req)
        for spec in info.params:
            for choice in spec.choices:
                pol, req = policy(_sweep_transform(name, likely, forced, **{spec.name: choice}), "default")
                add(f"enum.{name}.{spec.name}.{choice}", f"{name} reading history {choice}.", base.evolve(policy=pol, max_new_tokens=3),
                    requires=req)
    for key, (name, param, side, bound, inclusive) in edge_items().items():
        spec = next(p for p in CATALOG[name].params if p.name == param)
        lo = spec.minimum if spec.minimum is not None else spec.exclusive_minimum
        hi = spec.maximum if spec.maximum is not None else spec.exclusive_maximum
        span = (hi - lo) if lo is not None and hi is not None else max(1.0, abs(bound))
        # An exclusive bound: a value a fifth of the band inside it.  (Half the band, typical p = 0.975, put SmolLM2's
        # first row 6e-7 of mass short of the crossing token: float32 and float64 keep different supports there.)
        value = bound if inclusive else bound + (1 if side == "min" else -1) * EDGE_FRACTION * span / 5
        value = int(value) if spec.kind == "integer" else float(value)
        pol, req = policy(_sweep_transform(name, likely, forced, **{param: value}), "default")
        add(key, f"{name} with {param} = {value} (the {side} edge of its range).", base.evolve(policy=pol, max_new_tokens=3), requires=req)
    refused = unsupported_values()
    for field, path in SCHEMA_ENUMS.items():
        for value in schema_enum(path):
            if value in refused.get(field, ()):
                continue
            config = base.evolve(**{field: value}, max_new_tokens=0 if field == "zero_new_tokens" else 2)
            add(f"enum.{field}.{value}", f"{field} = {value}.", config, () if value == "reject" else run,
                requires=frozenset({f"cache:{value}"}) if field == "cache" else frozenset())
    for field, value in _FIELD_VALUES.items():
        config = base.evolve(**{field: value}, **({"stop_strings": ("e",)} if field == "include_stop_str" else {}))
        add(f"field.{field}", f"{field} = {value!r}.", config,
            requires=frozenset({"stream"} if field == "stream" else {"stop_strings"} if "stop" in field else set()))
    add("field.static_capacity", "A declared static capacity with room to spare.",
        base.evolve(cache="static", static_capacity=len(prompt) + 5), requires=frozenset({"cache:static"}))
    add("field.context_cap", "A context cap one past the prompt: context_length.", base.evolve(context_cap=len(prompt) + 1))
    # EOS shapes (M3.10 0x06): several ids, PAD among them, an empty set, a set whose second id the model selects while
    # min_new_tokens bans the whole set, and one whose second id fires EOS.
    pad = getattr(tok, "pad_token_id", None)
    add("eos.equals_pad", "An EOS set holding the PAD id.", base.evolve(eos_ids=sorted({eos, 0 if pad is None else pad})))
    add("eos.empty", "An empty EOS set.", base.evolve(eos_ids=()))
    add("eos.several_with_min_new_tokens", "EOS = {EOS, the model's first greedy id} with min_new_tokens 2: the whole set is "
        "banned while O < 2.", base.evolve(eos_ids=sorted({eos, likely[0]}), min_new_tokens=2, max_new_tokens=3))
    fire = forced[1] if len(forced) > 1 and forced[1] > eos else likely[0]
    add("eos.fired_not_first", "A forced output whose second id is the larger member of a two-id EOS set: finish eos.",
        base.evolve(policy={"family": "greedy", "transforms": [_sweep_transform("constraint", likely, forced)]},
                    eos_ids=sorted({eos, fire}), max_new_tokens=len(forced) + 1))
    # Stop-match shapes on a forced text, cut from its own token bytes.
    pieces = [_bytes_of(model, [t]) for t in forced]
    stops: dict[str, tuple[str, ...]] = {}
    first = pieces[0].decode("utf-8")
    stops["stop.match_at_first_output"] = (first[:1],)
    stops["stop.include"] = (first[:1],)
    stops["stop.match_spans_tokens"] = (first[-1:] + pieces[1].decode("utf-8")[:1],)
    stops["stop.shared_prefix"] = ((first[-1:] + pieces[1].decode("utf-8")[:1]) + "#", first[-1:] + pieces[1].decode("utf-8")[:1])
    # A stop string inside another, ending where the longer one's path runs on ("e #" then " " on "e c..."): only a
    # matcher that follows suffix links sees the inner one end.
    stops["stop.nested"] = (first[-1:] + pieces[1].decode("utf-8")[:1] + "#", pieces[1].decode("utf-8")[:1])
    wide = next((i for i, p in enumerate(pieces[:-1]) if len(p) >= 2), None)
    if wide is not None:  # multi-byte tokens (SmolLM2): matches that start or end inside one
        text = pieces[wide].decode("utf-8")
        stops["stop.match_starts_inside_token"] = (text[1:] + pieces[wide + 1].decode("utf-8")[:1],)
        stops["stop.match_ends_inside_token"] = (text[:-1],)
    for cid, strings in stops.items():
        add(cid, f"Stop strings {list(strings)} on the forced text {forced_text!r}.",
            base.evolve(policy={"family": "greedy", "transforms": [_sweep_transform("constraint", likely, forced)]},
                        stop_strings=strings, include_stop_str=cid == "stop.include", alignment="text", stream=True,
                        max_new_tokens=len(forced)), requires=frozenset({"stop_strings", "stream"}))
    doc = '{"a": 1}'
    add("finish.structured", f"A forced JSON document {doc!r}: finish structured at its last byte.",
        base.evolve(policy={"family": "greedy", "transforms": [_sweep_transform("constraint", likely, _text_ids(model, doc))]},
                    structured="json", max_new_tokens=len(_text_ids(model, doc)) + 1), requires=frozenset({"structured"}))
    # External closes of a stream while bytes are held back (M3.10 0x06: the flush on cancel / timeout / device error;
    # none after stream_error).
    closes = {
        "cancelled": (({"op": "cancel", "kind": "cancelled"},), frozenset()),
        "timeout": (({"op": "cancel", "kind": "timeout"},), frozenset()),
        "stream_error": (({"op": "stream_fail"},), frozenset()),
        "device_error": (({"op": "launch", "kind": None, "length": None}, {"op": "fault", "kind": "device_fault", "layer": 0},
                          {"op": "complete"}), frozenset({"inflight", "faults"})),
    }
    held_utf8 = _held_text(model, ("✓ 日本", "🦙 ok", "日本語", "ñandú"))
    for reason, (tail, req) in closes.items():
        req = req | {"stream"}
        k = 1
        stop_cfg = base.evolve(policy={"family": "greedy", "transforms": [_sweep_transform("constraint", likely, forced)]},
                               stop_strings=(first[-1:] + "#",), alignment="text", stream=True, max_new_tokens=len(forced))
        add(f"held.{reason}.stop_prefix", f"{reason} after one token while {first[-1:]!r} is held back as a stop prefix.", stop_cfg,
            ({"op": "step"},) * k + tail, requires=req | {"stop_strings"})
        if held_utf8 is not None:
            text, k = held_utf8
            ids = _text_ids(model, text)
            cfg = base.evolve(policy={"family": "greedy", "transforms": [_sweep_transform("constraint", likely, ids)]}, stream=True,
                              max_new_tokens=len(ids))
            add(f"held.{reason}.utf8_tail", f"{reason} after {k} token(s) of {text!r}: an incomplete UTF-8 character is held back.",
                cfg, ({"op": "step"},) * k + tail, requires=req)
    # constraint_error closes the output from outside a commit too (M3.10 0x02 branch table): a constraint that allows
    # exactly the first k tokens leaves the next decision an empty legal set, and the held-back bytes are flushed.
    def ending(ids: Sequence[int]) -> dict[str, Any]:
        states: dict[str, Any] = {f"s{i}": {str(t): f"s{i + 1}"} for i, t in enumerate(ids)}
        return {"family": "greedy", "transforms": [{"name": "constraint", "automaton": {"initial": "s0", "transitions": {
            **states, f"s{len(ids)}": {}}}}]}

    add("held.constraint_error.stop_prefix", f"constraint_error after one token while {first[-1:]!r} is held back as a stop prefix.",
        base.evolve(policy=ending(forced[:1]), stop_strings=(first[-1:] + "#",), alignment="text", stream=True,
                    max_new_tokens=len(forced)), ({"op": "step"},) * 2, requires=frozenset({"stream", "stop_strings"}))
    if held_utf8 is not None:
        text, k = held_utf8
        ids = _text_ids(model, text)
        add("held.constraint_error.utf8_tail", f"constraint_error after {k} token(s) of {text!r}: an incomplete UTF-8 character is "
            "held back.", base.evolve(policy=ending(ids[:k]), stream=True, max_new_tokens=len(ids)), ({"op": "step"},) * (k + 1),
            requires=frozenset({"stream"}))
    return tuple(out)
