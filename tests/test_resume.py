"""Resume after a crash: a real job killed mid-run, run again, equals an uninterrupted run.

Sampling is seeded and not greedy (temperature 0.8): each row's seed derives from the job seed
and its id, so the resumed rows must match the reference to the character.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines import load_config, run_job
from pipelines.write import part_name, part_range

from conftest import REPO, cli, job_config, kill_after_parts

ROWS = 240
BLOCK = 4


@pytest.fixture(scope="session")
def resume_job(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    rows = [{"sku": f"R{i:04d}", "title": f"Item {i}",
             "description": None if i % 37 == 5 else f"Thing number {i} 🙂"}
            for i in range(ROWS)]
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(output: Path) -> dict:
        return job_config(tiny_model, root / "in.jsonl", output,
                          input={"id_column": "sku"},
                          sampling={"temperature": 0.8, "seed": 3, "max_tokens": 32},
                          resources={"batch_size": BLOCK},
                          # a file per block (parts are ~2 KB): --retry-errors re-runs
                          # blocks in files of their own, and a file without errors is kept
                          output={"file_size_mb": 0.001})

    def write_config(name: str) -> Path:
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config(root / name)))
        return path

    return root, config, write_config


@pytest.fixture(scope="session")
def reference(resume_job, ray_cluster):
    root, config, _ = resume_job
    run_job(load_config(config(root / "reference")))
    return pl.read_parquet(root / "reference")


def overnight(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=600, **kwargs)


def settled_parts(staging: Path, quiet_s: float = 5.0) -> list[str]:
    """The staged parts once no new one has come for ``quiet_s`` seconds."""
    names, since = None, time.time()
    while True:
        now = sorted(p.name for p in staging.glob("part-*.parquet"))
        if now != names:
            names, since = now, time.time()
        elif time.time() - since >= quiet_s:
            return names
        time.sleep(0.2)


def assert_same_output(out_dir: Path, reference: pl.DataFrame):
    out = pl.read_parquet(out_dir)
    assert out["sku"].to_list() == reference["sku"].to_list()
    assert out.equals(reference)


def test_killed_then_interrupted_then_resumed_equals_an_uninterrupted_run(resume_job, reference,
                                                                         capsys):
    """A spot reclaim (SIGKILL to the whole process group), then a Ctrl-C during the resumed
    run, then a run to the end: the output equals the uninterrupted run's, row for row."""
    root, _, write_config = resume_job
    path = write_config("killed")
    code, _ = kill_after_parts(path, root / "killed.partial", 3, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert not (root / "killed").exists()  # nothing that looks finished
    # the engine's actor writes its parts itself: blocks it had in hand may still land
    # (whole) for a moment after the driver died
    written = settled_parts(root / "killed.partial")
    assert 3 <= len(written) < ROWS // BLOCK
    for name in written:  # every committed part is whole
        assert pq.read_table(root / "killed.partial" / name).num_rows == BLOCK

    status = overnight("status", root / "killed")
    assert status.returncode == 0 and "state: unfinished" in status.stdout
    assert f"/{ROWS} written" in status.stdout

    code, _, err = cli("run", path, "--set", "sampling.max_tokens=20", capsys=capsys)
    assert code == 2  # (refused before any engine, in this process)
    assert "holds an unfinished run of a different job (sampling changed)" in err

    code, stderr = kill_after_parts(path, root / "killed.partial", len(written) + 2,
                                    signal.SIGINT)
    assert code == 130, stderr
    assert "interrupted; the parts written are kept" in stderr
    assert not (root / "killed").exists()
    before = len(settled_parts(root / "killed.partial"))
    assert before >= len(written) + 2

    resumed = overnight("run", path)  # progress on: stderr is a pipe, as in a log file
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed: {before * BLOCK} rows were written by an earlier run" in resumed.stdout
    progress = [line for line in resumed.stderr.splitlines() if line.startswith("rows ")]
    assert progress and "\r" not in resumed.stderr  # plain lines, no carriage returns
    assert progress[-1].startswith(f"rows {ROWS}/{ROWS} (100%)")
    assert (f"overnight: {ROWS} rows -> {root / 'killed'} (resuming: {before * BLOCK} "
            "already written)") in resumed.stderr
    assert_same_output(root / "killed", reference)
    assert not (root / "killed.partial").exists()


def test_retry_errors_reruns_only_the_failed_rows(resume_job, reference, ray_cluster):
    root, config, _ = resume_job
    out = root / "retry"
    # the reference run's output and record, as if this job had just been run
    shutil.copytree(root / "reference", out)
    shutil.copy(root / "reference.overnight.json", root / "retry.overnight.json")
    # A transient engine failure, as the job records one: the row keeps no text.
    victim = part_name(8, 12)
    part = pl.read_parquet(out / victim)
    part = part.with_columns(
        pl.when(pl.col("sku") == "R0009").then(None).otherwise(pl.col("rewritten"))
        .alias("rewritten"),
        pl.when(pl.col("sku") == "R0009").then(pl.lit("engine_error"))
        .otherwise(pl.col("error_kind")).alias("error_kind"),
        pl.when(pl.col("sku") == "R0009").then(pl.lit("simulated: engine restarted"))
        .otherwise(pl.col("error")).alias("error"),
        pl.when(pl.col("sku") == "R0009").then(None).otherwise(pl.col("completion_tokens"))
        .alias("completion_tokens"),
        pl.when(pl.col("sku") == "R0009").then(None).otherwise(pl.col("finish_reason"))
        .alias("finish_reason"),
    )
    part.write_parquet(out / victim)
    untouched = os.stat(out / part_name(0, 4)).st_ino  # a file with no error

    failed_before = pl.read_parquet(out).filter(pl.col("error").is_not_null()).height
    summary = run_job(load_config(config(out)), retry_errors=True)

    assert summary.rows_resumed == ROWS - failed_before  # only the failed rows ran
    assert_same_output(out, reference)  # R0009 regenerated; null rows fail as before
    assert os.stat(out / part_name(0, 4)).st_ino == untouched  # linked, not rewritten


def test_a_run_stopped_in_its_commit_is_finished_by_the_same_command(resume_job, reference):
    """Killed after the staging folder became the output and before the record said so:
    `overnight status` and the same `overnight run` finish the commit (it once said "already
    exists; pass --overwrite", which would generate every row again). A commit stopped
    between its two renames leaves the old output aside: cleared once the new one is in."""
    root, _, write_config = resume_job
    path = write_config("stopped-commit")
    out, record_file = root / "stopped-commit", root / "stopped-commit.overnight.json"
    shutil.copytree(root / "reference", out)
    record = json.loads((root / "reference.overnight.json").read_text())
    record_file.write_text(json.dumps({**record, "state": "committing"}))
    aside = root / ".stopped-commit.replaced-0123abcd"  # the output a --overwrite replaced
    shutil.copytree(root / "reference", aside)
    inode = os.stat(out / sorted(os.listdir(out))[0]).st_ino

    status = overnight("status", out)
    assert status.returncode == 0 and "state: committing (interrupted" in status.stdout
    done = overnight("run", path, "--quiet")
    assert done.returncode == 0, done.stderr
    assert json.loads(record_file.read_text())["state"] == "complete"
    assert not aside.exists() and not (root / "stopped-commit.partial").exists()
    assert os.stat(out / sorted(os.listdir(out))[0]).st_ino == inode  # nothing rewritten
    assert_same_output(out, reference)
    assert json.loads((root / "stopped-commit.report.json").read_text())["rows"]["input"] \
        == ROWS


def test_a_part_that_cannot_be_read_stops_the_commit_in_one_line_naming_it(resume_job,
                                                                           reference):
    """A corrupt staged part (a disk fault) once stopped compaction with a RayTaskError
    traceback; now one line names the part and what to do, and the rest stay staged."""
    root, _, write_config = resume_job
    path = write_config("corrupt")
    staging = root / "corrupt.partial"
    shutil.copytree(root / "reference", staging)
    record = json.loads((root / "reference.overnight.json").read_text())
    (root / "corrupt.overnight.json").write_text(json.dumps(
        {"state": "running", "rows_total": ROWS, "fingerprint": record["fingerprint"]}))
    victim = staging / part_name(8, 12)
    victim.write_bytes(victim.read_bytes()[:100])  # cut short

    done = overnight("run", path, "--quiet")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("overnight: error")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{victim}: this part cannot be read" in lines[0]
    assert "remove it and run the same command again" in lines[0]
    victim.unlink()
    status = overnight("status", root / "corrupt")
    assert f"rows: {ROWS - BLOCK}/{ROWS} written" in status.stdout, status.stdout


def test_a_small_table_is_committed_a_block_at_a_time_as_its_rows_finish(tiny_model, tmp_path,
                                                                        capsys):
    """400 rows at the default batch_size (256) were two blocks, written when all their rows
    were done: a kill at 90% lost every row. Now a table too small for 16 blocks of
    batch_size is cut into 16 (the engine holds as many rows at once as before), and each is
    committed as it is done. Rows whose caps grow down the table finish in order."""
    from pipelines.read import plan_block_rows

    assert plan_block_rows(400, 256) == 25 and plan_block_rows(100_000, 256) == 256
    assert plan_block_rows(20, 256) == 8
    rows = 400
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(
        {"title": f"Item {i}", "description": "thing", "cap": 1 + i // 4}) + "\n"
        for i in range(rows)))
    config = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                        sampling={"max_tokens": 128, "max_tokens_column": "cap"})
    del config["resources"]  # the default batch_size
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, err = cli("validate", path, capsys=capsys)
    assert code == 0, err
    assert "16 blocks of up to 25 rows, each committed as it is done" in out

    code, _ = kill_after_parts(path, tmp_path / "out.partial", 1, signal.SIGKILL)
    assert code != 0  # killed while it ran
    staged = [part_range(p.name) for p in (tmp_path / "out.partial").glob("part-*.parquet")]
    done = sum(end - start for start, end in staged)
    assert 0 < done <= rows // 2, staged  # the first blocks, committed long before the last
