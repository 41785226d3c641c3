"""M3.10 0x05 / M3.8 0x0F Beam search on the real model: K live beams as K batch rows over one cache.

:class:`BeamRunner` runs one beam-family request on :class:`~decodespec.impl.model.LlamaForCausalLM`.
The live frontier is a batch of ``n <= K`` rows over one cache (no cache, dynamic or static);
the completed set is kept apart and never spends another model call.  One search step is two
runner actions, so a test can drive the spec's machine (:mod:`decodespec.spec.beam`) in lock step:

==========================  ===========================================================
runner method               spec transition / rule
==========================  ===========================================================
:meth:`BeamRunner.call`     ``transition.beam_call``: prefill (one shot or chunks) at step
                            0 on the single root row; afterwards one decode call whose row
                            ``k`` is live beam ``k``'s pending token at ``cache_position = P``
:meth:`BeamRunner.decide`   ``transition.beam_step``: consume the score rows once; log-softmax
                            of each row (float32), the policy's processors per beam
                            (:func:`decodespec.impl.policy.process_scores` on log-probabilities,
                            each beam with its own :class:`PolicyState` and request view);
                            ``selector.beam_topk`` over the flattened ``[n * V]`` grid in
                            float64 with ties to the lowest flat index
                            (:func:`top_flat_candidates`, the order of
                            :func:`decodespec.impl.policy.select_beam_candidates`); EOS
                            candidates ranked ``< K`` complete (``eos``), the live frontier is
                            refilled with the best ``K`` non-terminal candidates; the cap closes
                            per :class:`~decodespec.spec.beam.LengthCapRule`; the termination
                            contract (``transition.beam_stop``); then **one parent map** reorders
                            every cache layer (``reorder_cache``) and gathers every branch lane
                            before the child's token is appended (``transition.beam_fork``)
==========================  ===========================================================

Branch state (M3.10 0x05 "A beam is a coupled branch-state vector") is one record per batch row
(:class:`_Branch`): generated tokens (X), the float64 cumulative score (S; the length L is
``len(tokens)``), the cache-row ledger (C: the ids whose K/V rows this batch row holds, appended
by every call and gathered with the cache), the position (P = ``len`` of that ledger), the policy
state (Q: constraint automaton state; R: the request RNG counter -- deterministic beams draw
nothing, so children inherit it), the decoder lane (D: unused, ``None``; stop strings are refused),
the ancestry and parent checksum (Pi), and the decision step that created it (W, with
``BeamParams.revision()``).  :meth:`BeamRunner.live_branches` exports them as the spec's
:class:`~decodespec.spec.beam.BranchState` values; the checksum ``I_branch`` of a parent is the
seed's encoding (:func:`decodespec.spec.beam.branch_hash`, a checksum of exported values that
decides nothing).  The runtime never calls a spec transition, selector or penalty to decide.

Declared choices (docs/design.md section 2; docs/beam-expectations.md):

* Only the root row is live at step 0 (the other ``K - 1`` slots are vacant, never selected);
  the first reorder expands the single prefill row to the kept children.
* Scores are natural log-probabilities: ``log_softmax`` of the float32 logits, then the M3.8
  policy's processors per beam (on log-probabilities, HF's order); a processor returns logits, so
  the beam selector renormalises its output with ``log_softmax`` (the policy's rule; HF adds the
  processed rows un-renormalised, docs/beam-expectations.md row 16).  Without processors the rows
  are HF's.  Cumulative scores are float64 sums, left to right; the exported rows
  (``record=True``) are the float32 processed rows the decisions read.
* ``-inf`` candidates are never kept (the frontier may shrink); ties go to the lowest flat index.
* ``|y|`` counts generated tokens including EOS; ``normalized = score / lp(|y|)`` with
  ``lp = |y|**alpha`` or GNMT ``((5 + |y|) / 6)**alpha``.
* A beam request needs ``L + G <= C`` (the context cap: model window, envelope cap, static
  capacity), checked before any call: beams finish only by EOS or the length cap.
* Refused (``runtime.beam_unsupported``): sampling families, streaming, stop strings, structured
  output, a final-cache promise, snapshots; the beam family is deterministic here (beam sampling
  needs a per-beam RNG child-stream rule, docs/beam-expectations.md row 24).

Trace events (``decodespec.events.v1``): ``request`` (with ``beam``: the parameters), one
``beam_step`` per step (``step``, ``parents``, ``tokens``, ``scores``, ``completed``) equal to
``spec.beam.BeamStepRecord.to_event()`` for the same rows, and ``finish`` (the best hypothesis).

Source: M3.10 0x05 ("Beam search keeps multiple prefixes", "Applying one beam decision to request
state", "A beam is a coupled branch-state vector", "Fork parent state before appending the child
token", "Active and completed sets have different lifetimes"), M3.8 0x0F ("Beam search: joint
parent/token candidates", "First-step and finished-set contracts", "Length penalty"); peer:
transformers 5.24 ``generation/utils.py`` ``_beam_search`` (log-softmax then processors,
``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``, ``reorder_cache(beam_idx)``).

Size: one loop: the beam runner keeps K live beams as K batch rows of one cache and forks, reorders
and finishes them in the same state; splitting it would pass that state between modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from decodespec.spec.beam import (
    BEAM_NOT_ENABLED,
    BEAM_OUTSIDE_HF,
    BeamParams,
    BeamStatus,
    BeamStop,
    BranchState,
    CacheRef,
    EarlyStop,
    Hypothesis,
    LengthCapRule,
    LengthPenalty,
    PenaltyForm,
    RngState,
    branch_hash,
)
from decodespec.spec.enums import FinishReason, canonical_finish_reason
from decodespec.spec.errors import Rejection, ResourceLimit, register_code
from decodespec.spec.policy.config import Family, PolicyConfig
from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.policy.state import PolicyState, RequestView, initial_policy_state
from decodespec.spec.positions import CACHE_CAPACITY_EXCEEDED
from decodespec.spec.request import context_cap, policy_with_min_new_tokens

from .cache import StaticCache, make_cache
from .events import EVENTS_FORMAT, EventSink
from .model import CONTEXT_WINDOW_EXCEEDED, LlamaForCausalLM
from .policy import next_state, process_scores
from .runtime import INVALID_REQUEST, RuntimeRequest, _check_static_capacity, _validated

__all__ = [
    "BEAM_UNSUPPORTED",
    "BeamHypothesis",
    "BeamRunner",
    "BeamSearchResult",
    "BeamStepLog",
    "beam_generate",
    "top_flat_candidates",
]

BEAM_UNSUPPORTED = register_code(
    "runtime.beam_unsupported",
    "rejection",
    "M3.10 0x05 Search procedures change required runtime state",
    "The beam runtime cannot honour this combination: a sampling family (beam sampling is not modelled), streaming, "
    "stop strings, structured output, a final-cache promise or a snapshot.",
)


# --------------------------------------------------------------------------------------------
# Values.
# --------------------------------------------------------------------------------------------


@attrs.frozen
class _Branch:
    """One live beam's coupled lanes (see the module docstring); gathered whole by the parent map."""

    tokens: tuple[int, ...]  # X: generated ids
    score: float  # S: float64 cumulative processed log-probability
    cache_ids: tuple[int, ...]  # C: ids whose K/V rows this batch row holds (P = len)
    policy_state: PolicyState  # Q (constraint_state), R (rng_counter)
    decoder: Any  # D
    ancestry: tuple[int, ...]  # Pi: parent slot at each step
    parent_hash: str | None  # Pi: I_branch of the parent it was forked from
    consumed_step: int | None  # W: the decision step that created it
    logprobs: tuple[float, ...]  # raw log_softmax at each token (output only, not hashed)


@attrs.frozen
class BeamHypothesis(Hypothesis):
    """One completed hypothesis: the spec's :class:`~decodespec.spec.beam.Hypothesis` value (ids,
    ``score`` = cumulative processed log-probability as a float64 sum, ``normalized`` = HF's
    ``sequences_scores``, ``length``, ``finish_reason``, ``triggers``, ``ancestry`` = HF
    ``beam_indices`` for one request, ``rank``, ``branch_hash``) plus what the runtime observed.

    Attributes:
        step: The completing decision step.
        logprobs: Per token, ``log_softmax`` of the raw float32 logits of its selecting row.
        branch: The completed :class:`~decodespec.spec.beam.BranchState` (``branch_hash`` is its hash).
        text: Decoded ids without a final EOS ("" without a tokenizer).
    """

    step: int
    logprobs: tuple[float, ...]
    branch: BranchState = attrs.field(repr=False)
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        """``output_ids``, ``text``, ``score`` (normalized, HF's sequence score), ``sum_logprobs``,
        ``length``, ``finish_reason``, ``triggers``, ``ancestry``, ``logprobs``, ``branch_hash``."""
        return {
            "output_ids": list(self.output_ids), "text": self.text, "score": self.normalized, "sum_logprobs": self.score,
            "length": self.length, "finish_reason": self.finish_reason.value, "triggers": [t.value for t in self.triggers],
            "ancestry": list(self.ancestry), "logprobs": list(self.logprobs), "branch_hash": self.branch_hash,
        }


@attrs.frozen
class BeamSearchResult:
    """A finished search.

    Attributes:
        prompt_ids: The L prompt ids.
        hypotheses: Kept completed hypotheses, best first by ``(-normalized, step, rank)``.
        best: ``hypotheses[0]`` or ``None`` (nothing completed).
        stop: Why the search ended.
        steps: The ``beam_step`` event bodies, one per step.
        num_calls: Model calls made.
        params: The :class:`~decodespec.spec.beam.BeamParams`.
    """

    prompt_ids: tuple[int, ...]
    hypotheses: tuple[BeamHypothesis, ...]
    best: BeamHypothesis | None
    stop: BeamStop
    steps: tuple[dict[str, Any], ...]
    num_calls: int
    params: BeamParams

    def frontier(self) -> dict[str, Any]:
        """L, O, |U|, P and tag of the best hypothesis' own path (its last token is never processed)."""
        out = 0 if self.best is None else self.best.length
        prompt_len = len(self.prompt_ids)
        return {"prompt_len": prompt_len, "output_count": out, "pending": 1 if out else 0,
                "processed": prompt_len + out - 1 if out else prompt_len,
                "pending_tag": "closed_unprocessed" if out else "empty"}

    def to_json(self) -> dict[str, Any]:
        """The ``decodespec generate --json`` body of a beam request: the best hypothesis' ``output_ids``,
        ``text``, ``logprobs``, ``score``, ``sum_logprobs``, ``finish_reason``, ``triggers``,
        ``frontier``, and ``beams`` (every kept completed hypothesis, best first), ``stop``,
        ``num_beams``, ``beam_params``."""
        best = self.best
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": [] if best is None else list(best.output_ids),
            "text": "" if best is None else best.text,
            "logprobs": [] if best is None else list(best.logprobs),
            "score": None if best is None else best.normalized,
            "sum_logprobs": None if best is None else best.score,
            "finish_reason": None if best is None else best.finish_reason.value,
            "triggers": [] if best is None else [t.value for t in best.triggers],
            "frontier": self.frontier(),
            "beams": [h.to_json() for h in self.hypotheses],
            "stop": self.stop.value,
            "num_beams": self.params.num_beams,
            "beam_params": self.params.to_json(),
        }


@attrs.frozen
class BeamStepLog:
    """What one :meth:`BeamRunner.decide` read and produced (kept with ``record=True``).

    Attributes:
        rows: ``float32[n, V]`` processed log-probability rows, row ``k`` for live slot ``k`` (CPU).
        expanded: The live branches the rows belong to (after their call), exported.
        children: The new live branches (token pending), exported.
        completed: The newly completed branches, rank order, exported.
        parents: The parent map applied to the cache and every lane (``int64[n']``).
    """

    rows: torch.Tensor = attrs.field(repr=False)
    expanded: tuple[BranchState, ...]
    children: tuple[BranchState, ...]
    completed: tuple[BranchState, ...]
    parents: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# Small pure helpers (the runtime's own arithmetic; the spec is the oracle in tests).
# --------------------------------------------------------------------------------------------


def _lp(penalty: LengthPenalty, length: int) -> float:
    """``lp(length)``: ``length ** alpha`` or ``((5 + length) / 6) ** alpha`` (python float)."""
    base = float(length) if penalty.form is PenaltyForm.POWER else (5.0 + length) / 6.0
    return base ** penalty.alpha


def _ordered(fired: set[FinishReason]) -> tuple[FinishReason, ...]:
    return tuple(r for r in FinishReason if r in fired)


def top_flat_candidates(beam_scores: torch.Tensor, logprobs: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """``selector.beam_topk`` for one request: the best ``num_candidates`` flat indices ``i = k V + v``.

    Candidates ``beam_scores[k] + logprobs[k, v]`` are ranked by score descending, ties to the
    lowest flat index: the order of :func:`decodespec.impl.policy.select_beam_candidates`, computed
    without sorting the whole grid (``torch.topk`` finds the ``N``-th value, then only the
    candidates at or above it are sorted stably, so boundary ties are resolved by the declared rule).

    Args:
        beam_scores: ``float64[n]`` cumulative scores of the live parents.
        logprobs: ``float64[n, V]`` processed rows.
        num_candidates: ``N``, ``1 <= N <= n * V``.

    Returns:
        ``int64[N]`` flat indices, best first (``-inf`` candidates last).

    Source: M3.8 0x0F ``beam_step`` (``reshape(B, K * V).topk``); tie rule declared in docs/design.md.
    """
    flat = (beam_scores[:, None] + logprobs).reshape(-1)  # [n * V], parent-major
    kth = torch.topk(flat, num_candidates).values[-1]  # the N-th best score
    pool = torch.nonzero(flat >= kth).squeeze(-1)  # [N'] ascending flat index, N' >= N (ties at the boundary)
    order = torch.sort(flat[pool], descending=True, stable=True).indices  # equal scores keep ascending index
    return pool[order][:num_candidates]


# --------------------------------------------------------------------------------------------
# The runner.
# --------------------------------------------------------------------------------------------


class BeamRunner:
    """Step-wise beam search of one request (see the module docstring).

    Args:
        model: The decoder (device, dtype and attention implementation used as they are).
        request: A :class:`~decodespec.impl.runtime.RuntimeRequest` whose policy is the beam family.
        params: The search parameters; default ``BeamParams.from_policy(request.policy, G, eos)``.
            Its width, cap and EOS set must be the request's.
        sink: Event sink for the trace, or ``None``.
        tokenizer: ``decode(ids) -> str`` for hypothesis text.
        runtime_info: Extra ``runtime`` fields of the trace header.
        record: Keep :attr:`log` (processed rows and exported states of every step).

    Raises:
        Rejection: ``runtime.invalid_request`` (empty prompt, id outside ``[0, V)``, ``G < 1``,
            unknown cache family, parameters that disagree with the request);
            ``policy.family_mismatch`` for a non-beam policy; ``runtime.beam_unsupported``.
        ResourceLimit: ``model.context_window_exceeded`` / ``cache.capacity_exceeded`` when
            ``L + G`` exceeds the context cap.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        request: RuntimeRequest,
        params: BeamParams | None = None,
        *,
        sink: EventSink | None = None,
        tokenizer: Any = None,
        runtime_info: dict[str, Any] | None = None,
        record: bool = False,
    ):
        request = _validated_beam(model, request)
        eos = tuple(sorted(request.eos_ids))
        if params is None:
            params = BeamParams.from_policy(request.policy, request.max_new_tokens, eos)
        if (params.num_beams, params.max_new_tokens, tuple(sorted(params.eos_ids))) != (
                request.policy.num_beams, request.max_new_tokens, eos):
            raise Rejection(INVALID_REQUEST, f"beam parameters (K={params.num_beams}, G={params.max_new_tokens}, eos="
                            f"{sorted(params.eos_ids)}) disagree with the request (K={request.policy.num_beams}, "
                            f"G={request.max_new_tokens}, eos={list(eos)})", "$.policy")
        self.model, self.request, self.params = model, request, params
        self.policy = policy_with_min_new_tokens(request.policy, request.min_new_tokens)
        self.capacity = request.static_capacity if request.cache == "static" else None
        window = model.config.max_position_embeddings
        cap = context_cap(window, request.context_cap, self.capacity)
        need = request.prompt_len + request.max_new_tokens
        if need > cap:
            code = CACHE_CAPACITY_EXCEEDED if self.capacity is not None and self.capacity < need else CONTEXT_WINDOW_EXCEEDED
            raise ResourceLimit(code, f"L + G = {need} exceeds the context cap {cap}; beams finish only by EOS or "
                                "max_new_tokens", "$.termination.max_new_tokens", details={"limit": cap, "actual": need})
        if self.capacity is not None:
            _check_static_capacity(model, self.capacity, batch_size=request.policy.num_beams)
        #: One cache for the whole frontier: batch row k is live slot k (1 row until the first reorder).
        self.cache = make_cache(request.cache, model.cache_abi, capacity=self.capacity)
        self.sink, self.tokenizer, self.runtime_info, self.record = sink, tokenizer, dict(runtime_info or {}), record
        self.revision = params.revision()
        root_state = attrs.evolve(initial_policy_state(self.policy), rng_counter=request.rng_counter_start)
        #: The live frontier, slot order (slot k = batch row k of the cache after the last reorder).
        self.live: list[_Branch] = [_Branch(tokens=(), score=0.0, cache_ids=(), policy_state=root_state, decoder=None,
                                            ancestry=(), parent_hash=None, consumed_step=None, logprobs=())]
        #: Completed hypotheses, best first by (-normalized, step, rank).
        self.completed: list[BeamHypothesis] = []
        self.step_idx = 0
        self.phase = "new"  # new -> ready -> scored -> ... -> done
        self.stop: BeamStop | None = None
        self.num_calls = 0
        self.generation = 0
        self.events: list[dict[str, Any]] = []
        self.log: list[BeamStepLog] = []
        self._logits: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------------
    # Views.
    # ---------------------------------------------------------------------------------------
    def _export(self, b: _Branch, slot: int, *, status: BeamStatus = BeamStatus.LIVE,
                triggers: tuple[FinishReason, ...] = ()) -> BranchState:
        length = len(b.tokens)
        return BranchState(
            request_id=self.request.identity, row=0, slot=slot, step=length, prefix=self.request.prompt_ids + b.tokens,
            prompt_len=self.request.prompt_len, score=b.score,
            normalized=b.score / _lp(self.params.length_penalty, length) if length else None, length=length,
            cache=CacheRef.of(b.cache_ids), position=len(b.cache_ids), constraint=b.policy_state.constraint_state,
            rng=RngState(key=self.request.identity, counter=b.policy_state.rng_counter), decoder=b.decoder,
            status=status, finish_reason=canonical_finish_reason(triggers), triggers=triggers, ancestry=b.ancestry,
            parent_hash=b.parent_hash, policy_revision=self.revision, consumed_step=b.consumed_step,
        )

    def live_branches(self) -> tuple[BranchState, ...]:
        """The live frontier as the spec's :class:`~decodespec.spec.beam.BranchState` values (slot order)."""
        return tuple(self._export(b, k) for k, b in enumerate(self.live))

    @property
    def done(self) -> bool:
        """Whether the search has ended."""
        return self.phase == "done"

    # ---------------------------------------------------------------------------------------
    # Actions.
    # ---------------------------------------------------------------------------------------
    def admit(self) -> None:
        """Write the trace header; the root is live with the prompt pending.

        Raises:
            Rejection: ``beam.not_enabled`` unless the search is new.
        """
        self._require(self.phase == "new", "admit")
        if self.sink is not None:
            r = self.request
            self.sink.emit("request", format=EVENTS_FORMAT, identity=r.identity, prompt_ids=list(r.prompt_ids),
                           max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, eos_ids=sorted(r.eos_ids),
                           cache=r.cache, capacity=self.capacity, prefill_chunk=r.prefill_chunk, profile="decoder_only",
                           lanes=["self_kv"] if r.cached else [], runtime={"name": "decodespec.impl.beam", **self.runtime_info},
                           policy=self.policy.to_json(), seed=r.seed, beam=self.params.to_json())
        self.phase = "ready"

    def call(self) -> torch.Tensor:
        """``transition.beam_call``: process every live beam's pending input; returns the score rows.

        Step 0 prefills the prompt on the single root row (in ``prefill_chunk`` chunks when
        declared); later steps run one decode call with row ``k`` = live beam ``k``'s pending
        token at ``cache_position = position_ids = P`` (all live beams share P).  Without a cache
        every live prefix is recomputed (``[n, L + t]``), the reference answer.

        Returns:
            ``float32[n, V]`` raw logits of each live beam's last input row (also kept until
            :meth:`decide` consumes them).

        Raises:
            Rejection: ``beam.not_enabled`` unless the search awaits a call.
        """
        if self.phase == "new":
            self.admit()
        self._require(self.phase == "ready", "call")
        device = self.model.device
        r = self.request
        prefixes = [r.prompt_ids + b.tokens for b in self.live]
        if self.cache is None:
            logits = self._forward(torch.tensor(prefixes, dtype=torch.long, device=device), 0)  # [n, L + t] rows
            self.live = [attrs.evolve(b, cache_ids=p) for b, p in zip(self.live, prefixes)]
        else:
            start = len(self.live[0].cache_ids)
            assert all(len(b.cache_ids) == start for b in self.live) and start == self.cache.committed_length
            end = len(prefixes[0])
            chunk = (end - start) if r.prefill_chunk is None else r.prefill_chunk
            logits = None
            while start < end:
                stop = min(end, start + chunk)
                ids = torch.tensor([p[start:stop] for p in prefixes], dtype=torch.long, device=device)  # [n, T]
                self.cache.begin_call(start, stop - start, self.generation)
                logits = self._forward(ids, start)
                self.generation += 1
                self.cache.commit_call(self.generation)
                self.live = [attrs.evolve(b, cache_ids=b.cache_ids + p[start:stop]) for b, p in zip(self.live, prefixes)]
                start = stop
            assert logits is not None
        self._logits = logits
        self.phase = "scored"
        return logits

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        length = ids.shape[1]
        cache_position = torch.arange(start, start + length, device=ids.device)  # [T]
        mask = self.cache.key_validity(length, ids.device) if isinstance(self.cache, StaticCache) else None  # [n, S]
        with torch.inference_mode():
            out = self.model(ids, attention_mask=mask, past_key_values=self.cache, cache_position=cache_position,
                             logits_to_keep=1)
        self.num_calls += 1
        return out.logits[:, -1, :].to(torch.float32)  # [n, V]

    def decide(self) -> dict[str, Any]:
        """``transition.beam_step``: consume the score rows once and apply the beam decision.

        Returns:
            The ``beam_step`` event body (``step``, ``parents``, ``tokens``, ``scores``, ``completed``).

        Raises:
            Rejection: ``beam.not_enabled`` unless scored; ``beam.outside_hf_envelope`` (HF
                parameters, fewer finite candidates than HF's window); ``policy.*`` from the
                processors (e.g. ``policy.empty_support``).  Nothing changes.
        """
        self._require(self.phase == "scored", "decide")
        assert self._logits is not None
        params, r, step = self.params, self.request, self.step_idx
        raw = torch.log_softmax(self._logits, dim=-1)  # [n, V] float32
        views = [RequestView(prompt_ids=r.prompt_ids, output_ids=b.tokens, step=step, eos_ids=tuple(sorted(r.eos_ids)),
                             min_new_tokens=r.min_new_tokens, identity=r.identity, seed=r.seed) for b in self.live]
        # M3.8 twin: processors on log-probabilities (HF order); a processor returns logits, which
        # the beam selector renormalises with log_softmax, so every entry stays <= 0.
        rows = process_scores(raw, self.policy, [b.policy_state for b in self.live], views, kind=ScoreKind.LOGPROBS).values  # [n, V]
        assert not bool((rows > 0).any()), "processed beam rows are log-probabilities"
        n, vocab = rows.shape
        window = max(2, 1 + len(params.eos_ids)) * params.num_beams
        num_finite = int(torch.isfinite(rows).sum())
        if params.hf_envelope and num_finite < window:
            raise Rejection(BEAM_OUTSIDE_HF, f"only {num_finite} finite candidates at step {step}; HF's window takes {window}",
                            "$.logprobs")
        beam_scores = torch.tensor([b.score for b in self.live], dtype=torch.float64, device=rows.device)  # [n]
        rows64 = rows.to(torch.float64)  # [n, V]
        flat_idx = top_flat_candidates(beam_scores, rows64, min(n * vocab, window))  # [N] ranked flat indices
        parents_t = torch.div(flat_idx, vocab, rounding_mode="floor")  # [N]
        tokens_t = flat_idx % vocab  # [N]
        increments_t = rows64[parents_t, tokens_t]  # [N]
        keep = torch.isfinite(increments_t)  # -inf candidates are never kept (sorted last)
        parents, tokens = parents_t[keep].tolist(), tokens_t[keep].tolist()
        increments = increments_t[keep].tolist()
        raw_lps = raw[parents_t[keep], tokens_t[keep]].tolist()

        eos = set(params.eos_ids)
        k = params.num_beams
        at_cap = step + 1 >= params.max_new_tokens
        ranks = range(len(tokens))
        live_ranks = [i for i in ranks if tokens[i] not in eos][:k]
        done_ranks = [i for i in ranks if i < k and tokens[i] in eos]
        child_ranks = [] if at_cap else live_ranks
        if at_cap:  # the cap closes every live child (normative) or only ranks < K (HF; the rest are dropped)
            done_ranks += [i for i in live_ranks if params.length_cap_rule is LengthCapRule.CLOSE_LIVE or i < k]
        done_ranks.sort()

        expanded = self.live_branches()
        parent_hashes = [branch_hash(b) for b in expanded]

        def fork(i: int) -> _Branch:
            parent = self.live[parents[i]]  # gather every lane of the parent named by the parent map ...
            return attrs.evolve(  # ... then append the child's token (fork before append)
                parent, tokens=parent.tokens + (tokens[i],), score=parent.score + increments[i],
                policy_state=next_state(self.policy, parent.policy_state, tokens[i], draws=0, selected_prob=None),
                ancestry=parent.ancestry + (parents[i],), parent_hash=parent_hashes[parents[i]], consumed_step=step,
                logprobs=parent.logprobs + (raw_lps[i],))

        children = [fork(i) for i in child_ranks]
        new_done = []
        for i in done_ranks:
            b = fork(i)
            fired = {FinishReason.EOS} if tokens[i] in eos else set()
            if len(b.tokens) >= params.max_new_tokens:
                fired.add(FinishReason.LENGTH)
            triggers = _ordered(fired)
            new_done.append(self._hypothesis(b, rank=i, step=step, triggers=triggers))
        completed = sorted(self.completed + new_done, key=lambda h: (-h.normalized, h.step, h.rank))
        if params.completed_capacity is not None:
            completed = completed[: params.completed_capacity]

        if at_cap and live_ranks:
            stop: BeamStop | None = BeamStop.LENGTH_CAP
        elif not children:
            stop = BeamStop.NO_LIVE
        elif self._may_stop(children, completed):
            stop = BeamStop.EARLY_STOP
        else:
            stop = None

        # -- effects (validation is over): fork before append, one parent map for every lane --
        child_parents = [parents[i] for i in child_ranks]
        event = {
            "step": step, "parents": child_parents, "tokens": [tokens[i] for i in child_ranks],
            "scores": [c.score for c in children],
            "completed": [{"parent": parents[h.rank], "token": h.output_ids[-1], "rank": h.rank, "score": h.score,
                           "normalized": h.normalized, "length": h.length, "finish_reason": h.finish_reason.value,
                           "triggers": [t.value for t in h.triggers]} for h in new_done],
        }
        if stop is None:
            self._reorder(child_parents)
        self.live = children if stop is None else []
        self.completed = completed
        self._logits = None
        self.step_idx = step + 1
        self.events.append(event)
        if self.record:
            self.log.append(BeamStepLog(rows=rows.detach().to("cpu"), expanded=expanded,
                                        children=tuple(self._export(c, s) for s, c in enumerate(children)),
                                        completed=tuple(h.branch for h in new_done), parents=tuple(child_parents)))
        if self.sink is not None:
            self.sink.emit("beam_step", **event)
        if stop is not None:
            self.stop = stop
            self.phase = "done"
            self._emit_finish()
        else:
            self.phase = "ready"
        return event

    def _hypothesis(self, b: _Branch, *, rank: int, step: int, triggers: tuple[FinishReason, ...]) -> BeamHypothesis:
        reason = canonical_finish_reason(triggers)
        assert reason is not None
        text_ids = b.tokens[:-1] if b.tokens and b.tokens[-1] in self.params.eos_ids else b.tokens
        text = self.tokenizer.decode(list(text_ids)) if self.tokenizer is not None else ""
        branch = self._export(b, rank, status=BeamStatus.COMPLETED, triggers=triggers)
        assert branch.normalized is not None
        return BeamHypothesis(output_ids=b.tokens, score=b.score, normalized=branch.normalized, length=len(b.tokens),
                              finish_reason=reason, triggers=triggers, ancestry=b.ancestry, rank=rank,
                              branch_hash=branch_hash(branch), step=step, logprobs=b.logprobs, branch=branch, text=text)

    def _may_stop(self, live: Sequence[_Branch], completed: Sequence[BeamHypothesis]) -> bool:
        """The termination contract (M3.10 0x05 table; HF ``_check_early_stop_heuristic``)."""
        params = self.params
        kind, n, pen = params.early_stop, params.required_completed, params.length_penalty
        if kind is EarlyStop.AT_CAP or len(completed) < n:
            return False
        if kind is EarlyStop.FIXED_COUNT:
            return True
        threshold = completed[n - 1].normalized
        g = len(live[0].tokens)
        if kind is EarlyStop.EXACT:
            # Admissible under non-positive increments: the best completion of a live prefix has
            # score <= s and length in [g + 1, G]; s / lp(n) is largest at n = G (alpha > 0) or g + 1.
            horizon = params.max_new_tokens if pen.alpha > 0 else g + 1
            bound = max(b.score / _lp(pen, horizon) for b in live)
        else:
            horizon = params.max_new_tokens if (kind is EarlyStop.NEVER and pen.alpha > 0) else g
            bound = max(b.score for b in live) / _lp(pen, horizon)
        return bound <= threshold

    def _reorder(self, parents: list[int]) -> None:
        """Apply the parent map to every cache layer: child row ``r`` becomes parent row ``parents[r]``.

        The branch lanes were gathered by the same map in :meth:`decide` (each child record is its
        parent's, then its token is appended); the cache ledger (C, P) stays the parent's and the
        child's token is pending input for the next call (fork before append).
        """
        if self.cache is not None:
            self.cache.reorder_cache(torch.tensor(parents, dtype=torch.long))  # [n'] parent row of each child row

    def _emit_finish(self) -> None:
        if self.sink is None:
            return
        best = self.completed[0] if self.completed else None
        result = self.result()
        self.sink.emit("finish", finish_reason=None if best is None else best.finish_reason.value,
                       triggers=[] if best is None else [t.value for t in best.triggers], frontier=result.frontier(),
                       stop=self.stop.value if self.stop else None)

    def step(self) -> str | None:
        """Take the next action (``admit``, ``call``, ``decide``); ``None`` once the search is done."""
        if self.phase == "new":
            self.admit()
            return "admit"
        if self.phase == "ready":
            self.call()
            return "call"
        if self.phase == "scored":
            self.decide()
            return "decide"
        return None

    def run(self) -> BeamRunner:
        """Drive the search to its end; returns ``self``."""
        while self.step() is not None:
            pass
        return self

    def result(self) -> BeamSearchResult:
        """The :class:`BeamSearchResult` (the search must be done).

        Raises:
            Rejection: ``beam.not_enabled`` while the search runs.
        """
        self._require(self.phase == "done", "result")
        assert self.stop is not None
        hyps = tuple(self.completed)
        return BeamSearchResult(prompt_ids=self.request.prompt_ids, hypotheses=hyps, best=hyps[0] if hyps else None,
                                stop=self.stop, steps=tuple(self.events), num_calls=self.num_calls, params=self.params)

    def _require(self, condition: bool, action: str) -> None:
        if not condition:
            raise Rejection(BEAM_NOT_ENABLED, f"{action} is not enabled in phase {self.phase}", "$.action",
                            details={"action": action, "phase": self.phase})


def _validated_beam(model: LlamaForCausalLM, request: RuntimeRequest) -> RuntimeRequest:
    """The request's common checks plus the beam-only refusals (before any state is built)."""
    if request.policy.family is not Family.BEAM:
        from decodespec.spec.policy.codes import FAMILY_MISMATCH

        raise Rejection(FAMILY_MISMATCH, f"the beam runner needs the beam family, not {request.policy.family.value!r}",
                        "$.policy.family")
    for refused, what, path in (
        (request.stream, "streaming (no hypothesis is final before the search ends)", "$.output.stream"),
        (bool(request.stop_strings), "stop strings", "$.termination.stop_strings"),
        (request.structured != "none", "structured output", "$.termination.structured"),
        (request.final_cache == "all_outputs", "a final-cache promise (all_outputs)", "$.output.final_cache"),
        (request.timeout_ms is not None, "a wall-clock budget (the beam loop has no timeout boundary)", "$.termination.timeout_ms"),
    ):
        if refused:
            raise Rejection(BEAM_UNSUPPORTED, f"beam search cannot honour {what}", path)
    if isinstance(request.max_new_tokens, int) and not isinstance(request.max_new_tokens, bool) and request.max_new_tokens < 1:
        raise Rejection(INVALID_REQUEST, f"a beam search needs max_new_tokens >= 1, got {request.max_new_tokens}",
                        "$.termination.max_new_tokens")
    # The controller's checks (prompt ids, G, cache family, static capacity default), run with the
    # family check neutralised: that check is what sends beam policies here.
    checked = _validated(model, attrs.evolve(request, policy=PolicyConfig.greedy()))
    return attrs.evolve(checked, policy=request.policy)


def beam_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    params: BeamParams,
    *,
    policy_transforms: Sequence[dict[str, Any]] = (),
    min_new_tokens: int = 0,
    cache: str = "dynamic",
    static_capacity: int | None = None,
    prefill_chunk: int | None = None,
    identity: str = "",
    tokenizer: Any = None,
    sink: EventSink | None = None,
) -> BeamSearchResult:
    """Beam search of ``prompt_ids`` under ``params`` (a convenience over :class:`BeamRunner`).

    Args:
        model: The decoder.
        prompt_ids: L >= 1 ids in ``[0, V)``.
        params: :class:`~decodespec.spec.beam.BeamParams` (``hf_compatible(...)`` or normative).
        policy_transforms: M3.8 processor objects (e.g. ``{"name": "repetition_penalty", "penalty": 1.2}``).
        min_new_tokens: EOS is illegal while fewer tokens are generated.
        cache: ``"none"``, ``"dynamic"`` or ``"static"``.
        static_capacity: Static slots (default L + G + 1, at most the window).
        prefill_chunk: Prefill in chunks of at most this many tokens.
        identity: Request identity (``I_request`` of every branch).
        tokenizer: For hypothesis text.
        sink: Event sink.

    Returns:
        :class:`BeamSearchResult`.

    Raises:
        As :class:`BeamRunner`; ``policy.*`` for invalid transforms.
    """
    from decodespec.spec.policy.config import policy_config_from_json

    policy = policy_config_from_json({"family": "beam", "num_beams": params.num_beams, "transforms": list(policy_transforms)})
    request = RuntimeRequest(identity=identity, prompt_ids=tuple(prompt_ids), max_new_tokens=params.max_new_tokens,
                             policy=policy, eos_ids=frozenset(params.eos_ids), min_new_tokens=min_new_tokens, cache=cache,
                             static_capacity=static_capacity, prefill_chunk=prefill_chunk)
    return BeamRunner(model, request, params, tokenizer=tokenizer, sink=sink).run().result()
