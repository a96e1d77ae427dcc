"""The one thread that runs an in-process vLLM engine, and the queue of requests waiting for it.

Every block's ``generate`` call hands its requests (a ``Batch``) to the ``Stepper``, which adds
them to the engine as sequence slots free and steps it."""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from typing import Sequence

from udfs.rows import images
from udfs.columns import ErrorKind
from udfs.engines import vllm_outputs
from udfs.engines.engine import GenerationRequest, GenerationResult
from udfs.engines.engine import one_line as _one_line


class Batch:
    """One ``generate`` call's requests, and where their results land."""

    def __init__(self, requests: Sequence[GenerationRequest]):
        self.requests = requests
        self.results: list[GenerationResult | None] = [None] * len(requests)
        self.waiting = len(requests)
        self.done = threading.Event()
        self.failure: BaseException | None = None

    def set(self, index: int, result: GenerationResult) -> None:
        self.results[index] = result
        self.waiting -= 1
        if self.waiting == 0:
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.failure = exc
        self.done.set()


class Stepper:
    """The one thread that touches the engine: it adds each arriving batch's requests and
    steps the engine while any request is unfinished. New blocks join the running batch
    at the next step, so the engine never drains at a block boundary.

    Requests wait here, not in the engine's queue, until the engine has a free sequence slot
    (``max_num_seqs``), and the one added next is the one with the least slack: arrival step
    minus ``max_tokens``. Long requests start first, so short ones fill the batch at the end
    of a run instead of a few long ones running alone; and a request that has
    waited N steps goes before any newcomer not more than N tokens longer, so no block
    starves.

    On CPU it builds the engine too. OpenMP gives each thread that runs parallel work a team
    of its own, and once a process has more OpenMP threads than cores, libgomp stops its
    threads spinning between parallel regions: they sleep, and every region waits for them
    to wake. A CPU engine built in one thread and run in another had two teams, and ran at
    0.8 of bare vLLM's speed (its second core a third idle); built and run in one thread, it
    has one team, as bare vLLM has."""

    def __init__(self, engine, build, build_there: bool):
        """``engine``: the VLLMEngine (udfs/engines/vllm_engine.py) whose ``llm`` it builds or runs."""
        self.engine = engine
        self.inbox: queue.SimpleQueue[Batch] = queue.SimpleQueue()
        self.waiting = _Waiting()  # not yet in the engine
        self.pending: dict[str, tuple[Batch, int]] = {}  # in the engine, by request id
        self.counter = itertools.count()
        self.steps = 0
        self.busy_since: float | None = None  # last step finished, or work arrived (monotonic)
        # live progress (udfs/engines/recovery.py reports it): requests finished, their tokens, and
        # tokens generated so far including unfinished requests' (counted once a second)
        self.requests_done = self.tokens_finished = self.tokens_live = 0
        self._counted_at = 0.0
        # and the token budget: max_tokens of the requests seen, and of those finished
        self.requests_seen = self.cap_seen = self.cap_finished = 0
        # seconds the engine had nothing to do once work had come: blocks not arriving in
        # time (the run report shows it as a share of the generation)
        self.idle_s = 0.0
        self.broken: BaseException | None = None
        self.stopping = False
        self.wake = threading.Event()
        self.built = threading.Event()
        if not build_there:
            engine.llm = build()
            build = None
        self.thread = threading.Thread(target=self._run, args=(build,), name="vllm-stepper",
                                       daemon=True)
        self.thread.start()
        self.built.wait()
        if self.broken is not None:  # the engine did not build: the constructor says why
            raise self.broken

    def slots(self, llm_engine) -> int:
        """Requests held in the engine at once: one per sequence it runs."""
        return llm_engine.vllm_config.scheduler_config.max_num_seqs

    def stalled_for(self) -> float:
        """Seconds since the last step finished while requests are unfinished (0 when idle)."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def submit(self, batch: Batch) -> None:
        if self.broken is not None:
            batch.fail(RuntimeError(f"the engine failed earlier: {_one_line(self.broken)}"))
            return
        self.inbox.put(batch)
        self.wake.set()
        if self.broken is not None or not self.thread.is_alive():
            # the stepper broke (or stopped) after the check above and may have drained its
            # inbox already: fail what is left there rather than wait forever
            failure = RuntimeError(f"the engine failed: {_one_line(self.broken)}"
                                   if self.broken else "the engine was closed")
            _fail_all(self.inbox, failure)

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _run(self, build) -> None:
        try:
            if self.engine.cpu_threads:
                # OpenMP keeps its thread count per thread, and a new thread starts from the
                # process default: make this one's the count the engine is built with
                # (vLLM's CPU attention checks that its plan and its kernel agree)
                self.engine.set_num_threads(self.engine.cpu_threads)
            if build is not None:
                self.engine.llm = build()
        except BaseException as exc:
            self.broken = exc
        finally:
            self.built.set()
        if self.broken is not None:
            return
        llm_engine = self.engine.llm.llm_engine
        slots = self.slots(llm_engine)
        try:
            while not self.stopping:
                while not self.inbox.empty():
                    self._queue(self.inbox.get())
                while self.waiting and len(self.pending) < slots:
                    self._add(*self.waiting.pop())
                if not llm_engine.has_unfinished_requests():
                    self.busy_since = None
                    waited = time.monotonic()
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
                    if self.requests_seen:
                        self.idle_s += time.monotonic() - waited
                    continue
                if self.busy_since is None:
                    self.busy_since = time.monotonic()
                for out in llm_engine.step():
                    if out.finished and out.request_id in self.pending:
                        self._finish(*self.pending.pop(out.request_id), out)
                self._count_live(llm_engine)
                self.steps += 1
                self.busy_since = time.monotonic()
        except BaseException as exc:  # the engine is gone: fail every waiting block
            self.broken = exc
            for batch, _ in list(self.pending.values()):
                batch.fail(exc)
            for batch in self.waiting.batches():
                batch.fail(exc)
            _fail_all(self.inbox, exc)

    def _finish(self, batch: Batch, index: int, out) -> None:
        """A request's final output: its result to its batch, its counts to the progress."""
        request = batch.requests[index]
        result = vllm_outputs.result(out, request.logprobs, self.engine.reasoning,
                                     request.chat_template_kwargs)
        tools = getattr(self.engine, "tools", None)
        if request.tools and tools is not None:
            try:
                result = tools.parse(result, request.tools, out.prompt_token_ids,
                                     out.outputs[0].token_ids)
            except Exception as exc:  # noqa: BLE001 - a parser failing on one output: its row's
                result = GenerationResult(None, None, result.completion_tokens,
                                          error=f"the tool parser failed on this output: "
                                                f"{_one_line(exc)}",
                                          error_kind=ErrorKind.PARSE)
        batch.set(index, result)
        self.requests_done += 1
        self.tokens_finished += result.completion_tokens
        self.cap_finished += batch.requests[index].max_tokens

    def _count_live(self, llm_engine) -> None:
        """Tokens generated so far: those of finished requests, plus what the unfinished
        ones hold in vLLM's output processor (read here, in the one thread that steps the
        engine; once a second, a sum over at most max_num_seqs requests)."""
        now = time.monotonic()
        if now - self._counted_at < 1.0:
            return
        self._counted_at = now
        try:
            states = llm_engine.output_processor.request_states.values()
            in_flight = sum(s.detokenizer.num_output_tokens() for s in states)
        except AttributeError:  # another vLLM: its internals moved; finished tokens only
            in_flight = 0
        self.tokens_live = self.tokens_finished + in_flight

    def _queue(self, batch: Batch) -> None:
        self.requests_seen += len(batch.requests)
        self.cap_seen += sum(r.max_tokens for r in batch.requests)
        if self.busy_since is None:  # work waits from now: a stall counts from here
            self.busy_since = time.monotonic()
        for index in range(len(batch.requests)):
            self.waiting.push(batch, index, self.steps)

    def _add(self, batch: Batch, index: int) -> None:
        engine, request = self.engine, batch.requests[index]
        request_id = f"overnight-{next(self.counter)}"
        try:  # the sampling values too: one vLLM refuses is this request's error
            params = engine.sampling_params(request)
            params.output_kind = engine.vllm.sampling_params.RequestOutputKind.FINAL_ONLY
            engine.llm.llm_engine.add_request(
                request_id, engine.prompt(request), params,
                lora_request=engine.adapters[request.adapter] if request.adapter else None)
        except engine.request_errors as exc:  # this request only: a row error
            if isinstance(exc, images.ImageError):  # one of its images cannot be used
                result = GenerationResult(None, None, None, error=str(exc),
                                          error_kind=ErrorKind.IMAGE)
            else:
                result = GenerationResult(None, None, None, error=_one_line(exc))
            batch.set(index, result)
            self.requests_done += 1
            self.cap_finished += request.max_tokens
            return
        self.pending[request_id] = (batch, index)


class _Waiting:
    """Requests not yet in the engine, least slack first: a request's key is the engine step
    it arrived at minus its ``max_tokens`` (the steps it may take), ties in arrival order."""

    def __init__(self):
        self._heap: list[tuple[int, int, Batch, int]] = []
        self._arrivals = itertools.count()

    def push(self, batch: Batch, index: int, step: int, steps: int | None = None) -> None:
        """``steps``: what the request may take (default: its max_tokens)."""
        key = step - (batch.requests[index].max_tokens if steps is None else steps)
        heapq.heappush(self._heap, (key, next(self._arrivals), batch, index))

    def pop(self) -> tuple[Batch, int]:
        return heapq.heappop(self._heap)[2:]

    def batches(self) -> set[Batch]:
        return {batch for _, _, batch, _ in self._heap}

    def __len__(self) -> int:
        return len(self._heap)



def _fail_all(inbox: queue.SimpleQueue, failure: BaseException) -> None:
    """Fail every batch still in ``inbox`` (two threads may drain it at once)."""
    while True:
        try:
            inbox.get_nowait().fail(failure)
        except queue.Empty:
            return
