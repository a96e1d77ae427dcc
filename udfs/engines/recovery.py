"""Surviving engine death: a dead engine is replaced, a poison row isolated, a stall ended.

An engine dies in one of three ways: its process is killed (``kill -9``, out of memory, a
segfault in a kernel), it breaks inside a live process (the stepper's failure, vLLM's
``EngineDeadError``, a CUDA error), or it stops making progress. In each case the replica's
process ends: killed by the system, or ended here with ``os._exit`` after saying why. Ray
Data's actor pool then restarts the actor, which builds a new engine, and retries the blocks
the dead one held (``max_restarts`` and ``max_task_retries`` are unbounded in Ray Data; the
bound is ours, below).

``EngineHealth`` is a small Ray actor, one per job, that every replica reports to. It counts
restarts with their causes, refuses to let engines start again past ``max_restarts`` (the job
then stops in one line), and tracks the blocks in flight. A block that was in flight when an
engine died is a suspect: on its next attempt the replica runs it alone, first the rows known
to be safe, then each suspect range of rows in turn. A range that kills a fresh engine again
is halved, and the halves tried, until the rows that kill engines are single rows: those are
written with ``error_kind: engine_crash``, every other row of the block is generated. A block
that was only unlucky (its replica killed for another reason) passes its trial whole, at the
cost of running alone once.
"""

from __future__ import annotations

import os
import threading
import time

from udfs.columns import ErrorKind
from udfs.engines.engine import GenerationResult
from udfs.engines.engine import one_line as _one_line

PROGRESS_EVERY_S = 1.0  # how often a replica reports its live counts
DEATH_EXIT_CODE = 75  # os._exit status of a replica that ended itself (EX_TEMPFAIL)
UNREPORTED = ("the replica's process died without a word (killed, out of memory, or a crash "
              "in native code)")


class EngineRestartLimitError(RuntimeError):
    """Engines died more often than ``engine.max_restarts`` allows: the job stops."""


class EngineHealth:
    """The job's record of engine deaths and suspect blocks (a Ray actor; see module doc).

    Block keys are the first input ordinal of a predictor batch, stable across retries; row
    ranges are positions in that batch's list of requests."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.starts: dict[str, int] = {}  # actor id -> engine starts
        self.reported: dict[str, str] = {}  # actor id -> cause, said before it died
        self.restarts: list[dict] = []  # {"actor", "cause", "at"}
        self.blocks: dict[int, dict] = {}
        self.retried: set[int] = set()
        self.isolated: dict[str, str] = {}  # "block:row" -> cause
        self.refused: str | None = None
        self.live: dict[tuple[str, int], dict] = {}  # (actor, start) -> progress counts

    def hello(self, actor: str) -> str | None:
        """An engine is about to be built; the reason it may not, past the bound."""
        if self.starts.get(actor):
            cause = self.reported.pop(actor, None) or UNREPORTED
            self.restarts.append({"actor": actor, "cause": cause, "at": time.time()})
        self.starts[actor] = self.starts.get(actor, 0) + 1
        if self.refused is None and len(self.restarts) > self.max_restarts:
            last = self.restarts[-1]["cause"]
            self.refused = (f"engines died {len(self.restarts)} times, more than "
                            f"engine.max_restarts ({self.max_restarts}) allows; the last: {last}")
        return self.refused

    def died(self, actor: str, cause: str) -> None:
        self.reported[actor] = cause

    def progress(self, actor: str, counts: dict) -> None:
        """A replica's live counts (since its engine started: each start counts apart)."""
        self.live[(actor, self.starts.get(actor, 0))] = counts

    def snapshot(self) -> dict:
        """Requests finished, their tokens, and tokens generated, over every engine so far."""
        keys = ("requests", "tokens_finished", "tokens", "requests_seen", "cap_seen",
                "cap_finished", "idle_s")
        return {**{k: sum(c.get(k, 0) for c in self.live.values()) for k in keys},
                # engines restarted and rows isolated so far (the metrics endpoint's)
                "restarts": len(self.restarts), "isolated": len(self.isolated)}

    def begin(self, key: int, size: int) -> dict:
        """A replica starts a block: which of its rows are suspect, which known to kill."""
        block = self.blocks.setdefault(key, {"open": False, "trial": None, "suspects": [],
                                             "poison": {}})
        if block["open"]:  # its last attempt never ended: that engine died with it
            self.retried.add(key)
            cause = self.restarts[-1]["cause"] if self.restarts else UNREPORTED
            trial, block["trial"] = block["trial"], None
            if trial is not None:
                block["suspects"].remove(trial)
                first, end = trial
                if end - first == 1:
                    block["poison"][first] = cause
                    self.isolated[f"{key}:{first}"] = cause
                else:
                    middle = (first + end) // 2
                    block["suspects"][:0] = [(first, middle), (middle, end)]
            elif not block["suspects"]:
                block["suspects"] = [(0, size)]
        block["open"] = True
        return {"suspects": list(block["suspects"]), "poison": dict(block["poison"])}

    def trial(self, key: int, rows: tuple[int, int]) -> None:
        self.blocks[key]["trial"] = rows

    def cleared(self, key: int, rows: tuple[int, int]) -> None:
        block = self.blocks[key]
        block["suspects"].remove(rows)
        block["trial"] = None

    def end(self, key: int) -> None:
        block = self.blocks[key]
        if block["poison"] or key in self.retried:
            block["open"] = False
        else:  # nothing to remember about a block that never met a death
            del self.blocks[key]

    def summary(self) -> dict:
        return {"restarts": list(self.restarts), "retried_blocks": len(self.retried),
                "isolated_rows": len(self.isolated),
                "isolated_causes": sorted(set(self.isolated.values()))}


class Recovery:
    """A replica's side of it: reports to ``EngineHealth`` (found by name), runs suspect
    blocks alone, ends the process when its engine is dead or stalled."""

    def __init__(self, health: str | None, stall_timeout_s: float | None):
        import ray

        self.health = ray.get_actor(health) if health else None
        self.stall_timeout_s = stall_timeout_s
        self.actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        self.exclusive = _SharedExclusive()
        if self.health is not None:  # before an engine is built: past the bound, none is
            refusal = self._ask(self.health.hello, self.actor)
            if refusal:
                raise EngineRestartLimitError(refusal)

    def watch(self, engine) -> None:
        """Once the engine is built: report its progress, and end this replica if it
        stalls."""
        if self.health is not None or self.stall_timeout_s:
            threading.Thread(target=self._watch, args=(engine,), name="overnight-watch",
                             daemon=True).start()

    def generate(self, engine, key: int, requests: list) -> list[GenerationResult]:
        if self.health is None or not requests:
            return self._run(engine, requests)
        plan = self._ask(self.health.begin, key, len(requests))
        if not plan["suspects"] and not plan["poison"]:
            with self.exclusive.shared():
                results = self._run(engine, requests)
        else:
            with self.exclusive.alone():
                results = self._isolate(engine, key, requests, plan)
        self.health.end.remote(key)  # no wait: nothing hangs on it, and calls stay in order
        return results

    def _isolate(self, engine, key: int, requests: list, plan: dict) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        poison = {int(i): cause for i, cause in plan["poison"].items()}
        for i, cause in poison.items():
            results[i] = GenerationResult(None, None, None, error_kind=ErrorKind.ENGINE_CRASH,
                                          error=f"an engine died on this row: {cause}"[:500])
        suspect = {i for first, end in plan["suspects"] for i in range(first, end)}
        safe = [i for i in range(len(requests)) if i not in suspect and i not in poison]
        self._fill(engine, requests, safe, results)
        for first, end in plan["suspects"]:
            self._ask(self.health.trial, key, (first, end))
            self._fill(engine, requests, [i for i in range(first, end) if i not in poison],
                       results)
            self._ask(self.health.cleared, key, (first, end))
        return results

    def _fill(self, engine, requests: list, rows: list[int], results: list) -> None:
        for i, result in zip(rows, self._run(engine, [requests[i] for i in rows])):
            results[i] = result

    def _run(self, engine, requests: list) -> list[GenerationResult]:
        try:
            return engine.generate(requests)
        except Exception as exc:  # the engine is dead: this process goes, a new one comes
            self.engine_died(_one_line(exc))

    def engine_died(self, cause: str) -> None:
        """Say why, then end this replica's process: Ray restarts the actor and retries its
        blocks. Never returns."""
        try:
            if self.health is not None:
                self._ask(self.health.died, self.actor, cause, timeout=10)
        finally:
            os._exit(DEATH_EXIT_CODE)

    def _watch(self, engine) -> None:
        period = min(PROGRESS_EVERY_S, max(0.2, (self.stall_timeout_s or 60) / 4))
        stall_check = self.stall_timeout_s and hasattr(engine, "stalled_for")
        while True:
            time.sleep(period)
            if self.health is not None and hasattr(engine, "progress"):
                try:
                    self.health.progress.remote(self.actor, engine.progress())  # no wait
                except Exception:  # noqa: BLE001 - the job is ending; progress is no matter
                    pass
            stalled = engine.stalled_for() if stall_check else 0.0
            if stall_check and stalled > self.stall_timeout_s:
                self.engine_died(f"EngineStalled: no step finished for {stalled:.0f} s with "
                                 f"requests pending (engine.stall_timeout_s "
                                 f"{self.stall_timeout_s:g})")

    @staticmethod
    def _ask(method, *args, timeout: float | None = 120):
        import ray

        return ray.get(method.remote(*args), timeout=timeout)


class _SharedExclusive:
    """A lock that many blocks hold together, or one suspect block alone (a waiting suspect
    goes before blocks that arrive after it)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting_alone = 0

    def shared(self):
        return _Held(self._enter_shared, self._exit_shared)

    def alone(self):
        return _Held(self._enter_alone, self._exit_alone)

    def _enter_shared(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._shared += 1

    def _exit_shared(self):
        with self._cond:
            self._shared -= 1
            self._cond.notify_all()

    def _enter_alone(self):
        with self._cond:
            self._waiting_alone += 1
            self._cond.wait_for(lambda: not self._alone and self._shared == 0)
            self._waiting_alone -= 1
            self._alone = True

    def _exit_alone(self):
        with self._cond:
            self._alone = False
            self._cond.notify_all()


class _Held:
    def __init__(self, enter, exit_):
        self._enter, self._exit = enter, exit_

    def __enter__(self):
        self._enter()

    def __exit__(self, *exc):
        self._exit()

