"""Two HF deviations the lock-step machines meet on the tiny model, and their documented entries (checks/gate/expectations/hf.toml).

Each test drives the lock step on HF transformers with the configuration the machine drew, checks the
verdict, and checks that exactly the documented deviation explains it (and not a near miss).
"""

from __future__ import annotations

import attrs
import pytest

pytest.importorskip("transformers")

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.gate.cases import load_expectations
from decodespec.checks.gate.lockstep import LockStep
from decodespec.checks.modelcheck.traces import open_runtime

CONSTRAINT = {"family": "greedy", "order": "default", "transforms": [{"name": "constraint", "automaton": {
    "initial": "s0", "transitions": {"s0": {"100": "s1"}, "s1": {"101": "s2"}, "s2": {"100": "s3"}, "s3": {"101": "s0"}}}}]}


@pytest.fixture(scope="module")
def hf():
    return open_runtime("hf", "tiny")


def _explaining(case_id, record):
    return [e.id for e in load_expectations("hf") if e.matches(case_id, record.verdict, record.action, model="tiny", spec_state=record.spec_state)]


def test_constraint_overrides_min_new_tokens(hf):
    """The constraint allows only EOS 101 after 100; min_new_tokens = 2 bans it at O = 1: the spec finishes
    constraint_error with (100,), HF commits the banned EOS (hf.constraint_overrides_empty_support_machine)."""
    config = CaseConfig(model="tiny", prompt_ids=(1,), policy=CONSTRAINT, max_new_tokens=3, min_new_tokens=2, eos_ids=[101],
                        cache="none", attention="eager", seed=None, final_cache="none")
    ls = LockStep(hf, config, runtime="hf")
    assert ls.reset().verdict.passed
    assert ls.apply({"op": "step"}).verdict.passed
    record = ls.apply({"op": "step"})
    assert record.verdict.check == "output_ids" and record.verdict.expected == (100,) and record.verdict.actual == (100, 101)
    assert record.spec_state["finish_reason"] == "constraint_error"
    assert _explaining("machine.none", record) == ["hf.constraint_overrides_empty_support_machine"]
    # the same verdict without the spec's constraint_error finish is not explained
    assert _explaining("machine.none", attrs.evolve(record, spec_state={**record.spec_state, "finish_reason": None})) == []


def test_static_capacity_of_the_prompt_alone(hf):
    """S = L = 1 with G = 1: the spec refuses (cache.capacity_exceeded), HF runs (hf.static_capacity_holds_prompt_only)."""
    config = CaseConfig(model="tiny", prompt_ids=(1,), max_new_tokens=1, cache="static", static_capacity=1, attention="eager")
    ls = LockStep(hf, config, runtime="hf")
    record = ls.reset()
    assert record.verdict.check == "accept_reject" and record.spec["code"] == "cache.capacity_exceeded" and record.runtime["status"] == "ok"
    assert _explaining("machine.static", record) == ["hf.static_capacity_holds_prompt_only"]
    # a capacity that holds one output is admitted by both
    assert LockStep(open_runtime("hf", "tiny"), config.evolve(static_capacity=2), runtime="hf").reset().verdict.passed


def test_a_bad_word_that_is_an_eos_id_is_refused_as_unsupported():
    """HF's NoBadWordsLogitsProcessor drops a single-token bad word that is an EOS id, so the adapter refuses the config
    (adapter.unsupported) instead of running a ban HF would not apply; a bad word that is not EOS runs."""
    from decodespec.checks.adapters import ADAPTER_UNSUPPORTED
    from decodespec.checks.adapters.hf import generation_config
    from decodespec.spec.errors import Rejection

    config = CaseConfig(model="tiny", prompt_ids=(0,), policy={"family": "greedy", "transforms": [{"name": "bad_words", "sequences": [[0]]}]},
                        max_new_tokens=1, eos_ids=[0])
    with pytest.raises(Rejection) as refused:
        generation_config(config, max_length=2)
    assert refused.value.code == ADAPTER_UNSUPPORTED and refused.value.path == "$.policy.transforms[0]"
    assert generation_config(config.evolve(eos_ids=[5]), max_length=2).bad_words_ids == [[0]]
