"""Hardware figures for the roofline: a datasheet catalog of accelerators and this machine's CPU, measured.

Catalog FLOP/s are dense (no 2:4 sparsity) tensor-core peaks per compute dtype; bandwidth is the HBM/GDDR
datasheet figure. Memory sizes are the datasheet "GB" read as GiB (HBM stacks come in powers of two; what
a driver reports is within a few percent of that). `local-cpu` is measured on the spot: a large matmul
per dtype for FLOP/s, a streaming reduction over a tensor much larger than the caches for bandwidth.

Interconnects (for tensor/pipeline/expert parallel communication) are nominal: the datasheet link rate per
device and direction, and a round per-collective latency of the order NCCL/gloo reach. None is measured here.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Optional

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    bandwidth: float                       # bytes/s
    flops: dict[str, float] = field(default_factory=dict)  # dense peak FLOP/s per compute dtype
    measured: bool = False
    details: dict = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> tuple[str, float]:
        """(the dtype actually used, its peak). Without units for `dtype` the matmul runs at bf16
        (weights upcast), or fp32 where bf16 is missing too."""
        if dtype in self.flops:
            return dtype, self.flops[dtype]
        for fallback in ("bf16", "fp16", "fp32"):
            if fallback in self.flops:
                return fallback, self.flops[fallback]
        raise ValueError(f"{self.name} has no FLOP/s figure")

    def ops_per_byte(self, dtype: str) -> float:
        return self.peak_flops(dtype)[1] / self.bandwidth

    def share(self, fraction: float) -> "Hardware":
        """A process given `fraction` of this machine's cores: that share of its FLOP/s and of its memory
        bandwidth (on the measured CPU both scale with the threads, e.g. decode steps on 1 of 2 cores take ~2x)."""
        flops = {k: v * fraction for k, v in self.flops.items()}
        return replace(self, bandwidth=self.bandwidth * fraction, flops=flops, details={**self.details, "share": fraction})


def _gpu(name, mem_gib, bw_tb_s, **tflops) -> Hardware:
    return Hardware(name, mem_gib * GiB, bw_tb_s * 1e12, {k: v * 1e12 for k, v in tflops.items()})


CATALOG: dict[str, Hardware] = {h.name.lower(): h for h in [
    _gpu("H100-SXM", 80, 3.35, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    _gpu("H200", 141, 4.8, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9),
    _gpu("B200", 180, 8.0, fp32=80, tf32=1100, bf16=2250, fp16=2250, fp8=4500, int8=4500, fp4=9000),
    _gpu("A100-80GB", 80, 2.039, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624),
    _gpu("L40S", 48, 0.864, fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733, int8=733),
    _gpu("MI300X", 192, 5.3, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9, int8=2614.9),
]}


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float   # bytes/s one device sends (and receives) at once: the link rate per direction
    latency: float     # seconds per collective or point-to-point send, nominal
    scope: str         # "node": between the devices of one machine; "network": between machines
    about: str


INTERCONNECTS: dict[str, Interconnect] = {i.name.lower(): i for i in [
    Interconnect("NVLink-3", 300e9, 5e-6, "node", "A100 SXM: 12 links, 600 GB/s both directions"),
    Interconnect("NVLink-4", 450e9, 5e-6, "node", "H100/H200 SXM: 18 links, 900 GB/s both directions"),
    Interconnect("NVLink-5", 900e9, 5e-6, "node", "B200: 18 links, 1.8 TB/s both directions"),
    Interconnect("PCIe-Gen5-x16", 64e9, 10e-6, "node", "~64 GB/s per direction, no NVLink"),
    Interconnect("InfiniBand-NDR", 50e9, 10e-6, "network", "400 Gb/s, one NIC per device"),
    Interconnect("100GbE", 12.5e9, 30e-6, "network", "100 Gb/s Ethernet (RoCE/TCP), one NIC per device"),
    Interconnect("loopback", 3e9, 50e-6, "node", "gloo over TCP between processes of one machine"),
]}
# The link between the devices of one node, per catalog entry; anything else falls back to PCIe.
_NODE_LINK = {"h100-sxm": "nvlink-4", "h200": "nvlink-4", "b200": "nvlink-5", "a100-80gb": "nvlink-3",
              "local-cpu": "loopback"}


def get_interconnect(name: str) -> Interconnect:
    key = name.lower().strip().replace(" ", "-")
    key = {"nvlink": "nvlink-4", "pcie": "pcie-gen5-x16", "pcie5": "pcie-gen5-x16", "ib": "infiniband-ndr",
           "infiniband": "infiniband-ndr", "ndr": "infiniband-ndr", "ethernet": "100gbe"}.get(key, key)
    if key not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}; choose one of "
                         f"{', '.join(i.name for i in INTERCONNECTS.values())}")
    return INTERCONNECTS[key]


def default_links(hw: "Hardware") -> tuple[Interconnect, Interconnect]:
    """(within a node, between nodes) for a piece of hardware: its NVLink generation (PCIe for the others)
    and InfiniBand NDR; the local CPU's ranks are processes on this machine (loopback both ways)."""
    key = hw.name.lower()
    node = INTERCONNECTS[_NODE_LINK.get(key, "pcie-gen5-x16")]
    return node, (node if key == "local-cpu" else INTERCONNECTS["infiniband-ndr"])


_ALIASES = {"h100": "h100-sxm", "h100sxm": "h100-sxm", "h100_sxm": "h100-sxm", "h100 sxm": "h100-sxm",
            "h200-sxm": "h200", "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100_80gb": "a100-80gb",
            "mi300": "mi300x", "l40": "l40s", "cpu": "local-cpu", "local": "local-cpu"}


def hardware_names() -> list[str]:
    return [h.name for h in CATALOG.values()] + ["local-cpu"]


def get_hardware(name: str, measure_dtypes: tuple[str, ...] = ("fp32",)) -> Hardware:
    """A catalog entry, or `local-cpu` measured now (matmul FLOP/s for `measure_dtypes` only: an emulated
    bf16 matmul on a CPU without AVX512-BF16 takes seconds to time)."""
    key = name.lower().strip()
    key = _ALIASES.get(key, key)
    if key == "local-cpu":
        return measure_local_cpu(measure_dtypes)
    if key not in CATALOG:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(hardware_names())}")
    return CATALOG[key]


def for_device(device: str, dtype: str = "fp32") -> Optional[Hardware]:
    """Figures for the device an engine runs on: measured for the CPU, the catalog entry for a known GPU."""
    if device == "cpu":
        return measure_local_cpu((dtype,))
    import torch

    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name().lower().replace(" ", "")
        for key in ("h200", "h100", "b200", "a100", "l40s", "mi300x"):
            if key in gpu:
                return get_hardware(key)
    return None


# -- measured on the spot -----------------------------------------------------------------------
def read_bandwidth(nbytes: int = GiB, reps: int = 5) -> float:
    """Bytes read per second by torch.sum over a large bf16 tensor (what a decode step does to weights)."""
    import torch

    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy."""
    import torch

    x = torch.ones(nbytes // 4)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def matmul_flops(dtype: str = "fp32", n: int = 1024, reps: int = 3) -> float:
    """Best FLOP/s of an n x n x n matmul at `dtype` with torch's current thread count."""
    import torch

    td = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n, dtype=td), torch.randn(n, n, dtype=td)
    a @ b  # first call pays one-off setup (packing buffers, thread pool start)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_local_cpu(dtypes: tuple[str, ...] = ("fp32",), bandwidth_bytes: int = 256 * 2**20,
                      matmul_n: int = 1024, reps: int = 3) -> Hardware:
    """This machine's CPU as torch uses it now (its thread count). fp16 is timed as bf16 (what the
    engine runs on CPU); formats without CPU matmuls (fp8, int8, fp4) fall back in `peak_flops`."""
    import torch

    flops = {}
    for d in sorted({"bf16" if d in ("bf16", "fp16") else "fp32" for d in dtypes}):
        flops[d] = matmul_flops(d, matmul_n, reps)
    if "bf16" in flops:
        flops["fp16"] = flops["bf16"]
    bw = read_bandwidth(bandwidth_bytes, reps)
    return Hardware("local-cpu", _physical_memory(), bw, flops, measured=True,
                    details={"threads": torch.get_num_threads(), "matmul_n": matmul_n,
                             "bandwidth_tensor_bytes": bandwidth_bytes})
