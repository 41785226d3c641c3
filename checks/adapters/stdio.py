"""The JSON-lines client adapter: any command that speaks the wire protocol is a runtime under test.

``open_adapter('stdio:CMD')`` spawns ``CMD`` (split like a shell would, no shell), sends the
``start`` handshake and then forwards ``reset`` / ``apply`` / ``observe`` as one JSON line
each, waiting for the response that echoes the request's ``seq``
(:mod:`decodespec.checks.adapters.wire`).  The harness cannot tell it from an in-process
adapter: capabilities come from the handshake, a refused ``reset`` is raised as the typed error
the server named (``Rejection`` or ``ResourceLimit`` by the code's registered kind), and a
refused action comes back as a ``rejected`` :class:`~decodespec.checks.adapters.ApplyResult`.

Failures of the process itself are ``adapter.protocol`` rejections that name what happened: a
malformed or out-of-order line, an ``ok: false`` answer to ``apply`` / ``observe``, no answer
within ``timeout`` seconds, or the process exiting (with the tail of its stderr).  Bowtie
distinguishes such an "uncaught" failure from a refusal the same way.

Source: research/formal-anchors-survey.md 4.4 and 5.4 (Bowtie IHOP); docs/design.md section 11.
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from decodespec.spec.errors import ERROR_CODES, Rejection, ResourceLimit

from . import ADAPTER_PROTOCOL, CAPABILITIES, ApplyResult, CaseConfig, Observation
from .wire import PROTOCOL_VERSION, decode_line, encode_line, observation_from_json, request

__all__ = ["DEFAULT_TIMEOUT", "StdioAdapter", "available", "create"]

#: Seconds to wait for one response (model loading happens inside the first ``reset``).
DEFAULT_TIMEOUT = 900.0


def available() -> str | None:
    """Always usable (whether the command runs is found out at ``start``)."""
    return None


def create(command: str = "", **options: Any) -> StdioAdapter:
    """A :class:`StdioAdapter` running ``command`` (``timeout`` may be given; other options are ignored).

    Raises:
        Rejection: ``adapter.protocol`` for an empty command or a failed handshake.
    """
    return StdioAdapter(command, timeout=float(options.get("timeout", DEFAULT_TIMEOUT)))


class StdioAdapter:
    """A runtime in another process, spoken to over JSON lines (see the module docstring).

    Args:
        command: The server's command line, e.g. ``"python -m decodespec.checks.adapters.stdio_server"``
            (a leading ``python`` means this interpreter).
        timeout: Seconds to wait for each response.

    Raises:
        Rejection: ``adapter.protocol`` when the process cannot start or the handshake fails.
    """

    def __init__(self, command: str, *, timeout: float = DEFAULT_TIMEOUT):
        argv = shlex.split(command)
        if not argv:
            raise Rejection(ADAPTER_PROTOCOL, "stdio needs a command: --runtime stdio:'CMD ARGS'", "$.runtime")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        self.command = command
        self.timeout = timeout
        self.stderr = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - the adapter owns it until close()
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                            text=True, encoding="utf-8", bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except OSError as exc:
            raise Rejection(ADAPTER_PROTOCOL, f"cannot start {command!r}: {exc}", "$.runtime") from None
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.seq = 0
        try:
            hello = self._exchange(request("start", version=PROTOCOL_VERSION), seq=None)
        except Rejection:  # no answer in time, a malformed one, or the process exited: never leave it running
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=10)
            self.stderr.close()
            raise
        impl = hello.get("implementation")
        if not hello.get("ok") or not hello.get("ready") or hello.get("version") != PROTOCOL_VERSION or not isinstance(impl, Mapping):
            self.close()
            raise Rejection(ADAPTER_PROTOCOL, f"bad start handshake from {command!r}: {hello!r}", "$.start")
        caps = impl.get("capabilities")
        if not isinstance(caps, list) or not set(caps) <= CAPABILITIES:
            self.close()
            raise Rejection(ADAPTER_PROTOCOL, f"bad capabilities in the handshake: {caps!r}", "$.implementation.capabilities")
        self.implementation = dict(impl)
        self._capabilities = frozenset(caps)
        self.name = "stdio"

    # -- transport -----------------------------------------------------------------------
    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode("utf-8", errors="replace")

    def _exchange(self, message: dict[str, Any], *, seq: int | None) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise Rejection(ADAPTER_PROTOCOL, f"the adapter process exited with {self.process.returncode}: {self._stderr_tail()}", "$")
        try:
            self.process.stdin.write(encode_line(message))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise Rejection(ADAPTER_PROTOCOL, f"cannot write to the adapter process: {exc}; {self._stderr_tail()}", "$") from None
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            raise Rejection(ADAPTER_PROTOCOL, f"no answer to {message.get('cmd')!r} within {self.timeout} s", "$") from None
        if line is None:
            self.process.wait(timeout=30)
            raise Rejection(ADAPTER_PROTOCOL, f"the adapter process exited with {self.process.returncode} during "
                            f"{message.get('cmd')!r}: {self._stderr_tail()}", "$")
        answer = decode_line(line)
        if seq is not None and answer.get("seq") != seq:
            raise Rejection(ADAPTER_PROTOCOL, f"answer seq {answer.get('seq')!r} does not echo request seq {seq}", "$.seq")
        return answer

    def _call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return self._exchange(request(cmd, self.seq, **fields), seq=self.seq)

    @staticmethod
    def _error(answer: Mapping[str, Any]) -> tuple[str, str]:
        error = answer.get("error")
        if not isinstance(error, Mapping) or not isinstance(error.get("code"), str):
            raise Rejection(ADAPTER_PROTOCOL, f"a refusal without an error object: {answer!r}", "$.error")
        return error["code"], str(error.get("message", ""))

    # -- contract ------------------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        """The capabilities the server declared at ``start``."""
        return self._capabilities

    def reset(self, config: CaseConfig) -> None:
        """``reset``; a refusal is raised as the server's typed error.

        Raises:
            Rejection / ResourceLimit: the server's code (its registered kind); an
                unregistered code is ``adapter.protocol``.
        """
        answer = self._call("reset", config=config)
        if not answer.get("ok"):
            self._raise_refusal(answer)

    def _raise_refusal(self, answer: Mapping[str, Any]) -> None:
        code, message = self._error(answer)
        entry = ERROR_CODES.get(code)
        if entry is None:
            raise Rejection(ADAPTER_PROTOCOL, f"the server refused with an unregistered code {code!r}: {message}", "$.error.code")
        raise (ResourceLimit if entry.kind == "resource_limit" else Rejection)(code, message)

    def apply(self, action: Mapping[str, Any]) -> ApplyResult:
        """``apply``; the server's result (``ok`` or ``rejected``).

        Raises:
            Rejection: ``adapter.protocol`` when the server failed (``ok: false``).
        """
        answer = self._call("apply", action=dict(action))
        if not answer.get("ok"):
            code, message = self._error(answer)
            raise Rejection(ADAPTER_PROTOCOL, f"the adapter failed on {action!r}: [{code}] {message}", "$.apply")
        return ApplyResult.from_json(answer.get("result"))

    def observe(self) -> Observation:
        """``observe``; the decoded observation.

        Raises:
            Rejection: ``adapter.protocol`` when the server failed or sent a bad observation.
        """
        answer = self._call("observe")
        if not answer.get("ok"):
            code, message = self._error(answer)
            raise Rejection(ADAPTER_PROTOCOL, f"the adapter failed on observe: [{code}] {message}", "$.observe")
        return observation_from_json(answer.get("observation"))

    def prompt_logprobs(self, config: CaseConfig, spec: Any) -> tuple[Any, ...]:
        """``prompt_logprobs``: the server's prompt logprobs (M3.10 0x02) of ``config``'s prompt under ``spec``.

        Args:
            config: The request (its prompt, cache family, chunking).
            spec: A :class:`~decodespec.spec.prompt_logprobs.PromptLogprobsSpec`.

        Returns:
            One :class:`~decodespec.spec.prompt_logprobs.PromptLogprob` per entry, as the server sent them.

        Raises:
            Rejection / ResourceLimit: the server's typed refusal (as :meth:`reset`);
                ``adapter.protocol`` for a malformed answer.
        """
        from .wire import prompt_logprobs_from_json

        answer = self._call("prompt_logprobs", config=config, spec=spec.to_json())
        if not answer.get("ok"):
            self._raise_refusal(answer)
        return prompt_logprobs_from_json(answer.get("prompt_logprobs"))

    def send_command(self, cmd: str, **fields: Any) -> dict[str, Any]:
        """Any other command of the wire format (e.g. ``bench``): the server's ``ok`` answer.

        Raises:
            Rejection / ResourceLimit: the server's typed refusal; ``adapter.protocol`` for an
                unknown command or a failure of the server.
        """
        answer = self._call(cmd, **fields)
        if not answer.get("ok"):
            self._raise_refusal(answer)
        return answer

    def close(self) -> None:
        """``stop``, then wait for the process (killed after 10 s)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(encode_line({"cmd": "stop"}))
                self.process.stdin.flush()
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
        self.stderr.close()
