"""Throughput and memory of overnight's pipeline, against bare vLLM on the same prompts.

    python benchmarks/throughput.py                # defaults below; prints a table, writes JSON
    python benchmarks/throughput.py --rows 200 --mem-rows 1000 5000

One run measures, on the same rendered prompts, same model, same greedy sampling, with per-row
output lengths drawn from [--min-tokens, --max-tokens] (ignore_eos, so lengths are exact):
  1. ceiling: bare ``vllm.LLM.generate`` on all prompts in one call;
  1s. ceiling, longest first: the same one call on the prompts sorted by max_tokens, longest
              first: what the pipeline's ordering (udfs/engines/vllm_engine.py) does, given to bare vLLM,
              so the gain from ordering and the cost of the pipeline show apart;
  2. naive:   a loop of ``LLM.generate`` over fixed batches of --batch-size, each waiting for
              its longest sequence (what a per-block predictor does);
  3. overnight: ``overnight run`` end to end, Parquet to Parquet, through Ray Data.
Each runs in its own fresh process; the four run in turn, --repeat rounds (a shared machine's
speed drifts over minutes: each round's ratios compare neighbours). Reported, as medians: output
tokens/s over the generation and over the whole command, the ratios 3/1, 3/1s and 3/2, time to first
committed part; then, in runs of their own (memory is not sampled in the timed runs), against
bare ``LLM.generate`` fed the same prompts in 256-prompt chunks, the peak
memory (PSS, and RSS) of the pipeline's whole process tree (driver, Ray, workers) at
two input sizes.
The greedy texts of 3 and of 1s are compared with those of 1, row for row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ("soft bright lamp chair steel wood cotton glass leather warm cool modern classic "
         "durable elegant quiet small large light heavy premium").split()


def commit() -> str:
    """The checked-out commit, short: every results file names the code it measured."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=REPO).stdout.strip()


def make_input(path: Path, rows: int, lo: int, hi: int, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    pq.write_table(pa.table({
        "id": [f"r{i:06d}" for i in range(rows)],
        "text": [" ".join(rng.choices(WORDS, k=rng.randint(8, 60))) for _ in range(rows)],
        "max_tokens": [rng.randint(lo, hi) for _ in range(rows)],
    }), path)


def job(model: str, source: Path, out: Path, hi: int, batch_size: int, dtype: str,
        blocks_in_flight: int = 4, kv_cache_bytes: int = 1 << 30) -> dict:
    return {
        "input": {"path": str(source), "id_column": "id"},
        "model": {"name": model, "max_model_len": 1024, "dtype": dtype},
        "prompt": {"system": "Describe.", "template": "{{ text }}"},
        "sampling": {"temperature": 0.0, "max_tokens": hi, "max_tokens_column": "max_tokens",
                     "ignore_eos": True},
        "output": {"path": str(out), "column": "text_out"},
        "engine": {"kv_cache_memory_bytes": kv_cache_bytes},
        "resources": {"batch_size": batch_size, "blocks_in_flight": blocks_in_flight},
    }


def render(config: dict) -> tuple[list[list[int]], list[int]]:
    """The prompts exactly as the pipeline renders them, and each row's max_tokens (its
    max_tokens column's, or the job's)."""
    import pyarrow.parquet as pq

    from pipelines.config import load_config
    from pipelines.plan.preflight import plan_job
    from udfs import columns
    from udfs.stages.prompts import PromptRenderer

    plan = plan_job(load_config(config))
    table = pq.read_table(config["input"]["path"])
    rendered = PromptRenderer(plan.render)(table)
    caps_column = config["sampling"].get("max_tokens_column")
    return (rendered.column(columns.PROMPT_TOKEN_IDS).to_pylist(),
            table.column(caps_column).to_pylist() if caps_column
            else [config["sampling"]["max_tokens"]] * table.num_rows)


def reference(mode: str, spec_path: str) -> None:
    """Runs in a fresh process: bare vLLM, in one call (ceiling, in input order or longest
    first), in fixed batches (naive), or ``LLM.chat`` on the spec's conversations (chat)."""
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    llm = bare_llm(spec["model"], spec["dtype"], 1 << 30)
    import vllm

    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in spec["max_tokens"]]
    gen_start = time.time()
    if mode == "chat":  # vLLM's own chat path: the template and the tokenizer in the call
        outs = llm.chat(spec["conversations"], params, use_tqdm=False)
    elif mode == "ceiling":
        outs = llm.generate(prompts, params, use_tqdm=False)
    elif mode == "ceiling_sorted":
        order = sorted(range(len(prompts)), key=lambda i: -spec["max_tokens"][i])
        done = llm.generate([prompts[i] for i in order], [params[i] for i in order],
                            use_tqdm=False)
        outs = [None] * len(prompts)
        for i, out in zip(order, done):
            outs[i] = out
    else:
        b, outs = spec["batch_size"], []
        for i in range(0, len(prompts), b):
            outs += llm.generate(prompts[i:i + b], params[i:i + b], use_tqdm=False)
    gen = time.time() - gen_start
    print(json.dumps({
        "texts": [o.outputs[0].text for o in outs],
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "same_prompt_ids": all(o.prompt_token_ids == ids
                               for o, ids in zip(outs, spec["prompts"])),
        "generate_s": gen, "process_start_to_done_s": time.time() - started,
    }))


def bare_llm(model: str, dtype: str, kv_bytes: int):
    """The references' engine: the settings the pipeline gives a CPU engine, in process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    return vllm.LLM(model=model, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=kv_bytes,
                    enforce_eager=True, enable_chunked_prefill=False)


def tree_sample(pid: int, cpu: dict, memory: bool = True,
                private: dict | None = None) -> tuple[int, int, dict[str, int]]:
    """(RSS, PSS, PSS by role) summed over a process tree (and each role's USS, its private
    memory, added to ``private``). RSS counts a page shared by several
    processes (Ray's object store, mapped by the driver and every worker; shared libraries)
    once per process; PSS splits it among them, so its sum is the tree's real footprint. The
    role is what a process is: the driver, gcs_server, raylet, or a Ray worker's title
    (``ray::MapWorker(Predictor)``), so that growth can be traced to the process it is in.
    Each process's CPU seconds so far are kept in ``cpu``, by pid, with its role. Reading a
    process's memory (its smaps) costs the reader real CPU, which on 2 cores is taken from
    the engine: without ``memory`` only the CPU times (cheap) are read."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, {}
    rss = pss = 0
    roles: dict[str, int] = {}
    for p in procs:
        try:
            role = "driver" if p.pid == pid else _role(p.cmdline())
            times = p.cpu_times()
            cpu[p.pid] = (role, times.user + times.system)
            if not memory:
                continue
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + info.rss, pss + info.pss
        roles[role] = roles.get(role, 0) + info.pss
        if private is not None:
            private[role] = private.get(role, 0) + info.uss
    return rss, pss, roles


def _role(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    if line.startswith("ray::"):  # "ray::MapWorker(MapBatches(Predictor)).submit": no method
        title = line.split()[0]
        return title[:title.rindex(")") + 1] if ")" in title else title.split(".")[0]
    for name in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env",
                 "monitor.py"):
        if name in line:
            return name
    return (cmdline[0].rsplit("/", 1)[-1] if cmdline else "?") + " (other)"


TIMELINE_POINTS = 200  # the tree's PSS over a run, kept to a few hundred samples


def run_pipeline(config: dict, work: Path, name: str, memory: bool, env: dict | None = None,
                 every: float | None = None) -> dict:
    """``overnight run`` in a fresh process (with ``env`` added to its environment); samples
    its process tree's CPU times, and with ``memory`` its RSS and PSS (4 times a second unless
    ``every`` says otherwise: not in a timed run, see tree_sample)."""
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    staging = Path(config["output"]["path"] + ".partial")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path),
                             "--quiet", "--overwrite"], cwd=REPO,
                            env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, peak_pss, first_part, by_role, cpu = 0, 0, None, {}, {}
    at_peak: dict = {}  # the tree at its PSS peak: when, and each kind of process's share
    # (seconds, tree PSS MiB, {kind of process: its PSS MiB}, {...: its private memory, USS
    # MiB: PSS less its share of pages other processes map too, the object store's}), at most
    # TIMELINE_POINTS
    timeline: list = []

    def sample():
        nonlocal peak, peak_pss, first_part, at_peak
        samples, stride = 0, 1
        while proc.poll() is None:
            own: dict[str, int] = {}
            rss, pss, roles = tree_sample(proc.pid, cpu, memory, private=own)
            now = round(time.time() - started, 1)
            peak = max(peak, rss)
            if pss > peak_pss:
                peak_pss = pss
                at_peak = {"s": now, "by_process": roles}
            samples += 1
            if memory and samples % stride == 0:  # every stride-th sample: evenly spaced
                timeline.append((now, round(pss / 2**20),
                                 {k: round(v / 2**20) for k, v in roles.items() if v >= 2**25},
                                 {k: round(v / 2**20) for k, v in own.items() if v >= 2**25}))
                if len(timeline) >= 2 * TIMELINE_POINTS:
                    timeline[:], stride = timeline[1::2], 2 * stride
            for role, size in roles.items():
                by_role[role] = max(by_role.get(role, 0), size)
            if first_part is None and staging.exists() and any(staging.glob("part-*")):
                first_part = time.time() - started
            time.sleep(every or (0.25 if memory else 1.0))

    watcher = threading.Thread(target=sample)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"overnight run failed:\n{stderr[-2000:]}")
    out = {"process_start_to_done_s": time.time() - started, "first_part_s": first_part,
           "cpu_s_by_process": _cpu_by_role(cpu), "stdout": stdout, "pid": proc.pid}
    if memory:
        out.update({"peak_rss_mib": peak / 2**20, "peak_pss_mib": peak_pss / 2**20,
                    "peak_pss_mib_by_process": {k: round(v / 2**20, 1) for k, v in
                                                sorted(by_role.items(), key=lambda kv: -kv[1])},
                    "peak_pss_at_s": at_peak.get("s"),
                    "pss_mib_at_peak_by_process": {
                        k: round(v / 2**20, 1) for k, v in
                        sorted(at_peak.get("by_process", {}).items(), key=lambda kv: -kv[1])},
                    "pss_timeline_mib": timeline})
    return out


def _cpu_by_role(cpu: dict) -> dict[str, float]:
    """CPU seconds (user + system) each kind of process used, as last sampled."""
    out: dict[str, float] = {}
    for role, seconds in cpu.values():
        out[role] = out.get(role, 0.0) + seconds
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def generation_window(report_path: Path) -> dict:
    """The pipeline's own generation window from its run report: from the first engine ready
    to the last block generated (the fixed start-up left out, as in the references'
    ``generate_s``)."""
    report = json.loads(report_path.read_text())
    return {"generate_s": report["time"]["generation_s"],
            "startup_s": report["time"]["startup_s"], "time": report["time"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--blocks-in-flight", type=int, default=16,
                    help="64 x 16 = 1024 rows in the engine, as a job's defaults (256 x 4)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mem-rows", type=int, nargs=2, default=[2000, 20000])
    ap.add_argument("--mem-kv-mib", type=int, default=128,
                    help="KV cache of the memory runs. vLLM allocates it up front but on CPU "
                    "its pages become resident only as prefix-cached blocks first use them: "
                    "a cache larger than the small run's tokens makes the larger run look "
                    "like growth until the cache is all touched")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds of (ceiling, naive, overnight); medians are reported")
    ap.add_argument("--only", choices=["throughput", "memory"])
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "throughput.json"))
    args = ap.parse_args()

    from pipelines.tools.tiny_model import build_tiny_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bench_model = work / "bench-model"
    if not (bench_model / "config.json").exists():
        build_tiny_model(bench_model, size="bench")
    source = work / "prompts.parquet"
    make_input(source, args.rows, args.min_tokens, args.max_tokens)
    config = job(str(bench_model), source, work / "out", args.max_tokens, args.batch_size,
                 args.dtype, args.blocks_in_flight)
    prompts, caps = render(config)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(bench_model), "dtype": args.dtype,
                                "prompts": prompts, "max_tokens": caps,
                                "batch_size": args.batch_size}))

    if args.only == "memory":
        report_memory(args, measure_memory(args, work))
        return
    # The three, in turn, --repeat times: a shared machine's speed drifts by tens of percent
    # over minutes, so each round's ratios compare neighbours, and the medians are reported.
    rounds = []
    for i in range(args.repeat):
        results = {}
        for mode in ("ceiling", "ceiling_sorted", "naive"):
            print(f"round {i + 1}/{args.repeat}: {mode} ...", file=sys.stderr)
            out = subprocess.run([sys.executable, __file__, "_reference", mode, str(spec)],
                                 capture_output=True, text=True, cwd=REPO, check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"round {i + 1}/{args.repeat}: overnight ...", file=sys.stderr)
        results["overnight"] = run_overnight(config, work, results["ceiling"]["texts"])
        rounds.append(results)
    memory = {} if args.only == "throughput" else measure_memory(args, work)
    report(args, rounds, memory)


def run_overnight(config: dict, work: Path, ceiling_texts: list[str]) -> dict:
    import polars as pl

    pipe = run_pipeline(config, work, "pipeline", memory=False)
    out = pl.read_parquet(work / "out")
    pipe["tokens"] = int(out["completion_tokens"].sum())
    pipe.update(generation_window(work / "out.report.json"))
    pipe["identical_to_ceiling"] = out["text_out"].to_list() == ceiling_texts
    return pipe


def measure_memory(args, work: Path) -> dict:
    from pipelines.tools.tiny_model import build_tiny_model

    memory = {}
    tiny = work / "tiny-model"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny)
    for rows in args.mem_rows:
        print(f"memory at {rows} rows ...", file=sys.stderr)
        src = work / f"mem-{rows}.parquet"
        make_input(src, rows, 4, 8, seed=1)
        mem_config = job(str(tiny), src, work / f"mem-out-{rows}", 8, 256, "float32",
                         kv_cache_bytes=args.mem_kv_mib << 20)
        memory[rows] = run_pipeline(mem_config, work, f"mem-{rows}", memory=True)
        memory[rows].pop("stdout", None)
        print(f"memory at {rows} rows, bare vLLM ...", file=sys.stderr)
        plan = render(mem_config)
        spec = work / f"mem-spec-{rows}.json"
        spec.write_text(json.dumps({"model": str(tiny), "prompts": plan[0],
                                    "kv_bytes": args.mem_kv_mib << 20}))
        out = subprocess.run([sys.executable, __file__, "_bare_memory", str(spec)],
                             capture_output=True, text=True, cwd=REPO, check=True)
        memory[rows]["bare_vllm_peak_pss_mib"] = json.loads(out.stdout.splitlines()[-1])
    return memory


def bare_memory(spec_path: str) -> None:
    """Runs in a fresh process: the reference for memory. The same engine settings and
    prompts as the memory run, fed to bare ``LLM.generate`` in 256-prompt chunks (as blocks
    reach the engine), the process's peak PSS sampled as in the pipeline's runs."""
    spec = json.loads(Path(spec_path).read_text())
    llm = bare_llm(spec["model"], "float32", spec["kv_bytes"])
    import vllm

    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_sample(os.getpid(), {})[1])
            time.sleep(0.25)

    threading.Thread(target=sample, daemon=True).start()
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(0, len(prompts), 256):
        llm.generate(prompts[i:i + 256], params, use_tqdm=False)
    done.set()
    print(json.dumps(round(peak[0] / 2**20, 1)))


def report(args, rounds: list[dict], memory: dict) -> None:
    tok = rounds[0]["ceiling"]["tokens"]
    names = {"ceiling": "1 ceiling: LLM.generate, one call",
             "ceiling_sorted": "1s the same, prompts longest first",
             "naive": f"2 naive: LLM.generate per {args.batch_size} rows",
             "overnight": "3 overnight run, Parquet to Parquet"}
    print(f"\n{args.rows} prompts, output lengths {args.min_tokens}..{args.max_tokens} "
          f"(ignore_eos), {tok} output tokens, bench model (hidden 512, 6 layers), "
          f"{args.dtype}, CPU; median of {len(rounds)} rounds")
    print("(generate s: the generation window; for overnight, from its run report: first "
          "engine ready -> last block generated)")
    print(f"{'':42} {'generate s':>11} {'tok/s':>8} {'process s':>10} {'tok/s':>8}")
    for mode, name in names.items():
        gen = median(r[mode]["generate_s"] for r in rounds)
        whole = median(r[mode]["process_start_to_done_s"] for r in rounds)
        print(f"{name:42} {gen:11.1f} {tok / gen:8.0f} {whole:10.1f} {tok / whole:8.0f}")
    per_round = [{
        "3/1 generation": r["ceiling"]["generate_s"] / r["overnight"]["generate_s"],
        "3/1s generation": r["ceiling_sorted"]["generate_s"] / r["overnight"]["generate_s"],
        "1s/1 generation": r["ceiling"]["generate_s"] / r["ceiling_sorted"]["generate_s"],
        "3/2 generation": r["naive"]["generate_s"] / r["overnight"]["generate_s"],
        "3/1 whole process": (r["ceiling"]["process_start_to_done_s"]
                              / r["overnight"]["process_start_to_done_s"]),
        "3/2 whole process": (r["naive"]["process_start_to_done_s"]
                              / r["overnight"]["process_start_to_done_s"]),
    } for r in rounds]
    ratios = {k: median(p[k] for p in per_round) for k in per_round[0]}
    for k, v in ratios.items():
        each = ", ".join(f"{p[k]:.2f}" for p in per_round)
        print(f"ratio {k}: {v:.2f} (rounds: {each})")
    first = median(r["overnight"]["first_part_s"] or float("nan") for r in rounds)
    print(f"time to first committed part: {first:.1f} s")
    identical = all(r["overnight"]["identical_to_ceiling"] for r in rounds)
    sorted_same = all(r["ceiling_sorted"]["texts"] == r["ceiling"]["texts"] for r in rounds)
    print(f"1s's greedy texts identical to 1's: {sorted_same}")
    print(f"greedy texts identical to the ceiling's, row for row: {identical}")
    cpu = rounds[-1]["overnight"]["cpu_s_by_process"]
    print("CPU seconds of the pipeline's processes (last round, whole run): " + ", ".join(
        f"{role} {s:.0f}" for role, s in list(cpu.items())[:8]))
    for r in rounds:
        for result in r.values():
            result.pop("texts", None)
            result.pop("stdout", None)
    write(args, {"output_tokens": tok, "rounds": rounds, "ratios": ratios,
                 "ratios_per_round": per_round, "identical_to_ceiling": identical,
                 "sorted_ceiling_identical_to_ceiling": sorted_same,
                 **(report_memory(args, memory) if memory else {})})


def report_memory(args, memory: dict) -> dict:
    """Prints the memory lines; returns them for the JSON (also alone, with --only memory)."""
    sizes = sorted(memory)
    for rows in sizes:
        m = memory[rows]
        print(f"peak memory, process tree, {rows} rows: PSS {m['peak_pss_mib']:.0f} MiB, "
              f"RSS {m['peak_rss_mib']:.0f} MiB ({m['process_start_to_done_s']:.0f} s; "
              f"KV cache {args.mem_kv_mib} MiB)")
    small, large = (memory[n].get("peak_pss_mib_by_process", {}) for n in sizes)
    for role in sorted(large, key=lambda r: -(large[r] - small.get(r, 0)))[:6]:
        print(f"  {role:40} peak PSS {small.get(role, 0):7.0f} -> {large[role]:7.0f} MiB")
    bare = [memory[n].get("bare_vllm_peak_pss_mib") for n in sizes]
    if all(bare):
        print(f"  reference, bare LLM.generate in 256-prompt chunks: peak PSS {bare[0]:.0f} -> "
              f"{bare[1]:.0f} MiB ({100 * (bare[1] / bare[0] - 1):+.1f}%)")
    growth = memory[sizes[1]]["peak_pss_mib"] / memory[sizes[0]]["peak_pss_mib"] - 1
    rss_growth = memory[sizes[1]]["peak_rss_mib"] / memory[sizes[0]]["peak_rss_mib"] - 1
    print(f"memory growth {sizes[0]} -> {sizes[1]} rows: PSS {100 * growth:+.1f}% "
          f"(RSS {100 * rss_growth:+.1f}%)")
    out = {"memory": {str(k): v for k, v in memory.items()}, "memory_growth": growth,
           "memory_growth_rss": rss_growth}
    if args.only == "memory":
        write(args, out)
    return out


def write(args, result: dict) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # the machine's load when the run ended: on a shared machine, how much to trust it
    Path(args.out).write_text(json.dumps({"args": vars(args), "load_average_1_5_15_min":
                                          os.getloadavg(), **result}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_bare_memory":
        bare_memory(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "_reference":
        reference(sys.argv[2], sys.argv[3])
    else:
        main()
