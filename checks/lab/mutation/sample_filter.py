"""Cosmic Ray filter: keep a seeded random sample of a session's mutants, mark the rest SKIPPED.

Mutant sampling (a uniform random subset of the generated mutants, scored as an estimate of the
full score with its confidence interval) is the standard way to bound the cost of mutation
testing (A. J. Offutt et al.; W. E. Wong and A. P. Mathur, "Reducing the cost of mutation testing:
an empirical study", JSS 1995).  It is used here for the ``impl/`` modules whose full sessions do
not fit the machine (docs/results/mutation.md says which, with the sample size and seed): a
sampled session's score is reported as an estimate with a Wilson 95% interval, never as the
module's full score.

The sample is chosen without reference to any test result: among the work items still pending
(after ``annotation_filter``), each is ranked by ``sha256(seed + module + operator + occurrence)``
and the ``size`` smallest are kept.  The key does not involve Cosmic Ray's random job ids, so
``cosmic-ray init`` run twice on the same file gives the same sample.  Items outside the sample
are marked SKIPPED with the output ``not sampled: ...``; ``report`` counts them apart from the
annotation-equivalent ones.

Usage (after ``cosmic-ray init`` and ``annotation_filter``)::

    python -m decodespec.checks.lab.mutation.sample_filter SESSION.sqlite --size 200 --seed 28

Raises ``SystemExit(2)`` on a non-positive ``--size``.

Source: docs/results/mutation.md; Cosmic Ray's filter API
(``cosmic_ray.tools.filters.filter_app.FilterApp``, as in its ``cr-filter-pragma``).
"""

from __future__ import annotations

import hashlib
import sys

from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_item import WorkerOutcome, WorkResult

NOT_SAMPLED = "not sampled"


def sample_key(seed: int, module: str, operator: str, occurrence: int) -> str:
    """The rank of one mutant in the sample (hex digest; the smallest ``size`` are kept)."""
    text = f"{seed}\x00{module}\x00{operator}\x00{occurrence}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def choose(items: list[tuple[str, str, str, int]], size: int, seed: int) -> set[str]:
    """The job ids of the sample: ``items`` are (job_id, module, operator, occurrence)."""
    if size <= 0:
        raise ValueError(f"sample size must be positive, got {size}")
    ranked = sorted(items, key=lambda it: sample_key(seed, it[1], it[2], it[3]))
    return {job_id for job_id, *_ in ranked[:size]}


class SampleFilter(FilterApp):
    """Mark every pending work item outside the seeded sample as SKIPPED (``not sampled``)."""

    def description(self) -> str:
        return __doc__ or ""

    def add_args(self, parser) -> None:
        parser.add_argument("--size", type=int, required=True, help="mutants to keep")
        parser.add_argument("--seed", type=int, required=True, help="the sample's seed")

    def filter(self, work_db, args) -> None:
        if args.size <= 0:
            raise SystemExit(f"--size must be positive, got {args.size}")
        pending = []
        for item in work_db.pending_work_items:
            (m,) = item.mutations
            pending.append((item.job_id, str(m.module_path), m.operator_name, m.occurrence))
        keep = choose(pending, args.size, args.seed)
        note = f"{NOT_SAMPLED}: outside the seeded random sample (size {args.size}, seed {args.seed}, of {len(pending)})"
        for job_id, *_ in pending:
            if job_id not in keep:
                work_db.set_result(job_id, WorkResult(
                    output=note, test_outcome=None, diff=None, worker_outcome=WorkerOutcome.SKIPPED))


def main(argv=None) -> int:
    return SampleFilter().main(argv)


if __name__ == "__main__":
    sys.exit(main())
