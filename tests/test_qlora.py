"""QLoRA (model.quantization) end to end on a tiny model, on CPU (bitsandbytes 0.50 runs its 4-bit layers
there): the base's linear layers really are 4-bit, only the adapters train, gradient checkpointing and a
rollout between training forwards work, a checkpoint resumes exactly, the export is a plain full-precision
model that samples as the trained 4-bit policy does (to NF4 rounding), and the settings QLoRA cannot run are
refused with the reason."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config import ConfigError, config_from_dict
from grpo_core.train.loop import train
from tests.tiny import make_prompts, make_tiny_model, read_log, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
QUANT = {"quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": True}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def require_bitsandbytes() -> None:
    """Skip where bitsandbytes is missing; under CI fail instead (`make setup` installs the qlora extra)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run QLoRA, and bitsandbytes is not installed ({exc}): make setup installs "
                        "it")
        pytest.skip(f"bitsandbytes is not installed: {exc}")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    require_bitsandbytes()
    d = tmp_path_factory.mktemp("tiny-qlora")
    # hidden 64: whole 64-value quantization blocks, so the byte count per parameter is the real one
    return make_tiny_model(d / "model", hidden_size=64, heads=2), make_prompts(d / "train.jsonl")


def qlora_raw(assets, quantization=QUANT, lora=LORA, **train_kwargs) -> dict:
    model_dir, data = assets
    raw = tiny_config(model_dir, data, DIGITS, learning_rate=2e-2, beta=0.04, **train_kwargs).to_dict()
    raw.pop("embedded")
    raw["model"].update(dtype="bfloat16", lora=dict(lora) if lora else None,
                        quantization=dict(quantization) if quantization is not None else None)
    return raw


def qlora_config(assets, **train_kwargs):
    return config_from_dict(qlora_raw(assets, **train_kwargs))


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """4 steps with a checkpoint at step 2, exported: (root, result)."""
    root = tmp_path_factory.mktemp("straight")
    return root, train(qlora_config(assets, max_steps=4, save_steps=2), root=root, progress=False)


# ---------------------------------------------------------------------------------------------------
# the model


def quantized_bytes(module) -> int:
    """A Linear4bit's bytes per its own weights: the packed 4-bit values, the per-block constants (absmax)
    and, with double quantization, the constants of those constants. The two 256-entry lookup tables (1 KB
    each, the NF4 code, the same whatever the layer's size) are left out."""
    qs = module.weight.quant_state
    n = module.weight.numel() * module.weight.element_size() + qs.absmax.numel() * qs.absmax.element_size()
    if qs.nested:
        n += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + 4  # + its float32 offset
    return n


def test_the_base_is_4bit_and_only_the_adapters_train(assets):
    import bitsandbytes as bnb

    from grpo_core.model.loading import is_quantized, load_policy

    cfg = qlora_config(assets)
    policy, _ = load_policy(cfg.model)
    assert is_quantized(policy)
    layers = [getattr(getattr(layer, part), name) for layer in policy.get_base_model().model.layers
              for part in ("self_attn", "mlp") for name in LINEARS if hasattr(getattr(layer, part), name)]
    assert len(layers) == 2 * 7
    params4bit, fp_params = 0, 0
    for lin in layers:
        assert type(lin.base_layer) is bnb.nn.Linear4bit, type(lin.base_layer)
        w = lin.base_layer.weight
        assert w.dtype == torch.uint8 and w.quant_state.quant_type == "nf4" and w.quant_state.nested
        assert lin.base_layer.compute_dtype == torch.bfloat16
        assert lin.lora_A["default"].weight.dtype == torch.float32  # the adapters: float32 masters, as LoRA
        params4bit += quantized_bytes(lin.base_layer)
        fp_params += lin.base_layer.out_features * lin.base_layer.in_features
    ratio = params4bit / (2 * fp_params)  # against the same weights in bf16
    # 4 bits + one 8-bit absmax per 64 values + one float32 per 256 blocks = 4.127 bits: 0.258 of bf16
    assert 0.25 < ratio < 0.27, ratio
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # the rest of the base (embeddings, norms, the tied head) stays in model.dtype
    assert policy.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16


def test_gradient_checkpointing_and_a_rollout_between_training_forwards(assets):
    """An eval-mode, no-grad forward (a rollout, the reference pass) must not turn the 4-bit layers into their
    CPU inference layout (bitsandbytes 0.50 does on AVX512-BF16 CPUs): the next training forward would fail in
    backward. Under gradient checkpointing every adapter, the first layer's included, gets a gradient."""
    from grpo_core.model.loading import load_policy

    policy, _ = load_policy(qlora_config(assets).model, gradient_checkpointing=True)
    ids = torch.tensor([[5, 17, 42, 9, 3, 40, 11, 2]])
    policy.eval()
    with torch.no_grad():
        policy.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    policy.train()
    # B starts at 0: a first step gives only B a gradient; train B a little so A gets one too
    for _ in range(2):
        out = policy(input_ids=ids, labels=ids)
        out.loss.backward()
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if p.requires_grad and "lora_B" in n:
                    p -= 0.1 * p.grad
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), [n for n, g in grads.items()
                                                                              if g is None
                                                                              or not g.abs().sum()]


# ---------------------------------------------------------------------------------------------------
# training, checkpoints, resume, export


def test_training_moves_the_adapters_and_checkpoints_hold_only_them(straight):
    root, res = straight
    kl = [float(r["kl"]) for r in read_log(root / "metrics/train_log.csv")]
    assert kl[0] == 0.0 and kl[-1] > 0.0  # B = 0 at step 1: policy == 4-bit base == reference; then it moves
    ckpt = res.checkpoint_dir / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= names
    assert "model.safetensors" not in names  # neither the 4-bit base nor any other copy of it
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert saved and all("lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())


def test_resume_continues_exactly(assets, straight, tmp_path):
    train(qlora_config(assets, max_steps=2, save_steps=2), root=tmp_path, progress=False)
    resumed = train(qlora_config(assets, max_steps=4, save_steps=2), root=tmp_path, progress=False)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "checkpoint-2"
    a = load_file(straight[0] / "out/model/adapter/adapter_model.safetensors")
    b = load_file(tmp_path / "out/model/adapter/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_is_a_full_precision_model_that_samples_as_the_4bit_policy(assets, straight):
    """The export merges the adapters into the base as it was before quantization, so it cannot equal the
    trained policy (the 4-bit base + adapters) exactly: each base weight differs by its NF4 rounding (up to
    half a step of a 16-level code scaled per 64 weights). Measured here: the export's logits differ from the
    4-bit policy's by no more than the unquantized base's differ from the 4-bit base's (x 1.5; the adapters
    add nothing to the gap), far less than training moved them, and greedy completions agree token for token
    on at least 90% of the tokens of 8 prompts x 12 tokens."""
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_core.model.loading import load_policy, load_tokenizer
    from grpo_core.train.checkpoint import restore_policy_weights

    root, res = straight
    exported = AutoModelForCausalLM.from_pretrained(res.model_dir).eval()
    assert exported.dtype == torch.bfloat16  # model.dtype
    assert getattr(exported.config, "quantization_config", None) is None
    assert "quantization_config" not in json.loads((res.model_dir / "config.json").read_text())
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in exported.modules())
    assert not any("lora" in k for k in exported.state_dict())
    assert (res.model_dir / "adapter/adapter_model.safetensors").is_file()
    # it is the full-precision base + the adapters, merged
    base = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, res.model_dir / "adapter").merge_and_unload()
    for k, v in merged.state_dict().items():
        assert torch.equal(v, exported.state_dict()[k]), k

    cfg = qlora_config(assets)
    policy, _ = load_policy(cfg.model)  # the trained policy: the 4-bit base + the exported adapters
    restore_policy_weights(policy, res.model_dir / "adapter")
    policy.eval()
    quant_base, _ = load_policy(cfg.model)  # adapters at B = 0: the 4-bit base itself
    quant_base.eval()
    full_base = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.bfloat16).eval()
    tok = load_tokenizer(cfg.model)
    prompts = [json.loads(line)["prompt"] for line in assets[1].read_text().splitlines()[:8]]
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        gap_trained = (exported(**batch).logits - policy(**batch).logits).abs().max().item()
        gap_base = (full_base(**batch).logits - quant_base(**batch).logits).abs().max().item()
        moved = (exported(**batch).logits - full_base(**batch).logits).abs().max().item()
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tok.pad_token_id}
        a = exported.generate(**batch, **kwargs)[:, batch.input_ids.shape[1]:]
        b = policy.generate(**batch, **kwargs)[:, batch.input_ids.shape[1]:]
    # measured: gap_trained 0.041, gap_base 0.078, moved 0.99 (max |logit| differences), greedy agreement 100%
    assert gap_trained <= 1.5 * gap_base, (gap_trained, gap_base)
    # what training changed is far above the NF4 rounding
    assert moved > 5 * gap_trained, (moved, gap_trained)
    agree = (a == b).float().mean().item()
    assert agree >= 0.9, (agree, a, b)


# ---------------------------------------------------------------------------------------------------
# what is refused


def test_refusals_name_the_reason(assets, monkeypatch):
    with pytest.raises(ConfigError, match="needs model.lora; a 4-bit base is frozen"):
        config_from_dict(qlora_raw(assets, lora=None))
    raw = qlora_raw(assets)
    raw["generation"]["backend"] = "vllm"
    with pytest.raises(ConfigError,
                       match="not with generation.backend vllm; the engine is fed the policy's merged"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match="train.async_rollouts: not with model.quantization"):
        qlora_config(assets, async_rollouts=True)
    with pytest.raises(ConfigError, match="load_in_4bit: false is not offered"):
        config_from_dict(qlora_raw(assets, quantization={"load_in_4bit": False}))
    with pytest.raises(ConfigError, match="quant_type"):
        config_from_dict(qlora_raw(assets, quantization={"quant_type": "int4"}))
    assert (config_from_dict(qlora_raw(assets, quantization={})).model.quantization.quant_type
            == "nf4")  # defaults

    from grpo_core.model.sharding import FSDPSettings
    from grpo_core.train.parallel import ParallelConfigError, Parallelism, check_parallelism

    with pytest.raises(ParallelConfigError, match="4-bit base .* with FSDP2 is not supported: fully_shard"):
        check_parallelism(Parallelism(FSDPSettings()), lora=True, quantized=True)
    check_parallelism(Parallelism(), lora=True, quantized=True)  # one process or DDP: fine

    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, .*pip install -e '\.\[qlora\]'"):
        qlora_config(assets)
    from grpo_core.model.loading import (
        LoraConfig,
        ModelConfig,
        ModelLoadError,
        QuantizationConfig,
        bitsandbytes_config,
    )

    with pytest.raises(ModelLoadError, match=r"needs bitsandbytes .*pip install -e '\.\[qlora\]'"):
        bitsandbytes_config(ModelConfig(quantization=QuantizationConfig(), lora=LoraConfig()))
