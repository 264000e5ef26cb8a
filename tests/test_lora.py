"""LoRA end to end on a tiny model: checkpoints hold the adapters and resume exactly (after SIGKILL too), a
rollback restores them, the reference is the base with the adapters off, the export is a merged model that
loads with from_pretrained and the adapters are saved beside it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.train.checkpoint import list_checkpoints
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, nan_loss_at, read_log, tiny_config

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-lora")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def lora_config(assets, **train_kwargs):
    model_dir, data = assets
    cfg = tiny_config(model_dir, data, DIGITS, learning_rate=2e-2, beta=0.04, **train_kwargs)
    from grpo_core.config import config_from_dict

    raw = cfg.to_dict()
    raw["model"]["lora"] = dict(LORA)
    raw.pop("embedded")
    return config_from_dict(raw)


def adapter(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "out/model/adapter/adapter_model.safetensors")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_reference_is_the_base_with_adapters_off_and_the_export_merges(assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    res = train(lora_config(assets, max_steps=4), root=tmp_path, progress=False)
    kl = [float(r["kl"]) for r in read_log(tmp_path / "metrics/train_log.csv")]
    # step 1: adapters start at B = 0, so policy == base == reference; then the adapters move away from it
    assert kl[0] == 0.0 and kl[-1] > 0.0

    merged = AutoModelForCausalLM.from_pretrained(res.model_dir).eval()
    assert not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(assets[0])
    with_adapter = PeftModel.from_pretrained(base, res.model_dir / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 9, 3, 77]])
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(assets[0]).eval()(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)  # the adapters did change the model


def test_checkpoint_holds_adapter_optimizer_scheduler_and_rng(assets, tmp_path):
    train(lora_config(assets, max_steps=2, save_steps=2), root=tmp_path, progress=False)
    ckpt = list_checkpoints(tmp_path / "out/checkpoints")[-1]
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "scheduler.pt",
            "trainer_state.json"} <= names
    assert "model.safetensors" not in names  # the frozen base is not copied into every checkpoint
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert {"python", "numpy", "torch"} <= set(state["rng"][0])  # one state per process
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert (saved and all("lora_" in k for k in saved)
            and all(v.dtype == torch.float32 for v in saved.values()))


def test_resume_continues_exactly(assets, tmp_path):
    straight = train(lora_config(assets, max_steps=4, save_steps=2), root=tmp_path / "a", progress=False)
    train(lora_config(assets, max_steps=2, save_steps=2), root=tmp_path / "b", progress=False)
    resumed = train(lora_config(assets, max_steps=4, save_steps=2), root=tmp_path / "b", progress=False)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "checkpoint-2"
    a, b = adapter(tmp_path / "a"), adapter(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight.final_step == resumed.final_step == 4


def test_rollback_restores_the_adapter(assets, tmp_path, monkeypatch):
    """NaN at step 4 rolls back to checkpoint-2 (adapters already moved by step 3). With the learning rate
    kept (factor 1) the redone steps 3-5 must equal an uninterrupted run exactly: only if the adapters,
    optimizer, sampler and RNG all came back from checkpoint-2."""
    guards = {"nonfinite": {"action": "rollback"}, "rollback_lr_factor": 1.0, "max_rollbacks": 1}

    def cfg():
        c = lora_config(assets, max_steps=5, save_steps=2)
        from grpo_core.config import config_from_dict

        raw = c.to_dict()
        raw.pop("embedded")
        raw["guards"] = {**raw["guards"], **guards}
        return config_from_dict(raw)

    train(cfg(), root=tmp_path / "straight", progress=False)
    nan_loss_at(monkeypatch, {4})
    res = train(cfg(), root=tmp_path / "rolled", progress=False)
    state = json.loads((res.checkpoint_dir / "checkpoint-5/trainer_state.json").read_text())
    assert state["rollbacks"] == 1
    a, b = adapter(tmp_path / "straight"), adapter(tmp_path / "rolled")
    assert all(torch.equal(a[k], b[k]) for k in a)


RUN = """
import sys
from grpo_core.config import config_from_dict
from tests.tiny import tiny_config
from grpo_core.train.loop import train
cfg = tiny_config(sys.argv[1], sys.argv[2], [{"name": "digits", \
"function": "tests.reward_helpers:digit_fraction_then_die"}],
                  max_steps=12, save_steps=5, num_iterations=2, learning_rate=2e-2, beta=0.04)
raw = cfg.to_dict(); raw.pop("embedded")
raw["model"]["lora"] = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear"}
train(config_from_dict(raw), root=sys.argv[3], progress=False)
"""


@pytest.mark.slow
def test_exact_resume_after_sigkill(assets, tmp_path):
    """As the full fine-tuning test (tests/test_trainer.py): SIGKILL after checkpoint-5 (mid-round), resume,
    and the adapters, the merged export and the step log equal an uninterrupted run bit for bit."""
    model_dir, data = assets
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def run(root: Path, die_at: str | None) -> int:
        e = {k: v for k, v in env.items() if k != "GRPO_TEST_DIE_AT"}
        if die_at:
            e["GRPO_TEST_DIE_AT"] = die_at
        proc = subprocess.run([sys.executable, "-c", RUN, str(model_dir), str(data), str(root)], env=e,
                              capture_output=True, text=True)
        if proc.returncode not in (0, -9):
            print(proc.stderr[-3000:])
        return proc.returncode

    assert run(tmp_path / "straight", None) == 0
    assert run(tmp_path / "killed", "5") == -9
    assert [p.name for p in list_checkpoints(tmp_path / "killed/out/checkpoints")] == ["checkpoint-5"]
    assert run(tmp_path / "killed", None) == 0

    for rel in ("out/model/adapter/adapter_model.safetensors", "out/model/model.safetensors"):
        a, b = load_file(tmp_path / "straight" / rel), load_file(tmp_path / "killed" / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
        print(f"{rel}: straight {digest(tmp_path / 'straight' / rel)} resumed "
              f"{digest(tmp_path / 'killed' / rel)}")
    drop = {"step_time", "generation_time"}
    log_a = [{k: v for k, v in r.items() if k not in drop}
             for r in read_log(tmp_path / "straight/metrics/train_log.csv")]
    log_b = [{k: v for k, v in r.items() if k not in drop}
             for r in read_log(tmp_path / "killed/metrics/train_log.csv")]
    assert [r["step"] for r in log_b] == [str(i) for i in range(1, 13)]
    assert log_a == log_b


def test_disable_dropout_makes_the_training_forward_repeatable(assets):
    """LoRA's adapter dropout (0.5 here) makes two training-mode forwards differ; disable_dropout (TRL's
    disable_dropout) switches every dropout module off, so they agree - the log-probs the loss sees are the
    sampled policy's."""
    from grpo_core.model.loading import LoraConfig, ModelConfig, disable_dropout, load_policy

    model_dir, _ = assets
    cfg = ModelConfig(name_or_path=str(model_dir), lora=LoraConfig(**{**LORA, "lora_dropout": 0.5}))
    policy, _ = load_policy(cfg)
    policy.train()
    # a trained adapter: peft starts B at zero, where dropout on its input changes nothing
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.manual_seed(0)
    a, b = policy(input_ids=ids).logits, policy(input_ids=ids).logits
    assert not torch.allclose(a, b)
    assert disable_dropout(policy) > 0
    assert torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)


@pytest.mark.parametrize("fused_head", [False, True])
def test_the_lora_reference_is_scored_as_the_policy_with_its_adapters_off(assets, fused_head):
    """The reference view takes the policy's scoring path (the fused head, or logits for the completion only:
    logits_to_keep), never the (B, L, V) logits of the prompt too; its log-probs are the base model's."""
    from transformers import AutoModelForCausalLM

    from grpo_core.model.loading import AdapterDisabledReference, LoraConfig, ModelConfig, load_policy
    from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy

    model_dir, _ = assets
    policy, _ = load_policy(ModelConfig(name_or_path=str(model_dir), lora=LoraConfig(**LORA)))
    policy.eval()
    with torch.no_grad():  # adapters that change the numbers (peft starts B at zero)
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask, K = torch.ones_like(ids), 4
    head_rows = []
    hook = policy.get_base_model().lm_head.register_forward_hook(
        lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
    path = ScoringPath(forward="hf", fused_head=fused_head)
    with torch.no_grad():
        ref_logps, _ = token_logprobs_and_entropy(AdapterDisabledReference(policy), ids, mask, K, path=path)
        base_logps, _ = token_logprobs_and_entropy(base, ids, mask, K, path=path)
        policy_logps, _ = token_logprobs_and_entropy(policy, ids, mask, K, path=path)
    hook.remove()
    torch.testing.assert_close(ref_logps, base_logps, rtol=1e-5, atol=1e-5)
    assert (policy_logps - base_logps).abs().max() > 1e-3  # the adapters matter: the reference switched them
                                                           # off
    # reference and policy: the completion's positions only (12 each before)
    assert sum(head_rows) <= 2 * 2 * (K + 1)
