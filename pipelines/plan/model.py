"""The model as pre-flight checks it: its tokenizer loads, it has a chat template where a
prompt needs one, and its context length (max_model_len) is settled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, JobError, one_line
from udfs.stages.prompts import load_tokenizer


def resolve_model(config: JobConfig) -> int:
    """Check that the model's tokenizer loads and settle max_model_len: from the model's
    files where it is a local directory with a tokenizer.json (``_local_model``), else
    through transformers."""
    name, remote_code = config.model.name, config.model.trust_remote_code
    local = None if remote_code else _local_model(name)
    tokenizer = None
    if local is None:
        try:
            tokenizer = load_tokenizer(name, remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, HF errors...
            raise JobError(f"model.name {name!r}: cannot load its tokenizer: "
                           f"{one_line(exc, 300)}") from None
    chat = local.chat_template if local else bool(getattr(tokenizer, "chat_template", None))
    if any(p.messages_column for p in config.prompts()) and not chat:
        raise ConfigError(f"prompt.messages_column needs a chat model; {name!r} has no "
                          "chat template")
    if config.model.max_model_len is None and local and local.max_position_embeddings:
        return local.max_position_embeddings
    if config.model.max_model_len is not None and config.engine.kind == "vllm":
        # past the model's own limit vLLM refuses it, once an engine has started
        from pipelines.plan.images import read_model_config
        from pipelines.plan.max_model_len import check_max_model_len

        check_max_model_len(name, config.model.max_model_len,
                            read_model_config(name, remote_code),
                            pooling=config.task != "generate")
    # (without a length in config.json, transformers reads the config and the tokenizer)
    return resolve_max_model_len(name, config.model.max_model_len, remote_code, tokenizer)

@dataclass(frozen=True)
class _LocalModel:
    chat_template: bool
    max_position_embeddings: int | None


def _local_model(name: str) -> _LocalModel | None:
    """What pre-flight needs of a local model directory, read from its files with the
    ``tokenizers`` library alone: the driver starts no engine, and transformers' AutoTokenizer
    imports torch with it (seconds and memory of the driver, for a check). The tokenizer is
    loaded, so a broken one is still found here; the engine's replicas load it through
    transformers, as vLLM does. None where the name is no such directory (a hub name, a
    tokenizer without tokenizer.json, a file that is not JSON): transformers then loads it,
    and says what is wrong."""
    folder = Path(name)
    tokenizer_file, settings_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not (tokenizer_file.is_file() and (folder / "config.json").is_file()):
        return None
    try:
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        model = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict) or not isinstance(model, dict):
        return None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # noqa: BLE001 - the library's own errors: the file is bad
        raise JobError(f"model.name {name!r}: cannot load its tokenizer: "
                       f"{one_line(exc, 300)}") from None
    # where transformers finds a chat template: in tokenizer_config.json, or a file beside it
    chat = bool(settings.get("chat_template")) or any(
        (folder / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))
    length = model.get("max_position_embeddings")
    return _LocalModel(chat, length if isinstance(length, int) and length > 0 else None)


def resolve_max_model_len(name: str, max_model_len: int | None = None,
                          trust_remote_code: bool = False, tokenizer=None) -> int:
    """The model's context length: as configured, else from its config or tokenizer."""
    if max_model_len is not None:
        return max_model_len
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        length = getattr(hf, "max_position_embeddings", None)
    except Exception:
        length = None
    if not length and tokenizer is None:
        try:
            tokenizer = load_tokenizer(name, trust_remote_code)
        except Exception as exc:
            raise JobError(f"model {name!r}: cannot load it: "
                           f"{one_line(exc, 300)}") from None
    length = length or getattr(tokenizer, "model_max_length", None)
    if not length or length > 10_000_000:
        raise ConfigError(f"model.max_model_len: cannot tell {name!r}'s context length; set it")
    return int(length)

