"""The view's prompt of a row (pipelines/report/view.py: JobView.prompt) where the row's prompt cannot
be rendered: a fixed line naming the kind of error, never the error's text (in serve the caller
is a tenant; the text may quote the server's paths). No engine, no server: a record and one
part written here."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq


def test_a_prompt_that_cannot_be_rendered_is_a_fixed_line(tiny_model, tmp_path, caplog):
    from pipelines.report.view import JobView

    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(pa.table({"title": ["/srv/secret/path", "ok"]}),
                   out / "part-000000000000-000000000002.parquet")
    config = {"model": {"name": tiny_model}, "output": {"column": "generated"},
              "prompt": {"template": "{{ title ~ title.nothing_here() }}", "chat": False}}
    (tmp_path / "out.overnight.json").write_text(json.dumps({"state": "complete",
                                                             "config": config}))
    with caplog.at_level(logging.WARNING, logger="overnight.view"):
        answer = JobView(str(out)).prompt(0)
    assert answer["prompt"] is None
    assert answer["error"] == "the row's prompt could not be rendered: UndefinedError"
    assert "/srv/secret/path" not in answer["error"] and "nothing_here" not in answer["error"]
    assert "a row's prompt" in caplog.text  # the detail: in the server's log


def test_a_refused_filter_is_one_line_in_each_servers_shape():
    """pipelines/report/view.py: refused, overnight view's {"error": line} and, given serve's body,
    the API's error object naming the where parameter."""
    from pipelines.errors import ConfigError
    from pipelines.report.filters import FilterError
    from pipelines.report.view import refused
    from serve.routes_view import _invalid_value

    assert json.loads(refused(FilterError("where 'x': no column")).body) == {
        "error": "where 'x': no column"}
    answer = refused(FilterError("where 'x': no column"), body=_invalid_value)
    assert answer.status_code == 400 and json.loads(answer.body) == {"error": {
        "message": "where 'x': no column", "type": "invalid_request_error", "param": "where",
        "code": "invalid_value"}}
    assert json.loads(refused(ConfigError("try again"), body=_invalid_value).body)[
        "error"]["param"] is None
