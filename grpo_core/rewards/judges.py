"""Which reward judges an answer correct and which judges its format, for evaluation (the evaluate stage and
evaluation during training) and calibration.

The first configured reward whose built-in function checks the answer (``correctness``, ``numeric``,
``multiple_choice``, ``math_verify``, ``reasoning_gym``) judges correctness: a sample is correct when it
scores that reward's ``correct`` value (reasoning_gym: 1.0, the task's full score). The first configured
``soft_format`` / ``strict_format`` judges the format: > 0 is well formed. With none configured, the
built-in ``correctness`` and ``soft_format`` judge; beside a ``reasoning_gym`` correctness reward, a reply is
well formed when that reward's extraction finds an answer in it (a wrong answer, not none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from grpo_core.rewards.base import RewardFunction, RewardSpec
from grpo_core.rewards.correctness import correctness
from grpo_core.rewards.format import soft_format
from grpo_core.rewards.reasoning_gym import reasoning_gym_answered
from grpo_core.rewards.registry import build_reward_functions

CORRECTNESS_FUNCTIONS = frozenset({"correctness", "multiple_choice", "numeric", "math_verify",
                                   "reasoning_gym"})
FORMAT_FUNCTIONS = frozenset({"soft_format", "strict_format"})


def reward_index(specs: Sequence[RewardSpec], functions: frozenset[str]) -> int | None:
    """Index of the first reward spec whose built-in function is in ``functions`` (None if none)."""
    for i, spec in enumerate(specs):
        if spec.function in functions:
            return i
    return None


@dataclass(frozen=True)
class Judges:
    """correct_fn scores ``correct_value`` on a correct answer; format_fn scores > 0 on a well-formed one."""

    correct_fn: RewardFunction
    correct_value: float
    format_fn: RewardFunction

    def is_correct(self, score: float) -> bool:
        return math.isfinite(score) and abs(score - self.correct_value) < 1e-9  # NaN (None) is never correct

    @staticmethod
    def is_well_formed(score: float) -> bool:
        return math.isfinite(score) and score > 0


def build_judges(specs: Sequence[RewardSpec]) -> Judges:
    """The configured correctness and format rewards when present, else the built-ins."""
    ci, fi = reward_index(specs, CORRECTNESS_FUNCTIONS), reward_index(specs, FORMAT_FUNCTIONS)
    if ci is not None:
        correct_fn, correct_value = (build_reward_functions([specs[ci]])[0],
                                     float(specs[ci].kwargs.get("correct", 1.0)))
    else:
        correct_fn, correct_value = correctness(), 1.0
    if fi is not None:
        format_fn = build_reward_functions([specs[fi]])[0]
    elif ci is not None and specs[ci].function == "reasoning_gym":
        format_fn = reasoning_gym_answered(**{k: v for k, v in specs[ci].kwargs.items()
                                              if k in ("extract", "answer_tag")})
    else:
        format_fn = soft_format()
    return Judges(correct_fn, correct_value, format_fn)
