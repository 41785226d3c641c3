"""Checks of the beam runtime (impl/beam.py) that kill Cosmic Ray's survivors.

The screen of a sampled Cosmic Ray session over ``impl/beam.py`` (tests/test_beam_runtime.py,
tests/test_timeout_budget.py, tests/test_beam_runtime_cli.py on the tiny model;
docs/results/mutation-sampled-cache-beam-batch.md) left some mutants alive: a search of one
step, a vocabulary smaller than HF's candidate window, HF's ``never`` stop with a negative length
penalty, the frontier of a result.  Each check here replays the spec (``decodespec.spec.beam``)
over the runtime's rows or asserts a value derived by hand, and its docstring names the mutants it
kills (line, operator, occurrence, of ``impl/beam.py`` at commit 61ec8ad).

Rules: transition.beam_step, selector.beam_topk, transition.beam_stop (M3.8 0x0F; M3.10 0x05).
"""

from __future__ import annotations

import attrs
import pytest
from test_beam_runtime import EOS, PROMPT, beam_request, replay_against_spec  # tests/ is on sys.path

from decodespec.impl.beam import BeamRunner
from decodespec.impl.events import ListSink
from decodespec.impl.tiny import load_tiny, tiny_config
from decodespec.spec import beam as B
from decodespec.spec.errors import Rejection, ResourceLimit


def _run(model, params: B.BeamParams, **kw) -> BeamRunner:
    runner = BeamRunner(model, beam_request(params, **kw), params, record=True).run()
    replay_against_spec(runner)
    return runner


def test_a_search_of_one_token_runs_and_closes_at_the_cap(tiny_model):
    """G = 1 is a valid beam request: one call, one decision, K hypotheses closed by ``length``.

    Kills line 685 ``max_new_tokens < 1`` -> ``<= 1`` (Lt_LtE 6).
    """
    params = B.BeamParams(3, 1, [EOS], early_stop="at_cap")
    result = _run(tiny_model, params).result()
    assert result.num_calls == 1 and len(result.steps) == 1
    assert result.stop is B.BeamStop.LENGTH_CAP
    assert all(h.length == 1 for h in result.hypotheses) and len(result.hypotheses) >= 3


def test_a_result_reports_the_best_hypothesis_frontier(tiny_model):
    """``BeamSearchResult.frontier``: L, O = the best length, one pending (its last token), P = L + O - 1.

    Kills line 209 ``1 if out else 0`` -> ``1 if not out else 0`` (AddNot 1), line 210 ``prompt_len + out - 1``
    -> ``out // 1`` (Sub_FloorDiv 0), and line 227 ``[] if best is None`` -> ``is not None`` (Is_IsNot 7, the
    JSON body's ``triggers``).
    """
    params = B.BeamParams(2, 4, [EOS], early_stop="at_cap")
    result = _run(tiny_model, params).result()
    out = result.best.length
    assert out >= 1
    assert result.frontier() == {"prompt_len": len(PROMPT), "output_count": out, "pending": 1,
                                 "processed": len(PROMPT) + out - 1, "pending_tag": "closed_unprocessed"}
    body = result.to_json()
    assert body["frontier"] == result.frontier()
    assert body["triggers"] == [t.value for t in result.best.triggers] != []
    assert body["finish_reason"] == result.best.finish_reason.value
    empty = attrs.evolve(result, hypotheses=(), best=None)
    assert empty.frontier() == {"prompt_len": len(PROMPT), "output_count": 0, "pending": 0, "processed": len(PROMPT),
                                "pending_tag": "empty"}


def test_a_vocabulary_smaller_than_the_candidate_window_ranks_every_candidate():
    """A 4-token model with K = 3 and one EOS: HF's window (2K = 6) exceeds the ``n V = 4`` candidates of the
    first step, so the selector ranks all 4 (``min(n V, window)``); the spec replayed over the rows agrees.

    Kills line 499 ``min(n * vocab, window)`` -> ``n << vocab`` (Mul_LShift 3: ``1 << 4 = 16`` asks ``topk``
    for 6 of 4).
    """
    model = load_tiny(seed=0, device="cpu", config=attrs.evolve(tiny_config(), vocab_size=4))
    params = B.BeamParams(3, 3, [3], early_stop="at_cap")
    runner = _run(model, params, prompt=(1, 2))
    row = runner.log[0].rows[0].tolist()  # the root's processed row, [4]
    ranked = sorted(range(4), key=lambda v: -row[v])  # every id of the vocabulary, best first
    first = runner.events[0]
    assert first["tokens"] == [v for v in ranked if v != 3]  # the three non-EOS ids, all children of the root
    assert [(c["token"], c["rank"]) for c in first["completed"]] == [(3, ranked.index(3))]  # EOS ranks < K here
    assert runner.result().stop is B.BeamStop.LENGTH_CAP


def test_hfs_never_with_a_negative_length_penalty_bounds_a_live_beam_at_its_own_length(tiny_model):
    """HF ``early_stopping="never"`` bounds a live beam at ``G`` only when ``alpha > 0``; with ``alpha = -0.5`` it
    uses the beam's current length, so this search (K = 2, EOS 70, G = 12) runs to the cap; the spec replayed
    over the runtime's rows agrees.  (Bounding at G would stop it early at step 10.)

    Kills line 609 ``pen.alpha > 0`` -> ``!= 0`` (Gt_NotEq 3; with ``alpha = 0`` both are ``lp = 1``).
    """
    params = B.BeamParams.hf_compatible(2, 12, [70], length_penalty=-0.5, early_stopping="never")
    result = _run(tiny_model, params).result()
    assert result.stop is B.BeamStop.LENGTH_CAP and len(result.steps) == 12


def test_a_search_without_eos_runs_to_the_cap(tiny_model):
    """No EOS id: HF's candidate window is ``max(2, 1 + 0) K = 2K``; every hypothesis closes by ``length``.

    Kills line 492 ``1 + len(params.eos_ids)`` -> ``1 // len(...)`` (Add_FloorDiv 9: division by zero).
    """
    params = B.BeamParams(2, 3, [], early_stop="at_cap")
    result = _run(tiny_model, params).result()
    assert result.stop is B.BeamStop.LENGTH_CAP and {h.finish_reason.value for h in result.hypotheses} == {"length"}


def test_a_static_capacity_that_fits_leaves_the_refusal_to_the_context_cap(tiny_model):
    """L + G over the envelope's context cap with a static capacity that does fit: ``model.context_window_exceeded``
    (the capacity is not what is short).

    Kills line 348 ``self.capacity < need`` -> ``is not need`` (Lt_IsNot 0).
    """
    params = B.BeamParams(2, 8, [EOS])
    with pytest.raises(ResourceLimit) as err:
        BeamRunner(tiny_model, beam_request(params, cache="static", static_capacity=len(PROMPT) + 20,
                                            context_cap=len(PROMPT) + 7), params)
    assert err.value.code == "model.context_window_exceeded"


@pytest.mark.parametrize(("cache", "chunk"), [("dynamic", None), ("static", 2)])
def test_the_cache_generation_counts_the_calls(tiny_model, cache, chunk):
    """The beam runner's cache ledger starts at generation 0 and each call (a prefill chunk or a decode call)
    commits the next one: after the search the cache's generation equals the number of model calls.

    Kills line 367 ``self.generation = 0`` -> ``1`` (NumberReplacer 24).
    """
    params = B.BeamParams(2, 4, [EOS], early_stop="at_cap")
    runner = _run(tiny_model, params, cache=cache, prefill_chunk=chunk)
    assert runner.cache.generation == runner.num_calls == runner.generation
    assert runner.num_calls == 4 + (0 if chunk is None else (len(PROMPT) + 1) // 2 - 1)


def test_a_finished_search_refuses_admit_and_call_by_their_own_names(tiny_model):
    """``admit`` is enabled only in phase ``new``: after the search (phase ``done``) it is ``beam.not_enabled``.

    A ``call`` after the end is refused as a ``call`` (not as an ``admit`` it would first try).

    Kills line 406 ``self.phase == "new"`` -> ``<= "new"`` (Eq_LtE 2: ``"done" < "new"``) and line 431's
    (``call``) ``self.phase == "new"`` -> ``<= "new"`` (Eq_LtE 3).
    """
    params = B.BeamParams(2, 2, [EOS], early_stop="at_cap")
    runner = _run(tiny_model, params)
    for action in ("admit", "call"):
        with pytest.raises(Rejection) as err:
            getattr(runner, action)()
        assert err.value.code == "beam.not_enabled" and err.value.details == {"action": action, "phase": "done"}


def test_a_search_past_256_tokens_stops_at_the_cap(tiny_model):
    """G = 300 (past CPython's small-int cache): the width-1 search without EOS stops at the cap after 300 steps.

    Kills line 510 ``step + 1 >= params.max_new_tokens`` -> ``is`` (GtE_Is 1: equal ints above 256 are
    distinct objects, so the cap never fires).
    """
    params = B.BeamParams(1, 300, [], early_stop="at_cap")
    result = BeamRunner(tiny_model, beam_request(params), params).run().result()
    assert result.stop is B.BeamStop.LENGTH_CAP and len(result.steps) == 300 and result.best.length == 300


@pytest.mark.parametrize(("cache", "lanes"), [("dynamic", ["self_kv"]), ("static", ["self_kv"]), ("none", [])])
def test_the_trace_header_names_the_cached_lane(tiny_model, cache, lanes):
    """The ``request`` record's ``lanes``: ``["self_kv"]`` for a cached family, none without a cache.

    Kills line 412 ``["self_kv"] if r.cached else []`` -> ``if not r.cached`` (AddNot 20).
    """
    sink = ListSink()
    params = B.BeamParams(2, 2, [EOS], early_stop="at_cap")
    BeamRunner(tiny_model, beam_request(params, cache=cache), params, sink=sink).run()
    assert sink.records[0]["event"] == "request" and sink.records[0]["lanes"] == lanes


def test_the_exact_bound_with_a_negative_length_penalty_looks_one_token_ahead(tiny_model):
    """The exact stop with ``alpha <= 0``: the best completion of a live prefix of length g is at length g + 1 at the
    earliest, so the bound is ``score / lp(g + 1)``.  Here (K = 3, alpha = -1, EOS 35) it lets the search stop after
    3 steps; the spec replayed over the runtime's rows agrees.  (``lp(g)`` would keep it one more step.)

    Kills line 606 ``g + 1`` -> ``g // 1`` (Add_FloorDiv 17).
    """
    params = B.BeamParams(3, 12, [35], length_penalty=B.LengthPenalty(-1.0), early_stop="exact")
    result = _run(tiny_model, params, prompt=(1, 50, 60)).result()
    assert result.stop is B.BeamStop.EARLY_STOP and len(result.steps) == 3


class _IdText:
    """A tokenizer whose text is the ids themselves (``decode([5, 6]) == "5,6"``): every dropped id shows."""

    def decode(self, ids):
        return ",".join(str(i) for i in ids)


def test_a_hypothesis_text_leaves_out_only_a_final_eos(tiny_model):
    """Each hypothesis' ``text``: its ids without the last one when that is EOS, all of them otherwise.

    Kills line 585 ``b.tokens[-1] in eos_ids`` -> ``b.tokens[-0]`` (NumberReplacer 63) and ``b.tokens[:-1]`` ->
    ``b.tokens[:-2]`` (NumberReplacer 60).
    """
    params = B.BeamParams(3, 9, [EOS], early_stop="at_cap")
    result = BeamRunner(tiny_model, beam_request(params), params, tokenizer=_IdText()).run().result()
    ends = {h.output_ids[-1] == EOS for h in result.hypotheses}
    assert ends == {True, False} and all(h.output_ids[0] != EOS for h in result.hypotheses)
    for h in result.hypotheses:
        kept = h.output_ids[:-1] if h.output_ids[-1] == EOS else h.output_ids
        assert h.text == ",".join(str(i) for i in kept)


def _allowing(tokens) -> list[dict]:
    """A one-state constraint automaton whose legal ids are ``tokens`` (every other id is ``-inf``)."""
    return [{"name": "constraint", "automaton": {"initial": "a", "transitions": {"a": {str(t): "a" for t in tokens}}}}]


@pytest.mark.parametrize(("k", "eos", "window"), [(2, [EOS], 4), (2, [EOS, 70], 6), (3, [EOS, 70], 9),
                                                      (2, [EOS, 70, 35], 8)])
def test_hfs_candidate_window_is_one_plus_the_eos_count_times_k(tiny_model, k, eos, window):
    """Under HF's parameters the first step needs ``max(2, 1 + |eos|) K`` finite candidates: a constraint that leaves
    exactly that many is decided (K children or completions), one fewer is ``beam.outside_hf_envelope``.

    Kills line 492 ``1 + len(eos)`` -> ``1 * len(eos)`` (Add_Mul 9), ``1 << len(eos)`` (Add_LShift 9), ``1 | len(eos)``
    (Add_BitOr 9: three EOS ids), and
    ``max(...) * num_beams`` -> ``<< num_beams`` (Mul_LShift 2).
    """
    params = B.BeamParams.hf_compatible(k, 4, eos)
    others = [t for t in (35, 101, 108, 111, 72, 3, 50, 60, 44) if t not in eos]
    for finite, decided in ((window, True), (window - 1, False)):
        legal = eos + others[: finite - len(eos)]
        assert len(legal) == finite
        runner = BeamRunner(tiny_model, beam_request(params, transforms=_allowing(legal)), params)
        runner.call()
        if decided:
            event = runner.decide()
            assert len(event["tokens"]) + len(event["completed"]) >= k
        else:
            with pytest.raises(Rejection) as err:
                runner.decide()
            assert err.value.code == "beam.outside_hf_envelope"


def test_the_finish_record_carries_the_best_hypothesis_triggers(tiny_model):
    """The trace's ``finish`` record: the best hypothesis' finish reason and triggers (never empty for a best).

    Kills line 629 ``[] if best is None`` -> ``if not best is None`` (AddNot 55).
    """
    sink = ListSink()
    params = B.BeamParams(2, 4, [EOS], early_stop="at_cap")
    best = BeamRunner(tiny_model, beam_request(params), params, sink=sink).run().result().best
    finish = sink.records[-1]
    assert finish["event"] == "finish" and finish["finish_reason"] == best.finish_reason.value
    assert finish["triggers"] == [t.value for t in best.triggers] != []
