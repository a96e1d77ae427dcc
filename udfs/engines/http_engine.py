"""An engine that is a server: any OpenAI-compatible endpoint (vllm serve, SGLang, llama.cpp's
server, Ollama), driven by an async client that keeps many requests in flight.

The replica's requests from every block share one limit, ``max_concurrency``, so the server's
own continuous batching stays full across block boundaries, as the in-process engine's does. A
connection error, a timeout, a 429 or a 5xx is retried with exponential backoff and jitter
(honouring ``Retry-After``); any other 4xx is that row's error, with the server's message; a
request that exhausts its retries is a row error too, and the job goes on.

With ``endpoint: completions`` (the default) the prompt is sent as the token ids the renderer
made, so the server generates from exactly the tokens the in-process engine would; with
``endpoint: chat`` the rendered messages are sent and the server applies its chat template
(for servers that take no token ids).

A pooling task (``task: embed | score | classify``) goes through ``pool``: the token ids to
``/v1/embeddings`` or ``/classify``, a score's two texts to ``/v1/score`` (vLLM's endpoints).
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, fields
from typing import Sequence

import httpx

from udfs.rows import images
from udfs.columns import ErrorKind
from udfs.engines.engine import (WIRE_NAMES, EngineSpec, GenerationRequest, GenerationResult,
                                 PoolingRequest, PoolingResult, Sampling, token_logprob)
from udfs.redact import scrub

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
MAX_BACKOFF_S = 30.0


class Secret(str):
    """A string that does not show itself in a repr, a log line or a traceback."""

    def __repr__(self) -> str:
        return "'<secret>'"


@dataclass(frozen=True)
class HTTPOptions:
    base_url: str
    model: str  # the name the server serves the model under
    endpoint: str = "completions"  # or "chat"
    api_key: Secret | None = None
    max_concurrency: int = 64
    timeout_s: float = 600.0
    max_retries: int = 5
    backoff_s: float = 1.0

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> HTTPOptions:
        o = spec.options
        return cls(base_url=o["base_url"].rstrip("/"), model=o.get("served_model") or spec.model,
                   endpoint=o.get("endpoint", "completions"), api_key=o.get("api_key"),
                   max_concurrency=o.get("max_concurrency", 64),
                   timeout_s=o.get("timeout_s", 600.0), max_retries=o.get("max_retries", 5),
                   backoff_s=o.get("backoff_s", 1.0))


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(options: HTTPOptions, r: GenerationRequest) -> dict:
    """The OpenAI request for one GenerationRequest; vLLM's extensions only when used. A
    request on a LoRA adapter names it as its model, as a server with the adapter loaded
    (``vllm serve --lora-modules NAME=PATH``) takes it."""
    body: dict = {"model": r.adapter or options.model, "max_tokens": r.max_tokens,
                  "temperature": r.temperature, "top_p": r.top_p}
    if options.endpoint == "chat":
        body["messages"] = with_images(r.messages, r.images, r.image_spec) if r.images \
            else r.messages
    else:
        body["prompt"] = r.prompt_token_ids
    body.update(optional_sampling(r))
    if r.logprobs is not None:  # the two endpoints ask for them differently
        if options.endpoint == "chat":
            body.update(logprobs=True, top_logprobs=r.logprobs)
        else:
            body["logprobs"] = r.logprobs
    structured = r.structured or {}
    if "json" in structured:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": structured["json"]}}
    elif structured:  # choice / regex: vLLM's structured_outputs extension
        body["structured_outputs"] = structured
    return body


def optional_sampling(r: Sampling) -> dict:
    """The Sampling fields a body sends beside temperature and top_p: each only where it is
    set (not None, not empty, not its default), so that a server without vLLM's extensions
    takes a request that uses none of them."""
    body = {}
    for f in fields(Sampling):
        if f.name in ("temperature", "top_p"):  # always sent, ahead of the prompt
            continue
        value, default = getattr(r, f.name), f.default
        if not (value is not None if default is None
                else value != default if default else value):
            continue
        if f.name == "logit_bias":  # OpenAI's shape: token ids as the object's keys
            value = {str(token): bias for token, bias in value}
        elif isinstance(value, tuple):
            value = list(value)
        elif default is False:
            value = True
        body[WIRE_NAMES.get(f.name, f.name)] = value
    return body


def with_images(messages: list[dict], sources: tuple[dict, ...], spec) -> list[dict]:
    """The messages with each image placeholder part (``{"type": "image"}``, in order) as an
    ``image_url`` part holding its image's ``data:`` URL, checked first (udfs/rows/images.py): a
    server is never sent a bad image, nor asked to read a path. ImageError: the row's."""
    urls = iter([images.data_url(source, spec) for source in sources])
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": next(urls)}}
                       if part.get("type") == "image" else part for part in content]
        out.append({**message, "content": content})
    return out


def parse_response(endpoint: str, data: dict) -> GenerationResult:
    choice = data["choices"][0]
    text = choice["message"].get("content") if endpoint == "chat" else choice["text"]
    usage = data.get("usage") or {}
    return GenerationResult(text=text or "", finish_reason=choice.get("finish_reason"),
                            completion_tokens=usage.get("completion_tokens"),
                            logprobs=parse_logprobs(endpoint, choice.get("logprobs")),
                            prompt_tokens=usage.get("prompt_tokens"))


def parse_logprobs(endpoint: str, logprobs: dict | None) -> list[dict] | None:
    """The OpenAI shapes as the engine interface's entries (text only: no token ids). Chat:
    ``content[]`` of {token, logprob, top_logprobs[]}; completions: parallel lists, the
    alternatives as {token: logprob} (which holds the chosen token too: the top K kept)."""
    if not logprobs:
        return None
    if endpoint == "chat":
        return [token_logprob(t["token"], None, t["logprob"], [
            token_logprob(a["token"], None, a["logprob"]) for a in t.get("top_logprobs") or ()])
            for t in logprobs.get("content") or ()]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [token_logprob(token, None, logprob, [
        token_logprob(t, None, lp) for t, lp in sorted(
            (top or {}).items(), key=lambda item: -item[1])])
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops)]


def pooling_call(options: HTTPOptions, r: PoolingRequest) -> tuple[str, dict]:
    """The URL and body of one pooling request: the token ids the renderer made (a score's
    pair as its two texts: the server tokenizes a pair itself)."""
    if r.task == "embed":
        body: dict = {"model": options.model, "input": list(r.prompt_token_ids),
                      "encoding_format": "float"}
        if r.dimensions is not None:
            body["dimensions"] = r.dimensions
        if r.normalize is False:  # vLLM's extension; the default is normalized
            body["use_activation"] = False
        return f"{options.base_url}/embeddings", body
    if r.task == "score":
        query, document = r.texts
        return f"{options.base_url}/score", {"model": options.model, "queries": query,
                                              "documents": document}
    # vLLM serves /classify at the server's root, beside /v1
    root = options.base_url.removesuffix("/v1")
    return f"{root}/classify", {"model": options.model, "input": list(r.prompt_token_ids)}


def parse_pooling(task: str, data: dict) -> list[float]:
    item = data["data"][0]
    if task == "embed":
        return [float(x) for x in item["embedding"]]
    if task == "score":
        return [float(item["score"])]
    return [float(x) for x in item["probs"]]


def server_message(response: httpx.Response) -> str:
    """The server's own words for a failed request, on one line."""
    try:
        error = response.json()
        error = error.get("error", error) if isinstance(error, dict) else error
        text = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        text = response.text
    return " ".join(str(text).split())[:300] or response.reason_phrase


def retry_delay(attempt: int, base: float, response: httpx.Response | None = None) -> float:
    """Retry-After when the server gives one in seconds, else exponential backoff with jitter."""
    if response is not None:
        after = response.headers.get("retry-after")
        try:
            return min(max(float(after), 0.0), MAX_BACKOFF_S)
        except (TypeError, ValueError):
            pass
    return min(base * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1.5)


class HTTPEngine:
    """The ``Engine`` interface over HTTP. Thread-safe: the predictor's concurrent calls each
    hand their requests to one event loop, in a thread of its own, that owns the client."""

    def __init__(self, spec: EngineSpec):
        self.options = HTTPOptions.from_spec(spec)
        self.url = f"{self.options.base_url}/" + (
            "chat/completions" if self.options.endpoint == "chat" else "completions")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="overnight-http",
                                       daemon=True)
        self.thread.start()
        self.client, self.slots = self._call(self._open())
        self._done = self._tokens = 0

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _open(self):
        limit = self.options.max_concurrency
        client = httpx.AsyncClient(
            headers=headers(self.options.api_key),
            timeout=httpx.Timeout(self.options.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))
        return client, asyncio.Semaphore(limit)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        results = self._call(self._generate(requests))
        self._done += len(results)
        self._tokens += sum(r.completion_tokens or 0 for r in results)
        return results

    def progress(self) -> dict:
        """Requests finished and their output tokens (counted a block at a time)."""
        return {"requests": self._done, "tokens_finished": self._tokens, "tokens": self._tokens}

    async def _generate(self, requests):
        return await asyncio.gather(*(self._one(r) for r in requests))

    async def _one(self, request: GenerationRequest) -> GenerationResult:
        try:
            body = request_body(self.options, request)
        except images.ImageError as exc:  # one of its images cannot be used: the row's
            return GenerationResult(None, None, None, error=str(exc), error_kind=ErrorKind.IMAGE)
        data, error = await self._post(self.url, body)
        if error is not None:
            return _failed(error)
        try:
            return parse_response(self.options.endpoint, data)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return _failed(f"unreadable response from the server: {exc!r}"[:300])

    def pool(self, requests: Sequence[PoolingRequest]) -> list[PoolingResult]:
        """task: embed | score | classify through the server's pooling endpoints (vLLM's
        /v1/embeddings, /v1/score, /classify), as many in flight as ``generate`` keeps."""
        results = self._call(self._pool_all(requests))
        self._done += len(results)
        return results

    async def _pool_all(self, requests):
        return await asyncio.gather(*(self._pool(r) for r in requests))

    async def _pool(self, request: PoolingRequest) -> PoolingResult:
        url, body = pooling_call(self.options, request)
        data, error = await self._post(url, body)
        if error is not None:
            return PoolingResult(None, error=scrub(error))
        try:
            return PoolingResult(parse_pooling(request.task, data))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return PoolingResult(None, error=f"unreadable response from the server: "
                                             f"{exc!r}"[:300])

    async def _post(self, url: str, body: dict) -> tuple[dict | None, str | None]:
        """The server's JSON answer, or the request's error: a connection error, a timeout,
        a 429 or a 5xx retried with backoff; another 4xx at once, with the server's words."""
        last = "no attempt"
        for attempt in range(self.options.max_retries + 1):
            response = None
            async with self.slots:
                try:
                    response = await self.client.post(url, json=body)
                except httpx.TransportError as exc:  # connection refused/reset, timeouts
                    last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if response is not None:
                if response.status_code == 200:
                    try:
                        return response.json(), None
                    except ValueError as exc:
                        return None, f"unreadable response from the server: {exc!r}"[:300]
                last = f"HTTP {response.status_code}: {server_message(response)}"
                if response.status_code not in RETRY_STATUS:
                    return None, last
            if attempt < self.options.max_retries:
                await asyncio.sleep(retry_delay(attempt, self.options.backoff_s, response))
        return None, f"gave up after {self.options.max_retries} retries; last: {last}"

    def close(self) -> None:
        if self.loop.is_running():
            self._call(self.client.aclose())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def _failed(message: str) -> GenerationResult:
    return GenerationResult(text=None, finish_reason=None, completion_tokens=None,
                            error=scrub(message))  # a transport error may quote the URL


def list_models(base_url: str, api_key: str | None, timeout: float = 10.0) -> list[str]:
    """The model names a server serves (GET /models); raises httpx errors as they come."""
    response = httpx.get(f"{base_url.rstrip('/')}/models", headers=headers(api_key),
                         timeout=timeout)
    response.raise_for_status()
    return [m.get("id") for m in response.json().get("data", [])]
