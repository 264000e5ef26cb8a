"""What a reader of grpo_core can rely on: a function says by its parameters what it depends on - none but the
config assembly (grpo_core/config.py) takes the whole `train:` config (each takes the group of options it
reads: t.loss, t.optim, ...) - and none is longer than one sitting's read (90 lines)."""

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


def takes_the_train_config(fn) -> list[str]:
    """Parameters of ``fn`` annotated TrainConfig."""
    return [f"{arg.arg}: TrainConfig" for arg in fn.args.args + fn.args.kwonlyargs
            if arg.annotation is not None and "TrainConfig" in ast.unparse(arg.annotation)]


def offenders(check, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in sorted(p for p in GRPO_CORE.rglob("*.py") if p.relative_to(GRPO_CORE).as_posix() not in skip):
        for fn in functions(path.read_text(encoding="utf-8")):
            for problem in check(fn):
                out.append(f"{path.relative_to(GRPO_CORE.parent)}:{fn.lineno} {fn.name}: {problem}")
    return out


def test_only_the_config_assembly_takes_the_whole_train_config():
    assert offenders(takes_the_train_config, skip=("config.py",)) == []
    assert offenders(takes_the_train_config) != []  # the check sees config.py's own


def test_no_code_reads_train_keys_through_a_whole_run_config():
    """The trainer's phases read the groups the run holds (run.loss_fn, run.plan, run.checkpoints, ...)."""
    import re

    sources = [*GRPO_CORE.rglob("*.py"), *(GRPO_CORE.parent / "flows").rglob("*.py")]
    assert [str(p) for p in sources if re.search(r"\brun\.t\.", p.read_text(encoding="utf-8"))] == []


def test_no_function_is_over_90_lines():
    assert offenders(lambda fn: [f"{fn.end_lineno - fn.lineno + 1} lines"]
                     if fn.end_lineno - fn.lineno + 1 > MAX_LINES else []) == []


@pytest.mark.parametrize("source,expected", [
    ("def f(t: TrainConfig):\n    return t.a\n", ["t: TrainConfig"]),
    ("def f(x, *, t: TrainConfig | None = None):\n    return t\n", ["t: TrainConfig"]),
    ("def f(t: LossOptions):\n    return t.a\n", []),
])
def test_the_check_sees_a_train_config_parameter(source, expected):
    (fn,) = functions(source)
    assert takes_the_train_config(fn) == expected
