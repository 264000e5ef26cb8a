"""compute_advantages: hand-worked numbers, the claims practitioners argue about, None handling, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_core.advantages import compute_advantages

NAN = math.nan
EPS = 1e-4


def rewards_tensor(rows):
    return torch.tensor(rows, dtype=torch.float64)


def assert_close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# --- hand-worked examples -----------------------------------------------------------------------------------

# Two groups of G=3, one reward function:
#   group 0: [1, 2, 6]  mean 3, deviations [-2, -1, 3], var = (4 + 1 + 9) / (3 - 1) = 7,  std = sqrt(7)
#   group 1: [0, 0, 3]  mean 1, deviations [-1, -1, 2], var = (1 + 1 + 4) / (3 - 1) = 3,  std = sqrt(3)
#   batch:   [1, 2, 6, 0, 0, 3]  mean 2, deviations [-1, 0, 4, -2, -2, 1], var = 26 / 5 = 5.2
TWO_GROUPS = [[1.0], [2.0], [6.0], [0.0], [0.0], [3.0]]


def test_group_scale_hand_worked():
    advantages = compute_advantages(rewards_tensor(TWO_GROUPS), [1.0], group_size=3, scale="group")
    s0, s1 = math.sqrt(7) + EPS, math.sqrt(3) + EPS
    assert_close(advantages, [-2 / s0, -1 / s0, 3 / s0, -1 / s1, -1 / s1, 2 / s1])


def test_batch_scale_keeps_group_mean_and_divides_by_batch_std():
    advantages = compute_advantages(rewards_tensor(TWO_GROUPS), [1.0], group_size=3, scale="batch")
    # numerators are the per-group deviations; the denominator is the batch std sqrt(5.2) (+ eps)
    s = math.sqrt(5.2) + EPS
    assert_close(advantages, [-2 / s, -1 / s, 3 / s, -1 / s, -1 / s, 2 / s])


def test_no_scale_is_the_group_centred_reward():
    advantages = compute_advantages(rewards_tensor(TWO_GROUPS), [1.0], group_size=3, scale="none")
    assert_close(advantages, [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0])


def test_weights_none_entries_and_unscorable_row_hand_worked():
    # G=4, K=2, weights (2, 0.5). Weighted NaN-sums:
    #   [1, NaN] -> 2*1 = 2        (the NaN term contributes nothing)
    #   [0, 2]   -> 0 + 0.5*2 = 1
    #   [NaN, NaN] -> unscorable: out of the statistics, advantage 0
    #   [1, 1]   -> 2 + 0.5 = 2.5
    # scorable [2, 1, 2.5]: mean 11/6, deviations [1/6, -5/6, 4/6],
    #   var = (1 + 25 + 16) / 36 / (3 - 1) = 7/12
    rewards = rewards_tensor([[1.0, NAN], [0.0, 2.0], [NAN, NAN], [1.0, 1.0]])
    advantages = compute_advantages(rewards, torch.tensor([2.0, 0.5]), group_size=4)
    s = math.sqrt(7 / 12) + EPS
    assert_close(advantages, [(1 / 6) / s, (-5 / 6) / s, 0.0, (4 / 6) / s])


def test_normalize_then_sum_hand_worked():
    # GDPO, G=2, two groups, K=2, weights (1, 1). With two values a, b: std = |a - b| / sqrt(2).
    #   group 0, f0 [1, 0]: z = +-0.5 / (1/sqrt(2) + eps) =: +-z0      f1 [0, 0]: equal -> 0, 0
    #   group 1, f0 [1, 1]: 0, 0                                      f1 [5, 3]: z = +-1 / (sqrt(2) + eps) =:
    #   +-z1
    # sums s = [z0, -z0, z1, -z1]; batch mean 0, batch var = (2 z0^2 + 2 z1^2) / 3; A = s / (std + eps)
    rewards = rewards_tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 5.0], [1.0, 3.0]])
    advantages = compute_advantages(rewards, [1.0, 1.0], group_size=2, aggregation="normalize_then_sum")
    z0, z1 = 0.5 / (1 / math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)
    s = math.sqrt((2 * z0**2 + 2 * z1**2) / 3) + EPS
    assert_close(advantages, [z0 / s, -z0 / s, z1 / s, -z1 / s])


def test_normalize_then_sum_ignores_scale_like_trl():
    # TRL 1.16 reads scale_rewards only in sum_then_normalize; GDPO always ends with a batch z-score.
    rewards = rewards_tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 5.0], [1.0, 3.0]])
    results = [
        compute_advantages(rewards, [1.0, 1.0], 2, scale=scale, aggregation="normalize_then_sum")
        for scale in ("group", "batch", "none")
    ]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# --- the claims practitioners argue about -------------------------------------------------------------------


def test_plus_minus_one_and_one_zero_rewards_give_the_same_advantages():
    # {1, -1} is 2 * {1, 0} - 1: a positive affine map. A = (r - mean) / (std + eps) = z * std / (std + eps),
    # with z the exact z-score, so the two differ only through eps / std: 1e-4 / sqrt(1/3) ~ 1.7e-4 relative.
    plus_minus = rewards_tensor([[1.0], [-1.0], [1.0], [-1.0]])
    one_zero = rewards_tensor([[1.0], [0.0], [1.0], [0.0]])
    a_pm = compute_advantages(plus_minus, [1.0], group_size=4)
    a_10 = compute_advantages(one_zero, [1.0], group_size=4)
    torch.testing.assert_close(a_pm, a_10, rtol=2e-4, atol=0)
    # and exactly (to float precision) once eps is out of the way
    torch.testing.assert_close(
        compute_advantages(plus_minus, [1.0], 4, eps=0.0), compute_advantages(one_zero, [1.0], 4, eps=0.0)
    )
    # the value itself: deviations +-0.5 over std sqrt((4 * 0.25) / 3) = sqrt(1/3) -> +-0.866
    assert_close(a_10, [0.5 / (math.sqrt(1 / 3) + EPS), -0.5 / (math.sqrt(1 / 3) + EPS)] * 2)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_positive_affine_transform_leaves_advantages_unchanged(aggregation):
    torch.manual_seed(0)
    rewards = torch.randn(8, 1, dtype=torch.float64)
    transformed = 3.7 * rewards + 11.0
    a = compute_advantages(rewards, [1.0], 4, aggregation=aggregation)
    b = compute_advantages(transformed, [1.0], 4, aggregation=aggregation)
    # only eps breaks the invariance: relative change of order eps / std (std ~ 1 here, ~3.7 after)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(
        compute_advantages(rewards, [1.0], 4, eps=0.0, aggregation=aggregation),
        compute_advantages(transformed, [1.0], 4, eps=0.0, aggregation=aggregation),
    )


def test_negative_scale_flips_the_advantages():
    torch.manual_seed(1)
    rewards = torch.randn(8, 1, dtype=torch.float64)
    a = compute_advantages(rewards, [1.0], 4)
    flipped = compute_advantages(-2.0 * rewards + 5.0, [1.0], 4)
    torch.testing.assert_close(flipped, -a, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_equal_rewards_give_exactly_zero(scale, aggregation):
    # 0.1 three times: the float mean is 0.30000000000000004 / 3 = 0.10000000000000002, not 0.1,
    # so a naive (r - mean) / (0 + eps) gives ~ -1.4e-13 instead of 0.
    rewards = rewards_tensor([[0.1, 0.7]] * 3 + [[0.1, 0.7]] * 3)
    assert rewards[:3, 0].mean() != 0.1  # the float trap the implementation has to avoid
    advantages = compute_advantages(rewards, [1.0, 1.0], 3, scale=scale, aggregation=aggregation)
    assert torch.equal(advantages, torch.zeros(6, dtype=torch.float64))


def test_group_with_equal_rewards_is_zero_while_others_learn():
    rewards = rewards_tensor([[0.1], [0.1], [0.1], [1.0], [0.0], [0.2]])
    advantages = compute_advantages(rewards, [1.0], 3)
    assert torch.equal(advantages[:3], torch.zeros(3, dtype=torch.float64))
    assert (advantages[3:] != 0).all()


# --- None (NaN) handling ------------------------------------------------------------------------------------


def test_none_in_one_function_contributes_nothing_to_the_sum():
    # sum_then_normalize: a NaN term is skipped, which for a scorable row is the same as a 0 term.
    with_none = rewards_tensor([[1.0, NAN], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    with_zero = rewards_tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    assert torch.equal(
        compute_advantages(with_none, [1.0, 1.0], 4), compute_advantages(with_zero, [1.0, 1.0], 4)
    )


def test_unscorable_row_is_not_a_zero_reward():
    # Row 2 scored by nobody: advantage 0, and the others are normalised over rows 0, 1, 3 only.
    # Had it counted as reward 0, the group mean would move and every other advantage with it.
    unscorable = compute_advantages(rewards_tensor([[1.0], [0.0], [NAN], [1.0]]), [1.0], 4)
    as_zero = compute_advantages(rewards_tensor([[1.0], [0.0], [0.0], [1.0]]), [1.0], 4)
    # scorable [1, 0, 1]: mean 2/3, deviations [1/3, -2/3, 1/3], var = (1 + 4 + 1) / 9 / 2 = 1/3
    s = math.sqrt(1 / 3) + EPS
    assert_close(unscorable, [(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s])
    assert not torch.allclose(unscorable[[0, 1, 3]], as_zero[[0, 1, 3]])


def test_normalize_then_sum_skips_a_function_scored_once_in_a_group():
    # f1 scores only row 1 of group 0: no std there, so f1 adds nothing to group 0 (as if all NaN).
    once = rewards_tensor([[1.0, NAN], [0.0, 7.0], [1.0, 2.0], [0.0, 1.0]])
    never = rewards_tensor([[1.0, NAN], [0.0, NAN], [1.0, 2.0], [0.0, 1.0]])
    a_once = compute_advantages(once, [1.0, 1.0], 2, aggregation="normalize_then_sum")
    a_never = compute_advantages(never, [1.0, 1.0], 2, aggregation="normalize_then_sum")
    torch.testing.assert_close(a_once, a_never)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_group_with_one_scorable_row_gives_zero_not_nan(scale, aggregation):
    # group 0: one scorable row; group 1: none; group 2: rows 6, 7 scorable.
    # GDPO (as TRL): row 0 is scorable, its lone z-score is NaN and skipped, so its sum is 0, which is
    # also the batch mean of [0, +z, -z]: advantage 0 here too, by this construction.
    rewards = rewards_tensor([[3.0], [NAN], [NAN], [NAN], [NAN], [NAN], [1.0], [0.0], [NAN]])
    advantages = compute_advantages(rewards, [1.0], 3, scale=scale, aggregation=aggregation)
    assert torch.isfinite(advantages).all()
    assert advantages[0] == 0 and torch.equal(advantages[1:6], torch.zeros(5, dtype=torch.float64))
    assert advantages[6] > 0 > advantages[7] and advantages[8] == 0


def test_all_unscorable_batch_is_all_zero():
    rewards = torch.full((4, 2), NAN, dtype=torch.float64)
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        assert torch.equal(
            compute_advantages(rewards, [1.0, 1.0], 2, aggregation=aggregation), torch.zeros(4).double()
        )


def test_dtype_device_and_sequence_weights():
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.float32)
    advantages = compute_advantages(rewards, (1.0,), 2)
    assert advantages.dtype == torch.float32 and advantages.shape == (2,)
    # integer rewards are accepted (as float)
    assert compute_advantages(torch.tensor([[1], [0]]), [1.0], 2).is_floating_point()


# --- bad inputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"rewards": torch.zeros(4)}, "rewards"),
        ({"rewards": torch.zeros(4, 0)}, "rewards"),
        ({"weights": [1.0, 1.0, 1.0]}, "weights"),
        ({"weights": [[1.0, 1.0]]}, "weights"),
        ({"weights": [1.0, NAN]}, "weights"),
        ({"group_size": 3}, "group_size"),
        ({"group_size": 1}, "group_size"),
        ({"group_size": 2.0}, "group_size"),
        ({"scale": "sequence"}, "scale"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs, named):
    arguments = {"rewards": torch.zeros(4, 2), "weights": [1.0, 1.0], "group_size": 2} | kwargs
    with pytest.raises(ValueError, match=named):
        compute_advantages(**arguments)


def test_error_message_carries_the_value():
    with pytest.raises(ValueError, match="'sequence'"):
        compute_advantages(torch.zeros(4, 1), [1.0], 2, scale="sequence")
    with pytest.raises(ValueError, match="N=5"):
        compute_advantages(torch.zeros(5, 1), [1.0], 2)


# --- properties ---------------------------------------------------------------------------------------------

reward_values = st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.just(NAN), st.sampled_from([0.0, 1.0]))


@st.composite
def reward_batches(draw):
    group_size = draw(st.integers(2, 4))
    num_groups = draw(st.integers(1, 3))
    num_functions = draw(st.integers(1, 3))
    values = draw(
        st.lists(
            reward_values,
            min_size=group_size * num_groups * num_functions,
            max_size=group_size * num_groups * num_functions,
        )
    )
    weights = draw(
        st.lists(st.floats(-3, 3, allow_nan=False), min_size=num_functions, max_size=num_functions)
    )
    rewards = torch.tensor(values, dtype=torch.float64).view(group_size * num_groups, num_functions)
    return rewards, weights, group_size


@settings(max_examples=40, deadline=None)
@given(
    batch=reward_batches(),
    scale=st.sampled_from(["group", "batch", "none"]),
    aggregation=st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
)
def test_finite_inputs_give_finite_advantages(batch, scale, aggregation):
    rewards, weights, group_size = batch
    advantages = compute_advantages(rewards, weights, group_size, scale=scale, aggregation=aggregation)
    assert advantages.shape == (rewards.shape[0],)
    assert torch.isfinite(advantages).all()
    # unscorable rows are exactly 0
    assert (advantages[torch.isnan(rewards).all(dim=1)] == 0).all()


@settings(max_examples=40, deadline=None)
@given(batch=reward_batches(), scale=st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_sum_to_zero(batch, scale):
    # sum_then_normalize subtracts each group's mean over its scorable rows, so they sum to 0 per group
    rewards, weights, group_size = batch
    advantages = compute_advantages(rewards, weights, group_size, scale=scale)
    group_sums = advantages.view(-1, group_size).sum(dim=1)
    magnitude = 1.0 if scale != "none" else 1.0 + rewards.nan_to_num().abs().max().item() * 9
    assert group_sums.abs().max() <= 1e-9 * magnitude * group_size
