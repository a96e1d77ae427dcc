"""Prometheus metrics of a running job (``overnight run --metrics-port PORT``).

The numbers are the job's own progress (pipelines/job/progress.py), read when Prometheus scrapes:
rows written and failed (by error kind) from the parts the writer commits, tokens generated so
far and engine restarts from the replicas' live counts. Nothing is counted twice or kept apart
from what the progress line shows. Names follow Prometheus' conventions (a unit suffix,
``_total`` on counters, labels for kinds), e.g. ``overnight_rows_total{state="failed"}``.

The alert most teams want is "no progress for N minutes":
``time() - overnight_last_progress_timestamp_seconds > 600 and overnight_job_running == 1``
(docs/guide/monitoring.md has the rule). The endpoint binds to 127.0.0.1 unless told otherwise:
it says how a job goes, not what it holds, but it is the job owner's to expose.
"""

from __future__ import annotations

import time

from pipelines.errors import ConfigError

RATE_WINDOW_S = 60.0  # the generation rate's window


class JobCollector:
    """A prometheus_client collector over one run's Progress."""

    def __init__(self, progress, output: str, model: str):
        self.progress, self.output, self.model = progress, output, model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.progress
        with p.lock:
            done, total, errors = p.done, p.total, p.errors
            by_kind = dict(p.errors_by_kind)
            tokens, prompt = p.tokens, p.prompt_tokens
            live = dict(p.live or {})
            recent = list(p.recent)
            moved, started, finished = p.moved_at, p.start_time, p.finished
        info = GaugeMetricFamily("overnight_job_info", "The job this endpoint reports on.",
                                 labels=["output", "model"])
        info.add_metric([self.output, self.model], 1)
        yield info
        yield GaugeMetricFamily("overnight_job_running", "1 while the job runs, 0 once it "
                                "has ended (done or failed).", value=0 if finished else 1)
        yield GaugeMetricFamily("overnight_job_start_timestamp_seconds", "When the run began "
                                "(Unix time).", value=started)
        yield GaugeMetricFamily("overnight_last_progress_timestamp_seconds", "When rows were "
                                "last written or tokens last generated (Unix time); the run's "
                                "start before either.", value=moved or started)
        yield GaugeMetricFamily("overnight_rows_planned", "Input rows the job covers (with "
                                "the rows an earlier run wrote).", value=total)
        rows = CounterMetricFamily("overnight_rows", "Input rows written, by state: ok, or "
                                   "failed (kept with their error).", labels=["state"])
        rows.add_metric(["ok"], max(done - errors, 0))
        rows.add_metric(["failed"], errors)
        yield rows
        kinds = CounterMetricFamily("overnight_row_errors", "Rows written with an error, by "
                                    "error_kind.", labels=["kind"])
        for kind, n in sorted(by_kind.items()):
            kinds.add_metric([kind], n)
        yield kinds
        generated = CounterMetricFamily("overnight_tokens", "Tokens: prompt and output of the "
                                        "rows written; generated, every output token the "
                                        "engines made so far (rows not yet written too).",
                                        labels=["kind"])
        generated.add_metric(["prompt"], prompt)
        generated.add_metric(["output"], tokens)
        generated.add_metric(["generated"], max(live.get("tokens", 0), tokens))
        yield generated
        yield GaugeMetricFamily("overnight_generation_tokens_per_second", "Output tokens per "
                                "second over the last minute, over every engine.",
                                value=_rate(recent))
        yield CounterMetricFamily("overnight_engine_restarts", "Engines that died and were "
                                  "started again.", value=live.get("restarts", 0))
        yield CounterMetricFamily("overnight_rows_isolated", "Rows set apart as the cause of "
                                  "an engine's death.", value=live.get("isolated", 0))


def _rate(recent: list[tuple[float, int]]) -> float:
    """Tokens per second over the samples of the last RATE_WINDOW_S."""
    if len(recent) < 2:
        return 0.0
    end_t, end_tokens = recent[-1]
    window = [(t, n) for t, n in recent if end_t - t <= RATE_WINDOW_S]
    start_t, start_tokens = window[0]
    if end_t - start_t <= 0 or time.time() - end_t > RATE_WINDOW_S:
        return 0.0
    return round((end_tokens - start_tokens) / (end_t - start_t), 1)


def serve_metrics(progress, output: str, model: str, port: int, host: str = "127.0.0.1"):
    """Start the endpoint (a thread of this process, serving /metrics) for one run; returns a
    ``close()``. A port that cannot be bound is a one-line ConfigError."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(JobCollector(progress, output, model))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port}: "
                          f"{exc.strerror or exc}") from None

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return close
