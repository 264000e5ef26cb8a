"""The GRPO training loop, read top to bottom in ``train()``; each phase below it is a function.

    set up      policy, reference, optimizer, rollout backend, data, rewards     -> TrainingRun
    resume      the newest complete checkpoint, or step 0                        -> TrainState
    per step:
      round     at a round's start, sample_next_round: G completions per prompt, rewards (N, K),
                advantages (N,) -> Round (async_rollouts: the round the sampler worker sampled ahead, and
                the next one submitted; train.curriculum: prompts of each task's current level, which the
                round's accuracy may raise); then prepare_round: old log-probs (only when a round feeds > 1
                step), reference log-probs (beta > 0)
      gradients ga micro-batches: run.loss_fn(logps, old_logps, ref_logps, A, mask) (GRPOLoss); backward; clip
      guards    the step's metrics decide: apply, skip the update, roll back, or stop
      update    optimizer and schedule step; the rollout engine gets the new weights
      evaluate  every eval_steps: the policy on held-out prompts -> eval/* (grpo_core/train/periodic_eval.py)
      log       the step log (CSV) and the tracker
      save      every save_steps and at the end (with the round when the step ends inside it); the best
                checkpoint by metric_for_best_model is kept
    export      the final policy (load_best_model_at_end: the best checkpoint's), HF format

The math is in ``grpo_core/advantages.py``, ``loss.py`` and ``model/logprobs.py``; this file only wires it.
Shapes: N rows of a round on this process (prompts × G), P/C prompt/completion widths,
B = per_device_train_batch_size.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from grpo_core.loss import sampler_correction
from grpo_core.model.fastforward import use_manual_forward
from grpo_core.model.loading import DTYPES, load_model
from grpo_core.train.batching import BatchPlan, length_grouped_order
from grpo_core.train.checkpoint import latest_valid_checkpoint, remove_stale_temp_dirs
from grpo_core.train.completions import CompletionLog, as_table, completion_rows
from grpo_core.train.curriculum import build_sampler, close_round, curriculum_columns, observe
from grpo_core.train.dynamic import fill_round
from grpo_core.train.entropy import applied_entropy_coef, next_entropy_coef
from grpo_core.train.export import export_model
from grpo_core.train.forward import frozen_logprobs
from grpo_core.train.guards import GuardEvent, GuardMonitor, GuardsConfig, GuardStop, decide
from grpo_core.train.metrics import loss_stat_means, reduce_across_processes
from grpo_core.train.micro_batch import micro_batch_loss
from grpo_core.train.options import RunSections
from grpo_core.train.parallel import finite_everywhere, gather_values, global_sum
from grpo_core.train.periodic_eval import evaluate_held_out, evaluation_due, load_best_weights, update_best
from grpo_core.train.round import Round, assign_advantages, sample_round
from grpo_core.train.rounds_ahead import receive_round, take_round_ahead
from grpo_core.train.sampler_worker import SamplerWorker
from grpo_core.train.setup import set_up, start_sampler
from grpo_core.train.state import (
    Prompts,
    PromptSampler,
    Sampler,
    TrainingError,
    TrainingRun,
    TrainState,
    restore_state,
    save_state,
)
from grpo_core.train.step_log import StepLog, metric_columns

log = logging.getLogger(__name__)

__all__ = ["TrainHooks", "TrainResult", "TrainingError", "PromptSampler", "train"]


@dataclass
class TrainResult:
    final_step: int
    model_dir: Path
    log_path: Path
    checkpoint_dir: Path
    resumed_from: Path | None
    last_metrics: dict
    best_step: int | None = None          # the best checkpoint by metric_for_best_model (None: not tracked)
    best_value: float | None = None
    # the step whose weights were exported (load_best_model_at_end: the best)
    exported_step: int | None = None


@dataclass
class StepGradients:
    """What one step's gradient accumulation leaves besides the gradients themselves (all detached)."""

    losses: list[torch.Tensor]      # one () per micro-batch, already scaled to the step
    stats: list[dict]               # grpo_loss diagnostics per micro-batch
    entropies: list[torch.Tensor]   # one () per micro-batch: mean entropy over its loss tokens
    grad_norm: torch.Tensor         # () before clipping
    num_items: float                # loss tokens per process (the global count / processes)
    local_tokens: int               # this process's loss tokens
    trained_entropy: torch.Tensor | None  # (2,) float64: entropy sum and count over the trained tokens, this
                                          # process (use_adaptive_entropy only)


@dataclass(frozen=True)
class TrainHooks:
    """What a caller plugs into ``train()``: its tracker, its rollout backend, a sampler worker it spawned."""

    tracker: Any = None  # log_metrics(dict, step), optionally set_tags(dict) and log_table (e.g. MLflow)
    backend_factory: Callable | None = None  # (policy, tokenizer) -> backend, instead of generation.backend's
    # train.async_rollouts: a SamplerWorker spawned early, so that its imports overlap the caller's own set-up
    # (None: train() spawns one)
    sampler_worker: SamplerWorker | None = None


def train(cfg: RunSections, *, reward_weights: list[float] | None = None, root: str | Path = ".",
          allowed_prompts: list[int] | None = None, progress: bool = True,
          log_path: str | Path = "metrics/train_log.csv", export: bool = True,
          hooks: TrainHooks | None = None) -> TrainResult:
    """Run GRPO per ``cfg.train``; write checkpoints, the final model and the per-step log.

    reward_weights: one per reward function (None = what ``dvc repro`` uses: train.reward_weights when pinned,
    else calibrate's <root>/artifacts/calibration/reward_weights.json, else 1 each; ``train.reward_weights``
    module). allowed_prompts: dataset indices to train on (calibration may drop always/never-solved prompts).
    export: write the final model (benchmarks leave it out). hooks: the caller's tracker, rollout backend and
    sampler worker (``TrainHooks``); the sampler worker is stopped at train()'s end, whoever spawned it.
    Resumes from the newest complete checkpoint unless train.resume=never.
    """
    t, root, hooks = cfg.train, Path(root), hooks or TrainHooks()
    log_path, model_dir = root / log_path, root / t.checkpoints.output_dir / "model"
    worker = hooks.sampler_worker or (SamplerWorker() if t.rollouts.async_rollouts else None)
    with worker or contextlib.nullcontext():  # the worker is spawned first: its imports overlap the set-up
        run, prompts = set_up(cfg, root, reward_weights, hooks.backend_factory)
        sampler = build_sampler(t.levels, prompts.dataset, cfg.rewards, cfg.data, seed=t.seed,
                                allowed=allowed_prompts, shuffle=t.batch.shuffle_dataset)
        state, resumed_from = resume_or_start(run, sampler)
        step_log = open_step_log(run, log_path, prompts.scoring.reward_names, state.step, sampler)
        samples_log = open_completion_log(run, log_path, state.step)
        monitor = GuardMonitor(cfg.guards)
        bar = _progress_bar(run, state.step) if progress else None

        metrics: dict[str, Any] = {}
        run.policy.train_mode()
        if worker is not None:
            start_sampler(run, cfg.rewards, prompts, worker, hooks.backend_factory)
        while state.step < t.max_steps:
            step_start = time.perf_counter()
            if not _inside_round(state, run.plan):
                state.round = prepare_round(run, sample_next_round(run, prompts, state))
            entropy_coef = applied_entropy_coef(state.entropy_coef, state.last_entropy,
                                                adaptive=run.entropy.use_adaptive_entropy,
                                                target=run.entropy.entropy_target)
            grads = accumulate_gradients(run, step_micro_batches(state, run.plan), entropy_coef)
            metrics = step_metrics(run, state, grads)
            event = guard_decision(run, cfg.guards, monitor, state, metrics, hooks.tracker)
            if event is not None and event.action == "rollback":
                state = roll_back(run, state, cfg.guards.rollback_lr_factor)
                step_log = open_step_log(run, log_path, prompts.scoring.reward_names, state.step, sampler)
                samples_log = open_completion_log(run, log_path, state.step)
                monitor.reset_history()
                _progress_to(bar, state.step)
                continue
            skipped = event is not None and event.action == "skip_step"
            apply_update(run, state, skipped=skipped)
            adapt_entropy_coef(run, state, grads)
            if run.entropy.logged:
                metrics["entropy_coef"] = state.entropy_coef
            metrics.update({"guard/skipped": float(skipped),
                            "learning_rate": run.policy.learning_rate(),
                            "num_tokens": grads.num_items * run.accelerator.num_processes,
                            # generation included when it sampled
                            "step_time": time.perf_counter() - step_start})
            if prompts.held_out is not None and evaluation_due(run.evaluation, state.step, run.max_steps):
                with record_function("grpo/evaluate"):
                    metrics.update(evaluate_held_out(run, prompts.held_out))
            log_step(run, state, metrics, step_log, hooks.tracker, bar)
            log_completions(run, state, prompts.scoring.reward_names, samples_log, hooks.tracker)
            save_if_due(run, state, metrics)
    if bar is not None:
        bar.close()

    best = load_best_weights(run, state)
    if best is not None:
        log.info("load_best_model_at_end: exporting %s (%s %.4g)", best, run.evaluation.best_metric,
                 state.best_value)
    if export:
        with record_function("grpo/export"):
            final = run.policy.whole()  # collective when sharded without a replica
            if run.accelerator.is_main_process:
                export_model(final, run.tokenizer, model_dir, DTYPES[cfg.model.dtype],
                             full_precision_base=lambda: load_model(cfg.model, root))  # QLoRA merges into it
    run.accelerator.wait_for_everyone()
    return TrainResult(state.step, model_dir, log_path, run.checkpoint_dir, resumed_from, metrics,
                       best_step=state.best_step, best_value=state.best_value,
                       exported_step=state.best_step if best is not None else state.step)


# ---------------------------------------------------------------------------------------------------
# Set-up and resume


def resume_or_start(run: TrainingRun, sampler: Sampler) -> tuple[TrainState, Path | None]:
    """The newest complete checkpoint's state (train.resume=auto), else step 0; and where it came from."""
    if run.accelerator.is_main_process:
        remove_stale_temp_dirs(run.checkpoint_dir)
    run.accelerator.wait_for_everyone()
    last = latest_valid_checkpoint(run.checkpoint_dir) if run.checkpoints.resume == "auto" else None
    if last is None:
        return TrainState(sampler=sampler, entropy_coef=run.entropy.entropy_coef), None
    state = restore_state(run, last, sampler)
    run.policy.sync_rollouts()
    log.info("resumed from %s (step %d)", last, state.step)
    if state.step >= run.max_steps:
        log.info("already trained to step %d >= max_steps %d", state.step, run.max_steps)
    return state, last


def open_step_log(run: TrainingRun, path: Path, reward_names: list[str], step: int,
                  sampler: Sampler) -> StepLog | None:
    """Rank 0 alone owns the log (two ranks rewriting one file race on its temp name); a curriculum's
    columns after the others."""
    if not run.accelerator.is_main_process:
        return None
    levels = curriculum_columns(sampler)
    return StepLog(path, metric_columns(run, reward_names) + levels, step,
                   possible=metric_columns(run, reward_names, late=True) + levels)


# ---------------------------------------------------------------------------------------------------
# Round


def sample_next_round(run: TrainingRun, prompts: Prompts, state: TrainState) -> Round:
    """This process's share of the next global batch of prompts, sampled, scored and given advantages (with
    dynamic sampling: its quota of groups whose rewards differ, ``grpo_core/train/dynamic.py``, the surplus
    left in ``state.pending``; with async rollouts: the round sampled ahead).

    One global prompt order: each sampling takes the global batch and every process its own slice of it, so N
    processes train on exactly the prompts one process would.
    """
    plan, acc = run.plan, run.accelerator
    per_process = plan.prompts_per_round
    rank = acc.process_index

    def sample() -> Round:
        indices = state.sampler.take(per_process * acc.num_processes)[
            rank * per_process:(rank + 1) * per_process]
        rows = [prompts.dataset[i] for i in indices]
        sampled = sample_round(backend=run.policy.rollouts, tokenizer=run.tokenizer, rows=rows,
                               row_ids=indices, encoder=prompts.encoder, scoring=prompts.scoring,
                               spec=run.round_spec, accelerator=acc)
        observe(state.sampler, indices, sampled.rewards)  # a curriculum judges all that is sampled
        return sampled

    weights = prompts.scoring.weights
    with record_function("grpo/generate_round"):
        if run.sampler is not None:
            round_ = assign_advantages(take_round_ahead(run, prompts, state, per_process), weights,
                                       run.advantage, plan.group_size, acc)
        elif run.rollouts.dynamic_sampling:
            filled = fill_round(sample, state.pending, quota=per_process, scoring=prompts.scoring,
                                a=run.advantage, group_size=plan.group_size,
                                max_rounds=run.rollouts.dynamic_sampling_max_rounds, accelerator=acc)
            round_, state.pending = filled.round, filled.pending
        else:
            round_ = assign_advantages(sample(), weights, run.advantage, plan.group_size, acc)
    round_.metrics.update(close_round(state.sampler, acc, state.step + 1, log))
    return round_


def prepare_round(run: TrainingRun, round_: Round) -> Round:
    """A sampled round made ready to train on: rows length-grouped within each step's span; the frozen
    log-probs its steps need (old, when the round outlives this policy; reference, beta > 0); the sampler
    correction's ratio."""
    plan, acc = run.plan, run.accelerator
    ga = plan.micro_batches_per_step
    if run.batch.group_by_length and ga > 1:  # one micro-batch per step: nothing to regroup
        order = length_grouped_order(round_.prompt_mask.sum(1), round_.completion_mask.sum(1),
                                     plan.group_size, span=ga * plan.micro_batch_size,
                                     keep_groups=use_manual_forward(run.policy.module,
                                                                    run.logprobs.forward.forward_backend))
        round_ = round_.rows(order)
    sc = run.sampler_correction
    corrected = round_.sampling_logps is not None and sc.vllm_importance_sampling_correction
    outlives = plan.passes_per_round > 1 or plan.micro_batches_per_round > ga or corrected
    # the round outlives this policy, or the sampler is not it (a round sampled ahead brings the sampling
    # weights' own)
    if outlives and round_.old_logps is None:
        with record_function("grpo/old_logprobs"):
            round_.old_logps = frozen_logprobs(run.policy.module, round_, run.logprobs)
    if corrected:
        round_.sampler_ratio = sampler_correction(round_.old_logps, round_.sampling_logps,
                                                  round_.model_mask(), sc.vllm_importance_sampling_mode,
                                                  sc.vllm_importance_sampling_clip_min,
                                                  sc.vllm_importance_sampling_clip_max)
        round_.metrics.update(sampler_metrics(acc, round_))
    if run.policy.reference is not None and round_.ref_logps is None:  # a round sampled ahead brings them
        with record_function("grpo/ref_logprobs"):
            round_.ref_logps = frozen_logprobs(run.policy.reference, round_, run.logprobs)
    return round_


def sampler_metrics(accelerator, round_: Round) -> dict[str, float]:
    """TRL's sampling/* metrics of a round: |old - sampler| log-prob gap over the scored tokens, and the
    correction's ratio (over tokens, or sequences at sequence level), over every process."""
    mask = round_.model_mask().bool()
    gap = (round_.old_logps - round_.sampling_logps).abs()
    gap = gap[mask & ~torch.isnan(gap)]
    ratio = (round_.sampler_ratio.flatten() if round_.sampler_ratio.shape[1] == 1
             else round_.sampler_ratio[mask])
    gap, ratio = (gather_values(accelerator, v.float()) if accelerator.num_processes > 1 else v for v in (
        gap,
        ratio))

    def stat(values, fn):
        return float(fn(values)) if values.numel() else 0.0

    return {"sampling/sampling_logp_difference/mean": stat(gap, torch.mean),
            "sampling/sampling_logp_difference/max": stat(gap, torch.max),
            "sampling/importance_sampling_ratio/min": stat(ratio, torch.min),
            "sampling/importance_sampling_ratio/mean": stat(ratio, torch.mean),
            "sampling/importance_sampling_ratio/max": stat(ratio, torch.max)}


def step_micro_batches(state: TrainState, plan: BatchPlan) -> list[Round]:
    """The ga micro-batches (B rows each) of this optimizer step: slices
    (micro_step + j) % spg of the round."""
    spg, bs = plan.micro_batches_per_round, plan.micro_batch_size
    slices = [(state.micro_step + j) % spg for j in range(plan.micro_batches_per_step)]
    return [state.round.rows(slice(s * bs, (s + 1) * bs)) for s in slices]


# ---------------------------------------------------------------------------------------------------
# Gradients and metrics


def accumulate_gradients(run: TrainingRun, micro_batches: list[Round],
                         entropy_coef: float = 0.0) -> StepGradients:
    """Forward, loss and backward of each micro-batch (gradients summed over them), then clip.

    A non-finite loss never reaches the gradients; the nonfinite guard acts on it. entropy_coef: the entropy
    bonus this step applies (``applied_entropy_coef``).
    """
    acc = run.accelerator
    ga = len(micro_batches)
    loss_masks = [mb.loss_mask(run.rollouts.mask_truncated_completions) for mb in micro_batches]
    local_tokens = sum(int(m.sum()) for m in loss_masks)
    num_items = global_sum(acc, local_tokens) / acc.num_processes
    losses, stats, entropies, window = [], [], [], None
    for j, (mb, loss_mask) in enumerate(zip(micro_batches, loss_masks)):
        with run.policy.gradient_sync(acc, last=j == ga - 1):
            with record_function("grpo/policy_forward"):
                part = micro_batch_loss(run, mb, loss_mask, num_items=num_items, entropy_coef=entropy_coef)
            # one answer on every process, or their backward passes part ways
            if finite_everywhere(acc, part.loss):
                with record_function("grpo/backward"):
                    acc.backward(part.loss)
        losses.append(part.loss.detach())
        stats.append(part.stats)
        entropies.append(part.mean_entropy)
        if part.trained_entropy is not None:
            window = part.trained_entropy if window is None else window + part.trained_entropy
    grad_norm = run.policy.finish_gradients(acc, run.optim.max_grad_norm)  # the masters', averaged, clipped
    return StepGradients(losses, stats, entropies, grad_norm, num_items, local_tokens, window)


def step_metrics(run: TrainingRun, state: TrainState, grads: StepGradients) -> dict[str, Any]:
    """The step's metrics (grpo_core/train/metrics.py declares them) but those set after the update: the
    round's, loss, the loss's statistics, entropy, grad norm. On N processes every rank gets the numbers one
    process would."""
    acc = run.accelerator
    metrics = {"step": state.step + 1, **state.round.metrics}
    metrics["loss"] = torch.stack(grads.losses).sum().item()
    metrics.update(loss_stat_means(grads.stats, acc))
    metrics["entropy"] = torch.stack(grads.entropies).mean().item()
    if acc.num_processes > 1:
        metrics.update(reduce_across_processes(acc, metrics, float(grads.local_tokens)))
    metrics["grad_norm"] = float(grads.grad_norm)
    return metrics


# ---------------------------------------------------------------------------------------------------
# Guards, update, log, save


def guard_decision(run: TrainingRun, guards: GuardsConfig, monitor: GuardMonitor, state: TrainState,
                   metrics: dict, tracker) -> GuardEvent | None:
    """The most severe guard event of the step (None: all is well). Raises GuardStop for ``stop``, for a
    rollback past ``max_rollbacks`` and for a rollback with no checkpoint to go back to."""
    event = decide(monitor.check(state.step + 1, metrics))
    if event is None:
        return None
    log.warning("guard %s (%s): %s", event.guard, event.action, event.message)
    if tracker is not None and hasattr(tracker, "set_tags"):
        tracker.set_tags({f"guard.{event.guard}": f"{event.action}: {event.message}"})
    if event.action == "rollback" and state.rollbacks >= guards.max_rollbacks:
        event = GuardEvent(event.guard, "stop", f"{event.message} (after {state.rollbacks} rollbacks)")
    if event.action not in ("stop", "rollback"):
        return event
    kept = latest_valid_checkpoint(run.checkpoint_dir)
    if event.action == "stop":
        raise GuardStop(f"guard {event.guard} stopped training: {event.message}; "
                        + (f"the last good checkpoint is {kept}" if kept else "no checkpoint had been "
                                                                              "written yet"))
    if event.action == "rollback" and kept is None:
        raise GuardStop(f"guard {event.guard} asked for a rollback but there is no checkpoint yet: "
                        f"{event.message}")
    return event


def roll_back(run: TrainingRun, state: TrainState, lr_factor: float) -> TrainState:
    """Back to the newest checkpoint, with the learning rate multiplied by ``lr_factor``."""
    last = latest_valid_checkpoint(run.checkpoint_dir)
    run.policy.zero_grad()
    if run.sampler is not None and run.sampler.in_flight:
        # sampled by the abandoned weights: dropped (the checkpoint has its own round ahead)
        run.sampler.receive()
    restored = restore_state(run, last, state.sampler)
    restored.rollbacks = state.rollbacks + 1
    run.policy.sync_rollouts()  # an external engine must not sample with the abandoned weights
    run.policy.scale_learning_rate(lr_factor)
    log.warning("rolled back to %s; learning rate x%g", last, lr_factor)
    return restored


def apply_update(run: TrainingRun, state: TrainState, skipped: bool) -> None:
    """Step the optimizer and schedule (unless a guard skips the update), advance the state, and hand the new
    weights to the rollout engine and, every ref_model_sync_steps, to the reference (TR-DPO)."""
    if not skipped:
        with record_function("grpo/optimizer_step"):
            run.policy.step()
    run.policy.zero_grad()
    state.micro_step += run.plan.micro_batches_per_step
    state.step += 1
    with record_function("grpo/sync_weights"):
        run.policy.sync_rollouts()
    if run.policy.reference is not None and run.reference.due(state.step):
        run.policy.mix_into_reference(run.reference.ref_model_mixup_alpha)
        state.reference_synced = True


def open_completion_log(run: TrainingRun, step_log_path: Path, step: int) -> CompletionLog | None:
    """Rank 0's completions file beside the step log, when ``log_completions_steps`` asks for one."""
    if not run.completions.log_completions_steps or not run.accelerator.is_main_process:
        return None
    return CompletionLog(step_log_path.with_suffix(".completions.jsonl"), step)


def log_completions(run: TrainingRun, state: TrainState, reward_names: list[str],
                    samples_log: CompletionLog | None, tracker) -> None:
    """Every log_completions_steps: the round's rows as text, rewards and advantages (gathered from every
    process) into the completions file and, as a table, the tracker."""
    c, acc = run.completions, run.accelerator
    if not c.log_completions_steps or state.step % c.log_completions_steps:
        return
    rows = completion_rows(state.round, run.tokenizer, reward_names, state.step, c.num_completions_to_log)
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)[:c.num_completions_to_log]
    if not acc.is_main_process:
        return
    samples_log.append(rows)
    if tracker is not None and hasattr(tracker, "log_table"):
        tracker.log_table(as_table(rows), f"completions/step_{state.step:06d}.json")


def adapt_entropy_coef(run: TrainingRun, state: TrainState, grads: StepGradients) -> None:
    """Adaptive entropy control (``use_adaptive_entropy``): the step's entropy over the trained tokens of
    every process moves the coefficient for the next step. Its state is in TrainState, so checkpoints carry
    it."""
    e = run.entropy
    if not e.use_adaptive_entropy:
        return
    total = grads.trained_entropy
    if run.accelerator.num_processes > 1:
        total = run.accelerator.reduce(total.to(run.accelerator.device), "sum")
    total = total.cpu()
    entropy = float(total[0] / total[1].clamp(min=1.0))
    state.entropy_coef = next_entropy_coef(state.entropy_coef, entropy, target=e.entropy_target,
                                           delta=e.entropy_coef_delta, low=e.entropy_coef_min,
                                           high=e.entropy_coef_max)
    state.last_entropy = entropy


def log_step(run: TrainingRun, state: TrainState, metrics: dict, step_log: StepLog | None, tracker,
             bar) -> None:
    """Every logging_steps (and the last step): a line of the step log and the tracker's metrics; the bar."""
    if not run.accelerator.is_main_process:
        return
    if state.step % run.logging_steps == 0 or state.step == run.max_steps:
        step_log.append(metrics)
        if tracker is not None:
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=state.step)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['kl']:.4f}",
                        len=f"{metrics['completions/mean_length']:.1f}")


def save_if_due(run: TrainingRun, state: TrainState, metrics: dict) -> None:
    """A checkpoint every save_steps and at max_steps (save_strategy "no": never). Mid-round steps keep the
    round in the checkpoint; on N processes, where each holds its own slice of it, a save falling inside a
    round waits for the round's end."""
    c = run.checkpoints
    if c.save_strategy == "no":
        return
    mid_round = _inside_round(state, run.plan)
    multi = run.accelerator.num_processes > 1
    if multi and mid_round:
        return
    due = state.step % c.save_steps == 0 or state.step == run.max_steps
    if due or (multi and _passed_save_step(state.step, run.plan, c.save_steps)):
        update_best(run.evaluation, state, metrics)
        if run.sampler is not None and run.sampler.in_flight:
            receive_round(run, state)  # the round in flight is part of the state: saved, not regenerated
        with record_function("grpo/save"):
            save_state(run, state, metrics, keep_round=mid_round)


# ---------------------------------------------------------------------------------------------------
# Helpers of the phases


def _inside_round(state: TrainState, plan: BatchPlan) -> bool:
    """Whether the micro-steps taken so far end inside a generation round (spg micro-batches, num_iterations
    times over): a new step trains on the round in hand, and a checkpoint must keep it."""
    return state.micro_step % plan.micro_batches_per_round_trained != 0


def _passed_save_step(step: int, plan: BatchPlan, save_steps: int) -> bool:
    """Multi-process: a save step skipped inside a generation round is caught up at the round's end."""
    steps_per_round = plan.optimizer_steps_per_round
    return any((step - j) % save_steps == 0 for j in range(1, max(steps_per_round, 1)))


def _progress_bar(run: TrainingRun, step: int):
    if not run.accelerator.is_main_process:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.max_steps, initial=step, desc="grpo", unit="step", dynamic_ncols=True)


def _progress_to(bar, step: int) -> None:
    if bar is not None:
        bar.n = step
        bar.refresh()
