"""What the code reward's sandbox costs per call: a sandboxed `pass` (launcher, namespaces, tmpfs mounts, uid switch,
limits, the interpreter) against a plain `python -I -c pass` subprocess, side by side, medians over N runs.

    .venv/bin/python -m benchmarks.sandbox_overhead [N]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from grpo_core.rewards.sandbox import interpreter, run_python


def median_seconds(call, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(n: int = 30) -> None:
    python = interpreter()
    plain = median_seconds(lambda: subprocess.run([python, "-I", "-c", "pass"], check=True), n)
    boxed = median_seconds(lambda: run_python("pass"), n)
    print(f"plain subprocess ({python} -I -c pass): {plain * 1e3:.1f} ms")
    print(f"sandboxed run_python('pass'):          {boxed * 1e3:.1f} ms")
    print(f"overhead per call: {(boxed - plain) * 1e3:.1f} ms ({boxed / plain:.2f}x), median of {n}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
