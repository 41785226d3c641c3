"""Beam search spec against brute force (Hypothesis): the step, whole searches, bounds, greedy.

Random log-probability rows are a pure function of the prefix (seeded by it), with small integer
logits so that ties are common, and optional ``-inf`` masks.  Oracles are written here
independently of spec/beam.py: Python enumeration of one-step extensions, exhaustive enumeration
of all sequences up to the cap, an argmax greedy loop, and the branch hash rebuilt field by field.
"""

from __future__ import annotations

import itertools
import math

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec import beam as B
from decodespec.spec.enums import FinishReason

LANES = B.BranchLanes(constraint_init=3, constraint_step=lambda q, t: (q * 7 + t) % 11,
                      decoder_init=[], decoder_step=lambda d, t: (d + [t])[-3:])


def random_fn(seed: int, vocab: int, mask_rate: float):
    """``score_fn``: log-softmax of integer logits in [-2, 2] seeded by the prefix; some entries -inf."""
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def score_fn(prefix):
        key = tuple(int(t) for t in prefix)
        if key not in cache:
            rng = np.random.default_rng([seed, len(key), *key])
            logits = rng.integers(-2, 3, size=vocab).astype(np.float64)
            logits[rng.random(vocab) < mask_rate] = -np.inf
            finite = logits[np.isfinite(logits)]
            norm = np.log(np.exp(finite).sum()) if finite.size else 0.0
            cache[key] = logits - norm
        return cache[key]

    return score_fn


@st.composite
def searches(draw, max_vocab=4, max_len=3, widths=(1, 2, 3)):
    vocab = draw(st.integers(1, max_vocab))
    eos = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    params = B.BeamParams(
        num_beams=draw(st.sampled_from(widths)),
        max_new_tokens=draw(st.integers(1, max_len)),
        eos_ids=() if eos is None else (eos,),
        length_penalty=B.LengthPenalty(alpha=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.5, -1.0])),
                                       form=draw(st.sampled_from(list(B.PenaltyForm)))),
        early_stop=B.EarlyStop.AT_CAP,
    )
    fn = random_fn(draw(st.integers(0, 2**32 - 1)), vocab, draw(st.sampled_from([0.0, 0.25])))
    prompt = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    return params, fn, prompt, vocab


def ranked_extensions(live, rows, vocab):
    """All finite one-step extensions ``(score, slot, token, prefix)``, in the declared order."""
    ext = [(score + float(rows[k][v]), k, v, prefix + (v,))
           for k, (prefix, score) in enumerate(live) for v in range(vocab) if rows[k][v] != -math.inf]
    return sorted(ext, key=lambda e: (-e[0], e[1] * vocab + e[2]))


# ---------------------------------------------------------------------------------------------
# One step: selector.beam_topk over [B, K, V]
# ---------------------------------------------------------------------------------------------

VALUES = [0.0, -0.5, -1.0, -2.0, -math.inf]


@st.composite
def grids(draw):
    batch, rows, vocab = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    lp = np.array(draw(st.lists(st.sampled_from(VALUES), min_size=batch * rows * vocab,
                                max_size=batch * rows * vocab))).reshape(batch, rows, vocab)
    bs = np.array(draw(st.lists(st.sampled_from(VALUES), min_size=batch * rows, max_size=batch * rows))).reshape(batch, rows)
    eos = tuple(sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=2))))
    return lp, bs, draw(st.integers(1, 4)), eos


def brute_select(lp, bs, k, eos):
    out = []
    for b in range(lp.shape[0]):
        cands = sorted(((bs[b, p] + lp[b, p, v], p * lp.shape[2] + v, p, v)
                        for p in range(lp.shape[1]) for v in range(lp.shape[2])
                        if bs[b, p] + lp[b, p, v] != -math.inf), key=lambda c: (-c[0], c[1]))
        live = [(c[2], c[3], c[0]) for c in cands if c[3] not in eos][:k]
        done = [(c[2], c[3], c[0]) for c in cands[:k] if c[3] in eos]
        out.append((live, done, len(cands)))
    return out


def selection_as_tuples(select, lp, bs, k, eos):
    return [([(c.parent, c.token, c.score) for c in row.live], [(c.parent, c.token, c.score) for c in row.completed],
             row.num_finite) for row in select(lp, bs, k, eos)]


@given(grids())
def test_select_candidates_equals_brute_force(grid):
    """selector.beam_topk: kept = top K of all finite (parent, token) extensions, lowest flat index on ties."""
    lp, bs, k, eos = grid
    assert selection_as_tuples(B.select_candidates, lp, bs, k, eos) == brute_select(lp, bs, k, eos)


def _mutant_from_flat(decode):
    """A selector that ranks like the spec but decodes the flat index with ``decode(flat, K, V)``."""
    def select(lp, bs, k, eos):
        rows = B.select_candidates(lp, bs, k, eos)
        fix = lambda c: attrs.evolve(c, **dict(zip(("parent", "token"), decode(c.flat_idx, lp.shape[1], lp.shape[2]))))
        return tuple(attrs.evolve(r, live=tuple(map(fix, r.live)), completed=tuple(map(fix, r.completed))) for r in rows)
    return select


def _mutant_local_scores(lp, bs, k, eos):
    """M3.8 0x12 item 43: rank tokens by their local log-probability without the parent's score."""
    rows = B.select_candidates(lp, np.zeros_like(bs), k, eos)
    add = lambda c, b: attrs.evolve(c, score=c.score + float(bs[b, c.parent]))
    return tuple(attrs.evolve(r, live=tuple(add(c, b) for c in r.live), completed=tuple(add(c, b) for c in r.completed))
                 for b, r in enumerate(rows))


@pytest.mark.parametrize("mutant", [
    _mutant_from_flat(lambda i, K, V: (i // V, i % K)),   # M3.8 0x12 item 44: token = flat % K
    _mutant_from_flat(lambda i, K, V: (i // K, i % V)),   # parent = flat // K
    _mutant_local_scores,                                 # M3.8 0x12 item 43
], ids=["token_mod_K", "parent_div_K", "no_parent_scores"])
def test_brute_force_oracle_catches_selection_mutants(mutant):
    """The oracle of test_select_candidates_equals_brute_force fails each selection bug on a fixed grid."""
    lp = np.log(np.array([[[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]]))
    bs = np.log(np.array([[0.9, 0.1]]))
    assert selection_as_tuples(B.select_candidates, lp, bs, 2, ()) == brute_select(lp, bs, 2, ())
    assert selection_as_tuples(mutant, lp, bs, 2, ()) != brute_select(lp, bs, 2, ())


# ---------------------------------------------------------------------------------------------
# Whole searches
# ---------------------------------------------------------------------------------------------


def expected_child(params, parent, cand, slot, triggers):
    """The child's branch state rebuilt from the parent and the token, field by field (M3.10 0x05)."""
    length = parent.length + 1
    score = parent.score + cand.increment
    pen = params.length_penalty
    lp = (float(length) if pen.form is B.PenaltyForm.POWER else (5.0 + length) / 6.0) ** pen.alpha
    reason = next((r for r in (FinishReason.EOS, FinishReason.LENGTH) if r in triggers), None)
    return B.BranchState(
        request_id=parent.request_id, row=parent.row, slot=slot, step=parent.step + 1,
        prefix=parent.prefix + (cand.token,), prompt_len=parent.prompt_len, score=score, normalized=score / lp,
        length=length, cache=B.CacheRef(num_rows=len(parent.prefix), digest=B.token_digest(parent.prefix)),
        position=len(parent.prefix), constraint=(parent.constraint * 7 + cand.token) % 11, rng=parent.rng,
        decoder=(parent.decoder + [cand.token])[-3:],
        status=B.BeamStatus.COMPLETED if triggers else B.BeamStatus.LIVE, finish_reason=reason,
        triggers=tuple(triggers), ancestry=parent.ancestry + (cand.parent,), parent_hash=B.branch_hash(parent),
        policy_revision=params.revision(), consumed_step=parent.step,
    )


def checked_search(fn, prompt, params):
    """``beam_search`` with LANES; every step passes ``check_step`` and every child's I_branch equals
    the hash rebuilt from its parent's state plus its token (M3.10 0x05 I_branch)."""
    result = B.beam_search(fn, prompt, params, lanes=LANES)
    eos = set(params.eos_ids)
    for before, record, after in result.transitions():
        assert B.check_step(params, before, record, after) == ()
        at_cap = record.step + 1 == params.max_new_tokens
        for cand, child in zip(record.live_candidates + record.completed_candidates, record.children + record.completed):
            triggers = [r for r, on in ((FinishReason.EOS, cand.token in eos), (FinishReason.LENGTH, at_cap)) if on]
            want = expected_child(params, before.live[cand.parent], cand, child.slot, triggers)
            assert B.branch_hash(child) == B.branch_hash(want)
    return result


@given(searches())
def test_each_step_keeps_the_top_k_extensions_and_children_hash_from_their_parents(case):
    """transition.beam_step, invariant.beam_parent_coupling: live = top K non-terminal extensions of
    the previous live set, completions = terminal extensions ranked < K, and each child's I_branch
    equals the hash rebuilt from its parent's state plus its token, at every step."""
    params, fn, prompt, vocab = case
    result = checked_search(fn, prompt, params)
    eos = set(params.eos_ids)
    for before, record, after in result.transitions():
        live = [(b.prefix, b.score) for b in before.live]
        ranked = ranked_extensions(live, [fn(p) for p, _ in live], vocab)
        want_live = [(e[3], e[0]) for e in ranked if e[2] not in eos][: params.num_beams]
        want_done = [(e[3], e[0]) for e in ranked[: params.num_beams] if e[2] in eos]
        at_cap = record.step + 1 == params.max_new_tokens
        got_live = [(c.prefix, c.score) for c in record.children]
        got_done = [(c.prefix, c.score) for c in record.completed if c.finish_reason is FinishReason.EOS]
        assert (got_live if not at_cap else []) == (want_live if not at_cap else [])
        assert got_done == want_done
        if at_cap:
            assert sorted((c.prefix, c.score) for c in record.completed if c.finish_reason is FinishReason.LENGTH) \
                == sorted(want_live)


def all_complete_sequences(fn, prompt, params, vocab):
    """Every finite complete output: EOS-terminated of length <= G, or of length G; score sums left to right."""
    eos = set(params.eos_ids)
    out = {}
    for n in range(1, params.max_new_tokens + 1):
        for ys in itertools.product(range(vocab), repeat=n):
            if any(y in eos for y in ys[:-1]) or (ys[-1] not in eos and n < params.max_new_tokens):
                continue
            score = 0.0
            for i, y in enumerate(ys):
                score = score + float(fn(prompt + ys[:i])[y])
            if score != -math.inf:
                out[ys] = score
    return out


@given(searches(max_vocab=3, max_len=3, widths=(1,)))
def test_full_width_beam_search_equals_exhaustive_search(case):
    """selector.beam_topk with K = V**G prunes nothing: completed set = every complete sequence, and
    the best normalized score is the exhaustive maximum (at_cap and exact termination alike)."""
    params, fn, prompt, vocab = case
    params = attrs.evolve(params, num_beams=vocab ** params.max_new_tokens)
    every = all_complete_sequences(fn, prompt, params, vocab)
    result = checked_search(fn, prompt, params)
    assert {h.output_ids: h.score for h in result.hypotheses} == every
    if every:
        best = max(params.length_penalty.normalize(s, len(ys)) for ys, s in every.items())
        assert result.best.normalized == best
        exact = checked_search(fn, prompt, attrs.evolve(params, early_stop="exact"))
        assert (exact.best.output_ids, exact.best.score) == (result.best.output_ids, result.best.score)
    else:
        assert result.best is None


def _top(result, n):
    return [(h.output_ids, h.score) for h in result.hypotheses[:n]]


@given(searches(max_vocab=4, max_len=4), st.integers(1, 3))
def test_exact_termination_equals_running_to_the_cap(case, n):
    """transition.beam_stop (exact): stopping with the admissible bound never changes the top-n
    completed hypotheses of the finite-beam trace (M3.10 0x05; M3.8 0x12 item 47)."""
    params, fn, prompt, _ = case
    at_cap = checked_search(fn, prompt, params)
    exact = checked_search(fn, prompt, attrs.evolve(params, early_stop="exact", num_completed=n))
    assert _top(exact, n) == _top(at_cap, n)
    assert len(exact.steps) <= len(at_cap.steps)


@given(searches(max_vocab=4, max_len=4))
def test_hf_never_and_nonpositive_alpha_heuristic_are_admissible(case):
    """transition.beam_stop: HF 'never' (any alpha) and HF False (alpha <= 0) keep the top-K of the trace."""
    params, fn, prompt, _ = case
    at_cap = checked_search(fn, prompt, params)
    k = params.num_beams
    kinds = ["never"] + (["heuristic"] if params.length_penalty.alpha <= 0 else [])
    for kind in kinds:
        stopped = checked_search(fn, prompt, attrs.evolve(params, early_stop=kind))
        assert _top(stopped, k) == _top(at_cap, k), kind


def greedy(fn, prompt, max_new_tokens, eos):
    """Argmax decoding (lowest id on ties): ``(tokens, cumulative logprob)`` or ``None`` at a dead end."""
    prefix, tokens, total = tuple(prompt), [], 0.0
    for _ in range(max_new_tokens):
        row = fn(prefix)
        t = int(np.argmax(row))
        if row[t] == -math.inf:
            return None
        total = total + float(row[t])
        tokens.append(t)
        prefix = prefix + (t,)
        if t in eos:
            break
    return tuple(tokens), total


@given(searches(max_vocab=4, max_len=4, widths=(1,)),
       st.sampled_from(["fixed_count", "heuristic", "never", "exact", "at_cap"]))
def test_width_one_equals_greedy(case, kind):
    """selector.beam_topk with K = 1 and alpha = 0 is greedy: same tokens, bit-identical cumulative logprob."""
    params, fn, prompt, _ = case
    params = attrs.evolve(params, length_penalty=B.LengthPenalty(), early_stop=kind)
    result = checked_search(fn, prompt, params)
    want = greedy(fn, prompt, params.max_new_tokens, set(params.eos_ids))
    if want is None:  # greedy reaches a row of -inf: with K = 1 nothing completed before it either
        assert result.best is None and result.stop is B.BeamStop.NO_LIVE
        return
    assert (result.best.output_ids, result.best.score) == want
