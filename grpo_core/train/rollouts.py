"""A new generation round: sample G completions per prompt, score them, compute the group-relative advantages.

    rows (this process's prompts) -> sample_and_score (the one sample-and-score, grpo_core/sampling.py)
      -> rewards (N, K) [sample_round] -> gathered over processes -> compute_advantages -> this process's (N,)
      slice [assign_advantages] -> Round
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from grpo_core.advantages import AdvantageOptions, compute_advantages, nanstd
from grpo_core.data import PromptEncoder
from grpo_core.options import Options, option
from grpo_core.rewards.scoring import RewardCallOptions
from grpo_core.rollout import GenerationConfig, RolloutBackend, SamplingParams, sampling_params
from grpo_core.sampling import sample_and_score
from grpo_core.tools import Toolbox, ToolUseOptions, build_toolbox, load_rollout_func
from grpo_core.train.round import Round


@dataclass
class RolloutOptions(Options):
    """params.yaml `train:` keys of how rounds are produced: ahead in a sampler worker, refilled by dynamic
    sampling, their truncated completions kept or masked."""

    async_rollouts: bool | Literal["auto"] = option(
        False, "sample the next round in a sampler worker process (its own copy of the policy, fed the new weights "
        "after each optimizer step, as many torch threads as this process) while this process trains on the "
        "current round (grpo_core/train/sampler_worker.py); one training process, CPU, generation.backend "
        "auto/hf/manual, no dynamic_sampling, no model.quantization. auto: on where all of these hold (resolved "
        "when the config loads), off elsewhere")
    max_staleness: int = option(
        1, "async_rollouts: generation rounds the sampler may run ahead of training. 1: one-step off-policy, the "
        "clipped ratio takes the sampler's log-probs as old log-probs; 0: the worker samples with the current "
        "weights (the synchronous run, for checking)", ge=0, le=1)
    dynamic_sampling: bool = option(
        False, "DAPO's dynamic sampling: groups whose rewards all tie never reach the loss; more prompts are "
        "sampled until the round is full (grpo_core/train/dynamic.py)")
    dynamic_sampling_max_rounds: int = option(
        4, "dynamic_sampling: samplings a round may take to fill up; past them tied groups fill what is missing "
        "(counted as dynamic/tied_groups_used)", ge=1)
    mask_truncated_completions: bool = option(
        False, "exclude completions that hit max_completion_length from the loss")


@dataclass(frozen=True)
class RoundSpec:
    """How a round is sampled and scored."""

    sampling: SamplingParams          # generation.* (grpo_core.rollout.sampling_params)
    num_generations: int              # G
    reward_calls: RewardCallOptions   # train.reward_errors, reward_timeout_s
    tools: Toolbox | None = None      # train.tools / environment_factory (grpo_core.tools.build_toolbox): rollouts
                                      # are conversations with tool calls
    rollout_func: Callable | None = None  # train.rollout_func (grpo_core.rollout.custom): the user's own rollout

    @classmethod
    def from_config(cls, g: GenerationConfig, num_generations: int, reward_calls: RewardCallOptions,
                    tool_use: ToolUseOptions) -> RoundSpec:
        """params.yaml ``generation`` and ``train``'s G, reward calls and tools / environments / rollout function
        (imported and checked here)."""
        return cls(sampling_params(g), num_generations, reward_calls, tools=build_toolbox(tool_use),
                   rollout_func=load_rollout_func(tool_use))


def sample_round(*, backend: RolloutBackend, tokenizer, rows: list[dict], row_ids: list[int], encoder: PromptEncoder,
                 reward_fns, reward_names: list[str], weights: torch.Tensor, spec: RoundSpec, accelerator) -> Round:
    """Sampled and scored rows with their rewards (N, K) and the round's metrics; advantages still zero.

    rows: the dataset rows of this process's prompts, row_ids their dataset indices (named in errors).
    weights: (K,) one per reward function. Whole groups live on one process; the metrics see the global batch
    (gathered over processes).
    """
    G = spec.num_generations
    sampled = sample_and_score(None, tokenizer, rows, encoder, reward_fns,
                               num_generations=G, sampling=spec.sampling, batch_size=len(rows),
                               on_error=spec.reward_calls.reward_errors, backend=backend,
                               reward_timeout_s=spec.reward_calls.reward_timeout_s,
                               row_ids=row_ids, keep_batches=True, tools=spec.tools,
                               rollout_func=spec.rollout_func)
    (batch,) = sampled.batches
    rewards = torch.as_tensor(sampled.rewards, dtype=torch.float32)                     # (N, K)
    metrics = reward_metrics(gather_rows(accelerator, rewards), weights, G, reward_names)
    metrics.update(length_metrics(accelerator, batch.model_mask, batch.is_truncated))
    metrics.update({
        "reward_errors": float(sum(sampled.error_counts.values())),
        "reward_timeouts": float(sum(sampled.timeout_counts.values())),
        "generation_time": sampled.generation_time,
    })
    tool_counts = None
    if spec.tools is not None:
        metrics.update(tool_metrics(accelerator, sampled.tool_calls, sampled.tool_failures, sampled.turns))
        tool_counts = torch.stack([torch.as_tensor(c, dtype=torch.long)
                                   for c in (sampled.tool_calls, sampled.tool_failures, sampled.turns)], dim=1)  # (N, 3)
    return Round(prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask, completion_ids=batch.completion_ids,
                 completion_mask=batch.completion_mask, is_truncated=batch.is_truncated,
                 advantages=torch.zeros(len(rewards)), metrics=metrics, rewards=rewards,
                 sampling_logps=batch.sampling_logps, tool_mask=batch.tool_mask, tool_counts=tool_counts)


def assign_advantages(round_: Round, weights: torch.Tensor, a: AdvantageOptions, group_size: int,
                      accelerator) -> Round:
    """The round with its group-relative advantages (N,), computed over every process's rewards (so
    ``scale_rewards="batch"`` and the groups see the global batch)."""
    all_rewards = gather_rows(accelerator, round_.rewards)                                    # (world * N, K)
    advantages = compute_advantages(all_rewards, weights, group_size, scale=a.scale_rewards,
                                    aggregation=a.multi_objective_aggregation)
    if accelerator.num_processes > 1:
        n = len(round_)
        advantages = advantages[accelerator.process_index * n:(accelerator.process_index + 1) * n]
    return replace(round_, advantages=advantages.float())


def reward_metrics(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, names: list[str]) -> dict:
    """TRL 1.16's reward metrics of (N, K) rewards: the weighted reward's mean and std over the batch (``reward``,
    ``reward_std``; a row every function returned None for is left out), the share of groups whose weighted
    rewards are all equal, and each function's mean and std over the samples it applies to."""
    unscorable = torch.isnan(rewards).all(dim=1)
    total = torch.nansum(rewards * weights.to(rewards.dtype), dim=1).masked_fill(unscorable, math.nan)  # (N,)
    group_std = nanstd(total.view(-1, group_size), dim=1)                                                # (N / G,)
    out = {
        "reward": torch.nanmean(total).item(),
        "reward_std": nanstd(total, dim=0).item(),
        "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
    }
    for k, name in enumerate(names):
        col = rewards[:, k]
        valid = col[~torch.isnan(col)]
        out[f"rewards/{name}/mean"] = valid.mean().item() if len(valid) else float("nan")
        out[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else float("nan")
    return out


def tool_metrics(accelerator, calls, failures, turns) -> dict[str, float]:
    """TRL's tools/* metrics over every process's rows - tool calls per completion, failed calls per call - and
    assistant turns per completion. calls, failures, turns: (N,) per completion."""
    local = torch.tensor([float(sum(calls)), float(sum(failures)), float(sum(turns)), float(len(turns))],
                         dtype=torch.float64)
    if accelerator.num_processes > 1:
        local = accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    calls, failures, turns, completions = local.tolist()
    return {"tools/call_frequency": calls / max(completions, 1.0),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/mean_turns": turns / max(completions, 1.0)}


def length_metrics(accelerator, completion_mask: torch.Tensor, is_truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics over every process's rows: mean/min/max length and the truncated share.
    completion_mask: the model's tokens (tool blocks out, as TRL counts)."""
    both = gather_rows(accelerator, torch.stack([completion_mask.sum(1).float(), is_truncated.float()], dim=1))
    lengths, truncated = both[:, 0], both[:, 1]
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}


def gather_rows(accelerator, rows: torch.Tensor) -> torch.Tensor:
    """Every process's rows, in process order, on the CPU (the tensor itself on one process)."""
    if accelerator.num_processes == 1:
        return rows
    return accelerator.gather(rows.to(accelerator.device)).cpu()
