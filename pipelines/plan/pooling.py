"""Pre-flight for ``task: embed | score | classify``: what the model says about its outputs.

A pooling job's output columns depend on the model: the vector's length (embed), the labels
(classify), and whether it has the one output a score needs. They are read here from the
model's own config files, before any engine starts, so that a wrong model is one line and the
column types are fixed for every part (a part whose rows all failed still has them).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, JobError, one_line
from udfs import columns
from udfs.stages.pooler import PoolingSpec


def plan_pooling(config: JobConfig) -> tuple[JobConfig, PoolingSpec]:
    """The config with output.labels filled in (classify), and the pooler's spec."""
    hf = _hf_config(config)
    labels: tuple[str, ...] = ()
    size = None
    if config.task == "classify":
        labels = _labels(config, hf)
        config = config.model_copy(update={"output": config.output.model_copy(
            update={"labels": list(labels)})})
    elif config.task == "score":
        outputs = getattr(hf, "num_labels", None)
        if outputs != 1 or not _is_classifier(hf):
            raise JobError(f"model.name {config.model.name!r}: task: score needs a model "
                           "with one output (a cross-encoder or reward model, "
                           "*ForSequenceClassification with num_labels 1); this one has "
                           f"{_describe(hf)}")
    elif config.sampling.overrides_column is None:
        size = config.output.dimensions or embedding_size(config.model.name, hf)
    # (rows that set their own dimensions: a list column, each vector as long as asked)
    return config, PoolingSpec(task=config.task, output_column=config.output.column,
                               labels=labels, size=size,
                               normalize=config.output.normalize if config.task == "embed"
                               else None, dimensions=config.output.dimensions,
                               overrides_column=config.sampling.overrides_column)


def max_seq_length(name: str) -> int | None:
    """A sentence-transformers model's own limit (sentence_bert_config.json), which vLLM
    takes as the context length of a pooling model with absolute positions."""
    try:
        return int(json.loads((Path(name) / "sentence_bert_config.json").read_text())
                   ["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def embedding_size(name: str, hf) -> int:
    """The vector's length as vLLM's ModelConfig.embedding_size finds it: the config's
    embedding_size, else a sentence-transformers Dense layer's out_features, else the
    hidden size."""
    override = getattr(hf, "embedding_size", None)
    if override:
        return int(override)
    try:
        modules = json.loads((Path(name) / "modules.json").read_text())
        dense = [m for m in modules if m.get("type", "").endswith(".Dense")]
        if dense:
            found = json.loads((Path(name) / dense[-1]["path"] / "config.json").read_text())
            return int(found["out_features"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return int(text.hidden_size)


def _labels(config: JobConfig, hf) -> tuple[str, ...]:
    if not _is_classifier(hf):
        raise JobError(f"model.name {config.model.name!r}: task: classify needs a "
                       "sequence-classification model (*ForSequenceClassification); this one "
                       f"has {_describe(hf)}")
    count = int(getattr(hf, "num_labels", 0) or 0)
    id2label = getattr(hf, "id2label", None) or {}
    labels = tuple(config.output.labels or (str(id2label.get(i, f"LABEL_{i}"))
                                            for i in range(count)))
    if len(labels) != count:
        raise ConfigError(f"output.labels: {len(labels)} given; the model has {count} "
                          "outputs")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"output.labels: a label repeats ({', '.join(labels)}); each "
                          f"has a column {columns.PROBABILITY_PREFIX}<label>")
    return labels


def _is_classifier(hf) -> bool:
    return any(a.endswith(("ForSequenceClassification", "ClassificationModel"))
               for a in getattr(hf, "architectures", None) or ())


def _describe(hf) -> str:
    archs = ", ".join(getattr(hf, "architectures", None) or ()) or "no architecture"
    return f"{archs}, num_labels {getattr(hf, 'num_labels', None)}"


def _hf_config(config: JobConfig):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(config.model.name,
                                          trust_remote_code=config.model.trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HF errors...
        raise JobError(f"model.name {config.model.name!r}: cannot read its config: "
                       f"{one_line(exc, 300)}") from None
