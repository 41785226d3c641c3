"""The mutation sample filter (checks/lab/mutation/sample_filter.py) keeps a seeded, order-free sample.

Needs the ``mutation`` extra (Cosmic Ray); skipped without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cosmic_ray", reason="the mutation extra (cosmic-ray) is not installed")

from decodespec.checks.lab.mutation.sample_filter import choose


def _items(n):
    return [(f"job{i}", "impl/cache.py", f"Op{i % 3}", i) for i in range(n)]


def test_sample_is_seeded_sized_and_independent_of_job_order():
    items = _items(60)
    kept = choose(items, 12, seed=28)
    assert len(kept) == 12
    assert kept == choose(list(reversed(items)), 12, seed=28)
    # the job ids do not enter the key: renaming every job keeps the same mutants
    renamed = [(f"other{i}", m, op, occ) for i, (_, m, op, occ) in enumerate(items)]
    assert {f"other{j[3:]}" for j in kept} == choose(renamed, 12, seed=28)
    assert kept != choose(items, 12, seed=29)


def test_sample_larger_than_population_keeps_all_and_bad_size_is_refused():
    items = _items(5)
    assert choose(items, 10, seed=1) == {j for j, *_ in items}
    with pytest.raises(ValueError):
        choose(items, 0, seed=1)
