"""Math answers checked by Hugging Face's ``math-verify`` (the verifier of TRL's ``accuracy_reward`` and
open-r1): LaTeX (``\\frac``, ``\\sqrt``, ``\\boxed{}``), sets and intervals, percentages, units, ``#### N``
and thousands separators, compared symbolically with sympy.

The gold is parsed as it is; the model's answer is read from its answer section (``<answer>…</answer>``, where
any expression counts) or, with ``answer_tag=None``, from the whole completion, where only an anchored answer
counts (``\\boxed{}`` first, then "the final answer is …", as TRL's ``accuracy_reward``). A gold that does not
parse gives None ("does not apply"), as in TRL.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import extract_section


def _require_math_verify():
    try:
        import math_verify  # noqa: F401
    except ImportError as err:
        raise ImportError("the math_verify reward needs the math-verify package: pip install "
                          "'math-verify[antlr4_9_3]' (make setup installs it)") from err


def _timeouts(seconds: float) -> dict[str, int | None]:
    """math-verify times out with SIGALRM (whole seconds), which only the main thread may set: elsewhere (a
    reward timed out by the trainer runs in a worker thread) its own limit is off and the trainer's
    reward_timeout_s bounds the call."""
    limit = (math.ceil(seconds) if threading.current_thread() is threading.main_thread() and seconds > 0
             else None)
    return {"parsing_timeout": limit}


def parse_math_gold(raw: Any, timeout_s: float = 5.0) -> list | None:
    """The gold as math-verify parses it (sympy expression and its text), None when it does not parse."""
    from math_verify import parse

    if raw is None or (isinstance(raw, float) and raw != raw):
        return None
    return _first_parse(str(raw), lambda text: parse(text, **_timeouts(timeout_s))) or None


def _first_parse(text: str, parse_one) -> list:
    """Bare LaTeX (``\\sqrt{2}``, ``2^{10}`` with no ``$``) parses only between math delimiters, so such text
    is tried as ``$text$`` first; otherwise, and when that finds nothing, the text as it is."""
    if "$" not in text and any(mark in text for mark in ("\\", "^", "{")):
        parsed = parse_one(f"${text.strip()}$")
        if parsed:
            return parsed
    return parse_one(text)


def _parse_answer(text: str, anchored: bool, timeout_s: float) -> list:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                    boxed_match_priority=0, try_extract_without_anchor=not anchored),
              ExprExtractionConfig(try_extract_without_anchor=not anchored)]
    def parse_one(candidate: str) -> list:
        return parse(candidate, extraction_config=config, extraction_mode="first_match",
                     **_timeouts(timeout_s))

    return parse_one(text) if anchored else _first_parse(text, parse_one)


def math_verify(gold_column: str = "answer", answer_tag: str | None = "answer", correct: float = 1.0,
                incorrect: float = 0.0, timeout_s: float = 5.0) -> RewardFunction:
    """`correct` when math-verify finds the answer equal to the gold, else `incorrect` (also when there is no
    answer section or nothing parses in it); None where the gold is missing or does not parse. timeout_s: the
    limit of each parse and comparison (sympy can be slow on adversarial input; main thread only)."""
    _require_math_verify()

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        from math_verify import verify

        if gold_column not in kwargs:
            raise KeyError(f"math_verify: no gold column {gold_column!r} among the reward columns "
                           f"{sorted(kwargs)}")
        golds: dict[tuple[str, str], list | None] = {}  # a prompt's G completions share one gold: parsed once
        limit = _timeouts(timeout_s)["parsing_timeout"]
        out: list[RewardValue] = []
        for text, raw in zip(texts(completions), kwargs[gold_column], strict=True):
            key = (type(raw).__name__, str(raw))
            if key not in golds:
                golds[key] = parse_math_gold(raw, timeout_s)
            gold = golds[key]
            if gold is None:
                out.append(None)
                continue
            section = text if answer_tag is None else extract_section(text, answer_tag)
            answer = _parse_answer(section, answer_tag is None, timeout_s) if section is not None else []
            hit = bool(answer) and verify(gold, answer, timeout_seconds=limit)
            out.append(correct if hit else incorrect)
        return out

    return named(reward, "math_verify")
