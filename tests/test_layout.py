"""Layout: the fixed top-level folders install only under the ``decodespec`` namespace.

``spec``, ``impl``, ``checks`` and ``traces`` are names of unrelated PyPI distributions, so the
package must never install bare top-level modules with those names.  These tests prove that
the editable install and a built wheel both import from this repository, and that ``spec/``
stays free of torch.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"spec": "decodespec.spec", "impl": "decodespec.impl", "checks": "decodespec.checks"}


def test_namespace_packages_resolve_inside_this_repository():
    for folder, module in FOLDERS.items():
        mod = importlib.import_module(module)
        assert Path(mod.__file__).resolve().parent == REPO / folder, (module, mod.__file__)


@pytest.mark.parametrize("bare", ["spec", "impl", "checks", "traces"])
def test_no_bare_top_level_module_is_importable(bare):
    # Run from a neutral directory so the repository root is not on sys.path.
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({bare!r}) is None else 1)"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd="/", capture_output=True, text=True)
    assert proc.returncode == 0, f"a bare top-level module {bare!r} is importable: {proc.stderr}"


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = set()
    for folder, module in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([module, *rel.parts]) if rel.parts else module)
    assert found == listed


def test_spec_imports_no_torch():
    offenders = []
    for path in (REPO / "spec").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_importing_the_spec_does_not_load_torch():
    code = (
        "import sys, pkgutil, importlib, decodespec.spec as s\n"
        "for m in pkgutil.walk_packages(s.__path__, 'decodespec.spec.'): importlib.import_module(m.name)\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd="/", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr or "importing decodespec.spec loaded torch"


@pytest.mark.slow
def test_built_wheel_holds_only_the_namespace_and_imports_from_it(tmp_path):
    """Build the wheel from this repository, install it into a scratch target, import from it."""
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(REPO)],
        check=False, capture_output=True, text=True,
    )
    if build.returncode != 0 and "No module named" in build.stderr and "setuptools" in build.stderr:
        build = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(REPO)],
            check=False, capture_output=True, text=True,
        )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.glob("decodespec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"decodespec", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    # Every repository module is in the wheel, under the namespace, byte for byte.
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            arc = "/".join(["decodespec", folder, *path.relative_to(REPO / folder).parts])
            assert arc in names, arc
            assert zipfile.ZipFile(wheel).read(arc) == path.read_bytes(), arc
    target = tmp_path / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=False, capture_output=True, text=True,
    )
    assert inst.returncode == 0, inst.stderr
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import importlib.util\n"
        "import decodespec.spec, decodespec.impl, decodespec.checks, decodespec.checks.commands.cli\n"
        "for m in (decodespec.spec, decodespec.impl, decodespec.checks):\n"
        "    assert m.__file__.startswith(sys.argv[1]), m.__file__\n"
        "for bare in ('spec', 'impl', 'checks', 'traces'):\n"
        "    spec = importlib.util.find_spec(bare)\n"
        "    assert spec is None or not (spec.origin or '').startswith(sys.argv[1]), bare\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S would drop site-packages (attrs); isolate by running from / with the target first.
    run = subprocess.run([sys.executable, "-c", code, str(target)], check=False, cwd="/", capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr


def test_impl_never_imports_what_the_spec_computes_answers_with():
    """The oracle must not be circular: ``impl/`` may use the spec's vocabulary (enums, error codes, frozen
    request and policy records, config parsing) but never a transition, an invariant, the policy's decision
    or the stop/stream reference, which the gate uses to judge it (docstring mentions are fine)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "impl"
    forbidden_modules = ("decodespec.spec.transitions", "decodespec.spec.invariants", "decodespec.spec.policy.decide",
                         "decodespec.spec.vocab_parallel")
    forbidden_names = {"step", "decide", "processed_row", "align_output", "step_triggers", "reference_stream", "beam_step",
                       "MACHINE", "take_snapshot", "expected_report", "expected_start",
                       "participation_failure", "expected_rank_report", "rank_disagreement"}
    hits = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decodespec.spec"):
                if node.module.startswith(forbidden_modules):
                    hits.append(f"{path.name}: from {node.module}")
                hits += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name in forbidden_names]
            elif isinstance(node, ast.Import):
                hits += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith(forbidden_modules)]
    assert not hits, hits
