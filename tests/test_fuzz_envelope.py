"""Fuzzing the envelope and snapshot surfaces: every input is admitted or refused typed (issue 16).

Three Hypothesis tests, each asserting that an outcome is either success or a
:class:`~decodespec.spec.errors.DecodeSpecError` (a ``Rejection`` or ``ResourceLimit`` with a
registered code, a JSON path and a bounded message) -- never any other exception:

* :func:`test_envelope_byte_mutations`: the example envelopes ``docs/examples/*.request.json``
  with random byte edits (flip, delete, insert, duplicate a span) and spliced hostile tokens
  (integers past 2**53 or of 4,400 digits, ``NaN``, ``1e400``, lone surrogates, brackets,
  quotes, backslashes, duplicate keys), then :func:`validate_request_envelope`.
* :func:`test_envelope_field_values`: one field anywhere in an example (chosen among every JSON
  path of the document) replaced by a random JSON value, or one key renamed.
* :func:`test_snapshot_mutations`: saved snapshots of the tiny model (a sampled static-cache
  run with the stop/stream observer, a repaired snapshot with its score row, a snapshot that
  carries its admitted envelope) with one field replaced or the JSON bytes edited, then
  ``load_snapshot`` -> ``RequestRunner.restore`` -> run to the end.

Profiles: by default each test runs :data:`CI_EXAMPLES` examples (the three together take well
under 60 s on one core).  ``DECODESPEC_FUZZ_EXAMPLES=N`` runs N examples per test (the long run,
e.g. ``DECODESPEC_FUZZ_EXAMPLES=200000 nice -n 19 pytest tests/test_fuzz_envelope.py -q -p
no:cacheprovider``); ``DECODESPEC_FUZZ_REPORT=FILE`` writes the counts, outcomes and inputs per
second of the run to ``FILE`` (JSON).  No Hypothesis database is written (``database=None``).
The totals of the long run are in ``docs/results/fuzz.md``.

Source: M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data"; issue 16 (hostile input).
"""

from __future__ import annotations

import collections
import json
import os
import random
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from fuzzing import HANG_S, Chooser  # tests/ is on sys.path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import request, sampled_policy

from decodespec.impl.runtime import RequestRunner, RuntimeRequest
from decodespec.impl.snapshot import load_snapshot, save_snapshot
from decodespec.spec.envelope import validate_request_envelope
from decodespec.spec.errors import ERROR_CODES, MAX_MESSAGE_CHARS, DecodeSpecError
from decodespec.spec.policy.config import CATALOG

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "docs" / "examples").glob("*.request.json"))
#: Examples per test in the default (CI) profile.
CI_EXAMPLES = 150
NUM_EXAMPLES = int(os.environ.get("DECODESPEC_FUZZ_EXAMPLES", CI_EXAMPLES))
FUZZ = settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])

#: surface -> outcome ("admitted" or the error code) -> count, over the whole module.
STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
ELAPSED: collections.Counter = collections.Counter()
#: surface -> the longest one input took (seconds inside the surface): a hang is HANG_S or more.
SLOWEST: dict[str, float] = collections.defaultdict(float)
#: Untyped errors the long loop met (it records them and goes on; the test fails at the end).
UNTYPED: list[dict[str, Any]] = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    target = os.environ.get("DECODESPEC_FUZZ_REPORT")
    if target:
        report: dict[str, Any] = {surface: {"inputs": sum(c.values()), "seconds": round(ELAPSED[surface], 1),
                            "inputs_per_second": round(sum(c.values()) / max(ELAPSED[surface], 1e-9), 1),
                            "slowest_s": round(SLOWEST[surface], 3), "untyped": c["untyped"], "outcomes": dict(c.most_common())}
                  for surface, c in STATS.items()}
        report["untyped_errors"] = UNTYPED
        report["wrong_acceptances"] = len(WRONG)
        report["wrong"] = WRONG[:30]
        Path(target).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def _typed(surface: str, fn, *args: Any) -> Any:
    """Run ``fn(*args)``; a ``DecodeSpecError`` is recorded and must be well formed; anything else fails the test."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except DecodeSpecError as exc:
        assert exc.code in ERROR_CODES and exc.path.startswith("$"), exc
        assert len(exc.message) <= MAX_MESSAGE_CHARS + 32 and len(exc.path) <= MAX_MESSAGE_CHARS + 32
        STATS[surface][exc.code] += 1
        return None
    finally:
        elapsed = time.perf_counter() - start
        ELAPSED[surface] += elapsed
        SLOWEST[surface] = max(SLOWEST[surface], elapsed)
    STATS[surface]["admitted"] += 1
    return result


# --------------------------------------------------------------------------------------------
# Envelopes
# --------------------------------------------------------------------------------------------

RAW_EXAMPLES = [p.read_bytes() for p in EXAMPLES]
DOCS = [json.loads(raw) for raw in RAW_EXAMPLES]

#: Byte strings spliced into an envelope: each one has crashed or hung a JSON front end somewhere.
HOSTILE_TOKENS = [
    b"9007199254740992", b"9007199254740993", b"-9007199254740993", b"18446744073709551616", b"1" * 400, b"1" * 4400,
    b"1e400", b"-1e400", b"1e-400", b"NaN", b"Infinity", b"-Infinity", b"-0", b"1.0", b"0.1e1", b"null", b"true", b"[]", b"{}",
    b'"\\ud800"', b'"\\udfff\\ud800"', b'"\\u0000"', b"\xff", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"[" * 20, b"]" * 20, b"{" * 20,
    b'"', b"\\", b'\\"' * 50, b'"x' * 50, b'{"a": 1, "a": 2}', b'"' + b"x" * 5000, b",", b":", b"\x00",
]


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every JSON path of ``value`` (keys and indices), the root first."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += _paths(item, (*prefix, index))
    return out


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {k: (_replace(v, rest, value) if k == head else v) for k, v in doc.items()}
    return [(_replace(v, rest, value) if i == head else v) for i, v in enumerate(doc)]


def _rename(doc: Any, path: tuple, name: str) -> Any:
    """``doc`` with the key at ``path`` renamed to ``name`` (an index path is left as it is)."""
    if not path:
        return doc
    if len(path) == 1:
        if isinstance(doc, dict):
            return {(name if k == path[0] else k): v for k, v in doc.items()}
        return doc
    head = path[0]
    if isinstance(doc, dict):
        return {k: (_rename(v, path[1:], name) if k == head else v) for k, v in doc.items()}
    return [(_rename(v, path[1:], name) if i == head else v) for i, v in enumerate(doc)]


INTERESTING_INTS = [0, 1, -1, 2, 7, 8192, 8193, 49151, 49152, 2**31, 2**53 - 1, 2**53, 2**53 + 1, 2**63, -2**63, 10**30, 10**400,
                    1 << 20, (1 << 20) + 1, 4 * 1024 * 1024]
INTERESTING_FLOATS = [0.0, -0.0, 0.5, 1.0, 1e-300, 1e300, 1.7976931348623157e308, float("nan"), float("inf"), float("-inf"), -2.5]
INTERESTING_STRINGS = ["", "sha256:" + "0" * 64, "greedy", "multinomial", "beam", "static", "dynamic", "none", "\ud800", "x" * 3000,
                       "temperature", "top_k", "constraint", "logit_bias", "hf", "llama.cpp", "explicit", "name", "1", "0", "9" * 20]


def random_json(c: Chooser, depth: int = 0) -> Any:
    """A random JSON value: interesting scalars, random numbers and strings, small nested lists and objects."""
    kind = c.int(0, 9 if depth < 3 else 6)
    if kind == 0:
        return c.choice([None, True, False])
    if kind == 1:
        return c.choice(INTERESTING_INTS)
    if kind == 2:
        return c.int(-(2**64), 2**64)
    if kind == 3:
        return c.choice(INTERESTING_FLOATS)
    if kind == 4:
        return c.choice(INTERESTING_STRINGS)
    if kind in (5, 6):
        return c.text(12)
    if kind in (7, 8):
        return [random_json(c, depth + 1) for _ in range(c.int(0, 4))]
    return {c.choice(INTERESTING_STRINGS[5:] + [c.text(6)]): random_json(c, depth + 1) for _ in range(c.int(0, 4))}


def random_transform(c: Chooser) -> dict:
    """A transform from the catalog with random (often plausible) parameters."""
    info = CATALOG[c.choice(sorted(CATALOG))]
    out: dict[str, Any] = {"name": info.name}
    for spec in info.params:
        if c.int(0, 7) == 0:
            continue
        if c.int(0, 5) == 0:
            out[spec.name] = random_json(c)
        elif spec.kind == "number":
            out[spec.name] = c.choice([c.int(0, 1000) / 997, *INTERESTING_FLOATS, *INTERESTING_INTS])
        elif spec.kind == "integer":
            out[spec.name] = c.choice([c.int(1, 60), *INTERESTING_INTS])
        elif spec.kind == "enum":
            out[spec.name] = c.choice([*spec.choices, "other"])
        elif spec.kind == "token_bias":
            out[spec.name] = {str(c.choice([c.int(0, 300), *INTERESTING_INTS[:12]])): c.choice([1.5, -100.0, *INTERESTING_FLOATS])
                              for _ in range(c.int(0, 4))}
        elif spec.kind == "token_sequences":
            out[spec.name] = [[c.choice([c.int(0, 300), *INTERESTING_INTS[:12]]) for _ in range(c.int(0, 3))] for _ in range(c.int(0, 3))]
        else:
            states = [c.choice(["a", "b", "c", ""]) for _ in range(c.int(1, 3))]
            out[spec.name] = {"initial": c.choice([*states, "z"]),
                              "transitions": {s: {str(c.choice([c.int(0, 300), 2**53 + 1])): c.choice([*states, "z"])
                                                  for _ in range(c.int(0, 3))} for s in states}}
    return out


def mutate_bytes(c: Chooser, raw: bytes, steps: int = 6) -> bytes:
    """``raw`` with 1..``steps`` edits: flip, delete, insert, a hostile token, a duplicated span, a truncation."""
    raw = bytearray(raw)
    for _ in range(c.int(1, steps)):
        pos = c.int(0, len(raw))
        op = c.int(0, 5)
        if op == 0 and pos < len(raw):
            raw[pos] = c.int(0, 255)
        elif op == 1:
            del raw[pos:pos + c.int(1, 16)]
        elif op == 2:
            raw[pos:pos] = c.bytes(c.int(1, 8))
        elif op == 3:
            raw[pos:pos + c.int(0, 4)] = c.choice(HOSTILE_TOKENS)
        elif op == 4:
            raw[pos:pos] = raw[pos:min(len(raw), pos + c.int(1, 200))] * c.int(1, 4)
        elif op == 5 and c.int(0, 3) == 0:
            del raw[pos:]
    return bytes(raw)


def mutate_fields(c: Chooser, doc: Any, steps: int = 3) -> bytes:
    """``doc`` with 1..``steps`` edits (a value anywhere replaced, a key renamed, the policy redrawn), as JSON bytes."""
    for _ in range(c.int(1, steps)):
        op = c.int(0, 5)
        if op == 0 and isinstance(doc, dict) and isinstance(doc.get("policy"), dict):
            policy = {**doc["policy"], "transforms": [random_transform(c) for _ in range(c.int(0, 3))]}
            policy["family"] = c.choice(["greedy", "multinomial", "multinomial", "beam"])
            policy["order"] = c.choice(["default", "hf", "vllm", "llama.cpp", "explicit"])
            doc = {**doc, "policy": policy}
            continue
        path = c.choice(_paths(doc))
        if op == 1 and path and isinstance(path[-1], str):
            doc = _rename(doc, path, c.text(8))
        else:
            doc = _replace(doc, path, random_json(c))
    try:
        text = json.dumps(doc, ensure_ascii=bool(c.int(0, 1)), allow_nan=True)
    except ValueError:  # an int past Python's str-conversion limit: spliced as text by the byte mutations instead
        text = "{}"
    return text.encode("utf-8", "surrogatepass")


@FUZZ
@given(data=st.data())
def test_envelope_byte_mutations(data) -> None:
    c = Chooser(data)
    _typed("envelope_bytes", validate_request_envelope, mutate_bytes(c, c.choice(RAW_EXAMPLES)))


@FUZZ
@given(data=st.data())
def test_envelope_field_values(data) -> None:
    c = Chooser(data)
    _typed("envelope_fields", validate_request_envelope, mutate_fields(c, c.choice(DOCS)))


# --------------------------------------------------------------------------------------------
# Snapshots
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot_bases(tiny_model, byte_tokenizer, tmp_path_factory) -> list[tuple[Path, dict]]:
    """Three saved snapshots (path, document): sampled static + observer, repaired in SCORED, envelope-carrying."""
    folder = tmp_path_factory.mktemp("fuzz-snapshots")
    prompt = [1, *byte_tokenizer.encode("fuzz")]
    tiny_example = next(p for p in EXAMPLES if p.name == "tiny.request.json")
    admitted, _ = validate_request_envelope(tiny_example.read_bytes())
    requests = [
        ("sampled", request(prompt, 5, cache="static", policy=sampled_policy(), stop_strings=("zz",)), 2, "pending_suffix"),
        ("repaired", request(prompt, 5), 1, "repaired"),
        ("envelope", RuntimeRequest.from_admitted(admitted), 2, "pending_suffix"),
    ]
    out = []
    for name, req, at, form in requests:
        path = folder / f"{name}.json"
        save_snapshot(RequestRunner(tiny_model, req, tokenizer=byte_tokenizer).run(max_outputs=at).snapshot(form), path)
        # The oracle's reference: the uninterrupted run.  Resuming the untouched snapshot gives exactly it, except that a
        # resumed runner's receipts are the ones it issued (the uninterrupted run's last ones; the earlier ones are in the
        # snapshot's ledger), so the resumed result is the reference a mutant's resumed run must equal.
        uninterrupted = RequestRunner(tiny_model, req, tokenizer=byte_tokenizer).run().result()
        resumed = _resume(tiny_model, byte_tokenizer, path)
        assert _differing_fields(resumed, uninterrupted) == ["receipts"], name
        assert resumed.receipts and resumed.receipts == uninterrupted.receipts[-len(resumed.receipts):], name
        REFERENCE[str(path)] = resumed
        out.append((path, json.loads(path.read_text(encoding="utf-8"))))
    return out


#: base snapshot path -> the uninterrupted run's result (the snapshot oracle's reference).
REFERENCE: dict[str, Any] = {}
#: Admitted mutated snapshots whose resumed run is not exactly the uninterrupted run (each a wrong acceptance).
WRONG: list[dict[str, Any]] = []


def _resume(model, tokenizer, path: Path) -> Any:
    runner = RequestRunner.restore(model, load_snapshot(path), tokenizer=tokenizer)
    return runner.run().result()


def _mutation(doc: Any, mutated: bytes) -> Any:
    """Where a mutated snapshot differs from its base (JSON paths and the new values, cut), for the report."""
    from trace_oracle import _diffs

    try:
        new = json.loads(mutated)
    except (ValueError, RecursionError):
        return "unparseable bytes"
    out = []
    for path in _diffs(doc, new)[:5]:
        value = new
        try:
            for key in path:
                value = value[key]
        except (KeyError, IndexError, TypeError):
            value = "<deleted>"
        out.append([list(path), repr(value)[:80]])
    return out


#: GenerationResult fields outside the oracle: wall-clock measurements (issue 19's timeline), never equal across runs.
UNTIMED = ("timeline",)


def _differing_fields(a: Any, b: Any) -> list[str]:
    import attrs

    return [f.name for f in attrs.fields(type(a)) if f.name not in UNTIMED and getattr(a, f.name) != getattr(b, f.name)]


def mutate_snapshot(c: Chooser, doc: dict) -> bytes:
    """A snapshot document with its JSON bytes edited (one time in four) or 1-2 fields replaced."""
    if c.int(0, 3) == 0:
        return mutate_bytes(c, json.dumps(doc).encode(), steps=4)
    for _ in range(c.int(1, 2)):
        doc = _replace(doc, c.choice(_paths(doc)), random_json(c))
    try:
        return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")
    except ValueError:
        return b"{}"


def _snapshot_case(model, tokenizer, bases, c: Chooser) -> str:
    """One mutated snapshot: load, restore, run to the end; returns ``refused``, ``admitted.same_run`` or ``admitted.wrong``.

    The oracle (issue 16, "0 wrong acceptances"): a resumed run from an admitted mutated snapshot must produce
    exactly the uninterrupted run's result (every field of the GenerationResult: ids, logprobs, text, receipts,
    finish reason, frontier, RNG counter, stream report; not the wall-clock ``timeline``); anything else is a
    wrong acceptance.
    """
    path, doc = c.choice(bases)
    target = path.with_name("mutated.json")  # next to the bases: its cache.tensors still names a base's tensor file
    mutated = mutate_snapshot(c, doc)
    target.write_bytes(mutated)
    result = _typed("snapshot", _resume, model, tokenizer, target)
    if result is None:
        return "refused"
    reference = REFERENCE[str(path)]
    if not _differing_fields(result, reference):
        STATS["snapshot_oracle"]["same_run"] += 1
        return "admitted.same_run"
    STATS["snapshot_oracle"]["wrong"] += 1
    WRONG.append({"base": path.name, "differs": _differing_fields(result, reference), "mutation": _mutation(doc, mutated)})
    return "admitted.wrong"


@FUZZ
@given(data=st.data())
def test_snapshot_mutations(tiny_model, byte_tokenizer, snapshot_bases, data) -> None:
    WRONG.clear()
    outcome = _snapshot_case(tiny_model, byte_tokenizer, snapshot_bases, Chooser(data))
    assert outcome != "admitted.wrong", WRONG


@pytest.mark.skipif("DECODESPEC_FUZZ_SECONDS" not in os.environ, reason="the long fuzz loop runs only with DECODESPEC_FUZZ_SECONDS=S")
def test_long_fuzz_loop(tiny_model, byte_tokenizer, snapshot_bases) -> None:
    """The long run: the same mutations drawn from ``random.Random`` (no shrinking, much faster) for S seconds.

    Each round runs ``DECODESPEC_FUZZ_MIX`` = ``B:F:S`` inputs (default ``3:3:1``) of envelope
    bytes, envelope fields and snapshots (``1:1:0`` runs the envelope surfaces alone).
    ``DECODESPEC_FUZZ_SEED`` seeds it (default 0); a failure names the seed and the input number,
    so it can be replayed.  An input slower than ``fuzzing.HANG_S`` (10 s) fails the run as a hang.
    """
    seed = int(os.environ.get("DECODESPEC_FUZZ_SEED", "0"))
    deadline = time.monotonic() + float(os.environ["DECODESPEC_FUZZ_SECONDS"])
    rng = random.Random(seed)
    c = Chooser(rng=rng)
    rounds = 0

    def guarded(surface: str, case) -> None:
        try:
            case()
        except Exception as exc:  # noqa: BLE001 -- an untyped error: recorded (kind and place), the loop goes on
            where = traceback.extract_tb(exc.__traceback__)[-1]
            UNTYPED.append({"surface": surface, "round": rounds, "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                            "at": f"{Path(where.filename).name}:{where.lineno}"})
            STATS[surface]["untyped"] += 1

    n_bytes, n_fields, n_snapshots = (int(k) for k in os.environ.get("DECODESPEC_FUZZ_MIX", "3:3:1").split(":"))
    while time.monotonic() < deadline:
        rounds += 1
        for _ in range(n_bytes):
            guarded("envelope_bytes", lambda: _typed("envelope_bytes", validate_request_envelope, mutate_bytes(c, c.choice(RAW_EXAMPLES))))
        for _ in range(n_fields):
            guarded("envelope_fields", lambda: _typed("envelope_fields", validate_request_envelope, mutate_fields(c, c.choice(DOCS))))
        for _ in range(n_snapshots):
            guarded("snapshot", lambda: _snapshot_case(tiny_model, byte_tokenizer, snapshot_bases, c))
    assert rounds > 0
    assert not {s: t for s, t in SLOWEST.items() if t >= HANG_S}, dict(SLOWEST)
    assert not UNTYPED, UNTYPED[:5]
    assert not WRONG, WRONG[:3]
