"""The ``engine`` section: vLLM in the job's own actors (``kind: vllm``, the default), or an
OpenAI-compatible server (``kind: http``), with the restart and isolation settings both share.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pipelines.config.sections import Strict


class _EngineRecovery(Strict):
    """What happens when an engine dies (udfs/engines/recovery.py): it is replaced, its blocks
    retried, rows that kill engines isolated."""

    max_restarts: int = Field(
        32, ge=0, description="Engine deaths a job survives (each replaced, its blocks "
        "retried); one more stops the job. Isolating a poison row costs up to ~9 deaths.")
    stall_timeout_s: float = Field(
        600.0, gt=0, description="An in-process engine that holds unfinished requests but "
        "finishes no step for this long counts as dead: replaced, its blocks retried.")


class VLLMEngineConfig(_EngineRecovery):
    kind: Literal["vllm"] = "vllm"
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0,
        description="KV-cache size in bytes; required on CPU (default there: 1 GiB), "
        "on a GPU vLLM sizes it from gpu_memory_utilization.",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool | None = Field(
        None, description="Skip graph capture / torch.compile; default: true on CPU."
    )
    multiprocessing: bool | None = Field(
        None,
        description="Run the engine core in its own process (vLLM's default); "
        "default: true on a GPU, false on CPU where the two processes fight for cores.",
    )
    cpu_threads: int | None = Field(
        None, gt=0,
        description="On CPU: the engine's compute threads; default: the node's cores shared "
        "among the replicas on it (Ray would give each actor as many threads as the whole "
        "CPUs it reserved). Two jobs (or a job and other work) on the same cores: set "
        "OMP_WAIT_POLICY=PASSIVE in their environment, or OpenMP's threads spin while they "
        "wait (two tiny-model jobs at once took 6x their time alone, passive 1.4x).",
    )
    structured_outputs: dict[str, Any] = Field(
        default_factory=lambda: {"backend": "guidance", "disable_any_whitespace": True},
        description="vLLM's structured_outputs_config. The default, guidance without "
        "whitespace, keeps JSON compact and valid where vLLM's default lets a weak model pad "
        "it with whitespace until max_tokens.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Further keyword arguments passed verbatim to vllm.LLM."
    )


class HTTPEngineConfig(_EngineRecovery):
    """Any OpenAI-compatible server as the engine (vllm serve, SGLang, llama.cpp, Ollama)."""

    kind: Literal["http"]
    base_url: str = Field(description="The server's API root, e.g. http://127.0.0.1:8000/v1.")
    model: str | None = Field(
        None, description="The name the server serves the model under; default: model.name "
        "(which still names the tokenizer, loaded locally to count and check prompts).")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="completions: send the prompt as token ids, exactly as "
        "the in-process engine would; chat: send messages, the server applies its template.")
    api_key_env: str | None = Field(
        None, description="The environment variable holding the API key (never logged).")
    max_concurrency: int = Field(64, ge=1, description="Requests in flight per replica.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(5, ge=0, description="Retries of a connection error, 429 or 5xx.")
    backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles each retry.")


EngineConfig = Annotated[VLLMEngineConfig | HTTPEngineConfig, Field(discriminator="kind")]
