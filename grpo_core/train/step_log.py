"""The per-step log: a CSV with fixed columns (TRL's metric names), append-only, so a crash loses at most the
line being written and DVC can plot it directly."""

from __future__ import annotations

import csv
from pathlib import Path

from grpo_core.config import TrainConfig, eval_metric_names
from grpo_core.files import atomic_path

# the metric a loss type logs besides the clip ratios (TRL's names)
_LOSS_TYPE_METRICS = {"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"]}


def metric_columns(reward_names: list[str], t: TrainConfig | None = None, backend: str = "auto") -> list[str]:
    """The CSV's columns: TRL's metric names, plus what ``t`` switches on: the loss type's own metric,
    ``entropy_coef`` under an entropy bonus, the ``dynamic/*`` counts under dynamic sampling, ``async/*`` under
    async rollouts, ``tools/*`` with tools, the ``eval/*`` metrics under evaluation during training (blank on steps without one)."""
    t = t or TrainConfig()  # backend: generation.backend
    extra = list(_LOSS_TYPE_METRICS.get(t.loss_type, []))
    if t.entropy_coef != 0 or t.use_adaptive_entropy:
        extra.append("entropy_coef")
    if backend == "vllm" and t.vllm_importance_sampling_correction:
        extra += ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                  "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                  "sampling/importance_sampling_ratio/max"]
    if t.dynamic_sampling:
        extra += ["dynamic/groups_dropped", "dynamic/generation_rounds", "dynamic/tied_groups_used"]
    if t.async_rollouts:
        extra += ["async/staleness", "async/wait_time"]
    if t.tool_use.enabled:
        extra += ["tools/call_frequency", "tools/failure_frequency", "tools/mean_turns"]
    evaluation = ([*eval_metric_names(t.evaluation, reward_names, t.tool_use.enabled), "eval/runtime"]
                  if t.eval_strategy == "steps" else [])
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
                kept = [r for r in csv.DictReader(fh) if r.get("step") and int(float(r["step"])) <= resume_step]
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)

    def append(self, metrics: dict) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore").writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in metrics.items()})
