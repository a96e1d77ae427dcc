"""--retry-errors: the writer that merges a block's re-run rows into its committed rows.

``OutputStore.open_retry`` (pipelines/write/store.py) stages each block with errors as its
committed rows (a hidden ``.retry-START.parquet``); ``RetryWriter`` gathers the block's re-run
rows until all have arrived, whole (every sample), and writes the block's part with the new rows
in place of the old, in input order.
"""

from __future__ import annotations

import bisect

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.write.counts import RECORD_SCHEMA, count_part, read_part
from pipelines.write.parts import RETRY_OLD, input_offsets, part_name
from pipelines.write.writers import PartLayout, Writer
from udfs import columns

class RetryWriter(Writer):
    """``map_batches`` callable (one actor) for --retry-errors: a block's re-run rows are
    gathered until all have arrived, then merged with the block's committed rows (staged by
    ``OutputStore.open_retry``) and written as the block's part."""

    def __init__(self, layout: PartLayout):
        super().__init__(layout)
        self.expected = dict(zip(layout.block_starts, layout.block_rows))
        self.pending: dict[int, list[pa.Table]] = {}
        # of each block, the samples arrived: {ordinal: {sample index}}; a row is whole once
        # all of its samples have (Ray Data may cut a block between two of them)
        self.arrived: dict[int, dict[int, set[int]]] = {}
        self.whole: dict[int, int] = {}  # of each block, its rows arrived whole
        self.written: set[int] = set()

    def __call__(self, batch: pa.Table) -> pa.Table:
        ordinals = batch.column(columns.ORDINAL).to_pylist()
        samples = (batch.column(columns.SAMPLE_INDEX).to_pylist()
                   if columns.SAMPLES in batch.column_names else [0] * len(ordinals))
        counts = (batch.column(columns.SAMPLES).to_pylist()
                  if columns.SAMPLES in batch.column_names else [1] * len(ordinals))
        starts = self.layout.block_starts
        blocks: dict[int, list[int]] = {}
        for i, ordinal in enumerate(ordinals):
            blocks.setdefault(starts[bisect.bisect_right(starts, ordinal) - 1], []).append(i)
        records = []
        for start, rows in sorted(blocks.items()):
            # samples handed over again after a retried task: never merged twice
            seen = self.arrived.setdefault(start, {})
            rows = [i for i in rows if samples[i] not in seen.get(ordinals[i], ())]
            if start in self.written or not rows:
                continue
            self.pending.setdefault(start, []).append(batch.take(rows))
            for i in rows:
                got = seen.setdefault(ordinals[i], set())
                got.add(samples[i])
                if len(got) == counts[i]:
                    self.whole[start] = self.whole.get(start, 0) + 1
            if self.whole.get(start, 0) < self.expected[start]:
                continue
            del self.whole[start]
            pieces = self.pending.pop(start)
            del self.arrived[start]
            block = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            if len(pieces) > 1:  # input order, each row's samples in sample order
                keys = [(columns.ORDINAL, "ascending")] + (
                    [(columns.SAMPLE_INDEX, "ascending")]
                    if columns.SAMPLES in block.column_names else [])
                block = block.take(pc.sort_indices(block, sort_keys=keys))
            part = self._arrange(block)
            if self.layout.dedupe:  # the block too: _merge reads its ordinals row for row
                keep = self._dedupe(part)
                block, part = block.take(keep), part.take(keep)
            rerun = part
            part = self._merge(start, block.column(columns.ORDINAL), part)
            record = self._write(part_name(start, self.layout.block_end(start)), block, part)
            # the run's progress and report count the rows it generated, not the rows kept
            # (the merged part's): a retry of 9 rows once showed "rows 12/9 (133%)"
            records.append({**record, **count_part(rerun, self.layout.key_column)})
            self.written.add(start)
        return pa.Table.from_pylist(records, RECORD_SCHEMA)

    def _merge(self, start: int, ordinals: pa.Array, rows: pa.Table) -> pa.Table:
        """The block's committed rows with ``rows`` (re-run) in place of the old ones."""
        old = read_part(self.staging / RETRY_OLD.format(start))
        old_offsets = input_offsets(old.column(self.layout.key_column).to_pylist())
        positions = [o - start for o in ordinals.to_pylist()]  # re-run input rows
        taken = set(positions)
        keep = [i for i, offset in enumerate(old_offsets) if offset not in taken]
        # (typed: an empty list would be a null array, which take() refuses)
        merged = pa.concat_tables([old.take(pa.array(keep, pa.int64())), rows.cast(old.schema)])
        # stable sort by input row: a row's samples stay in sample order
        order = pc.sort_indices(pa.array([old_offsets[i] for i in keep] + positions))
        return merged.take(order)
