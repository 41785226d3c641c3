"""The reviewer docs (issue 10): generated from the registries, complete, each id documented once.

The site is built once per module (Sphinx + MyST, warnings as errors) and inspected: the
coverage record the build writes, the HTML anchors, the diagrams, the hand-written pages'
``{rule}`` / ``{error}`` references.  A second build plants a duplicated definition, an unknown
reference and result files, and must fail.  Counts of rules are never asserted: other modules
register rules as they land; coverage is asserted against whatever is registered.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import networkx as nx
import pytest

from decodespec.checks.docs import pages as docs
from decodespec.checks.docs.pages import (
    FRONTIER_BOUNDARIES,
    DocsError,
    build_site,
    check_coverage,
    commit_spine_graph,
    load_results,
    mentions_in_tests,
    preset_orders,
    render_svg,
    scan_references,
    schema_rows,
    to_dot,
)
from decodespec.spec.errors import ERROR_CODES, ErrorCode
from decodespec.spec.rules import RULES, Rule

pytestmark = [
    pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' not installed: apt-get install graphviz"),
]

HAND_WRITTEN = sorted((docs.REPO_ROOT / "docs").glob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> docs.BuildResult:
    """The site built once, with an empty results folder."""
    root = tmp_path_factory.mktemp("site")
    (root / "results").mkdir()
    return build_site(root / "html", results_dir=root / "results", source_dir=root / "src")


def _html(site: docs.BuildResult, page: str) -> str:
    return (site.out_dir / page).read_text(encoding="utf-8")


def _all_html(site: docs.BuildResult) -> dict[str, str]:
    return {p.relative_to(site.out_dir).as_posix(): p.read_text(encoding="utf-8")
            for p in site.out_dir.rglob("*.html")}


# ----------------------------------------------------------------------------------------------
# The built site
# ----------------------------------------------------------------------------------------------


def test_site_builds_without_warnings(site: docs.BuildResult) -> None:
    assert site.warnings == (), "\n".join(site.warnings)
    assert site.coverage.ok, "\n".join(site.coverage.problems())
    assert site.ok
    assert (site.out_dir / "index.html").is_file()


def test_every_rule_and_code_is_defined_exactly_once(site: docs.BuildResult) -> None:
    """Each registered rule (every kind: transition, invariant, mutant, ...) and error code is
    defined by exactly one page, both in the build's record and in the HTML anchors."""
    record = json.loads((site.out_dir / "_decodespec" / "coverage.json").read_text())
    expected = {f"rule:{r}" for r in RULES} | {f"error:{c}" for c in ERROR_CODES}
    assert set(record["definitions"]) == expected
    assert all(len(pages) == 1 for pages in record["definitions"].values())
    anchors: dict[str, int] = {}
    for text in _all_html(site).values():
        # definition anchors are rule-<id> / error-<code>; ids always contain a dot, heading
        # slugs (e.g. design.md's "rule-registry-spec-rules-py") never do
        for anchor in re.findall(r'id="((?:rule|error)-[^"]*\.[^"]*)"', text):
            anchors[anchor] = anchors.get(anchor, 0) + 1
    assert set(anchors) == {f"rule-{r}" for r in RULES} | {f"error-{c}" for c in ERROR_CODES}
    assert all(n == 1 for n in anchors.values()), {a: n for a, n in anchors.items() if n != 1}


def test_rules_land_on_the_page_of_their_kind(site: docs.BuildResult) -> None:
    record = json.loads((site.out_dir / "_decodespec" / "coverage.json").read_text())
    for rid, rule in RULES.items():
        page = docs.KIND_PAGES.get(rule.kind, docs.OTHER_RULES_PAGE)
        assert record["definitions"][f"rule:{rid}"] == [f"generated/{page}"]
    for code in ERROR_CODES:
        assert record["definitions"][f"error:{code}"] == ["generated/errors"]


def test_rule_sections_show_section_statement_and_implementation(site: docs.BuildResult) -> None:
    for rid, rule in RULES.items():
        page = _html(site, f"generated/{docs.KIND_PAGES.get(rule.kind, docs.OTHER_RULES_PAGE)}.html")
        start = page.index(f'id="rule-{rid}"')
        end = page.find('<section id="rule-', start + 1)
        block = page[start:end if end != -1 else len(page)]
        assert rule.title.split()[0] in block
        assert rule.section.split()[0] in block
        implemented_by = docs.implemented_by(rule.obj)
        if implemented_by is not None:
            assert implemented_by in block
        text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", block)).split())
        for name, code in docs.executable_guard(rid):  # the clauses the machine runs, not only the prose guard
            assert " ".join(name.split()) in text and code in text, (rid, name)


def test_every_transition_row_renders_its_executable_clauses() -> None:
    from decodespec.spec.transitions import TRANSITIONS

    rows = [row for row in TRANSITIONS if row.guard]
    assert rows and all(docs.executable_guard(row.rule_id)[: len(row.guard)] for row in rows)
    launch = docs.executable_guard("transition.launch_prefill")
    assert ("phase == READY", "transition.not_enabled") in launch and any(n.startswith("P < L") for n, _ in launch), launch
    assert docs.executable_guard("invariant.no_such_rule") == []


def test_error_codes_grouped_by_area(site: docs.BuildResult) -> None:
    page = _html(site, "generated/errors.html")
    for code, entry in ERROR_CODES.items():
        area = code.split(".", 1)[0]
        heading = page.index(f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{area}.*</span></code>")
        row = page.index(f'id="error-{code}"')
        assert row > heading
        assert entry.kind in page[row:row + 2000]


def test_state_machine_page_has_the_commit_spine_svg(site: docs.BuildResult) -> None:
    page = _html(site, "generated/state-machine.html")
    m = re.search(r'<div class="decodespec-diagram" id="diagram-spine">(.*?)</div>', page, re.DOTALL)
    assert m and m.group(1).lstrip().startswith("<svg")
    # one <g class="node"> per spine node, one edge group per edge
    graph = commit_spine_graph()
    assert m.group(1).count('class="node"') == graph.number_of_nodes()
    assert m.group(1).count('class="edge"') == graph.number_of_edges()
    for b in FRONTIER_BOUNDARIES:
        assert b.pending_tag in m.group(1)


def test_phase_diagram_is_drawn_from_the_explorer(site: docs.BuildResult) -> None:
    page = _html(site, "generated/state-machine.html")
    try:
        import decodespec.checks.modelcheck.explore  # noqa: F401 - is the explorer importable?
    except ImportError:
        assert "Phase diagram not drawn" in page
        return
    graph, _source = docs.phase_graph()
    assert graph is not None
    m = re.search(r'<div class="decodespec-diagram" id="diagram-phases">(.*?)</div>', page, re.DOTALL)
    assert m and m.group(1).lstrip().startswith("<svg")
    assert m.group(1).count('class="node"') == graph.number_of_nodes()
    assert m.group(1).count('class="edge"') == graph.number_of_edges()
    from decodespec.spec.state import Phase

    # every phase of the spec is reachable in some configuration, and each phase edge names
    # registered transition rules
    assert set(graph.nodes) == {p.value for p in Phase}
    for _u, _v, data in graph.edges(data=True):
        for name in data["label"].split("\n"):
            assert f"transition.{name}" in RULES


def test_phase_graph_reports_refused_configurations() -> None:
    pytest.importorskip("decodespec.checks.modelcheck.explore")
    graph, source = docs.phase_graph([{"no_such_bound": 1}, {}])
    assert graph is not None and "refused" in source and "no_such_bound" in source
    with pytest.raises(DocsError, match="refused every"):
        docs.phase_graph([{"no_such_bound": 1}])


def test_spec_agrees_with_the_seed_frontier_table() -> None:
    """invariant.frontiers_balance / invariant.cache_frontier_equals_processed at the M3.10 0x08
    boundaries: every reachable spec state at a boundary has the seed row's O, |U|, P and K."""
    observed, source = docs.spec_frontier_observations()
    assert observed is not None, source  # the explorer ships with the package: its absence is a failure, not a skip
    for b, seen in zip(FRONTIER_BOUNDARIES, observed):
        assert seen == {(b.output_count, b.pending_len, b.processed_offset, b.processed_offset)}, b.boundary


def test_frontier_column_reports_agreement(site: docs.BuildResult) -> None:
    page = _html(site, "generated/state-machine.html")
    observed, _ = docs.spec_frontier_observations()
    expected = "agrees" if observed is not None else "not checked"
    assert page.count(expected) >= len(FRONTIER_BOUNDARIES)
    assert "DISAGREES" not in page


def test_no_results_yet(site: docs.BuildResult) -> None:
    assert "No results yet." in _html(site, "generated/results.html")
    assert "No failure-lab results yet." in _html(site, "generated/failure-lab.html")


def test_envelope_page_renders_the_schema_when_present(site: docs.BuildResult) -> None:
    schema_path = docs.REPO_ROOT / "spec" / "schemas" / "request.v1.json"
    page = _html(site, "generated/envelope.html")
    if not schema_path.is_file():
        assert "not present yet" in page
        return
    schema = json.loads(schema_path.read_text())
    for row in schema_rows(schema):
        assert html.escape(row.path, quote=False) in page, row.path


def test_policy_presets_side_by_side(site: docs.BuildResult) -> None:
    presets = preset_orders()
    page = _html(site, "generated/policy.html")
    if not presets:
        assert "No order preset is declared yet" in page
        return
    for name, steps in presets.items():
        assert f"<th class=\"head\"><p>{name}</p></th>" in page
        for step in steps:
            assert step in page


def test_cli_page_lists_registered_commands(site: docs.BuildResult) -> None:
    from decodespec.checks.commands.cli import COMMANDS

    page = _html(site, "generated/cli.html")
    for name in COMMANDS:
        assert f'id="cli-{name}"' in page
    assert "--out DIR" in page  # the docs command's own help


def test_design_and_guides_are_in_the_site(site: docs.BuildResult) -> None:
    index = _html(site, "index.html")
    for page in ("quickstart", "adapters", "glossary", "design"):
        assert f'href="{page}.html"' in index
    glossary = _html(site, "glossary.html")
    for term in ("B", "T", "L", "O", "U", "P", "K", "V", "H", "H_kv", "D", "S", "G", "ALL_NEW", "ALL_OLD", "receipt"):
        assert f'id="term-{term}"' in glossary, term


# ----------------------------------------------------------------------------------------------
# Hand-written pages name only registered ids
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=lambda p: p.name)
def test_hand_written_pages_name_only_registered_ids(page: Path) -> None:
    docs.import_all()
    text = page.read_text(encoding="utf-8")
    for role, ident in scan_references(text):
        registry = RULES if role == "rule" else ERROR_CODES
        assert ident in registry, f"{page.name} names {{{role}}}`{ident}`, which is not registered"
    assert docs.scan_definitions(text) == [], f"{page.name} defines a rule; only generated pages do"


def test_scan_references_syntax() -> None:
    text = (
        "See {rule}`transition.sample_a` and {error}`envelope.sample_b`; plain `invariant.x` is code,\n"
        "and so is ``{rule}`invariant.in_code` ``.\n\n"
        "```python\n{rule}`invariant.in_block`\n```\n\n"
        "```{note}\n:class: tip\nInside a directive: {rule}`mutant.inside`.\n```\n"
    )
    assert scan_references(text) == [("rule", "transition.sample_a"), ("error", "envelope.sample_b"),
                                     ("rule", "mutant.inside")]


# ----------------------------------------------------------------------------------------------
# The build fails on planted mistakes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[docs.BuildResult, str]:
    """A build with a twice-defined rule, an unknown reference, and result files."""
    docs.import_all()
    assert RULES, "the registries are empty: docs.import_all() registered no rule"
    victim = next(iter(RULES))
    root = tmp_path_factory.mktemp("planted")
    results = root / "results"
    results.mkdir()
    (results / "impl.jsonl").write_text(
        json.dumps({"case": "greedy-eos", "result": "pass", "layer": "SEQUENCE", "expected": [1, 2], "actual": [1, 2]}) + "\n"
        + json.dumps({"case": "chunked-prefill", "result": "fail", "layer": "TENSOR", "expected": 0.5, "actual": 0.75}) + "\n"
    )
    (results / "peers.jsonl").write_text(
        json.dumps({"runtime": "hf", "case": "greedy-eos", "result": "deviation", "layer": "POLICY",
                    "expected": "top_k then top_p", "actual": "top_p then top_k"}) + "\n"
        + json.dumps({"mutant": "mutant.does_not_exist", "killed": True, "killed_by": "ladder.STATE"}) + "\n"
    )
    page = (
        "# Planted\n\n"
        f"```{{rule-def}} {victim}\n```\n\n"
        "See {rule}`transition.no_such_rule` and {error}`envelope.no_such_code`.\n"
    )
    # a copy of docs/ with one more hand-written page that names a registered rule
    docs_dir = root / "docs"
    shutil.copytree(docs.REPO_ROOT / "docs", docs_dir, ignore=shutil.ignore_patterns("results", "examples"))
    (docs_dir / "extra-notes.md").write_text(f"# Extra notes\n\nThe rule {{rule}}`{victim}` matters.\n")
    result = build_site(root / "html", docs_dir=docs_dir, results_dir=results, source_dir=root / "src",
                        extra_pages={"planted.md": page})
    return result, victim


def test_planted_mistakes_fail_the_build(planted: tuple[docs.BuildResult, str]) -> None:
    result, victim = planted
    assert not result.ok
    duplicated = dict(result.coverage.duplicated)
    assert sorted(duplicated[f"rule:{victim}"]) == sorted(
        ["planted", "generated/" + docs.KIND_PAGES.get(RULES[victim].kind, docs.OTHER_RULES_PAGE)])
    assert ("rule:transition.no_such_rule", "planted") in result.coverage.unknown_references
    assert ("error:envelope.no_such_code", "planted") in result.coverage.unknown_references
    joined = "\n".join(result.warnings)
    assert "transition.no_such_rule" in joined
    assert "mutant.does_not_exist" in joined  # a results line naming an unregistered mutant


def test_extra_hand_written_page_is_listed_and_links_resolve(planted: tuple[docs.BuildResult, str]) -> None:
    result, victim = planted
    more = (result.out_dir / "generated" / "more.html").read_text(encoding="utf-8")
    assert 'href="../extra-notes.html"' in more
    extra = (result.out_dir / "extra-notes.html").read_text(encoding="utf-8")
    page = docs.KIND_PAGES.get(RULES[victim].kind, docs.OTHER_RULES_PAGE)
    assert f'href="generated/{page}.html#rule-{victim}"' in extra
    assert (f"rule:{victim}", "extra-notes") not in result.coverage.unknown_references


def test_results_table(planted: tuple[docs.BuildResult, str]) -> None:
    result, _ = planted
    page = (result.out_dir / "generated" / "results.html").read_text(encoding="utf-8")
    assert "No results yet." not in page
    for needle in ("impl", "hf", "greedy-eos", "chunked-prefill", "decodespec-pass", "decodespec-fail", "decodespec-deviation"):
        assert needle in page
    lab = (result.out_dir / "generated" / "failure-lab.html").read_text(encoding="utf-8")
    assert "mutant.does_not_exist" in lab and "killed" in lab


# ----------------------------------------------------------------------------------------------
# Pure helpers
# ----------------------------------------------------------------------------------------------


def _rule(rid: str) -> Rule:
    return Rule(id=rid, kind=rid.split(".")[0], title="t", section="M3.10 0x08", statement="s")


def test_check_coverage_finds_missing_duplicated_and_unknown() -> None:
    rules = {r: _rule(r) for r in ("transition.a", "invariant.b", "mutant.c")}
    codes = {"envelope.x": ErrorCode("envelope.x", "rejection", "M3.10", "d")}
    ok = check_coverage({"rule:transition.a": ["p"], "rule:invariant.b": ["p"], "rule:mutant.c": ["q"],
                         "error:envelope.x": ["e"]}, [("rule:transition.a", "i")], rules=rules, codes=codes)
    assert ok.ok and ok.problems() == []
    bad = check_coverage({"rule:transition.a": ["p", "q"], "rule:invariant.zz": ["p"], "error:envelope.x": ["e"]},
                         [("rule:nope.x", "i"), ("rule:mutant.c", "i")], rules=rules, codes=codes)
    assert bad.missing == ("rule:invariant.b", "rule:mutant.c")
    assert bad.duplicated == (("rule:transition.a", ("p", "q")),)
    assert bad.unknown_definitions == ("rule:invariant.zz",)
    assert bad.unknown_references == (("rule:nope.x", "i"),)
    assert bad.undefined_references == (("rule:mutant.c", "i"),)
    assert len(bad.problems()) == 6


def test_frontier_table_keeps_the_invariant() -> None:
    """invariant P + |U| = L + O holds on every row of the M3.10 0x08 table, and U's tag matches |U|."""
    assert all(b.balanced for b in FRONTIER_BOUNDARIES)
    for b in FRONTIER_BOUNDARIES:
        assert (b.pending_len == 0) == (b.pending_tag == "EMPTY")
    broken = docs.FrontierBoundary("x", 1, "empty", 0, "EMPTY", 0, "e", "ready")
    assert not broken.balanced
    assert [b.processed for b in FRONTIER_BOUNDARIES] == ["L", "L", "L+1", "L+1", "L+1", "L+2"]


def test_commit_spine_graph_is_a_path_with_all_old_loops() -> None:
    g = commit_spine_graph()
    spine = nx.DiGraph([(u, v) for u, v in g.edges if u != v])
    assert nx.is_directed_acyclic_graph(spine)
    assert list(nx.topological_sort(spine)) == ["admitted"] + [f"b{i}" for i in range(len(FRONTIER_BOUNDARIES))]
    loops = sorted(u for u, v in g.edges if u == v)
    assert loops == ["admitted", "b1", "b3"]  # where a call is launched next


def test_to_dot_quotes_and_render_svg() -> None:
    g = nx.DiGraph(name='a "b"')
    g.add_node(1, label='say "hi"\nnext')
    g.add_edge(1, 1, label="back\\slash", style="dashed")
    g.add_node(2, rank="sink")
    dot = to_dot(g)
    assert '"say \\"hi\\"\\nnext"' in dot and '"back\\\\slash"' in dot
    assert "{rank=sink; n1;}" in dot
    svg = render_svg(dot)
    assert svg.startswith("<svg") and "say &quot;hi&quot;" in svg and "<!--" not in svg
    with pytest.raises(DocsError):
        render_svg("digraph { this is not dot")


def test_render_svg_without_dot_is_a_clear_missing_component(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docs.shutil, "which", lambda _name: None)
    with pytest.raises(DocsError, match="graphviz") as info:
        render_svg("digraph {}")
    assert info.value.missing_component
    with pytest.raises(DocsError, match="dot"):
        build_site(Path("/nonexistent-out"))


def test_build_refuses_to_replace_a_foreign_source_folder(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DocsError, match="refusing"):
        build_site(tmp_path / "html", source_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_cli_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from decodespec.checks.commands.cli import main

    monkeypatch.setattr(docs.shutil, "which", lambda _name: None)
    assert main(["docs", "--out", str(tmp_path / "html")]) == 3  # a missing component
    assert "graphviz" in capsys.readouterr().err
    monkeypatch.undo()
    foreign = tmp_path / "src"
    foreign.mkdir()
    (foreign / "x.txt").write_text("x")
    assert main(["docs", "--out", str(tmp_path / "html"), "--keep-source", str(foreign)]) == 1
    assert "refusing" in capsys.readouterr().err


def test_schema_rows_flatten_refs_items_and_alternatives() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {
            "a": {"$ref": "#/$defs/ids"},
            "b": {"type": "object", "properties": {"t": {"oneOf": [
                {"type": "object", "properties": {"name": {"const": "top_k"}, "k": {"type": "integer", "minimum": 1}}},
                {"type": "object", "properties": {"name": {"const": "top_p"}}},
            ]}}},
        },
        "$defs": {"ids": {"type": "array", "maxItems": 8, "items": {"type": "integer", "minimum": 0}, "description": "token ids"}},
    }
    rows = {r.path: r for r in schema_rows(schema)}
    assert rows["$"].constraints == "closed (no other fields)"
    assert rows["$.a"].required and rows["$.a"].type == "array" and "maxItems=8" in rows["$.a"].constraints
    assert rows["$.a"].description == "token ids"
    assert rows["$.a[]"].constraints == "minimum=0"
    assert not rows["$.b"].required
    assert rows["$.b.t<name=top_k>.k"].constraints == "minimum=1"
    assert "$.b.t<name=top_p>.name" in rows


def test_load_results(tmp_path: Path) -> None:
    assert load_results(tmp_path / "absent") == ([], [])
    (tmp_path / "impl.jsonl").write_text('{"case": "c", "result": "pass"}\n\n{"mutant": "mutant.m", "killed": false}\n')
    conf, lab = load_results(tmp_path)
    assert [(r.runtime, r.case, r.result) for r in conf] == [("impl", "c", "pass")]
    assert lab[0]["mutant"] == "mutant.m" and lab[0]["_source"] == "impl.jsonl:3"
    (tmp_path / "bad.jsonl").write_text('{"result": "pass"}\n')
    with pytest.raises(DocsError, match="bad.jsonl:1"):
        load_results(tmp_path)


def test_mentions_in_tests(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Module about invariant.b."""\n'
        "def test_one():\n    '''transition.a is checked.'''\n    assert 'envelope.x'\n\n"
        "def helper():\n    'transition.a'\n\n"
        "class TestK:\n    def test_two(self):\n        'transition.ab is another id'\n"
    )
    found = mentions_in_tests(tmp_path, ["transition.a", "invariant.b", "envelope.x", "mutant.c"])
    assert found == {
        "envelope.x": ["tests/test_x.py::test_one"],
        "invariant.b": ["tests/test_x.py"],
        "transition.a": ["tests/test_x.py::test_one"],
    }


def test_preset_orders_mirror_the_policy_package() -> None:
    from decodespec.spec import policy

    declared = policy.PRESET_ORDERS
    presets = preset_orders()
    for key, steps in declared.items():
        assert presets[getattr(key, "value", key)] == tuple(steps)


def test_import_all_reports_a_broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "dsbrokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("X = 1\n")
    (pkg / "optional.py").write_text("import surely_not_installed_pkg_xyz\n")
    (pkg / "test_skipped.py").write_text("raise RuntimeError('test modules are not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = docs.import_all(["dsbrokenpkg"])
    assert "dsbrokenpkg.fine" in report.imported
    assert report.skipped == (("dsbrokenpkg.optional", "optional dependency 'surely_not_installed_pkg_xyz' is not installed"),)
    (pkg / "broken.py").write_text("raise ValueError('boom')\n")
    with pytest.raises(DocsError, match="dsbrokenpkg.broken"):
        docs.import_all(["dsbrokenpkg"])
