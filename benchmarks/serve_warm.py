"""``overnight serve`` warm against cold: what the resident engine saves a team's small batches.

    python benchmarks/serve_warm.py                   # the tiny model, 3-request batches
    python benchmarks/serve_warm.py --model models/smollm2 --requests 20

Four runs, each on the same ``--requests``-request Batch file (chat, greedy, 8 tokens each):
  1. reference: ``overnight batch`` run ``--batches`` times one after another (each loads its
     engine), the way a team without the server runs ten small eval batches;
  2. cold: ``overnight serve --engine per-batch``: the first batch's time from create to its
     output file (the child loads the engine), then a second batch's (it loads it again);
  3. warm: ``overnight serve`` (the resident engine, loaded when the server starts): the
     server's start (the load), then a first and a second batch's create-to-output time;
  4. ten at once: ``--batches`` batches created together on the warm server, time until the
     last is complete, against (1).
Reported: each time and the ratios warm second batch / cold first batch and ten-at-once / ten
one after another (the aim: at most 0.5). Results go to
benchmarks/results/serve-warm-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
KEY = "sk-overnight-benchmark"


def request_file(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({
        "custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 8, "temperature": 0,
                 "messages": [{"role": "user", "content": f"Say something about {i}."}]}})
        + "\n" for i in range(count)))
    return path


class Server:
    def __init__(self, root: Path, config: Path, *args: str):
        from servers import free_port

        self.root, self.port = root, free_port()
        (root / "keys.txt").write_text(KEY + "\n")
        self.args = [sys.executable, "-m", "pipelines.cli", "serve", "--config", str(config),
                     "--data-dir", str(root / "data"), "--port", str(self.port),
                     "--api-keys-file", str(root / "keys.txt"), *args]

    def start(self) -> float:
        """Seconds until the API answers (with the resident engine: after its load)."""
        import httpx

        started = time.monotonic()
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=open(self.root / "log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            assert self.proc.poll() is None, (self.root / "log").read_text()[-2000:]
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/v1/files", timeout=2,
                          headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
                return time.monotonic() - started
            except httpx.HTTPError:
                time.sleep(0.2)

    def stop(self) -> None:
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)

    def batches(self, file: Path, count: int) -> list[float]:
        """``count`` batches of ``file`` created at once: each one's seconds from its create
        to its output file."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY,
                               max_retries=0)
        uploaded = client.files.create(file=file, purpose="batch")
        started = time.monotonic()
        ids = [client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                     endpoint="/v1/chat/completions").id for _ in range(count)]
        done: dict[str, float] = {}
        while len(done) < count:
            for batch_id in ids:
                if batch_id not in done:
                    batch = client.batches.retrieve(batch_id)
                    if batch.status in ("completed", "failed", "cancelled", "expired"):
                        assert batch.status == "completed", batch
                        done[batch_id] = time.monotonic() - started
            time.sleep(0.2)
        return [round(done[b], 2) for b in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "tiny"))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="overnight-serve-warm-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "job.yaml"
    config.write_text(json.dumps({
        "model": {"name": str(Path(args.model).resolve()), "dtype": "float32",
                  "max_model_len": 512},
        "engine": {"kv_cache_memory_bytes": 256 << 20}}))
    file = request_file(work / "requests.jsonl", args.requests)
    result: dict = {"model": args.model, "requests": args.requests, "batches": args.batches}

    sequential = []  # (1) overnight batch, one after another
    for i in range(args.batches):
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "pipelines.cli", "batch", str(file), "-o",
                        str(work / f"seq-{i}.jsonl"), "--model", args.model, "--config",
                        str(config), "--quiet", "--overwrite"], cwd=REPO, check=True,
                       capture_output=True)
        sequential.append(round(time.monotonic() - started, 2))
    result["overnight_batch_one_after_another_s"] = {"each": sequential,
                                                     "total": round(sum(sequential), 2)}
    print("overnight batch, one after another:", result["overnight_batch_one_after_another_s"])

    (work / "cold").mkdir()
    cold = Server(work / "cold", config, "--engine", "per-batch")
    result["cold_server_start_s"] = round(cold.start(), 2)
    result["cold_first_batch_s"] = cold.batches(file, 1)[0]
    result["cold_second_batch_s"] = cold.batches(file, 1)[0]
    cold.stop()
    print("cold (per-batch):", {k: v for k, v in result.items() if k.startswith("cold")})

    (work / "warm").mkdir()
    warm = Server(work / "warm", config)
    result["warm_server_start_s"] = round(warm.start(), 2)  # the resident engine's load
    result["warm_first_batch_s"] = warm.batches(file, 1)[0]
    result["warm_second_batch_s"] = warm.batches(file, 1)[0]
    at_once = warm.batches(file, args.batches)
    warm.stop()
    result["warm_at_once_s"] = {"each": at_once, "last": max(at_once)}
    result["ratio_warm_second_to_cold_first"] = round(
        result["warm_second_batch_s"] / result["cold_first_batch_s"], 3)
    result["ratio_at_once_to_one_after_another"] = round(
        max(at_once) / sum(sequential), 3)
    print("warm (resident):", {k: v for k, v in result.items() if k.startswith(("warm",
                                                                                 "ratio"))})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    result.update(date=time.strftime("%Y-%m-%d"), commit=commit)
    out = REPO / "benchmarks" / "results" / f"serve-warm-{result['date']}-{commit}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
