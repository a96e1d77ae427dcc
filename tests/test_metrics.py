"""Prometheus metrics of a run (``overnight run --metrics-port``, pipelines/report/metrics.py): a real
job on the tiny model, scraped over HTTP while it runs and once it is done; the numbers equal
what the job wrote."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import polars as pl

from pipelines import load_config, run_job
from pipelines.report.metrics import serve_metrics
from pipelines.job.progress import Progress

from conftest import REPO, cli, job_config

ROWS = [{"title": f"Lamp {i}", "description": None if i == 5 else "A steel lamp."}
        for i in range(40)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_runs_metrics_equal_what_it_wrote(tiny_model, ray_cluster, tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = load_config(job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out"))
    progress, port = Progress(total=0, enabled=False), _free_port()
    close = serve_metrics(progress, config.output.path, config.model.name, port)
    try:
        before = scrape(port)
        run_job(config, progress=progress)
        after = scrape(port)
    finally:
        close()
    assert before[("overnight_job_running", ())] == 1
    out = pl.read_parquet(tmp_path / "out")
    assert after[("overnight_job_running", ())] == 0
    assert after[("overnight_rows_planned", ())] == 40
    assert after[("overnight_rows_total", (("state", "ok"),))] == 39
    assert after[("overnight_rows_total", (("state", "failed"),))] == 1
    assert after[("overnight_row_errors_total", (("kind", "null_field"),))] == 1
    assert after[("overnight_tokens_total", (("kind", "output"),))] == \
        out["completion_tokens"].sum()
    assert after[("overnight_tokens_total", (("kind", "prompt"),))] == out["prompt_tokens"].sum()
    assert after[("overnight_tokens_total", (("kind", "generated"),))] >= \
        out["completion_tokens"].sum()
    assert after[("overnight_engine_restarts_total", ())] == 0
    assert after[("overnight_job_info", (("model", tiny_model),
                                         ("output", str(tmp_path / "out"))))] == 1
    # and the run report's
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert after[("overnight_rows_total", (("state", "failed"),))] == report["rows"]["errors"]
    assert after[("overnight_rows_total", (("state", "ok"),))] == report["rows"]["ok"]
    assert after[("overnight_tokens_total", (("kind", "output"),))] == \
        report["tokens"]["output"]["total"]
    last = after[("overnight_last_progress_timestamp_seconds", ())]
    assert after[("overnight_job_start_timestamp_seconds", ())] <= last <= time.time()


def test_the_cli_serves_metrics_while_the_job_runs(tiny_model, tmp_path, ray_cluster):
    import threading

    import yaml

    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_config(tiny_model, tmp_path / "in.jsonl",
                                              tmp_path / "out")))
    port = _free_port()
    codes = []  # the CLI in this process (its Ray), in a thread while this one scrapes
    run = threading.Thread(target=lambda: codes.append(
        cli("run", path, "--quiet", "--metrics-port", port)[0]))
    run.start()
    seen = []
    while run.is_alive():
        try:
            seen.append(scrape(port))
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    assert codes == [0]
    assert any(s[("overnight_job_running", ())] == 1 for s in seen)
    # the port is taken (by a listener of ours): one line, exit 2, before any engine starts
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        refused = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(path),
                                  "--quiet", "--overwrite", "--metrics-port", str(busy)],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(
        f"overnight: error: --metrics-port {busy}: cannot listen on 127.0.0.1:{busy}"), \
        refused.stderr
