"""Failure lab, snapshot group: a restored request does not continue like the uninterrupted one.

Source: M3.10 0x0BA "A completed output is not automatically a resumable snapshot" (the snapshot
binds P and U with P + |U| = L + O, the stop matcher and the stream holdback), 0x06 "Deriving the
stream holdback".
"""

from __future__ import annotations

from . import Patch, mutant

_G = "snapshot"


@mutant(
    "resume_resets_stop_matcher", group=_G, text=True, representative=True,
    title="Resume restarts the stop matcher and the stream holdback",
    section="M3.10 0x0BA A completed output is not automatically a resumable snapshot (stop matcher and holdback state)",
    statement="impl/output.py OutputObserver.restore_state replays the committed tokens but then resets the stop "
    "automaton to its start state: a stop string whose first bytes were committed before the snapshot is not "
    "matched after the restore, and the held-back bytes are published. RESUME / SEQUENCE fail (finish reason, text, "
    "chunks) when the snapshot falls inside a stop string.",
)
def _resume_resets_stop_matcher():
    return [Patch("decodespec.impl.output:OutputObserver.restore_state", edits=[(
        "\n    self.streamer, self.external, self.flush_failed = streamer, external, flush_failed\n",
        "\n    if streamer._matcher is not None:\n        streamer._matcher._state = 0  # the matcher restarts on resume\n"
        "    self.streamer, self.external, self.flush_failed = streamer, external, flush_failed\n")])]


@mutant(
    "resume_drops_pending_token", group=_G,
    title="Resume drops the pending token",
    section="M3.10 0x0BA A completed output is not automatically a resumable snapshot (P + |U| = L + O)",
    statement="impl/snapshot.py restore_runner restores U = [] (tag EMPTY) from a pending-suffix snapshot whose "
    "committed token was not yet processed: P + |U| < L + O, so the resumed request never feeds that token. STATE "
    "fails (frontier pending / tag) right after the restore.",
)
def _resume_drops_pending_token():
    return [Patch("decodespec.impl.snapshot:restore_runner", edits=[(
        "pending_ids=tuple(rec.pending_ids),\n        pending_tag=rec.pending_tag,", "pending_ids=(),\n        pending_tag=PendingTag.EMPTY,")])]
