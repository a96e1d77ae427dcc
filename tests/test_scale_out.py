"""Scale-out, proven with Ray itself (no GPU here): a Ray cluster with declared fake GPUs gets
one engine per GPU, or per placement group of GPUs with tensor parallel; a real two-node Ray
cluster on this machine shares a job's rows between its nodes; a request that cannot fit is a
fast, clear error. The engines underneath run on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from conftest import REPO, job_config
from servers import free_port

RAY = str(Path(sys.executable).with_name("ray"))
ROWS = [{"sku": f"G{i:03d}", "title": f"Lamp {i}", "description": "A lamp."} for i in range(24)]


class LocalCluster:
    """``ray start --block`` processes (a head, maybe a worker node) on loopback, stopped by
    signalling their own process groups: ``ray stop`` would stop every Ray on the machine."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []
        # Ray's socket paths must stay under 108 bytes: its temp dir gets a short name
        self.temp = Path(tempfile.mkdtemp(prefix="ovr-ray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def start_node(self, *args: str, head: bool = False) -> None:
        if head:  # token authentication (Ray's default for `ray start`) needs a token here
            subprocess.run([RAY, "get-auth-token", "--generate"], capture_output=True,
                           check=True, timeout=120)
        where = ["--head", f"--port={self.port}", "--include-dashboard=false",
                 f"--temp-dir={self.temp}"] if head else [f"--address={self.address}"]
        log = open(self.root / f"node-{len(self.procs)}.log", "wb")
        self.procs.append(subprocess.Popen(
            [RAY, "start", "--block", *where, *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}))

    def wait_for(self, nodes: int, timeout: float = 120) -> None:
        # One probe (a Python importing Ray, connected as a driver would) counts the alive
        # nodes until they are ``nodes``, rather than one probe a second: each imports Ray
        code = (f"import time, ray; ray.init(address={self.address!r}, logging_level='ERROR')\n"
                f"deadline = time.time() + {timeout}\n"
                "while True:\n"
                "    alive = sum(1 for n in ray.nodes() if n['Alive'])\n"
                f"    if alive == {nodes} or time.time() > deadline:\n"
                "        break\n"
                "    time.sleep(0.5)\n"
                "print(alive)")
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, timeout=timeout + 60,
                                     env={**os.environ, "RAY_AUTH_MODE": "token"})
            except subprocess.TimeoutExpired:
                continue
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(nodes)]:
                return
            time.sleep(1)
        raise RuntimeError(f"Ray cluster at {self.address} did not get {nodes} nodes")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # SIGTERM would drain for 30 s; nothing to keep
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


def run_on(cluster: LocalCluster, root: Path, name: str, tiny_model: str, **sections):
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = job_config(tiny_model, root / "in.jsonl", root / name,
                        input={"id_column": "sku"}, sampling={"max_tokens": 8},
                        resources={"address": cluster.address, "batch_size": 1,
                                   "blocks_in_flight": 1})
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    # Dispatch no block before every engine is up, so each replica gets rows to report.
    # The clusters `ray start` makes use token authentication: the driver must say so.
    env = {**os.environ, "RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S": "600",
           "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet"],
                         capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    report = None
    if run.returncode == 0:
        report = json.loads((root / f"{name}.report.json").read_text())
    return run, report


@pytest.fixture(scope="module")
def fake_gpus(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("fake-gpus"))
    cluster.start_node("--num-cpus=6", "--num-gpus=4", head=True)
    try:
        cluster.wait_for(1)
        yield cluster
    finally:
        cluster.stop()


def test_auto_makes_one_replica_per_gpu(fake_gpus, tiny_model, tmp_path):
    run, report = run_on(fake_gpus, tmp_path, "auto", tiny_model)
    assert run.returncode == 0, run.stderr[-3000:]
    replicas = report["throughput"]["per_replica"]
    assert len(replicas) == 4
    assert sorted(g for r in replicas for g in r["gpus"]) == ["0", "1", "2", "3"]
    assert all(len(r["gpus"]) == 1 and r["rows"] > 0 for r in replicas)
    assert sum(r["rows"] for r in replicas) == len(ROWS)
    assert pl.read_parquet(tmp_path / "auto")["sku"].to_list() == [r["sku"] for r in ROWS]


def test_tensor_parallel_2_makes_2_replicas_of_2_gpus(fake_gpus, tiny_model, tmp_path):
    # The placement groups are real; the CPU engine inside cannot take TP 2, so it is told
    # to run whole (engine.args reach vllm.LLM verbatim; on GPUs leave them out).
    run, report = run_on(fake_gpus, tmp_path, "tp2", tiny_model,
                         model={"tensor_parallel_size": 2},
                         engine={"args": {"tensor_parallel_size": 1,
                                          "distributed_executor_backend": "uni"}})
    assert run.returncode == 0, run.stderr[-3000:]
    replicas = report["throughput"]["per_replica"]
    assert len(replicas) == 2
    assert all(len(set(r["gpus"])) == 2 for r in replicas)
    assert sorted(g for r in replicas for g in r["gpus"]) == ["0", "1", "2", "3"]
    assert sum(r["rows"] for r in replicas) == len(ROWS)


def test_a_request_that_cannot_fit_is_a_fast_clear_error(fake_gpus, tiny_model, tmp_path):
    run, _ = run_on(fake_gpus, tmp_path, "unfit", tiny_model, resources={"replicas": 5})
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "overnight: error: resources.replicas 5 x 1 GPUs per engine: the Ray cluster has 4 "
        "GPUs, room for 4 such engines")


def test_an_engine_larger_than_any_node_is_refused(monkeypatch):
    """The placement check itself, on a made-up cluster of two 4-GPU nodes."""
    import ray

    from pipelines import load_config
    from pipelines.errors import JobError
    from pipelines.job.resources import plan_replicas

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16, "GPU": 8})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 4}}] * 2)
    base = job_config("m", "in.jsonl", "out")
    plan = plan_replicas(load_config({**base, "model": {**base["model"],
                                                          "tensor_parallel_size": 4}}))
    assert (plan.replicas, plan.group_gpus, plan.num_gpus) == (2, 4, 0)
    with pytest.raises(JobError, match="needs 8 GPUs on one node; the Ray cluster's nodes "
                                       "have at most 4"):
        plan_replicas(load_config({**base, "model": {**base["model"],
                                                     "tensor_parallel_size": 8}}))


def test_two_node_cluster_processes_rows_on_both_nodes(tiny_model, tmp_path):
    cluster = LocalCluster(tmp_path)
    cluster.start_node("--num-cpus=1", "--num-gpus=0", head=True)
    try:
        cluster.wait_for(1)
        cluster.start_node("--num-cpus=1", "--num-gpus=0")
        cluster.wait_for(2)
        run, report = run_on(cluster, tmp_path, "two-nodes", tiny_model,
                             resources={"replicas": 2})
    finally:
        cluster.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    replicas = report["throughput"]["per_replica"]
    assert len({r["node_id"] for r in replicas}) == 2
    assert all(r["rows"] > 0 for r in replicas)
    out = pl.read_parquet(tmp_path / "two-nodes")
    assert out["sku"].to_list() == [r["sku"] for r in ROWS]
    assert out["error"].null_count() == len(ROWS)
