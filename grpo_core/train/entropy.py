"""The entropy side of a step, read by the trainer: which tokens the policy term trains on (TRL's
``top_entropy_quantile``) and the entropy bonus's coefficient, fixed or under adaptive control (TRL's
``use_adaptive_entropy``). The bonus itself is in the loss (``GRPOLoss``, ``entropy_mean``); formulas in
docs/algorithm.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.common.options import ConfigError, Options, option


@dataclass
class EntropyOptions(Options):
    """params.yaml `train:` keys of the entropy bonus, its adaptive control and the high-entropy token
    mask."""

    top_entropy_quantile: float = option(
        1.0, "train the policy term on this top share of tokens by entropy, over the step's micro-batch on "
        "every process (1 = all; 0.2 = the 20% most uncertain)", gt=0, le=1)
    entropy_coef: float = option(0.0, "entropy bonus: loss -= entropy_coef * mean entropy of the trained "
                                 "tokens (use_adaptive_entropy: the starting value)", ge=0)
    use_adaptive_entropy: bool = option(False, "move entropy_coef by entropy_coef_delta each step: up while "
                                        "the entropy is at or below entropy_target, down above it; applied "
                                        "only at or below it")
    entropy_target: float = option(0.2, "use_adaptive_entropy: the entropy (nats per token) to hold", ge=0)
    entropy_coef_min: float = option(0.0, "use_adaptive_entropy: lowest entropy_coef", ge=0)
    entropy_coef_max: float = option(1.0, "use_adaptive_entropy: highest entropy_coef", ge=0)
    entropy_coef_delta: float = option(0.005, "use_adaptive_entropy: change of entropy_coef per step", ge=0)

    def check(self) -> None:
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ConfigError(f"entropy_coef_min: {self.entropy_coef_min} is above entropy_coef_max "
                              f"({self.entropy_coef_max})")

    @property
    def logged(self) -> bool:
        """Whether the coefficient is a metric of the step log (a bonus is on, or may come on)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy



@torch.no_grad()
def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float,
                      all_entropies: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's ``top_entropy_quantile`` (Wang et al. 2025, "the 80/20 rule"): (B, T) bool, True for the real
    tokens whose entropy is at least the (1 - top_quantile) quantile of the real tokens' entropies - those of
    every process when ``all_entropies`` (1-D, gathered) is given, else this micro-batch's. top_quantile
    0.2 trains on the 20 % most uncertain tokens (the forks in the reasoning)."""
    real = mask.bool()
    values = entropies[real].float() if all_entropies is None else all_entropies.float()
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1 - top_quantile)
    return ((entropies * mask.to(entropies.dtype)) >= threshold) & real


def next_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, low: float,
                      high: float) -> float:
    """Adaptive entropy control (TRL's ``use_adaptive_entropy``), once per optimizer step: the coefficient
    grows by ``delta`` while the step's entropy is at or below ``target``, shrinks by it otherwise, within
    [low, high]. It applies from the next step on, and only while the entropy stays at or below the target
    (``applied_entropy_coef``)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def applied_entropy_coef(coef: float, last_entropy: float, *, adaptive: bool, target: float) -> float:
    """The coefficient a step's micro-batches use: the static one, or the adaptive one gated on the entropy of
    the previous step (none before the first: +inf)."""
    if not adaptive:
        return coef
    return coef if last_entropy <= target else 0.0
