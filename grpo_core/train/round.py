"""A generation round: the rows one process trains on until the next round is sampled,
and how a new one is made.

N rows, grouped G at a time (rows ``[g*G, (g+1)*G)`` are one prompt's samples); P = prompt width
(left-padded), C = completion width (right-padded). A round feeds ``BatchPlan.optimizer_steps_per_round``
optimizer steps; each micro-batch is ``round.rows(slice(...))``. A new round:

    rows (this process's prompts) -> sample_and_score (grpo_core/rollout/sampling.py)
      -> rewards (N, K) [sample_round] -> gathered over processes -> compute_advantages -> this process's (N,)
      slice [assign_advantages] -> Round
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch

from grpo_core.advantages import AdvantageOptions, compute_advantages, nanstd
from grpo_core.common.options import Options, option
from grpo_core.data.loading import PromptEncoder
from grpo_core.rewards.scoring import RewardCallOptions
from grpo_core.rollout import GenerationConfig, RolloutBackend, SamplingParams, sampling_params
from grpo_core.rollout.sampling import SamplePlan, sample_and_score
from grpo_core.tools import Toolbox, ToolUseOptions, build_toolbox, load_rollout_func


@dataclass
class Round:
    prompt_ids: torch.Tensor       # (N, P) long
    prompt_mask: torch.Tensor      # (N, P) long, 1 = real token
    completion_ids: torch.Tensor   # (N, C) long
    completion_mask: torch.Tensor  # (N, C) long, 1 up to and including the EOS
    is_truncated: torch.Tensor     # (N,) bool: no EOS within max_completion_length
    advantages: torch.Tensor       # (N,) float32, group-relative
    metrics: dict[str, float] = field(default_factory=dict)  # reward/length metrics, over all processes
    old_logps: torch.Tensor | None = None  # (N, C) float32: the sampling policy's,
                                           # when the round feeds > 1 step
    ref_logps: torch.Tensor | None = None  # (N, C) float32: the reference's, when beta > 0
    rewards: torch.Tensor | None = None    # (N, K) float32 per-function rewards (NaN = None), kept while the
                                           # round is assembled (dynamic sampling recomputes the advantages)
    sampling_logps: torch.Tensor | None = None  # (N, C) float32: the sampling engine's own (vLLM), NaN = none
    sampler_ratio: torch.Tensor | None = None   # (N, C) or (N, 1): pi_old / pi_sampler, truncated or masked
    tool_mask: torch.Tensor | None = None       # (N, C) long, rollouts with tools: 1 on the model's tokens,
                                                # 0 on the tool/template tokens between its turns (None: all
                                                # the model's)
    tool_counts: torch.Tensor | None = None     # (N, 3) long, rollouts with tools: per row the tool calls the
                                                # model made, those answered with an error, and its assistant
                                                # turns

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def row_fields(self) -> list[str]:
        """The per-row tensors the round holds (log-probs only once computed)."""
        return [f.name for f in fields(self) if f.name != "metrics" and getattr(self, f.name) is not None]

    def rows(self, index: slice | torch.Tensor) -> Round:
        """Those rows (a slice, or an index tensor) of every per-row tensor; the metrics are the round's."""
        return replace(self, **{name: getattr(self, name)[index] for name in self.row_fields()})

    def model_mask(self) -> torch.Tensor:
        """(N, C) long: the completion tokens the model sampled - tool results and the template's tokens
        around them out. What the loss, entropy, the sampler correction and the length metrics count (as TRL's
        ``completion_mask * tool_mask``); the forward passes attend to every completion token."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def loss_mask(self, mask_truncated_completions: bool) -> torch.Tensor:
        """(N, C) long: the completion tokens the loss counts: the model's (``model_mask``), a truncated row's
        none when asked."""
        mask = self.model_mask().clone()
        if mask_truncated_completions:
            mask = mask * (~self.is_truncated).unsqueeze(1).long()
        return mask

    def to_buffer(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(weights_only=True)`` reads it back): the metrics as JSON bytes."""
        buffer = {name: getattr(self, name) for name in self.row_fields()}
        buffer["metrics_json"] = torch.tensor(list(json.dumps(self.metrics).encode()), dtype=torch.uint8)
        return buffer

    @classmethod
    def concat(cls, rounds: list[Round]) -> Round:
        """The rows of several rounds in order, prompts left-padded and completions right-padded to the widest
        (padding: id 0, mask 0); per-row fields that some round lacks are dropped; the metrics are the
        first's."""
        prompt = max(r.prompt_ids.shape[1] for r in rounds)
        completion = max(r.completion_ids.shape[1] for r in rounds)

        def widened(r: Round) -> dict:
            return {"prompt_ids": _pad(r.prompt_ids, prompt, left=True),
                    "prompt_mask": _pad(r.prompt_mask, prompt, left=True),
                    "completion_ids": _pad(r.completion_ids, completion),
                    "completion_mask": _pad(r.completion_mask, completion),
                    "sampling_logps": None if r.sampling_logps is None
                                      else _pad(r.sampling_logps, completion),
                    "tool_mask": None if r.tool_mask is None else _pad(r.tool_mask, completion),
                    **{n: getattr(r, n) for n in ("is_truncated", "advantages", "rewards", "tool_counts")}}

        parts = [widened(r) for r in rounds]
        shared = [n for n in parts[0] if all(p[n] is not None for p in parts)]
        return cls(metrics=dict(rounds[0].metrics), **{n: torch.cat([p[n] for p in parts]) for n in shared})

    @classmethod
    def from_buffer(cls, buffer: dict[str, torch.Tensor]) -> Round:
        buffer = dict(buffer)
        metrics = json.loads(bytes(buffer.pop("metrics_json").tolist()))
        return cls(metrics=metrics, **buffer)


def _pad(x: torch.Tensor, width: int, left: bool = False) -> torch.Tensor:
    """(N, w) -> (N, width) with zeros on the left (prompts) or the right (completions)."""
    missing = width - x.shape[1]
    if missing == 0:
        return x
    zeros = x.new_zeros(x.shape[0], missing)
    return torch.cat([zeros, x] if left else [x, zeros], dim=1)


@dataclass
class RolloutOptions(Options):
    """params.yaml `train:` keys of how rounds are produced: ahead in a sampler worker, refilled by dynamic
    sampling, their truncated completions kept or masked."""

    async_rollouts: bool | Literal["auto"] = option(
        False, "sample the next round in a sampler worker process (its own copy of the policy, fed the new "
        "weights after each optimizer step, as many torch threads as this process) while this process trains "
        "on the current round (grpo_core/train/sampler_worker.py); one training process, CPU, "
        "generation.backend auto/hf/manual, no dynamic_sampling, no model.quantization. auto: on where all "
        "of these hold (resolved when the config loads), off elsewhere")
    max_staleness: int = option(
        1, "async_rollouts: generation rounds the sampler may run ahead of training. 1: one-step off-policy, "
        "the clipped ratio takes the sampler's log-probs as old log-probs; 0: the worker samples with the "
        "current weights (the synchronous run, for checking)", ge=0, le=1)
    dynamic_sampling: bool = option(
        False, "DAPO's dynamic sampling: groups whose rewards all tie never reach the loss; more prompts are "
        "sampled until the round is full (grpo_core/train/dynamic.py)")
    dynamic_sampling_max_rounds: int = option(
        4, "dynamic_sampling: samplings a round may take to fill up; past them tied groups fill what is "
        "missing (counted as dynamic/tied_groups_used)", ge=1)
    mask_truncated_completions: bool = option(
        False, "exclude completions that hit max_completion_length from the loss")


@dataclass(frozen=True)
class RoundSpec:
    """How a round is sampled and scored."""

    sampling: SamplingParams          # generation.* (grpo_core.rollout.sampling_params)
    num_generations: int              # G
    reward_calls: RewardCallOptions   # train.reward_errors, reward_timeout_s
    tools: Toolbox | None = None      # train.tools / environment_factory (grpo_core.tools.build_toolbox):
                                      # rollouts are conversations with tool calls
    # train.rollout_func (grpo_core.rollout.custom): the user's own rollout
    rollout_func: Callable | None = None

    @classmethod
    def from_config(cls, g: GenerationConfig, num_generations: int, reward_calls: RewardCallOptions,
                    tool_use: ToolUseOptions) -> RoundSpec:
        """params.yaml ``generation`` and ``train``'s G, reward calls and tools / environments / rollout
        function (imported and checked here)."""
        return cls(sampling_params(g), num_generations, reward_calls, tools=build_toolbox(tool_use),
                   rollout_func=load_rollout_func(tool_use))


@dataclass(frozen=True)
class Scoring:
    """The K reward functions a round is scored with, their names and their weights."""

    reward_fns: list            # K callables (grpo_core.rewards.build_reward_functions)
    reward_names: list[str]     # K names, the columns of the reward matrix
    weights: torch.Tensor       # (K,) one per reward function


def sample_round(*, backend: RolloutBackend, tokenizer, rows: list[dict], row_ids: list[int],
                 encoder: PromptEncoder, scoring: Scoring, spec: RoundSpec, accelerator) -> Round:
    """Sampled and scored rows with their rewards (N, K) and the round's metrics; advantages still zero.

    rows: the dataset rows of this process's prompts, row_ids their dataset indices (named in errors). Whole
    groups live on one process; the metrics see the global batch (gathered over processes).
    """
    G = spec.num_generations
    plan = SamplePlan(G, spec.sampling, batch_size=len(rows), on_error=spec.reward_calls.reward_errors,
                      reward_timeout_s=spec.reward_calls.reward_timeout_s, keep_batches=True,
                      tools=spec.tools, rollout_func=spec.rollout_func)
    sampled = sample_and_score(None, tokenizer, rows, encoder, scoring.reward_fns, plan, backend=backend,
                               row_ids=row_ids)
    (batch,) = sampled.batches
    rewards = torch.as_tensor(sampled.rewards, dtype=torch.float32)                     # (N, K)
    metrics = reward_metrics(gather_rows(accelerator, rewards), scoring.weights, G, scoring.reward_names)
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
                                   for c in (sampled.tool_calls, sampled.tool_failures, sampled.turns)],
                                  dim=1)  # (N, 3)
    return Round(prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                 completion_ids=batch.completion_ids, completion_mask=batch.completion_mask,
                 is_truncated=batch.is_truncated, advantages=torch.zeros(len(rewards)), metrics=metrics,
                 rewards=rewards, sampling_logps=batch.sampling_logps, tool_mask=batch.tool_mask,
                 tool_counts=tool_counts)


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
    """TRL 1.16's reward metrics of (N, K) rewards: the weighted reward's mean and std over the batch
    (``reward``, ``reward_std``; a row every function returned None for is left out), the share of groups
    whose weighted rewards are all equal, and each function's mean and std over the samples it applies to."""
    unscorable = torch.isnan(rewards).all(dim=1)
    total = torch.nansum(rewards * weights.to(rewards.dtype), dim=1).masked_fill(unscorable, math.nan)  # (N,)
    group_std = nanstd(total.view(-1, group_size), dim=1)                                           # (N / G,)
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
    """TRL's tools/* metrics over every process's rows - tool calls per completion, failed calls per
    call - and assistant turns per completion. calls, failures, turns: (N,) per completion."""
    local = torch.tensor([float(sum(calls)), float(sum(failures)), float(sum(turns)), float(len(turns))],
                         dtype=torch.float64)
    if accelerator.num_processes > 1:
        local = accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    calls, failures, turns, completions = local.tolist()
    return {"tools/call_frequency": calls / max(completions, 1.0),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/mean_turns": turns / max(completions, 1.0)}


def length_metrics(accelerator, completion_mask: torch.Tensor,
                   is_truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics over every process's rows: mean/min/max length and the truncated share.
    completion_mask: the model's tokens (tool blocks out, as TRL counts)."""
    both = gather_rows(accelerator,
                       torch.stack([completion_mask.sum(1).float(), is_truncated.float()], dim=1))
    lengths, truncated = both[:, 0], both[:, 1]
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item()}


def gather_rows(accelerator, rows: torch.Tensor) -> torch.Tensor:
    """Every process's rows, in process order, on the CPU (the tensor itself on one process)."""
    if accelerator.num_processes == 1:
        return rows
    return accelerator.gather(rows.to(accelerator.device)).cpu()
