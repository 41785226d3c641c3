"""Partial trace files never survive a kill: a SIGKILLed ``decodespec generate --trace`` leaves its hidden
temporary, and the next run for the same target removes it (impl/events.py ``clean_stale_temporaries``).

Only our own temporaries are removed: the name pattern ``.<target>.<8 characters>.tmp`` of the same
target, a regular file of this user, not written for ``STALE_AFTER_S``, whose writer's ``flock`` is
gone (the kernel drops it when the writer dies).  A live writer's temporary, another target's, a
fresh one and any other file are left alone.

Source: M3.10 0x06 (bound traces; no partial file under any name).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decodespec.impl.events import STALE_AFTER_S, TEMP_NAME, FileSink, clean_stale_temporaries

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock-based liveness is POSIX")


def _temporaries(folder: Path, target: str = "t.trace") -> list[Path]:
    return sorted(p for p in folder.iterdir() if (m := TEMP_NAME.fullmatch(p.name)) and m["target"] == target)


def _age(path: Path, seconds: float = 10 * STALE_AFTER_S) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_sigkilled_generate_leaves_a_temporary_and_the_next_run_removes_it(tmp_path) -> None:
    target = tmp_path / "t.trace"
    cmd = [sys.executable, "-m", "decodespec.checks.commands.cli", "generate", "--model", "tiny", "--prompt", "hi", "--trace", str(target)]
    proc = subprocess.Popen([*cmd, "--max-new-tokens", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            temps = _temporaries(tmp_path)
            if temps and temps[0].stat().st_size > 20_000:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"generate ended before it could be killed: {proc.stderr.read()!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    leftover = _temporaries(tmp_path)
    assert len(leftover) == 1 and leftover[0].stat().st_size > 20_000 and not target.exists()  # what the kill leaves
    time.sleep(STALE_AFTER_S)
    done = subprocess.run([*cmd, "--max-new-tokens", "2"], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _temporaries(tmp_path) == [] and not leftover[0].exists()
    lines = target.read_text().splitlines()
    assert json.loads(lines[0])["event"] == "request" and json.loads(lines[-1])["event"] == "finish"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.trace"]


def test_only_our_dead_writers_temporaries_are_removed(tmp_path) -> None:
    stale = tmp_path / ".t.trace.abcd1234.tmp"          # ours, same target, writer gone, old: removed
    other_target = tmp_path / ".u.trace.abcd1234.tmp"   # another target's: kept
    not_ours = tmp_path / ".t.trace.abc.tmp"            # not the pattern (3 characters): kept
    fresh = tmp_path / ".t.trace.fresh000.tmp"          # just written (a writer about to lock it): kept
    for path in (stale, other_target, not_ours, fresh):
        path.write_text("partial")
    for path in (stale, other_target, not_ours):
        _age(path)
    live = tmp_path / ".t.trace.live0000.tmp"           # a live writer (this process) holds its lock: kept
    with FileSink(live) as sink:
        sink.emit("request")
        _age(live)
        mine = tmp_path / ".t.trace.mine0000.tmp"
        with FileSink(mine):  # opening a temporary of the same target cleans the stale ones
            pass
        assert not stale.exists()
        assert all(p.exists() for p in (other_target, not_ours, fresh, live, mine))
        assert clean_stale_temporaries(mine) == []  # live still locked, fresh still fresh
    os.replace(mine, tmp_path / "t.trace")  # generate renames its temporary into place: the lock goes with it
    _age(fresh)
    # Now old; live is still locked: this process holds a temporary's lock until it is renamed or removed.
    assert clean_stale_temporaries(tmp_path / ".t.trace.zzzz9999.tmp") == [fresh]
    assert live.exists() and not fresh.exists()


def test_a_symlink_or_a_folder_of_the_pattern_is_left_alone(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / ".t.trace.link0000.tmp"
    link.symlink_to(victim)
    folder = tmp_path / ".t.trace.dir00000.tmp"
    folder.mkdir()
    assert clean_stale_temporaries(tmp_path / ".t.trace.mine0000.tmp") == []
    assert link.is_symlink() and victim.read_text() == "keep" and folder.is_dir()


def test_a_sink_at_an_ordinary_path_cleans_nothing(tmp_path) -> None:
    stale = tmp_path / ".t.trace.abcd1234.tmp"
    stale.write_text("x")
    _age(stale)
    with FileSink(tmp_path / "t.trace"):
        pass
    assert stale.exists()


_KILL_DURING_SAVE = """
import os, signal, sys
import decodespec.impl.snapshot as snapshot
real = snapshot.save_snapshot
def dying(state, path, **options):
    doc, tensors = real(state, path, **options)  # both files written into the staging folder, not yet moved out
    os.kill(os.getpid(), signal.SIGKILL)
snapshot.save_snapshot = dying
from decodespec.checks.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _staging(folder: Path, target: str = "s.json") -> list[Path]:
    from decodespec.impl.events import STAGING_NAME

    return sorted(p for p in folder.iterdir() if (m := STAGING_NAME.fullmatch(p.name)) and m["target"] == target)


def test_a_kill_while_a_snapshot_is_written_leaves_a_staging_folder_that_the_next_run_removes(tmp_path) -> None:
    target = tmp_path / "s.json"
    args = ["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "3", "--snapshot", str(target)]
    killed = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE, *args], check=False, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftover = _staging(tmp_path)
    assert len(leftover) == 1 and sorted(p.name for p in leftover[0].iterdir()) == ["s.json", "s.json.safetensors"]
    assert not target.exists() and not target.with_name("s.json.safetensors").exists()  # nothing half-published
    _age(leftover[0])
    done = subprocess.run([sys.executable, "-m", "decodespec.checks.commands.cli", *args], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.json.safetensors"]


def test_a_live_or_odd_staging_folder_is_left_alone(tmp_path) -> None:
    from decodespec.impl.events import staging_folder

    odd = tmp_path / ".s.json.odd00000.snap"       # holds a sub-folder: not what we write, kept
    (odd / "inner").mkdir(parents=True)
    plain = tmp_path / ".s.json.file0000.snap"     # a file of the folder pattern: kept
    plain.write_text("x")
    other = tmp_path / ".t.json.stal0000.snap"     # another target's stale folder: kept
    other.mkdir()
    stale = tmp_path / ".s.json.stal0000.snap"     # ours, dead writer, old: removed
    stale.mkdir()
    (stale / "s.json").write_text("{")
    for path in (odd, plain, other, stale):
        _age(path)
    live = staging_folder(tmp_path / "s.json")     # this process holds its lock
    _age(live)
    assert not stale.exists() and all(p.exists() for p in (odd, plain, other, live))
    second = staging_folder(tmp_path / "s.json")
    assert live.is_dir() and second.is_dir()       # a live writer's folder survives another writer's cleaning


def test_write_atomically_replaces_whole_and_a_killed_writers_temporary_is_removed(tmp_path) -> None:
    """``write_atomically`` (gate failure traces, results files, calibration) leaves the old file or the new one:
    a writer killed before its rename leaves only its temporary, which the next write to the target removes."""
    from decodespec.impl.events import write_atomically

    target = tmp_path / "r.jsonl"
    target.write_text("old\n")
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "import decodespec.impl.events as ev\n"
        "real = os.replace\n"
        "os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"ev.write_atomically({str(target)!r}, 'x' * 100000)\n")], check=False, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert target.read_text() == "old\n"
    (leftover,) = _temporaries(tmp_path, "r.jsonl")
    assert leftover.stat().st_size == 100000
    _age(leftover)
    write_atomically(target, "new\n")
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with pytest.raises(OSError):
        write_atomically(tmp_path / "missing" / "x.json", "y")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
