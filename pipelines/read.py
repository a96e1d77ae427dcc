"""Reading the input table: find the files, check them, cut them into ordered blocks.

The scan reads every file once, cheaply (Parquet footers; JSONL line by line), before any engine
starts: it reports the first unreadable file or malformed line with its location, settles one
schema for the whole input, and records where each block of ``block_rows`` rows starts. Blocks
are numbered by the ordinal of their first row, so the same input always cuts the same way and
a resumed job can skip the blocks already written.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterator
from pathlib import PurePosixPath

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray.data
from ray.data import ExecutionResources
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from pipelines.errors import InputError
from pipelines.storage import Location, redact
from udfs import columns

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}


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
        self._hashes: list = []  # numpy uint64 arrays, one per chunk added

    def add(self, values) -> None:
        import polars as pl

        series = pl.from_arrow(values if isinstance(values, (pa.Array, pa.ChunkedArray))
                               else _id_array(values))
        self.nulls += series.null_count()
        self._hashes.append(series.drop_nulls().hash(seed=0).to_numpy())

    def repeated(self) -> set[int]:
        """Hashes seen more than once (a repeat, or rarely two ids that share a hash). Sorted
        in place and compared with their neighbours: 8 bytes a row and a bit more, where a
        hash table of 10M ids took 600 MiB more for a moment."""
        import numpy as np

        if not self._hashes:
            return set()
        hashes = np.concatenate(self._hashes)
        self._hashes = [hashes]  # the chunks go
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


def resolve_files(path: str, fmt: str = "auto") -> tuple[list[Location], str]:
    """The input files a path names (a file, a directory or a glob; local or on an object
    store such as ``s3://``), sorted, and their format."""
    try:
        where = Location.of(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"input.path {redact(path)!r}: {' '.join(str(exc).split())}") from None
    shown = str(where)
    try:
        if any(ch in where.path for ch in "*?["):
            files = _glob(where)
            if not files:
                raise InputError(f"input.path {shown!r}: the glob matches no file")
        elif where.is_dir():
            files = [f for f in where.files() if _suffix(f) in FORMATS and _visible(f, where)]
            if not files:
                raise InputError(f"input.path {shown!r}: the directory holds no .parquet or "
                                 ".jsonl file")
        elif where.is_file():
            files = [where]
        else:
            raise InputError(f"input.path {shown!r}: no such file or directory")
    except OSError as exc:  # an object store refusing: credentials, bucket, network
        raise InputError(f"input.path {shown!r}: {' '.join(str(exc).split())[:300]}") from None

    if fmt == "auto":
        kinds = {FORMATS.get(_suffix(f)) for f in files}
        if None in kinds:
            odd = next(f for f in files if _suffix(f) not in FORMATS)
            raise InputError(f"{odd}: unknown format; name it .parquet or .jsonl, "
                             "or set input.format")
        if len(kinds) > 1:
            raise InputError(f"input.path {shown!r}: mixes Parquet and JSONL files")
        fmt = kinds.pop()
    return files, fmt


def _suffix(file: Location) -> str:
    return PurePosixPath(file.name).suffix.lower()


def _visible(file: Location, root: Location) -> bool:
    """Not hidden: no name below ``root`` starts with "." or "_" (``.ipynb_checkpoints/``,
    Spark's ``_temporary/`` and ``_SUCCESS``, editors' ``.~lock`` files)."""
    if root.local:
        below = os.path.relpath(file.path, root.path)
    else:
        below = file.path.removeprefix(root.path.rstrip("/")).strip("/")
    return not any(part.startswith((".", "_")) for part in below.split("/") if part != "..")


def _glob(where: Location) -> list[Location]:
    fixed = []  # the pattern's leading folders without a wildcard
    for segment in where.path.split("/"):
        if any(ch in segment for ch in "*?["):
            break
        fixed.append(segment)
    root = Location("/".join(fixed) or ".", where.fs, where.scheme)
    if where.local:
        found = [Location(p) for p in sorted(glob.glob(where.path, recursive=True))
                 if os.path.isfile(p)]
    else:  # object stores have no glob: list below the fixed prefix, then match
        pattern = glob_regex(where.path)
        found = [f for f in root.files() if pattern.fullmatch(f.path)]
    return [f for f in found if _visible(f, root)]


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as the local filesystem's reads it: ``*``, ``?`` and ``[...]`` stay within one
    folder name; ``**/`` spans any number of folders."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


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
    schema = _as_json_text(_unify(schemas, fmt, big_ints))
    for name in schema.names:
        if name.startswith(columns.INTERNAL_PREFIX):
            raise InputError(f"column {name!r}: names starting with "
                             f"{columns.INTERNAL_PREFIX!r} are reserved")
    return InputPlan(files=files, format=fmt, schema=schema, blocks=blocks, num_rows=ordinal,
                     ids=ids, data_bytes=data_bytes)


def _unify(schemas: list[tuple[Location, pa.Schema]], fmt: str,
           big_ints: dict | None = None) -> pa.Schema:
    """One schema for the files of an input. The policy, for a column whose type differs
    between files:

    - a dictionary-encoded column (a polars or pandas categorical) is read as its values'
      type, so it meets plain strings as strings;
    - types widen as Arrow's permissive promotion widens them (int32 -> int64, float32 ->
      float64, string -> large_string, a struct's fields merged, a column missing from a file
      null there), but only where no value changes: each file's values are checked against
      the widened type (``_check_lossless``): integers against the widened integer's range
      (uint64 past 2^63 does not fit int64), integers past 2^53 against a float, a decimal
      against a float (at most 15 digits survive one), against a wider decimal or an integer
      (its digits and scale kept); a JSONL integer past 2^53 against a float under the same
      key, in any file or line (``_note_big_ints``);
    - anything else is refused, in one line naming the column and two files that disagree.
    """
    plain = [(file, _plain_types(schema)) for file, schema in schemas]
    unified = plain[0][1]
    for file, schema in plain[1:]:
        try:
            unified = pa.unify_schemas([unified, schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            name = next((f.name for f in schema if f.name in unified.names
                         and f.type != unified.field(f.name).type), None)
            if name is None:
                raise InputError(f"{file}: its columns do not match the other files: "
                                 f"{' '.join(str(exc).split())}") from None
            other = next(f for f, sch in plain if name in sch.names
                         and sch.field(name).type != schema.field(name).type)
            raise InputError(f"column {name!r} is {schema.field(name).type} in {file} but "
                             f"{_type_in(plain, other, name)} in {other}, which have no "
                             "common type; give it one type in every file") from None
    for (shown, name), (value, lineno) in (big_ints or {}).items():
        if pa.types.is_floating(unified.field(name).type):  # JSONL: within a file too
            other = next((f for f, sch in plain if name in sch.names
                          and pa.types.is_floating(sch.field(name).type)), shown)
            where = "on another line" if str(other) == shown else f"in {other}"
            raise InputError(f"{shown}:{lineno}: column {name!r} holds the integer {value}, "
                             f"but is a float {where}, which would round it; write it as a "
                             "string, or give the column one type throughout")
    if fmt == "parquet":  # a JSONL file's other values were checked as they were parsed
        for file, schema in plain:
            for fld in schema:
                target = unified.field(fld.name).type
                if fld.type != target:
                    other = next((f for f, sch in plain if fld.name in sch.names
                                  and sch.field(fld.name).type != fld.type), file)
                    _check_lossless(file, fld, target, other)
    return unified


def _type_in(plain: list, file, name: str) -> pa.DataType:
    return next(sch.field(name).type for f, sch in plain if f == file)


def _plain_types(schema: pa.Schema) -> pa.Schema:
    """``schema`` with each dictionary-encoded column as its values' type."""
    return pa.schema([fld.with_type(fld.type.value_type) if pa.types.is_dictionary(fld.type)
                      else fld for fld in schema], metadata=schema.metadata)


MAX_EXACT_FLOAT = 2 ** 53  # integers beyond it do not survive a float64
FLOAT_DIGITS = 15  # decimal digits any float64 keeps (DBL_DIG)


def _check_lossless(file: Location, fld: pa.Field, target: pa.DataType, other) -> None:
    """InputError, in one line naming the column and both files, where this Parquet file's
    values of column ``fld`` would change as ``target``, the type another file (``other``)
    gives it; an integer column's extremes are read for it."""
    source, name = fld.type, fld.name

    def refuse(what: str):
        raise InputError(f"column {name!r} is {source} in {file} but {target} in the input "
                         f"as a whole (from {other}): {what}; give it one type in every file")
    if pa.types.is_integer(source) and (pa.types.is_integer(target)
                                        or pa.types.is_floating(target)
                                        or pa.types.is_decimal(target)):
        low, high = _extremes(file, name)
        if low is None:
            return
        if pa.types.is_integer(target):
            info = _int_range(target)
            if low < info[0] or high > info[1]:
                refuse(f"it holds {high if high > info[1] else low}, which {target} cannot")
        elif pa.types.is_floating(target):
            biggest = max(abs(low), abs(high))
            if biggest > MAX_EXACT_FLOAT:
                refuse(f"it holds integers up to {biggest}, which a float would round")
        elif len(str(max(abs(low), abs(high)))) > target.precision - target.scale:
            refuse(f"it holds {max(abs(low), abs(high))}, which {target} cannot")
    elif pa.types.is_decimal(source):
        if pa.types.is_floating(target):
            if source.precision > FLOAT_DIGITS:
                refuse(f"a float keeps {FLOAT_DIGITS} digits, not {source.precision}")
        elif not (pa.types.is_decimal(target) and target.scale >= source.scale
                  and target.precision - target.scale >= source.precision - source.scale):
            refuse("its digits would not all survive")


def _extremes(file: Location, name: str) -> tuple:
    extremes = pc.min_max(_parquet(file).read(columns=[name]).column(0)).as_py()
    return extremes["min"], extremes["max"]


def _int_range(type_: pa.DataType) -> tuple[int, int]:
    bits = type_.bit_width
    if pa.types.is_unsigned_integer(type_):
        return 0, 2 ** bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


JSON_TEXT = {b"overnight.json_text": b"1"}  # field metadata: values kept as JSON text


def _as_json_text(schema: pa.Schema) -> pa.Schema:
    """Columns whose type holds an empty struct (``{}`` in every row), which Parquet cannot
    store, become their values' JSON text."""
    fields = [pa.field(f.name, pa.string(), metadata=JSON_TEXT) if _has_empty_struct(f.type)
              else f for f in schema]
    return pa.schema(fields, metadata=schema.metadata)


def _has_empty_struct(type_: pa.DataType) -> bool:
    if pa.types.is_struct(type_):
        return type_.num_fields == 0 or any(_has_empty_struct(f.type) for f in type_)
    if pa.types.is_list(type_) or pa.types.is_large_list(type_) or \
            pa.types.is_fixed_size_list(type_):
        return _has_empty_struct(type_.value_type)
    if pa.types.is_map(type_):
        return _has_empty_struct(type_.key_type) or _has_empty_struct(type_.item_type)
    return False


def _scan_parquet(file, ordinal, block_rows, id_column, ids, big_ints):
    try:
        meta = _parquet(file)
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
                schema = _merge_schema(schema, rows, file, lines, big_ints)
                blocks.append(Block(file, "jsonl", first, len(rows), block_start_offset))
                first += len(rows)
                rows, lines, block_start_offset = [], [], offset
        if rows:
            if id_column is not None:
                ids.add([r.get(id_column) for r in rows])
            schema = _merge_schema(schema, rows, file, lines, big_ints)
            blocks.append(Block(file, "jsonl", first, len(rows), block_start_offset))
    return schema, blocks, offset


def _blank(raw: bytes) -> bool:
    """A line with nothing but JSON's own whitespace; the scan and the reads agree on it
    (Python's str.strip() would also drop U+00A0, which json.loads refuses)."""
    return not raw.strip(b" \t\r\n")


def _loads(raw: bytes):
    """A JSONL line's value, as ``json.loads`` gives it. msgspec's decoder is twice as fast on
    the common line; whatever it refuses (NaN, a lone surrogate, 1e400, a malformed line)
    goes to ``json.loads``, which accepts the same lines as before or says why not."""
    try:
        return _DECODE(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(raw)


_DECODE = msgspec.json.Decoder().decode


def _parse_jsonl_line(raw: bytes, file: str, lineno: int) -> dict | None:
    if _blank(raw):
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


def _merge_schema(schema, rows, file, lines, big_ints):
    values = _rows_array(rows, file, lines)
    block_schema = pa.schema(values.type)
    _note_big_ints(values, file, lines, big_ints)
    if schema is None:
        return block_schema
    try:
        return pa.unify_schemas([schema, block_schema], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{file} (lines up to {lines[-1]}): values of mixed types: "
                         f"{' '.join(str(exc).split())}") from None


def _note_big_ints(values: pa.StructArray, file, lines: list[int], big_ints: dict) -> None:
    """The first integer past 2^53 of each integer column of a block, with its line, unless
    one is noted already: a float under the same key elsewhere would round it (_unify)."""
    for i, fld in enumerate(values.type):
        if not pa.types.is_integer(fld.type) or (str(file), fld.name) in big_ints:
            continue
        column = pc.abs(values.field(i))
        big = pc.indices_nonzero(pc.fill_null(pc.greater(column, MAX_EXACT_FLOAT), False))
        if len(big):
            at = big[0].as_py()
            big_ints[(str(file), fld.name)] = (values.field(i)[at].as_py(), lines[at])


def _rows_array(rows: list[dict], file, lines: list[int]) -> pa.StructArray:
    """The rows as Arrow values: the columns of every row (not only the first row's: sparse
    keys are the norm), and their types; a value Arrow cannot hold is named with its line."""
    try:
        return pa.array(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError) as exc:
        for row, lineno in zip(rows, lines):
            for key, value in row.items():
                try:
                    pa.array([value])
                except OverflowError:
                    raise InputError(f"{file}:{lineno}: column {key!r}: "
                                     f"{_short(value)} does not fit a 64-bit integer; "
                                     "write it as a string") from None
                except UnicodeEncodeError:
                    raise InputError(f"{file}:{lineno}: column {key!r}: a string holds a "
                                     "lone surrogate escape (such as \\ud800), which is not "
                                     "text UTF-8 can hold") from None
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    pass
        raise InputError(f"{file} (lines {lines[0]}-{lines[-1]}): values of mixed types: "
                         f"{' '.join(str(exc).split())}") from None


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_block(block: Block, schema: pa.Schema) -> pa.Table:
    """The rows of one block, cast to the input's schema, with their ordinals (pre-flight's
    samples; a job reads whole units)."""
    return next(read_unit(ReadUnit((block,)), schema))


def _parquet(file: Location) -> pq.ParquetFile:
    """A local file by path (Arrow opens and closes it), a remote one through its filesystem."""
    return pq.ParquetFile(file.path if file.local else file.open())


def _jsonl_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    as_text = [f.name for f in schema if f.metadata == JSON_TEXT]
    for row in rows:
        for name in as_text:
            if row.get(name) is not None:
                row[name] = json.dumps(row[name], ensure_ascii=False)
    return pa.Table.from_pylist(rows, schema=schema)


# field metadata: the column's name in the files, where the plan reads it under another
# (pre-flight names an earlier overnight job's columns apart: pipelines/preflight.py)
SOURCE_NAME = b"overnight.source_name"


def renamed(fld: pa.Field, name: str) -> pa.Field:
    """``fld`` under ``name``, read from the files under its own name."""
    return pa.field(name, fld.type, fld.nullable,
                    {**(fld.metadata or {}), SOURCE_NAME: fld.name.encode()})


def earlier_job(files: list[Location]) -> dict | None:
    """What an input written by overnight says of the job that wrote it (the metadata of its
    first file: columns.JOB_METADATA), or None."""
    if not files or _suffix(files[0]) != ".parquet":
        return None
    try:
        found = (_parquet(files[0]).schema_arrow.metadata or {}).get(columns.JOB_METADATA)
        return json.loads(found) if found else None
    except (OSError, ValueError, pa.ArrowException):  # the scan says what is wrong with it
        return None


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Give a block the input's full schema: missing columns as nulls, same types and order."""
    arrays, fields = [], []
    for fld in schema:
        meta = dict(fld.metadata or {})
        source = meta.pop(SOURCE_NAME, b"").decode() or fld.name
        if source in table.column_names:
            arrays.append(table.column(source).cast(fld.type))
        else:
            arrays.append(pa.nulls(table.num_rows, fld.type))
        # the block's column is named as the plan names it (and its output's file says so)
        fields.append(fld.with_metadata(meta) if source != fld.name else fld)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))



UNIT_ROWS = 16_384  # rows a read task covers at least (then up to its row group's end)


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
        ordinals = pa.array(range(block.ordinal, block.ordinal + block.num_rows), pa.int64())
        yield _conform(table, schema).append_column(columns.ORDINAL, ordinals)


def _parquet_blocks(unit: ReadUnit) -> Iterator[pa.Table]:
    """The unit's row groups, streamed once and cut into its blocks."""
    file = _parquet(unit.blocks[0].path)
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
                if not _blank(raw):
                    rows.append(_loads(raw))
            yield rows


class TableDatasource(Datasource):
    """One read task per read unit; every block it emits carries its rows' ordinals."""

    def __init__(self, blocks: list[Block], schema: pa.Schema,
                 only_rows: dict[int, list[int]] | None = None):
        super().__init__()
        self.units, self.schema = read_units(blocks), schema
        self.only_rows = only_rows or {}

    def estimate_inmemory_data_size(self):
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        schema, only = self.schema, self.only_rows

        def read(unit: ReadUnit) -> Iterator[pa.Table]:
            for block, table in zip(unit.blocks, read_unit(unit, schema)):
                yield table.take(only[block.ordinal]) if block.ordinal in only else table

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
    per_block = ray_block_rows(rows, block_rows, slots)
    # Reading is light: a fraction of a CPU, so it never starves the engine on a small machine.
    # One task per read unit; asking for this many output blocks makes Ray Data cut each
    # unit's output into pieces of about ``per_block`` rows.
    ds = ray.data.read_datasource(TableDatasource(todo, plan.schema, only_rows),
                                  num_cpus=0.25, override_num_blocks=-(-rows // per_block))
    options = ds.context.execution_options  # this dataset's own (a copy of the session's)
    options.resource_limits = options.resource_limits.min(ExecutionResources.for_limits(
        object_store_memory=read_ahead_bytes(plan, per_block, slots)))
    return ds, per_block


RAY_BLOCK_ROWS = 4096  # rows a Ray Data block carries, at most, once a job is large enough
ROUNDS = 8  # Ray Data blocks per engine slot, at least: the job's tail waits on one at most
READ_AHEAD_MIN = 256 << 20  # bytes of input read ahead of the engines, at least
READ_AHEAD_BLOCKS = 4  # Ray Data blocks read ahead per engine slot, at least


def read_ahead_bytes(plan: InputPlan, per_block: int, slots: int) -> int:
    """How much of the input Ray Data may hold, read but not yet written (its object store
    budget for the job). Reading is many times faster than any engine: left to its default
    (half the object store, 30% of the machine's memory) it reads a large table far ahead,
    and the memory that holds it grows with the table. A few blocks per engine slot keep
    every engine fed."""
    per_row = plan.data_bytes / max(plan.num_rows, 1)
    return max(READ_AHEAD_MIN, int(per_row * per_block * READ_AHEAD_BLOCKS * max(slots, 1)))


PARTS_AT_LEAST = 16  # a table's plan blocks, at least (each is committed as it is done)
BLOCK_ROWS_AT_LEAST = 8  # ... unless that would make blocks smaller than this


def plan_block_rows(rows: int, batch_size: int) -> int:
    """The rows of the plan's blocks: ``resources.batch_size``, or fewer in a table too
    small to have ``PARTS_AT_LEAST`` blocks of it. A block is the unit the writer commits: a
    400-row table in blocks of 256 rows committed nothing until its last row was done (a kill
    at 90% lost every row, and the progress line said 0 written the whole run). The engine
    holds as many rows at once as before (``blocks_at_once``), so only the parts are smaller;
    a large table keeps ``batch_size``, and so no more parts than before."""
    return min(batch_size, max(BLOCK_ROWS_AT_LEAST, -(-rows // PARTS_AT_LEAST)))


def blocks_at_once(blocks_in_flight: int, batch_size: int, block_rows: int,
                   blocks: int) -> int:
    """The plan blocks an engine holds at once: ``resources.blocks_in_flight`` blocks of
    ``batch_size`` rows' worth, whatever the plan's block (``plan_block_rows``), and no more
    than the job has."""
    scaled = blocks_in_flight * -(-batch_size // max(block_rows, 1))
    return max(blocks_in_flight, min(scaled, blocks))


def ray_block_rows(rows: int, block_rows: int, slots: int) -> int:
    """The rows of a Ray Data block, a whole number of the plan's blocks.

    A plan's block (``resources.batch_size`` rows) is the engine's unit of work and the
    writer's of commit, and the engine's stage cuts Ray Data's blocks back into them
    (udfs/chain.py). Each Ray Data block costs the driver ~8 KB of bookkeeping for the rest of
    the job, and a task to schedule: 10M rows in 256-row blocks would grow it by ~300 MiB. So
    a large job moves ~4,096-row blocks, and a small one keeps ``ROUNDS`` of them per slot:
    every engine has work, and the blocks left at the end are short."""
    per_slot = rows // (max(slots, 1) * ROUNDS)
    blocks = max(1, min(per_slot // block_rows, RAY_BLOCK_ROWS // block_rows))
    return blocks * block_rows
