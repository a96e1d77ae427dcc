"""Fault injection for tests/test_recovery.py, never shipped: on the PYTHONPATH of an
``overnight run`` the test starts, Python imports this in every process of the job (the
driver, Ray's workers), and it breaks the in-process engine the way the test asks:

  OVERNIGHT_TEST_FAULT=break   the engine raises inside its live process, once per job
  OVERNIGHT_TEST_FAULT=stall   the engine stops making progress, once per job
  OVERNIGHT_TEST_FAULT=poison  the process dies (SIGKILL) whenever a request with
                               max_tokens == OVERNIGHT_TEST_POISON_TOKENS reaches the engine
  OVERNIGHT_TEST_FAULT=reclaim the engine stops for good at the Nth request with max_tokens
                               == OVERNIGHT_TEST_POISON_TOKENS, after creating the marker
                               file: the test, seeing it, kills the whole job (a spot reclaim
                               in the middle of the step whose requests ask for that many)
  OVERNIGHT_TEST_FAULT=hold    a request the HTTP engine (a served batch's) would send with
                               max_tokens == OVERNIGHT_TEST_POISON_TOKENS never gets an answer:
                               a batch's slow tail without the CPU of generating it

"Once per job" is kept by a marker file (OVERNIGHT_TEST_FAULT_MARKER), so the engine that
replaces the broken one runs normally. The fault strikes at the Nth request added
(OVERNIGHT_TEST_FAULT_AFTER), mid-job.
"""

import os

FAULT = os.environ.get("OVERNIGHT_TEST_FAULT")

if FAULT == "hold":
    import asyncio

    import udfs.engines.http_engine as http_module

    _one = http_module.HTTPEngine._one
    _held = int(os.environ.get("OVERNIGHT_TEST_POISON_TOKENS", "-1"))

    async def _held_one(self, request):
        if request.max_tokens == _held:
            await asyncio.sleep(3600)
        return await _one(self, request)

    http_module.HTTPEngine._one = _held_one

elif FAULT:
    import signal
    import time

    import udfs.engines.stepper as engine_module

    _add = engine_module.Stepper._add
    _seen = {"adds": 0}
    marker = os.environ.get("OVERNIGHT_TEST_FAULT_MARKER", "")
    after = int(os.environ.get("OVERNIGHT_TEST_FAULT_AFTER", "20"))
    poison = int(os.environ.get("OVERNIGHT_TEST_POISON_TOKENS", "-1"))

    def _once() -> bool:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def _faulty_add(self, batch, index):
        _seen["adds"] += 1
        if FAULT == "poison" and batch.requests[index].max_tokens == poison:
            os.kill(os.getpid(), signal.SIGKILL)
        if FAULT == "reclaim" and batch.requests[index].max_tokens == poison:
            _seen["marked"] = _seen.get("marked", 0) + 1
            if _seen["marked"] >= after and _once():
                time.sleep(3600)
        if FAULT in ("break", "stall") and _seen["adds"] >= after and _once():
            if FAULT == "break":
                raise RuntimeError("injected engine failure (CUDA error: an illegal memory "
                                   "access was encountered)")
            time.sleep(3600)
        return _add(self, batch, index)

    engine_module.Stepper._add = _faulty_add
