"""What the code reward's jail costs: per program, a jailed `pass` (grpo_core/rewards/sandbox.py: bwrap,
namespaces, mounts, seccomp, prlimit, the interpreter) against the unsandboxed baseline, a plain
`subprocess.run` of the interpreter the jail runs, in the same isolated mode (``interpreter() -I -c pass``):
the difference is the jail's own cost. Medians over N runs; then the code reward's throughput (programs per
second: an a+b program against one stdin/stdout test each) with max_workers 1 and 2.

    .venv/bin/python -m benchmarks.sandbox_overhead [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from grpo_core.rewards.code import code_execution
from grpo_core.rewards.sandbox import interpreter, run_python

ADDER = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def median_seconds(call, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_program(n: int) -> list[tuple[str, float]]:
    python = interpreter()
    return [
        (f"plain subprocess ({python} -I -c pass)", median_seconds(
            lambda: subprocess.run([python, "-I", "-c", "pass"], check=True), n)),
        ("jail: run_python('pass') (bwrap)", median_seconds(lambda: run_python("pass"), n)),
    ]


def throughput(max_workers: int, programs: int) -> float:
    """Programs per second through the code reward: ``programs`` completions, one test case each."""
    reward = code_execution(max_workers=max_workers)
    tests = [[{"input": f"{i} {i + 1}\n", "output": f"{2 * i + 1}\n"}] for i in range(programs)]
    start = time.perf_counter()
    scores = reward([""] * programs, [ADDER] * programs, tests=tests)
    seconds = time.perf_counter() - start
    assert scores == [1.0] * programs, scores
    return programs / seconds


def main(n: int = 30) -> None:
    rows = per_program(n)
    plain = rows[0][1]
    print(f"per program, median of {n} (uid {os.geteuid()}, {os.cpu_count()} cores):")
    for name, seconds in rows:
        print(f"  {name:52s} {seconds * 1e3:7.1f} ms  {seconds / plain:5.2f}x plain")
    jail = rows[1][1]
    print(f"  the jail against plain: {(jail - plain) * 1e3:+.1f} ms per program")
    for workers in (1, 2):
        print(f"code reward, max_workers={workers}: {throughput(workers, 2 * n):6.1f} programs/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
