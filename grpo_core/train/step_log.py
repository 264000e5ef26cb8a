"""The per-step log: a CSV with fixed columns (TRL's metric names), append-only, so a crash loses at most the
line being written and DVC can plot it directly."""

from __future__ import annotations

import csv
from pathlib import Path

from grpo_core.common.files import atomic_path
from grpo_core.evaluation import eval_metric_names
from grpo_core.train.metrics import columns, undeclared
from grpo_core.train.state import TrainingRun


def switches(run: TrainingRun) -> set[str]:
    """What the run switches on that the metric table's optional metrics hang on (``Metric.when``)."""
    on = {run.loss_fn.options.loss_type} & {"cispo", "vespo"}
    if run.entropy.logged:
        on.add("entropy_coef")
    if run.generation.backend == "vllm" and run.sampler_correction.vllm_importance_sampling_correction:
        on.add("sampler_correction")
    if run.rollouts.dynamic_sampling:
        on.add("dynamic_sampling")
    if run.rollouts.async_rollouts:
        on.add("async")
    if run.round_spec.tools is not None:
        on.add("tools")
    return on


def metric_columns(run: TrainingRun, reward_names: list[str]) -> list[str]:
    """The CSV's columns: the metric table's for this run (grpo_core/train/metrics.py), then the ``eval/*``
    metrics under evaluation during training (blank on steps without one)."""
    tools = run.round_spec.tools is not None
    evaluation = ([*eval_metric_names(run.evaluation, reward_names, tools), "eval/runtime"]
                  if run.evaluation.eval_strategy == "steps" else [])
    return columns(switches(run), reward_names) + evaluation


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
        """One line; a metric that is not a column is an error, never dropped."""
        dropped = undeclared(metrics, self.columns)
        if dropped:
            raise ValueError(f"{self.path}: the metrics {dropped} are not columns of the step log; declare "
                             "them in grpo_core/train/metrics.py")
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.columns).writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in metrics.items()})
