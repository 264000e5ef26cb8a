"""pass@k against brute-force enumeration, evaluation summaries and deltas worked out by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from grpo_core.evaluation import compare, eval_report, pass_at_k, summarize_evaluation


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of k-subsets of n samples (c correct) that contain at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_closed_forms_and_large_n():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c/n
    assert pass_at_k(200, 1, 10) == pytest.approx(1 - math.comb(199, 10) / math.comb(200, 10))
    assert pass_at_k(1000, 0, 100) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair has a correct sample


@pytest.mark.parametrize(("n", "c", "k", "err"), [
    (4, 1, 5, ValueError), (4, 5, 1, ValueError), (4, 1, 0, ValueError), (0, 0, 1, ValueError),
    (4.0, 1, 1, TypeError),
])
def test_pass_at_k_rejects_bad_arguments(n, c, k, err):
    with pytest.raises(err):
        pass_at_k(n, c, k)


def make_frame() -> pd.DataFrame:
    """3 prompts: one greedy row each, 4 sampled rows each."""
    rows = []
    greedy_correct = [True, False, True]
    sampled_correct = [[True, False, False, False], [False] * 4, [True, True, True, False]]
    for p in range(3):
        rows.append({"prompt_index": p, "sample_index": 0, "mode": "greedy", "correct": greedy_correct[p],
                     "reward/correctness": float(greedy_correct[p]), "reward/format": [1.0, np.nan, 0.5][p],
                     "format_ok": [True, True, False][p], "completion_length": [10, 20, 30][p]})
        for s, ok in enumerate(sampled_correct[p]):
            rows.append({"prompt_index": p, "sample_index": s, "mode": "sampled", "correct": ok,
                         "reward/correctness": float(ok), "reward/format": 1.0, "format_ok": True,
                         "completion_length": 8})
    return pd.DataFrame(rows)


def test_summarize_evaluation_by_hand():
    out = summarize_evaluation(make_frame(), [1, 2, 4], ["correctness", "format"])
    assert out["num_prompts"] == 3 and out["num_samples_per_prompt"] == 4
    assert out["accuracy"] == pytest.approx(2 / 3)
    # per prompt (n=4): c = 1, 0, 3
    assert out["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert out["pass@2"] == pytest.approx((1 - math.comb(3, 2) / 6 + 0 + 1.0) / 3)  # c=3: n-c=1 < 2 -> 1
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["rewards/correctness/mean"] == pytest.approx(2 / 3)
    assert out["rewards/format/mean"] == pytest.approx(0.75)  # NaN ignored: mean(1.0, 0.5)
    assert out["format_compliance"] == pytest.approx(2 / 3)
    assert out["mean_completion_length"] == pytest.approx(20.0)
    assert out["sampled/rewards/correctness/mean"] == pytest.approx(4 / 12)
    assert out["sampled/mean_completion_length"] == pytest.approx(8.0)


def test_summarize_evaluation_errors_and_missing_modes():
    df = make_frame()
    with pytest.raises(ValueError, match="pass@8 needs >= 8"):
        summarize_evaluation(df, [8], ["correctness"])
    with pytest.raises(ValueError, match=r"lacks columns \['reward/length'\]"):
        summarize_evaluation(df, [1], ["length"])
    with pytest.raises(ValueError, match="duplicate"):
        summarize_evaluation(pd.concat([df, df.iloc[:1]]), [1], ["correctness"])
    only_greedy = summarize_evaluation(df[df["mode"] == "greedy"], [1, 4], ["correctness"])
    assert only_greedy["pass@4"] is None and only_greedy["accuracy"] == pytest.approx(2 / 3)
    only_sampled = summarize_evaluation(df[df["mode"] == "sampled"], [1], ["correctness"])
    assert only_sampled["accuracy"] is None and only_sampled["rewards/correctness/mean"] is None


def test_compare_and_report():
    base = {"accuracy": 0.25, "pass@4": 0.5, "num_prompts": 3, "flag": True, "name": "x", "gone": 1.0,
            "nested": {"a": 1.0, "b": None}, "missing": None}
    trained = {"accuracy": 0.75, "pass@4": 0.5, "num_prompts": 3, "flag": False, "name": "y",
               "nested": {"a": 3.5, "b": 2.0}, "missing": 1.0}
    delta = compare(base, trained)
    assert delta == {"accuracy": 0.5, "nested": {"a": 2.5}, "num_prompts": 0.0, "pass@4": 0.0}
    report = eval_report(base, trained, model="m")
    assert report["base"] == base and report["trained"] == trained and report["delta"] == delta
    assert report["model"] == "m"
