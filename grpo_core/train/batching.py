"""The batch arithmetic of a run, in one place: groups, micro-batches, optimizer steps and generation rounds.

Units, as the names say: a *completion* is one sampled row; a *group* is G completions of one prompt; a
*micro-batch* is what one forward/backward pass of one process holds; an *optimizer step* takes
``micro_batches_per_step`` micro-batches; a *round* is one generation (sampling) over every process, trained
on ``num_iterations`` times. TRL's names stay as the params.yaml keys.

The rows of a step are ordered by length across its micro-batches (``length_grouped_order``), so each pads to
its own longest row; rows move only within their step, so every step trains on the rows it would have (only
bnpo, normalised per micro-batch, weighs tokens differently). ``trim_padding`` drops a micro-batch's empty
columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_core.common.options import ConfigError, Options, option


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
                                   "longest row (grpo_core/train/batching.py; "
                                   "no effect with one micro-batch per step)")
    shuffle_dataset: bool = option(True, "prompts in a seeded new order each epoch; false: in file order")

    def plan(self, num_processes: int) -> BatchPlan:
        return BatchPlan(group_size=self.num_generations, micro_batch_size=self.per_device_train_batch_size,
                         micro_batches_per_step=self.gradient_accumulation_steps,
                         micro_batches_per_round=self.steps_per_generation
                                                 or self.gradient_accumulation_steps,
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
                f"{self.micro_batches_per_round} = {self.generation_batch_size} completions) must be "
                f"divisible by train.num_generations ({self.group_size}) so that whole groups are sampled")
        if self.num_processes > 1 and self.completions_per_round % self.group_size:
            raise ConfigError(
                "train.per_device_train_batch_size: each process samples whole groups, so its rows per "
                f"round (per_device_train_batch_size {self.micro_batch_size} x steps_per_generation "
                f"{self.micro_batches_per_round}) must be divisible by train.num_generations "
                f"({self.group_size})")

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


def length_grouped_order(prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, group_size: int,
                         span: int, keep_groups: bool) -> torch.Tensor:
    """A permutation of the N rows: rows [s, s + span) stay in that range, sorted there longest first.

    prompt_lengths, completion_lengths: (N,) real tokens per row; rows come G = group_size at a time (a
    prompt's G samples on adjacent rows). A row's length is prompt + completion.
    keep_groups: a group's rows stay adjacent (the hand-written forward computes a prompt shared by adjacent
    rows once): the pieces of groups inside a span are ordered by their longest row, and rows inside a piece
    by their own length. Otherwise every row is placed by its own length.
    Ties keep their order (a stable sort): the result is a pure function of the lengths.

    Returns: (N,) long, ``new_rows = rows[order]``.
    """
    n = prompt_lengths.shape[0]
    if completion_lengths.shape != (n,) or prompt_lengths.ndim != 1:
        raise ValueError(f"prompt_lengths and completion_lengths must be (N,) alike, got "
                         f"{tuple(prompt_lengths.shape)} and {tuple(completion_lengths.shape)}")
    if group_size < 1 or span < 1:
        raise ValueError(f"group_size and span must be >= 1, got {group_size} and {span}")
    length = (prompt_lengths + completion_lengths).long()
    order = []
    for start in range(0, n, span):
        rows = torch.arange(start, min(start + span, n))
        key = length[rows]
        if keep_groups:
            # Rank each row by (its piece's longest row, then its own length), longest first; pieces with
            # equal longest rows stay in order, so a piece is never split.
            piece = rows // group_size
            piece_max = torch.zeros(int(piece.max()) + 1, dtype=torch.long).scatter_reduce(
                0, piece, key, reduce="amax", include_self=False)[piece]
            # Sort by row length first, then stably by (piece max, piece): the last sort wins,
            # ties keep the first's.
            by_row = torch.sort(key, descending=True, stable=True).indices
            by_piece = torch.sort(piece_max[by_row] * (n + 1) + (n - piece[by_row]), descending=True,
                                  stable=True).indices
            order.append(rows[by_row[by_piece]])
        else:
            order.append(rows[torch.sort(key, descending=True, stable=True).indices])
    return torch.cat(order) if order else torch.zeros(0, dtype=torch.long)


def trim_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                 completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt and completion side by side, without the columns that are padding in every row.

    prompt_ids, prompt_mask: (B, P), left-padded; completion_ids, completion_mask: (B, C), right-padded.
    Returns input_ids (B, P' + C'), attention_mask (B, P' + C') and completion_mask (B, C'), where P' drops
    the leading all-padding prompt columns and C' = the longest completion (at least 1 column).
    """
    first = int((prompt_mask.sum(0) > 0).int().argmax()) if prompt_mask.any() else prompt_mask.shape[1]
    width = int(completion_mask.sum(1).max()) if completion_mask.any() else 1
    input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :width]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :width]], dim=1)
    return input_ids, attention_mask, completion_mask[:, :width]
