"""``overnight serve``'s HTTP surface against a hostile caller, on the real app served by
uvicorn in this process (a stand-in runner: no engine, no batch runs): a batch page's row
filter cannot read a file (polars' SQL did: another key's upload, the server's secret,
/etc/passwd came back in its errors), a body stops being read at its route's limit, chunked
or not, and a body or field of the wrong shape is a 400 in the API's own error object, never
a 500 with an exception's text. Also the view cache's bound and the queue-depth gauge."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.report.view import _quoted

KEY, OTHER_KEY = "sk-security-test-first", "sk-security-test-other"
BATCH = "batch_" + "5" * 24
TENANT_SECRET = "TENANT-B-PROMPT-7c41d09e"  # another key's upload holds it
KEYS_SECRET = "sk-KEYS-FILE-LINE-3e9a51"  # a keys file beside the data directory


class StandInRunner:
    """What the app asks of the runner: the served model's name, and a wake-up."""

    model = served_model = "tiny"

    def wake(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _batch_with_rows(store, owner: str, batch_id: str, rows: pa.Table, state="complete"):
    """A finished batch as the store and its job leave it: the object, and the job's
    output (one part and its record), no engine run."""
    from pipelines.write import part_name

    now = int(time.time())
    store.add_batch(owner, {
        "id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions",
        "status": "completed", "model": "tiny", "created_at": now, "expires_at": now + 60,
        "completed_at": now, "input_file_id": "file-none", "output_file_id": None,
        "error_file_id": None, "errors": None, "metadata": None,
        "request_counts": {"total": rows.num_rows, "completed": rows.num_rows, "failed": 0}})
    output = store.batch_dir(batch_id) / "results.jsonl.overnight" / "output"
    output.mkdir(parents=True)
    pq.write_table(rows, output / part_name(0, rows.num_rows))
    (output.parent / "output.overnight.json").write_text(json.dumps(
        {"state": state, "config": {"model": {"name": "tiny"}}}))


ROWS = pa.table({
    "custom_id": ["r0", "r1", "r2", "q3"], "n": [1, 2, 3, 4],
    "rating": ["4", "good", "5", None], "text": ["a", "b", "c", "d"],
    "error": [None, None, None, None], "error_kind": pa.array([None] * 4, pa.string()),
    "finish_reason": ["stop"] * 4})


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    import uvicorn

    from serve.app import create_app
    from serve.store import Store

    root = tmp_path_factory.mktemp("serve-security")
    (root / "keys.txt").write_text(f"{KEYS_SECRET}\n{KEY}\n")
    store = Store(root / "data")
    (root / "theirs.jsonl").write_text(f"{TENANT_SECRET}\n")
    store.add_file(store.owner_of(OTHER_KEY), root / "theirs.jsonl", "theirs.jsonl", "batch")
    _batch_with_rows(store, store.owner_of(KEY), BATCH, ROWS)
    app = create_app(store, StandInRunner(), owners={store.owner_of(KEY),
                                                     store.owner_of(OTHER_KEY)},
                     max_upload_bytes=1 << 20)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(),
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    secrets = [TENANT_SECRET, KEYS_SECRET, (root / "data" / "key.secret").read_text().strip(),
               "root:x:0:0", str(root)]
    yield {"base": f"http://127.0.0.1:{server.config.port}", "store": store, "root": root,
           "secrets": secrets, "port": server.config.port}
    server.should_exit = True
    thread.join(30)


def _get(api, path: str, **params) -> httpx.Response:
    return httpx.get(api["base"] + path, params=params, timeout=30,
                     headers={"Authorization": f"Bearer {KEY}"})


def _openai_error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}, body
    return body["error"]


def _anthropic_error(response: httpx.Response) -> dict:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


# -- the row filter ----------------------------------------------------------------------------

ATTACKS = [
    # polars' SQL opened each of these while parsing; a column it did not find printed the
    # file's first line ("valid columns: [...]")
    "custom_id IN (SELECT nope FROM read_csv('{root}/keys.txt'))",
    "custom_id IN (SELECT * FROM read_csv('{root}/keys.txt'))",
    "custom_id IN (SELECT nope FROM read_csv('{data}/key.secret'))",
    "custom_id IN (SELECT nope FROM read_csv('{data}/files/*'))",
    "custom_id IN (SELECT nope FROM read_ndjson('{data}/files/*'))",
    "custom_id IN (SELECT nope FROM read_json('{data}/files/*'))",
    "custom_id IN (SELECT nope FROM read_parquet('{data}/batches/**/*.parquet'))",
    "custom_id IN (SELECT nope FROM read_csv('/etc/passwd'))",
    "custom_id IN (SELECT nope FROM read_csv('keys.txt'))",
    "custom_id = (SELECT column_1 FROM read_csv('/etc/passwd'))",
    "custom_id IN (select nope from READ_CSV('{root}/keys.txt'))",
    "read_csv('{root}/keys.txt')",
    "read_csv('{root}/keys.txt') IS NOT NULL",
    "n > 1; SELECT * FROM read_csv('{root}/keys.txt')",
    "n > 1 -- read_csv('{root}/keys.txt')",
    "n > 1 /* read_csv('{root}/keys.txt') */",
    "custom_id IN (\uff33\uff25\uff2c\uff25\uff23\uff34 nope FROM read_csv('{root}/keys.txt'))",
    "custom_id IN (SELECT\u200bnope FROM read_csv('{root}/keys.txt'))",
    "custom_id IN (WITH t AS (SELECT * FROM read_csv('{root}/keys.txt')) SELECT * FROM t)",
    '"custom_id" IN (SELECT "nope" FROM read_csv(\'{root}/keys.txt\'))',
    "nope_{data}",
]


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize("route", ["rows", "prompt"])
def test_a_filter_cannot_read_a_file_and_its_error_shows_none(api, attack, route):
    where = attack.format(root=api["root"], data=api["root"] / "data")
    answer = _get(api, f"/v1/batches/{BATCH}/view/{route}", where=where)
    assert answer.status_code == 400, answer.text
    error = _openai_error(answer)
    assert error["param"] == "where" and error["message"].startswith("where "), error
    shown = error["message"].replace(_quoted(where), "")  # (the caller's filter, quoted)
    for secret in api["secrets"]:
        assert secret not in shown, (secret, error)


@pytest.mark.parametrize("where, expected", [
    ("n >= 2 AND custom_id LIKE 'r%'", ["r1", "r2"]),
    ("TRY_CAST(rating AS INTEGER) >= 4", ["r0", "r2"]),
    ("rating IS NULL OR custom_id IN ('r0')", ["r0", "q3"]),
    ("NOT (n BETWEEN 2 AND 3)", ["r0", "q3"]),
])
def test_the_filters_a_user_writes_still_select_their_rows(api, where, expected):
    answer = _get(api, f"/v1/batches/{BATCH}/view/rows", where=where)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [r[body["columns"].index("custom_id")] for r in body["rows"]] == expected
    assert body["matching"] == len(expected)
    assert _get(api, f"/v1/batches/{BATCH}/view/prompt", where=where).json() == {
        "prompt": None}  # (the job has no template: nothing to render)


@pytest.mark.parametrize("route", ["rows", "prompt"])
def test_a_filter_that_fails_on_the_data_is_a_400_in_our_own_words(api, route):
    """CAST of "good" to an integer fails only when the rows are read: a 400 (it was a 500
    on the prompt), saying why without polars' text, which names the server's paths."""
    where = "CAST(rating AS INTEGER) >= 4"
    answer = _get(api, f"/v1/batches/{BATCH}/view/{route}", where=where)
    assert answer.status_code == 400, answer.text
    error = _openai_error(answer)
    assert error["message"] == (
        f"where {where!r} cannot be evaluated on these rows: a row's value does not convert "
        "or compare as the filter asks (CAST of a word to a number, say: TRY_CAST gives null "
        "instead)") and error["param"] == "where"
    assert str(api["root"]) not in answer.text


def test_a_filter_of_the_wrong_type_names_it_and_an_offset_past_the_end_is_empty(api):
    answer = _get(api, f"/v1/batches/{BATCH}/view/rows", where="custom_id > 1")
    assert answer.status_code == 400
    assert _openai_error(answer)["message"] == (
        "where 'custom_id > 1': > compares text with a number (before character 14)")
    answer = _get(api, f"/v1/batches/{BATCH}/view/rows", where="custm_id = 'r0'")
    assert "did you mean 'custom_id'?" in _openai_error(answer)["message"]
    far = _get(api, f"/v1/batches/{BATCH}/view/rows", offset=10**30)  # it was polars' error
    assert far.status_code == 200 and far.json()["rows"] == []
    assert _get(api, f"/v1/batches/{BATCH}/view/prompt", offset=10**30).json() == {
        "prompt": None}


def test_overnight_view_says_the_same_in_its_own_line(api):
    """``overnight view``'s JobView: the same filter, the same one-line refusals."""
    from pipelines.report.filters import FilterError
    from pipelines.report.view import JobView

    work = api["store"].batch_dir(BATCH) / "results.jsonl.overnight" / "output"
    view = JobView(str(work))
    assert [r[0] for r in view.rows(where="n > 3")["rows"]] == ["q3"]
    for where in (ATTACKS[0].format(root=api["root"]), "CAST(rating AS INTEGER) > 1"):
        with pytest.raises(FilterError) as caught:
            view.rows(where=where)
        assert KEYS_SECRET not in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(FilterError):
        view.prompt(0, where="CAST(rating AS INTEGER) > 1")


# -- bodies: their limit, their shape ----------------------------------------------------------

def _post(api, path: str, body: bytes, key: str = KEY) -> httpx.Response:
    return httpx.post(api["base"] + path, content=body, timeout=60, headers={
        "Authorization": f"Bearer {key}", "x-api-key": key,
        "Content-Type": "application/json"})


@pytest.mark.parametrize("value, kind", [(["file-a"], "an array"), ({"id": "file-a"},
                                                                     "an object"),
                                         (7, "a number"), (True, "a boolean")])
def test_a_field_of_the_wrong_type_is_a_400_not_a_500(api, value, kind):
    """``input_file_id`` as a list or object reached SQLite (a 500, plain text)."""
    answer = _post(api, "/v1/batches", json.dumps({
        "input_file_id": value, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).encode())
    assert answer.status_code == 400, answer.text
    error = _openai_error(answer)
    assert (error["param"], error["code"]) == ("input_file_id", "invalid_type")
    assert error["message"] == (f"Invalid type for 'input_file_id': expected a string, but "
                                f"got {kind} instead.")


@pytest.mark.parametrize("nested", ["[" * 100_000 + "]" * 100_000,
                                    '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_json_nested_100000_deep_is_a_400_on_both_batch_apis(api, nested):
    answer = _post(api, "/v1/batches", nested.encode())
    assert answer.status_code == 400, answer.text
    assert _openai_error(answer)["message"] == \
        "We could not parse the JSON body of your request."
    answer = _post(api, "/v1/messages/batches", ('{"requests": ' + nested + "}").encode())
    assert answer.status_code == 400, answer.text
    assert _anthropic_error(answer)["type"] == "invalid_request_error"


def _chunked(api, path: str, megabytes: int, head: bytes = b"",
             content_type: str = "application/json") -> tuple[int, bytes]:
    """A chunked body of ``megabytes`` MiB sent 1 MiB at a time, stopping once the server
    answers: (MiB sent by then, the answer's first bytes)."""
    with socket.create_connection(("127.0.0.1", api["port"]), timeout=30) as sock:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"x-api-key: {KEY}\r\nContent-Type: {content_type}\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n").encode())
        if head:
            sock.sendall(f"{len(head):x}\r\n".encode() + head + b"\r\n")
        chunk, sent = b"[" * (1 << 20), 0
        try:
            while sent < megabytes:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += 1
                if select.select([sock], [], [], 0)[0]:
                    break
            return sent, sock.recv(4096)
        except OSError:  # it stopped reading and closed: its answer came first
            return sent, sock.recv(4096)


def test_a_chunked_body_past_the_limit_is_refused_before_it_is_read_whole(api, monkeypatch):
    """Every route stops reading at its limit: a JSON body at 1 MiB (POST /v1/batches had
    none), an upload at --max-upload-mb (1 MiB here), a message batch at Anthropic's limit
    (1 MiB here; 256 MB served): 413 in the API's error object, 64 MiB never all sent."""
    from serve import anthropic

    monkeypatch.setattr(anthropic, "MAX_BYTES", 1 << 20)
    sent, answer = _chunked(api, "/v1/batches", 64)
    assert sent < 64 and answer.startswith(b"HTTP/1.1 413"), (sent, answer)
    assert b'"code":"request_too_large"' in answer
    form = (b'--xx\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    sent, answer = _chunked(api, "/v1/files", 64, form, "multipart/form-data; boundary=xx")
    assert sent < 64 and answer.startswith(b"HTTP/1.1 413"), (sent, answer)
    assert b'"param":"file","code":"file_too_large"' in answer
    sent, answer = _chunked(api, "/v1/messages/batches", 64)
    assert sent < 64 and answer.startswith(b"HTTP/1.1 413"), (sent, answer)
    assert b'{"type":"error","error":{"type":"request_too_large"' in answer
    assert not list((api["root"] / "data" / "files").glob(".upload-*"))  # nothing spooled left
    # a Content-Length past the limit: refused before a byte of the body is read
    with socket.create_connection(("127.0.0.1", api["port"]), timeout=30) as sock:
        sock.sendall((f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                      f"\r\nContent-Length: {600 << 20}\r\n\r\n").encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_a_server_bug_is_a_500_in_the_apis_error_object_without_its_text(api, monkeypatch):
    store = api["store"]

    def bug(*args, **kwargs):
        raise RuntimeError(f"a bug at {api['root']}")

    monkeypatch.setattr(store, "list_files", bug)
    monkeypatch.setattr(store, "list_batches", bug)
    answer = _get(api, "/v1/files")
    assert answer.status_code == 500 and _openai_error(answer)["type"] == "server_error"
    answer = httpx.get(api["base"] + "/v1/messages/batches", timeout=30,
                       headers={"x-api-key": KEY})
    assert answer.status_code == 500 and _anthropic_error(answer)["type"] == "api_error"
    for answer in (_get(api, "/v1/files"), answer):
        assert "a bug" not in answer.text and str(api["root"]) not in answer.text


# -- leaks and gauges ---------------------------------------------------------------------------

def test_the_views_kept_are_few_and_none_of_a_batch_whose_data_is_gone(tmp_path):
    """One JobView (and its tokenizer) was kept for every batch ever viewed."""
    import shutil

    from serve.routes_view import VIEWS_KEPT, ViewCache
    from serve.store import Store

    store = Store(tmp_path / "data")
    ids = [f"batch_{i:024d}" for i in range(VIEWS_KEPT + 3)]
    for batch_id in ids:
        _batch_with_rows(store, "owner", batch_id, ROWS)
    views = ViewCache(store)
    for batch_id in ids:
        assert views.get(batch_id) is not None
    assert list(views.views) == ids[-VIEWS_KEPT:]
    assert views.get(ids[-1]) is views.get(ids[-1])  # kept, not made again
    shutil.rmtree(store.batch_dir(ids[-2]))  # deleted, or swept past the retention
    views.get(ids[-1])
    assert ids[-2] not in views.views and views.get(ids[-2]) is None


def test_the_queue_depth_counts_only_the_batches_not_started(tmp_path):
    """Three running at once (--max-running-batches), two queued, one validating: the queue
    is three deep (it said five: every in_progress batch but one)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from serve.metrics import registry_of
    from serve.store import Store

    store = Store(tmp_path / "data")
    for i, (status, started) in enumerate([("in_progress", True)] * 3 + [
            ("in_progress", False)] * 2 + [("validating", False), ("completed", True)]):
        store.add_batch("owner", {"id": f"b{i}", "status": status,
                                  "in_progress_at": 1 if started else None})
    text = generate_latest(registry_of(store)).decode()
    found = {s.name: s.value for family in text_string_to_metric_families(text)
             for s in family.samples if not s.labels}
    assert found["overnight_batch_queue_depth"] == 3
    assert found["overnight_batches_running"] == 3
