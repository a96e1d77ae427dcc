"""Reuse: a re-run over a changed table carries over the rows whose request is unchanged.

Every row of a generate job's output holds its request key (``request_key``, made in
pipelines/reuse/request_key.py). The key is a column, not a sidecar: it travels with the row wherever
the output is copied (yesterday's snapshot, an object store), and a reader that does not want
it leaves one column out.

A run with ``output.reuse`` (or ``output.reuse_from``) finds the new table's keys among the
earlier output's (``plan_reuse``), then stages the rows found as parts, their generated columns
beside the new table's values in the new table's order (``stage_reused``), before any engine
starts; the rest run as the rows still to do of a resumed job do. The lookup is a join of two
key columns, never a dict of rows: both sides are hashed a block at a time and spilled to local
files by their keys' bits, and each slice is joined by sorting, so the driver holds 5 bytes a
new row (where its earlier outputs are) and one slice at a time.

Two input rows never merge. Rows may share a key (a greedy job's duplicate texts under two
ids: the same request); the earlier output's input rows are told apart by their ids and
sample_index, never by the key (``_input_rows``), and the k-th new row with a key takes the
k-th earlier input row with it (``_join``): each earlier row is carried over once at most. The
lookup is row by row: an output a --retry-errors run with another max_tokens merged into holds
rows keyed by either run's settings, each found by its own key. The earlier output is its parts
by their names, or, where its files were renamed, every Parquet file in its folder.

A job of steps: a row's key covers every step, and its output rows (its fan-out) are carried
over together. When only its first steps are unchanged, both sides are keyed again by those
steps alone (``KeySpec.first_steps``, over the earlier output's source values), and a row found
is staged as its state after them (``_stage_states``: a hidden file a block, which
udfs/stages/steps.py starts the block's rows from) rather than as a part.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.plan.changes import changed_settings
from pipelines.errors import JobError, OutputError, one_line
from pipelines.reuse.request_key import KeySpec, key_words, request_words
from pipelines.storage import Location
from pipelines.write.parts import list_parts
from pipelines.write.store import OutputStore
from udfs import columns

SLICE_ROWS = 500_000  # keys joined at once, about (each side)
# A run over a table this large looks up and stages its rows in a Ray task on the driver's
# node (``carry_over_on_ray``): the lookup's arrays and the staging's blocks are that task's
# memory, and the driver's stays what a first run's is
LARGE_ROWS = 1_000_000
BUCKET_ROWS = 200_000  # carried rows gathered at once into the new table's order, about


@dataclass
class ReusePlan:
    """What a re-run carries over: for each new row, where its earlier outputs are."""

    source: str
    rows: int  # the new table's
    reused: int = 0
    earlier_rows: int = 0  # the earlier output's input rows
    dropped: int = 0  # earlier rows whose request the new table no longer makes
    failed: int = 0  # earlier rows found, with an error: generated again
    why_none: str | None = None  # with nothing reused: why
    # a job of steps whose first steps alone are unchanged: the rows found are carried over
    # up to this step (its first), and run from there (udfs/stages/steps.py); None: whole rows
    from_step: int | None = None
    from_step_name: str | None = None
    files: list = field(default_factory=list, repr=False)  # the earlier output's files
    file_rows: np.ndarray | None = field(default=None, repr=False)  # their first global rows
    at: np.ndarray | None = field(default=None, repr=False)  # int64[rows]: first earlier row, -1
    count: np.ndarray | None = field(default=None, repr=False)  # int32[rows]: its samples

    @property
    def generated(self) -> int:
        return self.rows - self.reused

    def line(self) -> str:
        line = (f"reuse: {self.reused} of {self.rows} rows reusable from {self.source}; "
                f"{self.generated} to generate")
        if self.why_none:
            return f"{line} ({self.why_none})"
        extra = [f"{self.failed} of them failed before" if self.failed else "",
                 f"{self.dropped} earlier rows no longer asked for (removed or changed)"
                 if self.dropped else ""]
        return line + "".join(f"; {e}" for e in extra if e) + steps_carried(self.record())

    def record(self) -> dict:
        return {"source": self.source, "rows": self.rows, "reused": self.reused,
                "generated": self.generated, "dropped": self.dropped, "failed": self.failed,
                "why_none": self.why_none, "from_step": self.from_step,
                "from_step_name": self.from_step_name}


def steps_carried(reuse: dict) -> str:
    """What of a job of steps' rows was carried over, when not the whole rows: words to add
    to a line about the rows reused."""
    if reuse.get("from_step") is None:
        return ""
    name = reuse.get("from_step_name")
    return (f" (the steps before {name!r}: {name!r} and the steps after it run for every row)"
            if name else " (their first steps' columns)")


def reuse_source(config) -> Location | None:
    """The earlier output a run reuses: output.reuse_from, or with output.reuse the output
    itself where it is complete. None: nothing to reuse (a first run)."""
    if config.output.reuse_from:
        source = Location.of(config.output.reuse_from)
        if not source.exists():
            raise OutputError(f"output.reuse_from {str(source)!r}: no such output")
        return source
    if not config.output.reuse:
        return None
    out = Location.of(config.output.path)
    record = OutputStore(out).read_record() or {}
    # an unfinished run's own staging is resumed, the output it replaces is still whole
    if out.exists() and record.get("state") in ("complete", "running", "committing"):
        return out
    return None


def plan_reuse(plan, source: Location) -> ReusePlan:
    """Find the new table's requests among the earlier output's (``plan``: a JobPlan)."""
    files, why = earlier_files(source)
    footers = [_footer(file) for file in files]
    keyed = [(file, footer) for file, footer in zip(files, footers)
             if columns.REQUEST_KEY in footer.names]
    result = ReusePlan(source=str(source), rows=plan.input.num_rows,
                       files=[file for file, _ in keyed])
    if why is not None or not keyed:
        result.why_none = why or ("the earlier output has no request_key column: it was "
                                  "written before overnight kept one")
        return result
    spec = plan.request_key
    ours = json.loads(spec.parts)
    # each file's job: the settings its rows were keyed by (its first part's: a file of a
    # --retry-errors run holds rows of both runs' settings, each with its own key)
    settings = [footer.job.get("request_key") for _, footer in keyed]
    theirs = next((s for s in settings if s == ours), settings[0])
    rekey = None  # the earlier rows' keys: their request_key column
    why = None
    if spec.step_columns:  # a job of steps: its first steps may be all that is unchanged
        k, why = _unchanged_steps(theirs, ours)
        if k is not None and (k < len(ours["steps"]) or k < len(theirs["steps"])):
            result.from_step = k
            result.from_step_name = ours["steps"][k]["name"] if k < len(ours["steps"]) else None
            spec = rekey = spec.first_steps(k)  # keyed again, by those steps alone
    if rekey is not None and why is None:
        names = set(keyed[0][1].names)
        missing = [c for c in rekey.columns
                   if (c if c != columns.ORDINAL else columns.ROW_ID) not in names]
        if missing:
            why = f"the earlier output has no column {missing[0]!r}"
    earlier_rows = sum(footer.rows for _, footer in keyed)
    if why is not None:  # every key differs
        result.why_none = why
        result.earlier_rows = result.dropped = earlier_rows  # (rows, not input rows: about)
        return result
    # (settings that differ in every file: no key can be the same; the rows are looked up
    # all the same, each by its own key, and the line says what changed)
    with tempfile.TemporaryDirectory(prefix="overnight-reuse-") as spill:
        slices = max(1, -(-max(plan.input.num_rows, earlier_rows) // SLICE_ROWS))
        new = _Spill(spill, "new", slices)
        _spill_new(plan, spec, new)
        old = _Spill(spill, "old", slices)
        result.file_rows = _spill_old(keyed, old, rekey, plan.config.input.id_column)
        result.earlier_rows = old.rows
        # 5 bytes a new row where they fit (the earlier output under 2^31 rows, a row's
        # samples under 256): the driver's one array the size of the table
        result.at = np.full(plan.input.num_rows, -1,
                            np.int32 if result.file_rows[-1] < 2**31 - 1 else np.int64)
        result.count = np.zeros(plan.input.num_rows, np.min_scalar_type(max(old.most, 1)))
        for i in range(slices):
            _join(new.read(i), old.read(i), result)
    result.reused = int((result.at >= 0).sum())
    if result.reused == 0 and result.why_none is None:
        other = settings[0] if ours not in settings and rekey is None else None
        result.why_none = (changed_settings(other, ours) if other
                           else "no row's request is the same")
    return result


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


def carry_over(plan, source: Location, layout, done: set[int]) -> tuple[dict, dict, str]:
    """``plan_reuse`` then ``stage_reused``: what was found (its record, and its line), and
    what was staged."""
    found = plan_reuse(plan, source)
    return found.record(), stage_reused(plan, found, layout, done), found.line()


def carry_over_on_ray(plan, source: Location, layout, done: set[int]) -> tuple[dict, dict, str]:
    """``carry_over`` in a Ray task on this node (where the staging folder and the local spill
    are), its memory apart from the driver's. A JobError in it is raised here as it was."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(carry_over).options(num_cpus=1, max_retries=0, scheduling_strategy=here)
    try:
        return ray.get(task.remote(plan, source, layout, done))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, JobError):
            raise cause from None
        raise


def _unchanged_steps(theirs: dict | None, ours: dict) -> tuple[int | None, str | None]:
    """A job of steps: how many of its first steps the earlier job had the same, all its
    other settings the same too; or why none of its rows can be carried over."""
    if theirs is None or "steps" not in theirs:
        return None, "the earlier output is not of a job of steps"
    rest = lambda parts: {k: v for k, v in parts.items() if k != "steps"}  # noqa: E731
    if rest(theirs) != rest(ours):
        return None, changed_settings(rest(theirs), rest(ours))
    k = 0
    while k < min(len(theirs["steps"]), len(ours["steps"])) and \
            theirs["steps"][k] == ours["steps"][k]:
        k += 1
    if k == 0:
        return None, f"steps[0] ({ours['steps'][0]['name']}) changed"
    later = theirs["steps"][k:]
    dropping = next((s for s in later if s.get("where") is not None or s.get("explode") or
                     (s.get("prompt") or {}).get("on_too_long") == "skip"), None)
    if dropping is not None and not (theirs.get("output") or {}).get("keep_dropped"):
        # a row its later step dropped is not in the earlier output at all
        changed = ours["steps"][k]["name"] if k < len(ours["steps"]) else "the steps after"
        return None, (f"steps[{k}] ({changed}) changed, and the earlier job's step "
                      f"{dropping['name']!r} after it drops rows, which its output does "
                      "not hold (output.keep_dropped: true keeps them for a next run)")
    return k, None


@dataclass
class _Footer:
    """What an earlier file's footer says: its columns, rows and the job that wrote it."""

    names: list[str]
    rows: int
    job: dict


def _footer(file: Location) -> _Footer:
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
    return _Footer(schema.names, rows, job if isinstance(job, dict) else {})


class _Spill:
    """Keys spilled to local files by their leading bits: each slice joins in memory."""

    DTYPE = {"new": np.dtype([("high", "<u8"), ("low", "<u8"), ("row", "<i8")]),
             "old": np.dtype([("high", "<u8"), ("low", "<u8"), ("row", "<i8"),
                              ("count", "<i4"), ("ok", "?")])}

    def __init__(self, folder: str, side: str, slices: int):
        self.dtype = self.DTYPE[side]
        self.paths = [os.path.join(folder, f"{side}-{i}.bin") for i in range(slices)]
        self.slices = slices
        self.rows = 0
        self.most = 0  # the old side's: the most rows an input row had (its samples)

    def add(self, records: np.ndarray) -> None:
        self.rows += len(records)
        if "count" in records.dtype.names and len(records):
            self.most = max(self.most, int(records["count"].max()))
        which = (records["high"] % np.uint64(self.slices)).astype(np.int64)
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange(1, self.slices))
        for i, rows in enumerate(np.split(order, cuts)):
            if len(rows):
                with open(self.paths[i], "ab") as handle:
                    handle.write(records[rows].tobytes())

    def read(self, i: int) -> np.ndarray:
        if not os.path.exists(self.paths[i]):
            return np.empty(0, self.dtype)
        data = np.fromfile(self.paths[i], self.dtype)
        os.remove(self.paths[i])
        return data


def _spill_new(plan, spec: KeySpec, spill: _Spill) -> None:
    from pipelines.read import read_unit, read_units

    for unit in read_units(plan.input.blocks):
        for block in read_unit(unit, plan.input.schema):
            high, low = request_words(block, spec)
            records = np.empty(block.num_rows, spill.dtype)
            records["high"], records["low"] = high, low
            records["row"] = block.column(columns.ORDINAL).to_numpy()
            spill.add(records)


def _spill_old(keyed: list, spill: _Spill, rekey: KeySpec | None = None,
               id_column: str | None = None) -> np.ndarray:
    """Each earlier input row (its run of rows: its samples, or a job of steps' fan-out): its
    key, first row (across the files), rows, and whether all of them succeeded. Returns each
    file's first row, and the rows in all, last. ``keyed``: (file, its _Footer) each;
    ``rekey``: the rows keyed again by it, from their own values, not read from their
    request_key; ``id_column``: this job's, where a file's job does not say its own."""
    starts = [0]
    for file, footer in keyed:
        names = footer.names
        same = _id_column(footer, id_column)
        wanted = [columns.REQUEST_KEY, columns.ERROR,
                  *([columns.SAMPLE_INDEX] if columns.SAMPLE_INDEX in names else []),
                  *([same] if same is not None else [])]
        if rekey is not None:
            wanted += [c if c != columns.ORDINAL else columns.ROW_ID for c in rekey.columns]
        with file.open() as handle:
            table = pq.ParquetFile(handle).read(columns=list(dict.fromkeys(wanted)))
        n = table.num_rows
        if n:
            if rekey is None:
                high, low, valid = key_words(table.column(columns.REQUEST_KEY))
            else:
                if columns.ORDINAL in rekey.columns:  # a seed by the row's position then
                    table = table.append_column(columns.ORDINAL, table.column(columns.ROW_ID))
                high, low = request_words(table, rekey)
                valid = table.column(columns.REQUEST_KEY).is_valid().to_numpy(
                    zero_copy_only=False)
            firsts = np.flatnonzero(_input_rows(table, high, low, same,
                                                "steps" in (footer.job.get("request_key")
                                                            or {})))
            failed = table.column(columns.ERROR).is_valid().to_numpy(zero_copy_only=False)
            failed |= ~valid
            records = np.empty(len(firsts), spill.dtype)
            records["high"], records["low"] = high[firsts], low[firsts]
            records["row"] = firsts + starts[-1]
            records["count"] = np.diff(np.append(firsts, n))
            records["ok"] = np.add.reduceat(failed.astype(np.int32), firsts) == 0
            spill.add(records)
        starts.append(starts[-1] + n)
    return np.asarray(starts, np.int64)


def _id_column(footer: _Footer, id_column: str | None) -> str | None:
    """The earlier file's column that names its input rows: row_id, or its job's id column
    (its metadata says; else this job's), where the file has it."""
    for name in (columns.ROW_ID, footer.job.get("id_column"), id_column):
        if name is not None and name in footer.names:
            return name
    return None


def _input_rows(table: pa.Table, high: np.ndarray, low: np.ndarray, same: str | None,
                steps: bool) -> np.ndarray:
    """Where each earlier input row's rows start (a bool a row). Two neighbouring input rows
    may ask for one request (a greedy job's duplicate texts under two ids): they are told
    apart by their ids, and by sample_index, never by their keys alone. A one-prompt job's
    input row is its samples (sample_index from 0), or one row; a job of steps', its rows of
    one id."""
    n = table.num_rows
    new_run = np.ones(n, bool)
    new_run[1:] = (high[1:] != high[:-1]) | (low[1:] != low[:-1])
    if not steps:
        if columns.SAMPLE_INDEX in table.column_names:
            new_run |= pc.fill_null(pc.equal(table.column(columns.SAMPLE_INDEX), 0),
                                    True).to_numpy(zero_copy_only=False)
        else:
            new_run[:] = True
    if same is not None:
        ids = table.column(same).combine_chunks()
        new_run[1:] |= ~pc.fill_null(pc.equal(ids[1:], ids[:-1]), False).to_numpy(
            zero_copy_only=False)
    return new_run


def _join(new: np.ndarray, old: np.ndarray, result: ReusePlan) -> None:
    """One slice: each new row's earlier input row, matched by (key, occurrence): the k-th new
    row with a key (in the new table's order) takes the k-th earlier input row with it (in
    the earlier output's order), so each earlier row is carried over once at most and two new
    rows never share one. Rows share a key where their requests are the same (a greedy
    job's duplicate texts): which of the earlier ones a new row takes changes nothing but
    which ids they came from."""
    if len(old) == 0:
        return
    old = old[np.lexsort((old["row"], old["low"], old["high"]))]
    new = new[np.lexsort((new["row"], new["low"], new["high"]))]
    high = np.concatenate([old["high"], new["high"]])
    low = np.concatenate([old["low"], new["low"]])
    occurrence = np.concatenate([_occurrences(old), _occurrences(new)])
    side = np.repeat(np.array([0, 1], np.int8), [len(old), len(new)])
    order = np.lexsort((side, occurrence, low, high))
    # an earlier row directly followed by a new one of the same (key, occurrence): a match
    h, lo, occ, sd = high[order], low[order], occurrence[order], side[order]
    pair = ((h[:-1] == h[1:]) & (lo[:-1] == lo[1:]) & (occ[:-1] == occ[1:])
            & (sd[:-1] == 0) & (sd[1:] == 1))
    earlier, later = order[:-1][pair], order[1:][pair] - len(old)
    # earlier rows the new table asks for again: not dropped
    result.dropped += len(old) - len(earlier)
    ok = old["ok"][earlier]
    result.failed += int((~ok).sum())
    rows = new["row"][later][ok]
    result.at[rows] = old["row"][earlier][ok]
    result.count[rows] = old["count"][earlier][ok]


def _occurrences(records: np.ndarray) -> np.ndarray:
    """For records sorted by key: each one's place among those with its key (0, 1, ...)."""
    n = len(records)
    if n == 0:
        return np.zeros(0, np.int64)
    first = np.ones(n, bool)
    first[1:] = (records["high"][1:] != records["high"][:-1]) | \
        (records["low"][1:] != records["low"][:-1])
    starts = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    return np.arange(n) - starts


def stage_reused(plan, reuse: ReusePlan, layout, done: set[int]) -> dict:
    """Write the rows ``reuse`` found as parts in staging: each earlier output file read once
    (the columns the job generates), its rows sorted into the new table's order through
    local files a bucket of blocks apart, then beside the new table's own values. Returns
    the tokens carried over, not generated again."""
    from pipelines.read import read_unit, read_units
    from pipelines.write import PartWriter
    from pipelines.write.writers import runs

    writer = PartWriter(layout)
    steps = plan.config.steps
    if reuse.from_step is not None:  # a job of steps: its first steps' columns, as states
        thinking = plan.config.model.reasoning_parser is not None
        carried = [c for step in steps[:reuse.from_step] for c in step.added_columns(thinking)]
        carried += [columns.DROPPED_BY] * plan.config.output.keep_dropped
    else:
        carried = [c for c in layout.added_columns
                   if c not in (columns.ROW_ID, columns.REQUEST_KEY)]
    buckets = _buckets([b for b in plan.input.blocks if b.ordinal not in done])
    starts = np.asarray([bucket[0].ordinal for bucket in buckets], np.int64)
    ends = np.asarray([bucket[-1].ordinal + bucket[-1].num_rows for bucket in buckets],
                      np.int64)
    saved = {"prompt_tokens": 0, "completion_tokens": 0, "rows": 0}
    if not buckets or not reuse.reused:  # (nothing found: no lookup was made at all)
        return saved
    with tempfile.TemporaryDirectory(prefix="overnight-reuse-") as spill:
        held: dict[int, list[str]] = {}
        for f, file in enumerate(reuse.files):
            lo, hi = reuse.file_rows[f], reuse.file_rows[f + 1]
            rows = np.flatnonzero((reuse.at >= lo) & (reuse.at < hi))
            bucket = np.searchsorted(starts, rows, side="right") - 1
            keep = (bucket >= 0) & (rows < ends[np.maximum(bucket, 0)])
            rows, bucket = rows[keep], bucket[keep]
            if not len(rows):
                continue
            with file.open() as handle:
                table = pq.read_table(handle, columns=carried)
            samples = reuse.count[rows]
            first = np.repeat(np.cumsum(samples) - samples, samples)
            take = np.repeat(reuse.at[rows] - lo, samples) + np.arange(samples.sum()) - first
            piece = table.take(pa.array(take, pa.int64())).append_column(
                columns.ORDINAL, pa.array(np.repeat(rows, samples), pa.int64()))
            of = np.repeat(bucket, samples)
            for b in np.unique(of):
                name = os.path.join(spill, f"{b}-{f}.parquet")
                pq.write_table(piece.filter(pa.array(of == b)), name)
                held.setdefault(int(b), []).append(name)
            del table, piece
        for b, blocks in enumerate(buckets):
            if b not in held:
                continue
            found = pa.concat_tables([pq.read_table(n) for n in held.pop(b)],
                                     promote_options="permissive")
            # (a stable sort: each row's samples stay in sample order)
            found = found.take(pc.sort_indices(found, [(columns.ORDINAL, "ascending")]))
            if reuse.from_step is not None:
                saved["rows"] += _stage_states(found, blocks, steps[:reuse.from_step], layout)
                for name, tokens in _step_tokens(found, steps[:reuse.from_step]).items():
                    saved[name] += tokens
                continue
            ordinals = found.column(columns.ORDINAL).to_numpy()
            source = pa.concat_tables([t for unit in read_units(blocks)
                                       for t in read_unit(unit, plan.input.schema)])
            rows = source.take(pa.array(ordinals - blocks[0].ordinal, pa.int64()))
            del source
            for name in carried:
                rows = rows.append_column(name, found.column(name))
            for run in _whole_blocks_joined(runs(rows.column(columns.ORDINAL),
                                                  layout.block_starts), ordinals, layout):
                # (a job of steps' part: its input rows by its name, a row its filter
                # dropped is not in it)
                whole = len(run) == rows.num_rows  # (an unchanged table's bucket: no copy)
                record = writer._write_run(rows if whole else rows.take(run),
                                           [] if steps else None)
                saved["rows"] += record["input_rows"]
                if not steps:
                    saved["prompt_tokens"] += record["prompt_tokens"]
                    saved["completion_tokens"] += record["completion_tokens"]
            if steps:
                for name, tokens in _step_tokens(found, steps).items():
                    saved[name] += tokens
            del found, rows
    return saved


def _stage_states(found: pa.Table, blocks: list, steps: list, layout) -> int:
    """A job of steps run again from a changed step: each found row's state after the steps
    before it (one per fan-out of those steps: the first of its earlier rows), a file a block
    in staging, which the block's run starts from (udfs/stages/steps.py). Returns the input rows."""
    import polars as pl

    from udfs.stages.steps import STATES  # (hidden: not a part; the commit clears it)

    index = [columns.step_column(s.output_column, "index") for s in steps
             if s.output_column is not None and (s.explode or s.sampling.n > 1)]
    frame = pl.from_arrow(found).unique([columns.ORDINAL, *index], keep="first",
                                        maintain_order=True)
    if columns.DROPPED_BY in frame.columns:  # dropped by a later step: not by these
        frame = frame.with_columns(pl.when(pl.col(columns.DROPPED_BY).is_in(
            [s.name for s in steps])).then(pl.col(columns.DROPPED_BY)).alias(columns.DROPPED_BY))
    states = frame.to_arrow().cast(found.schema)  # (polars' strings are large ones)
    ordinals = states.column(columns.ORDINAL).to_numpy()
    staging = Location.of(layout.staging)
    for block in blocks:
        inside = (ordinals >= block.ordinal) & (ordinals < block.ordinal + block.num_rows)
        if inside.any():
            part = states.filter(pa.array(inside))
            (staging / STATES.format(block.ordinal)).write(lambda tmp: pq.write_table(part, tmp))
    return len(np.unique(ordinals))


def _step_tokens(found: pa.Table, steps: list) -> dict:
    """A job of steps' rows carried over: the tokens each step generated for them, each
    generation once (a fan-out's later steps repeat an earlier step's columns)."""
    import polars as pl

    frame = pl.from_arrow(found)
    out, index = {"prompt_tokens": 0, "completion_tokens": 0}, []
    for step in steps:
        c = step.output_column
        if c is None:
            continue
        if step.explode or step.sampling.n > 1:
            index.append(columns.step_column(c, "index"))
        once = frame.unique([columns.ORDINAL, *index], keep="first")
        for total in out:
            out[total] += int(once[columns.step_column(c, total)].fill_null(0).sum())
    return out


def _whole_blocks_joined(runs: list, ordinals: np.ndarray, layout) -> list:
    """Runs of rows (each inside one block) with consecutive whole blocks joined into one:
    a part of many blocks starts and ends where blocks do, so the compaction still cuts files
    at block starts (pipelines/write/compact.py), and an unchanged table is a few large parts."""
    out, joinable, starts = [], False, set(layout.block_starts)
    for run in runs:
        first, last = int(ordinals[run[0].as_py()]), int(ordinals[run[-1].as_py()])
        whole = first in starts and last + 1 == layout.block_end(first)
        if whole and joinable and int(ordinals[out[-1][-1].as_py()]) + 1 == first:
            out[-1] = pa.concat_arrays([out[-1], run])
        else:
            out.append(run)
        joinable = whole
    return out


def _buckets(blocks: list) -> list[list]:
    """Runs of consecutive blocks of about BUCKET_ROWS rows."""
    out, rows = [], 0
    for block in blocks:
        if out and rows + block.num_rows <= BUCKET_ROWS and \
                out[-1][-1].ordinal + out[-1][-1].num_rows == block.ordinal:
            out[-1].append(block)
            rows += block.num_rows
        else:
            out.append([block])
            rows = block.num_rows
    return out
