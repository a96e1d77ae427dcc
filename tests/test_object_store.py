"""Input and output on an object store: a real S3 API (moto's server, on loopback) behind
``s3://`` paths, read by Ray's read tasks and written by the writer actor, the real engine in
between. The endpoint and the test credentials travel in the URI's options (as they would for
MinIO); the job's record and report keep the path without them."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipelines import load_config, run_job
from pipelines.errors import JobError
from pipelines.storage import Location
from pipelines.write import OutputStore, part_name

from conftest import job_config
from servers import MotoServer

ROWS = [{"sku": f"S{i:02d}", "title": f"Lamp {i}", "description": f"light {i}"} for i in range(12)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A URI maker for one bucket on a local S3 server. moto's server runs in a process of its
    own: imported here, its Flask proxies would sit in this worker's modules, where vLLM's
    kernel scan (when a later test file builds an engine in this process) trips over them
    ("Working outside of application context")."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    options = f"endpoint_override=127.0.0.1:{server.port}&scheme=http&region=us-east-1"

    def uri(key: str) -> str:
        return f"s3://testing:testing@bucket/{key}?{options}"

    fs, _ = pafs.FileSystem.from_uri(uri("x") + "&allow_bucket_creation=true")
    fs.create_dir("bucket")
    yield uri
    server.kill()


def put_table(s3, key: str, table: pa.Table) -> None:
    fs, path = pafs.FileSystem.from_uri(s3(key))
    pq.write_table(table, path, filesystem=fs)


def read_table(s3, key: str) -> pa.Table:
    fs, path = pafs.FileSystem.from_uri(s3(key))
    return pq.read_table(path, filesystem=fs)


def test_a_job_reads_from_and_writes_to_s3(s3, tiny_model, ray_cluster):
    put_table(s3, "in/a.parquet", pa.Table.from_pylist(ROWS[:7]))
    put_table(s3, "in/b.parquet", pa.Table.from_pylist(ROWS[7:]))
    config = load_config(job_config(tiny_model, s3("in/*.parquet"), s3("out/rewritten"),
                                    input={"id_column": "sku"}, resources={"batch_size": 4}))
    summary = run_job(config)

    out = read_table(s3, "out/rewritten")
    assert out.column("sku").to_pylist() == [r["sku"] for r in ROWS]  # every row, in order
    assert out.select(["title", "description"]).to_pylist() == [
        {"title": r["title"], "description": r["description"]} for r in ROWS]
    assert out.column("error").null_count == len(ROWS)
    assert all(out.column("rewritten").to_pylist())
    assert summary.rows == len(ROWS) and summary.output == "s3://bucket/out/rewritten"

    store = OutputStore(s3("out/rewritten"))
    record = store.read_record()
    assert record["state"] == "complete"
    assert not store.staging.exists()  # the staged parts were moved into place
    # no credentials or endpoint options in what the job keeps
    kept = store.record.read_text() + (store.path.sibling(".report.json")).read_text()
    assert "testing:testing" not in kept and "endpoint_override" not in kept
    assert record["config"]["output"]["path"] == "s3://bucket/out/rewritten"
    report = json.loads(store.path.sibling(".report.json").read_text())
    assert report["rows"]["output"] == len(ROWS)

    with pytest.raises(JobError, match="already exists"):  # as with a local path
        run_job(config)


def test_an_interrupted_object_store_commit_is_finished_by_the_next_run(s3, tmp_path):
    """There is no rename on an object store: the commit copies the staged parts, then marks
    the record complete. A run killed in between leaves the record at 'committing'; the next
    run of the same job finds every part staged and commits again."""
    store = OutputStore(s3("half/out"))
    fingerprint = {"job": 1}
    assert store.open(fingerprint, overwrite=False) == set()
    for start in (0, 4):
        (store.staging / part_name(start)).write(
            lambda tmp, s=start: pq.write_table(pa.table({"x": [s]}), tmp))
    # killed during the commit: the record says so, one part was copied so far
    store.write_record({**store.read_record(), "state": "committing"})
    store.path.mkdir()
    (store.staging / part_name(0)).copy_to(store.path / part_name(0))

    again = OutputStore(s3("half/out"))
    assert again.open(fingerprint, overwrite=False) == {0, 4}  # nothing left to generate
    again.commit({"fingerprint": fingerprint})
    assert again.read_record()["state"] == "complete"
    assert read_table(s3, "half/out").column("x").to_pylist() == [0, 4]
    assert not again.staging.exists()


def test_unreachable_or_missing_input_is_one_clear_line(s3):
    from pipelines.read import resolve_files

    with pytest.raises(JobError, match=r"input.path 's3://bucket/nope/\*.parquet': the glob "
                                       "matches no file"):
        resolve_files(s3("nope/*.parquet"))
    with pytest.raises(JobError, match="input.path 's3://bucket/missing.parquet': no such"):
        resolve_files(s3("missing.parquet"))
    assert str(Location.of(s3("a/b"))) == "s3://bucket/a/b"


def test_an_output_at_a_bucket_root_is_refused_before_anything_runs(tmp_path):
    from pipelines.errors import ConfigError
    from pipelines.plan.preflight import plan_job

    (tmp_path / "in.jsonl").write_text('{"t": "x"}\n')
    config = load_config({"input": {"path": str(tmp_path / "in.jsonl")}, "model": {"name": "m"},
                          "prompt": {"template": "{{ t }}"},
                          "output": {"path": "s3://key:secret@bucket/?region=us-east-1"}})
    with pytest.raises(ConfigError, match=r"output.path 's3://bucket': name a folder inside "
                                          r"the bucket, e.g. s3://bucket/out"):
        plan_job(config)


def test_a_glob_stays_in_its_folder_and_hidden_folders_are_not_read(s3):
    """On an object store '*' matched across '/', and hidden and '_' folders were read."""
    from pipelines.read import resolve_files

    for key in ("g/a.parquet", "g/sub/b.parquet", "g/_temporary/c.parquet",
                "g/.ipynb_checkpoints/d.parquet", "g/sub/.hidden/e.parquet"):
        put_table(s3, key, pa.Table.from_pylist(ROWS[:1]))
    names = lambda pattern: [f.path.rsplit("/", 1)[-1] for f in resolve_files(s3(pattern))[0]]
    assert names("g/*.parquet") == ["a.parquet"]
    assert names("g/**/*.parquet") == ["a.parquet", "b.parquet"]
    assert names("g") == ["a.parquet", "b.parquet"]
