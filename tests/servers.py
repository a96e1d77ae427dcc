"""Real servers for the tests, on loopback: ``vllm serve`` with the tiny model, moto's S3
server, and a stub that answers 429 a few times before passing requests through to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


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
