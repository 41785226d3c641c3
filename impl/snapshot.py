"""Resumable snapshots of a running request: both forms, JSON plus safetensors, validated restore.

A :class:`RuntimeSnapshot` is the spec's logical :class:`~decodespec.spec.snapshot.SnapshotRecord`
(identity, form, phase, frontiers, pending tag and ids, output ids, receipt ledger, generation,
RNG counter, finish state, call counters) plus what only the runtime holds: the logprob values,
the M3.8 policy state (RNG counter, automaton state, Mirostat ``mu``), the decision receipts as
JSON, the request itself (with the admitted envelope's canonical bytes when there is one), the
cache family, ABI and capacity, the committed K/V rows ``[1, H_kv, P, D]`` of every layer, the
consumable score row ``[V]`` of a ``repaired`` snapshot taken in SCORED, and the stop/stream
observer's state (``observer.snapshot_state()`` when it has one).

Files (:func:`save_snapshot` / :func:`load_snapshot`): ``FILE`` holds the JSON
(``"format": "decodespec.snapshot.v1"``) and ``FILE.safetensors`` the tensors
(``safetensors.torch.save_file``; keys ``cache.layers.<l>.keys`` / ``.values`` and
``score.logits``); the JSON records the tensor file's SHA-256, checked on load.  The SHA-256
detects accidental damage only: a tensor changed together with its recorded hash is accepted.
With a user key (``DECODESPEC_SNAPSHOT_KEY``, or ``key=``) the JSON also carries
``"authentication": {"algorithm": "hmac-sha256", "mac": <hex>}`` over the RFC 8785 bytes of the
rest of the document (so over the tensor hash too), and loading with a key refuses a file
without a matching one (``snapshot.unauthenticated``); see :mod:`decodespec.spec.snapshot`.

Forms (M3.10 0x0BA "A completed output is not automatically a resumable snapshot"):

* ``pending_suffix``: between calls (READY) or after finish; U (``[u_O]``, PENDING_NEXT_CALL or
  CLOSED_UNPROCESSED) is serialized, the cache holds exactly P = L + O - |U| rows.
* ``repaired``: :meth:`RequestRunner.snapshot` first runs the *valid append call* for a pending
  token -- the ordinary decode call between calls (whose row is then the next decision's score,
  saved with the snapshot) or the declared repair call after finish -- so U = [] and P = L + O.
  Nothing is relabelled: without a repair promise (``final_cache = all_outputs``) a finished
  request has no repaired form (``snapshot.form_unavailable``).

:func:`restore_runner` validates everything before building any state (typed ``snapshot.*``
errors, registered in :mod:`decodespec.spec.snapshot`): the file shape
(``snapshot.malformed`` at the offending field: each field is read with its JSON type, integers
within the I-JSON domain, no lone surrogate anywhere), the identity (``snapshot.identity_mismatch``; an envelope carried by
the snapshot is re-admitted and must hash to the same identity), the cache family, ABI,
capacity and tensor layout (``snapshot.abi_mismatch``), ``P + |U| = L + O`` and exactly P cached
rows (``snapshot.frontier_invalid``), the pending suffix against the declared form
(``snapshot.pending_invalid``), and the ledger (``snapshot.ledger_invalid``): one logprob and one
receipt per output, every logprob finite and <= 0, each decision receipt naming its output's
token, logprob, step, score row, draws and RNG counter and carrying its own content hash, the
observer's ids and logprobs equal to the ledger's, the RNG counter equal to the draws consumed,
score rows and finish state consistent, and the call counters against P (processed rows need a model call and a generation
>= 1; the spec's check "finish state, bounds and counters are consistent").  Restoring and continuing
gives the same tokens and logprobs as never stopping (tests/test_snapshot*.py).

Source: M3.10 0x0BA "A completed output is not automatically a resumable snapshot", "Immutable
identity versus mutable request state" (restoring token ids while resetting RNG, parser, stream
suffix, finish state or positions is a different continuation).

Size: one format: both snapshot forms, their JSON + safetensors files and every typed restore check
(identity, ledger, lanes, cache ABI, observer state) of the same record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from pathlib import Path
from typing import Any

import attrs
import rfc8785
import torch

from decodespec.spec.enums import CallKind, PendingTag, Selection, published_finish_reason
from decodespec.spec.envelope import lone_surrogate_path
from decodespec.spec.errors import DecodeSpecError, Rejection, quote, quote_content
from decodespec.spec.limits import MAX_SAFE_INT
from decodespec.spec.passport import CONTENT, passport_from_json, snapshot_passport
from decodespec.spec.policy.config import policy_config_from_json
from decodespec.spec.policy.receipt import content_id, receipt_policy_mismatch
from decodespec.spec.policy.state import PolicyState
from decodespec.spec.request import context_cap, policy_with_min_new_tokens
from decodespec.spec.snapshot import (
    PENDING_SUFFIX,
    REPAIRED,
    SNAPSHOT_ABI_MISMATCH,
    SNAPSHOT_FORM_UNAVAILABLE,
    SNAPSHOT_FORMS,
    SNAPSHOT_FRONTIER_INVALID,
    SNAPSHOT_IDENTITY_MISMATCH,
    SNAPSHOT_KEY_ENV,
    SNAPSHOT_LEDGER_INVALID,
    SNAPSHOT_MAC_ALGORITHM,
    SNAPSHOT_MALFORMED,
    SNAPSHOT_PENDING_INVALID,
    SNAPSHOT_UNAUTHENTICATED,
    SnapshotRecord,
)
from decodespec.spec.state import Phase, Receipt
from decodespec.spec.state import Score as SpecScore

from .cache import CacheABI
from .output import OUTPUT_STATE_FORMAT
from .values import Decision, RunnerState, RuntimeRequest, Score

__all__ = [
    "SNAPSHOT_FORMAT",
    "RuntimeSnapshot",
    "load_snapshot",
    "request_from_json",
    "request_to_json",
    "restore_runner",
    "save_snapshot",
    "snapshot_key",
    "take_runtime_snapshot",
]

#: Name of the snapshot JSON format.
SNAPSHOT_FORMAT = "decodespec.snapshot.v1"
_LANE = "self_kv"


@attrs.frozen(eq=False)
class RuntimeSnapshot:
    """A resumable snapshot (see the module docstring).

    Attributes:
        record: The logical record (spec value type).
        logprobs: ``float[O]`` natural-log probabilities of the outputs.
        policy_state: The M3.8 policy state the next decision reads.
        receipts: The decision receipts as JSON, one per output (as far as the runner holds them).
        request: The runtime request (``request.envelope`` carries the admitted envelope).
        cache_family: ``none`` / ``dynamic`` / ``static``.
        cache_abi: The ABI of the stored rows (``None`` without a cache).
        capacity: Static capacity, else ``None``.
        tensors: Per layer ``(keys, values)`` ``[1, H_kv, P, D]`` on the CPU, or ``None``.
        score_logits: ``[V]`` raw row of the consumable score (repaired form in SCORED), or ``None``.
        observer_state: JSON state of the stop/stream observer, or ``None``.
    """

    record: SnapshotRecord
    logprobs: tuple[float, ...]
    policy_state: PolicyState
    receipts: tuple[dict, ...]
    request: Any
    cache_family: str
    cache_abi: CacheABI | None
    capacity: int | None
    tensors: list[tuple[torch.Tensor, torch.Tensor]] | None = attrs.field(repr=False)
    score_logits: torch.Tensor | None = attrs.field(default=None, repr=False)
    observer_state: Any = None

    @property
    def form(self) -> str:
        """``pending_suffix`` or ``repaired``."""
        return self.record.form

    def frontier(self) -> dict[str, Any]:
        """``{"prompt_len", "output_count", "pending", "processed", "pending_tag"}``."""
        r = self.record
        return {"prompt_len": len(self.request.prompt_ids), "output_count": len(r.output_ids), "pending": len(r.pending_ids),
                "processed": r.processed, "pending_tag": r.pending_tag.value}


# --------------------------------------------------------------------------------------------
# Taking a snapshot.
# --------------------------------------------------------------------------------------------


def take_runtime_snapshot(runner, form: str) -> RuntimeSnapshot:
    """The snapshot of ``runner`` in ``form`` (``repaired`` first runs the append call; see the module docstring).

    Raises:
        Rejection: ``snapshot.form_unavailable``; the runner is unchanged unless the append call
            ran (then it is in the state that call selected).
    """
    def refuse(why: str) -> Rejection:
        return Rejection(SNAPSHOT_FORM_UNAVAILABLE, why, "$.form")

    if form not in SNAPSHOT_FORMS:
        raise refuse(f"unknown snapshot form {form!r}; expected one of {SNAPSHOT_FORMS}")
    if runner.request.prompt_logprobs is not None:  # declared limit: the published prompt rows are not part of the v1 record
        raise refuse("a request with prompt logprobs (output.prompt_logprobs) cannot be snapshotted: v1 snapshots do not carry them")
    if runner.in_flight is not None:
        raise refuse("a call is in flight")
    if runner.quarantined:
        raise refuse("the handle is quarantined (recover first)")
    if runner.phase in (Phase.NEW, Phase.DECIDED) or runner.phase not in (Phase.READY, Phase.SCORED, Phase.FINISHED):
        raise refuse(f"no snapshot in phase {runner.phase.value}")
    if form == PENDING_SUFFIX and runner.phase is Phase.SCORED:
        raise refuse("a pending-suffix snapshot is taken between calls or after finish, not with a consumable score")
    if form == REPAIRED and runner.pending_ids:
        if runner.phase is Phase.READY:
            runner.launch(CallKind.DECODE)
        elif runner.repair_owed():
            runner.launch(CallKind.REPAIR)
        else:
            raise refuse("the final token is closed unprocessed and the request declares no append/repair call "
                         "(final_cache all_outputs)")
        if runner.complete() is not Selection.ALL_NEW:
            raise refuse("the append call selected ALL_OLD; the state keeps its pending token")
    request = runner.request
    st = runner.state()
    processed = st.processed
    record = SnapshotRecord(
        identity=request.identity,
        form=form,
        phase=st.phase,
        processed=processed,
        output_ids=st.output_ids,
        pending_ids=st.pending_ids,
        pending_tag=st.pending_tag,
        lanes=((_LANE, processed if processed > 0 else None),) if request.cached else (),
        generation=st.generation,
        score=None if st.score is None else SpecScore(st.score.score_id, st.score.generation, st.score.processed, st.score.output_count),
        issued=st.issued,
        consumed=tuple(Receipt(d.receipt_id, d.score_id, d.token_id, d.draws, d.rng_counter_before) for d in st.consumed),
        scores=tuple(SpecScore(*sc) for sc in st.scores),
        rng_counter=st.policy_state.rng_counter,
        finish_reason=st.finish_reason,
        triggers=st.triggers,
        num_calls=st.num_calls,
        num_retries=st.num_retries,
    )
    tensors = None
    if runner.cache is not None and processed > 0:
        tensors = [(k.detach().to("cpu").contiguous().clone(), v.detach().to("cpu").contiguous().clone())
                   for k, v in runner.cache.committed_tensors()]
    observer_state = runner.observer.snapshot_state()
    snapshot = RuntimeSnapshot(
        record=record,
        logprobs=st.logprobs,
        policy_state=st.policy_state,
        receipts=tuple(r.to_json() for r in st.receipts),
        request=request,
        cache_family=request.cache,
        cache_abi=None if runner.cache is None else runner.cache.abi,
        capacity=runner.capacity,
        tensors=tensors,
        score_logits=None if st.score is None else st.score.logits.detach().to("cpu").clone(),
        observer_state=observer_state,
    )
    if runner.sink is not None:
        runner.sink.emit("snapshot", form=form, frontier=runner.frontier(), state=record.to_json())
    return snapshot


# --------------------------------------------------------------------------------------------
# Files.
# --------------------------------------------------------------------------------------------


def request_to_json(request) -> dict[str, Any]:
    """A :class:`~decodespec.impl.runtime.RuntimeRequest` as JSON (the envelope as its canonical JSON object)."""
    out = {f.name: getattr(request, f.name) for f in attrs.fields(type(request))}
    out["prompt_ids"] = list(request.prompt_ids)
    out["policy"] = request.policy.to_json()
    out["eos_ids"] = sorted(request.eos_ids)
    out["stop_strings"] = list(request.stop_strings)
    out["envelope"] = None if request.envelope is None else json.loads(request.envelope)
    assert out.pop("prompt_logprobs") is None, "take_runtime_snapshot refuses a request with prompt logprobs"
    return out


def request_from_json(obj: dict[str, Any]):
    """Inverse of :func:`request_to_json`; an envelope is re-admitted (its identity recomputed).

    Raises:
        Rejection: ``snapshot.malformed`` for a mistyped field; the envelope's own
            ``envelope.*`` / ``policy.*`` codes; ``snapshot.identity_mismatch`` when the
            re-admitted envelope's identity differs from the recorded one.
    """
    from decodespec.spec.envelope import validate_request_envelope


    if not isinstance(obj, dict):
        raise Rejection(SNAPSHOT_MALFORMED, f"the request must be an object, got {type(obj).__name__}", "$.request")
    if obj.get("envelope") is not None:
        try:
            raw = rfc8785.dumps(obj["envelope"])
        except (rfc8785.CanonicalizationError, TypeError, ValueError, RecursionError) as exc:
            raise Rejection(SNAPSHOT_MALFORMED, f"the carried envelope is not canonical JSON: {type(exc).__name__}", "$.request.envelope") from None
        admitted, identity = validate_request_envelope(raw)
        dropped = "envelope_identity" in obj  # the prompt text was dropped (save_snapshot without content)
        if dropped and "text" in obj["envelope"].get("prompt", {}):
            raise Rejection(SNAPSHOT_MALFORMED, "envelope_identity is recorded but the carried envelope still has its prompt text",
                            "$.request.envelope_identity")
        expected = obj.get("envelope_identity") if dropped else obj.get("identity")
        if identity != expected:
            field = "envelope_identity" if dropped else "identity"
            raise Rejection(SNAPSHOT_IDENTITY_MISMATCH, f"the carried envelope hashes to {identity}, not the recorded {field} "
                            f"{quote(expected)}", "$.request.envelope")
        request = RuntimeRequest.from_admitted(admitted)
        if dropped:  # the request identity (it keys the RNG) is the recorded one; without its text it cannot be recomputed
            recorded = obj.get("identity")
            if not isinstance(recorded, str) or not recorded.startswith("sha256:") or len(recorded) != 71:
                raise Rejection(SNAPSHOT_MALFORMED, f"the request identity {quote(recorded)} is not sha256:<64 hex>", "$.request.identity")
            request = attrs.evolve(request, identity=recorded)
        return request
    path = "$.request"
    values: dict[str, Any] = {}
    for f in attrs.fields(RuntimeRequest):
        if f.name in ("policy", "envelope") or (f.name not in obj and f.default is not attrs.NOTHING):
            continue
        kind = _REQUEST_FIELDS[f.name]
        value = _field(obj, f.name, path, kind[0])
        if isinstance(value, int) and not isinstance(value, bool):
            _nonnegative(value, f"{path}.{f.name}")
        if isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, kind[1]) or isinstance(item, bool):
                    raise _malformed(f"{f.name}[{i}] must be {kind[1].__name__}, got {type(item).__name__}", f"{path}.{f.name}[{i}]")
                if isinstance(item, int):
                    _nonnegative(item, f"{path}.{f.name}[{i}]")
            value = (frozenset if f.name == "eos_ids" else tuple)(value)
        values[f.name] = value
    values["policy"] = policy_config_from_json(_field(obj, "policy", path, dict), f"{path}.policy")
    return RuntimeRequest(**values, envelope=None)


#: The JSON type of each :class:`~decodespec.impl.runtime.RuntimeRequest` field in a snapshot
#: (``(type or types, element type of a list)``); ``policy`` and ``envelope`` are read apart.
_REQUEST_FIELDS: dict[str, tuple[Any, Any]] = {
    "identity": (str, None), "prompt_ids": (list, int), "max_new_tokens": (int, None), "eos_ids": (list, int),
    "min_new_tokens": (int, None), "seed": ((int, type(None)), None), "rng_counter_start": (int, None), "cache": (str, None),
    "static_capacity": ((int, type(None)), None), "prefill_chunk": ((int, type(None)), None), "zero_new_tokens": (str, None),
    "final_cache": (str, None), "max_retries": (int, None), "context_cap": ((int, type(None)), None), "stream": (bool, None),
    "stop_strings": (list, str), "structured": (str, None), "include_stop_str": (bool, None), "alignment": (str, None),
    "vocab_hash": (str, None), "timeout_ms": ((int, type(None)), None),
}


def _tensor_path(path: Path) -> Path:
    return path.with_name(path.name + ".safetensors")


def snapshot_key(key: bytes | str | None = None) -> bytes | None:
    """The HMAC key: ``key`` when given, else the UTF-8 bytes of ``$DECODESPEC_SNAPSHOT_KEY`` (``None`` when unset or empty)."""
    if key is None:
        key = os.environ.get(SNAPSHOT_KEY_ENV) or None
    if isinstance(key, str):
        key = key.encode("utf-8")
    return key or None


def _mac(doc: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in doc.items() if k != "authentication"}
    return hmac.new(key, rfc8785.dumps(body), hashlib.sha256).hexdigest()


def _authenticate(doc: dict[str, Any], key: bytes) -> None:
    """Raise ``snapshot.unauthenticated`` unless ``doc`` carries the HMAC-SHA256 of its other fields under ``key``."""
    auth = doc.get("authentication")
    if not isinstance(auth, dict) or auth.get("algorithm") != SNAPSHOT_MAC_ALGORITHM or not isinstance(auth.get("mac"), str):
        raise Rejection(SNAPSHOT_UNAUTHENTICATED, f"a snapshot key is set but the file carries no {SNAPSHOT_MAC_ALGORITHM} "
                        "authentication", "$.authentication")
    try:
        expected = _mac(doc, key)
    except (rfc8785.CanonicalizationError, TypeError, ValueError, RecursionError):
        expected = ""
    if not hmac.compare_digest(expected, auth["mac"]):
        raise Rejection(SNAPSHOT_UNAUTHENTICATED, "the snapshot's HMAC does not match this key: it was written with another key "
                        "or changed since", "$.authentication.mac")


def save_snapshot(snapshot: RuntimeSnapshot, path: str | Path, key: bytes | str | None = None, *,
                  content: bool = False) -> tuple[Path, Path]:
    """Write ``path`` (JSON) and ``path.safetensors`` (tensors); returns both paths.

    With a key (``key``, else ``$DECODESPEC_SNAPSHOT_KEY``) the JSON carries an HMAC-SHA256 of its
    other fields (module docstring).  The JSON declares its passport as ``data``
    (:func:`decodespec.spec.passport.snapshot_passport`): unless ``content``, the carried
    envelope's ``prompt.text`` is dropped and ``request.envelope_identity`` records the identity of
    the envelope as carried (the request identity, which keys the RNG, stays the recorded one);
    the token ids and the K/V tensors, which encode the content, are always kept.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for index, (keys, values) in enumerate(snapshot.tensors or ()):
        tensors[f"cache.layers.{index}.keys"] = keys.contiguous()
        tensors[f"cache.layers.{index}.values"] = values.contiguous()
    if snapshot.score_logits is not None:
        tensors["score.logits"] = snapshot.score_logits.contiguous()
    tensor_path = _tensor_path(path)
    save_file(tensors, str(tensor_path), metadata={"format": SNAPSHOT_FORMAT, "identity": snapshot.record.identity})
    digest = "sha256:" + hashlib.sha256(tensor_path.read_bytes()).hexdigest()
    doc = {
        "format": SNAPSHOT_FORMAT,
        "identity": snapshot.record.identity,
        "form": snapshot.form,
        "frontier": snapshot.frontier(),
        "state": snapshot.record.to_json(),
        "logprobs": list(snapshot.logprobs),
        "policy_state": snapshot.policy_state.to_json(),
        "receipts": list(snapshot.receipts),
        "data": snapshot_passport(content).to_json(),
        "request": _carried_request(request_to_json(snapshot.request), content),
        "cache": {
            "family": snapshot.cache_family,
            "abi": None if snapshot.cache_abi is None else snapshot.cache_abi.to_json(),
            "capacity": snapshot.capacity,
            "num_layers": 0 if snapshot.tensors is None else len(snapshot.tensors),
            "tensors": tensor_path.name,
            "sha256": digest,
        },
        "score": None if snapshot.record.score is None else {"score_id": snapshot.record.score.score_id, "tensor": "score.logits"},
        "observer": snapshot.observer_state,
    }
    doc["request_sha256"] = _request_digest(doc["request"])
    secret = snapshot_key(key)
    if secret is not None:
        doc["authentication"] = {"algorithm": SNAPSHOT_MAC_ALGORITHM, "mac": _mac(doc, secret)}
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path, tensor_path


def _request_digest(request: Any) -> str:
    """``sha256:<hex>`` of the carried request's canonical JSON (RFC 8785): binds the request constants to the snapshot.

    Raises:
        Rejection: ``snapshot.malformed`` when the request is not canonical JSON (NaN, a lone surrogate, ...).
    """
    try:
        return "sha256:" + hashlib.sha256(rfc8785.dumps(request)).hexdigest()
    except (rfc8785.CanonicalizationError, TypeError, ValueError, RecursionError) as exc:
        raise Rejection(SNAPSHOT_MALFORMED, f"the request is not canonical JSON: {type(exc).__name__}", "$.request") from None


def _check_request_digest(doc: dict[str, Any]) -> None:
    """The carried request hashes to the recorded ``request_sha256`` (``snapshot.identity_mismatch`` at ``$.request``).

    A snapshot of a request built through the Python API (no envelope) has a caller-chosen identity that does not
    hash the request's constants, so without this digest a changed ``max_new_tokens``, ``seed``, ``context_cap`` or
    ``vocab_hash`` resumed a different run (found by the snapshot fuzz's oracle, tests/test_fuzz_envelope.py).  Like
    the tensor file's SHA-256 it shows accidental or naive change only: whoever rewrites the request can rewrite the
    digest; an authenticated snapshot needs a key (``$DECODESPEC_SNAPSHOT_KEY``, HMAC-SHA256 over every field).
    """
    recorded = doc.get("request_sha256")
    if not isinstance(recorded, str):
        raise Rejection(SNAPSHOT_MALFORMED, "the snapshot records no request_sha256 (the digest of its request)", "$.request_sha256")
    if _request_digest(doc.get("request")) != recorded:
        raise Rejection(SNAPSHOT_IDENTITY_MISMATCH, "the request does not hash to the recorded request_sha256: a request constant "
                        "was changed after the snapshot was taken", "$.request")


def _carried_request(request: dict[str, Any], content: bool) -> dict[str, Any]:
    """``request_to_json`` output as a snapshot carries it: without the envelope's ``prompt.text`` unless ``content``.

    When the carried envelope does not hash to the request identity (its text was dropped, now or by
    the snapshot this run resumed), ``envelope_identity`` records the carried envelope's identity.
    """
    from decodespec.spec.envelope import identity_of

    envelope = request.get("envelope")
    if not isinstance(envelope, dict):
        return request
    if not content and isinstance(envelope.get("prompt"), dict) and "text" in envelope["prompt"]:
        envelope = {**envelope, "prompt": {k: v for k, v in envelope["prompt"].items() if k != "text"}}
    carried = identity_of(rfc8785.dumps(envelope))
    out = {**request, "envelope": envelope}
    if carried != request.get("identity"):
        out["envelope_identity"] = carried
    return out


def load_snapshot(path: str | Path, key: bytes | str | None = None) -> RuntimeSnapshot:
    """Read a snapshot written by :func:`save_snapshot` (shape checks only; :func:`restore_runner` validates).

    Raises:
        Rejection: ``snapshot.malformed`` for unreadable JSON, a wrong format, a missing field,
            a missing tensor file, one whose SHA-256 differs from the recorded one, or one that
            is not a readable safetensors file (truncated, with its SHA-256 re-recorded), each at
            the offending field; ``snapshot.unauthenticated`` when a key is set (``key``, else
            ``$DECODESPEC_SNAPSHOT_KEY``) and the file has no matching HMAC-SHA256.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Rejection(SNAPSHOT_MALFORMED, f"cannot read {quote(str(path))}: {type(exc).__name__}: {quote_content(str(exc))}", "$") from None
    if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
        raise Rejection(SNAPSHOT_MALFORMED, f"not a {SNAPSHOT_FORMAT} file", "$.format")
    try:
        surrogate = lone_surrogate_path(doc)
    except RecursionError:
        raise Rejection(SNAPSHOT_MALFORMED, "the JSON nests too deeply", "$") from None
    if surrogate is not None:
        raise Rejection(SNAPSHOT_MALFORMED, "a string escapes a lone UTF-16 surrogate (not UTF-8 text)", surrogate)
    secret = snapshot_key(key)
    if secret is not None:
        _authenticate(doc, secret)
    passport_from_json(doc.get("data"), "$.data", missing=CONTENT)  # data.unknown_classification; no passport: an older snapshot
    try:
        cache = _field(doc, "cache", "$", dict)
        name = _field(cache, "tensors", "$.cache", str)
        try:
            tensor_path = path.with_name(name)
        except ValueError:
            raise _malformed(f"tensor file name {quote(name)} is not a file name next to the snapshot", "$.cache.tensors") from None
        try:
            tensor_bytes = tensor_path.read_bytes() if tensor_path.name == name and tensor_path.is_file() else None
        except OSError as exc:  # a name too long for the file system, a file that cannot be read
            raise _malformed(f"tensor file {quote(str(tensor_path))} cannot be read: {quote(str(exc))}", "$.cache.tensors") from None
        if tensor_bytes is None:
            raise _malformed(f"tensor file {quote(str(tensor_path))} is missing", "$.cache.tensors")
        if "sha256:" + hashlib.sha256(tensor_bytes).hexdigest() != _field(cache, "sha256", "$.cache", str):
            raise _malformed(f"tensor file {quote(str(tensor_path))} differs from the recorded SHA-256", "$.cache.sha256")
        try:
            stored = load_file(str(tensor_path))
        except (SafetensorError, OSError) as exc:  # truncated or corrupt although its SHA-256 was re-recorded
            raise _malformed(f"tensor file {quote(str(tensor_path))} is not a readable safetensors file: {quote(str(exc))}",
                             "$.cache.tensors") from None
        num_layers = _nonnegative(_field(cache, "num_layers", "$.cache", int), "$.cache.num_layers")
        tensors = None
        if num_layers:
            tensors = [(_tensor(stored, f"cache.layers.{i}.keys"), _tensor(stored, f"cache.layers.{i}.values")) for i in range(num_layers)]
        policy = _field(doc, "policy_state", "$", dict)
        constraint_state = _field(policy, "constraint_state", "$.policy_state", (str, type(None)))
        mu = _field(policy, "mirostat_mu", "$.policy_state", (int, float, type(None)))
        score = _field(doc, "score", "$", (dict, type(None)))
        capacity = _field(cache, "capacity", "$.cache", (int, type(None)))
        abi = _field(cache, "abi", "$.cache", (dict, type(None)))
        carried = request_from_json(_field(doc, "request", "$", dict))  # typed field checks first, then the digest
        _check_request_digest(doc)
        return RuntimeSnapshot(
            record=SnapshotRecord.from_json(_field(doc, "state", "$", dict)),
            logprobs=tuple(_number(x, f"$.logprobs[{i}]") for i, x in enumerate(_field(doc, "logprobs", "$", list))),
            policy_state=PolicyState(_nonnegative(_field(policy, "rng_counter", "$.policy_state", int), "$.policy_state.rng_counter"),
                                     constraint_state, None if mu is None else _number(mu, "$.policy_state.mirostat_mu")),
            receipts=tuple(_field(doc, "receipts", "$", list)),
            request=carried,
            cache_family=_field(cache, "family", "$.cache", str),
            cache_abi=None if abi is None else CacheABI.from_json(abi),
            capacity=None if capacity is None else _nonnegative(capacity, "$.cache.capacity"),
            tensors=tensors,
            score_logits=_tensor(stored, "score.logits") if score else None,
            observer_state=doc.get("observer"),
        )
    except DecodeSpecError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as exc:
        raise _malformed(f"not a snapshot: {type(exc).__name__}: {quote_content(str(exc))}", "$") from None


def _malformed(message: str, path: str) -> Rejection:
    return Rejection(SNAPSHOT_MALFORMED, message, path)


def _field(obj: Any, key: str, path: str, types: type | tuple[type, ...]) -> Any:
    """``obj[key]`` of one of ``types`` (``bool`` is never an ``int``), else ``snapshot.malformed`` naming the field."""
    if not isinstance(obj, dict):
        raise _malformed(f"expected an object, got {type(obj).__name__}", path)
    if key not in obj:
        raise _malformed(f"missing field {key!r}", f"{path}.{key}")
    value = obj[key]
    wanted = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in wanted)
        raise _malformed(f"{key} must be {names}, got {type(value).__name__}", f"{path}.{key}")
    return value


def _nonnegative(value: int, path: str) -> int:
    if not 0 <= value <= MAX_SAFE_INT:
        shown = quote_content if any(k in path for k in ("prompt_ids", "eos_ids", "output_ids")) else quote  # token ids: content
        raise _malformed(f"{shown(value)} is not an integer in [0, {MAX_SAFE_INT}]", path)
    return value


def _number(value: Any, path: str) -> float:
    """A JSON number as a float (``NaN`` / ``Infinity`` literals pass here; restore refuses them where they matter)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(f"expected a number, got {type(value).__name__}", path)
    try:
        return float(value)
    except OverflowError:
        raise _malformed(f"the number {quote(value)} does not fit a float", path) from None


def _tensor(stored: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in stored:
        raise _malformed(f"the tensor file holds no {key!r}", "$.cache.tensors")
    return stored[key]


# --------------------------------------------------------------------------------------------
# Restore.
# --------------------------------------------------------------------------------------------


def _refuse(code: str, message: str, path: str = "$.snapshot") -> Rejection:
    return Rejection(code, message, path)


def _check(snapshot: RuntimeSnapshot, model, request) -> None:
    """Every restore check, in order; raises the first failing one's ``snapshot.*`` code."""
    rec = snapshot.record
    prompt_len = len(request.prompt_ids)
    outputs, pending = rec.output_ids, rec.pending_ids
    # identity
    if rec.identity != request.identity or snapshot.request.identity != request.identity:
        raise _refuse(SNAPSHOT_IDENTITY_MISMATCH, f"the snapshot belongs to {rec.identity}, the request is {request.identity}", "$.identity")
    if tuple(snapshot.request.prompt_ids) != tuple(request.prompt_ids):
        raise _refuse(SNAPSHOT_IDENTITY_MISMATCH, "the snapshot's prompt differs from the request's", "$.request.prompt_ids")
    # cache family, ABI, capacity, tensor layout
    abi = model.cache_abi
    if snapshot.cache_family != request.cache:
        raise _refuse(SNAPSHOT_ABI_MISMATCH, f"snapshot cache family {snapshot.cache_family} != request's {request.cache}", "$.cache.family")
    expected_lanes = ((_LANE, rec.processed if rec.processed else None),) if request.cached else ()
    if tuple(name for name, _ in rec.lanes) != tuple(name for name, _ in expected_lanes):
        raise _refuse(SNAPSHOT_ABI_MISMATCH, f"lane roster {rec.lanes} does not fit the {request.cache} cache", "$.state.lanes")
    if request.cached:
        if snapshot.cache_abi != abi:
            raise _refuse(SNAPSHOT_ABI_MISMATCH, f"snapshot cache ABI {snapshot.cache_abi} differs from the model's {abi}", "$.cache.abi")
        if request.cache == "static" and snapshot.capacity != request.static_capacity:
            raise _refuse(SNAPSHOT_ABI_MISMATCH, f"snapshot capacity {snapshot.capacity} != the request's {request.static_capacity}", "$.cache.capacity")
        for layer_idx, pair in enumerate(snapshot.tensors or ()):
            for tensor in pair:
                if (tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[1] != abi.num_key_value_heads or tensor.shape[3] != abi.head_dim
                        or str(tensor.dtype).removeprefix("torch.") != abi.dtype):
                    raise _refuse(SNAPSHOT_ABI_MISMATCH, f"layer {layer_idx} tensor {tuple(tensor.shape)} {tensor.dtype} does not fit "
                                  f"[1, {abi.num_key_value_heads}, P, {abi.head_dim}] {abi.dtype}", f"$.cache.layers[{layer_idx}]")
        if snapshot.tensors is not None and len(snapshot.tensors) != abi.num_layers:
            raise _refuse(SNAPSHOT_ABI_MISMATCH, f"{len(snapshot.tensors)} layers stored, the model has {abi.num_layers}", "$.cache.num_layers")
    # pending suffix against the declared form
    if rec.form not in SNAPSHOT_FORMS:
        raise _refuse(SNAPSHOT_PENDING_INVALID, f"unknown form {rec.form!r}", "$.form")
    if len(pending) > 1 or (pending and outputs[-len(pending):] != pending):
        raise _refuse(SNAPSHOT_PENDING_INVALID, f"pending {list(pending)} is not a one-token suffix of the output", "$.state.pending_ids")
    tag_ok = {PendingTag.EMPTY: not pending, PendingTag.PENDING_NEXT_CALL: bool(pending) and rec.phase is Phase.READY,
              PendingTag.CLOSED_UNPROCESSED: bool(pending) and rec.phase is Phase.FINISHED}[rec.pending_tag]
    if not tag_ok:
        raise _refuse(SNAPSHOT_PENDING_INVALID, f"tag {rec.pending_tag.value} with U = {list(pending)} in phase {rec.phase.value}", "$.state.pending_tag")
    if rec.form == REPAIRED and pending:
        raise _refuse(SNAPSHOT_PENDING_INVALID, "a 'repaired' snapshot with a token still ahead of the cache frontier", "$.state.pending_ids")
    allowed = (Phase.READY, Phase.FINISHED) if rec.form == PENDING_SUFFIX else (Phase.READY, Phase.SCORED, Phase.FINISHED)
    if rec.phase not in allowed:
        raise _refuse(SNAPSHOT_PENDING_INVALID, f"a {rec.form} snapshot cannot be in phase {rec.phase.value}", "$.state.phase")
    # frontiers
    # before any output, P stops at 0 or (chunked prefill into a cache) between chunks
    chunked = request.cached and request.prefill_chunk is not None
    in_prefill = not outputs and not pending and (rec.processed == 0 or (chunked and 0 < rec.processed < prompt_len))
    if not (rec.processed + len(pending) == prompt_len + len(outputs) or in_prefill) or rec.processed < 0:
        raise _refuse(SNAPSHOT_FRONTIER_INVALID, f"P {rec.processed} + |U| {len(pending)} != L {prompt_len} + O {len(outputs)}", "$.state.processed")
    if rec.phase is Phase.READY and not in_prefill and len(pending) != 1:
        raise _refuse(SNAPSHOT_FRONTIER_INVALID, "between calls after the prompt exactly one token is pending", "$.state.pending_ids")
    if request.cache == "static" and rec.processed > (snapshot.capacity or 0):
        raise _refuse(SNAPSHOT_FRONTIER_INVALID, f"P {rec.processed} exceeds the capacity {snapshot.capacity}", "$.state.processed")
    if request.cached:
        rows = {k.shape[2] for k, _ in snapshot.tensors or ()} | {v.shape[2] for _, v in snapshot.tensors or ()}
        if (rows or {0}) != {rec.processed} or rec.lanes != expected_lanes:
            raise _refuse(SNAPSHOT_FRONTIER_INVALID, f"the cache holds {sorted(rows)} rows and lanes {rec.lanes}; P is {rec.processed}", "$.cache")
    _check_ledger(snapshot, model, request)


def _check_ledger(snapshot: RuntimeSnapshot, model, request) -> None:
    """The ledger checks (``snapshot.ledger_invalid``): receipts, score rows, finish state, bounds, call counters.

    The same facts as the spec's restore checks "receipts line up with the outputs and the RNG
    counter", "score rows line up with the receipts and the phase" and "finish state, bounds and
    counters are consistent" (``spec/snapshot.py`` ``RESTORE_CHECKS``), written over the runner's
    own bookkeeping: one logprob and one receipt per output, receipt ids unique and issued, each
    receipt's RNG counter continuing the previous one's draws; every consumed receipt's score row
    taken at O = its index, P = L + its index; a consumable score exactly in SCORED, at the
    record's generation and frontiers; a finish reason exactly in FINISHED, the highest-precedence
    trigger; EOS only as the last output; and the counters: P > 0 needs a model call under a
    generation >= 1, each score row its own generation, retries within ``max_retries``.

    Source: M3.10 0x06 "One selection is an output-state transaction", 0x00 "Immutable identity
    versus mutable request state".
    """
    rec = snapshot.record
    prompt_len = len(request.prompt_ids)
    outputs = rec.output_ids
    vocab_size = model.config.vocab_size
    # receipts
    if not (len(snapshot.logprobs) == len(outputs) == len(rec.consumed)):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"{len(outputs)} outputs, {len(snapshot.logprobs)} logprobs, {len(rec.consumed)} receipts", "$.logprobs")
    for index, (c, t) in enumerate(zip(rec.consumed, outputs)):
        if c.token_id != t:
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"consumed receipt {index} names token {c.token_id}, output {index} is {t}",
                          f"$.state.consumed[{index}].token_id")
    for index, lp in enumerate(snapshot.logprobs):
        if not (math.isfinite(lp) and lp <= 0.0):
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"logprob {index} is {lp!r}; a log-probability is finite and <= 0", f"$.logprobs[{index}]")
    _check_receipts(snapshot)
    _check_observer(snapshot)
    receipt_ids = [c.receipt_id for c in rec.consumed]
    if len(set(receipt_ids)) != len(receipt_ids) or len(set(rec.issued)) != len(rec.issued) or not set(receipt_ids) <= set(rec.issued):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, "consumed receipts must be distinct and issued, issued receipts distinct", "$.state.issued")
    counter = request.rng_counter_start
    for index, c in enumerate(rec.consumed):
        if c.rng_counter_before != counter or not 0 <= c.draws <= request.max_draws():
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {index} starts at RNG counter {c.rng_counter_before} with {c.draws} draws; "
                          f"expected counter {counter} and 0..{request.max_draws()} draws", f"$.state.consumed[{index}]")
        counter += c.draws
    if rec.rng_counter != counter or snapshot.policy_state.rng_counter != rec.rng_counter:
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"RNG counter {rec.rng_counter} / policy {snapshot.policy_state.rng_counter} != start "
                      f"{request.rng_counter_start} + {counter - request.rng_counter_start} draws", "$.state.rng_counter")
    # score rows
    rows = {s.score_id: s for s in rec.scores}
    if len(rows) != len(rec.scores):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, "score ids repeat", "$.state.scores")
    for index, c in enumerate(rec.consumed):
        row = rows.get(c.score_id)
        if row is None or row.output_count != index or row.processed != prompt_len + index:
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {index} was not decided on a score row taken at O = {index}, "
                          f"P = {prompt_len + index}", f"$.state.consumed[{index}].score_id")
    if (rec.score is not None) != (rec.phase is Phase.SCORED) or (rec.score is not None) != (snapshot.score_logits is not None):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, "a score row exists exactly in SCORED", "$.score")
    if rec.score is not None and (rows.get(rec.score.score_id) != rec.score or rec.score.generation != rec.generation
                                  or rec.score.processed != rec.processed or rec.score.output_count != len(outputs)):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"the consumable score {rec.score} is not the record's own row at generation "
                      f"{rec.generation}, P {rec.processed}, O {len(outputs)}", "$.state.score")
    if snapshot.score_logits is not None and tuple(snapshot.score_logits.shape) != (vocab_size,):
        raise _refuse(SNAPSHOT_ABI_MISMATCH, f"score row {tuple(snapshot.score_logits.shape)} is not [V = {vocab_size}]", "$.score")
    # finish state
    if (rec.phase is Phase.FINISHED) != (rec.finish_reason is not None):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, "a finish reason exists exactly in FINISHED", "$.state.finish_reason")
    if rec.phase is Phase.FINISHED and (not rec.triggers or rec.finish_reason is not published_finish_reason(rec.triggers)):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"finish reason {rec.finish_reason} is not the first of the triggers "
                      f"{sorted(t.value for t in rec.triggers)} under the finish precedence", "$.state.triggers")
    if rec.phase is not Phase.FINISHED and rec.triggers:
        raise _refuse(SNAPSHOT_LEDGER_INVALID, "finish triggers recorded before the request finished", "$.state.triggers")
    eos_at = [i for i, t in enumerate(outputs) if t in request.eos_ids]
    if eos_at and (eos_at != [len(outputs) - 1] or rec.phase is not Phase.FINISHED or eos_at[0] < request.min_new_tokens):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"EOS at output positions {eos_at}: only the last output of a finished request, "
                      f"at or after min_new_tokens {request.min_new_tokens}", "$.state.output_ids")
    # bounds
    cap = context_cap(model.config.max_position_embeddings, request.context_cap, snapshot.capacity)
    if len(outputs) > request.max_new_tokens or prompt_len + len(outputs) > cap or any(not 0 <= t < vocab_size for t in outputs):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"outputs beyond max_new_tokens {request.max_new_tokens}, the context cap {cap} "
                      f"or the vocabulary", "$.state.output_ids")
    # call counters against P (the runtime counts every launch and advances the generation on every ALL_NEW)
    if rec.num_calls < 0 or rec.generation < 0 or not 0 <= rec.num_retries <= request.max_retries:
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"counters out of range: {rec.num_calls} calls, generation {rec.generation}, "
                      f"{rec.num_retries} retries (max_retries {request.max_retries})", "$.state.num_calls")
    if rec.processed > 0 and (rec.num_calls < 1 or rec.generation < 1):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"P = {rec.processed} rows processed after {rec.num_calls} model calls at generation "
                      f"{rec.generation}", "$.state.num_calls")
    if rec.generation < len(rec.scores):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"{len(rec.scores)} score rows under generation {rec.generation} (each ALL_NEW call "
                      f"advances it)", "$.state.generation")
    # The generation counts the ALL_NEW completions and the recoveries, and each recovery follows a failed call, so it is at
    # most the launches; with no retry in an open request every call was ALL_NEW, so it is exactly the launches; and no score
    # is newer than it (the snapshot fuzz's oracle: a generation of 49151 was admitted and renamed every later score row).
    if rec.generation > rec.num_calls or (rec.num_retries == 0 and rec.phase is not Phase.FINISHED and rec.generation != rec.num_calls):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"generation {rec.generation} after {rec.num_calls} model calls and {rec.num_retries} "
                      "retries (each ALL_NEW call or recovery advances it once)", "$.state.generation")
    newest = max((sc.generation for sc in rec.scores), default=0)
    if newest > rec.generation or (rec.score is not None and rec.score.generation != rec.generation):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"a score row of generation {max(newest, getattr(rec.score, 'generation', 0))} beside "
                      f"generation {rec.generation}", "$.state.generation")


def _check_receipts(snapshot: RuntimeSnapshot) -> None:
    """The decision receipts against the ledger, field by field (``snapshot.ledger_invalid``, the field named).

    The runner holds the receipts of the tokens it decided itself (after a restore, those decided
    since), so the ``n`` receipts line up with the last ``n`` outputs: receipt ``j`` is output
    ``i = O - n + j`` and must name its token (``selected_id``), its logprob (``raw_logprob``, equal
    to ``logprobs[i]``), its step (``i``), score row, draws and RNG counter, and carry the content
    hash of its own fields (``receipt_id``), and name the request's effective policy by its
    ``policy_digest`` (the snapshot's request carries the policy once) with its applied
    ``transforms`` a subsequence of that policy's
    (:func:`~decodespec.spec.policy.receipt.receipt_policy_mismatch`, which also reads the older
    embedded form).  A pending token changed everywhere but in the last receipt is refused here.

    Source: M3.8 0x0B decision receipts; M3.10 0x06 "One selection is an output-state transaction".
    """

    rec = snapshot.record
    receipts, outputs = snapshot.receipts, rec.output_ids
    policy = policy_with_min_new_tokens(snapshot.request.policy, snapshot.request.min_new_tokens)
    if len(receipts) > len(outputs):
        raise _refuse(SNAPSHOT_LEDGER_INVALID, f"{len(receipts)} decision receipts for {len(outputs)} outputs", "$.receipts")
    offset = len(outputs) - len(receipts)
    for j, receipt in enumerate(receipts):
        i, path = offset + j, f"$.receipts[{j}]"
        if not isinstance(receipt, dict):
            raise _refuse(SNAPSHOT_MALFORMED, f"a decision receipt is an object, not {type(receipt).__name__}", path)
        consumed = rec.consumed[i]
        rng = receipt.get("rng")
        expected = (("selected_id", outputs[i]), ("raw_logprob", snapshot.logprobs[i]), ("step", i), ("score_id", consumed.score_id),
                    ("draws", consumed.draws))
        for key, want in expected:
            shown = quote_content if key == "selected_id" else quote  # a token id is user content (spec/errors.py)
            if receipt.get(key) != want or isinstance(receipt.get(key), bool):
                raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {j} (output {i}) records {key} = {shown(receipt.get(key))}; the ledger "
                              f"has {shown(want)}", f"{path}.{key}")
        if not isinstance(rng, dict) or rng.get("counter_before") != consumed.rng_counter_before:
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {j} (output {i}) does not start at RNG counter {consumed.rng_counter_before}",
                          f"{path}.rng.counter_before")
        mismatch = receipt_policy_mismatch(receipt, policy)
        if mismatch is not None:
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {j} (output {i}) {mismatch[1]}", f"{path}.{mismatch[0]}")
        body = {k: v for k, v in receipt.items() if k != "receipt_id"}
        try:
            digest = content_id(body)
        except (rfc8785.CanonicalizationError, TypeError, ValueError, RecursionError):
            digest = None
        if digest is None or receipt.get("receipt_id") != digest:
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"receipt {j} (output {i}): receipt_id is not the content hash of its fields",
                          f"{path}.receipt_id")


def _check_observer(snapshot: RuntimeSnapshot) -> None:
    """The stop/stream observer's state against the ledger (``snapshot.ledger_invalid``, the field named).

    Its ``output_ids`` must be the snapshot's outputs and its ``logprobs`` the ledger's logprobs
    (which the receipts and the finiteness check above have bound), element by element.
    """
    state = snapshot.observer_state
    if state is None:
        return
    if not isinstance(state, dict):
        raise _refuse(SNAPSHOT_MALFORMED, f"the observer state is an object, not {type(state).__name__}", "$.observer")
    if state.get("format") != OUTPUT_STATE_FORMAT:
        raise _refuse(SNAPSHOT_MALFORMED, f"the observer state's format is {quote(state.get('format'))}, not {OUTPUT_STATE_FORMAT}",
                      "$.observer.format")
    rec = snapshot.record
    for key, want in (("output_ids", list(rec.output_ids)), ("logprobs", list(snapshot.logprobs))):
        got = state.get(key)
        if not isinstance(got, list):
            raise _refuse(SNAPSHOT_MALFORMED, f"the observer's {key} is not a list", f"$.observer.{key}")
        if len(got) != len(want):
            raise _refuse(SNAPSHOT_LEDGER_INVALID, f"the observer holds {len(got)} {key}, the ledger {len(want)}", f"$.observer.{key}")
        shown = quote_content if key == "output_ids" else quote  # token ids are user content (spec/errors.py)
        for index, (g, w) in enumerate(zip(got, want)):
            if g != w or isinstance(g, bool) or not isinstance(g, (int, float)):
                raise _refuse(SNAPSHOT_LEDGER_INVALID, f"the observer's {key}[{index}] is {shown(g)}; the ledger has {shown(w)}",
                              f"$.observer.{key}[{index}]")


def restore_runner(cls, model, snapshot: RuntimeSnapshot, request=None, **kwargs: Any):
    """A runner of class ``cls`` that continues ``snapshot`` (every check passes before any state is built).

    Args:
        cls: :class:`~decodespec.impl.runtime.RequestRunner` (or a subclass).
        model: The decoder.
        snapshot: The snapshot.
        request: The request to continue (default the snapshot's own); its identity must match.
        **kwargs: Passed to ``cls`` (sink, faults, observer, tokenizer, runtime_info).

    Raises:
        Rejection: ``snapshot.*`` (see the module docstring).
    """

    request = snapshot.request if request is None else request
    _check(snapshot, model, request)
    runner = cls(model, request, **kwargs)
    rec = snapshot.record
    if runner.cache is not None and snapshot.tensors:
        device = model.device
        runner.cache.load_committed([(k.to(device), v.to(device)) for k, v in snapshot.tensors], generation=rec.generation)
    elif runner.cache is not None:
        runner.cache.generation = rec.generation
    score = None
    if rec.score is not None:
        logits = snapshot.score_logits.to(model.device)
        score = Score(rec.score.score_id, rec.score.generation, rec.score.processed, rec.score.output_count, logits)
    runner.adopt_state(RunnerState(
        phase=rec.phase,
        processed=rec.processed,
        output_ids=tuple(rec.output_ids),
        logprobs=tuple(snapshot.logprobs),
        receipts=(),
        consumed=tuple(Decision(c.receipt_id, c.score_id, c.token_id, lp, c.draws, c.rng_counter_before, None, None)
                       for c, lp in zip(rec.consumed, snapshot.logprobs)),
        pending_ids=tuple(rec.pending_ids),
        pending_tag=rec.pending_tag,
        generation=rec.generation,
        in_flight=None,
        score=score,
        decision=None,
        issued=tuple(rec.issued),
        scores=tuple((s.score_id, s.generation, s.processed, s.output_count) for s in rec.scores),
        policy_state=snapshot.policy_state,
        finish_reason=rec.finish_reason,
        triggers=frozenset(rec.triggers),
        quarantined=False,
        num_calls=rec.num_calls,
        num_retries=rec.num_retries,
    ))
    if snapshot.observer_state is not None:
        runner.observer.restore_state(snapshot.observer_state)
    if runner.sink is not None:
        runner._emit_request()
        runner.sink.emit("restore", form=rec.form, frontier=runner.frontier(), state=rec.to_json())
    return runner
