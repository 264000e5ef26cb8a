"""Evaluation during training (``train.eval_strategy: steps``) and the best checkpoint
(``metric_for_best_model``).

    every eval_steps and at the last step: the policy on the first eval_max_samples held-out prompts, greedy,
      then num_generations_eval samples each at the training temperature (grpo_core/evaluation.py)
      -> summarize_evaluation -> eval/* metrics in the step's log line and the tracker
    at each checkpoint: its eval/<metric> against the best so far -> TrainState.best_step / best_value;
      the best checkpoint is never pruned, and load_best_model_at_end exports its weights.

Rank 0 evaluates (the unwrapped policy, or under FSDP2 the whole sampling copy) and broadcasts the numbers.
Every RNG is saved before and restored after, so a run with evaluation trains exactly as one without (with a
vLLM engine, whose sampler keeps its own RNG, up to that engine's state).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from grpo_core.common.rng import rng_state, set_rng_state
from grpo_core.data.loading import DataConfig, PromptEncoder, load_split
from grpo_core.evaluation import (
    EvalOptions,
    Grading,
    eval_metric_names,
    eval_modes,
    score_policy,
    summarize_evaluation,
)
from grpo_core.rewards.judges import build_judges
from grpo_core.rollout import GenerationConfig, sampling_params
from grpo_core.train.state import HeldOutPrompts, TrainingRun, TrainState


def load_held_out(e: EvalOptions, data: DataConfig, g: GenerationConfig, reward_specs: list, *,
                  root: str | Path, seed: int, encoder: PromptEncoder,
                  reward_fns: list) -> HeldOutPrompts | None:
    """The held-out prompts when ``e.eval_strategy`` (resolved) is steps, else None."""
    if e.eval_strategy == "no":
        return None
    dataset = load_split(data, "eval", root)
    n = len(dataset) if e.eval_max_samples is None else min(e.eval_max_samples, len(dataset))
    modes = eval_modes(max_new_tokens=g.max_completion_length, num_generations=e.num_generations_eval,
                       sampling=sampling_params(g), sequences_per_call=e.per_device_eval_batch_size,
                       seed=seed)
    return HeldOutPrompts([dataset[i] for i in range(n)], encoder, reward_fns, [r.name for r in reward_specs],
                          build_judges(reward_specs), modes)


def evaluation_due(e: EvalOptions, step: int, max_steps: int) -> bool:
    return e.eval_strategy == "steps" and (step % e.eval_steps == 0 or step == max_steps)


def evaluate_held_out(run: TrainingRun, held_out: HeldOutPrompts) -> dict[str, float]:
    """The eval/* metrics of the policy as it is now (NaN where a mean has no value), on every process."""
    calls, acc = run.round_spec.reward_calls, run.accelerator
    metrics: dict[str, float] | None = None
    if acc.is_main_process:
        start, saved = time.perf_counter(), rng_state()
        try:
            grading = Grading(held_out.reward_fns, held_out.reward_names, held_out.judges,
                              calls.reward_errors, calls.reward_timeout_s)
            modes = [dataclasses.replace(mode, tools=run.round_spec.tools,
                                         rollout_func=run.round_spec.rollout_func)
                     for mode in held_out.modes]  # sampled as training samples
            records = score_policy(run.tokenizer, held_out.rows, range(len(held_out.rows)), held_out.encoder,
                                   grading, modes, backend=run.policy.rollouts)
        finally:
            set_rng_state(saved)
        metrics = _eval_metrics(records, run.evaluation, held_out.reward_names,
                                run.round_spec.tools is not None)
        metrics["eval/runtime"] = time.perf_counter() - start
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        metrics = broadcast_object_list([metrics])[0]
    return metrics


def _eval_metrics(records: list[dict], e: EvalOptions, reward_names: list[str],
                  tools: bool = False) -> dict[str, float]:
    import pandas as pd

    G = e.num_generations_eval
    summary = summarize_evaluation(pd.DataFrame.from_records(records), sorted({1, G}) if G else [],
                                   reward_names)
    out = {}
    for key in eval_metric_names(e, reward_names, tools):
        value = summary.get(key.removeprefix("eval/"))
        out[key] = float("nan") if value is None else float(value)
    return out


def update_best(e: EvalOptions, state: TrainState, metrics: dict) -> None:
    """Before a checkpoint is written: its step becomes the best when its metric_for_best_model beats the best
    so far (strictly: a tie keeps the earlier checkpoint, as transformers' Trainer does)."""
    key = e.best_metric
    value = metrics.get(key) if key is not None else None
    if value is None or not math.isfinite(value):
        return
    if (state.best_value is None
            or (value > state.best_value if e.greater_is_better else value < state.best_value)):
        state.best_step, state.best_value = state.step, float(value)


def load_best_weights(run: TrainingRun, state: TrainState) -> Path | None:
    """load_best_model_at_end: the best checkpoint's weights into the policy (and the sampling engine) before
    the export; returns that checkpoint, or None when the last step's weights are already the ones to
    export."""
    if not run.evaluation.load_best_model_at_end or state.best_step is None or state.best_step == state.step:
        return None
    path = run.checkpoint_dir / f"checkpoint-{state.best_step}"
    run.policy.restore_weights(path)
    return path
