"""Every Arrow type where input values meet polars (udfs/rows/to_polars.py): the id column's check
(pipelines/read/scan.py: IdDigest, pipelines/plan/input_checks.py: _repeated_ids) and the conversion
a filter and a row hash read. A decimal256 column (a BigQuery BIGNUMERIC export) made polars
panic: every run of a template reading it stopped, and as an id column `validate` printed a
traceback; a float id column with two NaNs passed as unique.

Property tests (hypothesis) over types drawn from Arrow's: leaves (integers, floats with NaN
and infinities, decimals 32-256 of each width, strings and binaries of every layout, dates,
times, timestamps with and without a zone, durations, month-day-nano intervals), inside
lists, large and fixed-size lists, structs and maps, and as dictionaries, run-end encodings
and list views: 300 cases for the conversion, 200 for the id check (deadline off)."""

from __future__ import annotations

import datetime
import decimal
import json
import math

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from udfs.rows import to_polars

D = decimal.Decimal


def _decimals(precision: int, scale: int):
    top = 10 ** precision - 1  # every digit the type holds, at its scale
    return st.integers(-top, top).map(lambda i: D(f"{i}E-{scale}"))  # (exact: no context)


UTC = datetime.timezone.utc
# (type, a strategy of its values); a small pool of each is drawn, so rows repeat
LEAVES = {
    "int8": (pa.int8(), st.integers(-128, 127)),
    "int64": (pa.int64(), st.integers(-2 ** 63, 2 ** 63 - 1)),
    "uint64": (pa.uint64(), st.integers(0, 2 ** 64 - 1)),
    "float32": (pa.float32(), st.floats(width=32)),
    "float64": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=4)),
    "large_string": (pa.large_string(), st.text(max_size=4)),
    "string_view": (pa.string_view(), st.text(max_size=4)),
    "binary": (pa.binary(), st.binary(max_size=4)),
    "large_binary": (pa.large_binary(), st.binary(max_size=4)),
    "binary_view": (pa.binary_view(), st.binary(max_size=4)),
    "fixed_size_binary": (pa.binary(3), st.binary(min_size=3, max_size=3)),
    "decimal32": (pa.decimal32(5, 2), _decimals(5, 2)),
    "decimal64": (pa.decimal64(12, 3), _decimals(12, 3)),
    "decimal128": (pa.decimal128(38, 10), _decimals(38, 10)),
    "decimal256_narrow": (pa.decimal256(20, 2), _decimals(20, 2)),
    "decimal256_38": (pa.decimal256(38, 0), _decimals(38, 0)),
    "decimal256_wide": (pa.decimal256(40, 1), _decimals(40, 1)),
    "decimal256_bignumeric": (pa.decimal256(76, 38), _decimals(76, 38)),
    "date32": (pa.date32(), st.dates()),
    "timestamp_s": (pa.timestamp("s"), st.datetimes(datetime.datetime(1900, 1, 1),
                                                    datetime.datetime(2200, 1, 1))
                    .map(lambda t: t.replace(microsecond=0))),
    "timestamp_us_utc": (pa.timestamp("us", "UTC"), st.datetimes(
        datetime.datetime(1900, 1, 1), datetime.datetime(2200, 1, 1), timezones=st.just(UTC))),
    "time64_ns": (pa.time64("ns"), st.times()),
    "duration_s": (pa.duration("s"), st.integers(-10 ** 9, 10 ** 9)),
    "interval": (pa.month_day_nano_interval(), st.tuples(
        st.integers(-2 ** 31, 2 ** 31 - 1), st.integers(-2 ** 31, 2 ** 31 - 1),
        st.integers(-2 ** 63, 2 ** 63 - 1)).map(lambda t: pa.MonthDayNano(list(t)))),
    "null": (pa.null(), st.none()),
}
INNER = ("list", "large_list", "fixed_size_list", "struct", "map")
OUTER = (None, "dictionary", "run_end_encoded", "list_view", "large_list_view")


@st.composite
def columns(draw, rows=st.integers(1, 12), outer=OUTER):
    """An Arrow array of a drawn type and its rows (values from a small pool: rows repeat;
    nulls among them)."""
    kind, values = LEAVES[draw(st.sampled_from(sorted(LEAVES)))]
    wrappers = draw(st.lists(st.sampled_from(INNER), max_size=2))
    pool = draw(st.lists(values, min_size=1, max_size=4))
    n = draw(rows)

    def one():
        return None if draw(st.integers(0, 5)) == 0 else draw(st.sampled_from(pool))

    def wrapped(kind, depth):
        if depth == len(wrappers):
            return kind, one
        inner, make = wrapped(kind, depth + 1)
        how = wrappers[depth]
        if how == "struct":
            return pa.struct([("a", inner), ("b", pa.int8())]), lambda: {
                "a": make(), "b": draw(st.integers(0, 1))}
        if how == "map":
            return pa.map_(pa.string(), inner), lambda: [
                (draw(st.sampled_from("xy")), make()) for _ in range(draw(st.integers(0, 2)))]
        if how == "fixed_size_list":
            return pa.list_(inner, 2), lambda: [make(), make()]
        container = pa.list_ if how == "list" else pa.large_list
        return container(inner), lambda: [make() for _ in range(draw(st.integers(0, 2)))]

    kind, make = wrapped(kind, 0)
    top = [None if draw(st.integers(0, 5)) == 0 else make() for _ in range(n)]
    array = pa.array(top, kind)
    how = draw(st.sampled_from(outer))
    if how == "dictionary" and not pa.types.is_null(kind):
        try:
            array = array.dictionary_encode()
        except pa.ArrowNotImplementedError:  # (not every type can be a dictionary's)
            pass
    elif how == "run_end_encoded":
        try:
            array = pc.run_end_encode(array)
        except pa.ArrowNotImplementedError:  # (nor of a run-end encoding's)
            pass
    elif how in ("list_view", "large_list_view") and (pa.types.is_list(kind)
                                                      or pa.types.is_large_list(kind)):
        field = kind.value_field
        view = pa.list_view(field) if how == "list_view" else pa.large_list_view(field)
        try:
            array = array.cast(view)
        except pa.ArrowNotImplementedError:  # (not every list casts to a view)
            array = pa.array(top, view)
    return array


def _values(series) -> list:
    """A Series' values, a map's entries as they are (to_list makes a map a dict, one
    entry a key); polars' own export panics on some nested types: then to_list."""
    import polars as pl

    try:
        return series.to_arrow().to_pylist()
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001
        return series.to_list()


def same(a, b) -> bool:
    """Python values equal, NaN equal to NaN (a row's value is itself)."""
    return key(a) == key(b)


def key(value) -> str:
    def plain(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else repr(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return repr(v)
    return json.dumps(plain(value), sort_keys=True)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(columns())
def test_every_arrow_type_reaches_polars_with_rows_equal_exactly_where_they_were(array):
    """to_polars never raises, keeps the rows, and tells rows apart exactly where their
    values differ (the row hash a request key and the id check rest on): equal values hash
    equal, different values stay different; the source keeps its type."""
    kind = array.type
    frame = to_polars.frame(pa.table({"c": array}))
    series = to_polars.series(array)
    assert frame.height == len(array) == len(series)
    assert array.type == kind  # for polars' eyes only
    values = array.to_pylist()
    seen = [key(v) for v in _values(series)]
    hashes = frame.hash_rows(seed=7).to_list()
    for i in range(len(values)):
        for j in range(i):
            assert same(values[i], values[j]) == (seen[i] == seen[j]), (kind, values[i],
                                                                        values[j])
            if same(values[i], values[j]):
                assert hashes[i] == hashes[j], (kind, values[i])


def test_a_decimal256_is_read_exactly_and_the_filter_compares_it_as_a_number():
    from udfs.stages.where import where_mask

    narrow = pa.array([D("1.25"), D("100.50"), None], pa.decimal256(20, 2))
    wide = pa.array([D("1" * 40 + ".5"), None, D("-0.5")], pa.decimal256(76, 1))
    assert to_polars.series(narrow).to_list() == [D("1.25"), D("100.50"), None]
    assert to_polars.series(wide).to_list() == ["1" * 40 + ".5", None, "-0.5"]  # exact text
    assert to_polars.as_text(wide.type) and not to_polars.as_text(narrow.type)
    table = pa.table({"price": narrow, "big": wide})
    assert where_mask(table, "price > 10") == ([False, True, False], {})


@pytest.fixture(scope="module")
def id_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ids")


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(array=columns(rows=st.integers(1, 10), outer=(None, "dictionary")),
       row_group=st.integers(1, 4))
def test_the_id_check_takes_every_type_and_finds_every_repeat_null_and_nan(array, row_group,
                                                                           id_folder):
    """An id column of any type Parquet holds: scanned (its hashes, in row groups), its
    nulls counted, its first NaN found, and its repeats found as Python finds them; the
    writer's count of a part's rows by their ids right (a map's once raised); never a
    traceback. (-0.0 and 0.0 are left out: whether they are one id is a choice, not a
    finding; so are maps, whose entries' order polars' hash reads.)"""
    from pipelines.plan.input_checks import _repeated_ids
    from pipelines.read import scan_input
    from pipelines.write.parts import count_runs

    values = array.to_pylist()
    assume(not any(isinstance(v, float) and v == 0 and math.copysign(1, v) < 0
                   for v in _leaves(values)))
    real = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    # the writer counts a part's input rows as runs of one id (a row's samples share it)
    if real and not any(isinstance(v, float) and math.isnan(v) for v in _leaves(real)):
        ids = pa.array(real, array.type) if not pa.types.is_dictionary(array.type) else \
            pa.array(real, array.type.value_type).dictionary_encode()
        assert count_runs(ids) == 1 + sum(not same(a, b) for a, b in zip(real, real[1:]))
    assume("map<" not in str(array.type))
    # pyarrow 26 reads a list of nulls back from a Parquet row group past the first as an
    # invalid array (offsets past its values): a reader's bug, not the id check's
    assume("<item: null>" not in str(array.type))
    path = id_folder / "ids.parquet"
    try:
        pq.write_table(pa.table({"id": array, "n": range(len(array))}), path,
                       row_group_size=row_group)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        assume(False)  # a type Parquet cannot hold: no input has it
    plan = scan_input(str(path), "parquet", 4, "id")
    assert plan.ids.nulls == sum(v is None for v in values)
    nans = [i for i, v in enumerate(values) if isinstance(v, float) and math.isnan(v)]
    assert plan.ids.nan_at == (nans[0] if nans else None)
    repeated = {key(v) for v in real if sum(same(v, w) for w in real) > 1}
    found, examples = _repeated_ids(plan, "id")
    assert found == len(repeated), (array.type, values, examples)


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def test_validate_refuses_nan_ids_and_takes_decimal256_ids_in_one_line(tiny_model, tmp_path,
                                                                        capsys):
    """As the issue found them: validate on a decimal256 id column (it printed a traceback),
    two NaN ids (they passed as unique), a decimal256 id repeated: each one line."""
    from pipelines.cli import main

    def validate(table: pa.Table) -> tuple[int, str]:
        pq.write_table(table, tmp_path / "in.parquet")
        (tmp_path / "job.yaml").write_text(json.dumps({
            "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id"},
            "model": {"name": tiny_model, "max_model_len": 512},
            "prompt": {"template": "{{ title }}: {{ price }}"},
            "sampling": {"max_tokens": 8}, "output": {"path": str(tmp_path / "out")}}))
        code = main(["validate", str(tmp_path / "job.yaml")])
        return code, capsys.readouterr().err.strip()

    price = pa.array([D("1.5"), D("2.5"), D("3.5")], pa.decimal256(76, 38))
    ok = pa.table({"id": pa.array([D("1"), D("2"), D("3")], pa.decimal256(40, 0)),
                   "title": ["a", "b", "c"], "price": price})
    assert validate(ok) == (0, "")
    nan = ok.set_column(0, "id", pa.array([1.0, float("nan"), float("nan")]))
    assert validate(nan) == (2, "overnight: error: input.id_column 'id' has NaN at row 1 "
                                "(counting from 0): an id must tell rows apart, and NaN "
                                "equals nothing, itself included")
    twice = ok.set_column(0, "id", pa.array([D("1"), D("1"), D("3")], pa.decimal256(40, 0)))
    assert validate(twice) == (2, "overnight: error: input.id_column 'id' is not unique: 1 "
                                  "value(s) repeat, e.g. '1'")
