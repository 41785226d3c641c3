"""M3.10 0x06 Stop criteria, the stream commit horizon and output alignment (pure reference).

This module is the oracle for what a runtime does with each committed token after selection
(M3.10 0x06 "One selection is an output-state transaction", steps 3-7): feed the token's bytes
to the incremental decoder, the byte-level stop matcher and the structured parser; resolve the
finish triggers under one precedence; publish only the bytes behind the stream commit horizon;
and, at finish, return ids, logprobs and text under one declared alignment contract.

Definitions (``D_t`` is the UTF-8 byte string of output tokens ``0..t``; special tokens such as
EOS contribute no bytes; ``P`` is the set of encoded stop strings):

* **stop holdback** ``h_t`` (M3.10 "Deriving the stream holdback"): the length of the longest
  suffix of ``D_t`` that is a proper prefix of a pattern in ``P`` (:func:`stop_holdback`).
* **decoder frontier**: ``|D_t|`` minus the trailing bytes that are a valid but incomplete UTF-8
  sequence (:func:`decoder_frontier`).  SmolLM2's tokenizer is byte-level BPE: its decode *is*
  UTF-8 decoding of the concatenated token bytes (invalid sequences become U+FFFD), so a decoded
  prefix can no longer change exactly when its bytes form no incomplete tail: stability is UTF-8
  completeness (checked against ``tokenizer.decode`` in ``tests/test_stream_detokenizer.py``).
* **stream frontier** ``F_t = min(decoder frontier, stop frontier)`` (:func:`stream_frontier`),
  where the stop frontier is ``|D_t|`` when no stop string is excluded from the output,
  ``|D_t| - h_t`` under text and span alignment, and, under token alignment, the decoder frontier
  of the longest token prefix that ends at or before ``|D_t| - h_t``.

Declared choices where the seed leaves one open (each is tested):

* **Match domain.** Stop strings are ``str`` values matched on their UTF-8 bytes against the
  *output* bytes only (never the prompt).  A match may start and end inside a token and span any
  number of tokens.
* **Which match fires.** The earliest-ending match wins; among matches ending at the same byte
  the longest pattern wins, then the first listed (:func:`find_stop_match`).
* **min_new_tokens.** Like vLLM, ``min_new_tokens`` suppresses EOS *and* stop strings: a trigger
  of either kind is eligible only at output index ``t >= min_new_tokens`` (0-based), and a stop
  match is eligible only when it ends inside the bytes of an eligible token.  A suppressed EOS is
  an ordinary committed token with no bytes.  Structured completion/error, ``length`` and
  ``context_length`` are never suppressed.
* **Finish precedence.** Every trigger that fires at one commit is recorded; one canonical
  reason is returned, the highest under :data:`decodespec.spec.enums.FINISH_PRECEDENCE`.
* **Text cut.** The text ends at the stop match (its start when the stop string is excluded,
  its end when ``include_stop_str``) when a stop string fired; else at the structured completion
  offset when the JSON value completed (bytes after it in the same token are trimmed); else
  nothing is trimmed.  The cut depends on the triggers, not on which reason is canonical.
* **Alignment contracts** (M3.10 "Token-aligned and text-aligned outputs can diverge"), chosen
  per request (:class:`OutputAlignment`), with ``k`` the number of returned tokens:

  - ``TOKEN``: whole tokens; the returned ids always decode exactly to the returned text.  When
    an excluded stop string fired, ``k`` is the number of tokens that end at or before the match
    start (every token holding a stop byte is dropped with its logprob, so the text may lose
    bytes before the stop that share its first token).  Otherwise every committed token is kept
    and the text is their full decode (an included stop string keeps any overhang after it; a
    structured completion keeps the rest of its token).
  - ``TEXT``: the text is trimmed at the exact byte cut; ``k`` is the fewest tokens whose bytes
    cover the text.  The ids then decode to ``text + overhang``, the documented mismatch
    (:attr:`AlignedOutput.overhang`), a prefix of the trimmed bytes.
  - ``SPAN``: every committed token is kept; the text is trimmed at the exact cut and
    :attr:`AlignedOutput.token_spans`, ``visible`` and ``trimmed`` mark which bytes are shown.

  Logprobs follow the returned ids: ``len(logprobs) == len(output_ids)`` in every contract.
  EOS is kept in the ids (and its logprob) and never appears in the text.
* **include_stop_str** decides whether the matched stop string is part of the returned text;
  when it is, nothing needs to be held back for it while streaming.

Source: M3.10 0x06 "Stop criteria and active rows" through "Finish reason and RNG precedence";
peers: vLLM ``v1/engine/detokenizer.py`` (holds back ``max(len(stop)) - 1`` characters, truncates
text but not ids), HF ``StopStringCriteria`` (stops on overlap with the last token, never trims).

Size: one reference: the stream's commit horizon is defined by the stop matcher's holdback and the
incremental decoder, and the output alignment by the stop match; they are checked against each
other.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .enums import FINISH_PRECEDENCE, FinishReason, canonical_finish_reason
from .errors import Rejection, ResourceLimit, register_code
from .rules import rule
from .structured import DEFAULT_MAX_JSON_DEPTH, JsonStatus, json_prefix_status, utf8_lead_info

__all__ = [
    "MAX_STOP_PATTERN_BYTES",
    "MAX_STOP_STRINGS",
    "STOP_AFTER_FINISH",
    "STOP_EMPTY_PATTERN",
    "STOP_FINISH_NOT_ALLOWED",
    "STOP_INVALID_ALIGNMENT",
    "STOP_INVALID_COUNT",
    "STOP_PATTERN_TOO_LONG",
    "STOP_PATTERN_TYPE",
    "STOP_TOKEN_OUT_OF_RANGE",
    "STOP_TOO_MANY_PATTERNS",
    "AlignedOutput",
    "Chunk",
    "OutputAlignment",
    "ReferenceRun",
    "StopConfig",
    "StopMatch",
    "StreamStep",
    "align_output",
    "chunk_metadata_holds",
    "decoder_frontier",
    "encode_stop_strings",
    "find_stop_match",
    "make_chunk",
    "output_alignment_holds",
    "reference_stream",
    "resolve_finish",
    "step_triggers",
    "stop_holdback",
    "stream_excludes_stop",
    "stream_frontier",
    "stream_matches_output",
    "stream_prefix_holds",
    "token_ends",
    "utf8_pending_len",
]

_SECTION = "M3.10 0x06 Stop criteria and active rows"

STOP_EMPTY_PATTERN = register_code(
    "stop.empty_pattern", "rejection", _SECTION,
    "A stop string is empty; it would match before any output byte.")
STOP_PATTERN_TYPE = register_code(
    "stop.pattern_type", "rejection", _SECTION,
    "A stop string is not a str, or cannot be encoded as UTF-8 (a lone surrogate).")
STOP_TOO_MANY_PATTERNS = register_code(
    "stop.too_many_patterns", "resource_limit", "M3.10 0x06 Bound parsers, matchers, traces",
    "More stop strings than the declared bound MAX_STOP_STRINGS.")
STOP_PATTERN_TOO_LONG = register_code(
    "stop.pattern_too_long", "resource_limit", "M3.10 0x06 Bound parsers, matchers, traces",
    "A stop string's UTF-8 encoding is longer than the declared bound MAX_STOP_PATTERN_BYTES.")
STOP_INVALID_COUNT = register_code(
    "stop.invalid_count", "rejection", _SECTION,
    "A stop count is out of range: a negative count, min_new_tokens > max_new_tokens, "
    "max_context_len < 1, max_json_depth < 1, or an EOS id that is negative.")
STOP_INVALID_ALIGNMENT = register_code(
    "stop.invalid_alignment", "rejection", "M3.10 0x06 Token-aligned and text-aligned outputs can diverge",
    "The output alignment is not one of token, text, span.")
STOP_TOKEN_OUT_OF_RANGE = register_code(
    "stop.token_out_of_range", "rejection", "M3.10 0x06 One selection is an output-state transaction",
    "A committed token id is outside [0, V) of the tokenizer.")
STOP_AFTER_FINISH = register_code(
    "stop.after_finish", "rejection", "M3.10 0x06 One selection is an output-state transaction",
    "A token was pushed, or a finish requested, after the output was closed.")
STOP_FINISH_NOT_ALLOWED = register_code(
    "stop.finish_not_allowed", "rejection", "M3.10 0x06 Finish reason and RNG precedence",
    "An external finish named a reason that only a committed token can fire (eos, stop_string, "
    "structured, structured_error), or a length reason whose bound is not reached.")

#: Declared bound on the number of stop strings (M3.10 0x06 "Bound parsers, matchers, traces").
MAX_STOP_STRINGS = 64
#: Declared bound on one stop string's UTF-8 length in bytes.
MAX_STOP_PATTERN_BYTES = 512



class OutputAlignment(str, enum.Enum):
    """Output contract after a stop (M3.10 "Token-aligned and text-aligned outputs can diverge")."""

    TOKEN = "token"
    TEXT = "text"
    SPAN = "span"


def encode_stop_strings(stop_strings: Sequence[str]) -> tuple[bytes, ...]:
    """Validate stop strings and return their UTF-8 encodings, in order.

    Raises:
        Rejection: ``stop.pattern_type`` (not a str, or not encodable), ``stop.empty_pattern``.
        ResourceLimit: ``stop.too_many_patterns``, ``stop.pattern_too_long``.
    """
    if isinstance(stop_strings, (str, bytes)):
        raise Rejection(STOP_PATTERN_TYPE, "stop strings must be a list of str, not one string", "$.stop")
    items = list(stop_strings)
    if len(items) > MAX_STOP_STRINGS:
        raise ResourceLimit(STOP_TOO_MANY_PATTERNS, f"{len(items)} stop strings > {MAX_STOP_STRINGS}", "$.stop",
                            {"limit": MAX_STOP_STRINGS, "actual": len(items)})
    out = []
    for i, s in enumerate(items):
        path = f"$.stop[{i}]"
        if not isinstance(s, str):
            raise Rejection(STOP_PATTERN_TYPE, f"stop string must be str, got {type(s).__name__}", path)
        try:
            b = s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise Rejection(STOP_PATTERN_TYPE, f"stop string is not encodable as UTF-8: {exc.reason}", path) from None
        if not b:
            raise Rejection(STOP_EMPTY_PATTERN, "stop string is empty", path)
        if len(b) > MAX_STOP_PATTERN_BYTES:
            raise ResourceLimit(STOP_PATTERN_TOO_LONG, f"stop string is {len(b)} bytes > {MAX_STOP_PATTERN_BYTES}", path,
                                {"limit": MAX_STOP_PATTERN_BYTES, "actual": len(b)})
        out.append(b)
    return tuple(out)


def _to_alignment(value: Any) -> OutputAlignment:
    try:
        return OutputAlignment(value)
    except ValueError:
        raise Rejection(STOP_INVALID_ALIGNMENT, f"alignment must be one of token, text, span; got {value!r}",
                        "$.alignment") from None


def _to_id_set(value: Iterable[int]) -> frozenset[int]:
    return frozenset(value)


def _to_stop_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)):
        raise Rejection(STOP_PATTERN_TYPE, "stop strings must be a list of str, not one string", "$.stop")
    return tuple(value)


def _check_count(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Rejection(STOP_INVALID_COUNT, f"{name} must be an int >= {minimum}, got {value!r}", f"$.{name}")


@attrs.frozen
class StopConfig:
    """Frozen stop, stream and output parameters of one request (validated on construction).

    Attributes:
        max_new_tokens: ``G``; the ``length`` trigger fires when ``O >= G``.
        eos_ids: Token ids that fire ``eos`` (the stop-token set).
        min_new_tokens: EOS and stop strings are suppressed at output indices below this.
        prompt_len: ``L``, for the total-context bound.
        max_context_len: ``context_length`` fires when ``L + O >= max_context_len``; ``None`` = no bound.
        stop_strings: Stop strings, matched on their UTF-8 bytes in the output.
        include_stop_str: Whether a matched stop string is part of the returned text.
        alignment: The output contract (:class:`OutputAlignment`).
        json_completion: Whether a completed JSON value fires ``structured`` (and an invalid
            prefix ``structured_error``).
        max_json_depth: Bound on JSON nesting depth.

    Raises:
        Rejection: ``stop.invalid_count``, ``stop.pattern_type``, ``stop.empty_pattern``.
        ResourceLimit: ``stop.too_many_patterns``, ``stop.pattern_too_long``.
    """

    max_new_tokens: int
    eos_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_to_id_set)
    min_new_tokens: int = 0
    prompt_len: int = 0
    max_context_len: int | None = None
    stop_strings: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_tuple)
    include_stop_str: bool = False
    alignment: OutputAlignment = attrs.field(default=OutputAlignment.TEXT, converter=_to_alignment)
    json_completion: bool = False
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    stop_patterns: tuple[bytes, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _check_count(self.max_new_tokens, "max_new_tokens", 0)
        _check_count(self.min_new_tokens, "min_new_tokens", 0)
        _check_count(self.prompt_len, "prompt_len", 0)
        _check_count(self.max_json_depth, "max_json_depth", 1)
        if self.max_context_len is not None:
            _check_count(self.max_context_len, "max_context_len", 1)
        if self.min_new_tokens > self.max_new_tokens:
            raise Rejection(STOP_INVALID_COUNT, f"min_new_tokens={self.min_new_tokens} > max_new_tokens={self.max_new_tokens}",
                            "$.min_new_tokens")
        for i in self.eos_ids:
            _check_count(i, "eos_ids[]", 0)
        object.__setattr__(self, "stop_patterns", encode_stop_strings(self.stop_strings))

    @property
    def holds_back_stop(self) -> bool:
        """Whether stop-pattern prefixes must be held back while streaming (excluded stops)."""
        return bool(self.stop_patterns) and not self.include_stop_str


@attrs.frozen
class StopMatch:
    """One stop-string occurrence in the output bytes.

    Attributes:
        pattern_idx: Index into ``stop_strings``.
        start, end: Half-open byte range ``[start, end)`` of the match in the output bytes.

    Units: bytes.
    """

    pattern_idx: int
    start: int
    end: int


@attrs.frozen
class Chunk:
    """One published piece of the stream; text never travels without its token metadata.

    Attributes:
        chunk_idx: 0-based, consecutive.
        text: UTF-8 decode of output bytes ``[byte_start, byte_end)``.
        byte_start, byte_end: Half-open byte range in the output bytes (``byte_start`` is the
            previous chunk's ``byte_end``; published bytes are never retracted).
        token_start, token_end: Half-open range of output token indices whose bytes the chunk
            covers (from the token holding ``byte_start`` to the token holding ``byte_end - 1``).

    Units: bytes and output token indices.
    """

    chunk_idx: int
    text: str
    byte_start: int
    byte_end: int
    token_start: int
    token_end: int

    def to_json(self) -> dict[str, Any]:
        """The ``stream`` event fields of the runtime trace (docs/design.md section 6)."""
        return attrs.asdict(self)


@attrs.frozen
class AlignedOutput:
    """The returned output of one finished request under one alignment contract.

    Attributes:
        alignment: The contract applied.
        output_ids: Returned token ids (``int[k]``).
        logprobs: Their logprobs (``float[k]``), or ``None`` when none were recorded (or ``O = 0``).
        text: Returned text: UTF-8 decode of output bytes ``[0, visible_end)``.
        token_spans: Byte span ``(start, end)`` of each returned token in the output bytes.
        visible_end: End of the visible bytes (the text).
        ids_byte_end: End of the bytes of the returned ids (``>= visible_end``).
        overhang: Output bytes ``[visible_end, ids_byte_end)``: what the returned ids decode to
            beyond the text (empty under ``TOKEN``; the documented mismatch under ``TEXT``;
            the trimmed bytes under ``SPAN``).
        total_bytes: Bytes of all committed output tokens.
        num_committed: ``O``, tokens committed (returned or not).
        finish_reason: The canonical finish reason.
        triggers: Every trigger that fired, in precedence order.
        stop_match: The stop match that fired, or ``None``.
        structured_end: Byte offset where the JSON value completed, or ``None``.

    Units: byte offsets into the output's UTF-8 bytes.
    """

    alignment: OutputAlignment
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    text: str
    token_spans: tuple[tuple[int, int], ...]
    visible_end: int
    ids_byte_end: int
    overhang: bytes
    total_bytes: int
    num_committed: int
    finish_reason: FinishReason
    triggers: tuple[FinishReason, ...]
    stop_match: StopMatch | None
    structured_end: int | None

    @property
    def visible(self) -> tuple[int, int]:
        """Half-open byte range of the visible text."""
        return (0, self.visible_end)

    @property
    def trimmed(self) -> tuple[int, int]:
        """Half-open byte range of committed output bytes not in the text."""
        return (self.visible_end, self.total_bytes)


@attrs.frozen
class StreamStep:
    """The reference view after one committed token.

    Attributes:
        token_idx: Output index ``t`` of the token.
        num_bytes: ``|D_t|``.
        decoder_frontier: Bytes whose decode can no longer change.
        stop_holdback: ``h_t``.
        published: Bytes published after this step (the stream frontier, or the final text
            length when this step finished the output).
        triggers: Finish triggers that fired at this step, in precedence order.
    """

    token_idx: int
    num_bytes: int
    decoder_frontier: int
    stop_holdback: int
    published: int
    triggers: tuple[FinishReason, ...]


@attrs.frozen
class ReferenceRun:
    """The reference stream of one token sequence: per-step view, chunks, final output."""

    steps: tuple[StreamStep, ...]
    chunks: tuple[Chunk, ...]
    output: AlignedOutput | None


# -- pure definitions ------------------------------------------------------------------------

def token_ends(token_bytes: Sequence[bytes]) -> list[int]:
    """Cumulative byte end of each output token: ``ends[i] = |bytes of tokens 0..i|``."""
    ends, n = [], 0
    for b in token_bytes:
        n += len(b)
        ends.append(n)
    return ends


def utf8_pending_len(data: bytes) -> int:
    """Length of the trailing valid-but-incomplete UTF-8 sequence of ``data`` (0..3).

    A lead byte followed by fewer continuation bytes than it needs, each in its allowed range
    (RFC 3629 Table 3-7), may still become one character; any other tail is final (valid, or
    invalid and decoded as U+FFFD now and forever).
    """
    for n in (1, 2, 3):
        if n > len(data):
            return 0
        tail = data[-n:]
        lead = utf8_lead_info(tail[0])
        if lead is None:
            continue
        need, lo, hi = lead
        if n > need:
            return 0
        ok = all((lo if i == 1 else 0x80) <= tail[i] <= (hi if i == 1 else 0xBF) for i in range(1, n))
        return n if ok else 0
    return 0


@rule(
    "invariant.decoder_frontier",
    title="Decoder frontier: UTF-8 completeness",
    section="M3.10 0x06 Deriving the stream holdback",
    statement=(
        "For byte-level BPE, decode(ids) is the UTF-8 decode (U+FFFD for invalid sequences) of "
        "the concatenated token bytes; the decoded text of bytes [0, f) can no longer change "
        "once f excludes only a trailing valid-but-incomplete UTF-8 sequence."
    ),
)
def decoder_frontier(data: bytes) -> int:
    """Bytes of ``data`` whose decode can no longer change: ``len(data) - utf8_pending_len(data)``."""
    return len(data) - utf8_pending_len(data)


@rule(
    "invariant.stream_holdback",
    title="Stop holdback h_t",
    section="M3.10 0x06 Deriving the stream holdback",
    statement=(
        "h_t is the length of the longest suffix of the decoded output bytes D_t that is a "
        "proper prefix of some stop pattern (0 if none); a future token can complete a stop only "
        "through that suffix."
    ),
)
def stop_holdback(data: bytes, patterns: Sequence[bytes]) -> int:
    """``h_t``: the longest suffix of ``data`` that is a proper prefix of a pattern.

    Units: bytes.
    """
    best = 0
    for p in patterns:
        for r in range(min(len(p) - 1, len(data)), best, -1):
            if data[len(data) - r:] == p[:r]:
                best = r
                break
    return best


@rule(
    "invariant.stop_match_rule",
    title="Which stop match fires",
    section="M3.10 0x06 Token stops, text stops, and structured stops",
    statement=(
        "Among stop matches in the output bytes that end after the eligibility offset, the "
        "earliest-ending one fires; at the same end byte the longest pattern, then the first "
        "listed."
    ),
)
def find_stop_match(data: bytes, patterns: Sequence[bytes], *, eligible_from: int = 0) -> StopMatch | None:
    """The stop match that fires in ``data``, or ``None``.

    Args:
        data: Output bytes ``D_t``.
        patterns: Encoded stop strings.
        eligible_from: Only matches with ``end > eligible_from`` count (the byte offset where
            the first eligible token starts under ``min_new_tokens``).

    Units: bytes.
    """
    for end in range(max(eligible_from, 0) + 1, len(data) + 1):
        found = [(-len(p), i) for i, p in enumerate(patterns) if len(p) <= end and data[end - len(p):end] == p]
        if found:
            neg_len, idx = min(found)
            return StopMatch(pattern_idx=idx, start=end + neg_len, end=end)
    return None


@rule(
    "invariant.stop_triggers",
    title="Finish triggers of one committed token",
    section="M3.10 0x06 Stop criteria and active rows",
    statement=(
        "After committing output token t: stop_string fires on an eligible stop match, structured "
        "when the JSON value completes, structured_error when the prefix is invalid JSON, eos when "
        "the id is in the EOS set, length when O >= max_new_tokens, context_length when "
        "L + O >= max_context_len; eos and stop_string are eligible only when t >= min_new_tokens."
    ),
)
def step_triggers(config: StopConfig, token_ids: Sequence[int], token_bytes: Sequence[bytes]
                  ) -> tuple[frozenset[FinishReason], StopMatch | None, int | None]:
    """Triggers fired by the last of ``token_ids`` (assuming none fired at an earlier token).

    Args:
        config: The request's stop parameters.
        token_ids: Committed output ids ``int[O]`` (``O >= 1``).
        token_bytes: Their bytes (``b""`` for special tokens).

    Returns:
        ``(triggers, stop_match, structured_end)``.
    """
    t = len(token_ids) - 1
    data = b"".join(token_bytes)
    fired: set[FinishReason] = set()
    eligible = t >= config.min_new_tokens
    match = None
    if config.stop_patterns and eligible:
        eligible_from = token_ends(token_bytes)[config.min_new_tokens - 1] if config.min_new_tokens else 0
        match = find_stop_match(data, config.stop_patterns, eligible_from=eligible_from)
        if match is not None:
            fired.add(FinishReason.STOP_STRING)
    structured_end = None
    if config.json_completion:
        status, structured_end = json_prefix_status(data, max_depth=config.max_json_depth)
        if status is JsonStatus.COMPLETE:
            fired.add(FinishReason.STRUCTURED)
        elif status is JsonStatus.INVALID:
            fired.add(FinishReason.STRUCTURED_ERROR)
    if eligible and token_ids[-1] in config.eos_ids:
        fired.add(FinishReason.EOS)
    if t + 1 >= config.max_new_tokens:
        fired.add(FinishReason.LENGTH)
    if config.max_context_len is not None and config.prompt_len + t + 1 >= config.max_context_len:
        fired.add(FinishReason.CONTEXT_LENGTH)
    return frozenset(fired), match, structured_end


@rule(
    "invariant.finish_precedence",
    title="One canonical finish reason",
    section="M3.10 0x06 Finish reason and RNG precedence",
    statement=(
        "Every trigger that fires at one commit is recorded; the published finish reason is the "
        "highest of them under FINISH_PRECEDENCE (cancelled > timeout > device_error > "
        "stream_error > constraint_error > structured_error > stop_string > structured > eos > context_length > length)."
    ),
)
def resolve_finish(triggers: frozenset[FinishReason] | set[FinishReason]) -> tuple[FinishReason, tuple[FinishReason, ...]]:
    """``(canonical reason, all triggers in precedence order)`` for a non-empty trigger set."""
    reason = canonical_finish_reason(triggers)
    assert reason is not None, "resolve_finish needs at least one trigger"
    return reason, tuple(r for r in FINISH_PRECEDENCE if r in triggers)


@rule(
    "invariant.stream_frontier",
    title="Stream frontier",
    section="M3.10 0x06 Deriving the stream holdback",
    statement=(
        "After a commit that does not finish the output, exactly the bytes before "
        "F_t = min(decoder frontier, stop frontier) are published, where the stop frontier is "
        "|D_t| without excluded stop strings, |D_t| - h_t under text and span alignment, and the "
        "decoder frontier of the longest token prefix ending at or before |D_t| - h_t under token "
        "alignment."
    ),
)
def stream_frontier(config: StopConfig, token_bytes: Sequence[bytes]) -> int:
    """``F_t`` for output token bytes ``token_bytes`` (tokens ``0..t``).

    Units: bytes.
    """
    data = b"".join(token_bytes)
    stop_front = len(data)
    if config.holds_back_stop:
        stop_front = len(data) - stop_holdback(data, config.stop_patterns)
        if config.alignment is OutputAlignment.TOKEN:
            ends = token_ends(token_bytes)
            k = bisect.bisect_right(ends, stop_front)
            stop_front = decoder_frontier(data[:ends[k - 1]]) if k else 0
    return min(decoder_frontier(data), stop_front)


def _text_cut(config: StopConfig, triggers: frozenset[FinishReason], stop_match: StopMatch | None,
              structured_end: int | None) -> int | None:
    if FinishReason.STOP_STRING in triggers:
        assert stop_match is not None
        return stop_match.end if config.include_stop_str else stop_match.start
    if FinishReason.STRUCTURED in triggers:
        assert structured_end is not None
        return structured_end
    return None


def align_output(config: StopConfig, token_ids: Sequence[int], token_bytes: Sequence[bytes],
                 logprobs: Sequence[float] | None, triggers: frozenset[FinishReason],
                 stop_match: StopMatch | None = None, structured_end: int | None = None) -> AlignedOutput:
    """The returned output under ``config.alignment`` (see the module docstring).

    Args:
        config: Stop parameters (alignment, include_stop_str).
        token_ids: All committed output ids ``int[O]``.
        token_bytes: Their bytes.
        logprobs: ``float[O]`` or ``None``.
        triggers: Non-empty set of triggers that closed the output.
        stop_match: The fired stop match when ``stop_string`` is in ``triggers``.
        structured_end: The completion offset when ``structured`` is in ``triggers``.
    """
    data = b"".join(token_bytes)
    ends = token_ends(token_bytes)
    num = len(token_ids)
    cut = _text_cut(config, triggers, stop_match, structured_end)
    if cut is None or config.alignment is OutputAlignment.SPAN:
        k = num
    elif config.alignment is OutputAlignment.TEXT:
        k = bisect.bisect_left(ends, cut) + 1 if cut > 0 else 0
    elif FinishReason.STOP_STRING in triggers and not config.include_stop_str:
        k = bisect.bisect_right(ends, cut)
    else:
        k = num
    ids_byte_end = ends[k - 1] if k else 0
    visible_end = ids_byte_end if config.alignment is OutputAlignment.TOKEN else (len(data) if cut is None else cut)
    reason, ordered = resolve_finish(triggers)
    return AlignedOutput(
        alignment=config.alignment,
        output_ids=tuple(token_ids[:k]),
        logprobs=None if not logprobs else tuple(logprobs[:k]),
        text=data[:visible_end].decode("utf-8", errors="replace"),
        token_spans=tuple((ends[i - 1] if i else 0, ends[i]) for i in range(k)),
        visible_end=visible_end,
        ids_byte_end=ids_byte_end,
        overhang=data[visible_end:ids_byte_end],
        total_bytes=len(data),
        num_committed=num,
        finish_reason=reason,
        triggers=ordered,
        stop_match=stop_match if FinishReason.STOP_STRING in triggers else None,
        structured_end=structured_end if FinishReason.STRUCTURED in triggers else None,
    )


def make_chunk(chunk_idx: int, data: bytes, ends: Sequence[int], byte_start: int, byte_end: int) -> Chunk:
    """The chunk publishing output bytes ``[byte_start, byte_end)`` with its token range."""
    return Chunk(
        chunk_idx=chunk_idx,
        text=data[byte_start:byte_end].decode("utf-8", errors="replace"),
        byte_start=byte_start,
        byte_end=byte_end,
        token_start=bisect.bisect_right(ends, byte_start),
        token_end=bisect.bisect_left(ends, byte_end) + 1,
    )


def reference_stream(config: StopConfig, token_ids: Sequence[int], token_bytes: Sequence[bytes],
                     logprobs: Sequence[float] | None = None, *,
                     external: FinishReason | None = None) -> ReferenceRun:
    """Run the reference over committed tokens until a trigger fires.

    Args:
        config: Stop parameters.
        token_ids: Candidate output ids in commit order; tokens after the one that finishes the
            output are ignored.
        token_bytes: Their bytes (``b""`` for special tokens), same length.
        logprobs: ``float[len(token_ids)]`` or ``None``.
        external: If no trigger fires, close the output after the last token with this reason
            (an :data:`~decodespec.spec.enums.EXTERNAL_FINISH_REASONS` member other than ``stream_error``); ``None``
            leaves the run unfinished (``output is None``).

    Returns:
        Per-step view, the chunks a conforming streamer publishes, and the final output.
    """
    assert len(token_ids) == len(token_bytes)
    assert logprobs is None or len(logprobs) == len(token_ids)
    steps: list[StreamStep] = []
    chunks: list[Chunk] = []
    published = 0
    output = None
    num = 0

    def publish(upto: int, data: bytes, ends: list[int]) -> None:
        nonlocal published
        assert upto >= published, "a stream frontier moved backwards"
        if upto > published:
            chunks.append(make_chunk(len(chunks), data, ends, published, upto))
            published = upto

    for t in range(len(token_ids)):
        num = t + 1
        ids, tb = token_ids[:num], token_bytes[:num]
        data, ends = b"".join(tb), token_ends(tb)
        fired, match, structured_end = step_triggers(config, ids, tb)
        if fired:
            output = align_output(config, ids, tb, None if logprobs is None else logprobs[:num], fired, match, structured_end)
            publish(output.visible_end, data, ends)
        else:
            publish(stream_frontier(config, tb), data, ends)
        steps.append(StreamStep(
            token_idx=t, num_bytes=len(data), decoder_frontier=decoder_frontier(data),
            stop_holdback=stop_holdback(data, config.stop_patterns), published=published,
            triggers=output.triggers if output is not None else ()))
        if output is not None:
            break
    if output is None and external is not None:
        ids, tb = token_ids[:num], token_bytes[:num]
        output = align_output(config, ids, tb, None if logprobs is None else logprobs[:num], frozenset({external}))
        publish(output.visible_end, b"".join(tb), token_ends(tb))
    return ReferenceRun(steps=tuple(steps), chunks=tuple(chunks), output=output)


# -- invariants over what a runtime published and returned ------------------------------------

@rule(
    "invariant.stream_prefix",
    title="Published stream is never retracted",
    section="M3.10 0x06 Streaming has a commit horizon",
    statement=(
        "Chunks are numbered 0, 1, ... and publish consecutive, non-empty, non-overlapping byte "
        "ranges starting at byte 0: what was published is a prefix of everything published later."
    ),
)
def stream_prefix_holds(chunks: Sequence[Chunk]) -> bool:
    """Whether ``chunks`` publish consecutive non-empty byte ranges from 0, numbered from 0."""
    at = 0
    for i, c in enumerate(chunks):
        if c.chunk_idx != i or c.byte_start != at or c.byte_end <= c.byte_start:
            return False
        at = c.byte_end
    return True


@rule(
    "invariant.stream_final",
    title="Stream equals the returned text",
    section="M3.10 0x06 Streaming has a commit horizon",
    statement=(
        "After a finish other than stream_error, the concatenated chunk texts equal the returned "
        "text and the last chunk ends at its visible end (held-back bytes are flushed when no stop "
        "matched)."
    ),
)
def stream_matches_output(chunks: Sequence[Chunk], output: AlignedOutput) -> bool:
    """Whether the chunks publish exactly ``output.text`` (bytes ``[0, visible_end)``)."""
    end = chunks[-1].byte_end if chunks else 0
    return stream_prefix_holds(chunks) and end == output.visible_end and "".join(c.text for c in chunks) == output.text


@rule(
    "invariant.stream_no_stop_bytes",
    title="No excluded stop byte is ever published",
    section="M3.10 0x06 Deriving the stream holdback",
    statement=(
        "When the fired stop string is excluded from the output, no published chunk reaches past "
        "the match start."
    ),
)
def stream_excludes_stop(chunks: Sequence[Chunk], output: AlignedOutput, include_stop_str: bool) -> bool:
    """Whether no chunk publishes a byte of an excluded stop match."""
    if output.stop_match is None or include_stop_str:
        return True
    return all(c.byte_end <= output.stop_match.start for c in chunks)


@rule(
    "invariant.chunk_metadata",
    title="Chunks carry their token range",
    section="M3.10 0x06 Streaming has a commit horizon",
    statement=(
        "A chunk's text is the decode of its byte range, and [token_start, token_end) is the range "
        "of output tokens from the one holding its first byte to the one holding its last byte."
    ),
)
def chunk_metadata_holds(chunk: Chunk, data: bytes, ends: Sequence[int]) -> bool:
    """Whether ``chunk`` agrees with output bytes ``data`` and token ends ``ends``."""
    return chunk == make_chunk(chunk.chunk_idx, data, ends, chunk.byte_start, chunk.byte_end)


@rule(
    "invariant.output_alignment",
    title="Ids, logprobs and text stay aligned",
    section="M3.10 0x06 Token-aligned and text-aligned outputs can diverge",
    statement=(
        "len(logprobs) == len(output_ids); the returned ids' bytes are text bytes + overhang; "
        "TOKEN has no overhang, SPAN returns every committed token, TEXT returns the fewest tokens "
        "covering the text; the finish reason is the highest-precedence trigger."
    ),
)
def output_alignment_holds(output: AlignedOutput, committed_bytes: Sequence[bytes]) -> bool:
    """Whether ``output`` satisfies its alignment contract against the committed token bytes."""
    data = b"".join(committed_bytes)
    k = len(output.output_ids)
    ids_bytes = b"".join(committed_bytes[:k])
    ok = (
        (output.logprobs is None or len(output.logprobs) == k)
        and len(output.token_spans) == k
        and ids_bytes == data[:output.visible_end] + output.overhang
        and output.text == data[:output.visible_end].decode("utf-8", errors="replace")
        and output.total_bytes == len(data)
        and output.num_committed == len(committed_bytes)
        and output.finish_reason is canonical_finish_reason(output.triggers)
    )
    if output.alignment is OutputAlignment.TOKEN:
        ok = ok and not output.overhang
    elif output.alignment is OutputAlignment.SPAN:
        ok = ok and k == output.num_committed
    else:
        ok = ok and (k == 0 or output.token_spans[-1][0] < output.visible_end or output.visible_end == output.total_bytes)
    return ok
