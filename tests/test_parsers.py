"""The output parser: a generated text becomes a typed value or its row's parse_error, and no
text, however odd, stops the job (issue #18). Named cases, a seeded fuzz over random schemas
and outputs, the parser stage in Ray Data, and a whole job whose model answers past int64."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import polars as pl
import pyarrow as pa
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from pipelines import load_config, run_job
from udfs.columns import ErrorKind
from udfs.rows.parsers import OutputParser, StructuredSpec, schema_to_arrow

from conftest import job_config

# The fuzz runs in CI: the same examples every run, a bounded number of them.
FUZZ = settings(derandomize=True, max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NESTED = {"type": "object", "required": ["name", "stats"], "properties": {
    "name": {"type": "string"},
    "stats": {"type": "object", "required": ["count"], "properties": {
        "count": {"type": "integer"}, "ratio": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}}}}}}


def parse_texts(schema: dict, texts: list[str]) -> list[dict]:
    parser = OutputParser(StructuredSpec(json_schema=schema), "text")
    nulls = pa.array([None] * len(texts), pa.string())
    out = parser(pa.table({"text": pa.array(texts, pa.string()), "error_kind": nulls,
                           "error": nulls}))
    assert out.num_rows == len(texts) and out.column("text").to_pylist() == texts
    return out.to_pylist()


def test_truncated_or_invalid_output_keeps_its_text_and_gets_an_error():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}},
              "required": ["n"]}
    parser = OutputParser(StructuredSpec(json_schema=schema), "text")
    batch = pa.table({"text": ['{"n": 2}', '{"n": 1', '{"n": 9}', None],
                      "error_kind": [None, None, None, "null_field"],
                      "error": [None, None, None, "column 'x' is null"]})
    out = parser(batch).to_pylist()
    assert out[0]["parsed"] == {"n": 2} and out[0]["error"] is None
    assert out[1]["error_kind"] == ErrorKind.PARSE and "not valid JSON" in out[1]["error"]
    assert out[1]["text"] == '{"n": 1' and out[1]["parsed"] is None
    assert "does not match the schema at n" in out[2]["error"]
    assert out[3]["error_kind"] == "null_field"


def test_schema_types_map_to_arrow():
    schema = {"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "f": {"type": "number"},
        "b": {"type": "boolean"}, "e": {"enum": ["x", "y"]}, "opt": {"type": ["string", "null"]},
        "l": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"k": {"type": "string"}}}}}
    assert schema_to_arrow(schema) == pa.struct([
        ("s", pa.string()), ("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_()),
        ("e", pa.string()), ("opt", pa.string()), ("l", pa.list_(pa.int64())),
        ("o", pa.struct([("k", pa.string())]))])


MISFITS = {  # valid JSON (to Python at least), valid under NESTED, no room in its column
    '{"name": "a", "stats": {"count": 9223372036854775808}}':
        "at stats/count: 9223372036854775808 is outside the 64-bit integer range",
    '{"name": "a", "stats": {"count": -%d}}' % 10 ** 30:
        "at stats/count: -1" + "0" * 30 + " is outside the 64-bit integer range",
    '{"name": "a", "stats": {"count": 1e300}}':
        "at stats/count: 1e+300 is outside the 64-bit integer range",
    '{"name": "a", "stats": {"count": %d}}' % 10 ** 200:
        "at stats/count: an integer of 201 digits is outside the 64-bit integer range",
    '{"name": "a", "stats": {"count": 1, "ratio": 1e400}}':
        "at stats/ratio: a number beyond the 64-bit float range",
    '{"name": "a", "stats": {"count": 1, "ratio": 9007199254740993}}':
        "at stats/ratio: 9007199254740993 has no exact 64-bit float",
    '{"name": "a\\udc80", "stats": {"count": 1}}':
        "at name: the string holds '\\udc80', a lone surrogate that UTF-8 cannot encode",
    '{"name": "a", "stats": {"count": 1, "tags": ["x", "\\ud800"]}}':
        "at stats/tags/1: the string holds '\\ud800', a lone surrogate",
}
NOT_JSON = {
    '{"name": "a", "stats": {"count": 1, "ratio": NaN}}': "NaN is not a JSON number",
    '{"name": "a", "stats": {"count": 1, "ratio": -Infinity}}': "-Infinity is not a JSON",
    '{"name": "a", "stats": {"count": %s}}' % ("9" * 5000): "for integer string conversion",
    "[" * 100_000 + "]" * 100_000: "nested too deeply",
    '{"name": "a", "stats": {"count": 1}': "Expecting ',' delimiter",
    "": "Expecting value at char 0",
}


@pytest.mark.parametrize("text", list(MISFITS))
def test_a_valid_output_its_column_cannot_hold_is_that_rows_parse_error(text):
    ok, bad = parse_texts(NESTED, ['{"name": "b", "stats": {"count": 2}}', text])
    assert ok["error"] is None and ok["parsed"]["stats"]["count"] == 2
    assert bad["error_kind"] == ErrorKind.PARSE and bad["parsed"] is None
    assert bad["error"].startswith("output does not fit its column: " + MISFITS[text])


@pytest.mark.parametrize("text", list(NOT_JSON))
def test_what_is_not_json_is_that_rows_parse_error(text):
    [row] = parse_texts(NESTED, [text])
    assert row["error_kind"] == ErrorKind.PARSE and NOT_JSON[text] in row["error"]


def test_what_breaks_the_validator_itself_is_that_rows_parse_error():
    # jsonschema's multipleOf divides in floats: an integer past float's range overflows
    schema = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}
    ok, bad = parse_texts(schema, ['{"n": 1.5}', '{"n": %d}' % 10 ** 400])
    assert ok["parsed"] == {"n": 1.5}
    assert bad["error"] == ("output could not be checked: OverflowError: int too large to "
                            "convert to float")


def test_a_long_block_of_misfits_keeps_every_good_row():
    texts = [f'{{"name": "r{i}", "stats": {{"count": {i * 2 ** 62}}}}}' for i in range(200)]
    rows = parse_texts(NESTED, texts)
    assert [r["parsed"]["stats"]["count"] for r in rows[:2]] == [0, 2 ** 62]
    assert all(r["error_kind"] == ErrorKind.PARSE for r in rows[2:])


# --- the fuzz ------------------------------------------------------------------------------

NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=5)


def _bounds(kind: str, values) -> st.SearchStrategy[dict]:
    bounded = st.tuples(values, values).map(sorted).map(
        lambda b: {"type": kind, "minimum": b[0], "maximum": b[1]})
    return st.just({"type": kind}) | bounded


LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    _bounds("integer", st.integers(-(2 ** 70), 2 ** 70)),
    _bounds("number", st.floats(-1e300, 1e300)),
    st.just({"type": "boolean"}),
    st.lists(st.text(max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
).flatmap(lambda s: st.just(s) | st.just({**s, "type": [s["type"], "null"]})
          if "type" in s else st.just(s))


def _objects(children) -> st.SearchStrategy[dict]:
    def shape(props: dict):
        return st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.just(props)},
            optional={"required": st.lists(st.sampled_from(sorted(props)), unique=True),
                      "additionalProperties": st.just(False)})

    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(shape)


SCHEMAS = _objects(st.recursive(
    LEAVES, lambda children: children.map(lambda c: {"type": "array", "items": c,
                                                     "maxItems": 3}) | _objects(children),
    max_leaves=6))


def _project(value, arrow_type: pa.DataType):
    """What the struct column holds for a JSON value: declared fields only, missing ones
    null."""
    if value is None:
        return None
    if pa.types.is_struct(arrow_type):
        return {f.name: _project(value.get(f.name), f.type) for f in arrow_type}
    if pa.types.is_list(arrow_type):
        return [_project(v, arrow_type.value_type) for v in value]
    return value


def _arrow_holds(value, arrow_type: pa.DataType) -> bool:
    """The oracle, from Arrow itself: the value converts, and comes back the same."""
    try:
        back = pa.array([value], type=arrow_type).to_pylist()[0]
    except Exception:
        return False
    return back == _project(value, arrow_type)


BAD_VALUES = st.sampled_from([
    str(2 ** 63), str(-(2 ** 63) - 1), str(10 ** 30), "1e400", "-1e400", "NaN", "Infinity",
    '"\\ud800"', '"x\\udfff"', '["\\ud83d"]', "[" * 3000 + "]" * 3000,
    '{"a": ' * 800 + "1" + "}" * 800, "1" * 5000, "9007199254740993"])


def _invalid_texts(schema: dict) -> st.SearchStrategy[str]:
    """Arbitrary text; a property set to a huge int, a lone surrogate, deep nesting, NaN...;
    a valid output cut off, as max_tokens cuts it."""
    props = sorted(schema["properties"])
    planted = st.tuples(st.sampled_from(props), BAD_VALUES).map(
        lambda p: '{"%s": %s}' % p)
    cut = from_schema(schema).map(json.dumps).flatmap(
        lambda t: st.integers(0, max(len(t) - 1, 0)).map(lambda k: t[:k]))
    return st.one_of(st.text(max_size=40), planted, cut, BAD_VALUES)


@FUZZ
@given(schema=SCHEMAS, data=st.data())
def test_fuzz_valid_outputs_round_trip_or_are_parse_errors(schema, data):
    StructuredSpec(json_schema=schema).check()  # every generated schema is one a job accepts
    arrow_type = schema_to_arrow(schema)
    values = data.draw(st.lists(from_schema(schema), min_size=1, max_size=6), label="values")
    texts = [json.dumps(v, ensure_ascii=data.draw(st.booleans())) for v in values]
    for value, row in zip(values, parse_texts(schema, texts)):
        if _arrow_holds(value, arrow_type):
            assert row["error"] is None, row["error"]
            assert row["parsed"] == _project(value, arrow_type)
        else:  # e.g. an integer past int64: hypothesis-jsonschema draws them unbounded
            assert row["error_kind"] == ErrorKind.PARSE and row["parsed"] is None
            assert row["error"].startswith("output does not fit its column: at ")


@FUZZ
@given(schema=SCHEMAS, data=st.data())
def test_fuzz_invalid_outputs_never_stop_the_parser(schema, data):
    texts = data.draw(st.lists(_invalid_texts(schema), min_size=1, max_size=6), label="texts")
    arrow_type = schema_to_arrow(schema)
    for text, row in zip(texts, parse_texts(schema, texts)):
        if row["error"] is None:  # a text that happens to be valid, and fits
            assert row["parsed"] == _project(json.loads(text), arrow_type)
        else:
            assert row["error_kind"] == ErrorKind.PARSE and row["parsed"] is None
            row["error"].encode("utf-8")  # a lone surrogate quoted in it is escaped


# --- in Ray Data, and a whole job ----------------------------------------------------------

def test_the_parser_stage_in_ray_data_isolates_an_overflowing_row(ray_cluster):
    texts = [json.dumps({"name": f"r{i}", "stats": {"count": i, "tags": ["a"]}})
             for i in range(50)]
    texts[17] = '{"name": "r17", "stats": {"count": 18446744073709551616}}'
    nulls = pa.array([None] * 50, pa.string())
    block = pa.table({"id": list(range(50)), "text": texts, "error_kind": nulls,
                      "error": nulls})
    ds = ray.data.from_arrow(block).map_batches(
        OutputParser, fn_constructor_kwargs={"spec": StructuredSpec(json_schema=NESTED),
                                             "output_column": "text"},
        batch_format="pyarrow", batch_size=None, num_cpus=0.25,
        compute=ray.data.ActorPoolStrategy(size=1))
    out = sorted(pa.concat_tables(ray.get(ds.to_arrow_refs())).to_pylist(),
                 key=lambda r: r["id"])
    assert len(out) == 50
    assert out[17]["error"] == ("output does not fit its column: at stats/count: "
                                "18446744073709551616 is outside the 64-bit integer range")
    assert [r["parsed"]["stats"]["count"] for r in out if r["id"] != 17] == \
        [i for i in range(50) if i != 17]


class ScriptedServer:
    """An OpenAI-compatible chat endpoint on loopback whose 'model' answers every row with
    valid JSON, and the row that mentions OVERFLOW with a count past int64."""

    def __init__(self, model: str):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # /v1/models, asked in pre-flight
                self._send({"data": [{"id": model}]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = json.dumps(request["messages"])
                count = 2 ** 64 if "OVERFLOW" in prompt else len(prompt)
                text = '{"name": "x", "stats": {"count": %d, "tags": ["t"]}}' % count
                self._send({"choices": [{"message": {"content": text},
                                         "finish_reason": "stop"}],
                            "usage": {"completion_tokens": 7}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_job_whose_model_answers_past_int64_finishes_with_that_rows_parse_error(
        tiny_model, ray_cluster, tmp_path):
    rows = [{"sku": f"S{i:02d}", "title": "OVERFLOW" if i == 5 else f"Lamp {i}",
             "description": "A lamp."} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = ScriptedServer(tiny_model)
    try:
        raw = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                         input={"id_column": "sku"}, structured={"json_schema": NESTED})
        raw["engine"] = {"kind": "http", "base_url": server.base_url, "endpoint": "chat"}
        summary = run_job(load_config(raw))
    finally:
        server.close()
    out = pl.read_parquet(tmp_path / "out")
    assert out["sku"].to_list() == [r["sku"] for r in rows]
    bad = out.row(5, named=True)
    assert bad["error_kind"] == ErrorKind.PARSE and bad["parsed"] is None
    assert bad["error"] == ("output does not fit its column: at stats/count: "
                            "18446744073709551616 is outside the 64-bit integer range")
    assert bad["rewritten"] == '{"name": "x", "stats": {"count": 18446744073709551616, ' \
                               '"tags": ["t"]}}'
    assert out.drop_nulls("parsed").height == 11 and summary.errors == {ErrorKind.PARSE: 1}
