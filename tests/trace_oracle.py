"""The wrong-acceptance oracle of the trace fuzz: is an ACCEPTED mutated trace one that deserved acceptance?

``validate-trace`` accepting a mutated trace is right in exactly three cases, decided here by machine
(issue 16, "Done when": 0 wrong acceptances):

1. **same content** -- the mutant parses to the same canonical content as its seed: the same non-blank
   lines (``impl.events.read_events`` drops blank lines and surrounding whitespace), each the same JSON
   value once numbers are compared by value and type class (``0``, ``-0.0`` and ``0.0`` are one
   integer, as JSON Schema's ``integer`` and the spec's ``int()`` read them; ``true`` is never ``1``),
   and the header's policy compared as the spec reads it (``policy_config_from_json(...).to_json()``:
   a field deleted that has that default is the same policy, with the same ``policy_digest``);
2. **free fields only** -- every differing value is at a field the format declares free
   (:data:`FREE_FIELDS`, each with its reason): a value the spec's events do not determine, so no
   validator could tell the mutant from a trace of a run that stated it;
3. anything else is a **wrong acceptance** (a test failure): a mutation the validator should have
   refused.

There is no third "re-derived valid run" class: a mutation that changes a determined field makes the file
a different claim about the run, and the seed traces are runs of our runtime whose every determined field
the validator checks, so such a mutant must be refused.

Source: issue 16 ("0 wrong acceptances"); M3.10 0x06 "Bound parsers, matchers, traces, and sensitive data".
"""

from __future__ import annotations

import json
from typing import Any

#: The fields the trace format declares free: ``(event, path)`` -> the condition under which a change is free and why.
#: ``path`` is a tuple of keys; the mutant must still pass the events schema (which bounds the domain).
FREE_FIELDS: dict[tuple[str, tuple[str, ...]], str] = {
    ("request", ("runtime", "model")): "which model computed the rows: the events record decisions, not the weights "
                                       "(the gate, not the trace, judges numerics); the schema bounds it to our models",
    ("request", ("runtime", "device")): "the device the runtime ran on leaves no mark in the events (schema: cpu / cuda[:N])",
    ("request", ("runtime", "dtype")): "the compute dtype leaves no mark in the events (schema: float32 / bfloat16 / float16)",
    ("request", ("runtime", "attention")): "the attention implementation leaves no mark in the events (schema: sdpa / eager)",
    ("request", ("runtime", "decode_kernel")): "the decode kernel leaves no mark in the events (schema: torch / native)",
    ("request", ("seed",)): "free only in a redacted trace: there the receipts' rng.key_id are keyed digests, so the seed "
                            "determines nothing the validator can see (a content trace's key_id is rng_key(identity, seed), checked)",
    ("stream", ("token_start",)): "free only in a redacted trace, within the bounds validate-trace checks (a chunk starts in "
                                  "the token where the last ended or after it): the token range is derived from the token bytes, "
                                  "which a redacted trace does not hold (its verdict lists invariant.chunk_metadata in needs_content)",
    ("stream", ("token_end",)): "as token_start",
    ("request", ("params", "max_retries")): "free only in a trace without a fault event: the retry budget shows only when a "
                                            "call fails, and any budget admits a run that never retried",
    ("request", ("params", "max_draws")): "free only at or above every decision's draws (validate-trace checks the guard "
                                          "draws <= max_draws): the bound shows only when a decision reaches it",
    ("request", ("output", "max_json_depth")): "free only without structured completion (output.structured 'none'): the "
                                               "depth bounds the JSON matcher, which does not run then",
    ("*", ("t_ns",)): "any event's optional timestamp (issue 19; spec/latency.py): host wall-clock nanoseconds, which the "
                      "spec's state machine does not determine (the schema bounds it to [0, MAX_SAFE_INT])",
    ("request", ("output", "stop_strings", "*", "digest")): "free only in a redacted trace: a stop string's keyed digest "
                                                            "(HMAC under a per-file key that is not stored) is checked by nothing "
                                                            "(the stop oracle needs the text; needs_content says so)",
    ("request", ("params", "context_cap")): "free only while the trace never reaches it (no context_length trigger, and "
                                            "prompt_len + output_count stays below both values): the cap shows only when reached",
    ("request", ("output", "stop_strings")): "free only in a content trace with no stop-string trigger or finish, for "
                                             "every string added to or removed from the list (an entry replaced, "
                                             "appended or dropped): it occurs nowhere in the output text and no "
                                             "non-empty prefix of it ends any prefix of the output text, so it could "
                                             "neither match nor hold back a suffix of the stream (checked at every "
                                             "character, a superset of the token boundaries the matcher sees)",
    ("stream", ("text_redacted", "digest")): "free only in a redacted trace: a chunk's text digest is keyed (HMAC under a "
                                             "per-file key that is not stored) and the token bytes that would relate it "
                                             "to the tokens are not in the file; the verdict lists "
                                             "invariant.chunk_metadata (chunk text) in needs_content",
    ("request", ("output", "include_stop_str")): "free only while no stop string matched (no stop_string trigger or "
                                                 "finish): it says whether a matched stop string stays in the returned "
                                                 "text, and nothing is returned differently before a match",
    ("finish", ("stream", "error")): "free only while the report says the delivery failed: the consumer's exception text "
                                     "(a runtime message, not a spec value)",
}


class _Bool:
    """A JSON boolean, kept apart from the integers 0 / 1 (Python's ``True == 1``)."""

    def __init__(self, value: bool):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Bool) and other.value is self.value

    def __hash__(self) -> int:
        return hash(("bool", self.value))

    def __repr__(self) -> str:
        return "true" if self.value else "false"


def _norm(value: Any) -> Any:
    if isinstance(value, bool):
        return _Bool(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)  # -0.0, 0.0 and 0 are one JSON Schema integer
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    return value


def canonical_lines(data: bytes) -> list[Any]:
    """The trace's content as the validator reads it: its non-blank lines, parsed and normalized (see the module docstring)."""
    from decodespec.spec.policy.config import policy_config_from_json

    out = []
    for line in data.decode("utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        rec = json.loads(line)
        if isinstance(rec, dict) and rec.get("event") == "request" and isinstance(rec.get("policy"), dict):
            try:
                rec = {**rec, "policy": policy_config_from_json(rec["policy"]).to_json()}
            except Exception:  # noqa: BLE001, S110 -- an unreadable policy stays as written (compared raw)
                pass
        out.append(_norm(rec))
    return out


def _diffs(a: Any, b: Any, path: tuple = ()) -> list[tuple]:
    """The paths where ``a`` and ``b`` differ (a key present in one only is a difference at that key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                out.append((*path, key))
            else:
                out.extend(_diffs(a[key], b[key], (*path, key)))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diffs(x, y, (*path, i))]
    return [] if a == b and type(a) is type(b) else [path]


def _stop_matched(lines: list[Any]) -> bool:
    """Whether any event records a stop-string trigger or finish."""
    return any(isinstance(r, dict) and ("stop_string" in (r.get("triggers") or ()) or r.get("finish_reason") == "stop_string")
               for r in lines)


def _stop_strings_free(header: dict[str, Any], lines: list[Any], old: Any, new: Any) -> bool:
    """FREE_FIELDS[request, output.stop_strings]: every added or removed string is inert in this output."""
    data = header.get("data")
    if not isinstance(data, dict) or data.get("classification") != "content":
        return False
    if not (isinstance(old, list) and isinstance(new, list) and all(isinstance(s, str) for s in old + new)):
        return False
    events = [r for r in lines if isinstance(r, dict)]
    if _stop_matched(events):
        return False
    texts = [r["text"] for r in events if r.get("event") in ("stream", "finish") and isinstance(r.get("text"), str)]
    if not texts:
        return False
    output = "".join(texts)
    for stop in set(old) ^ set(new):
        if not stop or stop in output:
            return False
        # A holdback needs an output prefix whose suffix is a non-empty prefix of the stop string.
        if any(output[:end].endswith(stop[:k]) for end in range(1, len(output) + 1) for k in range(1, len(stop) + 1)):
            return False
    return True


def _free(event: str, path: tuple, header: dict[str, Any], rec: dict[str, Any], lines: list[Any],
          old_rec: dict[str, Any]) -> bool:
    if path == ("t_ns",):  # any event's optional timestamp (FREE_FIELDS["*", ("t_ns",)])
        return True
    if event == "request" and path[:2] == ("output", "stop_strings") and (
            len(path) == 2 or (len(path) == 3 and isinstance(path[2], int))):
        return _stop_strings_free(header, lines, _at(old_rec, ("output", "stop_strings")), _at(rec, ("output", "stop_strings")))
    if (event, path) not in FREE_FIELDS and not (len(path) == 4 and (event, (*path[:2], "*", path[3])) in FREE_FIELDS):
        return False
    data = header.get("data")
    redacted = isinstance(data, dict) and data.get("classification") == "redacted"
    if path in (("seed",), ("token_start",), ("token_end",)):
        return redacted
    if (len(path) == 4 and path[:2] == ("output", "stop_strings") and path[3] == "digest") or path == ("text_redacted", "digest"):
        return redacted
    if path == ("params", "context_cap"):
        cap = header["params"]["context_cap"]
        reached = max((r["frontier"]["prompt_len"] + r["frontier"]["output_count"] for r in lines
                       if isinstance(r, dict) and isinstance(r.get("frontier"), dict)), default=0)
        fired = any(isinstance(r, dict) and "context_length" in (r.get("triggers") or ()) for r in lines)
        return not fired and isinstance(cap, int) and reached < cap
    if path == ("params", "max_retries"):
        return not any(isinstance(r, dict) and r.get("event") == "fault" for r in lines)
    if path == ("params", "max_draws"):
        draws = [r.get("draws") for r in lines if isinstance(r, dict) and r.get("event") == "decision"]
        value = header["params"]["max_draws"]
        return all(isinstance(d, int) and d <= value for d in draws)
    if path == ("output", "include_stop_str"):
        return not _stop_matched(lines)
    if path == ("output", "max_json_depth"):
        return header.get("output", {}).get("structured") == "none"
    if path == ("stream", "error"):
        report = rec.get("stream")
        return isinstance(report, dict) and report.get("failed") is True
    return True


def _at(value: Any, path: tuple) -> Any:
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def classify_acceptance(original: bytes, mutated: bytes) -> tuple[str, str]:
    """``(class, detail)`` of an accepted mutant: ``("same", "")``, ``("free", fields)`` or ``("wrong", why)``."""
    try:
        before, after = canonical_lines(original), canonical_lines(mutated)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return "wrong", f"the accepted mutant does not even parse: {type(exc).__name__}"
    if before == after:
        return "same", ""
    if len(before) != len(after):
        return "wrong", f"{len(before)} lines became {len(after)}"
    header = after[0] if after and isinstance(after[0], dict) else {}
    free = []
    for index, (a, b) in enumerate(zip(before, after)):
        for path in _diffs(a, b):
            event = b.get("event") if isinstance(b, dict) else None
            if isinstance(a, dict) and isinstance(b, dict) and a.get("event") == event and _free(
                    str(event), path, header, b, after, a):
                free.append(f"{event}.{'.'.join(map(str, path))}")
            else:
                return "wrong", f"line {index + 1} ({event}) differs at {list(path)}"
    return "free", ",".join(sorted(set(free)))
