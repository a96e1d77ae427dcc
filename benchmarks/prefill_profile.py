"""Where the time goes in a prefill-heavy job: a py-spy profile of the engine's process (#24).

    python benchmarks/prefill_profile.py --rows 20000 --max-tokens 1 \\
        --raw /tmp/prefill-profile --summary benchmarks/results/prefill-profile-before.md

Runs benchmarks/prefill.py's job (``overnight run``, the tiny model, greedy, float32, CPU) and,
once its first part is written (the engine generating), for --duration seconds:
  - reads every thread's CPU time of the predictor actor's process (/proc/PID/task) before and
    after, and each process's of the job (driver, writer, Ray) as throughput.py samples them;
  - records the predictor's Python threads with ``py-spy record --threads --nonblocking``
    (on-CPU samples only), then as long again with ``--gil`` (which thread holds the GIL);
  - takes a few ``py-spy dump``s.
Each Python thread's measured CPU seconds are split among components by its samples' stacks
(the rules in COMPONENTS, first match from the leaf up); threads py-spy does not see (OpenMP's
workers, Ray's C++ threads) are listed by their names. Raw profiles go to --raw (not the repo);
the table, as Markdown, to --summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prefill import job, workload  # noqa: E402
from benchmarks.throughput import REPO, _cpu_by_role, tree_sample  # noqa: E402

PY_SPY = Path(sys.executable).with_name("py-spy")
TICK = os.sysconf("SC_CLK_TCK")

# Where a sample's stack is decides its scope (the first scope one of its frames names), then
# the first of the scope's rules that a frame matches; in our own modules the source line of
# the innermost frame there decides (a C call such as to_pylist has no frame of its own).
SCOPES = [
    ("render", "udfs/stages/prompts.py", [
        ("chat template (Jinja)", ["apply_chat_template"]),
        ("row template (Jinja)", ["jinja2", "<template>"]),
        ("tokenizer encode", ["tokeniz"]),
    ], [("pa.array", ["pa.array", "append_column"]), ("to_pylist", ["to_pylist"])]),
    ("engine", "site-packages/vllm/", [
        ("add_request (input processing)", ["add_request", "input_processor"]),
        ("SamplingParams", ["sampling_params.py"]),
        ("scheduler", ["sched/"]),
        ("update_from_output", ["update_from_output"]),
        ("output processing, detokenize", ["output_processor", "detokenizer"]),
        ("model: input preparation", ["_prepare_inputs", "_update_states", "input_batch",
                                      "_prepare", "block_table"]),
        ("model: forward", ["model_executor/models", "model_executor/layers", "torch/",
                            "attention"]),
        ("model: sampling", ["sample"]),
    ], []),
    ("stepper", "udfs/engines/stepper.py", [], [("queue, heap", ["heap", "waiting", "inbox"]),
                                         ("live counts", ["_count_live", "num_output"])]),
    ("predictor", "udfs/stages/predictor.py", [("request building", ["_request ("])], [
        ("to_pylist", ["to_pylist"]), ("request building", ["_request("]),
        ("malloc_trim", ["release_free_memory", "malloc_trim"]),
        ("result assembly, pa.array", ["pa.array", "append_column", "rows_of",
                                       "drop_columns", "result"])]),
    ("recovery", "udfs/engines/recovery.py", [], []),
    ("Ray Data", "ray/data/", [], []),
    ("Ray", "site-packages/ray/", [], []),
]


def component(frames: list[str]) -> str:
    """A sample's component (see SCOPES); ``frames`` root first, as py-spy writes them."""
    for scope, where, rules, by_line in SCOPES:
        inside = [f for f in frames if where in f]
        if not inside:
            continue
        for name, needles in rules:
            if any(n in f for f in reversed(frames) for n in needles):
                return f"{scope}: {name}"
        text = _source_line(inside[-1])
        for name, needles in by_line:
            if any(n in text for n in needles):
                return f"{scope}: {name}"
        return f"{scope}: other"
    return "other Python"


def _source_line(frame: str) -> str:
    """The source text at a frame such as ``__call__ (/path/udfs/predictor.py:123)``."""
    import linecache

    where = frame[frame.rfind("(") + 1:-1]
    path, _, line = where.rpartition(":")
    return linecache.getline(path, int(line)) if line.isdigit() else ""


def parse_raw(path: Path, only: str | None = None) -> dict[int, dict]:
    """py-spy's raw output: ``thread (TID): NAME;frame;...;frame COUNT`` a line; with ``only``,
    the samples with a frame in that file."""
    threads: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")
        if only is not None and only not in rest:
            continue
        tid = int(head.split("(")[1].split(")")[0])
        name = head.split("): ", 1)[1] if "): " in head else "?"
        t = threads.setdefault(tid, {"name": name, "samples": 0,
                                     "components": defaultdict(int)})
        t["samples"] += int(count)
        t["components"][component(rest.split(";"))] += int(count)
    return threads


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far) from /proc."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def find(pid: int, title: str) -> int | None:
    import psutil

    for p in psutil.Process(pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::") and title in " ".join(p.cmdline()):
                return p.pid
        except psutil.NoSuchProcess:
            continue
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--row-group", type=int, default=5000)
    ap.add_argument("--duration", type=int, default=20, help="seconds of each py-spy record")
    ap.add_argument("--rate", type=int, default=67, help="py-spy samples a second")
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "prefill"))
    ap.add_argument("--raw", default="/tmp/prefill-profile")
    ap.add_argument("--summary", help="write the table here, as Markdown")
    ap.add_argument("--label", default="", help="a line saying which code was profiled")
    ap.add_argument("--bare", action="store_true",
                    help="also profile bare LLM.generate on the same prompts, per 1,000 rows")
    args = ap.parse_args()

    import yaml

    work, raw = Path(args.work), Path(args.raw)
    raw.mkdir(parents=True, exist_ok=True)
    for old in raw.glob("*.txt"):  # a profile of this run only
        old.unlink()
    tiny, source = workload(work, args.rows, args.row_group)
    out = work / f"profile-{args.max_tokens}"
    config = job(str(tiny), source, out, args.max_tokens)
    path = work / "profile.yaml"
    path.write_text(yaml.safe_dump(config))

    result = {"args": vars(args), **profile_overnight(args, path, out, raw)}
    if args.bare:
        bare = profile_bare(args, config, work, raw)
        result["bare_generate_s"] = bare["generate_s"]
        result["per_1k_rows"] = per_rows(result["components"], result["rows_in_window"], bare)
    (raw / "profile.json").write_text(json.dumps(result, indent=2))
    lines = markdown(args, result)
    print("\n".join(lines))
    if args.summary:
        Path(args.summary).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.summary}", file=sys.stderr)


def profile_overnight(args, path: Path, out: Path, raw: Path) -> dict:
    """The job, profiled for a window once its first part is written."""
    from benchmarks.scale import _staged_rows

    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet",
                             "--overwrite"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    staging = Path(str(out) + ".partial")
    predictor = None
    while proc.poll() is None:
        predictor = predictor or find(proc.pid, "Predictor")
        if predictor and staging.exists() and any(staging.glob("part-*")):
            break
        time.sleep(0.2)
    if proc.poll() is not None or predictor is None:
        raise SystemExit(f"the job ended before it could be profiled:\n{proc.stderr.read()}")
    print(f"generating after {time.time() - started:.0f} s; predictor pid {predictor}",
          file=sys.stderr)

    cpu_before: dict = {}
    footers: dict = {}
    tree_sample(proc.pid, cpu_before, memory=False)
    rows_before = _staged_rows(staging, footers)
    threads_before, window_start = thread_times(predictor), time.time()
    dumps = threading.Thread(target=_dumps, args=(predictor, raw, args.duration))
    dumps.start()
    record = ["record", "--pid", str(predictor), "--nonblocking", "--rate", str(args.rate)]
    _py_spy([*record, "--duration", str(args.duration), "--threads", "--full-filenames",
             "--format", "raw", "-o", str(raw / "predictor.txt")])
    threads_after, window = thread_times(predictor), time.time() - window_start
    rows_after = _staged_rows(staging, footers)
    cpu_after: dict = {}
    tree_sample(proc.pid, cpu_after, memory=False)
    dumps.join()
    # as long again: who holds the GIL; then a flame graph (both only while the job runs)
    _py_spy([*record, "--duration", str(args.duration), "--threads", "--full-filenames",
             "--gil", "--format", "raw", "-o", str(raw / "predictor-gil.txt")], required=False)
    _py_spy([*record, "--duration", "10", "--format", "speedscope",
             "-o", str(raw / "predictor.speedscope")], required=False)
    generating = proc.poll() is None
    proc.communicate()
    if proc.returncode != 0:
        raise SystemExit("the profiled job failed")
    return {"window_s": round(window, 1), "still_generating_after": generating,
            "rows_in_window": rows_after - rows_before,
            "components": table(parse_raw(raw / "predictor.txt"), threads_before,
                                threads_after),
            "gil_holder_share": gil_shares(parse_raw(raw / "predictor-gil.txt"))
            if (raw / "predictor-gil.txt").exists() else {},
            "cpu_s_by_process_in_window": by_role(cpu_before, cpu_after),
            "job_s": round(time.time() - started, 1), "load_average": os.getloadavg()[0],
            "job_time": json.loads(Path(str(out) + ".report.json").read_text())["time"]}


def profile_bare(args, config: dict, work: Path, raw: Path) -> dict:
    """Bare ``LLM.generate`` on the same prompts (benchmarks/prefill.py's reference), run under
    py-spy from its start, its threads' CPU times read from /proc until it exits: CPU seconds
    by component inside ``LLM.generate`` (each Python thread's CPU times the share of its
    samples there; the threads py-spy does not see, OpenMP's, counted whole)."""
    import psutil

    from benchmarks.throughput import render

    prompts, caps = render(config)
    spec = work / "profile-spec.json"
    spec.write_text(json.dumps({"model": config["model"]["name"], "dtype": "float32",
                                "prompts": prompts, "max_tokens": caps}))
    print(f"bare vLLM on the same {len(prompts)} prompts, under py-spy ...", file=sys.stderr)
    spy = subprocess.Popen([str(PY_SPY), "record", "--threads", "--full-filenames",
                            "--nonblocking", "--rate", str(args.rate), "--format", "raw",
                            "-o", str(raw / "bare.txt"), "--", sys.executable,
                            str(REPO / "benchmarks" / "throughput.py"), "_reference", "ceiling",
                            str(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=REPO)
    last: dict = {}
    while spy.poll() is None:  # the last reading before the process ends
        try:
            for child in psutil.Process(spy.pid).children():
                last = thread_times(child.pid) or last
        except (psutil.NoSuchProcess, OSError):
            pass
        time.sleep(0.5)
    stdout, stderr = spy.communicate()
    if spy.returncode != 0:
        raise SystemExit(f"bare vLLM under py-spy failed: {stderr[-1000:]}")
    everything = parse_raw(raw / "bare.txt")
    inside = parse_raw(raw / "bare.txt", only="LLM.generate (")
    share = {tid: inside[tid]["samples"] / everything[tid]["samples"] for tid in inside}
    cpu = {tid: (name, seconds * share.get(tid, 1.0 if tid not in everything else 0.0))
           for tid, (name, seconds) in last.items()}
    return {"rows": len(prompts), "components": table(inside, {}, cpu),
            "generate_s": json.loads(next(line for line in reversed(stdout.splitlines())
                                          if line.startswith("{")))["generate_s"]}


def per_rows(overnight: list[dict], rows: int, bare: dict) -> list[dict]:
    """CPU seconds per 1,000 rows by component (whichever thread ran it): overnight's window
    against bare vLLM's whole generate call."""
    def seconds(components: list[dict], n: int) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in components:
            name = c["component"].split(" / ", 1)[-1]
            name = "native threads (OpenMP, Ray's C++)" if name.startswith("native") else name
            out[name] += c["cpu_s"] * 1000 / max(n, 1)
        return out

    ours, theirs = seconds(overnight, rows), seconds(bare["components"], bare["rows"])
    names = sorted(set(ours) | set(theirs), key=lambda k: -(ours.get(k, 0) + theirs.get(k, 0)))
    return [{"component": k, "overnight": round(ours.get(k, 0), 3),
             "bare": round(theirs.get(k, 0), 3)} for k in names]


def _py_spy(argv: list[str], required: bool = True) -> None:
    done = subprocess.run([str(PY_SPY), *argv], capture_output=True, text=True)
    if done.returncode != 0:
        message = f"py-spy {argv[0]} failed: {done.stderr[-500:]}"
        if required:
            raise SystemExit(message)
        print(message, file=sys.stderr)


def _dumps(pid: int, raw: Path, duration: float, count: int = 3) -> None:
    for i in range(count):
        time.sleep(duration / (count + 1))
        done = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid), "--nonblocking"],
                              capture_output=True, text=True)
        (raw / f"dump-{i}.txt").write_text(done.stdout + done.stderr)


def table(threads: dict[int, dict], before: dict, after: dict) -> list[dict]:
    """Component -> CPU seconds in the window: each Python thread's measured CPU split by its
    samples; the other threads by name."""
    seconds: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in after.items():
        spent = cpu - before.get(tid, (name, 0.0))[1]
        sampled = threads.get(tid)
        if sampled and sampled["samples"]:
            for comp, n in sampled["components"].items():
                seconds[f"{_role(sampled['name'])} / {comp}"] += spent * n / sampled["samples"]
        elif spent > 0:
            seconds[f"native threads ({name})"] += spent
    total = sum(seconds.values()) or 1.0
    return [{"component": k, "cpu_s": round(v, 2), "share": round(v / total, 4)}
            for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]


def _role(thread_name: str) -> str:
    if thread_name == "vllm-stepper":
        return "stepper thread"
    if thread_name == "MainThread":
        return "main thread"
    if thread_name.startswith("Dummy-"):  # Ray's threads, running one block each
        return "block threads"
    if "poll_uss" in thread_name:
        return "Ray Data memory pollers"
    return f"thread {thread_name}"


def gil_shares(threads: dict[int, dict]) -> dict[str, float]:
    """Of the samples where some thread held the GIL: which thread, doing what."""
    counts: dict[str, int] = defaultdict(int)
    for t in threads.values():
        for comp, n in t["components"].items():
            counts[f"{_role(t['name'])} / {comp}"] += n
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each kind of process used between the two samples."""
    return _cpu_by_role({pid: (role, after[pid][1] - seconds)
                         for pid, (role, seconds) in before.items() if pid in after})


def markdown(args, result: dict) -> list[str]:
    window = result["window_s"]
    comps = result["components"]
    total = sum(c["cpu_s"] for c in comps)
    lines = ["# Prefill-heavy job: where the engine's process spends its CPU",
             "", args.label or "", "",
             f"`python benchmarks/prefill_profile.py --rows {args.rows} --max-tokens "
             f"{args.max_tokens} --duration {args.duration}`: {args.rows} rows, max_tokens "
             f"{args.max_tokens}, tiny model, float32, 2 cores. A {window:.0f} s window of "
             f"generation; the predictor actor's process used {total:.1f} CPU s in it "
             f"({total / window:.2f} cores). py-spy {args.rate} Hz, on-CPU samples; each Python "
             "thread's measured CPU time split by its samples.",
             "", "| component | % of the engine process's CPU | CPU s |", "|---|---:|---:|"]
    for c in comps:
        if c["share"] >= 0.005:
            lines.append(f"| {c['component']} | {100 * c['share']:.1f} | {c['cpu_s']:.2f} |")
    rest = [c for c in comps if c["share"] < 0.005]
    if rest:
        lines.append(f"| (others, each < 0.5%) | {100 * sum(c['share'] for c in rest):.1f} | "
                     f"{sum(c['cpu_s'] for c in rest):.2f} |")
    lines += ["", "Who holds the GIL (py-spy --gil, share of samples where a thread held it):",
              "", "| thread / component | share |", "|---|---:|"]
    for k, v in list(result["gil_holder_share"].items())[:10]:
        lines.append(f"| {k} | {100 * v:.1f}% |")
    if result.get("per_1k_rows"):
        lines += ["", f"CPU s per 1,000 rows: overnight's window ({result['rows_in_window']} "
                  "rows written in it) against bare `LLM.generate` on the same prompts, profiled "
                  f"the same way (its whole call, {result['bare_generate_s']:.0f} s):", "",
                  "| component | overnight | bare vLLM |", "|---|---:|---:|"]
        for c in result["per_1k_rows"]:
            if max(c["overnight"], c["bare"]) >= 0.01:
                lines.append(f"| {c['component']} | {c['overnight']:.3f} | {c['bare']:.3f} |")
    t = result["job_time"]
    lines += ["", f"The job: {t['total_s']:.0f} s = start-up {t['startup_s']:.0f} s (pre-flight "
              f"{t['preflight_s']:.0f}, Ray {t['ray_start_s']:.0f}, engines "
              f"{t['engine_start_s']:.0f}) + generation {t['generation_s']:.0f} s + finish "
              f"{t['finish_s']:.0f} s; machine load average at the end "
              f"{result['load_average']:.1f} (2 cores)."]
    lines += ["", f"CPU seconds of the job's processes in the same window ({window:.0f} s):", "",
              "| process | CPU s | cores |", "|---|---:|---:|"]
    for role, s in result["cpu_s_by_process_in_window"].items():
        if s >= 0.05:
            lines.append(f"| {role} | {s:.1f} | {s / window:.2f} |")
    return lines


if __name__ == "__main__":
    main()
