"""``overnight status OUTPUT``: how far a job got, read from its parts and its record."""

from __future__ import annotations

import time

from pipelines.errors import OutputError
from pipelines.job.summary import RunSummary
from pipelines.order.grouped import running_parts
from pipelines.write import OutputStore, list_parts, summarize_part
from udfs import columns

STATES = {
    "running": "unfinished (running now, or interrupted: run the same job again to resume)",
    "retrying": "re-running rows with errors (interrupted: run with --retry-errors again)",
    "complete": "complete",
    "committing": "committing (interrupted while the output was put in place: run the same "
                  "job again to finish; nothing is generated again)",
}


def output_status(path: str) -> list[str]:
    store = OutputStore(path)
    record = store.read_record()
    if record is None:
        raise OutputError(f"{path!r}: no overnight job record here "
                          f"({store.record.name} is missing)")
    state = record.get("state", "unknown")
    live = state in ("running", "retrying", "committing") and store.staging.exists()
    id_column = record.get("fingerprint", {}).get("input", {}).get("id_column")
    key_column = id_column or columns.ROW_ID
    folder = running_parts(store.staging) if live else store.path
    summary = RunSummary(output=str(store.path))
    for part in list_parts(folder)[0]:
        summary.add_part(summarize_part(folder / part.name, key_column))
    done = summary.input_rows
    total = record.get("rows_total") or done
    errors = ", ".join(f"{k} {v}" for k, v in sorted(summary.errors.items())) or "none"
    started = record.get("started")
    lines = [
        f"output: {store.path}",
        f"state: {STATES.get(state, state)}",
        f"rows: {done}/{total} written ({100 * done / max(total, 1):.0f}%), "
        f"{total - done} left, in {summary.parts} parts",
        f"errors: {sum(summary.errors.values())} ({errors}); skipped: {summary.skipped}",
        f"tokens: {summary.prompt_tokens} in, {summary.completion_tokens} out",
    ]
    if started:
        lines.append("started: " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)))
    return lines



