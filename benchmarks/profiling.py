"""torch.profiler for the benchmarks: around one side's run (``profiled``), or started and stopped by the
caller (the GPU kit's profiled step); the top operators by self time as text, and the time under the trainer's
labels."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

LABEL_PREFIX = "grpo/"  # the trainer's record_function names (grpo_core/train/loop.py)


def activities() -> list:
    """CPU, and CUDA where there is a GPU."""
    kinds = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        kinds.append(torch.profiler.ProfilerActivity.CUDA)
    return kinds


def top_operators(prof, rows: int = 40) -> str:
    """The operators by self time (CUDA time on a GPU, else CPU), as torch's table."""
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def label_times(prof) -> dict[str, dict]:
    """Per trainer label (``grpo/...``): calls, CPU seconds (wall time of the span on the host, children
    included) and the device seconds of the kernels run under it (None without a GPU)."""
    out = {}
    for event in prof.key_averages():
        if event.key.startswith(LABEL_PREFIX):
            device = getattr(event, "device_time_total", None) if torch.cuda.is_available() else None
            out[event.key] = {"calls": event.count, "cpu_s": event.cpu_time_total / 1e6,
                              "device_s": None if device is None else device / 1e6}
    return out


@contextlib.contextmanager
def profiled(out: Path, label: str, rows: int = 40):
    with torch.profiler.profile(activities=activities(), record_shapes=False) as prof:
        yield prof
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {label}\n{top_operators(prof, rows)}\n")
