"""The Python API (a job's stages on a user's dataset, a DataFrame in and out) and the prompt
policies, on the real engine."""

from __future__ import annotations

import polars as pl
import pytest

from pipelines import ConfigError, JobError, add_stages, load_config, run_dataframe
from pipelines.plan.preflight import plan_job
from udfs import columns
from udfs.columns import FinishReason
from udfs.stages.prompts import PromptRenderer

from conftest import job_config

PRODUCTS = pl.DataFrame({
    "title": ["Lamp", "Chair", "Scarf", "Kettle", "Vase"],
    "description": ["Warm light.", "Oak, sturdy.", "word " * 600, "Steel ☕.", "Glass."],
    "price": [9.5, None, 20.0, 31.0, 12.25],
})


@pytest.fixture(scope="session")
def skipped(tiny_model, ray_cluster):
    """No chat template, no id column, over-long prompts skipped."""
    config = job_config(tiny_model, "unused", "unused",
                        prompt={"chat": False, "system": None, "on_too_long": "skip"})
    return run_dataframe(PRODUCTS, config, return_summary=True)


def test_dataframe_in_dataframe_out(skipped):
    out, _ = skipped
    assert isinstance(out, pl.DataFrame)
    assert out.select(PRODUCTS.columns).equals(PRODUCTS)
    assert out["row_id"].to_list() == list(range(PRODUCTS.height))


def test_skip_policy_keeps_the_row_without_an_error(skipped):
    out, summary = skipped
    row = out.row(2, named=True)
    assert row["finish_reason"] == FinishReason.SKIPPED
    assert row["error"] is None and row["rewritten"] is None and row["prompt_tokens"] > 496
    assert summary.skipped == 1 and summary.rows_ok == PRODUCTS.height - 1


def test_plain_prompts_equal_vllm_generate(skipped, llm):
    """Without a chat template the rendered text is the prompt, as LLM.generate takes it."""
    import vllm

    out, _ = skipped
    ok = out.filter(pl.col("finish_reason") != FinishReason.SKIPPED)
    prompts = [f"Title: {t}\n{d}" for t, d in zip(ok["title"], ok["description"])]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16)
    reference = llm.generate(prompts, params, use_tqdm=False)
    assert [r.outputs[0].text for r in reference] == ok["rewritten"].to_list()


def test_truncate_policy_fits_the_prompt(tiny_model, tmp_path):
    """Truncation is decided before the engine: checked on the renderer alone."""
    PRODUCTS.write_parquet(tmp_path / "in.parquet")
    config = job_config(tiny_model, tmp_path / "in.parquet", tmp_path / "out",
                        prompt={"on_too_long": "truncate"})
    out = PromptRenderer(plan_job(load_config(config)).render)(PRODUCTS.to_arrow())
    assert out.column("error").null_count == PRODUCTS.height
    assert out.column("prompt_tokens").to_pylist()[2] == 512 - 16
    ids = out.column(columns.PROMPT_TOKEN_IDS).to_pylist()[2]
    assert ids[0] == 0  # the chat template's BOS survives: tokens are cut from the middle


def test_dedupe_drops_identical_samples(tiny_model, ray_cluster):
    """Greedy samples of one row are identical: dedupe keeps the first of each row."""
    config = job_config(tiny_model, "unused", "unused", sampling={"n": 3},
                        output={"dedupe": True})
    out, summary = run_dataframe(PRODUCTS, config, return_summary=True)
    assert out["row_id"].to_list() == list(range(PRODUCTS.height))
    assert out["sample_index"].to_list() == [0] * PRODUCTS.height
    assert summary.deduped == 2 * PRODUCTS.height
    assert f"dedupe: {2 * PRODUCTS.height} duplicate samples dropped" in summary.lines()


ITEMS = [{"n": i, "title": f"Item {i}", "description": f"Thing number {i}."} for i in range(12)]


def stages_config(tiny_model: str, **sections) -> dict:
    """A job without input or output.path: the dataset is the input, the caller writes it."""
    sections["sampling"] = {"max_tokens": 8, **sections.get("sampling", {})}
    config = job_config(tiny_model, "unused", "unused", **sections)
    del config["input"], config["output"]["path"]
    return config


def test_add_stages_keeps_every_row_and_column(tiny_model, ray_cluster):
    import ray

    config = stages_config(tiny_model)
    rows = add_stages(ray.data.from_items(ITEMS), config).take_all()
    assert len(rows) == len(ITEMS)
    by_n = sorted(rows, key=lambda r: r["n"])
    assert [{k: r[k] for k in ITEMS[0]} for r in by_n] == ITEMS
    added = [c for c in load_config({**config, "input": {"path": "unused"},
                                     "output": {**config["output"], "path": "unused"}})
             .generated_columns() if c not in (columns.ROW_ID, columns.REQUEST_KEY)]
    assert [list(r) for r in rows] == [[*ITEMS[0], *added]] * len(rows)
    assert all(r["rewritten"] and r["error"] is None for r in rows)


def test_add_stages_refuses_a_bad_config_before_any_engine(tiny_model, ray_cluster):
    import ray

    ds = ray.data.from_items(ITEMS)
    with pytest.raises(ConfigError) as bad_key:
        add_stages(ds, stages_config(tiny_model, sampling={"max_tokenz": 8}))
    with pytest.raises(JobError) as bad_column:
        add_stages(ds, stages_config(tiny_model, prompt={"template": "{{ titel }}"}))
    for raised in (bad_key, bad_column):
        assert "\n" not in str(raised.value)
    assert "max_tokenz" in str(bad_key.value) and "titel" in str(bad_column.value)


def test_a_pandas_frame_in_a_pandas_frame_out(tiny_model, ray_cluster):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(ITEMS[:3])
    out = run_dataframe(frame, stages_config(tiny_model))
    assert isinstance(out, pd.DataFrame)
    assert out[list(frame.columns)].equals(frame)
    assert out["error"].isna().all()
