"""overnight view over a large output: the page server's memory and answer times.

    python benchmarks/view_memory.py                 # a 10M-row output, 10 files
    python benchmarks/view_memory.py --rows 1000000 --files 2

Writes an output as a finished job leaves it (a job record, its Parquet files named by the
input rows they hold: source columns, the generated text, finish reasons, token counts, 1% of
rows with an error), generated once into --scratch (never shipped; no model runs). Then starts
``overnight view`` on it in a fresh process and asks, in turn: the status (every file's counts),
the first page of rows, a page filtered by error kind, a page filtered by a ``where``
condition, a text search, and a page in the middle. The server's RSS is sampled 20 times a
second throughout; reported: its peak, and each answer's seconds and rows. Results go to
benchmarks/results/view-memory-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ("soft bright lamp chair steel wood cotton glass leather warm cool modern classic "
         "durable elegant quiet small large light heavy premium").split()


def make_output(out: Path, rows: int, files: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.write.parts import part_name

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = pa.array([" ".join(rng.choice(WORDS, size=int(rng.integers(20, 40))))
                     for _ in range(2000)])
    per = -(-rows // files)
    for start in range(0, rows, per):
        n = min(per, rows - start)
        ids = pa.array([f"sku-{i:09d}" for i in range(start, start + n)])
        failed = rng.random(n) < 0.01
        table = pa.table({
            "sku": ids,
            "title": pa.array([f"Product {i}" for i in range(start, start + n)]),
            "description": pool.take(pa.array(rng.integers(0, len(pool), n))),
            "rewritten": pa.array(np.where(failed, None, np.asarray(
                pool.take(pa.array(rng.integers(0, len(pool), n))).to_pylist(),
                dtype=object)), pa.string()),
            "finish_reason": pa.array(np.where(failed, None, "stop"), pa.string()),
            "prompt_tokens": pa.array(rng.integers(100, 200, n)),
            "completion_tokens": pa.array(np.where(failed, 0, rng.integers(20, 64, n))),
            "error_kind": pa.array(np.where(failed, "parse_error", None), pa.string()),
            "error": pa.array(np.where(failed, "output did not parse as JSON", None),
                              pa.string()),
        })
        pq.write_table(table, out / part_name(start, start + n), row_group_size=100_000)
    record = {"state": "complete", "rows_total": rows, "started": time.time(),
              "config": {"input": {"path": "products.parquet", "id_column": "sku"},
                         "model": {"name": "none"}, "output": {"column": "rewritten",
                                                               "path": str(out)}}}
    out.with_name(out.name + ".overnight.json").write_text(json.dumps(record))


def main() -> None:
    import httpx
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/overnight-view-bench"))
    args = parser.parse_args()
    out = args.scratch / f"out-{args.rows}"
    if not out.with_name(out.name + ".overnight.json").exists():
        started = time.time()
        make_output(out, args.rows, args.files)
        print(f"wrote {args.rows:,} rows in {time.time() - started:.0f} s", flush=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "view", str(out),
                             "--port", str(port)], cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(base + "/", timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    peak, stop = [0], threading.Event()
    process = psutil.Process(proc.pid)

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    idle = process.memory_info().rss
    asks = [("status", "/api/status", {}),
            ("first page", "/api/rows", {}),
            ("error kind", "/api/rows", {"error_kind": "parse_error"}),
            ("where", "/api/rows", {"where": "prompt_tokens > 190 AND completion_tokens < 25"}),
            ("text search", "/api/rows", {"text": "elegant quiet"}),
            ("middle page", "/api/rows", {"offset": args.rows // 2})]
    answers = []
    for name, path, params in asks:
        started = time.time()
        body = httpx.get(base + path, params=params, timeout=600).json()
        answers.append({"ask": name, "params": params, "seconds": round(time.time() - started, 2),
                        "rows": len(body.get("rows", [])), "matching": body.get("matching"),
                        "rows_done": body.get("rows_done")})
        print(answers[-1], flush=True)
    stop.set()
    sampler.join()
    proc.terminate()
    proc.wait(30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "rows": args.rows,
              "files": args.files, "server_rss_idle_mib": round(idle / 2**20),
              "server_rss_peak_mib": round(peak[0] / 2**20), "answers": answers}
    print(json.dumps(result, indent=2))
    path = REPO / "benchmarks" / "results" / (
        f"view-memory-{args.rows // 1_000_000}m-{result['date']}-{commit}.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
