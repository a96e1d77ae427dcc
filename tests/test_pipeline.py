"""The whole job on the real engine through real Ray Data, run once and checked many ways.

The input is two JSONL files holding the rows users really have: plain ones, emoji and
right-to-left text, template syntax inside values, an empty string, a null in a template
column, and a description far too long for the context.
"""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from pipelines import load_config, run_job
from pipelines.write import part_name
from udfs.columns import ErrorKind
from udfs.stages.prompts import PromptRenderer

from conftest import job_config

ROWS = [
    {"sku": f"S{i:03d}", "title": f"Lamp {i}", "description": f"A warm light number {i}.",
     "price": float(i), "tags": ["a", "b"][: i % 3]}
    for i in range(20)
]
ROWS[3]["description"] = "Über café naïve 🙂👍 — مرحبا بالعالم — שלום"
ROWS[5]["description"] = "{{ 7 * 7 }} {% for x in range(3) %}loop{% endfor %} {{ title }}"
ROWS[7]["description"] = ""
ROWS[9]["description"] = None
ROWS[11]["description"] = "word " * 2000
ROWS[13]["price"] = None
NULL_ROW, LONG_ROW, TEMPLATE_ROW = "S009", "S011", "S005"
PRICES = {"input": 0.5, "output": 2.0}


@pytest.fixture(scope="session")
def job(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    (root / "in").mkdir()
    for name, rows in (("a.jsonl", ROWS[:12]), ("b.jsonl", ROWS[12:])):
        (root / "in" / name).write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    config = load_config(job_config(tiny_model, root / "in", root / "out",
                                    input={"id_column": "sku"},
                                    report={"price_per_mtok": PRICES}))
    summary = run_job(config)
    return config, summary, pl.read_parquet(root / "out"), root


def test_every_input_row_once_in_input_order(job):
    _, _, out, root = job
    assert out["sku"].to_list() == [r["sku"] for r in ROWS]
    # the parts of blocks handed over in pieces, joined into one file named by its rows
    assert sorted(p.name for p in (root / "out").iterdir()) == [part_name(0, len(ROWS))]


def test_source_columns_unchanged(job):
    _, _, out, _ = job
    source = out.select("sku", "title", "description", "price", "tags").to_dicts()
    assert source == ROWS


def test_generated_columns_added(job):
    config, _, out, _ = job
    assert out.columns[5:] == ["rewritten", "finish_reason", "prompt_tokens",
                               "completion_tokens", "error_kind", "error", "request_key"]
    assert out["request_key"].str.len_chars().unique().to_list() == [32]
    ok = out.filter(pl.col("error").is_null())
    assert ok.height == len(ROWS) - 2
    assert ok["rewritten"].null_count() == 0
    assert set(ok["finish_reason"]) <= {"stop", "length"}
    assert ok["completion_tokens"].min() > 0 and ok["prompt_tokens"].min() > 0
    assert ok["completion_tokens"].max() <= config.sampling.max_tokens


def test_null_template_field_is_a_row_error(job):
    _, _, out, _ = job
    row = out.filter(pl.col("sku") == NULL_ROW).row(0, named=True)
    assert row["error_kind"] == ErrorKind.NULL_FIELD
    assert row["error"] == "column 'description' is null in this row"
    assert row["rewritten"] is None


def test_overlong_prompt_is_a_row_error(job):
    _, _, out, _ = job
    row = out.filter(pl.col("sku") == LONG_ROW).row(0, named=True)
    assert row["error_kind"] == ErrorKind.PROMPT_TOO_LONG
    assert row["error"].startswith("prompt has ")
    assert "max_model_len 512 - max_tokens 16 leaves 496" in row["error"]
    assert row["rewritten"] is None and row["prompt_tokens"] > 496


def test_summary_counts_match_the_output(job):
    _, summary, out, _ = job
    assert summary.rows == out.height == len(ROWS)
    assert summary.errors == {ErrorKind.NULL_FIELD: 1, ErrorKind.PROMPT_TOO_LONG: 1}
    assert summary.rows_ok == len(ROWS) - 2
    assert summary.completion_tokens == out["completion_tokens"].sum()


def test_output_is_committed_with_its_record(job):
    _, _, _, root = job
    assert not (root / "out.partial").exists()
    record = json.loads((root / "out.overnight.json").read_text())
    assert record["state"] == "complete"
    assert record["summary"]["rows"] == len(ROWS)
    assert all(p.suffix == ".parquet" for p in (root / "out").iterdir())
    assert pq.read_table(root / "out").num_rows == len(ROWS)


def test_values_are_never_evaluated_as_templates(job):
    config, _, out, _ = job
    from pipelines.plan.preflight import plan_job

    renderer = PromptRenderer(plan_job(config).render)
    text = renderer.render_text(next(r for r in ROWS if r["sku"] == TEMPLATE_ROW))
    assert "{{ 7 * 7 }} {% for x in range(3) %}loop{% endfor %} {{ title }}" in text
    assert "49" not in text
    assert out.filter(pl.col("sku") == TEMPLATE_ROW)["error"].item() is None


def test_greedy_rows_equal_vllm_chat_on_the_same_messages(job, llm):
    """The pipeline renders and tokenizes exactly as vLLM's own chat path does."""
    import vllm

    config, _, out, _ = job
    ok = out.filter(pl.col("error").is_null())
    conversations = [
        [{"role": "system", "content": config.prompt.system},
         {"role": "user", "content": f"Title: {r['title']}\n{r['description']}"}]
        for r in ok.iter_rows(named=True)
    ]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=config.sampling.max_tokens)
    reference = llm.chat(conversations, params, use_tqdm=False)
    assert [r.outputs[0].text for r in reference] == ok["rewritten"].to_list()
    assert [len(r.prompt_token_ids) for r in reference] == ok["prompt_tokens"].to_list()


# --- the run report, checked against the output it describes ------------------------------

def test_report_numbers_match_the_output(job):
    config, summary, out, root = job
    report = json.loads((root / "out.report.json").read_text())
    assert report == summary.report
    rows = report["rows"]
    assert (rows["input"], rows["output"], rows["errors"]) == (len(ROWS), out.height, 2)
    assert rows["ok"] == out.filter(pl.col("error").is_null()).height == len(ROWS) - 2
    assert rows["errors_by_kind"] == {
        ErrorKind.NULL_FIELD: {"count": 1, "examples": [NULL_ROW]},
        ErrorKind.PROMPT_TOO_LONG: {"count": 1, "examples": [LONG_ROW]}}
    prompt, output = report["tokens"]["prompt"], report["tokens"]["output"]
    assert prompt["total"] == out["prompt_tokens"].sum()
    assert output["total"] == out["completion_tokens"].sum() == summary.completion_tokens
    lengths = sorted(out["completion_tokens"].drop_nulls())
    assert output["p50"] in lengths and lengths[0] <= output["p50"] <= output["p95"]
    assert output["mean"] == pytest.approx(sum(lengths) / len(lengths), abs=0.01)
    assert output["max"] <= config.sampling.max_tokens
    assert sum(report["histogram"]["output_tokens"]["counts"]) == len(ROWS) - 2
    assert report["cost"]["total"] == pytest.approx(
        prompt["total"] / 1e6 * PRICES["input"] + output["total"] / 1e6 * PRICES["output"])
    t = report["time"]
    assert t["startup_s"] + t["generation_s"] + t["finish_s"] == pytest.approx(
        t["total_s"], abs=0.05)
    assert 0 < t["generation_s"] < t["total_s"]
    (replica,) = report["throughput"]["per_replica"]  # one CPU engine
    assert replica["rows"] == len(ROWS) and replica["output_tokens"] == output["total"]
    assert replica["gpus"] == [] and replica["node"]
    # the engine's actor reserved 1 of Ray's 2 CPUs (the light stages hold fractions), yet
    # computes with both cores: Ray alone would have given it one OpenMP thread
    assert replica["cpu_threads"] == 2
    assert sum(e["output_tokens"] for e in report["timeline"]) == output["total"]
    assert report["model"]["name"] == config.model.name
    assert report["fingerprint"] == json.loads((root / "out.overnight.json").read_text())[
        "fingerprint_hash"]


def test_report_command_prints_it_again_and_renders_html(job):
    import subprocess
    import sys

    from conftest import REPO

    _, _, _, root = job
    html_path = root / "report.html"
    result = subprocess.run([sys.executable, "-m", "pipelines.cli", "report", str(root / "out"),
                             "--html", str(html_path)], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"rows         {len(ROWS)} in -> {len(ROWS)} out: {len(ROWS) - 2} ok" in result.stdout
    assert f"null_field 1  e.g. {NULL_ROW}" in result.stdout
    page = html_path.read_text()
    assert page.count("<svg") == 2 and "Output length" in page and "Throughput" in page


def test_report_rebuilt_from_the_output_alone(job):
    """Without the report file (say a copy of the output), the numbers come from the parts."""
    from pipelines.report.run_report import build_report

    _, summary, _, root = job
    record = json.loads((root / "out.overnight.json").read_text())
    rebuilt = build_report(root / "out", record)
    assert rebuilt["rows"] == summary.report["rows"]
    assert rebuilt["tokens"] == summary.report["tokens"]
    assert "time" not in rebuilt


def test_ray_blocks_of_several_plan_blocks_are_cut_back_into_them(tiny_model, ray_cluster,
                                                                   tmp_path, llm):
    """A job with more plan blocks than its engine slots want moves several in each Ray Data
    block (pipelines/read.py); the engine's stage cuts them back: one part per plan block,
    every row once, in order, and the same greedy text as vLLM's own chat path."""
    import vllm

    from pipelines.read import ray_block_rows

    rows = [{"sku": f"K{i:03d}", "title": f"Mug {i}", "description": f"Holds tea, {i} cups."}
            for i in range(48)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                                    input={"id_column": "sku"},
                                    sampling={"temperature": 0.0, "max_tokens": 4},
                                    resources={"batch_size": 2, "blocks_in_flight": 1}))
    assert ray_block_rows(len(rows), 2, 1) == 6  # 8 Ray Data blocks of 3 plan blocks each
    summary = run_job(config)
    out = pl.read_parquet(tmp_path / "out")
    assert out["sku"].to_list() == [r["sku"] for r in rows]
    assert out["error"].null_count() == len(rows)
    (replica,) = summary.report["throughput"]["per_replica"]
    assert replica["parts"] == len(rows) // 2  # each plan block a part of its own
    reference = llm.chat([[{"role": "system", "content": config.prompt.system},
                           {"role": "user", "content": f"Title: {r['title']}\n"
                                                       f"{r['description']}"}] for r in rows],
                         vllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out["rewritten"].to_list() == [r.outputs[0].text for r in reference]
