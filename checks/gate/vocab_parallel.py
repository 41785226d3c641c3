"""Judge the vocabulary-parallel head (impl/vocab_parallel.py) against the float64 reference (spec/vocab_parallel.py).

:func:`run_ranks` starts ``R`` processes (``torch.multiprocessing``, fork or spawn), each joins a gloo
process group (the inputs are CPU tensors) with a bounded collective timeout, builds the same inputs from
the case seed (:func:`case_inputs`), computes every function of :mod:`decodespec.impl.vocab_parallel`
on its shard, and writes its local results; the whole run has a wall-clock deadline after which
every rank is killed (a hang fails, it never blocks).  When a failure-lab mutant is installed in
the calling process (:func:`decodespec.checks.lab.mutants.active`), every rank runs under it (a forked
rank inherits it; a spawned rank, a fresh interpreter, installs it again).  :func:`compare` checks the assembled results against the
reference run over the same ``R`` shards: exact equality for ids, masks and telemetry; for
floating results a forward-error bound derived from float64's unit roundoff, the summation
length and the magnitudes (never a hand-typed tolerance): ``|a - b| <= 4 n eps |terms|``.

Ranks are forked from the calling process where that is safe (no CUDA initialized yet), else
spawned.  ``run_check(ranks)`` is the gate check ``distributed.vocab_parallel.R<ranks>`` of the failure
lab (:mod:`decodespec.checks.lab.mutants.harness`).

Source: M3.8 0x0A "Vocabulary-parallel projection and loss", "Distributed inference
selection", "Collective and failure ledger"; brief (torch.distributed, not our own
communication layer).
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from decodespec.spec import vocab_parallel as ref
from decodespec.spec.policy.scores import softmax

from .ranks import RankRunTimeout, read_rank_results, start_ranks

__all__ = [
    "VocabCase",
    "case_inputs",
    "compare",
    "reference",
    "run_check",
    "run_ranks",
]

EPS = float(np.finfo(np.float64).eps)


@attrs.frozen
class VocabCase:
    """One vocabulary-parallel check.

    Attributes:
        vocab: V.  hidden: d.  rows: N.  seed: input seed.
        k: top-k.  p: top-p mass.
        tie_levels: selection rows hold integer logits in ``[0, tie_levels)`` (ties across shards).
    """

    vocab: int = 13
    hidden: int = 6
    rows: int = 5
    seed: int = 0
    k: int = 4
    p: float = 0.8
    tie_levels: int = 3


#: The small case of the gate and the unit tests; the SmolLM2-sized head (V = 49152, d = 576).
SMALL = VocabCase()
SMOLLM2_HEAD = VocabCase(vocab=49152, hidden=576, rows=2, seed=1, k=40, p=0.95, tie_levels=7)


def case_inputs(case: VocabCase) -> dict[str, np.ndarray]:
    """The case's float64 inputs, the same in every process: hidden, weight, targets, tie rows, probs, uniforms."""
    rng = np.random.default_rng(case.seed)
    hidden = rng.standard_normal((case.rows, case.hidden))
    weight = rng.standard_normal((case.vocab, case.hidden)) / np.sqrt(case.hidden)
    targets = rng.integers(0, case.vocab, case.rows)
    ties = rng.integers(0, case.tie_levels, (case.rows, case.vocab)).astype(np.float64)
    z = rng.standard_normal((case.rows, case.vocab)) * 2.0
    probs = np.stack([softmax(row) for row in z])
    u = rng.random(case.rows)
    return {"hidden": hidden, "weight": weight, "targets": targets, "ties": ties, "probs": probs, "u": u}


def _worker(rank: int, world: int, init_file: str, case_json: str, out_dir: str, timeout_s: float, mutant: str | None) -> None:
    import torch
    import torch.distributed as dist

    from decodespec.impl import vocab_parallel as vp

    case = VocabCase(**json.loads(case_json))
    dist.init_process_group(vp.backend("cpu"), init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        import contextlib

        stack = contextlib.ExitStack()
        if mutant:
            from decodespec.checks.lab.mutants import get

            stack.enter_context(get(mutant).applied())
        with stack:
            x = {k: torch.from_numpy(v) for k, v in case_inputs(case).items()}
            a, b = vp.shard_range(case.vocab, world, rank)
            w = x["weight"][a:b]
            z = vp.local_logits(x["hidden"], w)
            m, s, lse = vp.logsumexp(z)
            ce = vp.cross_entropy(z, a, x["targets"])
            g = vp.logit_grad(z, a, x["targets"])
            gw = vp.weight_grad(g, x["hidden"])
            gh = vp.hidden_grad(g, w)
            greedy = vp.greedy(x["ties"][:, a:b], a, case.vocab)
            top_values, top_ids = vp.top_k(x["ties"][:, a:b], a, case.vocab, case.k)
            keep = vp.top_p_keep(x["probs"][:, a:b], a, case.vocab, case.p)
            drawn = vp.multinomial(x["probs"][:, a:b], a, case.vocab, x["u"] if rank == 0 else torch.zeros_like(x["u"]))
            tele = vp.telemetry(z, a, x["targets"])
        out = {"m": m, "s": s, "lse": lse, "ce": ce, "g": g, "gw": gw, "gh": gh, "greedy": greedy, "top_values": top_values,
               "top_ids": top_ids, "keep": keep, "drawn": drawn}
        np.savez(Path(out_dir) / f"rank{rank}.npz", **{k: v.numpy() for k, v in out.items()})
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(tele))
    finally:
        dist.destroy_process_group()


def run_ranks(ranks: int, case: VocabCase = SMALL, *, mutant: str | None = None, deadline_s: float = 120.0) -> list[dict[str, Any]]:
    """Run the case on ``ranks`` processes; each rank's results (``numpy`` arrays and ``telemetry``).

    Raises:
        RankRunTimeout: the ranks did not all finish within ``deadline_s`` (every rank is killed).
        RuntimeError: a rank raised (its traceback is in the message) or exited without results.
    """
    with tempfile.TemporaryDirectory(prefix="decodespec-vp-") as tmp:
        start_ranks(_worker, (ranks, os.path.join(tmp, "store"), json.dumps(attrs.asdict(case)), tmp, max(5.0, deadline_s / 2)),
                    ranks, deadline_s=deadline_s, spawn_args=(mutant,))
        out = read_rank_results(tmp, ranks)
        for r, result in enumerate(out):
            result["telemetry"] = json.loads((Path(tmp) / f"rank{r}.json").read_text())
        return out


def reference(ranks: int, case: VocabCase) -> dict[str, Any]:
    """The float64 reference of every quantity over the same ``ranks`` contiguous shards."""
    x = case_inputs(case)
    rg = ref.shard_ranges(case.vocab, ranks)
    z = ref.shard_logits(x["hidden"], x["weight"], rg)
    m, s, lse = ref.logsumexp(z)
    g = ref.logit_grads(z, rg, x["targets"])
    top_values, top_ids = ref.top_k(ref.shard(x["ties"], rg), rg, case.k)
    return {
        "ranges": rg, "z": z, "m": m, "s": s, "lse": lse, "ce": ref.cross_entropy(z, rg, x["targets"]), "g": g,
        "gw": ref.weight_grads(g, x["hidden"]), "gh": ref.hidden_grad(g, x["weight"], rg),
        "greedy": ref.greedy(ref.shard(x["ties"], rg), rg), "top_values": top_values, "top_ids": top_ids,
        "keep": ref.top_p_keep(ref.shard(x["probs"], rg), rg, case.p),
        "drawn": ref.multinomial(ref.shard(x["probs"], rg), rg, x["u"]),
        "telemetry": json.loads(json.dumps(attrs.asdict(ref.telemetry(z, rg, x["targets"])))),
    }


def _within(name: str, got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> str | None:
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    if np.all(err <= bound):
        return None
    i = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    return f"{name}: |{got[i]!r} - {want[i]!r}| = {err[i]:.3g} exceeds the float64 bound {bound[i]:.3g} at {tuple(int(j) for j in i)}"


def _exact(name: str, got: np.ndarray, want: np.ndarray) -> str | None:
    if got.shape != want.shape or not np.array_equal(got, want):
        return f"{name}: {got.tolist() if got.size < 64 else got.shape} != {want.tolist() if want.size < 64 else want.shape}"
    return None


def compare(case: VocabCase, results: list[dict[str, Any]]) -> list[str]:
    """Every disagreement of the ranks' results with the reference (empty when all agree).

    Bounds (forward error of float64 sums and dot products, ``eps`` the machine epsilon): a
    local logit ``dz = 4 d eps |H| |E|.T`` (row maximum; another BLAS may round the length-d dot
    product differently), the global maximum ``dz``, the denominator ``(4 V eps + 4 dz) s``, the
    log-sum-exp ``4 V eps (1 + |lse|) + 2 dz``, the loss that plus ``4 V eps |z_y| + dz``; the
    logit gradient ``(4 V eps + 4 dz)(|G| + 1)``; the weight and hidden gradients the same
    relative error plus the dot-product lengths (``V + N``, ``V + d``) over the magnitudes
    ``(|G| + 1).T |H|`` and ``(|G| + 1) |E|``.  Ids, masks and telemetry are exact.
    """
    ranks = len(results)
    want = reference(ranks, case)
    x = case_inputs(case)
    v, n, d = case.vocab, case.rows, case.hidden
    problems: list[str | None] = []
    # the local logits are dot products of length d: another BLAS may round them differently
    z_err = (4 * d * EPS * (np.abs(x["hidden"]) @ np.abs(x["weight"]).T)).max(axis=-1)
    for r, res in enumerate(results):  # replicated results agree on every rank
        lse_bound = 4 * v * EPS * (1 + np.abs(want["lse"])) + 2 * z_err
        problems.append(_within(f"rank {r} m", res["m"], want["m"], z_err))
        problems.append(_within(f"rank {r} s", res["s"], want["s"], (4 * v * EPS + 4 * z_err) * want["s"]))
        problems.append(_within(f"rank {r} lse", res["lse"], want["lse"], lse_bound))
        z_y = np.take_along_axis(np.concatenate(want["z"], axis=-1), x["targets"][:, None], axis=-1)[:, 0]
        problems.append(_within(f"rank {r} cross_entropy", res["ce"], want["ce"], lse_bound + 4 * v * EPS * np.abs(z_y) + z_err))
        g_scale = 4 * v * EPS + 4 * z_err[:, None]  # relative error of P = exp(z - m) / s
        abs_g = np.abs(np.concatenate(want["g"], axis=-1)) + 1
        problems.append(_within(f"rank {r} hidden_grad", res["gh"], want["gh"],
                                (4 * (v + d) * EPS + g_scale) * (abs_g @ np.abs(x["weight"]))))
        problems.append(_exact(f"rank {r} greedy", res["greedy"], want["greedy"]))
        problems.append(_exact(f"rank {r} top_k ids", res["top_ids"], want["top_ids"]))
        problems.append(_exact(f"rank {r} top_k values", res["top_values"], want["top_values"]))
        problems.append(_exact(f"rank {r} multinomial", res["drawn"], want["drawn"]))
        if res["telemetry"] != want["telemetry"]:
            problems.append(f"rank {r} telemetry: {res['telemetry']} != {want['telemetry']}")
        g_r = want["g"][r]
        problems.append(_within(f"rank {r} logit_grad", res["g"], g_r, g_scale * (np.abs(g_r) + 1)))
        a, b = want["ranges"][r]
        gw_bound = ((4 * (v + n) * EPS + g_scale) * (np.abs(g_r) + 1)).T @ np.abs(x["hidden"])
        problems.append(_within(f"rank {r} weight_grad", res["gw"], want["gw"][r], gw_bound))
        problems.append(_exact(f"rank {r} top_p keep", res["keep"], want["keep"][r]))
        assert b - a == g_r.shape[-1]
    return [p for p in problems if p]


def run_check(ranks: int = 2, case: VocabCase = SMALL, *, deadline_s: float = 120.0) -> list[str]:
    """The gate check: run ``ranks`` processes (under the active mutant, if any) and compare; the problems found.

    A timeout or a crashed rank is a problem too (``"timeout: ..."`` / ``"crash: ..."``).
    """
    from decodespec.checks.lab.mutants import active

    mutant = active()
    try:
        results = run_ranks(ranks, case, mutant=mutant, deadline_s=deadline_s)
    except RankRunTimeout as exc:
        return [f"timeout: {exc}"]
    except RuntimeError as exc:
        return [f"crash: {exc}"]
    return compare(case, results)
