"""The functions a filter may call (lower, length, round, coalesce, ...): each builds its
polars expression from the parser (for its checks' messages), its name and its arguments; the
parser (filter_parser.Parser) goes unannotated, as that module imports this table."""

from __future__ import annotations

from pipelines.report.filter_tokens import FilterError
from pipelines.report.filter_values import NAMES, Value, load_polars


def _arity(name: str, args: list, low: int, high: int | None = None) -> None:
    high = low if high is None else high
    if not low <= len(args) <= high:
        wanted = str(low) if low == high else f"{low} to {high}"
        raise FilterError(f"{name}() takes {wanted} argument{'s' * (high != 1)}, not "
                          f"{len(args)}")


def _text_function(method):
    def build(parser, name: str, args: list) -> Value:
        _arity(name, args, 1)
        parser.need(args[0], "str", f"{name}()")
        return Value(method(args[0].expr.str), "str", size=args[0].size + 1)
    return build


def _length(parser, name: str, args: list) -> Value:
    _arity(name, args, 1)
    value = args[0]
    pl = load_polars()
    if value.kind == "str":
        return Value(value.expr.str.len_bytes() if name == "octet_length"
                     else value.expr.str.len_chars(), "num", size=value.size + 1)
    if value.kind == "list" and name != "octet_length":
        return Value(value.expr.arr.len() if isinstance(value.dtype, pl.Array)
                     else value.expr.list.len(), "num", size=value.size + 1)
    if value.kind == "null":
        return Value(pl.lit(None, pl.Int64), "num")
    raise FilterError(f"{name}() takes text{' or a list' * (name != 'octet_length')}, not "
                      f"{NAMES[value.kind]}")


def _abs(parser, name: str, args: list) -> Value:
    _arity(name, args, 1)
    parser.need(args[0], "num", "abs()")
    return Value(args[0].expr.abs(), "num", size=args[0].size + 1)


def _round(parser, name: str, args: list) -> Value:
    _arity(name, args, 1, 2)
    parser.need(args[0], "num", "round()")
    digits = 0
    if len(args) == 2:
        if not (args[1].is_literal and isinstance(args[1].literal, int)
                and not isinstance(args[1].literal, bool) and 0 <= args[1].literal <= 20):
            raise FilterError("round()'s second argument is a whole number of digits, 0 to 20")
        digits = args[1].literal
    return Value(args[0].expr.round(digits), "num", size=sum(a.size for a in args) + 1)


def _coalesce(parser, name: str, args: list) -> Value:
    if not args:
        raise FilterError("coalesce() takes at least one argument")
    kinds = {a.kind for a in args} - {"null"}
    if len(kinds) > 1:
        raise FilterError(f"coalesce() takes values of one type, not "
                          f"{' and '.join(sorted(NAMES[k] for k in kinds))}")
    return Value(load_polars().coalesce([a.expr for a in args]), kinds.pop() if kinds else "null",
                 size=sum(a.size for a in args) + 1)


def _affix(parser, name: str, args: list) -> Value:
    _arity(name, args, 2)
    parser.need(args[0], "str", f"{name}()")
    if not (args[1].is_literal and args[1].kind == "str"):
        raise FilterError(f"{name}() takes 'text' in quotes as its second argument")
    method = args[0].expr.str.starts_with if name == "starts_with" else \
        args[0].expr.str.ends_with
    return Value(method(args[1].literal), "bool", size=args[0].size + 2)


FUNCTIONS = {
    "lower": _text_function(lambda s: s.to_lowercase()),
    "upper": _text_function(lambda s: s.to_uppercase()),
    "trim": _text_function(lambda s: s.strip_chars()),
    "ltrim": _text_function(lambda s: s.strip_chars_start()),
    "rtrim": _text_function(lambda s: s.strip_chars_end()),
    "length": _length, "char_length": _length, "character_length": _length,
    "octet_length": _length, "abs": _abs, "round": _round, "coalesce": _coalesce,
    "starts_with": _affix, "ends_with": _affix,
}
