"""params.yaml, assembled from the options each component declares, and checked across sections.

Each section's keys are declared, with their defaults, limits and meaning, by the code that reads them
(``grpo_core/common/options.py`` says how): ``data:`` in data.py, ``model:`` in model/loading.py,
``generation:`` in rollout/, ``rewards:`` in rewards/base.py, ``guards:`` in train/guards.py, and ``train:``'s
keys in the group of the part that reads them (``TrainConfig``, grpo_core/train/options.py). This module puts
them together and checks what spans sections; it sits above the trainer, which takes the result as the
sections it reads (``RunSections``) without importing this module.

``train:`` stays flat in params.yaml, with TRL ``GRPOConfig``'s names, so a TRL user can carry a config over;
in code each key lives in one group: ``train.epsilon`` is ``cfg.train.loss.epsilon``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_core.calibration import CalibrateConfig
from grpo_core.common.options import ConfigError, Options, construct, convert, describe, option, unknown_key
from grpo_core.common.params_file import read_params, set_dotted
from grpo_core.data.loading import DATA_FILES_FORMS, DataConfig
from grpo_core.data.reasoning_gym import ReasoningGymConfig
from grpo_core.data.validation import ValidateConfig
from grpo_core.embedded.config import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR, EmbeddedConfig
from grpo_core.evaluation import eval_metric_names
from grpo_core.model.gguf_export import ExportOptions
from grpo_core.model.loading import ModelConfig
from grpo_core.rewards.base import RewardSpec
from grpo_core.rollout import GenerationConfig
from grpo_core.train.curriculum import ASYNC_BLOCKER, check_curriculum
from grpo_core.train.guards import GuardsConfig
from grpo_core.train.options import TrainConfig, flat_train, train_groups, train_key_owner

__all__ = ["ConfigError", "PipelineConfig", "load_config", "config_from_dict"]


def describe_train() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, meaning) of each params.yaml `train:` key, TrainConfig's then its groups'."""
    rows = [r for r in describe(TrainConfig) if r[0] not in train_groups()]
    return rows + [r for cls in train_groups().values() for r in describe(cls)]


def build_train(data: Any, prefix: str = "train") -> TrainConfig:
    """TrainConfig from params.yaml's flat `train:` mapping: each key routed to the group that owns it."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping of keys, got {type(data).__name__} {data!r}")
    owner = train_key_owner()
    routed: dict[str | None, dict] = {}
    for key, value in data.items():
        if f"{prefix}.{key}" in MOVED_KEYS:
            raise ConfigError(f"{prefix}.{key}: moved to {MOVED_KEYS[f'{prefix}.{key}']} (the generation "
                              "section is shared by calibrate, train and evaluate); set it there")
        if key not in owner:
            raise unknown_key(f"{prefix}.{key}", key, owner)
        routed.setdefault(owner[key], {})[key] = value
    groups = {name: construct(cls, routed.get(name, {}), prefix) for name, cls in train_groups().items()}
    return construct(TrainConfig, {**routed.get(None, {}), **groups}, prefix)


@dataclass
class EvaluateConfig(Options):
    """params.yaml `evaluate:` (flows/stages/evaluate.py)."""

    max_samples: int | None = option(500, "held-out prompts evaluated (None = all)", ge=1)
    num_generations: int = option(8, "n: samples per prompt for pass@k", ge=1)
    pass_k: list[int] = option([1, 4, 8], "k values for the unbiased pass@k")
    temperature: float | None = option(None, "override of generation.temperature for the sampled pass@k "
                                       "(None = training's; greedy accuracy decodes greedily); shown in "
                                       "reports/evaluation.md", gt=0)
    max_completion_length: int | None = option(None, "override of generation.max_completion_length for both "
                                               "greedy and sampled completions (None = training's)", ge=1)
    batch_size: int = option(64, "prompts per generate call", ge=1)
    seed: int = option(0, "seed for sampling")

    def check(self) -> None:
        for k in self.pass_k:
            if not 1 <= k <= self.num_generations:
                raise ConfigError(f"pass_k: k={k} must be between 1 and evaluate.num_generations "
                                  f"({self.num_generations})")


@dataclass
class TrackingConfig(Options):
    """params.yaml `tracking:` (flows/tracking.py)."""

    experiment_name: str = option("grpo-pipeline", "MLflow experiment")
    tracking_uri: str | None = option(None, "MLflow tracking URI (None = sqlite:///<repo>/mlflow.db, or "
                                      "$MLFLOW_TRACKING_URI)")
    register_model: bool = option(True, "register the trained model in the MLflow Model Registry")
    registered_model_name: str = option("grpo-policy", "registered model name")
    promotion_metric: str = option("accuracy", "eval metric the promotion gate compares")
    promotion_margin: float = option(0.0,
                                     "alias `champion` only when the metric beats the champion's by this",
                                     ge=0)


@dataclass
class PipelineConfig:
    embedded: EmbeddedConfig | None = option(None, "the embedded default's synthetic task and tiny model "
                                             "(`prepare`); null when params.yaml names your own data and "
                                             "model")
    reasoning_gym: ReasoningGymConfig | None = option(None, "reasoning-gym tasks as the data (`prepare`, "
                                                      "grpo_core/data/reasoning_gym.py); null = not used")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    export: ExportOptions | None = field(default_factory=ExportOptions)  # null = no GGUF export

    def to_dict(self) -> dict:
        """As params.yaml writes it: `train:` flat."""
        out = dataclasses.asdict(self)
        if self.train is not None:
            out["train"] = flat_train(self.train)
        return out


# Keys that live in another section now; an old params.yaml gets an error naming the new place.
MOVED_KEYS = {
    **{f"train.{k}": f"generation.{k}" for k in (
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
        "generation_kwargs", "generation_batch_size", "cache_implementation", "vllm_gpu_memory_utilization",
        "vllm_enable_sleep_mode", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_group_port",
        "vllm_server_timeout")},
    "train.generation_backend": "generation.backend",
    "train.max_prompt_length": "data.max_prompt_length",
}


def config_from_dict(raw: dict, overrides: typing.Mapping[str, Any] | None = None,
                     source: str = "params") -> PipelineConfig:
    raw = json.loads(json.dumps(raw or {}))  # deep copy of plain YAML data
    if overrides:
        raw = _apply_overrides(raw, overrides)
    sections = {f.name for f in dataclasses.fields(PipelineConfig)}
    for key in raw:
        if key not in sections:
            raise ConfigError(str(unknown_key(f"{source}: unknown section '{key}'", key, sorted(sections)))
                              .replace(": unknown key", "", 1))
    hints = typing.get_type_hints(PipelineConfig)
    kwargs = {name: build_train(value) if name == "train" else convert(value, hints[name], name)
              for name, value in raw.items()}
    cfg = PipelineConfig(**kwargs)
    _resolve_generation_batch_size(cfg)
    _resolve_async_rollouts(cfg)
    check_across_sections(cfg)
    return cfg


def _apply_overrides(raw: dict, overrides: typing.Mapping[str, Any]) -> dict:
    """``{"train.learning_rate": 1e-4}`` -> raw["train"]["learning_rate"] = 1e-4 (keys checked at build)."""
    for dotted, value in overrides.items():
        set_dotted(raw, dotted, value)
    return raw


def _resolve_generation_batch_size(cfg: PipelineConfig) -> None:
    """generation.generation_batch_size (TRL's alternative to train.steps_per_generation) ->
    steps_per_generation, the one the trainer reads; both set is an error, as in TRL."""
    g, b, p = cfg.generation, cfg.train.batch, cfg.train.parallel
    if g.generation_batch_size is None:
        return
    if b.steps_per_generation is not None:
        raise ConfigError(f"generation.generation_batch_size: set together with train.steps_per_generation "
                          f"({b.steps_per_generation}); set one of them (TRL refuses both too)")
    per_step = b.per_device_train_batch_size * p.num_processes
    if g.generation_batch_size % per_step:
        raise ConfigError(f"generation.generation_batch_size: {g.generation_batch_size} is not a multiple of "
                          f"train.per_device_train_batch_size x train.num_processes ({per_step}), the "
                          "completions one optimizer step trains on")
    b.steps_per_generation = g.generation_batch_size // per_step


def _resolve_async_rollouts(cfg: PipelineConfig) -> None:
    """train.async_rollouts "auto" -> on unless something rules it out: what the checks and the trainer read
    is a bool."""
    if cfg.train.rollouts.async_rollouts == "auto":
        cfg.train.rollouts.async_rollouts = async_rollouts_blocker(cfg) is None


def check_across_sections(cfg: PipelineConfig) -> None:
    """What no single section can check alone (each section checked its own keys when it was built); reads
    the config, never changes it."""
    t = cfg.train
    t.batch_plan  # noqa: B018 - raises when the batch does not hold whole groups
    if (t.loss.loss_type == "vespo" and cfg.generation.backend == "vllm"
            and t.sampler_correction.vllm_importance_sampling_correction
            and not t.sampler_correction.vllm_importance_sampling_mode.startswith("token")):
        raise ConfigError("train.vllm_importance_sampling_mode: vespo folds the correction into its sequence "
                          "weight token by token; use token_truncate or token_mask (got "
                          f"{t.sampler_correction.vllm_importance_sampling_mode})")
    _check_rewards(cfg)
    if cfg.data.hub_dataset is None and not cfg.data.paths("train"):
        raise ConfigError(f"data.train_files: empty; name local files ({DATA_FILES_FORMS}) or set "
                          "data.hub_dataset")
    if cfg.embedded is not None and cfg.reasoning_gym is not None:
        raise ConfigError("reasoning_gym: set together with embedded; prepare writes one of them to "
                          f"{EMBEDDED_DATA_DIR}: set embedded: null and point model.name_or_path at your "
                          "model")
    if cfg.embedded is not None:
        for key, fixed in (("data_dir", EMBEDDED_DATA_DIR), ("model_dir", EMBEDDED_MODEL_DIR)):
            if getattr(cfg.embedded, key) != fixed:
                raise ConfigError(f"embedded.{key}: {getattr(cfg.embedded, key)!r}; dvc.yaml names {fixed!r} "
                                  "as prepare's output, so leave the key out (point "
                                  "data.* / model.name_or_path at your own files instead)")
    _check_eval(cfg)
    why = _async_config_blocker(cfg) if t.rollouts.async_rollouts is True else None
    if why is not None:
        raise ConfigError(f"train.async_rollouts: {why} - set train.async_rollouts: false")
    if t.reference.sync_ref_model and cfg.model.lora is not None:
        raise ConfigError("train.sync_ref_model: not with model.lora; under LoRA the reference is the base "
                          "model with the adapters switched off, so there is no separate reference to mix "
                          "the policy into (TRL raises the same)")
    _check_quantization(cfg)


def _check_rewards(cfg: PipelineConfig) -> None:
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward function is required")
    names = [r.name for r in cfg.rewards]
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: names must be unique, got {names}")
    for i, spec in enumerate(cfg.rewards):
        if spec.function == "environment_reward" and cfg.train.tool_use.environment_factory is None:
            raise ConfigError(f"rewards[{i}]: environment_reward reads each rollout's environment "
                              f"(get_reward()); set train.environment_factory")
    weights = cfg.train.advantage.reward_weights
    if weights is not None and len(weights) != len(cfg.rewards):
        raise ConfigError(f"train.reward_weights: {len(weights)} weights for {len(cfg.rewards)} "
                          f"reward functions ({', '.join(names)})")
    check_curriculum(cfg.train.levels, cfg.rewards)


def _check_quantization(cfg: PipelineConfig) -> None:
    """model.quantization (QLoRA) with the rest. FSDP2 is refused where train.accelerate_config is read
    (``train/parallel.py:check_parallelism``)."""
    if cfg.model.quantization is None:
        return
    if cfg.generation.backend == "vllm":
        raise ConfigError("model.quantization: not with generation.backend vllm; the engine is fed the "
                          "policy's merged weights (base + adapters, layer by layer) after each step, and a "
                          "4-bit base has no full-precision weight to merge into - use generation.backend "
                          "auto or hf")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.quantization: needs bitsandbytes, which is not installed; install the "
                          "extra: pip install -e '.[qlora]' (make setup installs it)")


def _check_eval(cfg: PipelineConfig) -> None:
    t, e = cfg.train, cfg.train.eval_plan
    if e.eval_strategy == "no":
        return
    if cfg.data.hub_dataset is None and not cfg.data.paths("eval"):
        raise ConfigError("train.eval_strategy: steps scores held-out prompts, but data.eval_files is empty; "
                          "name held-out data or set data.hub_dataset")
    names = eval_metric_names(e, [r.name for r in cfg.rewards], t.tool_use.enabled)
    if e.best_metric is not None and e.best_metric not in names:
        raise ConfigError(f"train.metric_for_best_model: {e.metric_for_best_model!r} is not an eval metric; "
                          f"choose one of {', '.join(names)}")
    if e.load_best_model_at_end:
        if t.checkpoints.save_strategy != "steps":
            raise ConfigError("train.load_best_model_at_end: needs checkpoints to choose from; set "
                              "train.save_strategy: steps")
        if t.checkpoints.save_steps % e.eval_steps:
            raise ConfigError(f"train.save_steps: {t.checkpoints.save_steps} is not a multiple of the "
                              f"evaluation interval ({e.eval_steps}, train.eval_steps), so some checkpoints "
                              "would have no evaluation to be judged by (train.load_best_model_at_end)")


def async_rollouts_blocker(cfg: PipelineConfig) -> str | None:
    """Why the sampler worker cannot serve ``cfg`` (None: it can); what ``train.async_rollouts: auto`` decides
    by. The worker samples on the CPU, so a machine with a CUDA device (where the policy trains) rules it
    out."""
    why = _async_config_blocker(cfg)
    if why is not None:
        return why
    import torch  # only for auto: whether training will run on a GPU

    if torch.cuda.is_available():
        return "a CUDA device is present (the policy trains there; the worker samples on the CPU)"
    return None


def _async_config_blocker(cfg: PipelineConfig) -> str | None:
    """What in ``cfg`` itself the sampler worker cannot serve (None: nothing);
    the device is checked at run time."""
    t = cfg.train
    if t.parallel.num_processes > 1:
        return ("one training process with one sampler worker; train.num_processes is "
                f"{t.parallel.num_processes}")
    if cfg.generation.backend == "vllm":
        return ("the sampler worker samples with generation.backend auto, hf or manual; vllm (colocated or "
                "server) samples in the training process")
    if t.levels.curriculum is not None:
        return ASYNC_BLOCKER
    if t.rollouts.dynamic_sampling:
        return ("not with train.dynamic_sampling (a round's size is only known once its groups are scored, "
                "so it cannot be requested one step ahead)")
    if cfg.model.quantization is not None:
        return ("not with model.quantization; the sampler worker copies the policy into shared memory, which "
                "bitsandbytes' packed 4-bit weights and their quantization state are not built for")
    return None


def load_config(path: str | Path = "params.yaml",
                overrides: typing.Mapping[str, Any] | None = None) -> PipelineConfig:
    """Read and validate params.yaml (YAML 1.2, as DVC writes it: grpo_core/common/params_file.py). Raises
    ConfigError naming the key on any problem."""
    path = Path(path)
    return config_from_dict(read_params(path), overrides, source=str(path))


def params_read(inputs: Any) -> list[str]:
    """The params.yaml keys a stage's inputs record (a dataclass of what the stage is handed) holds: a field
    named after a section -> that section; a group of `train:` -> ``train.<key>`` for each of its keys; any
    other field -> the key(s) its metadata ``param`` names. dvc.yaml must list each
    (tests/test_dvc_params.py)."""
    sections = {f.name for f in dataclasses.fields(PipelineConfig)}
    groups = tuple(train_groups().values())
    keys: list[str] = []
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if "param" in f.metadata:
            named = f.metadata["param"]
            keys += [named] if isinstance(named, str) else list(named)
        elif isinstance(value, groups):
            keys += [f"train.{v.name}" for v in dataclasses.fields(value)]
        elif f.name in sections:
            keys.append(f.name)
        else:
            raise TypeError(f"{type(inputs).__name__}.{f.name}: neither a section, a group of train:, nor a "
                            "field naming its param")
    return keys


def only_sections(cfg: PipelineConfig, keep: typing.Iterable[str]) -> PipelineConfig:
    """``cfg`` with every section outside ``keep`` set to None: code handed it fails loudly on reading a
    section its stage does not declare (and DVC does not track) instead of silently depending on it."""
    keep = set(keep)
    return dataclasses.replace(cfg, **{f.name: None for f in dataclasses.fields(PipelineConfig)
                                       if f.name not in keep})
