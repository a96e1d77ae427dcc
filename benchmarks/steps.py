"""A job of three steps against one step, and against the same three steps chained by hand.

    python benchmarks/steps.py [--rows 2000] [--max-tokens 16] [--model models/tiny]

Three runs over the same product table (benchmarks/products.py), each an ``overnight run`` in a
process of its own (its own Ray, its own engine), greedy, float32, every step generating
exactly ``--max-tokens`` (``ignore_eos``):

- **one step:** ``rewrite`` alone;
- **three steps:** ``rewrite`` -> ``label`` (over the rewrite) -> ``pitch`` (over both), one
  job (udfs/stages/steps.py): one engine, every step's requests in its queue together;
- **chained by hand:** the same three steps as three single-step jobs, each reading the output
  of the one before (three engines started, two intermediate tables).

Reported, from each run's report (OUTPUT.report.json): output tokens per second of the
generation phase (issue #21 asks the three-step job for >= 0.9x the one-step job's), start-up
seconds (pre-flight, Ray, the engine), and the whole process's wall time. Results go to
``benchmarks/results/steps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.products import make_products  # noqa: E402

STEPS = [
    {"name": "rewrite", "template": "Rewrite: {{ title }}. {{ description }}"},
    {"name": "label", "template": "Label this: {{ rewrite }}"},
    {"name": "pitch", "template": "{{ title }} ({{ label }}): {{ rewrite }}"},
]


def job(model: str, source: Path, output: Path, steps: list[dict], max_tokens: int,
        batch_size: int, id_column: str = "sku") -> dict:
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    config = {
        "input": {"path": str(source), "id_column": id_column},
        "model": {"name": model, "max_model_len": 1024, "dtype": "float32"},
        "output": {"path": str(output)},
        "engine": {"kv_cache_memory_bytes": 256 << 20},
        "resources": {"batch_size": batch_size},
    }
    if len(steps) == 1:
        config["prompt"] = {"template": steps[0]["template"]}
        config["sampling"] = sampling
        config["output"]["column"] = steps[0]["name"]
    else:
        config["steps"] = [{"name": s["name"], "prompt": {"template": s["template"]},
                            "sampling": sampling} for s in steps]
    return config


def run(config: dict, work: Path, name: str) -> dict:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(path),
                           "--overwrite", "--quiet"], cwd=REPO, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name}: {proc.stderr.strip()[-2000:]}")
    report = json.loads(Path(config["output"]["path"] + ".report.json").read_text())
    t = report["time"]
    return {"wall_s": round(wall, 2), "startup_s": t["startup_s"],
            "generation_s": t["generation_s"],
            "output_tokens": report["tokens"]["output"]["total"],
            "output_tokens_per_s": report["throughput"]["output_tokens_per_s"],
            "steps": report.get("steps")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--model", default=str(REPO / "models" / "tiny"))
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "steps"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "steps.json"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = make_products(work / "table", rows=args.rows, files=1, row_group=args.rows)[0]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    one = run(job(args.model, source, work / "one", STEPS[:1], args.max_tokens,
                  args.batch_size), work, "one")
    three = run(job(args.model, source, work / "three", STEPS, args.max_tokens,
                    args.batch_size), work, "three")
    chained, previous = [], source
    for step in STEPS:
        out = work / f"by-hand-{step['name']}"
        chained.append(run(job(args.model, previous, out, [step], args.max_tokens,
                               args.batch_size), work, f"by-hand-{step['name']}"))
        previous = out
    results = {
        "rows": args.rows, "max_tokens": args.max_tokens, "model": args.model,
        "batch_size": args.batch_size, "load_average": os.getloadavg(),
        "one_step": one, "three_steps": three, "chained_by_hand": chained,
        "ratio_tokens_per_s_three_over_one": round(
            three["output_tokens_per_s"] / one["output_tokens_per_s"], 3),
        "startup_saved_s": round(sum(c["startup_s"] for c in chained) - three["startup_s"], 1),
        "wall_saved_s": round(sum(c["wall_s"] for c in chained) - three["wall_s"], 1),
    }
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"one step:      {one['output_tokens_per_s']:,.0f} output tok/s, start-up "
          f"{one['startup_s']:.1f} s, wall {one['wall_s']:.1f} s")
    print(f"three steps:   {three['output_tokens_per_s']:,.0f} output tok/s "
          f"({results['ratio_tokens_per_s_three_over_one']:.2f}x one step), start-up "
          f"{three['startup_s']:.1f} s, wall {three['wall_s']:.1f} s")
    print(f"chained jobs:  start-up {sum(c['startup_s'] for c in chained):.1f} s in all, wall "
          f"{sum(c['wall_s'] for c in chained):.1f} s in all (saved by one job: start-up "
          f"{results['startup_saved_s']:.1f} s, wall {results['wall_saved_s']:.1f} s)")


if __name__ == "__main__":
    main()
