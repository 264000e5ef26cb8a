"""One micro-batch's share of the step's loss: the policy's forward pass with entropies, the high-entropy
token mask (over every process's tokens), then the run's ``GRPOLoss``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.train.entropy import high_entropy_mask
from grpo_core.train.forward import policy_logprobs
from grpo_core.train.parallel import gather_values
from grpo_core.train.round import Round
from grpo_core.train.state import TrainingRun


@dataclass
class MicroBatchLoss:
    loss: torch.Tensor             # () with grad, scaled to the step (for backward)
    stats: dict                    # grpo_loss diagnostics
    mean_entropy: torch.Tensor     # () detached: mean entropy over the loss tokens (the logged "entropy")
    trained_entropy: torch.Tensor | None  # (2,) float64: entropy sum and count over the trained tokens
                                          # (use_adaptive_entropy only)


def micro_batch_loss(run: TrainingRun, mb: Round, loss_mask: torch.Tensor, *, num_items: float,
                     entropy_coef: float) -> MicroBatchLoss:
    """One micro-batch's share of the step's loss (``run.loss_fn``): logps (B, C') with grad, old/ref logps
    cut to C', advantages (B,), loss mask (B, C'); the high-entropy token mask (``top_entropy_quantile``) and
    the entropy bonus (``entropy_coef``)."""
    e, acc = run.entropy, run.accelerator
    logps, entropy, _ = policy_logprobs(run.policy.module, mb, run.logprobs, compute_entropy=True)
    width, device = logps.shape[1], logps.device
    mask = loss_mask[:, :width].to(device)
    trained = None
    if e.top_entropy_quantile < 1.0:  # the threshold is the quantile over every process's tokens, as in TRL
        every = gather_values(acc, entropy.detach()[mask.bool()].float()) if acc.num_processes > 1 else None
        trained = high_entropy_mask(entropy.detach(), mask, e.top_entropy_quantile, all_entropies=every)
    loss, stats = run.loss_fn(
        logps, _cut(mb.old_logps, width, device), _cut(mb.ref_logps, width, device), mb.advantages.to(device),
        mask, num_items=max(num_items, 1.0), entropy_mask=trained,
        sampling_logps=_cut(mb.sampling_logps, width, device),
        sampler_ratio=_cut(mb.sampler_ratio, width, device),  # (B, 1) at sequence level stays (B, 1)
        entropies=entropy, entropy_coef=entropy_coef)
    effective = mask.bool() if trained is None else trained
    m = mask.to(entropy.dtype)
    trained_sum = None  # only adaptive control reads it; it stays on the device until the step's end
    if e.use_adaptive_entropy:
        trained_sum = torch.stack([(entropy.detach() * effective).sum(), effective.sum()]).double()
    return MicroBatchLoss(loss, stats, ((entropy * m).sum() / m.sum().clamp(min=1)).detach(), trained_sum)


def _cut(x: torch.Tensor | None, width: int, device) -> torch.Tensor | None:
    """(N, C) -> (N, width) on ``device``; None stays None."""
    return None if x is None else x[:, :width].to(device, non_blocking=True)
