"""Reading the planned blocks into Ray Data: a datasource whose read tasks each cover a run of
blocks (``ReadUnit``), reading a Parquet file's row groups or a JSONL file's byte range as it
streams, in input order, skipping the blocks a resumed job has written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import ray.data
from ray.data import ExecutionResources
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipelines.read.files import parquet_file
from pipelines.read.scan import BOM, Block, InputPlan, blank, loads
from pipelines.read.schema import JSON_TEXT, conform
from pipelines.read.sizes import ray_block_rows, read_ahead_bytes, reads_at_once
from udfs import columns
from udfs.stages.memory import release_memory


def read_block(block: Block, schema: pa.Schema) -> pa.Table:
    """The rows of one block, cast to the input's schema, with their ordinals (pre-flight's
    samples; a job reads whole units)."""
    return next(read_unit(ReadUnit((block,)), schema))


def _jsonl_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    as_text = [f.name for f in schema if f.metadata == JSON_TEXT]
    for row in rows:
        for name in as_text:
            if row.get(name) is not None:
                row[name] = json.dumps(row[name], ensure_ascii=False)
    return pa.Table.from_pylist(rows, schema=schema)


UNIT_ROWS = 16_384  # rows a read task covers at least (then up to its row group's end)
# ... or fewer, where its rows are large (a column of photos): a read task's output is held
# whole before Ray Data cuts it into blocks, so a unit of 16,384 rows of 1 MB photos held 16 GB
UNIT_BYTES = 64 << 20


@dataclass(frozen=True)
class ReadUnit:
    """Consecutive blocks of one file, read by one task in one pass, so that every input row
    is decoded once: a Parquet unit ends only where a new row group starts (each block
    re-reading its row group decoded a 200,000-row group 782 times); a JSONL unit reads its
    byte range once."""

    blocks: tuple[Block, ...]

    @property
    def num_rows(self) -> int:
        return sum(b.num_rows for b in self.blocks)


def read_units(blocks: list[Block], unit_rows: int = UNIT_ROWS) -> list[ReadUnit]:
    """The blocks (in input order) grouped into read units."""
    units: list[list[Block]] = []
    for block in blocks:
        current = units[-1] if units else None
        if current and _continues(current, block, unit_rows):
            current.append(block)
        else:
            units.append([block])
    return [ReadUnit(tuple(unit)) for unit in units]


def _continues(unit: list[Block], block: Block, unit_rows: int) -> bool:
    last = unit[-1]
    if block.path != last.path or block.ordinal != last.ordinal + last.num_rows:
        return False  # another file, or blocks between them are done already
    if block.format == "parquet" and block.group_start == last.group_start:
        # a cut here would decode the head of this row group twice; at the next group a
        # cut re-decodes less than a block (the rows of one that straddles the boundary)
        return True
    return sum(b.num_rows for b in unit) < unit_rows


def read_unit(unit: ReadUnit, schema: pa.Schema) -> Iterator[pa.Table]:
    """Each block of the unit, cast to the input's schema, with its ordinals."""
    first = unit.blocks[0]
    if first.format == "parquet":
        tables = _parquet_blocks(unit)
    else:
        tables = (_jsonl_table(rows, schema) for rows in _jsonl_blocks(unit))
    for block, table in zip(unit.blocks, tables):
        places = pa.array(range(block.ordinal, block.ordinal + block.num_rows), pa.int64())
        if columns.ORDINAL in table.column_names:
            # a copy of the input in another order (pipelines/order/): each row brings its
            # ordinal, and its place in the copy places it in the run
            ordinals = table.column(columns.ORDINAL)
            yield (conform(table.drop_columns([columns.ORDINAL]), schema)
                   .append_column(columns.ORDINAL, ordinals)
                   .append_column(columns.POSITION, places))
        else:
            yield conform(table, schema).append_column(columns.ORDINAL, places)


def _parquet_blocks(unit: ReadUnit) -> Iterator[pa.Table]:
    """The unit's row groups, streamed once and cut into its blocks."""
    file = parquet_file(unit.blocks[0].path)
    start, end = unit.blocks[0].offset, unit.blocks[-1].offset + unit.blocks[-1].num_rows
    groups, first_row, seen = [], None, 0
    for i in range(file.metadata.num_row_groups):
        n = file.metadata.row_group(i).num_rows
        if seen + n > start and seen < end:
            groups.append(i)
            first_row = seen if first_row is None else first_row
        seen += n
    stream = file.iter_batches(batch_size=max(b.num_rows for b in unit.blocks),
                               row_groups=groups, use_threads=False)
    pending: list[pa.RecordBatch] = []
    held, skip = 0, start - first_row  # rows of the first group before the unit starts
    for block in unit.blocks:
        while held < skip + block.num_rows:
            batch = next(stream)
            pending.append(batch)
            held += batch.num_rows
        table = pa.Table.from_batches(pending).slice(skip, block.num_rows)
        yield table
        rest = pa.Table.from_batches(pending).slice(skip + block.num_rows)
        pending, held, skip = rest.to_batches(), rest.num_rows, 0


def _jsonl_blocks(unit: ReadUnit) -> Iterator[list[dict]]:
    with unit.blocks[0].path.open() as handle:
        handle.seek(unit.blocks[0].offset)
        start = unit.blocks[0].offset == 0  # the file's first line: a BOM may lead it
        for block in unit.blocks:
            rows = []
            while len(rows) < block.num_rows:
                raw = handle.readline()
                if not raw:
                    break
                if start:
                    raw, start = raw.removeprefix(BOM), False
                if not blank(raw):
                    rows.append(loads(raw))
            yield rows


class TableDatasource(Datasource):
    """One read task per read unit; every block it emits carries its rows' ordinals."""

    def __init__(self, blocks: list[Block], schema: pa.Schema,
                 only_rows: dict[int, list[int]] | None = None, unit_rows: int = UNIT_ROWS):
        super().__init__()
        self.units, self.schema = read_units(blocks, unit_rows), schema
        self.only_rows = only_rows or {}

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        schema, only = self.schema, self.only_rows

        def read(unit: ReadUnit) -> Iterator[pa.Table]:
            for block, table in zip(unit.blocks, read_unit(unit, schema)):
                yield table.take(only[block.ordinal]) if block.ordinal in only else table
            release_memory()  # the worker reads other units next: a large one's pages go back

        return [
            ReadTask(
                (lambda u=unit: read(u)),
                BlockMetadata(num_rows=sum(len(only.get(b.ordinal, ())) or b.num_rows
                                           for b in unit.blocks),
                              size_bytes=None, input_files=[str(unit.blocks[0].path)],
                              exec_stats=None),
            )
            for unit in self.units
        ]


def read_dataset(plan: InputPlan, skip_blocks: frozenset[int] = frozenset(),
                 only_rows: dict[int, list[int]] | None = None, others: bool = False,
                 block_rows: int = 256, slots: int = 1):
    """A Ray Dataset over the plan's blocks, leaving out those whose first ordinal is in
    ``skip_blocks`` (written by an earlier run of the same job); with ``only_rows``, just
    those blocks, and in each just the rows at the given positions (with ``others``, the
    other blocks too, whole); and the rows of its Ray Data blocks (``ray_block_rows``). None
    if nothing is left. ``block_rows``: the plan's rows per block; ``slots``: the engine calls
    that run at once over the whole job (replicas x blocks in flight)."""
    todo = [b for b in plan.blocks if b.ordinal not in skip_blocks
            and (only_rows is None or others or b.ordinal in only_rows)]
    if not todo:
        return None, block_rows
    rows = sum(len(only_rows[b.ordinal]) if only_rows and b.ordinal in only_rows
               else b.num_rows for b in todo)
    per_row = plan.data_bytes / max(plan.num_rows, 1)
    per_block = ray_block_rows(rows, block_rows, slots, per_row)
    # Reading is light: a fraction of a CPU, so it never starves the engine on a small machine.
    # One task per read unit; asking for this many output blocks makes Ray Data cut each
    # unit's output into pieces of about ``per_block`` rows.
    unit_rows = max(1, min(UNIT_ROWS, int(UNIT_BYTES // max(per_row, 1))))
    source = TableDatasource(todo, plan.schema, only_rows, unit_rows)
    read_ahead = read_ahead_bytes(plan, per_block, slots)
    largest_unit = max(unit.num_rows for unit in source.units) * per_row
    ds = ray.data.read_datasource(source, num_cpus=0.25, override_num_blocks=-(-rows // per_block),
                                  concurrency=reads_at_once(read_ahead, largest_unit))
    options = ds.context.execution_options  # this dataset's own (a copy of the session's)
    options.resource_limits = options.resource_limits.min(ExecutionResources.for_limits(
        object_store_memory=read_ahead))
    return ds, per_block
