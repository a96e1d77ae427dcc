"""Compaction: the staged parts, joined into files of about ``output.file_size_mb``, in input
order, by Ray tasks on the cluster (the rows never pass through the driver).

A job writes a part for every block, or for every piece of one (pipelines/write/writers.py):
tens of thousands of small files for a large table, which object stores and every reader after us
pay for. Once every row is staged, consecutive parts are grouped, at block boundaries, until a
group holds about the target size; each group becomes one file ``part-START-END.parquet``,
written whole (a temporary name, then a rename; one upload on an object store), and only then
are its parts removed. A file whose range holds a part supersedes it (``list_parts``), so a
compaction stopped at any moment leaves the staging folder consistent, and the next run
finishes it. Each task also returns its file's counts, so the summary and the report are added
up from a few numbers per file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.errors import OutputError, one_line
from pipelines.read.schema import conform  # a block given the input's schema: the same cast
from pipelines.storage import Location
from pipelines.write import (
    COUNTED, COUNTED_IF_PRESENT, Part, add_steps, count_part, list_parts, part_name, part_steps,
    read_part)
from udfs import columns
from udfs.stages.memory import release_memory

ROW_GROUP_BYTES = 64 << 20  # Arrow bytes buffered per row group written (readers like ~64 MiB)
STATS_EXAMPLES = 5  # ids kept per error kind, for the report


@dataclass(frozen=True)
class Group:
    start: int
    end: int
    names: tuple[str, ...]

    @property
    def name(self) -> str:
        return part_name(self.start, self.end)


def plan_groups(parts: list[Part], block_starts: tuple[int, ...], rows_total: int,
                target_bytes: int) -> list[Group]:
    """Consecutive parts grouped into files of about ``target_bytes`` (sizes on disk),
    cut only where a block starts, so each file holds whole blocks (--retry-errors reads a
    block's rows from one file)."""
    starts = set(block_starts)
    ends = dict(zip(block_starts, (*block_starts[1:], rows_total)))
    groups: list[list[Part]] = []
    size = 0
    for part in parts:
        if groups and part.start in starts and size + part.size > target_bytes:
            groups.append([])
            size = 0
        if not groups:
            groups.append([])
        groups[-1].append(part)
        size += part.size
    return [Group(g[0].start, g[-1].end if g[-1].end is not None else ends[g[-1].start],
                  tuple(p.name for p in g)) for g in groups if g]


def compact(staging: Location, block_starts: tuple[int, ...], rows_total: int,
            target_bytes: int, key_column: str) -> list[dict]:
    """Compact the staged parts (in Ray tasks; Ray must be up); returns each output file's
    counts (``file_stats``), in input order."""
    import ray

    write = ray.remote(num_cpus=1, max_retries=2)(write_group)
    groups = _groups(staging, block_starts, rows_total, target_bytes)
    return ray.get([write.remote(staging, group, key_column) for group in groups])


def compact_locally(staging: Location, block_starts: tuple[int, ...], rows_total: int,
                    target_bytes: int, key_column: str) -> list[dict]:
    """``compact`` in this process, one file after another (no Ray)."""
    return [write_group(staging, group, key_column)
            for group in _groups(staging, block_starts, rows_total, target_bytes)]


def _groups(staging: Location, block_starts: tuple[int, ...], rows_total: int,
            target_bytes: int) -> list[Group]:
    parts, superseded = list_parts(staging)
    for part in superseded:
        (staging / part.name).remove()
    return plan_groups(parts, block_starts, rows_total, target_bytes)


def write_group(staging: Location, group: Group, key_column: str) -> dict:
    """One output file from a group of parts (streamed: one row group buffered at a time),
    then its parts removed; a group of one part already named for its range is left as it
    is. Returns the file's counts."""
    target = staging / group.name
    if group.names == (group.name,):
        return file_stats(_read_staged(target, columns=[*COUNTED, key_column],
                                       if_present=COUNTED_IF_PRESENT), key_column,
                          group.name)
    schemas = []
    for name in group.names:
        try:
            with (staging / name).open() as handle:
                schemas.append(pq.read_schema(handle))
        except (OSError, pa.ArrowException):
            _read_staged(staging / name)  # names the part
            raise
    schema = pa.unify_schemas(schemas, promote_options="permissive")
    schema = schema.with_metadata(_file_metadata(schemas))
    stats = StatsBuilder(key_column)

    def write(tmp):
        buffered, size = [], 0
        with pq.ParquetWriter(tmp, schema) as out:
            for name in group.names:
                table = _read_staged(staging / name)
                stats.add(table)  # (with the part's own metadata: a job with steps' counts)
                table = table.replace_schema_metadata(schema.metadata)
                if table.schema != schema:
                    table = conform(table, schema)
                buffered.append(table)
                size += table.nbytes
                if size >= ROW_GROUP_BYTES:
                    out.write_table(pa.concat_tables(buffered), row_group_size=1 << 30)
                    buffered, size = [], 0
            if buffered:
                out.write_table(pa.concat_tables(buffered), row_group_size=1 << 30)

    target.write(write)
    for name in group.names:  # only once the file that replaces them is whole
        if name != group.name:
            (staging / name).remove()
    release_memory()  # a worker runs many groups: a group's pages go back once written
    return stats.result(group.name)


def _read_staged(path: Location, columns: list[str] | None = None,
                 if_present: tuple[str, ...] = ()) -> pa.Table:
    """A staged part; one that cannot be read (a disk fault, a file cut short outside our
    writes) is named, with what to do: its rows run again once it is gone."""
    try:
        return read_part(path, columns=columns, if_present=if_present)
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"{path}: this part cannot be read ({one_line(exc, 200)}"
                          "); remove it and run the same command again: its rows run "
                          "again") from None


def _file_metadata(schemas: list[pa.Schema]) -> dict:
    """A file's metadata from its parts': the job's (the same on each), and a job with steps'
    counts added up."""
    meta = {k: v for k, v in (schemas[0].metadata or {}).items()
            if k != columns.STEPS_METADATA}
    found = [s for s in map(part_steps, schemas) if s is not None]
    if found:
        steps: list[dict] = []
        for part in found:
            steps = add_steps(steps, part["steps"])
        meta[columns.STEPS_METADATA] = json.dumps(
            {"input_rows": sum(p["input_rows"] for p in found), "steps": steps}).encode()
    return meta


class StatsBuilder:
    """A file's counts, added up part by part: ``count_part``'s numbers, the token counts as
    {value: rows} (exact percentiles and histograms from a few numbers per file), and a few
    ids per error kind."""

    def __init__(self, key_column: str):
        self.key_column = key_column
        self.counts = {"input_rows": 0, "rows": 0, "skipped": 0, "prompt_tokens": 0,
                       "completion_tokens": 0, "reasoning_tokens": 0,
                       columns.IMAGE_COUNT: 0, columns.IMAGE_TOKENS: 0}
        self.errors: dict[str, int] = {}
        self.steps: list[dict] | None = None  # a job with steps: per-step counts
        self.values: dict[str, dict[int, int]] = {"prompt_tokens": {}, "completion_tokens": {}}
        self.examples: dict[str, list] = {}

    def add(self, table: pa.Table) -> None:
        counted = count_part(table, self.key_column)
        for key in self.counts:
            self.counts[key] += counted.get(key, 0)  # (image counts: a job with images')
        if counted["steps"] is not None:
            self.steps = add_steps(self.steps or [], counted["steps"])
        for kind, n in json.loads(counted["errors"]).items():
            self.errors[kind] = self.errors.get(kind, 0) + n
            shown = self.examples.setdefault(kind, [])
            if len(shown) < STATS_EXAMPLES:
                rows = table.filter(pc.equal(table.column(columns.ERROR_KIND), kind))
                for value in rows.column(self.key_column).slice(
                        0, STATS_EXAMPLES - len(shown)).to_pylist():
                    shown.append(value if isinstance(value, (str, int, float, bool))
                                 else str(value))
        for column, values in self.values.items():
            counts = pc.value_counts(table.column(column).combine_chunks())
            for value, n in zip(counts.field("values").to_pylist(),
                                counts.field("counts").to_pylist()):
                if value is not None:
                    values[value] = values.get(value, 0) + n

    def result(self, name: str) -> dict:
        return {"part": name, **self.counts, "errors": json.dumps(self.errors),
                "steps": self.steps,
                "error_examples": self.examples,
                "values": {c: sorted(v.items()) for c, v in self.values.items()}}


def file_stats(table: pa.Table, key_column: str, name: str = "") -> dict:
    stats = StatsBuilder(key_column)
    stats.add(table)
    return stats.result(name)


def output_stats(folder: Location, key_column: str) -> list[dict]:
    """``file_stats`` of each file of a committed output, read in the driver one file at a
    time, only the columns counted (``overnight report`` on an output without its report)."""
    return [file_stats(read_part(folder / part.name, columns=[*COUNTED, key_column],
                                 if_present=COUNTED_IF_PRESENT),
                       key_column, part.name) for part in list_parts(folder)[0]]
