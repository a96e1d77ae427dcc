"""task: embed | score | classify through real Ray Data and the real vLLM engine, compared with
vLLM's own ``LLM.embed`` / ``LLM.score`` / ``LLM.classify`` on the same inputs.

Each job runs once (module fixtures) and several tests read its output. The embedding model
is the tiny generator run as a pooling model; the classifier and the scorer are tiny
sequence classifiers (tests/conftest.py); all-MiniLM-L6-v2, from a wheel, is the real one.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from pipelines import load_config, run_job
from pipelines.errors import ConfigError, JobError
from pipelines.plan.preflight import plan_job
from udfs.columns import ErrorKind
from udfs.stages.prompts import PromptRenderer

from conftest import CLASSIFIER_LABELS, KV_CACHE, job_config

ROWS = [{"sku": f"P{i:03d}", "title": f"{c} {m} lamp {i}", "description": f"A {s} light."}
        for i, (c, m, s) in enumerate(
            (c, m, s) for c in ("red", "blue", "green") for m in ("steel", "wood", "glass")
            for s in ("soft", "bright"))]
ROWS[3]["description"] = None  # null_field
ROWS[7]["description"] = "very " * 600  # longer than max_model_len 512


def _reference_llm(model: str, **kwargs):
    import vllm

    return vllm.LLM(model=model, runner="pooling", dtype="float32", max_model_len=512,
                    kv_cache_memory_bytes=KV_CACHE, enforce_eager=True,
                    enable_chunked_prefill=False, **kwargs)


def _job(model, tmp, name, task, **sections):
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    raw = job_config(model, tmp / "in.jsonl", tmp / name, input={"id_column": "sku"})
    del raw["prompt"]["system"], raw["sampling"]  # no sampling for a pooling task
    raw["output"].pop("column")
    raw["task"] = task
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw)


def _texts(rows, template="Title: {{ title }}\n{{ description }}"):
    from jinja2 import Template

    return [Template(template).render(**r) for r in rows]


@pytest.fixture(scope="module")
def embed_run(tiny_model, ray_cluster, tmp_path_factory):
    config = _job(tiny_model, tmp_path_factory.mktemp("embed"), "out", "embed",
                  output={"normalize": False})
    summary = run_job(config)
    return config, summary, pl.read_parquet(config.output.path)


@pytest.fixture(scope="module")
def classify_run(tiny_classifier, ray_cluster, tmp_path_factory):
    config = _job(tiny_classifier, tmp_path_factory.mktemp("classify"), "out", "classify",
                  prompt={"on_too_long": "truncate"})
    summary = run_job(config)
    return config, summary, pl.read_parquet(config.output.path)


@pytest.fixture(scope="module")
def score_run(tiny_scorer, ray_cluster, tmp_path_factory):
    config = _job(tiny_scorer, tmp_path_factory.mktemp("score"), "out", "score",
                  prompt={"template": "{{ title }}", "pair_template": "{{ description }}",
                          "on_too_long": "skip"})
    summary = run_job(config)
    return config, summary, pl.read_parquet(config.output.path)


def test_embed_job_equals_llm_embed(embed_run, tiny_model):
    import vllm

    config, summary, out = embed_run
    assert out["sku"].to_list() == [r["sku"] for r in ROWS]
    assert dict(zip(out["sku"], out["error_kind"])) == {
        r["sku"]: (ErrorKind.NULL_FIELD if i == 3 else ErrorKind.PROMPT_TOO_LONG if i == 7
                   else None) for i, r in enumerate(ROWS)}
    schema = pq.read_schema(next(iter(sorted(__import__("pathlib").Path(
        config.output.path).glob("*.parquet")))))
    assert str(schema.field("embedding").type) == "fixed_size_list<element: float>[128]"
    ok = out.filter(pl.col("error").is_null())
    rows = [r for r in ROWS if r["sku"] in set(ok["sku"])]
    llm = _reference_llm(tiny_model)
    try:
        ref = llm.embed(_texts(rows), pooling_params=vllm.PoolingParams(use_activation=False),
                        use_tqdm=False)
    finally:
        del llm
    got = np.array(ok["embedding"].to_list())
    want = np.array([r.outputs.embedding for r in ref])
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999
    assert abs(np.linalg.norm(got, axis=1) - 1).max() > 0.01  # normalize: false, as asked
    assert summary.rows_ok == len(ROWS) - 2 and summary.completion_tokens == 0
    assert summary.prompt_tokens == ok["prompt_tokens"].sum() + out["prompt_tokens"][7]
    assert summary.report["rows"]["ok"] == len(ROWS) - 2


def test_classify_job_equals_llm_classify(classify_run, tiny_classifier):
    from vllm.inputs import TokensPrompt

    config, _, out = classify_run
    probs = [f"prob_{label}" for label in CLASSIFIER_LABELS]
    assert out.columns[-8:] == ["label", *probs, "finish_reason", "prompt_tokens",
                                "completion_tokens", "error_kind", "error"][-8:]
    assert out["error_kind"].to_list() == [ErrorKind.NULL_FIELD if i == 3 else None
                                           for i in range(len(ROWS))]
    assert out["prompt_tokens"][7] == 512  # truncated to fit
    ok = out.filter(pl.col("error").is_null())
    renderer = PromptRenderer(plan_job(config).render)
    prompts = [TokensPrompt(prompt_token_ids=renderer.render_row(
        {"title": r["title"], "description": r["description"]})[0])
        for r in ROWS if r["sku"] in set(ok["sku"])]
    llm = _reference_llm(tiny_classifier)
    try:
        ref = [r.outputs.probs for r in llm.classify(prompts, use_tqdm=False)]
    finally:
        del llm
    assert np.abs(np.array(ok.select(probs).rows()) - np.array(ref)).max() < 1e-5
    assert ok["label"].to_list() == [CLASSIFIER_LABELS[int(np.argmax(p))] for p in ref]
    assert ok.select(pl.sum_horizontal(probs))[:, 0].to_list() == pytest.approx(
        [1.0] * ok.height, abs=1e-5)
    assert out.schema["prob_positive"] == pl.Float32


def test_score_job_equals_llm_score(score_run, tiny_scorer):
    _, summary, out = score_run
    assert out["finish_reason"][7] == "skipped" and out["error_kind"][7] is None
    assert out["error_kind"][3] == ErrorKind.NULL_FIELD
    assert summary.skipped == 1
    ok = out.filter(pl.col("error").is_null() & pl.col("finish_reason").is_null())
    rows = [r for r in ROWS if r["sku"] in set(ok["sku"])]
    llm = _reference_llm(tiny_scorer)
    try:
        ref = llm.score([r["title"] for r in rows], [r["description"] for r in rows],
                        use_tqdm=False)
    finally:
        del llm
    assert np.abs(ok["score"].to_numpy() - [r.outputs.score for r in ref]).max() < 1e-5
    assert out.schema["score"] == pl.Float32


def test_retry_errors_reruns_only_the_failed_rows(score_run):
    config, _, before = score_run
    summary = run_job(config, retry_errors=True)
    after = pl.read_parquet(config.output.path)
    assert summary.rows == len(ROWS)
    assert after.drop("error").equals(before.drop("error"))  # the null row fails again
    assert after["error_kind"][3] == ErrorKind.NULL_FIELD


PRODUCTS = [
    ("Stainless steel electric kettle, 1.7 litres", "1.7 L electric water boiler in steel"),
    ("Wireless noise-cancelling over-ear headphones", "Bluetooth headset that blocks noise"),
    ("Organic cotton crew-neck t-shirt, white", "White tee made of organic cotton"),
    ("Non-stick frying pan, 28 cm", "28 centimetre skillet with non-stick coating"),
    ("Leather hiking boots, waterproof", "Waterproof leather boots for trekking"),
    ("Mechanical keyboard with RGB backlight", "Clicky gaming keyboard with colour lights"),
    ("Ceramic coffee mug, 350 ml", "350 millilitre ceramic cup for coffee"),
    ("Yoga mat, non-slip, 6 mm", "Thick anti-slip mat for yoga exercise"),
]


def test_rewritten_titles_find_their_originals(minilm, ray_cluster, tmp_path):
    """A real sentence-transformer: each paraphrase's nearest original is its own; and the
    job's vectors equal LLM.embed's."""
    rows = [{"id": f"o{i}", "text": a} for i, (a, _) in enumerate(PRODUCTS)]
    rows += [{"id": f"r{i}", "text": b} for i, (_, b) in enumerate(PRODUCTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config({
        "task": "embed", "input": {"path": str(tmp_path / "in.jsonl"), "id_column": "id"},
        "model": {"name": minilm, "dtype": "float32"}, "prompt": {"template": "{{ text }}"},
        "output": {"path": str(tmp_path / "out")}, "engine": {"kv_cache_memory_bytes": KV_CACHE},
        "resources": {"batch_size": 8}})
    run_job(config)
    out = pl.read_parquet(config.output.path)
    vectors = np.array(out["embedding"].to_list())
    assert vectors.shape == (16, 384)
    assert np.abs(np.linalg.norm(vectors, axis=1) - 1).max() < 1e-5  # normalized by default
    originals, rewrites = vectors[:8], vectors[8:]
    assert (rewrites @ originals.T).argmax(1).tolist() == list(range(8))

    import vllm

    llm = vllm.LLM(model=minilm, runner="pooling", dtype="float32",
                   kv_cache_memory_bytes=KV_CACHE, enforce_eager=True)
    try:
        want = np.array([r.outputs.embedding for r in llm.embed([r["text"] for r in rows],
                                                                 use_tqdm=False)])
    finally:
        del llm
    assert (vectors * want).sum(1).min() >= 0.9999


def _raw(model, tmp_path, **top):
    raw = {"input": {"path": str(tmp_path / "in.jsonl")}, "model": {"name": model},
           "prompt": {"template": "{{ title }}"}, "output": {"path": str(tmp_path / "o")}}
    return {**raw, **top}


@pytest.mark.parametrize("extra, message", [
    ({"task": "embed", "sampling": {"n": 2}}, "sampling.n does not apply to task: embed"),
    ({"task": "classify", "structured": {"choice": ["a"]}},
     "structured does not apply to task: classify"),
    ({"task": "score"}, "task: score needs prompt.pair_template"),
    ({"task": "embed", "output": {"path": "o", "labels": ["a"]}},
     "output.labels does not apply to task: embed"),
])
def test_settings_that_cannot_apply_are_refused(extra, message, tmp_path):
    raw = _raw("m", tmp_path, **extra)
    if "output" in extra:
        raw["output"] = {**extra["output"], "path": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_score_on_a_three_label_model_is_one_line(tiny_classifier, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"title": "a", "d": "b"}) + "\n")
    config = load_config({**_raw(tiny_classifier, tmp_path, task="score"),
                          "prompt": {"template": "{{ title }}", "pair_template": "{{ d }}"}})
    with pytest.raises(JobError, match=r"task: score needs a model with one output .* "
                                       r"LlamaForSequenceClassification, num_labels 3"):
        plan_job(config)


def test_validate_names_the_task_and_the_rows_that_will_fail(tiny_scorer, tmp_path):
    from pipelines.plan.validate import validate_job

    config = _job(tiny_scorer, tmp_path, "validated", "score",
                  prompt={"template": "{{ title }}", "pair_template": "{{ description }}"})
    lines = validate_job(config).lines()
    assert f"model: {tiny_scorer} (max_model_len 512, task score)" in lines
    for kind, sku in (("null_field", "P003"), ("prompt_too_long", "P007")):
        assert any(line.startswith(f"will fail: 1 rows {kind}, e.g. row {sku!r}")
                   for line in lines), lines
