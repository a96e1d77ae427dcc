"""Prometheus metrics of ``overnight serve`` (``GET /metrics``, behind the server's keys):
batches by status, the queue's depth (batches not started yet), the batches running, and the
requests of every batch by state. Read from the store when scraped; the server keeps no
counts of its own."""

from __future__ import annotations

from serve.store import TERMINAL

STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)


class ServerCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        numbers = self.store.metrics()
        batches = GaugeMetricFamily("overnight_batches", "Batches by status (every key's).",
                                    labels=["status"])
        for status in (*STATUSES, *sorted(set(numbers["batches"]) - set(STATUSES))):
            batches.add_metric([status], numbers["batches"].get(status, 0))
        yield batches
        # waiting: not started yet (up to --max-running-batches run at once, each with its
        # in_progress_at set; this once counted every in_progress batch but one as waiting)
        yield GaugeMetricFamily("overnight_batch_queue_depth", "Batches waiting to start: "
                                "validating, and in_progress but not started.",
                                value=numbers["queued"] + numbers["batches"].get("validating",
                                                                                 0))
        yield GaugeMetricFamily("overnight_batches_running", "Batches whose job runs now "
                                "(in_progress and started).", value=numbers["running"])
        requests = CounterMetricFamily("overnight_batch_requests", "Requests of every batch "
                                       "the store holds, by state (completed, failed).",
                                       labels=["state"])
        for state in ("completed", "failed"):
            requests.add_metric([state], numbers["requests"][state])
        yield requests


def registry_of(store):
    """A registry holding only the server's collector (not the process's default one)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(ServerCollector(store))
    return registry
