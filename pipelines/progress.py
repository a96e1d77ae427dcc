"""Live progress: rows done / total, output tokens/s, ETA, errors so far.

On a terminal one line is redrawn in place; in a log file (stdout not a TTY) a plain line is
printed every ``interval`` seconds instead of a flood of carriage returns.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, interval: float = 10.0):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.5 if self.tty else interval
        self.done = self.tokens = self.errors = 0
        self.start_time = self.last_print = 0.0
        self.already = 0
        self.first = None  # (time, rows, tokens) at the first finished block: rates count
        # from there, so the engine's start-up does not drag the ETA for the whole night

    def start(self, output: str, already: int = 0) -> None:
        self.start_time = self.last_print = time.time()
        self.already = self.done = already
        self._emit(f"overnight: {self.total} rows -> {output}"
                   + (f" (resuming: {already} already written)" if already else ""))

    def update(self, rows: int, tokens: int, errors: int) -> None:
        now = time.time()
        self.done += rows
        self.tokens += tokens
        self.errors += errors
        if self.first is None:
            self.first = (now, self.done, self.tokens)
        if now - self.last_print >= self.interval or self.done >= self.total:
            self.last_print = now
            self._emit(self.line(now), redraw=self.tty)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start_time, 1e-9)
        since, rows0, tokens0 = self.first or (self.start_time, self.already, 0)
        if now - since < 1.0:  # one block so far: all we know is the rate since the start
            since, rows0, tokens0 = self.start_time, self.already, 0
        window = max(now - since, 1e-9)
        rate = (self.done - rows0) / window
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        pct = 100.0 * self.done / max(self.total, 1)
        return (f"rows {self.done}/{self.total} ({pct:.0f}%) | "
                f"{(self.tokens - tokens0) / window:.0f} tok/s out | errors {self.errors} | "
                f"elapsed {_clock(elapsed)} | eta {_clock(eta)}")

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _emit(self, text: str, redraw: bool = False) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r\x1b[2K" + text) if redraw else text + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    if seconds != seconds:  # NaN: no rate yet
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else \
        f"{rest // 60:02d}:{rest % 60:02d}"
