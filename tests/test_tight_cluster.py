"""No silent hang (issue #18): a cluster with as many CPUs as GPUs runs the job, one with no
CPU for the light stages is refused at once, and a job kept waiting says what it waits for.
Fake GPUs are Ray's own (``num_gpus=``); the engines underneath run on the CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading

import polars as pl
import pytest
import ray

from pipelines import load_config, run_job
from pipelines.job import watchdog
from pipelines.errors import JobError
from pipelines.job.resources import LIGHT_STAGES_CPUS, plan_replicas

from conftest import REPO, job_config
from test_parsers import ScriptedServer

ROWS = [{"sku": f"T{i:02d}", "title": f"Lamp {i}", "description": "A lamp."} for i in range(8)]

# A driver with a Ray of its own: the session's Ray has no GPU, and these need fake ones.
DRIVER = """
import json, sys, ray
from pipelines import load_config, run_job
from pipelines.errors import JobError
cpus, gpus, temp, config = sys.argv[1:]
ray.init(num_cpus=int(cpus), num_gpus=int(gpus), include_dashboard=False, log_to_driver=False,
         logging_level="ERROR", _temp_dir=temp)
try:
    summary = run_job(load_config(json.loads(config)))
    print(json.dumps({"rows": summary.rows, "ok": summary.rows_ok}))
except JobError as exc:
    print(json.dumps({"refused": str(exc)}))
"""


def fake_cluster(monkeypatch, cpus: float, gpus_per_node: list[int]) -> None:
    monkeypatch.setattr(ray, "cluster_resources",
                        lambda: {"CPU": cpus, "GPU": sum(gpus_per_node)})
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": cpus / len(gpus_per_node), "GPU": g}}
        for g in gpus_per_node])


def plan_for(**model):
    base = job_config("m", "in.jsonl", "out")
    return plan_replicas(load_config({**base, "model": {**base["model"], **model}}))


def test_four_gpu_engines_on_four_cpus_leave_room_for_the_light_stages(monkeypatch):
    fake_cluster(monkeypatch, 4, [4])
    plan = plan_for()
    assert (plan.replicas, plan.num_gpus, plan.num_cpus) == (4, 1, 0.81)
    assert plan.needs()["CPU"] + LIGHT_STAGES_CPUS <= 4
    tp2 = plan_for(tensor_parallel_size=2)
    assert (tp2.replicas, tp2.group_gpus, tp2.group_cpus) == (2, 2, 0.81)
    assert tp2.needs() == {"GPU": 4, "CPU": 2 * 2 * 0.81}
    fake_cluster(monkeypatch, 16, [4, 4])  # where CPUs are plenty, a whole one each
    assert plan_for().num_cpus == 1


def test_a_gpu_node_short_of_cpus_is_sized_by_its_own_cpus(monkeypatch):
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 34, "GPU": 8})
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": 32}},
        {"Alive": True, "Resources": {"CPU": 2, "GPU": 8}}])
    assert plan_for().num_cpus == 0.25  # 8 engines on the 2 CPUs of their node


def test_a_cluster_with_no_cpu_for_the_light_stages_is_refused(monkeypatch):
    fake_cluster(monkeypatch, 0, [4])
    with pytest.raises(JobError, match=r"^the Ray cluster has 4 GPUs for the engines but 0 "
                                       r"CPUs: the read, parse and write stages need 0.75 CPU; "
                                       r"start its nodes with CPUs \(ray start --num-cpus\)$"):
        plan_for()


def test_one_cpu_and_no_gpu_gives_the_engine_what_the_light_stages_leave(monkeypatch):
    fake_cluster(monkeypatch, 1, [0])
    assert plan_for().num_cpus == 0.25


@pytest.mark.parametrize("cpus, gpus", [(2, 2), (0, 2)], ids=["2cpu-2gpu", "0cpu-2gpu"])
def test_a_cluster_with_as_many_cpus_as_gpus_runs_or_refuses_at_once(tiny_model, tmp_path,
                                                                     cpus, gpus):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                        input={"id_column": "sku"}, sampling={"max_tokens": 4})
    temp = tempfile.mkdtemp(prefix="ovr-ray-", dir="/tmp")  # Ray's socket paths stay short
    try:
        run = subprocess.run([sys.executable, "-c", DRIVER, str(cpus), str(gpus), temp,
                              json.dumps(config)], capture_output=True, text=True, cwd=REPO,
                             timeout=150)  # a hang fails here, not in CI's global timeout
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if cpus:
        assert result == {"rows": len(ROWS), "ok": len(ROWS)}
        out = pl.read_parquet(tmp_path / "out")
        assert out["sku"].to_list() == [r["sku"] for r in ROWS]
        assert out["rewritten"].null_count() == 0
    else:
        assert result["refused"].startswith("the Ray cluster has 2 GPUs for the engines but 0 "
                                            "CPUs")


def test_a_job_kept_waiting_says_what_for_and_goes_on(tiny_model, ray_cluster, tmp_path,
                                                      monkeypatch, capsys):
    """Something else holds every CPU of the cluster for a while: the job says so, then runs
    once they are free."""
    monkeypatch.setattr(watchdog, "NOTICE_AFTER_S", 2.0)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    server = ScriptedServer(tiny_model)
    raw = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                     input={"id_column": "sku"})
    raw["engine"] = {"kind": "http", "base_url": server.base_url, "endpoint": "chat"}

    @ray.remote(num_cpus=2)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())
    release = threading.Timer(8.0, ray.kill, args=(holder,))
    release.start()
    config = load_config(raw)
    try:
        summary = run_job(config)
    finally:
        release.cancel()
        ray.kill(holder)
        server.close()
    assert summary.rows_ok == len(ROWS)
    assert watchdog.waiting_line(config, 60.0) is None  # nothing pending, CPUs free: no news
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("overnight: waiting")]
    assert lines, "no waiting notice"
    assert lines[0].startswith("overnight: waiting for resources: nothing written for ")
    assert " of the job's actors cannot start; 1 engine(s) need 0.25 CPU and the read, " \
           "parse and write stages 0.75 CPU; the Ray cluster has 0 CPU free of 2: free them " \
           "(another job?), add nodes, or lower resources.replicas" in lines[0]
