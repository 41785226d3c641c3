"""The explorer catches broken transitions with shortest counterexamples, written as ITF; the ITF codec.

Source: research/formal-anchors-survey.md 3.1 (TLC BFS, deadlock, coverage), 5.1 (ITF).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.checks.modelcheck import itf
from decodespec.checks.modelcheck.explore import DEADLOCK, UNTYPED_REJECTION, ExploreBounds, explore, params_for_bounds
from decodespec.spec import transitions as T
from decodespec.spec.actions import Admit, Decide, Launch
from decodespec.spec.enums import PendingTag
from decodespec.spec.errors import Rejection
from decodespec.spec.profiles import PROFILES

REPO = Path(__file__).resolve().parents[1]
ONE_SHOT = ExploreBounds(prefill_chunk=None)


def commit_keeps_receipt_unconsumed(params, state, action):
    """Broken transition.commit: appends the token but never records the receipt as consumed."""
    return attrs.evolve(T.commit(params, state, action), consumed=state.consumed)


def all_old_advances_p(params, state, action):
    """Broken transition.complete_all_old: advances P although the rosters disagreed."""
    nxt = T.complete_all_old(params, state, action)
    end = state.in_flight.end
    return attrs.evolve(nxt, processed=end, lanes=T.expected_lanes(params, state.in_flight),
                        last_completion=attrs.evolve(nxt.last_completion, processed_after=end))


def all_new_forgets_lanes(params, state, action):
    """Broken transition.complete_all_new: selects ALL_NEW but leaves the K/V lane behind P."""
    nxt = T.complete_all_new(params, state, action)
    return attrs.evolve(nxt, lanes=state.lanes)


def commit_claims_processed(params, state, action):
    """Broken transition.commit: counts the selected token as processed (the off-by-one bug)."""
    nxt = T.commit(params, state, action)
    return attrs.evolve(nxt, processed=nxt.processed + 1, lanes=tuple((n, nxt.processed + 1) for n, _ in nxt.lanes))


@pytest.mark.parametrize(
    "rule_id, effect, caught, steps",
    [
        ("transition.commit", commit_keeps_receipt_unconsumed, "invariant.logprobs_aligned", 5),
        ("transition.complete_all_old", all_old_advances_p, "invariant.all_old_exposes_nothing", 3),
        ("transition.complete_all_new", all_new_forgets_lanes, "invariant.cache_frontier_equals_processed", 3),
        ("transition.commit", commit_claims_processed, "invariant.frontiers_balance", 5),
    ],
    ids=["commit-no-consume", "all-old-advances-P", "all-new-forgets-lanes", "commit-claims-processed"],
)
def test_broken_transition_is_caught_with_a_shortest_counterexample(rule_id, effect, caught, steps, tmp_path) -> None:
    """A deliberately broken effect plugged into the machine violates a named invariant; the BFS
    counterexample is as short as possible and round-trips through an ITF file."""
    params = params_for_bounds(ONE_SHOT)
    result = explore(params, ONE_SHOT, machine=T.MACHINE.with_effect(rule_id, effect))
    assert not result.ok
    violation = result.violations[0]
    assert caught in {v.rule_id for v in result.violations}
    assert len(violation.actions) == steps and violation.rules[-1] == rule_id
    assert isinstance(violation.actions[0], Admit)
    trace = violation.to_itf(params, ONE_SHOT)
    path = itf.write_trace(tmp_path / "cex.itf.json", trace)
    back = itf.read_trace(path)
    assert back["#meta"]["violated"] == violation.rule_id and back["#meta"]["format"] == "decodespec.counterexample"
    assert back["#meta"]["format-version"] == 1 and back["#meta"]["bounds"]["prompt_len"] == 3
    assert len(back["states"]) == steps + 1
    assert back["states"][0]["action"] == "init" and back["states"][-1]["rule"] == rule_id
    assert [s["#meta"]["index"] for s in back["states"]] == list(range(steps + 1))
    first = itf.decode(back["states"][0]["phase"])
    assert first == itf.Variant("NEW") and itf.decode(back["states"][-1]["processed"]) == violation.states[-1].processed


def test_the_spec_machine_passes_where_the_mutants_fail() -> None:
    params = params_for_bounds(ONE_SHOT)
    result = explore(params, ONE_SHOT)
    assert result.ok and result.num_terminal > 0 and result.max_depth >= 10
    assert result.num_transitions >= result.num_edges >= result.num_states - 1
    assert result.states_per_second > 0


def test_weakened_guard_is_caught() -> None:
    """Dropping the min_new_tokens clause of transition.decide lets an early EOS through."""
    bounds = attrs.evolve(ONE_SHOT, min_new_tokens=1)
    params = params_for_bounds(bounds)
    guard = tuple(c for c in T.MACHINE.route(params, None, Decide("x", 0)).guard if not c.name.startswith("EOS"))  # type: ignore[arg-type]
    result = explore(params, bounds, machine=T.MACHINE.with_guard("transition.decide", guard))
    assert result.violations[0].rule_id == "invariant.eos_closes_output"


def test_deadlock_is_reported() -> None:
    """A prefix-LM request whose chunk cannot hold the prefix can only be cancelled: a deadlock."""
    params = attrs.evolve(params_for_bounds(ONE_SHOT), profile=PROFILES["prefix_lm"], prefix_length=2, prefill_chunk=1)
    result = explore(params, ONE_SHOT)
    assert [v.rule_id for v in result.violations] == [DEADLOCK]
    assert len(result.violations[0].actions) == 1


def test_untyped_refusal_is_reported() -> None:
    def crashes(params, state, action):
        raise KeyError("boom")

    params = params_for_bounds(ONE_SHOT)
    result = explore(params, ONE_SHOT, machine=T.MACHINE.with_effect("transition.decide", crashes))
    assert result.violations[0].rule_id == UNTYPED_REJECTION


def test_coverage_reports_unexercised_transitions_and_rejections() -> None:
    params = params_for_bounds(ONE_SHOT)
    result = explore(params, ONE_SHOT)
    rank_layer = {"transition.rank_enter", "transition.rank_report", "transition.rank_fault", "transition.rank_timeout"}
    assert set(result.unexercised) == {"transition.admit_no_call", "transition.admit_reject"} | rank_layer  # R = 1: no ranks
    assert result.rejected[("Commit", "transition.not_enabled")] > 0  # duplicate / stale receipts tried
    assert result.rejected[("Decide", "transition.not_enabled")] > 0  # stale scores and early EOS tried
    assert result.rejected[("Launch", "transition.not_enabled")] > 0  # reset cache_position tried
    assert ("in_flight", "scored") in result.phase_edges and ("finished", "finished") in result.phase_edges
    assert set(result.action_counts) == {"Admit", "Launch", "Complete", "Fault", "Decide", "Commit", "Cancel",
                                         "StreamFailure", "Recover", "Snapshot", "Restore", "SupportEmpty"}
    summary = result.summary()
    assert json.loads(json.dumps(summary))["states"] == result.num_states


@pytest.mark.parametrize("bounds", [
    ExploreBounds(max_new_tokens=0, zero_new_tokens="reject"),
    ExploreBounds(max_new_tokens=0, zero_new_tokens="no_call"),
    ExploreBounds(max_new_tokens=0, zero_new_tokens="prefill_only"),
    ExploreBounds(cache="static"),
    ExploreBounds(cache="none", final_cache="processed_inputs_only"),
    ExploreBounds(profile="encoder_decoder", prompt_len=1),
    ExploreBounds(profile="prefix_lm", prefill_chunk=3, prefix_length=2),
    ExploreBounds(profile="hybrid"),
], ids=["g0-reject", "g0-no-call", "g0-prefill-only", "static", "no-cache", "enc-dec", "prefix-lm", "hybrid"])
def test_branches_and_profiles_are_explorable(bounds: ExploreBounds) -> None:
    result = explore(params_for_bounds(bounds), bounds)
    assert result.ok, result.summary()["violations"]


def test_params_for_bounds_refuses_out_of_scope_bounds() -> None:
    for bad in (ExploreBounds(profile="rnn"), ExploreBounds(cache="paged"), ExploreBounds(vocab=1),
                ExploreBounds(cache="static", capacity=2), ExploreBounds(profile="prefix_lm", prefix_length=3, prefill_chunk=2)):
        with pytest.raises(Rejection) as err:
            params_for_bounds(bad)
        assert err.value.code == "explore.invalid_bounds"


# ---------------------------------------------------------------------------------------------
# ITF codec
# ---------------------------------------------------------------------------------------------


def test_itf_schema_is_the_research_restatement() -> None:
    research = Path("/work/shared/research/itf.schema.json")
    if not research.exists():
        pytest.skip("research/itf.schema.json is not on this machine")
    assert itf.ITF_SCHEMA == json.loads(research.read_text())


def test_itf_value_encoding_table() -> None:
    assert itf.encode(5) == 5 and itf.encode(2**60) == {"#bigint": str(2**60)} and itf.encode(-(2**60)) == {"#bigint": str(-(2**60))}
    assert itf.encode((1, 2)) == [1, 2] and itf.encode(itf.Tup((1, "a"))) == {"#tup": [1, "a"]}
    assert itf.encode(frozenset({3, 1})) == {"#set": [1, 3]}
    assert itf.encode({"a": 1}) == {"a": 1} and itf.encode({1: "x"}) == {"#map": [[1, "x"]]}
    assert itf.encode(None) == {"tag": "None", "value": {"#tup": []}}
    assert itf.encode(PendingTag.EMPTY) == {"tag": "EMPTY", "value": {"#tup": []}}
    assert itf.encode(itf.Variant("Some", 4)) == {"tag": "Some", "value": 4}
    assert itf.encode(Launch(kind=__import__("decodespec.spec.enums", fromlist=["x"]).CallKind.DECODE, start=3, length=1)) == {
        "kind": {"tag": "DECODE", "value": {"#tup": []}}, "start": 3, "length": 1}
    for bad in (1.5, {"#x": 1}, object()):
        with pytest.raises(itf.ItfError):
            itf.encode(bad)
    for bad in (None, 1.5, {"#bigint": "1.5"}, {"#unserializable": "Int"}, {"#weird": 1}):
        with pytest.raises(itf.ItfError):
            itf.decode(bad)


_LEAF = st.one_of(st.booleans(), st.text(max_size=5), st.integers(-(2**70), 2**70))
_ITF_VALUES = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.builds(lambda xs: itf.Tup(xs), st.lists(inner, max_size=3)),
        st.frozensets(_LEAF, max_size=3),
        st.dictionaries(st.text(alphabet="abcxyz_", min_size=1, max_size=4), inner, max_size=3),
        st.builds(itf.Variant, st.text(alphabet="ABCxyz", min_size=1, max_size=4), inner),
        st.builds(lambda pairs: itf.ItfMap(pairs), st.dictionaries(st.integers(0, 9), inner, max_size=3)),
    ),
    max_leaves=12,
)


@given(_ITF_VALUES)
def test_itf_round_trip(value) -> None:
    """decode(encode(x)) == x and encode(decode(j)) == j for ITF values; each encodes to a schema-valid trace."""
    encoded = itf.encode(value)
    assert itf.decode(encoded) == value
    assert itf.encode(itf.decode(encoded)) == encoded
    itf.validate_trace(itf.make_trace(["x"], [{"x": value}]))


def test_itf_trace_validation_errors() -> None:
    with pytest.raises(itf.ItfError):
        itf.validate_trace({"vars": ["x"], "states": [{"y": 1}]})
    with pytest.raises(itf.ItfError):
        itf.validate_trace({"vars": ["x"], "states": [{"x": None}]})
    with pytest.raises(itf.ItfError):
        itf.validate_trace({"vars": ["x"], "states": [{"x": 1}], "loop": 1})
    with pytest.raises(itf.ItfError):
        itf.make_trace(["x"], [{}])
    trace = itf.make_trace(["x"], [{"x": 1}, {"x": 2}], meta={"format": "ITF"}, params=["N"], loop=0)
    itf.validate_trace(trace)
    assert trace["states"][1] == {"#meta": {"index": 1}, "x": 2} and trace["loop"] == 0


def test_quint_style_trace_decodes() -> None:
    """A trace shaped like Quint's output (sum types, bigints, records) validates and decodes."""
    quint = {
        "#meta": {"format": "ITF", "source": "x.qnt"},
        "vars": ["phase", "count", "opt", "mbt::actionTaken"],
        "states": [
            {"#meta": {"index": 0}, "phase": {"tag": "Idle", "value": {"#tup": []}}, "count": {"#bigint": "40"},
             "opt": {"tag": "Some", "value": {"#bigint": "1"}}, "mbt::actionTaken": "init"},
        ],
    }
    itf.validate_trace(quint)
    state = quint["states"][0]
    assert itf.decode(state["phase"]) == itf.Variant("Idle") and itf.decode(state["count"]) == 40
    assert itf.decode(state["opt"]) == itf.Variant("Some", 1)


def test_cli_explore_reports_throughput_and_bounds_errors(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "decodespec.checks", "explore", "--prompt-len", "2", "--max-new-tokens", "2"],
                         check=False, capture_output=True, cwd=tmp_path, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] and report["states"] > 0 and report["states_per_second"] > 0
    assert "transition.commit" in report["rules"] and report["violations"] == []
    bad = subprocess.run([sys.executable, "-m", "decodespec.checks", "explore", "--vocab", "1"],
                         check=False, capture_output=True, cwd=tmp_path, text=True)
    assert bad.returncode == 2 and json.loads(bad.stdout)["ok"] is False
    assert set(T.MACHINE.rule_ids()) >= set(report["rules"])
