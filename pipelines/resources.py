"""Where the job runs: the Ray session, and how many engine replicas with what resources.

Ray does all the scheduling; this module only turns the config into Ray resource requests and
refuses, with a clear line, a request that the cluster can never satisfy (Ray would wait forever).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from pipelines.config import JobConfig
from pipelines.errors import JobError

# Light stages (read, render, write) take a fraction of a CPU, so on a small machine they never
# starve the engine of the cores it needs, nor deadlock waiting for them.
LIGHT_STAGE_CPUS = 0.25


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int
    num_gpus: float  # per replica
    num_cpus: float  # per replica


@contextlib.contextmanager
def ray_session(address: str | None = None, verbose: bool = False):
    """Use the Ray already initialized in this process, else start (and later stop) one."""
    import ray

    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not verbose:  # Ray's start-up notices and its C++ core's log lines, unless asked for
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)
    ray.init(address=address, include_dashboard=False, log_to_driver=verbose,
             logging_level=logging.INFO if verbose else logging.ERROR,
             configure_logging=True)
    try:
        yield
    finally:
        ray.shutdown()


def plan_replicas(config: JobConfig) -> ReplicaPlan:
    import ray

    total = ray.cluster_resources()
    gpus, cpus = int(total.get("GPU", 0)), total.get("CPU", 0)
    tp = config.model.tensor_parallel_size
    wanted = config.resources.replicas
    if config.engine.kind == "http":  # a replica is an HTTP client: no GPU, a sliver of CPU
        return ReplicaPlan(1 if wanted == "auto" else wanted, 0, LIGHT_STAGE_CPUS)
    if gpus == 0:
        if tp > 1:
            raise JobError(f"model.tensor_parallel_size {tp} needs GPUs; the Ray cluster has none")
        replicas = 1 if wanted == "auto" else wanted
        # The engine takes the real cores; what is left runs the light stages.
        per_replica = max(1.0, (cpus - 3 * LIGHT_STAGE_CPUS) // replicas)
        if replicas * per_replica + LIGHT_STAGE_CPUS > cpus:
            raise JobError(f"resources.replicas {replicas}: the Ray cluster has {cpus:g} CPUs "
                           "and no GPU; use replicas: auto")
        return ReplicaPlan(replicas, 0, per_replica)
    fit = gpus // tp
    if fit == 0:
        raise JobError(f"model.tensor_parallel_size {tp} needs {tp} GPUs; "
                       f"the Ray cluster has {gpus}")
    replicas = fit if wanted == "auto" else wanted
    if replicas > fit:
        raise JobError(f"resources.replicas {replicas} x tensor_parallel_size {tp} needs "
                       f"{replicas * tp} GPUs; the Ray cluster has {gpus}")
    return ReplicaPlan(replicas, tp, 1)
