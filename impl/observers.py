"""The runner's commit observer protocol (stop strings, structured completion, the stream) and its null implementation.

:class:`~decodespec.impl.runtime.RequestRunner` hands each committed token to one
:class:`CommitObserver` and calls every method of the protocol at its boundary; an observer that
has nothing to say inherits :class:`NullObserver`'s answers (no text trigger, no chunk, no
state).  :class:`decodespec.impl.output.OutputObserver` is the full implementation.

Source: M3.10 0x06 "One selection is an output-state transaction" (the commit hands the token to
the stop/stream components; EOS, length and context stay in the controller).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from decodespec.spec.enums import FinishReason

__all__ = ["CommitObservation", "CommitObserver", "NullObserver"]


@attrs.frozen
class CommitObservation:
    """What the stop/stream components report for one committed token.

    Attributes:
        text_triggers: Subset of ``{stop_string, structured, structured_error}``.
        stream_failed: This commit's delivery failed (``stream_error`` becomes one of the commit's
            triggers; needs a streamed request).
        chunks: The stream chunks this commit published (written to the trace as ``stream``
            events after the ``commit`` event).
    """

    text_triggers: frozenset[FinishReason] = frozenset()
    stream_failed: bool = False
    chunks: tuple[Any, ...] = ()


class CommitObserver(Protocol):
    """What :class:`~decodespec.impl.runtime.RequestRunner` calls on its observer (every method, no probing).

    * ``observe(token_id, logprob, output_index)``: one committed token (before finish is decided).
    * ``inject_delivery_failure()``: the next chunk this commit publishes fails (a planned stream failure).
    * ``close(reason)``: the request finished outside a commit; returns the chunks the close flushed.
    * ``snapshot_state()`` / ``restore_state(state)``: the observer's state carried in snapshots (``None``: none).
    * ``text_so_far()``: the text of the committed output so far, or ``None`` (the runner then decodes the ids).
    * ``stream_report()``: the stream's report (chunks, delivered bytes and tokens, failure), or ``None``.
    * ``output``: the aligned output once finished, or ``None``; ``chunks``: the chunks delivered.
    """

    @property
    def output(self) -> Any: ...  # pragma: no cover

    @property
    def chunks(self) -> tuple[Any, ...]: ...  # pragma: no cover

    def observe(self, token_id: int, logprob: float, output_index: int) -> CommitObservation: ...  # pragma: no cover

    def inject_delivery_failure(self) -> None: ...  # pragma: no cover

    def close(self, reason: FinishReason) -> tuple[Any, ...]: ...  # pragma: no cover

    def snapshot_state(self) -> dict[str, Any] | None: ...  # pragma: no cover

    def restore_state(self, state: dict[str, Any]) -> None: ...  # pragma: no cover

    def text_so_far(self) -> str | None: ...  # pragma: no cover

    def stream_report(self) -> dict[str, Any] | None: ...  # pragma: no cover


class NullObserver:
    """The observer with nothing to observe: no text trigger, no chunk, no state, no text of its own.

    The runner's observer when none is given and the tokenizer has no ``token_bytes``; subclass it
    to observe only some boundaries.
    """

    output: Any = None
    chunks: tuple[Any, ...] = ()

    def observe(self, token_id: int, logprob: float, output_index: int) -> CommitObservation:
        """No text trigger, no stream failure, no chunk."""
        return CommitObservation()

    def inject_delivery_failure(self) -> None:
        """Nothing is delivered, so nothing fails."""

    def close(self, reason: FinishReason) -> tuple[Any, ...]:
        """No chunk to flush."""
        return ()

    def snapshot_state(self) -> dict[str, Any] | None:
        """No state."""
        return None

    def restore_state(self, state: dict[str, Any]) -> None:
        """No state to restore."""

    def text_so_far(self) -> str | None:
        """No text of its own."""
        return None

    def stream_report(self) -> dict[str, Any] | None:
        """No stream."""
        return None
