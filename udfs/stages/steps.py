"""A job of several steps (``steps:`` in the config): generate, judge, filter, on one engine.

``StepsPredictor`` is the engine's ``map_batches`` callable for such a job, in place of the
``Predictor``: one engine per replica, and every step of a block run on it, in order, before
the block goes on to be written. Several blocks are in flight in each actor (threads), each at
its own step, so the engine's running batch mixes the steps' requests and stays full, and a
row goes on to its next step as soon as its block's step is done, not after the whole table.

A step is one of:
- a generation: its prompt rendered from the row (the source columns and earlier steps'
  columns, a structured step's fields as ``{{ judge.score }}``), generated as a one-step job's
  would be (``Predictor``, sharing this replica's engine), its structured output parsed
  (``OutputParser``); ``sampling.n`` > 1 or ``explode`` (a JSON array, one row per element)
  turn one row into several;
- a filter: ``where``, a polars SQL expression (udfs/stages/where.py); a row for which it
  does not hold is dropped there and goes no further (as does a row a step skipped:
  ``prompt.on_too_long: skip``).

A step may have both: the filter first, then the generation on the rows that pass.

A row that fails at a step (its prompt too long, the engine refused it, its output did not
parse) goes no further either, but is kept, with its error: ``error`` says which step.
Dropped rows stay in the block, marked (``columns.DROPPED``), so that the writer names each
part by the input rows it covers and a resumed job knows those rows are done; it writes them
only with ``output.keep_dropped``.

Each step's columns are named after its output column C (udfs/columns.py): C, then
C_finish_reason, C_prompt_tokens, C_completion_tokens; with a JSON Schema C holds the parsed
value and C_text the raw text; with fan-out C_index numbers a row's rows; with a reasoning
parser (a thinking model) C is the answer, C_reasoning the thinking and C_reasoning_tokens its
tokens, and a row whose thinking used the step's budget is that step's ``no_answer`` error.
The job-level columns hold each row's totals. Every request's seed derives from the job's
seed, the step and the row's place in the fan-out, so a resumed or re-run job generates the
same rows. A re-run that reuses an earlier output whose first steps are unchanged
(pipelines/reuse/staging.py) hands a block's rows their state after those steps (``STATES``): such a
row goes on from the first changed step, with the seed keys and totals those steps left.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from udfs import columns
from udfs.columns import ErrorKind, FinishReason
from udfs.engines.engine import EngineSpec
from udfs.rows.parsers import OutputParser, StructuredSpec
from udfs.stages.memory import release_free_memory
from udfs.stages.predictor import Predictor, SamplingSpec
from udfs.stages.prompts import RenderSpec
from udfs.stages.where import where_mask

# Internal columns of a block between steps
_SEQ = "__overnight_step_seq"  # the row's position in the block before the step
KEY = "__overnight_step_key"  # the row's seed key at this step: step, input row, fan-out path
PARSED = "__overnight_step_parsed"  # a structured step's parsed value, before it is renamed
_KIND, _ERROR = "__overnight_step_error_kind", "__overnight_step_error"
_FINISH = "__overnight_step_finish"
_PROMPT, _COMPLETION = "__overnight_step_prompt_tokens", "__overnight_step_completion_tokens"
_REASONING = "__overnight_step_reasoning_tokens"
_DROPPED_BY = "__overnight_step_dropped_by"
_TOTALS = (_KIND, _ERROR, _FINISH, _PROMPT, _COMPLETION, _REASONING, _DROPPED_BY)


@dataclass(frozen=True)
class StepSpec:
    """One step, as pre-flight planned it (pipelines/plan/steps.py); picklable."""

    name: str
    column: str | None = None  # None: a filter step
    where: str | None = None
    render: RenderSpec | None = None
    sampling: SamplingSpec | None = None  # its key_column is KEY
    structured: StructuredSpec | None = None
    explode: bool = False
    fan_out: bool = False  # adds C_index (explode, or n > 1)


class StepsPredictor:
    """``map_batches`` callable class: one engine, every step of a block in turn."""

    def __init__(self, engine: EngineSpec, steps: tuple[StepSpec, ...], key_column: str,
                 keep_dropped: bool = False, health: str | None = None,
                 stall_timeout_s: float | None = None, states: str | None = None,
                 from_step: int = 0, block_starts: tuple[int, ...] = ()):
        self.steps = steps
        self.key_column = key_column
        self.keep_dropped = keep_dropped
        # a re-run reusing an earlier output's first steps (pipelines/reuse/staging.py): the folder of
        # the blocks' carried rows (STATES, a file a block, named by the block's first row),
        # and the step they go on from
        self.states, self.from_step, self.block_starts = states, from_step, list(block_starts)
        first = next(s for s in steps if s.render is not None)
        # the first generating step builds the engine; the others share it (and its render
        # lock, recovery and replica label)
        self.runners: dict[str, Predictor] = {}
        base = None
        for step in steps:
            if step.render is None:
                continue
            if base is None:
                base = Predictor(engine, step.sampling, step.column, render=first.render,
                                 health=health, stall_timeout_s=stall_timeout_s)
                self.runners[step.name] = base
            else:
                self.runners[step.name] = base.sharing(step.sampling, step.column, step.render)
        self.base = base
        self.parsers = {s.name: OutputParser(s.structured, s.column)
                        for s in steps if s.structured is not None}

    def __call__(self, batch: pa.Table) -> pa.Table:
        block = (batch.column(columns.ORDINAL)[0].as_py()
                 if batch.num_rows and columns.ORDINAL in batch.column_names else -1)
        carried = self._carried(batch)
        if carried is None:
            state, counts = self._run(self._start(batch), 0, block)
        else:  # rows whose first steps an earlier output holds: on from the step after them
            ordinals = carried.column(columns.ORDINAL).to_numpy()
            fresh = ~pc.is_in(batch.column(columns.ORDINAL), pa.array(ordinals)).to_numpy(
                zero_copy_only=False)
            state, counts = self._run(self._start(batch.filter(pa.array(fresh))), 0, block)
            later, more = self._run(self._resumed(batch, carried), self.from_step, block)
            counts = [_add_counts(a, b) for a, b in zip(counts, [None] * self.from_step + more)]
            later = later.select(state.column_names)
            state = pa.concat_tables([state, later], promote_options="permissive")
            state = state.take(pc.sort_indices(state, [(columns.ORDINAL, "ascending")]))
        release_free_memory()
        return self._finish(state, counts)

    def _start(self, batch: pa.Table) -> pa.Table:
        """The block's rows before the first step: their seed keys, no error, no tokens."""
        state = batch.append_column(KEY, pa.array(
            [json.dumps(k, default=str) for k in batch.column(self.key_column).to_pylist()],
            pa.string()))
        n = state.num_rows
        for name, type_ in ((_KIND, pa.string()), (_ERROR, pa.string()),
                            (_FINISH, pa.string()), (_DROPPED_BY, pa.string())):
            state = state.append_column(name, pa.nulls(n, type_))
        for name in (_PROMPT, _COMPLETION, _REASONING):
            state = state.append_column(name, pa.array([0] * n, pa.int64()))
        return state

    def _run(self, state: pa.Table, first: int, block: int) -> tuple[pa.Table, list[dict]]:
        """The steps from ``first`` on, in turn; with each step's counts."""
        counts = []
        for step in self.steps[first:]:
            started = time.time()
            state, count = self._step(step, state, block)
            counts.append({"name": step.name, **count,
                           "seconds": round(time.time() - started, 3)})
        return state, counts

    def _carried(self, batch: pa.Table) -> pa.Table | None:
        """The batch's rows' states an earlier output held (their first steps' columns, a
        row for each of their fan-out), from the block's file; None: none."""
        if self.states is None or batch.num_rows == 0:
            return None
        ordinals = batch.column(columns.ORDINAL)
        start = pc.min(ordinals).as_py()
        table = _read_states(self.states, start, self.block_starts)
        if table is None:
            return None
        table = table.filter(pc.is_in(table.column(columns.ORDINAL), ordinals.combine_chunks()
                                      if isinstance(ordinals, pa.ChunkedArray) else ordinals))
        return table if table.num_rows else None

    def _resumed(self, batch: pa.Table, carried: pa.Table) -> pa.Table:
        """The carried rows as they would stand after the steps before ``from_step``: their
        source values, those steps' columns, seed keys and totals as those steps left them."""
        at = {o: i for i, o in enumerate(batch.column(columns.ORDINAL).to_pylist())}
        rows = batch.take(pa.array([at[o] for o in carried.column(columns.ORDINAL).to_pylist()],
                                   pa.int64()))
        state = self._start(rows)
        for name in carried.column_names:
            if name not in (columns.ORDINAL, columns.DROPPED_BY):
                state = state.append_column(name, carried.column(name))
        if columns.DROPPED_BY in carried.column_names:  # dropped by one of those steps
            state = _replace(state, _DROPPED_BY, carried.column(columns.DROPPED_BY))
        key = state.column(KEY)
        finish = None
        for step in self.steps[:self.from_step]:
            if step.column is None:
                continue
            key = pc.binary_join_element_wise(pa.scalar(step.name), key, "/")
            if step.fan_out:
                index = pc.fill_null(state.column(columns.step_column(step.column, "index")), 0)
                key = pc.binary_join_element_wise(key, pc.cast(index, pa.string()), "#")
            for total, own in ((_PROMPT, columns.PROMPT_TOKENS),
                               (_COMPLETION, columns.COMPLETION_TOKENS),
                               (_REASONING, columns.REASONING_TOKENS)):
                name = columns.step_column(step.column, own)
                if name in state.column_names:
                    state = _replace(state, total, pc.add(state.column(total),
                                                          pc.fill_null(state.column(name), 0)))
            finish = state.column(columns.step_column(step.column, columns.FINISH_REASON))
        state = _replace(state, KEY, key)
        return _replace(state, _FINISH, finish) if finish is not None else state

    def _step(self, step: StepSpec, state: pa.Table, block: int) -> tuple[pa.Table, dict]:
        live = [i for i, (kind, dropped) in enumerate(zip(
            state.column(_KIND).to_pylist(), state.column(_DROPPED_BY).to_pylist()))
            if kind is None and dropped is None]
        count = {"rows_in": len(live), "dropped": 0, "errors": 0, "rows_out": len(live),
                 "prompt_tokens": 0, "completion_tokens": 0}
        failed: dict[int, str] = {}
        if step.where is not None and live:
            keep, failed = where_mask(_public(_take(state, live)), step.where)
            # a row the filter cannot be evaluated on is kept, with its error
            unfit = [live[k] for k in failed]
            state = _set(state, _KIND, unfit, ErrorKind.FILTER)
            state = _set_each(state, _ERROR, unfit, [
                f"step {step.name}: where {step.where!r} cannot be evaluated on this row: "
                f"{why}" for why in failed.values()])
            dropped = [i for k, (i, ok) in enumerate(zip(live, keep))
                       if not ok and k not in failed]
            state = _set(state, _DROPPED_BY, dropped, step.name)
            live = [i for i, ok in zip(live, keep) if ok]
            count["dropped"], count["errors"] = len(dropped), len(failed)
        if step.column is None:  # a filter step
            count["rows_out"] = len(live)
            return state, count
        state = state.append_column(_SEQ, pa.array(range(state.num_rows), pa.int64()))
        done = self._generate(step, _take(state, live), block)
        added = [c for c in done.column_names if c not in state.column_names]
        running = set(live)
        rest = [i for i in range(state.num_rows) if i not in running]
        idle = _take(state, rest)
        for name in added:
            idle = idle.append_column(name, pa.nulls(idle.num_rows, done.schema.field(name).type))
        merged = pa.concat_tables([done.select(idle.column_names), idle])
        order = pc.sort_indices(merged.column(_SEQ))  # a stable sort: fan-out stays in order
        merged = merged.take(order)
        if step.fan_out:  # C_index: a row's place among its rows; null where it did not run
            # or the step dropped it (an empty array exploded, a prompt skipped): no element
            ran = pa.concat_arrays([pc.is_null(done.column(_DROPPED_BY)).combine_chunks(),
                                    pa.array([False] * idle.num_rows, pa.bool_())]
                                   ).take(order)
            index = pc.if_else(ran, _positions(merged.column(_SEQ)), pa.scalar(None, pa.int32()))
            merged = merged.append_column(columns.step_column(step.column, "index"), index)
            # each of a row's new rows seeds its next steps apart
            merged = _replace(merged, KEY, pc.binary_join_element_wise(
                merged.column(KEY), pc.cast(pc.fill_null(merged.column(columns.step_column(
                    step.column, "index")), 0), pa.string()), "#"))
        merged = merged.drop_columns([_SEQ])
        done_counts = _done_counts(done, step)
        count["dropped"] += done_counts.pop("dropped")
        count["errors"] += done_counts.pop("errors")
        count.update(done_counts)
        return merged, count

    def _generate(self, step: StepSpec, rows: pa.Table, block: int) -> pa.Table:
        """The step run on its live rows; each of the rows it returns (more than one per row
        with fan-out) with the step's columns, its totals updated and a key of its own."""
        c = step.column
        rows = _replace(rows, KEY, pc.binary_join_element_wise(
            pa.array([step.name] * rows.num_rows, pa.string()), rows.column(KEY), "/"))
        if rows.num_rows == 0:
            out = rows
            for name, type_ in step_types(step, index=False).items():
                out = out.append_column(name, pa.nulls(0, type_))
            return out
        runner = self.runners[step.name]
        out = runner(rows, key=f"{block}/{step.name}")
        if step.name in self.parsers:
            out = self.parsers[step.name](out)
        meta = {m: columns.step_column(c, m) for m in columns.STEP_META}
        thinking = step.sampling.reasoning_column is not None
        if thinking:  # the step's thinking is already in C_reasoning; its tokens are its own
            meta[columns.REASONING_TOKENS] = columns.step_column(c, columns.REASONING_TOKENS)
        kinds = out.column(columns.ERROR_KIND).to_pylist()
        errors = out.column(columns.ERROR).to_pylist()
        if step.structured is not None and step.structured.json_schema is not None:
            out = out.rename_columns([columns.step_column(c, "text") if n == c
                                      else c if n == step.structured.parsed_column else n
                                      for n in out.column_names])
        skipped = [i for i, reason in enumerate(out.column(columns.FINISH_REASON).to_pylist())
                   if reason == FinishReason.SKIPPED]
        # prompt.on_too_long: skip: not generated, no error; such a row goes no further
        out = _set(out, _DROPPED_BY, skipped, step.name)
        if step.explode:
            out, kinds, errors = _explode(out, c, kinds, errors, step.name)
        if columns.SAMPLE_INDEX in out.column_names:  # n > 1: C_index numbers them instead
            out = out.drop_columns([columns.SAMPLE_INDEX, columns.SAMPLES])
        # the row's totals: its error (a step runs only rows without one: the first, naming
        # its step), tokens summed, the last finish
        out = _replace(out, _KIND, pa.array(kinds, pa.string()))
        out = _replace(out, _ERROR, pa.array(
            [None if e is None else f"step {step.name}: {e}" for e in errors], pa.string()))
        out = _replace(out, _FINISH, out.column(columns.FINISH_REASON))
        for total, own in ((_PROMPT, columns.PROMPT_TOKENS),
                           (_COMPLETION, columns.COMPLETION_TOKENS),
                           *((_REASONING, columns.REASONING_TOKENS),) * thinking):
            out = _replace(out, total, pc.add(out.column(total),
                                              pc.fill_null(out.column(own), 0)))
        # (the prefix cache's count is the predictor's per request: a step's is not summed yet)
        out = out.drop_columns([columns.ERROR_KIND, columns.ERROR, columns.REPLICA,
                                columns.READY_AT, columns.DONE_AT, columns.CACHED_TOKENS])
        return out.rename_columns([meta.get(n, n) for n in out.column_names])

    def _finish(self, state: pa.Table, counts: list[dict]) -> pa.Table:
        """The job-level columns from the totals; the steps' counts for the writer."""
        base = self.base
        rows = state.num_rows
        out = state.drop_columns([KEY, *_TOTALS])
        if self.keep_dropped:
            out = out.append_column(columns.DROPPED_BY, state.column(_DROPPED_BY))
        of = lambda value, type_: pa.array([value] * rows, type_)  # noqa: E731
        out = (out
               .append_column(columns.DROPPED, pc.is_valid(state.column(_DROPPED_BY)))
               .append_column(columns.STEP_COUNTS, of(json.dumps(counts), pa.string()))
               .append_column(columns.REPLICA, of(base.replica, pa.string()))
               .append_column(columns.READY_AT, of(base.ready_at, pa.float64()))
               .append_column(columns.DONE_AT, of(time.time(), pa.float64())))
        totals = [(columns.FINISH_REASON, _FINISH), (columns.PROMPT_TOKENS, _PROMPT),
                  (columns.COMPLETION_TOKENS, _COMPLETION)]
        if any(s.sampling is not None and s.sampling.reasoning_column for s in self.steps):
            totals.append((columns.REASONING_TOKENS, _REASONING))  # over the thinking steps
        for name, total in [*totals, (columns.ERROR_KIND, _KIND), (columns.ERROR, _ERROR)]:
            out = out.append_column(name, state.column(total))
        return out

    def close(self) -> None:
        if self.base is not None:
            self.base.close()


def _read_states(folder: str, start: int, starts: list[int]) -> pa.Table | None:
    """The carried rows of the block holding ordinal ``start`` (its file is named by the
    block's first ordinal), or None."""
    import bisect

    import fsspec  # (as pipelines/storage.py reaches an object store; it comes with Ray)
    import pyarrow.parquet as pq

    first = starts[max(bisect.bisect_right(starts, start) - 1, 0)]
    try:
        with fsspec.open(f"{folder.rstrip('/')}/{STATES.format(first)}", "rb") as handle:
            return pq.read_table(handle)
    except FileNotFoundError:
        return None


def _add_counts(a: dict | None, b: dict | None) -> dict:
    """One step's counts over two sets of rows."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] if isinstance(a[k], (int, float)) else a[k] for k in a}


STATES = ".reuse-state-{:012d}.parquet"  # a block's carried rows, in staging (pipelines/reuse/staging.py)


def step_types(step: StepSpec, index: bool = True) -> dict[str, pa.DataType]:
    """The columns a generating step adds, by type (pre-flight checks later steps against
    them; a block where the step ran on no row gets them as nulls)."""
    from udfs.rows.parsers import schema_to_arrow

    c = step.column
    schema = step.structured.json_schema if step.structured is not None else None
    value = pa.string() if schema is None else schema_to_arrow(schema)
    if step.explode:
        value = value.value_type
    types = {c: value}
    if schema is not None:
        types[columns.step_column(c, "text")] = pa.string()
    if index and step.fan_out:
        types[columns.step_column(c, "index")] = pa.int32()
    if step.sampling.reasoning_column is not None:
        types[step.sampling.reasoning_column] = pa.string()
    types.update({columns.step_column(c, columns.FINISH_REASON): pa.string(),
                  columns.step_column(c, columns.PROMPT_TOKENS): pa.int64(),
                  columns.step_column(c, columns.COMPLETION_TOKENS): pa.int64()})
    if step.sampling.reasoning_column is not None:
        types[columns.step_column(c, columns.REASONING_TOKENS)] = pa.int64()
    return types


def _public(table: pa.Table) -> pa.Table:
    """The columns a filter may name: the source's and the steps' (not the internal ones)."""
    return table.select([n for n in table.column_names
                         if not n.startswith(columns.INTERNAL_PREFIX)])


def _take(table: pa.Table, rows: list[int]) -> pa.Table:
    return table.take(pa.array(rows, pa.int64()))  # (typed: an empty list is not)


def _set(table: pa.Table, name: str, rows: list[int], value) -> pa.Table:
    if not rows:
        return table
    values = table.column(name).to_pylist()
    for i in rows:
        values[i] = value
    return _replace(table, name, pa.array(values, table.schema.field(name).type))


def _set_each(table: pa.Table, name: str, rows: list[int], values: list) -> pa.Table:
    if not rows:
        return table
    column = table.column(name).to_pylist()
    for i, value in zip(rows, values):
        column[i] = value
    return _replace(table, name, pa.array(column, table.schema.field(name).type))


def _replace(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def _positions(seq: pa.ChunkedArray) -> pa.Array:
    """Each row's place among the rows of the same ``seq`` (sorted): 0, 1, 2, ..."""
    out, last, k = [], None, 0
    for s in seq.to_pylist():
        k = k + 1 if s == last else 0
        out.append(k)
        last = s
    return pa.array(out, pa.int32())


def _explode(out: pa.Table, column: str, kinds: list, errors: list, step: str):
    """One row per element of each row's array (the step's column); a row whose output did
    not parse stays one row, with its error. A row whose array is empty explodes into no
    rows: it is dropped by the step, as a filter drops a row (kept in the block, marked, its
    value and C_index null; written only with output.keep_dropped, with dropped_by)."""
    values = out.column(column)
    lengths = pc.fill_null(pc.list_value_length(values), 0).to_pylist()
    take, items, new_kinds, new_errors, dropped = [], [], [], [], []
    flat = pc.list_flatten(values).to_pylist() if len(values) else []
    at = 0
    for i, length in enumerate(lengths):
        if length == 0:
            take.append(i)
            items.append(None)
            new_kinds.append(kinds[i])
            new_errors.append(errors[i])
            dropped.append(kinds[i] is None)  # a valid, empty array: nothing to go on with
            continue
        for j in range(length):
            take.append(i)
            items.append(flat[at + j])
            new_kinds.append(kinds[i])
            new_errors.append(errors[i])
            dropped.append(False)
        at += length
    exploded = out.take(pa.array(take, pa.int64()))
    exploded = _replace(exploded, column, pa.array(items, values.type.value_type))
    marks = exploded.column(_DROPPED_BY).to_pylist()
    exploded = _replace(exploded, _DROPPED_BY, pa.array(
        [step if d else m for d, m in zip(dropped, marks)], pa.string()))
    return exploded, new_kinds, new_errors


def _done_counts(done: pa.Table, step: StepSpec) -> dict:
    """A step's counts over the rows it returned."""
    dropped = pc.sum(pc.is_valid(done.column(_DROPPED_BY))).as_py() or 0  # empty arrays
    errors = pc.sum(pc.is_valid(done.column(_KIND))).as_py() or 0  # its rows had none before
    c = step.column
    return {
        "dropped": dropped,
        "errors": errors,
        "rows_out": done.num_rows - dropped - errors,
        "prompt_tokens": pc.sum(done.column(columns.step_column(c, columns.PROMPT_TOKENS))
                                ).as_py() or 0,
        "completion_tokens": pc.sum(done.column(
            columns.step_column(c, columns.COMPLETION_TOKENS))).as_py() or 0,
    }
