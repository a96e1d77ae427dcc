"""The engine interface: the one seam between the predictor actor and whatever generates.

An engine is built inside the actor from a small picklable spec, generates a list of requests
(returning one result per request, in order, never raising for one bad request), and is closed
explicitly. Implementations are chosen by the spec's ``kind`` through ``ENGINES``.

A pooling engine (``task: embed | score | classify``) has ``pool`` instead of ``generate``:
one forward pass per request, a vector or a few floats back.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class EngineSpec:
    """How to build an engine; picklable, sent to each replica."""

    kind: str
    model: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """The sampling fields a generation depends on, declared once: the job's (SamplingSpec)
    and each row's request (GenerationRequest) carry them to vLLM and to an OpenAI body."""

    # In the order an OpenAI body sends them (udfs/engines/http_engine.py: request_body)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    # The matched stop string kept at the text's end (vLLM's include_stop_str_in_output): a
    # reader that must know which one stopped it (Anthropic's stop_sequence) strips it itself
    include_stop: bool = False
    # Added to these tokens' logits at every step: ((token id, bias), ...), OpenAI's logit_bias
    logit_bias: tuple[tuple[int, float], ...] = ()

    @functools.cached_property
    def sampling_fields(self) -> dict:
        """Its Sampling fields by name, read once: every row's request starts from a job's."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}


SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))
# A Sampling field's name in vLLM, a request body and a row's overrides, where it differs
WIRE_NAMES = {"include_stop": "include_stop_str_in_output"}


def sampling_values(values: Mapping[str, Any]) -> dict:
    """The Sampling fields ``values`` gives (a config section's, a row's overrides; by their
    wire names), in the shapes Sampling declares: a list as a tuple, logit_bias's
    {token id: bias} as ((token id, bias), ...) in its order (None: not given)."""
    out = {}
    for name in SAMPLING_FIELDS:
        wire = WIRE_NAMES.get(name, name)
        if wire not in values:
            continue
        value = values[wire]
        if name == "logit_bias":
            if value is None:
                continue
            value = tuple((int(token), bias) for token, bias in value.items())
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return out


@dataclass(frozen=True)
class GenerationRequest(Sampling):
    """One row's request: its prompt, its token budget and its sampling (positional: the
    token ids and max_tokens; the rest by name)."""

    prompt_token_ids: list[int]
    max_tokens: int
    _: KW_ONLY
    # Per generated token: its logprob and this many top alternatives (None: no logprobs)
    logprobs: int | None = None
    # Constrained decoding: {"json": schema} | {"choice": [...]} | {"regex": "..."}
    structured: dict | None = None
    # The same prompt as chat messages, for an engine that applies the chat template itself
    messages: list[dict] | None = None
    # The chat template's switches its prompt was rendered with (prompt.chat_template_kwargs),
    # which a reasoning parser reads as vLLM's chat path gives them (Qwen3's enable_thinking)
    chat_template_kwargs: dict | None = None
    # The LoRA adapter to run it on, by its name in the engine's adapters (None: the base)
    adapter: str | None = None
    # The prompt's images, in the order its placeholders stand (udfs/rows/images.py: each a
    # {bytes, path} source, found and loaded by ``image_spec``), decoded when the engine
    # takes the request; an image that cannot be used is this request's image_error
    images: tuple[dict, ...] = ()
    image_spec: Any = None  # udfs.rows.images.ImageSpec
    # The functions the model may call, as JSON: {"tools": [chat-shaped function tools],
    # "tool_choice": "none" | "auto" | "required" | {"type": "function", "function": {"name"}},
    # "parallel_tool_calls": bool} (udfs/stages/tool_calls.py); None: no tools
    tools: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str | None
    finish_reason: str | None
    completion_tokens: int | None
    error: str | None = None  # set when this request failed; the others are unaffected
    error_kind: str | None = None  # with error: its ErrorKind; default engine_error
    # With request.logprobs: one TokenLogprob per generated token, as plain dicts (the
    # Arrow struct of the logprobs column: token, token_id, logprob, top)
    logprobs: list[dict] | None = None
    # An engine with a reasoning parser (a thinking model): ``text`` is the answer alone
    # (None where the model did not get to one), ``reasoning`` the thinking (None where it did
    # not think), ``reasoning_tokens`` the tokens of it, and ``answer_start`` the index of the
    # answer's first token among the generated ones (``logprobs[answer_start:]`` are its own)
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    answer_start: int = 0
    # the prompt's tokens as the engine counted them, where it knows: a prompt's images
    # expanded into their tokens
    prompt_tokens: int | None = None
    # A request with tools: the calls vLLM's tool parser found, each {id, name, arguments
    # (JSON text)}; ``text`` is then the content beside them (None: none). [] where it called
    # none; None for a request without tools
    tool_calls: list[dict] | None = None
    # the prompt's tokens the engine's prefix cache held (vLLM's num_cached_tokens): not
    # computed again
    cached_tokens: int | None = None


def token_logprob(token: str | None, token_id: int | None, logprob: float,
                  top: list[dict] | None = None) -> dict:
    """One generated token's entry of a result's ``logprobs``; ``top`` holds entries of the
    same shape without ``top``, most likely first. ``token_id`` is None where an engine
    returns text only (an OpenAI server)."""
    entry = {"token": token, "token_id": token_id, "logprob": logprob}
    return entry if top is None else {**entry, "top": top}


class Engine(Protocol):
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, in order. A failing request yields a result with ``error``."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PoolingRequest:
    """One row for a pooling model (``task: embed | score | classify``): one forward pass over
    its tokens, no sampling."""

    task: str  # "embed" | "score" | "classify"
    prompt_token_ids: list[int]
    # score: where the second text (the document) starts in prompt_token_ids, for models
    # that tell the two apart by token type (BERT cross-encoders); None: one segment
    pair_start: int | None = None
    # score: the two texts as rendered, for an engine that tokenizes pairs itself (a server)
    texts: tuple[str, str] | None = None
    normalize: bool | None = None  # embed: L2-normalize (None: the model's default)
    dimensions: int | None = None  # embed: a Matryoshka model's shorter vector


@dataclass(frozen=True)
class PoolingResult:
    """embed: the vector; classify: one probability per label; score: one value."""

    values: list[float] | None
    error: str | None = None
    error_kind: str | None = None


class PoolingEngine(Protocol):
    def pool(self, requests: Sequence[PoolingRequest]) -> list[PoolingResult]:
        """One result per request, in order. A failing request yields a result with ``error``."""
        ...

    def close(self) -> None: ...


def one_line(exc: BaseException) -> str:
    """An exception as one line, ``Type: message``, for a row's error or a death's cause."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


# kind -> "module:Class"; imported only when an engine of that kind is built.
ENGINES = {
    "vllm": "udfs.engines.vllm_engine:VLLMEngine",
    "http": "udfs.engines.http_engine:HTTPEngine",  # generates and pools (task: embed...) alike
    "vllm_pooling": "udfs.engines.pooling_engine:VLLMPoolingEngine",
}


def build_engine(spec: EngineSpec) -> Engine:
    try:
        target = ENGINES[spec.kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {spec.kind!r}; known: {sorted(ENGINES)}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(spec)
