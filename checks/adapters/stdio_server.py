"""An example JSON-lines adapter server: a runtime behind the wire protocol, in its own process.

``python -m decodespec.checks.adapters.stdio_server [--runtime impl|hf|llamacpp]`` reads one request per
line on stdin and answers one response per line on stdout (line-buffered), exactly as a runtime
written in another language would (:mod:`decodespec.checks.adapters.wire`):

* ``start`` -> the handshake naming the implementation and its capabilities;
* ``reset`` -> ``ok``, or the typed refusal ``{"ok": false, "error": {"code", "message"}}``;
* ``apply`` -> the action's result (``ok`` or ``rejected`` with the code);
* ``observe`` -> the observation (arrays as base64);
* ``prompt_logprobs`` -> the adapter's prompt logprobs (M3.10 0x02) of ``config`` under ``spec``,
  or the typed refusal (as for ``reset``);
* a command of ``extra`` (e.g. the vLLM server's ``bench``) -> that handler's answer;
* ``stop`` -> ``ok``, then the process exits 0.

An ``apply`` / ``observe`` that fails with anything but a typed refusal answers ``ok: false``
(a protocol error the client reports), and the server keeps serving.  Library output that
would go to stdout is sent to stderr so that stdout carries protocol lines only.

The gate runs it with ``--runtime stdio:"python -m decodespec.checks.adapters.stdio_server"``; its
results equal the in-process adapter's (tests/test_adapters_stdio.py).

Source: research/formal-anchors-survey.md 4.4 and 5.4 (Bowtie's IHOP harness: start
handshake, one command per line, line-buffered stdout, errored vs refused); docs/design.md
section 11.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from decodespec.checks.adapters import ADAPTER_PROTOCOL, CaseConfig, open_adapter
from decodespec.checks.adapters.wire import (
    PROTOCOL_VERSION,
    decode_line,
    encode_line,
    response_error,
    response_ok,
    start_response,
)
from decodespec.spec.errors import DecodeSpecError
from decodespec.spec.prompt_logprobs import PromptLogprobsSpec

__all__ = ["main", "serve"]


def serve(runtime: str, stdin: TextIO, stdout: TextIO, factory: Callable[[], Any] | None = None,
          extra: Mapping[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] | None = None) -> int:
    """Serve ``runtime`` over ``stdin`` / ``stdout`` until ``stop`` or end of input; return the exit status.

    ``factory`` builds the adapter instead of ``open_adapter(runtime)`` (a server for a runtime
    outside the named ones, e.g. :mod:`decodespec.checks.adapters.vllm_engine`).  ``extra`` maps
    further command names to ``handler(adapter, message) -> fields`` (answered ``ok`` with those
    fields; a typed error is answered as a refusal).
    """
    adapter = None
    started = False

    def send(message: dict[str, Any]) -> None:
        stdout.write(encode_line(message))
        stdout.flush()

    for line in stdin:
        if not line.strip():
            continue
        seq = None
        try:
            message = decode_line(line)
            seq = message.get("seq")
            cmd = message.get("cmd")
            if cmd == "start":
                if message.get("version") != PROTOCOL_VERSION:
                    send(response_error(None, ADAPTER_PROTOCOL, f"protocol version {message.get('version')!r} is not {PROTOCOL_VERSION}"))
                    continue
                adapter = adapter or (factory() if factory is not None else open_adapter(runtime))
                started = True
                send(start_response(adapter.name, _version(), adapter.capabilities(), language="python",
                                    source="decodespec.checks.adapters.stdio_server"))
                continue
            if cmd == "stop":
                send(response_ok())
                break
            if not started:
                send(response_error(seq, ADAPTER_PROTOCOL, "the first command must be start"))
                continue
            if cmd == "reset":
                try:
                    adapter.reset(CaseConfig.from_json(message.get("config")))
                except DecodeSpecError as exc:
                    send(response_error(seq, exc.code, exc.message))
                    continue
                send(response_ok(seq))
            elif cmd == "apply":
                send(response_ok(seq, result=adapter.apply(message.get("action"))))
            elif cmd == "observe":
                send(response_ok(seq, observation=adapter.observe()))
            elif cmd == "prompt_logprobs":
                spec = PromptLogprobsSpec.from_json(message.get("spec") or {})
                entries = adapter.prompt_logprobs(CaseConfig.from_json(message.get("config")), spec)
                send({**response_ok(seq), "prompt_logprobs": [entry.to_json() for entry in entries]})
            elif extra is not None and cmd in extra:
                send({**response_ok(seq), **extra[cmd](adapter, message)})
            else:
                send(response_error(seq, ADAPTER_PROTOCOL, f"unknown command {cmd!r}"))
        except DecodeSpecError as exc:
            send(response_error(seq, exc.code, exc.message))
        except Exception as exc:  # noqa: BLE001 - the adapter itself failed: a protocol error, keep serving
            send(response_error(seq, ADAPTER_PROTOCOL, f"{type(exc).__name__}: {exc}"))
    if adapter is not None:
        adapter.close()
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decodespec")
    except PackageNotFoundError:  # pragma: no cover - a source checkout without metadata
        return "0"


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m decodespec.checks.adapters.stdio_server [--runtime NAME]``."""
    parser = argparse.ArgumentParser(prog="python -m decodespec.checks.adapters.stdio_server", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="impl", help="the in-process adapter to serve: impl (default), hf or llamacpp")
    args = parser.parse_args(argv)
    protocol = sys.stdout
    sys.stdout = sys.stderr  # library prints must not corrupt the protocol stream
    try:
        return serve(args.runtime, sys.stdin, protocol)
    finally:
        sys.stdout = protocol


if __name__ == "__main__":
    sys.exit(main())
