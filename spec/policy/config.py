"""M3.8 0x0B The decoding-policy pipeline: the policy configuration, its catalog and presets.

One frozen :class:`PolicyConfig` holds everything that turns a score row into a decision:
the family (greedy, multinomial, beam), the transform order (a named preset or the explicit
list order), every transform with its parameters, the tie rule, the empty-support policy and
the beam parameters.  It is built from JSON by :func:`policy_config_from_json`, which raises a
typed :class:`~decodespec.spec.errors.Rejection` with a ``policy.*`` code and the JSON path of
the offending field; :data:`POLICY_JSON_SCHEMA` is the same contract as a JSON Schema
(draft 2020-12) for embedding into the request-envelope schema.

The transform order is declared data (M3.8 0x0B "Most policy transforms do not commute").
Presets reproduce the documented orders of the peers (``research/peers-survey.md`` B'):

* ``"default"``: the normative order M3.8 0x0B suggests: mandatory suppression / legality ->
  penalties and biases -> temperature -> truncation -> (final legal-support assertion ->
  normalization -> selection, added by the pipeline).
* ``"hf"``: transformers 5.24 ``GenerationMixin._get_logits_processor``
  (``generation/utils.py:1416-1663``): SequenceBias -> RepetitionPenalty -> NoRepeatNGram ->
  NoBadWords -> MinNewTokens -> PrefixConstrained -> Temperature -> TopK -> TopP -> MinP ->
  Typical -> Epsilon -> Eta.
* ``"vllm"``: vLLM v1 ``Sampler`` docstring (``vllm/v1/sample/sampler.py``): allowed-token
  mask -> bad words -> min_tokens -> logit_bias -> repetition, frequency, presence penalties ->
  temperature -> min_p -> top_k -> top_p.
* ``"llama.cpp"``: ``common/sampling.cpp`` default chain (grammar first) -> logit_bias ->
  penalties -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> temperature (last); with
  Mirostat v2 the chain is logit_bias -> temperature -> mirostat_v2.
* ``"explicit"``: the order of the given ``transforms`` list.

A preset has no place for a transform its peer lacks (``policy.transform_not_in_preset``).

Source: M3.8 0x0B, 0x0C-0x0F; HF ``generation/logits_process.py``; vLLM
``vllm/v1/sample/{sampler.py,ops/topk_topp_sampler.py,ops/penalties.py}``; llama.cpp
``src/llama-sampler.cpp``, ``common/sampling.cpp``.

Size: the policy configuration is a catalog: one entry per M3.8 transform with its parameter ranges
and the presets' orders, a table read top to bottom.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from decodespec.spec.errors import Rejection, ResourceLimit, quote
from decodespec.spec.limits import (
    MAX_AUTOMATON_EDGES,
    MAX_AUTOMATON_STATES,
    MAX_BAD_WORD_LENGTH,
    MAX_BAD_WORDS_SEQUENCES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_SAFE_INT,
    MAX_TOKEN_KEY_DIGITS,
)
from decodespec.spec.policy import codes
from decodespec.spec.policy.scores import ScoreKind

__all__ = [
    "CATALOG",
    "POLICY_JSON_SCHEMA",
    "PRESET_ORDERS",
    "TIE_RULE_LOWEST_ID",
    "Automaton",
    "EarlyStopping",
    "EmptySupport",
    "Family",
    "Order",
    "ParamSpec",
    "PolicyConfig",
    "Stage",
    "TransformInfo",
    "TransformSpec",
    "policy_config_from_json",
    "resolve_order",
]


class Family(str, enum.Enum):
    """The selection family: ``greedy`` (argmax), ``multinomial`` (one draw), ``beam``."""

    GREEDY = "greedy"
    MULTINOMIAL = "multinomial"
    BEAM = "beam"


class Order(str, enum.Enum):
    """How the transform list is ordered: a named preset or the explicit list order."""

    DEFAULT = "default"
    HF = "hf"
    VLLM = "vllm"
    LLAMA_CPP = "llama.cpp"
    EXPLICIT = "explicit"


class EmptySupport(str, enum.Enum):
    """What happens when no token keeps a finite score.

    * ``RAISE``: ``policy.empty_support``.
    * ``FALLBACK_EOS``: force the lowest EOS id that is legal (finite after the legality-stage
      transforms alone); if none is legal, ``policy.empty_support``.  Forced, so no draw.
    """

    RAISE = "raise"
    FALLBACK_EOS = "fallback_eos"


class EarlyStopping(str, enum.Enum):
    """Beam termination: HF ``early_stopping`` (``"true"``, ``"false"``, ``"never"``) or ``"exact"``.

    ``"exact"`` is not an HF value: it selects the spec's normative termination (M3.10 0x05
    "exact relative to a declared finite-beam search trace"; ``decodespec.spec.beam.EarlyStop.EXACT``
    with the normative parameters, see ``BeamParams.from_policy``).
    """

    TRUE = "true"
    FALSE = "false"
    NEVER = "never"
    EXACT = "exact"


class Stage(str, enum.Enum):
    """Where a transform sits in the normative pipeline (M3.8 0x0B).

    ``LEGALITY`` and ``PENALTY`` are processors (they run for every family); ``TEMPERATURE``
    and ``TRUNCATION`` are warpers (sampling only).
    """

    LEGALITY = "legality"
    PENALTY = "penalty"
    TEMPERATURE = "temperature"
    TRUNCATION = "truncation"


#: The one declared tie rule: among equal scores the lowest token id (or lowest flat beam
#: index) wins, and top-k keeps exactly k ids by breaking ties at the k-th value toward
#: lower ids.
TIE_RULE_LOWEST_ID = "lowest_id"

HISTORY_CHOICES = ("prompt_and_output", "output")

_TOKEN_KEY = re.compile(r"^(0|[1-9][0-9]*)$")


# ----------------------------------------------------------------------------------------
# Parameter catalog
# ----------------------------------------------------------------------------------------


@attrs.frozen
class ParamSpec:
    """One transform parameter.

    Attributes:
        name: JSON field name.
        kind: ``"number"``, ``"integer"``, ``"enum"``, ``"token_bias"``, ``"token_sequences"``
            or ``"automaton"``.
        required: Whether the field must be present.
        default: Value used when absent (only for optional parameters).
        minimum / maximum: Inclusive bounds (numbers and integers).
        exclusive_minimum / exclusive_maximum: Exclusive bounds.
        choices: Allowed strings for ``"enum"``.
        description: One sentence with units.
    """

    name: str
    kind: str
    required: bool = True
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    choices: tuple[str, ...] = ()
    description: str = ""


@attrs.frozen
class TransformInfo:
    """Catalog entry of one transform.

    Attributes:
        name: The transform name used in JSON and rule ids (``transform.<name>``).
        stage: Its :class:`Stage` in the normative pipeline.
        params: Its parameters, in documentation order.
        stateful: Whether it owns a slot of :class:`~decodespec.spec.policy.decide.PolicyState`
            (at most one such transform per config).
        accepts: Score kinds it accepts.
        returns: Score kind it returns.
    """

    name: str
    stage: Stage
    params: tuple[ParamSpec, ...]
    stateful: bool = False
    accepts: frozenset[ScoreKind] = frozenset({ScoreKind.LOGITS, ScoreKind.LOGPROBS})
    returns: ScoreKind = ScoreKind.LOGITS


_HISTORY = ParamSpec("history", "enum", required=False, default="prompt_and_output", choices=HISTORY_CHOICES,
                     description="Which token history the rule reads: prompt ids + output ids (HF), or output ids only (vLLM bad words).")


def _info(name: str, stage: Stage, *params: ParamSpec, stateful: bool = False) -> TransformInfo:
    return TransformInfo(name=name, stage=stage, params=tuple(params), stateful=stateful)


#: Every transform the policy knows, by name.
CATALOG: dict[str, TransformInfo] = {
    i.name: i
    for i in (
        _info("constraint", Stage.LEGALITY,
              ParamSpec("automaton", "automaton", description="Finite-state automaton: {initial, transitions: {state: {token_id: next_state}}}; the legal set of a state is the ids of its transitions."),
              stateful=True),
        _info("min_new_tokens", Stage.LEGALITY),
        _info("bad_words", Stage.LEGALITY,
              ParamSpec("sequences", "token_sequences", description="Banned token-id sequences; the last id of a sequence is banned when the history ends with the rest."),
              _HISTORY),
        _info("no_repeat_ngram", Stage.LEGALITY,
              ParamSpec("n", "integer", minimum=1, description="n-gram size in tokens; an n-gram already in the history cannot repeat."),
              _HISTORY),
        _info("repetition_penalty", Stage.PENALTY,
              ParamSpec("penalty", "number", exclusive_minimum=0.0, description="Multiplicative penalty r > 0 (dimensionless): z/r if z > 0 else z*r for every id in the history; r > 1 penalizes."),
              _HISTORY),
        _info("frequency_penalty", Stage.PENALTY,
              ParamSpec("penalty", "number", minimum=-2.0, maximum=2.0, description="Logit units subtracted per occurrence of an id in the output ids (OpenAI / vLLM)."),),
        _info("presence_penalty", Stage.PENALTY,
              ParamSpec("penalty", "number", minimum=-2.0, maximum=2.0, description="Logit units subtracted once from every id present in the output ids (OpenAI / vLLM)."),),
        _info("logit_bias", Stage.PENALTY,
              ParamSpec("bias", "token_bias", description="Additive logit bias per token id: {\"<id>\": bias}, finite logit units."),),
        _info("temperature", Stage.TEMPERATURE,
              ParamSpec("temperature", "number", minimum=0.0, description="T >= 0 (dimensionless): z/T for T > 0; T = 0 is the greedy branch, never a division."),),
        _info("top_k", Stage.TRUNCATION,
              ParamSpec("k", "integer", minimum=1, description="Keep exactly the k highest scores (ties at the k-th value broken toward lower ids)."),),
        _info("top_p", Stage.TRUNCATION,
              ParamSpec("p", "number", exclusive_minimum=0.0, maximum=1.0, description="Nucleus mass in (0, 1]: keep the smallest probability-ranked prefix reaching p, including the crossing token; p = 1 keeps everything."),),
        _info("min_p", Stage.TRUNCATION,
              ParamSpec("p", "number", minimum=0.0, maximum=1.0, description="Keep tokens with probability >= p * p_max; p = 0 keeps everything."),),
        _info("typical", Stage.TRUNCATION,
              ParamSpec("p", "number", exclusive_minimum=0.0, exclusive_maximum=1.0, description="Locally typical mass in (0, 1): keep the smallest prefix ranked by |surprisal - entropy| (nats) reaching p."),),
        _info("epsilon", Stage.TRUNCATION,
              ParamSpec("epsilon", "number", exclusive_minimum=0.0, exclusive_maximum=1.0, description="Absolute probability floor in (0, 1); the most probable token is always kept."),),
        _info("eta", Stage.TRUNCATION,
              ParamSpec("epsilon", "number", exclusive_minimum=0.0, exclusive_maximum=1.0, description="Eta cutoff epsilon in (0, 1): floor min(epsilon, sqrt(epsilon) * exp(-H)), H the row entropy in nats."),),
        _info("top_n_sigma", Stage.TRUNCATION,
              ParamSpec("n", "number", exclusive_minimum=0.0, description="Keep logits >= max - n * sigma, sigma the population standard deviation of the finite logits (logit units)."),),
        _info("mirostat_v2", Stage.TRUNCATION,
              ParamSpec("tau", "number", exclusive_minimum=0.0, description="Target surprise in bits; mu starts at 2 * tau."),
              ParamSpec("eta", "number", exclusive_minimum=0.0, description="Controller gain (dimensionless): mu <- mu - eta * (observed surprise - tau)."),
              stateful=True),
    )
}


# ----------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------

#: The documented transform order of each preset (names only; the position is the rank).
PRESET_ORDERS: dict[Order, tuple[str, ...]] = {
    Order.DEFAULT: (
        "constraint", "min_new_tokens", "bad_words", "no_repeat_ngram",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
        "temperature",
        "top_n_sigma", "top_k", "top_p", "min_p", "typical", "epsilon", "eta", "mirostat_v2",
    ),
    Order.HF: (
        "logit_bias", "repetition_penalty", "no_repeat_ngram", "bad_words", "min_new_tokens", "constraint",
        "temperature", "top_k", "top_p", "min_p", "typical", "epsilon", "eta",
    ),
    Order.VLLM: (
        "constraint", "bad_words", "min_new_tokens", "logit_bias",
        "repetition_penalty", "frequency_penalty", "presence_penalty",
        "temperature", "min_p", "top_k", "top_p",
    ),
    Order.LLAMA_CPP: (
        "constraint", "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty",
        "top_n_sigma", "top_k", "typical", "top_p", "min_p", "temperature",
    ),
}

#: llama.cpp's chain when Mirostat v2 is selected (``common/sampling.cpp``: temp -> mirostat_v2).
LLAMA_CPP_MIROSTAT_ORDER: tuple[str, ...] = ("constraint", "logit_bias", "temperature", "mirostat_v2")


# ----------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------


@attrs.frozen
class Automaton:
    """A deterministic finite-state constraint: legal set per state, transition on the emitted token.

    Attributes:
        initial: The start state.
        transitions: ``((state, ((token_id, next_state), ...)), ...)`` sorted by state and id.
            The legal set ``A(s)`` is the token ids listed for ``s``; a state with no entry
            has an empty legal set.

    Source: M3.8 0x0B "Hard constraints define a conditional support" (``s_{t+1} =
    delta(s_t, y_t)``), M3.8 0x0E "Hard constraints and finite-state policy".
    """

    initial: str
    transitions: tuple[tuple[str, tuple[tuple[int, str], ...]], ...]

    @property
    def states(self) -> frozenset[str]:
        """Every declared state."""
        return frozenset(s for s, _ in self.transitions) | {self.initial}

    def legal(self, state: str) -> tuple[int, ...]:
        """The legal token ids in ``state`` (ascending)."""
        for s, edges in self.transitions:
            if s == state:
                return tuple(t for t, _ in edges)
        return ()

    def step(self, state: str, token_id: int) -> str:
        """``delta(state, token_id)``.

        Raises:
            AssertionError: ``token_id`` is not legal in ``state`` (the policy masked it).
        """
        for s, edges in self.transitions:
            if s == state:
                for t, nxt in edges:
                    if t == token_id:
                        return nxt
        raise AssertionError(f"token {token_id} is not legal in constraint state {state!r}")

    def max_token_id(self) -> int:
        """Largest token id named anywhere (-1 when none)."""
        return max((t for _, edges in self.transitions for t, _ in edges), default=-1)

    def to_json(self) -> dict[str, Any]:
        """``{"initial": ..., "transitions": {state: {"<id>": next}}}``."""
        return {"initial": self.initial, "transitions": {s: {str(t): n for t, n in edges} for s, edges in self.transitions}}


@attrs.frozen
class TransformSpec:
    """One configured transform: its catalog name and its normalized parameter values.

    Attributes:
        name: A key of :data:`CATALOG`.
        params: ``((param_name, value), ...)`` in catalog order, defaults filled in.  Values are
            ``float``, ``int``, ``str``, ``tuple[tuple[int, float], ...]`` (token bias, sorted by
            id), ``tuple[tuple[int, ...], ...]`` (token sequences) or :class:`Automaton`.
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def info(self) -> TransformInfo:
        """The catalog entry."""
        return CATALOG[self.name]

    def get(self, key: str) -> Any:
        """The value of parameter ``key``."""
        for k, v in self.params:
            if k == key:
                return v
        raise KeyError(key)

    def to_json(self) -> dict[str, Any]:
        """The transform as its JSON object (parses back to an equal value)."""
        out: dict[str, Any] = {"name": self.name}
        for spec, (key, value) in zip(self.info.params, self.params):
            out[key] = _PARAM_DUMP[spec.kind](value)
        return out

    def token_ids(self) -> list[int]:
        """Every token id named in the parameters (for range checks against V)."""
        ids: list[int] = []
        for key, value in self.params:
            if isinstance(value, Automaton):
                ids.append(value.max_token_id())
            elif key == "bias":
                ids.extend(t for t, _ in value)
            elif key == "sequences":
                ids.extend(t for seq in value for t in seq)
        return ids


@attrs.frozen(cache_hash=True)  # hashed once: policy_digest looks a policy up per decision
class PolicyConfig:
    """The immutable decoding policy of one request (M3.8 0x0B "immutable policy config").

    Attributes:
        family: Selection family.
        order: The requested order (a preset name or ``explicit``).
        transforms: The transforms in the *resolved* order the pipeline applies them.
        tie_rule: Always :data:`TIE_RULE_LOWEST_ID`.
        empty_support: :class:`EmptySupport` policy.
        num_beams: K, the beam width (1 outside the beam family).
        length_penalty: Beam length-penalty exponent alpha (HF ``length_penalty``).
        early_stopping: Beam stopping rule (HF ``early_stopping``).

    Build it with :func:`policy_config_from_json` (validated) or :meth:`greedy`.
    """

    family: Family
    order: Order = Order.DEFAULT
    transforms: tuple[TransformSpec, ...] = ()
    tie_rule: str = TIE_RULE_LOWEST_ID
    empty_support: EmptySupport = EmptySupport.RAISE
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.FALSE

    @classmethod
    def greedy(cls) -> PolicyConfig:
        """The plain greedy policy: no transforms, lowest-id argmax."""
        return cls(family=Family.GREEDY)

    def find(self, name: str) -> TransformSpec | None:
        """The first transform called ``name``, or ``None``."""
        return next((t for t in self.transforms if t.name == name), None)

    @property
    def preset(self) -> str:
        """The order name recorded in receipts (``"default"``, ``"hf"``, ..., ``"explicit"``)."""
        return self.order.value

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object; ``policy_config_from_json(c.to_json()) == c``."""
        return {
            "family": self.family.value,
            "order": self.order.value,
            "transforms": [t.to_json() for t in self.transforms],
            "tie_rule": self.tie_rule,
            "empty_support": self.empty_support.value,
            "num_beams": self.num_beams,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping.value,
        }


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------


def _reject(code: str, message: str, path: str) -> Rejection:
    return Rejection(code, message, path)


def _too_large(what: str, actual: int, limit: int, path: str) -> ResourceLimit:
    return ResourceLimit(codes.TOO_LARGE, f"{what}: {actual} > {limit} (decodespec.spec.limits)", path, {"limit": limit, "actual": actual})


def _check_safe_int(name: str, value: int, path: str) -> None:
    """Every policy integer lies in the I-JSON domain (so it hashes and converts exactly)."""
    if not -MAX_SAFE_INT <= value <= MAX_SAFE_INT:
        raise _reject(codes.INVALID_PARAMETER, f"{name} = {quote(value)} is outside the integer domain "
                      f"[-{MAX_SAFE_INT}, {MAX_SAFE_INT}]", path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_bounds(spec: ParamSpec, value: float, path: str) -> None:
    bad = (
        (spec.minimum is not None and value < spec.minimum)
        or (spec.maximum is not None and value > spec.maximum)
        or (spec.exclusive_minimum is not None and value <= spec.exclusive_minimum)
        or (spec.exclusive_maximum is not None and value >= spec.exclusive_maximum)
    )
    if bad:
        raise _reject(codes.INVALID_PARAMETER, f"{spec.name}={quote(value)} is outside {_range_text(spec)}", path)


def _range_text(spec: ParamSpec) -> str:
    lo = f"[{spec.minimum}" if spec.minimum is not None else (f"({spec.exclusive_minimum}" if spec.exclusive_minimum is not None else "(-inf")
    hi = f"{spec.maximum}]" if spec.maximum is not None else (f"{spec.exclusive_maximum})" if spec.exclusive_maximum is not None else "inf)")
    return f"{lo}, {hi}"


def _parse_number(spec: ParamSpec, value: Any, path: str) -> float:
    if not _is_number(value):
        raise _reject(codes.INVALID_TYPE, f"{spec.name} must be a number, got {type(value).__name__}", path)
    if _is_int(value):
        _check_safe_int(spec.name, value, path)
    value = float(value)
    if not math.isfinite(value):
        raise _reject(codes.INVALID_PARAMETER, f"{spec.name} must be finite", path)
    _check_bounds(spec, value, path)
    number: float = value
    return number


def _parse_integer(spec: ParamSpec, value: Any, path: str) -> int:
    if not _is_int(value):
        raise _reject(codes.INVALID_TYPE, f"{spec.name} must be an integer, got {type(value).__name__}", path)
    _check_safe_int(spec.name, value, path)
    _check_bounds(spec, value, path)
    return int(value)


def _parse_enum(spec: ParamSpec, value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _reject(codes.INVALID_TYPE, f"{spec.name} must be a string", path)
    if value not in spec.choices:
        raise _reject(codes.INVALID_PARAMETER, f"{spec.name}={quote(value)} is not one of {list(spec.choices)}", path)
    return value


def _parse_token_id(value: Any, path: str) -> int:
    if not _is_int(value):
        raise _reject(codes.INVALID_TYPE, "a token id must be an integer", path)
    if value < 0:
        raise _reject(codes.INVALID_PARAMETER, f"token id {quote(value)} is negative", path)
    _check_safe_int("a token id", value, path)
    return int(value)


def _parse_token_key(key: Any, path: str) -> int:
    if not isinstance(key, str) or not _TOKEN_KEY.match(key):
        raise _reject(codes.INVALID_PARAMETER, f"token-id key {quote(key)} must be a decimal non-negative integer string", path)
    if len(key) > MAX_TOKEN_KEY_DIGITS:  # checked before int(): Python refuses (and is quadratic on) huge digit strings
        raise _reject(codes.INVALID_PARAMETER, f"token-id key {quote(key)} has {len(key)} digits; a token id has at most "
                      f"{MAX_TOKEN_KEY_DIGITS}", path)
    tid = int(key)
    _check_safe_int("a token id", tid, path)
    return tid


def _parse_object(value: Any, path: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _reject(codes.INVALID_TYPE, f"{what} must be an object", path)
    return value


def _parse_token_bias(spec: ParamSpec, value: Any, path: str) -> tuple[tuple[int, float], ...]:
    obj = _parse_object(value, path, spec.name)
    if not obj:
        raise _reject(codes.INVALID_PARAMETER, "bias needs at least one token id", path)
    if len(obj) > MAX_LOGIT_BIAS_ENTRIES:
        raise _too_large("logit_bias entries", len(obj), MAX_LOGIT_BIAS_ENTRIES, path)
    out = []
    for key, bias in obj.items():
        tid = _parse_token_key(key, f"{path}.{key}")
        out.append((tid, _parse_number(ParamSpec("bias", "number"), bias, f"{path}.{key}")))
    return tuple(sorted(out))


def _parse_token_sequences(spec: ParamSpec, value: Any, path: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list):
        raise _reject(codes.INVALID_TYPE, f"{spec.name} must be a list of token-id lists", path)
    if not value:
        raise _reject(codes.INVALID_PARAMETER, f"{spec.name} needs at least one sequence", path)
    if len(value) > MAX_BAD_WORDS_SEQUENCES:
        raise _too_large(f"{spec.name}: sequences", len(value), MAX_BAD_WORDS_SEQUENCES, path)
    out = []
    for i, seq in enumerate(value):
        if not isinstance(seq, list):
            raise _reject(codes.INVALID_TYPE, "each sequence must be a list of token ids", f"{path}[{i}]")
        if not seq:
            raise _reject(codes.INVALID_PARAMETER, "a banned sequence cannot be empty", f"{path}[{i}]")
        if len(seq) > MAX_BAD_WORD_LENGTH:
            raise _too_large("banned sequence length", len(seq), MAX_BAD_WORD_LENGTH, f"{path}[{i}]")
        out.append(tuple(_parse_token_id(t, f"{path}[{i}][{j}]") for j, t in enumerate(seq)))
    return tuple(out)


def _parse_automaton(spec: ParamSpec, value: Any, path: str) -> Automaton:
    obj = _parse_object(value, path, spec.name)
    _closed_fields(obj, ("initial", "transitions"), ("initial", "transitions"), path)
    initial = obj["initial"]
    if not isinstance(initial, str):
        raise _reject(codes.INVALID_TYPE, "initial must be a state name (string)", f"{path}.initial")
    table = _parse_object(obj["transitions"], f"{path}.transitions", "transitions")
    if len(table) > MAX_AUTOMATON_STATES:
        raise _too_large("automaton states", len(table), MAX_AUTOMATON_STATES, f"{path}.transitions")
    num_edges = sum(len(edges) for edges in table.values() if isinstance(edges, Mapping))
    if num_edges > MAX_AUTOMATON_EDGES:
        raise _too_large("automaton edges", num_edges, MAX_AUTOMATON_EDGES, f"{path}.transitions")
    transitions = []
    for state, edges in table.items():
        epath = f"{path}.transitions.{state}"
        edges = _parse_object(edges, epath, "a state's transitions")
        parsed = []
        for key, nxt in edges.items():
            tid = _parse_token_key(key, f"{epath}.{key}")
            if not isinstance(nxt, str):
                raise _reject(codes.INVALID_TYPE, "a next state must be a state name (string)", f"{epath}.{key}")
            if nxt not in table:
                raise _reject(codes.INVALID_AUTOMATON, f"next state {quote(nxt)} is not declared", f"{epath}.{key}")
            parsed.append((tid, nxt))
        transitions.append((state, tuple(sorted(parsed))))
    if initial not in table:
        raise _reject(codes.INVALID_AUTOMATON, f"initial state {quote(initial)} is not declared", f"{path}.initial")
    return Automaton(initial=initial, transitions=tuple(sorted(transitions)))


_PARAM_PARSE: dict[str, Callable[[ParamSpec, Any, str], Any]] = {
    "number": _parse_number,
    "integer": _parse_integer,
    "enum": _parse_enum,
    "token_bias": _parse_token_bias,
    "token_sequences": _parse_token_sequences,
    "automaton": _parse_automaton,
}

_PARAM_DUMP: dict[str, Callable[[Any], Any]] = {
    "number": float,
    "integer": int,
    "enum": str,
    "token_bias": lambda v: {str(t): b for t, b in v},
    "token_sequences": lambda v: [list(s) for s in v],
    "automaton": lambda v: v.to_json(),
}


def _closed_fields(obj: Mapping[str, Any], allowed: tuple[str, ...], required: tuple[str, ...], path: str) -> None:
    for key in obj:
        if key not in allowed:
            raise _reject(codes.UNKNOWN_FIELD, f"unknown field {quote(key)} (allowed: {list(allowed)})", f"{path}.{key}")
    for key in required:
        if key not in obj:
            raise _reject(codes.MISSING_FIELD, f"missing required field {key!r}", f"{path}.{key}")


def _parse_transform(obj: Any, path: str) -> TransformSpec:
    obj = _parse_object(obj, path, "a transform")
    if "name" not in obj:
        raise _reject(codes.MISSING_FIELD, "a transform needs a name", f"{path}.name")
    name = obj["name"]
    if not isinstance(name, str):
        raise _reject(codes.INVALID_TYPE, "a transform name must be a string", f"{path}.name")
    info = CATALOG.get(name)
    if info is None:
        raise _reject(codes.UNKNOWN_TRANSFORM, f"unknown transform {quote(name)} (known: {sorted(CATALOG)})", f"{path}.name")
    _closed_fields(obj, ("name", *(p.name for p in info.params)), ("name", *(p.name for p in info.params if p.required)), path)
    params = []
    for spec in info.params:
        if spec.name in obj:
            params.append((spec.name, _PARAM_PARSE[spec.kind](spec, obj[spec.name], f"{path}.{spec.name}")))
        else:
            params.append((spec.name, spec.default))
    return TransformSpec(name=name, params=tuple(params))


def _parse_enum_field(enum_cls: type[enum.Enum], obj: Mapping[str, Any], key: str, default: enum.Enum, path: str) -> Any:
    if key not in obj:
        return default
    value = obj[key]
    if not isinstance(value, str):
        raise _reject(codes.INVALID_TYPE, f"{key} must be a string", f"{path}.{key}")
    try:
        return enum_cls(value)
    except ValueError:
        raise _reject(codes.INVALID_PARAMETER, f"{key}={quote(value)} is not one of {[e.value for e in enum_cls]}", f"{path}.{key}") from None


def resolve_order(order: Order, transforms: tuple[TransformSpec, ...], path: str = "$.policy") -> tuple[TransformSpec, ...]:
    """Put ``transforms`` in the order of preset ``order`` (``explicit`` keeps the list order).

    Args:
        order: The requested order.
        transforms: Parsed transforms in list order; ``transforms[i]`` is at ``{path}.transforms[i]``.
        path: JSON path of the policy object, for errors.

    Returns:
        The transforms in pipeline order.

    Raises:
        Rejection: ``policy.transform_not_in_preset`` (the peer has no such transform),
            ``policy.duplicate_transform`` (a name twice under a preset, or a stateful
            transform twice under ``explicit``).
    """
    seen: dict[str, int] = {}
    for i, t in enumerate(transforms):
        if t.name in seen and (order is not Order.EXPLICIT or t.info.stateful):
            raise _reject(codes.DUPLICATE_TRANSFORM, f"transform {t.name!r} appears twice (first at index {seen[t.name]})", f"{path}.transforms[{i}]")
        seen.setdefault(t.name, i)
    if order is Order.EXPLICIT:
        return transforms
    ranks = PRESET_ORDERS[order]
    if order is Order.LLAMA_CPP and "mirostat_v2" in seen:
        ranks = LLAMA_CPP_MIROSTAT_ORDER
    for i, t in enumerate(transforms):
        if t.name not in ranks:
            raise _reject(codes.TRANSFORM_NOT_IN_PRESET, f"order {order.value!r} has no place for {t.name!r} (its order: {list(ranks)})", f"{path}.transforms[{i}].name")
    return tuple(sorted(transforms, key=lambda t: ranks.index(t.name)))


_TOP_FIELDS = ("family", "order", "transforms", "tie_rule", "empty_support", "num_beams", "length_penalty", "early_stopping")


def policy_config_from_json(obj: Mapping[str, Any], path: str = "$.policy") -> PolicyConfig:
    """Validate a policy JSON object and build the frozen :class:`PolicyConfig`.

    Args:
        obj: The decoded JSON object (see :data:`POLICY_JSON_SCHEMA`), e.g.
            ``{"family": "multinomial", "order": "hf", "transforms": [{"name": "temperature",
            "temperature": 0.7}, {"name": "top_p", "p": 0.9}]}``.
        path: JSON path of ``obj`` inside the enclosing document, prefixed to error paths.

    Returns:
        The config with transforms in resolved pipeline order.

    Raises:
        Rejection: ``policy.invalid_type``, ``policy.missing_field``, ``policy.unknown_field``,
            ``policy.invalid_parameter``, ``policy.unknown_transform``,
            ``policy.duplicate_transform``, ``policy.transform_not_in_preset``,
            ``policy.warper_requires_sampling``, ``policy.invalid_automaton``; each with the JSON
            path of the offending field.  Validation happens before anything is built.

    Source: M3.8 0x00 "Immutable head-to-policy manifest" (policy group), M3.8 0x0B.
    """
    obj = _parse_object(obj, path, "the policy")
    _closed_fields(obj, _TOP_FIELDS, ("family",), path)
    family = _parse_enum_field(Family, obj, "family", Family.GREEDY, path)
    order = _parse_enum_field(Order, obj, "order", Order.DEFAULT, path)
    empty_support = _parse_enum_field(EmptySupport, obj, "empty_support", EmptySupport.RAISE, path)
    early_stopping = _parse_enum_field(EarlyStopping, obj, "early_stopping", EarlyStopping.FALSE, path)
    tie_rule = obj.get("tie_rule", TIE_RULE_LOWEST_ID)
    if not isinstance(tie_rule, str):
        raise _reject(codes.INVALID_TYPE, "tie_rule must be a string", f"{path}.tie_rule")
    if tie_rule != TIE_RULE_LOWEST_ID:
        raise _reject(codes.INVALID_PARAMETER, f"tie_rule={quote(tie_rule)}; the only declared tie rule is {TIE_RULE_LOWEST_ID!r}", f"{path}.tie_rule")
    num_beams = _parse_integer(ParamSpec("num_beams", "integer", minimum=1), obj.get("num_beams", 1), f"{path}.num_beams")
    length_penalty = _parse_number(ParamSpec("length_penalty", "number"), obj.get("length_penalty", 1.0), f"{path}.length_penalty")
    if family is not Family.BEAM:
        for key, neutral in (("num_beams", 1), ("length_penalty", 1.0), ("early_stopping", "false")):
            if key in obj and obj[key] != neutral:
                raise _reject(codes.INVALID_PARAMETER, f"{key} is a beam parameter; family {family.value!r} needs it absent or {neutral!r}", f"{path}.{key}")
    raw = obj.get("transforms", [])
    if not isinstance(raw, list):
        raise _reject(codes.INVALID_TYPE, "transforms must be a list", f"{path}.transforms")
    parsed = tuple(_parse_transform(t, f"{path}.transforms[{i}]") for i, t in enumerate(raw))
    if family is not Family.MULTINOMIAL:
        for i, t in enumerate(parsed):
            if t.info.stage in (Stage.TEMPERATURE, Stage.TRUNCATION):
                raise _reject(codes.WARPER_REQUIRES_SAMPLING, f"{t.name!r} is a sampling warper; family {family.value!r} would ignore it", f"{path}.transforms[{i}].name")
    transforms = resolve_order(order, parsed, path)
    return PolicyConfig(
        family=family,
        order=order,
        transforms=transforms,
        tie_rule=tie_rule,
        empty_support=empty_support,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )


# ----------------------------------------------------------------------------------------
# JSON Schema
# ----------------------------------------------------------------------------------------

_TOKEN_KEY_PATTERN = _TOKEN_KEY.pattern


def _param_schema(spec: ParamSpec) -> dict[str, Any]:
    desc = {"description": spec.description} if spec.description else {}
    if spec.kind in ("number", "integer"):
        out: dict[str, Any] = {"type": spec.kind, **desc}
        for key, attr in (("minimum", "minimum"), ("maximum", "maximum"), ("exclusiveMinimum", "exclusive_minimum"), ("exclusiveMaximum", "exclusive_maximum")):
            if getattr(spec, attr) is not None:
                out[key] = getattr(spec, attr)
        return out
    if spec.kind == "enum":
        return {"enum": list(spec.choices), **desc}
    if spec.kind == "token_bias":
        return {"type": "object", "minProperties": 1, "propertyNames": {"pattern": _TOKEN_KEY_PATTERN}, "additionalProperties": {"type": "number"}, **desc}
    if spec.kind == "token_sequences":
        return {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}, **desc}
    assert spec.kind == "automaton", spec.kind
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["initial", "transitions"],
        "properties": {
            "initial": {"type": "string"},
            "transitions": {
                "type": "object",
                "additionalProperties": {"type": "object", "propertyNames": {"pattern": _TOKEN_KEY_PATTERN}, "additionalProperties": {"type": "string"}},
            },
        },
        **desc,
    }


def _transform_schema(info: TransformInfo) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", *(p.name for p in info.params if p.required)],
        "properties": {"name": {"const": info.name}, **{p.name: _param_schema(p) for p in info.params}},
    }


#: JSON Schema (draft 2020-12 vocabulary, no ``$schema``/``$id`` so it embeds as a subschema)
#: of the object :func:`policy_config_from_json` accepts.  The function additionally checks
#: what a schema cannot: automaton state references, preset membership, duplicates, beam-only
#: fields outside the beam family and warpers outside sampling.
POLICY_JSON_SCHEMA: dict[str, Any] = {
    "title": "decodespec decoding policy (M3.8 0x0B)",
    "type": "object",
    "additionalProperties": False,
    "required": ["family"],
    "properties": {
        "family": {"enum": [f.value for f in Family]},
        "order": {"enum": [o.value for o in Order], "default": Order.DEFAULT.value},
        "transforms": {"type": "array", "items": {"oneOf": [_transform_schema(i) for i in CATALOG.values()]}, "default": []},
        "tie_rule": {"const": TIE_RULE_LOWEST_ID, "default": TIE_RULE_LOWEST_ID},
        "empty_support": {"enum": [e.value for e in EmptySupport], "default": EmptySupport.RAISE.value},
        "num_beams": {"type": "integer", "minimum": 1, "default": 1},
        "length_penalty": {"type": "number", "default": 1.0},
        "early_stopping": {"enum": [e.value for e in EarlyStopping], "default": EarlyStopping.FALSE.value},
    },
}
