"""Guards: each fires on the metric it watches, with the configured action, and only then."""

import math

import pytest

from grpo_core.config import ConfigError, config_from_dict
from grpo_core.train.guards import (
    GuardMonitor,
    GuardsConfig,
    NonFiniteGuard,
    RewardHackingGuard,
    RewardSilentGuard,
    ThresholdGuard,
    decide,
)

CALM = {"loss": 0.01, "grad_norm": 0.5, "kl": 0.02, "entropy": 1.5, "completions/clipped_ratio": 0.0,
        "rewards/format/mean": 0.5, "rewards/correctness/mean": 0.5}


def test_calm_metrics_raise_nothing():
    cfg = GuardsConfig(kl_max=ThresholdGuard(1.0, "stop"), entropy_min=ThresholdGuard(0.1, "stop"),
                       clipped_ratio_max=ThresholdGuard(0.5, "stop"))
    assert GuardMonitor(cfg).check(1, CALM) == []


@pytest.mark.parametrize("key, value, cfg_kwargs, guard", [
    ("kl", 1.5, {"kl_max": ThresholdGuard(1.0, "rollback")}, "kl_max"),
    ("entropy", 0.05, {"entropy_min": ThresholdGuard(0.1, "stop")}, "entropy_min"),
    ("completions/clipped_ratio", 0.9, {"clipped_ratio_max": ThresholdGuard(0.5, "skip_step")},
     "clipped_ratio_max"),
])
def test_threshold_guards_fire_with_their_action(key, value, cfg_kwargs, guard):
    cfg = GuardsConfig(**cfg_kwargs)
    (event,) = GuardMonitor(cfg).check(7, {**CALM, key: value})
    assert event.guard == guard and event.action == getattr(cfg, guard).action
    assert "step 7" in event.message and f"{value:.6g}" in event.message


def test_a_window_guard_ignores_a_one_step_spike_and_acts_on_a_sustained_level():
    """window 5: the median of the last five steps. The KL trace of a real run (embedded default, seed 11)
    with its one-step estimator spike of 4.12 at step 45 passes; a run whose KL stays above the threshold is
    caught on the third high step of five."""
    mon = GuardMonitor(GuardsConfig(kl_max=ThresholdGuard(2.0, "rollback", window=5)))
    calm_with_spike = [0.05, 0.08, 0.11, 0.07, 4.12, 0.09, 0.1, 0.06, 0.08, 0.07]
    assert [mon.check(s, {**CALM, "kl": kl}) for s, kl in enumerate(calm_with_spike, start=41)] == [[]] * 10
    drifting = [2.5, 3.0, 2.8]   # the third: window [0.08, 0.07, 2.5, 3.0, 2.8], median 2.5
    events = [mon.check(s, {**CALM, "kl": kl}) for s, kl in enumerate(drifting, start=51)]
    assert events[:2] == [[], []]
    (event,) = events[2]
    assert event.guard == "kl_max" and event.action == "rollback"
    assert event.message == ("step 53: median kl of the last 5 steps 2.5 (this step 2.8) is above the "
                             "threshold 2")
    mon.reset_history()  # after a rollback the window restarts: four high values are not yet a full window
    assert all(mon.check(s, {**CALM, "kl": 3.0}) == [] for s in range(48, 52))
    assert mon.check(52, {**CALM, "kl": 3.0})[0].guard == "kl_max"


def test_window_one_is_each_step_alone_and_a_window_is_validated():
    mon = GuardMonitor(GuardsConfig(entropy_min=ThresholdGuard(0.1, "warn")))
    assert (mon.check(1, {**CALM, "entropy": 0.05})[0].message
            == "step 1: entropy=0.05 is below the threshold 0.1")
    with pytest.raises(ConfigError, match="guards.kl_max.window"):
        config_from_dict({"data": {"train_files": ["x.jsonl"]}, "rewards": [{"name": "a", "function": "b"}],
                          "guards": {"kl_max": {"threshold": 1.0, "window": 0}}})


def test_threshold_none_means_off():
    assert GuardMonitor(GuardsConfig()).check(1, {**CALM, "kl": 1e9, "entropy": 0.0}) == []


@pytest.mark.parametrize("bad", [{"loss": math.nan}, {"grad_norm": math.inf}])
def test_nonfinite_always_checked(bad):
    (event,) = GuardMonitor(GuardsConfig(nonfinite=NonFiniteGuard("skip_step"))).check(3, {**CALM, **bad})
    assert event.guard == "nonfinite" and event.action == "skip_step" and "not finite" in event.message


def test_nonfinite_cannot_be_set_to_warn():
    with pytest.raises(ConfigError, match="guards.nonfinite.action: 'warn' is not allowed"):
        config_from_dict({"data": {"train_files": ["x.jsonl"]}, "rewards": [{"name": "a", "function": "b"}],
                          "guards": {"nonfinite": {"action": "warn"}}})


def test_reward_hacking_needs_format_up_and_correctness_down():
    g = RewardHackingGuard(format_reward="format", correctness_reward="correctness", window=3,
                           format_rise=0.2, correctness_drop=0.1, action="stop")
    mon = GuardMonitor(GuardsConfig(reward_hacking=g))
    # window 1: format 0.5, correctness 0.6; window 2: format 0.8 (+0.3), correctness 0.45 (-0.15) -> fires
    steps = [(0.5, 0.6)] * 3 + [(0.8, 0.45)] * 3
    events = [mon.check(i, {**CALM, "rewards/format/mean": f, "rewards/correctness/mean": c})
              for i, (f, c) in enumerate(steps, 1)]
    assert events[:5] == [[]] * 5
    assert events[5][0].guard == "reward_hacking" and events[5][0].action == "stop"

    # both rising is learning, not hacking
    mon = GuardMonitor(GuardsConfig(reward_hacking=g))
    steps = [(0.5, 0.4)] * 3 + [(0.8, 0.7)] * 3
    assert all(mon.check(i, {**CALM, "rewards/format/mean": f, "rewards/correctness/mean": c}) == []
               for i, (f, c) in enumerate(steps, 1))


def test_most_severe_action_decides():
    cfg = GuardsConfig(kl_max=ThresholdGuard(1.0, "warn"), entropy_min=ThresholdGuard(0.1, "rollback"),
                       nonfinite=NonFiniteGuard("skip_step"))
    events = GuardMonitor(cfg).check(2, {**CALM, "kl": 5.0, "entropy": 0.0, "loss": math.nan})
    assert {e.guard for e in events} == {"kl_max", "entropy_min", "nonfinite"}
    assert decide(events).guard == "entropy_min"
    assert decide([]) is None


def test_a_reward_scoring_nothing_for_n_steps_in_a_row_fires_naming_it():
    """NaN (every value None/NaN/failed) counts; two silent steps then a scored one start the count over."""
    monitor = GuardMonitor(GuardsConfig(reward_silent=RewardSilentGuard(steps=3, action="stop")))
    silent = {**CALM, "rewards/format/mean": math.nan}
    assert monitor.check(1, silent) == [] and monitor.check(2, silent) == []
    assert monitor.check(3, CALM) == []  # format scored something: the count starts over
    assert monitor.check(4, silent) == [] and monitor.check(5, {**silent, "rewards/format/mean": None}) == []
    (event,) = monitor.check(6, silent)
    assert (event.guard, event.action) == ("reward_silent", "stop")
    assert (event.message.startswith("step 6: reward 'format' scored none of the completions")
            and "3 steps" in event.message)
    monitor.reset_history()  # a rollback: the steps counted no longer exist
    assert monitor.check(7, silent) == []


def test_the_silent_reward_guard_is_on_by_default_and_null_turns_it_off():
    assert GuardsConfig().reward_silent == RewardSilentGuard(steps=3, action="stop")
    off = GuardMonitor(GuardsConfig(reward_silent=RewardSilentGuard(steps=None)))
    assert all(off.check(s, {**CALM, "rewards/correctness/mean": math.nan}) == [] for s in range(1, 10))
    with pytest.raises(ConfigError, match="guards.reward_silent.steps: 0 is out of range"):
        config_from_dict({"guards": {"reward_silent": {"steps": 0}}})
