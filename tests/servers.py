"""Real servers for the HTTP engine's tests, on loopback: ``vllm serve`` with the tiny model,
and a stub that answers 429 a few times before passing requests through to it."""

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


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on CPU: start, kill, start again on
    the same port (the engine settings are the ones the in-process tests use)."""

    def __init__(self, model: str, log_path, kv_cache: int, max_model_len: int = 512):
        self.model, self.log_path = model, log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", "float32", "--max-model-len", str(max_model_len),
                     "--kv-cache-memory-bytes", str(kv_cache), "--enforce-eager",
                     "--no-enable-chunked-prefill", "--structured-outputs-config",
                     '{"backend": "guidance", "disable_any_whitespace": true}']
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm server exited {self.proc.returncode}; see "
                                   f"{self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vllm server not up after {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


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
