"""Replayable conformance traces: ITF files of lock-step runs (``decodespec.trace``, version 1).

A trace is an ITF trace (Apalache ADR-015, :mod:`decodespec.checks.modelcheck.itf`) whose ``#meta`` holds
everything a replay needs, as plain JSON:

* ``format: "decodespec.trace"``, ``format_version`` (:data:`TRACE_FORMAT_VERSION`);
* ``runtime`` (``impl``, ``hf``, ``llamacpp``, ``vllm``, ``stdio:CMD``, ``engine:CMD`` or a registered broken runtime,
  :data:`RUNTIMES`), ``model``, ``seed`` (the Hypothesis seed, when generated), ``config`` (the
  :class:`~decodespec.checks.adapters.CaseConfig` JSON), ``tolerance``;
* ``actions``: the contract actions after the implicit ``reset`` (step 0);
* ``mutant`` (optional): the failure-lab mutant (``mutant.<name>``, :mod:`decodespec.checks.lab.mutants`)
  installed when the trace was recorded (``pytest checks/ --mutant NAME``, ``decodespec
  mutants``); absent when none was.  :func:`replay` installs it again (with the gate's reference
  on the oracle side, as the gate does), so a mutant's failure trace reproduces;
* ``threads`` (optional): torch's intra-op thread count when the trace was recorded
  (``torch.get_num_threads()``).  A CPU float32 reduction rounds differently when it is split over
  another number of threads, so a verdict that rests on bit-exact scores (a natural float32 tie)
  reproduces only under the recorded count; :func:`replay` sets it for the replay and restores it;
* ``cpu_capability`` (optional): ``torch.backends.cpu.get_cpu_capability()`` when the trace was
  recorded (``DEFAULT``, ``AVX2``, ``AVX512``: the vectorised kernels, fixed at torch's import by
  ``ATEN_CPU_CAPABILITY`` or the CPU), and ``exact_floats`` (optional, ``true``): the verdict rests
  on bit-exact float32 values; replayed under another capability and not reproduced, the result
  says plainly that this process cannot reproduce it (:func:`cannot_reproduce_here`);
* ``verdict``: the **expected verdict** -- ``passed``, or ``failed`` / ``undecided`` with its
  ladder ``layer``, ``rule`` and ``check``, the ``step`` it was found at, expected, actual and
  the message, and (optional) ``probe``: a bounded probe of the rows that failed -- the worst
  coordinate (vocabulary id; or layer, K / V, head, position, dim) with both values and the
  bound, and the largest differences, both sides, capped (:attr:`~decodespec.checks.gate.ladder.Verdict.probe`);
  replay does not read it;
* ``description``, ``features`` (the ops used), ``spec_refs`` (rule ids), ``generator``.

``vars`` / ``states`` record each step as ITF values for trace viewers: ``action``, the
``runtime`` and ``spec`` results, the ``observation`` summary, the spec ``state`` and the step
``verdict`` (ITF has no floats or nulls: floats are written as decimal strings, ``None`` as
Quint's ``None`` variant).  Replay reads only ``#meta``.

:func:`replay` re-runs the actions against the spec and the named runtime and reports whether
the run's verdict reproduces the recorded one (same result, layer and rule).

Versioning (test262 style, traces/README.md): a change in how traces are *interpreted* --
the meaning of an action or an observation field, the ladder's layers or order, a tolerance --
bumps :data:`TRACE_FORMAT_VERSION`; a replay refuses another version.

Source: research/formal-anchors-survey.md 2.6 (export the shrunk example when ``is_final``),
4.3 (test262 versioning), 5.1 (ITF and project conventions); docs/design.md section 11.

Size: one format: ITF trace writing, loading with its typed refusals, and replay against a named
runtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import jsonschema

from decodespec.spec.errors import DecodeSpecError, Rejection, quote_content, register_code
from decodespec.spec.passport import REDACTED, SYNTHETIC, SYNTHETIC_PASSPORT, TRACE_REDACTED, passport_from_json
from decodespec.spec.policy.config import policy_config_from_json

from ..adapters import COMMAND_RUNTIMES, Adapter, CaseConfig, check_action, open_adapter, parse_runtime
from ..gate.ladder import Verdict
from . import itf

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "MAX_NAME_PART",
    "MAX_TRACE_BYTES",
    "MAX_TRACE_NAME",
    "META_SCHEMA",
    "RUNTIMES",
    "RUNTIME_CHECKED_ENV",
    "TRACE_FORMAT",
    "TRACE_FORMAT_VERSION",
    "TRACE_INVALID",
    "TRACE_RUNTIME_REFUSED",
    "ReplayResult",
    "cannot_reproduce_here",
    "check_replay_runtime",
    "check_runtime",
    "cpu_environment",
    "default_trace_dir",
    "installed_mutant",
    "intra_op_threads",
    "load_trace",
    "make_trace",
    "mutant_installed",
    "name_slug",
    "open_runtime",
    "record",
    "replay",
    "runtime_command",
    "stdio_command",
    "trace_file_name",
    "write_trace",
]

TRACE_FORMAT = "decodespec.trace"
#: Bump when the interpretation of a trace changes (see the module docstring).
TRACE_FORMAT_VERSION = 1
TRACE_INVALID = register_code(
    "trace.invalid_conformance_trace", "rejection", "traces/README.md (decodespec.trace)",
    "A conformance trace file is not UTF-8 JSON of at most 64 MiB, not an ITF decodespec.trace of this format version, "
    "or a #meta field replay reads is missing or outside its domain (META_SCHEMA, a lone surrogate, the case config "
    "and its policy, an action); the path names the field.")
_VARS = ("action", "runtime", "spec", "observation", "state", "verdict")

#: Named runtimes beyond :func:`~decodespec.checks.adapters.open_adapter`'s: name -> adapter factory (the
#: deliberately broken runtimes of :data:`decodespec.checks.lab.broken.BROKEN_RUNTIMES` are added on first use).
RUNTIMES: dict[str, Callable[[], Adapter]] = {}


def _vllm() -> Adapter:
    """The ``vllm`` runtime: a server in vLLM's own environment (:mod:`decodespec.checks.adapters.vllm`)."""
    from ..adapters import AdapterUnavailable, vllm

    reason = vllm.available()
    if reason is not None:
        raise AdapterUnavailable(reason)
    return vllm.create()


RUNTIMES["vllm"] = _vllm


def _register_broken(name: str) -> None:
    """Add :data:`decodespec.checks.lab.broken.BROKEN_RUNTIMES` to :data:`RUNTIMES` unless ``name`` is registered."""
    if name not in RUNTIMES:
        try:
            from ..lab.broken import BROKEN_RUNTIMES
        except ModuleNotFoundError:  # pragma: no cover
            return
        for key, factory in BROKEN_RUNTIMES.items():
            RUNTIMES.setdefault(key, factory)


def open_runtime(name: str, model: str | None = None) -> Adapter:
    """The adapter of runtime ``name`` (a registered one first, else :func:`open_adapter`).

    Raises:
        AdapterUnavailable: the runtime is not installed here.
        Rejection: ``adapter.unsupported`` for an unknown name.
    """
    _register_broken(name)
    if name in RUNTIMES:
        return RUNTIMES[name]()
    return open_adapter(name, model=model)


#: Seconds :func:`check_runtime` waits for a ``stdio:CMD`` server's ``start`` handshake (an ``engine:CMD``'s ``hello``).
HANDSHAKE_TIMEOUT = 60.0
#: Environment variable ``decodespec check`` sets to the runtime it has checked, so that the
#: gate's conftest does not spawn a ``stdio:CMD`` server a second time for the handshake.
RUNTIME_CHECKED_ENV = "DECODESPEC_RUNTIME_CHECKED"


def check_runtime(name: str, model: str | None = None, *, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Check that ``name`` is a runtime the gate can run, before any case runs.

    A registered runtime (:data:`RUNTIMES`) or ``impl`` / ``hf`` / ``llamacpp`` passes on its
    name (a peer that is not installed is the gate's skip, not an error); ``stdio:CMD`` needs a
    non-empty command whose server answers the ``start`` handshake within ``timeout`` seconds,
    ``engine:CMD`` one whose engine answers the ``hello`` (the process is then closed).

    Raises:
        Rejection: ``adapter.unsupported`` for an unknown name; ``adapter.protocol`` for an
            empty ``stdio:`` / ``engine:`` command, one that cannot start, exits, or answers the
            handshake wrongly or not in time.
    """
    _register_broken(name)
    if name in RUNTIMES:
        return
    kind, _ = parse_runtime(name)
    if kind in COMMAND_RUNTIMES:
        open_adapter(name, model=model, timeout=timeout).close()


def default_trace_dir() -> Path:
    """``$DECODESPEC_TRACE_DIR``, else ``traces/failures`` of the repository (git-ignored)."""
    env = os.environ.get("DECODESPEC_TRACE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "traces" / "failures"


def installed_mutant() -> str | None:
    """The failure-lab mutant installed now (``mutant.<name>``), else ``None``.

    No mutant can be installed unless :mod:`decodespec.checks.lab.mutants` was imported, so this
    does not import it.
    """
    mutants = sys.modules.get("decodespec.checks.lab.mutants")
    return mutants.active() if mutants is not None else None


@contextlib.contextmanager
def mutant_installed(name: str | None) -> Any:
    """Install the failure-lab mutant ``name`` (and the gate's reference on the oracle side) for the block.

    Does nothing for ``None`` or when ``name`` is already the installed mutant (a replay inside
    ``pytest checks/ --mutant NAME``).

    Raises:
        Rejection: ``trace.invalid_conformance_trace`` for an unknown mutant name.
        decodespec.checks.lab.mutants.seams.SeamMoved: the runtime changed under the mutant.
    """
    if name is None or name == installed_mutant():
        yield
        return
    from ..lab.mutants import get
    from ..lab.mutants.seams import spec_side

    try:
        chosen = get(name)
    except KeyError as exc:
        raise Rejection(TRACE_INVALID, f"#meta.mutant: {exc.args[0]}", "$.#meta.mutant") from None
    with spec_side(), chosen.applied():
        yield


def _itf_value(value: Any) -> Any:
    """A JSON value made ITF-encodable: floats as decimal strings (ITF has no floats)."""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _itf_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_itf_value(v) for v in value]
    return value


def make_trace(
    *,
    runtime: str,
    config: CaseConfig,
    records: Sequence[Any],
    verdict: Verdict,
    tolerance: Any = None,
    description: str = "",
    seed: Any = None,
    generator: Mapping[str, Any] | None = None,
    spec_refs: Sequence[str] = (),
    mutant: str | None = None,
    exact_floats: bool = False,
) -> dict[str, Any]:
    """Build a ``decodespec.trace`` ITF trace from lock-step records (:class:`~decodespec.checks.gate.lockstep.StepRecord`).

    ``records[0]`` is the reset step; the actions are the rest.  ``mutant`` (default: the
    failure-lab mutant installed now, :func:`installed_mutant`) is recorded as ``#meta.mutant``
    when there is one.  When torch is imported, the intra-op thread count and the CPU kernel
    capability (``threads``, ``cpu_capability``: :func:`cpu_environment`) are recorded;
    ``exact_floats`` marks a verdict that rests on bit-exact float32 values (a natural tie), which
    reproduces only under that capability and count.
    """
    actions = [dict(r.action) for r in records[1:] if r.action.get("op") != "compare_resume"]
    states = []
    for r in records:
        states.append({
            "action": _itf_value(r.action if r.index else {"op": "reset"}),
            "runtime": _itf_value(r.runtime),
            "spec": _itf_value(r.spec),
            "observation": _itf_value(r.observation or {}),
            "state": _itf_value(r.spec_state or {}),
            "verdict": _itf_value(r.verdict.to_json()),
        })
    refs = list(dict.fromkeys([*spec_refs, *([verdict.rule] if verdict.rule else [])]))
    meta = {
        "format": TRACE_FORMAT,
        "format_version": TRACE_FORMAT_VERSION,
        "format-description": "https://apalache-mc.org/docs/adr/015adr-trace.html",
        "source": "checks/gate/lockstep.py",
        "description": description,
        "runtime": runtime,
        "model": config.model,
        "seed": seed,
        "config": config.to_json(),
        "tolerance": None if tolerance is None else attrs.asdict(tolerance),
        "actions": actions,
        "features": sorted({a["op"] for a in actions}),
        "spec_refs": refs,
        "verdict": verdict.to_json(),
        "generator": dict(generator or {"tool": "decodespec"}),
        "data": SYNTHETIC_PASSPORT.to_json(),  # the trace passport: every input was generated by the gate (spec/passport.py)
    }
    mutant = mutant or installed_mutant()
    if mutant:
        meta["mutant"] = mutant
    meta.update(cpu_environment())
    if exact_floats:
        meta["exact_floats"] = True
    return itf.make_trace(list(_VARS), states, meta=meta)


def cpu_environment() -> dict[str, Any]:
    """``{"threads", "cpu_capability"}`` of this process when torch is imported (else ``{}``).

    ``cpu_capability`` is ``torch.backends.cpu.get_cpu_capability()`` (``DEFAULT``, ``AVX2``,
    ``AVX512``, ...): the vectorised kernels torch chose at import, from ``ATEN_CPU_CAPABILITY``
    or the CPU.  It cannot be changed after torch is imported.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {"threads": int(torch.get_num_threads()), "cpu_capability": str(torch.backends.cpu.get_cpu_capability())}


def cannot_reproduce_here(meta: Mapping[str, Any]) -> str | None:
    """Why this process cannot reproduce ``meta``'s bit-exact verdict, or ``None``.

    Only a trace marked ``exact_floats`` (its verdict rests on bit-exact float32 values, e.g. a
    natural tie) depends on the machine: it reproduces only under the recorded
    ``cpu_capability`` (the thread count, ``threads``, is set by :func:`replay`).  A trace that
    does not record the capability, or a process without torch (a runtime in another process),
    gives ``None``.
    """
    recorded = meta.get("cpu_capability")
    here = cpu_environment().get("cpu_capability")
    if not meta.get("exact_floats") or recorded is None or here is None or recorded == here:
        return None
    return (f"the verdict rests on bit-exact float32 values (#meta.exact_floats) recorded under torch CPU capability {recorded} "
            f"with {meta.get('threads', '?')} thread(s); this process runs {here} kernels, whose float32 rounding differs. "
            f"torch chooses them at import: rerun with ATEN_CPU_CAPABILITY={str(recorded).lower()} on a CPU that has it")


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Any:
    """Run the block with torch's intra-op thread count set to ``threads`` (a trace's ``#meta.threads``).

    Does nothing for ``None`` (a trace that does not record it) or when torch is not imported
    (a runtime in another process).  The previous count is restored on exit.

    Raises:
        Rejection: ``trace.invalid_conformance_trace`` when ``threads`` is not a positive integer.
    """
    if threads is None:
        yield
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise Rejection(TRACE_INVALID, f"#meta.threads {threads!r} is not a positive thread count", "$.#meta.threads")
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record(runtime: str, config: CaseConfig, actions: Sequence[Mapping[str, Any]], *, adapter: Adapter | None = None,
           description: str = "", stop_at_failure: bool = True, **meta: Any) -> dict[str, Any]:
    """Run ``actions`` in lock step on ``runtime`` and return the trace (its verdict is the run's).

    Args:
        runtime: Runtime name (recorded; used to open the adapter unless ``adapter`` is given).
        config: The case.
        actions: Contract actions after the reset.
        adapter: An adapter to use instead of opening ``runtime``.
        description: One sentence for ``#meta``.
        stop_at_failure: Stop after the first failed step (the trace ends there).
        **meta: ``seed``, ``generator``, ``spec_refs``, ``exact_floats`` for :func:`make_trace`.
    """
    from ..gate.lockstep import LockStep

    adapter = adapter or open_runtime(runtime, config.model)
    ls = LockStep(adapter, config, runtime=runtime)
    ls.reset()
    for action in actions:
        if stop_at_failure and ls.failed:
            break
        ls.apply(action)
    return make_trace(runtime=runtime, config=config, records=ls.records, verdict=ls.verdict, tolerance=ls.tolerance,
                      description=description, **meta)


#: Longest failure-trace file name, in characters (``.itf.json`` included): far below the 255-byte limit of common file systems.
MAX_TRACE_NAME = 120
#: Longest slug of one part of a failure-trace file name (a ``stdio:CMD`` runtime's command is cut to this).
MAX_NAME_PART = 40
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._]+")
_DOTS = re.compile(r"\.{2,}")


def name_slug(text: str, limit: int = MAX_NAME_PART) -> str:
    """``text`` as a safe file-name part: runs of characters outside ``[A-Za-z0-9._]`` become ``_``, no leading or trailing
    ``.`` / ``_`` and no run of dots (no hidden file, no ``..``), at most ``limit`` characters; ``"x"`` when nothing is left."""
    slug = _DOTS.sub(".", _UNSAFE_NAME.sub("_", text)).strip("._")[:limit].rstrip("._")
    return slug or "x"


def trace_file_name(trace: Mapping[str, Any]) -> str:
    """``<runtime>[-<mutant>]-<model>-<result>[-<layer>]-<hash12>.itf.json``, each part a safe slug (:func:`name_slug`).

    The hash is the first 12 hex digits of sha256 over the meta's config and actions, the case
    that produced it (``source``) and the verdict's check, step, expected and actual values -- so
    two cases with the same actions, or two different failures of the same input (a second
    planted bug), never overwrite each other's trace -- and the runtime name too when its slug is
    not the name itself (a ``stdio:CMD`` runtime: its command line, spaces, slashes and quotes
    included, is cut to a slug, so two commands with the same slug still get two names).  The name is at most :data:`MAX_TRACE_NAME` characters, holds no
    path separator, space or shell metacharacter, and never starts with a dot.
    """
    meta = trace["#meta"]
    runtime = str(meta["runtime"])
    slug = name_slug(runtime)
    verdict = meta["verdict"]
    outcome = {k: verdict.get(k) for k in ("check", "step", "expected", "actual")}
    key = [meta["config"], meta["actions"], meta.get("source"), outcome] + ([] if slug == runtime else [runtime])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    parts = [slug, *([name_slug(str(meta["mutant"]))] if meta.get("mutant") else []), name_slug(str(meta["model"])),
             name_slug(str(verdict["result"]))]
    if verdict.get("layer"):
        parts.append(name_slug(str(verdict["layer"])))
    stem = "-".join(parts)[:MAX_TRACE_NAME - len(".itf.json") - 13]
    return f"{stem}-{digest}.itf.json"


def write_trace(trace: Mapping[str, Any], directory: str | Path | None = None, name: str | None = None) -> Path:
    """Write ``trace`` (validated ITF) into ``directory`` (default :func:`default_trace_dir`); return the path."""
    directory = Path(directory) if directory is not None else default_trace_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return itf.write_trace(directory / (name or trace_file_name(trace)), trace)


#: Largest conformance trace file :func:`load_trace` reads (bytes): far above any recorded run (the corpus' largest
#: is about 40 KB), and a bound on the memory a hostile file can make the reader use.
MAX_TRACE_BYTES = 64 * 1024 * 1024

#: The replay fields of ``#meta`` (traces/README.md), Draft 2020-12.  Fields outside it are allowed (a new optional
#: field is not a version change), but every field replay reads is typed here, so a replay of any file either runs
#: or is refused with ``trace.invalid_conformance_trace`` and the field's JSON path.
META_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["format", "format_version", "runtime", "config", "actions", "verdict"],
    "properties": {
        "runtime": {"type": "string", "minLength": 1, "maxLength": 4096},
        "model": {"type": "string"},
        "config": {"type": "object"},
        "actions": {"type": "array", "maxItems": 100_000,
                    "items": {"type": "object", "required": ["op"], "properties": {"op": {"type": "string"}}}},
        "verdict": {
            "type": "object",
            "required": ["result"],
            "properties": {
                "result": {"enum": ["passed", "failed", "undecided"]},
                "layer": {"enum": [None, "STATE", "TENSOR", "POLICY", "DECISION", "SEQUENCE", "RESUME"]},
                "rule": {"type": ["string", "null"]},
                "check": {"type": ["string", "null"]},
                "message": {"type": "string"},
                "step": {"type": ["integer", "null"], "minimum": 0},
            },
        },
        "mutant": {"type": ["string", "null"]},
        "threads": {"type": "integer", "minimum": 1, "maximum": 4096},
        "cpu_capability": {"type": "string", "minLength": 1, "maxLength": 64},
        "exact_floats": {"type": "boolean"},
        "tolerance": {"type": ["object", "null"]},
        "data": {"type": "object"},  # the passport, read by decodespec.spec.passport.passport_from_json
    },
}

TRACE_RUNTIME_REFUSED = register_code(
    "trace.runtime_not_allowed", "rejection", "M3.10 0x06 (bound parsers and traces); traces/README.md (replay)",
    "A conformance trace names a stdio:CMD or engine:CMD runtime: replay never starts a process a file names; the user must "
    "name the same command on the command line (--runtime 'stdio:CMD' / 'engine:CMD' or --allow-runtime CMD).")


def _meta_path(parts: Sequence[Any]) -> str:
    return "$.#meta" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _lone_surrogate(value: Any, parts: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The path of the first string (or record key) holding a lone UTF-16 surrogate (a JSON ``\\ud800`` escape), else ``None``."""
    stack = [(value, parts)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return where
                stack.append((sub, (*where, key)))
        elif isinstance(item, list):
            stack.extend((sub, (*where, i)) for i, sub in enumerate(item))
    return None


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read and check a ``decodespec.trace`` file: every field replay reads, before anything runs.

    The file must be at most :data:`MAX_TRACE_BYTES` of UTF-8 JSON, a valid ITF trace, of this
    format and version; ``#meta`` must match :data:`META_SCHEMA` and hold no lone surrogate; its
    ``config`` must build a :class:`~decodespec.checks.adapters.CaseConfig` (whose identity is
    canonical JSON: ids within +-(2**53 - 1)) and every action must pass
    :func:`~decodespec.checks.adapters.check_action`.  Loading starts no process and runs nothing.

    Raises:
        Rejection: ``trace.invalid_conformance_trace`` naming the JSON path of the first problem
            (``$`` for the file as a whole, ``$.#meta.config.device``, ``$.#meta.actions[3].op`` ...);
            the config's or action's own refusal code is in ``details["cause"]``.
    """
    try:
        size = os.stat(path).st_size
        if size <= MAX_TRACE_BYTES:
            _refuse_event_trace(path)
        if size > MAX_TRACE_BYTES:
            raise Rejection(TRACE_INVALID, f"{path}: {size} bytes > the {MAX_TRACE_BYTES}-byte limit of a conformance trace", "$",
                            {"limit": MAX_TRACE_BYTES, "actual": size})
        trace = itf.read_trace(path)
    except (OSError, itf.ItfError) as exc:
        message = str(exc)
        raise Rejection(TRACE_INVALID, message if message.startswith(f"{path}:") else f"{path}: {message}", "$") from None
    meta = trace.get("#meta", {})
    if meta.get("format") != TRACE_FORMAT:
        raise Rejection(TRACE_INVALID, f"{path}: format {_short(meta.get('format'))} is not {TRACE_FORMAT!r}", "$.#meta.format")
    if meta.get("format_version") != TRACE_FORMAT_VERSION or isinstance(meta.get("format_version"), bool):
        raise Rejection(TRACE_INVALID, f"{path}: format_version {_short(meta.get('format_version'))}; this replay reads "
                        f"version {TRACE_FORMAT_VERSION} (traces/README.md)", "$.#meta.format_version")
    for key in ("runtime", "config", "actions", "verdict"):
        if key not in meta:
            raise Rejection(TRACE_INVALID, f"{path}: #meta lacks {key!r}", f"$.#meta.{key}")
    bad = _lone_surrogate(meta)
    if bad is not None:
        raise Rejection(TRACE_INVALID, f"{path}: a string holds a lone UTF-16 surrogate (not a Unicode scalar value)", _meta_path(bad))
    # The passport: a corpus file written before it existed is the gate's, so synthetic; replay needs the content.
    try:
        passport = passport_from_json(meta.get("data"), "$.#meta.data", missing=SYNTHETIC)
    except Rejection as exc:
        raise Rejection(TRACE_INVALID, f"{path}: {exc.message}", exc.path, {"cause": exc.code}) from None
    if passport.classification == REDACTED:
        raise Rejection(TRACE_REDACTED, f"{path}: the trace is redacted (#meta.data.classification): replay re-runs its actions, "
                        "which need the raw content; re-record it with the content kept (the opt-in flag)", "$.#meta.data.classification")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(META_SCHEMA).iter_errors(meta))
    if error is not None:
        where = _meta_path(list(error.absolute_path))
        content = any(k in where for k in ("prompt", "stop", "text"))  # user content: fingerprinted (spec/errors.py)
        shown = f"{quote_content(error.instance)} fails the schema's {error.validator!r}" if content else _short(error.message, 200)
        raise Rejection(TRACE_INVALID, f"{path}: {where} does not match the replay fields of #meta (traces/README.md): {shown}", where)
    try:
        config = CaseConfig.from_json(meta["config"])
        policy_config_from_json(config.policy)  # the M3.8 policy both sides will run
    except DecodeSpecError as exc:
        where = exc.path[1:] if exc.path.startswith("$") else ""
        where = where if where.startswith(".policy") or exc.code.startswith("adapter.") else ".policy" + where
        raise Rejection(TRACE_INVALID, f"{path}: #meta.config: {exc.message}", "$.#meta.config" + where,
                        {"cause": exc.code}) from None
    except (OverflowError, ValueError) as exc:  # a number outside the policy parser's float / int domain
        raise Rejection(TRACE_INVALID, f"{path}: #meta.config.policy is not an M3.8 policy: {type(exc).__name__}: {_short(str(exc), 120)}",
                        "$.#meta.config.policy") from None
    for index, action in enumerate(meta["actions"]):
        try:
            check_action(action)
        except Rejection as exc:
            raise Rejection(TRACE_INVALID, f"{path}: #meta.actions[{index}]: {exc.message}",
                            f"$.#meta.actions[{index}]" + exc.path[1:], {"cause": exc.code}) from None
    return trace


def _refuse_event_trace(path: str | Path) -> None:
    """Refuse a runtime event trace (``decodespec generate --trace``) given to replay, with what to do instead.

    Raises:
        Rejection: ``trace.redacted`` for a redacted event trace (re-record with ``--trace-content``,
            or check it with ``decodespec validate-trace``); ``trace.invalid_conformance_trace`` for a
            content one (``validate-trace`` is its checker).
    """
    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 20)
        header = json.loads(first.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return
    if not isinstance(header, dict) or header.get("event") != "request" or header.get("format") != "decodespec.events.v1":
        return
    data = header.get("data")
    if isinstance(data, dict) and data.get("classification") == REDACTED:
        raise Rejection(TRACE_REDACTED, f"{path}: a redacted runtime event trace (decodespec generate --trace): its ids and text are "
                        "digests, so nothing can be re-run from it. Check it as it is with decodespec validate-trace, or re-record "
                        "it with decodespec generate --trace FILE --trace-content", "$[0].data.classification")
    raise Rejection(TRACE_INVALID, f"{path}: a runtime event trace (decodespec.events.v1), not a conformance trace; check it with "
                    "decodespec validate-trace", "$[0].format")


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error message never echoes a hostile value whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def stdio_command(runtime: str) -> str | None:
    """The command of a ``stdio:CMD`` runtime name, else ``None``."""
    name, _, command = runtime.partition(":")
    return command if name == "stdio" else None


def runtime_command(runtime: str) -> str | None:
    """The command a runtime name starts: ``CMD`` of ``stdio:CMD`` or ``engine:CMD``, else ``None``."""
    name, _, command = runtime.partition(":")
    return command if name in COMMAND_RUNTIMES else None


def check_replay_runtime(meta: Mapping[str, Any], runtime: str | None, allow_commands: Sequence[str] = ()) -> str:
    """The runtime a replay of ``meta`` runs: ``runtime`` when the user named one, else the trace's.

    Replay never starts a process that a file names: a trace whose ``runtime`` is ``stdio:CMD`` or
    ``engine:CMD`` runs only when the user names that runtime (``runtime``, e.g. ``--runtime
    'stdio:CMD'``) or lists ``CMD`` exactly in ``allow_commands`` (``--allow-runtime CMD``).

    Raises:
        Rejection: ``trace.runtime_not_allowed`` (path ``$.#meta.runtime``) otherwise; nothing was started.
    """
    if runtime is not None:
        return runtime
    recorded = meta["runtime"]
    command = runtime_command(recorded)
    if command is not None and command not in allow_commands:
        kind = recorded.partition(":")[0]
        raise Rejection(TRACE_RUNTIME_REFUSED, f"the trace names the runtime {kind}:{_short(command)}; replay does not start a "
                        f"command read from a file: name it on the command line (--runtime '{kind}:CMD' or --allow-runtime CMD)",
                        "$.#meta.runtime")
    return recorded


@attrs.frozen
class ReplayResult:
    """The outcome of :func:`replay`.

    Attributes:
        reproduced: Whether the run's verdict has the recorded result, layer and rule.
        expected: The recorded verdict.
        actual: The replayed run's verdict.
        runtime: The runtime replayed against.
        steps: Steps replayed (reset included).
        mutant: The failure-lab mutant installed for the replay (the trace's ``#meta.mutant``), else ``None``.
        cannot_reproduce_here: When not reproduced and the trace's bit-exact verdict was recorded
            under another CPU capability, why this process cannot reproduce it
            (:func:`cannot_reproduce_here`), else ``None``.
        unsupported: When the runtime refused the trace's config with ``adapter.unsupported``
            (a config outside what it can run: the gate's skip, never a failure), its reason, else ``None``.
    """

    reproduced: bool
    expected: Verdict
    actual: Verdict
    runtime: str
    steps: int
    mutant: str | None = None
    cannot_reproduce_here: str | None = None
    unsupported: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as JSON (``mutant``, ``cannot_reproduce_here`` and ``unsupported`` only when set)."""
        out = {"reproduced": self.reproduced, "runtime": self.runtime, "steps": self.steps,
               "expected": self.expected.to_json(), "actual": self.actual.to_json()}
        if self.mutant:
            out["mutant"] = self.mutant
        if self.cannot_reproduce_here:
            out["cannot_reproduce_here"] = self.cannot_reproduce_here
        if self.unsupported:
            out["unsupported"] = self.unsupported
        return out


def replay(trace: Mapping[str, Any], *, runtime: str | None = None, adapter: Adapter | None = None,
           allow_commands: Sequence[str] = ()) -> ReplayResult:
    """Re-run a trace's actions against the spec and a runtime; compare the verdict with the recorded one.

    When the trace records a failure-lab mutant (``#meta.mutant``) it is installed for the
    replay, with the gate's reference on the oracle side, as ``pytest checks/ --mutant NAME``
    does (:func:`mutant_installed`); a recorded intra-op thread count (``#meta.threads``) is set
    for the replay (:func:`intra_op_threads`).

    Args:
        trace: A loaded trace (:func:`load_trace`).
        runtime: Runtime to replay against (default the recorded one).  Naming it is the user's
            consent to start it; a recorded ``stdio:CMD`` / ``engine:CMD`` is started only when ``CMD`` is in
            ``allow_commands`` (:func:`check_replay_runtime`).
        adapter: An adapter to use instead of opening the runtime.
        allow_commands: ``stdio`` / ``engine`` commands the user allows a trace to name (``--allow-runtime``).

    Raises:
        Rejection: ``trace.runtime_not_allowed`` for a recorded ``stdio:CMD`` / ``engine:CMD`` the user did not name.
        Rejection: ``adapter.invalid_config`` / ``adapter.invalid_action`` for a malformed
            config or action; ``trace.invalid_conformance_trace`` for an unknown mutant.
        AdapterUnavailable: the runtime is not installed here.
    """
    from ..gate.lockstep import LockStep

    meta = trace["#meta"]
    # A caller's adapter starts nothing from the file; otherwise a recorded stdio:CMD / engine:CMD needs the user's consent.
    name = (runtime or meta["runtime"]) if adapter is not None else check_replay_runtime(meta, runtime, allow_commands)
    config = CaseConfig.from_json(meta["config"])
    mutant = meta.get("mutant") or None
    with mutant_installed(mutant), intra_op_threads(meta.get("threads")):
        adapter = adapter or open_runtime(name, config.model)
        try:
            ls = LockStep(adapter, config, runtime=name)
            ls.reset()
            for action in meta["actions"]:
                if ls.failed:
                    break
                ls.apply(action)
            expected = Verdict.from_json(meta["verdict"])
            actual = ls.verdict
            reproduced = expected.same_outcome(actual)
            return ReplayResult(reproduced, expected, actual, name, len(ls.records), mutant,
                                None if reproduced else cannot_reproduce_here(meta), ls.unsupported)
        finally:
            adapter.close()
