"""What a training run holds: the long-lived objects (``TrainingRun``) and the state a checkpoint saves
(``TrainState``), with the two functions that write and read the latter.

A checkpoint (grpo_core/train/checkpoint.py) = weights + optimizer + scheduler + ``TrainState`` (step,
micro-step, rollbacks, the data order - under a curriculum with each task's level and window -, the in-flight
round, the round sampled ahead under async rollouts, whether the reference was synced) + every RNG. Restoring
it and running on gives the run that was never interrupted, bit for bit on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from grpo_core.advantages import AdvantageOptions
from grpo_core.common.errors import TrainingFailure
from grpo_core.common.rng import restore_rngs, rng_state
from grpo_core.data.loading import PromptEncoder
from grpo_core.evaluation import EvalMode
from grpo_core.loss import SamplerCorrectionOptions
from grpo_core.rewards.judges import Judges
from grpo_core.rollout import GenerationConfig
from grpo_core.train.batching import BatchOptions, BatchPlan
from grpo_core.train.checkpoint import (
    CheckpointContents,
    CheckpointOptions,
    load_checkpoint,
    save_checkpoint,
)
from grpo_core.train.completions import CompletionLogOptions
from grpo_core.train.entropy import EntropyOptions
from grpo_core.train.optim import OptimizerOptions
from grpo_core.train.policy import Policy
from grpo_core.train.reference import ReferenceOptions
from grpo_core.train.round import Round, Scoring
from grpo_core.train.sampler_worker import SamplerWorker

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from grpo_core.evaluation import EvalOptions
    from grpo_core.loss import GRPOLoss
    from grpo_core.train.forward import LogprobOptions
    from grpo_core.train.round import RolloutOptions, RoundSpec


class TrainingError(TrainingFailure, RuntimeError):
    """Training cannot go on; the message says why."""


class PromptSampler:
    """Prompt indices in seeded epoch permutations (in file order with ``shuffle`` off: TRL's
    ``shuffle_dataset``); its state is two integers, so resume is exact."""

    def __init__(self, num_prompts: int, seed: int, allowed: list[int] | None = None, shuffle: bool = True):
        self.pool = np.asarray(allowed if allowed is not None else range(num_prompts), dtype=np.int64)
        if len(self.pool) == 0:
            raise TrainingError("no training prompts to sample from (after calibration's filtering)")
        self.seed, self.epoch, self.position, self.shuffle = seed, 0, 0, shuffle

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return self.pool
        return self.pool[np.random.default_rng([self.seed, self.epoch]).permutation(len(self.pool))]

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            order = self._order()
            chunk = order[self.position:self.position + n - len(out)]
            out.extend(int(i) for i in chunk)
            self.position += len(chunk)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class Sampler(Protocol):
    """What hands a run its prompts: a PromptSampler, or a curriculum's (grpo_core/train/curriculum.py)."""

    def take(self, n: int) -> list[int]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class HeldOutPrompts:
    """What each evaluation scores, built once at set-up."""

    rows: list[dict]            # the first eval_max_samples rows of the eval split (row i is its row i)
    encoder: PromptEncoder
    reward_fns: list            # the training rewards, K of them
    reward_names: list[str]
    judges: Judges              # correctness and format (grpo_core/rewards/judges.py)
    modes: list[EvalMode]       # greedy, then sampled when num_generations_eval > 0


@dataclass
class Prompts:
    """What a round is sampled from and scored with."""

    dataset: Any                # datasets.Dataset of the train split
    encoder: PromptEncoder
    scoring: Scoring            # the K training rewards, their names and weights
    held_out: HeldOutPrompts | None  # evaluation during training (train.eval_strategy steps), else None


@dataclass
class TrainState:
    """Everything that changes from step to step besides weights, optimizer and scheduler."""

    sampler: Sampler             # the data order: (epoch, position); a curriculum's levels and windows too
    step: int = 0                # optimizer steps taken
    micro_step: int = 0          # micro-batches consumed: step * gradient_accumulation_steps
    rollbacks: int = 0           # guard rollbacks so far (bounded by guards.max_rollbacks)
    round: Round | None = None   # the generation round in use (saved when a checkpoint falls inside it)
    reference_synced: bool = False  # the reference has moved off the base weights (TR-DPO): it is saved too
    entropy_coef: float = 0.0   # the entropy bonus's coefficient (moves each step under use_adaptive_entropy)
    last_entropy: float = float("inf")  # the previous step's entropy over the trained tokens
                                        # (adaptive control)
    pending: Round | None = None  # dynamic sampling: kept groups beyond a round's quota, for the next rounds
    best_step: int | None = None  # the checkpoint with the best metric_for_best_model so far (never pruned)
    best_value: float | None = None  # its value
    ahead: Round | None = None   # async rollouts: the next round, sampled ahead and received
                                 # (saved when in hand)
    ahead_step: int | None = None  # the optimizer steps behind the weights that sampled ``ahead``

    def state_dict(self) -> dict:
        """What a checkpoint's trainer_state.json holds of this state (the step is the checkpoint's own; the
        rounds go in files of their own)."""
        return {"micro_step": self.micro_step, "sampler": self.sampler.state_dict(),
                "rollbacks": self.rollbacks, "entropy_coef": self.entropy_coef,
                "last_entropy": self.last_entropy, "best_step": self.best_step, "best_value": self.best_value,
                "ahead_step": self.ahead_step}

    @classmethod
    def from_state_dict(cls, saved: dict, sampler: Sampler, *, step: int, entropy_coef: float,
                        round: Round | None, ahead: Round | None, pending: Round | None,
                        reference_synced: bool) -> TrainState:
        """The state a checkpoint saved (``state_dict``) with its rounds; ``sampler`` takes the saved data
        order. A key an older checkpoint lacks takes its default (``entropy_coef``: the run's setting)."""
        sampler.load_state_dict(saved["sampler"])
        return cls(sampler=sampler, step=step, micro_step=saved["micro_step"],
                   rollbacks=saved.get("rollbacks", 0), round=round, reference_synced=reference_synced,
                   entropy_coef=saved.get("entropy_coef", entropy_coef),
                   last_entropy=saved.get("last_entropy", float("inf")), pending=pending,
                   best_step=saved.get("best_step"), best_value=saved.get("best_value"), ahead=ahead,
                   ahead_step=saved.get("ahead_step"))


@dataclass
class TrainingRun:
    """The long-lived objects of one ``train()`` call, built once by its set-up phase, with the options each
    phase reads (the groups of params.yaml's `train:`)."""

    seed: int
    max_steps: int
    logging_steps: int
    plan: BatchPlan                # micro-batches, steps and rounds (grpo_core/train/batching.py)
    batch: BatchOptions
    optim: OptimizerOptions
    entropy: EntropyOptions
    sampler_correction: SamplerCorrectionOptions
    advantage: AdvantageOptions
    reference: ReferenceOptions
    checkpoints: CheckpointOptions
    evaluation: EvalOptions        # resolved (eval_steps, num_generations_eval filled in)
    rollouts: RolloutOptions
    completions: CompletionLogOptions
    generation: GenerationConfig   # params.yaml generation: how rounds are sampled
    round_spec: RoundSpec          # sampling, G and reward calls of a round
    logprobs: LogprobOptions       # the trainer's log-prob passes (train's forward keys,
                                   # generation.temperature)
    loss_fn: GRPOLoss              # the objective, built once (grpo_core/loss.py), called per micro-batch
    accelerator: Accelerator
    policy: Policy                 # weights, their copies, optimizer, schedule (grpo_core/train/policy.py)
    tokenizer: PreTrainedTokenizerBase
    params_hash: str         # training_params_hash: a checkpoint from other params is refused
    checkpoint_dir: Path
    sampler: SamplerWorker | None = None  # train.async_rollouts: the sampler worker (set by start_sampler)


def save_state(run: TrainingRun, state: TrainState, metrics: dict, *, keep_round: bool) -> None:
    """checkpoint-<step> from the main process; the others wait until it is in place (so a rollback on any
    process finds it). keep_round: the step ends inside its generation round, so the round is saved and a
    resume trains on it instead of sampling a new one. Sharded (FSDP2): every process first takes part in
    gathering the whole weights and optimizer state, which rank 0 writes in the one-process format."""
    acc = run.accelerator
    acc.wait_for_everyone()
    pending = _gather_pending(acc, state.pending) if run.rollouts.dynamic_sampling else None
    rngs = _per_process(acc, rng_state())  # each process samples its own stream
    weights, optimizer_state, reference = run.policy.checkpoint_parts(with_reference=state.reference_synced)
    if acc.is_main_process:
        meta = {**state.state_dict(), "params_hash": run.params_hash, "world_size": acc.num_processes,
                "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        contents = CheckpointContents(
            model=run.policy.masters, tokenizer=run.tokenizer, optimizer_state=optimizer_state,
            scheduler=run.policy.scheduler, state=meta, weights=weights, reference=reference, rng_states=rngs,
            pending_groups=pending,
            rollout_buffer=state.round.to_buffer() if keep_round and state.round is not None else None,
            ahead_round=state.ahead.to_buffer() if state.ahead is not None else None)
        save_checkpoint(run.checkpoint_dir, state.step, contents, keep_last=run.checkpoints.save_total_limit,
                        keep_step=state.best_step)
    acc.wait_for_everyone()


def restore_state(run: TrainingRun, path: Path, sampler: Sampler) -> TrainState:
    """Load checkpoint ``path`` into the run's policy (weights, optimizer, schedule, a synced reference),
    ``sampler`` and the RNGs; return its ``TrainState`` (whose ``sampler`` is the one passed)."""
    ck = load_checkpoint(path, expected_hash=run.params_hash, device=run.accelerator.device)
    run.policy.restore(path, ck.optimizer, ck.scheduler, ck.reference_file)
    restore_rngs(ck.state["rng"], run.accelerator.process_index, run.seed, ck.state["step"])

    def as_round(buffer: dict | None) -> Round | None:
        return Round.from_buffer(buffer) if buffer is not None else None

    return TrainState.from_state_dict(
        ck.state, sampler, step=ck.state["step"], entropy_coef=run.entropy.entropy_coef,
        round=as_round(ck.rollout_buffer), ahead=as_round(ck.ahead_round),
        pending=_own_pending(ck.pending_groups, run.accelerator, run.plan.group_size),
        reference_synced=ck.reference_file is not None)


def _gather_pending(accelerator, pending: Round | None) -> list[dict | None]:
    """Every process's pending groups as buffers, in process order (a collective on N processes)."""
    return _per_process(accelerator, pending.to_buffer() if pending is not None and len(pending) else None)


def _per_process(accelerator, item: Any) -> list:
    """``item`` of every process, in rank order (a collective on N processes; no communication on one)."""
    if accelerator.num_processes == 1:
        return [item]
    from accelerate.utils import gather_object

    return gather_object([item])


def _own_pending(saved: list[dict | None] | None, accelerator, group_size: int) -> Round | None:
    """This process's pending groups from a checkpoint: its own when the world size is the one saved, else the
    saved groups dealt out group by group over the processes (they are independent of one another)."""
    if not saved:
        return None
    rank, world = accelerator.process_index, accelerator.num_processes
    if len(saved) == world:
        return Round.from_buffer(saved[rank]) if saved[rank] is not None else None
    rounds = [Round.from_buffer(b) for b in saved if b is not None]
    if not rounds:
        return None
    pool = Round.concat(rounds)
    mine = [g * group_size + i for g in range(rank, len(pool) // group_size, world)
            for i in range(group_size)]
    return pool.rows(torch.tensor(mine, dtype=torch.long)) if mine else None
