"""What a run shows: the run report, `overnight view` and its filters, `overnight status`, the metrics."""
