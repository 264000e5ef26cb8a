"""Wrappers around reward functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, is_async_reward, named


def clip_reward(fn: RewardFunction, bounds: Sequence[float]) -> RewardFunction:
    """`fn` with every non-None value clipped to [lo, hi]; None passes through; the name is kept."""
    if len(bounds) != 2 or not bounds[0] <= bounds[1]:
        raise ValueError(f"clip must be [lo, hi] with lo <= hi, got {list(bounds)!r}")
    lo, hi = float(bounds[0]), float(bounds[1])

    def clip(values: Any) -> Any:
        if not isinstance(values, list | tuple):
            return values  # let score_completions report the bad return type against the function's name
        # Only real numbers are clipped; anything else is left for score_completions to report.
        return [min(hi, max(lo, v)) if isinstance(v, int | float) and v == v else v for v in values]

    if is_async_reward(fn):
        async def clipped_async(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
            return clip(await fn(prompts, completions, **kwargs))

        return named(clipped_async, fn.__name__)

    def clipped(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return clip(fn(prompts, completions, **kwargs))

    return named(clipped, fn.__name__)
