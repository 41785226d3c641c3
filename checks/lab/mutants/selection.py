"""Failure lab, score and selection group: the policy twin (impl/policy.py) transforms or selects wrongly.

Every seam here is in the runtime's M3.8 twin; the gate's POLICY layer compares the runtime's
processed support and probabilities with the spec policy's on the runtime's own raw row, the
DECISION layer compares the selected ids, and the STATE layer the RNG counter.

Source: M3.10 0x0B "Score and selection bugs"; M3.8 0x12 items 10, 13, 22, 35, 36, 38, 39, 40,
41, 42.
"""

from __future__ import annotations

from . import Patch, mutant

_G = "score and selection"
_PROCESS = "decodespec.impl.policy:process_scores"
_SOFTMAX = 'z, kind, normalization = torch.softmax(z, dim=-1), ScoreKind.PROBS, "softmax"'


def _normalization(new: str) -> Patch:
    """Replace the multinomial selector's normalization (processed logits -> probabilities) by ``new``."""
    return Patch(_PROCESS, edits=[(_SOFTMAX, f'z, kind, normalization = {new}, ScoreKind.PROBS, "softmax"')])


@mutant(
    "argmax_over_time", group=_G, representative=True,
    title="Argmax over the row/time axis instead of the vocabulary",
    section="M3.10 0x0B Score and selection bugs (argmax over time instead of vocabulary); M3.8 0x12 item 22",
    statement="impl/policy.py greedy_select takes the maximum over dim=0 (the rows / time positions) instead of "
    "dim=-1: with one row every entry equals its own column maximum, so the returned index is a position (0), not "
    "the vocabulary argmax. The result keeps shape [B]; DECISION fails (the reference margin rules the id out).",
)
def _argmax_over_time():
    return [Patch("decodespec.impl.policy:greedy_select", edits=[(
        "at_max = values == values.amax(dim=-1, keepdim=True)", "at_max = values == values.amax(dim=0, keepdim=True)")])]


@mutant(
    "multinomial_over_logits", group=_G,
    title="Multinomial over raw logits",
    section="M3.10 0x0B Score and selection bugs (multinomial over logits); M3.8 0x12 items 13 and 35",
    statement="impl/policy.py process_scores hands the processed logits to the inverse-CDF sampler as weights "
    "(negative logits clamped to zero so that the sampler accepts them) instead of softmax probabilities: the draw "
    "follows a distribution linear in the logits. Same [B, V] shape; POLICY fails (processed probabilities).",
)
def _multinomial_over_logits():
    return [_normalization("torch.where(torch.isfinite(z), z, 0.0).clamp(min=0.0)")]


@mutant(
    "multinomial_over_logprobs", group=_G,
    title="Log-probabilities used as multinomial weights",
    section="M3.10 0x0B Score and selection bugs (passing log-probs directly as multinomial weights); M3.8 0x12 item 13",
    statement="impl/policy.py process_scores passes log-softmax values as sampling weights, sign-flipped so that the "
    "sampler accepts them (-log p >= 0): the least likely supported token gets the largest weight. Same shape; POLICY "
    "fails (processed probabilities) and the draws pick other tokens.",
)
def _multinomial_over_logprobs():
    return [_normalization("torch.where(torch.isfinite(z), -torch.log_softmax(z, dim=-1), 0.0)")]


@mutant(
    "softmax_twice", group=_G,
    title="Softmax applied to probabilities again",
    section="M3.8 0x12 item 10 (applying softmax to probabilities again); M3.10 0x0B Score and selection bugs",
    statement="impl/policy.py process_scores normalizes softmax(softmax(z)): the second softmax flattens the "
    "distribution and gives every masked id (probability 0) the weight exp(0). Same shape; POLICY fails "
    "(processed probabilities of the support).",
)
def _softmax_twice():
    return [_normalization("torch.softmax(torch.softmax(z, dim=-1), dim=-1)")]


@mutant(
    "top_p_over_logits", group=_G,
    title="Top-p cumulative sum over logits",
    section="M3.10 0x0B Score and selection bugs (top-p over logits)",
    statement="impl/policy.py top_p accumulates the sorted logits instead of softmax probabilities: cumulative sums "
    "of logits are not probability mass, so the nucleus keeps a wrong number of ids. POLICY fails (processed "
    "support ids).",
)
def _top_p_over_logits():
    return [Patch("decodespec.impl.policy:_TRANSFORMS[top_p]", edits=[("probs = torch.softmax(z, dim=-1)", "probs = z")])]


@mutant(
    "top_p_no_gather", group=_G,
    title="Top-p keep mask not gathered back through the sort permutation",
    section="M3.10 0x0B Score and selection bugs (top-p without gather back through sorted indices); M3.8 0x12 item 39",
    statement="impl/policy.py _prefix_keep scatters the keep mask over sorted positions back through the identity "
    "instead of the sort permutation: sorted position j is taken as vocabulary id j, so the nucleus is the lowest "
    "ids. POLICY fails (support ids), or the support empties and the runtime refuses a decision the spec accepts.",
)
def _top_p_no_gather():
    return [Patch("decodespec.impl.policy:_prefix_keep", edits=[(
        "return _scatter_keep(keep_sorted, order, probs.shape[-1])",
        "return _scatter_keep(keep_sorted, torch.arange(order.shape[-1], device=order.device).expand_as(order), probs.shape[-1])")])]


@mutant(
    "top_p_drops_crossing_token", group=_G,
    title="Top-p drops the threshold-crossing token",
    section="M3.8 0x12 item 38 (dropping the top-p threshold-crossing token)",
    statement="impl/policy.py _prefix_keep keeps an id only when the mass up to and including it is below p "
    "(cumsum < p) instead of the mass before it: the crossing token is dropped and the support's mass falls below p. "
    "POLICY fails (support ids).",
)
def _top_p_drops_crossing_token():
    return [Patch("decodespec.impl.policy:_prefix_keep", edits=[(
        "keep_sorted = (before < mass) & (sorted_p > 0)", "keep_sorted = (before + sorted_p < mass) & (sorted_p > 0)")])]


@mutant(
    "temperature_zero_division", group=_G,
    title="Temperature 0 as a division by a tiny temperature",
    section="M3.8 0x12 item 36 (dividing by temperature=0); docs/design.md declared choice (temperature 0 is the greedy branch)",
    statement="impl/policy.py drops the temperature-0 greedy branch and divides by max(T, 1e-6) instead (the usual "
    "'avoid the division by zero' fix): the row becomes nearly one-hot but the multinomial selector still draws, so "
    "the decision consumes an RNG draw the declared greedy branch never takes. POLICY fails (draws) or STATE (RNG "
    "counter).",
)
def _temperature_zero_division():
    return [
        Patch(_PROCESS, edits=[('if t.name == "temperature" and t.get("temperature") == 0.0:', "if False:")]),
        Patch("decodespec.impl.policy:_TRANSFORMS[temperature]", edits=[("return z / t", "return z / max(t, 1e-6)"),
                                                                         ("assert t > 0,", "assert t >= 0,")]),
    ]


@mutant(
    "repetition_penalty_sign_blind", group=_G,
    title="Repetition penalty divides negative logits too",
    section="M3.8 0x12 item 41 (applying one repetition formula to positive and negative logits)",
    statement="impl/policy.py repetition_penalty divides every seen id's logit by the penalty: a negative logit moves "
    "toward zero and its probability rises instead of falling. POLICY fails (processed probabilities) on a row where "
    "a seen id has a negative logit.",
)
def _repetition_penalty_sign_blind():
    return [Patch("decodespec.impl.policy:_TRANSFORMS[repetition_penalty]", edits=[(
        "penalized = torch.where(z > 0, z / r, z * r)", "penalized = z / r")])]


@mutant(
    "top_k_keeps_ties", group=_G,
    title="Top-k keeps every id tied at the k-th value",
    section="M3.8 0x12 item 40 (threshold top-k keeps more than k under ties); docs/design.md (exact-k, ties to lower ids)",
    statement="impl/policy.py top_k keeps every id whose value equals the k-th largest (threshold top-k) instead of "
    "exactly k with ties going to the lower ids: observable only on a row with ties at the k-th value, where the "
    "support has more than k ids. POLICY fails (support ids).",
)
def _top_k_keeps_ties():
    return [Patch("decodespec.impl.policy:_TRANSFORMS[top_k]", edits=[(
        "keep = above | (at & (torch.cumsum(at.to(torch.int64), dim=-1) <= room))", "keep = above | at")])]


@mutant(
    "empty_support_undeclared_fallback", group=_G,
    title="An empty support falls back to EOS although the policy declares a refusal",
    section="M3.8 0x12 item 42 (masking every token to negative infinity: raise or provide an explicit legal fallback)",
    statement="impl/policy.py _apply_fallback forces an EOS id whenever the support is empty, ignoring the policy's "
    "declared empty_support = raise and whether a legality transform banned that EOS: the runtime emits a token "
    "where the spec finishes the request with constraint_error (policy.empty_support, M3.10 0x02 branch table). STATE "
    "fails (phase: the spec is finished, the runtime decided).",
)
def _empty_support_undeclared_fallback():
    return [Patch("decodespec.impl.policy:_apply_fallback", edits=[(
        "eos = [] if config.empty_support is EmptySupport.RAISE else sorted(e for e in set(views[b].eos_ids) if bool(torch.isfinite(legal[b, e])))",
        "eos = sorted(views[b].eos_ids)")])]
