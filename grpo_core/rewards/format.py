"""Format rewards: strict and soft tag layouts, and the per-tag XML count of the GRPO notebooks.

Each factory takes the tag names as kwargs and returns a reward function (N completions → N floats).
"""

from __future__ import annotations

import re
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts


def strict_format(
    reward: float = 1.0, reasoning_tag: str = "reasoning", answer_tag: str = "answer"
) -> RewardFunction:
    """`reward` when the whole completion is exactly
    `<reasoning>\\n…\\n</reasoning>\\n<answer>\\n…\\n</answer>` (optionally one final newline), else 0.0.

    The sections may span several lines (DOTALL); nothing may precede or follow the layout.
    """
    r, a = re.escape(reasoning_tag), re.escape(answer_tag)
    pattern = re.compile(rf"<{r}>\n.*?\n</{r}>\n<{a}>\n.*?\n</{a}>\n?", re.DOTALL)

    def strict_format(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [reward if pattern.fullmatch(t) else 0.0 for t in texts(completions)]

    return named(strict_format, "strict_format")


def soft_format(
    reward: float = 1.0, reasoning_tag: str = "reasoning", answer_tag: str = "answer"
) -> RewardFunction:
    """`reward` when the completion starts (after optional whitespace) with `<reasoning>…</reasoning>`
    followed by `<answer>…</answer>`, whitespace between them free; trailing text allowed; else 0.0."""
    r, a = re.escape(reasoning_tag), re.escape(answer_tag)
    pattern = re.compile(rf"\s*<{r}>.*?</{r}>\s*<{a}>.*?</{a}>", re.DOTALL)

    def soft_format(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [reward if pattern.match(t) else 0.0 for t in texts(completions)]

    return named(soft_format, "soft_format")


def xml_count(
    per_tag: float = 0.125,
    trailing_penalty: float = 0.001,
    reasoning_tag: str = "reasoning",
    answer_tag: str = "answer",
) -> RewardFunction:
    """Partial credit per correctly placed tag, as in the GRPO notebooks (max 4 × `per_tag` = 0.5):

    +per_tag each for exactly one `<reasoning>\\n`, one `\\n</reasoning>\\n`, one `\\n<answer>\\n` and one
    `\\n</answer>`; minus `trailing_penalty` per character after `\\n</answer>` (one final newline is free).
    Unlike the notebook, the trailing text is measured once, so a completion that ends right after
    `</answer>` is not penalised.
    """
    r, a = reasoning_tag, answer_tag
    open_r, close_r, open_a, close_a = f"<{r}>\n", f"\n</{r}>\n", f"\n<{a}>\n", f"\n</{a}>"

    def score(text: str) -> float:
        value = 0.0
        value += per_tag if text.count(open_r) == 1 else 0.0
        value += per_tag if text.count(close_r) == 1 else 0.0
        value += per_tag if text.count(open_a) == 1 else 0.0
        if text.count(close_a) == 1:
            trailing = text.split(close_a, 1)[1]
            trailing = trailing[1:] if trailing.startswith("\n") else trailing
            value += per_tag - trailing_penalty * len(trailing)
        return value

    def xml_count(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [score(t) for t in texts(completions)]

    return named(xml_count, "xml_count")
