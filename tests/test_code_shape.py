"""What a reader of grpo_core can rely on: a function says by its parameters what it depends on - none but the
declaration of `train:` and the config assembly (grpo_core/train/options.py, config.py) takes the whole
`train:` config (each takes the group of options it reads: t.loss, t.optim, ...) - and none is longer than
one sitting's read (90 lines). Files stay short (config.py at most 500 lines, any other at most 600), long
parameter lists are the named exceptions, an option is read by its owner only, and ruff passes with lines
of at most 110 columns."""

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
    assert offenders(takes_the_train_config, skip=("config.py", "train/options.py")) == []
    assert offenders(takes_the_train_config) != []  # the check sees the declaration's own


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


def parameter_count(fn) -> int:
    """Parameters a caller can pass: self/cls left out, ``*args`` and ``**kwargs`` one each."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    starred = (a.vararg is not None) + (a.kwarg is not None)
    return len([n for n in names if n not in ("self", "cls")]) + starred


def test_at_most_four_functions_take_more_than_eight_parameters():
    """The four kept: the contract's functional ``grpo_loss`` and the same call on the loss object, and two
    reward factories whose parameters are the keyword arguments params.yaml passes."""
    over = offenders(lambda fn: [f"{parameter_count(fn)} parameters"] if parameter_count(fn) > 8 else [])
    assert sorted(o.split(" ")[1].rstrip(":") for o in over) == [
        "__call__", "code_execution", "grpo_loss", "keyword_hits"], over


@pytest.mark.parametrize("source,expected", [
    ("def f(self, a, b=1, *c, d, **e):\n    pass\n", 5),
    ("def f(a, /, b):\n    pass\n", 2),
])
def test_parameter_count_by_hand(source, expected):
    (fn,) = functions(source)
    assert parameter_count(fn) == expected


def test_file_sizes():
    sizes = {p.relative_to(GRPO_CORE).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in GRPO_CORE.rglob("*.py")}
    assert sizes["config.py"] <= 500
    assert {name: n for name, n in sizes.items() if n > 600} == {}


def test_the_loss_clip_range_is_read_only_by_the_loss():
    """``train.loss.epsilon`` (and epsilon_high): attribute reads outside loss.py would be a second owner."""
    readers = set()
    for path in [*GRPO_CORE.rglob("*.py"), *(GRPO_CORE.parent / "flows").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("epsilon", "epsilon_high"):
                readers.add(path.relative_to(GRPO_CORE.parent).as_posix())
    assert readers == {"grpo_core/loss.py"}


def test_ruff_passes_with_lines_at_most_110():
    """The repo's own lint settings (pyproject.toml): E501 on at 110 columns."""
    import subprocess
    import sys
    import tomllib

    root = GRPO_CORE.parent
    ruff = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 110
    assert "E501" not in ruff["lint"].get("ignore", [])
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(root)], cwd=root,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def fields_typed_any(cls: type) -> list[str]:
    """A dataclass's fields whose annotation (a string under postponed evaluation) is or holds ``Any``."""
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if "Any" in str(f.type).replace("|", " ").split()]


def test_a_training_run_and_its_policy_have_no_field_a_reader_must_guess():
    from dataclasses import dataclass

    from grpo_core.train.policy import Policy
    from grpo_core.train.state import TrainingRun

    assert fields_typed_any(TrainingRun) == [] and fields_typed_any(Policy) == []
    assert {"policy", "accelerator", "tokenizer"} <= {f for f in TrainingRun.__dataclass_fields__}

    @dataclass
    class Loose:
        backend: Any  # noqa: F821 - a string under postponed evaluation, never resolved
        replica: torch.nn.Module | Any = None  # noqa: F821

    assert fields_typed_any(Loose) == ["backend", "replica"]
