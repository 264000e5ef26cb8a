"""dvc.yaml's `params:` cover what each stage reads: the keys are derived from the inputs each stage is handed
(``stage_inputs`` in flows/stages/<stage>.py, a record of sections and groups of `train:`), never listed twice
by hand. A stage missing a key would let `dvc repro` serve an old calibration or evaluation as current."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from grpo_core.config import PipelineConfig, load_config, only_sections, params_read
from grpo_core.rewards.scoring import RewardCallOptions

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["prepare", "convert", "validate", "calibrate", "train", "evaluate", "export"]


def dvc_params(stage: str) -> list[str]:
    spec = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    return [p for entry in spec.get("params", [])
            for p in ([entry] if isinstance(entry, str) else list(entry))]


def covered(key: str, listed: list[str]) -> bool:
    """A key is tracked when dvc.yaml lists it or the section (or parent key) holding it."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in listed for i in range(1, len(parts) + 1))


def missing_keys(read: list[str], listed: list[str]) -> list[str]:
    return [k for k in read if not covered(k, listed)]


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_lists_every_key_the_stage_reads(stage):
    cfg = load_config(ROOT / "params.yaml")
    read = params_read(importlib.import_module(f"flows.stages.{stage}").stage_inputs(cfg))
    assert read, stage
    assert (missing_keys(read, dvc_params(stage))
            == []), f"dvc.yaml stages.{stage}.params misses keys {stage} reads"


def test_the_sampling_stages_track_the_whole_generation_section():
    """Calibrate and evaluate sample as training does: a change of generation.* re-runs them too."""
    cfg = load_config(ROOT / "params.yaml")
    for stage in ("calibrate", "train", "evaluate"):
        assert "generation" in params_read(importlib.import_module(f"flows.stages.{stage}").stage_inputs(cfg))
        assert "generation" in dvc_params(stage)


def test_params_read_derives_keys_from_sections_groups_and_named_fields():
    @dataclasses.dataclass
    class Inputs:
        generation: object
        calls: RewardCallOptions
        seed: int = dataclasses.field(default=0, metadata={"param": "train.seed"})
        size: int = dataclasses.field(default=0,
                                      metadata={"param": ("train.num_generations", "train.num_processes")})

    t = PipelineConfig().train
    assert params_read(Inputs(PipelineConfig().generation, t.reward_calls)) == [
        "generation", "train.reward_errors", "train.reward_timeout_s", "train.seed", "train.num_generations",
        "train.num_processes"]


def test_a_missing_key_is_caught():
    """The check itself can fail: drop generation (or one train key) from calibrate's list and it reports
    them."""
    cfg = load_config(ROOT / "params.yaml")
    read = params_read(importlib.import_module("flows.stages.calibrate").stage_inputs(cfg))
    listed = dvc_params("calibrate")
    assert missing_keys(read, [p for p in listed if p != "generation"]) == ["generation"]
    assert (missing_keys(read, [p for p in listed if p != "train.reward_timeout_s"])
            == ["train.reward_timeout_s"])
    assert covered("train.reward_errors", ["train"]) and not covered("train.reward_errors", ["training"])


def test_an_undeclared_section_cannot_be_read():
    """A stage's code gets a config with only its declared sections: reading another one fails loudly."""
    cfg = only_sections(load_config(ROOT / "params.yaml"), ("train", "generation"))
    assert cfg.generation.temperature == 1.0 and cfg.evaluate is None and cfg.tracking is None
    with pytest.raises(AttributeError):
        cfg.tracking.promotion_metric  # noqa: B018


@pytest.mark.parametrize("params_file", ["params.yaml", *sorted(p.relative_to(ROOT).as_posix()
                                                                 for p in (ROOT / "configs").glob("*.yaml"))])
def test_every_key_dvc_yaml_tracks_is_written_in_params_and_each_recipe(params_file):
    """`dvc repro` refuses a stage whose tracked key is missing from params.yaml ("Parameters ... are
    missing"): params.yaml and every recipe a user copies over it must write each key dvc.yaml names."""
    values = YAML(typ="safe", pure=True).load((ROOT / params_file).read_text())

    def present(key: str) -> bool:
        node = values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    tracked = {k for stage in STAGES for k in dvc_params(stage)}
    assert sorted(k for k in tracked if not present(k)) == []
