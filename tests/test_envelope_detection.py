"""Detection power of the widened gate: independent runtime bugs (tests/envelope_bugs.py) fail it on the tiny model.

Each bug is a temporary patch of ``impl/`` (never committed there) of a kind issue 15 item 4
names: a stop matcher without suffix links, a ``min_new_tokens`` rule that bans only the first
EOS id, ``min_p`` ignoring ``p = 1``, an external close that drops the stop holdback.  Before the
machines drew the whole envelope, ``pytest checks/ --model tiny`` passed with every one of them
installed (no case or machine drew the input: one EOS id, no stop strings in the machines, one
sampling policy).  Now:

* the envelope sweep's case for the item (``checks/test_sweep.py``) fails at the ladder layer
  named here, and passes without the patch;
* the lock-step machines (``checks/test_machines.py``) kill the EOS-set bug too (derandomized
  here, 150 examples per machine, any of the three cache families' machines may be the killer,
  since a change of the strategies changes which examples are drawn).  The other three need a
  rarer conjunction (``min_p`` at ``p = 1`` in a sampled policy that reaches a decision; a stream
  cancelled while a stop prefix is held back; a stop string ending where a longer one's path
  runs on): random gate runs drew and killed each of them, a fixed 150-example draw need not,
  so the sweep is what makes their detection certain.

Rules: ``invariant.stop_match_rule``, ``invariant.stream_holdback``, ``transform.min_new_tokens``,
``transform.min_p`` (checked through ``ladder.STATE``, ``ladder.DECISION``, ``ladder.SEQUENCE``).
Source: issue 15 item 4; M3.10 0x06; M3.8 0x0B-0x0C.
"""

from __future__ import annotations

import pytest
from envelope_bugs import BUGS
from hypothesis import Phase

from decodespec.checks.gate.cases import run_case
from decodespec.checks.gate.drawing import sweep_cases
from decodespec.checks.gate.machines import run_machine

#: bug -> (the sweep case that kills it, the ladder layer and check of its failed verdict).
SWEEP_KILLS = {
    "stop_suffix_link": ("sweep.stop.nested", "STATE", "output_ids"),
    "eos_first_only": ("sweep.eos.several_with_min_new_tokens", "DECISION", "decision.policy"),
    "min_p_upper_edge": ("sweep.edge.min_p.p.max", "DECISION", "decision.draw"),
    "cancel_drops_stop_holdback": ("sweep.held.cancelled.stop_prefix", "SEQUENCE", "stream.chunks"),
}


@pytest.fixture(autouse=True)
def _traces(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODESPEC_TRACE_DIR", str(tmp_path))


@pytest.mark.parametrize("bug", sorted(SWEEP_KILLS))
def test_the_sweep_case_fails_with_the_bug_and_passes_without(bug: str) -> None:
    case_id, layer, check = SWEEP_KILLS[bug]
    case = {c.id: c for c in sweep_cases("tiny")}[case_id]
    assert run_case(case, "impl").result == "pass"
    with BUGS[bug]():
        result = run_case(case, "impl")
    assert result.result == "fail", result
    assert (result.verdict.layer, result.verdict.check) == (layer, check), result.verdict
    assert result.trace is not None  # replayable: decodespec replay FILE


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["eos_first_only"])
def test_a_lockstep_machine_fails_with_the_bug(bug: str) -> None:
    verdicts = []
    with BUGS[bug]():
        for cache in ("dynamic", "none", "static"):
            try:
                run_machine("impl", "tiny", cache, database=None, phases=[Phase.generate], derandomize=True, max_examples=150)
            except AssertionError as exc:
                verdicts.append((cache, str(exc).splitlines()[0]))
                break
    assert verdicts and verdicts[0][1].startswith(("ladder.DECISION", "ladder.POLICY", "ladder.SEQUENCE")), verdicts
