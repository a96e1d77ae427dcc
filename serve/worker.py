"""A batch worker: ``overnight batch`` runs, one after another, in one long-lived process with
its own Ray, for the batches of the resident engine (serve/engine.py).

A batch's job is exactly what ``python -m pipelines.cli batch ...`` runs: the same function,
``pipelines.batchfile.run.run_batch``, with the same arguments, ended as the command line ends a run
(``pipelines.errors.exit_status``: a user's mistake one line and status 2), its output to the
batch's log; only what it costs to start is paid once: Python's imports and Ray's start, which
were most of a small batch's time (docs/benchmarks.md). A worker runs one batch at a time;
the runner treats it as that batch's child while it runs (``WorkerRun``), so a cancel, an
expiry or a restart kills it whole (its process group, its Ray with it) exactly as it killed a
child, and a worker that failed is never given another batch.

Protocol: the runner writes a JSON line ``{"batch": {...}, "log": path}`` to the worker's stdin,
``batch`` the keyword arguments of ``run_batch``; the worker answers ``{"rc": N}`` on its stdout
once the run ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback

from serve.processes import die_with_parent


def main() -> None:  # pragma: no cover - runs in the worker process
    from pipelines.batchfile.run import run_batch
    from pipelines.job.resources import ray_session

    answers = os.fdopen(os.dup(1), "w")  # the runner reads answers here
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints go nowhere between runs
    with ray_session():  # one Ray for the worker's life: each job finds it initialized
        for line in sys.stdin:
            job = json.loads(line)
            answers.write(json.dumps({"rc": _run(run_batch, job["batch"], job["log"])}) + "\n")
            answers.flush()


def _run(run_batch, arguments: dict, log_path: str) -> int:  # pragma: no cover - in the worker
    """``overnight batch`` with ``arguments`` (``run_batch``'s), its exit status as the command
    line's, its stdout and stderr appended to ``log_path``."""
    from pipelines.errors import exit_status

    saved = os.dup(1), os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        return exit_status(lambda: run_batch(**arguments))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash is this run's, reported as a child's would be
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log, *saved):
            os.close(fd)


class Worker:
    """A worker process, in its own process group, dying with the thread that started it."""

    def __init__(self, env: dict[str, str], log_path):
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "serve.worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                preexec_fn=die_with_parent, env={**os.environ, **env})
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, arguments: dict, log_path) -> WorkerRun:
        """A batch run: ``pipelines.batchfile.run.run_batch(**arguments)``."""
        self.proc.stdin.write((json.dumps({"batch": arguments, "log": str(log_path)}) + "\n")
                              .encode())
        self.proc.stdin.flush()
        return WorkerRun(self)

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class WorkerRun:
    """One batch's run in a worker, with the part of ``subprocess.Popen`` the runner uses:
    ``pid``, ``poll()``, ``returncode`` (a signal's negative number if the worker died),
    ``wait()``."""

    def __init__(self, worker: Worker):
        self.worker, self.pid, self.returncode = worker, worker.pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self.worker.proc.stdout], [], [], 0)
            if ready:
                line = self.worker.proc.stdout.readline()
                self.returncode = json.loads(line)["rc"] if line else self.worker.proc.wait()
            elif not self.worker.alive():
                self.returncode = self.worker.proc.returncode
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            select.select([self.worker.proc.stdout], [], [], 0.5)
        return self.returncode


if __name__ == "__main__":
    main()
