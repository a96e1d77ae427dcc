"""The part writer puts blocks back together: Ray Data may hand a block over in pieces, in any
order (a stage batched by rows can end a batch mid-block); a part is written once, whole, in
input order."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.write import PartLayout, PartWriter, part_name
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


def test_a_block_in_pieces_is_written_once_whole_and_in_order(tmp_path):
    layout = PartLayout(staging=str(tmp_path), source_columns=("title",),
                        added_columns=(columns.ROW_ID, "text", *columns.GENERATED),
                        block_starts=(0, 4, 8), block_rows=(4, 4, 2), text_column="text")
    writer = PartWriter(layout)
    # block 4..7 arrives in two pieces, the later rows first, with block 8..9 whole between
    first = writer(pa.concat_tables([rows([6, 7], samples=2), rows([8, 9], samples=2)]))
    assert first["part"].to_pylist() == [part_name(8)]
    assert not (tmp_path / part_name(4)).exists()  # not before it is whole
    second = writer(pa.concat_tables([rows([0, 1, 2, 3], samples=2), rows([4, 5], samples=2)]))
    assert second["part"].to_pylist() == [part_name(0), part_name(4)]
    assert second["input_rows"].to_pylist() == [4, 4] and second["rows"].to_pylist() == [8, 8]
    part = pq.read_table(tmp_path / part_name(4))
    assert part.column(columns.ROW_ID).to_pylist() == [4, 4, 5, 5, 6, 6, 7, 7]
    assert part.column("text").to_pylist() == ["4.0", "4.1", "5.0", "5.1", "6.0", "6.1",
                                               "7.0", "7.1"]
    assert writer.pending == {}


def test_rows_handed_over_twice_are_written_once(tmp_path):
    """Ray Data retries a task that failed after handing on part of its output: the rows it
    hands on again must not reach a part twice, before or after the part is written."""
    layout = PartLayout(staging=str(tmp_path), source_columns=("title",),
                        added_columns=(columns.ROW_ID, "text", *columns.GENERATED),
                        block_starts=(0, 4), block_rows=(4, 4), text_column="text")
    writer = PartWriter(layout)
    assert writer(rows([0, 1], samples=2)).num_rows == 0
    assert writer(rows([0, 1], samples=2)).num_rows == 0  # the retry's first piece again
    assert writer(rows([0, 1, 2, 3], samples=2))["part"].to_pylist() == [part_name(0)]
    assert writer(rows([2, 3, 4, 5, 6, 7]))["part"].to_pylist() == [part_name(4)]
    assert pq.read_table(tmp_path / part_name(0)).column(columns.ROW_ID).to_pylist() == \
        [0, 0, 1, 1, 2, 2, 3, 3]
    assert pq.read_table(tmp_path / part_name(4)).column(columns.ROW_ID).to_pylist() == \
        [4, 5, 6, 7]
    assert writer.pending == {}
