"""``overnight serve``: its settings checked in one place, then the state, the queue and uvicorn.

Everything a user can get wrong (no key, a config that cannot be read, no model) is a
``ConfigError`` before the port is opened: one line, exit status 2, like every other command.
"""

from __future__ import annotations

import logging
import os
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
                  data_dir: str, host: str, port: int, max_upload_mb: float) -> ServeSettings:
    raw: dict = {}
    if config:
        try:
            raw = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{config}: cannot read: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{config}: not a mapping of sections")
    raw = {k: v for k, v in raw.items() if k not in JOB_ONLY_SECTIONS}
    model = model or (raw.get("model") or {}).get("name")
    if not model:
        raise ConfigError("serve: no model; give --model, or a --config with model.name")
    return ServeSettings(data_dir=Path(data_dir).resolve(), model=model, config=raw,
                         overrides=list(overrides), host=host, port=port,
                         max_upload_bytes=int(max_upload_mb * (1 << 20)))


def serve(settings: ServeSettings, keys: list[str]) -> None:
    """Run until interrupted. Batches left unfinished by an earlier server are picked up."""
    import uvicorn

    from serve.app import create_app, key_owner
    from serve.runner import Runner
    from serve.store import Store

    store = Store(settings.data_dir)
    config_path = None
    if settings.config:
        config_path = settings.data_dir / "batch-config.yaml"
        config_path.write_text(yaml.safe_dump(settings.config), encoding="utf-8")
    runner = Runner(store, model=settings.model, config=config_path,
                    overrides=settings.overrides, served_model=settings.model)
    app = create_app(store, runner, owners={key_owner(k) for k in keys},
                     max_upload_bytes=settings.max_upload_bytes)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    runner.start()
    print(f"overnight serve: http://{settings.host}:{settings.port}/v1  model "
          f"{settings.model}, data {settings.data_dir}, {len(keys)} key(s)", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
