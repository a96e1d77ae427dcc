"""``overnight serve``'s runner, by its functions (no engine, no HTTP): where a stopped batch's
requests go, and when an embedding batch may load an engine of its own.

Issue #56 A5: an OpenAI batch that expired, was cancelled or was given up wrote the requests
it had not reached nowhere (``{total: 3, completed: 0, failed: 0}`` and no files). As the
hosted API does, they are lines of its error file (``batch_expired``, ``batch_cancelled``,
``batch_failed``), and ``completed + failed = total`` whatever the batch's end; a message
batch's are ``canceled``/``expired``/``errored`` results. A7: an embedding batch never starts a
second engine on a GPU the resident one fills (``engine_turn``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.batchfile.prepare import prepare
from pipelines.write.parts import part_name
from serve.child import DEATHS
from serve.runner import (ATTEMPTS, INPUT, LOAD, RELEASE, RESULTS, START, WAIT,
                          Runner, engine_turn)
from serve.store import Store


def _line(custom_id: str, content: str = "hi") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}],
                                "max_tokens": 4}})


def _message(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "params": {
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}})


def _batch(store: Store, batch_id: str, lines: list[str], *, status: str = "in_progress",
           api: str | None = None, total: int | None = None) -> Path:
    """A batch in the store, its input staged; ``total``: its validated count (None: its
    lines)."""
    count = sum(1 for line in lines if line.strip())
    store.add_batch("owner", {
        "id": batch_id, "object": "batch", "status": status, "endpoint": "/v1/chat/completions",
        "created_at": 1, "expires_at": 2, "errors": None, "output_file_id": None,
        "error_file_id": None, **({"api": api} if api else {}),
        "request_counts": {"total": count if total is None else total, "completed": 0,
                           "failed": 0}})
    folder = store.batch_dir(batch_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INPUT).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _started(folder: Path, done: int, fmt: str = "openai") -> None:
    """The batch's job as a stopped run leaves it: the prepared table and its first ``done``
    requests answered in a committed part."""
    work = folder / f"{RESULTS}.overnight"
    work.mkdir()
    prepared = prepare(folder / INPUT, work, 16, 512, fmt=fmt)
    rows = pq.read_table(prepared.table).slice(0, done).to_pylist()
    for row in rows:
        row.update(text="ok", finish_reason="length", prompt_tokens=3, completion_tokens=4,
                   error=None, error_kind=None)
    (work / "output.partial").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), work / "output.partial" / part_name(0, done))


def _files(folder: Path) -> tuple[list[dict], list[dict]]:
    read = [[json.loads(line) for line in (folder / name).read_text().splitlines()]
            if (folder / name).exists() else [] for name in (RESULTS, "errors.jsonl")]
    return read[0], read[1]


@pytest.fixture
def runner(tmp_path):
    store = Store(tmp_path / "data")
    return Runner(store, model="m", config=None, overrides=[], served_model="m")


@pytest.mark.parametrize("end,status,code", [
    ("expire", "expired", "batch_expired"), ("cancel", "cancelled", "batch_cancelled"),
    ("give up", "failed", "batch_failed")])
def test_the_requests_a_stopped_batch_did_not_reach_are_its_error_lines(runner, end, status,
                                                                        code):
    """Three lines, one refused (bad body), one done: the done one is a result, the refused
    one its error, the one not reached an error line with the hosted API's code; counts
    add up to the total."""
    lines = [_line("a"), _line("b", content=5), _line("c")]
    folder = _batch(runner.store, "b1", lines, status="cancelling" if end == "cancel"
                    else "in_progress")
    _started(folder, done=1)
    {"expire": runner._expire, "cancel": runner._finish_cancel,
     "give up": lambda b: runner._give_up(b, [{"cause": "was killed by SIGKILL"}] * ATTEMPTS)
     }[end]("b1")
    batch = runner.store.get_batch(None, "b1")
    assert batch["status"] == status
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    results, errors = _files(folder)
    assert [r["custom_id"] for r in results] == ["a"]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("b", "invalid_body", 2), ("c", code, 3)]
    unreached = errors[1]
    assert set(unreached) == {"id", "custom_id", "response", "error"}
    assert unreached["response"] is None and unreached["error"]["message"]
    assert batch["output_file_id"] and batch["error_file_id"]


@pytest.mark.parametrize("status,end,code", [
    ("in_progress", "expire", "batch_expired"), ("cancelling", "cancel", "batch_cancelled"),
    ("validating", "cancel", "batch_cancelled")])
def test_a_batch_stopped_before_it_started_has_every_request_in_its_error_file(
        runner, status, end, code):
    """Queued (or not yet validated) when the window passed or the cancel came: each line an
    error line (a line that is not JSON too, without a custom_id), none lost."""
    cancel = status == "validating"  # cancelled while validating: no total counted yet
    folder = _batch(runner.store, "q", [_line("a"), "{not json", _line("c")],
                    status="cancelling" if end == "cancel" else status,
                    total=0 if cancel else None)
    (runner._expire if end == "expire" else runner._finish_cancel)("q")
    batch = runner.store.get_batch(None, "q")
    results, errors = _files(folder)
    assert results == [] and batch["output_file_id"] is None
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("a", code), (None, code), ("c", code)]
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


def test_a_message_batch_stopped_has_a_result_of_each_request(runner):
    """Anthropic's side, the same for every end: done ones succeeded, refused ones errored,
    those not reached expired; its counts by result type add up to its requests."""
    folder = _batch(runner.store, "m", [_message("a"), _message("b").replace('"m"', "5"),
                                        _message("c")], api="anthropic")
    _started(folder, done=1, fmt="anthropic")
    runner._expire("m")
    batch = runner.store.get_batch(None, "m")
    kinds = [json.loads(line)["result"]["type"]
             for line in (folder / RESULTS).read_text().splitlines()]
    assert kinds == ["succeeded", "errored", "expired"] and batch["status"] == "expired"
    assert batch["result_counts"] == {"succeeded": 1, "errored": 1, "expired": 1}
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}


def test_a_given_up_batch_delivered_before_a_kill_of_the_server_ends_failed(runner):
    """Its files written (one commit, which names the stop), the server killed before it
    recorded the end: started again, it ends failed as the files say, not completed."""
    folder = _batch(runner.store, "g", [_line("a"), _line("b")])
    _started(folder, done=1)
    runner._deliver("g", "errored")  # the give-up's delivery; then the kill
    runner._start("g")
    batch = runner.store.get_batch(None, "g")
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "batch_failed"
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert not (folder / DEATHS).exists()


def test_a_server_bug_in_a_step_still_delivers_every_request(runner, monkeypatch):
    """A step that raises on a running batch ends it failed with its files (the done result,
    the rest not reached), not with nothing."""
    folder = _batch(runner.store, "s", [_line("a"), _line("b")])
    _started(folder, done=1)

    def bug(batch_id):
        raise RuntimeError("a bug")

    runner._guard("s", bug, "s")
    batch = runner.store.get_batch(None, "s")
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "server_error"
    results, errors = _files(folder)
    assert [r["custom_id"] for r in results] == ["a"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("b", "batch_failed")]


GENERATE, EMBED = "/v1/chat/completions", "/v1/embeddings"


@pytest.mark.parametrize("endpoint,gpu,running,loaded,turn", [
    # a CPU: nothing fills it; an embedding batch's engine runs beside the resident one
    (EMBED, False, [GENERATE, GENERATE], True, START),
    (GENERATE, False, [EMBED], True, START),
    # a GPU the resident engine fills: an embedding batch waits until no batch runs, then
    # the resident engine is released for its engine
    (EMBED, True, [GENERATE], True, WAIT),
    (EMBED, True, [EMBED], False, WAIT),
    (EMBED, True, [], True, RELEASE),
    (EMBED, True, [], False, START),
    # ... and a generation batch waits for the embedding batches, then for the engine
    (GENERATE, True, [EMBED], False, WAIT),
    (GENERATE, True, [], False, LOAD),
    (GENERATE, True, [GENERATE], True, START),
])
def test_an_embedding_batch_never_starts_a_second_engine_on_a_gpu_the_resident_one_fills(
        endpoint, gpu, running, loaded, turn):
    assert engine_turn(endpoint, shares_gpu=gpu, running=running, loaded=loaded) == turn


class _Engine:
    """The resident engine's part the runner uses, on a GPU."""

    on_gpu = True

    def __init__(self):
        self.held, self.calls = True, []

    def serving(self):
        return self.held

    def loading(self):
        return False

    def release(self):
        self.held = False
        self.calls.append("release")

    def acquire(self):
        self.held = True
        self.calls.append("acquire")


def test_the_queue_releases_the_gpu_for_an_embedding_batch_and_loads_it_again(tmp_path):
    """In order: a generation batch running keeps the embedding batch (and those behind it)
    waiting; once none runs the engine is released and the embedding batch starts; the next
    generation batch has the engine loaded again first."""
    store = Store(tmp_path / "data")
    engine = _Engine()
    runner = Runner(store, model="m", config=None, overrides=[], served_model="m",
                    resident=(tmp_path / "c.yaml", {}), engine=engine, max_running=4)
    for batch_id, endpoint in (("gen", GENERATE), ("emb", EMBED), ("next", GENERATE)):
        _batch(store, batch_id, [_line("a")])
        store.update_batch(batch_id, endpoint=endpoint)
    runner.running = {"gen": object()}
    assert not runner._my_turn("emb") and engine.calls == []
    runner.running = {}
    assert runner._my_turn("emb") and engine.calls == ["release"]
    runner.running = {"emb": object()}
    assert not runner._my_turn("next") and engine.calls == ["release"]
    runner.running = {}
    assert not runner._my_turn("next") and engine.calls == ["release", "acquire"]
    assert runner._my_turn("next")
