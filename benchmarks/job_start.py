"""A job's fixed cost: the CPU of an 8-row job, against bare ``vllm.LLM`` built in a fresh process.

    python benchmarks/job_start.py              # 4 jobs in one Ray, 1 CLI run; prints, writes JSON

On the tiny model, float32, the suite's engine settings:
  1. bare:       a fresh Python that imports vLLM and builds ``vllm.LLM`` (its own CPU, exact);
  2. in-process: ``run_job`` of an 8-row job, in a process that already runs Ray (as the test
                 suite's jobs do), ``--jobs`` times; the machine's CPU over each (``/proc/stat``);
  3. CLI:        ``overnight run`` of the same job in a subprocess, with its own Ray.
Machine-wide CPU counts every process, so run it on an otherwise idle machine. Reported: each
run's wall and CPU seconds, and the ratios of a job's CPU to bare vLLM's start.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.throughput import commit  # noqa: E402

BARE = """
import vllm
vllm.LLM(model={model!r}, dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20,
         enforce_eager=True, enable_chunked_prefill=False)
"""


def machine_cpu() -> float:
    """CPU seconds all processes have used (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7, 8)) / os.sysconf("SC_CLK_TCK")


def timed(run) -> dict:
    cpu, wall = machine_cpu(), time.monotonic()
    run()
    return {"wall_s": round(time.monotonic() - wall, 2), "cpu_s": round(machine_cpu() - cpu, 2)}


def job(model: str, work: Path, name: str) -> dict:
    return {"input": {"path": str(work / "in.parquet")},
            "model": {"name": model, "max_model_len": 512, "dtype": "float32"},
            "prompt": {"template": "Title: {{ title }}"},
            "sampling": {"temperature": 0.0, "max_tokens": 16},
            "output": {"path": str(work / name), "column": "text"},
            "engine": {"kv_cache_memory_bytes": 128 << 20}, "resources": {"batch_size": 8}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "job-start"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "job-start.json"))
    args = ap.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray
    import yaml

    from pipelines import load_config, run_job
    from pipelines.tools.tiny_model import build_tiny_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model(work / "tiny"))
    pq.write_table(pa.table({"title": [f"Item {i}" for i in range(8)]}), work / "in.parquet")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic()
    subprocess.run([sys.executable, "-c", BARE.format(model=model)], env=env, check=True,
                   capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    bare = {"wall_s": round(time.monotonic() - wall, 2),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)}
    print(f"bare vllm.LLM in a fresh process: {bare}")

    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    in_process = []
    for i in range(args.jobs):
        config = load_config(job(model, work, f"out-{i}"))
        in_process.append(timed(lambda: run_job(config, overwrite=True)))
        print(f"in-process job {i + 1}: {in_process[-1]}")
    ray.shutdown()

    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job(model, work, "out-cli")))
    cli = timed(lambda: subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet", "--overwrite"],
        cwd=REPO, env=env, check=True, capture_output=True))
    print(f"CLI run in a subprocess: {cli}")

    warm = in_process[1:] or in_process  # the first job also warms the session's Ray workers
    cpu = median(r["cpu_s"] for r in warm)
    summary = {"in_process_job_cpu_s": cpu, "cli_job_cpu_s": cli["cpu_s"],
               "bare_engine_cpu_s": bare["cpu_s"],
               "in_process_job / bare engine start": round(cpu / bare["cpu_s"], 2),
               "cli job / bare engine start": round(cli["cpu_s"] / bare["cpu_s"], 2)}
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({
        "commit": commit(), "load_average_1_5_15_min": os.getloadavg(), "bare": bare,
        "in_process": in_process, "cli": cli, "summary": summary}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
