"""The math_verify reward (Hugging Face's math-verify): a table of answer/gold pairs, equal and unequal, in
the answer section and in a whole completion; golds that do not parse; and the reward wired into validate's
gold check and evaluation's correctness judge."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from grpo_core.rewards import build_reward_functions  # noqa: E402
from grpo_core.rewards.judges import build_judges  # noqa: E402
from grpo_core.rewards.math import math_verify, parse_math_gold  # noqa: E402


def section(body: str) -> str:
    return f"<reasoning>\nwork\n</reasoning>\n<answer>\n{body}\n</answer>"


# (gold, the answer section's text, equal?)
SECTION_PAIRS = [
    # GSM8K golds and thousands separators
    ("#### 72", "72", True), ("#### 72", "73", False), ("#### 1,234", "1234", True),
    ("#### 1234", "1,234", True), ("#### 1,000,000", "1000000", True), ("#### 1,000,000", "100000", False),
    ("#### -5", "-5", True), ("#### -5", "5", False), ("#### 0", "0", True), ("#### 18", "18.0", True),
    ("#### 18", "18.5", False), ("42", "$42$", True), ("42", r"\boxed{42}", True),
    ("42", r"The answer is \boxed{24}", False),
    # fractions, decimals, roots, powers
    (r"\frac{1}{2}", "0.5", True), (r"\frac{1}{2}", r"\frac{2}{4}", True),
    (r"\frac{1}{2}", r"\dfrac{1}{2}", True), (r"\frac{1}{2}", "1/2", True),
    (r"\frac{1}{2}", r"\frac{1}{3}", False), (r"\frac{3}{4}", "0.75", True),
    (r"\frac{3}{4}", "0.7", False), ("3/4", r"\frac{3}{4}", True), (r"\sqrt{2}", r"2^{1/2}", True),
    (r"\sqrt{2}", r"\sqrt{3}", False), (r"2\sqrt{3}", r"\sqrt{12}", True), (r"\sqrt{8}", r"2\sqrt{2}", True),
    ("2^{10}", "1024", True), ("2^{10}", "1000", False), (r"-\frac{7}{3}", r"-\frac{14}{6}", True),
    (r"\frac{-7}{3}", r"\frac{7}{3}", False),
    # boxed golds and boxed answers
    (r"$\boxed{5}$", "5", True), (r"$\boxed{5}$", r"\boxed{6}", False),
    (r"$\boxed{\frac{1}{3}}$", r"\boxed{\frac{1}{3}}", True),
    # expressions
    ("$x^2+2x+1$", "$(x+1)^2$", True), ("$x^2+2x+1$", "$(x-1)^2$", False), ("$2x$", "$x+x$", True),
    ("$3a+2b$", "$2b+3a$", True), ("$3a+2b$", "$3a-2b$", False), (r"$\pi$", r"$\pi$", True),
    (r"$2\pi$", r"$\pi + \pi$", True), (r"$\pi$", "3", False),
    # sets and intervals
    (r"$\{1,2,3\}$", r"$\{3,2,1\}$", True), (r"$\{1,2,3\}$", r"$\{1,2\}$", False),
    (r"$[0,1)$", "$[0, 1)$", True), (r"$(0,1)$", "$[0,1]$", False),
    (r"$(-\infty, 2]$", r"$(-\infty,2]$", True), (r"$(-\infty, 2]$", r"$(-\infty,2)$", False),
    (r"$[1,5]$", r"$[1,5]$", True), ("$x=2$", "$2$", True),
    # percentages and units
    (r"50\%", "50", True), (r"50\%", r"50\%", True), (r"50\%", "40", False), (r"12.5\%", r"12.5\%", True),
    ("10 cm", r"$10\text{ cm}$", True), ("10", r"$10\text{ meters}$", True),
    ("10", r"$11\text{ meters}$", False),
    # plain numbers in other spellings
    ("0.25", r"\frac{1}{4}", True), ("0.25", ".25", True), ("0.25", "0.26", False), ("100", "100.00", True),
    ("3.0", "3", True), ("-0.5", r"-\frac{1}{2}", True), ("-0.5", r"\frac{1}{2}", False),
    ("#### 1,234", "1243", False), (r"\sqrt{8}", r"3\sqrt{2}", False), ("$2x$", "$x^2$", False),
]

# (gold, the whole completion, equal?): without an answer section only an anchored answer counts
WHOLE_PAIRS = [
    ("72", r"so the total is \boxed{72}.", True), ("72", r"First 70, then \boxed{72}", True),
    ("72", r"\boxed{71}", False), (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{3}}", True),
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{2}}", False), ("12", "The final answer is $12$.", True),
    ("12", "The final answer is $13$.", False),
]


@pytest.mark.parametrize(("gold", "answer", "equal"), SECTION_PAIRS)
def test_answer_sections(gold, answer, equal):
    reward = math_verify(correct=1.0, incorrect=0.0)
    assert reward([""], [section(answer)], answer=[gold]) == [1.0 if equal else 0.0]


@pytest.mark.parametrize(("gold", "completion", "equal"), WHOLE_PAIRS)
def test_whole_completions(gold, completion, equal):
    reward = math_verify(answer_tag=None)
    assert reward([""], [completion], answer=[gold]) == [1.0 if equal else 0.0]


def test_the_table_is_large_and_balanced():
    pairs = SECTION_PAIRS + WHOLE_PAIRS
    assert len(pairs) >= 60
    assert sum(e for *_, e in pairs) >= 25 and sum(not e for *_, e in pairs) >= 25


def test_values_golds_that_do_not_parse_and_chat_completions():
    reward = math_verify(correct=2.0, incorrect=-1.0, gold_column="solution")
    chat = [[{"role": "assistant", "content": section("7")}],
            [{"role": "assistant", "content": "no tags, 7"}],
            [{"role": "assistant", "content": section("7")}],
            [{"role": "assistant", "content": section("7")}]]
    assert reward([""] * 4, chat, solution=["7", "7", "no number here", None]) == [2.0, -1.0, None, None]
    assert parse_math_gold("#### 1,234")[0] == 1234 and parse_math_gold("banana") is None
    with pytest.raises(KeyError, match="no gold column 'answer'"):
        math_verify()([""], ["x"], solution=["1"])


def test_it_is_a_built_in_and_judges_correctness_in_evaluation():
    from grpo_core.rewards.base import RewardSpec

    spec = RewardSpec(name="math", function="math_verify", kwargs={"correct": 3.0})
    (fn,) = build_reward_functions([spec])
    judges = build_judges([RewardSpec(name="fmt", function="soft_format"), spec])
    assert judges.correct_value == 3.0
    assert judges.is_correct(judges.correct_fn([""], [section(r"\frac{1}{2}")], answer=["0.5"])[0])


def test_validate_accepts_latex_golds_under_math_verify():
    import pandas as pd

    from flows.stages.validate import gold_parser
    from grpo_core.config import config_from_dict
    from grpo_core.data.validation import ValidationRules, validate_frames

    frame = pd.DataFrame({"prompt": ["a", "b", "c"], "answer": [r"\frac{1}{2}", r"$[0,1)$", "#### 1,234"]})
    raw = {"data": {"train_files": ["t.jsonl"]}, "rewards": [{"name": "m", "function": "math_verify"}]}
    cfg = config_from_dict(raw)
    fns = build_reward_functions(cfg.rewards)
    report = validate_frames(frame, None, ValidationRules(require_answer=True, reward_fns_for_gold=fns,
                                                          parse_gold=gold_parser(cfg)))
    assert report.ok, report.to_text()
    numeric = config_from_dict({**raw, "rewards": [{"name": "n", "function": "numeric"}]})
    strict = validate_frames(frame, None,
                             ValidationRules(require_answer=True, parse_gold=gold_parser(numeric)))
    assert not strict.ok and "gold_parseable" in strict.to_text()
