"""The set-up phase of a training run: from the sections a run reads (``RunSections``) to the objects a run
holds (``TrainingRun``) and what it samples from (``Prompts``).

    accelerator, seeds -> policy (float32 masters; LoRA, QLoRA) and reference -> data, rewards, reward weights
      -> placement (DDP, FSDP2 shards, the bf16 compute copy, a cast copy to sample from), optimizer, schedule
      -> rollout backend -> TrainingRun (each phase's options: the groups of `train:`)
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

import torch

from grpo_core.data.loading import PromptEncoder, load_split
from grpo_core.loss import (
    GRPOLoss,
)
from grpo_core.model.loading import (
    DTYPES,
    cast_lm_head_to_fp32,
    disable_dropout,
    load_policy,
    load_reference,
    owns_weights,
)
from grpo_core.rewards import build_reward_functions
from grpo_core.rollout import Placement, backend_for
from grpo_core.train.compute_weights import uses_compute_weights
from grpo_core.train.forward import LogprobOptions
from grpo_core.train.options import RunSections, training_params_hash
from grpo_core.train.parallel import ParallelConfigError, check_parallelism, read_parallelism
from grpo_core.train.periodic_eval import (
    load_held_out,
)
from grpo_core.train.policy import Placing, place_policy
from grpo_core.train.reward_weights import training_reward_weights
from grpo_core.train.round import RoundSpec, Scoring
from grpo_core.train.sampler_worker import ADAPTERS_OFF, SamplerWorker, WorkerRecipe
from grpo_core.train.state import (
    Prompts,
    TrainingError,
    TrainingRun,
)

log = logging.getLogger(__name__)


def set_up(cfg: RunSections, root: Path, reward_weights, backend_factory) -> tuple[TrainingRun, Prompts]:
    """Accelerator, seed, policy (fp32 masters), reference, data, rewards, optimizer, rollout backend.

    The policy is placed as the run's strategy asks (grpo_core/train/policy.py: one process or DDP, FSDP2
    shards, the bf16 compute copy; a sharded or half-precision run samples from a copy). On CUDA, float32
    matmuls run in TF32.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    t = cfg.train
    f = t.forward
    parallelism = read_parallelism(resolve_path(root, t.parallel.accelerate_config))
    check_parallelism(parallelism, lora=cfg.model.lora is not None, mixed_precision=f.mixed_precision,
                      quantized=cfg.model.quantization is not None)
    compute_copy = uses_compute_weights(f.mixed_precision, lora=cfg.model.lora is not None,
                                        quantized=cfg.model.quantization is not None,
                                        sharded=parallelism.fsdp is not None and launched_processes() > 1)
    # bf16 weights: no autocast
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=t.parallel.collective_timeout_s))
    accelerator = Accelerator(mixed_precision="no" if compute_copy else f.mixed_precision,
                              cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout])
    if accelerator.device.type == "cuda":
        allow_tf32()
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise ParallelConfigError("accelerate was launched with distributed_type "
                                  f"{accelerator.distributed_type.value}; this trainer shards by itself: "
                                  "launch with infra/accelerate/fsdp2.yaml (train.accelerate_config)")
    set_seed(t.seed)
    model, tokenizer = load_policy(cfg.model, root, gradient_checkpointing=f.gradient_checkpointing)
    ref_model = load_reference(cfg.model, root, model) if t.loss.beta > 0 else None
    for module in (model, ref_model):
        if module is not None and f.disable_dropout:
            disable_dropout(module)
        if module is not None and f.cast_lm_head_to_fp32 and owns_weights(module):  # LoRA: one head for both
            cast_lm_head_to_fp32(module)
    dataset = load_split(cfg.data, "train", root)
    encoder = PromptEncoder.from_config(tokenizer, cfg.data)
    reward_fns = build_reward_functions(cfg.rewards)
    reward_names = [r.name for r in cfg.rewards]
    if reward_weights is None:  # as `dvc repro` does: pinned, else calibrate's file, else 1 each
        reward_weights, source = training_reward_weights(reward_names, t.advantage.reward_weights, root)
        log.info("reward weights %s from %s", reward_weights, source)
    weights = torch.tensor(reward_weights, dtype=torch.float32)
    if len(weights) != len(reward_fns):
        raise TrainingError(f"{len(weights)} reward weights for {len(reward_fns)} reward functions "
                            f"{reward_names}")
    make_backend = backend_factory or (lambda m, tok: backend_for(
        m, tok, cfg.generation, seed=t.seed, max_prompt_length=cfg.data.max_prompt_length,
        return_logprobs=(t.sampler_correction.vllm_importance_sampling_correction
                         or t.loss.off_policy_mask_threshold is not None),
        place=Placement(accelerator.process_index, accelerator.local_process_index,
                        accelerator.num_processes),
        dtype=DTYPES[cfg.model.dtype]))
    placing = Placing(accelerator, cfg.model, cfg.generation, t.optim, t.max_steps, f.mixed_precision,
                      make_sampler=lambda m: make_backend(m, tokenizer))
    policy = place_policy(placing, model, ref_model, fsdp=parallelism.fsdp, compute_copy=compute_copy)
    if accelerator.num_processes > 1:
        # each process samples a stream of its own, as TRL seeds them (device_specific: seed + rank); only
        # now, once the weights exist: every process must build the same initial weights (FSDP2 shards are not
        # broadcast from rank 0). One process keeps its stream as it was.
        set_seed(t.seed, device_specific=True)
    round_spec = RoundSpec.from_config(cfg.generation, t.batch.num_generations, t.reward_calls, t.tool_use)
    loss_fn = GRPOLoss(t.loss, max_completion_length=cfg.generation.max_completion_length,
                       gradient_accumulation_steps=t.batch.gradient_accumulation_steps)
    run = TrainingRun(seed=t.seed, max_steps=t.max_steps, logging_steps=t.logging_steps, plan=t.batch_plan,
                      batch=t.batch, optim=t.optim, entropy=t.entropy,
                      sampler_correction=t.sampler_correction, advantage=t.advantage, reference=t.reference,
                      checkpoints=t.checkpoints, evaluation=t.eval_plan, rollouts=t.rollouts,
                      completions=t.completions, generation=cfg.generation, round_spec=round_spec,
                      logprobs=LogprobOptions(f, cfg.generation.temperature,
                                              t.batch.per_device_train_batch_size),
                      loss_fn=loss_fn, accelerator=accelerator, policy=policy, tokenizer=tokenizer,
                      params_hash=training_params_hash(cfg, weights.tolist()),
                      checkpoint_dir=root / t.checkpoints.output_dir / "checkpoints")
    held_out = load_held_out(run.evaluation, cfg.data, cfg.generation, cfg.rewards, root=root, seed=t.seed,
                             encoder=encoder, reward_fns=reward_fns)
    return run, Prompts(dataset, encoder, Scoring(reward_fns, reward_names, weights), held_out)


def launched_processes() -> int:
    """The processes this run was launched with (torchrun sets WORLD_SIZE), known before
    the Accelerator exists: its mixed precision depends on whether the policy will be sharded."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def allow_tf32() -> None:
    """TF32 for the float32 matmuls and convolutions that remain on CUDA (the float32 head, float32 compute):
    10 mantissa bits in the products, float32 accumulation - what Megatron, TRL's examples and PyTorch's own
    recommendation for Ampere and later use; CPU numerics are left as they are."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"


def start_sampler(run: TrainingRun, reward_specs: list, prompts: Prompts, worker: SamplerWorker,
                  backend_factory) -> None:
    """train.async_rollouts: set the sampler worker up with a copy of the policy and the reference it scores
    rounds sampled ahead with (``run.sampler``)."""
    reference = run.policy.reference
    # none, or one that moves (TR-DPO): the trainer scores it
    if reference is None or run.reference.sync_ref_model:
        reference = None
    elif not owns_weights(reference):
        reference = ADAPTERS_OFF
    recipe = WorkerRecipe(run.round_spec, run.logprobs, run.generation, prompts.encoder)
    worker.start(run.policy.masters, run.tokenizer, recipe, reward_specs, prompts.scoring.reward_names,
                 prompts.scoring.weights, make_backend=backend_factory, reference=reference)
    run.sampler = worker


def resolve_path(root: Path, path: str | None) -> Path | None:
    return None if path is None else (Path(path) if Path(path).is_absolute() else root / path)
