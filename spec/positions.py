"""M3.10 0x0A Position and cache consistency: translation receipts, decision rows, cached masks, capacity.

Pure functions over plain integers and tuples (no tensors), so that the runtime can compare its
tensors against them element by element:

* :func:`translation_receipt`: for one rectangular row, the explicit map
  *rectangular column -> valid semantic row -> model position id -> logical cache slot*
  (M3.10 0x0A "Each prepared call records an explicit translation receipt"), for left or right
  padding, under the ``valid_token_cumsum`` position rule, with either a compact cache (padding
  is not cached) or a rectangular one (padding columns occupy slots that stay invalid).
* :func:`decision_column`: the greatest valid column, the row that owns the next decision
  (M3.10 0x07; ``count - 1`` is wrong under left padding).
* :func:`cached_causal_mask` / :func:`prefix_lm_chunk_mask`: visibility of a chunk of ``c``
  query rows starting at logical position ``p`` over keys ``[0, p + c)``: shape ``[c, p + c]``,
  a fully visible history block of width ``p`` and a lower-triangular current block
  (M3.10 0x0A "Deriving cached causal visibility from coordinates"); the prefix-LM variant is
  bidirectional inside the prefix (M3.10 0x01 "Prefix execution has a phase change").
* :class:`StaticCacheLedger`: ``0 <= committed <= reserved <= maximum``; a write that would
  overflow the reserved slots is refused with ``ResourceLimit("cache.capacity_exceeded")``
  before any slot is touched, and a write that does not start at the committed frontier is
  refused with ``Rejection("cache.slot_mismatch")`` (M3.10 0x09 "Cache families preserve
  different contracts", 0x0B "cache_position reset after prefill").

Masks are returned as Boolean *visibility* (``True`` = the query may read the key); the
runtime turns ``False`` into ``-inf``.  Absence is ``None`` (never ``-1``).

Source: M3.10 0x07 "Batched inference and padding-side bugs", 0x09, 0x0A.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .errors import Rejection, ResourceLimit, register_code

__all__ = [
    "CACHE_CAPACITY_EXCEEDED",
    "CACHE_LEDGER_INVALID",
    "CACHE_SLOT_MISMATCH",
    "EMPTY_INPUT_ROW",
    "INVALID_MASK",
    "PAD_POSITION_FILL",
    "PREFIX_SPLIT",
    "StaticCacheLedger",
    "TranslationEntry",
    "TranslationReceipt",
    "cached_causal_mask",
    "call_positions",
    "decision_column",
    "intersect_key_validity",
    "prefix_lm_chunk_mask",
    "translation_receipt",
    "valid_columns",
]

EMPTY_INPUT_ROW = register_code(
    "runtime.empty_input_row",
    "rejection",
    "M3.10 0x07 Batched inference and padding-side bugs",
    "An input row has no valid column, so no row can own the next decision.",
)
INVALID_MASK = register_code(
    "runtime.invalid_mask",
    "rejection",
    "M3.10 0x07 Batched inference and padding-side bugs",
    "An attention mask holds a value other than 0 or 1, or its valid columns are not one contiguous run.",
)
PREFIX_SPLIT = register_code(
    "runtime.prefix_split",
    "rejection",
    "M3.10 0x01 Prefix execution has a phase change inside one sequence",
    "A prefix-LM call would split the bidirectional prefix across calls (earlier prefix rows could not see later ones).",
)
CACHE_CAPACITY_EXCEEDED = register_code(
    "cache.capacity_exceeded",
    "resource_limit",
    "M3.10 0x09 Cache families preserve different contracts",
    "A static-cache write would end beyond the reserved slots; refused before any slot is touched.",
)
CACHE_SLOT_MISMATCH = register_code(
    "cache.slot_mismatch",
    "rejection",
    "M3.10 0x0B Shape-correct failure lab (cache_position reset after prefill)",
    "A cache write does not start at the committed frontier (it would overwrite committed rows or leave a gap).",
)
CACHE_LEDGER_INVALID = register_code(
    "cache.ledger_invalid",
    "rejection",
    "M3.10 0x09 Cache families preserve different contracts",
    "A static-cache ledger violates 0 <= committed <= reserved <= maximum.",
)

#: Value the runtime writes into ``position_ids`` at padding columns.  The padding column is not
#: a token, so its position is *absent* (``None`` in a receipt); HF transformers
#: (``generation/utils.py``, ``_prepare_position_ids_for_generation``) and the M3.10 0x0A
#: snippet fill it with 0 so the tensor stays integral.
PAD_POSITION_FILL = 0


def valid_columns(attention_mask: Sequence[int], *, path: str = "$.attention_mask") -> tuple[int, ...]:
    """Columns whose mask value is 1, after checking the mask's values.

    Args:
        attention_mask: One row ``[T]`` of 0/1 integers (bools accepted).

    Returns:
        The valid columns in increasing order.

    Raises:
        Rejection: ``runtime.invalid_mask`` for a value outside {0, 1};
            ``runtime.empty_input_row`` when no column is valid.
    """
    columns = []
    for column, value in enumerate(attention_mask):
        if value not in (0, 1):  # True/False compare equal to 1/0
            raise Rejection(INVALID_MASK, f"mask value {value!r} is not 0 or 1", f"{path}[{column}]")
        if value:
            columns.append(column)
    if not columns:
        raise Rejection(EMPTY_INPUT_ROW, "the row has no valid column, so no row owns the decision", path)
    return tuple(columns)


def decision_column(attention_mask: Sequence[int], *, path: str = "$.attention_mask") -> int:
    """The greatest valid column of one row: the column whose output row owns the next decision.

    Left padding ``[0,0,1,1,1]`` gives 4 (``sum - 1`` would give 2); right padding
    ``[1,1,0,0]`` gives 1 (the rectangular last column 3 would sample a PAD row).

    Raises:
        Rejection: as :func:`valid_columns`.

    Source: M3.10 0x07 (greatest valid absolute column).
    """
    return valid_columns(attention_mask, path=path)[-1]


@attrs.frozen
class TranslationEntry:
    """One rectangular column of a translation receipt.

    Attributes:
        column: Rectangular column index in ``[0, T)``.
        valid: Whether the column holds a real token.
        row_idx: Index of the token among the valid tokens (the semantic row), or ``None``.
        position_id: Coordinate passed to the positional method, or ``None`` for padding.
        cache_slot: Logical cache slot written for this column, or ``None`` when padding is
            not cached.  Under the rectangular layout a padding column has a slot that stays
            invalid (never readable).
    """

    column: int
    valid: bool
    row_idx: int | None
    position_id: int | None
    cache_slot: int | None


@attrs.frozen
class TranslationReceipt:
    """The explicit coordinate map of one rectangular input row (M3.10 0x0A).

    Attributes:
        entries: One :class:`TranslationEntry` per column, in column order.
        cache_layout: ``"compact"`` (only valid tokens occupy slots) or ``"rectangular"``
            (every column occupies a slot; padding slots stay invalid).
        decision_column: Greatest valid column (owner of the next decision row).
        num_valid: Number of valid tokens (the semantic prompt length L).
    """

    entries: tuple[TranslationEntry, ...]
    cache_layout: str
    decision_column: int
    num_valid: int

    def position_ids(self, pad_fill: int = PAD_POSITION_FILL) -> tuple[int, ...]:
        """The ``position_ids`` row ``[T]`` (int64 in a tensor), padding filled with ``pad_fill``."""
        return tuple(pad_fill if e.position_id is None else e.position_id for e in self.entries)

    def cache_positions(self) -> tuple[int, ...]:
        """The logical slots written by this row, in column order (``cache_position`` ``[T']``).

        Compact layout: one slot per valid token; rectangular layout: one slot per column.
        """
        return tuple(e.cache_slot for e in self.entries if e.cache_slot is not None)

    def slot_validity(self) -> tuple[bool, ...]:
        """For each written slot (in :meth:`cache_positions` order), whether it holds a real token."""
        return tuple(e.valid for e in self.entries if e.cache_slot is not None)


def translation_receipt(
    attention_mask: Sequence[int],
    *,
    cache_layout: str = "compact",
    cache_position_start: int = 0,
    path: str = "$.attention_mask",
) -> TranslationReceipt:
    """Build the translation receipt of one row under the ``valid_token_cumsum`` position rule.

    For ``[PAD, PAD, A, B, C]`` (mask ``[0,0,1,1,1]``): position ids ``[-, -, 0, 1, 2]``;
    compact slots ``[-, -, 0, 1, 2]``; rectangular slots ``[0, 1, 2, 3, 4]`` with only 2..4
    valid.  Both are correct; mixing them without this receipt is not (M3.10 0x0A).

    Args:
        attention_mask: One row ``[T]`` of 0/1 values; left, right or no padding.  The valid
            columns must form one contiguous run (interior holes are rejected).
        cache_layout: ``"compact"`` or ``"rectangular"``.
        cache_position_start: Logical slot of the first written column (0 for a fresh request).

    Returns:
        The receipt.

    Raises:
        Rejection: ``runtime.invalid_mask`` for a bad value, a non-contiguous run or an unknown
            layout; ``runtime.empty_input_row`` for an all-padding row.
    """
    if cache_layout not in ("compact", "rectangular"):
        raise Rejection(INVALID_MASK, f"unknown cache layout {cache_layout!r}", path)
    if cache_position_start < 0:
        raise Rejection(INVALID_MASK, f"cache_position_start {cache_position_start} is negative", path)
    columns = valid_columns(attention_mask, path=path)
    if columns[-1] - columns[0] + 1 != len(columns):
        hole = next(c for c in range(columns[0], columns[-1]) if c not in columns)
        raise Rejection(INVALID_MASK, "valid columns are not one contiguous run", f"{path}[{hole}]")
    entries = []
    row_idx = 0
    for column, value in enumerate(attention_mask):
        valid = bool(value)
        if cache_layout == "rectangular":
            slot: int | None = cache_position_start + column
        else:
            slot = cache_position_start + row_idx if valid else None
        entries.append(
            TranslationEntry(
                column=column,
                valid=valid,
                row_idx=row_idx if valid else None,
                position_id=row_idx if valid else None,
                cache_slot=slot,
            )
        )
        row_idx += valid
    return TranslationReceipt(
        entries=tuple(entries), cache_layout=cache_layout, decision_column=columns[-1], num_valid=len(columns)
    )


def call_positions(start: int, length: int) -> tuple[int, ...]:
    """Position ids (= logical cache slots) of an unpadded call processing ``[start, start+length)``.

    In the contiguous single-request profile the model position id, the ``cache_position`` and
    the semantic token position coincide by this declared translation; the call's rows are
    ``start, ..., start + length - 1`` and never restart at 0 after prefill.
    """
    if start < 0 or length < 0:
        raise ValueError(f"negative call slice start={start} length={length}")
    return tuple(range(start, start + length))


def cached_causal_mask(start: int, length: int) -> tuple[tuple[bool, ...], ...]:
    """Causal visibility of a chunk: ``length`` query rows at ``[start, start+length)`` over keys ``[0, start+length)``.

    ``M[i][j]`` is ``True`` iff ``j <= start + i``: a fully visible history block of width
    ``start`` and a lower-triangular current block of width ``length``.  For ``start=3,
    length=2``: row 0 sees keys 0..3, row 1 sees 0..4.

    Shapes:
        result: ``[c, p + c]`` with ``c = length``, ``p = start`` (bool).

    Source: M3.10 0x0A "Deriving cached causal visibility from coordinates".
    """
    if start < 0 or length < 1:
        raise ValueError(f"a chunk needs start >= 0 and length >= 1, got start={start} length={length}")
    width = start + length
    return tuple(tuple(j <= start + i for j in range(width)) for i in range(length))


def prefix_lm_chunk_mask(start: int, length: int, prefix_length: int, *, path: str = "$") -> tuple[tuple[bool, ...], ...]:
    """Prefix-LM visibility of a chunk: bidirectional inside the prefix, causal after it.

    With global query position ``q = start + i`` and key ``j``:
    ``V(q, j) = 1`` if ``q < prefix_length and j < prefix_length``; ``1`` if
    ``q >= prefix_length and j <= q``; else ``0``.  A chunk that holds a prefix row must hold
    the whole prefix (start at 0 and reach ``prefix_length``): otherwise earlier prefix rows
    would be computed without the later prefix keys.

    Shapes:
        result: ``[c, p + c]`` (bool).

    Raises:
        Rejection: ``runtime.prefix_split`` when the chunk splits the prefix.

    Source: M3.10 0x01 "Prefix execution has a phase change inside one sequence".
    """
    if start < 0 or length < 1 or prefix_length < 1:
        raise ValueError(f"bad chunk start={start} length={length} prefix_length={prefix_length}")
    if start < prefix_length and (start != 0 or start + length < prefix_length):
        raise Rejection(
            PREFIX_SPLIT,
            f"chunk [{start}, {start + length}) splits the bidirectional prefix [0, {prefix_length})",
            path,
        )
    width = start + length

    def visible(q: int, j: int) -> bool:
        if q < prefix_length:
            return j < prefix_length
        return j <= q

    return tuple(tuple(visible(start + i, j) for j in range(width)) for i in range(length))


def intersect_key_validity(mask: Sequence[Sequence[bool]], key_valid: Sequence[bool]) -> tuple[tuple[bool, ...], ...]:
    """Intersect a visibility mask ``[c, K]`` with per-key validity ``[K]`` (padding, unwritten slots).

    Padding and unwritten static slots intersect with the causal relation; they never replace
    it (M3.10 0x0A).  A finite score to an unwritten zero key still changes the softmax
    denominator, so invalid keys must be masked explicitly (M3.10 0x09).
    """
    if any(len(row) != len(key_valid) for row in mask):
        raise ValueError(f"mask width and key validity length {len(key_valid)} differ")
    return tuple(tuple(bool(v and k) for v, k in zip(row, key_valid)) for row in mask)


@attrs.frozen
class StaticCacheLedger:
    """Slot accounting of one static cache: ``0 <= committed <= reserved <= maximum``.

    Attributes:
        committed: Slots holding committed K/V rows of processed tokens (``K_frontier``).
        reserved: Slots allocated for this request (the static capacity ``S``).
        maximum: Largest capacity the model admits (its maximum context).

    Units: slots (one slot = one input position's K/V row in every cache-producing layer).

    Source: M3.10 0x09 ("Static storage demonstrates why capacity and commitment differ").
    """

    committed: int
    reserved: int
    maximum: int

    def __attrs_post_init__(self) -> None:
        if not (0 <= self.committed <= self.reserved <= self.maximum):
            raise Rejection(
                CACHE_LEDGER_INVALID,
                f"need 0 <= committed ({self.committed}) <= reserved ({self.reserved}) <= maximum ({self.maximum})",
            )

    def check_write(self, start: int, length: int, *, path: str = "$.cache_position") -> tuple[int, ...]:
        """The slots a write of ``length`` rows at ``start`` would touch, after checking it.

        Raises:
            Rejection: ``cache.slot_mismatch`` when ``start`` is not the committed frontier
                (a reset ``cache_position`` would overwrite committed rows).
            ResourceLimit: ``cache.capacity_exceeded`` when ``start + length > reserved``.
                Checked before anything is written: the ledger is unchanged.
        """
        if length < 1:
            raise Rejection(CACHE_SLOT_MISMATCH, f"a write needs at least one row, got {length}", path)
        if start != self.committed:
            raise Rejection(
                CACHE_SLOT_MISMATCH, f"write starts at slot {start} but the committed frontier is {self.committed}", path
            )
        if start + length > self.reserved:
            raise ResourceLimit(
                CACHE_CAPACITY_EXCEEDED,
                f"write [{start}, {start + length}) exceeds the {self.reserved} reserved slots",
                path,
                details={"start": start, "length": length, "reserved": self.reserved},
            )
        return tuple(range(start, start + length))

    def write(self, start: int, length: int) -> StaticCacheLedger:
        """The ledger after a checked write of ``length`` rows at ``start`` (see :meth:`check_write`)."""
        self.check_write(start, length)
        return attrs.evolve(self, committed=start + length)

    def readable_slots(self, start: int, length: int) -> tuple[bool, ...]:
        """Which of the ``reserved`` slots a call writing ``[start, start+length)`` may read: ``[reserved]`` bool.

        Only committed history plus the current chunk; stale or never-written slots stay
        invisible even though the backing tensor holds values there.
        """
        self.check_write(start, length)
        return tuple(slot < start + length for slot in range(self.reserved))
