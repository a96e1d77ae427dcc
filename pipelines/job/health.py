"""The job's engine health, seen from the driver: the replicas' live counts read every second
into the progress line and the report's samples, whether other processes share the engines'
cores (said once), and the engines' deaths once the job ends."""

from __future__ import annotations

import threading
import time

from pipelines.job.cpu_share import OtherLoad
from pipelines.job.progress import Progress


MAX_SAMPLES = 1000  # the report's throughput-over-time samples, at most about
OTHERS_EVERY = 10  # polls between two readings of the cores other processes use


class Health:
    """The job's EngineHealth actor (udfs/engines/recovery.py): the replicas' live counts,
    read every ``every`` seconds into the progress line and the report's samples; its summary
    of engine deaths once the job ends."""

    def __init__(self, max_restarts: int, progress: Progress, every: float = 1.0,
                 check_cores: bool = False, engine_cores: float | None = None):
        import uuid

        import ray

        from udfs.engines.recovery import EngineHealth

        self.name = f"overnight-health-{uuid.uuid4().hex[:12]}"
        self.actor = ray.remote(EngineHealth).options(
            name=self.name, num_cpus=0, lifetime=None).remote(max_restarts)
        self.samples: list[dict] = []  # {"t": Unix seconds, "tokens": generated so far}
        self._stop = threading.Event()
        # engines on this machine: whether other processes share its cores, said once
        self.others = OtherLoad() if check_cores else None
        if self.others is not None:
            self.others.others_cores(0)  # the first reading, to count from
        self.engine_cores = engine_cores
        self._poller = threading.Thread(target=self._poll, args=(progress, every),
                                        name="overnight-progress", daemon=True)
        self._poller.start()

    def _poll(self, progress: Progress, every: float) -> None:
        import ray

        polls = 0
        while not self._stop.wait(every):
            polls += 1
            if self.others is not None and polls % OTHERS_EVERY == 0:
                line = self.others.busy_line(self.others.others_cores(OTHERS_EVERY * every),
                                             self.engine_cores)
                if line is not None:
                    progress.say(line)
                    self.others = None  # once
            try:
                counts = ray.get(self.actor.snapshot.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - Ray going away: the job's own error says why
                return
            self.samples.append({"t": time.time(), "tokens": counts["tokens"],
                                 "requests": counts["requests"],
                                 "idle_s": counts.get("idle_s", 0)})
            if len(self.samples) > 2 * MAX_SAMPLES:  # a night's job: one in two, the last kept
                self.samples = self.samples[-1::-2][::-1]
            progress.update_live(counts)

    def close(self) -> dict:
        import ray

        self._stop.set()
        self._poller.join(timeout=15)
        try:
            return ray.get(self.actor.summary.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the summary is a report's extra, never a failure
            return {}
        finally:
            ray.kill(self.actor)
