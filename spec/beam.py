"""M3.10 0x05 / M3.8 0x0F Beam search: a coupled branch-state vector, one step, completion, stopping.

Beam search is a bookkeeping algorithm over prefixes, scores and cache rows (M3.10 0x05 "Beam
search keeps multiple prefixes"): at each step every live beam is expanded over the vocabulary,
the joint ``[K, V]`` candidate space is ranked by cumulative log-probability, terminal candidates
move to a completed set, and a bounded live frontier is kept.  Every kept child inherits *all* of
one parent's branch state (M3.10 "A beam is a coupled branch-state vector") before its token is
appended (M3.10 "Fork parent state before appending the child token").

The model is an uninterpreted ``score_fn(prefix) -> logprobs[V]``; a model call is the
:func:`beam_call` transition that processes every live branch's pending tokens (its cache then
holds the whole prefix).  The transitions are pure functions over frozen ``attrs`` values:

* :func:`initial_state` (``transition.beam_init``): one live root, the prompt pending; the other
  ``K - 1`` slots of the dense ``[K]`` score vector are vacant at ``-inf`` (M3.8 0x0F
  "First-step and finished-set contracts").
* :func:`beam_call` (``transition.beam_call``): process pending tokens.
* :func:`beam_step` (``transition.beam_step``): consume the score rows once, select
  (:func:`select_candidates`, ``selector.beam_topk``), fork (:func:`fork_child`,
  ``transition.beam_fork``), complete, close at the length cap, and evaluate the declared
  termination contract (:func:`stop_satisfied`, ``transition.beam_stop``).
* :func:`beam_search`: the driver that runs a whole search and returns a :class:`BeamResult`.

Declared choices (the seeds leave them open; each is a parameter of :class:`BeamParams` or a
fixed rule named here):

* Scores are **log-probabilities** (:data:`SCORE_KIND`): every entry is ``-inf`` or a finite
  value ``<= 0``; beam scores are cumulative sums in float64, left to right.
* Tie rule: the **lowest flat index** ``i = k * V + v`` wins (parent slot, then token id);
  parent ``= i // V``, token ``= i % V`` (M3.8 0x0F).
* Candidates with score ``-inf`` are never kept: a zero-probability continuation is not a
  hypothesis.  When fewer than ``K`` finite non-terminal candidates exist, the live frontier
  shrinks (the trailing slots are vacant).
* Kept set: the top ``K`` of all finite one-step extensions.  Terminal (EOS) candidates in it move
  to the completed set (finish ``eos``); the live frontier is refilled with the top ``K``
  non-terminal extensions (M3.8 0x0F: "EOS candidates usually move to a finished set while
  additional live candidates fill the beam frontier").
* Length ``|y|`` counts **generated** tokens including the EOS token, never the prompt (M3.10
  0x0B lists "a length penalty counting the prompt" as a bug).  Penalties: ``|y|**alpha``
  (:attr:`PenaltyForm.POWER`) or GNMT ``((5 + |y|) / 6)**alpha`` (:attr:`PenaltyForm.GNMT`);
  ``normalized = score / penalty``.
* Completed hypotheses are ranked by ``(-normalized, completion step, rank)``: an equal score
  found later never displaces an earlier one.
* The hard length cap ``max_new_tokens = G`` closes the remaining hypotheses with finish reason
  ``length`` (:class:`LengthCapRule`); an EOS token at the cap finishes ``eos`` (precedence).
* Termination contracts (:class:`EarlyStop`): HF's three ``early_stopping`` settings exactly, the
  seed's exact bound relative to the finite-beam trace, and "run to the cap" (the oracle).

The HF transformers 5.24 behaviour is the declared parameter set :meth:`BeamParams.hf_compatible`;
every difference from the normative parameters is listed in ``docs/beam-expectations.md``.

Source: M3.10 0x05 ("Beam search keeps multiple prefixes", "Applying one beam decision to request
state", "A beam is a coupled branch-state vector", "Fork parent state before appending the child
token", "Active and completed sets have different lifetimes", "Search procedures change required
runtime state"), M3.10 0x0B "Beam bookkeeping bugs", M3.8 0x0F "Beam search: joint parent/token
candidates", M3.8 0x12 items 43-47; peer: transformers 5.24 ``generation/utils.py``
``_beam_search`` and helpers.

Size: one machine: the beam parameters, the coupled branch state, one step with its invariants and
the reference search (M3.10 0x05 / M3.8 0x0F) are read together.
"""

from __future__ import annotations

import enum
import hashlib
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import rfc8785

from decodespec.spec.enums import FinishReason, canonical_finish_reason
from decodespec.spec.errors import Rejection, register_code
from decodespec.spec.policy import codes as policy_codes
from decodespec.spec.policy.config import EarlyStopping, Family, PolicyConfig
from decodespec.spec.policy.scores import ScoreKind, ScoreRow
from decodespec.spec.rules import rule

__all__ = [
    "SCORE_KIND",
    "BeamParams",
    "BeamPhase",
    "BeamResult",
    "BeamState",
    "BeamStatus",
    "BeamStepRecord",
    "BeamStop",
    "BranchLanes",
    "BranchState",
    "CacheRef",
    "Candidate",
    "EarlyStop",
    "Hypothesis",
    "LengthCapRule",
    "LengthPenalty",
    "PenaltyForm",
    "RngState",
    "RowSelection",
    "admissible_bound",
    "beam_call",
    "beam_completed_metadata",
    "beam_completed_never_expanded",
    "beam_first_step_single_parent",
    "beam_fork_before_append",
    "beam_live_frontier",
    "beam_parent_coupling",
    "beam_search",
    "beam_step",
    "branch_encoding",
    "branch_hash",
    "check_state",
    "check_step",
    "fork_child",
    "initial_state",
    "select_candidates",
    "stop_satisfied",
    "token_digest",
]

#: The declared score kind of every beam score row: natural log-probabilities (M3.10 0x05 table
#: "log-probs: log_softmax(logits) ... log-prob beam sums").  Entries are ``-inf`` or ``<= 0``;
#: rows need not sum to one (HF adds processed, un-renormalized log-probabilities).
SCORE_KIND = ScoreKind.LOGPROBS

#: Version tag that opens every branch encoding (changing the encoding changes the tag).
BRANCH_ENCODING_TAG = "decodespec.beam.branch.v1"

BEAM_INVALID_WIDTH = register_code(
    "beam.invalid_width", "rejection", "M3.8 0x0F Beam search", "The beam width K must be an integer >= 1.")
BEAM_INVALID_MAX_NEW_TOKENS = register_code(
    "beam.invalid_max_new_tokens", "rejection", "M3.10 0x05 Active and completed sets",
    "A beam search needs a hard length cap: max_new_tokens must be an integer >= 1.")
BEAM_INVALID_EOS = register_code(
    "beam.invalid_eos", "rejection", "M3.8 0x0F Beam search",
    "EOS ids must be distinct integers in [0, V).")
BEAM_INVALID_LENGTH_PENALTY = register_code(
    "beam.invalid_length_penalty", "rejection", "M3.8 0x0F Length penalty",
    "The length-penalty exponent alpha must be a finite number and the form power or gnmt.")
BEAM_INVALID_EARLY_STOPPING = register_code(
    "beam.invalid_early_stopping", "rejection", "M3.10 0x05 Active and completed sets",
    "The termination contract must be one of the declared EarlyStop kinds (HF: True, False or 'never').")
BEAM_INVALID_NUM_COMPLETED = register_code(
    "beam.invalid_num_completed", "rejection", "M3.10 0x05 Active and completed sets",
    "The completed count a termination contract waits for must be >= 1 and fit the completed capacity.")
BEAM_INVALID_CAPACITY = register_code(
    "beam.invalid_capacity", "rejection", "M3.10 0x05 Active and completed sets",
    "The completed-set capacity must be None (unbounded) or an integer >= 1.")
BEAM_EMPTY_PROMPT = register_code(
    "beam.empty_prompt", "rejection", "M3.10 0x05 Beam search keeps multiple prefixes",
    "A beam search starts from a non-empty prompt of non-negative token ids.")
BEAM_SHAPE = register_code(
    "beam.shape", "rejection", "M3.8 0x0F Beam search",
    "Score rows must be a [num_live, V] array (one 1-D row of V entries per live beam), V fixed for the search.")
BEAM_NAN_SCORE = register_code(
    "beam.nan_score", "rejection", "M3.8 0x0F Beam search", "A beam score row contains NaN.")
BEAM_NOT_LOGPROB = register_code(
    "beam.score_not_logprob", "rejection", "M3.10 0x05 log-prob beam sums",
    "A beam score row is not a log-probability row: an entry is > 0 or +inf.")
BEAM_OUTSIDE_HF = register_code(
    "beam.outside_hf_envelope", "rejection", "docs/beam-expectations.md",
    "Under the HF-compatible parameters, HF's candidate window (max(2, 1 + #EOS) * K) would hold a "
    "-inf or sentinel (-1e9) candidate, where HF and the spec are not declared equal.")
BEAM_NOT_ENABLED = register_code(
    "beam.not_enabled", "rejection", "M3.10 0x05 Applying one beam decision to request state",
    "The beam action is not enabled in this phase (each score row is consumed exactly once; nothing "
    "runs after the search is done).")
BEAM_INVALID_LANE_STATE = register_code(
    "beam.invalid_lane_state", "rejection", "M3.10 0x05 A beam is a coupled branch-state vector",
    "A constraint or decoder lane state is not a JSON value, so it cannot enter the branch hash.")


def _reject(code: str, message: str, path: str = "$", **details: Any) -> Rejection:
    return Rejection(code, message, path=path, details=details or None)


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """The converter of an id list: a tuple."""
    return tuple(values)


def _reason_value(reason: FinishReason | None) -> str | None:
    """A finish reason's JSON value (``None`` while open)."""
    return None if reason is None else reason.value


def _as_int(value: Any, code: str, path: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise _reject(code, f"expected an integer >= {minimum}, got {value!r}", path)
    try:
        out = operator.index(value)
    except TypeError:
        raise _reject(code, f"expected an integer >= {minimum}, got {value!r}", path) from None
    if out < minimum:
        raise _reject(code, f"expected an integer >= {minimum}, got {out}", path)
    return out


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


class PenaltyForm(str, enum.Enum):
    """Form of the length-penalty denominator ``lp(|y|)`` (M3.8 0x0F "Length penalty").

    * ``POWER``: ``|y| ** alpha`` (HF ``length_penalty``).
    * ``GNMT``: ``((5 + |y|) / 6) ** alpha`` (Wu et al. 2016, GNMT).
    """

    POWER = "power"
    GNMT = "gnmt"


class EarlyStop(str, enum.Enum):
    """Beam-level termination contract (M3.10 0x05 "Active and completed sets" table).

    With ``n`` the completed count the contract waits for (:attr:`BeamParams.required_completed`),
    ``c_n`` the ``n``-th best completed normalized score, ``s`` the best live cumulative score,
    ``g`` the live generated length and ``G`` the length cap:

    * ``FIXED_COUNT`` ("fixed complete count"; HF ``early_stopping=True``): stop once ``n``
      hypotheses are completed.
    * ``HEURISTIC`` (HF ``early_stopping=False``): stop once ``n`` are completed and
      ``s / lp(g) <= c_n``.  Not admissible for ``alpha > 0``: a longer descendant can still win.
    * ``NEVER`` (HF ``early_stopping="never"``): as ``HEURISTIC`` but with ``lp(G)`` when
      ``alpha > 0``.  Admissible under non-positive increments (despite its name it does stop).
    * ``EXACT`` ("exact relative to a declared finite-beam search trace"): stop once ``n`` are
      completed and no live hypothesis can beat ``c_n`` under the admissible bound
      :func:`admissible_bound`.
    * ``AT_CAP``: never stop early; run until no live hypothesis remains or the length cap.
    """

    FIXED_COUNT = "fixed_count"
    HEURISTIC = "heuristic"
    NEVER = "never"
    EXACT = "exact"
    AT_CAP = "at_cap"


class LengthCapRule(str, enum.Enum):
    """Which hypotheses the hard length cap closes (M3.10 0x05: "close all remaining hypotheses at
    the cap ... truncation is a finish reason, not EOS").

    * ``CLOSE_LIVE`` (normative): every live child that reaches ``G`` tokens completes with finish
      reason ``length``.
    * ``CLOSE_TOP_RANKS`` (HF): only the candidates of the last step ranked ``< K`` among all
      candidates complete; live children ranked ``>= K`` are discarded (HF ``top_num_beam_mask``).
    """

    CLOSE_LIVE = "close_live"
    CLOSE_TOP_RANKS = "close_top_ranks"


@attrs.frozen
class LengthPenalty:
    """Declared length normalisation ``normalized = score / lp(|y|)`` (M3.8 0x0F "Length penalty").

    Attributes:
        alpha: Exponent; ``0`` ranks completed hypotheses by raw cumulative log-probability,
            ``> 0`` favours longer ones, ``< 0`` shorter ones.
        form: :class:`PenaltyForm`.

    Raises:
        Rejection: ``beam.invalid_length_penalty`` if ``alpha`` is not finite.

    Units: ``|y|`` counts generated tokens including EOS, never prompt tokens.
    """

    alpha: float = attrs.field(default=0.0)
    form: PenaltyForm = attrs.field(default=PenaltyForm.POWER)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise _reject(BEAM_INVALID_LENGTH_PENALTY, f"alpha must be a finite number, got {self.alpha!r}",
                          "$.length_penalty.alpha")
        if not isinstance(self.form, PenaltyForm):
            try:
                object.__setattr__(self, "form", PenaltyForm(self.form))
            except ValueError:
                raise _reject(BEAM_INVALID_LENGTH_PENALTY, f"unknown form {self.form!r}",
                              "$.length_penalty.form") from None
        object.__setattr__(self, "alpha", float(self.alpha))

    def denominator(self, length: int) -> float:
        """``lp(length)``: ``length ** alpha`` (POWER) or ``((5 + length) / 6) ** alpha`` (GNMT).

        Args:
            length: Generated tokens ``|y| >= 1`` (EOS included).

        Returns:
            A positive float.
        """
        assert length >= 1, "a normalized score needs |y| >= 1"
        base = float(length) if self.form is PenaltyForm.POWER else (5.0 + length) / 6.0
        factor: float = base ** self.alpha
        return factor

    @rule("transform.beam_length_penalty", title="Beam length normalisation", section="M3.8 0x0F Length penalty",
          statement="normalized = score / lp(|y|) with lp = |y|**alpha (power) or ((5+|y|)/6)**alpha (GNMT); "
                    "|y| counts generated tokens including EOS and never the prompt.")
    def normalize(self, score: float, length: int) -> float:
        """The normalized score ``score / lp(length)`` of a hypothesis with ``length`` generated tokens."""
        return score / self.denominator(length)

    def to_json(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "form": self.form.value}


def _early_stop(value: Any) -> EarlyStop:
    try:
        return EarlyStop(value)
    except ValueError:
        raise _reject(BEAM_INVALID_EARLY_STOPPING, f"unknown termination contract {value!r}", "$.early_stop") from None


@attrs.frozen
class BeamParams:
    """Declared parameters of one beam search (immutable; separate from :class:`BeamState`).

    Attributes:
        num_beams: Beam width ``K >= 1``.
        max_new_tokens: Hard length cap ``G >= 1`` on generated tokens.
        eos_ids: Terminal token ids (may be empty: then only the cap completes hypotheses).
        length_penalty: :class:`LengthPenalty` used for completed scores and stopping bounds.
        early_stop: :class:`EarlyStop` termination contract.
        num_completed: ``n``, the completed count the contract waits for; ``None`` means ``1``
            for ``EXACT`` (the best result) and ``K`` for the HF-derived kinds.
        completed_capacity: ``None`` keeps every completed hypothesis; an integer keeps only the
            best ones (HF keeps ``K``).
        length_cap_rule: :class:`LengthCapRule`.
        hf_envelope: When true, a step where HF's candidate window would hold a ``-inf`` or
            sentinel candidate raises ``beam.outside_hf_envelope`` instead of silently differing.

    Raises:
        Rejection: ``beam.invalid_width``, ``beam.invalid_max_new_tokens``, ``beam.invalid_eos``,
            ``beam.invalid_early_stopping``, ``beam.invalid_num_completed``,
            ``beam.invalid_capacity``.

    Source: M3.8 0x0F (width, joint candidates, length penalty), M3.10 0x05 (termination table).
    """

    num_beams: int
    max_new_tokens: int
    eos_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    length_penalty: LengthPenalty = attrs.field(factory=LengthPenalty)
    early_stop: EarlyStop = attrs.field(default=EarlyStop.EXACT, converter=_early_stop)
    num_completed: int | None = None
    completed_capacity: int | None = None
    length_cap_rule: LengthCapRule = attrs.field(default=LengthCapRule.CLOSE_LIVE, converter=LengthCapRule)
    hf_envelope: bool = False

    def __attrs_post_init__(self) -> None:
        def set_(name: str, value: object) -> None:  # frozen init
            object.__setattr__(self, name, value)

        set_("num_beams", _as_int(self.num_beams, BEAM_INVALID_WIDTH, "$.num_beams", 1))
        set_("max_new_tokens", _as_int(self.max_new_tokens, BEAM_INVALID_MAX_NEW_TOKENS, "$.max_new_tokens", 1))
        eos = tuple(_as_int(e, BEAM_INVALID_EOS, f"$.eos_ids[{i}]", 0) for i, e in enumerate(self.eos_ids))
        if len(set(eos)) != len(eos):
            raise _reject(BEAM_INVALID_EOS, f"duplicate EOS ids {list(eos)}", "$.eos_ids")
        set_("eos_ids", eos)
        if not isinstance(self.length_penalty, LengthPenalty):
            raise _reject(BEAM_INVALID_LENGTH_PENALTY, "length_penalty must be a LengthPenalty", "$.length_penalty")
        if self.completed_capacity is not None:
            set_("completed_capacity", _as_int(self.completed_capacity, BEAM_INVALID_CAPACITY, "$.completed_capacity", 1))
        if self.num_completed is not None:
            set_("num_completed", _as_int(self.num_completed, BEAM_INVALID_NUM_COMPLETED, "$.num_completed", 1))
        cap = self.completed_capacity
        if cap is not None and self.required_completed > cap:
            raise _reject(BEAM_INVALID_NUM_COMPLETED,
                          f"the contract waits for {self.required_completed} completed hypotheses but the "
                          f"completed set keeps only {cap}", "$.num_completed")

    @property
    def required_completed(self) -> int:
        """``n``: how many completed hypotheses the termination contract waits for."""
        if self.num_completed is not None:
            return self.num_completed
        return 1 if self.early_stop in (EarlyStop.EXACT, EarlyStop.AT_CAP) else self.num_beams

    @property
    def hf_candidate_window(self) -> int:
        """HF's ``beams_to_keep = max(2, 1 + #EOS) * K`` (transformers 5.24 ``_beam_search``)."""
        return max(2, 1 + len(self.eos_ids)) * self.num_beams

    @classmethod
    def hf_compatible(
        cls,
        num_beams: int,
        max_new_tokens: int,
        eos_ids: Iterable[int] = (),
        *,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> BeamParams:
        """The parameters under which the spec equals HF ``generate(num_beams=K, ...)``.

        HF transformers 5.24 ``_beam_search`` (``do_sample=False``, one request): power length
        penalty over generated tokens, ``early_stopping`` True / False / ``"never"`` mapped to
        ``FIXED_COUNT`` / ``HEURISTIC`` / ``NEVER`` waiting for ``K`` completions, a completed set
        of capacity ``K``, the cap closing only the top-``K`` ranks, and the HF envelope check.
        ``generate``'s ``num_return_sequences = r`` is ``BeamResult.returned(r)``.

        Args:
            num_beams: HF ``num_beams`` (K).
            max_new_tokens: HF ``max_new_tokens`` (``max_length - prompt_len``).
            eos_ids: HF ``eos_token_id`` (all of them).
            length_penalty: HF ``length_penalty`` (default 1.0 as in HF).
            early_stopping: HF ``early_stopping``: ``True``, ``False`` (HF default) or ``"never"``.

        Raises:
            Rejection: ``beam.invalid_early_stopping`` for any other ``early_stopping`` value,
                and the codes of :class:`BeamParams`.

        Source: transformers 5.24 ``generation/utils.py`` ``_beam_search``,
        ``_check_early_stop_heuristic``, ``_beam_search_has_unfinished_sequences``,
        ``_update_finished_beams``; see docs/beam-expectations.md.
        """
        if early_stopping is True:
            kind = EarlyStop.FIXED_COUNT
        elif early_stopping is False:
            kind = EarlyStop.HEURISTIC
        elif early_stopping == "never":
            kind = EarlyStop.NEVER
        else:
            raise _reject(BEAM_INVALID_EARLY_STOPPING,
                          f"HF early_stopping must be True, False or 'never', got {early_stopping!r}",
                          "$.early_stopping")
        k = _as_int(num_beams, BEAM_INVALID_WIDTH, "$.num_beams", 1)
        return cls(
            num_beams=k,
            max_new_tokens=max_new_tokens,
            eos_ids=tuple(eos_ids),
            length_penalty=LengthPenalty(alpha=length_penalty, form=PenaltyForm.POWER),
            early_stop=kind,
            num_completed=k,
            completed_capacity=k,
            length_cap_rule=LengthCapRule.CLOSE_TOP_RANKS,
            hf_envelope=True,
        )

    @classmethod
    def from_policy(cls, config: PolicyConfig, max_new_tokens: int, eos_ids: Iterable[int] = ()) -> BeamParams:
        """The beam parameters of a beam-family :class:`~decodespec.spec.policy.config.PolicyConfig`.

        The policy's ``num_beams``, ``length_penalty`` and ``early_stopping`` carry HF's names and
        meaning, so ``true`` / ``false`` / ``never`` map to :meth:`hf_compatible`.  ``exact`` (not an
        HF value) gives the normative parameters: ``early_stop=EXACT`` with the policy's width and
        ``length_penalty`` as the power-form alpha, ``n = 1``, every completed hypothesis kept, the
        cap closing every live child.

        Raises:
            Rejection: ``policy.family_mismatch`` unless ``config.family`` is ``beam``.
        """
        if config.family is not Family.BEAM:
            raise _reject(policy_codes.FAMILY_MISMATCH, f"beam parameters need the beam family, not "
                          f"{config.family.value!r}", "$.policy.family")
        if config.early_stopping is EarlyStopping.EXACT:
            return cls(num_beams=config.num_beams, max_new_tokens=max_new_tokens, eos_ids=tuple(eos_ids),
                       length_penalty=LengthPenalty(alpha=config.length_penalty, form=PenaltyForm.POWER),
                       early_stop=EarlyStop.EXACT)
        early: dict[EarlyStopping, bool | str] = {EarlyStopping.TRUE: True, EarlyStopping.FALSE: False, EarlyStopping.NEVER: "never"}
        return cls.hf_compatible(config.num_beams, max_new_tokens, eos_ids, length_penalty=config.length_penalty,
                                 early_stopping=early[config.early_stopping])

    def to_json(self) -> dict[str, Any]:
        """The parameters as a JSON object (the input of :meth:`revision`)."""
        return {
            "num_beams": self.num_beams,
            "max_new_tokens": self.max_new_tokens,
            "eos_ids": list(self.eos_ids),
            "length_penalty": self.length_penalty.to_json(),
            "early_stop": self.early_stop.value,
            "num_completed": self.required_completed,
            "completed_capacity": self.completed_capacity,
            "length_cap_rule": self.length_cap_rule.value,
            "hf_envelope": self.hf_envelope,
            "score_kind": SCORE_KIND.value,
        }

    def revision(self) -> str:
        """The search-plan revision ``W``: SHA-256 of the RFC 8785 encoding of :meth:`to_json`."""
        return hashlib.sha256(rfc8785.dumps(self.to_json())).hexdigest()


# --------------------------------------------------------------------------------------------
# Branch state (X, S, L, C, P, Q, R, D, F, Pi, W) and its hash
# --------------------------------------------------------------------------------------------


class BeamStatus(str, enum.Enum):
    """``F``: a branch is an active model input (``LIVE``) or a candidate result (``COMPLETED``)."""

    LIVE = "live"
    COMPLETED = "completed"


class BeamPhase(str, enum.Enum):
    """Where a search stands: live branches have pending tokens (``AWAITING_CALL``), their score
    rows are ready to be consumed once (``AWAITING_DECISION``), or the search is over (``DONE``)."""

    AWAITING_CALL = "awaiting_call"
    AWAITING_DECISION = "awaiting_decision"
    DONE = "done"


class BeamStop(str, enum.Enum):
    """Why a search ended: its termination contract held, no live hypothesis remained, or the cap."""

    EARLY_STOP = "early_stop"
    NO_LIVE = "no_live"
    LENGTH_CAP = "length_cap"


def token_digest(tokens: Sequence[int]) -> str:
    """SHA-256 of the RFC 8785 JSON array of ``tokens``: the logical content of a cache."""
    return hashlib.sha256(rfc8785.dumps([int(t) for t in tokens])).hexdigest()


@attrs.frozen
class CacheRef:
    """``C``: the logical cache a branch owns: K/V rows for ``prefix[:num_rows]``.

    A dense runtime realizes a fork by ``index_select`` of parent rows, a paged one by a reference
    count; both must hold the same logical content, which is what ``digest`` names.

    Attributes:
        num_rows: Tokens with a K/V row (the processed frontier ``P`` of this branch).
        digest: :func:`token_digest` of those tokens.
    """

    num_rows: int
    digest: str

    @classmethod
    def of(cls, tokens: Sequence[int]) -> CacheRef:
        """The cache holding rows for exactly ``tokens``."""
        return cls(num_rows=len(tokens), digest=token_digest(tokens))


@attrs.frozen
class RngState:
    """``R``: request-owned counter-based RNG state.  Deterministic beam search draws nothing, so a
    child inherits its parent's state unchanged (the declared child-stream rule)."""

    key: str
    counter: int = 0


def _identity_lane(state: Any, token: int) -> Any:
    return state


@attrs.frozen
class BranchLanes:
    """How the opaque per-branch lanes ``Q`` (constraint automaton) and ``D`` (incremental decoder /
    stop matcher) start and advance with one appended token.  States must be JSON values.

    Attributes:
        constraint_init: ``Q`` of the root.
        constraint_step: ``(q, token) -> q'``.
        decoder_init: ``D`` of the root.
        decoder_step: ``(d, token) -> d'``.
    """

    constraint_init: Any = None
    constraint_step: Callable[[Any, int], Any] = _identity_lane
    decoder_init: Any = None
    decoder_step: Callable[[Any, int], Any] = _identity_lane


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


@attrs.frozen
class BranchState:
    """One beam's coupled branch-state vector ``B_{b,k,t} = (X, S, L, C, P, Q, R, D, F, Pi, W)``.

    Attributes:
        request_id: ``I_request``.
        row: ``b``, the request row.
        slot: ``k``: the live slot (rank among kept non-terminal candidates) or, for a completed
            hypothesis, its candidate rank at the completing step.
        step: ``t``: decisions applied along this path (equals ``length``).
        prefix: ``X``: prompt followed by generated tokens.
        prompt_len: ``X``: the prompt span is ``prefix[:prompt_len]``.
        score: ``S``: cumulative log-probability of the generated tokens (float64 sum, left to right).
        normalized: ``S``: ``score / lp(length)``; ``None`` for the root (``length == 0``).
        length: ``L``: generated tokens ``|y|``.
        cache: ``C``: :class:`CacheRef`.
        position: ``P``: ``cache_position`` / position id of the next input token (the first
            pending token); equals ``cache.num_rows``.
        constraint: ``Q`` (JSON value).
        rng: ``R``: :class:`RngState`.
        decoder: ``D`` (JSON value).
        status: ``F``: :class:`BeamStatus`.
        finish_reason: ``F``: canonical finish reason of a completed hypothesis, else ``None``.
        triggers: ``F``: every finish trigger that fired (precedence order).
        ancestry: ``Pi``: parent slot at each step (HF ``beam_indices``), ``len == length``.
        parent_hash: ``Pi``: :func:`branch_hash` of the parent state it was forked from.
        policy_revision: ``W``: :meth:`BeamParams.revision`.
        consumed_step: ``W``: the decision step whose (consumed-once) decision created this
            branch; ``None`` for the root.

    Source: M3.10 0x05 "A beam is a coupled branch-state vector".
    """

    request_id: str
    row: int
    slot: int
    step: int
    prefix: tuple[int, ...]
    prompt_len: int
    score: float
    normalized: float | None
    length: int
    cache: CacheRef
    position: int
    constraint: Any
    rng: RngState
    decoder: Any
    status: BeamStatus
    finish_reason: FinishReason | None
    triggers: tuple[FinishReason, ...]
    ancestry: tuple[int, ...]
    parent_hash: str | None
    policy_revision: str
    consumed_step: int | None

    @property
    def output_ids(self) -> tuple[int, ...]:
        """Generated tokens ``prefix[prompt_len:]``."""
        return self.prefix[self.prompt_len:]

    @property
    def pending(self) -> tuple[int, ...]:
        """Tokens without a cache row yet (``U`` of this branch)."""
        return self.prefix[self.cache.num_rows:]

    def branch_hash(self) -> str:
        """:func:`branch_hash` of this state."""
        return branch_hash(self)


def branch_encoding(b: BranchState) -> list[Any]:
    """The canonical value hashed by :func:`branch_hash`, in the seed's order.

    ``[tag, I_request, b, k, t, X, S, L, C, P, Q, R, D, F, Pi, W]``; floats are written with
    ``float.hex`` (exact, and ``-inf`` is representable).
    """
    return [
        BRANCH_ENCODING_TAG, b.request_id, b.row, b.slot, b.step,
        {"prefix": list(b.prefix), "prompt_len": b.prompt_len},
        {"score": _hex(b.score), "normalized": _hex(b.normalized)},
        b.length,
        {"num_rows": b.cache.num_rows, "digest": b.cache.digest},
        b.position,
        b.constraint,
        {"key": b.rng.key, "counter": b.rng.counter},
        b.decoder,
        {"status": b.status.value, "finish_reason": None if b.finish_reason is None else b.finish_reason.value,
         "triggers": [r.value for r in b.triggers]},
        {"ancestry": list(b.ancestry), "parent": b.parent_hash},
        {"policy": b.policy_revision, "consumed": b.consumed_step},
    ]


def branch_hash(b: BranchState) -> str:
    """``I_branch = H(I_request || b || k || t || X || S || L || C || P || Q || R || D || F || Pi || W)``.

    ``H`` is SHA-256 over the RFC 8785 (JCS) bytes of :func:`branch_encoding`.

    Returns:
        64 lowercase hex characters.

    Raises:
        Rejection: ``beam.invalid_lane_state`` if ``Q`` or ``D`` is not a JSON value.

    Source: M3.10 0x05 "A beam is a coupled branch-state vector" (the checksum ``I_branch``).
    """
    try:
        data = rfc8785.dumps(branch_encoding(b))
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise _reject(BEAM_INVALID_LANE_STATE, f"constraint/decoder lane state is not a JSON value: {exc}",
                      "$.lanes") from None
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# Candidate selection over [B, K, V]
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Candidate:
    """One ranked joint candidate ``(parent, token)`` of a step.

    Attributes:
        rank: Position in the declared order (score descending, then flat index ascending).
        flat_idx: ``parent * V + token``.
        parent: ``flat_idx // V``.
        token: ``flat_idx % V``.
        score: ``beam_scores[parent] + logprobs[parent, token]`` (float64).
        increment: ``logprobs[parent, token]``.
    """

    rank: int
    flat_idx: int
    parent: int
    token: int
    score: float
    increment: float


@attrs.frozen
class RowSelection:
    """What one request row keeps at a step.

    Attributes:
        live: The top ``K`` finite non-terminal candidates, best first (the new live slots).
        completed: Terminal (EOS) candidates ranked ``< K``, best first.
        num_finite: Finite candidates in the row's ``K * V`` grid.
    """

    live: tuple[Candidate, ...]
    completed: tuple[Candidate, ...]
    num_finite: int


def _check_rows(logprobs: np.ndarray, path: str) -> None:
    if np.isnan(logprobs).any():
        idx = tuple(int(i) for i in np.argwhere(np.isnan(logprobs))[0])
        raise _reject(BEAM_NAN_SCORE, f"NaN score at index {list(idx)}", path)
    if (logprobs > 0).any():
        idx = tuple(int(i) for i in np.argwhere(logprobs > 0)[0])
        raise _reject(BEAM_NOT_LOGPROB, f"score {float(logprobs[idx])!r} > 0 at index {list(idx)}: not a log-probability",
                      path)


@rule("selector.beam_topk", title="Joint parent/token top-K with refill", section="M3.8 0x0F Beam search",
      statement="candidates[b, k*V+v] = beam_scores[b,k] + logprobs[b,k,v]; rank finite candidates by score "
                "descending then flat index ascending; parent = flat // V, token = flat % V; terminal "
                "candidates ranked < K complete; the live frontier is the top K non-terminal candidates.")
def select_candidates(logprobs: np.ndarray, beam_scores: np.ndarray, num_beams: int,
                      eos_ids: Iterable[int] = ()) -> tuple[RowSelection, ...]:
    """Rank the joint candidate space of every row and keep a bounded frontier.

    Args:
        logprobs: Log-probability rows ``[B, K_rows, V]`` (float; ``-inf`` allowed).
        beam_scores: Cumulative scores ``[B, K_rows]``; ``-inf`` marks a vacant slot, so its
            candidates are never kept (M3.8 0x0F: "If all initial beams represent the same
            prefix, activate only one").
        num_beams: ``K``, the number of live candidates to keep per row.
        eos_ids: Terminal token ids.

    Returns:
        One :class:`RowSelection` per row ``b``.

    Raises:
        Rejection: ``beam.shape`` (ranks or sizes disagree), ``beam.nan_score``,
            ``beam.score_not_logprob`` (an entry of ``logprobs`` or ``beam_scores`` > 0),
            ``beam.invalid_width``, ``beam.invalid_eos`` (id >= V).

    Shapes: ``logprobs [B, K_rows, V]``, ``beam_scores [B, K_rows]``; flat index over ``K_rows * V``.
    Units: natural log-probabilities.
    Source: M3.8 0x0F ``beam_step``; tie rule: lowest flat index (declared).
    """
    k = _as_int(num_beams, BEAM_INVALID_WIDTH, "$.num_beams", 1)
    lp = np.asarray(logprobs, dtype=np.float64)
    bs = np.asarray(beam_scores, dtype=np.float64)
    if lp.ndim != 3 or bs.shape != lp.shape[:2] or lp.shape[2] < 1:
        raise _reject(BEAM_SHAPE, f"expected logprobs [B, K, V] and beam_scores [B, K], got {lp.shape} and {bs.shape}")
    _check_rows(lp, "$.logprobs")
    _check_rows(bs, "$.beam_scores")
    batch, rows, vocab = lp.shape
    eos = tuple(int(e) for e in eos_ids)
    if any(e >= vocab for e in eos):
        raise _reject(BEAM_INVALID_EOS, f"EOS ids {list(eos)} must be < V = {vocab}", "$.eos_ids")
    eos_arr = np.asarray(eos, dtype=np.int64)
    out = []
    for b in range(batch):
        flat = (bs[b][:, None] + lp[b]).reshape(rows * vocab)       # [K_rows * V], parent-major
        order = np.argsort(-flat, kind="stable")                      # score desc, flat idx asc; -inf last
        num_finite = int(np.count_nonzero(np.isfinite(flat)))
        order = order[:num_finite]
        is_eos = np.isin(order % vocab, eos_arr)
        live_ranks = np.flatnonzero(~is_eos)[:k]
        done_ranks = np.flatnonzero(is_eos[:k])

        def cand(r: int, order: np.ndarray = order, flat: np.ndarray = flat, b: int = b) -> Candidate:  # binds this row's arrays
            i = int(order[r])
            parent, token = divmod(i, vocab)
            return Candidate(rank=int(r), flat_idx=i, parent=parent, token=token,
                             score=float(flat[i]), increment=float(lp[b, parent, token]))

        out.append(RowSelection(live=tuple(cand(int(r)) for r in live_ranks),
                                completed=tuple(cand(int(r)) for r in done_ranks), num_finite=num_finite))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# State and transitions
# --------------------------------------------------------------------------------------------


def _completed_key(b: BranchState) -> tuple[float, int, int]:
    return (-b.normalized, b.step, b.slot)  # type: ignore[operator]  # a completed branch always has its normalized score


@attrs.frozen
class BeamState:
    """The search state of one request (M3.10 0x05 "Active and completed sets have different
    lifetimes").

    Attributes:
        request_id: ``I_request``.
        row: ``b``.
        prompt: Prompt token ids (``L`` tokens).
        step: Decision steps applied (``t``); every live branch has ``length == step``.
        phase: :class:`BeamPhase`.
        live: Live branches in slot order (slot ``k`` at index ``k``), at most ``K``; the dense
            ``[K]`` score vector pads the rest with ``-inf`` (:meth:`beam_scores`).
        completed: Completed hypotheses, best first by ``(-normalized, step, rank)``.
        vocab_size: ``V``, fixed by the first score rows (``None`` before).
        stop: Why the search ended, once ``phase`` is ``DONE``.
        lanes: :class:`BranchLanes` (behaviour, not state; excluded from equality).
    """

    request_id: str
    row: int
    prompt: tuple[int, ...]
    step: int
    phase: BeamPhase
    live: tuple[BranchState, ...]
    completed: tuple[BranchState, ...]
    vocab_size: int | None = None
    stop: BeamStop | None = None
    lanes: BranchLanes = attrs.field(factory=BranchLanes, eq=False, repr=False)

    def beam_scores(self, num_beams: int) -> np.ndarray:
        """Dense cumulative scores ``[K]`` float64: live slots, then ``-inf`` for vacant slots."""
        out = np.full(num_beams, -np.inf, dtype=np.float64)
        out[: len(self.live)] = [b.score for b in self.live]
        return out


@rule("transition.beam_init", title="Beam search starts from one live root", section="M3.8 0x0F First-step contract",
      statement="The root holds the prompt as pending input with score 0 in slot 0; the other K-1 slots are "
                "vacant at -inf so that identical parents cannot fill the first frontier with duplicates.")
def initial_state(params: BeamParams, prompt: Sequence[int], *, request_id: str = "request", row: int = 0,
                  lanes: BranchLanes | None = None) -> BeamState:
    """The initial search state: one live root (slot 0, score 0), ``K - 1`` vacant slots.

    Args:
        params: :class:`BeamParams`.
        prompt: Prompt token ids (``L >= 1``).
        request_id: ``I_request`` (also the RNG key).
        row: ``b``.
        lanes: :class:`BranchLanes` for ``Q`` and ``D`` (identity lanes by default).

    Raises:
        Rejection: ``beam.empty_prompt``; ``beam.invalid_lane_state``.
    """
    try:
        ids = tuple(operator.index(t) for t in prompt)
    except TypeError:
        raise _reject(BEAM_EMPTY_PROMPT, "prompt ids must be integers", "$.prompt") from None
    if not ids or min(ids) < 0:
        raise _reject(BEAM_EMPTY_PROMPT, "the prompt must hold at least one non-negative token id", "$.prompt")
    lanes = lanes or BranchLanes()
    root = BranchState(
        request_id=str(request_id), row=int(row), slot=0, step=0, prefix=ids, prompt_len=len(ids),
        score=0.0, normalized=None, length=0, cache=CacheRef.of(()), position=0,
        constraint=lanes.constraint_init, rng=RngState(key=str(request_id)), decoder=lanes.decoder_init,
        status=BeamStatus.LIVE, finish_reason=None, triggers=(), ancestry=(), parent_hash=None,
        policy_revision=params.revision(), consumed_step=None,
    )
    branch_hash(root)  # validates the lane states
    return BeamState(request_id=str(request_id), row=int(row), prompt=ids, step=0, phase=BeamPhase.AWAITING_CALL,
                     live=(root,), completed=(), lanes=lanes)


@rule("transition.beam_call", title="One model call processes every live branch's pending input",
      section="M3.10 0x05 Applying one beam decision to request state",
      statement="Guard: phase awaiting_call.  Effect: each live branch's cache gains rows for its pending "
                "tokens (cache = prefix, position = len(prefix)); the phase becomes awaiting_decision.")
def beam_call(params: BeamParams, state: BeamState) -> BeamState:
    """Process the pending tokens of every live branch (prefill at step 0, decode after).

    Raises:
        Rejection: ``beam.not_enabled`` unless ``state.phase`` is ``AWAITING_CALL``.
    """
    if state.phase is not BeamPhase.AWAITING_CALL:
        raise _reject(BEAM_NOT_ENABLED, f"beam_call needs phase awaiting_call, not {state.phase.value}", "$.phase")
    live = tuple(attrs.evolve(b, cache=CacheRef.of(b.prefix), position=len(b.prefix)) for b in state.live)
    return attrs.evolve(state, live=live, phase=BeamPhase.AWAITING_DECISION)


def _triggers(params: BeamParams, token: int, length: int) -> tuple[FinishReason, ...]:
    fired = set()
    if token in params.eos_ids:
        fired.add(FinishReason.EOS)
    if length >= params.max_new_tokens:
        fired.add(FinishReason.LENGTH)
    return tuple(r for r in FinishReason if r in fired)


@rule("transition.beam_fork", title="Fork parent state before appending the child token",
      section="M3.10 0x05 Fork parent state before appending the child token",
      statement="A child copies every lane of its parent (cache, position, RNG, ancestry, policy) and only then "
                "appends its token: child cache == parent cache, child position == len(parent prefix), the new "
                "token is pending input; score, length, Q and D advance with the token; F from its triggers.")
def fork_child(params: BeamParams, parent: BranchState, *, parent_slot: int, slot: int, token: int,
               increment: float, triggers: tuple[FinishReason, ...], lanes: BranchLanes,
               parent_hash: str | None = None) -> BranchState:
    """Fork ``parent`` and append ``token``: the child branch state.

    Args:
        params: :class:`BeamParams` (length penalty).
        parent: The parent after its model call (no pending tokens).
        parent_slot: The parent's live slot (appended to the ancestry).
        slot: The child's slot (live slot, or candidate rank when it completes).
        token: The appended token id.
        increment: ``logprobs[parent_slot, token]``.
        triggers: Finish triggers that fired (empty for a live child).
        lanes: :class:`BranchLanes`.
        parent_hash: ``branch_hash(parent)`` if already known.

    Returns:
        The child :class:`BranchState` (``COMPLETED`` iff ``triggers``).
    """
    length = parent.length + 1
    score = parent.score + increment
    reason = canonical_finish_reason(triggers)
    return BranchState(
        request_id=parent.request_id, row=parent.row, slot=slot, step=parent.step + 1,
        prefix=parent.prefix + (int(token),), prompt_len=parent.prompt_len,
        score=score, normalized=params.length_penalty.normalize(score, length), length=length,
        cache=parent.cache, position=parent.position,
        constraint=lanes.constraint_step(parent.constraint, int(token)), rng=parent.rng,
        decoder=lanes.decoder_step(parent.decoder, int(token)),
        status=BeamStatus.COMPLETED if triggers else BeamStatus.LIVE, finish_reason=reason, triggers=triggers,
        ancestry=parent.ancestry + (parent_slot,),
        parent_hash=parent_hash if parent_hash is not None else branch_hash(parent),
        policy_revision=parent.policy_revision, consumed_step=parent.step,
    )


def admissible_bound(penalty: LengthPenalty, score: float, length: int, max_new_tokens: int) -> float:
    """An upper bound on the normalized score of every completion of a live hypothesis.

    Derivation (non-positive increments): a completion ``y`` of a live hypothesis with score ``s``
    and ``g < G`` generated tokens has score ``s' <= s`` and length ``n`` in ``[g + 1, G]``, so
    ``s' / lp(n) <= s / lp(n)`` because ``lp(n) > 0``.  As ``s <= 0``, ``s / lp(n)`` is largest
    where ``lp(n)`` is largest: both forms are non-decreasing in ``n`` for ``alpha >= 0`` (take
    ``n = G``) and non-increasing for ``alpha < 0`` (take ``n = g + 1``).  The bound is attained
    when every later increment is 0, so no smaller bound of this kind is admissible.

    Args:
        penalty: :class:`LengthPenalty`.
        score: ``s <= 0``, cumulative log-probability of the live hypothesis.
        length: ``g``, its generated length (``< G``).
        max_new_tokens: ``G``.

    Source: M3.10 0x05 "exact relative to a declared finite-beam search trace ... requires an
    admissible bound for the declared score"; M3.8 0x12 item 47.
    """
    n = max_new_tokens if penalty.alpha > 0 else length + 1
    return score / penalty.denominator(n)


@rule("transition.beam_stop", title="Beam-level termination contracts", section="M3.10 0x05 Active and completed sets",
      statement="With n completed required and c_n the n-th best completed normalized score: fixed_count stops at "
                "n completions; heuristic when best live score / lp(g) <= c_n; never when best live / lp(G if "
                "alpha > 0 else g) <= c_n; exact when max over live of the admissible bound <= c_n; at_cap never.")
def stop_satisfied(params: BeamParams, live: Sequence[BranchState], completed: Sequence[BranchState]) -> bool:
    """Whether the declared termination contract allows stopping now (live hypotheses remain).

    Args:
        params: :class:`BeamParams` (``early_stop``, ``required_completed``, penalty, cap).
        live: Live branches after the step (equal lengths ``g``).
        completed: Completed hypotheses, best first.

    Returns:
        ``True`` when the search may stop and drop the live hypotheses.

    Source: M3.10 0x05 termination table; HF ``_check_early_stop_heuristic``,
    ``_beam_search_has_unfinished_sequences``.
    """
    kind = params.early_stop
    n = params.required_completed
    if kind is EarlyStop.AT_CAP or len(completed) < n:
        return False
    if kind is EarlyStop.FIXED_COUNT or not live:
        return True
    threshold = completed[n - 1].normalized
    pen = params.length_penalty
    if kind is EarlyStop.EXACT:
        bound = max(admissible_bound(pen, b.score, b.length, params.max_new_tokens) for b in live)
    else:
        g = live[0].length
        hyp_len = params.max_new_tokens if (kind is EarlyStop.NEVER and pen.alpha > 0) else g
        bound = max(b.score for b in live) / pen.denominator(hyp_len)
    return bound <= threshold  # type: ignore[operator]  # completed branches always have normalized scores


@attrs.frozen
class BeamStepRecord:
    """What one :func:`beam_step` did; :meth:`to_event` is the ``beam_step`` trace event.

    Attributes:
        step: Decision step ``t`` (0-based).
        expanded: The live parents that were expanded, after their model call.
        live_candidates: Candidates that became live children (one per child, slot order).
        completed_candidates: Candidates that completed (EOS, or the cap), rank order.
        discarded: Live candidates dropped at the cap under ``CLOSE_TOP_RANKS``.
        children: The new live branches.
        completed: The newly completed branches (same order as ``completed_candidates``).
        stop: Why the search ended at this step, or ``None``.
    """

    step: int
    expanded: tuple[BranchState, ...]
    live_candidates: tuple[Candidate, ...]
    completed_candidates: tuple[Candidate, ...]
    discarded: tuple[Candidate, ...]
    children: tuple[BranchState, ...]
    completed: tuple[BranchState, ...]
    stop: BeamStop | None

    def to_event(self) -> dict[str, Any]:
        """The ``beam_step`` event body of docs/design.md section 6: ``step``, ``parents``,
        ``tokens``, ``scores`` (cumulative log-probabilities of the new live slots) and
        ``completed`` (one object per completion)."""
        return {
            "step": self.step,
            "parents": [c.parent for c in self.live_candidates],
            "tokens": [c.token for c in self.live_candidates],
            "scores": [b.score for b in self.children],
            "completed": [
                {"parent": c.parent, "token": c.token, "rank": c.rank, "score": b.score,
                 "normalized": b.normalized, "length": b.length, "finish_reason": _reason_value(b.finish_reason),
                 "triggers": [r.value for r in b.triggers]}
                for c, b in zip(self.completed_candidates, self.completed)
            ],
        }


@rule("transition.beam_step", title="Apply one beam decision", section="M3.10 0x05 Applying one beam decision to request state",
      statement="Guard: phase awaiting_decision, one log-prob row per live branch.  Effect: select (selector.beam_topk), "
                "fork each kept child from its parent (transition.beam_fork), move terminal children to the completed "
                "set, close children at the length cap, then stop per the termination contract (transition.beam_stop).")
def beam_step(params: BeamParams, state: BeamState, logprobs: np.ndarray) -> tuple[BeamState, BeamStepRecord]:
    """Consume the score rows of the live branches once and apply the beam decision.

    Args:
        params: :class:`BeamParams`.
        state: A state in phase ``AWAITING_DECISION``.
        logprobs: ``[num_live, V]`` log-probability rows, row ``k`` for live slot ``k``.

    Returns:
        ``(next_state, record)``; ``next_state.phase`` is ``AWAITING_CALL`` or ``DONE``.

    Raises:
        Rejection: ``beam.not_enabled``, ``beam.shape``, ``beam.nan_score``,
            ``beam.score_not_logprob``, ``beam.invalid_eos``, ``beam.outside_hf_envelope``.
            Nothing changes when one is raised.

    Shapes: ``logprobs [num_live, V]`` float; internally ``[1, num_live, V]``.
    Source: M3.10 0x05; M3.8 0x0F.
    """
    if state.phase is not BeamPhase.AWAITING_DECISION:
        raise _reject(BEAM_NOT_ENABLED, f"beam_step needs phase awaiting_decision, not {state.phase.value}", "$.phase")
    lp = np.asarray(logprobs, dtype=np.float64)
    if lp.ndim != 2 or lp.shape[0] != len(state.live) or lp.shape[1] < 1:
        raise _reject(BEAM_SHAPE, f"expected [{len(state.live)}, V] rows, got {lp.shape}", "$.logprobs")
    if state.vocab_size is not None and lp.shape[1] != state.vocab_size:
        raise _reject(BEAM_SHAPE, f"V changed from {state.vocab_size} to {lp.shape[1]}", "$.logprobs")
    scores = np.array([[b.score for b in state.live]], dtype=np.float64)        # [1, num_live]
    (sel,) = select_candidates(lp[None], scores, params.num_beams, params.eos_ids)
    if params.hf_envelope and sel.num_finite < params.hf_candidate_window:
        raise _reject(BEAM_OUTSIDE_HF, f"only {sel.num_finite} finite candidates at step {state.step}; HF's window "
                      f"takes {params.hf_candidate_window}", "$.logprobs")

    lanes = state.lanes
    parent_hashes = [branch_hash(b) for b in state.live]

    def fork(c: Candidate, slot: int, triggers: tuple[FinishReason, ...]) -> BranchState:
        return fork_child(params, state.live[c.parent], parent_slot=c.parent, slot=slot, token=c.token,
                          increment=c.increment, triggers=triggers, lanes=lanes, parent_hash=parent_hashes[c.parent])

    at_cap = state.step + 1 >= params.max_new_tokens
    live_c, done_c, discarded = [], list(sel.completed), []
    for c in sel.live:
        if not at_cap:
            live_c.append(c)
        elif params.length_cap_rule is LengthCapRule.CLOSE_LIVE or c.rank < params.num_beams:
            done_c.append(c)
        else:
            discarded.append(c)
    done_c.sort(key=lambda c: c.rank)
    children = tuple(fork(c, slot, ()) for slot, c in enumerate(live_c))
    new_done = tuple(fork(c, c.rank, _triggers(params, c.token, state.step + 1)) for c in done_c)
    completed = tuple(sorted(state.completed + new_done, key=_completed_key))
    if params.completed_capacity is not None:
        completed = completed[: params.completed_capacity]

    if at_cap and sel.live:
        stop: BeamStop | None = BeamStop.LENGTH_CAP
    elif not children:
        stop = BeamStop.NO_LIVE
    elif stop_satisfied(params, children, completed):
        stop = BeamStop.EARLY_STOP
    else:
        stop = None
    next_state = attrs.evolve(state, step=state.step + 1, live=children, completed=completed,
                              vocab_size=int(lp.shape[1]),
                              phase=BeamPhase.DONE if stop else BeamPhase.AWAITING_CALL, stop=stop)
    record = BeamStepRecord(step=state.step, expanded=state.live, live_candidates=tuple(live_c),
                            completed_candidates=tuple(done_c), discarded=tuple(discarded), children=children,
                            completed=new_done, stop=stop)
    return next_state, record


# --------------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------------


def _step_pairs(record: BeamStepRecord) -> list[tuple[Candidate, BranchState]]:
    return list(zip(record.live_candidates, record.children)) + list(zip(record.completed_candidates, record.completed))


@rule("invariant.beam_parent_coupling", title="Every lane of a child descends from its named parent",
      section="M3.10 0x05 A beam is a coupled branch-state vector",
      statement="For every kept child, the whole branch state equals the fork of the parent named by its parent "
                "id with its token (X, S, L, C, P, Q, R, D, Pi, W gathered by one parent map).")
def beam_parent_coupling(params: BeamParams, before: BeamState, record: BeamStepRecord, after: BeamState) -> bool:
    """Step invariant: each child equals :func:`fork_child` of ``record.expanded[parent]``."""
    pairs = _step_pairs(record)
    if len(record.expanded) != len(before.live) or any(p.cache.num_rows != len(p.prefix) for p in record.expanded):
        return False
    for c, child in pairs:
        if not 0 <= c.parent < len(record.expanded):
            return False
        parent = record.expanded[c.parent]
        expected = fork_child(params, parent, parent_slot=c.parent, slot=child.slot, token=c.token,
                              increment=c.increment, triggers=child.triggers, lanes=before.lanes)
        if child != expected:
            return False
    return after.live == record.children


@rule("invariant.beam_fork_before_append", title="Siblings never see each other's token",
      section="M3.10 0x05 Fork parent state before appending the child token",
      statement="child cache before append == parent cache; child pending input == its token only; child "
                "position == parent committed length; siblings share exactly the parent prefix.")
def beam_fork_before_append(params: BeamParams, before: BeamState, record: BeamStepRecord, after: BeamState) -> bool:
    """Step invariant: fork happened before append, for every child and every sibling pair."""
    for c, child in _step_pairs(record):
        parent = record.expanded[c.parent]
        if (child.cache != parent.cache or child.prefix[:-1] != parent.prefix or child.pending != (c.token,)
                or child.position != len(parent.prefix) or child.cache.num_rows != len(child.prefix) - 1):
            return False
    return True


@rule("invariant.beam_completed_never_expanded", title="Completed hypotheses are never expanded",
      section="M3.10 0x05 Active and completed sets have different lifetimes",
      statement="Every expanded parent is live and not terminal; no completed hypothesis is a parent or a live "
                "branch later; completed hypotheses are only dropped by the declared capacity.")
def beam_completed_never_expanded(params: BeamParams, before: BeamState, record: BeamStepRecord,
                                  after: BeamState) -> bool:
    """Step invariant over ``before -> after``."""
    done_prefixes = {b.prefix for b in before.completed} | {b.prefix for b in after.completed}
    eos = set(params.eos_ids)
    for p in record.expanded:
        if p.status is not BeamStatus.LIVE or p.prefix in done_prefixes or (p.length and p.prefix[-1] in eos):
            return False
    if any(b.status is not BeamStatus.LIVE or b.prefix in done_prefixes for b in after.live):
        return False
    kept = {b.prefix for b in after.completed}
    dropped = [b for b in before.completed if b.prefix not in kept]
    if dropped:
        cap = params.completed_capacity
        if cap is None or len(after.completed) < cap:
            return False
        worst = _completed_key(after.completed[-1])
        if any(_completed_key(b) < worst for b in dropped):
            return False
    return True


@rule("invariant.beam_first_step_single_parent", title="Only one parent at the first step",
      section="M3.8 0x0F First-step and finished-set contracts",
      statement="When all beams share the prompt, only slot 0 is live (the others at -inf): the first step "
                "expands exactly one parent and every kept child names parent 0, so no two children are equal.")
def beam_first_step_single_parent(params: BeamParams, before: BeamState, record: BeamStepRecord,
                                  after: BeamState) -> bool:
    """Step invariant, checked at step 0 (vacuous later)."""
    if record.step != 0:
        return True
    dense = before.beam_scores(params.num_beams)
    return (len(record.expanded) == 1 and dense[0] == 0.0 and bool(np.all(np.isneginf(dense[1:])))
            and all(c.parent == 0 for c, _ in _step_pairs(record)))


@rule("invariant.beam_live_frontier", title="The live frontier is bounded, distinct and non-terminal",
      section="M3.10 0x05 Beam search keeps multiple prefixes",
      statement="At most K live branches in slots 0..n-1, all live, of length == step, with distinct prefixes, "
                "finite non-increasing scores, no terminal last token, cache == prefix or pending == last token.")
def beam_live_frontier(params: BeamParams, state: BeamState) -> bool:
    """State invariant."""
    live = state.live
    if len(live) > params.num_beams or len({b.prefix for b in live}) != len(live):
        return False
    eos = set(params.eos_ids)
    for k, b in enumerate(live):
        if (b.slot != k or b.status is not BeamStatus.LIVE or b.length != state.step or b.step != state.step
                or not math.isfinite(b.score) or b.position != b.cache.num_rows
                or len(b.ancestry) != b.length or (b.length and b.prefix[-1] in eos)
                or len(b.pending) > (len(b.prefix) if b.length == 0 else 1)):
            return False
    return all(live[i].score >= live[i + 1].score for i in range(len(live) - 1))


@rule("invariant.beam_completed_metadata", title="Completed hypotheses carry score, length and finish metadata",
      section="M3.10 0x05 Active and completed sets have different lifetimes",
      statement="Each completed hypothesis has status completed, triggers matching its last token and length, "
                "finish reason = canonical(triggers), normalized = score / lp(|y|); the set is ranked best "
                "first and within its capacity.")
def beam_completed_metadata(params: BeamParams, state: BeamState) -> bool:
    """State invariant."""
    done = state.completed
    if params.completed_capacity is not None and len(done) > params.completed_capacity:
        return False
    for b in done:
        if (b.status is not BeamStatus.COMPLETED or b.length < 1 or b.length > params.max_new_tokens
                or b.triggers != _triggers(params, b.prefix[-1], b.length) or not b.triggers
                or b.finish_reason is not canonical_finish_reason(b.triggers)
                or b.normalized != params.length_penalty.normalize(b.score, b.length)):
            return False
    return [_completed_key(b) for b in done] == sorted(_completed_key(b) for b in done)


_STEP_INVARIANTS = (beam_parent_coupling, beam_fork_before_append, beam_completed_never_expanded,
                    beam_first_step_single_parent)
_STATE_INVARIANTS = (beam_live_frontier, beam_completed_metadata)


def check_state(params: BeamParams, state: BeamState) -> tuple[str, ...]:
    """Ids of the beam state invariants that ``state`` violates (empty when all hold)."""
    return tuple(f.__rule_id__ for f in _STATE_INVARIANTS if not f(params, state))  # type: ignore[attr-defined]  # set by @rule


def check_step(params: BeamParams, before: BeamState, record: BeamStepRecord, after: BeamState) -> tuple[str, ...]:
    """Ids of the beam step and state invariants violated by ``before -> after`` (empty when all hold)."""
    bad = [f.__rule_id__ for f in _STEP_INVARIANTS if not f(params, before, record, after)]  # type: ignore[attr-defined]  # set by @rule
    return tuple(bad) + check_state(params, after)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Hypothesis:
    """One completed hypothesis as returned.

    Attributes:
        output_ids: Generated tokens (EOS included when it finished on EOS).
        score: Cumulative log-probability (natural log).
        normalized: ``score / lp(length)``; the ranking score.
        length: ``|y|`` generated tokens.
        finish_reason: ``eos`` or ``length``.
        triggers: Every trigger that fired.
        ancestry: Parent slot at each step.
        rank: Candidate rank at the completing step.
        branch_hash: :func:`branch_hash` of the completed branch.
    """

    output_ids: tuple[int, ...]
    score: float
    normalized: float
    length: int
    finish_reason: FinishReason
    triggers: tuple[FinishReason, ...]
    ancestry: tuple[int, ...]
    rank: int
    branch_hash: str

    @classmethod
    def of(cls, b: BranchState) -> Hypothesis:
        assert b.status is BeamStatus.COMPLETED and b.finish_reason is not None and b.normalized is not None
        return cls(output_ids=b.output_ids, score=b.score, normalized=b.normalized, length=b.length,
                   finish_reason=b.finish_reason, triggers=b.triggers, ancestry=b.ancestry, rank=b.slot,
                   branch_hash=branch_hash(b))


@attrs.frozen
class BeamResult:
    """A whole search.

    Attributes:
        hypotheses: Every kept completed hypothesis, best first by ``(-normalized, step, rank)``.
        best: ``hypotheses[0]``, or ``None`` when nothing completed (every candidate was ``-inf``).
        steps: One :class:`BeamStepRecord` per decision step.
        states: ``states[0]`` is the initial state, ``states[i + 1]`` the state after step ``i``.
        called: ``called[i]`` is ``states[i]`` after its model call: the input of step ``i``.
        stop: :class:`BeamStop`.
    """

    hypotheses: tuple[Hypothesis, ...]
    best: Hypothesis | None
    steps: tuple[BeamStepRecord, ...]
    states: tuple[BeamState, ...]
    called: tuple[BeamState, ...]
    stop: BeamStop

    def transitions(self) -> list[tuple[BeamState, BeamStepRecord, BeamState]]:
        """``(before, record, after)`` of every step, as the step invariants take them."""
        return list(zip(self.called, self.steps, self.states[1:]))

    def returned(self, num_return_sequences: int = 1) -> tuple[Hypothesis, ...]:
        """The best ``num_return_sequences`` hypotheses (HF ``num_return_sequences``)."""
        return self.hypotheses[:num_return_sequences]

    def events(self) -> list[dict[str, Any]]:
        """The ``beam_step`` event bodies, one per step."""
        return [r.to_event() for r in self.steps]


def _row_values(row: Any) -> np.ndarray:
    if isinstance(row, ScoreRow):
        if row.kind is not SCORE_KIND:
            raise _reject(policy_codes.SCORE_KIND_MISMATCH, f"beam search ranks {SCORE_KIND.value} rows, got a "
                          f"{row.kind.value} row", "$.score_fn")
        return np.asarray(row.values, dtype=np.float64)
    return np.asarray(row, dtype=np.float64)


def beam_search(score_fn: Callable[[tuple[int, ...]], Sequence[float] | np.ndarray | ScoreRow], prompt: Sequence[int],
                params: BeamParams, *, request_id: str = "request", row: int = 0,
                lanes: BranchLanes | None = None) -> BeamResult:
    """Run a whole beam search over an uninterpreted model.

    Args:
        score_fn: ``score_fn(prefix) -> logprobs[V]``: the log-probability row after ``prefix``
            (prompt plus generated tokens), already processed by the declared policy; an array
            (taken as :data:`SCORE_KIND`) or a ``ScoreRow`` of kind ``logprobs``.
        prompt: Prompt token ids.
        params: :class:`BeamParams`.
        request_id: ``I_request``.
        row: ``b``.
        lanes: :class:`BranchLanes`.

    Returns:
        :class:`BeamResult`.

    Raises:
        Rejection: any code of :func:`initial_state` and :func:`beam_step` (``beam.shape`` also
            when ``score_fn`` returns rows of different lengths); ``policy.score_kind_mismatch``
            for a ``ScoreRow`` that is not log-probabilities.

    Source: M3.10 0x05; M3.8 0x0F.
    """
    state = initial_state(params, prompt, request_id=request_id, row=row, lanes=lanes)
    states, called, records = [state], [], []
    while state.phase is not BeamPhase.DONE:
        state = beam_call(params, state)
        called.append(state)
        rows = [_row_values(score_fn(b.prefix)) for b in state.live]
        if any(r.ndim != 1 for r in rows) or len({r.shape for r in rows}) != 1:
            raise _reject(BEAM_SHAPE, f"score_fn must return 1-D rows of one length V, got {[r.shape for r in rows]}",
                          "$.score_fn")
        state, record = beam_step(params, state, np.stack(rows))
        states.append(state)
        records.append(record)
    hyps = tuple(Hypothesis.of(b) for b in state.completed)
    assert state.stop is not None
    return BeamResult(hypotheses=hyps, best=hyps[0] if hyps else None, steps=tuple(records),
                      states=tuple(states), called=tuple(called), stop=state.stop)
