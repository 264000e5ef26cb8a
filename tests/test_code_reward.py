"""The code-execution reward and its sandbox: test-case shapes of the public code-RL datasets, pass rates
worked out by hand, and hostile programs, each contained and scored, with this (the training) process
unaffected."""

from __future__ import annotations

import os

import pytest

from grpo_core.rewards import build_reward_functions
from grpo_core.rewards.code import CodeTest, code_execution, extract_program, parse_tests
from grpo_core.rewards.sandbox import run_python
from tests.tiny import require_jail

FENCE = "`" * 3


def block(code: str) -> str:
    return f"Here it is:\n{FENCE}python\n{code}\n{FENCE}\n"


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    require_jail("the code reward")


def test_program_extraction_and_test_shapes():
    assert extract_program(f"a\n{FENCE}py\nx = 1\n{FENCE}\nb\n{FENCE}python\nx = 2\n{FENCE}") == "x = 2\n"
    assert extract_program("x = 1") is None and extract_program("x = 1", require_block=False) == "x = 1"
    io = [CodeTest("1 2", "3"), CodeTest("4 5", "9")]
    assert parse_tests([{"input": "1 2", "output": "3"}, {"input": "4 5", "output": "9"}]) == io
    assert parse_tests({"inputs": ["1 2", "4 5"], "outputs": ["3", "9"]}) == io
    assert (parse_tests('{"test_cases": [{"input": "1 2", "output": "3"}, {"input": "4 5", "output": "9"}]}')
            == io)
    assert parse_tests(["assert f(1) == 1", "assert f(2) == 4"]) == [CodeTest(check="assert f(1) == 1"),
                                                                   CodeTest(check="assert f(2) == 4")]
    assert parse_tests("assert f(1) == 1") == [CodeTest(check="assert f(1) == 1")]
    assert parse_tests(None) == [] and parse_tests("") == []
    with pytest.raises(ValueError, match="unknown shape"):
        parse_tests({"cases": 3})


def test_pass_rates_by_hand():
    reward = build_reward_functions(
        [{"name": "code", "function": "code_execution", "kwargs": {"timeout_s": 3}}])[0]
    adder = block("a, b = map(int, input().split())\nprint(a + b)")
    off_by_one = block("a, b = map(int, input().split())\nprint(a + b + (a == 4))")
    square = block("def f(x):\n    return x * x")
    io = [{"input": "1 2\n", "output": "3\n"}, {"input": "4 5", "output": "9  \n"}]  # trailing spaces ignored
    asserts = ["assert f(1) == 1", "assert f(3) == 9", "assert f(2) == 5"]
    scores = reward([""] * 6, [adder, off_by_one, square, "no program here", square, adder],
                    tests=[io, io, asserts, asserts, None, "assert False"])
    assert scores == [1.0, 0.5, pytest.approx(2 / 3), 0.0, None, 0.0]
    with pytest.raises(KeyError, match="no test column 'tests'"):
        code_execution()([""], [adder], cases=[io])


# hostile programs, scored like any failing program while this process goes on (the jail's own suite, with
# what must hold on the machine after each: tests/test_sandbox_hostile.py)
HOSTILE = [
    "while True:\n    pass",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "x = bytearray(10 * 1024 ** 3)",
    "open('/etc/grpo-pwned', 'w').write('x')",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
]


@pytest.mark.parametrize("program", HOSTILE,
                         ids=["loop", "fork bomb", "10 GB", "write /etc", "kill the parent"])
def test_hostile_programs_score_zero(program):
    reward = code_execution(timeout_s=1)
    assert reward([""], [block(program)], tests=[[{"input": "", "output": "ok"}]]) == [0.0]
    assert not os.path.exists("/etc/grpo-pwned")


def test_the_program_sees_an_empty_environment_and_its_own_folder():
    result = run_python("import os\nopen('f', 'w').write('x')\nprint(sorted(os.environ), os.getcwd(), "
                        "os.listdir('.'))")
    assert (result.status == "ok"
            and result.stdout.strip() == "['HOME', 'LANG', 'PATH', 'PWD'] /tmp ['f', 'main.py']")
    again = run_python("import os\nprint(os.listdir('/tmp'))")
    assert again.stdout.strip() == "['main.py']"  # a fresh folder each run


def test_training_goes_on_while_its_reward_runs_hostile_programs(tmp_path):
    from grpo_core.train.loop import train
    from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

    cfg = tiny_config(make_tiny_model(tmp_path / "model"), make_prompts(tmp_path / "p.jsonl"),
                      [{"name": "hostile", "function": "tests.reward_helpers:hostile_programs"},
                       {"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                      max_steps=2, per_device_train_batch_size=8)
    result = train(cfg, root=tmp_path, progress=False)
    log = read_log(result.log_path)
    assert result.final_step == 2 and [float(r["rewards/hostile/mean"]) for r in log] == [0.0, 0.0]
