"""The part writers and the compaction: Ray Data may hand a block over in pieces, in any order
(a stage batched by rows can end a batch mid-block); every piece is written at once as a part
named by its rows, and the finished output is a few files, whole, in input order."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.write.compact import Group, plan_groups, write_group
from pipelines.storage import Location
from pipelines.write import (OutputStore, Part, PartLayout, PartWriter, covered_blocks,
                             list_parts, part_name)
from udfs import columns


def rows(ordinals, samples=1):
    n = len(ordinals) * samples
    return pa.table({
        "title": [f"t{o}" for o in ordinals for _ in range(samples)],
        columns.ORDINAL: pa.array([o for o in ordinals for _ in range(samples)], pa.int64()),
        "text": [f"{o}.{k}" for o in ordinals for k in range(samples)],
        **{c: pa.array([None] * n, pa.string()) for c in (columns.ERROR_KIND, columns.ERROR)},
        columns.FINISH_REASON: ["length"] * n,
        columns.PROMPT_TOKENS: pa.array([3] * n, pa.int64()),
        columns.COMPLETION_TOKENS: pa.array([2] * n, pa.int64()),
    })


LAYOUT = dict(source_columns=("title",), added_columns=(columns.ROW_ID, "text",
                                                         *columns.GENERATED),
              block_starts=(0, 4, 8), block_rows=(4, 4, 2), text_column="text", rows_total=10)


def test_pieces_are_written_at_once_as_parts_named_by_their_rows(tmp_path):
    writer = PartWriter(PartLayout(staging=str(tmp_path), **LAYOUT))
    # block 4..7 arrives in two pieces, the later rows first, with block 8..9 whole between;
    # one batch holds rows of two blocks that are not neighbours
    first = writer(pa.concat_tables([rows([6, 7], samples=2), rows([8, 9], samples=2)]))
    assert first["part"].to_pylist() == [part_name(6, 8), part_name(8, 10)]
    second = writer(pa.concat_tables([rows([0, 1, 2, 3], samples=2), rows([4, 5], samples=2)]))
    assert second["part"].to_pylist() == [part_name(0, 4), part_name(4, 6)]
    assert second["input_rows"].to_pylist() == [4, 2] and second["rows"].to_pylist() == [8, 4]
    part = pq.read_table(tmp_path / part_name(4, 6))
    assert part.column(columns.ROW_ID).to_pylist() == [4, 4, 5, 5]
    assert part.column("text").to_pylist() == ["4.0", "4.1", "5.0", "5.1"]
    parts, superseded = list_parts(Location.of(str(tmp_path)))
    assert [p.start for p in parts] == [0, 4, 6, 8] and not superseded
    assert covered_blocks(parts, (0, 4, 8), 10) == ({0, 4, 8}, set())


def test_rows_handed_over_twice_are_written_once(tmp_path):
    """Ray Data retries a task that failed after handing on part of its output: the rows it
    hands on again are the same piece, the same part; a part inside a larger one's range
    is superseded, never read twice."""
    writer = PartWriter(PartLayout(staging=str(tmp_path), **LAYOUT))
    writer(rows([0, 1], samples=2))
    writer(rows([0, 1], samples=2))  # the retry's piece again: the same name
    writer(rows([0, 1, 2, 3], samples=2))
    parts, superseded = list_parts(Location.of(str(tmp_path)))
    assert [p.name for p in parts] == [part_name(0, 4)]
    assert [p.name for p in superseded] == [part_name(0, 2)]


def test_a_resume_runs_only_the_rows_not_written(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    store.staging.mkdir()
    writer = PartWriter(PartLayout(staging=store.staging, **LAYOUT))
    writer(rows([0, 1, 2, 3]))
    writer(rows([5, 6]))  # block 4 in part when the run stopped: rows 4 and 7 were in flight
    writer(rows([8, 9]))
    assert store._resume((0, 4, 8), 10) == {0, 8}
    assert store.remaining == {4: [0, 3]}  # positions in the block
    assert [p.name for p in list_parts(store.staging)[0]] == [
        part_name(0, 4), part_name(5, 7), part_name(8, 10)]
    writer(rows([4, 7]))  # the resumed run: one batch, two runs of rows
    parts = list_parts(store.staging)[0]
    assert covered_blocks(parts, (0, 4, 8), 10) == ({0, 4, 8}, set())
    assert [p.name for p in parts][1:4] == [part_name(4, 5), part_name(5, 7), part_name(7, 8)]


def test_compaction_joins_parts_at_block_boundaries_and_finishes_after_a_stop(tmp_path):
    staging = Location.of(str(tmp_path))
    writer = PartWriter(PartLayout(staging=staging, **LAYOUT))
    for piece in ([0, 1], [2, 3], [4, 5, 6], [7], [8, 9]):
        writer(rows(piece, samples=2))
    parts, _ = list_parts(staging)
    one = parts[0].size
    # about two parts a file: a file ends only where a block starts
    groups = plan_groups(parts, (0, 4, 8), 10, target_bytes=2 * one + 1)
    assert [(g.start, g.end) for g in groups] == [(0, 4), (4, 8), (8, 10)]
    # a stop after the first file was written, before its parts were removed
    pq.write_table(pa.concat_tables([pq.read_table(tmp_path / part_name(0, 2)),
                                     pq.read_table(tmp_path / part_name(2, 4))]),
                   tmp_path / part_name(0, 4))
    parts, superseded = list_parts(staging)
    assert [p.name for p in superseded] == [part_name(0, 2), part_name(2, 4)]
    for part in superseded:
        (staging / part.name).remove()
    for group in plan_groups(parts, (0, 4, 8), 10, target_bytes=1 << 30)[:1]:
        stats = write_group(staging, group, columns.ROW_ID)
    assert [p.name for p in list_parts(staging)[0]] == [part_name(0, 10)]
    assert stats["input_rows"] == 10 and stats["rows"] == 20
    table = pq.read_table(tmp_path / part_name(0, 10))
    assert table.column(columns.ROW_ID).to_pylist() == [o for o in range(10) for _ in (0, 1)]


def test_a_group_of_one_part_named_for_its_range_is_left_as_it_is(tmp_path):
    staging = Location.of(str(tmp_path))
    PartWriter(PartLayout(staging=staging, **LAYOUT))(rows([0, 1, 2, 3]))
    inode = (tmp_path / part_name(0, 4)).stat().st_ino
    stats = write_group(staging, Group(0, 4, (part_name(0, 4),)), columns.ROW_ID)
    assert stats["rows"] == 4 and (tmp_path / part_name(0, 4)).stat().st_ino == inode
    assert covered_blocks([Part(part_name(0), 0, None)], (0, 4), 8) == ({0}, set())


def test_the_output_reads_in_input_order_with_polars_pyarrow_and_duckdb(tmp_path):
    """A compacted output of several files, as its readers see it: every row once, in input
    order, one schema."""
    import duckdb
    import polars as pl
    import pyarrow.dataset as ds

    from pipelines.write.compact import compact_locally

    starts = tuple(range(0, 100, 4))
    layout = PartLayout(staging=str(tmp_path), source_columns=("title",),
                        added_columns=(columns.ROW_ID, "text", *columns.GENERATED),
                        block_starts=starts, block_rows=(4,) * 25, text_column="text",
                        rows_total=100)
    writer = PartWriter(layout)
    for first in range(0, 100, 3):  # pieces that straddle blocks, handed over out of order
        writer(rows(list(range(first, min(first + 3, 100)))[::-1]))
    size = sum(p.size for p in list_parts(Location.of(str(tmp_path)))[0])
    stats = compact_locally(Location.of(str(tmp_path)), starts, 100, size // 5, columns.ROW_ID)
    names = [p.name for p in list_parts(Location.of(str(tmp_path)))[0]]
    assert 4 <= len(names) <= 7 and len(stats) == len(names)
    assert sorted(tmp_path.iterdir()) == [tmp_path / n for n in names]  # nothing else there
    expected = list(range(100))
    assert pl.read_parquet(tmp_path)["row_id"].to_list() == expected
    assert pl.scan_parquet(tmp_path / "*.parquet").select("row_id").collect()[
        "row_id"].to_list() == expected
    assert ds.dataset(tmp_path).to_table(columns=["row_id"])["row_id"].to_pylist() == expected
    got = duckdb.sql(f"select row_id from read_parquet('{tmp_path}/*.parquet')").fetchall()
    assert [r[0] for r in got] == expected


def test_a_listing_leaves_out_a_file_renamed_while_it_is_taken(tmp_path, monkeypatch):
    # overnight serve counts a running job's parts while its writers rename .tmp files into
    # parts: a file gone between the listing and its stat is left out, not an error (it failed
    # a batch in a kill-and-restart test)
    import os

    (tmp_path / "part-1.parquet").write_bytes(b"12345")
    (tmp_path / ".part-2.parquet.tmp").write_bytes(b"x")
    real = os.scandir

    class Vanishing:
        def __init__(self, entries):
            self.entries = entries

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.entries.close()

        def __iter__(self):
            for entry in self.entries:
                if entry.name.endswith(".tmp"):
                    os.rename(entry.path, tmp_path / "part-2.parquet")  # committed meanwhile
                yield entry

    monkeypatch.setattr(os, "scandir", lambda path: Vanishing(real(path)))
    assert Location.of(str(tmp_path)).sizes()["part-1.parquet"] == 5
    assert ".part-2.parquet.tmp" not in Location.of(str(tmp_path)).sizes()
    assert Location.of(str(tmp_path / "gone")).sizes() == {}


def sampled(ordinals, samples=3, only=None):
    """Rows with ``samples`` samples each, as the predictor gives them (sample_index and
    the row's sample count); ``only``: of the first or last row, just these samples."""
    table = rows(ordinals, samples)
    index = [k for _ in ordinals for k in range(samples)]
    table = (table.append_column(columns.SAMPLE_INDEX, pa.array(index, pa.int32()))
             .append_column(columns.SAMPLES, pa.array([samples] * len(index), pa.int32())))
    if only is not None:
        keep = [i for i, (o, k) in enumerate(zip(table.column(columns.ORDINAL).to_pylist(),
                                                 index)) if (o, k) in only or o not in
                {o for o, _ in only}]
        table = table.take(keep)
    return table


SAMPLED = dict(LAYOUT, added_columns=(columns.ROW_ID, columns.SAMPLE_INDEX, "text",
                                      *columns.GENERATED))


def test_a_row_cut_between_its_samples_is_written_whole_once_both_pieces_came(tmp_path):
    """Ray Data cuts a large block anywhere between the engine and the writers, between two
    samples of one row too: the parts hold whole rows (all their samples), and none overlap.
    Seen: 64 rows of 1.2 MB text, n=3; the resume dropped a part as "superseded", losing two
    samples."""
    staging = Location.of(str(tmp_path))
    one, two = (PartWriter(PartLayout(staging=staging, **SAMPLED)) for _ in range(2))
    # block 0..3, cut after row 1's first sample; the pieces reach two writers of the pool
    first = one(sampled([0, 1], only={(1, 0)}))
    assert first["part"].to_pylist() == [part_name(0, 1)]
    second = two(sampled([1, 2, 3], only={(1, 1), (1, 2)}))
    assert sorted(second["part"].to_pylist()) == [part_name(1, 2), part_name(2, 4)]
    parts, superseded = list_parts(staging)
    assert [p.name for p in parts] == [part_name(0, 1), part_name(1, 2), part_name(2, 4)]
    assert not superseded and sorted(tmp_path.iterdir()) == [tmp_path / p.name for p in parts]
    row = pq.read_table(tmp_path / part_name(1, 2))
    assert row.column("text").to_pylist() == ["1.0", "1.1", "1.2"]
    assert row.column(columns.SAMPLE_INDEX).to_pylist() == [0, 1, 2]
    assert covered_blocks(parts, (0, 4, 8), 10) == ({0}, set())


def test_a_row_whose_first_piece_a_killed_run_left_is_run_again_whole(tmp_path):
    store = OutputStore(str(tmp_path / "out"))
    store.staging.mkdir()
    writer = PartWriter(PartLayout(staging=store.staging, **SAMPLED))
    writer(sampled([0, 1], only={(1, 0), (1, 1)}))  # then killed: row 1's third never came
    assert store._resume((0, 4, 8), 10) == set()
    assert store.remaining == {0: [1, 2, 3]}
    writer(sampled([1, 2]))  # the resumed run: row 1 whole this time
    writer(sampled([3], only={(3, 2)}))  # and cut again, the other way round
    writer(sampled([3], only={(3, 0), (3, 1)}))
    parts = list_parts(store.staging)[0]
    assert [p.name for p in parts] == [part_name(0, 1), part_name(1, 3), part_name(3, 4)]
    assert pq.read_table(store.staging.path + "/" + part_name(3, 4)).column(
        "text").to_pylist() == ["3.0", "3.1", "3.2"]
    store.commit({})  # what the killed run left aside is cleared with the commit
    assert sorted(os.listdir(store.path.path)) == [p.name for p in parts]


def test_parts_that_overlap_in_part_are_refused_never_superseded(tmp_path):
    import pytest

    from pipelines.errors import OutputError

    for name in (part_name(0, 4), part_name(2, 6)):
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(OutputError, match=r"parts part-0+-0+4\.parquet and "
                                          r"part-0+2-0+6\.parquet overlap \(rows 2-3"):
        list_parts(Location.of(str(tmp_path)))


def test_the_retry_writer_merges_a_row_whose_samples_came_in_two_batches(tmp_path):
    """--retry-errors: the re-run rows travel to one writer; a row cut between its samples
    keeps all three (the writer once dropped the second piece's samples of a row it had seen)."""
    from pipelines.write import RETRY_OLD, RetryWriter

    staging = Location.of(str(tmp_path))
    old = PartWriter(PartLayout(staging=str(tmp_path / "old"), **SAMPLED))
    (tmp_path / "old").mkdir()
    old(sampled([0, 1, 2, 3]))
    committed = pq.read_table(tmp_path / "old" / part_name(0, 4))
    pq.write_table(committed, tmp_path / RETRY_OLD.format(0))
    layout = PartLayout(staging=staging, **dict(SAMPLED, block_rows=(2, 0, 0)))
    writer = RetryWriter(layout)
    rerun = sampled([1, 2]).set_column(2, "text", pa.array([f"new{i}" for i in range(6)]))
    assert writer(rerun.slice(0, 4)).num_rows == 0  # row 2's third sample still to come
    written = writer(rerun.slice(4))
    assert written["part"].to_pylist() == [part_name(0, 4)]
    # its record counts the rows re-run (for the run's progress), not the part's four
    assert written["input_rows"].to_pylist() == [2] and written["rows"].to_pylist() == [6]
    part = pq.read_table(tmp_path / part_name(0, 4))
    assert part.column("text").to_pylist() == [
        "0.0", "0.1", "0.2", "new0", "new1", "new2", "new3", "new4", "new5",
        "3.0", "3.1", "3.2"]
