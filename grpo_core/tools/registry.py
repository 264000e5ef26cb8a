"""Tools and environments from params.yaml import paths, checked before anything samples.

    train.tools                ["package.module:function", ...]          -> standalone tools
    train.environment_factory  "package.module:Class" | {name: "..."}    -> one environment per rollout

A tool is TRL's: a plain function (``async def`` too) whose type hints and docstring are its JSON schema -
transformers' ``get_json_schema``, the schema ``apply_chat_template(tools=...)`` shows the model. An
environment is a class (or any callable returning an instance) with ``reset(**row)``; its public methods are
its tools, and it keeps its state across the turns of one rollout. ``get_reward`` (read by the
``environment_reward`` reward) and ``close`` (called once the rollout is scored) are not tools. With a
mapping, each row's ``environment`` column names its environment, and only that environment's methods are
offered in its prompt (TRL's semantics).
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_core.common.errors import ConfigurationError, TrainingFailure
from grpo_core.common.options import ConfigError, Options, option
from grpo_core.tools.bounded import call_within

#: an environment's methods that are not tools
NOT_TOOLS = ("reset", "get_reward", "close")
#: what a tool may return: a string is shown as is, the rest as ``str(result)`` (TRL's rendering); anything
#: else is a failed call whose error the model is shown
RESULT_TYPES: tuple[type, ...] = (str, numbers.Number, type(None), list, tuple, dict)
#: the row column that picks an environment when ``environment_factory`` is a mapping (TRL's name)
ENVIRONMENT_COLUMN = "environment"


#: how an import path of a tool, an environment or a rollout function is written
IMPORT_PATH_FORM = "'package.module:name'"


def is_import_path(value: Any) -> bool:
    module, _, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    return bool(module.strip()) and bool(attr.strip()) and " " not in value


@dataclass
class ToolUseOptions(Options):
    """params.yaml `train:` keys of agentic rollouts (TRL's names and semantics; docs/agentic.md): the tools
    and environments calibrate, train and evaluate sample with. Whether they import and have usable signatures
    is validate's to check (``build_toolbox``), before anything samples; here only their shapes."""

    tools: list[str] = option([], "functions the model may call, each `package.module:function` (TRL's "
                              "tools): type hints on every argument and a docstring (Args: section) make the "
                              "schema its chat template shows; a completion then runs tool calls turn by "
                              "turn, tool output masked from the loss. Needs chat prompts")
    environment_factory: str | dict | None = option(
        None, "`package.module:Class` built per rollout: reset(**row) at its start (a string it returns is "
        "appended to the prompt), its public methods are tools, close() (when defined) after scoring; or "
        "{name: package.module:Class}, chosen per row by its `environment` column (TRL's "
        "environment_factory)")
    max_tool_calling_iterations: int | None = option(
        None, "tool-calling turns per completion at most (None = until the model stops calling tools or "
        "max_completion_length is reached; TRL's)", ge=0)
    tool_timeout_s: float = option(
        30.0, "seconds one tool call may take; past it the model is answered with the error and the call "
        "counts as a failure (0 = no limit). It also bounds an environment's constructor, reset and close: "
        "past it the stage fails naming the one that hung", ge=0)
    rollout_func: str | None = option(
        None, "`package.module:function` that samples a round itself (TRL's rollout_func): called as "
        "fn(prompts, trainer) and returning {prompt_ids, completion_ids, logprobs[, env_mask]}; not with "
        "tools or environment_factory")

    @property
    def enabled(self) -> bool:
        """Whether completions are multi-turn conversations with tool calls."""
        return bool(self.tools) or self.environment_factory is not None

    def check(self) -> None:
        for i, path in enumerate(self.tools):
            if not is_import_path(path):
                raise ConfigError(f"tools[{i}]: {path!r} is not an import path; write {IMPORT_PATH_FORM}")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"tools: a tool is named twice ({self.tools}); each tool may appear once")
        self._check_environment_factory()
        if self.rollout_func is not None:
            if not is_import_path(self.rollout_func):
                raise ConfigError(f"rollout_func: {self.rollout_func!r} is not an import path; write "
                                  f"{IMPORT_PATH_FORM}")
            if self.enabled:
                raise ConfigError("rollout_func: not with train.tools or train.environment_factory; a "
                                  "rollout function samples the whole conversation itself (return env_mask "
                                  "to mask what it inserted), the tool loop is for the built-in rollout")

    def _check_environment_factory(self) -> None:
        factory = self.environment_factory
        if isinstance(factory, str) and not is_import_path(factory):
            raise ConfigError(f"environment_factory: {factory!r} is not an import path; write "
                              f"{IMPORT_PATH_FORM} or a mapping name -> {IMPORT_PATH_FORM}")
        if not isinstance(factory, dict):
            return
        if not factory:
            raise ConfigError("environment_factory: an empty mapping; name at least one environment, or null")
        for name, path in factory.items():
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"environment_factory: {name!r} is not an environment name (the values of "
                                  "the rows' `environment` column)")
            if not is_import_path(path):
                raise ConfigError(f"environment_factory.{name}: {path!r} is not an import path; write "
                                  f"{IMPORT_PATH_FORM}")


class ToolConfigError(ConfigurationError, ValueError):
    """A tool or environment that cannot be used: it does not import, lacks type hints or a docstring, ...;
    the message names the params.yaml key and the import path."""


class EnvironmentFailure(TrainingFailure, RuntimeError):
    """An environment misbehaved while sampling (a reset that returned neither None nor a string, a row naming
    no configured environment, a constructor, reset or close that did not return within train.tool_timeout_s);
    the message names the environment and the row."""


def bounded(fn: Callable, timeout_s: float | None, what: str, arguments: Mapping | None = None) -> Any:
    """``fn(**arguments)`` within ``timeout_s`` (train.tool_timeout_s),
    else EnvironmentFailure naming ``what``."""
    try:
        return call_within(fn, dict(arguments or {}), timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(f"{what} did not return within train.tool_timeout_s = {timeout_s:g} s; an "
                                 "environment's constructor, reset and close are bounded as its tools "
                                 "are") from None


def import_path(path: str, key: str) -> Any:
    """The object ``package.module:name`` names (``name`` may be dotted: ``module:Class.method``)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ToolConfigError(f"{key}: {path!r} is not an import path; write {IMPORT_PATH_FORM}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolConfigError(f"{key}: cannot import module {module_name!r} (from {path!r}): {exc}") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ToolConfigError(f"{key}: module {module_name!r} has no attribute {attr!r} (from {path!r})")
        target = getattr(target, part)
    return target


def tool_schema(fn: Callable, where: str) -> dict:
    """The JSON schema of a tool (what its chat template shows the model), or a ToolConfigError naming
    ``where``: every argument needs a type hint and a line in the docstring's Args section; a return
    annotation, when given, must be a type the model can be shown."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise ToolConfigError(f"{where}: {fn!r} is not callable; a tool is a function")
    try:
        schema = get_json_schema(fn)
    except Exception as exc:
        # transformers' TypeHintParsingException / DocstringParsingException (not ValueErrors)
        raise ToolConfigError(f"{where}: {exc}. A tool needs a type hint on every argument and a docstring: "
                              "a description, then an Args: section with a line per argument "
                              "(docs/agentic.md)") from exc
    returns = _return_annotation(fn)
    if returns is not None and not _renderable(returns):
        raise ToolConfigError(f"{where}: returns {returns!r}; a tool returns a string (numbers, lists, dicts "
                              "and None are shown to the model with str())")
    return schema


def _return_annotation(fn: Callable) -> Any:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable hints: get_json_schema already judged the arguments
        return None
    return hints.get("return")


def _renderable(annotation: Any) -> bool:
    """Whether values of ``annotation`` are among RESULT_TYPES (every member of a union must be)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(_renderable(a) for a in typing.get_args(annotation))
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    cls = origin or annotation  # list[int] -> list
    return isinstance(cls, type) and issubclass(cls, RESULT_TYPES)


def environment_tools(environment: Any) -> dict[str, Callable]:
    """An environment's tools: the bound public methods of its class (not ``reset``, ``get_reward``,
    ``close``), listed on the class so properties are never evaluated (as TRL lists them)."""
    return {name: getattr(environment, name)
            for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS}


@dataclass
class RolloutTools:
    """What one rollout may call: the standalone tools and its own environment's methods, by name."""

    functions: dict[str, Callable]
    environment: Any = None
    observation: str | None = None    # what reset() returned, appended to the prompt's last message
    timeout_s: float | None = None    # the bound on the environment's close (train.tool_timeout_s)

    @property
    def schemas(self) -> list[Callable]:
        """For ``apply_chat_template(tools=...)`` and ``parse_response(tools=...)``
        (None when there are none)."""
        return list(self.functions.values())

    def close(self) -> None:
        close = getattr(self.environment, "close", None)
        if callable(close):
            bounded(close, self.timeout_s, f"{type(self.environment).__name__}.close()")


@dataclass
class Toolbox:
    """The configured tools and environment factories, imported and checked (``build_toolbox``)."""

    tools: list[Callable]
    factories: dict[str | None, Callable] | None  # None key: one environment class for every row
    max_iterations: int | None
    timeout_s: float

    @property
    def multi_environment(self) -> bool:
        return self.factories is not None and None not in self.factories

    @property
    def environment_names(self) -> list[str] | None:
        """The names rows pick environments by (a mapping), else None."""
        return sorted(self.factories) if self.multi_environment else None

    def all_tools(self) -> list[Callable]:
        """Every tool any rollout may be offered: the standalone ones and every environment's methods (of an
        instance built for the listing and closed). What validate counts prompt lengths with (an upper bound
        when rows pick among several environments)."""
        tools = list(self.tools)
        for factory in (self.factories or {}).values():
            environment = bounded(factory, self.timeout_s, f"{getattr(factory, '__name__', factory)}()")
            try:
                tools += [m for name, m in environment_tools(environment).items()
                          if name not in {getattr(t, "__name__", None) for t in tools}]
            finally:
                RolloutTools({}, environment, timeout_s=self.timeout_s).close()
        return tools

    def check_reset(self, rows: Sequence[Mapping], where: Sequence[str]) -> None:
        """Validate's check: each row (one per environment it picks) resets a new environment,
        ``reset(**row)`` taking the row's columns and returning None or a string; a ToolConfigError naming the
        row otherwise."""
        for row, label in zip(rows, where):
            try:
                close_all(self.open([row], [label]))
            except EnvironmentFailure as exc:
                raise ToolConfigError(str(exc)) from exc
            except TypeError as exc:
                raise ToolConfigError(f"{label}: reset(**row) cannot take the row's columns {sorted(row)}: "
                                      f"{exc}; an environment's reset receives every column of its row "
                                      "(accept **kwargs for those it does not use)") from exc

    def environment_of(self, row: Mapping, where: str = "a row") -> str | None:
        """The environment a row selects (None: the single one, or none at all)."""
        if not self.multi_environment:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            raise EnvironmentFailure(f"{where}: environment {name!r} (its {ENVIRONMENT_COLUMN!r} column) is "
                                    f"not one of train.environment_factory's: {sorted(self.factories)}")
        return name

    def open(self, rows: Sequence[Mapping], where: Sequence[str] | None = None) -> list[RolloutTools]:
        """One ``RolloutTools`` per row: a new environment, reset with the row's columns (TRL's
        ``reset(**row)``, without the ``environment`` column when it picks the environment). Close them with
        ``close_all`` once scored."""
        opened: list[RolloutTools] = []
        try:
            for i, row in enumerate(rows):
                label = where[i] if where is not None else f"row {i}"
                opened.append(self._open_one(row, label))
        except BaseException:
            close_all(opened)
            raise
        return opened

    def _open_one(self, row: Mapping, where: str) -> RolloutTools:
        functions = {getattr(fn, "__name__", repr(fn)): fn for fn in self.tools}
        if self.factories is None:
            return RolloutTools(functions)
        name = self.environment_of(row, where)
        factory = self.factories[name]
        environment = bounded(factory, self.timeout_s, f"{where}: {getattr(factory, '__name__', factory)}()")
        kwargs = ({k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.multi_environment
                  else dict(row))
        tools = RolloutTools({**functions, **environment_tools(environment)}, environment,
                             timeout_s=self.timeout_s)
        try:
            observation = bounded(environment.reset, self.timeout_s,
                                  f"{where}: {type(environment).__name__}.reset()", kwargs)
        except BaseException:
            tools.close()
            raise
        if observation is not None and not isinstance(observation, str):
            tools.close()
            raise EnvironmentFailure(f"{where}: {type(environment).__name__}.reset() returned "
                                    f"{type(observation).__name__}; it returns None or a string (appended to "
                                    "the prompt)")
        tools.observation = observation
        return tools


def close_all(opened: Sequence[RolloutTools]) -> None:
    """Close every rollout's environment, the first error raised after all are closed."""
    first: BaseException | None = None
    for tools in opened:
        try:
            tools.close()
        except BaseException as exc:  # noqa: BLE001 - the others still get closed
            first = first or exc
    if first is not None:
        raise first


def build_toolbox(u: ToolUseOptions) -> Toolbox | None:
    """The tools and environment factories of ``train.*`` imported and checked (None when there are none):
    each tool's schema; each environment built once (as TRL probes it), with a ``reset`` and schemas for its
    methods, no method named like a standalone tool, then closed."""
    if not u.enabled:
        return None
    tools = []
    for i, path in enumerate(u.tools):
        key = f"train.tools[{i}]"
        fn = import_path(path, key)
        tool_schema(fn, f"{key} ({path})")
        tools.append(fn)
    factories = None
    if u.environment_factory is not None:
        named = (u.environment_factory if isinstance(u.environment_factory, dict)
                 else {None: u.environment_factory})
        factories = {}
        for name, path in named.items():
            key = "train.environment_factory" + ("" if name is None else f".{name}")
            factories[name] = import_path(path, key)
            probe_environment(factories[name], f"{key} ({path})",
                              [getattr(fn, "__name__", "") for fn in tools], u.tool_timeout_s)
    return Toolbox(tools, factories, u.max_tool_calling_iterations, u.tool_timeout_s)


def probe_environment(factory: Callable, where: str, standalone: Sequence[str],
                      timeout_s: float | None = None) -> None:
    """Build one environment and check it: a callable ``reset``, a schema for every tool method, no tool name
    taken twice; then close it. Building and closing are bounded by ``timeout_s``."""
    if not callable(factory):
        raise ToolConfigError(f"{where}: {factory!r} is not callable; name an environment class")
    try:
        environment = bounded(factory, timeout_s, f"{where}: building the environment")
    except EnvironmentFailure:
        raise
    except Exception as exc:
        raise ToolConfigError(f"{where}: building the environment raised {type(exc).__name__}: {exc} (it is "
                              "built with no arguments, once per rollout)") from exc
    try:
        if not callable(getattr(environment, "reset", None)):
            raise ToolConfigError(f"{where}: {type(environment).__name__} has no reset() method; an "
                                  "environment defines reset(**row), called at the start of each rollout")
        methods = environment_tools(environment)
        if not methods and not standalone:
            raise ToolConfigError(f"{where}: {type(environment).__name__} has no public method, so the model "
                                  "has no tool to call (and train.tools is empty)")
        for name, method in methods.items():
            if name in standalone:
                raise ToolConfigError(f"{where}: its method {name}() has the name of a tool in train.tools; "
                                      "a tool name must be unique")
            tool_schema(method, f"{where}, method {name}")
    finally:
        RolloutTools({}, environment, timeout_s=timeout_s).close()


def load_rollout_func(u: ToolUseOptions) -> Callable | None:
    """``train.rollout_func`` imported and checked - callable as ``fn(prompts, trainer)`` (TRL's
    ``rollout_func``, run by grpo_core/rollout/custom.py) - or None when unset."""
    if u.rollout_func is None:
        return None
    fn = import_path(u.rollout_func, "train.rollout_func")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise ToolConfigError(f"train.rollout_func ({u.rollout_func}): cannot be called as fn(prompts, "
                              f"trainer): {exc}") from exc
    except ValueError:  # a builtin without a signature: nothing to check
        pass
    return fn
