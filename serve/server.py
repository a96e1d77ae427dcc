"""``overnight serve``: its settings checked in one place, then the state, the queue and uvicorn.

Everything a user can get wrong (no key, a config that cannot be read, no model) is a
``ConfigError`` before the port is opened: one line, exit status 2, like every other command.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipelines.errors import ConfigError

KEYS_ENV = "OVERNIGHT_API_KEYS"
# what a batch file sets itself; a job config may hold them (one YAML for `run` and `serve`)
JOB_ONLY_SECTIONS = ("input", "prompt", "output", "structured")


@dataclass
class ServeSettings:
    data_dir: Path
    model: str
    config: dict = field(default_factory=dict)  # engine, model, sampling, resources, report
    overrides: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_bytes: int = 200 << 20  # the hosted API's limit for a batch input file
    served_model_name: str = ""  # the ``model`` batches and results give; "": the dir's name
    retention_days: float | None = None  # finished batches' data kept this long (None: kept)
    completion_window_s: float = 86400  # a batch unfinished this long after its creation expires
    engine: str = "resident"  # or "per-batch": each batch loads an engine of its own
    max_running: int = 4  # batches run at once (on the resident engine); 1 without one

    @property
    def served_model(self) -> str:
        from pipelines.batchfile.envelopes import served_name

        return self.served_model_name or served_name(self.model)


def read_keys(keys_file: str | None, environ=os.environ) -> list[str]:
    """Keys from a file (one a line; blank lines and ``#`` comments skipped) and from
    ``OVERNIGHT_API_KEYS`` (comma- or space-separated)."""
    keys = [k for k in environ.get(KEYS_ENV, "").replace(",", " ").split()]
    if keys_file:
        try:
            text = Path(keys_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--api-keys-file {keys_file}: cannot read: "
                              f"{exc.strerror or exc}") from None
        keys += [line.strip() for line in text.splitlines()
                 if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"serve: no API keys; give --api-keys-file FILE (one key a line) "
                          f"or set {KEYS_ENV}")
    if any(len(k) < 8 for k in keys):
        raise ConfigError("serve: an API key is shorter than 8 characters")
    return keys


def load_settings(*, config: str | None, model: str | None, overrides: list[str],
                  data_dir: str, host: str, port: int, max_upload_mb: float,
                  served_model_name: str | None = None,
                  retention_days: float | None = None,
                  completion_window_s: float = 86400, engine: str = "resident",
                  max_running: int | None = None) -> ServeSettings:
    from pipelines.config.load import apply_overrides, read_yaml

    raw: dict = {}
    if config:
        try:
            raw = read_yaml(config) or {}  # a key given twice refused, as a job's
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{config}: cannot read: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{config}: not a mapping of sections")
    raw = apply_overrides({k: v for k, v in raw.items() if k not in JOB_ONLY_SECTIONS},
                          list(overrides))
    model = model or (raw.get("model") or {}).get("name")
    if not model:
        raise ConfigError("serve: no model; give --model, or a --config with model.name")
    if retention_days is not None and not retention_days > 0:
        raise ConfigError(f"serve: --retention-days {retention_days}: must be more than 0")
    if not completion_window_s > 0:
        raise ConfigError(f"serve: --completion-window-s {completion_window_s}: must be more "
                          "than 0")
    if engine not in ("resident", "per-batch"):
        raise ConfigError(f"serve: --engine {engine}: resident or per-batch")
    if max_running is not None and max_running < 1:
        raise ConfigError(f"serve: --max-running-batches {max_running}: at least 1")
    for key, what in (("reasoning_parser", "reasoning"), ("tool_parser", "tool calls")):
        if engine == "resident" and (raw.get("model") or {}).get(key):
            raise ConfigError(f"serve: model.{key} needs --engine per-batch (the resident "
                              "engine takes requests as the HTTP engine sends them, which "
                              f"does not parse {what} yet)")
    return ServeSettings(data_dir=Path(data_dir).resolve(), model=model, config=raw,
                         host=host, port=port, engine=engine,
                         max_running=max_running or (4 if engine == "resident" else 1),
                         max_upload_bytes=int(max_upload_mb * (1 << 20)),
                         served_model_name=served_model_name or "",
                         retention_days=retention_days,
                         completion_window_s=completion_window_s)


SWEEP_EVERY = 600  # seconds between looks for finished batches' data past the retention


def _sweep_loop(store, retention_days: float | None) -> None:
    """Finished batches' folders removed once past the retention (and, always, what a
    deleted input file's batches kept of it once they end)."""
    log = logging.getLogger("overnight.serve")
    retention = retention_days * 86400 if retention_days is not None else None
    while True:
        try:
            for batch_id in store.sweep(retention):
                log.info("batch %s: its data removed (retention %s days)", batch_id,
                         retention_days)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.exception("sweep")
        time.sleep(SWEEP_EVERY)


def serve(settings: ServeSettings, keys: list[str]) -> None:
    """Run until interrupted. Batches left unfinished by an earlier server are picked up."""
    import uvicorn

    from serve.app import create_app
    from serve.runner import Runner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per look at the engine
    store = _open_store(settings, keys)
    config_path = _write_config(settings)
    engine, resident = _start_resident_engine(settings)
    runner = Runner(store, model=settings.model, config=config_path, overrides=[],
                    served_model=settings.served_model, max_running=settings.max_running,
                    resident=resident)
    app = create_app(store, runner, owners={store.owner_of(k) for k in keys},
                     max_upload_bytes=settings.max_upload_bytes,
                     window_s=settings.completion_window_s)
    runner.start()
    threading.Thread(target=_sweep_loop, args=(store, settings.retention_days),
                     name="overnight-serve-sweep", daemon=True).start()
    print(f"overnight serve: http://{settings.host}:{settings.port}/v1  model "
          f"{settings.served_model} ({settings.model}), data {settings.data_dir}, "
          f"{len(keys)} key(s); batches page http://{settings.host}:{settings.port}/ui",
          flush=True)
    def stop_processes() -> None:
        runner.stop_workers()
        if engine is not None:
            engine.stop()

    # at shutdown: uvicorn re-raises a SIGTERM once it has stopped, so a `finally` here
    # would not run; its shutdown event does
    app.router.add_event_handler("shutdown", stop_processes)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    finally:
        stop_processes()


def _open_store(settings: ServeSettings, keys: list[str]):
    """The server's state in ``data_dir``, readable by this user only, with ``keys`` known."""
    from serve.store import Store

    # Prompts, results and the key HMACs are this user's alone: every file and folder the
    # server and its batches' children make is theirs only, and what an earlier server made
    # with a wider mode is closed (the data directory itself shuts the rest)
    os.umask(0o077)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_dir, 0o700)
    store = Store(settings.data_dir)
    for path in settings.data_dir.glob("state.sqlite3*"):
        os.chmod(path, 0o600)
    store.adopt_keys(keys)
    return store


def _write_config(settings: ServeSettings) -> Path | None:
    """The batches' job config, as a YAML file their ``overnight batch`` reads; None: none."""
    if not settings.config:
        return None
    config_path = settings.data_dir / "batch-config.yaml"
    config_path.write_text(yaml.safe_dump(settings.config), encoding="utf-8")
    return config_path


def _start_resident_engine(settings: ServeSettings):
    """The resident engine loaded, and what the runner needs of it (a batch's job config on
    it, the environment with its key); (None, None) with ``--engine per-batch`` or an HTTP
    engine (a server already)."""
    engine_kind = (settings.config.get("engine") or {}).get("kind", "vllm")
    if settings.engine != "resident" or engine_kind == "http":
        return None, None
    from serve.engine import KEY_ENV, ResidentEngine

    print(f"overnight serve: loading {settings.model} into the resident engine "
          f"(log: {settings.data_dir / 'engine.log'})", flush=True)
    engine = ResidentEngine(settings.data_dir, settings.model, settings.served_model,
                            settings.config)
    engine.start()
    engine.watch()
    warm_path = settings.data_dir / "batch-config-resident.yaml"
    warm_path.write_text(yaml.safe_dump(engine.job_config(settings.config,
                                                          settings.max_running)),
                         encoding="utf-8")
    return engine, (warm_path, {KEY_ENV: engine.key})
