"""The server's child processes, by process group and session (Linux): a child dies with the
thread that started it, and what a child started is found, and killed, by the group or session
it shares with it. The runner's batch children and batch workers (serve/runner.py,
serve/worker.py) and the resident engine (serve/engine.py) use them."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path


def die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Linux: the child gets SIGKILL when the thread that started it (the runner's, alive as
    long as the server) dies, so a killed server leaves no orphan engine behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def kill_group(child: subprocess.Popen) -> None:
    """The child's whole process group killed at once. Its parts are committed atomically, so
    a hard stop loses nothing written; after a SIGINT the job's Ray actors go on writing parts
    for seconds (docs/benchmarks.md)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()
    _until_gone(group, child.pid)


def kill_session(child: subprocess.Popen) -> None:
    """A child (started in a session of its own) and every process of its session killed,
    reaped, and waited for (30 s at most)."""
    for pid in session(child.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.wait()
    _until_gone(session, child.pid)


def _until_gone(live, pid: int, seconds: float = 30) -> None:
    """Wait while ``live(pid)`` lists processes, ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while live(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def session(sid: int) -> list[int]:
    """The live processes of a session (Linux /proc)."""
    return [int(proc.name) for proc in _live(SESSION, sid)]


def group(pgid: int) -> list[bytes]:
    """The command lines of the live processes in a process group (Linux /proc)."""
    commands = []
    for proc in _live(GROUP, pgid):
        try:
            commands.append((proc / "cmdline").read_bytes())
        except OSError:  # gone since
            continue
    return commands


GROUP, SESSION = 2, 3  # a /proc/PID/stat's fields after the command: state, ppid, pgrp, session


def _live(field: int, value: int) -> list[Path]:
    """The /proc folders of the live (not zombie) processes whose ``field`` is ``value``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[field]) == value and fields[0] != "Z":
                found.append(stat.parent)
        except (OSError, IndexError, ValueError):
            continue
    return found
