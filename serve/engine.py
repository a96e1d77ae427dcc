"""The resident engine: ``vllm serve`` on loopback, started once with the server and kept
loaded between batches. Every batch's job sends its requests to it (``engine.kind: http``,
udfs/engines/http_engine.py), so a batch starts generating without loading a model, and several
batches share one engine's continuous batching.

Why a server process and not engine actors in the server's own Ray: a batch stays an
``overnight batch`` child (validation, results, resume, cancel by killing its group, exactly
as the CLI runs), and the child's requests reach the engine through the HTTP engine, already
built and tested for any OpenAI-compatible server. The engine is started with the same vLLM
settings the in-process engine builds (``llm_kwargs``), and the child sends the prompt's token
ids (``endpoint: completions``), so its results equal ``overnight batch``'s.

The engine listens on 127.0.0.1 only, behind a random key made at each start (``VLLM_API_KEY``;
the children get it in their environment, never on a command line). It dies with the server
(``PR_SET_PDEATHSIG``); one left by a server killed where that is unavailable is stopped when
the next starts (its pid in ``engine.pid``); it keeps its port across restarts
(``engine.port``), so a batch's job resumes from its committed parts. If it dies while the server runs, it is started
again; the batches' requests wait (retried with backoff) and go on.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pipelines.errors import ConfigError
from serve.processes import group

log = logging.getLogger("overnight.serve")

KEY_ENV = "OVERNIGHT_RESIDENT_ENGINE_KEY"  # the children's environment: the engine's key
PID_FILE, LOG_FILE, PORT_FILE = "engine.pid", "engine.log", "engine.port"
START_TIMEOUT_S = 1800.0  # a large model's weights load for minutes on a GPU box


def resident_settings(model: str, config: dict) -> tuple[list[str], dict[str, str]]:
    """``vllm serve``'s command-line flags and environment for the ``model`` and ``engine``
    sections of a job config: the keyword arguments the in-process engine passes to
    ``vllm.LLM`` (udfs/engines/vllm_engine.py), as flags."""
    from pydantic import ValidationError

    from pipelines.config.engine import VLLMEngineConfig
    from pipelines.config.sections import ModelConfig
    from pipelines.plan.model import resolve_max_model_len
    from pipelines.plan.specs import vllm_engine_options
    from udfs.engines.vllm_engine import llm_kwargs, on_cpu

    try:
        model_config = ModelConfig(**{**(config.get("model") or {}), "name": model})
        engine = VLLMEngineConfig(**(config.get("engine") or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"serve: {where}: {first['msg']}") from None
    max_model_len = resolve_max_model_len(model, model_config.max_model_len,
                                          model_config.trust_remote_code)
    options = vllm_engine_options(model_config, engine, max_model_len)
    cpu = on_cpu()
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}  # as udfs/engines/vllm_engine.py sets it
    multiprocessing = options.pop("multiprocessing", None)
    if multiprocessing is not None or cpu:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    if threads := options.pop("cpu_threads", None):
        env["OMP_NUM_THREADS"] = str(threads)
    adapters = options.pop("adapters", None) or {}
    lora = {k: options.pop(k, None) for k in ("max_lora_rank", "max_loras", "max_cpu_loras")}
    kwargs = llm_kwargs(model, options, cpu, adapters=adapters, lora=lora)
    kwargs.pop("distributed_executor_backend", None)  # vllm serve picks its own
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    for name, path in sorted(adapters.items()):
        flags += ["--lora-modules", f"{name}={path}"]
    return flags, env


_CURRENT: list = []  # the server's resident engine, once made (a server has one)


def resident_engine() -> ResidentEngine | None:
    """The server's resident engine, if it has one: the runner releases it for an embedding
    batch on a GPU it fills (serve/runner.py: engine_turn)."""
    return _CURRENT[-1] if _CURRENT else None


class ResidentEngine:
    """One ``vllm serve`` for the server's life, watched and started again if it dies; on a
    GPU, released while an embedding batch's own engine needs the GPU, and loaded again
    for the next generation batch (``release``, ``acquire``)."""

    def __init__(self, data_dir: Path, model: str, served_model: str, config: dict):
        from udfs.engines.vllm_engine import on_cpu

        self.data_dir, self.model, self.served_model = Path(data_dir), model, served_model
        self.flags, self.env = resident_settings(model, config)
        # on a GPU the engine fills it (gpu_memory_utilization): a second engine beside it
        # would not fit; on a CPU nothing fills
        self.on_gpu = not on_cpu()
        self.held = True  # it should be loaded (False: released for another engine)
        self._loading: threading.Thread | None = None
        _CURRENT[:] = [self]
        self.port = _stable_port(self.data_dir / PORT_FILE)
        self.key = secrets.token_urlsafe(24)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None
        self._stopping = False

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.model, "--served-model-name", self.served_model, "--host", "127.0.0.1",
                "--port", str(self.port), "--disable-uvicorn-access-log", *self.flags]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start it and wait until it serves the model; ConfigError (one line, with the end
        of its log) if it cannot."""
        _stop_stale(self.data_dir / PID_FILE)
        with open(self.data_dir / LOG_FILE, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_terminated_with_parent,
                env={**os.environ, **self.env, "VLLM_API_KEY": self.key,
                     "RAY_USAGE_STATS_ENABLED": "0"})
        (self.data_dir / PID_FILE).write_text(str(self.proc.pid))
        log.info("resident engine: starting %s (pid %d, port %d)", self.model, self.proc.pid,
                 self.port)
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                _kill_group(self.proc.pid)
                raise ConfigError(f"serve: the resident engine (vllm serve {self.model}) "
                                  f"exited with status {self.proc.returncode}: "
                                  f"{_last_line(self.data_dir / LOG_FILE)}")
            if self.ready():
                log.info("resident engine: up in %.1f s", time.monotonic() - started)
                return
            time.sleep(0.5)
        self.stop()
        raise ConfigError(f"serve: the resident engine did not start in {timeout:.0f} s; "
                          f"see {self.data_dir / LOG_FILE}")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/models", timeout=5, headers={
                "Authorization": f"Bearer {self.key}"}).status_code == 200
        except httpx.HTTPError:
            return False

    def watch(self) -> None:
        """A thread: the engine started again (same port and key) whenever it dies, unless
        it was released."""
        def loop():
            while not self._stopping:
                time.sleep(2)
                if self.proc is not None and self.proc.poll() is not None \
                        and not self._stopping and self.held and not self.loading():
                    log.warning("resident engine: exited with status %s; starting it again",
                                self.proc.returncode)
                    _kill_group(self.proc.pid)  # its engine core process too
                    try:
                        self.start()
                    except ConfigError as exc:
                        log.error("%s", exc)

        threading.Thread(target=loop, name="overnight-serve-engine", daemon=True).start()

    def release(self) -> None:
        """The engine stopped for now, its GPU free for another engine (an embedding batch's);
        ``acquire`` loads it again."""
        self.held = False
        if self.proc is not None:
            _kill_group(self.proc.pid)
            self.proc.wait()
        log.info("resident engine: released for an embedding batch's own engine")

    def acquire(self) -> None:
        """Loading again started (in a thread: a load takes minutes on a GPU), if released."""
        if self.held or self._stopping:
            return
        self.held = True

        def load():
            try:
                self.start()
            except ConfigError as exc:
                log.error("%s", exc)

        self._loading = threading.Thread(target=load, name="overnight-serve-engine-load",
                                         daemon=True)
        self._loading.start()

    def loading(self) -> bool:
        return self._loading is not None and self._loading.is_alive()

    def serving(self) -> bool:
        """Loaded and answering: batches may run on it."""
        return self.held and not self.loading() and self.proc is not None \
            and self.proc.poll() is None

    def stop(self) -> None:
        """The engine's whole process group killed: the API server and vLLM's engine core
        process, which outlives a killed API server otherwise, its memory held."""
        self._stopping = True
        if self.proc is not None:
            _kill_group(self.proc.pid)
            self.proc.wait()

    def job_config(self, config: dict, max_running: int) -> dict:
        """A batch's job config: the same model and sampling, its engine this one. Each batch
        keeps at most the engine's share of requests in flight (``max_concurrency``), so the
        engine serves every running batch's requests side by side (see Runner)."""
        http = {"kind": "http", "base_url": self.base_url, "model": self.served_model,
                "endpoint": "completions", "api_key_env": KEY_ENV,
                "max_concurrency": max(1, BATCH_IN_FLIGHT // max_running),
                # a restart of the engine takes a while: requests wait for it, not fail
                "max_retries": 12}
        recovery = {k: v for k, v in (config.get("engine") or {}).items()
                    if k in ("max_restarts", "stall_timeout_s")}
        return {**config, "engine": {**http, **recovery}}


# Requests in flight on the resident engine, shared among the running batches: enough to keep
# its continuous batching full, each batch's share sent as it finishes the last.
BATCH_IN_FLIGHT = 256


def _terminated_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """Linux: SIGTERM to the engine's API server when the server's thread that started it
    dies, so that it stops its engine core process too (a SIGKILL would leave that behind)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_stale(pid_file: Path) -> None:
    """What an engine of an earlier server left running (its API server where PDEATHSIG is
    unavailable, its engine core process where the API server was killed): its process group
    killed, if a process of it is still vLLM's."""
    try:
        pgid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    if any(b"vllm" in command or b"VLLM" in command for command in group(pgid)):
        _kill_group(pgid)


def _stable_port(record: Path) -> int:
    """The port the engine had under the last server, if it is free, else a new one (kept in
    ``record``): the batches' job configs name the engine's URL, and a batch resumed after a
    restart resumes only if its job's settings are the same."""
    try:
        port = int(record.read_text())
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    except (OSError, ValueError):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if record.exists():
            log.warning("resident engine: on a new port, %d: a batch unfinished under the "
                        "last server starts again from its first request", port)
        record.write_text(str(port))
    return port


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:300] if lines else "(no log)"
