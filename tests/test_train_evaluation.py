"""Evaluation during training (train.eval_strategy): eval/* equal an independent greedy decode of the same
weights, evaluation never changes what training computes, and the best checkpoint by metric_for_best_model is
kept, survives a resume and is exported under load_best_model_at_end."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import grpo_core.train.loop as loop
from grpo_core.config import ConfigError, config_from_dict
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

REWARDS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"},
           {"name": "correct", "function": "correctness"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalsteps")
    return make_tiny_model(d / "model"), make_prompts(d / "prompts.jsonl", n=24)


def weights(path):
    return load_file(path / "model.safetensors")


def greedy_by_hand(model_dir, prompts, max_new_tokens):
    """(digit fraction, completion tokens incl. EOS) of each prompt,
    decoded one prompt at a time by HF generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in seq:
            seq = seq[:seq.index(tok.eos_token_id) + 1]
        text = tok.decode(seq, skip_special_tokens=True)
        out.append((sum(ch.isdigit() for ch in text) / max(len(text), 1), len(seq)))
    return out


def test_eval_metrics_equal_a_greedy_decode_by_hand(assets, tmp_path):
    import json

    model_dir, data = assets
    cfg = tiny_config(model_dir, data, REWARDS, max_steps=3, eval_strategy="steps", eval_steps=2,
                      eval_max_samples=10, num_generations_eval=0, per_device_eval_batch_size=4)
    result = train(cfg, root=tmp_path, progress=False)
    log = read_log(result.log_path)
    assert [r["eval/accuracy"] != "" for r in log] == [False, True, True]  # steps 2 and 3 (the last)
    assert "eval/pass@1" not in log[0]  # greedy only
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()[:10]]
    by_hand = greedy_by_hand(result.model_dir, prompts, cfg.generation.max_completion_length)
    last = result.last_metrics
    assert last["eval/rewards/digits/mean"] == pytest.approx(sum(d for d, _ in by_hand) / 10, rel=1e-9)
    assert last["eval/mean_completion_length"] == pytest.approx(sum(n for _, n in by_hand) / 10, rel=1e-12)
    assert last["eval/accuracy"] == 0.0 and last["eval/rewards/correct/mean"] == 0.0  # a random model
    assert last["eval/runtime"] > 0
    assert (float(log[2]["eval/rewards/digits/mean"])
            == pytest.approx(last["eval/rewards/digits/mean"], rel=1e-5))


def test_evaluation_leaves_training_as_it_was(assets, tmp_path):
    # sampled evaluation draws from the RNGs every step; the trained weights and the training columns must not
    # move
    model_dir, data = assets
    plain = train(tiny_config(model_dir, data, REWARDS, max_steps=3), root=tmp_path / "plain", progress=False)
    with_eval = train(tiny_config(model_dir, data, REWARDS, max_steps=3, eval_strategy="steps", eval_steps=1,
                                  eval_max_samples=6, num_generations_eval=3), root=tmp_path / "eval",
                      progress=False)
    a, b = weights(plain.model_dir), weights(with_eval.model_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain_log, eval_log = read_log(plain.log_path), read_log(with_eval.log_path)
    for key in ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length"):
        assert [r[key] for r in plain_log] == [r[key] for r in eval_log], key
    assert all(r["eval/pass@3"] != "" and r["eval/sampled/rewards/digits/mean"] != "" for r in eval_log)
    assert 0.0 <= with_eval.last_metrics["eval/pass@1"] <= with_eval.last_metrics["eval/pass@3"] <= 1.0


def scripted_evaluations(monkeypatch, values: list[float], key: str = "eval/accuracy"):
    """evaluate_held_out returns values[k] at its k-th call (the training itself is real)."""
    calls = iter(values)
    monkeypatch.setattr(loop, "evaluate_held_out",
                        lambda run, held_out: {key: next(calls), "eval/runtime": 0.0})


def test_the_best_checkpoint_is_kept_and_exported(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    knobs = dict(eval_strategy="steps", eval_steps=1, save_steps=1, save_total_limit=1, learning_rate=1e-2,
                 num_generations_eval=0)
    # step 2 is the best; the tie at step 4 does not win
    scripted_evaluations(monkeypatch, [0.1, 0.5, 0.3, 0.5])
    result = train(tiny_config(model_dir, data, REWARDS, max_steps=4, load_best_model_at_end=True, **knobs),
                   root=tmp_path, progress=False)
    kept = sorted(p.name for p in result.checkpoint_dir.glob("checkpoint-*"))
    assert kept == ["checkpoint-2", "checkpoint-4"]  # save_total_limit 1, and the best beside it
    assert (result.best_step, result.best_value, result.exported_step) == (2, 0.5, 2)
    exported, best, last = (weights(result.model_dir), weights(result.checkpoint_dir / "checkpoint-2"),
                            weights(result.checkpoint_dir / "checkpoint-4"))
    assert all(torch.equal(exported[k], best[k]) for k in exported)
    assert not all(torch.equal(exported[k], last[k]) for k in exported)

    # extended by one step: the best comes back from the checkpoint;
    # a lower-is-better metric picks another step
    scripted_evaluations(monkeypatch, [0.7])
    more = train(tiny_config(model_dir, data, REWARDS, max_steps=5, load_best_model_at_end=True, **knobs),
                 root=tmp_path, progress=False)
    assert more.resumed_from.name == "checkpoint-4" and (more.best_step, more.exported_step) == (5, 5)
    assert sorted(p.name for p in more.checkpoint_dir.glob("checkpoint-*")) == ["checkpoint-5"]

    scripted_evaluations(monkeypatch, [3.0, 2.0, 4.0], key="eval/mean_completion_length")
    low = train(tiny_config(model_dir, data, REWARDS, max_steps=3,
                            metric_for_best_model="mean_completion_length",
                            greater_is_better=False, **knobs), root=tmp_path / "low", progress=False)
    assert (low.best_step, low.best_value, low.exported_step) == (2, 2.0, 3)  # tracked, not exported


def test_without_load_best_the_last_step_is_exported(assets, tmp_path, monkeypatch):
    model_dir, data = assets
    scripted_evaluations(monkeypatch, [0.9, 0.1])
    result = train(tiny_config(model_dir, data, REWARDS, max_steps=2, eval_strategy="steps", eval_steps=1,
                               save_steps=1, num_generations_eval=0), root=tmp_path, progress=False)
    assert result.best_step is None and result.exported_step == 2
    a, b = weights(result.model_dir), weights(result.checkpoint_dir / "checkpoint-2")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("train", "match"), [
    ({"load_best_model_at_end": True}, "train.load_best_model_at_end: .*eval_strategy: steps"),
    ({"metric_for_best_model": "accuracy"}, "train.metric_for_best_model: .*eval_strategy: steps"),
    ({"eval_strategy": "steps", "metric_for_best_model": "eval/loss"},
     "train.metric_for_best_model: 'eval/loss'"),
    ({"eval_strategy": "steps", "metric_for_best_model": "pass@8", "num_generations_eval": 0}, "pass@8"),
    ({"eval_strategy": "steps", "eval_steps": 20, "save_steps": 50, "load_best_model_at_end": True},
     "train.save_steps: 50 is not a multiple"),
    ({"eval_strategy": "steps", "load_best_model_at_end": True, "save_strategy": "no"},
     "train.save_strategy"),
    ({"eval_steps": 0}, "train.eval_steps"),
])
def test_bad_evaluation_settings_name_the_key(train, match):
    raw = {"rewards": REWARDS, "data": {"train_files": ["t.jsonl"], "eval_files": ["e.jsonl"]},
           "train": train}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def test_evaluation_needs_held_out_data():
    with pytest.raises(ConfigError, match="data.eval_files is empty"):
        config_from_dict({"rewards": REWARDS, "data": {"train_files": ["t.jsonl"]},
                          "train": {"eval_strategy": "steps"}})
    cfg = config_from_dict({"rewards": REWARDS,
                            "data": {"train_files": ["t.jsonl"], "eval_files": ["e.jsonl"]},
                            "train": {"eval_strategy": "steps", "load_best_model_at_end": True,
                                      "eval_steps": 10, "save_steps": 30, "num_generations": 4}})
    e = cfg.train.eval_plan
    assert e.best_metric == "eval/accuracy" and math.isclose(e.num_generations_eval, 4)
