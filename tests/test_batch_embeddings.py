"""``/v1/embeddings`` lines in ``overnight batch``: results shaped as OpenAI's embeddings
response and equal to vLLM's own ``run_batch`` on the same lines; a line overnight cannot run
is that line's error; a file mixing embeddings with chat lines refuses the other kind's lines,
each with its error."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.batchfile import embeddings as batch_embeddings
from pipelines.batchfile.prepare import prepare
from pipelines.batchfile.run import run_batch_file

from conftest import KV_CACHE

MODEL_NAME = "tiny-embedder"


def _line(cid, body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": MODEL_NAME, **body}}


GOOD = [_line("one", {"input": "a red steel lamp"}),
        _line("two", {"input": ["soft cotton shirt", "blue glass bottle"],
                      "encoding_format": "base64"}),
        _line("three", {"input": "a quiet modern chair", "encoding_format": "float"})]
BAD = {  # line number (after GOOD) -> (custom_id, code, words in the message)
    4: ("dims", "engine_error", "Matryoshka"),  # the model has no shorter vectors
    5: ("tokens", "invalid_body", "token ids are not supported"),
    6: ("chat", "invalid_url", "cannot share a file"),
    7: ("long", "prompt_too_long", "tokens"),
}
LINES = [*GOOD, _line("dims", {"input": "lamp", "dimensions": 16}),
         _line("tokens", {"input": [5, 6, 7]}),
         {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
          "body": {"messages": [{"role": "user", "content": "hi"}]}},
         _line("long", {"input": "very " * 600})]


@pytest.fixture(scope="module")
def embeddings_batch(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-embeddings")
    (root / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LINES))
    counts = run_batch_file(root / "requests.jsonl", root / "results.jsonl", model=tiny_model,
                            config={"model": {"max_model_len": 512, "dtype": "float32"},
                                    "engine": {"kv_cache_memory_bytes": KV_CACHE},
                                    "resources": {"batch_size": 4}})
    results = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (root / "results.errors.jsonl").read_text().splitlines()]
    return root, counts, results, errors


def _vectors(body: dict) -> list[np.ndarray]:
    out = []
    for item in sorted(body["data"], key=lambda d: d["index"]):
        vector = item["embedding"]
        if isinstance(vector, str):
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        out.append(np.asarray(vector, dtype=np.float64))
    return out


def test_results_are_openai_embeddings_responses(embeddings_batch):
    _, counts, results, errors = embeddings_batch
    assert counts["requests"] == len(LINES) and counts["results"] == len(GOOD)
    assert [r["custom_id"] for r in results] == ["one", "two", "three"]
    for r in results:
        body = r["response"]["body"]
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        assert all(d["object"] == "embedding" for d in body["data"])
    two = results[1]["response"]["body"]
    assert [d["index"] for d in two["data"]] == [0, 1]
    assert isinstance(two["data"][0]["embedding"], str)  # base64
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for r in results
               for v in _vectors(r["response"]["body"]))  # normalized, as the API's are
    by_line = {e["error"]["line"]: e for e in errors}
    assert sorted(by_line) == sorted(BAD)
    for number, (cid, code, words) in BAD.items():
        error = by_line[number]
        assert error["custom_id"] == cid and error["error"]["code"] == code
        assert words in error["error"]["message"], error


def test_results_equal_vllms_own_run_batch(embeddings_batch, tiny_model):
    root, _, results, _ = embeddings_batch
    (root / "vllm_in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
         "-i", str(root / "vllm_in.jsonl"), "-o", str(root / "vllm_out.jsonl"),
         "--model", tiny_model, "--served-model-name", MODEL_NAME, "--runner", "pooling",
         "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(KV_CACHE), "--enforce-eager",
         "--no-enable-chunked-prefill"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = {}
    for line in (root / "vllm_out.jsonl").read_text().splitlines():
        line = json.loads(line)
        theirs[line["custom_id"]] = line["response"]["body"]
    for r in results:
        ours, want = _vectors(r["response"]["body"]), _vectors(theirs[r["custom_id"]])
        assert len(ours) == len(want)
        for a, b in zip(ours, want):
            assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) >= 0.9999
        assert r["response"]["body"]["usage"]["prompt_tokens"] == \
            theirs[r["custom_id"]]["usage"]["prompt_tokens"]


def _exploded(work, line) -> tuple:
    work.mkdir()
    (work / "requests.jsonl").write_text(json.dumps(line) + "\n")
    prepared = prepare(work / "requests.jsonl", work, 16, 512)
    return prepared, batch_embeddings.explode(prepared.table, work / "inputs.parquet")


def test_a_line_of_2048_inputs_explodes_into_a_table_linear_in_its_inputs(tmp_path):
    """OpenAI allows 2,048 inputs in a line: its job table is 2,048 times a 1-input line's,
    not 2,048 rows each carrying every input (a 0.57 MB line took 2 GB)."""
    text = "a red steel lamp with a brass foot and a linen shade"
    _, one = _exploded(tmp_path / "one", _line("x", {"input": [text]}))
    _, many = _exploded(tmp_path / "many", _line("x", {"input": [text] * 2048}))
    table = pq.read_table(many)
    assert table.num_rows == 2048 and table["input_index"].to_pylist() == list(range(2048))
    assert table.nbytes <= 1.5 * 2048 * pq.read_table(one).nbytes, table.nbytes


def test_the_exploded_table_is_reused_while_its_prepared_table_is_the_same(tmp_path):
    """The exploded table is the job's input, whose mtime is in the job's fingerprint: the
    same file again (an interrupted batch run again) must not rewrite it, or the job would
    not resume; a file prepared again (another request file) is exploded again."""
    prepared, out = _exploded(tmp_path / "w", _line("x", {"input": ["one", "two"]}))
    stamp = out.stat().st_mtime_ns
    assert batch_embeddings.explode(prepared.table, out).stat().st_mtime_ns == stamp
    (tmp_path / "w" / "requests.jsonl").write_text(
        json.dumps(_line("y", {"input": ["three"]})) + "\n")
    prepared = prepare(tmp_path / "w" / "requests.jsonl", tmp_path / "w", 16, 512)
    assert pq.read_table(batch_embeddings.explode(prepared.table, out))["text"].to_pylist() \
        == ["three"]
