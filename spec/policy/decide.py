"""M3.8 0x0B The decoding-policy pipeline: processed row, decision and receipt, beam candidates.

``decide(row, config, state, view) -> (receipt, state')`` is the whole local policy of one
step.  Its pipeline, in order:

1. validate the row, configuration, state and view (typed errors before anything else);
2. apply ``config.transforms`` in their resolved order, checking each transform's accepted
   score kind (``policy.score_kind_mismatch``) and rejecting produced NaN / +inf;
3. *temperature 0* is the greedy branch: the temperature step and every later warper are
   skipped (never a division), later processors still run, and selection is greedy with no
   draw;
4. final legal-support assertion: an empty support raises ``policy.empty_support`` unless the
   configured fallback applies (``fallback_eos``: the lowest EOS id that survives the
   legality-stage transforms alone is forced, with no draw); the raw row is never restored;
5. normalization required by the selector (softmax for multinomial, log-softmax for beam),
   recorded in the receipt;
6. selection: greedy (lowest id on ties, no draw), multinomial (inverse CDF in id order with
   one uniform at RNG address ``(step, 0)``), beam (joint top candidates);
7. policy-state update: RNG counter += draws, constraint state ``delta(s, y)``, Mirostat ``mu``.

Source: M3.8 0x0B ("Local policy trace and assertions", "Policy state is typed and partly
mutable"), 0x0C-0x0F, 0x12 items 35-44.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from decodespec.spec.errors import Rejection
from decodespec.spec.policy import codes
from decodespec.spec.policy.config import EmptySupport, Family, PolicyConfig, Stage, TransformSpec
from decodespec.spec.policy.receipt import DecisionReceipt, RngRecord
from decodespec.spec.policy.rng import rng_key, uniform
from decodespec.spec.policy.scores import ScoreKind, ScoreRow, check_scores, log_softmax, softmax
from decodespec.spec.policy.selectors import ACCEPTS, DRAWS, beam_select, greedy, multinomial
from decodespec.spec.policy.state import PolicyState, RequestView
from decodespec.spec.policy.transforms import TRANSFORMS, mirostat_update

__all__ = [
    "BeamCandidates",
    "ProcessedRow",
    "TraceStep",
    "beam_candidates",
    "child_state",
    "decide",
    "processed_row",
]

_SELECTOR_OF = {Family.GREEDY: "greedy", Family.MULTINOMIAL: "multinomial", Family.BEAM: "beam"}


@attrs.frozen
class TraceStep:
    """One line of the local policy trace (M3.8 0x0B "summary(transform.name, scores)").

    Attributes:
        name: Transform name, ``"softmax"``/``"log_softmax"`` for normalization, or
            ``"temperature:greedy_branch"``/``"<name>:skipped"``/``"fallback_eos"``.
        kind: Score kind after the step.
        support_size: Ids with finite score (positive probability) after the step.
        margin: The step's decision margin (``inf`` when it has no boundary).
    """

    name: str
    kind: ScoreKind
    support_size: int
    margin: float = math.inf


@attrs.frozen(eq=False)
class ProcessedRow:
    """The processed row the selector sees (the conformance ladder's POLICY layer).

    Attributes:
        values: ``[V]`` float64 scores handed to the selector, of kind ``kind``.
        kind: Their :class:`ScoreKind`.
        probs: ``[V]`` float64 processed distribution (``softmax(values)``, or ``values`` for
            kind probs, ``exp(values)`` for logprobs).
        applied: Transforms actually applied, in order.
        normalization: ``"softmax"``, ``"log_softmax"`` or ``None``.
        selector: ``"greedy"``, ``"multinomial"`` or ``"beam"``.
        greedy_reason: ``"family"``, ``"temperature_zero"``, ``"fallback_eos"`` or ``None``.
        fallback_used: Whether the empty-support fallback forced the row.
        trace: One :class:`TraceStep` per step.
        support_mask: ``[V]`` bool, the ids with a finite processed score before normalization
            (positive probability for a probability row): the finite support, independent of
            softmax underflow.
    """

    values: np.ndarray
    kind: ScoreKind
    probs: np.ndarray
    applied: tuple[TransformSpec, ...]
    normalization: str | None
    selector: str
    greedy_reason: str | None
    fallback_used: bool
    trace: tuple[TraceStep, ...]
    support_mask: np.ndarray

    @property
    def support(self) -> np.ndarray:
        """Ids in the finite support, ascending (int64)."""
        return np.flatnonzero(self.support_mask)

    @property
    def support_size(self) -> int:
        """Size of the finite support."""
        return int(self.support_mask.sum())

    @property
    def margin(self) -> float:
        """Smallest decision margin over all steps."""
        return min((s.margin for s in self.trace), default=math.inf)


def _support_size(values: np.ndarray, kind: ScoreKind) -> int:
    return int((values > 0).sum()) if kind is ScoreKind.PROBS else int(np.isfinite(values).sum())


def _check_inputs(row: ScoreRow, config: PolicyConfig, state: PolicyState, view: RequestView) -> None:
    if not isinstance(row, ScoreRow):
        raise Rejection(codes.INVALID_ROW, "decide needs a ScoreRow (build it with ScoreRow.create)", "$.row")
    state.check(config)
    v = row.vocab_size
    if view.max_token_id() >= v:
        raise Rejection(codes.TOKEN_OUT_OF_RANGE, f"the request view names token id {view.max_token_id()} >= V = {v}", "$.view")
    for i, t in enumerate(config.transforms):
        ids = t.token_ids()
        if ids and max(ids) >= v:
            raise Rejection(codes.TOKEN_OUT_OF_RANGE, f"{t.name} names token id {max(ids)} >= V = {v}", f"$.policy.transforms[{i}]")


def _legal_eos(row: ScoreRow, config: PolicyConfig, state: PolicyState, view: RequestView) -> list[int]:
    """EOS ids that stay finite under the legality-stage transforms alone (in config order)."""
    z = row.values.copy()
    for t in config.transforms:
        if t.info.stage is Stage.LEGALITY:
            z = TRANSFORMS[t.name](z, t, view, state).values
    return sorted(e for e in set(view.eos_ids) if np.isfinite(z[e]))


def _json_margin(trace: list[TraceStep]) -> float | None:
    margin = min((s.margin for s in trace), default=math.inf)
    return None if math.isinf(margin) else margin


def _fallback(row: ScoreRow, config: PolicyConfig, state: PolicyState, view: RequestView, trace: list[TraceStep], applied: tuple[TransformSpec, ...]) -> ProcessedRow:
    eos = _legal_eos(row, config, state, view) if config.empty_support is EmptySupport.FALLBACK_EOS else []
    if not eos:
        raise Rejection(
            codes.EMPTY_SUPPORT,
            "no token has a finite score after the transforms" + ("" if config.empty_support is EmptySupport.RAISE else " and no EOS id is legal for fallback_eos"),
            "$",
            {"step": view.step, "constraint_state": state.constraint_state, "trace": [s.name for s in trace], "margin": _json_margin(trace)},
        )
    values = np.full(row.vocab_size, -math.inf)
    values[eos[0]] = 0.0
    probs = np.zeros(row.vocab_size)
    probs[eos[0]] = 1.0
    trace.append(TraceStep("fallback_eos", ScoreKind.LOGITS, 1))
    return ProcessedRow(values, ScoreKind.LOGITS, probs, applied, None, "greedy", "fallback_eos", True, tuple(trace), probs > 0)


def processed_row(row: ScoreRow, config: PolicyConfig, state: PolicyState, view: RequestView) -> ProcessedRow:
    """Run the transform pipeline, the legal-support assertion and the selector's normalization.

    Args:
        row: The typed score row.
        config: The policy.
        state: The policy state before the decision.
        view: The read-only request view.

    Returns:
        The :class:`ProcessedRow` the selector will see.

    Raises:
        Rejection: ``policy.score_kind_mismatch``, ``policy.nan_scores``,
            ``policy.infinite_scores``, ``policy.empty_support``, ``policy.invalid_state``,
            ``policy.token_out_of_range``, ``policy.invalid_row``.

    Shapes:
        row.values: ``[V]``; result values and probs: ``[V]`` float64.
    """
    _check_inputs(row, config, state, view)
    selector = _SELECTOR_OF[config.family]
    greedy_reason = "family" if config.family is Family.GREEDY else None
    z, kind = row.values.copy(), row.kind
    trace: list[TraceStep] = []
    applied: list[TransformSpec] = []
    if _support_size(z, kind) == 0:
        return _fallback(row, config, state, view, trace, ())
    for i, t in enumerate(config.transforms):
        if greedy_reason == "temperature_zero" and t.info.stage in (Stage.TEMPERATURE, Stage.TRUNCATION):
            trace.append(TraceStep(f"{t.name}:skipped", kind, _support_size(z, kind)))
            continue
        if t.name == "temperature" and t.get("temperature") == 0.0:
            selector, greedy_reason = "greedy", "temperature_zero"
            trace.append(TraceStep("temperature:greedy_branch", kind, _support_size(z, kind)))
            continue
        if kind not in t.info.accepts:
            raise Rejection(codes.SCORE_KIND_MISMATCH, f"{t.name} accepts {sorted(k.value for k in t.info.accepts)}, got {kind.value}", f"$.policy.transforms[{i}]")
        step = TRANSFORMS[t.name](z, t, view, state)
        check_scores(step.values, f"$.policy.transforms[{i}]")
        z, kind = step.values, t.info.returns
        applied.append(t)
        trace.append(TraceStep(t.name, kind, _support_size(z, kind), step.margin))
        if trace[-1].support_size == 0:
            break
    if _support_size(z, kind) == 0:
        return _fallback(row, config, state, view, trace, tuple(applied))
    support_mask = z > 0 if kind is ScoreKind.PROBS else np.isfinite(z)
    normalization = None
    if selector == "multinomial" and kind is not ScoreKind.PROBS:
        z, kind, normalization = softmax(z), ScoreKind.PROBS, "softmax"
    elif selector == "beam" and kind is ScoreKind.LOGITS:
        z, kind, normalization = log_softmax(z), ScoreKind.LOGPROBS, "log_softmax"
    if kind not in ACCEPTS[selector]:
        raise Rejection(codes.SCORE_KIND_MISMATCH, f"selector {selector} accepts {sorted(k.value for k in ACCEPTS[selector])}, got {kind.value}", "$.row.kind")
    if normalization:
        trace.append(TraceStep(normalization, kind, _support_size(z, kind)))
    probs = z if kind is ScoreKind.PROBS else (np.exp(z) if kind is ScoreKind.LOGPROBS else softmax(z))
    return ProcessedRow(z, kind, probs, tuple(applied), normalization, selector, greedy_reason, False, tuple(trace), support_mask)


def child_state(config: PolicyConfig, state: PolicyState, token_id: int, *, draws: int = 0, selected_prob: float | None = None) -> PolicyState:
    """The policy state after committing ``token_id`` (also the state a beam child inherits).

    Args:
        config: The policy.
        state: The state before the decision.
        token_id: The selected id (must be legal in the constraint state).
        draws: Uniforms consumed by the decision.
        selected_prob: Final processed probability of ``token_id`` when Mirostat ran and
            observes it; ``None`` leaves ``mu`` unchanged (greedy branch, forced token).

    Returns:
        ``state`` with ``rng_counter + draws``, ``constraint_state = delta(s, token_id)`` and the
        Mirostat update.
    """
    constraint = config.find("constraint")
    mirostat = config.find("mirostat_v2")
    mu = state.mirostat_mu
    if mirostat is not None and selected_prob is not None:
        assert mu is not None, "initial_policy_state sets mu for a mirostat_v2 policy"
        mu = mirostat_update(mu, mirostat, selected_prob)
    return PolicyState(
        rng_counter=state.rng_counter + draws,
        constraint_state=None if constraint is None else constraint.get("automaton").step(state.constraint_state, token_id),
        mirostat_mu=mu,
    )


def _raw_logprob(row: ScoreRow, token_id: int) -> float:
    if row.kind is ScoreKind.LOGITS:
        value = float(log_softmax(row.values)[token_id])
    elif row.kind is ScoreKind.LOGPROBS:
        value = float(row.values[token_id])
    else:
        value = math.log(float(row.values[token_id]))
    assert math.isfinite(value), "a selected token always has a finite raw score"
    return value


def decide(row: ScoreRow, config: PolicyConfig, state: PolicyState, view: RequestView) -> tuple[DecisionReceipt, PolicyState]:
    """Turn one score row into one token decision and the next policy state.

    Args:
        row: The typed score row (``[V]``).
        config: The policy (family greedy or multinomial).
        state: Policy state before the decision (see ``initial_policy_state``).
        view: Read-only request view; ``view.step`` addresses the RNG draw.

    Returns:
        ``(receipt, next_state)``.  Nothing else changes; on error nothing changes.

    Raises:
        Rejection: ``policy.family_mismatch`` (beam family: use :func:`beam_candidates`) and
            every error of :func:`processed_row`.

    Source: M3.8 0x0B ``policy_step``; M3.10 0x08 (one receipt per authenticated score row).
    """
    if config.family is Family.BEAM:
        raise Rejection(codes.FAMILY_MISMATCH, "the beam family decides with beam_candidates, not decide", "$.policy.family")
    pr = processed_row(row, config, state, view)
    key = rng_key(view.identity, view.seed)
    addresses: tuple[tuple[int, int], ...]
    uniforms: tuple[float, ...]
    if pr.selector == "multinomial":
        u = uniform(key, view.step, 0)
        token, _ = multinomial(pr.probs, u)
        addresses, uniforms = ((view.step, 0),), (u,)
    else:
        token, _ = greedy(pr.values)
        addresses, uniforms = (), ()
    draws = len(uniforms)
    assert draws == DRAWS[pr.selector]
    observes = any(t.name == "mirostat_v2" for t in pr.applied) and not pr.fallback_used
    next_state = child_state(config, state, token, draws=draws, selected_prob=float(pr.probs[token]) if observes else None)
    receipt = DecisionReceipt.build(
        score_id=row.row_id,
        score_kind=row.kind.value,
        vocab_hash=row.vocab_hash,
        vocab_size=row.vocab_size,
        step=view.step,
        family=config.family.value,
        preset=config.preset,
        policy=config,
        transforms=pr.applied,
        normalization=pr.normalization,
        selector=pr.selector,
        greedy_reason=pr.greedy_reason,
        tie_rule=config.tie_rule,
        empty_support=config.empty_support.value,
        fallback_used=pr.fallback_used,
        support_size=pr.support_size,
        selected_id=token,
        raw_logprob=_raw_logprob(row, token),
        processed_logprob=math.log(float(pr.probs[token])),
        draws=draws,
        rng=RngRecord(key_id=key.key_id, addresses=addresses, uniforms=uniforms, counter_before=state.rng_counter, counter_after=state.rng_counter + draws),
        state_before=state,
        state_after=next_state,
    )
    return receipt, next_state


@attrs.frozen(eq=False)
class BeamCandidates:
    """Ranked joint candidates of one beam step.

    Attributes:
        scores: ``[N]`` float64 candidate sequence scores, best first.
        parents: ``[N]`` int64 parent beam indices (``flat // V``).
        tokens: ``[N]`` int64 vocabulary ids (``flat % V``).
        logprobs: ``[K, V]`` float64 processed log-probabilities per parent.
    """

    scores: np.ndarray
    parents: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


def beam_candidates(
    rows: Sequence[ScoreRow],
    beam_scores: Sequence[float],
    config: PolicyConfig,
    states: Sequence[PolicyState],
    views: Sequence[RequestView],
    num_candidates: int | None = None,
) -> BeamCandidates:
    """Process each parent's row and rank the joint ``[K, V]`` candidate grid.

    Args:
        rows: K score rows, one per live parent beam (same V).
        beam_scores: K running sequence scores (``-inf`` marks an inactive duplicate parent,
            M3.8 0x0F "If all initial beams represent the same prefix, activate only one").
        config: A beam-family policy (processors only).
        states: K parent policy states (constraint state per beam).
        views: K parent request views (history per beam).
        num_candidates: Candidates to return; default ``2 * num_beams`` (HF ``_beam_search``
            keeps 2K so EOS candidates can leave while K stay live), capped at ``K * V``.

    Returns:
        :class:`BeamCandidates`.  Children inherit ``child_state(config, states[parent], token)``.

    Raises:
        Rejection: ``policy.family_mismatch`` for a non-beam config, ``policy.invalid_row`` on
            mismatched lengths or widths, and every error of :func:`processed_row`.

    Shapes:
        rows: K x ``[V]``; beam_scores: ``[K]``; outputs ``[N]`` and ``[K, V]``.
    """
    if config.family is not Family.BEAM:
        raise Rejection(codes.FAMILY_MISMATCH, "beam candidates need the beam family", "$.policy.family")
    k = len(rows)
    if k == 0 or not (len(beam_scores) == len(states) == len(views) == k) or len({r.vocab_size for r in rows}) != 1:
        raise Rejection(codes.INVALID_ROW, "beam rows, scores, states and views must be K >= 1 aligned entries of one width", "$.rows")
    logprobs = np.stack([processed_row(r, config, s, v).values for r, s, v in zip(rows, states, views)])
    v = rows[0].vocab_size
    n = min(k * v, 2 * config.num_beams if num_candidates is None else num_candidates)
    scores, parents, tokens = beam_select(logprobs, np.asarray(beam_scores, dtype=np.float64), n)
    return BeamCandidates(scores, parents, tokens, logprobs)
