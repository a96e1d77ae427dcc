"""A batch's child process: its ``overnight batch`` command line and start, what an earlier
server left of it (killed before the batch is touched), and how it ended: its own error, or
a death recorded in the batch's folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from serve.processes import die_with_parent, group
from serve.store import Store

# each death of a batch's child is one line here (when, how): it survives a server's restart
DEATHS = "deaths.jsonl"
# where a run of the batch starts in its log.txt (its own error: after the last one)
RUN_MARK = "-- overnight serve: a run of this batch starts --\n"


def stop_stale_child(store: Store, batch_id: str) -> None:
    """What an earlier server process left of this batch's child, killed before the batch is
    touched: the child itself where PDEATHSIG is unavailable, and always the Ray agents of its
    process group, which outlive a killed driver (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``)."""
    pid = store.child_of(batch_id)
    if pid is None:
        return
    marks = (str(store.batch_dir(batch_id)).encode(), b"ray::", b"/ray/")
    if any(any(mark in command for mark in marks) for command in group(pid)):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while group(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    store.set_child(batch_id, None)


def argv(arguments: dict) -> list[str]:
    """The ``overnight batch`` command line of ``run_batch``'s ``arguments``."""
    files = [] if arguments["errors"] is None else ["-e", arguments["errors"]]
    argv = ["batch", arguments["requests"], "-o", arguments["results"], *files,
            "--format", arguments["format"], "--model", arguments["model"],
            "--served-model-name", arguments["served_model_name"], "--quiet"]
    if arguments["config"] is not None:
        argv += ["--config", arguments["config"]]
    for override in arguments["overrides"]:
        argv += ["--set", override]
    return argv


def own_error(folder: Path) -> str | None:
    """The child's own one-line error (``overnight: error: ...``), from its last run's lines
    of the log, if it stopped on one: a refusal a new run would repeat."""
    try:
        text = (folder / "log.txt").read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.rsplit(RUN_MARK, 1)[-1].splitlines()):
        if line.startswith("overnight: error: "):
            return line[len("overnight: error: "):]
    return None


def death_cause(returncode: int) -> str:
    """How the child ended, in words, from its exit status (a signal, or a bare exit)."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"stopped with exit status {returncode} and no error of its own"


def read_deaths(folder: Path) -> list[dict]:
    """The batch's recorded deaths (DEATHS), oldest first; none if it never died."""
    try:
        text = (folder / DEATHS).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def spawn(arguments: dict, log_file, env: dict[str, str]) -> subprocess.Popen:
    """``overnight batch`` with ``run_batch``'s ``arguments`` as a child process: in a session
    of its own (killed whole), dying with the server, its output in ``log_file``."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", *argv(arguments)], stdout=log_file,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=die_with_parent,
        env={**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0"})


def record_death(folder: Path, cause: str) -> None:
    """One line of DEATHS, on disk before the queue goes on (a restart counts it)."""
    with open(folder / DEATHS, "a", encoding="utf-8") as record:
        record.write(json.dumps({"at": int(time.time()), "cause": cause}) + "\n")
        record.flush()
        os.fsync(record.fileno())
