"""What ``overnight validate`` (and every run's pre-flight) refuses in one line before any engine
starts, or reads: outputs that overlap their input, hidden folders, values Arrow cannot hold,
sampling out of range, replicas, engine arguments, nulls in nested values, step filters, one
schema across an input's files; credentials never printed; and the steps of a job, unit by
unit where an engine start would only repeat what is tested."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import cli, job_config, one_line_error, write_jsonl
from conftest import override_rows as rows


@pytest.fixture
def job_file(tiny_model, tmp_path):
    """(folder, data folder, write(**sections) -> the job's YAML): a job on data/ (JSONL
    rows of title and description unless a test writes its own files)."""
    data = tmp_path / "data"
    data.mkdir()

    def write(input_path=data, **sections):
        config = job_config(tiny_model, input_path, tmp_path / "out")
        for name, value in sections.items():
            config[name] = {**config.get(name, {}), **value}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return tmp_path, data, write


ROWS = [{"title": f"Lamp {i}", "description": f"light {i}"} for i in range(3)]


# -- 16: replicas


@pytest.mark.parametrize("replicas", [0, -2])
def test_no_replicas_is_refused_by_validate(job_file, capsys, replicas):
    _, data, write = job_file
    write_jsonl(data / "a.jsonl", ROWS)
    code, _, err = cli("validate", write(resources={"replicas": replicas}), capsys=capsys)
    assert code == 2
    one_line_error(err, "resources.replicas", "1 or more")


# -- engine.args


def test_an_unknown_engine_arg_is_refused_by_validate(job_file, capsys):
    _, data, write = job_file
    write_jsonl(data / "a.jsonl", ROWS)
    code, _, err = cli("validate", write(engine={"args": {"max_num_seq": 4}}), capsys=capsys)
    assert code == 2
    one_line_error(err, "engine.args.max_num_seq", "'max_num_seqs'")
    code, _, err = cli("validate", write(engine={"args": {"max_num_seqs": 4, "seed": 1}}),
                       capsys=capsys)
    assert code == 0, err


# -- 8: nulls inside a struct or a list


NESTED = [{"title": "Lamp", "meta": {"color": None, "size": 3}, "tags": ["a", None]},
          {"title": "Desk", "meta": {"color": "red", "size": 4}, "tags": ["b"]}]


def test_a_null_inside_a_struct_or_list_follows_on_null_and_never_prints_none(job_file,
                                                                              capsys):
    _, data, write = job_file
    write_jsonl(data / "a.jsonl", NESTED)
    prompt = {"template": 'Color: {{ meta.color }}, size {{ meta.size }}', "system": None}
    code, out, err = cli("validate", write(prompt=prompt), capsys=capsys)
    assert code == 0, err
    assert "will fail: 1 rows null_field, e.g. row 0: 'meta.color' is null in this row" in out
    lists = {"template": '{{ tags | join(", ") }}', "system": None}
    code, out, err = cli("validate", write(prompt=lists), capsys=capsys)
    assert "will fail: 1 rows null_field, e.g. row 0: 'tags[1]' is null in this row" in out
    code, out, err = cli("validate", write(prompt={**prompt, "on_null": "empty"}),
                         capsys=capsys)
    assert code == 0 and "will fail: no row" in out, err
    assert "Color: , size 3" in out and "Color: red, size 4" in out and "None" not in out
    code, out, err = cli("validate", write(prompt={**lists, "on_null": "empty"}),
                         capsys=capsys)
    assert "\na, <" in out and "None" not in out


def test_a_template_may_test_and_default_a_nested_null(tiny_model):
    from udfs.stages.templates import compile_template, render_template

    template, _ = compile_template(
        "{{ meta.color | default('n/a') }}|{{ 'none' if meta.color is none }}|"
        "{{ meta | tojson }}|{{ tags | select | join(',') }}")
    assert render_template(template, NESTED[0]) == 'n/a|none|{"color": null, "size": 3}|a'


# -- 12, 13: explode over an empty array; a filter a row's value breaks


def test_a_filter_a_row_breaks_is_its_error_and_an_empty_array_is_dropped(
        job_file, capsys, ray_cluster):
    """One job of two steps over a Parquet input with a decimal256 column no filter names
    (polars panicked on it): a filter whose CAST fails on one row's rating makes that row's
    error (filter_error), not the job's; every other row's array is empty (maxItems 0) and
    explodes into no rows: dropped by the step, kept only with output.keep_dropped (dropped_by
    names it), with no element and no index. The report counts them dropped, not ok."""
    import decimal

    import polars as pl

    root, data, write = job_file
    pq.write_table(pa.table({
        "title": ["Lamp", "Desk", "Chair"], "rating": ["4", "good", "5"],
        "price": pa.array([decimal.Decimal("12345678901234567890123456789012345678.5")] * 3,
                          pa.decimal256(40, 1))}), data / "a.parquet")
    path = write()
    config = yaml.safe_load(path.read_text())
    del config["prompt"], config["sampling"]
    config["output"].pop("column")
    config["output"]["keep_dropped"] = True
    config["steps"] = [{"name": "rated", "where": "CAST(rating AS INTEGER) >= 1"},
                       {"name": "tags", "prompt": {"template": "Tags for {{ title }}:"},
                        "sampling": {"temperature": 0.0, "max_tokens": 8},
                        "structured": {"json_schema": {"type": "array", "maxItems": 0,
                                                       "items": {"type": "string"}}},
                        "explode": True}]
    path.write_text(yaml.safe_dump(config))
    code, out, err = cli("run", path, "--quiet", capsys=capsys)
    assert code == 0, err
    written = pq.read_table(root / "out")
    assert written.column("price").type == pa.decimal256(40, 1)  # kept, as it was
    table = pl.from_arrow(written.drop_columns(["price"]))  # (polars cannot read it)
    assert table["title"].to_list() == ["Lamp", "Desk", "Chair"]
    assert table["error_kind"].to_list() == [None, "filter_error", None]
    assert table["error"][1].startswith("step rated: where 'CAST(rating AS INTEGER) >= 1' "
                                        "cannot be evaluated on this row: conversion from")
    assert table["dropped_by"].to_list() == ["tags", None, "tags"]
    assert table["tags_index"].null_count() == table["tags"].null_count() == 3
    assert table["tags_text"].to_list() == ["[]", None, "[]"]
    report = json.loads((root / "out.report.json").read_text())
    assert report["rows"]["ok"] == 0 and report["rows"]["dropped"] == 2
    assert report["rows"]["errors"] == 1
    from pipelines.job.summary import RunSummary  # the summary run prints and records agrees
    summary = RunSummary(**json.loads((root / "out.overnight.json").read_text())["summary"])
    assert (summary.rows_ok, summary.dropped) == (0, 2)
    assert "(0 ok, 0 skipped, 2 dropped by a step, 1 with errors" in summary.lines()[0]
    rated, tags = report["steps"]
    assert (rated["rows_in"], rated["errors"], rated["rows_out"]) == (3, 1, 2)
    assert (tags["rows_in"], tags["dropped"], tags["rows_out"]) == (2, 2, 0)


def test_a_filter_sees_only_the_columns_it_names_and_a_row_it_cannot_read_fails_alone():
    import decimal

    from udfs.stages.where import where_mask

    table = pa.table({"wide": pa.array([decimal.Decimal("1.5")] * 3, pa.decimal256(40, 2)),
                      "rating": ["4", "good", None], "n": [1, 2, 3]})
    keep, failed = where_mask(table, "CAST(rating AS INTEGER) >= 4 AND n < 3")
    assert keep == [True, False, False] and list(failed) == [1]
    assert "conversion from `str` to `i32` failed" in failed[1]
    assert where_mask(table, "n >= 2") == ([False, True, True], {})
    assert where_mask(table, "1 = 1") == ([True] * 3, {})


def test_a_filter_on_a_column_polars_cannot_read_is_refused_by_validate(job_file, capsys):
    import decimal

    _, data, write = job_file
    pq.write_table(pa.table({"title": ["Lamp"], "price": pa.array(
        [decimal.Decimal("1.5")], pa.decimal256(40, 1))}), data / "a.parquet")
    path = write()
    config = yaml.safe_load(path.read_text())
    del config["prompt"], config["sampling"]
    config["output"].pop("column")
    config["steps"] = [{"name": "cheap", "where": "price < 10"},
                       {"name": "pitch", "prompt": {"template": "{{ title }}"}}]
    path.write_text(yaml.safe_dump(config))
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    one_line_error(err, "steps[0] (cheap): where uses 'price', a decimal256(40, 1) column")


# -- 10, 14, 15: one schema for the files of an input


def parquet(path, **columns):
    pq.write_table(pa.table(columns), path)


@pytest.mark.parametrize("case, needles", [
    ("decimal_and_float", ["column 'price' is decimal128(20, 4) in", "a.parquet but double",
                           "b.parquet", "a float keeps 15 digits, not 20"]),
    ("uint64_past_int64", ["column 'n' is uint64 in", "a.parquet but int64", "b.parquet",
                           "it holds 9223372036854775813, which int64 cannot"]),
    ("jsonl_big_int_and_float", ["a.jsonl:2: column 'n' holds the integer 9007199254740993",
                                 "but is a float in", "b.jsonl"]),
    ("int_and_string", ["column 'n' is string in", "b.parquet but int64 in", "a.parquet",
                        "no common type"]),
])
def test_types_that_would_lose_values_across_files_are_refused_in_one_line(
        job_file, capsys, case, needles):
    import decimal

    _, data, write = job_file
    title = {"title": ["Lamp"]}
    if case == "decimal_and_float":
        parquet(data / "a.parquet", **title, price=pa.array(
            [decimal.Decimal("12345678901234.5678")], pa.decimal128(20, 4)))
        parquet(data / "b.parquet", **title, price=[1.5])
    elif case == "uint64_past_int64":
        parquet(data / "a.parquet", **title, n=pa.array([2 ** 63 + 5], pa.uint64()))
        parquet(data / "b.parquet", **title, n=pa.array([-1], pa.int64()))
    elif case == "int_and_string":
        parquet(data / "a.parquet", **title, n=[1])
        parquet(data / "b.parquet", **title, n=["one"])
    else:
        write_jsonl(data / "a.jsonl", [{"title": "Lamp", "n": 1},
                                       {"title": "Desk", "n": 2 ** 53 + 1}])
        write_jsonl(data / "b.jsonl", [{"title": "Chair", "n": 1.5}])
    code, _, err = cli("validate", write(prompt={"template": "{{ title }}"}), capsys=capsys)
    assert code == 2
    one_line_error(err, *needles)


def test_types_that_widen_without_loss_are_read_across_files(job_file, capsys):
    """A categorical (dictionary-encoded) column meets plain strings as strings; a uint64
    within int64's range, a float32 and a decimal of few digits widen; a JSONL file may
    start with a UTF-8 BOM."""
    import decimal

    import polars as pl

    from pipelines.read import read_block, scan_input

    _, data, write = job_file
    pl.DataFrame({"title": ["Lamp", "Desk"], "n": [1, 2]}).with_columns(
        pl.col("title").cast(pl.Categorical), pl.col("n").cast(pl.UInt64)
    ).with_columns(small=pl.Series([0.5, 0.25], dtype=pl.Float32),
                   price=pl.Series([decimal.Decimal("12.34")] * 2,
                                   dtype=pl.Decimal(8, 2))).write_parquet(data / "a.parquet")
    parquet(data / "b.parquet", title=["Chair"], n=pa.array([-1], pa.int64()), small=[0.1],
            price=[1.5])
    code, out, err = cli("validate", write(prompt={"template": "{{ title }} {{ n }} "
                                                   "{{ price }}"}), capsys=capsys)
    assert code == 0, err
    assert "input: 2 parquet file(s), 3 rows" in out and "Chair -1 1.5" in out
    plan = scan_input(str(data), "auto", 8, None)
    assert [str(plan.schema.field(c).type) for c in ("title", "n", "small", "price")] == [
        "string", "int64", "double", "double"]
    got = [r for b in plan.blocks for r in read_block(b, plan.schema).to_pylist()]
    assert [(r["title"], r["n"], r["price"]) for r in got] == [
        ("Lamp", 1, 12.34), ("Desk", 2, 12.34), ("Chair", -1, 1.5)]

    for f in data.iterdir():
        f.unlink()
    (data / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"title": "Lamp"}\r\n{"title": "Desk"}\r\n')
    code, out, err = cli("validate", write(prompt={"template": "{{ title }}"}), capsys=capsys)
    assert code == 0, err
    assert "2 rows" in out and "Lamp" in out


def test_a_filter_no_row_of_the_first_block_can_be_evaluated_on_is_refused_by_validate(
        job_file, capsys):
    _, data, write = job_file
    write_jsonl(data / "a.jsonl", [{"title": f"T{i}", "rating": "good"} for i in range(4)])
    path = write()
    config = yaml.safe_load(path.read_text())
    del config["prompt"], config["sampling"]
    config["output"].pop("column")
    config["steps"] = [{"name": "rated", "where": "CAST(rating AS INTEGER) >= 4"},
                       {"name": "pitch", "prompt": {"template": "{{ title }}"}}]
    path.write_text(yaml.safe_dump(config))
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    one_line_error(err, "steps[0] (rated): where 'CAST(rating AS INTEGER) >= 4' cannot be "
                   "evaluated on any of the 4 rows tried (the first block's), e.g. row 0: "
                   "conversion from `str` to `i32` failed")
    write_jsonl(data / "a.jsonl", [{"title": f"T{i}", "rating": "good" if i else "5"}
                                   for i in range(4)])
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 0, err  # one row it can be evaluated on: the others are their own errors


# -- refused before any engine starts, on rows with a sku and their overrides


@pytest.fixture
def sku_job_file(tiny_model, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()[:4]))

    def write(input_path=data, output=tmp_path / "out", **sections) -> object:
        config = job_config(tiny_model, input_path, output, input={"id_column": "sku"})
        for name, value in sections.items():  # an http engine replaces the vllm one
            config[name] = value if name == "engine" else {**config.get(name, {}), **value}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return tmp_path, data, write


@pytest.mark.parametrize("where", ["same", "inside", "file"])
def test_an_output_that_overlaps_the_input_is_refused_and_the_input_kept(sku_job_file, capsys,
                                                                          where):
    root, data, write = sku_job_file
    output = {"same": data, "inside": data / "out", "file": data / "a.jsonl"}[where]
    code, _, err = cli("run", write(output=output), "--overwrite", capsys=capsys)
    assert code == 2
    one_line_error(err, "overlaps the input")
    assert (data / "a.jsonl").read_text().count("\n") == 4


def test_hidden_and_underscore_folders_are_not_read(sku_job_file, capsys):
    root, data, write = sku_job_file
    for hidden in (".ipynb_checkpoints", "_temporary"):
        (data / hidden).mkdir()
        (data / hidden / "a.jsonl").write_text("{broken\n")
    code, out, err = cli("validate", write(), capsys=capsys)
    assert code == 0, err
    assert "4 rows" in out


@pytest.mark.parametrize("lines, needles", [
    ('{"sku": "A", "title": "t", "description": "d", "n": 18446744073709551616}\n',
     ["a.jsonl:1", "column 'n'", "64-bit integer"]),
    ('{"sku": "A", "title": "t", "description": "d"}\n\u00a0\n', ["a.jsonl:2", "not valid JSON"]),
])
def test_input_values_arrow_cannot_hold_are_one_line_naming_file_and_line(sku_job_file, capsys,
                                                                          lines, needles):
    root, data, write = sku_job_file
    (data / "a.jsonl").write_text(lines, encoding="utf-8")
    code, _, err = cli("validate", write(), capsys=capsys)
    assert code == 2
    one_line_error(err, *needles)


@pytest.mark.parametrize("setting, needle", [
    ("sampling.temperature=3", "sampling.temperature"),
    ("sampling.top_p=1.5", "sampling.top_p"),
])
def test_out_of_range_sampling_is_refused_by_validate(sku_job_file, capsys, setting, needle):
    _, _, write = sku_job_file
    code, _, err = cli("validate", write(), "--set", setting, capsys=capsys)
    assert code == 2
    one_line_error(err, needle)


def test_truncating_chat_messages_for_a_server_is_refused(sku_job_file, capsys):
    _, _, write = sku_job_file
    path = write(prompt={"on_too_long": "truncate"},
                 engine={"kind": "http", "base_url": "http://127.0.0.1:9/v1",
                         "endpoint": "chat"})
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    one_line_error(err, "truncate", "endpoint")


@pytest.mark.parametrize("column, value, needle", [
    ("opts", 7, "overrides_column 'opts' is int64"),
    ("cap", "ten", "max_tokens_column 'cap' is string"),
])
def test_a_sampling_column_of_the_wrong_type_is_refused(sku_job_file, capsys, column, value,
                                                        needle):
    _, data, write = sku_job_file
    rows_ = [{**r, column: value} for r in rows()[:4]]
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    key = "overrides_column" if column == "opts" else "max_tokens_column"
    code, _, err = cli("validate", write(sampling={key: column}), capsys=capsys)
    assert code == 2
    one_line_error(err, needle)


# -- secrets never printed


@pytest.mark.parametrize("path, secrets", [
    ("s3://AKIAEXAMPLE:se/cr+et@bucket/in.parquet", ["AKIAEXAMPLE", "se/cr", "cr+et"]),
    ("https://user:pw-hunter2@127.0.0.1:9/a.jsonl", ["pw-hunter2"]),
    ("s3://bucket/in/*.jsonl?access_key=AKIAQ&secret_key=zz-top", ["AKIAQ", "zz-top"]),
])
def test_credentials_in_an_input_path_are_never_printed(sku_job_file, capsys, path, secrets):
    _, _, write = sku_job_file
    code, _, err = cli("validate", write(input_path=path), capsys=capsys)
    assert code == 2
    line = one_line_error(err)
    assert not any(s in line for s in secrets), line


def test_an_api_key_with_a_trailing_newline_is_not_printed(sku_job_file, capsys, monkeypatch):
    _, _, write = sku_job_file
    monkeypatch.setenv("OVERNIGHT_TEST_KEY", "sk-newline-secret-7\n")
    path = write(engine={"kind": "http", "base_url": "http://u:pw-x9@127.0.0.1:9/v1",
                         "api_key_env": "OVERNIGHT_TEST_KEY"})
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    line = one_line_error(err, "cannot reach the server")
    assert "sk-newline-secret-7" not in line and "pw-x9" not in line
