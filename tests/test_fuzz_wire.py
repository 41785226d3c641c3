"""Fuzzing the stdio wire from the runtime's side: a foreign runtime that answers with mutated lines.

The harness speaks to a runtime over JSON lines (checks/adapters/stdio.py, wire.py).  Here the
server is our own runtime served in process by :func:`decodespec.checks.adapters.stdio_server.serve` on a
pair of pipes, and one of its response lines is mutated on the way back (a JSON-level mutation of
the message -- mostly inside the observation or the result -- or a byte-level one), then read by
the real :class:`~decodespec.checks.adapters.stdio.StdioAdapter` transport and judged by the lock
step.  Every outcome must be a verdict (passed when the mutation changed nothing that matters,
failed otherwise) or a typed :class:`DecodeSpecError` with a registered code; any other
exception fails.  ``DECODESPEC_FUZZ_EXAMPLES`` sets the examples (default 60); a long run:
``DECODESPEC_FUZZ_SECONDS=S`` (seeded by ``DECODESPEC_FUZZ_SEED``, report in
``DECODESPEC_FUZZ_REPORT``).

Source: issue 16 deliverable 1 (the stdio wire is a request surface: typed errors for every input).
"""

from __future__ import annotations

import io
import json
import os
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fuzzing import Chooser, Ledger, byte_mutation, json_mutation  # tests/ is on sys.path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodespec.checks.adapters import CaseConfig
from decodespec.checks.adapters.stdio import StdioAdapter
from decodespec.checks.adapters.stdio_server import serve
from decodespec.checks.adapters.wire import PROTOCOL_VERSION, request
from decodespec.checks.gate.lockstep import LockStep
from decodespec.spec.errors import ERROR_CODES, DecodeSpecError

EXAMPLES = int(os.environ.get("DECODESPEC_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])

#: Requests the lock step runs (tiny model): greedy with a stop-free run, and sampled with top-k.
CONFIGS = [
    CaseConfig(model="tiny", prompt_ids=(1, 75, 104, 101), max_new_tokens=3, seed=0),
    CaseConfig(model="tiny", prompt_ids=(1, 72), max_new_tokens=3, seed=4, cache="static",
               policy={"family": "multinomial", "order": "default", "transforms": [{"name": "top_k", "k": 20}]}),
]


class _Process:
    """What StdioAdapter reads of a process: alive until the server thread ends."""

    def __init__(self, stdin: Any, thread: threading.Thread):
        self.stdin, self._thread, self.returncode = stdin, thread, None

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        return 0

    def kill(self) -> None:
        pass


class MutatingStdio(StdioAdapter):
    """StdioAdapter's transport and parsing over an in-process server whose ``mutate_at``-th response is mutated."""

    def __init__(self, c: Chooser, mutate_at: int, timeout: float = 60.0):
        # The mutation runs on the reader thread: it draws from its own seeded generator (Hypothesis draws stay on this thread).
        self.c = Chooser(rng=random.Random(c.int(0, 2**32 - 1)))
        self.command, self.timeout, self.mutate_at, self.answers = "in-process", timeout, mutate_at, 0
        self.notes: list[str] = []
        self.stderr = io.BytesIO()
        to_server_r, to_server_w = os.pipe()
        from_server_r, from_server_w = os.pipe()
        server_in = os.fdopen(to_server_r, "r", encoding="utf-8")
        server_out = os.fdopen(from_server_w, "w", encoding="utf-8")
        thread = threading.Thread(target=self._serve, args=(server_in, server_out), daemon=True)
        thread.start()
        self.process = _Process(os.fdopen(to_server_w, "w", encoding="utf-8"), thread)
        self._server_lines = os.fdopen(from_server_r, "r", encoding="utf-8", errors="surrogateescape")
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump_mutated, daemon=True).start()
        self.seq = 0
        hello = self._exchange(request("start", version=PROTOCOL_VERSION), seq=None)
        self.implementation = dict(hello["implementation"])
        self._capabilities = frozenset(hello["implementation"]["capabilities"])
        self.name = "stdio"

    @staticmethod
    def _serve(server_in, server_out) -> None:
        try:
            serve("impl", server_in, server_out)
        finally:
            server_out.close()

    def _pump_mutated(self) -> None:
        for line in self._server_lines:
            self.answers += 1
            if self.answers == self.mutate_at:
                line = self._mutate(line)
            self.lines.put(line)
        self.lines.put(None)

    def _mutate(self, line: str) -> str:
        if self.c.int(0, 3):
            message = json.loads(line)
            prefer = ("observation",) if "observation" in message else ("result",) if "result" in message else ()
            message, note = json_mutation(self.c, message, prefer=prefer)
            self.notes.append(note)
            try:
                return json.dumps(message, allow_nan=True) + "\n"
            except ValueError:
                return "{}\n"
        raw, note = byte_mutation(self.c, line.encode("utf-8"))
        self.notes.append(note)
        return raw.decode("utf-8", errors="surrogateescape").replace("\n", " ") + "\n"

    def close(self) -> None:
        try:
            self.process.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
            self.process.stdin.flush()
            self.process.stdin.close()
        except (OSError, ValueError):
            pass
        self.process.wait(timeout=30)


def _wire_case(c: Chooser) -> str:
    """One lock-step run against a runtime whose ``k``-th answer is mutated; returns the outcome."""
    config = c.choice(CONFIGS)
    adapter = None
    try:
        adapter = MutatingStdio(c, mutate_at=c.int(2, 5))  # answers: start, reset, observe, run, observe
        ls = LockStep(adapter, config, runtime="stdio:in-process")
        ls.reset()
        ls.apply({"op": "run"})
        outcome = "verdict.failed" if ls.failed else "verdict.passed"
    except DecodeSpecError as exc:
        assert exc.code in ERROR_CODES and exc.path.startswith("$"), (adapter.notes if adapter else None, exc)
        outcome = f"refused.{exc.code}"
    finally:
        if adapter is not None:
            adapter.close()
    return outcome


@FUZZ
@given(data=st.data())
def test_a_runtime_answering_a_mutated_line_gets_a_verdict_or_a_typed_error(data) -> None:
    _wire_case(Chooser(data))


@pytest.mark.skipif("DECODESPEC_FUZZ_SECONDS" not in os.environ, reason="the long fuzz loop runs only with DECODESPEC_FUZZ_SECONDS=S")
def test_long_wire_fuzz_loop() -> None:
    seed = int(os.environ.get("DECODESPEC_FUZZ_SEED", "0"))
    deadline = time.monotonic() + float(os.environ["DECODESPEC_FUZZ_SECONDS"])
    c = Chooser(rng=random.Random(seed))
    ledger = Ledger()
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        ledger.run("stdio_wire", lambda: _wire_case(c), where=f"seed {seed} round {rounds}")
    report = os.environ.get("DECODESPEC_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"seed": seed, "rounds": rounds, **ledger.to_json()}, indent=1) + "\n")
    assert not ledger.untyped, ledger.untyped[:5]
    assert not ledger.hangs(), ledger.hangs()


@pytest.mark.parametrize("number", ["9" * 5000, str(10**400), str(2**64), str(-(2**63) - 1)])
def test_an_integer_outside_the_protocol_range_is_a_protocol_error(number) -> None:
    """A runtime answering an integer outside ``[-2^63, 2^64)`` (here as a decision's logprob) gets ``adapter.protocol``.

    Found by this file's fuzzer under ATEN_CPU_CAPABILITY=avx2 in stop 30: a mutated ``"logprob"`` of 10^400
    passed the observation schema (a JSON number) and raised ``OverflowError`` at the DECISION layer's
    ``float()``; 5,000 digits raised Python's untyped int-conversion ``ValueError`` inside ``json.loads``.
    """
    from decodespec.checks.adapters.wire import decode_line
    from decodespec.spec.errors import Rejection

    line = '{"ok": true, "seq": 4, "observation": {"decision": {"token_id": 3, "logprob": ' + number + "}}}"
    with pytest.raises(Rejection) as info:
        decode_line(line)
    assert info.value.code == "adapter.protocol" and info.value.path == "$"
    edge = decode_line(f'{{"ok": true, "a": {-(2**63)}, "b": {2**64 - 1}, "c": 1e300}}')
    assert edge == {"ok": True, "a": -(2**63), "b": 2**64 - 1, "c": 1e300}
