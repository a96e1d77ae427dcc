"""Prometheus metrics of ``overnight serve`` (``GET /metrics``, behind the server's keys):
batches by status, the queue's depth, and the requests of every batch by state. Read from the
store when scraped; the server keeps no counts of its own."""

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
        # in_progress batches run one at a time, oldest first: the others wait behind it
        waiting = max(numbers["batches"].get("in_progress", 0) - 1, 0)
        yield GaugeMetricFamily("overnight_batch_queue_depth", "Batches waiting to run: "
                                "in_progress behind the one running, and validating.",
                                value=waiting + numbers["batches"].get("validating", 0))
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
