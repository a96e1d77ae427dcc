"""Reading: files are found, checked and cut into ordered blocks before any engine starts."""

import dataclasses
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.errors import InputError
from pipelines.read import read_block, resolve_files, scan_input
from udfs import columns


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def test_blocks_cover_every_row_in_order_across_files(tmp_path: Path):
    write_jsonl(tmp_path / "a.jsonl", [{"t": f"a{i}"} for i in range(5)])
    write_jsonl(tmp_path / "b.jsonl", [{"t": f"b{i}", "extra": i} for i in range(4)])
    plan = scan_input(str(tmp_path), "auto", 2, None)
    assert plan.num_rows == 9
    assert [b.ordinal for b in plan.blocks] == [0, 2, 4, 5, 7]
    rows = [r for b in plan.blocks for r in read_block(b, plan.schema).to_pylist()]
    assert [r["t"] for r in rows] == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(4)]
    assert [r[columns.ORDINAL] for r in rows] == list(range(9))
    assert rows[0]["extra"] is None and rows[-1]["extra"] == 3


def test_parquet_blocks_span_row_groups(tmp_path: Path):
    table = pa.table({"x": list(range(25))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=7)
    plan = scan_input(str(tmp_path / "t.parquet"), "auto", 10, None)
    got = [v for b in plan.blocks for v in read_block(b, plan.schema).column("x").to_pylist()]
    assert got == list(range(25))


def test_malformed_jsonl_line_is_named(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 1}\n{"t": 2}\n{"t": \n')
    with pytest.raises(InputError, match=rf"{path}:3: not valid JSON"):
        scan_input(str(path), "auto", 10, None)


def test_non_utf8_jsonl_line_is_named(tmp_path: Path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"t": "ok"}\n{"t": "caf\xe9"}\n')
    with pytest.raises(InputError, match=rf"{path}:2: not valid UTF-8"):
        scan_input(str(path), "auto", 10, None)


def test_jsonl_line_that_is_not_an_object(tmp_path: Path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"t": 1}\n[1, 2]\n')
    with pytest.raises(InputError, match=rf"{path}:2: expected a JSON object, got list"):
        scan_input(str(path), "auto", 10, None)


def test_missing_path(tmp_path: Path):
    with pytest.raises(InputError, match="no such file or directory"):
        resolve_files(str(tmp_path / "nope.parquet"))


def test_glob_matching_nothing(tmp_path: Path):
    with pytest.raises(InputError, match="the glob matches no file"):
        resolve_files(str(tmp_path / "*.parquet"))


def test_empty_input(tmp_path: Path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(InputError, match="the input has no rows"):
        scan_input(str(path), "auto", 10, None)


def test_unreadable_parquet(tmp_path: Path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match=rf"{path}: not a readable Parquet file"):
        scan_input(str(path), "auto", 10, None)


def test_mixed_formats_in_a_directory(tmp_path: Path):
    write_jsonl(tmp_path / "a.jsonl", [{"t": 1}])
    pq.write_table(pa.table({"t": [1]}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match="mixes Parquet and JSONL"):
        resolve_files(str(tmp_path))


def test_values_pass_through_unchanged(tmp_path: Path):
    odd = ["", None, "🙂👍 emoji", "مرحبا بالعالم", "{{ 7 * 7 }} {% if x %}", "x" * 100_000]
    path = write_jsonl(tmp_path / "odd.jsonl", [{"t": v} for v in odd])
    plan = scan_input(str(path), "auto", 4, None)
    got = [v for b in plan.blocks for v in read_block(b, plan.schema).column("t").to_pylist()]
    assert got == odd


def test_integers_that_a_float_column_elsewhere_would_round_are_refused(tmp_path: Path):
    pq.write_table(pa.table({"id": pa.array([2 ** 53 + 1], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([0.5])}), tmp_path / "b.parquet")
    with pytest.raises(InputError, match=r"column 'id' is int64 in \S+a.parquet but double "
                                         r"in the input as a whole \(from \S+b.parquet\): it "
                                         r"holds integers up to 9007199254740993"):
        scan_input(str(tmp_path), "auto", 4, None)
    pq.write_table(pa.table({"id": pa.array([7], pa.int64())}), tmp_path / "a.parquet")
    plan = scan_input(str(tmp_path), "auto", 4, None)  # small integers survive a double
    assert plan.schema.field("id").type == pa.float64()


def test_jsonl_keys_and_types_come_from_every_row(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text('{"id": 1, "text": "a"}\n'
                                      '{"id": 2, "text": "b", "notes": "keep me", "m": {}}\n')
    plan = scan_input(str(tmp_path / "a.jsonl"), "auto", 8, None)
    table = read_block(plan.blocks[0], plan.schema)
    assert table.column("notes").to_pylist() == [None, "keep me"]
    assert table.column("m").to_pylist() == [None, "{}"]


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """The rows of each Parquet batch decoded from here on (counted, not timed)."""
    rows: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def counting(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            rows.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    return rows


def test_each_row_is_decoded_once_on_a_one_row_group_file(tmp_path: Path, decoded):
    """Counted, not timed: a 1,000-row file in one row group, cut into 100 blocks, is decoded
    in one pass (each block re-read its whole row group before: 100,000 rows decoded)."""
    from pipelines.read import read_unit, read_units

    pq.write_table(pa.table({"x": list(range(1000))}), tmp_path / "one.parquet",
                   row_group_size=1000)
    plan = scan_input(str(tmp_path / "one.parquet"), "auto", 10, None)
    units = read_units(plan.blocks)
    assert len(plan.blocks) == 100 and len(units) == 1
    tables = [t for u in units for t in read_unit(u, plan.schema)]
    assert sum(decoded) == 1000
    assert [t.num_rows for t in tables] == [10] * 100
    assert [v for t in tables for v in t.column("x").to_pylist()] == list(range(1000))
    assert [v for t in tables for v in t.column(columns.ORDINAL).to_pylist()] == \
        list(range(1000))
    # resuming after half the blocks: the rest of the file, still one pass
    decoded.clear()
    rest = read_units(plan.blocks[50:])
    assert [v for u in rest for t in read_unit(u, plan.schema)
            for v in t.column(columns.ORDINAL).to_pylist()] == list(range(500, 1000))
    assert sum(decoded) == 1000  # the group is read from its start; nothing twice


def test_read_units_break_at_row_groups_and_at_done_blocks(tmp_path: Path):
    from pipelines.read import read_unit, read_units

    pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "a.parquet",
                   row_group_size=30)
    (tmp_path / "b.jsonl").write_text("".join(f'{{"x": {i}}}\n\n' for i in range(100, 130)))
    plan = scan_input(str(tmp_path / "a.parquet"), "auto", 8, None)
    units = read_units(plan.blocks, unit_rows=16)  # past 16 rows, a unit ends at a group end
    assert [u.num_rows for u in units] == [32, 32, 32, 4]
    todo = [b for b in plan.blocks if b.ordinal not in (40, 48)]  # two blocks done
    got = [v for u in read_units(todo, unit_rows=16) for t in read_unit(u, plan.schema)
           for v in t.column("x").to_pylist()]
    assert got == [v for v in range(100) if not 40 <= v < 56]
    jsonl = scan_input(str(tmp_path / "b.jsonl"), "auto", 8, None)
    units = read_units(jsonl.blocks, unit_rows=16)
    assert [u.num_rows for u in units] == [16, 14]
    assert [v for u in units for t in read_unit(u, jsonl.schema)
            for v in t.column("x").to_pylist()] == list(range(100, 130))


def test_ray_blocks_are_whole_plan_blocks_large_for_large_jobs_and_many_for_small():
    """A Ray Data block costs the driver ~8 KB for the rest of the job: a large job moves
    ~4,096-row blocks; a small one keeps 8 per engine slot (so each engine has work)."""
    from pipelines.read import RAY_BLOCK_ROWS, ROUNDS, ray_block_rows

    assert ray_block_rows(20, 8, 4) == 8  # a small job: one plan block each, as before
    assert ray_block_rows(10_000_000, 256, 4) == RAY_BLOCK_ROWS == 4096
    per = ray_block_rows(100_000, 256, 4)
    assert per % 256 == 0 and -(-100_000 // per) >= 4 * ROUNDS
    assert ray_block_rows(10_000_000, 8192, 4) == 8192  # never less than one plan block
    # rows of ~1 MB (a column of photos): ~64 MiB a block, a whole number of plan blocks
    assert ray_block_rows(10_000_000, 16, 4, row_bytes=1 << 20) == 64
    assert ray_block_rows(10_000_000, 256, 4, row_bytes=1 << 20) == 256


def test_the_engine_stage_cuts_ray_blocks_back_into_plan_blocks():
    from udfs.stages.chain import Chain

    batch = pa.table({"x": list(range(10)), columns.ORDINAL: pa.array(range(20, 30), pa.int64())})
    chain = Chain([], cut=((0, 24, 28), 3))  # plan blocks at 0, 24, 28; at most 3 rows each
    pieces = [p.column(columns.ORDINAL).to_pylist() for p in chain.pieces(batch)]
    assert pieces == [[20, 21, 22], [23], [24, 25, 26], [27], [28, 29]]
    assert [p.num_rows for p in Chain([]).pieces(batch)] == [10]  # no cut: the batch whole



class _Held:
    """A stage that holds each piece a while and counts how many it holds at once."""

    def __init__(self, hold: float = 0.2):
        self.hold, self.now, self.most = hold, 0, 0
        self.lock = threading.Lock()

    def __call__(self, piece):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.hold)
        with self.lock:
            self.now -= 1
        return piece


def test_a_batchs_pieces_reach_the_engine_at_once_up_to_the_blocks_in_flight():
    """One piece after another, a batch's later pieces waited for the earlier ones to finish
    generating (the long-output benchmark's engine ran part empty): they run at once, at
    most ``at_once`` over all the actor's calls, and come out in input order."""
    from udfs.stages.chain import Chain

    batch = pa.table({columns.ORDINAL: pa.array(range(2, 14), pa.int64())})
    chain = Chain([], cut=((0, 4, 8, 12), 4), at_once=3)
    chain.stages = [held := _Held()]
    out = [p.column(columns.ORDINAL).to_pylist() for p in chain(batch)]
    assert out == [[2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert held.most == 3  # four pieces, three at once

    # two calls at once (the actor's blocks in flight): still three pieces at most
    held.most = 0
    threads = [threading.Thread(target=lambda: list(chain(batch))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert held.most == 3
    chain.close()

def test_jsonl_lines_the_fast_decoder_refuses_read_as_json_loads_reads_them(tmp_path: Path):
    """msgspec decodes the common line; NaN and 1e400 go to json.loads, so the values (and
    the lines refused, and why) are what they were. A lone surrogate escape is named."""
    import math

    lines = ['{"x": 1.5, "s": "plain"}', '{"x": NaN, "s": "\\u00e9"}', '{"x": 1e400, "s": "é"}']
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    plan = scan_input(str(tmp_path / "a.jsonl"), "auto", 8, None)
    table = read_block(plan.blocks[0], plan.schema)
    xs = table.column("x").to_pylist()
    assert xs[0] == 1.5 and math.isnan(xs[1]) and xs[2] == math.inf
    assert table.column("s").to_pylist() == ["plain", "é", "é"]
    (tmp_path / "b.jsonl").write_text('{"x": 1}\n{"x": 2} trailing\n')
    with pytest.raises(InputError, match=r"b.jsonl:2: not valid JSON: Extra data"):
        scan_input(str(tmp_path / "b.jsonl"), "auto", 8, None)
    (tmp_path / "c.jsonl").write_text('{"s": "ok"}\n{"s": "\\ud800"}\n')
    with pytest.raises(InputError, match=r"c.jsonl:2: column 's': a string holds a lone surr"):
        scan_input(str(tmp_path / "c.jsonl"), "auto", 8, None)


def test_repeated_ids_are_found_in_one_pass_and_named(tmp_path: Path, decoded):
    """The scan keeps 8-byte hashes; where ids repeat, the values behind them are read in one
    more pass, each row decoded once (a block at a time decoded a one-group file per block)."""
    from pipelines.plan.input_checks import _repeated_ids

    ids = [f"id{i}" for i in range(1000)]
    ids[900], ids[950], ids[999] = "id3", "id3", "id7"
    pq.write_table(pa.table({"id": ids}), tmp_path / "one.parquet", row_group_size=1000)
    plan = scan_input(str(tmp_path / "one.parquet"), "auto", 10, "id")
    decoded.clear()  # the scan read the id column
    repeats, shown = _repeated_ids(plan, "id")
    assert (repeats, sorted(shown)) == (2, ["id3", "id7"])
    assert sum(decoded) == 1000


def test_ray_data_reads_only_a_few_blocks_per_engine_ahead(tmp_path: Path, ray_cluster):
    """Left to its default, Ray Data reads a large table far ahead of the engines, into
    memory that grows with the table; the job's dataset holds a budget that does not."""
    from pipelines.read import READ_AHEAD_BLOCKS, READ_AHEAD_MIN, read_ahead_bytes, read_dataset

    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"{i:04d}" * 250 for i in range(64)]}), path)
    plan = scan_input(str(path), "auto", block_rows=8, id_column=None)
    assert 64_000 <= plan.data_bytes < 80_000  # Parquet's uncompressed size, about
    ds, per_block = read_dataset(plan, block_rows=8, slots=2)
    assert ds.context.execution_options.resource_limits.object_store_memory == READ_AHEAD_MIN
    # a wide table over many engines: a few of its blocks per engine slot, whatever the size
    wide = dataclasses.replace(plan, data_bytes=64 << 20)  # 1 MiB a row, its 64 rows
    assert read_ahead_bytes(wide, 4096, 32) == (1 << 20) * 4096 * READ_AHEAD_BLOCKS * 32
    # the session's own context is left as it was
    import ray.data

    assert ray.data.DataContext.get_current().execution_options.resource_limits \
        .object_store_memory != READ_AHEAD_MIN


def test_large_read_units_run_as_many_at_once_as_the_read_ahead_holds_twice():
    """Photos (a 200 MB unit, a 410 MB budget): one task at a time; a text table's units
    (8 MB): Ray Data's choice."""
    from pipelines.read.sizes import reads_at_once

    assert reads_at_once(410 << 20, 200 << 20) == 1
    assert reads_at_once(256 << 20, 600 << 20) == 1  # a unit larger than the budget: still one
    assert reads_at_once(2 << 30, 200 << 20) == 5
    assert reads_at_once(256 << 20, 8 << 20) is None
