"""What the fuzz suites share: the choices a mutation makes, from Hypothesis or from ``random.Random``.

A mutation is written once against :class:`Chooser`; the CI profile draws its choices from
Hypothesis (``data.draw``: shrinkable, derandomized under ``CI=true``), the long loops from a seeded
``random.Random`` (no shrinking, about ten times faster per input), so both profiles run the same
mutations.  :class:`Ledger` keeps a long loop's outcome counts, untyped errors and slowest inputs.

Source: issue 16 deliverable 7 (a short CI profile and an hour-long run of the same fuzzers).
"""

from __future__ import annotations

import json
import math
import random
import struct
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

#: An input slower than this (seconds inside the surface) counts as a hang (issue 16: "0 hangs over 10 s").
HANG_S = 10.0


class Chooser:
    """The choices a mutation makes, from Hypothesis (``data.draw``, shrinkable) or from ``random.Random`` (the long loop)."""

    def __init__(self, data: Any = None, rng: random.Random | None = None):
        self.data, self.rng = data, rng

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi)) if self.data is not None else self.rng.randint(lo, hi)

    def bool(self) -> bool:
        return self.int(0, 1) == 1

    def choice(self, seq: Any) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        return bytes(self.int(0, 255) for _ in range(n))

    def text(self, n: int) -> str:
        alphabet = "ab_.-0189 \"\\{}[]:,\u00e9\u4e2d\U0001f600\ud800"
        return "".join(self.choice(alphabet) for _ in range(self.int(0, n)))

    def float(self) -> float:
        """Any float64, NaN and the infinities included (a random bit pattern in the long loop)."""
        if self.data is not None:
            return self.data.draw(st.floats(allow_nan=True, allow_infinity=True))
        if self.rng.randint(0, 3) == 0:
            return self.rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1.7976931348623157e308])
        return struct.unpack("<d", self.rng.getrandbits(64).to_bytes(8, "little"))[0]


class Ledger:
    """A long loop's record: outcome counts per surface, the untyped errors (kind and place), the slowest inputs."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = {}
        self.seconds: Counter = Counter()
        self.slowest: dict[str, float] = {}
        self.untyped: list[dict[str, Any]] = []

    def run(self, surface: str, case: Callable[[], str], where: str = "") -> None:
        """Run one input; ``case`` returns its outcome name (an admission or a typed code); anything it raises is untyped."""
        start = time.perf_counter()
        try:
            outcome = case()
        except Exception as exc:  # noqa: BLE001 -- an untyped error: recorded (kind and place), the loop goes on
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            self.untyped.append({"surface": surface, "input": where, "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                                 "at": f"{Path(frame.filename).name}:{frame.lineno}"})
            outcome = "untyped"
        elapsed = time.perf_counter() - start
        self.seconds[surface] += elapsed
        self.slowest[surface] = max(self.slowest.get(surface, 0.0), elapsed)
        self.counts.setdefault(surface, Counter())[outcome] += 1

    def hangs(self) -> dict[str, float]:
        """The surfaces whose slowest input took :data:`HANG_S` or more."""
        return {s: t for s, t in self.slowest.items() if t >= HANG_S}

    def to_json(self) -> dict[str, Any]:
        return {"inputs": {s: sum(c.values()) for s, c in self.counts.items()},
                "per_second": {s: round(sum(self.counts[s].values()) / t, 1) for s, t in self.seconds.items() if t},
                "slowest_s": {s: round(t, 3) for s, t in self.slowest.items()},
                "outcomes": {s: dict(c.most_common()) for s, c in self.counts.items()},
                "untyped": self.untyped[:50]}


#: Values a JSON-level mutation puts in place of another (each a type, size or content some reader mishandled once).
HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 7, 2**31, 2**53 - 1, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**400, 0.5, -0.0, 1e308, -1e308,
    "", "x", "\ud800", "a\udc00b", "é✓日本", "x" * 5000, "stdio:touch /nonexistent/decodespec-fuzz-marker", "impl", "hf",
    "impl.broken.nope", "passed", "failed", "ALL_NEW", "ALL_OLD", "sha256:" + "0" * 64, "cuda:0", "float64",
    [], [1], [None], [-1], [2**60], ["x"], [[1, 2]], {}, {"op": "run"}, {"op": "stdio"}, {"#bigint": "12"}, {"tag": "None"},
    {"family": "greedy"}, {"result": "passed"}, {"a": {"b": {"c": [1]}}},
]


#: A deep-nest marker: :func:`_dumps` splices that many nested arrays in as text.
DEEP = "\x00deep:"


def _dumps(doc: Any) -> bytes:
    """``json.dumps(doc)`` with every deep-nest marker replaced by that many nested arrays around ``1``."""
    text = json.dumps(doc)
    marker = json.dumps(DEEP)[1:-1]
    while '"' + marker in text:
        start = text.index('"' + marker)
        end = text.index('"', start + 1)
        depth = int(text[start + 1 + len(marker):end])
        text = text[:start] + "[" * depth + "1" + "]" * depth + text[end + 1:]
    return text.encode()


def _paths(value: Any, prefix: tuple = (), limit: int = 4000) -> list[tuple]:
    """Every path (keys / indices) into ``value``, breadth-first, at most ``limit``."""
    out, queue = [], [(value, prefix)]
    while queue and len(out) < limit:
        item, where = queue.pop(0)
        out.append(where)
        if isinstance(item, dict):
            queue.extend((v, (*where, k)) for k, v in item.items())
        elif isinstance(item, list):
            queue.extend((v, (*where, i)) for i, v in enumerate(item))
    return out


def _set(root: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return root


def json_mutation(c: Chooser, doc: Any, prefer: tuple = ()) -> tuple[Any, str]:
    """One JSON-level mutation of ``doc`` (a deep copy); returns the new document and a description."""
    doc = json.loads(json.dumps(doc))
    base = doc
    for key in prefer:
        if isinstance(base, dict) and key in base and c.int(0, 9) < 8:
            base = base[key]
        else:
            prefer = ()
            break
    paths = _paths(base, tuple(prefer))
    path = c.choice(paths)
    kind = c.choice(["replace", "replace", "replace", "delete", "add", "deep", "number"])
    if kind == "delete" and path:
        return _set(doc, path, None, delete=True), f"delete {list(path)}"
    if kind == "add":
        target = doc
        for key in path:
            target = target[key]
        if isinstance(target, dict):
            name = c.choice(["note", "op", "#meta", "runtime", "\ud800", "x" * 300])
            target[name] = c.choice(HOSTILE)
            return doc, f"add {list(path)}.{name!r}"
        if isinstance(target, list):
            target.append(c.choice(HOSTILE))
            return doc, f"append {list(path)}"
    if kind == "deep":  # a marker, spliced in as text by _dumps (a Python object this deep could not be serialised)
        depth = c.choice([50, 2000, 200_000])
        return _set(doc, path, f"{DEEP}{depth}"), f"deep {list(path)} x{depth}"
    if kind == "number":
        value = c.int(-(2**70), 2**70) if c.bool() else c.float()
        return _set(doc, path, value), f"number {list(path)} = {value!r}"
    value = c.choice(HOSTILE)
    return _set(doc, path, value), f"replace {list(path)} = {str(value)[:40]!r}"


def byte_mutation(c: Chooser, data: bytes) -> tuple[bytes, str]:
    """One byte-level mutation: flip, insert, delete a range, truncate or splice a non-UTF-8 byte."""
    kind = c.choice(["flip", "insert", "delete", "truncate", "non_utf8"])
    at = c.int(0, max(len(data) - 1, 0))
    if kind == "flip" and data:
        return data[:at] + bytes([data[at] ^ c.int(1, 255)]) + data[at + 1:], f"flip @{at}"
    if kind == "insert":
        return data[:at] + c.bytes(c.int(1, 8)) + data[at:], f"insert @{at}"
    if kind == "delete":
        return data[:at] + data[at + c.int(1, 64):], f"delete @{at}"
    if kind == "truncate":
        return data[:at], f"truncate @{at}"
    return data[:at] + c.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]) + data[at:], f"non-utf8 @{at}"


