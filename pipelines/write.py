"""Writing the output: Parquet parts committed as they are generated, the dataset committed once.

While a job runs, its parts go to a staging directory beside the output, ``OUTPUT.partial/``,
each written to a temporary name and renamed into place, so a part is either whole or absent.
A part holds a run of consecutive input rows and is named by their ordinals, ``[start, end)``:
``part-000000000256-000000000512.parquet``. The names alone say which rows are done, and sort
in input order.

The invariant everything here rests on (resume's coverage arithmetic, the retry merge,
compaction): **a part holds whole input rows, all of each row's samples, and no two parts
overlap** but where one holds the other whole (a compaction not yet finished). Ray Data may
cut a block anywhere between the engine's stage and the writer's, between two samples of one
row too: the writer keeps a row's samples that came without the rest aside, as a hidden
``.samples-ORDINAL-FIRST.parquet``, and the writer that completes the row writes its part
(``PartWriter``). A listing that finds two parts overlapping in part refuses them
(``list_parts``): that is a defect, and "superseded" would drop rows. The writers are a pool, stateless: each writes what it is handed at once, one
part per run of consecutive rows of one block, so no actor holds rows back and none is a
funnel every row passes through.

When every row is written, the parts are compacted (pipelines/compact.py) into files of about
``output.file_size_mb``, each written whole and then the parts it replaces removed: a file whose
range holds another's supersedes it, so a compaction interrupted at any moment is finished by
the next run. Then the staging directory is renamed to the output path. A crash at any moment
leaves either the old state or the new one; the next run of the same job picks up the parts
already there.

On an object store (``s3://``, ``gs://``: see pipelines/storage.py) each part is one upload,
whole or absent, but a directory cannot be renamed: the commit copies the staged files into
place, and only then marks the record complete. The record says which state the output is in; a
run interrupted during the commit finishes it when run again.

The output directory holds Parquet files and nothing else, so that ``pl.read_parquet(OUTPUT)``,
``pq.read_table(OUTPUT)`` and DuckDB's ``read_parquet('OUTPUT/*.parquet')`` all read it, in input
order. The job's own record (its fingerprint, state and summary) is a file beside it,
``OUTPUT.overnight.json``.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.errors import OutputError
from pipelines.storage import Location, hold_lock, scrub_record
from udfs import columns

PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
_PART = re.compile(r"part-(\d{12})(?:-(\d{12}))?\.parquet")
# --retry-errors: a block's committed rows, staged while its failed rows run again (hidden:
# never listed as a part; the commit clears it)
_RETRY_OLD = ".retry-{:012d}.parquet"
# Some of an input row's samples, kept aside until the rest arrive (PartWriter): the row's
# ordinal and its first sample index here (hidden: never listed as a part; the commit clears
# what a killed run left, and the row runs again)
_SAMPLES_PIECE = ".samples-{:012d}-{}"


def part_name(start: int, end: int | None = None) -> str:
    """The name of the part holding input rows [start, end). Without ``end``, the name an
    earlier version gave a block's part (still read)."""
    if end is None:
        return f"{PART_PREFIX}{start:012d}{PART_SUFFIX}"
    return f"{PART_PREFIX}{start:012d}-{end:012d}{PART_SUFFIX}"


def part_range(name: str) -> tuple[int, int | None] | None:
    """``(start, end)`` of a part's name, ``end`` None for a block's part of an earlier
    version; None for any other file."""
    match = _PART.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), (int(match[2]) if match[2] is not None else None)


def part_ordinal(name: str) -> int | None:
    found = part_range(name)
    return found[0] if found else None


@dataclass(frozen=True)
class Part:
    """A part in a folder: input rows [start, end); ``end`` None for an earlier version's
    block part (its block's end)."""

    name: str
    start: int
    end: int | None
    size: int = 0


def list_parts(folder: Location) -> tuple[list[Part], list[Part]]:
    """The parts of a folder in input order, and those superseded: a part inside the range of
    a larger one (a compaction interrupted before it removed its sources; a part written
    again after a retried task). Each input row is in exactly one of the parts returned.
    Two parts that overlap in part break the module's invariant: OutputError, naming them."""
    found = []
    for name, size in folder.sizes().items():
        where = part_range(name)
        if where is not None:
            found.append(Part(name, where[0], where[1], size))
    found.sort(key=lambda p: (p.start, -(p.end if p.end is not None else p.start + 1)))
    kept, superseded, reach = [], [], -1
    for part in found:
        end = part.end if part.end is not None else part.start + 1
        if part.start < reach:
            if end > reach:  # starts inside the last part kept and runs past it
                raise OutputError(
                    f"{folder}: parts {kept[-1].name} and {part.name} overlap (rows "
                    f"{part.start}-{reach - 1} are in both): the folder is not a consistent "
                    "output; remove the later part to run those rows again")
            superseded.append(part)
            continue
        kept.append(part)
        reach = end
    return kept, superseded


def write_atomically(path: Path | Location, write) -> None:
    """Call ``write(tmp_path)``, then put the file at ``path`` whole (fsync and rename on a
    local disk, one upload on an object store): whole or absent."""
    Location.of(path).write(write)


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

    def block_end(self, start: int) -> int:
        i = bisect.bisect_right(self.block_starts, start)
        return self.block_starts[i] if i < len(self.block_starts) else self.rows_total


def input_offsets(keys: list) -> list[int]:
    """For each row of a part, which of the part's input rows it belongs to. A part holds
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
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("steps", pa.string())])  # a job with steps: the part's per-step counts (JSON), or null


class _Writer:
    def __init__(self, layout: PartLayout):
        self.layout = layout
        self.staging = Location.of(layout.staging)

    def _arrange(self, table: pa.Table) -> pa.Table:
        if columns.ROW_ID in self.layout.added_columns:
            table = table.append_column(columns.ROW_ID, table.column(columns.ORDINAL))
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
        return {"part": name, **_timing(block), **counted}

    def _drop(self, block: pa.Table, part: pa.Table) -> pa.Table:
        """A job with steps: the rows its filters dropped left out, unless it keeps them."""
        if columns.DROPPED not in block.column_names or self.layout.keep_dropped:
            return part
        return part.filter(pc.invert(block.column(columns.DROPPED)))


class PartWriter(_Writer):
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
        for rows in _runs(batch.column(columns.ORDINAL), self.layout.block_starts):
            records.append(self._write_run(batch.take(rows), steps))
            if steps is not None:
                steps = []  # the batch's other parts: their input rows, no counts again
        for ordinal, piece in pieces:
            block = self._set_aside(ordinal, piece)
            if block is not None:
                records.append(self._write_run(block, [] if steps is not None else None))
        return pa.Table.from_pylist(records, RECORD_SCHEMA)

    def _write_run(self, block: pa.Table, steps: list[dict] | None) -> dict:
        """A run of consecutive whole input rows of one block, written as its part."""
        first = block.column(columns.ORDINAL)[0].as_py()
        last = block.column(columns.ORDINAL)[-1].as_py()
        part = self._drop(block, self._arrange(block))
        if self.layout.dedupe:
            part = part.take(self._dedupe(part))
        return self._write(part_name(first, last + 1), block, part, steps)

    def _set_aside(self, ordinal: int, piece: pa.Table) -> pa.Table | None:
        """Some of one input row's samples, kept aside in staging until the rest arrive (in
        this writer or another of the pool). Returns the row's samples, all of them in sample
        order, when this piece completes it (its pieces then removed), else None. Two writers
        completing it at once write the same part, whole, under the same name."""
        prefix = _SAMPLES_PIECE.format(ordinal, "")
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


def _runs(ordinals: pa.ChunkedArray | pa.Array, block_starts: tuple[int, ...]) -> list:
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


class RetryWriter(_Writer):
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
            part = self._merge(start, block.column(columns.ORDINAL), part)
            records.append(self._write(part_name(start, self.layout.block_end(start)),
                                       block, part))
            self.written.add(start)
        return pa.Table.from_pylist(records, RECORD_SCHEMA)

    def _merge(self, start: int, ordinals: pa.Array, rows: pa.Table) -> pa.Table:
        """The block's committed rows with ``rows`` (re-run) in place of the old ones."""
        old = read_part(self.staging / _RETRY_OLD.format(start))
        old_offsets = input_offsets(old.column(self.layout.key_column).to_pylist())
        positions = [o - start for o in ordinals.to_pylist()]  # re-run input rows
        taken = set(positions)
        keep = [i for i, offset in enumerate(old_offsets) if offset not in taken]
        # (typed: an empty list would be a null array, which take() refuses)
        merged = pa.concat_tables([old.take(pa.array(keep, pa.int64())), rows.cast(old.schema)])
        # stable sort by input row: a row's samples stay in sample order
        order = pc.sort_indices(pa.array([old_offsets[i] for i in keep] + positions))
        return merged.take(order)


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
    rows, tokens. Vectorized: a compacted part holds hundreds of thousands of rows."""
    kinds = pc.value_counts(part.column(columns.ERROR_KIND).combine_chunks()
                            if part.num_rows else pa.array([], pa.string()))
    errors = {k.as_py(): n.as_py() for k, n in zip(kinds.field("values"), kinds.field("counts"))
              if k.as_py() is not None}
    steps = part_steps(part.schema)
    return {
        # a job with steps may leave a part's input rows out (dropped): its metadata counts
        "input_rows": (steps["input_rows"] if steps is not None
                       else count_runs(part.column(key_column))),
        "steps": steps["steps"] if steps is not None else None,
        "rows": part.num_rows,
        "errors": json.dumps(dict(sorted(errors.items()))),
        "skipped": pc.sum(pc.equal(part.column(columns.FINISH_REASON),
                                   columns.FinishReason.SKIPPED)).as_py() or 0,
        # a job with steps: the tokens its steps generated (a row's own columns count its
        # fan-out parent's again, and dropped rows are not in the part)
        **({"prompt_tokens": sum(s["prompt_tokens"] for s in steps["steps"]),
            "completion_tokens": sum(s["completion_tokens"] for s in steps["steps"])}
           if steps is not None else
           {"prompt_tokens": pc.sum(part.column(columns.PROMPT_TOKENS)).as_py() or 0,
            "completion_tokens": pc.sum(part.column(columns.COMPLETION_TOKENS)).as_py() or 0}),
    }


def part_steps(schema: pa.Schema) -> dict | None:
    """A job with steps: a part's (or file's) {"input_rows", "steps": [per-step counts]}."""
    found = (schema.metadata or {}).get(columns.STEPS_METADATA)
    return json.loads(found) if found is not None else None


STEP_NUMBERS = ("rows_in", "rows_out", "dropped", "errors", "prompt_tokens",
                "completion_tokens", "seconds")


def add_steps(total: list[dict], more: list[dict]) -> list[dict]:
    """Two lists of per-step counts added up, step by step (by name, in order)."""
    if not total:
        return [dict(step) for step in more]
    by_name = {step["name"]: step for step in total}
    for step in more:
        mine = by_name.get(step["name"])
        if mine is None:
            total.append(dict(step))
            by_name[step["name"]] = total[-1]
            continue
        for key in STEP_NUMBERS:
            mine[key] = round(mine.get(key, 0) + step.get(key, 0), 3)
    return total


def count_runs(keys: pa.ChunkedArray | pa.Array) -> int:
    """Runs of equal keys: the input rows of a part (each row's samples share its key)."""
    if len(keys) == 0:
        return 0
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if pa.types.is_struct(keys.type) or pa.types.is_list(keys.type) \
            or pa.types.is_large_list(keys.type):
        return input_offsets(keys.to_pylist())[-1] + 1
    changed = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
    return 1 + (pc.sum(pc.fill_null(changed, True)).as_py() or 0)


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
        # after open(): the rows still to run of blocks an interrupted run wrote in part
        self.remaining: dict[int, list[int]] = {}

    @contextmanager
    def locked(self):
        """This output, for this process alone while the block runs: a second run of a job
        writing here is refused in one line (two at once would write the same parts and
        commit over each other). A local output's lock is ``OUTPUT.overnight.lock`` beside
        it; an object store has no lock to take (say so in the docs)."""
        if not self.path.local:
            yield
            return
        try:
            handle, holder = hold_lock(self.path.sibling(".overnight.lock").path)
        except OSError as exc:  # a folder this user cannot write
            raise OutputError(f"output.path {str(self.path)!r}: cannot write there: "
                              f"{' '.join(str(exc).split())[:300]}") from None
        if handle is None:
            raise OutputError(f"output.path {str(self.path)!r} is being written by another "
                              f"overnight run (pid {holder}); wait for it to end, or choose "
                              "another output.path")
        try:
            yield
        finally:
            handle.close()

    def read_record(self) -> dict | None:
        try:
            return json.loads(self.record.read_text())
        except FileNotFoundError:
            return None

    def write_record(self, record: dict) -> None:
        self.path.parent.mkdir()
        self.record.write_text(json.dumps(scrub_record(record), indent=2, default=str))

    def interrupted_commit(self, fingerprint: dict) -> dict | None:
        """The record of a run of this job stopped after its output was put in place and
        before the record said so (a local disk's commit: the staging folder renamed to the
        output, the record still "committing"): the commit to finish. None otherwise."""
        record = self.read_record() or {}
        if (record.get("state") == "committing" and "summary" in record
                and not self.staging.exists() and self.path.exists()
                and not diff_fingerprints(record.get("fingerprint", {}), fingerprint)):
            return record
        return None

    def finish_commit(self, record: dict) -> None:
        """Record the job complete, once its output is in place; clear what a commit stopped
        half-way left beside it."""
        self.write_record({**record, "state": "complete", "finished": time.time()})
        self.staging.remove()  # on a local disk, already gone
        self._remove_replaced()

    def _remove_replaced(self) -> None:
        """An earlier output a local commit moved aside (``.NAME.replaced-*``), left by a
        commit stopped between its two renames: the output is now the staged one."""
        if self.path.local:
            for name in self.path.parent.names():
                if name.startswith(f".{self.path.name}.replaced-"):
                    (self.path.parent / name).remove()

    def open(self, fingerprint: dict, *, overwrite: bool, rows_total: int = 0,
             block_starts: tuple[int, ...] = ()) -> set[int]:
        """Prepare staging for this job; return the first ordinals of blocks already written
        (``block_starts``: every planned block's)."""
        record = self.read_record() or {}
        if self.staging.exists() and record.get("state") in ("running", "committing"):
            # An unfinished run. Of this job: resume it, with or without --overwrite (the
            # command that started it may have had the flag; "the same command resumes").
            changed = diff_fingerprints(record.get("fingerprint", {}), fingerprint)
            if not changed:
                return self._resume(block_starts, rows_total)
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

    def _resume(self, block_starts: tuple[int, ...], rows_total: int) -> set[int]:
        """The blocks the staged parts cover whole. Superseded parts are removed. Of a block
        only partly written (its other rows were in flight when the run stopped), the rows
        still to run are kept in ``self.remaining`` ({block start: positions in the block}):
        the rows written are not read again."""
        kept, superseded = list_parts(self.staging)
        for part in superseded:
            (self.staging / part.name).remove()
        if not block_starts:  # no plan given: each part stands for the block it starts
            return {p.start for p in kept}
        done, partial = covered_blocks(kept, block_starts, rows_total)
        self.remaining = missing_rows(kept, partial, block_starts, rows_total)
        return done

    def done_blocks(self, block_starts: tuple[int, ...] = (), rows_total: int = 0) -> set[int]:
        """The blocks the staged parts cover whole (without ``block_starts``: the starts of
        the staged parts)."""
        kept, _ = list_parts(self.staging)
        if not block_starts:
            return {p.start for p in kept}
        return covered_blocks(kept, block_starts, rows_total)[0]

    def open_retry(self, fingerprint: dict, key_column: str, block_starts: tuple[int, ...],
                   rows_total: int) -> dict[int, list[int]]:
        """Stage a re-run of the rows with errors in the committed output. Files without
        errors are linked (copied, on an object store) into staging unchanged; of a file with
        errors, the blocks without errors are staged as parts and each block with errors as
        its committed rows, for the retry writer to merge into. Returns {block start: input
        positions in the block to re-run}."""
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
        for part in list_parts(self.path)[0]:
            table = read_part(self.path / part.name, columns=[key_column, columns.ERROR])
            ordinals = part.start + np.asarray(
                input_offsets(table.column(key_column).to_pylist()), dtype=np.int64)
            failed = ordinals[table.column(columns.ERROR).is_valid().to_numpy(
                zero_copy_only=False)]
            if len(failed) == 0:
                (self.path / part.name).copy_to(self.staging / part.name)
                continue
            retry.update(self._stage_for_retry(part, ordinals, set(failed.tolist()),
                                               block_starts, rows_total))
        self.write_record({**record, "state": "retrying", "retry_started": time.time()})
        return retry

    def _stage_for_retry(self, part: Part, ordinals: np.ndarray, failed: set[int],
                         block_starts: tuple[int, ...], rows_total: int) -> dict[int, list]:
        whole = read_part(self.path / part.name)
        blocks = np.asarray(block_starts)[
            np.searchsorted(np.asarray(block_starts), ordinals, side="right") - 1]
        retry, clean = {}, []  # clean: row indices of a run of blocks without errors

        def stage_clean():
            if clean:
                rows = pa.array(np.concatenate(clean), pa.int64())
                first, last = ordinals[rows[0].as_py()], ordinals[rows[-1].as_py()]
                table = whole.take(rows)
                (self.staging / part_name(int(first), int(last) + 1)).write(
                    lambda tmp: pq.write_table(table, tmp))
                clean.clear()

        for start in np.unique(blocks):
            rows = np.flatnonzero(blocks == start)
            bad = sorted(o - int(start) for o in set(ordinals[rows].tolist()) & failed)
            if not bad:
                clean.append(rows)
                continue
            stage_clean()
            old = whole.take(pa.array(rows, pa.int64()))
            (self.staging / _RETRY_OLD.format(int(start))).write(
                lambda tmp, old=old: pq.write_table(old, tmp))
            retry[int(start)] = bad
        stage_clean()
        return retry

    def discard(self) -> None:
        """The output, its staging folder and its record, removed."""
        for where in (self.path, self.staging, self.record):
            where.remove()

    def commit(self, record: dict) -> None:
        """Make the staged parts the output, then record the job as complete. On a local
        disk that is one rename; on an object store, a copy of each part, after which the
        record turns complete (an interrupted copy is redone by the next run)."""
        kept, superseded = list_parts(self.staging)
        keep = {p.name for p in kept}
        for name in self.staging.names():  # temporaries left by a killed run; superseded
            if name not in keep:
                (self.staging / name).remove()
        # "committing", with the summary: a run stopped from here on finishes the commit
        # (``interrupted_commit``) instead of finding an output it would refuse to replace
        self.write_record({**record, "state": "committing"})
        if self.path.local:
            if self.path.exists():  # moved aside, then removed once the new one is in place
                self.path.rename_to(self.path.with_name(
                    f".{self.path.name}.replaced-{uuid.uuid4().hex[:8]}"))
            self.staging.rename_to(self.path)
        else:
            self.path.remove()
            self.path.mkdir()
            for name in self.staging.names():
                (self.staging / name).copy_to(self.path / name)
        self.finish_commit(record)


def covered_blocks(parts: list[Part], block_starts: tuple[int, ...],
                   rows_total: int) -> tuple[set[int], set[int]]:
    """(blocks the parts cover whole, blocks they cover in part), by first ordinal."""
    if not block_starts:
        return set(), set()
    starts = list(block_starts)
    ends = starts[1:] + [rows_total]
    have = np.zeros(len(starts), dtype=np.int64)  # rows of each block the parts hold
    for part in parts:
        end = part.end
        if end is None:  # an earlier version's block part: its whole block
            i = bisect.bisect_right(starts, part.start) - 1
            end = ends[i] if i >= 0 and starts[i] == part.start else part.start
        lo = max(bisect.bisect_right(starts, part.start) - 1, 0)
        for i in range(lo, len(starts)):
            if starts[i] >= end:
                break
            have[i] += min(end, ends[i]) - max(part.start, starts[i])
    done = {starts[i] for i in range(len(starts)) if have[i] >= ends[i] - starts[i]}
    partial = {starts[i] for i in range(len(starts)) if 0 < have[i] < ends[i] - starts[i]}
    return done, partial


def missing_rows(parts: list[Part], blocks: set[int], block_starts: tuple[int, ...],
                 rows_total: int) -> dict[int, list[int]]:
    """Of each block in ``blocks``, the positions (from the block's start) no part holds."""
    ends = dict(zip(block_starts, (*block_starts[1:], rows_total)))
    have = {start: np.zeros(ends[start] - start, dtype=bool) for start in blocks}
    for part in parts:
        start = block_starts[bisect.bisect_right(block_starts, part.start) - 1]
        if start in have and part.end is not None:
            have[start][part.start - start:min(part.end, ends[start]) - start] = True
    return {start: np.flatnonzero(~held).tolist() for start, held in sorted(have.items())}


def diff_fingerprints(old: dict, new: dict) -> list[str]:
    """The top-level keys whose values differ, e.g. ['sampling', 'input files']."""
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))

