"""benchmarks/learning.py on a checkout whose params.yaml takes its data from reasoning-gym and scores with
the reasoning_gym reward: TRL's reward functions get the rows' task columns (task, task_config, metadata,
answer) as ours do, and one evaluator scores both sides as the evaluate stage does, per task too.

The tiny model answers nothing right, so what shows that the columns arrived is that the reward scored every
step's completions (0.0, a number) rather than giving None: a row without its task scores None, and a reward
called without the columns raises."""

from __future__ import annotations

import json
import os

import pytest

for _name in ("reasoning_gym", "trl"):
    try:
        __import__(_name)
    except ImportError as exc:  # the reasoning-gym extra and the dev extra's trl: CI must run this
        if os.environ.get("CI"):
            raise ImportError(f"CI must test the learning benchmark on reasoning-gym data, and {_name} is "
                              f"not installed ({exc}): make setup installs it") from exc
        pytest.skip(f"{_name} is not installed: {exc}", allow_module_level=True)


def reasoning_gym_checkout(root, monkeypatch):
    """A tiny checkout where prepare (reasoning-gym), convert, validate and calibrate ran: the inputs
    benchmarks/learning.py reads."""
    from flows.stages.__main__ import main
    from tests.test_reasoning_gym import SMALL_SUMS, tiny_params
    from tests.tiny import in_stage_repo, make_tiny_model

    make_tiny_model(root / "models" / "tiny")
    in_stage_repo(root, tiny_params([SMALL_SUMS]), monkeypatch, "test-learning-reasoning-gym")
    for stage in ("prepare", "convert", "validate", "calibrate"):
        assert main([stage]) == 0, stage
    return root


def test_both_sides_score_reasoning_gym_rows_and_report_per_task(tmp_path, monkeypatch):
    from benchmarks import learning

    root = reasoning_gym_checkout(tmp_path / "repo", monkeypatch)
    out = tmp_path / "x.json"
    assert learning.main(["--root", str(root), "--sides", "ours", "trl", "--seeds", "0", "--jobs", "1",
                          "--max-steps", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = {r["side"]: r for r in doc["runs"]}
    assert set(runs) == {"ours", "trl"}
    for side, run in runs.items():
        assert run["steps"] == 2, side
        # the evaluate stage's held-out accuracy over the 8 prompts, and its per-task metrics
        assert run["num_prompts"] == 8 and 0.0 <= run["accuracy"] <= 1.0, side
        assert run["tasks/chain_sum/num_prompts"] == 8, side
        assert run["tasks/chain_sum/accuracy"] == run["accuracy"], side  # one task: the same prompts
        assert 0.0 <= run["tasks/chain_sum/accuracy"] <= run["tasks/chain_sum/mean_score"] <= 1.0, side
        assert run["mean_score"] == pytest.approx(run["rewards/rg/mean"]), side
        assert "accuracy_well_formed" in run and "tasks/chain_sum/accuracy_well_formed" in run, side
        # the reward read each step's rows: a number per step, not None (no task column seen)
        assert len(run["train_rewards"]["rg"]) == 2, (side, run["train_rewards"])
        assert all(r is not None and 0.0 <= r <= 1.0 for r in run["train_rewards"]["rg"]), (side, run)
    assert 0.0 <= doc["base_accuracy"] <= 1.0 and "tasks/chain_sum/accuracy" in doc["runs"][0]["base"]
    for side in ("ours", "trl"):
        assert doc["summary"][side]["tasks"]["tasks/chain_sum/accuracy"] == runs[side]["accuracy"]
    assert "| chain_sum | mean_score |" in doc["table"] and "| all | accuracy_well_formed |" in doc["table"]
