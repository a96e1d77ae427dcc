"""Short outputs over a big table: overnight against bare vLLM on a prefill-heavy job (#24).

    python benchmarks/prefill.py --rows 100000 --repeat 1       # the issue's size (long)
    python benchmarks/prefill.py --rows 5000 --out benchmarks/results/prefill-5k.json

The table (benchmarks/products.py: a title and a 30-40-word description, ~172 prompt tokens a
row with the tiny model's tokenizer) is one Parquet file in row groups of --row-group rows. For
each of --max-tokens (1 and 8: a label, a few words), greedy, float32, the tiny model, CPU, in
fresh processes, in turn, --repeat rounds (medians; each round's ratios compare neighbours):
  bare       ``vllm.LLM.generate`` on all prompts in one call, the engine settings the pipeline
             gives a CPU engine (benchmarks/throughput.py's ceiling), the prompts rendered by
             the product's own PromptRenderer, so the token ids are the pipeline's: the
             engine alone, the template and tokenizer run before its clock starts;
  bare chat  ``vllm.LLM.chat`` on each row's messages, as the pipeline renders them: vLLM's
             own chat path, which applies the chat template and tokenizes inside the call,
             as overnight does inside its generation window (checked: the same token ids);
  overnight  ``overnight run``, Parquet to Parquet, through Ray Data.
Reported: rows/s over the whole process and over the generation (bare: the ``generate`` call;
overnight: the run report's generation window, first engine ready to last block generated),
the ratios overnight/bare of both, whether the greedy outputs are identical row for row, the
output's file count, and the CPU seconds of each of the pipeline's processes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.products import ID_COLUMN, PROMPT, make_products  # noqa: E402
from benchmarks.throughput import (REPO, generation_window, render, run_pipeline,  # noqa: E402
                                   write)

OUTPUT_COLUMN = "label"


def job(model: str, source: Path, out: Path, max_tokens: int) -> dict:
    """A new user's job: the defaults, but for what the workload fixes."""
    return {
        "input": {"path": str(source), "id_column": ID_COLUMN},
        "model": {"name": model, "max_model_len": 1024, "dtype": "float32"},
        "prompt": dict(PROMPT),
        # ignore_eos as in the bare reference (a random-weight model hardly ever stops)
        "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
        "output": {"path": str(out), "column": OUTPUT_COLUMN},
        "engine": {"kv_cache_memory_bytes": 1 << 30},
    }


def workload(work: Path, rows: int, row_group: int) -> tuple[Path, Path]:
    """The tiny model and the table, in ``work`` (each built once)."""
    from pipelines.tools.tiny_model import build_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    tiny = work / "tiny-model"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny)
    source = work / f"products-{rows}"
    make_products(source, rows, files=1, row_group=row_group)
    return tiny, source


def conversations(config: dict) -> list[list[dict]]:
    """Each row's chat messages, as the pipeline renders them (its system prompt, template)."""
    import pyarrow.parquet as pq

    from pipelines.config import load_config
    from pipelines.plan.preflight import plan_job
    from udfs.stages.prompts import PromptRenderer

    renderer = PromptRenderer(plan_job(load_config(config)).render)
    rows = pq.read_table(config["input"]["path"], columns=renderer.variables).to_pylist()
    return [renderer.render_messages(row) for row in rows]


def run_bare(spec: Path, mode: str = "ceiling") -> dict:
    """throughput.py's ceiling (or its chat reference), in a fresh process."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "throughput.py"),
                          "_reference", mode, str(spec)],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"bare vLLM failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_overnight(config: dict, work: Path, name: str, bare_texts: list[str]) -> dict:
    import polars as pl

    out = Path(config["output"]["path"])
    result = run_pipeline(config, work, name, memory=False)
    result.pop("stdout", None)
    result.pop("pid", None)
    result.update(generation_window(Path(str(out) + ".report.json")))
    table = pl.read_parquet(out)
    result["files"] = sum(1 for _ in out.glob("*.parquet"))
    result["identical_to_bare"] = table[OUTPUT_COLUMN].to_list() == bare_texts
    result["errors"] = int(table["error"].is_not_null().sum())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--row-group", type=int, default=5000,
                    help="rows per Parquet row group (the issue's table: 5,000)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["bare", "overnight"],
                    help="one arm only (no ratios, no comparison of outputs)")
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "prefill"))
    ap.add_argument("--note", default="", help="kept with the results: which code, which machine")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prefill.json"))
    args = ap.parse_args()

    work = Path(args.work)
    tiny, source = workload(work, args.rows, args.row_group)
    specs, configs = {}, {}
    for k in args.max_tokens:
        configs[k] = job(str(tiny), source, work / f"out-{k}", k)
        prompts, caps = render(configs[k])
        specs[k] = work / f"spec-{k}.json"
        specs[k].write_text(json.dumps({"model": str(tiny), "dtype": "float32",
                                        "prompts": prompts, "max_tokens": caps,
                                        "conversations": conversations(configs[k])}))
    prompt_tokens = sum(len(p) for p in prompts)

    rounds = []
    for i in range(args.repeat):
        results: dict = {}
        for k in args.max_tokens:
            r = results[str(k)] = {}
            if args.only != "overnight":
                print(f"round {i + 1}/{args.repeat}, max_tokens {k}: bare vLLM ...",
                      file=sys.stderr)
                r["bare"] = run_bare(specs[k])
                print(f"round {i + 1}/{args.repeat}, max_tokens {k}: bare vLLM, LLM.chat ...",
                      file=sys.stderr)
                r["bare chat"] = run_bare(specs[k], "chat")
            if args.only != "bare":
                print(f"round {i + 1}/{args.repeat}, max_tokens {k}: overnight ...",
                      file=sys.stderr)
                r["overnight"] = run_overnight(configs[k], work, f"out-{k}",
                                               r.get("bare", {}).get("texts", []))
        rounds.append(results)
    report(args, rounds, prompt_tokens)


def report(args, rounds: list[dict], prompt_tokens: int) -> None:
    n = args.rows
    print(f"\nprefill-heavy: {n} rows, {prompt_tokens / n:.1f} prompt tokens a row, greedy, "
          f"tiny model, float32, CPU; median of {len(rounds)} round(s)")
    print(f"{'':28} {'generate s':>10} {'rows/s':>8} {'process s':>10} {'rows/s':>8}")
    summary = {}
    for k in map(str, args.max_tokens):
        arms = [a for a in ("bare", "bare chat", "overnight") if a in rounds[0][k]]
        for arm in arms:
            gen = median(r[k][arm]["generate_s"] for r in rounds)
            whole = median(r[k][arm]["process_start_to_done_s"] for r in rounds)
            print(f"{f'max_tokens {k}, {arm}':28} {gen:10.1f} {n / gen:8.0f} {whole:10.1f} "
                  f"{n / whole:8.0f}")
        if "overnight" not in arms or len(arms) < 2:
            continue
        summary[k] = {}
        for ref in arms[:-1]:  # each reference against overnight, round by round
            per_round = [{
                "whole process": (r[k][ref]["process_start_to_done_s"]
                                  / r[k]["overnight"]["process_start_to_done_s"]),
                "generation": r[k][ref]["generate_s"] / r[k]["overnight"]["generate_s"],
            } for r in rounds]
            ratios = {name: median(p[name] for p in per_round) for name in per_round[0]}
            for name, value in ratios.items():
                each = ", ".join(f"{p[name]:.2f}" for p in per_round)
                print(f"  overnight/{ref} rows/s, {name}: {value:.2f} (rounds: {each})")
            summary[k]["ratios" if ref == "bare" else "ratios_vs_chat"] = ratios
            summary[k]["ratios_per_round" if ref == "bare" else "ratios_vs_chat_per_round"] = \
                per_round
        identical = all(r[k]["overnight"]["identical_to_bare"] for r in rounds)
        chat_same = all(r[k]["bare chat"]["texts"] == r[k]["bare"]["texts"]
                        and r[k]["bare chat"]["same_prompt_ids"] for r in rounds) \
            if "bare chat" in arms else None
        last = rounds[-1][k]["overnight"]
        print(f"  greedy outputs identical to bare vLLM's, row for row: {identical}; "
              f"LLM.chat's prompt ids and outputs the same as well: {chat_same}; "
              f"output files {last['files']}; row errors {last['errors']}")
        print("  CPU s of the pipeline's processes (last round): " + ", ".join(
            f"{role} {s:.0f}" for role, s in list(last["cpu_s_by_process"].items())[:6]))
        summary[k].update({"identical_to_bare": identical, "chat_same_as_bare": chat_same})
    for r in rounds:
        for k in r.values():
            for result in k.values():
                result.pop("texts", None)
    write(args, {"prompt_tokens_per_row": prompt_tokens / n, "summary": summary,
                 "rounds": rounds})


if __name__ == "__main__":
    main()
