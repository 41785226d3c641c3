"""The conformance matrix: every gate case and machine against every runtime, from the gate's report files.

Rows are the cases and machines (``case``, with the model in brackets when it is not the
file's main model, e.g. ``machine.none [tiny]``); columns are the runtimes that have a report
under ``docs/results/`` (``impl``, ``hf``, ``llamacpp``, ``vllm`` first, then any other, e.g. a
user's ``stdio:CMD`` run written with ``--report``).  A cell is the case's result on that
runtime -- ``pass``, ``deviation`` (documented in ``checks/gate/expectations/<runtime>.toml``),
``undecided`` (the reference margin cannot decide), ``fail``, ``skip`` (the runtime does not
declare what the case needs, or refuses it) or ``-`` (not in that report) -- with the ladder
layer of a result that is not a pass, and a key into the reasons: the deviation's id (its
reason, the peer's and the spec's behaviour, the committed trace) or the skip / failure
message.  A case that ran more than once in a report (the machines run per model) shows the
worst result first (``fail`` > ``undecided`` > ``deviation`` > ``pass`` > ``skip``).

Summaries: per runtime, the count of each result, the documented deviations that did not
occur (``expectation_unused``) and whether the report was recorded on an older gate (cases
of the current gate it lacks, cases it has that the gate no longer runs); per runtime and
ladder layer, the non-passing results.

``decodespec matrix`` prints the text table; ``decodespec matrix --write docs/matrix.md``
writes the docs page (MyST Markdown, rendered by ``decodespec docs``) and ``--check`` exits 1
when the committed page differs from the one the report files give (``tests/test_matrix.py``
runs that check, so a results file changed without the page fails CI).

Source: research/formal-anchors-survey.md 4.4 (Bowtie's implementation matrix, test262.fyi);
docs/design.md section 9 (the report lines).
"""

from __future__ import annotations

import fnmatch
import html
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "KNOWN_RUNTIMES",
    "LAYERS",
    "MACHINES",
    "SEVERITY",
    "Cell",
    "Matrix",
    "build_matrix",
    "current_gate_cases",
    "main_table",
    "render_markdown",
    "render_text",
]

_REPO = Path(__file__).resolve().parents[2]
#: Column order of the runtimes the project ships adapters for; any other runtime follows, sorted.
KNOWN_RUNTIMES = ("impl", "hf", "llamacpp", "vllm")
#: Results from worst to best: a row's cell shows its worst result first.
SEVERITY = ("fail", "undecided", "deviation", "pass", "skip")
#: The ladder's layers, in order (docs/generated/ladder).
LAYERS = ("STATE", "TENSOR", "POLICY", "DECISION", "SEQUENCE", "RESUME")
_SHORT = {"pass": "pass", "deviation": "dev", "undecided": "undec", "fail": "FAIL", "skip": "skip"}
#: Files under the results folder that are not gate reports (the failure lab's mutant lines).
_NOT_REPORTS = ("failure-lab.jsonl",)


@attrs.frozen
class Cell:
    """One runtime's results of one row.

    Attributes:
        results: Each report line's result, worst first.
        layer: The ladder layer of the worst result (``""`` for a pass or a skip).
        key: The deviation id of a deviation, else ``""``.
        note: The reason (deviation), or the message (fail, undecided, skip), shortened.
    """

    results: tuple[str, ...]
    layer: str = ""
    key: str = ""
    note: str = ""

    @property
    def result(self) -> str:
        """The worst result."""
        return self.results[0]

    def label(self) -> str:
        """``dev ×2``-style text: the worst result, then a count when the row ran more than once."""
        worst = _SHORT.get(self.result, self.result)
        if len(self.results) > 1:
            rest = sorted(set(self.results[1:]) - {self.result}, key=_rank)
            return f"{worst} ×{len(self.results)}" + (f" ({', '.join(_SHORT.get(r, r) for r in rest)})" if rest else "")
        return worst


def _rank(result: str) -> int:
    return SEVERITY.index(result) if result in SEVERITY else -1  # an unknown result sorts first (worst)


@attrs.frozen
class Matrix:
    """The rows, columns, cells and summaries (see the module docstring)."""

    runtimes: tuple[str, ...]
    rows: tuple[str, ...]
    cells: Mapping[tuple[str, str], Cell]
    models: Mapping[str, str]
    unused: Mapping[str, tuple[str, ...]]
    missing: Mapping[str, tuple[str, ...]]
    retired: Mapping[str, tuple[str, ...]]
    deviations: Mapping[str, Mapping[str, Mapping[str, Any]]]

    def counts(self, runtime: str) -> dict[str, int]:
        """Report lines per result of ``runtime`` (every line, a machine's runs counted each)."""
        out: dict[str, int] = {}
        for (row, rt), cell in self.cells.items():
            if rt == runtime:
                for r in cell.results:
                    out[r] = out.get(r, 0) + 1
        return out

    def by_layer(self, runtime: str) -> dict[str, dict[str, int]]:
        """``layer -> result -> rows`` of ``runtime``'s non-passing, non-skipped rows (by their worst result)."""
        out: dict[str, dict[str, int]] = {}
        for (row, rt), cell in self.cells.items():
            if rt == runtime and cell.result not in ("pass", "skip"):
                by = out.setdefault(cell.layer or "-", {})
                by[cell.result] = by.get(cell.result, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain JSON of the matrix (the ``--format json`` output)."""
        return {"runtimes": list(self.runtimes), "models": dict(self.models),
                "rows": [{"row": row, **{rt: attrs.asdict(self.cells[row, rt]) for rt in self.runtimes if (row, rt) in self.cells}}
                         for row in self.rows],
                "summary": {rt: {"counts": self.counts(rt), "by_layer": self.by_layer(rt), "expectation_unused": list(self.unused[rt]),
                                 "missing_cases": list(self.missing[rt]), "retired_cases": list(self.retired[rt])}
                            for rt in self.runtimes}}


#: The machines' report ids (a machine a runtime skips writes no line, so they never count as absent).
MACHINES = ("machine.none", "machine.dynamic", "machine.static", "machine.beam")


def current_gate_cases(model: str = "smollm2") -> tuple[str, ...]:
    """The case ids the current gate reports on ``model``: the case table, the envelope sweep, then the machines."""
    from .cases import cases_for
    from .drawing import sweep_cases

    return tuple(c.id for c in cases_for(model)) + tuple(c.id for c in sweep_cases(model)) + MACHINES


def _expectations(runtime: str, directory: Path) -> dict[str, dict[str, Any]]:
    from .cases import load_expectations

    try:
        return {e.id: dict(e.fields) for e in load_expectations(runtime, directory)}
    except (ValueError, OSError):  # pragma: no cover - a broken expectations file fails the gate itself
        return {}


def _runtime_order(names: Iterable[str]) -> tuple[str, ...]:
    names = set(names)
    return tuple(n for n in KNOWN_RUNTIMES if n in names) + tuple(sorted(names - set(KNOWN_RUNTIMES)))


def _shorten(text: Any, limit: int = 220) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def build_matrix(results_dir: Path | None = None, *, expectations_dir: Path | None = None,
                 gate_cases: Sequence[str] | None = None) -> Matrix:
    """Read every gate report (``*.jsonl`` with ``case`` lines) under ``results_dir`` into a :class:`Matrix`.

    Args:
        results_dir: Default ``docs/results``.
        expectations_dir: Default ``checks/gate/expectations`` (deviation reasons and traces).
        gate_cases: The current gate's case ids (default :func:`current_gate_cases`).

    Raises:
        ValueError: a line that is not a JSON object.
    """
    results_dir = results_dir or _REPO / "docs" / "results"
    expectations_dir = expectations_dir or _REPO / "checks" / "gate" / "expectations"
    gate = tuple(gate_cases) if gate_cases is not None else current_gate_cases()
    lines: dict[str, list[dict[str, Any]]] = {}
    unused: dict[str, list[str]] = {}
    order: list[str] = []
    for path in sorted(results_dir.glob("*.jsonl")):
        if path.name in _NOT_REPORTS:
            continue
        for lineno, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not text.strip():
                continue
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError(f"{path.name}:{lineno}: not a JSON object")  # noqa: TRY004 - a bad results file, refused like bad JSON
            if "case" not in obj or "result" not in obj:
                continue
            runtime = str(obj.get("runtime") or path.stem)
            if obj["result"] == "expectation_unused":
                unused.setdefault(runtime, []).append(str(obj.get("deviation", obj["case"])))
                continue
            lines.setdefault(runtime, []).append(obj)
    runtimes = _runtime_order(lines)
    models: dict[str, str] = {}
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rt in runtimes:
        found = [str(o.get("model") or "") for o in lines[rt]]
        models[rt] = max(set(found), key=found.count) if found else ""
    main_model = max(models.values(), key=list(models.values()).count) if models else ""
    for rt in runtimes:
        for obj in lines[rt]:
            model = str(obj.get("model") or "")
            row = obj["case"] + (f" [{model}]" if obj["case"].startswith("machine.") and model not in ("", main_model) else "")
            if row not in order:
                order.append(row)
            grouped.setdefault((row, rt), []).append(obj)
    position = {case: i for i, case in enumerate(gate)}
    rows = tuple(sorted(order, key=lambda r: (position.get(r.split(" [")[0], len(position)), order.index(r))))
    cells: dict[tuple[str, str], Cell] = {}
    deviations: dict[str, dict[str, dict[str, Any]]] = {}
    for (row, rt), objs in grouped.items():
        objs = sorted(objs, key=lambda o: _rank(str(o["result"])))
        worst = objs[0]
        key, note = "", ""
        if worst["result"] == "deviation":
            key = str(worst.get("deviation") or "").split(",")[0].strip()
            note = _shorten(worst.get("reason"))
        elif worst["result"] != "pass":
            note = _shorten(worst.get("message") or worst.get("reason"))
        layer = str(worst.get("layer") or "") if worst["result"] not in ("pass", "skip") else ""
        cells[row, rt] = Cell(tuple(str(o["result"]) for o in objs), layer, key, note)
        for o in objs:
            for dev in str(o.get("deviation") or "").split(","):
                if dev.strip():
                    deviations.setdefault(rt, {})[dev.strip()] = {}
    for rt, ids in deviations.items():
        documented = _expectations(rt, expectations_dir)
        for dev in ids:
            ids[dev] = documented.get(dev, {"id": dev, "reason": "(not in the expectations file any more)"})
    present = {rt: {o["case"] for o in lines[rt]} for rt in runtimes}
    missing = {rt: tuple(c for c in gate if c not in present[rt] and c not in MACHINES) for rt in runtimes}
    retired = {rt: tuple(sorted(c for c in present[rt] if c not in gate and not fnmatch.fnmatchcase(c, "machine.*") and not c.startswith("peer."))) for rt in runtimes}
    return Matrix(runtimes, rows, cells, models, {rt: tuple(unused.get(rt, ())) for rt in runtimes}, missing, retired,
                  deviations)


def main_table(matrix: Matrix) -> list[list[str]]:
    """Header plus one row per case: ``[case, <cell label per runtime>]`` (``-``: not in that report)."""
    out = [["case", *matrix.runtimes]]
    for row in matrix.rows:
        out.append([row, *(matrix.cells[row, rt].label() + (f" {matrix.cells[row, rt].layer}" if matrix.cells[row, rt].layer else "")
                           if (row, rt) in matrix.cells else "-" for rt in matrix.runtimes)])
    return out


def _summary_line(matrix: Matrix, rt: str) -> str:
    counts = matrix.counts(rt)
    parts = [f"{counts[r]} {r}" for r in (*SEVERITY, *sorted(set(counts) - set(SEVERITY))) if counts.get(r)]
    text = ", ".join(parts)
    if matrix.unused[rt]:
        text += f"; {len(matrix.unused[rt])} documented deviation(s) did not occur ({', '.join(matrix.unused[rt])})"
    if matrix.missing[rt] or matrix.retired[rt]:
        text += (f"; recorded on an older gate: {len(matrix.missing[rt])} current case(s) absent"
                 + (f", {len(matrix.retired[rt])} case(s) the gate no longer runs" if matrix.retired[rt] else ""))
    return text


def render_text(matrix: Matrix) -> str:
    """The matrix as a fixed-width text table, then the per-runtime and per-layer summaries."""
    table = main_table(matrix)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    out += ["", "per runtime (report lines):"]
    out += [f"  {rt} ({matrix.models[rt]}): {_summary_line(matrix, rt)}" for rt in matrix.runtimes]
    out += ["", "per ladder layer (rows not passing, by worst result):"]
    for rt in matrix.runtimes:
        layers = matrix.by_layer(rt)
        text = "; ".join(f"{layer} " + ", ".join(f"{n} {r}" for r, n in sorted(by.items(), key=lambda kv: _rank(kv[0])))
                         for layer, by in sorted(layers.items(), key=lambda kv: LAYERS.index(kv[0]) if kv[0] in LAYERS else 99))
        out.append(f"  {rt}: {text or 'none'}")
    return "\n".join(out) + "\n"


_STYLE = ("<style>table.decodespec-matrix { border-collapse: collapse; font-size: 0.85em; } "
          "table.decodespec-matrix td, table.decodespec-matrix th { border: 1px solid #ccc; padding: 2px 6px; white-space: nowrap; } "
          ".m-pass { color: #17631b; } .m-deviation { color: #7a5a00; font-weight: bold; } .m-undecided { color: #35508a; } "
          ".m-fail { color: #a3150b; font-weight: bold; } .m-skip { color: #777; }</style>")


def _anchor(*parts: str) -> str:
    return "m-" + re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def _cell_html(matrix: Matrix, row: str, rt: str) -> str:
    cell = matrix.cells.get((row, rt))
    if cell is None:
        return "–"
    text = html.escape(cell.label()) + (f" <small>{html.escape(cell.layer)}</small>" if cell.layer else "")
    css = f"m-{cell.result}"
    if cell.key:
        return f'<a class="{css}" href="#{_anchor(rt, cell.key)}" title="{html.escape(cell.note)}">{text}</a>'
    if cell.note:
        return f'<a class="{css}" href="#{_anchor(rt, row)}" title="{html.escape(cell.note)}">{text}</a>'
    return f'<span class="{css}">{text}</span>'


def render_markdown(matrix: Matrix) -> str:
    """The docs page (MyST Markdown with inline HTML cells): summaries, the matrix, then the reasons behind every cell."""
    esc = html.escape
    out = ["# Conformance matrix", "",
           ("Every case and machine of the conformance gate (rows) against every runtime with a report in "
           "`docs/results/` (columns), generated by `decodespec matrix --write docs/matrix.md` from those files "
           "(`tests/test_matrix.py` fails when this page is stale). A cell is the case's result on that runtime: "
           "**pass**; **dev**, a documented deviation (`checks/gate/expectations/<runtime>.toml`: the runtime's behaviour, "
           "the spec's, the reason and the trace that replays it); **undec**, the reference margin cannot decide; "
           "**FAIL**; **skip**, the runtime does not declare what the case needs or refuses it; – not in that report. "
           "The ladder layer follows a result that is not a pass; a cell links to its reason below. A row that ran more "
           "than once (a machine per model) shows its worst result and the count. Produce a column for another runtime with "
           "`pytest checks/ --runtime 'stdio:CMD' --report docs/results/NAME.jsonl`."), "",
           "## Summary per runtime", "",
           "| runtime | model | pass | dev | undec | FAIL | skip | notes |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rt in matrix.runtimes:
        c = matrix.counts(rt)
        notes = []
        if matrix.missing[rt] or matrix.retired[rt]:
            notes.append(f"recorded on an older gate: {len(matrix.missing[rt])} current case(s) absent"
                         + (f", {len(matrix.retired[rt])} no longer run" if matrix.retired[rt] else ""))
        if matrix.unused[rt]:
            notes.append("documented deviation(s) that did not occur: " + ", ".join(f"`{u}`" for u in matrix.unused[rt]))
        out.append(f"| `{rt}` | {matrix.models[rt]} | " + " | ".join(str(c.get(r, 0)) for r in ("pass", "deviation", "undecided", "fail", "skip"))
                   + f" | {'; '.join(notes) or '–'} |")
    out += ["", "## Summary per ladder layer", "",
            "Rows that did not pass, by the layer of their worst result (a deviation refused at admission is a STATE row).", "",
            "| runtime | " + " | ".join(LAYERS) + " |", "| --- |" + " --- |" * len(LAYERS)]
    for rt in matrix.runtimes:
        layers = matrix.by_layer(rt)
        out.append(f"| `{rt}` | " + " | ".join(", ".join(f"{n} {_SHORT.get(r, r)}" for r, n in sorted(layers.get(layer, {}).items(),
                                                                                                     key=lambda kv: _rank(kv[0])))
                                              or "–" for layer in LAYERS) + " |")
    out += ["", "## Matrix", "", _STYLE, "", '<table class="decodespec-matrix">',
            "<thead><tr><th>case</th>" + "".join(f"<th>{esc(rt)}</th>" for rt in matrix.runtimes) + "</tr></thead>", "<tbody>"]
    for row in matrix.rows:
        out.append(f"<tr><td><code>{esc(row)}</code></td>" + "".join(f"<td>{_cell_html(matrix, row, rt)}</td>" for rt in matrix.runtimes)
                   + "</tr>")
    out += ["</tbody>", "</table>", "", "## Reasons", ""]
    for rt in matrix.runtimes:
        out += [f"### {rt}", ""]
        items = []
        for dev, fields in sorted(matrix.deviations.get(rt, {}).items()):
            parts = [f'<dt id="{_anchor(rt, dev)}"><code>{esc(dev)}</code> (deviation)</dt><dd>{esc(str(fields.get("reason", "")))}']
            for label, key in ((rt, rt), ("spec", "spec"), ("spec rule", "spec_rule"), ("source", "source"), ("trace", "trace")):
                if fields.get(key):
                    parts.append(f"<br><b>{esc(label)}:</b> <code>{esc(str(fields[key]))}</code>" if key in ("spec_rule", "trace")
                                 else f"<br><b>{esc(label)}:</b> {esc(str(fields[key]))}")
            items.append("".join(parts) + "</dd>")
        for row in matrix.rows:
            cell = matrix.cells.get((row, rt))
            if cell is not None and not cell.key and cell.note:
                items.append(f'<dt id="{_anchor(rt, row)}"><code>{esc(row)}</code> ({esc(cell.result)})</dt><dd>{esc(cell.note)}</dd>')
        out += (["<dl>", *items, "</dl>"] if items else ["None."]) + [""]
    return "\n".join(out).rstrip() + "\n"
