"""No silent hang: a job that commits nothing for a while says, in one line, what it waits for.

Ray waits for resources without a word: an actor that no node can hold stays pending forever,
and the driver's ``iter_batches`` just blocks. ``watch`` wraps that iterator; a thread beside it
notices when no part has come for ``NOTICE_AFTER_S`` and compares what the engines and the light
stages reserve with what the cluster has free.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable, Iterator

from pipelines.config import JobConfig
from pipelines.job.resources import LIGHT_STAGE_CPUS, LIGHT_STAGES_CPUS, plan_replicas

# Long enough that an engine loading a model on a GPU stays quiet; repeated while it lasts.
NOTICE_AFTER_S = float(os.environ.get("OVERNIGHT_WAIT_NOTICE_S", "60"))


def watch(batches: Iterable, config: JobConfig, after_s: float | None = None,
          stream=None) -> Iterator:
    """Yield ``batches``; while none comes for ``after_s`` seconds, print why, every
    ``after_s``. The watching thread ends with the iteration, however it ends."""
    after_s = NOTICE_AFTER_S if after_s is None else after_s
    last = [time.monotonic()]
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(min(after_s, 5.0)):
            idle = time.monotonic() - last[0]
            if idle >= after_s:
                try:
                    line = waiting_line(config, idle)
                except Exception:  # Ray going away under it: the watchdog breaks nothing
                    line = None
                if line:
                    _say(line, stream or sys.stderr)
                last[0] = time.monotonic()

    thread = threading.Thread(target=run, name="overnight-watchdog", daemon=True)
    thread.start()
    try:
        for batch in batches:
            last[0] = time.monotonic()
            yield batch
    finally:
        stop.set()


def waiting_line(config: JobConfig, idle: float) -> str | None:
    """One line: what the job reserves, what the cluster has free, and what is pending; None
    when every actor is up and a read task could start (an engine busy with a long block on
    a CPU is no news)."""
    import ray

    try:
        plan = plan_replicas(config)
    except Exception as exc:  # the plan ran once already; say what we can
        return f"waiting: nothing written for {idle:.0f} s ({exc})"
    need, free, total = plan.needs(), ray.available_resources(), ray.cluster_resources()
    engines = f"{plan.replicas} engine(s) need " + " + ".join(
        f"{need[k]:g} {k}" for k in ("GPU", "CPU") if need[k])
    have = ", ".join(f"{free.get(k, 0):g} {k} free of {total.get(k, 0):g}"
                     for k in ("GPU", "CPU") if total.get(k, 0) or need[k])
    pending = _pending_actors()
    if pending == 0 and free.get("CPU", 0) >= LIGHT_STAGE_CPUS:
        return None
    if pending:
        return (f"waiting for resources: nothing written for {idle:.0f} s and {pending} of the "
                f"job's actors cannot start; {engines} and the read, parse and write stages "
                f"{LIGHT_STAGES_CPUS:g} CPU; the Ray cluster has {have}: free them (another "
                "job?), add nodes, or lower resources.replicas")
    return (f"waiting for resources: nothing written for {idle:.0f} s; {engines} and the "
            f"read, parse and write stages {LIGHT_STAGES_CPUS:g} CPU; the Ray cluster has "
            f"{have}")


def _pending_actors() -> int | None:
    """Actors of this job that Ray has not placed yet (None: unknown). Ray's public state API
    needs the dashboard, which the job's own Ray does not start; its actor table does not."""
    try:
        import ray
        from ray._private.state import state

        job = ray.get_runtime_context().get_job_id()
        return sum(1 for a in state.actor_table(None).values()
                   if a.get("State") == "PENDING_CREATION" and a.get("JobID") == job)
    except Exception:  # a private API: without it the line still says what is free
        return None


def _say(line: str, stream) -> None:
    tty = hasattr(stream, "isatty") and stream.isatty()
    stream.write(("\r\x1b[2K" if tty else "") + f"overnight: {line}\n")  # off the progress line
    stream.flush()
