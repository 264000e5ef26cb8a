"""flows/pictures.py without a browser: when the chart view counts as drawn, when the pictures would show
nothing to compare, and what `make pictures` says about a store it cannot picture. tests/test_mlflow_ui.py
runs it in chromium."""

from __future__ import annotations

import shutil

import pytest

from flows.pictures import Chart, PicturesError, check_curves, curve_charts, logged_curves, main, read_charts

NAMES = ["baseline abc1234", "learning_rate=0.0001"]


def chart(title, *curves):
    return Chart(title, dict(zip(NAMES, curves)))


def test_the_chart_view_is_drawn_once_every_curve_chart_has_every_pipelines_curve():
    reward = chart("reward", [(1, 0.1), (2, 0.3)], [(1, 0.1), (2, 0.2)])
    kl = chart("kl", [(1, 0.0), (2, 0.01)], [(1, 0.0), (2, 0.02)])
    entropy = chart("entropy", [(1, 0.9), (2, 0.8)], [(1, 0.9), (2, 0.7)])
    loading = chart("accuracy", [(0, 0.5), (2, 0.7)])  # the second pipeline's curve not drawn yet
    bars = Chart("step_time", {n: [(0, 1.0)] for n in NAMES})  # not a learning curve: not waited for
    curves = ("reward", "kl", "entropy")
    assert curve_charts([reward, kl, entropy, bars], NAMES, curves) == {"reward": reward, "kl": kl,
                                                                        "entropy": entropy}
    assert curve_charts([reward, kl, entropy, loading], NAMES, curves) == {}
    assert curve_charts([reward, kl], NAMES, curves) == {}  # the entropy chart not on the page yet
    one_point = chart("kl", [(1, 0.0)], [(1, 0.0)])
    assert curve_charts([reward, one_point, entropy], NAMES, curves) == {}


def test_the_charts_waited_for_are_the_curves_every_pipeline_logged():
    baseline = {"reward", "kl", "entropy", "accuracy", "completions/mean_length", "eval/accuracy",
                "step_time"}
    experiment = baseline - {"eval/accuracy"}  # evaluated only at the end
    assert logged_curves([baseline, experiment]) == ("reward", "accuracy", "kl", "entropy",
                                                     "completions/mean_length")
    assert logged_curves([baseline]) == ("reward", "accuracy", "eval/accuracy", "kl", "entropy",
                                         "completions/mean_length")
    assert logged_curves([{"step_time"}, baseline]) == ()


class Page:
    """What CHARTS_JS returns for a page: two charts as MLflow 3.17 draws them."""

    def execute_script(self, script):
        def trace(name, y, hover, metric="reward"):
            return {"name": name, "metric": metric, "hover": hover, "x": [1, 2, 3], "y": y}

        # each run: its moving average, then its raw values (faded)
        smoothed = {"title": "reward", "traces": [
            trace(NAMES[0], [0.1, 0.2, 0.25], "none"), trace(NAMES[0], [0.1, 0.3, 0.3], "skip"),
            trace(NAMES[1], [0.1, 0.1, 0.15], "none"), trace(NAMES[1], [0.1, 0.1, 0.2], "skip")]}
        plain = {"title": "accuracy", "traces": [trace(NAMES[0], [0.5, 0.6, 0.7], "none", "accuracy"),
                                                 trace(NAMES[0], [0.5, 0.6, 0.7], "none", "accuracy")]}
        return [smoothed, plain]


def test_charts_are_read_as_logged_not_as_smoothed():
    reward, accuracy = read_charts(Page())
    assert reward == Chart("reward",
                           {NAMES[0]: [(1, 0.1), (2, 0.3), (3, 0.3)],
                            NAMES[1]: [(1, 0.1), (2, 0.1), (3, 0.2)]})
    assert accuracy == Chart("accuracy", {NAMES[0]: [(1, 0.5), (2, 0.6), (3, 0.7)]})


def test_pictures_of_equal_curves_are_refused():
    differ = {"reward": chart("reward", [(1, 0.0), (2, 0.0)], [(1, 0.0), (2, 0.0)]),
              "kl": chart("kl", [(1, 0.0), (2, 0.01)], [(1, 0.0), (2, 0.02)])}
    check_curves(differ, NAMES)  # the reward curves agree (the tiny model earns none), the KL curves do not
    same = {t: chart(t, c.curves[NAMES[0]], c.curves[NAMES[0]]) for t, c in differ.items()}
    with pytest.raises(PicturesError, match="drew the same curves in every chart"):
        check_curves(same, NAMES)


def test_pictures_of_a_store_without_two_pipelines_say_so(tmp_path):
    from tests.test_pipeline import REPO

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with pytest.raises(PicturesError,
                       match="no experiment 'grpo-pipeline' at sqlite:///.*did the pipeline run"):
        main(["--repo", str(tmp_path), "--no-runs"])

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("grpo-pipeline")
    client.create_run(exp, run_name="baseline abc1234", tags={"grpo.role": "pipeline"})
    client.create_run(exp, run_name="calibrate", tags={"grpo.role": "stage"})
    with pytest.raises(PicturesError, match="holds 1 pipeline run.*compare two"):
        main(["--repo", str(tmp_path), "--no-runs"])
