"""The per-step log: a CSV with fixed columns (TRL's metric names), append-only, so a crash loses at most the
line being written and DVC can plot it directly."""

from __future__ import annotations

import csv
from pathlib import Path

from grpo_core.common.files import atomic_path
from grpo_core.evaluation import eval_metric_names
from grpo_core.train.state import TrainingRun

# the metric a loss type logs besides the clip ratios (TRL's names)
_LOSS_TYPE_METRICS = {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"]}


def metric_columns(run: TrainingRun, reward_names: list[str]) -> list[str]:
    """The CSV's columns: TRL's metric names, plus what the run switches on: the loss type's own metric,
    ``entropy_coef`` under an entropy bonus, the ``dynamic/*`` counts under dynamic sampling, ``async/*``
    under async rollouts, ``tools/*`` with tools, the ``eval/*`` metrics under evaluation during training
    (blank on steps without one)."""
    tools = run.round_spec.tools is not None
    extra = list(_LOSS_TYPE_METRICS.get(run.loss_fn.options.loss_type, []))
    if run.entropy.logged:
        extra.append("entropy_coef")
    if run.generation.backend == "vllm" and run.sampler_correction.vllm_importance_sampling_correction:
        extra += ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                  "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                  "sampling/importance_sampling_ratio/max"]
    if run.rollouts.dynamic_sampling:
        extra += ["dynamic/groups_dropped", "dynamic/generation_rounds", "dynamic/tied_groups_used"]
    if run.rollouts.async_rollouts:
        extra += ["async/staleness", "async/wait_time"]
    if tools:
        extra += ["tools/call_frequency", "tools/failure_frequency", "tools/mean_turns"]
    evaluation = ([*eval_metric_names(run.evaluation, reward_names, tools), "eval/runtime"]
                  if run.evaluation.eval_strategy == "steps" else [])
    cols = ["step", "loss", "reward", "reward_std", "frac_reward_zero_std"]
    for name in reward_names:
        cols += [f"rewards/{name}/mean", f"rewards/{name}/std"]
    cols += ["kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             *extra,
             "completions/mean_length", "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "grad_norm", "learning_rate", "reward_errors", "reward_timeouts",
             "num_tokens", "guard/skipped", "step_time", "generation_time", *evaluation]
    return cols


class StepLog:
    """Opened at ``resume_step``: the lines of later steps are dropped (they are about to be redone)."""

    def __init__(self, path: Path, columns: list[str], resume_step: int):
        self.path, self.columns = path, columns
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        if resume_step > 0 and path.exists():
            with open(path, newline="") as fh:
                kept = [r for r in csv.DictReader(fh) if r.get("step")
                        and int(float(r["step"])) <= resume_step]
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)

    def append(self, metrics: dict) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore").writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in metrics.items()})
