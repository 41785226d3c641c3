"""The conformance matrix (``decodespec matrix``, docs/matrix.md): built from the gate's report files, and never stale.

Source: issue 18 item 3; :mod:`decodespec.checks.gate.matrix`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decodespec.checks.commands.cli import main
from decodespec.checks.gate import matrix as m

REPO = Path(__file__).resolve().parent.parent
GATE = ("matrix.a", "boundary.b", "adversarial.c", "machine.none", "machine.dynamic", "machine.static", "machine.beam")


def _line(case: str, runtime: str, result: str, **extra) -> dict:
    return {"case": case, "runtime": runtime, "model": extra.pop("model", "smollm2"), "result": result,
            "layer": extra.pop("layer", None), "rule": None, "check": None, "expected": None, "actual": None,
            "message": extra.pop("message", ""), **extra}


def _write(folder: Path, name: str, lines: list[dict]) -> None:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")


@pytest.fixture()
def reports(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    _write(folder, "impl", [_line(c, "impl", "pass") for c in GATE[:3]] +
           [_line("machine.none", "impl", "pass", model="tiny"), _line("machine.none", "impl", "pass")])
    _write(folder, "zz", [_line("matrix.a", "stdio:./my-server", "fail", layer="TENSOR", message="row off by 3"),
                          _line("boundary.b", "stdio:./my-server", "skip", message="does not declare ['stream']")])
    _write(folder, "vllm", [
        _line("matrix.a", "vllm", "deviation", layer="DECISION", deviation="vllm.request_rng", reason="its own generator"),
        _line("boundary.b", "vllm", "undecided", layer="DECISION", message="margin too small"),
        _line("machine.none", "vllm", "pass"), _line("machine.none", "vllm", "deviation", layer="SEQUENCE", deviation="vllm.x",
                                                      reason="r"),
        {"case": "boundary.gone", "runtime": "vllm", "model": "smollm2", "result": "expectation_unused", "deviation": "vllm.old"},
    ])
    (folder / "failure-lab.jsonl").write_text(json.dumps({"mutant": "mutant.x", "killed": True}) + "\n", encoding="utf-8")
    exp = tmp_path / "expectations"
    exp.mkdir()
    (exp / "vllm.toml").write_text('[[deviation]]\nid = "vllm.request_rng"\nreason = "its own generator"\n'
                                   'vllm = "a torch.Generator per request"\nspec = "Philox at (step, 0)"\n'
                                   'trace = "traces/vllm-request-rng.itf.json"\n', encoding="utf-8")
    return folder


def test_rows_columns_and_cells(reports: Path) -> None:
    mx = m.build_matrix(reports, expectations_dir=reports.parent / "expectations", gate_cases=GATE)
    assert mx.runtimes == ("impl", "vllm", "stdio:./my-server")  # known runtimes first, then the others
    assert mx.rows[:3] == ("matrix.a", "boundary.b", "adversarial.c")  # the gate's order
    assert "machine.none [tiny]" in mx.rows and "machine.none" in mx.rows
    assert mx.cells["matrix.a", "vllm"] == m.Cell(("deviation",), "DECISION", "vllm.request_rng", "its own generator")
    assert mx.cells["matrix.a", "stdio:./my-server"].result == "fail"
    assert mx.cells["matrix.a", "stdio:./my-server"].label() == "FAIL"
    # a row run twice shows its worst result and the count
    assert mx.cells["machine.none", "vllm"].results == ("deviation", "pass")
    assert mx.cells["machine.none", "vllm"].label() == "dev ×2 (pass)"
    assert ("adversarial.c", "vllm") not in mx.cells
    assert mx.counts("vllm") == {"deviation": 2, "undecided": 1, "pass": 1}
    assert mx.by_layer("vllm") == {"DECISION": {"deviation": 1, "undecided": 1}, "SEQUENCE": {"deviation": 1}}
    assert mx.unused["vllm"] == ("vllm.old",)
    assert mx.missing["impl"] == ()  # a machine a runtime skips writes no line: never absent
    assert mx.missing["stdio:./my-server"] == ("adversarial.c",)
    assert mx.deviations["vllm"]["vllm.request_rng"]["trace"] == "traces/vllm-request-rng.itf.json"


def test_text_and_page_name_every_result_and_reason(reports: Path) -> None:
    mx = m.build_matrix(reports, expectations_dir=reports.parent / "expectations", gate_cases=GATE)
    text = m.render_text(mx)
    assert "dev DECISION" in text and "FAIL TENSOR" in text and "undec DECISION" in text
    assert "vllm (smollm2): 1 undecided, 2 deviation, 1 pass" in text
    assert "recorded on an older gate" in text
    page = m.render_markdown(mx)
    anchor = m._anchor("vllm", "vllm.request_rng")
    assert f'href="#{anchor}"' in page and f'id="{anchor}"' in page  # the cell links to its reason
    assert "traces/vllm-request-rng.itf.json" in page and "a torch.Generator per request" in page
    assert "row off by 3" in page  # a failure's message is its reason
    assert "`vllm.old`" in page


def test_cli_check_fails_on_a_stale_page(reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "matrix.md"
    assert main(["matrix", "--results", str(reports), "--write", str(page)]) == 0
    assert main(["matrix", "--results", str(reports), "--check", str(page)]) == 0
    _write(reports, "vllm", [_line("matrix.a", "vllm", "pass")])  # a report changed, the page not
    assert main(["matrix", "--results", str(reports), "--check", str(page)]) == 1
    assert "stale" in capsys.readouterr().err


def test_committed_matrix_page_is_up_to_date() -> None:
    """docs/matrix.md is what docs/results/*.jsonl and the expectations files give now (regenerate: decodespec matrix --write docs/matrix.md)."""
    committed = (REPO / "docs" / "matrix.md").read_text(encoding="utf-8")
    assert committed == m.render_markdown(m.build_matrix()), "docs/matrix.md is stale: run decodespec matrix --write docs/matrix.md"
