"""The runtime's event trace, format ``decodespec.events.v1`` (docs/design.md section 6): NDJSON sinks.

:class:`decodespec.impl.runtime.RequestRunner` writes one JSON object per line at each
consistent boundary.  Every line has ``"v": 1``, ``"seq"`` (0-based, consecutive) and
``"event"``; a *frontier* object is ``{"prompt_len", "output_count", "pending", "processed",
"pending_tag"}`` (L, O, |U|, P, tag).  How each event maps to a spec action of
the spec (the mapping lives in :mod:`decodespec.checks.modelcheck.trace_validation`, which replays it; this
module never imports the spec's transitions):

==================  =====================================================================
event               spec action (or check)
==================  =====================================================================
``request``         the parameters (``params``: the :class:`~decodespec.spec.state.RequestParams`
                    fields; ``output``: ``stop_strings``, ``include_stop_str``, ``alignment``,
                    ``structured``, ``max_json_depth``, ``stream``) and ``Admit``
                    (``admit`` / ``admit_no_call``)
``call_launched``   ``Launch(kind, start=cache_position[0], length=len(input_ids))``;
                    ``input_ids`` must be the committed sequence's slice, ``frontier_before``
                    and ``generation`` the state's
``fault``           ``Fault(kind)`` for ``device_fault`` / ``missing_lane``;
                    ``StreamFailure()`` for ``stream_error``
``call_completed``  ``Complete(call_id, generation, lanes, stages_ok, output_row)`` with the
                    closed-roster report (``lanes_completed``); ``selection``,
                    ``frontier_after``, ``score_id`` and ``reason`` must be the spec's
``quarantine``      check: the completion left the handle quarantined
``recover``         ``Recover()``
``decision``        ``Decide(score_id, token_id, draws)``; ``receipt_id`` and
                    ``rng_counter_before`` must be the spec's; ``logprob`` a finite value <= 0
``empty_support``   ``SupportEmpty(score_id)``: the policy found no legal token
                    (``code`` ``policy.empty_support``, ``message``); ``rng_counter`` must be
                    the spec's (no draw); a ``finish`` with ``constraint_error`` follows
``commit``          ``Commit(receipt_id, text_triggers, stream_failed)`` (text triggers =
                    ``triggers`` among stop_string / structured / structured_error;
                    ``stream_failed``: this commit's delivery failed, so ``stream_error`` is
                    among ``triggers``); ``output_count``, ``pending_tag`` and ``triggers``
                    must be the spec's, and the text triggers the stop oracle's
``cancel``          ``Cancel(kind)`` at interrupt point ``at``
``snapshot``        ``Snapshot(form)``
``restore``         ``Restore(record)`` with the snapshot's ledger (``state``)
``finish``          check: ``finish_reason``, ``triggers`` and ``frontier`` are the spec's; a
                    streamed request adds ``stream`` (``chunks``, ``delivered_bytes``,
                    ``delivered_tokens``, ``failed``, ``error``): what was delivered
``stream``          one published chunk (``chunk_idx``, ``text``, ``byte_start``, ``byte_end``,
                    ``token_start``, ``token_end``), written right after the ``commit`` that
                    published it or before the ``finish`` of an external close (its flush);
                    checked against the stream contract, not a spec action
``beam_step``       a beam search's ``transition.beam_step`` (written by
                    :class:`decodespec.impl.beam.BeamRunner`, whose ``request`` header
                    carries ``beam``, the ``BeamParams`` JSON, instead of ``params``):
                    ``step``, ``parents``, ``tokens``, ``scores`` (the new live slots) and
                    ``completed`` (``parent``, ``token``, ``rank``, ``score``,
                    ``normalized``, ``length``, ``finish_reason``, ``triggers``), equal to
                    ``decodespec.spec.beam.BeamStepRecord.to_event()`` for the same rows
==================  =====================================================================

Times (issue 19; M3.10 0x0BA "Latency semantics"): ``call_launched``, ``call_completed``,
``stream`` and ``finish`` carry an optional ``t_ns`` -- integer nanoseconds since admission on the
host monotonic clock, read after the completion boundary (:mod:`decodespec.impl.latency`); absent
past ``spec.latency.MAX_TIMED_EVENTS`` timed calls or emissions, and in traces written before
issue 19 (which still validate).  What they mean -- TTFT, ITL, E2E, per-phase times -- is
:mod:`decodespec.spec.latency`; :func:`decodespec.checks.gate.latency.timeline_from_trace` reads them.
Timings are not user content: the redactor keeps them.

Every file is written through a :class:`decodespec.spec.passport.Redactor` unless the caller asks
for content (``content=True``; ``decodespec generate --trace-content``): ids, texts, stop strings
and identities become keyed digests and byte counts, and the ``request`` header gets ``data``, the
trace passport (docs/design.md section 6).

Cost when enabled: one ``json.dumps`` of lists of ints per event (logits are never
converted); disabled, the runner skips building the fields (``sink is None``).

Source: docs/design.md section 6; M3.10 0x0BA "Requirements for observability" (an event
trace that a checker can replay against the spec).
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self, TextIO

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["BEAM_STEP_FIELDS", "EVENTS_FORMAT", "STALE_AFTER_S", "TEMP_NAME", "EventSink", "FileSink", "ListSink",
           "clean_stale_temporaries", "read_events"]

#: Name of the trace format (written in the ``request`` event's ``format`` field).
EVENTS_FORMAT = "decodespec.events.v1"

#: The body fields of a ``beam_step`` event, in order (``spec.beam.BeamStepRecord.to_event()``).
BEAM_STEP_FIELDS = ("step", "parents", "tokens", "scores", "completed")


class EventSink:
    """Writes ``decodespec.events.v1`` lines to a text stream, redacted unless ``content`` is asked for.

    Args:
        stream: Any object with ``write(str)`` (a file opened for text, ``sys.stdout``,
            ``io.StringIO``).
        content: ``False`` (the default): every line is written through a
            :class:`decodespec.spec.passport.Redactor` keyed with a fresh random key that is
            never stored (prompt and output ids, decoded and streamed text, stop strings and
            identities become digests and byte counts; the header's ``data`` says
            ``"classification": "redacted"``).  ``True``: the raw content, declared as
            ``{"classification": "content", "opt_in": true}`` -- the caller's explicit opt-in
            (``decodespec generate --trace-content``).

    Attributes:
        seq: The ``seq`` the next event gets.
        redactor: The redactor, or ``None`` for a content trace.

    Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data" (the trace passport).
    """

    def __init__(self, stream: TextIO | None = None, *, content: bool = False):
        from decodespec.spec.passport import Redactor

        self._stream = stream if stream is not None else io.StringIO()
        self.seq = 0
        self.content = bool(content)
        self.redactor = None if self.content else Redactor(secrets.token_bytes(32))  # the file's key: never stored

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event line; returns the record as written (``{"v": 1, "seq", "event", **fields}``, redacted unless content)."""
        from decodespec.spec.passport import CONTENT_PASSPORT

        record = {"v": 1, "seq": self.seq, "event": event, **fields}
        if self.redactor is not None:
            if event == "request":
                self.redactor = self.redactor.for_request(record)
            record = self.redactor.event(record)
        elif event == "request":
            record["data"] = CONTENT_PASSPORT.to_json()
        self.seq += 1
        self._stream.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        return record

    def close(self) -> None:
        """Flush the stream (does not close streams the sink did not open)."""
        flush = getattr(self._stream, "flush", None)
        if flush is not None:
            flush()


class ListSink(EventSink):
    """An in-memory sink: :attr:`records` (dicts) and :meth:`lines` (the NDJSON text lines).

    Keeps the content by default (``content=True``: an in-memory record for the caller's own
    checks, never a file); ``content=False`` redacts like a file sink.
    """

    def __init__(self, *, content: bool = True) -> None:
        super().__init__(io.StringIO(), content=content)
        self.records: list[dict[str, Any]] = []

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(event, **fields)
        self.records.append(record)
        return record

    def lines(self) -> list[str]:
        """The written lines, without their newline."""
        return self._stream.getvalue().splitlines()  # type: ignore[union-attr]


#: A temporary trace of ours: ``.<target name>.<8 characters of tempfile.mkstemp>.tmp`` next to the target
#: (``decodespec generate --trace FILE`` writes it, then renames it onto FILE).
TEMP_NAME = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp")
#: A snapshot's staging folder: ``.<target name>.<8 characters of tempfile.mkdtemp>.snap`` next to the target
#: (``decodespec generate --snapshot FILE`` writes the JSON and the tensor file into it, then renames both out).
STAGING_NAME = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.snap")
#: A temporary younger than this (seconds since its last write) is never removed: its writer may be between
#: creating it and taking its lock.
STALE_AFTER_S = 1.0

#: Open lock descriptors of this process's temporaries (path -> fd): held until the file is renamed or removed,
#: so that a concurrent cleaner never takes a live temporary for a stale one.
_LOCKS: dict[str, int] = {}


def _lock(path: Path) -> None:
    """Hold an exclusive ``flock`` on ``path`` for as long as it exists under that name (released by :func:`_prune_locks`)."""
    if fcntl is None:  # pragma: no cover - not POSIX: no lock, and no cleanup either
        return
    _prune_locks()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner holds a sibling's lock only for a moment (and never a fresh file's)
    _LOCKS[str(path)] = fd


def _prune_locks() -> None:
    """Release the locks of temporaries that have been renamed into place or removed."""
    for name, fd in list(_LOCKS.items()):
        try:
            alive = os.path.samestat(os.fstat(fd), os.lstat(name))
        except OSError:
            alive = False
        if not alive:
            os.close(_LOCKS.pop(name))


def write_atomically(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` so that a kill leaves either the old file or the new one, never a part of one.

    The bytes go to a temporary of ours beside ``path`` (:data:`TEMP_NAME`, held under ``flock``;
    the stale temporaries a killed writer left for the same target are removed first), which is
    then renamed onto ``path``.  ``str`` data is written as UTF-8.  The file gets the mode a plain
    ``open(path, "w")`` would give (0o666 less the umask).

    Raises:
        OSError: the folder is missing or not writable (nothing is written then).

    Source: M3.10 0x06 (partial files never survive a kill).
    """
    import tempfile

    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    temp = Path(name)
    try:
        _lock(temp)
        clean_stale_temporaries(temp)
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(temp, 0o666 & ~mask)
        os.replace(temp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    finally:
        _prune_locks()
    return path


def staging_folder(target: str | Path) -> Path:
    """Create a locked staging folder (:data:`STAGING_NAME`) beside ``target`` and clean the stale ones.

    The folder is held under an exclusive ``flock`` until it is removed (the kernel drops the lock
    if this process dies, even by SIGKILL), and the stale staging folders of the same target that a
    killed run left are removed first (:func:`clean_stale_temporaries`).

    Raises:
        OSError: the folder cannot be created (the caller reports it as ``io.error``).

    Source: M3.10 0x06 (partial files never survive a kill: cleaned on the next run).
    """
    import tempfile

    target = Path(target)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".snap", dir=target.parent))
    _lock(folder)
    clean_stale_temporaries(folder)
    return folder


def clean_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the stale temporaries of ``path``'s target that an earlier, killed run left beside it; return them.

    ``path`` is a temporary of ours: a trace temporary (:data:`TEMP_NAME`, a regular file) or a
    snapshot staging folder (:data:`STAGING_NAME`, a folder holding only regular files).  A
    sibling is removed only when it is a temporary of the same kind and target (the same name
    pattern), owned by this user, not written for :data:`STALE_AFTER_S`, and no process holds its
    lock (every writer holds an exclusive ``flock`` from creation until the rename or removal, and
    the kernel drops it when the writer dies, even by SIGKILL).  Anything else -- a symlink, a
    folder of the trace pattern, a file of the folder pattern, a folder with a sub-folder or a
    link inside -- is left alone.  Does nothing off POSIX.

    Source: M3.10 0x06 (partial files never survive a kill: cleaned on the next run).
    """
    path = Path(path)
    pattern, is_kind = (TEMP_NAME, stat.S_ISREG) if TEMP_NAME.fullmatch(path.name) else (STAGING_NAME, stat.S_ISDIR)
    match = pattern.fullmatch(path.name)
    if fcntl is None or match is None:
        return []
    removed = []
    now = time.time()
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    for name in names:
        other = pattern.fullmatch(name)
        if other is None or other["target"] != match["target"] or name == path.name:
            continue
        candidate = path.parent / name
        try:
            st = os.lstat(candidate)
            if not is_kind(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_S:
                continue
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live writer holds it
            if os.path.samestat(os.fstat(fd), os.lstat(candidate)):  # still the file we locked
                if stat.S_ISDIR(st.st_mode):
                    _remove_staging(candidate)
                else:
                    os.unlink(candidate)
                removed.append(candidate)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _remove_staging(folder: Path) -> None:
    """Remove a stale staging folder that holds regular files only (anything else: ``OSError``, left alone)."""
    entries = [folder / name for name in os.listdir(folder)]
    if not all(stat.S_ISREG(os.lstat(entry).st_mode) for entry in entries):
        raise IsADirectoryError(folder)
    for entry in entries:
        os.unlink(entry)
    os.rmdir(folder)


class FileSink(EventSink):
    """A sink writing to ``path`` (truncated); use as a context manager or call :meth:`close`.

    Redacted unless ``content=True`` (:class:`EventSink`).

    When ``path`` is a temporary of ours (:data:`TEMP_NAME`, what ``decodespec generate --trace``
    writes before renaming it into place), the sink holds an exclusive lock on it until it is
    renamed or removed, and first removes the stale temporaries a killed run left for the same
    target (:func:`clean_stale_temporaries`).
    """

    def __init__(self, path: str | Path, *, content: bool = False):
        self.path = Path(path)
        self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - the sink owns the file until close()
        super().__init__(self._file, content=content)
        if TEMP_NAME.fullmatch(self.path.name):
            _lock(self.path)
            clean_stale_temporaries(self.path)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(source: str | Path | Iterable[str]) -> list[str]:
    """The non-empty lines of a trace file (a path) or of an iterable of lines."""
    if isinstance(source, (str, Path)) and Path(source).exists():
        lines: Iterable[str] = Path(source).read_text(encoding="utf-8").splitlines()
    elif isinstance(source, (str, Path)):
        raise FileNotFoundError(str(source))
    else:
        lines = source
    return [line for line in (ln.strip() for ln in lines) if line]
