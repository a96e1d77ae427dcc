"""The scan: every file read once, cheaply (Parquet footers; JSONL line by line), before any
engine starts. It reports the first unreadable file or malformed line with its location, checks
the id column (nulls, repeats) without holding its values, and records where each block of
``block_rows`` rows starts: blocks are numbered by the ordinal of their first row, so the same
input always cuts the same way and a resumed job skips the blocks already written.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
from dataclasses import dataclass, field

import msgspec
import pyarrow as pa

from pipelines.errors import InputError
from pipelines.read.files import parquet_file, resolve_files
from pipelines.read.schema import as_json_text, merge_schema, unify
from pipelines.storage import Location, redact
from udfs import columns


@dataclass(frozen=True)
class Block:
    """Rows [ordinal, ordinal + num_rows) of the input; in ``path`` they start at ``offset``
    (a row index for Parquet, a byte offset for JSONL)."""

    path: Location
    format: str
    ordinal: int
    num_rows: int
    offset: int
    group_start: int = 0  # Parquet: the first row of the row group holding the block's first


class IdDigest:
    """The id column as 8-byte hashes, to find nulls and repeats in a table of any size
    without holding its values in the driver (a Python list of ids cost ~100 bytes a row)."""

    def __init__(self):
        self.nulls = 0
        # a float id column's first NaN, by row: NaN equals nothing, not even another NaN, so
        # two of them would pass as two ids (and a row's samples as rows of their own)
        self.nan_at: int | None = None
        self.rows = 0  # the ids added so far (added in row order)
        self._hashes: list = []  # numpy uint64 arrays, one per chunk added

    def add(self, values) -> None:
        from udfs.rows import to_polars

        # (to_polars: any Arrow type, a decimal256 too, which polars' own import panics on)
        series = to_polars.series(values if isinstance(values, (pa.Array, pa.ChunkedArray))
                                  else _id_array(values))
        if self.nan_at is None and series.dtype.is_float():
            nans = series.is_nan().fill_null(False)
            if nans.any():
                self.nan_at = self.rows + int(nans.arg_true()[0])
        self.rows += len(series)
        self.nulls += series.null_count()
        self._hashes.append(series.drop_nulls().hash(seed=0).to_numpy())

    def repeated(self) -> set[int]:
        """Hashes seen more than once (a repeat, or rarely two ids that share a hash). Sorted
        in place and compared with their neighbours: 8 bytes a row and a bit more, where a
        hash table takes many times that for a moment. Asked once: the hashes go."""
        import numpy as np

        if not self._hashes:
            return set()
        # one array, each chunk let go once copied (concatenated, they were held twice), and
        # let go itself once looked at: a 10M-row table's 80 MB, not 160 for the whole run
        hashes = np.empty(sum(len(h) for h in self._hashes), np.uint64)
        at = 0
        for i, chunk in enumerate(self._hashes):
            hashes[at:at + len(chunk)] = chunk
            at += len(chunk)
            self._hashes[i] = None
        self._hashes = []
        hashes.sort()
        same = np.flatnonzero(hashes[1:] == hashes[:-1])
        return set(hashes[same].tolist())


def _id_array(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # mixed kinds: as JSON text
        return pa.array([None if v is None else json.dumps(v, sort_keys=True) for v in values])


@dataclass
class InputPlan:
    files: list[Location]
    format: str
    schema: pa.Schema
    blocks: list[Block]
    num_rows: int
    ids: IdDigest | None = field(default=None, repr=False)  # the id column, when one is named
    data_bytes: int = 0  # the rows' size, about: Parquet's uncompressed sizes, JSONL's text

    def fingerprint_parts(self) -> list[dict]:
        """What identifies the input for resume: each file's path, size and mtime."""
        out = []
        for file in self.files:
            size, mtime_ns = file.stat()
            out.append({"path": os.path.abspath(file.path) if file.local else str(file),
                        "size": size, "mtime_ns": mtime_ns})
        return out


def scan_input(path: str, fmt: str, block_rows: int, id_column: str | None,
               resolved: tuple[list[Location], str] | None = None) -> InputPlan:
    """Check every file and plan the blocks. Raises InputError naming the first problem.
    ``resolved``: ``resolve_files(path, fmt)``, when the caller has it already."""
    files, fmt = resolved or resolve_files(path, fmt)
    scan = _scan_parquet if fmt == "parquet" else _scan_jsonl
    schemas, blocks, ids = [], [], IdDigest() if id_column else None
    ordinal = data_bytes = 0
    big_ints: dict = {}  # JSONL: (file, column) -> (an integer past 2^53, its line)
    for file in files:
        schema, file_blocks, size = scan(file, ordinal, block_rows, id_column, ids, big_ints)
        if schema is not None:
            schemas.append((file, schema))
        blocks.extend(file_blocks)
        data_bytes += size
        ordinal += sum(b.num_rows for b in file_blocks)
    if ordinal == 0:
        raise InputError(f"input.path {redact(path)!r}: the input has no rows")
    schema = as_json_text(unify(schemas, fmt, big_ints))
    for name in schema.names:
        if name.startswith(columns.INTERNAL_PREFIX):
            raise InputError(f"column {name!r}: names starting with "
                             f"{columns.INTERNAL_PREFIX!r} are reserved")
    return InputPlan(files=files, format=fmt, schema=schema, blocks=blocks, num_rows=ordinal,
                     ids=ids, data_bytes=data_bytes)


def _scan_parquet(file, ordinal, block_rows, id_column, ids, big_ints):
    try:
        meta = parquet_file(file)
        num_rows = meta.metadata.num_rows
        schema = meta.schema_arrow
        if id_column is not None and id_column in schema.names:
            for group in range(meta.metadata.num_row_groups):  # one group's ids at a time
                ids.add(meta.read_row_group(group, columns=[id_column]).column(0))
        groups = [meta.metadata.row_group(g) for g in range(meta.metadata.num_row_groups)]
        starts = [0, *itertools.accumulate(group.num_rows for group in groups)]
        size = sum(group.total_byte_size for group in groups)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{file}: not a readable Parquet file: {exc}") from None
    blocks = []
    for start in range(0, num_rows, block_rows):
        rows = min(block_rows, num_rows - start)
        group_start = starts[bisect.bisect_right(starts, start) - 1]
        blocks.append(Block(file, "parquet", ordinal + start, rows, start, group_start))
    return schema, blocks, size


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows tools write at a file's start


def _scan_jsonl(file, ordinal, block_rows, id_column, ids, big_ints):
    blocks, schema, rows, lines = [], None, [], []
    block_start_offset, offset = 0, 0
    first = ordinal
    try:
        handle = file.open()
    except OSError as exc:
        raise InputError(f"{file}: cannot open: {exc.strerror or exc}") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            row = _parse_jsonl_line(raw.removeprefix(BOM) if lineno == 1 else raw, file,
                                    lineno)
            offset += len(raw)
            if row is None:
                continue
            rows.append(row)
            lines.append(lineno)
            if len(rows) == block_rows:
                if id_column is not None:
                    ids.add([r.get(id_column) for r in rows])
                schema = merge_schema(schema, rows, file, lines, big_ints)
                blocks.append(Block(file, "jsonl", first, len(rows), block_start_offset))
                first += len(rows)
                rows, lines, block_start_offset = [], [], offset
        if rows:
            if id_column is not None:
                ids.add([r.get(id_column) for r in rows])
            schema = merge_schema(schema, rows, file, lines, big_ints)
            blocks.append(Block(file, "jsonl", first, len(rows), block_start_offset))
    return schema, blocks, offset


def blank(raw: bytes) -> bool:
    """A line with nothing but JSON's own whitespace; the scan and the reads agree on it
    (Python's str.strip() would also drop U+00A0, which json.loads refuses)."""
    return not raw.strip(b" \t\r\n")


def loads(raw: bytes):
    """A JSONL line's value, as ``json.loads`` gives it. msgspec's decoder is twice as fast on
    the common line; whatever it refuses (NaN, a lone surrogate, 1e400, a malformed line)
    goes to ``json.loads``, which accepts the same lines as before or says why not."""
    try:
        return _DECODE(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(raw)


_DECODE = msgspec.json.Decoder().decode


def _parse_jsonl_line(raw: bytes, file: str, lineno: int) -> dict | None:
    if blank(raw):
        return None
    try:
        row = _DECODE(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    else:
        if isinstance(row, dict):
            return row
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{file}:{lineno}: not valid UTF-8 (byte {exc.start})") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{file}:{lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(row, dict):
        raise InputError(f"{file}:{lineno}: expected a JSON object, got {type(row).__name__}")
    return row
