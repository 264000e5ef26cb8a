"""The environment's own reward (TRL 1.16: an environment with ``get_reward()`` owns a reward).

TRL adds it as an extra reward column by itself; here it is listed in ``rewards:`` like any other, so its
name, weight (calibrated or pinned) and clip are as explicit as the rest:
``{name: solved, function: environment_reward}``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named


def environment_reward() -> RewardFunction:
    """Each rollout's ``environment.get_reward()`` (awaited when ``async``), read after its conversation
    ended; None where the rollout's environment defines no ``get_reward`` (a mapping of environments may mix
    them)."""

    def environment_reward(prompts: list, completions: list, environments: Sequence[Any] | None = None,
                           **kwargs: Any) -> list[RewardValue]:
        if environments is None:
            raise ValueError("environment_reward reads each rollout's environment, and there is none: set "
                             "train.environment_factory")
        values = []
        for environment in environments:
            get_reward = getattr(environment, "get_reward", None)
            value = get_reward() if callable(get_reward) else None
            values.append(asyncio.run(value) if inspect.isawaitable(value) else value)
        return values

    return named(environment_reward, "environment_reward")
