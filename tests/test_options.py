"""How a component's options are declared and checked (grpo_core/common/options.py): ranges and cross-field
checks once, when the options are made, whichever way; YAML's types strict; the batch arithmetic in one
place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from grpo_core.common.options import ConfigError
from grpo_core.config import config_from_dict, load_config
from grpo_core.loss import LossOptions, grpo_loss
from grpo_core.train.batching import BatchOptions, BatchPlan

ROOT = Path(__file__).resolve().parents[1]


def base() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("changes, key, allowed", [
    ({"epsilon": 1.5}, "epsilon", "> 0 and < 1"),
    ({"epsilon": 0.0}, "epsilon", "> 0 and < 1"),
    ({"delta": 0.5}, "delta", "> 1"),
    ({"beta": -0.1}, "beta", ">= 0"),
])
def test_a_loss_limit_is_one_rule_for_params_yaml_the_object_and_the_functional_form(changes, key, allowed):
    (name, value), = changes.items()
    with pytest.raises(ConfigError, match=rf"^train\.{key}: {value!r} is out of range; allowed: {allowed}$"):
        config_from_dict(base(), {f"train.{name}": value})
    with pytest.raises(ConfigError, match=rf"^{key}: {value!r} is out of range; allowed: {allowed}$"):
        LossOptions(**changes)
    functional = {"epsilon_low" if name == "epsilon" else name: value}
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError,
                       match=rf"^{'epsilon_low' if name == 'epsilon' else key}: .*allowed: {allowed}$"):
        grpo_loss(ones, None, None, torch.ones(2), ones, **functional)


def test_a_bare_yaml_no_is_read_as_no_and_other_booleans_are_refused_naming_the_choices(tmp_path):
    """YAML 1.1 readers (and `-S key=no` through some tools) turn a bare `no` into false: for a key whose
    choices include 'no' that is what was meant; a boolean for any other choice is an error naming the
    choices."""
    cfg = config_from_dict(base(), {"train.mixed_precision": False, "train.eval_strategy": False})
    assert cfg.train.forward.mixed_precision == "no" and cfg.train.evaluation.eval_strategy == "no"
    with pytest.raises(ConfigError,
                       match=r"^train.mixed_precision: True is not allowed; choose one of 'no', 'bf16'"):
        config_from_dict(base(), {"train.mixed_precision": True})
    with pytest.raises(ConfigError, match=r"^train.loss_type: False is not allowed; choose one of 'grpo'"):
        config_from_dict(base(), {"train.loss_type": False})
    text = (ROOT / "params.yaml").read_text()
    assert 'mixed_precision: "no"' in text
    (tmp_path / "params.yaml").write_text(text.replace('mixed_precision: "no"', "mixed_precision: false"))
    assert load_config(tmp_path / "params.yaml").train.forward.mixed_precision == "no"


def test_the_batch_arithmetic_by_hand():
    """8 completions per micro-batch, 2 micro-batches a step, 4 a round per pass, 2 passes, 2 processes,
    G = 4."""
    plan = BatchOptions(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                        steps_per_generation=4, num_iterations=2).plan(num_processes=2)
    assert plan == BatchPlan(group_size=4, micro_batch_size=8, micro_batches_per_step=2,
                             micro_batches_per_round=4, passes_per_round=2, num_processes=2)
    assert plan.completions_per_round == 32 and plan.prompts_per_round == 8   # per process: 8 x 4
    assert plan.generation_batch_size == 64                                   # both processes
    assert plan.micro_batches_per_round_trained == 8                          # 4 x 2 passes
    assert plan.optimizer_steps_per_round == 4                                # 8 / 2 per step
    assert BatchOptions(gradient_accumulation_steps=3).plan(1).micro_batches_per_round == 3  # TRL's default
    with pytest.raises(ConfigError, match="must be divisible by train.num_generations"):
        BatchOptions(num_generations=3, per_device_train_batch_size=8).plan(1)
    with pytest.raises(ConfigError, match="each process samples whole groups"):
        BatchOptions(num_generations=4, per_device_train_batch_size=2).plan(2)


def test_an_unknown_key_names_the_closest_and_a_group_key_is_set_where_it_lives():
    with pytest.raises(ConfigError, match=r"^train.epsilom: unknown key; did you mean 'epsilon'\?"):
        config_from_dict(base(), {"train.epsilom": 0.1})
    cfg = config_from_dict(base(), {"train.epsilon": 0.1, "train.learning_rate": 1e-5, "train.save_steps": 7})
    assert ((cfg.train.loss.epsilon, cfg.train.optim.learning_rate, cfg.train.checkpoints.save_steps)
            == (0.1, 1e-5, 7))
    with pytest.raises(AttributeError):
        cfg.train.epsilon  # noqa: B018 - one place: the group that reads it
