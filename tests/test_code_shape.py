"""What a reader of grpo_core can rely on (issue 29): a function says by its parameters what it depends on - none
takes the whole `train:` config to read a few keys of it (it takes the view that holds them: t.loss, t.optim, ...)
- and none is longer than one sitting's read (90 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GRPO_CORE = Path(__file__).resolve().parents[1] / "grpo_core"
MAX_LINES = 90


def functions(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def train_config_params_read_narrowly(fn) -> list[str]:
    """Parameters annotated TrainConfig of which ``fn`` reads at most three attributes."""
    narrow = []
    for arg in fn.args.args + fn.args.kwonlyargs:
        if arg.annotation is None or "TrainConfig" not in ast.unparse(arg.annotation):
            continue
        reads = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == arg.arg}
        if len(reads) <= 3:
            narrow.append(f"{arg.arg} reads only {sorted(reads)}")
    return narrow


def offenders(check) -> list[str]:
    out = []
    for path in sorted(GRPO_CORE.rglob("*.py")):
        for fn in functions(path.read_text(encoding="utf-8")):
            for problem in check(fn):
                out.append(f"{path.relative_to(GRPO_CORE.parent)}:{fn.lineno} {fn.name}: {problem}")
    return out


def test_no_function_takes_the_whole_train_config_to_read_three_keys():
    assert offenders(train_config_params_read_narrowly) == []


def test_no_function_is_over_90_lines():
    assert offenders(lambda fn: [f"{fn.end_lineno - fn.lineno + 1} lines"]
                     if fn.end_lineno - fn.lineno + 1 > MAX_LINES else []) == []


@pytest.mark.parametrize("source,expected", [
    ("def f(t: TrainConfig):\n    return t.a + t.b\n", ["t reads only ['a', 'b']"]),
    ("def f(t: TrainConfig):\n    return t.a + t.b + t.c + t.d\n", []),
    ("def f(t: LossConfig):\n    return t.a\n", []),
])
def test_the_check_sees_narrow_reads(source, expected):
    (fn,) = functions(source)
    assert train_config_params_read_narrowly(fn) == expected
