"""Reviewer docs generated from the spec registries: pages, diagrams, the build and its coverage check (issue 10).

Reviewers of a runtime change read the contract, the state machine and which rule each check
enforces without reading Python.  Every page that describes a rule is generated from the
registries, so it cannot drift from the code:

* :data:`decodespec.spec.rules.RULES` (transitions, invariants, policy transforms and
  selectors, ladder layers, mutants, profiles) and
  :data:`decodespec.spec.errors.ERROR_CODES` (rejection and resource-limit codes);
* the published envelope schema ``spec/schemas/request.v1.json`` and ``docs/examples/*.json``;
* the policy's declared order presets (:mod:`decodespec.spec.policy`, when present);
* the explorer's graph of reachable states (:mod:`decodespec.checks.modelcheck.explore`, when present)
  for the phase machine, and the M3.10 0x08 boundary table for the commit spine;
* conformance and failure-lab report files under ``docs/results/``;
* the tests themselves: a test "checks" a rule when its source names the rule id.

How it works.  :func:`build_site` imports every module of ``decodespec.spec``,
``decodespec.impl`` and ``decodespec.checks`` (:func:`import_all`, so that every registration
has run), stages the hand-written pages of ``docs/`` plus generated pages
(:func:`write_generated_pages`, one directive per registered rule or code) into a build
folder, and runs Sphinx with MyST and warnings as errors.  The Sphinx extension that renders
those directives is :mod:`decodespec.checks.docs.extension`; this module imports no Sphinx
(``decodespec docs`` reports a missing Sphinx as a missing component).

Page syntax (MyST), for hand-written pages:

* ``{rule}`transition.commit``` links to a rule, ``{error}`envelope.duplicate_key``` to an
  error code.  An id that is not registered is a build error, and :func:`scan_references`
  lets tests check pages without building.  A plain backticked id is *not* a reference and is
  not checked (error areas such as ``transition.*`` share prefixes with rule kinds).
* ``{rule-def}`` / ``{error-table}`` directives *define* a rule or codes; only generated pages
  use them.  The build records every definition and reference and fails when a registered
  rule or code is defined zero or two times, or a reference names an unknown id
  (the SpecTec ``-w`` check, research/formal-anchors-survey.md section 6); the record is
  written to ``<out>/_decodespec/coverage.json``.

Diagrams are drawn offline by Graphviz ``dot`` into SVG that is inlined into the HTML (no
JavaScript, no CDN); the build fails with :class:`DocsError` when ``dot`` is absent.

Source: research/formal-anchors-survey.md section 6 (rendered spec docs); aesthetics-survey.md
8.4 (splice rules by id, fail on unknown ids); M3.10 0x08 (boundary table); Bowtie and test262
reports (research/formal-anchors-survey.md 4.3, 4.4) for the results table.

Size: the docs generator: every generated page (rules, transitions, errors, schemas, matrix,
diagrams) from the spec registries and the build with its coverage check.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import importlib
import importlib.util
import io
import json
import os
import pkgutil
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import networkx as nx

from decodespec.spec.errors import ERROR_CODES, DecodeSpecError, ErrorCode
from decodespec.spec.passport import SYNTHETIC, passport_from_json
from decodespec.spec.rules import RULES, Rule
from decodespec.spec.transitions import TRANSITIONS

__all__ = [
    "COVERAGE_FILE",
    "FRONTIER_BOUNDARIES",
    "KIND_PAGES",
    "PACKAGES",
    "REPO_ROOT",
    "BuildResult",
    "Coverage",
    "DocsError",
    "FrontierBoundary",
    "ImportReport",
    "build_site",
    "check_coverage",
    "commit_spine_graph",
    "dot_available",
    "environment_variable",
    "executable_guard",
    "implemented_by",
    "import_all",
    "load_results",
    "mentions_in_tests",
    "phase_graph",
    "preset_orders",
    "registry_keys",
    "render_svg",
    "result_class",
    "scan_references",
    "schema_rows",
    "spec_frontier_observations",
    "split_statement",
    "to_dot",
    "write_generated_pages",
]

#: The packages whose modules register rules and codes at import time.
PACKAGES: tuple[str, ...] = ("decodespec.spec", "decodespec.impl", "decodespec.checks")

#: The source checkout (``checks/..``): ``docs/``, ``tests/`` and ``spec/schemas`` live here.
REPO_ROOT: Path = Path(__file__).resolve().parents[2]

#: The hand-written pages that ``docs/index.md`` lists itself; every other ``docs/*.md`` page
#: is staged too and listed on the generated "Other pages" page.
HAND_WRITTEN: tuple[str, ...] = ("index.md", "quickstart.md", "adapters.md", "glossary.md", "design.md", "matrix.md")

#: Rule kind -> generated page (under ``generated/``) that defines its rules.
KIND_PAGES: dict[str, str] = {
    "transition": "transitions",
    "invariant": "invariants",
    "transform": "policy",
    "selector": "policy",
    "ladder": "ladder",
    "mutant": "failure-lab",
    "profile": "profiles",
}

#: Page for rules of a kind added to RULE_KINDS after this module was written.
OTHER_RULES_PAGE = "other-rules"

#: A reference in a hand-written page: ``{rule}`id``` or ``{error}`code```.
REFERENCE_RE = re.compile(r"\{(rule|error)\}`([^`\s]+)`")

#: A definition directive in a page: ```` ```{rule-def} id ```` or ```` ```{error-table} area ````.
DEFINITION_RE = re.compile(r"^(`{3,}|:{3,})\{(rule-def|error-table)\}[ \t]+(\S+)", re.MULTILINE)


class DocsError(Exception):
    """The docs cannot be built: a component is missing or a module does not import.

    Attributes:
        missing_component: ``True`` when a tool or package is absent (CLI exit code 3),
            ``False`` when the project itself is broken (exit code 1).
    """

    def __init__(self, message: str, *, missing_component: bool = False):
        super().__init__(message)
        self.missing_component = missing_component


# --------------------------------------------------------------------------------------------
# Registrations: import everything
# --------------------------------------------------------------------------------------------


@attrs.frozen
class ImportReport:
    """Which modules :func:`import_all` imported and which it skipped (and why)."""

    imported: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]


def _is_skipped_module(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("test_") or leaf in ("conftest", "__main__")


def import_all(packages: Sequence[str] = PACKAGES) -> ImportReport:
    """Import every module under ``packages`` so that all rule and code registrations have run.

    Test modules (``test_*``), ``conftest`` and ``__main__`` are skipped.  A module that fails
    because an optional third-party dependency is missing (``ModuleNotFoundError`` for a name
    outside ``decodespec``) is skipped and reported; any other import error is a project bug.

    Raises:
        DocsError: when a project module fails to import (its rules would silently vanish).
    """
    imported: list[str] = []
    skipped: list[tuple[str, str]] = []

    def try_import(name: str) -> bool:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("decodespec"):
                skipped.append((name, f"optional dependency {exc.name!r} is not installed"))
                return False
            raise DocsError(f"module {name} does not import: {exc!r}") from exc
        except Exception as exc:  # a project bug: report it with the module name
            raise DocsError(f"module {name} does not import: {exc!r}") from exc
        imported.append(name)
        return True

    for package in packages:
        if not try_import(package):
            continue
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=package + ".", onerror=lambda _n: None):
            if _is_skipped_module(info.name) or any(info.name.startswith(s + ".") for s, _ in skipped):
                continue
            try_import(info.name)
    return ImportReport(imported=tuple(imported), skipped=tuple(skipped))


# --------------------------------------------------------------------------------------------
# Which tests name which rule or code ("Checked by")
# --------------------------------------------------------------------------------------------

_DOTTED_RE = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


def _test_files(root: Path) -> list[Path]:
    files = sorted((root / "tests").glob("**/test_*.py")) if (root / "tests").is_dir() else []
    if (root / "checks").is_dir():
        files += sorted((root / "checks").glob("**/test_*.py"))
    return files


def mentions_in_tests(root: Path, ids: Iterable[str]) -> dict[str, list[str]]:
    """Map each id in ``ids`` to the tests whose source names it exactly.

    A "test" is a function or method named ``test*`` (or a method of a class named ``Test*``
    or of a Hypothesis state machine) in a ``test_*.py`` file under ``tests/`` or ``checks/``;
    its docstring and body are searched for dotted tokens equal to an id.  Ids named only in
    the module docstring map to the file itself.

    Args:
        root: Source checkout (the folder holding ``tests/`` and ``checks/``).
        ids: Rule ids and error codes to look for.

    Returns:
        id -> sorted list of ``"path::Class::test_name"`` strings (only ids that are named).
    """
    wanted = set(ids)
    found: dict[str, set[str]] = {}

    def note(text: str, label: str) -> None:
        for token in _DOTTED_RE.findall(text):
            if token in wanted:
                found.setdefault(token, set()).add(label)

    for path in _test_files(root):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue  # a file mid-edit; its tests are simply not credited
        rel = path.relative_to(root).as_posix()
        doc = ast.get_docstring(tree)
        if doc:
            note(doc, rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        segment = ast.get_source_segment(source, item) or ""
                        note(segment, f"{rel}::{node.name}::{item.name}")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                segment = ast.get_source_segment(source, node) or ""
                note(segment, f"{rel}::{node.name}")
    return {k: sorted(v) for k, v in sorted(found.items())}


# --------------------------------------------------------------------------------------------
# Policy presets (declared data in decodespec.spec.policy)
# --------------------------------------------------------------------------------------------


def _step_name(step: Any) -> str | None:
    if isinstance(step, enum.Enum):
        step = step.value
    if isinstance(step, str):
        return step
    for attr in ("name", "value", "id"):
        value = getattr(step, attr, None)
        if isinstance(value, str):
            return value
    return None


def preset_orders() -> dict[str, tuple[str, ...]]:
    """The named transform-order presets declared by :mod:`decodespec.spec.policy`.

    Looks in ``decodespec.spec.policy`` and its submodules for module-level mappings whose
    name contains ``PRESET`` or ``ORDER``, from preset name to a sequence of steps (strings,
    enums or objects with a ``name``), and for module-level sequences of step names whose name
    ends in ``_ORDER`` (a preset named after the attribute, e.g. ``LLAMA_CPP_MIROSTAT_ORDER``).
    Returns ``{}`` when the policy package is absent or declares none.

    Returns:
        preset name -> ordered step names, in declaration order.
    """
    try:
        pkg = importlib.import_module("decodespec.spec.policy")
    except ImportError:
        return {}
    modules = [pkg]
    for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=pkg.__name__ + "."):
        if not _is_skipped_module(info.name):
            with contextlib.suppress(ImportError):
                modules.append(importlib.import_module(info.name))
    presets: dict[str, tuple[str, ...]] = {}
    for module in modules:
        for attr, value in vars(module).items():
            if not attr.isupper():
                continue
            if attr.endswith("_ORDER") and isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
                presets.setdefault(attr[: -len("_ORDER")].lower(), tuple(value))
                continue
            if not ("PRESET" in attr or "ORDER" in attr) or not isinstance(value, Mapping):
                continue
            for key, steps in value.items():
                name = _step_name(key)
                if name is None or isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence):
                    continue
                names = [_step_name(s) for s in steps]
                if names and all(n is not None for n in names):
                    presets.setdefault(name, tuple(n for n in names if n is not None))
    return presets


# --------------------------------------------------------------------------------------------
# Envelope schema
# --------------------------------------------------------------------------------------------


@attrs.frozen
class SchemaRow:
    """One field of a JSON Schema, flattened: JSON path, type, required, constraints, text."""

    path: str
    type: str
    required: bool
    constraints: str
    description: str


_CONSTRAINT_KEYS = (
    "const", "enum", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength",
    "maxLength", "minItems", "maxItems", "uniqueItems", "pattern", "format", "default",
)


def _resolve(schema: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    seen: set[str] = set()
    while "$ref" in node and isinstance(node["$ref"], str) and node["$ref"].startswith("#/"):
        ref = node["$ref"]
        if ref in seen:
            break
        seen.add(ref)
        target: Any = schema
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, Mapping) else {}
        extra = {k: v for k, v in node.items() if k != "$ref"}
        node = {**target, **extra}
    return node


def _type_of(node: Mapping[str, Any]) -> str:
    t = node.get("type")
    if isinstance(t, list):
        return " | ".join(map(str, t))
    if isinstance(t, str):
        return t
    if "const" in node:
        return type(node["const"]).__name__.replace("str", "string")
    for key in ("oneOf", "anyOf"):
        if key in node:
            return key
    if "enum" in node:
        return "enum"
    return "any"


def _constraints(node: Mapping[str, Any]) -> str:
    parts = []
    for key in _CONSTRAINT_KEYS:
        if key in node:
            parts.append(f"{key}={json.dumps(node[key], ensure_ascii=False)}")
    if node.get("additionalProperties") is False:
        parts.append("closed (no other fields)")
    return "; ".join(parts)


def _alternative_label(node: Mapping[str, Any], idx: int) -> str:
    props = node.get("properties", {})
    for key, sub in props.items() if isinstance(props, Mapping) else ():
        if isinstance(sub, Mapping) and "const" in sub:
            return f"{key}={sub['const']}"
    return str(node.get("title") or idx)


def schema_rows(schema: Mapping[str, Any], *, max_depth: int = 12) -> list[SchemaRow]:
    """Flatten a JSON Schema (Draft 2020-12) into one row per field, depth first.

    Local ``$ref`` s are resolved; array items get the path suffix ``[]``; ``oneOf`` /
    ``anyOf`` alternatives get ``<label>`` (the value of their ``const`` discriminator field,
    else their title or index).

    Returns:
        Rows in document order; the root is ``$``.
    """
    rows: list[SchemaRow] = []

    def walk(node: Mapping[str, Any], path: str, required: bool, depth: int) -> None:
        node = _resolve(schema, node)
        rows.append(SchemaRow(path, _type_of(node), required, _constraints(node), str(node.get("description", ""))))
        if depth >= max_depth:
            return
        req = set(node.get("required", []) or [])
        props = node.get("properties")
        if isinstance(props, Mapping):
            for key, sub in props.items():
                if isinstance(sub, Mapping):
                    walk(sub, f"{path}.{key}", key in req, depth + 1)
        items = node.get("items")
        if isinstance(items, Mapping):
            walk(items, f"{path}[]", True, depth + 1)
        for key in ("oneOf", "anyOf"):
            alts = node.get(key)
            if isinstance(alts, list):
                for idx, alt in enumerate(alts):
                    if isinstance(alt, Mapping):
                        alt = _resolve(schema, alt)
                        walk(alt, f"{path}<{_alternative_label(alt, idx)}>", True, depth + 1)

    walk(schema, "$", True, 0)
    return rows


# --------------------------------------------------------------------------------------------
# Frontier boundary table and the commit spine (M3.10 0x08)
# --------------------------------------------------------------------------------------------


@attrs.frozen
class FrontierBoundary:
    """One row of the M3.10 0x08 boundary table, in the decoder-only cached profile.

    Attributes:
        boundary: The loop boundary, in the seed's words.
        output_count: O, committed output tokens.
        pending: U as the seed writes it (``"empty"``, ``"[y0]"``, ...).
        pending_len: |U|.
        pending_tag: The :class:`~decodespec.spec.enums.PendingTag` value of U.
        processed_offset: P - L (P, and K = P, relative to the prompt length L).
        event: The spine event that leads *to* this boundary from the previous one.
        phase: The spec phase (:class:`decodespec.spec.state.Phase` value) of a state at this
            boundary; with ``output_count``, ``pending_tag`` and ``after_repair`` it selects the
            spec states that :func:`spec_frontier_observations` compares with the row.
        after_repair: The row follows the optional repair call.
    """

    boundary: str
    output_count: int
    pending: str
    pending_len: int
    pending_tag: str
    processed_offset: int
    event: str
    phase: str
    after_repair: bool = False

    @property
    def processed(self) -> str:
        """P (= K in this profile) as an expression in L."""
        return "L" if self.processed_offset == 0 else f"L+{self.processed_offset}"

    @property
    def balanced(self) -> bool:
        """The frontier invariant ``P + |U| = L + O`` at this boundary."""
        return self.processed_offset + self.pending_len == self.output_count


#: The boundary table of M3.10 0x08 ("Output, input, and cache frontiers"), transcribed from
#: the seed (the spec does not expose the table as one object), plus the spine event that
#: leads to each row (M3.10 "Authoritative phase and commit spine": completion, decision,
#: commit, later processing).  :attr:`FrontierBoundary.balanced` recomputes the invariant.
FRONTIER_BOUNDARIES: tuple[FrontierBoundary, ...] = (
    FrontierBoundary("after prompt prefill, before first selection", 0, "empty", 0, "EMPTY", 0,
                     "prefill call completes ALL_NEW: prompt [0, L) processed, score row exposed", "scored"),
    FrontierBoundary("after selecting y0", 1, "[y0]", 1, "PENDING_NEXT_CALL", 0,
                     "decide (M3.8 receipt) + commit once: y0 appended to the output", "ready"),
    FrontierBoundary("after processing y0, before selecting y1", 1, "empty", 0, "EMPTY", 1,
                     "decode call completes ALL_NEW: y0 processed into every state lane", "scored"),
    FrontierBoundary("after selecting y1", 2, "[y1]", 1, "PENDING_NEXT_CALL", 1,
                     "decide + commit once: y1 appended to the output", "ready"),
    FrontierBoundary("stop immediately", 2, "[y1] or closed-unprocessed output", 1, "CLOSED_UNPROCESSED", 1,
                     "finish: y1 stays CLOSED_UNPROCESSED", "finished"),
    FrontierBoundary("optional append/repair of y1", 2, "empty", 0, "EMPTY", 2,
                     "repair call processes y1; its logits are discarded", "finished", after_repair=True),
)


def commit_spine_graph(boundaries: Sequence[FrontierBoundary] = FRONTIER_BOUNDARIES) -> nx.DiGraph:
    """The commit spine as a graph: admission, then one node per boundary, events on edges.

    A call that completes ALL_OLD changes nothing and exposes no score: drawn as a self loop
    on the boundaries that launch a call (M3.10 0x08 "SELECT LOGICAL STATE").

    Returns:
        ``networkx.DiGraph`` whose nodes and edges carry a ``label`` attribute.
    """
    g = nx.DiGraph(name="commit_spine")
    g.add_node("admitted", label="admitted request\nO=0  U=empty  P=0", shape="ellipse")
    prev = "admitted"
    for idx, b in enumerate(boundaries):
        node = f"b{idx}"
        g.add_node(node, label=f"{b.boundary}\nO={b.output_count}  U={b.pending} ({b.pending_tag})\nP=K={b.processed}")
        g.add_edge(prev, node, label=b.event)
        prev = node
    for node, data in list(g.nodes(data=True)):
        if "PENDING_NEXT_CALL" in data["label"] or node == "admitted":
            g.add_edge(node, node, label="call completes ALL_OLD:\nno score, no change", style="dashed")
    return g


# --------------------------------------------------------------------------------------------
# Phase machine (from the explorer's graph of reachable states)
# --------------------------------------------------------------------------------------------


#: Explorer configurations whose reachable graphs are unioned into the phase machine: the
#: default bounds (chunked prefill, interrupts, faults, adversarial actions, repair), the three
#: G=0 branches, a static cache and the non-default profiles.  Keyword arguments of
#: ``decodespec.checks.modelcheck.explore.ExploreBounds``.
PHASE_CONFIGS: tuple[dict[str, Any], ...] = (
    {},
    {"max_new_tokens": 0, "zero_new_tokens": "reject"},
    {"max_new_tokens": 0, "zero_new_tokens": "no_call"},
    {"max_new_tokens": 0, "zero_new_tokens": "prefill_only"},
    {"cache": "static"},
    {"profile": "prefix_lm", "prefill_chunk": None},
    {"profile": "hybrid"},
    {"profile": "encoder_decoder", "prompt_len": 1},
)


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def _explored_graphs(configs: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[Any, nx.DiGraph]], list[str]]:
    """Explore each configuration; return the ``(params, graph)`` pairs and the refused ones."""
    from decodespec.checks.modelcheck import explore as ex

    out, refused = [], []
    for cfg in configs:
        try:
            bounds = ex.ExploreBounds(**cfg)
            params = ex.params_for_bounds(bounds)
        except (TypeError, ValueError, DecodeSpecError) as exc:  # the explorer's bounds changed
            refused.append(f"{cfg}: {exc}")
            continue
        out.append((params, ex.explore(params, bounds).graph))
    return out, refused


def phase_graph(configs: Sequence[Mapping[str, Any]] = PHASE_CONFIGS) -> tuple[nx.DiGraph | None, str]:
    """The phase machine: the explorer's reachable-state graphs collapsed to phases.

    Every reachable state of each configuration in ``configs`` is mapped to its ``phase``; a
    phase edge is drawn when some transition goes from a state of one phase to a state of the
    other, labelled with the transition rules seen on it (without the ``transition.`` prefix).

    Returns:
        ``(graph, source)``: a ``networkx.DiGraph`` over phase names (nodes and edges carry
        ``label``), and a sentence naming where it came from; ``(None, reason)`` when the
        explorer is not available.
    """
    try:
        importlib.import_module("decodespec.checks.modelcheck.explore")
    except ImportError as exc:
        return None, f"the explorer (decodespec.checks.modelcheck.explore) is not available: {exc}"
    edge_rules: dict[tuple[str, str], set[str]] = {}
    num_states = 0
    terminal: set[str] = set()
    explored, refused = _explored_graphs(configs)
    if not explored:
        raise DocsError(f"the explorer refused every phase configuration: {refused}")
    for _params, graph in explored:
        num_states += graph.number_of_nodes()
        for u, v, data in graph.edges(data=True):
            pu, pv = _value(u.phase), _value(v.phase)
            rule_id = str(data.get("rule", ""))
            edge_rules.setdefault((pu, pv), set()).add(rule_id.split(".", 1)[-1])
        terminal |= {_value(n.phase) for n in graph.nodes if graph.out_degree(n) == 0}
    phases = nx.DiGraph(name="phases")
    for (pu, pv), names in sorted(edge_rules.items()):
        phases.add_edge(pu, pv, label="\n".join(sorted(n for n in names if n)))
    initial = {_value(next(iter(graph.nodes)).phase) for _p, graph in explored if graph.number_of_nodes()}
    for node in phases.nodes:
        phases.nodes[node]["label"] = node
        if node in initial:
            phases.nodes[node]["rank"] = "source"
        if node in terminal and not any(u == node and v != node for u, v in phases.edges):
            phases.nodes[node].update(shape="doubleoctagon", rank="sink")
    source = (f"collapsed from {num_states} reachable states of {len(explored)} explorer configurations "
              "(decodespec.checks.modelcheck.explore, PHASE_CONFIGS); edges name the transition rules taken")
    if refused:
        source += f"; configurations the explorer refused: {'; '.join(refused)}"
    return phases, source


def spec_frontier_observations(
    boundaries: Sequence[FrontierBoundary] = FRONTIER_BOUNDARIES,
) -> tuple[list[set[tuple[int, int, int, int | None]]] | None, str]:
    """What the spec's reachable states say at each boundary of the M3.10 0x08 table.

    Explores a decoder-only request (L=2, G=3, one-shot prefill, greedy, repair allowed, no
    faults) and, for each boundary, collects ``(O, |U|, P - L, K - L)`` over every reachable
    state in the boundary's phase with the boundary's O and U tag (the repair row also needs
    the last completed call to be a repair).

    Returns:
        ``(observations, source)`` with one set per boundary, or ``(None, reason)`` when the
        explorer is not available.
    """
    try:
        importlib.import_module("decodespec.checks.modelcheck.explore")
    except ImportError as exc:
        return None, f"the explorer is not available: {exc}"
    cfg = {"vocab": 3, "prompt_len": 2, "max_new_tokens": 3, "prefill_chunk": None, "faults": False,
           "adversarial": False, "final_cache": "all_outputs"}
    explored, refused = _explored_graphs([cfg])
    if not explored:
        raise DocsError(f"the explorer refused the frontier-table configuration: {refused}")
    (params, graph), = explored
    L = params.prompt_len
    observed: list[set[tuple[int, int, int, int | None]]] = []
    for b in boundaries:
        seen = set()
        for st in graph.nodes:
            if (_value(st.phase), st.output_count, _value(st.pending_tag)) != (b.phase, b.output_count, b.pending_tag):
                continue
            if b.after_repair != (st.last_completion is not None and _value(st.last_completion.kind) == "repair"):
                continue
            k = st.k_frontier(params)
            seen.add((st.output_count, len(st.pending_ids), st.processed - L, None if k is None else k - L))
        observed.append(seen)
    return observed, f"explored {graph.number_of_nodes()} states of a decoder-only request with L={L}, G=3"


# --------------------------------------------------------------------------------------------
# Graphviz
# --------------------------------------------------------------------------------------------


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: nx.DiGraph, *, rankdir: str = "TB") -> str:
    """DOT source for ``graph``: node and edge ``label`` / ``style`` / ``shape`` attributes kept.

    A node whose ``rank`` attribute is ``"source"`` or ``"sink"`` is placed on the first or last
    rank.
    """
    lines = [
        f"digraph {_dot_quote(str(graph.graph.get('name', 'g')))} {{",
        f"  rankdir={rankdir};",
        '  node [shape=box, style="rounded", fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=10];',
    ]
    ids = {node: f"n{idx}" for idx, node in enumerate(graph.nodes)}
    for node, data in graph.nodes(data=True):
        attrs_ = {"label": str(data.get("label", node))}
        attrs_.update({k: str(data[k]) for k in ("shape", "style") if k in data})
        lines.append(f"  {ids[node]} [" + ", ".join(f"{k}={_dot_quote(v)}" for k, v in attrs_.items()) + "];")
    for rank in ("source", "sink"):
        members = [ids[n] for n, d in graph.nodes(data=True) if d.get("rank") == rank]
        if members:
            lines.append(f"  {{rank={rank}; " + "; ".join(members) + ";}")
    for u, v, data in graph.edges(data=True):
        attrs_ = {k: str(data[k]) for k in ("label", "style") if k in data}
        body = ", ".join(f"{k}={_dot_quote(val)}" for k, val in attrs_.items())
        lines.append(f"  {ids[u]} -> {ids[v]}" + (f" [{body}]" if body else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_available() -> bool:
    """Whether Graphviz ``dot`` is on ``PATH``."""
    return shutil.which("dot") is not None


def render_svg(dot_source: str) -> str:
    """Render DOT source to an SVG element (XML prolog, doctype and comments stripped).

    Raises:
        DocsError: ``dot`` is not installed (``missing_component``) or rejects the source.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise DocsError(
            "Graphviz 'dot' is not on PATH; the diagrams cannot be drawn. "
            "Install the Debian package 'graphviz' (.ci/setup does so when run as root).",
            missing_component=True,
        )
    proc = subprocess.run([exe, "-Tsvg"], check=False, input=dot_source, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise DocsError(f"dot failed: {proc.stderr.strip()}")
    svg = proc.stdout
    svg = re.sub(r"<\?xml[^>]*\?>\s*", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>\s*", "", svg)
    svg = re.sub(r"<!--.*?-->\s*", "", svg, flags=re.DOTALL)
    return svg.strip()


# --------------------------------------------------------------------------------------------
# Conformance and failure-lab results
# --------------------------------------------------------------------------------------------


@attrs.frozen
class CaseResult:
    """One line of a ``decodespec check --report`` file (or of a failure-lab results file)."""

    runtime: str
    case: str
    result: str
    layer: str
    expected: str
    actual: str
    source: str


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load_results(results_dir: Path) -> tuple[list[CaseResult], list[dict[str, Any]]]:
    """Read every ``*.jsonl`` report under ``results_dir``.

    A conformance line has ``case``, ``result`` (``pass`` / ``fail`` / ``deviation`` or any
    other string), ``layer``, ``expected``, ``actual`` and optionally ``runtime`` (default: the
    file's stem).  A failure-lab line has ``mutant`` (a ``mutant.*`` rule id), ``killed``
    (bool) and optionally ``killed_by`` (the check or ladder layer that killed it).

    Returns:
        ``(conformance, mutant_lines)``.

    Raises:
        DocsError: a line is not a JSON object or lacks ``case`` / ``result`` or ``mutant``.
    """
    conformance: list[CaseResult] = []
    mutants: list[dict[str, Any]] = []
    if not results_dir.is_dir():
        return conformance, mutants
    for path in sorted(results_dir.glob("*.jsonl")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DocsError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(obj, dict):
                raise DocsError(f"{where}: not a JSON object")
            try:  # the passport; a line without one was written by the gate before it existed (synthetic)
                passport_from_json(obj.get("data"), "$.data", missing=SYNTHETIC)
            except DecodeSpecError as exc:
                raise DocsError(f"{where}: [{exc.code}] {exc.path}: {exc.message}") from None
            if "mutant" in obj:
                mutants.append({**obj, "_source": where})
                continue
            if "case" not in obj or "result" not in obj:
                raise DocsError(f"{where}: a report line needs 'case' and 'result' (or 'mutant')")
            conformance.append(CaseResult(
                runtime=str(obj.get("runtime", path.stem)),
                case=str(obj["case"]),
                result=str(obj["result"]),
                layer=str(obj.get("layer") or ""),
                expected=_short(obj.get("expected", "")),
                actual=_short(obj.get("actual", "")),
                source=where,
            ))
    return conformance, mutants


# --------------------------------------------------------------------------------------------
# Generated pages
# --------------------------------------------------------------------------------------------

_KIND_INTRO = {
    "transition": (
        "Transitions",
        ("Every action of the request state machine: its guard (when it is enabled) and effect, "
        "from the transition registry. A disabled action is rejected and changes nothing."),
    ),
    "invariant": ("Invariants", "Named predicates over (parameters, state), checked after every step."),
    "profile": ("Profiles", "Architecture profiles: which state lanes a request carries and which frontiers apply."),
    "ladder": (
        "The conformance ladder",
        ("Layers compared in this order, stopping at the first failed layer; a later pass never "
        "cures an earlier failure."),
    ),
    "mutant": (
        "The failure lab",
        ("Deliberately broken variants (mutants) of the runtime or spec, each with the seed "
        "section it breaks and the check that must kill it."),
    ),
}


def _page_header(title: str, intro: str) -> str:
    return (
        f"# {title}\n\n"
        "<!-- Generated by decodespec.checks.docs from the spec registries; do not edit. -->\n\n"
        f"{intro}\n\n"
    )


def _fence(name: str, arg: str = "", body: str = "") -> str:
    head = f"```{{{name}}}" + (f" {arg}" if arg else "")
    return f"{head}\n{body}```\n\n" if body else f"{head}\n```\n\n"


def _rule_defs(rules: Iterable[Rule]) -> str:
    return "".join(_fence("rule-def", r.id) for r in rules)


def _kind_page(kind: str, rules: list[Rule]) -> str:
    title, intro = _KIND_INTRO.get(kind, (kind.capitalize() + " rules", f"Rules of kind `{kind}`."))
    text = _page_header(title, intro)
    if not rules:
        return text + f"No `{kind}` rule is registered yet.\n"
    return text + _fence("rule-index", kind) + "## Definitions\n\n" + _rule_defs(rules)


def _policy_page(transforms: list[Rule], selectors: list[Rule]) -> str:
    text = _page_header(
        "Decoding policy (M3.8)",
        "Score transforms (processors and warpers) and selectors, and the named transform orders "
        "(presets) side by side: which step each preset applies first.",
    )
    text += "## Order presets side by side\n\n" + _fence("policy-presets")
    for heading, kind, rules in (("Transforms", "transform", transforms), ("Selectors", "selector", selectors)):
        text += f"## {heading}\n\n"
        if not rules:
            text += f"No `{kind}` rule is registered yet.\n\n"
            continue
        text += _fence("rule-index", kind) + _rule_defs(rules)
    return text


def _failure_lab_page(rules: list[Rule]) -> str:
    text = _kind_page("mutant", rules)
    return text + "\n## Latest failure-lab results\n\n" + _fence("mutant-results")


def _errors_page(codes: Mapping[str, ErrorCode]) -> str:
    text = _page_header(
        "Rejection and resource-limit codes",
        "Every error a module may raise, grouped by area. A `rejection` is the caller's fault, a "
        "`resource_limit` a declared bound; in both cases nothing changed. Codes are the API: "
        "messages may be reworded, codes may not.",
    )
    areas = sorted({c.split(".", 1)[0] for c in codes})
    if not areas:
        return text + "No error code is registered yet.\n"
    for area in areas:
        text += f"## `{area}.*`\n\n" + _fence("error-table", area)
    return text


def _envelope_page(gen: Path, schema_path: Path, examples: list[Path]) -> str:
    text = _page_header(
        "Request envelope",
        "The immutable request envelope (`numinens.request.v1`), from the published JSON Schema. "
        "Rejections of an envelope are listed on the {doc}`errors` page (area `envelope`).",
    )
    if not schema_path.is_file():
        return text + f"The schema file `spec/schemas/{schema_path.name}` is not present yet.\n"
    data = gen / "_data"
    data.mkdir(exist_ok=True)
    shutil.copy2(schema_path, data / schema_path.name)
    text += "## Fields\n\n" + _fence("schema-table", f"_data/{schema_path.name}")
    if examples:
        text += "## Examples\n\n"
        for ex in examples:
            shutil.copy2(ex, data / f"example-{ex.name}")
            text += f"### `{ex.name}`\n\n" + _fence("literalinclude", f"_data/example-{ex.name}", ":language: json\n")
    text += "## The schema file\n\n" + _fence("literalinclude", f"_data/{schema_path.name}", ":language: json\n")
    return text


def _state_machine_page() -> str:
    text = _page_header(
        "State machine and commit spine",
        "The phase machine and the commit spine of one request (M3.10 \"Authoritative phase and "
        "commit spine\"), with the frontier table of M3.10 0x08. Four events stay separate even "
        "when code fuses them: model-call completion (ALL_NEW or ALL_OLD), decision (an M3.8 "
        "receipt), logical commit (the receipt consumed once), and later processing of the pending "
        "token by the next call.",
    )
    text += "## Phase machine\n\n" + _fence("decodespec-diagram", "phases")
    text += "## Commit spine\n\n" + _fence("decodespec-diagram", "spine")
    text += "## Frontier boundaries (M3.10 0x08)\n\n" + _fence("frontier-table")
    return text


def _results_page() -> str:
    return _page_header(
        "Conformance results",
        "The latest `decodespec check --report FILE` results per runtime, read from "
        "`docs/results/*.jsonl` (one JSON object per case: `case`, `result`, `layer`, `expected`, "
        "`actual`, optional `runtime`, default the file name). `deviation` is an accepted, "
        "declared deviation of a peer (an expectations file with reasons), not a skipped case.",
    ) + _fence("conformance-results")


def _cli_page() -> str:
    return _page_header(
        "Command line",
        "The `decodespec` subcommands that exist now, with their `--help`, read from the CLI registry.",
    ) + _fence("cli-reference")


def _about_page() -> str:
    return _page_header(
        "About these pages",
        "How this site is generated and what it covers: the modules imported for registration, "
        "rules without a test that names them, and the reference syntax for hand-written pages.",
    ) + _fence("generation-report")


def _more_page(extra: list[str]) -> str:
    text = _page_header("Other pages", "Hand-written pages of `docs/` that the index does not list itself.")
    if not extra:
        return text + "None yet.\n"
    return text + _fence("toctree", body=":maxdepth: 1\n\n" + "".join(f"/{name}\n" for name in extra))


def write_generated_pages(src_dir: Path, *, rules: Mapping[str, Rule] = RULES,
                          codes: Mapping[str, ErrorCode] = ERROR_CODES,
                          root: Path = REPO_ROOT) -> list[Path]:
    """Write the generated MyST pages under ``src_dir / "generated"``.

    Each registered rule gets exactly one ``{rule-def}`` directive, on the page of its kind
    (:data:`KIND_PAGES`); each error area one ``{error-table}``.

    Returns:
        The written page paths.
    """
    gen = src_dir / "generated"
    gen.mkdir(parents=True, exist_ok=True)
    by_kind: dict[str, list[Rule]] = {}
    for r in rules.values():  # registration order: the order the spec modules read
        by_kind.setdefault(r.kind, []).append(r)
    pages: dict[str, str] = {
        "state-machine": _state_machine_page(),
        "transitions": _kind_page("transition", by_kind.get("transition", [])),
        "invariants": _kind_page("invariant", by_kind.get("invariant", [])),
        "profiles": _kind_page("profile", by_kind.get("profile", [])),
        "policy": _policy_page(by_kind.get("transform", []), by_kind.get("selector", [])),
        "envelope": _envelope_page(gen, root / "spec" / "schemas" / "request.v1.json",
                                   sorted((root / "docs" / "examples").glob("*.json"))),
        "errors": _errors_page(codes),
        "ladder": _kind_page("ladder", by_kind.get("ladder", [])),
        "failure-lab": _failure_lab_page(by_kind.get("mutant", [])),
        "results": _results_page(),
        "cli": _cli_page(),
        "about": _about_page(),
        "more": _more_page(sorted(p.stem for p in src_dir.glob("*.md") if p.name not in HAND_WRITTEN)),
    }
    others = [r for kind, rs in by_kind.items() if kind not in KIND_PAGES for r in rs]
    if others:
        pages[OTHER_RULES_PAGE] = _page_header("Other rules", "Rules of kinds without a page of their own.") + _rule_defs(others)
    written = []
    for name, text in pages.items():
        path = gen / f"{name}.md"
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------
# Coverage: every rule and code defined exactly once, every reference known
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Coverage:
    """What a built site documents, compared with the registries.

    Attributes:
        missing: Registered rule ids / error codes (``"rule:<id>"``, ``"error:<code>"``) that
            no page defines.
        duplicated: Keys defined on more than one place, with the pages.
        unknown_definitions: Keys defined on a page but not registered.
        unknown_references: ``(key, page)`` of ``{rule}`` / ``{error}`` references to ids that are
            not registered.
        undefined_references: ``(key, page)`` of references to registered ids that no page defines.
    """

    missing: tuple[str, ...]
    duplicated: tuple[tuple[str, tuple[str, ...]], ...]
    unknown_definitions: tuple[str, ...]
    unknown_references: tuple[tuple[str, str], ...]
    undefined_references: tuple[tuple[str, str], ...]

    @property
    def ok(self) -> bool:
        """No problem of any kind."""
        return not (self.missing or self.duplicated or self.unknown_definitions
                    or self.unknown_references or self.undefined_references)

    def problems(self) -> list[str]:
        """One human sentence per problem."""
        out = [f"{k} is registered but documented nowhere" for k in self.missing]
        out += [f"{k} is documented {len(p)} times: {', '.join(p)}" for k, p in self.duplicated]
        out += [f"{k} is documented but not registered" for k in self.unknown_definitions]
        out += [f"{page} names {k}, which is not registered" for k, page in self.unknown_references]
        out += [f"{page} names {k}, which is registered but documented nowhere" for k, page in self.undefined_references]
        return out


def registry_keys(rules: Mapping[str, Rule] = RULES, codes: Mapping[str, ErrorCode] = ERROR_CODES) -> set[str]:
    """``rule:<id>`` for every rule and ``error:<code>`` for every code."""
    return {f"rule:{r}" for r in rules} | {f"error:{c}" for c in codes}


def check_coverage(definitions: Mapping[str, Sequence[str]], references: Iterable[tuple[str, str]],
                   *, rules: Mapping[str, Rule] = RULES, codes: Mapping[str, ErrorCode] = ERROR_CODES) -> Coverage:
    """Compare what the pages define and reference with the registries.

    Args:
        definitions: key (``rule:<id>`` / ``error:<code>``) -> pages that define it.
        references: ``(key, page)`` for every ``{rule}`` / ``{error}`` reference.
        rules, codes: The registries (default: the global ones).
    """
    keys = registry_keys(rules, codes)
    defined = {k for k, pages in definitions.items() if pages}
    return Coverage(
        missing=tuple(sorted(keys - defined)),
        duplicated=tuple(sorted((k, tuple(p)) for k, p in definitions.items() if len(p) > 1)),
        unknown_definitions=tuple(sorted(defined - keys)),
        unknown_references=tuple(sorted((k, page) for k, page in set(references) if k not in keys)),
        undefined_references=tuple(sorted((k, page) for k, page in set(references) if k in keys and k not in defined)),
    )


def scan_references(text: str) -> list[tuple[str, str]]:
    """The ``{rule}`` / ``{error}`` references in a page's MyST source, as ``(kind, id)`` pairs.

    Parsed with MyST's own Markdown parser (markdown-it with the MyST role plugin), so code
    spans and code blocks are not references; the bodies of directives (fences whose info
    starts with ``{``) are parsed recursively, without their ``:option:`` lines.  Without the
    docs extra, a regular expression over the raw text is used instead.
    """
    try:
        from markdown_it import MarkdownIt
        from mdit_py_plugins.myst_role import myst_role_plugin
    except ImportError:  # pragma: no cover - the docs extra is absent
        return [(role, ident) for role, ident in REFERENCE_RE.findall(text)]
    md = MarkdownIt("commonmark").use(myst_role_plugin)
    found: list[tuple[str, str]] = []

    def walk(source: str) -> None:
        for token in md.parse(source):
            if token.type == "fence" and token.info.strip().startswith("{"):
                body = "\n".join(ln for ln in token.content.splitlines() if not re.match(r"^:\w[\w-]*:", ln))
                walk(body)
            for child in token.children or []:
                if child.type == "myst_role" and child.meta.get("name") in ("rule", "error"):
                    found.append((child.meta["name"], child.content.strip()))

    walk(text)
    return found


def scan_definitions(text: str) -> list[tuple[str, str]]:
    """The ``{rule-def}`` / ``{error-table}`` directives in a page's source, as ``(name, arg)``."""
    return [(name, arg) for _fence_, name, arg in DEFINITION_RE.findall(text)]


# --------------------------------------------------------------------------------------------
# Building the site
# --------------------------------------------------------------------------------------------


@attrs.frozen
class BuildResult:
    """The outcome of :func:`build_site`.

    Attributes:
        ok: Sphinx finished without a warning (warnings are errors) and coverage is complete.
        out_dir: The HTML site (``index.html`` at its root).
        source_dir: The staged sources (hand-written + generated pages).
        warnings: Sphinx's warnings and errors, one per line.
        coverage: The definitions/references check read back from the build.
        imports: What :func:`import_all` imported and skipped.
    """

    ok: bool
    out_dir: Path
    source_dir: Path
    warnings: tuple[str, ...]
    coverage: Coverage
    imports: ImportReport


def _require_sphinx() -> None:
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        raise DocsError(
            f"{', '.join(missing)} not installed: pip install 'decodespec[docs]'", missing_component=True
        )


def stage_sources(src_dir: Path, docs_dir: Path) -> list[Path]:
    """Copy ``conf.py``, every hand-written page (``docs_dir/*.md``) and the plots under ``docs_dir/results`` into ``src_dir``.

    Pages other than :data:`HAND_WRITTEN` are listed by the generated ``generated/more`` page.

    Raises:
        DocsError: ``docs_dir`` lacks ``conf.py`` or ``index.md`` (not a source checkout).
    """
    for required in ("conf.py", "index.md"):
        if not (docs_dir / required).is_file():
            raise DocsError(f"{docs_dir / required} not found: run from a source checkout", missing_component=True)
    src_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in [docs_dir / "conf.py", *sorted(docs_dir.glob("*.md"))]:
        shutil.copy2(path, src_dir / path.name)
        copied.append(src_dir / path.name)
    for path in sorted(docs_dir.glob("results/**/*.png")):  # committed plots the pages embed (docs/sweeps.md)
        target = src_dir / path.relative_to(docs_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied.append(target)
    return copied


def build_site(out_dir: Path, *, docs_dir: Path | None = None, results_dir: Path | None = None,
               source_dir: Path | None = None, extra_pages: Mapping[str, str] | None = None) -> BuildResult:
    """Generate the pages and build the HTML site with Sphinx (warnings are errors).

    Args:
        out_dir: Where the HTML goes (created; ``index.html`` at its root).
        docs_dir: Hand-written pages and ``conf.py`` (default ``<repo>/docs``).
        results_dir: Conformance / failure-lab reports (default ``<docs_dir>/results``).
        source_dir: Where to stage the sources (default: a temporary folder, removed after).
            An existing folder is replaced only when it is empty or was staged by an earlier
            build (it holds ``STAGING_MARKER``).
        extra_pages: Extra ``name.md -> text`` pages to stage (tests use this to plant errors).

    Returns:
        A :class:`BuildResult`; ``ok`` is ``False`` when Sphinx warned or coverage is incomplete.

    Raises:
        DocsError: Sphinx / MyST / Graphviz missing, hand-written pages missing, a project
            module that does not import, or an unreadable results file.
    """
    _require_sphinx()
    if not dot_available():
        render_svg("")  # raises the clear "dot missing" DocsError
    imports = import_all()
    docs_dir = (docs_dir or REPO_ROOT / "docs").resolve()
    results_dir = (results_dir or docs_dir / "results").resolve()
    load_results(results_dir)  # fail early and clearly on a malformed report
    out_dir = Path(out_dir).resolve()
    tmp = None
    if source_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="decodespec-docs-")
        source_dir = Path(tmp.name) / "src"
    source_dir = Path(source_dir).resolve()
    try:
        if source_dir.exists():
            if any(source_dir.iterdir()) and not (source_dir / STAGING_MARKER).is_file():
                raise DocsError(f"{source_dir} is not empty and was not staged by decodespec docs: refusing to replace it")
            shutil.rmtree(source_dir)
        stage_sources(source_dir, docs_dir)
        (source_dir / STAGING_MARKER).write_text("staged by decodespec.checks.docs; replaced on every build\n")
        write_generated_pages(source_dir)
        for name, text in (extra_pages or {}).items():
            (source_dir / name).write_text(text, encoding="utf-8")
        warnings = _run_sphinx(source_dir, out_dir, results_dir)
        coverage = read_coverage(out_dir)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return BuildResult(ok=not warnings and coverage.ok, out_dir=out_dir, source_dir=source_dir,
                       warnings=tuple(warnings), coverage=coverage, imports=imports)


def _run_sphinx(src: Path, out: Path, results_dir: Path) -> list[str]:
    from sphinx.cmd.build import build_main

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="decodespec-doctrees-") as doctrees:
        warn_file = Path(doctrees) / "warnings.txt"
        argv = ["-b", "html", "-E", "-W", "-q", "-N", "-w", str(warn_file), "-d", str(Path(doctrees) / "d"),
                "-D", f"decodespec_results_dir={results_dir}", str(src), str(out)]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), environment_variable("SOURCE_DATE_EPOCH", "0"):
            code = build_main(argv)
        warnings = [ln for ln in (warn_file.read_text(encoding="utf-8") if warn_file.exists() else "").splitlines() if ln.strip()]
        if code != 0 and not warnings:
            warnings = [ln for ln in stderr.getvalue().splitlines() if ln.strip()] or [f"sphinx exited with {code}"]
    return warnings


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` for the block (restored after)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


COVERAGE_FILE = Path("_decodespec") / "coverage.json"

#: Marks a staging folder as ours, so that a later build may replace it.
STAGING_MARKER = ".decodespec-docs-staging"


def read_coverage(out_dir: Path) -> Coverage:
    """Read ``<out_dir>/_decodespec/coverage.json`` written by the build and check it.

    Raises:
        DocsError: the file is absent (the build did not run the extension).
    """
    path = Path(out_dir) / COVERAGE_FILE
    if not path.is_file():
        raise DocsError(f"{path} not written: the decodespec Sphinx extension did not run")
    data = json.loads(path.read_text(encoding="utf-8"))
    return check_coverage(data["definitions"], [tuple(x) for x in data["references"]])


# --------------------------------------------------------------------------------------------
# Rule pages: the statement, the executed guard clauses, the implementing object
# --------------------------------------------------------------------------------------------

_STATEMENT_SPLIT = re.compile(r"(?is)^\s*guard\s*:\s*(?P<guard>.*?)\s*\beffect\s*:\s*(?P<effect>.*)$")


def split_statement(statement: str) -> list[tuple[str, str]]:
    """``[("Guard", ...), ("Effect", ...)]`` when the statement says so, else ``[("Statement", ...)]``."""
    m = _STATEMENT_SPLIT.match(statement)
    if m:
        return [("Guard", m["guard"].strip()), ("Effect", m["effect"].strip())]
    return [("Statement", statement.strip())]


def executable_guard(rule_id: str) -> list[tuple[str, str]]:
    """The guard clauses the request machine runs for a transition rule, in order: ``[(clause name, error code)]``.

    Read from :data:`decodespec.spec.transitions.TRANSITIONS` (the table row of ``rule_id``), so the docs show the
    executable clauses beside the prose statement (issue 17 item 6); ``[]`` for a rule that is no table row.
    """
    for row in TRANSITIONS:
        if row.rule_id == rule_id:
            return [(clause.name, clause.code) for clause in row.guard]
    return []


def implemented_by(obj: Any) -> str | None:
    """``module.qualname`` of a rule's registered object (``None`` when it has none)."""
    if obj is None:
        return None
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}"


def result_class(result: str) -> str:
    """The CSS class of a report result: ``pass``, ``fail``, ``deviation`` or ``other``."""
    r = result.lower()
    if r in ("pass", "passed", "ok"):
        return "pass"
    if r in ("fail", "failed", "error"):
        return "fail"
    if "deviation" in r or r in ("accepted", "xfail"):
        return "deviation"
    return "other"
