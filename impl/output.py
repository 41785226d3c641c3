"""The request controller's output transaction: stop strings, structured completion and streaming.

:class:`OutputObserver` is the :class:`~decodespec.impl.runtime.CommitObserver` that
:class:`~decodespec.impl.runtime.RequestRunner` builds for a request whose tokenizer exposes
``token_bytes`` (SmolLM2's :class:`~decodespec.impl.tokenizer.GGUFTokenizer`, the tiny model's
``ByteTokenizer``).  It wraps one :class:`~decodespec.impl.stream.Streamer` and carries out
steps 3, 4 and 7 of M3.10's output-state transaction for each committed token (the runner does
1, 2, 5, 6 and 8):

1. policy selection (runner: ``decide``);
2. append to the output ledger (runner: ``commit``);
3. feed the incremental detokenizer, 4. update the stop matcher and the structured parser
   (:meth:`OutputObserver.observe` -> ``Streamer.push``);
5. resolve EOS / length / context_length / stop_string / structured / structured_error /
   stream_error precedence (runner, with the text triggers reported here);
6. advance only the RNG draws the decision consumed (runner: the receipt's ``draws``);
7. publish only the bytes behind the stream commit horizon, each chunk with its token and byte
   offsets (``Streamer`` -> the ``on_chunk`` consumer, and the trace's ``stream`` events);
8. expose the token as PENDING_NEXT_CALL or close it CLOSED_UNPROCESSED (runner).

Declared output-transaction policy on a delivery failure (docs/design.md section 2): a consumer
callback that raises closes the output with ``stream_error``; the committed tokens are kept; only
the chunks whose callback returned are claimed delivered (:attr:`OutputObserver.delivered_bytes`).
A failure at a commit is reported with that commit (``Commit.stream_failed``), also when the
commit fires another trigger (``stream_error`` outranks every content trigger).  A failure of the
flush that an external close (``cancelled`` / ``timeout`` / ``device_error``) publishes is reported
in the stream report only (:attr:`OutputObserver.flush_failed`): the spec's interrupt has already
closed the output, and each of these reasons outranks ``stream_error``, so the canonical finish
reason is the same either way.

Snapshots (:meth:`snapshot_state` / :meth:`restore_state`): the state is the committed ids and
logprobs, the number of chunks and bytes delivered, and how the output closed; restoring replays
the ids through a fresh streamer without delivering anything (every component is a function of
the committed bytes), then requires the replay to reproduce exactly the recorded chunk count and
delivered frontier.  A resumed request therefore publishes the same chunks, with the same
indices and offsets, as one that never stopped.

Source: M3.10 0x06 "Streaming has a commit horizon", "One selection is an output-state
transaction", "Deriving the stream holdback", "Token-aligned and text-aligned outputs can
diverge", "Finish reason and RNG precedence", "Constraints before selection, completion after
selection"; 0x00 "Immutable identity versus mutable request state" (restoring ids while
resetting the parser or the stream suffix is a different continuation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from decodespec.spec.actions import TEXT_TRIGGERS
from decodespec.spec.enums import EXTERNAL_FINISH_REASONS, FinishReason
from decodespec.spec.errors import Rejection, quote
from decodespec.spec.request import INVALID_REQUEST
from decodespec.spec.snapshot import SNAPSHOT_LEDGER_INVALID, SNAPSHOT_MALFORMED
from decodespec.spec.stop import AlignedOutput, Chunk, StopConfig
from decodespec.spec.structured import DEFAULT_MAX_JSON_DEPTH

from .observers import CommitObservation
from .stream import Streamer

__all__ = ["OUTPUT_STATE_FORMAT", "OutputObserver", "output_header", "stop_config"]

#: Format name of :meth:`OutputObserver.snapshot_state`.
OUTPUT_STATE_FORMAT = "decodespec.output_state.v1"


def stop_config(request: Any, context_cap: int) -> StopConfig:
    """The :class:`~decodespec.spec.stop.StopConfig` of a :class:`~decodespec.impl.runtime.RuntimeRequest`.

    The count triggers are the runner's own (G, the EOS set, ``min_new_tokens``, L and the context
    cap C), so the streamer closes its output at exactly the commit where the runner finishes.

    Raises:
        Rejection / ResourceLimit: ``stop.*`` for bad stop strings or an unknown alignment.
    """
    return StopConfig(
        max_new_tokens=request.max_new_tokens,
        eos_ids=request.eos_ids,
        min_new_tokens=request.min_new_tokens,
        prompt_len=request.prompt_len,
        max_context_len=context_cap,
        stop_strings=request.stop_strings,
        include_stop_str=request.include_stop_str,
        alignment=request.alignment,
        json_completion=request.structured == "json",
        max_json_depth=DEFAULT_MAX_JSON_DEPTH,
    )


def output_header(config: StopConfig, stream: bool) -> dict[str, Any]:
    """The trace header's ``output`` object: what trace validation rebuilds the :class:`StopConfig` from.

    (The counts -- G, EOS set, ``min_new_tokens``, L, C -- are the header's ``params``.)
    """
    return {
        "stop_strings": list(config.stop_strings),
        "include_stop_str": config.include_stop_str,
        "alignment": config.alignment.value,
        "structured": "json" if config.json_completion else "none",
        "max_json_depth": config.max_json_depth,
        "stream": stream,
    }


class _TextTokenizer:
    """The tokenizer as the output sees it: the request's EOS ids are special too (no bytes in the text).

    Declared choice (docs/design.md section 2): EOS is kept in the output ids and never appears in
    the text, also when a declared EOS id is an ordinary token of the vocabulary.
    """

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.special_ids = frozenset(getattr(tokenizer, "special_ids", ())) | frozenset(eos_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id)


class _ReplayFailure(Exception):
    """Raised by the replay consumer at the chunk whose delivery failed before the snapshot."""


class InjectedStreamFailure(Exception):
    """The delivery failure a fault plan injects (:class:`~decodespec.impl.faults.StreamFailureAt`)."""


class OutputObserver:
    """Stop / structured / stream state of one request; the runner's :class:`CommitObserver`.

    Args:
        tokenizer: ``token_bytes(id)``, ``vocab_size``, ``special_ids`` (special tokens and the
            request's EOS ids contribute no bytes).
        config: The request's :class:`StopConfig` (:func:`stop_config`).
        on_chunk: Consumer called with each published :class:`Chunk` (a streamed request), or
            ``None``.  If it raises, the output closes with ``stream_error`` (module docstring).

    Attributes:
        streamer: The wrapped :class:`~decodespec.impl.stream.Streamer` (read-only use).
        external: The reason of an external close (:meth:`close`), or ``None``.
        flush_failed: Whether the flush published by an external close failed to deliver.
    """

    def __init__(self, tokenizer: Any, config: StopConfig, *, on_chunk: Callable[[Chunk], None] | None = None):
        self.tokenizer = _TextTokenizer(tokenizer, config.eos_ids)
        self.config = config
        self._on_chunk = on_chunk
        self._inject = False
        self.streamer = Streamer(self.tokenizer, config, on_chunk=self._deliver)
        self._ids: list[int] = []
        self._logprobs: list[float | None] = []
        self.external: FinishReason | None = None
        self.flush_failed = False

    # -- views -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Whether the output is closed."""
        return self.streamer.finished

    @property
    def output(self) -> AlignedOutput | None:
        """The returned output under the request's alignment contract, once closed."""
        return self.streamer.output

    @property
    def output_ids(self) -> tuple[int, ...]:
        """Every committed id observed (before any alignment cut)."""
        return tuple(self._ids)

    @property
    def num_committed(self) -> int:
        """Tokens observed (O)."""
        return self.streamer.num_committed

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk published and delivered so far (restored ones included)."""
        return tuple(self.streamer.chunks)

    @property
    def delivered_bytes(self) -> int:
        """The delivered frontier: end of the last delivered chunk, in output bytes."""
        return self.streamer.delivered_bytes

    @property
    def delivery_failed(self) -> bool:
        """Whether the consumer callback raised (at a commit or at the external-close flush)."""
        return self.streamer.stream_error is not None

    @property
    def stream_failed(self) -> bool:
        """Whether the stream failed: a delivery failed, or the runner closed the output with ``stream_error``."""
        return self.delivery_failed or self.external is FinishReason.STREAM_ERROR

    def text_so_far(self) -> str:
        """UTF-8 decode of every committed output byte (U+FFFD for an incomplete tail)."""
        return self.streamer.detokenizer.text()

    def stream_report(self) -> dict[str, Any]:
        """``{"chunks", "delivered_bytes", "delivered_tokens", "failed", "error"}``: what was delivered.

        ``delivered_tokens`` is the ``token_end`` of the last delivered chunk (0 when none);
        ``failed`` is :attr:`stream_failed`; ``error`` the consumer's exception, if it raised.
        """
        chunks = self.streamer.chunks
        error = self.streamer.stream_error
        return {"chunks": len(chunks), "delivered_bytes": self.delivered_bytes,
                "delivered_tokens": chunks[-1].token_end if chunks else 0, "failed": self.stream_failed,
                "error": None if error is None else f"{type(error).__name__}: {error}"}

    # -- the CommitObserver protocol ---------------------------------------------------------
    def _deliver(self, chunk: Chunk) -> None:
        if self._inject:
            self._inject = False
            raise InjectedStreamFailure(f"injected stream failure at chunk {chunk.chunk_idx}")
        if self._on_chunk is not None:
            self._on_chunk(chunk)

    def inject_delivery_failure(self) -> None:
        """Make the next :meth:`observe` fail the delivery of the first chunk it publishes (fault plans)."""
        self._inject = True

    def observe(self, token_id: int, logprob: float, output_index: int):
        """Steps 3, 4 and 7 for committed token ``output_index``: text triggers, failure, chunks published.

        Returns:
            A :class:`~decodespec.impl.observers.CommitObservation`.

        Raises:
            Rejection: ``stop.after_finish`` once closed; ``stop.token_out_of_range``; and
                ``runtime.invalid_request`` when ``output_index`` is not the next index.
        """
        if output_index != self.streamer.num_committed:
            raise Rejection(INVALID_REQUEST, f"output index {output_index} observed after {self.streamer.num_committed} tokens", "$.output_index")
        try:
            chunks = self.streamer.push(token_id, logprob)
        finally:
            self._inject = False
        self._ids.append(token_id)
        self._logprobs.append(logprob)
        text = frozenset(self.streamer.last_triggers) & TEXT_TRIGGERS
        return CommitObservation(text_triggers=text, stream_failed=self.delivery_failed, chunks=tuple(chunks))

    def close(self, reason: FinishReason) -> tuple[Chunk, ...]:
        """Close the output from outside a commit (the runner finished it); returns the flushed chunks.

        Nothing happens when the output is already closed.  Held-back bytes are flushed (no stop
        string matched) except after ``stream_error``; a failing flush sets :attr:`flush_failed`.

        Raises:
            Rejection: ``stop.finish_not_allowed`` for a reason only a commit can fire.
        """
        if self.streamer.finished:
            return ()
        chunks = self.streamer.finish(reason)
        self.external = FinishReason(reason)
        self.flush_failed = self.delivery_failed
        return tuple(chunks)

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_state(self) -> dict[str, Any]:
        """JSON state for a snapshot (module docstring)."""
        s = self.streamer
        return {
            "format": OUTPUT_STATE_FORMAT,
            "output_ids": list(self.output_ids),
            "logprobs": list(self._logprobs),
            "chunks": len(s.chunks),
            "delivered_bytes": s.delivered_bytes,
            "delivery_failed": self.delivery_failed,
            "external": None if self.external is None else self.external.value,
            "flush_failed": self.flush_failed,
        }

    def restore_state(self, state: Any) -> None:
        """Adopt a :meth:`snapshot_state` (replayed through a fresh streamer; nothing is delivered again).

        Raises:
            Rejection: ``snapshot.malformed`` for a state of another shape; ``snapshot.ledger_invalid``
                when the replay does not reproduce the recorded chunks and delivered frontier.
                The observer is unchanged then.
        """
        def count(key: str) -> int:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {quote(value)}")
            return value

        def flag(key: str, default: Any = None) -> bool:
            value = state.get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be a boolean, got {quote(value)}")  # noqa: TRY004 - every malformed field reads as ValueError
            return value

        try:
            if state.get("format") != OUTPUT_STATE_FORMAT:
                raise ValueError(f"format is {quote(state.get('format'))}")
            ids = [int(t) for t in state["output_ids"]]
            logprobs = [None if lp is None else float(lp) for lp in state["logprobs"]]
            num_chunks, delivered = count("chunks"), count("delivered_bytes")
            failed = flag("delivery_failed")
            external = None if state["external"] is None else FinishReason(state["external"])
            flush_failed = flag("flush_failed", False)
            if len(logprobs) != len(ids) or (external is not None and external not in EXTERNAL_FINISH_REASONS | {FinishReason.LENGTH}):
                raise ValueError("logprobs do not line up with the ids, or the external reason is not one")
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise Rejection(SNAPSHOT_MALFORMED, f"not an output state: {type(exc).__name__}: {quote(str(exc))}", "$.observer") from None
        streamer = self._replay(ids, logprobs, fail_at=num_chunks if failed else None, external=external)
        if len(streamer.chunks) != num_chunks or streamer.delivered_bytes != delivered or (streamer.stream_error is not None) != failed:
            raise Rejection(SNAPSHOT_LEDGER_INVALID, f"replaying the {len(ids)} committed tokens publishes {len(streamer.chunks)} chunks up "
                            f"to byte {streamer.delivered_bytes}; the snapshot records {num_chunks} up to byte {delivered}", "$.observer")
        self.streamer, self.external, self.flush_failed = streamer, external, flush_failed
        self._ids, self._logprobs = ids, logprobs

    def replay(self, output_ids: Sequence[int], logprobs: Sequence[float], finish_reason: FinishReason | None = None) -> None:
        """Adopt committed tokens whose chunks a conforming stream already delivered (a snapshot without output state).

        Args:
            output_ids: The committed ids.
            logprobs: Their logprobs.
            finish_reason: The request's finish reason when it is finished (an external close is
                replayed as one; a content trigger closes the replay by itself).
        """
        external = finish_reason if finish_reason in EXTERNAL_FINISH_REASONS | {FinishReason.LENGTH} else None
        self.streamer = self._replay(list(output_ids), list(logprobs), fail_at=None, external=external)
        self.external = external
        self._ids, self._logprobs = list(output_ids), list(logprobs)

    def _replay(self, ids: list[int], logprobs: list[float | None], *, fail_at: int | None, external: FinishReason | None) -> Streamer:
        live = False

        def deliver(chunk: Chunk) -> None:
            if live:
                self._deliver(chunk)
            elif chunk.chunk_idx == fail_at:
                raise _ReplayFailure("the delivery of this chunk failed before the snapshot")

        streamer = Streamer(self.tokenizer, self.config, on_chunk=deliver)
        for index, (token, logprob) in enumerate(zip(ids, logprobs)):
            if streamer.finished:
                raise Rejection(SNAPSHOT_LEDGER_INVALID, f"the output closed before output {index} of {len(ids)}", "$.observer.output_ids")
            streamer.push(token, logprob)
        if external is not None and not streamer.finished:
            streamer.finish(external)
        live = True
        return streamer
