"""Cosmic Ray filter: mark mutants inside type annotations as SKIPPED (equivalent by construction).

Every ``impl/`` module that the mutation run covers starts with ``from __future__ import
annotations`` (PEP 563), so an annotation is stored as a string and never evaluated, and nothing
in ``impl/``, ``spec/`` or ``checks/`` resolves one (no ``typing.get_type_hints``,
``attrs.resolve_types`` or ``__annotations__`` read).  A mutant that only rewrites an annotation
(Cosmic Ray's ``ReplaceBinaryOperator_BitOr_*`` on ``int | None`` is the common one) therefore
cannot change behaviour; running the gate on each would cost ~15 s apiece and prove nothing.
The filter refuses a module without the future import, so it never skips a live annotation.

Usage (after ``cosmic-ray init``)::

    python -m decodespec.checks.lab.mutation.annotation_filter SESSION.sqlite

Source: docs/results/mutation.md (the equivalence argument); Cosmic Ray's filter API
(``cosmic_ray.tools.filters.filter_app.FilterApp``, as in its ``cr-filter-pragma``).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import parso
from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def _annotation_nodes(node):
    """Yield every annotation node under ``node`` (parameter, return and variable annotations)."""
    if node.type == "funcdef" and node.annotation is not None:
        yield node.annotation
    if node.type == "param" and node.annotation is not None:
        yield node.annotation
    if node.type == "annassign":
        yield node.children[1]
    for child in getattr(node, "children", ()):
        yield from _annotation_nodes(child)


@cache
def annotation_spans(path: str) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    """The (start, end) positions (1-based row, 0-based column, as parso) of ``path``'s annotations.

    Raises ``ValueError`` when the module lacks ``from __future__ import annotations``.
    """
    text = Path(path).read_text(encoding="utf-8")
    if "from __future__ import annotations" not in text:
        raise ValueError(f"{path}: annotations are evaluated (no PEP 563 import); refusing to skip them")
    tree = parso.parse(text)
    return tuple((n.start_pos, n.end_pos) for n in _annotation_nodes(tree))


def in_annotation(path: str, start: tuple[int, int], end: tuple[int, int]) -> bool:
    """True when the span ``start``..``end`` lies inside one annotation of ``path``."""
    return any(a <= tuple(start) and tuple(end) <= b for a, b in annotation_spans(path))


class AnnotationFilter(FilterApp):
    """Mark every work item whose mutations all lie in annotations as SKIPPED."""

    def description(self) -> str:
        return __doc__

    def filter(self, work_db, _args) -> None:
        for item in work_db.pending_work_items:
            if all(in_annotation(str(m.module_path), m.start_pos, m.end_pos) for m in item.mutations):
                work_db.set_result(item.job_id, WorkResult(
                    output="equivalent: mutates a PEP 563 annotation (never evaluated)",
                    test_outcome=None, diff=None, worker_outcome=WorkerOutcome.SKIPPED))


def main(argv=None) -> int:
    return AnnotationFilter().main(argv)


if __name__ == "__main__":
    sys.exit(main())
