"""Every committed trace under traces/ replays to its recorded verdict (the regression corpus).

The corpus holds passes (boundary cases, adversarial interleavings), an undecided margin, the
failures of deliberately broken runtimes at their ladder layers (``ladder.STATE``,
``ladder.TENSOR``, ``ladder.DECISION``) and the regression of a fixed discrepancy of our runtime
(``adversarial-restore-counters-mismatch``).
Source: traces/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decodespec.checks.adapters import AdapterUnavailable
from decodespec.checks.modelcheck.traces import load_trace, replay
from decodespec.checks.testing import SMOLLM2_SKIP_REASON
from decodespec.impl.gguf import smollm2_available

CORPUS = sorted((Path(__file__).resolve().parent.parent / "traces").glob("*.json"))


def test_the_corpus_covers_every_kind_of_verdict() -> None:
    verdicts = {(m["verdict"]["result"], m["verdict"]["layer"]) for m in (load_trace(p)["#meta"] for p in CORPUS)}
    assert {("passed", None), ("undecided", "DECISION"), ("failed", "STATE"), ("failed", "TENSOR"), ("failed", "DECISION")} <= verdicts


@pytest.mark.parametrize("path", CORPUS, ids=[p.name for p in CORPUS])
def test_corpus_trace_reproduces(path: Path, request: pytest.FixtureRequest) -> None:
    """A peer's trace skips where the peer is not installed (llama.cpp in CI); an HF SmolLM2 trace reuses the session's HF model."""
    trace = load_trace(path)
    meta = trace["#meta"]
    if meta["model"] == "smollm2" and not smollm2_available():
        pytest.skip(SMOLLM2_SKIP_REASON)
    if meta["runtime"] == "hf" and meta["model"] == "smollm2":
        from decodespec.checks.adapters.hf import adopt_model

        adopt_model(request.getfixturevalue("hf_smollm2"), "smollm2")
    try:
        result = replay(trace)
    except AdapterUnavailable as exc:
        pytest.skip(f"{meta['runtime']} trace: {exc}")
    if not result.reproduced and result.cannot_reproduce_here:
        pytest.skip(f"{path.name}: {result.cannot_reproduce_here}")
    assert result.reproduced, (path.name, result.expected.to_json(), result.actual.to_json())
