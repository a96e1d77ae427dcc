"""Rows grouped by prompt prefix (pipelines/order/): a table whose rows share long heads far
apart runs head by head, and its output equals an input-order run's, row for row.

The table is a document asked questions, question by question (all documents for the first
question, then the second), with an engine cache too small to hold every document: in input
order a document's head is gone by the time its next question comes.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines import load_config, run_job
from pipelines.order.grouped import COPY_NAME, PARTS_FOLDER, HeadOrder, _cuts
from pipelines.order.heads import DEPTHS, MIN_HEAD, Heads, head_keys
from pipelines.storage import Location
from pipelines.write import part_name, part_range
from udfs import columns

from conftest import cli, job_config, kill_after_parts

DOCUMENTS, QUESTIONS = 24, 2


@pytest.fixture(scope="session")
def qa_job(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-order")
    documents = [" ".join(f"d{d}w{i}" for i in range(40)) for d in range(DOCUMENTS)]
    rows = [{"qid": f"q{q}-d{d}", "document": documents[d], "question": f"What is {q}?"}
            for q in range(QUESTIONS) for d in range(DOCUMENTS)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(name: str, group: str) -> dict:
        return job_config(tiny_model, root / "qa.jsonl", root / name,
                          input={"id_column": "qid"},
                          prompt={"system": "Answer from the document.",
                                  "template": "{{ document }}\n\nQuestion: {{ question }}"},
                          sampling={"temperature": 0.8, "seed": 5, "max_tokens": 8},
                          # about 1,000 tokens of KV cache (1 KiB a token): four documents
                          engine={"kv_cache_memory_bytes": 1 << 20},
                          resources={"batch_size": 4, "group_by_prefix": group})

    def write_config(name: str, group: str):
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config(name, group)))
        return path

    return root, config, write_config


@pytest.fixture(scope="session")
def in_input_order(qa_job, ray_cluster):
    root, config, _ = qa_job
    summary = run_job(load_config(config("input-order", "off")))
    return pl.read_parquet(root / "input-order"), summary.report


@pytest.fixture(scope="session")
def grouped(qa_job, ray_cluster):
    root, config, _ = qa_job
    summary = run_job(load_config(config("grouped", "auto")))
    return pl.read_parquet(root / "grouped"), summary.report


def test_a_grouped_run_writes_what_an_input_order_run_writes_row_for_row(in_input_order,
                                                                         grouped, qa_job):
    """Seeded, not greedy: each row's seed follows its id, whatever order it ran in."""
    expected, _ = in_input_order
    out, report = grouped
    assert out["qid"].to_list() == [f"q{q}-d{d}" for q in range(QUESTIONS)
                                    for d in range(DOCUMENTS)]
    assert out.equals(expected)
    assert out["error"].null_count() == out.height
    # nothing of the run in head order is left beside the output
    root = qa_job[0]
    assert sorted(p.name for p in (root / "grouped").iterdir()) == \
        sorted(p.name for p in (root / "input-order").iterdir())
    assert all(part_range(p.name) for p in (root / "grouped").iterdir())


def test_grouping_lets_the_prefix_cache_hold_each_document_for_its_next_question(
        in_input_order, grouped):
    _, plain = in_input_order
    _, report = grouped
    cache, plain_cache = report["prefix_cache"], plain["prefix_cache"]
    assert "grouped_by_prefix" not in plain_cache
    shared = cache["grouped_by_prefix"]
    assert shared["rows"] == DOCUMENTS * QUESTIONS
    assert shared["shared_in_input_order"] == 0  # question by question: no neighbour shares
    assert shared["shared_in_head_order"] >= MIN_HEAD * DOCUMENTS * (QUESTIONS - 1)
    assert cache["prompt_tokens"] == plain_cache["prompt_tokens"]
    # every document's second question finds its head in the cache
    assert cache["cached_tokens"] >= shared["shared_in_head_order"]
    assert cache["cached_tokens"] > 2 * plain_cache["cached_tokens"]
    replica = report["throughput"]["per_replica"][0]
    assert replica["cached_tokens"] == cache["cached_tokens"]
    assert replica["prefix_caching"] is True  # vLLM's default for this model on CPU


def test_validate_says_what_the_heads_share_and_the_order_the_job_will_run_in(qa_job, capsys):
    root, _, write_config = qa_job
    code, out, _ = cli("validate", write_config("validated", "auto"), capsys=capsys)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("prompt heads:"))
    assert "(0% next to each other in input order)" in line
    assert line.endswith("the job runs them grouped by prompt prefix")
    code, out, _ = cli("validate", write_config("validated-off", "off"), capsys=capsys)
    assert "the job runs them in input order (resources.group_by_prefix: false)" in out


def test_a_grouped_run_killed_mid_way_resumes_to_the_same_output(qa_job, in_input_order,
                                                                  capsys):
    """A spot reclaim while the parts in head order are being written: the same command
    resumes from them, and the output is in input order as if nothing happened."""
    root, _, write_config = qa_job
    path = write_config("killed", "on")
    code, _ = kill_after_parts(path, root / "killed.partial" / PARTS_FOLDER, 3,
                               signal.SIGKILL)
    assert code == -signal.SIGKILL
    staged = sorted(p.name for p in (root / "killed.partial" / PARTS_FOLDER).glob("part-*"))
    assert 3 <= len(staged) < DOCUMENTS * QUESTIONS // 4
    # status counts the parts written in head order
    code, out, _ = cli("status", root / "killed", capsys=capsys)
    written = sum(part_range(name)[1] - part_range(name)[0] for name in staged)
    assert f"rows: {written}/{DOCUMENTS * QUESTIONS} written" in out
    code, _, err = cli("run", path, capsys=capsys)
    assert code == 0, err
    expected, _ = in_input_order
    assert pl.read_parquet(root / "killed").equals(expected)
    assert not (root / "killed.partial").exists()


# Without an engine: the heads, their order, and the output put back in input order


def test_heads_sort_rows_sharing_a_prefix_together_ties_in_input_order():
    long_a, long_b = list(range(300)), list(range(200)) + [9] * 100
    rows = [long_a + [1], long_b + [2], [5] * 40, long_a + [3], None, long_b + [4]]
    found = [head_keys(ids) for ids in rows]
    heads = Heads(np.array([k for k, _ in found], np.uint64), np.array([n for _, n in found]))
    order = heads.grouped_order().tolist()
    assert abs(order.index(3) - order.index(0)) == 1
    assert abs(order.index(5) - order.index(1)) == 1
    assert order[-1] == 4  # a row that does not render: last
    # in input order only a and b sit together: 200 tokens shared, 128 at the ladder's depths
    assert heads.shared_tokens() == 128
    # a, a' share 300 tokens (256 at the ladder), b, b' too, and a or a' with b 128
    assert heads.shared_tokens(heads.grouped_order()) == 256 + 128 + 256
    assert len(found[0][0]) == len(DEPTHS)


def test_heads_shorter_than_the_least_worth_grouping_count_for_nothing():
    found = [head_keys([7] * (MIN_HEAD // 2) + [i]) for i in range(5)]
    heads = Heads(np.array([k for k, _ in found], np.uint64), np.array([n for _, n in found]))
    assert heads.shared_tokens(heads.grouped_order()) == 0


def _head_order_parts(tmp_path, order: list[int], samples: int = 1):
    """A staging folder holding a run in head order's parts: rows placed by ``order``."""
    staging = Location.of(tmp_path / "out.partial")
    (staging / PARTS_FOLDER).mkdir()
    for start in range(0, len(order), 3):
        ordinals = [o for o in order[start:start + 3] for _ in range(samples)]
        table = pa.table({"id": [f"r{o}" for o in ordinals],
                          "sample_index": [i % samples for i in range(len(ordinals))],
                          columns.ORDINAL: pa.array(ordinals, pa.int64())})
        end = min(start + 3, len(order))
        pq.write_table(table, (tmp_path / "out.partial" / PARTS_FOLDER /
                               part_name(start, end)))
    (staging / COPY_NAME).write_text("a copy")
    return staging


class _Plan:
    class input:  # noqa: N801 - the plan's shape, as HeadOrder reads it
        num_rows = 10
        blocks = ()


@pytest.mark.parametrize("stopped_half_way", [False, True])
def test_restore_puts_the_rows_back_in_input_order_and_does_it_again_when_stopped(
        tmp_path, stopped_half_way):
    order = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    staging = _head_order_parts(tmp_path, order, samples=2)
    if stopped_half_way:  # a restore stopped after writing one file in input order
        pq.write_table(pa.table({"id": ["r0"]}), tmp_path / "out.partial" /
                               part_name(0, 4))
    HeadOrder(staging, _Plan).restore((0, 4, 8), target_bytes=1)
    names = sorted(p.name for p in (tmp_path / "out.partial").iterdir())
    assert names == [part_name(0, 4), part_name(4, 8), part_name(8, 10)]
    out = pl.read_parquet(tmp_path / "out.partial")
    assert out["id"].to_list() == [f"r{i}" for i in range(10) for _ in range(2)]
    assert out["sample_index"].to_list() == [0, 1] * 10
    assert columns.ORDINAL not in out.columns


def test_cuts_fall_where_an_input_block_starts():
    ordinals = np.repeat(np.arange(10), 2)
    assert _cuts(ordinals, (0, 4, 8), nbytes=200, target_bytes=1) == [(0, 8), (8, 16),
                                                                     (16, 20)]
    assert _cuts(ordinals, (0, 4, 8), nbytes=200, target_bytes=10_000) == [(0, 20)]


def test_the_setting_reads_yaml_on_and_off_and_refuses_anything_else(tmp_path, capsys):
    """YAML reads an unquoted on / off as true / false; --set as well."""
    from pipelines.config.sections import ResourcesConfig

    for text, expected in (("auto", "auto"), ("on", True), ("off", False), ("'off'", False),
                           ("true", True), ("no", False)):
        loaded = yaml.safe_load(f"group_by_prefix: {text}")
        assert ResourcesConfig(**loaded).group_by_prefix == expected, text
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config("model", tmp_path / "in.jsonl", tmp_path / "out",
                                              resources={"group_by_prefix": "sometimes"})))
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"overnight: error: {path}: resources.group_by_prefix: must be auto, true or false "
        "(got 'sometimes')"]
