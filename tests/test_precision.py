"""Mixed precision keeps every update: bf16 compute over float32 master weights moves the policy as float32
does, where AdamW on bf16 weights rounds small updates away; the export is in model.dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_core.model.loading import ModelConfig, load_policy
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def test_trained_weights_are_float32_masters_whatever_the_model_dtype(assets):
    model, _ = load_policy(ModelConfig(name_or_path=str(assets[0]), dtype="bfloat16"))
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


def test_lora_keeps_the_frozen_base_in_model_dtype_and_the_adapters_in_float32(assets):
    pytest.importorskip("peft")
    from grpo_core.model.loading import LoraConfig

    model, _ = load_policy(ModelConfig(name_or_path=str(assets[0]), dtype="bfloat16", lora=LoraConfig(r=2)))
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


# One training run per process: accelerate's state is process-wide, and a stage is a process too.
RUN = """
import json, sys, torch
import grpo_core.train.loop as trainer
import grpo_core.train.setup as setup
from grpo_core.config import config_from_dict
from tests.tiny import tiny_config
model_dir, data, root, dtype, mixed, plain = sys.argv[1:7]
cfg = tiny_config(model_dir, data, [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                  learning_rate=1e-5, beta=0.04, max_steps=30, save_steps=1000, mixed_precision=mixed)
raw = cfg.to_dict(); raw.pop("embedded"); raw["model"]["dtype"] = dtype
if plain == "1":  # the negative control: AdamW straight on bf16 weights, without fp32 master weights
    load = setup.load_policy
    def bf16_policy(*a, **k):
        model, tok = load(*a, **k)
        return model.to(torch.bfloat16), tok
    setup.load_policy = bf16_policy
trainer.train(config_from_dict(raw), root=root, progress=False)
"""


def mean_kl(assets, root: Path, dtype: str, mixed: str, plain: bool = False) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN, str(assets[0]), str(assets[1]), str(root), dtype, mixed,
                           "1" if plain else "0"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kl = [float(r["kl"]) for r in read_log(root / "metrics/train_log.csv")]
    assert len(kl) == 30
    return sum(kl[20:30]) / 10  # steps 21-30


@pytest.mark.slow
def test_bf16_moves_the_policy_as_fp32_does_and_plain_bf16_adamw_does_not(assets, tmp_path):
    fp32 = mean_kl(assets, tmp_path / "fp32", "float32", "no")
    bf16 = mean_kl(assets, tmp_path / "bf16", "bfloat16", "bf16")
    plain = mean_kl(assets, tmp_path / "plain", "bfloat16", "bf16", plain=True)
    print(f"mean KL, steps 21-30, lr 1e-5: fp32 {fp32:.3g}, bf16 (fp32 masters) {bf16:.3g} "
          f"({bf16 / fp32:.2f}x), plain bf16 AdamW {plain:.3g} ({plain / fp32:.2f}x)")
    assert 0.5 < bf16 / fp32 < 2.0
    assert plain / fp32 < 0.5  # the test can fail: the rounding it guards against is real
    config = json.loads((tmp_path / "bf16/out/model/config.json").read_text())
    assert config["dtype"] == "bfloat16"  # the export is in model.dtype
    from safetensors.torch import load_file

    assert ({t.dtype for t in load_file(tmp_path / "bf16/out/model/model.safetensors").values()}
            == {torch.bfloat16})


def test_a_half_precision_model_dtype_samples_from_a_copy_in_it_refreshed_after_every_step(assets, tmp_path):
    """model.dtype bfloat16, full fine-tuning: the backend samples from a bf16 copy of the float32 masters
    (not the masters under autocast), refreshed after every optimizer step - after the run it equals the last
    step's masters cast to bf16 - and HF's static KV cache runs on it (K and V in one dtype: no fall-back to
    the dynamic cache)."""
    import dataclasses

    from safetensors.torch import load_file

    from grpo_core.rollout import HFGenerateBackend
    from grpo_core.train.loop import TrainHooks, train
    from tests.tiny import tiny_config

    backends = []

    def factory(model, tokenizer):
        backends.append(HFGenerateBackend(model, tokenizer, static_cache=True))
        return backends[-1]

    cfg = tiny_config(*assets, [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                      max_steps=2, save_steps=2, per_device_train_batch_size=8)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    train(cfg, root=tmp_path, progress=False, hooks=TrainHooks(backend_factory=factory),
          export=False)  # the export casts in place
    (backend,) = backends
    assert backend.static_cache  # the static cache ran every round: no K/V dtype mismatch made it fall back
    copy = backend.model.state_dict()
    masters = load_file(tmp_path / "out/checkpoints/checkpoint-2/model.safetensors")
    base = load_file(assets[0] / "model.safetensors")
    assert {t.dtype for t in copy.values() if t.is_floating_point()} == {torch.bfloat16}
    for name, master in masters.items():
        assert master.dtype == torch.float32
        assert torch.equal(copy[name], master.to(torch.bfloat16)), name
    moved = [name for name in masters if not torch.equal(masters[name], base[name].float())]
    assert moved  # the copy followed training: the check can fail


def test_tf32_is_switched_on_through_the_api_this_torch_has():
    """set_up calls allow_tf32 on CUDA; here only that it names flags this torch has and sets them (a renamed
    flag would raise on the first GPU run, where no test runs)."""
    from grpo_core.train.setup import allow_tf32

    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        allow_tf32()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before
