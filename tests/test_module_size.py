"""No module over ~600 lines without a reason written at its top (issue 17).

A module longer than :data:`LIMIT` lines must say in its module docstring, in a paragraph that
starts ``Size:``, why its parts belong in one file.  A long module without one fails here; split it
by concern (as spec/vocab.py and spec/head.py were) or write the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 600
FOLDERS = ("spec", "impl", "checks")


def unexplained(source: str) -> bool:
    """Whether a module of ``source`` is over the limit without a ``Size:`` paragraph in its docstring."""
    if source.count("\n") + 1 <= LIMIT:
        return False
    doc = ast.get_docstring(ast.parse(source)) or ""
    return not any(line.startswith("Size: ") and len(line) > len("Size: ") + 20 for line in doc.splitlines())


@pytest.mark.parametrize("folder", FOLDERS)
def test_long_modules_say_why(folder):
    bad = [f"{p.relative_to(ROOT)} ({p.read_text(encoding='utf-8').count(chr(10)) + 1} lines)"
           for p in sorted((ROOT / folder).rglob("*.py")) if unexplained(p.read_text(encoding="utf-8"))]
    assert not bad, f"modules over {LIMIT} lines with no 'Size:' paragraph at their top: {bad}"


def test_the_rule_reads_the_docstring():
    body = "x = 1\n" * LIMIT
    assert unexplained('"""A module."""\n' + body)
    assert not unexplained('"""A module.\n\nSize: one table of transitions, read top to bottom.\n"""\n' + body)
    assert unexplained('"""A module.\n\nSize: big.\n"""\n' + body)  # a reason, not a word
    assert not unexplained('"""A module."""\n' + "x = 1\n" * 10)
