"""Reward functions (TRL-compatible), the built-ins, and their resolution from params.yaml.

    fn(prompts: list, completions: list, **columns) -> list[float | None]

`build_reward_functions(specs)` turns `rewards:` entries into functions; `score_completions` runs them on a
batch into an (N, K) float64 matrix with NaN for None. `parse_gold` is exposed for data validation.
"""

from grpo_core.rewards.base import RewardFunction, RewardSpec, completion_text
from grpo_core.rewards.correctness import correctness, multiple_choice, numeric
from grpo_core.rewards.format import soft_format, strict_format, xml_count
from grpo_core.rewards.keywords import keyword_hits
from grpo_core.rewards.length import overlong_penalty, reasoning_length
from grpo_core.rewards.parsing import ParsedGold, extract_section, parse_gold, parse_number
from grpo_core.rewards.registry import (
    BUILTINS,
    RewardConfigError,
    build_reward_functions,
    resolve_reward_function,
)
from grpo_core.rewards.scoring import RewardFunctionError, call_reward, score_completions
from grpo_core.rewards.wrappers import clip_reward

__all__ = [
    "BUILTINS",
    "ParsedGold",
    "RewardConfigError",
    "RewardFunction",
    "RewardFunctionError",
    "RewardSpec",
    "build_reward_functions",
    "clip_reward",
    "completion_text",
    "correctness",
    "extract_section",
    "keyword_hits",
    "multiple_choice",
    "numeric",
    "overlong_penalty",
    "parse_gold",
    "parse_number",
    "reasoning_length",
    "resolve_reward_function",
    "call_reward",
    "score_completions",
    "soft_format",
    "strict_format",
    "xml_count",
]
