"""The code reward against programs that game it rather than solve the task: each hostile program scores 0
under ``sandbox: none`` and in the jail, while honest programs score what running them plainly (the program,
then the test, exit status 0) gives. The judging these tests pin down is described in
grpo_core/rewards/code.py's docstring and docs/operations.md ("Code rewards: judged outside the program")."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from grpo_core.rewards.code import AssertPlan, asserts_passed, code_execution, jail_program, plan_asserts
from grpo_core.rewards.sandbox import RunResult, interpreter
from tests.test_sandbox_hostile import UNPRIVILEGED, copy_attack_files
from tests.tiny import require_jail

FENCE = "`" * 3
ADD = ["assert add(1, 2) == 3", "assert add(20, 22) == 42"]
WRONG_ADD = "def add(a, b):\n    return a - b\n"
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
ISCLOSE_TEST = ["import math\nassert math.isclose(area(1), 3.14159, rel_tol=1e-3)"]


def block(code: str) -> str:
    return f"Here it is:\n{FENCE}python\n{code}\n{FENCE}\n"


@pytest.fixture(scope="module", params=["none", "bwrap"])
def sandbox(request) -> str:
    if request.param == "bwrap":
        require_jail("the hostile code-reward suite")
    return request.param


@pytest.fixture(scope="module")
def reward(sandbox):
    return code_execution(timeout_s=3, sandbox=sandbox)


def score(reward, programs: list[str], tests) -> list[float | None]:
    return reward([""] * len(programs), [block(p) for p in programs], tests=[tests] * len(programs))


# (name, program, tests): each passes under append-the-test-and-read-the-exit-status judging (except where
# the comment says otherwise), each defines the function wrongly or not at all
HOSTILE = [
    ("os._exit(0) early", WRONG_ADD + "import os\nos._exit(0)", ADD),
    ("sys.exit(0) early", WRONG_ADD + "import sys\nsys.exit(0)", ADD),
    ("SystemExit from the function", "def add(a, b):\n    raise SystemExit(0)", ADD),
    ("failure swallowed by sys.excepthook",
     "import os, sys\nsys.excepthook = lambda *args: os._exit(0)\n" + WRONG_ADD, ADD),
    ("runs the test itself inside try/except, then exits 0",
     WRONG_ADD + "import os, sys\ntry:\n"
     "    exec(open(sys.argv[0]).read().split('END' + 'OFPROGRAM')[-1], globals())\n"
     "except BaseException:\n    pass\nos._exit(0)\n# ENDOFPROGRAM", ADD),
    ("__eq__ always true", "class Yes:\n    def __eq__(self, other):\n        return True\n"
                           "def add(a, b):\n    return Yes()", ADD),
    ("__bool__ and __eq__ always true",
     "class Yes:\n    def __bool__(self):\n        return True\n"
     "    def __eq__(self, other):\n        return True\n"
     "def is_odd(n):\n    return Yes()", ["assert is_odd(3)", "assert is_odd(4) == False"]),
    ("int subclass equal to everything",
     "class Num(int):\n    __hash__ = int.__hash__\n    def __eq__(self, other):\n        return True\n"
     "def add(a, b):\n    return Num(0)", ADD),
    ("math.isclose patched", "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0",
     ISCLOSE_TEST),
    ("__import__ patched",
     "import builtins, types\nreal_import = builtins.__import__\n"
     "fake = types.SimpleNamespace(isclose=lambda *a, **k: True)\n"
     "builtins.__import__ = lambda name, *a, **k: fake if name == 'math' else real_import(name, *a, **k)\n"
     "def area(r):\n    return 0",
     ["from math import isclose\nassert isclose(area(1), 3.14159, rel_tol=1e-3)"]),
    ("AssertionError replaced by SystemExit",
     "import builtins\nbuiltins.AssertionError = SystemExit\n" + WRONG_ADD,
     ["if add(1, 2) != 3:\n    raise AssertionError"]),
    ("print and sys.stdout patched, the harness's end line written everywhere",
     WRONG_ADD + "import builtins, os, sys\n"
     "for fd in range(1, 64):\n    try:\n        os.write(fd, b'\"end\"\\n')\n"
     "    except OSError:\n        pass\n"
     "builtins.print = lambda *a, **k: None\nsys.stdout = open(os.devnull, 'w')\nos._exit(0)", ADD),
    ("returns the expected value read from the test",
     "import re, sys\n"
     "def add(a, b):\n"
     "    seen = [int(n) for n in re.findall(r'\\d+', open(sys.argv[0]).read())]\n"
     "    frame = sys._getframe(1)\n"
     "    while frame is not None:\n"
     "        seen += [c for c in frame.f_code.co_consts if type(c) is int]\n"
     "        seen += [v for v in frame.f_locals.values() if type(v) is int]\n"
     "        frame = frame.f_back\n"
     "    return max(seen)", ["assert add(1, 2) == 31337"]),
    ("forges the probes' reports from what it reads, then exits",
     "import os, re, sys\ndef add(a, b):\n    return 0\n"
     "source = open(sys.argv[0]).read()\nguess = max(int(n) for n in re.findall(r'\\d+', source))\n"
     "for index in range(8):\n"
     "    for fd in range(1, 64):\n        try:\n"
     "            os.write(fd, ('[%d, [[\"i\", %d]]]\\n\"end\"\\n' % (index, guess)).encode())\n"
     "        except OSError:\n            pass\n"
     "os._exit(0)", ["assert add(1, 2) == 31337"]),
    ("kills the parent, then exits 0",
     WRONG_ADD + "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n"
                 "    pass\nos._exit(0)", ADD),
    ("atexit handler calls os._exit(0)", "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG_ADD,
     ADD),
    # scored 0 by exit-status judging too (the assert's failure exits 1): the marker must not turn into a pass
    ("atexit handler prints success markers",
     "import atexit, os\n" + WRONG_ADD
     + "atexit.register(lambda: [os.write(fd, b'\"end\"\\nPASSED\\n') for fd in (1, 2, 3, 4)])", ADD),
]


@pytest.mark.parametrize("name, program, tests", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_program_scores_zero(name, program, tests, sandbox, reward):
    if name == "kills the parent, then exits 0" and sandbox == "none":
        pytest.skip("sandbox: none isolates nothing: the program's parent is this process "
                    "(trusted code only)")
    assert score(reward, [program], tests) == [0.0]


def test_the_users_reproduction(reward):
    early_exit = "def add(a, b):\n    return 0\nimport os\nos._exit(0)"
    always_equal = ("class A:\n    def __eq__(self, other):\n        return True\n"
                    "def add(a, b):\n    return A()")
    programs = [early_exit, WRONG_ADD, always_equal, RIGHT_ADD]
    assert score(reward, programs, ["assert add(1, 2) == 3"]) == [0.0, 0.0, 0.0, 1.0]


def test_honest_programs_score_the_share_they_pass(reward):
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]
    right_and_wrong = score(reward, [RIGHT_ADD, "def add(a, b):\n    return a * b"], tests)
    assert right_and_wrong == [pytest.approx(2 / 3), pytest.approx(1 / 3)]  # 1+2, 0+0 | 0*0, (2*2 != 5)
    assert score(reward, [RIGHT_ADD, WRONG_ADD], ADD) == [1.0, 0.0]


def test_stdin_stdout_output_is_the_answer_however_the_program_ends(reward):
    io = [{"input": "1 2\n", "output": "3\n"}]
    reads = "a, b = map(int, input().split())\n"
    programs = [reads + "print(a + b, flush=True)\nimport os\nos._exit(0)",  # the output is the answer
                reads + "print(a - b, flush=True)\nimport os\nos._exit(0)",
                reads + "print(a + b)\nprint('\"end\"')",  # markers are output like any other
                "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'3\\n')\n"
                "    except OSError:\n        pass\nprint('PASSED')"]
    assert score(reward, programs, io) == [1.0, 0.0, 0.0, 0.0]


# honest programs: (program, tests, score). The expected scores are worked out by hand, and each is also what
# running the program plainly with each test appended and reading its exit status gives (checked below)
HONEST = [
    ("from __future__ import annotations\ndef add(a: int, b: int) -> int:\n    return a + b", ADD, 1.0),
    ("def add(a, b):\n    print('adding', a, b)\n    return a + b", ADD, 1.0),
    ("if __name__ == '__main__':\n    print('demo')\n" + RIGHT_ADD, ADD, 1.0),
    ("from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
     ["assert f() == (1, 2)", "assert f() == [1, 2]"], 0.5),
    ("from collections import Counter, defaultdict\ndef f():\n    return Counter('aab')\n"
     "def g():\n    d = defaultdict(list)\n    d[1].append(2)\n    return d",
     ["assert f() == {'a': 2, 'b': 1}", "assert g() == {1: [2]}"], 1.0),
    ("import math\ndef area(r):\n    return math.pi * r * r",
     ISCLOSE_TEST + ["assert abs(area(1) - 3.14159) < 1e-3", "assert round(area(1), 2) == 3.14",
                     "assert area(1) == 3.14"], 0.75),
    ("def is_odd(n):\n    return n % 2 == 1\ndef nothing():\n    return None",
     ["assert is_odd(3)", "assert not is_odd(4)", "assert is_odd(3) is True", "assert nothing() is None",
      "assert is_odd(4)"], 0.8),
    ("def f():\n    return {1: [2, (3, b'x')], 'k': {4, 5}, 'z': frozenset(), 'c': 1+2j}\n"
     "def g():\n    return float('inf')",
     ["assert f() == {1: [2, (3, b'x')], 'k': {5, 4}, 'z': frozenset(), 'c': 1+2j}",
      "assert g() == float('inf')", "assert sorted(f()['k'], reverse=True) == [5, 4]"], 1.0),
    (RIGHT_ADD, ["def check(candidate):\n    assert candidate(1, 2) == 3, 'one'\n"
                 "    assert candidate(-1, 1) == 0\n\ncheck(add)",
                 "def check(candidate):\n    assert candidate(1, 2) == 4\n\ncheck(add)"], 0.5),
    ("import math\ndef root(x):\n    if x < 0:\n        raise ValueError(x)\n    return math.sqrt(x)",
     ["try:\n    root(-1)\n    assert False\nexcept ValueError:\n    pass",
      "try:\n    root(4)\n    assert False\nexcept ValueError:\n    pass"], 0.5),
    ("def items():\n    return []", ["assert not items() or items()[0] == 1",
                                     "assert len(items()) > 0 and items()[0] == 1"], 0.5),
    (RIGHT_ADD, ["if add(1, 2) != 3:\n    raise AssertionError",
                 "if add(1, 2) != 4:\n    raise AssertionError",
                 "x = add(1, 2)\nassert x == 3", "assert all(add(i, i) == 2 * i for i in range(5))",
                 "assert add(1, 2) == 3, f'expected 3, got {add(1, 2)}'"], 0.8),
    ("raise RuntimeError('broken at import')\n" + RIGHT_ADD, ADD, 0.0),
    ("import threading\nthreading.Thread(target=lambda: print('bye')).start()\n" + RIGHT_ADD, ADD, 1.0),
    ("def gen():\n    return (i * i for i in range(3))\ndef pairs():\n    return zip('ab', map(int, '12'))\n"
     "def span():\n    return range(1, 4)\ndef table():\n    return {'a': 1, 'b': 2}",
     ["assert list(gen()) == [0, 1, 4]", "assert gen() == [0, 1, 4]", "assert dict(pairs()) == {'a': 1}",
      "assert tuple(pairs()) == (('a', 1), ('b', 2))", "assert span() == range(1, 4)",
      "assert sum(span()) == 6", "assert table().keys() == {'a', 'b'}",
      "assert sorted(table().values()) == [1, 2]",
      "assert ('b', 2) in table().items()", "assert len(gen()) == 3"], 0.7),
]


@pytest.mark.parametrize("program, tests, expected", HONEST, ids=[f"honest-{i}" for i in range(len(HONEST))])
def test_honest_programs_score_as_plain_runs_do(program, tests, expected, reward):
    plain = sum(plain_run_passes(program, test) for test in tests) / len(tests)
    assert plain == pytest.approx(expected)
    assert score(reward, [program], tests) == [pytest.approx(expected)]


@functools.cache  # the same for both sandboxes
def plain_run_passes(program: str, test: str) -> bool:
    """The judging before: the program, then the test, run plainly; passed if it exits 0."""
    return subprocess.run([sys.executable, "-I", "-c", f"{program}\n\n{test}\n"], capture_output=True,
                          timeout=30).returncode == 0


def test_the_expected_side_never_enters_the_jail():
    test = ("import math\ndef check(candidate):\n    assert candidate(7) == 31337, 'want 31337'\n"
            "    assert math.isclose(candidate(8), 27182.5, rel_tol=1e-9)\ncheck(f)\nassert f(9) == 'secret'")
    plan = plan_asserts(test)
    jail_file = jail_program("def f(x):\n    return x", plan)
    for expected in ("31337", "27182", "secret"):
        assert expected not in jail_file
    assert "candidate(7)" in jail_file and "candidate(8)" in jail_file and "f(9)" in jail_file
    assert plan.widths == (1, 1, 1) and plan.required == frozenset({0, 1, 2})


def ran(stdout: str, status: str = "ok") -> RunResult:
    return RunResult(status, 0 if status == "ok" else 1, stdout, "", 0.01)


@pytest.mark.parametrize("stdout, status, verdict", [
    ('[0, [["i", 3]]]\n"end"\n', "ok", True),
    ('[0, [["i", 3]]]\n[0, [["i", 3]]]\n"end"\n', "ok", True),   # an assert in a loop: every report judged
    ('"end"\n', "ok", False),                                  # the assert never reported
    ('[0, [["i", 3]]]\n', "ok", False),                        # the test did not run to its end
    ('[0, [["i", 3]]]\n"end"\n', "error", False),              # it ran to its end, then failed
    ('[0, [["i", 3]]]\n[0, [["i", 4]]]\n"end"\n', "ok", False),  # one of two reports wrong (a guess)
    ('[0, [["i", 3], ["i", 3]]]\n"end"\n', "ok", False),        # more values than the assert probes
    ('[1, [["i", 3]]]\n"end"\n', "ok", False),                 # no assert 1
    ('[0, [["e"]]]\n"end"\n', "ok", False),                    # the probe raised or was not plain data
    ('[0, [["o", "Yes()"]]]\n"end"\n', "ok", False),           # not a tag _jail_plain writes
    ('[0, [["f", 3.0]]]\n"end"\n', "ok", True),                # 3.0 == 3, as in Python
    ('[0, [["b", true]]]\n"end"\n', "ok", False),
    ('[0, [["s", "3"]]]\n"end"\n', "ok", False),
    ('PASSED\n[0, [["i", 3]]]\n"end"\n', "ok", False),         # anything else on the channel
    ('[0, ' * 100000 + "\n", "ok", False),                     # a line too deep to parse
])
def test_the_judge_reads_only_what_holds(stdout, status, verdict):
    plan = plan_asserts("assert add(1, 2) == 3")
    assert asserts_passed(plan, ran(stdout, status)) is verdict


def test_values_built_to_keep_the_judge_busy_are_refused_in_time():
    # 50,000 ints with one hash: building their set would take minutes of comparisons; summing a range of
    # 10**9 about as long
    colliding = [["i", k * (2**61 - 1)] for k in range(1, 50_001)]
    for test, value in [("assert f() == {0}", ["S", colliding]), ("assert set(f()) == {0}", ["l", colliding]),
                        ("assert f() == {}", ["d", [[key, ["n"]] for key in colliding]]),
                        ("assert sum(f()) == 0", ["r", 0, 10**9, 1])]:
        start = time.perf_counter()
        assert not asserts_passed(plan_asserts(test), ran(json.dumps([0, [value]]) + '\n"end"\n'))
        assert time.perf_counter() - start < 5.0
    distinct = [["i", k] for k in range(50_000)]
    assert asserts_passed(plan_asserts("assert len(set(f())) == 50000"),
                          ran(json.dumps([0, [["l", distinct]]]) + '\n"end"\n'))


def test_judging_here_keeps_pythons_semantics():
    plan = plan_asserts("assert x() is None or x()[0] == 1\nassert sorted(y()) == [1, 2]")
    assert plan.widths == (2, 1) and plan.required == frozenset({0, 1})
    assert asserts_passed(plan, ran('[0, [["n"], ["e"]]]\n[1, [["S", [["i", 2], ["i", 1]]]]]\n"end"\n'))
    empty = '[0, [["l", []], ["e"]]]\n[1, [["l", [["i", 1], ["i", 2]]]]]\n"end"\n'
    assert not asserts_passed(plan, ran(empty))
    # round's ndigits out of all proportion is refused, not computed
    huge = plan_asserts("assert round(5, n()) == 0")
    assert not asserts_passed(huge, ran('[0, [["i", -1000000000]]]\n"end"\n'))
    # a name the test binds to something of its own is not the builtin: that call is probed as a whole
    shadowed = plan_asserts("def sorted(x):\n    return [1, 2]\nassert sorted(y()) == [1, 2]")
    assert shadowed.widths == (1,) and "sorted(y())" in shadowed.jail_test


def test_a_test_that_is_not_python_is_named(reward):
    with pytest.raises(ValueError,
                       match=r"code_execution: an assert test case is not valid Python .*add\(1, 2"):
        score(reward, [RIGHT_ADD], ["assert add(1, 2 == 3"])
    assert isinstance(plan_asserts("assert True"), AssertPlan)


def test_as_an_unprivileged_user():
    """The jail as a user without privileges (bwrap not started through setpriv): the same scores."""
    require_jail("the hostile code-reward suite")
    if os.geteuid() != 0:
        pytest.skip(f"not root: the tests above already ran as an unprivileged user (uid {os.geteuid()})")
    hostile = {name: program for name, program, _ in HOSTILE}
    programs = [hostile["os._exit(0) early"], WRONG_ADD, hostile["__eq__ always true"],
                hostile["print and sys.stdout patched, the harness's end line written everywhere"], RIGHT_ADD]
    with tempfile.TemporaryDirectory(prefix="grpo-hostile-code-") as code:
        copy_attack_files(Path(code))
        repo = Path(__file__).resolve().parents[1]
        for rel in ("grpo_core/rewards/code.py", "grpo_core/rewards/base.py", "grpo_core/rewards/parsing.py",
                    "grpo_core/common/options.py"):
            (Path(code) / rel).write_text((repo / rel).read_text())
            os.chmod(Path(code) / rel, 0o755)
        runner = ("import json, sys\nsys.path.insert(0, sys.argv[1])\n"
                  "from grpo_core.rewards.code import code_execution\n"
                  "programs = json.loads(sys.argv[2])\n"
                  "scores = code_execution(timeout_s=3)([''] * len(programs), programs, "
                  "tests=[['assert add(1, 2) == 3']] * len(programs))\n"
                  "print(json.dumps(scores))")
        completions = json.dumps([block(p) for p in programs])
        proc = subprocess.run([interpreter(), "-I", "-c", runner, code, completions],
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/",
                              user=UNPRIVILEGED, group=UNPRIVILEGED, extra_groups=[], capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0.0, 0.0, 0.0, 0.0, 1.0]
