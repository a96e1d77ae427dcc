"""The view pages' row filter (pipelines/report/filters.py): SQL's small language of conditions built
into a polars expression from an allow-list, never through polars' SQL (whose subqueries read
files, and whose errors print what they read). Pure functions, no engine: a fuzz of the parser
and a comparison with polars' own SQL over filters both take."""

from __future__ import annotations

import datetime

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.report.filters import MAX_DEPTH, MAX_LENGTH, FilterError, filter_expr

FRAME = pl.DataFrame({
    "title": ["Lamp 1", "Lamp 10", "a\nb", None, "50% off", "it's"],
    "n": [3, 5, None, 1, -2, 0],
    "x": [1.5, -2.5, None, 0.0, 2.0, 7.25],
    "ok": [True, False, None, True, False, True],
    "rating": ["4", "good", "3", None, "5", "1"],
    "judge": [{"score": 4, "verdict": "faithful"}, {"score": 2, "verdict": "no"}, None,
              {"score": 5, "verdict": None}, {"score": 1, "verdict": "faithful"},
              {"score": 3, "verdict": "no"}],
    "tags": [["a"], [], None, ["a", "b"], ["c"], ["d"]],
})


def rows(text: str) -> list:
    return FRAME.with_row_index().filter(filter_expr(text, FRAME.schema))["index"].to_list()


@pytest.mark.parametrize("text, expected", [
    ("title = 'Lamp 1' OR title LIKE 'Lamp 1_' AND n < 0", [0]),  # the view test's filter
    ("judge.score >= 4", [0, 3]),  # a struct's field, as a step's where reads it
    ('"judge"."verdict" = \'faithful\'', [0, 4]),
    ("length(title) > 6", [1, 4]),
    ("title LIKE '%\n%'", [2]),  # % spans a newline, as SQL's
    ("title LIKE '50% off'", [4]),
    ("title ILIKE 'lamp%'", [0, 1]),
    ("title NOT LIKE 'Lamp%'", [2, 4, 5]),  # null: neither
    ("title = 'it''s'", [5]),
    ("n BETWEEN 1 AND 3", [0, 3]),
    ("n NOT IN (1, 3, NULL)", []),  # SQL's NOT IN with a null: never true
    ("n IN (5, -2)", [1, 4]),
    ("title IS NULL OR n IS NULL", [2, 3]),
    ("NOT ok", [1, 4]),
    ("ok AND x > 1", [0, 5]),
    ("TRY_CAST(rating AS INTEGER) >= 4", [0, 4]),
    ("n % 4 = 1 OR n % 4 = -2", [1, 3, 4]),  # SQL's remainder: the dividend's sign
    ("-n > 1 AND x / 2 > 0.5", [4]),
    ("lower(title) = 'lamp 1' OR upper(judge.verdict) = 'NO'", [0, 1, 5]),
    ("coalesce(n, 0) = 0", [2, 5]),
    ("starts_with(title, 'Lamp') AND NOT ends_with(title, '0')", [0]),
    ("title || '!' = 'Lamp 1!'", [0]),
    ("round(x) = 2 AND abs(n) = 2", [4]),
    ("length(tags) = 2", [3]),
    ("1 = 1", [0, 1, 2, 3, 4, 5]),
    ("NULL", []),
    ("((n > 0)) and (title like 'L%' or x < 0)", [0, 1]),  # keywords in any case
])
def test_the_filters_users_write_select_the_rows_sql_would(text, expected):
    assert rows(text) == expected


@pytest.mark.parametrize("text, message", [
    ("titel = 'x'", "no column 'titel' (character 1); did you mean 'title'? the columns are: "
                    "title, n, x, ok, rating, judge, tags"),
    ("judge.scor > 1", "'judge' has no field 'scor' (character 1); did you mean 'score'?"),
    ("title > 1", "> compares text with a number"),
    ("tags = 'a'", "= compares a list with text"),
    ("n + 1", "the filter is a number, not a condition"),
    ("n LIKE '1%'", "LIKE matches text; its left side is a number"),
    ("title LIKE ((", "the filter ends where a column, a literal or '(' should follow"),
    ("title = 'x", "a string opened at character 9 is never closed"),
    ("read_csv('keys.txt')", "no function 'read_csv' (character 1); a filter may use abs,"),
    ("n IN (SELECT * FROM read_csv('keys.txt'))", "SELECT at character 7: a filter is one "
                                                   "condition on the rows' columns, never a "
                                                   "query"),
    ("n IN (n, 1)", "IN takes a list of literals"),
    ("title = 'x'; SELECT 1", "unexpected ';' at character 12"),
    ("/* comment */ n = 1", "'/' at character 1: a column, a literal or '(' expected"),
    ("title = \u2018x\u2019", "unexpected '\u2018' at character 9"),
    ("n = 1\u200b", "unexpected U+200B at character 6"),
    ("99999999999999999999 > n", "too large"),
    ("CAST(n AS blob) = 1", "CAST takes a type"),
    ("", "the filter is empty"),
    ("(" * (MAX_DEPTH + 1) + "n = 1" + ")" * (MAX_DEPTH + 1), "nests more than"),
    ("n = 1 OR " * 250 + "n = 1", "more than 200 operators"),
    ("x" * (MAX_LENGTH + 1), f"at most {MAX_LENGTH}"),
])
def test_what_is_not_a_filter_is_one_line_of_its_own(text, message):
    with pytest.raises(FilterError) as caught:
        filter_expr(text, FRAME.schema)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_dates_and_times_compare_with_iso_text_in_the_columns_zone():
    frame = pl.DataFrame({"day": ["2024-01-02", "2024-03-01"], "at": ["2024-01-01 10:00",
                                                                       "2024-01-01 12:00"]})
    frame = frame.with_columns(pl.col("day").str.to_date(), pl.col("at").str.to_datetime()
                               .dt.replace_time_zone("Europe/Paris"))

    def days(text):
        return frame.with_row_index().filter(filter_expr(text, frame.schema))["index"].to_list()

    assert days("day = '2024-01-02'") == [0]
    assert days("day > '2024-01-02T00:00:01'") == [1]
    assert days("at = '2024-01-01T10:00:00'") == [0]  # the column's zone
    assert days("at > '2024-01-01T09:30:00+00:00'") == [1]  # 10:00 in Paris is 09:00 UTC
    with pytest.raises(FilterError, match="not an ISO 8601 date"):
        days("day = 'yesterday'")


def test_a_cast_a_value_defeats_fails_when_the_rows_are_read():
    """What only a value can break (CAST of "good") fails at collect; the view says so in
    its own words (tests/test_serve_security.py)."""
    with pytest.raises(pl.exceptions.InvalidOperationError):
        rows("CAST(rating AS INTEGER) >= 4")


ATTACKS = ["read_csv", "read_parquet", "read_ndjson", "read_json", "SELECT", "FROM", "*",
           "'keys.txt'", "'/etc/passwd'", "'/tmp/*'", "'**/*.secret'", "(", ")", ",", ";",
           "--", "/*", "*/", "UNION", "WITH", "::", "=>", "$1", "@x", "\\", "\u200b", "\uff08"]
VOCABULARY = ["title", "n", "x", "ok", "judge.score", "judge", "tags", "rating", '"title"',
              "'a'", "'Lamp%'", "1", "2.5", "-3", "NULL", "TRUE", "FALSE", "=", "!=", "<>",
              "<", "<=", ">", ">=", "+", "-", "*", "/", "%", "||", "AND", "OR", "NOT", "IS",
              "IN", "LIKE", "ILIKE", "BETWEEN", "CAST", "TRY_CAST", "AS", "INTEGER", "lower",
              "length", "coalesce", ".", *ATTACKS]


def _never_polars_sql(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a filter reached polars' SQL")

    for name in ("sql_expr", "sql", "SQLContext"):
        monkeypatch.setattr(pl, name, refused)


def _nodes(tree, found: set) -> set:
    """The node names of a serialized expression (its keys, never a literal's value)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.add(key)
            _nodes(value, found)
    elif isinstance(tree, list):
        for value in tree:
            _nodes(value, found)
    return found


def _holds_the_property(text: str) -> None:
    """A FilterError, or an expression over the frame's own columns with no node that could
    name a file or a plan (a scan, a subquery), which runs or fails only on a value."""
    import json
    import warnings

    try:
        expr = filter_expr(text, FRAME.schema)
    except FilterError as exc:
        assert "\n" not in str(exc)
        return
    assert set(expr.meta.root_names()) <= set(FRAME.columns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (polars: its JSON form may change between versions)
        nodes = _nodes(json.loads(expr.meta.serialize(format="json")), set())
    assert not [n for n in nodes if any(w in n.lower() for w in (
        "scan", "plan", "source", "path", "file", "sql"))], nodes
    try:
        FRAME.filter(expr)
    except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError):
        pass  # a CAST a value defeats: the caller reports it (test_serve_security.py)


# 400 random strings and 400 random token sequences; no file is read, whatever they say
@settings(max_examples=400, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=120))
def test_random_text_is_a_filter_or_a_filter_error(text, monkeypatch):
    _never_polars_sql(monkeypatch)
    _holds_the_property(text)


@settings(max_examples=400, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.sampled_from(VOCABULARY), min_size=1, max_size=14))
def test_random_tokens_are_a_filter_or_a_filter_error(tokens, monkeypatch):
    _never_polars_sql(monkeypatch)
    _holds_the_property(" ".join(tokens))


# -- the same rows as polars' SQL, over filters in the language both speak --------------------

# (a length as an INTEGER: polars' SQL subtracts from a length in its unsigned type and wraps,
# 0 - length('Lamp 1') being 4294967290 there; here it is -6, as SQL's)
_numbers = st.one_of(st.sampled_from(["n", "x", "judge.score", "abs(n)",
                                      "CAST(length(title) AS INTEGER)"]),
                     st.integers(-3, 6).map(str), st.sampled_from(["1.5", "0.5", "-2.5"]))
_sums = st.recursive(_numbers, lambda inner: st.tuples(
    inner, st.sampled_from(["+", "-", "*", "%"]), inner).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})" if t[1] != "%" or t[2] not in ("0", "-0")
        else f"({t[0]} + {t[2]})"), max_leaves=3)
_texts = st.one_of(st.sampled_from(["title", "judge.verdict", "lower(title)", "rating"]),
                   st.sampled_from(["'Lamp 1'", "'a'", "''", "'it''s'", "'faithful'"]))
_comparisons = st.sampled_from(["=", "!=", "<>", "<", "<=", ">", ">="])
_tests = st.one_of(
    st.tuples(_sums, _comparisons, _sums).map(" ".join),
    st.tuples(_texts, _comparisons, _texts).map(" ".join),
    st.tuples(_texts, st.sampled_from(["LIKE", "NOT LIKE", "ILIKE", "NOT ILIKE"]),
              st.sampled_from(["'Lamp%'", "'%1_'", "'_'", "'%'", "'it''s'", "'%\n%'"])
              ).map(" ".join),
    st.tuples(_sums, st.sampled_from(["IN", "NOT IN"]),
              st.lists(st.integers(-3, 6).map(str), min_size=1, max_size=4)).map(
                  lambda t: f"{t[0]} {t[1]} ({', '.join(t[2])})"),
    st.tuples(_sums, st.sampled_from(["BETWEEN", "NOT BETWEEN"]), _sums, _sums).map(
        lambda t: f"{t[0]} {t[1]} {t[2]} AND {t[3]}"),
    st.tuples(st.sampled_from(["title", "n", "judge", "judge.verdict", "tags"]),
              st.sampled_from(["IS NULL", "IS NOT NULL"])).map(" ".join),
    st.sampled_from(["ok", "NOT ok", "TRY_CAST(rating AS INTEGER) > 2"]))
_conditions = st.recursive(_tests, lambda inner: st.one_of(
    st.tuples(inner, st.sampled_from(["AND", "OR"]), inner).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"),
    inner.map(lambda c: f"NOT ({c})")), max_leaves=4)


# 300 generated filters: each selects the rows polars' SQL selects (on the frame in memory;
# these texts hold no subquery, so polars' SQL here reads nothing)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_conditions)
def test_the_rows_are_those_polars_sql_selects(text):
    mine = rows(text)
    try:
        theirs = FRAME.with_row_index().filter(pl.sql_expr(text).fill_null(False))[
            "index"].to_list()
    except Exception:  # noqa: BLE001 - a filter polars' SQL refuses (NOT BETWEEN, say)
        return
    assert mine == theirs, text


# -- hostile filters (overnight serve's batch pages): refused or cheap, never seconds of CPU ---

WIDE = pl.DataFrame({"a": list(range(1000)), "s": ["x" * 300, "y" * 300] * 500})


def test_a_remainder_chain_that_doubles_its_left_side_is_refused():
    """SQL's % reads its left side twice; 14 of them were 16,384 copies of ``a`` (17 s)."""
    with pytest.raises(FilterError, match="more than 2000 nodes"):
        filter_expr("a" + " % 2" * 14 + " = 1", WIDE.schema)
    with pytest.raises(FilterError, match="more than 2000 nodes"):
        filter_expr("a" + " % 2" * 14 + " BETWEEN 0 AND 1", WIDE.schema)


def test_between_and_in_read_their_left_side_once():
    """BETWEEN (is_between) and IN (is_in) no longer copy their left side: 16 BETWEENs nested
    and 1,900 items of IN are a few nodes each; both count as operators."""
    nested = "a BETWEEN 0 AND 1"
    for _ in range(15):
        nested = f"CAST({nested} AS INT) BETWEEN 0 AND 1"
    assert WIDE.filter(filter_expr(nested, WIDE.schema)).height == 1000
    many = "a % 2 % 2 % 2 IN (" + ",".join(["1"] * 1900) + ")"
    assert WIDE.filter(filter_expr(many, WIDE.schema)).height == 500
    with pytest.raises(FilterError, match="more than 200 operators"):
        filter_expr(" OR ".join(["a IN (1)"] * 201), WIDE.schema)
    with pytest.raises(FilterError, match="more than 200 operators"):
        filter_expr(" OR ".join(["a BETWEEN 0 AND 1"] * 101), WIDE.schema)


@pytest.mark.parametrize("text, expected", [
    ("n IN (1, NULL)", [3]),  # no item equals: null, never false
    ("NOT (n IN (1, NULL))", []),
    ("n NOT IN (3)", [1, 3, 4, 5]),
    ("n IN (3, 2.5)", [0]),  # an integer column with a fraction's item
    ("x IN (1.5, 2)", [0, 4]),
    ("length(title) IN (6, 7)", [0, 1, 4]),  # an unsigned length
    ("NULL IN (1)", []),
    ("n BETWEEN NULL AND 2", []),
    ("n NOT BETWEEN NULL AND 2", [0, 1]),  # 3 <= 2 is false: the NULL bound does not matter
    ("3 BETWEEN n AND 10", [0, 3, 4, 5]),
    ("title BETWEEN 'L' AND 'M'", [0, 1]),
])
def test_in_and_between_keep_sqls_nulls(text, expected):
    assert rows(text) == expected


@pytest.mark.parametrize("pattern, message", [
    ("%_" * 1990, "at most 500"),
    ("_" * 17, "17 wildcards (% and _); at most 16"),
    ("a%b" * 17, "17 wildcards"),
])
def test_a_like_pattern_of_many_wildcards_is_refused(pattern, message):
    with pytest.raises(FilterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        filter_expr(f"s LIKE '{pattern}'", WIDE.schema)


def test_runs_of_percent_are_one_wildcard():
    assert WIDE.filter(filter_expr("s LIKE '" + "%" * 400 + "x'", WIDE.schema)).height == 500


@pytest.mark.parametrize("literal", ["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"])
def test_a_timestamp_past_the_years_limits_is_a_filter_error(literal):
    frame = pl.DataFrame({"t": [datetime.datetime(2024, 1, 1)]}).with_columns(
        pl.col("t").dt.replace_time_zone("UTC"))
    with pytest.raises(FilterError, match="out of range"):
        filter_expr(f"t > '{literal}'", frame.schema)
