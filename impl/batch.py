"""M3.10 0x07 Batched inference and padding: padded batches of independent requests.

A padded batch puts ``B`` independent requests of different prompt lengths into one rectangle
``[B, T]`` so that one model call serves them all.  The rectangle is only a transport: every
row must end with the same tokens, logits and finish state as its unbatched run.  The objects
that must agree (M3.10 0x07, 0x0A) are built here from one validated Boolean mask:

* ``attention_mask`` ``bool[B, T]``: Boolean semantics (``bool`` or 0/1 values; an additive
  ``0/-inf`` mask is refused), no empty row (``runtime.empty_input_row``), each row's valid columns one
  contiguous run (left, right or no padding; ``runtime.invalid_mask`` otherwise);
* ``position_ids`` from valid-token counts: ``cumsum(mask) - 1``, padding filled with 0
  (:data:`decodespec.spec.positions.PAD_POSITION_FILL`, HF 5.24), so a row's real tokens get
  ``0..L_b-1`` whatever its padding;
* the decision row of each request: the **greatest valid column**
  (``where(valid, column, -1).amax(-1)``), never ``out[:, -1]`` (a PAD row under right padding)
  nor ``lengths - 1`` (a PAD row under left padding);
* cache slots, declared **rectangular** (:data:`CACHE_LAYOUT`): slot = rectangular column.  The
  prompt call writes slots ``0..T-1`` (padding columns occupy slots that are never valid keys);
  the ``k``-th decode call writes slot ``T + k`` for every row.  Key validity over the slots is
  the row's column validity, so a right-padded row's history has a hole ``[A, B, PAD, PAD, X]``
  that attention never reads.  Each call records a
  :class:`~decodespec.spec.positions.TranslationReceipt` per row (column -> semantic row ->
  position id -> slot), built from the tensors passed to the model;
* the next call's mask is the **post-append** revision, derived as
  ``cat(previous validity, active[:, None])`` (a new tensor), never the pre-append mask reused.

Generation (:func:`batch_generate`): one prefill call for the rectangle, then one decode call
per step for every row still active.  Each row owns its policy state, its
:class:`~decodespec.impl.rng.RequestRng` (keyed by that row's identity and seed, draw address
``(O_b, 0)`` as in the single-request runtime) and its finish state; a decision is taken with
the runtime's policy twin (:func:`decodespec.impl.policy.decide`) on the row's own score row.
Declared: a finished row is *masked*, not compacted: it stays in the rectangle, is fed
``pad_token_id`` at a column marked invalid in the post-append mask, and is excluded from
selection (no decision, no RNG draw, no output).  Its final token stays CLOSED_UNPROCESSED
(``P_b = L_b + O_b - 1``), as in :class:`~decodespec.impl.runtime.RequestRunner`.  Every call
goes through the cache's call ledger (``begin_call`` / ``commit_call``) and the ordinary
``LlamaForCausalLM.forward``; the cache is a :class:`~decodespec.impl.cache.DynamicCache` or a
:class:`~decodespec.impl.cache.StaticCache` of ``T + max(G) - 1`` slots.

Source: M3.10 0x07 "Batched inference and padding-side bugs" (greatest valid column, Boolean
mask, empty rows, pre-append vs post-append mask), 0x06 "Stop criteria and active rows"
(finished rows kept out of selection; masked-out rows draw nothing), 0x0A "Position fields have
related but distinct meanings" (translation receipt, ``valid_token_cumsum``), 0x0B "Last-position
bugs"; HF ``generation/utils.py`` (``_prepare_position_ids_for_generation``, the
``unfinished_sequences`` mask).

Size: the padded batch value, its validation and the one batched decode loop with per-row policy, RNG
and finish; split further, the loop's per-row state would cross a module boundary.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import attrs
import torch

from decodespec.spec.enums import FINISH_PRECEDENCE, FinishReason, PendingTag, canonical_finish_reason
from decodespec.spec.errors import Rejection
from decodespec.spec.policy.config import Family, PolicyConfig
from decodespec.spec.policy.state import PolicyState, RequestView, initial_policy_state
from decodespec.spec.positions import (
    EMPTY_INPUT_ROW,
    INVALID_MASK,
    PAD_POSITION_FILL,
    TranslationEntry,
    TranslationReceipt,
)

from .cache import DynamicCache, StaticCache
from .generate import GenerationResult
from .model import LlamaForCausalLM
from .policy import decide as policy_decide
from .rng import RequestRng
from .runtime import INVALID_REQUEST

__all__ = [
    "CACHE_LAYOUT",
    "BatchCall",
    "BatchResult",
    "PaddedBatch",
    "batch_generate",
    "check_attention_mask",
    "closed_result",
    "commit_triggers",
    "decision_columns",
    "gather_decision_rows",
    "position_ids_from_mask",
    "translation_receipts",
]

#: Declared cache layout of padded batches: slot = rectangular column (padding slots never valid).
CACHE_LAYOUT = "rectangular"


# --------------------------------------------------------------------------------------------
# The mask and what is derived from it.
# --------------------------------------------------------------------------------------------


def check_attention_mask(attention_mask: torch.Tensor, *, path: str = "$.attention_mask") -> torch.Tensor:
    """Validate a padding mask and return it as ``bool[B, T]`` (a new tensor; the input is not changed).

    Args:
        attention_mask: ``[B, T]`` ``bool``, or 0/1 values of any real dtype (1 = a real token).

    Returns:
        ``bool[B, T]`` on the mask's device.

    Raises:
        Rejection: ``runtime.invalid_mask`` for a wrong rank, a value other than 0/1 (an
            additive ``0/-inf`` mask is not a validity mask), or valid columns that are not one
            contiguous run in some row; ``runtime.empty_input_row`` for a row with no
            valid column (no row could own its decision).  The path names the row.

    Source: M3.10 0x07 ("validate Boolean mask semantics and reject empty active rows").
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or 0 in attention_mask.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise Rejection(INVALID_MASK, f"attention_mask must be a non-empty [B, T] tensor, got {got}", path)
    if attention_mask.dtype.is_complex:
        raise Rejection(INVALID_MASK, f"attention_mask must hold 0/1 values, got {attention_mask.dtype}", path)
    if attention_mask.dtype != torch.bool:
        bad = (attention_mask != 0) & (attention_mask != 1)  # [B, T]
        if bool(bad.any()):
            row, column = (int(i) for i in bad.nonzero()[0])
            raise Rejection(INVALID_MASK, f"mask value {attention_mask[row, column].item()} is not 0 or 1 (an additive mask is not a "
                            "validity mask)", f"{path}[{row}][{column}]")
    valid = attention_mask.to(torch.bool)  # [B, T]
    counts = valid.sum(dim=-1)  # [B]
    empty = (counts == 0).nonzero()
    if empty.numel():
        row = int(empty[0])
        raise Rejection(EMPTY_INPUT_ROW, f"row {row} has no valid column, so no row owns its decision", f"{path}[{row}]")
    columns = torch.arange(valid.shape[-1], device=valid.device)  # [T]
    first = torch.where(valid, columns, valid.shape[-1]).amin(dim=-1)  # [B]
    last = torch.where(valid, columns, -1).amax(dim=-1)  # [B]
    holes = (last - first + 1 != counts).nonzero()
    if holes.numel():
        row = int(holes[0])
        raise Rejection(INVALID_MASK, f"row {row}: valid columns are not one contiguous run", f"{path}[{row}]")
    return valid


def position_ids_from_mask(valid: torch.Tensor) -> torch.Tensor:
    """``position_ids`` under the ``valid_token_cumsum`` rule: ``cumsum(valid) - 1``, padding 0.

    Args:
        valid: ``bool[B, T]`` validated mask (:func:`check_attention_mask`).

    Returns:
        ``int64[B, T]``; ``[0,0,1,1,1] -> [0,0,0,1,2]``.

    Source: M3.10 0x0A (``position_ids = attention_mask.long().cumsum(-1) - 1``, padding filled).
    """
    return (valid.long().cumsum(dim=-1) - 1).masked_fill_(~valid, PAD_POSITION_FILL)  # [B, T]


def decision_columns(valid: torch.Tensor) -> torch.Tensor:
    """The greatest valid column of each row: the input column whose output row owns the decision.

    Left padding ``[0,0,1,1,1]`` gives 4 (``sum - 1`` would give 2); right padding ``[1,1,0,0]``
    gives 1 (``out[:, -1]`` would read the PAD column 3).

    Args:
        valid: ``bool[B, T]`` validated mask (no empty row).

    Returns:
        ``int64[B]``.

    Source: M3.10 0x07 (``torch.where(valid, columns, -1).amax(dim=-1)``).
    """
    columns = torch.arange(valid.shape[-1], device=valid.device)  # [T]
    return torch.where(valid, columns, -1).amax(dim=-1)  # [B]


def gather_decision_rows(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Row ``b`` of ``values`` at column ``columns[b]``: ``[B, T, X] -> [B, X]``.

    Source: M3.10 0x07 (``hidden[torch.arange(B), last_idx, :]``).
    """
    return values[torch.arange(values.shape[0], device=values.device), columns.to(values.device)]  # [B, X]


def translation_receipts(
    valid: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor, row_start: Sequence[int] | None = None
) -> tuple[TranslationReceipt | None, ...]:
    """The translation receipt of each row of one call, read from the tensors given to the model.

    Column ``c`` of row ``b``: valid iff ``valid[b, c]``; semantic row ``row_start[b] + (number of
    valid columns before c)``; model position id ``position_ids[b, c]`` (``None`` at padding);
    logical slot ``cache_position[c]`` (rectangular layout: every column has a slot, padding
    slots stay invalid).  A row with no valid column in this call (a finished row in a decode
    call) has no receipt (``None``).

    Args:
        valid: ``bool[B, T]`` validity of this call's columns.
        position_ids: ``int64[B, T]`` the call's position ids.
        cache_position: ``int64[T]`` the call's slots.
        row_start: Per row, the semantic index of its first valid column in this call (the row's
            processed count); default 0 (a prompt call).

    Returns:
        One :class:`~decodespec.spec.positions.TranslationReceipt` (layout ``"rectangular"``)
        or ``None`` per row.

    Source: M3.10 0x0A "Each prepared call records an explicit translation receipt".
    """
    valid_rows, position_rows, slots = valid.tolist(), position_ids.tolist(), cache_position.tolist()
    starts = [0] * len(valid_rows) if row_start is None else list(row_start)
    out: list[TranslationReceipt | None] = []
    for flags, positions, start in zip(valid_rows, position_rows, starts):
        if not any(flags):
            out.append(None)
            continue
        entries, row_idx = [], start
        for column, (flag, position) in enumerate(zip(flags, positions)):
            entries.append(TranslationEntry(column=column, valid=flag, row_idx=row_idx if flag else None,
                                            position_id=position if flag else None, cache_slot=slots[column]))
            row_idx += flag
        last = max(column for column, flag in enumerate(flags) if flag)
        out.append(TranslationReceipt(entries=tuple(entries), cache_layout=CACHE_LAYOUT, decision_column=last, num_valid=sum(flags)))
    return tuple(out)


@attrs.frozen(eq=False)
class PaddedBatch:
    """A validated rectangle of ``B`` independent prompts and everything derived from its mask.

    Build with :meth:`from_prompts` (pad a list of prompts on one side) or :meth:`from_tensors`
    (a caller's rectangle, validated).

    Attributes:
        input_ids: ``int64[B, T]``; padding columns hold ``pad_token_id`` (any id: never read).
        attention_mask: ``bool[B, T]`` validity.
        position_ids: ``int64[B, T]`` (:func:`position_ids_from_mask`).
        decision_columns: ``int64[B]`` (:func:`decision_columns`).
        prompt_ids: Per row, the valid ids (the request's prompt, ``L_b`` of them).
        padding_side: ``"left"``, ``"right"`` or ``None`` (a caller's rectangle).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    decision_columns: torch.Tensor
    prompt_ids: tuple[tuple[int, ...], ...]
    padding_side: str | None = None

    @property
    def batch_size(self) -> int:
        """B."""
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """T, the rectangle's columns."""
        return self.input_ids.shape[1]

    @property
    def prompt_lens(self) -> tuple[int, ...]:
        """``L_b`` of each row."""
        return tuple(len(p) for p in self.prompt_ids)

    def receipts(self) -> tuple[TranslationReceipt, ...]:
        """The prompt call's translation receipt of each row (slots ``0..T-1``, rectangular)."""
        slots = torch.arange(self.width, device=self.input_ids.device)  # [T]
        return translation_receipts(self.attention_mask, self.position_ids, slots)  # type: ignore[return-value]

    @classmethod
    def from_tensors(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PaddedBatch:
        """Validate a caller's rectangle (see :func:`check_attention_mask`).

        Raises:
            Rejection: as :func:`check_attention_mask`; ``runtime.invalid_mask`` when
                ``input_ids`` is not an integer tensor of the mask's shape.
        """
        valid = check_attention_mask(attention_mask)
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != valid.shape or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise Rejection(INVALID_MASK, f"input_ids must be an integer tensor of the mask's shape {tuple(valid.shape)}, got {got}", "$.input_ids")
        valid = valid.to(input_ids.device)
        prompts = tuple(tuple(int(t) for t, ok in zip(ids, flags) if ok) for ids, flags in zip(input_ids.tolist(), valid.tolist()))
        return cls(input_ids.long(), valid, position_ids_from_mask(valid), decision_columns(valid), prompts, None)

    @classmethod
    def from_prompts(
        cls,
        prompts: Sequence[Sequence[int]],
        *,
        padding_side: str = "left",
        pad_token_id: int = 0,
        device: torch.device | str | None = None,
    ) -> PaddedBatch:
        """Pad ``prompts`` to the longest one on ``padding_side``.

        Raises:
            Rejection: ``runtime.empty_input_row`` for an empty prompt (or no prompt at all);
                ``runtime.invalid_request`` for an unknown side or a non-integer id.
        """
        if padding_side not in ("left", "right"):
            raise Rejection(INVALID_REQUEST, f"padding_side must be 'left' or 'right', got {padding_side!r}", "$.padding_side")
        if not prompts:
            raise Rejection(EMPTY_INPUT_ROW, "a batch needs at least one prompt", "$.prompts")
        rows: list[tuple[int, ...]] = []
        for b, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise Rejection(EMPTY_INPUT_ROW, f"prompt {b} is empty, so no row owns its decision", f"$.prompts[{b}]")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
                raise Rejection(INVALID_REQUEST, f"prompt {b} holds a non-integer id", f"$.prompts[{b}]")
            rows.append(tuple(prompt))
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [B, T]
        valid = torch.zeros((len(rows), width), dtype=torch.bool)  # [B, T]
        for b, prompt in enumerate(rows):
            span = slice(width - len(prompt), width) if padding_side == "left" else slice(0, len(prompt))
            ids[b, span] = torch.tensor(prompt, dtype=torch.long)
            valid[b, span] = True
        ids, valid = ids.to(device), valid.to(device)
        return cls(ids, valid, position_ids_from_mask(valid), decision_columns(valid), tuple(rows), padding_side)


# --------------------------------------------------------------------------------------------
# Generation.
# --------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class BatchCall:
    """One model call of a padded batch, as handed to the model (CPU copies, for checking).

    Attributes:
        call_id: 0 for the prompt call, then one per decode step.
        generation: Cache generation the call read (its ledger ``begin_call``).
        cache_position: The slots written, ``[T_call]``.
        position_ids: ``[B][T_call]`` RoPE coordinates.
        key_validity: ``[B][S_k]`` the ``attention_mask`` over every key slot (post-append).
        active: Per row, whether the row takes part in this call (has a valid column).
        decision_columns: Per row, the call column whose output row was decided on, or ``None``.
        receipts: Per row, the call's :class:`~decodespec.spec.positions.TranslationReceipt`
            (``None`` for a finished row).
    """

    call_id: int
    generation: int
    cache_position: tuple[int, ...]
    position_ids: tuple[tuple[int, ...], ...]
    key_validity: tuple[tuple[bool, ...], ...]
    active: tuple[bool, ...]
    decision_columns: tuple[int | None, ...]
    receipts: tuple[TranslationReceipt | None, ...]


@attrs.frozen(eq=False)
class BatchResult:
    """What :func:`batch_generate` returned.

    Attributes:
        rows: One :class:`~decodespec.impl.generate.GenerationResult` per request, in batch order.
        calls: Every model call, in order (:class:`BatchCall`).
        scores: With ``return_scores``: per row, the float32 CPU score row ``[V]`` of each of its
            decisions; else ``None``.
        cache_layout: :data:`CACHE_LAYOUT`.
    """

    rows: tuple[GenerationResult, ...]
    calls: tuple[BatchCall, ...]
    scores: tuple[tuple[torch.Tensor, ...], ...] | None
    cache_layout: str = CACHE_LAYOUT


def _per_row(value: Any, batch: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise Rejection(INVALID_REQUEST, f"{len(value)} {name} for {batch} rows", f"$.{name}")
        return list(value)
    return [value] * batch


@attrs.define
class _Row:
    """Mutable per-request state of one batch row (explicit integers, like the runtime's)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    policy: PolicyConfig
    identity: str
    seed: int | None
    rng: RequestRng
    state: PolicyState
    output_ids: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    receipts: list[Any] = attrs.Factory(list)
    scores: list[torch.Tensor] = attrs.Factory(list)
    triggers: set[FinishReason] = attrs.Factory(set)

    @property
    def active(self) -> bool:
        return not self.triggers


def batch_generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]] | PaddedBatch,
    *,
    max_new_tokens: int | Sequence[int],
    policy: PolicyConfig | Sequence[PolicyConfig] | None = None,
    eos_token_ids: Collection[int] | None = None,
    identities: Sequence[str] | None = None,
    seeds: int | None | Sequence[int | None] = None,
    padding_side: str = "left",
    pad_token_id: int | None = None,
    cache: str = "dynamic",
    vocab_hash: str = "",
    tokenizer: Any = None,
    return_scores: bool = False,
) -> BatchResult:
    """Generate for ``B`` independent requests in one padded batch (see the module docstring).

    Args:
        model: The decoder (device, dtype and attention implementation used as they are).
        prompts: ``B`` prompts (padded on ``padding_side``) or a :class:`PaddedBatch`.
        max_new_tokens: ``G`` for every row, or one ``G_b >= 1`` per row.
        policy: One M3.8 policy (greedy or multinomial family) for every row, or one per row;
            default plain greedy.
        eos_token_ids: Ids that finish a row with ``eos``; default ``{model.config.eos_token_id}``
            (empty when the config has none); ``()`` disables.
        identities: Per row request identity (keys the row's RNG); default ``"batch-row-<b>"``.
        seeds: One seed for every row, or one per row (``None``: unseeded identity key).
        padding_side: ``"left"`` or ``"right"`` (ignored for a :class:`PaddedBatch`).
        pad_token_id: Id fed at padding columns and to finished rows; default the config's
            ``pad_token_id`` (0 when it has none).
        cache: ``"dynamic"`` or ``"static"`` (``T + max(G) - 1`` slots, batch ``B``).
        vocab_hash: Ordered vocabulary hash recorded in the receipts.
        tokenizer: ``decode(ids) -> str`` for each row's ``text``; ``None``: ``""``.
        return_scores: Keep every decided score row (float32, CPU) in :attr:`BatchResult.scores`.

    Returns:
        :class:`BatchResult`; row ``b``'s score ids are ``"score-<generation>"`` of the call
        that produced them (the same ids as its unbatched run without prefill chunks).

    Raises:
        Rejection: ``runtime.invalid_request`` (a per-row list of the wrong length, ``G_b < 1``,
            an id outside ``[0, V)``, an unknown cache family, a beam policy);
            ``runtime.empty_input_row`` / ``runtime.invalid_mask`` (see :class:`PaddedBatch`);
            ``policy.*`` when a row's policy refuses its score row.
        ResourceLimit: ``model.context_window_exceeded`` when a row's ``L_b + G_b - 1`` position
            would leave the model window.
    """
    config = model.config
    pad = (config.pad_token_id if config.pad_token_id is not None else 0) if pad_token_id is None else pad_token_id
    batch = prompts if isinstance(prompts, PaddedBatch) else PaddedBatch.from_prompts(
        prompts, padding_side=padding_side, pad_token_id=pad, device=model.device)
    num_rows, width = batch.batch_size, batch.width
    device = model.device
    limits = _per_row(max_new_tokens, num_rows, "max_new_tokens")
    policies = _per_row(PolicyConfig.greedy() if policy is None else policy, num_rows, "policy")
    seed_list = _per_row(seeds, num_rows, "seeds")
    names = list(identities) if identities is not None else [f"batch-row-{b}" for b in range(num_rows)]
    if len(names) != num_rows:
        raise Rejection(INVALID_REQUEST, f"{len(names)} identities for {num_rows} rows", "$.identities")
    if eos_token_ids is None:
        eos_token_ids = () if config.eos_token_id is None else (config.eos_token_id,)
    eos = frozenset(int(t) for t in eos_token_ids)
    if cache not in ("dynamic", "static"):
        raise Rejection(INVALID_REQUEST, f"a padded batch runs a dynamic or static cache, not {cache!r}", "$.runtime.cache_family")
    for b, (g, p) in enumerate(zip(limits, policies)):
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise Rejection(INVALID_REQUEST, f"max_new_tokens must be an int >= 1 in a padded batch, got {g!r}", f"$.max_new_tokens[{b}]")
        if p.family is Family.BEAM:
            raise Rejection(INVALID_REQUEST, "a padded batch runs greedy or multinomial policies, not beams", f"$.policy[{b}]")
    for b, prompt in enumerate(batch.prompt_ids):
        outside = sum(1 for t in prompt if not 0 <= int(t) < config.vocab_size)
        if outside:  # token ids are user content: counted, never quoted
            raise Rejection(INVALID_REQUEST, f"prompt {b} holds {outside} id(s) outside [0, {config.vocab_size})", f"$.prompts[{b}]")
    rows = [_Row(prompt, g, p, name, seed, RequestRng(name, seed), initial_policy_state(p))
            for prompt, g, p, name, seed in zip(batch.prompt_ids, limits, policies, names, seed_list)]
    window = config.max_position_embeddings
    capacity = width + max(limits) - 1
    if cache == "static":
        kv: DynamicCache | StaticCache = StaticCache(model.cache_abi, capacity, batch_size=num_rows)
    else:
        kv = DynamicCache(model.cache_abi)

    calls: list[BatchCall] = []
    history = batch.attention_mask  # bool[B, S]: validity of every written slot (the pre-call revision)
    num_valid = batch.attention_mask.sum(dim=-1)  # int64[B]: processed valid tokens per row
    generation = 0
    input_ids, position_ids, call_valid = batch.input_ids, batch.position_ids, batch.attention_mask
    columns = batch.decision_columns  # int64[B]
    row_start = [0] * num_rows
    with torch.inference_mode():
        while True:
            start, length = (0, width) if not calls else (history.shape[1] - 1, 1)
            cache_position = torch.arange(start, start + length, device=device)  # [T_call]
            key_validity = history if cache == "dynamic" else torch.cat(
                [history, history.new_zeros(num_rows, capacity - history.shape[1])], dim=-1)  # [B, S_k]
            active = [row.active for row in rows]
            kv.begin_call(start, length, generation)
            keep = columns[:, None]  # [B, 1]: each row's decision column, selected before lm_head (M3.8 0x06)
            out = model(input_ids, attention_mask=key_validity, position_ids=position_ids, past_key_values=kv,
                        cache_position=cache_position, logits_to_keep=keep)
            assert kv.complete_layers() == config.num_hidden_layers, f"incomplete lane roster {kv.lane_writes()}"
            generation += 1
            kv.commit_call(generation)
            logits = out.logits[:, -1]  # [B, V]: one projected row per sequence (M3.8 0x06)
            calls.append(BatchCall(
                call_id=len(calls), generation=generation - 1, cache_position=tuple(cache_position.tolist()),
                position_ids=tuple(tuple(r) for r in position_ids.tolist()), key_validity=tuple(tuple(r) for r in key_validity.tolist()),
                active=tuple(active), decision_columns=tuple(int(c) if a else None for c, a in zip(columns.tolist(), active)),
                receipts=translation_receipts(call_valid, position_ids, cache_position, row_start)))
            next_ids = []
            for b, row in enumerate(rows):
                if not row.active:
                    next_ids.append(pad)
                    continue
                _decide(row, logits[b], f"score-{generation}", eos, window, vocab_hash, return_scores)
                next_ids.append(row.output_ids[-1] if row.active else pad)
            if not any(row.active for row in rows):
                break
            # The next call: one column per row; its validity is the post-append revision.
            fed = torch.tensor([row.active for row in rows], dtype=torch.bool, device=device)  # [B]
            row_start = num_valid.tolist()
            position_ids = torch.where(fed, num_valid, PAD_POSITION_FILL)[:, None]  # [B, 1]
            num_valid = num_valid + fed.long()
            input_ids = torch.tensor(next_ids, dtype=torch.long, device=device)[:, None]  # [B, 1]
            call_valid = fed[:, None]  # [B, 1]
            history = torch.cat([history, call_valid], dim=-1)  # [B, S + 1], a new tensor
            columns = torch.zeros(num_rows, dtype=torch.long, device=device)  # the one column of a decode call

    results = tuple(_row_result(row, tokenizer) for row in rows)
    scores = tuple(tuple(row.scores) for row in rows) if return_scores else None
    return BatchResult(rows=results, calls=tuple(calls), scores=scores)


def _decide(row: _Row, logits: torch.Tensor, score_id: str, eos: frozenset[int], window: int, vocab_hash: str, keep_score: bool) -> None:
    """Decide and commit one token for an active row (the runtime's decide + commit, per row)."""
    view = RequestView(prompt_ids=row.prompt_ids, output_ids=row.output_ids, eos_ids=sorted(eos), identity=row.identity, seed=row.seed)
    receipt, after = policy_decide(logits, row.policy, row.state, view, score_id=score_id, vocab_hash=vocab_hash, rng=row.rng)
    if keep_score:
        row.scores.append(logits.detach().float().cpu().clone())
    token = receipt.selected_id
    row.output_ids.append(token)
    row.logprobs.append(receipt.raw_logprob)
    row.receipts.append(receipt)
    row.state = after
    row.triggers |= commit_triggers(token, len(row.prompt_ids), len(row.output_ids), row.max_new_tokens, eos, window)


def commit_triggers(token_id: int, num_prompt: int, num_output: int, max_new_tokens: int, eos_ids: Collection[int], window: int) -> set[FinishReason]:
    """The token-level finish conditions a commit fires (the runtime's rule): ``eos``, ``length``, ``context_length``.

    Args:
        token_id: The committed id.
        num_prompt, num_output: ``L`` and ``O`` after the commit.
        max_new_tokens: ``G``.
        eos_ids: The EOS set.
        window: The context cap ``C`` (``L + O >= C`` fires ``context_length``).
    """
    fired = set()
    if token_id in eos_ids:
        fired.add(FinishReason.EOS)
    if num_output >= max_new_tokens:
        fired.add(FinishReason.LENGTH)
    if num_prompt + num_output >= window:
        fired.add(FinishReason.CONTEXT_LENGTH)
    return fired


def closed_result(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    triggers: Collection[FinishReason],
    *,
    tokenizer: Any = None,
    receipts: Sequence[Any] = (),
    rng_counter: int = 0,
) -> GenerationResult:
    """The :class:`~decodespec.impl.generate.GenerationResult` of a request closed by token-level triggers.

    The final committed token was never fed: ``|U| = 1`` CLOSED_UNPROCESSED, ``P = L + O - 1``
    (as :class:`~decodespec.impl.runtime.RequestRunner` without a repair call); a final EOS is
    kept in ``output_ids`` and left out of ``text``.
    """
    ids = list(output_ids)
    text_ids = ids[:-1] if ids and FinishReason.EOS in triggers else ids
    num_prompt, num_out = len(prompt_ids), len(ids)
    frontier = {"prompt_len": num_prompt, "output_count": num_out, "pending": 1, "processed": num_prompt + num_out - 1,
                "pending_tag": PendingTag.CLOSED_UNPROCESSED.value}
    return GenerationResult(
        prompt_ids=tuple(prompt_ids),
        output_ids=tuple(ids),
        text=tokenizer.decode(text_ids) if tokenizer is not None else "",
        logprobs=tuple(logprobs),
        finish_reason=canonical_finish_reason(triggers),
        triggers=tuple(t for t in FINISH_PRECEDENCE if t in triggers),
        frontier=frontier,
        receipts=tuple(receipts),
        rng_counter=rng_counter,
    )


def _row_result(row: _Row, tokenizer: Any) -> GenerationResult:
    return closed_result(row.prompt_ids, row.output_ids, row.logprobs, row.triggers, tokenizer=tokenizer, receipts=row.receipts,
                         rng_counter=row.state.rng_counter)
