"""M3.10 0x02 "Prompt logprobs versus generated-token logprobs": scoring the prefill rows of one call.

Implements :mod:`decodespec.spec.prompt_logprobs` (``invariant.prompt_logprobs_aligned``): the
row at input position ``p`` scores the prompt token ``x_{p+1}`` for ``p = 0 .. L-2``; the row at
``L - 1`` is the decision row and is not scored here.  Each row's raw logits come from the LM
head applied to the row's final-normed hidden state, in blocks of at most
:data:`BLOCK_ELEMENTS` logits, so a prefill of ``T`` rows never holds ``[T, V]`` logits at once;
the log-softmax is taken in float32 (the decision logprobs' dtype), ranks and top-k under the
total order "higher logprob first, lower id first among equal logprobs" (a stable descending
sort).

Source: M3.10 0x02; vLLM ``prompt_logprobs`` (ranks from 1); HF ``logits[:, :-1]`` scored at
``input_ids[:, 1:]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decodespec.spec.prompt_logprobs import FirstTokenPolicy, PromptLogprob, PromptLogprobsSpec

__all__ = ["BLOCK_ELEMENTS", "entries_from_logits", "entries_from_prompt_rows", "first_entries", "score_rows"]

#: Most logits materialised at once (rows per block = BLOCK_ELEMENTS // V, at least 1): 16 Mi floats, 64 MiB.
BLOCK_ELEMENTS = 1 << 24


def score_rows(lm_head: torch.nn.Module, hidden: torch.Tensor, start: int, prompt_ids: Sequence[int], top_k: int) -> list[PromptLogprob]:
    """The prompt-logprob entries of the rows of one prefill call that score a prompt token.

    Args:
        lm_head: The vocabulary head (``[d_model] -> [V]`` raw logits).
        hidden: ``[T, d_model]`` final-normed hidden states of the call's rows (positions
            ``start .. start + T - 1``).
        start: Position of the call's row 0.
        prompt_ids: The ``L`` decoder input ids.
        top_k: Alternatives per row (``0 .. 20``).

    Returns:
        One :class:`PromptLogprob` per row ``p`` of the call with ``p + 1 < L`` (token
        ``x_{p+1}``), in position order.

    Shapes: ``hidden [T, d_model]``; the head's output ``[R, V]`` per block of ``R`` rows.
    Units: nats.
    """
    L = len(prompt_ids)
    rows = max(0, min(hidden.shape[0], L - 1 - start))  # rows whose target x_{p+1} is a prompt token
    out: list[PromptLogprob] = []
    if rows == 0:
        return out
    block = max(1, BLOCK_ELEMENTS // int(lm_head.weight.shape[0]))  # rows per block
    for row in range(0, rows, block):
        logits = lm_head(hidden[row:min(rows, row + block)])  # [R, V] raw scores
        out.extend(entries_from_logits(logits, start + row + 1, prompt_ids, top_k))
    return out


def entries_from_logits(logits: torch.Tensor, first_position: int, prompt_ids: Sequence[int], top_k: int) -> list[PromptLogprob]:
    """Entries of ``R`` consecutive raw score rows: row ``j`` scores the prompt token at ``first_position + j``.

    Args:
        logits: ``[R, V]`` raw logits (any float dtype; the log-softmax runs in float32).
        first_position: The position of the token row 0 scores (``>= 1``; ``first_position + R <= L``).
        prompt_ids: The ``L`` decoder input ids.
        top_k: Alternatives per row.

    Returns:
        ``R`` :class:`PromptLogprob` values: logprob, rank (higher logprob first, lower id first on
        ties) and the first ``top_k`` ids of that order (a stable descending sort).

    Shapes: ``logits [R, V]``.  Units: nats.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [R, V]
    n = logprobs.shape[0]
    assert first_position >= 1 and first_position + n <= len(prompt_ids), "row 0 scores x_1 at the earliest; no row scores past x_{L-1}"
    targets = torch.tensor(list(prompt_ids[first_position:first_position + n]), dtype=torch.long, device=logprobs.device)  # [R]
    own = logprobs.gather(1, targets[:, None])  # [R, 1]
    ids = torch.arange(logprobs.shape[1], device=logprobs.device)  # [V]
    greater = (logprobs > own).sum(dim=1)  # [R]
    tied_lower = ((logprobs == own) & (ids[None, :] < targets[:, None])).sum(dim=1)  # [R]
    ranks = (1 + greater + tied_lower).tolist()
    top_ids: list[list[int]] = [[] for _ in range(n)]
    top_values: list[list[float]] = [[] for _ in range(n)]
    if top_k:
        values, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)  # [R, V]: ties keep the lower id first
        top_ids, top_values = order[:, :top_k].tolist(), values[:, :top_k].tolist()
    return [PromptLogprob(first_position + j, int(prompt_ids[first_position + j]), float(own[j, 0]), int(ranks[j]),
                          tuple(zip(top_ids[j], top_values[j]))) for j in range(n)]


def first_entries(prompt_ids: Sequence[int], spec: PromptLogprobsSpec) -> list[PromptLogprob]:
    """The entries before any row's: ``[x_0 without a score]`` under ``none``, ``[]`` under ``omitted`` (M3.10 0x02)."""
    return [PromptLogprob(0, int(prompt_ids[0]))] if spec.first_token is FirstTokenPolicy.NONE and prompt_ids else []


def entries_from_prompt_rows(logits: torch.Tensor, prompt_ids: Sequence[int], spec: PromptLogprobsSpec) -> list[PromptLogprob]:
    """Every entry of a prompt from its first ``L - 1`` raw rows (row ``i`` scores ``x_{i+1}``): :func:`first_entries`,
    then :func:`entries_from_logits` -- a peer's formatter of its own rows (HF's logits, llama.cpp's ``logits_all``).

    Shapes: ``logits [L - 1, V]`` (any float dtype).
    """
    rows = entries_from_logits(logits, 1, prompt_ids, spec.top_k) if len(prompt_ids) > 1 else []
    return first_entries(prompt_ids, spec) + rows
