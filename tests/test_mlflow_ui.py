"""Comparing two pipelines the way users do: a real `mlflow server` over the store two `dvc` runs wrote
(the session's built pipeline, then `dvc exp run --temp -S train.learning_rate=0.002`), read with the client
API and opened in Debian's chromium (selenium, headless). The experiment, the server, the browser and the
pictures are flows/pictures.py's - what `make pictures` runs for the README, here on the tiny pipelines; the
pictures go to ``test-artifacts/`` at the repo root (or ``$GRPO_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import struct
from pathlib import Path

import pytest
import yaml

from flows import pictures
from flows.comparison import CURVE_CHARTS, HEADLINE, RUN_COLOR_TAG, VIEW_TAG
from flows.pictures import chromium, exp_run, logged_curves, mlflow_ui, take_pictures
from tests.test_pipeline import (
    GIT,
    REPO,
    built_pipeline,
    copy_repo,
    differing_tensors,
    dvc,
    logits_on_fixed_input,
    pipeline_env,
    run,
    stage_runs,
)

pytestmark = pytest.mark.slow
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SHOTS = Path(os.environ.get("GRPO_TEST_ARTIFACTS") or REPO / "test-artifacts")


@pytest.fixture(scope="module")
def two_pipelines(tmp_path_factory):
    """(repo, exp name): the built pipeline committed, then one `dvc exp run` with another learning rate."""
    repo = copy_repo(built_pipeline(tmp_path_factory)[0], tmp_path_factory.mktemp("compare") / "repo")
    run(repo, "git", "add", "-A")
    run(repo, *GIT, "commit", "-q", "-m", "results")
    out = exp_run(repo, "0.002")
    for stage in ("prepare", "validate", "calibrate"):
        assert f"Stage '{stage}' didn't change" in out
    assert "Running stage 'train'" in out and "Running stage 'evaluate'" in out
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    names = [e["name"] for rev in shown for e in (rev.get("experiments") or []) if e.get("name")]
    assert len(names) == 1, shown
    return repo, names[0]


@pytest.fixture(scope="module")
def server(two_pipelines, tmp_path_factory):
    """`mlflow server` on 127.0.0.1 over the repo's sqlite store; yields its URL."""
    repo, _ = two_pipelines
    log = tmp_path_factory.mktemp("mlflow-server") / "server.log"
    with mlflow_ui(f"sqlite:///{repo / 'mlflow.db'}", log, env=pipeline_env()) as url:
        yield url


def client_for(url: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=url)


def parents(client) -> dict[str, object]:
    exp = client.get_experiment_by_name("grpo-pipeline")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`grpo.role` = 'pipeline'")
    return {r.info.run_name: r for r in runs}


def children(client, parent) -> dict[str, object]:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags["stage"]: r for r in runs}


def built_commit(repo: Path) -> str:
    """The commit the built pipeline ran at (the clone's first;
    `two_pipelines` commits the results on top)."""
    return run(repo, "git", "rev-list", "--max-parents=0", "HEAD").stdout.strip()


def six(value: float) -> float:
    """6 significant digits, what the parent keeps."""
    return float(f"{value:.6g}")


def history(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def train_log(repo: Path) -> list[dict]:
    with open(repo / "metrics/train_log.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# --------------------------------------------------------------------------------------------------
# client API against the server


def test_parents_carry_names_summary_params_datasets_and_source(two_pipelines, server):
    repo, exp_name = two_pipelines
    client = client_for(server)
    sha, head = built_commit(repo), run(repo, "git", "rev-parse", "HEAD").stdout.strip()
    by_name = parents(client)
    assert set(by_name) == {f"baseline {sha[:7]}", exp_name}  # what changed, or that nothing did
    base, exp = by_name[f"baseline {sha[:7]}"], by_name[exp_name]

    # the baseline's curves and numbers are its outputs', worked out here from the files
    metrics, rows = json.loads((repo / "metrics/eval.json").read_text()), train_log(repo)
    last = int(rows[-1]["step"])
    for key in ("reward", "kl", "entropy", "completions/mean_length"):  # each step's, as in the train log
        assert history(client, base, key) == [(int(r["step"]), float(r[key])) for r in rows]
    # the held-out evaluation: the base policy at step 0, the trained one at the last step
    # (6 significant digits)
    assert history(client, base, "accuracy") == [(0, six(metrics["base"]["accuracy"])),
                                                 (last, six(metrics["trained"]["accuracy"]))]
    for k in (1, 2, 4):
        assert history(client, base, f"pass_at_{k}") == [(0, six(metrics["base"][f"pass@{k}"])),
                                                          (last, six(metrics["trained"][f"pass@{k}"]))]
    latest = base.data.metrics  # what the runs table shows: the final reward and KL, the trained accuracy
    assert latest["reward"] == float(rows[-1]["reward"]) and latest["kl"] == float(rows[-1]["kl"])
    assert latest["accuracy"] == six(metrics["trained"]["accuracy"])
    assert latest["accuracy_gain"] == six(metrics["delta"]["accuracy"]) and latest["steps"] == len(rows)
    assert latest["step_time"] == six(statistics.median(float(r["step_time"]) for r in rows))
    assert set(exp.data.metrics) == set(latest)
    # another learning rate moves the policy otherwise (the tiny model earns no reward: its reward curves are
    # zeros)
    assert history(client, exp, "kl") != history(client, base, "kl")
    # two colors, the second the one after the first
    assert base.data.tags[RUN_COLOR_TAG] != exp.data.tags[RUN_COLOR_TAG]

    # the params that differ, named and recorded; the changed value is a param of the parent
    assert json.loads(exp.data.tags["grpo.params_diff"]) == {"train.learning_rate": 0.002}
    assert json.loads(base.data.tags["grpo.params_diff"]) == {}
    assert (exp.data.params["train.learning_rate"] == "0.002"
            and base.data.params["train.learning_rate"] == "0.001")
    assert exp.data.tags["dvc.exp_name"] == exp_name

    # datasets: the validated files with their DVC hashes
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    dvc_md5 = {o["path"]: o["md5"] for o in lock["stages"]["validate"]["outs"]}
    for parent, commit in ((base, sha), (exp, head)):
        inputs = {i.dataset.name: i for i in parent.inputs.dataset_inputs}
        assert set(inputs) == {"train", "eval"}
        assert inputs["train"].dataset.digest == dvc_md5["data/validated/train.parquet"]
        assert inputs["eval"].dataset.digest == dvc_md5["data/validated/eval.parquet"]
        assert {t.value for t in inputs["train"].tags} == {"training"}
        assert json.loads(inputs["train"].dataset.profile)["num_rows"] == 48
        assert parent.data.tags["mlflow.source.git.commit"] == commit
        assert parent.data.tags["mlflow.source.name"] == "dvc.yaml"
        assert parent.info.status == "FINISHED"

    exp_meta = client.get_experiment(base.info.experiment_id)
    assert exp_meta.tags["mlflow.experimentKind"] == "finetuning"
    view = json.loads(json.loads(exp_meta.tags[VIEW_TAG])["state"])
    assert view["selectedColumns"] == [f"metrics.`{m}`" for m in HEADLINE] + ["params.`train.learning_rate`"]
    assert [c["metricKey"] for c in view["compareRunCharts"]] == list(CURVE_CHARTS)


def test_train_run_leads_with_reward_and_kl_and_the_model_is_logged_and_registered(two_pipelines, server,
                                                                                   monkeypatch):
    import mlflow
    import torch
    from mlflow.models import Model
    from safetensors.torch import load_file

    repo, _ = two_pipelines
    client = client_for(server)
    sha = built_commit(repo)
    runs = children(client, parents(client)[f"baseline {sha[:7]}"])
    assert set(runs) == {"prepare", "validate", "calibrate", "train", "evaluate", "export"}
    train = runs["train"]
    rewards = [float(r["reward"]) for r in train_log(repo)]
    headline = [m.value for m in sorted(client.get_metric_history(train.info.run_id, "0_overview/reward"),
                                        key=lambda m: m.step)]
    assert headline == [
        m.value for m in sorted(client.get_metric_history(train.info.run_id, "reward"), key=lambda m: m.step)]
    assert headline == pytest.approx(rewards, rel=1e-5, abs=1e-12)  # the train log: 6 significant digits
    assert len(client.get_metric_history(train.info.run_id, "0_overview/kl")) == len(rewards)

    evaluate = runs["evaluate"]
    (output,) = evaluate.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.source_run_id == evaluate.info.run_id and logged.status.value == "READY"
    (version,) = [v for v in client.search_model_versions("name = 'grpo-policy'")
                  if v.run_id == evaluate.info.run_id]
    assert version.source == f"models:/{logged.model_id}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)  # what a user downloading from the team's server sets
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", server)
    folder = Path(mlflow.artifacts.download_artifacts(f"models:/grpo-policy/{version.version}"))
    # the registered version is the baseline pipeline's exported model, tensor for tensor (dvc exp run --temp
    # left the workspace's artifacts/model as the baseline wrote it)
    exported = repo / "artifacts/model"
    registered = load_file(folder / "model.safetensors")
    assert differing_tensors(registered, load_file(exported / "model.safetensors")) == []
    torch.testing.assert_close(logits_on_fixed_input(folder), logits_on_fixed_input(exported), rtol=0, atol=0)
    signature = Model.load(str(folder / "MLmodel")).signature
    assert signature.inputs.input_names() == ["prompt"] and signature.outputs.input_names() == ["completion"]


def test_exp_run_logs_its_stages_under_its_own_parent(two_pipelines, server):
    repo, exp_name = two_pipelines
    client = client_for(server)
    exp_runs = children(client, parents(client)[exp_name])
    assert set(exp_runs) == {"train", "evaluate", "export"}  # DVC re-ran just what the param feeds
    train = exp_runs["train"]
    assert train.data.params["train.learning_rate"] == "0.002" and train.data.tags["dvc.exp_name"] == exp_name
    assert train.data.tags["train.checkpoints"] == "fresh"  # new params: no resume from the old checkpoints
    assert len(stage_runs(repo)) == 2 + 6 + 3


# --------------------------------------------------------------------------------------------------
# a real browser


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are not installed (apt-get install chromium "
                        "chromium-driver)")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    with chromium() as driver:
        yield driver


def wait_for(driver, condition, what: str, timeout: float = 90.0, shot: str | None = None):
    """flows.pictures.wait_for, and a screenshot of the page it gave up on (``shot``)."""
    try:
        return pictures.wait_for(driver, condition, what, timeout)
    except pictures.PicturesError:
        if shot:
            driver.save_screenshot(str(SHOTS / f"FAILED-{shot}"))
        raise


def test_browser_overlays_the_two_pipelines_learning_curves_in_the_pictures(two_pipelines, server, browser):
    """What `make pictures` checks and shoots, checked here against the store: the runs table with a row per
    pipeline and no column name cut, and the chart view's learning curves, a curve per pipeline with its
    values."""
    repo, exp_name = two_pipelines
    client = client_for(server)
    by_name = parents(client)
    base_name = f"baseline {built_commit(repo)[:7]}"
    exp_id = by_name[base_name].info.experiment_id
    names = [base_name, exp_name]

    curves = logged_curves(set(by_name[n].data.metrics) for n in names)
    assert set(curves) == set(CURVE_CHARTS) - {"eval/accuracy"}  # no in-training evaluation: no chart for it
    pictures = take_pictures(browser, server, exp_id, names, curves, SHOTS)

    headers = [h["text"] for h in pictures.headers]
    assert (set(HEADLINE) | {"train.learning_rate"} <= set(headers)
            and not any(h["cut"] for h in pictures.headers))
    assert headers.index("accuracy") < headers.index("train.learning_rate")
    charts = pictures.charts
    assert set(charts) == set(CURVE_CHARTS) - {"eval/accuracy"}  # no in-training evaluation: no chart for it
    for title, chart in charts.items():  # each chart draws the two pipelines' curves,
                                         # as the parents logged them
        assert set(chart.curves) == set(names)
        for name in names:
            assert chart.curves[name] == [(float(s), v) for s, v in history(client, by_name[name], title)]
    kl = charts["kl"].curves  # two curves, with different values
    assert kl[base_name] != kl[exp_name] and len(kl[base_name]) == len(kl[exp_name]) == len(train_log(repo))
    for path in pictures.files:  # PNGs (the header's IHDR chunk holds the size) of a 1600 px wide page
        head = path.read_bytes()[:24]
        width, height = struct.unpack(">II", head[16:24])
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and width == 1600 and height >= 400
    assert [p.name for p in pictures.files] == ["mlflow-runs.png", "mlflow-charts.png"]


def test_train_run_page_opens_on_reward_and_kl(two_pipelines, server, browser):
    repo, _ = two_pipelines
    client = client_for(server)
    train = children(client, parents(client)[f"baseline {built_commit(repo)[:7]}"])["train"]
    browser.get(f"{server}/#/experiments/{train.info.experiment_id}/runs/{train.info.run_id}/model-metrics")
    body = lambda d: d.find_element("tag name", "body").text  # noqa: E731
    wait_for(browser, lambda d: "0_overview" in body(d), "the overview section", shot="train.png")
    text = body(browser)
    assert text.index("0_overview") < text.index("clip_ratio")  # reward and KL before the clip ratios
    browser.save_screenshot(str(SHOTS / "mlflow-train-run.png"))
