"""What the fuzz suites share: the choices a mutation makes, from Hypothesis or from ``random.Random``.

A mutation is written once against :class:`Chooser`; the CI profile draws its choices from
Hypothesis (``data.draw``: shrinkable, derandomized under ``CI=true``), the long loops from a seeded
``random.Random`` (no shrinking, about ten times faster per input), so both profiles run the same
mutations.  :class:`Ledger` keeps a long loop's outcome counts, untyped errors and slowest inputs.

Source: issue 16 deliverable 7 (a short CI profile and an hour-long run of the same fuzzers).
"""

from __future__ import annotations

import math
import random
import struct
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

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
