"""Reward statistics and the weight rule, against numbers worked out by hand or by a second method."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from grpo_core.calibration import (
    calibrate_weights,
    pass_rates,
    realised_shares,
    reward_statistics,
    select_training_prompts,
    within_group_variance,
)

NAMES = ["correctness", "format", "constant"]


def constructed() -> np.ndarray:
    """G=4, two prompts, three rewards with zero within-group covariance between correctness and format.

    correctness: [1,0,1,0] and [1,1,0,0]  -> each group var (Bessel) = 4 * 0.25 / 3 = 1/3   -> v_c = 1/3
    format:      [0,0,4,4] and [0,4,4,0]  -> each group var = 4 * 4 / 3 = 16/3             -> v_f = 16/3
    constant:    0.5 everywhere            -> var 0: dead
    centred correctness . centred format = 0 in both groups, so the diagonal rule is exact here.
    """
    c = [1, 0, 1, 0, 1, 1, 0, 0]
    f = [0, 0, 4, 4, 0, 4, 4, 0]
    k = [0.5] * 8
    return np.array([c, f, k], dtype=float).T


def test_a_single_reward_is_not_flagged_dominant():
    """One reward (the SmolLM2 recipe's correctness alone) carries 100% of the variance: no warning for that;
    nor when the only other reward is dead."""
    one = calibrate_weights(constructed()[:, :1], 4, ["correctness"], [1.0], dead_std_threshold=1e-6,
                            dominant_share=0.9, correctness_index=0)
    assert one["flags"] == {"correctness": []} and one["warnings"] == []
    assert one["weights"]["correctness"] == pytest.approx(1.0)
    with_dead = calibrate_weights(constructed()[:, [0, 2]], 4, ["correctness", "constant"], [0.8, 0.2],
                                  dead_std_threshold=1e-6, dominant_share=0.9, correctness_index=0)
    assert with_dead["flags"] == {"correctness": [], "constant": ["dead"]}


def test_weight_rule_on_constructed_case():
    out = calibrate_weights(constructed(), 4, NAMES, [0.6, 0.2, 0.2], dead_std_threshold=1e-6,
                            dominant_share=0.9, correctness_index=0)
    # constant is dead -> its 0.2 is redistributed: effective shares 0.6/0.8 = 0.75 and 0.2/0.8 = 0.25.
    # raw weights sqrt(s/v): correctness sqrt(0.75 / (1/3)) = 1.5; format sqrt(0.25 / (16/3)) = sqrt(3)/8.
    # scaled so the live weights sum to the configured total 0.6 + 0.2 + 0.2 = 1.0.
    raw_c, raw_f = 1.5, math.sqrt(3) / 8
    assert out["weights"]["correctness"] == pytest.approx(raw_c / (raw_c + raw_f))
    assert out["weights"]["format"] == pytest.approx(raw_f / (raw_c + raw_f))
    assert out["weights"]["constant"] == 0.0
    assert out["weights_list"] == [out["weights"][n] for n in NAMES]
    assert sum(out["weights_list"]) == pytest.approx(1.0)
    # under uniform weights format carries 16/3 / (16/3 + 1/3) = 16/17 = 0.941 > 0.9: dominant
    assert out["shares"]["approx_uniform"]["format"] == pytest.approx(16 / 17)
    assert out["flags"] == {"correctness": [], "format": ["dominant"], "constant": ["dead"]}
    # the chosen weights hit the effective targets; with zero covariance the realised shares agree
    assert (out["target_shares"]["effective"]
            == pytest.approx({"correctness": 0.75, "format": 0.25, "constant": 0.0}))
    assert out["shares"]["approx_chosen"]["correctness"] == pytest.approx(0.75)
    assert out["shares"]["realised_chosen"]["correctness"] == pytest.approx(0.75)
    assert out["shares"]["realised_chosen"]["format"] == pytest.approx(0.25)
    assert "sqrt(s_k / v_k)" in out["rule"]
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN anywhere


def test_statistics_by_hand():
    stats = reward_statistics(constructed(), 4, NAMES, correctness_index=0)
    c = stats["per_function"]["correctness"]
    assert c["mean"] == pytest.approx(0.5)
    assert c["std"] == pytest.approx(math.sqrt(8 * 0.25 / 7))  # ddof=1 over 8 values
    assert c["mean_within_group_var"] == pytest.approx(1 / 3)
    assert c["mean_within_group_std"] == pytest.approx(math.sqrt(1 / 3))
    assert c["zero_variance_group_fraction"] == 0.0
    k = stats["per_function"]["constant"]
    assert k["mean_within_group_std"] == 0.0 and k["zero_variance_group_fraction"] == 1.0
    assert (stats["correlation"]["correctness"]["format"]
            == pytest.approx(np.corrcoef(constructed()[:, :2].T)[0, 1]))
    assert stats["correlation"]["constant"]["format"] is None  # undefined for a constant
    assert stats["correlation_with_correctness"]["correctness"] == pytest.approx(1.0)
    assert stats["difficulty"]["pass_rate_per_prompt"] == [0.5, 0.5]


def test_nan_handling_and_none_fraction():
    # G=3, 2 prompts; reward b is None for three samples, leaving group 2 with one valid value
    a = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    b = [2.0, np.nan, 4.0, np.nan, 5.0, np.nan]
    stats = reward_statistics(np.array([a, b]).T, 3, ["a", "b"])
    pb = stats["per_function"]["b"]
    assert pb["none_fraction"] == pytest.approx(0.5)
    assert pb["num_groups_with_variance"] == 1  # group 2 has a single valid value: no std
    assert pb["mean_within_group_var"] == pytest.approx(2.0)  # var([2, 4], ddof=1)
    pa = stats["per_function"]["a"]
    assert pa["zero_variance_group_fraction"] == pytest.approx(0.5)  # group 2 = [1, 1, 1]
    # pairwise-complete correlation: rows 0, 2, 4 -> a = [1, 0, 1], b = [2, 4, 5]
    assert stats["correlation"]["a"]["b"] == pytest.approx(np.corrcoef([1, 0, 1], [2, 4, 5])[0, 1])


def test_within_group_variance_matches_numpy():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(24, 3))
    r[rng.random(r.shape) < 0.2] = np.nan
    got = within_group_variance(r, 6)
    for p in range(4):
        for k in range(3):
            vals = r[p * 6:(p + 1) * 6, k]
            vals = vals[~np.isnan(vals)]
            want = np.var(vals, ddof=1) if vals.size > 1 else np.nan
            np.testing.assert_allclose(got[p, k], want, equal_nan=True)


def test_realised_shares_include_covariance():
    # second method: per-group covariance matrices, Euler allocation w_k (C w)_k / w'Cw summed over groups
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 1))
    r = np.hstack([x, x + 0.5 * rng.normal(size=(40, 1)), rng.normal(size=(40, 1))])  # a, b correlated
    w = np.array([1.0, 0.5, 2.0])
    num, den = np.zeros(3), 0.0
    for p in range(5):
        cov = np.cov(r[p * 8:(p + 1) * 8].T)
        num += w * (cov @ w)
        den += w @ cov @ w
    np.testing.assert_allclose(realised_shares(r, 8, w), num / den)
    assert realised_shares(r, 8, w).sum() == pytest.approx(1.0)


def test_realised_shares_nan_rules():
    # G=3, one prompt. Row 2 is unscorable (all NaN): left out. Row 1 has b = None: counts as 0 in R.
    r = np.array([[1.0, 2.0], [0.0, np.nan], [np.nan, np.nan]])
    w = np.array([1.0, 1.0])
    kept = np.array([[1.0, 2.0], [0.0, 0.0]])  # what compute_advantages sums over
    cov = np.cov(kept.T)
    np.testing.assert_allclose(realised_shares(r, 3, w), w * (cov @ w) / (w @ cov @ w))


def test_difficulty_profile_and_selection():
    # G=4: prompt 0 always solved, 1 never, 2 half, 3 all None
    corr = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1] + [np.nan] * 4, dtype=float)
    fmt = np.linspace(0, 1, 16)
    out = calibrate_weights(np.array([corr, fmt]).T, 4, ["c", "f"], [0.8, 0.2], correctness_index=0)
    d = out["difficulty"]
    assert d["pass_rate_per_prompt"] == [1.0, 0.0, 0.5, None]
    assert d["always_solved"] == 1 and d["never_solved"] == 1 and d["unknown"] == 1
    assert d["histogram"]["pass_rate"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert d["histogram"]["count"] == [1, 0, 1, 0, 1]
    rates = d["pass_rate_per_prompt"]
    assert select_training_prompts(rates, False, False) == [0, 1, 2, 3]
    assert select_training_prompts(rates, True, False) == [1, 2, 3]
    assert select_training_prompts(rates, True, True) == [2, 3]  # unknown rates are kept
    # pass threshold: 0.9 does not pass by default, does with a lower threshold
    np.testing.assert_array_equal(pass_rates(np.array([0.9, 1.0]), 2), [0.5])
    np.testing.assert_array_equal(pass_rates(np.array([0.9, 1.0]), 2, threshold=0.5), [1.0])


def test_dead_correctness_warns_and_all_dead_keeps_the_configured_shares():
    r = np.array([[0, 0, 0, 0], [1, 0, 1, 0]], dtype=float).T  # correctness never solved, format varies
    out = calibrate_weights(r, 2, ["c", "f"], [0.8, 0.2], correctness_index=0)
    assert out["weights"] == {"c": 0.0, "f": pytest.approx(1.0)}  # f gets the whole configured total
    assert any("correctness function 'c' is dead" in w for w in out["warnings"])
    dead = calibrate_weights(np.ones((4, 2)), 2, ["c", "f"], [0.8, 0.2])
    assert dead["weights_list"] == [0.8, 0.2] and dead["flags"] == {"c": ["dead"], "f": ["dead"]}
    assert dead["target_shares"]["effective"] == {"c": pytest.approx(0.8), "f": pytest.approx(0.2)}
    assert any("configured target shares" in w for w in dead["warnings"])
    lone = calibrate_weights(np.zeros((4, 1)), 4, ["c"], [1.0], correctness_index=0)  # never solved
    assert lone["weights_list"] == [1.0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rewards": np.zeros((6, 2)), "group_size": 4}, "multiple of group_size"),
    ({"rewards": np.zeros((4, 3))}, "3 columns but 2 names"),
    ({"target_shares": [0.5]}, "one per reward"),
    ({"target_shares": [-1.0, 1.0]}, ">= 0"),
    ({"correctness_index": 5}, "out of range"),
])
def test_input_errors_name_the_problem(kwargs, match):
    args = {"rewards": np.zeros((4, 2)), "group_size": 2, "names": ["a", "b"], "target_shares": [0.5, 0.5]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        calibrate_weights(args.pop("rewards"), args.pop("group_size"), args.pop("names"),
                          args.pop("target_shares"), **args)
