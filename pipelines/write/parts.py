"""Parts: their names, their listing, and the coverage arithmetic of resume.

A part holds a run of consecutive input rows and is named by their ordinals, ``[start, end)``:
``part-000000000256-000000000512.parquet``. The names alone say which rows are done, and sort in
input order. Everything here rests on the package's invariant (see pipelines/write/__init__.py):
a part holds whole input rows, all of each row's samples, and no two parts overlap but where one
holds the other whole (a compaction not yet finished). ``list_parts`` refuses a folder that
breaks it; ``covered_blocks`` and ``missing_rows`` count on it.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.errors import OutputError
from pipelines.storage import Location

PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
_PART = re.compile(r"part-(\d{12})(?:-(\d{12}))?\.parquet")
# --retry-errors: a block's committed rows, staged while its failed rows run again (hidden:
# never listed as a part; the commit clears it)
RETRY_OLD = ".retry-{:012d}.parquet"
# Some of an input row's samples, kept aside until the rest arrive (PartWriter): the row's
# ordinal and its first sample index here (hidden: never listed as a part; the commit clears
# what a killed run left, and the row runs again)
SAMPLES_PIECE = ".samples-{:012d}-{}"


def part_name(start: int, end: int | None = None) -> str:
    """The name of the part holding input rows [start, end). Without ``end``, the name an
    earlier version gave a block's part (still read)."""
    if end is None:
        return f"{PART_PREFIX}{start:012d}{PART_SUFFIX}"
    return f"{PART_PREFIX}{start:012d}-{end:012d}{PART_SUFFIX}"


def part_range(name: str) -> tuple[int, int | None] | None:
    """``(start, end)`` of a part's name, ``end`` None for a block's part of an earlier
    version; None for any other file."""
    match = _PART.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), (int(match[2]) if match[2] is not None else None)


def part_ordinal(name: str) -> int | None:
    found = part_range(name)
    return found[0] if found else None


@dataclass(frozen=True)
class Part:
    """A part in a folder: input rows [start, end); ``end`` None for an earlier version's
    block part (its block's end)."""

    name: str
    start: int
    end: int | None
    size: int = 0


def list_parts(folder: Location) -> tuple[list[Part], list[Part]]:
    """The parts of a folder in input order, and those superseded: a part inside the range of
    a larger one (a compaction interrupted before it removed its sources; a part written
    again after a retried task). Each input row is in exactly one of the parts returned.
    Two parts that overlap in part break the module's invariant: OutputError, naming them."""
    found = []
    for name, size in folder.sizes().items():
        where = part_range(name)
        if where is not None:
            found.append(Part(name, where[0], where[1], size))
    found.sort(key=lambda p: (p.start, -(p.end if p.end is not None else p.start + 1)))
    kept, superseded, reach = [], [], -1
    for part in found:
        end = part.end if part.end is not None else part.start + 1
        if part.start < reach:
            if end > reach:  # starts inside the last part kept and runs past it
                raise OutputError(
                    f"{folder}: parts {kept[-1].name} and {part.name} overlap (rows "
                    f"{part.start}-{reach - 1} are in both): the folder is not a consistent "
                    "output; remove the later part to run those rows again")
            superseded.append(part)
            continue
        kept.append(part)
        reach = end
    return kept, superseded


def input_offsets(keys: list) -> list[int]:
    """For each row of a part, which of the part's input rows it belongs to. A part holds
    its input rows in order, each as a run of one or more rows (its samples) sharing a key."""
    offsets, current = [], -1
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1]:
            current += 1
        offsets.append(current)
    return offsets


def count_runs(keys: pa.ChunkedArray | pa.Array) -> int:
    """Runs of equal keys: the input rows of a part (each row's samples share its key)."""
    if len(keys) == 0:
        return 0
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if pa.types.is_struct(keys.type) or pa.types.is_list(keys.type) \
            or pa.types.is_large_list(keys.type):
        return input_offsets(keys.to_pylist())[-1] + 1
    try:
        changed = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
    except pa.ArrowNotImplementedError:  # a map, a fixed-size list, an interval: by value
        return input_offsets(keys.to_pylist())[-1] + 1
    return 1 + (pc.sum(pc.fill_null(changed, True)).as_py() or 0)


def covered_blocks(parts: list[Part], block_starts: tuple[int, ...],
                   rows_total: int) -> tuple[set[int], set[int]]:
    """(blocks the parts cover whole, blocks they cover in part), by first ordinal."""
    if not block_starts:
        return set(), set()
    starts = list(block_starts)
    ends = starts[1:] + [rows_total]
    have = np.zeros(len(starts), dtype=np.int64)  # rows of each block the parts hold
    for part in parts:
        end = part.end
        if end is None:  # an earlier version's block part: its whole block
            i = bisect.bisect_right(starts, part.start) - 1
            end = ends[i] if i >= 0 and starts[i] == part.start else part.start
        lo = max(bisect.bisect_right(starts, part.start) - 1, 0)
        for i in range(lo, len(starts)):
            if starts[i] >= end:
                break
            have[i] += min(end, ends[i]) - max(part.start, starts[i])
    done = {starts[i] for i in range(len(starts)) if have[i] >= ends[i] - starts[i]}
    partial = {starts[i] for i in range(len(starts)) if 0 < have[i] < ends[i] - starts[i]}
    return done, partial


def missing_rows(parts: list[Part], blocks: set[int], block_starts: tuple[int, ...],
                 rows_total: int) -> dict[int, list[int]]:
    """Of each block in ``blocks``, the positions (from the block's start) no part holds."""
    ends = dict(zip(block_starts, (*block_starts[1:], rows_total)))
    have = {start: np.zeros(ends[start] - start, dtype=bool) for start in blocks}
    for part in parts:
        start = block_starts[bisect.bisect_right(block_starts, part.start) - 1]
        if start in have and part.end is not None:
            have[start][part.start - start:min(part.end, ends[start]) - start] = True
    return {start: np.flatnonzero(~held).tolist() for start, held in sorted(have.items())}
