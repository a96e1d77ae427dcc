"""What a filter's parts become: a polars expression with the kind of value it holds, the
literals, and the polars types the checks name (polars imported on first use)."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from pipelines.report.filter_tokens import MAX_NODES, FilterError

# the types CAST takes, by the names SQL spells them
CASTS = {**dict.fromkeys(("INT", "INTEGER", "BIGINT", "SMALLINT", "TINYINT", "INT2", "INT4",
                          "INT8", "INT64", "LONG"), "Int64"),
         **dict.fromkeys(("FLOAT", "DOUBLE", "REAL", "FLOAT4", "FLOAT8", "FLOAT64", "NUMERIC",
                          "DECIMAL"), "Float64"),
         **dict.fromkeys(("TEXT", "VARCHAR", "STRING", "CHAR"), "String"),
         **dict.fromkeys(("BOOL", "BOOLEAN"), "Boolean")}

NAMES = {"num": "a number", "str": "text", "bool": "a condition (true or false)",
         "null": "null", "date": "a date", "datetime": "a timestamp", "time": "a time of day",
         "duration": "a duration", "struct": "a struct", "list": "a list",
         "binary": "bytes", "other": "a value of another type"}


@dataclass
class Value:
    """An expression and what it holds: "num", "str", "bool", "null", "date", "datetime",
    "time", "duration", "struct", "list", "binary" or "other"; ``literal``: a literal's
    Python value (LIKE's pattern, IN's items), else None; ``size``: the expression's nodes,
    a part used twice counted twice (a FilterError past MAX_NODES)."""

    expr: object
    kind: str
    dtype: object = None
    literal: object = None
    is_literal: bool = False
    size: int = 1

    def __post_init__(self):
        if self.size > MAX_NODES:
            raise FilterError(f"the filter is too large: more than {MAX_NODES} nodes once "
                              "expanded (each % uses its left side twice)")


def load_polars():
    import polars as pl

    return pl


def kind_of(dtype) -> str:
    """What a column of a polars type holds, as the checks name it."""
    import polars as pl

    if dtype == pl.Boolean:
        return "bool"
    if dtype.is_numeric():
        return "num"
    if dtype in (pl.String, pl.Categorical) or isinstance(dtype, (pl.Categorical, pl.Enum)):
        return "str"
    for kind, types in (("date", (pl.Date,)), ("datetime", (pl.Datetime,)), ("time", (pl.Time,)),
                        ("duration", (pl.Duration,)), ("struct", (pl.Struct,)),
                        ("list", (pl.List, pl.Array)), ("binary", (pl.Binary,)),
                        ("null", (pl.Null,))):
        if dtype == types[0] or isinstance(dtype, types):
            return kind
    return "other"


def null_types() -> dict:
    pl = load_polars()
    return {"num": pl.Float64, "str": pl.String, "bool": pl.Boolean, "date": pl.Date,
            "datetime": pl.Datetime("us"), "time": pl.Time, "duration": pl.Duration("us")}


def literal(value) -> Value:
    pl = load_polars()
    if value is None:
        return Value(pl.lit(None), "null", None, None, True)
    if isinstance(value, bool):
        return Value(pl.lit(value), "bool", pl.Boolean, value, True)
    if isinstance(value, int):
        return Value(pl.lit(value, pl.Int64), "num", pl.Int64, value, True)
    if isinstance(value, float):
        return Value(pl.lit(value, pl.Float64), "num", pl.Float64, value, True)
    return Value(pl.lit(value, pl.String), "str", pl.String, value, True)


def temporal(value: Value, kind: str, dtype=None) -> Value:
    """A text literal compared with a date or timestamp column, read as one (ISO 8601); a
    time without a zone is in the column's zone, if it has one."""
    pl = load_polars()
    zone = getattr(dtype, "time_zone", None)
    readers = (_dt.date.fromisoformat, _dt.datetime.fromisoformat) if kind == "date" \
        else (_dt.datetime.fromisoformat,)
    for read in readers:
        try:
            parsed = read(value.literal)
        except ValueError:
            continue
        found = "date" if type(parsed) is _dt.date else "datetime"
        if found == "datetime" and (parsed.tzinfo is not None or zone is not None):
            if zone is None:
                raise FilterError(f"{value.literal[:40]!r} has a time zone; the column's "
                                  "times have none")
            from zoneinfo import ZoneInfo

            try:
                parsed = (parsed.replace(tzinfo=ZoneInfo(zone)) if parsed.tzinfo is None
                          else parsed.astimezone(ZoneInfo(zone)))
            except (ValueError, OverflowError, KeyError):  # (KeyError: a zone Python lacks)
                raise FilterError(f"{value.literal[:40]!r} is out of range in the column's "
                                  f"time zone") from None
        try:
            return Value(pl.lit(parsed), found, None, parsed, True)
        except (ValueError, OverflowError):
            raise FilterError(f"{value.literal[:40]!r} is out of a timestamp's range") from None
    raise FilterError(f"{value.literal[:40]!r} is not an ISO 8601 "
                      f"{'date' if kind == 'date' else 'timestamp'}")
