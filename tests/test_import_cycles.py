"""No import cycle inside a package, and no function-local import that hides one (issue 17 items 4 and 5).

Checked for ``spec/``, ``impl/`` and ``checks/`` (docs/design.md 1a: the module map of ``checks/``).

The graph is read from the source with :mod:`ast`: an edge ``a -> b`` for every import in module
``a`` of a module ``b`` of the same package, at the top level *and* inside functions (a function-
local import of a module that imports the importer back is a cycle postponed, not removed).
Imports under ``if TYPE_CHECKING:`` never run and are left out, as is a submodule importing its own
parent package (the parent is already initialising).  A function-local import of a heavy optional
dependency (torch, transformers, ...) is not an edge: only the package's own modules count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spec", "impl", "checks")


def _module_name(folder: str, path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["decodespec", folder, *parts])


def import_graph(files: dict[str, str], folder: str) -> nx.DiGraph:
    """The import graph of ``files`` (module name -> source; ``__init__`` modules named by their package) of package ``folder``."""
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    packages = {name for name in files if any(other.startswith(name + ".") for other in files)}
    for name, source in files.items():
        tree = ast.parse(source)
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for sub in ast.walk(node)}
        here = name.split(".") if name in packages else name.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = ".".join((here[:len(here) - (node.level - 1)] if node.level else []) + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        targets.append(f"{base}.{alias.name}")
                    elif base in files:
                        targets.append(base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in files]
            for target in targets:
                if target != name and not name.startswith(target + "."):
                    graph.add_edge(name, target)
    return graph


def package_files(folder: str) -> dict[str, str]:
    base = ROOT / folder
    return {_module_name(folder, p, base): p.read_text(encoding="utf-8") for p in sorted(base.rglob("*.py"))}


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_import_cycle(folder):
    found = cycles(import_graph(package_files(folder), folder))
    assert not found, f"import cycles in {folder}/ (counting function-local imports): {found}"


def test_a_cycle_hidden_in_a_function_is_found():
    files = {
        "decodespec.x.a": "from .b import f\n",
        "decodespec.x.b": "def f():\n    from .a import g\n    return g\n",
        "decodespec.x.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n",
        "decodespec.x.d": "import torch\nfrom decodespec.x.c import h\n",
    }
    graph = import_graph(files, "x")
    assert cycles(graph) == [["decodespec.x.a", "decodespec.x.b"]]
    assert not graph.has_edge("decodespec.x.c", "decodespec.x.a") and graph.has_edge("decodespec.x.d", "decodespec.x.c")
    files["decodespec.x.b"] = "def f():\n    return 1\n"
    assert cycles(import_graph(files, "x")) == []


def test_a_cycle_through_a_subpackage_and_a_from_import_of_a_module_is_found():
    # checks/ is split into subpackages: a relative import two levels up, and ``from . import y``
    # naming a module, are edges too.
    files = {
        "decodespec.x": "",
        "decodespec.x.a": "from .sub import b\n",
        "decodespec.x.sub": "",
        "decodespec.x.sub.b": "def late():\n    from ..a import VALUE\n    return VALUE\n",
        "decodespec.x.y": "from . import z\n",
        "decodespec.x.z": "from decodespec.x.y import thing\n",
    }
    assert cycles(import_graph(files, "x")) == [["decodespec.x.a", "decodespec.x.sub.b"], ["decodespec.x.y", "decodespec.x.z"]]


def test_a_package_importing_its_own_children_is_no_cycle():
    # A package's __init__ imports its submodules (registration) and they import names from it
    # (the mutants catalogue): the parent is already initialising, so that is no dependency.
    files = {
        "decodespec.x": "REGISTRY = {}\n\nfrom . import one, two\n",
        "decodespec.x.one": "from . import REGISTRY\n",
        "decodespec.x.two": "from decodespec.x import REGISTRY\nfrom .one import REGISTRY as R\n",
    }
    graph = import_graph(files, "x")
    assert cycles(graph) == []
    assert set(graph.edges) == {("decodespec.x", "decodespec.x.one"), ("decodespec.x", "decodespec.x.two"), ("decodespec.x.two", "decodespec.x.one")}
