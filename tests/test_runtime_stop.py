"""Stop strings, structured completion and streaming through the request controller (tiny model).

The runner's output transaction (M3.10 0x06 "One selection is an output-state transaction";
``impl/output.py`` wired into ``RequestRunner.commit``) is compared with the spec's oracle
(``decodespec.spec.stop.reference_stream`` over the tokens the runner committed): returned ids,
logprobs, text, overhang and every published chunk.  Every trace is replayed by trace validation
with the tokenizer's bytes (``checks/modelcheck/trace_validation.py``), and hand-broken stream traces are
rejected at the right line.  Rules: ``transition.commit`` (``Commit.stream_failed``),
``invariant.stop_triggers``, ``invariant.stream_frontier``, ``invariant.stream_prefix``,
``invariant.stream_final``, ``invariant.stream_no_stop_bytes``, ``invariant.chunk_metadata``,
``invariant.output_alignment``.
"""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from runtime_helpers import renumber, request  # tests/ is on sys.path

from decodespec.checks.modelcheck.trace_validation import token_bytes_of, validate_trace
from decodespec.impl.events import ListSink
from decodespec.impl.faults import FaultPlan, Interrupt, StreamFailureAt
from decodespec.impl.generate import generate
from decodespec.impl.runtime import RequestRunner
from decodespec.impl.snapshot import load_snapshot, save_snapshot
from decodespec.spec import transitions as T
from decodespec.spec.actions import Commit
from decodespec.spec.enums import FinishReason as FR
from decodespec.spec.errors import Rejection
from decodespec.spec.state import InterruptPoint, PendingTag
from decodespec.spec.stop import reference_stream

G = 12


class Consumer:
    """A stream consumer that records chunks and raises at chunk ``fail_at`` (never, by default)."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at
        self.chunks = []

    def __call__(self, chunk) -> None:
        if chunk.chunk_idx == self.fail_at:
            raise BrokenPipeError("consumer went away")
        self.chunks.append(chunk)


@pytest.fixture(scope="module")
def prompt(byte_tokenizer):
    return [1, *byte_tokenizer.encode("trace")]


@pytest.fixture(scope="module")
def free(tiny_model, byte_tokenizer, prompt):
    """The greedy continuation without stop strings (runs to ``length``)."""
    result = RequestRunner(tiny_model, request(prompt, G), tokenizer=byte_tokenizer).run().result()
    assert result.finish_reason is FR.LENGTH and len(result.output_ids) == G
    return result


def run(model, tok, prompt, g=G, *, consumer=None, faults=None, **changes):
    """Run one streamed request; return (runner, result, trace lines)."""
    sink = ListSink()
    changes.setdefault("stream", True)
    runner = RequestRunner(model, request(prompt, g, **changes), tokenizer=tok, sink=sink, faults=faults, on_chunk=consumer)
    runner.run()
    return runner, runner.result(), sink.lines()


def accepted(lines, tok):
    verdict = validate_trace(lines, token_bytes=token_bytes_of(tok))
    assert verdict.accepted, verdict
    return verdict


def reference(runner, tok):
    """The spec's reference run over the tokens the runner committed."""
    ids = runner.output_ids
    tb = [b"" if i in tok.special_ids or i in runner.request.eos_ids else tok.token_bytes(i) for i in ids]
    return reference_stream(runner.stop_config, ids, tb, runner.logprobs, external=None)


def stream_events(lines):
    return [json.loads(line) for line in lines if json.loads(line)["event"] == "stream"]


@settings(max_examples=40)
@given(data=st.data())
def test_controller_output_equals_the_spec_reference(tiny_model, byte_tokenizer, prompt, free, data):
    """invariant.output_alignment, invariant.stream_frontier, invariant.stream_final: runner == reference_stream."""
    text = free.text
    substring = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4)).map(lambda p: text[p[0]:p[0] + p[1]])
    stops = data.draw(st.lists(st.one_of(substring, st.text("BHo$ xyz", min_size=1, max_size=3)), min_size=1, max_size=3, unique=True))
    alignment = data.draw(st.sampled_from(["token", "text", "span"]))
    include = data.draw(st.booleans())
    min_new = data.draw(st.integers(0, 4))
    consumer = Consumer()
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=tuple(stops), alignment=alignment,
                                include_stop_str=include, min_new_tokens=min_new, consumer=consumer)
    ref = reference(runner, byte_tokenizer)
    out = ref.output
    assert out is not None and result.finish_reason is out.finish_reason and result.triggers == out.triggers
    assert (result.output_ids, result.logprobs, result.text) == (out.output_ids, out.logprobs, out.text)
    assert (result.overhang, result.token_spans, result.visible_end) == (out.overhang, out.token_spans, out.visible_end)
    assert len(result.logprobs) == len(result.output_ids)
    assert tuple(consumer.chunks) == ref.chunks == result.chunks
    assert "".join(c.text for c in consumer.chunks) == result.text
    assert [c["chunk_idx"] for c in stream_events(lines)] == list(range(len(ref.chunks)))
    assert runner.output_ids == list(free.output_ids[:runner.output_count])  # stop strings never change selection
    accepted(lines, byte_tokenizer)


def test_stop_over_three_tokens_trims_and_never_streams_it(tiny_model, byte_tokenizer, prompt, free):
    """A stop string over three byte tokens: cut at the match, nothing of it published, under each alignment."""
    data = free.text.encode()
    stop = data[3:6].decode()  # "$BB": three tokens
    for alignment in ("token", "text", "span"):
        consumer = Consumer()
        runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(stop,), alignment=alignment, consumer=consumer)
        assert result.finish_reason is FR.STOP_STRING and runner.output_count == 6 and result.stop_match == (stop, 3, 6)
        assert result.text == free.text[:3] and "".join(c.text for c in consumer.chunks) == free.text[:3]
        assert all(c.byte_end <= 3 for c in consumer.chunks)
        kept = 6 if alignment == "span" else 3
        assert result.output_ids == free.output_ids[:kept] and result.logprobs == free.logprobs[:kept]
        assert runner.pending_tag is PendingTag.CLOSED_UNPROCESSED and runner.frontier()["output_count"] == 6
        accepted(lines, byte_tokenizer)


def test_prefix_stops_first_token_stop_and_unmatched_stop(tiny_model, byte_tokenizer, prompt, free):
    """Earliest-ending match first, then the longest; a match by the very first token; an unmatched stop flushes all."""
    text = free.text
    _, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(text[3:7], text[3:5]), alignment="text")
    assert result.stop_match == (text[3:5], 3, 5) and result.text == text[:3]  # the shorter one ends first
    accepted(lines, byte_tokenizer)
    _, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(text[4:6], text[3:6]), alignment="text")
    assert result.stop_match == (text[3:6], 3, 6) and result.text == text[:3]  # same end byte: the longest wins
    accepted(lines, byte_tokenizer)
    consumer = Consumer()
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(text[0],), consumer=consumer)
    assert runner.output_count == 1 and result.text == "" and result.output_ids == () and consumer.chunks == []
    assert result.finish_reason is FR.STOP_STRING and stream_events(lines) == []
    accepted(lines, byte_tokenizer)
    consumer = Consumer()
    absent = text[-1] + "\u00e9" + text[0]
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(absent,), consumer=consumer)
    assert result.finish_reason is FR.LENGTH and result.text == text and result.output_ids == free.output_ids
    assert "".join(c.text for c in consumer.chunks) == text and consumer.chunks[-1].byte_end == len(text)
    accepted(lines, byte_tokenizer)


def test_min_new_tokens_suppresses_stop_strings_and_eos(tiny_model, byte_tokenizer, prompt, free):
    """Declared: min_new_tokens suppresses stop strings (here the first token's) and EOS until reached."""
    first = free.text[0]
    later = free.text.index(first, 3)
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(first,), min_new_tokens=3, alignment="text")
    assert runner.output_count == later + 1 and result.stop_match == (first, later, later + 1) and result.text == free.text[:later]
    accepted(lines, byte_tokenizer)
    eos = free.output_ids[0]
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, eos_ids=frozenset({eos}), min_new_tokens=3)
    assert eos not in runner.output_ids[:3] and result.finish_reason in (FR.EOS, FR.LENGTH)
    assert chr(eos - 3) not in result.text[-1:] or result.finish_reason is FR.LENGTH  # EOS never in the text
    accepted(lines, byte_tokenizer)


def test_json_mode_through_the_controller(tiny_model, byte_tokenizer, prompt, free):
    """Structured completion: the tiny model's first byte is not JSON, so structured_error fires at once."""
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, structured="json")
    assert runner.output_count == 1 and result.finish_reason is FR.STRUCTURED_ERROR and result.text == free.text[:1]
    accepted(lines, byte_tokenizer)


# --------------------------------------------------------------------------------------------
# Stream failures (declared output-transaction policy).
# --------------------------------------------------------------------------------------------


def test_delivery_failure_mid_stream_keeps_the_committed_output(tiny_model, byte_tokenizer, prompt, free):
    consumer = Consumer(fail_at=2)
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, consumer=consumer)
    assert runner.output_count == 3 and result.finish_reason is FR.STREAM_ERROR and result.triggers == (FR.STREAM_ERROR,)
    assert result.output_ids == free.output_ids[:3] and result.text == free.text[:3]
    assert result.stream == {"chunks": 2, "delivered_bytes": 2, "delivered_tokens": 2, "failed": True,
                             "error": "BrokenPipeError: consumer went away"}
    commit = [json.loads(line) for line in lines if json.loads(line)["event"] == "commit"][-1]
    assert commit["stream_failed"] is True and commit["triggers"] == ["stream_error"]
    accepted(lines, byte_tokenizer)


def test_delivery_failure_at_the_finishing_commit_is_reported(tiny_model, byte_tokenizer, prompt, free):
    """A stream failure at a commit that also fires length is reported: stream_error outranks it, both recorded."""
    text = free.text
    g = 9
    stop = text[7:9] + "x"  # a prefix of it is held back until length closes the output at output 8
    probe = Consumer()
    run(tiny_model, byte_tokenizer, prompt, g, stop_strings=(stop,), consumer=probe)
    last = probe.chunks[-1]
    assert last.token_end == g and last.byte_start == 7  # the final flush is published by the finishing commit
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, g, stop_strings=(stop,), consumer=Consumer(fail_at=last.chunk_idx))
    assert result.finish_reason is FR.STREAM_ERROR and result.triggers == (FR.STREAM_ERROR, FR.LENGTH)
    assert runner.output_count == g and result.output_ids == free.output_ids[:g] and result.text == text[:g]
    assert result.stream["failed"] and result.stream["delivered_bytes"] == 7
    commit = [json.loads(line) for line in lines if json.loads(line)["event"] == "commit"][-1]
    assert commit["stream_failed"] is True and commit["triggers"] == ["stream_error", "length"]
    accepted(lines, byte_tokenizer)
    # The fault plan's stream failure after the final commit is reported the same way (never dropped).
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, g, faults=FaultPlan.of(StreamFailureAt(g - 1)))
    assert result.finish_reason is FR.STREAM_ERROR and result.triggers == (FR.STREAM_ERROR, FR.LENGTH)
    accepted(lines, byte_tokenizer)


def test_spec_commit_with_a_stream_failure(tiny_model, byte_tokenizer, prompt):
    """transition.commit: Commit.stream_failed adds stream_error (finishing or not) and needs a stream."""
    from decodespec.spec.actions import Admit, Complete, Decide, Launch
    from decodespec.spec.enums import CallKind
    from decodespec.spec.state import RequestParams, initial_state

    def decided(stream: bool, g: int):
        params = RequestParams(identity="t", prompt_len=2, max_new_tokens=g, vocab_size=8, eos_ids=frozenset(), stream=stream,
                               cache_family="dynamic", context_cap=16)
        s = T.step(params, initial_state(params), Admit())
        s = T.step(params, s, Launch(CallKind.PREFILL, 0, 2))
        s = T.step(params, s, Complete(0, 0, (("self_kv", 2),), True, 1))
        return params, T.step(params, s, Decide(s.score.score_id, 3, 0))

    params, state = decided(True, 1)
    done = T.step(params, state, Commit("receipt-0", stream_failed=True))
    assert done.finish_reason is FR.STREAM_ERROR and done.triggers == {FR.STREAM_ERROR, FR.LENGTH}
    params, state = decided(True, 4)
    done = T.step(params, state, Commit("receipt-0", stream_failed=True))
    assert done.finish_reason is FR.STREAM_ERROR and done.pending_tag is PendingTag.CLOSED_UNPROCESSED
    params, state = decided(False, 4)
    with pytest.raises(Rejection, match="needs a stream"):
        T.step(params, state, Commit("receipt-0", stream_failed=True))


def test_flush_failure_at_an_external_close_is_reported(tiny_model, byte_tokenizer, prompt, free):
    """A cancel closes the output and flushes the held-back bytes; a failing flush shows in the stream report."""
    text = free.text
    stop = text[4:6] + "x"
    plan = FaultPlan.of(Interrupt(FR.CANCELLED, 6, InterruptPoint.BEFORE_LAUNCH))
    probe = Consumer()
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(stop,), faults=plan, consumer=probe)
    assert result.finish_reason is FR.CANCELLED and runner.output_count == 6 and result.text == text[:6]
    assert probe.chunks[-1].byte_start == 4 and probe.chunks[-1].text == text[4:6]  # the flush of the held-back prefix
    accepted(lines, byte_tokenizer)
    runner, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(stop,), faults=plan,
                                consumer=Consumer(fail_at=probe.chunks[-1].chunk_idx))
    assert result.finish_reason is FR.CANCELLED and result.triggers == (FR.CANCELLED,)
    assert result.stream["failed"] and result.stream["delivered_bytes"] == 4
    accepted(lines, byte_tokenizer)
    records = [json.loads(line) for line in lines]
    records[-1]["stream"]["failed"] = False
    records[-1]["stream"]["error"] = None  # else the report contradicts itself first (an error fails the delivery)
    verdict = validate_trace(renumber(records), token_bytes=token_bytes_of(byte_tokenizer))
    assert not verdict.accepted and verdict.line == len(records) and "invariant.stream_final" in verdict.reason


def test_chunk_consumer_and_stop_settings_are_validated(tiny_model, byte_tokenizer, prompt):
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request(prompt, 4), tokenizer=byte_tokenizer, on_chunk=Consumer())
    assert info.value.code == "runtime.invalid_request"
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request(prompt, 4, stream=True), on_chunk=Consumer())  # no tokenizer: no observer
    assert info.value.code == "runtime.invalid_request"
    with pytest.raises(Rejection) as info:
        RequestRunner(tiny_model, request(prompt, 4, alignment="bytes"), tokenizer=byte_tokenizer)
    assert info.value.code == "stop.invalid_alignment"
    for structured in ("grammar", "JSON", ""):  # only the envelope's enum: an unknown value never runs as none
        with pytest.raises(Rejection) as info:
            RequestRunner(tiny_model, request(prompt, 4, structured=structured), tokenizer=byte_tokenizer)
        assert (info.value.code, info.value.path) == ("runtime.invalid_request", "$.termination.structured")
    with pytest.raises(Rejection) as info:
        generate(tiny_model, prompt, max_new_tokens=4, tokenizer=byte_tokenizer, stop_strings="B")
    assert info.value.code == "stop.pattern_type"


def test_zero_new_tokens_streams_nothing(tiny_model, byte_tokenizer, prompt):
    consumer = Consumer()
    _runner, result, lines = run(tiny_model, byte_tokenizer, prompt, 0, stop_strings=("B",), consumer=consumer)
    assert result.finish_reason is FR.LENGTH and result.text == "" and result.output_ids == () and consumer.chunks == []
    assert result.stream == {"chunks": 0, "delivered_bytes": 0, "delivered_tokens": 0, "failed": False, "error": None}
    accepted(lines, byte_tokenizer)


# --------------------------------------------------------------------------------------------
# Snapshots: resume equivalence with stop strings and streaming.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["pending_suffix", "repaired"])
def test_resume_publishes_the_same_stream(tiny_model, byte_tokenizer, prompt, free, form, tmp_path):
    """The stop/stream state rides in the snapshot: a resumed run publishes exactly the remaining chunks."""
    stop = free.text[8:10]
    kwargs = {"stop_strings": (stop,), "alignment": "span", "cache": "static", "final_cache": "all_outputs"}
    whole = Consumer()
    _, expected, _ = run(tiny_model, byte_tokenizer, prompt, consumer=whole, **kwargs)
    assert expected.finish_reason is FR.STOP_STRING
    for k in range(expected.num_committed + 1):
        first, second = Consumer(), Consumer()
        runner = RequestRunner(tiny_model, request(prompt, G, stream=True, **kwargs), tokenizer=byte_tokenizer, on_chunk=first)
        snapshot = runner.run(max_outputs=k).snapshot(form)
        if k == 2:  # through the files once
            save_snapshot(snapshot, tmp_path / "s.json")
            snapshot = load_snapshot(tmp_path / "s.json")
        sink = ListSink()
        resumed = RequestRunner.restore(tiny_model, snapshot, tokenizer=byte_tokenizer, on_chunk=second, sink=sink).run()
        assert first.chunks + second.chunks == whole.chunks
        assert attrs.evolve(resumed.result(), receipts=()) == attrs.evolve(expected, receipts=())  # receipts: this run's only
        accepted(sink.lines(), byte_tokenizer)


def test_restore_refuses_an_output_state_that_does_not_replay(tiny_model, byte_tokenizer, prompt):
    runner = RequestRunner(tiny_model, request(prompt, G, stream=True), tokenizer=byte_tokenizer, on_chunk=Consumer())
    snapshot = runner.run(max_outputs=3).snapshot()
    state = dict(snapshot.observer_state, chunks=1)
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, attrs.evolve(snapshot, observer_state=state), tokenizer=byte_tokenizer)
    assert info.value.code == "snapshot.ledger_invalid"
    with pytest.raises(Rejection) as info:
        RequestRunner.restore(tiny_model, attrs.evolve(snapshot, observer_state={"format": "x"}), tokenizer=byte_tokenizer)
    assert info.value.code == "snapshot.malformed"


# --------------------------------------------------------------------------------------------
# Hand-broken stream traces are rejected at the right line.
# --------------------------------------------------------------------------------------------


def _stop_trace(tiny_model, byte_tokenizer, prompt, free):
    stop = free.text[3:6]
    _, result, lines = run(tiny_model, byte_tokenizer, prompt, stop_strings=(stop,), alignment="text")
    assert result.finish_reason is FR.STOP_STRING
    return [json.loads(line) for line in lines]


def _reject(records, tok, **kwargs):
    verdict = validate_trace(renumber(records), token_bytes=token_bytes_of(tok), **kwargs)
    assert not verdict.accepted
    return verdict


def test_a_chunk_with_held_back_stop_bytes_is_rejected(tiny_model, byte_tokenizer, prompt, free):
    records = _stop_trace(tiny_model, byte_tokenizer, prompt, free)
    chunks = [r for r in records if r["event"] == "stream"]
    assert chunks[-1]["byte_end"] == 3  # the stop "$BB" starts at byte 3: nothing of it was published
    i = next(n for n, r in enumerate(records) if r["event"] == "commit" and r["output_count"] == 4) + 1
    records.insert(i, {"v": 1, "seq": 0, "event": "stream", "chunk_idx": len(chunks), "text": free.text[3], "byte_start": 3,
                       "byte_end": 4, "token_start": 3, "token_end": 4})  # "$": the stop's first byte, still held back
    verdict = _reject(records, byte_tokenizer)
    assert (verdict.line, verdict.event) == (i + 1, "stream") and "beyond the stream horizon" in verdict.reason
    # Without the token bytes only the structure is checked: the chunk itself passes, the final text does not.
    verdict = validate_trace(renumber(records))
    assert verdict.event == "finish" and "stream.chunks" in verdict.reason


def test_retracted_overlapping_and_early_chunks_are_rejected(tiny_model, byte_tokenizer, prompt, free):
    records = _stop_trace(tiny_model, byte_tokenizer, prompt, free)
    hits = [n for n, r in enumerate(records) if r["event"] == "stream"]
    overlap = [dict(r) for r in records]
    overlap[hits[1]].update(byte_start=0, text=free.text[:2], token_start=0)
    verdict = _reject(overlap, byte_tokenizer)
    assert (verdict.line, verdict.event) == (hits[1] + 1, "stream") and "never retracted" in verdict.reason
    early = [dict(r) for r in records]
    chunk = early.pop(hits[1])
    commit = max(n for n in range(hits[1]) if early[n]["event"] == "commit")
    early.insert(commit, chunk)  # published before the commit of its token
    verdict = _reject(early, byte_tokenizer)
    assert (verdict.line, verdict.event) == (commit + 1, "stream") and "before its tokens are committed" in verdict.reason
    gap = [dict(r) for r in records]
    del gap[hits[1]]  # a chunk missing: the next one starts too late
    verdict = _reject(gap, byte_tokenizer)
    assert verdict.line == hits[1] + 1 and "stream frontier" in verdict.reason


def test_a_commit_whose_text_triggers_disagree_with_the_stop_oracle_is_rejected(tiny_model, byte_tokenizer, prompt, free):
    records = _stop_trace(tiny_model, byte_tokenizer, prompt, free)
    i = [n for n, r in enumerate(records) if r["event"] == "commit"][1]
    records[i].update(triggers=["stop_string"], pending_tag="CLOSED_UNPROCESSED")
    del records[i + 1:]
    records.append({"v": 1, "seq": 0, "event": "finish", "finish_reason": "stop_string", "triggers": ["stop_string"],
                    "frontier": {}})
    verdict = _reject(records, byte_tokenizer)
    assert (verdict.line, verdict.event) == (i + 1, "commit") and "invariant.stop_triggers" in verdict.reason


def test_a_stream_event_in_a_request_that_does_not_stream_is_rejected(tiny_model, byte_tokenizer, prompt):
    _, _, lines = run(tiny_model, byte_tokenizer, prompt, 4, stream=False)
    records = [json.loads(line) for line in lines]
    assert not any(r["event"] == "stream" for r in records) and "stream" not in records[-1]
    i = next(n for n, r in enumerate(records) if r["event"] == "commit")
    records.insert(i + 1, {"v": 1, "seq": 0, "event": "stream", "chunk_idx": 0, "text": "B", "byte_start": 0, "byte_end": 1,
                           "token_start": 0, "token_end": 1})
    verdict = _reject(records, byte_tokenizer)
    assert verdict.line == i + 2 and "does not stream" in verdict.reason
