"""The frozen reference of the KL term (``beta`` > 0) and TR-DPO's syncing of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.common.options import Options, option


@dataclass
class ReferenceOptions(Options):
    """params.yaml `train:` keys of TR-DPO's reference syncing (the reference itself exists when beta > 0)."""

    sync_ref_model: bool = option(False,
                                  "TR-DPO: mix the policy into the reference every ref_model_sync_steps")
    ref_model_mixup_alpha: float = option(0.6, "TR-DPO alpha: ref = alpha * policy + (1 - alpha) * ref",
                                          ge=0, le=1)
    ref_model_sync_steps: int = option(512, "steps between reference syncs", ge=1)

    def due(self, step: int) -> bool:
        """Whether the reference is mixed after optimizer step ``step``."""
        return self.sync_ref_model and step % self.ref_model_sync_steps == 0


@torch.no_grad()
def mix_reference(ref_model, policy, alpha: float) -> None:
    """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref."""
    for ref_p, p in zip(ref_model.parameters(), policy.parameters()):
        ref_p.mul_(1 - alpha).add_(p.detach().to(ref_p.dtype), alpha=alpha)
