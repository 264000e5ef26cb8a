"""The policy a run trains and every copy of its weights, behind the verbs the loop uses.

    module      what runs forward and backward: the policy itself (one process), DDP-wrapped (N processes),
                fully_shard-ed (FSDP2), or the bf16 compute copy of the float32 masters
    masters     the weights the optimizer steps, unwrapped (under FSDP2 the sharded model itself):
                checkpoints, export, the reference's TR-DPO mix and the sampler worker read them
    reference   the frozen reference (beta > 0), LoRA's adapter-off view of the policy, or None
    rollouts    what rounds are sampled from (``grpo_core.rollout.RolloutBackend``): a backend over the
                masters, over a whole replica of them (sharded runs, the cast copy), or over the compute copy;
                ``sync_rollouts`` hands it the masters after every change
    optimizer, scheduler

Each placement is a function below (``place_policy`` picks one): ``place_sharded`` (FSDP2),
``place_compute_copy`` (bf16 compute weights over float32 masters, one process or N), ``place_whole``
(one process or DDP, full fine-tuning or LoRA; a half-precision model.dtype samples from a cast copy).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo_core.model.loading import DTYPES, owns_weights
from grpo_core.model.sharding import (
    FSDPSettings,
    clip_gradients,
    gather_optimizer_state,
    gather_weights,
    is_sharded,
    load_optimizer_state,
    shard_model,
)
from grpo_core.rollout import GenerationConfig, RolloutBackend
from grpo_core.train.checkpoint import restore_policy_weights, restore_reference_weights
from grpo_core.train.compute_weights import ComputeWeights
from grpo_core.train.export import whole_model
from grpo_core.train.optim import OptimizerOptions, build_optimizer_and_scheduler, scale_learning_rate
from grpo_core.train.reference import mix_reference
from grpo_core.train.replica import EngineFromShards, ReplicaRollouts

if TYPE_CHECKING:
    from accelerate import Accelerator

    from grpo_core.model.loading import ModelConfig


@dataclass
class Policy:
    """The weights a run trains, their copies, and what steps them (the module docstring draws each)."""

    module: torch.nn.Module            # forward and backward
    masters: torch.nn.Module           # what the optimizer steps, unwrapped: save, sync and export these
    reference: torch.nn.Module | None  # frozen (moved by TR-DPO's mix only), sharded as the policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rollouts: RolloutBackend
    replica: torch.nn.Module | None = None   # a whole copy that samples (sharded runs, the cast copy)
    compute: ComputeWeights | None = None    # the bf16 compute copy: ``module``, and what rollouts sample

    @property
    def sharded(self) -> bool:
        return is_sharded(self.module)

    def train_mode(self) -> None:
        """Training mode for what trains and for the masters (the sampler worker copies their mode)."""
        self.module.train()
        self.masters.train()

    def gradient_sync(self, accelerator: Accelerator, *, last: bool):
        """The context a micro-batch's backward runs in: on N processes DDP all-reduces once, after the step's
        ``last`` micro-batch. FSDP2 reduce-scatters every micro-batch (deferring would keep whole, unsharded
        gradients on every process - the memory sharding exists to save); a compute copy reduces in
        ``finish_gradients``, and accelerate's ``no_sync`` leaves its unwrapped module alone."""
        defer = not last and accelerator.num_processes > 1 and not self.sharded
        return accelerator.no_sync(self.module) if defer else contextlib.nullcontext()

    def finish_gradients(self, accelerator: Accelerator, max_grad_norm: float) -> torch.Tensor:
        """The step's gradients on the masters, averaged over processes, clipped to ``max_grad_norm`` (0: not
        clipped); the norm before clipping."""
        if self.compute is not None:  # the masters' float32 gradients, averaged as DDP would
            self.compute.all_reduce_gradients(accelerator.num_processes)
        max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
        if self.sharded:
            return clip_gradients(self.masters.parameters(), max_norm)
        return accelerator.clip_grad_norm_(self.masters.parameters(), max_norm)

    def step(self) -> None:
        """The optimizer's and the schedule's step."""
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def learning_rate(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def scale_learning_rate(self, factor: float) -> None:
        scale_learning_rate(self.optimizer, self.scheduler, factor)

    def sync_rollouts(self) -> None:
        """The masters into what rounds are sampled from (collective when sharded: every process calls it)."""
        if self.compute is not None:  # the masters cast into the copy that trains and samples
            self.compute.refresh()
            self.rollouts.sync_weights(self.compute.model)
        else:
            self.rollouts.sync_weights(self.masters)

    def mix_into_reference(self, alpha: float) -> None:
        """TR-DPO: reference <- alpha * policy + (1 - alpha) * reference."""
        mix_reference(self.reference, self.masters, alpha)

    def whole(self) -> torch.nn.Module | None:
        """The whole policy to export (collective when sharded without a replica; None off the main
        process then)."""
        return whole_model(self.masters, self.replica)

    def checkpoint_parts(self, *, with_reference: bool) -> tuple[dict | None, dict, dict | None]:
        """(whole weights - None when ``masters`` is whole and saves itself -, optimizer state, reference
        weights or None). Sharded: collective, every process takes part in the gathering."""
        reference = self.reference if with_reference else None
        if self.sharded:
            return (gather_weights(self.masters), gather_optimizer_state(self.masters, self.optimizer),
                    gather_weights(reference) if reference is not None else None)
        return None, self.optimizer.state_dict(), reference.state_dict() if reference is not None else None

    def restore(self, path: Path, optimizer_state: dict, scheduler_state: dict,
                reference_file: Path | None) -> None:
        """A checkpoint's weights, optimizer and schedule (and its synced reference, when it saved one)."""
        restore_policy_weights(self.masters, path)
        if self.sharded:
            load_optimizer_state(self.masters, self.optimizer, optimizer_state)
        else:
            self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(scheduler_state)
        if reference_file is not None and self.reference is not None:
            restore_reference_weights(self.reference, reference_file)

    def restore_weights(self, path: Path) -> None:
        """A checkpoint's weights alone (load_best_model_at_end), handed to the rollouts too."""
        restore_policy_weights(self.masters, path)
        self.sync_rollouts()


# ---------------------------------------------------------------------------------------------------
# Placements: the float32 policy (and its reference) as this run's strategy holds them


@dataclass(frozen=True)
class Placing:
    """What every placement needs besides the model: the run's options and how to build a sampler."""

    accelerator: Accelerator
    model_config: ModelConfig
    generation: GenerationConfig
    optim: OptimizerOptions
    max_steps: int
    mixed_precision: str   # train.mixed_precision (FSDP2's compute dtype)
    make_sampler: Callable[[torch.nn.Module], RolloutBackend]  # a backend over the module that samples


def place_policy(placing: Placing, model: torch.nn.Module, reference: torch.nn.Module | None, *,
                 fsdp: FSDPSettings | None, compute_copy: bool) -> Policy:
    """The placement this run's strategy asks for (``fsdp``: the FSDP2 plugin's settings, or None)."""
    if fsdp is not None and placing.accelerator.num_processes > 1:
        return place_sharded(placing, model, reference, fsdp)
    if reference is not None and owns_weights(reference):
        reference.to(placing.accelerator.device)
    if compute_copy:
        return place_compute_copy(placing, model, reference)
    return place_whole(placing, model, reference)


def place_sharded(placing: Placing, model: torch.nn.Module, reference: torch.nn.Module | None,
                  fsdp: FSDPSettings) -> Policy:
    """FSDP2: the policy and the reference sharded; rollouts from a whole replica in model.dtype, or, a
    colocated vLLM engine, from the shards streamed into the engine (its copy is the only whole one)."""
    acc = placing.accelerator
    g = placing.generation
    engine = g.backend == "vllm" and g.vllm_mode == "colocate"
    replica = None if engine else copy.deepcopy(model).to(acc.device, DTYPES[placing.model_config.dtype])
    shard_model(model.to(acc.device), fsdp, placing.mixed_precision)
    if reference is not None:
        shard_model(reference.to(acc.device), fsdp)
    optimizer, scheduler = build_optimizer_and_scheduler(model, placing.optim, placing.max_steps)
    rollouts = (EngineFromShards(placing.make_sampler(model)) if engine
                else ReplicaRollouts(replica, placing.make_sampler))
    return Policy(model, model, reference, optimizer, scheduler, rollouts, replica=replica)


def place_compute_copy(placing: Placing, model: torch.nn.Module, reference: torch.nn.Module | None) -> Policy:
    """bf16 compute weights: the float32 masters stepped by the optimizer; their bf16 copy trains and
    samples (grpo_core/train/compute_weights.py)."""
    masters = model.to(placing.accelerator.device)
    optimizer, scheduler = build_optimizer_and_scheduler(masters, placing.optim, placing.max_steps)
    compute = ComputeWeights(masters)
    rollouts = placing.make_sampler(compute.model)
    return Policy(compute.model, masters, reference, optimizer, scheduler, rollouts, compute=compute)


def place_whole(placing: Placing, model: torch.nn.Module, reference: torch.nn.Module | None) -> Policy:
    """One process or DDP (accelerate's prepare), full fine-tuning or LoRA; a half-precision model.dtype
    samples from a copy in that dtype, refreshed after every step (``samples_from_a_cast_copy``)."""
    acc = placing.accelerator
    optimizer, scheduler = build_optimizer_and_scheduler(model, placing.optim, placing.max_steps)
    module, optimizer = acc.prepare(model, optimizer)
    masters = acc.unwrap_model(module)
    if samples_from_a_cast_copy(placing.model_config, placing.generation, masters):
        replica = copy.deepcopy(masters).to(DTYPES[placing.model_config.dtype]).eval()
        return Policy(module, masters, reference, optimizer, scheduler,
                      ReplicaRollouts(replica, placing.make_sampler), replica=replica)
    return Policy(module, masters, reference, optimizer, scheduler, placing.make_sampler(masters))


def samples_from_a_cast_copy(model_config: ModelConfig, generation: GenerationConfig,
                             policy: torch.nn.Module) -> bool:
    """Whether rollouts sample from a copy of the policy in ``model.dtype`` (e.g. bf16) instead of the float32
    masters: full fine-tuning with a half-precision model.dtype, sampled by HF generate or the decode loop.
    The masters under autocast would run every decode step on float32 weights (a cast of each weight per op, a
    float32 residual stream) and HF's static KV cache would get K and V in two dtypes; a bf16 copy runs as a
    bf16 model does. Not under LoRA (the frozen base is in model.dtype already) nor vLLM (its engine is in
    model.dtype)."""
    dtype = DTYPES[model_config.dtype]
    return (model_config.lora is None and generation.backend != "vllm" and dtype != torch.float32
            and any(p.dtype != dtype for p in policy.parameters()))
