"""The weights a run trains with come from one rule (grpo_core/train/reward_weights.py), applied by
`dvc repro`'s train stage and by grpo_core's train() alike: pinned train.reward_weights, else calibrate's
file, else 1 each (the stage requires the file)."""

from __future__ import annotations

import json

import pytest

from flows.stages import common
from grpo_core.common.errors import InputUnreadable
from grpo_core.train.checkpoint import latest_checkpoint, load_checkpoint
from grpo_core.train.loop import train
from grpo_core.train.options import training_params_hash
from grpo_core.train.reward_weights import CALIBRATION_WEIGHTS, CalibrationMismatch, training_reward_weights
from tests.tiny import make_prompts, make_tiny_model, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


def write_calibration(root, names, weights):
    path = root / CALIBRATION_WEIGHTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"names": names, "weights_list": weights}))


def test_the_rule_pinned_then_calibrated_then_equal(tmp_path):
    assert common.CALIBRATION_WEIGHTS == CALIBRATION_WEIGHTS   # the stages name the file calibrate writes
    assert training_reward_weights(["a", "b"], None, tmp_path) == ([1.0, 1.0], "equal (no calibration file, "
                                                                                 "train.reward_weights null)")
    with pytest.raises(InputUnreadable,
                       match=f"{CALIBRATION_WEIGHTS}: missing; it is written by the `calibrate`"):
        training_reward_weights(["a", "b"], None, tmp_path, calibration_required=True)
    write_calibration(tmp_path, ["a", "b"], [0.75, 0.25])
    assert training_reward_weights(["a", "b"], None, tmp_path) == ([0.75, 0.25], CALIBRATION_WEIGHTS)
    assert training_reward_weights(["a", "b"], [2, 3], tmp_path) == ([2.0, 3.0], "train.reward_weights")
    with pytest.raises(CalibrationMismatch, match=r"calibrated for rewards \['a', 'b'\], but params.yaml "
                                                  r"names \['a', 'c'\]; re-run `dvc repro calibrate`"):
        training_reward_weights(["a", "c"], None, tmp_path)
    (tmp_path / CALIBRATION_WEIGHTS).write_text("{not json")
    with pytest.raises(InputUnreadable, match="unreadable calibration weights"):
        training_reward_weights(["a", "b"], None, tmp_path)


@pytest.mark.parametrize("pinned", [None, [0.5]])
def test_core_train_applies_the_calibrated_or_pinned_weights_as_the_stage_does(tmp_path, pinned):
    """A Python user calling train(cfg) gets the run `dvc repro` makes: the checkpoint's params hash carries
    the weights trained with - calibrate's 0.25 when nothing is pinned, the pinned 0.5 otherwise (never 1)."""
    model_dir = make_tiny_model(tmp_path / "model")
    data = make_prompts(tmp_path / "prompts.jsonl", n=16)
    write_calibration(tmp_path, ["digits"], [0.25])
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=1, save_steps=1, reward_weights=pinned)
    train(cfg, root=tmp_path, progress=False, export=False)
    state = load_checkpoint(latest_checkpoint(tmp_path / "out" / "checkpoints")).state
    expected = pinned or [0.25]
    assert state["params_hash"] == training_params_hash(cfg, expected)
    assert state["params_hash"] != training_params_hash(cfg, [1.0])
