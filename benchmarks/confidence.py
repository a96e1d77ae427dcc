"""What confidence costs: a structured.choice generation with and without the top logprobs
the confidence column asks for, on one engine, in one process.

    python benchmarks/confidence.py                  # 1,000 prompts, 3 rounds of each arm
    python benchmarks/confidence.py --rows 200 --repeat 1

Both arms run ``LLM.generate`` on the same prompts with the same choice grammar (guidance,
no free whitespace, as a job runs it), greedy; the second also asks for the top K logprobs
of every token, K as pre-flight computes it (udfs/logprobs.confidence_top_k: the labels'
total length + 1). Arms alternate, so load on a shared machine falls on both. Reported: each
round's wall and CPU seconds (this process, the engine's threads included), the medians and
their ratios (with / without). On a loaded machine the wall seconds of one arm varied 2x from
round to round; the CPU seconds vary less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--labels", default="positive,negative,mixed")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="overnight-confidence-"))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "vllm-cache"))

    import vllm
    from transformers import AutoTokenizer
    from vllm.sampling_params import StructuredOutputsParams

    from pipelines.tools.tiny_model import build_tiny_model
    from udfs.rows.logprobs import confidence_top_k

    model = str(build_tiny_model(scratch / "tiny"))
    labels = args.labels.split(",")
    top = confidence_top_k(labels)
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = vllm.LLM(model=model, dtype="float32", max_model_len=512,
                   kv_cache_memory_bytes=256 << 20, enforce_eager=True,
                   enable_chunked_prefill=False, max_logprobs=max(20, top),
                   structured_outputs_config={"backend": "guidance",
                                              "disable_any_whitespace": True})
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=tokenizer.encode(
        f"Review {i}: the kettle boils fast and looks fine. " * 4)) for i in range(args.rows)]
    choice = StructuredOutputsParams(choice=labels)
    arms = {"without": vllm.SamplingParams(temperature=0, max_tokens=12,
                                           structured_outputs=choice),
            f"with top {top}": vllm.SamplingParams(temperature=0, max_tokens=12,
                                                   structured_outputs=choice, logprobs=top)}
    llm.generate(prompts[:50], arms["without"], use_tqdm=False)  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeat):
        for name, params in arms.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs) / len(outputs)
    for what, seconds in (("wall", wall), ("cpu", cpu)):
        for name, values in seconds.items():
            print(f"{what} {name:>14}: {', '.join(f'{s:.2f}' for s in values)} s; "
                  f"median {statistics.median(values):.2f} s")
        without, with_ = (statistics.median(v) for v in seconds.values())
        print(f"{what} ratio with/without: {with_ / without:.3f}")
    print(f"({args.rows} prompts, {tokens:.1f} tokens each, labels {labels})")


if __name__ == "__main__":
    main()
