"""Run a function on ``R`` gloo ranks in their own processes, within a wall-clock deadline, and read their results.

The distributed checks (:mod:`decodespec.checks.gate.vocab_parallel`, :mod:`decodespec.checks.gate.sharded_tie`)
start their ranks with :func:`start_ranks` (fork where that is safe, else spawn; every rank is
killed at the deadline, so a hang fails and never blocks) and read each rank's ``rank<r>.npz``
with :func:`read_rank_results`.

Source: M3.8 0x0A "Collective and failure ledger" (a collective that hangs is a failure);
brief (torch.distributed, not our own communication layer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RankRunTimeout", "read_rank_results", "start_ranks"]


class RankRunTimeout(TimeoutError):
    """The ranks did not finish within the deadline (every rank was killed)."""


def start_ranks(worker: Any, args: tuple[Any, ...], ranks: int, *, deadline_s: float, spawn_args: tuple[Any, ...] = ()) -> None:
    """Run ``worker(rank, *args, *extra)`` on ``ranks`` processes and wait for all of them, within ``deadline_s``.

    ``extra`` is ``spawn_args`` when the ranks are spawned (fresh interpreters: e.g. the mutant to
    install again) and ``(None,) * len(spawn_args)`` when they are forked (they inherit it).

    Raises:
        RankRunTimeout: the ranks did not all finish within ``deadline_s`` (every rank is killed).
        RuntimeError: a rank raised (its traceback is in the message) or exited abnormally.
    """
    import torch
    import torch.multiprocessing as mp

    # fork copies this interpreter (torch already imported, an installed mutant already in place): a
    # fraction of a second per rank where spawn re-imports torch (15-20 s per rank on the shared
    # 2-core machine).  After CUDA was initialized only spawn is safe, and so after this process ran
    # torch with more than one intra-op thread: GNU libgomp's thread pool does not survive a fork (the
    # forked rank's first parallel region hangs -- seen in the full test suite, 2 threads, until the
    # deadline).  Spawned ranks re-install the mutant.
    forkable = not torch.cuda.is_initialized() and "fork" in mp.get_all_start_methods() and torch.get_num_threads() == 1
    method = "fork" if forkable else "spawn"
    extra = spawn_args if method == "spawn" else (None,) * len(spawn_args)
    ctx = mp.start_processes(worker, args=(*args, *extra), nprocs=ranks, join=False, start_method=method)
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, end - time.monotonic()))):
            if time.monotonic() > end:
                raise RankRunTimeout(f"{ranks} ranks did not finish within {deadline_s:.0f} s")
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"a rank raised: {str(exc)[-2000:]}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a rank exited: {exc}") from None
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()


def read_rank_results(folder: str, ranks: int) -> list[dict[str, Any]]:
    """Each rank's ``rank<r>.npz`` in ``folder`` as a dict of arrays.

    Raises:
        RuntimeError: a rank wrote no results.
    """
    out = []
    for r in range(ranks):
        path = Path(folder) / f"rank{r}.npz"
        if not path.is_file():
            raise RuntimeError(f"rank {r} wrote no results")
        with np.load(path) as data:
            out.append({k: data[k] for k in data.files})
    return out
