"""M3.10 0x02 "Prompt logprobs versus generated-token logprobs": which prefill row scores which prompt token.

Prefill returns one logit row per prompt input row.  For prompt tokens ``x_0 .. x_{L-1}`` the row
at input position ``i`` scores ``x_{i+1}`` (``i = 0 .. L-2``); the row at ``L-1`` scores the first
generated token (it is the decision row, not a prompt logprob).  There is no ordinary score for
``x_0`` without an earlier context row, so a prompt-logprob API must declare what it returns for
it (:class:`FirstTokenPolicy`):

* ``none`` (the default; HF transformers' and vLLM's ``prompt_logprobs``): one entry per prompt
  token, ``L`` entries, the first with ``logprob = None`` (and no rank, no top-k);
* ``omitted``: the first token has no entry, ``L - 1`` entries.

The seed's third option, scoring ``x_0`` under an injected start token, is a different forward
(one more input row) and is not offered in v1.

An entry's ``logprob`` is the natural log-softmax of the **raw** logits row (before any M3.8
transform) at the prompt token, the same quantity a generated token's logprob is
(``z[y] - logsumexp(z)``); ``rank`` is the token's 1-based place in the row under the total
order "higher logprob first, lower id first among equal logprobs"; ``top`` lists the first
``top_k`` ids of that order with their logprobs (rank ``j + 1`` at index ``j``).  The values are
a property of the prompt prefix alone: the prefill's chunking, the cache family and the no-cache
path change only their float rounding (``invariant.prompt_logprobs_aligned``).

The request field is ``output.prompt_logprobs`` of the ``numinens.request.v1`` envelope, an
object ``{"first_token": "none" | "omitted", "top_k": 0 .. MAX_PROMPT_LOGPROBS_TOP_K}``; absent
means not requested (so envelopes written before the field existed keep their identity).

Source: M3.10 0x02 "Prompt logprobs versus generated-token logprobs"; vLLM
``SamplingParams.prompt_logprobs`` (first entry ``None``, ranks from 1); HF transformers
``model(input_ids).logits[:, :-1]`` scored at ``input_ids[:, 1:]``.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .rules import rule

__all__ = [
    "DEFAULT_FIRST_TOKEN",
    "DEFAULT_TOP_K",
    "MAX_PROMPT_LOGPROBS_TOP_K",
    "PROMPT_LOGPROBS_JSON_SCHEMA",
    "FirstTokenPolicy",
    "PromptLogprob",
    "PromptLogprobsSpec",
    "prompt_logprobs_aligned",
    "scored_positions",
]

_S = 'M3.10 0x02 "Prompt logprobs versus generated-token logprobs"'


class FirstTokenPolicy(str, enum.Enum):
    """What a prompt-logprob answer holds for ``x_0``, which no row scores (M3.10 0x02)."""

    NONE = "none"
    """An entry for ``x_0`` with ``logprob = None``: ``L`` entries."""
    OMITTED = "omitted"
    """No entry for ``x_0``: ``L - 1`` entries."""


#: The default first-token policy (HF's and vLLM's: the first entry is ``None``).
DEFAULT_FIRST_TOKEN = FirstTokenPolicy.NONE
#: The default number of alternatives per row (0: only the prompt token's own logprob and rank).
DEFAULT_TOP_K = 0
#: Most alternatives per row (vLLM's default ``max_logprobs``).
MAX_PROMPT_LOGPROBS_TOP_K = 20

#: The ``output.prompt_logprobs`` object of the request schema.
PROMPT_LOGPROBS_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [],
    "description": "Request prompt logprobs (M3.10 0x02): row i of the prefill scores prompt token i + 1; 'first_token' "
    "declares the answer for token 0, which no row scores ('none': an entry with a null logprob; 'omitted': no entry). "
    "Absent: not requested.",
    "properties": {
        "first_token": {"enum": [p.value for p in FirstTokenPolicy], "default": DEFAULT_FIRST_TOKEN.value},
        "top_k": {"type": "integer", "minimum": 0, "maximum": MAX_PROMPT_LOGPROBS_TOP_K, "default": DEFAULT_TOP_K},
    },
}


@attrs.frozen
class PromptLogprobsSpec:
    """The requested prompt logprobs (``output.prompt_logprobs``, defaults filled in).

    Attributes:
        first_token: The :class:`FirstTokenPolicy`.
        top_k: Alternatives per row, ``0 .. MAX_PROMPT_LOGPROBS_TOP_K``.
    """

    first_token: FirstTokenPolicy = attrs.field(default=DEFAULT_FIRST_TOKEN, converter=FirstTokenPolicy)
    top_k: int = attrs.field(default=DEFAULT_TOP_K)

    @top_k.validator
    def _top_k(self, _attribute: Any, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PROMPT_LOGPROBS_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_PROMPT_LOGPROBS_TOP_K}], got {value!r}")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PromptLogprobsSpec:
        """The value of a schema-valid ``output.prompt_logprobs`` object (absent fields take the defaults)."""
        return cls(first_token=obj.get("first_token", DEFAULT_FIRST_TOKEN.value), top_k=obj.get("top_k", DEFAULT_TOP_K))

    def to_json(self) -> dict[str, Any]:
        """``{"first_token", "top_k"}``."""
        return {"first_token": self.first_token.value, "top_k": self.top_k}

    def num_entries(self, prompt_len: int) -> int:
        """Entries of an answer for an ``L``-token prompt: ``L`` (``none``) or ``L - 1`` (``omitted``)."""
        return prompt_len if self.first_token is FirstTokenPolicy.NONE else max(prompt_len - 1, 0)


@attrs.frozen
class PromptLogprob:
    """One prompt token's entry.

    Attributes:
        position: ``i``, the token's index in the decoder input ``x_0 .. x_{L-1}``.
        token_id: ``x_i``.
        logprob: ``log_softmax(row_{i-1})[x_i]`` in nats (raw row), or ``None`` for ``x_0``.
        rank: 1-based place of ``x_i`` in row ``i - 1`` (higher logprob first, lower id first on
            ties), or ``None`` for ``x_0``.
        top: The first ``top_k`` ``(id, logprob)`` of that order (rank ``j + 1`` at index ``j``),
            or ``None`` for ``x_0``.

    Units: nats.
    """

    position: int
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: tuple[tuple[int, float], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"position", "token_id", "logprob", "rank", "top": [{"token_id", "logprob", "rank"}, ...]}``."""
        top = None if self.top is None else [{"token_id": t, "logprob": lp, "rank": j + 1} for j, (t, lp) in enumerate(self.top)]
        return {"position": self.position, "token_id": self.token_id, "logprob": self.logprob, "rank": self.rank, "top": top}


def scored_positions(prompt_len: int, spec: PromptLogprobsSpec) -> tuple[tuple[int, int | None], ...]:
    """``(token position, row position or None)`` of each entry, in order: token ``i`` is scored by row ``i - 1``.

    Returns ``((0, None), (1, 0), ..., (L-1, L-2))`` under ``none`` and the same without the first
    pair under ``omitted``.  Row ``L - 1`` scores the first generated token and appears nowhere.

    Source: M3.10 0x02 (the row table).
    """
    first = 0 if spec.first_token is FirstTokenPolicy.NONE else 1
    return tuple((i, i - 1 if i else None) for i in range(first, prompt_len))


@rule(
    "invariant.prompt_logprobs_aligned",
    title="Prompt logprobs: row i scores x_{i+1}, x_0 per the declared first-token policy",
    section=_S,
    statement="An answer for prompt x_0..x_{L-1} has L entries under first_token = none (the first, for x_0, with no "
    "logprob, rank or top-k: no row precedes it) and L-1 under omitted; entry for x_i (i >= 1) holds x_i, a finite "
    "logprob <= 0 that is the raw log-softmax of prefill row i-1 at x_i, its rank (1-based, higher logprob first, lower "
    "id first on ties) and the first top_k ids of that order with non-increasing logprobs, the rank-1 one at least the "
    "token's; the last prefill row (L-1) scores the first output, never a prompt token.  The values depend on the prompt "
    "prefix alone: one-shot and chunked prefill, every cache family and the no-cache path agree up to float rounding.",
)
def prompt_logprobs_aligned(prompt_ids: Sequence[int], spec: PromptLogprobsSpec, entries: Sequence[PromptLogprob]) -> bool:
    """Whether ``entries`` has the shape the rule requires for ``prompt_ids`` under ``spec`` (values are the checks' job).

    Args:
        prompt_ids: The ``L`` decoder input ids.
        spec: The request's :class:`PromptLogprobsSpec`.
        entries: The runtime's answer.
    """
    expected = scored_positions(len(prompt_ids), spec)
    if len(entries) != len(expected):
        return False
    for entry, (position, row) in zip(entries, expected):
        if entry.position != position or entry.token_id != prompt_ids[position]:
            return False
        if row is None:
            if entry.logprob is not None or entry.rank is not None or entry.top is not None:
                return False
            continue
        lp = entry.logprob
        if lp is None or not math.isfinite(lp) or lp > 0 or entry.rank is None or entry.rank < 1 or entry.top is None:
            return False
        top = entry.top
        if len(top) != spec.top_k or len({t for t, _ in top}) != len(top):
            return False
        if any(not math.isfinite(v) or v > 0 for _, v in top) or any(a[1] < b[1] for a, b in itertools.pairwise(top)):
            return False
        if top and top[0][1] < lp:
            return False
        ids = [t for t, _ in top]
        if (entry.rank <= len(top)) != (entry.token_id in ids) or entry.token_id in ids and ids.index(entry.token_id) != entry.rank - 1:
            return False
    return True
