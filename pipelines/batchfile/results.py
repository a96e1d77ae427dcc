"""The result and error files written from the job's parts, in input order, and committed
as one (a journal, ``WRITTEN``): a kill leaves both files or neither."""

from __future__ import annotations

import heapq
import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.batchfile import anthropic
from pipelines.batchfile.envelopes import chat_message, jsonl, result_line, unfinished_error
from pipelines.batchfile.lines import CUSTOM_ID, LINE, MODEL, Reject, load_line, numbered_lines
from pipelines.storage import Location
from pipelines.write import list_parts, write_atomically
from udfs import columns
from udfs.rows.logprobs import token_bytes_of


# The result and error files are one commit. Both are written to staged names beside their
# targets; then a journal in the work directory names the pair (the commit point); then each is
# renamed into place. A kill at any point leaves either no journal for this pair (the write is
# done again, and nothing in place is ours to refuse) or a journal whose staged files a re-run
# renames in (``finish_write``): never one file of a pair without the other.
WRITTEN = "written.json"  # the journal: in RESULTS.overnight/, beside the job's parts


def work_dir(results: Path) -> Path:
    """Where a result file's job lives: its prepared table, parts and journal."""
    return results.with_name(results.name + ".overnight")


def finish_write(results: Path, errors: Path | None) -> dict | None:
    """A committed write of this pair completed (its staged files renamed into place, which
    a kill may have cut short); its journal, or None when no write of this pair was
    committed, so a file already at these paths is not this work directory's. ``errors``
    None: a Message Batches file's, whose one file holds every result."""
    journal = work_dir(results) / WRITTEN
    try:
        record = json.loads(journal.read_text())
    except (OSError, ValueError):
        return None
    if (record.get("results"), record.get("errors")) != (str(results),
                                                         errors and str(errors)):
        return None
    for staged, target in zip(record["staged"], (results, errors)):
        if target is not None and os.path.exists(staged):
            os.replace(staged, target)
    done = results.exists() and (errors is None or errors.exists())
    return record if done else None


def write_results(job_output: Path, rejected: Path, results: Path, errors: Path | None,
                  model: str, tokenizer: str | None = None,
                  adapters: tuple[str, ...] = (), fmt: str = "openai",
                  unfinished: str | None = None) -> tuple[int, int]:
    """The job's parts -> result lines (in input order); failed rows and rejected lines ->
    error lines (in line order), both committed at once (see WRITTEN). Returns (results,
    errors). A result on a LoRA adapter (one of ``adapters``) names it as its model. ``fmt``
    "anthropic": one file (``errors`` None) of every line's result, in line order. With
    ``unfinished`` ("canceled", "expired" or "errored": a batch stopped before its end), a
    request the job did not reach has a result of that type (Anthropic's), or an error line
    with the hosted Batch API's code for it (``UNFINISHED_CODES``): every request is in one
    of the files, whatever the batch's end."""
    finish_write(results, errors)  # an earlier commit first: its staged files are not leftovers
    for path in (results, errors):  # staged files of writes killed before their commit
        for leftover in path.parent.glob(f".{path.name}.*.staged") if path else ():
            leftover.unlink(missing_ok=True)
    token = uuid.uuid4().hex[:8]
    if fmt == anthropic.FORMAT:
        return _write_anthropic(job_output, rejected, results, token, model, adapters,
                                unfinished)
    staged_ok, staged_errors = _staged(results, token), _staged(errors, token)
    failures = job_output.with_name(job_output.name + ".failed.jsonl")
    ok = failed = 0
    created = int(time.time())
    token_bytes = token_bytes_of(tokenizer)  # a token's bytes, for the logprobs' byte fields
    parts = _parts(job_output)
    with open(staged_ok, "w", encoding="utf-8") as out, \
            open(failures, "w", encoding="utf-8") as fail:
        for part in parts:  # in input order
            for request in _requests(pq.read_table(job_output / part.name)):
                adapter = request[0].get(MODEL)
                line = result_line(request, adapter if adapter in adapters else model,
                                   created, token_bytes)
                target = out if line["error"] is None else fail
                target.write(jsonl(line))
                ok += line["error"] is None
    unreached = (jsonl(unfinished_error(custom_id, unfinished, line)) for line, custom_id
                 in _unreached(job_output, parts)) if unfinished else iter(())
    with open(staged_errors, "w", encoding="utf-8") as out, \
            open(rejected, encoding="utf-8") as a, open(failures, encoding="utf-8") as b:
        for line in heapq.merge(a, b, unreached,
                                key=lambda text: json.loads(text)["error"]["line"]):
            out.write(line)
            failed += 1  # every error line: rejected, failed in the run, or not reached
    _commit(results, errors, (staged_ok, staged_errors), [ok, failed], unfinished)
    failures.unlink()
    return ok, failed


def _requests(part: pa.Table):
    """A part's rows grouped by request (a request with n > 1 has n rows, its samples)."""
    rows = part.to_pylist()
    group: list[dict] = []
    for row in rows:
        if group and row[CUSTOM_ID] != group[0][CUSTOM_ID]:
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def _write_anthropic(job_output: Path, rejected: Path, results: Path, token: str, model: str,
                     adapters: tuple[str, ...], unfinished: str | None) -> tuple[int, int]:
    """A Message Batches file's results: the job's rows and the rejected lines merged in line
    order into one file, committed as the pair is (see WRITTEN); and with ``unfinished``,
    the requests not reached."""
    staged = _staged(results, token)
    counts = [0, 0]  # succeeded, errored
    parts = _parts(job_output)

    def unreached():
        for line, custom_id in _unreached(job_output, parts):
            yield line, anthropic.unfinished(custom_id, unfinished, line)

    def ran():
        for part in parts:  # in input order
            for (row,) in _requests(pq.read_table(job_output / part.name)):  # n is always 1
                if row[columns.ERROR] is not None \
                        and row[columns.ERROR_KIND] != columns.ErrorKind.NO_ANSWER:
                    yield row[LINE], anthropic.errored(row[CUSTOM_ID], row[columns.ERROR_KIND],
                                                       row[columns.ERROR], row[LINE])
                else:
                    adapter = row.get(MODEL)
                    yield row[LINE], anthropic.succeeded(
                        row, adapter if adapter in adapters else model,
                        thinking=columns.REASONING_TOKENS in row, message=chat_message(row))

    def refused():
        with open(rejected, encoding="utf-8") as lines:
            for text in lines:
                error = json.loads(text)
                yield error["error"]["line"], anthropic.errored(
                    error["custom_id"], error["error"]["code"], error["error"]["message"],
                    error["error"]["line"])

    with open(staged, "w", encoding="utf-8") as out:
        streams = (ran(), refused(), *((unreached(),) if unfinished else ()))
        for _, line in heapq.merge(*streams, key=lambda item: item[0]):
            out.write(jsonl(line))
            counts[line["result"]["type"] != "succeeded"] += 1
    _commit(results, None, (staged, None), counts, unfinished)
    return counts[0], counts[1]


def write_unstarted(requests: Path, results: Path, errors: Path | None, unfinished: str) \
        -> tuple[int, int]:
    """A batch stopped before its job prepared anything (cancelled or expired in the queue,
    failed before its start): every line of its file is a request not reached, its error
    line (``errors`` None: a Message Batches file, a result of that type), committed as a
    run's files are. Returns (results, errors): (0, lines)."""
    token = uuid.uuid4().hex[:8]
    staged = (_staged(results, token), errors and _staged(errors, token))
    count = 0
    with open(staged[0], "w", encoding="utf-8") as out, \
            open(staged[1] or os.devnull, "w", encoding="utf-8") as bad:
        for number, raw in numbered_lines(requests):
            try:
                custom_id = load_line(raw).get("custom_id")
            except (Reject, AttributeError):  # not an object: no custom_id to give
                custom_id = None
            custom_id = custom_id if isinstance(custom_id, str) else None
            if errors is None:
                out.write(jsonl(anthropic.unfinished(custom_id, unfinished, number)))
            else:
                bad.write(jsonl(unfinished_error(custom_id, unfinished, number)))
            count += 1
    work_dir(results).mkdir(parents=True, exist_ok=True)
    _commit(results, errors, staged, [0, count], unfinished)
    return 0, count


def _parts(job_output: Path) -> list:
    """The job's committed parts in input order; none where it wrote none yet."""
    return list_parts(Location.of(job_output))[0] if job_output.is_dir() else []


def _unreached(job_output: Path, parts: list):
    """(line, custom_id) of each prepared request no committed part holds, in line order."""
    done = set()
    for part in parts:
        done.update(pq.read_table(job_output / part.name, columns=[LINE])
                    .column(LINE).to_pylist())
    prepared = pq.ParquetFile(job_output.parent / "requests.parquet")
    for group in range(prepared.num_row_groups):
        table = prepared.read_row_group(group, columns=[CUSTOM_ID, LINE])
        for custom_id, line in zip(table.column(CUSTOM_ID).to_pylist(),
                                   table.column(LINE).to_pylist()):
            if line not in done:
                yield line, custom_id


def _commit(results: Path, errors: Path | None, staged: tuple, counts: list[int],
            unfinished: str | None = None) -> None:
    """The staged files synced, the journal naming them written (the commit point), each
    renamed into place (see WRITTEN). ``errors`` None: one file, ``staged`` (file, None).
    ``unfinished``: the files of a batch stopped before its end, which the journal says."""
    for path in staged:
        if path is not None:
            _fsync(path)
    record = {"results": str(results), "errors": errors and str(errors), "counts": counts,
              "staged": [path and str(path) for path in staged], "unfinished": unfinished}
    write_atomically(work_dir(results) / WRITTEN, lambda tmp: tmp.write_text(json.dumps(record)))
    finish_write(results, errors)


def _staged(path: Path, token: str) -> Path:
    return path.with_name(f".{path.name}.{token}.staged")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
