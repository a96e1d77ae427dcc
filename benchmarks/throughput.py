"""Throughput and memory of overnight's pipeline, against bare vLLM on the same prompts.

    python benchmarks/throughput.py                # defaults below; prints a table, writes JSON
    python benchmarks/throughput.py --rows 200 --mem-rows 1000 5000

One run measures, on the same rendered prompts, same model, same greedy sampling, with per-row
output lengths drawn from [--min-tokens, --max-tokens] (ignore_eos, so lengths are exact):
  1. ceiling: bare ``vllm.LLM.generate`` on all prompts in one call;
  2. naive:   a loop of ``LLM.generate`` over fixed batches of --batch-size, each waiting for
              its longest sequence (what a per-block predictor does);
  3. overnight: ``overnight run`` end to end, Parquet to Parquet, through Ray Data.
Each runs in its own fresh process. Reported: output tokens/s over the generation (1, 2) and
over the whole command (1, 2, 3), the ratios 3/1 and 3/2, time to first committed part, and
the peak memory (PSS, and RSS) of the pipeline's whole process tree (driver, Ray, workers) at
two input sizes.
The greedy texts of 3 are compared with those of 1, row for row.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ("soft bright lamp chair steel wood cotton glass leather warm cool modern classic "
         "durable elegant quiet small large light heavy premium").split()


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
    """The prompts exactly as the pipeline renders them, and each row's max_tokens."""
    import pyarrow.parquet as pq

    from pipelines.config import load_config
    from pipelines.preflight import plan_job
    from udfs import columns
    from udfs.prompts import PromptRenderer

    plan = plan_job(load_config(config))
    table = pq.read_table(config["input"]["path"])
    rendered = PromptRenderer(plan.render)(table)
    return (rendered.column(columns.PROMPT_TOKEN_IDS).to_pylist(),
            table.column("max_tokens").to_pylist())


def reference(mode: str, spec_path: str) -> None:
    """Runs in a fresh process: bare vLLM, in one call (ceiling) or in fixed batches."""
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024,
                   kv_cache_memory_bytes=1 << 30, enforce_eager=True,
                   enable_chunked_prefill=False)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in spec["max_tokens"]]
    gen_start = time.time()
    if mode == "ceiling":
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        b, outs = spec["batch_size"], []
        for i in range(0, len(prompts), b):
            outs += llm.generate(prompts[i:i + b], params[i:i + b], use_tqdm=False)
    gen = time.time() - gen_start
    print(json.dumps({
        "texts": [o.outputs[0].text for o in outs],
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "generate_s": gen, "process_start_to_done_s": time.time() - started,
    }))


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) summed over a process tree. RSS counts a page shared by several processes
    (Ray's object store, mapped by the driver and every worker; shared libraries) once per
    process; PSS splits it among them, so its sum is the tree's real footprint."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = pss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return rss, pss


def run_pipeline(config: dict, work: Path, name: str) -> dict:
    """``overnight run`` in a fresh process; samples its process tree's RSS."""
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    staging = Path(config["output"]["path"] + ".partial")
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path),
                             "--quiet", "--overwrite"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, peak_pss, first_part = 0, 0, None

    def sample():
        nonlocal peak, peak_pss, first_part
        while proc.poll() is None:
            rss, pss = tree_memory(proc.pid)
            peak, peak_pss = max(peak, rss), max(peak_pss, pss)
            if first_part is None and staging.exists() and any(staging.glob("part-*")):
                first_part = time.time() - started
            time.sleep(0.25)

    watcher = threading.Thread(target=sample)
    watcher.start()
    stdout, stderr = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"overnight run failed:\n{stderr[-2000:]}")
    return {"process_start_to_done_s": time.time() - started, "first_part_s": first_part,
            "peak_rss_mib": peak / 2**20, "peak_pss_mib": peak_pss / 2**20, "stdout": stdout}


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
    ap.add_argument("--blocks-in-flight", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mem-rows", type=int, nargs=2, default=[2000, 20000])
    ap.add_argument("--mem-kv-mib", type=int, default=128,
                    help="KV cache of the memory runs. vLLM allocates it up front but on CPU "
                    "its pages become resident only as prefix-cached blocks first use them: "
                    "a cache larger than the small run's tokens makes the larger run look "
                    "like growth until the cache is all touched")
    ap.add_argument("--only", choices=["throughput", "memory"])
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "throughput.json"))
    args = ap.parse_args()

    from pipelines.tiny_model import build_tiny_model

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

    results = {}
    if args.only == "memory":
        report_memory(args, measure_memory(args, work))
        return
    for mode in ("ceiling", "naive"):
        print(f"running {mode} ...", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, "_reference", mode, str(spec)],
                             capture_output=True, text=True, cwd=REPO, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print("running overnight ...", file=sys.stderr)
    pipe = run_pipeline(config, work, "pipeline")
    import polars as pl

    out = pl.read_parquet(work / "out")
    pipe["tokens"] = int(out["completion_tokens"].sum())
    pipe.update(generation_window(work / "out.report.json"))
    pipe["identical_to_ceiling"] = out["text_out"].to_list() == results["ceiling"]["texts"]
    results["overnight"] = pipe

    memory = {} if args.only == "throughput" else measure_memory(args, work)
    report(args, results, memory)


def measure_memory(args, work: Path) -> dict:
    from pipelines.tiny_model import build_tiny_model

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
        memory[rows] = run_pipeline(mem_config, work, f"mem-{rows}")
        memory[rows].pop("stdout", None)
    return memory


def report(args, results: dict, memory: dict) -> None:
    c, n, o = results["ceiling"], results["naive"], results["overnight"]
    tok = c["tokens"]
    rows = [
        ("1 ceiling: LLM.generate, one call", c["generate_s"], c["process_start_to_done_s"]),
        (f"2 naive: LLM.generate per {args.batch_size} rows", n["generate_s"],
         n["process_start_to_done_s"]),
        ("3 overnight run, Parquet to Parquet", o["generate_s"], o["process_start_to_done_s"]),
    ]
    print(f"\n{args.rows} prompts, output lengths {args.min_tokens}..{args.max_tokens} "
          f"(ignore_eos), {tok} output tokens, bench model (hidden 512, 6 layers), "
          f"{args.dtype}, CPU")
    print("(generate s: the generation window; for overnight, from its run report: first "
          "engine ready -> last block generated)")
    print(f"{'':42} {'generate s':>11} {'tok/s':>8} {'process s':>10} {'tok/s':>8}")
    for name, gen, whole in rows:
        g = f"{gen:11.1f} {tok / gen:8.0f}" if gen else f"{'':11} {'':8}"
        print(f"{name:42} {g} {whole:10.1f} {tok / whole:8.0f}")
    whole = {k: v["process_start_to_done_s"] for k, v in results.items()}
    ceiling_rate, naive_rate = tok / c["generate_s"], tok / n["generate_s"]
    ratios = {
        "3/1 whole process": whole["ceiling"] / whole["overnight"],
        "3/2 whole process": whole["naive"] / whole["overnight"],
    }
    pipe_rate = tok / o["generate_s"]  # engine ready -> last block (its run report)
    ratios["3/1 generation"] = pipe_rate / ceiling_rate
    ratios["3/2 generation"] = pipe_rate / naive_rate
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    print(f"time to first committed part: {o['first_part_s']:.1f} s")
    print(f"greedy texts identical to the ceiling's, row for row: {o['identical_to_ceiling']}")
    for r in results.values():
        r.pop("texts", None)
        r.pop("stdout", None)
    write(args, {"output_tokens": tok, "results": results, "ratios": ratios,
                 **(report_memory(args, memory) if memory else {})})


def report_memory(args, memory: dict) -> dict:
    """Prints the memory lines; returns them for the JSON (also alone, with --only memory)."""
    sizes = sorted(memory)
    for rows in sizes:
        m = memory[rows]
        print(f"peak memory, process tree, {rows} rows: PSS {m['peak_pss_mib']:.0f} MiB, "
              f"RSS {m['peak_rss_mib']:.0f} MiB ({m['process_start_to_done_s']:.0f} s; "
              f"KV cache {args.mem_kv_mib} MiB)")
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
    Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_reference":
        reference(sys.argv[2], sys.argv[3])
    else:
        main()
