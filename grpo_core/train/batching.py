"""The batch arithmetic of a run, in one place: groups, micro-batches, optimizer steps and generation rounds.

Units, as the names say: a *completion* is one sampled row; a *group* is G completions of one prompt; a
*micro-batch* is what one forward/backward pass of one process holds; an *optimizer step* takes
``micro_batches_per_step`` micro-batches; a *round* is one generation (sampling) over every process, trained on
``num_iterations`` times. TRL's names stay as the params.yaml keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_core.options import ConfigError, Options, option


@dataclass
class BatchOptions(Options):
    """params.yaml `train:` keys of what a micro-batch, a step and a generation round hold."""

    num_generations: int = option(8, "G: completions sampled per prompt (the group)", ge=2)
    per_device_train_batch_size: int = option(8, "completions per micro-batch per process", ge=1)
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", ge=1)
    steps_per_generation: int | None = option(
        None, "micro-batches one generation round feeds per process, per pass (TRL's name; None = "
        "gradient_accumulation_steps)", ge=1)
    num_iterations: int = option(1, "optimisation passes over each generation round (mu)", ge=1)
    group_by_length: bool = option(True, "sort a step's rows by length so each micro-batch pads to its own "
                                   "longest row (grpo_core/microbatch.py; no effect with one micro-batch per step)")
    shuffle_dataset: bool = option(True, "prompts in a seeded new order each epoch; false: in file order")

    def plan(self, num_processes: int) -> BatchPlan:
        return BatchPlan(group_size=self.num_generations, micro_batch_size=self.per_device_train_batch_size,
                         micro_batches_per_step=self.gradient_accumulation_steps,
                         micro_batches_per_round=self.steps_per_generation or self.gradient_accumulation_steps,
                         passes_per_round=self.num_iterations, num_processes=num_processes)


@dataclass(frozen=True)
class BatchPlan:
    """The run's batch sizes, derived once from ``BatchOptions`` and the process count; checked on creation
    (errors name the params.yaml key)."""

    group_size: int               # G
    micro_batch_size: int         # completions per micro-batch, per process
    micro_batches_per_step: int   # gradient accumulation
    micro_batches_per_round: int  # per process and pass
    passes_per_round: int         # num_iterations
    num_processes: int

    def __post_init__(self) -> None:
        if self.generation_batch_size % self.group_size:
            raise ConfigError(
                f"train.per_device_train_batch_size: the generation batch (per_device_train_batch_size "
                f"{self.micro_batch_size} x num_processes {self.num_processes} x steps_per_generation "
                f"{self.micro_batches_per_round} = {self.generation_batch_size} completions) must be divisible "
                f"by train.num_generations ({self.group_size}) so that whole groups are sampled")
        if self.num_processes > 1 and self.completions_per_round % self.group_size:
            raise ConfigError(
                f"train.per_device_train_batch_size: each process samples whole groups, so its rows per round "
                f"(per_device_train_batch_size {self.micro_batch_size} x steps_per_generation "
                f"{self.micro_batches_per_round}) must be divisible by train.num_generations ({self.group_size})")

    @property
    def completions_per_round(self) -> int:
        """Completions one process samples per round."""
        return self.micro_batch_size * self.micro_batches_per_round

    @property
    def prompts_per_round(self) -> int:
        """Prompts (groups) one process samples per round."""
        return self.completions_per_round // self.group_size

    @property
    def generation_batch_size(self) -> int:
        """Completions sampled per round over all processes (TRL's generation_batch_size)."""
        return self.completions_per_round * self.num_processes

    @property
    def micro_batches_per_round_trained(self) -> int:
        """Micro-batches a round is trained on, over all its passes."""
        return self.micro_batches_per_round * self.passes_per_round

    @property
    def optimizer_steps_per_round(self) -> int:
        """Optimizer steps a round feeds, over all its passes."""
        return self.micro_batches_per_round // self.micro_batches_per_step * self.passes_per_round
