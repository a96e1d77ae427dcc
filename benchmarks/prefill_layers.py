"""Where the prefill job's gap to bare vLLM goes, one layer at a time (#24).

    python benchmarks/prefill.py --rows 20000 --max-tokens 1 --repeat 1   # writes the spec
    python benchmarks/prefill_layers.py benchmarks/.work/prefill/spec-1.json

On the prompts prefill.py rendered (its spec-K.json), each in a fresh process, the time of the
generation alone:
  engine     overnight's VLLMEngine (udfs/engines/stepper.py: the stepper thread, requests added
             as slots free) fed 256-request blocks from --threads threads, in a plain process;
  ray-actor  the same inside a Ray actor of 1 CPU, as the pipeline's engine runs (no Ray Data,
             no rendering, no reading or writing).
Bare vLLM on the same prompts is prefill.py's own arm; the whole pipeline, its other arm.
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


def engine_time(spec_path: str, threads: int) -> float:
    """Seconds to generate every prompt through VLLMEngine, blocks of 256 from ``threads``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    from udfs.engines.engine import EngineSpec, GenerationRequest
    from udfs.engines.vllm_engine import VLLMEngine

    spec = json.loads(Path(spec_path).read_text())
    engine = VLLMEngine(EngineSpec("vllm", spec["model"], {
        "max_model_len": 1024, "dtype": spec.get("dtype", "float32"),
        "kv_cache_memory_bytes": 1 << 30, "cpu_threads": os.cpu_count(),
        "structured_outputs": {"backend": "guidance", "disable_any_whitespace": True}}))
    requests = [GenerationRequest(prompt_token_ids=p, max_tokens=k, temperature=0.0,
                                  ignore_eos=True)
                for p, k in zip(spec["prompts"], spec["max_tokens"])]
    blocks = iter([requests[i:i + 256] for i in range(0, len(requests), 256)])
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                block = next(blocks, None)
            if block is None:
                return
            engine.generate(block)

    started = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - started
    engine.close()
    return seconds


def in_ray_actor(spec_path: str, threads: int) -> float:
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    actor = ray.remote(num_cpus=1)(_Actor).remote()
    return ray.get(actor.run.remote(spec_path, threads))


class _Actor:
    def run(self, spec_path: str, threads: int) -> float:
        return engine_time(spec_path, threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--threads", type=int, default=4, help="blocks in flight (the default 4)")
    ap.add_argument("_arm", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._arm:  # a fresh process for one arm
        run = engine_time if args._arm == "engine" else in_ray_actor
        print(json.dumps({"arm": args._arm, "generate_s": run(args.spec, args.threads)}))
        return
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for arm in ("engine", "ray-actor"):
        # the arm right after the spec: argparse takes both positionals in one run
        out = subprocess.run([sys.executable, __file__, args.spec, arm, "--threads",
                              str(args.threads)], capture_output=True, text=True,
                             env=env, cwd=REPO)
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
        print(line)


if __name__ == "__main__":
    main()
