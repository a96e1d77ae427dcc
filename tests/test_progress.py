"""The progress display, driven directly: a log file gets plain lines at an interval, a
terminal gets one line redrawn in place. (The real job's non-TTY output is checked in
test_resume.py.)"""

from __future__ import annotations

import io

import pytest

from pipelines.job.progress import Progress


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


class Clock:
    """A fake clock: ``progress.clock``, moved by hand."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def live(requests: int, tokens: int, seen: int, cap: int = 64) -> dict:
    """The replicas' counts (EngineHealth.snapshot): ``requests`` finished of ``seen`` at an
    engine, each with a budget of ``cap`` and using half of it."""
    return {"requests": requests, "tokens_finished": requests * cap // 2, "tokens": tokens,
            "requests_seen": seen, "cap_seen": seen * cap, "cap_finished": requests * cap}


def eta_of(line: str) -> str:
    return line.split("| eta ")[-1]


def test_no_eta_from_the_first_seconds_of_generation():
    """The demo model's first seconds once said `generated 0/400 ... eta 40:11` with 78 s
    left: no ETA before requests have finished, nor before a few seconds of generation, nor
    before two estimates agree; the line says what it waits for. Once shown, it stays."""
    clock, stream = Clock(), io.StringIO()
    progress = Progress(total=400, stream=stream, interval=0.0, clock=clock)
    progress.requests_total = 400
    progress.start("out/x")
    lines = []
    # 0.5 s a poll; 64 requests at an engine; 6 finished a second from the third second on,
    # at 100 tokens a second (a steady rate: the ETA settles)
    for step in range(1, 60):
        clock.now += 0.5
        t = step * 0.5
        done = max(0, int((t - 3) * 6))
        progress.update_live(live(done, int(100 * t), min(400, 64 + done)))
        lines.append(stream.getvalue().splitlines()[-1])
    first = lines[0]
    assert "generated 0/400" in first and eta_of(first).startswith("--:-- (")
    shown = [i for i, line in enumerate(lines) if not eta_of(line).startswith("--:--")]
    assert shown, lines
    start = shown[0]
    assert shown == list(range(start, len(lines)))  # once shown, it stays
    at = (start + 1) * 0.5  # seconds since the first tokens, when it is first shown
    assert at >= 5.0 and int(lines[start].split("generated ")[1].split("/")[0]) >= 20
    assert "measuring" in eta_of(lines[start - 1]), lines[start - 1]


def test_an_eta_waits_for_two_estimates_that_agree():
    """A rate that jumps (a burst, then a stall) keeps the ETA back until two estimates
    ETA_GAP_S apart agree within a quarter."""
    from pipelines.job.progress import EtaGate

    gate = EtaGate()
    total = 1000
    assert gate.waiting(0.0, float("nan"), 0, total, 0.0) == "waiting for the first output"
    assert "measuring" in gate.waiting(1.0, 100.0, 5, total, 1.0)  # too few, too soon
    assert "measuring" in gate.waiting(6.0, 100.0, 60, total, 6.0)  # the first estimate
    assert "not settled" in gate.waiting(8.0, 300.0, 70, total, 8.0)  # 300 against 98
    assert "not settled" in gate.waiting(10.0, 150.0, 80, total, 10.0)  # 150 against 298
    assert gate.waiting(12.0, 140.0, 90, total, 12.0) is None  # 140 against 148
    assert gate.waiting(13.0, 999.0, 91, total, 13.0) is None  # shown: it stays


def test_a_small_job_shows_an_eta_once_a_twentieth_is_done():
    """ETA_MIN_DONE requests, or a twentieth of a small job's: a 40-row job's ETA does not
    wait for 20 of them."""
    from pipelines.job.progress import EtaGate

    gate = EtaGate()
    assert "measuring" in gate.waiting(6.0, 10.0, 1, 40, 6.0)
    assert gate.waiting(6.0, 10.0, 2, 40, 6.0) is not None  # the first estimate
    assert gate.waiting(8.0, 8.0, 3, 40, 8.0) is None


def test_a_retry_run_counts_its_own_rows_never_past_100_percent_nor_a_negative_eta():
    """--retry-errors of 9 rows once showed `rows 12/9 (133%)` and a negative ETA (the
    writer counted the rows its parts kept; it now counts the rows re-run: test_write.py):
    whatever the counts say, the line stays within this run's total."""
    clock, stream = Clock(), io.StringIO()
    progress = Progress(total=9, stream=stream, interval=0.0, clock=clock)
    progress.start("out/x")
    for rows in (4, 4, 4):
        clock.now += 3
        progress.update(rows=rows, tokens=40, errors=0)
    for line in stream.getvalue().splitlines()[1:]:
        done, total = line.split(" (")[0].removeprefix("rows ").split("/")
        assert int(done) <= int(total) == 9, line
        assert "%" in line and int(line.split("(")[1].split("%")[0]) <= 100, line
        assert "eta -" not in line.replace("eta --:--", ""), line
    assert stream.getvalue().splitlines()[-1].startswith("rows 9/9 (100%)")


def test_a_parts_only_eta_waits_too_and_a_resume_counts_this_runs_rows():
    """Without the replicas' live counts (parts only): the same gate, on the rows this run
    generates (a resume's rows already written are not its work)."""
    clock, stream = Clock(), io.StringIO()
    progress = Progress(total=1000, stream=stream, interval=0.0, clock=clock)
    progress.start("out/x", already=600)
    etas = []
    for _ in range(12):
        clock.now += 1
        progress.update(rows=10, tokens=100, errors=0)
        etas.append(eta_of(stream.getvalue().splitlines()[-1]))
    assert etas[0].startswith("--:-- (measuring: 10/400 done")
    assert etas[-1] != "" and not etas[-1].startswith("--:--"), etas
    assert all(e.startswith("--:--") for e in etas[:5]), etas  # 5 s at least


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
    from pipelines.report.report_html import render_html

    samples = summary.report["samples"]
    assert len(samples) >= 5 and samples[-1]["tokens"] >= samples[0]["tokens"]
    page = render_html(summary.report)
    for heading in ("sampled from the replicas as they generate", "Sample rows: input and "
                    "output", "<th>sku</th>", "<th>rewritten</th>", "Replicas"):
        assert heading in page
    # before the first tokens: what runs, with its own seconds (the phases' unit test above)
    assert re.search(r"\| loading the model on \d+ replicas? \(\d+ s\) \|", stream.getvalue())
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
        if fraction < 0.2 or actual < 5 or eta == "--:--":  # not shown yet (EtaGate)
            continue
        minutes, seconds = eta.split(":")[-2:]
        estimate = int(minutes) * 60 + int(seconds)
        assert actual / 2 <= estimate <= actual * 2, (eta, actual, stream.getvalue())
        checked += 1
    assert checked >= 2, stream.getvalue()


def test_before_the_first_tokens_the_line_says_what_runs_with_its_own_seconds():
    """The demo once showed 51 s of `rows 0/300 ... eta --:--` while its engine loaded: each
    step before the first tokens is named with its own seconds, printed as it begins; the
    counts' first requests at an engine say the model is loaded; tokens bring the usual line."""
    clock, stream = Clock(), io.StringIO()
    progress = Progress(total=300, stream=stream, interval=60.0, clock=clock)
    progress.requests_total = 300
    progress.start("out/x")
    progress.phase("starting Ray")
    clock.now += 4
    progress.phase("loading the model on 1 replica")
    assert stream.getvalue().splitlines()[1].startswith("rows 0/300 (0%) | starting Ray (0 s)")
    lines = stream.getvalue().splitlines()
    assert lines[-1] == ("rows 0/300 (0%) | loading the model on 1 replica (0 s) | "
                         "elapsed 00:04 | eta --:--")
    clock.now += 12
    progress.update_live(live(0, 0, 0))  # no engine has reported: still loading
    assert "loading the model on 1 replica (12 s) | elapsed 00:16 | eta --:--" \
        in progress.line(clock.now)
    progress.update_live(live(0, 0, 64))  # requests at an engine, no token yet
    clock.now += 3
    assert "| first rows generating (3 s) | elapsed 00:19 | eta --:--" in progress.line(clock.now)
    progress.update_live(live(0, 50, 64))
    assert "generated 0/300" in progress.line(clock.now + 1)
    assert "first rows" not in progress.line(clock.now + 1)


def test_a_terminal_gets_the_phase_redrawn_and_a_note_on_a_line_of_its_own():
    stream = Terminal()
    progress = Progress(total=10, stream=stream)
    progress.start("out/x")
    progress.phase("starting Ray")
    progress.say("note: something")
    assert "\r\x1b[2Krows 0/10 (0%) | starting Ray (0 s)" in stream.getvalue()
    assert "\r\x1b[2Knote: something\n" in stream.getvalue()  # not glued to the redrawn line


def fake_proc(root, machine_busy: int, processes: dict[int, tuple[int, int]]) -> None:
    """A /proc with a first /proc/stat line and ``pid: (parent, ticks)`` processes."""
    root.mkdir(exist_ok=True)
    # user nice system idle iowait irq softirq steal: busy split over user and system
    (root / "stat").write_text(f"cpu  {machine_busy - 10} 0 10 5000 7 0 0 0 0 0\ncpu0 1 2\n")
    for pid, (parent, ticks) in processes.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(parent)] + ["0"] * 9 + [str(ticks - 1), "1"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} (a (weird) name) " + " ".join(fields))
    (root / "self").mkdir(exist_ok=True)  # not a process id: skipped


def test_the_cores_other_processes_use_are_the_machine_less_this_jobs_tree(tmp_path):
    from pipelines.job.cpu_share import OtherLoad, tree_ticks

    proc = tmp_path / "proc"
    # 100: the driver; 101 its Ray; 102 an engine under Ray; 200: another user's process
    job = {100: (1, 50), 101: (100, 100), 102: (101, 300), 200: (1, 1000)}
    fake_proc(proc, 2000, job)
    assert tree_ticks(proc, 100) == 450
    load = OtherLoad(proc=str(proc), root=100, cores=2, ticks_per_s=100)
    assert load.others_cores(0) is None  # the first reading
    # 10 s later: the machine did 1500 more ticks busy, the job's tree 600 of them
    fake_proc(proc, 3500, {**job, 102: (101, 900)})
    others = load.others_cores(10.0)
    assert others == pytest.approx(0.9)  # (1500 - 600) ticks / 100 per s / 10 s
    line = load.busy_line(others, 2)
    assert line.startswith("note: other processes are using 0.9 of this machine's 2 cores "
                           "(the engine runs 2 threads)")
    assert load.busy_line(0.3, 2) is None  # a sliver: nothing said
    assert OtherLoad(proc=str(tmp_path / "none")).others_cores(1.0) is None  # no /proc: silent
