"""Runtime restore refuses a ledger the spec refuses: call counters, generation, score rows, finish state.

``transition.restore``'s check "finish state, bounds and counters are consistent" (and the receipt
and score-row checks before it, all ``snapshot.ledger_invalid``, ``spec/snapshot.py``
``RESTORE_CHECKS``) is checked again by the runtime (``impl/snapshot.py``, written over the
runner's own bookkeeping, without calling the spec).  Each corrupted record below is refused by
the runtime **and** by the spec with the same code, before any state is built: the sink sees no
event and a given cache keeps its rows.  The first case is the former accepted deviation
``impl.restore_counters_unchecked`` (no cache, cancelled before launch, a record claiming P = 1
after no model call); its lock-step regression is ``traces/adversarial-restore-counters-mismatch.itf.json``.

Source: M3.10 0x06 "One selection is an output-state transaction", 0x00 "Immutable identity
versus mutable request state".
"""

from __future__ import annotations

import attrs
import pytest
import torch
from runtime_helpers import request  # tests/ is on sys.path

from decodespec.checks.modelcheck.trace_validation import params_from_header
from decodespec.impl.events import ListSink
from decodespec.impl.runtime import RequestRunner
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection
from decodespec.spec.snapshot import SNAPSHOT_LEDGER_INVALID, restore_failure

PROMPT = (1, 40, 41, 42)


def _spec_code(runner: RequestRunner, record) -> str | None:
    header = {"identity": runner.request.identity, "prompt_ids": list(runner.request.prompt_ids), "params": runner.spec_params()}
    failed = restore_failure(params_from_header(header), record)
    return None if failed is None else failed.code


def _refused_by_both(model, runner: RequestRunner, snapshot, **kwargs) -> str:
    """Restore ``snapshot`` on the runtime; both sides must refuse with one code; returns it."""
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(model, snapshot, **kwargs)
    assert _spec_code(runner, snapshot.record) == info.value.code
    return info.value.code


def test_restore_refuses_processed_rows_without_a_model_call(tiny_model):
    """transition.restore: no cache, cancelled before launch, the record claims P = 1 after 0 calls (was impl.restore_counters_unchecked)."""
    runner = RequestRunner(tiny_model, request(PROMPT[:1], 1, cache="none"))
    runner.admit()
    runner.cancel()
    good = runner.snapshot("pending_suffix")
    assert good.record.num_calls == 0 and good.record.generation == 0 and good.record.processed == 0
    bad = attrs.evolve(good, record=attrs.evolve(good.record, processed=1))
    sink = ListSink()
    assert _refused_by_both(tiny_model, runner, bad, sink=sink) == SNAPSHOT_LEDGER_INVALID
    assert sink.records == []  # nothing built, nothing emitted
    # one call is not enough either: the processed rows need an ALL_NEW call (generation >= 1)
    one_call = attrs.evolve(good, record=attrs.evolve(good.record, processed=1, num_calls=1))
    assert _refused_by_both(tiny_model, runner, one_call) == SNAPSHOT_LEDGER_INVALID
    restored = RequestRunner.restore(tiny_model, good)  # the uncorrupted record restores
    assert restored.finish_reason is FinishReason.CANCELLED and restored.processed == 0


@pytest.fixture
def mid_run(tiny_model):
    """A dynamic-cache greedy run suspended after 2 outputs, and its pending-suffix snapshot."""
    runner = RequestRunner(tiny_model, request(PROMPT, 4, cache="dynamic")).run(max_outputs=2)
    return runner, runner.snapshot("pending_suffix")


@pytest.mark.parametrize("change", [
    lambda r: {"num_calls": 0},
    lambda r: {"generation": 0},
    lambda r: {"generation": len(r.scores) - 1},
    lambda r: {"num_retries": 1},
    lambda r: {"num_calls": -1},
    lambda r: {"triggers": frozenset({FinishReason.LENGTH})},
    lambda r: {"scores": r.scores + r.scores[:1]},
    lambda r: {"issued": r.issued + r.issued[:1]},
    lambda r: {"consumed": (attrs.evolve(r.consumed[0], score_id=r.consumed[1].score_id),) + r.consumed[1:]},
], ids=["no-calls", "generation-0", "generation-below-scores", "retries-over-max", "negative-calls",
        "triggers-before-finish", "score-id-repeated", "receipt-issued-twice", "receipt-on-another-row"])
def test_restore_refuses_a_ledger_the_spec_refuses(tiny_model, mid_run, change):
    """transition.restore: ledger corruptions between calls are refused by the runtime with the spec's code, changing nothing."""
    runner, good = mid_run
    bad = attrs.evolve(good, record=attrs.evolve(good.record, **change(good.record)))
    assert _refused_by_both(tiny_model, runner, bad) == SNAPSHOT_LEDGER_INVALID
    assert _spec_code(runner, good.record) is None
    resumed = RequestRunner.restore(tiny_model, good).run()
    assert resumed.output_count == 4


def test_restore_refuses_a_finish_reason_that_is_not_the_first_trigger(tiny_model):
    """transition.restore: a finished record's reason must be the first trigger under the finish precedence."""
    runner = RequestRunner(tiny_model, request(PROMPT, 2, cache="static")).run()
    good = runner.snapshot("pending_suffix")
    assert good.record.finish_reason is FinishReason.LENGTH
    # {length, cancelled} publishing length is a cancelled repair call after the close (legal); stream_error cannot be.
    for triggers, reason in ((frozenset({FinishReason.LENGTH, FinishReason.STREAM_ERROR}), FinishReason.LENGTH),
                             (frozenset(), FinishReason.LENGTH)):
        bad = attrs.evolve(good, record=attrs.evolve(good.record, triggers=triggers, finish_reason=reason))
        cache_rows = runner.cache.committed_tensors()[0][0].clone()
        assert _refused_by_both(tiny_model, runner, bad, cache=runner.cache) == SNAPSHOT_LEDGER_INVALID
        assert runner.cache.committed_tensors()[0][0].equal(cache_rows)  # the given cache was not reset


@pytest.mark.parametrize("cache, chunk, code", [
    ("none", None, "snapshot.frontier_invalid"),
    ("dynamic", None, "snapshot.frontier_invalid"),
    ("dynamic", 2, "snapshot.ledger_invalid"),
])
def test_restore_before_prefill_accepts_a_partial_prompt_only_between_chunks(tiny_model, cache, chunk, code):
    """transition.restore: before any output, 0 < P < L is the prefill shape only for a chunked prefill into a cache.

    Without chunks it breaks ``P + |U| = L + O`` (``snapshot.frontier_invalid``); with chunks the
    frontier is fine and the ledger refuses P = 1 after no model call (``snapshot.ledger_invalid``).
    """
    runner = RequestRunner(tiny_model, request(PROMPT, 2, cache=cache, prefill_chunk=chunk))
    runner.admit()
    good = runner.snapshot("pending_suffix")
    lanes = (("self_kv", 1),) if cache != "none" else ()
    bad = attrs.evolve(good, record=attrs.evolve(good.record, processed=1, lanes=lanes),
                       tensors=None if cache == "none" else _one_row(tiny_model))
    assert _refused_by_both(tiny_model, runner, bad) == code


def _one_row(model):
    """A ``[1, H_kv, 1, D]`` K/V row per layer of ``model`` (zeros; only the shapes matter to the frontier checks)."""
    abi = model.cache_abi
    row = torch.zeros(1, abi.num_key_value_heads, 1, abi.head_dim, dtype=getattr(torch, abi.dtype))
    return [(row, row) for _ in range(abi.num_layers)]
