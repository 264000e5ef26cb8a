"""bf16 compute weights over float32 master weights: mixed precision as Megatron keeps it.

The policy's masters (``Policy.masters``) hold the float32 weights: the optimizer updates them and
checkpoints, exports, the reference's TR-DPO mix and the async sampler read them. A copy of it in bf16
(``ComputeWeights.model``, ``Policy.module``) runs every forward and backward of training, and every rollout:

    forward, backward   on the bf16 copy: bf16 weights and activations, a bf16 residual stream, no autocast
    each gradient       moved, as soon as autograd has accumulated it, into a float32 gradient on its master
                        (a post-accumulate-grad hook per parameter): micro-batches sum in float32 and no bf16
                        gradient outlives its backward
    N processes         the float32 gradients all-reduced (averaged) once, after the step's last micro-batch:
                        the reduction in float32, as FSDP2's ``reduce_dtype``; the copy is not DDP-wrapped
    optimizer step      on the float32 masters (AdamW state float32): an lr-1e-6 update survives
    after the step      the masters cast into the copy (``refresh``),
                        which is also what rollouts sample from

Bytes per parameter: masters 4 + gradients 4 + AdamW 8 + the copy 2 = 18, what the float32 masters plus the
bf16 rollout copy cost before; the copy now does both jobs. Under autocast (the previous way) every op cast
its float32 weight again and the residual stream stayed float32.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from grpo_core.model.loading import Float32Head, cast_lm_head_to_fp32

# float32 elements per all-reduce (512 MiB): few collectives, a bounded extra buffer
ALL_REDUCE_BUCKET_NUMEL = 2 ** 27


class ComputeWeights:
    """The bf16 compute copy of the float32 masters (the unwrapped policy): training's forward and backward
    run on ``model``, whose gradients land on the masters in float32 as they are made (a hook per parameter).

    ``refresh()`` casts the masters into the copy (after every optimizer step, restore and rollback);
    ``all_reduce_gradients`` averages the masters' gradients over processes. Rollouts sample from ``model``
    too: the policy builds its rollout backend over it (grpo_core/train/policy.py).
    """

    def __init__(self, masters: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.model = copy.deepcopy(masters).to(dtype)
        if isinstance(masters.get_output_embeddings(), Float32Head):
            cast_lm_head_to_fp32(self.model)  # an untied float32 head stays float32 (cast_lm_head_to_fp32)
        names = dict(masters.named_parameters())
        self._pairs = [(p, names[n]) for n, p in self.model.named_parameters() if names[n].requires_grad]
        for p, master in self._pairs:
            p.register_post_accumulate_grad_hook(_mover(master))

    def refresh(self) -> None:
        """The masters' current values into the copy."""
        with torch.no_grad():
            for p, master in self._pairs:
                p.copy_(master)

    def all_reduce_gradients(self, world_size: int) -> None:
        """Average the masters' float32 gradients over processes (what DDP does), in buckets of at most
        ``ALL_REDUCE_BUCKET_NUMEL`` elements. A parameter without a gradient on this process contributes
        zeros, so every process flattens the same tensors in the same order."""
        if world_size == 1:
            return
        masters = [m for _, m in self._pairs]
        for m in masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        for bucket in _buckets(masters):
            flat = torch.cat([m.grad.reshape(-1) for m in bucket])
            dist.all_reduce(flat)
            flat /= world_size
            offset = 0
            for m in bucket:
                m.grad.copy_(flat[offset:offset + m.numel()].view_as(m))
                offset += m.numel()


def _mover(master: torch.nn.Parameter):
    """The hook for one compute parameter: its bf16 gradient added into ``master.grad`` in the master's dtype
    (float32), then freed."""
    def move(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.to(master.dtype)
        else:
            master.grad.add_(p.grad)
        p.grad = None
    return move


def _buckets(params: list[torch.Tensor]):
    bucket, size = [], 0
    for p in params:
        if bucket and size + p.numel() > ALL_REDUCE_BUCKET_NUMEL:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def uses_compute_weights(mixed_precision: str, *, lora: bool, quantized: bool, sharded: bool) -> bool:
    """Whether training runs on a bf16 compute copy: full fine-tuning with ``train.mixed_precision: bf16`` and
    no FSDP2 (which keeps its own bf16 compute weights: ``MixedPrecisionPolicy(param_dtype=bf16)``). LoRA
    trains float32 adapters over a base already in model.dtype; fp16 keeps autocast with accelerate's loss
    scaler."""
    return mixed_precision == "bf16" and not (lora or quantized or sharded)
