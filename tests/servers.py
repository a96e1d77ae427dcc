"""Real servers for the tests, on loopback: ``vllm serve`` with the tiny model, moto's S3
server, a stub that answers 429 a few times before passing requests through to it, and
``overnight serve`` itself with the client calls its tests share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai

from conftest import KV_CACHE, REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """A server in a process (and session) of its own on a free loopback port: start it, wait
    until ``ready_path`` answers 200, kill it, start it again on the same port."""

    ready_path = "/"

    def __init__(self, args: list[str], log_path, env: dict | None = None):
        self.args, self.log_path, self.env = args, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(self.env or {})})
        name = type(self).__name__
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}",
                             timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"{name} not up after {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class VLLMServer(LoopbackServer):
    """``python -m vllm.entrypoints.openai.api_server`` on CPU (the engine settings are the
    ones the in-process tests use)."""

    ready_path = "/v1/models"

    def __init__(self, model: str, log_path, kv_cache: int, max_model_len: int = 512):
        self.model = model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        super().__init__(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--max-model-len", str(max_model_len),
             "--kv-cache-memory-bytes", str(kv_cache), "--enforce-eager",
             "--no-enable-chunked-prefill", "--structured-outputs-config",
             '{"backend": "guidance", "disable_any_whitespace": true}'],
            log_path, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


class MotoServer(LoopbackServer):
    """moto's S3 server (``python -m moto.server``): a real S3 API on loopback."""

    ready_path = "/moto-api/"

    def __init__(self, log_path):
        self.port = free_port()
        super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                          "-p", str(self.port)], log_path)


class TooManyRequestsStub:
    """A loopback HTTP server that answers the first ``refuse`` POSTs with 429 (Retry-After:
    0) and passes every other request through to ``upstream``, counting both."""

    def __init__(self, upstream: str, refuse: int):
        self.upstream, self.refuse = upstream.rstrip("/"), refuse
        self.refused = self.passed = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if method == "POST":
                    with stub.lock:
                        refuse = stub.refused < stub.refuse
                        stub.refused += refuse
                        stub.passed += not refuse
                    if refuse:
                        self.send_response(429)
                        self.send_header("Retry-After", "0")
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        self.wfile.write(b'{"error": {"message": "slow down"}}')
                        return
                path = self.path[len("/v1"):] if self.path.startswith("/v1") else self.path
                answer = httpx.request(method, stub.upstream + path, content=body, timeout=120,
                                       headers={"Content-Type": "application/json"})
                self.send_response(answer.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


# -- `overnight serve` as a child process, and what its tests ask of it ---------------------

KEY, OTHER_KEY = "sk-overnight-test-first", "sk-overnight-test-second"
TERMINAL = ("completed", "failed", "cancelled", "expired")
FAST = 20_000


def request(custom_id: str, content: str, max_tokens: int, url="/v1/chat/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "gpt-4o-mini", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def request_file(path: Path, count: int, max_tokens: int, prefix: str) -> Path:
    path.write_text("".join(json.dumps(request(f"{prefix}-{i}", f"Say something about {i}.",
                                               max_tokens)) + "\n" for i in range(count)))
    return path


def long_file(path: Path, prefix: str, tail: int, tail_tokens: int, head: int = FAST) -> Path:
    """``head`` requests of one token (FAST), then ``tail`` of ``tail_tokens``. A batch file's
    job commits its parts a read unit (16,384 rows or more, to the end of a 10,000-row group)
    at a time, so the counts move, and a batch can be stopped, between the fast head and the
    slow tail. (A tail held unanswered by the tests' ``hold`` fault needs no long head: the
    head's blocks commit, the tail's never do.)"""
    path.write_text("".join(
        json.dumps(request(f"{prefix}-{i}", str(i), 1 if i < head else tail_tokens)) + "\n"
        for i in range(head + tail)))
    return path


class Server:
    """``overnight serve`` as a child process, on a free port; started again on the same
    data directory and port after a kill."""

    def __init__(self, root: Path, tiny_model: str, *args: str, env: dict | None = None):
        self.root, self.port, self.args = root, free_port(), list(args)
        self.env = {**os.environ, **(env or {})}  # the server's, and its batches' children's
        (root / "keys.txt").write_text(f"# test keys\n{KEY}\n{OTHER_KEY}\n")
        # what a batch needs on this machine (see tests/test_batch.py); blocks of 512 rows
        (root / "job.yaml").write_text(json.dumps({
            "model": {"name": tiny_model, "dtype": "float32", "max_model_len": 512},
            "engine": {"kv_cache_memory_bytes": KV_CACHE}, "resources": {"batch_size": 512}}))
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "serve", "--config",
             str(self.root / "job.yaml"), "--data-dir", str(self.root / "data"), "--port",
             str(self.port), "--api-keys-file", str(self.root / "keys.txt"),
             "--max-upload-mb", "8", *self.args], cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 300  # the resident engine loads first
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                httpx.get(f"{self.base_url}/files", timeout=2,
                          headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError(f"the server did not answer in 300 s\n{self.log()}")

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no clean-up of any kind
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-3000:]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0)


def wait(client: openai.OpenAI, batch_id: str, until=TERMINAL, timeout: float = 300):
    """Poll a batch until its status is one of ``until``; returns every object seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(client.batches.retrieve(batch_id))
        if seen[-1].status in until:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {seen[-1].status} after {timeout} s")


def some_done(client: openai.OpenAI, batch_id: str, timeout: float = 300):
    """Poll a batch until some of its requests are done (it must still be running)."""
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).request_counts.completed == 0:
        assert batch.status in ("validating", "in_progress"), batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    # JSON Lines end at "\n" only: a generated text may hold U+2028 or U+0085, which
    # str.splitlines() would also split at
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n")
            if line]


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
