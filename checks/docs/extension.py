"""The Sphinx extension of the reviewer docs: the ``decodespec`` directives and roles, and the coverage check.

``docs/conf.py`` loads it (``extensions = [..., "decodespec.checks.docs.extension"]``);
:func:`decodespec.checks.docs.pages.build_site` stages the pages it renders.  A generated page
holds one directive per registered rule or code (``rule-def``, ``error-table``, ...), which
renders from :data:`decodespec.spec.rules.RULES` and :data:`decodespec.spec.errors.ERROR_CODES`
and records the definition; the ``{rule}`` and ``{error}`` roles record references.  At the end
of the read phase every registered id must be defined exactly once and every reference must
name a registered id (:func:`on_check_consistency`); the record is written to
``<out>/_decodespec/coverage.json`` (:func:`on_build_finished`).

Sphinx, docutils and MyST are the ``docs`` extra: without them this module does not import, and
:func:`~decodespec.checks.docs.pages.import_all` reports it skipped.

Source: research/formal-anchors-survey.md section 6 (rendered spec docs; SpecTec's ``-w``
check); aesthetics-survey.md 8.4 (splice rules by id, fail on unknown ids).

Size: the Sphinx extension: every directive, role and event handler of the reviewer docs registered
by one setup(), module-level functions each.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, SphinxRole
from sphinx.util.nodes import make_refnode

from decodespec.checks.commands import cli
from decodespec.spec.errors import ERROR_CODES
from decodespec.spec.rules import RULE_KINDS, RULES

from .pages import (
    COVERAGE_FILE,
    FRONTIER_BOUNDARIES,
    REPO_ROOT,
    Coverage,
    DocsError,
    ImportReport,
    check_coverage,
    commit_spine_graph,
    environment_variable,
    executable_guard,
    implemented_by,
    import_all,
    load_results,
    mentions_in_tests,
    phase_graph,
    preset_orders,
    registry_keys,
    render_svg,
    result_class,
    schema_rows,
    spec_frontier_observations,
    split_statement,
    to_dot,
)

__all__ = ["CSS", "DIRECTIVES", "setup"]

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


#: The stylesheet written to ``_static/decodespec.css`` (tables, diagrams, result colours).
CSS = """
.decodespec-diagram { overflow-x: auto; margin: 1em 0; }
.decodespec-diagram svg { max-width: 100%; height: auto; }
table.decodespec { font-size: 0.9em; width: 100%; }
div.body { max-width: none; }
table.decodespec td, table.decodespec th { vertical-align: top; }
table.decodespec ul span.pre { white-space: pre-wrap; overflow-wrap: anywhere; }
table.decodespec ul { margin: 0 0 0 1em; padding: 0; }
.decodespec-pass { color: #17631b; font-weight: bold; }
.decodespec-fail { color: #a3150b; font-weight: bold; }
.decodespec-deviation { color: #7a5a00; font-weight: bold; }
"""

logger = logging.getLogger("decodespec.docs")


# ---- node helpers ----------------------------------------------------------------------

def inline(text: str) -> list[Any]:
    """Docutils nodes of ``text``: plain text, and a literal for each backticked span."""
    out: list[Any] = []
    pos = 0
    for m in _CODE_SPAN.finditer(text):
        if m.start() > pos:
            out.append(nodes.Text(text[pos:m.start()]))
        out.append(nodes.literal(m.group(2), m.group(2)))
        pos = m.end()
    if pos < len(text):
        out.append(nodes.Text(text[pos:]))
    return out


def paragraphs(text: str) -> list[Any]:
    """One paragraph node per blank-line-separated paragraph of ``text`` (a dash when empty)."""
    paras = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return [nodes.paragraph("", "", *inline(" ".join(p.split()))) for p in paras] or [nodes.paragraph("", "—")]


def cell_content(value: Any) -> list[Any]:
    """The body of a table cell: a node, a list of nodes, or text (backticks become literals)."""
    if isinstance(value, nodes.Node):
        return [value if isinstance(value, (nodes.paragraph, nodes.bullet_list, nodes.literal_block)) else nodes.paragraph("", "", value)]
    if isinstance(value, list):
        return [v if isinstance(v, (nodes.paragraph, nodes.bullet_list)) else nodes.paragraph("", "", v) for v in value] or [nodes.paragraph("", "")]
    return [nodes.paragraph("", "", *inline(str(value)))] if str(value) else [nodes.paragraph("", "")]


def table(headers: Sequence[str] | None, rows: Sequence[Sequence[Any]], *, row_ids: Sequence[str | None] | None = None,
          widths: Sequence[int] | None = None, classes: Sequence[str] = ()) -> Any:
    """A ``decodespec`` table: optional header row, one row per entry of ``rows`` (ids from ``row_ids``), column ``widths``."""
    ncols = len(headers) if headers else (len(rows[0]) if rows else 1)
    tbl = nodes.table(classes=["decodespec", *classes])
    tgroup = nodes.tgroup(cols=ncols)
    tbl += tgroup
    for w in widths or [1] * ncols:
        tgroup += nodes.colspec(colwidth=w)
    if headers:
        thead = nodes.thead()
        tgroup += thead
        hrow = nodes.row()
        for h in headers:
            hrow += nodes.entry("", nodes.paragraph("", h))
        thead += hrow
    tbody = nodes.tbody()
    tgroup += tbody
    for idx, row in enumerate(rows):
        rnode = nodes.row()
        if row_ids and row_ids[idx]:
            rnode["ids"].append(row_ids[idx])
        for value in row:
            entry = nodes.entry()
            entry.extend(cell_content(value))
            rnode += entry
        tbody += rnode
    return tbl


def tests_list(ident: str, mentions: Mapping[str, list[str]]) -> Any:
    """The tests that name ``ident`` as a bullet list of literals (an emphasis when none does)."""
    tests = mentions.get(ident, [])
    if not tests:
        return nodes.emphasis("", "no test names this id yet")
    bl = nodes.bullet_list()
    for t in tests:
        bl += nodes.list_item("", nodes.paragraph("", "", nodes.literal(t, t)))
    return bl


def env_state(env: Any) -> dict[str, Any]:
    """The extension's state on the build environment (definitions, references, keys, imports, mentions)."""
    return env.decodespec  # set up in builder-inited


def xref(key: str, text: str, docname: str) -> Any:
    """A pending cross-reference to the definition of ``key`` (``rule:<id>`` / ``error:<code>``), resolved by :func:`on_missing_reference`."""
    return addnodes.pending_xref("", nodes.literal(text, text), refdomain="", reftype="decodespec",
                                 reftarget=key, refwarn=True, refdoc=docname)


def rule_link(ident: str, docname: str, text: str | None = None) -> Any:
    """A link to rule ``ident``'s definition (a literal when the id is not registered)."""
    text = text or ident
    return xref(f"rule:{ident}", text, docname) if ident in RULES else nodes.literal(text, text)


# ---- directives -----------------------------------------------------------------------

class Base(SphinxDirective):
    """A ``decodespec`` directive: :meth:`body` renders it; a failure warns with the directive's location and renders nothing."""

    has_content = False
    required_arguments = 0
    optional_arguments = 1
    final_argument_whitespace = False

    @property
    def state_(self) -> dict[str, Any]:
        return env_state(self.env)

    def define(self, key: str, anchor: str) -> None:
        """Record that this page defines ``key`` at ``anchor``."""
        self.state_["defs"].setdefault(key, []).append((self.env.docname, anchor))

    def warn(self, message: str) -> None:
        """A build warning at this directive (an error under ``-W``)."""
        logger.warning(message, location=self.get_location())

    def body(self) -> list[Any]:
        raise NotImplementedError

    def run(self) -> list[Any]:
        # a failure inside the spec or the explorer is reported as a build error with the
        # directive's location, not as a Sphinx crash that hides every other page
        try:
            return self.body()
        except DocsError as exc:
            self.warn(str(exc))
        except Exception as exc:  # noqa: BLE001 - a failing directive warns and renders nothing; the build goes on
            self.warn(f"{self.name} failed: {exc!r}")
        return []


class RuleDef(Base):
    """One rule: a section with its fields, and the anchor ``rule-<id>``."""

    required_arguments = 1
    optional_arguments = 0

    def body(self) -> list[Any]:
        ident = self.arguments[0]
        anchor = f"rule-{ident}"
        self.define(f"rule:{ident}", anchor)
        r = RULES.get(ident)
        section = nodes.section(ids=[anchor])
        if r is None:
            self.warn(f"rule-def names {ident!r}, which is not a registered rule")
            section += nodes.title("", "", nodes.literal(ident, ident))
            return [section]
        section += nodes.title("", "", nodes.literal(ident, ident), nodes.Text(f": {r.title}"))
        rows: list[list[Any]] = [["Kind", r.kind], ["Section", r.section]]
        for label, text in split_statement(r.statement):
            rows.append([label, paragraphs(text)])
        clauses = executable_guard(ident)
        if clauses:
            items = nodes.bullet_list()
            for name, code in clauses:
                items += nodes.list_item("", nodes.paragraph("", "", nodes.literal(name, name), nodes.Text(f"  (else {code})")))
            rows.append(["Guard clauses (executed, in order)", items])
        impl = implemented_by(r.obj)
        rows.append(["Implemented by", nodes.literal(impl, impl) if impl else "—"])
        rows.append(["Checked by", tests_list(ident, self.state_["mentions"])])
        section += table(None, rows, widths=[1, 5], classes=["decodespec-rule"])
        return [section]


class RuleIndex(Base):
    """A table of the rules of one kind, linking to their definitions."""

    required_arguments = 1
    optional_arguments = 0

    def body(self) -> list[Any]:
        kind = self.arguments[0]
        rules = [r for r in RULES.values() if r.kind == kind]
        mentions = self.state_["mentions"]
        rows = [[rule_link(r.id, self.env.docname), r.title, r.section, str(len(mentions.get(r.id, [])))] for r in rules]
        if not rows:
            return [nodes.paragraph("", f"No {kind} rule is registered yet.")]
        return [table(["Rule", "Title", "Section", "Tests"], rows, widths=[3, 4, 4, 1])]


class ErrorTable(Base):
    """All error codes of one area, each row anchored ``error-<code>``."""

    required_arguments = 1
    optional_arguments = 0

    def body(self) -> list[Any]:
        area = self.arguments[0]
        codes = [c for c in sorted(ERROR_CODES.values(), key=lambda c: c.code) if c.code.split(".", 1)[0] == area]
        if not codes:
            self.warn(f"error-table names area {area!r}, which has no registered code")
            return []
        ids = []
        for c in codes:
            self.define(f"error:{c.code}", f"error-{c.code}")
            ids.append(f"error-{c.code}")
        mentions = self.state_["mentions"]
        rows = [[nodes.literal(c.code, c.code), c.kind, c.section, paragraphs(c.description), tests_list(c.code, mentions)] for c in codes]
        return [table(["Code", "Kind", "Section", "Description", "Tests naming it"], rows, row_ids=ids, widths=[3, 2, 3, 5, 5])]


class PolicyPresets(Base):
    """The declared transform-order presets side by side."""

    def body(self) -> list[Any]:
        presets = preset_orders()
        if not presets:
            return [nodes.paragraph("", "", nodes.emphasis("", "No order preset is declared yet in decodespec.spec.policy."))]
        names = list(presets)
        doc = self.env.docname

        def step(name: str) -> Any:
            for kind in ("transform", "selector"):
                if f"{kind}.{name}" in RULES:
                    return rule_link(f"{kind}.{name}", doc, name)
            return nodes.literal(name, name)

        depth = max(len(v) for v in presets.values())
        seq_rows = [[str(i + 1)] + [step(presets[p][i]) if i < len(presets[p]) else "" for p in names] for i in range(depth)]
        steps: list[str] = []
        for p in names:
            for s in presets[p]:
                if s not in steps:
                    steps.append(s)
        pos_rows = [[step(s)] + [", ".join(str(i + 1) for i, x in enumerate(presets[p]) if x == s) or "—" for p in names] for s in steps]
        return [
            nodes.paragraph("", "", *inline(
                "Each column is one preset (`order` in the policy object); row i is the step it applies i-th. "
                "Each step links to its transform rule. Source: the presets declared in `decodespec.spec.policy`.")),
            table(["#"] + names, seq_rows),
            nodes.paragraph("", "The same data by step: the position of each step in each preset (— when absent)."),
            table(["Step"] + names, pos_rows),
        ]


class SchemaTable(Base):
    """The fields of a JSON Schema file, flattened."""

    required_arguments = 1
    optional_arguments = 0

    def body(self) -> list[Any]:
        rel, abspath = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(rel)
        try:
            schema = json.loads(Path(abspath).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            self.warn(f"cannot read schema {abspath}: {exc}")
            return []
        rows = [[nodes.literal(r.path, r.path), r.type, "yes" if r.required else "no", r.constraints, r.description]
                for r in schema_rows(schema)]
        head = [nodes.paragraph("", "", nodes.Text("Schema "), nodes.literal(str(schema.get("$id", "")), str(schema.get("$id", ""))),
                                nodes.Text(f" ({schema.get('$schema', 'JSON Schema')})."))]
        return head + [table(["Field", "Type", "Required", "Constraints", "Description"], rows, widths=[4, 2, 1, 4, 5])]


class FrontierTable(Base):
    """The M3.10 0x08 boundary table, the invariant recomputed and each row checked against the spec."""

    def body(self) -> list[Any]:
        observed, source = spec_frontier_observations()
        rows = []
        for idx, b in enumerate(FRONTIER_BOUNDARIES):
            if not b.balanced:
                self.warn(f"frontier table row {b.boundary!r} violates P + |U| = L + O")
            expected = (b.output_count, b.pending_len, b.processed_offset, b.processed_offset)
            if observed is None:
                verdict = "not checked"
            elif observed[idx] == {expected}:
                verdict = "agrees"
            else:
                got = sorted(observed[idx], key=str)
                verdict = f"DISAGREES: (O, |U|, P-L, K-L) = {got}"
                self.warn(f"the spec disagrees with the M3.10 0x08 boundary table at {b.boundary!r}: "
                          f"expected {expected}, reachable states give {got}")
            rows.append([b.boundary, str(b.output_count), b.pending, b.pending_tag, b.processed,
                         "holds" if b.balanced else "VIOLATED", b.event, f"{b.phase}: {verdict}"])
        check = (f"The last column is the spec's answer: {source}; every reachable state in the row's phase "
                 "with the row's O and U tag must have exactly the row's O, |U|, P and K = P."
                 if observed is not None else f"The rows are not checked against the spec: {source}.")
        return [
            table(["Boundary", "O", "U", "U tag", "P = K", "P + |U| = L + O", "Event leading here", "Spec states"], rows,
                  widths=[4, 1, 3, 3, 1, 2, 5, 3]),
            nodes.paragraph("", "", *inline(
                "Source: M3.10 0x08 \"Output, input, and cache frontiers\" (decoder-only prompt of length L, "
                "ordinary one-token decode, contiguous full-cache profile). The rows are transcribed from the "
                "seed in `decodespec.checks.docs.pages.FRONTIER_BOUNDARIES` because the spec does not expose the table "
                "as one object; the invariant column is recomputed from O, |U| and P for every row. " + check)),
        ]


class Diagram(Base):
    """An inline SVG diagram drawn by Graphviz from the spec's graph."""

    required_arguments = 1
    optional_arguments = 0

    def body(self) -> list[Any]:
        name = self.arguments[0]
        if name == "spine":
            graph, source = commit_spine_graph(), "drawn from the M3.10 0x08 boundary table below (FRONTIER_BOUNDARIES, each row checked against the spec's reachable states)"
            rankdir = "TB"
        elif name == "phases":
            graph, source = phase_graph()
            rankdir = "TB"
        else:
            self.warn(f"unknown diagram {name!r} (phases, spine)")
            return []
        if graph is None:
            return [nodes.note("", nodes.paragraph("", f"Phase diagram not drawn: {source}."))]
        try:
            svg = render_svg(to_dot(graph, rankdir=rankdir))
        except DocsError as exc:
            self.warn(str(exc))
            return []
        html = f'<div class="decodespec-diagram" id="diagram-{name}">\n{svg}\n</div>\n'
        return [nodes.raw("", html, format="html"), nodes.paragraph("", f"Diagram {source}.")]


class ConformanceResults(Base):
    """The latest conformance results per runtime (Bowtie / test262 style)."""

    def body(self) -> list[Any]:
        results, _ = load_results(Path(self.config.decodespec_results_dir))
        if not results:
            return [nodes.paragraph("", "", nodes.strong("", "No results yet."),
                                    nodes.Text(" Run `decodespec check --report docs/results/<runtime>.jsonl`."))]
        runtimes = sorted({r.runtime for r in results})
        out: list[Any] = [nodes.rubric("", "Summary per runtime")]
        summary = []
        for rt in runtimes:
            mine = [r for r in results if r.runtime == rt]
            counts = {k: sum(1 for r in mine if result_class(r.result) == k) for k in ("pass", "fail", "deviation", "other")}
            summary.append([rt, str(counts["pass"]), str(counts["fail"]), str(counts["deviation"]), str(counts["other"]), str(len(mine))])
        out.append(table(["Runtime", "pass", "fail", "accepted deviation", "other", "cases"], summary))
        out.append(nodes.rubric("", "Case by runtime"))
        cases = sorted({r.case for r in results})
        latest = {(r.runtime, r.case): r for r in results}

        def cell(rt: str, case: str) -> Any:
            r = latest.get((rt, case))
            if r is None:
                return "—"
            text = r.result + (f" ({r.layer})" if r.layer and result_class(r.result) != "pass" else "")
            return nodes.inline(text, text, classes=[f"decodespec-{result_class(r.result)}"])

        out.append(table(["Case"] + runtimes, [[nodes.literal(c, c)] + [cell(rt, c) for rt in runtimes] for c in cases]))
        failing = [r for r in results if result_class(r.result) != "pass"]
        if failing:
            out.append(nodes.rubric("", "Failures and deviations"))
            out.append(table(["Runtime", "Case", "Result", "Layer", "Expected", "Actual", "Report line"],
                             [[r.runtime, nodes.literal(r.case, r.case), r.result, r.layer, nodes.literal(r.expected, r.expected),
                               nodes.literal(r.actual, r.actual), r.source] for r in failing]))
        return out


class MutantResults(Base):
    """Failure-lab results: which check killed each mutant."""

    def body(self) -> list[Any]:
        _, lines = load_results(Path(self.config.decodespec_results_dir))
        if not lines:
            return [nodes.paragraph("", "", nodes.strong("", "No failure-lab results yet."))]
        rows = []
        for line in lines:
            ident = str(line["mutant"])
            key = f"rule:{ident}"
            self.state_["refs"].append((key, self.env.docname))
            if key not in self.state_["keys"]:
                self.warn(f"{line['_source']}: mutant {ident!r} is not a registered rule")
            killed = line.get("killed")
            rows.append([rule_link(ident, self.env.docname), "killed" if killed else ("SURVIVED" if killed is False else "?"),
                         str(line.get("killed_by", "")), line["_source"]])
        return [table(["Mutant", "Outcome", "Killed by", "Report line"], rows)]


class CliReference(Base):
    """``--help`` of every registered ``decodespec`` subcommand."""

    def body(self) -> list[Any]:

        with environment_variable("COLUMNS", "100"):
            parser = cli.build_parser()
            sub = next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)
            choices = dict(sub.choices) if sub is not None else {}
            out: list[Any] = [nodes.literal_block(parser.format_usage(), parser.format_usage(), language="text")]
            if not choices:
                return out + [nodes.paragraph("", "No subcommand is registered yet.")]
            for name, sp in choices.items():
                section = nodes.section(ids=[f"cli-{name}"])
                section += nodes.title("", "", nodes.literal(f"decodespec {name}", f"decodespec {name}"))
                text = sp.format_help()
                section += nodes.literal_block(text, text, language="text")
                out.append(section)
        return out


class GenerationReport(Base):
    """What was imported, what is covered by tests, and the page syntax."""

    def body(self) -> list[Any]:
        st = self.state_
        report: ImportReport = st["imports"]
        mentions = st["mentions"]
        out: list[Any] = [nodes.rubric("", "Registries")]
        rows = []
        for kind in RULE_KINDS:
            ids = [r.id for r in RULES.values() if r.kind == kind]
            rows.append([kind, str(len(ids)), str(sum(1 for i in ids if i in mentions))])
        rows.append(["error codes", str(len(ERROR_CODES)), str(sum(1 for c in ERROR_CODES if c in mentions))])
        out.append(table(["Kind", "Registered", "Named by a test"], rows))
        untested = [r.id for r in RULES.values() if r.id not in mentions] + [c for c in sorted(ERROR_CODES) if c not in mentions]
        out.append(nodes.rubric("", "Registered ids that no test names"))
        if untested:
            bl = nodes.bullet_list()
            for ident in untested:
                link = rule_link(ident, self.env.docname) if ident in RULES else xref(f"error:{ident}", ident, self.env.docname)
                bl += nodes.list_item("", nodes.paragraph("", "", link))
            out.append(bl)
        else:
            out.append(nodes.paragraph("", "None."))
        out.append(nodes.rubric("", "Modules imported for registration"))
        out.append(nodes.paragraph("", "", nodes.literal(", ".join(report.imported), ", ".join(report.imported))))
        if report.skipped:
            out.append(nodes.rubric("", "Modules skipped"))
            out.append(table(["Module", "Why"], [[nodes.literal(m, m), why] for m, why in report.skipped]))
        return out


# ---- roles ----------------------------------------------------------------------------

class RefRole(SphinxRole):
    """``{rule}`ID``` / ``{error}`CODE```: a link to the definition; an unregistered id warns and renders as a literal."""

    def __init__(self, category: str):
        super().__init__()
        self.category = category

    def run(self) -> tuple[list[Any], list[Any]]:
        ident = self.text.strip()
        key = f"{self.category}:{ident}"
        st = env_state(self.env)
        st["refs"].append((key, self.env.docname))
        if key not in st["keys"]:
            logger.warning(f"{{{self.category}}}`{ident}` names an id that is not registered", location=self.get_location())
            return [nodes.literal(ident, ident)], []
        return [xref(key, ident, self.env.docname)], []


# ---- events ---------------------------------------------------------------------------

def on_builder_inited(app_: Any) -> None:
    """Import every module (registrations), and record the registry keys and which tests name each id."""
    imports = import_all()
    keys = registry_keys()
    ids = list(RULES) + list(ERROR_CODES)
    app_.env.decodespec = {"defs": {}, "refs": [], "keys": keys, "imports": imports,
                           "mentions": mentions_in_tests(REPO_ROOT, ids)}
    if not app_.config.decodespec_results_dir:
        app_.config.decodespec_results_dir = str(REPO_ROOT / "docs" / "results")


def on_purge(app_: Any, env: Any, docname: str) -> None:
    """Forget the definitions and references of a re-read page."""
    st = getattr(env, "decodespec", None)
    if st is None:
        return
    for key in list(st["defs"]):
        st["defs"][key] = [d for d in st["defs"][key] if d[0] != docname]
    st["refs"] = [r for r in st["refs"] if r[1] != docname]


def on_missing_reference(app_: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve a ``decodespec`` cross-reference to the page and anchor that defines it."""
    if node.get("reftype") != "decodespec":
        return None
    entries = env.decodespec["defs"].get(node["reftarget"], [])
    if not entries:
        return None
    docname, anchor = entries[0]
    return make_refnode(app_.builder, node["refdoc"], docname, anchor, contnode, node["reftarget"])


def coverage_of(env: Any) -> Coverage:
    """The definitions and references recorded so far, checked (:func:`~decodespec.checks.docs.pages.check_coverage`)."""
    st = env.decodespec
    defs = {k: [d for d, _a in v] for k, v in st["defs"].items()}
    return check_coverage(defs, st["refs"])


def on_check_consistency(app_: Any, env: Any) -> None:
    """Warn on every undocumented, twice-documented or unknown id (errors under ``-W``)."""
    if not app_.config.decodespec_strict_coverage:
        return
    for problem in coverage_of(env).problems():
        logger.warning(f"docs coverage: {problem}")


def on_build_finished(app_: Any, exc: Any) -> None:
    """Write ``_decodespec/coverage.json`` and the stylesheet into the output folder."""
    env = app_.env
    if getattr(env, "decodespec", None) is None:
        return
    st = env.decodespec
    data = {
        "definitions": {k: [d for d, _a in v] for k, v in sorted(st["defs"].items()) if v},
        "references": sorted(set(st["refs"])),
    }
    path = Path(app_.outdir) / COVERAGE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    static = Path(app_.outdir) / "_static"
    static.mkdir(parents=True, exist_ok=True)
    (static / "decodespec.css").write_text(CSS, encoding="utf-8")


#: Directive name -> class, as :func:`setup` registers them.
DIRECTIVES: dict[str, type[Base]] = {
    "rule-def": RuleDef, "rule-index": RuleIndex, "error-table": ErrorTable, "policy-presets": PolicyPresets,
    "schema-table": SchemaTable, "frontier-table": FrontierTable, "decodespec-diagram": Diagram,
    "conformance-results": ConformanceResults, "mutant-results": MutantResults, "cli-reference": CliReference,
    "generation-report": GenerationReport,
}


def setup(app: Sphinx) -> dict[str, Any]:
    """Sphinx entry point: the ``decodespec`` directives and roles, and the coverage check.

    Directives (:data:`DIRECTIVES`): ``rule-def ID``, ``rule-index KIND``, ``error-table AREA``,
    ``policy-presets``, ``schema-table FILE``, ``frontier-table``, ``decodespec-diagram
    phases|spine``, ``conformance-results``, ``mutant-results``, ``cli-reference``,
    ``generation-report``.  Roles: ``rule`` and ``error`` (links; unknown ids are build
    warnings).  Config: ``decodespec_results_dir`` (default ``<repo>/docs/results``),
    ``decodespec_strict_coverage`` (default ``True``: undocumented, twice-documented or unknown
    ids are warnings, hence errors under ``-W``).
    """
    app.add_config_value("decodespec_results_dir", "", "env", types=frozenset({str}))
    app.add_config_value("decodespec_strict_coverage", True, "env", types=frozenset({bool}))
    for name, cls in DIRECTIVES.items():
        app.add_directive(name, cls)
    app.add_role("rule", RefRole("rule"))
    app.add_role("error", RefRole("error"))
    app.add_css_file("decodespec.css")
    app.connect("builder-inited", on_builder_inited)
    app.connect("env-purge-doc", on_purge)
    app.connect("missing-reference", on_missing_reference)
    app.connect("env-check-consistency", on_check_consistency)
    app.connect("build-finished", on_build_finished)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True, "env_version": 1}
