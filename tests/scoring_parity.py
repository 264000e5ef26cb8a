"""Run by tests/test_wrapped_scoring.py: the fused LM head (``train.fused_lm_head``, the LM head scoring chunk
by chunk inside the model's own forward) against the full-logits path, under every wrapper the trainer scores
through.

    python -m tests.scoring_parity OUT_DIR                                # one process: plain, autocast, LoRA
    # DDP, FSDP2
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.scoring_parity OUT_DIR

Each case scores the same micro-batch twice on the same wrapped model, ``fused_head=True`` and ``False``: the
policy's pass (log-probs and entropies, then the gradients of a loss on both) and a frozen pass (no gradient,
no entropy: the old policy's and the reference's). Writes OUT_DIR/scoring-rank{R}.json: per case the largest
differences of log-probs, entropies and gradients (and the largest gradient, for scale), and the last
dimension of what the LM head returned on each path (a spy: the fused path's head returns 1 or 2 numbers per
token, the logits path's the vocabulary).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy

VOCAB, B, L, K, CHUNK, TEMPERATURE = 301, 3, 12, 5, 4, 0.7


def make_model(tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # the same weights on every process
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def make_batch(rank: int) -> tuple[torch.Tensor, ...]:
    """A micro-batch of its own on each process (so DDP's all-reduce and FSDP2's reduce-scatter matter), with
    a left-padded prompt and a completion that ended early; position ids as the trainer makes them."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    weights = torch.randn(B, K, generator=g)
    return ids, mask, positions, weights


def head_of(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return inner.get_output_embeddings()


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: DTensor shards
            out[name] = g.detach().float().clone()
    return out


def score(model, batch, fused: bool, scored=None):
    """(logps, entropies, grads, head output's last dim) of the policy's pass,
    then the frozen pass's log-probs."""
    ids, mask, positions, weights = batch
    seen = []
    hook = head_of(model).register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    try:
        # FSDP2: after a no-grad forward that did not reshard (the root; every unit with reshard_after_forward
        # False) zero_grad would clear the gathered copies' grads
        for m in model.modules():
            if hasattr(m, "reshard"):
                m.reshard()
        model.zero_grad(set_to_none=True)
        path = ScoringPath(chunk_size=CHUNK, forward="hf", fused_head=fused)
        logps, entropy = token_logprobs_and_entropy(scored or model, ids, mask, K, TEMPERATURE,
                                                    position_ids=positions, path=path)
        if logps.requires_grad:  # not the LoRA reference: its base is frozen, its adapters off
            ((logps * weights).sum() + (0.1 * entropy).sum()).backward()
        grads = grads_of(model)
        with torch.no_grad():
            frozen, none = token_logprobs_and_entropy(scored or model, ids, mask, K, TEMPERATURE,
                                                      compute_entropy=False, position_ids=positions,
                                                      path=path)
        assert none is None
    finally:
        hook.remove()
    return logps.detach().float(), entropy.detach().float(), grads, frozen.float(), seen


def compare(name: str, model, batch, scored=None) -> dict:
    fused, full = score(model, batch, True, scored), score(model, batch, False, scored)
    assert fused[2].keys() == full[2].keys() and bool(fused[2]) == (scored is None), name
    return {
        "case": name,
        "logps": (fused[0] - full[0]).abs().max().item(),
        "entropy": (fused[1] - full[1]).abs().max().item(),
        "frozen_logps": (fused[3] - full[3]).abs().max().item(),
        "grads": max(((fused[2][k] - full[2][k]).abs().max().item() for k in full[2]), default=None),
        "grad_scale": max((g.abs().max().item() for g in full[2].values()), default=None),
        "logps_dtype": str(fused[0].dtype),
        "head_output_last_dim": {"fused": sorted(set(fused[4])), "full": sorted(set(full[4]))},
    }


def one_process_cases() -> list[dict]:
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    from grpo_core.model.loading import AdapterDisabledReference

    results = [compare(f"plain{'-tied' if tied else ''}", make_model(tied), make_batch(0))
               for tied in (False, True)]
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    wrapped = accelerator.prepare(make_model(tied=True))
    # accelerate's autocast + fp32-output wrapper
    assert getattr(wrapped, "_original_forward", None) is not None
    results.append(compare("autocast-bf16", wrapped, make_batch(0)))

    def lora_policy():
        torch.manual_seed(1)
        policy = get_peft_model(make_model(tied=True), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # adapters that change the numbers (peft starts B at zero)
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return policy

    policy = lora_policy()
    results.append(compare("lora-policy", policy, make_batch(0)))
    results.append(compare("lora-reference", policy, make_batch(0), scored=AdapterDisabledReference(policy)))
    policy = accelerator.prepare(lora_policy())
    results.append(compare("lora-reference-autocast-bf16", policy, make_batch(0),
                           scored=AdapterDisabledReference(policy)))
    return results


def two_process_cases(rank: int) -> list[dict]:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    from grpo_core.model.sharding import FSDPSettings, shard_model

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)  # joins torchrun's gloo group
    assert dist.is_initialized() and dist.get_world_size() == 2
    batch = make_batch(rank)
    results = [compare("ddp-tied", DistributedDataParallel(make_model(tied=True)), batch),
               compare("ddp", DistributedDataParallel(make_model(tied=False)), batch)]
    # as the trainer: DDP around accelerate's autocast
    ddp_autocast = accelerator.prepare(make_model(tied=True))
    assert isinstance(ddp_autocast, DistributedDataParallel)
    assert getattr(ddp_autocast.module, "_original_forward", None) is not None
    results.append(compare("ddp-autocast-bf16", ddp_autocast, batch))
    for tied in (True, False):
        results.append(compare(f"fsdp2{'-tied' if tied else ''}",
                               shard_model(make_model(tied), FSDPSettings()), batch))
    results.append(compare("fsdp2-tied-bf16", shard_model(make_model(tied=True), FSDPSettings(), "bf16"),
                           batch))
    results.append(compare("fsdp2-tied-keep-gathered",
                           shard_model(make_model(tied=True), FSDPSettings(reshard_after_forward=False)),
                           batch))
    return results


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    results = one_process_cases() if world == 1 else two_process_cases(rank)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"scoring-rank{rank}.json").write_text(json.dumps(results, indent=1))
    if rank == 0:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main(*sys.argv[1:])
