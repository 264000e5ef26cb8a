"""Typed options: how a component declares the params.yaml keys it reads, and how YAML becomes them.

A component's options are an ``Options`` dataclass beside the code that reads them; each field is an
``option``: its default, a one-line help and optionally a numeric range. Ranges and the checks that involve
several fields of one class (its ``check``) run once, when it is made, however it is made: from YAML by
``build`` (errors name the key, ``train.epsilon: ...``) or in code (``grpo_loss``'s keywords). ``build`` also
refuses unknown keys (naming the closest valid one) and wrong types.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from grpo_core.common.errors import ConfigurationError


class ConfigError(ConfigurationError, ValueError):
    """A params.yaml problem; the message names the key (``section.key``) and what is allowed."""


def option(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, expected: str | None = None) -> Any:
    """A dataclass field with its meaning, an optional range, and
    (``expected``) the forms a wrong type is told."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "expected": expected}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return f"list[{type_name(inner)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def convert(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against annotation ``tp`` and converted (ints to float, mappings to dataclasses)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, typing.get_args(tp), key, tp)
    if origin is Literal:
        return _convert_literal(value, typing.get_args(tp), key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list ({type_name(tp)}), "
                              f"got {type(value).__name__} {value!r}")
        (inner,) = typing.get_args(tp) or (Any,)
        return [convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, value, key)
    if tp is Any:
        return value
    if tp not in _SCALARS:
        raise ConfigError(f"{key}: unsupported type {tp!r}")  # a bug in an options class, not in the YAML
    numeric = tp in (int, float) and not isinstance(value, bool)
    if (numeric and isinstance(value, (int, float) if tp is float else int)) or (
            not numeric and type(value) is tp):
        return float(value) if tp is float else value
    raise ConfigError(f"{key}: expected {_SCALARS[tp]}, got {value!r}")


def _convert_union(value: Any, args: tuple, key: str, tp: Any) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{key}: null is not allowed; expected {type_name(tp)}")
    candidates = [a for a in args if a is not type(None)]
    if len(candidates) == 1:  # Optional[X]: X's own, more precise, error
        return convert(value, candidates[0], key)
    for arg in candidates:
        try:
            return convert(value, arg, key)
        except ConfigError:
            continue
    raise ConfigError(f"{key}: {value!r} is not {type_name(tp)}")


def _convert_literal(value: Any, allowed: tuple, key: str) -> Any:
    # YAML 1.1 (PyYAML, `-S key=no` through some tools) reads a bare no as false
    if value is False and "no" in allowed:
        return "no"
    if value not in allowed or isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
    return value


def check_range(value: Any, meta: Mapping, key: str) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    bounds = {"ge": (">=", value.__ge__), "gt": (">", value.__gt__), "le": ("<=", value.__le__),
              "lt": ("<", value.__lt__)}
    if any(meta.get(n) is not None and ok(meta[n]) is False for n, (_, ok) in bounds.items()):
        allowed = " and ".join(f"{s} {meta[n]}" for n, (s, _) in bounds.items() if meta.get(n) is not None)
        raise ConfigError(f"{key}: {value!r} is out of range; allowed: {allowed}")


def unknown_key(key: str, name: str, valid: typing.Iterable[str]) -> ConfigError:
    valid = list(valid)
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"{key}: unknown key{hint}")


def build(cls: type, data: Any, prefix: str) -> Any:
    """``cls`` from a YAML mapping; every error names ``prefix.key``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in data:
        if name not in fields:
            raise unknown_key(f"{prefix}.{name}", name, fields)
    return construct(cls, data, prefix)


def construct(cls: type, kwargs: Mapping, prefix: str) -> Any:
    """``cls(**kwargs)``, its own checks' errors prefixed with where the section is."""
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{prefix}.{err}" if not str(err).startswith(prefix + ".") else str(err)) from None


class Options:
    """Base of an options dataclass: on construction every field is converted to its type (YAML mappings to
    nested options) and checked against its range, then ``check`` (override it for checks across fields) runs.
    A ConfigError it raises names the field (``"epsilon: ..."``); ``build`` prefixes where the section is."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                converted = convert(value, hints[f.name], f.name)
            except ConfigError as err:  # a field that names its accepted forms says them instead of the type
                if f.metadata.get("expected") is None:
                    raise
                raise ConfigError(f"{f.name}: {value!r} is not {f.metadata['expected']}") from err
            check_range(converted, f.metadata, f.name)
            object.__setattr__(self, f.name, converted)  # an int given for a float field becomes the float
        self.check()

    def check(self) -> None:
        """Checks across this class's own fields; raise ConfigError("field: ...")."""


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, meaning) for every field of an options class: for docs and --help."""
    hints = _hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows
