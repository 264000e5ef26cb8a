"""The GRPO loop on a tiny model: the update has the right sign, reuse and resume behave, errors are clear."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_core.train.loop as trainer_mod
from grpo_core.rewards import RewardFunctionError
from grpo_core.rollout import default_backend
from grpo_core.train.checkpoint import CheckpointError, list_checkpoints
from grpo_core.train.loop import train
from grpo_core.train.state import PromptSampler
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

REPO = Path(__file__).resolve().parents[1]
DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")



def test_every_trainable_parameter_changes_after_one_step(assets, tmp_path):
    model_dir, data = assets
    before = load_file(model_dir / "model.safetensors")
    res = train(tiny_config(model_dir, data, DIGITS, max_steps=1), root=tmp_path, progress=False)
    after = load_file(res.model_dir / "model.safetensors")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == []


def test_reward_rises_when_the_update_has_the_right_sign(assets, tmp_path):
    model_dir, data = assets
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=40, learning_rate=5e-3, num_generations=8,
                      per_device_train_batch_size=64)
    train(cfg, root=tmp_path, progress=False)
    rewards = [float(r["rewards/digits/mean"]) for r in read_log(tmp_path / "metrics/train_log.csv")]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, (first, last)


def test_num_iterations_halves_generation_and_activates_clipping(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    calls = {"generate": 0, "frozen": 0}
    real_frozen = trainer_mod.frozen_logprobs

    class CountingBackend:
        def __init__(self, model, tokenizer):
            self.inner = default_backend(model, tokenizer)

        def generate(self, *a, **k):
            calls["generate"] += 1
            return self.inner.generate(*a, **k)

        def sync_weights(self, model):
            self.inner.sync_weights(model)

    def counting_frozen(*a, **k):
        calls["frozen"] += 1
        return real_frozen(*a, **k)

    monkeypatch.setattr(trainer_mod, "frozen_logprobs", counting_frozen)

    train(tiny_config(model_dir, data, DIGITS, max_steps=6), root=tmp_path / "mu1", progress=False,
          backend_factory=CountingBackend)
    assert calls == {"generate": 6, "frozen": 0}  # on-policy: no old log-prob pass at all
    log1 = read_log(tmp_path / "mu1/metrics/train_log.csv")
    assert all(float(r["clip_ratio/region_mean"]) == 0.0 for r in log1)  # ratio == 1: clipping is inert

    calls.update(generate=0, frozen=0)
    train(tiny_config(model_dir, data, DIGITS, max_steps=6, num_iterations=2, learning_rate=2e-2),
          root=tmp_path / "mu2", progress=False, backend_factory=CountingBackend)
    assert calls == {"generate": 3, "frozen": 3}  # one old log-prob pass per generation round
    log2 = read_log(tmp_path / "mu2/metrics/train_log.csv")
    second_passes = [float(r["clip_ratio/region_mean"]) for r in log2[1::2]]
    assert max(second_passes) > 0.0


@pytest.mark.parametrize(("loss_type", "extra", "column"), [
    ("cispo", {"epsilon_high": 1.001}, "cispo_clip_ratio"),
    ("sapo", {}, None),
    ("luspo", {"importance_sampling_level": "sequence"}, "clip_ratio/region_mean"),
    ("vespo", {"off_policy_mask_threshold": 0.0}, "vespo/phi_seq_mean"),
])
def test_each_loss_type_trains_end_to_end_and_logs_its_metric(assets, tmp_path, loss_type, extra, column):
    """Two passes over each round (num_iterations 2), so the second pass is off-policy and each term's ratio
    handling runs; the weights move, and the step log carries the loss type's own metric, moved off its
    on-policy value on the second passes."""
    model_dir, data = assets
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=4, num_iterations=2, learning_rate=2e-2, beta=0.04,
                      loss_type=loss_type, **extra)
    res = train(cfg, root=tmp_path, progress=False)
    log = read_log(tmp_path / "metrics/train_log.csv")
    assert [r["step"] for r in log] == ["1", "2", "3", "4"]
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in log)
    before, after = load_file(model_dir / "model.safetensors"), load_file(res.model_dir / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if column is not None:
        first, second = [float(r[column]) for r in log[0::2]], [float(r[column]) for r in log[1::2]]
        on_policy = {"cispo_clip_ratio": 0.0, "clip_ratio/region_mean": 0.0, "vespo/phi_seq_mean": 1.0}[column]
        assert all(v == pytest.approx(on_policy) for v in first)  # ratio 1: nothing clipped, phi(1) = 1
        assert any(v != pytest.approx(on_policy, abs=1e-6) for v in second)


def test_adaptive_entropy_state_is_checkpointed_and_a_resume_is_exact(assets, tmp_path):
    """Entropy ~6 nats sits below a target of 10: the coefficient climbs by delta each step (0.01 -> 0.05 over 4),
    is logged, lands in each checkpoint, and a run stopped at step 2 and resumed ends on the same weights."""
    model_dir, data = assets
    knobs = {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 10.0, "entropy_coef_delta": 0.01,
             "entropy_coef_max": 0.035, "top_entropy_quantile": 0.5, "save_steps": 2, "learning_rate": 1e-2}
    whole = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "whole", progress=False)
    coefs = [float(r["entropy_coef"]) for r in read_log(tmp_path / "whole/metrics/train_log.csv")]
    assert coefs == pytest.approx([0.02, 0.03, 0.035, 0.035])  # capped at entropy_coef_max
    import json

    state = json.loads((whole.checkpoint_dir / "checkpoint-2/trainer_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.03) and 0 < state["last_entropy"] < 10
    train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path / "split", progress=False)
    split = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "split", progress=False)
    assert split.resumed_from is not None and split.resumed_from.name == "checkpoint-2"
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(split.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_beta_gives_kl_and_leaves_the_reference_alone(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    captured = {}
    real_load_reference = trainer_mod.load_reference

    def capture(*a, **k):
        ref = real_load_reference(*a, **k)
        captured["ref"] = ref
        captured["before"] = {k: v.clone() for k, v in ref.state_dict().items()}
        return ref

    monkeypatch.setattr(trainer_mod, "load_reference", capture)
    train(tiny_config(model_dir, data, DIGITS, max_steps=4, beta=0.1), root=tmp_path, progress=False)
    kls = [float(r["kl"]) for r in read_log(tmp_path / "metrics/train_log.csv")]
    assert kls[0] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert all(k > 0 for k in kls[1:])
    after = captured["ref"].state_dict()
    assert all(torch.equal(captured["before"][k], after[k]) for k in after)


def test_raising_reward_stops_with_its_name_or_counts_as_none(assets, tmp_path):
    model_dir, data = assets
    buggy = [{"name": "buggy", "function": "tests.reward_helpers:raises_on_long"}]
    with pytest.raises(RewardFunctionError, match="'buggy' raised on sample 0: ValueError"):
        train(tiny_config(model_dir, data, buggy, max_steps=1), root=tmp_path / "a", progress=False)
    res = train(tiny_config(model_dir, data, buggy + DIGITS, max_steps=2, reward_errors="none"),
                root=tmp_path / "b", progress=False)
    assert res.last_metrics["reward_errors"] > 0


def test_hanging_reward_times_out_and_training_goes_on(assets, tmp_path):
    model_dir, data = assets
    hanging = [{"name": "stuck", "function": "tests.reward_helpers:digit_fraction_hangs_on_second_call"}]
    cfg = tiny_config(model_dir, data, hanging + DIGITS, max_steps=3, reward_timeout_s=0.5)
    res = train(cfg, root=tmp_path, progress=False)
    assert res.final_step == 3
    rows = read_log(tmp_path / "metrics/train_log.csv")
    assert [float(r["reward_timeouts"]) for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["rewards/stuck/mean"] == "nan"  # its samples scored None: ignored, never 0
    assert float(rows[1]["rewards/digits/mean"]) >= 0 and rows[2]["rewards/stuck/mean"] != "nan"


def test_resume_refuses_changed_params(assets, tmp_path):
    model_dir, data = assets
    train(tiny_config(model_dir, data, DIGITS, max_steps=2, save_steps=1), root=tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="different training params"):
        train(tiny_config(model_dir, data, DIGITS, max_steps=3, learning_rate=1e-4), root=tmp_path, progress=False)
    # told to start fresh, it does
    res = train(tiny_config(model_dir, data, DIGITS, max_steps=1, learning_rate=1e-4, resume="never"),
                root=tmp_path, progress=False)
    assert res.resumed_from is None and res.final_step == 1


def test_checkpoints_are_pruned_to_the_limit(assets, tmp_path):
    model_dir, data = assets
    train(tiny_config(model_dir, data, DIGITS, max_steps=5, save_steps=1, save_total_limit=2), root=tmp_path,
          progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "out/checkpoints")] == ["checkpoint-4", "checkpoint-5"]


def test_prompt_sampler_covers_each_epoch_once_and_restores():
    s = PromptSampler(10, seed=3)
    first = s.take(10)
    assert sorted(first) == list(range(10))
    s.take(4)
    state = s.state_dict()
    expected = s.take(9)
    t = PromptSampler(10, seed=3)
    t.load_state_dict(state)
    assert t.take(9) == expected


RUN = """
import sys
from grpo_core.train.loop import train
from tests.tiny import tiny_config
cfg = tiny_config(sys.argv[1], sys.argv[2], [{"name": "digits", "function": "tests.reward_helpers:digit_fraction_then_die"}],
                  max_steps=12, save_steps=5, num_iterations=2)
train(cfg, root=sys.argv[3], progress=False)
"""


@pytest.mark.slow
def test_without_shuffle_prompts_come_in_file_order_every_epoch():
    sampler = PromptSampler(5, seed=3, shuffle=False)
    assert sampler.take(7) == [0, 1, 2, 3, 4, 0, 1]
    shuffled = PromptSampler(5, seed=3).take(5)
    assert sorted(shuffled) == [0, 1, 2, 3, 4] and shuffled != [0, 1, 2, 3, 4]
    assert PromptSampler(6, seed=0, allowed=[4, 1, 5], shuffle=False).take(4) == [4, 1, 5, 4]


def test_exact_resume_after_sigkill(assets, tmp_path):
    """k steps + SIGKILL + resume == an uninterrupted run: bit-identical weights and the same metrics.

    num_iterations=2 with save_steps=5 puts checkpoint-5 in the middle of a generation round, so the
    saved rollout buffer is exercised too. The kill comes from a reward function on its 5th call
    (round 5 = steps 9-10), after checkpoint-5 and before checkpoint-10.
    """
    model_dir, data = assets
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def run(root: Path, die_at: str | None) -> int:
        e = dict(env)
        e.pop("GRPO_TEST_DIE_AT", None)
        if die_at:
            e["GRPO_TEST_DIE_AT"] = die_at
        return subprocess.run([sys.executable, "-c", RUN, str(model_dir), str(data), str(root)], env=e,
                              capture_output=True, text=True).returncode

    assert run(tmp_path / "straight", None) == 0
    assert run(tmp_path / "killed", "5") == -9
    assert [p.name for p in list_checkpoints(tmp_path / "killed/out/checkpoints")] == ["checkpoint-5"]
    assert run(tmp_path / "killed", None) == 0

    a = load_file(tmp_path / "straight/out/model/model.safetensors")
    b = load_file(tmp_path / "killed/out/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    drop = {"step_time", "generation_time"}
    log_a = [{k: v for k, v in r.items() if k not in drop} for r in read_log(tmp_path / "straight/metrics/train_log.csv")]
    log_b = [{k: v for k, v in r.items() if k not in drop} for r in read_log(tmp_path / "killed/metrics/train_log.csv")]
    assert [r["step"] for r in log_b] == [str(i) for i in range(1, 13)]
    assert log_a == log_b


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_and_the_run_ends_the_same(assets, tmp_path, caplog):
    """Checkpoints at steps 1 and 2, then checkpoint-2's optimizer file halved (a crash while the disk filled, a
    bad copy): resume verifies the manifest, names the file, restarts from checkpoint-1, and ends on the weights
    and log of an uninterrupted run."""
    model_dir, data = assets
    knobs = {"save_steps": 1, "learning_rate": 1e-2}
    whole = train(tiny_config(model_dir, data, DIGITS, max_steps=3, **knobs), root=tmp_path / "whole", progress=False)
    first = train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path / "split", progress=False)
    optimizer = first.checkpoint_dir / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    split = train(tiny_config(model_dir, data, DIGITS, max_steps=3, **knobs), root=tmp_path / "split", progress=False)
    assert split.resumed_from.name == "checkpoint-1"
    assert "checkpoint-2 is corrupt, skipped" in caplog.text and "optimizer.pt has" in caplog.text
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(split.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_log(tmp_path / "split/metrics/train_log.csv")]
    assert steps == ["1", "2", "3"]
