"""The progress display, driven directly: a log file gets plain lines at an interval, a
terminal gets one line redrawn in place. (The real job's non-TTY output is checked in
test_resume.py.)"""

from __future__ import annotations

import io

import pytest

from pipelines.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_file_gets_plain_lines_no_carriage_returns():
    stream = io.StringIO()
    progress = Progress(total=100, stream=stream, interval=0.0)
    progress.start("out/x")
    for _ in range(4):
        progress.update(rows=25, tokens=250, errors=1)
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "overnight: 100 rows -> out/x"
    assert [line.split(" |")[0] for line in lines[1:]] == [
        "rows 25/100 (25%)", "rows 50/100 (50%)", "rows 75/100 (75%)", "rows 100/100 (100%)"]
    assert "errors 4" in lines[-1] and "eta 00:00" in lines[-1]


def test_log_file_lines_are_rate_limited():
    stream = io.StringIO()
    progress = Progress(total=1000, stream=stream, interval=3600)
    progress.start("out/x")
    for _ in range(9):
        progress.update(rows=100, tokens=1, errors=0)
    progress.update(rows=100, tokens=1, errors=0)  # the last one always prints
    assert len(stream.getvalue().splitlines()) == 2


def test_terminal_redraws_one_line():
    stream = Terminal()
    progress = Progress(total=10, stream=stream)
    progress.start("out/x", already=4)
    progress.update(rows=6, tokens=60, errors=0)
    progress.finish()
    text = stream.getvalue()
    assert "(resuming: 4 already written)" in text
    assert "\r\x1b[2Krows 10/10 (100%)" in text and text.endswith("\n")


@pytest.mark.serial  # an ETA holds only while the machine keeps its pace
def test_a_real_jobs_live_progress_has_an_eta_within_2x_after_the_first_fifth(
        tiny_model, ray_cluster, tmp_path):
    """A real job in a log (not a TTY): lines come from the replicas' live counts while
    blocks are in flight, long before parts commit, and after 20% of the requests every ETA
    is within 2x of the time the job then really took (where that is over 5 s: a log line's
    resolution). Outputs end before their max_tokens at lengths the ETA cannot know, as EOS
    ends a real model's: each row's min_tokens, with most of the vocabulary stop tokens
    (an ETA from the last 15 s's rate, less the tokens in flight, was off 2-5x here)."""
    import json
    import random
    import re
    from pathlib import Path

    from pipelines import load_config, run_job

    from conftest import job_config

    # ~15 s of generation on 2 cores: budgets of 16..255 tokens (started longest first),
    # each output some length up to its budget
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    lengths = random.Random(0)
    rows = []
    for i in range(1500):
        cap = 16 + (i * 37) % 240
        rows.append({"sku": f"P{i:04d}", "title": f"Thing {i}", "description": "words " * (i % 40),
                     "cap": cap, "o": json.dumps({"min_tokens": lengths.randint(8, cap)})})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(job_config(
        tiny_model, tmp_path / "in.jsonl", tmp_path / "out", input={"id_column": "sku"},
        sampling={"max_tokens": 256, "max_tokens_column": "cap", "overrides_column": "o",
                  "temperature": 1.0, "stop_token_ids": list(range(vocab // 10, vocab))},
        model={"max_model_len": 512}, resources={"batch_size": 64}))
    stream = io.StringIO()
    summary = run_job(config, progress=Progress(total=0, stream=stream, interval=1.0))
    import polars as pl

    ended = pl.read_parquet(tmp_path / "out")["finish_reason"]
    assert (ended == "stop").mean() > 0.9  # before their max_tokens, as EOS ends them

    # the report's throughput over time comes from the same live samples; its page shows
    # rows input beside output, and the replicas
    from pipelines.report import render_html

    samples = summary.report["samples"]
    assert len(samples) >= 5 and samples[-1]["tokens"] >= samples[0]["tokens"]
    page = render_html(summary.report)
    for heading in ("sampled from the replicas as they generate", "Sample rows: input and "
                    "output", "<th>sku</th>", "<th>rewritten</th>", "Replicas"):
        assert heading in page
    lines = [line for line in stream.getvalue().splitlines() if " written | generated " in line]
    parsed = []
    for line in lines:
        m = re.search(r"generated (\d+)/(\d+) .* elapsed (\d+):(\d+) \| eta (\S+)", line)
        done, total, minutes, seconds, eta = m.groups()
        parsed.append((int(done) / int(total), int(minutes) * 60 + int(seconds), eta))
    assert len(parsed) >= 5, stream.getvalue()
    assert any(fraction < 1 and "(0%) written" in line
               for (fraction, _, _), line in zip(parsed, lines))  # live before any part
    end = parsed[-1][1]
    checked = 0
    for fraction, elapsed, eta in parsed:
        actual = end - elapsed
        if fraction < 0.2 or actual < 5:
            continue
        minutes, seconds = eta.split(":")[-2:]
        estimate = int(minutes) * 60 + int(seconds)
        assert actual / 2 <= estimate <= actual * 2, (eta, actual, stream.getvalue())
        checked += 1
    assert checked >= 2, stream.getvalue()
