"""Writing the output: Parquet parts committed one block at a time, the dataset committed once.

While a job runs, its parts go to a staging directory beside the output, ``OUTPUT.partial/``,
each written to a temporary name and renamed into place, so a part is either whole or absent.
A part holds exactly one input block and is named by the block's first ordinal
(``part-000000000256.parquet``): the names alone say which rows are done, and sort in input
order. When every block is written, the staging directory is renamed to the output path. A
crash at any moment leaves either the old state or the new one; the next run of the same job
picks up the parts already there.

On an object store (``s3://``, ``gs://``: see pipelines/storage.py) each part is one upload,
whole or absent, but a directory cannot be renamed: the commit copies the staged parts into
place, and only then marks the record complete. The record says which state the output is in; a
run interrupted during the commit finishes it when run again.

The output directory holds Parquet parts and nothing else, so that ``pl.read_parquet(OUTPUT)``
and ``pq.read_table(OUTPUT)`` both read it. The job's own record (its fingerprint, state and
summary) is a file beside it, ``OUTPUT.overnight.json``.
"""

from __future__ import annotations

import bisect
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.errors import OutputError
from pipelines.storage import Location, scrub_record
from udfs import columns

PART_PREFIX, PART_SUFFIX = "part-", ".parquet"


def part_name(ordinal: int) -> str:
    return f"{PART_PREFIX}{ordinal:012d}{PART_SUFFIX}"


def part_ordinal(name: str) -> int | None:
    if name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX):
        digits = name[len(PART_PREFIX):-len(PART_SUFFIX)]
        if digits.isdigit():
            return int(digits)
    return None


def write_atomically(path: Path | Location, write) -> None:
    """Call ``write(tmp_path)``, then put the file at ``path`` whole (fsync and rename on a
    local disk, one upload on an object store): whole or absent."""
    Location.of(path).write(write)


@dataclass(frozen=True)
class PartLayout:
    """Which output columns go where; sent to each writer task."""

    staging: Location | str
    source_columns: tuple[str, ...]
    added_columns: tuple[str, ...]  # row_id (when added), the text column, GENERATED
    block_starts: tuple[int, ...]  # first ordinal of every planned block, sorted
    # input rows each block will bring, parallel to block_starts (with --retry-errors: the
    # block's rows to re-run); a part is written once all of them have arrived
    block_rows: tuple[int, ...] = ()
    # --retry-errors: the committed output whose parts the re-run rows are merged into
    merge_from: Location | str | None = None
    key_column: str = columns.ROW_ID  # the output column that identifies an input row
    text_column: str = "generated"
    dedupe: bool = False  # drop a sample whose text repeats an earlier sample of its row


def input_offsets(keys: list) -> list[int]:
    """For each row of a part, which of the block's input rows it belongs to. A part holds
    its input rows in order, each as a run of one or more rows (its samples) sharing a key."""
    offsets, current = [], -1
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1]:
            current += 1
        offsets.append(current)
    return offsets


RECORD_SCHEMA = pa.schema([
    ("part", pa.string()), ("replica", pa.string()), ("ready_at", pa.float64()),
    ("done_at", pa.float64()), ("written_at", pa.float64()), ("input_rows", pa.int64()),
    ("rows", pa.int64()), ("errors", pa.string()), ("skipped", pa.int64()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64())])


class PartWriter:
    """``map_batches`` callable (one actor): writes each block as one part once all its rows
    have arrived, and returns one small row per part written for the driver's progress and
    summary. Ray Data may hand a block over in pieces (a GPU stage must batch by rows, and a
    batch can end mid-block), so rows wait here until their block is whole."""

    def __init__(self, layout: PartLayout):
        self.layout = layout
        self.staging = Location.of(layout.staging)
        self.expected = dict(zip(layout.block_starts, layout.block_rows))
        self.pending: dict[int, list[pa.Table]] = {}
        self.arrived: dict[int, set[int]] = {}
        self.written: set[int] = set()  # blocks whose part this writer wrote

    def _arrange(self, table: pa.Table) -> pa.Table:
        if columns.ROW_ID in self.layout.added_columns:
            table = table.append_column(columns.ROW_ID, table.column(columns.ORDINAL))
        return table.select([*self.layout.source_columns, *self.layout.added_columns])

    def __call__(self, batch: pa.Table) -> pa.Table:
        ordinals = batch.column(columns.ORDINAL).to_pylist()
        starts = self.layout.block_starts
        blocks: dict[int, list[int]] = {}
        for i, ordinal in enumerate(ordinals):
            blocks.setdefault(starts[bisect.bisect_right(starts, ordinal) - 1], []).append(i)
        records = []
        for start, rows in sorted(blocks.items()):
            # Rows that arrived before come again when Ray Data retries a task that failed
            # after handing some of its output on: never write a row twice. (A row's samples
            # travel together, in one batch, so its ordinal stands for all of them.)
            seen = self.arrived.setdefault(start, set())
            rows = [i for i in rows if ordinals[i] not in seen]
            if start in self.written or not rows:
                continue
            self.pending.setdefault(start, []).append(batch.take(rows))
            seen.update(ordinals[i] for i in rows)
            if len(seen) < self.expected[start]:
                continue
            pieces = self.pending.pop(start)
            del self.arrived[start]
            block = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            if len(pieces) > 1:  # input order; a row's samples keep theirs (stable sort)
                block = block.take(pc.sort_indices(block.column(columns.ORDINAL)))
            part = self._arrange(block)
            if self.layout.dedupe:  # the block too: _merge reads its ordinals row for row
                keep = self._dedupe(part)
                block, part = block.take(keep), part.take(keep)
            if self.layout.merge_from is not None:
                part = self._merge(start, block.column(columns.ORDINAL), part)
            (self.staging / part_name(start)).write(
                lambda tmp, part=part: pq.write_table(part, tmp))
            self.written.add(start)
            records.append({"part": part_name(start), **_timing(block),
                            **count_part(part, self.layout.key_column)})
        return pa.Table.from_pylist(records, RECORD_SCHEMA)


    def _merge(self, start: int, ordinals: pa.Array, rows: pa.Table) -> pa.Table:
        """The committed part of this block with ``rows`` (re-run) in place of the old ones."""
        old = read_part(Location.of(self.layout.merge_from) / part_name(start))
        old_offsets = input_offsets(old.column(self.layout.key_column).to_pylist())
        positions = [o - start for o in ordinals.to_pylist()]  # re-run input rows
        taken = set(positions)
        keep = [i for i, offset in enumerate(old_offsets) if offset not in taken]
        # (typed: an empty list would be a null array, which take() refuses)
        merged = pa.concat_tables([old.take(pa.array(keep, pa.int64())), rows.cast(old.schema)])
        # stable sort by input row: a row's samples stay in sample order
        order = pc.sort_indices(pa.array([old_offsets[i] for i in keep] + positions))
        return merged.take(order)

    def _dedupe(self, part: pa.Table) -> list[int]:
        """The rows to keep: the first of identical generations of one input row (samples
        without text, failed the same way, count as identical), so every input row keeps one
        row or more."""
        keys = part.column(self.layout.key_column).to_pylist()
        texts = part.column(self.layout.text_column).to_pylist()
        seen, keep = set(), []
        for i, (key, text) in enumerate(zip(keys, texts)):
            if (key, text) not in seen:
                keep.append(i)
                seen.add((key, text))
        return keep


def _timing(block: pa.Table) -> dict:
    """Which replica generated the block, and when (the predictor's columns)."""
    if columns.REPLICA not in block.column_names:
        return {"replica": None, "ready_at": None, "done_at": None, "written_at": time.time()}
    return {"replica": block.column(columns.REPLICA)[0].as_py(),
            "ready_at": pc.min(block.column(columns.READY_AT)).as_py(),
            "done_at": pc.max(block.column(columns.DONE_AT)).as_py(),
            "written_at": time.time()}


COUNTED = [columns.ERROR_KIND, columns.FINISH_REASON, columns.PROMPT_TOKENS,
           columns.COMPLETION_TOKENS]


def summarize_part(path: Location, key_column: str) -> dict:
    """``count_part`` of a written part, reading only the columns it counts."""
    return count_part(read_part(path, columns=[*COUNTED, key_column]), key_column)


def read_part(path: Location, columns: list[str] | None = None) -> pa.Table:
    with path.open() as handle:
        return pq.read_table(handle, columns=columns)


def count_part(part: pa.Table, key_column: str) -> dict:
    """What the summary adds up: input rows, output rows (samples), errors by kind, skipped
    rows, tokens."""
    kinds = part.column(columns.ERROR_KIND).to_pylist()
    errors: dict[str, int] = {}
    for kind in kinds:
        if kind is not None:
            errors[kind] = errors.get(kind, 0) + 1
    keys = part.column(key_column).to_pylist()
    return {
        "input_rows": input_offsets(keys)[-1] + 1 if keys else 0,
        "rows": part.num_rows,
        "errors": json.dumps(errors),
        "skipped": part.column(columns.FINISH_REASON).to_pylist().count(
            columns.FinishReason.SKIPPED),
        "prompt_tokens": pc.sum(part.column(columns.PROMPT_TOKENS)).as_py() or 0,
        "completion_tokens": pc.sum(part.column(columns.COMPLETION_TOKENS)).as_py() or 0,
    }


class OutputStore:
    """The output path, its staging directory and its job record; the rules for starting
    over, resuming and committing. Paths may be local or on an object store."""

    def __init__(self, path: str | Location):
        if isinstance(path, (str, os.PathLike)) and os.path.islink(path):
            # a link to the real output folder: work beside what it points to, so the commit
            # renames real folders and the link keeps pointing at the output
            path = os.path.realpath(path)
        self.path = Location.of(path)
        self.staging = self.path.sibling(".partial")
        self.record = self.path.sibling(".overnight.json")

    def read_record(self) -> dict | None:
        try:
            return json.loads(self.record.read_text())
        except FileNotFoundError:
            return None

    def write_record(self, record: dict) -> None:
        self.path.parent.mkdir()
        self.record.write_text(json.dumps(scrub_record(record), indent=2, default=str))

    def open(self, fingerprint: dict, *, overwrite: bool, rows_total: int = 0) -> set[int]:
        """Prepare staging for this job; return the first ordinals of blocks already written."""
        record = self.read_record() or {}
        if self.staging.exists() and record.get("state") in ("running", "committing"):
            # An unfinished run. Of this job: resume it, with or without --overwrite (the
            # command that started it may have had the flag; "the same command resumes").
            changed = diff_fingerprints(record.get("fingerprint", {}), fingerprint)
            if not changed:
                return self.done_blocks()
            if not overwrite:
                raise OutputError(
                    f"{self.staging} holds an unfinished run of a different job "
                    f"({', '.join(changed)} changed); pass --overwrite to discard it, "
                    "or choose another output.path")
        elif self.path.exists() and not overwrite:
            raise OutputError(f"output.path {str(self.path)!r} already exists; "
                              "pass --overwrite to replace it, or choose another path")
        self.staging.remove()
        self.staging.mkdir()
        self.write_record({"state": "running", "started": time.time(),
                           "rows_total": rows_total, "fingerprint": fingerprint})
        return set()

    def open_retry(self, fingerprint: dict, key_column: str) -> dict[int, list[int]]:
        """Stage a re-run of the rows with errors in the committed output. Parts without
        errors are linked (copied, on an object store) into staging unchanged; returns
        {block start: input positions}."""
        record = self.read_record()
        # "retrying": an interrupted retry; the committed output is untouched, start it again
        if not self.path.exists() or not record or record.get("state") not in ("complete",
                                                                                 "retrying"):
            raise OutputError(f"--retry-errors: {str(self.path)!r} is not a completed output "
                              "of this job; run it first")
        changed = diff_fingerprints(record.get("fingerprint", {}), fingerprint)
        if changed:
            raise OutputError(f"--retry-errors: {self.path} was written by a different job "
                              f"({', '.join(changed)} changed)")
        self.staging.remove()
        self.staging.mkdir()
        retry: dict[int, list[int]] = {}
        for name in self.path.names():
            start = part_ordinal(name)
            if start is None:
                continue
            part = read_part(self.path / name, columns=[key_column, columns.ERROR])
            offsets = input_offsets(part.column(key_column).to_pylist())
            failed = sorted({offsets[i] for i, e in enumerate(part.column(1).to_pylist())
                             if e is not None})
            if failed:
                retry[start] = failed
            else:
                (self.path / name).copy_to(self.staging / name)
        self.write_record({**record, "state": "retrying", "retry_started": time.time()})
        return retry

    def discard(self) -> None:
        """The output, its staging folder and its record, removed."""
        for where in (self.path, self.staging, self.record):
            where.remove()

    def done_blocks(self) -> set[int]:
        found = (part_ordinal(name) for name in self.staging.names())
        return {o for o in found if o is not None}

    def commit(self, record: dict) -> None:
        """Make the staged parts the output, then record the job as complete. On a local
        disk that is one rename; on an object store, a copy of each part, after which the
        record turns complete (an interrupted copy is redone by the next run)."""
        for name in self.staging.names():  # temporaries left by a killed earlier run
            if part_ordinal(name) is None:
                (self.staging / name).remove()
        if self.path.local:
            old = None
            if self.path.exists():
                old = self.path.with_name(f".{self.path.name}.replaced-{uuid.uuid4().hex[:8]}")
                self.path.rename_to(old)
            self.staging.rename_to(self.path)
            if old is not None:
                old.remove()
        else:
            self.write_record({**record, "state": "committing"})
            self.path.remove()
            self.path.mkdir()
            for name in self.staging.names():
                (self.staging / name).copy_to(self.path / name)
        self.write_record({**record, "state": "complete", "finished": time.time()})
        self.staging.remove()  # on a local disk, already gone


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """The top-level keys whose values differ, e.g. ['sampling', 'input files']."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
