"""The Python API: a job's stages added to a user's own Ray Dataset, or a job run over a
DataFrame (polars, pandas or Arrow), through the same code as ``overnight run``.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.config import load_config, read_yaml
from pipelines.errors import ConfigError
from pipelines.job.pipeline import actor_pool, job_stages, run_job
from pipelines.job.resources import LIGHT_STAGE_CPUS, plan_replicas
from pipelines.job.summary import RunSummary
from pipelines.plan.preflight import plan_job
from pipelines.plan.specs import JobPlan
from udfs import columns
from udfs.stages.chain import chain_named_for

SAMPLE_ROWS = 64  # the dataset's first rows: what add_stages checks the config against


def add_stages(ds, config: dict | str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """``ds`` with a job's stages appended (render -> generate or pool -> parse): a lazy
    ``ray.data.Dataset`` whose rows keep every column and gain the job's generated columns.

    ``config`` is a dict or a YAML path shaped like a job file, without ``input`` or
    ``output.path``: the dataset is the input and the caller's pipeline writes it. The config
    is checked as ``overnight validate`` checks it, against the dataset's first rows, before
    any engine starts: a problem is a one-line ConfigError (a JobError). Nothing is written
    and nothing resumed. The added columns are a job's, less ``row_id`` and ``request_key``,
    which name a row of a job's output."""
    plan = _plan_on_sample(ds, config, overrides)
    replicas = plan_replicas(plan.config)
    stage, after = job_stages(plan, replicas)
    # in the writer's place (pipelines/job/pipeline.py: build_dataset), the columns as a job
    # writes them: the last stage's, in the same actors
    added = [name for name in plan.config.generated_columns()
             if name not in (columns.ROW_ID, columns.REQUEST_KEY)]
    keep = (PublicColumns, {"added": tuple(added)})
    engine_stages = [stage] if after else [stage, keep]
    ds = ds.map_batches(chain_named_for(engine_stages),
                        fn_constructor_kwargs={"stages": engine_stages},
                        batch_format="pyarrow", batch_size=plan.config.resources.batch_size,
                        **replicas.remote_args(), compute=actor_pool(replicas.replicas))
    if after:
        after.append(keep)
        ds = ds.map_batches(chain_named_for(after), fn_constructor_kwargs={"stages": after},
                            batch_format="pyarrow", batch_size=None,
                            num_cpus=round(2 * LIGHT_STAGE_CPUS / replicas.replicas, 4),
                            compute=actor_pool(replicas.replicas))
    return ds


class PublicColumns:
    """``map_batches`` stage: a batch's own columns, then the ``added`` ones in a job's output
    order; the columns that carry state between stages dropped."""

    def __init__(self, added: tuple[str, ...]):
        self.added = added

    def __call__(self, batch: pa.Table) -> pa.Table:
        own = [name for name in batch.column_names
               if name not in self.added and not name.startswith(columns.INTERNAL_PREFIX)]
        return batch.select([*own, *(name for name in self.added if name in batch.column_names)])


def _plan_on_sample(ds, config: dict | str | Path, overrides) -> JobPlan:
    """The job planned as ``overnight run`` plans it, its input the dataset's first rows."""
    raw = _raw_config(config)
    try:
        sample = ds.take_batch(SAMPLE_ROWS, batch_format="pyarrow")
    except ValueError as exc:  # Ray Data's "The dataset is empty."
        raise ConfigError(f"the dataset: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="overnight-") as tmp:
        source = Path(tmp) / "sample.parquet"
        pq.write_table(sample, source)
        raw.setdefault("input", {})["path"] = str(source)
        raw.setdefault("output", {})["path"] = str(Path(tmp) / "output")  # never written
        plan = plan_job(load_config(raw, overrides))
    if plan.steps is not None:  # a step's rows are tracked by their position in the input
        raise ConfigError("steps: a job with steps runs with run_job or run_dataframe, not "
                          "add_stages")
    if plan.config.input.id_column is None and plan.pooling is None:
        # a row's seed, where it has no id and no position: its prompt's (the same prompt,
        # the same samples)
        plan = replace(plan, sampling=replace(plan.sampling,
                                              key_column=columns.PROMPT_TOKEN_IDS))
    return plan


def run_dataframe(data, config: dict | str | Path,
                  overrides: list[str] | tuple[str, ...] = (), *,
                  return_summary: bool = False):
    """Run a job over ``data``: every column kept, the generated columns added, same order.

    ``data`` is a polars or pandas DataFrame or an Arrow table; the result is of the same
    kind (a polars DataFrame for Arrow). ``config`` is a dict or a YAML path shaped like a job
    file; its ``input.path`` and ``output.path`` may be left out (the frame is the input, the
    result is returned). With ``return_summary``: ``(result, RunSummary)``.
    """
    raw = _raw_config(config)
    pandas = _is_pandas(data)
    if pandas:
        table = pa.Table.from_pandas(data, preserve_index=False)
    else:
        table = data.to_arrow() if isinstance(data, pl.DataFrame) else data
    with tempfile.TemporaryDirectory(prefix="overnight-") as tmp:
        source = Path(tmp) / "input.parquet"
        pq.write_table(table, source)
        raw.setdefault("input", {})["path"] = str(source)
        raw.setdefault("output", {})["path"] = str(Path(tmp) / "output")
        summary: RunSummary = run_job(load_config(raw, overrides))
        result = pl.read_parquet(Path(tmp) / "output")
    if pandas:
        result = result.to_pandas()
    return (result, summary) if return_summary else result


def _is_pandas(data) -> bool:
    """A pandas DataFrame, told without importing pandas (an optional dependency): a frame
    of it means it is imported already."""
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(data, pandas.DataFrame)


def _raw_config(config: dict | str | Path) -> dict:
    if isinstance(config, dict):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    raw = read_yaml(config)  # a key given twice refused, as a job's
    if not isinstance(raw, dict):
        raise ConfigError(f"{config}: expected a mapping of sections (input, model, ...)")
    return raw
