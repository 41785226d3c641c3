"""M3.8 0x09: judge a sharded optimizer over a tied model against ``invariant.head_tied_sharded_owner``.

:func:`run_sharded_tie` starts ``R`` gloo ranks (CPU; forked from a one-thread process, else
spawned: :func:`decodespec.checks.gate.ranks.start_ranks`).  Each rank loads the tiny model
(seed 0, tied), builds the optimizer with :func:`decodespec.impl.sharded.sharded_optimizer`
(torch's ``ZeroRedundancyOptimizer``, Adam per shard) -- or a failure-lab sharder of
:data:`SHARD_MUTANTS` --, runs one next-token loss on the same ids (one repeated, so the lookup's
scatter accumulates), records what its local shard holds, the pieces of the gradient (the
upstream gradient at the embedding output, the logits' gradient, the projected hidden rows) and
the table before and after one step.  The parent judges: the table's observed gradient against
:func:`~decodespec.spec.head_tying.tied_gradient` (input scatter + classifier term, float64), the step
against :func:`~decodespec.spec.head_tying.adam_first_update`, the shards' ownership and the replicas,
with :func:`~decodespec.spec.head_tying.sharded_tie_violations`.

Bounds (never typed in): the gradient, float32 sums of ``N`` scatter rows and ``R``-long dot
products plus their one addition, ``gamma(N + R + 1, u32)`` times the sum of the terms'
magnitudes; the step, at most eight float32 roundings of each value it touches,
``8 u32 (|E| + lr)``.

Source: M3.8 0x09 ("Distributed and sharded optimizers must preserve that identity", "Tied
parameters receive two semantic gradient contributions"), 0x08 step 6; 0x12 items 31, 56.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from decodespec.spec.head_loss import UNIT_ROUNDOFF, gamma
from decodespec.spec.head_tying import ShardedTieObservation, adam_first_update, sharded_tie_violations, tied_gradient
from decodespec.spec.rules import Rule, register

from .ranks import read_rank_results, start_ranks

__all__ = ["INPUT_IDS", "LR", "SHARD_MUTANTS", "ShardedTieReport", "observe_sharded_tie", "run_sharded_tie"]

#: The training step's ids (id 40 twice: the lookup's scatter adds two rows into one).
INPUT_IDS = (1, 40, 41, 40, 42, 43)
#: Adam's learning rate of the step.
LR = 1e-2


def _duplicated_entries(model: Any) -> Any:
    """Failure lab: the sharder walks every module's Parameter, the tied table once as embedding and once as head."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    with warnings.catch_warnings():  # torch warns of a duplicated parameter in one group: the bug this sharder is
        warnings.simplefilter("ignore", UserWarning)
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=LR)


def _alias_split(model: Any) -> Any:
    """Failure lab: the loader materializes the head as a copy of the table, and the sharder places the two apart."""
    from decodespec.impl.sharded import sharded_optimizer

    from .head_check import untie_by_copy

    return sharded_optimizer(untie_by_copy(model), lr=LR)


#: name -> (optimizer factory, section, title, statement); each is the rule ``mutant.<name>``.
SHARD_MUTANTS: dict[str, tuple[Callable[[Any], Any], str, str, str]] = {
    "head_shard_duplicate_tie": (
        _duplicated_entries, "M3.8 0x09 Weight tying (Distributed and sharded optimizers must preserve that identity); 0x12 item 31",
        "A sharder registers the tied table twice (as embedding and as head)",
        ("The ZeroRedundancyOptimizer is built from named_parameters(remove_duplicate=False): the one tied Parameter is two "
        "entries, ZeRO's size-greedy partition puts one on each rank, each rank keeps an Adam state for it. The model is still "
        "tied and the step still lands once per rank, but two ranks own one table: check_sharded_tie reports split_owners and "
        "duplicate_state.")),
    "head_shard_alias_split": (
        _alias_split, "M3.8 0x09 Weight tying (Distributed and sharded optimizers must preserve that identity); 0x12 item 56",
        "A loader copies the tied table into a second head Parameter and the sharder places the two on different ranks",
        ("lm_head.weight becomes its own Parameter holding the embedding's values, then ZeRO shards the two: each rank owns one "
        "half, the embedding's gradient lacks the classifier term. check_sharded_tie reports alias_lost, split_owners, "
        "duplicate_state and gradient_not_once.")),
}
for _name, (_fn, _section, _title, _statement) in SHARD_MUTANTS.items():
    register(Rule(id=f"mutant.{_name}", kind="mutant", title=_title, section=_section, statement=_statement, obj=_fn))


def _worker(rank: int, world: int, init_file: str, out_dir: str, mutant: str | None, timeout_s: float, model_name: str) -> None:
    import torch
    import torch.distributed as dist

    from decodespec.impl.sharded import sharded_optimizer
    from decodespec.impl.tiny import load_tiny
    from decodespec.impl.weights import load_smollm2

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model = load_tiny(seed=0) if model_name == "tiny" else load_smollm2()  # a fresh copy in each rank
        for p in model.parameters():
            p.requires_grad_(True)
        optimizer = SHARD_MUTANTS[mutant][0](model) if mutant else sharded_optimizer(model, lr=LR)
        embed_mod, head_mod = model.model.embed_tokens, model.lm_head
        embed, head = embed_mod.weight, head_mod.weight
        seen: dict[str, Any] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(_module: Any, inputs: Any, output: Any) -> None:
                if name == "hidden":
                    seen[name] = inputs[0]
                    inputs[0].retain_grad()
                output.retain_grad()
                seen[name if name != "hidden" else "logits"] = output
            return hook

        h1 = embed_mod.register_forward_hook(keep("embedded"))
        h2 = head_mod.register_forward_hook(keep("hidden"))
        ids = torch.tensor([list(INPUT_IDS)])
        with torch.enable_grad():
            logits = model(ids).logits  # [1, T, V]
            torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        h1.remove()
        h2.remove()
        local = [p for g in optimizer.optim.param_groups for p in g["params"]]
        before = embed.detach().double().numpy().copy()
        grad = embed.grad.detach().double().numpy().copy()
        optimizer.step()
        states = sum(1 for p in {id(p): p for p in local if p is embed or p is head}.values() if optimizer.optim.state.get(p))
        out = {
            "ids": ids.reshape(-1).numpy(), "grad_in": seen["embedded"].grad.reshape(-1, embed.shape[1]).double().numpy(),
            "grad_logits": seen["logits"].grad.reshape(-1, head.shape[0]).double().numpy(),
            "hidden": seen["hidden"].detach().reshape(-1, head.shape[1]).double().numpy(),
            "before": before, "grad": grad, "after": embed.detach().double().numpy(), "head_after": head.detach().double().numpy(),
            "facts": np.array([head is embed, sum(1 for p in local if p is embed or p is head), states,
                               bool(model.config.tie_word_embeddings)], dtype=np.int64),
        }
        np.savez(Path(out_dir) / f"rank{rank}.npz", **out)
    finally:
        dist.destroy_process_group()


@attrs.frozen(eq=False)
class ShardedTieReport:
    """A sharded run judged: the observation and its violations (empty: the tie held)."""

    observation: ShardedTieObservation
    violations: tuple[str, ...]

    @property
    def passed(self) -> bool:
        """No violation."""
        return not self.violations


def observe_sharded_tie(results: list[dict[str, np.ndarray]]) -> ShardedTieObservation:
    """The :class:`~decodespec.spec.head_tying.ShardedTieObservation` of the ranks' results (see the module docstring)."""
    u = UNIT_ROUNDOFF["float32"]
    grad_error = update_error = 0.0
    for res in results:
        ids = res["ids"]
        inp, outp = tied_gradient(ids, res["grad_in"], res["grad_logits"], res["hidden"], res["grad"].shape[0])
        abs_in = np.zeros_like(inp)
        np.add.at(abs_in, ids, np.abs(res["grad_in"]))
        bound = gamma(len(ids) + res["hidden"].shape[0] + 1, u) * (abs_in + np.abs(res["grad_logits"]).T @ np.abs(res["hidden"]))
        grad_error = max(grad_error, _ratio(np.abs(res["grad"] - (inp + outp)), bound))
        want = adam_first_update(res["before"], res["grad"], LR)
        update_error = max(update_error, _ratio(np.abs(res["after"] - want), 8 * u * (np.abs(res["before"]) + LR)))
    agree = all(np.array_equal(r["after"], results[0]["after"]) and np.array_equal(r["head_after"], results[0]["head_after"])
                for r in results)
    facts = [r["facts"] for r in results]
    return ShardedTieObservation(declared_tied=bool(facts[0][3]), alias=tuple(bool(f[0]) for f in facts),
                                 entries=tuple(int(f[1]) for f in facts), states=tuple(int(f[2]) for f in facts),
                                 grad_error=grad_error, update_error=update_error, replicas_agree=agree)


def _ratio(err: np.ndarray, bound: np.ndarray) -> float:
    """``max err / bound`` (an exact zero error is 0 even where the bound is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(err == 0, 0.0, err / bound)
    return float(np.nanmax(r)) if r.size else 0.0


def run_sharded_tie(ranks: int = 2, *, mutant: str | None = None, model: str = "tiny", deadline_s: float = 120.0) -> ShardedTieReport:
    """Run one sharded step of ``model`` on ``ranks`` gloo ranks (with the failure-lab sharder ``mutant``) and judge it.

    Raises:
        RankRunTimeout: the ranks did not finish within ``deadline_s``.
        RuntimeError: a rank raised or wrote no results.
    """
    if mutant is not None and mutant not in SHARD_MUTANTS:
        raise KeyError(f"unknown sharder mutant {mutant!r}; known: {sorted(SHARD_MUTANTS)}")
    with tempfile.TemporaryDirectory(prefix="decodespec-zero-") as tmp:
        start_ranks(_worker, (ranks, os.path.join(tmp, "store"), tmp, mutant, max(5.0, deadline_s / 2), model), ranks,
                    deadline_s=deadline_s)
        results = read_rank_results(tmp, ranks)
    obs = observe_sharded_tie(results)
    return ShardedTieReport(obs, sharded_tie_violations(obs))
