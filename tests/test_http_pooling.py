"""task: embed | score | classify with ``engine.kind: http``, against a real ``vllm serve
--runner pooling`` on loopback: the same values as vLLM's own in-process calls. One server at
a time: the one-output scorer (it serves /v1/score and /classify), then the embedding model."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from pipelines import load_config, run_job

from conftest import KV_CACHE, job_config
from servers import VLLMServer

ROWS = [{"sku": f"Q{i:02d}", "title": f"{c} lamp {i}", "description": f"A {s} {m} light."}
        for i, (c, s, m) in enumerate((c, s, m) for c in ("red", "blue", "green")
                                      for s in ("soft", "bright") for m in ("steel", "wood"))]
ROWS[2]["description"] = None


def _server(model, tmp_path_factory, name):
    srv = VLLMServer(model, tmp_path_factory.mktemp(name) / "server.log", KV_CACHE)
    srv.args += ["--runner", "pooling"]
    srv.start()
    return srv


def _job(model, base_url, tmp, task, **prompt):
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    raw = job_config(model, tmp / "in.jsonl", tmp / task, input={"id_column": "sku"})
    del raw["prompt"]["system"], raw["sampling"]
    raw["output"].pop("column")
    raw["prompt"].update(prompt)
    raw["task"] = task
    raw["engine"] = {"kind": "http", "base_url": base_url}
    return load_config(raw)


def _reference(model):
    import vllm

    return vllm.LLM(model=model, runner="pooling", dtype="float32", max_model_len=512,
                    kv_cache_memory_bytes=KV_CACHE, enforce_eager=True,
                    enable_chunked_prefill=False)


@pytest.fixture(scope="module")
def scorer_server(tiny_scorer, tmp_path_factory):
    srv = _server(tiny_scorer, tmp_path_factory, "scorer")
    yield srv
    srv.kill()


def test_score_and_classify_through_the_server(scorer_server, tiny_scorer, ray_cluster,
                                               tmp_path):
    score = _job(tiny_scorer, scorer_server.base_url, tmp_path, "score",
                 template="{{ title }}", pair_template="{{ description }}")
    run_job(score)
    scored = pl.read_parquet(score.output.path)
    classify = _job(tiny_scorer, scorer_server.base_url, tmp_path, "classify")
    run_job(classify)
    classified = pl.read_parquet(classify.output.path)
    assert scored["error_kind"][2] == classified["error_kind"][2] == "null_field"
    ok = [r for i, r in enumerate(ROWS) if i != 2]
    llm = _reference(tiny_scorer)
    try:
        want_scores = [r.outputs.score for r in llm.score(
            [r["title"] for r in ok], [r["description"] for r in ok], use_tqdm=False)]
        texts = [f"Title: {r['title']}\n{r['description']}" for r in ok]
        want_probs = [r.outputs.probs[0] for r in llm.classify(texts, use_tqdm=False)]
    finally:
        del llm
    got = scored.filter(pl.col("error").is_null())["score"].to_numpy()
    assert np.abs(got - want_scores).max() < 1e-5
    got = classified.filter(pl.col("error").is_null())["prob_relevance"].to_numpy()
    assert np.abs(got - want_probs).max() < 1e-5


def test_embed_through_the_server(tiny_model, ray_cluster, tmp_path, tmp_path_factory):
    srv = _server(tiny_model, tmp_path_factory, "embedder")
    try:
        config = _job(tiny_model, srv.base_url, tmp_path, "embed")
        run_job(config)
    finally:
        srv.kill()
    out = pl.read_parquet(config.output.path).filter(pl.col("error").is_null())
    llm = _reference(tiny_model)
    try:
        want = np.array([r.outputs.embedding for r in llm.embed(
            [f"Title: {r['title']}\n{r['description']}" for i, r in enumerate(ROWS) if i != 2],
            use_tqdm=False)])
    finally:
        del llm
    got = np.array(out["embedding"].to_list())
    assert got.shape == want.shape
    assert ((got * want).sum(1) / np.linalg.norm(got, axis=1)
            / np.linalg.norm(want, axis=1)).min() >= 0.9999
