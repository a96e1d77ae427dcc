"""Request keys (pipelines/reuse/request_key.py) and what the fingerprint holds of a job's files
(pipelines/plan/model_files.py): the key changes whenever the request the engine gets would, and two
rows share one only where their prompts are the same. Pure functions and pre-flight: no engine.

The property test draws tables of mixed column types (ints of each width, uint64, floats with
-0.0, NaN and inf, decimals of several scales, decimal256 and decimals in lists, bools,
strings, binary, dates, naive and zoned timestamps, lists, structs, maps, dictionaries, nulls), two tables whose same
column may have another type, and checks, over every pair of rows of both, that an equal key
means an equal prompt (the project's own renderer) and equal typed values.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.reuse.request_key import KeySpec, canonical_column, request_keys
from udfs.stages.prompts import PromptRenderer
from udfs.stages.templates import compile_template, render_template

REPO = Path(__file__).resolve().parent.parent
SPEC_PARTS = {"prompt": {"template": "fixed"}, "request key": {"scheme": "test"}}
PARIS = "Europe/Paris"

# Raw values every type below takes its own way: chosen so that two types' values often share
# polars' row hash (0, 1, -1, 10 and their bits, the same instant)
RAW = st.sampled_from([0, 1, -1, 10, 100, 2**31 - 1, 2**40, -(2**63), 2**63 - 1])


def _float(raw: int, special: int) -> float:
    return [float(raw), -0.0, 0.0, float("nan"), float("inf"), -float("inf"), 0.1, 1.0][special]


def _instant(raw: int) -> int:
    return raw % (2**41)  # microseconds within the years a datetime holds


def _value(kind: str, raw: int, special: int):
    """The raw value as one of ``kind``'s, or None (a null)."""
    if special == 8:
        return None
    if kind == "int8":
        return raw % 100
    if kind == "int32":
        return max(min(raw, 2**31 - 1), -(2**31))
    if kind == "int64":
        return raw
    if kind == "uint64":
        return raw % 2**64
    if kind == "bool":
        return bool(raw % 2)
    if kind in ("float32", "float64"):
        return _float(raw, special)
    if kind.startswith("decimal"):
        scale = int(kind[-1])
        return decimal.Decimal(raw % 10**6).scaleb(-scale)
    if kind in ("string", "large_string", "dict"):
        return ["", str(raw), str(raw % 10), "a"][special % 4]
    if kind == "binary":
        return ["", str(raw), str(raw % 10), "a"][special % 4].encode()
    if kind in ("date32", "date64"):
        return dt.date(2026, 1, 1) + dt.timedelta(days=raw % 1000)
    if kind.startswith("ts"):
        moment = dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=_instant(raw))
        return moment if kind == "ts" else moment.replace(tzinfo=dt.timezone.utc)
    if kind == "list_float":
        return [_float(raw, special), _float(raw, (special + 1) % 8)][:special % 3]
    if kind == "list_int":
        return [raw % 7, None][:special % 3]
    if kind == "struct":
        return {"x": _float(raw, special), "y": None if special == 7 else str(raw % 3)}
    if kind == "map":
        return [("k", raw % 3)][:special % 2]
    if kind == "list_decimal":  # (a decimal inside a list panicked polars' row hash)
        return [decimal.Decimal(raw % 1000).scaleb(-2), None][:special % 3]
    return None  # "null"


TYPES = {
    "int8": pa.int8(), "int32": pa.int32(), "int64": pa.int64(), "uint64": pa.uint64(),
    "bool": pa.bool_(), "float32": pa.float32(), "float64": pa.float64(),
    "decimal1": pa.decimal128(10, 1), "decimal2": pa.decimal128(10, 2),
    "decimal0": pa.decimal128(12, 0), "decimal256_2": pa.decimal256(40, 2),
    "string": pa.string(), "large_string": pa.large_string(), "binary": pa.binary(),
    "dict": pa.dictionary(pa.int32(), pa.string()),
    "date32": pa.date32(), "date64": pa.date64(),
    "ts": pa.timestamp("us"), "ts_utc": pa.timestamp("us", "UTC"),
    "ts_paris": pa.timestamp("us", PARIS), "ts_ms_utc": pa.timestamp("ms", "UTC"),
    "list_float": pa.list_(pa.float64()), "list_int": pa.large_list(pa.int16()),
    "struct": pa.struct([("x", pa.float32()), ("y", pa.string())]),
    "map": pa.map_(pa.string(), pa.int64()), "null": pa.null(),
    "list_decimal": pa.list_(pa.decimal64(10, 2)),
}


def _array(kind: str, cells: list[tuple[int, int]]) -> pa.Array:
    values = [_value(kind, raw, special) for raw, special in cells]
    if kind == "ts_ms_utc":
        values = [None if v is None else v.replace(microsecond=v.microsecond // 1000 * 1000)
                  for v in values]
    if kind == "float32":  # (as float32 holds it)
        return pa.array(values, pa.float64()).cast(pa.float32())
    if kind == "dict":
        return pa.array(values, pa.string()).dictionary_encode()
    if kind == "ts_paris":
        return pa.array(values, pa.timestamp("us", "UTC")).cast(TYPES[kind])
    return pa.array(values, TYPES[kind])


def _typed(value):
    """A value as a template could tell it apart: its Python type and text, deeply."""
    if isinstance(value, dict):
        return ("dict", [(k, _typed(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    return (type(value).__name__, repr(value))


NAMES = ("a", "b", "c")
TEMPLATE = compile_template("a={{ a }};b={{ b }};c={{ c }}")[0]


def _rendered(table: pa.Table) -> list[str]:
    """Each row's prompt text, as the renderer fills it (nulls printed empty)."""
    return [render_template(TEMPLATE, PromptRenderer.fill_nulls(row), "empty")
            for row in table.select(list(NAMES)).to_pylist()]


cells = st.lists(st.tuples(RAW, st.integers(0, 8)), min_size=1, max_size=5)
kinds = st.sampled_from(sorted(TYPES))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(kinds, kinds), min_size=3, max_size=3), cells, st.data())
def test_rows_share_a_key_only_where_their_prompts_and_values_are_the_same(types, first, data):
    """300 examples: two tables (the same columns, each maybe of another type) of 1-5 rows
    each; over all pairs of their rows, an equal key means an equal prompt and equal typed
    values. Keys do not depend on how a table is cut into chunks."""
    second = data.draw(cells)
    spec = KeySpec.of(SPEC_PARTS, list(NAMES))
    tables = [pa.table({name: _array(kind[i], rows) for name, kind in zip(NAMES, types)})
              for i, rows in ((0, first), (1, second))]
    keys, prompts, values = [], [], []
    for table in tables:
        keys += request_keys(table, spec).to_pylist()
        prompts += _rendered(table)
        values += [_typed(row) for row in table.to_pylist()]
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            if keys[i] == keys[j]:
                assert prompts[i] == prompts[j], (types, i, j)
                assert values[i] == values[j], (types, i, j)
    table = tables[0]
    if table.num_rows > 1:  # the same rows in other chunks, sliced: the same keys
        chunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
        assert request_keys(chunked, spec).to_pylist() == keys[:table.num_rows]


@pytest.mark.parametrize("a,b", [
    (pa.array([decimal.Decimal("0.10")], pa.decimal128(10, 2)),
     pa.array([decimal.Decimal("1.0")], pa.decimal128(10, 1))),
    (pa.array([0], pa.timestamp("us", "UTC")), pa.array([0], pa.timestamp("us", PARIS))),
    (pa.array([0], pa.timestamp("us")), pa.array([0], pa.timestamp("us", "UTC"))),
    (pa.array([-0.0]), pa.array([0.0])),
    (pa.array([[-0.0]]), pa.array([[0.0]])),
    (pa.array([{"x": -0.0}]), pa.array([{"x": 0.0}])),
    (pa.array([True]), pa.array([1])),
    (pa.array([b"ab"]), pa.array(["ab"])),
    (pa.array([2**64 - 1], pa.uint64()), pa.array([-1], pa.int64())),
    (pa.array([""]), pa.array([0])),
    (pa.array([None], pa.struct([("x", pa.int64())])),
     pa.array([{"x": None}], pa.struct([("x", pa.int64())]))),
])
def test_values_that_print_apart_have_other_keys(a, b):
    """The cases polars' row hash alone gave one key (the issue's list)."""
    spec = KeySpec.of(SPEC_PARTS, ["v"])
    assert render_template(compile_template("{{ v }}")[0], {"v": a.to_pylist()[0]}, "empty") \
        != render_template(compile_template("{{ v }}")[0], {"v": b.to_pylist()[0]}, "empty")
    assert request_keys(pa.table({"v": a}), spec) != request_keys(pa.table({"v": b}), spec)


@pytest.mark.parametrize("a,b", [
    (pa.array([5], pa.int32()), pa.array([5], pa.int64())),
    (pa.array(["x"], pa.string()), pa.array(["x"], pa.large_string())),
    (pa.array(["x"]).dictionary_encode(), pa.array(["x"])),
    (pa.array([[1.5]], pa.list_(pa.float32())), pa.array([[1.5]], pa.large_list(pa.float64()))),
    (pa.array([decimal.Decimal("0.10")], pa.decimal128(10, 2)),
     pa.array([decimal.Decimal("0.10")], pa.decimal256(40, 2))),
    (pa.array([float("nan")]), pa.array([-float("nan")])),
])
def test_values_that_print_alike_across_types_keep_one_key(a, b):
    """A table written by another tool (int32 for int64, large strings, decimal256): the same
    printed values, the same keys, so a re-run still reuses them."""
    spec = KeySpec.of(SPEC_PARTS, ["v"])
    assert request_keys(pa.table({"v": a}), spec) == request_keys(pa.table({"v": b}), spec)


def test_a_key_column_of_any_type_makes_keys():
    """decimal256 (polars cannot read it: it panicked), a union and an interval (as text)."""
    spec = KeySpec.of(SPEC_PARTS, ["v"])
    union = pa.UnionArray.from_sparse(pa.array([0, 1], pa.int8()),
                                      [pa.array([1, 2]), pa.array(["a", "b"])])
    for column in (pa.array([decimal.Decimal("1.5"), None], pa.decimal256(60, 3)), union,
                   pa.array([pa.scalar((1, 2, 3), pa.month_day_nano_interval()).as_py(), None],
                            pa.month_day_nano_interval())):
        keys = request_keys(pa.table({"v": column}), spec).to_pylist()
        assert len(keys) == 2 and keys[0] != keys[1]
    assert canonical_column(pa.chunked_array([], pa.float32()))[1] == "float"


# -- what the fingerprint holds of the model's and an adapter's files

def _model_copy(tmp_path: Path, source: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(source, model)
    return model


@pytest.fixture
def tiny_copy(tmp_path, tiny_model):
    return _model_copy(tmp_path, Path(tiny_model))


def test_a_model_directory_is_named_by_its_files(tiny_copy):
    from pipelines.plan.model_files import model_fingerprint

    before = model_fingerprint(str(tiny_copy))
    assert model_fingerprint(str(tiny_copy)) == before
    template = tiny_copy / "chat_template.jinja"
    template.write_text(template.read_text() + " ")  # the chat template edited in place
    edited = model_fingerprint(str(tiny_copy))
    assert edited != before
    weights = tiny_copy / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # retrained: new time
    assert model_fingerprint(str(tiny_copy)) != edited
    (tiny_copy / ".cache").mkdir()  # a download's bookkeeping: not the model
    (tiny_copy / ".cache" / "lock").write_text("x")
    assert model_fingerprint(str(tiny_copy)) == model_fingerprint(str(tiny_copy))
    tokenizer = {"tokenizer": str(tiny_copy)}  # engine.args naming the model's own: once
    assert set(model_fingerprint(str(tiny_copy), tokenizer)) == {"model"}


def test_a_hugging_face_name_is_its_cached_commit(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from pipelines.plan.model_files import model_fingerprint

    repo = tmp_path / "models--org--name"
    commit = "a" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert model_fingerprint("org/name") == {"model": {"revision": commit}}
    assert model_fingerprint("org/other") == {"model": {"revision": None}}


def test_an_adapter_retrained_in_place_is_another_job(tmp_path):
    from pipelines.plan.adapters import adapters_fingerprint

    adapter = tmp_path / "de"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\0" * 64)
    stat = weights.stat()
    before = adapters_fingerprint({"de": str(adapter), "served": None})
    weights.write_bytes(b"\1" * 64)  # the same size, the same time: other weights
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = adapters_fingerprint({"de": str(adapter), "served": None})
    assert after != before and after["served"] is None


# -- pre-flight and validate: what changed, said before any engine starts

def _job(tmp_path: Path, model: Path, **sections) -> dict:
    rows = [{"sku": f"S{i}", "title": f"Item {i % 5}"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    job = {"input": {"path": str(tmp_path / "t.parquet"), "id_column": "sku"},
           "model": {"name": str(model), "max_model_len": 256, "dtype": "float32"},
           "prompt": {"template": "Title: {{ title }}"},
           "sampling": {"temperature": 0.0, "max_tokens": 4},
           "output": {"path": str(tmp_path / "out"), "column": "generated",
                      "reuse": True}}
    job.update(sections)
    return job


def earlier_output(plan, out: Path) -> None:
    """An output as the job would have written it (its request keys, its metadata), without
    an engine: each row's text made up."""
    from pipelines.job.pipeline import job_metadata
    from pipelines.read import read_block
    from udfs import columns

    table = pa.concat_tables([read_block(b, plan.input.schema) for b in plan.input.blocks])
    keys = request_keys(table, plan.request_key)
    table = table.drop_columns([columns.ORDINAL])
    n = table.num_rows
    for name, value in ((plan.config.output.column, pa.array(["x"] * n)),
                        (columns.PROMPT_TOKENS, pa.array([3] * n)),
                        (columns.COMPLETION_TOKENS, pa.array([4] * n)),
                        (columns.FINISH_REASON, pa.array(["length"] * n)),
                        (columns.ERROR_KIND, pa.nulls(n, pa.string())),
                        (columns.ERROR, pa.nulls(n, pa.string())),
                        (columns.REQUEST_KEY, keys)):
        table = table.append_column(name, value)
    table = table.replace_schema_metadata(
        {columns.JOB_METADATA: json.dumps(job_metadata(plan)).encode()})
    out.mkdir(exist_ok=True)
    pq.write_table(table, out / f"part-000000000000-{n:012d}.parquet")


def test_validate_says_a_model_changed_in_place_reuses_nothing(tiny_copy, tmp_path):
    from pipelines import load_config
    from pipelines.plan.preflight import plan_job
    from pipelines.plan.validate import validate_job

    job = _job(tmp_path, tiny_copy, output={"path": str(tmp_path / "out"), "column": "generated",
                                            "reuse_from": str(tmp_path / "snapshot")})
    earlier_output(plan_job(load_config(job)), tmp_path / "snapshot")
    assert validate_job(load_config(job)).reuse == (
        f"reuse: 8 of 8 rows reusable from {tmp_path / 'snapshot'}; 0 to generate")
    config = json.loads((tiny_copy / "tokenizer_config.json").read_text())
    weights = tiny_copy / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a copy without -p
    assert validate_job(load_config(job)).reuse == (
        f"reuse: 0 of 8 rows reusable from {tmp_path / 'snapshot'}; 8 to generate "
        "(model files changed: model.safetensors (modification time))")
    (tiny_copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert validate_job(load_config(job)).reuse == (
        f"reuse: 0 of 8 rows reusable from {tmp_path / 'snapshot'}; 8 to generate "
        "(model files changed: chat_template.jinja (content), model.safetensors "
        "(modification time))")
    assert config  # (the tokenizer's own settings untouched)


def test_a_steps_json_schema_file_is_keyed_by_its_content(tiny_copy, tmp_path):
    from pipelines import load_config
    from pipelines.plan.preflight import plan_job
    from pipelines.plan.changes import changed_keys

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"]}))
    job = _job(tmp_path, tiny_copy)
    del job["prompt"], job["sampling"], job["output"]["column"]
    job["steps"] = [{"name": "judge", "prompt": {"template": "Judge: {{ title }}"},
                     "sampling": {"temperature": 0.0, "max_tokens": 8},
                     "structured": {"json_schema": str(schema)}}]
    before = plan_job(load_config(job))
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "integer"}},
                                  "required": ["ok"]}))
    after = plan_job(load_config(job))
    assert after.request_key.parts != before.request_key.parts
    assert changed_keys(json.loads(before.request_key.parts),
                        json.loads(after.request_key.parts)) == ["steps"]
    assert after.fingerprint["steps"] != before.fingerprint["steps"]  # a resume refuses it


# -- a refused resume or retry says what changed; a record from before model.files resumes

def _fingerprint(**changes) -> dict:
    base = {"sampling": {"max_tokens": 4}, "engine": {"kind": "vllm"},
            "model": {"name": "m", "max_model_len": 256,
                      "files": {"model": {"files": {"config.json": "a" * 32,
                                                    "model.safetensors": [100, 1]}}}},
            "steps": [{"name": "judge", "prompt": {"template": "x"},
                       "structured": {"json_schema": {"type": "object"}}}],
            "adapters": {"de": {"files": {"adapter_model.safetensors": "b" * 32}},
                         "served": None}}
    return json.loads(json.dumps({**base, **changes}))


def test_a_record_from_before_model_files_matches_on_them():
    from pipelines.plan.changes import diff_fingerprints, what_changed

    ours = _fingerprint()
    earlier = _fingerprint()
    del earlier["model"]["files"]  # written before the fingerprint held the model's files
    assert diff_fingerprints(earlier, ours) == []
    earlier["model"]["max_model_len"] = 512  # the rest of the model still counts
    assert diff_fingerprints(earlier, ours) == ["model"]
    assert what_changed(earlier, ours) == "model changed"
    assert diff_fingerprints(ours, earlier) == ["model"]  # (files recorded, none now: changed)


def test_what_changed_names_the_files_and_the_step():
    from pipelines.plan.changes import changed_settings, what_changed

    ours = _fingerprint()
    copied = _fingerprint()
    copied["model"]["files"]["model"]["files"]["model.safetensors"] = [100, 2]
    assert what_changed(copied, ours) == (
        "model files changed: model.safetensors (modification time)")
    copied["model"]["files"]["model"]["files"]["config.json"] = "c" * 32
    copied["model"]["files"]["model"]["files"]["extra.bin"] = [1, 1]
    copied["sampling"]["max_tokens"] = 8
    assert what_changed(copied, ours) == (
        "sampling changed; model files changed: config.json (content), extra.bin (removed), "
        "model.safetensors (modification time)")
    assert changed_settings(copied, ours) == (
        "sampling.max_tokens changed; model files changed: config.json (content), extra.bin "
        "(removed), model.safetensors (modification time)")
    hub = _fingerprint(model={"name": "org/m", "files": {"model": {"revision": "1" * 40}}})
    assert what_changed(hub, _fingerprint(model={"name": "org/m", "files": {
        "model": {"revision": "2" * 40}}})) == (
        "model files changed: the cached commit (111111111111 -> 222222222222)")
    retrained = _fingerprint(adapters={"de": {"files": {"adapter_model.safetensors": "d" * 32}},
                                       "served": None})
    assert what_changed(retrained, ours) == (
        "adapters changed: de: adapter_model.safetensors (content)")
    before = _fingerprint(adapters={"de": {"config": "e" * 16, "weights bytes": 64},
                                    "served": None})  # an older record's form: still refused
    assert what_changed(before, ours) == "adapters changed: de: its files"
    schema = _fingerprint()
    schema["steps"][0]["structured"]["json_schema"] = "judge.json"  # (an older record's path)
    assert what_changed(schema, ours) == "steps[0] (judge) changed: structured.json_schema"


def test_an_http_engines_model_is_fingerprinted_by_its_name(tiny_copy, tmp_path):
    """Its server holds the model; a local copy or cache of that name says nothing of it."""
    from pipelines import load_config
    from pipelines.plan.fingerprint import _model_fingerprint

    job = _job(tmp_path, tiny_copy)
    assert "files" in _model_fingerprint(load_config(job), 256)
    job["engine"] = {"kind": "http", "base_url": "http://127.0.0.1:9/v1"}
    model = _model_fingerprint(load_config(job), 256)
    assert "files" not in model and model["name"] == str(tiny_copy)
