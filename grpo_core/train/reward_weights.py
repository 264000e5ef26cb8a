"""The reward weights a training run uses: one code path for `dvc repro` (flows/stages/train.py) and for a
Python user calling ``grpo_core.train.loop.train(cfg)`` without weights."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from grpo_core.common.errors import ConfigurationError, InputUnreadable

#: calibrate's output, relative to the project root (dvc.yaml names it)
CALIBRATION_WEIGHTS = "artifacts/calibration/reward_weights.json"


class CalibrationMismatch(ConfigurationError, ValueError):
    """The calibration file was made for other reward functions than params.yaml names."""


def training_reward_weights(reward_names: Sequence[str], pinned: Sequence[float] | None, root: str | Path,
                            *, calibration_required: bool = False) -> tuple[list[float], str]:
    """(one weight per reward function, where they came from): ``train.reward_weights`` when pinned, else
    calibrate's ``weights_list`` (``<root>/artifacts/calibration/reward_weights.json``), else - only when the
    file is absent and not required - 1.0 each. Raises CalibrationMismatch when the file calibrated other
    rewards, InputUnreadable when a required file is missing or unreadable."""
    names = list(reward_names)
    if pinned is not None:
        return [float(w) for w in pinned], "train.reward_weights"
    path = Path(root) / CALIBRATION_WEIGHTS
    if not path.is_file():
        if calibration_required:
            raise InputUnreadable(f"{CALIBRATION_WEIGHTS}: missing; it is written by the `calibrate` stage "
                                  "(run `dvc repro calibrate`), or pin train.reward_weights")
        return [1.0] * len(names), "equal (no calibration file, train.reward_weights null)"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        weights = [float(w) for w in doc["weights_list"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputUnreadable(f"{CALIBRATION_WEIGHTS}: unreadable calibration weights ({err}); re-run "
                              f"`dvc repro calibrate`") from err
    if doc.get("names") != names:
        raise CalibrationMismatch(f"{CALIBRATION_WEIGHTS}: calibrated for rewards {doc.get('names')}, but "
                                  f"params.yaml names {names}; re-run `dvc repro calibrate`")
    return weights, CALIBRATION_WEIGHTS
