"""The progress display, driven directly: a log file gets plain lines at an interval, a
terminal gets one line redrawn in place. (The real job's non-TTY output is checked in
test_resume.py.)"""

from __future__ import annotations

import io

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
