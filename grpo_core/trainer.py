"""The GRPO training loop, top to bottom.

    for each generation round:
        prompts  <- sampler (whole groups: each prompt repeated G times)
        rollout  <- backend.generate(prompts)                     # G completions per prompt
        rewards  <- score_completions(reward_fns, ...)            # (N, K), NaN where a reward is None
        A        <- compute_advantages(rewards, weights, G)       # group-relative
        old_logps <- policy(rollout) once, only if the round feeds more than one optimizer step
        repeat num_iterations times:
            for each optimizer step the round feeds:
                for each micro-batch: loss = grpo_loss(logps, old_logps, ref_logps, A, mask); backward
                clip grads; optimizer.step(); scheduler.step(); log; checkpoint

The math lives in ``advantages.py``, ``loss.py`` and ``logprobs.py``; this file only wires it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_core.advantages import compute_advantages
from grpo_core.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    remove_stale_temp_dirs,
    save_checkpoint,
    set_rng_state,
)
from grpo_core.config import PipelineConfig, training_params_hash
from grpo_core.data import PromptEncoder, completion_for_reward, load_split
from grpo_core.errors import TrainingFailure
from grpo_core.fastforward import use_manual_forward
from grpo_core.files import atomic_path
from grpo_core.guards import GuardEvent, GuardMonitor, GuardStop, decide
from grpo_core.logprobs import token_logprobs_and_entropy
from grpo_core.loss import grpo_loss
from grpo_core.microbatch import length_grouped_order
from grpo_core.modeling import DTYPES, is_peft_model, load_policy, load_reference
from grpo_core.rewards import build_reward_functions, score_completions
from grpo_core.rollout import RolloutBackend, SamplingParams, backend_for, decode_completions

log = logging.getLogger(__name__)


class TrainingError(TrainingFailure, RuntimeError):
    """Training cannot go on; the message says why."""


# ---------------------------------------------------------------------------------------------------
# Data order


class PromptSampler:
    """Prompt indices in seeded epoch permutations; its state is two integers, so resume is exact."""

    def __init__(self, num_prompts: int, seed: int, allowed: list[int] | None = None):
        self.pool = np.asarray(allowed if allowed is not None else range(num_prompts), dtype=np.int64)
        if len(self.pool) == 0:
            raise TrainingError("no training prompts to sample from (after calibration's filtering)")
        self.seed, self.epoch, self.position = seed, 0, 0

    def _order(self) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------------
# Per-step log: a CSV with fixed columns (TRL's metric names), append-only, so a crash loses at most
# the line being written and DVC can plot it directly.


def metric_columns(reward_names: list[str]) -> list[str]:
    cols = ["step", "loss", "reward", "reward_std", "frac_reward_zero_std"]
    for name in reward_names:
        cols += [f"rewards/{name}/mean", f"rewards/{name}/std"]
    cols += ["kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "completions/mean_length", "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "grad_norm", "learning_rate", "reward_errors", "reward_timeouts", "num_tokens", "guard/skipped",
             "step_time", "generation_time"]
    return cols


class StepLog:
    def __init__(self, path: Path, columns: list[str], resume_step: int):
        self.path, self.columns = path, columns
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        if resume_step > 0 and path.exists():  # drop steps after the checkpoint: they are redone
            with open(path, newline="") as fh:
                kept = [r for r in csv.DictReader(fh) if r.get("step") and int(float(r["step"])) <= resume_step]
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)

    def append(self, metrics: dict) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore").writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in metrics.items()})


# ---------------------------------------------------------------------------------------------------
# One generation round: sample, score, compute advantages.


def generate_and_score(*, backend: RolloutBackend, tokenizer, dataset, indices: list[int], encoder: PromptEncoder,
                       reward_fns, reward_names: list[str], weights: torch.Tensor, cfg, accelerator) -> dict:
    """Sample G completions for each prompt in ``indices``; return the round's tensors and metrics.

    Returns a dict of tensors (rows grouped G at a time): prompt_ids/prompt_mask (N, P),
    completion_ids/completion_mask (N, C), is_truncated (N,), advantages (N,), plus ``metrics``.
    """
    t = cfg.train
    rows = [dataset[i] for i in indices]
    prompt_ids = [encoder.encode(r["prompt"], row=i) for r, i in zip(rows, indices)]
    sampling = SamplingParams(max_new_tokens=t.max_completion_length, temperature=t.temperature,
                              top_p=t.top_p, top_k=t.top_k)
    t0 = time.perf_counter()
    batch = backend.generate(prompt_ids, t.num_generations, sampling)
    generation_time = time.perf_counter() - t0

    G = t.num_generations
    texts = decode_completions(tokenizer, batch)
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    completions = [completion_for_reward(text, p) for text, p in zip(texts, prompts)]
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    columns["completion_ids"] = [ids[m.bool()].tolist() for ids, m in zip(batch.completion_ids, batch.completion_mask)]
    scored = score_completions(reward_fns, prompts, completions, columns, on_error=t.reward_errors,
                               timeout_s=t.reward_timeout_s)
    rewards = torch.as_tensor(scored.rewards, dtype=torch.float32)

    # Whole groups live on one process; advantages still see the global batch (scale_rewards="batch").
    all_rewards = accelerator.gather(rewards.to(accelerator.device)).cpu() if accelerator.num_processes > 1 else rewards
    advantages = compute_advantages(all_rewards, weights, G, scale=t.scale_rewards,
                                    aggregation=t.multi_objective_aggregation)
    if accelerator.num_processes > 1:
        n = rewards.shape[0]
        advantages = advantages[accelerator.process_index * n:(accelerator.process_index + 1) * n]

    metrics = reward_metrics(all_rewards, weights, G, reward_names)
    lengths, truncated = batch.completion_lengths.float(), batch.is_truncated.float()
    if accelerator.num_processes > 1:  # the length metrics (and the length guard) see the global batch
        both = accelerator.gather(torch.stack([lengths, truncated], dim=1).to(accelerator.device)).cpu()
        lengths, truncated = both[:, 0], both[:, 1]
    metrics.update({
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
        "reward_errors": float(sum(scored.error_counts.values())),
        "reward_timeouts": float(sum(scored.timeout_counts.values())),
        "generation_time": generation_time,
    })
    return {
        "prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
        "is_truncated": batch.is_truncated, "advantages": advantages.float(),
        "metrics": metrics, "texts": texts,
    }


def reward_metrics(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, names: list[str]) -> dict:
    """TRL's reward metrics: mean weighted reward, mean group std, share of zero-std groups, per function."""
    total = torch.nansum(rewards * weights.to(rewards.dtype), dim=1)  # all-None rows count 0, as in TRL
    group_std = total.view(-1, group_size).std(dim=1)
    out = {
        "reward": total.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
    }
    for k, name in enumerate(names):
        col = rewards[:, k]
        valid = col[~torch.isnan(col)]
        out[f"rewards/{name}/mean"] = valid.mean().item() if len(valid) else float("nan")
        out[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else float("nan")
    return out


# ---------------------------------------------------------------------------------------------------
# Forward passes


def _trim(mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Concatenate prompt and completion, dropping columns that are padding in every row of the micro-batch."""
    pm, cm = mb["prompt_mask"], mb["completion_mask"]
    first = int((pm.sum(0) > 0).int().argmax()) if pm.any() else pm.shape[1]
    width = int(cm.sum(1).max()) if cm.any() else 1
    input_ids = torch.cat([mb["prompt_ids"][:, first:], mb["completion_ids"][:, :width]], dim=1)
    attention = torch.cat([pm[:, first:], cm[:, :width]], dim=1)
    return input_ids, attention, cm[:, :width], width


def policy_logprobs(model, mb: dict, temperature: float, compute_entropy: bool, forward: str = "hf"):
    """Per-token log-probs (and entropies) of the completion tokens: (B, C') each, C' the trimmed width.

    Position ids follow the attention mask (as ``generate`` does with left padding), so a padded
    prompt sees the same positions at training time as at sampling time. forward: ``train.forward_backend``
    (hf, manual or auto: the hand-written forward of ``grpo_core.fastforward`` where it applies).
    """
    input_ids, attention, mask, width = _trim(mb)  # trimmed on the host: no device sync
    device = _device_of(model)
    input_ids, attention = input_ids.to(device, non_blocking=True), attention.to(device, non_blocking=True)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    logps, entropy = token_logprobs_and_entropy(model, input_ids, attention, logits_to_keep=width,
                                                temperature=temperature, compute_entropy=compute_entropy,
                                                position_ids=position_ids, forward=forward)
    return logps, entropy, mask


_ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated", "advantages",
             "old_logps", "ref_logps")


def select_rows(round_: dict, rows: slice | torch.Tensor) -> dict:
    """Those rows of a generation round (a slice, or an index tensor): every per-row tensor the round holds."""
    return {k: round_[k][rows] for k in _ROW_KEYS if round_.get(k) is not None}


def micro_batch(round_: dict, start: int, stop: int) -> dict:
    """Rows [start, stop) of a generation round."""
    return select_rows(round_, slice(start, stop))


# ---------------------------------------------------------------------------------------------------
# Optimiser


FUSED_ADAMW = True


def build_optimizer_and_scheduler(model, t):
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel per step instead of per-tensor ops (and no foreach temporaries the size of the model)
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                                  weight_decay=t.weight_decay, fused=FUSED_ADAMW)
    warmup = math.ceil(t.warmup_ratio * t.max_steps)
    name = "constant_with_warmup" if t.lr_scheduler_type == "constant" else t.lr_scheduler_type
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=t.max_steps)
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    final_step: int
    model_dir: Path
    log_path: Path
    checkpoint_dir: Path
    resumed_from: Path | None
    last_metrics: dict


def train(cfg: PipelineConfig, *, reward_weights: list[float] | None = None, tracker=None,
          root: str | Path = ".", allowed_prompts: list[int] | None = None, progress: bool = True,
          log_path: str | Path = "metrics/train_log.csv", backend_factory=None) -> TrainResult:
    """Run GRPO per ``cfg.train``; write checkpoints, the final model and the per-step log.

    reward_weights: one per reward function (None = all 1). tracker: an object with ``log_metrics(dict,
    step)`` (e.g. MLflow), optional. allowed_prompts: dataset indices to train on (calibration may drop
    always/never-solved prompts). Resumes from the newest complete checkpoint unless train.resume=never.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    t = cfg.train
    root = Path(root)
    out_dir = root / t.output_dir
    ckpt_dir, model_dir, log_path = out_dir / "checkpoints", out_dir / "model", root / log_path
    accelerator = Accelerator(mixed_precision=t.mixed_precision, cpu=not torch.cuda.is_available())
    set_seed(t.seed)

    # Model, data, rewards --------------------------------------------------------------------------
    model, tokenizer = load_policy(cfg.model, root, gradient_checkpointing=t.gradient_checkpointing)
    ref_model = load_reference(cfg.model, root, model) if t.beta > 0 else None
    dataset = load_split(cfg.data, "train", root)
    encoder = PromptEncoder.from_config(tokenizer, cfg.data, t.max_prompt_length)
    reward_fns = build_reward_functions(cfg.rewards)
    reward_names = [r.name for r in cfg.rewards]
    weights = torch.tensor(reward_weights if reward_weights is not None else [1.0] * len(reward_fns))
    if len(weights) != len(reward_fns):
        raise TrainingError(f"{len(weights)} reward weights for {len(reward_fns)} reward functions {reward_names}")
    optimizer, scheduler = build_optimizer_and_scheduler(model, t)
    model, optimizer = accelerator.prepare(model, optimizer)
    if ref_model is not None and not getattr(ref_model, "_is_adapter_view", False):
        ref_model.to(accelerator.device)
    policy = accelerator.unwrap_model(model)
    backend = (backend_factory or (lambda m, tok: backend_for(
        m, tok, t, rank=accelerator.process_index, local_rank=accelerator.local_process_index,
        world_size=accelerator.num_processes)))(policy, tokenizer)

    # Resume ---------------------------------------------------------------------------------------
    G = t.num_generations
    spg, ga, mu = t.effective_steps_per_generation, t.gradient_accumulation_steps, t.num_iterations
    micro_per_round = spg  # a generation round = spg micro-batches of per_device_train_batch_size
    prompts_per_round = t.per_device_train_batch_size * spg // G  # per process
    need_old_logps = mu > 1 or spg > ga
    # One global prompt order: each round takes the global batch and every process its own slice of it,
    # so N processes train on exactly the prompts one process would (the 2-process test checks it).
    sampler = PromptSampler(len(dataset), t.seed, allowed_prompts)
    rank, world = accelerator.process_index, accelerator.num_processes
    params_hash = training_params_hash(cfg, weights.tolist())
    step, micro_step, round_ = 0, 0, None
    resumed_from = None
    rollbacks = 0
    if accelerator.is_main_process:
        remove_stale_temp_dirs(ckpt_dir)
    accelerator.wait_for_everyone()
    last = latest_checkpoint(ckpt_dir) if t.resume == "auto" else None
    if last is not None:
        state, round_ = _restore_checkpoint(last, params_hash, policy, optimizer, scheduler, ref_model, sampler)
        step, micro_step, rollbacks = state["step"], state["micro_step"], state.get("rollbacks", 0)
        resumed_from = last
        backend.sync_weights(policy)
        log.info("resumed from %s (step %d)", last, step)
    if step >= t.max_steps:
        log.info("already trained to step %d >= max_steps %d", step, t.max_steps)
    # rank 0 alone owns the log: two ranks rewriting one file race on its temp name
    step_log = StepLog(log_path, metric_columns(reward_names), step) if accelerator.is_main_process else None
    monitor = GuardMonitor(cfg.guards)

    bar = None
    if progress and accelerator.is_main_process:
        from tqdm.auto import tqdm
        bar = tqdm(total=t.max_steps, initial=step, desc="grpo", unit="step", dynamic_ncols=True)

    # Loop -----------------------------------------------------------------------------------------
    metrics: dict[str, Any] = {}
    model.train()
    while step < t.max_steps:
        step_start = time.perf_counter()
        if micro_step % (micro_per_round * mu) == 0:  # a new generation round
            indices = sampler.take(prompts_per_round * world)[rank * prompts_per_round:(rank + 1) * prompts_per_round]
            round_ = generate_and_score(backend=backend, tokenizer=tokenizer, dataset=dataset, indices=indices,
                                        encoder=encoder, reward_fns=reward_fns, reward_names=reward_names,
                                        weights=weights, cfg=cfg, accelerator=accelerator)
            round_.pop("texts")
            if t.group_by_length and ga > 1:  # one micro-batch per step: nothing to regroup
                order = length_grouped_order(round_["prompt_mask"].sum(1), round_["completion_mask"].sum(1), G,
                                             span=ga * t.per_device_train_batch_size,
                                             keep_groups=use_manual_forward(model, t.forward_backend))
                round_.update(select_rows(round_, order))
            if need_old_logps:
                round_["old_logps"] = _frozen_logprobs(model, round_, t)
            if ref_model is not None:
                round_["ref_logps"] = _frozen_logprobs(ref_model, round_, t)

        # The micro-batches of this optimizer step: slice (micro_step % spg) .. of the round.
        losses, stats_acc = [], []
        step_slices = [(micro_step + j) % micro_per_round for j in range(ga)]
        bs = t.per_device_train_batch_size
        mbs = [micro_batch(round_, s * bs, (s + 1) * bs) for s in step_slices]
        loss_masks = [_loss_mask(mb, t) for mb in mbs]
        num_items = _global_sum(accelerator, sum(int(m.sum()) for m in loss_masks)) / accelerator.num_processes
        entropies = []
        for j, (mb, loss_mask) in enumerate(zip(mbs, loss_masks)):
            sync = j == ga - 1
            ctx = accelerator.no_sync(model) if (not sync and accelerator.num_processes > 1) else contextlib.nullcontext()
            with ctx:
                logps, entropy, _ = policy_logprobs(model, mb, t.temperature, compute_entropy=True,
                                                    forward=t.forward_backend)
                width = logps.shape[1]
                loss, stats = grpo_loss(
                    logps, _cut(mb.get("old_logps"), width, logps.device),
                    _cut(mb.get("ref_logps"), width, logps.device),
                    mb["advantages"].to(logps.device), loss_mask[:, :width].to(logps.device),
                    loss_type=t.loss_type, beta=t.beta, epsilon_low=t.epsilon, epsilon_high=t.epsilon_high,
                    delta=t.delta, importance_sampling_level=t.importance_sampling_level,
                    max_completion_length=t.max_completion_length, num_items=max(num_items, 1.0))
                if t.loss_type != "dapo":  # dapo already divides by the step's token count
                    loss = loss / ga
                if torch.isfinite(loss):  # a NaN never reaches the gradients; the nonfinite guard acts on it
                    accelerator.backward(loss)
            losses.append(loss.detach())
            stats_acc.append(stats)
            m = loss_mask[:, :width].to(entropy.device).float()
            entropies.append(((entropy * m).sum() / m.sum().clamp(min=1)).detach())
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else float("inf")
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)

        # Metrics (TRL names) and guards, before the update is applied ------------------------------
        metrics = {"step": step + 1, **round_["metrics"]}
        metrics["loss"] = torch.stack(losses).sum().item()
        for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            vals = [float(s[key]) for s in stats_acc if key in s]
            metrics[key] = sum(vals) / len(vals) if vals else 0.0
        metrics["entropy"] = torch.stack(entropies).mean().item()
        if world > 1:  # every rank logs, and guards decide on, the same numbers: the mean over processes
            metrics.update(_reduce_metrics(accelerator, metrics, float(sum(int(m.sum()) for m in loss_masks))))
        metrics["grad_norm"] = float(grad_norm)
        event = decide(monitor.check(step + 1, metrics))
        if event is not None:
            log.warning("guard %s (%s): %s", event.guard, event.action, event.message)
            _tag(tracker, {f"guard.{event.guard}": f"{event.action}: {event.message}"})
        if event is not None and event.action == "rollback" and rollbacks >= cfg.guards.max_rollbacks:
            event = GuardEvent(event.guard, "stop", f"{event.message} (after {rollbacks} rollbacks)")
        if event is not None and event.action == "stop":
            kept = latest_checkpoint(ckpt_dir)
            raise GuardStop(f"guard {event.guard} stopped training: {event.message}; "
                            + (f"the last good checkpoint is {kept}" if kept else "no checkpoint had been written yet"))
        if event is not None and event.action == "rollback":
            last = latest_checkpoint(ckpt_dir)
            if last is None:
                raise GuardStop(f"guard {event.guard} asked for a rollback but there is no checkpoint yet: "
                                f"{event.message}")
            optimizer.zero_grad(set_to_none=True)
            state, round_ = _restore_checkpoint(last, params_hash, policy, optimizer, scheduler, ref_model, sampler)
            step, micro_step = state["step"], state["micro_step"]
            backend.sync_weights(policy)  # an external engine must not sample with the abandoned weights
            rollbacks += 1
            _scale_learning_rate(optimizer, scheduler, cfg.guards.rollback_lr_factor)
            if accelerator.is_main_process:
                step_log = StepLog(log_path, metric_columns(reward_names), step)
            monitor.reset_history()
            if bar is not None:
                bar.n = step
                bar.refresh()
            log.warning("rolled back to %s; learning rate x%g", last, cfg.guards.rollback_lr_factor)
            continue
        skipped = event is not None and event.action == "skip_step"
        if not skipped:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        micro_step += ga
        step += 1
        backend.sync_weights(policy)
        if ref_model is not None and t.sync_ref_model and step % t.ref_model_sync_steps == 0:
            _mix_reference(ref_model, policy, t.ref_model_mixup_alpha)

        metrics["guard/skipped"] = float(skipped)
        metrics["learning_rate"] = scheduler.get_last_lr()[0]
        metrics["num_tokens"] = num_items * accelerator.num_processes
        metrics["step_time"] = time.perf_counter() - step_start  # generation included when this step sampled
        if accelerator.is_main_process:
            if step % t.logging_steps == 0 or step == t.max_steps:
                step_log.append(metrics)
                if tracker is not None:
                    tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                                len=f"{metrics['completions/mean_length']:.1f}")
        mid_round = micro_step % (micro_per_round * mu) != 0
        if world > 1 and mid_round:
            pass  # each process holds its own slice of the round: checkpoint at the round's end instead
        elif step % t.save_steps == 0 or step == t.max_steps or (world > 1 and _passed_save_step(step, ga, t)):
            _save(ckpt_dir, step, micro_step, policy, tokenizer, optimizer, scheduler, sampler, params_hash,
                  round_ if micro_step % (micro_per_round * mu) else None, ref_model, t, metrics, accelerator,
                  rollbacks)
    if bar is not None:
        bar.close()

    # Final model: the newest checkpoint's weights, in HF format, written atomically -----------------
    if accelerator.is_main_process:
        _export_model(policy, tokenizer, model_dir, DTYPES[cfg.model.dtype])
    accelerator.wait_for_everyone()
    return TrainResult(step, model_dir, log_path, ckpt_dir, resumed_from, metrics)


# ---------------------------------------------------------------------------------------------------
# Helpers of the loop


def _device_of(model) -> torch.device:
    """The device of a model's weights (the LoRA reference view holds its policy outside its module tree)."""
    for p in model.parameters():
        return p.device
    inner = getattr(model, "_peft", None)
    return _device_of(inner[0]) if inner else torch.device("cpu")


def _cut(x: torch.Tensor | None, width: int, device=None) -> torch.Tensor | None:
    if x is not None and device is not None:
        return x[:, :width].to(device, non_blocking=True)
    return None if x is None else x[:, :width]


def _loss_mask(mb: dict, t) -> torch.Tensor:
    mask = mb["completion_mask"].clone()
    if t.mask_truncated_completions:
        mask = mask * (~mb["is_truncated"]).unsqueeze(1).long()
    return mask


_TOKEN_MEAN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _reduce_metrics(accelerator, metrics: dict, local_tokens: float) -> dict:
    """One all-reduce for the step's per-process metrics, so every rank logs (and its guards judge) the
    numbers one process would: the loss is a plain mean (each process's share is already scaled to the
    global batch), the token means are weighted by each process's loss tokens."""
    keys = _TOKEN_MEAN_METRICS
    local = [float(metrics["loss"]), local_tokens] + [float(metrics[k]) * local_tokens for k in keys]
    total = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), "sum").tolist()
    out = {"loss": total[0] / accelerator.num_processes}
    out.update({k: v / max(total[1], 1.0) for k, v in zip(keys, total[2:])})
    return out


def _passed_save_step(step: int, ga: int, t) -> bool:
    """Multi-process: a save step skipped inside a generation round is caught up at the round's end."""
    rounds_steps = t.effective_steps_per_generation // ga * t.num_iterations  # optimizer steps per round
    return any((step - j) % t.save_steps == 0 for j in range(1, max(rounds_steps, 1)))


def _global_sum(accelerator, value: int) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    return float(accelerator.reduce(torch.tensor(float(value), device=accelerator.device), "sum").item())


@torch.no_grad()
def _frozen_logprobs(model, round_: dict, t) -> torch.Tensor:
    """Log-probs of the round's completions under a frozen model, micro-batch by micro-batch: (N, C)."""
    n, width = round_["completion_ids"].shape
    out = torch.zeros(n, width)
    bs = t.per_device_train_batch_size
    for start in range(0, n, bs):
        mb = micro_batch(round_, start, min(start + bs, n))
        logps, _, _ = policy_logprobs(model, mb, t.temperature, compute_entropy=False, forward=t.forward_backend)
        out[start:start + logps.shape[0], :logps.shape[1]] = logps.float().cpu()
    return out


@torch.no_grad()
def _mix_reference(ref_model, policy, alpha: float) -> None:
    """TR-DPO: ref <- alpha * policy + (1 - alpha) * ref."""
    for ref_p, p in zip(ref_model.parameters(), policy.parameters()):
        ref_p.mul_(1 - alpha).add_(p.detach().to(ref_p.dtype), alpha=alpha)
    ref_model._synced = True


def _restore_checkpoint(path, params_hash, policy, optimizer, scheduler, ref_model, sampler):
    """Load weights, optimizer, scheduler, reference, sampler and RNGs; return (state, rollout buffer)."""
    ck = load_checkpoint(path, expected_hash=params_hash)
    _load_weights(policy, path)
    optimizer.load_state_dict(ck.optimizer)
    scheduler.load_state_dict(ck.scheduler)
    if ck.reference_state is not None and ref_model is not None:
        ref_model.load_state_dict(ck.reference_state)
    sampler.load_state_dict(ck.state["sampler"])
    round_ = ck.rollout_buffer
    if round_ is not None:
        round_["metrics"] = json.loads(bytes(round_.pop("metrics_json").tolist()))
    set_rng_state(ck.state["rng"])
    return ck.state, round_


def _scale_learning_rate(optimizer, scheduler, factor: float) -> None:
    """Multiply the schedule's base rates (and the current rate) by ``factor``: the rollback's cooler restart."""
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor


def _tag(tracker, tags: dict) -> None:
    if tracker is not None and hasattr(tracker, "set_tags"):
        tracker.set_tags(tags)


def _load_weights(model, path: Path) -> None:
    """A checkpoint's trained weights into ``model``: every weight, or under LoRA the adapters alone (what
    peft's ``save_pretrained`` wrote, in its own key names)."""
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        adapter = path / "adapter_model.safetensors"
        if not adapter.is_file():
            raise TrainingError(f"{path}: no adapter_model.safetensors; the checkpoint was not written by a LoRA "
                                "run (model.lora is set now)")
        state = load_file(adapter)
        result = set_peft_model_state_dict(model, state)
        lora_keys = [k for k, _ in model.named_parameters() if "lora_" in k]
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing or len(state) != len(lora_keys):
            raise TrainingError(f"{path}: checkpoint adapters do not match the model (missing {missing[:5]}, "
                                f"unexpected {list(result.unexpected_keys)[:5]}; {len(state)} tensors saved, "
                                f"{len(lora_keys)} adapter weights in the model)")
        return
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name != "reference.safetensors"]
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; anything else missing means a different architecture.
    missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise TrainingError(f"{path}: checkpoint weights do not match the model (missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]})")


def _save(ckpt_dir, step, micro_step, policy, tokenizer, optimizer, scheduler, sampler, params_hash,
          round_, ref_model, t, metrics, accelerator, rollbacks) -> None:
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    buffer = None
    if round_ is not None:
        buffer = {k: v for k, v in round_.items() if isinstance(v, torch.Tensor)}
        buffer["metrics_json"] = torch.tensor(list(_json_bytes(round_["metrics"])), dtype=torch.uint8)
    ref_state = ref_model.state_dict() if ref_model is not None and getattr(ref_model, "_synced", False) else None
    state = {"micro_step": micro_step, "sampler": sampler.state_dict(), "params_hash": params_hash,
             "rollbacks": rollbacks,
             "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    save_checkpoint(ckpt_dir, step, model=policy, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                    state=state, rollout_buffer=buffer, reference_state=ref_state, keep_last=t.save_total_limit)


def _json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()


def _export_model(policy, tokenizer, model_dir: Path, dtype: torch.dtype) -> None:
    """The final policy in ``model.dtype``, HF format, via a temp dir + rename. Under LoRA: the merged model
    (base + adapters, loadable with ``from_pretrained``) with the adapters themselves in ``adapter/``."""
    import shutil

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(model_dir.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    if is_peft_model(policy):
        policy.save_pretrained(tmp / "adapter", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "adapter")
        policy = policy.merge_and_unload()
    policy.to(dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    os.replace(tmp, model_dir)
