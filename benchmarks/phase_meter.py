"""Time and peak memory per phase of a training step: what the GPU kit's profiled step records
(benchmarks/kit_step.py).

A phase is a named span - the trainer's ``record_function`` labels (``grpo/generate_round``,
``grpo/backward``, ...) - and spans nest. For each span the meter keeps its wall seconds (CUDA synchronized at
both ends, so the GPU's work is inside the span that queued it) and the peak of every gauge while it was open:

    allocator  CUDA: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, reset at every span
               boundary (``reset_peak_memory_stats``). CPU: the process's peak resident set (VmHWM), reset at
               every boundary by writing 5 to /proc/self/clear_refs (Linux >= 4.0): the CPU stand-in, for the
               smoke run.
    device     the whole GPU's used memory as the driver reports it - what nvidia-smi shows: the CUDA context,
               the caching allocator's reserve and anything else on the GPU - sampled every 20 ms by a thread
               (NVML through nvidia-ml-py's ``pynvml``, else a streaming
               ``nvidia-smi --query-gpu=memory.used``); absent without an NVIDIA GPU. A span shorter than the
               sampling period can miss its peak: read the allocator for short phases.

Nesting: a boundary reads every gauge's peak since the previous boundary into the innermost open span, then
resets the gauge; a closing span hands its peaks to its parent. So each span's peak covers everything inside
it, and no reset hides a peak from an enclosing span.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

import torch

from benchmarks.rss import peak_rss_bytes

MIB = 2**20


class CudaAllocatorGauge:
    """The caching allocator's peaks (allocated: tensors alive; reserved: what it holds from the driver)."""

    kind = "cuda allocator"

    def peak(self) -> dict[str, float]:
        return {"allocated_mib": torch.cuda.max_memory_allocated() / MIB,
                "reserved_mib": torch.cuda.max_memory_reserved() / MIB}

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats()


class RssGauge:
    """The process's peak resident set (VmHWM): the allocator gauge's stand-in on CPU."""

    kind = "process RSS (VmHWM)"

    def __init__(self):
        self.resettable = self._clear_peak()

    def peak(self) -> dict[str, float]:
        return {"rss_mib": peak_rss_bytes() / MIB}

    def reset(self) -> None:
        if self.resettable:
            self._clear_peak()

    @staticmethod
    def _clear_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current RSS
            return True
        except OSError:
            return False


def _nvml_reader(index: int):
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB


class DeviceMemoryGauge:
    """The GPU's used memory (MiB), sampled by a daemon thread;
    ``peak`` is the largest sample since ``reset``."""

    kind = "device used memory (NVML / nvidia-smi)"

    def __init__(self, index: int = 0, interval_s: float = 0.02):
        self.interval_s, self.source = interval_s, None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._last = self._max = None
        self._proc = None
        read = _nvml_reader(index)
        if read is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
        elif shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 f"--loop-ms={max(int(interval_s * 1000), 20)}"], stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._stream, daemon=True)
        else:
            return
        self._thread.start()

    @property
    def available(self) -> bool:
        return self.source is not None

    def _record(self, value: float) -> None:
        with self._lock:
            self._last = value
            self._max = value if self._max is None else max(self._max, value)

    def _poll(self, read) -> None:
        while not self._stop.is_set():
            self._record(read())
            time.sleep(self.interval_s)

    def _stream(self) -> None:
        for line in self._proc.stdout:
            try:
                self._record(float(line.strip()))
            except ValueError:
                continue

    @property
    def last(self) -> float | None:
        """The latest sample (MiB), None before the first."""
        with self._lock:
            return self._last

    def wait_for_sample(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._last is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def peak(self) -> dict[str, float]:
        with self._lock:
            return {} if self._max is None else {"device_used_mib": self._max}

    def reset(self) -> None:
        with self._lock:
            self._max = self._last

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)


def gauges_for_this_machine() -> list:
    """The allocator gauge (CUDA, else RSS) and, with an NVIDIA GPU, the device gauge."""
    if not torch.cuda.is_available():
        return [RssGauge()]
    device = DeviceMemoryGauge(torch.cuda.current_device())
    if device.available:
        device.wait_for_sample()
        return [CudaAllocatorGauge(), device]
    return [CudaAllocatorGauge()]


def _max_into(into: dict[str, float], readings: dict[str, float]) -> None:
    for key, value in readings.items():
        into[key] = max(into.get(key, value), value)


@dataclass
class _Span:
    name: str
    start: float
    peaks: dict[str, float] = field(default_factory=dict)


class PhaseMeter:
    """Seconds and peak memory of nested spans, grouped by step (``end_step`` closes one)."""

    def __init__(self, gauges: list, synchronize=None):
        self.gauges = gauges
        self.synchronize = synchronize or (torch.cuda.synchronize if torch.cuda.is_available()
                                           else (lambda: None))
        self.records: list[dict] = []       # one per closed span: step, phase, seconds, peaks
        self.steps: list[dict] = []         # one per step: the whole step's peaks and the trainer's metrics
        self._stack: list[_Span] = []
        self._step = _Span("step", time.perf_counter())
        self._boundary()

    def _boundary(self) -> None:
        readings: dict[str, float] = {}
        for gauge in self.gauges:
            readings.update(gauge.peak())
        _max_into(self._stack[-1].peaks if self._stack else self._step.peaks, readings)
        for gauge in self.gauges:
            gauge.reset()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.synchronize()
        self._boundary()  # the enclosing span's peak up to here
        self._stack.append(_Span(name, time.perf_counter()))
        try:
            yield
        finally:
            self.synchronize()
            self._boundary()
            span = self._stack.pop()
            _max_into(self._stack[-1].peaks if self._stack else self._step.peaks, span.peaks)
            self.records.append({"step": len(self.steps) + 1, "phase": name,
                                 "seconds": time.perf_counter() - span.start, **span.peaks})

    def end_step(self, metrics: dict | None = None) -> None:
        """Close the current step (call between spans) with the trainer's metrics of it; open the next."""
        self.synchronize()
        self._boundary()
        now = time.perf_counter()
        self.steps.append({"step": len(self.steps) + 1, "seconds": now - self._step.start, **self._step.peaks,
                           "metrics": dict(metrics or {})})
        self._step = _Span("step", now)

    def summary(self, steps: list[int]) -> dict[str, dict]:
        """Per phase over ``steps``: the median over steps of the phase's seconds in a step (its calls
        summed), calls per step, and the largest peak of each gauge."""
        out: dict[str, dict] = {}
        for name in dict.fromkeys(r["phase"] for r in self.records):
            per_step = {s: [r for r in self.records if r["phase"] == name and r["step"] == s] for s in steps}
            per_step = {s: rs for s, rs in per_step.items() if rs}
            if not per_step:
                continue
            peaks: dict[str, float] = {}
            for rs in per_step.values():
                for r in rs:
                    _max_into(peaks, {k: v for k, v in r.items() if k.endswith("_mib")})
            out[name] = {"seconds": statistics.median(sum(r["seconds"] for r in rs)
                                                      for rs in per_step.values()),
                         "calls_per_step": statistics.median(len(rs) for rs in per_step.values()),
                         **peaks}
        return out
