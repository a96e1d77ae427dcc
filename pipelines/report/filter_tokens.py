"""A filter's first step: its text as tokens, with the limits every step holds it to and the
one error every step raises (a line a caller may see)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipelines.errors import ConfigError

MAX_LENGTH = 4000  # characters of a filter: a condition typed in a box, not a program
MAX_DEPTH = 40  # parentheses, NOTs and function calls inside one another
MAX_OPERATORS = 200  # comparisons, arithmetic, AND, OR, IN, BETWEEN, calls (not IN's items)
# nodes of the built expression, counting every copy polars evaluates apart (SQL's % uses its
# left side twice): ``a % 2 % 2 ...`` doubles with each %, and polars expands every copy
MAX_NODES = 2000
MAX_PATTERN = 500  # characters of a LIKE pattern
MAX_WILDCARDS = 16  # % and _ in one LIKE pattern (a run of % counting as one)
KEYWORDS = {"AND", "OR", "NOT", "IS", "NULL", "TRUE", "FALSE", "IN", "LIKE", "ILIKE",
            "BETWEEN", "CAST", "TRY_CAST", "AS"}
# SQL's words for queries, said to be no part of a filter (where no column has the name)
STATEMENTS = {"SELECT", "FROM", "WITH", "UNION", "VALUES", "TABLE", "INSERT", "UPDATE",
              "DELETE", "DROP", "CREATE", "ATTACH", "COPY", "PRAGMA", "EXPLAIN"}
OPERATORS = ("<>", "!=", "<=", ">=", "==", "||", "=", "<", ">", "+", "-", "*", "/", "%", "(",
             ")", ",", ".")


class FilterError(ConfigError):
    """A filter that does not parse or does not fit the frame: a one-line message a caller
    may see (it quotes only the filter and the frame's column names)."""


@dataclass(frozen=True)
class Token:
    kind: str  # "name", "quoted" (a "double-quoted" name), "number", "string", "op", "word", "end"
    text: str
    at: int  # the character it starts at (1-based, as the message says it)
    value: object = None


def tokenize(text: str) -> list[Token]:
    """The filter's tokens; a FilterError at the first character that is not one."""
    if not isinstance(text, str):
        raise FilterError("a filter is text")
    if len(text) > MAX_LENGTH:
        raise FilterError(f"the filter is {len(text)} characters; at most {MAX_LENGTH}")
    tokens, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch == "'":
            value, end = _quoted(text, i, "'")
            tokens.append(Token("string", text[i:end], i + 1, value))
            i = end
        elif ch == '"':
            value, end = _quoted(text, i, '"')
            if not value:
                raise FilterError(f'an empty quoted name "" at character {i + 1}')
            tokens.append(Token("quoted", text[i:end], i + 1, value))
            i = end
        elif ch in "0123456789" or (ch == "." and i + 1 < n and text[i + 1] in "0123456789"):
            end = _number_end(text, i)
            tokens.append(Token("number", text[i:end], i + 1, _number(text[i:end], i + 1)))
            i = end
        elif ch.isalpha() or ch == "_":
            end = i + 1
            while end < n and (text[end].isalnum() or text[end] == "_"):
                end += 1
            word = text[i:end]
            kind = "word" if word.upper() in KEYWORDS else "name"
            tokens.append(Token(kind, word.upper() if kind == "word" else word, i + 1, word))
            i = end
        else:
            op = next((o for o in OPERATORS if text.startswith(o, i)), None)
            if op is None:
                raise FilterError(f"unexpected {_shown(ch)} at character {i + 1}")
            tokens.append(Token("op", op, i + 1))
            i += len(op)
    tokens.append(Token("end", "", n + 1))
    return tokens


def _quoted(text: str, start: int, quote: str) -> tuple[str, int]:
    """A quoted string or name from ``start`` (its opening quote), a doubled quote standing
    for one: its value, and the index after its closing quote."""
    out, i = [], start + 1
    while i < len(text):
        if text[i] == quote:
            if text.startswith(quote * 2, i):
                out.append(quote)
                i += 2
                continue
            return "".join(out), i + 1
        out.append(text[i])
        i += 1
    kind = "string" if quote == "'" else "quoted name"
    raise FilterError(f"a {kind} opened at character {start + 1} is never closed")


def _number_end(text: str, i: int) -> int:
    match = re.compile(r"[0-9]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?").match(text, i)
    end = match.end()
    if end < len(text) and (text[end].isalnum() or text[end] == "_"):
        raise FilterError(f"a number runs into {_shown(text[end])} at character {end + 1}")
    return end


def _number(token: str, at: int):
    if re.fullmatch(r"[0-9]+", token):
        value = int(token)
        if value > 2**63 - 1:
            raise FilterError(f"the number {token[:30]} at character {at} is too large")
        return value
    try:
        return float(token)
    except ValueError:
        raise FilterError(f"{token[:30]!r} at character {at} is not a number") from None


def _shown(ch: str) -> str:
    """A character as a message names it: itself where printable, else its code point."""
    return repr(ch) if ch.isprintable() and not ch.isspace() else f"U+{ord(ch):04X}"
