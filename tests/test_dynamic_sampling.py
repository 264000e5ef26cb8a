"""Dynamic sampling (DAPO): tied groups never reach the loss, the round stays full, the surplus waits in a
checkpointed buffer, a resume is exact; and the tie test itself, by hand."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.loss import GRPOLoss
from grpo_core.train.dynamic import fill_round, tied_groups
from grpo_core.train.loop import train
from grpo_core.train.round import Round, Scoring
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config, train_options

NAN = math.nan
HALF_TIED = [{"name": "digits", "function": "tests.reward_helpers:length_on_odd_prompts"}]


def test_tied_groups_by_hand():
    # G = 2, K = 2, weights (1, 1): totals (1, 1) tie; (0.5+0.5, 1+0) tie in total but not per function;
    # (1, 0) differ; (NaN-only column, equal other column) tie in both senses
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0],
                            [0.5, 0.5], [1.0, 0.0],
                            [1.0, 0.0], [0.0, 0.0],
                            [NAN, 2.0], [NAN, 2.0]])
    weights = torch.tensor([1.0, 1.0])
    assert tied_groups(rewards, weights, 2, "sum_then_normalize").tolist() == [True, True, False, True]
    assert tied_groups(rewards, weights, 2, "normalize_then_sum").tolist() == [False, False, False, True]


class FakeAccelerator:
    num_processes, process_index = 1, 0


def fake_rows(rewards_per_group: list[list[float]], tag: int) -> Round:
    """A sampled round whose group g has the given rewards; prompt_ids hold (tag, g) to trace rows."""
    rewards = torch.tensor([r for group in rewards_per_group for r in group],
                           dtype=torch.float32).unsqueeze(1)
    n, G = len(rewards), len(rewards_per_group[0])
    ids = torch.tensor([[tag, i // G] for i in range(n)])
    return Round(prompt_ids=ids, prompt_mask=torch.ones(n, 2, dtype=torch.long),
                 completion_ids=torch.ones(n, 3, dtype=torch.long),
                 completion_mask=torch.ones(n, 3, dtype=torch.long),
                 is_truncated=torch.zeros(n, dtype=torch.bool), advantages=torch.zeros(n), rewards=rewards,
                 metrics={"generation_time": 1.0, "reward_errors": 0.0, "reward_timeouts": 0.0})


def fill(samples: list[Round], pending=None, quota=3, max_rounds=4):
    queue = list(samples)
    t = train_options(num_generations=2, dynamic_sampling=True)
    scoring = Scoring(reward_fns=[], reward_names=["r"], weights=torch.tensor([1.0]))  # rows come scored
    return fill_round(lambda: queue.pop(0), pending, quota=quota, scoring=scoring, a=t.advantage,
                      group_size=t.batch.num_generations, max_rounds=max_rounds,
                      accelerator=FakeAccelerator()), queue


def groups(round_: Round) -> list[tuple[int, int]]:
    return [tuple(row) for row in round_.prompt_ids[::2].tolist()]


def test_the_round_fills_with_untied_groups_and_keeps_the_surplus():
    first = fake_rows([[1, 1], [0, 1], [2, 2]], tag=1)   # group 1 differs; 0 and 2 tie
    second = fake_rows([[0, 1], [3, 3], [1, 0]], tag=2)  # groups 0 and 2 differ
    third = fake_rows([[0, 1], [0, 1], [0, 1]], tag=3)   # never needed
    filled, left = fill([first, second, third])
    assert groups(filled.round) == [(1, 1), (2, 0), (2, 2)]
    assert filled.pending is None and len(left) == 1  # two samplings sufficed
    assert filled.metrics["dynamic/groups_dropped"] == 3 and filled.metrics["dynamic/generation_rounds"] == 2
    assert filled.metrics["dynamic/tied_groups_used"] == 0
    assert (filled.round.advantages.view(-1, 2) != 0).any(dim=1).all()  # no group with all-zero advantages
    assert filled.metrics["generation_time"] == 2.0  # both samplings
    assert filled.metrics["reward"] == pytest.approx(sum([2, 1, 4, 1, 6, 1]) / 12)  # over all 12 samples

    surplus, _ = fill([fake_rows([[0, 1], [1, 1], [1, 1]], 1), fake_rows([[0, 1], [0, 2], [0, 3]], 2)])
    assert groups(surplus.round) == [(1, 0), (2, 0), (2, 1)] and groups(surplus.pending) == [(2, 2)]
    again, left = fill([fake_rows([[0, 1], [0, 1], [5, 5]], 3)], pending=surplus.pending)
    assert groups(again.round) == [(2, 2), (3, 0), (3, 1)]  # the pending group first


def test_at_the_cap_tied_groups_fill_the_round_and_are_counted():
    all_tied = [fake_rows([[1, 1], [2, 2], [0, 0]], tag) for tag in (1, 2)]
    filled, _ = fill(all_tied + [fake_rows([[0, 1], [0, 1], [0, 1]], 3)], max_rounds=2)
    assert len(filled.round) == 6 and filled.pending is None
    assert (filled.metrics["dynamic/tied_groups_used"] == 3
            and filled.metrics["dynamic/generation_rounds"] == 2)
    assert torch.equal(filled.round.advantages, torch.zeros(6))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("dyn")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def test_in_training_tied_groups_never_reach_the_loss(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    seen = []
    real = GRPOLoss.__call__

    def recording(self, logps, old, ref, advantages, mask, **kw):
        seen.append(advantages.detach().clone())
        return real(self, logps, old, ref, advantages, mask, **kw)

    monkeypatch.setattr(GRPOLoss, "__call__", recording)
    cfg = tiny_config(model_dir, data, HALF_TIED, max_steps=3, dynamic_sampling=True,
                      dynamic_sampling_max_rounds=8, per_device_train_batch_size=16, num_generations=4)
    train(cfg, root=tmp_path, progress=False)
    assert len(seen) == 3 and all(len(a) == 16 for a in seen)  # the batch stays full
    for advantages in seen:
        assert (advantages.view(-1, 4).abs() > 0).any(dim=1).all()  # every group carries a signal
    log = read_log(tmp_path / "metrics/train_log.csv")
    assert all(float(r["dynamic/tied_groups_used"]) == 0 for r in log)
    assert sum(float(r["dynamic/groups_dropped"]) for r in log) > 0
    assert float(log[0]["dynamic/generation_rounds"]) >= 2  # half the groups tie: one sampling cannot fill it


def test_dynamic_sampling_resumes_exactly_with_its_pending_groups(assets, tmp_path):
    model_dir, data = assets
    knobs = {"dynamic_sampling": True, "save_steps": 2, "per_device_train_batch_size": 12,
             "num_generations": 4, "learning_rate": 1e-2}
    whole = train(tiny_config(model_dir, data, HALF_TIED, max_steps=4, **knobs), root=tmp_path / "whole",
                  progress=False)
    saved = [torch.load(c / "pending_groups.pt", weights_only=True) for c in
             sorted(whole.checkpoint_dir.glob("checkpoint-*"))]
    assert any(entry[0] is not None for entry in saved)  # a surplus was pending at some checkpoint
    train(tiny_config(model_dir, data, HALF_TIED, max_steps=2, **knobs), root=tmp_path / "split",
          progress=False)
    split = train(tiny_config(model_dir, data, HALF_TIED, max_steps=4, **knobs), root=tmp_path / "split",
                  progress=False)
    assert split.resumed_from.name == "checkpoint-2"
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(split.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole_log, split_log = (read_log(tmp_path / "whole/metrics/train_log.csv"),
                            read_log(tmp_path / "split/metrics/train_log.csv"))
    for key in ("loss", "dynamic/groups_dropped", "dynamic/generation_rounds"):
        assert [r[key] for r in whole_log] == [r[key] for r in split_log], key


def test_the_config_names_the_cap():
    from grpo_core.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="train.dynamic_sampling_max_rounds"):
        config_from_dict({"rewards": HALF_TIED, "data": {"train_files": ["t.jsonl"]},
                          "train": {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 0}})
