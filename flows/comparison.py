"""What makes pipeline runs comparable in the MLflow UI.

- ``pipeline_summary(root)``: what a *parent* run carries, read from the pipeline's outputs
  (``metrics/eval.json``, ``metrics/train_log.csv``) as a ``PipelineSummary``:

  - learning curves (logged with their steps, so the UI draws them as lines): ``reward``, ``kl``, ``entropy``,
    ``completions/mean_length`` per training step and ``eval/accuracy`` per in-training evaluation (the train
    log's names, as on the train run); ``accuracy`` and ``pass_at_<k>``, the held-out evaluation, at
    step 0 (the base policy) and at the last training step (the trained policy). A curve's last point is what
    the runs table shows: the final reward and KL, the trained policy's accuracy.
  - single numbers (logged at step 0, drawn as one bar per pipeline): ``accuracy_gain`` (trained - base),
    ``step_time`` (median seconds per step), ``steps``.

  ``log_summary`` logs it on the parent; it never logs a point twice, so every stage (and the Prefect flow at
  its end) can call it with whatever outputs exist by then.
- ``params_diff(current, baseline)``: the params.yaml keys whose values differ from the committed ones
  (``git show HEAD:params.yaml``), and ``diff_name`` - a short run name from them (``learning_rate=0.002``).
- ``prepare_experiment_view(client, experiment_id, diff_keys)``: tags the experiment as fine-tuning
  (``mlflow.experimentKind``) and stores a saved view (``mlflow.sharedViewState.grpo``) that opens the runs
  table with the headline metrics and every param that has differed so far as columns (wide enough for their
  names), and the chart view on the learning curves of the pipelines side by side. ``experiment_url`` is the
  link that opens it (``make ui`` prints it).

MLflow 3.17's chart view draws a metric as a line when a run's latest value of it has a step >= 1, as bars
otherwise; it titles a chart with the metric's key and keeps the sections (and the charts in them) of the
saved view in their order, adding charts for metrics the view does not name in sections named by the key's
prefix (unprefixed: "Model metrics"); charts with no data are hidden. MLflow 3.17's UI picks its
GenAI / model-training mode per browser (the sidebar switch, or the URL's ``workflowType``), not from the
experiment's kind tag; the link sets ``workflowType=machine_learning``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "finetuning"  # shared/CONTRACT.md: the UI opens on model training
VIEW_ID = "grpo"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_ID}"
DIFF_KEYS_TAG = "grpo.params_differed"  # every params.yaml key that has differed in a run, JSON list
TRAIN_CURVES = ("reward", "kl", "entropy", "completions/mean_length", "eval/accuracy")  # train log columns
ACCURACY = "accuracy"  # the held-out evaluation's accuracy: step 0 the base policy,
                       # the last step the trained one
# the chart view's first section, in this order (a chart whose metric no run has is hidden: eval/accuracy
# without in-training evaluation)
CURVES_SECTION = "learning curves"
CURVE_CHARTS = ("reward", ACCURACY, "eval/accuracy", "kl", "entropy", "completions/mean_length")
# per-step values are one batch's each, noisy: their charts draw a moving average (~10 steps) over the raw
# values; the evaluations' points are drawn as they are
SMOOTHED = ("reward", "kl", "entropy", "completions/mean_length")
SMOOTHNESS = 90
# the runs table's metric columns; a metric column is 100 px wide in MLflow 3.17, room for about 15 characters
HEADLINE = (ACCURACY, "accuracy_gain", "reward", "kl", "step_time")
# a run's color in the UI's table and charts (the UI's color picker writes it too)
RUN_COLOR_TAG = "mlflow.runColor"
RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
              "#bcbd22", "#7f7f7f")  # matplotlib's tab10, grey last


# --------------------------------------------------------------------------------------------------
# the parent's summary


@dataclasses.dataclass(frozen=True)
class PipelineSummary:
    """What a parent run carries: curves (metric -> [(step, value)], steps ascending) and single numbers
    (step 0)."""

    curves: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    values: dict[str, float] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.curves or self.values)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number else None  # NaN: not logged


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _train_rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as fh:
            return [row for row in csv.DictReader(fh) if _number(row.get("step")) is not None]
    except OSError:
        return []


def pipeline_summary(root: Path, eval_path: str | None = "metrics/eval.json",
                     train_log: str | None = "metrics/train_log.csv") -> PipelineSummary:
    """The parent's curves and numbers from the pipeline's outputs (missing outputs give fewer keys, never an
    error; None leaves that output out, e.g. training leaves out the evaluation a later stage rewrites)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    values: dict[str, float] = {}
    rows = _train_rows(root / train_log) if train_log else []
    for column in TRAIN_CURVES:  # eval/accuracy has a value at evaluation steps only
        points = [(int(float(r["step"])), v) for r in rows if (v := _number(r.get(column))) is not None]
        if points:
            curves[column] = points
    times = [t for t in (_number(r.get("step_time")) for r in rows) if t is not None]
    if times:
        values["step_time"] = statistics.median(times)
    if rows:
        values["steps"] = float(len(rows))

    metrics = _read_json(root / eval_path) if eval_path else None
    if isinstance(metrics, dict):
        base, trained = metrics.get("base") or {}, metrics.get("trained") or {}
        # the trained policy is the last step's
        last = max(int(float(r["step"])) for r in rows) if rows else 1
        for key in ("accuracy", *(k for k in trained if k.startswith("pass@"))):
            name = key.replace("pass@", "pass_at_")
            points = [(step, v) for step, side in ((0, base), (last, trained))
                      if (v := _number(side.get(key))) is not None]
            if points:
                curves[name] = points
        gain = _number((metrics.get("delta") or {}).get("accuracy"))
        if gain is not None:
            values["accuracy_gain"] = gain
    return PipelineSummary(curves={k: [(step, _rounded(v)) for step, v in points]
                                   for k, points in curves.items()},
                           values={k: _rounded(v) for k, v in values.items()})


def _rounded(value: float) -> float:
    """``value`` to 6 significant digits, as the train log writes its values: a runs-table cell shows ~10
    characters, and eval.json's 0.836 - 0.534 is 0.30199999999999994."""
    return float(f"{value:.6g}")


def log_summary(client: Any, run_id: str, summary: PipelineSummary) -> int:
    """Log ``summary`` on ``run_id``: each curve point whose step that metric does not have yet (a stage, then
    the flow, may log the same outputs again), and the numbers at step 0 (re-logging replaces the value the UI
    shows). Returns the number of values sent."""
    from mlflow.entities import Metric

    from flows.tracking import BATCH_METRICS

    ts = int(time.time() * 1000)
    metrics = [Metric(k, float(v), ts, 0) for k, v in summary.values.items()]
    for key, points in summary.curves.items():
        logged = {m.step for m in client.get_metric_history(run_id, key)}
        metrics += [Metric(key, float(v), ts, step) for step, v in points if step not in logged]
    for start in range(0, len(metrics), BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[start:start + BATCH_METRICS], synchronous=True)
    return len(metrics)


# --------------------------------------------------------------------------------------------------
# names from what changed


def flatten_yaml(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"train.learning_rate": 0.002, ...}; lists are leaves (compared whole)."""
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten_yaml(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data} if prefix else {}


def params_diff(current: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> dict[str, Any]:
    """Flattened keys of ``current`` whose value differs from ``baseline`` (a key only one side has counts;
    a removed key maps to None). Empty when there is no baseline."""
    if baseline is None:
        return {}
    now, base = flatten_yaml(current), flatten_yaml(baseline)
    return {k: now.get(k) for k in sorted(set(now) | set(base)) if now.get(k) != base.get(k)}


def _short_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 24 else text[:23] + "…"


def diff_name(diff: Mapping[str, Any], limit: int = 80) -> str:
    """``learning_rate=0.002 max_steps=50``: the last part of each key unless two keys share it;
    cut with ``+N``."""
    leaves = [k.rsplit(".", 1)[-1] for k in diff]
    parts = [f"{leaf if leaves.count(leaf) == 1 else key}={_short_value(value)}"
             for key, leaf, value in zip(diff, leaves, diff.values())]
    name = ""
    for i, part in enumerate(parts):
        more = f" +{len(parts) - i}"
        if name and len(name) + 1 + len(part) + (len(more) if i < len(parts) - 1 else 0) > limit:
            return name + more
        name = f"{name} {part}".strip()
    return name


# --------------------------------------------------------------------------------------------------
# the experiment's kind, its saved view, the pipelines' colors


def next_run_color(previous: str | None) -> str:
    """The color after ``previous`` (the newest pipeline's) in ``RUN_COLORS``: the last ten pipelines never
    share one. Without it MLflow colors a run by a hash of its id, and two pipelines compared may get the same
    color."""
    i = RUN_COLORS.index(previous) + 1 if previous in RUN_COLORS else 0
    return RUN_COLORS[i % len(RUN_COLORS)]


def _line_chart(metric: str, section: str, smoothness: int) -> dict[str, Any]:
    """A line chart of ``metric`` against the step, as MLflow 3.17's chart view stores one
    (RunsChartsLineCardConfig); its uuid is derived from the metric so that rewriting the view keeps the same
    charts. ``smoothness`` (0-100): the UI draws an exponential moving average of weight smoothness/101 over
    the raw values, which it shows faded."""
    return {"uuid": f"grpo-chart-{metric}", "type": "LINE", "metricKey": metric,
            "selectedMetricKeys": [metric], "metricSectionId": section, "isGenerated": False,
            "deleted": False, "runsCountToCompare": 10, "xAxisKey": "step", "xAxisScaleType": "linear",
            "scaleType": "linear", "lineSmoothness": smoothness,
            "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False, "range": {}}


def column_width(name: str) -> int:
    """Pixels for a runs-table column headed ``name``: 7 a character (MLflow 3.17's header font averages ~5.5;
    wide letters need more) plus padding and the sort arrow, and at least MLflow's default 100."""
    return max(100, 7 * len(name) + 32)


def view_state(diff_keys: Iterable[str]) -> dict[str, Any]:
    """The saved view: runs-table columns = headline metrics + params that differed (in that order, each wide
    enough for its name); the chart view's first section the learning curves (``CURVE_CHARTS``), then MLflow's
    own."""
    columns = [f"metrics.`{m}`" for m in HEADLINE] + [f"params.`{k}`" for k in sorted(diff_keys)]
    widths = {f"params.`{k}`": column_width(k) for k in diff_keys if column_width(k) > 100}
    curves = "grpo-curves"
    sections = [{"uuid": curves, "name": CURVES_SECTION, "display": True, "isReordered": True,
                 "deleted": False, "isGenerated": False},
                {"uuid": "grpo-model-metrics", "name": "Model metrics", "display": True, "isReordered": False,
                 "deleted": False, "isGenerated": True}]
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths,
            "compareRunSections": sections,
            "compareRunCharts": [_line_chart(m, curves, SMOOTHNESS if m in SMOOTHED else 0)
                                 for m in CURVE_CHARTS],
            "isAccordionReordered": True, "hideEmptyCharts": True}


def prepare_experiment_view(client: Any, experiment_id: str, diff_keys: Iterable[str] = ()) -> list[str]:
    """Tag the experiment as fine-tuning and (re)write its saved view;
    returns every param key that has differed."""
    exp = client.get_experiment(experiment_id)
    known = json.loads(exp.tags.get(DIFF_KEYS_TAG) or "[]")
    keys = sorted(set(known) | set(diff_keys))
    now = int(time.time() * 1000)
    view = {"name": "GRPO pipelines", "createdAt": now, "updatedAt": now,
            "state": json.dumps(view_state(keys))}
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    client.set_experiment_tag(experiment_id, DIFF_KEYS_TAG, json.dumps(keys))
    client.set_experiment_tag(experiment_id, VIEW_TAG, json.dumps(view))
    return keys


def experiment_url(ui_url: str, experiment_id: str, chart: bool = False) -> str:
    """The runs page of the experiment, in model-training mode, with the saved view
    (``chart``: the chart view)."""
    mode = "&compareRunsMode=CHART" if chart else ""
    return (f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&viewStateShareKey={VIEW_ID}{mode}")


def main() -> int:
    """``python -m flows.comparison``: print the link ``make ui`` opens (the experiment of params.yaml)."""
    import os

    from mlflow import MlflowClient

    from flows.stages.common import find_repo_root, load_params
    from flows.tracking import resolve_tracking_uri, ui_url

    root = find_repo_root()
    cfg = load_params(root / "params.yaml")
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, root)
    name = (os.environ.get("GRPO_EXPERIMENT_NAME") or "").strip() or cfg.tracking.experiment_name
    exp = MlflowClient(tracking_uri=uri).get_experiment_by_name(name)
    if exp is None:
        print(f"No runs yet in experiment '{name}' at {uri}: run `make repro` first.")
    else:
        print(f"Pipelines side by side: {experiment_url(ui_url(uri), exp.experiment_id)}")
        print(f"Their charts:           {experiment_url(ui_url(uri), exp.experiment_id, chart=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
