"""The optimizer and learning-rate schedule (TRL's defaults: AdamW, constant or warmup-then-decay)."""

from __future__ import annotations

import math

import torch

from grpo_core.config import OptimizerConfig


def build_optimizer_and_scheduler(model: torch.nn.Module, o: OptimizerConfig):
    """AdamW over the trainable parameters and the schedule of ``o.lr_scheduler_type`` over ``o.max_steps``."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per step instead of per-tensor ops (and no foreach temporaries the size of the model)
    optimizer = torch.optim.AdamW(params, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2),
                                  weight_decay=o.weight_decay, fused=o.fused_adamw)
    warmup = math.ceil(o.warmup_ratio * o.max_steps)
    name = "constant_with_warmup" if o.lr_scheduler_type == "constant" else o.lr_scheduler_type
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=o.max_steps)
    return optimizer, scheduler


def scale_learning_rate(optimizer, scheduler, factor: float) -> None:
    """Multiply the schedule's base rates (and the current rate) by ``factor``: the rollback's cooler restart."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
