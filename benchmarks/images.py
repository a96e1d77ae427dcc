"""Images in, text out: a job's images/s against bare vLLM ``LLM.chat`` on the same images, and
the process tree's peak memory over a small and a ten-times larger table of photos.

    python benchmarks/images.py                       # 1,000 and 10,000 rows of ~1 MB photos
    python benchmarks/images.py --rows 200 2000       # smaller, quicker
    python benchmarks/images.py --source paths        # the table holds paths, not bytes

One run builds (once, under --work) the tiny vision model (``overnight tiny-model --vision``)
and ``--distinct`` random-noise JPEG photos of about 1 MB each (noise does not compress), then
for each table size:
  1. a table of that many rows whose ``photo`` column holds the photos' bytes (a Parquet binary
     column, so the larger table is ~10 GB on disk) or their paths, cycling through them;
  2. bare: ``vllm.LLM.chat`` on every row's conversation in one call, each image given as an
     already-decoded ``image_pil`` part (the engine's work alone), in a process of its own;
  3. overnight: ``overnight run`` on the table, Parquet to Parquet, in a process of its own,
     its process tree's memory sampled every 0.5 s as PSS (the driver, Ray's daemons and
     workers, the engine's actor; a page of Ray's object store that several of them map is
     counted once, where summed RSS counts it in each).
Reported: images/s in the generation phase (the run report's for overnight; the chat call's
for bare), their ratio, each run's whole-process seconds, the process tree's peak memory for
each size and the larger over the smaller (within 15% is the aim); and whether the texts equal bare's row for row.
Results go to benchmarks/results/images-<date>-<commit>.json.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.throughput import commit  # noqa: E402

KV = 256 << 20
TEMPLATE = "Describe this product photo. Its title: {{ title }}"


def photos(work: Path, count: int) -> list[Path]:
    """``count`` random-noise JPEGs of ~1 MB (1100x800, quality 90), made once."""
    import numpy as np
    from PIL import Image

    folder = work / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"photo-{i:03d}.jpg" for i in range(count)]
    rng = np.random.default_rng(0)
    for path in paths:
        if not path.exists():
            pixels = rng.integers(0, 256, (800, 1100, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path, "JPEG", quality=90)
    return paths


def table(work: Path, rows: int, paths: list[Path], source: str) -> Path:
    """A table of ``rows`` rows, written in row groups of 256 (memory flat while writing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = work / f"table-{source}-{rows}.parquet"
    if out.exists():
        return out
    schema = pa.schema([("sku", pa.string()), ("title", pa.string()),
                        ("photo", pa.binary() if source == "bytes" else pa.string())])
    data = {p: p.read_bytes() for p in paths} if source == "bytes" else {}
    # no dictionary: each row's photo stored whole, as a table of distinct photos would be
    with pq.ParquetWriter(out, schema, use_dictionary=["sku", "title"]) as writer:
        for first in range(0, rows, 256):
            ids = range(first, min(rows, first + 256))
            chosen = [paths[i % len(paths)] for i in ids]
            writer.write_table(pa.table({
                "sku": [f"P{i:06d}" for i in ids], "title": [f"item {i}" for i in ids],
                "photo": [data[p] for p in chosen] if source == "bytes"
                else [str(p) for p in chosen]}, schema))
    return out


def config(model: str, source: Path, out: Path, tokens: int) -> dict:
    return {
        "input": {"path": str(source), "id_column": "sku"},
        "model": {"name": model, "max_model_len": 512, "dtype": "float32"},
        "prompt": {"images": ["photo"], "template": TEMPLATE},
        "sampling": {"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True},
        "output": {"path": str(out), "column": "text_out"},
        "engine": {"kv_cache_memory_bytes": KV},
        "resources": {"batch_size": 64},
    }


BARE = """
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import pyarrow.parquet as pq
from PIL import Image
import io
from vllm import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True,
          kv_cache_memory_bytes=spec["kv"], enable_chunked_prefill=False)
params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
t = pq.read_table(spec["table"])
titles, photos = t.column("title").to_pylist(), t.column("photo").to_pylist()
def image(value):
    return Image.open(io.BytesIO(value) if isinstance(value, bytes) else value)
conversations = [[{"role": "user", "content": [
    {"type": "image_pil", "image_pil": image(p)},
    {"type": "text", "text": spec["template"].replace("{{ title }}", title)}]}]
    for title, p in zip(titles, photos)]
started = time.time()
outs = llm.chat(conversations, params, use_tqdm=False)
took = time.time() - started
print(json.dumps({"images_per_s": len(outs) / took, "generation_s": took,
                  "texts": [o.outputs[0].text for o in outs]}))
"""


def bare(model: str, source: Path, tokens: int, work: Path) -> dict:
    spec = work / "bare.json"
    spec.write_text(json.dumps({"model": model, "kv": KV, "tokens": tokens,
                                "table": str(source), "template": TEMPLATE}))
    started = time.time()
    run = subprocess.run([sys.executable, "-c", BARE, str(spec)], capture_output=True,
                         text=True, cwd=REPO, check=False)
    if run.returncode:
        sys.exit(f"bare vLLM failed: {run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["whole_s"] = time.time() - started
    return result


def tree_pss(pid: int) -> tuple[int, dict]:
    """The process tree's proportional set size: each shared page (Ray's object store, which
    every process that reads a block maps) counted once over the processes sharing it, where
    RSS summed over them counts it in each. With it, each kind of process's (MiB, summed by
    name: the driver, ray::MapWorker(...), ray::write_group...)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, {}
    total, by_name = 0, {}
    for proc in procs:
        try:
            pss = proc.memory_full_info().pss
            name = "driver" if proc.pid == pid else (proc.cmdline() or [proc.name()])[0]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += pss
        by_name[name] = by_name.get(name, 0) + round(pss / 2**20)
    return total, by_name


def overnight(job: dict, work: Path, name: str) -> dict:
    import polars as pl
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet",
                             "--overwrite"], cwd=REPO)
    peak, at_peak = [0], [{}]

    def sample() -> None:
        while proc.poll() is None:
            total, by_name = tree_pss(proc.pid)
            if total > peak[0]:
                peak[0], at_peak[0] = total, {"at_s": round(time.time() - started, 1),
                                              **dict(sorted(by_name.items(),
                                                            key=lambda kv: -kv[1]))}
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if proc.wait():
        sys.exit(f"overnight run failed ({proc.returncode})")
    sampler.join()
    whole = time.time() - started
    out = job["output"]["path"]
    report = json.loads(Path(out + ".report.json").read_text())
    frame = pl.read_parquet(out, columns=["text_out", "error"])
    return {"images_per_s": report["throughput"]["rows_per_s"],
            "generation_s": report["time"]["generation_s"], "whole_s": whole,
            "peak_tree_pss_mib": peak[0] / 2**20, "pss_mib_at_peak_by_process": at_peak[0],
            "errors": frame["error"].drop_nulls().len(),
            "texts": frame["text_out"].to_list()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs=2, default=[1000, 10000])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--distinct", type=int, default=64)
    parser.add_argument("--source", choices=["bytes", "paths"], default="bytes")
    parser.add_argument("--work", type=Path, default=Path("/tmp/overnight-images-bench"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from pipelines.tools.tiny_model import build_tiny_vision_model

    model = str(build_tiny_vision_model(args.work / "vision"))
    paths = photos(args.work, args.distinct)
    sizes = {}
    for rows in args.rows:
        source = table(args.work, rows, paths, args.source)
        reference = bare(model, source, args.tokens, args.work) if rows == args.rows[0] \
            else None
        ours = overnight(config(model, source, args.work / f"out-{rows}", args.tokens),
                         args.work, f"job-{rows}")
        sizes[rows] = {"overnight": {k: v for k, v in ours.items() if k != "texts"}}
        if reference is not None:
            sizes[rows]["bare"] = {k: v for k, v in reference.items() if k != "texts"}
            sizes[rows]["overnight_over_bare"] = round(
                ours["images_per_s"] / reference["images_per_s"], 3)
            sizes[rows]["texts_equal_bare"] = ours["texts"] == reference["texts"]
        print(json.dumps({rows: sizes[rows]}), file=sys.stderr)
    small, large = (sizes[r]["overnight"]["peak_tree_pss_mib"] for r in args.rows)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "source": args.source,
              "photo_bytes": round(sum(p.stat().st_size for p in paths) / len(paths)),
              "tokens_per_row": args.tokens, "rows": sizes,
              "peak_pss_large_over_small": round(large / small, 3)}
    print(json.dumps(result, indent=2))
    name = f"images-{result['date']}-{result['commit']}-{args.rows[0]}-{args.rows[1]}-{args.source}.json"
    out = REPO / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
