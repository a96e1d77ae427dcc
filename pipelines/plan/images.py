"""Pre-flight for a job's images (``prompt.images``): the columns can hold images, the model
takes them, no row holds more than the engine is told to allow; and where relative paths are
read from. What a row's image holds is checked where it is loaded (udfs/rows/images.py): a bad one
is that row's error, never the job's.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, InputError, did_you_mean
from pipelines.read import InputPlan, read_block
from udfs.rows.images import ImageSpec

# What a prompt.images column may be: bytes, text (a path or a data: URL), a {bytes, path}
# struct, a list of any of these, or all null
_KINDS = "bytes, a path or data: URL (text), a {bytes, path} struct, or a list of these"


def check_images(config: JobConfig, plan: InputPlan) -> int:
    """A job with images (any prompt's prompt.images): its columns hold images, the model
    takes them; -> the most images a prompt may hold (0: a job without images)."""
    prompts = [p for p in config.prompts() if p.images]
    if not prompts:
        return 0
    if config.engine.kind == "http" and config.engine.endpoint != "chat":
        raise ConfigError("prompt.images with engine.kind http needs engine.endpoint: chat "
                          "(the images go to the server as data: URLs in the chat messages)")
    for prompt in prompts:
        check_image_columns(prompt, plan.schema)
    if config.engine.kind == "vllm":  # a server's model is the server's to say
        check_model_takes_images(config.model.name, config.model.trust_remote_code)
    sample = read_block(plan.blocks[0], plan.schema) if plan.blocks else None
    return max(max_images(p, sample) for p in prompts)


def image_spec(prompt, input_path: str) -> ImageSpec | None:
    """The renderer's ImageSpec for a prompt with images: prompt.images columns, or a
    messages column, whose image_url parts are images (None: a template without images)."""
    if not prompt.images and prompt.messages_column is None:
        return None
    return ImageSpec(columns=tuple(prompt.images or ()),
                     root=table_folder(input_path) if prompt.images else None,
                     max_pixels=prompt.max_image_pixels, fetch_urls=prompt.fetch_image_urls)


def table_folder(input_path: str) -> str:
    """The folder a relative image path is read from: the input's directory, a file's or a
    glob's folder; an object store's URI keeps its options (``?endpoint_override=...``)."""
    base, sep, query = input_path.partition("?") if "://" in input_path else (input_path, "", "")
    parts = base.split("/")
    glob = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)
    if glob is not None:
        folder = "/".join(parts[:glob]) or "."
    elif "://" not in base and os.path.isdir(base):
        folder = base
    elif "://" in base and not Path(base).suffix:  # a prefix of files
        folder = base
    else:
        folder = "/".join(parts[:-1]) or "."
    folder = folder.rstrip("/") or "/"
    if "://" not in folder:
        folder = os.path.abspath(folder)
    return folder + (sep + query if sep else "")


def check_image_columns(prompt, schema: pa.Schema, key: str = "prompt") -> None:
    """Each prompt.images column exists and is of a type that can hold an image."""
    for name in prompt.images or ():
        if name not in schema.names:
            raise InputError(f"{key}.images: column {name!r} is not a column of the input"
                             f"{did_you_mean(name, schema.names)}; its columns are: "
                             f"{', '.join(schema.names)}")
        kind = schema.field(name).type
        if not _holds_images(kind):
            raise InputError(f"{key}.images: column {name!r} is {kind}, which cannot hold an "
                             f"image; it must hold {_KINDS}")


def _holds_images(kind: pa.DataType, nested: bool = False) -> bool:
    if pa.types.is_null(kind) or pa.types.is_binary(kind) or pa.types.is_large_binary(kind) \
            or pa.types.is_fixed_size_binary(kind) or pa.types.is_string(kind) \
            or pa.types.is_large_string(kind) or pa.types.is_binary_view(kind) \
            or pa.types.is_string_view(kind):
        return True
    if pa.types.is_struct(kind):
        names = {kind.field(i).name for i in range(kind.num_fields)}
        return bool(names & {"bytes", "path"}) and all(
            _holds_images(kind.field(n).type, True) for n in names & {"bytes", "path"})
    if not nested and (pa.types.is_list(kind) or pa.types.is_large_list(kind)
                       or pa.types.is_list_view(kind)):
        return _holds_images(kind.value_type, True)
    return False


def most_images(prompt, table: pa.Table) -> int:
    """The most images one row of ``table`` holds over the prompt's image columns."""
    total = None
    for name in prompt.images or ():
        column = table.column(name)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            counts = pc.fill_null(pc.list_value_length(column), 0)
        else:
            counts = pc.if_else(pc.is_null(column), 0, 1)
        counts = counts.cast(pa.int64())
        total = counts if total is None else pc.add(total, counts)
    if total is None or len(total) == 0:
        return 0
    return int(pc.max(total).as_py() or 0)


def max_images(prompt, sample: pa.Table | None) -> int:
    """The images a prompt may hold: prompt.max_images, else the image columns' number, or
    more where a row of ``sample`` (the first block) holds more; the engine is told so."""
    if prompt.max_images is not None:
        if sample is not None:
            seen = most_images(prompt, sample)
            if seen > prompt.max_images:
                raise ConfigError(f"prompt.max_images is {prompt.max_images}, and a row of the "
                                  f"table's first block holds {seen} images; raise it")
        return prompt.max_images
    seen = most_images(prompt, sample) if sample is not None else 0
    return max(len(prompt.images or ()), seen, 1)


def check_model_takes_images(name: str, trust_remote_code: bool = False) -> None:
    """The model is one vLLM runs with images: its architecture among vLLM's multimodal
    models (read from vLLM's source, not imported), or, where that cannot be read, a config
    with a vision tower."""
    config = read_model_config(name, trust_remote_code)
    if config is None:
        return  # the engine's start says what is wrong with a model pre-flight cannot read
    architectures = config.get("architectures") or []
    known = vllm_multimodal_architectures()
    takes = (any(a in known for a in architectures) if known is not None and architectures
             else "vision_config" in config)
    if not takes:
        which = ", ".join(architectures) or config.get("model_type") or "its architecture"
        raise ConfigError(f"prompt.images: model.name {name!r} ({which}) takes no images; "
                          "use a vision-language model (one of vLLM's multimodal models)")


def read_model_config(name: str, trust_remote_code: bool) -> dict | None:
    """A model's config.json values (a local folder's file, or through transformers); None
    where it cannot be read (the engine's start then says why)."""
    local = Path(name) / "config.json"
    if local.is_file():
        try:
            value = json.loads(local.read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # noqa: BLE001 - a model that cannot be read: the engine says
        return None


@functools.cache
def vllm_multimodal_architectures() -> frozenset[str] | None:
    """The architectures vLLM runs as multimodal models (``_MULTIMODAL_MODELS`` in
    ``vllm/model_executor/models/registry.py``), read from its source, not imported; None
    where vLLM is not installed here or its source is laid out otherwise."""
    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))
        tree = ast.parse((root / "model_executor" / "models" / "registry.py").read_text())
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(n, ast.Name) and n.id == "_MULTIMODAL_MODELS" for n in targets) \
                and isinstance(node.value, ast.Dict):
            names = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            return frozenset(names) or None
    return None
