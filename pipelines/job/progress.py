"""Live progress: rows written / total, requests generated, output tokens/s, ETA, errors.

Two sources: the parts the writer commits (rows on disk, errors), and the replicas' live
counts (requests finished, output tokens generated so far, reported every ~2 s through the
job's EngineHealth actor: see udfs/engines/recovery.py). Several blocks are in flight at once and
long requests start first, so parts commit late; the live counts move from the first
step. The rate and the ETA are in tokens: the tokens left at the rate so far.

The tokens left are what the requests not finished will cost: their ``max_tokens`` (for
requests not yet at an engine, the mean ``max_tokens`` of those that are) times the share of
their budget finished requests used (1 with ignore_eos, or before any request finished; less
where EOS ends them early). Tokens the unfinished requests already hold are not taken off:
those requests are also the ones that run longest (the short ones finished first, so the
share used is low while they run), and a run's last requests run few at a time, at a lower
rate than the window saw. The rate is the output tokens per second since the first token,
over at most the last ``RATE_WINDOW_S``: a window that holds many turns of the engine's
whole batch (prefills, decodes, the gaps between waves of blocks), where the last 15 s saw
one moment's mix.

No ETA is shown until the rate it rests on is worth a guess (``EtaGate``): enough of this
run's work done (``ETA_MIN_DONE`` of it, or ``ETA_MIN_SHARE``), ``ETA_MIN_SECONDS`` of
generation, and two estimates ``ETA_GAP_S`` apart that agree within ``ETA_AGREE``; before
that the line says what it waits for: a first seconds' rate is far off. The rows counted are
the ones this run generates (a ``--retry-errors`` run's: the rows with errors), never more
than 100% of them.

Before the first tokens the line says what the job is doing instead (``phase``: starting Ray,
loading the model, the first rows generating), with that step's own seconds: an engine's start
takes a minute where the rows take none.

On a terminal one line is redrawn in place; in a log file (stdout not a TTY) a plain line is
printed every ``interval`` seconds instead of a flood of carriage returns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque

RATE_WINDOW_S = 1800.0  # the rate's window at most: since the first token, for short jobs
ETA_MIN_DONE = 20  # requests (or rows) finished before an ETA is shown...
ETA_MIN_SHARE = 0.05  # ...or this share of them
ETA_MIN_SECONDS = 5.0  # and this long generating
ETA_GAP_S = 2.0  # two estimates at least this far apart...
ETA_AGREE = 0.25  # ...that agree within this share
FIRST_ROWS = "first rows generating"  # the phase once requests are at an engine, before tokens


class EtaGate:
    """Whether an ETA is worth showing yet: it rests on enough work done and time spent, and
    two estimates ``ETA_GAP_S`` apart agree (each as the moment the run would end). Once
    shown it stays: an ETA that comes and goes says less than one that moves."""

    def __init__(self):
        self.shown = False
        self.earlier: tuple[float, float] | None = None  # (when, the end it foresaw)

    def waiting(self, now: float, eta: float, done: int, total: int, seconds: float) -> str | None:
        """None where ``eta`` may be shown; else what the ETA still waits for."""
        if self.shown:
            return None
        if eta != eta or done <= 0:  # NaN: no rate yet
            return "waiting for the first output"
        if done < min(ETA_MIN_DONE, max(1.0, ETA_MIN_SHARE * total)) \
                or seconds < ETA_MIN_SECONDS:
            return f"measuring: {done}/{total} done in {seconds:.0f} s"
        end = now + eta
        if self.earlier is None or now - self.earlier[0] >= ETA_GAP_S:
            before = self.earlier
            self.earlier = (now, end)
            if before is not None and now - before[0] >= ETA_GAP_S:
                left = max(before[1] - now, 0.0)  # what the earlier estimate says now
                if abs(left - eta) <= ETA_AGREE * max(left, eta, 1.0):
                    self.shown = True
                    return None
        return f"measuring: {done}/{total} done, the rate not settled yet"


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, interval: float = 10.0,
                 clock=time.time):
        self.total, self.enabled = total, enabled
        self.clock = clock  # time.time; a test's fake clock
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.5 if self.tty else interval
        self.done = self.tokens = self.errors = 0
        self.start_time = self.last_print = 0.0
        self.already = 0
        self.first = None  # (time, rows, tokens) at the first finished block: rates count
        # from there, so the engine's start-up does not drag the ETA for the whole night
        self.requests_total = 0  # requests this run generates (rows x samples)
        self.live: dict | None = None  # the replicas' counts: requests, tokens_finished, tokens
        self.live_first: tuple[float, int] | None = None  # (time, tokens) at the first tokens
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens): the rate's window
        self.lock = threading.Lock()  # the writer's parts and the replicas' counts both print
        # what the metrics endpoint adds (pipelines/report/metrics.py): errors by kind, prompt
        # tokens, when rows or tokens last moved, and whether the run has ended
        self.errors_by_kind: dict[str, int] = {}
        self.prompt_tokens = 0
        self.moved_at = 0.0
        self.finished = False
        self.gate = EtaGate()
        self.phase_text, self.phase_since = "", 0.0  # what runs before the first tokens

    def start(self, output: str, already: int = 0) -> None:
        self.start_time = self.last_print = self.clock()
        self.already = self.done = already
        self._emit(f"overnight: {self.total} rows -> {output}"
                   + (f" (resuming: {already} already written)" if already else ""))

    def phase(self, text: str) -> None:
        """What the job is doing until its first tokens (starting Ray, loading the model): the
        line shows it with its own seconds, printed at once (a step begun is news)."""
        with self.lock:
            now = self.clock()
            self.phase_text, self.phase_since = text, now
            if self.done < self.total:
                self.last_print = now
                self._emit(self.line(now), redraw=self.tty)

    def say(self, text: str) -> None:
        """A line of its own (what a run found before it starts)."""
        with self.lock:
            self._emit(text)

    def update(self, rows: int, tokens: int, errors: int, by_kind: dict | None = None,
               prompt_tokens: int = 0) -> None:
        with self.lock:
            now = self.clock()
            self.done += rows
            self.tokens += tokens
            self.errors += errors
            self.prompt_tokens += prompt_tokens
            for kind, n in (by_kind or {}).items():
                self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + n
            if rows or tokens:
                self.moved_at = now
            if self.first is None:
                self.first = (now, self.done, self.tokens)
            if now - self.last_print >= self.interval or self.done >= self.total:
                self.last_print = now
                self._emit(self.line(now), redraw=self.tty)

    def update_live(self, counts: dict) -> None:
        """The replicas' counts, summed (EngineHealth.snapshot)."""
        with self.lock:
            now = self.clock()
            if self.live is None or counts.get("tokens", 0) > self.live.get("tokens", 0):
                self.moved_at = now
            self.live = counts
            if not counts.get("tokens") and counts.get("requests_seen") \
                    and self.phase_text != FIRST_ROWS:  # at an engine: its model is loaded
                self.phase_text, self.phase_since = FIRST_ROWS, now
            if self.live_first is None and counts.get("tokens"):
                self.live_first = (now, counts["tokens"])
            if self.live_first is not None:
                while self.recent and now - self.recent[0][0] > RATE_WINDOW_S:
                    self.recent.popleft()
                self.recent.append((now, counts["tokens"]))
            if now - self.last_print >= self.interval and self.done < self.total:
                self.last_print = now
                self._emit(self.line(now), redraw=self.tty)

    def line(self, now: float) -> str:
        if self.live is not None and self.live_first is not None:
            return self._live_line(now)
        if self.phase_text and self.first is None:
            return self._phase_line(now)
        return self._parts_line(now)

    def _phase_line(self, now: float) -> str:
        """Before any tokens or rows: what runs, for how long; no rate, so no ETA."""
        return (f"{self._rows()} | {self.phase_text} ({now - self.phase_since:.0f} s) | "
                f"elapsed {_clock(now - self.start_time)} | eta --:--")

    def _live_line(self, now: float) -> str:
        live = self.live
        elapsed = max(now - self.start_time, 1e-9)
        since, tokens0 = self.recent[0] if self.recent else self.live_first
        window = now - since
        rate = (live["tokens"] - tokens0) / window if window >= 1.0 else 0.0
        requests, total = live["requests"], max(self.requests_total, live["requests"])
        if self.done >= self.total:  # every part is written: the counts may lag by a poll
            requests = total
        eta = self._tokens_left(live, total) / rate if rate > 0 else float("nan")
        eta = self._shown_eta(now, eta, requests, total, now - self.live_first[0])
        return (f"{self._rows()} written | generated "
                f"{requests}/{total} | {rate:.0f} tok/s out | errors {self.errors} | "
                f"elapsed {_clock(elapsed)} | {eta}")

    def _rows(self) -> str:
        """This run's rows written of its total: never past it, whatever a count says."""
        done = min(self.done, self.total)
        return f"rows {done}/{self.total} ({100.0 * done / max(self.total, 1):.0f}%)"

    def _shown_eta(self, now: float, eta: float, done: int, total: int,
                   seconds: float) -> str:
        """``eta MM:SS`` once the gate lets it through (never below zero); before that, what
        it waits for."""
        if self.done >= self.total:
            return f"eta {_clock(0.0)}"
        waiting = self.gate.waiting(now, eta, done, total, seconds)
        if waiting is not None:
            return f"eta --:-- ({waiting})"
        return f"eta {_clock(max(eta, 0.0))}"

    @staticmethod
    def _tokens_left(live: dict, total: int) -> float:
        """What the requests not finished will cost, in output tokens (module docstring)."""
        seen, cap_seen = live.get("requests_seen", 0), live.get("cap_seen", 0)
        if not seen:
            return float("nan")
        budget = cap_seen - live.get("cap_finished", 0)
        budget += max(total - seen, 0) * cap_seen / seen  # not at an engine yet
        finished = live.get("cap_finished", 0)
        used = min(live["tokens_finished"] / finished, 1.0) if finished else 1.0
        return max(budget * used, 0.0)

    def _parts_line(self, now: float) -> str:
        elapsed = max(now - self.start_time, 1e-9)
        since, rows0, tokens0 = self.first or (self.start_time, self.already, 0)
        if now - since < 1.0:  # one block so far: all we know is the rate since the start
            since, rows0, tokens0 = self.start_time, self.already, 0
        window = max(now - since, 1e-9)
        rate = (self.done - rows0) / window
        left = max(self.total - self.done, 0)
        eta = left / rate if rate > 0 else float("nan")
        generated = self.done - self.already  # this run's rows, against this run's total
        eta = self._shown_eta(now, eta, generated, self.total - self.already,
                              now - (self.first[0] if self.first else now))
        return (f"{self._rows()} | "
                f"{(self.tokens - tokens0) / window:.0f} tok/s out | errors {self.errors} | "
                f"elapsed {_clock(elapsed)} | {eta}")

    def finish(self) -> None:
        self.finished = True
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _emit(self, text: str, redraw: bool = False) -> None:  # with the lock held
        if not self.enabled:
            return
        # a line of its own on a terminal first clears the line redrawn there
        clear = "\r\x1b[2K" if self.tty else ""
        self.stream.write((clear + text) if redraw else clear + text + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    if seconds != seconds:  # NaN: no rate yet
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else \
        f"{rest // 60:02d}:{rest % 60:02d}"
