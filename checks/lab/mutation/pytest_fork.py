"""A pre-imported pytest launcher for Cosmic Ray screens: each run is a fresh fork, the mutated module is imported anew.

Cosmic Ray runs its test command once per mutant; for a screen of a few seconds most of each run
is importing torch, Hypothesis and pytest (about 3 s of 5 on the shared 2-core machine).  The
server imports those once (and the spec, which never imports ``impl/``), then forks one child
per request; the child runs ``pytest.main`` with the request's arguments in the request's
directory and imports the test files and ``decodespec.impl.*`` itself, from disk, after the
fork, so it sees the mutated file.  The server refuses to start if any ``decodespec.impl``
module other than ``decodespec.impl.rng`` is loaded (``--forbid`` names the module under test),
and kills a child that runs past ``--limit`` seconds (a mutant that hangs).

Usage (from the repository root of the scratch copy)::

    python checks/lab/mutation/pytest_fork.py serve SOCKET --forbid decodespec.impl.policy &
    python checks/lab/mutation/pytest_fork.py run SOCKET -- PYTEST_ARGS...   # the Cosmic Ray test command

``run`` prints the child's output and exits with pytest's exit status (2 when the server is
unreachable, so a missing server reads as a kill, never as a survivor: check that the unmutated
command passes before a session).  Source: docs/results/mutation.md (the ``impl/policy.py``
section).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

_RC = b"\0PYTEST_FORK_RC="


def _serve(path: str, forbid: list[str], limit: float) -> None:
    # Pre-imports, the point of the server (the children find them in sys.modules).  noqa F401 where ruff asks.
    import hypothesis.extra.pytestplugin
    import hypothesis.strategies  # noqa: F401
    import numpy  # noqa: F401
    import pytest
    import torch  # noqa: F401

    import decodespec.checks.lab.mutation.screen_profile
    import decodespec.impl.rng
    import decodespec.spec.errors
    import decodespec.spec.policy  # noqa: F401

    loaded = sorted(m for m in sys.modules if m.startswith("decodespec.impl") and m not in ("decodespec.impl", "decodespec.impl.rng"))
    if loaded or any(m in sys.modules for m in forbid):
        raise SystemExit(f"refusing to serve: {loaded} loaded before the fork")
    if os.path.exists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    while True:
        conn, _ = srv.accept()
        request = json.loads(conn.makefile("rb").readline())
        pid = os.fork()
        if pid == 0:
            srv.close()
            os.chdir(request["cwd"])
            fd = conn.fileno()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = sys.stdout
            os.environ.update(request["env"])
            try:
                import pytest

                code = int(pytest.main(request["args"]))
            except BaseException as exc:  # noqa: BLE001  (any failure of the child is a failing run)
                print(f"pytest_fork child: {exc!r}")
                code = 3
            sys.stdout.flush()
            os._exit(code)
        deadline = time.monotonic() + limit
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = 124
                break
            time.sleep(0.02)
        try:
            conn.sendall(_RC + str(code).encode() + b"\n")
        except OSError:
            pass
        conn.close()


def _run(path: str, args: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if k in ("CI", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError as exc:
        print(f"pytest_fork: no server at {path}: {exc}")
        return 2
    conn.sendall(json.dumps({"cwd": os.getcwd(), "args": args, "env": env}).encode() + b"\n")
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    out, _, rc = data.partition(_RC)
    sys.stdout.write(out.decode(errors="replace"))
    return int(rc.strip() or b"2")


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        forbid = [argv[i + 1] for i, a in enumerate(argv) if a == "--forbid"]
        limit = float(argv[argv.index("--limit") + 1]) if "--limit" in argv else 30.0
        _serve(argv[1], forbid, limit)
        return 0
    if argv[:1] == ["run"] and "--" in argv:
        return _run(argv[1], argv[argv.index("--") + 1:])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
