"""``overnight serve`` driven by the official ``openai`` client over loopback: a real server
process (``python -m pipelines.cli serve``), real batches through ``overnight batch`` children on
the tiny model.

One server is shared by the module; the checks that start no engine run first, then one
batch each for the round trip (with its counts watched while it runs), the cancel, and the
restart after ``kill -9`` (which kills and restarts that same server).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import KV_CACHE, REPO, table_rows, wait_until

KEY, OTHER_KEY = "sk-overnight-test-first", "sk-overnight-test-second"
TERMINAL = ("completed", "failed", "cancelled", "expired")
FAST = 20_000


def request(custom_id: str, content: str, max_tokens: int, url="/v1/chat/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "gpt-4o-mini", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def request_file(path: Path, count: int, max_tokens: int, prefix: str) -> Path:
    path.write_text("".join(json.dumps(request(f"{prefix}-{i}", f"Say something about {i}.",
                                               max_tokens)) + "\n" for i in range(count)))
    return path


def long_file(path: Path, prefix: str, tail: int, tail_tokens: int) -> Path:
    """FAST requests of one token, then ``tail`` of ``tail_tokens``. A batch file's job commits
    its parts a read unit (16,384 rows or more, to the end of a 10,000-row group) at a time, so
    the counts move, and a batch can be stopped, between the fast head and the slow tail."""
    path.write_text("".join(
        json.dumps(request(f"{prefix}-{i}", str(i), 1 if i < FAST else tail_tokens)) + "\n"
        for i in range(FAST + tail)))
    return path


class Server:
    """``overnight serve`` as a child process, on a free port; started again on the same
    data directory and port after a kill."""

    def __init__(self, root: Path, tiny_model: str, *args: str):
        self.root, self.port, self.args = root, _free_port(), list(args)
        (root / "keys.txt").write_text(f"# test keys\n{KEY}\n{OTHER_KEY}\n")
        # what a batch needs on this machine (see tests/test_batch.py); blocks of 512 rows
        (root / "job.yaml").write_text(json.dumps({
            "model": {"name": tiny_model, "dtype": "float32", "max_model_len": 512},
            "engine": {"kv_cache_memory_bytes": KV_CACHE}, "resources": {"batch_size": 512}}))
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "serve", "--config",
             str(self.root / "job.yaml"), "--data-dir", str(self.root / "data"), "--port",
             str(self.port), "--api-keys-file", str(self.root / "keys.txt"),
             "--max-upload-mb", "8", *self.args], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # the resident engine loads first
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                httpx.get(f"{self.base_url}/files", timeout=2,
                          headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError(f"the server did not answer in 300 s\n{self.log()}")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no clean-up of any kind
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-3000:]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve"), tiny_model, "--max-running-batches", "2")
    server.start()
    yield server
    server.stop()


def wait(client: openai.OpenAI, batch_id: str, until=TERMINAL, timeout: float = 300):
    """Poll a batch until its status is one of ``until``; returns every object seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(client.batches.retrieve(batch_id))
        if seen[-1].status in until:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {seen[-1].status} after {timeout} s")


def some_done(client: openai.OpenAI, batch_id: str, timeout: float = 300):
    """Poll a batch until some of its requests are done (it must still be running)."""
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).request_counts.completed == 0:
        assert batch.status in ("validating", "in_progress"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    # JSON Lines end at "\n" only: a generated text may hold U+2028 or U+0085, which
    # str.splitlines() would also split at
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n")
            if line]


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


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
         "--data-dir", str(server.root / "data"), "--port", str(_free_port()),
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


def test_metrics_count_batches_by_status_and_their_requests(server, tmp_path):
    client = server.client()
    done = client.batches.create(
        input_file_id=client.files.create(file=request_file(tmp_path / "m.jsonl", 3, 2, "m"),
                                          purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h")
    assert wait(client, done.id)[-1].status == "completed"
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


XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


def test_the_pages_show_a_keys_own_batches_and_each_ones_rows(server, browser, tmp_path):
    """/ui: the batches of the key given on the page, none of another key's; a batch's page:
    its job as `overnight view` shows it, its data behind the key. A value holding markup
    (a request's text, a batch's metadata) shows as its characters and never runs."""
    from selenium.webdriver.common.by import By

    client, other = server.client(), server.client(OTHER_KEY)
    lines = [request("ui-0", "Say hello.", 4), request("ui-1", XSS, 4),
             request("ui-2", "Count to three.", 4)]
    path = tmp_path / "ui.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    mine = client.batches.create(
        input_file_id=client.files.create(file=path, purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h", metadata={"note": XSS})
    theirs = other.batches.create(
        input_file_id=other.files.create(file=("t.jsonl", b"\n"), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h")
    done = wait(client, mine.id)[-1]
    assert done.status == "completed", (done.errors, server.log())
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


def _content(line: dict):
    body = line["response"]["body"]
    return ([c["message"]["content"] for c in body["choices"]],
            [c["finish_reason"] for c in body["choices"]], body["usage"])


def test_round_trip_equals_overnight_batch(server, tiny_model, tmp_path):
    client = server.client()
    requests = request_file(tmp_path / "requests.jsonl", 160, 48, "rt")
    uploaded = client.files.create(file=requests, purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    seen = wait(client, created.id)
    batch = seen[-1]
    assert batch.status == "completed", (batch.errors, server.log())
    assert batch.request_counts.model_dump() == {"total": 160, "completed": 160, "failed": 0}
    assert batch.error_file_id is None
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    statuses = [b.status for b in seen]
    assert statuses[0] in ("validating", "in_progress") and "in_progress" in statuses

    results = lines_of(client, batch.output_file_id)
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    reference = tmp_path / "reference.jsonl"
    subprocess.run([sys.executable, "-m", "pipelines.cli", "batch", str(requests),
                    "-o", str(reference), "--model", tiny_model, "--config",
                    str(server.root / "job.yaml"), "--quiet"], cwd=REPO, check=True,
                   capture_output=True)
    expected = [json.loads(line) for line in reference.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"rt-{i}" for i in range(160)]
    assert {r["custom_id"]: _content(r) for r in results} == \
        {r["custom_id"]: _content(r) for r in expected}
    # the served name (the model directory's), never the server's filesystem path
    assert batch.model == Path(tiny_model).name
    assert {r["response"]["body"]["model"] for r in results} == {Path(tiny_model).name}

    # a file's deletion takes every copy of its data the batch made: the output file its
    # link in the batch's folder and the job's parts; the input file the batch's copy
    folder = server.root / "data" / "batches" / batch.id
    assert (folder / "results.jsonl").exists() and (folder / "input.jsonl").exists()
    assert client.files.delete(batch.output_file_id).deleted
    assert not (folder / "results.jsonl").exists()
    assert not (folder / "results.jsonl.overnight").exists()
    assert client.files.delete(uploaded.id).deleted
    assert not (folder / "input.jsonl").exists()
    assert not any(server.root.joinpath("data", "files").glob(f"{uploaded.id}*"))


def test_cancel_mid_run_keeps_the_results_done(server, tmp_path):
    client = server.client()
    uploaded = client.files.create(file=long_file(tmp_path / "long.jsonl", "c", 10_000, 32),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    running = some_done(client, batch.id)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    final = wait(client, batch.id)[-1]
    assert final.status == "cancelled" and final.cancelled_at, final
    done = final.request_counts.completed
    assert 0 < running.request_counts.completed <= done < FAST + 10_000
    assert final.request_counts.total == FAST + 10_000 == done + final.request_counts.failed
    results = lines_of(client, final.output_file_id)
    ids = [r["custom_id"] for r in results]
    assert len(ids) == done == len(set(ids)) and set(ids) <= {f"c-{i}" for i in range(FAST + 10_000)}
    assert all(r["response"]["status_code"] == 200 for r in results)
    # the requests not reached: the error file's, as the hosted API lists them (issue #56 A5)
    errors = lines_of(client, final.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted([*ids, *(e["custom_id"] for e in errors)]) == sorted(
        f"c-{i}" for i in range(FAST + 10_000))


def _message_requests(count: int, prefix: str) -> list[dict]:
    """Anthropic twins of request_file's requests (greedy, 4 + i % 5 tokens each)."""
    return [{"custom_id": f"{prefix}-{i}", "params": {
        "model": "claude-sonnet-4-5", "max_tokens": 4 + i % 5, "temperature": 0,
        "messages": [{"role": "user", "content": f"Say something about {i}."}]}}
        for i in range(count)]


def test_anthropics_client_runs_message_batches_equal_to_the_openai_results(server, tmp_path):
    """The official anthropic client, unchanged but for base_url and the key: create,
    retrieve, list (paged), results, cancel, delete; greedy results equal the same requests
    as an OpenAI batch, request for request; a parameter overnight cannot honour is that
    request's errored result; another key sees nothing; Anthropic's errors."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY,
                                 max_retries=0)
    requests = _message_requests(12, "m")
    tools = {"custom_id": "tools", "params": {**requests[0]["params"],
                                              "tools": [{"name": "x", "input_schema": {}}]}}
    created = client.messages.batches.create(requests=[*requests, tools])
    assert created.type == "message_batch" and created.processing_status == "in_progress"
    assert created.id.startswith("msgbatch_") and created.results_url is None
    assert created.request_counts.processing == 13

    openai_client = server.client()
    twins = tmp_path / "twins.jsonl"
    twins.write_text("".join(json.dumps(request(r["custom_id"], r["params"]["messages"][0][
        "content"], r["params"]["max_tokens"])) + "\n" for r in requests))
    uploaded = openai_client.files.create(file=twins, purpose="batch")
    openai_batch = openai_client.batches.create(input_file_id=uploaded.id, completion_window=
                                                "24h", endpoint="/v1/chat/completions")

    deadline = time.monotonic() + 300
    while (batch := client.messages.batches.retrieve(created.id)).processing_status != "ended":
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.5)
    assert batch.ended_at is not None and batch.results_url.endswith(f"/{created.id}/results")
    assert batch.request_counts.model_dump() == {"processing": 0, "succeeded": 12,
                                                 "errored": 1, "canceled": 0, "expired": 0}
    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    assert sorted(results) == sorted([*(r["custom_id"] for r in requests), "tools"])
    assert results["tools"].type == "errored"
    assert "params.tools" in results["tools"].error.error.message
    expected = {line["custom_id"]: line["response"]["body"] for line in lines_of(
        openai_client, wait(openai_client, openai_batch.id)[-1].output_file_id)}
    for r in requests:
        message, chat = results[r["custom_id"]].message, expected[r["custom_id"]]
        assert results[r["custom_id"]].type == "succeeded"
        assert message.content[0].text == chat["choices"][0]["message"]["content"]
        assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
        assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
            chat["choices"][0]["finish_reason"]]

    # cancelled at once: every request has one result, those not reached canceled
    second = client.messages.batches.create(requests=_message_requests(300, "c"))
    assert client.messages.batches.cancel(second.id).processing_status in ("canceling",
                                                                           "ended")
    deadline = time.monotonic() + 120
    while (ended := client.messages.batches.retrieve(second.id)).processing_status != "ended":
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.3)
    kinds = collections.Counter(r.result.type for r in client.messages.batches.results(
        second.id))
    assert sum(kinds.values()) == 300 and set(kinds) <= {"succeeded", "canceled"}, kinds
    assert ended.request_counts.canceled == kinds["canceled"] > 0

    pages = list(client.messages.batches.list(limit=1))  # paged one at a time, newest first
    assert [b.id for b in pages][:2] == [second.id, created.id]
    assert client.messages.batches.cancel(created.id).processing_status == "ended"
    with pytest.raises(anthropic.BadRequestError):  # a repeated custom_id: refused whole
        client.messages.batches.create(requests=_message_requests(2, "d") * 2)
    other = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}",
                                api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.retrieve(created.id)
    assert list(other.messages.batches.list()) == []
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="sk-nope-nope",
                            max_retries=0).messages.batches.list()
    with pytest.raises(openai.NotFoundError):  # not an OpenAI batch
        openai_client.batches.retrieve(created.id)
    assert client.messages.batches.delete(created.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(created.id)


def test_a_small_batch_behind_a_large_one_finishes_first_on_the_shared_engine(server,
                                                                               tmp_path):
    """The running batches share the resident engine: 20 requests submitted after 20,000
    complete while the large batch is still running (which is then cancelled, its done part
    delivered)."""
    client = server.client()
    large = client.files.create(file=request_file(tmp_path / "large.jsonl", 20_000, 4, "L"),
                                purpose="batch")
    small = client.files.create(file=request_file(tmp_path / "small.jsonl", 20, 4, "s"),
                                purpose="batch")
    first = client.batches.create(input_file_id=large.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait(client, first.id, until=("in_progress",))
    second = client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    done = wait(client, second.id)[-1]
    assert done.status == "completed", (done.errors, server.log())
    assert done.request_counts.model_dump() == {"total": 20, "completed": 20, "failed": 0}
    still = client.batches.retrieve(first.id)
    assert still.status == "in_progress" and still.in_progress_at <= done.in_progress_at, still
    assert still.request_counts.completed < 20_000
    assert [r["custom_id"] for r in lines_of(client, done.output_file_id)] == \
        [f"s-{i}" for i in range(20)]
    client.batches.cancel(first.id)
    assert wait(client, first.id)[-1].status == "cancelled"


def test_killed_with_two_running_and_one_queued_all_complete_each_request_once(server,
                                                                               tmp_path):
    """kill -9 of the server (two batches may run at once here): two running, one queued.
    Started again, the three complete, every request answered exactly once; the counts of
    the one with committed parts go on from them, never back."""
    client = server.client()
    files = {name: client.files.create(file=path, purpose="batch").id for name, path in (
        ("long", request_file(tmp_path / "r.jsonl", 2_000, 4, "r")),
        ("short", request_file(tmp_path / "s.jsonl", 1_000, 4, "t")),
        ("queued", request_file(tmp_path / "q.jsonl", 50, 4, "q")))}
    batches = {name: client.batches.create(input_file_id=file_id,
                                           endpoint="/v1/chat/completions",
                                           completion_window="24h")
               for name, file_id in files.items()}
    before = some_done(client, batches["long"].id)  # request_counts moved while it runs
    assert before.status == "in_progress" and 0 < before.request_counts.completed < 2_000
    running = client.batches.retrieve(batches["short"].id)
    queued = client.batches.retrieve(batches["queued"].id)
    assert running.status == "in_progress" and running.in_progress_at is not None, running
    assert queued.status == "in_progress" and queued.in_progress_at is None, queued
    server.kill()
    server.start()
    client = server.client()
    expected = {"long": [f"r-{i}" for i in range(2_000)],
                "short": [f"t-{i}" for i in range(1_000)],
                "queued": [f"q-{i}" for i in range(50)]}
    for name, batch in batches.items():
        seen = wait(client, batch.id, timeout=600)
        final = seen[-1]
        assert final.status == "completed", (name, final.errors, server.log())
        total = len(expected[name])
        assert final.request_counts.model_dump() == {"total": total, "completed": total,
                                                     "failed": 0}, name
        ids = collections.Counter(r["custom_id"] for r in lines_of(client, final.output_file_id))
        assert ids == collections.Counter(expected[name]), name
        if name == "long":  # the counts went on from the parts committed before the kill
            completed = [before.request_counts.completed] + [
                b.request_counts.completed for b in seen]
            assert completed == sorted(completed)


def _child_of(server: Server, batch_id: str) -> int | None:
    """The pid of a batch's ``overnight batch`` child, as the server records it."""
    import sqlite3

    with sqlite3.connect(f"file:{server.root / 'data' / 'state.sqlite3'}?mode=ro",
                         uri=True) as db:
        return db.execute("SELECT child_pid FROM batches WHERE id=?", (batch_id,)).fetchone()[0]


def _new_child(server: Server, batch_id: str, old: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (pid := _child_of(server, batch_id)) in (None, old):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    return pid


def test_a_batch_whose_job_dies_runs_again_from_its_parts_then_fails_with_them(server,
                                                                                tmp_path):
    """The OOM killer's kill -9 of a batch's child: its Ray processes go with it, and the
    batch runs again from its committed parts (the counts never go back), up to
    ATTEMPTS runs; past that it fails, with the cause, and the results done are delivered
    (they were thrown away: failed, no output file)."""
    from serve.processes import group as _group
    from serve.runner import ATTEMPTS

    client = server.client()
    uploaded = client.files.create(file=long_file(tmp_path / "d.jsonl", "d", 2_000, 4),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    before = some_done(client, batch.id)
    child = _child_of(server, batch.id)
    assert any(b"ray::" in c or b"raylet" in c for c in _group(child))  # the job's Ray
    for run in range(1, ATTEMPTS + 1):
        os.kill(child, signal.SIGKILL)
        if run == ATTEMPTS:
            break
        killed, child = child, _new_child(server, batch.id, child)
        assert _group(killed) == []  # nothing it started outlives it
        again = client.batches.retrieve(batch.id)
        assert again.status == "in_progress" and again.errors is None, again
        assert again.request_counts.completed >= before.request_counts.completed
    final = wait(client, batch.id)[-1]
    assert final.status == "failed" and final.failed_at, (final, server.log())
    [error] = final.errors.data
    assert error.code == "batch_failed" and f"died {ATTEMPTS} times" in error.message \
        and "SIGKILL" in error.message, error
    results = lines_of(client, final.output_file_id)
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids)) == final.request_counts.completed
    assert final.request_counts.completed >= before.request_counts.completed > 0
    assert all(r["response"]["status_code"] == 200 for r in results)
    unreached = lines_of(client, final.error_file_id)  # issue #56 A5: each an error line
    assert {e["error"]["code"] for e in unreached} == {"batch_failed"}
    assert len(unreached) == final.request_counts.failed \
        == final.request_counts.total - len(ids)


WINDOW_S = 75  # long enough for its first parts here (a block of 512 rows), far shorter than its tail


def test_a_batch_past_its_window_expires_with_its_done_part_and_a_queued_one_never_starts(
        tiny_model, tmp_path):
    """A server whose batches have WINDOW_S seconds (--completion-window-s): a long batch
    runs, commits its fast head, and expires with those results delivered; a batch queued
    behind it is in_progress without in_progress_at (not started) until it expires too."""
    server = Server(tmp_path, tiny_model, "--completion-window-s", str(WINDOW_S),
                    "--max-running-batches", "1")
    server.start()
    try:
        client = server.client()
        long = client.files.create(file=long_file(tmp_path / "long.jsonl", "x", 20_000, 400),
                                   purpose="batch")
        short = client.files.create(file=request_file(tmp_path / "short.jsonl", 3, 4, "q"),
                                    purpose="batch")
        first = client.batches.create(input_file_id=long.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        queued = client.batches.create(input_file_id=short.id,
                                       endpoint="/v1/chat/completions", completion_window="24h")
        assert first.expires_at - first.created_at == WINDOW_S
        running = some_done(client, first.id, timeout=WINDOW_S)
        assert running.in_progress_at is not None
        waiting = client.batches.retrieve(queued.id)
        assert waiting.status == "in_progress" and waiting.in_progress_at is None, waiting
        final = wait(client, first.id, timeout=WINDOW_S + 120)[-1]
        assert final.status == "expired" and final.expired_at >= final.expires_at, final
        done = final.request_counts.completed
        assert 0 < running.request_counts.completed <= done < FAST + 20_000
        ids = [r["custom_id"] for r in lines_of(client, final.output_file_id)]
        assert len(ids) == done == len(set(ids))
        other = wait(client, queued.id, timeout=60)[-1]
        assert other.status == "expired" and other.in_progress_at is None, other
        assert other.output_file_id is None and other.request_counts.completed == 0
        # its requests are each an error line (issue #56 A5), as those the first did not reach
        assert other.request_counts.failed == other.request_counts.total == 3
        assert [(e["custom_id"], e["error"]["code"]) for e in lines_of(
            client, other.error_file_id)] == [(f"q-{i}", "batch_expired") for i in range(3)]
        assert final.request_counts.failed == final.request_counts.total - done
    finally:
        server.stop()


def _session(sid: int) -> list[bytes]:
    """The command lines of the live processes of a session (a batch's child starts one;
    Ray's workers take process groups of their own inside it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append((stat.parent / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_sigterm_of_the_server_leaves_nothing_of_a_batchs_own_child(server, tmp_path):
    """SIGTERM of the server while a batch runs in a child of its own (an embeddings batch
    loads its own engine, as every batch does with --engine per-batch): the child's whole
    session goes with the server, its Ray agents too (a child killed by PDEATHSIG alone
    left ray::DashboardAgent and ray::RuntimeEnvAgent running), and the stop is not counted
    as a death of the batch. Last in the module: it stops the module's server."""
    from serve.child import DEATHS

    client = server.client()
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "m", "input": f"a steel lamp, number {i}"}} for i in range(2000)]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = client.batches.create(
        input_file_id=client.files.create(file=tmp_path / "e.jsonl", purpose="batch").id,
        endpoint="/v1/embeddings", completion_window="24h")
    child = _new_child(server, batch.id, None)
    try:
        wait_until(lambda: sum(c.startswith(b"ray::") for c in _session(child)) >= 2,
                   timeout=120)  # its Ray's agents are up
        server.proc.terminate()
        assert server.proc.wait(90) is not None
        time.sleep(2)  # (what outlives the server would still be there)
        assert _session(child) == [], _session(child)
        assert not (server.root / "data" / "batches" / batch.id / DEATHS).exists()
    finally:
        for pid in [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
                    if _in_session(p, child)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _in_session(stat: Path, sid: int) -> bool:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[3]) == sid
    except (OSError, IndexError, ValueError):
        return False
