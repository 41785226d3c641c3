"""Failure lab, last-position group: the decision row is not the row that owns the decision.

Source: M3.10 0x0B "Last-position bugs", 0x07 "Batched inference and padding-side bugs"
(greatest valid column, count-minus-one under left padding); M3.8 0x12 items 21 and 23.
"""

from __future__ import annotations

from . import Patch, mutant

_G = "last-position"


@mutant(
    "right_padding_last_column", group=_G, text=True, representative=True,
    title="Right padding read at the last rectangular column (out[:, -1])",
    section="M3.10 0x0B Last-position bugs (right padding plus out[:, -1]); M3.8 0x12 item 21",
    statement="impl/batch.py decision_columns returns the last rectangular column T-1 for every row instead of the "
    "greatest valid column: under right padding a shorter row decides on the output of a PAD column. Shapes stay "
    "[B, d_model]; the shorter row's score row is not the reference row of its prefix (TENSOR) and its token path "
    "differs from its unbatched run.",
)
def _right_padding_last_column():
    return [Patch("decodespec.impl.batch:decision_columns", edits=[(
        "return torch.where(valid, columns, -1).amax(dim=-1)", "return columns[-1].expand(valid.shape[0])")])]


@mutant(
    "last_valid_count_minus_one", group=_G, text=True,
    title="Decision row from the valid count (lengths - 1): a shorter prefix under left padding",
    section="M3.10 0x07 Batched inference and padding-side bugs (count-minus-one is not a general last-valid gather)",
    statement="impl/batch.py decision_columns gathers at attention_mask.sum(-1) - 1, a column that is the last "
    "valid one only under right padding: under left padding [0,0,1,1,1] it selects column 2, the output row of an "
    "earlier (shorter) prefix of the row, so the row decides on the wrong prefix length. Caught by the left-padded "
    "batch case (TENSOR against the reference row of the full prompt).",
)
def _last_valid_count_minus_one():
    return [Patch("decodespec.impl.batch:decision_columns", edits=[(
        "return torch.where(valid, columns, -1).amax(dim=-1)", "return valid.long().sum(dim=-1) - 1")])]


@mutant(
    "first_prompt_row", group=_G,
    title="All prompt logits computed and the first row selected",
    section="M3.8 0x12 item 23 (computing all prompt logits and accidentally selecting the first row); M3.10 0x0B",
    statement="impl/runtime.py RequestRunner._forward keeps every row's logits (logits_to_keep=0) and reads row 0 "
    "instead of the call's last row: a prefill decision conditions on the first prompt token only (a decode call "
    "has one row and is unaffected). Every tensor is valid; the first score row is not the reference row (TENSOR).",
)
def _first_prompt_row():
    return [Patch("decodespec.impl.runtime:RequestRunner._forward", edits=[
        ("cache_position=cache_position, logits_to_keep=1,", "cache_position=cache_position, logits_to_keep=0,"),
        ("logits = out.logits[0, -1]", "logits = out.logits[0, 0]"),
    ])]


@mutant(
    "previous_call_row", group=_G,
    title="Decision row gathered with the previous call's mask (the previous prefix length)",
    section="M3.10 0x0B Last-position bugs (last-valid gather with the previous call's attention_mask)",
    statement="impl/runtime.py RequestRunner._forward exports, as the call's decision row, the last valid row of the "
    "previous call (the row the previous mask designates) and keeps this call's row for the next one: the score "
    "row has shape [V] but belongs to the previous prefix length, so every decision after the first call conditions "
    "on a stale prefix (TENSOR: the row differs from the reference row of the committed prefix).",
)
def _previous_call_row():
    return [Patch("decodespec.impl.runtime:RequestRunner._forward", edits=[(
        "logits = out.logits[0, -1]",
        "previous = getattr(self, '_previous_call_row', None); "
        "self._previous_call_row = out.logits[0, -1]; "
        "logits = self._previous_call_row if previous is None else previous",
    )])]
