"""A model's context length as vLLM derives it, read from its config without loading it.

``model.max_model_len`` past the model's own limit passed pre-flight, and vLLM refused it only
once an engine started (``User-specified max_model_len ... is greater than the derived
max_model_len``). vLLM's rule (``vllm/config/model.py: _get_and_verify_max_len``, with
``derive_max_model_len_and_key`` in ``vllm/transformers_utils/model_arch_config_convertor.py``)
is followed here on the config's JSON, so that the driver imports neither vLLM nor torch:

- the text model's config (a vision-language model's ``text_config``, as transformers'
  ``get_text_config`` finds it);
- the smallest of its length keys (``max_position_embeddings``, ``n_positions``, ...), where
  ``model_max_length`` wins if given (Command-R);
- a pooling model with absolute positions: at most its tokenizer's ``model_max_length``, and a
  sentence-transformers model's ``max_seq_length`` in its place;
- times the RoPE scaling ``factor``, except for the rope types whose length is scaled already;
- a longer ``max_model_len`` is refused unless the config's ``model_max_length`` allows it,
  or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set (as vLLM allows it then).
"""

from __future__ import annotations

import os
from pathlib import Path

from pipelines.errors import ConfigError

from udfs.stages.chat_content import json_object

# vLLM's possible_keys, in its order
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
               "model_max_length", "max_target_positions", "max_sequence_length",
               "max_seq_length", "seq_len")
# rope types whose max_position_embeddings is scaled already (vLLM does not apply the factor)
SCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
# transformers' get_text_config: the names a composite model's text config goes by
TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")


def text_config(config: dict) -> dict:
    """The text model's config of ``config`` (the config itself for a text model)."""
    found = [config[n] for n in TEXT_CONFIG_NAMES if isinstance(config.get(n), dict)]
    return found[0] if len(found) == 1 else config


def derived_length(config: dict, folder: Path | None = None,
                   pooling: bool = False) -> tuple[int, str] | None:
    """(the longest max_model_len vLLM allows, the key it comes from), or None where the
    config names no length (vLLM then takes what it is given)."""
    text = text_config(config)
    length, key = None, None
    for name in LENGTH_KEYS:
        value = text.get(name)
        if _number(value) and (length is None or value < length):
            length, key = value, name
    if _number(text.get("model_max_length")):
        length, key = text["model_max_length"], "model_max_length"
    if pooling and text.get("position_embedding_type") == "absolute" and folder is not None:
        tokenizer = json_object(folder / "tokenizer_config.json").get("model_max_length")
        if _number(tokenizer) and (length is None or tokenizer < length):
            length, key = tokenizer, "model_max_length in tokenizer_config.json"
    if length is None:
        return None
    factor = 1.0
    if "gemma3" not in str(text.get("model_type", "")):
        for rope in _rope_parameters(text):
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in SCALED_ROPE:
                factor = rope.get("factor", factor) or 1.0
    length = length * factor
    if pooling and folder is not None:
        sentence = json_object(folder / "sentence_bert_config.json").get("max_seq_length")
        if _number(sentence):
            length, key = sentence, "max_seq_length in sentence_bert_config.json"
    return int(length), key


def check_max_model_len(name: str, max_model_len: int, config: dict | None,
                        pooling: bool = False) -> None:
    """ConfigError in one line where vLLM would refuse ``max_model_len`` for the model
    ``name`` (``config``: its config.json's values; None: not readable, nothing checked)."""
    if config is None or _allow_long():
        return
    folder = Path(name) if Path(name).is_dir() else None
    derived = derived_length(config, folder, pooling)
    if derived is None or max_model_len <= derived[0]:
        return
    allowed = text_config(config).get("model_max_length")
    if _number(allowed) and max_model_len <= allowed:
        return
    limit, key = derived
    raise ConfigError(f"model.max_model_len {max_model_len} is more than {name!r} takes: "
                      f"{limit} ({key} in its config); set it to {limit} or less "
                      f"(--set model.max_model_len={limit}), as vLLM would refuse it")


def _allow_long() -> bool:
    """vLLM's own escape hatch (envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    return os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")


def _rope_parameters(text: dict) -> list[dict]:
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        return []
    if all(isinstance(v, dict) for v in rope.values()):  # one per layer type
        return [v for v in rope.values() if v]
    return [rope]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


