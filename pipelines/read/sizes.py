"""How large a block is, and how much is read ahead: the plan's block rows (each committed as it
is done), Ray Data's block rows, and the bytes read ahead of the engines.
"""

from __future__ import annotations

from pipelines.read.scan import InputPlan


RAY_BLOCK_ROWS = 4096  # rows a Ray Data block carries, at most, once a job is large enough
RAY_BLOCK_BYTES = 64 << 20  # ... and bytes, about, where rows are large (a column of photos)
ROUNDS = 8  # Ray Data blocks per engine slot, at least: the job's tail waits on one at most
READ_AHEAD_MIN = 256 << 20  # bytes of input read ahead of the engines, at least
READ_AHEAD_BLOCKS = 4  # Ray Data blocks read ahead per engine slot, at least


def read_ahead_bytes(plan: InputPlan, per_block: int, slots: int) -> int:
    """How much of the input Ray Data may hold, read but not yet written (its object store
    budget for the job). Reading is many times faster than any engine: left to its default
    (half the object store, 30% of the machine's memory) it reads a large table far ahead,
    and the memory that holds it grows with the table. A few blocks per engine slot keep
    every engine fed."""
    per_row = plan.data_bytes / max(plan.num_rows, 1)
    return max(READ_AHEAD_MIN, int(per_row * per_block * READ_AHEAD_BLOCKS * max(slots, 1)))


def reads_at_once(read_ahead: int, unit_bytes: float) -> int | None:
    """The read tasks that run at once where a read unit is large (a column of photos), so
    that together they hold about the read-ahead budget. The budget bounds Ray's object
    store; a task holds its own memory too, about twice its unit (the decoded row group, or
    page: pyarrow writes up to 1,024 values a page, 0.8 GB of photos, and the blocks cut from
    it), until its blocks are taken, and a task the budget pauses keeps holding it. At a job's
    start, with nothing read yet, Ray Data started as many as the CPUs let it, each holding
    its unit while the engine loaded (docs/benchmarks.md). None (Ray Data's choice) where
    units are small."""
    at_once = max(1, int(read_ahead // max(READ_TASK_HOLDS * unit_bytes, 1)))
    return at_once if at_once < READS_AT_ONCE_UNBOUNDED else None


READ_TASK_HOLDS = 2  # a read task's memory, about, in units of its unit's bytes
READS_AT_ONCE_UNBOUNDED = 16  # tasks: more than a node's CPUs give the read, where it is light


PARTS_AT_LEAST = 16  # a table's plan blocks, at least (each is committed as it is done)
BLOCK_ROWS_AT_LEAST = 8  # ... unless that would make blocks smaller than this


def plan_block_rows(rows: int, batch_size: int) -> int:
    """The rows of the plan's blocks: ``resources.batch_size``, or fewer in a table too
    small to have ``PARTS_AT_LEAST`` blocks of it. A block is the unit the writer commits: a
    400-row table in blocks of 256 rows committed nothing until its last row was done (a kill
    at 90% lost every row, and the progress line said 0 written the whole run). The engine
    holds as many rows at once as before (``blocks_at_once``), so only the parts are smaller;
    a large table keeps ``batch_size``, and so no more parts than before."""
    return min(batch_size, max(BLOCK_ROWS_AT_LEAST, -(-rows // PARTS_AT_LEAST)))


def blocks_at_once(blocks_in_flight: int, batch_size: int, block_rows: int,
                   blocks: int) -> int:
    """The plan blocks an engine holds at once: ``resources.blocks_in_flight`` blocks of
    ``batch_size`` rows' worth, whatever the plan's block (``plan_block_rows``), and no more
    than the job has."""
    scaled = blocks_in_flight * -(-batch_size // max(block_rows, 1))
    return max(blocks_in_flight, min(scaled, blocks))


def ray_block_rows(rows: int, block_rows: int, slots: int, row_bytes: float = 0) -> int:
    """The rows of a Ray Data block, a whole number of the plan's blocks.

    A plan's block (``resources.batch_size`` rows) is the engine's unit of work and the
    writer's of commit, and the engine's stage cuts Ray Data's blocks back into them
    (udfs/stages/chain.py). Each Ray Data block costs the driver ~8 KB of bookkeeping for the rest of
    the job, and a task to schedule: 10M rows in 256-row blocks would grow it by ~300 MiB. So
    a large job moves ~4,096-row blocks, and a small one keeps ``ROUNDS`` of them per slot:
    every engine has work, and the blocks left at the end are short."""
    per_slot = rows // (max(slots, 1) * ROUNDS)
    most = RAY_BLOCK_ROWS
    if row_bytes > 0:  # large rows: ~RAY_BLOCK_BYTES a block (a block of 4,096 photos: 4 GB)
        most = min(most, int(RAY_BLOCK_BYTES // row_bytes))
    blocks = max(1, min(per_slot // block_rows, most // block_rows))
    return blocks * block_rows
