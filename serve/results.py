"""A batch's results: counted from its job's committed parts while it runs, delivered from
them when it stops early (cancelled, expired, failed), and registered as the batch's files,
with its final status and counts, when it ends."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipelines.storage import Location
from pipelines.write import list_parts
from serve.store import ERRORS, INPUT, RESULTS, Store

log = logging.getLogger("overnight.serve")


def update_counts(store: Store, batch_id: str,
                  counted: dict[str, tuple[int, int]]) -> None:
    """The running batch's ``request_counts``, from its job's committed parts; ``counted``:
    each part's counts (part path -> (requests, failed)), so that a part is read once."""
    work = store.batch_dir(batch_id) / f"{RESULTS}.overnight"
    parts_dir = work / "output.partial"
    if not parts_dir.is_dir():
        parts_dir = work / "output"
    done = failed = 0
    for found in list_parts(Location.of(parts_dir))[0] if parts_dir.is_dir() else []:
        part = parts_dir / found.name  # superseded parts (mid-compaction) not counted
        key = str(part)
        if key not in counted:
            try:
                table = pq.read_table(part, columns=["custom_id", "error"])
            except FileNotFoundError:  # the job committed (moved its parts) meanwhile
                return
            ids = table.column("custom_id").to_pylist()
            bad = {i for i, e in zip(ids, table.column("error").to_pylist()) if e}
            counted[key] = (len(set(ids)), len(bad))
        done += counted[key][0]
        failed += counted[key][1]
    prepared = work / "prepared.json"
    rejected = json.loads(prepared.read_text())["rejected"] if prepared.exists() else 0
    counts = {"total": store.get_batch(None, batch_id)["request_counts"]["total"],
              "completed": done - failed, "failed": failed + rejected}
    store.update_batch(batch_id, only_if=("in_progress",), request_counts=counts)


def deliver(store: Store, batch_id: str, unfinished: str, *, model: str,
            served_model: str) -> None:
    """The result and error files of the parts committed so far, unless the pair is
    already written (one commit: pipelines.batchfile.results.finish_write). Every request is in
    them: those not reached are ``unfinished`` (canceled, expired, errored), as
    Anthropic reports them in a message batch's one file, and as the hosted Batch API
    lists them in the error file (``batch_cancelled``, ``batch_expired``, and
    ``batch_failed`` where the job could not go on)."""
    from pipelines.batchfile.results import finish_write, write_results, write_unstarted

    folder = store.batch_dir(batch_id)
    errors = errors_file(store.get_batch(None, batch_id), folder)
    anthropic = errors is None
    work = folder / f"{RESULTS}.overnight"
    parts = work / "output.partial"
    if not parts.is_dir():
        parts = work / "output"
    if finish_write(folder / RESULTS, errors) is not None:
        return
    if (work / "rejected.jsonl").exists() and (work / "requests.parquet").exists():
        write_results(parts, work / "rejected.jsonl", folder / RESULTS, errors,
                      served_model, tokenizer=model,
                      fmt="anthropic" if anthropic else "openai", unfinished=unfinished)
    elif (folder / INPUT).exists():  # never started: every request is unfinished
        write_unstarted(folder / INPUT, folder / RESULTS, errors, unfinished)


def finalize(store: Store, batch_id: str, status: str, *,
             only_if: tuple[str, ...] = ("finalizing",), **extra) -> None:
    """Register the result and error files (idempotent: their ids derive from the batch's)
    and move the batch from one of ``only_if`` to ``status`` with the final counts."""
    batch = store.get_batch(None, batch_id)
    owner = store.batch_owner(batch_id)
    folder = store.batch_dir(batch_id)
    changes: dict = {"status": status, f"{status}_at": int(time.time())}
    counts = dict(batch.get("request_counts") or {"total": 0})
    if batch.get("api") == "anthropic":  # its results are its own (serve/anthropic.py)
        from pipelines.batchfile.anthropic import count_results

        found = changes["result_counts"] = count_results(folder / RESULTS)
        counts.update(completed=found.get("succeeded", 0),
                      failed=sum(found.values()) - found.get("succeeded", 0))
        changes["request_counts"] = counts
        if store.update_batch(batch_id, only_if=only_if, **changes, **extra):
            log.info("batch %s: %s (%s)", batch_id, status, found)
        return
    for name, key, label, count_key in ((RESULTS, "output_file_id", "output", "completed"),
                                        (ERRORS, "error_file_id", "error", "failed")):
        path = folder / name
        lines = _count_lines(path) if path.exists() else 0
        counts[count_key] = lines
        if lines and not batch.get(key):
            file_id = "file-" + hashlib.sha256(f"{batch_id}:{label}".encode()).hexdigest()[:24]
            store.add_file(owner, path, f"{batch_id}_{label}.jsonl", "batch_output",
                           file_id=file_id, link=True)
            changes[key] = file_id
    # every request is in one of the files (its lines); a batch cancelled before it was
    # validated has no total yet: its lines are its requests
    counts["total"] = max(counts.get("total") or 0, counts["completed"] + counts["failed"])
    changes["request_counts"] = counts
    if store.update_batch(batch_id, only_if=only_if, **changes, **extra) is None:
        return  # moved by someone else first (a cancel): that status stands
    log.info("batch %s: %s (%d completed, %d failed)", batch_id, status,
             counts["completed"], counts["failed"])


def errors_file(batch: dict, folder: Path) -> Path | None:
    """A batch's error file; None for a message batch, whose one file holds every result."""
    return None if batch.get("api") == "anthropic" else folder / ERRORS


def one_error(code: str, message: str) -> dict:
    """A batch's ``errors`` holding one error, as the hosted API lists them."""
    return {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                        "line": None}]}


def _count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())
