"""LoRA adapters per row: overnight's output tokens/s on a table mixing adapters, against bare
vLLM on the same requests; and a table whose rows alternate between adapters against the same
rows sorted by adapter.

    python benchmarks/lora.py                  # 320 rows, 3 adapters and the base model
    python benchmarks/lora.py --rows 640 --adapters 4 --repeat 2

One run builds (once, under --work) the bench-size random model (hidden 512, 6 layers, float32)
and --adapters random LoRA adapters on it (PEFT, rank 8, q/k/v/o), then measures, each in a
fresh process, in turn, --repeat rounds:
  1. bare:        ``vllm.LLM.generate`` on every prompt in one call, a ``LoRARequest`` per
                  prompt (the rows in table order: alternating);
  2. bare sorted: the same, the prompts sorted by adapter;
  3. overnight:   ``overnight run`` on the alternating table, Parquet to Parquet;
  4. overnight sorted: on the same rows sorted by adapter.
Every request has the same output length (ignore_eos), so tokens/s compare work done.
Reported, as medians: each run's output tokens/s over its generation (the run report's for
overnight, the generate call's for bare vLLM), the ratios overnight / bare on the same table,
and sorted / alternating for each; overnight's texts are checked against bare vLLM's, row for
row. Results go to benchmarks/results/lora-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from throughput import WORDS, commit  # noqa: E402  (the benchmarks' shared helpers)

KV = 1 << 30


def build(work: Path, adapters: int) -> tuple[str, dict[str, str]]:
    """The bench model and its adapters, made once."""
    from pipelines.tools.tiny_model import build_tiny_model

    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny_model(model, size="bench")
    made = {}
    for k in range(adapters):
        out = work / f"adapter{k}"
        if not (out / "adapter_config.json").exists():
            subprocess.run([sys.executable, "-c", MAKE_ADAPTER, str(model), str(out), str(k)],
                           check=True, cwd=REPO)
        made[f"a{k}"] = str(out)
    return str(model), made


MAKE_ADAPTER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
base, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(seed)
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False))
peft.save_pretrained(out)
"""


def make_tables(work: Path, rows: int, names: list[str | None]) -> tuple[Path, Path]:
    """The alternating table (row i on names[i % len]) and the same rows sorted by adapter."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    table = pa.table({
        "id": [f"r{i:06d}" for i in range(rows)],
        "text": [" ".join(rng.choices(WORDS, k=rng.randint(8, 40))) for _ in range(rows)],
        "adapter": [names[i % len(names)] for i in range(rows)],
    })
    alternating, ordered = work / "alternating.parquet", work / "sorted.parquet"
    pq.write_table(table, alternating)
    order = sorted(range(rows), key=lambda i: (names.index(table["adapter"][i].as_py()), i))
    pq.write_table(table.take(order), ordered)
    return alternating, ordered


def job(model: str, adapters: dict, source: Path, out: Path, tokens: int) -> dict:
    return {
        "input": {"path": str(source), "id_column": "id"},
        "model": {"name": model, "max_model_len": 1024, "dtype": "float32",
                  "adapters": adapters},
        "prompt": {"system": "Describe.", "template": "{{ text }}", "adapter_column": "adapter"},
        "sampling": {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True},
        "output": {"path": str(out), "column": "text_out"},
        "engine": {"kv_cache_memory_bytes": KV},
        "resources": {"batch_size": 64},
    }


BARE = """
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], dtype="float32", max_model_len=1024, enforce_eager=True,
          kv_cache_memory_bytes=spec["kv"], enable_chunked_prefill=False, enable_lora=True,
          max_lora_rank=8, max_loras=len(spec["adapters"]) + 1,
          max_cpu_loras=len(spec["adapters"]) + 1)
lora = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(sorted(spec["adapters"].items()))}
params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
started = time.time()
outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], params,
                    lora_request=[lora[n] if n else None for n in spec["names"]], use_tqdm=False)
took = time.time() - started
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"tokens_per_s": tokens / took, "texts": [o.outputs[0].text for o in outs]}))
"""


def bare(model: str, adapters: dict, config: dict, tokens: int, work: Path) -> dict:
    """Bare vLLM on the job's own rendered prompts, in table order."""
    import pyarrow.parquet as pq

    from throughput import render

    prompts, _ = render(config)
    names = pq.read_table(config["input"]["path"]).column("adapter").to_pylist()
    spec = work / "bare.json"
    spec.write_text(json.dumps({"model": model, "adapters": adapters, "kv": KV,
                                "tokens": tokens, "prompts": prompts, "names": names}))
    run = subprocess.run([sys.executable, "-c", BARE, str(spec)], capture_output=True,
                         text=True, cwd=REPO, check=False)
    if run.returncode:
        sys.exit(f"bare vLLM failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def overnight(config: dict, work: Path, name: str) -> dict:
    import polars as pl
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet",
                    "--overwrite"], check=True, cwd=REPO)
    out = config["output"]["path"]
    report = json.loads(Path(out + ".report.json").read_text())
    texts = pl.read_parquet(out)["text_out"].to_list()
    return {"tokens_per_s": report["throughput"]["output_tokens_per_s"], "texts": texts,
            "adapters": report.get("adapters")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=320)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/overnight-lora-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, adapters = build(args.work, args.adapters)
    names = [None, *adapters]
    alternating, ordered = make_tables(args.work, args.rows, names)
    configs = {kind: job(model, adapters, source, args.work / f"out-{kind}", args.tokens)
               for kind, source in (("alternating", alternating), ("sorted", ordered))}
    runs: dict[str, list[float]] = {k: [] for k in ("bare", "bare_sorted", "overnight",
                                                   "overnight_sorted")}
    same = True
    for _ in range(args.repeat):
        for kind in ("alternating", "sorted"):
            suffix = "" if kind == "alternating" else "_sorted"
            reference = bare(model, adapters, configs[kind], args.tokens, args.work)
            ours = overnight(configs[kind], args.work, kind)
            runs["bare" + suffix].append(reference["tokens_per_s"])
            runs["overnight" + suffix].append(ours["tokens_per_s"])
            same = same and ours["texts"] == reference["texts"]
    tps = {k: round(median(v), 1) for k, v in runs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit(), "rows": args.rows,
        "adapters": args.adapters, "tokens_per_row": args.tokens, "repeat": args.repeat,
        "output_tokens_per_s": tps,
        "overnight_over_bare": round(tps["overnight"] / tps["bare"], 3),
        "overnight_over_bare_sorted": round(tps["overnight_sorted"] / tps["bare_sorted"], 3),
        "sorted_over_alternating": {
            "bare": round(tps["bare_sorted"] / tps["bare"], 3),
            "overnight": round(tps["overnight_sorted"] / tps["overnight"], 3)},
        "texts_equal_bare": same,
    }
    print(json.dumps(result, indent=2))
    out = REPO / "benchmarks" / "results" / f"lora-{result['date']}-{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
