"""params.yaml `embedded:` — the embedded default's synthetic task, tiny model and warm start.

Declared as every section is (grpo_core/common/options.py): each key's default, limits and meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_core.common.options import ConfigError, Options, option

TaskName = Literal["arithmetic", "multiple_choice", "calculator"]

#: the task with chat prompts and a calculator tool (grpo_core/embedded/tool_tasks.py)
TOOL_TASK = "calculator"
#: the smallest embedded.max_operand the tool task accepts (its numbers start at 10)
MIN_MAX_OPERAND = 10

#: prepare's outputs in dvc.yaml: the embedded default's data and base model.
EMBEDDED_DATA_DIR = "data/prepared"
EMBEDDED_MODEL_DIR = "artifacts/base_model"


@dataclass
class EmbeddedConfig(Options):
    seed: int = option(0, "seed for the data, the model's initial weights and the warm-start batches")
    num_train: int = option(3000, "training prompts", ge=1)
    num_eval: int = option(500, "held-out prompts (no prompt shared with train)", ge=1)
    tasks: list[TaskName] = option(
        ["arithmetic", "multiple_choice"],
        "task variants, mixed in equal shares; or [calculator] alone: chat prompts answered with the "
        "calculator tool (grpo_core/embedded/tools.py; configs/embedded-tools.yaml)",
    )
    max_operand: int = option(
        9,
        "largest number in a word problem (operands are 1..max_operand); calculator: its numbers are "
        "10..max_operand (a product's second factor 2..99), >= 10",
        ge=3,
        le=999,
    )
    shuffle_options: bool = option(
        False, "shuffle multiple-choice options (else A = sum, B = difference, C/D near misses)"
    )
    # dvc.yaml names these two folders as prepare's outputs, so under `dvc repro` they stay at their defaults
    # (grpo_core.config refuses other values in params.yaml); other callers of the builder may point them
    # anywhere.
    model_dir: str = option(EMBEDDED_MODEL_DIR,
                            "where the base model and tokenizer are written (fixed under DVC)")
    data_dir: str = option(EMBEDDED_DATA_DIR,
                           "where train.jsonl and eval.jsonl are written (fixed under DVC)")
    hidden_size: int = option(96, "model width", ge=8)
    num_hidden_layers: int = option(3, "transformer blocks", ge=1)
    num_attention_heads: int = option(4, "attention heads (hidden_size must divide by it)", ge=1)
    intermediate_size: int = option(256, "MLP width", ge=8)
    warm_start_steps: int = option(400, "supervised warm-start steps (0 = untrained base model)", ge=0)
    warm_start_batch_size: int = option(64, "demonstrations per warm-start step", ge=1)
    warm_start_learning_rate: float = option(
        3.0e-3, "AdamW peak learning rate (warm-up, then cosine decay)", gt=0
    )
    label_noise: float = option(
        0.5,
        "mean share of demonstrations that apply the wrong operation (calculator: that answer a wrong guess "
        "without calling the tool)",
        ge=0,
        le=1,
    )
    label_noise_spread: float = option(
        0.3,
        "per-template wrong-operation (calculator: guess) share spans label_noise ± this (heterogeneous "
        "headroom)", ge=0,
        le=0.5,
    )
    format_noise: float = option(
        0.1,
        "share of demonstrations with a broken tag layout (calculator: of tool calls with a broken "
        "expression, which the tool rejects)", ge=0,
        le=1,
    )
    num_threads: int = option(
        1,
        "torch CPU threads for prepare (0 = torch's default); weights are bit-identical per thread count",
        ge=0,
    )

    def check(self) -> None:
        """The calculator task (chat prompts, a tool) stands alone and needs multi-digit numbers."""
        if TOOL_TASK in self.tasks and len(self.tasks) > 1:
            raise ConfigError(f"tasks: {self.tasks}; {TOOL_TASK} has chat prompts and a tool, the word "
                              f"problems neither: it cannot be mixed with them (tasks: [{TOOL_TASK}])")
        if TOOL_TASK in self.tasks and self.max_operand < MIN_MAX_OPERAND:
            raise ConfigError(f"max_operand: {self.max_operand}; the {TOOL_TASK} task's numbers are "
                              f"{MIN_MAX_OPERAND}..max_operand, so it needs >= {MIN_MAX_OPERAND} (e.g. 99)")
