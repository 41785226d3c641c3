"""M3.8 0x0B-0x0F The decoding policy in torch: processed rows, decisions and receipts (float32).

The runtime's twin of ``decodespec.spec.policy``: the same pipeline over ``[B, V]`` (or ``[V]``)
float32 tensors on any device, written independently in torch (it never calls the spec's
transforms, selectors or RNG).  It imports only the spec's value types (``PolicyConfig``,
``TransformSpec``, ``PolicyState``, ``RequestView``, ``DecisionReceipt``) and error codes.

Pipeline (rule ids in brackets): transforms in ``config.transforms`` order
[``transform.<name>``]; temperature 0 branches to greedy, skipping later warpers; the final
legal-support assertion (``policy.empty_support`` or the declared ``fallback_eos``);
normalization for the selector; selection [``selector.greedy``: lowest id among maxima;
``selector.multinomial``: inverse CDF in id order with one uniform from
:class:`decodespec.impl.rng.RequestRng` at ``(step, 0)``; ``selector.beam``: stable top-N
over the flattened ``[K*V]`` axis]; state update (RNG counter, automaton, Mirostat ``mu``).

Torch idioms mirrored: HF ``RepetitionPenaltyLogitsProcessor`` (gather / ``where`` /
scatter), HF ``NoRepeatNGramLogitsProcessor`` (``unfold`` windows), HF ``TopPLogitsWarper``
(sort, cumsum, scatter back through the permutation), vLLM ``apply_penalties``
(``bincount`` counts), llama.cpp ``top_n_sigma`` (population std of finite logits).
Differences from those peers are the spec's declared choices: exact-k top-k with lowest-id
ties, stable sorts, the crossing token kept by top-p and typical.

Size: the torch twin of every M3.8 transform and selector, one function each in the spec's order
(spec/policy/transforms.py, selectors.py), over shared row helpers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import torch

from decodespec.impl.rng import RequestRng
from decodespec.spec.errors import Rejection
from decodespec.spec.policy import codes
from decodespec.spec.policy.config import EmptySupport, Family, PolicyConfig, Stage, TransformSpec
from decodespec.spec.policy.receipt import DecisionReceipt, RngRecord
from decodespec.spec.policy.scores import ScoreKind
from decodespec.spec.policy.state import PolicyState, RequestView

__all__ = [
    "TorchProcessed",
    "beam_candidates",
    "decide",
    "greedy_select",
    "multinomial_select",
    "next_state",
    "process_scores",
    "select_beam_candidates",
]

_NEG_INF = float("-inf")
_WARPERS = (Stage.TEMPERATURE, Stage.TRUNCATION)

TorchTransform = Callable[[torch.Tensor, TransformSpec, Sequence[RequestView], Sequence[PolicyState]], torch.Tensor]
_TRANSFORMS: dict[str, TorchTransform] = {}


def _register(name: str) -> Callable[[TorchTransform], TorchTransform]:
    def deco(fn: TorchTransform) -> TorchTransform:
        _TRANSFORMS[name] = fn
        return fn

    return deco


def _ban(z: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(banned, _NEG_INF)


def _row_mask(z: torch.Tensor, ids_per_row: Sequence[Sequence[int]]) -> torch.Tensor:
    """``[B, V]`` bool, True at ``ids_per_row[b]`` in row b."""
    mask = torch.zeros_like(z, dtype=torch.bool)
    for b, ids in enumerate(ids_per_row):
        if ids:
            mask[b, torch.tensor(list(ids), dtype=torch.long, device=z.device)] = True
    return mask


def _edges(spec: TransformSpec) -> dict[str, dict[int, str]]:
    return {state: dict(edges) for state, edges in spec.get("automaton").transitions}


def _stable_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row descending; equal values keep ascending id order (``lowest_id``)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _scatter_keep(keep_sorted: torch.Tensor, order: torch.Tensor, vocab: int) -> torch.Tensor:
    """Map a keep mask over sorted positions back to vocabulary ids through the permutation."""
    return torch.zeros(order.shape[0], vocab, dtype=torch.bool, device=order.device).scatter(-1, order, keep_sorted)


def _ranked_support(key: torch.Tensor, support: torch.Tensor, *, descending: bool) -> torch.Tensor:
    """Ids ordered by ``key`` (ties: ascending id), ``[B, N]``.

    For one row only the support is sorted (a nucleus after top-k is tiny, the vocabulary is
    not); ids outside the support never enter the kept prefix, so leaving them out changes
    nothing.  Several rows sort the whole vocabulary (off-support keys sort last).
    """
    if key.shape[0] == 1:
        ids = support[0].nonzero().squeeze(-1)  # ascending ids, so the stable sort breaks ties by id
        return ids[torch.sort(key[0, ids], descending=descending, stable=True).indices].unsqueeze(0)
    return torch.sort(key, dim=-1, descending=descending, stable=True).indices


def _prefix_keep(probs: torch.Tensor, order: torch.Tensor, mass: float) -> torch.Tensor:
    """Keep the ranked prefix whose mass before each id is < ``mass`` (the crossing id stays)."""
    sorted_p = probs.gather(-1, order)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = (before < mass) & (sorted_p > 0)
    keep_sorted[..., 0] = sorted_p[..., 0] > 0
    return _scatter_keep(keep_sorted, order, probs.shape[-1])


# ----------------------------------------------------------------------------------------
# Legality
# ----------------------------------------------------------------------------------------


@_register("constraint")
def _constraint(z, spec, views, states):
    edges = _edges(spec)
    legal = _row_mask(z, [sorted(edges.get(s.constraint_state, {})) for s in states])
    return _ban(z, ~legal)


@_register("min_new_tokens")
def _min_new_tokens(z, spec, views, states):
    return _ban(z, _row_mask(z, [v.eos_ids if len(v.output_ids) < v.min_new_tokens else () for v in views]))


@_register("bad_words")
def _bad_words(z, spec, views, states):
    banned_rows = []
    for v in views:
        h = v.history(spec.get("history"))
        banned_rows.append([seq[-1] for seq in spec.get("sequences") if len(seq) - 1 <= len(h) and list(h[len(h) - len(seq) + 1:]) == list(seq[:-1])])
    return _ban(z, _row_mask(z, banned_rows))


@_register("no_repeat_ngram")
def _no_repeat_ngram(z, spec, views, states):
    n = spec.get("n")
    banned_rows = []
    for v in views:
        h = torch.tensor(v.history(spec.get("history")), dtype=torch.long)
        if h.numel() < n:
            banned_rows.append([])
            continue
        windows = h.unfold(0, n, 1)  # [num_windows, n]
        prefix = h[h.numel() - n + 1:]  # [n - 1]
        matches = (windows[:, :-1] == prefix).all(dim=-1)
        banned_rows.append(windows[matches, -1].tolist())
    return _ban(z, _row_mask(z, banned_rows))


# ----------------------------------------------------------------------------------------
# Penalties and biases
# ----------------------------------------------------------------------------------------


@_register("repetition_penalty")
def _repetition_penalty(z, spec, views, states):
    r = spec.get("penalty")
    seen = _row_mask(z, [v.history(spec.get("history")) for v in views])
    penalized = torch.where(z > 0, z / r, z * r)
    return torch.where(seen, penalized, z)


def _counts(z: torch.Tensor, views: Sequence[RequestView]) -> torch.Tensor:
    v = z.shape[-1]
    return torch.stack([torch.bincount(torch.tensor(view.output_ids, dtype=torch.long), minlength=v)[:v] for view in views]).to(z.device, z.dtype)


@_register("frequency_penalty")
def _frequency_penalty(z, spec, views, states):
    return z - spec.get("penalty") * _counts(z, views)


@_register("presence_penalty")
def _presence_penalty(z, spec, views, states):
    return z - spec.get("penalty") * (_counts(z, views) > 0).to(z.dtype)


@_register("logit_bias")
def _logit_bias(z, spec, views, states):
    bias = torch.zeros(z.shape[-1], dtype=z.dtype, device=z.device)
    ids, values = zip(*spec.get("bias"))
    bias[torch.tensor(ids, dtype=torch.long, device=z.device)] = torch.tensor(values, dtype=z.dtype, device=z.device)
    return z + bias


# ----------------------------------------------------------------------------------------
# Warpers
# ----------------------------------------------------------------------------------------


@_register("temperature")
def _temperature(z, spec, views, states):
    t = spec.get("temperature")
    assert t > 0, "temperature 0 is the greedy branch, never a division"
    return z / t


@_register("top_k")
def _top_k(z, spec, views, states):
    k = spec.get("k")
    if k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]  # [B, 1] the k-th largest value
    above = z > kth
    at = z == kth
    room = k - above.sum(dim=-1, keepdim=True)  # ids still to keep among the ties at the k-th value
    keep = above | (at & (torch.cumsum(at.to(torch.int64), dim=-1) <= room))  # ties: lowest ids first
    return _ban(z, ~keep)


@_register("top_p")
def _top_p(z, spec, views, states):
    p = spec.get("p")
    if p >= 1.0:
        return z
    probs = torch.softmax(z, dim=-1)
    return _ban(z, ~_prefix_keep(probs, _ranked_support(probs, torch.isfinite(z), descending=True), p))


@_register("min_p")
def _min_p(z, spec, views, states):
    alpha = spec.get("p")
    if alpha <= 0.0:
        return z
    return _ban(z, z < z.amax(dim=-1, keepdim=True) + math.log(alpha))  # p < alpha p_max, in logits


@_register("typical")
def _typical(z, spec, views, states):
    # In float64: the kept set is decided by the ranked mass reaching p, and with p near 1 the
    # crossing id's probability (~1e-5 on SmolLM2's tail) is below the drift of a float32 entropy,
    # ranking and mass over ~600 tail ids (impl.typical_crossing_float32).  One [V] row in float64
    # costs nothing next to the forward; the mask then bans on the row's own dtype.
    z64 = z.double()
    logp = torch.log_softmax(z64, dim=-1)
    probs = logp.exp()
    entropy = -(torch.where(probs > 0, probs * logp, torch.zeros_like(logp))).sum(dim=-1, keepdim=True)
    shifted = torch.where(torch.isfinite(logp), (-logp - entropy).abs(), torch.full_like(logp, math.inf))
    order = _ranked_support(shifted, torch.isfinite(logp), descending=False)
    return _ban(z, ~_prefix_keep(probs, order, spec.get("p")))


def _log_floor(z: torch.Tensor, logp: torch.Tensor, log_floor: torch.Tensor | float) -> torch.Tensor:
    keep = (logp >= log_floor) | (z == z.amax(dim=-1, keepdim=True))
    return _ban(z, ~keep)


@_register("epsilon")
def _epsilon(z, spec, views, states):
    # Log-probabilities in float64, as _typical: an id whose log-probability sits at the floor keeps
    # the side the float64 spec gives it instead of the side float32 rounding gives it.
    return _log_floor(z, torch.log_softmax(z.double(), dim=-1), math.log(spec.get("epsilon")))


@_register("eta")
def _eta(z, spec, views, states):
    # In float64: the floor depends on the row's entropy, whose float32 sum over V drifts by more than
    # the gap between the floor and the nearest id's log-probability (found by the machines on
    # SmolLM2: eta 0.043 after temperature 2.5 kept one id fewer than the spec on the same row).
    logp = torch.log_softmax(z.double(), dim=-1)
    entropy = -(torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp))).sum(dim=-1, keepdim=True)
    log_eps = math.log(spec.get("epsilon"))
    return _log_floor(z, logp, torch.clamp(0.5 * log_eps - entropy, max=log_eps))


@_register("top_n_sigma")
def _top_n_sigma(z, spec, views, states):
    finite = torch.isfinite(z)
    count = finite.sum(dim=-1, keepdim=True).to(z.dtype)
    zf = torch.where(finite, z, torch.zeros_like(z))
    mean = zf.sum(dim=-1, keepdim=True) / count
    var = (torch.where(finite, z - mean, torch.zeros_like(z)) ** 2).sum(dim=-1, keepdim=True) / count
    threshold = z.amax(dim=-1, keepdim=True) - spec.get("n") * var.sqrt()
    return _ban(z, z < threshold)


@_register("mirostat_v2")
def _mirostat_v2(z, spec, views, states):
    mu = torch.tensor([[s.mirostat_mu] for s in states], dtype=z.dtype, device=z.device)
    surprise = -torch.log_softmax(z, dim=-1) / math.log(2.0)  # bits; +inf for forbidden ids
    keep = surprise <= mu
    top = greedy_select(z)
    keep[torch.arange(z.shape[0], device=z.device), top] |= ~keep.any(dim=-1)
    return _ban(z, ~keep)


# ----------------------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class TorchProcessed:
    """The processed rows the selector sees.

    Attributes:
        values: ``[B, V]`` float32 selector input of kind ``kind``.
        kind: Score kind of ``values``.
        probs: ``[B, V]`` float32 processed distribution.
        applied: Transforms applied, in order.
        normalization: ``"softmax"``, ``"log_softmax"`` or ``None``.
        selector: ``"greedy"``, ``"multinomial"`` or ``"beam"``.
        greedy_reason: ``"family"``, ``"temperature_zero"`` or ``None`` (config-level).
        fallback_rows: Per row, whether ``fallback_eos`` forced it (then it is one-hot EOS).
        support_mask: ``[B, V]`` bool finite support before normalization.
    """

    values: torch.Tensor
    kind: ScoreKind
    probs: torch.Tensor
    applied: tuple[TransformSpec, ...]
    normalization: str | None
    selector: str
    greedy_reason: str | None
    fallback_rows: tuple[bool, ...]
    support_mask: torch.Tensor


def _check_finite(z: torch.Tensor, path: str) -> None:
    if torch.isnan(z).any():
        raise Rejection(codes.NAN_SCORES, "NaN in scores; the row is never sampled", path)
    if torch.isposinf(z).any():
        raise Rejection(codes.INFINITE_SCORES, "+inf in scores", path)


def _support(z: torch.Tensor, kind: ScoreKind) -> torch.Tensor:
    return (z > 0).sum(dim=-1) if kind is ScoreKind.PROBS else torch.isfinite(z).sum(dim=-1)


def _check_row(scores: torch.Tensor, kind: ScoreKind) -> None:
    if scores.ndim != 2 or scores.shape[-1] == 0 or not scores.is_floating_point():
        raise Rejection(codes.INVALID_ROW, f"scores must be float [B, V] or [V], got {tuple(scores.shape)} {scores.dtype}", "$.row.values")
    _check_finite(scores, "$.row.values")
    if kind is ScoreKind.PROBS:
        bad = torch.isinf(scores).any() or (scores < 0).any() or (scores > 1).any() or ((scores.double().sum(-1) - 1).abs() > 1e-4).any()
    elif kind is ScoreKind.LOGPROBS:
        bad = (torch.logsumexp(scores.double(), dim=-1).abs() > 1e-4).any()
    else:
        bad = False
    if bad:
        raise Rejection(codes.INVALID_ROW, f"scores contradict their declared kind {kind.value}", "$.row.values")


def _as_rows(x, b: int, what: str) -> list:
    rows = list(x) if isinstance(x, (list, tuple)) else [x] * b
    if len(rows) != b:
        raise Rejection(codes.INVALID_ROW, f"{len(rows)} {what} for {b} rows", "$.rows")
    return rows


def _legality_only(raw: torch.Tensor, config: PolicyConfig, views, states) -> torch.Tensor:
    z = raw
    for t in config.transforms:
        if t.info.stage is Stage.LEGALITY:
            z = _TRANSFORMS[t.name](z, t, views, states)
    return z


def process_scores(
    scores: torch.Tensor,
    config: PolicyConfig,
    states: PolicyState | Sequence[PolicyState],
    views: RequestView | Sequence[RequestView],
    *,
    kind: ScoreKind = ScoreKind.LOGITS,
) -> TorchProcessed:
    """Run the policy pipeline on ``[B, V]`` (or ``[V]``) scores in float32.

    Args:
        scores: Raw score rows (any float dtype and device; computed in float32).
        config: The policy.
        states: One policy state per row (or one for every row).
        views: One request view per row (or one for every row).
        kind: Declared kind of ``scores``.

    Returns:
        :class:`TorchProcessed` (always ``[B, V]``).

    Raises:
        Rejection: ``policy.score_kind_mismatch``, ``policy.nan_scores``,
            ``policy.infinite_scores``, ``policy.empty_support`` (details name the row),
            ``policy.invalid_row``, ``policy.invalid_state``, ``policy.token_out_of_range``.

    Shapes:
        scores: ``[B, V]`` or ``[V]``; outputs ``[B, V]`` float32.
    """
    kind = ScoreKind(kind)
    z = (scores.unsqueeze(0) if scores.ndim == 1 else scores).to(torch.float32)
    _check_row(z, kind)
    b, v = z.shape
    states, views = _as_rows(states, b, "states"), _as_rows(views, b, "views")
    for s in states:
        s.check(config)
    for view in views:
        if view.max_token_id() >= v:
            raise Rejection(codes.TOKEN_OUT_OF_RANGE, f"the request view names token id {view.max_token_id()} >= V = {v}", "$.view")
    for i, t in enumerate(config.transforms):
        if t.token_ids() and max(t.token_ids()) >= v:
            raise Rejection(codes.TOKEN_OUT_OF_RANGE, f"{t.name} names a token id >= V = {v}", f"$.policy.transforms[{i}]")
    raw = z
    selector = {Family.GREEDY: "greedy", Family.MULTINOMIAL: "multinomial", Family.BEAM: "beam"}[config.family]
    greedy_reason = "family" if config.family is Family.GREEDY else None
    applied: list[TransformSpec] = []
    dead = (_support(z, kind) == 0).unsqueeze(-1)  # [B, 1]: rows whose support is already empty
    for i, t in enumerate(config.transforms):
        if bool(dead.all()):
            break
        if greedy_reason == "temperature_zero" and t.info.stage in _WARPERS:
            continue
        if t.name == "temperature" and t.get("temperature") == 0.0:
            selector, greedy_reason = "greedy", "temperature_zero"
            continue
        if kind not in t.info.accepts:
            raise Rejection(codes.SCORE_KIND_MISMATCH, f"{t.name} accepts {sorted(k.value for k in t.info.accepts)}, got {kind.value}", f"$.policy.transforms[{i}]")
        # An emptied row stays empty: it is fed zeros (so softmax-based warpers stay defined)
        # and masked back to -inf; its own fate is decided by the empty-support policy below.
        z = _TRANSFORMS[t.name](torch.where(dead, 0.0, z), t, views, states).masked_fill(dead, _NEG_INF)
        _check_finite(z, f"$.policy.transforms[{i}]")
        kind = t.info.returns
        applied.append(t)
        dead = dead | (_support(z, kind) == 0).unsqueeze(-1)
    empty = dead.squeeze(-1).tolist()
    if any(empty):
        z, kind = _apply_fallback(z, kind, empty, raw, config, views, states)
    support_mask = z > 0 if kind is ScoreKind.PROBS else torch.isfinite(z)
    normalization = None
    if selector == "multinomial" and kind is not ScoreKind.PROBS:
        z, kind, normalization = torch.softmax(z, dim=-1), ScoreKind.PROBS, "softmax"
    elif selector == "beam" and kind is ScoreKind.LOGITS:
        z, kind, normalization = torch.log_softmax(z, dim=-1), ScoreKind.LOGPROBS, "log_softmax"
    if (selector == "multinomial" and kind is not ScoreKind.PROBS) or (selector == "beam" and kind is not ScoreKind.LOGPROBS):
        raise Rejection(codes.SCORE_KIND_MISMATCH, f"selector {selector} cannot take {kind.value} scores", "$.row.kind")
    probs = z if kind is ScoreKind.PROBS else (z.exp() if kind is ScoreKind.LOGPROBS else torch.softmax(z, dim=-1))
    return TorchProcessed(z, kind, probs, tuple(applied), normalization, selector, greedy_reason, tuple(empty), support_mask)


def _apply_fallback(z, kind, empty, raw, config, views, states):
    if config.empty_support is EmptySupport.FALLBACK_EOS:
        legal = _legality_only(raw, config, views, states)
    out = z.clone() if kind is not ScoreKind.PROBS else torch.log(z)
    for b, is_empty in enumerate(empty):
        if not is_empty:
            continue
        eos = [] if config.empty_support is EmptySupport.RAISE else sorted(e for e in set(views[b].eos_ids) if bool(torch.isfinite(legal[b, e])))
        if not eos:
            raise Rejection(codes.EMPTY_SUPPORT, f"row {b}: no token has a finite score after the transforms and no fallback applies", "$", {"row": b, "step": views[b].step})
        out[b] = _NEG_INF
        out[b, eos[0]] = 0.0
    return out, ScoreKind.LOGITS


# ----------------------------------------------------------------------------------------
# Selectors and state
# ----------------------------------------------------------------------------------------


def greedy_select(values: torch.Tensor) -> torch.Tensor:
    """Lowest id among the row maxima (``selector.greedy``).

    Shapes:
        values: ``[B, V]``; returns ``[B]`` int64.
    """
    ids = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    at_max = values == values.amax(dim=-1, keepdim=True)
    return torch.where(at_max, ids, values.shape[-1]).amin(dim=-1)


def multinomial_select(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary-id order with one uniform per row (``selector.multinomial``).

    Args:
        probs: ``[B, V]`` non-negative processed probabilities.
        u: ``[B]`` uniforms in ``[0, 1)``.

    Returns:
        ``[B]`` int64 vocabulary ids: the first id whose cumulative mass exceeds ``u * total``.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # float64 accumulation of float32 mass
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last_positive = torch.where(probs > 0, ids, -1).amax(dim=-1)
    return torch.minimum(idx, last_positive)


def next_state(config: PolicyConfig, state: PolicyState, token_id: int, *, draws: int, selected_prob: float | None) -> PolicyState:
    """State after committing ``token_id``: counter + draws, automaton transition, Mirostat update.

    ``selected_prob`` is the final processed probability when Mirostat ran (``None`` otherwise,
    leaving ``mu`` unchanged).  Units: ``mu`` in bits.
    """
    constraint = config.find("constraint")
    mirostat = config.find("mirostat_v2")
    constraint_state = state.constraint_state
    if constraint is not None:
        nxt = _edges(constraint).get(state.constraint_state, {}).get(token_id)
        assert nxt is not None, f"token {token_id} is not legal in constraint state {state.constraint_state!r}"
        constraint_state = nxt
    mu = state.mirostat_mu
    if mirostat is not None and selected_prob is not None:
        mu = mu - mirostat.get("eta") * (-math.log2(selected_prob) - mirostat.get("tau"))
    return PolicyState(rng_counter=state.rng_counter + draws, constraint_state=constraint_state, mirostat_mu=mu)


def decide(
    scores: torch.Tensor,
    config: PolicyConfig,
    state: PolicyState,
    view: RequestView,
    *,
    kind: ScoreKind = ScoreKind.LOGITS,
    score_id: str = "",
    vocab_hash: str = "",
    rng: RequestRng | None = None,
) -> tuple[DecisionReceipt, PolicyState]:
    """Decide one token from one raw score row (the runtime's ``decision`` step).

    Args:
        scores: ``[V]`` (or ``[1, V]``) raw scores of kind ``kind``, any device.
        config: A greedy or multinomial policy.
        state: Policy state before the decision.
        view: Read-only request view (``view.step`` addresses the draw).
        kind: Declared kind of ``scores``.
        score_id: Identity of the score row (the ``call_completed`` ``score_id``).
        vocab_hash: Ordered vocabulary map hash.
        rng: The request's :class:`RequestRng` (built from ``view.identity``/``view.seed`` if
            omitted).

    Returns:
        ``(receipt, next_state)``; ``receipt.raw_logprob`` is ``log_softmax(raw)[token]``.

    Raises:
        Rejection: ``policy.family_mismatch`` for the beam family and every error of
            :func:`process_scores`.
    """
    if config.family is Family.BEAM:
        raise Rejection(codes.FAMILY_MISMATCH, "the beam family decides with beam_candidates, not decide", "$.policy.family")
    row = scores.reshape(1, -1) if scores.ndim == 1 or (scores.ndim == 2 and scores.shape[0] == 1) else None
    if row is None:
        raise Rejection(codes.INVALID_ROW, f"decide takes one row, got {tuple(scores.shape)}", "$.row.values")
    pr = process_scores(row, config, state, view, kind=kind)
    rng = rng or RequestRng(view.identity, view.seed)
    fallback = pr.fallback_rows[0]
    if pr.selector == "multinomial" and not fallback:
        u = rng.uniform(view.step, 0)
        token = int(multinomial_select(pr.probs, torch.tensor([u], dtype=torch.float64, device=pr.probs.device))[0])
        addresses, uniforms = ((view.step, 0),), (u,)
    else:
        token = int(greedy_select(pr.values)[0])
        addresses, uniforms = (), ()
    selected_prob = float(pr.probs[0, token])
    observes = any(t.name == "mirostat_v2" for t in pr.applied) and not fallback
    after = next_state(config, state, token, draws=len(uniforms), selected_prob=selected_prob if observes else None)
    raw = row.to(torch.float32)
    raw_logprob = {ScoreKind.LOGITS: lambda: torch.log_softmax(raw, dim=-1), ScoreKind.LOGPROBS: lambda: raw, ScoreKind.PROBS: lambda: raw.log()}[ScoreKind(kind)]()
    receipt = DecisionReceipt.build(
        score_id=score_id,
        score_kind=ScoreKind(kind).value,
        vocab_hash=vocab_hash,
        vocab_size=int(row.shape[-1]),
        step=view.step,
        family=config.family.value,
        preset=config.preset,
        policy=config,
        transforms=pr.applied,
        normalization=None if fallback else pr.normalization,
        selector="greedy" if fallback else pr.selector,
        greedy_reason="fallback_eos" if fallback else pr.greedy_reason,
        tie_rule=config.tie_rule,
        empty_support=config.empty_support.value,
        fallback_used=fallback,
        support_size=int(pr.support_mask[0].sum()),
        selected_id=token,
        raw_logprob=float(raw_logprob[0, token]),
        processed_logprob=math.log(selected_prob),
        draws=len(uniforms),
        rng=RngRecord(key_id=rng.key_id, addresses=addresses, uniforms=uniforms, counter_before=state.rng_counter, counter_after=after.rng_counter),
        state_before=state,
        state_after=after,
    )
    return receipt, after


def select_beam_candidates(logprobs: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top candidates of the joint beam grid (``selector.beam``).

    Args:
        logprobs: ``[B, K, V]`` processed log-probabilities per parent beam.
        beam_scores: ``[B, K]`` running scores (``-inf`` for inactive parents).
        num_candidates: N <= K * V.

    Returns:
        ``(scores [B, N], parents [B, N], tokens [B, N])``: flat index ``i = k V + v`` ranked by
        score with ties to the lowest flat index; ``parent = i // V``, ``token = i % V``.
    """
    b, k, v = logprobs.shape
    flat = (beam_scores.unsqueeze(-1) + logprobs).reshape(b, k * v)  # [B, K*V]
    scores, order = _stable_desc(flat)
    scores, order = scores[:, :num_candidates], order[:, :num_candidates]
    return scores, torch.div(order, v, rounding_mode="floor"), order % v


def beam_candidates(
    scores: torch.Tensor,
    beam_scores: torch.Tensor,
    config: PolicyConfig,
    states: Sequence[PolicyState],
    views: Sequence[RequestView],
    num_candidates: int | None = None,
    *,
    kind: ScoreKind = ScoreKind.LOGITS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Process K parent rows and rank their joint candidates (one request).

    Args:
        scores: ``[K, V]`` raw rows, one per live parent.
        beam_scores: ``[K]`` running scores.
        config: A beam-family policy.
        states: K parent policy states.
        views: K parent request views.
        num_candidates: Default ``2 * num_beams`` (HF), capped at ``K * V``.
        kind: Declared kind of ``scores``.

    Returns:
        ``(cand_scores [N], parents [N], tokens [N], logprobs [K, V])``.

    Raises:
        Rejection: ``policy.family_mismatch`` and every error of :func:`process_scores`.
    """
    if config.family is not Family.BEAM:
        raise Rejection(codes.FAMILY_MISMATCH, "beam candidates need the beam family", "$.policy.family")
    pr = process_scores(scores, config, list(states), list(views), kind=kind)
    k, v = pr.values.shape
    n = min(k * v, 2 * config.num_beams if num_candidates is None else num_candidates)
    s, p, t = select_beam_candidates(pr.values.unsqueeze(0), beam_scores.to(pr.values).unsqueeze(0), n)
    return s[0], p[0], t[0], pr.values
