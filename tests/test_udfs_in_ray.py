"""The UDFs dropped into a user's own Ray Data pipeline, as the README shows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipelines import load_config
from pipelines.plan.preflight import plan_job
from udfs.stages.predictor import Predictor
from udfs.stages.prompts import PromptRenderer

from conftest import REPO


def test_renderer_and_predictor_in_a_users_ray_pipeline(tiny_model, ray_cluster):
    config = load_config(REPO / "configs" / "demo.yaml",
                         [f"model.name={tiny_model}", "sampling.temperature=0",
                          "input.path=" + str(REPO / "data" / "products.parquet")])
    plan = plan_job(config)
    source = pq.read_table(REPO / "data" / "products.parquet")
    ds = ray.data.read_parquet(str(REPO / "data" / "products.parquet"))
    ds = ds.map_batches(PromptRenderer, fn_constructor_kwargs={"spec": plan.render},
                        batch_format="pyarrow", num_cpus=0.25,
                        compute=ray.data.ActorPoolStrategy(size=1))
    ds = ds.map_batches(Predictor, fn_constructor_kwargs={
        "engine": plan.engine, "sampling": plan.sampling, "output_column": "rewritten"},
        batch_format="pyarrow", num_cpus=0.5, compute=ray.data.ActorPoolStrategy(size=1))
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    assert table.num_rows == source.num_rows
    assert sorted(table.column("sku").to_pylist()) == sorted(source.column("sku").to_pylist())
    assert table.column("error").null_count == table.num_rows
    assert table.column("rewritten").null_count == 0
