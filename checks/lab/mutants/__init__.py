"""The failure lab: named, shape-correct bugs of our runtime that the conformance gate must kill.

Both seeds end with a failure lab of bugs that keep every tensor shape and change the answer
(M3.10 0x0B "Shape-correct failure lab", M3.8 0x12 "Failure lab").  Each bug is a
:class:`Mutant`: a named, documented variant of the runtime (:mod:`decodespec.impl`), registered
as the rule ``mutant.<name>`` (its seed section and a statement of the bug and what it breaks),
made of :class:`~decodespec.checks.lab.mutants.seams.Patch` values that replace seams of the runtime
only inside :meth:`Mutant.applied` (a context manager that restores every seam on exit; see
:mod:`decodespec.checks.lab.mutants.seams`).  Nothing in ``impl/`` imports this package.

The catalogue, by group (:data:`GROUPS`), lives in the modules ``lastpos``, ``selection``,
``stop``, ``beams``, ``cache``, ``commit``, ``rng``, ``logprob``, ``encdec``, ``snapshot``,
``model``, ``tp`` (the tensor-parallel ranks, killed by the gate of
``--runtime impl-tp``), ``vocab_parallel`` (the vocabulary-parallel head), ``vocab`` (the runtime's vocabulary
identity, killed at STATE) and ``head`` (the output-head contracts of M3.8 0x05, 0x08, 0x09: loss
implementations, loaders and vocabulary migrations, each killed by its own checker,
:attr:`Mutant.checker`).
:mod:`decodespec.checks.lab.mutants.harness` runs the gate (the case table, then the lock-step
machines) against a mutant until its first failure; ``decodespec mutants`` is the command line.

Source: M3.10 0x0B; M3.8 0x12; docs/design.md section 4 (``mutant.*`` rules).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import attrs

from decodespec.spec.rules import Rule, register

from .seams import Patch, fingerprint, install, oracle_side

__all__ = [
    "GROUPS",
    "MUTANTS",
    "Mutant",
    "Patch",
    "active",
    "all_seams",
    "get",
    "mutant",
    "oracle_side",
    "seam_fingerprint",
]

#: Failure-lab groups, in report order.
GROUPS = (
    "last-position",
    "score and selection",
    "stop and active rows",
    "beams",
    "cache and positions",
    "hidden state",
    "commit",
    "rng",
    "logprob",
    "encoder-decoder",
    "snapshot",
    "model math",
    "tensor parallel",
    "vocabulary parallel",
    "vocabulary",
    "output head",
)

#: Every registered mutant, by name (registration order).
MUTANTS: dict[str, "Mutant"] = {}

#: Names of the mutants installed now (:meth:`Mutant.applied`), outermost first.
_ACTIVE: list[str] = []


@attrs.frozen
class Mutant:
    """One failure-lab bug.

    Attributes:
        name: Short name; the rule id is ``mutant.<name>``.
        group: One of :data:`GROUPS`.
        title: Short human title.
        section: Seed section(s), e.g. ``"M3.10 0x0B Last-position bugs; M3.8 0x12 item 21"``.
        statement: The bug, where it is patched, and what it breaks.
        patches: The seams it replaces.
        text: Needs real text (stop strings, UTF-8, padding): also killed on SmolLM2 in the full run.
        representative: Runs in the CI-sized subset (one per group).
        first: Gate check ids (globs) the harness runs before the rest, because they exercise the
            patched code directly (e.g. ``distributed.*`` for the vocabulary-parallel head); the
            gate is still the whole gate, only its order changes.
        checker: For a bug of an interface the gate's case table does not drive (a loss
            implementation, a loader, a vocabulary migration: the ``output head`` group), the
            check that must kill it instead of the gate: ``checker(mutated)`` runs the check on the
            broken implementation (``mutated=True``) or on the correct one (``False``, the
            calibration) and returns ``None`` when it passes, else ``{"check", "layer", "rule",
            "ladder_check", "message"}``.  Such a mutant patches no seam.
        runtime: The runtime whose gate must kill it (``impl``; ``impl-tp``: a bug of the tensor-parallel ranks).
    """

    name: str
    group: str = attrs.field(validator=attrs.validators.in_(GROUPS))
    title: str
    section: str
    statement: str
    patches: tuple[Patch, ...] = attrs.field(converter=tuple)
    text: bool = False
    representative: bool = False
    first: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    checker: Callable[[bool], dict | None] | None = attrs.field(default=None, eq=False)
    runtime: str = "impl"

    @property
    def rule_id(self) -> str:
        """``mutant.<name>``."""
        return f"mutant.{self.name}"

    @property
    def seams(self) -> tuple[str, ...]:
        """The patched seams (``module:qualname`` paths)."""
        return tuple(dict.fromkeys(p.target for p in self.patches))

    @contextlib.contextmanager
    def applied(self) -> Iterator["Mutant"]:
        """Install the bug; every seam is restored (the same objects) on exit.

        Raises:
            decodespec.checks.lab.mutants.seams.SeamMoved: the runtime changed under the mutant.
        """
        with install(self.patches, self.name):
            _ACTIVE.append(self.name)
            try:
                yield self
            finally:
                _ACTIVE.remove(self.name)


def mutant(name: str, *, group: str, title: str, section: str, statement: str, text: bool = False,
           representative: bool = False, first: Sequence[str] = (), runtime: str = "impl") -> Callable[[Callable[[], Sequence[Patch]]], Mutant]:
    """Decorator over a function returning the mutant's patches: registers :class:`Mutant` and the rule ``mutant.<name>``."""

    def deco(fn: Callable[[], Sequence[Patch]]) -> Mutant:
        if name in MUTANTS:
            raise AssertionError(f"mutant {name!r} registered twice")
        m = Mutant(name, group, title, section, statement, tuple(fn()), text, representative, tuple(first), runtime=runtime)
        register(Rule(id=m.rule_id, kind="mutant", title=title, section=section, statement=statement, obj=fn))
        MUTANTS[name] = m
        return m

    return deco


def get(name: str) -> Mutant:
    """The mutant called ``name`` (with or without the ``mutant.`` prefix).

    Raises:
        KeyError: no such mutant (the message lists the known names).
    """
    key = name.removeprefix("mutant.")
    if key not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    return MUTANTS[key]


def active() -> str | None:
    """The rule id (``mutant.<name>``) of the innermost mutant installed now, else ``None``.

    Conformance traces record it (``#meta.mutant``, :func:`decodespec.checks.modelcheck.traces.make_trace`)
    so that ``decodespec replay`` re-installs the bug the trace was recorded under.
    """
    return f"mutant.{_ACTIVE[-1]}" if _ACTIVE else None


def all_seams() -> tuple[str, ...]:
    """Every seam any mutant patches (sorted, unique)."""
    return tuple(sorted({s for m in MUTANTS.values() for s in m.seams}))


def seam_fingerprint() -> dict[str, object]:
    """:func:`~decodespec.checks.lab.mutants.seams.fingerprint` of :func:`all_seams`."""
    return fingerprint(all_seams())


from . import lastpos, selection, stop, beams, cache, commit, rng, logprob, encdec, snapshot, model, tp, vocab_parallel, vocab, head  # noqa: E402,F401,I001  (registration, report order)
