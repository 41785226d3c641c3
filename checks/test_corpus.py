"""Gate: the committed regression corpus (``traces/*.itf.json``) replayed against the runtime under test.

A trace recorded on the runtime under test (or on one of its registered broken variants) must
reproduce its recorded verdict (result, ladder layer and rule); a trace that recorded a pass on
another runtime must pass here too (the corpus is a conformance suite for every runtime).

Source: research/formal-anchors-survey.md 4.3 (test262-style corpus), 5.1 (ITF); traces/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decodespec.checks.adapters import AdapterUnavailable
from decodespec.checks.testing import SMOLLM2_SKIP_REASON
from decodespec.checks.traces import load_trace, replay
from decodespec.impl.gguf import smollm2_available

CORPUS = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.json"))


@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_corpus_trace(path: Path, gate_runtime: str) -> None:
    """Replay one corpus trace (``ladder.*`` verdicts) against the gate's runtime."""
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
        result = replay(trace, runtime=runtime)
    except AdapterUnavailable as exc:
        pytest.skip(str(exc))
    assert result.reproduced, (f"{path.name}: recorded {result.expected.to_json()} but replay on {runtime} gave "
                               f"{result.actual.to_json()}")
