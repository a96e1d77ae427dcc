"""Pre-flight of the input: its columns are the ones the config names, its ids are unique,
and the output stays apart from it; an earlier overnight job's columns named apart.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow as pa

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, InputError, did_you_mean
from pipelines.read import InputPlan, glob_regex, read_unit, read_units, renamed
from pipelines.storage import Location
from udfs import columns


def name_apart(schema: pa.Schema, earlier: dict, config: JobConfig) -> pa.Schema:
    """An input written by an earlier overnight job holds columns this job adds too
    (finish_reason, error...): this job reads those under the earlier job's prefix (its
    output column: ``rewrite_finish_reason``), so both jobs' columns are in the output."""
    prefix, added = earlier.get("prefix"), set(earlier.get("added", ()))
    mine = set(config.generated_columns())
    clashes = [f.name for f in schema if f.name in mine and f.name in added
               and f.name != prefix and f.name != config.input.id_column]
    if not clashes or not prefix:
        return schema
    taken = set(schema.names) | mine
    fields = []
    for fld in schema:
        if fld.name in clashes:
            name = f"{prefix}_{fld.name}"
            if name in taken:
                raise InputError(f"the input (an earlier overnight job's output) has columns "
                                 f"{fld.name!r} and {name!r}; this job would add "
                                 f"{fld.name!r} and cannot name the earlier one apart")
            fld = renamed(fld, name)
        fields.append(fld)
    return pa.schema(fields, metadata=schema.metadata)


def check_output_apart(input_path: str, plan: InputPlan, output: Location) -> None:
    """The output, its staging folder and its record must not be, hold or sit inside the
    input: ``--overwrite`` would delete the input, or the next run would read the job's own
    parts as input."""
    own = [output, output.sibling(".partial"), output.sibling(".overnight.json")]
    source = Location.of(input_path)
    folder = source if not _is_glob(source.path) and source.is_dir() else None
    pattern = glob_regex(source.path) if _is_glob(source.path) else None

    def where(loc: Location) -> str:
        return os.path.realpath(loc.path) if loc.local else str(loc)

    def inside(a: str, b: str) -> bool:
        return a == b or a.startswith(b.rstrip("/") + "/")

    for mine in own:
        if mine.local != source.local:
            continue
        path = where(mine)
        clash = next((f for f in plan.files if inside(where(f), path)), None)
        if clash is None and folder is not None and inside(path, where(folder)):
            clash = folder
        if clash is None and pattern is not None and (
                pattern.fullmatch(mine.path) or pattern.fullmatch(mine.path + "/part-0.parquet")
                or pattern.fullmatch(mine.path + "/part-0.jsonl")):
            clash = source
        if clash is not None:
            raise ConfigError(f"output.path {str(output)!r} overlaps the input ({str(clash)!r}): "
                              "the job would read or replace its own input; write the output "
                              "outside the input's folder")


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def check_columns(config: JobConfig, plan: InputPlan, variables: list[str]) -> None:
    names = plan.schema.names
    missing = [v for v in variables if v not in names]
    if missing:
        raise InputError(f"prompt.template uses column {missing[0]!r}, which the input does "
                         f"not have{did_you_mean(missing[0], names)}; its columns are: "
                         f"{', '.join(names)}")
    id_column = config.input.id_column
    if id_column is not None:
        if id_column not in names:
            raise InputError(f"input.id_column {id_column!r} is not a column of the input"
                             f"{did_you_mean(id_column, names)}; its columns are: "
                             f"{', '.join(names)}")
        if plan.ids.nulls:
            raise InputError(f"input.id_column {id_column!r} is null in {plan.ids.nulls} "
                             "row(s)")
        if plan.ids.nan_at is not None:  # NaN equals no other id, not even another NaN
            raise InputError(f"input.id_column {id_column!r} has NaN at row "
                             f"{plan.ids.nan_at} (counting from 0): an id must tell rows "
                             "apart, and NaN equals nothing, itself included")
        repeats, dupes = _repeated_ids(plan, id_column)
        if repeats:
            shown = ", ".join(repr(d) for d in dupes)
            raise InputError(f"input.id_column {id_column!r} is not unique: {repeats} "
                             f"value(s) repeat, e.g. {shown}")
    for key in ("max_tokens_column", "overrides_column"):
        column = getattr(config.sampling, key)
        if column is not None and column not in names:
            raise InputError(f"sampling.{key} {column!r} is not a column of the input"
                             f"{did_you_mean(column, names)}; its columns are: "
                             f"{', '.join(names)}")
        if column is not None and not _COLUMN_TYPES[key](plan.schema.field(column).type):
            raise InputError(f"sampling.{key} {column!r} is {plan.schema.field(column).type}; "
                             f"it must hold {_COLUMN_KINDS[key]}")
    for prompt in config.prompts():
        column = prompt.adapter_column
        if column is not None and column not in names:
            raise InputError(f"prompt.adapter_column {column!r} is not a column of the input"
                             f"{did_you_mean(column, names)}; its columns are: "
                             f"{', '.join(names)}")
        kind = plan.schema.field(column).type if column is not None else None
        if kind is not None and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                     or pa.types.is_null(kind)):
            raise InputError(f"prompt.adapter_column {column!r} is {kind}; it must hold "
                             "adapter names (strings)")
    clashes = [c for c in config.generated_columns() if c in names]
    if clashes:
        hint = (" (name your id column in input.id_column)" if clashes[0] == columns.ROW_ID
                else " (rename output.column)" if clashes[0] == config.output.column else "")
        raise InputError(f"the input already has a column {clashes[0]!r}, which the job "
                         f"would add{hint}")


_COLUMN_TYPES = {
    "max_tokens_column": lambda t: pa.types.is_integer(t) or pa.types.is_null(t),
    "overrides_column": lambda t: (pa.types.is_string(t) or pa.types.is_large_string(t)
                                   or pa.types.is_struct(t) or pa.types.is_null(t)),
}
_COLUMN_KINDS = {"max_tokens_column": "integers",
                 "overrides_column": "JSON objects (as text) or structs"}


def _repeated_ids(plan: InputPlan, id_column: str, shown: int = 5) -> tuple[int, list]:
    """How many ids repeat, and a few of them. The scan kept 8-byte hashes only; where some
    repeat, the input is read once more (each row decoded once) for the values behind the
    first few (two ids that merely share a hash pass: a 1-in-10^12 chance at 10M rows)."""
    suspects = sorted(plan.ids.repeated())
    import polars as pl

    from udfs.rows import to_polars  # as the scan hashed them (pipelines/read/scan.py: IdDigest)

    for first in range(0, len(suspects), 64):  # a further pass only if all 64 were flukes
        wanted = pl.Series(suspects[first:first + 64], dtype=pl.UInt64)
        counts: Counter = Counter()
        for unit in read_units(plan.blocks):
            for table in read_unit(unit, plan.schema):
                ids = to_polars.series(table.column(id_column)).drop_nulls()
                counts.update(map(_hashable, ids.filter(ids.hash(seed=0).is_in(wanted))
                                  .to_list()))
        found = [v for v, n in counts.items() if n > 1]
        if found:
            exact = len(suspects) <= 64  # else the hashes' count, all but surely right
            return (len(found) if exact else len(suspects)), found[:shown]
    return 0, []


def _hashable(value):
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (list, dict)) \
        else value
