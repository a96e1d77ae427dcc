"""``/v1/embeddings`` lines of an OpenAI Batch file, run as a ``task: embed`` job.

A line's body is OpenAI's embeddings request: ``model``, ``input`` (a string or a list of
strings; each string is one vector), ``encoding_format`` (``float``, or ``base64``: the
float32 vector's little-endian bytes), ``dimensions`` (a Matryoshka model's shorter vector;
on any other model that line's error, as vLLM refuses it) and ``user``. Input given as token
ids is that line's error: the job renders and counts text.

pipelines/batchfile/lines.py reads the file; here a line becomes a row of the prepared table (its
inputs as a JSON list), the table is exploded into one row per input for the job, and the
job's rows become result lines shaped as OpenAI's embeddings response. A line one of whose
inputs fails (too long for the model) is an error line as a whole.

A file holds either embeddings or chat/completions requests, as a hosted batch has one
endpoint: pipelines/batchfile/prepare.py refuses the lines of the other kind, each with its
own error.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

URL = "/v1/embeddings"
KIND = "embeddings"
INDEX, TEXT = "input_index", "text"  # columns of the exploded table, beside the prepared ones
COLUMN = "embedding"
PROMPT = "prompt"  # the prepared table's column of a line's inputs (a JSON list)
EXPLODE_ROWS = 256  # prepared lines exploded at a time
STAMP = b"overnight.prepared"  # the exploded table's metadata: its prepared table's stamp


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None  # changes nothing written


def parse_body(body: dict, reject) -> dict:
    """The prepared row's fields for one embeddings body; ``reject(message)`` raises that
    line's error."""
    try:
        parsed = EmbeddingsBody.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"] if not isinstance(p, int)) or "body"
        if key.startswith("input"):
            key = "input"  # the union's members are noise
        raise reject(f"body.{key}: " + ("not supported by overnight; remove it"
                                        if first["type"] == "extra_forbidden"
                                        else first["msg"]))
    inputs = [parsed.input] if isinstance(parsed.input, str) else parsed.input
    if not inputs:
        raise reject("body.input: give one string or a non-empty list of strings")
    if not all(isinstance(text, str) for text in inputs):
        raise reject("body.input: token ids are not supported; send the text")
    if any(not text for text in inputs):
        raise reject("body.input: an input is empty")
    options: dict[str, Any] = {"encoding_format": parsed.encoding_format}
    if parsed.dimensions is not None:
        options["dimensions"] = parsed.dimensions
    return {PROMPT: json.dumps(inputs, ensure_ascii=False), "overrides": json.dumps(options),
            "model": parsed.model}


def explode(prepared_table: Path, out: Path) -> Path:
    """One row per input: the prepared table's rows, each with its input's text and index,
    but without the line's inputs as JSON (the ``prompt`` column): each row carrying its
    line's every input made a line of 2,048 inputs 2,048 times its size, a table quadratic
    in a line's inputs. Streamed, ``EXPLODE_ROWS`` lines at a time (pipelines/batchfile/prepare.py
    writes the prepared table in row groups of bounded size), so memory stays flat.

    An exploded table of this prepared table is reused, not written again: it is the job's
    input, whose mtime is in the job's fingerprint, and a rewrite made an interrupted batch
    "a different job" that would not resume."""
    stamp = _stamp(prepared_table)
    if _stamp_of(out) == stamp:
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    with pq.ParquetFile(prepared_table) as source:
        kept = [field for field in source.schema_arrow if field.name != PROMPT]
        schema = pa.schema([*kept, pa.field(INDEX, pa.int64()), pa.field(TEXT, pa.string())],
                           metadata={STAMP: stamp})
        with pq.ParquetWriter(tmp, schema) as writer:
            for batch in source.iter_batches(batch_size=EXPLODE_ROWS):
                writer.write_table(_explode_batch(batch, schema))
    os.replace(tmp, out)
    return out


def _explode_batch(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """A batch of prepared lines -> one row per input (its line's other columns repeated)."""
    inputs = [json.loads(text) for text in batch.column(PROMPT).to_pylist()]
    lines = pa.array([line for line, texts in enumerate(inputs) for _ in texts], pa.int64())
    other = pa.Table.from_batches([batch]).drop_columns([PROMPT]).take(lines)
    index = pa.array([i for texts in inputs for i in range(len(texts))], pa.int64())
    text = pa.array([t for texts in inputs for t in texts], pa.string())
    return other.append_column(schema.field(INDEX), index) \
        .append_column(schema.field(TEXT), text).replace_schema_metadata(schema.metadata)


def _stamp(path: Path) -> bytes:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}".encode()


def _stamp_of(exploded: Path) -> bytes | None:
    try:
        return (pq.read_schema(exploded).metadata or {}).get(STAMP)
    except (OSError, pa.ArrowInvalid):  # none yet, or not whole: write it
        return None


def job_raw(table: Path, output: Path, model: str, base: dict) -> dict:
    """The raw config of the embed job over the exploded table; the rest from ``base``."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    raw["task"] = "embed"
    raw["input"] = {"path": str(table)}
    raw.setdefault("model", {})["name"] = model
    raw["prompt"] = {"template": "{{ " + TEXT + " }}", "on_too_long": "error"}
    # a row's dimensions; vectors of any length (a list column)
    raw["sampling"] = {"overrides_column": "overrides"}
    raw["output"] = {"path": str(output), "column": COLUMN}
    return raw


def result_body(rows: list[dict], model: str, prompt_tokens: int) -> dict:
    """OpenAI's embeddings response for one request's rows (its inputs, in order)."""
    encoding = json.loads(rows[0]["overrides"]).get("encoding_format", "float")
    data = [{"object": "embedding", "index": row[INDEX],
             "embedding": _encode(row[COLUMN], encoding)} for row in rows]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encode(vector: list[float], encoding: str):
    if encoding == "base64":
        import numpy as np

        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
