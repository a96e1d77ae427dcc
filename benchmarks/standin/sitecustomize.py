"""A stand-in for the vLLM engine, for benchmarks/scale.py only (never shipped): on the
PYTHONPATH of an ``overnight run`` with OVERNIGHT_BENCH_STANDIN=1, Python imports this in every
process of the job (the driver, Ray's workers), and ``udfs.vllm_engine.VLLMEngine`` becomes a
class that is built at once, imports no vllm, and answers every request instantly with
``max_tokens`` tokens of text: only the pipeline around the engine is left to measure.

OVERNIGHT_BENCH_REQUESTS=FILE: each ``generate`` call appends its request count to FILE (one
``write`` a block), so a resumed run shows which rows reached the engine again.
OVERNIGHT_BENCH_MAXRSS=DIR: each process writes its peak RSS (``ru_maxrss``) to DIR/PID at exit
(processes Ray kills write nothing; the driver always does).
"""

import os

if os.environ.get("OVERNIGHT_BENCH_STANDIN") == "1":
    import udfs.vllm_engine as engine_module
    from udfs.engine import GenerationResult

    WORDS = "label " * 64

    class StandInEngine:
        """The engine seam's interface, with no model behind it."""

        cpu_threads = None
        dtype = "stand-in"

        def __init__(self, spec):
            self.requests = self.tokens = 0
            path = os.environ.get("OVERNIGHT_BENCH_REQUESTS")
            self._log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if path else None

        def generate(self, requests):
            out = [GenerationResult(text=WORDS[:6 * r.max_tokens].strip(),
                                    finish_reason="length", completion_tokens=r.max_tokens)
                   for r in requests]
            self.requests += len(out)  # several blocks' threads: a count, not an invariant
            self.tokens += sum(r.max_tokens for r in requests)
            if self._log is not None:
                os.write(self._log, f"{len(out)}\n".encode())
            return out

        def progress(self):
            return {"requests": self.requests, "tokens_finished": self.tokens,
                    "tokens": self.tokens, "requests_seen": self.requests,
                    "cap_seen": self.tokens, "cap_finished": self.tokens}

        def stalled_for(self):
            return 0.0

        def close(self):
            if self._log is not None:
                os.close(self._log)
                self._log = None

    engine_module.VLLMEngine = StandInEngine

if os.environ.get("OVERNIGHT_BENCH_MAXRSS"):
    import atexit

    def _peak_rss() -> None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        folder = os.environ["OVERNIGHT_BENCH_MAXRSS"]
        with open(os.path.join(folder, str(os.getpid())), "w") as handle:
            handle.write(str(kib * 1024))

    atexit.register(_peak_rss)
