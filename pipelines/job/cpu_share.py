"""Whether other processes are using this machine's cores while a job runs here: the machine's
busy CPU time (/proc/stat) less this process's and its children's (Ray and its engine workers
started here), between two readings. Linux only; elsewhere it says nothing."""

from __future__ import annotations

import os
from pathlib import Path

BUSY_OTHERS_MIN = 0.5  # cores other processes use on average before the job says so...
BUSY_OTHERS_SHARE = 0.25  # ...and this share of the machine's cores


def machine_busy_ticks(stat: str) -> int:
    """Busy clock ticks over all cores, from /proc/stat's first line (all but idle, iowait)."""
    fields = [int(v) for v in stat.splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def tree_ticks(proc: Path, root: int) -> int:
    """Clock ticks (user + system) of ``root`` and every live process descended from it."""
    parents, ticks = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # ended while read
            continue
        rest = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        parents[int(entry.name)] = int(rest[1])
        ticks[int(entry.name)] = int(rest[11]) + int(rest[12])  # utime, stime
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total


class OtherLoad:
    """Cores used by processes that are not this job's, on average since the last reading."""

    def __init__(self, proc: str = "/proc", root: int | None = None,
                 cores: int | None = None, ticks_per_s: int | None = None):
        self.proc = Path(proc)
        self.root = root or os.getpid()
        self.cores = cores or os.cpu_count() or 1
        self.ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self.last: tuple[int, int] | None = None

    def reading(self) -> tuple[int, int]:
        return (machine_busy_ticks((self.proc / "stat").read_text()),
                tree_ticks(self.proc, self.root))

    def others_cores(self, seconds: float) -> float | None:
        """Other processes' cores over the last ``seconds`` (since the previous call); None
        at the first call or where /proc cannot be read."""
        try:
            now = self.reading()
        except (OSError, ValueError, IndexError):
            return None
        before, self.last = self.last, now
        if before is None or seconds <= 0:
            return None
        others = (now[0] - before[0]) - (now[1] - before[1])
        return max(others, 0) / self.ticks_per_s / seconds

    def busy_line(self, others: float | None, engine_cores: float | None) -> str | None:
        """One line where others use a real share of the cores; else None."""
        if others is None or others < max(BUSY_OTHERS_MIN, BUSY_OTHERS_SHARE * self.cores):
            return None
        given = f" (the engine runs {engine_cores:g} threads)" if engine_cores else ""
        return (f"note: other processes are using {others:.1f} of this machine's {self.cores} "
                f"cores{given}: the job runs slower than on an idle machine")
