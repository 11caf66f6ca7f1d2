"""Facts about the machine this process runs on, and the sizes users write: where derived artifacts are
cached, which CPU features and cores there are, whether CUDA is present, '4GiB' as bytes; and handing the
process's freed heap back to it (release_free_heap).

A leaf: it imports nothing of tokenmill's, and no torch unless a GPU driver is present (cuda_available).
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
from typing import Any


def cache_root() -> str:
    """Where derived artifacts live (converted GGUF models, compiled kernels): $TOKENMILL_CACHE_DIR."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: Any) -> int:
    """'4GiB' -> 4294967296; plain numbers are bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. 4GiB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot products in hardware (AVX512_BF16 or AMX): --dtype auto's prior."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_key() -> str:
    """This machine's CPU model and count, as a file-name-safe key (caches of measured figures and of model
    resolutions)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}-{os.cpu_count()}cpus".replace("/", "_").replace(" ", "_")


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU driver is present (a CPU box's
    `tokenmill serve` keeps torch out of its API process: models/resolution_cache.py)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere a no-op); True if any went.
    A start frees a lot at once: a tokenizer's JSON parsed into Python objects (~115 MB at a 152k vocabulary),
    a GGUF's metadata arrays on its first use (~90 MB), the kernel probes' buffers. glibc hands back freed memory
    only from the top of its heap, so live blocks above those frees kept 30-120 MB resident that nothing used
    (SmolLM2 and 0.5B Qwen2 GGUFs, measured). Call it where such a phase ends, never per step."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    return bool(trim(0))
