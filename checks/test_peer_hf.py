"""Peer gate: HF transformers (runs with ``pytest checks/ --runtime hf``; skipped for other runtimes).

The shared case table runs in checks/test_gate.py; this module adds HF's procedures for the
table's custom cases (padded batches, beam width one: HF's entries of :data:`decodespec.checks.gate.procedures.CUSTOM`),
the HF-specific cases (:func:`peer_cases`, judged and reported like the table's), the evidence
behind the documented deviations in ``checks/gate/expectations/hf.toml``.  The committed HF traces
(``traces/hf-*.itf.json``) replay in checks/test_corpus.py and tests/test_traces_corpus.py.

Findings verified here rather than assumed (research/peers-survey.md): HF's sampling uses the
global torch RNG (no per-request replay); HF's top-k keeps ties at the k-th value, also a natural
float32 tie of SmolLM2 (``peer.hf.top_k_tie``; the table's ``boundary.top_k_ties`` makes its tie
with a logit bias); HF refuses temperature 0 when sampling (``boundary.temperature_zero``); HF
does not trim stop strings (``boundary.stop_patterns_shared_prefix``).  HF's beam-search early-stopping heuristic is pinned
by tests/test_beam_hf.py (docs/beam-expectations.md).

Source: M3.10 "Correctness matrix", "Pinned official runtime reconciliation"; transformers 5.24.0.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.gate.cases import Case, run_case
from decodespec.checks.gate.prompts import prompt_ids
from decodespec.checks.modelcheck.traces import write_trace

RUNTIME = "hf"


@pytest.fixture(autouse=True)
def only_hf(gate_runtime: str) -> None:
    if gate_runtime.split(":", 1)[0] != RUNTIME:
        pytest.skip("HF peer cases: run pytest checks/ --runtime hf")


def _first_tie_rank(model: str, prompt: tuple[int, ...]) -> int:
    """k such that the k-th and (k+1)-th largest scores of HF's own first row are equal (float32).

    HF's row, not the reference row: the two agree within the tolerance, not bit for bit, so a
    tie of one need not be a tie of the other; the ladder judges the policy on the runtime's own row.
    """
    from decodespec.checks.adapters.hf import create

    adapter = create()
    try:
        adapter.reset(CaseConfig(model=model, prompt_ids=prompt, max_new_tokens=1, eos_ids=[2]))
        assert adapter.apply({"op": "prefill", "chunk": None}).ok
        row = adapter.observe().score_row  # float32[V]
    finally:
        adapter.close()
    ranked = np.sort(row)[::-1]
    ties = np.nonzero(ranked[:-1] == ranked[1:])[0]
    assert ties.size, "no exact tie in HF's first row"
    return int(ties[0]) + 1


def peer_cases(model: str) -> tuple[Case, ...]:
    """HF-specific cases on ``model`` (ids ``peer.hf.*``)."""
    hello = prompt_ids(model, "Hello there")
    base = CaseConfig(model=model, prompt_ids=hello, max_new_tokens=2, eos_ids=[2], seed=11)
    cases = []
    if model == "smollm2":
        k = _first_tie_rank(model, hello)
        cases.append(Case("peer.hf.top_k_tie", "lockstep",
                          f"top-k with k = {k}, where the k-th and (k+1)-th scores of HF's first row are equal: exactly k ids "
                          "survive (temperature 0.05 first, HF's order, so that both sides draw the top id whatever the RNG and "
                          "the support is what differs).",
                          "M3.8 0x0D top-k; docs/design.md section 7 (tie rule)",
                          base.evolve(policy={"family": "multinomial", "order": "hf", "transforms": [
                              {"name": "temperature", "temperature": 0.05}, {"name": "top_k", "k": k}]}, max_new_tokens=1),
                          ({"op": "step"},), requires=frozenset({"sampling", "policy_rows"})))
    return tuple(cases)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "peer_case" in metafunc.fixturenames:
        from decodespec.checks.conftest import _model

        runtime = metafunc.config.getoption("--runtime").split(":", 1)[0]
        cases = peer_cases(_model(metafunc.config)) if runtime == RUNTIME else ()
        metafunc.parametrize("peer_case", cases, ids=[c.id for c in cases])


def test_peer_gate_case(peer_case: Case, gate_runtime: str, gate_expectations, gate_report) -> None:
    """One HF-specific case: lock step with the spec, the ladder in order, HF's expectations applied."""
    result = run_case(peer_case, gate_runtime, expectations=gate_expectations)
    gate_report.add(result)
    if result.result == "skip":
        pytest.skip(result.reason)
    if result.result == "fail":
        where = f"; trace: {write_trace(result.trace)}" if result.trace is not None else ""
        v = result.verdict
        pytest.fail(f"{peer_case.id}: {v.rule} {v.check} at step {v.step}: {v.message}{where}", pytrace=False)
    if result.result == "undecided":
        warnings.warn(f"{peer_case.id}: undecided: {result.verdict.message}", stacklevel=1)


def test_hf_right_padded_row_decides_on_the_pad_column(gate_model: str) -> None:
    """hf.right_padded_generate: HF's first decision row of a right-padded shorter prompt is the pad column's logits.

    The batched ``generate`` (:func:`~decodespec.checks.adapters.hf.batch_generate`) row equals
    HF's forward at the last (pad) column, not at the row's own last prompt token, which is what
    the spec and HF's own batch-size-one run decide on.
    """
    import torch

    from decodespec.checks.adapters.hf import batch_generate, hf_model

    long, short = prompt_ids(gate_model, "héllo ✓ 日本"), prompt_ids(gate_model, "Hi")
    assert len(short) < len(long)
    config = CaseConfig(model=gate_model, prompt_ids=long, max_new_tokens=1, eos_ids=[2])
    (_, long_rows), (_, short_rows) = batch_generate(config, [long, short], "right")
    model = hf_model(gate_model)
    ids = torch.full((2, len(long)), int(model.config.pad_token_id or 0), dtype=torch.long)  # [B, L_max]
    ids[0], ids[1, :len(short)] = torch.tensor(long), torch.tensor(short)
    mask = (torch.arange(len(long))[None] < torch.tensor([[len(long)], [len(short)]])).long()  # [B, L_max]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, L_max], GenerationMixin._prepare_position_ids_for_generation
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=positions).logits.float()  # [B, L_max, V]
        alone = model(torch.tensor([short])).logits[0, -1].float()  # [V]
    np.testing.assert_allclose(long_rows[0], padded[0, -1].numpy(), atol=1e-4)
    np.testing.assert_allclose(short_rows[0], padded[1, -1].numpy(), atol=1e-4)  # the pad column ...
    assert float((torch.from_numpy(short_rows[0]) - alone).abs().max()) > 1.0  # ... not the row's own last token


def test_hf_sampling_follows_the_global_rng(gate_model: str) -> None:
    """hf.global_rng: HF's draw depends on every other torch draw in the process; the spec's replay does not.

    Two HF runs with the same seed agree; one torch draw between two HF steps changes HF's path.
    """
    import torch

    from decodespec.checks.adapters.hf import create

    config = CaseConfig(model=gate_model, prompt_ids=prompt_ids(gate_model, "Hello there"), max_new_tokens=6, eos_ids=[],
                        policy={"family": "multinomial", "transforms": [{"name": "temperature", "temperature": 1.5}]}, seed=5)
    adapter = create()

    def path(interleave: bool) -> tuple[int, ...]:
        adapter.reset(config)
        assert adapter.apply({"op": "step"}).ok
        if interleave:
            torch.rand(1)  # somebody else's draw (another request, a dropout layer, a test)
        assert adapter.apply({"op": "run"}).ok
        return adapter.observe().output_ids

    alone = path(False)
    assert path(False) == alone  # same global seed, nothing in between: HF replays itself
    assert path(True) != alone  # one foreign draw: HF's path moves
    adapter.close()
