"""Defects found in review (issue #46, "Hardening II"), each pinned where a user meets it: a
config, an input or a template that ``overnight validate`` refuses in one line (or reads), and
the steps of a job, unit by unit where an engine start would only repeat what is tested."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines.cli import main

from conftest import job_config


def cli(*args, capsys) -> tuple[int, str, str]:
    code = main([*map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overnight: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


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


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


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
    from udfs.prompts import compile_template, render_template

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
    rated, tags = report["steps"]
    assert (rated["rows_in"], rated["errors"], rated["rows_out"]) == (3, 1, 2)
    assert (tags["rows_in"], tags["dropped"], tags["rows_out"]) == (2, 2, 0)


def test_a_filter_sees_only_the_columns_it_names_and_a_row_it_cannot_read_fails_alone():
    import decimal

    from udfs.steps import where_mask

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
