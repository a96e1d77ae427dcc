"""Engines that die are replaced and the job goes on (udfs/engines/recovery.py), on the real CPU engine
through real Ray: a replica killed with kill -9, an engine broken inside its process, a row
that kills every engine it reaches, a stalled engine, and the restart bound.

Each case is one ``overnight run`` in a process of its own (its own Ray), faults injected by
tests/faults/sitecustomize.py, which the test puts on that process's PYTHONPATH. Sampling is
seeded (temperature 0.8): a recovered run must equal the uninterrupted reference row for row.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from pipelines import load_config, run_job
from udfs.columns import ErrorKind

from conftest import REPO, job_config

ROWS = 96
POISON_ROW, POISON_TOKENS = 29, 13  # the marked row asks for 13 tokens; none other does
FAULTS = REPO / "tests" / "faults"


def rows(count: int) -> list[dict]:
    return [{"sku": f"E{i:03d}", "title": f"Chair {i}", "description": f"seat number {i}",
             "cap": POISON_TOKENS if i == POISON_ROW else None} for i in range(count)]


def config(tiny_model: str, root: Path, name: str, count: int = ROWS, **engine) -> dict:
    raw = job_config(tiny_model, root / f"in-{count}.jsonl", root / name,
                     input={"id_column": "sku"},
                     sampling={"temperature": 0.8, "seed": 7, "max_tokens": 16,
                               "max_tokens_column": "cap"},
                     resources={"batch_size": 4})
    raw["engine"].update(engine)
    return raw


@pytest.fixture(scope="session")
def recovery_job(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    for count in (ROWS, 200):
        (root / f"in-{count}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows(count)))
    run_job(load_config(config(tiny_model, root, "reference")))
    return root, pl.read_parquet(root / "reference")


def run(root: Path, raw: dict, fault: str | None = None, kill_after_parts: int | None = None,
        **env) -> tuple[subprocess.CompletedProcess, float]:
    """``overnight run`` of ``raw`` in its own process (and Ray), with a fault."""
    path = root / f"{Path(raw['output']['path']).name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(FAULTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if fault:
        environ.update({"OVERNIGHT_TEST_FAULT": fault,
                        "OVERNIGHT_TEST_FAULT_MARKER": str(root / f"{path.stem}.fault"),
                        "OVERNIGHT_TEST_POISON_TOKENS": str(POISON_TOKENS), **env})
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(path)],
                            cwd=REPO, env=environ, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if kill_after_parts is not None:
            _kill_predictor_after(Path(raw["output"]["path"] + ".partial"), kill_after_parts,
                                  session=proc.pid)
        out, err = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), \
        time.time() - started


def _kill_predictor_after(staging: Path, parts: int, session: int) -> None:
    """kill -9 the engine's actor process once ``parts`` parts are committed."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if staging.exists() and len(list(staging.glob("part-*.parquet"))) >= parts:
            for pid in _predictor_pids(session):
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)
    raise AssertionError("the job never committed enough parts to be killed mid-run")


def _predictor_pids(session: int) -> list[int]:
    """The engine actors of the job whose driver leads ``session`` (Ray's processes stay in
    their driver's session), not those of jobs other tests run at the same time."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"MapBatches(Predictor)" in (entry / "cmdline").read_bytes() \
                        and os.getsid(int(entry.name)) == session:
                    found.append(int(entry.name))
            except OSError:
                continue
    assert found, "no predictor process to kill"
    return found


def restarts(root: Path, name: str) -> list[dict]:
    report = json.loads((root / f"{name}.report.json").read_text())
    return report["recovery"]["restarts"]


def test_a_replica_killed_with_kill_9_is_replaced_and_the_output_is_whole(recovery_job,
                                                                          tiny_model):
    root, reference = recovery_job
    done, seconds = run(root, config(tiny_model, root, "killed"), kill_after_parts=1)
    assert done.returncode == 0, done.stderr
    assert pl.read_parquet(root / "killed").equals(reference)
    (restart,) = restarts(root, "killed")
    assert "died without a word" in restart["cause"]
    assert "1 engine restart(s)" in done.stdout
    print(f"kill -9 recovered; whole run {seconds:.1f} s")


def test_an_engine_broken_inside_its_process_is_replaced(recovery_job, tiny_model):
    root, reference = recovery_job
    done, seconds = run(root, config(tiny_model, root, "broken"), fault="break",
                        OVERNIGHT_TEST_FAULT_AFTER="20")
    assert done.returncode == 0, done.stderr
    assert pl.read_parquet(root / "broken").equals(reference)
    (restart,) = restarts(root, "broken")
    assert "injected engine failure" in restart["cause"]
    print(f"broken engine recovered; whole run {seconds:.1f} s")


def test_a_stalled_engine_is_replaced_within_its_timeout(recovery_job, tiny_model):
    root, reference = recovery_job
    done, seconds = run(root, config(tiny_model, root, "stalled", stall_timeout_s=4),
                        fault="stall", OVERNIGHT_TEST_FAULT_AFTER="20")
    assert done.returncode == 0, done.stderr
    assert pl.read_parquet(root / "stalled").equals(reference)
    (restart,) = restarts(root, "stalled")
    assert restart["cause"].startswith("EngineStalled: no step finished for")
    print(f"stalled engine recovered; whole run {seconds:.1f} s")


def test_a_poison_row_is_isolated_and_every_other_row_generated(recovery_job, tiny_model):
    root, _ = recovery_job
    done, seconds = run(root, config(tiny_model, root, "poisoned", count=200), fault="poison")
    assert done.returncode == 0, done.stderr
    out = pl.read_parquet(root / "poisoned")
    assert out.height == 200
    crashed = out.filter(pl.col("error_kind") == ErrorKind.ENGINE_CRASH)
    assert crashed["sku"].to_list() == [f"E{POISON_ROW:03d}"]
    assert crashed["error"][0].startswith("an engine died on this row")
    others = out.filter(pl.col("sku") != f"E{POISON_ROW:03d}")
    assert others["error"].null_count() == 199 and others["rewritten"].null_count() == 0
    report = json.loads((root / "poisoned.report.json").read_text())["recovery"]
    assert report["isolated_rows"] == 1 and len(report["restarts"]) >= 2
    print(f"poison row isolated after {len(report['restarts'])} restarts; whole run "
          f"{seconds:.1f} s")


def test_past_the_restart_bound_the_job_stops_in_one_line_and_keeps_its_parts(
        recovery_job, tiny_model):
    root, _ = recovery_job
    done, _ = run(root, config(tiny_model, root, "bounded", max_restarts=1), fault="poison")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("overnight: error")]
    assert len(errors) == 1, done.stderr
    assert "EngineRestartLimitError: engines died 2 times, more than engine.max_restarts (1)" \
        in errors[0], errors[0]
    assert (root / "bounded.partial").is_dir()  # the parts written are kept for a re-run
