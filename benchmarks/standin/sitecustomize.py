"""A stand-in for the vLLM engine, for benchmarks/scale.py only (never shipped): on the
PYTHONPATH of an ``overnight run`` with OVERNIGHT_BENCH_STANDIN=1, Python imports this in every
process of the job (the driver, Ray's workers), and ``udfs.engines.vllm_engine.VLLMEngine`` becomes a
class that is built at once, imports no vllm, and answers every request instantly with
``max_tokens`` tokens of text: only the pipeline around the engine is left to measure.

OVERNIGHT_BENCH_REQUESTS=FILE: each ``generate`` call appends its request count to FILE (one
``write`` a block), so a resumed run shows which rows reached the engine again.
OVERNIGHT_BENCH_MAXRSS=DIR: each process writes its peak RSS (``VmHWM``) to DIR/PID at exit
(processes Ray kills write nothing; the driver always does).
"""

import os

if os.environ.get("OVERNIGHT_BENCH_STANDIN") == "1":
    import udfs.engines.vllm_engine as engine_module
    from udfs.engines.engine import GenerationResult

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
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so a process started by a
        # large parent (the benchmark holding a 10M-row table) would report the parent's size
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        folder = os.environ["OVERNIGHT_BENCH_MAXRSS"]
        with open(os.path.join(folder, str(os.getpid())), "w") as handle:
            handle.write(str(kib * 1024))

    atexit.register(_peak_rss)

if os.environ.get("OVERNIGHT_BENCH_DRIVER_TRACE"):
    import sys

    # the driver only (``python -m pipelines.cli run``): its RSS every few seconds; with
    # OVERNIGHT_BENCH_DRIVER_TRACE_PY=1 also Python's own allocations, and at exit the sites
    # holding the most (tracemalloc slows the driver's imports many times over)
    if any(a.endswith("pipelines.cli") or a.endswith("pipelines/cli.py") for a in sys.argv) \
            or sys.argv[:1] == ["-m"]:
        import atexit
        import threading
        import time
        import tracemalloc

        python = os.environ.get("OVERNIGHT_BENCH_DRIVER_TRACE_PY") == "1"
        if python:
            tracemalloc.start(8)
        _trace = open(os.environ["OVERNIGHT_BENCH_DRIVER_TRACE"], "a")
        _t0 = time.time()

        def _rss_mib() -> float:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        def _sample() -> None:
            while True:
                current = tracemalloc.get_traced_memory()[0] if python else 0
                _trace.write(f"t {time.time() - _t0:.1f} rss_mib {_rss_mib():.1f} "
                             f"python_mib {current / 2**20:.1f}\n")
                _trace.flush()
                time.sleep(float(os.environ.get("OVERNIGHT_BENCH_DRIVER_TRACE_EVERY", "5")))

        threading.Thread(target=_sample, daemon=True).start()

        def _top() -> None:
            snapshot = tracemalloc.take_snapshot()
            for stat in snapshot.statistics("traceback")[:12]:
                _trace.write(f"{stat.size / 2**20:.1f} MiB in {stat.count} blocks:\n")
                for line in stat.traceback.format()[-8:]:
                    _trace.write(f"    {line}\n")
            _trace.flush()

        if python:
            atexit.register(_top)
