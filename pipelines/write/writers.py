"""The writers: ``map_batches`` callables (a pool of them) that write what they are handed at
once, one part per run of consecutive whole input rows of one block.

Ray Data may cut a block anywhere between the engine's stage and the writer's, between two
samples of one row too: ``PartWriter`` keeps a row's samples that came without the rest aside, as
a hidden ``.samples-ORDINAL-FIRST.parquet``, and the writer that completes the row writes its
part. So a part always holds whole input rows (the invariant of pipelines/write/__init__.py).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.reuse.request_key import request_keys
from pipelines.storage import Location
from pipelines.write.counts import RECORD_SCHEMA, count_part, read_part, timing
from pipelines.write.parts import SAMPLES_PIECE, part_name, part_range
from udfs import columns

@dataclass(frozen=True)
class PartLayout:
    """Which output columns go where; sent to each writer."""

    staging: Location | str
    source_columns: tuple[str, ...]
    added_columns: tuple[str, ...]  # row_id (when added), the text column, GENERATED
    block_starts: tuple[int, ...]  # first ordinal of every planned block, sorted
    # input rows each block will bring, parallel to block_starts (with --retry-errors: the
    # block's rows to re-run); the retry writer writes a block once all of them have arrived
    block_rows: tuple[int, ...] = ()
    # --retry-errors: the committed output whose rows the re-run rows are merged into
    merge_from: Location | str | None = None
    key_column: str = columns.ROW_ID  # the output column that identifies an input row
    text_column: str = "generated"
    dedupe: bool = False  # drop a sample whose text repeats an earlier sample of its row
    rows_total: int = 0  # the input's rows: the last block ends there
    # a job with steps: write the rows a step's filter dropped too (else only counted)
    keep_dropped: bool = False
    # the Parquet schema metadata of every file written: the job that wrote it
    # (columns.JOB_METADATA), for a job that reads this output as its input
    metadata: tuple[tuple[bytes, bytes], ...] = ()
    # a generate job's request keys (pipelines/reuse/request_key.py): each row's, in request_key
    request_key: object | None = None

    def block_end(self, start: int) -> int:
        i = bisect.bisect_right(self.block_starts, start)
        return self.block_starts[i] if i < len(self.block_starts) else self.rows_total


class Writer:
    def __init__(self, layout: PartLayout):
        self.layout = layout
        self.staging = Location.of(layout.staging)

    def _arrange(self, table: pa.Table) -> pa.Table:
        if columns.ROW_ID in self.layout.added_columns:
            table = table.append_column(columns.ROW_ID, table.column(columns.ORDINAL))
        if self.layout.request_key is not None and columns.REQUEST_KEY not in table.column_names:
            table = table.append_column(columns.REQUEST_KEY,
                                        request_keys(table, self.layout.request_key))
        return table.select([*self.layout.source_columns, *self.layout.added_columns])

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

    def _write(self, name: str, block: pa.Table, part: pa.Table,
               steps: list[dict] | None = None) -> dict:
        """Write a part, with the job's metadata; ``steps``: a job with steps' counts for
        the part's input rows (the rows its filters dropped are not in the part)."""
        meta = dict(self.layout.metadata)
        if steps is not None:
            start, end = part_range(name)
            meta[columns.STEPS_METADATA] = json.dumps(
                {"input_rows": end - start, "steps": steps}).encode()
        if meta:
            part = part.replace_schema_metadata(meta)
        (self.staging / name).write(lambda tmp: pq.write_table(part, tmp))
        counted = count_part(part, self.layout.key_column)
        if counted["steps"] is not None:  # the record is an Arrow row: the counts as JSON
            counted["steps"] = json.dumps(counted["steps"])
        return {"part": name, **timing(block), **counted}

    def _drop(self, block: pa.Table, part: pa.Table) -> pa.Table:
        """A job with steps: the rows its filters dropped left out, unless it keeps them."""
        if columns.DROPPED not in block.column_names or self.layout.keep_dropped:
            return part
        return part.filter(pc.invert(block.column(columns.DROPPED)))


class PartWriter(Writer):
    """``map_batches`` callable (a pool of them): writes what it is handed at once, one part
    per run of consecutive input rows of one block, and returns one small row per part for
    the driver's progress and report. Ray Data may hand a block over in pieces (a GPU stage
    must batch by rows, and a batch can end mid-block): each piece is a part of its own; the
    compaction joins them. A piece handed over again (Ray Data retries a task that failed after
    handing some of its output on) has the same name: written once."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        records = []
        # a job with steps: the batch's per-step counts, kept with its first part
        steps = (json.loads(batch.column(columns.STEP_COUNTS)[0].as_py())
                 if columns.STEP_COUNTS in batch.column_names and batch.num_rows else None)
        batch, pieces = _whole_rows(batch)
        for rows in runs(batch.column(columns.place_column(batch)), self.layout.block_starts):
            records.append(self.write_run(batch.take(rows), steps))
            if steps is not None:
                steps = []  # the batch's other parts: their input rows, no counts again
        for ordinal, piece in pieces:
            block = self._set_aside(ordinal, piece)
            if block is not None:
                records.append(self.write_run(block, [] if steps is not None else None))
        return pa.Table.from_pylist(records, RECORD_SCHEMA)

    def write_run(self, block: pa.Table, steps: list[dict] | None) -> dict:
        """A run of consecutive whole input rows of one block, written as its part."""
        places = block.column(columns.place_column(block))
        first, last = places[0].as_py(), places[-1].as_py()
        part = self._drop(block, self._arrange(block))
        if self.layout.dedupe:
            part = part.take(self._dedupe(part))
        return self._write(part_name(first, last + 1), block, part, steps)

    def _set_aside(self, ordinal: int, piece: pa.Table) -> pa.Table | None:
        """Some of one input row's samples, kept aside in staging until the rest arrive (in
        this writer or another of the pool). Returns the row's samples, all of them in sample
        order, when this piece completes it (its pieces then removed), else None. Two writers
        completing it at once write the same part, whole, under the same name."""
        prefix = SAMPLES_PIECE.format(ordinal, "")
        first = piece.column(columns.SAMPLE_INDEX)[0].as_py()
        (self.staging / f"{prefix}{first:06d}.parquet").write(
            lambda tmp: pq.write_table(piece, tmp))
        names = [n for n in self.staging.names() if n.startswith(prefix)]
        found = []
        for name in names:
            try:
                found.append(read_part(self.staging / name))
            except FileNotFoundError:  # the writer that completed the row removed it
                return None
        block = pa.concat_tables(found, promote_options="permissive")
        index = block.column(columns.SAMPLE_INDEX).to_numpy()
        # a piece staged by an interrupted run, its row now run again: each sample once
        index, keep = np.unique(index, return_index=True)
        if len(index) < piece.column(columns.SAMPLES)[0].as_py():
            return None
        block = block.take(pa.array(keep, pa.int64()))  # (np.unique: in sample order)
        for name in names:
            try:
                (self.staging / name).remove()
            except FileNotFoundError:
                pass
        return block


def _whole_rows(batch: pa.Table) -> tuple[pa.Table, list[tuple[int, pa.Table]]]:
    """The batch's whole input rows, and the rows of which only some samples came, as
    ``(ordinal, its samples here)``. Only rows with several samples can come in pieces (the
    predictor gives each of their rows ``columns.SAMPLES``, the row's sample count)."""
    if columns.SAMPLES not in batch.column_names or batch.num_rows == 0:
        return batch, []
    ordinals = batch.column(columns.ORDINAL).to_numpy()
    expected = batch.column(columns.SAMPLES).to_numpy()
    values, first, counts = np.unique(ordinals, return_index=True, return_counts=True)
    short = values[counts < expected[first]]
    if len(short) == 0:
        return batch, []
    cut = np.isin(ordinals, short)
    pieces = [(int(o), batch.filter(pa.array(ordinals == o))) for o in short]
    return batch.filter(pa.array(~cut)), pieces


def runs(ordinals: pa.ChunkedArray | pa.Array, block_starts: tuple[int, ...]) -> list:
    """The batch's rows as runs of consecutive ordinals within one block, each in input
    order (a row's samples share its ordinal and stay in sample order)."""
    values = np.asarray(ordinals.to_numpy() if isinstance(ordinals, pa.Array)
                        else ordinals.combine_chunks().to_numpy())
    if len(values) == 0:
        return []
    order = np.argsort(values, kind="stable")
    sorted_ = values[order]
    blocks = np.searchsorted(np.asarray(block_starts), sorted_, side="right")
    cuts = np.flatnonzero((np.diff(sorted_) > 1) | (np.diff(blocks) != 0)) + 1
    return [pa.array(rows, pa.int64()) for rows in np.split(order, cuts)]
