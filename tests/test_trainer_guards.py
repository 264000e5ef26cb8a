"""Guards acting inside the loop: skip_step keeps updates out, stop names the guard, rollback restores."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config import config_from_dict
from grpo_core.train.guards import GuardStop
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, nan_loss_at

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def cfg_with(assets, guards: dict, **train):
    model_dir, data = assets
    return config_from_dict({
        "data": {"train_files": [str(data)], "eval_files": [str(data)], "max_prompt_length": 48},
        "model": {"name_or_path": str(model_dir)},
        "generation": {"max_completion_length": 8},
        "rewards": DIGITS,
        "train": {"learning_rate": 3e-3, "num_generations": 4, "per_device_train_batch_size": 16,
                  "output_dir": "out", "save_steps": 100,
                  **train},
        "guards": guards,
    })


def rows(root):
    with open(root / "metrics/train_log.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_skip_step_keeps_flagged_updates_out_of_the_weights(assets, tmp_path):
    # step 1: policy == reference, kl = 0, not above 1e-9: applied. Every later step has kl > 0: skipped.
    guards = {"kl_max": {"threshold": 1e-9, "action": "skip_step"}}
    one = train(cfg_with(assets, guards, max_steps=1, beta=0.1), root=tmp_path / "one", progress=False)
    four = train(cfg_with(assets, guards, max_steps=4, beta=0.1), root=tmp_path / "four", progress=False)
    a, b = load_file(one.model_dir / "model.safetensors"), load_file(four.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [float(r["guard/skipped"]) for r in rows(tmp_path / "four")] == [0, 1, 1, 1]


def test_stop_raises_naming_the_guard_and_exports_nothing(assets, tmp_path):
    guards = {"entropy_min": {"threshold": 100.0, "action": "stop"}}
    with pytest.raises(GuardStop,
                       match=r"guard entropy_min stopped training: step 1: entropy=.* below the threshold "
                             r"100"):
        train(cfg_with(assets, guards, max_steps=3), root=tmp_path, progress=False)
    assert not (tmp_path / "out/model").exists()


def test_rollback_restores_the_last_checkpoint_and_cools_the_learning_rate(assets, tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, {4})  # the 4th micro-batch = step 4 (one micro-batch per step)
    guards = {"nonfinite": {"action": "rollback"}, "rollback_lr_factor": 0.5, "max_rollbacks": 1}
    res = train(cfg_with(assets, guards, max_steps=6, save_steps=2), root=tmp_path, progress=False)
    log = rows(tmp_path)
    assert [r["step"] for r in log] == ["1", "2", "3", "4", "5", "6"]  # step 3 redone after the rollback to 2
    lrs = [float(r["learning_rate"]) for r in log]
    assert lrs[:2] == [3e-3, 3e-3] and lrs[2:] == [1.5e-3] * 4
    state = json.loads((res.checkpoint_dir / "checkpoint-6/trainer_state.json").read_text())
    assert state["rollbacks"] == 1


def test_rollback_limit_turns_into_a_stop(assets, tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, {3})
    guards = {"nonfinite": {"action": "rollback"}, "max_rollbacks": 0}
    with pytest.raises(GuardStop, match="guard nonfinite stopped training: step 3: loss=nan is not finite"):
        train(cfg_with(assets, guards, max_steps=4, save_steps=2), root=tmp_path, progress=False)


def test_nan_loss_is_never_trained_on(assets, tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, {2})
    res = train(cfg_with(assets, {"nonfinite": {"action": "skip_step"}}, max_steps=3), root=tmp_path,
                progress=False)
    weights = load_file(res.model_dir / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert [float(r["guard/skipped"]) for r in rows(tmp_path)] == [0, 1, 0]


def test_length_blow_up_guard_stops_on_completions_hitting_the_limit(assets, tmp_path):
    # a random tiny model rarely emits EOS within 8 tokens: most completions hit max_completion_length
    guards = {"clipped_ratio_max": {"threshold": 0.5, "action": "stop"}}
    with pytest.raises(GuardStop, match=r"guard clipped_ratio_max stopped training: step 1: "
                                        r"clipped_ratio=.* is above the threshold 0.5; "
                                        r"no checkpoint had been written yet"):
        train(cfg_with(assets, guards, max_steps=3), root=tmp_path, progress=False)


def test_reward_hacking_guard_fires_when_format_rises_while_correctness_falls(assets, tmp_path):
    model_dir, data = assets
    cfg = config_from_dict({
        "data": {"train_files": [str(data)], "eval_files": [str(data)], "max_prompt_length": 48},
        "model": {"name_or_path": str(model_dir)},
        "generation": {"max_completion_length": 8},
        "rewards": [{"name": "format", "function": "tests.reward_helpers:format_rising"},
                    {"name": "correctness", "function": "tests.reward_helpers:correctness_falling"}],
        "train": {"learning_rate": 3e-3, "num_generations": 4, "per_device_train_batch_size": 16,
                  "output_dir": "out", "save_steps": 100,
                  "max_steps": 10},
        "guards": {"reward_hacking": {"format_reward": "format", "correctness_reward": "correctness",
                                      "window": 2, "format_rise": 0.1, "correctness_drop": 0.1,
                                      "action": "stop"}},
    })
    # windows of 2 steps: steps 1-2 vs 3-4 -> format +0.2, correctness -0.2: fires at step 4
    with pytest.raises(GuardStop, match=r"guard reward_hacking stopped training: step 4: "):
        train(cfg, root=tmp_path, progress=False)
    assert [int(r["step"]) for r in rows(tmp_path)] == [1, 2, 3]


def test_a_reward_that_scores_nothing_stops_the_run_naming_it(assets, tmp_path):
    """NaN for every row counts as "no score": without the guard training goes on with zero advantages from
    it. The default guard stops at the 3rd such step in a row, before its update, naming the reward."""
    model_dir, data = assets
    cfg = config_from_dict({
        "data": {"train_files": [str(data)], "eval_files": [str(data)], "max_prompt_length": 48},
        "model": {"name_or_path": str(model_dir)},
        "generation": {"max_completion_length": 8},
        "rewards": [*DIGITS, {"name": "broken", "function": "tests.reward_helpers:all_nan"}],
        "train": {"learning_rate": 3e-3, "num_generations": 4, "per_device_train_batch_size": 16,
                  "output_dir": "out", "save_steps": 100, "max_steps": 5, "reward_weights": [1.0, 1.0]},
    })
    with pytest.raises(GuardStop, match=r"guard reward_silent stopped training: step 3: reward 'broken' "
                                        r"scored none of the completions .* for 3 steps in a row"):
        train(cfg, root=tmp_path, progress=False)
    assert [r["rewards/broken/mean"] for r in rows(tmp_path)] == ["nan", "nan"]
