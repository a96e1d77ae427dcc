"""One schema for the whole input, settled before any engine starts.

Files of one table may disagree on a column's type: a type is widened only where no value can
change (``unify``), else the scan stops in one line naming the column and two files. Values that
no Arrow type holds (JSON integers past int64, empty structs) are kept as JSON text.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.errors import InputError, one_line
from pipelines.read.files import parquet_file
from pipelines.storage import Location


def unify(schemas: list[tuple[Location, pa.Schema]], fmt: str,
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
                                 f"{one_line(exc, None)}") from None
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
    extremes = pc.min_max(parquet_file(file).read(columns=[name]).column(0)).as_py()
    return extremes["min"], extremes["max"]


def _int_range(type_: pa.DataType) -> tuple[int, int]:
    bits = type_.bit_width
    if pa.types.is_unsigned_integer(type_):
        return 0, 2 ** bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


JSON_TEXT = {b"overnight.json_text": b"1"}  # field metadata: values kept as JSON text


def as_json_text(schema: pa.Schema) -> pa.Schema:
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


def merge_schema(schema, rows, file, lines, big_ints):
    values = _rows_array(rows, file, lines)
    block_schema = pa.schema(values.type)
    _note_big_ints(values, file, lines, big_ints)
    if schema is None:
        return block_schema
    try:
        return pa.unify_schemas([schema, block_schema], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"{file} (lines up to {lines[-1]}): values of mixed types: "
                         f"{one_line(exc, None)}") from None


def _note_big_ints(values: pa.StructArray, file, lines: list[int], big_ints: dict) -> None:
    """The first integer past 2^53 of each integer column of a block, with its line, unless
    one is noted already: a float under the same key elsewhere would round it (unify)."""
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
                         f"{one_line(exc, None)}") from None


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# field metadata: the column's name in the files, where the plan reads it under another
# (pre-flight names an earlier overnight job's columns apart: pipelines/plan/input_checks.py)
SOURCE_NAME = b"overnight.source_name"


def renamed(fld: pa.Field, name: str) -> pa.Field:
    """``fld`` under ``name``, read from the files under its own name."""
    return pa.field(name, fld.type, fld.nullable,
                    {**(fld.metadata or {}), SOURCE_NAME: fld.name.encode()})


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
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
