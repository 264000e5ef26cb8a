"""Correctness rewards against a gold column: multiple choice, numeric, and the dispatching `correctness`.

The model's answer is read from its answer section (`<answer>…</answer>`; `answer_tag=None` reads the
whole completion). A row whose gold is missing or of the other kind gets None ("does not apply").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import (
    DEFAULT_LETTERS,
    ParsedGold,
    extract_choice,
    extract_number,
    extract_section,
    parse_gold,
)


def _gold_column(kwargs: dict[str, Any], column: str, n: int, reward: str) -> Sequence[Any]:
    if column not in kwargs:
        cols = sorted(k for k in kwargs if k not in ("completion_ids", "completion_lengths", "trainer_state"))
        raise KeyError(f"{reward}: no gold column {column!r} among the reward columns {cols}")
    gold = kwargs[column]
    if len(gold) != n:
        raise ValueError(f"{reward}: gold column {column!r} has {len(gold)} values for {n} completions")
    return gold


def _answer_text(text: str, answer_tag: str | None) -> str | None:
    return text if answer_tag is None else extract_section(text, answer_tag)


def _numbers_equal(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    if rel_tol <= 0:
        return a == b
    return abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))


@dataclass(frozen=True)
class _Grading:
    """How a correctness reward reads an answer and scores it: its factory's keywords."""

    letters: str  # the choice letters a gold or an answer may be; "" = numbers only
    answer_tag: str | None  # the answer is this section's text; None = the whole completion
    require_boxed: bool  # a choice counts only as \boxed{X}, not as a bare letter
    rel_tol: float  # numbers this close (relative) count as equal; 0 = exactly
    correct: float  # the reward of a right answer
    incorrect: float  # the reward of a wrong answer, or of none


def _score(text: str, gold: ParsedGold, grading: _Grading) -> float:
    answer = _answer_text(text, grading.answer_tag)
    if answer is None:  # no answer section: nothing was answered
        return grading.incorrect
    if gold.kind == "choice":
        hit = extract_choice(answer, grading.letters, require_boxed=grading.require_boxed) == gold.value
    else:
        value, tolerance = extract_number(answer), grading.rel_tol
        hit = value is not None and _numbers_equal(value, gold.value, tolerance)  # type: ignore[arg-type]
    return grading.correct if hit else grading.incorrect


def _make(metric: str, kinds: frozenset[str], gold_column: str, grading: _Grading) -> RewardFunction:
    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        golds = _gold_column(kwargs, gold_column, len(completions), metric)
        out: list[RewardValue] = []
        for text, raw in zip(texts(completions), golds):
            gold = parse_gold(raw, grading.letters)
            if gold is None or gold.kind not in kinds:
                out.append(None)
                continue
            out.append(_score(text, gold, grading))
        return out

    return named(reward, metric)


def multiple_choice(
    letters: str = DEFAULT_LETTERS,
    gold_column: str = "answer",
    answer_tag: str | None = "answer",
    require_boxed: bool = True,
    correct: float = 1.0,
    incorrect: float = 0.0,
) -> RewardFunction:
    """`correct` when the answer section's last `\\boxed{X}` (or, with `require_boxed=False`, a bare
    letter) equals the gold letter, else `incorrect`; None where the gold is missing or not a letter."""
    grading = _Grading(letters=letters, answer_tag=answer_tag, require_boxed=require_boxed, rel_tol=0.0,
                       correct=correct, incorrect=incorrect)
    return _make("multiple_choice", frozenset({"choice"}), gold_column, grading)


def numeric(
    gold_column: str = "answer",
    answer_tag: str | None = "answer",
    rel_tol: float = 0.0,
    correct: float = 1.0,
    incorrect: float = 0.0,
) -> RewardFunction:
    """`correct` when the answer section's number (last `\\boxed{}`, else last number) equals the gold
    number exactly (0.5 = 1/2 = .50; "1,234" = 1234) or within `rel_tol`; None where the gold is missing
    or not a number."""
    grading = _Grading(letters="", answer_tag=answer_tag, require_boxed=True, rel_tol=rel_tol,
                       correct=correct, incorrect=incorrect)
    return _make("numeric", frozenset({"number"}), gold_column, grading)


def correctness(
    letters: str = DEFAULT_LETTERS,
    gold_column: str = "answer",
    answer_tag: str | None = "answer",
    require_boxed: bool = True,
    rel_tol: float = 0.0,
    correct: float = 1.0,
    incorrect: float = 0.0,
) -> RewardFunction:
    """Dispatch on each row's gold: a letter → `multiple_choice`, a number → `numeric`; None where the gold
    is missing or unparseable (see `parse_gold`)."""
    grading = _Grading(letters=letters, answer_tag=answer_tag, require_boxed=require_boxed, rel_tol=rel_tol,
                       correct=correct, incorrect=incorrect)
    return _make("correctness", frozenset({"choice", "number"}), gold_column, grading)
