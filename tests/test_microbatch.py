"""Length-grouped micro-batches (grpo_core/train/batching.py): orders worked out by hand, the step's gradient
unchanged, less padding in the forward passes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import grpo_core.train.micro_batch as micro_batch_mod
from grpo_core.train.batching import length_grouped_order
from grpo_core.train.loop import TrainHooks, train
from tests.distributed_worker import DeterministicBackend
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config


def order(prompt, completion, G, span, keep):
    return length_grouped_order(torch.tensor(prompt), torch.tensor(completion), G, span, keep).tolist()


def test_rows_sorted_longest_first_within_each_span():
    # lengths (prompt + completion): 3, 7, 5, 5 | 9, 1
    prompt, completion = [1, 2, 2, 3, 4, 1], [2, 5, 3, 2, 5, 0]
    # ties (rows 2, 3) keep their order
    assert order(prompt, completion, 2, 4, keep=False) == [1, 2, 3, 0, 4, 5]
    # groups of 2 kept adjacent: {0, 1} (longest 7) before {2, 3} (longest 5), rows inside by length
    assert order(prompt, completion, 2, 4, keep=True) == [1, 0, 2, 3, 4, 5]


def test_a_longer_later_group_moves_first_and_pieces_of_groups_stay_whole():
    assert order([0] * 4, [1, 2, 8, 3], 2, 4, keep=True) == [2, 3, 1, 0]
    # G = 3, span 4: rows 0-2 are one group, row 3 the start of the next; the piece {3} is longest
    assert order([0] * 6, [2, 2, 2, 9, 1, 1], 3, 4, keep=True) == [3, 0, 1, 2, 4, 5]
    # a span smaller than a group: rows sorted inside it
    assert order([0] * 4, [1, 5, 2, 3], 4, 2, keep=True) == [1, 0, 3, 2]


def test_bad_shapes_and_sizes_are_errors():
    with pytest.raises(ValueError, match="must be"):
        length_grouped_order(torch.ones(4), torch.ones(3), 2, 2, False)
    with pytest.raises(ValueError, match=">= 1"):
        length_grouped_order(torch.ones(4), torch.ones(4), 0, 2, False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


@pytest.mark.parametrize("loss_type,forward", [("dapo", "hf"), ("grpo", "manual")])
def test_grouping_changes_padding_not_the_update(assets, tmp_path, monkeypatch, loss_type, forward):
    """Two micro-batches per step: the sorted ones are narrower in total; each step's loss and gradient norm,
    and the weights after two steps, are those of the unsorted run."""
    model_dir, data = assets
    widths = []
    real_policy_logprobs = micro_batch_mod.policy_logprobs

    def recording(model, mb, *args, **kwargs):
        out = real_policy_logprobs(model, mb, *args, **kwargs)
        if torch.is_grad_enabled():  # the policy forward (the frozen passes run under no_grad)
            widths[-1].append(int(mb.prompt_mask.sum(0).gt(0).sum()) + out[0].shape[1])
        return out

    monkeypatch.setattr(micro_batch_mod, "policy_logprobs", recording)
    weights, logs = {}, {}
    for grouped in (False, True):
        widths.append([])
        cfg = tiny_config(model_dir, data,
                          [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                          max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                          num_generations=4, beta=0.04, loss_type=loss_type, learning_rate=1e-2,
                          group_by_length=grouped, forward_backend=forward)
        res = train(cfg, root=tmp_path / str(grouped), progress=False,
                    hooks=TrainHooks(backend_factory=DeterministicBackend))
        weights[grouped] = load_file(res.model_dir / "model.safetensors")
        logs[grouped] = read_log(tmp_path / str(grouped) / "metrics/train_log.csv")
    assert sum(widths[1]) < sum(widths[0]), widths
    for plain, sorted_ in zip(logs[False], logs[True]):
        for key in ("loss", "grad_norm", "reward"):
            assert float(sorted_[key]) == pytest.approx(float(plain[key]), rel=1e-4, abs=1e-7), key
    start = load_file(model_dir / "model.safetensors")
    for name, w in weights[False].items():  # Adam turns float noise into sign noise where a gradient is ~0
        update = (w - start[name]).abs()
        assert ((weights[True][name] - w).abs() <= 1e-5 + 1e-3 * update.max()).all(), name
