"""The rows a re-run found, staged before any engine starts: as parts, their generated columns
beside the new table's values in its order; or, for a job of steps run again from a changed
step, as each row's state after the steps before it."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.reuse.find import ReusePlan
from pipelines.storage import Location
from udfs import columns

BUCKET_ROWS = 200_000  # carried rows gathered at once into the new table's order, about


def stage_reused(plan, reuse: ReusePlan, layout, done: set[int]) -> dict:
    """Write the rows ``reuse`` found as parts in staging: each earlier output file read once
    (the columns the job generates), its rows sorted into the new table's order through
    local files a bucket of blocks apart, then beside the new table's own values. Returns
    the tokens carried over, not generated again."""
    from pipelines.write import PartWriter

    writer = PartWriter(layout)
    steps = plan.config.steps
    carried = _carried_columns(plan, reuse, layout)
    buckets = _buckets([b for b in plan.input.blocks if b.ordinal not in done])
    saved = {"prompt_tokens": 0, "completion_tokens": 0, "rows": 0}
    if not buckets or not reuse.reused:  # (nothing found: no lookup was made at all)
        return saved
    with tempfile.TemporaryDirectory(prefix="overnight-reuse-") as spill:
        held = _spill_by_bucket(reuse, carried, buckets, spill)
        for b, blocks in enumerate(buckets):
            if b not in held:
                continue
            found = pa.concat_tables([pq.read_table(n) for n in held.pop(b)],
                                     promote_options="permissive")
            # (a stable sort: each row's samples stay in sample order)
            found = found.take(pc.sort_indices(found, [(columns.ORDINAL, "ascending")]))
            if reuse.from_step is not None:
                saved["rows"] += _stage_states(found, blocks, steps[:reuse.from_step], layout)
                for name, tokens in _step_tokens(found, steps[:reuse.from_step]).items():
                    saved[name] += tokens
                continue
            _stage_parts(plan, found, blocks, carried, layout, writer, saved)
            if steps:
                for name, tokens in _step_tokens(found, steps).items():
                    saved[name] += tokens
            del found
    return saved


def _carried_columns(plan, reuse: ReusePlan, layout) -> list[str]:
    """The earlier output's columns a row carries over: the job's generated ones; a job of
    steps run again from a changed step, its first steps' columns (its state after them)."""
    if reuse.from_step is not None:
        thinking = plan.config.model.reasoning_parser is not None
        carried = [c for step in plan.config.steps[:reuse.from_step]
                   for c in step.added_columns(thinking)]
        return carried + [columns.DROPPED_BY] * plan.config.output.keep_dropped
    return [c for c in layout.added_columns if c not in (columns.ROW_ID, columns.REQUEST_KEY)]


def _spill_by_bucket(reuse: ReusePlan, carried: list[str], buckets: list[list],
                     spill: str) -> dict[int, list[str]]:
    """Each earlier file read once: its rows found, with their new ordinals, into local files
    by the bucket of blocks they go to. Returns each bucket's files."""
    starts = np.asarray([bucket[0].ordinal for bucket in buckets], np.int64)
    ends = np.asarray([bucket[-1].ordinal + bucket[-1].num_rows for bucket in buckets],
                      np.int64)
    held: dict[int, list[str]] = {}
    for f, file in enumerate(reuse.files):
        lo, hi = reuse.file_rows[f], reuse.file_rows[f + 1]
        rows = np.flatnonzero((reuse.at >= lo) & (reuse.at < hi))
        bucket = np.searchsorted(starts, rows, side="right") - 1
        keep = (bucket >= 0) & (rows < ends[np.maximum(bucket, 0)])
        rows, bucket = rows[keep], bucket[keep]
        if not len(rows):
            continue
        with file.open() as handle:
            table = pq.read_table(handle, columns=carried)
        samples = reuse.count[rows]
        first = np.repeat(np.cumsum(samples) - samples, samples)
        take = np.repeat(reuse.at[rows] - lo, samples) + np.arange(samples.sum()) - first
        piece = table.take(pa.array(take, pa.int64())).append_column(
            columns.ORDINAL, pa.array(np.repeat(rows, samples), pa.int64()))
        of = np.repeat(bucket, samples)
        for b in np.unique(of):
            name = os.path.join(spill, f"{b}-{f}.parquet")
            pq.write_table(piece.filter(pa.array(of == b)), name)
            held.setdefault(int(b), []).append(name)
        del table, piece
    return held


def _stage_parts(plan, found: pa.Table, blocks: list, carried: list[str], layout, writer,
                 saved: dict) -> None:
    """A bucket's rows found, beside the new table's own values, written as parts; what they
    hold is added to ``saved`` (a job of steps' tokens are counted by its steps)."""
    from pipelines.read import read_unit, read_units
    from pipelines.write.writers import runs

    steps = plan.config.steps
    ordinals = found.column(columns.ORDINAL).to_numpy()
    source = pa.concat_tables([t for unit in read_units(blocks)
                               for t in read_unit(unit, plan.input.schema)])
    rows = source.take(pa.array(ordinals - blocks[0].ordinal, pa.int64()))
    del source
    for name in carried:
        rows = rows.append_column(name, found.column(name))
    for run in _whole_blocks_joined(runs(rows.column(columns.ORDINAL), layout.block_starts),
                                    ordinals, layout):
        # (a job of steps' part: its input rows by its name, a row its filter
        # dropped is not in it)
        whole = len(run) == rows.num_rows  # (an unchanged table's bucket: no copy)
        record = writer.write_run(rows if whole else rows.take(run), [] if steps else None)
        saved["rows"] += record["input_rows"]
        if not steps:
            saved["prompt_tokens"] += record["prompt_tokens"]
            saved["completion_tokens"] += record["completion_tokens"]


def _stage_states(found: pa.Table, blocks: list, steps: list, layout) -> int:
    """A job of steps run again from a changed step: each found row's state after the steps
    before it (one per fan-out of those steps: the first of its earlier rows), a file a block
    in staging, which the block's run starts from (udfs/stages/steps.py). Returns the input rows."""
    import polars as pl

    from udfs.stages.steps import STATES  # (hidden: not a part; the commit clears it)

    index = [columns.step_column(s.output_column, "index") for s in steps
             if s.output_column is not None and (s.explode or s.sampling.n > 1)]
    frame = pl.from_arrow(found).unique([columns.ORDINAL, *index], keep="first",
                                        maintain_order=True)
    if columns.DROPPED_BY in frame.columns:  # dropped by a later step: not by these
        frame = frame.with_columns(pl.when(pl.col(columns.DROPPED_BY).is_in(
            [s.name for s in steps])).then(pl.col(columns.DROPPED_BY)).alias(columns.DROPPED_BY))
    states = frame.to_arrow().cast(found.schema)  # (polars' strings are large ones)
    ordinals = states.column(columns.ORDINAL).to_numpy()
    staging = Location.of(layout.staging)
    for block in blocks:
        inside = (ordinals >= block.ordinal) & (ordinals < block.ordinal + block.num_rows)
        if inside.any():
            part = states.filter(pa.array(inside))
            (staging / STATES.format(block.ordinal)).write(lambda tmp: pq.write_table(part, tmp))
    return len(np.unique(ordinals))


def _step_tokens(found: pa.Table, steps: list) -> dict:
    """A job of steps' rows carried over: the tokens each step generated for them, each
    generation once (a fan-out's later steps repeat an earlier step's columns)."""
    import polars as pl

    frame = pl.from_arrow(found)
    out, index = {"prompt_tokens": 0, "completion_tokens": 0}, []
    for step in steps:
        c = step.output_column
        if c is None:
            continue
        if step.explode or step.sampling.n > 1:
            index.append(columns.step_column(c, "index"))
        once = frame.unique([columns.ORDINAL, *index], keep="first")
        for total in out:
            out[total] += int(once[columns.step_column(c, total)].fill_null(0).sum())
    return out


def _whole_blocks_joined(runs: list, ordinals: np.ndarray, layout) -> list:
    """Runs of rows (each inside one block) with consecutive whole blocks joined into one:
    a part of many blocks starts and ends where blocks do, so the compaction still cuts files
    at block starts (pipelines/write/compact.py), and an unchanged table is a few large parts."""
    out, joinable, starts = [], False, set(layout.block_starts)
    for run in runs:
        first, last = int(ordinals[run[0].as_py()]), int(ordinals[run[-1].as_py()])
        whole = first in starts and last + 1 == layout.block_end(first)
        if whole and joinable and int(ordinals[out[-1][-1].as_py()]) + 1 == first:
            out[-1] = pa.concat_arrays([out[-1], run])
        else:
            out.append(run)
        joinable = whole
    return out


def _buckets(blocks: list) -> list[list]:
    """Runs of consecutive blocks of about BUCKET_ROWS rows."""
    out, rows = [], 0
    for block in blocks:
        if out and rows + block.num_rows <= BUCKET_ROWS and \
                out[-1][-1].ordinal + out[-1][-1].num_rows == block.ordinal:
            out[-1].append(block)
            rows += block.num_rows
        else:
            out.append([block])
            rows = block.num_rows
    return out
