"""A job run in head order: the decision, the copy of the input it reads, and its output put
back in input order before the commit.

Rows are grouped before the blocks are cut, not inside a replica: a replica holds a few blocks,
and in a table whose rows sharing a head stand far apart (a document asked ten questions, the
table question by question) those blocks share nothing. So the input is copied in head order
(``.prefix-order-input.parquet`` in the staging folder), each row with its ordinal, and the job
reads the copy: its blocks, parts and resume are places in the copy (``columns.POSITION``), its
rows keep their ordinals (so seeds, row ids and request keys are those of a run in input order),
and consecutive blocks hold consecutive heads, so a head goes to one replica. The parts go to a
folder of their own (``.prefix-order``); once every row is written they are read back, sorted
by ordinal and written to the staging folder as an ordinary run's parts, which the commit then
puts in place. A run stopped at any point resumes: from the head-order parts while their
folder is there, else from the parts in input order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.errors import one_line
from pipelines.order.heads import MIN_HEAD, HeadReader, Heads
from pipelines.read import Block, InputPlan, read_unit, read_units
from pipelines.read.schema import SOURCE_NAME
from pipelines.storage import Location
from pipelines.write import PartLayout, list_parts, part_name, read_part
from pipelines.write.parts import covered_blocks, missing_rows
from udfs import columns

PARTS_FOLDER = ".prefix-order"  # in the staging folder: the parts, named by place in the copy
COPY_NAME = ".prefix-order-input.parquet"  # in the staging folder: the input in head order
# The table is copied and the output sorted in the driver's memory: larger inputs run in input
# order (a table of this size takes seconds to copy; its job, hours)
MAX_INPUT_BYTES = 1 << 30
SAMPLE_ROWS = 4096  # rows read first: a table whose first rows share no head is not read whole
# Grouping pays where it puts this share of the prompt tokens or more next to the head they
# share, beyond what input order does
WORTH = 0.1


@dataclass(frozen=True)
class Found:
    """What the heads say: the share of prompt tokens in heads shared with the row before, in
    input order and in head order."""

    rows: int
    prompt_tokens: int
    shared_in_input_order: int
    shared_in_head_order: int

    @property
    def gain(self) -> float:
        return (self.shared_in_head_order - self.shared_in_input_order) / max(
            self.prompt_tokens, 1)

    def line(self) -> str:
        share = self.shared_in_head_order / max(self.prompt_tokens, 1)
        before = self.shared_in_input_order / max(self.prompt_tokens, 1)
        return (f"{share:.0%} of the prompt tokens are in heads of {MIN_HEAD}+ tokens that "
                f"rows share ({before:.0%} next to each other in input order)")

    def summary(self) -> dict:
        return {"rows": self.rows, "prompt_tokens": self.prompt_tokens,
                "shared_in_input_order": self.shared_in_input_order,
                "shared_in_head_order": self.shared_in_head_order}


def running_parts(staging: Location) -> Location:
    """Where a running job writes its parts: the head-order folder of a run grouped by head
    (its rows still in head order), else the staging folder (``overnight status``, ``view``)."""
    grouped = staging / PARTS_FOLDER
    return grouped if grouped.exists() else staging


def found_in(heads: Heads) -> Found:
    return Found(len(heads.lengths), heads.prompt_tokens, heads.shared_tokens(),
                 heads.shared_tokens(heads.grouped_order()))


def will_group(config, found: Found) -> bool:
    """Whether a job whose heads are ``found`` runs in head order (none of ``why_not``)."""
    if found.shared_in_head_order <= found.shared_in_input_order:
        return False
    return config.resources.group_by_prefix is True or found.gain >= WORTH


def plan_line(config, plan, found: Found) -> str:
    """``overnight validate``'s line: what the heads share, and the order the job will run in."""
    reason = why_not(config, plan, retry_errors=False)
    if reason is None and HeadReader.for_model(plan.render) is None:
        reason = "the model's tokenizer.json is not here to read"
    if reason is None:
        then = ("the job runs them grouped by prompt prefix" if will_group(config, found) else
                "the job runs them in input order (grouping would gain less than "
                f"{WORTH:.0%} of them)")
    else:
        then = f"the job runs them in input order ({reason})"
    return f"prompt heads: {found.line()}; {then}"


def why_not(config, plan, retry_errors: bool) -> str | None:
    """Why this job runs in input order whatever its heads, or None."""
    if config.resources.group_by_prefix is False:
        return "resources.group_by_prefix: false"
    if retry_errors:
        return "--retry-errors runs a few rows"
    if config.steps is not None:
        return "a job of steps runs each row's steps together"
    if plan.pooling is not None:
        return "a pooling job has no generation to share a head with"
    if config.output.reuse or config.output.reuse_from:
        return "output.reuse stages the rows it finds by input block"
    if plan.render.images is not None:
        return "a job with images"
    if plan.input.data_bytes > MAX_INPUT_BYTES:
        return f"the input is over {MAX_INPUT_BYTES >> 20} MiB (copied in memory)"
    return None


@dataclass
class HeadOrder:
    """A job's run in head order: the copy it reads, and where its parts go."""

    staging: Location
    plan: object  # the JobPlan whose input is the copy
    found: Found | None = None  # None for a resumed run (the copy was made before)

    @property
    def parts(self) -> Location:
        return self.staging / PARTS_FOLDER

    @property
    def block_starts(self) -> tuple[int, ...]:
        return tuple(b.ordinal for b in self.plan.input.blocks)

    def layout(self, layout: PartLayout) -> PartLayout:
        """The job's layout for parts named by place in the copy; each keeps its rows'
        ordinals, to be put back in input order."""
        return replace(layout, staging=self.parts, block_starts=self.block_starts,
                       block_rows=tuple(b.num_rows for b in self.plan.input.blocks),
                       added_columns=(*layout.added_columns, columns.ORDINAL))

    def open(self) -> tuple[set[int], dict | None]:
        """The copy's blocks written whole by an earlier run, and of the others the places
        still to run (None: all)."""
        self.parts.mkdir()
        kept, superseded = list_parts(self.parts)
        for part in superseded:
            (self.parts / part.name).remove()
        done, partial = covered_blocks(kept, self.block_starts, self.plan.input.num_rows)
        return done, missing_rows(kept, partial, self.block_starts,
                                  self.plan.input.num_rows) or None

    def restore(self, block_starts: tuple[int, ...], target_bytes: int) -> None:
        """Every row written: the output in input order, as parts in the staging folder cut
        where the input's blocks start (``block_starts``), each of about ``target_bytes``;
        then the head-order parts and the copy removed. Stopped half way, the next run does
        it again from the start (the head-order parts are removed last)."""
        kept, _ = list_parts(self.parts)
        table = pa.concat_tables([read_part(self.parts / p.name) for p in kept],
                                 promote_options="permissive")
        table = table.take(pc.sort_indices(table, [(columns.ORDINAL, "ascending")]))  # stable
        ordinals = table.column(columns.ORDINAL).to_numpy()
        table = table.drop_columns([columns.ORDINAL])
        earlier, superseded = list_parts(self.staging)  # a stopped restore's: written again
        for part in (*earlier, *superseded):
            (self.staging / part.name).remove()
        for start, end in _cuts(ordinals, block_starts, table.nbytes, target_bytes):
            piece = table.slice(start, end - start)
            first = int(ordinals[start])
            last = _block_end(block_starts, int(ordinals[end - 1]), self.plan.input.num_rows)
            (self.staging / part_name(first, last)).write(
                lambda tmp, piece=piece: pq.write_table(piece, tmp))
        self.parts.remove()
        (self.staging / COPY_NAME).remove()


def _block_end(block_starts: tuple[int, ...], ordinal: int, rows_total: int) -> int:
    i = bisect.bisect_right(block_starts, ordinal)
    return block_starts[i] if i < len(block_starts) else rows_total


def _cuts(ordinals: np.ndarray, block_starts: tuple[int, ...], nbytes: int,
          target_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of about ``target_bytes`` each, cut only where an input block starts (a
    file holds whole blocks, as compaction's do)."""
    if len(ordinals) == 0:
        return []
    per_row = nbytes / len(ordinals)
    starts = np.searchsorted(ordinals, np.asarray(block_starts), side="left")
    cuts, begin = [], 0
    for at in starts[1:]:
        if at > begin and (at - begin) * per_row >= target_bytes:
            cuts.append((begin, int(at)))
            begin = int(at)
    cuts.append((begin, len(ordinals)))
    return cuts


def head_order(config, plan, staging: Location, progress=None,
               fresh: bool = True) -> HeadOrder | None:
    """The job's rows in head order, where that pays (``resources.group_by_prefix``): the
    copy written, and the run that reads it; None to run in input order. ``fresh``: no part
    in input order is written yet (else only a stopped head-order run goes on)."""
    if (staging / PARTS_FOLDER).exists() and (staging / COPY_NAME).exists():
        return HeadOrder(staging, _copy_plan(plan, staging / COPY_NAME))  # a stopped run's
    if not fresh:
        return None
    reader = HeadReader.for_model(plan.render)
    if reader is None:
        return None
    try:
        read = _heads_of(config, plan, reader)
    except Exception as exc:  # noqa: BLE001 - the order rows run in, never a reason to stop
        if progress is not None:
            progress.say(f"the prompts' heads could not be read ({one_line(exc, 200)}): the "
                         "rows run in input order")
        return None
    if read is None:
        return None
    table, heads, found = read
    if progress is not None:
        progress.say(f"grouping rows by prompt prefix: {found.line()}")
    copy = table.take(pa.array(heads.grouped_order(), pa.int64()))
    block_rows = max(b.num_rows for b in plan.input.blocks)
    (staging / COPY_NAME).write(lambda tmp: pq.write_table(copy, tmp, row_group_size=block_rows))
    (staging / PARTS_FOLDER).mkdir()
    return HeadOrder(staging, _copy_plan(plan, staging / COPY_NAME), found)


def _heads_of(config, plan, reader: HeadReader) -> tuple[pa.Table, Heads, Found] | None:
    """The input, its rows' heads and what they share, where grouping them pays; None where
    it does not (the first rows are looked at first: sharing nothing there, no more is read)."""
    units, tables, read = read_units(plan.input.blocks), [], 0
    for unit in units:
        tables.extend(read_unit(unit, plan.input.schema))
        read += 1
        if sum(t.num_rows for t in tables) >= SAMPLE_ROWS:
            break
    heads = reader.heads(pa.concat_tables(tables))
    if read < len(units):
        if config.resources.group_by_prefix == "auto" and found_in(heads).gain < WORTH:
            return None
        rest = [t for unit in units[read:] for t in read_unit(unit, plan.input.schema)]
        more = reader.heads(pa.concat_tables(rest))  # the first rows' heads are not read again
        heads = Heads(np.vstack([heads.keys, more.keys]),
                      np.concatenate([heads.lengths, more.lengths]))
        tables.extend(rest)
    table = pa.concat_tables(tables)
    found = found_in(heads)
    return (table, heads, found) if will_group(config, found) else None


def _copy_plan(plan, copy: Location):
    """The job's plan, reading the copy: blocks of the same size, one row group each."""
    total = pq.ParquetFile(copy.path if copy.local else copy.open()).metadata.num_rows
    size = max(b.num_rows for b in plan.input.blocks)
    blocks = [Block(copy, "parquet", start, min(size, total - start), start, start)
              for start in range(0, total, size)]
    # the copy's columns are named as the plan names them (the input's names were renamed)
    schema = pa.schema([_without_source_name(f) for f in plan.input.schema],
                       metadata=plan.input.schema.metadata)
    return replace(plan, input=InputPlan(files=[copy], format="parquet", schema=schema,
                                         blocks=blocks, num_rows=total,
                                         data_bytes=plan.input.data_bytes))


def _without_source_name(field: pa.Field) -> pa.Field:
    meta = {k: v for k, v in (field.metadata or {}).items() if k != SOURCE_NAME}
    return field.with_metadata(meta) if meta else field.remove_metadata()
