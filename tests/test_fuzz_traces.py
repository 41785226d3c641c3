"""Fuzzing the trace readers: mutated traces through ``decodespec validate-trace`` and replay's loader.

Seeds: every committed conformance trace (``traces/*.itf.json``) and event traces written by
``decodespec generate --trace`` (tiny model: greedy, sampled + streamed with a stop string, and
suspended by a snapshot; redacted by default, two of them also with ``--trace-content``).  Each example applies a few mutations, at the byte level (flip, insert,
delete, truncate, a byte that is not UTF-8) or the JSON level (replace a value anywhere, mostly in
``#meta`` / one event line, by a hostile one: another type, an integer above 2**53 or of 400 digits,
a lone surrogate, a long string, a ``stdio:`` command, a deep nest; delete a key; add one).

Every outcome must be an acceptance or a typed refusal (a :class:`DecodeSpecError`, or
``validate-trace``'s verdict / exit 2 with a registered code), and every accepted event-trace mutant must be
one the wrong-acceptance oracle (``tests/trace_oracle.py``: same canonical content, or only fields the format
declares free) says deserved it; any other exception or a wrong acceptance fails the test,
and no process may be started (``subprocess.Popen``, ``os.system`` and ``os.posix_spawn`` raise
while an example runs).  A loaded conformance trace also goes through replay's runtime check
(a ``stdio:`` runtime named by the file is refused).

Profiles: ``DECODESPEC_FUZZ_EXAMPLES`` (default 300 per test: the CI profile, under 60 s on one
core) sets the examples per test; ``DECODESPEC_FUZZ_STATS=FILE`` writes the outcome counts and
rates as JSON at the end (what docs/results/fuzz-traces.md reports), and
``DECODESPEC_FUZZ_ACCEPTED=FILE`` appends each accepted event-trace mutation with the oracle's class.  A long
run: ``DECODESPEC_FUZZ_EXAMPLES=20000 nice -n 19 .venv/bin/python -m pytest tests/test_fuzz_traces.py``.

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data"; issue 16 deliverable 7.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Self
from unittest import mock

import pytest
from fuzzing import DEEP, Chooser, Ledger, _dumps, byte_mutation, json_mutation  # tests/ is on sys.path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_oracle import classify_acceptance  # tests/ is on sys.path

from decodespec.checks.commands.cli import main
from decodespec.checks.modelcheck.traces import check_replay_runtime, load_trace
from decodespec.spec.errors import ERROR_CODES, DecodeSpecError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted((ROOT / "traces").glob("*.itf.json"))
#: The corpus seeds, read once.
CORPUS_BYTES = {path: path.read_bytes() for path in CORPUS}
EXAMPLES = int(os.environ.get("DECODESPEC_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])

STATS: Counter = Counter()
TIMES: Counter = Counter()
#: The wrong acceptances seen (tests/trace_oracle.py): each fails the test that saw it.
WRONG: list[dict[str, Any]] = []

def _streams() -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """stdout / stderr as a terminal has them: strict UTF-8 text over bytes (a lone surrogate cannot be written)."""
    return (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict"),
            io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace"))


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("utf-8")


@contextlib.contextmanager
def no_process_started():
    """While the block runs, starting any process raises (and so fails the example); a no-op inside an outer one."""
    if isinstance(subprocess.Popen, mock.Mock):  # the long loop holds one around all of its inputs
        yield
        return
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a process was started: {args[:1]!r}")

    with mock.patch.object(subprocess, "Popen", side_effect=refuse), mock.patch.object(os, "system", side_effect=refuse), \
            mock.patch.object(os, "posix_spawn", side_effect=refuse), mock.patch.object(os, "posix_spawnp", side_effect=refuse):
        yield


class Seed(bytes):
    """A seed file's bytes, shown by its name (Hypothesis prints drawn values)."""

    def __new__(cls, name: str, data: bytes) -> Self:
        seed = super().__new__(cls, data)
        seed.name = name
        return seed

    def __repr__(self) -> str:
        return f"<seed {self.name}: {len(self)} bytes>"


@pytest.fixture(scope="module")
def event_traces(tmp_path_factory) -> list[bytes]:
    folder = tmp_path_factory.mktemp("fuzz-events")
    base = ["generate", "--model", "tiny", "--prompt", "hi", "--device", "cpu"]
    runs = {
        "greedy": ["--max-new-tokens", "4"],  # redacted (the default passport)
        "greedy-content": ["--max-new-tokens", "4", "--trace-content"],
        "sampled-stream-content": ["--max-new-tokens", "8", "--do-sample", "--seed", "3", "--top-k", "20", "--stop", "BB", "--stream",
                                   "--trace-content"],
        "sampled-stream": ["--max-new-tokens", "8", "--do-sample", "--seed", "3", "--top-k", "20", "--stop", "BB", "--stream"],
        "snapshot": ["--max-new-tokens", "4", "--snapshot", str(folder / "s.json"), "--snapshot-at", "2"],
    }
    out = []
    with contextlib.redirect_stdout(io.StringIO()):
        for name, flags in runs.items():
            path = folder / f"{name}.ndjson"
            assert main([*base, "--trace", str(path), *flags]) == 0
            out.append(Seed(name, path.read_bytes()))
    return out


def _write_stats(every: int = 1) -> None:
    """Write the counts and rates to ``$DECODESPEC_FUZZ_STATS`` (every ``every`` examples: a killed long run keeps them)."""
    target = os.environ.get("DECODESPEC_FUZZ_STATS")
    if target and (STATS["conformance"] + STATS["events"]) % every == 0:
        rates = {k: round(STATS[k] / TIMES[k], 1) for k in TIMES if TIMES[k]}
        Path(target).write_text(json.dumps({"examples_per_test": EXAMPLES, "counts": dict(sorted(STATS.items())),
                                            "seconds": {k: round(v, 1) for k, v in TIMES.items()}, "per_second": rates},
                                           indent=1) + "\n")


@pytest.fixture(scope="module", autouse=True)
def stats_file():
    yield
    _write_stats()


def _mutate_conformance(c: Chooser, source: bytes) -> tuple[bytes, list[str]]:
    notes = []
    for _ in range(c.int(1, 3)):
        if c.bool():
            try:
                doc = json.loads(source)
            except (ValueError, RecursionError):
                doc = None
            if doc is not None:
                doc, note = json_mutation(c, doc, prefer=("#meta",))
                source = _dumps(doc)
                notes.append(note)
                continue
        source, note = byte_mutation(c, source)
        notes.append(note)
    return source, notes


def _conformance_case(c: Chooser, folder: Path) -> str:
    """One mutated conformance trace through replay's loader and runtime check; returns the outcome."""
    path = c.choice(CORPUS)
    source = Seed(path.name, CORPUS_BYTES[path])
    mutated, notes = _mutate_conformance(c, source)
    path = folder / "fuzz-conformance.itf.json"
    path.write_bytes(mutated)
    out, err = _streams()
    start = time.perf_counter()
    try:
        with no_process_started(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            trace = load_trace(path)
            check_replay_runtime(trace["#meta"], None)
            outcome = "conformance.loaded"
    except DecodeSpecError as exc:
        assert exc.code in ERROR_CODES and exc.path.startswith("$"), (notes, exc)
        outcome = f"conformance.refused.{exc.code}"
    finally:
        TIMES["conformance"] += time.perf_counter() - start
    STATS[outcome] += 1
    STATS["conformance"] += 1
    _write_stats(every=200)
    return outcome


@FUZZ
@given(data=st.data())
def test_a_mutated_conformance_trace_loads_or_is_a_typed_refusal(data, tmp_path_factory) -> None:
    _conformance_case(Chooser(data), tmp_path_factory.getbasetemp())


def _mutate_events(c: Chooser, source: bytes) -> tuple[bytes, list[str]]:
    notes = []
    for _ in range(c.int(1, 2)):
        lines = source.split(b"\n")
        if c.int(0, 3) and lines:
            index = c.int(0, len(lines) - 1)
            try:
                record = json.loads(lines[index])
            except (ValueError, RecursionError):
                record = None
            if record is not None:
                record, note = json_mutation(c, record)
                lines[index] = _dumps(record)
                source = b"\n".join(lines)
                notes.append(f"line {index + 1}: {note}")
                continue
        if c.int(0, 4) == 0 and len(lines) > 2:  # drop, duplicate or swap whole lines
            i, j = sorted((c.int(0, len(lines) - 1), c.int(0, len(lines) - 1)))
            kind = c.choice(["drop", "dup", "swap"])
            lines = (lines[:i] + lines[i + 1:] if kind == "drop" else lines[:i] + [lines[i]] + lines[i:] if kind == "dup"
                     else [*lines[:i], lines[j], *lines[i + 1:j], lines[i], *lines[j + 1:]])
            source = b"\n".join(lines)
            notes.append(f"{kind} lines {i + 1},{j + 1}")
            continue
        source, note = byte_mutation(c, source)
        notes.append(note)
    return source, notes


def _events_case(c: Chooser, event_traces: list[bytes], folder: Path) -> str:
    """One mutated event trace through ``decodespec validate-trace``; returns the outcome."""
    source = c.choice(event_traces)
    mutated, notes = _mutate_events(c, source)
    path = folder / "fuzz-events.ndjson"
    path.write_bytes(mutated)
    out, err = _streams()
    start = time.perf_counter()
    try:
        with no_process_started(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["validate-trace", str(path), "--tokenizer", "tiny"])
    finally:
        TIMES["events"] += time.perf_counter() - start
    STATS["events"] += 1
    _write_stats(every=200)
    assert code in (0, 1, 2), (notes, code)
    out, err = _text(out), _text(err)
    assert "Traceback" not in err, (notes, err)
    if code == 2:
        error = json.loads(err.strip().splitlines()[-1])["error"]
        assert error["path"].startswith("$") and (error["code"] in ERROR_CODES or error["code"] == "trace.unreadable"), (notes, error)
        STATS[f"events.unreadable.{error['code']}"] += 1
        return f"events.unreadable.{error['code']}"
    verdict = json.loads(out)
    if verdict["accepted"]:
        assert code == 0 and verdict["code"] is None
        kind, detail = ("unchanged", "") if mutated == source else classify_acceptance(source, mutated)
        outcome = f"events.accepted.{kind}"
        STATS[outcome] += 1
        if kind == "wrong":
            WRONG.append({"seed": getattr(source, "name", "?"), "notes": notes, "why": detail})
        review = os.environ.get("DECODESPEC_FUZZ_ACCEPTED")
        if review and mutated != source:
            with open(review, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"seed": getattr(source, "name", "?"), "notes": notes, "class": kind, "detail": detail},
                                    ensure_ascii=True) + "\n")
    else:
        assert code == 1 and verdict["code"] in ERROR_CODES and verdict["line"] >= 1, (notes, verdict)
        outcome = f"events.rejected.{verdict['code']}"
        STATS[outcome] += 1
    return outcome


@FUZZ
@given(data=st.data())
def test_a_mutated_event_trace_is_accepted_or_refused_with_a_code(data, event_traces, tmp_path_factory) -> None:
    """... and an accepted mutant is one the oracle (tests/trace_oracle.py) says deserved it: no wrong acceptance."""
    WRONG.clear()
    outcome = _events_case(Chooser(data), event_traces, tmp_path_factory.getbasetemp())
    assert outcome != "events.accepted.wrong", WRONG


@pytest.mark.skipif("DECODESPEC_FUZZ_SECONDS" not in os.environ, reason="the long fuzz loop runs only with DECODESPEC_FUZZ_SECONDS=S")
def test_long_trace_fuzz_loop(event_traces, tmp_path_factory) -> None:
    """The long run: the same mutations from a seeded ``random.Random`` (no shrinking) for S seconds.

    Each round runs ``DECODESPEC_FUZZ_MIX`` = ``C:E`` inputs (default ``1:1``) of conformance traces
    (replay's loader) and event traces (``validate-trace``).  ``DECODESPEC_FUZZ_SEED`` seeds it;
    ``DECODESPEC_FUZZ_REPORT=FILE`` writes the counts, rates, slowest inputs and untyped errors.
    Untyped errors and inputs slower than ``fuzzing.HANG_S`` fail the run at the end.
    """
    seed = int(os.environ.get("DECODESPEC_FUZZ_SEED", "0"))
    deadline = time.monotonic() + float(os.environ["DECODESPEC_FUZZ_SECONDS"])
    c = Chooser(rng=random.Random(seed))
    n_conformance, n_events = (int(k) for k in os.environ.get("DECODESPEC_FUZZ_MIX", "1:1").split(":"))
    shm = Path("/dev/shm")
    folder = Path(tempfile.mkdtemp(prefix="decodespec-fuzz-", dir=shm)) if shm.is_dir() else tmp_path_factory.mktemp("fuzz-long")
    ledger = Ledger()
    WRONG.clear()
    rounds = 0
    try:
        with no_process_started():  # one patch around the loop (it costs more than a reader's call)
            while time.monotonic() < deadline:
                rounds += 1
                for i in range(n_conformance):
                    ledger.run("replay_loader", lambda: _conformance_case(c, folder), where=f"seed {seed} round {rounds}.{i}")
                for i in range(n_events):
                    ledger.run("validate_trace", lambda: _events_case(c, event_traces, folder), where=f"seed {seed} round {rounds}.{i}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = os.environ.get("DECODESPEC_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"seed": seed, "rounds": rounds, **ledger.to_json(), "wrong_acceptances": len(WRONG),
                                            "wrong": WRONG[:50]}, indent=1) + "\n")
    assert rounds > 0
    assert not ledger.untyped, ledger.untyped[:5]
    assert not WRONG, WRONG[:5]
    assert not ledger.hangs(), ledger.hangs()


@FUZZ
@given(data=st.data())
def test_the_fast_schema_check_never_accepts_what_the_python_validator_refuses(data, event_traces) -> None:
    """checks/modelcheck/fastschema.py: the Rust validator's acceptance is trusted, so it must imply the Python validator's,
    for the ITF schema (mutated conformance traces) and the events schema (mutated event lines)."""
    import jsonschema

    from decodespec.checks.modelcheck.fastschema import FastAccept
    from decodespec.checks.modelcheck.itf import ITF_SCHEMA
    from decodespec.checks.modelcheck.trace_validation import EVENTS_SCHEMA_PATH

    c = Chooser(data)
    events_schema = json.loads(EVENTS_SCHEMA_PATH.read_text(encoding="utf-8"))
    path = c.choice(CORPUS)
    doc, _ = json_mutation(c, json.loads(path.read_bytes()), prefer=("#meta",) if c.bool() else ("states",))
    line = c.choice(c.choice(event_traces).split(b"\n")[:-1])
    record, _ = json_mutation(c, json.loads(line))
    for schema, value in ((ITF_SCHEMA, doc), (events_schema, record)):
        if json.dumps(DEEP)[1:-1] in json.dumps(value):  # a deep-nest marker: only the file readers expand it
            continue
        if FastAccept(schema)(value):
            assert jsonschema.Draft202012Validator(schema).is_valid(value)
