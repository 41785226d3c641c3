"""A sharded optimizer over a model with a tied head: torch's ``ZeroRedundancyOptimizer`` over unique Parameters.

:func:`sharded_optimizer` builds ``torch.distributed.optim.ZeroRedundancyOptimizer`` (Adam per
shard) over :func:`unique_parameters` of the model: the Parameters by object identity, each
once, so a tied table (``lm_head.weight is embed_tokens.weight``) is one entry that ZeRO places
in exactly one rank's shard with one optimizer state; after each step ZeRO broadcasts it from
that owner.  Autograd already accumulates the lookup's scatter and the classifier's dense term
into that one Parameter's ``.grad``.  It needs an initialized process group (gloo on CPU).

The gate judges it (``checks/gate/sharded_tie.py``) against ``invariant.head_tied_sharded_owner``;
this module never imports the spec's rule.

Source: M3.8 0x09 ("Distributed and sharded optimizers must preserve that identity"), 0x08
step 6 ("Restore or create exactly one optimizer state for each shared Parameter"); torch
``torch/distributed/optim/zero_redundancy_optimizer.py`` (greedy size partition, owner broadcast).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sharded_optimizer", "unique_parameters"]


def unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model``'s trainable Parameters, each object once, in registration order.

    ``Module.parameters()`` already deduplicates a shared Parameter; this states it and keeps
    it when a caller walks ``named_parameters(remove_duplicate=False)``-style lists.
    """
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def sharded_optimizer(model: torch.nn.Module, lr: float = 1e-2, **adam: Any) -> Any:
    """A ``ZeroRedundancyOptimizer`` (Adam) sharding :func:`unique_parameters` of ``model`` over the default group.

    Raises:
        RuntimeError: without an initialized ``torch.distributed`` process group.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(unique_parameters(model), optimizer_class=torch.optim.Adam, lr=lr, **adam)
