"""M3.10 "A completed output is not automatically a resumable snapshot": the two snapshot forms and restore.

A snapshot binds the request identity and every piece of mutable state needed to continue
exactly (M3.10 "Immutable identity versus mutable request state": committed tokens, next
model-input slice, per-lane frontiers, generation, RNG counter, finish state and the receipt
ledger that aligns tokens with logprobs).  The spec models it as a :class:`SnapshotRecord` (the
logical part; the runtime adds the cache tensors, logprob values, policy state and stop/stream
state) in one of two declared forms:

* ``pending_suffix`` (:data:`PENDING_SUFFIX`): taken between calls (phase READY) or after
  finish; binds ``P`` and the pending suffix ``U`` (often ``[u_O]``, tagged PENDING_NEXT_CALL or
  CLOSED_UNPROCESSED) with ``P + |U| = L + O`` (or, during a chunked prefill, ``O = 0``, ``U = []``,
  ``P < L``).  The pending token is *not* processed state: restoring it never counts it in P.
* ``repaired`` (:data:`REPAIRED`): a valid append call has processed U (the ordinary decode
  call, or the repair call after finish) and its complete all-lane state was selected, so
  ``U = []`` and ``P = L + O``.  Taken in SCORED (the append call's row is the next decision's
  consumable score, carried by the snapshot), after a repair (FINISHED, U empty), or where U is
  already empty.  Never manufactured by relabelling: a record that claims ``repaired`` while a
  token is still pending is refused (``snapshot.pending_invalid``).

Pure functions: :func:`snapshot_forms` (which forms a state admits), :func:`take_snapshot`,
:func:`restore_state` (validate every field in a fixed order, then build the state) and
:data:`RESTORE_CHECKS` (the same validation as named guard clauses, used by
``transition.restore``).  Declared choices: a restored state keeps the snapshot's generation
(its score stays bound), is never quarantined, and has no ``last_completion`` (diagnostic
history, not resumable state); snapshots are refused while a call is in flight, a decision
is pending (DECIDED) or the handle is quarantined.

Error codes (all ``Rejection``; nothing is built when one is raised):
``snapshot.form_unavailable``, ``snapshot.identity_mismatch``, ``snapshot.abi_mismatch``,
``snapshot.frontier_invalid``, ``snapshot.pending_invalid``, ``snapshot.ledger_invalid``,
``snapshot.malformed``, ``snapshot.unauthenticated``.

Integrity, plainly: a snapshot file records the SHA-256 of its tensor file, and the restore checks
bind every logical field to every other (receipts, logprobs, observer, frontiers).  The SHA-256
detects *accidental* damage only: whoever can edit the file can edit a tensor and its recorded
hash together, and such a file is accepted (the cache rows are not recomputed).  An
authenticated form exists: with a key in :data:`SNAPSHOT_KEY_ENV`, the writer adds an
HMAC-SHA256 (:data:`SNAPSHOT_MAC_ALGORITHM`) over the document's RFC 8785 bytes (which include
the tensor file's SHA-256), and the reader refuses a file without a matching HMAC
(``snapshot.unauthenticated``).  Without a key the HMAC is neither written nor checked.

Source: M3.10 0x0BA "A completed output is not automatically a resumable snapshot" (both
forms; "never copy the rejected/candidate row, increment a length field, or relabel a cache
slot"), "Immutable identity versus mutable request state" (a resume snapshot binds identity and
mutable state), 0x0A (resume equivalence is the RESUME comparison level).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .enums import FinishReason, PendingTag, published_finish_reason
from .errors import Rejection, quote, register_code
from .state import Phase, Receipt, RequestParams, RequestState, Score

__all__ = [
    "PENDING_SUFFIX",
    "REPAIRED",
    "RESTORE_CHECKS",
    "SNAPSHOT_ABI_MISMATCH",
    "SNAPSHOT_FORMS",
    "SNAPSHOT_FORM_UNAVAILABLE",
    "SNAPSHOT_FRONTIER_INVALID",
    "SNAPSHOT_IDENTITY_MISMATCH",
    "SNAPSHOT_KEY_ENV",
    "SNAPSHOT_LEDGER_INVALID",
    "SNAPSHOT_MAC_ALGORITHM",
    "SNAPSHOT_MALFORMED",
    "SNAPSHOT_PENDING_INVALID",
    "SNAPSHOT_UNAUTHENTICATED",
    "RestoreCheck",
    "SnapshotRecord",
    "form_available",
    "restore_failure",
    "restore_state",
    "snapshot_forms",
    "take_snapshot",
]

PENDING_SUFFIX = "pending_suffix"
REPAIRED = "repaired"
#: The two declared snapshot forms.
SNAPSHOT_FORMS = (PENDING_SUFFIX, REPAIRED)

_S = "M3.10 0x0BA A completed output is not automatically a resumable snapshot"
SNAPSHOT_FORM_UNAVAILABLE = register_code(
    "snapshot.form_unavailable", "rejection", _S,
    "No snapshot of the requested form exists in this state (a call in flight, a pending decision, a quarantined handle, "
    "a repaired form while a token is still pending, or an unknown form).")
SNAPSHOT_IDENTITY_MISMATCH = register_code(
    "snapshot.identity_mismatch", "rejection", "M3.10 Immutable identity versus mutable request state",
    "The snapshot belongs to another request identity (changing any identity field is a new request, not progress).")
SNAPSHOT_ABI_MISMATCH = register_code(
    "snapshot.abi_mismatch", "rejection", "M3.10 0x09 A cache is an ABI, not an untyped tuple",
    "The snapshot's cache family, lane roster, cache ABI or tensor layout differs from the restoring runtime's.")
SNAPSHOT_FRONTIER_INVALID = register_code(
    "snapshot.frontier_invalid", "rejection", _S,
    "The snapshot's frontiers violate P + |U| = L + O (or the prefill shape O = 0, U = [], P < L), a lane is not at P, "
    "the cache does not hold exactly P rows, or P exceeds the static capacity.")
SNAPSHOT_PENDING_INVALID = register_code(
    "snapshot.pending_invalid", "rejection", _S,
    "The pending suffix is not the declared form: more than one token, not the output's suffix, a tag that disagrees with "
    "U or the phase, or a token pending in a 'repaired' snapshot.")
SNAPSHOT_LEDGER_INVALID = register_code(
    "snapshot.ledger_invalid", "rejection", "M3.10 0x06 One selection is an output-state transaction",
    "The receipt ledger disagrees with the outputs: receipts, score rows, logprobs, RNG counter, finish state or call "
    "counters do not line up.")
SNAPSHOT_UNAUTHENTICATED = register_code(
    "snapshot.unauthenticated", "rejection", "M3.10 0x06 Bound parsers, matchers, traces, and sensitive data",
    "A snapshot key is set (DECODESPEC_SNAPSHOT_KEY) but the snapshot carries no HMAC-SHA256, or its HMAC does not match: "
    "the file was not written with this key, or was changed after it was.")
#: Environment variable holding the user's snapshot key (its UTF-8 bytes are the HMAC-SHA256 key).
SNAPSHOT_KEY_ENV = "DECODESPEC_SNAPSHOT_KEY"
#: The one authentication algorithm a snapshot may declare.
SNAPSHOT_MAC_ALGORITHM = "hmac-sha256"
SNAPSHOT_MALFORMED = register_code(
    "snapshot.malformed", "rejection", _S,
    "The snapshot file is not a decodespec snapshot (bad JSON, missing or mistyped field, missing or altered tensor file).")


@attrs.frozen
class SnapshotRecord:
    """The logical part of a resumable snapshot (see the module docstring).

    Attributes:
        identity: Request identity the snapshot belongs to.
        form: :data:`PENDING_SUFFIX` or :data:`REPAIRED`.
        phase: READY, SCORED or FINISHED.
        processed: P.
        output_ids: The committed output (O = its length).
        pending_ids / pending_tag: U and its tag.
        lanes: ``(lane, frontier or None)`` in roster order.
        generation: The state/cache generation of the retained state.
        score: The consumable score (``repaired`` form in SCORED), else ``None``.
        issued / consumed / scores: The receipt ledger (issued ids, consumed receipts in
            output order, every exposed score the consumed receipts and the current score bind).
        rng_counter: The request RNG counter.
        finish_reason / triggers: Finish state.
        num_calls / num_retries: Call counters (call ids continue after a restore).
    """

    identity: str
    form: str
    phase: Phase
    processed: int
    output_ids: tuple[int, ...]
    pending_ids: tuple[int, ...]
    pending_tag: PendingTag
    lanes: tuple[tuple[str, int | None], ...]
    generation: int
    score: Score | None
    issued: tuple[str, ...]
    consumed: tuple[Receipt, ...]
    scores: tuple[Score, ...]
    rng_counter: int
    finish_reason: FinishReason | None
    triggers: frozenset[FinishReason]
    num_calls: int
    num_retries: int

    @property
    def output_count(self) -> int:
        """O."""
        return len(self.output_ids)

    def to_json(self) -> dict[str, Any]:
        """The record as JSON (enums as their values, sets sorted)."""
        return {
            "identity": self.identity,
            "form": self.form,
            "phase": self.phase.value,
            "processed": self.processed,
            "output_ids": list(self.output_ids),
            "pending_ids": list(self.pending_ids),
            "pending_tag": self.pending_tag.value,
            "lanes": [[name, frontier] for name, frontier in self.lanes],
            "generation": self.generation,
            "score": None if self.score is None else attrs.asdict(self.score),
            "issued": list(self.issued),
            "consumed": [attrs.asdict(r) for r in self.consumed],
            "scores": [attrs.asdict(s) for s in self.scores],
            "rng_counter": self.rng_counter,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "triggers": sorted(t.value for t in self.triggers),
            "num_calls": self.num_calls,
            "num_retries": self.num_retries,
        }

    @classmethod
    def from_json(cls, obj: Any, path: str = "$.state") -> SnapshotRecord:
        """Inverse of :meth:`to_json`.

        Raises:
            Rejection: ``snapshot.malformed`` for a missing or mistyped field.
        """
        try:
            score = obj["score"]
            return cls(
                identity=_str(obj["identity"]),
                form=_str(obj["form"]),
                phase=Phase(obj["phase"]),
                processed=_int(obj["processed"]),
                output_ids=tuple(_int(t) for t in obj["output_ids"]),
                pending_ids=tuple(_int(t) for t in obj["pending_ids"]),
                pending_tag=PendingTag(obj["pending_tag"]),
                lanes=tuple((_str(name), None if frontier is None else _int(frontier)) for name, frontier in obj["lanes"]),
                generation=_int(obj["generation"]),
                score=None if score is None else _score(score),
                issued=tuple(_str(i) for i in obj["issued"]),
                consumed=tuple(Receipt(_str(r["receipt_id"]), _str(r["score_id"]), _int(r["token_id"]), _int(r["draws"]),
                                       _int(r["rng_counter_before"])) for r in obj["consumed"]),
                scores=tuple(_score(s) for s in obj["scores"]),
                rng_counter=_int(obj["rng_counter"]),
                finish_reason=None if obj["finish_reason"] is None else FinishReason(obj["finish_reason"]),
                triggers=frozenset(FinishReason(t) for t in obj["triggers"]),
                num_calls=_int(obj["num_calls"]),
                num_retries=_int(obj["num_retries"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise Rejection(SNAPSHOT_MALFORMED, f"not a snapshot record: {type(exc).__name__}: {quote(str(exc))}", path) from None


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _score(obj: Any) -> Score:
    return Score(_str(obj["score_id"]), _int(obj["generation"]), _int(obj["processed"]), _int(obj["output_count"]))


# --------------------------------------------------------------------------------------------
# Taking a snapshot.
# --------------------------------------------------------------------------------------------


def form_available(params: RequestParams, state: RequestState, form: str) -> str | None:
    """``None`` when ``state`` admits a snapshot of ``form``, else why not (a sentence).

    Both forms need: no call in flight, no pending decision, a handle that is not quarantined.
    ``pending_suffix``: phase READY or FINISHED.  ``repaired``: U empty and phase READY,
    SCORED or FINISHED.
    """
    if form not in SNAPSHOT_FORMS:
        return f"unknown snapshot form {form!r}; expected one of {SNAPSHOT_FORMS}"
    if state.in_flight is not None:
        return "a call is in flight"
    if state.quarantined:
        return "the handle is quarantined (recover first)"
    if form == PENDING_SUFFIX and state.phase not in (Phase.READY, Phase.FINISHED):
        return f"a pending-suffix snapshot is taken between calls or after finish, not in phase {state.phase.value}"
    if form == REPAIRED:
        if state.phase not in (Phase.READY, Phase.SCORED, Phase.FINISHED):
            return f"no repaired snapshot in phase {state.phase.value}"
        if state.pending_ids:
            return "a token is still pending: run the append (decode or repair) call first"
    return None


def snapshot_forms(params: RequestParams, state: RequestState) -> tuple[str, ...]:
    """The snapshot forms ``state`` admits, in :data:`SNAPSHOT_FORMS` order."""
    return tuple(form for form in SNAPSHOT_FORMS if form_available(params, state, form) is None)


def take_snapshot(params: RequestParams, state: RequestState, form: str) -> SnapshotRecord:
    """The :class:`SnapshotRecord` of ``state`` in ``form``.

    Raises:
        Rejection: ``snapshot.form_unavailable`` (see :func:`form_available`); nothing changes.
    """
    why = form_available(params, state, form)
    if why is not None:
        raise Rejection(SNAPSHOT_FORM_UNAVAILABLE, why, "$.form")
    return SnapshotRecord(
        identity=state.identity,
        form=form,
        phase=state.phase,
        processed=state.processed,
        output_ids=state.output_ids,
        pending_ids=state.pending_ids,
        pending_tag=state.pending_tag,
        lanes=state.lanes,
        generation=state.generation,
        score=state.score,
        issued=state.issued,
        consumed=state.consumed,
        scores=state.scores,
        rng_counter=state.rng_counter,
        finish_reason=state.finish_reason,
        triggers=state.triggers,
        num_calls=state.num_calls,
        num_retries=state.num_retries,
    )


# --------------------------------------------------------------------------------------------
# Restoring: named checks in a fixed order, then the state.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class RestoreCheck:
    """One named restore check: ``holds(params, record) -> bool``; ``code`` raised when it fails."""

    name: str
    code: str
    holds: Callable[[RequestParams, SnapshotRecord], bool]


def _prefill_shape(params: RequestParams, r: SnapshotRecord) -> bool:
    """O = 0, U = [], and P a frontier a prefill can stop at: 0, or any P < L between chunks."""
    if r.output_count or r.pending_ids:
        return False
    chunked = params.cached and params.prefill_chunk is not None
    return r.processed == 0 or (chunked and 0 < r.processed < params.prompt_len)


def _balanced(params: RequestParams, r: SnapshotRecord) -> bool:
    return r.processed + len(r.pending_ids) == params.prompt_len + r.output_count or _prefill_shape(params, r)


def _lanes_ok(params: RequestParams, r: SnapshotRecord) -> bool:
    for lane in params.profile.lanes:
        if lane.name not in params.roster:
            continue
        frontier = dict(r.lanes).get(lane.name)
        if r.processed == 0:
            expected = None
        else:
            expected = r.processed if lane.advancing else params.source_len
        if frontier != expected:
            return False
    return True


def _tag_ok(params: RequestParams, r: SnapshotRecord) -> bool:
    tag = r.pending_tag
    if (tag is PendingTag.EMPTY) != (not r.pending_ids):
        return False
    if tag is PendingTag.PENDING_NEXT_CALL:
        return r.phase is Phase.READY
    if tag is PendingTag.CLOSED_UNPROCESSED:
        return r.phase is Phase.FINISHED
    return True


def _receipts_ok(params: RequestParams, r: SnapshotRecord) -> bool:
    if len(r.consumed) != r.output_count or any(c.token_id != t for c, t in zip(r.consumed, r.output_ids)):
        return False
    ids = [c.receipt_id for c in r.consumed]
    issued = set(r.issued)
    if len(set(ids)) != len(ids) or len(issued) != len(r.issued) or not set(ids) <= issued:
        return False
    counter = params.rng_counter_start
    for receipt in r.consumed:
        if receipt.rng_counter_before != counter or not 0 <= receipt.draws <= params.max_draws:
            return False
        counter += receipt.draws
    return r.rng_counter == counter


def _scores_ok(params: RequestParams, r: SnapshotRecord) -> bool:
    by_id = {s.score_id: s for s in r.scores}
    if len(by_id) != len(r.scores):
        return False
    for index, receipt in enumerate(r.consumed):
        score = by_id.get(receipt.score_id)
        if score is None or score.output_count != index or score.processed != params.prompt_len + index:
            return False
    if (r.score is not None) != (r.phase is Phase.SCORED):
        return False
    if r.score is None:
        return True
    s = r.score
    return (by_id.get(s.score_id) == s and s.generation == r.generation and s.processed == r.processed
            and s.output_count == r.output_count)


def _finish_ok(params: RequestParams, r: SnapshotRecord) -> bool:
    if (r.phase is Phase.FINISHED) != (r.finish_reason is not None):
        return False
    if r.phase is Phase.FINISHED:
        if not r.triggers or r.finish_reason is not published_finish_reason(r.triggers):
            return False
    elif r.triggers:
        return False
    eos = [i for i, t in enumerate(r.output_ids) if t in params.eos_ids]
    if eos and (eos != [r.output_count - 1] or r.phase is not Phase.FINISHED or eos[0] < params.min_new_tokens):
        return False
    bounded = r.output_count <= params.max_new_tokens and params.prompt_len + r.output_count <= params.context_cap
    counters = (r.generation >= 0 and r.num_calls >= 0 and 0 <= r.num_retries <= params.max_retries
                and (r.processed == 0 or (r.num_calls >= 1 and r.generation >= 1)) and r.generation >= len(r.scores))
    return bounded and counters and all(0 <= t < params.vocab_size for t in r.output_ids)


#: The restore validation, in the order it runs (the first failing check is reported).
RESTORE_CHECKS: tuple[RestoreCheck, ...] = (
    RestoreCheck("identity matches the request", SNAPSHOT_IDENTITY_MISMATCH, lambda p, r: r.identity == p.identity),
    RestoreCheck("lane roster matches the profile and cache family", SNAPSHOT_ABI_MISMATCH,
                 lambda p, r: tuple(name for name, _ in r.lanes) == p.roster),
    RestoreCheck("form is declared and the phase admits it", SNAPSHOT_FORM_UNAVAILABLE,
                 lambda p, r: r.form in SNAPSHOT_FORMS
                 and r.phase in ((Phase.READY, Phase.FINISHED) if r.form == PENDING_SUFFIX else (Phase.READY, Phase.SCORED, Phase.FINISHED))),
    RestoreCheck("|U| <= 1 and U is the output's suffix", SNAPSHOT_PENDING_INVALID,
                 lambda p, r: len(r.pending_ids) <= 1 and (not r.pending_ids or r.output_ids[-len(r.pending_ids):] == r.pending_ids)),
    RestoreCheck("the pending tag agrees with U and the phase", SNAPSHOT_PENDING_INVALID, _tag_ok),
    RestoreCheck("a repaired snapshot has no pending token", SNAPSHOT_PENDING_INVALID,
                 lambda p, r: r.form != REPAIRED or not r.pending_ids),
    RestoreCheck("P + |U| = L + O (or the prefill shape)", SNAPSHOT_FRONTIER_INVALID, _balanced),
    RestoreCheck("between calls, a processed prompt leaves one pending token (no score without a call)", SNAPSHOT_FRONTIER_INVALID,
                 lambda p, r: r.phase is not Phase.READY or len(r.pending_ids) == 1 or _prefill_shape(p, r)),
    RestoreCheck("P within the static capacity", SNAPSHOT_FRONTIER_INVALID,
                 lambda p, r: p.static_capacity is None or r.processed <= p.static_capacity),
    RestoreCheck("every lane at its frontier (advancing at P, fixed at S)", SNAPSHOT_FRONTIER_INVALID, _lanes_ok),
    RestoreCheck("receipts line up with the outputs and the RNG counter", SNAPSHOT_LEDGER_INVALID, _receipts_ok),
    RestoreCheck("score rows line up with the receipts and the phase", SNAPSHOT_LEDGER_INVALID, _scores_ok),
    RestoreCheck("finish state, bounds and counters are consistent", SNAPSHOT_LEDGER_INVALID, _finish_ok),
)


def restore_failure(params: RequestParams, record: SnapshotRecord) -> RestoreCheck | None:
    """The first :data:`RESTORE_CHECKS` entry ``record`` fails, or ``None`` when it is restorable."""
    return next((check for check in RESTORE_CHECKS if not check.holds(params, record)), None)


def restore_state(params: RequestParams, record: SnapshotRecord) -> RequestState:
    """Validate ``record`` against ``params`` and build the restored state.

    Returns:
        The state the snapshot was taken in, without ``last_completion``, never quarantined,
        with no call in flight and no pending receipt.

    Raises:
        Rejection: the first failing check's ``snapshot.*`` code (see :data:`RESTORE_CHECKS`);
            nothing is built.
    """
    failed = restore_failure(params, record)
    if failed is not None:
        raise Rejection(failed.code, f"restore check '{failed.name}' fails", "$.snapshot", details={"check": failed.name})
    return RequestState(
        identity=record.identity,
        phase=record.phase,
        processed=record.processed,
        output_ids=record.output_ids,
        output_logprobs=tuple(r.score_id for r in record.consumed),
        pending_ids=record.pending_ids,
        pending_tag=record.pending_tag,
        lanes=record.lanes,
        generation=record.generation,
        score=record.score,
        issued=record.issued,
        consumed=record.consumed,
        scores=record.scores,
        rng_counter=record.rng_counter,
        finish_reason=record.finish_reason,
        triggers=record.triggers,
        num_calls=record.num_calls,
        num_retries=record.num_retries,
    )
