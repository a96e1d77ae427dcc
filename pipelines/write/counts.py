"""What a part holds, counted: the small record each writer returns for the driver's progress
and report, and the per-step counts a job of steps keeps in a part's metadata."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.storage import Location
from pipelines.write.parts import count_runs
from udfs import columns

RECORD_SCHEMA = pa.schema([
    ("part", pa.string()), ("replica", pa.string()), ("ready_at", pa.float64()),
    ("done_at", pa.float64()), ("written_at", pa.float64()), ("input_rows", pa.int64()),
    ("rows", pa.int64()), ("errors", pa.string()), ("skipped", pa.int64()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("steps", pa.string()),  # a job with steps: the part's per-step counts (JSON), or null
    ("cached_tokens", pa.int64())])  # prompt tokens the engine's prefix cache held


def timing(block: pa.Table) -> dict:
    """Which replica generated the block, and when (the predictor's columns)."""
    if columns.REPLICA not in block.column_names:
        return {"replica": None, "ready_at": None, "done_at": None, "written_at": time.time()}
    cached = (pc.sum(block.column(columns.CACHED_TOKENS)).as_py()
              if columns.CACHED_TOKENS in block.column_names else None)
    return {"replica": block.column(columns.REPLICA)[0].as_py(),
            "ready_at": pc.min(block.column(columns.READY_AT)).as_py(),
            "done_at": pc.max(block.column(columns.DONE_AT)).as_py(),
            "written_at": time.time(), "cached_tokens": cached}


COUNTED = [columns.ERROR_KIND, columns.FINISH_REASON, columns.PROMPT_TOKENS,
           columns.COMPLETION_TOKENS]
# a job with a reasoning parser's; a job with images'
COUNTED_IF_PRESENT = (columns.REASONING_TOKENS, columns.IMAGE_COUNT, columns.IMAGE_TOKENS)


def summarize_part(path: Location, key_column: str) -> dict:
    """``count_part`` of a written part, reading only the columns it counts."""
    return count_part(read_part(path, columns=[*COUNTED, key_column],
                                if_present=COUNTED_IF_PRESENT), key_column)


def read_part(path: Location, columns: list[str] | None = None,
              if_present: tuple[str, ...] = ()) -> pa.Table:
    """A part, or ``columns`` of it; ``if_present``: more columns, read where the part has
    them (a thinking model's reasoning_tokens)."""
    with path.open() as handle:
        if if_present:
            names = pq.read_schema(handle).names
            columns = [*(columns or []), *(c for c in if_present if c in names)]
        return pq.read_table(handle, columns=columns)


def count_part(part: pa.Table, key_column: str) -> dict:
    """What the summary adds up: input rows, output rows (samples), errors by kind, skipped
    rows, tokens. Vectorized: a compacted part holds hundreds of thousands of rows."""
    kinds = pc.value_counts(part.column(columns.ERROR_KIND).combine_chunks()
                            if part.num_rows else pa.array([], pa.string()))
    errors = {k.as_py(): n.as_py() for k, n in zip(kinds.field("values"), kinds.field("counts"))
              if k.as_py() is not None}
    steps = part_steps(part.schema)
    return {
        # a job with steps may leave a part's input rows out (dropped): its metadata counts
        "input_rows": (steps["input_rows"] if steps is not None
                       else count_runs(part.column(key_column))),
        "steps": steps["steps"] if steps is not None else None,
        "rows": part.num_rows,
        "errors": json.dumps(dict(sorted(errors.items()))),
        "skipped": pc.sum(pc.equal(part.column(columns.FINISH_REASON),
                                   columns.FinishReason.SKIPPED)).as_py() or 0,
        # a thinking model's: the output tokens it spent thinking
        "reasoning_tokens": (pc.sum(part.column(columns.REASONING_TOKENS)).as_py() or 0
                             if columns.REASONING_TOKENS in part.column_names else 0),
        # a job with images: the images its rows' prompts held, and their tokens
        **{name: pc.sum(part.column(name)).as_py() or 0
           for name in (columns.IMAGE_COUNT, columns.IMAGE_TOKENS) if name in part.column_names},
        # a job with steps: the tokens its steps generated (a row's own columns count its
        # fan-out parent's again, and dropped rows are not in the part)
        **({"prompt_tokens": sum(s["prompt_tokens"] for s in steps["steps"]),
            "completion_tokens": sum(s["completion_tokens"] for s in steps["steps"])}
           if steps is not None else
           {"prompt_tokens": pc.sum(part.column(columns.PROMPT_TOKENS)).as_py() or 0,
            "completion_tokens": pc.sum(part.column(columns.COMPLETION_TOKENS)).as_py() or 0}),
    }


def part_steps(schema: pa.Schema) -> dict | None:
    """A job with steps: a part's (or file's) {"input_rows", "steps": [per-step counts]}."""
    found = (schema.metadata or {}).get(columns.STEPS_METADATA)
    return json.loads(found) if found is not None else None


STEP_NUMBERS = ("rows_in", "rows_out", "dropped", "errors", "prompt_tokens",
                "completion_tokens", "seconds")


def add_steps(total: list[dict], more: list[dict]) -> list[dict]:
    """Two lists of per-step counts added up, step by step (by name, in order)."""
    if not total:
        return [dict(step) for step in more]
    by_name = {step["name"]: step for step in total}
    for step in more:
        mine = by_name.get(step["name"])
        if mine is None:
            total.append(dict(step))
            by_name[step["name"]] = total[-1]
            continue
        for key in STEP_NUMBERS:
            mine[key] = round(mine.get(key, 0) + step.get(key, 0), 3)
    return total
