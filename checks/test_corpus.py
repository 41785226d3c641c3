"""Gate: the committed regression corpus (``traces/*.itf.json``) replayed against the runtime under test.

A trace recorded on the runtime under test (or on one of its registered broken variants) must
reproduce its recorded verdict (result, ladder layer and rule); a trace that recorded a pass on
another runtime must pass here too (the corpus is a conformance suite for every runtime).

Source: research/formal-anchors-survey.md 4.3 (test262-style corpus), 5.1 (ITF); traces/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decodespec.checks.adapters import AdapterUnavailable, CaseConfig, config_capabilities, required_capabilities
from decodespec.checks.modelcheck.traces import load_trace, open_runtime, replay
from decodespec.checks.testing import SMOLLM2_SKIP_REASON
from decodespec.impl.gguf import smollm2_available

CORPUS = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.json"))


@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_corpus_trace(path: Path, gate_runtime: str, gate_expectations) -> None:
    """Replay one corpus trace (``ladder.*`` verdicts) against the gate's runtime.

    A passed trace replayed on another runtime skips when its actions or its config need a capability
    the runtime does not declare; any replay skips when the runtime refuses the config as unsupported
    at the reset (e.g. the tiny model or a static cache on llama.cpp); a failure names the documented deviation
    (``checks/gate/expectations``) that explains its failure there (the file name is the case id:
    ``boundary-stop-string-x`` is ``boundary.stop_string_x``).
    """
    trace = load_trace(path)
    meta = trace["#meta"]
    if meta["model"] == "smollm2" and not smollm2_available():
        pytest.skip(SMOLLM2_SKIP_REASON)
    recorded = meta["runtime"]
    base = gate_runtime.split(":", 1)[0]
    if recorded == gate_runtime or recorded.startswith(base + ".broken."):
        runtime = recorded
    elif meta["verdict"]["result"] == "passed":
        runtime = gate_runtime
    else:
        pytest.skip(f"records a {meta['verdict']['result']} verdict of runtime {recorded}")
    try:
        adapter = open_runtime(runtime, meta["model"])
    except AdapterUnavailable as exc:
        pytest.skip(str(exc))
    config = CaseConfig.from_json(meta["config"])
    # As run_case: the actions' ops and every feature the config sets (features.config_capabilities).
    missing = set().union(config_capabilities(config), *(required_capabilities(a) for a in meta["actions"])) - adapter.capabilities()
    if missing:  # as run_case skips a case whose requirements the runtime does not declare
        adapter.close()
        pytest.skip(f"{runtime} does not declare {sorted(missing)}")
    result = replay(trace, runtime=runtime, adapter=adapter)
    if not result.reproduced and result.cannot_reproduce_here:  # a bit-exact verdict of other CPU kernels
        pytest.skip(f"{path.name}: {result.cannot_reproduce_here}")
    if runtime != recorded and not result.reproduced:
        step = result.actual.step
        action = meta["actions"][step - 1] if step and step <= len(meta["actions"]) else None
        case_id = path.name.removesuffix(".itf.json").replace("-", ".", 1).replace("-", "_")
        for e in gate_expectations:
            if e.matches(case_id, result.actual, action, model=meta["model"]):
                pytest.skip(f"documented deviation {e.id} of {runtime}: {e.reason}")
    if not result.reproduced and result.unsupported:  # the reset refused as unsupported: a skip, never a fail
        pytest.skip(f"{path.name}: {result.unsupported}")
    assert result.reproduced, (f"{path.name}: recorded {result.expected.to_json()} but replay on {runtime} gave "
                               f"{result.actual.to_json()}")
