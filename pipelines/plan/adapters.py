"""LoRA adapters (``model.adapters``): each checked against the base model before any engine
starts, and the engine's LoRA settings derived from them.

An adapter is a directory in PEFT's format: ``adapter_config.json`` (its ``peft_type``, rank
``r``, ``target_modules``) and its weights (``adapter_model.safetensors``), whose
``...<module>.lora_A.weight`` is ``r x in_features`` and ``lora_B`` ``out_features x r`` of the
base model's ``<module>.weight``. Reading only the two files' headers (no weights are loaded),
pre-flight finds what would otherwise fail an engine minutes into a job, or worse, load: a path
that is not there or not a LoRA, an adapter for another model (shapes that differ), a rank above
``model.max_lora_rank``, target modules the model lacks. Each is one line naming the adapter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipelines.errors import ConfigError

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
WEIGHTS = "adapter_model.safetensors"


def check_adapters(model) -> dict:
    """``model`` is the job's ModelConfig. The engine's adapter options ({"adapters": {name:
    absolute directory}, "max_lora_rank", "max_loras", "max_cpu_loras"}); ConfigError naming
    the adapter on a problem."""
    base = base_weights(model.name)
    ranks = []
    for name, path in model.adapters.items():
        ranks.append(_check_adapter(f"model.adapters.{name}", Path(path).expanduser(), base,
                                    model.name))
    rank = max(ranks)
    if model.max_lora_rank is not None and rank > model.max_lora_rank:
        name = list(model.adapters)[ranks.index(rank)]
        raise ConfigError(f"model.adapters.{name}: rank {rank} is above model.max_lora_rank "
                          f"{model.max_lora_rank}; raise it or remove the setting")
    if rank > RANKS[-1]:
        name = list(model.adapters)[ranks.index(rank)]
        raise ConfigError(f"model.adapters.{name}: rank {rank} is above vLLM's largest, "
                          f"{RANKS[-1]}")
    return {"adapters": {n: str(Path(p).expanduser().resolve())
                         for n, p in model.adapters.items()},
            "max_lora_rank": model.max_lora_rank or next(r for r in RANKS if r >= rank),
            "max_loras": model.max_loras, "max_cpu_loras": model.max_cpu_loras}


def _check_adapter(where: str, path: Path, base: dict | None, model_name: str) -> int:
    """One adapter's checks; its rank."""
    if not path.exists():
        raise ConfigError(f"{where}: {str(path)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{where}: {str(path)!r} is not a directory (a PEFT adapter is a "
                          "directory with adapter_config.json)")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where}: {str(path)!r} is not a PEFT adapter (no "
                          "adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: adapter_config.json does not parse: {exc}") from None
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ConfigError(f"{where}: a {kind or 'unknown'} adapter, not a LoRA one "
                          "(adapter_config.json peft_type)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{where}: adapter_config.json r (the rank) must be a positive "
                          f"integer (got {rank!r})")
    weights = path / WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{where}: no {WEIGHTS} in {str(path)!r}")
    if base is None:  # the base model's weights are not here to compare (a hub name)
        return rank
    targets = config.get("target_modules")
    leaves = {name.rsplit(".", 1)[-1] for name in base}
    if isinstance(targets, list):
        lacking = sorted(t for t in targets if t not in leaves)
        if lacking:
            raise ConfigError(f"{where}: targets {', '.join(lacking)}, which {model_name!r} "
                              f"does not have (its modules: {', '.join(sorted(leaves))})")
    elif isinstance(targets, str) and not any(re.fullmatch(targets, m) for m in base):
        raise ConfigError(f"{where}: target_modules {targets!r} matches no module of "
                          f"{model_name!r}")
    for key, shape in _headers(weights).items():
        found = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if found is None:
            continue
        module, which = found.groups()
        mine = base.get(module)
        if mine is None:
            raise ConfigError(f"{where}: its weights are for a module {module!r}, which "
                              f"{model_name!r} does not have: an adapter for another model")
        out_features, in_features = mine
        want = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(shape) != want:
            raise ConfigError(f"{where}: not an adapter for {model_name!r}: {module} lora_"
                              f"{which} is {'x'.join(map(str, shape))}, the model's "
                              f"{module} needs {'x'.join(map(str, want))} at rank {rank}")
    return rank


def adapter_sampling(config, prompt, adapter: str | None = None) -> dict:
    """The SamplingSpec fields that pick each request's LoRA adapter: the job's adapters,
    the default (a step's own, else model.adapter) and the prompt's adapter column."""
    if not config.model.adapters:
        return {}
    return {"adapters": tuple(config.model.adapters), "adapter": adapter or config.model.adapter,
            "adapter_column": prompt.adapter_column}


def base_weights(model_name: str) -> dict | None:
    """The base model's linear weights: {module name: (out_features, in_features)}, from its
    safetensors headers; None where the model is not a local directory of them."""
    root = Path(model_name).expanduser()
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    modules = {}
    for file in files:
        for key, shape in _headers(file).items():
            if key.endswith(".weight") and len(shape) == 2:
                modules[key[:-len(".weight")]] = tuple(shape)
    return modules


def _headers(path: Path) -> dict[str, list[int]]:
    """A safetensors file's tensors and shapes, from its header alone."""
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size)) if 0 < size < 1 << 28 else None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file")
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def adapters_fingerprint(adapters: dict[str, str | None] | None) -> dict | None:
    """What a resumed run must find unchanged, and a re-run's request keys hold: each
    adapter's files, its weights by their content (pipelines/plan/model_files.py: an adapter
    retrained in place is another job, whatever its size)."""
    from pipelines.plan.model_files import adapter_fingerprint

    if not adapters:
        return None
    # (a server's adapter, path None: its name is what the job sends)
    return {name: None if path is None else adapter_fingerprint(path)
            for name, path in sorted(adapters.items())}
