"""Runtime stop, stream and output components, called once per committed token (M3.10 0x06).

The generation loop commits a token and calls :meth:`Streamer.push`; the streamer feeds the
token's bytes to the :class:`IncrementalDetokenizer`, the :class:`StopMatcher` and (optionally)
the :class:`~decodespec.impl.structured.JsonCompletionDetector`, resolves the finish triggers,
and publishes only the bytes behind the stream commit horizon as :class:`Chunk` values that carry
their byte and token offsets.  When a trigger fires it closes the output and returns the final
chunk; :attr:`Streamer.output` then holds the ids, logprobs and text under the request's
alignment contract.

Each component implements a rule of :mod:`decodespec.spec.stop` (the oracle; never called here):

* :class:`IncrementalDetokenizer`: ``invariant.decoder_frontier``.  Byte-level BPE decodes by
  UTF-8-decoding the concatenated token bytes, so the stable prefix is what the stdlib
  incremental UTF-8 decoder no longer holds back.
* :class:`StopMatcher`: ``invariant.stop_match_rule`` and ``invariant.stream_holdback``: an
  Aho-Corasick automaton over bytes; per token the work is O(token bytes), the whole text is
  never re-scanned; the holdback ``h_t`` is a per-state constant.
* :class:`Streamer`: ``invariant.stop_triggers``, ``invariant.finish_precedence``,
  ``invariant.stream_frontier``, ``invariant.stream_prefix``, ``invariant.stream_final``,
  ``invariant.stream_no_stop_bytes``, ``invariant.chunk_metadata``, ``invariant.output_alignment``.

Output-transaction policy on streamer failure (declared): when the ``on_chunk`` callback raises
an ``Exception``, that chunk counts as *not delivered*; the trigger ``stream_error`` is recorded
and the output closes at once (``stream_error`` outranks every content trigger, see
``FINISH_PRECEDENCE``).  The committed tokens are kept and :attr:`Streamer.output` is computed as
for any finish (with the stop cut if a stop string also fired), but nothing more is published:
:attr:`Streamer.delivered_bytes` is the end of the last chunk whose callback returned, and only
:attr:`Streamer.chunks` are claimed delivered.  The loop must not commit further tokens
(:meth:`Streamer.push` then raises ``stop.after_finish``).

Source: M3.10 0x06 "Streaming has a commit horizon", "One selection is an output-state
transaction", "Deriving the stream holdback", "Token-aligned and text-aligned outputs can
diverge", "Finish reason and RNG precedence".  Peers: vLLM ``v1/engine/detokenizer.py`` (fixed
``max(len(stop)) - 1`` character holdback; ids not trimmed), HF ``TextStreamer`` (no stop
awareness).
"""

from __future__ import annotations

import bisect
import codecs
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from decodespec.spec.enums import EXTERNAL_FINISH_REASONS, FINISH_PRECEDENCE, FinishReason
from decodespec.spec.errors import Rejection
from decodespec.spec.stop import (
    STOP_AFTER_FINISH,
    STOP_EMPTY_PATTERN,
    STOP_FINISH_NOT_ALLOWED,
    STOP_TOKEN_OUT_OF_RANGE,
    AlignedOutput,
    Chunk,
    OutputAlignment,
    StopConfig,
    StopMatch,
)
from decodespec.spec.structured import JsonStatus

from .structured import JsonCompletionDetector, utf8_pending

__all__ = ["IncrementalDetokenizer", "StopMatcher", "Streamer"]


class IncrementalDetokenizer:
    """Output bytes of committed tokens and the prefix whose decode can no longer change.

    Implements ``invariant.decoder_frontier``.  Special tokens (``tokenizer.special_ids``, e.g.
    EOS) contribute no bytes, as in ``tokenizer.decode(ids, skip_special_tokens=True)``.

    Args:
        tokenizer: Anything with ``token_bytes(id) -> bytes``, ``vocab_size`` and ``special_ids``
            (:class:`~decodespec.impl.tokenizer.GGUFTokenizer`, ``ByteTokenizer``).

    Attributes:
        token_ends: ``int[O]``: cumulative byte end of each output token.
        stable_after: ``int[O]``: the decoder frontier right after each output token.

    Units: bytes.
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._special = frozenset(getattr(tokenizer, "special_ids", ()))
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._data = bytearray()
        self.token_ends: list[int] = []
        self.stable_after: list[int] = []

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the output text (``b""`` for special tokens)."""
        return b"" if token_id in self._special else self._tokenizer.token_bytes(token_id)

    def push(self, token_id: int) -> bytes:
        """Append one committed token; return the bytes it added.

        Raises:
            IndexError: for an id the tokenizer does not know (the streamer validates first).
        """
        new = self.bytes_of(token_id)
        self._data += new
        self._decoder.decode(new)
        self.token_ends.append(len(self._data))
        self.stable_after.append(self.stable_len)
        return new

    @property
    def data(self) -> bytes:
        """All output bytes ``D_t``."""
        return bytes(self._data)

    @property
    def num_bytes(self) -> int:
        """``|D_t|``."""
        return len(self._data)

    @property
    def stable_len(self) -> int:
        """The decoder frontier: bytes before a trailing incomplete UTF-8 sequence."""
        return len(self._data) - len(utf8_pending(self._decoder))

    def text(self, start: int = 0, end: int | None = None) -> str:
        """UTF-8 decode of output bytes ``[start, end)`` (U+FFFD for invalid bytes)."""
        return self._data[start:end].decode("utf-8", errors="replace")


class StopMatcher:
    """Incremental multi-pattern stop matcher over output bytes (Aho-Corasick).

    Implements ``invariant.stop_match_rule`` (earliest-ending match; at one end byte the longest
    pattern, then the first listed) and ``invariant.stream_holdback`` (:attr:`holdback` is the
    longest suffix of the bytes read that is a proper prefix of a pattern).

    Args:
        patterns: Encoded stop strings (``StopConfig.stop_patterns``), each non-empty.

    Raises:
        Rejection: ``stop.empty_pattern`` for an empty pattern.
    """

    def __init__(self, patterns: Sequence[bytes]):
        for i, p in enumerate(patterns):
            if not p:
                raise Rejection(STOP_EMPTY_PATTERN, "stop pattern is empty", f"$.stop[{i}]")
        self.patterns = tuple(patterns)
        # Trie: children per node, depth, first-listed pattern ending exactly at the node.
        children: list[dict[int, int]] = [{}]
        depth = [0]
        ends_here: list[int | None] = [None]
        for idx, pat in enumerate(self.patterns):
            node = 0
            for byte in pat:
                nxt = children[node].get(byte)
                if nxt is None:
                    nxt = len(children)
                    children[node][byte] = nxt
                    children.append({})
                    depth.append(depth[node] + 1)
                    ends_here.append(None)
                node = nxt
            if ends_here[node] is None:
                ends_here[node] = idx
        fail = [0] * len(children)
        match = list(ends_here)           # longest pattern that is a suffix of the node's string
        hold = [0] * len(children)        # longest suffix that is a proper prefix of a pattern
        order: deque[int] = deque(children[0].values())
        while order:
            node = order.popleft()
            if match[node] is None:
                match[node] = match[fail[node]]
            hold[node] = depth[node] if children[node] else hold[fail[node]]
            for byte, child in children[node].items():
                f = fail[node]
                while f and byte not in children[f]:
                    f = fail[f]
                fail[child] = children[f].get(byte, 0)
                order.append(child)
        self._children, self._fail, self._match, self._hold = children, fail, match, hold
        self._delta: list[dict[int, int]] = [{} for _ in children]
        self._state = 0
        self.num_bytes = 0

    def _step(self, state: int, byte: int) -> int:
        nxt = self._delta[state].get(byte)
        if nxt is None:
            s = state
            while s and byte not in self._children[s]:
                s = self._fail[s]
            nxt = self._children[s].get(byte, 0)
            self._delta[state][byte] = nxt
        return nxt

    def feed(self, data: bytes, *, eligible: bool = True) -> StopMatch | None:
        """Read one token's bytes; return the first match that ends in them, if ``eligible``.

        Reading stops at the returned match (the output closes there).  With ``eligible=False``
        (``min_new_tokens`` not reached) matches are ignored but the state advances.

        Units: byte offsets from the start of the output.
        """
        for byte in data:
            self._state = self._step(self._state, byte)
            self.num_bytes += 1
            idx = self._match[self._state]
            if eligible and idx is not None:
                return StopMatch(pattern_idx=idx, start=self.num_bytes - len(self.patterns[idx]), end=self.num_bytes)
        return None

    @property
    def holdback(self) -> int:
        """``h_t`` for the bytes read so far (bytes)."""
        return self._hold[self._state]


class Streamer:
    """Per-request stop/stream/output state; ``push`` once per committed token.

    Args:
        tokenizer: The request's tokenizer (``token_bytes``, ``vocab_size``, ``special_ids``).
        config: The frozen :class:`~decodespec.spec.stop.StopConfig` of the request.
        on_chunk: Optional delivery callback, called with each chunk as it is published; if it
            raises, the output closes with ``stream_error`` (module docstring).

    Attributes:
        chunks: Chunks published and delivered so far.
        output: The returned output once finished, else ``None``.
        last_triggers: Triggers fired by the latest commit or finish, in precedence order.
        stream_error: The exception the callback raised, or ``None``.
    """

    def __init__(self, tokenizer: Any, config: StopConfig, *, on_chunk: Callable[[Chunk], None] | None = None):
        self.config = config
        self._vocab_size = int(tokenizer.vocab_size)
        self._detok = IncrementalDetokenizer(tokenizer)
        self._matcher = StopMatcher(config.stop_patterns) if config.stop_patterns else None
        self._json = JsonCompletionDetector(config.max_json_depth) if config.json_completion else None
        self._on_chunk = on_chunk
        self._ids: list[int] = []
        self._logprobs: list[float | None] = []
        self.chunks: list[Chunk] = []
        self.output: AlignedOutput | None = None
        self.last_triggers: tuple[FinishReason, ...] = ()
        self.stream_error: Exception | None = None

    # -- views -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Whether the output is closed."""
        return self.output is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        """The canonical finish reason, once finished."""
        return None if self.output is None else self.output.finish_reason

    @property
    def num_committed(self) -> int:
        """``O``: tokens pushed."""
        return len(self._ids)

    @property
    def delivered_bytes(self) -> int:
        """End of the last published (and delivered) chunk, in output bytes."""
        return self.chunks[-1].byte_end if self.chunks else 0

    @property
    def detokenizer(self) -> IncrementalDetokenizer:
        """The incremental detokenizer (read-only use)."""
        return self._detok

    # -- transitions -------------------------------------------------------------------------
    def push(self, token_id: int, logprob: float | None = None) -> list[Chunk]:
        """Commit one output token; return the chunks published by this commit.

        Args:
            token_id: The committed id, ``0 <= token_id < V``.
            logprob: Its logprob (natural log), or ``None``.

        Returns:
            The chunks published (and delivered) by this commit; when a trigger fires, the final
            chunk (the rest of the returned text) and :attr:`output` is set.

        Raises:
            Rejection: ``stop.after_finish`` once finished; ``stop.token_out_of_range`` for an
                id outside ``[0, V)``.  Nothing changes.
        """
        self._check_open()
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self._vocab_size:
            raise Rejection(STOP_TOKEN_OUT_OF_RANGE, f"token id {token_id!r} is outside [0, {self._vocab_size})", "$.token_id")
        cfg = self.config
        t = len(self._ids)
        new = self._detok.push(token_id)
        self._ids.append(token_id)
        self._logprobs.append(logprob)
        fired: set[FinishReason] = set()
        eligible = t >= cfg.min_new_tokens
        match = self._matcher.feed(new, eligible=eligible) if self._matcher is not None else None
        if match is not None:
            fired.add(FinishReason.STOP_STRING)
        structured_end = None
        if self._json is not None:
            status = self._json.feed(new)
            if status is JsonStatus.COMPLETE:
                fired.add(FinishReason.STRUCTURED)
                structured_end = self._json.completion_offset
            elif status is JsonStatus.INVALID:
                fired.add(FinishReason.STRUCTURED_ERROR)
        if eligible and token_id in cfg.eos_ids:
            fired.add(FinishReason.EOS)
        if t + 1 >= cfg.max_new_tokens:
            fired.add(FinishReason.LENGTH)
        if cfg.max_context_len is not None and cfg.prompt_len + t + 1 >= cfg.max_context_len:
            fired.add(FinishReason.CONTEXT_LENGTH)
        if fired:
            return self._close(fired, match, structured_end)
        self.last_triggers = ()
        return self._publish(self._frontier())

    def finish(self, reason: FinishReason | str) -> list[Chunk]:
        """Close the output between commits (cancel, timeout, device error, stream error).

        ``length`` / ``context_length`` are accepted only when their bound is already reached
        (e.g. ``max_new_tokens = 0``).  Held-back bytes are flushed (no stop matched), except
        after ``stream_error``.

        Raises:
            Rejection: ``stop.after_finish``; ``stop.finish_not_allowed`` for a reason only a
                commit can fire.  Nothing changes.
        """
        self._check_open()
        cfg = self.config
        try:
            why = FinishReason(reason)
        except ValueError:
            raise Rejection(STOP_FINISH_NOT_ALLOWED, f"unknown finish reason {reason!r}", "$.reason") from None
        o = len(self._ids)
        allowed = (
            why in EXTERNAL_FINISH_REASONS
            or (why is FinishReason.LENGTH and o >= cfg.max_new_tokens)
            or (why is FinishReason.CONTEXT_LENGTH and cfg.max_context_len is not None
                and cfg.prompt_len + o >= cfg.max_context_len)
        )
        if not allowed:
            raise Rejection(STOP_FINISH_NOT_ALLOWED, f"finish reason {why.value!r} cannot close the output from outside", "$.reason")
        return self._close({why}, None, None)

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.output is not None:
            raise Rejection(STOP_AFTER_FINISH, f"the output is closed ({self.output.finish_reason.value})", "$")

    def _frontier(self) -> int:
        """``invariant.stream_frontier``: min(decoder frontier, stop frontier)."""
        detok = self._detok
        front = detok.num_bytes
        if self.config.holds_back_stop:
            assert self._matcher is not None
            front -= self._matcher.holdback
            if self.config.alignment is OutputAlignment.TOKEN:
                whole = bisect.bisect_right(detok.token_ends, front)
                front = detok.stable_after[whole - 1] if whole else 0
        return min(detok.stable_len, front)

    def _chunk(self, start: int, end: int) -> Chunk:
        ends = self._detok.token_ends
        return Chunk(chunk_idx=len(self.chunks), text=self._detok.text(start, end), byte_start=start, byte_end=end,
                     token_start=bisect.bisect_right(ends, start), token_end=bisect.bisect_left(ends, end) + 1)

    def _publish(self, upto: int) -> list[Chunk]:
        start = self.delivered_bytes
        assert upto >= start, "stream frontier moved backwards"
        if upto == start:
            return []
        chunk = self._chunk(start, upto)
        if self._on_chunk is not None:
            try:
                self._on_chunk(chunk)
            except Exception as exc:  # noqa: BLE001 - any callback failure is a stream_error
                self.stream_error = exc
                if self.output is None:
                    self._close({FinishReason.STREAM_ERROR}, None, None)
                else:
                    self.output = self._build_output(set(self.output.triggers) | {FinishReason.STREAM_ERROR},
                                                     self.output.stop_match, self.output.structured_end)
                    self.last_triggers = self.output.triggers
                return []
        self.chunks.append(chunk)
        return [chunk]

    def _close(self, fired: set[FinishReason], match: StopMatch | None, structured_end: int | None) -> list[Chunk]:
        self.output = self._build_output(fired, match, structured_end)
        self.last_triggers = self.output.triggers
        if FinishReason.STREAM_ERROR in fired:
            return []
        return self._publish(self.output.visible_end)

    def _build_output(self, fired: set[FinishReason], match: StopMatch | None, structured_end: int | None) -> AlignedOutput:
        """``invariant.output_alignment`` and ``invariant.finish_precedence`` for the closed output."""
        cfg = self.config
        detok = self._detok
        ends = detok.token_ends
        num = len(self._ids)
        stop = FinishReason.STOP_STRING in fired
        cut = None
        if stop:
            assert match is not None
            cut = match.end if cfg.include_stop_str else match.start
        elif FinishReason.STRUCTURED in fired:
            cut = structured_end
        keep = num
        if cut is not None and cfg.alignment is OutputAlignment.TEXT:
            # Fewest tokens whose bytes reach the cut.
            keep = next(i + 1 for i, e in enumerate(ends) if e >= cut) if cut > 0 else 0
        elif cut is not None and cfg.alignment is OutputAlignment.TOKEN and stop and not cfg.include_stop_str:
            # Whole tokens that end at or before the match start.
            keep = sum(1 for e in ends if e <= cut)
        kept_end = ends[keep - 1] if keep else 0
        if cfg.alignment is OutputAlignment.TOKEN:
            shown = kept_end
        else:
            shown = detok.num_bytes if cut is None else cut
        ordered = tuple(r for r in FINISH_PRECEDENCE if r in fired)
        recorded = bool(self._logprobs) and all(lp is not None for lp in self._logprobs)
        logprobs = tuple(self._logprobs[:keep]) if recorded else None
        return AlignedOutput(
            alignment=cfg.alignment,
            output_ids=tuple(self._ids[:keep]),
            logprobs=logprobs,
            text=detok.text(0, shown),
            token_spans=tuple(zip([0] + ends[:keep - 1] if keep else [], ends[:keep])),
            visible_end=shown,
            ids_byte_end=kept_end,
            overhang=detok.data[shown:kept_end],
            total_bytes=detok.num_bytes,
            num_committed=num,
            finish_reason=ordered[0],
            triggers=ordered,
            stop_match=match if stop else None,
            structured_end=structured_end if FinishReason.STRUCTURED in fired else None,
        )
