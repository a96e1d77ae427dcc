"""task: embed through overnight, against bare ``vllm.LLM.embed`` on the same prompts.

    python benchmarks/embed.py                   # 20,000 rows, 3 rounds; prints, writes JSON
    python benchmarks/embed.py --rows 2000 --repeat 1

Each round runs, each in a fresh process, on the same token ids (rendered as the pipeline
renders them), the same model (the benchmark-sized tiny Llama, run as a pooling model) and the
same engine settings:
  1. bare:      ``LLM.embed`` on all prompts in one call, in process;
  2. overnight: ``overnight run`` of a ``task: embed`` job end to end, Parquet to Parquet,
                through Ray Data.
Reported, as medians over rounds: rows/s over the embedding phase (bare: the ``embed`` call;
overnight: the run report's generation window, first engine ready to last block pooled) and
over the whole process (start to exit), and the ratios overnight/bare of each. Every row's
vector from the job is compared with bare vLLM's (cosine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.throughput import generation_window, make_input, run_pipeline  # noqa: E402

MAX_MODEL_LEN = 1024


def job(model: str, source: Path, out: Path, batch_size: int, blocks_in_flight: int) -> dict:
    return {
        "task": "embed",
        "input": {"path": str(source), "id_column": "id"},
        "model": {"name": model, "max_model_len": MAX_MODEL_LEN, "dtype": "float32"},
        "prompt": {"template": "{{ text }}"},
        "output": {"path": str(out)},
        "engine": {"kv_cache_memory_bytes": 1 << 30},
        "resources": {"batch_size": batch_size, "blocks_in_flight": blocks_in_flight},
    }


def render(config: dict) -> list[list[int]]:
    """The prompts exactly as the pipeline renders them."""
    import pyarrow.parquet as pq

    from pipelines.config import load_config
    from pipelines.plan.preflight import plan_job
    from udfs import columns
    from udfs.stages.prompts import PromptRenderer

    plan = plan_job(load_config(config))
    rendered = PromptRenderer(plan.render)(pq.read_table(config["input"]["path"]))
    return rendered.column(columns.PROMPT_TOKEN_IDS).to_pylist()


def bare(spec_path: str) -> None:
    """Runs in a fresh process: bare ``LLM.embed`` on every prompt in one call, with the
    settings the pipeline gives a CPU engine."""
    import os

    started = time.time()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = json.loads(Path(spec_path).read_text())
    import numpy as np
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(model=spec["model"], runner="pooling", dtype="float32",
                   max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=1 << 30,
                   enforce_eager=True, enable_chunked_prefill=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    embed_start = time.time()
    outs = llm.embed(prompts, use_tqdm=False)
    embed_s = time.time() - embed_start
    np.save(spec["vectors"], np.array([o.outputs.embedding for o in outs], np.float32))
    print(json.dumps({"embed_s": embed_s, "process_start_to_done_s": time.time() - started}))


def run_round(config: dict, spec: Path, work: Path) -> dict:
    import numpy as np
    import polars as pl

    out = subprocess.run([sys.executable, __file__, "_bare", str(spec)], capture_output=True,
                         text=True, cwd=REPO, check=True)
    reference = json.loads(out.stdout.strip().splitlines()[-1])
    pipe = run_pipeline(config, work, "embed", memory=False)
    window = generation_window(Path(config["output"]["path"] + ".report.json"))
    got = np.array(pl.read_parquet(config["output"]["path"])["embedding"].to_list())
    want = np.load(json.loads(spec.read_text())["vectors"])
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    return {"bare": reference,
            "overnight": {"embed_s": window["generate_s"], "startup_s": window["startup_s"],
                          "process_start_to_done_s": pipe["process_start_to_done_s"],
                          "cpu_s_by_process": pipe["cpu_s_by_process"]},
            "min_cosine": float(cosine.min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--blocks-in-flight", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=str(REPO / "benchmarks" / ".work" / "embed"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "embed.json"))
    args = ap.parse_args()

    from pipelines.tools.tiny_model import build_tiny_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "bench-model"
    if not (model / "config.json").exists():
        build_tiny_model(model, size="bench")
    source = work / "texts.parquet"
    make_input(source, args.rows, 1, 1)
    config = job(str(model), source, work / "out", args.batch_size, args.blocks_in_flight)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": render(config),
                                "vectors": str(work / "bare.npy")}))
    rounds = []
    for i in range(args.repeat):
        print(f"round {i + 1}/{args.repeat} ...", file=sys.stderr)
        rounds.append(run_round(config, spec, work))
    rows = args.rows

    def rate(key: str, phase: str) -> list[float]:
        return [rows / r[key][phase] for r in rounds]

    summary = {
        "rows": rows, "rounds": rounds,
        "min_cosine": min(r["min_cosine"] for r in rounds),
        "bare_rows_per_s": {"embed": median(rate("bare", "embed_s")),
                            "whole": median(rate("bare", "process_start_to_done_s"))},
        "overnight_rows_per_s": {"embed": median(rate("overnight", "embed_s")),
                                 "whole": median(rate("overnight", "process_start_to_done_s"))},
        "ratio_overnight_over_bare": {
            "embed": median(r["bare"]["embed_s"] / r["overnight"]["embed_s"] for r in rounds),
            "whole": median(r["bare"]["process_start_to_done_s"]
                            / r["overnight"]["process_start_to_done_s"] for r in rounds)},
    }
    print(f"rows {rows}; min cosine vs bare {summary['min_cosine']:.6f}")
    for phase in ("embed", "whole"):
        print(f"{phase:>6}: bare {summary['bare_rows_per_s'][phase]:8.1f} rows/s, overnight "
              f"{summary['overnight_rows_per_s'][phase]:8.1f} rows/s, ratio "
              f"{summary['ratio_overnight_over_bare'][phase]:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_bare":
        bare(sys.argv[2])
    else:
        main()
