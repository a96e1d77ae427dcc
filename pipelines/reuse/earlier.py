"""The earlier output a re-run reuses: its Parquet files, and what each file's footer says of
the job that wrote it (read without reading its rows)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.errors import OutputError, one_line
from pipelines.storage import Location
from pipelines.write.parts import list_parts
from udfs import columns


def earlier_files(source: Location) -> tuple[list[Location], str | None]:
    """The earlier output's Parquet files, and why there are none: its parts by their names
    (``list_parts``), or, in a folder whose files were renamed (a copy, an export), every
    Parquet file in it, read by its content; a file path is an output of one file."""
    if not source.exists():
        raise OutputError(f"output.reuse_from {str(source)!r}: no such output")
    if not source.is_dir():
        return [source], None
    parts = list_parts(source)[0]
    if parts:
        return [source / p.name for p in parts], None
    named = sorted(n for n in source.sizes() if n.endswith(".parquet") and not n.startswith("."))
    if not named:
        return [], "the earlier output has no Parquet files"
    return [source / n for n in named], None


@dataclass
class Footer:
    """What an earlier file's footer says: its columns, rows and the job that wrote it."""

    names: list[str]
    rows: int
    job: dict


def footer(file: Location) -> Footer:
    try:
        with file.open() as handle:
            meta = pq.ParquetFile(handle)
            schema, rows = meta.schema_arrow, meta.metadata.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise OutputError(f"output.reuse_from {str(file)!r}: not a Parquet file "
                          f"({one_line(exc, 160)})") from None
    try:
        job = json.loads((schema.metadata or {}).get(columns.JOB_METADATA, b"{}"))
    except ValueError:
        job = {}
    return Footer(schema.names, rows, job if isinstance(job, dict) else {})

