"""Where the job runs: the Ray session, and how many engine replicas with what resources.

Ray does all the scheduling; this module only turns the config into Ray resource requests
sized so that the whole chain fits the cluster at once, and refuses, with a clear line, a request
that the cluster can never satisfy (Ray would wait forever, saying nothing).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import sys
import threading
from dataclasses import dataclass

from pipelines.config import JobConfig
from pipelines.errors import JobError, one_line

# Light stages (read, parse, write) take a fraction of a CPU, so on a small machine they never
# starve the engine of the cores it needs, nor deadlock waiting for them.
LIGHT_STAGE_CPUS = 0.25
LIGHT_STAGES_CPUS = 3 * LIGHT_STAGE_CPUS  # a read task, the parser and the writer, at once
TASK_EVENTS_KEPT = 10_000  # task records a Ray started here keeps in its GCS (Ray: 100,000)


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int
    num_gpus: float  # per replica
    num_cpus: float  # per replica
    # GPUs each replica reserves as one placement group (tensor x pipeline parallel > 1);
    # the actor then asks for no GPU of its own and vLLM's workers take the group's bundles.
    group_gpus: int = 0
    accelerator_type: str | None = None
    # CPU engines: compute threads each (the node's cores shared among its replicas), where
    # Ray would set an actor's threads to its whole reserved CPUs
    cpu_threads: int | None = None
    group_cpus: float = 1.0  # CPU in each GPU's bundle of the placement group

    def needs(self) -> dict[str, float]:
        """What all the engines reserve together, as Ray resources."""
        gpus = self.replicas * (self.group_gpus or self.num_gpus)
        cpus = self.replicas * (self.group_cpus * self.group_gpus if self.group_gpus
                                else self.num_cpus)
        return {"GPU": gpus, "CPU": cpus}

    def remote_args(self) -> dict:
        """Ray resource arguments for the predictor's ``map_batches``."""
        args: dict = {"num_cpus": self.num_cpus}
        if self.group_gpus:
            args["ray_remote_args_fn"] = functools.partial(
                placement_group_strategy, self.group_gpus, self.accelerator_type,
                self.group_cpus)
        elif self.num_gpus:
            args["num_gpus"] = self.num_gpus
            if self.accelerator_type:
                args["accelerator_type"] = self.accelerator_type
        if self.replicas > 1 and not self.group_gpus:
            args["scheduling_strategy"] = "SPREAD"  # engines on as many nodes as possible
        return args


def placement_group_strategy(gpus: int, accelerator_type: str | None,
                             cpus: float = 1.0) -> dict:
    """One replica's GPUs as a placement group packed on one node; the actor and everything
    it starts (vLLM's Ray workers) run inside it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1, "CPU": cpus} if cpus else {"GPU": 1}
    if accelerator_type:
        bundle[f"accelerator_type:{accelerator_type}"] = 0.001
    group = ray.util.placement_group([dict(bundle) for _ in range(gpus)],
                                     strategy="STRICT_PACK")
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_capture_child_tasks=True)}


@contextlib.contextmanager
def ray_session(address: str | None = None, verbose: bool = False):
    """Use the Ray already initialized in this process, else start (and later stop) one, or
    connect to the cluster at ``address``, shipping this project's code to its workers."""
    import ray

    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # the level we set, not the user's: its one notice is ours to drop (_without_level_notice)
    quiet_core = not verbose and "RAY_BACKEND_LOG_LEVEL" not in os.environ
    if not verbose:  # Ray's start-up notices and its C++ core's log lines, unless asked for
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    options: dict = dict(log_to_driver=verbose, configure_logging=True,
                         logging_level=logging.INFO if verbose else logging.ERROR)
    if address is None:
        options["include_dashboard"] = False
        # Ray's GCS keeps a record of every task and actor call (100,000 by default), and a
        # large job makes tens of thousands (docs/benchmarks.md). The records serve Ray's
        # dashboard and state API, which a job started here does not run; a few thousand are
        # plenty to debug one.
        os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", str(TASK_EVENTS_KEPT))
    else:
        import udfs

        # the pipelines package by its folder, which is what Ray takes of a package (its
        # __path__): `import pipelines` here would make its __init__.py an import of this file
        pipelines_folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        options["runtime_env"] = {"py_modules": [pipelines_folder, udfs]}
    try:
        with _no_http_servers(address is None), _without_level_notice(quiet_core):
            ray.init(address=address, **options)
    except ConnectionError as exc:
        # A cluster made by `ray start` (Ray >= 2.60) wants its auth token, which a driver
        # sends only with RAY_AUTH_MODE=token, read when Ray is imported.
        hint = "" if os.environ.get("RAY_AUTH_MODE") else (
            "; if the cluster uses token authentication (the default of `ray start`), "
            "export RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token)")
        raise JobError(f"resources.address {address!r}: cannot connect to a Ray cluster "
                       f"there ({one_line(exc, 200)}){hint}") from None
    if not verbose:
        _mute_ray_error_feed()
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _no_http_servers(local: bool):
    """A Ray started here serves no HTTP. ``include_dashboard=False`` still starts Ray's
    dashboard process (--port=8265, for usage stats) and its per-node agent (port 52365, with
    the jobs API, through which any local user could run code as this user), and both serve
    HTTP whenever Ray's optional dashboard packages import (``ray[default]``). Ray starts
    them ``--minimal``, with no HTTP server, when they do not; it asks
    ``get_dashboard_dependency_error`` while ``ray.init`` starts the processes, so that is
    where they are told so. (A cluster joined at an address is its owner's to secure.)"""
    from ray._private import utils

    check = getattr(utils, "get_dashboard_dependency_error", None)
    if not local or check is None:
        yield
        return
    utils.get_dashboard_dependency_error = lambda: ImportError(
        "overnight starts Ray without its dashboard's HTTP servers")
    try:
        yield
    finally:
        utils.get_dashboard_dependency_error = check


# What Ray's C++ core prints, whatever the level, when RAY_BACKEND_LOG_LEVEL is set: the one
# line that level lets through ("[2026-12-07 ... I 123 123] logging.cc:303: Set ray log ...").
_LEVEL_NOTICE = re.compile(rb"\[[^\]\n]*\] logging\.cc:\d+: Set ray log level from environment "
                           rb"variable RAY_BACKEND_LOG_LEVEL to -?\d+\r?\n")


@contextlib.contextmanager
def _without_level_notice(enabled: bool):
    """This process's stderr while Ray starts, less Ray's notice that RAY_BACKEND_LOG_LEVEL is
    set (the level that keeps its core's other lines off the terminal). Everything else is
    passed on as it comes, by a thread reading a pipe put in place of file descriptor 2."""
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError):  # no usable stderr (a closed one): nothing to filter
        yield
        return

    def forward():
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                os.write(saved, _LEVEL_NOTICE.sub(b"", chunk))
        os.close(saved)

    os.dup2(write_end, 2)
    os.close(write_end)
    reader = threading.Thread(target=forward, name="ray-start-stderr", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer here closed: the reader drains it and ends
        reader.join(timeout=5)


def _mute_ray_error_feed() -> None:
    """Ray's driver prints every error its workers report (each retry of a task of an actor
    that failed to start: hundreds of traceback lines) from a thread of its own. The job says
    what stopped it in one line; --verbose keeps Ray's feed."""
    from ray._private import worker

    if hasattr(worker, "print_to_stdstream"):
        worker.print_to_stdstream = lambda *args, **kwargs: None


def plan_replicas(config: JobConfig) -> ReplicaPlan:
    import ray

    total = ray.cluster_resources()
    gpus, cpus = int(total.get("GPU", 0)), total.get("CPU", 0)
    per = config.model.tensor_parallel_size * config.model.pipeline_parallel_size
    wanted = config.resources.replicas
    accelerator = config.resources.accelerator_type
    if config.engine.kind == "http":  # a replica is an HTTP client: no GPU, a sliver of CPU
        return ReplicaPlan(1 if wanted == "auto" else wanted, 0, LIGHT_STAGE_CPUS)
    if gpus == 0:
        if per > 1:
            raise JobError(f"model.tensor_parallel_size x pipeline_parallel_size = {per} "
                           "needs GPUs; the Ray cluster has none")
        if accelerator:
            raise JobError(f"resources.accelerator_type {accelerator!r}: the Ray cluster "
                           "has no GPU")
        replicas = 1 if wanted == "auto" else wanted
        # The engines take the real cores; what is left runs the light stages. An engine
        # may take a fraction of a CPU where several share a small node, or where one has
        # a single CPU (a whole one would leave the light stages none: Ray waits forever).
        spare = cpus - LIGHT_STAGES_CPUS
        if replicas > 1:
            per_replica = min(1.0, (spare / replicas) // LIGHT_STAGE_CPUS * LIGHT_STAGE_CPUS)
        else:
            per_replica = max(1.0, spare // 1) if spare >= 1 else \
                spare // LIGHT_STAGE_CPUS * LIGHT_STAGE_CPUS
        if replicas == 1 and per_replica < LIGHT_STAGE_CPUS:
            raise JobError(f"the Ray cluster has {cpus:g} CPUs and no GPU: an engine and the "
                           "read, parse and write stages need at least 1 CPU")
        if replicas > 1 and per_replica < 2 * LIGHT_STAGE_CPUS:
            raise JobError(f"resources.replicas {replicas}: the Ray cluster has {cpus:g} CPUs "
                           "and no GPU; use replicas: auto")
        nodes = _cpus_per_node()
        per_node = -(-replicas // max(len(nodes), 1))  # SPREAD: as even as it gets
        threads = max(1, int(min(nodes, default=cpus) // per_node))
        return ReplicaPlan(replicas, 0, per_replica, cpu_threads=threads)
    fit = sum(int(n) // per for n in _gpus_per_node())  # a replica's GPUs share one node
    if fit == 0:
        raise JobError(f"an engine of tensor_parallel_size x pipeline_parallel_size = {per} "
                       f"needs {per} GPUs on one node; the Ray cluster's nodes have at most "
                       f"{max(_gpus_per_node()):g}")
    replicas = fit if wanted == "auto" else wanted
    if replicas > fit:
        raise JobError(f"resources.replicas {replicas} x {per} GPUs per engine: the Ray "
                       f"cluster has {gpus} GPUs, room for {fit} such engines")
    share = gpu_engine_cpus(replicas, per, cpus, _node_resources())
    if per > 1:
        return ReplicaPlan(replicas, 0, share, group_gpus=per, accelerator_type=accelerator,
                           group_cpus=share)
    return ReplicaPlan(replicas, 1, share, accelerator_type=accelerator)


def gpu_engine_cpus(replicas: int, gpus_each: int, cpus: float,
                    nodes: list[dict[str, float]]) -> float:
    """The CPU each GPU of an engine reserves: a whole one where the cluster has them beside
    the light stages, else an even share of what is left (hundredths, maybe none). A GPU
    engine's own CPU work (scheduling, detokenizing) is light, and Ray's reservation does not
    limit the threads it runs; a whole CPU each left a 4-GPU, 4-CPU cluster waiting forever."""
    if cpus < LIGHT_STAGES_CPUS:
        raise JobError(f"the Ray cluster has {gpus_each * replicas} GPUs for the engines but "
                       f"{cpus:g} CPUs: the read, parse and write stages need "
                       f"{LIGHT_STAGES_CPUS:g} CPU; start its nodes with CPUs "
                       "(ray start --num-cpus)")
    share = (cpus - LIGHT_STAGES_CPUS) / (replicas * gpus_each)
    for node in nodes:  # an engine's GPUs and CPU share a node: each node must hold its own
        engines = int(node.get("GPU", 0)) // gpus_each
        if engines:
            share = min(share, node.get("CPU", 0) / (engines * gpus_each))
    return min(1.0, math.floor(share * 100) / 100)


def _node_resources() -> list[dict[str, float]]:
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def _gpus_per_node() -> list[float]:
    import ray

    return [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")]


def _cpus_per_node() -> list[float]:
    import ray

    return [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]


def check_paths_shared(paths: list[str]) -> None:
    """On a cluster of several nodes, every node must see the job's files (shared storage):
    a task pinned to each node looks for them, and a node that cannot is a clear error."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return

    @ray.remote(num_cpus=0)
    def missing(candidates: list[str]) -> list[str]:
        return [p for p in candidates if not os.path.exists(p)]

    checks = [missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(paths) for n in nodes]
    for node, absent in zip(nodes, ray.get(checks)):
        if absent:
            raise JobError(f"{absent[0]} is not visible on node {node['NodeManagerAddress']} "
                           f"({len(nodes)} nodes in the Ray cluster): put the job's input and "
                           "output on storage every node shares")
