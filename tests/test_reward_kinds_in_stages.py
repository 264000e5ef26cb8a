"""Every kind of reward through validate (its gold check and smoke test) and calibrate (its statistics),
in-process on a tiny model: math answers (math_verify), code run in the sandbox (code_execution), a learned
reward model, a reward isolated in a worker process and an async one."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.hub_fixture import build_chat_tokenizer
from tests.test_stages import REPO
from tests.tiny import in_stage_repo, make_tiny_model

pytest.importorskip("math_verify")


def write_rows(path, n: int, first: int = 0) -> None:
    with open(path, "w") as fh:
        for i in range(first, first + n):
            a, b = i % 7 + 1, i % 5 + 2
            tests = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"}]
            fh.write(json.dumps({"prompt": f"Q{i}: what is {a} + {b}?", "answer": str(a + b), "tests": tests})
                     + "\n")


def make_classifier(path) -> str:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_chat_tokenizer(["what is the sum", "1 2 3 4 5 6 7 8 9"])
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    make_tiny_model(tmp_path / "artifacts" / "base_model")
    (tmp_path / "data" / "prepared").mkdir(parents=True)
    write_rows(tmp_path / "data/prepared/train.jsonl", 12)
    write_rows(tmp_path / "data/prepared/eval.jsonl", 4, first=12)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["embedded"] = None
    raw["calibrate"].update(num_prompts=4, num_generations=3)
    raw["train"].update(num_generations=4, per_device_train_batch_size=8)
    raw["generation"]["max_completion_length"] = 6
    raw["rewards"] = [
        {"name": "math", "function": "math_verify"},
        {"name": "code", "function": "code_execution", "kwargs": {"timeout_s": 3, "require_block": False}},
        {"name": "judge", "function": "reward_model", "kwargs": {"model": make_classifier(tmp_path / "rm")}},
        {"name": "digits", "function": "tests.reward_helpers:digit_fraction", "isolated": True},
        {"name": "polite", "function": "tests.reward_helpers:frees_partner"},
    ]
    raw["guards"]["reward_hacking"] = {"format_reward": None, "correctness_reward": None}
    return in_stage_repo(tmp_path, raw, monkeypatch, "test-reward-kinds")


def test_validate_and_calibrate_take_every_kind_of_reward(repo):
    from flows.stages.__main__ import main

    assert main(["validate"]) == 0
    report = (repo / "reports/validation.md").read_text() if (repo / "reports/validation.md").exists() else ""
    assert "FAILED" not in report
    assert main(["calibrate"]) == 0
    weights = json.loads((repo / "artifacts/calibration/reward_weights.json").read_text())
    assert weights["names"] == ["math", "code", "judge", "digits", "polite"]
    per = weights["stats"]["per_function"]
    # a tiny random policy: wrong, no program
    assert per["math"]["mean"] == 0.0 and per["code"]["mean"] == 0.0
    assert per["polite"]["mean"] == 0.5 and 0.0 <= per["digits"]["mean"] <= 1.0
    assert (per["judge"]["mean"] is not None
            and per["judge"]["mean_within_group_std"] > 0)  # texts differ to it
