"""Keyword reward: credit per keyword found, capped."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import extract_section


def keyword_hits(
    keywords: Sequence[str],
    per_hit: float = 0.1,
    cap: float = 0.5,
    count_repeats: bool = False,
    case_sensitive: bool = False,
    whole_words: bool = True,
    section: Literal["completion", "reasoning", "answer"] = "completion",
    reasoning_tag: str = "reasoning",
    answer_tag: str = "answer",
) -> RewardFunction:
    """min(cap, per_hit × hits): hits = distinct keywords present (or every occurrence with
    `count_repeats`), searched in the whole completion or only its reasoning/answer section (a missing
    section has no hits)."""
    if not keywords:
        raise ValueError("keyword_hits: `keywords` must be a non-empty list")
    if section not in ("completion", "reasoning", "answer"):
        raise ValueError(f"keyword_hits: section must be completion|reasoning|answer, got {section!r}")
    flags = 0 if case_sensitive else re.IGNORECASE
    patterns = [
        re.compile(rf"(?<!\w){re.escape(k)}(?!\w)" if whole_words else re.escape(k), flags) for k in keywords
    ]

    def score(text: str) -> float:
        if section != "completion":
            tag = reasoning_tag if section == "reasoning" else answer_tag
            text = extract_section(text, tag, last=section == "answer") or ""
        counts = [len(p.findall(text)) for p in patterns]
        hits = sum(counts) if count_repeats else sum(1 for c in counts if c)
        return min(cap, per_hit * hits)

    def keyword_hits(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [score(t) for t in texts(completions)]

    return named(keyword_hits, "keyword_hits")
