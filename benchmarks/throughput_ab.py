"""The long-output benchmark's overnight arm, for two versions of the code, rounds interleaved.

    git worktree add /tmp/before 688574b
    python benchmarks/throughput_ab.py /tmp/before .            # 5 rounds: before, this tree
    python benchmarks/throughput_ab.py /tmp/a /tmp/b --rounds 6 --out ab.json

benchmarks/throughput.py's own ratios compare each round's overnight run with bare vLLM in
the same round, but this machine's speed drifts by 10-20% over minutes, and two runs of it
made an hour apart differ more than most changes do. This runs the same job
(throughput.py's defaults: 400 rows, 8-256 output tokens, the bench model, float32) with
each tree's code in turn, in fresh processes, so each round compares neighbours: the per-round
differences of the generation window (the run report's, first engine ready to last block
generated) and of the whole command are what to read, not either tree's absolute seconds.

A tree's code runs from the tree itself (the command's working directory and PYTHONPATH, which
Ray's workers inherit), so a git worktree of an older commit measures that commit. Its
benchmarks/throughput.py is not used: the job is this one's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import mean, median, stdev

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.throughput as bench  # noqa: E402


def run_tree(tree: Path, config: dict, work: Path) -> dict:
    """One ``overnight run`` with ``tree``'s code: its generation window and CPU seconds."""
    here = Path(bench.__file__).resolve().parent.parent
    bench.REPO = tree  # run_pipeline runs the CLI from REPO
    try:
        env = {} if tree == here else {"PYTHONPATH": str(tree)}
        result = bench.run_pipeline(config, work, "ab", memory=False, env=env)
    finally:
        bench.REPO = here
    result.update(bench.generation_window(Path(config["output"]["path"] + ".report.json")))
    cpu = result.get("cpu_s_by_process", {})
    return {"generate_s": result["generate_s"],
            "process_s": round(result["process_start_to_done_s"], 1),
            "engine_cpu_s": next((s for role, s in cpu.items() if "MapWorker" in role
                                  and "Predictor" in role), None),
            "driver_cpu_s": cpu.get("driver"), "load_1min": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs=2, help="two checkouts: before, after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--work", default=str(bench.REPO / "benchmarks" / ".work" / "ab"))
    ap.add_argument("--out", default=str(bench.REPO / "benchmarks" / "results" /
                                         "throughput-ab.json"))
    args = ap.parse_args()
    from pipelines.tools.tiny_model import build_tiny_model

    trees = [Path(t).resolve() for t in args.trees]
    for tree in trees:
        if not (tree / "pipelines" / "cli.py").exists():
            raise SystemExit(f"{tree}: not a checkout of overnight (no pipelines/cli.py)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "bench-model"
    if not (model / "config.json").exists():
        build_tiny_model(model, size="bench")
    source = work / "prompts.parquet"
    bench.make_input(source, args.rows, 8, 256)
    config = bench.job(str(model), source, work / "out", 256, 64, "float32", 16)

    names = ["before", "after"]
    rounds = []
    for i in range(args.rounds):
        rounds.append({})
        for name, tree in zip(names, trees):
            print(f"round {i + 1}/{args.rounds}: {name} ({tree}) ...", file=sys.stderr)
            rounds[-1][name] = run_tree(tree, config, work)
        print(f"  {rounds[-1]}", file=sys.stderr)

    print(f"\n{args.rows} rows, 8..256 output tokens, {args.rounds} rounds, before = "
          f"{trees[0]}, after = {trees[1]}")
    summary = {}
    for key in ("generate_s", "process_s", "engine_cpu_s"):
        diffs = [r["after"][key] - r["before"][key] for r in rounds
                 if r["after"][key] is not None and r["before"][key] is not None]
        spread = stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        summary[key] = {"before_median": median(r["before"][key] for r in rounds),
                        "after_median": median(r["after"][key] for r in rounds),
                        "after_minus_before": [round(d, 2) for d in diffs],
                        "mean_difference": round(mean(diffs), 2),
                        "standard_error": round(spread, 2)}
        s = summary[key]
        print(f"{key:>13}: before {s['before_median']:.1f}, after {s['after_median']:.1f} "
              f"(medians); after - before per round {s['after_minus_before']}, mean "
              f"{s['mean_difference']:+.2f} +/- {s['standard_error']:.2f}")
    Path(args.out).write_text(json.dumps({"trees": [str(t) for t in trees], "rows": args.rows,
                                          "summary": summary, "rounds": rounds}, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
