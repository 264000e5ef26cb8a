"""Which instruction set torch's CPU kernels may use, so that one run gives the same bytes on different CPUs.

ATen's vectorized ops, oneDNN and MKL each pick their code path from the CPU; an AVX-512 path sums in another
order than an AVX2 one, and the weights a run writes differ in their last bits - then every figure after them.
Capping all three at one level (``model.cpu_kernels``) makes every x86-64 CPU that has that level compute
alike. What it costs and what it gives: benchmarks/results/cpu-kernels.json.
"""

from __future__ import annotations

import logging
import os
import platform
import typing
from typing import Literal

log = logging.getLogger(__name__)

#: model.cpu_kernels -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR)
KERNEL_ENV = {
    "scalar": ("default", "SSE41", "COMPATIBLE"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
}
CpuKernels = Literal["native", "avx2", "avx512", "scalar"]
CHOICES = typing.get_args(CpuKernels)


def pin_cpu_kernels(level: str) -> str | None:
    """Cap ATen, oneDNN and MKL at ``level`` ('native': leave them to the CPU). Returns the capability ATen
    runs at, or None where nothing was pinned (native, or a CPU that is not x86-64).

    Call it before the process's first tensor op: ATen reads its setting once, at its first dispatch, and MKL
    and oneDNN at their first call. A CPU without ``level`` runs its own best, lower level (with a warning:
    its bytes will not match a pinned run elsewhere)."""
    if level not in CHOICES:
        raise ValueError(f"model.cpu_kernels: {level!r} is not one of {', '.join(CHOICES)}")
    if level == "native" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    aten, onednn, mkl = KERNEL_ENV[level]
    os.environ.update(ATEN_CPU_CAPABILITY=aten, ONEDNN_MAX_CPU_ISA=onednn, MKL_CBWR=mkl)
    import torch

    running = torch.backends.cpu.get_cpu_capability().lower()
    if running != aten:
        log.warning("model.cpu_kernels: %s asked, torch's CPU kernels run at %s (this CPU lacks %s, or a "
                    "tensor op ran before the pin): results will not be byte-identical to a %s run on "
                    "another CPU", level, running, level, level)
    return running
