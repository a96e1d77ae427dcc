"""``overnight serve``'s API driven by the official ``openai`` client over loopback, on a real
server process (``python -m pipelines.cli serve``, the module's ``server``): keys and what each
sees, a malformed file, a second server refused, the store's owners, list pages, the metrics
and the pages in a browser."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import REPO, table_rows, wait_until
from servers import KEY, OTHER_KEY, error_of, free_port, lines_of, request, request_file, wait


def test_keys_are_required_and_a_key_sees_only_its_own(server, tmp_path):
    first, second = server.client(), server.client(OTHER_KEY)
    uploaded = first.files.create(file=request_file(tmp_path / "mine.jsonl", 2, 4, "k"),
                                  purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch",
                                                                      "mine.jsonl")
    assert uploaded.bytes == (tmp_path / "mine.jsonl").stat().st_size
    assert first.files.content(uploaded.id).content == (tmp_path / "mine.jsonl").read_bytes()
    assert first.files.retrieve(uploaded.id) == uploaded
    # a batch whose file is malformed: it is refused in validation, so no engine starts
    bad = first.files.create(file=("bad.jsonl", b"{not json\n"), purpose="batch")
    batch = first.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")

    for call in (lambda: second.files.retrieve(uploaded.id),
                 lambda: second.files.content(uploaded.id),
                 lambda: second.files.delete(uploaded.id),
                 lambda: second.batches.retrieve(batch.id),
                 lambda: second.batches.cancel(batch.id),
                 lambda: second.batches.create(input_file_id=uploaded.id,
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert error_of(caught.value)["type"] == "invalid_request_error"
    assert [f.id for f in second.files.list()] == []
    assert [b.id for b in second.batches.list()] == []
    assert uploaded.id in [f.id for f in first.files.list()]

    with pytest.raises(openai.AuthenticationError) as caught:
        server.client("sk-not-a-key-at-all").files.list()
    assert error_of(caught.value)["code"] == "invalid_api_key"
    no_header = httpx.get(f"{server.base_url}/batches")
    assert no_header.status_code == 401 and no_header.json()["error"]["type"] == \
        "invalid_request_error"
    assert KEY not in server.log() and OTHER_KEY not in server.log()

    assert first.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        first.files.retrieve(uploaded.id)


def test_a_malformed_file_fails_its_batch_as_the_hosted_api_reports_it(server, tmp_path):
    client = server.client()
    lines = [json.dumps(request("a", "hi", 4)),
             "{this is not json",
             json.dumps(request("a", "the same custom_id", 4)),
             json.dumps(request("b", "wrong url", 4, url="/v1/completions")),
             json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    uploaded = client.files.create(file=tmp_path / "bad.jsonl", purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"run": "bad"})
    assert created.status == "validating" and created.metadata == {"run": "bad"}
    batch = wait(client, created.id)[-1]
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    # a file refused counts no requests, as the hosted API's (completed + failed = total)
    assert batch.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("url_mismatch", 4),
        ("missing_required_parameter", 5)]
    assert batch.errors.data[3].param == "body"

    empty = client.files.create(file=("empty.jsonl", b"\n"), purpose="batch")
    batch = wait(client, client.batches.create(
        input_file_id=empty.id, endpoint="/v1/chat/completions",
        completion_window="24h").id)[-1]
    assert [(e.code, e.line) for e in batch.errors.data] == [("empty_file", None)]

    # malformed uploads and requests: 4xx with OpenAI's error object
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("notes.txt", b"hello"), purpose="batch")
    assert error_of(caught.value)["message"] == "Invalid file format for Batch API. Must be .jsonl"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert error_of(caught.value)["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.jsonl", b"x" * (9 << 20)), purpose="batch")
    assert caught.value.status_code == 413 and error_of(caught.value)["param"] == "file"
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations",
                              completion_window="24h")
    assert error_of(caught.value)["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert error_of(caught.value)["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.cancel(batch.id)  # already failed
    assert "failed" in error_of(caught.value)["message"]


def test_a_second_server_on_the_same_data_dir_is_refused_in_one_line(server):
    """The data directory is locked for the server's life: a second ``overnight serve`` on it
    (which once took the first one's running batch for a stale leftover and killed it)
    stops before it touches anything."""
    config = (server.root / "data" / "batch-config.yaml").read_bytes()
    second = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "serve", "--config", str(server.root / "job.yaml"),
         "--data-dir", str(server.root / "data"), "--port", str(free_port()),
         "--api-keys-file", str(server.root / "keys.txt")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2
    assert second.stderr.strip() == (
        f"overnight: error: serve: --data-dir {server.root / 'data'} is in use by another "
        f"overnight serve (pid {server.proc.pid}); stop it, or give another --data-dir")
    assert (server.root / "data" / "batch-config.yaml").read_bytes() == config
    server.client().files.list()  # the first one is still there


def test_a_batch_never_leaves_a_final_status_and_a_failing_step_keeps_a_cancel(tmp_path):
    """The store refuses to move a batch out of completed, failed, expired or cancelled (a
    failed batch once went on to completed, its errors kept); a step that raises on a
    cancelling batch ends it cancelled, not failed."""
    from serve.runner import Runner
    from serve.store import TERMINAL, Store

    store = Store(tmp_path / "data")
    for status in TERMINAL:
        store.add_batch("owner", {"id": status, "status": status})
        assert store.update_batch(status, status="completed" if status != "completed"
                                  else "failed", errors=None) is None
        assert store.update_batch(status, status="in_progress") is None
        assert store.get_batch(None, status)["status"] == status
    store.add_batch("owner", {"id": "c", "status": "cancelling"})
    runner = Runner(store, model="m", config=None, overrides=[], served_model="m")

    def server_bug():
        raise RuntimeError("a bug")

    runner._guard("c", server_bug)
    assert store.get_batch(None, "c")["status"] == "cancelled"
    runner._guard("completed", server_bug)
    assert store.get_batch(None, "completed")["status"] == "completed"


def test_the_data_is_its_users_alone_and_keys_are_kept_as_hmacs(server, tmp_path):
    """Every file and folder the server makes is 0600/0700 (they were 0644/0755: any local
    user read every key's prompts and results), and a key is recorded as an HMAC under the
    store's own secret, not as its bare SHA-256."""
    import hashlib
    import sqlite3
    import stat

    uploaded = server.client().files.create(file=("p.jsonl", b"{}\n"), purpose="batch")
    data = server.root / "data"
    assert (data / "files" / uploaded.id).is_file()
    for path in [data, *data.rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    with sqlite3.connect(data / "state.sqlite3") as db:
        owners = {row[0] for row in db.execute("SELECT owner FROM files")}
    assert owners and hashlib.sha256(KEY.encode()).hexdigest() not in owners


def test_a_store_with_sha256_owners_is_moved_to_hmacs_and_old_batches_expire(tmp_path):
    """A data directory from before (owners = SHA-256 of the key) keeps its objects: each
    is moved to its key's HMAC when the key is seen. With a retention, a finished batch's
    folder and its output file go once it ended longer ago than that; newer ones stay."""
    import hashlib

    from serve.store import Store

    store = Store(tmp_path / "data")
    (tmp_path / "f.jsonl").write_text("{}\n")
    old_owner = hashlib.sha256(KEY.encode()).hexdigest()
    kept = store.add_file(old_owner, tmp_path / "f.jsonl", "f.jsonl", "batch")
    assert store.get_file(store.owner_of(KEY), kept["id"]) is None
    store.adopt_keys([KEY])
    assert store.get_file(store.owner_of(KEY), kept["id"]) == kept

    owner, now = store.owner_of(KEY), time.time()
    for batch_id, ended in (("batch_old", now - 3 * 86400), ("batch_new", now - 3600)):
        folder = store.batch_dir(batch_id)
        folder.mkdir()
        (folder / "results.jsonl").write_text('{"custom_id": "a"}\n')
        out = store.add_file(owner, folder / "results.jsonl", "r.jsonl", "batch_output",
                             file_id=f"file-{batch_id}", link=True)
        store.add_batch(owner, {"id": batch_id, "status": "completed", "created_at": ended,
                                "completed_at": ended, "input_file_id": kept["id"],
                                "output_file_id": out["id"], "error_file_id": None})
    assert store.sweep(retention=2 * 86400, now=now) == ["batch_old"]
    assert not store.batch_dir("batch_old").exists()
    assert store.get_file(owner, "file-batch_old") is None
    assert not store.file_path("file-batch_old").exists()
    assert store.get_file(owner, "file-batch_new") and store.batch_dir("batch_new").is_dir()
    assert store.get_batch(owner, "batch_old")["status"] == "completed"  # the object stays


def test_batches_list_in_cursor_pages(server):
    client = server.client()
    created = [client.batches.create(
        input_file_id=client.files.create(file=(f"e{i}.jsonl", b"\n"), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h").id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == created[0]
    # the client's own auto-pagination walks every page, newest first, each batch once
    every = [b.id for b in client.batches.list(limit=2)]
    assert every[:3] == created[::-1] and len(every) == len(set(every))


def _metrics(server, key=KEY) -> dict:
    """The server's /metrics, parsed: {(name, labels as a tuple of pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10,
                     headers={"Authorization": f"Bearer {key}"})
    text.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.text) for s in family.samples}


XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


@pytest.fixture(scope="module")
def ui_batches(server, tmp_path_factory):
    """Two finished batches, one a key's (three requests, one holding markup; markup in its
    metadata), one of the other key (a file without a request): counted by the metrics, shown
    on the pages. Returns (mine, theirs, lines, mine finished)."""
    client, other = server.client(), server.client(OTHER_KEY)
    lines = [request("ui-0", "Say hello.", 4), request("ui-1", XSS, 4),
             request("ui-2", "Count to three.", 4)]
    path = tmp_path_factory.mktemp("ui") / "ui.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    mine = client.batches.create(
        input_file_id=client.files.create(file=path, purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h", metadata={"note": XSS})
    theirs = other.batches.create(
        input_file_id=other.files.create(file=("t.jsonl", b"\n"), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h")
    done = wait(client, mine.id)[-1]
    assert done.status == "completed", (done.errors, server.log())
    wait(other, theirs.id)
    return mine, theirs, lines, done


def test_metrics_count_batches_by_status_and_their_requests(server, ui_batches):
    numbers = _metrics(server)
    # every key's batches, as the API lists them to their owners
    listed = [b for key in (KEY, OTHER_KEY) for b in server.client(key).batches.list(limit=100)]
    for status in ("validating", "in_progress", "completed", "failed", "cancelled"):
        assert numbers[("overnight_batches", (("status", status),))] == \
            sum(b.status == status for b in listed), status
    assert numbers[("overnight_batch_requests_total", (("state", "completed"),))] == sum(
        (b.request_counts.completed if b.request_counts else 0) for b in listed) >= 3
    assert ("overnight_batch_queue_depth", ()) in numbers
    # behind the same keys as the API
    assert httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).status_code == 401


def test_the_pages_show_a_keys_own_batches_and_each_ones_rows(server, browser, ui_batches,
                                                               tmp_path):
    """/ui: the batches of the key given on the page, none of another key's; a batch's page:
    its job as `overnight view` shows it, its data behind the key. A value holding markup
    (a request's text, a batch's metadata) shows as its characters and never runs."""
    from selenium.webdriver.common.by import By

    client = server.client()
    mine, theirs, lines, done = ui_batches
    base = f"http://127.0.0.1:{server.port}"
    own, foreign = ({"Authorization": f"Bearer {key}"} for key in (KEY, OTHER_KEY))

    # the pages hold no data and need no key; the data they show needs the batch's own key
    page = httpx.get(f"{base}/ui", timeout=10)
    assert page.status_code == 200 and mine.id not in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "http://" not in page.text and "https://" not in page.text
    status_url = f"{base}/v1/batches/{mine.id}/view/status"
    assert httpx.get(status_url, timeout=10).status_code == 401
    assert httpx.get(status_url, headers=foreign, timeout=10).status_code == 404
    status = httpx.get(status_url, headers=own, timeout=10).json()
    assert (status["state"], status["rows_done"], status["rows_total"]) == ("complete", 3, 3)
    assert status["batch"]["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert status["output"] == mine.id and str(server.root) not in json.dumps(status)
    rows = httpx.get(f"{base}/v1/batches/{mine.id}/view/rows", headers=own, timeout=10).json()
    assert [r[rows["columns"].index("custom_id")] for r in rows["rows"]] == \
        ["ui-0", "ui-1", "ui-2"]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
             for line in lines_of(client, done.output_file_id)}
    assert [r[rows["columns"].index("text")] for r in rows["rows"]] == \
        [texts[f"ui-{i}"] for i in range(3)]
    # a batch whose job never started (its file holds no request) says so in one line
    none = httpx.get(f"{base}/v1/batches/{theirs.id}/view/status", headers=foreign, timeout=10)
    assert none.status_code == 404 and "has no rows yet" in none.json()["error"]["message"]

    # in a browser: the key's batches, as the API lists them to it, and none of the other's
    browser.get(f"{base}/ui")
    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    listed = [b.id for b in client.batches.list(limit=100).data]
    cells = wait_until(lambda: [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in browser.find_elements(By.CSS_SELECTOR, "#batches tbody tr")] or None)
    assert [c[0] for c in cells] == listed and theirs.id not in listed
    row = next(c for c in cells if c[0] == mine.id)
    assert row[1:7] == ["completed", "/v1/chat/completions", row[3], "3", "3", "0"]
    assert json.loads(row[7]) == {"note": XSS}  # the metadata as its characters
    assert browser.execute_script("return window.__xss") is None
    browser.save_screenshot(str(tmp_path / "serve-batches.png"))
    browser.find_element(By.LINK_TEXT, mine.id).click()
    # the batch's page: its rows, its counts, a row's prompt through the chat template
    wait_until(lambda: browser.find_element(By.ID, "rows").text == "3 / 3")
    shown = wait_until(lambda: len(table_rows(browser)) == 3 and table_rows(browser))
    heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#table thead th")]
    assert [r[heads.index("custom_id")] for r in shown] == ["ui-0", "ui-1", "ui-2"]
    assert "<script>window.__xss = 1</script>" in shown[1][heads.index("prompt")]  # (JSON)
    assert browser.execute_script("return window.__xss") is None
    assert browser.find_element(By.ID, "output").text == mine.id
    browser.find_elements(By.CSS_SELECTOR, "#table tbody tr")[0].click()
    assert "Say hello." in wait_until(lambda: browser.find_element(By.ID, "prompt").text)
    browser.save_screenshot(str(tmp_path / "serve-batch.png"))
    assert not browser.find_element(By.ID, "back").get_attribute("hidden")
