"""What makes pipeline runs comparable in the MLflow UI.

- ``pipeline_summary(root)``: the summary metrics a *parent* run carries, read from the pipeline's outputs
  (``metrics/eval.json``, ``metrics/train_log.csv``): ``summary/accuracy_{base,trained,delta}``,
  ``summary/pass_at_<k>`` and ``summary/pass_at_<k>_delta``, ``summary/final_reward``, ``summary/final_kl``,
  ``summary/median_step_time``. One section, so the experiment's chart view compares pipelines directly.
- ``params_diff(current, baseline)``: the params.yaml keys whose values differ from the committed ones
  (``git show HEAD:params.yaml``), and ``diff_name`` - a short run name from them (``learning_rate=0.002``).
- ``prepare_experiment_view(client, experiment_id, diff_keys)``: tags the experiment as fine-tuning
  (``mlflow.experimentKind``) and stores a saved view (``mlflow.sharedViewState.grpo``) that opens the runs
  table with the summary metrics and every param that has differed so far as columns, and the chart view
  with the summary first. ``experiment_url`` is the link that opens it (``make ui`` prints it).

MLflow 3.17's UI picks its GenAI / model-training mode per browser (the sidebar switch, or the URL's
``workflowType``), not from the experiment's kind tag; the link sets ``workflowType=machine_learning``.
"""

from __future__ import annotations

import csv
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
SUMMARY = "summary"
HEADLINE = ("accuracy_trained", "accuracy_delta", "final_reward", "final_kl", "accuracy_base", "median_step_time")


# --------------------------------------------------------------------------------------------------
# the parent's summary


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
            return list(csv.DictReader(fh))
    except OSError:
        return []


def pipeline_summary(root: Path, eval_path: str | None = "metrics/eval.json",
                     train_log: str | None = "metrics/train_log.csv") -> dict[str, float]:
    """``summary/*`` metrics from the pipeline's outputs (missing outputs give fewer keys, never an error;
    None leaves that output out, e.g. training leaves out the evaluation a later stage rewrites)."""
    out: dict[str, float] = {}
    metrics = _read_json(root / eval_path) if eval_path else None
    if isinstance(metrics, dict):
        for side in ("base", "trained", "delta"):
            value = _number((metrics.get(side) or {}).get("accuracy"))
            if value is not None:
                out[f"{SUMMARY}/accuracy_{side}"] = value
        for key, value in (metrics.get("trained") or {}).items():
            if key.startswith("pass@") and _number(value) is not None:
                k = key.split("@", 1)[1]
                out[f"{SUMMARY}/pass_at_{k}"] = float(value)
                delta = _number((metrics.get("delta") or {}).get(key))
                if delta is not None:
                    out[f"{SUMMARY}/pass_at_{k}_delta"] = delta
    rows = _train_rows(root / train_log) if train_log else []
    if rows:
        for name, column in (("final_reward", "reward"), ("final_kl", "kl")):
            value = _number(rows[-1].get(column))
            if value is not None:
                out[f"{SUMMARY}/{name}"] = value
        times = [t for t in (_number(r.get("step_time")) for r in rows) if t is not None]
        if times:
            out[f"{SUMMARY}/median_step_time"] = statistics.median(times)
            out[f"{SUMMARY}/steps"] = float(len(rows))
    return out


def log_summary(client: Any, run_id: str, summary: Mapping[str, float]) -> None:
    """The summary as step-0 metrics of ``run_id`` (re-logging replaces the value the UI shows)."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    if summary:
        client.log_batch(run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in summary.items()], synchronous=True)


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
    """``learning_rate=0.002 max_steps=50``: the last part of each key unless two keys share it; cut with ``+N``."""
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
# the experiment's kind and saved view


def view_state(diff_keys: Iterable[str]) -> dict[str, Any]:
    """The saved view: runs-table columns = headline summary metrics + params that differed; chart sections with
    ``summary`` first."""
    metrics = [f"{SUMMARY}/{k}" for k in HEADLINE]
    columns = (["attributes.`Dataset`", "attributes.`Source`", "attributes.`Models`"]
               + [f"metrics.`{m}`" for m in metrics] + [f"params.`{k}`" for k in sorted(diff_keys)])
    sections = [{"uuid": f"grpo-{name}", "name": name, "display": True, "isReordered": False, "deleted": False,
                 "isGenerated": True} for name in (SUMMARY, "Model metrics", "System metrics")]
    return {"selectedColumns": columns, "compareRunSections": sections, "compareRunCharts": [],
            "isAccordionReordered": True}


def prepare_experiment_view(client: Any, experiment_id: str, diff_keys: Iterable[str] = ()) -> list[str]:
    """Tag the experiment as fine-tuning and (re)write its saved view; returns every param key that has differed."""
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
    """The runs page of the experiment, in model-training mode, with the saved view (``chart``: the chart view)."""
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
