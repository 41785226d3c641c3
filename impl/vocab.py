"""Vocabulary migration of a loaded model (and its optimizer) as one row-address transaction, in torch.

:func:`migrate_vocabulary` resizes / reorders the vocabulary rows of a
:class:`~decodespec.impl.model.LlamaForCausalLM` in place, following the construction order of
M3.8 0x08 "Tied alias and optimizer restoration order":

1. validate the immutable old -> new map (a partial bijection) before touching anything;
2. allocate the resized embedding (and, untied, head and bias) rows;
3. move every retained row by the map; initialize new rows as declared (``zeros``, ``mean`` of
   source rows, ``copy`` of one old row, or given ``values``) -- there is no default;
4. install the new Parameters and restore the tied alias once (``lm_head.weight is
   embed_tokens.weight``);
5. with an optimizer: replace the old Parameter objects in its parameter groups (no stale
   object, one entry per shared Parameter) and move every row-shaped state tensor (Adam's
   ``exp_avg``, ``exp_avg_sq`` ...) by the same map, new rows zero, one state per Parameter.

The gate judges it against the float64 spec (:mod:`decodespec.spec.vocab`: ``migrate_state``,
``migration_violations``, the mapped raw-logit oracle); this module never calls it.

Source: M3.8 0x08 ("Vocabulary migration is a row-address transaction", "Tied alias and
optimizer restoration order"), 0x09 (tied means one Parameter); HF ``resize_token_embeddings``
(the peer operation, append-only with mean initialization).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from decodespec.spec.errors import Rejection
from decodespec.spec.vocab import INVALID_MAP
from decodespec.spec.vocab_migration import NEW_ROW_INITS

__all__ = ["migrate_vocabulary"]


def _map(old_size: int, new_size: int, old_to_new: Mapping[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pairs = sorted((int(a), int(b)) for a, b in dict(old_to_new).items())
    old = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    new = torch.tensor([b for _, b in pairs], dtype=torch.long)
    if new_size < 1 or (old.numel() and (old.min() < 0 or old.max() >= old_size or new.min() < 0 or new.max() >= new_size)):
        raise Rejection(INVALID_MAP, f"map ids must lie in [0, {old_size}) -> [0, {new_size})", "$.old_to_new")
    if torch.unique(new).numel() != new.numel():
        raise Rejection(INVALID_MAP, "two old ids map to one new id: the map is not a bijection on the retained ids", "$.old_to_new")
    fresh = torch.ones(new_size, dtype=torch.bool)
    fresh[new] = False
    return old, new, torch.nonzero(fresh).flatten()


def _init_rows(old_rows: torch.Tensor, fresh: torch.Tensor, init: str | None, sources: Mapping[int, Any],
               values: torch.Tensor | None) -> torch.Tensor:
    """``[n_new, ...]`` declared rows for the new ids ``fresh`` (computed in float64, stored in the rows' dtype)."""
    out = torch.zeros((fresh.numel(), *old_rows.shape[1:]), dtype=torch.float64)
    src64 = old_rows.detach().to(torch.float64).cpu()
    for k, n in enumerate(fresh.tolist()):
        if init == "mean":
            ids = sources.get(n, range(old_rows.shape[0]))
            out[k] = src64[torch.as_tensor(list(ids) if not isinstance(ids, int) else [ids], dtype=torch.long)].mean(dim=0)
        elif init == "copy":
            out[k] = src64[int(sources[n])]
        elif init == "values":
            assert values is not None
            out[k] = values[k].to(torch.float64)
    return out.to(old_rows.dtype)


def _resized(rows: torch.Tensor, old: torch.Tensor, new: torch.Tensor, fresh: torch.Tensor, new_size: int,
             init: str | None, sources: Mapping[int, Any], values: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros((new_size, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    with torch.no_grad():
        out[new.to(rows.device)] = rows.detach()[old.to(rows.device)]
        if fresh.numel():
            out[fresh.to(rows.device)] = _init_rows(rows, fresh, init, sources, values).to(rows.device)
    return out


def migrate_vocabulary(model: Any, old_to_new: Mapping[int, int], new_size: int, *, init: str | None = None,
                       sources: Mapping[int, Any] | None = None, values: torch.Tensor | None = None,
                       optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Migrate ``model``'s vocabulary rows (and ``optimizer``'s state) in place; returns ``model``.

    Args:
        model: A :class:`~decodespec.impl.model.LlamaForCausalLM` (``model.embed_tokens``,
            ``lm_head``; tied or not).
        old_to_new: ``{old id: new id}`` for the retained ids (a partial bijection).
        new_size: ``V_new``.
        init: Declared initialization of new rows: ``zeros``, ``mean``, ``copy`` or ``values``
            (required when a new id is not an image of the map).
        sources: ``mean``: ``{new id: old ids}`` (default all old rows); ``copy``: ``{new id: old id}``.
        values: ``values``: ``[n_new, d]`` rows in ascending new-id order (the same rows serve
            embedding and head when untied).  A head bias's new entries follow ``init`` (the
            mean / copy of the source entries, zeros), zeros for ``values``.
        optimizer: Optional optimizer over the model's Parameters (Adam-like row-shaped state).

    Raises:
        Rejection: ``vocab.invalid_map`` (a bad map, new rows without a declared init, a bad
            source or ``values`` shape), raised before anything changes.  Any exception raised
            after validation (an allocation, an optimizer that refuses its new groups, the
            decode-weight arena) is re-raised after every replaced reference was put back: the
            model, its tie, its configuration and the optimizer are exactly as before.

    Source: M3.8 0x08 "Tied alias and optimizer restoration order" (steps 2-6), "Release and
    rollback ledger".
    """
    embed_mod = model.model.embed_tokens
    old_size = int(embed_mod.weight.shape[0])
    old, new, fresh = _map(old_size, int(new_size), old_to_new)
    sources = dict(sources or {})
    if fresh.numel():
        if init not in NEW_ROW_INITS:
            raise Rejection(INVALID_MAP, f"{fresh.numel()} new rows need a declared initialization, one of {NEW_ROW_INITS}", "$.init")
        for n in fresh.tolist():
            src = sources.get(n)
            if init == "copy" and (src is None or not 0 <= int(src) < old_size):
                raise Rejection(INVALID_MAP, f"new row {n} has no old row to copy", f"$.sources.{n}")
            if init == "mean" and src is not None:
                ids = [src] if isinstance(src, int) else list(src)
                if not ids or min(ids) < 0 or max(ids) >= old_size:
                    raise Rejection(INVALID_MAP, f"mean sources of new row {n} must be old ids", f"$.sources.{n}")
        if init == "values" and (values is None or tuple(values.shape) != (fresh.numel(), embed_mod.weight.shape[1])):
            raise Rejection(INVALID_MAP, f"values must be [{fresh.numel()}, {embed_mod.weight.shape[1]}]", "$.values")
    undo = _undo_log(model, optimizer)
    try:
        _apply(model, old, new, fresh, int(new_size), init, sources, values, optimizer, old_size)
    except BaseException:
        undo()  # the release bundle of before, exactly: a migration is one transaction (M3.8 0x08)
        raise
    return model


def _undo_log(model: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    """Record every reference a migration replaces; the returned callable puts them all back.

    The migration never writes into an old tensor (it allocates new ones), so restoring the old
    Parameter objects, sizes, configuration, parameter-group lists and state entries restores
    the values too.
    """
    embed_mod, head_mod = model.model.embed_tokens, model.lm_head
    saved = (embed_mod.weight, head_mod.weight, head_mod.bias, getattr(embed_mod, "num_embeddings", None),
             getattr(head_mod, "out_features", None), model.config, model.config.vocab_size)
    groups = None if optimizer is None else [list(g["params"]) for g in optimizer.param_groups]
    state = None if optimizer is None else dict(optimizer.state)

    def undo() -> None:
        embed_mod.weight, head_mod.weight = saved[0], saved[1]
        if saved[2] is not None or head_mod.bias is not None:
            head_mod.bias = saved[2]
        if saved[3] is not None:
            embed_mod.num_embeddings = saved[3]
        if saved[4] is not None:
            head_mod.out_features = saved[4]
        model.config = saved[5]
        if model.config.vocab_size != saved[6]:
            model.config.vocab_size = saved[6]  # a mutable configuration edited in place
        if optimizer is not None:
            for g, params in zip(optimizer.param_groups, groups):
                dict.__setitem__(g, "params", params)  # plain dict store: the group object itself is kept
            optimizer.state.clear()
            optimizer.state.update(state)
        if hasattr(model, "rebuild_fused_projections"):
            model.rebuild_fused_projections()  # the decode-weight arena holds the old head again

    return undo


def _apply(model: Any, old: torch.Tensor, new: torch.Tensor, fresh: torch.Tensor, new_size: int, init: str | None,
           sources: dict, values: torch.Tensor | None, optimizer: torch.optim.Optimizer | None, old_size: int) -> None:
    """Steps 2-6 of the construction order, in place (the caller validated the map and holds the undo log)."""
    embed_mod, head_mod = model.model.embed_tokens, model.lm_head
    tied = head_mod.weight is embed_mod.weight
    # Steps 2-3: allocate and move.
    swaps: dict[int, torch.nn.Parameter] = {}  # id(old Parameter) -> new Parameter
    old_params: dict[int, torch.nn.Parameter] = {}

    def replace(param: torch.nn.Parameter, rows_init: str | None) -> torch.nn.Parameter:
        if id(param) in swaps:
            return swaps[id(param)]
        data = _resized(param, old, new, fresh, int(new_size), rows_init, sources, values if rows_init == "values" else None)
        fresh_param = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        swaps[id(param)] = fresh_param
        old_params[id(param)] = param
        return fresh_param

    new_embed = replace(embed_mod.weight, init)
    new_head = new_embed if tied else replace(head_mod.weight, init)
    # A bias's new entries follow the declared rule of the weight (mean / copy of the source biases, zeros), zero for
    # given weight rows ("values" are [n_new, d]).
    new_bias = None if head_mod.bias is None else replace(head_mod.bias, "zeros" if init == "values" else init)
    # Step 4: install, restore the alias once.
    embed_mod.weight = new_embed
    head_mod.weight = new_head if not tied else embed_mod.weight
    if new_bias is not None:
        head_mod.bias = new_bias
    if hasattr(embed_mod, "num_embeddings"):
        embed_mod.num_embeddings = int(new_size)
    if hasattr(head_mod, "out_features"):
        head_mod.out_features = int(new_size)
    if attrs.has(type(model.config)):
        model.config = attrs.evolve(model.config, vocab_size=int(new_size))
    else:
        model.config.vocab_size = int(new_size)
    # Step 5: the optimizer holds the new objects, once, with moments moved by the same map.
    if optimizer is not None:
        for group in optimizer.param_groups:
            seen: set[int] = set()
            params = []
            for p in group["params"]:
                q = swaps.get(id(p), p)
                if id(q) not in seen:
                    seen.add(id(q))
                    params.append(q)
            group["params"] = params
        for key, param in list(old_params.items()):
            state = optimizer.state.pop(param, None)
            if state is None:
                continue
            moved = {}
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == old_size:
                    moved[name] = _resized(value, old, new, fresh, int(new_size), "zeros", {}, None)
                else:
                    moved[name] = value
            optimizer.state[swaps[key]] = moved
    if hasattr(model, "rebuild_fused_projections"):
        model.rebuild_fused_projections()  # the head moved: place it in the decode-weight arena again
