"""Arrow values handed to polars: each column of a type polars cannot take as one it can.

Polars 2.1's Arrow import panics on a 256-bit decimal (a BigQuery BIGNUMERIC export), at any
depth (``PanicException: operator does not support primitive Int256``), and refuses
run-end-encoded arrays, list views, unions and month-day-nano intervals; a 32- or 64-bit
decimal inside a list or struct panics its row hash. Every place input
values meet polars (the request key's row hash, the id column's hashes, a step's filter) goes
through ``frame``/``series`` here, so such a column is read, never the job's end. The
conversion is for polars' eyes only: the output keeps each source column's own type.

- ``decimal256(p, s)`` with p <= 38, ``decimal32`` and ``decimal64``: ``decimal128(p, s)``,
  every value exact (polars holds every decimal as 128 bits);
- wider decimals: their exact text ("12345678901234567890123456789012345678901.5");
- dictionary and run-end encodings: their values; list views: lists;
- unions, intervals of months, days and nanoseconds, and anything else polars refuses: each
  value's text (JSON where it is a list or a struct), so equal values stay equal.
"""

from __future__ import annotations

import json

import pyarrow as pa

MAX_DECIMAL128 = 38  # digits


def polars_type(kind: pa.DataType) -> pa.DataType | None:
    """The type polars is handed a ``kind`` column as, or None where it takes it as it is."""
    if pa.types.is_decimal256(kind):
        return (pa.decimal128(kind.precision, kind.scale)
                if kind.precision <= MAX_DECIMAL128 else pa.string())
    if pa.types.is_decimal32(kind) or pa.types.is_decimal64(kind):
        return pa.decimal128(kind.precision, kind.scale)
    if pa.types.is_dictionary(kind) or pa.types.is_run_end_encoded(kind):
        return polars_type(kind.value_type) or kind.value_type
    if pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind):
        inner = kind.value_field.with_type(polars_type(kind.value_type) or kind.value_type)
        return pa.list_(inner) if pa.types.is_list_view(kind) else pa.large_list(inner)
    if pa.types.is_union(kind) or pa.types.is_interval(kind):
        return pa.string()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) \
            or pa.types.is_fixed_size_list(kind):
        inner = polars_type(kind.value_type)
        if inner is None:
            return None
        field = kind.value_field.with_type(inner)
        return (pa.list_(field) if pa.types.is_list(kind) else pa.large_list(field)
                if pa.types.is_large_list(kind) else pa.list_(field, kind.list_size))
    if pa.types.is_struct(kind):
        fields = [kind.field(i) for i in range(kind.num_fields)]
        changed = [polars_type(f.type) for f in fields]
        if all(c is None for c in changed):
            return None
        return pa.struct([f.with_type(c) if c is not None else f
                          for f, c in zip(fields, changed)])
    if pa.types.is_map(kind):
        key, item = polars_type(kind.key_type), polars_type(kind.item_type)
        if key is None and item is None:
            return None
        return pa.map_(key or kind.key_type, kind.item_field.with_type(item or kind.item_type))
    return None


def as_text(kind: pa.DataType) -> bool:
    """Whether polars sees a ``kind`` column's values, or some of them, as their text: a
    filter comparing them as numbers would be comparing text."""
    if pa.types.is_decimal256(kind):
        return kind.precision > MAX_DECIMAL128
    if pa.types.is_union(kind) or pa.types.is_interval(kind):
        return True
    if pa.types.is_struct(kind):
        return any(as_text(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return as_text(kind.key_type) or as_text(kind.item_type)
    if hasattr(kind, "value_type"):  # lists of every kind, dictionaries, run-end encodings
        return as_text(kind.value_type)
    return False


def ready(column: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """``column`` as polars can take it (the module docstring's rules), values kept: cast,
    else built again from its values (a cast of a list view with nulls once made an array
    with short offsets), else each value's text."""
    target = polars_type(column.type)
    if target is None:
        return column
    for convert in (_cast, _rebuilt):
        try:
            out = convert(column, target)
            out.validate(full=True)
            return out
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError,
                OverflowError, TypeError, ValueError):
            continue
    return _text(column)


def _cast(column, target: pa.DataType):
    if pa.types.is_run_end_encoded(column.type):
        import pyarrow.compute as pc

        column = pc.run_end_decode(column)
    return column.cast(target)


def _rebuilt(column, target: pa.DataType):
    return pa.array(column.to_pylist(), target)


def _text(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each value's text, exact: a decimal's digits, a list's or struct's JSON."""
    return pa.array([None if v is None else v if isinstance(v, str) else
                     json.dumps(v, sort_keys=True, default=str) if isinstance(v, (list, dict))
                     else str(v) for v in column.to_pylist()], pa.string())


def table_ready(table: pa.Table) -> pa.Table:
    """Each column of ``table`` as ``ready`` makes it."""
    if all(polars_type(t) is None for t in table.schema.types):
        return table
    return pa.Table.from_arrays([ready(c) for c in table.columns], names=table.column_names)


def frame(table: pa.Table, **options):
    """``pl.from_arrow`` of a table, any column's type: a DataFrame."""
    import polars as pl

    try:
        out = pl.from_arrow(table_ready(table), **options)
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001 - a type not foreseen
        out = pl.from_arrow(pa.Table.from_arrays(
            [_taken(c) for c in table_ready(table).columns], names=table.column_names),
            **options)
    return out if isinstance(out, pl.DataFrame) else out.to_frame()


def series(column: pa.Array | pa.ChunkedArray):
    """``pl.from_arrow`` of one column, any type: a Series."""
    import polars as pl

    try:
        return pl.from_arrow(ready(column))
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001 - a type not foreseen
        return pl.from_arrow(_text(column))


def _taken(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """The column as it is where polars takes it, else its text."""
    import polars as pl

    try:
        pl.from_arrow(column)
        return column
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001
        return _text(column)
