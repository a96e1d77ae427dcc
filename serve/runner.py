"""The batch queue: validate, then run up to ``max_running`` batches at once, in the order they
were created, each as ``overnight batch``.

Each batch runs as a child process, ``python -m pipelines.cli batch input.jsonl -o results.jsonl
-e errors.jsonl --model M --config C --quiet``, in its own process group, so that it:

- runs exactly what the CLI runs (validation, results, errors file, resume), and the server
  owns only the queue around it;
- can be stopped whole (SIGKILL to the group: its parts are committed atomically);
- dies with the server (``PR_SET_PDEATHSIG``): a ``kill -9`` of the server leaves no engine
  running, and the restarted server starts the child again, which resumes from the job's
  committed parts (``run_batch_file`` resumes an interrupted run of the same file);
- when it dies on its own (the OOM killer), takes its Ray processes with it (its group is
  killed) and is started again from those parts, ``ATTEMPTS`` runs at most; past that the
  batch fails with the results done so far, delivered as a cancel delivers them.

With a resident engine (serve/engine.py) a batch runs in a batch worker (serve/worker.py),
which runs ``overnight batch`` in process, one batch after another, Ray and imports started
once; its job sends its requests to the engine: the running
batches share it, each with at most its share of the engine's requests in flight, so the
engine works on all of them side by side (round robin by batch, in effect): a small batch
started behind a large one finishes in its own time. A batch waits in the queue only while
``max_running`` others run. Embedding batches (and every batch without a resident engine)
load an engine of their own, as ``overnight batch`` does.

While it runs, ``request_counts`` is read from those committed parts (each part once), in the
job's staging folder ``results.jsonl.overnight/output.partial/``. A cancelled batch gets the
results of the parts done so far, written by ``pipelines.batchfile.results.write_results`` as the CLI
writes them at the end of a run (both: serve/results.py; the child itself: serve/child.py).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

from serve.child import (RUN_MARK, death_cause, own_error, read_deaths, record_death, spawn,
                         stop_stale_child)
from serve.processes import kill_group, kill_session
from serve.results import deliver, errors_file, finalize, one_error, update_counts
from serve.store import INPUT, RESULTS, Store
from serve.validate import check_input_file
from serve.worker import Worker, WorkerRun

log = logging.getLogger("overnight.serve")

POLL = 0.5  # seconds between looks at a running child (counts, cancel)
# A child that dies without its own error (the OOM killer's SIGKILL, a crash) is started again
# from the job's committed parts, up to this many runs in all; each death is one line of
# DEATHS in the batch's folder (serve/child.py), which survives a restart of the server.
ATTEMPTS = 3
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
EMBEDDINGS = "/v1/embeddings"  # a batch of these runs on an engine of its own
# a stopped batch's final status, by the type its requests not reached were given
FINAL_STATUS = {"canceled": "cancelled", "expired": "expired", "errored": "failed"}


class Runner:
    """Two daemon threads: one validates new batches, one runs the queue.

    ``config``: the batches' job config (a YAML path); ``resident``: the job config of a
    batch run on the resident engine and the environment its child needs (the engine's key),
    or None (every batch loads its own engine)."""

    def __init__(self, store: Store, *, model: str, config: Path | None,
                 overrides: list[str], served_model: str, max_running: int = 1,
                 resident: tuple[Path, dict[str, str]] | None = None, engine=None):
        from serve.engine import resident_engine

        self.store, self.model, self.config = store, model, config
        self.overrides, self.served_model = overrides, served_model
        self.max_running, self.resident = max(1, max_running), resident
        # the resident engine itself (serve/engine.py), released for an embedding batch
        # on a GPU it fills (engine_turn)
        self.engine = engine if engine is not None or resident is None else resident_engine()
        self._validate_wake, self._run_wake = threading.Event(), threading.Event()
        self._counted: dict[str, tuple[int, int]] = {}  # part path -> (requests, failed)
        self.running: dict[str, subprocess.Popen] = {}  # batch id -> its child (runner thread)
        self._idle: list = []  # batch workers between batches (serve/worker.py)
        # the server is exiting: the queue stops (stop_workers), and says when it has
        self._stopping, self._stopped = threading.Event(), threading.Event()
        self._stopped.set()  # (until the queue's thread runs)

    def start(self) -> None:
        for target, name in ((self._validate_loop, "validator"), (self._run_loop, "runner")):
            threading.Thread(target=target, name=f"overnight-serve-{name}", daemon=True).start()

    def wake(self) -> None:
        self._validate_wake.set()
        self._run_wake.set()

    def stop_workers(self) -> None:
        """Every batch's child and batch worker killed with all it started (the server is
        exiting). The queue stops first, so nothing starts again and no kill is counted as
        a batch's death; then each child's whole session goes: a child or worker killed by
        PDEATHSIG alone left its Ray's agents running, and Ray's
        workers take process groups of their own inside the session."""
        self._stopping.set()
        self._run_wake.set()
        self._stopped.wait(60)  # the queue's step in progress ends first
        for child in [*list(self.running.values()), *self._idle]:
            kill_session(child.worker.proc if isinstance(child, WorkerRun)
                          else getattr(child, "proc", child))

    # -- validation --------------------------------------------------------------------------

    def _validate_loop(self) -> None:
        while True:
            for batch_id in self.store.batches_in("validating"):
                self._guard(batch_id, self._validate, batch_id)
            self._validate_wake.wait(5)
            self._validate_wake.clear()

    def _validate(self, batch_id: str) -> None:
        batch = self.store.get_batch(None, batch_id)
        checked = check_input_file(self.store.batch_dir(batch_id) / INPUT, batch["endpoint"])
        now = int(time.time())
        counts = {"total": checked.requests, "completed": 0, "failed": 0}
        if checked.errors:  # its requests were never accepted: none counted, as the hosted
            # API counts a file it refuses (completed + failed = total holds)
            self.store.update_batch(batch_id, only_if=("validating",), status="failed",
                                    failed_at=now, errors=checked.as_errors(),
                                    request_counts={**counts, "total": 0})
        else:  # queued: in_progress as OpenAI names it, in_progress_at once it starts
            self.store.update_batch(batch_id, only_if=("validating",), status="in_progress",
                                    request_counts=counts)
        self._run_wake.set()

    # -- the queue ---------------------------------------------------------------------------

    def _run_loop(self) -> None:
        self._stopped.clear()
        while not self._stopping.is_set():
            self._housekeeping()
            for batch_id, child in list(self.running.items()):
                self._guard(batch_id, self._watch, batch_id, child)
            queue = [b for b in self.store.batches_in("in_progress")
                     if b not in self.running and not self._expired(b)]
            for batch_id in queue[:self.max_running - len(self.running)]:
                if not self._my_turn(batch_id):  # in order: the next ones wait behind it
                    break
                self._guard(batch_id, self._start, batch_id)
            self._run_wake.wait(POLL if self.running or self._waiting_for_gpu() else 5)
            self._run_wake.clear()
        self._stopped.set()

    def _my_turn(self, batch_id: str) -> bool:
        """Whether the batch may start now, the resident engine released or loaded again
        first where ``engine_turn`` says so."""
        if self.engine is None:
            return True
        running = [(self.store.get_batch(None, b) or {}).get("endpoint") for b in self.running]
        turn = engine_turn((self.store.get_batch(None, batch_id) or {}).get("endpoint"),
                           shares_gpu=self.engine.on_gpu, running=running,
                           loaded=self.engine.serving())
        if turn == RELEASE:
            self.engine.release()
        elif turn == LOAD:
            self.engine.acquire()
        return turn in (START, RELEASE)

    def _waiting_for_gpu(self) -> bool:
        return self.engine is not None and self.engine.loading()

    def _housekeeping(self) -> None:
        """Batches not running that need a step: cancelled while queued (or while the server
        was down), or finished but not yet finalized when the server was killed."""
        for batch_id in self.store.batches_in("cancelling"):
            if batch_id not in self.running:
                self._guard(batch_id, self._finish_cancel, batch_id)
        for batch_id in self.store.batches_in("finalizing"):
            if batch_id not in self.running:
                self._guard(batch_id, finalize, self.store, batch_id, "completed")

    def _expired(self, batch_id: str) -> bool:
        """True, and the batch expired with the results done so far (as the hosted API does),
        once its completion window has passed; its job stopped first."""
        batch = self.store.get_batch(None, batch_id)
        if batch is None or batch["status"] != "in_progress" \
                or time.time() < (batch.get("expires_at") or float("inf")):
            return False
        self._stop_child(batch_id)
        self._guard(batch_id, self._expire, batch_id)
        return True

    def _expire(self, batch_id: str) -> None:
        stop_stale_child(self.store, batch_id)
        self._deliver(batch_id, "expired")
        finalize(self.store, batch_id, "expired", only_if=("in_progress",))

    def _stop_child(self, batch_id: str) -> None:
        child = self.running.pop(batch_id, None)
        if child is not None:
            kill_group(child)
            self.store.set_child(batch_id, None)

    def _guard(self, batch_id: str, step, *args) -> None:
        """A step that fails on a server bug ends its batch, not the queue: cancelled if the
        user asked for that, else failed; a batch already in a final status keeps it."""
        try:
            step(*args)
        except Exception as exc:  # noqa: BLE001 - the queue must go on
            log.exception("batch %s: %s", batch_id, type(exc).__name__)
            self._stop_child(batch_id)
            now, errors = int(time.time()), one_error("server_error", type(exc).__name__)
            if self._end_with_results(batch_id, errors):
                return
            if self.store.update_batch(batch_id, only_if=("cancelling",), status="cancelled",
                                       cancelled_at=now, errors=errors) is None:
                self.store.update_batch(batch_id, only_if=UNFINISHED, status="failed",
                                        failed_at=now, errors=errors)

    def _end_with_results(self, batch_id: str, errors: dict) -> bool:
        """A batch a server bug stops, ended as a stopped batch is: cancelled (if asked) or
        failed, with every request in its files (done, or not reached). False where even
        that fails: then it ends without them."""
        batch = self.store.get_batch(None, batch_id)
        if batch is None or batch["status"] not in UNFINISHED:
            return False
        status, kind = (("cancelled", "canceled") if batch["status"] == "cancelling"
                        else ("failed", "errored"))
        try:
            self._deliver(batch_id, kind)
            finalize(self.store, batch_id, status, only_if=UNFINISHED, errors=errors)
        except Exception:  # noqa: BLE001 - the same bug again, most likely
            log.exception("batch %s: its results could not be delivered", batch_id)
            return False
        return True

    def _start(self, batch_id: str) -> None:
        from pipelines.batchfile.results import finish_write

        folder = self.store.batch_dir(batch_id)
        stop_stale_child(self.store, batch_id)
        batch = self.store.get_batch(None, batch_id)
        written = finish_write(folder / RESULTS, errors_file(batch, folder))
        if written is not None:  # the child finished, or a stop delivered its files; the
            # server did not see the end: the batch ends as the files say
            stopped = written.get("unfinished")
            finalize(self.store, batch_id, FINAL_STATUS.get(stopped, "completed"),
                     only_if=("in_progress", "finalizing"),
                     **({"errors": one_error("batch_failed", "the batch stopped "
                                             "before its end; the results done are "
                                             "delivered")}
                        if stopped == "errored" else {}))
            return
        deaths = read_deaths(folder)
        if len(deaths) >= ATTEMPTS:  # given up before a restart, not yet delivered
            self._give_up(batch_id, deaths)
            return
        self.store.update_batch(batch_id, only_if=("in_progress",),
                                in_progress_at=int(batch.get("in_progress_at") or time.time()))
        self.running[batch_id] = self._launch(batch_id, folder, batch)

    def _watch(self, batch_id: str, child: subprocess.Popen) -> None:
        """One look at a running batch: its window, a cancel, its counts; once its child has
        exited, what comes next (finalized, started again, or failed)."""
        if child.poll() is None:
            if self._expired(batch_id):
                return
            if self.store.get_batch(None, batch_id)["status"] == "cancelling":
                self._stop_child(batch_id)
                self._finish_cancel(batch_id)
                return
            update_counts(self.store, batch_id, self._counted)
            return
        if isinstance(child, WorkerRun) and child.returncode == 0 and child.worker.alive():
            del self.running[batch_id]  # the worker, ready for the next batch
            self.store.set_child(batch_id, None)
            self._idle.append(child.worker)
        else:
            self._stop_child(batch_id)  # what the child started (Ray's processes) goes with it
        folder = self.store.batch_dir(batch_id)
        if child.returncode == 0 and self.store.update_batch(
                batch_id, only_if=("in_progress",), status="finalizing",
                finalizing_at=int(time.time())) is not None:
            finalize(self.store, batch_id, "completed")
        elif self.store.get_batch(None, batch_id)["status"] == "cancelling":
            self._finish_cancel(batch_id)
        elif (message := own_error(folder)) is not None:  # it ran and refused: not again
            self._give_up(batch_id, [], message)
        else:
            cause = death_cause(child.returncode)
            record_death(folder, cause)
            deaths = read_deaths(folder)
            if len(deaths) < ATTEMPTS:  # still in_progress: the queue starts it again
                log.warning("batch %s: its job %s (run %d of %d); starting it again from its "
                            "committed parts", batch_id, cause, len(deaths), ATTEMPTS)
            else:
                self._give_up(batch_id, deaths)

    def _give_up(self, batch_id: str, deaths: list[dict], message: str | None = None) -> None:
        """A batch that cannot finish: failed, with the results of the parts done so far
        (delivered as a cancel delivers them) and the reason in its errors."""
        if message is None:
            message = (f"the batch's job died {len(deaths)} times (last: "
                       f"{deaths[-1]['cause']}); the results done so far are delivered")
        self._deliver(batch_id, "errored")
        finalize(self.store, batch_id, "failed", only_if=("in_progress",),
                 errors=one_error("batch_failed", message))
        log.info("batch %s: failed: %s", batch_id, message)

    def _launch(self, batch_id: str, folder: Path, batch: dict) -> subprocess.Popen:
        # an embedding batch needs a pooling engine: its own, as `overnight batch` loads it
        warm = self.resident is not None and batch["endpoint"] != EMBEDDINGS
        config, env = self.resident if warm else (self.config, {})
        # a message batch (serve/anthropic.py): one results file, Anthropic's results
        errors = errors_file(batch, folder)
        # `overnight batch`'s arguments: pipelines.batchfile.run.run_batch's
        arguments = {"requests": str(folder / INPUT), "results": str(folder / RESULTS),
                     "errors": None if errors is None else str(errors),
                     "format": "anthropic" if errors is None else "openai",
                     "model": self.model, "served_model_name": self.served_model,
                     "quiet": True, "config": None if config is None else str(config),
                     # in input order: a running batch's counts, and what a cancel or an
                     # expiry delivers, are read from its job's parts in input order
                     "overrides": [*self.overrides, "resources.group_by_prefix=false"]}
        with open(folder / "log.txt", "ab") as log_file:
            log_file.write(RUN_MARK.encode())  # where this run's own error would start
            log_file.flush()
            if warm:  # in a batch worker, started once (serve/worker.py)
                child = self._worker(env).run(arguments, folder / "log.txt")
            else:
                child = spawn(arguments, log_file, env)
        self.store.set_child(batch_id, child.pid)
        log.info("batch %s: started (pid %d%s)", batch_id, child.pid,
                 ", on the resident engine" if warm else "")
        return child

    def _worker(self, env: dict[str, str]) -> Worker:
        """An idle batch worker, or a new one."""
        while self._idle:
            worker = self._idle.pop()
            if worker.alive():
                return worker
        return Worker({**env, "RAY_USAGE_STATS_ENABLED": "0"},
                      self.store.root / "workers.log")

    # -- cancel, deliver ---------------------------------------------------------------------

    def _finish_cancel(self, batch_id: str) -> None:
        """A stopped (or never started) batch: the results of the parts done so far."""
        stop_stale_child(self.store, batch_id)
        self._deliver(batch_id, "canceled")
        finalize(self.store, batch_id, "cancelled", only_if=("cancelling",))

    def _deliver(self, batch_id: str, unfinished: str) -> None:
        """The batch's result and error files from its parts done so far (serve/results.py)."""
        deliver(self.store, batch_id, unfinished, model=self.model,
                served_model=self.served_model)


START, WAIT, RELEASE, LOAD = "start", "wait", "release", "load"


def engine_turn(endpoint: str | None, *, shares_gpu: bool, running: list[str | None],
                loaded: bool) -> str:
    """Whether the next batch in the queue starts now, on a server with a resident engine.
    An embedding batch loads an engine of its own (a pooling one). On a CPU nothing fills,
    and it runs beside the resident engine (START). On a GPU the resident engine fills it
    (``gpu_memory_utilization``): a second engine there would fail to load, or starve the
    first. So there an embedding batch waits until no batch runs (WAIT), then the resident
    engine is released (RELEASE) and the batch starts; the next generation batch waits
    until the embedding batches are done and the engine is loaded again (LOAD, then WAIT
    while it loads). ``running``: the endpoints of the batches running."""
    embedding = endpoint == EMBEDDINGS
    if not shares_gpu:
        return START
    if embedding:
        if running:
            return WAIT
        return RELEASE if loaded else START
    if EMBEDDINGS in running:
        return WAIT
    return START if loaded else LOAD
