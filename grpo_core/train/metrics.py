"""The step's metrics, declared once: each one's name (TRL's where TRL has one), how the processes combine it,
and when the run logs it. The step log's columns are this table's, in its order; the loop reduces the loss's
statistics by it; the step log refuses a metric the table does not declare, so none is dropped unseen.

How processes combine a metric (``reduce``):

    given        one number for the whole step already: the round's metrics (computed over every process),
                 what the loop measures or sets (grad norm, learning rate, times), evaluation
    process_mean a plain mean over processes (each holds as many sequences)
    token_mean   a mean over processes weighted by each one's loss tokens
    min, max     the smallest / largest over processes (TRL's clip_ratio/low_min, clip_ratio/high_max)

A loss statistic (``loss_stat``) is computed per micro-batch and averaged over the step's micro-batches, as
TRL averages what it logs between two log lines; min and max are taken across processes per micro-batch first,
as TRL gathers each micro-batch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Reduce = Literal["given", "process_mean", "token_mean", "min", "max"]
#: what a metric's presence hangs on (``switches``); "always": every run
When = Literal["always", "cispo", "vespo", "entropy_coef", "sampler_correction", "dynamic_sampling", "async",
               "tools"]


@dataclass(frozen=True)
class Metric:
    name: str                # "{reward}": one per reward function
    reduce: Reduce
    when: When = "always"
    loss_stat: bool = False  # computed by the loss per micro-batch (GRPOLoss's stats)


_SAMPLER_CORRECTION = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                       "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                       "sampling/importance_sampling_ratio/max")

#: in the step log's column order; evaluation's and a curriculum's columns come after them
METRICS: tuple[Metric, ...] = (
    Metric("step", "given"),
    Metric("loss", "process_mean"),  # each micro-batch's share of the step's loss, summed
    Metric("reward", "given"),
    Metric("reward_std", "given"),
    Metric("frac_reward_zero_std", "given"),
    Metric("rewards/{reward}/mean", "given"),
    Metric("rewards/{reward}/std", "given"),
    Metric("kl", "token_mean", loss_stat=True),  # 0 with beta 0
    Metric("entropy", "token_mean"),
    # the clipped family's (0 for the other loss types)
    Metric("clip_ratio/low_mean", "token_mean", loss_stat=True),
    Metric("clip_ratio/low_min", "min", loss_stat=True),
    Metric("clip_ratio/high_mean", "token_mean", loss_stat=True),
    Metric("clip_ratio/high_max", "max", loss_stat=True),
    Metric("clip_ratio/region_mean", "token_mean", loss_stat=True),
    Metric("cispo_clip_ratio", "token_mean", "cispo", loss_stat=True),
    Metric("vespo/phi_seq_mean", "process_mean", "vespo", loss_stat=True),
    Metric("ratio_mean", "token_mean", loss_stat=True),  # the importance ratio pi_theta / pi_old
    Metric("entropy_coef", "given", "entropy_coef"),
    *(Metric(name, "given", "sampler_correction") for name in _SAMPLER_CORRECTION),
    Metric("dynamic/groups_dropped", "given", "dynamic_sampling"),
    Metric("dynamic/generation_rounds", "given", "dynamic_sampling"),
    Metric("dynamic/tied_groups_used", "given", "dynamic_sampling"),
    Metric("async/staleness", "given", "async"),
    Metric("async/wait_time", "given", "async"),
    Metric("tools/call_frequency", "given", "tools"),
    Metric("tools/failure_frequency", "given", "tools"),
    Metric("tools/mean_turns", "given", "tools"),
    Metric("completions/mean_length", "given"),
    Metric("completions/min_length", "given"),
    Metric("completions/max_length", "given"),
    Metric("completions/clipped_ratio", "given"),
    Metric("grad_norm", "given"),
    Metric("learning_rate", "given"),
    Metric("reward_errors", "given"),
    Metric("reward_timeouts", "given"),
    Metric("num_tokens", "given"),
    Metric("guard/skipped", "given"),
    Metric("step_time", "given"),
    Metric("generation_time", "given"),
)

LOSS_STATS: tuple[Metric, ...] = tuple(m for m in METRICS if m.loss_stat)


def columns(switches: set[str], reward_names: list[str]) -> list[str]:
    """The step log's columns from the table: the metrics whose ``when`` is "always" or in ``switches``, a
    ``{reward}`` metric once per reward function."""
    names: list[str] = []
    for metric in METRICS:
        if metric.when == "always" or metric.when in switches:
            names += ([metric.name.format(reward=r) for r in reward_names] if "{reward}" in metric.name
                      else [metric.name])
    return names


def undeclared(metrics: dict, columns: list[str]) -> list[str]:
    """The metrics a step log with ``columns`` would drop."""
    known = set(columns)
    return sorted(k for k in metrics if k not in known)


def loss_stat_means(stats: list[dict], accelerator) -> dict[str, float]:
    """The step's loss statistics from its micro-batches' (``stats``, GRPOLoss's, one dict each): each the
    mean over micro-batches, min and max taken across processes per micro-batch first; 0 for an "always"
    metric this loss type does not compute. A statistic the table does not declare is an error."""
    unknown = sorted({k for s in stats for k in s} - {m.name for m in LOSS_STATS})
    if unknown:
        raise ValueError(f"the loss computes {unknown}, which grpo_core/train/metrics.py does not declare")
    out: dict[str, float] = {}
    for metric in LOSS_STATS:
        values = torch.tensor([float(s[metric.name]) for s in stats if metric.name in s], dtype=torch.float64)
        if values.numel() == 0:
            if metric.when == "always":
                out[metric.name] = 0.0
            continue
        if metric.reduce in ("min", "max") and accelerator.num_processes > 1:
            values = _extreme_across_processes(accelerator, values, metric.reduce)
        out[metric.name] = values.mean().item()
    return out


def _extreme_across_processes(accelerator, values: torch.Tensor, reduce: str) -> torch.Tensor:
    """Per micro-batch, the min or max over processes of ``values`` (one per micro-batch), NaN (no sequence
    with a token) skipped unless every process has NaN: every process's vector gathered, then TRL's
    nanmin / nanmax over processes."""
    gathered = accelerator.gather(values.to(accelerator.device)[None]).cpu()  # (processes, micro-batches)
    seen = ~torch.isnan(gathered)
    if reduce == "min":
        extreme = torch.where(seen, gathered, math.inf).amin(dim=0)
    else:
        extreme = torch.where(seen, gathered, -math.inf).amax(dim=0)
    return torch.where(seen.any(dim=0), extreme, torch.nan)


def reduce_across_processes(accelerator, metrics: dict, local_tokens: float) -> dict[str, float]:
    """One all-reduce for the step's per-process ``process_mean`` and ``token_mean`` metrics, so every rank
    logs (and its guards judge) the numbers one process would: plain means over processes (each holds as many
    sequences, and its loss share is already scaled to the global batch), and means weighted by each process's
    loss tokens."""
    plain = [m.name for m in METRICS if m.reduce == "process_mean" and m.name in metrics]
    weighted = [m.name for m in METRICS if m.reduce == "token_mean" and m.name in metrics]
    local = ([float(metrics[k]) for k in plain] + [local_tokens]
             + [float(metrics[k]) * local_tokens for k in weighted])
    total = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device),
                               "sum").tolist()
    out = {k: v / accelerator.num_processes for k, v in zip(plain, total)}
    tokens = max(total[len(plain)], 1.0)
    out.update({k: v / tokens for k, v in zip(weighted, total[len(plain) + 1:])})
    return out
