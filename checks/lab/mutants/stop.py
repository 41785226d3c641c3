"""Failure lab, stop and active-row group: finish conditions, stop strings, streaming, UTF-8, JSON.

Source: M3.10 0x0B "Stop and active-row bugs" and "Commit and streaming bugs" (emitting bytes
before stop matching has a safe suffix, trimming returned text without trimming token/logprob
offsets), 0x06 "Streaming has a commit horizon", "Deriving the stream holdback"; M3.8 0x12.
"""

from __future__ import annotations

from . import Patch, mutant

_G = "stop and active rows"


@mutant(
    "batch_rows_expand_after_eos", group=_G, text=True, representative=True,
    title="Finished batch rows keep expanding after EOS",
    section="M3.10 0x0B Stop and active-row bugs (finished rows keep expanding after EOS); 0x06 Stop criteria and active rows",
    statement="impl/batch.py _Row.active only checks the length budget, so a row that selected EOS stays in the "
    "selection set: the rectangular batch continues and tokens appear after logical completion. The row's ids "
    "differ from its unbatched run, which stops at EOS (STATE).",
)
def _batch_rows_expand_after_eos():
    return [Patch("decodespec.impl.batch:_Row.active", edits=[("return not self.triggers", "return len(self.output_ids) < self.max_new_tokens")])]


@mutant(
    "stop_string_last_token_only", group=_G, text=True,
    title="Stop strings matched on each token's bytes alone",
    section="M3.10 0x0B Stop and active-row bugs (stop string split across tokens)",
    statement="impl/stream.py StopMatcher.feed restarts the automaton at every token, so a stop string whose bytes "
    "span two tokens is never matched (and the holdback forgets a partial match): the output runs past the stop. "
    "SEQUENCE fails (finish reason, text, chunks) on a stop string spanning tokens.",
)
def _stop_string_last_token_only():
    return [Patch("decodespec.impl.stream:StopMatcher.feed", edits=[(
        "\n    for byte in data:\n", "\n    self._state = 0  # matched against this token's bytes only\n    for byte in data:\n")])]


@mutant(
    "stop_trims_ids_not_logprobs", group=_G, text=True,
    title="Stop cut trims the token ids but not the logprobs",
    section="M3.10 0x0B Stop and active-row bugs (stop token removed from tokens but not logprobs); Commit and "
    "streaming bugs (trimming returned text without trimming token/logprob offsets)",
    statement="impl/stream.py Streamer._build_output cuts the returned ids at the stop match but returns every "
    "committed logprob: the metadata no longer lines up with the returned ids and text (len(logprobs) != "
    "len(output_ids), invariant.output_alignment). SEQUENCE fails (returned output alignment).",
)
def _stop_trims_ids_not_logprobs():
    return [Patch("decodespec.impl.stream:Streamer._build_output", edits=[(
        "logprobs = tuple(self._logprobs[:keep]) if recorded else None", "logprobs = tuple(self._logprobs) if recorded else None")])]


@mutant(
    "stop_bytes_streamed_early", group=_G, text=True,
    title="Stream publishes bytes before the stop matcher has a safe suffix",
    section="M3.10 0x0B Commit and streaming bugs (emitting bytes before stop matching has a safe suffix); 0x06 Deriving the stream holdback",
    statement="impl/stream.py Streamer._frontier ignores the stop holdback: a prefix of a stop string is published "
    "and, when the stop fires, cannot be taken back (the final flush never moves backwards). SEQUENCE fails (stream "
    "chunks contain bytes of the stop string).",
)
def _stop_bytes_streamed_early():
    return [
        Patch("decodespec.impl.stream:Streamer._frontier", edits=[("front -= self._matcher.holdback", "front -= 0")]),
        Patch("decodespec.impl.stream:Streamer._publish", edits=[(
            'assert upto >= start, "stream frontier moved backwards"', "upto = max(upto, start)  # what was sent stays sent")]),
    ]


@mutant(
    "utf8_emitted_incomplete", group=_G, text=True,
    title="UTF-8 bytes streamed before the character is complete (U+FFFD)",
    section="M3.10 0x06 Streaming has a commit horizon (decoder frontier); 0x0B Commit and streaming bugs",
    statement="impl/stream.py IncrementalDetokenizer.stable_len counts every byte as stable, ignoring a trailing "
    "incomplete UTF-8 sequence: a chunk ends inside a character, so its text carries U+FFFD and the next chunk starts "
    "with continuation bytes. SEQUENCE fails (stream chunks) on multi-byte output.",
)
def _utf8_emitted_incomplete():
    return [Patch("decodespec.impl.stream:IncrementalDetokenizer.stable_len", edits=[(
        "return len(self._data) - len(utf8_pending(self._decoder))", "return len(self._data)")])]


@mutant(
    "json_brace_completes", group=_G, text=True,
    title="Any closing brace treated as JSON completion",
    section="M3.10 0x0B (structured completion); docs/design.md (RFC 8259 completion over output bytes); spec/structured.py",
    statement="impl/structured.py JsonCompletionDetector._close closes every open container at a closing bracket: "
    "the first '}' of a nested object completes the value, so the output is cut inside the JSON document. SEQUENCE / "
    "STATE fail (finish structured one token early, text cut).",
)
def _json_brace_completes():
    return [Patch("decodespec.impl.structured:JsonCompletionDetector._close", edits=[(
        "self._containers.pop()", "self._containers.clear()")])]
