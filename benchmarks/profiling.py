"""torch.profiler around one side's run: the top operators by self time, as text."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


@contextlib.contextmanager
def profiled(out: Path, label: str, rows: int = 40):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        yield prof
    out.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows)
    out.write_text(f"# {label}\n{table}\n")
