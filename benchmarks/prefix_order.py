"""Rows grouped by prompt prefix (#58): overnight against bare vLLM on tables whose rows share
long heads far apart, and on one whose rows share none.

    python benchmarks/prefix_order.py                           # the sizes below (~25 min here)
    python benchmarks/prefix_order.py --documents 400 --questions 10 --rows-b 4000   # the issue's

Tables (the bench-size tiny model, ~800-token heads, greedy, 16 output tokens, float32, CPU):
  qa        --documents documents asked --questions questions each, question by question (all
            documents for the first question, then the second...);
  few-shot  --categories categories, each its own few-shot head, --rows-b rows shuffled;
  unique    --rows-unique rows whose prompts share nothing.
The engine's KV cache holds --cache-heads heads (of the ~800 tokens) at once, so in input order
a head is gone before the next row that needs it comes. Each table runs, in fresh processes:
  bare input order  ``vllm.LLM.generate`` on the prompts (the pipeline's own token ids) in the
                    table's order, the engine settings the pipeline gives a CPU engine;
  bare sorted       the same call on the prompts sorted by head (document, category): the
                    ceiling of any bucketing;
  overnight         ``overnight run`` with resources.group_by_prefix auto (and, for unique and
                    for the parity check, off).
Reported: each arm's generation seconds (bare: the ``generate`` call; overnight: the run
report's generation window, and with the grouping pass and the restore added), the ratios
overnight/bare sorted and overnight/bare input order, the prefix cache's hit rate (vLLM's
num_cached_tokens over the prompt tokens), and whether the outputs are identical row for row.
With --replicas 2, the qa table runs on two replicas too, grouped and not: each replica's prompt
tokens computed (not held by its cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.throughput import commit, generation_window, run_pipeline, write  # noqa: E402

WORDS = ("the a product lamp chair table shirt shoe phone cable bag bottle soft bright warm "
         "cool steel wood cotton wool glass leather red blue green black white small large "
         "light heavy fast slow quiet new classic modern simple elegant durable").split()
MAX_TOKENS = 16
KV_BYTES_PER_TOKEN = 2 * 6 * 4 * 64 * 4  # K and V, 6 layers, 4 KV heads of 64, float32


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def tables(work: Path, args) -> dict[str, tuple[Path, list]]:
    """Each table's Parquet file and its rows' head (the key bare sorted sorts by)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    docs = [text(rng, args.head_words) for _ in range(args.documents)]
    qa = [{"id": f"q{q:02d}-d{d:04d}", "head": docs[d], "text": f"Question {q}: {text(rng, 6)}"}
          for q in range(args.questions) for d in range(args.documents)]
    shots = [text(rng, args.head_words) for _ in range(args.categories)]
    few = [{"id": f"r{i:05d}", "head": shots[i % args.categories], "text": text(rng, 12)}
           for i in range(args.rows_b)]
    rng.shuffle(few)
    unique = [{"id": f"u{i:05d}", "head": text(rng, args.head_words), "text": text(rng, 12)}
              for i in range(args.rows_unique)]
    out = {}
    for name, rows in (("qa", qa), ("few-shot", few), ("unique", unique)):
        path = work / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1024)
        heads = {h: i for i, h in enumerate(dict.fromkeys(r["head"] for r in rows))}
        out[name] = (path, [heads[r["head"]] for r in rows])
    return out


def job(model: str, source: Path, out: Path, group: str, kv_bytes: int, replicas: int = 1):
    return {
        "input": {"path": str(source), "id_column": "id"},
        "model": {"name": model, "max_model_len": 1024, "dtype": "float32"},
        "prompt": {"template": "{{ head }}\n\n{{ text }}"},
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        "output": {"path": str(out), "column": "answer"},
        "engine": {"kv_cache_memory_bytes": kv_bytes},
        "resources": {"group_by_prefix": group, "replicas": replicas},
    }


def bare(spec_path: str) -> None:
    """Runs in a fresh process: bare ``LLM.generate`` on the prompts in the spec's order."""
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    llm = vllm.LLM(model=spec["model"], dtype="float32", max_model_len=1024,
                   kv_cache_memory_bytes=spec["kv_bytes"], enforce_eager=True,
                   enable_chunked_prefill=False)
    order = spec["order"]
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in order]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    gen_start = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen = time.time() - gen_start
    texts = [None] * len(order)
    for i, out in zip(order, outs):
        texts[i] = out.outputs[0].text
    print(json.dumps({"texts": texts, "generate_s": gen,
                      "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                      "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                      "process_start_to_done_s": time.time() - started}))


def run_bare(spec: dict, work: Path, name: str) -> dict:
    path = work / f"spec-{name}.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, __file__, "_bare", str(path)], capture_output=True,
                         text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"bare vLLM failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_overnight(config: dict, work: Path, name: str) -> dict:
    import polars as pl

    out = Path(config["output"]["path"])
    result = run_pipeline(config, work, name, memory=False)
    result.pop("stdout", None)
    result.pop("pid", None)
    report = json.loads(Path(str(out) + ".report.json").read_text())
    result.update(generation_window(Path(str(out) + ".report.json")))
    t = report["time"]
    result["with_grouping_s"] = t["generation_s"] + t.get("grouping_s", 0) + t.get("restore_s", 0)
    result["prefix_cache"] = report.get("prefix_cache")
    result["per_replica"] = [{k: r.get(k) for k in ("rows", "prompt_tokens", "cached_tokens")}
                             for r in report["throughput"]["per_replica"]]
    result["texts"] = pl.read_parquet(out)["answer"].to_list()
    return result


def prompts_of(config: dict) -> list[list[int]]:
    from benchmarks.throughput import render

    return render({**config, "sampling": {**config["sampling"]}})[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--categories", type=int, default=40)
    ap.add_argument("--rows-b", type=int, default=400, help="rows of the few-shot table")
    ap.add_argument("--rows-unique", type=int, default=200, help="rows of the unique table")
    ap.add_argument("--head-words", type=int, default=780, help="about a token a word: ~800-token heads")
    ap.add_argument("--cache-heads", type=int, default=10,
                    help="heads the engine's KV cache holds at once")
    ap.add_argument("--replicas", type=int, default=1, help="2: the qa table on two too")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of overnight auto against off on the unique table")
    ap.add_argument("--only", nargs="+", choices=["qa", "few-shot", "unique"])
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "prefix-order"))
    ap.add_argument("--note", default="", help="kept with the results: which code, which machine")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prefix-order.json"))
    args = ap.parse_args()

    from pipelines.tools.tiny_model import build_tiny_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "bench-model"
    if not (model / "config.json").exists():
        build_tiny_model(model, size="bench")
    results = {}
    for name, (path, heads) in tables(work, args).items():
        if args.only and name not in args.only:
            continue
        results[name] = one_table(args, work, str(model), name, path, heads)
    report(args, results)


def one_table(args, work: Path, model: str, name: str, path: Path, heads: list) -> dict:
    probe = job(model, path, work / f"{name}-probe", "off", 1 << 30)
    prompts = prompts_of(probe)
    head_tokens = sum(len(p) for p in prompts) / len(prompts)
    kv_bytes = int(args.cache_heads * head_tokens * KV_BYTES_PER_TOKEN)
    spec = {"model": model, "prompts": prompts, "kv_bytes": kv_bytes}
    rows = list(range(len(prompts)))
    print(f"{name}: {len(prompts)} rows, {head_tokens:.0f} prompt tokens a row, a KV cache "
          f"of {kv_bytes / KV_BYTES_PER_TOKEN:,.0f} tokens", file=sys.stderr)
    arms = {}
    print(f"{name}: bare, input order ...", file=sys.stderr)
    arms["bare input order"] = run_bare({**spec, "order": rows}, work, f"{name}-input")
    print(f"{name}: bare, sorted by head ...", file=sys.stderr)
    arms["bare sorted"] = run_bare({**spec, "order": sorted(rows, key=lambda i: (heads[i], i))},
                                   work, f"{name}-sorted")
    for group in ("auto", "off") if name == "unique" else ("auto",):
        print(f"{name}: overnight, group_by_prefix {group} ...", file=sys.stderr)
        arms[f"overnight {group}"] = run_overnight(
            job(model, path, work / f"{name}-{group}", group, kv_bytes), work, f"{name}-{group}")
    if name == "unique":  # auto against off again, alternated: this machine drifts by 10%+
        rounds = [(arms["overnight auto"], arms["overnight off"])]
        for i in range(1, args.repeat):
            pair = []
            for group in ("off", "auto") if i % 2 else ("auto", "off"):
                print(f"{name}: overnight, group_by_prefix {group}, round {i + 1} ...",
                      file=sys.stderr)
                pair.append(run_overnight(job(model, path, work / f"{name}-{group}", group,
                                              kv_bytes), work, f"{name}-{group}"))
            rounds.append(tuple(pair) if i % 2 == 0 else tuple(pair[::-1]))
        arms["overnight auto"]["auto/off per round"] = [
            {"whole process": off["process_start_to_done_s"] / auto["process_start_to_done_s"],
             "generation": off["generate_s"] / auto["generate_s"]} for auto, off in rounds]
    if args.replicas > 1 and name == "qa":
        for group in ("auto", "off"):
            print(f"{name}: overnight, {args.replicas} replicas, group_by_prefix {group} ...",
                  file=sys.stderr)
            arms[f"overnight {group}, {args.replicas} replicas"] = run_overnight(
                job(model, path, work / f"{name}-{group}-r", group, kv_bytes, args.replicas),
                work, f"{name}-{group}-r")
    reference = arms["bare input order"]["texts"]
    for arm in arms.values():
        arm["identical_to_bare_input_order"] = arm["texts"] == reference
    return {"rows": len(prompts), "prompt_tokens_per_row": head_tokens,
            "kv_cache_tokens": kv_bytes // KV_BYTES_PER_TOKEN, "arms": arms}


def report(args, results: dict) -> None:
    print(f"\n{'':34} {'generate s':>10} {'+grouping':>10} {'cache hit':>9} {'same':>5}")
    summary = {}
    for name, r in results.items():
        arms = r["arms"]
        for arm, a in arms.items():
            cache = a.get("prefix_cache") or {}
            hit = (cache.get("hit_rate") if cache else
                   a.get("cached_tokens", 0) / max(a.get("prompt_tokens", 1), 1))
            print(f"{name + ', ' + arm:34} {a['generate_s']:10.1f} "
                  f"{a.get('with_grouping_s', a['generate_s']):10.1f} {hit or 0:9.0%} "
                  f"{str(a['identical_to_bare_input_order']):>5}")
        grouped = arms["overnight auto"]
        s = summary[name] = {
            "overnight/bare sorted, generation": arms["bare sorted"]["generate_s"]
            / grouped["generate_s"],
            "overnight/bare sorted, with grouping and restore": arms["bare sorted"]["generate_s"]
            / grouped["with_grouping_s"],
            "overnight/bare input order, generation": arms["bare input order"]["generate_s"]
            / grouped["generate_s"],
            "bare sorted/bare input order": arms["bare input order"]["generate_s"]
            / arms["bare sorted"]["generate_s"],
            "identical_to_bare_input_order": all(a["identical_to_bare_input_order"]
                                                 for a in arms.values())}
        if "overnight off" in arms:
            per_round = grouped["auto/off per round"]
            for what in ("whole process", "generation"):
                s[f"auto/off, {what}, median of {len(per_round)}"] = median(
                    r[what] for r in per_round)
                s[f"auto/off, {what}, each round"] = [round(r[what], 3) for r in per_round]
        for key, value in s.items():
            print(f"  {name}: {key}: {value:.2f}" if isinstance(value, float) else
                  f"  {name}: {key}: {value}")
        for arm, a in arms.items():
            if "replicas" in arm:
                computed = [r["prompt_tokens"] - (r["cached_tokens"] or 0)
                            for r in a["per_replica"]]
                print(f"  {name}, {arm}: prompt tokens computed per replica {computed}, "
                      f"{sum(computed):,} in all")
                s[f"computed per replica, {arm}"] = computed
    for r in results.values():
        for a in r["arms"].values():
            a.pop("texts", None)
    write(args, {"commit": commit(), "summary": summary, "tables": results})


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_bare":
        bare(sys.argv[2])
    else:
        main()
