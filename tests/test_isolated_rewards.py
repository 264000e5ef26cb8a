"""Rewards marked `isolated: true` run in a worker process: a call past its timeout ends the work (the worker
is killed), where a plain reward's timed-out call is abandoned in a thread that goes on; errors and values
come back."""

from __future__ import annotations

import math
import time

import pytest

from grpo_core.config import ConfigError, config_from_dict
from grpo_core.rewards import build_reward_functions, score_completions


def slow(name: str, marker, isolated: bool, seconds: float = 2.0) -> dict:
    return {"name": name, "function": "tests.reward_helpers:sleeps_then_marks", "isolated": isolated,
            "kwargs": {"marker": str(marker), "seconds": seconds}}


def test_a_timed_out_isolated_reward_is_killed_a_threaded_one_goes_on(tmp_path):
    fns = build_reward_functions([slow("isolated", tmp_path / "isolated", True),
                                  slow("threaded", tmp_path / "threaded", False)])
    fns[0].start()  # the worker imports the reward outside the timed call
    scores = score_completions(fns, ["p", "q"], ["a", "b"], {}, on_error="none", timeout_s=0.5)
    assert scores.timeout_counts["isolated"] >= 1 and scores.timeout_counts["threaded"] >= 1
    assert all(math.isnan(v) for v in scores.rewards.ravel())
    time.sleep(2.5)  # long enough for either call to have finished its sleep
    assert (tmp_path / "threaded").exists()        # the abandoned thread did its work anyway
    assert not (tmp_path / "isolated").exists()    # the killed worker did not


def test_an_isolated_reward_answers_raises_and_recovers(tmp_path):
    quick, failing = build_reward_functions([
        slow("quick", tmp_path / "q", True, seconds=0.0),
        {"name": "bug", "function": "tests.reward_helpers:raises_value_error", "isolated": True},
    ])
    assert quick(["p", "q"], ["a", "b"]) == [1.0, 1.0] and (tmp_path / "q").exists()
    scores = score_completions([quick, failing], ["p"], ["a"], {}, on_error="none", timeout_s=30)
    assert (scores.rewards[0, 0] == 1.0 and math.isnan(scores.rewards[0, 1])
            and scores.error_counts["bug"] == 1)
    with pytest.raises(Exception, match=r"reward 'bug' \(isolated\) raised ValueError: a bug in the reward"):
        score_completions([failing], ["p"], ["a"], {}, on_error="raise", timeout_s=30)
    quick.stop()  # killed between calls: the next call starts a fresh worker
    assert quick(["p"], ["a"]) == [1.0]


def test_isolated_is_a_checked_key():
    raw = {"data": {"train_files": ["t.jsonl"]}, "rewards": [{"name": "c", "function": "correctness",
                                                             "isolated": "yes"}]}
    with pytest.raises(ConfigError, match=r"rewards\[0\].isolated: expected true or false"):
        config_from_dict(raw)


def test_async_rewards_run_together_and_a_timeout_cancels_the_work(tmp_path):
    waiter, freer, late = build_reward_functions([
        {"name": "waiter", "function": "tests.reward_helpers:waits_for_partner"},
        {"name": "freer", "function": "tests.reward_helpers:frees_partner", "clip": [0.0, 0.25]},
        {"name": "late", "function": "tests.reward_helpers:sleeps_then_marks_async",
         "kwargs": {"marker": str(tmp_path / "late"), "seconds": 1.0}},
    ])
    # the waiter is listed first: awaited one after the other it would wait out its timeout
    scores = score_completions([waiter, freer, late], ["p", "q"], ["a", "b"], {}, on_error="none",
                               timeout_s=0.3)
    assert (scores.rewards[:, 0].tolist() == [1.0, 1.0]
            and scores.rewards[:, 1].tolist() == [0.25, 0.25])  # clipped
    assert all(math.isnan(v) for v in scores.rewards[:, 2]) and scores.timeout_counts["late"] == 1
    time.sleep(1.2)
    assert not (tmp_path / "late").exists()  # cancelled at its await, never finished
