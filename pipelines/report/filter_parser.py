"""The filter's grammar (see filters.py): a recursive descent over its tokens that checks each
part's type against the frame's schema and builds the polars expression as it goes."""

from __future__ import annotations

import datetime as _dt
import difflib
import re

from pipelines.report.filter_functions import FUNCTIONS
from pipelines.report.filter_tokens import (MAX_DEPTH, MAX_OPERATORS, MAX_PATTERN,
                                            MAX_WILDCARDS, STATEMENTS, FilterError, Token,
                                            tokenize)
from pipelines.report.filter_values import (CASTS, NAMES, Value, kind_of, literal, load_polars,
                                            null_types, temporal)


class Parser:
    """Recursive descent over the tokens, building the polars expression as it goes."""

    def __init__(self, text: str, schema: dict):
        self.text, self.schema = text, schema
        self.tokens = tokenize(text)
        self.i, self.depth, self.operators = 0, 0, 0

    # -- the token stream -------------------------------------------------------------------

    @property
    def token(self) -> Token:
        return self.tokens[self.i]

    def take(self) -> Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def at(self, kind: str, *texts: str) -> bool:
        token = self.token
        return token.kind == kind and (not texts or token.text in texts)

    def accept(self, kind: str, *texts: str) -> Token | None:
        return self.take() if self.at(kind, *texts) else None

    def expect(self, kind: str, text: str, what: str) -> Token:
        if not self.at(kind, text):
            raise self.unexpected(what)
        return self.take()

    def unexpected(self, wanted: str) -> FilterError:
        token = self.token
        if token.kind == "end":
            return FilterError(f"the filter ends where {wanted} should follow")
        return FilterError(f"{token.text[:40]!r} at character {token.at}: {wanted} expected")

    def deeper(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise FilterError(f"the filter nests more than {MAX_DEPTH} deep "
                              f"(at character {self.token.at})")
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.depth -= 1

    # -- the grammar ------------------------------------------------------------------------

    def parse(self):
        if self.token.kind == "end":
            raise FilterError("the filter is empty")
        value = self.condition()
        if not self.at("end"):
            raise self.unexpected("an operator (AND, OR, =, ...) or the end")
        if value.kind not in ("bool", "null"):
            raise FilterError(f"the filter is {NAMES[value.kind]}, not a condition (true or "
                              "false for each row)")
        return value.expr

    def condition(self) -> Value:
        return self.chain("OR", self.disjunct, load_polars().any_horizontal)

    def disjunct(self) -> Value:
        return self.chain("AND", self.term, load_polars().all_horizontal)

    def chain(self, word: str, operand, join) -> Value:
        """Operands joined by AND (OR) as one flat all (any) of them, SQL's logic of nulls
        kept: polars is slow to optimize a left-deep tree of many ANDs."""
        values = [operand()]
        while self.accept("word", word):
            self.count()
            values.append(operand())
        if len(values) == 1:
            return values[0]
        return Value(join([self.logical(v, word) for v in values]), "bool",
                     size=1 + sum(v.size for v in values))

    def count(self) -> None:
        """One operator more; a FilterError past MAX_OPERATORS (polars' optimizer is
        quadratic in an expression's depth)."""
        self.operators += 1
        if self.operators > MAX_OPERATORS:
            raise FilterError(f"the filter has more than {MAX_OPERATORS} operators "
                              f"(at character {self.token.at})")

    def logical(self, value: Value, word: str):
        if value.kind not in ("bool", "null"):
            raise FilterError(f"{word} joins conditions; one side is {NAMES[value.kind]}")
        return value.expr.cast(load_polars().Boolean) if value.kind == "null" else value.expr

    def term(self) -> Value:
        if self.accept("word", "NOT"):
            with self.deeper():
                value = self.term()
            return Value(~self.logical(value, "NOT"), "bool", size=value.size + 1)
        return self.test(self.value())

    def test(self, left: Value) -> Value:
        if self.at("op", "=", "==", "!=", "<>", "<", "<=", ">", ">="):
            op = self.take()
            return self.compare(left, op, self.value())
        if self.accept("word", "IS"):
            negated = bool(self.accept("word", "NOT"))
            self.expect("word", "NULL", "NULL (IS NULL, IS NOT NULL)")
            return Value(left.expr.is_not_null() if negated else left.expr.is_null(), "bool",
                         size=left.size + 1)
        negated = bool(self.accept("word", "NOT"))
        if self.accept("word", "IN"):
            found = self.in_list(left)
        elif self.at("word", "LIKE", "ILIKE"):
            found = self.like(left, self.take())
        elif self.accept("word", "BETWEEN"):
            found = self.between(left)
        elif negated:
            raise self.unexpected("IN, LIKE, ILIKE or BETWEEN after NOT")
        else:
            return left
        return Value(~found.expr, "bool", size=found.size + 1) if negated else found

    def compare(self, left: Value, op: Token, right: Value) -> Value:
        self.count()
        left, right = self.comparable(left, right, op.text)
        a, b = left.expr, right.expr
        expr = {"=": a == b, "==": a == b, "!=": a != b, "<>": a != b, "<": a < b,
                "<=": a <= b, ">": a > b, ">=": a >= b}[op.text]
        return Value(expr, "bool", size=left.size + right.size + 1)

    def between(self, left: Value) -> Value:
        """``left BETWEEN low AND high``: polars' is_between, which reads ``left`` once (not
        ``left >= low AND left <= high``, two copies of it), with SQL's nulls: a NULL bound
        leaves the other comparison to decide (false, or null)."""
        self.count()
        low = self.value()
        self.expect("word", "AND", "AND (BETWEEN low AND high)")
        high = self.value()
        left, low = self.comparable(left, low, "BETWEEN")
        left, high = self.comparable(left, high, "BETWEEN")
        size = left.size + low.size + high.size + 1
        pl = load_polars()
        if left.kind == "null":
            return Value(pl.lit(None, pl.Boolean), "bool", size=size)
        # an untyped NULL bound makes polars' is_between null on every row; a typed one
        # keeps SQL's three-valued AND
        dtype = left.dtype if left.kind in ("date", "datetime", "time", "duration") \
            and left.dtype is not None else null_types().get(left.kind)
        low_expr, high_expr = ((pl.lit(None, dtype) if bound.kind == "null" else bound.expr)
                               for bound in (low, high))
        return Value(left.expr.is_between(low_expr, high_expr), "bool", size=size)

    def comparable(self, left: Value, right: Value, op: str) -> tuple[Value, Value]:
        """The two sides, a date's or a timestamp's text literal read as one; a FilterError
        where they cannot be compared."""
        if left.kind in ("date", "datetime") and right.kind == "str" and right.is_literal:
            right = temporal(right, left.kind, left.dtype)
        elif right.kind in ("date", "datetime") and left.kind == "str" and left.is_literal:
            left = temporal(left, right.kind, right.dtype)
        kinds = {left.kind, right.kind}
        if "null" in kinds or len(kinds) == 1 and left.kind not in ("struct", "list",
                                                                      "binary", "other") \
                or kinds == {"date", "datetime"}:
            return left, right
        raise FilterError(f"{op} compares {NAMES[left.kind]} with {NAMES[right.kind]}"
                          f"{self.near()}")

    def near(self) -> str:
        return f" (before character {self.token.at})"

    def in_list(self, left: Value) -> Value:
        """``left IN (literal, ...)``: polars' is_in (``left`` read once, not once per item),
        with SQL's nulls: a NULL item makes a row no item equals null (so NOT IN with a NULL
        is never true), and a null ``left`` is null."""
        self.count()
        self.expect("op", "(", "( after IN")
        items = [self.literal_item()]
        while self.accept("op", ","):
            items.append(self.literal_item())
        self.expect("op", ")", ") closing IN's list")
        for i, item in enumerate(items):
            left, items[i] = self.comparable(left, item, "IN")
        pl = load_polars()
        values = [item.literal for item in items if item.kind != "null"]
        size = left.size + 2
        if left.kind == "null" or not values:
            return Value(pl.lit(None, pl.Boolean), "bool", size=size)
        target, values = self.in_type(left, values)
        found = left.expr.cast(target).is_in(pl.Series(values, dtype=target).implode())
        if len(values) < len(items) and any(item.kind == "null" for item in items):
            found = found | pl.lit(None, pl.Boolean)  # true | null: true; false | null: null
        return Value(found, "bool", size=size)

    def in_type(self, left: Value, values: list) -> tuple[object, list]:
        """The type IN compares ``left`` with its items in (polars' is_in wants one type), and
        the items in it: integers as integers, numbers with a fraction as Float64, a date
        with timestamps as timestamps."""
        pl = load_polars()
        if left.kind == "num":
            dtype = self.dtype_of(left)
            if all(isinstance(v, int) for v in values) and dtype is not None \
                    and dtype.is_integer() and dtype not in (pl.Int128, pl.UInt128):
                if dtype.is_unsigned_integer():  # a negative item equals no row
                    return pl.UInt64, [v for v in values if v >= 0]
                return pl.Int64, values
            return pl.Float64, [float(v) for v in values]
        if left.kind == "date":
            if all(type(v) is _dt.date for v in values):
                return pl.Date, values
            return pl.Datetime("us"), [v if isinstance(v, _dt.datetime)
                                       else _dt.datetime.combine(v, _dt.time()) for v in values]
        if left.kind == "datetime":
            dtype = left.dtype if left.dtype is not None else pl.Datetime("us")
            return dtype, values
        types = {"str": pl.String, "bool": pl.Boolean}
        if left.kind not in types:  # (comparable lets no literal but NULL meet these)
            raise FilterError(f"IN compares {NAMES[left.kind]} with literals{self.near()}")
        return types[left.kind], values

    def dtype_of(self, value: Value):
        """A value's polars type, resolved over the frame's schema where it is computed (no
        row is read); None if polars cannot say."""
        if value.dtype is not None:
            return value.dtype
        pl = load_polars()
        try:
            return pl.LazyFrame(schema=self.schema).select(
                value.expr.alias("value")).collect_schema()["value"]
        except Exception:  # noqa: BLE001 - then compared as Float64
            return None

    def literal_item(self) -> Value:
        value = self.value()
        if not value.is_literal:
            raise FilterError(f"IN takes a list of literals (numbers, 'text', TRUE, FALSE, "
                              f"NULL){self.near()}")
        return value

    def like(self, left: Value, word: Token) -> Value:
        pattern = self.value()
        if left.kind != "str":
            raise FilterError(f"{word.text} matches text; its left side is "
                              f"{NAMES[left.kind]}{self.near()}")
        if pattern.kind == "null":
            return Value(load_polars().lit(None, load_polars().Boolean), "bool")
        if not (pattern.is_literal and pattern.kind == "str"):
            raise FilterError(f"{word.text} takes a 'pattern' in quotes{self.near()}")
        text = pattern.literal
        if len(text) > MAX_PATTERN:
            raise FilterError(f"{word.text}'s pattern is {len(text)} characters; at most "
                              f"{MAX_PATTERN}{self.near()}")
        text = re.sub("%%+", "%", text)  # '%%' matches what '%' does
        wildcards = text.count("%") + text.count("_")
        if wildcards > MAX_WILDCARDS:
            raise FilterError(f"{word.text}'s pattern has {wildcards} wildcards (% and _); at "
                              f"most {MAX_WILDCARDS}{self.near()}")
        regex = "".join(".*" if c == "%" else "." if c == "_" else _escaped(c) for c in text)
        flags = "(?is)" if word.text == "ILIKE" else "(?s)"
        return Value(left.expr.str.contains(f"{flags}^{regex}$"), "bool", size=left.size + 1)

    def value(self) -> Value:
        left = self.product()
        while self.at("op", "+", "-", "||"):
            op = self.take()
            right = self.product()
            self.count()
            if op.text == "||":
                self.need(left, "str", "||")
                self.need(right, "str", "||")
                left = Value(left.expr + right.expr, "str", size=left.size + right.size + 1)
            else:
                left = self.arithmetic(left, op, right)
        return left

    def product(self) -> Value:
        left = self.unary()
        while self.at("op", "*", "/", "%"):
            op = self.take()
            self.count()
            left = self.arithmetic(left, op, self.unary())
        return left

    def arithmetic(self, left: Value, op: Token, right: Value) -> Value:
        for side in (left, right):
            if side.kind not in ("num", "null"):
                raise FilterError(f"{op.text} takes numbers; one side is {NAMES[side.kind]} "
                                  f"(at character {op.at})")
        a, b = left.expr, right.expr
        if op.text == "%":  # SQL's remainder takes the dividend's sign (polars' %: the divisor's;
            # polars has no truncated remainder, so ``a`` is read twice and counted twice)
            return Value((a.abs() % b.abs()) * a.sign(), "num",
                         size=2 * left.size + right.size + 4)
        expr = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op.text]
        return Value(expr, "num", size=left.size + right.size + 1)

    def unary(self) -> Value:
        if self.at("op", "-", "+"):
            op = self.take()
            with self.deeper():
                value = self.unary()
            self.need(value, "num", f"unary {op.text}")
            if op.text == "+":
                return value
            if value.is_literal and value.literal is not None:
                return literal(-value.literal)
            return Value(-value.expr, "num", size=value.size + 1)
        return self.atom()

    def need(self, value: Value, kind: str, what: str) -> None:
        if value.kind not in (kind, "null"):
            raise FilterError(f"{what} takes {NAMES[kind]}, not {NAMES[value.kind]}"
                              f"{self.near()}")

    def atom(self) -> Value:
        token = self.token
        if token.kind in ("number", "string"):
            self.take()
            return literal(token.value)
        if self.accept("word", "NULL"):
            return literal(None)
        if self.at("word", "TRUE", "FALSE"):
            return literal(self.take().text == "TRUE")
        if self.accept("op", "("):
            with self.deeper():
                value = self.condition()
            self.expect("op", ")", "')'")
            return value
        if self.at("word", "CAST", "TRY_CAST"):
            return self.cast(self.take())
        if token.kind == "name" and self.tokens[self.i + 1].text == "(" \
                and self.tokens[self.i + 1].kind == "op":
            return self.function(self.take())
        if token.kind in ("name", "quoted"):
            return self.column()
        raise self.unexpected("a column, a literal or '('")

    def column(self) -> Value:
        first = self.take()
        parts = [first.value]
        while self.at("op", "."):
            self.take()
            if not self.at("name") and not self.at("quoted"):
                raise self.unexpected("a field name after '.'")
            parts.append(self.take().value)
        # a column whose own name holds the dots, else a column and its struct's fields
        for size in range(len(parts), 0, -1):
            name = ".".join(parts[:size])
            if name in self.schema:
                return self.fields(name, parts[size:], first.at)
        if first.kind == "name" and first.text.upper() in STATEMENTS:
            raise FilterError(f"{first.text[:20]} at character {first.at}: a filter is one "
                              "condition on the rows' columns, never a query (no subquery, "
                              "no table function)")
        raise FilterError(f"no column {parts[0]!r} (character {first.at})"
                          f"{_close(parts[0], self.schema)}")

    def fields(self, name: str, fields: list[str], at: int) -> Value:
        pl = load_polars()
        expr, dtype, path = pl.col(name), self.schema[name], name
        for field in fields:
            names = [f.name for f in dtype.fields] if isinstance(dtype, pl.Struct) else None
            if names is None:
                raise FilterError(f"{path!r} is {NAMES[kind_of(dtype)]}, not a struct: it has "
                                  f"no field {field!r} (character {at})")
            if field not in names:
                raise FilterError(f"{path!r} has no field {field!r} (character {at})"
                                  f"{_close(field, names, 'fields')}")
            dtype = dict(zip(names, (f.dtype for f in dtype.fields)))[field]
            expr, path = expr.struct.field(field), f"{path}.{field}"
        if kind_of(dtype) == "str" and dtype != pl.String:  # categorical: text's methods
            expr = expr.cast(pl.String)
        return Value(expr, kind_of(dtype), dtype, size=len(fields) + 2)

    def cast(self, word: Token) -> Value:
        pl = load_polars()
        self.expect("op", "(", f"( after {word.text}")
        with self.deeper():
            value = self.condition()
        self.expect("word", "AS", f"AS (type) in {word.text}")
        name = self.accept("name")
        target = CASTS.get(name.text.upper()) if name else None
        if target is None:
            raise FilterError(f"{word.text} takes a type: one of {', '.join(sorted(CASTS))}"
                              f"{self.near()}")
        if name.text.upper() == "DOUBLE" and self.at("name") \
                and self.token.text.upper() == "PRECISION":
            self.take()
        self.expect("op", ")", f") closing {word.text}")
        if value.kind not in ("num", "str", "bool", "null"):
            raise FilterError(f"{word.text} converts numbers, text and conditions; this is "
                              f"{NAMES[value.kind]}{self.near()}")
        dtype = getattr(pl, target)
        kind = kind_of(dtype)
        return Value(value.expr.cast(dtype, strict=word.text == "CAST"), kind, dtype,
                     size=value.size + 1)

    def function(self, name: Token) -> Value:
        spec = FUNCTIONS.get(name.text.lower())
        if spec is None:
            raise FilterError(f"no function {name.text[:40]!r} (character {name.at}); a filter "
                              f"may use {', '.join(sorted(FUNCTIONS))}")
        self.take()  # (
        self.count()
        args = []
        with self.deeper():
            if not self.at("op", ")"):
                args.append(self.value())
                while self.accept("op", ","):
                    args.append(self.value())
        self.expect("op", ")", f") closing {name.text}(")
        return spec(self, name.text.lower(), args)


def _escaped(ch: str) -> str:
    """A character of a LIKE pattern as the regex matches it literally (polars' regex is
    Rust's: a code point escape is valid for every character)."""
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):X}}}"


def _close(name: str, known, what: str = "columns") -> str:
    """'; did you mean X? the columns are: ...' for a name not found."""
    known = [k for k in known if not str(k).startswith("__overnight_")]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(known[:30]) + (", ..." if len(known) > 30 else "")
    return f"{hint or ';'} the {what} are: {listed}" if known else hint
