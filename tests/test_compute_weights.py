"""bf16 compute weights over float32 masters (grpo_core/train/compute_weights.py): training's
forward and backward run on a bf16 copy without autocast, gradients sum in float32 on the masters, the
optimizer steps the masters, and the same copy is what rollouts sample from."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.train.compute_weights import ComputeWeights, uses_compute_weights
from tests.tiny import make_prompts, make_tiny_model, random_qwen2, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


class _Recorder:
    """A rollout backend stand-in that records what it was built over and synced with."""

    def __init__(self, model):
        self.model, self.synced = model, []

    def sync_weights(self, model):
        self.synced.append(model)


def _loss(model, ids):
    return model(input_ids=ids).logits.float().logsumexp(-1).mean()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("compute")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def test_micro_batch_gradients_sum_in_float32_on_the_masters():
    """Two backward passes on the bf16 copy: each master's gradient is float32(g1) + float32(g2) exactly,
    where g1 and g2 are the bf16 gradients of the two micro-batches worked out on a separate bf16 model; the
    copy keeps none."""
    masters = random_qwen2(seed=1).train()
    weights = ComputeWeights(masters)
    assert {p.dtype for p in weights.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in masters.parameters()} == {torch.float32}
    batches = [torch.randint(0, 37, (3, 9), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    for ids in batches:
        _loss(weights.model, ids).backward()

    reference = copy.deepcopy(masters).to(torch.bfloat16)
    per_batch = []
    for ids in batches:
        reference.zero_grad(set_to_none=True)
        _loss(reference, ids).backward()
        per_batch.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    rounded_apart = 0
    for name, master in masters.named_parameters():
        g1, g2 = per_batch[0][name], per_batch[1][name]
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, g1.float() + g2.float()), name
        rounded_apart += int(((g1 + g2).float() != master.grad).sum())
    assert rounded_apart > 0  # a bf16 sum differs: the test tells float32 accumulation from bf16
    assert all(p.grad is None for p in weights.model.parameters())


def test_an_update_below_bf16_spacing_survives_on_the_masters_and_sync_casts_them_into_the_copy():
    masters = random_qwen2(seed=2).train()
    weights = ComputeWeights(masters)
    before = {n: p.detach().clone() for n, p in masters.named_parameters()}
    optimizer = torch.optim.AdamW(masters.parameters(), lr=1e-6, weight_decay=0.0)
    _loss(weights.model, torch.randint(0, 37, (2, 7))).backward()
    optimizer.step()
    moved_masters = sum(int((p != before[n]).sum()) for n, p in masters.named_parameters())
    moved_in_bf16 = sum(int((p.to(torch.bfloat16) != before[n].to(torch.bfloat16)).sum())
                        for n, p in masters.named_parameters())
    # most of the update is below bf16's spacing: kept in float32
    assert moved_masters > 10 * max(moved_in_bf16, 1)
    weights.refresh()
    for (name, p), master in zip(weights.model.named_parameters(), masters.parameters()):
        assert torch.equal(p, master.to(torch.bfloat16)), name


def test_the_policy_samples_from_the_copy_and_syncs_it_from_the_masters():
    """place_compute_copy: what trains is the bf16 copy, the rollout backend is built over that copy, and
    sync_rollouts casts the masters into it before telling the backend to reload from it."""
    import types

    from grpo_core.train.optim import OptimizerOptions
    from grpo_core.train.policy import Placing, place_compute_copy

    masters = random_qwen2(seed=3).train()
    placing = Placing(types.SimpleNamespace(device=torch.device("cpu")), None, None, OptimizerOptions(),
                      max_steps=4, mixed_precision="bf16", make_sampler=_Recorder)
    policy = place_compute_copy(placing, masters, None)
    assert policy.module is policy.compute.model and policy.rollouts.model is policy.module
    assert policy.masters is masters and {p.dtype for p in policy.module.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        next(masters.parameters()).add_(1.0)
    policy.sync_rollouts()
    first = next(policy.module.parameters())
    assert torch.equal(first, next(masters.parameters()).to(torch.bfloat16))
    assert policy.rollouts.synced == [policy.module]  # the backend is told to reload from the copy


def test_only_unsharded_bf16_full_fine_tuning_takes_the_copy():
    assert uses_compute_weights("bf16", lora=False, quantized=False, sharded=False)
    assert not uses_compute_weights("no", lora=False, quantized=False, sharded=False)
    # autocast + loss scaler
    assert not uses_compute_weights("fp16", lora=False, quantized=False, sharded=False)
    assert not uses_compute_weights("bf16", lora=True, quantized=False, sharded=False)
    assert not uses_compute_weights("bf16", lora=False, quantized=True, sharded=False)
    assert not uses_compute_weights("bf16", lora=False, quantized=False, sharded=True)  # MixedPrecisionPolicy


def test_training_runs_forward_and_rollouts_on_one_bf16_copy_without_autocast(assets, tmp_path, monkeypatch):
    """mixed_precision bf16: every training forward sees bf16 weights and no autocast, the rollout backend
    samples from that same module, the checkpoint holds float32 masters, and the copy equals them cast after
    the last step."""
    import grpo_core.train.loop as train_loop
    import grpo_core.train.micro_batch as micro_batch
    from grpo_core.rollout import HFGenerateBackend

    seen, backends = [], []
    real = micro_batch.policy_logprobs

    def spy(model, *args, **kwargs):
        seen.append(({p.dtype for p in model.parameters()}, torch.is_autocast_enabled("cpu"), model))
        return real(model, *args, **kwargs)

    def factory(model, tokenizer):
        backends.append(HFGenerateBackend(model, tokenizer, static_cache=True))
        return backends[-1]

    monkeypatch.setattr(micro_batch, "policy_logprobs", spy)
    cfg = tiny_config(*assets, DIGITS, max_steps=2, save_steps=2, learning_rate=1e-4, mixed_precision="bf16",
                      beta=0.04)
    result = train_loop.train(cfg, root=tmp_path, progress=False, export=False,
                              hooks=train_loop.TrainHooks(backend_factory=factory))
    assert seen and all(dtypes == {torch.bfloat16} and not autocast for dtypes, autocast, _ in seen)
    (backend,) = backends
    assert all(model is backend.model for _, _, model in seen)  # one bf16 copy trains and samples
    assert backend.static_cache
    masters = load_file(result.checkpoint_dir / "checkpoint-2/model.safetensors")
    base = load_file(assets[0] / "model.safetensors")
    state = backend.model.state_dict()
    assert {t.dtype for t in masters.values()} == {torch.float32}
    for name, master in masters.items():
        assert torch.equal(state[name], master.to(torch.bfloat16)), name
    assert any(not torch.equal(masters[n], base[n].float()) for n in masters)  # training moved them


def test_a_bf16_compute_run_resumes_bit_for_bit(assets, tmp_path):
    from grpo_core.train.loop import train

    knobs = {"mixed_precision": "bf16", "save_steps": 2, "learning_rate": 1e-3}
    whole = train(tiny_config(*assets, DIGITS, max_steps=4, **knobs), root=tmp_path / "whole", progress=False)
    train(tiny_config(*assets, DIGITS, max_steps=2, **knobs), root=tmp_path / "split", progress=False)
    split = train(tiny_config(*assets, DIGITS, max_steps=4, **knobs), root=tmp_path / "split", progress=False)
    assert split.resumed_from is not None and split.resumed_from.name == "checkpoint-2"
    a = load_file(whole.checkpoint_dir / "checkpoint-4/model.safetensors")
    b = load_file(split.checkpoint_dir / "checkpoint-4/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
