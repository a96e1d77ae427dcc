"""What this machine's processor means for the engine: the dtype a job's ``dtype: auto`` becomes.

Reads ``/proc/cpuinfo`` only; imports neither torch nor vLLM, so ``overnight doctor`` and the
engine can both ask it cheaply.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's feature flags (``flags`` on x86, ``Features`` on Arm); empty where
    the file cannot be read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_fast_bf16(flags: frozenset[str]) -> bool:
    """True where bfloat16 matrix products run natively fast on this CPU: Intel's AMX tiles.

    ``avx512_bf16`` alone is not enough: on an AMD EPYC with it (and no AMX) vLLM's CPU engine
    generated 25 tok/s in bfloat16 against 144 tok/s in float32 (SmolLM2-135M, 2 cores).
    """
    return "amx_bf16" in flags


def auto_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """The dtype to give vLLM for a job's ``dtype: auto`` on ``device`` ("cpu", "cuda", "rocm").

    On a GPU, ``auto``: vLLM takes the model's own dtype (float16 where the GPU has no
    bfloat16). On a CPU vLLM's ``auto`` means bfloat16, several times slower than float32
    where the CPU has no native bfloat16: float32 there.
    """
    if device != "cpu":
        return "auto"
    if flags is None:
        flags = cpu_flags()
    return "bfloat16" if cpu_has_fast_bf16(flags) else "float32"
