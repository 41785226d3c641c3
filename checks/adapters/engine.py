"""The engine route: the gate owns the request controller, a runtime process answers only model calls.

``open_adapter('engine:CMD')`` spawns ``CMD`` (split like a shell would, no shell; a leading
``python`` means this interpreter) and returns ``PeerAdapter(StdioEngine(CMD), "engine")``: the
request controller the HF and llama.cpp adapters share (:class:`~decodespec.checks.adapters.peer.PeerAdapter`)
runs in the gate's process and owns the whole contract -- phases, receipt ids, the due call,
interrupt points, the G = 0 branches, the owed repair call, the context cap and every
``transition.not_enabled`` refusal -- while the runtime process answers the engine questions of
:class:`~decodespec.checks.adapters.peer.PeerEngine` over JSON lines: "start this request", "run the
model over positions ``[start, start + length)`` and give me the last row", "roll back to P",
"decide on this row with your own sampler", "which finish triggers fire", "your K/V rows".

Wire format (``decodespec.engine.v1``; every message is one JSON object on one line, UTF-8;
schema :data:`ENGINE_SCHEMA_PATH` = ``spec/schemas/engine.v1.json``, which validates every
message both ways):

* request (gate -> engine, on the engine's stdin): ``{"id": n, "method": NAME, "params": {...}}``;
* response (engine -> gate, on its stdout, line-buffered): ``{"id": n, "result": {...}}`` or
  ``{"id": n, "error": {"code", "message"}}`` (a registered error code, e.g.
  ``adapter.unsupported``).

=================  ===========================================  ==============================================
method             params                                       result
=================  ===========================================  ==============================================
``hello``          ``protocol``                                 ``protocol``, ``name``, ``version``,
                                                                ``capabilities``, ``methods`` (optional ones)
``window``         ``config``                                   ``window`` (positions the model can hold)
``start``          ``config``, ``context_cap``, ``reuse``       ``processed``, ``physical``
``forward``        ``start``, ``length``, ``ids``               ``logits`` (the call's last row), ``processed``,
                                                                ``physical``
``rollback``       ``processed``                                ``processed``, ``physical``
``decide``         ``logits``, ``ids``, ``output_count``        ``token_id``; ``support_ids``,
                                                                ``support_probs``, ``draws`` optional
``accept``         ``token_id``                                 ``{}``                      (optional)
``triggers``       ``ids``, ``output_count``                    ``triggers``                (optional)
``text``           ``ids``                                      ``text``                    (optional)
``cache_probe``    ``processed``                                ``cache``                   (optional)
``stop``           ``{}``                                       ``{}``, then the process exits
=================  ===========================================  ==============================================

Arrays the engine sends (``logits``, ``cache``) are a JSON array of numbers (nested for
``cache``) or ``{"dtype": "float32", "shape": [...], "base64": ...}`` (little-endian bytes);
rows the gate sends (``decide``'s ``logits``) are a JSON array of numbers.

Optional methods and what their absence means (the hello's ``methods`` lists those implemented):

* ``accept``: nothing to record (a sampler chain without history).
* ``triggers``: the envelope's own rules on the committed sequence: ``eos`` when the last id is
  in ``config.eos_ids``, ``length`` when ``output_count >= max_new_tokens``, ``context_length``
  when ``len(ids) >= context_cap``; then ``stop_strings`` and ``structured`` cannot be declared
  (they need the runtime's matcher).  The gate then checks the engine's rows and ids, not its
  stopping code.
* ``text``: the returned text is not exposed (``Observation.text = None``, skipped by the ladder).
* ``cache_probe``: committed K/V rows are not exposed; ``cache_probe`` cannot be declared, so the
  TENSOR layer compares score rows only.

Capabilities: the hello's ``capabilities`` use the names of :data:`~decodespec.checks.adapters.CAPABILITIES`
(:mod:`.features`), except :data:`ENGINE_REFUSED_CAPABILITIES` (snapshots, faults and our native
kernel have no engine method in version 1).  The controller adds :data:`CONTROLLER_CAPABILITIES`
(what it implements over any engine: separate decide / commit, calls in flight, the raw row, the
G = 0 branches, the final-cache promises and the repair call, the context cap, the retry budget).  ``policy_rows`` declares that ``decide``
returns the processed support; ``cache_probe`` needs the ``cache_probe`` method.

Failures of the engine process are typed ``adapter.protocol`` rejections, never a hang: a line
that is not JSON, not an object, longer than :data:`MAX_LINE_BYTES`, outside the schema, or that
answers another ``id``; no answer within the per-request timeout; the process exiting (with the
tail of its stderr).  An ``error`` answer with a registered code is raised as that typed error
(``start`` / ``window``: the config is refused -- ``adapter.unsupported`` makes the gate skip the
case; ``decide``: ``policy.empty_support`` finishes the request with ``constraint_error``); an
unregistered code is ``adapter.protocol``.

Source: issue 22 item 2 (a reusable controller: the runtime author writes the model calls, not
the contract); :mod:`decodespec.checks.adapters.peer` (the controller and the engine protocol);
research/formal-anchors-survey.md 5.4 (Bowtie IHOP: handshake, one command per line).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from decodespec.spec.enums import FinishReason
from decodespec.spec.errors import ERROR_CODES, Rejection, ResourceLimit

from . import ADAPTER_PROTOCOL, CAPABILITIES, CaseConfig
from .peer import PeerAdapter, PeerDecision, bound_triggers
from .wire import IntegerOutOfRange, bounded_int

__all__ = [
    "CONTROLLER_CAPABILITIES",
    "DEFAULT_TIMEOUT",
    "ENGINE_PROTOCOL",
    "ENGINE_REFUSED_CAPABILITIES",
    "ENGINE_SCHEMA_PATH",
    "MAX_LINE_BYTES",
    "OPTIONAL_METHODS",
    "OP_AND_PROBE_MEANINGS",
    "EngineAdapter",
    "StdioEngine",
    "available",
    "capabilities_markdown",
    "create",
    "engine_schema",
]

#: The protocol name the hello carries both ways.
ENGINE_PROTOCOL = "decodespec.engine.v1"
#: The JSON Schema of every engine message.
ENGINE_SCHEMA_PATH = Path(__file__).resolve().parent.parent.parent / "spec" / "schemas" / "engine.v1.json"
#: Seconds to wait for one answer (the first ``window`` / ``start`` loads the model); ``$DECODESPEC_ENGINE_TIMEOUT``
#: overrides it for the gate's runs.
DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "DECODESPEC_ENGINE_TIMEOUT"
#: Longest line the gate reads from an engine, in bytes (a SmolLM2 K/V probe of a long request fits).
MAX_LINE_BYTES = 256 * 1024 * 1024
#: Methods an engine may leave out (listed in the hello's ``methods`` when implemented).
OPTIONAL_METHODS = ("accept", "triggers", "text", "cache_probe")
#: What the controller implements over any engine (added to the engine's declaration).
CONTROLLER_CAPABILITIES = frozenset({
    "decide_commit", "inflight", "logits", "termination.zero_new_tokens:reject", "termination.zero_new_tokens:prefill_only",
    "termination.max_total_tokens", "output.final_cache:all_outputs", "output.final_cache:none",
    "runtime.max_retries",  # the retry budget after a recovered fault: a no-op on an engine, which has no faults
})
#: Capabilities an engine cannot declare in version 1 (no engine method serves them).
ENGINE_REFUSED_CAPABILITIES = frozenset({"snapshot", "faults", "decode_kernel:native", "beam", "stream"})
#: Capabilities that need an optional method.
_NEEDS_METHOD = {"cache_probe": "cache_probe", "stop_strings": "triggers", "structured": "triggers"}
#: What each op / probe capability declares (:data:`~decodespec.checks.adapters.OP_AND_PROBE_CAPABILITIES`; a test keeps
#: the keys equal), for the generated capability table of docs/adapters.md.
OP_AND_PROBE_MEANINGS = {
    "decide_commit": "separate decide / commit ops (stale and duplicate receipts)",
    "inflight": "launch / complete ops: a call stays in flight, so a cancel can arrive during it",
    "faults": "fault / recover ops (a device fault of the call in flight, a missing state lane)",
    "snapshot": "snapshot / restore ops (pending-suffix and repaired forms, corrupted restores refused)",
    "reuse": "a new request on the same cache object, which forgets every row",
    "logits": "the raw score row of each decision (TENSOR layer)",
    "policy_rows": "the processed support and its probabilities (POLICY layer)",
    "cache_probe": "the committed K (after RoPE) and V rows (TENSOR layer)",
    "decode_kernel:native": "our runtime's native C decode kernel (impl only)",
    "rank_faults": "fault kinds rank_kill / rank_stall: one rank of a tensor-parallel call dies or stalls (impl-tp only)",
}
_COMMIT_TRIGGERS = {FinishReason.EOS, FinishReason.LENGTH, FinishReason.CONTEXT_LENGTH, FinishReason.STOP_STRING,
                    FinishReason.STRUCTURED, FinishReason.STRUCTURED_ERROR}


def available() -> str | None:
    """Always usable (whether the command runs is found out at the hello)."""
    return None


def create(command: str = "", **options: Any) -> EngineAdapter:
    """``EngineAdapter(StdioEngine(command), "engine")`` (a :class:`PeerAdapter`).

    ``timeout`` (seconds per answer) may be given, else ``$DECODESPEC_ENGINE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`;
    other options are ignored.

    Raises:
        Rejection: ``adapter.protocol`` for an empty command or a failed hello.
    """
    timeout = options.get("timeout", os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        raise Rejection(ADAPTER_PROTOCOL, f"${TIMEOUT_ENV} is not a number of seconds: {str(timeout)[:40]!r}", "$.timeout") from None
    if not 0 < timeout < float("inf"):
        raise Rejection(ADAPTER_PROTOCOL, f"the engine timeout must be a positive number of seconds, got {timeout}", "$.timeout")
    return EngineAdapter(StdioEngine(command, timeout=timeout), "engine")


class EngineAdapter(PeerAdapter):
    """:class:`~decodespec.checks.adapters.peer.PeerAdapter` over a :class:`StdioEngine` that also ends the engine process."""

    def close(self) -> None:
        """Drop the request, then ``stop`` the engine process."""
        super().close()
        self.engine.close()


@functools.lru_cache(maxsize=1)
def engine_schema() -> dict[str, Any]:
    """``spec/schemas/engine.v1.json``, parsed."""
    return json.loads(ENGINE_SCHEMA_PATH.read_text(encoding="utf-8"))


@functools.cache
def _validator(definition: str) -> jsonschema.Draft202012Validator:
    schema = engine_schema()
    return jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": f"#/$defs/{definition}"})


def _protocol(message: str, path: str = "$") -> Rejection:
    return Rejection(ADAPTER_PROTOCOL, message, path)


def _check(definition: str, value: Any, where: str) -> None:
    """Validate ``value`` against ``$defs/<definition>``; the first error is ``adapter.protocol`` at its path."""
    error = next(iter(_validator(definition).iter_errors(value)), None)
    if error is not None:
        path = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise _protocol(f"{where} does not match spec/schemas/engine.v1.json#/$defs/{definition} at {path}: {error.message[:200]}",
                        path)


def _array(value: Any, ndim: int, path: str) -> np.ndarray:
    """A float32 array from a JSON array of numbers or a ``{"dtype", "shape", "base64"}`` object, of ``ndim`` dimensions."""
    try:
        if isinstance(value, Mapping):
            raw = base64.b64decode(value["base64"], validate=True)
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape([int(n) for n in value["shape"]])
        else:
            arr = np.asarray(value, dtype=np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise _protocol(f"bad array: {str(exc)[:200]}", path) from None
    if arr.ndim != ndim or arr.size == 0:
        raise _protocol(f"expected a non-empty {ndim}-dimensional array, got shape {list(arr.shape)}", path)
    return arr


def _engine_route(name: str) -> str:
    if name in CONTROLLER_CAPABILITIES:
        return "the controller (always declared)"
    if name in ENGINE_REFUSED_CAPABILITIES:
        return f"not in {ENGINE_PROTOCOL}"
    if name in _NEEDS_METHOD:
        return f"the engine, with its `{_NEEDS_METHOD[name]}` method"
    return "the engine"


def capabilities_markdown() -> str:
    """The capability table of docs/adapters.md, generated from :data:`~decodespec.checks.adapters.CAPABILITIES` (names),
    :mod:`.features` (the schema path each feature name stands for) and this module (who serves it on the engine route).

    A test compares the page's table with this text; regenerate it with
    ``python -c "from decodespec.checks.adapters.engine import capabilities_markdown; print(capabilities_markdown())"``.
    """
    from .features import CASE_ONLY_FEATURES, CONFIG_FIELDS, SHORT_NAMES, feature_capabilities, sendable_features

    paths = feature_capabilities()
    long_names = {short: full for full, short in SHORT_NAMES.items()}
    fields = {f"{section}.{prop}": field for field, (section, prop) in CONFIG_FIELDS.items()}
    sendable = sendable_features() | CASE_ONLY_FEATURES
    rows = ["| name | what it declares | on the engine route |", "| --- | --- | --- |"]
    for name in sorted(OP_AND_PROBE_MEANINGS):
        rows.append(f"| `{name}` | {OP_AND_PROBE_MEANINGS[name]} | {_engine_route(name)} |")
    for name in sorted(paths, key=lambda n: (paths[n].startswith("policy.transforms"), paths[n], n)):
        path = paths[name]
        full = long_names.get(name, name)
        value = full.split(":", 1)[1] if ":" in full and not full.startswith("transform:") else None
        what = f"request schema `{path}`" + (f" = `{value}`" if value is not None else " set")
        if path.startswith("policy.transforms"):
            what = f"the M3.8 policy transform `{name.split(':', 1)[1]}`"
        elif path.startswith("policy."):
            what = f"M3.8 policy field `{path[7:]}`" + (f" = `{value}`" if value is not None else " set")
        if path in fields:
            what += f" (case config `{fields[path]}`)"
        if name not in sendable:
            what += "; the gate sends no such case today"
        rows.append(f"| `{name}` | {what} | {_engine_route(name)} |")
    return "\n".join(rows) + "\n"


class StdioEngine:
    """A :class:`~decodespec.checks.adapters.peer.PeerEngine` in another process (see the module docstring).

    Args:
        command: The engine's command line, e.g. ``"python docs/examples/engine_tiny.py --model-dir tiny/"``.
        timeout: Seconds to wait for each answer.

    Raises:
        Rejection: ``adapter.protocol`` when the process cannot start or the hello fails.
    """

    name = "engine"

    def __init__(self, command: str, *, timeout: float = DEFAULT_TIMEOUT):
        argv = shlex.split(command)
        if not argv:
            raise _protocol("engine needs a command: --runtime engine:'CMD ARGS'", "$.runtime")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        self.command, self.timeout = command, timeout
        self.stderr = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - the engine owns it until close()
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as exc:
            self.stderr.close()
            raise _protocol(f"cannot start {command!r}: {exc}", "$.runtime") from None
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.next_id = 0
        self.config: CaseConfig | None = None
        self.context_cap = 0
        self._processed = self._physical = 0
        self.vocab: int | None = None
        try:
            hello = self._call("hello", protocol=ENGINE_PROTOCOL)
            self._accept_hello(hello)
        except Rejection:
            self.close()
            raise

    def _accept_hello(self, hello: Mapping[str, Any]) -> None:
        caps, methods = set(hello["capabilities"]), set(hello["methods"])
        unknown = sorted(caps - CAPABILITIES)
        if unknown:
            raise _protocol(f"unknown capabilities {unknown} in the hello (names: decodespec.checks.adapters.CAPABILITIES)",
                            "$.result.capabilities")
        refused = sorted(caps & ENGINE_REFUSED_CAPABILITIES)
        if refused:
            raise _protocol(f"an engine cannot declare {refused} in {ENGINE_PROTOCOL} (no engine method serves them)",
                            "$.result.capabilities")
        lacking = sorted(f"{cap} needs the {method!r} method" for cap, method in _NEEDS_METHOD.items() if cap in caps and method not in methods)
        if lacking:
            raise _protocol(f"the hello declares capabilities without their methods: {lacking}", "$.result.methods")
        self.implementation = dict(hello)
        self.methods = frozenset(methods)
        self.capabilities = frozenset(caps | CONTROLLER_CAPABILITIES)

    # -- transport -----------------------------------------------------------------------
    def _pump(self) -> None:
        stream = self.process.stdout
        while True:
            line = stream.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            self.lines.put(line)
            if len(line) > MAX_LINE_BYTES:
                break  # the reader stops: the answer is refused, and nothing more is read
        self.lines.put(None)

    def _stderr_tail(self) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - 2000))
            return self.stderr.read().decode("utf-8", errors="replace")
        except (OSError, ValueError):
            return ""

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            pass

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one request and return its validated ``result``.

        Raises:
            Rejection / ResourceLimit: the engine's registered error code; ``adapter.protocol`` for a
                failed transport, a malformed answer or an unregistered code.
        """
        request = {"id": self.next_id, "method": method, "params": params}
        self.next_id += 1
        if self.process.poll() is not None:
            raise _protocol(f"the engine process exited with {self.process.returncode} before {method!r}: {self._stderr_tail()}")
        try:
            self.process.stdin.write(json.dumps(request, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise _protocol(f"cannot write {method!r} to the engine process: {exc}; {self._stderr_tail()}") from None
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            self._kill()  # a late answer would be read as the next request's: the engine is done
            raise _protocol(f"no answer to {method!r} within {self.timeout:g} s (the engine process was killed)") from None
        if line is None:
            self._kill()
            raise _protocol(f"the engine process exited with {self.process.returncode} during {method!r}: {self._stderr_tail()}")
        if len(line) > MAX_LINE_BYTES:
            self._kill()
            raise _protocol(f"the answer to {method!r} is longer than {MAX_LINE_BYTES} bytes (the engine process was killed)")
        try:
            answer = json.loads(line, parse_int=bounded_int)
        except (json.JSONDecodeError, UnicodeDecodeError, IntegerOutOfRange) as exc:
            raise _protocol(f"the answer to {method!r} is not a JSON line: {exc}; line starts {line[:120]!r}") from None
        _check("response", answer, "$")
        if answer["id"] != request["id"]:
            raise _protocol(f"the answer id {answer['id']} does not echo the request id {request['id']} ({method!r})", "$.id")
        if "error" in answer:
            code, message = answer["error"]["code"], answer["error"]["message"]
            entry = ERROR_CODES.get(code)
            if entry is None:
                raise _protocol(f"the engine answered {method!r} with an unregistered code {code!r}: {message}", "$.error.code")
            raise (ResourceLimit if entry.kind == "resource_limit" else Rejection)(code, f"[{method}] {message}")
        _check(f"{method}_result", answer["result"], "$.result")
        return answer["result"]

    def _frontiers(self, result: Mapping[str, Any]) -> None:
        self._processed, self._physical = int(result["processed"]), int(result["physical"])

    # -- PeerEngine ----------------------------------------------------------------------
    def window_for(self, config: CaseConfig) -> int:
        """The engine's ``window`` for the case's model (positions; the engine loads the model)."""
        return int(self._call("window", config=config.to_json())["window"])

    def start(self, config: CaseConfig, *, context_cap: int, reuse: bool = False) -> None:
        """``start``: the engine builds the request (cache, sampler); a refusal is its typed error."""
        self._frontiers(self._call("start", config=config.to_json(), context_cap=context_cap, reuse=reuse))
        self.config, self.context_cap = config, context_cap

    def processed(self) -> int:
        """P as the engine reported it after its latest state change (``start``, ``forward``, ``rollback``)."""
        return self._processed

    def physical(self) -> int:
        """Physical rows as the engine reported them after its latest state change."""
        return self._physical

    def forward(self, sequence: list[int], start: int, length: int) -> np.ndarray:
        """``forward`` over ``sequence[start:start + length]``; the engine's last row.

        Shapes: returns ``float32[V]`` (V fixed by the first row of the process).

        Raises:
            Rejection: ``adapter.protocol`` for a row of another length.
        """
        result = self._call("forward", start=start, length=length, ids=list(sequence[start:start + length]))
        self._frontiers(result)
        row = _array(result["logits"], 1, "$.result.logits")
        if self.vocab is not None and row.shape[0] != self.vocab:
            raise _protocol(f"a row of {row.shape[0]} logits after rows of {self.vocab}", "$.result.logits")
        self.vocab = row.shape[0]
        return row

    def rollback(self, processed: int) -> None:
        """``rollback``: the engine drops every row at or after ``processed``."""
        self._frontiers(self._call("rollback", processed=processed))

    def decide(self, row: np.ndarray, sequence: list[int], output_count: int) -> PeerDecision:
        """``decide``: the engine's own policy code on ``row``.

        Raises:
            Rejection: the engine's ``policy.empty_support`` (the controller finishes with
                ``constraint_error``); ``adapter.protocol`` for an id outside ``[0, V)``, a
                support without probabilities of the same length, or no support although
                ``policy_rows`` is declared.
        """
        values = [float(v) for v in np.asarray(row, dtype=np.float32)]
        result = self._call("decide", logits=values, ids=list(sequence), output_count=output_count)
        token = int(result["token_id"])
        if not 0 <= token < len(values):
            raise _protocol(f"decide selected {token}, outside [0, {len(values)})", "$.result.token_id")
        ids, probs = result.get("support_ids"), result.get("support_probs")
        if (ids is None) != (probs is None) or (ids is not None and len(ids) != len(probs)):
            raise _protocol("support_ids and support_probs come together, with one probability per id", "$.result.support_probs")
        if ids is None and "policy_rows" in self.capabilities:
            raise _protocol("the engine declares policy_rows but its decide returned no support", "$.result.support_ids")
        support = None if ids is None else (np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float32))
        return PeerDecision(token, *(support or (None, None)), result.get("draws"))

    def accept(self, token_id: int) -> None:
        """``accept`` when the engine has it (a sampler chain with history), else nothing."""
        if "accept" in self.methods:
            self._call("accept", token_id=int(token_id))

    def triggers(self, sequence: list[int], output_count: int) -> set[FinishReason]:
        """The engine's ``triggers``, else the envelope's EOS / length / context-length rules (module docstring)."""
        if "triggers" in self.methods:
            return {FinishReason(t) for t in self._call("triggers", ids=list(sequence), output_count=output_count)["triggers"]}
        fired = bound_triggers(sequence, output_count, self.config.max_new_tokens, self.context_cap)
        if sequence and sequence[-1] in self.config.eos_ids:
            fired.add(FinishReason.EOS)
        return fired

    def text(self, output_ids: list[int]) -> str | None:
        """The engine's ``text`` of ``output_ids``, else ``None`` (not exposed)."""
        if "text" not in self.methods:
            return None
        return str(self._call("text", ids=list(output_ids))["text"])

    def cache_probe(self, processed: int) -> np.ndarray | None:
        """The engine's committed K/V rows ``float32[layers, 2, H_kv, P, D]``, else ``None``.

        Raises:
            Rejection: ``adapter.protocol`` for a probe that is not 5-dimensional or holds another P.
        """
        if "cache_probe" not in self.methods or "cache_probe" not in self.capabilities:
            return None
        cache = _array(self._call("cache_probe", processed=processed)["cache"], 5, "$.result.cache")
        if cache.shape[1] != 2 or cache.shape[3] != processed:
            raise _protocol(f"a K/V probe of shape {list(cache.shape)} is not [layers, 2, H_kv, {processed}, D]", "$.result.cache")
        return cache

    def save(self) -> Any:  # pragma: no cover - the snapshot capability cannot be declared (ENGINE_REFUSED_CAPABILITIES)
        """Not in engine v1."""
        raise _protocol(f"{ENGINE_PROTOCOL} has no snapshots", "$.op")

    def load(self, blob: Any) -> None:  # pragma: no cover - see save
        """Not in engine v1."""
        raise _protocol(f"{ENGINE_PROTOCOL} has no snapshots", "$.op")

    def close(self) -> None:
        """``stop``, then wait for the process (killed after 10 s)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"id": self.next_id, "method": "stop", "params": {}}).encode() + b"\n")
                self.process.stdin.flush()
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self._kill()
        self.stderr.close()
