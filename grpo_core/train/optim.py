"""The optimizer and learning-rate schedule (TRL's defaults: AdamW, constant or warmup-then-decay)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_core.common.options import Options, option


@dataclass
class OptimizerOptions(Options):
    """params.yaml `train:` keys of AdamW, gradient clipping and the learning-rate schedule."""

    learning_rate: float = option(1e-6, "AdamW peak learning rate", gt=0)
    weight_decay: float = option(0.0, "AdamW decoupled weight decay", ge=0)
    adam_beta1: float = option(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = option(0.999, "AdamW beta2", ge=0, lt=1)
    max_grad_norm: float = option(1.0, "clip the global gradient norm (0 = off)", ge=0)
    fused_adamw: bool = option(True,
                               "torch's fused AdamW (one kernel per step) instead of the per-tensor one")
    warmup_ratio: float = option(0.0, "share of max_steps spent warming the learning rate up", ge=0, le=1)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = option(
        "constant", "learning-rate schedule after warmup")


def build_optimizer_and_scheduler(model: torch.nn.Module, o: OptimizerOptions, max_steps: int):
    """AdamW over the trainable parameters and the schedule of ``o.lr_scheduler_type`` over ``max_steps``."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per step instead of per-tensor ops (and no foreach temporaries the size of the model)
    optimizer = torch.optim.AdamW(params, lr=o.learning_rate, betas=(o.adam_beta1, o.adam_beta2),
                                  weight_decay=o.weight_decay, fused=o.fused_adamw)
    warmup = math.ceil(o.warmup_ratio * max_steps)
    name = "constant_with_warmup" if o.lr_scheduler_type == "constant" else o.lr_scheduler_type
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps)
    return optimizer, scheduler


def scale_learning_rate(optimizer, scheduler, factor: float) -> None:
    """Multiply the schedule's base rates (and the current rate) by ``factor``: the rollback's cooler
    restart."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
