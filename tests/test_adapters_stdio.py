"""The JSON-lines stdio form: our runtime behind ``python -m decodespec.checks.adapters.stdio_server`` is judged exactly
as the in-process impl adapter (checks/adapters/stdio.py, checks/adapters/stdio_server.py).

Every lock-step case of the tiny table that exercises a distinct part of the contract (sampled
draws, chunked prefill, decide / commit with stale receipts, launch / fault / recover, cancels,
snapshots with corrupted restores, static reuse, streaming, stop strings, structured output, a
refused G = 0 request) runs through one server process and in process: every step's runtime
result, spec result, observation summary and verdict are equal, and so are the case results of
:func:`~decodespec.checks.gate.cases.run_case`.

Source: research/formal-anchors-survey.md 4.4 and 5.4 (Bowtie: one harness, any process); docs/design.md section 11.
"""

from __future__ import annotations

import pytest

from decodespec.checks.gate.cases import cases_for, run_case
from decodespec.checks.gate.lockstep import LockStep
from decodespec.checks.modelcheck.traces import open_runtime

SERVER = "stdio:python -m decodespec.checks.adapters.stdio_server"
CASES = ("matrix.sampled_lockstep", "matrix.static_chunked_prefill", "adversarial.duplicate_stale_receipt",
         "adversarial.device_fault_retry", "adversarial.cancel_in_flight", "adversarial.corrupt_restore",
         "adversarial.static_reuse_shorter", "boundary.stop_patterns_shared_prefix", "boundary.structured_nested_json",
         "boundary.utf8_split_streamed", "boundary.zero_new_tokens_reject")


@pytest.fixture(scope="module")
def server():
    adapter = open_runtime(SERVER, "tiny")
    yield adapter
    adapter.close()


def _records(adapter, case, runtime: str) -> list[dict]:
    ls = LockStep(adapter, case.config, runtime=runtime)
    ls.reset()
    for action in case.actions:
        if ls.failed:
            break
        ls.apply(action)
    return [{k: v for k, v in r.to_json().items() if k != "spec_state"} for r in ls.records]


def test_the_server_declares_the_impl_adapters_capabilities(server):
    local = open_runtime("impl", "tiny")
    try:
        assert server.capabilities() == local.capabilities()
    finally:
        local.close()


@pytest.mark.parametrize("case_id", CASES)
def test_stdio_lock_step_equals_in_process(server, case_id: str):
    """Step by step: the same runtime results, spec results, observations and verdicts (the runtime name aside)."""
    case = next(c for c in cases_for("tiny") if c.id == case_id)
    assert case.kind == "lockstep"
    local = open_runtime("impl", "tiny")
    try:
        want = _records(local, case, "impl")
    finally:
        local.close()
    got = _records(server, case, "impl")
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(want, got)):
        assert b == a, f"{case_id} step {index} ({a['action']['op']}) differs through stdio"


def test_run_case_results_are_equal():
    """The gate's classification through a fresh server process (the --runtime stdio:CMD path) equals in-process."""
    case = next(c for c in cases_for("tiny") if c.id == "adversarial.corrupt_restore")
    local, remote = run_case(case, "impl"), run_case(case, SERVER)
    assert remote.result == local.result == "pass" and remote.verdict == local.verdict


@pytest.mark.parametrize("first", ["none", "omitted"])
def test_stdio_prompt_logprobs_equal_in_process(server, first: str):
    """The wire's ``prompt_logprobs`` command (issue 19): the server's entries equal the in-process adapter's, and a
    refusal comes back typed (M3.10 0x02)."""
    from decodespec.spec.errors import DecodeSpecError
    from decodespec.spec.prompt_logprobs import PromptLogprobsSpec

    case = next(c for c in cases_for("tiny") if c.id == "matrix.prompt_logprobs")
    spec = PromptLogprobsSpec(first_token=first, top_k=3)
    bad = case.config.evolve(prompt_ids=(10**6,))  # an id outside the vocabulary
    local = open_runtime("impl", "tiny")
    try:
        want = tuple(local.prompt_logprobs(case.config, spec))
        with pytest.raises(DecodeSpecError) as local_exc:
            local.prompt_logprobs(bad, spec)
    finally:
        local.close()
    got = server.prompt_logprobs(case.config, spec)
    assert got == want and len(got) == len(case.config.prompt_ids) - (first == "omitted")
    with pytest.raises(DecodeSpecError) as exc:
        server.prompt_logprobs(bad, spec)
    assert exc.value.code == local_exc.value.code == "runtime.invalid_request"
