"""The Python API for notebooks: a DataFrame in, a DataFrame out.

The same job as ``overnight run``, through the same pipeline: the frame is written to a
temporary Parquet file, the job runs on it, and its output is read back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.config import load_config, read_yaml
from pipelines.errors import ConfigError
from pipelines.job.pipeline import run_job
from pipelines.job.summary import RunSummary


def run_dataframe(data: pl.DataFrame | pa.Table, config: dict | str | Path,
                  overrides: list[str] | tuple[str, ...] = (), *,
                  return_summary: bool = False) -> pl.DataFrame | tuple[pl.DataFrame, RunSummary]:
    """Run a job over ``data``: every column kept, the generated columns added, same order.

    ``config`` is a dict or a YAML path shaped like a job file; its ``input.path`` and
    ``output.path`` may be left out (the frame is the input, the result is returned).
    """
    raw = _raw_config(config)
    table = data.to_arrow() if isinstance(data, pl.DataFrame) else data
    with tempfile.TemporaryDirectory(prefix="overnight-") as tmp:
        source = Path(tmp) / "input.parquet"
        pq.write_table(table, source)
        raw.setdefault("input", {})["path"] = str(source)
        raw.setdefault("output", {})["path"] = str(Path(tmp) / "output")
        summary = run_job(load_config(raw, overrides))
        result = pl.read_parquet(Path(tmp) / "output")
    return (result, summary) if return_summary else result


def _raw_config(config: dict | str | Path) -> dict:
    if isinstance(config, dict):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    raw = read_yaml(config)  # a key given twice refused, as a job's
    if not isinstance(raw, dict):
        raise ConfigError(f"{config}: expected a mapping of sections (input, model, ...)")
    return raw
