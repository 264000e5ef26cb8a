"""One direction of flow: no import cycle among the project's modules, function-level imports included
(a lazy import hides a cycle from Python, not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for root in ("grpo_core", "flows") for p in (REPO / root).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere in it: ``from a.b import c`` is a.b.c when that is a
    module, else a.b (importing a package's name, not its submodules)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != module_name(path)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_the_project():
    modules = project_modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["grpo_core.train.loop"]  # the walk sees the project
    assert "grpo_core.rollout.types" in graph["grpo_core.rollout.manual"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_grpo_core_never_imports_flows():
    modules = project_modules()
    upward = {name: sorted(m for m in imports_of(path, modules) if m.startswith("flows"))
              for name, path in modules.items() if name.startswith("grpo_core")}
    assert not {k: v for k, v in upward.items() if v}


def _docstring_only(path: Path) -> bool:
    """A package's ``__init__.py`` that holds its map and no code."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                              for n in body)


def test_design_doc_names_every_module_and_only_modules_that_exist():
    """docs/design.md's module list follows the tree: a module it names that is gone, or a grpo_core module
    (packages rewards/, tools/ and embedded/ as a whole) it does not name, fails here."""
    import re

    named = set(re.findall(r"^- `(grpo_core/[a-z_/]*(?:\.py|/))`", (REPO / "docs/design.md").read_text(),
                           re.M))
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/design.md names modules that are gone: {missing}"
    whole = {p for p in named if p.endswith("/")}
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "grpo_core").rglob("*.py")}
    unnamed = sorted(p for p in tree if p not in named and not any(p.startswith(w) for w in whole)
                     and not _docstring_only(REPO / p))
    assert not unnamed, f"docs/design.md does not name: {unnamed}"


# grpo_core's layers, bottom to top (grpo_core/__init__.py); flows/ above them all.
LAYERS = [
    ("grpo_core.common",),
    ("grpo_core.embedded",),
    ("grpo_core.advantages", "grpo_core.loss", "grpo_core.calibration"),
    ("grpo_core.model",),
    ("grpo_core.tools", "grpo_core.data", "grpo_core.rewards"),
    ("grpo_core.rollout",),
    ("grpo_core.evaluation",),
    ("grpo_core.train",),
    ("grpo_core.config",),  # assembles params.yaml from the options the layers below declare
    ("flows",),
]


def layer_of(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py::LAYERS")


def test_layer_of_places_modules_and_refuses_strays():
    assert (layer_of("grpo_core.train.loop") > layer_of("grpo_core.model.logprobs")
            > layer_of("grpo_core.loss"))
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("grpo_core.somewhere_new")


def test_every_import_goes_down_or_sideways():
    """One direction of flow: no module imports a layer above its own."""
    modules = project_modules()
    upward = sorted(f"{name} -> {m}" for name, path in modules.items() for m in imports_of(path, modules)
                    if layer_of(m) > layer_of(name))
    assert not upward, upward
