"""Reward functions: hand-worked values for every built-in, numeric equivalence, resolution, scoring."""

from __future__ import annotations

import math
import threading
import time
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

from grpo_core.rewards import (
    BUILTINS,
    RewardConfigError,
    RewardFunctionError,
    build_reward_functions,
    clip_reward,
    correctness,
    keyword_hits,
    multiple_choice,
    numeric,
    overlong_penalty,
    parse_gold,
    reasoning_length,
    score_completions,
    soft_format,
    strict_format,
    xml_count,
)
from grpo_core.rewards.base import named

GOOD = "<reasoning>\nadd them\n</reasoning>\n<answer>\n42\n</answer>"


def call(fn, completions, **columns):
    return fn(prompts=["q"] * len(completions), completions=completions, **columns)


def answer(text: str) -> str:
    return f"<reasoning>\nwork\n</reasoning>\n<answer>\n{text}\n</answer>"


# Functions named by import path in the tests below (module-level so that `module:function` resolves).
def length_reward(prompts, completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


def raises_on_bad(prompts, completions, **kwargs):
    if any("bad" in c for c in completions):
        raise ValueError("saw a bad completion")
    return [1.0] * len(completions)


# --- format ---------------------------------------------------------------------------------------


def test_strict_format():
    fn = strict_format()
    texts = [
        GOOD,
        GOOD + "\n",  # one final newline allowed
        "<reasoning>\na\nb\n</reasoning>\n<answer>\n1\n</answer>",  # multi-line reasoning
        "x" + GOOD,  # text before
        GOOD + "\nmore",  # text after
        "<reasoning>add</reasoning>\n<answer>\n42\n</answer>",  # no newlines inside the tags
        "<answer>\n42\n</answer>",
    ]
    assert call(fn, texts) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    think = strict_format(reward=0.5, reasoning_tag="think")
    assert call(think, ["<think>\nx\n</think>\n<answer>\n1\n</answer>", GOOD]) == [0.5, 0.0]


def test_soft_format():
    fn = soft_format()
    texts = [
        "<reasoning>a</reasoning><answer>1</answer>",
        "  <reasoning>a</reasoning>\n\n<answer>1</answer> trailing text is fine",
        "<answer>1</answer><reasoning>a</reasoning>",  # wrong order
        "<reasoning>a</reasoning> then <answer>1</answer>",  # text between the sections
        "<reasoning>a<answer>1</answer>",
    ]
    assert call(fn, texts) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert call(
        soft_format(reward=0.25, answer_tag="final"), ["<reasoning>a</reasoning><final>1</final>"]
    ) == [0.25]


def test_xml_count_by_hand():
    fn = xml_count()
    texts = [
        GOOD,  # 4 tags × 0.125
        GOOD + "\n",  # the final newline is free
        GOOD + "\nabc",  # 3 trailing chars after the newline: 0.5 - 0.003
        "add them\n</reasoning>\n<answer>\n42\n</answer>",  # no opening reasoning tag: 0.375
        "<reasoning>\n<reasoning>\nx\n</reasoning>\n<answer>\n42\n</answer>",  # opening tag twice: 0.375
        "nothing",
    ]
    assert call(fn, texts) == pytest.approx([0.5, 0.5, 0.497, 0.375, 0.375, 0.0])
    assert call(xml_count(per_tag=1.0, trailing_penalty=0.1), [GOOD + "\nab"]) == pytest.approx([3.8])


# --- length and keywords -----------------------------------------------------------------------------


def test_reasoning_length_bands():
    fn = reasoning_length(bands=[[0, 4, 0.2], [5, 10, 1.0]], default=-0.5, missing=None)
    texts = [
        "<reasoning>\nabc\n</reasoning>",  # 3 chars (stripped) → first band
        "<reasoning>abcdefg</reasoning>",  # 7 chars → second band
        "<reasoning>" + "x" * 11 + "</reasoning>",  # 11 → no band → default
        "no reasoning at all",  # missing → None
    ]
    assert call(fn, texts) == [0.2, 1.0, -0.5, None]
    words = reasoning_length(bands=[[2, None, 1.0]], unit="words")
    assert call(words, ["<reasoning>one</reasoning>", "<reasoning>one two three</reasoning>", "x"]) == [
        0.0,
        1.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="band"):
        reasoning_length(bands=[[1, 2]])


def test_keyword_hits_capped():
    fn = keyword_hits(keywords=["because", "therefore"], per_hit=0.3, cap=0.5)
    texts = [
        "because x, therefore y",  # 2 hits × 0.3 = 0.6 → cap 0.5
        "Because of that",  # case-insensitive: 0.3
        "becauseX is not the word",  # whole words only: 0
        "because because because",  # distinct keywords: 1 hit
    ]
    assert call(fn, texts) == pytest.approx([0.5, 0.3, 0.0, 0.3])
    repeats = keyword_hits(keywords=["because"], per_hit=0.1, cap=1.0, count_repeats=True)
    assert call(repeats, ["because because because"]) == pytest.approx([0.3])
    section = keyword_hits(keywords=["sum"], per_hit=1.0, cap=1.0, section="reasoning")
    assert call(section, ["<reasoning>the sum</reasoning><answer>x</answer>", "sum <answer>x</answer>"]) == [
        1.0,
        0.0,
    ]
    with pytest.raises(ValueError):
        keyword_hits(keywords=[])


def test_overlong_penalty_dapo():
    fn = overlong_penalty(max_completion_length=100, cache_length=20)
    # free up to 80 tokens, then linear to -1 at 100, -1 beyond
    lengths = [10, 80, 81, 90, 100, 101]
    expected = [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    assert call(fn, ["c"] * 6, completion_lengths=lengths) == pytest.approx(expected)
    assert call(fn, ["c"] * 6, completion_ids=[[1] * n for n in lengths]) == pytest.approx(expected)
    default_cache = overlong_penalty(max_completion_length=32)  # cache 8: free up to 24
    assert call(default_cache, ["c", "c"], completion_lengths=[24, 28]) == pytest.approx([0.0, -0.5])
    with pytest.raises(ValueError, match="completion_ids"):
        call(fn, ["c"])


# --- correctness ---------------------------------------------------------------------------------------

NUMERIC_EQUIVALENT = [
    ("0.5", "1/2"),
    ("0.5", ".50"),
    ("0.5", "0.50"),
    ("1/2", "0.5"),
    ("0.75", "\\frac{3}{4}"),
    ("1234", "1,234"),
    ("1,234", "1234"),
    ("1234567", "1,234,567"),
    ("-3", "-3.0"),
    ("-3", "\\boxed{-3}"),
    ("72", "$72"),
    ("18", "18."),
    ("#### 1,500", "1500"),  # GSM8K-style gold
]


@pytest.mark.parametrize(("gold", "said"), NUMERIC_EQUIVALENT)
def test_numeric_equivalence(gold, said):
    assert call(numeric(), [answer(said)], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("gold", "said"), [("0.5", "0.51"), ("1234", "1,235"), ("-3", "3"), ("12", "1,2")])
def test_numeric_mismatch(gold, said):
    assert call(numeric(), [answer(said)], answer=[gold]) == [0.0]


def test_numeric_reads_box_then_last_number_of_answer_section():
    fn = numeric()
    texts = [
        "<reasoning>\n3+4=7\n</reasoning>\n<answer>\nfirst 3, then 7 apples\n</answer>",  # last number: 7
        "<reasoning>\n7\n</reasoning>\n<answer>\n\\boxed{7} not 9\n</answer>",  # the box wins
        "<reasoning>\n7\n</reasoning>\n7",  # no answer section: not answered
        "<reasoning>\n45-38=7\n</reasoning>\n<answer>\n45-38=7\n</answer>",  # a minus between numbers
    ]
    assert call(fn, texts, answer=["7"] * 4) == [1.0, 1.0, 0.0, 1.0]
    whole = numeric(answer_tag=None)  # no tags: the whole completion
    assert call(whole, ["so it is 7"], answer=["7"]) == [1.0]


def test_multiple_choice():
    fn = multiple_choice()
    texts = [
        answer("\\boxed{B}"),
        answer("\\boxed{ B }"),
        answer("B"),  # not boxed
        "<reasoning>\n\\boxed{B}\n</reasoning>\n<answer>\n\\boxed{C}\n</answer>",  # only the answer counts
        answer("\\boxed{E}"),  # not a letter of ABCD
    ]
    assert call(fn, texts, answer=["B"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert call(multiple_choice(letters="ABCDE"), [answer("\\boxed{E}")], answer=["E"]) == [1.0]
    assert call(multiple_choice(require_boxed=False), [answer("(B)")], answer=["B"]) == [1.0]


def test_correctness_dispatches_on_gold_and_skips_missing_gold():
    fn = correctness()
    completions = [answer("\\boxed{A}"), answer("12"), answer("12"), answer("12"), answer("12"), answer("12")]
    golds = ["A", "12", None, float("nan"), "", "not a number"]
    assert call(fn, completions, answer=golds) == [1.0, 1.0, None, None, None, None]
    # the specialised built-ins leave the other kind of row alone
    assert call(multiple_choice(), [answer("12")], answer=["12"]) == [None]
    assert call(numeric(), [answer("\\boxed{A}")], answer=["A"]) == [None]
    with pytest.raises(KeyError, match="answer"):
        call(fn, [answer("12")], solution=["12"])
    assert call(correctness(gold_column="solution"), [answer("12")], solution=["12"]) == [1.0]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("B", ("choice", "B")),
        ("(C)", ("choice", "C")),
        ("\\boxed{D}", ("choice", "D")),
        ("42", ("number", Fraction(42))),
        (" 1,234 ", ("number", Fraction(1234))),
        ("#### 7", ("number", Fraction(7))),
        (3, ("number", Fraction(3))),
        (0.1, ("number", Fraction(1, 10))),
        ("E", None),
        ("seven", None),
        (None, None),
        (float("nan"), None),
        ("  ", None),
        (True, None),
    ],
)
def test_parse_gold(raw, expected):
    parsed = parse_gold(raw)
    assert (None if parsed is None else (parsed.kind, parsed.value)) == expected


def test_chat_completions_and_chat_prompts():
    prompts = [[{"role": "user", "content": "2+2?"}]]
    completions = [[{"role": "assistant", "content": answer("4")}]]
    for fn in (correctness(), strict_format(), soft_format(), xml_count()):
        assert fn(prompts=prompts, completions=completions, answer=["4"]) == [
            1.0 if fn.__name__ != "xml_count" else 0.5
        ]


# --- clipping, resolution, scoring --------------------------------------------------------------------


def test_clip_keeps_none_and_name():
    fn = clip_reward(reasoning_length(bands=[[0, 3, 5.0], [4, None, -5.0]], missing=None), [-1.0, 1.0])
    texts = ["<reasoning>ab</reasoning>", "<reasoning>abcdef</reasoning>", "none"]
    assert call(fn, texts) == [1.0, -1.0, None]
    assert fn.__name__ == "reasoning_length"
    with pytest.raises(ValueError):
        clip_reward(fn, [1.0, -1.0])


def spec(name, function, kwargs=None, clip=None):
    return SimpleNamespace(name=name, function=function, kwargs=kwargs or {}, target_share=1.0, clip=clip)


def test_build_reward_functions_names_kwargs_and_clip():
    fns = build_reward_functions(
        [
            spec("correct", "correctness"),
            spec("fmt", "soft_format", {"reward": 0.5}),
            spec(
                "length",
                "overlong_penalty",
                {"max_completion_length": 10, "cache_length": 5},
                clip=[-0.5, 0.0],
            ),
        ]
    )
    assert [f.__name__ for f in fns] == ["correct", "fmt", "length"]
    completions = [answer("3")]
    assert fns[0](prompts=["q"], completions=completions, answer=["3"]) == [1.0]
    assert fns[1](prompts=["q"], completions=["<reasoning>a</reasoning><answer>3</answer>"]) == [0.5]
    assert fns[2](prompts=["q"], completions=completions, completion_lengths=[20]) == [-0.5]  # -1 clipped
    dict_spec = build_reward_functions([{"name": "c", "function": "correctness"}])  # mappings work too
    assert dict_spec[0].__name__ == "c"


def test_unknown_builtin_names_closest_match_and_builtins():
    with pytest.raises(RewardConfigError) as err:
        build_reward_functions([spec("acc", "corectness")])
    message = str(err.value)
    assert "'acc'" in message and "'correctness'" in message
    assert all(name in message for name in BUILTINS)


def test_bad_kwargs_are_reported_with_the_parameters():
    with pytest.raises(RewardConfigError, match="reward_value|takes: reward"):
        build_reward_functions([spec("fmt", "soft_format", {"reward_value": 1.0})])
    with pytest.raises(RewardConfigError, match="duplicate"):
        build_reward_functions([spec("a", "soft_format"), spec("a", "strict_format")])


def test_import_path_binds_kwargs():
    (fn,) = build_reward_functions([spec("len", f"{__name__}:length_reward", {"scale": 2.0})])
    assert fn.__name__ == "len"
    assert fn(prompts=["q", "q"], completions=["ab", "abcd"]) == [4.0, 8.0]


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("no_such_package.rewards:fn", "cannot import module 'no_such_package.rewards'"),
        ("grpo_core.rewards:no_such_function", "has no attribute 'no_such_function'"),
        ("grpo_core.rewards:", "package.module:function"),
    ],
)
def test_import_path_that_does_not_resolve(path, match):
    with pytest.raises(RewardConfigError, match=match):
        build_reward_functions([spec("r", path)])


def test_score_completions_matrix_with_nan_for_none():
    fns = build_reward_functions([spec("correct", "correctness"), spec("fmt", "strict_format")])
    completions = [answer("1"), answer("2"), "garbage"]
    rewards, errors = score_completions(fns, ["q"] * 3, completions, {"answer": ["1", None, "3"]})
    assert rewards.shape == (3, 2) and rewards.dtype == np.float64
    assert rewards[0].tolist() == [1.0, 1.0]
    assert math.isnan(rewards[1, 0]) and rewards[1, 1] == 1.0
    assert rewards[2].tolist() == [0.0, 0.0]
    assert errors == {"correct": 0, "fmt": 0}


def test_score_completions_raising_function_in_both_modes():
    (fn,) = build_reward_functions([spec("fragile", f"{__name__}:raises_on_bad")])
    completions = ["ok", "bad", "ok", "bad"]
    with pytest.raises(RewardFunctionError, match=r"'fragile' raised on sample 1: ValueError: saw a bad"):
        score_completions([fn], ["q"] * 4, completions, {})
    rewards, errors = score_completions([fn], ["q"] * 4, completions, {}, on_error="none")
    assert rewards[[0, 2], 0].tolist() == [1.0, 1.0]
    assert np.isnan(rewards[[1, 3], 0]).all()
    assert errors == {"fragile": 2}


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, "x"], "returned 'x'"),
        ([1.0, float("inf")], "finite"),
        (1.0, "returned float"),
    ],
)
def test_score_completions_rejects_bad_returns(returned, match):
    def bad(prompts, completions, **kwargs):
        return returned

    with pytest.raises(RewardFunctionError, match=match) as err:
        score_completions([bad], ["q", "q"], ["a", "b"], {}, on_error="none")
    assert "'bad'" in str(err.value)


def test_score_completions_checks_lengths():
    with pytest.raises(ValueError, match="column 'answer'"):
        score_completions([correctness()], ["q"], ["a"], {"answer": ["1", "2"]})


def hangs_on_slow(prompts, completions, **kwargs):
    """Sleeps (far past any test timeout) when it sees 'slow'; 1.0 otherwise."""
    if any(c == "slow" for c in completions):
        threading.Event().wait(30)
    return [1.0] * len(completions)


def test_a_hanging_reward_times_out_scores_none_and_is_counted(caplog):
    fast = build_reward_functions([spec("fmt", "strict_format")])[0]
    hanging = named(hangs_on_slow, "hangs")
    started = time.perf_counter()
    with caplog.at_level("WARNING"):
        scored = score_completions([hanging, fast], ["q"] * 3, ["a", "slow", "c"], {}, timeout_s=0.3)
    elapsed = time.perf_counter() - started
    assert elapsed < 5  # the 30 s sleep was abandoned after 0.3 s
    assert np.isnan(scored.rewards[:, 0]).all()  # the whole hanging batch call scores None...
    assert scored.rewards[:, 1].tolist() == [0.0, 0.0, 0.0]  # ...and the other reward is unaffected
    assert scored.timeout_counts == {"hangs": 1, "fmt": 0}
    assert scored.error_counts == {"hangs": 0, "fmt": 0}
    assert "'hangs' did not return within 0.3s" in caplog.text


def test_timeout_in_the_per_sample_retry_hits_only_the_hanging_sample():
    def raises_on_batches_hangs_on_slow(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch")
        return hangs_on_slow(prompts, completions)

    fn = named(raises_on_batches_hangs_on_slow, "mixed")
    scored = score_completions([fn], ["q"] * 3, ["a", "slow", "c"], {}, timeout_s=0.3, on_error="none")
    assert scored.rewards[[0, 2], 0].tolist() == [1.0, 1.0]
    assert np.isnan(scored.rewards[1, 0])
    assert scored.timeout_counts == {"mixed": 1} and scored.error_counts == {"mixed": 0}


def test_a_reward_within_its_timeout_is_untouched_and_errors_still_propagate():
    (fn,) = build_reward_functions([spec("fragile", f"{__name__}:raises_on_bad")])
    rewards, errors = score_completions([fn], ["q"] * 2, ["ok", "ok"], {}, timeout_s=5)
    assert rewards[:, 0].tolist() == [1.0, 1.0] and errors == {"fragile": 0}
    with pytest.raises(RewardFunctionError, match="raised on sample 1"):
        score_completions([fn], ["q"] * 2, ["ok", "bad"], {}, timeout_s=5)
    with pytest.raises(ValueError, match="timeout_s must be >= 0"):
        score_completions([fn], ["q"], ["ok"], {}, timeout_s=-1)
