"""train.async_rollouts: a sampler worker process samples round r+1 while the trainer trains on round r.

Checked against independent runs: staleness 0 against the synchronous trainer (token for token), staleness 1
against log-probs recomputed here from the previous checkpoint's weights, resume against an uninterrupted run,
rollback against the round the checkpoint saved.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo_core.common.errors import EXIT_ERROR, exit_code_for
from grpo_core.config import ConfigError
from grpo_core.rewards import RewardFunctionError
from grpo_core.train.checkpoint import load_checkpoint
from grpo_core.train.forward import LogprobOptions, frozen_logprobs
from grpo_core.train.loop import TrainHooks, train
from grpo_core.train.round import Round
from grpo_core.train.sampler_worker import SamplerWorker, SamplerWorkerLost
from tests.tiny import make_prompts, make_tiny_model, nan_loss_at, read_log, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
ASYNC = {"async_rollouts": True, "max_staleness": 1}
TIMING = {"step_time", "generation_time", "async/staleness", "async/wait_time"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def weights_equal(a, b) -> bool:
    a, b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def log_without_timing(root) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_log(root / "metrics/train_log.csv")]


def test_staleness_0_is_the_synchronous_run_token_for_token(assets, tmp_path):
    """The worker samples with the current weights and the trainer's RNG state: same samples, same updates."""
    model_dir, data = assets
    knobs = {"max_steps": 3, "beta": 0.04}
    sync = train(tiny_config(model_dir, data, DIGITS, **knobs), root=tmp_path / "sync", progress=False)
    zero = train(tiny_config(model_dir, data, DIGITS, async_rollouts=True, max_staleness=0, **knobs),
                 root=tmp_path / "zero", progress=False)
    assert weights_equal(sync.model_dir, zero.model_dir)
    assert log_without_timing(tmp_path / "sync") == log_without_timing(tmp_path / "zero")
    assert ([float(r["async/staleness"]) for r in read_log(tmp_path / "zero/metrics/train_log.csv")]
            == [0, 0, 0])


def test_staleness_1_trains_on_rounds_the_previous_weights_sampled_with_their_log_probs(assets, tmp_path):
    """checkpoint-n holds the round step n+1 trains on: sampled by checkpoint-(n-1)'s weights (the base model
    for n = 1), whose log-probs of its tokens - recomputed here - are its old log-probs, with the reference's
    (the base model's) log-probs; a resume from checkpoint-2 ends on the weights of the uninterrupted run."""
    model_dir, data = assets
    knobs = {**ASYNC, "beta": 0.04, "save_steps": 1, "save_total_limit": 10}
    whole = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "whole",
                  progress=False)
    log = read_log(tmp_path / "whole/metrics/train_log.csv")
    assert [float(r["async/staleness"]) for r in log] == [0, 1, 1, 1]
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for n in (1, 2, 3):
        ck = load_checkpoint(whole.checkpoint_dir / f"checkpoint-{n}")
        assert ck.state["ahead_step"] == n - 1
        ahead = Round.from_buffer(ck.ahead_round)
        sampler_dir = model_dir if n == 1 else whole.checkpoint_dir / f"checkpoint-{n - 1}"
        sampler = AutoModelForCausalLM.from_pretrained(sampler_dir, dtype=torch.float32)
        current = AutoModelForCausalLM.from_pretrained(whole.checkpoint_dir / f"checkpoint-{n}",
                                                       dtype=torch.float32)
        mask = ahead.completion_mask.bool()
        # the decode loop's own log-probs, within float noise
        expected = frozen_logprobs(sampler, ahead,
                                   LogprobOptions(cfg.train.forward, cfg.generation.temperature,
                                                  cfg.train.batch.per_device_train_batch_size))
        torch.testing.assert_close(ahead.old_logps[mask], expected[mask], rtol=0, atol=2e-5)
        assert (frozen_logprobs(current, ahead,
                                LogprobOptions(cfg.train.forward, cfg.generation.temperature,
                                               cfg.train.batch.per_device_train_batch_size))[mask]
                - ahead.old_logps[mask]).abs().max() > 1e-3
        # scored by the worker, off the trainer's path
        reference = frozen_logprobs(base, ahead,
                                    LogprobOptions(cfg.train.forward, cfg.generation.temperature,
                                                   cfg.train.batch.per_device_train_batch_size))
        torch.testing.assert_close(ahead.ref_logps[mask], reference[mask], rtol=0, atol=1e-6)

    train(tiny_config(model_dir, data, DIGITS, max_steps=2, **knobs), root=tmp_path / "split", progress=False)
    split = train(tiny_config(model_dir, data, DIGITS, max_steps=4, **knobs), root=tmp_path / "split",
                  progress=False)
    assert split.resumed_from.name == "checkpoint-2"
    assert weights_equal(whole.model_dir, split.model_dir)
    assert log_without_timing(tmp_path / "whole") == log_without_timing(tmp_path / "split")


class StepRecorder:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))


def test_a_rollback_trains_on_the_round_its_checkpoint_saved(assets, tmp_path, monkeypatch):
    """A NaN at step 4 rolls back to checkpoint-2: the round in flight (sampled by abandoned weights) is
    dropped and step 3 is redone on the round checkpoint-2 saved - the same round the first step 3 trained
    on."""
    model_dir, data = assets
    nan_loss_at(monkeypatch, {4})  # one micro-batch per step: the 4th call is step 4
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=5, save_steps=2, **ASYNC)
    cfg.guards.nonfinite.action = "rollback"
    tracker = StepRecorder()
    res = train(cfg, root=tmp_path, progress=False, hooks=TrainHooks(tracker=tracker))
    assert [s for s, _ in tracker.rows] == [1, 2, 3, 3, 4, 5]
    (_, first), (_, again) = tracker.rows[2], tracker.rows[3]
    for key in ("reward", "rewards/digits/mean", "completions/mean_length", "async/staleness"):
        assert first[key] == again[key], key
    assert again["learning_rate"] == first["learning_rate"] / 2
    assert [r["step"] for r in read_log(tmp_path / "metrics/train_log.csv")] == ["1", "2", "3", "4", "5"]
    assert json.loads((res.checkpoint_dir / "checkpoint-5/trainer_state.json").read_text())["rollbacks"] == 1


def test_a_reward_raising_in_the_worker_is_raised_by_the_trainer_with_its_name(assets, tmp_path):
    model_dir, data = assets
    buggy = [{"name": "buggy", "function": "tests.reward_helpers:raises_on_long"}]
    with pytest.raises(RewardFunctionError, match="buggy") as info:
        train(tiny_config(model_dir, data, buggy, **ASYNC), root=tmp_path, progress=False)
    assert "in the sampler worker" in str(info.value.__cause__)


def test_a_worker_killed_mid_round_is_a_transient_error_not_a_hang(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    monkeypatch.setenv("GRPO_TEST_DIE_AT", "2")  # the worker SIGKILLs itself scoring its 2nd round
    dying = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction_then_die"}]
    with pytest.raises(SamplerWorkerLost, match=r"the sampler worker \(pid \d+\) died \(exit code -9\); the "
                                                r"run resumes from its last checkpoint") as info:
        train(tiny_config(model_dir, data, dying, **ASYNC), root=tmp_path, progress=False)
    assert exit_code_for(info.value) == EXIT_ERROR  # retried by the flow, not a permanent training failure


def test_a_worker_that_dies_between_rounds_is_the_same_transient_error(assets, tmp_path, monkeypatch):
    """Killed half a second after answering round 2, between rounds or in a later one: the next submit finds
    the pipe broken, or the wait for the round notices; the same transient error either way. 40 steps outlast
    the timer."""
    model_dir, data = assets
    monkeypatch.setenv("GRPO_TEST_DIE_AT", "2")
    dying = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction_then_die_after"}]
    with pytest.raises(SamplerWorkerLost,
                       match=r"the sampler worker \(pid \d+\) died \(exit code -9\)") as info:
        train(tiny_config(model_dir, data, dying, max_steps=40, **ASYNC), root=tmp_path, progress=False)
    assert exit_code_for(info.value) == EXIT_ERROR


def test_a_stopped_worker_fails_within_its_heartbeat_limit(assets, tmp_path, monkeypatch):
    """SIGSTOP: alive, so no death to notice; its heartbeat stops and the trainer gives up after the limit."""
    import time

    model_dir, data = assets
    monkeypatch.setenv("GRPO_TEST_STOP_AT", "2")
    stopping = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction_then_stop"}]
    worker = SamplerWorker(silent_limit_s=3.0)
    start = time.monotonic()
    with pytest.raises(SamplerWorkerLost,
                       match=r"has sent no heartbeat for \d+ s .*limit is 3 s\): it is stopped"):
        train(tiny_config(model_dir, data, stopping, **ASYNC), root=tmp_path, progress=False,
              hooks=TrainHooks(sampler_worker=worker))
    assert time.monotonic() - start < 60
    import multiprocessing

    # the stopped one was killed
    assert "grpo-sampler" not in [p.name for p in multiprocessing.active_children()]


@pytest.mark.parametrize(("knobs", "message"), [
    ({"num_processes": 2}, "one training process"),
    ({"generation_backend": "vllm"}, "generation.backend auto, hf or manual; vllm"),
    ({"dynamic_sampling": True}, "dynamic_sampling"),
    ({"max_staleness": 2}, "train.max_staleness: 2 is out of range"),
])
def test_combinations_the_worker_cannot_serve_are_config_errors(assets, knobs, message):
    model_dir, data = assets
    with pytest.raises(ConfigError, match=message):
        tiny_config(model_dir, data, DIGITS, **{**ASYNC, **knobs})


@pytest.mark.parametrize(("knobs", "cuda", "resolved"), [
    ({}, False, True),                                # one process on a CPU: on
    ({}, True, False),                                # a CUDA device: the policy trains there, off
    ({"num_processes": 2}, False, False),
    ({"generation_backend": "vllm"}, False, False),
    ({"dynamic_sampling": True}, False, False),
])
def test_auto_turns_async_on_exactly_where_the_worker_can_serve(assets, monkeypatch, knobs, cuda, resolved):
    """params.yaml's `async_rollouts: auto`: resolved at load,
    where an explicit true would be a config error."""
    model_dir, data = assets
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = tiny_config(model_dir, data, DIGITS, async_rollouts="auto", **knobs)
    assert cfg.train.rollouts.async_rollouts is resolved and cfg.train.rollouts.async_rollouts is resolved


def test_params_yaml_asks_for_auto():
    from pathlib import Path

    import yaml

    params = Path(__file__).resolve().parents[1] / "params.yaml"
    assert yaml.safe_load(params.read_text())["train"]["async_rollouts"] == "auto"
