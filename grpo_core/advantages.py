"""Group-relative advantages for GRPO (TRL 1.16 ``GRPOTrainer`` semantics).

Rows of the reward matrix come in groups of ``group_size`` consecutive samples of the same prompt:
rows ``0..G-1`` belong to prompt 0, rows ``G..2G-1`` to prompt 1, and so on. A reward function that
returned ``None`` for a sample leaves ``NaN`` in its column; ``NaN`` is ignored, never treated as 0.

Two aggregations (TRL ``multi_objective_aggregation``):

* ``sum_then_normalize`` (GRPO):  r_i = sum_k w_k r_ik (NaN terms skipped),
  A_i = (r_i - mean_group(r)) / (std(r) + eps) with std per group, over the batch, or no division.
* ``normalize_then_sum`` (GDPO):  z_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + eps) per function,
  s_i = sum_k w_k z_ik (NaN terms skipped),  A_i = (s_i - mean_batch(s)) / (std_batch(s) + eps).

Every std is the Bessel-corrected (N - 1) sample std over the non-NaN entries, as TRL's ``nanstd``.
See docs/algorithm.md for the derivation and the TRL option names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_core.common.options import Options, option

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class AdvantageOptions(Options):
    """params.yaml `train:` keys of how a group's rewards become advantages (``compute_advantages``)."""

    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "advantage std: per group, whole batch, or none")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = option(
        "sum_then_normalize", "combine rewards before (GRPO) or after (GDPO) per-function normalisation")
    reward_weights: list[float] | None = option(None, "pin reward weights (None = calibration's, else all 1)")


def compute_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    group_size: int,
    scale: str = "group",
    aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages of N samples from (N, K) per-function rewards.

    Args:
        rewards: (N, K) float, NaN where reward function k returned None for sample i.
        weights: (K,) weight of each reward function.
        group_size: G, samples per prompt; N must be a multiple of G and G >= 2.
        scale: "group" | "batch" | "none" (TRL ``scale_rewards``); only read by sum_then_normalize,
            as in TRL, where normalize_then_sum always ends with a batch normalisation.
        aggregation: "sum_then_normalize" | "normalize_then_sum" (TRL ``multi_objective_aggregation``).
        eps: added to every std before dividing (TRL hard-codes 1e-4).

    Returns:
        (N,) advantages in the dtype of ``rewards`` (float32 if rewards are not floating point).
        Exactly 0 for unscorable rows (every function NaN) and for rows whose group has equal scores
        (batch, for normalize_then_sum). sum_then_normalize also gives 0 to a group with a single
        scorable row (no std: TRL's NaN, then nan_to_num).
    """
    rewards, weights = _validated(rewards, weights, group_size, scale, aggregation, eps)
    if aggregation == "sum_then_normalize":
        advantages = _sum_then_normalize(rewards, weights, group_size, scale, eps)
    else:
        advantages = _normalize_then_sum(rewards, weights, group_size, eps)
    # NaN is left where no statistic exists: unscorable rows, and a std over fewer than two values.
    # Those samples carry no learning signal, so they get advantage 0 (TRL: nan_to_num(nan=0.0)).
    return torch.nan_to_num(advantages, nan=0.0)


def _sum_then_normalize(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale: str, eps: float
) -> torch.Tensor:
    """(N, K) rewards -> (N,) advantages: weighted NaN-sum first, then the group baseline."""
    total = weighted_nansum(rewards, weights, unscorable_rows(rewards))  # (N,), NaN on unscorable rows
    grouped = total.view(-1, group_size)  # (N/G, G)
    centered = center(grouped, dim=1)  # r_i - mean_group(r)
    if scale == "none":
        return centered.reshape(-1)
    if scale == "group":
        std = nanstd(grouped, dim=1, keepdim=True)  # (N/G, 1)
    else:  # "batch": std over every scorable row of the batch, baseline still per group
        std = nanstd(total, dim=0)
    return (centered / (std + eps)).reshape(-1)


def _normalize_then_sum(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """(N, K) rewards -> (N,) advantages: z-score per function and group, weighted NaN-sum, batch z-score."""
    num_functions = rewards.shape[1]
    grouped = rewards.view(-1, group_size, num_functions)  # (N/G, G, K)
    # z_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + eps); NaN where function k scored < 2 rows of
    # the group (no std), which the NaN-sum below then skips, as TRL does.
    z_scores = center(grouped, dim=1) / (nanstd(grouped, dim=1, keepdim=True) + eps)
    total = weighted_nansum(z_scores.view(-1, num_functions), weights, unscorable_rows(rewards))  # (N,)
    return center(total, dim=0) / (nanstd(total, dim=0) + eps)


def weighted_nansum(values: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
    """(N, K), (K,), (N,) bool -> (N,): sum_k w_k v_ik over non-NaN v_ik; NaN on unscorable rows.

    A plain nansum would turn an unscorable row (every reward function returned None) into 0, a real
    reward that biases the group baseline; NaN drops the row from every statistic downstream. A row
    that is scorable but whose terms are all NaN (GDPO: its only function had no std in the group)
    keeps its sum of 0, as in TRL.
    """
    total = (values * weights.unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(unscorable, math.nan)


def unscorable_rows(rewards: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N,) bool: True where every reward function returned None (NaN)."""
    return torch.isnan(rewards).all(dim=1)


def center(values: torch.Tensor, dim: int) -> torch.Tensor:
    """values - nanmean(values, dim), NaN kept, and exactly 0 where all non-NaN values along dim are equal.

    The exact-zero case matters: nanmean of equal floats can be off by one ulp (0.1 * 3 / 3 != 0.1), and
    dividing that by (0 + eps) would hand every sample of an all-correct group a ~1e-13 advantage.
    """
    centered = values - torch.nanmean(values, dim=dim, keepdim=True)
    present = ~torch.isnan(values)
    highest = values.masked_fill(~present, -math.inf).amax(dim=dim, keepdim=True)
    lowest = values.masked_fill(~present, math.inf).amin(dim=dim, keepdim=True)
    all_equal = highest == lowest  # also True for a single present value; -inf == inf is False (none present)
    return torch.where(all_equal & present, torch.zeros_like(centered), centered)


def nanstd(values: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std over non-NaN entries along dim; NaN where fewer than two are present.

    std = sqrt( sum_i (x_i - mean)^2 / (n - 1) ), as ``torch.std`` and TRL's ``nanstd``.
    """
    present = ~torch.isnan(values)
    count = present.sum(dim=dim, keepdim=True)
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    squared_deviations = torch.where(present, (values - mean) ** 2, torch.zeros_like(values))
    variance = squared_deviations.sum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.sqrt(variance).masked_fill(count < 2, math.nan)
    return std if keepdim else std.squeeze(dim)


def _validated(
    rewards: torch.Tensor | Sequence,
    weights: torch.Tensor | Sequence[float],
    group_size: int,
    scale: str,
    aggregation: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the arguments; return rewards as a float tensor and weights in the same dtype and device."""
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be a 2-D (N, K) tensor, got shape {tuple(rewards.shape)}")
    num_rows, num_functions = rewards.shape
    if num_functions < 1:
        raise ValueError(
            f"rewards must have at least one column (reward function), got shape {tuple(rewards.shape)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group baseline needs two samples), got {group_size}")
    if num_rows % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rows of rewards (N={num_rows})"
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.ndim != 1 or weights.shape[0] != num_functions:
        raise ValueError(
            f"weights must have one entry per reward function (K={num_functions}), got shape "
            f"{tuple(weights.shape)}"
        )
    if not torch.isfinite(weights).all():
        raise ValueError(f"weights must be finite, got {weights.tolist()}")
    return rewards, weights
