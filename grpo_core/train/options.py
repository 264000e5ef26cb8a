"""params.yaml `train:` as the trainer reads it (``TrainConfig``), the sections a training run reads
(``RunSections``), and the fingerprint of what a run computes (``training_params_hash``).

Each group of ``TrainConfig`` is declared beside the part of the trainer that reads it; this module only puts
them together. The assembly of the whole params.yaml (grpo_core/config.py) sits above the trainer and hands
it a ``PipelineConfig``, which is a ``RunSections``: the trainer never imports the assembly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo_core.advantages import AdvantageOptions
from grpo_core.common.options import Options, option
from grpo_core.data.loading import DataConfig
from grpo_core.evaluation import EvalOptions
from grpo_core.loss import LossOptions, SamplerCorrectionOptions
from grpo_core.model.loading import ModelConfig
from grpo_core.rewards.base import RewardSpec
from grpo_core.rewards.scoring import RewardCallOptions
from grpo_core.rollout import GenerationConfig
from grpo_core.tools import ToolUseOptions
from grpo_core.train.batching import BatchOptions, BatchPlan
from grpo_core.train.checkpoint import CheckpointOptions
from grpo_core.train.completions import CompletionLogOptions
from grpo_core.train.curriculum import CurriculumOptions
from grpo_core.train.entropy import EntropyOptions
from grpo_core.train.forward import ForwardOptions
from grpo_core.train.guards import GuardsConfig
from grpo_core.train.optim import OptimizerOptions
from grpo_core.train.parallel import ParallelOptions
from grpo_core.train.reference import ReferenceOptions
from grpo_core.train.round import RolloutOptions


def _group(cls: type) -> Any:
    summary = " ".join((cls.__doc__ or "").split("\n\n")[0].split())  # the docstring's first paragraph
    return field(default_factory=cls, metadata={"group": True, "help": summary})


@dataclass
class TrainConfig(Options):
    """params.yaml `train:`: the run's own keys, then one group per part of the trainer that reads them (each
    declared beside its reader). In params.yaml the groups' keys sit flat under `train:`."""

    seed: int = option(0, "seed for sampling, data order and initialisation")
    max_steps: int = option(100, "optimizer steps to train", ge=1)
    logging_steps: int = option(1, "log metrics every N steps", ge=1)
    batch: BatchOptions = _group(BatchOptions)
    optim: OptimizerOptions = _group(OptimizerOptions)
    loss: LossOptions = _group(LossOptions)
    entropy: EntropyOptions = _group(EntropyOptions)
    sampler_correction: SamplerCorrectionOptions = _group(SamplerCorrectionOptions)
    advantage: AdvantageOptions = _group(AdvantageOptions)
    reference: ReferenceOptions = _group(ReferenceOptions)
    forward: ForwardOptions = _group(ForwardOptions)
    checkpoints: CheckpointOptions = _group(CheckpointOptions)
    evaluation: EvalOptions = _group(EvalOptions)
    parallel: ParallelOptions = _group(ParallelOptions)
    rollouts: RolloutOptions = _group(RolloutOptions)
    completions: CompletionLogOptions = _group(CompletionLogOptions)
    reward_calls: RewardCallOptions = _group(RewardCallOptions)
    tool_use: ToolUseOptions = _group(ToolUseOptions)
    levels: CurriculumOptions = _group(CurriculumOptions)

    def check(self) -> None:
        self.loss.check_meant()

    @property
    def batch_plan(self) -> BatchPlan:
        """The run's batch sizes (micro-batches, steps, rounds), derived in one place."""
        return self.batch.plan(self.parallel.num_processes)

    @property
    def eval_plan(self) -> EvalOptions:
        """The evaluation options with the defaults that follow other keys filled in."""
        return self.evaluation.resolved(num_generations=self.batch.num_generations,
                                        logging_steps=self.logging_steps)


@functools.cache
def train_groups() -> dict[str, type]:
    """TrainConfig's groups: attribute name -> options class."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.metadata.get("group")}


@functools.cache
def train_key_owner() -> dict[str, str | None]:
    """Every `train:` key of params.yaml -> the TrainConfig group that owns it (None: TrainConfig's own)."""
    owner: dict[str, str | None] = {f.name: None for f in dataclasses.fields(TrainConfig)
                                    if not f.metadata.get("group")}
    for name, cls in train_groups().items():
        owner.update({leaf.name: name for leaf in dataclasses.fields(cls)})
    return owner


def flat_train(t: TrainConfig) -> dict[str, Any]:
    """``t`` as params.yaml's flat `train:` mapping (every key, defaults included; a block as a mapping)."""
    owner = train_key_owner()
    values = {key: getattr(t if group is None else getattr(t, group), key) for key, group in owner.items()}
    return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()}


class RunSections(Protocol):
    """The params.yaml sections a training run reads, checked and resolved (grpo_core/config.py's
    ``PipelineConfig`` is one)."""

    data: DataConfig
    model: ModelConfig
    generation: GenerationConfig
    rewards: list[RewardSpec]
    train: TrainConfig
    guards: GuardsConfig


_NEWER_KEYS = {"curriculum"}  # added since checkpoints were written: hashed only when set, so those resume
_BOOKKEEPING_KEYS = {  # keys that change bookkeeping only; they never make a checkpoint incompatible
    "max_steps", "logging_steps", "reward_timeout_s",
    *(f.name for cls in (CheckpointOptions, ParallelOptions) for f in dataclasses.fields(cls)),
    # evaluation during training runs on forked RNGs: it never changes what training computes
    *(f.name for f in dataclasses.fields(EvalOptions))}


def training_params_hash(cfg: RunSections, reward_weights: typing.Sequence[float] | None = None) -> str:
    """sha256 over everything that changes what training computes (model, generation, data, rewards, train.*).

    A checkpoint stores it; resuming under a different hash is refused. ``max_steps`` is excluded so a
    run can be extended, as are the other bookkeeping keys in ``_BOOKKEEPING_KEYS``. The batch counts as
    per_device_train_batch_size x num_processes: how the global batch is split over processes is layout, so
    a run resumes on another world size that keeps it (2 x 8 -> 1 x 16).
    """
    train = {k: v for k, v in flat_train(cfg.train).items()
             if k not in _BOOKKEEPING_KEYS and not (k in _NEWER_KEYS and v is None)}
    train["per_device_train_batch_size"] = (cfg.train.batch.per_device_train_batch_size
                                            * cfg.train.parallel.num_processes)
    payload = {
        "model": dataclasses.asdict(cfg.model),
        "generation": dataclasses.asdict(cfg.generation),
        "data": dataclasses.asdict(cfg.data),
        "rewards": [dataclasses.asdict(r) for r in cfg.rewards],
        "train": train,
        "reward_weights": list(reward_weights) if reward_weights is not None else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
