"""A filter step's ``where``: the rows of a block for which a polars SQL expression holds, and
the rows it cannot be evaluated on, each with its own error."""

from __future__ import annotations

import pyarrow as pa


def where_mask(table: pa.Table, expression: str) -> tuple[list[bool], dict[int, str]]:
    """The rows for which ``expression`` (polars SQL) holds, null counting as not; and the
    rows it cannot be evaluated on (``CAST(rating AS INTEGER)`` over a rating of "good"), by
    position, with why: each such row's own error, never the block's. Polars is handed only
    the columns the filter names: a column it cannot hold elsewhere in the row (decimal256)
    is none of its business."""
    import polars as pl

    expr = pl.sql_expr(expression).fill_null(False)
    part = table.select(list(dict.fromkeys(expr.meta.root_names())))
    try:
        return _holds(part, expr, table.num_rows), {}
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001 - some row's value
        pass
    keep, failed = [], {}
    for i in range(table.num_rows):  # row by row, to find which
        try:
            keep.extend(_holds(part.slice(i, 1), expr, 1))
        except (Exception, pl.exceptions.PanicException) as exc:  # noqa: BLE001
            keep.append(False)
            failed[i] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return keep, failed


def _holds(part: pa.Table, expr, rows: int) -> list[bool]:
    import polars as pl

    from udfs.rows import to_polars

    # (to_polars: a column of a type polars cannot take, a decimal256, as one it can)
    frame = to_polars.frame(part) if part.num_columns else pl.DataFrame()
    values = frame.select(expr).to_series().to_list()
    return values * rows if len(values) == 1 and rows != 1 else values  # a constant filter
