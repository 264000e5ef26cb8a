"""Dynamic sampling (DAPO, Yu et al. 2025): a round trains only on groups whose rewards differ.

A group whose G completions all score the same has zero advantage everywhere: it adds no policy gradient, yet
it takes a slot of the batch and dilutes the token normalisers. With ``train.dynamic_sampling`` a round is
filled like this, on each process:

    pending (groups kept earlier, not yet trained on)
    while some process holds fewer than its quota of groups and the round has sampled < max rounds:
        sample the next prompts of the global order -> drop the tied groups -> append the rest to pending
    the round = the first quota groups of pending (tied groups of this round fill what is still missing at the
    cap); the rest stays pending for the next round, and goes into checkpoints.

Every process samples as many times as the process that needs the most (their reward gathers are collective);
a process already full keeps its extra groups pending. The advantages are computed on the assembled round, so
``scale_rewards="batch"`` sees the batch that is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from grpo_core.advantages import AdvantageOptions
from grpo_core.train.round import (
    Round,
    Scoring,
    assign_advantages,
    gather_rows,
    length_metrics,
    reward_metrics,
)


def tied_groups(rewards: torch.Tensor, weights: torch.Tensor, group_size: int,
                aggregation: str) -> torch.Tensor:
    """(N / G,) bool: the groups whose advantages are all zero. rewards (N, K), NaN = None.

    sum_then_normalize: the weighted totals tie within the group. normalize_then_sum: every reward function
    ties within the group (each is normalised on its own first). A function that is None for the whole group
    ties.
    """
    if aggregation == "sum_then_normalize":
        totals = torch.nansum(rewards * weights.to(rewards.dtype), dim=1).view(-1, group_size)
        return (totals == totals[:, :1]).all(dim=1)
    grouped = rewards.view(-1, group_size, rewards.shape[1])                        # (groups, G, K)
    first = grouped[:, :1]
    same = (grouped == first) | (torch.isnan(grouped) & torch.isnan(first))
    return same.all(dim=2).all(dim=1)


@dataclass
class Filled:
    round: Round               # quota groups, with advantages
    pending: Round | None      # kept groups beyond the quota, for later rounds
    metrics: dict[str, float]  # the round's metrics: rewards over everything sampled,
                               # and the dynamic/* counts


def fill_round(sample, pending: Round | None, *, quota: int, scoring: Scoring, a: AdvantageOptions,
               group_size: int, max_rounds: int, accelerator) -> Filled:
    """Sample with ``sample()`` (-> ``sample_round``'s Round, rewards kept) until this process holds ``quota``
    non-tied groups, or ``max_rounds`` (train.dynamic_sampling_max_rounds) samplings were made; see the module
    docstring. scoring: its weights decide the ties and the advantages, its names the reward metrics."""
    G, weights = group_size, scoring.weights
    kept, tied, attempts = [pending] if pending is not None else [], [], []
    while len(attempts) < max_rounds and _any_process(accelerator, _groups(kept, G) < quota):
        attempt = sample()
        attempts.append(attempt)
        rows = tied_groups(attempt.rewards, weights, G, a.multi_objective_aggregation).repeat_interleave(G)
        kept.append(attempt.rows(torch.nonzero(~rows).squeeze(1)))
        tied.append(attempt.rows(torch.nonzero(rows).squeeze(1)))
    kept = [r for r in kept if len(r)]
    have = _groups(kept, G)
    short = max(quota - have, 0)
    pool = Round.concat(kept + ([Round.concat(tied).rows(slice(0, short * G))] if short else []))
    round_, rest = pool.rows(slice(0, quota * G)), None
    # the kept groups beyond the quota wait for the next round; tied ones are dropped for good
    if have > quota:
        rest = pool.rows(slice(quota * G, None))
    metrics = _round_metrics(accelerator, attempts, round_, weights, G, scoring.reward_names)
    metrics.update(_counts(accelerator, dropped=sum(len(r) for r in tied) // G, rounds=len(attempts),
                           filled_with_tied=short))
    return Filled(assign_advantages(replace(round_, metrics=metrics), weights, a, G, accelerator), rest,
                  metrics)


def _round_metrics(accelerator, attempts: list[Round], round_: Round, weights: torch.Tensor, G: int,
                   reward_names: list[str]) -> dict[str, float]:
    """Rewards over everything sampled for the round (what the policy did, comparable with dynamic sampling
    off); lengths over the rows trained on; times and reward errors summed over the samplings."""
    # no sampling: the pending groups it trains on
    sampled = [a.rewards for a in attempts] or [round_.rewards]
    metrics = reward_metrics(torch.cat([gather_rows(accelerator, r) for r in sampled]), weights, G,
                             reward_names)
    for key in ("generation_time", "reward_errors", "reward_timeouts"):
        metrics[key] = float(sum(a.metrics[key] for a in attempts))
    metrics.update(length_metrics(accelerator, round_.model_mask(), round_.is_truncated))
    metrics.update(_tool_metrics(attempts))
    return metrics


def _tool_metrics(attempts: list[Round]) -> dict[str, float]:
    """The tools/* metrics over every sampling of the round (each samples as many completions): calls per
    completion and turns averaged, failures per call weighted by each sampling's calls."""
    per = [a.metrics for a in attempts if "tools/call_frequency" in a.metrics]
    if not per:
        return {}
    calls = [m["tools/call_frequency"] for m in per]
    failed = sum(m["tools/failure_frequency"] * c for m, c in zip(per, calls))
    return {"tools/call_frequency": sum(calls) / len(per),
            "tools/failure_frequency": failed / sum(calls) if sum(calls) else 0.0,
            "tools/mean_turns": sum(m["tools/mean_turns"] for m in per) / len(per)}


def _groups(rounds: list[Round], group_size: int) -> int:
    return sum(len(r) for r in rounds) // group_size


def _any_process(accelerator, flag: bool) -> bool:
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor(float(flag), device=accelerator.device)
    return bool(accelerator.reduce(value, "sum").item() > 0)


def _counts(accelerator, *, dropped: int, rounds: int, filled_with_tied: int) -> dict[str, float]:
    """The dynamic/* metrics over every process: groups dropped as tied, generation rounds the step took (the
    same on every process), tied groups used to fill the batch at the cap."""
    local = torch.tensor([float(dropped), float(filled_with_tied)], dtype=torch.float64)
    if accelerator.num_processes > 1:
        local = accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    return {"dynamic/groups_dropped": float(local[0]), "dynamic/generation_rounds": float(rounds),
            "dynamic/tied_groups_used": float(local[1])}
