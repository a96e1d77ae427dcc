"""The specs a job's stages are built from, made from a checked config: the ``JobPlan`` that
holds them, and its prompt (``RenderSpec``), engine (``EngineSpec``), sampling and
structured-output specs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipelines.config import JobConfig, SamplingConfig
from pipelines.errors import ConfigError, JobError, one_line
from pipelines.plan.adapters import adapter_sampling, check_adapters
from pipelines.plan.fingerprint import RECOVERY_SETTINGS
from pipelines.plan.images import image_spec
from pipelines.read import InputPlan
from pipelines.reuse.request_key import KeySpec
from pipelines.storage import redact
from udfs import columns
from udfs.engines.engine import EngineSpec, sampling_values
from udfs.rows.logprobs import SERVER_TOP_K_MAX, confidence_top_k
from udfs.rows.parsers import SchemaError, StructuredSpec
from udfs.stages.pooler import PoolingSpec
from udfs.stages.predictor import SamplingSpec
from udfs.stages.prompts import RenderSpec


@dataclass
class JobPlan:
    """A job as pre-flight planned it: its checked config, its input and each stage's spec."""

    config: JobConfig
    input: InputPlan
    render: RenderSpec
    engine: EngineSpec
    sampling: SamplingSpec
    fingerprint: dict
    structured: StructuredSpec | None = None
    pooling: PoolingSpec | None = None  # task: embed | score | classify
    steps: tuple | None = None  # a job of several steps: StepSpec each (udfs/stages/steps.py)
    # a generate job's: how its rows' request keys are made (pipelines/reuse/request_key.py)
    request_key: KeySpec | None = None

    @property
    def fingerprint_hash(self) -> str:
        blob = json.dumps(self.fingerprint, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def render_spec(config: JobConfig, prompt, sampling, max_model_len: int,
                pooling: PoolingSpec | None) -> RenderSpec:
    """How a row becomes a prompt; ``prompt``, ``sampling``: the job's sections, or a job of
    steps' first generating step's."""
    return RenderSpec(
        template=prompt.template, tokenizer=config.model.name,
        max_model_len=max_model_len, max_tokens=0 if pooling else sampling.max_tokens,
        system=prompt.system,
        # a pooling model embeds the text as it is, unless asked for the chat template
        chat=prompt.chat if prompt.chat is not None else pooling is None,
        on_too_long=prompt.on_too_long, on_null=prompt.on_null,
        trust_remote_code=config.model.trust_remote_code,
        messages_column=prompt.messages_column,
        keep_messages=config.engine.kind == "http" and config.engine.endpoint == "chat",
        max_tokens_column=sampling.max_tokens_column,
        chat_template_kwargs=prompt.chat_template_kwargs,
        images=image_spec(prompt, config.input.path),
        chat_template_content_format=prompt.chat_template_content_format,
        tools=prompt.tool_spec(), tools_column=prompt.tools_column,
    )


def engine_spec(config: JobConfig, prompt, max_model_len: int, images: int,
                structured: StructuredSpec | None, pooling: PoolingSpec | None) -> EngineSpec:
    """The engine's kind, model and options; an HTTP engine's server asked, now, for the model
    it serves. ``images``: the most images a prompt may hold."""
    options = (_http_engine_options(config) if config.engine.kind == "http" else {
        **vllm_engine_options(config.model, config.engine, max_model_len),
        **({"reasoning_parser": config.model.reasoning_parser,
            "chat_template_kwargs": prompt.chat_template_kwargs}
           if config.model.reasoning_parser else {}),
        **({"tool_parser": config.model.tool_parser} if config.model.tool_parser else {}),
    })
    if images and config.engine.kind == "vllm" \
            and "limit_mm_per_prompt" not in config.engine.args:
        options["args"] = {**options.get("args", {}), "limit_mm_per_prompt": {"image": images}}
    top_for_confidence = _top_for_confidence(config, structured)
    if top_for_confidence > 20 and config.engine.kind == "vllm":
        options["max_logprobs"] = top_for_confidence  # vLLM allows 20 by default
    kind = config.engine.kind
    if pooling is not None and kind == "vllm":
        kind = "vllm_pooling"  # udfs/engines/pooling_engine.py; the HTTP engine does both
    return EngineSpec(kind, config.model.name, options)


def sampling_spec(config: JobConfig, prompt, structured: StructuredSpec | None) -> SamplingSpec:
    """The job's sampling settings, and the columns its generation writes beside the output."""
    s = config.sampling
    # a named tool_choice: the tools' own constraint holds the output (the engine's tool
    # parser sets it); its arguments parse as structured output's JSON does
    forced = prompt.forced_tool() is not None
    return SamplingSpec(
        max_tokens=s.max_tokens, **section_sampling(s),
        key_column=config.input.id_column or columns.ORDINAL,
        structured=structured.engine_params() if structured and not forced else None, n=s.n,
        max_tokens_column=s.max_tokens_column, overrides_column=s.overrides_column,
        logprobs_column=config.logprobs_column(), logprobs=config.output.logprobs,
        confidence_column=config.confidence_column(),
        confidence_top_k=_top_for_confidence(config, structured),
        reasoning_column=config.reasoning_column(),
        **adapter_sampling(config, prompt),
        count_images=config.steps is None and bool(prompt.images),
        tools=prompt.tool_spec(), tools_column=prompt.tools_column,
        tool_calls_column=config.tool_calls_column(),
        check_tool_calls=prompt.tools is not None, arguments_as_text=forced,
    )


def section_sampling(section: SamplingConfig) -> dict:
    """A sampling section's Sampling fields, for its SamplingSpec (logit_bias in token order)."""
    values = sampling_values(section.model_dump())
    return {**values, "logit_bias": tuple(sorted(values.get("logit_bias", ())))}


def _top_for_confidence(config: JobConfig, structured: StructuredSpec | None) -> int:
    """The alternatives a confidence column needs (0: no confidence column); a server allows
    what it allows: usually OpenAI's 20."""
    if not config.confidence_column():
        return 0
    if config.engine.kind == "http":
        return confidence_top_k(structured.choice, SERVER_TOP_K_MAX)
    return confidence_top_k(structured.choice)


def vllm_engine_options(model, engine, max_model_len: int) -> dict:
    """The in-process engine's options (udfs/engines/vllm_engine.py) from the ``model`` and ``engine``
    sections, reasoning aside; a LoRA adapter each checked against the model
    (pipelines/plan/adapters.py). ``overnight serve`` starts its resident engine from them."""
    return {
        "max_model_len": max_model_len,
        "dtype": model.dtype,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "trust_remote_code": model.trust_remote_code,
        **engine.model_dump(exclude={"kind", *RECOVERY_SETTINGS}),
        **(check_adapters(model) if model.adapters else {}),
    }


def _http_engine_options(config: JobConfig) -> dict:
    """The server must be up and serve the model, now, not hours into the job."""
    import os

    import httpx

    from udfs.engines.http_engine import Secret, list_models

    engine = config.engine
    api_key = None
    if engine.api_key_env:
        api_key = (os.environ.get(engine.api_key_env) or "").strip()
        if not api_key:
            raise ConfigError(f"engine.api_key_env: the environment variable "
                              f"{engine.api_key_env!r} is not set")
        if not api_key.isprintable() or " " in api_key:  # never shown: it is the secret
            raise ConfigError(f"engine.api_key_env: the key in {engine.api_key_env!r} holds "
                              "spaces or control characters; an API key is one printable word")
    served = engine.model or config.model.name
    shown = redact(engine.base_url)
    try:
        models = list_models(engine.base_url, api_key)
    except httpx.HTTPStatusError as exc:
        raise JobError(f"engine.base_url {shown}: GET /models answered "
                       f"{exc.response.status_code}"
                       + (" (check the API key)" if exc.response.status_code in (401, 403)
                          else "")) from None
    except (httpx.HTTPError, ValueError) as exc:
        raise JobError(f"engine.base_url {shown}: cannot reach the server "
                       f"({type(exc).__name__}: {one_line(exc, 160)})") from None
    if served not in models:
        raise JobError(f"engine.model {served!r} is not served at {shown}; it "
                       f"serves: {', '.join(map(str, models)) or 'nothing'}")
    return {**engine.model_dump(exclude={"kind", "model", "api_key_env", *RECOVERY_SETTINGS}),
            "served_model": served, "api_key": Secret(api_key) if api_key else None,
            "served_models": models}


def structured_spec(section, parsed_column: str, key: str = "structured",
                    arrays: bool = False) -> StructuredSpec:
    """A structured section as a spec, its JSON Schema loaded and checked; ``key`` names the
    section in an error."""
    schema = section.json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(Path(schema).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{key}.json_schema: cannot read {schema!r}: "
                              f"{exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}.json_schema: {schema} line {exc.lineno}: "
                              f"not valid JSON: {exc.msg}") from None
    spec = StructuredSpec(json_schema=schema,
                          choice=tuple(section.choice) if section.choice else None,
                          regex=section.regex, parsed_column=parsed_column)
    which = "json_schema" if schema is not None else "choice" if section.choice else "regex"
    try:
        spec.check(arrays)
    except SchemaError as exc:
        raise ConfigError(f"{key}.{which}: {exc}") from None
    return spec
