"""A row filter's text (the ``where`` of ``overnight view``'s page and of ``overnight serve``'s
batch pages) as a polars expression, built from an allow-list: the frame's own columns (bare,
``"double-quoted"``, a struct's field by a dot: ``judge.score``), literals, operators and a
few functions. Nothing else parses.

Why not ``pl.sql_expr``: polars' SQL parses subqueries with table functions (``read_csv``,
``read_parquet``, ``read_ndjson``, ``read_json``, with globs and absolute paths) and opens the
files while it parses; its errors then print what it read (another key's upload, the
server's secret). Here the expression is built with ``pl.col`` and ``pl.lit`` only, so a
filter cannot name anything but the frame's columns, and every error is this module's own one
line (``FilterError``), never polars' text.

The language is the SQL users write in a filter box::

    condition := disjunct (OR disjunct)*          disjunct := term (AND term)*
    term      := NOT term | value [test]
    test      := (= | == | != | <> | < | <= | > | >=) value
               | IS [NOT] NULL | [NOT] IN (literal, ...) | [NOT] (LIKE | ILIKE) 'pattern'
               | [NOT] BETWEEN value AND value
    value     := sum, with + - (numbers), || (text), * / % (numbers), unary -
    atom      := column | literal | (condition) | function(value, ...)
               | CAST(value AS type) | TRY_CAST(value AS type)

Types are checked against the frame's schema before anything runs (a text column compared
with a number is a FilterError naming it); what can only fail on a value (a CAST of "good" to
an integer) fails when the frame is collected, and the caller says so in its own words.
"""

from __future__ import annotations

from pipelines.report.filter_parser import Parser
from pipelines.report.filter_tokens import MAX_DEPTH, MAX_LENGTH, FilterError

__all__ = ["MAX_DEPTH", "MAX_LENGTH", "FilterError", "filter_expr"]


def filter_expr(text: str, schema) -> object:
    """``text`` as a polars expression over a frame of ``schema`` (a mapping of column names to
    polars types), null counting as false; a FilterError if it is not one."""
    return Parser(text, dict(schema)).parse().fill_null(False)
