"""The per-step log: a CSV with fixed columns (TRL's metric names), append-only, so a crash loses at most the
line being written and DVC can plot it directly."""

from __future__ import annotations

import csv
from pathlib import Path

from grpo_core.common.files import atomic_path
from grpo_core.evaluation import eval_metric_names
from grpo_core.train.metrics import columns, undeclared
from grpo_core.train.state import TrainingRun


def switches(run: TrainingRun, *, late: bool = False) -> set[str]:
    """What the run switches on that the metric table's optional metrics hang on (``Metric.when``). The
    sampler correction's metrics come with a backend that reports its own log-probs (vLLM; others may), known
    for sure only once a round has them: with ``late``, they count whenever the correction is on."""
    on = {run.loss_fn.options.loss_type} & {"cispo", "vespo"}
    if run.entropy.logged:
        on.add("entropy_coef")
    correction = run.sampler_correction.vllm_importance_sampling_correction
    if correction and (run.generation.backend == "vllm" or late):
        on.add("sampler_correction")
    if run.rollouts.dynamic_sampling:
        on.add("dynamic_sampling")
    if run.rollouts.async_rollouts:
        on.add("async")
    if run.round_spec.tools is not None:
        on.add("tools")
    return on


def metric_columns(run: TrainingRun, reward_names: list[str], *, late: bool = False) -> list[str]:
    """The CSV's columns: the metric table's for this run (grpo_core/train/metrics.py), then the ``eval/*``
    metrics under evaluation during training (blank on steps without one). ``late``: with the columns a
    round may turn out to need (``switches``)."""
    tools = run.round_spec.tools is not None
    evaluation = ([*eval_metric_names(run.evaluation, reward_names, tools), "eval/runtime"]
                  if run.evaluation.eval_strategy == "steps" else [])
    return columns(switches(run, late=late), reward_names) + evaluation


class StepLog:
    """Opened at ``resume_step``: the lines of later steps are dropped (they are about to be redone).
    ``possible``: the columns a line may also bring (``metric_columns(late=True)``), in their order; the file
    is rewritten wider when the first line that has them comes."""

    def __init__(self, path: Path, columns: list[str], resume_step: int, possible: list[str] | None = None):
        self.path, self.columns, self.possible = path, columns, possible or columns
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        if resume_step > 0 and path.exists():
            kept = self._rows(lambda r: int(float(r["step"])) <= resume_step)
        self._write(kept)

    def _rows(self, keep) -> list[dict]:
        with open(self.path, newline="") as fh:
            return [r for r in csv.DictReader(fh) if r.get("step") and keep(r)]

    def _write(self, rows: list[dict]) -> None:
        with atomic_path(self.path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def append(self, metrics: dict) -> None:
        """One line; a metric that is not a column is an error, never dropped."""
        wider = [c for c in self.possible if c in metrics and c not in self.columns]
        if wider:
            kept = self._rows(lambda r: True)
            self.columns = [c for c in self.possible if c in self.columns or c in wider]
            self._write(kept)
        dropped = undeclared(metrics, self.columns)
        if dropped:
            raise ValueError(f"{self.path}: the metrics {dropped} are not columns of the step log; declare "
                             "them in grpo_core/train/metrics.py")
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.columns).writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in metrics.items()})
