"""The runtime adapter contract of the conformance gate: case configs, actions, results, observations.

The gate (``pytest checks/``, ``decodespec check``, ``decodespec replay``) drives the spec and a
runtime in lock step.  A runtime takes part through an **adapter** that only *translates*: it
builds a request from a :class:`CaseConfig`, applies one JSON action at a time and reports an
:class:`Observation` (the observable projection of its state).  The harness does every
comparison (the ladder, :mod:`decodespec.checks.gate.ladder`); an adapter never judges.

Two forms share this contract: an in-process Python class implementing :class:`Adapter`
(our runtime: :mod:`decodespec.checks.adapters.impl`; HF transformers, llama.cpp), and a
JSON-lines process over stdin/stdout for any other language, whose messages are defined by
:mod:`decodespec.checks.adapters.wire` (Bowtie-style ``start`` handshake).

Case config
    :class:`CaseConfig` (frozen, JSON-serialisable, :meth:`CaseConfig.to_json` /
    :meth:`CaseConfig.from_json`): model (``tiny`` / ``smollm2``), prompt ids, the M3.8 policy
    JSON object, ``max_new_tokens`` (G), ``min_new_tokens``, EOS ids, stop strings, output
    alignment, structured completion, cache family (``none`` / ``dynamic`` / ``static``),
    static capacity, prefill chunk, dtype, device, attention implementation, seed, beam
    width, plus the G=0 branch, the final-cache promise (repair call), the retry budget, the
    stream flag and an optional context cap.  :meth:`CaseConfig.identity` is the request
    identity every party uses (it keys the request RNG with the seed).

Reset
    ``reset(config)`` builds and **admits** the request: afterwards the phase is ``ready``
    (or ``finished`` with ``length`` for G = 0 under ``zero_new_tokens = "no_call"``).  A
    config the runtime refuses raises :class:`~decodespec.spec.errors.Rejection` (or
    ``ResourceLimit``) with a registered code (``envelope.zero_new_tokens_rejected``,
    ``runtime.invalid_request``, ``adapter.unsupported`` for a capability it lacks ...).

Actions (:data:`OPS`; validate with :func:`check_action`)
    JSON objects ``{"op": <name>, ...}``; receipt ids are the spec's (``"receipt-<n>"``, n the
    0-based decision number of the request), so duplicate and stale receipts replay the same
    way on every runtime.

    ==============  ========================================  ========================================
    op              fields                                    meaning (spec actions)
    ==============  ========================================  ========================================
    ``prefill``     ``chunk``: rows, or ``null`` (the rest)   launch + complete one prefill call
    ``decode``      --                                        launch + complete the decode call
    ``launch``      ``kind``?, ``length``? (default: due)     launch the due call; stays in flight
    ``complete``    --                                        complete the in-flight call
    ``decide``      --                                        policy decision on the current score
    ``commit``      ``receipt``: id or ``null`` (pending)     consume the receipt exactly once
    ``step``        --                                        next call(s) + decide + commit
    ``run``         --                                        ``step`` until terminal (repair too)
    ``cancel``      ``kind``: ``cancelled`` / ``timeout``     at the current interrupt point
    ``fault``       ``kind``: ``device_fault`` /              a fault of the in-flight call
                    ``missing_lane``; ``layer``? (0)          (``rank_kill`` / ``rank_stall`` on
                    / ``rank_kill`` / ``rank_stall``;         ``rank``?: one rank process of a
                    ``rank``? (0)                             tensor-parallel call dies / stalls
                                                              before ``layer``: spec ``device_fault``)
    ``recover``     --                                        recover a quarantined handle
    ``repair``      --                                        launch + complete the repair call
    ``snapshot``    ``form``; ``id``? (handle name)           ``pending_suffix`` / ``repaired``
    ``restore``     ``snapshot``: handle; ``corrupt``?        restore into a fresh request
    ``reuse``       ``prompt_ids``; ``max_new_tokens``?       reset onto the same cache object
    ``stream_fail`` --                                        the streamer fails
    ==============  ========================================  ========================================

    ``snapshot`` returns ``{"snapshot": handle}`` (the given ``id``, else one the adapter
    names); a ``repaired`` snapshot with a pending token first runs the valid append call
    (decode between calls, repair after finish).  ``restore`` with ``corrupt`` (one of
    :data:`CORRUPTIONS`) restores a deliberately broken copy (:func:`corrupt_record`), which
    must be refused.  ``reuse`` is the static-cache reuse case: a new request (the config with
    the new prompt) on the **same cache object**, which must forget every row.

Apply
    ``apply(action) -> ApplyResult``: ``ok`` with optional ``data`` (``decide``:
    ``receipt_id``, ``token_id``, ``logprob``, ``draws``; ``commit``: ``receipt_id``,
    ``token_id``, ``triggers``; ``launch``: ``call_id``, ``kind``, ``start``, ``length``;
    ``complete``: ``selection``, ``reason``; ``snapshot``: ``snapshot``), or ``rejected`` with
    the typed error's ``code`` and ``message`` -- and then **nothing changed** (the harness
    checks the observation).  ``step`` and ``run`` are loops of controller actions: a refused
    one ends the loop with its refusal, and the actions before it stand (the harness then
    judges the observation against the spec state after those actions).  An op outside the adapter's capabilities is rejected with
    ``adapter.unsupported``; the harness never sends one knowingly.

Observation
    :class:`Observation`; a field that is ``None`` is *not exposed* by the runtime and is
    skipped by the comparator (our runtime exposes every field).  Arrays are numpy in-process
    and ``{"dtype", "shape", "base64"}`` on the wire.

Capabilities (:data:`CAPABILITIES`)
    The ops and probes (:data:`OP_AND_PROBE_CAPABILITIES`): ``decide_commit`` (separate decide /
    commit ops), ``inflight`` (launch / complete / cancel in flight), ``faults``, ``snapshot``,
    ``reuse``, ``logits`` (the raw score row), ``policy_rows`` (the processed-row probe),
    ``cache_probe`` (committed K/V rows), ``decode_kernel:native``; :data:`OP_CAPABILITIES`
    names what each op needs.  And one name per policy transform (``transform:logit_bias``) and
    per envelope feature (``output.alignment:text``, ``termination.min_new_tokens``; the first
    names keep their short form: ``cache:none`` / ``cache:dynamic`` / ``cache:static``,
    ``prefill_chunk``, ``stop_strings``, ``structured``, ``stream`` (stream chunks,
    ``stream_fail``), ``sampling`` (multinomial policies with the request RNG), ``beam``),
    derived from the schemas (:mod:`decodespec.checks.adapters.features`);
    :func:`config_capabilities` names what a case config needs.  The gate sends no config
    outside the declared names, and a config refused with ``adapter.unsupported`` is a skip.

Runtimes
    :func:`open_adapter` resolves ``impl``, ``hf``, ``llamacpp``, ``stdio:CMD`` and ``engine:CMD``
    (:mod:`decodespec.checks.adapters.engine`: the gate's controller over a process that answers model calls): module
    ``decodespec.checks.adapters.<name>`` exposes ``available() -> str | None`` (``None`` when
    usable, else the skip reason) and ``create(**options) -> Adapter``.

Source: research/formal-anchors-survey.md 0 (quint-connect / Bowtie adapter contract: reset,
apply -> ok | rejected, observe a projection; comparison in the harness), 5.4 (Bowtie IHOP);
/work/shared/DESIGN.md "Other runtimes"; M3.10 "Correctness matrix" (what is compared),
0x0BA (the observable fields: positions, frontiers, selected id, logprob, RNG counter, finish
reason, stream chunks with offsets, cache lengths).

Size: the adapter contract: case config, actions, results, observation and the Adapter protocol,
which every adapter and the gate import together.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import rfc8785

from decodespec.spec.enums import PendingTag
from decodespec.spec.envelope import CACHE_ABI_FOR_ARCHITECTURE, SCHEMA_NAME
from decodespec.spec.errors import Rejection, quote_content, register_code
from decodespec.spec.request import static_capacity as request_static_capacity
from decodespec.spec.snapshot import SnapshotRecord

__all__ = [
    "ADAPTER_INVALID_ACTION",
    "ADAPTER_INVALID_CONFIG",
    "ADAPTER_PROTOCOL",
    "ADAPTER_UNSUPPORTED",
    "CAPABILITIES",
    "COMMAND_RUNTIMES",
    "CORRUPTIONS",
    "MODELS",
    "OPS",
    "OP_AND_PROBE_CAPABILITIES",
    "OP_CAPABILITIES",
    "RANK_FAULTS",
    "Adapter",
    "AdapterUnavailable",
    "ApplyResult",
    "CaseConfig",
    "ModelFacts",
    "Observation",
    "check_action",
    "config_capabilities",
    "corrupt_record",
    "no_controller_action",
    "open_adapter",
    "parse_runtime",
    "required_capabilities",
]

_SECTION = "docs/design.md (conformance gate: adapter contract)"
ADAPTER_INVALID_CONFIG = register_code(
    "adapter.invalid_config", "rejection", _SECTION,
    "A case config is not a decodespec case: a missing, unknown or mistyped field, or a value outside its domain.")
ADAPTER_INVALID_ACTION = register_code(
    "adapter.invalid_action", "rejection", _SECTION,
    "An action is not a JSON object with a known 'op' and exactly that op's fields of the right types.")
ADAPTER_UNSUPPORTED = register_code(
    "adapter.unsupported", "rejection", _SECTION,
    "The runtime does not declare the capability an action or a case config needs.")
ADAPTER_PROTOCOL = register_code(
    "adapter.protocol", "rejection", _SECTION,
    "A JSON-lines adapter message is malformed, out of order, or the adapter process answered with an error.")

#: Models the gate runs.
MODELS = ("tiny", "smollm2")
#: The capabilities that are not envelope features: the contract ops a runtime can take apart (separate decide /
#: commit, calls in flight, faults, snapshots, cache reuse), what it can show (raw rows, processed rows, K/V rows)
#: and our native decode kernel.  :data:`CAPABILITIES` adds the envelope's (:mod:`.features`).
OP_AND_PROBE_CAPABILITIES = frozenset({
    "decide_commit", "inflight", "faults", "snapshot", "logits", "policy_rows", "cache_probe", "reuse", "decode_kernel:native",
    "rank_faults",
})
#: Fault kinds that act on one rank process of a tensor-parallel call (capability ``rank_faults``); the spec sees the
#: participant missing from the call's roster: ``Fault("device_fault")`` (M3.10 0x0A "A missing participant ... selects
#: ALL_OLD").
RANK_FAULTS = ("rank_kill", "rank_stall")
#: Deliberate corruptions of a snapshot's logical record a restore must refuse (:func:`corrupt_record`).
CORRUPTIONS = ("identity", "processed_plus_one", "pending_dropped", "repaired_with_pending", "rng_counter")

_INT = "int"
_OPT_INT = "int?"
_STR = "str"
_OPT_STR = "str?"
_IDS = "ids"

#: op -> {field: type tag, ...} (fields marked ``?`` may be absent or null).
OPS: dict[str, dict[str, str]] = {
    "prefill": {"chunk": _OPT_INT},
    "decode": {},
    "launch": {"kind": _OPT_STR, "length": _OPT_INT},
    "complete": {},
    "decide": {},
    "commit": {"receipt": _OPT_STR},
    "step": {},
    "run": {},
    "cancel": {"kind": _STR},
    "fault": {"kind": _STR, "layer": _OPT_INT, "rank": _OPT_INT},
    "recover": {},
    "repair": {},
    "snapshot": {"form": _STR, "id": _OPT_STR},
    "restore": {"snapshot": _STR, "corrupt": _OPT_STR},
    "reuse": {"prompt_ids": _IDS, "max_new_tokens": _OPT_INT},
    "stream_fail": {},
}
_REQUIRED = {op: tuple(k for k, t in fields.items() if not t.endswith("?")) for op, fields in OPS.items()}
_ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("launch", "kind"): ("prefill", "decode", "repair"),
    ("cancel", "kind"): ("cancelled", "timeout"),
    ("fault", "kind"): ("device_fault", "missing_lane", "rank_kill", "rank_stall"),
    ("snapshot", "form"): ("pending_suffix", "repaired"),
    ("restore", "corrupt"): CORRUPTIONS,
}

#: op -> capabilities it needs (every one of them).
OP_CAPABILITIES: dict[str, frozenset[str]] = {
    "prefill": frozenset(), "decode": frozenset(), "step": frozenset(), "run": frozenset(),
    "launch": frozenset({"inflight"}), "complete": frozenset({"inflight"}),
    "decide": frozenset({"decide_commit"}), "commit": frozenset({"decide_commit"}),
    "cancel": frozenset(), "fault": frozenset({"faults", "inflight"}), "recover": frozenset({"faults"}),
    "repair": frozenset(), "snapshot": frozenset({"snapshot"}), "restore": frozenset({"snapshot"}),
    "reuse": frozenset({"reuse"}), "stream_fail": frozenset({"stream"}),
}


def check_action(action: Any) -> dict[str, Any]:
    """Validate one action and return it as a plain dict with every optional field filled (``None``).

    Raises:
        Rejection: ``adapter.invalid_action`` naming the offending field.
    """
    if not isinstance(action, Mapping) or not isinstance(action.get("op"), str):
        raise Rejection(ADAPTER_INVALID_ACTION, f"an action is a JSON object with a string 'op', got {action!r}", "$.op")
    op = action["op"]
    if op not in OPS:
        raise Rejection(ADAPTER_INVALID_ACTION, f"unknown op {op!r}; expected one of {sorted(OPS)}", "$.op")
    fields = OPS[op]
    extra = sorted(set(action) - set(fields) - {"op"})
    if extra:
        raise Rejection(ADAPTER_INVALID_ACTION, f"op {op!r} takes no field(s) {extra}", f"$.{extra[0]}")
    out: dict[str, Any] = {"op": op}
    for name, tag in fields.items():
        value = action.get(name)
        path = f"$.{name}"
        if value is None:
            if not tag.endswith("?"):
                raise Rejection(ADAPTER_INVALID_ACTION, f"op {op!r} needs field {name!r}", path)
            out[name] = None
            continue
        base = tag.rstrip("?")
        if base == _INT and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise Rejection(ADAPTER_INVALID_ACTION, f"{name} must be a non-negative integer, got {value!r}", path)
        if base == _STR and not isinstance(value, str):
            raise Rejection(ADAPTER_INVALID_ACTION, f"{name} must be a string, got {value!r}", path)
        if base == _IDS:
            if not isinstance(value, (list, tuple)) or not value or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_SAFE_ID for t in value):
                raise Rejection(ADAPTER_INVALID_ACTION, f"{name} must be a non-empty list of token ids, got {value!r}", path)
            value = [int(t) for t in value]
        allowed = _ENUMS.get((op, name))
        if allowed is not None and value not in allowed:
            raise Rejection(ADAPTER_INVALID_ACTION, f"{name} must be one of {list(allowed)}, got {value!r}", path)
        out[name] = value
    return out


def no_controller_action(phase: str) -> Rejection:
    """The refusal of ``step`` / ``run`` when the controller has nothing left to do (a terminal request).

    ``transition.not_enabled`` with ``details`` naming the pseudo rule ``controller`` and its guard,
    so the spec side and every adapter refuse it the same way.
    """
    return Rejection("transition.not_enabled", f"no controller action is enabled in phase {phase} (terminal)", "$.op",
                     details={"rule": "controller", "guard": "the request is not terminal"})


def required_capabilities(action: Mapping[str, Any], config: CaseConfig | None = None) -> frozenset[str]:
    """Capabilities an action needs (chunked prefill also needs ``prefill_chunk``)."""
    need = set(OP_CAPABILITIES[action["op"]])
    if action["op"] == "prefill" and action.get("chunk") is not None:
        need.add("prefill_chunk")
    if action["op"] == "fault" and action.get("kind") in RANK_FAULTS:
        need.add("rank_faults")
    return frozenset(need)


# --------------------------------------------------------------------------------------------
# Case config.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ModelFacts:
    """What a case's envelope states about the model it runs on (the artifact and text-interface planes).

    Attributes:
        release_id: The model's name (``tiny``, ``smollm2``).
        checkpoint_sha256: ``"sha256:<hex>"`` of the checkpoint file.
        tokenizer_sha256: ``"sha256:<hex>"``: the tokenizer's ordered vocabulary hash.
        vocab_size: V.
        window: The model's context window (positions): the envelope's ``max_context``.
        eos_ids: The tokenizer's EOS ids (empty when it declares none).
        bos_id: The tokenizer's BOS id, or ``None``.
    """

    release_id: str
    checkpoint_sha256: str
    tokenizer_sha256: str
    vocab_size: int
    window: int
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None


#: Largest token id a case config holds: I-JSON's exact integer range (the identity is RFC 8785 JSON).
MAX_SAFE_ID = 2**53 - 1


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class CaseConfig:
    """One conformance case's request (frozen; JSON via :meth:`to_json` / :meth:`from_json`).

    Attributes:
        model: ``"tiny"`` (seeded random Llama, ``ByteTokenizer``) or ``"smollm2"``.
        prompt_ids: The L prompt token ids (L >= 1).
        policy: The M3.8 policy JSON object (``decodespec.spec.policy.POLICY_JSON_SCHEMA``).
        max_new_tokens: G >= 0.
        min_new_tokens: EOS and stop strings are suppressed while O < this.
        eos_ids: The termination EOS set.
        stop_strings: Stop strings (matched on output bytes).
        include_stop_str: Whether a matched stop string stays in the returned text.
        alignment: Output alignment ``token`` (the envelope's default) / ``text`` / ``span``.
        structured: ``"none"`` or ``"json"``.
        stream: Whether the output streams (chunks; ``stream_fail`` applies).
        cache: ``"none"``, ``"dynamic"`` or ``"static"``.
        static_capacity: Static-cache slots S (default chosen by the runtime: L + G + 1).
        prefill_chunk: Largest prefill chunk, or ``None`` (one-shot prefill).
        zero_new_tokens: G = 0 branch ``reject`` / ``no_call`` / ``prefill_only``.
        final_cache: ``processed_inputs_only`` or ``all_outputs`` (the repair call at finish).
        max_retries: Failed calls retried after recovery before ``device_error``.
        context_cap: Bound on L + O (``None``: the model window and the capacity only).
        dtype: Model dtype (``float32``, ``bfloat16``, ``float16``).
        device: ``cpu`` or ``cuda[:N]``.
        attention: ``sdpa`` or ``eager``.
        decode_kernel: ``torch`` or ``native`` (:mod:`decodespec.impl.native`: one-row float32 CPU
            decode calls on a static cache run in the C kernel; needs the ``decode_kernel:native``
            capability).
        seed: Request seed (keys the RNG with :meth:`identity`), or ``None``.
        num_beams: Beam width (1: single-path decoding).

    Units: tokens for every length and count.
    """

    model: str
    prompt_ids: tuple[int, ...] = attrs.field(converter=_ids)
    policy: dict[str, Any] = attrs.field(factory=lambda: {"family": "greedy"}, hash=False)
    max_new_tokens: int = 8
    min_new_tokens: int = 0
    eos_ids: tuple[int, ...] = attrs.field(default=(), converter=lambda v: tuple(sorted(int(i) for i in v)))
    stop_strings: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    include_stop_str: bool = False
    alignment: str = "token"
    structured: str = "none"
    stream: bool = False
    cache: str = "dynamic"
    static_capacity: int | None = None
    prefill_chunk: int | None = None
    zero_new_tokens: str = "no_call"
    final_cache: str = "processed_inputs_only"
    max_retries: int = 0
    context_cap: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    attention: str = "sdpa"
    decode_kernel: str = "torch"
    seed: int | None = 0
    num_beams: int = 1

    def __attrs_post_init__(self) -> None:
        def bad(field: str, why: str) -> Rejection:
            return Rejection(ADAPTER_INVALID_CONFIG, f"{field}: {why}", f"$.{field}")

        choices = {
            "model": MODELS, "alignment": ("token", "text", "span"), "structured": ("none", "json"),
            "cache": ("none", "dynamic", "static"), "zero_new_tokens": ("reject", "no_call", "prefill_only"),
            "final_cache": ("none", "processed_inputs_only", "all_outputs"), "dtype": ("float32", "bfloat16", "float16"),
            "attention": ("sdpa", "eager"), "decode_kernel": ("torch", "native"),
        }
        for field in (*choices, "device"):
            if not isinstance(getattr(self, field), str):
                raise bad(field, f"a string, got {type(getattr(self, field)).__name__}")
        for field in ("include_stop_str", "stream"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, f"a boolean, got {type(getattr(self, field)).__name__}")
        if not re.fullmatch(r"cpu|cuda(:[0-9]{1,4})?", self.device):
            raise bad("device", f"cpu or cuda[:N], got {self.device[:40]!r}")
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise bad(field, f"must be one of {list(allowed)}, got {getattr(self, field)!r}")
        if not self.prompt_ids or any(t < 0 for t in self.prompt_ids):
            raise bad("prompt_ids", "a non-empty list of non-negative ids")
        for field in ("prompt_ids", "eos_ids"):
            if any(t > MAX_SAFE_ID for t in getattr(self, field)):
                raise bad(field, "token ids are at most 2**53 - 1 (I-JSON, RFC 7493: the identity is canonical JSON)")
        if not isinstance(self.policy, dict) or not isinstance(self.policy.get("family"), str):
            raise bad("policy", "an M3.8 policy JSON object with a 'family'")
        for field in ("max_new_tokens", "min_new_tokens", "max_retries"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(field, f"a non-negative integer, got {value!r}")
        for field in ("static_capacity", "prefill_chunk", "context_cap"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise bad(field, f"a positive integer or null, got {value!r}")
        if isinstance(self.num_beams, bool) or not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise bad("num_beams", f"a positive integer, got {self.num_beams!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 2**53 - 1):
            raise bad("seed", f"an integer in [0, 2**53 - 1] or null, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise bad("stop_strings", "non-empty strings")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"{self.min_new_tokens} > max_new_tokens {self.max_new_tokens}")
        if self.final_cache == "all_outputs" and self.cache == "none":
            raise bad("final_cache", "all_outputs needs a cache (envelope.output_unimplementable: no cache, no final cache)")
        try:
            rfc8785.dumps(self.to_json())  # the identity's canonical form: I-JSON integers, Unicode scalar values only
        except (rfc8785.CanonicalizationError, UnicodeError, TypeError, ValueError) as exc:
            raise Rejection(ADAPTER_INVALID_CONFIG, f"the config has no canonical JSON form (RFC 8785): {str(exc)[:120]}", "$") from None

    @property
    def prompt_len(self) -> int:
        """L."""
        return len(self.prompt_ids)

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object (every field, lists for tuples; ``decode_kernel`` only when not ``torch``,
        so configs and traces written before the field existed read and hash the same)."""
        out = attrs.asdict(self, recurse=False)
        if out["decode_kernel"] == "torch":
            del out["decode_kernel"]
        out["prompt_ids"] = list(self.prompt_ids)
        out["eos_ids"] = list(self.eos_ids)
        out["stop_strings"] = list(self.stop_strings)
        out["policy"] = json.loads(json.dumps(self.policy))
        return out

    @classmethod
    def from_json(cls, obj: Any) -> CaseConfig:
        """Inverse of :meth:`to_json` (absent optional fields take their defaults).

        Raises:
            Rejection: ``adapter.invalid_config`` for a non-object, an unknown or missing field,
                or a value outside its domain.
        """
        if not isinstance(obj, Mapping):
            raise Rejection(ADAPTER_INVALID_CONFIG, f"a case config is a JSON object, got {type(obj).__name__}", "$")
        names = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise Rejection(ADAPTER_INVALID_CONFIG, f"unknown field(s) {unknown}", f"$.{unknown[0]}")
        for required in ("model", "prompt_ids"):
            if required not in obj:
                raise Rejection(ADAPTER_INVALID_CONFIG, f"missing field {required!r}", f"$.{required}")
        try:
            return cls(**dict(obj))
        except (TypeError, ValueError, OverflowError) as exc:
            # The exception text may hold a value of the config (a prompt id, a stop string): user content, so fingerprinted.
            raise Rejection(ADAPTER_INVALID_CONFIG, f"{type(exc).__name__}: {quote_content(str(exc))}", "$") from None

    def evolve(self, **changes: Any) -> CaseConfig:
        """A copy with ``changes`` (validated again)."""
        return attrs.evolve(self, **changes)

    def envelope(self, model: ModelFacts) -> dict[str, Any]:
        """The ``numinens.request.v1`` envelope of this case on ``model`` (JSON; validate it with
        :func:`decodespec.spec.envelope.validate_request_envelope`).

        The case's fields map to the envelope's planes (the inverse direction of
        :data:`~decodespec.checks.adapters.features.CONFIG_FIELDS`): ``eos_ids`` ->
        ``termination.eos_ids``, with ``termination.ignore_eos`` set when the tokenizer's EOS
        ids are not all in it (a case without EOS runs to its length bound); ``context_cap`` ->
        ``termination.max_total_tokens``; ``cache`` -> ``runtime.cache_family`` and its cache
        ABI; ``static_capacity`` -> ``runtime.static_capacity``, the spec's default
        (:func:`decodespec.spec.request.static_capacity`) when the case leaves it to the runtime;
        ``final_cache = all_outputs`` -> ``runtime.append_repair``; ``final_cache`` ``none`` and no
        ``prefill_chunk`` without a cache; ``dtype`` -> ``runtime.compute_dtype`` (logits float32); the model window ->
        ``position_visibility.max_context``; ``seed`` -> ``rng.seed`` (0 for a case without a
        seed: the gate keys the RNG by the case's own identity and seed,
        :func:`decodespec.spec.request_machine.rekeyed`).  ``device`` and ``decode_kernel``
        choose how a runtime computes and are not in the envelope; ``num_beams`` is the
        policy's own field.  The tokenizer's BOS is stated when it is not one of the case's
        EOS ids.

        The builder is total: every config gives an envelope; the envelope may still be
        refused (the gate's admission refuses first what a runtime refuses with its own code,
        :func:`decodespec.spec.request_machine.refusal_of`).

        Source: M3.10 "Immutable request envelope and canonical identity" (the planes).
        """
        text_interface: dict[str, Any] = {"tokenizer_sha256": model.tokenizer_sha256, "vocab_size": model.vocab_size,
                                          "eos_ids": sorted(set(model.eos_ids))}
        if model.bos_id is not None and model.bos_id not in self.eos_ids:
            text_interface["bos_id"] = model.bos_id
        runtime: dict[str, Any] = {
            "framework_revision": "decodespec-gate", "compute_dtype": self.dtype, "logit_dtype": "float32",
            "cache_family": self.cache, "cache_abi": "none" if self.cache == "none" else CACHE_ABI_FOR_ARCHITECTURE["decoder_only"],
            "attention": self.attention, "append_repair": self.final_cache == "all_outputs", "max_retries": self.max_retries,
        }
        capacity = request_static_capacity(self.cache, self.static_capacity, self.prompt_len, self.max_new_tokens, model.window)
        if capacity is not None:
            runtime["static_capacity"] = capacity
        if self.prefill_chunk is not None and self.cache != "none":
            runtime["prefill_chunk"] = self.prefill_chunk
        termination: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens, "eos_ids": list(self.eos_ids),
            "ignore_eos": not set(model.eos_ids) <= set(self.eos_ids), "stop_strings": list(self.stop_strings),
            "structured": self.structured, "zero_new_tokens": self.zero_new_tokens,
        }
        if self.context_cap is not None:
            termination["max_total_tokens"] = self.context_cap
        return {
            "schema": SCHEMA_NAME,
            "artifact": {"release_id": model.release_id, "checkpoint_sha256": model.checkpoint_sha256, "architecture": "decoder_only"},
            "text_interface": text_interface,
            "prompt": {"input_ids": list(self.prompt_ids), "attention_mask": [1] * self.prompt_len},
            "position_visibility": {"mode": "causal", "position_rule": "valid_token_cumsum", "cache_position_start": 0,
                                    "max_context": model.window},
            "policy": json.loads(json.dumps(self.policy)),
            "rng": {"algorithm": "philox", "seed": 0 if self.seed is None else self.seed, "counter": 0},
            "runtime": runtime,
            "termination": termination,
            # Without a cache there is no final cache to promise (envelope.output_unimplementable otherwise).
            "output": {"return_token_ids": True, "return_logprobs": True, "final_cache": "none" if self.cache == "none" else self.final_cache,
                       "include_stop_str": self.include_stop_str, "alignment": self.alignment, "stream": self.stream},
        }

    def identity(self) -> str:
        """The request identity: ``"sha256:" + hex(sha256(b"decodespec.case.v1" + b"\\x00" + JCS(to_json())))``.

        ``decode_kernel`` is left out: it chooses how the runtime computes, not the request, so a
        run on either kernel draws the same RNG stream.
        """
        request = {k: v for k, v in self.to_json().items() if k != "decode_kernel"}
        digest = hashlib.sha256(b"decodespec.case.v1\x00" + rfc8785.dumps(request)).hexdigest()
        return "sha256:" + digest


from .features import config_capabilities, feature_capabilities  # needs CaseConfig's defaults

#: Every capability an adapter may declare: :data:`OP_AND_PROBE_CAPABILITIES` plus one name per policy transform
#: and per envelope feature, derived from the request and policy schemas
#: (:func:`~decodespec.checks.adapters.features.feature_capabilities`).
CAPABILITIES = OP_AND_PROBE_CAPABILITIES | frozenset(feature_capabilities())


# --------------------------------------------------------------------------------------------
# Results and observations.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ApplyResult:
    """The answer to one action: accepted (``ok``, optional ``data``) or rejected (``code``, ``message``).

    A rejected action changed nothing.
    """

    ok: bool
    data: dict[str, Any] = attrs.field(factory=dict)
    code: str | None = None
    message: str | None = None

    @classmethod
    def accepted(cls, data: Mapping[str, Any] | None = None) -> ApplyResult:
        """An accepted action's result."""
        return cls(True, dict(data or {}))

    @classmethod
    def rejected(cls, code: str, message: str = "") -> ApplyResult:
        """A refused action's result (the typed error's code and message)."""
        return cls(False, {}, code, message)

    def to_json(self) -> dict[str, Any]:
        """``{"status": "ok", "data": {...}}`` or ``{"status": "rejected", "code", "message"}``."""
        if self.ok:
            return {"status": "ok", "data": self.data}
        return {"status": "rejected", "code": self.code, "message": self.message or ""}

    @classmethod
    def from_json(cls, obj: Any) -> ApplyResult:
        """Inverse of :meth:`to_json`.

        Raises:
            Rejection: ``adapter.protocol`` for anything else.
        """
        if isinstance(obj, Mapping) and obj.get("status") == "ok" and isinstance(obj.get("data", {}), Mapping):
            return cls.accepted(obj.get("data"))
        if isinstance(obj, Mapping) and obj.get("status") == "rejected" and isinstance(obj.get("code"), str):
            return cls.rejected(obj["code"], str(obj.get("message", "")))
        raise Rejection(ADAPTER_PROTOCOL, f"not an apply result: {obj!r}", "$.result")


def _opt_array(dtype: Any) -> Any:
    def convert(value: Any) -> np.ndarray | None:
        if value is None:
            return None
        arr = np.asarray(value, dtype=dtype)
        arr.setflags(write=False)
        return arr

    return convert


def _opt_tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


@attrs.frozen(eq=False)
class Observation:
    """The observable projection of a runtime's request state (``None``: not exposed).

    Attributes:
        phase: The spec's phase name (``new``, ``ready``, ``in_flight``, ``scored``,
            ``decided``, ``finished``), or ``None``.
        output_ids: Committed output ids ``int[O]`` (EOS included).
        logprobs: ``float[O]``: natural log-softmax of the raw row at each committed id.
        frontier: ``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}``
            (L, O, |U|, P, tag) or ``None``.
        finish_reason: Canonical finish reason, or ``None`` while open.
        triggers: Every trigger that fired, in precedence order.
        rng_counter: Request RNG counter (draws consumed by committed decisions).
        generation: State / cache generation.
        quarantined: Whether the cache handle awaits recovery.
        decision: The latest decision (pending or committed): ``{"receipt_id", "score_id",
            "token_id", "logprob", "draws"}``, or ``None`` before the first.
        score_row: ``float32[V]`` raw logits of the latest exposed score row (kept after its
            decision is committed), or ``None``.
        score_id: Its score id.
        score_output_count: O when that row was exposed: the row conditions on
            ``prompt_ids + output_ids[:score_output_count]`` and predicts output number
            ``score_output_count``.
        support_ids: ``int64[k]`` ascending ids of the processed support of the latest decision
            (the POLICY probe), or ``None``.
        support_probs: ``float32[k]`` their processed probabilities.
        text: Returned text so far (EOS and special tokens excluded), or ``None``.
        chunks: Stream chunks delivered: ``{"chunk_idx", "text", "byte_start", "byte_end",
            "token_start", "token_end"}`` each, or ``None``.
        cache_committed: Committed cache rows (K frontier; 0 without a cache), or ``None``.
        cache_physical: Physical rows: allocated slots S (static) or written rows (dynamic).
        call: The latest launched call ``{"call_id", "kind", "start", "length",
            "position_ids", "cache_position", "in_flight"}``, or ``None``.
        cache_probe: ``float32[num_layers, 2, H_kv, P, D]`` committed K (after RoPE) and V rows,
            or ``None``.
        beam_tokens / beam_parents: Selected ids and their parent beams of the latest beam
            step, or ``None``.
        returned_ids / returned_logprobs: The returned output once the request is finished, under
            its alignment contract (a stop cut trims both, ``len(logprobs) == len(ids)``;
            ``invariant.output_alignment``), or ``None`` while open / not exposed.
        vocab_hash: The ordered vocabulary identity the runtime scores and decodes with
            (:func:`decodespec.spec.vocab.vocab_table_hash` of its id -> token-bytes table; the
            ``vocab_hash`` its receipts carry), or ``None``.
        vocab_rows: Rows of its output head (the score row's length V_out), or ``None``.

    Shapes: see each attribute; V the vocabulary size.
    """

    phase: str | None = None
    output_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    logprobs: tuple[float, ...] = attrs.field(default=(), converter=lambda v: tuple(float(x) for x in v))
    frontier: dict[str, Any] | None = None
    finish_reason: str | None = None
    triggers: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    rng_counter: int | None = None
    generation: int | None = None
    quarantined: bool | None = None
    decision: dict[str, Any] | None = None
    score_row: np.ndarray | None = attrs.field(default=None, converter=_opt_array(np.float32))
    score_id: str | None = None
    score_output_count: int | None = None
    support_ids: np.ndarray | None = attrs.field(default=None, converter=_opt_array(np.int64))
    support_probs: np.ndarray | None = attrs.field(default=None, converter=_opt_array(np.float32))
    text: str | None = None
    chunks: tuple[dict[str, Any], ...] | None = attrs.field(default=None, converter=_opt_tuple)
    cache_committed: int | None = None
    cache_physical: int | None = None
    call: dict[str, Any] | None = None
    cache_probe: np.ndarray | None = attrs.field(default=None, converter=_opt_array(np.float32))
    beam_tokens: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    beam_parents: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    returned_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    returned_logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    vocab_hash: str | None = None
    vocab_rows: int | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON-able, array-free part (what traces record per step; arrays as their shapes)."""
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, np.ndarray):
                out[field.name] = None if value is None else {"shape": list(value.shape), "dtype": str(value.dtype)}
            elif isinstance(value, tuple):
                out[field.name] = list(value)
            else:
                out[field.name] = value
        return out


# --------------------------------------------------------------------------------------------
# The adapter protocol and the registry.
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Adapter(Protocol):
    """What the gate needs from a runtime (see the module docstring)."""

    name: str

    def capabilities(self) -> frozenset[str]:  # pragma: no cover - protocol
        """The capabilities this runtime declares (a subset of :data:`CAPABILITIES`)."""
        ...

    def reset(self, config: CaseConfig) -> None:  # pragma: no cover - protocol
        """Build and admit the request of ``config``; raise ``Rejection`` / ``ResourceLimit`` if refused."""
        ...

    def apply(self, action: Mapping[str, Any]) -> ApplyResult:  # pragma: no cover - protocol
        """Apply one action; a rejected action changes nothing."""
        ...

    def observe(self) -> Observation:  # pragma: no cover - protocol
        """The current observable projection."""
        ...

    def close(self) -> None:  # pragma: no cover - protocol
        """Release the runtime (processes, files)."""
        ...


class AdapterUnavailable(Exception):
    """The named runtime cannot run here (not installed, no model file); the message is the skip reason."""


#: Runtime kinds that take a command line after ``:`` and start it as a process: ``stdio:CMD`` (the whole contract over
#: :mod:`.wire`) and ``engine:CMD`` (model calls only over :mod:`.engine`; the gate's controller owns the contract).
COMMAND_RUNTIMES = ("stdio", "engine")


def parse_runtime(runtime: str) -> tuple[str, str]:
    """``(name, command)`` of a runtime name: ``impl``, ``impl-tp``, ``hf``, ``llamacpp`` (command ``""``), ``stdio:CMD`` or
    ``engine:CMD``.

    Raises:
        Rejection: ``adapter.unsupported`` for an unknown name or a ``:`` argument to a runtime
            other than ``stdio`` and ``engine``.
    """
    name, _, rest = runtime.partition(":")
    if name not in COMMAND_RUNTIMES and rest:
        raise Rejection(ADAPTER_UNSUPPORTED, f"only stdio and engine take a ':' argument, got {runtime!r}", "$.runtime")
    if name not in ("impl", "impl-tp", "hf", "llamacpp", *COMMAND_RUNTIMES):
        raise Rejection(ADAPTER_UNSUPPORTED, f"unknown runtime {runtime!r}; expected impl, impl-tp, hf, llamacpp, stdio:CMD or "
                        "engine:CMD", "$.runtime")
    return name, rest


def open_adapter(runtime: str, **options: Any) -> Adapter:
    """Create the adapter named ``runtime``: ``impl``, ``impl-tp`` (module ``impl_tp``), ``hf``, ``llamacpp``, ``stdio:CMD`` or
    ``engine:CMD``.

    Args:
        runtime: The runtime name (``stdio:`` or ``engine:`` followed by the process's command line).
        **options: Passed to the module's ``create`` (e.g. ``model="smollm2"``).

    Raises:
        AdapterUnavailable: the adapter module or its runtime is not installed (the reason).
        Rejection: ``adapter.unsupported`` for an unknown runtime name.
    """
    name, rest = parse_runtime(runtime)
    if name in COMMAND_RUNTIMES:
        options = {"command": rest, **options}
    try:
        module = importlib.import_module(f"decodespec.checks.adapters.{name.replace('-', '_')}")
    except ModuleNotFoundError as exc:
        raise AdapterUnavailable(f"the {name} adapter is not available: {exc}") from None
    reason = module.available()
    if reason is not None:
        raise AdapterUnavailable(reason)
    return module.create(**options)


# --------------------------------------------------------------------------------------------
# Snapshot corruption (shared by the harness and every adapter).
# --------------------------------------------------------------------------------------------


def corrupt_record(record: SnapshotRecord, corruption: str) -> SnapshotRecord:
    """A deliberately broken copy of a snapshot's logical record (a restore must refuse it).

    ``identity``: another request; ``processed_plus_one``: the pending token counted as
    processed (P + 1, U kept); ``pending_dropped``: U = [] while P stays; ``repaired_with_pending``:
    a pending token labelled ``repaired``; ``rng_counter``: the RNG counter skips a draw.  The
    two pending corruptions need a pending token; on a record without one they fall back to
    ``processed_plus_one`` (still invalid).

    Raises:
        Rejection: ``adapter.invalid_action`` for an unknown corruption.

    Source: M3.10 0x0B ("never ... increment a length field, or relabel a cache slot"),
    checks/modelcheck/explore.py ``corrupted_records``.
    """
    if corruption not in CORRUPTIONS:
        raise Rejection(ADAPTER_INVALID_ACTION, f"unknown corruption {corruption!r}; expected one of {list(CORRUPTIONS)}", "$.corrupt")
    if corruption == "identity":
        return attrs.evolve(record, identity="sha256:" + "f" * 64)
    if corruption == "rng_counter":
        return attrs.evolve(record, rng_counter=record.rng_counter + 1)
    if corruption == "pending_dropped" and record.pending_ids:
        return attrs.evolve(record, pending_ids=(), pending_tag=PendingTag.EMPTY)
    if corruption == "repaired_with_pending" and record.pending_ids:
        return attrs.evolve(record, form="repaired")
    return attrs.evolve(record, processed=record.processed + 1)


def stable_json(value: Any) -> str:
    """Canonical JSON text (sorted keys, no spaces) used in ids and comparisons."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sequence_ids(values: Sequence[Any]) -> list[int]:
    """``values`` as a list of Python ints (numpy / torch scalars accepted)."""
    return [int(v) for v in values]
