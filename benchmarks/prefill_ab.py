"""The prefill-heavy job (#24) under several environments, rounds interleaved, with where each
run's CPU went in its generation window.

    python benchmarks/prefill_ab.py '{"default": {}}' --rounds 1            # the profile alone
    python benchmarks/prefill_ab.py '{"default": {}, "cache-1024":
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}}' --rounds 2 --out ab.json
    python benchmarks/prefill_ab.py '{"default": {}, "bare cache-16":
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}}'                          # a bare arm's env

ARMS is a JSON object: a name, and the environment variables that arm adds. An arm whose name
starts with "bare" runs bare vLLM with them; the others run ``overnight run``, whose job a
"_config" entry changes: sections of the job's YAML, each merged into the job's (e.g.
``{"_config": {"engine": {"cpu_threads": 1}}}``). A bare arm's "_nice" entry starts bare vLLM
at that nice value; an overnight arm's "_driver_nice" sets the driver's threads to that nice
value once the engine's process is up. Ray starts its workers, the engine's among them, at nice 15
(``RAY_worker_niceness``; an overnight arm's ``{"RAY_worker_niceness": "0"}`` changes that).
Each round runs
bare vLLM with no additions first (every ratio compares an arm with it), then the arms, their
order reversed every other round: this machine's speed drifts 10-20 % over minutes, so only a
round's neighbours are compared. The job is benchmarks/prefill.py's (the tiny model, float32,
greedy, ``max_tokens`` of --max-tokens), on --rows rows.

For each overnight run, over its generation window (the run report's: first engine ready to the
last block generated): the CPU seconds of each kind of process, and of the engine process's
busiest threads by thread id (Ray names every thread of a worker after the process; the engine's
two busiest are vLLM's stepper thread and OpenMP's worker). Bare vLLM's threads are reported
for its ``generate`` call, taken as the last ``generate_s`` seconds of its process. Sampled
every 0.5 s from /proc, which costs the machine a little in every arm alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.prefill as prefill  # noqa: E402
import benchmarks.throughput as bench  # noqa: E402

EVERY_S = 0.5


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of ``pid``'s threads, by thread id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the thread's name
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def renice_threads(pid: int, nice: int) -> None:
    """Every thread of ``pid`` to ``nice`` (Linux's setpriority changes one thread only)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass


class Sampler:
    """Every EVERY_S seconds, a process tree's CPU seconds by kind of process
    (benchmarks/throughput.py's tree_sample), and those of the threads of the engine's process
    (the one whose kind contains ``engine_role``; without it, the root), kept as a timeline."""

    def __init__(self, proc: subprocess.Popen, engine_role: str | None,
                 driver_nice: int | None = None):
        self.proc, self.engine_role, self.driver_nice = proc, engine_role, driver_nice
        self.started = time.time()
        self.timeline: list[tuple[float, dict[str, float], dict[int, float]]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cpu: dict[int, tuple[str, float]] = {}  # by pid: its kind, its CPU seconds so far
        while self.proc.poll() is None:
            bench.tree_sample(self.proc.pid, cpu, memory=False)
            threads: dict[int, float] = {}
            for pid, (role, _) in cpu.items():
                if (pid == self.proc.pid if self.engine_role is None
                        else self.engine_role in role):
                    threads.update(thread_cpu(pid))
            if self.driver_nice is not None and threads:  # the engine is up: lower the driver
                renice_threads(self.proc.pid, self.driver_nice)
            self.timeline.append((time.time() - self.started, bench._cpu_by_role(cpu), threads))
            time.sleep(EVERY_S)

    def window(self, start: float, end: float, top: int = 8) -> dict:
        """CPU seconds between two moments (seconds from the start), by kind of process and
        by thread of the sampled process (its ``top`` busiest)."""
        self.thread.join()
        if not self.timeline:
            return {}

        def at(t):
            return min(self.timeline, key=lambda sample: abs(sample[0] - t))

        (_, roles_a, threads_a), (_, roles_b, threads_b) = at(start), at(end)
        roles = {k: round(v - roles_a.get(k, 0.0), 1) for k, v in roles_b.items()}
        threads = {k: round(v - threads_a.get(k, 0.0), 1) for k, v in threads_b.items()}
        return {"by_process": dict(sorted(roles.items(), key=lambda kv: -kv[1])[:top]),
                "engine_threads": sorted(threads.values(), reverse=True)[:top]}


def run_bare(spec: Path, env: dict, nice: int = 0) -> dict:
    """``nice``: the bare process's priority (it runs at this nice value from its start)."""
    proc = subprocess.Popen([sys.executable, str(bench.REPO / "benchmarks" / "throughput.py"),
                             "_reference", "ceiling", str(spec)], cwd=bench.REPO,
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    sampler = Sampler(proc, engine_role=None)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"bare vLLM failed:\n{stderr[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    whole = time.time() - sampler.started
    out["cpu_window"] = sampler.window(whole - out["generate_s"], whole)
    return out


def run_overnight(config: dict, work: Path, env: dict, driver_nice: int | None = None) -> dict:
    """``driver_nice``: the driver's threads are set to this nice value once the engine's
    process is up (Ray's own processes, started by the driver before, keep theirs)."""
    import yaml

    path = work / "ab.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet",
                             "--overwrite"], cwd=bench.REPO, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc, engine_role="Predictor", driver_nice=driver_nice)
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"overnight run failed:\n{stderr[-2000:]}")
    whole = time.time() - sampler.started
    times = json.loads(Path(config["output"]["path"] + ".report.json").read_text())["time"]
    start, gen = times["startup_s"], times["generation_s"]
    return {"generate_s": gen, "process_start_to_done_s": whole,
            "cpu_window": sampler.window(start, start + gen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", help='JSON: {"name": {"ENV_VAR": "value"}, ...}')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--row-group", type=int, default=5000)
    ap.add_argument("--work", default=str(bench.REPO / "benchmarks" / ".work" / "prefill"))
    ap.add_argument("--out", default=str(bench.REPO / "benchmarks" / "results" /
                                         "prefill-ab.json"))
    args = ap.parse_args()
    arms = json.loads(args.arms)
    import polars as pl

    work = Path(args.work)
    tiny, source = prefill.workload(work, args.rows, args.row_group)
    config = prefill.job(str(tiny), source, work / "out-ab", args.max_tokens)
    prompts, caps = bench.render(config)
    spec = work / "spec-ab.json"
    spec.write_text(json.dumps({"model": str(tiny), "dtype": "float32", "prompts": prompts,
                                "max_tokens": caps}))
    rounds = []
    for i in range(args.rounds):
        names = list(arms) if i % 2 == 0 else list(arms)[::-1]
        print(f"round {i + 1}/{args.rounds}: bare vLLM, then {', '.join(names)}", file=sys.stderr)
        base = run_bare(spec, {})
        texts = base.pop("texts")
        results = {"bare": base}
        for name in names:
            env = dict(arms[name])
            if name.startswith("bare"):
                r = run_bare(spec, env, nice=env.pop("_nice", 0))
                r["identical_to_bare"] = r.pop("texts") == texts
            else:
                job = {**config, **{section: {**config.get(section, {}), **values}
                                    for section, values in env.pop("_config", {}).items()}}
                r = run_overnight(job, work, env, driver_nice=env.pop("_driver_nice", None))
                table = pl.read_parquet(work / "out-ab")
                r["identical_to_bare"] = table[prefill.OUTPUT_COLUMN].to_list() == texts
            r["generation_ratio"] = round(base["generate_s"] / r["generate_s"], 3)
            r["whole_process_ratio"] = round(base["process_start_to_done_s"]
                                             / r["process_start_to_done_s"], 3)
            results[name] = r
            print(f"  {name}: generate {r['generate_s']:.1f} s ({r['generation_ratio']} of "
                  f"bare's {base['generate_s']:.1f}), whole {r['process_start_to_done_s']:.1f} s",
                  file=sys.stderr)
        rounds.append(results)
        Path(args.out).write_text(json.dumps({"rows": args.rows, "max_tokens": args.max_tokens,
                                              "arms": arms, "rounds": rounds}, indent=1))
    report(arms, rounds)


def report(arms: dict, rounds: list[dict]) -> None:
    print(f"{'arm':24} {'generate s':>10} {'vs bare':>8} {'whole s':>8} {'vs bare':>8}  "
          "same  CPU s in the window: engine threads | processes (last round)")
    for name in ["bare", *arms]:
        runs = [r[name] for r in rounds]
        gen = median(r["generate_s"] for r in runs)
        whole = median(r["process_start_to_done_s"] for r in runs)
        ratio = "" if name == "bare" else f"{median(r['generation_ratio'] for r in runs):8.2f}"
        wratio = "" if name == "bare" else \
            f"{median(r['whole_process_ratio'] for r in runs):8.2f}"
        same = "" if name == "bare" else str(all(r["identical_to_bare"] for r in runs))
        cpu = runs[-1]["cpu_window"]
        threads = " ".join(f"{s:.1f}" for s in cpu.get("engine_threads", [])[:4])
        procs = ", ".join(f"{k} {v:.1f}" for k, v in list(cpu.get("by_process", {}).items())[:4])
        print(f"{name:24} {gen:10.1f} {ratio:>8} {whole:8.1f} {wratio:>8}  {same:5} "
              f"{threads} | {procs}")


if __name__ == "__main__":
    main()
