"""Scoring a batch of completions with K reward functions into an (N, K) matrix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from grpo_core.rewards.base import RewardFunction


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something other than N floats/ints/Nones."""


def _name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", repr(fn))


def _check_output(values: Any, n: int, name: str) -> list[float]:
    """`values` as N floats, NaN for None; error naming the function when it is not a length-N list."""
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, list | tuple):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}, expected a list of {n} float|int|None"
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {n} completions"
        )
    out: list[float] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isinf(v):
            out.append(float(v))  # NaN is kept: it means None
        else:
            raise RewardFunctionError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {i}; "
                "expected a finite float, an int or None"
            )
    return out


def _call(fn: RewardFunction, prompts: list, completions: list, columns: Mapping[str, Sequence[Any]]) -> Any:
    return fn(prompts=prompts, completions=completions, **{k: list(v) for k, v in columns.items()})


def _per_sample(
    fn: RewardFunction,
    prompts: list,
    completions: list,
    columns: Mapping[str, Sequence[Any]],
    on_error: str,
) -> tuple[list[float], int]:
    """Fallback after a batch call raised: one call per sample, so only failing samples become None."""
    name, values, failures = _name(fn), [], 0
    for i in range(len(completions)):
        row = {k: [v[i]] for k, v in columns.items()}
        try:
            out = _call(fn, [prompts[i]], [completions[i]], row)
        except Exception as exc:
            if on_error == "raise":
                raise RewardFunctionError(
                    f"reward function {name!r} raised on sample {i}: {type(exc).__name__}: {exc}"
                ) from exc
            values.append(math.nan)
            failures += 1
            continue
        values.extend(_check_output(out, 1, name))
    return values, failures


def score_completions(
    reward_fns: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    on_error: Literal["raise", "none"] = "raise",
) -> tuple[np.ndarray, dict[str, int]]:
    """Score N completions with K reward functions.

    Args:
        reward_fns: K functions `fn(prompts, completions, **columns) -> list[float | None]`.
        prompts, completions: N each (a prompt repeated once per completion, as TRL does).
        columns: extra keyword lists, each of length N (dataset columns, `completion_ids`, ...).
        on_error: "raise" → a raising function raises RewardFunctionError naming it and the first failing
            sample; "none" → its failing samples score None (NaN) and are counted.

    Returns:
        rewards: (N, K) float64, NaN where a function returned None (or failed with on_error="none").
        error_counts: {function name: number of samples on which it raised}, one key per function.

    A function that returns anything but N values of float/int/None raises RewardFunctionError in both modes.
    """
    if on_error not in ("raise", "none"):
        raise ValueError(f"on_error must be 'raise' or 'none', got {on_error!r}")
    prompts, completions, columns = list(prompts), list(completions), dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: repeat each prompt per completion")
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {key!r} has {len(col)} values for {n} completions")
    rewards = np.full((n, len(reward_fns)), np.nan, dtype=np.float64)
    error_counts: dict[str, int] = {}
    for k, fn in enumerate(reward_fns):
        name = _name(fn)
        batch_error: Exception | None = None
        try:
            out = _call(fn, prompts, completions, columns)
        except Exception as exc:
            batch_error = exc
        if batch_error is not None:
            values, failures = _per_sample(fn, prompts, completions, columns, on_error)
            if failures == 0 and on_error == "raise":
                # Every sample passes alone, yet the batch call failed: report the batch, not a sample.
                raise RewardFunctionError(
                    f"reward function {name!r} raised on the batch of {n} (no single sample fails): "
                    f"{type(batch_error).__name__}: {batch_error}"
                ) from batch_error
        else:
            values, failures = _check_output(out, n, name), 0
        rewards[:, k] = values
        error_counts[name] = error_counts.get(name, 0) + failures
    return rewards, error_counts
