"""A training curriculum (``train.curriculum``): each task trains on its easiest level first and moves up one
level when its rolling training accuracy at that level reaches the threshold.

    train split: a ``level`` column (int) and, when present, a ``task`` column (without it: one task)
      -> per task its ladder: the levels its rows hold (among calibration's allowed prompts), lowest first
    the pool: the rows at their task's current level, in the order of a PromptSampler seeded by (train.seed,
      the levels), so a level state always gives the same order
    each round: take(n) from the pool -> sampled and scored -> observe: per task, its completions the
      correctness judge calls correct, and all of them -> close_round: the counts summed over processes make
      one entry of each task's window; a full window (``window`` rounds that sampled the task at its level)
      whose accuracy >= ``threshold`` moves the task up one level and clears its window; the pool changes
      from the next take on
    the levels, the windows and the pool's position are the sampler's state: checkpoints carry it, so a resume
      continues at the same levels, exactly.

The rule knows nothing of where levels come from (the reasoning-gym prepare writes them,
grpo_core/data/reasoning_gym.py); any train split with a level column can climb.
"""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from grpo_core.common.options import ConfigError, Options, option
from grpo_core.data.loading import DataConfig, DataError
from grpo_core.rewards.base import RewardSpec
from grpo_core.rewards.judges import CORRECTNESS_FUNCTIONS, build_judges, reward_index
from grpo_core.train.state import PromptSampler, Sampler, TrainingError

#: the train split's columns the rule reads: each row's level (int, higher = harder) and its task
LEVEL_COLUMN, TASK_COLUMN = "level", "task"

# an MLflow metric key holds word characters, "-", ".", " " and "/" (here: between the key's parts only)
_UNSAFE_IN_KEYS = re.compile(r"[^\w\-. ]")

#: why train.async_rollouts cannot serve a curriculum (config.py's async check reads it)
ASYNC_BLOCKER = ("not with train.curriculum: the sampler worker draws the next round before the current one "
                 "is scored, so a promotion would reach the pool a round late")


@dataclass
class CurriculumRule(Options):
    """When a task moves up a level."""

    threshold: float = option(0.7, "rolling training accuracy at the current level that moves a task up one "
                              "level", gt=0, le=1)
    window: int = option(5, "generation rounds the rolling accuracy spans (optimizer steps, when each round "
                         "feeds one); only a full window at the task's level promotes it", ge=1)
    metric: Literal["accuracy"] = option("accuracy", "what is compared with threshold: accuracy, the share "
                                         "of the window's completions the correctness judge (the first "
                                         "correctness reward, as evaluate judges) calls correct")


@dataclass
class CurriculumOptions(Options):
    """params.yaml `train:` key of the curriculum: which level of each task a round samples, and when a task
    moves up (grpo_core/train/curriculum.py)."""

    curriculum: CurriculumRule | None = option(
        None, "train each task on its easiest level first (the train split's level column, e.g. from "
        "reasoning_gym.tasks[].levels), one level up when its rolling training accuracy reaches threshold: "
        "{threshold: 0.7, window: 5, metric: accuracy}; null = every row, from the start")


def check_curriculum(options: CurriculumOptions, reward_specs: Sequence[RewardSpec]) -> None:
    """The rule needs a correctness reward among the training rewards: its scores are the accuracy."""
    if options.curriculum is None or reward_index(reward_specs, CORRECTNESS_FUNCTIONS) is not None:
        return
    have = ", ".join(f"{s.name} ({s.function})" for s in reward_specs) or "none"
    functions = ", ".join(sorted(CORRECTNESS_FUNCTIONS))
    raise ConfigError(f"train.curriculum: promotes on training accuracy, which the correctness judge scores: "
                      f"the first reward whose function is one of {functions}; rewards has none ({have}) - "
                      "add one")


@dataclass(frozen=True)
class AccuracyJudge:
    """Which completions count as correct: ``is_correct`` of the score in the correctness reward's column."""

    column: int                          # of a round's rewards (N, K)
    is_correct: Callable[[float], bool]  # Judges.is_correct


@dataclass(frozen=True)
class Promotion:
    """A task moved up a level."""

    task: str           # "" = the whole split (no task column)
    old: int
    new: int
    accuracy: float     # the rolling accuracy that promoted it
    rounds: int         # the window


class CurriculumSampler:
    """PromptSampler's interface (take, state_dict, load_state_dict) over the rows at each task's current
    level; ``observe`` and ``close_round`` feed it each round's verdicts (see the module docstring).

    tasks, levels: per dataset row. allowed: the rows calibration kept (None = all). Only tasks whose rows
    hold two levels or more climb (and are logged); a task with one level always samples it."""

    def __init__(self, tasks: Sequence[str], levels: Sequence[int], rule: CurriculumRule,
                 judge: AccuracyJudge, seed: int, allowed: Sequence[int] | None = None, shuffle: bool = True):
        self.tasks, self.levels, self.rule, self.judge = list(tasks), list(levels), rule, judge
        self.seed, self.shuffle = seed, shuffle
        self.rows = list(range(len(self.levels)) if allowed is None else allowed)
        ladders: dict[str, set[int]] = {}
        for i in self.rows:
            ladders.setdefault(self.tasks[i], set()).add(self.levels[i])
        self.ladders = {task: sorted(found) for task, found in sorted(ladders.items())}
        self.climbing = [task for task, ladder in self.ladders.items() if len(ladder) > 1]
        self.current = {task: ladder[0] for task, ladder in self.ladders.items()}
        self.windows = {task: deque(maxlen=rule.window) for task in self.climbing}
        self.tally = {task: [0, 0] for task in self.climbing}  # this round's (correct, completions), local
        self.pool = self._pool()

    def _pool(self) -> PromptSampler:
        """The rows at their task's current level, ordered by a seed of (seed, levels)."""
        rows = [i for i in self.rows if self.levels[i] == self.current[self.tasks[i]]]
        state = json.dumps([self.seed, [self.current[t] for t in self.ladders]])
        seed = int.from_bytes(hashlib.sha256(f"curriculum:{state}".encode()).digest()[:8], "big")
        return PromptSampler(len(self.levels), seed, rows, shuffle=self.shuffle)

    def take(self, n: int) -> list[int]:
        return self.pool.take(n)

    def observe(self, indices: Sequence[int], rewards: torch.Tensor) -> None:
        """One sampling's verdicts: ``indices`` the rows sampled (this process's), ``rewards`` (N, K) their
        completions', G consecutive rows per prompt."""
        group = rewards.shape[0] // max(len(indices), 1)
        correct = [self.judge.is_correct(v) for v in rewards[:, self.judge.column].tolist()]
        for r, index in enumerate(indices):
            counts = self.tally.get(self.tasks[index])
            if counts is not None:
                counts[0] += sum(correct[r * group:(r + 1) * group])
                counts[1] += group

    def close_round(self, accelerator) -> tuple[dict[str, float], list[Promotion]]:
        """The round's counts (over every process: each decides the same) into the windows; the tasks that
        move up. Returns the round's metrics - per climbing task its level and rolling accuracy, as sampled
        (before a promotion) - and the promotions."""
        if not self.climbing:
            return {}, []
        counts = torch.tensor([self.tally[t] for t in self.climbing], dtype=torch.float64)  # (T, 2)
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts.to(accelerator.device), "sum").cpu()
        self.tally = {task: [0, 0] for task in self.climbing}
        metrics, promotions = {}, []
        for task, (correct, total) in zip(self.climbing, counts.tolist()):
            window = self.windows[task]
            if total:  # a round that did not sample the task tells nothing of it
                window.append((int(correct), int(total)))
            accuracy = rolling_accuracy(window)
            metrics[metric_name(task, "level")] = float(self.current[task])
            metrics[metric_name(task, "accuracy")] = accuracy
            ladder = self.ladders[task]
            higher = ladder.index(self.current[task]) + 1
            if len(window) == self.rule.window and accuracy >= self.rule.threshold and higher < len(ladder):
                promotions.append(Promotion(task, self.current[task], ladder[higher], accuracy, len(window)))
                self.current[task] = ladder[higher]
                window.clear()
        if promotions:
            self.pool = self._pool()
        return metrics, promotions

    def metric_names(self) -> list[str]:
        return [metric_name(t, part) for t in self.climbing for part in ("level", "accuracy")]

    def state_dict(self) -> dict:
        return {"levels": dict(self.current),
                "windows": {task: [list(e) for e in w] for task, w in self.windows.items()},
                "pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for task, level in state["levels"].items():
            if level not in self.ladders.get(task, []):
                raise TrainingError(f"train.curriculum: the checkpoint has task {task or '(all rows)'!r} at "
                                    f"level {level}, which the train split's rows do not hold (levels per "
                                    f"task: {self.ladders}); was the split prepared again?")
        self.current.update({task: int(level) for task, level in state["levels"].items()})
        for task, entries in state["windows"].items():
            self.windows[task] = deque((tuple(e) for e in entries), maxlen=self.rule.window)
        self.tally = {task: [0, 0] for task in self.climbing}
        self.pool = self._pool()
        self.pool.load_state_dict(state["pool"])


def rolling_accuracy(window: deque) -> float:
    """Correct completions over completions in the window (NaN: none yet)."""
    total = sum(t for _, t in window)
    return sum(c for c, _ in window) / total if total else float("nan")


def metric_name(task: str, part: str) -> str:
    """``curriculum/<task>/<part>`` (``curriculum/<part>`` for a split without a task column); characters a
    tracker's metric key cannot hold become ``_``."""
    return f"curriculum/{_UNSAFE_IN_KEYS.sub('_', task)}/{part}" if task else f"curriculum/{part}"


def build_sampler(options: CurriculumOptions, dataset: Any, reward_specs: Sequence[RewardSpec],
                  data: DataConfig, *, seed: int, allowed: list[int] | None,
                  shuffle: bool) -> PromptSampler | CurriculumSampler:
    """The run's prompt sampler: a CurriculumSampler over ``dataset`` (the train split) under
    ``options.curriculum``, else a PromptSampler."""
    rule = options.curriculum
    if rule is None:
        return PromptSampler(len(dataset), seed, allowed, shuffle=shuffle)
    split = (f"data.hub_dataset {data.hub_dataset}[{data.train_split}]" if data.hub_dataset
             else f"data.train_files {data.train_files}")
    if LEVEL_COLUMN not in dataset.column_names:
        raise ConfigError(f"train.curriculum: the train split ({split}) has no {LEVEL_COLUMN!r} column; each "
                          "row's level (0 = the easiest) is what the curriculum climbs (the reasoning-gym "
                          f"prepare writes it for tasks with levels); its columns are {dataset.column_names}")
    levels = list(dataset[LEVEL_COLUMN])
    for row, level in enumerate(levels):
        if isinstance(level, bool) or not isinstance(level, numbers.Integral):
            raise DataError(f"train.curriculum: the train split ({split}) has level {level!r} at row {row}; "
                            "levels are integers")
    levels = [int(level) for level in levels]
    tasks = ([str(t) if t is not None else "" for t in dataset[TASK_COLUMN]]
             if TASK_COLUMN in dataset.column_names else [""] * len(levels))
    judges = build_judges(reward_specs)
    judge = AccuracyJudge(reward_index(reward_specs, CORRECTNESS_FUNCTIONS), judges.is_correct)
    sampler = CurriculumSampler(tasks, levels, rule, judge, seed, allowed, shuffle)
    if not sampler.climbing:
        logging.getLogger(__name__).warning("train.curriculum: no task of the train split (%s) has more than "
                                            "one level; every round samples all rows", split)
    return sampler


def curriculum_columns(sampler: Sampler) -> list[str]:
    """The step log's curriculum columns (none without one)."""
    return sampler.metric_names() if isinstance(sampler, CurriculumSampler) else []


def observe(sampler: Sampler, indices: Sequence[int], rewards: torch.Tensor) -> None:
    """A sampling's verdicts to the curriculum (nothing without one)."""
    if isinstance(sampler, CurriculumSampler):
        sampler.observe(indices, rewards)


def close_round(sampler: Sampler, accelerator, step: int, log: logging.Logger) -> dict[str, float]:
    """The round's curriculum metrics (none without one); each promotion as one line of ``log`` (the main
    process's), naming the step whose round decided it."""
    if not isinstance(sampler, CurriculumSampler):
        return {}
    metrics, promotions = sampler.close_round(accelerator)
    for p in promotions if accelerator.is_main_process else []:
        # a warning, so that it shows where the run prints nothing below that (the train stage)
        log.warning("curriculum: %s level %d -> %d at step %d: rolling accuracy %.3f >= %g over the last %d "
                    "rounds; the next round samples level %d", p.task or "(all rows)", p.old, p.new, step,
                    p.accuracy, sampler.rule.threshold, p.rounds, p.new)
    return metrics
