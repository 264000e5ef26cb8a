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
import grpo_core.train.policy as policy_mod
import grpo_core.train.setup as setup_mod
from grpo_core.rewards import RewardFunctionError
from grpo_core.rollout import default_backend
from grpo_core.train.checkpoint import CheckpointError, list_checkpoints
from grpo_core.train.loop import TrainHooks, train
from grpo_core.train.state import PromptSampler
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

REPO = Path(__file__).resolve().parents[1]
DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")



def recorded_micro_batches(monkeypatch) -> list[list]:
    """Filled as the run goes: each optimizer step's micro-batches (Rounds), as the loop hands them over."""
    steps = []
    real = trainer_mod.accumulate_gradients

    def record(run, micro_batches, *args, **kwargs):
        steps.append(micro_batches)
        return real(run, micro_batches, *args, **kwargs)

    monkeypatch.setattr(trainer_mod, "accumulate_gradients", record)
    return steps


def recorded_first_gradients(monkeypatch) -> dict[str, torch.Tensor]:
    """Filled as the run goes: the clipped gradients the optimizer's first step applies, by parameter name."""
    grads = {}
    real = policy_mod.build_optimizer_and_scheduler

    def build(model, options, max_steps):
        optimizer, scheduler = real(model, options, max_steps)

        def record(*_):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                              if p.requires_grad})

        optimizer.register_step_pre_hook(record)
        return optimizer, scheduler

    monkeypatch.setattr(policy_mod, "build_optimizer_and_scheduler", build)
    return grads


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO's advantages of one reward function: (r - group mean) / (group std + 1e-4), std with N - 1."""
    groups = rewards.double().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    return (centered / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def test_one_step_logs_the_dapo_loss_and_moves_each_weight_by_adams_first_update(assets, tmp_path,
                                                                                  monkeypatch):
    """One on-policy step (ratio 1, beta 0), its gradient clipped to norm 0.1. The logged loss is DAPO's
    -sum_i A_i n_i / sum_i n_i (n_i completion tokens, A_i the group-normalised rewards), and each weight
    moves by AdamW's first update, -lr * g / (|g| + eps): bias correction makes m / sqrt(v) = g / |g|."""
    model_dir, data = assets
    clip = 0.1
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=1, max_grad_norm=clip)
    steps, grads = recorded_micro_batches(monkeypatch), recorded_first_gradients(monkeypatch)
    before = load_file(model_dir / "model.safetensors")
    res = train(cfg, root=tmp_path, progress=False)
    after = load_file(res.model_dir / "model.safetensors")
    (row,) = read_log(tmp_path / "metrics/train_log.csv")

    ((batch,),) = steps  # one step, one micro-batch: the whole round
    advantages = group_advantages(batch.rewards[:, 0],
                                  cfg.train.batch.num_generations)  # one reward, weight 1
    torch.testing.assert_close(batch.advantages.double(), advantages, rtol=0, atol=1e-6)
    lengths = batch.completion_mask.sum(dim=1).double()
    expected_loss = (-(advantages * lengths).sum() / lengths.sum()).item()
    assert float(row["loss"]) == pytest.approx(expected_loss, rel=1e-5, abs=1e-8)  # logged to 6 digits

    assert before.keys() == after.keys() == grads.keys()  # (the tied head is saved once, as the embedding)
    # the pre-clip norm is logged; the optimizer saw the gradient scaled down to max_grad_norm
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()
    assert float(row["grad_norm"]) > clip and norm == pytest.approx(clip, rel=1e-5)
    assert cfg.train.optim.weight_decay == 0.0  # else AdamW also shrinks each weight by lr * weight_decay
    lr, eps = cfg.train.optim.learning_rate, 1e-8  # eps: torch's AdamW default, which optim.py keeps
    for name, g in grads.items():
        g = g.double()
        moved = after[name].double() - before[name].double()
        # atol: about one float32 rounding of a weight near 1 (the norms'); a whole step is lr = 3e-3
        torch.testing.assert_close(moved, -lr * g / (g.abs() + eps), rtol=0, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
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

    counting = TrainHooks(backend_factory=CountingBackend)
    train(tiny_config(model_dir, data, DIGITS, max_steps=6), root=tmp_path / "mu1", progress=False,
          hooks=counting)
    assert calls == {"generate": 6, "frozen": 0}  # on-policy: no old log-prob pass at all
    log1 = read_log(tmp_path / "mu1/metrics/train_log.csv")
    assert all(float(r["clip_ratio/region_mean"]) == 0.0 for r in log1)  # ratio == 1: clipping is inert

    calls.update(generate=0, frozen=0)
    train(tiny_config(model_dir, data, DIGITS, max_steps=6, num_iterations=2, learning_rate=2e-2),
          root=tmp_path / "mu2", progress=False, hooks=counting)
    assert calls == {"generate": 3, "frozen": 3}  # one old log-prob pass per generation round
    log2 = read_log(tmp_path / "mu2/metrics/train_log.csv")
    second_passes = [float(r["clip_ratio/region_mean"]) for r in log2[1::2]]
    assert max(second_passes) > 0.0


def on_policy_loss(cfg, batch) -> float | None:
    """A step's loss at ratio 1 and KL 0 (the first step: policy = old = reference), from the round's
    advantages A_i, completion lengths and old log-probs. None for vespo: its OPSM at threshold 0 drops
    negative sequences on the float noise between the old and the new log-probs."""
    t, a = cfg.train.loss, batch.advantages.double()
    mask = batch.completion_mask.double()
    if t.loss_type == "cispo":  # -min(r, eps_high) A logp summed over the tokens / their count; r = 1
        return (-(a[:, None] * batch.old_logps.double() * mask).sum() / mask.sum()).item()
    if t.loss_type == "sapo":  # -(4 / tau) sigmoid(0) A per token: a mean per sequence, then over sequences
        tau = torch.where(a > 0, t.sapo_temperature_pos, t.sapo_temperature_neg)
        return (-2 * a / tau).mean().item()
    if t.loss_type == "luspo":  # -A per token, summed per sequence (GSPO's ratio is 1), mean over sequences
        return (-a * mask.sum(dim=1)).mean().item()
    return None


@pytest.mark.parametrize(("loss_type", "extra", "column"), [
    ("cispo", {"epsilon_high": 1.001}, "cispo_clip_ratio"),
    ("sapo", {}, None),
    ("luspo", {"importance_sampling_level": "sequence"}, "clip_ratio/region_mean"),
    ("vespo", {"off_policy_mask_threshold": 0.0}, "vespo/phi_seq_mean"),
])
def test_each_loss_type_trains_end_to_end_and_logs_its_metric(assets, tmp_path, monkeypatch, loss_type, extra,
                                                              column):
    """Two passes over each round (num_iterations 2), so the second pass is off-policy and each term's ratio
    handling runs; the first step's loss is the loss type's formula at ratio 1, the weights move, and the step
    log carries the loss type's own metric, moved off its on-policy value on the second passes."""
    model_dir, data = assets
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=4, num_iterations=2, learning_rate=2e-2, beta=0.04,
                      loss_type=loss_type, **extra)
    steps = recorded_micro_batches(monkeypatch)
    res = train(cfg, root=tmp_path, progress=False)
    log = read_log(tmp_path / "metrics/train_log.csv")
    assert [r["step"] for r in log] == ["1", "2", "3", "4"]
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in log)
    (first,) = steps[0]
    expected = on_policy_loss(cfg, first)
    if expected is not None:  # rel: the 6 logged digits and the old and new forwards' float32 differences
        assert float(log[0]["loss"]) == pytest.approx(expected, rel=1e-4)
    before, after = load_file(model_dir / "model.safetensors"), load_file(res.model_dir / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if column is not None:
        first, second = [float(r[column]) for r in log[0::2]], [float(r[column]) for r in log[1::2]]
        on_policy = {"cispo_clip_ratio": 0.0, "clip_ratio/region_mean": 0.0,
                     "vespo/phi_seq_mean": 1.0}[column]
        assert all(v == pytest.approx(on_policy) for v in first)  # ratio 1: nothing clipped, phi(1) = 1
        assert any(v != pytest.approx(on_policy, abs=1e-6) for v in second)


def test_adaptive_entropy_state_is_checkpointed_and_a_resume_is_exact(assets, tmp_path):
    """Entropy ~6 nats sits below a target of 10: the coefficient climbs by delta each step (0.01 -> 0.05 over
    4), is logged, lands in each checkpoint, and a run stopped at step 2 and resumed ends on the same
    weights."""
    model_dir, data = assets
    knobs = {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 10.0,
             "entropy_coef_delta": 0.01, "entropy_coef_max": 0.035, "top_entropy_quantile": 0.5,
             "save_steps": 2, "learning_rate": 1e-2}
    whole = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "whole",
                  progress=False)
    coefs = [float(r["entropy_coef"]) for r in read_log(tmp_path / "whole/metrics/train_log.csv")]
    assert coefs == pytest.approx([0.02, 0.03, 0.035, 0.035])  # capped at entropy_coef_max
    import json

    state = json.loads((whole.checkpoint_dir / "checkpoint-2/trainer_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.03) and 0 < state["last_entropy"] < 10
    train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path / "split", progress=False)
    split = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "split",
                  progress=False)
    assert split.resumed_from is not None and split.resumed_from.name == "checkpoint-2"
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(split.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_beta_gives_kl_and_leaves_the_reference_alone(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    captured = {}
    real_load_reference = setup_mod.load_reference

    def capture(*a, **k):
        ref = real_load_reference(*a, **k)
        captured["ref"] = ref
        captured["before"] = {k: v.clone() for k, v in ref.state_dict().items()}
        return ref

    monkeypatch.setattr(setup_mod, "load_reference", capture)
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
        train(tiny_config(model_dir, data, DIGITS, max_steps=3, learning_rate=1e-4), root=tmp_path,
              progress=False)
    # told to start fresh, it does
    res = train(tiny_config(model_dir, data, DIGITS, max_steps=1, learning_rate=1e-4, resume="never"),
                root=tmp_path, progress=False)
    assert res.resumed_from is None and res.final_step == 1


def test_checkpoints_are_pruned_to_the_limit(assets, tmp_path):
    model_dir, data = assets
    train(tiny_config(model_dir, data, DIGITS, max_steps=5, save_steps=1, save_total_limit=2), root=tmp_path,
          progress=False)
    assert ([p.name for p in list_checkpoints(tmp_path / "out/checkpoints")]
            == ["checkpoint-4", "checkpoint-5"])


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
cfg = tiny_config(sys.argv[1], sys.argv[2], [{"name": "digits", \
"function": "tests.reward_helpers:digit_fraction_then_die"}],
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
    log_a = [{k: v for k, v in r.items() if k not in drop}
             for r in read_log(tmp_path / "straight/metrics/train_log.csv")]
    log_b = [{k: v for k, v in r.items() if k not in drop}
             for r in read_log(tmp_path / "killed/metrics/train_log.csv")]
    assert [r["step"] for r in log_b] == [str(i) for i in range(1, 13)]
    assert log_a == log_b


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_and_the_run_ends_the_same(assets, tmp_path,
                                                                                          caplog):
    """Checkpoints at steps 1 and 2, then checkpoint-2's optimizer file halved (a crash while the disk filled,
    a bad copy): resume verifies the manifest, names the file, restarts from checkpoint-1, and ends on the
    weights and log of an uninterrupted run."""
    model_dir, data = assets
    knobs = {"save_steps": 1, "learning_rate": 1e-2}
    whole = train(tiny_config(model_dir, data, DIGITS, max_steps=3, **knobs), root=tmp_path / "whole",
                  progress=False)
    first = train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path / "split",
                  progress=False)
    optimizer = first.checkpoint_dir / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    split = train(tiny_config(model_dir, data, DIGITS, max_steps=3, **knobs), root=tmp_path / "split",
                  progress=False)
    assert split.resumed_from.name == "checkpoint-1"
    assert "checkpoint-2 is corrupt, skipped" in caplog.text and "optimizer.pt has" in caplog.text
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(split.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_log(tmp_path / "split/metrics/train_log.csv")]
    assert steps == ["1", "2", "3"]
