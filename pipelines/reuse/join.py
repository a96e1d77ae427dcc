"""The lookup's join: the new table's request keys and the earlier output's, spilled to local
files by their keys' bits and joined a slice at a time by sorting, never a dict of rows."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.reuse.earlier import Footer
from pipelines.reuse.request_key import KeySpec, key_words, request_words
from udfs import columns

SLICE_ROWS = 500_000  # keys joined at once, about (each side)


def join_keys(plan, spec: KeySpec, keyed: list, rekey: KeySpec | None, result,
              earlier_rows: int) -> None:
    """Each new row's earlier input row, into ``result`` (a ReusePlan: its ``at``, ``count``,
    ``file_rows``, ``earlier_rows``, ``dropped``, ``failed``); ``keyed``: (file, its Footer)
    each; ``rekey``: the earlier rows keyed again by it (pipelines/reuse/find.py says when)."""
    with tempfile.TemporaryDirectory(prefix="overnight-reuse-") as spill:
        slices = max(1, -(-max(plan.input.num_rows, earlier_rows) // SLICE_ROWS))
        new = _Spill(spill, "new", slices)
        _spill_new(plan, spec, new)
        old = _Spill(spill, "old", slices)
        result.file_rows = _spill_old(keyed, old, rekey, plan.config.input.id_column)
        result.earlier_rows = old.rows
        # 5 bytes a new row where they fit (the earlier output under 2^31 rows, a row's
        # samples under 256): the driver's one array the size of the table
        result.at = np.full(plan.input.num_rows, -1,
                            np.int32 if result.file_rows[-1] < 2**31 - 1 else np.int64)
        result.count = np.zeros(plan.input.num_rows, np.min_scalar_type(max(old.most, 1)))
        for i in range(slices):
            _join(new.read(i), old.read(i), result)


class _Spill:
    """Keys spilled to local files by their leading bits: each slice joins in memory."""

    DTYPE = {"new": np.dtype([("high", "<u8"), ("low", "<u8"), ("row", "<i8")]),
             "old": np.dtype([("high", "<u8"), ("low", "<u8"), ("row", "<i8"),
                              ("count", "<i4"), ("ok", "?")])}

    def __init__(self, folder: str, side: str, slices: int):
        self.dtype = self.DTYPE[side]
        self.paths = [os.path.join(folder, f"{side}-{i}.bin") for i in range(slices)]
        self.slices = slices
        self.rows = 0
        self.most = 0  # the old side's: the most rows an input row had (its samples)

    def add(self, records: np.ndarray) -> None:
        self.rows += len(records)
        if "count" in records.dtype.names and len(records):
            self.most = max(self.most, int(records["count"].max()))
        which = (records["high"] % np.uint64(self.slices)).astype(np.int64)
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(1, self.slices))
        for i, rows in enumerate(np.split(order, cuts)):
            if len(rows):
                with open(self.paths[i], "ab") as handle:
                    handle.write(records[rows].tobytes())

    def read(self, i: int) -> np.ndarray:
        if not os.path.exists(self.paths[i]):
            return np.empty(0, self.dtype)
        data = np.fromfile(self.paths[i], self.dtype)
        os.remove(self.paths[i])
        return data



def _spill_new(plan, spec: KeySpec, spill: _Spill) -> None:
    from pipelines.read import read_unit, read_units

    for unit in read_units(plan.input.blocks):
        for block in read_unit(unit, plan.input.schema):
            high, low = request_words(block, spec)
            records = np.empty(block.num_rows, spill.dtype)
            records["high"], records["low"] = high, low
            records["row"] = block.column(columns.ORDINAL).to_numpy()
            spill.add(records)


def _spill_old(keyed: list, spill: _Spill, rekey: KeySpec | None = None,
               id_column: str | None = None) -> np.ndarray:
    """Each earlier input row (its run of rows: its samples, or a job of steps' fan-out): its
    key, first row (across the files), rows, and whether all of them succeeded. Returns each
    file's first row, and the rows in all, last. ``keyed``: (file, its Footer) each;
    ``rekey``: the rows keyed again by it, from their own values, not read from their
    request_key; ``id_column``: this job's, where a file's job does not say its own."""
    starts = [0]
    for file, footer in keyed:
        names = footer.names
        same = _id_column(footer, id_column)
        wanted = [columns.REQUEST_KEY, columns.ERROR,
                  *([columns.SAMPLE_INDEX] if columns.SAMPLE_INDEX in names else []),
                  *([same] if same is not None else [])]
        if rekey is not None:
            wanted += [c if c != columns.ORDINAL else columns.ROW_ID for c in rekey.columns]
        with file.open() as handle:
            table = pq.ParquetFile(handle).read(columns=list(dict.fromkeys(wanted)))
        n = table.num_rows
        if n:
            if rekey is None:
                high, low, valid = key_words(table.column(columns.REQUEST_KEY))
            else:
                if columns.ORDINAL in rekey.columns:  # a seed by the row's position then
                    table = table.append_column(columns.ORDINAL, table.column(columns.ROW_ID))
                high, low = request_words(table, rekey)
                valid = table.column(columns.REQUEST_KEY).is_valid().to_numpy(
                    zero_copy_only=False)
            firsts = np.flatnonzero(_input_rows(table, high, low, same,
                                                "steps" in (footer.job.get("request_key")
                                                            or {})))
            failed = table.column(columns.ERROR).is_valid().to_numpy(zero_copy_only=False)
            failed |= ~valid
            records = np.empty(len(firsts), spill.dtype)
            records["high"], records["low"] = high[firsts], low[firsts]
            records["row"] = firsts + starts[-1]
            records["count"] = np.diff(np.append(firsts, n))
            records["ok"] = np.add.reduceat(failed.astype(np.int32), firsts) == 0
            spill.add(records)
        starts.append(starts[-1] + n)
    return np.asarray(starts, np.int64)


def _id_column(footer: Footer, id_column: str | None) -> str | None:
    """The earlier file's column that names its input rows: row_id, or its job's id column
    (its metadata says; else this job's), where the file has it."""
    for name in (columns.ROW_ID, footer.job.get("id_column"), id_column):
        if name is not None and name in footer.names:
            return name
    return None


def _input_rows(table: pa.Table, high: np.ndarray, low: np.ndarray, same: str | None,
                steps: bool) -> np.ndarray:
    """Where each earlier input row's rows start (a bool a row). Two neighbouring input rows
    may ask for one request (a greedy job's duplicate texts under two ids): they are told
    apart by their ids, and by sample_index, never by their keys alone. A one-prompt job's
    input row is its samples (sample_index from 0), or one row; a job of steps', its rows of
    one id."""
    n = table.num_rows
    new_run = np.ones(n, bool)
    new_run[1:] = (high[1:] != high[:-1]) | (low[1:] != low[:-1])
    if not steps:
        if columns.SAMPLE_INDEX in table.column_names:
            new_run |= pc.fill_null(pc.equal(table.column(columns.SAMPLE_INDEX), 0),
                                    True).to_numpy(zero_copy_only=False)
        else:
            new_run[:] = True
    if same is not None:
        ids = table.column(same).combine_chunks()
        new_run[1:] |= ~pc.fill_null(pc.equal(ids[1:], ids[:-1]), False).to_numpy(
            zero_copy_only=False)
    return new_run


def _join(new: np.ndarray, old: np.ndarray, result) -> None:
    """One slice: each new row's earlier input row, matched by (key, occurrence): the k-th new
    row with a key (in the new table's order) takes the k-th earlier input row with it (in
    the earlier output's order), so each earlier row is carried over once at most and two new
    rows never share one. Rows share a key where their requests are the same (a greedy
    job's duplicate texts): which of the earlier ones a new row takes changes nothing but
    which ids they came from."""
    if len(old) == 0:
        return
    old = old[np.lexsort((old["row"], old["low"], old["high"]))]
    new = new[np.lexsort((new["row"], new["low"], new["high"]))]
    high = np.concatenate([old["high"], new["high"]])
    low = np.concatenate([old["low"], new["low"]])
    occurrence = np.concatenate([_occurrences(old), _occurrences(new)])
    side = np.repeat(np.array([0, 1], np.int8), [len(old), len(new)])
    order = np.lexsort((side, occurrence, low, high))
    # an earlier row directly followed by a new one of the same (key, occurrence): a match
    h, lo, occ, sd = high[order], low[order], occurrence[order], side[order]
    pair = ((h[:-1] == h[1:]) & (lo[:-1] == lo[1:]) & (occ[:-1] == occ[1:])
            & (sd[:-1] == 0) & (sd[1:] == 1))
    earlier, later = order[:-1][pair], order[1:][pair] - len(old)
    # earlier rows the new table asks for again: not dropped
    result.dropped += len(old) - len(earlier)
    ok = old["ok"][earlier]
    result.failed += int((~ok).sum())
    rows = new["row"][later][ok]
    result.at[rows] = old["row"][earlier][ok]
    result.count[rows] = old["count"][earlier][ok]


def _occurrences(records: np.ndarray) -> np.ndarray:
    """For records sorted by key: each one's place among those with its key (0, 1, ...)."""
    n = len(records)
    if n == 0:
        return np.zeros(0, np.int64)
    first = np.ones(n, bool)
    first[1:] = (records["high"][1:] != records["high"][:-1]) | \
        (records["low"][1:] != records["low"][:-1])
    starts = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    return np.arange(n) - starts

