"""Rule registry: every transition, invariant, policy transform, ladder layer and mutant has an id.

A reader finds any rule by its id in the code, the docs and the tests (STYLE.md, house rules).
Ids are dotted: ``transition.commit``, ``invariant.frontiers_balance``,
``transform.top_p``, ``ladder.STATE``, ``mutant.top_p_no_gather``.  Error codes live in
:mod:`decodespec.spec.errors` and share the namespace rules (``error.<code>`` in docs).

Each module registers its own rules at import time with :func:`rule`, either as a decorator
over the function that implements the rule, or by calling :func:`register` with a value.
The docs generator (``decodespec docs``) renders :data:`RULES` and a test fails when a rule
is undocumented, documented twice, or when a page names a rule id that does not exist.

Source: STYLE.md ("A reader should find any rule by its id"); research/aesthetics-survey.md
8.4 (SpecTec-style splicing by rule id).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

__all__ = ["RULES", "RULE_KINDS", "Rule", "register", "rule", "rules_of_kind"]

#: The rule kinds, in the order the docs render them.
RULE_KINDS = ("transition", "invariant", "transform", "selector", "ladder", "mutant", "profile")


@attrs.frozen
class Rule:
    """One named rule of the contract.

    Attributes:
        id: Dotted identifier, unique across the project, e.g. ``"invariant.frontiers_balance"``.
        kind: One of :data:`RULE_KINDS`.
        title: Short human title.
        section: Seed section, e.g. ``"M3.10 0x08 Output, input, and cache frontiers"``.
        statement: The rule in one or a few sentences (guard and effect for a transition,
            the predicate for an invariant).
        obj: The Python object that implements the rule (a function or class), or ``None``.
    """

    id: str
    kind: str = attrs.field(validator=attrs.validators.in_(RULE_KINDS))
    title: str
    section: str
    statement: str
    obj: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.id.startswith(self.kind + "."):
            raise ValueError(f"rule id {self.id!r} must start with its kind {self.kind!r}")


#: Every registered rule, by id.
RULES: dict[str, Rule] = {}

F = TypeVar("F", bound=Callable[..., Any])


def register(rule_: Rule) -> Rule:
    """Add ``rule_`` to :data:`RULES`.

    Raises:
        AssertionError: if another rule with the same id but a different definition exists.
    """
    existing = RULES.get(rule_.id)
    assert existing is None or existing == rule_, f"rule {rule_.id!r} registered twice"
    RULES[rule_.id] = rule_
    return rule_


def rule(id: str, *, title: str, section: str, statement: str) -> Callable[[F], F]:
    """Decorator: register the decorated object as the implementation of rule ``id``.

    The kind is the first component of ``id``.  The object gets a ``__rule_id__`` attribute.
    """

    kind = id.split(".", 1)[0]

    def deco(obj: F) -> F:
        register(Rule(id=id, kind=kind, title=title, section=section, statement=statement, obj=obj))
        try:
            obj.__rule_id__ = id  # type: ignore[attr-defined]  # tags the function or class it registers
        except (AttributeError, TypeError):  # pragma: no cover - builtins
            pass
        return obj

    return deco


def rules_of_kind(kind: str) -> list[Rule]:
    """All rules of ``kind``, sorted by id."""
    return sorted((r for r in RULES.values() if r.kind == kind), key=lambda r: r.id)
