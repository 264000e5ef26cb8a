"""Resolution of params.yaml `rewards:` entries into named reward functions.

A spec's `function` is a built-in name (a factory called with the spec's kwargs) or an import path
`package.module:function` naming a plain reward function (kwargs bound with functools.partial).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo_core.common.errors import ConfigurationError
from grpo_core.rewards.base import RewardFunction, RewardSpec, named
from grpo_core.rewards.code import code_execution
from grpo_core.rewards.correctness import correctness, multiple_choice, numeric
from grpo_core.rewards.environment import environment_reward
from grpo_core.rewards.format import soft_format, strict_format, xml_count
from grpo_core.rewards.isolated import IsolatedReward
from grpo_core.rewards.keywords import keyword_hits
from grpo_core.rewards.length import overlong_penalty, reasoning_length
from grpo_core.rewards.math import math_verify
from grpo_core.rewards.reasoning_gym import reasoning_gym
from grpo_core.rewards.reward_model import reward_model
from grpo_core.rewards.sandbox import SandboxUnavailable
from grpo_core.rewards.wrappers import clip_reward

BUILTINS: dict[str, Callable[..., RewardFunction]] = {
    "correctness": correctness,
    "multiple_choice": multiple_choice,
    "numeric": numeric,
    "math_verify": math_verify,
    "reasoning_gym": reasoning_gym,
    "code_execution": code_execution,
    "reward_model": reward_model,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xml_count": xml_count,
    "reasoning_length": reasoning_length,
    "keyword_hits": keyword_hits,
    "overlong_penalty": overlong_penalty,
    "environment_reward": environment_reward,
}


class RewardConfigError(ConfigurationError, ValueError):
    """A `rewards:` entry that cannot be turned into a reward function; the message names the entry."""


def _field(spec: RewardSpec | Mapping[str, Any], key: str, default: Any = None) -> Any:
    # The lead's config objects carry attributes; plain dicts (tests, notebooks) are accepted too.
    if isinstance(spec, Mapping):
        return spec.get(key, default)
    return getattr(spec, key, default)


def _import_function(path: str, reward: str) -> Callable[..., Any]:
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise RewardConfigError(
            f"reward {reward!r}: import path {path!r} must look like 'package.module:function'"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardConfigError(
            f"reward {reward!r}: cannot import module {module_name!r} (from {path!r}): {exc}"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise RewardConfigError(
                f"reward {reward!r}: module {module_name!r} has no attribute {attr_path!r} (from {path!r})"
            )
        target = getattr(target, part)
    if not callable(target):
        raise RewardConfigError(f"reward {reward!r}: {path!r} is not callable")
    return target


def _unknown_builtin(function: str, reward: str) -> RewardConfigError:
    close = difflib.get_close_matches(function, BUILTINS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if "." in function:
        hint += " An import path is written 'package.module:function'."
    return RewardConfigError(
        f"reward {reward!r}: unknown reward function {function!r}.{hint} Built-ins: "
        f"{', '.join(sorted(BUILTINS))}"
    )


def resolve_reward_function(
    function: str, kwargs: Mapping[str, Any] | None = None, name: str | None = None
) -> RewardFunction:
    """One reward function from a built-in name or import path, bound to `kwargs`, named `name`
    (default: the built-in name or the imported function's name)."""
    kwargs = dict(kwargs or {})
    label = name or function
    if ":" in function:
        target = _import_function(function, label)
        fn: Callable[..., Any] = functools.partial(target, **kwargs) if kwargs else target
        return named(fn, name or getattr(target, "__name__", function.rsplit(":", 1)[1]))
    if function not in BUILTINS:
        raise _unknown_builtin(function, label)
    factory = BUILTINS[function]
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        params = ", ".join(inspect.signature(factory).parameters)
        raise RewardConfigError(
            f"reward {label!r}: bad kwargs for built-in {function!r} ({exc}); it takes: {params}"
        ) from exc
    try:
        built = factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise RewardConfigError(f"reward {label!r}: {exc}") from exc
    return named(built, name or function)


def build_reward_functions(specs: Sequence[RewardSpec | Mapping[str, Any]]) -> list[RewardFunction]:
    """The reward functions for params.yaml's `rewards:` list, in order; each function's `__name__` is its
    spec's `name` (the metric `rewards/<name>/mean`), clipped to `spec.clip` when given.

    Raises RewardConfigError naming the entry for unknown built-ins (with the closest match), import paths
    that do not resolve, bad kwargs, duplicate names, or a malformed clip.
    """
    functions: list[RewardFunction] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        name = _field(spec, "name")
        function = _field(spec, "function")
        if not isinstance(name, str) or not name:
            raise RewardConfigError(f"rewards[{i}]: `name` must be a non-empty string, got {name!r}")
        if name in seen:
            raise RewardConfigError(f"rewards[{i}]: duplicate reward name {name!r} (names are metric names)")
        if not isinstance(function, str) or not function:
            raise RewardConfigError(
                f"reward {name!r}: `function` must be a non-empty string, got {function!r}"
            )
        try:
            fn = resolve_reward_function(function, _field(spec, "kwargs") or {}, name)  # fails fast, here
        except (RewardConfigError, SandboxUnavailable) as exc:  # the same error, naming the entry
            raise type(exc)(f"rewards[{i}]: {exc}") from exc
        clip = _field(spec, "clip")
        if _field(spec, "isolated", False):
            functions.append(IsolatedReward(function, _field(spec, "kwargs") or {}, name, clip,
                                            resolve=resolve_reward_function))
            seen.add(name)
            continue
        if clip is not None:
            try:
                fn = clip_reward(fn, clip)
            except (TypeError, ValueError) as exc:
                raise RewardConfigError(f"reward {name!r}: {exc}") from exc
        seen.add(name)
        functions.append(fn)
    return functions
