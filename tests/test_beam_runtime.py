"""Beam runtime (impl/beam.py) on the tiny model: the spec replayed over the runtime's own rows.

The spec (``decodespec.spec.beam``) is the oracle: every test that runs a search drives
``initial_state`` / ``beam_call`` / ``beam_step`` with the processed score rows the runtime decided
on (``BeamRunner(record=True)``) and requires the same decisions (the ``beam_step`` events), the
same exported branch states (every lane of ``B = (X, S, L, C, P, Q, R, D, F, Pi, W)``), the step
invariants, and, for every child at every step, ``branch_hash(child) == branch_hash(fork of its
exported parent + its token)``.  Cache tensors are checked directly for fork-before-append, and a
deliberately un-reordered cache must change the answer.

:func:`replay_against_spec` is shared with ``test_beam_runtime_smollm2.py`` and ``test_beam_hf.py``.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.impl.beam import BEAM_UNSUPPORTED, BeamRunner, beam_generate, top_flat_candidates
from decodespec.impl.cache import DynamicCache, StaticCache
from decodespec.impl.events import BEAM_STEP_FIELDS, ListSink
from decodespec.impl.generate import generate
from decodespec.impl.policy import select_beam_candidates
from decodespec.impl.runtime import RuntimeRequest
from decodespec.spec import beam as B
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection, ResourceLimit
from decodespec.spec.policy.config import policy_config_from_json

PROMPT = (1, 72, 101, 108, 108, 111)
EOS = 79  # a token the tiny model likes, so hypotheses complete on EOS


# --------------------------------------------------------------------------------------------
# The replay (shared).
# --------------------------------------------------------------------------------------------


def check_branch_hashes(params: B.BeamParams, log, lanes: B.BranchLanes | None = None) -> int:
    """Every child of one step (live and completed): its hash equals the hash of the spec's fork of
    its exported parent plus its token, and its parent checksum is the parent's hash.  Returns the
    number of children checked."""
    lanes = lanes or B.BranchLanes()
    checked = 0
    for child in log.children + log.completed:
        slot = child.ancestry[-1]
        parent = log.expanded[slot]
        token = child.prefix[-1]
        expected = B.fork_child(params, parent, parent_slot=slot, slot=child.slot, token=token,
                                increment=float(log.rows[slot, token]), triggers=child.triggers, lanes=lanes)
        assert child.parent_hash == B.branch_hash(parent)
        assert B.branch_hash(child) == B.branch_hash(expected), (child, expected)
        checked += 1
    return checked


def replay_against_spec(runner: BeamRunner, lanes: B.BranchLanes | None = None) -> B.BeamState:
    """Drive the spec over ``runner.log`` (a finished ``record=True`` runner) and compare everything.

    transition.beam_call, transition.beam_step, selector.beam_topk, transition.beam_fork,
    transition.beam_stop, invariant.beam_parent_coupling, invariant.beam_fork_before_append,
    invariant.beam_completed_never_expanded, invariant.beam_first_step_single_parent,
    invariant.beam_live_frontier, invariant.beam_completed_metadata.
    """
    params = runner.params
    state = B.initial_state(params, runner.request.prompt_ids, request_id=runner.request.identity, lanes=lanes)
    assert runner.done and len(runner.log) == len(runner.events) >= 1
    for t, log in enumerate(runner.log):
        state = B.beam_call(params, state)
        assert state.live == log.expanded, f"step {t}: the runtime's parents after their call differ from the spec's"
        before = state
        state, record = B.beam_step(params, state, log.rows.double().numpy())
        assert record.to_event() == runner.events[t], f"step {t}: beam_step decisions differ"
        assert tuple(runner.events[t]) == BEAM_STEP_FIELDS
        assert state.live == log.children and record.completed == log.completed, f"step {t}: exported lanes differ"
        assert tuple(c.parent for c in record.live_candidates) == log.parents
        assert B.check_step(params, before, record, state) == ()
        assert check_branch_hashes(params, log, lanes) == len(log.children) + len(log.completed)
    assert state.phase is B.BeamPhase.DONE and state.stop is runner.stop
    result = runner.result()
    assert tuple(h.branch for h in result.hypotheses) == state.completed
    return state


# --------------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------------


def beam_request(params: B.BeamParams, *, cache: str = "dynamic", transforms=(), prompt=PROMPT, **kw) -> RuntimeRequest:
    policy = policy_config_from_json({"family": "beam", "num_beams": params.num_beams, "transforms": list(transforms)})
    return RuntimeRequest(identity="sha256:" + "ab" * 32, prompt_ids=prompt, max_new_tokens=params.max_new_tokens,
                          policy=policy, eos_ids=frozenset(params.eos_ids), cache=cache, **kw)


def run(model, params: B.BeamParams, *, lanes: B.BranchLanes | None = None, sink=None, **kw) -> BeamRunner:
    """A finished recorded search, already replayed by the spec (every step, every branch hash)."""
    runner = BeamRunner(model, beam_request(params, **kw), params, record=True, sink=sink).run()
    replay_against_spec(runner, lanes)
    return runner


HF_FALSE = B.BeamParams.hf_compatible(3, 9, [EOS], length_penalty=1.0, early_stopping=False)
HF_TRUE = B.BeamParams.hf_compatible(2, 9, [EOS], length_penalty=0.0, early_stopping=True)
HF_NEVER = B.BeamParams.hf_compatible(4, 9, [EOS, 70], length_penalty=2.0, early_stopping="never")
EXACT = B.BeamParams(3, 9, [EOS], length_penalty=B.LengthPenalty(1.0), early_stop="exact")
EXACT_GNMT = B.BeamParams(3, 9, [EOS], length_penalty=B.LengthPenalty(0.6, "gnmt"), early_stop="exact")
EXACT_NEG = B.BeamParams(2, 9, [EOS], length_penalty=B.LengthPenalty(-0.5), early_stop="exact")
AT_CAP = B.BeamParams(3, 9, [EOS], early_stop="at_cap")
PARAMS = {"hf_false": HF_FALSE, "hf_true": HF_TRUE, "hf_never_two_eos": HF_NEVER, "exact": EXACT,
          "exact_gnmt": EXACT_GNMT, "exact_negative_alpha": EXACT_NEG, "at_cap": AT_CAP}


# --------------------------------------------------------------------------------------------
# The selector.
# --------------------------------------------------------------------------------------------


@given(st.data())
def test_top_flat_candidates_is_the_policy_twins_stable_order(data):
    """selector.beam_topk: the threshold-then-stable-sort selection equals the policy twin's full
    stable sort (ties to the lowest flat index), including ties at the N-th value and -inf."""
    n = data.draw(st.integers(1, 4))
    vocab = data.draw(st.integers(1, 7))
    values = st.sampled_from([0.0, -0.5, -1.0, -2.0, float("-inf")])
    rows = torch.tensor(data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=n, max_size=n)),
                        dtype=torch.float64)
    scores = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, -0.5, -1.5]), min_size=n, max_size=n)), dtype=torch.float64)
    num = data.draw(st.integers(1, n * vocab))
    _, parents, tokens = select_beam_candidates(rows[None], scores[None], num)
    assert top_flat_candidates(scores, rows, num).tolist() == (parents[0] * vocab + tokens[0]).tolist()


# --------------------------------------------------------------------------------------------
# The spec replayed over the runtime's rows.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_runtime_decisions_and_lanes_equal_the_spec_replayed_over_its_rows(tiny_model, name, cache):
    """transition.beam_step, selector.beam_topk, transition.beam_fork, transition.beam_stop,
    transform.beam_length_penalty: for HF's three settings, the exact bound (power, GNMT, alpha < 0)
    and at_cap, every cache family makes the spec's decisions over its own rows, with equal lanes."""
    runner = run(tiny_model, PARAMS[name], cache=cache)
    state = replay_against_spec(runner)  # (run() replays too; the final state is used below)
    assert any(h.finish_reason is FinishReason.EOS for h in runner.result().hypotheses), "no EOS completion exercised"
    if PARAMS[name].completed_capacity is not None:
        assert len(state.completed) <= PARAMS[name].completed_capacity


def test_parents_cross_and_a_parent_with_two_children_forks_before_append(tiny_model):
    """invariant.beam_fork_before_append at the tensor level: after the reorder, child row r of every
    cache layer equals its parent's row before the decision (siblings share it), the child's token
    is not yet cached, and the parent map is the one the events name."""
    for family in ("dynamic", "static"):
        runner = BeamRunner(tiny_model, beam_request(AT_CAP, cache=family), AT_CAP, record=True)
        crossed = shared = 0
        while not runner.done:
            runner.call()
            before = [(k.clone(), v.clone()) for k, v in zip(runner.cache.key_cache, runner.cache.value_cache)]
            committed = runner.cache.committed_length
            event = runner.decide()
            assert check_branch_hashes(AT_CAP, runner.log[-1]) == len(event["parents"]) + len(event["completed"])
            if runner.done:
                break
            parents = event["parents"]
            crossed += parents != sorted(parents)
            shared += len(set(parents)) < len(parents)
            assert runner.cache.committed_length == committed == len(runner.request.prompt_ids) + event["step"]
            assert runner.cache.batch_size == len(parents)
            for layer, (k_before, v_before) in enumerate(before):
                k_after, v_after = runner.cache.key_cache[layer], runner.cache.value_cache[layer]
                for row, parent in enumerate(parents):
                    assert torch.equal(k_after[row, :, :committed], k_before[parent, :, :committed])
                    assert torch.equal(v_after[row, :, :committed], v_before[parent, :, :committed])
            for child, parent in zip(runner.live_branches(), parents):
                assert child.cache.num_rows == child.position == committed and child.pending == (child.prefix[-1],)
        assert crossed and shared, "the search never crossed parents or forked one parent twice"
        replay_against_spec(runner)


@pytest.mark.parametrize("family", ["dynamic", "static"])
def test_an_unreordered_cache_changes_the_answer(tiny_model, monkeypatch, family):
    """invariant.beam_parent_coupling: a cache that keeps its rows in place (only resized) while the
    lanes follow the parent map gives another answer, so the equality tests can fail."""
    good = run(tiny_model, AT_CAP, cache=family).result()
    assert any(e["parents"] != list(range(len(e["parents"]))) for e in good.steps[1:]), "no reorder to get wrong"
    cls = DynamicCache if family == "dynamic" else StaticCache
    original = cls.reorder_cache

    def in_place(self, beam_idx):
        rows = len(beam_idx)
        original(self, [min(r, self.batch_size - 1) for r in range(rows)])

    monkeypatch.setattr(cls, "reorder_cache", in_place)
    bad = run(tiny_model, AT_CAP, cache=family).result()
    assert [(h.output_ids, h.score) for h in bad.hypotheses] != [(h.output_ids, h.score) for h in good.hypotheses]


def assert_same_beams(results, tol: float) -> None:
    """Identical hypotheses (ids, ancestry, finish, per-step parents and tokens); scores and logprobs
    within ``tol`` (the cache families' float32 logits agree within the declared logit tolerance)."""
    ref = results[0]
    for other in results[1:]:
        assert [(h.output_ids, h.ancestry, h.triggers, h.rank, h.step) for h in other.hypotheses] == [
            (h.output_ids, h.ancestry, h.triggers, h.rank, h.step) for h in ref.hypotheses]
        assert [(e["parents"], e["tokens"]) for e in other.steps] == [(e["parents"], e["tokens"]) for e in ref.steps]
        for a, b in zip(other.hypotheses, ref.hypotheses):
            assert a.score == pytest.approx(b.score, abs=tol) and a.normalized == pytest.approx(b.normalized, abs=tol)
            assert a.logprobs == pytest.approx(b.logprobs, abs=tol)


def test_cache_families_give_identical_beams(tiny_model):
    """No cache (the reference), dynamic, static, and chunked prefills: the same beams."""
    results = [run(tiny_model, EXACT, cache="none").result(), run(tiny_model, EXACT, cache="dynamic").result(),
               run(tiny_model, EXACT, cache="static").result(), run(tiny_model, EXACT, cache="static", prefill_chunk=4).result(),
               run(tiny_model, EXACT, cache="dynamic", prefill_chunk=1).result()]
    assert_same_beams(results, tol=5e-5)  # tests/runtime_helpers.py LOGIT_TOL["tiny"]


def test_width_one_equals_greedy_token_for_token_with_identical_logprobs(tiny_model):
    """A width-1 beam under the normative parameters is the greedy path: same ids, bit-identical
    logprobs, and the beam score is their left-to-right float64 sum."""
    for eos, g in ((EOS, 12), (3, 6)):
        params = B.BeamParams(1, g, [eos])
        best = run(tiny_model, params).result().best  # replayed by the spec, branch hashes included
        greedy = generate(tiny_model, PROMPT, max_new_tokens=g, eos_token_ids=(eos,))
        assert best.output_ids == greedy.output_ids and best.logprobs == greedy.logprobs
        assert best.finish_reason is greedy.finish_reason
        total = 0.0
        for lp in greedy.logprobs:
            total += lp
        assert best.score == total


def test_completed_hypotheses_carry_score_length_reason_and_ancestry(tiny_model):
    """invariant.beam_completed_metadata: at the cap (close_live) every live child completes with
    `length`; EOS hypotheses finish `eos`; normalized = score / |y|**alpha; best first.  HF closes
    only the top ranks and records no reason (expectations hf.beam_length_cap, hf.beam_finish_reasons);
    HF keeps K completed hypotheses where the spec keeps all, with the same top K
    (hf.beam_completed_capacity)."""
    result = run(tiny_model, EXACT).result()
    reasons = {h.finish_reason for h in result.hypotheses}
    assert reasons <= {FinishReason.EOS, FinishReason.LENGTH} and FinishReason.EOS in reasons
    for h in result.hypotheses:
        assert h.length == len(h.output_ids) == len(h.ancestry) == len(h.logprobs)
        assert h.normalized == h.score / float(h.length) ** 1.0
        assert (h.output_ids[-1] == EOS) == (FinishReason.EOS in h.triggers)
        assert (h.length == EXACT.max_new_tokens) == (FinishReason.LENGTH in h.triggers)
        assert h.branch.status is B.BeamStatus.COMPLETED and h.text == ""
    keys = [(-h.normalized, h.step, h.rank) for h in result.hypotheses]
    assert keys == sorted(keys) and result.best is result.hypotheses[0]
    at_cap = run(tiny_model, AT_CAP).result()
    last = at_cap.steps[-1]["completed"]
    assert at_cap.stop is B.BeamStop.LENGTH_CAP and at_cap.steps[-1]["parents"] == []
    assert sum(h.length == 9 for h in at_cap.hypotheses) == len(last) == 3 + sum(c["token"] == EOS for c in last)
    assert {tuple(c["triggers"]) for c in last} <= {("eos", "length"), ("length",)}
    assert all(c["finish_reason"] == ("eos" if c["token"] == EOS else "length") for c in last)
    assert len(at_cap.hypotheses) > AT_CAP.num_beams
    capped = run(tiny_model, attrs.evolve(AT_CAP, completed_capacity=AT_CAP.num_beams)).result()
    assert [(h.output_ids, h.score) for h in capped.hypotheses] == [(h.output_ids, h.score) for h in at_cap.hypotheses[:3]]


# --------------------------------------------------------------------------------------------
# Per-beam policy state: constraint automata, processors, and the HF envelope.
# --------------------------------------------------------------------------------------------

# Tokens 35 / 79 / 70 / 3, two states; the legal set depends on each beam's own path.
AUTOMATON = {"initial": "a", "transitions": {
    "a": {"35": "b", "70": "a", "79": "end", "3": "b"},
    "b": {"35": "a", "79": "end", "70": "b", "101": "a"},
    "end": {"79": "end"},
}}
EDGES = {s: {int(t): n for t, n in e.items()} for s, e in AUTOMATON["transitions"].items()}
CONSTRAINT_LANES = B.BranchLanes(constraint_init="a", constraint_step=lambda q, t: EDGES[q][t])


def test_constraint_state_forks_with_its_beam(tiny_model):
    """Lane Q (constraint automaton state) is part of the coupled branch vector: each child's state
    is its parent's advanced by its own token; the spec with the same automaton lane agrees."""
    params = B.BeamParams(3, 8, [EOS], length_penalty=B.LengthPenalty(1.0), early_stop="at_cap")
    runner = run(tiny_model, params, transforms=[{"name": "constraint", "automaton": AUTOMATON}], lanes=CONSTRAINT_LANES)
    states = {b.constraint for log in runner.log for b in log.children}
    assert states == {"a", "b"}
    for log in runner.log:
        for child in log.children:
            assert child.constraint == EDGES[log.expanded[child.ancestry[-1]].constraint][child.prefix[-1]]


def test_repetition_penalty_reads_each_beams_own_history(tiny_model):
    """Processors run per beam on log-probabilities (HF order: log_softmax, then processors), and
    the policy renormalises their output (log_softmax): each beam's row reads its own history, and
    the spec agrees with the decisions taken on them."""
    params = B.BeamParams.hf_compatible(3, 8, [EOS], length_penalty=1.0, early_stopping="never")
    runner = run(tiny_model, params, transforms=[{"name": "repetition_penalty", "penalty": 1.5}])
    plain = run(tiny_model, params).result()
    assert [h.output_ids for h in runner.result().hypotheses] != [h.output_ids for h in plain.hypotheses]
    log = runner.log[2]
    assert len({b.prefix for b in log.expanded}) == len(log.expanded) > 1
    for k, branch in enumerate(log.expanded):
        seen = torch.zeros(tiny_model.config.vocab_size, dtype=torch.bool)
        seen[list(branch.prefix)] = True
        with torch.inference_mode():
            raw = torch.log_softmax(tiny_model(torch.tensor([branch.prefix])).logits[0, -1].float(), dim=-1)
        want = torch.log_softmax(torch.where(seen, raw * 1.5, raw), dim=-1)
        torch.testing.assert_close(log.rows[k], want, rtol=0, atol=5e-5)


def test_fewer_finite_candidates_than_hfs_window_is_refused_under_hf_parameters(tiny_model):
    """-inf candidates are never kept: under the normative parameters the frontier shrinks to the
    legal continuations; under the HF parameters the runtime refuses (beam.outside_hf_envelope)
    where HF would keep -inf or sentinel candidates, and nothing changes (hf.beam_first_step_sentinel)."""
    constraint = [{"name": "constraint", "automaton": AUTOMATON}]
    narrow = B.BeamParams(4, 6, [EOS], early_stop="at_cap")
    runner = run(tiny_model, narrow, transforms=constraint, lanes=CONSTRAINT_LANES)
    assert len(runner.log[0].children) == 3  # "a" has 4 legal tokens, one of them EOS
    hf = B.BeamParams.hf_compatible(4, 6, [EOS])
    runner = BeamRunner(tiny_model, beam_request(hf, transforms=constraint), hf)
    runner.call()
    with pytest.raises(Rejection) as err:
        runner.decide()
    assert err.value.code == "beam.outside_hf_envelope"
    assert runner.phase == "scored" and runner.events == [] and len(runner.live) == 1


def test_min_new_tokens_keeps_eos_out_of_the_candidates(tiny_model):
    """min_new_tokens (a legality processor per beam): no hypothesis completes on EOS before it."""
    params = B.BeamParams(3, 8, [EOS], early_stop="at_cap")
    runner = run(tiny_model, params, min_new_tokens=4)
    assert all(h.length >= 4 for h in runner.result().hypotheses)
    assert all(math.isinf(float(log.rows[0, EOS])) for log in runner.log[:4])


# --------------------------------------------------------------------------------------------
# Trace, exactly-once, refusals.
# --------------------------------------------------------------------------------------------


def test_trace_has_the_header_one_beam_step_per_step_and_the_finish(tiny_model):
    """The decodespec.events.v1 trace: `request` with the beam parameters, `beam_step` bodies equal
    to the runner's events (BeamStepRecord.to_event() shape), `finish` of the best hypothesis."""
    sink = ListSink()
    runner = run(tiny_model, HF_FALSE, sink=sink)
    events = [r["event"] for r in sink.records]
    assert events == ["request"] + ["beam_step"] * len(runner.events) + ["finish"]
    assert [r["seq"] for r in sink.records] == list(range(len(events)))
    assert sink.records[0]["beam"] == HF_FALSE.to_json() and sink.records[0]["policy"]["family"] == "beam"
    assert [{k: r[k] for k in BEAM_STEP_FIELDS} for r in sink.records[1:-1]] == runner.events
    best = runner.result().best
    assert sink.records[-1]["finish_reason"] == best.finish_reason.value
    assert sink.records[-1]["frontier"]["output_count"] == best.length


def test_each_score_row_is_consumed_exactly_once(tiny_model):
    """transition.beam_step guard: decide needs fresh rows; call needs a consumed decision; result needs the end."""
    runner = BeamRunner(tiny_model, beam_request(EXACT), EXACT)
    with pytest.raises(Rejection) as err:
        runner.decide()
    assert err.value.code == "beam.not_enabled"
    runner.call()
    with pytest.raises(Rejection):
        runner.call()
    runner.decide()
    with pytest.raises(Rejection):
        runner.decide()
    with pytest.raises(Rejection):
        runner.result()
    runner.run()
    assert runner.step() is None
    with pytest.raises(Rejection):
        runner.call()


def test_a_positive_bias_is_renormalised_so_increments_stay_non_positive(tiny_model):
    """The exact bound needs non-positive increments (M3.10 0x05 log-prob beam sums): a logit bias
    that lifts one token above 0 in log-probability space is renormalised by the policy, so the
    rows the spec replays are log-probabilities (beam.score_not_logprob never applies)."""
    params = B.BeamParams(2, 4, [EOS], early_stop="at_cap")
    runner = run(tiny_model, params, transforms=[{"name": "logit_bias", "bias": {"35": 50.0}}])
    for log in runner.log:
        assert float(log.rows.max()) <= 0.0
        assert torch.logsumexp(log.rows.double(), dim=-1).abs().max() < 1e-5
    assert runner.events[0]["tokens"][0] == 35 and runner.events[0]["scores"][0] > -1e-5


@pytest.mark.parametrize("change, code", [
    ({"stream": True}, BEAM_UNSUPPORTED),
    ({"stop_strings": ("ab",)}, BEAM_UNSUPPORTED),
    ({"structured": "json"}, BEAM_UNSUPPORTED),
    ({"final_cache": "all_outputs"}, BEAM_UNSUPPORTED),
    ({"max_new_tokens": 0}, "runtime.invalid_request"),
    ({"prompt_ids": ()}, "runtime.invalid_request"),
    ({"prompt_ids": (1, 600)}, "runtime.invalid_request"),
    ({"cache": "paged"}, "runtime.invalid_request"),
    ({"policy": policy_config_from_json({"family": "greedy"})}, "policy.family_mismatch"),
    ({"eos_ids": frozenset({EOS, 3})}, "runtime.invalid_request"),
])
def test_requests_the_beam_runtime_cannot_honour_are_refused(tiny_model, change, code):
    """Typed refusals before any call: streaming, stop strings, structured output, final cache,
    G = 0, bad prompts, unknown cache families, a non-beam policy, parameters that disagree."""
    request = attrs.evolve(beam_request(EXACT), **change)
    with pytest.raises(Rejection) as err:
        BeamRunner(tiny_model, request, EXACT if "policy" not in change else None)
    assert err.value.code == code


def test_a_request_longer_than_the_context_cap_is_a_resource_limit(tiny_model):
    """A beam request needs L + G <= C (window, envelope cap, static capacity): beams close only by
    EOS or the length cap."""
    params = B.BeamParams(2, 8, [EOS])
    with pytest.raises(ResourceLimit) as err:
        BeamRunner(tiny_model, beam_request(params, context_cap=len(PROMPT) + 7), params)
    assert err.value.code == "model.context_window_exceeded"
    with pytest.raises(ResourceLimit) as err:
        BeamRunner(tiny_model, beam_request(params, cache="static", static_capacity=len(PROMPT) + 7), params)
    assert err.value.code == "cache.capacity_exceeded"
    BeamRunner(tiny_model, beam_request(params, cache="static", static_capacity=len(PROMPT) + 8), params).run()
    BeamRunner(tiny_model, beam_request(params, context_cap=len(PROMPT) + 8), params).run()


def test_policy_exact_maps_to_the_normative_parameters_and_beam_generate_agrees(tiny_model):
    """BeamParams.from_policy: early_stopping 'exact' is the normative contract; HF values are
    hf_compatible; beam_generate is the runner's convenience form."""
    policy = policy_config_from_json({"family": "beam", "num_beams": 3, "length_penalty": 1.0, "early_stopping": "exact"})
    assert B.BeamParams.from_policy(policy, 9, [EOS]) == EXACT
    hf = policy_config_from_json({"family": "beam", "num_beams": 3, "early_stopping": "false"})
    assert B.BeamParams.from_policy(hf, 9, [EOS]) == HF_FALSE
    runner = BeamRunner(tiny_model, attrs.evolve(beam_request(EXACT), policy=policy), record=True).run()
    replay_against_spec(runner)
    assert runner.params == EXACT
    assert beam_generate(tiny_model, PROMPT, EXACT, identity=runner.request.identity).steps == runner.result().steps
