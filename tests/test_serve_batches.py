"""Batches through ``overnight serve`` on the tiny model, driven by the official clients: the
round trip equal to ``overnight batch``, a cancel mid-run, Anthropic's Message Batches, and a
small batch behind a large one on the shared engine."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import openai
import pytest

from conftest import cli
from servers import (FAST, KEY, OTHER_KEY, lines_of, long_file, request, request_file, some_done,
                     wait)


def _content(line: dict):
    body = line["response"]["body"]
    return ([c["message"]["content"] for c in body["choices"]],
            [c["finish_reason"] for c in body["choices"]], body["usage"])


def test_round_trip_equals_overnight_batch(server, tiny_model, tmp_path, ray_cluster):
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
    assert cli("batch", requests, "-o", reference, "--model", tiny_model,  # (this process's Ray)
               "--config", server.root / "job.yaml", "--quiet")[0] == 0
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
    tools = {"custom_id": "tools", "params": {**requests[0]["params"], "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}}  # a server tool: refused
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
    assert "params.tools[0].type: 'web_search_20250305' is a server tool" \
        in results["tools"].error.error.message
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
