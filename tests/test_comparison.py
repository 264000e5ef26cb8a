"""flows/comparison.py: the parent's curves and numbers from the outputs, logged once each; run names from the
params diff; the saved view; the pipelines' colors."""

from __future__ import annotations

import json
import statistics

import pytest

from flows.comparison import (
    CURVE_CHARTS,
    HEADLINE,
    RUN_COLORS,
    VIEW_TAG,
    PipelineSummary,
    column_width,
    diff_name,
    log_summary,
    next_run_color,
    params_diff,
    pipeline_summary,
    view_state,
)

EVAL = {"base": {"accuracy": 0.5, "pass@1": 0.4, "pass@4": 0.7, "num_prompts": 12},
        "trained": {"accuracy": 0.75, "pass@1": 0.6, "pass@4": 0.9, "num_prompts": 12},
        "delta": {"accuracy": 0.25, "pass@1": 0.2, "pass@4": 0.2}}
# step, reward, kl, entropy, completions/mean_length, eval/accuracy (evaluated at steps 2 and 4), step_time
LOG = ["step,reward,kl,entropy,completions/mean_length,eval/accuracy,step_time",
       "1,0.1,0.0,0.9,16.5,,2.0", "2,0.3,0.01,0.8,17.0,0.25,1.0", "3,0.6,0.02,0.7,17.5,nan,5.0",
       "4,0.7,0.03,0.6,18.0,0.5,3.0"]


def write_outputs(root, log=LOG, metrics=EVAL):
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics/eval.json").write_text(json.dumps(metrics))
    (root / "metrics/train_log.csv").write_text("\n".join(log) + "\n")


def test_summary_curves_come_from_the_train_log_and_the_held_out_evaluation(tmp_path):
    write_outputs(tmp_path)
    summary = pipeline_summary(tmp_path)
    assert summary.curves == {
        "reward": [(1, 0.1), (2, 0.3), (3, 0.6), (4, 0.7)],
        "kl": [(1, 0.0), (2, 0.01), (3, 0.02), (4, 0.03)],
        "entropy": [(1, 0.9), (2, 0.8), (3, 0.7), (4, 0.6)],
        "completions/mean_length": [(1, 16.5), (2, 17.0), (3, 17.5), (4, 18.0)],
        "eval/accuracy": [(2, 0.25), (4, 0.5)],  # the evaluation steps only: empty and NaN are no points
        # the held-out evaluation: the base policy at step 0, the trained one at the last step
        "accuracy": [(0, 0.5), (4, 0.75)], "pass_at_1": [(0, 0.4), (4, 0.6)],
        "pass_at_4": [(0, 0.7), (4, 0.9)]}
    assert summary.values == {"accuracy_gain": 0.25, "step_time": statistics.median([2.0, 1.0, 5.0, 3.0]),
                              "steps": 4.0}


def test_summary_of_missing_outputs_is_empty_and_train_only_leaves_out_the_evaluation(tmp_path):
    assert not pipeline_summary(tmp_path / "missing")  # no outputs yet: nothing, no error
    write_outputs(tmp_path)
    only_train = pipeline_summary(tmp_path, eval_path=None)
    assert set(only_train.curves) == {"reward", "kl", "entropy", "completions/mean_length", "eval/accuracy"}
    assert set(only_train.values) == {"step_time", "steps"}
    # a resumed run's log holds its steps in order; a torn last line (no step) is no point
    write_outputs(tmp_path, log=[*LOG, "not-a-step,0.9,0,0,0,,1"])
    assert pipeline_summary(tmp_path).curves["accuracy"] == [(0, 0.5), (4, 0.75)]
    write_outputs(tmp_path, metrics={"base": {"accuracy": 0.5}, "trained": {}, "delta": {}})
    assert pipeline_summary(tmp_path).curves["accuracy"] == [(
        0,
        0.5)] and "accuracy_gain" not in pipeline_summary(
                                                                  tmp_path).values


def test_summary_values_keep_six_significant_digits(tmp_path):
    base, trained = {"accuracy": 0.534, "pass@4": 0.8971428571428572}, {"accuracy": 0.836,
                                                                        "pass@4": 0.9086857142857143}
    write_outputs(tmp_path, log=[LOG[0], "1,0.1,0,0,16,,0.3212239", "2,0.2,0,0,16,,0.3212241"],
                  metrics={"base": base, "trained": trained, "delta": {"accuracy": 0.836 - 0.534}})
    summary = pipeline_summary(tmp_path)
    assert 0.836 - 0.534 == 0.30199999999999994 and summary.values["accuracy_gain"] == 0.302
    assert summary.curves["pass_at_4"] == [(0, 0.897143), (2, 0.908686)]
    assert summary.values["step_time"] == 0.321224  # the median 0.321224 of the two, rounded


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}")


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_log_summary_logs_each_curve_point_once(client):
    exp = client.create_experiment("comparison")
    run_id = client.create_run(exp).info.run_id
    train_only = PipelineSummary(curves={"reward": [(1, 0.1), (2, 0.3)]}, values={"steps": 2.0})
    assert log_summary(client, run_id, train_only) == 3
    # then the evaluate stage (and the flow at its end) log the whole pipeline's: only what is new is sent
    full = PipelineSummary(curves={"reward": [(1, 0.1), (2, 0.3)], "accuracy": [(0, 0.5), (2, 0.75)]},
                           values={"steps": 2.0, "accuracy_gain": 0.25})
    assert log_summary(client, run_id, full) == 2 + 2
    # the numbers again (at step 0 they replace), no curve point
    assert log_summary(client, run_id, full) == 2
    assert history(client, run_id, "reward") == [(1, 0.1), (2, 0.3)]
    assert history(client, run_id, "accuracy") == [(0, 0.5), (2, 0.75)]
    latest = client.get_run(run_id).data.metrics  # what the runs table shows: the curve's last point
    assert latest["accuracy"] == 0.75 and latest["reward"] == 0.3 and latest["accuracy_gain"] == 0.25
    assert log_summary(client, run_id, PipelineSummary()) == 0


def test_log_summary_sends_long_curves_in_batches_within_mlflows_limit(client):
    exp = client.create_experiment("long")
    run_id = client.create_run(exp).info.run_id
    curve = [(step, step / 2500) for step in range(1, 2501)]  # log_batch takes 1000 metrics at most
    assert log_summary(client, run_id, PipelineSummary(curves={"reward": curve})) == 2500
    assert history(client, run_id, "reward") == curve


def test_params_diff_names_changed_added_and_removed_keys():
    base = {"train": {"learning_rate": 1e-3, "max_steps": 150, "beta": 0.0}, "data": {"train_files": "a"}}
    now = {"train": {"learning_rate": 2e-3, "max_steps": 150, "seed": 7}, "data": {"train_files": "a"}}
    assert params_diff(now, base) == {"train.beta": None, "train.learning_rate": 2e-3, "train.seed": 7}
    assert params_diff(now, now) == {} and params_diff(now, None) == {}


def test_diff_name_is_short_and_keeps_ambiguous_keys_whole():
    assert (diff_name({"train.learning_rate": 0.002, "train.max_steps": 50})
            == "learning_rate=0.002 max_steps=50")
    assert diff_name({"train.seed": 1, "evaluate.seed": 2}) == "train.seed=1 evaluate.seed=2"
    long = {f"train.key_{i}": i for i in range(20)}
    name = diff_name(long, limit=40)
    assert len(name) <= 40 + 4 and name.endswith(f"+{20 - name.count('=')}")


def test_saved_view_opens_on_the_learning_curves_and_the_headline_columns():
    state = view_state(["train.learning_rate", "train.beta"])
    cols = state["selectedColumns"]
    assert cols == ["metrics.`accuracy`", "metrics.`accuracy_gain`", "metrics.`reward`", "metrics.`kl`",
                    "metrics.`step_time`", "params.`train.beta`", "params.`train.learning_rate`"]
    assert state["columnOrder"] == cols
    # 100 px (MLflow's width) holds 'accuracy_gain'; a longer param name gets a wider column
    assert all(len(m) <= 13 for m in HEADLINE)
    assert (state["columnWidths"]
            == {"params.`train.learning_rate`": 7 * 19 + 32, "params.`train.beta`": 7 * 10 + 32})
    assert column_width("model.lr") == 100 and column_width("x" * 30) == 242

    first, *rest = state["compareRunSections"]
    assert first["name"] == "learning curves" and state["isAccordionReordered"] and state["hideEmptyCharts"]
    assert [s["name"] for s in rest] == ["Model metrics"]
    charts = state["compareRunCharts"]
    assert [c["metricKey"] for c in charts] == list(CURVE_CHARTS) == [
        "reward", "accuracy", "eval/accuracy", "kl", "entropy", "completions/mean_length"]
    # a line against the step, in the first section, the same chart when the view is rewritten
    for chart in charts:
        assert (chart["type"] == "LINE" and chart["xAxisKey"] == "step"
                and chart["metricSectionId"] == first["uuid"])
        assert chart["selectedMetricKeys"] == [chart["metricKey"]] and not chart["deleted"]
    # a batch's values per step are noisy: a moving average over them; evaluations are drawn as they are
    assert {c["metricKey"]: c["lineSmoothness"] for c in charts} == {
        "reward": 90, "accuracy": 0, "eval/accuracy": 0, "kl": 90, "entropy": 90,
        "completions/mean_length": 90}
    assert not any(c["useGlobalLineSmoothing"] for c in charts)
    assert view_state(["train.learning_rate"])["compareRunCharts"] == charts
    assert VIEW_TAG == "mlflow.sharedViewState.grpo"


def test_next_run_color_differs_from_the_previous_pipelines():
    assert next_run_color(None) == RUN_COLORS[0] and next_run_color("#abcdef") == RUN_COLORS[0]
    colors = [next_run_color(None)]
    for _ in range(len(RUN_COLORS) - 1):
        colors.append(next_run_color(colors[-1]))
    assert len(set(colors)) == len(RUN_COLORS)  # ten pipelines in a row, ten colors
    assert next_run_color(colors[-1]) == colors[0]
